//! One Docker sandbox: its container, its host-side workspace, and the operations on it (exec
//! through the Engine API; files, diff, checkpoints and export on the host side).

use std::fs;
use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures_util::StreamExt;
use taskbox_core::accounts::ExecUser;
use taskbox_core::api::*;
use taskbox_core::egress::{CLOSE_GRACE, ExecWindow};
use taskbox_core::exec_limits;
use taskbox_core::fsops::WorkspaceFs;
use taskbox_core::kit::{
    self, Common, ExecEnd, ExecPlan, ExecSlot, Handle, ProcState, StagedLayers, StdinSink,
};
use taskbox_core::layers::Fingerprint;
use taskbox_core::policy::{CREDENTIAL_STORES, Policy, WorkspaceMode};
use taskbox_core::result::{Enforcement, ExecResult};
use tokio::io::AsyncWriteExt;

use crate::daemon::{Daemon, DaemonError};
use crate::hostmount;
use crate::procfs;

pub use crate::procfs::INIT_PATH;
/// Where the per-exec status files appear in the container.
pub const RUN_MOUNT: &str = "/.taskbox/run";

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
    /// The sandbox's CA bundle for its inspected hosts, bound read-only at
    /// `egress::EGRESS_MOUNT` (empty without inspected hosts).
    pub fn egress(&self) -> PathBuf {
        self.0.join("egress")
    }
}

/// The workspace overlay of a sandbox as mounted on the host.
#[derive(Debug, Clone)]
pub(crate) struct Overlay {
    /// The host workspace (the baseline of diffs).
    pub workspace: PathBuf,
    /// The overlay's lower layer: the workspace itself, or its idmapped bind.
    pub lower: PathBuf,
    /// The container user (uid, gid): who its execs are ([`Overlay::exec_user`]) and what
    /// its file operations run as ([`Overlay::sandbox_user`]).
    pub user: (u32, u32),
    /// Paths inside the workspace (relative) that stay hidden: taskbox's own state, host
    /// sockets bound there, the deny list.
    pub masked: Vec<PathBuf>,
}

/// The `User` the Engine API is given for the container and each exec: numeric `UID:GID`,
/// for which the runtime sets no supplementary group.
pub(crate) fn docker_user(user: (u32, u32)) -> String {
    format!("{}:{}", user.0, user.1)
}

impl Overlay {
    /// Who the container's execs are ([`docker_user`]).
    pub fn exec_user(&self) -> String {
        docker_user(self.user)
    }

    /// The same user, as the credentials of the file operations: its uid and gid, and no
    /// supplementary group, as the runtime gives an exec of a numeric `UID:GID`.
    pub fn sandbox_user(&self) -> taskbox_core::kit::SandboxUser {
        taskbox_core::kit::SandboxUser {
            uid: self.user.0,
            gid: self.user.1,
            groups: Vec::new(),
        }
    }

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

/// What the Docker backend keeps of an exec's process.
#[derive(Default)]
pub struct DockerProc {
    /// The wrapper's pid on the host, once known.
    wrapper_pid: Option<i32>,
    /// Docker's id of the exec.
    docker_exec: Option<String>,
}

impl ProcState for DockerProc {}

type Slot = ExecSlot<DockerProc>;

/// A background exec's stdin: what the driver forwards to the attached stream.
struct StdinChannel {
    tx: tokio::sync::mpsc::UnboundedSender<StdinMsg>,
    queued: Arc<Queued>,
}

/// Bytes sent to an exec's stdin that its driver has not yet written to the stream: a writer
/// waits while there are more than [`STDIN_QUEUE_MAX`], so input of any size streams in
/// bounded memory (as a pipe's writer waits on the native backend).
#[derive(Default)]
pub(crate) struct Queued {
    bytes: std::sync::Mutex<usize>,
    /// The stream takes no more (the command closed it, the exec ended).
    done: AtomicBool,
    taken: std::sync::Condvar,
}

const STDIN_QUEUE_MAX: usize = 4 << 20;

impl Queued {
    /// The driver wrote `n` bytes (or, with `done`, will write no more).
    fn took(&self, n: usize, done: bool) {
        if done {
            self.done.store(true, Ordering::SeqCst);
        }
        let mut b = kit::lock(&self.bytes);
        *b = b.saturating_sub(n);
        self.taken.notify_all();
    }
}

impl StdinSink for StdinChannel {
    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        let ended = || std::io::Error::other("it ended");
        let mut b = kit::lock(&self.queued.bytes);
        while *b > STDIN_QUEUE_MAX {
            if self.queued.done.load(Ordering::SeqCst) || self.tx.is_closed() {
                return Err(ended());
            }
            b = self
                .queued
                .taken
                .wait_timeout(b, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        *b += data.len();
        drop(b);
        self.tx
            .send(StdinMsg::Data(data.to_vec()))
            .map_err(|_| ended())
    }

    fn close(self: Box<Self>) {
        let _ = self.tx.send(StdinMsg::Close);
    }
}

/// The cause of a lost container when nothing more precise is known.
const CONTAINER_GONE: &str =
    "its container is gone or stopped (e.g. the Docker daemon went away or restarted)";

/// One live sandbox.
pub struct Sandbox {
    pub common: Common<DockerProc>,
    pub(crate) dirs: Dirs,
    pub(crate) overlay: Overlay,
    pub container: String,
    pub init: procfs::ProcId,
    pub lost: AtomicBool,
    pub daemon: Arc<Daemon>,
    /// "cgroup-v1" or "cgroup-v2".
    pub limits_kind: String,
}

impl Sandbox {
    pub fn lost_error(&self) -> ApiError {
        if self.common.lost_cause().is_none() {
            self.mark_lost(CONTAINER_GONE);
        }
        self.common.lost_error()
    }

    /// Whether the container still runs (its pid 1 is alive). Marks the sandbox lost if not.
    /// Not from a task of the daemon's runtime: it blocks ([`Self::check_alive_async`] there).
    pub fn check_alive(&self) -> bool {
        match self.seen_alive() {
            Some(alive) => alive,
            None => {
                self.mark_lost(&self.why_gone());
                false
            }
        }
    }

    /// [`Self::check_alive`] for a task of the daemon's runtime (an exec's driver): a worker
    /// thread of the runtime blocked on the daemon's answer would hold the very tasks (in its
    /// own queue) that bring the answer in.
    async fn check_alive_async(&self) -> bool {
        match self.seen_alive() {
            Some(alive) => alive,
            None => {
                self.mark_lost(&self.inspect_gone().await);
                false
            }
        }
    }

    /// What is known without the daemon: lost already (false), or its init alive (true);
    /// `None` when the init just went and the daemon must say why.
    fn seen_alive(&self) -> Option<bool> {
        if self.lost.load(Ordering::SeqCst) {
            return Some(false);
        }
        procfs::alive(&self.init).then_some(true)
    }

    /// Why the container's init is gone, from a synchronous caller.
    fn why_gone(&self) -> String {
        let d = &self.daemon;
        // On a thread of its own: the caller may be inside a runtime's context (`block_on`
        // refuses to nest).
        std::thread::scope(|scope| {
            scope
                .spawn(|| d.block_on(self.inspect_gone()))
                .join()
                .unwrap_or_else(|_| format!("{CONTAINER_GONE} (the inspection panicked)"))
        })
    }

    /// Why the container's init is gone, as far as the daemon can say: its exit (a signal,
    /// the OOM killer), or the daemon itself being gone.
    async fn inspect_gone(&self) -> String {
        let d = &self.daemon;
        let inspected = d
            .call(
                "inspect a container",
                Duration::from_secs(5),
                d.docker.inspect_container(
                    &self.container,
                    None::<bollard::query_parameters::InspectContainerOptions>,
                ),
            )
            .await;
        match inspected {
            Ok(c) => {
                let st = c.state.unwrap_or_default();
                let code = st.exit_code.unwrap_or(0);
                let how = if code > 128 {
                    format!(
                        "its init was killed by signal {} (exit status {code})",
                        code - 128
                    )
                } else {
                    format!("its init exited with status {code}")
                };
                if st.oom_killed == Some(true) {
                    format!("its container stopped: {how}, by the OOM killer")
                } else {
                    format!("its container stopped: {how}")
                }
            }
            Err(DaemonError::NotFound(_)) => "its container was removed".to_owned(),
            Err(e) => format!("{CONTAINER_GONE} ({e})"),
        }
    }

    pub fn mark_lost(&self, cause: &str) {
        // The cause first: whoever sees the flag finds it.
        self.common.mark_lost(cause);
        self.lost.store(true, Ordering::SeqCst);
    }

    fn enforcement(&self) -> Enforcement {
        Enforcement {
            landlock: "none".into(),
            seccomp: true,
            network: self.common.policy.network.mode.as_str().into(),
            limits: self.limits_kind.clone(),
            disk: "loop-ext4".into(),
        }
    }

    /// The wrapper's host pid of an exec: known, or asked of the daemon once (`None` while the
    /// daemon has none yet).
    fn wrapper_pid(&self, slot: &Slot) -> Result<Option<i32>, DaemonError> {
        let (known, exec) = {
            let st = slot.state();
            (st.proc.wrapper_pid, st.proc.docker_exec.clone())
        };
        let (None, Some(exec)) = (known, exec) else {
            return Ok(known);
        };
        let d = &self.daemon;
        let inspect =
            d.block_on(d.call("inspect an exec", d.timeout, d.docker.inspect_exec(&exec)))?;
        let pid = inspect.pid.filter(|p| *p > 0).map(|p| p as i32);
        if pid.is_some() {
            slot.state().proc.wrapper_pid = pid;
        }
        Ok(pid)
    }

    /// The exec's wrapper, once it runs the command (a kill sent before could miss the exec:
    /// the daemon reports a pid before the wrapper is executed, and the wrapper waits for its
    /// signals only once it has blocked them, which it does before it starts the command);
    /// `None` when it never shows in time, the exec ended, or the daemon cannot be asked.
    fn wrapper(&self, slot: &Slot) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(pid) = self.wrapper_pid(slot).ok()?
                && procfs::is_wrapper_of(pid, slot.id)
                && !procfs::children(pid).is_empty()
            {
                return Some(pid);
            }
            if slot.state().settled() || Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Asks an exec's wrapper to kill the exec's whole process tree, and kills the tree from
    /// the host too: the wrapper runs as the exec's user and may not signal what a command
    /// made of another user (root with `setuid` but not `kill`, then `su`). If the wrapper is
    /// gone, kills what is left of the tree from the host.
    pub fn kill_tree(&self, slot: &Slot) {
        match self.wrapper(slot) {
            Some(pid) => {
                // SAFETY: kill has no memory arguments; the pid was checked to be the wrapper.
                unsafe { libc::kill(pid, libc::SIGUSR1) };
                procfs::kill_descendants(pid, &self.init);
            }
            None => procfs::kill_orphans(&self.init, slot.id),
        }
    }

    /// Runs a command: foreground (blocking, streaming `events`) or background.
    fn run(
        self: &Arc<Self>,
        plan: ExecPlan,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let layers = &self.common.layers;
        // What execve would refuse (for the wrapper, then for the command) is refused here,
        // naming the limit, before the daemon is asked for anything.
        let wrapper = [INIT_PATH, "exec", LONGEST_ID, &plan.cwd, MERGE_FLAG, "--"];
        plan.check(
            exec_limits::argument_space(procfs::stack_limit(&self.init).unwrap_or(DEFAULT_STACK)),
            &wrapper,
        )?;
        check_spec_size(&wrapper, &plan.argv, &plan.env)?;
        // The container user when the request names none, else the one the kit resolved.
        let user = plan
            .exec_user
            .as_ref()
            .map_or_else(|| self.overlay.exec_user(), docker_exec_user);
        let before = layers.fingerprint()?;
        let oom_before = procfs::oom_kills(&self.init);
        let id = self.common.slots.next_id();
        let (stdin_tx, stdin_rx) = tokio::sync::mpsc::unbounded_channel();
        let queued = Arc::new(Queued::default());
        let attach_stdin = plan.stdin.is_some() || plan.background;
        if let Some(data) = &plan.stdin {
            let _ = stdin_tx.send(StdinMsg::Data(data.clone()));
            let _ = stdin_tx.send(StdinMsg::Close);
        }
        let keep_stdin = plan.background && plan.stdin.is_none();
        let slot = Arc::new(ExecSlot::new(
            id,
            plan.argv.clone(),
            taskbox_core::kit::findings::paths(&self.common, &plan.cwd),
            plan.output_limit,
            &layers.spill,
            keep_stdin.then(|| {
                Box::new(StdinChannel {
                    tx: stdin_tx,
                    queued: queued.clone(),
                }) as Box<dyn StdinSink>
            }),
            DockerProc::default(),
        ));
        let ExecPlan {
            argv,
            env,
            cwd,
            timeout,
            background,
            merge_output,
            ..
        } = plan;
        let mut cmd = vec![INIT_PATH.to_string(), "exec".into(), id.to_string(), cwd];
        if merge_output {
            cmd.push(MERGE_FLAG.into());
        }
        cmd.push("--".into());
        cmd.extend(argv);
        let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
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
                tracing::warn!(sandbox = %self.common.id, message = %m, "the container is not running");
                self.mark_lost(&format!("its container is not running ({m})"));
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
        slot.state().proc.docker_exec = Some(docker_exec);
        self.common.slots.insert(slot.clone());
        let baseline = Baseline {
            before,
            oom_before,
            window: self.common.egress.as_ref().map(|e| e.log.open()),
        };
        let stream = Stream {
            output,
            input: attach_stdin.then_some(input),
            stdin: stdin_rx,
            queued,
        };
        let start = Instant::now();
        if background {
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
        self.common.slots.remove(id);
        Ok(ExecOutcome::Finished(res?))
    }
}

/// Docker's `User` for an exec as `user`: numeric `UID:GID`, for which the runtime sets no
/// supplementary group; or, when the user has supplementary groups and its uid's first line
/// in `/etc/passwd` is the one resolved, the uid alone: the runtime then looks that uid up in
/// the container's same two files and gives it that line's gid and the groups that list its
/// name, the ones resolved here (Docker takes no list of groups for an exec).
pub(crate) fn docker_exec_user(user: &ExecUser) -> String {
    if !user.groups.is_empty() && user.first_of_uid {
        user.uid.to_string()
    } else {
        docker_user((user.uid, user.gid))
    }
}

/// The exec id as the wrapper's argument takes the most room.
const LONGEST_ID: &str = "18446744073709551615";

/// The wrapper's flag for merged output (`init exec ID CWD --merge -- ARGV`): the command's
/// stderr is its stdout, so the two keep the order of the writes (two streams through the
/// daemon would not).
const MERGE_FLAG: &str = "--merge";

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
    queued: Arc<Queued>,
}

/// What an exec's result is measured against: the upper layer and the OOM count before it
/// started, and its window on the egress proxy's decisions.
pub(crate) struct Baseline {
    before: Option<Fingerprint>,
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
        slot: &Arc<Slot>,
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
                        Self::push(slot, true, &message, &events);
                    }
                    Some(Ok(LogOutput::StdErr { message })) => {
                        Self::push(slot, false, &message, &events);
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
                            stream.queued.took(data.len(), !stdin_open);
                        }
                        Some(StdinMsg::Close) | None => {
                            let _ = input.shutdown().await;
                            stdin_open = false;
                            stream.queued.took(0, true);
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
                        tracing::warn!(sandbox = %self.common.id, exec = slot.id,
                            "the exec's streams stayed open after its tree was killed");
                        break;
                    }
                }
            }
        }
        let ended = self.read_status(slot.id);
        if ended.is_none() {
            if !self.check_alive_async().await {
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
        slot: &Slot,
        stdout: bool,
        data: &[u8],
        events: &Option<std::sync::mpsc::Sender<ExecEvent>>,
    ) {
        slot.push(stdout, data);
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
        slot: &Slot,
        driven: Driven,
        timeout: Duration,
        start: Instant,
        baseline: Baseline,
    ) -> Result<ExecResult, ApiError> {
        // What the wrapper could not kill (a process of another user) was left to the
        // container's pid 1 when it exited: nothing of an exec outlives it.
        procfs::kill_orphans(&self.init, slot.id);
        let captured = slot.take_output();
        let (out, err) = (captured.stdout, captured.stderr);
        let mut end = match &driven.ended {
            Some(Ended::Exit { code, cpu_ms, rss }) => ExecEnd {
                exit_code: Some(*code),
                cpu_ms: *cpu_ms,
                max_rss_bytes: *rss,
                ..ExecEnd::default()
            },
            Some(Ended::Signal {
                signal,
                cpu_ms,
                rss,
            }) => ExecEnd {
                signal: Some(*signal),
                cpu_ms: *cpu_ms,
                max_rss_bytes: *rss,
                ..ExecEnd::default()
            },
            Some(Ended::ExecFailed { errno }) => ExecEnd {
                exit_code: Some(if *errno == libc::ENOENT { 127 } else { 126 }),
                exec_failed: Some((*errno, slot.argv.first().cloned().unwrap_or_default())),
                ..ExecEnd::default()
            },
            Some(Ended::Cwd { errno }) => {
                return Err(exec_limits::cwd_refused(
                    format!(
                        "cannot enter working directory: {}",
                        std::io::Error::from_raw_os_error(*errno)
                    ),
                    *errno,
                ));
            }
            None if driven.timed_out => ExecEnd::default(),
            None => {
                // The container's end takes the wrapper with it: the sandbox's loss, not the
                // command's (the init is looked at again, it may take a moment to be reaped).
                let deadline = Instant::now() + Duration::from_secs(1);
                while Instant::now() < deadline {
                    if !self.check_alive() {
                        return Err(self.lost_error());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                return Err(ApiError::internal(
                    "the exec ended without a status from its wrapper (was it killed from \
                     inside the sandbox?)",
                ));
            }
        };
        let limits = &self.common.policy.limits;
        end.timed_out = driven.timed_out.then_some(timeout);
        end.duration_ms = start.elapsed().as_millis() as u64;
        // The container's memory cgroup counts the kernel's OOM kills.
        if procfs::oom_kills(&self.init) > baseline.oom_before {
            end.oom_killed_at = Some(limits.memory_bytes);
        }
        // A process killed for writing past the file size limit, or a shell reporting that a
        // child was (128 + SIGXFSZ).
        if end.signal == Some(libc::SIGXFSZ) || end.exit_code == Some(128 + libc::SIGXFSZ) {
            end.file_size_limit = Some(limits.file_size_bytes);
        }
        if taskbox_core::disk::is_full_at(&self.dirs.disk(), limits.disk_bytes) {
            end.disk_full_at = Some(limits.disk_bytes);
        }
        // The exec's wrapper has ended, and with it every process of the exec: what the proxy
        // decided meanwhile is (also) this exec's.
        end.network = baseline.window.map(|w| w.close(CLOSE_GRACE));
        let changes = self.common.layers.changes_since(baseline.before.as_ref())?;
        end.unnamed_paths = changes.unnamed.clone();
        let mut result = end.into_result(out, err, changes.shown, self.enforcement());
        result.ignored_changes = changes.ignored.len() as u64;
        taskbox_core::kit::findings::add(
            self,
            &mut result,
            captured.findings,
            slot.findings.as_ref(),
            &changes.ignored,
        );
        Ok(result)
    }
}

impl Handle for Sandbox {
    type Proc = DockerProc;

    fn common(&self) -> &Common<DockerProc> {
        &self.common
    }

    fn refresh(&self) {
        self.check_alive();
    }

    fn exec(
        self: &Arc<Self>,
        plan: ExecPlan,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        self.run(plan, events)
    }

    fn signal(&self, slot: &Slot, signal: i32) -> Result<(), ApiError> {
        if signal == libc::SIGKILL {
            self.kill_tree(slot);
        } else if let Some(wrapper) = self.wrapper(slot)
            && let Some(main) = procfs::children(wrapper).first().copied()
        {
            // SAFETY: kill has no memory arguments; `main` is the wrapper's child.
            unsafe { libc::kill(main, signal) };
        }
        Ok(())
    }

    /// The workspace as mounted on the host (the kit runs `op` as the container user).
    fn with_fs<T>(
        &self,
        op: impl FnOnce(&WorkspaceFs) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let fs = WorkspaceFs::open(&self.dirs.mnt())?
            .with_mount_path(PathBuf::from(&self.common.exec_base.workdir))
            .with_protected(&self.common.policy.filesystem.protected);
        op(&fs)
    }

    /// The container's root, through its pid 1, checked still the same process once opened (a
    /// pid reused by another process would lead elsewhere).
    fn open_root(&self) -> Result<std::os::fd::OwnedFd, ApiError> {
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let path = format!("/proc/{}/root", self.init.pid);
        let fd = std::fs::File::open(&path)
            .map_err(|e| ApiError::internal(format!("cannot open {path}: {e}")))?;
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        Ok(fd.into())
    }

    /// Every exec is stopped, and every other process of the container but its pid 1 killed:
    /// nothing of the sandbox may run while the new workspace and its guards are mounted on
    /// paths it could otherwise swap for symlinks.
    fn stop_all(&self) -> Result<(), ApiError> {
        if !self.check_alive() {
            return Err(self.lost_error());
        }
        let slots = &self.common.slots;
        for slot in slots.all() {
            if !slot.state().settled() {
                self.kill_tree(&slot);
            }
        }
        slots.wait_settled(Instant::now() + kit::STOP_WAIT);
        procfs::kill_all_but_init(&self.init);
        Ok(())
    }

    /// The overlay is detached on the host (and so in the container), and a fresh one on the
    /// staged layers is mounted in its place (it propagates into the container).
    fn remount(&self, staged: &StagedLayers, name: &str) -> Result<(), ApiError> {
        self.overlay.prepare_upper(&staged.upper)?;
        hostmount::detach(&self.dirs.mnt()).map_err(|e| {
            self.mark_lost(&format!("a restore could not detach its workspace: {e}"));
            self.lost_error()
        })?;
        let policy = &self.common.policy;
        if let Err(e) = self
            .overlay
            .mount(&self.dirs, &staged.upper, &staged.work, policy)
        {
            self.mark_lost(&format!(
                "the restore of checkpoint {name} could not mount its workspace again: {e}"
            ));
            return Err(self.lost_error());
        }
        Ok(())
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
