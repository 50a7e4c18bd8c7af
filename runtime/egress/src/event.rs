//! Decision events: what the proxy tells its subscriber about every connection it decides.
//!
//! The types are defined in `taskbox_core::egress`, so that backends and traces read them
//! without linking the proxy; they are re-exported here.

use std::sync::Arc;

pub use taskbox_core::egress::{ConnectionEnd, Decision, Outcome, Protocol};

/// Receives every [`Decision`]; called on the connection's task, so it should not block (push
/// into a channel).
pub type Subscriber = Arc<dyn Fn(&Decision) + Send + Sync>;
