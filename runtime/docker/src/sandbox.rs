//! One Docker sandbox: its container, its host-side workspace, and the operations on it (exec
//! through the Engine API; files, diff, checkpoints and export on the host side).

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures_util::StreamExt;
use taskbox_core::api::*;
use taskbox_core::capture::Capture;
use taskbox_core::changes;
use taskbox_core::egress::{self, CLOSE_GRACE, ExecWindow, SandboxEgress};
use taskbox_core::exec_limits;
use taskbox_core::fsops::WorkspaceFs;
use taskbox_core::layers;
use taskbox_core::policy::{CREDENTIAL_STORES, Policy, WorkspaceMode};
use taskbox_core::result::{Change, Enforcement, ExecResult, Output, Resources, Violation};
use taskbox_core::sandbox::{
    SPILL_MOUNT, StagedLayers, changes_err, checkpoint_name, layer_diff, layers_err, read_spill,
    take_checkpoint,
};
use tokio::io::AsyncWriteExt;

use crate::daemon::{Daemon, DaemonError};
use crate::hostmount;
use crate::procfs;

pub use crate::procfs::INIT_PATH;
/// Where the per-exec status files appear in the container.
pub const RUN_MOUNT: &str = "/.taskbox/run";

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The directories of one sandbox under `STATE/docker/sandboxes/ID`.
#[derive(Debug, Clone)]
pub(crate) struct Dirs(pub PathBuf);

impl Dirs {
    /// The sandbox's disk quota (`limits.disk`), a loop-mounted ext4 that holds its upper and
    /// work directories, its `/tmp`, its exec status files and its spill files.
    pub fn disk(&self) -> PathBuf {
        self.0.join("disk")
    }
    pub fn upper(&self) -> PathBuf {
        self.disk().join("upper")
    }
    pub fn work(&self) -> PathBuf {
        self.disk().join("work")
    }
    pub fn tmp(&self) -> PathBuf {
        self.disk().join("tmp")
    }
    pub fn mnt(&self) -> PathBuf {
        self.0.join("mnt")
    }
    pub fn lower(&self) -> PathBuf {
        self.0.join("lower")
    }
    pub fn out(&self) -> PathBuf {
        self.disk().join("out")
    }
    pub fn run(&self) -> PathBuf {
        self.disk().join("run")
    }
    pub fn empty(&self) -> PathBuf {
        self.0.join("empty")
    }
    pub fn checkpoints(&self) -> PathBuf {
        self.0.join("checkpoints")
    }
}

/// The workspace overlay of a sandbox as mounted on the host.
#[derive(Debug, Clone)]
pub(crate) struct Overlay {
    /// The host workspace (the baseline of diffs).
    pub workspace: PathBuf,
    /// The overlay's lower layer: the workspace itself, or its idmapped bind.
    pub lower: PathBuf,
    /// The container user (uid, gid).
    pub user: (u32, u32),
    /// Paths inside the workspace (relative) that stay hidden: taskbox's own state, host
    /// sockets bound there, the deny list.
    pub masked: Vec<PathBuf>,
}

impl Overlay {
    /// Mounts the overlay with `upper`/`work` on the sandbox's `mnt`, then the policy's guards.
    pub fn mount(
        &self,
        dirs: &Dirs,
        upper: &Path,
        work: &Path,
        policy: &Policy,
    ) -> Result<(), ApiError> {
        let mnt = dirs.mnt();
        hostmount::mount_overlay(&self.lower, upper, work, &mnt)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let guarded = (|| -> std::io::Result<()> {
            // Reached beneath the mount without following symlinks: on a restore the layers
            // hold what the sandbox made.
            for rel in CREDENTIAL_STORES
                .iter()
                .map(PathBuf::from)
                .chain(self.masked.iter().cloned())
            {
                hostmount::mask_beneath(&mnt, &rel, &dirs.empty())?;
            }
            for rel in &policy.filesystem.protected {
                hostmount::protect_beneath(&mnt, Path::new(rel))?;
            }
            if policy.filesystem.workspace == WorkspaceMode::ReadOnly {
                hostmount::protect_readonly(&mnt)?;
            }
            Ok(())
        })();
        if let Err(e) = guarded {
            let _ = hostmount::detach(&mnt);
            return Err(ApiError::internal(format!(
                "cannot guard the workspace: {e}"
            )));
        }
        Ok(())
    }

    /// Prepares an upper directory whose root the container user owns, with the workspace's mode.
    pub fn prepare_upper(&self, upper: &Path) -> Result<(), ApiError> {
        let mode = fs::metadata(&self.workspace)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o755);
        std::os::unix::fs::chown(upper, Some(self.user.0), Some(self.user.1))
            .and_then(|_| fs::set_permissions(upper, fs::Permissions::from_mode(mode)))
            .map_err(|e| ApiError::internal(format!("cannot prepare {}: {e}", upper.display())))
    }
}

/// How an exec ended, from the wrapper's status file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ended {
    Exit { code: i32, cpu_ms: u64, rss: u64 },
    Signal { signal: i32, cpu_ms: u64, rss: u64 },
    ExecFailed { errno: i32 },
    Cwd { errno: i32 },
}

impl Ended {
    pub fn parse(line: &str) -> Option<Ended> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<i64>().ok());
        match f.first().copied()? {
            "exit" => Some(Ended::Exit {
                code: num(1)? as i32,
                cpu_ms: num(2).unwrap_or(0).max(0) as u64,
                rss: num(3).unwrap_or(0).max(0) as u64,
            }),
            "signal" => Some(Ended::Signal {
                signal: num(1)? as i32,
                cpu_ms: num(2).unwrap_or(0).max(0) as u64,
                rss: num(3).unwrap_or(0).max(0) as u64,
            }),
            "execfail" => Some(Ended::ExecFailed {
                errno: num(1)? as i32,
            }),
            "cwd" => Some(Ended::Cwd {
                errno: num(1)? as i32,
            }),
            _ => None,
        }
    }
}

/// What the driver sends to an exec's standard input.
pub(crate) enum StdinMsg {
    Data(Vec<u8>),
    Close,
}

pub(crate) struct SlotState {
    /// The wrapper's pid on the host, once known.
    wrapper_pid: Option<i32>,
    /// Docker's id of the exec.
    docker_exec: Option<String>,
    stdout: Option<Capture>,
    stderr: Option<Capture>,
    result: Option<ExecResult>,
    error: Option<String>,
    stdin: Option<tokio::sync::mpsc::UnboundedSender<StdinMsg>>,
    done: bool,
}

pub(crate) struct ExecSlot {
    id: u64,
    argv: Vec<String>,
    state: Mutex<SlotState>,
    cond: Condvar,
}

impl ExecSlot {
    pub fn info(&self) -> ProcessInfo {
        let mut st = lock(&self.state);
        let stdout = st.stdout.as_mut().map(Capture::snapshot);
        let stderr = st.stderr.as_mut().map(Capture::snapshot);
        let result = st.result.clone();
        ProcessInfo {
            exec_id: self.id,
            argv: self.argv.clone(),
            running: !st.done,
            stdout: stdout
                .or_else(|| result.as_ref().map(|r| r.stdout.clone()))
                .unwrap_or_default(),
            stderr: stderr
                .or_else(|| result.as_ref().map(|r| r.stderr.clone()))
                .unwrap_or_default(),
            result,
        }
    }

    fn finish(&self, outcome: Result<ExecResult, ApiError>) {
        let mut st = lock(&self.state);
        match outcome {
            Ok(r) => st.result = Some(r),
            Err(e) => st.error = Some(e.to_string()),
        }
        st.stdin = None;
        st.done = true;
        drop(st);
        self.cond.notify_all();
    }
}

/// One live sandbox.
pub(crate) struct Sandbox {
    pub id: SandboxId,
    pub info: Mutex<SandboxInfo>,
    pub dirs: Dirs,
    pub overlay: Overlay,
    /// Where the workspace is inside the container.
    pub workdir: String,
    pub container: String,
    pub init: procfs::ProcId,
    pub policy: Policy,
    pub base_env: Vec<(String, String)>,
    pub execs: Mutex<HashMap<u64, Arc<ExecSlot>>>,
    pub next_exec: AtomicU64,
    pub lost: AtomicBool,
    /// Execs and file operations hold it shared; checkpoint and restore exclusively.
    pub layers_lock: RwLock<()>,
    pub daemon: Arc<Daemon>,
    /// "cgroup-v1" or "cgroup-v2".
    pub limits_kind: String,
    /// Network mode "proxy": the sandbox's egress proxy.
    pub egress: Option<SandboxEgress>,
}

/// Runs file operations with the container user's filesystem ids, so what the API writes is
/// owned by that user and what it may touch is what that user may touch. fsuid is per thread;
/// the guard restores root's on drop.
struct AsUser;

impl AsUser {
    fn enter(user: (u32, u32)) -> AsUser {
        // SAFETY: setfsgid/setfsuid only change this thread's filesystem credentials.
        unsafe {
            libc::setfsgid(user.1);
            libc::setfsuid(user.0);
        }
        AsUser
    }
}

impl Drop for AsUser {
    fn drop(&mut self) {
        // SAFETY: as above; back to root's ids (the backend runs as root).
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
    }
}

impl Sandbox {
    pub fn lost_error(&self) -> ApiError {
        ApiError::Conflict(format!(
            "sandbox {} is lost (its container is gone or stopped, e.g. the Docker daemon \
             restarted); destroy it",
            self.id
        ))
    }

    /// Whether the container still runs (its pid 1 is alive). Marks the sandbox lost if not.
    pub fn check_alive(&self) -> bool {
        if self.lost.load(Ordering::SeqCst) {
            return false;
        }
        if procfs::alive(&self.init) {
            return true;
        }
        self.mark_lost();
        false
    }

    /// Puts new egress rules in force (network mode "proxy" only).
    pub fn set_network(&self, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        match &self.egress {
            Some(egress) => egress.replace_rules(self.id.as_str(), rules),
            None => Err(egress::no_proxy(self.id.as_str(), self.policy.network.mode)),
        }
    }

    pub fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        lock(&self.info).state = "lost".into();
    }

    pub fn snapshot_info(&self) -> SandboxInfo {
        self.check_alive();
        lock(&self.info).clone()
    }

    fn enforcement(&self) -> Enforcement {
        Enforcement {
            landlock: "none".into(),
            seccomp: true,
            network: self.policy.network.mode.as_str().into(),
            limits: self.limits_kind.clone(),
            disk: "loop-ext4".into(),
        }
    }

    /// The workspace for path-safe file operations, with the container user's ids.
    pub fn with_fs<T>(
        &self,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let _g = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let fs = WorkspaceFs::open(&self.dirs.mnt())?
            .with_mount_path(PathBuf::from(&self.workdir))
            .with_protected(&self.policy.filesystem.protected);
        let _user = AsUser::enter(self.overlay.user);
        op(&fs)
    }

    /// Reads a workspace file, or an exec's spill file under [`SPILL_MOUNT`].
    pub fn fs_read(&self, req: ReadRequest) -> Result<ReadResult, ApiError> {
        if let Some(r) = read_spill(&self.dirs.out(), &req) {
            return r;
        }
        self.with_fs(|fs| fs.read(&req))
    }

    fn checkpoint_dir(&self, name: &str) -> Result<PathBuf, ApiError> {
        Ok(self.dirs.checkpoints().join(checkpoint_name(name)?))
    }

    pub fn diff(&self, req: DiffRequest) -> Result<DiffResult, ApiError> {
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
        layer_diff(
            &self.overlay.workspace,
            &self.dirs.upper(),
            since.as_deref(),
        )
    }

    pub fn checkpoint(&self, req: CheckpointRequest) -> Result<CheckpointInfo, ApiError> {
        let dir = self.checkpoint_dir(&req.name)?;
        let _g = self
            .layers_lock
            .write()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let files = take_checkpoint(&self.overlay.workspace, &self.dirs.upper(), &dir, &req.name)?;
        lock(&self.info).checkpoints.push(req.name.clone());
        Ok(CheckpointInfo {
            name: req.name,
            created_at_ms: now_ms(),
            files,
        })
    }

    /// Stops every exec of the sandbox and waits (up to `wait`) until they have ended.
    fn stop_execs(&self, wait: Duration) {
        let slots: Vec<Arc<ExecSlot>> = lock(&self.execs).values().cloned().collect();
        for slot in &slots {
            if !lock(&slot.state).done {
                self.kill_tree(slot);
            }
        }
        let deadline = Instant::now() + wait;
        for slot in slots {
            let mut st = lock(&slot.state);
            while !st.done {
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
    }

    /// Rolls the workspace back to a checkpoint: every exec is stopped (and every other process
    /// of the container but its pid 1 killed), the overlay is detached
    /// on the host (and so in the container), and a fresh one on a copy of the checkpoint is
    /// mounted in its place (it propagates into the container).
    pub fn restore(&self, req: CheckpointRequest) -> Result<(), ApiError> {
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
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        self.stop_execs(Duration::from_secs(5));
        // Whatever left its exec's tree (and could pose as another exec's wrapper) too: nothing
        // of the sandbox may run while the new workspace and its guards are mounted on paths it
        // could otherwise swap for symlinks.
        procfs::kill_all_but_init(&self.init);
        let staged = StagedLayers::stage(&self.dirs.disk(), &ckpt)?;
        self.overlay.prepare_upper(&staged.upper)?;
        hostmount::detach(&self.dirs.mnt()).map_err(|e| {
            self.mark_lost();
            ApiError::internal(format!("restore: {e}; destroy the sandbox"))
        })?;
        if let Err(e) = self
            .overlay
            .mount(&self.dirs, &staged.upper, &staged.work, &self.policy)
        {
            self.mark_lost();
            return Err(ApiError::internal(format!(
                "restore of checkpoint {} failed: {e}; destroy the sandbox",
                req.name
            )));
        }
        staged.swap_in(&self.dirs.disk(), &self.dirs.upper(), &self.dirs.work())
    }

    pub fn export(&self, req: ExportRequest, exports: &Path) -> Result<ExportResult, ApiError> {
        let _g = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        let upper = self.dirs.upper();
        let ws = &self.overlay.workspace;
        let list = changes::scan(&upper, ws).map_err(changes_err)?;
        let mut patch = None;
        let mut tar_path = None;
        match req.format {
            ExportFormat::Patch => {
                patch = Some(changes::unified_diff(&upper, ws, &list).map_err(changes_err)?);
            }
            ExportFormat::Tar => {
                fs::create_dir_all(exports).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", exports.display()))
                })?;
                let path = exports.join(format!("{}-{}.tar", self.id, now_ms()));
                let mut f = std::io::BufWriter::new(fs::File::create(&path).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", path.display()))
                })?);
                layers::export_tar(&upper, ws, &list, &mut f).map_err(layers_err)?;
                f.flush().map_err(|e| {
                    ApiError::internal(format!("cannot write {}: {e}", path.display()))
                })?;
                tar_path = Some(path.display().to_string());
            }
        }
        let mut applied = false;
        if req.apply {
            layers::apply_to_host(&upper, ws, &list).map_err(layers_err)?;
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

    pub fn slot(&self, exec_id: u64) -> Result<Arc<ExecSlot>, ApiError> {
        lock(&self.execs)
            .get(&exec_id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("process {exec_id} does not exist")))
    }

    /// The wrapper's host pid of an exec, asking the daemon the first time.
    fn wrapper_pid(&self, slot: &ExecSlot) -> Option<i32> {
        let (known, exec) = {
            let st = lock(&slot.state);
            (st.wrapper_pid, st.docker_exec.clone())
        };
        if known.is_some() {
            return known;
        }
        let exec = exec?;
        let d = &self.daemon;
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let inspect =
                d.block_on(d.call("inspect an exec", d.timeout, d.docker.inspect_exec(&exec)));
            match inspect {
                Ok(i) => {
                    if let Some(pid) = i.pid.filter(|p| *p > 0) {
                        let pid = pid as i32;
                        lock(&slot.state).wrapper_pid = Some(pid);
                        return Some(pid);
                    }
                    if i.running == Some(false) && Instant::now() > deadline {
                        return None;
                    }
                }
                Err(_) => return None,
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Asks an exec's wrapper to kill the exec's whole process tree; if the wrapper is gone,
    /// kills what is left of the tree from the host.
    pub fn kill_tree(&self, slot: &ExecSlot) {
        match self.wrapper_pid(slot) {
            Some(pid) if procfs::is_wrapper_of(pid, slot.id) => {
                // SAFETY: kill has no memory arguments; the pid was checked to be the wrapper.
                unsafe { libc::kill(pid, libc::SIGUSR1) };
            }
            _ => procfs::kill_orphans(&self.init, slot.id),
        }
    }

    /// Sends `signal` to the exec's main process (SIGKILL: the whole tree).
    pub fn kill(&self, exec_id: u64, signal: i32) -> Result<ProcessInfo, ApiError> {
        let slot = self.slot(exec_id)?;
        if !(1..=64).contains(&signal) {
            return Err(ApiError::invalid(format!("invalid signal {signal}")));
        }
        if !lock(&slot.state).done {
            if signal == libc::SIGKILL {
                self.kill_tree(&slot);
            } else if let Some(wrapper) = self.wrapper_pid(&slot)
                && procfs::is_wrapper_of(wrapper, slot.id)
                && let Some(main) = procfs::children(wrapper).first().copied()
            {
                // SAFETY: kill has no memory arguments; `main` is the wrapper's child.
                unsafe { libc::kill(main, signal) };
            }
        }
        Ok(slot.info())
    }

    pub fn write_stdin(&self, exec_id: u64, data: &[u8], close: bool) -> Result<(), ApiError> {
        let slot = self.slot(exec_id)?;
        let mut st = lock(&slot.state);
        let Some(tx) = st.stdin.as_ref() else {
            return Err(ApiError::Conflict(format!(
                "process {exec_id} has no open stdin (it ended, was started with stdin text, or \
                 stdin was closed)"
            )));
        };
        if !data.is_empty() && tx.send(StdinMsg::Data(data.to_vec())).is_err() {
            st.stdin = None;
            return Err(ApiError::Conflict(format!(
                "cannot write to process {exec_id}: it ended"
            )));
        }
        if close {
            let _ = tx.send(StdinMsg::Close);
            st.stdin = None;
        }
        Ok(())
    }

    pub fn wait(&self, exec_id: u64, timeout: Duration) -> Result<ProcessInfo, ApiError> {
        let slot = self.slot(exec_id)?;
        let deadline = Instant::now() + timeout;
        {
            let mut st = lock(&slot.state);
            while !st.done {
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

    fn fingerprint(&self) -> Result<Option<layers::Fingerprint>, ApiError> {
        if self.policy.filesystem.workspace != WorkspaceMode::Overlay {
            return Ok(None);
        }
        layers::fingerprint(&self.dirs.upper())
            .map(Some)
            .map_err(layers_err)
    }

    fn changes_since(&self, before: &layers::Fingerprint) -> Result<Vec<Change>, ApiError> {
        let upper = self.dirs.upper();
        let after = layers::fingerprint(&upper).map_err(layers_err)?;
        layers::exec_changes(before, &after, &upper, &self.overlay.workspace).map_err(layers_err)
    }

    /// Runs a command: foreground (blocking, streaming `events`) or background.
    pub fn exec(
        self: &Arc<Self>,
        req: ExecRequest,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let guard = self
            .layers_lock
            .read()
            .map_err(|_| ApiError::internal("poisoned"))?;
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let argv = req.resolved_argv()?;
        let timeout = req.time_limit(self.policy.limits.timeout)?;
        let cwd = match &req.cwd {
            None => self.workdir.clone(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => format!("{}/{c}", self.workdir.trim_end_matches('/')),
        };
        exec_limits::check_cwd(&cwd)?;
        let env = req.layered_env(&self.base_env)?;
        // What execve would refuse (for the wrapper, then for the command) is refused here,
        // naming the limit, before the daemon is asked for anything.
        let wrapper = [INIT_PATH, "exec", LONGEST_ID, &cwd, "--"];
        exec_limits::Command {
            argv: &argv,
            env: &env,
            shell: req.shell.is_some(),
            extra: &wrapper,
        }
        .check(exec_limits::argument_space(
            procfs::stack_limit(&self.init).unwrap_or(DEFAULT_STACK),
        ))?;
        check_spec_size(&wrapper, &argv, &env)?;
        let limit = req.output_cap(self.policy.limits.output_bytes);
        let before = self.fingerprint()?;
        let oom_before = procfs::oom_kills(&self.init);
        let id = self.next_exec.fetch_add(1, Ordering::SeqCst);
        let out = self.dirs.out();
        let stdout = Capture::new(limit, out.join(format!("{id}.stdout")))
            .with_shown_path(Path::new(SPILL_MOUNT).join(format!("{id}.stdout")));
        let stderr = Capture::new(limit, out.join(format!("{id}.stderr")))
            .with_shown_path(Path::new(SPILL_MOUNT).join(format!("{id}.stderr")));
        let (stdin_tx, stdin_rx) = tokio::sync::mpsc::unbounded_channel();
        let attach_stdin = req.stdin.is_some() || req.background;
        if let Some(text) = &req.stdin {
            let _ = stdin_tx.send(StdinMsg::Data(text.clone().into_bytes()));
            let _ = stdin_tx.send(StdinMsg::Close);
        }
        let slot = Arc::new(ExecSlot {
            id,
            argv: argv.clone(),
            state: Mutex::new(SlotState {
                wrapper_pid: None,
                docker_exec: None,
                stdout: Some(stdout),
                stderr: Some(stderr),
                result: None,
                error: None,
                stdin: (req.background && req.stdin.is_none()).then_some(stdin_tx),
                done: false,
            }),
            cond: Condvar::new(),
        });
        let mut cmd = vec![
            INIT_PATH.to_string(),
            "exec".into(),
            id.to_string(),
            cwd,
            "--".into(),
        ];
        cmd.extend(argv);
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let user = format!("{}:{}", self.overlay.user.0, self.overlay.user.1);
        let d = self.daemon.clone();
        let container = self.container.clone();
        let started = self.daemon.block_on(async move {
            let created = d
                .call(
                    "create an exec",
                    d.timeout,
                    d.docker.create_exec(
                        &container,
                        CreateExecOptions {
                            cmd: Some(cmd),
                            env: Some(env),
                            user: Some(user),
                            working_dir: Some("/".to_string()),
                            attach_stdin: Some(attach_stdin),
                            attach_stdout: Some(true),
                            attach_stderr: Some(true),
                            tty: Some(false),
                            ..Default::default()
                        },
                    ),
                )
                .await?;
            let started = d
                .call(
                    "start an exec",
                    d.timeout,
                    d.docker.start_exec(
                        &created.id,
                        Some(StartExecOptions {
                            detach: false,
                            tty: false,
                            output_capacity: Some(64 * 1024),
                        }),
                    ),
                )
                .await?;
            Ok::<_, DaemonError>((created.id, started))
        });
        let (docker_exec, started) = match started {
            Ok(s) => s,
            Err(DaemonError::Conflict(m)) | Err(DaemonError::NotFound(m)) => {
                tracing::warn!(sandbox = %self.id, message = %m, "the container is not running");
                self.mark_lost();
                return Err(self.lost_error());
            }
            Err(e) => {
                if !self.check_alive() {
                    return Err(self.lost_error());
                }
                return Err(e.into());
            }
        };
        let StartExecResults::Attached { output, input } = started else {
            return Err(ApiError::internal("the daemon started the exec detached"));
        };
        lock(&slot.state).docker_exec = Some(docker_exec);
        lock(&self.execs).insert(id, slot.clone());
        let baseline = Baseline {
            before,
            oom_before,
            window: self.egress.as_ref().map(|e| e.log.open()),
        };
        let stream = Stream {
            output,
            input: attach_stdin.then_some(input),
            stdin: stdin_rx,
        };
        let start = Instant::now();
        if req.background {
            drop(guard);
            let sb = Arc::clone(self);
            let slot2 = slot.clone();
            let d = self.daemon.clone();
            d.spawn(async move {
                let res = sb.drive(&slot2, stream, timeout, start, None).await;
                let res = res.and_then(|ended| {
                    tokio::task::block_in_place(|| {
                        sb.result(&slot2, ended, timeout, start, baseline)
                    })
                });
                slot2.finish(res);
            });
            return Ok(ExecOutcome::Background(slot.info()));
        }
        // The driver runs on the backend's runtime; events come back over a channel and the
        // callback runs on this thread, outside any async context (it may block).
        let (ev_tx, ev_rx) = std::sync::mpsc::channel::<ExecEvent>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (sb, slot2) = (Arc::clone(self), slot.clone());
        let ev_tx = events.is_some().then_some(ev_tx);
        self.daemon.spawn(async move {
            let r = sb.drive(&slot2, stream, timeout, start, ev_tx).await;
            let _ = done_tx.send(r);
        });
        if let Some(cb) = events {
            for ev in ev_rx {
                cb(ev);
            }
        }
        let res = done_rx
            .recv()
            .map_err(|_| ApiError::internal("the exec's driver ended without an answer"))
            .and_then(|r| r)
            .and_then(|ended| self.result(&slot, ended, timeout, start, baseline));
        lock(&self.execs).remove(&id);
        drop(guard);
        Ok(ExecOutcome::Finished(res?))
    }
}

/// The exec id as the wrapper's argument takes the most room.
const LONGEST_ID: &str = "18446744073709551615";

/// The usual stack limit, when the container's cannot be read.
pub(crate) const DEFAULT_STACK: u64 = 8 << 20;

/// containerd hands an exec's process spec (its JSON) to the container's shim in one message of
/// at most 4 MiB; the arguments and environment may take this much of it.
const SPEC_ROOM: u64 = 4 * 1024 * 1024 - 256 * 1024;

/// Refuses an exec whose argv and environment, as JSON in the process spec, would not fit in
/// containerd's message: Go escapes control characters, `<`, `>`, `&` and U+2028/9 as six bytes.
fn check_spec_size(
    wrapper: &[&str],
    argv: &[String],
    env: &[(String, String)],
) -> Result<(), ApiError> {
    let json_len = |s: &str| -> u64 {
        s.chars()
            .map(|c| match c {
                '\u{0}'..='\u{1f}' | '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => 6,
                '"' | '\\' => 2,
                c => c.len_utf8() as u64,
            })
            .sum::<u64>()
            + 3
    };
    let total: u64 = wrapper.iter().map(|s| json_len(s)).sum::<u64>()
        + argv.iter().map(|s| json_len(s)).sum::<u64>()
        + env
            .iter()
            .map(|(k, v)| json_len(k) + json_len(v) - 2)
            .sum::<u64>();
    if total > SPEC_ROOM {
        return Err(ApiError::invalid(format!(
            "the command's arguments and environment take {total} bytes in the process spec \
             Docker passes to containerd, over the {SPEC_ROOM} bytes its 4 MiB message leaves \
             them; pass long text on stdin or in a file"
        )));
    }
    Ok(())
}

/// An attached exec's streams.
pub(crate) struct Stream {
    output: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>,
    >,
    input: Option<std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>>,
    stdin: tokio::sync::mpsc::UnboundedReceiver<StdinMsg>,
}

/// What an exec's result is measured against: the upper layer and the OOM count before it
/// started, and its window on the egress proxy's decisions.
pub(crate) struct Baseline {
    before: Option<layers::Fingerprint>,
    oom_before: u64,
    window: Option<ExecWindow>,
}

/// What the driver saw.
pub(crate) struct Driven {
    ended: Option<Ended>,
    timed_out: bool,
}

impl Sandbox {
    /// Pumps an exec's output into its captures (and `events`) until the streams end, killing
    /// the tree at the deadline; then reads the wrapper's status.
    async fn drive(
        self: &Arc<Self>,
        slot: &Arc<ExecSlot>,
        mut stream: Stream,
        timeout: Duration,
        start: Instant,
        events: Option<std::sync::mpsc::Sender<ExecEvent>>,
    ) -> Result<Driven, ApiError> {
        if let Some(ev) = &events {
            let _ = ev.send(ExecEvent::Started { exec_id: slot.id });
        }
        let deadline = tokio::time::Instant::from_std(start + timeout);
        let mut timed_out = false;
        // After a kill, how long the streams may stay open before the driver gives up on them.
        let mut give_up: Option<tokio::time::Instant> = None;
        let mut stdin_open = stream.input.is_some();
        let mut stream_error = None;
        loop {
            let kill_at = if timed_out {
                give_up.unwrap_or(deadline)
            } else {
                deadline
            };
            tokio::select! {
                item = stream.output.next() => match item {
                    Some(Ok(LogOutput::StdOut { message })) => {
                        self.push(slot, true, &message, &events);
                    }
                    Some(Ok(LogOutput::StdErr { message })) => {
                        self.push(slot, false, &message, &events);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        stream_error = Some(e.to_string());
                        break;
                    }
                    None => break,
                },
                msg = stream.stdin.recv(), if stdin_open => {
                    let Some(input) = stream.input.as_mut() else {
                        stdin_open = false;
                        continue;
                    };
                    match msg {
                        Some(StdinMsg::Data(data)) => {
                            if input.write_all(&data).await.is_err() {
                                stdin_open = false;
                            }
                        }
                        Some(StdinMsg::Close) | None => {
                            let _ = input.shutdown().await;
                            stdin_open = false;
                        }
                    }
                }
                _ = tokio::time::sleep_until(kill_at) => {
                    if !timed_out {
                        timed_out = true;
                        let (sb, s) = (Arc::clone(self), Arc::clone(slot));
                        let _ = tokio::task::spawn_blocking(move || sb.kill_tree(&s)).await;
                        give_up = Some(tokio::time::Instant::now() + Duration::from_secs(5));
                    } else {
                        let (sb, s) = (Arc::clone(self), Arc::clone(slot));
                        let _ = tokio::task::spawn_blocking(move || {
                            procfs::kill_orphans(&sb.init, s.id)
                        })
                        .await;
                        tracing::warn!(sandbox = %self.id, exec = slot.id,
                            "the exec's streams stayed open after its tree was killed");
                        break;
                    }
                }
            }
        }
        let ended = self.read_status(slot.id);
        if ended.is_none() {
            if !self.check_alive() {
                return Err(self.lost_error());
            }
            if let Some(e) = stream_error {
                let ping = self.daemon.ping().await;
                if let Err(e) = ping {
                    return Err(e.into());
                }
                return Err(ApiError::internal(format!(
                    "the exec's output stream failed: {e}"
                )));
            }
        }
        Ok(Driven { ended, timed_out })
    }

    fn push(
        &self,
        slot: &ExecSlot,
        stdout: bool,
        data: &[u8],
        events: &Option<std::sync::mpsc::Sender<ExecEvent>>,
    ) {
        {
            let mut st = lock(&slot.state);
            let cap = if stdout {
                &mut st.stdout
            } else {
                &mut st.stderr
            };
            if let Some(c) = cap.as_mut() {
                c.push(data);
            }
        }
        if let Some(ev) = events {
            let text = String::from_utf8_lossy(data).into_owned();
            let _ = ev.send(if stdout {
                ExecEvent::Stdout { data: text }
            } else {
                ExecEvent::Stderr { data: text }
            });
        }
    }

    /// Reads and removes the wrapper's status file of exec `id`.
    fn read_status(&self, id: u64) -> Option<Ended> {
        let path = self.dirs.run().join(format!("{id}.status"));
        let mut f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .ok()?;
        if !f.metadata().ok()?.is_file() {
            return None;
        }
        let mut buf = String::new();
        let _ = (&mut f).take(256).read_to_string(&mut buf);
        let _ = fs::remove_file(&path);
        Ended::parse(&buf)
    }

    /// Builds the observation of an exec that has ended.
    fn result(
        &self,
        slot: &ExecSlot,
        driven: Driven,
        timeout: Duration,
        start: Instant,
        baseline: Baseline,
    ) -> Result<ExecResult, ApiError> {
        let Baseline {
            before,
            oom_before,
            window,
        } = baseline;
        let (mut out, mut err) = {
            let mut st = lock(&slot.state);
            (
                st.stdout.take().map(Capture::finish).unwrap_or_default(),
                st.stderr.take().map(Capture::finish).unwrap_or_default(),
            )
        };
        let (mut exit_code, mut signal, cpu_ms, max_rss_bytes) = match &driven.ended {
            Some(Ended::Exit { code, cpu_ms, rss }) => (Some(*code), None, *cpu_ms, *rss),
            Some(Ended::Signal {
                signal,
                cpu_ms,
                rss,
            }) => (None, Some(*signal), *cpu_ms, *rss),
            Some(Ended::ExecFailed { errno }) => {
                let program = slot.argv.first().map_or("", String::as_str);
                err.note_exec_failure(*errno, program);
                (
                    Some(if *errno == libc::ENOENT { 127 } else { 126 }),
                    None,
                    0,
                    0,
                )
            }
            Some(Ended::Cwd { errno }) => {
                return Err(ApiError::invalid(format!(
                    "cannot enter working directory: {}",
                    std::io::Error::from_raw_os_error(*errno)
                )));
            }
            None if driven.timed_out => (None, Some(libc::SIGKILL), 0, 0),
            None => {
                return Err(ApiError::internal(
                    "the exec ended without a status from its wrapper (was it killed from \
                     inside the sandbox?)",
                ));
            }
        };
        if driven.timed_out {
            exit_code = None;
            signal = Some(libc::SIGKILL);
        }
        let mut violations = Vec::new();
        if driven.timed_out {
            violations.push(Violation::timeout(timeout));
        }
        // The container's memory cgroup counts the kernel's OOM kills.
        let oom_killed = procfs::oom_kills(&self.init) > oom_before;
        if oom_killed {
            violations.push(Violation::memory_limit(self.policy.limits.memory_bytes));
        }
        // A process killed for writing past the file size limit, or a shell reporting that a
        // child was (128 + SIGXFSZ).
        if signal == Some(libc::SIGXFSZ) || exit_code == Some(128 + libc::SIGXFSZ) {
            violations.push(Violation::file_size_limit(
                self.policy.limits.file_size_bytes,
            ));
        }
        if taskbox_core::disk::is_full_at(&self.dirs.disk(), self.policy.limits.disk_bytes) {
            violations.push(Violation::disk_limit(self.policy.limits.disk_bytes));
        }
        // The exec's wrapper has ended, and with it every process of the exec: what the proxy
        // decided meanwhile is (also) this exec's.
        let network = window.map(|w| {
            let (denials, activity) = w.close(CLOSE_GRACE);
            violations.extend(denials);
            activity
        });
        let changes = match &before {
            Some(before) => self.changes_since(before)?,
            None => Vec::new(),
        };
        if out.text.is_empty() && out.bytes == 0 {
            out = Output::default();
        }
        Ok(ExecResult {
            exit_code,
            signal,
            timed_out: driven.timed_out,
            duration_ms: start.elapsed().as_millis() as u64,
            stdout: out,
            stderr: err,
            changes,
            violations,
            resources: Resources {
                cpu_ms,
                max_rss_bytes,
                oom_killed,
            },
            enforcement: self.enforcement(),
            network,
        })
    }

    /// Marks every exec of a sandbox that is going away.
    pub fn end_execs(&self, why: &str) {
        for slot in lock(&self.execs).values() {
            let mut st = lock(&slot.state);
            if !st.done {
                st.error = Some(why.to_string());
                st.done = true;
                st.stdin = None;
            }
            drop(st);
            slot.cond.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_spec_must_fit_in_containerds_message() {
        let wrapper = [INIT_PATH, "exec", LONGEST_ID, "/workspace", "--"];
        let plain = vec!["echo".to_string(), "a".repeat(3 << 20)];
        check_spec_size(&wrapper, &plain, &[]).unwrap();
        // Go writes each `<` as \u003c: a sixth of the text already fills the message.
        let escaped = vec!["echo".to_string(), "<".repeat(1 << 20)];
        let e = check_spec_size(&wrapper, &escaped, &[]).unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidArgument(m) if m.contains("containerd") && m.contains("4 MiB")),
            "{e}"
        );
        let env = vec![("V".to_string(), "\u{1}".repeat(1 << 20))];
        assert!(check_spec_size(&wrapper, &plain[..1], &env).is_err());
    }

    #[test]
    fn status_lines_parse() {
        assert_eq!(
            Ended::parse("exit 3 12 4096\n"),
            Some(Ended::Exit {
                code: 3,
                cpu_ms: 12,
                rss: 4096
            })
        );
        assert_eq!(
            Ended::parse("signal 9 0 0"),
            Some(Ended::Signal {
                signal: 9,
                cpu_ms: 0,
                rss: 0
            })
        );
        assert_eq!(
            Ended::parse("execfail 2"),
            Some(Ended::ExecFailed { errno: 2 })
        );
        assert_eq!(Ended::parse("cwd 20"), Some(Ended::Cwd { errno: 20 }));
        assert_eq!(Ended::parse("bogus"), None);
        assert_eq!(Ended::parse(""), None);
    }
}
