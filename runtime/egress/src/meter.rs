//! What one connection moved: bytes each way and the time of its last transfer, shared by the
//! relay and the HTTP forwarder (which meters the response head it reads itself).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Byte counts and the time of the last transfer of one connection.
#[derive(Debug)]
pub(crate) struct Meter {
    start: Instant,
    pub(crate) up: AtomicU64,
    pub(crate) down: AtomicU64,
    /// Milliseconds after `start` of the last transfer either way.
    last: AtomicU64,
}

impl Meter {
    pub(crate) fn new() -> Meter {
        Meter {
            start: Instant::now(),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            last: AtomicU64::new(0),
        }
    }

    pub(crate) fn add(&self, counter: &AtomicU64, bytes: usize) {
        counter.fetch_add(bytes as u64, Ordering::Relaxed);
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, Ordering::Relaxed);
    }

    pub(crate) fn idle_for(&self) -> Duration {
        let now = self.start.elapsed();
        now.saturating_sub(Duration::from_millis(self.last.load(Ordering::Relaxed)))
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}
