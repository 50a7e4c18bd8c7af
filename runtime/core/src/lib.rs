//! taskbox-core: the runtime's core.
//!
//! It owns the policy model ([`policy`], with the host patterns of its `[network]` rules in
//! [`netpattern`]), the observations agents see ([`result`]), bounded output
//! capture ([`capture`]), the workspace overlay and its changes and diffs ([`changes`], read
//! through descriptors that never follow a symlink out of a layer: [`tree`]), resource
//! limits ([`cgroup`]) and the native backend's one-shot runs ([`native`]), which hand a complete
//! plan to the synchronous `taskbox-init` helper, with the host view or an image as the root
//! ([`image`], [`image_view`]). The command policy is [`commands`] (rules and their check, over
//! the static shell reading of [`shell`]), enforced over any backend by [`approvals`], which
//! also holds the execs waiting for a person's approval. [`egress`] is the seam to the egress proxy (`taskbox-egress`):
//! how a backend starts one per sandbox, hands it the sandbox's listener, and turns its decisions
//! into each exec's violations and network activity. [`exec_limits`] refuses, on every backend, a
//! command execve would not take.

pub use taskbox_contract::api;
pub mod approvals;
pub use taskbox_workspace::capture;
pub mod cgroup;
pub use taskbox_policy::commands;
pub use taskbox_workspace::changes;
pub mod disk;
pub mod egress;
pub use taskbox_contract::exec_limits;
pub use taskbox_workspace::fsops;
pub mod hostdirs;
pub mod image;
pub mod image_view;
pub use taskbox_workspace::layers;
pub mod loopdev;
pub mod native;
pub use taskbox_policy as policy;
pub use taskbox_policy::netpattern;
pub mod replay;
pub use taskbox_contract::result;
pub mod router;
pub mod sandbox;
pub use taskbox_policy::shell;
pub mod trace;
pub mod trace_html;
pub use taskbox_workspace::tree;
