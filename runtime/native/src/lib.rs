//! taskbox-native: the native backend. One-shot runs ([`native`]) and long-lived sandboxes
//! ([`sandbox`]) hand a complete plan to the synchronous `taskbox-init` helper, which confines
//! the command with namespaces, Landlock and seccomp, on the host view or with an image as the
//! root ([`image_view`]), under resource limits ([`cgroup`]). Long-lived sandboxes are a
//! `Backend` of the kit (`taskbox-kit`), which gives them the whole `SandboxApi`.

pub mod cgroup;
pub mod image_view;
pub mod native;
pub mod sandbox;
mod spawn;

// The crates below, under the names the modules use.
pub(crate) use taskbox_contract::{accounts, api, exec_end, exec_limits, result};
pub(crate) use taskbox_kit::{self as kit, disk, egress, hostdirs, image};
pub(crate) use taskbox_policy as policy;
pub(crate) use taskbox_workspace::{capture, changes, fsops};
