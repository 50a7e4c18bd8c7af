//! The warm pool of forks: sandboxes started ahead for each fork origin (the create request
//! a parent's forks are made from, without labels and lease), so that a fork takes a started
//! sandbox and plants its parent's frozen layers into it instead of starting one in its path.
//!
//! A pooled sandbox is started exactly as a fork's sandbox would be, from the same request
//! (workspace, image, policy, environment, limits): same mounts, namespaces, Landlock rules,
//! seccomp filter, cgroup and egress proxy. It has an empty upper layer and has run nothing,
//! not even the probe exec of a create. A fork that takes one swaps the frozen upper layer in
//! with the path a restore takes ([`crate::Handle::remount`]: a fresh overlay mounted on a
//! staged copy, nothing stopped since nothing runs) and copies the frozen `/tmp` in place.
//!
//! An origin's pool is filled after its first fork, and refilled in the background after each
//! take (a moment later, so that the refill does not take the CPU the new forks' first
//! commands need). A pooled sandbox that waits longer than `max_idle` is retired, and an
//! origin not forked for as long is let go; at most `max_origins` origins are kept warm (the
//! one forked longest ago gives way). The pool's places are held in a [`WarmGauge`] when one is
//! given: a supervisor counts them in its host total and retires them when a create needs the
//! room. Pooled sandboxes are in no table: never listed, never reachable by id, and ended when
//! the backend is (`Sandboxes`' drop).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::api::{ApiError, CreateRequest, SandboxId};
use crate::{Backend, Handle, lock};
use taskbox_contract::warm::WarmGauge;

/// How long after a take an origin's pool starts refilling: the forks just made run their
/// first commands meanwhile.
pub const REFILL_AFTER: Duration = Duration::from_millis(250);

/// How long an origin whose pooled sandbox failed to start waits before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// Sandboxes started for the pool at once: a start waits on its disk and helper part of the
/// time, so one per core (up to 4) refills a pool of 16 in a fraction of a second without
/// taking more than the machine's cores from its sandboxes.
fn fill_parallel() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 4))
}

/// The warm pool's settings (see the module docs).
#[derive(Debug, Clone)]
pub struct ForkPoolConfig {
    /// Sandboxes kept ready per fork origin (0: no pool).
    pub size: usize,
    /// How long a pooled sandbox waits for a fork before it is retired; an origin not forked for
    /// as long is let go.
    pub max_idle: Duration,
    /// Fork origins kept warm at once.
    pub max_origins: usize,
    /// The fleet's count of the pool's places, and the room it leaves the pool.
    pub gauge: Option<Arc<WarmGauge>>,
}

impl ForkPoolConfig {
    /// A pool of `size` sandboxes per origin, with the default idle time (5 minutes) and number
    /// of origins (4).
    pub fn new(size: usize) -> ForkPoolConfig {
        ForkPoolConfig {
            size,
            max_idle: Duration::from_secs(300),
            max_origins: 4,
            gauge: None,
        }
    }
}

impl Default for ForkPoolConfig {
    /// No pool.
    fn default() -> ForkPoolConfig {
        ForkPoolConfig::new(0)
    }
}

/// What the pool holds and has done, for tests and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStatus {
    /// Origins kept warm.
    pub origins: usize,
    /// Sandboxes ready for a fork.
    pub ready: usize,
    /// Sandboxes being started for the pool.
    pub starting: usize,
    /// The ready sandboxes' ids (never a tenant's, never listed).
    pub ids: Vec<SandboxId>,
    /// Sandboxes started for the pool, in total.
    pub started: u64,
    /// Forks served from the pool, in total.
    pub served: u64,
    /// Of those, the forks whose layer pid 1 wrote through the mounted workspace (the rest
    /// had it mounted in place of theirs, see `Handle::merge`).
    pub merged: u64,
    /// Pooled sandboxes retired (idle, lost, past the fleet's room, or their origin let go).
    pub retired: u64,
}

/// The pool of one backend (see the module docs).
pub(crate) struct ForkPool<B: Backend> {
    shared: Arc<Shared<B>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared<B: Backend> {
    backend: Arc<B>,
    config: ForkPoolConfig,
    state: Mutex<State<B::Sandbox>>,
    cond: Condvar,
    started: AtomicU64,
    served: AtomicU64,
    merged: AtomicU64,
    retired: AtomicU64,
}

struct State<S> {
    origins: Vec<Origin<S>>,
    /// Pooled sandboxes to end, out of the lock (by the pool's thread).
    doomed: Vec<Arc<S>>,
    stop: bool,
    /// Starts under way (their threads hold the pool).
    in_flight: usize,
}

struct Origin<S> {
    key: String,
    req: CreateRequest,
    ready: VecDeque<(Arc<S>, Instant)>,
    starting: usize,
    last_fork: Instant,
    /// When the pool may start sandboxes for it again.
    fill_from: Instant,
}

/// The key of a fork origin: everything of the request but its labels, lease and upload id,
/// and the policy as resolved (name and hash), hashed (the request may carry secrets). Creates of
/// one origin get the same sandbox but for its workspace's content at the time.
pub fn origin_key(req: &CreateRequest) -> String {
    use sha2::Digest as _;
    let bare = CreateRequest {
        labels: Default::default(),
        ttl_secs: None,
        workspace_id: None,
        ..req.clone()
    };
    let mut h = sha2::Sha256::new();
    h.update(serde_json::to_vec(&bare).unwrap_or_default());
    if let Some(p) = &req.resolved_policy {
        h.update(b"\0policy\0");
        h.update(p.name.as_bytes());
        h.update(b"\0");
        h.update(p.hash.as_bytes());
    }
    crate::hex(&h.finalize())
}

enum Job<S> {
    End(Vec<Arc<S>>),
    Start(String, Box<CreateRequest>),
}

impl<B: Backend> ForkPool<B> {
    pub(crate) fn new(backend: Arc<B>, config: ForkPoolConfig) -> ForkPool<B> {
        ForkPool {
            shared: Arc::new(Shared {
                backend,
                config,
                state: Mutex::new(State {
                    origins: Vec::new(),
                    doomed: Vec::new(),
                    stop: false,
                    in_flight: 0,
                }),
                cond: Condvar::new(),
                started: AtomicU64::new(0),
                served: AtomicU64::new(0),
                merged: AtomicU64::new(0),
                retired: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Up to `n` ready sandboxes of `req`'s origin, out of the pool (the caller owns them).
    /// The origin is made warm by its first take, and refilled after each.
    pub(crate) fn take(&self, req: &CreateRequest, n: usize) -> Vec<Arc<B::Sandbox>> {
        let shared = &self.shared;
        let key = origin_key(req);
        let now = Instant::now();
        let mut taken = Vec::new();
        {
            let mut st = lock(&shared.state);
            if st.stop {
                return taken;
            }
            let State {
                origins, doomed, ..
            } = &mut *st;
            match origins.iter_mut().find(|o| o.key == key) {
                Some(o) => {
                    o.last_fork = now;
                    o.fill_from = o.fill_from.max(now + REFILL_AFTER);
                    while taken.len() < n {
                        let Some((sb, _)) = o.ready.pop_front() else {
                            break;
                        };
                        sb.refresh();
                        if sb.common().lost_cause().is_some() {
                            doomed.push(sb);
                        } else {
                            taken.push(sb);
                        }
                    }
                }
                None => {
                    if origins.len() >= shared.config.max_origins.max(1) {
                        // The origin forked longest ago gives way.
                        if let Some(i) = (0..origins.len()).min_by_key(|&i| origins[i].last_fork) {
                            let gone = origins.swap_remove(i);
                            doomed.extend(gone.ready.into_iter().map(|(sb, _)| sb));
                        }
                    }
                    origins.push(Origin {
                        key,
                        req: CreateRequest {
                            labels: Default::default(),
                            ttl_secs: None,
                            ..req.clone()
                        },
                        ready: VecDeque::new(),
                        starting: 0,
                        last_fork: now,
                        fill_from: now + REFILL_AFTER,
                    });
                }
            }
            shared.show_ready(&st);
        }
        if let Some(g) = &shared.config.gauge {
            g.serve(taken.len());
        }
        shared
            .served
            .fetch_add(taken.len() as u64, Ordering::Relaxed);
        self.ensure_thread();
        shared.cond.notify_all();
        taken
    }

    /// A fork served from the pool took its layer through its mount.
    pub(crate) fn count_merged(&self) {
        self.shared.merged.fetch_add(1, Ordering::Relaxed);
    }

    /// A sandbox taken from the pool could not be planted: it is ended by the pool's thread.
    pub(crate) fn discard(&self, sb: Arc<B::Sandbox>) {
        self.shared.retired.fetch_add(1, Ordering::Relaxed);
        lock(&self.shared.state).doomed.push(sb);
        self.shared.cond.notify_all();
    }

    pub(crate) fn status(&self) -> PoolStatus {
        let shared = &self.shared;
        let st = lock(&shared.state);
        PoolStatus {
            origins: st.origins.len(),
            ready: ready_count(&st),
            starting: st.origins.iter().map(|o| o.starting).sum(),
            ids: st
                .origins
                .iter()
                .flat_map(|o| o.ready.iter().map(|(sb, _)| sb.common().id.clone()))
                .collect(),
            started: shared.started.load(Ordering::Relaxed),
            served: shared.served.load(Ordering::Relaxed),
            merged: shared.merged.load(Ordering::Relaxed),
            retired: shared.retired.load(Ordering::Relaxed),
        }
    }

    fn ensure_thread(&self) {
        let mut thread = lock(&self.thread);
        if thread.is_some() {
            return;
        }
        let shared = Arc::clone(&self.shared);
        if let Some(g) = &shared.config.gauge {
            let weak: Weak<Shared<B>> = Arc::downgrade(&shared);
            g.set_waker(move || {
                if let Some(s) = weak.upgrade() {
                    s.cond.notify_all();
                }
            });
        }
        match std::thread::Builder::new()
            .name("fork-pool".into())
            .spawn(move || Shared::run(&shared))
        {
            Ok(t) => *thread = Some(t),
            Err(e) => tracing::warn!(error = %e, "cannot start the fork pool's thread"),
        }
    }

    /// Ends the pool: no more starts, every pooled sandbox ended (before this returns).
    pub(crate) fn stop(&self) {
        let shared = &self.shared;
        let left: Vec<Arc<B::Sandbox>> = {
            let mut st = lock(&shared.state);
            st.stop = true;
            let mut left: Vec<_> = std::mem::take(&mut st.doomed);
            for o in st.origins.drain(..) {
                left.extend(o.ready.into_iter().map(|(sb, _)| sb));
            }
            shared.show_ready(&st);
            left
        };
        shared.cond.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
        // The starts under way end what they start when they see the stop.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut st = lock(&shared.state);
        while st.in_flight > 0 && Instant::now() < deadline {
            st = match shared.cond.wait_timeout(st, Duration::from_millis(50)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        drop(st);
        shared.end(left);
    }
}

/// The sandboxes ready in every origin's pool.
fn ready_count<S>(st: &State<S>) -> usize {
    st.origins.iter().map(|o| o.ready.len()).sum()
}

impl<B: Backend> Shared<B> {
    /// Tells the gauge how many sandboxes are ready now (under the state's lock, after a change).
    fn show_ready(&self, st: &State<B::Sandbox>) {
        if let Some(g) = &self.config.gauge {
            g.set_ready(ready_count(st));
        }
    }

    fn end(&self, sandboxes: Vec<Arc<B::Sandbox>>) {
        if sandboxes.is_empty() {
            return;
        }
        if let Some(g) = &self.config.gauge {
            g.release(sandboxes.len());
        }
        for sb in sandboxes {
            tracing::debug!(sandbox = %sb.common().id, "pooled sandbox retired");
            self.backend.end(sb);
        }
    }

    /// The pool's thread: retires what is due, and has what is short started, a few at a time
    /// ([`fill_parallel`]), each on a thread of its own.
    fn run(self: &Arc<Self>) {
        loop {
            let job = {
                let mut st = lock(&self.state);
                loop {
                    if st.stop {
                        return;
                    }
                    if let Some(job) = self.next_job(&mut st) {
                        break job;
                    }
                    let wait = self.config.max_idle.min(Duration::from_secs(1));
                    st = match self.cond.wait_timeout(st, wait) {
                        Ok((g, _)) => g,
                        Err(p) => p.into_inner().0,
                    };
                }
            };
            match job {
                Job::End(list) => self.end(list),
                Job::Start(key, req) => {
                    let shared = Arc::clone(self);
                    let k = key.clone();
                    let spawned = std::thread::Builder::new()
                        .name("fork-pool-start".into())
                        .spawn(move || {
                            let started = shared.backend.start_warm(&req);
                            if let Ok(sb) = &started {
                                // A plant's directories made now, not in the fork's request.
                                let disk = &sb.common().layers.disk;
                                if let Err(e) = crate::layers::StagedLayers::make_ready(disk) {
                                    tracing::debug!(error = %e, "cannot make the stage ahead");
                                }
                            }
                            shared.started_one(&k, started);
                        });
                    if let Err(e) = spawned {
                        self.started_one(
                            &key,
                            Err(ApiError::internal(format!("cannot start a thread: {e}"))),
                        );
                    }
                }
            }
        }
    }

    /// What to do now, if anything: the sandboxes to end (due, lost, past the room), or an
    /// origin to start one more for (its place held in the gauge).
    fn next_job(&self, st: &mut State<B::Sandbox>) -> Option<Job<B::Sandbox>> {
        let now = Instant::now();
        let max_idle = self.config.max_idle;
        let mut due = std::mem::take(&mut st.doomed);
        let mut excess = self.config.gauge.as_ref().map_or(0, |g| g.excess());
        for o in &mut st.origins {
            let before = o.ready.len();
            o.ready.retain(|(sb, since)| {
                let keep =
                    now.duration_since(*since) < max_idle && sb.common().lost_cause().is_none();
                if !keep {
                    due.push(Arc::clone(sb));
                }
                keep
            });
            self.retired
                .fetch_add((before - o.ready.len()) as u64, Ordering::Relaxed);
        }
        // Past the fleet's room: the oldest ready sandboxes go first.
        while excess > 0 {
            let oldest = st
                .origins
                .iter_mut()
                .filter_map(|o| o.ready.front().map(|(_, since)| *since).zip(Some(o)))
                .min_by_key(|(since, _)| *since)
                .map(|(_, o)| o);
            let Some((sb, _)) = oldest.and_then(|o| o.ready.pop_front()) else {
                break;
            };
            self.retired.fetch_add(1, Ordering::Relaxed);
            due.push(sb);
            excess -= 1;
        }
        // An origin not forked for the idle time is let go once it holds nothing.
        st.origins.retain(|o| {
            !(o.ready.is_empty() && o.starting == 0 && now.duration_since(o.last_fork) >= max_idle)
        });
        self.show_ready(st);
        if !due.is_empty() {
            return Some(Job::End(due));
        }
        if st.in_flight >= fill_parallel() {
            return None;
        }
        let size = self.config.size;
        let short = st.origins.iter_mut().find(|o| {
            o.ready.len() + o.starting < size
                && now >= o.fill_from
                && now.duration_since(o.last_fork) < max_idle
        })?;
        if let Some(g) = &self.config.gauge
            && !g.try_hold()
        {
            return None;
        }
        short.starting += 1;
        st.in_flight += 1;
        Some(Job::Start(short.key.clone(), Box::new(short.req.clone())))
    }

    /// A sandbox `started` for origin `key` goes into the pool (or is ended, when the pool
    /// stopped or let the origin go meanwhile).
    fn started_one(&self, key: &str, started: Result<Arc<B::Sandbox>, ApiError>) {
        let mut st = lock(&self.state);
        st.in_flight -= 1;
        self.cond.notify_all();
        let stop = st.stop;
        let origin = st.origins.iter_mut().find(|o| o.key == key);
        match (started, origin) {
            (Ok(sb), Some(o)) if !stop => {
                o.starting -= 1;
                self.started.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(sandbox = %sb.common().id, "pooled sandbox ready");
                o.ready.push_back((sb, Instant::now()));
                self.show_ready(&st);
            }
            (Ok(sb), origin) => {
                if let Some(o) = origin {
                    o.starting -= 1;
                }
                self.started.fetch_add(1, Ordering::Relaxed);
                drop(st);
                self.end(vec![sb]);
            }
            (Err(e), origin) => {
                if let Some(o) = origin {
                    o.starting -= 1;
                    o.fill_from = Instant::now() + RETRY_AFTER;
                }
                drop(st);
                if let Some(g) = &self.config.gauge {
                    g.release(1);
                }
                tracing::warn!(error = %e, "cannot start a sandbox for the fork pool");
            }
        }
    }
}
