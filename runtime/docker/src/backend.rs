//! [`DockerBackend`]: the narrow API over Docker containers.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use bollard::models::{ContainerCreateBody, HostConfig, ResourcesUlimits};
use bollard::query_parameters::{
    CreateContainerOptions, InspectContainerOptions, ListContainersOptions, RemoveContainerOptions,
    StartContainerOptions,
};
use sha2::{Digest, Sha256};
use taskbox_core::api::*;
use taskbox_core::disk::Disk;
use taskbox_core::egress::{self, EgressLog, EgressService, SandboxEgress};
use taskbox_core::image::{ImageResolver, ImageRoot};
use taskbox_core::kit::layers::overlay_workspace;
use taskbox_core::kit::{
    Backend, Common, ExecBase, Layers, SPILL_MOUNT, Sandboxes, Seed, Table, lock, now_ms,
};
use taskbox_core::native;
use taskbox_core::policy::{self, NetworkMode, Policy, RootMode, WorkspaceMode};
use taskbox_core::result::Enforcement;

use crate::daemon::{DEFAULT_SOCKET, Daemon, DaemonError};
use crate::hostmount;
use crate::images::ensure_image;
use crate::procfs::{self, ProcId};
use crate::sandbox::{Dirs, INIT_PATH, Overlay, RUN_MOUNT, Sandbox};

/// Labels on every container of taskbox.
pub const LABEL_OWNER: &str = "io.taskbox.owner";
pub const LABEL_SANDBOX: &str = "io.taskbox.sandbox";
pub const LABEL_LEASE: &str = "io.taskbox.lease-expires-ms";
pub const LABEL_IMAGE: &str = "io.taskbox.image";
pub const LABEL_POLICY: &str = "io.taskbox.policy-hash";

/// The container user when the image names none.
pub const DEFAULT_USER: (u32, u32) = (1000, 1000);

/// The Docker backend's settings.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// The daemon's socket (`unix:///PATH`); default `$DOCKER_HOST` when it is a Unix socket,
    /// else the usual one.
    pub socket: String,
    /// Pre-started containers kept per (image, policy) that has been asked for (0: no pool).
    pub pool_size: usize,
    /// (image, policy) pairs whose pool is filled from the start.
    pub warm: Vec<(String, String)>,
    /// Limit of one ordinary daemon call.
    pub call_timeout: Duration,
    /// Limit of loading an image into the daemon.
    pub load_timeout: Duration,
    /// How long a pooled container may wait for a sandbox before it is replaced.
    pub pool_max_idle: Duration,
    /// Starts the egress proxies of sandboxes whose policy has network mode "proxy" (each
    /// reached through a listener made in its container's network namespace); without it such
    /// sandboxes are refused.
    pub egress: Option<Arc<dyn EgressService>>,
}

impl Default for DockerConfig {
    fn default() -> DockerConfig {
        let socket = std::env::var("DOCKER_HOST")
            .ok()
            .filter(|h| h.starts_with("unix://"))
            .unwrap_or_else(|| DEFAULT_SOCKET.to_string());
        DockerConfig {
            socket,
            pool_size: 0,
            warm: Vec::new(),
            call_timeout: Duration::from_secs(15),
            load_timeout: Duration::from_secs(300),
            pool_max_idle: Duration::from_secs(3600),
            egress: None,
        }
    }
}

/// A container started for a sandbox, before (or without yet) its workspace.
struct Prepared {
    id: SandboxId,
    dirs: Dirs,
    container: String,
    init: ProcId,
    created: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    image: String,
    policy_hash: String,
}

struct PoolSpec {
    image: ImageRoot,
    policy: Policy,
}

#[derive(Default)]
struct Pool {
    specs: HashMap<PoolKey, Arc<PoolSpec>>,
    ready: HashMap<PoolKey, Vec<Prepared>>,
    /// Containers to remove once the daemon answers again.
    doomed: Vec<String>,
    /// The start-up sweep could not reach the daemon: try again.
    sweep_pending: bool,
    stop: bool,
}

pub(crate) struct Inner {
    root: PathBuf,
    exports: PathBuf,
    owner: String,
    daemon: Arc<Daemon>,
    images: Arc<dyn ImageResolver>,
    config: DockerConfig,
    wrapper: PathBuf,
    limits_kind: String,
    table: Table<Sandbox>,
    pool: Mutex<Pool>,
    pool_cond: Condvar,
    _lock: fs::File,
}

/// The Docker backend: one hardened container per sandbox (see [`Docker`]).
pub type DockerBackend = Sandboxes<Docker>;

/// How the Docker backend starts and ends sandboxes, and its pool of prepared containers.
pub struct Docker {
    inner: Arc<Inner>,
    pool_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Docker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerBackend")
            .field("root", &self.inner.root)
            .field("owner", &self.inner.owner)
            .finish()
    }
}

fn io_internal(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> ApiError {
    let msg = format!("{what} {}", path.display());
    move |e| ApiError::internal(format!("{msg}: {e}"))
}

/// The owner label of a backend keeping its state in `root`.
pub fn owner_id(root: &Path) -> String {
    let canonical = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let digest = Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Parses an image's `UID[:GID]`.
fn parse_user(user: Option<&str>) -> Result<(u32, u32), ApiError> {
    let Some(u) = user.filter(|u| !u.is_empty()) else {
        return Ok(DEFAULT_USER);
    };
    let (uid, gid) = match u.split_once(':') {
        Some((a, b)) => (a.parse::<u32>(), b.parse::<u32>()),
        None => (u.parse::<u32>(), u.parse::<u32>()),
    };
    match (uid, gid) {
        (Ok(0), _) | (_, Ok(0)) => Err(ApiError::invalid(format!(
            "the image's user is {u}: the docker backend runs sandboxes as a non-root user; \
             set the image's user to a non-zero UID[:GID]"
        ))),
        (Ok(uid), Ok(gid)) => Ok((uid, gid)),
        _ => Err(ApiError::invalid(format!(
            "the image's user {u:?} is not numeric UID[:GID]"
        ))),
    }
}

impl Docker {
    /// A backend keeping its state in `STATE/docker` (`state_dir` is taskbox's state directory).
    /// Needs root (it mounts the workspace overlays on the host). Whatever an earlier process
    /// with this state directory left (containers with its owner label, mounts, directories)
    /// is removed; when the daemon cannot be reached now, that is retried in the background.
    pub fn open(
        state_dir: &Path,
        images: Arc<dyn ImageResolver>,
        config: DockerConfig,
    ) -> Result<DockerBackend, ApiError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(ApiError::invalid(
                "the docker backend needs root: it mounts each sandbox's workspace overlay on \
                 the host (run the supervisor as root, or use the native backend)",
            ));
        }
        let root = state_dir.join("docker");
        if root.to_string_lossy().contains([',', ':', '\\', '\n']) {
            return Err(ApiError::invalid(format!(
                "state directory {}: the path contains ',', ':' or '\\', which Docker bind and \
                 overlay options cannot carry",
                state_dir.display()
            )));
        }
        // The sandboxes' layers live below: the owner's alone (see `private_dir`).
        taskbox_core::native::private_dir(&root).map_err(io_internal("cannot create", &root))?;
        for d in [root.join("sandboxes"), root.join("bin")] {
            fs::create_dir_all(&d).map_err(io_internal("cannot create", &d))?;
        }
        let lock_path = root.join(".lock");
        let lock_file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_internal("cannot open", &lock_path))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let rc = unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Err(ApiError::Conflict(format!(
                "another taskbox process uses the docker state in {}; stop it or choose \
                 another --state-dir",
                root.display()
            )));
        }
        // Sandbox mounts live under a private mount point: they reach the containers (as slaves of
        // each sandbox's shared mount point) and nothing else.
        hostmount::make_private_mountpoint(&root).map_err(|e| ApiError::internal(e.to_string()))?;
        let wrapper = install_wrapper(&root.join("bin"))?;
        let daemon = Arc::new(Daemon::new(&config.socket, config.call_timeout)?);
        let limits_kind = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            "cgroup-v2"
        } else {
            "cgroup-v1"
        }
        .to_string();
        let inner = Arc::new(Inner {
            owner: owner_id(&root),
            exports: state_dir.join("exports"),
            root,
            daemon,
            images,
            config,
            wrapper,
            limits_kind,
            table: Table::default(),
            pool: Mutex::new(Pool::default()),
            pool_cond: Condvar::new(),
            _lock: lock_file,
        });
        inner.sweep();
        for (image, policy) in inner.config.warm.clone() {
            if let Err(e) = inner.register_pool(&image, &policy) {
                tracing::warn!(%image, %policy, error = %e, "cannot warm a pool");
            }
        }
        let weak = Arc::downgrade(&inner);
        let thread = std::thread::Builder::new()
            .name("docker-pool".into())
            .spawn(move || pool_loop(weak))
            .map_err(|e| ApiError::internal(format!("cannot start the pool thread: {e}")))?;
        Ok(Sandboxes::of(Docker {
            inner,
            pool_thread: Mutex::new(Some(thread)),
        }))
    }

    /// The owner label value of this backend's containers.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The daemon socket.
    pub fn socket(&self) -> &str {
        self.inner.daemon.socket()
    }

    /// Containers waiting in the pool for (image, policy).
    pub fn pooled(&self, image: &str, policy: &str) -> usize {
        let Ok(key) = self.inner.pool_key(image, policy) else {
            return 0;
        };
        lock(&self.inner.pool)
            .ready
            .get(&key)
            .map(Vec::len)
            .unwrap_or(0)
    }

    /// The container of a sandbox (its Docker name).
    pub fn container_name(&self, id: &SandboxId) -> Result<String, ApiError> {
        Ok(self.inner.get(id)?.container.clone())
    }

    /// Where on the host a spill file of a sandbox is, given its path as an ExecResult shows it
    /// (inside the container, under the read-only spill mount). It lives until the sandbox is
    /// destroyed; a one-shot run moves it out first.
    pub fn spill_file(&self, id: &SandboxId, shown: &str) -> Result<PathBuf, ApiError> {
        let sb = self.inner.get(id)?;
        Path::new(shown)
            .strip_prefix(SPILL_MOUNT)
            .ok()
            .and_then(|rest| {
                let mut parts = rest.components();
                match (parts.next(), parts.next()) {
                    (Some(std::path::Component::Normal(name)), None) => {
                        Some(sb.dirs.out().join(name))
                    }
                    _ => None,
                }
            })
            .ok_or_else(|| {
                ApiError::invalid(format!("{shown} is not a spill file of sandbox {id}"))
            })
    }
}

/// Writes the embedded wrapper to `bin/init-SHA` once (mode 0755) and returns its path.
fn install_wrapper(bin: &Path) -> Result<PathBuf, ApiError> {
    let digest = Sha256::digest(crate::WRAPPER);
    let name: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let path = bin.join(format!("init-{name}"));
    if fs::read(&path).is_ok_and(|b| b == crate::WRAPPER) {
        return Ok(path);
    }
    let tmp = bin.join(format!(".init-{name}.{}", std::process::id()));
    let mut f = fs::File::create(&tmp).map_err(io_internal("cannot create", &tmp))?;
    f.write_all(crate::WRAPPER)
        .and_then(|_| f.sync_all())
        .map_err(io_internal("cannot write", &tmp))?;
    drop(f);
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
        .map_err(io_internal("cannot chmod", &tmp))?;
    fs::rename(&tmp, &path).map_err(io_internal("cannot install", &path))?;
    Ok(path)
}

impl Inner {
    fn get(&self, id: &SandboxId) -> Result<Arc<Sandbox>, ApiError> {
        self.table.get(id)
    }

    fn pool_key(&self, image: &str, policy_name: &str) -> Result<PoolKey, ApiError> {
        let image = self.images.resolve(image)?;
        let (policy, _) =
            policy::resolve(policy_name).map_err(|e| ApiError::invalid(e.to_string()))?;
        Ok(PoolKey {
            image: image.digest,
            policy_hash: policy.hash(),
        })
    }

    fn register_pool(&self, image: &str, policy_name: &str) -> Result<(), ApiError> {
        let image = self.images.resolve(image)?;
        let (policy, _) =
            policy::resolve(policy_name).map_err(|e| ApiError::invalid(e.to_string()))?;
        self.register_spec(image, policy);
        Ok(())
    }

    fn register_spec(&self, image: ImageRoot, policy: Policy) {
        if self.config.pool_size == 0 {
            return;
        }
        let key = PoolKey {
            image: image.digest.clone(),
            policy_hash: policy.hash(),
        };
        let mut pool = lock(&self.pool);
        pool.specs
            .entry(key)
            .or_insert_with(|| Arc::new(PoolSpec { image, policy }));
        drop(pool);
        self.pool_cond.notify_all();
    }

    /// Removes what an earlier process left: its containers, then its mounts and directories.
    fn sweep(&self) {
        match self.remove_owned_containers() {
            Ok(n) if n > 0 => tracing::info!(count = n, "removed containers an earlier run left"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for leftover containers now; retrying");
                lock(&self.pool).sweep_pending = true;
            }
        }
        let Ok(rd) = fs::read_dir(self.root.join("sandboxes")) else {
            return;
        };
        for e in rd.flatten() {
            let dir = e.path();
            tracing::info!(dir = %dir.display(), "removing what an earlier run left");
            remove_sandbox_dir(&dir);
        }
    }

    /// Force-removes every container with this backend's owner label that no live sandbox or
    /// pooled container of this process uses.
    fn remove_owned_containers(&self) -> Result<usize, DaemonError> {
        let d = &self.daemon;
        let mut filters = HashMap::new();
        filters.insert(
            "label".to_string(),
            vec![format!("{LABEL_OWNER}={}", self.owner)],
        );
        let list = d.block_on(d.call(
            "list containers",
            d.timeout,
            d.docker.list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            })),
        ))?;
        let mut ours: Vec<String> = self
            .table
            .all()
            .iter()
            .map(|s| s.container.clone())
            .collect();
        ours.extend(
            lock(&self.pool)
                .ready
                .values()
                .flatten()
                .map(|p| p.container.clone()),
        );
        let mut removed = 0;
        for c in list {
            let names: Vec<String> = c
                .names
                .unwrap_or_default()
                .iter()
                .map(|n| n.trim_start_matches('/').to_string())
                .collect();
            if names.iter().any(|n| ours.contains(n)) {
                continue;
            }
            let Some(id) = c.id else { continue };
            self.remove_container(&id)?;
            removed += 1;
        }
        Ok(removed)
    }

    fn remove_container(&self, name: &str) -> Result<(), DaemonError> {
        let d = &self.daemon;
        let r = d.block_on(d.call(
            "remove a container",
            d.timeout,
            d.docker.remove_container(
                name,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    ..Default::default()
                }),
            ),
        ));
        match r {
            Ok(()) | Err(DaemonError::NotFound(_)) => Ok(()),
            // Removal already under way.
            Err(DaemonError::Conflict(m)) if m.contains("in progress") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Removes a container now, or later when the daemon cannot be reached.
    fn discard_container(&self, name: &str) {
        if let Err(e) = self.remove_container(name) {
            tracing::warn!(container = name, error = %e, "cannot remove the container now; retrying");
            lock(&self.pool).doomed.push(name.to_string());
            self.pool_cond.notify_all();
        }
    }

    fn discard(&self, p: Prepared) {
        self.discard_container(&p.container);
        remove_sandbox_dir(&p.dirs.0);
    }

    fn body(
        &self,
        id: &SandboxId,
        dirs: &Dirs,
        image: &ImageRoot,
        policy: &Policy,
        user: (u32, u32),
        lease_ms: Option<u64>,
    ) -> ContainerCreateBody {
        let limits = &policy.limits;
        let mut labels = HashMap::new();
        labels.insert(LABEL_OWNER.to_string(), self.owner.clone());
        labels.insert(LABEL_SANDBOX.to_string(), id.to_string());
        labels.insert(
            LABEL_LEASE.to_string(),
            lease_ms
                .map(|l| l.to_string())
                .unwrap_or_else(|| "0".into()),
        );
        labels.insert(LABEL_IMAGE.to_string(), image.digest.clone());
        labels.insert(LABEL_POLICY.to_string(), policy.hash());
        let seccomp = crate::seccomp::profile().to_string();
        // /tmp is a directory of the sandbox's disk, so it counts against limits.disk.
        let binds = vec![
            format!("{}:{INIT_PATH}:ro", self.wrapper.display()),
            format!("{}:{RUN_MOUNT}:rw", dirs.run().display()),
            format!("{}:{SPILL_MOUNT}:ro", dirs.out().display()),
            format!("{}:{}:ro", dirs.egress().display(), egress::EGRESS_MOUNT),
            format!("{}:/tmp:rw", dirs.tmp().display()),
            format!(
                "{}:{}:rw,rslave",
                dirs.mnt().display(),
                image.config.workdir
            ),
        ];
        let ulimit = |name: &str, v: u64| ResourcesUlimits {
            name: Some(name.into()),
            soft: Some(v.min(i64::MAX as u64) as i64),
            hard: Some(v.min(i64::MAX as u64) as i64),
        };
        let memory = limits.memory_bytes.min(i64::MAX as u64) as i64;
        // `security.root_capabilities`: the container's bounding set. Docker gives a process its
        // capabilities (effective and permitted) only when it starts as uid 0 in a container
        // whose own user is root (no-new-privileges keeps an exec from gaining them through
        // execve): so such a container's pid 1 (taskbox's init, which only reaps) is root, and
        // every exec names its user, the image's unless the request names another.
        let caps: Vec<String> = policy
            .security
            .root_capabilities
            .iter()
            .map(|c| c.kernel_name().to_string())
            .collect();
        let container_user = if caps.is_empty() { user } else { (0, 0) };
        ContainerCreateBody {
            image: Some(image.config_digest.clone()),
            entrypoint: Some(vec![INIT_PATH.to_string()]),
            cmd: Some(vec!["init".to_string()]),
            user: Some(crate::sandbox::docker_user(container_user)),
            working_dir: Some("/".into()),
            hostname: Some("taskbox".into()),
            labels: Some(labels),
            network_disabled: Some(true),
            host_config: Some(HostConfig {
                cap_drop: Some(vec!["ALL".into()]),
                cap_add: Some(caps).filter(|c| !c.is_empty()),
                security_opt: Some(vec![
                    "no-new-privileges:true".into(),
                    format!("seccomp={seccomp}"),
                ]),
                // `filesystem.root = "writable"`: the container's own layer, removed with it.
                readonly_rootfs: Some(policy.filesystem.root == RootMode::ReadOnly),
                network_mode: Some("none".into()),
                ipc_mode: Some("private".into()),
                init: Some(false),
                privileged: Some(false),
                pids_limit: Some(limits.pids.min(i64::MAX as u64) as i64),
                memory: Some(memory),
                memory_swap: Some(memory),
                nano_cpus: Some((limits.cpu_cores * 1e9) as i64),
                ulimits: Some(vec![
                    ulimit("nofile", limits.open_files),
                    ulimit("fsize", limits.file_size_bytes),
                    ulimit("core", 0),
                ]),
                binds: Some(binds),
                auto_remove: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Starts a container for a new sandbox: its directories, the shared mount point of its
    /// workspace, the image in the daemon, the container itself.
    fn prepare(
        &self,
        image: &ImageRoot,
        policy: &Policy,
        lease_ms: Option<u64>,
    ) -> Result<Prepared, ApiError> {
        let user = parse_user(image.config.user.as_deref())?;
        let id = SandboxId::generate();
        let dirs = Dirs(self.root.join("sandboxes").join(id.as_str()));
        let made = (|| -> Result<(), ApiError> {
            fs::create_dir_all(&dirs.0).map_err(io_internal("cannot create", &dirs.0))?;
            // The disk quota first: the layers, /tmp, the status and spill files live on it. It
            // stays mounted until the sandbox's directory is removed (with every mount in it).
            Disk::mount_on_host(
                &dirs.0,
                policy.limits.disk_bytes,
                &self.root.join("disk-templates"),
            )
            .map_err(|e| ApiError::internal(e.to_string()))?
            .keep_mounted();
            for d in [dirs.mnt(), dirs.checkpoints(), dirs.egress()] {
                fs::create_dir_all(&d).map_err(io_internal("cannot create", &d))?;
            }
            let _ = fs::set_permissions(dirs.egress(), fs::Permissions::from_mode(0o755));
            fs::write(dirs.empty(), b"").map_err(io_internal("cannot create", &dirs.empty()))?;
            let _ = fs::set_permissions(dirs.empty(), fs::Permissions::from_mode(0o444));
            let _ = fs::set_permissions(dirs.out(), fs::Permissions::from_mode(0o755));
            // Every user an exec may run as writes its wrapper's status file there: all may
            // add files, none may list the directory or replace another's file.
            std::os::unix::fs::chown(dirs.run(), Some(user.0), Some(user.1))
                .and_then(|_| fs::set_permissions(dirs.run(), fs::Permissions::from_mode(0o1733)))
                .map_err(io_internal("cannot prepare", &dirs.run()))?;
            hostmount::make_shared_mountpoint(&dirs.mnt())
                .map_err(|e| ApiError::internal(e.to_string()))
        })();
        if let Err(e) = made {
            remove_sandbox_dir(&dirs.0);
            return Err(e);
        }
        let started = (|| -> Result<(String, ProcId), ApiError> {
            ensure_image(&self.daemon, &*self.images, image, self.config.load_timeout)?;
            let name = format!("taskbox-{id}");
            let body = self.body(&id, &dirs, image, policy, user, lease_ms);
            let d = &self.daemon;
            d.block_on(async {
                d.call(
                    "create a container",
                    d.timeout,
                    d.docker.create_container(
                        Some(CreateContainerOptions {
                            name: Some(name.clone()),
                            ..Default::default()
                        }),
                        body,
                    ),
                )
                .await?;
                d.call(
                    "start a container",
                    d.timeout,
                    d.docker
                        .start_container(&name, None::<StartContainerOptions>),
                )
                .await?;
                let inspect = d
                    .call(
                        "inspect a container",
                        d.timeout,
                        d.docker
                            .inspect_container(&name, None::<InspectContainerOptions>),
                    )
                    .await?;
                let pid = inspect.state.and_then(|s| s.pid).unwrap_or(0) as i32;
                Ok::<_, DaemonError>(pid)
            })
            .map_err(ApiError::from)
            .and_then(|pid| {
                ProcId::of(pid)
                    .filter(|_| pid > 0)
                    .map(|p| (name.clone(), p))
                    .ok_or_else(|| {
                        ApiError::internal(format!(
                            "the container {name} started but is not running"
                        ))
                    })
            })
            .inspect_err(|_| self.discard_container(&name))
        })();
        match started {
            Ok((container, init)) => Ok(Prepared {
                id,
                dirs,
                container,
                init,
                created: Instant::now(),
            }),
            Err(e) => {
                remove_sandbox_dir(&dirs.0);
                Err(e)
            }
        }
    }

    /// A pooled container for `key`, if one is ready and alive.
    fn take_pooled(&self, key: &PoolKey) -> Option<Prepared> {
        let mut pool = lock(&self.pool);
        let list = pool.ready.get_mut(key)?;
        let mut stale = Vec::new();
        let mut found = None;
        while let Some(p) = list.pop() {
            if procfs::alive(&p.init) {
                found = Some(p);
                break;
            }
            stale.push(p);
        }
        drop(pool);
        self.pool_cond.notify_all();
        for p in stale {
            self.discard(p);
        }
        found
    }

    /// A sandbox for `req`; a fork's layers from `seed`, put on its disk before its overlay is
    /// mounted (its `/tmp`, bound in a pooled container already, is filled in place).
    fn create(&self, req: &CreateRequest, seed: Option<&Seed>) -> Result<Arc<Sandbox>, ApiError> {
        if req.backend.as_deref() != Some("docker") {
            return Err(ApiError::invalid(format!(
                "backend {:?} is not this one; the docker backend takes backend \"docker\"",
                req.backend.as_deref().unwrap_or("native")
            )));
        }
        let Some(image_name) = &req.image else {
            return Err(ApiError::invalid(
                "the docker backend needs an image: give image (a name or digest)",
            ));
        };
        let resolved = req.for_backend()?;
        let policy_name = resolved.name.clone();
        let policy = resolved.policy.clone();
        let egress_service = match (policy.network.mode, &self.config.egress) {
            (NetworkMode::None, _) => None,
            (NetworkMode::Proxy, Some(service)) => Some(service.clone()),
            (NetworkMode::Proxy, None) => {
                return Err(ApiError::invalid(format!(
                    "policy {policy_name:?} has network mode \"proxy\", and this docker backend \
                     was started without the egress proxy"
                )));
            }
            (NetworkMode::Host, _) => {
                return Err(ApiError::invalid(format!(
                    "policy {policy_name:?} has network mode \"host\": the docker backend gives \
                     containers no network but loopback, or the egress proxy (mode \"proxy\"); \
                     use the native backend for the host's network"
                )));
            }
        };
        // Read before a container is taken: a secret that cannot be had refuses the create.
        let secrets = match egress_service {
            Some(_) => egress::resolve_secrets(&policy, &req.secrets)?,
            None => Vec::new(),
        };
        for (k, v) in &req.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "invalid environment variable name {k:?}"
                )));
            }
        }
        // An environment no exec could pass to execve is refused now, not at every exec.
        let env: Vec<(String, String)> = req.env.clone().into_iter().collect();
        taskbox_core::exec_limits::Command {
            argv: &[],
            env: &env,
            shell: false,
            extra: &[],
        }
        .check(taskbox_core::exec_limits::argument_space(
            crate::sandbox::DEFAULT_STACK,
        ))?;
        let workspace = overlay_workspace(&req.workspace)?;
        if workspace.starts_with(&self.root) {
            return Err(ApiError::invalid(format!(
                "workspace {} lies inside taskbox's state directory",
                workspace.display()
            )));
        }
        // What the container must not find in its workspace: taskbox's own state, the host's
        // bound sockets, the deny list.
        let state_dir = self.root.parent().unwrap_or(&self.root);
        let hidden = taskbox_core::hostdirs::for_workspace(&workspace, state_dir, &[])
            .map_err(|why| ApiError::invalid(format!("workspace refused: {why}")))?;
        let masked =
            taskbox_core::hostdirs::inside_workspace(&workspace, &hidden, policy.denied_paths());
        let image = self.images.resolve(image_name)?;
        let user = parse_user(image.config.user.as_deref())?;
        let key = PoolKey {
            image: image.digest.clone(),
            policy_hash: policy.hash(),
        };
        let created = now_ms();
        let expires = req.ttl_secs.map(|t| created + t * 1000);
        let prepared = match self.take_pooled(&key) {
            Some(p) => p,
            None => self.prepare(&image, &policy, expires)?,
        };
        self.register_spec(image.clone(), policy.clone());

        let dirs = prepared.dirs.clone();
        let attached = (|| -> Result<Overlay, ApiError> {
            let md = fs::metadata(&workspace).map_err(io_internal("cannot stat", &workspace))?;
            let owner = (md.uid(), md.gid());
            let lower = if owner == user {
                workspace.clone()
            } else {
                fs::create_dir_all(dirs.lower())
                    .map_err(io_internal("cannot create", &dirs.lower()))?;
                hostmount::idmapped_bind(&workspace, &dirs.lower(), owner, user).map_err(|e| {
                    ApiError::internal(format!(
                        "the workspace belongs to uid {} and the container user is uid {}: {e}",
                        owner.0, user.0
                    ))
                })?;
                dirs.lower()
            };
            let overlay = Overlay {
                workspace: workspace.clone(),
                lower,
                user,
                masked: masked.clone(),
            };
            overlay.prepare_upper(&dirs.upper())?;
            if let Some(seed) = seed {
                seed.plant(&dirs.disk())?;
            }
            overlay.mount(&dirs, &dirs.upper(), &dirs.work(), &policy)?;
            Ok(overlay)
        })();
        let overlay = match attached {
            Ok(o) => o,
            Err(e) => {
                self.discard(prepared);
                return Err(e);
            }
        };
        // Network mode "proxy": the container has only loopback; its proxy accepts on a
        // listener bound to 127.0.0.1:3128 in the container's network namespace.
        let egress = match egress_service
            .map(|service| start_egress(service.as_ref(), &prepared, &policy, secrets))
            .transpose()
        {
            Ok(e) => e,
            Err(e) => {
                self.discard(prepared);
                return Err(e);
            }
        };
        // The same order as the native backend: the fixed variables, the image's, the
        // policy's, the request's.
        // The same layers as a native sandbox's, without the host's variables.
        let mut base_env = native::layer_env(Vec::new(), &policy, &image.config.env, &req.env);
        // Inspected hosts: the CA bundle in the container, its variables and the secrets'
        // placeholders (before the request's own variables, which win).
        if let Some(trust) = egress.as_ref().and_then(|e| e.proxy.trust()) {
            if let Err(e) = egress::write_trust(&dirs.egress(), &trust) {
                if let Some(e) = &egress {
                    e.proxy.shutdown();
                }
                self.discard(prepared);
                return Err(ApiError::internal(format!(
                    "cannot write the sandbox's CA bundle: {e}"
                )));
            }
            for (k, v) in egress::trust_env(&trust) {
                if !req.env.contains_key(&k) {
                    base_env.retain(|(ek, _)| *ek != k);
                    base_env.push((k, v));
                }
            }
        }
        let info = SandboxInfo {
            id: prepared.id.clone(),
            backend: "docker".into(),
            workspace: workspace.display().to_string(),
            policy: policy_name,
            policy_hash: policy.hash(),
            image: image.digest.clone(),
            enforcement: Enforcement {
                landlock: "none".into(),
                seccomp: true,
                network: policy.network.mode.as_str().into(),
                limits: self.limits_kind.clone(),
                disk: "loop-ext4".into(),
            },
            labels: req.labels.clone(),
            created_at_ms: created,
            expires_at_ms: expires,
            state: "running".into(),
            checkpoints: Vec::new(),
            lost_cause: None,
            forked_from: None,
        };
        tracing::debug!(sandbox = %prepared.id, age_ms = prepared.created.elapsed().as_millis() as u64, "container ready");
        let layers = Layers::new(
            overlay.workspace.clone(),
            dirs.disk(),
            dirs.checkpoints(),
            dirs.out(),
        )
        .with_exports(self.exports.clone())
        .with_overlay(policy.filesystem.workspace == WorkspaceMode::Overlay)
        .with_scratch("tmp", dirs.tmp());
        let exec_base = ExecBase {
            workdir: image.config.workdir.clone(),
            env: base_env,
            shell: None,
        };
        Ok(Arc::new(Sandbox {
            common: Common::new(info, policy, exec_base, layers)
                .with_egress(egress)
                .with_user(overlay.sandbox_user()),
            dirs,
            overlay,
            container: prepared.container,
            init: prepared.init,
            lost: AtomicBool::new(false),
            daemon: self.daemon.clone(),
            limits_kind: self.limits_kind.clone(),
        }))
    }

    fn destroy(&self, sb: &Sandbox) {
        sb.common.slots.end_all("the sandbox was destroyed");
        if let Some(e) = &sb.common.egress {
            e.proxy.shutdown();
        }
        self.discard_container(&sb.container);
        remove_sandbox_dir(&sb.dirs.0);
    }

    /// One round of the pool thread's work; returns whether there is more to do now.
    fn pool_round(&self) -> bool {
        let (sweep, doomed) = {
            let mut pool = lock(&self.pool);
            (
                std::mem::take(&mut pool.sweep_pending),
                std::mem::take(&mut pool.doomed),
            )
        };
        if sweep {
            match self.remove_owned_containers() {
                Ok(_) => {}
                Err(_) => {
                    lock(&self.pool).sweep_pending = true;
                    return false;
                }
            }
        }
        for (i, name) in doomed.iter().enumerate() {
            if self.remove_container(name).is_err() {
                lock(&self.pool).doomed.extend(doomed[i..].iter().cloned());
                return false;
            }
        }
        // Replace pooled containers that died or waited too long.
        let expired: Vec<Prepared> = {
            let mut pool = lock(&self.pool);
            let max_idle = self.config.pool_max_idle;
            let mut out = Vec::new();
            for list in pool.ready.values_mut() {
                let (keep, drop_): (Vec<_>, Vec<_>) = std::mem::take(list)
                    .into_iter()
                    .partition(|p| procfs::alive(&p.init) && p.created.elapsed() < max_idle);
                *list = keep;
                out.extend(drop_);
            }
            out
        };
        for p in expired {
            self.discard(p);
        }
        let wanted = {
            let pool = lock(&self.pool);
            if pool.stop {
                return false;
            }
            pool.specs
                .iter()
                .find(|(k, _)| {
                    pool.ready.get(*k).map(Vec::len).unwrap_or(0) < self.config.pool_size
                })
                .map(|(k, s)| (k.clone(), s.clone()))
        };
        let Some((key, spec)) = wanted else {
            return false;
        };
        let lease = now_ms() + self.config.pool_max_idle.as_millis() as u64;
        match self.prepare(&spec.image, &spec.policy, Some(lease)) {
            Ok(p) => {
                let mut pool = lock(&self.pool);
                if pool.stop {
                    drop(pool);
                    self.discard(p);
                    return false;
                }
                pool.ready.entry(key).or_default().push(p);
                true
            }
            Err(e) => {
                tracing::warn!(image = %spec.image.digest, error = %e, "cannot fill the pool");
                false
            }
        }
    }

    fn shutdown(&self) {
        self.shutdown_sandboxes();
        // Only the private mount point itself is left (unless an unmount failed).
        if hostmount::mounts_under(&self.root) == [self.root.clone()] {
            let _ = hostmount::detach(&self.root);
        }
    }

    fn shutdown_sandboxes(&self) {
        let pooled: Vec<Prepared> = {
            let mut pool = lock(&self.pool);
            pool.stop = true;
            pool.ready.drain().flat_map(|(_, v)| v).collect()
        };
        self.pool_cond.notify_all();
        for sb in self.table.drain() {
            self.destroy(&sb);
        }
        for p in pooled {
            self.discard(p);
        }
    }
}

/// Unmounts everything under a sandbox directory and removes it. A directory that still has
/// a mount under it is left in place: removing files through a mount of the workspace would
/// reach the host copy.
/// Starts a sandbox's egress proxy and gives it a listener on 127.0.0.1:3128 in the network
/// namespace of the container's pid 1 (joining it takes root on the host).
fn start_egress(
    service: &dyn EgressService,
    prepared: &Prepared,
    policy: &Policy,
    secrets: Vec<egress::ResolvedSecret>,
) -> Result<SandboxEgress, ApiError> {
    let listener = egress::listen_in_netns(prepared.init.pid, egress::PROXY_PORT).map_err(|e| {
        ApiError::internal(format!(
            "cannot make the egress listener in container {}'s network namespace (this needs \
             root on the host): {e}",
            prepared.container
        ))
    })?;
    let log = EgressLog::new();
    let proxy = service
        .start(
            prepared.id.as_str(),
            egress::EgressConfig {
                network: policy.network.clone(),
                secrets,
            },
            log.sink(),
        )
        .map_err(|e| ApiError::internal(format!("egress proxy: {e}")))?;
    if let Err(e) = proxy.serve_listener(listener) {
        proxy.shutdown();
        return Err(ApiError::internal(format!("egress proxy: {e}")));
    }
    Ok(SandboxEgress::new(proxy, log, &policy.network))
}

fn remove_sandbox_dir(dir: &Path) {
    let left = hostmount::unmount_all_under(dir);
    if !left.is_empty() {
        tracing::error!(dir = %dir.display(), mounts = ?left, "cannot unmount; leaving the directory");
        return;
    }
    native::remove_tree(dir);
}

fn pool_loop(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let more = inner.pool_round();
        if lock(&inner.pool).stop {
            return;
        }
        if more {
            continue;
        }
        let pool = lock(&inner.pool);
        let _ = inner.pool_cond.wait_timeout(pool, Duration::from_secs(2));
    }
}

impl Drop for Docker {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        // Cleanup blocks on the daemon; never from inside an async runtime's thread.
        let cleanup = std::thread::spawn(move || inner.shutdown());
        let _ = cleanup.join();
        if let Some(t) = lock(&self.pool_thread).take() {
            let _ = t.join();
        }
    }
}

impl Backend for Docker {
    type Sandbox = Sandbox;
    const NAME: &'static str = "docker";

    fn table(&self) -> &Table<Sandbox> {
        &self.inner.table
    }

    fn start(&self, req: &CreateRequest) -> Result<Arc<Sandbox>, ApiError> {
        self.inner.create(req, None)
    }

    fn start_fork(&self, req: &CreateRequest, seed: &Seed) -> Result<Arc<Sandbox>, ApiError> {
        self.inner.create(req, Some(seed))
    }

    fn end(&self, sandbox: Arc<Sandbox>) {
        self.inner.destroy(&sandbox);
    }

    fn end_all(&self, sandboxes: Vec<Arc<Sandbox>>) {
        let inner = self.inner.clone();
        // Cleanup blocks on the daemon; never from inside an async runtime's thread.
        let cleanup = std::thread::spawn(move || {
            for sb in sandboxes {
                inner.destroy(&sb);
            }
        });
        let _ = cleanup.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_numeric_and_not_root() {
        assert_eq!(parse_user(None).unwrap(), DEFAULT_USER);
        assert_eq!(parse_user(Some("1001")).unwrap(), (1001, 1001));
        assert_eq!(parse_user(Some("1001:50")).unwrap(), (1001, 50));
        assert!(parse_user(Some("0")).is_err());
        assert!(parse_user(Some("1000:0")).is_err());
        assert!(parse_user(Some("nobody")).is_err());
    }
}
