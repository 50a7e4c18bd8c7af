//! taskbox-core: the runtime's core.
//!
//! It owns the policy model ([`policy`]), the observations agents see ([`result`]), bounded output
//! capture ([`capture`]), the workspace overlay and its changes and diffs ([`changes`]), resource
//! limits ([`cgroup`]) and the native backend's one-shot runs ([`native`]), which hand a complete
//! plan to the synchronous `taskbox-init` helper.

pub mod api;
pub mod capture;
pub mod cgroup;
pub mod changes;
pub mod fsops;
pub mod image;
pub mod layers;
pub mod native;
pub mod policy;
pub mod result;
pub mod router;
pub mod sandbox;
#[cfg(test)]
pub(crate) mod testutil;
pub mod trace;
