//! A warm pool's place in the fleet ([`WarmGauge`]): sandboxes a backend starts ahead so that
//! forks need not start any take memory, processes and a disk like any other, so they count
//! in the host's live total; they belong to no tenant, so they count in no tenant's; and they
//! never take a place a create or a fork needs.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

type Room = Arc<dyn Fn() -> usize + Send + Sync>;
type Waker = Arc<dyn Fn() + Send + Sync>;

/// Shared by a backend's warm pool, which holds places in it, and the supervisor, which counts
/// them in its total and says how many places the fleet leaves the pool.
#[derive(Default)]
pub struct WarmGauge {
    held: AtomicUsize,
    ready: AtomicUsize,
    served: AtomicU64,
    room: RwLock<Option<Room>>,
    waker: RwLock<Option<Waker>>,
}

impl std::fmt::Debug for WarmGauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WarmGauge")
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

impl WarmGauge {
    pub fn new() -> Arc<WarmGauge> {
        Arc::new(WarmGauge::default())
    }

    /// Sandboxes the pool holds now, started or starting.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Sandboxes the pool holds started, ready for a fork (the places it holds less those
    /// still starting).
    pub fn ready(&self) -> usize {
        self.ready.load(Ordering::SeqCst)
    }

    /// The pool says how many of its sandboxes are ready now.
    pub fn set_ready(&self, n: usize) {
        self.ready.store(n, Ordering::SeqCst);
    }

    /// Forks served from the pool so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }

    /// Counts `n` forks served from the pool, whose places it gives back.
    pub fn serve(&self, n: usize) {
        self.served.fetch_add(n as u64, Ordering::SeqCst);
        self.release(n);
    }

    /// How many places the pool may hold at most, asked each time it would start a sandbox
    /// (a supervisor: its total limit less its live and starting sandboxes). Without one, the
    /// pool is bounded by its own size only.
    pub fn set_room(&self, room: impl Fn() -> usize + Send + Sync + 'static) {
        if let Ok(mut r) = self.room.write() {
            *r = Some(Arc::new(room));
        }
    }

    /// The most the pool may hold now.
    pub fn room(&self) -> usize {
        let room = self.room.read().ok().and_then(|r| r.clone());
        room.map_or(usize::MAX, |f| f())
    }

    /// Takes a place for one more pooled sandbox, if the room allows it.
    pub fn try_hold(&self) -> bool {
        let room = self.room();
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                (h < room).then_some(h + 1)
            })
            .is_ok()
    }

    /// Gives `n` places back: pooled sandboxes taken by a fork, retired, or never started.
    pub fn release(&self, n: usize) {
        let _ = self
            .held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                Some(h.saturating_sub(n))
            });
    }

    /// How many the pool holds past its room now: what it retires.
    pub fn excess(&self) -> usize {
        self.held().saturating_sub(self.room())
    }

    /// What the pool runs when the supervisor wants places back at once ([`WarmGauge::nudge`]).
    pub fn set_waker(&self, waker: impl Fn() + Send + Sync + 'static) {
        if let Ok(mut w) = self.waker.write() {
            *w = Some(Arc::new(waker));
        }
    }

    /// Tells the pool that the room shrank: it retires its excess now, not at its next round.
    pub fn nudge(&self) {
        let waker = self.waker.read().ok().and_then(|w| w.clone());
        if let Some(w) = waker {
            w();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_held_within_the_room_and_given_back() {
        let g = WarmGauge::new();
        assert!(g.try_hold() && g.try_hold());
        assert_eq!((g.held(), g.excess()), (2, 0));
        let room = Arc::new(AtomicUsize::new(2));
        let r = room.clone();
        g.set_room(move || r.load(Ordering::SeqCst));
        assert!(!g.try_hold(), "no room for a third");
        room.store(1, Ordering::SeqCst);
        assert_eq!(g.excess(), 1);
        g.release(1);
        assert_eq!((g.held(), g.excess()), (1, 0));
        g.release(5);
        assert_eq!(g.held(), 0);
        assert!(g.try_hold());
        g.serve(1);
        assert_eq!((g.held(), g.served()), (0, 1));
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        g.set_waker(move || {
            w.fetch_add(1, Ordering::SeqCst);
        });
        g.nudge();
        assert_eq!(woken.load(Ordering::SeqCst), 1);
    }
}
