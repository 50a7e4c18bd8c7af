//! The native Linux backend, one-shot: plan the sandbox from a policy, hand the plan to the
//! `taskbox-init` helper, capture its output within bounds, enforce the wall-clock timeout, and
//! turn what happened into an [`ExecResult`].

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use taskbox_protocol::config::{
    DISK_FD, DiskPlan, EGRESS_FD, EgressPlan, InitConfig, LandlockPlan, MountOp, OwnerMap, PLAN_FD,
    Rlimit, RlimitResource, RootPlan, STATUS_FD, Status,
};

use crate::capture::Capture;
use crate::cgroup::{Cgroup, CgroupLimits};
use crate::changes;
use crate::disk::Disk;
use crate::egress::{self, EgressLog, EgressProxy, EgressService};
use crate::exec_end::ExecEnd;
use crate::image::ImageRoot;
use crate::image_view::{Identity, ImageView, ImageViewError, check_option_path};
use crate::policy::{
    BUILTIN_DENY_READ, CREDENTIAL_STORES, HomeMode, LandlockMode, NetworkMode, Policy,
    WorkspaceMode,
};
use crate::result::{Enforcement, ExecResult, Output};

/// What went wrong in taskbox itself (not in the command). The CLI exits 125 on these.
#[derive(Debug, thiserror::Error)]
pub enum NativeError {
    /// the workspace is unusable
    #[error("workspace {path}: {why}")]
    Workspace { path: String, why: String },
    /// the request is invalid
    #[error("{0}")]
    Invalid(String),
    /// the state directory cannot be prepared
    #[error("state directory {path}: {source}")]
    State { path: String, source: io::Error },
    /// the helper binary is missing
    #[error(
        "cannot find the sandbox helper `taskbox-init` next to {exe} (set TASKBOX_INIT to its path)"
    )]
    HelperMissing { exe: String },
    /// starting the helper failed
    #[error("cannot start the sandbox helper: {0}")]
    Spawn(io::Error),
    /// the helper reported a set-up failure
    #[error("sandbox set-up failed at {stage}: {message}")]
    Setup { stage: String, message: String },
    /// cgroup set-up failed
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// computing the workspace changes failed
    #[error(transparent)]
    Changes(#[from] changes::ChangesError),
    /// the image cannot be the sandbox's root
    #[error(transparent)]
    Image(#[from] ImageViewError),
    /// an I/O error while supervising the run
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// the egress proxy could not be wired into the sandbox
    #[error("egress proxy: {0}")]
    Egress(String),
    /// the disk quota could not be made
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NativeError {
    let what = what.into();
    move |source| NativeError::Io { what, source }
}

/// Where the command's standard input comes from.
#[derive(Debug, Clone, Default)]
pub enum StdinSource {
    /// Inherit the caller's standard input.
    #[default]
    Inherit,
    /// Empty input.
    Null,
}

/// A one-shot run.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub argv: Vec<String>,
    pub workspace: PathBuf,
    pub policy: Policy,
    /// Overrides the policy's timeout.
    pub timeout: Option<Duration>,
    /// Mount the workspace read-write, without the overlay: the command changes the host copy.
    pub write_through: bool,
    /// Extra variables (after the policy's).
    pub env: Vec<(String, String)>,
    /// Working directory; default the workspace root.
    pub cwd: Option<PathBuf>,
    pub stdin: StdinSource,
    /// Also copy the command's output to this process's stdout/stderr as it arrives.
    pub echo: bool,
    /// Remove the run's scratch directory and cgroup in a detached process, off the caller's
    /// critical path. Only for single-threaded callers (it forks); the CLI sets it.
    pub detach_cleanup: bool,
    /// Compute the unified diff of the workspace changes.
    pub want_diff: bool,
    pub state_dir: PathBuf,
    /// The sandbox's root: this image (read-only, shared, never written) instead of the host
    /// view. The workspace appears at the image's workdir, and a relative `cwd` is taken from
    /// there.
    pub image: Option<ImageRoot>,
    /// Build mode (the image builder's `run` steps; needs `image`): the root is writable, an
    /// overlay with the image's rootfs below and this directory (created when missing) as its
    /// upper layer, so what the command changes outside the workspace and the private mounts
    /// lands here as a normal overlay upper layer: new and modified files, deletions as
    /// whiteouts (character devices 0/0), replaced directories marked opaque with the
    /// `user.overlay.opaque` attribute (the overlay uses `userxattr`, root or not). Its work
    /// directory is created beside it (`.NAME.work-RUNID`) and removed after the run.
    pub root_upper: Option<PathBuf>,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutcome {
    pub result: ExecResult,
    /// The unified diff, when asked for.
    pub diff: Option<String>,
    /// The command could not be executed: (errno, program).
    pub exec_failed: Option<(i32, String)>,
}

/// The default state directory: `$TASKBOX_STATE_DIR`, else /var/lib/taskbox for root, else
/// `$XDG_STATE_HOME/taskbox` or `~/.local/state/taskbox`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TASKBOX_STATE_DIR") {
        return PathBuf::from(d);
    }
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/lib/taskbox");
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("taskbox");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| OsString::from("/tmp"));
    PathBuf::from(home).join(".local/state/taskbox")
}

/// Finds the helper: `$TASKBOX_INIT`, else `taskbox-init` beside the running executable (or one
/// directory up, as in cargo's test layout).
pub fn helper_path() -> Result<PathBuf, NativeError> {
    if let Some(p) = std::env::var_os("TASKBOX_INIT") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join("taskbox-init");
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    Err(NativeError::HelperMissing {
        exe: exe.display().to_string(),
    })
}

pub(crate) fn run_id() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{:x}{:05x}", now.as_millis(), std::process::id() & 0xfffff)
}

/// A run's (or a sandbox's) private directories, and its disk quota, which holds its layers
/// and scratch directories; removed on drop.
pub(crate) struct RunDir {
    pub(crate) dir: PathBuf,
    pub(crate) disk: Option<Disk>,
    /// The mount point of the root and the mask file, when they are not the run's own but
    /// shared by every sandbox of a backend (see [`RunDir::shared`]).
    shared: Option<SharedFiles>,
}

/// The mount points of the sandbox's root and of its disk, and the empty mask file, made once
/// per backend: a mount point is only a name in each sandbox's own mount namespace, and the
/// mask file is bound read-only, so one of each serves every sandbox. Each made per sandbox was
/// an inode made and freed on the state directory's file system per sandbox (see `write_table`
/// in the server for what that costs on an ext4 without a journal).
#[derive(Debug, Clone)]
pub(crate) struct SharedFiles {
    root: PathBuf,
    empty: PathBuf,
    disk: PathBuf,
}

impl SharedFiles {
    /// Makes (or checks) them in `dir`, a directory only the backend's user may enter.
    pub(crate) fn make(dir: &Path) -> io::Result<SharedFiles> {
        let root = dir.join(".root");
        let empty = dir.join(".empty");
        let disk = dir.join(".disk");
        for d in [&root, &disk] {
            match fs::create_dir(d) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
        }
        // Made again, read-only, unless an earlier process (or run) left it as it must be.
        match fs::symlink_metadata(&empty) {
            Ok(md) if md.is_file() && md.len() == 0 && md.mode() & 0o777 == 0o444 => {}
            found => {
                if found.is_ok() {
                    fs::remove_file(&empty)?;
                }
                fs::write(&empty, b"")?;
                fs::set_permissions(&empty, fs::Permissions::from_mode(0o444))?;
            }
        }
        Ok(SharedFiles { root, empty, disk })
    }
}

impl RunDir {
    pub(crate) fn new(dir: PathBuf) -> RunDir {
        RunDir {
            dir,
            disk: None,
            shared: None,
        }
    }
    /// A sandbox's directories, whose root mount point and mask file are `shared`.
    pub(crate) fn shared(dir: PathBuf, shared: SharedFiles) -> RunDir {
        RunDir {
            dir,
            disk: None,
            shared: Some(shared),
        }
    }
    pub(crate) fn root(&self) -> PathBuf {
        match &self.shared {
            Some(s) => s.root.clone(),
            None => self.dir.join("root"),
        }
    }
    /// The overlay's upper directory, as this process reaches it.
    pub(crate) fn upper(&self) -> PathBuf {
        self.on_disk("upper")
    }
    /// A directory of the disk ([`crate::disk::SUBDIRS`]) as this process reaches it (without a
    /// disk: in the run's directory).
    pub(crate) fn on_disk(&self, name: &str) -> PathBuf {
        match &self.disk {
            Some(d) => d.path().join(name),
            None => self.dir.join(name),
        }
    }
    /// The same directory as the helper names it in the sandbox's plan.
    pub(crate) fn planned(&self, name: &str) -> PathBuf {
        match &self.disk {
            Some(d) => d.planned().join(name),
            None => self.dir.join(name),
        }
    }
    /// Where the helper mounts the disk (see [`SharedFiles`]).
    pub(crate) fn disk_mount_point(&self) -> PathBuf {
        match &self.shared {
            Some(s) => s.disk.clone(),
            None => self.dir.join("disk"),
        }
    }
    pub(crate) fn empty_file(&self) -> PathBuf {
        match &self.shared {
            Some(s) => s.empty.clone(),
            None => self.dir.join("empty"),
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // The disk first: nothing of it may be left when its directory goes.
        drop(self.disk.take());
        remove_tree(&self.dir);
    }
}

pub use crate::hostdirs::private_dir;

pub use crate::hostdirs::remove_tree;

fn home_dir() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .filter(|h| h.is_absolute() && h != Path::new("/"))
}

fn expand_home(p: &str, home: Option<&Path>) -> Option<PathBuf> {
    match p.strip_prefix("~/") {
        Some(rest) => home.map(|h| h.join(rest)),
        None => Some(PathBuf::from(p)),
    }
}

/// Variables every sandbox gets, on every backend, so that re-runs (and replays on another
/// host or backend) see the same clock zone, locale and build timestamp: they replace what the
/// host passes through, and an image's config, the policy's `[env] set` and the request's env
/// replace them. `SOURCE_DATE_EPOCH` is 1980-01-01, the earliest time a zip file can hold.
/// `PYTHONDONTWRITEBYTECODE`: Python checks a cached `.pyc` against its source's mtime in whole
/// seconds and its size only, so an edit of the same size within the second of the run that
/// cached it imports the stale bytecode; an agent edits and reruns that fast. Without a cache
/// written in the sandbox there is nothing stale to import (docs/decisions.md); an empty value
/// (`PYTHONDONTWRITEBYTECODE=`) turns caching back on.
pub const FIXED_ENV: &[(&str, &str)] = &[
    ("TZ", "UTC"),
    ("LANG", "C.UTF-8"),
    ("SOURCE_DATE_EPOCH", "315532800"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
];

/// Computes the environment of the command: the policy's allowlist of host variables, then
/// [`FIXED_ENV`], then the image's, the policy's own variables, then the request's.
pub fn sandbox_env(policy: &Policy, extra: &[(String, String)]) -> Vec<(String, String)> {
    compose_env(policy, None, extra)
}

/// As [`sandbox_env`], with an image's variables (`image`) between the host's and the policy's.
/// With an image, host variables that name host paths (`PATH`, `HOME`, any value starting with
/// `/`) are left out: the image root has none of those paths, and the image sets its own; and no
/// host variable overrides one the image sets.
pub(crate) fn compose_env(
    policy: &Policy,
    image: Option<&[(String, String)]>,
    extra: &[(String, String)],
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for (k, v) in std::env::vars_os() {
        let (Some(k), Some(v)) = (k.to_str(), v.to_str()) else {
            continue;
        };
        let allowed = policy.env.pass.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => k.starts_with(prefix),
            None => p == k,
        });
        let host_path = k == "PATH" || k == "HOME" || v.starts_with('/');
        if allowed && !(image.is_some() && host_path) {
            set_var(&mut env, k, v);
        }
    }
    let extra = extra.iter().map(|(k, v)| (k, v));
    let mut env = layer_env(env, policy, image.unwrap_or_default(), extra);
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push((
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        ));
    }
    env
}

/// Layers the sandbox's own variables over `env` (what the host passes through, if anything), in
/// the order both backends use: [`FIXED_ENV`], the image's, the policy's `[env] set`, the egress
/// proxy's (network mode "proxy"), then the caller's `extra`; a later one replaces an earlier
/// one of the same name.
pub fn layer_env<'a>(
    mut env: Vec<(String, String)>,
    policy: &Policy,
    image: &[(String, String)],
    extra: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<(String, String)> {
    for (k, v) in FIXED_ENV {
        set_var(&mut env, k, v);
    }
    for (k, v) in image {
        set_var(&mut env, k, v);
    }
    let mut policy_vars: Vec<_> = policy.env.set.iter().collect();
    policy_vars.sort();
    for (k, v) in policy_vars {
        set_var(&mut env, k, v);
    }
    // The egress proxy, advertised after the policy's variables (a policy that sets its own
    // git config keeps it: the proxy's entry is appended) and before the caller's.
    if policy.network.mode == NetworkMode::Proxy {
        for (k, v) in egress::proxy_env(egress::PROXY_PORT, &env) {
            set_var(&mut env, &k, &v);
        }
    }
    for (k, v) in extra {
        set_var(&mut env, k, v);
    }
    env
}

fn set_var(env: &mut Vec<(String, String)>, k: &str, v: &str) {
    env.retain(|(ek, _)| ek != k);
    env.push((k.to_string(), v.to_string()));
}

/// Where a sandbox's workspace is: on the host (the overlay's lower layer, where changes are
/// read) and inside the sandbox (the host path itself with the host view, the image's workdir
/// with an image).
#[derive(Debug, Clone)]
pub(crate) struct WorkspacePaths {
    pub(crate) host: PathBuf,
    pub(crate) inside: PathBuf,
    /// Host paths no sandbox may see ([`hostdirs`](crate::hostdirs): taskbox's own state, the
    /// host's bound Unix sockets), canonical: masked in the host view, and wherever they appear
    /// inside the workspace.
    pub(crate) hidden: Vec<PathBuf>,
}

impl WorkspacePaths {
    /// The workspace `host` seen at `inside`, for a backend whose state directory is
    /// `state_dir`; `extra` are more paths to hide (the supervisor's socket and tokens file).
    /// Refuses a workspace that is, lies inside or holds taskbox's own state, unless it is one
    /// the backend made itself beneath its state directory (a replay's or an upload's). The
    /// scan of the host's sockets is left running on a thread of its own
    /// ([`SocketScan`](crate::hostdirs::SocketScan)) while the set-up goes on, and
    /// [`PendingWorkspace::finish`] gives the paths once the mount plan needs them.
    pub(crate) fn start(
        host: PathBuf,
        inside: PathBuf,
        state_dir: &Path,
        extra: &[PathBuf],
    ) -> Result<PendingWorkspace, String> {
        let own = crate::hostdirs::own_for_workspace(&host, state_dir, extra)?;
        let scan = crate::hostdirs::SocketScan::start();
        Ok(PendingWorkspace {
            paths: WorkspacePaths {
                host,
                inside,
                hidden: own,
            },
            scan,
        })
    }
}

/// A sandbox's workspace paths whose hidden list still lacks the host's sockets: no mount plan
/// takes one ([`plan_mounts`] takes [`WorkspacePaths`]), so none is made without them.
#[derive(Debug)]
pub(crate) struct PendingWorkspace {
    paths: WorkspacePaths,
    scan: crate::hostdirs::SocketScan,
}

impl PendingWorkspace {
    /// The paths, with the sockets the scan found among the hidden ones.
    pub(crate) fn finish(self) -> WorkspacePaths {
        WorkspacePaths {
            hidden: self.scan.add_to(self.paths.hidden),
            ..self.paths
        }
    }
}

/// The sandbox's root: the host view, or an image (writable into an upper layer in build mode).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RootView<'a> {
    Host,
    Image { view: &'a ImageView, build: bool },
}

/// The host workspace itself, for `--write-through`. Run by root, the command is uid 0: in a
/// directory another user owns it would leave root-owned files. So the mount maps that owner
/// onto the sandbox's root (an idmapped mount): the command keeps the owner's rights there, and
/// what it creates is the owner's. (Setuid and setgid modes are refused by seccomp.)
fn write_through_mount(ws: &WorkspacePaths, owner_as: Option<(u32, u32)>) -> MountOp {
    let owner = fs::metadata(&ws.host).map(|m| (m.uid(), m.gid()));
    let (as_uid, as_gid) = owner_as.unwrap_or((0, 0));
    match owner {
        Ok((uid, gid)) if nix::unistd::geteuid().is_root() && (uid, gid) != (as_uid, as_gid) => {
            MountOp::BindOwned {
                src: ws.host.clone(),
                dst: ws.inside.clone(),
                uid,
                gid,
                as_uid,
                as_gid,
            }
        }
        _ => MountOp::Bind {
            src: ws.host.clone(),
            dst: ws.inside.clone(),
            readonly: false,
        },
    }
}

/// `plan` with the owners a sandbox of `identity` needs: with an id range, the workspace's
/// upper layer is the sandbox user's (as its lower layer shows the workspace), and a writable
/// root's layer and `/run` the sandbox root's (lock files of tools run as root: adduser, apt).
pub(crate) fn ranged_disk_plan(mut plan: DiskPlan, identity: &Identity) -> DiskPlan {
    if let (Some(range), Some((uid, gid))) = (identity.id_range, identity.ranged_user()) {
        plan.owners.push(("upper".into(), uid, gid));
        for dir in ["root-upper", "run"] {
            plan.owners.push((dir.into(), range.base, range.base));
        }
    }
    plan
}

/// The mount plan and the Landlock write set for a sandbox of `policy` around `ws`.
pub(crate) fn plan_mounts(
    policy: &Policy,
    ws: &WorkspacePaths,
    run: &RunDir,
    write_through: bool,
    root: RootView<'_>,
    owner_as: Option<(u32, u32)>,
) -> (Vec<MountOp>, Vec<PathBuf>) {
    let mut ops = Vec::new();
    let mut writable = vec![PathBuf::from("/tmp"), PathBuf::from("/dev")];
    // Scratch space: a directory of the sandbox's disk (so it counts against limits.disk), or,
    // without a disk (unit tests of plans), a tmpfs.
    let disk = run.disk.is_some();
    let tmpfs = |dst: &str, mode: u32| match disk_dir(dst) {
        Some(name) if disk => MountOp::Bind {
            src: run.planned(name),
            dst: dst.into(),
            readonly: false,
        },
        _ => MountOp::Tmpfs {
            dst: dst.into(),
            mode,
            size_bytes: None,
        },
    };
    let (has_var_tmp, has_run) = match root {
        RootView::Host => (Path::new("/var/tmp").is_dir(), Path::new("/run").is_dir()),
        // The scaffold provides /run; /var/tmp only where the image has it.
        RootView::Image { view, .. } => (view.has_var_tmp(), true),
    };
    // Private scratch space: nothing written there reaches the host.
    ops.push(tmpfs("/tmp", 0o1777));
    if has_var_tmp {
        ops.push(tmpfs("/var/tmp", 0o1777));
        writable.push(PathBuf::from("/var/tmp"));
    }
    // /run holds the sockets of host daemons (Docker, D-Bus, systemd): none is reachable. An
    // image's /run is private as well (pid 1 keeps its private mounts there).
    if has_run {
        ops.push(tmpfs("/run", 0o755));
    }
    ops.extend(dev_ops(run));

    // Hidden paths that hold the workspace: an empty tmpfs with only the way to the workspace
    // in it, made read-only once the workspace is mounted.
    let mut around_workspace = Vec::new();
    if let RootView::Image { build, .. } = root {
        // The host is out of sight: no host path to mask, no home to hide. In build mode the
        // whole root is writable (its changes land in the build's upper layer).
        if build {
            writable.push(PathBuf::from("/"));
        }
    } else {
        ops.extend(host_masks(policy, run, &mut writable));
        for h in &ws.hidden {
            if ws.host.starts_with(h) {
                ops.push(MountOp::Dir {
                    dst: h.clone(),
                    mode: 0o755,
                });
                ops.push(tmpfs(h.to_str().unwrap_or("/"), 0o755));
                around_workspace.push(h.clone());
            } else if !h.starts_with(&ws.host) {
                ops.push(MountOp::Mask {
                    dst: h.clone(),
                    empty: run.empty_file(),
                });
            }
        }
    }

    // The workspace: an overlay whose upper layer belongs to the run, so the host copy stays
    // untouched; or the host directory itself with --write-through; or read-only.
    ops.push(MountOp::Dir {
        dst: ws.inside.clone(),
        mode: 0o755,
    });
    match (write_through, &policy.filesystem.workspace) {
        (true, _) => {
            ops.push(write_through_mount(ws, owner_as));
            writable.push(ws.inside.clone());
        }
        (false, WorkspaceMode::Overlay) => {
            // With `owner_as` (the host ids of a root-run sandbox's user), the lower layer is
            // mapped so that its owner's files are that user's.
            let lower_map = owner_as.and_then(|(as_uid, as_gid)| {
                let md = fs::metadata(&ws.host).ok()?;
                Some(OwnerMap {
                    uid: md.uid(),
                    gid: md.gid(),
                    as_uid,
                    as_gid,
                })
            });
            ops.push(MountOp::Overlay {
                lower: ws.host.clone(),
                upper: run.planned("upper"),
                work: run.planned("work"),
                dst: ws.inside.clone(),
                lower_map,
            });
            writable.push(ws.inside.clone());
        }
        (false, WorkspaceMode::ReadOnly) => {
            ops.push(MountOp::Bind {
                src: ws.host.clone(),
                dst: ws.inside.clone(),
                readonly: true,
            });
        }
    }

    ops.extend(workspace_guard_ops(
        policy,
        ws,
        &run.empty_file(),
        matches!(root, RootView::Host),
    ));
    for h in around_workspace {
        ops.push(MountOp::RemountReadOnly { dst: h });
    }

    ops.push(MountOp::Proc {
        dst: "/proc".into(),
    });
    for p in ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"] {
        ops.push(MountOp::ProtectReadOnly { dst: p.into() });
    }
    (ops, writable)
}

/// The disk directory bound on a scratch mount point (see [`crate::disk::SUBDIRS`]).
fn disk_dir(dst: &str) -> Option<&'static str> {
    match dst {
        "/tmp" => Some("tmp"),
        "/var/tmp" => Some("var-tmp"),
        "/run" => Some("run"),
        "/dev/shm" => Some("shm"),
        _ => None,
    }
}

/// The size of the small tmpfs mounts that only hold mount points, device nodes and symlinks
/// (`/dev`, the hidden `/home` and `/root`): the sandbox's files go to its disk, not there.
pub(crate) const SMALL_TMPFS: u64 = 1 << 20;

/// A minimal /dev: the harmless devices bound from the host, a private pty instance and shm.
fn dev_ops(run: &RunDir) -> Vec<MountOp> {
    let mut ops = vec![MountOp::Tmpfs {
        dst: "/dev".into(),
        mode: 0o755,
        size_bytes: run.disk.as_ref().map(|_| SMALL_TMPFS),
    }];
    for dev in ["null", "zero", "full", "random", "urandom", "tty"] {
        let host = Path::new("/dev").join(dev);
        if host.exists() {
            ops.push(MountOp::File { dst: host.clone() });
            ops.push(MountOp::Bind {
                src: host.clone(),
                dst: host,
                readonly: false,
            });
        }
    }
    ops.push(MountOp::Dir {
        dst: "/dev/pts".into(),
        mode: 0o755,
    });
    ops.push(MountOp::Devpts {
        dst: "/dev/pts".into(),
    });
    ops.push(MountOp::Symlink {
        target: "pts/ptmx".into(),
        dst: "/dev/ptmx".into(),
    });
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        ops.push(MountOp::Symlink {
            target: target.into(),
            dst: Path::new("/dev").join(name),
        });
    }
    ops.push(MountOp::Dir {
        dst: "/dev/shm".into(),
        mode: 0o1777,
    });
    ops.push(match run.disk {
        Some(_) => MountOp::Bind {
            src: run.planned("shm"),
            dst: "/dev/shm".into(),
            readonly: false,
        },
        None => MountOp::Tmpfs {
            dst: "/dev/shm".into(),
            mode: 0o1777,
            size_bytes: None,
        },
    });
    ops
}

/// The host view's masks: the deny list, and home directories hidden or read-only as the
/// policy says (a private home is added to `writable`).
fn host_masks(policy: &Policy, run: &RunDir, writable: &mut Vec<PathBuf>) -> Vec<MountOp> {
    let mut ops = Vec::new();
    // Paths no policy may open: masked with an empty file or an empty read-only directory.
    for p in BUILTIN_DENY_READ
        .iter()
        .map(PathBuf::from)
        .chain(policy.filesystem.deny_read.iter().map(PathBuf::from))
    {
        if let Ok(canonical) = fs::canonicalize(&p) {
            ops.push(MountOp::Mask {
                dst: canonical,
                empty: run.empty_file(),
            });
        }
    }

    // Home directories: hidden (an empty private tmpfs) except the listed toolchain directories.
    let home = home_dir().and_then(|h| fs::canonicalize(h).ok());
    if policy.filesystem.home == HomeMode::Hidden {
        let mut hidden = Vec::new();
        for top in ["/home", "/root"] {
            if Path::new(top).is_dir() {
                hidden.push(PathBuf::from(top));
            }
        }
        if let Some(h) = &home
            && !hidden.iter().any(|t| h.starts_with(t))
        {
            hidden.push(h.clone());
        }
        for top in &hidden {
            // The mount point may lie on a tmpfs made above (a home under /tmp).
            ops.push(MountOp::Dir {
                dst: top.clone(),
                mode: 0o755,
            });
            ops.push(MountOp::Tmpfs {
                dst: top.clone(),
                mode: 0o755,
                size_bytes: run.disk.as_ref().map(|_| SMALL_TMPFS),
            });
        }
        if let Some(h) = &home {
            ops.push(MountOp::Dir {
                dst: h.clone(),
                mode: 0o755,
            });
            // The private home's files go to the disk.
            if run.disk.is_some() {
                ops.push(MountOp::Bind {
                    src: run.planned("home"),
                    dst: h.clone(),
                    readonly: false,
                });
            }
            writable.push(h.clone());
            for dir in &policy.filesystem.home_visible {
                let Some(host) = expand_home(dir, Some(h)) else {
                    continue;
                };
                let Ok(host) = fs::canonicalize(&host) else {
                    continue;
                };
                if !host.starts_with(h) {
                    // A symlink out of home: bind the target where the name was.
                    continue;
                }
                if host.is_dir() {
                    ops.push(MountOp::Dir {
                        dst: host.clone(),
                        mode: 0o755,
                    });
                } else {
                    ops.push(MountOp::File { dst: host.clone() });
                }
                ops.push(MountOp::Bind {
                    src: host.clone(),
                    dst: host,
                    readonly: true,
                });
            }
        }
    }

    if policy.filesystem.home == HomeMode::ReadOnly
        && let Some(h) = &home
    {
        ops.push(MountOp::Dir {
            dst: h.clone(),
            mode: 0o755,
        });
        ops.push(MountOp::Bind {
            src: h.clone(),
            dst: h.clone(),
            readonly: true,
        });
    }
    ops
}

/// The mounts that guard paths inside the (mounted) workspace: credential stores masked wherever
/// they would be visible (under a toolchain directory or a read-only home with the host view,
/// and in the workspace), and the policy's protected paths bound read-only. What exists is
/// looked up on the host; the ops name the paths inside. `empty` is the empty file masks bind.
pub(crate) fn workspace_guard_ops(
    policy: &Policy,
    ws: &WorkspacePaths,
    empty: &Path,
    host_view: bool,
) -> Vec<MountOp> {
    let mut ops = Vec::new();
    if host_view && let Some(h) = home_dir().and_then(|h| fs::canonicalize(h).ok()) {
        for store in CREDENTIAL_STORES {
            let p = h.join(store);
            if fs::symlink_metadata(&p).is_ok() {
                ops.push(MountOp::Mask {
                    dst: fs::canonicalize(&p).unwrap_or(p),
                    empty: empty.to_path_buf(),
                });
            }
        }
    }
    for store in CREDENTIAL_STORES {
        if fs::symlink_metadata(ws.host.join(store)).is_ok() {
            ops.push(MountOp::Mask {
                dst: ws.inside.join(store),
                empty: empty.to_path_buf(),
            });
        }
    }
    // What is hidden on the host stays hidden inside the workspace: taskbox's own state and
    // bound sockets, and the deny list (a workspace of /etc must not show /etc/shadow).
    for rel in crate::hostdirs::inside_workspace(&ws.host, &ws.hidden, policy.denied_paths()) {
        ops.push(MountOp::Mask {
            dst: ws.inside.join(rel),
            empty: empty.to_path_buf(),
        });
    }
    for rel in &policy.filesystem.protected {
        ops.push(MountOp::ProtectReadOnly {
            dst: ws.inside.join(rel),
        });
    }
    ops
}

/// The rlimits of a sandbox's commands: file size, open files and no core dumps always; memory
/// (address space) and processes when no cgroup holds them.
pub(crate) fn rlimits_for(policy: &Policy, have_cgroup: bool) -> Vec<Rlimit> {
    let limits = &policy.limits;
    let mut rlimits = vec![
        Rlimit {
            resource: RlimitResource::FileSize,
            limit: limits.file_size_bytes,
        },
        Rlimit {
            resource: RlimitResource::OpenFiles,
            limit: limits.open_files,
        },
        Rlimit {
            resource: RlimitResource::CoreSize,
            limit: 0,
        },
    ];
    if !have_cgroup {
        rlimits.push(Rlimit {
            resource: RlimitResource::AddressSpace,
            limit: limits.memory_bytes,
        });
        // RLIMIT_NPROC counts every process of the uid on the host; for root that is the whole
        // system, so it is only a usable fallback for unprivileged callers.
        if !nix::unistd::geteuid().is_root() {
            rlimits.push(Rlimit {
                resource: RlimitResource::Processes,
                limit: limits.pids,
            });
        }
    }
    rlimits
}

/// Runs one command in a fresh native sandbox and returns its observation. A policy with
/// network mode "proxy" needs [`run_with`].
pub fn run(req: &RunRequest) -> Result<RunOutcome, NativeError> {
    run_with(req, None)
}

/// [`run`], with an egress service that starts the run's proxy when the policy's network mode
/// is "proxy" (ignored otherwise). The proxy lives as long as the run; what it decided becomes
/// the result's network violations and `network` activity.
pub fn run_with(
    req: &RunRequest,
    egress_service: Option<&dyn EgressService>,
) -> Result<RunOutcome, NativeError> {
    if req.argv.is_empty() {
        return Err(NativeError::Invalid(
            "no command given (put it after `--`)".into(),
        ));
    }
    let timeout = req.timeout.unwrap_or(req.policy.limits.timeout);
    if timeout.is_zero() {
        return Err(NativeError::Invalid(
            "timeout must be greater than zero".into(),
        ));
    }
    let workspace = fs::canonicalize(&req.workspace).map_err(|e| NativeError::Workspace {
        path: req.workspace.display().to_string(),
        why: e.to_string(),
    })?;
    if !workspace.is_dir() {
        return Err(NativeError::Workspace {
            path: workspace.display().to_string(),
            why: "not a directory".into(),
        });
    }
    if workspace == Path::new("/") {
        return Err(NativeError::Workspace {
            path: "/".into(),
            why: "the host root cannot be a workspace".into(),
        });
    }
    let ws_str = workspace.to_string_lossy();
    if ws_str.contains([',', ':', '\\']) || ws_str.contains('\n') {
        return Err(NativeError::Workspace {
            path: ws_str.into_owned(),
            why: "the path contains ',', ':' or '\\', which overlay mount options cannot carry; \
                  move or symlink the workspace to a plainer path"
                .into(),
        });
    }
    let proxy_mode = req.policy.network.mode == NetworkMode::Proxy;
    let egress_service = match (proxy_mode, egress_service) {
        (false, _) => None,
        (true, Some(service)) => Some(service),
        (true, None) => {
            return Err(NativeError::Invalid(
                "network mode \"proxy\" needs the egress proxy, and this caller did not start one"
                    .into(),
            ));
        }
    };
    let is_root = nix::unistd::geteuid().is_root();
    let view = req
        .image
        .as_ref()
        .map(|image| ImageView::new(image, is_root))
        .transpose()?;
    if req.root_upper.is_some() && view.is_none() {
        return Err(NativeError::Invalid(
            "build mode (root_upper) needs an image to build on".into(),
        ));
    }
    let ws = WorkspacePaths::start(
        workspace.clone(),
        view.as_ref()
            .map_or_else(|| workspace.clone(), |v| v.workdir.clone()),
        &req.state_dir,
        &[],
    )
    .map_err(|why| NativeError::Workspace {
        path: workspace.display().to_string(),
        why,
    })?;

    let id = run_id();
    let runs = req.state_dir.join("runs");
    let spill_dir = req.state_dir.join("spill");
    for d in [&runs, &spill_dir] {
        private_dir(d).map_err(|source| NativeError::State {
            path: d.display().to_string(),
            source,
        })?;
    }
    // The root's mount point and the mask file are shared by the runs of this state
    // directory, side by side or one after the other (see `SharedFiles`).
    let shared = SharedFiles::make(&runs).map_err(|source| NativeError::State {
        path: runs.display().to_string(),
        source,
    })?;
    let mut run_dir = RunDir::shared(runs.join(&id), shared);
    fs::create_dir(&run_dir.dir).map_err(|source| NativeError::State {
        path: run_dir.dir.display().to_string(),
        source,
    })?;
    // The disk quota, which the helper mounts; the workspace's layers and the scratch mounts
    // live on it.
    run_dir.disk = Some(Disk::prepare(
        &run_dir.dir,
        run_dir.disk_mount_point(),
        req.policy.limits.disk_bytes,
        &disk_templates(&req.state_dir),
    )?);

    // The root: the host view, or the image (with the build's upper layer in build mode).
    let mut build_work = None;
    let (root_plan, root_view, identity, env) = match &view {
        None => (
            RootPlan::Host,
            RootView::Host,
            Identity::host_view(is_root),
            sandbox_env(&req.policy, &req.env),
        ),
        Some(v) => {
            let scaffold = run_dir.dir.join("scaffold");
            v.prepare_scaffold(&scaffold)?;
            let build = match &req.root_upper {
                Some(upper) => {
                    let (upper, work) = prepare_build_layer(upper, &id)?;
                    build_work = Some(RunDir::new(work.clone()));
                    Some((upper, work))
                }
                None => None,
            };
            let plan = v.root_plan(
                &scaffold,
                build.as_ref().map(|(u, w)| (u.as_path(), w.as_path())),
            );
            let env = compose_env(&req.policy, Some(&v.base_env()), &req.env);
            let root = RootView::Image {
                view: v,
                build: build.is_some(),
            };
            (plan, root, v.identity, env)
        }
    };
    // Run by root, the command is an id of a namespace of its own (docs/security.md,
    // "Credentials"); an image build step stays root, whose files the layer must own as they
    // will be owned in the image.
    let identity = if is_root && req.root_upper.is_none() {
        identity.in_range()
    } else {
        identity
    };
    let limits = &req.policy.limits;
    let cgroup = Cgroup::create(
        &id,
        CgroupLimits {
            memory_bytes: limits.memory_bytes,
            pids: limits.pids,
            cpu_cores: limits.cpu_cores,
        },
    )?;
    // Until the run owns its clean-up (below), a set-up that fails removes the cgroup: a run
    // refused for a missing secret left it on the host.
    let mut setup_guard = CgroupGuard(cgroup.as_ref());
    let rlimits = rlimits_for(&req.policy, cgroup.is_some());

    let ws = ws.finish();
    let (mounts, write_paths) = plan_mounts(
        &req.policy,
        &ws,
        &run_dir,
        req.write_through,
        root_view,
        identity.ranged_user(),
    );
    let cwd = req.cwd.clone().unwrap_or_else(|| ws.inside.clone());
    let cwd = if cwd.is_absolute() {
        cwd
    } else {
        ws.inside.join(cwd)
    };
    let isolate_network = req.policy.network.mode != NetworkMode::Host;
    let mut egress = egress_service
        .map(|service| {
            // A one-shot run has no create request: its secrets come from the environment or
            // files of the process that runs it.
            let secrets = egress::resolve_secrets(&req.policy, &Default::default())
                .map_err(|e| e.to_string())?;
            let config = egress::EgressConfig {
                network: req.policy.network.clone(),
                secrets,
            };
            EgressWiring::start(service, &format!("run-{id}"), config)
        })
        .transpose()
        .map_err(NativeError::Egress)?;
    let (mut mounts, mut env) = (mounts, env);
    if let Some(trust) = egress.as_ref().and_then(|e| e.proxy.trust()) {
        let dir = run_dir.dir.join("egress");
        egress::write_trust(&dir, &trust).map_err(io_err("cannot write the sandbox's CA"))?;
        mounts.extend(egress_mounts(dir));
        for (k, v) in egress::trust_env(&trust) {
            if !req.env.iter().any(|(ek, _)| *ek == k) {
                set_var(&mut env, &k, &v);
            }
        }
    }
    let config = InitConfig {
        argv: req.argv.clone(),
        cwd: cwd.clone(),
        env,
        user_namespace: identity.user_namespace,
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
        inner_uid: identity.inner_uid,
        inner_gid: identity.inner_gid,
        isolate_network,
        hostname: "taskbox".into(),
        new_root: run_dir.root(),
        root: root_plan,
        mounts,
        landlock: LandlockPlan {
            enabled: true,
            required: req.policy.security.landlock == LandlockMode::Required,
            read: vec![PathBuf::from("/")],
            write: write_paths,
            deny_tcp: isolate_network,
            connect_tcp: egress
                .as_ref()
                .map(|_| egress::PROXY_PORT)
                .into_iter()
                .collect(),
        },
        seccomp: req.policy.security.seccomp,
        // What the command leaves in the host's own directory keeps its mode there.
        refuse_setid_modes: req.write_through,
        rlimits,
        cgroup_procs: cgroup.as_ref().map(Cgroup::join_files).unwrap_or_default(),
        id_range: identity.id_range,
        root_capabilities: identity.root_capabilities(&req.policy),
        control: false,
        egress: egress.as_ref().map(|_| EgressPlan {
            port: egress::PROXY_PORT,
        }),
        disk: run_dir
            .disk
            .as_mut()
            .map(|d| ranged_disk_plan(d.plan(), &identity)),
    };
    let plan = serde_json::to_vec(&config)
        .map_err(|e| NativeError::Invalid(format!("cannot encode the plan: {e}")))?;
    let plan = crate::spawn::plan_memfd(&plan).map_err(io_err("cannot write the plan"))?;

    let window = egress.as_ref().map(|e| e.log.open());
    let disk_channel = DiskChannel::new()?;
    let findings_paths = crate::kit::findings::enabled().then(|| taskbox_findings::Paths {
        roots: vec![
            ws.inside.display().to_string(),
            workspace.display().to_string(),
        ],
        cwd: cwd.display().to_string(),
    });
    setup_guard.0 = None;
    let outcome = supervise(
        req,
        &config,
        plan,
        &spill_dir,
        &id,
        timeout,
        cgroup.as_ref(),
        egress.as_mut(),
        run_dir.disk.as_mut().map(|d| (d, disk_channel)),
        findings_paths.as_ref(),
    );
    if let Some(cg) = &cgroup {
        cg.kill_all(Duration::from_secs(5));
    }
    // Every process of the run is gone, so the proxy sees its clients close and reports the
    // ends; then it stops. What it decided is the run's.
    let network = egress.take().zip(window).map(|(e, window)| {
        let closed = window.close(egress::CLOSE_GRACE);
        e.proxy.shutdown();
        closed
    });
    let outcome = outcome.and_then(|sup| {
        let Supervised {
            mut end,
            stdout,
            stderr,
            findings,
            mut enforcement,
            exec_failed,
        } = sup;
        end.network = network;
        if let Some(cg) = &cgroup {
            if cg.oom_killed() {
                end.oom_killed_at = Some(limits.memory_bytes);
            }
            if let Some(peak) = cg.peak_memory() {
                end.max_rss_bytes = end.max_rss_bytes.max(peak);
            }
        }
        let mut diff = None;
        let mut changes = Vec::new();
        let mut ignored = Vec::new();
        let mut upper = None;
        if !req.write_through && req.policy.filesystem.workspace == WorkspaceMode::Overlay {
            let unnamed;
            (changes, unnamed) = changes::scan_named(&run_dir.upper(), &workspace)?;
            end.unnamed_paths = unnamed.map(|dir| dir.to_string_lossy().into_owned());
            let limit = req.policy.limits.file_size_bytes;
            if crate::kit::layers::reached_file_size(&run_dir.upper(), &changes, limit) {
                end.file_size_limit = Some(limit);
            }
            // What a reviewer sees: the same split as a sandbox's exec changes and diff.
            let review = taskbox_workspace::review::review(
                &run_dir.upper(),
                &workspace,
                changes,
                &taskbox_workspace::review::TrackedFiles::default(),
            )?;
            changes = review.shown;
            ignored = review.ignored;
            upper = Some(run_dir.upper());
            if req.want_diff {
                diff = Some(changes::unified_diff(
                    &run_dir.upper(),
                    &workspace,
                    &changes,
                )?);
            }
        }
        enforcement.limits = cgroup
            .as_ref()
            .map(Cgroup::kind)
            .unwrap_or("rlimit")
            .to_string();
        if let Some(disk) = &run_dir.disk {
            enforcement.disk = disk.kind().as_str().to_string();
            if disk.is_full() {
                end.disk_full_at = Some(disk.size());
            }
        }
        let mut result = end.into_result(stdout, stderr, changes, enforcement);
        result.ignored_changes = ignored.len() as u64;
        if let Some(paths) = &findings_paths {
            crate::kit::findings::add_to_run(
                &mut result,
                findings,
                paths,
                upper.as_deref(),
                &ignored,
            );
        }
        Ok(RunOutcome {
            result,
            diff,
            exec_failed,
        })
    });
    // The detached clean-up forks, which is only safe in a single-threaded process; the egress
    // service's threads make this one multi-threaded.
    let detach = req.detach_cleanup && egress_service.is_none();
    if !(detach && cleanup_detached(&run_dir, cgroup.as_ref())) {
        if let Some(cg) = &cgroup {
            cg.remove();
        }
        drop(run_dir);
    } else {
        // The clean-up process holds its own copy of the disk's descriptor.
        let mut run_dir = run_dir;
        drop(run_dir.disk.take());
        std::mem::forget(run_dir);
    }
    drop(build_work);
    outcome
}

/// Build mode: creates the upper layer `upper` when missing and a fresh work directory beside
/// it (overlayfs needs both on one file system); returns both, canonical.
fn prepare_build_layer(upper: &Path, id: &str) -> Result<(PathBuf, PathBuf), NativeError> {
    let state = |path: &Path| {
        let path = path.display().to_string();
        move |source| NativeError::State { path, source }
    };
    fs::create_dir_all(upper).map_err(state(upper))?;
    let upper = fs::canonicalize(upper).map_err(state(upper))?;
    let (Some(parent), Some(name)) = (upper.parent(), upper.file_name()) else {
        return Err(NativeError::Invalid(format!(
            "root_upper {} cannot be the root directory",
            upper.display()
        )));
    };
    let work = parent.join(format!(".{}.work-{id}", name.to_string_lossy()));
    for p in [&upper, &work] {
        check_option_path("root_upper", p).map_err(NativeError::Invalid)?;
    }
    fs::create_dir(&work).map_err(state(&work))?;
    Ok((upper, work))
}

/// Removes the scratch directory and cgroup of a finished run in a detached grandchild, so the
/// caller returns at once (removing directories on a disk mounted with `discard` waits for each
/// freed block; removing a cgroup waits for the kernel to release it). Returns false when it
/// could not fork; the caller then cleans up itself.
fn cleanup_detached(run_dir: &RunDir, cgroup: Option<&Cgroup>) -> bool {
    use nix::unistd::{ForkResult, fork};
    // SAFETY: the caller is single-threaded (see `RunRequest::detach_cleanup`), so the children
    // may allocate and use the file system after fork.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            let _ = nix::unistd::setsid();
            // SAFETY: as above.
            if let Ok(ForkResult::Child) = unsafe { fork() } {
                if let Some(cg) = cgroup {
                    cg.kill_all(Duration::from_secs(5));
                    cg.remove();
                }
                remove_tree(&run_dir.dir);
            }
            // SAFETY: _exit skips destructors and atexit handlers, which belong to the parent.
            unsafe { libc::_exit(0) }
        }
        Ok(ForkResult::Parent { child }) => {
            let _ = nix::sys::wait::waitpid(child, None);
            true
        }
        Err(_) => false,
    }
}

/// What supervising the helper learned: how the command ended, its output, what was in force,
/// and why it could not be run, if it could not (already said on `stderr`).
struct Supervised {
    end: ExecEnd,
    stdout: Output,
    stderr: Output,
    /// What the streams' readers found (when they read).
    findings: Option<taskbox_findings::Findings>,
    enforcement: Enforcement,
    exec_failed: Option<(i32, String)>,
}

/// Removes a run's cgroup when its set-up ends early, unless emptied (`.0 = None`) once the
/// run has taken over its clean-up.
struct CgroupGuard<'a>(Option<&'a Cgroup>);

impl Drop for CgroupGuard<'_> {
    fn drop(&mut self) {
        if let Some(cg) = self.0 {
            cg.kill_all(Duration::from_secs(5));
            cg.remove();
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn supervise(
    req: &RunRequest,
    config: &InitConfig,
    plan: OwnedFd,
    spill_dir: &Path,
    id: &str,
    timeout: Duration,
    cgroup: Option<&Cgroup>,
    egress: Option<&mut EgressWiring>,
    disk: Option<(&mut Disk, DiskChannel)>,
    findings: Option<&taskbox_findings::Paths>,
) -> Result<Supervised, NativeError> {
    let helper = helper_path()?;
    let (status_read, status_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| NativeError::Spawn(e.into()))?;
    let (stdout_read, stdout_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| NativeError::Spawn(e.into()))?;
    let (stderr_read, stderr_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| NativeError::Spawn(e.into()))?;
    let (disk, disk_channel) = match disk {
        Some((d, c)) => (Some(d), Some(c)),
        None => (None, None),
    };
    let mut fds = vec![(status_write.as_fd(), STATUS_FD), (plan.as_fd(), PLAN_FD)];
    fds.extend(
        egress
            .as_ref()
            .and_then(|e| e.helper_fd())
            .map(|fd| (fd, EGRESS_FD)),
    );
    fds.extend(
        disk_channel
            .as_ref()
            .and_then(DiskChannel::helper_fd)
            .map(|fd| (fd, DISK_FD)),
    );
    let start = Instant::now();
    let mut child = crate::spawn::spawn(
        helper.as_os_str(),
        &[
            std::ffi::OsStr::new(crate::spawn::PLAN_ARG),
            std::ffi::OsStr::new(id),
        ],
        match req.stdin {
            StdinSource::Inherit => crate::spawn::Stream::Inherit,
            StdinSource::Null => crate::spawn::Stream::Null,
        },
        crate::spawn::Stream::To(stdout_write.as_fd()),
        crate::spawn::Stream::To(stderr_write.as_fd()),
        &fds,
    )
    .map_err(NativeError::Spawn)?;
    drop(fds);
    drop((stdout_write, stderr_write));
    drop((status_write, plan));
    // The helper mounts the disk before it starts the sandbox, or fails set-up (reported on
    // the status pipe).
    if let (Some(disk), Some(mut channel)) = (disk, disk_channel) {
        channel.theirs = None;
        if let Err(why) = disk.receive(&channel.ours, Duration::from_secs(30)) {
            kill_tree(child.id() as i32, cgroup);
            let _ = child.wait();
            let mut rest = Vec::new();
            let _ = fs::File::from(status_read).read_to_end(&mut rest);
            for s in parse_status(&rest) {
                if let Status::SetupFailed { stage, message } = s {
                    return Err(NativeError::Setup { stage, message });
                }
            }
            return Err(NativeError::Setup {
                stage: "disk".into(),
                message: why,
            });
        }
    }
    if let Some(egress) = egress {
        // pid 1 sends the listener before it starts the command, or fails set-up (reported on
        // the status pipe below); the command's output cannot be waiting yet.
        if let Err(why) = egress.connect(Duration::from_secs(30)) {
            tracing::debug!(run = %id, %why, "no egress listener");
            let statuses = {
                kill_tree(child.id() as i32, cgroup);
                let _ = child.wait();
                let mut rest = Vec::new();
                let _ = fs::File::from(status_read).read_to_end(&mut rest);
                parse_status(&rest)
            };
            for s in statuses {
                if let Status::SetupFailed { stage, message } = s {
                    return Err(NativeError::Setup { stage, message });
                }
            }
            return Err(NativeError::Egress(why));
        }
    }
    let helper_pid = child.id() as i32;
    let (stdout, stderr) = (stdout_read, stderr_read);

    let limit = req.policy.limits.output_bytes as usize;
    // The spill files outlive the run (and its disk), so they are bounded on their own: half
    // of limits.disk each.
    let spill_cap = req.policy.limits.disk_bytes / 2;
    let mut out =
        Capture::new(limit, spill_dir.join(format!("{id}.stdout"))).with_spill_cap(spill_cap);
    let mut err =
        Capture::new(limit, spill_dir.join(format!("{id}.stderr"))).with_spill_cap(spill_cap);
    if let Some(paths) = findings {
        out = out.with_findings(paths.clone());
        err = err.with_findings(paths.clone());
    }
    let mut status_buf = Vec::new();
    let mut open = [true, true, true];
    let deadline = start + timeout;
    let mut timed_out = false;
    let mut buf = vec![0u8; 64 * 1024];
    let mut echo_out = io::stdout();
    let mut echo_err = io::stderr();

    let mut exited_seen = false;
    while open.iter().any(|o| *o) {
        // Done once the output has ended and pid 1 has reported the command's status: the
        // status pipe stays open until the namespaces are torn down, which need not be waited
        // for (the helper is killed below; the kernel finishes the teardown on its own).
        if !open[0] && !open[1] && exited_seen {
            break;
        }
        let now = Instant::now();
        if !timed_out && now >= deadline {
            timed_out = true;
            kill_tree(helper_pid, cgroup);
        }
        let wait_ms = if timed_out {
            // After the kill only the pipes' ends remain to be read; a descendant that escaped
            // the pid namespace cannot exist, so this is short.
            1000
        } else {
            deadline
                .saturating_duration_since(now)
                .as_millis()
                .clamp(1, 60_000) as i32
        };
        let fds = [&stdout, &stderr, &status_read];
        let mut pollfds: Vec<PollFd> = Vec::new();
        let mut which = Vec::new();
        for (i, fd) in fds.iter().enumerate() {
            if open[i] {
                pollfds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                which.push(i);
            }
        }
        let n = match poll(
            &mut pollfds,
            PollTimeout::try_from(wait_ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(n) => n,
            Err(nix::Error::EINTR) => continue,
            Err(e) => {
                kill_tree(helper_pid, cgroup);
                return Err(NativeError::Io {
                    what: "poll".into(),
                    source: e.into(),
                });
            }
        };
        if n == 0 {
            if timed_out {
                // Nothing more arrives: stop reading what is left open.
                break;
            }
            continue;
        }
        let ready: Vec<(usize, bool)> = pollfds
            .iter()
            .zip(&which)
            .map(|(p, &i)| (i, p.revents().is_some_and(|r| !r.is_empty())))
            .collect();
        for (i, is_ready) in ready {
            if !is_ready {
                continue;
            }
            let fd = fds[i];
            let got = match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => {
                    open[i] = false;
                    continue;
                }
                Ok(n) => n,
                Err(nix::Error::EINTR) | Err(nix::Error::EAGAIN) => continue,
                Err(_) => {
                    open[i] = false;
                    continue;
                }
            };
            let data = &buf[..got];
            match i {
                0 => {
                    out.push(data);
                    if req.echo {
                        let _ = echo_out.write_all(data);
                        let _ = echo_out.flush();
                    }
                }
                1 => {
                    err.push(data);
                    if req.echo {
                        let _ = echo_err.write_all(data);
                    }
                }
                _ => {
                    status_buf.extend_from_slice(data);
                    exited_seen = parse_status(&status_buf)
                        .iter()
                        .any(|s| matches!(s, Status::Exited { .. }));
                }
            }
        }
    }
    // Make sure nothing survives (the helper is not reaped yet, so its pid cannot have been
    // reused), then collect it.
    kill_tree(helper_pid, cgroup);
    let _ = child.wait();
    let (rusage_cpu_ms, rusage_rss) = child.usage().unwrap_or((0, 0));
    let duration_ms = start.elapsed().as_millis() as u64;

    let mut rest = Vec::new();
    let mut status_file = fs::File::from(status_read);
    let _ = status_file.read_to_end(&mut rest);
    status_buf.extend_from_slice(&rest);
    let statuses = parse_status(&status_buf);

    let mut exit_code = None;
    let mut signal = None;
    let mut landlock = "none".to_string();
    let mut seccomp = false;
    let mut exec_failed = None;
    let mut command_usage = None;
    let mut file_size_exceeded = false;
    let mut setid_refused = None;
    for s in statuses {
        match s {
            Status::Exited {
                code,
                signal: sig,
                cpu_ms,
                max_rss_bytes,
                file_size_exceeded: fsize,
                setid_refused: refused,
                setid_calls: calls,
            } => {
                exit_code = code;
                signal = sig;
                command_usage = Some((cpu_ms, max_rss_bytes));
                file_size_exceeded = fsize;
                setid_refused = (refused > 0).then_some((refused, calls));
            }
            Status::Landlock { status } => landlock = status,
            Status::Seccomp { installed } => seccomp = installed,
            Status::ExecFailed { errno, program } => exec_failed = Some((errno, program)),
            Status::SetupFailed { stage, message } if !timed_out => {
                return Err(NativeError::Setup { stage, message });
            }
            _ => {}
        }
    }
    if !timed_out && exit_code.is_none() && signal.is_none() {
        return Err(NativeError::Setup {
            stage: "supervision".into(),
            message: "the sandbox ended without reporting the command's status".into(),
        });
    }
    // Said on stderr as it streams, so a terminal shows it where the command's output is.
    if let Some((errno, program)) = &exec_failed {
        err.push((crate::result::exec_failure_line(*errno, program) + "\n").as_bytes());
    }
    let limits = &req.policy.limits;
    let end = ExecEnd {
        exit_code,
        signal,
        timed_out: timed_out.then_some(timeout),
        cpu_ms: command_usage.map_or(rusage_cpu_ms, |u| u.0),
        max_rss_bytes: command_usage.map_or(rusage_rss, |u| u.1),
        file_size_limit: file_size_exceeded.then_some(limits.file_size_bytes),
        setid_refused,
        // Output past the spill files' share of the quota was not kept.
        disk_full_at: (out.spill_capped() || err.spill_capped()).then_some(limits.disk_bytes),
        duration_ms,
        ..ExecEnd::default()
    };
    let enforcement = Enforcement {
        landlock,
        seccomp,
        network: match (config.egress.is_some(), config.isolate_network) {
            (true, _) => "proxy",
            (false, true) => "none",
            (false, false) => "host",
        }
        .into(),
        limits: String::new(),
        disk: String::new(),
    };
    let (stdout, out_found) = out.finish_with_findings();
    let (stderr, err_found) = err.finish_with_findings();
    Ok(Supervised {
        end,
        stdout,
        stderr,
        findings: crate::kit::findings::both(out_found, err_found),
        enforcement,
        exec_failed,
    })
}

fn parse_status(buf: &[u8]) -> Vec<Status> {
    buf.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect()
}

/// Kills the sandbox: the helper, whose death kills the sandbox's pid 1 (parent-death signal),
/// whose death in turn takes every process of the pid namespace with it; and whatever the cgroup
/// still holds. Only called before the helper is reaped, so its pid is still ours.
fn kill_tree(helper: i32, cgroup: Option<&Cgroup>) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let _ = kill(Pid::from_raw(helper), Signal::SIGKILL);
    if let Some(cg) = cgroup {
        cg.kill_all(Duration::from_millis(0));
    }
}

/// The socket pair on which the helper sends a descriptor of the disk it mounted
/// (`taskbox_protocol::config::DISK_FD`).
pub(crate) struct DiskChannel {
    pub(crate) ours: OwnedFd,
    /// The helper's end, installed as `DISK_FD`; dropped once the helper has it.
    pub(crate) theirs: Option<OwnedFd>,
}

impl DiskChannel {
    pub(crate) fn new() -> Result<DiskChannel, NativeError> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| NativeError::Spawn(e.into()))?;
        Ok(DiskChannel {
            ours,
            theirs: Some(theirs),
        })
    }

    pub(crate) fn helper_fd(&self) -> Option<BorrowedFd<'_>> {
        self.theirs.as_ref().map(AsFd::as_fd)
    }
}

/// Where the ext4 templates of disks are kept (see [`crate::disk`]).
pub(crate) fn disk_templates(state_dir: &Path) -> PathBuf {
    state_dir.join("disk-templates")
}

/// The mounts that show a sandbox its CA bundle: `dir` (holding
/// [`egress::CA_BUNDLE_FILE`]) read-only at [`egress::EGRESS_MOUNT`], under the private `/tmp`.
pub(crate) fn egress_mounts(dir: PathBuf) -> [MountOp; 2] {
    [
        MountOp::Dir {
            dst: egress::EGRESS_MOUNT.into(),
            mode: 0o755,
        },
        MountOp::Bind {
            src: dir,
            dst: egress::EGRESS_MOUNT.into(),
            readonly: true,
        },
    ]
}

/// A sandbox's egress proxy and the channel on which its pid 1 hands over the listener
/// (`taskbox_protocol::config::EgressPlan`): started before the helper, connected once the helper
/// has sent the listener.
pub(crate) struct EgressWiring {
    pub(crate) proxy: Box<dyn EgressProxy>,
    pub(crate) log: std::sync::Arc<EgressLog>,
    ours: OwnedFd,
    /// The helper's end, installed as `EGRESS_FD`; dropped once the helper has it.
    theirs: Option<OwnedFd>,
}

impl EgressWiring {
    /// Starts the proxy for sandbox `tag` with `config`'s rules and secrets.
    pub(crate) fn start(
        service: &dyn EgressService,
        tag: &str,
        config: egress::EgressConfig,
    ) -> Result<EgressWiring, String> {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| format!("socketpair: {e}"))?;
        let log = EgressLog::new();
        let proxy = service
            .start(tag, config, log.sink())
            .map_err(|e| e.to_string())?;
        Ok(EgressWiring {
            proxy,
            log,
            ours,
            theirs: Some(theirs),
        })
    }

    /// The descriptor to install as `EGRESS_FD` in the helper.
    pub(crate) fn helper_fd(&self) -> Option<BorrowedFd<'_>> {
        self.theirs.as_ref().map(AsFd::as_fd)
    }

    /// Receives the listener pid 1 made (waiting up to `timeout`) and lets the proxy serve it.
    /// Call after the helper is spawned.
    pub(crate) fn connect(&mut self, timeout: Duration) -> Result<(), String> {
        use taskbox_protocol::control::{Received, recv_within};
        self.theirs = None;
        let mut buf = Vec::new();
        let mut fds = match recv_within::<taskbox_protocol::config::EgressPlan>(
            self.ours.as_fd(),
            &mut buf,
            timeout,
        )
        .map_err(|e| format!("cannot receive the listener: {e}"))?
        {
            Received::Message(_, fds) => fds,
            Received::Nothing => {
                return Err(format!("no listener from the sandbox within {timeout:?}"));
            }
            Received::Closed => return Err("the sandbox ended before it made the listener".into()),
        };
        let Some(fd) = fds.pop() else {
            return Err("the sandbox sent no listener".into());
        };
        self.proxy
            .serve_listener(std::net::TcpListener::from(fd))
            .map_err(|e| e.to_string())
    }
}

/// Removes spill files older than `age` (one-shot runs keep them so the agent can read them).
pub fn prune_spill(state_dir: &Path, age: Duration) {
    let Ok(rd) = fs::read_dir(state_dir.join("spill")) else {
        return;
    };
    for e in rd.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|el| el > age);
        if old {
            let _ = fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::ImageConfig;

    /// The host paths an op reads from (mount sources, layers, the mask file).
    fn host_sources(op: &MountOp) -> Vec<&Path> {
        match op {
            MountOp::Bind { src, .. } => vec![src.as_path()],
            MountOp::Overlay {
                lower, upper, work, ..
            } => vec![lower.as_path(), upper.as_path(), work.as_path()],
            MountOp::Mask { empty, .. } => vec![empty.as_path()],
            _ => Vec::new(),
        }
    }

    #[test]
    fn an_image_plan_brings_no_host_path_but_devices_workspace_and_run_dirs() {
        let scratch = tempfile::tempdir().unwrap();
        let rootfs = scratch.path().join("rootfs");
        fs::create_dir_all(rootfs.join("var/tmp")).unwrap();
        let ws = scratch.path().join("ws");
        fs::create_dir_all(ws.join(".git/hooks")).unwrap();
        fs::write(ws.join(".netrc"), "machine x password y\n").unwrap();
        let run = RunDir::new(scratch.path().join("run"));
        let image = ImageRoot {
            digest: format!("sha256:{}", "c".repeat(64)),
            config_digest: format!("sha256:{}", "d".repeat(64)),
            rootfs,
            config: ImageConfig::default(),
        };
        let view = ImageView::new(&image, false).unwrap();
        let paths = WorkspacePaths {
            host: ws.clone(),
            inside: view.workdir.clone(),
            hidden: Vec::new(),
        };
        let policy = Policy::default();
        let (ops, writable) = plan_mounts(
            &policy,
            &paths,
            &run,
            false,
            RootView::Image {
                view: &view,
                build: false,
            },
            None,
        );
        for op in &ops {
            for src in host_sources(op) {
                assert!(
                    src.starts_with("/dev/") || src == ws || src.starts_with(&run.dir),
                    "{op:?} brings in the host path {}",
                    src.display()
                );
            }
        }
        assert_eq!(
            writable,
            ["/tmp", "/dev", "/var/tmp", "/workspace"].map(PathBuf::from)
        );
        // Guards sit at the workspace's inside path; the credential store found on the host
        // is masked there.
        assert!(ops.contains(&MountOp::ProtectReadOnly {
            dst: "/workspace/.git/hooks".into()
        }));
        assert!(ops.contains(&MountOp::Mask {
            dst: "/workspace/.netrc".into(),
            empty: run.empty_file()
        }));
        // Build mode: the whole root is writable.
        let (_, writable) = plan_mounts(
            &policy,
            &paths,
            &run,
            false,
            RootView::Image {
                view: &view,
                build: true,
            },
            None,
        );
        assert!(writable.contains(&PathBuf::from("/")));
    }

    #[test]
    fn image_variables_replace_host_paths_but_not_the_policys() {
        let mut policy = Policy::default();
        policy.env.pass = vec!["HOME".into(), "PATH".into(), "LANG".into(), "TB_*".into()];
        policy.env.set.insert("FROM_POLICY".into(), "policy".into());
        let image = vec![
            ("PATH".to_string(), "/image/bin".to_string()),
            ("FROM_POLICY".to_string(), "image".to_string()),
            ("HOME".to_string(), "/home/img".to_string()),
        ];
        // The host's PATH, HOME and LANG of the test process.
        let env = compose_env(&policy, Some(&image), &[("X".into(), "1".into())]);
        let get = |k: &str| env.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PATH"), Some("/image/bin"));
        assert_eq!(get("HOME"), Some("/home/img"));
        assert_eq!(get("FROM_POLICY"), Some("policy"));
        assert_eq!(get("X"), Some("1"));
        assert_eq!(get("LANG"), Some("C.UTF-8"), "fixed, not the host's");
        assert_eq!(get("TZ"), Some("UTC"));
        // Without an image nothing changes.
        let host = compose_env(&policy, None, &[]);
        assert_eq!(
            host.iter()
                .find(|(k, _)| k == "PATH")
                .map(|(_, v)| v.clone()),
            std::env::var("PATH").ok()
        );
    }
}
