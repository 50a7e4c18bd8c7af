//! taskbox-trace: what a sandbox did, recorded, shown and replayed.
//!
//! It owns the trace format and its writer, the [`trace::Traced`] decorator that records every
//! operation of any backend before it runs (write-ahead) and after ([`trace`]), the HTML view of
//! a trace ([`trace_html`]), and replay: the re-run of a recorded trace against a clean sandbox of
//! any backend, with the report of where it diverges ([`replay`]), and the content digest of a
//! plain-directory workspace that a trace records and replay checks ([`digest`]). It depends on
//! the contract and on policies, on no backend.

pub mod digest;
pub mod replay;
pub mod trace;
pub mod trace_html;

/// The contract's and the policies' modules, as `crate::api`, `crate::result`, `crate::policy`
/// and `crate::commands` for this crate's own.
pub(crate) use taskbox_contract::{api, result};
pub(crate) use taskbox_policy::{self as policy, commands};
