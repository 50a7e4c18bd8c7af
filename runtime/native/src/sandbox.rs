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

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use taskbox_protocol::config::{
    DISK_FD, DiskPlan, EGRESS_FD, EgressPlan, InitConfig, LandlockPlan, MountOp, PLAN_FD, RootPlan,
    STATUS_FD, Status,
};
use taskbox_protocol::control::{self, CONTROL_FD, Event, ExecIds, Request};

use crate::api::*;
use crate::cgroup::{Cgroup, CgroupLimits, OomCounter};
use crate::egress::{
    CLOSE_GRACE, EgressConfig, EgressService, ExecWindow, PROXY_PORT, SandboxEgress,
    resolve_secrets, trust_env, write_trust,
};
use crate::exec_limits;
use crate::fsops::WorkspaceFs;
use crate::image::ImageResolver;
use crate::image_view::{Identity, ImageView, ImageViewError};
use crate::kit::disk::Disk;
use crate::kit::layers::overlay_workspace;
use crate::kit::layers::{ExecChanges, ExecStart};
use crate::kit::{
    self, Backend, Common, ExecBase, ExecEnd, ExecPlan, ExecSlot, FsLandlock, Handle, Layers, Open,
    Options, ProcState, SPILL_MOUNT, Sandboxes, Seed, StagedLayers, Table, lock, now_ms,
};
use crate::native::{self, RunDir};
use crate::policy::{LandlockMode, NetworkMode, RootMode, WorkspaceMode};
use crate::result::{Enforcement, ExecResult};
use crate::spawn;

/// pid 1's private mount of the sandbox's state directory and the host workspace.
const PRIVATE: &str = "/run/.taskbox";

/// The native backend: long-lived sandboxes on this host (see [`Native`]).
pub type NativeBackend = Sandboxes<Native>;

/// How the native backend starts and ends sandboxes: each is the `taskbox-init` helper in
/// control mode.
pub struct Native {
    state_dir: PathBuf,
    /// The root's mount point and the mask file every sandbox shares.
    shared: native::SharedFiles,
    table: Table<Sandbox>,
    /// The image store, which resolves `CreateRequest.image`; without it only the host view.
    images: Option<Arc<dyn ImageResolver>>,
    /// Starts the egress proxies of sandboxes whose policy has network mode "proxy"; without it
    /// such sandboxes are refused.
    egress: Option<Arc<dyn EgressService>>,
    /// More host paths to hide in every sandbox besides taskbox's state directories (the
    /// supervisor's socket and tokens file).
    hidden: Vec<PathBuf>,
    /// The enforcement a create's probe found, by origin ([`kit::origin_key`]): a later create
    /// of the same origin (the same policy on this host) takes it instead of probing again.
    proven: Mutex<HashMap<String, Enforcement>>,
    /// The helpers' zygote ([`spawn::Zygote`]), started by the first create.
    zygote: Mutex<ZygoteSlot>,
    /// An exclusive lock on `STATE/sandboxes/.lock`: one backend per state directory, so the
    /// start-up sweep never removes what a live backend owns.
    _lock: fs::File,
}

/// The backend's zygote: none until the first create, after it broke (the next create starts
/// another), or when `TASKBOX_ZYGOTE=off`.
#[derive(Debug, Default)]
struct ZygoteSlot {
    /// `TASKBOX_ZYGOTE=off` when the backend was opened: every helper is spawned.
    off: bool,
    running: Option<spawn::Zygote>,
    /// A helper binary that could not start as a zygote: its helpers are spawned, and it is not
    /// tried again.
    refused: Option<PathBuf>,
}

impl std::fmt::Debug for Native {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeBackend")
            .field("state_dir", &self.state_dir)
            .finish()
    }
}

impl Open for Native {
    type Config = PathBuf;

    /// A backend keeping its state in `state_dir`. Whatever an earlier process left there (the
    /// directories and cgroups of sandboxes that died with it) is removed.
    fn open(state_dir: PathBuf) -> Result<Native, ApiError> {
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
        let shared = native::SharedFiles::make(&sandboxes).map_err(|e| {
            ApiError::internal(format!(
                "cannot make the shared mount point and mask file in {}: {e}",
                sandboxes.display()
            ))
        })?;
        let backend = Native {
            shared,
            state_dir,
            table: Table::default(),
            images: None,
            egress: None,
            hidden: Vec::new(),
            proven: Mutex::default(),
            zygote: Mutex::new(ZygoteSlot {
                off: std::env::var_os("TASKBOX_ZYGOTE").is_some_and(|v| v == "off"),
                ..ZygoteSlot::default()
            }),
            _lock: lock,
        };
        backend.sweep();
        Ok(backend)
    }
}

impl Options for Native {
    fn set_images(&mut self, images: Arc<dyn ImageResolver>) {
        self.images = Some(images);
    }

    fn set_egress(&mut self, egress: Arc<dyn EgressService>) {
        self.egress = Some(egress);
    }

    fn set_hidden_paths(&mut self, paths: Vec<PathBuf>) {
        self.hidden = paths;
    }
}

impl Native {
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
}

/// What the native backend keeps of an exec's process: the starter it was sent to (which
/// signals it), and what its reaper reported of its end.
#[derive(Default)]
pub struct NativeProc {
    starter: Option<Arc<StarterLink>>,
    exited: Option<Exited>,
}

/// The runtime's end of one of the sandbox's exec starters (see the helper's server module):
/// execs of its user, and their signals, go here, not through pid 1. The starter exits when the
/// last holder drops this.
#[derive(Debug)]
struct StarterLink {
    /// Whose commands it starts (`None`: the sandbox's own user).
    user: Option<ExecIds>,
    sock: OwnedFd,
    /// The sockets of the reapers it forked ahead ([`Event::Reaper`]), and the receive buffer.
    reapers: Mutex<(Vec<OwnedFd>, Vec<u8>)>,
    /// The sockets of reapers that ran an exec and wait for the next ([`StarterLink::give_back`]):
    /// tried first, newest first.
    idle: Mutex<Vec<OwnedFd>>,
}

/// The most reapers of one starter kept waiting for an exec: enough for a few execs side by
/// side; more are let go (their socket closed, they exit).
const IDLE_REAPERS: usize = 4;

impl StarterLink {
    fn new(user: Option<ExecIds>, sock: OwnedFd) -> StarterLink {
        StarterLink {
            user,
            sock,
            reapers: Mutex::new((Vec::new(), Vec::new())),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Keeps the socket of a reaper whose exec ended and that said it waits for another.
    fn give_back(&self, reaper: OwnedFd) {
        let mut idle = lock(&self.idle);
        if idle.len() < IDLE_REAPERS {
            idle.push(reaper);
        }
    }

    fn send(&self, req: &Request, fds: &[i32]) -> Result<(), control::SendError> {
        control::send(self.sock.as_fd(), req, fds)
    }

    /// Sends an exec with its descriptors: to a reaper that waits for its next exec, or one the
    /// starter forked ahead, when there is one (the starter is then not on the exec's way),
    /// else to the starter, which forks one. Returns the socket of the reaper that took it.
    fn send_exec(&self, req: &Request, fds: &[i32]) -> Result<Option<OwnedFd>, control::SendError> {
        loop {
            let idle = lock(&self.idle).pop();
            let Some(reaper) = idle.or_else(|| self.take_reaper()) else {
                break;
            };
            match control::send(reaper.as_fd(), req, fds) {
                Ok(()) => return Ok(Some(reaper)),
                // That reaper is gone (it died, or its starter did): the next, or the starter.
                Err(control::SendError::Channel(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        self.send(req, fds).map(|()| None)
    }

    /// A reaper the starter announced, if any.
    fn take_reaper(&self) -> Option<OwnedFd> {
        let mut guard = lock(&self.reapers);
        let (ready, buf) = &mut *guard;
        while let Ok(control::Received::Message(event, fds)) =
            control::try_recv::<Event>(self.sock.as_fd(), buf)
        {
            if event == Event::Reaper {
                ready.extend(fds);
            }
        }
        // Oldest first: one that is gone is tried (and dropped) before a newer one.
        (!ready.is_empty()).then(|| ready.remove(0))
    }
}

/// What pid 1 sent that a caller waits for: its answer to the last remount or merge, and
/// starters.
#[derive(Default)]
struct Mail {
    /// The answer to the last remount request (`Some(error)` when it failed), until taken.
    remounted: Option<Option<String>>,
    /// The answer to the last merge request, likewise.
    merged: Option<Option<String>>,
    /// Starters sent and not yet taken, with their user (or why pid 1 could not start one).
    starters: Vec<(Option<ExecIds>, Result<OwnedFd, String>)>,
}

impl ProcState for NativeProc {
    fn exited(&self) -> bool {
        self.exited.is_some()
    }
}

/// What an exec's reaper reported about its end: the end itself, what was in force,
/// and why the command could not start, if it could not.
#[derive(Debug, Clone)]
struct Exited {
    end: ExecEnd,
    landlock: String,
    seccomp: bool,
    setup_error: Option<String>,
    /// Its reaper waits for another exec on the same socket.
    reusable: bool,
}

type Slot = ExecSlot<NativeProc>;

/// One live sandbox.
pub struct Sandbox {
    common: Common<NativeProc>,
    dirs: RunDir,
    /// The workspace on the host (the overlay's lower layer) and inside the sandbox.
    ws: native::WorkspacePaths,
    helper: Mutex<Option<spawn::Spawned>>,
    /// The helper's standard error (its and pid 1's panics), for the cause of a loss.
    helper_log: spawn::HelperLog,
    init_pid: i32,
    /// The id of the workspace's mount inside the sandbox (it changes on restore).
    ws_mount: Mutex<u64>,
    control: OwnedFd,
    send_lock: Mutex<()>,
    /// The starters in use, one per user the execs run as (the sandbox's own from the start).
    starters: Mutex<Vec<Arc<StarterLink>>>,
    _status: OwnedFd,
    cgroup: Option<Cgroup>,
    /// The cgroup's OOM-kill counter, kept open: read before and after every exec.
    oom: Option<OomCounter>,
    lost: AtomicBool,
    /// Set when it is being destroyed: the end of its pid 1 is then expected.
    ending: AtomicBool,
    /// The OOM kills of its cgroup and of the host when it started (see `death_cause`).
    oom_at_start: u64,
    host_oom_at_start: u64,
    /// What pid 1 sent that a caller waits for.
    mail: Mutex<Mail>,
    mail_cond: Condvar,
    /// Who the commands are (the ids an exec as another user may take).
    identity: Identity,
}

impl Sandbox {
    fn id(&self) -> &SandboxId {
        &self.common.id
    }

    fn send(&self, req: &Request, fds: &[i32]) -> Result<(), ApiError> {
        let _g = lock(&self.send_lock);
        match control::send(self.control.as_fd(), req, fds) {
            Ok(()) => Ok(()),
            // Nothing was sent: the sandbox is as it was, and the request may be tried again.
            Err(e @ control::SendError::Prepare { .. }) => {
                Err(ApiError::Unavailable(format!("sandbox {}: {e}", self.id())))
            }
            Err(e) => {
                let channel =
                    format!("its control channel to pid 1 failed ({e}); its processes are ended");
                self.mark_lost(&self.death_cause(&channel));
                Err(self.lost_error())
            }
        }
    }

    fn lost_error(&self) -> ApiError {
        self.common.lost_error()
    }

    /// Why the sandbox ended, from its helper's exit status (the helper exits with pid 1's
    /// status, 128+N for signal N), waited for a moment (the helper ends right after pid 1);
    /// `otherwise` when the helper still runs.
    fn death_cause(&self, otherwise: &str) -> String {
        let deadline = Instant::now() + Duration::from_millis(500);
        let status = loop {
            // The lock is held for one look at a time: a destroy takes the helper meanwhile.
            let looked = match lock(&self.helper).as_mut() {
                Some(child) => child.try_wait().map_err(drop),
                None => Err(()),
            };
            match looked {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline && !self.ending.load(Ordering::SeqCst) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break None,
            }
        };
        let how = match status {
            Some(st) => {
                use std::os::unix::process::ExitStatusExt;
                match (st.code(), st.signal()) {
                    (Some(code), _) if code > 128 => {
                        format!("its init (pid 1) was killed by {}", signal_name(code - 128))
                    }
                    (Some(code), _) => format!("its init (pid 1) exited with status {code}"),
                    (None, Some(sig)) => {
                        format!("its helper process was killed by {}", signal_name(sig))
                    }
                    (None, None) => "its init (pid 1) ended".to_owned(),
                }
            }
            None => otherwise.to_owned(),
        };
        let how = match self.helper_log.last_words() {
            Some(words) => format!("{how} (it wrote: {words})"),
            None => how,
        };
        match self.oom_since_start() {
            Some(what) => format!("{how}; {what}"),
            None => how,
        }
    }

    /// Whether an OOM killer ran since the sandbox started: its cgroup's (its memory limit) or
    /// the host's (`/proc/vmstat`).
    fn oom_since_start(&self) -> Option<String> {
        if self.oom_kills() > self.oom_at_start {
            return Some(format!(
                "its cgroup's OOM killer ran (the sandbox's memory limit of {} bytes)",
                self.common.policy.limits.memory_bytes
            ));
        }
        if host_oom_kills() > self.host_oom_at_start {
            return Some("the host ran out of memory (the kernel's OOM killer ran)".to_owned());
        }
        None
    }

    /// The sandbox can no longer be driven: say so everywhere (its state, its running execs,
    /// every later call) and end its processes, so nothing lives on that no one can reach.
    /// Destroy removes the rest.
    fn mark_lost(&self, why: &str) {
        // The cause first: whoever sees the flag finds it (the first cause given stays).
        self.common.mark_lost(why);
        if self.lost.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(sandbox = %self.id(), reason = why, "sandbox lost");
        self.common
            .slots
            .end_all(&format!("the sandbox is lost ({why})"));
        // pid 1 exits at the end of its control stream, and the kernel kills every process of
        // its pid namespace with it.
        let _ =
            nix::sys::socket::shutdown(self.control.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    fn enforcement(&self, landlock: &str, seccomp: bool) -> Enforcement {
        Enforcement {
            landlock: landlock.to_string(),
            seccomp,
            network: self.common.policy.network.mode.as_str().into(),
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
            // The end of a sandbox being destroyed is no loss.
            if msg.as_ref().map_or(true, Option::is_none) && sb.ending.load(Ordering::SeqCst) {
                return;
            }
            match msg {
                Ok(Some((event, fds))) => sb.on_event(event, fds),
                Ok(None) => return sb.mark_lost(&sb.death_cause("its init (pid 1) ended")),
                Err(e) => {
                    let channel = format!("its control channel to pid 1 failed ({e})");
                    return sb.mark_lost(&sb.death_cause(&channel));
                }
            }
        }
    }

    fn on_event(&self, event: Event, fds: Vec<OwnedFd>) {
        match event {
            Event::Starter { user, error } => {
                let link = match (error, fds.into_iter().next()) {
                    (None, Some(fd)) => Ok(fd),
                    (Some(why), _) => Err(why),
                    (None, None) => Err("pid 1 sent a starter without its socket".into()),
                };
                lock(&self.mail).starters.push((user, link));
                self.mail_cond.notify_all();
            }
            Event::Remounted { error } => {
                lock(&self.mail).remounted = Some(error);
                self.mail_cond.notify_all();
            }
            Event::Merged { error } => {
                lock(&self.mail).merged = Some(error);
                self.mail_cond.notify_all();
            }
            Event::Ready | Event::Reaper => {}
            Event::Error { message } => {
                tracing::warn!(sandbox = %self.id(), %message, "sandbox reported an error");
            }
            // An exec's end comes on its own pipe.
            Event::Exited { .. } => {}
        }
    }

    /// Waits (until `deadline`) for `pick` to take something from the mail; None on time out or
    /// once the sandbox is lost.
    fn wait_mail<T>(
        &self,
        deadline: Instant,
        mut pick: impl FnMut(&mut Mail) -> Option<T>,
    ) -> Option<T> {
        let mut mail = lock(&self.mail);
        loop {
            if let Some(got) = pick(&mut mail) {
                return Some(got);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.lost.load(Ordering::SeqCst) {
                return None;
            }
            mail = match self
                .mail_cond
                .wait_timeout(mail, left.min(Duration::from_millis(200)))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// The starter of `user`'s execs: the one in use, one pid 1 already sent, or one asked for.
    fn starter_for(&self, user: Option<&ExecIds>) -> Result<Arc<StarterLink>, ApiError> {
        let mut links = lock(&self.starters);
        if let Some(link) = links.iter().find(|l| l.user.as_ref() == user) {
            return Ok(link.clone());
        }
        let take = |mail: &mut Mail| {
            let at = mail.starters.iter().position(|(u, _)| u.as_ref() == user)?;
            Some(mail.starters.remove(at).1)
        };
        let sent = match self.wait_mail(Instant::now(), take) {
            Some(sent) => sent,
            None => {
                self.send(
                    &Request::Starter {
                        user: user.cloned(),
                    },
                    &[],
                )?;
                self.wait_mail(Instant::now() + Duration::from_secs(10), take)
                    .ok_or_else(|| {
                        if self.lost.load(Ordering::SeqCst) {
                            self.lost_error()
                        } else {
                            ApiError::internal(format!(
                                "sandbox {}: pid 1 did not start an exec starter within 10s",
                                self.id()
                            ))
                        }
                    })?
            }
        };
        let sock =
            sent.map_err(|why| ApiError::internal(format!("sandbox {}: {why}", self.id())))?;
        let link = Arc::new(StarterLink::new(user.cloned(), sock));
        links.push(link.clone());
        Ok(link)
    }

    /// Stops using `link` (its starter is gone): the next exec of its user gets a new one.
    fn forget_starter(&self, link: &Arc<StarterLink>) {
        lock(&self.starters).retain(|l| !Arc::ptr_eq(l, link));
    }

    /// The OOM kills of the sandbox's cgroup so far (0 without one).
    fn oom_kills(&self) -> u64 {
        match (&self.oom, &self.cgroup) {
            (Some(counter), _) => counter.kills(),
            (None, Some(cg)) => cg.oom_kills(),
            (None, None) => 0,
        }
    }
}

/// How a sandbox's disk is bounded (`enforcement.disk`).
fn disk_kind(dirs: &RunDir) -> &'static str {
    dirs.disk.as_ref().map_or("none", |d| d.kind().as_str())
}

/// The OOM kills of the host so far (`oom_kill` of `/proc/vmstat`; 0 when unknown).
fn host_oom_kills() -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("oom_kill ").map(|n| n.trim().parse().ok()))
        })
        .flatten()
        .unwrap_or(0)
}

/// A signal's name and number, as `SIGKILL (signal 9)`.
fn signal_name(sig: i32) -> String {
    match nix::sys::signal::Signal::try_from(sig) {
        Ok(s) => format!("{} (signal {sig})", s.as_str()),
        Err(_) => format!("signal {sig}"),
    }
}

/// The root of the sandbox whose pid 1 is `pid`, as this process reaches it.
fn proc_root(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root"))
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

impl Native {
    /// Starts a sandbox's helper (`HELPER - label`, stdin and stdout on `/dev/null`, stderr on
    /// `log`, each of `fds` on its number): forked by the backend's zygote, which the first
    /// create starts and a create that finds it gone starts again, or spawned when there is
    /// none (`TASKBOX_ZYGOTE=off`, or it cannot start). A zygote that took the request and
    /// gave no answer fails the create (see [`spawn::ZygoteError::Lost`]).
    fn spawn_helper(
        &self,
        helper: &Path,
        label: &str,
        log: std::os::fd::BorrowedFd<'_>,
        fds: &[(std::os::fd::BorrowedFd<'_>, i32)],
    ) -> std::io::Result<spawn::Spawned> {
        let mut slot = lock(&self.zygote);
        if !slot.off {
            if slot.running.as_ref().is_some_and(|z| !z.runs(helper)) {
                slot.running = None;
            }
            // A zygote found gone is replaced once, within this create.
            for _ in 0..2 {
                if slot.running.is_none() && slot.refused.as_deref() != Some(helper) {
                    match spawn::Zygote::start(helper, &self.state_dir) {
                        Ok(z) => slot.running = Some(z),
                        Err(e) => {
                            tracing::warn!(
                                "{} cannot be the helpers' zygote ({e}); each helper is spawned",
                                helper.display()
                            );
                            slot.refused = Some(helper.to_path_buf());
                        }
                    }
                }
                let Some(z) = slot.running.as_mut() else {
                    break;
                };
                match z.spawn(label, log, fds) {
                    Ok(child) => return Ok(child),
                    Err(spawn::ZygoteError::Refused(why)) => {
                        return Err(std::io::Error::other(why));
                    }
                    Err(spawn::ZygoteError::Gone(why)) => {
                        tracing::warn!("{why}; starting another");
                        slot.running = None;
                    }
                    Err(spawn::ZygoteError::Lost(why)) => {
                        slot.running = None;
                        return Err(std::io::Error::other(format!(
                            "{why}; the next create starts another"
                        )));
                    }
                }
            }
        }
        drop(slot);
        spawn::spawn(
            helper.as_os_str(),
            &[
                std::ffi::OsStr::new(spawn::PLAN_ARG),
                std::ffi::OsStr::new(label),
            ],
            spawn::Stream::Null,
            spawn::Stream::Null,
            spawn::Stream::To(log),
            fds,
        )
    }

    fn launch(&self, req: &CreateRequest, seed: Option<&Seed>) -> Result<Arc<Sandbox>, ApiError> {
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

        let ws = native::WorkspacePaths::start(
            workspace.clone(),
            view.as_ref()
                .map_or_else(|| workspace.clone(), |v| v.workdir.clone()),
            &self.state_dir,
            &self.hidden,
        )
        .map_err(|why| ApiError::invalid(format!("workspace refused: {why}")))?;

        let id = SandboxId::generate();
        tracing::debug!(sandbox = %id, "starting a sandbox");
        let mut dirs = RunDir::shared(
            self.state_dir.join("sandboxes").join(id.as_str()),
            self.shared.clone(),
        );
        fs::create_dir(&dirs.dir).map_err(|e| {
            ApiError::internal(format!("cannot create {}: {e}", dirs.dir.display()))
        })?;
        // The disk quota: the helper mounts it, and the layers, the scratch mounts and the
        // spill files live on it.
        dirs.disk = Some(
            crate::disk::Disk::prepare(
                &dirs.dir,
                dirs.disk_mount_point(),
                policy.limits.disk_bytes,
                &native::disk_templates(&self.state_dir),
            )
            .map_err(|e| ApiError::internal(e.to_string()))?,
        );

        let writable_root = policy.filesystem.root == RootMode::Writable;
        let (root_plan, root_view, identity) = match &view {
            None if writable_root => {
                return Err(ApiError::invalid(format!(
                    "policy {policy_name:?} has filesystem.root = \"writable\", which needs an \
                     image (the host view's root is the host's own, which no sandbox writes); \
                     give an image, or leave filesystem.root read-only"
                )));
            }
            None => (
                RootPlan::Host,
                native::RootView::Host,
                Identity::host_view(is_root),
            ),
            Some(v) => {
                let scaffold = dirs.dir.join("scaffold");
                v.prepare_scaffold(&scaffold)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                // A writable root's changes land in a layer on the sandbox's disk.
                let upper =
                    writable_root.then(|| (dirs.planned("root-upper"), dirs.planned("root-work")));
                (
                    v.root_plan(
                        &scaffold,
                        upper.as_ref().map(|(u, w)| (u.as_path(), w.as_path())),
                    ),
                    native::RootView::Image {
                        view: v,
                        build: writable_root,
                    },
                    v.identity,
                )
            }
        };
        // Run by root, the commands are ids of a namespace of their own (docs/security.md,
        // "Running as root").
        let identity = if is_root {
            identity.in_range()
        } else {
            identity
        };
        // Who the commands are on the host: the helper's maps and the file operations both
        // take it from here.
        let user = identity.host_user();
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
        let ws = ws.finish();
        let (mut mounts, write_paths) = native::plan_mounts(
            &policy,
            &ws,
            &dirs,
            false,
            root_view,
            identity.ranged_user(),
        );
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
            // The layers' directory (the disk's root, or the sandbox's directory without a
            // disk) and the mask file: the disk's mount point and the mask file are shared by
            // the backend's sandboxes, so only this sandbox's are bound here.
            MountOp::Dir {
                dst: Path::new(PRIVATE).join("layers"),
                mode: 0o700,
            },
            MountOp::Bind {
                src: dirs.planned(""),
                dst: Path::new(PRIVATE).join("layers"),
                readonly: false,
            },
            MountOp::File {
                dst: Path::new(PRIVATE).join("empty"),
            },
            MountOp::Bind {
                src: dirs.empty_file(),
                dst: Path::new(PRIVATE).join("empty"),
                readonly: true,
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
        let mut egress = match egress_service {
            Some(service) => {
                let config = EgressConfig {
                    network: policy.network.clone(),
                    secrets: resolve_secrets(&policy, &req.secrets)?,
                };
                let wiring = native::EgressWiring::start(service.as_ref(), id.as_str(), config)
                    .map_err(ApiError::internal)?;
                Some(wiring)
            }
            None => None,
        };
        let mut base_env =
            native::compose_env(&policy, view.as_ref().map(|v| v.base_env()).as_deref(), &[]);
        if let Some(trust) = egress.as_ref().and_then(|e| e.proxy.trust()) {
            let dir = dirs.dir.join("egress");
            write_trust(&dir, &trust).map_err(|e| {
                ApiError::internal(format!("cannot write the sandbox's CA bundle: {e}"))
            })?;
            mounts.extend(native::egress_mounts(dir));
            for (k, v) in trust_env(&trust) {
                base_env.retain(|(ek, _)| *ek != k);
                base_env.push((k, v));
            }
        }
        for (k, v) in &req.env {
            base_env.retain(|(ek, _)| ek != k);
            base_env.push((k.clone(), v.clone()));
        }
        let landlock_required = policy.security.landlock == LandlockMode::Required;
        let config = InitConfig {
            argv: Vec::new(),
            cwd: ws.inside.clone(),
            env: base_env.clone(),
            user_namespace: identity.user_namespace,
            uid: user.uid,
            gid: user.gid,
            inner_uid: identity.inner_uid,
            inner_gid: identity.inner_gid,
            isolate_network,
            hostname: "taskbox".into(),
            new_root: dirs.root(),
            root: root_plan,
            mounts,
            landlock: LandlockPlan {
                enabled: true,
                required: landlock_required,
                read: vec![PathBuf::from("/")],
                write: write_paths.clone(),
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
            disk: dirs.disk.as_mut().map(|d| DiskPlan {
                // A fork's layers go on the disk before the helper mounts anything from it.
                hold: seed.is_some(),
                ..native::ranged_disk_plan(d.plan(), &identity)
            }),
            id_range: identity.id_range,
            root_capabilities: identity.root_capabilities(&policy),
        };
        let plan = serde_json::to_vec(&config)
            .map_err(|e| ApiError::internal(format!("cannot encode the plan: {e}")))?;
        let plan = spawn::plan_memfd(&plan)
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
        let log = spawn::HelperLog::new()
            .map_err(|e| ApiError::internal(format!("cannot create the helper log: {e}")))?;
        let mut disk_channel =
            native::DiskChannel::new().map_err(|e| ApiError::internal(e.to_string()))?;
        let mut fds = vec![
            (status_write.as_fd(), STATUS_FD),
            (theirs.as_fd(), CONTROL_FD),
            (plan.as_fd(), PLAN_FD),
        ];
        fds.extend(disk_channel.helper_fd().map(|fd| (fd, DISK_FD)));
        let egress_fd = egress.as_ref().and_then(native::EgressWiring::helper_fd);
        fds.extend(egress_fd.map(|fd| (fd, EGRESS_FD)));
        let child = self
            .spawn_helper(&helper, id.as_str(), log.as_fd(), &fds)
            .map_err(|e| ApiError::internal(format!("cannot start the sandbox helper: {e}")))?;
        drop(fds);
        drop((status_write, theirs, plan));
        disk_channel.theirs = None;

        // The helper mounts the disk first; then pid 1 reports that the sandbox is built (or
        // why it is not). It made the egress listener before it said so: the proxy can serve
        // it from now on.
        let received = match (dirs.disk.as_mut(), seed) {
            (Some(disk), seed) => disk
                .receive(&disk_channel.ours, Duration::from_secs(30))
                .and_then(|()| match seed {
                    None => Ok(()),
                    Some(seed) => {
                        let planted = seed.plant(disk.path()).map_err(|e| e.to_string());
                        let told = Disk::release(&disk_channel.ours, planted.is_ok());
                        planted.and(told)
                    }
                }),
            (None, None) => Ok(()),
            (None, Some(_)) => Err("a fork needs a disk of its own to hold its layers".into()),
        };
        let started = wait_ready(&status_read, &ours, Duration::from_secs(30));
        let started = match (received, started) {
            (Err(why), Ok(_)) => Err(ApiError::internal(format!("sandbox disk: {why}"))),
            (_, started) => started,
        };
        let started = started.and_then(|started| match egress.as_mut() {
            Some(e) => e
                .connect(Duration::from_secs(5))
                .map(|()| started)
                .map_err(|why| ApiError::internal(format!("egress proxy: {why}"))),
            None => Ok(started),
        });
        // The workspace mount, as pid 1 built it and before any command could touch the tree:
        // file operations check they reach this mount (see `Sandbox::fs`).
        let started = started.and_then(|(pid, starter)| {
            let (_, mount) = WorkspaceFs::open_mounted(&proc_root(pid), &ws.inside)?;
            Ok((pid, mount, starter))
        });
        let (init_pid, ws_mount, starter) = match started {
            Ok(started) => started,
            Err(e) => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                // What the helper wrote before it failed (a panic's message) says more.
                return Err(match (e, log.last_words()) {
                    (ApiError::Internal(why), Some(words)) => {
                        ApiError::Internal(format!("{why} (the helper wrote: {words})"))
                    }
                    (e, _) => e,
                });
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
                network: policy.network.mode.as_str().into(),
                limits: cgroup.as_ref().map(Cgroup::kind).unwrap_or("rlimit").into(),
                disk: disk_kind(&dirs).into(),
            },
            labels: req.labels.clone(),
            created_at_ms: created,
            expires_at_ms: req.ttl_secs.map(|t| created + t * 1000),
            state: "running".into(),
            checkpoints: Vec::new(),
            lost_cause: None,
            forked_from: None,
        };
        let control_reader = ours
            .try_clone()
            .map_err(|e| ApiError::internal(format!("dup: {e}")))?;
        let egress = egress.map(|e| SandboxEgress::new(e.proxy, e.log, &policy.network));
        let exports = self.state_dir.join("exports");
        let layers = Layers::new(
            ws.host.clone(),
            dirs.on_disk(""),
            dirs.dir.join("checkpoints"),
            dirs.on_disk("out"),
        )
        .with_exports(exports)
        .with_overlay(policy.filesystem.workspace == WorkspaceMode::Overlay)
        .with_scratch("tmp", dirs.on_disk("tmp"));
        let exec_base = ExecBase {
            workdir: ws.inside.display().to_string(),
            env: base_env,
            shell: view.map(|v| v.shell().to_vec()),
        };
        let sandbox = Arc::new(Sandbox {
            common: Common::new(info, policy, exec_base, layers)
                .with_egress(egress)
                .with_user(user)
                .with_fs_landlock(Some(FsLandlock {
                    writable: write_paths,
                    required: landlock_required,
                })),
            dirs,
            ws,
            helper: Mutex::new(Some(child)),
            helper_log: log,
            init_pid,
            ws_mount: Mutex::new(ws_mount),
            control: ours,
            send_lock: Mutex::new(()),
            starters: Mutex::new(vec![Arc::new(StarterLink::new(None, starter))]),
            _status: status_read,
            oom: cgroup.as_ref().and_then(Cgroup::oom_counter),
            oom_at_start: cgroup.as_ref().map_or(0, Cgroup::oom_kills),
            host_oom_at_start: host_oom_kills(),
            cgroup,
            lost: AtomicBool::new(false),
            ending: AtomicBool::new(false),
            mail: Mutex::new(Mail::default()),
            mail_cond: Condvar::new(),
            identity,
        });
        let weak = Arc::downgrade(&sandbox);
        if let Err(e) = std::thread::Builder::new()
            .name(format!("sandbox-{}", sandbox.id()))
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

/// Reads the status pipe until pid 1 says it started, then the control socket until it is ready
/// (with the sandbox's own exec starter, which comes before). Returns pid 1's pid and the
/// starter's socket.
fn wait_ready(
    status: &OwnedFd,
    control_sock: &OwnedFd,
    limit: Duration,
) -> Result<(i32, OwnedFd), ApiError> {
    let deadline = Instant::now() + limit;
    let mut status_buf = Vec::new();
    let mut pid = None;
    let mut starter = None;
    // pid 1 can be ready before the helper's report of its pid has arrived: the two come on
    // different channels. Once ready, only the report is waited for.
    let mut ready = false;
    let mut buf = Vec::new();
    loop {
        if ready && pid.is_some() {
            let starter = starter.ok_or_else(|| {
                ApiError::internal("the sandbox was ready without its exec starter")
            })?;
            return Ok((pid.unwrap_or_default(), starter));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ApiError::internal(if ready {
                "the sandbox did not report its pid"
            } else {
                "the sandbox did not start within 30s"
            }));
        }
        let mut fds = vec![PollFd::new(status.as_fd(), PollFlags::POLLIN)];
        if !ready {
            fds.push(PollFd::new(control_sock.as_fd(), PollFlags::POLLIN));
        }
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
        let control_ready = fds
            .get(1)
            .is_some_and(|f| f.revents().is_some_and(|r| !r.is_empty()));
        drop(fds);
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
                Ok(Some((Event::Ready, _))) => ready = true,
                Ok(Some((Event::Starter { user: None, error }, fds))) => {
                    if let Some(why) = error {
                        return Err(ApiError::internal(format!("sandbox set-up failed: {why}")));
                    }
                    starter = fds.into_iter().next();
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

/// The errno at the end of an I/O error's text as the helper reports it (`... (os error 2)`).
fn os_error_of(message: &str) -> Option<i32> {
    let (_, tail) = message.rsplit_once("(os error ")?;
    tail.strip_suffix(')')?.parse().ok()
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

/// How often pid 1 is asked to end what a dead reaper left, until its output has ended.
const ORPHANS_AGAIN: Duration = Duration::from_millis(100);

/// How often a timed-out exec's kill is asked for again, until it has ended.
const KILL_AGAIN: Duration = Duration::from_secs(1);

/// The most an exec's output is read in one go.
const READ_MAX: usize = 64 * 1024;

/// A running exec's pipes, owned by whoever drives it: its output, and its reaper's events
/// (which end once nothing of the exec is left).
struct Pipes {
    stdout: OwnedFd,
    stderr: OwnedFd,
    events: OwnedFd,
    /// The socket of the reaper that took the exec, with its starter: handed back once the
    /// exec ended, when the reaper said it waits for another.
    reaper: Option<(Arc<StarterLink>, OwnedFd)>,
}

/// What an exec's result is measured against: the upper layer before it started, the cgroup's
/// OOM count, and its window on the egress proxy's decisions.
struct Baseline {
    /// Taken by the exec's end.
    before: Option<ExecStart>,
    oom_before: u64,
    window: Option<ExecWindow>,
}

impl Sandbox {
    /// The ids (inside) of the user the plan names, `None` for the sandbox's own user. A
    /// root-run sandbox can be any user its range maps; a rootless one has its one user.
    fn exec_ids(&self, plan: &ExecPlan) -> Result<Option<ExecIds>, ApiError> {
        let Some(user) = &plan.exec_user else {
            return Ok(None);
        };
        let id = &self.identity;
        let own = (
            id.inner_uid
                .unwrap_or_else(|| nix::unistd::geteuid().as_raw()),
            id.inner_gid
                .unwrap_or_else(|| nix::unistd::getegid().as_raw()),
        );
        let name = plan.user.as_deref().unwrap_or_default();
        match id.id_range {
            Some(range) => {
                let outside = [user.uid, user.gid]
                    .into_iter()
                    .chain(user.groups.iter().copied())
                    .find(|i| range.host(*i).is_none());
                if let Some(i) = outside {
                    return Err(ApiError::invalid(format!(
                        "user {name:?}: id {i} is outside the sandbox's ids (0 to {}); \
                         give a user whose uid, gid and groups are below {}",
                        range.size - 1,
                        range.size
                    )));
                }
                if (user.uid, user.gid) == own && user.groups.is_empty() {
                    return Ok(None);
                }
                Ok(Some(ExecIds {
                    uid: user.uid,
                    gid: user.gid,
                    groups: user.groups.clone(),
                }))
            }
            // One id is mapped: the sandbox's own user is the only one there is.
            None if user.uid == own.0 => Ok(None),
            None => Err(ApiError::invalid(format!(
                "user {name:?} (uid {}): this sandbox runs its commands as uid {} alone, since \
                 taskbox runs without root here (an unprivileged user namespace maps one id); \
                 run the supervisor as root to exec as other users",
                user.uid, own.0
            ))),
        }
    }

    fn start_exec(self: &Arc<Self>, plan: &ExecPlan) -> Result<(Arc<Slot>, Pipes), ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(self.lost_error());
        }
        // What execve would refuse is refused here, naming the limit. The command inherits
        // this process's stack limit (no rlimit of the plan changes it).
        plan.check(exec_limits::own_argument_space(), &[])?;
        let user = self.exec_ids(plan)?;
        let starter = self.starter_for(user.as_ref())?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let (in_r, in_w) = pipe()?;
        let (events_r, events_w) = pipe()?;
        let mut stdin_keep: Option<Box<dyn kit::StdinSink>> = None;
        match (&plan.stdin, plan.background) {
            (Some(data), _) => {
                let data = data.clone();
                let mut w = fs::File::from(in_w);
                std::thread::spawn(move || {
                    let _ = w.write_all(&data);
                });
            }
            (None, true) => stdin_keep = Some(Box::new(fs::File::from(in_w))),
            (None, false) => drop(in_w),
        }
        let slots = &self.common.slots;
        let id = slots.next_id();
        let slot = Arc::new(ExecSlot::new(
            id,
            plan.argv.clone(),
            kit::findings::paths(&self.common, &plan.cwd),
            plan.output_limit,
            &self.common.layers.spill,
            stdin_keep,
            NativeProc {
                starter: Some(starter.clone()),
                ..NativeProc::default()
            },
        ));
        slots.insert(slot.clone());
        let request = Request::Exec {
            id,
            argv: plan.argv.clone(),
            cwd: plan.cwd.clone(),
            env: plan.env.clone(),
            user: user.clone(),
        };
        let fds = [
            in_r.as_raw_fd(),
            out_w.as_raw_fd(),
            // Merged: both on the one pipe, so their order is the order of the writes; the
            // stderr pipe then ends at once.
            if plan.merge_output {
                out_w.as_raw_fd()
            } else {
                err_w.as_raw_fd()
            },
            events_w.as_raw_fd(),
        ];
        let mut link = starter;
        let mut sent = link.send_exec(&request, &fds);
        if let Err(control::SendError::Channel(_)) = &sent {
            // The starter is gone (pid 1 ends the execs it left): once more with a new one.
            self.forget_starter(&link);
            let next = self.starter_for(user.as_ref()).inspect_err(|_| {
                slots.remove(id);
            })?;
            slot.update(|st| st.proc.starter = Some(next.clone()));
            sent = next.send_exec(&request, &fds);
            link = next;
        }
        drop((in_r, out_w, err_w, events_w));
        let reaper = match sent {
            Ok(reaper) => reaper.map(|sock| (link, sock)),
            Err(e) => {
                slots.remove(id);
                return Err(match e {
                    // Nothing was sent: the sandbox is as it was, and the request may be tried
                    // again.
                    control::SendError::Prepare { .. } => {
                        ApiError::Unavailable(format!("sandbox {}: {e}", self.id()))
                    }
                    control::SendError::Channel(_) => ApiError::internal(format!(
                        "sandbox {}: its exec starter does not answer: {e}",
                        self.id()
                    )),
                });
            }
        };
        Ok((
            slot,
            Pipes {
                stdout: out_r,
                stderr: err_r,
                events: events_r,
                reaper,
            },
        ))
    }

    /// The exec's end from its event pipe's one line (`line`, read whole), also kept in the
    /// slot.
    fn exited_of(&self, slot: &Slot, line: &[u8]) -> Option<Exited> {
        let event = serde_json::from_slice::<Event>(line);
        let Ok(Event::Exited {
            code,
            signal,
            landlock,
            seccomp,
            exec_failed,
            setup_error,
            cpu_ms,
            max_rss_bytes,
            file_size_exceeded,
            reusable,
            ..
        }) = event
        else {
            tracing::warn!(sandbox = %self.id(), exec = slot.id, event = ?event, "unreadable exec end");
            return None;
        };
        let limits = &self.common.policy.limits;
        let end = Exited {
            end: ExecEnd {
                exit_code: code,
                signal,
                exec_failed,
                cpu_ms,
                max_rss_bytes,
                file_size_limit: file_size_exceeded.then_some(limits.file_size_bytes),
                ..ExecEnd::default()
            },
            landlock,
            seccomp,
            setup_error,
            reusable,
        };
        slot.update(|st| st.proc.exited = Some(end.clone()));
        Some(end)
    }

    /// Sends `req` (about `slot`'s exec) to that exec's starter. Best effort: a starter that is
    /// gone had its execs ended by pid 1, and nothing is left to kill or signal.
    fn to_starter(&self, slot: &Slot, req: &Request) {
        if let Some(starter) = slot.state().proc.starter.clone() {
            let _ = starter.send(req, &[]);
        }
    }

    /// Asks the exec's starter to kill its tree.
    fn kill_tree(&self, slot: &Slot) {
        self.to_starter(slot, &Request::KillTree { id: slot.id });
    }
    /// Asks every starter in use to kill its execs' processes, and pid 1 to end those of
    /// starters that are gone.
    fn kill_all(&self) -> Result<(), ApiError> {
        let links: Vec<_> = lock(&self.starters).clone();
        for link in links {
            let _ = link.send(&Request::KillAll, &[]);
        }
        self.send(&Request::KillAll, &[])
    }

    /// Reads an exec's output until it ends (or its deadline kills it) and builds its result.
    fn drive(
        &self,
        slot: &Slot,
        pipes: Pipes,
        timeout: Duration,
        start: Instant,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
        mut baseline: Baseline,
    ) -> Result<ExecResult, ApiError> {
        let result = self.drive_to_end(slot, pipes, timeout, start, events, &mut baseline);
        // An exec that ended without its changes measured (it could not start, or the sandbox
        // was lost) is over all the same.
        if let Some(before) = baseline.before.take() {
            self.common.layers.exec_abandoned(before);
        }
        result
    }

    fn drive_to_end(
        &self,
        slot: &Slot,
        mut pipes: Pipes,
        timeout: Duration,
        start: Instant,
        mut events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
        baseline: &mut Baseline,
    ) -> Result<ExecResult, ApiError> {
        if let Some(ev) = events.as_mut() {
            ev(ExecEvent::Started { exec_id: slot.id });
        }
        let deadline = start + timeout;
        let mut timed_out = false;
        // stdout, stderr, and the reaper's events: the exec is over when all three have ended.
        let mut open = [true, true, true];
        // Small first: most commands write little, and zeroing 64 KiB per exec showed in its
        // profile. A read that fills it grows it, up to 64 KiB, for commands that write a lot.
        let mut buf = vec![0u8; 4 * 1024];
        let mut events_buf = Vec::new();
        let mut exited = None;
        let mut killed_at = None;
        let mut orphaned: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if let Some(at) = orphaned
                && now >= at + ORPHANS_AGAIN
            {
                orphaned = Some(now);
                let _ = self.send(&Request::KillAll, &[]);
            }
            if !timed_out && now >= deadline {
                timed_out = true;
            }
            // Asked again each second until the exec ends: a request that overtook the exec's
            // own start is not lost.
            if timed_out && killed_at.is_none_or(|at: Instant| now >= at + KILL_AGAIN) {
                killed_at = Some(now);
                self.kill_tree(slot);
            }
            if !open.iter().any(|o| *o) {
                break;
            }
            if self.lost.load(Ordering::SeqCst) && slot.state().error.is_some() {
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
            let fds = [&pipes.stdout, &pipes.stderr, &pipes.events];
            let mut pollfds = Vec::with_capacity(3);
            let mut which = Vec::with_capacity(3);
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
                    Ok(0) => {
                        open[i] = false;
                        if i == 2 && exited.is_none() {
                            // The reaper died before the exec's end (killed from outside): what
                            // it started hangs under pid 1 once re-parented, and pid 1 ends such
                            // orphans; asked until the output ends (the kernel may re-parent
                            // them only after this end was seen).
                            orphaned = Some(now - ORPHANS_AGAIN);
                        }
                    }
                    Ok(n) if i == 2 => {
                        events_buf.extend_from_slice(&buf[..n]);
                        // The pipe's one line, whole: the exec's end.
                        if events_buf.ends_with(b"\n") {
                            exited = self.exited_of(slot, &events_buf);
                        }
                        // Its last event: nothing follows it.
                        if exited.is_some() {
                            open[2] = false;
                        }
                    }
                    Ok(n) => {
                        let full = n == buf.len();
                        let data = &buf[..n];
                        slot.push(i == 0, data);
                        if let Some(ev) = events.as_mut() {
                            let text = String::from_utf8_lossy(data).into_owned();
                            ev(if i == 0 {
                                ExecEvent::Stdout { data: text }
                            } else {
                                ExecEvent::Stderr { data: text }
                            });
                        }
                        if full && buf.len() < READ_MAX {
                            buf.resize(READ_MAX, 0);
                        }
                    }
                    Err(nix::Error::EINTR) | Err(nix::Error::EAGAIN) => {}
                    Err(_) => open[i] = false,
                }
            }
        }
        let Some(exited) = exited else {
            // A reaper that ends without a report went down with the sandbox, as a rule: the
            // event reader says so in a moment (it waits for the helper's status for the
            // cause); the exec's answer is then the sandbox's loss, not an internal error.
            let t0 = Instant::now();
            while !self.lost.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(2) {
                let helper_runs = lock(&self.helper)
                    .as_mut()
                    .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
                if helper_runs && t0.elapsed() > Duration::from_millis(500) {
                    // The sandbox lives on: this reaper alone failed.
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            return Err(if self.lost.load(Ordering::SeqCst) {
                self.lost_error()
            } else {
                ApiError::internal(format!(
                    "sandbox {}: the exec's reaper (or, before it, the sandbox's exec starter) \
                     ended without reporting how the command ended",
                    self.id()
                ))
            });
        };
        // Its reaper waits for the next exec, which it takes with no fork on its way.
        if exited.reusable
            && let Some((link, sock)) = pipes.reaper.take()
        {
            link.give_back(sock);
        }
        if let Some(err) = &exited.setup_error {
            return Err(if let Some(why) = err.strip_prefix("cwd: ") {
                match os_error_of(why) {
                    Some(errno) => exec_limits::cwd_refused(why.to_string(), errno),
                    None => ApiError::invalid(why.to_string()),
                }
            } else {
                ApiError::internal(format!("the command could not start: {err}"))
            });
        }
        let captured = slot.take_output();
        let (out, err) = (captured.stdout, captured.stderr);
        let policy = &self.common.policy;
        let layers = &self.common.layers;
        let mut end = exited.end;
        end.timed_out = timed_out.then_some(timeout);
        end.duration_ms = start.elapsed().as_millis() as u64;
        if self.oom_kills() > baseline.oom_before {
            end.oom_killed_at = Some(policy.limits.memory_bytes);
        }
        if let Some(disk) = &self.dirs.disk
            && disk.is_full()
        {
            end.disk_full_at = Some(disk.size());
        }
        // Every process of the exec is gone: what the proxy decided meanwhile is (also) this
        // exec's.
        end.network = baseline.window.take().map(|w| w.close(CLOSE_GRACE));
        let changes = match baseline.before.take() {
            Some(before) => layers.exec_end(before)?,
            None => ExecChanges::default(),
        };
        let limit = policy.limits.file_size_bytes;
        if layers.reached_file_size(&changes, limit) {
            end.file_size_limit = Some(limit);
        }
        end.unnamed_paths = changes.unnamed.clone();
        let mut result = end.into_result(
            out,
            err,
            changes.shown,
            self.enforcement(&exited.landlock, exited.seccomp),
        );
        result.ignored_changes = changes.ignored.len() as u64;
        kit::findings::add(
            self,
            &mut result,
            captured.findings,
            slot.findings.as_ref(),
            &changes.ignored,
        );
        lock(&self.common.info).enforcement = result.enforcement.clone();
        Ok(result)
    }

    /// Ends the sandbox: closing the control socket ends pid 1 and with it every process.
    fn shutdown(&self) {
        self.ending.store(true, Ordering::SeqCst);
        let _ = self.kill_all();
        let _ =
            nix::sys::socket::shutdown(self.control.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        lock(&self.starters).clear();
        if let Some(mut child) = lock(&self.helper).take()
            && !matches!(child.wait_timeout(Duration::from_secs(2)), Ok(Some(_)))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(cg) = &self.cgroup {
            cg.kill_all(Duration::from_secs(5));
            cg.remove();
        }
        if let Some(egress) = &self.common.egress {
            egress.proxy.shutdown();
        }
        // Execs still being driven see the end of their pipes; mark them.
        self.common.slots.end_all("the sandbox was destroyed");
    }

    /// The workspace as the sandbox sees it, for path-safe file operations.
    fn fs(&self) -> Result<WorkspaceFs, ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(self.lost_error());
        }
        let (fs, mount) = WorkspaceFs::open_mounted(&proc_root(self.init_pid), &self.ws.inside)?;
        if mount != *lock(&self.ws_mount) {
            return Err(ApiError::Conflict(format!(
                "the workspace of sandbox {} is no longer mounted at {} (something in the \
                 sandbox moved or replaced a directory on its path); destroy it",
                self.id(),
                self.ws.inside.display()
            )));
        }
        Ok(fs
            .with_mount_path(self.ws.inside.clone())
            .with_protected(&self.common.policy.filesystem.protected))
    }
}

impl Backend for Native {
    type Sandbox = Sandbox;
    const NAME: &'static str = "native";

    fn table(&self) -> &Table<Sandbox> {
        &self.table
    }

    fn start(&self, req: &CreateRequest) -> Result<Arc<Sandbox>, ApiError> {
        self.start_seeded(req, None)
    }

    fn start_fork(&self, req: &CreateRequest, seed: &Seed) -> Result<Arc<Sandbox>, ApiError> {
        self.start_seeded(req, Some(seed))
    }

    const WARM_FORKS: bool = true;

    /// A sandbox started as a create's, but proven by no probe: nothing runs in it until a
    /// fork takes it from the pool and plants its layers (through [`Handle::remount`]).
    fn start_warm(&self, req: &CreateRequest) -> Result<Arc<Sandbox>, ApiError> {
        self.launch(req, None)
    }

    fn end(&self, sandbox: Arc<Sandbox>) {
        sandbox.shutdown();
        kit::release(sandbox);
    }
}

impl Native {
    /// A sandbox for `req`, its layers from `seed` when it is a fork. The first create of an
    /// origin is proven by a first exec, which reports the enforcement in force; a fork takes its
    /// parent's, and a later create of the same origin what the first one's probe found (the
    /// same policy on the same host: the same Landlock and seccomp outcome).
    fn start_seeded(
        &self,
        req: &CreateRequest,
        seed: Option<&Seed>,
    ) -> Result<Arc<Sandbox>, ApiError> {
        let sandbox = self.launch(req, seed)?;
        // What is known in force (a fork's parent's, or its origin's), and the origin a probe
        // proves for later creates.
        let (known, origin) = match seed {
            Some(seed) => (seed.enforcement.clone(), None),
            None => {
                let key = kit::origin_key(req);
                (lock(&self.proven).get(&key).cloned(), Some(key))
            }
        };
        if let Some(e) = known.filter(|e| e.landlock != "unknown") {
            lock(&sandbox.common.info).enforcement = e;
            return Ok(sandbox);
        }
        let probe = sandbox
            .common
            .plan(&ExecRequest {
                argv: Some(vec!["/bin/true".into()]),
                ..ExecRequest::default()
            })
            .and_then(|plan| sandbox.exec(plan, None));
        match probe {
            Err(e) => {
                sandbox.shutdown();
                Err(e)
            }
            Ok(_) => {
                let found = lock(&sandbox.common.info).enforcement.clone();
                if let Some(key) = origin
                    && found.landlock != "unknown"
                {
                    let mut proven = lock(&self.proven);
                    // Bounded: origins are few (one per workspace and policy in use); past
                    // the bound the next creates probe again.
                    if proven.len() >= MAX_PROVEN {
                        proven.clear();
                    }
                    proven.insert(key, found);
                }
                Ok(sandbox)
            }
        }
    }
}

/// Origins whose probed enforcement a backend keeps (see `Native::start_seeded`).
const MAX_PROVEN: usize = 256;

impl Handle for Sandbox {
    type Proc = NativeProc;

    fn common(&self) -> &Common<NativeProc> {
        &self.common
    }

    fn exec(
        self: &Arc<Self>,
        plan: ExecPlan,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let layers = &self.common.layers;
        let baseline = Baseline {
            before: Some(layers.exec_start()?),
            oom_before: self.oom_kills(),
            window: self.common.egress.as_ref().map(|e| e.log.open()),
        };
        let (slot, pipes) = match self.start_exec(&plan) {
            Ok(started) => started,
            Err(e) => {
                if let Some(before) = baseline.before {
                    layers.exec_abandoned(before);
                }
                return Err(e);
            }
        };
        let (timeout, start) = (plan.timeout, Instant::now());
        if plan.background {
            let sb = Arc::clone(self);
            let slot2 = slot.clone();
            std::thread::Builder::new()
                .name(format!("exec-{}-{}", self.id(), slot.id))
                .spawn(move || {
                    let res = sb.drive(&slot2, pipes, timeout, start, None, baseline);
                    slot2.finish(res);
                })
                .map_err(|e| ApiError::internal(format!("cannot start a thread: {e}")))?;
            return Ok(ExecOutcome::Background(slot.info()));
        }
        let result = self.drive(&slot, pipes, timeout, start, events, baseline);
        self.common.slots.remove(slot.id);
        Ok(ExecOutcome::Finished(result?))
    }

    fn signal(&self, slot: &Slot, signal: i32) -> Result<(), ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(self.lost_error());
        }
        if signal == libc::SIGKILL {
            self.kill_tree(slot);
            return Ok(());
        }
        // Its reaper passes it on to the command (the starter holds it until the reaper has
        // taken the exec).
        self.to_starter(
            slot,
            &Request::Signal {
                id: slot.id,
                signal,
            },
        );
        Ok(())
    }

    fn with_fs<T>(
        &self,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        op(&self.fs()?)
    }

    /// pid 1's root: the root every exec of the sandbox has.
    fn open_root(&self) -> Result<OwnedFd, ApiError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(self.lost_error());
        }
        let path = proc_root(self.init_pid);
        let fd = fs::File::open(&path)
            .map_err(|e| ApiError::internal(format!("cannot open {}: {e}", path.display())))?;
        Ok(OwnedFd::from(fd))
    }

    fn stop_all(&self) -> Result<(), ApiError> {
        self.kill_all()?;
        self.common
            .slots
            .wait_settled(Instant::now() + kit::STOP_WAIT);
        Ok(())
    }

    /// pid 1 reads the layer from a descriptor sent with the request and writes it through
    /// the workspace's mount (see the helper's merge module): the mount and its exec starters
    /// stay, and nothing is copied on the host.
    fn merge(&self, layer: &Path) -> Result<(), ApiError> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(layer)
            .map_err(|e| {
                ApiError::internal(format!(
                    "cannot open the fork's layer {}: {e}",
                    layer.display()
                ))
            })?;
        lock(&self.mail).merged = None;
        self.send(
            &Request::Merge {
                workspace: self.ws.inside.display().to_string(),
            },
            &[dir.as_raw_fd()],
        )?;
        let outcome = self
            // As long as writing the layer takes: pid 1 answers when it is done, or is lost.
            .wait_mail(Instant::now() + Duration::from_secs(120), |m| {
                m.merged.take()
            })
            .unwrap_or_else(|| Some("the sandbox did not answer the merge".to_string()));
        match outcome {
            None => Ok(()),
            Some(err) => Err(ApiError::internal(err)),
        }
    }

    /// Detaches the overlay inside the sandbox and mounts a fresh one on the staged layers,
    /// with the workspace's guards: pid 1 does it, as only it may (its private view of the
    /// state directory holds the layers).
    fn remount(&self, _staged: &StagedLayers, name: &str) -> Result<(), ApiError> {
        let private = Path::new(PRIVATE);
        // The staged layers as pid 1 sees them (see `PRIVATE` in `create`).
        let mut ops = vec![MountOp::Overlay {
            lower: private.join("lower"),
            upper: private.join("layers/upper.next"),
            work: private.join("layers/work.next"),
            dst: self.ws.inside.clone(),
            lower_map: None,
        }];
        let empty = private.join("empty");
        let guards = native::workspace_guard_ops(&self.common.policy, &self.ws, &empty, false);
        for op in guards {
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
        // The starters in use end with the remount; pid 1 sends one that knows the new mount.
        lock(&self.starters).clear();
        {
            let mut mail = lock(&self.mail);
            mail.remounted = None;
            mail.starters.clear();
        }
        self.send(
            &Request::Remount {
                path: self.ws.inside.display().to_string(),
                ops,
            },
            &[],
        )?;
        let outcome = self
            .wait_mail(Instant::now() + Duration::from_secs(10), |m| {
                m.remounted.take()
            })
            .unwrap_or_else(|| Some("the sandbox did not answer the remount".to_string()));
        if let Some(err) = outcome {
            self.lost.store(true, Ordering::SeqCst);
            return Err(ApiError::internal(format!(
                "restore of checkpoint {name} failed inside the sandbox: {err}; destroy it"
            )));
        }
        // File operations now go to the new mount (opened while no exec runs).
        let (_, mount) = WorkspaceFs::open_mounted(&proc_root(self.init_pid), &self.ws.inside)?;
        *lock(&self.ws_mount) = mount;
        Ok(())
    }
}
