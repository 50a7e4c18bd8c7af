//! The two small helpers every layer needs the same way: the wall clock in the unit the API
//! speaks (milliseconds since the Unix epoch), and a mutex that a panicking holder does not make
//! unusable.

use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Locks `m`, also when a holder panicked: the data it guards stays consistent, since each
/// holder makes whole changes.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
