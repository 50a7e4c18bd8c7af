//! taskbox-core: the native backend, the decorators, and the seams every backend shares.
//!
//! What it owns itself:
//! - the native backend: one-shot runs ([`native`]) and long-lived sandboxes ([`sandbox`]), which
//!   hand a complete plan to the synchronous `taskbox-init` helper, with the host view or an image
//!   as the root ([`image`], [`image_view`]), and resource limits ([`cgroup`]);
//! - what a backend needs around a sandbox: the disk quota ([`disk`], over [`loopdev`]), the
//!   host directories that are never a workspace and always masked ([`hostdirs`]), and the seam
//!   to the egress proxy ([`egress`]: how a backend starts one per sandbox, hands it the
//!   sandbox's listener, and turns its decisions into each exec's violations and network
//!   activity);
//! - the decorators over any backend: the command policy and the execs waiting for a person's
//!   approval ([`approvals`]), and the router over several backends ([`router`]);
//! - the runtime assembled once ([`runtime`]): the backends, the router, the command policy and
//!   the trace recorder stacked in one order, for every surface.
//!
//! The crates below it are re-exported under their old module names, so `taskbox_core::api`
//! and the rest stay valid paths: the contract (`taskbox-contract`: [`api`], [`result`],
//! [`exec_limits`]), policies (`taskbox-policy`: [`policy`], [`commands`], [`shell`],
//! [`netpattern`]), the workspace (`taskbox-workspace`: [`changes`], [`layers`], [`fsops`],
//! [`capture`], [`tree`]) and traces (`taskbox-trace`: [`trace`], [`trace_html`], [`replay`]).

pub mod approvals;
pub mod cgroup;
pub mod disk;
pub mod egress;
pub mod hostdirs;
pub mod image;
pub mod image_view;
pub mod kit;
pub mod loopdev;
pub mod native;
pub mod router;
pub mod runtime;
pub mod sandbox;

pub use taskbox_contract::{api, exec_end, exec_limits, exec_plan, result};
pub use taskbox_policy::{self as policy, commands, netpattern, shell};
pub use taskbox_trace::{replay, trace, trace_html};
pub use taskbox_workspace::{capture, changes, fsops, layers, tree};
