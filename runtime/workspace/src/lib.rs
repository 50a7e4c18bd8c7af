//! taskbox-workspace: a sandbox's workspace as layers on the host, and everything read or
//! written there on the sandbox's behalf.
//!
//! It owns the overlay's changes and their diffs ([`changes`]), the layer operations built on
//! them: checkpoints, restores, exports and applies ([`layers`]), the path-safe file operations
//! of the narrow API (read, write, edit, patch, list, search, stat, remove: [`fsops`]), bounded
//! output capture ([`capture`]), and the directory walks beneath a layer that never follow a
//! symlink out of it ([`tree`], over openat2 `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`). Every
//! backend that keeps a workspace on the host uses it; it starts no process.

pub mod capture;
pub mod changes;
pub mod fsops;
pub(crate) mod ignores;
pub mod layers;
pub mod review;
pub(crate) mod sys;
#[cfg(any(test, feature = "testutil"))]
#[doc(hidden)]
pub mod testutil;
pub mod tree;
pub mod untar;

/// The contract's modules, as `crate::api` and `crate::result` for this crate's own.
pub(crate) use taskbox_contract::{api, result};
