//! taskbox-kit, the backend kit: everything between the contract and how a process starts
//! inside a backend's boundary, written once, and the seams every backend shares around a
//! sandbox: its disk quota ([`disk`] over [`loopdev`]), the host directories that are never a
//! workspace and always masked ([`hostdirs`]), the egress proxy's seam ([`egress`]), and the
//! image store's ([`image`]).
//!
//! A backend implements two traits:
//! - [`Backend`]: starts a sandbox for a create request and ends one; it owns the [`Table`] of
//!   its live sandboxes;
//! - [`Handle`]: one live sandbox. It runs an exec (building its [`ExecPlan`] and reporting its
//!   end as an [`ExecEnd`](crate::exec_end::ExecEnd)), signals one, opens the workspace for file
//!   operations, stops every process and remounts the workspace for a restore.
//!
//! [`Sandboxes`] then implements [`SandboxApi`] for it: ids and the table, leases, background
//! processes (wait, kill, stdin, their state) over [`Slots`], and the workspace operations (file
//! operations, diff, checkpoint, restore, export) over the shared overlay type [`Layers`],
//! and forks, from a warm pool of started sandboxes when the backend can start one ahead
//! ([`pool`]).
//! `docs/backends.md` walks through adding a backend.

pub mod disk;
pub mod egress;
pub mod findings;
pub mod fsuser;
pub mod hostdirs;
pub mod image;
pub mod layers;
pub mod loopdev;
pub mod pool;
pub mod slots;
pub mod users;

// The crates below, under the names the modules use.
pub(crate) use taskbox_contract::{accounts, api, result, support};
pub(crate) use taskbox_policy as policy;
pub(crate) use taskbox_workspace::{capture, changes, fsops};

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

pub use fsuser::{FsLandlock, SandboxUser};
pub use layers::{ExecChanges, Layers, SPILL_MOUNT, Seed, StagedLayers};
pub use pool::{ForkPoolConfig, PoolStatus, origin_key};
pub use slots::{Captured, ExecSlot, ProcState, Slots, StdinSink};
pub use taskbox_contract::exec_end::ExecEnd;
pub use taskbox_contract::exec_plan::ExecPlan;

use crate::api::*;
use crate::egress::SandboxEgress;
use crate::fsops::WorkspaceFs;
use crate::policy::Policy;

pub use crate::support::{lock, now_ms};

/// A backend: how sandboxes start and end in its boundary.
pub trait Backend: Send + Sync + 'static {
    type Sandbox: Handle;
    /// Its name in `SandboxInfo.backend` and the logs.
    const NAME: &'static str;

    /// Its live sandboxes.
    fn table(&self) -> &Table<Self::Sandbox>;

    /// Starts a sandbox for `req`, whose policy is resolved ([`CreateRequest::for_backend`]).
    fn start(&self, req: &CreateRequest) -> Result<Arc<Self::Sandbox>, ApiError>;

    /// Ends a sandbox taken out of the table: its processes, its mounts, its directories. The
    /// sandbox's last handles are those of its background execs' drivers, which end with it.
    fn end(&self, sandbox: Arc<Self::Sandbox>);

    /// Starts a fork: a sandbox for `req` (the parent's create request, as the kit rebuilds it)
    /// whose workspace's upper layer and scratch directories start as `seed`'s
    /// ([`Seed::plant`], before its overlay is mounted). Backends that cannot keep this default,
    /// which refuses.
    fn start_fork(&self, req: &CreateRequest, seed: &Seed) -> Result<Arc<Self::Sandbox>, ApiError> {
        let _ = (req, seed);
        Err(ApiError::invalid(format!(
            "the {} backend cannot fork a sandbox",
            Self::NAME
        )))
    }

    /// Whether [`Backend::start_warm`] starts sandboxes (a warm pool of forks is kept only
    /// then).
    const WARM_FORKS: bool = false;

    /// Starts a sandbox for the warm pool of forks ([`pool`]): as [`Backend::start`] would for
    /// `req`, with an empty upper layer, running nothing in it (not even a probe), so that a
    /// fork can plant its layers into it through [`Handle::remount`]. Backends that cannot
    /// keep this default, which refuses.
    fn start_warm(&self, req: &CreateRequest) -> Result<Arc<Self::Sandbox>, ApiError> {
        let _ = req;
        Err(ApiError::invalid(format!(
            "the {} backend cannot start a sandbox ahead",
            Self::NAME
        )))
    }

    /// Ends the sandboxes left when the backend is dropped.
    fn end_all(&self, sandboxes: Vec<Arc<Self::Sandbox>>) {
        for sb in sandboxes {
            self.end(sb);
        }
    }
}

/// One live sandbox of a backend.
pub trait Handle: Send + Sync + Sized + 'static {
    /// What the backend keeps of an exec's process.
    type Proc: ProcState;

    /// The parts every backend's sandbox has.
    fn common(&self) -> &Common<Self::Proc>;

    /// Called before the sandbox's info is read: a backend that learns that a sandbox is lost
    /// only by looking (Docker) looks.
    fn refresh(&self) {}

    /// Runs a planned command: to its end (streaming `events`), or in the background with a
    /// slot in [`Common::slots`]. The layers are held shared until it returns.
    fn exec(
        self: &Arc<Self>,
        plan: ExecPlan,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError>;

    /// Delivers `signal` (1-64; SIGKILL: to the exec's whole tree) to a running exec.
    fn signal(&self, slot: &ExecSlot<Self::Proc>, signal: i32) -> Result<(), ApiError>;

    /// Runs a file operation on the workspace as the sandbox sees it (the layers are held
    /// shared meanwhile). The kit runs `op` as the sandbox's user ([`Common::user`]): the
    /// handle opens the workspace with its own rights, and does nothing else in it.
    fn with_fs<T>(
        &self,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError>,
    ) -> Result<T, ApiError>;

    /// The sandbox's root directory as its commands see it, for file operations on absolute
    /// paths: a descriptor of `/proc/PID/root` of a process in the sandbox's mount namespace,
    /// opened with this process's own rights (the kit then resolves every path beneath it as
    /// the sandbox's user, under its Landlock rules).
    fn open_root(&self) -> Result<std::os::fd::OwnedFd, ApiError>;

    /// For a restore: ends every process of the sandbox that could hold files of the old
    /// workspace open, and waits for its execs to settle.
    fn stop_all(&self) -> Result<(), ApiError>;

    /// For a restore of checkpoint `name`: mounts `staged` where the workspace is.
    fn remount(&self, staged: &StagedLayers, name: &str) -> Result<(), ApiError>;

    /// For a warm fork, in a sandbox that has run nothing and whose upper layer is empty:
    /// writes the upper layer `layer` (a directory on the host, left as it is) through the
    /// mounted workspace, which then shows what a [`Handle::remount`] of a copy of it would,
    /// with the mount and what depends on it left in place. An error (the default: the
    /// backend cannot) may leave part of it written; the caller then remounts, which replaces
    /// it all.
    fn merge(&self, layer: &std::path::Path) -> Result<(), ApiError> {
        let _ = layer;
        Err(ApiError::internal(
            "this backend remounts its forks' layers",
        ))
    }
}

/// The parts every backend's sandbox has.
pub struct Common<P> {
    pub id: SandboxId,
    pub info: Mutex<SandboxInfo>,
    pub policy: Policy,
    /// What execs run in: the workspace inside the sandbox (the default working directory),
    /// the environment every exec gets, and the shell of `shell` execs.
    pub exec_base: ExecBase,
    pub layers: Layers,
    pub slots: Slots<P>,
    /// Network mode "proxy": the sandbox's egress proxy.
    pub egress: Option<SandboxEgress>,
    /// Who the sandbox's commands are on the host: what file operations run as.
    pub user: SandboxUser,
    /// The Landlock rules of the sandbox's execs, which file operations on its root obey too
    /// (`None`: its execs have none, as in a container).
    pub fs_landlock: Option<FsLandlock>,
    /// The create request the sandbox was made from (its policy resolved), set by the kit once
    /// it is made: what its forks are made from.
    pub origin: OnceLock<CreateRequest>,
}

/// What a sandbox's execs run in.
#[derive(Debug, Clone, Default)]
pub struct ExecBase {
    /// The workspace inside the sandbox: the default working directory.
    pub workdir: String,
    /// The environment every exec gets, under the request's.
    pub env: Vec<(String, String)>,
    /// The image's shell and its flag for `shell` execs (`None`: `/bin/sh -c`).
    pub shell: Option<Vec<String>>,
}

impl<P: ProcState> Common<P> {
    pub fn new(
        info: SandboxInfo,
        policy: Policy,
        exec_base: ExecBase,
        layers: Layers,
    ) -> Common<P> {
        Common {
            id: info.id.clone(),
            info: Mutex::new(info),
            policy,
            exec_base,
            layers,
            slots: Slots::default(),
            egress: None,
            user: SandboxUser::of_this_process(),
            fs_landlock: None,
            origin: OnceLock::new(),
        }
    }

    /// Who the sandbox's commands are (default: this process's own ids and groups). A backend
    /// gives the credentials its execs get, from the same place.
    pub fn with_user(mut self, user: SandboxUser) -> Common<P> {
        self.user = user;
        self
    }

    /// The Landlock rules of the sandbox's execs (see [`Common::fs_landlock`]).
    pub fn with_fs_landlock(mut self, rules: Option<FsLandlock>) -> Common<P> {
        self.fs_landlock = rules;
        self
    }

    pub fn with_egress(mut self, egress: Option<SandboxEgress>) -> Common<P> {
        self.egress = egress;
        self
    }

    /// Puts new egress rules in force (network mode "proxy" only).
    pub fn set_network(&self, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        match &self.egress {
            Some(egress) => egress.replace_rules(self.id.as_str(), rules),
            None => Err(crate::egress::no_proxy(
                self.id.as_str(),
                self.policy.network.mode,
            )),
        }
    }

    /// Rotates or revokes one of the sandbox's secrets (network mode "proxy" only).
    pub fn set_secret(&self, update: SecretUpdate) -> Result<SecretStatus, ApiError> {
        match &self.egress {
            Some(egress) => egress.set_secret(self.id.as_str(), update),
            None => Err(ApiError::Conflict(format!(
                "sandbox {} has no egress proxy (network mode \"{}\"), so no secrets",
                self.id,
                self.policy.network.mode.as_str()
            ))),
        }
    }

    /// The plan of an exec request in this sandbox.
    pub fn plan(&self, req: &ExecRequest) -> Result<ExecPlan, ApiError> {
        let base = &self.exec_base;
        ExecPlan::new(
            req,
            &self.policy,
            &base.env,
            &base.workdir,
            base.shell.as_deref(),
        )
    }

    /// Marks the sandbox lost in its info, with why (the first cause given stays).
    pub fn mark_lost(&self, cause: &str) {
        let mut info = lock(&self.info);
        info.state = "lost".into();
        if info.lost_cause.is_none() {
            info.lost_cause = Some(cause.to_owned());
        }
    }

    /// Why the sandbox is lost, when it is.
    pub fn lost_cause(&self) -> Option<String> {
        lock(&self.info).lost_cause.clone()
    }

    /// The one error of every operation on a lost sandbox: an infrastructure failure, with its
    /// cause.
    pub fn lost_error(&self) -> ApiError {
        let cause = self
            .lost_cause()
            .unwrap_or_else(|| "its processes are gone".to_owned());
        lost_error(&self.id, &cause)
    }
}

/// The error of an operation on sandbox `id`, lost because of `cause`.
pub fn lost_error(id: &SandboxId, cause: &str) -> ApiError {
    ApiError::Infrastructure(format!(
        "sandbox {id} is lost: {cause}. This is an infrastructure failure, not the command's: \
         nothing more runs in the sandbox; destroy it (and drop the episode rather than score it)"
    ))
}

/// A backend's live sandboxes by id.
pub struct Table<S> {
    map: RwLock<HashMap<SandboxId, Arc<S>>>,
}

impl<S> Default for Table<S> {
    fn default() -> Self {
        Table {
            map: RwLock::new(HashMap::new()),
        }
    }
}

impl<S> Table<S> {
    pub fn get(&self, id: &SandboxId) -> Result<Arc<S>, ApiError> {
        self.map
            .read()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::sandbox_not_found(id))
    }

    fn insert(&self, id: SandboxId, sb: Arc<S>) -> Result<(), ApiError> {
        self.map
            .write()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .insert(id, sb);
        Ok(())
    }

    fn remove(&self, id: &SandboxId) -> Result<Arc<S>, ApiError> {
        self.map
            .write()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .remove(id)
            .ok_or_else(|| ApiError::sandbox_not_found(id))
    }

    pub fn all(&self) -> Vec<Arc<S>> {
        self.map
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Takes every sandbox out of the table.
    pub fn drain(&self) -> Vec<Arc<S>> {
        match self.map.write() {
            Ok(mut m) => m.drain().map(|(_, s)| s).collect(),
            Err(p) => p.into_inner().drain().map(|(_, s)| s).collect(),
        }
    }
}

/// A backend with the operations of [`SandboxApi`]: the one implementation of the contract
/// that every backend shares. It derefs to the backend for what is the backend's own.
pub struct Sandboxes<B: Backend> {
    backend: Arc<B>,
    /// The warm pool of forks, when asked for ([`Sandboxes::with_fork_pool`]).
    pool: Option<pool::ForkPool<B>>,
}

/// A backend opened from its configuration alone (`Sandboxes::new`).
pub trait Open: Backend + Sized {
    type Config;
    fn open(config: Self::Config) -> Result<Self, ApiError>;
}

/// What a backend may be given after it is opened: an image store, an egress service, more
/// host paths to hide (the options the native backend takes, through [`Sandboxes`]).
pub trait Options: Backend {
    fn set_images(&mut self, images: Arc<dyn crate::image::ImageResolver>);
    fn set_egress(&mut self, egress: Arc<dyn crate::egress::EgressService>);
    fn set_hidden_paths(&mut self, paths: Vec<std::path::PathBuf>);
}

impl<B: Open> Sandboxes<B> {
    /// The backend opened from `config`.
    pub fn new(config: B::Config) -> Result<Sandboxes<B>, ApiError> {
        B::open(config).map(Sandboxes::of)
    }
}

impl<B: Options> Sandboxes<B> {
    /// The backend, to set an option on: only while nothing else holds it (the builder
    /// methods below run before the backend serves anything, and the pool's thread starts at
    /// the first fork).
    fn options(&mut self) -> Option<&mut B> {
        let b = Arc::get_mut(&mut self.backend);
        if b.is_none() {
            tracing::error!("an option was set on a backend already in use; it is ignored");
        }
        b
    }

    /// Gives the backend an image store: sandboxes may then have an image as their root
    /// (`CreateRequest.image`, a name or digest the store resolves).
    pub fn with_images(mut self, images: Arc<dyn crate::image::ImageResolver>) -> Sandboxes<B> {
        if let Some(b) = self.options() {
            b.set_images(images);
        }
        self
    }

    /// Gives the backend an egress service: sandboxes whose policy has network mode "proxy" get
    /// a proxy of their own from it (see [`crate::egress`]).
    pub fn with_egress(mut self, egress: Arc<dyn crate::egress::EgressService>) -> Sandboxes<B> {
        if let Some(b) = self.options() {
            b.set_egress(egress);
        }
        self
    }

    /// Hides these host paths in every sandbox too (a supervisor's socket and tokens file),
    /// besides taskbox's state directories and the host's bound sockets, which are always
    /// hidden; none of them can be a workspace.
    pub fn with_hidden_paths(mut self, paths: Vec<std::path::PathBuf>) -> Sandboxes<B> {
        if let Some(b) = self.options() {
            b.set_hidden_paths(paths);
        }
        self
    }
}

impl<B: Backend> Sandboxes<B> {
    pub fn of(backend: B) -> Sandboxes<B> {
        Sandboxes {
            backend: Arc::new(backend),
            pool: None,
        }
    }

    /// Keeps a warm pool of forks ([`pool`]): `config.size` sandboxes started ahead for each
    /// fork origin, after its first fork. Nothing for a backend that cannot start sandboxes
    /// ahead ([`Backend::WARM_FORKS`]), or with a size of 0.
    pub fn with_fork_pool(mut self, config: ForkPoolConfig) -> Sandboxes<B> {
        if let Some(old) = self.pool.take() {
            old.stop();
        }
        if B::WARM_FORKS && config.size > 0 {
            self.pool = Some(pool::ForkPool::new(Arc::clone(&self.backend), config));
        }
        self
    }

    /// What the warm pool of forks holds and has done (`None`: no pool).
    pub fn fork_pool_status(&self) -> Option<PoolStatus> {
        self.pool.as_ref().map(pool::ForkPool::status)
    }

    fn get(&self, id: &SandboxId) -> Result<Arc<B::Sandbox>, ApiError> {
        self.backend.table().get(id)
    }

    /// A sandbox that still runs: a lost one answers every operation but info, destroy and
    /// renew with its infrastructure error ([`Common::lost_error`]).
    fn live(&self, id: &SandboxId) -> Result<Arc<B::Sandbox>, ApiError> {
        let sb = self.get(id)?;
        sb.refresh();
        if sb.common().lost_cause().is_some() {
            return Err(sb.common().lost_error());
        }
        Ok(sb)
    }

    /// Destroys every sandbox whose lease has run out; returns their ids.
    pub fn reap_expired(&self) -> Vec<SandboxId> {
        let now = now_ms();
        let expired: Vec<SandboxId> = self
            .list()
            .into_iter()
            .filter(|i| i.expires_at_ms.is_some_and(|t| t <= now))
            .map(|i| i.id)
            .collect();
        for id in &expired {
            let _ = self.destroy(id);
        }
        expired
    }

    /// Extends (or sets) a sandbox's lease to `ttl` from now.
    pub fn renew(&self, id: &SandboxId, ttl: Duration) -> Result<SandboxInfo, ApiError> {
        let sb = self.get(id)?;
        let mut info = lock(&sb.common().info);
        info.expires_at_ms = Some(now_ms() + ttl.as_millis() as u64);
        Ok(info.clone())
    }

    fn info_of(sb: &B::Sandbox) -> SandboxInfo {
        sb.refresh();
        lock(&sb.common().info).clone()
    }

    /// A file operation at `place`, shared with execs and excluded from checkpoint and restore,
    /// run as the sandbox's user.
    fn with_fs<T: Send>(
        &self,
        id: &SandboxId,
        place: Place,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError> + Send,
    ) -> Result<T, ApiError> {
        let sb = self.live(id)?;
        let _g = sb.common().layers.shared()?;
        fs_at(&*sb, place, op)
    }
}

/// Where a file operation's paths are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Beneath the workspace (relative paths): the workspace as mounted, reached by the
    /// backend; the sandbox's symlinks resolve inside the workspace.
    Workspace,
    /// Beneath the sandbox's root (absolute paths), as its commands see it, under its Landlock
    /// rules.
    Root,
}

impl Place {
    /// Absolute paths are the sandbox's, relative ones the workspace's.
    fn of(path: &str) -> Place {
        if path.starts_with('/') {
            Place::Root
        } else {
            Place::Workspace
        }
    }

    /// The place of an operation on an optional path (none: the workspace root).
    fn of_opt(path: Option<&str>) -> Place {
        path.map_or(Place::Workspace, Place::of)
    }
}

/// Runs `op` at `place` of `sb` as its user (the layers already held).
fn fs_at<H: Handle, T: Send>(
    sb: &H,
    place: Place,
    op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError> + Send,
) -> Result<T, ApiError> {
    let common = sb.common();
    match place {
        Place::Workspace => sb.with_fs(|fs| fsuser::as_user(&common.user, None, || op(fs))),
        Place::Root => {
            let root = sb.open_root()?;
            let fs_root = root
                .try_clone()
                .map_err(|e| ApiError::internal(format!("cannot duplicate a descriptor: {e}")))?;
            let workdir = std::path::Path::new(&common.exec_base.workdir);
            let protected: Vec<String> = common
                .policy
                .filesystem
                .protected
                .iter()
                .map(|p| workdir.join(p).display().to_string())
                .collect();
            let fs = WorkspaceFs::sandbox_root(fs_root).with_protected(&protected);
            let landlock = common.fs_landlock.as_ref().map(|rules| (&root, rules));
            fsuser::as_user(&common.user, landlock, || op(&fs))
        }
    }
}

/// The user `spec` names in `sb`, resolved against the sandbox's own `/etc/passwd` and
/// `/etc/group` as they are now ([`users`]: read beneath its root, where a link cannot make the
/// supervisor read a host file), so a user an earlier exec added counts.
fn exec_user<H: Handle>(sb: &H, spec: &str) -> Result<crate::accounts::ExecUser, ApiError> {
    users::resolve_in_root(&sb.open_root()?, spec)
}

/// `req` with both paths absolute when either is (a relative one taken as the workspace's), so
/// that both resolve beneath one root.
fn rename_place(req: &MoveRequest, workdir: &str) -> (Place, MoveRequest) {
    let (from, to) = (Place::of(&req.from), Place::of(&req.to));
    if from == Place::Workspace && to == Place::Workspace {
        return (Place::Workspace, req.clone());
    }
    let abs = |p: &str| {
        if p.starts_with('/') {
            p.to_owned()
        } else {
            std::path::Path::new(workdir).join(p).display().to_string()
        }
    };
    (
        Place::Root,
        MoveRequest {
            from: abs(&req.from),
            to: abs(&req.to),
            overwrite: req.overwrite,
        },
    )
}

/// A reader that hashes what it gives and keeps its own failure, so an upload can tell a body
/// that stopped arriving from a file system that refused it.
struct HashingReader<'a> {
    inner: &'a mut (dyn std::io::Read + Send),
    hasher: sha2::Sha256,
    failed: Option<std::io::Error>,
}

impl std::io::Read for HashingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest as _;
        match self.inner.read(buf) {
            Ok(n) => {
                self.hasher.update(&buf[..n]);
                Ok(n)
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Err(e),
            Err(e) => {
                let kept = std::io::Error::new(e.kind(), e.to_string());
                self.failed = Some(e);
                Err(kept)
            }
        }
    }
}

/// A sink that hashes what it passes on.
struct HashingSink<'a> {
    inner: &'a mut dyn ByteSink,
    hasher: sha2::Sha256,
}

impl ByteSink for HashingSink<'_> {
    fn start(&mut self, size: u64) -> std::io::Result<()> {
        self.inner.start(size)
    }
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use sha2::Digest as _;
        self.hasher.update(bytes);
        self.inner.write(bytes)
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl<B: Backend> Deref for Sandboxes<B> {
    type Target = B;
    fn deref(&self) -> &B {
        &self.backend
    }
}

impl<B: Backend> Drop for Sandboxes<B> {
    fn drop(&mut self) {
        // The pool first: its thread holds the backend and starts nothing more.
        if let Some(pool) = self.pool.take() {
            pool.stop();
        }
        let all = self.backend.table().drain();
        self.backend.end_all(all);
    }
}

impl<B: Backend + std::fmt::Debug> std::fmt::Debug for Sandboxes<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.backend.fmt(f)
    }
}

/// The create request of a fork of a sandbox made from `origin` whose info is `parent`: the same
/// workspace, image (by digest), policy and environment, the parent's labels with `req`'s over
/// them, and `req`'s lease or the parent's.
fn fork_request(origin: &CreateRequest, parent: &SandboxInfo, req: &ForkRequest) -> CreateRequest {
    let mut labels = parent.labels.clone();
    labels.extend(req.labels.clone());
    CreateRequest {
        workspace: parent.workspace.clone(),
        workspace_id: None,
        image: (parent.image != "host").then(|| parent.image.clone()),
        labels,
        ttl_secs: req.ttl_secs.or(origin.ttl_secs),
        ..origin.clone()
    }
}

impl<B: Backend> Sandboxes<B> {
    /// Makes `count` forks from `seed` side by side: as many as the warm pool has ready take
    /// one of its sandboxes and have the seed planted into it ([`plant_warm`]), the rest are
    /// started ([`Backend::start_fork`]), as is any whose planting fails. All of them, or none
    /// (those made before a failure are ended again). Returns them and how many came from the
    /// pool.
    fn start_forks(
        &self,
        req: &CreateRequest,
        seed: &Seed,
        count: u32,
    ) -> Result<Forks<B::Sandbox>, ApiError> {
        // A pooled sandbox has run nothing, so it knows nothing of what is in force: it takes
        // its parent's, as a cold fork does (else the cold path's probe learns it).
        let warm = match (&self.pool, &seed.enforcement) {
            (Some(pool), Some(e)) if e.landlock != "unknown" => pool.take(req, count as usize),
            _ => Vec::new(),
        };
        let cold = count as usize - warm.len();
        let made: Vec<Made<B::Sandbox>> = std::thread::scope(|scope| {
            let backend = &self.backend;
            let pool = self.pool.as_ref();
            let planted: Vec<_> = warm
                .into_iter()
                .map(|sb| {
                    scope.spawn(move || match plant_warm(&sb, seed, req) {
                        Ok(merged) => {
                            if let (true, Some(pool)) = (merged, pool) {
                                pool.count_merged();
                            }
                            (Ok(sb), true)
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %sb.common().id, error = %e,
                                "cannot plant a fork into a pooled sandbox; starting one");
                            if let Some(pool) = pool {
                                pool.discard(sb);
                            }
                            (backend.start_fork(req, seed), false)
                        }
                    })
                })
                .collect();
            let started: Vec<_> = (0..cold)
                .map(|_| scope.spawn(|| (backend.start_fork(req, seed), false)))
                .collect();
            planted
                .into_iter()
                .chain(started)
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        (Err(ApiError::internal("a fork's start panicked")), false)
                    })
                })
                .collect()
        });
        let mut forks = Vec::with_capacity(made.len());
        let mut from_pool = 0;
        let mut failed = None;
        for (r, warm) in made {
            match r {
                Ok(sb) => {
                    from_pool += usize::from(warm);
                    forks.push(sb);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            for sb in forks {
                self.backend.end(sb);
            }
            return Err(e);
        }
        Ok(Forks {
            sandboxes: forks,
            from_pool,
        })
    }
}

/// One fork's start: the sandbox, and whether it came from the warm pool.
type Made<S> = (Result<Arc<S>, ApiError>, bool);

/// The sandboxes of a fork request, and how many came from the warm pool.
struct Forks<S> {
    sandboxes: Vec<Arc<S>>,
    from_pool: usize,
}

/// Plants `seed` into `sb`, a sandbox of the warm pool started from `req`'s origin, which has
/// run nothing: the seed's upper layer is written through its mounted workspace
/// ([`Handle::merge`]), or, where that fails, staged on its disk and mounted as its workspace
/// (the path of a restore, with nothing to stop); its scratch directories are copied into the
/// mounted ones; then the sandbox takes `req`'s labels and lease from now on, and what its
/// parent found in force, as a started fork would. Returns whether the layer was merged.
fn plant_warm<H: Handle>(sb: &Arc<H>, seed: &Seed, req: &CreateRequest) -> Result<bool, ApiError> {
    let common = sb.common();
    let layers = &common.layers;
    let merged = {
        let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1000.0;
        let _g = layers.exclusive()?;
        let t = std::time::Instant::now();
        // Written through the mount when the backend can (its exec starters stay), else a copy
        // of the layer is mounted in place of the empty one.
        let merged = crate::layers::is_empty_dir(&layers.upper)
            && match sb.merge(&seed.upper) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(sandbox = %common.id, error = %e,
                        "remounting a fork's layer");
                    false
                }
            };
        if !merged {
            let staged = StagedLayers::stage(&layers.disk, &seed.upper)?;
            sb.remount(&staged, "(the fork point)")?;
            staged.swap_in(&layers.disk, &layers.upper, &layers.work)?;
        }
        let layer_ms = ms(t);
        let t = std::time::Instant::now();
        seed.plant_scratch(&layers.scratch)?;
        tracing::debug!(sandbox = %common.id, merged, layer_ms, scratch_ms = ms(t),
            "fork planted into a pooled sandbox");
        merged
    };
    let now = now_ms();
    let mut info = lock(&common.info);
    info.labels = req.labels.clone();
    info.created_at_ms = now;
    info.expires_at_ms = req.ttl_secs.map(|t| now + t * 1000);
    if let Some(e) = &seed.enforcement {
        info.enforcement = e.clone();
    }
    Ok(merged)
}

impl<B: Backend> SandboxApi for Sandboxes<B> {
    fn create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        let sb = self.backend.start(&req)?;
        let _ = sb.common().origin.set(req);
        let info = Self::info_of(&sb);
        self.backend.table().insert(info.id.clone(), sb)?;
        tracing::info!(sandbox = %info.id, backend = B::NAME, workspace = %info.workspace,
            image = %info.image, "sandbox created");
        Ok(info)
    }

    fn list(&self) -> Vec<SandboxInfo> {
        let mut v: Vec<SandboxInfo> = self
            .backend
            .table()
            .all()
            .iter()
            .map(|s| Self::info_of(s))
            .collect();
        v.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        v
    }

    fn info(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        let sb = self.get(id)?;
        Ok(Self::info_of(&sb))
    }

    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let sb = self.live(id)?;
        let _g = sb.common().layers.exec_shared()?;
        let mut plan = sb.common().plan(&req)?;
        if let Some(spec) = &plan.user {
            let user = exec_user(&*sb, spec)?;
            // The user's own home, unless the request sets one.
            if let Some(home) = &user.home
                && !req.env.contains_key("HOME")
            {
                plan.env.retain(|(k, _)| k != "HOME");
                plan.env.push(("HOME".into(), home.clone()));
            }
            plan.exec_user = Some(user);
        }
        let Some(events) = events else {
            return sb.exec(plan, None);
        };
        let mut forward = |e| events(e);
        let outcome = sb.exec(plan, Some(&mut forward))?;
        // The stream ends with the result, whatever the backend.
        if let ExecOutcome::Finished(result) = &outcome {
            events(ExecEvent::Ended {
                result: Box::new(result.clone()),
            });
        }
        Ok(outcome)
    }

    fn process(&self, id: &SandboxId, exec_id: u64) -> Result<ProcessInfo, ApiError> {
        Ok(self.live(id)?.common().slots.get(exec_id)?.info())
    }

    fn wait(
        &self,
        id: &SandboxId,
        exec_id: u64,
        timeout: Duration,
    ) -> Result<ProcessInfo, ApiError> {
        Ok(self.live(id)?.common().slots.get(exec_id)?.wait(timeout))
    }

    fn kill(&self, id: &SandboxId, exec_id: u64, signal: i32) -> Result<ProcessInfo, ApiError> {
        let sb = self.live(id)?;
        let slot = sb.common().slots.get(exec_id)?;
        if !(1..=64).contains(&signal) {
            return Err(ApiError::invalid(format!("invalid signal {signal}")));
        }
        if !slot.state().settled() {
            sb.signal(&slot, signal)?;
        }
        Ok(slot.info())
    }

    fn write_stdin(
        &self,
        id: &SandboxId,
        exec_id: u64,
        data: &[u8],
        close: bool,
    ) -> Result<(), ApiError> {
        let sb = self.live(id)?;
        sb.common().slots.get(exec_id)?.write_stdin(data, close)
    }

    fn read(&self, id: &SandboxId, req: ReadRequest) -> Result<ReadResult, ApiError> {
        let sb = self.live(id)?;
        let _g = sb.common().layers.shared()?;
        if let Some(r) = sb.common().layers.read_spill(&req) {
            return r;
        }
        fs_at(&*sb, Place::of(&req.path), |fs| fs.read(&req))
    }

    fn write(&self, id: &SandboxId, req: WriteRequest) -> Result<WriteResult, ApiError> {
        self.with_fs(id, Place::of(&req.path), |fs| fs.write(&req))
    }

    fn edit(&self, id: &SandboxId, req: EditRequest) -> Result<EditResult, ApiError> {
        self.with_fs(id, Place::of(&req.path), |fs| fs.edit(&req))
    }

    fn patch(&self, id: &SandboxId, req: PatchRequest) -> Result<PatchResult, ApiError> {
        // A patch's paths are the workspace's (a diff of it).
        self.with_fs(id, Place::Workspace, |fs| fs.patch(&req))
    }

    fn list_dir(&self, id: &SandboxId, req: ListRequest) -> Result<ListResult, ApiError> {
        self.with_fs(id, Place::of_opt(req.path.as_deref()), |fs| fs.list(&req))
    }

    fn search(&self, id: &SandboxId, req: SearchRequest) -> Result<SearchResult, ApiError> {
        self.with_fs(id, Place::of_opt(req.path.as_deref()), |fs| fs.search(&req))
    }

    fn stat(&self, id: &SandboxId, req: PathRequest) -> Result<StatResult, ApiError> {
        self.with_fs(id, Place::of(&req.path), |fs| fs.stat(&req))
    }

    fn remove(&self, id: &SandboxId, req: RemoveRequest) -> Result<(), ApiError> {
        self.with_fs(id, Place::of(&req.path), |fs| fs.remove(&req))
    }

    fn rename(&self, id: &SandboxId, req: MoveRequest) -> Result<(), ApiError> {
        let sb = self.live(id)?;
        let (place, req) = rename_place(&req, &sb.common().exec_base.workdir);
        let _g = sb.common().layers.shared()?;
        fs_at(&*sb, place, |fs| fs.rename(&req))
    }

    fn upload(
        &self,
        id: &SandboxId,
        req: UploadRequest,
        body: &mut (dyn std::io::Read + Send),
    ) -> Result<WriteResult, ApiError> {
        use sha2::Digest as _;
        let mut src = HashingReader {
            inner: body,
            hasher: sha2::Sha256::new(),
            failed: None,
        };
        let place = Place::of(&req.path);
        let r = self.with_fs(id, place, |fs| fs.upload(&req, &mut src));
        if let Some(e) = src.failed.take() {
            // The body failed, not the file system: the caller's side, said as such.
            return Err(ApiError::InvalidArgument(format!(
                "upload {}: the content stopped arriving: {e}",
                req.path
            )));
        }
        let mut r = r?;
        r.sha256 = Some(hex(&src.hasher.finalize()));
        Ok(r)
    }

    fn download(
        &self,
        id: &SandboxId,
        req: DownloadRequest,
        sink: &mut dyn ByteSink,
    ) -> Result<DownloadResult, ApiError> {
        use sha2::Digest as _;
        let mut sink = HashingSink {
            inner: sink,
            hasher: sha2::Sha256::new(),
        };
        let (path, bytes) =
            self.with_fs(id, Place::of(&req.path), |fs| fs.download(&req, &mut sink))?;
        Ok(DownloadResult {
            path,
            bytes,
            sha256: hex(&sink.hasher.finalize()),
        })
    }

    fn diff(&self, id: &SandboxId, req: DiffRequest) -> Result<DiffResult, ApiError> {
        self.live(id)?.common().layers.diff(&req)
    }

    fn checkpoint(
        &self,
        id: &SandboxId,
        req: CheckpointRequest,
    ) -> Result<CheckpointInfo, ApiError> {
        let sb = self.live(id)?;
        sb.common().layers.checkpoint(req, &sb.common().info)
    }

    fn restore(&self, id: &SandboxId, req: CheckpointRequest) -> Result<(), ApiError> {
        let sb = self.live(id)?;
        sb.common().layers.restore(
            &req.name,
            || sb.stop_all(),
            |staged| sb.remount(staged, &req.name),
        )
    }

    fn export(&self, id: &SandboxId, req: ExportRequest) -> Result<ExportResult, ApiError> {
        self.live(id)?.common().layers.export(&req, id)
    }

    fn destroy(&self, id: &SandboxId) -> Result<(), ApiError> {
        let sb = self.backend.table().remove(id)?;
        self.backend.end(sb);
        tracing::info!(sandbox = %id, backend = B::NAME, "sandbox destroyed");
        Ok(())
    }

    fn set_network(&self, id: &SandboxId, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        self.live(id)?.common().set_network(rules)
    }

    fn fork(&self, id: &SandboxId, req: ForkRequest) -> Result<ForkResult, ApiError> {
        let count = req.count()?;
        let parent = self.live(id)?;
        let common = parent.common();
        let info = Self::info_of(&parent);
        let origin = common.origin.get().ok_or_else(|| {
            ApiError::invalid(format!(
                "sandbox {id} was not created by this backend's create, so its create request \
                 is unknown: it cannot be forked"
            ))
        })?;
        let child = fork_request(origin, &info, &req);
        // The frozen copy goes on the parent's own disk (a directory no mount of the sandbox
        // shows), where making its files is cheap; on the state directory, each was an inode
        // found past every one freed there in the last minute (ext4 without a journal, see
        // decisions.md). Should the parent's disk be full, the state directory takes it.
        let name = SandboxId::generate();
        let on_disk = common.layers.disk.join(format!(".fork-{name}"));
        let on_state = common
            .layers
            .checkpoints
            .with_file_name("forks")
            .join(name.as_str());
        let t = std::time::Instant::now();
        let mut seed = match common.layers.freeze(&on_disk, req.checkpoint.as_deref()) {
            Ok(seed) => seed,
            Err(e) if req.checkpoint.is_none() => {
                tracing::debug!(sandbox = %id, error = %e, "freezing on the state directory");
                common.layers.freeze(&on_state, None)?
            }
            Err(e) => return Err(e),
        };
        seed.enforcement = Some(info.enforcement.clone());
        let frozen_ms = t.elapsed().as_secs_f64() * 1000.0;
        let from = ForkOrigin {
            parent: id.clone(),
            checkpoint: req.checkpoint.clone(),
            forked_at_ms: now_ms(),
        };
        let Forks {
            sandboxes: forks,
            from_pool,
        } = self.start_forks(&child, &seed, count)?;
        drop(seed);
        let mut infos: Vec<SandboxInfo> = Vec::with_capacity(forks.len());
        let mut left = forks.into_iter();
        while let Some(sb) = left.next() {
            let _ = sb.common().origin.set(child.clone());
            lock(&sb.common().info).forked_from = Some(from.clone());
            let info = Self::info_of(&sb);
            if let Err(e) = self.backend.table().insert(info.id.clone(), sb.clone()) {
                // All or none: the table cannot take them (it is poisoned).
                self.backend.end(sb);
                left.for_each(|sb| self.backend.end(sb));
                for done in &infos {
                    let _ = self.destroy(&done.id);
                }
                return Err(e);
            }
            infos.push(info);
        }
        tracing::info!(sandbox = %id, backend = B::NAME, forks = infos.len(), from_pool,
            checkpoint = ?req.checkpoint, frozen_ms, total_ms = t.elapsed().as_secs_f64() * 1000.0,
            "sandbox forked");
        Ok(ForkResult { sandboxes: infos })
    }

    fn set_secret(&self, id: &SandboxId, update: SecretUpdate) -> Result<SecretStatus, ApiError> {
        self.get(id)?.common().set_secret(update)
    }
}

/// How long a restore waits for the execs it stopped to settle.
pub const STOP_WAIT: Duration = Duration::from_secs(5);

/// Waits (up to [`STOP_WAIT`]) until `sb` is the last handle of its sandbox, then drops it: what
/// the sandbox owns (its directories) is gone when this returns, not when the last driver of a
/// background exec lets go of it.
pub fn release<S>(sb: Arc<S>) {
    let deadline = std::time::Instant::now() + STOP_WAIT;
    while Arc::strong_count(&sb) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(sb);
}
