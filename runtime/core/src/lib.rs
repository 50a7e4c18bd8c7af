//! taskbox-core: the decorators over any backend and the runtime assembled from them, over the
//! crates below, which it re-exports under their module names.
//!
//! What it owns itself:
//! - the decorators over any backend: the command policy and the execs waiting for a person's
//!   approval ([`approvals`]), and the router over several backends ([`router`]);
//! - the runtime assembled once ([`runtime`]): the backends, the router, the command policy and
//!   the trace recorder stacked in one order, for every surface.
//!
//! The crates below it are re-exported under their old module names, so `taskbox_core::api`
//! and the rest stay valid paths: the backend kit and the seams backends share
//! (`taskbox-kit`: [`kit`], [`disk`], [`loopdev`], [`hostdirs`], [`egress`], [`image`]), the
//! native backend (`taskbox-native`: [`native`], [`sandbox`], [`image_view`], [`cgroup`]), the
//! contract (`taskbox-contract`: [`api`], [`result`], [`warm`],
//! [`exec_limits`]), policies (`taskbox-policy`: [`policy`], [`commands`], [`shell`],
//! [`netpattern`]), the workspace (`taskbox-workspace`: [`changes`], [`layers`], [`fsops`],
//! [`capture`], [`tree`]) and traces (`taskbox-trace`: [`trace`], [`trace_html`], [`replay`]).

pub mod approvals;
pub mod router;
pub mod runtime;

pub use taskbox_kit::{self as kit, disk, egress, hostdirs, image, loopdev};
pub use taskbox_native::{cgroup, image_view, native, sandbox};

pub use taskbox_contract::{
    accounts, api, exec_end, exec_limits, exec_plan, result, support, warm,
};
pub use taskbox_policy::{self as policy, commands, netpattern, shell};
pub use taskbox_trace::{replay, trace, trace_html};
pub use taskbox_workspace::{capture, changes, fsops, layers, tree, untar};
