//! Long-lived native sandboxes, and [`NativeBackend`], which implements [`SandboxApi`] with them.
//!
//! A sandbox is the `taskbox-init` helper started in control mode: its pid 1 builds the same
//! isolated tree as a one-shot run, then serves exec requests on a control socket. Each exec is as
//! confined as a one-shot run (its own session, rlimits, no_new_privs, Landlock, no capabilities,
//! seccomp) and has its own reaper inside the sandbox, so its whole process tree is killed on
//! timeout or request, and whatever it leaves running is killed when its main process ends.
//! Files in /tmp and the workspace, and background execs, persist across execs until destroy.
//!
//! The sandbox ends when its control socket closes: on destroy, and also when this process dies
//! for any reason, so a crashed supervisor leaves no sandbox process behind.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use taskbox_protocol::config::{
    DISK_FD, EGRESS_FD, EgressPlan, InitConfig, LandlockPlan, MountOp, RootPlan, STATUS_FD, Status,
};
use taskbox_protocol::control::{self, CONTROL_FD, Event, Request};

use crate::api::*;
use crate::capture::Capture;
use crate::cgroup::{Cgroup, CgroupLimits};
use crate::changes;
use crate::egress::{CLOSE_GRACE, EgressService, ExecWindow, PROXY_PORT, SandboxEgress};
use crate::exec_limits;
use crate::fsops::WorkspaceFs;
use crate::image::ImageResolver;
use crate::image_view::{Identity, ImageView, ImageViewError};
use crate::layers;
use crate::native::{self, RunDir};
use crate::policy::{LandlockMode, NetworkMode, Policy, WorkspaceMode};
use crate::result::{Change, Enforcement, ExecResult, Output, Resources, Violation};

/// Where spill files of execs appear inside the sandbox (read-only).
pub const SPILL_MOUNT: &str = "/tmp/.taskbox/out";

/// pid 1's private mount of the sandbox's state directory and the host workspace.
const PRIVATE: &str = "/run/.taskbox";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The native backend: long-lived sandboxes on this host.
pub struct NativeBackend {
    state_dir: PathBuf,
    sandboxes: RwLock<HashMap<SandboxId, Arc<Sandbox>>>,
    /// The image store, which resolves `CreateRequest.image`; without it only the host view.
    images: Option<Arc<dyn ImageResolver>>,
    /// Starts the egress proxies of sandboxes whose policy has network mode "proxy"; without it
    /// such sandboxes are refused.
    egress: Option<Arc<dyn EgressService>>,
    /// More host paths to hide in every sandbox besides taskbox's state directories (the
    /// supervisor's socket and tokens file).
    hidden: Vec<PathBuf>,
    /// An exclusive lock on `STATE/sandboxes/.lock`: one backend per state directory, so the
    /// start-up sweep never removes what a live backend owns.
    _lock: fs::File,
}

impl std::fmt::Debug for NativeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeBackend")
            .field("state_dir", &self.state_dir)
            .finish()
    }
}

impl NativeBackend {
    /// A backend keeping its state in `state_dir`. Whatever an earlier process left there (the
    /// directories and cgroups of sandboxes that died with it) is removed.
    pub fn new(state_dir: PathBuf) -> Result<NativeBackend, ApiError> {
        let sandboxes = state_dir.join("sandboxes");
        crate::native::private_dir(&sandboxes).map_err(|e| {
            ApiError::internal(format!("cannot create {}: {e}", sandboxes.display()))
        })?;
        let lock_path = sandboxes.join(".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ApiError::internal(format!("cannot open {}: {e}", lock_path.display())))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Err(ApiError::Conflict(format!(
                "another taskbox supervisor uses the state directory {}; stop it or choose \
                 another --state-dir",
                state_dir.display()
            )));
        }
        let backend = NativeBackend {
            state_dir,
            sandboxes: RwLock::new(HashMap::new()),
            images: None,
            egress: None,
            hidden: Vec::new(),
            _lock: lock,
        };
        backend.sweep();
        Ok(backend)
    }

    /// Gives the backend an image store: sandboxes may then have an image as their root
    /// (`CreateRequest.image`, a name or digest the store resolves).
    pub fn with_images(mut self, images: Arc<dyn ImageResolver>) -> NativeBackend {
        self.images = Some(images);
        self
    }

    /// Gives the backend an egress service: sandboxes whose policy has network mode "proxy" get
    /// a proxy of their own from it (see [`crate::egress`]).
    pub fn with_egress(mut self, egress: Arc<dyn EgressService>) -> NativeBackend {
        self.egress = Some(egress);
        self
    }

    /// Hides these host paths in every sandbox too (a supervisor's socket and tokens file),
    /// besides taskbox's state directories and the host's bound sockets, which are always
    /// hidden; none of them can be a workspace.
    pub fn with_hidden_paths(mut self, paths: Vec<PathBuf>) -> NativeBackend {
        self.hidden = paths;
        self
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Removes what sandboxes of an earlier process left: their processes are gone (they end
    /// when their control socket closes), so only directories and empty cgroups remain.
    fn sweep(&self) {
        let Ok(rd) = fs::read_dir(self.state_dir.join("sandboxes")) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            tracing::info!(sandbox = %name, "removing what an earlier run left");
            if let Some(cg) = Cgroup::existing(&format!("sb-{name}")) {
                cg.kill_all(Duration::from_secs(2));
                cg.remove();
            }
            native::remove_tree(&e.path());
        }
    }

    fn get(&self, id: &SandboxId) -> Result<Arc<Sandbox>, ApiError> {
        self.sandboxes
            .read()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id} does not exist")))
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

    /// Runs a file operation on a sandbox's workspace, shared with execs and excluded from
    /// checkpoint and restore.
    fn with_fs<T>(
        &self,
        id: &SandboxId,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let sb = self.get(id)?;
        let _g = sb
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        op(&sb.fs()?)
    }

    /// Extends (or sets) a sandbox's lease to `ttl` from now.
    pub fn renew(&self, id: &SandboxId, ttl: Duration) -> Result<SandboxInfo, ApiError> {
        let sb = self.get(id)?;
        let mut info = sb.info.lock().map_err(|_| ApiError::internal("poisoned"))?;
        info.expires_at_ms = Some(now_ms() + ttl.as_millis() as u64);
        Ok(info.clone())
    }
}

impl Drop for NativeBackend {
    fn drop(&mut self) {
        let ids: Vec<SandboxId> = self
            .sandboxes
            .read()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        for id in ids {
            let _ = self.destroy(&id);
        }
    }
}

/// What the sandbox's pid 1 reported about an exec's end.
#[derive(Debug, Clone)]
struct Exited {
    code: Option<i32>,
    signal: Option<i32>,
    landlock: String,
    seccomp: bool,
    exec_failed: Option<(i32, String)>,
    setup_error: Option<String>,
    cpu_ms: u64,
    max_rss_bytes: u64,
    file_size_exceeded: bool,
}

struct SlotState {
    pid: Option<i32>,
    exited: Option<Exited>,
    stdout: Option<Capture>,
    stderr: Option<Capture>,
    result: Option<ExecResult>,
    error: Option<String>,
    stdin: Option<fs::File>,
}

struct ExecSlot {
    id: u64,
    argv: Vec<String>,
    state: Mutex<SlotState>,
    cond: Condvar,
}

impl ExecSlot {
    fn info(&self) -> ProcessInfo {
        let mut st = match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        let stdout = st.stdout.as_mut().map(Capture::snapshot);
        let stderr = st.stderr.as_mut().map(Capture::snapshot);
        let result = st.result.clone();
        ProcessInfo {
            exec_id: self.id,
            argv: self.argv.clone(),
            running: result.is_none() && st.error.is_none(),
            stdout: stdout
                .or_else(|| result.as_ref().map(|r| r.stdout.clone()))
                .unwrap_or_default(),
            stderr: stderr
                .or_else(|| result.as_ref().map(|r| r.stderr.clone()))
                .unwrap_or_default(),
            result,
        }
    }
}

/// One live sandbox.
struct Sandbox {
    id: SandboxId,
    info: Mutex<SandboxInfo>,
    dirs: RunDir,
    /// The workspace on the host (the overlay's lower layer) and inside the sandbox.
    ws: native::WorkspacePaths,
    /// The image's shell for `shell` execs (`None`: the host view's `/bin/sh -c`).
    shell: Option<Vec<String>>,
    policy: Policy,
    base_env: Vec<(String, String)>,
    helper: Mutex<Option<Child>>,
    init_pid: i32,
    /// The id of the workspace's mount inside the sandbox (it changes on restore).
    ws_mount: Mutex<u64>,
    control: OwnedFd,
    send_lock: Mutex<()>,
    _status: OwnedFd,
    execs: Mutex<HashMap<u64, Arc<ExecSlot>>>,
    next_exec: AtomicU64,
    cgroup: Option<Cgroup>,
    lost: AtomicBool,
    /// Execs and file operations hold it shared; restore holds it exclusively.
    layers_lock: RwLock<()>,
    /// pid 1's answer to the last remount request (`Some(error)` when it failed), until taken.
    remounted: Mutex<Option<Option<String>>>,
    remount_cond: Condvar,
    /// Network mode "proxy": the sandbox's egress proxy.
    egress: Option<SandboxEgress>,
}

impl Sandbox {
    fn spill_dir(&self) -> PathBuf {
        self.dirs.on_disk("out")
    }

    fn send(&self, req: &Request, fds: &[i32]) -> Result<(), ApiError> {
        let _g = self
            .send_lock
            .lock()
            .map_err(|_| ApiError::internal("poisoned"))?;
        match control::send(self.control.as_fd(), req, fds) {
            Ok(()) => Ok(()),
            // Nothing was sent: the sandbox is as it was, and the request may be tried again.
            Err(e @ control::SendError::Prepare { .. }) => {
                Err(ApiError::Unavailable(format!("sandbox {}: {e}", self.id)))
            }
            Err(e) => {
                let why = format!("its control channel failed: {e}");
                self.mark_lost(&why);
                Err(ApiError::Conflict(format!(
                    "sandbox {} is lost ({why}); its processes are ended; destroy it",
                    self.id
                )))
            }
        }
    }

    /// The sandbox can no longer be driven: say so everywhere (its state, its running execs,
    /// every later call) and end its processes, so nothing lives on that no one can reach.
    /// Destroy removes the rest.
    fn mark_lost(&self, why: &str) {
        if self.lost.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(sandbox = %self.id, reason = why, "sandbox lost");
        lock(&self.info).state = "lost".into();
        for slot in lock(&self.execs).values() {
            let mut st = lock(&slot.state);
            if st.exited.is_none() {
                st.error = Some(format!("the sandbox is lost ({why})"));
            }
            drop(st);
            slot.cond.notify_all();
        }
        // pid 1 exits at the end of its control stream, and the kernel kills every process of
        // its pid namespace with it.
        let _ =
            nix::sys::socket::shutdown(self.control.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    fn slot(&self, exec_id: u64) -> Result<Arc<ExecSlot>, ApiError> {
        self.execs
            .lock()
            .map_err(|_| ApiError::internal("poisoned"))?
            .get(&exec_id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("process {exec_id} does not exist")))
    }

    fn enforcement(&self, landlock: &str, seccomp: bool) -> Enforcement {
        Enforcement {
            landlock: landlock.to_string(),
            seccomp,
            network: match self.policy.network.mode {
                NetworkMode::Host => "host",
                NetworkMode::Proxy => "proxy",
                NetworkMode::None => "none",
            }
            .into(),
            limits: self
                .cgroup
                .as_ref()
                .map(Cgroup::kind)
                .unwrap_or("rlimit")
                .into(),
            disk: disk_kind(&self.dirs).into(),
        }
    }

    /// Handles the events pid 1 sends, until the control socket closes.
    fn read_events(weak: Weak<Sandbox>, control: OwnedFd) {
        let mut buf = Vec::new();
        loop {
            let msg = control::recv::<Event>(control.as_fd(), &mut buf);
            let Some(sb) = weak.upgrade() else { return };
            match msg {
                Ok(Some((event, _))) => sb.on_event(event),
                Ok(None) => return sb.mark_lost("its pid 1 ended"),
                Err(e) => return sb.mark_lost(&e.to_string()),
            }
        }
    }

    fn on_event(&self, event: Event) {
        match event {
            Event::Started { id, pid } => self.update_slot(id, |st| st.pid = Some(pid)),
            Event::Exited {
                id,
                code,
                signal,
                landlock,
                seccomp,
                exec_failed,
                setup_error,
                cpu_ms,
                max_rss_bytes,
                file_size_exceeded,
            } => {
                let exited = Exited {
                    code,
                    signal,
                    landlock,
                    seccomp,
                    exec_failed,
                    setup_error,
                    cpu_ms,
                    max_rss_bytes,
                    file_size_exceeded,
                };
                self.update_slot(id, |st| st.exited = Some(exited));
            }
            Event::Remounted { error } => {
                *lock(&self.remounted) = Some(error);
                self.remount_cond.notify_all();
            }
            Event::Ready => {}
            Event::Error { message } => {
                tracing::warn!(sandbox = %self.id, %message, "sandbox reported an error");
            }
        }
    }

    fn update_slot(&self, id: u64, update: impl FnOnce(&mut SlotState)) {
        if let Ok(slot) = self.slot(id) {
            update(&mut lock(&slot.state));
            slot.cond.notify_all();
        }
    }
}

/// How a sandbox's disk is bounded (`enforcement.disk`).
fn disk_kind(dirs: &RunDir) -> &'static str {
    dirs.disk.as_ref().map_or("none", |d| d.kind().as_str())
}

/// The root of the sandbox whose pid 1 is `pid`, as this process reaches it.
fn proc_root(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The cgroup of a sandbox still starting: removed, its processes killed, unless taken.
struct StartingCgroup(Option<Cgroup>);

impl Drop for StartingCgroup {
    fn drop(&mut self) {
        if let Some(cg) = self.0.take() {
            cg.kill_all(Duration::from_secs(2));
            cg.remove();
        }
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd), ApiError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| ApiError::internal(format!("pipe: {e}")))
}

impl NativeBackend {
    fn start(&self, req: &CreateRequest) -> Result<Arc<Sandbox>, ApiError> {
        if let Some(b) = &req.backend
            && b != "native"
        {
            return Err(ApiError::invalid(format!(
                "backend {b:?} is not available here; use \"native\""
            )));
        }
        // "host" names the host view, as `SandboxInfo.image` (and a trace's header) do.
        let image = match req.image.as_deref() {
            None | Some("host") => None,
            Some(name) => {
                let Some(images) = &self.images else {
                    return Err(ApiError::invalid(format!(
                        "image {name:?}: images need the image store, and this native backend \
                         was started without one; leave image unset for the host view"
                    )));
                };
                Some(images.resolve(name)?)
            }
        };
        let is_root = nix::unistd::geteuid().is_root();
        let view = image
            .as_ref()
            .map(|i| ImageView::new(i, is_root))
            .transpose()
            .map_err(|e| match e {
                ImageViewError::Invalid { .. } => ApiError::invalid(e.to_string()),
                other => ApiError::internal(other),
            })?;
        let resolved = req.for_backend()?;
        let policy_name = resolved.name.clone();
        let policy = resolved.policy.clone();
        let egress_service = match (policy.network.mode, &self.egress) {
            (NetworkMode::Proxy, Some(service)) => Some(service.clone()),
            (NetworkMode::Proxy, None) => {
                return Err(ApiError::invalid(format!(
                    "policy {policy_name:?} has network mode \"proxy\", and this backend was \
                     started without the egress proxy"
                )));
            }
            _ => None,
        };
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "invalid environment variable name {k:?}"
                )));
            }
        }
        // An environment no exec could pass to execve is refused before anything is made for
        // the sandbox, not at every exec.
        let env: Vec<(String, String)> = req.env.clone().into_iter().collect();
        exec_limits::Command {
            argv: &[],
            env: &env,
            shell: false,
            extra: &[],
        }
        .check(exec_limits::own_argument_space())?;
        let workspace = overlay_workspace(&req.workspace)?;

        let ws = native::WorkspacePaths::new(
            workspace.clone(),
            view.as_ref()
                .map_or_else(|| workspace.clone(), |v| v.workdir.clone()),
            &self.state_dir,
            &self.hidden,
        )
        .map_err(|why| ApiError::invalid(format!("workspace refused: {why}")))?;

        let id = SandboxId::generate();
        tracing::debug!(sandbox = %id, "starting a sandbox");
        let mut dirs = RunDir::new(self.state_dir.join("sandboxes").join(id.as_str()));
        for d in [dirs.dir.clone(), dirs.root()] {
            fs::create_dir_all(&d)
                .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", d.display())))?;
        }
        // The disk quota: the helper mounts it, and the layers, the scratch mounts and the
        // spill files live on it.
        dirs.disk = Some(
            crate::disk::Disk::prepare(
                &dirs.dir,
                policy.limits.disk_bytes,
                &native::disk_templates(&self.state_dir),
            )
            .map_err(|e| ApiError::internal(e.to_string()))?,
        );
        fs::write(dirs.empty_file(), b"")
            .map_err(|e| ApiError::internal(format!("cannot create the mask file: {e}")))?;
        let _ = fs::set_permissions(dirs.empty_file(), fs::Permissions::from_mode(0o444));

        let (root_plan, root_view, identity) = match &view {
            None => (
                RootPlan::Host,
                native::RootView::Host,
                Identity::host_view(is_root),
            ),
            Some(v) => {
                let scaffold = dirs.dir.join("scaffold");
                v.prepare_scaffold(&scaffold)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                (
                    v.root_plan(&scaffold, None),
                    native::RootView::Image {
                        view: v,
                        build: false,
                    },
                    v.identity,
                )
            }
        };
        let limits = &policy.limits;
        // Until the sandbox takes it, the cgroup goes (its processes killed) with any failure
        // below: a create is all or nothing. The directories go with `dirs` likewise.
        let mut cgroup = StartingCgroup(
            Cgroup::create(
                &format!("sb-{id}"),
                CgroupLimits {
                    memory_bytes: limits.memory_bytes,
                    pids: limits.pids,
                    cpu_cores: limits.cpu_cores,
                },
            )
            .map_err(|e| ApiError::internal(e.to_string()))?,
        );
        let rlimits = native::rlimits_for(&policy, cgroup.0.is_some());
        let (mut mounts, write_paths) = native::plan_mounts(&policy, &ws, &dirs, false, root_view);
        // pid 1's private view of the sandbox's state and of the host workspace, needed to
        // remount the overlay on restore (overlayfs takes its layers only from mounts of the
        // caller's own namespace). The directory is mode 000 on a read-only tmpfs: the
        // sandboxed processes, which hold no capability, can neither enter nor chmod it.
        mounts.extend([
            MountOp::Dir {
                dst: PRIVATE.into(),
                mode: 0o700,
            },
            MountOp::Tmpfs {
                dst: PRIVATE.into(),
                mode: 0o000,
                size_bytes: Some(64 * 1024),
            },
            MountOp::Dir {
                dst: Path::new(PRIVATE).join("state"),
                mode: 0o700,
            },
            MountOp::Bind {
                src: dirs.dir.clone(),
                dst: Path::new(PRIVATE).join("state"),
                readonly: false,
            },
            MountOp::Dir {
                dst: Path::new(PRIVATE).join("lower"),
                mode: 0o700,
            },
            MountOp::Bind {
                src: workspace.clone(),
                dst: Path::new(PRIVATE).join("lower"),
                readonly: true,
            },
            MountOp::RemountReadOnly {
                dst: PRIVATE.into(),
            },
        ]);
        // Spill files of execs, readable (not writable) inside the sandbox.
        mounts.push(MountOp::Dir {
            dst: SPILL_MOUNT.into(),
            mode: 0o755,
        });
        mounts.push(MountOp::Bind {
            src: dirs.planned("out"),
            dst: SPILL_MOUNT.into(),
            readonly: true,
        });
        let isolate_network = policy.network.mode != NetworkMode::Host;
        let mut egress = egress_service
            .map(|service| {
                native::EgressWiring::start(service.as_ref(), id.as_str(), &policy.network)
            })
            .transpose()
            .map_err(ApiError::internal)?;
        let mut base_env =
            native::compose_env(&policy, view.as_ref().map(|v| v.base_env()).as_deref(), &[]);
        for (k, v) in &req.env {
            base_env.retain(|(ek, _)| ek != k);
            base_env.push((k.clone(), v.clone()));
        }
        let config = InitConfig {
            argv: Vec::new(),
            cwd: ws.inside.clone(),
            env: base_env.clone(),
            user_namespace: identity.user_namespace,
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            inner_uid: identity.inner_uid,
            inner_gid: identity.inner_gid,
            isolate_network,
            hostname: "taskbox".into(),
            new_root: dirs.root(),
            root: root_plan,
            mounts,
            landlock: LandlockPlan {
                enabled: true,
                required: policy.security.landlock == LandlockMode::Required,
                read: vec![PathBuf::from("/")],
                write: write_paths,
                deny_tcp: isolate_network,
                connect_tcp: egress.as_ref().map(|_| PROXY_PORT).into_iter().collect(),
            },
            seccomp: policy.security.seccomp,
            refuse_setid_modes: false,
            rlimits,
            cgroup_procs: cgroup
                .0
                .as_ref()
                .map(Cgroup::join_files)
                .unwrap_or_default(),
            control: true,
            egress: egress.as_ref().map(|_| EgressPlan { port: PROXY_PORT }),
            disk: dirs.disk.as_mut().map(crate::disk::Disk::plan),
        };
        let plan_path = dirs.dir.join("plan.json");
        let plan = serde_json::to_vec_pretty(&config)
            .map_err(|e| ApiError::internal(format!("cannot encode the plan: {e}")))?;
        fs::write(&plan_path, plan)
            .map_err(|e| ApiError::internal(format!("cannot write the plan: {e}")))?;

        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| ApiError::internal(format!("socketpair: {e}")))?;
        let (status_read, status_write) = pipe()?;
        let helper = native::helper_path().map_err(|e| ApiError::internal(e.to_string()))?;
        let log = fs::File::create(dirs.dir.join("helper.log"))
            .map_err(|e| ApiError::internal(format!("cannot create the helper log: {e}")))?;
        let (sw, cs) = (status_write.as_raw_fd(), theirs.as_raw_fd());
        let ef = egress.as_ref().and_then(native::EgressWiring::helper_fd);
        let mut disk_channel =
            native::DiskChannel::new().map_err(|e| ApiError::internal(e.to_string()))?;
        let df = disk_channel.helper_fd().unwrap_or(-1);
        let mut cmd = Command::new(helper);
        cmd.arg(&plan_path)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        // SAFETY: the closure runs in the forked child before exec and only calls fcntl and
        // dup2, which are async-signal-safe; the descriptors stay open in this process until
        // spawn returns.
        unsafe {
            cmd.pre_exec(move || match ef {
                Some(ef) => native::install_fds(&[
                    (sw, STATUS_FD),
                    (cs, CONTROL_FD),
                    (df, DISK_FD),
                    (ef, EGRESS_FD),
                ]),
                None => native::install_fds(&[(sw, STATUS_FD), (cs, CONTROL_FD), (df, DISK_FD)]),
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| ApiError::internal(format!("cannot start the sandbox helper: {e}")))?;
        drop(status_write);
        drop(theirs);
        disk_channel.theirs = None;

        // The helper mounts the disk first; then pid 1 reports that the sandbox is built (or
        // why it is not). It made the egress listener before it said so: the proxy can serve
        // it from now on.
        let received = match dirs.disk.as_mut() {
            Some(disk) => disk.receive(&disk_channel.ours, Duration::from_secs(30)),
            None => Ok(()),
        };
        let started = wait_ready(&status_read, &ours, Duration::from_secs(30));
        let started = match (received, started) {
            (Err(why), Ok(_)) => Err(ApiError::internal(format!("sandbox disk: {why}"))),
            (_, started) => started,
        };
        let started = started.and_then(|pid| match egress.as_mut() {
            Some(e) => e
                .connect(Duration::from_secs(5))
                .map(|()| pid)
                .map_err(|why| ApiError::internal(format!("egress proxy: {why}"))),
            None => Ok(pid),
        });
        // The workspace mount, as pid 1 built it and before any command could touch the tree:
        // file operations check they reach this mount (see `Sandbox::fs`).
        let started = started.and_then(|pid| {
            let (_, mount) = WorkspaceFs::open_mounted(&proc_root(pid), &ws.inside)?;
            Ok((pid, mount))
        });
        let (init_pid, ws_mount) = match started {
            Ok(started) => started,
            Err(e) => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let cgroup = cgroup.0.take();
        let created = now_ms();
        let info = SandboxInfo {
            id: id.clone(),
            backend: "native".into(),
            workspace: workspace.display().to_string(),
            policy: policy_name,
            policy_hash: resolved.hash.clone(),
            image: view
                .as_ref()
                .map_or_else(|| "host".into(), |v| v.image.digest.clone()),
            enforcement: Enforcement {
                landlock: "unknown".into(),
                seccomp: policy.security.seccomp,
                network: match policy.network.mode {
                    NetworkMode::Host => "host",
                    NetworkMode::Proxy => "proxy",
                    NetworkMode::None => "none",
                }
                .into(),
                limits: cgroup.as_ref().map(Cgroup::kind).unwrap_or("rlimit").into(),
                disk: disk_kind(&dirs).into(),
            },
            labels: req.labels.clone(),
            created_at_ms: created,
            expires_at_ms: req.ttl_secs.map(|t| created + t * 1000),
            state: "running".into(),
            checkpoints: Vec::new(),
        };
        let control_reader = ours
            .try_clone()
            .map_err(|e| ApiError::internal(format!("dup: {e}")))?;
        let egress = egress.map(|e| SandboxEgress::new(e.proxy, e.log, &policy.network));
        let sandbox = Arc::new(Sandbox {
            id,
            info: Mutex::new(info),
            dirs,
            ws,
            shell: view.map(|v| v.shell().to_vec()),
            policy,
            base_env,
            helper: Mutex::new(Some(child)),
            init_pid,
            ws_mount: Mutex::new(ws_mount),
            control: ours,
            send_lock: Mutex::new(()),
            _status: status_read,
            execs: Mutex::new(HashMap::new()),
            next_exec: AtomicU64::new(1),
            cgroup,
            lost: AtomicBool::new(false),
            layers_lock: RwLock::new(()),
            remounted: Mutex::new(None),
            remount_cond: Condvar::new(),
            egress,
        });
        let weak = Arc::downgrade(&sandbox);
        if let Err(e) = std::thread::Builder::new()
            .name(format!("sandbox-{}", sandbox.id))
            .spawn(move || Sandbox::read_events(weak, control_reader))
        {
            sandbox.shutdown();
            return Err(ApiError::internal(format!(
                "cannot start the event reader: {e}"
            )));
        }
        Ok(sandbox)
    }
}

/// Reads the status pipe until it reports pid 1's pid (after pid 1 said it is ready).
fn wait_for_started(
    status: &OwnedFd,
    status_buf: &mut Vec<u8>,
    deadline: Instant,
) -> Result<i32, ApiError> {
    loop {
        for line in status_buf.split(|b| *b == b'\n') {
            if let Ok(Status::Started { pid }) = serde_json::from_slice(line) {
                return Ok(pid);
            }
        }
        if let Some(e) = setup_error(status_buf) {
            return Err(e);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ApiError::internal("the sandbox did not report its pid"));
        }
        let mut fds = [PollFd::new(status.as_fd(), PollFlags::POLLIN)];
        let ms = left.as_millis().min(60_000) as i32;
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(ApiError::internal(format!("poll: {e}"))),
        }
        let mut chunk = [0u8; 4096];
        match nix::unistd::read(status.as_raw_fd(), &mut chunk) {
            Ok(0) => return Err(ApiError::internal("the sandbox did not report its pid")),
            Ok(n) => status_buf.extend_from_slice(&chunk[..n]),
            Err(_) => {}
        }
    }
}

/// Reads the status pipe until pid 1 says it started, then the control socket until it is ready.
fn wait_ready(status: &OwnedFd, control_sock: &OwnedFd, limit: Duration) -> Result<i32, ApiError> {
    let deadline = Instant::now() + limit;
    let mut status_buf = Vec::new();
    let mut pid = None;
    let mut buf = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ApiError::internal("the sandbox did not start within 30s"));
        }
        let mut fds = [
            PollFd::new(status.as_fd(), PollFlags::POLLIN),
            PollFd::new(control_sock.as_fd(), PollFlags::POLLIN),
        ];
        let ms = left.as_millis().min(60_000) as i32;
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(ApiError::internal(format!("poll: {e}"))),
        }
        let status_ready = fds[0].revents().is_some_and(|r| !r.is_empty());
        let control_ready = fds[1].revents().is_some_and(|r| !r.is_empty());
        if status_ready {
            let mut chunk = [0u8; 4096];
            match nix::unistd::read(status.as_raw_fd(), &mut chunk) {
                Ok(0) => {
                    return Err(setup_error(&status_buf).unwrap_or_else(|| {
                        ApiError::internal("the sandbox helper exited during set-up")
                    }));
                }
                Ok(n) => status_buf.extend_from_slice(&chunk[..n]),
                Err(_) => {}
            }
            if let Some(e) = setup_error(&status_buf) {
                return Err(e);
            }
            for line in status_buf.split(|b| *b == b'\n') {
                if let Ok(Status::Started { pid: p }) = serde_json::from_slice(line) {
                    pid = Some(p);
                }
            }
        }
        if control_ready {
            match control::recv::<Event>(control_sock.as_fd(), &mut buf) {
                Ok(Some((Event::Ready, _))) => {
                    if let Some(p) = pid {
                        return Ok(p);
                    }
                    // pid 1 can be ready before the helper's report of its pid has arrived:
                    // the two come on different channels. Wait for the report.
                    return wait_for_started(status, &mut status_buf, deadline);
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    // Set-up failed: the reason is on the status pipe.
                    let mut chunk = [0u8; 4096];
                    while let Ok(n) = nix::unistd::read(status.as_raw_fd(), &mut chunk) {
                        if n == 0 {
                            break;
                        }
                        status_buf.extend_from_slice(&chunk[..n]);
                    }
                    return Err(setup_error(&status_buf)
                        .unwrap_or_else(|| ApiError::internal("the sandbox ended during set-up")));
                }
            }
        }
    }
}

fn setup_error(buf: &[u8]) -> Option<ApiError> {
    buf.split(|b| *b == b'\n')
        .find_map(|line| match serde_json::from_slice::<Status>(line) {
            Ok(Status::SetupFailed { stage, message }) => Some(ApiError::internal(format!(
                "sandbox set-up failed at {stage}: {message}"
            ))),
            _ => None,
        })
}

/// A running exec's pipes, owned by whoever drives it.
struct Pipes {
    stdout: OwnedFd,
    stderr: OwnedFd,
}

impl Sandbox {
    fn start_exec(
        self: &Arc<Self>,
        req: &ExecRequest,
    ) -> Result<(Arc<ExecSlot>, Pipes, Duration, Instant), ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(ApiError::Conflict(format!(
                "sandbox {} is lost (its processes are gone); destroy it",
                self.id
            )));
        }
        let mut argv = req.resolved_argv()?;
        if let (Some(line), Some(shell)) = (&req.shell, &self.shell) {
            argv = shell.iter().cloned().chain([line.clone()]).collect();
        }
        let timeout = req.time_limit(self.policy.limits.timeout)?;
        let cwd = match &req.cwd {
            None => self.ws.inside.clone(),
            Some(c) if c.starts_with('/') => PathBuf::from(c),
            Some(c) => self.ws.inside.join(c),
        };
        let env = req.layered_env(&self.base_env)?;
        // What execve would refuse is refused here, naming the limit. The command inherits
        // this process's stack limit (no rlimit of the plan changes it).
        exec_limits::Command {
            argv: &argv,
            env: &env,
            shell: req.shell.is_some(),
            extra: &[],
        }
        .check(exec_limits::own_argument_space())?;
        exec_limits::check_cwd(&cwd.to_string_lossy())?;
        let limit = req.output_cap(self.policy.limits.output_bytes);
        let id = self.next_exec.fetch_add(1, Ordering::SeqCst);
        let spill = self.spill_dir();
        let stdout = Capture::new(limit, spill.join(format!("{id}.stdout")))
            .with_shown_path(Path::new(SPILL_MOUNT).join(format!("{id}.stdout")));
        let stderr = Capture::new(limit, spill.join(format!("{id}.stderr")))
            .with_shown_path(Path::new(SPILL_MOUNT).join(format!("{id}.stderr")));

        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let (in_r, in_w) = pipe()?;
        let mut stdin_keep = None;
        match (&req.stdin, req.background) {
            (Some(text), _) => {
                let data = text.clone().into_bytes();
                let mut w = fs::File::from(in_w);
                std::thread::spawn(move || {
                    let _ = w.write_all(&data);
                });
            }
            (None, true) => stdin_keep = Some(fs::File::from(in_w)),
            (None, false) => drop(in_w),
        }
        let slot = Arc::new(ExecSlot {
            id,
            argv: argv.clone(),
            state: Mutex::new(SlotState {
                pid: None,
                exited: None,
                stdout: Some(stdout),
                stderr: Some(stderr),
                result: None,
                error: None,
                stdin: stdin_keep,
            }),
            cond: Condvar::new(),
        });
        lock(&self.execs).insert(id, slot.clone());
        let sent = self.send(
            &Request::Exec {
                id,
                argv,
                cwd: cwd.display().to_string(),
                env,
            },
            &[in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        );
        drop((in_r, out_w, err_w));
        if let Err(e) = sent {
            lock(&self.execs).remove(&id);
            return Err(e);
        }
        Ok((
            slot,
            Pipes {
                stdout: out_r,
                stderr: err_r,
            },
            timeout,
            Instant::now(),
        ))
    }

    /// Reads an exec's output until it ends (or its deadline kills it) and builds its result.
    #[allow(clippy::too_many_arguments)]
    fn drive(
        &self,
        slot: &ExecSlot,
        pipes: Pipes,
        timeout: Duration,
        start: Instant,
        mut events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
        before: &Option<layers::Fingerprint>,
        window: Option<ExecWindow>,
    ) -> Result<ExecResult, ApiError> {
        if let Some(ev) = events.as_mut() {
            ev(ExecEvent::Started { exec_id: slot.id });
        }
        let oom_before = self.cgroup.as_ref().map(Cgroup::oom_kills).unwrap_or(0);
        let deadline = start + timeout;
        let mut timed_out = false;
        let mut open = [true, true];
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let now = Instant::now();
            if !timed_out && now >= deadline {
                timed_out = true;
                let _ = self.send(&Request::KillTree { id: slot.id }, &[]);
            }
            if !open.iter().any(|o| *o) {
                break;
            }
            if self.lost.load(Ordering::SeqCst) && lock(&slot.state).error.is_some() {
                break;
            }
            let wait_ms = if timed_out {
                200
            } else {
                deadline
                    .saturating_duration_since(now)
                    .as_millis()
                    .clamp(1, 200) as i32
            };
            let fds = [&pipes.stdout, &pipes.stderr];
            let mut pollfds = Vec::new();
            let mut which = Vec::new();
            for (i, fd) in fds.iter().enumerate() {
                if open[i] {
                    pollfds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                    which.push(i);
                }
            }
            match poll(
                &mut pollfds,
                PollTimeout::try_from(wait_ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(0) | Err(nix::Error::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(ApiError::internal(format!("poll: {e}"))),
            }
            let ready: Vec<usize> = pollfds
                .iter()
                .zip(&which)
                .filter(|(p, _)| p.revents().is_some_and(|r| !r.is_empty()))
                .map(|(_, i)| *i)
                .collect();
            for i in ready {
                match nix::unistd::read(fds[i].as_raw_fd(), &mut buf) {
                    Ok(0) => open[i] = false,
                    Ok(n) => {
                        let data = &buf[..n];
                        {
                            let mut st = lock(&slot.state);
                            let cap = if i == 0 {
                                &mut st.stdout
                            } else {
                                &mut st.stderr
                            };
                            if let Some(c) = cap.as_mut() {
                                c.push(data);
                            }
                        }
                        if let Some(ev) = events.as_mut() {
                            let text = String::from_utf8_lossy(data).into_owned();
                            ev(if i == 0 {
                                ExecEvent::Stdout { data: text }
                            } else {
                                ExecEvent::Stderr { data: text }
                            });
                        }
                    }
                    Err(nix::Error::EINTR) | Err(nix::Error::EAGAIN) => {}
                    Err(_) => open[i] = false,
                }
            }
        }
        // The pipes are closed: every process of the exec is gone or closed them. Wait for the
        // reaper's report (it comes once nothing of the exec is left).
        let exited = {
            let mut st = lock(&slot.state);
            loop {
                if let Some(e) = st.exited.clone() {
                    break Some(e);
                }
                if st.error.is_some() {
                    break None;
                }
                let now = Instant::now();
                if !timed_out && now >= deadline {
                    timed_out = true;
                    drop(st);
                    let _ = self.send(&Request::KillTree { id: slot.id }, &[]);
                    st = lock(&slot.state);
                    continue;
                }
                let wait = if timed_out {
                    Duration::from_millis(200)
                } else {
                    deadline
                        .saturating_duration_since(now)
                        .min(Duration::from_millis(200))
                };
                st = match slot.cond.wait_timeout(st, wait) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        };
        let Some(exited) = exited else {
            return Err(ApiError::Conflict(format!(
                "sandbox {} ended while the command ran; destroy it",
                self.id
            )));
        };
        if let Some(err) = &exited.setup_error {
            return Err(if err.starts_with("cwd:") {
                ApiError::invalid(err.trim_start_matches("cwd: ").to_string())
            } else {
                ApiError::internal(format!("the command could not start: {err}"))
            });
        }
        let (mut out, mut err) = {
            let mut st = lock(&slot.state);
            (
                st.stdout.take().map(Capture::finish).unwrap_or_default(),
                st.stderr.take().map(Capture::finish).unwrap_or_default(),
            )
        };
        let mut exit_code = exited.code;
        let mut signal = exited.signal;
        if timed_out {
            exit_code = None;
            signal = Some(libc::SIGKILL);
        }
        if let Some((errno, program)) = &exited.exec_failed {
            err.note_exec_failure(*errno, program);
        }
        let mut violations = Vec::new();
        if timed_out {
            violations.push(Violation::timeout(timeout));
        }
        let oom_killed = self
            .cgroup
            .as_ref()
            .is_some_and(|cg| cg.oom_kills() > oom_before);
        if oom_killed {
            violations.push(Violation::memory_limit(self.policy.limits.memory_bytes));
        }
        if exited.file_size_exceeded {
            violations.push(Violation::file_size_limit(
                self.policy.limits.file_size_bytes,
            ));
        }
        if let Some(disk) = &self.dirs.disk
            && disk.is_full()
        {
            violations.push(Violation::disk_limit(disk.size()));
        }
        // Every process of the exec is gone: what the proxy decided meanwhile is (also) this
        // exec's.
        let network = window.map(|w| {
            let (denials, activity) = w.close(CLOSE_GRACE);
            violations.extend(denials);
            activity
        });
        let changes = match before {
            Some(before) => self.changes_since(before)?,
            None => Vec::new(),
        };
        let limit = self.policy.limits.file_size_bytes;
        let fsize = Violation::file_size_limit(limit);
        if !violations.contains(&fsize)
            && native::reached_file_size(&self.dirs.upper(), &changes, limit)
        {
            violations.push(fsize);
        }
        if out.text.is_empty() && out.bytes == 0 {
            out = Output::default();
        }
        let result = ExecResult {
            exit_code,
            signal,
            timed_out,
            duration_ms: start.elapsed().as_millis() as u64,
            stdout: out,
            stderr: err,
            changes,
            violations,
            resources: Resources {
                cpu_ms: exited.cpu_ms,
                max_rss_bytes: exited.max_rss_bytes,
                oom_killed,
            },
            enforcement: self.enforcement(&exited.landlock, exited.seccomp),
            network,
        };
        if let Ok(mut info) = self.info.lock() {
            info.enforcement = result.enforcement.clone();
        }
        Ok(result)
    }

    /// A fingerprint of the upper layer, taken before an exec (cost: the size of the change so
    /// far, not of the workspace).
    fn fingerprint(&self) -> Result<Option<layers::Fingerprint>, ApiError> {
        if self.policy.filesystem.workspace != WorkspaceMode::Overlay {
            return Ok(None);
        }
        layers::fingerprint(&self.dirs.upper())
            .map(Some)
            .map_err(layers_err)
    }

    /// What changed in the workspace since `before` was taken.
    fn changes_since(&self, before: &layers::Fingerprint) -> Result<Vec<Change>, ApiError> {
        let upper = self.dirs.upper();
        let after = layers::fingerprint(&upper).map_err(layers_err)?;
        layers::exec_changes(before, &after, &upper, &self.ws.host).map_err(layers_err)
    }

    fn exec(
        self: &Arc<Self>,
        req: ExecRequest,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let guard = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let before = self.fingerprint()?;
        let window = self.egress.as_ref().map(|e| e.log.open());
        let (slot, pipes, timeout, start) = self.start_exec(&req)?;
        if req.background {
            drop(guard);
            let sb = Arc::clone(self);
            let slot2 = slot.clone();
            std::thread::Builder::new()
                .name(format!("exec-{}-{}", self.id, slot.id))
                .spawn(move || {
                    let res = sb.drive(&slot2, pipes, timeout, start, None, &before, window);
                    let mut st = lock(&slot2.state);
                    match res {
                        Ok(r) => st.result = Some(r),
                        Err(e) => st.error = Some(e.to_string()),
                    }
                    st.stdin = None;
                    drop(st);
                    slot2.cond.notify_all();
                })
                .map_err(|e| ApiError::internal(format!("cannot start a thread: {e}")))?;
            return Ok(ExecOutcome::Background(slot.info()));
        }
        let result = self.drive(&slot, pipes, timeout, start, events, &before, window);
        lock(&self.execs).remove(&slot.id);
        drop(guard);
        let result = result?;
        Ok(ExecOutcome::Finished(result))
    }

    fn wait(&self, exec_id: u64, timeout: Duration) -> Result<ProcessInfo, ApiError> {
        let slot = self.slot(exec_id)?;
        let deadline = Instant::now() + timeout;
        {
            let mut st = lock(&slot.state);
            while st.result.is_none() && st.error.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = match slot.cond.wait_timeout(st, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        }
        Ok(slot.info())
    }

    fn kill(&self, exec_id: u64, signal: i32) -> Result<ProcessInfo, ApiError> {
        let slot = self.slot(exec_id)?;
        if !(1..=64).contains(&signal) {
            return Err(ApiError::invalid(format!("invalid signal {signal}")));
        }
        let (pid, done) = {
            let st = lock(&slot.state);
            (st.pid, st.result.is_some() || st.exited.is_some())
        };
        if !done {
            if signal == libc::SIGKILL {
                self.send(&Request::KillTree { id: exec_id }, &[])?;
            } else if let Some(pid) = pid {
                self.send(
                    &Request::Signal {
                        id: exec_id,
                        pid,
                        signal,
                    },
                    &[],
                )?;
            }
        }
        Ok(slot.info())
    }

    fn write_stdin(&self, exec_id: u64, data: &[u8], close: bool) -> Result<(), ApiError> {
        let slot = self.slot(exec_id)?;
        let mut st = lock(&slot.state);
        let Some(w) = st.stdin.as_mut() else {
            return Err(ApiError::Conflict(format!(
                "process {exec_id} has no open stdin (it ended, was started with stdin text, or \
                 stdin was closed)"
            )));
        };
        w.write_all(data)
            .map_err(|e| ApiError::Conflict(format!("cannot write to process {exec_id}: {e}")))?;
        if close {
            st.stdin = None;
        }
        Ok(())
    }

    /// Puts new egress rules in force (network mode "proxy" only).
    fn set_network(&self, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        match &self.egress {
            Some(egress) => egress.replace_rules(self.id.as_str(), rules),
            None => Err(crate::egress::no_proxy(
                self.id.as_str(),
                self.policy.network.mode,
            )),
        }
    }

    /// Ends the sandbox: closing the control socket ends pid 1 and with it every process.
    fn shutdown(&self) {
        let _ = self.send(&Request::KillAll, &[]);
        let _ =
            nix::sys::socket::shutdown(self.control.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(mut child) = lock(&self.helper).take() {
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        if let Some(cg) = &self.cgroup {
            cg.kill_all(Duration::from_secs(5));
            cg.remove();
        }
        if let Some(egress) = &self.egress {
            egress.proxy.shutdown();
        }
        // Execs still being driven see the end of their pipes; mark them.
        for slot in lock(&self.execs).values() {
            let mut st = lock(&slot.state);
            if st.result.is_none() && st.exited.is_none() {
                st.error = Some("the sandbox was destroyed".into());
            }
            drop(st);
            slot.cond.notify_all();
        }
    }
}

impl SandboxApi for NativeBackend {
    fn create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        let sandbox = self.start(&req)?;
        // A first exec proves the sandbox works and reports the enforcement in force.
        let probe = sandbox.exec(
            ExecRequest {
                argv: Some(vec!["/bin/true".into()]),
                ..ExecRequest::default()
            },
            None,
        );
        if let Err(e) = probe {
            sandbox.shutdown();
            return Err(e);
        }
        let info = lock(&sandbox.info).clone();
        self.sandboxes
            .write()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .insert(info.id.clone(), sandbox);
        tracing::info!(sandbox = %info.id, workspace = %info.workspace, "sandbox created");
        Ok(info)
    }

    fn list(&self) -> Vec<SandboxInfo> {
        let mut v: Vec<SandboxInfo> = self
            .sandboxes
            .read()
            .map(|m| m.values().map(|s| lock(&s.info).clone()).collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        v
    }

    fn info(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        Ok(lock(&self.get(id)?.info).clone())
    }

    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        self.get(id)?.exec(req, events)
    }

    fn process(&self, id: &SandboxId, exec_id: u64) -> Result<ProcessInfo, ApiError> {
        Ok(self.get(id)?.slot(exec_id)?.info())
    }

    fn wait(
        &self,
        id: &SandboxId,
        exec_id: u64,
        timeout: Duration,
    ) -> Result<ProcessInfo, ApiError> {
        self.get(id)?.wait(exec_id, timeout)
    }

    fn kill(&self, id: &SandboxId, exec_id: u64, signal: i32) -> Result<ProcessInfo, ApiError> {
        self.get(id)?.kill(exec_id, signal)
    }

    fn write_stdin(
        &self,
        id: &SandboxId,
        exec_id: u64,
        data: &[u8],
        close: bool,
    ) -> Result<(), ApiError> {
        self.get(id)?.write_stdin(exec_id, data, close)
    }

    fn read(&self, id: &SandboxId, req: ReadRequest) -> Result<ReadResult, ApiError> {
        self.get(id)?.fs_read(req)
    }

    fn write(&self, id: &SandboxId, req: WriteRequest) -> Result<WriteResult, ApiError> {
        self.with_fs(id, |fs| fs.write(&req))
    }

    fn edit(&self, id: &SandboxId, req: EditRequest) -> Result<EditResult, ApiError> {
        self.with_fs(id, |fs| fs.edit(&req))
    }

    fn patch(&self, id: &SandboxId, req: PatchRequest) -> Result<PatchResult, ApiError> {
        self.with_fs(id, |fs| fs.patch(&req))
    }

    fn list_dir(&self, id: &SandboxId, req: ListRequest) -> Result<ListResult, ApiError> {
        self.with_fs(id, |fs| fs.list(&req))
    }

    fn search(&self, id: &SandboxId, req: SearchRequest) -> Result<SearchResult, ApiError> {
        self.with_fs(id, |fs| fs.search(&req))
    }

    fn stat(&self, id: &SandboxId, req: PathRequest) -> Result<StatResult, ApiError> {
        self.with_fs(id, |fs| fs.stat(&req))
    }

    fn remove(&self, id: &SandboxId, req: RemoveRequest) -> Result<(), ApiError> {
        self.with_fs(id, |fs| fs.remove(&req))
    }

    fn rename(&self, id: &SandboxId, req: MoveRequest) -> Result<(), ApiError> {
        self.with_fs(id, |fs| fs.rename(&req))
    }

    fn diff(&self, id: &SandboxId, req: DiffRequest) -> Result<DiffResult, ApiError> {
        self.get(id)?.diff(req)
    }

    fn checkpoint(
        &self,
        id: &SandboxId,
        req: CheckpointRequest,
    ) -> Result<CheckpointInfo, ApiError> {
        self.get(id)?.checkpoint(req)
    }

    fn restore(&self, id: &SandboxId, req: CheckpointRequest) -> Result<(), ApiError> {
        self.get(id)?.restore(req)
    }

    fn export(&self, id: &SandboxId, req: ExportRequest) -> Result<ExportResult, ApiError> {
        self.get(id)?.export(req)
    }

    fn destroy(&self, id: &SandboxId) -> Result<(), ApiError> {
        let sb = self
            .sandboxes
            .write()
            .map_err(|_| ApiError::internal("sandbox table poisoned"))?
            .remove(id)
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id} does not exist")))?;
        sb.shutdown();
        tracing::info!(sandbox = %id, "sandbox destroyed");
        Ok(())
    }

    fn set_network(&self, id: &SandboxId, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        self.get(id)?.set_network(rules)
    }
}

/// What a git-style diff says about one file beyond its status.
#[derive(Default)]
struct Section {
    binary: bool,
    mode_change: Option<String>,
}

/// Reads the per-file facts of a git-style diff: binary or not, and mode changes. Sections start
/// at `diff --git a/P b/P` lines (paths are written as the renderer writes them, unquoted).
fn diff_sections(text: &str) -> BTreeMap<&str, Section> {
    let mut out: BTreeMap<&str, Section> = BTreeMap::new();
    let mut current: Option<&str> = None;
    let mut old_mode: Option<&str> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("diff --git a/") {
            current = rest.split(" b/").next();
            old_mode = None;
            if let Some(p) = current {
                out.entry(p).or_default();
            }
            continue;
        }
        let Some(p) = current else { continue };
        if let Some(m) = line.strip_prefix("old mode ") {
            old_mode = Some(m);
        } else if let (Some(m), Some(old)) = (line.strip_prefix("new mode "), old_mode) {
            out.entry(p).or_default().mode_change = Some(format!("{old} -> {m}"));
        } else if line.starts_with("Binary files ") {
            out.entry(p).or_default().binary = true;
        }
    }
    out
}

/// Reads an exec's spill file when `req` names one under [`SPILL_MOUNT`] (`N.stdout` or
/// `N.stderr`, kept in `dir`); None for any other path (shared by the backends).
pub fn read_spill(dir: &Path, req: &ReadRequest) -> Option<Result<ReadResult, ApiError>> {
    let name = req.path.strip_prefix(SPILL_MOUNT)?.strip_prefix('/')?;
    let valid = name.split_once('.').is_some_and(|(n, ext)| {
        !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
            && (ext == "stdout" || ext == "stderr")
    });
    if !valid {
        return Some(Err(ApiError::not_found(format!(
            "{} does not exist",
            req.path
        ))));
    }
    Some(WorkspaceFs::open(dir).and_then(|fs| {
        let mut r = fs.read(&ReadRequest {
            path: name.to_string(),
            ..req.clone()
        })?;
        r.path = req.path.clone();
        Ok(r)
    }))
}

/// The change in the upper layer `upper` over the workspace `host`, or, with `since` (a
/// checkpoint's layer), since that checkpoint (shared by the backends).
pub fn layer_diff(host: &Path, upper: &Path, since: Option<&Path>) -> Result<DiffResult, ApiError> {
    let (list, d) = match since {
        None => {
            let list = changes::scan(upper, host).map_err(changes_err)?;
            let d = changes::diff(upper, host, &list).map_err(changes_err)?;
            (list, d)
        }
        Some(base) => {
            let list = layers::scan_between(host, base, upper).map_err(layers_err)?;
            let d = layers::diff_between(host, base, upper, &list).map_err(layers_err)?;
            (list, d)
        }
    };
    let sections = diff_sections(&d.text);
    let files = list
        .into_iter()
        .map(|c| {
            let section = sections.get(c.path.as_str());
            FileDiff {
                binary: section.is_some_and(|s| s.binary),
                mode_change: section.and_then(|s| s.mode_change.clone()),
                path: c.path,
                status: c.kind,
            }
        })
        .collect();
    Ok(DiffResult {
        files,
        diff: d.text,
        stats: d.stats,
    })
}

/// Copies the upper layer `upper` to a new checkpoint layer `dir` (named `name`; it must not
/// exist); the number of changed files it holds (shared by the backends).
pub fn take_checkpoint(host: &Path, upper: &Path, dir: &Path, name: &str) -> Result<u64, ApiError> {
    if dir.exists() {
        return Err(ApiError::Conflict(format!(
            "checkpoint {name} exists already; choose another name"
        )));
    }
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent)
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", parent.display())))?;
    }
    if let Err(e) = layers::copy_layer(upper, dir) {
        native::remove_tree(dir);
        return Err(layers_err(e));
    }
    Ok(changes::scan(upper, host).map_err(changes_err)?.len() as u64)
}

/// The layers a restore mounts, made in a sandbox's directory `dir` before the swap:
/// `upper.next` (a copy of the checkpoint layer `ckpt`) and an empty `work.next`.
pub struct StagedLayers {
    pub upper: PathBuf,
    pub work: PathBuf,
}

impl StagedLayers {
    pub fn stage(dir: &Path, ckpt: &Path) -> Result<StagedLayers, ApiError> {
        let staged = StagedLayers {
            upper: dir.join("upper.next"),
            work: dir.join("work.next"),
        };
        native::remove_tree(&staged.upper);
        native::remove_tree(&staged.work);
        layers::copy_layer(ckpt, &staged.upper).map_err(layers_err)?;
        fs::create_dir(&staged.work).map_err(|e| {
            ApiError::internal(format!("cannot create {}: {e}", staged.work.display()))
        })?;
        Ok(staged)
    }

    /// Once the new overlay is mounted on them: puts them in place of `upper` and `work`, and
    /// removes the old ones (through `dir/trash`).
    pub fn swap_in(self, dir: &Path, upper: &Path, work: &Path) -> Result<(), ApiError> {
        let trash = dir.join("trash");
        native::remove_tree(&trash);
        let _ = fs::create_dir(&trash);
        let moves = [
            (upper.to_path_buf(), trash.join("upper")),
            (work.to_path_buf(), trash.join("work")),
            (self.upper, upper.to_path_buf()),
            (self.work, work.to_path_buf()),
        ];
        for (from, to) in moves {
            fs::rename(&from, &to).map_err(|e| {
                ApiError::internal(format!(
                    "cannot move {} to {}: {e}",
                    from.display(),
                    to.display()
                ))
            })?;
        }
        native::remove_tree(&trash);
        Ok(())
    }
}

/// A layer operation's error as the API reports it (shared by the backends).
pub fn layers_err(e: layers::LayersError) -> ApiError {
    match e {
        layers::LayersError::Refused { .. } => ApiError::PathRefused(e.to_string()),
        other => ApiError::internal(other),
    }
}

/// A change scan's error as the API reports it (shared by the backends).
pub fn changes_err(e: changes::ChangesError) -> ApiError {
    ApiError::internal(e)
}

/// The canonical path of a workspace a create request names: an existing directory other than
/// `/`, whose path overlay mount options can carry (shared by the backends).
pub fn overlay_workspace(given: &str) -> Result<PathBuf, ApiError> {
    let workspace = fs::canonicalize(given)
        .map_err(|e| ApiError::invalid(format!("workspace {given}: {e}")))?;
    if !workspace.is_dir() || workspace == Path::new("/") {
        return Err(ApiError::invalid(format!(
            "workspace {} must be a directory other than /",
            workspace.display()
        )));
    }
    if workspace.to_string_lossy().contains([',', ':', '\\', '\n']) {
        return Err(ApiError::invalid(format!(
            "workspace {}: the path contains ',', ':' or '\\', which overlay options cannot carry",
            workspace.display()
        )));
    }
    Ok(workspace)
}

/// Checkpoint names: `[A-Za-z0-9._-]{1,64}`, not `.` or `..` (shared by the backends).
pub fn checkpoint_name(name: &str) -> Result<&str, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(name)
    } else {
        Err(ApiError::invalid(format!(
            "invalid checkpoint name {name:?}: use 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'"
        )))
    }
}

impl Sandbox {
    /// The workspace as the sandbox sees it, for path-safe file operations.
    fn fs(&self) -> Result<WorkspaceFs, ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(ApiError::Conflict(format!(
                "sandbox {} is lost (its processes are gone); destroy it",
                self.id
            )));
        }
        let (fs, mount) = WorkspaceFs::open_mounted(&proc_root(self.init_pid), &self.ws.inside)?;
        if mount != *lock(&self.ws_mount) {
            return Err(ApiError::Conflict(format!(
                "the workspace of sandbox {} is no longer mounted at {} (something in the \
                 sandbox moved or replaced a directory on its path); destroy it",
                self.id,
                self.ws.inside.display()
            )));
        }
        Ok(fs
            .with_mount_path(self.ws.inside.clone())
            .with_protected(&self.policy.filesystem.protected))
    }

    /// Reads a workspace file, or an exec's spill file under [`SPILL_MOUNT`].
    fn fs_read(&self, req: ReadRequest) -> Result<ReadResult, ApiError> {
        let _g = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        if let Some(r) = read_spill(&self.spill_dir(), &req) {
            return r;
        }
        self.fs()?.read(&req)
    }

    fn checkpoint_dir(&self, name: &str) -> Result<PathBuf, ApiError> {
        Ok(self
            .dirs
            .dir
            .join("checkpoints")
            .join(checkpoint_name(name)?))
    }

    fn diff(&self, req: DiffRequest) -> Result<DiffResult, ApiError> {
        let _g = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let since = match &req.since {
            None => None,
            Some(name) => {
                let base = self.checkpoint_dir(name)?;
                if !base.is_dir() {
                    return Err(ApiError::not_found(format!(
                        "checkpoint {name} does not exist"
                    )));
                }
                Some(base)
            }
        };
        layer_diff(&self.ws.host, &self.dirs.upper(), since.as_deref())
    }

    fn checkpoint(&self, req: CheckpointRequest) -> Result<CheckpointInfo, ApiError> {
        let dir = self.checkpoint_dir(&req.name)?;
        // Exclusive: no exec or file operation of the API changes the upper layer meanwhile.
        let _g = self
            .layers_lock
            .write()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let files = take_checkpoint(&self.ws.host, &self.dirs.upper(), &dir, &req.name)?;
        lock(&self.info).checkpoints.push(req.name.clone());
        Ok(CheckpointInfo {
            name: req.name,
            created_at_ms: now_ms(),
            files,
        })
    }

    /// Rolls the workspace back to a checkpoint: background execs are stopped, the overlay is
    /// detached inside the sandbox, and a fresh one is mounted on a copy of the checkpoint.
    fn restore(&self, req: CheckpointRequest) -> Result<(), ApiError> {
        let ckpt = self.checkpoint_dir(&req.name)?;
        if !ckpt.is_dir() {
            return Err(ApiError::not_found(format!(
                "checkpoint {} does not exist",
                req.name
            )));
        }
        let _g = self
            .layers_lock
            .write()
            .map_err(|_| ApiError::internal("poisoned"))?;
        // Processes with files open in the old view would keep writing to it: stop them.
        self.send(&Request::KillAll, &[])?;
        let slots: Vec<Arc<ExecSlot>> = lock(&self.execs).values().cloned().collect();
        for slot in slots {
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut st = lock(&slot.state);
            while st.result.is_none() && st.error.is_none() && st.exited.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = match slot.cond.wait_timeout(st, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        }
        // Staged on the disk, beside the layers they replace (a rename cannot cross file
        // systems, and the overlay needs its upper and work directories on one).
        let layers_dir = self.dirs.on_disk("");
        let staged = StagedLayers::stage(&layers_dir, &ckpt)?;
        let private = Path::new(PRIVATE);
        // The staged layers as the sandbox sees the state directory.
        let on_disk = match self.dirs.disk {
            Some(_) => "state/disk",
            None => "state",
        };
        let mut ops = vec![MountOp::Overlay {
            lower: private.join("lower"),
            upper: private.join(on_disk).join("upper.next"),
            work: private.join(on_disk).join("work.next"),
            dst: self.ws.inside.clone(),
        }];
        let empty = private.join("state/empty");
        for op in native::workspace_guard_ops(&self.policy, &self.ws, &empty, false) {
            let inside = match &op {
                MountOp::Mask { dst, .. } | MountOp::ProtectReadOnly { dst } => {
                    dst.starts_with(&self.ws.inside)
                }
                _ => false,
            };
            if inside {
                ops.push(op);
            }
        }
        *lock(&self.remounted) = None;
        self.send(
            &Request::Remount {
                path: self.ws.inside.display().to_string(),
                ops,
            },
            &[],
        )?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut r = lock(&self.remounted);
        let outcome = loop {
            if let Some(outcome) = r.take() {
                break outcome;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.lost.load(Ordering::SeqCst) {
                break Some("the sandbox did not answer the remount".to_string());
            }
            r = match self
                .remount_cond
                .wait_timeout(r, left.min(Duration::from_millis(200)))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        drop(r);
        if let Some(err) = outcome {
            self.lost.store(true, Ordering::SeqCst);
            return Err(ApiError::internal(format!(
                "restore of checkpoint {} failed inside the sandbox: {err}; destroy it",
                req.name
            )));
        }
        // File operations now go to the new mount (opened while no exec runs).
        let (_, mount) = WorkspaceFs::open_mounted(&proc_root(self.init_pid), &self.ws.inside)?;
        *lock(&self.ws_mount) = mount;
        // The new mount holds the new directories; the old ones are no longer used.
        staged.swap_in(&layers_dir, &self.dirs.upper(), &self.dirs.work())
    }

    fn export(&self, req: ExportRequest) -> Result<ExportResult, ApiError> {
        let _g = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let upper = self.dirs.upper();
        let list = changes::scan(&upper, &self.ws.host).map_err(changes_err)?;
        let mut patch = None;
        let mut tar_path = None;
        match req.format {
            ExportFormat::Patch => {
                patch =
                    Some(changes::unified_diff(&upper, &self.ws.host, &list).map_err(changes_err)?);
            }
            ExportFormat::Tar => {
                let dir = self
                    .dirs
                    .dir
                    .parent()
                    .and_then(Path::parent)
                    .map(|state| state.join("exports"))
                    .ok_or_else(|| ApiError::internal("no state directory"))?;
                fs::create_dir_all(&dir).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", dir.display()))
                })?;
                let path = dir.join(format!("{}-{}.tar", self.id, now_ms()));
                let mut f = std::io::BufWriter::new(fs::File::create(&path).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", path.display()))
                })?);
                layers::export_tar(&upper, &self.ws.host, &list, &mut f).map_err(layers_err)?;
                f.flush().map_err(|e| {
                    ApiError::internal(format!("cannot write {}: {e}", path.display()))
                })?;
                tar_path = Some(path.display().to_string());
            }
        }
        let mut applied = false;
        if req.apply {
            layers::apply_to_host(&upper, &self.ws.host, &list).map_err(layers_err)?;
            applied = true;
        }
        Ok(ExportResult {
            format: req.format,
            patch,
            tar_path,
            changes: list,
            applied,
        })
    }
}
