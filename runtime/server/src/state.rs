//! The server's shared state: the backend, who owns which sandbox, leases, quotas and metrics.
//!
//! Ownership: every sandbox created through the server carries the label `taskbox.tenant`; on
//! start the owner map is rebuilt from the backend's `list()` (a sandbox without the label
//! belongs to `local`). Sandboxes created behind the server's back after it started are not
//! served.
//!
//! Leases: the server keeps them. It passes the effective `ttl_secs` to the backend at create
//! (so a backend may record it), but its own table is what the reaper and every answer's
//! `expires_at_ms` use, because only the server knows about renewals. The table is saved in
//! `STATE/server/leases.json` on every change so a restart keeps renewed leases; a sandbox not in
//! the file takes the backend's `expires_at_ms`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use taskbox_core::api::{ApiError, SandboxApi, SandboxId, SandboxInfo};
use taskbox_core::warm::WarmGauge;

use crate::auth::{Auth, LOCAL_TENANT, TENANT_LABEL, Tenant};
use crate::config::{Limits, Rate};
use crate::error::{HttpError, ServerError};
use crate::idempotency::Idempotency;
use crate::metrics::Metrics;
use crate::workspaces::{UPLOAD_LABEL, Uploads, WorkspaceRules};

pub use crate::clock::now_ms;

#[derive(Debug, Default)]
struct Registry {
    /// Sandbox -> owning tenant.
    owners: HashMap<SandboxId, String>,
    /// Sandbox -> lease end (ms since the epoch).
    leases: HashMap<SandboxId, u64>,
    /// Sandbox -> when it was created (ms since the epoch): where its hard lifetime starts.
    created: HashMap<SandboxId, u64>,
    /// Tenant -> creates in flight (they count against the sandbox limits).
    pending: HashMap<String, usize>,
    /// The creation rate of each tenant, and of all together.
    buckets: HashMap<String, Bucket>,
    bucket_total: Bucket,
    /// Sandboxes lost to a restart of the supervisor: what the last one owned and this one does
    /// not find. Every call on one answers `infrastructure` with the cause, until it is
    /// destroyed (which only forgets it) or [`LOST_KEPT_MS`] passes.
    lost: HashMap<SandboxId, Lost>,
}

/// A sandbox lost to a restart, as the server remembers it.
#[derive(Debug, Clone)]
struct Lost {
    tenant: String,
    cause: String,
    /// When it is forgotten (ms since the epoch).
    until_ms: u64,
}

/// How long a sandbox lost to a restart is remembered: a day.
pub const LOST_KEPT_MS: u64 = 24 * 3600 * 1000;

/// Why the sandboxes the last supervisor owned are gone after a restart.
const RESTARTED: &str = "the supervisor restarted, and the sandbox's processes ended with the \
    supervisor that ran it";

/// A token bucket of a creation rate: full at first, one token per sandbox.
#[derive(Debug, Default)]
struct Bucket {
    /// Tokens and when they were counted (`None`: never used, full).
    state: Option<(f64, std::time::Instant)>,
}

impl Bucket {
    /// The tokens now, refilled at `rate` since they were last counted.
    fn tokens(&self, rate: Rate, now: std::time::Instant) -> f64 {
        match self.state {
            None => f64::from(rate.burst),
            Some((t, at)) => {
                let refill = now.saturating_duration_since(at).as_secs_f64() * rate.per_sec;
                (t + refill).min(f64::from(rate.burst))
            }
        }
    }

    /// How long until `n` tokens are there (zero: they are).
    fn wait_for(&self, n: usize, rate: Rate, now: std::time::Instant) -> Duration {
        let missing = n as f64 - self.tokens(rate, now);
        if missing <= 0.0 {
            return Duration::ZERO;
        }
        if n as f64 > f64::from(rate.burst) {
            // Never at once: as long as the burst takes to fill.
            return Duration::from_secs_f64(f64::from(rate.burst) / rate.per_sec);
        }
        Duration::from_secs_f64(missing / rate.per_sec)
    }

    fn take(&mut self, n: usize, rate: Rate, now: std::time::Instant) {
        let left = self.tokens(rate, now) - n as f64;
        self.state = Some((left.max(0.0), now));
    }
}

#[derive(Debug, Default)]
struct ExecCounts {
    total: usize,
    per_tenant: HashMap<String, usize>,
}

struct Inner {
    backend: Arc<dyn SandboxApi>,
    auth: Auth,
    limits: Limits,
    registry: Mutex<Registry>,
    execs: Mutex<ExecCounts>,
    metrics: Metrics,
    lease_file: Option<PathBuf>,
    /// Held by the thread saving the tables, and whether a change waits for a save (see
    /// `save_leases`).
    saving: Mutex<()>,
    unsaved: std::sync::atomic::AtomicBool,
    workspaces: WorkspaceRules,
    uploads: Option<Uploads>,
    /// Idempotency keys of creates and applying exports.
    idempotency: Arc<Idempotency>,
    /// Set when the server closes its connections (see [`AppState::closing`]).
    closing: std::sync::atomic::AtomicBool,
    /// The backend's warm pool of forks, as the fleet counts it.
    warm: Option<Arc<WarmGauge>>,
}

/// Everything a request handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("auth", &self.inner.auth)
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// Builds an [`AppState`]: `AppState::builder(backend).auth(..).limits(..).build()`.
pub struct AppStateBuilder {
    backend: Arc<dyn SandboxApi>,
    auth: Auth,
    limits: Limits,
    lease_file: Option<PathBuf>,
    workspaces: Option<WorkspaceRules>,
    uploads: Option<Uploads>,
    warm: Option<Arc<WarmGauge>>,
}

impl AppStateBuilder {
    /// How requests authenticate (default [`Auth::Local`]).
    pub fn auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Which directories callers may name as workspaces (default: none under a root, so only
    /// what a caller on the Unix socket may read itself).
    pub fn workspaces(mut self, rules: WorkspaceRules) -> Self {
        self.workspaces = Some(rules);
        self
    }

    /// Where uploaded workspaces live (default: nowhere, `POST /v1/workspaces` answers 404).
    pub fn uploads(mut self, uploads: Uploads) -> Self {
        self.uploads = Some(uploads);
        self
    }

    /// The backend's warm pool of forks (default: none): its sandboxes count in the total of
    /// live sandboxes and in no tenant's; the pool fills only within the room the total limit
    /// leaves it, and gives places back at once when a create or a fork needs them.
    pub fn warm(mut self, gauge: Option<Arc<WarmGauge>>) -> Self {
        self.warm = gauge;
        self
    }

    /// Where the lease table is saved (default: nowhere, leases live in memory only).
    pub fn lease_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.lease_file = Some(path.into());
        self
    }

    /// Rebuilds ownership and leases from the backend's `list()` and the lease file. Blocks:
    /// call it from a blocking thread inside a runtime.
    pub fn build(self) -> Result<AppState, ServerError> {
        let saved = match &self.lease_file {
            Some(p) => load_leases(p)?,
            None => HashMap::new(),
        };
        let mut reg = Registry::default();
        for info in self.backend.list() {
            let tenant = info
                .labels
                .get(TENANT_LABEL)
                .cloned()
                .unwrap_or_else(|| LOCAL_TENANT.to_string());
            let lease = saved.get(info.id.as_str()).copied().or(info.expires_at_ms);
            // The hard lifetime holds across restarts, whatever a saved lease says.
            let lease = match (lease, self.limits.hard_end(info.created_at_ms)) {
                (Some(l), Some(h)) => Some(l.min(h)),
                (l, h) => l.or(h),
            };
            if let Some(exp) = lease {
                reg.leases.insert(info.id.clone(), exp);
            }
            reg.created.insert(info.id.clone(), info.created_at_ms);
            reg.owners.insert(info.id, tenant);
        }
        // What the last supervisor owned and this one does not find was lost with it.
        if let Some(path) = &self.lease_file {
            let now = now_ms();
            for (id, tenant) in load_owners(&owners_file(path)) {
                let Ok(id) = SandboxId::parse(&id) else {
                    continue;
                };
                if !reg.owners.contains_key(&id) {
                    tracing::warn!(sandbox = %id, tenant = %tenant, "sandbox lost to a restart");
                    reg.lost.insert(
                        id,
                        Lost {
                            tenant,
                            cause: RESTARTED.to_owned(),
                            until_ms: now + LOST_KEPT_MS,
                        },
                    );
                }
            }
        }
        tracing::info!(
            sandboxes = reg.owners.len(),
            leases = reg.leases.len(),
            lost = reg.lost.len(),
            "server state rebuilt from the backend"
        );
        let state = AppState {
            inner: Arc::new(Inner {
                backend: self.backend,
                auth: self.auth,
                registry: Mutex::new(reg),
                execs: Mutex::new(ExecCounts::default()),
                metrics: Metrics::default(),
                lease_file: self.lease_file,
                saving: Mutex::new(()),
                unsaved: std::sync::atomic::AtomicBool::new(false),
                workspaces: match self.workspaces {
                    Some(w) => w,
                    None => WorkspaceRules::new(&[], Path::new("/nonexistent"), &[])?,
                },
                uploads: self.uploads,
                idempotency: Arc::new(Idempotency::new(&self.limits)),
                limits: self.limits,
                closing: std::sync::atomic::AtomicBool::new(false),
                warm: self.warm,
            }),
        };
        if let Some(gauge) = &state.inner.warm {
            // The pool's room: the total limit less the tenants' live and starting sandboxes.
            let weak = Arc::downgrade(&state.inner);
            gauge.set_room(move || {
                let Some(inner) = weak.upgrade() else {
                    return 0;
                };
                let reg = inner
                    .registry
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                let used = reg.owners.len() + reg.pending.values().sum::<usize>();
                inner.limits.max_sandboxes_total.saturating_sub(used)
            });
        }
        state.save_leases();
        Ok(state)
    }
}

fn load_leases(path: &Path) -> Result<HashMap<String, u64>, ServerError> {
    match std::fs::read(path) {
        Ok(bytes) => first_value(&bytes).map_err(|e| ServerError::Leases {
            path: path.to_path_buf(),
            why: e.to_string(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
        Err(e) => Err(ServerError::Leases {
            path: path.to_path_buf(),
            why: e.to_string(),
        }),
    }
}

/// Where the owners of the live sandboxes are saved, beside the lease table: a restarted server
/// tells the sandboxes it lost from those that never were.
fn owners_file(lease_file: &Path) -> PathBuf {
    lease_file.with_file_name("owners.json")
}

/// The saved owners (sandbox -> tenant); none when there is no file or it does not parse.
fn load_owners(path: &Path) -> BTreeMap<String, String> {
    std::fs::read(path)
        .ok()
        .and_then(|b| first_value(&b).ok())
        .unwrap_or_default()
}

/// A table keyed by sandbox (the leases, the owners) as sorted JSON.
fn table_text<V: serde::Serialize>(table: &HashMap<SandboxId, V>) -> std::io::Result<Vec<u8>> {
    let map: BTreeMap<&str, &V> = table.iter().map(|(k, v)| (k.as_str(), v)).collect();
    serde_json::to_vec_pretty(&map).map_err(std::io::Error::other)
}

/// Writes `text` over the table file at `path`, in place, in a directory only the server
/// reads. In place rather than a new file renamed over it: each rename freed one inode and
/// took another, on every create and destroy, and on an ext4 without a journal each new inode
/// is found past every inode freed in the last minutes (the kernel's `recently_deleted`), which
/// under a burst of creates cost more CPU than anything else the server did. A crash between
/// the write and the truncation leaves the end of a longer old table behind the new one; the
/// loaders read the first JSON value and ignore what follows it.
fn write_table(path: &Path, text: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    file.write_all(text)?;
    file.set_len(text.len() as u64)
}

/// The first JSON value of `bytes` (a table file may hold the end of an older, longer table
/// after it: see [`write_table`]).
fn first_value<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> serde_json::Result<T> {
    match serde_json::Deserializer::from_slice(bytes)
        .into_iter::<T>()
        .next()
    {
        Some(v) => v,
        None => serde_json::from_slice(bytes),
    }
}

/// A reserved place for a sandbox being created; dropping it without `commit` frees it.
pub(crate) struct CreateSlot {
    state: AppState,
    tenant: String,
    done: bool,
}

impl CreateSlot {
    /// Records the new sandbox `info` as the tenant's, with the lease `asked` (seconds; the
    /// server's default when `None`) from now, within its hard lifetime. Returns the lease end.
    pub fn commit(mut self, info: &SandboxInfo, asked: Option<u64>) -> Option<u64> {
        let expires = self
            .state
            .limits()
            .lease_end(asked, info.created_at_ms, now_ms());
        let mut reg = self.state.registry();
        release_pending(&mut reg, &self.tenant);
        reg.owners.insert(info.id.clone(), self.tenant.clone());
        reg.created.insert(info.id.clone(), info.created_at_ms);
        match expires {
            Some(t) => reg.leases.insert(info.id.clone(), t),
            None => reg.leases.remove(&info.id),
        };
        drop(reg);
        self.state.save_leases();
        self.done = true;
        expires
    }
}

fn release_pending(reg: &mut Registry, tenant: &str) {
    if let Some(n) = reg.pending.get_mut(tenant) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            reg.pending.remove(tenant);
        }
    }
}

impl Drop for CreateSlot {
    fn drop(&mut self) {
        if !self.done {
            release_pending(&mut self.state.registry(), &self.tenant);
        }
    }
}

/// One exec in flight; dropping it frees the place.
pub(crate) struct ExecPermit {
    state: AppState,
    tenant: String,
}

impl Drop for ExecPermit {
    fn drop(&mut self) {
        if let Ok(mut c) = self.state.inner.execs.lock() {
            c.total = c.total.saturating_sub(1);
            if let Some(n) = c.per_tenant.get_mut(&self.tenant) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.per_tenant.remove(&self.tenant);
                }
            }
        }
    }
}

impl AppState {
    pub fn builder(backend: Arc<dyn SandboxApi>) -> AppStateBuilder {
        AppStateBuilder {
            backend,
            auth: Auth::Local,
            limits: Limits::default(),
            lease_file: None,
            workspaces: None,
            uploads: None,
            warm: None,
        }
    }

    /// Which workspaces callers may name.
    pub fn workspaces(&self) -> &WorkspaceRules {
        &self.inner.workspaces
    }

    /// Uploaded workspaces, when this server keeps them.
    pub fn uploads(&self) -> Result<&Uploads, ApiError> {
        self.inner.uploads.as_ref().ok_or_else(|| {
            ApiError::not_found("this server keeps no uploaded workspaces (no state directory)")
        })
    }

    pub fn backend(&self) -> &Arc<dyn SandboxApi> {
        &self.inner.backend
    }

    pub fn auth(&self) -> &Auth {
        &self.inner.auth
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The idempotency keys of creates and applying exports.
    pub fn idempotency(&self) -> &Arc<Idempotency> {
        &self.inner.idempotency
    }

    /// Whether the server is closing its connections: a request still running then gets no
    /// answer (its connection is cut), whatever its backend call returns afterwards.
    pub(crate) fn closing(&self) -> bool {
        self.inner.closing.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn set_closing(&self) {
        self.inner
            .closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding the lock leaves plain maps behind; they stay usable.
        self.inner
            .registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Saves the lease and owner tables after a change, outside the registry's lock. Saves
    /// combine: a change made while another thread saves is left to that thread, which saves
    /// again before it stops, so every change is on file once the last saver returns, and a
    /// burst of creates costs a few saves rather than one each under the lock.
    fn save_leases(&self) {
        use std::sync::atomic::Ordering;
        let Some(path) = &self.inner.lease_file else {
            return;
        };
        self.inner.unsaved.store(true, Ordering::SeqCst);
        loop {
            let saver = match self.inner.saving.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                // The saver saves this change too before it lets go.
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            while self.inner.unsaved.swap(false, Ordering::SeqCst) {
                let (leases, owners) = {
                    let reg = self.registry();
                    (table_text(&reg.leases), table_text(&reg.owners))
                };
                if let Err(e) = leases.and_then(|t| write_table(path, &t)) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot save the lease table");
                }
                let owners_path = owners_file(path);
                if let Err(e) = owners.and_then(|t| write_table(&owners_path, &t)) {
                    tracing::warn!(path = %owners_path.display(), error = %e, "cannot save the owners");
                }
            }
            drop(saver);
            // A change that came after the last look and found the saver still busy.
            if !self.inner.unsaved.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    /// Parses `raw` as a sandbox id owned by `tenant`: 400 when invalid, 404 when missing or
    /// someone else's (the same answer, so ids of other tenants cannot be probed).
    pub fn owned(&self, tenant: &str, raw: &str) -> Result<SandboxId, HttpError> {
        let id = SandboxId::parse(raw)?;
        let reg = self.registry();
        match reg.owners.get(&id) {
            Some(owner) if owner == tenant => Ok(id),
            _ => match reg.lost.get(&id) {
                // Lost to a restart: an infrastructure failure, with its cause.
                Some(lost) if lost.tenant == tenant && lost.until_ms > now_ms() => Err(
                    HttpError::Api(taskbox_core::kit::lost_error(&id, &lost.cause)),
                ),
                _ => Err(not_found(&id).into()),
            },
        }
    }

    /// [`AppState::owned`] for a destroy: a sandbox lost to a restart is forgotten (its destroy
    /// has nothing left to do) and its id given back.
    pub fn owned_or_forget_lost(&self, tenant: &str, raw: &str) -> Result<SandboxId, HttpError> {
        let id = SandboxId::parse(raw)?;
        {
            let mut reg = self.registry();
            if reg.lost.get(&id).is_some_and(|l| l.tenant == tenant) {
                reg.lost.remove(&id);
                return Ok(id);
            }
        }
        self.owned(tenant, raw)
    }

    /// The tenant's sandbox ids.
    pub fn owned_ids(&self, tenant: &str) -> Vec<SandboxId> {
        self.registry()
            .owners
            .iter()
            .filter(|(_, t)| t.as_str() == tenant)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Live sandboxes per tenant.
    pub fn live_per_tenant(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for t in self.registry().owners.values() {
            *m.entry(t.clone()).or_default() += 1;
        }
        m
    }

    pub fn live_total(&self) -> usize {
        self.registry().owners.len()
    }

    /// Sandboxes the backend's warm pool of forks holds (no tenant's; see
    /// [`AppStateBuilder::warm`]).
    pub fn pooled(&self) -> usize {
        self.inner.warm.as_ref().map_or(0, |g| g.held())
    }

    /// Sandboxes of the backend's warm pool that are started and ready for a fork.
    pub fn pooled_ready(&self) -> usize {
        self.inner.warm.as_ref().map_or(0, |g| g.ready())
    }

    /// Forks served from the backend's warm pool so far.
    pub fn pooled_served(&self) -> u64 {
        self.inner.warm.as_ref().map_or(0, |g| g.served())
    }

    /// Reserves a place for a new sandbox of `tenant`, or says which limit is reached.
    pub(crate) fn reserve_create(&self, tenant: &str) -> Result<CreateSlot, HttpError> {
        let mut slots = self.reserve_creates(tenant, 1)?;
        slots
            .pop()
            .ok_or_else(|| HttpError::Api(ApiError::internal("no place was reserved")))
    }

    /// Reserves `n` places for new sandboxes of `tenant` (a create's one, a fork's count): all
    /// of them, or none and which limit is reached, with when to try again. Checked and taken
    /// under one lock, so that a burst of requests never passes a limit: live sandboxes (those
    /// starting included), sandboxes starting, and the creation rate, each per tenant and in
    /// total. Nothing waits: a request over a limit is answered at once.
    pub(crate) fn reserve_creates(
        &self,
        tenant: &str,
        n: usize,
    ) -> Result<Vec<CreateSlot>, HttpError> {
        let refused = match self.try_reserve(tenant, n) {
            Ok(()) => None,
            Err((which, e)) => Some((which, e)),
        };
        if let Some((which, e)) = refused {
            self.metrics().create_refused(which);
            return Err(e);
        }
        // The pool's sandboxes yield their places: past the total with them, the pool retires
        // what is in excess now.
        if let Some(gauge) = &self.inner.warm
            && gauge.excess() > 0
        {
            gauge.nudge();
        }
        Ok((0..n)
            .map(|_| CreateSlot {
                state: self.clone(),
                tenant: tenant.to_string(),
                done: false,
            })
            .collect())
    }

    fn try_reserve(&self, tenant: &str, n: usize) -> Result<(), (&'static str, HttpError)> {
        let limits = &self.inner.limits;
        let now = std::time::Instant::now();
        let mut reg = self.registry();
        let starting_total: usize = reg.pending.values().sum();
        let starting_mine = reg.pending.get(tenant).copied().unwrap_or(0);
        // Creates take well under a second: try again in one.
        let soon = Duration::from_secs(1);
        if starting_total + n > limits.max_starting_total {
            return Err((
                "max_starting_total",
                limit(
                    format!(
                        "the server is starting {starting_total} sandboxes, its limit is {} \
                         (max_starting_total); try again in a moment",
                        limits.max_starting_total
                    ),
                    soon,
                ),
            ));
        }
        if starting_mine + n > limits.max_starting_per_tenant {
            return Err((
                "max_starting_per_tenant",
                limit(
                    format!(
                        "tenant {tenant} is starting {starting_mine} sandboxes, its limit is {} \
                         (max_starting_per_tenant); try again in a moment",
                        limits.max_starting_per_tenant
                    ),
                    soon,
                ),
            ));
        }
        let live_total = reg.owners.len() + starting_total;
        if live_total + n > limits.max_sandboxes_total {
            let after = next_lease_end(&reg, None);
            return Err((
                "max_sandboxes_total",
                limit(
                    format!(
                        "the server has {live_total} live sandboxes, its limit is {} \
                         (max_sandboxes_total); destroy one or try later",
                        limits.max_sandboxes_total
                    ),
                    after,
                ),
            ));
        }
        let live_mine =
            reg.owners.values().filter(|t| t.as_str() == tenant).count() + starting_mine;
        if live_mine + n > limits.max_sandboxes_per_tenant {
            let after = next_lease_end(&reg, Some(tenant));
            return Err((
                "max_sandboxes_per_tenant",
                limit(
                    format!(
                        "tenant {tenant} has {live_mine} live sandboxes, its limit is {} \
                         (max_sandboxes_per_tenant); destroy one first",
                        limits.max_sandboxes_per_tenant
                    ),
                    after,
                ),
            ));
        }
        if let Some(rate) = limits.create_rate_total {
            let wait = reg.bucket_total.wait_for(n, rate, now);
            if !wait.is_zero() {
                return Err((
                    "create_rate_total",
                    limit(
                        format!(
                            "the server creates at most {} sandboxes a second \
                             (create_rate_total); try again in {} ms",
                            rate.per_sec,
                            wait.as_millis()
                        ),
                        wait,
                    ),
                ));
            }
        }
        if let Some(rate) = limits.create_rate_per_tenant {
            let wait = reg
                .buckets
                .get(tenant)
                .map_or(Duration::ZERO, |b| b.wait_for(n, rate, now));
            if !wait.is_zero() {
                return Err((
                    "create_rate_per_tenant",
                    limit(
                        format!(
                            "tenant {tenant} creates at most {} sandboxes a second \
                             (create_rate_per_tenant); try again in {} ms",
                            rate.per_sec,
                            wait.as_millis()
                        ),
                        wait,
                    ),
                ));
            }
        }
        if let Some(rate) = limits.create_rate_total {
            reg.bucket_total.take(n, rate, now);
        }
        if let Some(rate) = limits.create_rate_per_tenant {
            reg.buckets
                .entry(tenant.to_string())
                .or_default()
                .take(n, rate, now);
        }
        *reg.pending.entry(tenant.to_string()).or_default() += n;
        Ok(())
    }

    /// Sandboxes being created per tenant.
    pub fn starting_per_tenant(&self) -> BTreeMap<String, usize> {
        self.registry()
            .pending
            .iter()
            .map(|(t, n)| (t.clone(), *n))
            .collect()
    }

    /// Takes a place for one exec of `tenant`, or says which limit is reached.
    pub(crate) fn exec_permit(&self, tenant: &str) -> Result<ExecPermit, HttpError> {
        let limits = &self.inner.limits;
        let mut c = self
            .inner
            .execs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if c.total >= limits.max_execs_total {
            return Err(limit(
                format!(
                    "the server has reached its limit of {} concurrent execs (max_execs_total); try again when one ends",
                    limits.max_execs_total
                ),
                Duration::from_secs(1),
            ));
        }
        let mine = c.per_tenant.get(tenant).copied().unwrap_or(0);
        if mine >= limits.max_execs_per_tenant {
            return Err(limit(
                format!(
                    "tenant {tenant} has reached its limit of {} concurrent execs (max_execs_per_tenant); wait for one to end",
                    limits.max_execs_per_tenant
                ),
                Duration::from_secs(1),
            ));
        }
        c.total += 1;
        *c.per_tenant.entry(tenant.to_string()).or_default() += 1;
        Ok(ExecPermit {
            state: self.clone(),
            tenant: tenant.to_string(),
        })
    }

    /// The lease end the server holds for `id`.
    pub fn lease(&self, id: &SandboxId) -> Option<u64> {
        self.registry().leases.get(id).copied()
    }

    /// Renews the lease of `id` to `asked` seconds from now (the default when `None`), within
    /// its hard lifetime; returns the new lease end.
    pub fn renew(&self, id: &SandboxId, asked: Option<u64>) -> Option<u64> {
        let now = now_ms();
        let created = self.registry().created.get(id).copied().unwrap_or(now);
        let end = self.inner.limits.lease_end(asked, created, now);
        self.set_lease(id, end);
        end
    }

    /// Sets (or with `None` clears) the lease of `id`.
    pub fn set_lease(&self, id: &SandboxId, expires_at_ms: Option<u64>) {
        let mut reg = self.registry();
        match expires_at_ms {
            Some(t) => reg.leases.insert(id.clone(), t),
            None => reg.leases.remove(id),
        };
        drop(reg);
        self.save_leases();
    }

    /// `info` with the server's lease end.
    pub fn with_lease(&self, mut info: SandboxInfo) -> SandboxInfo {
        info.expires_at_ms = self.lease(&info.id);
        info
    }

    /// Forgets a destroyed sandbox.
    pub fn forget(&self, id: &SandboxId) {
        let mut reg = self.registry();
        reg.owners.remove(id);
        reg.created.remove(id);
        reg.leases.remove(id);
        // Saved whether or not it had a lease: the owners are saved with the leases.
        drop(reg);
        self.save_leases();
    }

    /// Sandboxes whose lease ended by `now_ms`.
    fn expired(&self, now_ms: u64) -> Vec<SandboxId> {
        self.registry()
            .leases
            .iter()
            .filter(|(_, t)| **t <= now_ms)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Destroys every sandbox whose lease has ended; returns how many went. A destroy that fails
    /// is retried ten seconds later.
    pub async fn reap_expired(&self) -> usize {
        let mut reaped = 0;
        for id in self.expired(now_ms()) {
            let backend = self.backend().clone();
            let target = id.clone();
            let res = tokio::task::spawn_blocking(move || backend.destroy(&target))
                .await
                .unwrap_or_else(|e| Err(ApiError::internal(e)));
            match res {
                Ok(()) | Err(ApiError::SandboxNotFound(_)) => {
                    tracing::info!(sandbox = %id, "lease ended: sandbox destroyed");
                    self.forget(&id);
                    reaped += 1;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "lease ended but destroy failed; retrying in 10s");
                    self.set_lease(&id, Some(now_ms() + 10_000));
                }
            }
        }
        reaped
    }

    /// Removes uploaded workspaces whose lease ended and that no live sandbox uses.
    pub async fn reap_uploads(&self) {
        if self.inner.uploads.is_none() {
            return;
        }
        let state = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let in_use: std::collections::HashSet<String> = state
                .backend()
                .list()
                .into_iter()
                .filter_map(|i| i.labels.get(UPLOAD_LABEL).cloned())
                .collect();
            if let Ok(u) = state.uploads() {
                for id in u.reap(&in_use) {
                    tracing::info!(upload = %id, "upload lease ended: removed");
                }
            }
        })
        .await;
    }

    /// Runs [`AppState::reap_expired`] and [`AppState::reap_uploads`] every `period`, and drops
    /// expired idempotency keys, forever.
    pub async fn run_reaper(self, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.reap_expired().await;
            self.reap_uploads().await;
            let now = now_ms();
            self.registry().lost.retain(|_, l| l.until_ms > now);
            self.inner.idempotency.purge();
        }
    }
}

/// A 429 for `msg`, to be tried again `after` from now (`Retry-After`, whole seconds).
fn limit(msg: String, after: Duration) -> HttpError {
    HttpError::Limited {
        error: ApiError::LimitExceeded(msg),
        retry_after: after,
    }
}

/// How long until the first lease ends (of `tenant`'s sandboxes, or of all), between one and
/// thirty seconds: when a place may free up without a destroy.
fn next_lease_end(reg: &Registry, tenant: Option<&str>) -> Duration {
    let now = now_ms();
    let first = reg
        .leases
        .iter()
        .filter(|(id, _)| tenant.is_none_or(|t| reg.owners.get(*id).is_some_and(|o| o == t)))
        .map(|(_, end)| *end)
        .min();
    let secs = first.map_or(30, |end| end.saturating_sub(now).div_ceil(1000));
    Duration::from_secs(secs.clamp(1, 30))
}

/// The one answer for a sandbox the caller cannot see: the same as for one that does not exist.
pub fn not_found(id: &SandboxId) -> ApiError {
    ApiError::sandbox_not_found(id)
}

/// The authenticated tenant of a request, from its `Authorization` header and the server's
/// tokens (extracting it answers 401 when there is none).
impl FromRequestParts<AppState> for Tenant {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Tenant, HttpError> {
        let header = match parts.headers.get(header::AUTHORIZATION) {
            None => None,
            Some(v) => Some(v.to_str().map_err(|_| {
                HttpError::Unauthorized("the authorization header is not ASCII".into())
            })?),
        };
        let tenant = state.auth().authenticate(header)?;
        tracing::Span::current().record("tenant", tenant.as_str());
        Ok(Tenant(tenant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_written_over_a_longer_one_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server/leases.json");
        let mut long = HashMap::new();
        for i in 0..50 {
            long.insert(SandboxId::parse(&format!("sb-{i:016x}")).unwrap(), 7u64);
        }
        write_table(&path, &table_text(&long).unwrap()).unwrap();
        let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
        let short: HashMap<SandboxId, u64> =
            [(SandboxId::parse("sb-00000000000000aa").unwrap(), 9)].into();
        write_table(&path, &table_text(&short).unwrap()).unwrap();
        // The same file, no longer than its content.
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::ino(&md), inode);
        assert_eq!(md.len() as usize, table_text(&short).unwrap().len());
        let back = load_leases(&path).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back["sb-00000000000000aa"], 9);
        // As a crash between the write and the truncation leaves it: the old table's end.
        let mut torn = table_text(&short).unwrap();
        torn.extend_from_slice(b"\n  \"sb-0000000000000031\": 7\n}");
        std::fs::write(&path, &torn).unwrap();
        assert_eq!(load_leases(&path).unwrap().len(), 1);
        assert_eq!(
            load_owners(&path).len(),
            0,
            "a lease table is no owner table"
        );
    }
}
