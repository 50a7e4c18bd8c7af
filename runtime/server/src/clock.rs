//! The supervisor's wall clock, in the unit its leases, uploads and metrics keep.

pub use taskbox_core::support::now_ms;
