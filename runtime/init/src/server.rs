//! Long-lived mode of the sandbox's pid 1: serve exec requests on the control socket.
//!
//! pid 1 hands each exec to the sandbox's exec starter (Z, see [`Starter`]), confined once as
//! every command is. For each exec Z forks its own reaper process (E), a child subreaper: every
//! process the command starts, however it daemonises, stays beneath E, so E can kill exactly
//! that exec's tree (on request, on timeout, and always once the command's main process has
//! ended) and report the status only when nothing of the exec is left.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, fork};

use crate::command::{exec_confined, fail};
use crate::config::{InitConfig, STATUS_FD, Status};
use crate::control::{self, CONTROL_FD, Event, ExecIds, Request};
use crate::mounts;

fn control_fd() -> BorrowedFd<'static> {
    // SAFETY: CONTROL_FD is inherited from the runtime and stays open for the life of pid 1 and
    // of every exec reaper; nothing closes it before they exit.
    unsafe { BorrowedFd::borrow_raw(CONTROL_FD) }
}

fn emit(event: &Event) {
    let _ = control::send(control_fd(), event, &[]);
}

/// pid 1's request loop. Returns never: when the runtime closes the socket, pid 1 exits and the
/// kernel kills everything left in the sandbox.
///
/// pid 1 keeps its privilege (it remounts the workspace on restore) and starts no command
/// itself: it hands each exec to the sandbox's exec starter (see [`Starter`]), a child confined
/// once the way every command is, and answers for it when the starter dies with execs it never
/// took.
pub fn serve(config: &InitConfig) -> ! {
    // SIGUSR1 asks an exec reaper to kill its tree. Blocked here so a reaper inherits it blocked
    // and cannot die of it before installing its handler.
    let mut usr1 = SigSet::empty();
    usr1.add(Signal::SIGUSR1);
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&usr1), None);

    emit(&Event::Ready);
    // One starter per user the execs run as (`None`: the sandbox's own), started when first
    // needed; the sandbox's own at once.
    let mut starters: Vec<Starter> = Starter::spawn(config, None).into_iter().collect();
    let mut buf = Vec::new();
    loop {
        // Collect the starters that ended, and any orphan that reached pid 1 (reapers of a
        // starter that died, processes that escaped no subreaper).
        loop {
            match waitpid(
                Pid::from_raw(-1),
                Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
            ) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(status) => {
                    if let Some(pid) = status.pid()
                        && let Some(s) = starters.iter_mut().find(|s| s.pid == pid)
                    {
                        s.reaped = true;
                    }
                }
            }
        }
        for s in take_where(&mut starters, |s| s.reaped) {
            s.ended();
        }
        let mut fds = vec![PollFd::new(control_fd(), PollFlags::POLLIN)];
        fds.extend(
            starters
                .iter()
                .map(|s| PollFd::new(s.sock.as_fd(), PollFlags::POLLIN)),
        );
        match poll(&mut fds, PollTimeout::from(200u16)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => fail("control", e),
        }
        let control_ready = fds[0].any().unwrap_or(false);
        let ready: Vec<bool> = fds[1..].iter().map(|f| f.any().unwrap_or(false)).collect();
        drop(fds);
        for (s, ready) in starters.iter_mut().zip(ready) {
            // A starter whose end closed is gone: it is answered for below.
            if ready && !s.read_notes(false) {
                s.reaped = true;
            }
        }
        for s in take_where(&mut starters, |s| s.reaped) {
            s.ended();
        }
        if !control_ready {
            continue;
        }
        let (request, fds) = match control::recv::<Request>(control_fd(), &mut buf) {
            Ok(Some(r)) => r,
            // The runtime is gone: so is the sandbox.
            Ok(None) => std::process::exit(0),
            // A message that cannot be read is answered (for its exec, when its id can be
            // read, so the runtime does not wait for it); a broken socket ends the sandbox
            // (spinning on it would only burn CPU).
            Err(control::RecvError::Malformed { reason, exec_id }) => {
                let message = format!("bad control message: {reason}");
                match exec_id {
                    Some(id) => emit(&not_started(id, message)),
                    None => emit(&Event::Error { message }),
                }
                continue;
            }
            Err(control::RecvError::Channel(_)) => std::process::exit(125),
        };
        match request {
            Request::Remount { path, ops } => {
                // The starters' Landlock rules name the workspace's current mount: the commands
                // after the remount need starters whose rules name the new one.
                for s in starters.drain(..) {
                    s.stop();
                }
                let error = remount(Path::new(&path), &ops).err();
                drop(fds);
                emit(&Event::Remounted { error });
                starters.extend(Starter::spawn(config, None));
            }
            Request::Exec { id, ref user, .. } => {
                let at = match starters.iter().position(|s| s.user == *user) {
                    Some(at) => Some(at),
                    None => Starter::spawn_holding(config, user.as_ref(), &fds).map(|s| {
                        starters.push(s);
                        starters.len() - 1
                    }),
                };
                match at {
                    Some(at) => starters[at].forward(&request, &fds),
                    None => emit(&not_started(id, "cannot start the exec starter".into())),
                }
            }
            // Each starter knows its own execs and ignores the others'.
            request => {
                for s in &mut starters {
                    s.forward(&request, &fds);
                }
            }
        }
    }
}

/// Removes and returns the items of `v` for which `pred` holds.
fn take_where<T>(v: &mut Vec<T>, pred: impl Fn(&T) -> bool) -> Vec<T> {
    let (taken, kept) = std::mem::take(v).into_iter().partition(|t| pred(t));
    *v = kept;
    taken
}

/// The `Exited` of an exec that never started.
fn not_started(id: u64, why: String) -> Event {
    Event::Exited {
        id,
        code: None,
        signal: None,
        landlock: "none".into(),
        seccomp: false,
        exec_failed: None,
        setup_error: Some(why),
        cpu_ms: 0,
        max_rss_bytes: 0,
        file_size_exceeded: false,
    }
}

/// The sandbox's exec starter (Z), as pid 1 sees it: a child of pid 1 that confined itself once
/// as every command is confined (`no_new_privs`, no capabilities, the seccomp filter; the
/// Landlock ruleset built, to be applied by each command in a domain of its own), and that
/// starts every exec: for each it forks the exec's reaper (E), which forks the command. Paying
/// for the confinement once per sandbox instead of once per exec is most of what an exec costs
/// inside the sandbox (the filter's compilation and attachment above all).
///
/// pid 1 forwards it the exec requests (`Exec`, with its descriptors, `Signal`, `KillTree`,
/// `KillAll`) on a socket of their own; it answers each `Exec` with the exec's id once the
/// exec's reaper exists, which from then on reports the exec itself. The commands cannot signal
/// it (Landlock's signal scope keeps each in its own domain) and it is not dumpable (no command
/// reads its memory or descriptors through /proc). Should it die anyway, pid 1 answers the execs
/// it had not taken and starts another for the next.
struct Starter {
    pid: Pid,
    sock: OwnedFd,
    /// Who its commands are (`None`: the sandbox's own user).
    user: Option<ExecIds>,
    /// Execs forwarded and not yet taken.
    pending: std::collections::BTreeSet<u64>,
    /// waitpid returned it.
    reaped: bool,
    /// The receive buffer of its notes, kept: [`control::recv`] sizes a new one to a whole
    /// datagram (64 KiB, zeroed), and a note comes with every exec.
    buf: Vec<u8>,
}

impl Starter {
    fn spawn(config: &InitConfig, user: Option<&ExecIds>) -> Option<Starter> {
        Starter::spawn_holding(config, user, &[])
    }

    /// As [`Starter::spawn`], while pid 1 holds `held` (an exec's descriptors, which the
    /// starter receives on its own socket and must not keep a copy of: a pipe's end it held
    /// would never let the exec's output end).
    fn spawn_holding(
        config: &InitConfig,
        user: Option<&ExecIds>,
        held: &[OwnedFd],
    ) -> Option<Starter> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (ours, theirs) = match socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        ) {
            Ok(pair) => pair,
            Err(e) => {
                emit(&Event::Error {
                    message: format!("cannot start the exec starter: socketpair: {e}"),
                });
                return None;
            }
        };
        // SAFETY: pid 1 is single-threaded.
        match unsafe { fork() } {
            Ok(ForkResult::Child) => {
                drop(ours);
                for fd in held {
                    let _ = nix::unistd::close(fd.as_raw_fd());
                }
                starter_main(config, theirs, user)
            }
            Ok(ForkResult::Parent { child }) => Some(Starter {
                pid: child,
                sock: ours,
                user: user.cloned(),
                pending: Default::default(),
                reaped: false,
                buf: Vec::new(),
            }),
            Err(e) => {
                emit(&Event::Error {
                    message: format!("cannot start the exec starter: fork: {e}"),
                });
                None
            }
        }
    }

    /// Sends `request` (and its descriptors) on; an exec is pending until taken.
    fn forward(&mut self, request: &Request, fds: &[OwnedFd]) {
        let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let sent = control::send(self.sock.as_fd(), request, &raw);
        if let Request::Exec { id, .. } = request {
            match sent {
                Ok(()) => {
                    self.pending.insert(*id);
                }
                Err(e) => emit(&not_started(*id, format!("cannot hand the exec over: {e}"))),
            }
        }
    }

    /// Reads the starter's notes (the ids of execs taken): those waiting, or with `block` until
    /// none is pending (at most a few seconds). False when the starter's end has closed.
    fn read_notes(&mut self, block: bool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let wait = if block && !self.pending.is_empty() {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return true;
                }
                PollTimeout::try_from(left.as_millis().min(1000) as i32)
                    .unwrap_or(PollTimeout::ZERO)
            } else {
                PollTimeout::ZERO
            };
            let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, wait) {
                Ok(0) => {
                    if block && !self.pending.is_empty() {
                        continue;
                    }
                    return true;
                }
                Err(nix::Error::EINTR) => continue,
                Err(_) => return false,
                Ok(_) => {}
            }
            match control::recv::<u64>(self.sock.as_fd(), &mut self.buf) {
                Ok(Some((id, _))) => {
                    self.pending.remove(&id);
                }
                Ok(None) | Err(control::RecvError::Channel(_)) => return false,
                Err(control::RecvError::Malformed { .. }) => {}
            }
        }
    }

    /// The starter died: what it took reports itself, what it did not is answered here.
    fn ended(mut self) {
        self.read_notes(false);
        for id in std::mem::take(&mut self.pending) {
            emit(&not_started(
                id,
                "the sandbox's exec starter ended before it started the command".into(),
            ));
        }
        if !self.reaped {
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = waitpid(self.pid, None);
        }
    }

    /// Ends the starter once it has taken every exec it was given (the reapers it started go on
    /// without it).
    fn stop(mut self) {
        self.read_notes(true);
        self.ended();
    }
}

/// The exec starter's loop (see [`Starter`]). Never returns: it exits when pid 1's end closes.
fn starter_main(config: &InitConfig, sock: OwnedFd, user: Option<&ExecIds>) -> ! {
    // SAFETY: prctl with integer arguments only. Not dumpable: the commands, which share its
    // uid, may not reach its memory or descriptors through /proc.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    // What could not be confined is every exec's setup error.
    let mut confined = crate::command::confine_starter(config, user)
        .map_err(|(stage, message)| format!("{stage}: {message}"));
    let mut reapers: HashMap<u64, Pid> = HashMap::new();
    let mut buf = Vec::new();
    let take = |id: u64| {
        let _ = control::send(sock.as_fd(), &id, &[]);
    };
    loop {
        loop {
            match waitpid(
                Pid::from_raw(-1),
                Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
            ) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(status) => {
                    if let Some(pid) = status.pid() {
                        reapers.retain(|_, p| *p != pid);
                    }
                }
            }
        }
        let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(200u16)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(_) => std::process::exit(125),
        }
        let (request, fds) = match control::recv::<Request>(sock.as_fd(), &mut buf) {
            Ok(Some(r)) => r,
            Ok(None) | Err(control::RecvError::Channel(_)) => std::process::exit(0),
            Err(control::RecvError::Malformed { reason, exec_id }) => {
                if let Some(id) = exec_id {
                    emit(&not_started(id, format!("bad control message: {reason}")));
                    take(id);
                }
                continue;
            }
        };
        match request {
            Request::Exec {
                id, argv, cwd, env, ..
            } => {
                let stdio = match (<[OwnedFd; 3]>::try_from(fds), &confined) {
                    (Ok(stdio), Ok(_)) => stdio,
                    (Err(_), _) => {
                        emit(&not_started(
                            id,
                            "exec request without its three descriptors".into(),
                        ));
                        take(id);
                        continue;
                    }
                    (_, Err(why)) => {
                        emit(&not_started(id, why.clone()));
                        take(id);
                        continue;
                    }
                };
                // SAFETY: the starter is single-threaded.
                match unsafe { fork() } {
                    Ok(ForkResult::Child) => {
                        drop(sock);
                        let Ok(landlock) = std::mem::replace(&mut confined, Err(String::new()))
                        else {
                            std::process::exit(125)
                        };
                        let mut exec_config = config.clone();
                        exec_config.argv = argv;
                        exec_config.cwd = PathBuf::from(cwd);
                        exec_config.env = env;
                        reap_exec(id, &exec_config, stdio, landlock)
                    }
                    Ok(ForkResult::Parent { child }) => {
                        reapers.insert(id, child);
                    }
                    Err(e) => emit(&not_started(id, format!("fork: {e}"))),
                }
                take(id);
            }
            Request::Signal { id, pid, signal } => {
                if reapers.contains_key(&id)
                    && let Ok(sig) = Signal::try_from(signal)
                {
                    let _ = kill(Pid::from_raw(pid), sig);
                }
            }
            Request::KillTree { id } => {
                if let Some(pid) = reapers.get(&id) {
                    let _ = kill(*pid, Signal::SIGUSR1);
                }
            }
            Request::KillAll => {
                for pid in reapers.values() {
                    let _ = kill(*pid, Signal::SIGUSR1);
                }
            }
            // pid 1's own work; never forwarded.
            Request::Remount { .. } => {}
        }
    }
}

fn remount(path: &Path, ops: &[crate::config::MountOp]) -> Result<(), String> {
    // What the sandbox did to the directories above the workspace (its processes are stopped
    // now) must not make this detach another mount: the path must lead, through no symlink, to
    // a mount's root.
    match crate::sys::is_mount_root_nofollow(path) {
        Ok(true) => {}
        Ok(false) => return Err(format!("{} is no longer a mount", path.display())),
        Err(e) => return Err(format!("cannot reach {}: {e}", path.display())),
    }
    nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| format!("cannot detach {}: {e}", path.display()))?;
    for op in ops {
        mounts::apply(Path::new("/"), op).map_err(|e| e.to_string())?;
    }
    Ok(())
}

static KILL_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    KILL_REQUESTED.store(true, Ordering::SeqCst);
}

/// The exec reaper (E): starts the command, forwards its confinement report, and reports its end
/// once every process of the exec is gone.
fn reap_exec(
    id: u64,
    config: &InitConfig,
    stdio: [OwnedFd; 3],
    landlock: crate::landlock_rules::Prepared,
) -> ! {
    let fail_early = |why: String| -> ! {
        emit(&not_started(id, why));
        std::process::exit(0)
    };
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let action = SigAction::new(
        SigHandler::Handler(on_usr1),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let _ = unsafe { nix::sys::signal::sigaction(Signal::SIGUSR1, &action) };
    let mut usr1 = SigSet::empty();
    usr1.add(Signal::SIGUSR1);
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&usr1), None);

    let (status_read, status_write) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => fail_early(format!("pipe: {e}")),
    };
    let command = match spawn_command(config, &stdio, status_write.as_raw_fd(), landlock) {
        Ok(pid) => Pid::from_raw(pid),
        Err(e) => fail_early(format!("clone: {e}")),
    };
    drop(stdio);
    drop(status_write);
    emit(&Event::Started {
        id,
        pid: command.as_raw(),
    });
    let mut main = MainStatus {
        pid: command.as_raw(),
        result: None,
        cpu_ms: 0,
        max_rss_bytes: 0,
        file_size_exceeded: false,
    };

    // The command's confinement report, until its exec closes the pipe.
    let mut report = Vec::new();
    let mut reader = std::fs::File::from(status_read);
    let mut chunk = [0u8; 4096];
    loop {
        match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => report.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                if KILL_REQUESTED.swap(false, Ordering::SeqCst) {
                    kill_children(&mut main);
                }
            }
            Err(_) => break,
        }
    }
    let mut landlock = "none".to_string();
    let mut seccomp = false;
    let mut exec_failed = None;
    let mut setup_error = None;
    for line in report.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<Status>(line) {
            Ok(Status::Landlock { status }) => landlock = status,
            Ok(Status::Seccomp { installed }) => seccomp = installed,
            Ok(Status::ExecFailed { errno, program }) => exec_failed = Some((errno, program)),
            Ok(Status::SetupFailed { stage, message }) => {
                setup_error = Some(format!("{stage}: {message}"))
            }
            _ => {}
        }
    }

    // Wait for the main process; on request kill the tree. Once it has ended, nothing of the
    // exec may outlive it.
    while main.result.is_none() {
        if KILL_REQUESTED.swap(false, Ordering::SeqCst) {
            kill_children(&mut main);
            continue;
        }
        if !reap_one(&mut main, 0) {
            break;
        }
    }
    // Nothing of the exec outlives its main process.
    kill_children(&mut main);
    let MainStatus {
        result,
        cpu_ms,
        max_rss_bytes,
        file_size_exceeded,
        ..
    } = main;
    let (code, signal) = result.unwrap_or((None, None));
    emit(&Event::Exited {
        id,
        code,
        signal,
        landlock,
        seccomp,
        exec_failed,
        setup_error,
        cpu_ms,
        max_rss_bytes,
        file_size_exceeded: file_size_exceeded || crate::command::reports_file_size_kill(code),
    });
    std::process::exit(0)
}

/// What the command's process gets from its reaper (see [`spawn_command`]).
struct CommandArgs<'a> {
    config: &'a InitConfig,
    stdio: [i32; 3],
    status: i32,
    landlock: std::mem::ManuallyDrop<crate::landlock_rules::Prepared>,
}

/// The command's process until its exec: its descriptors in place, then
/// [`exec_confined`]. Never returns (the exec, or `_exit`).
extern "C" fn command_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the reaper's `CommandArgs`, alive and untouched while the reaper is
    // suspended (CLONE_VFORK) until this process execs or exits.
    let args = unsafe { &mut *arg.cast::<CommandArgs<'_>>() };
    for (fd, target) in args.stdio.iter().zip(0..) {
        // SAFETY: dup2 on descriptors of this process's own table.
        if unsafe { libc::dup2(*fd, target) } < 0 {
            // SAFETY: _exit ends this process only; nothing of the reaper's state is touched.
            unsafe { libc::_exit(125) };
        }
    }
    // The command reports its confinement on fd 3, a pipe to this reaper.
    // SAFETY: as above.
    if unsafe { libc::dup2(args.status, STATUS_FD) } < 0 {
        // SAFETY: as above.
        unsafe { libc::_exit(125) };
    }
    let _ = crate::sys::set_cloexec(STATUS_FD);
    // SAFETY: taken once, here; the reaper never drops its copy (ManuallyDrop).
    let landlock = unsafe { std::mem::ManuallyDrop::take(&mut args.landlock) };
    exec_confined(args.config, landlock)
}

/// The stack of the command's process until its exec, below a guard page.
const COMMAND_STACK: usize = 512 * 1024;

/// Starts the command's process sharing this reaper's memory until its exec (`CLONE_VM |
/// CLONE_VFORK`, as posix_spawn does): no page tables to copy, no copy-on-write faults, and an
/// exec that has no copy of the reaper to tear down, which were a third of what an exec cost
/// inside the sandbox. The reaper is suspended until the command execs or exits, so the two
/// never run on the shared memory at once; the command has its own descriptors, signal
/// handlers, working directory and credentials (no CLONE_FILES, CLONE_SIGHAND, CLONE_FS), and
/// what it allocates before its exec stays allocated in the reaper, which exits soon after.
/// Its status lines are a few hundred bytes, far below the pipe's buffer that the reaper
/// reads only once it runs again. Returns the command's pid.
fn spawn_command(
    config: &InitConfig,
    stdio: &[OwnedFd; 3],
    status: i32,
    landlock: crate::landlock_rules::Prepared,
) -> std::io::Result<i32> {
    // SAFETY: a fresh private anonymous mapping; checked below.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            COMMAND_STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the lowest page of the mapping made above: an overflow faults instead of
    // writing into the reaper's memory below it.
    if unsafe { libc::mprotect(stack, 4096, libc::PROT_NONE) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut args = CommandArgs {
        config,
        stdio: [
            stdio[0].as_raw_fd(),
            stdio[1].as_raw_fd(),
            stdio[2].as_raw_fd(),
        ],
        status,
        landlock: std::mem::ManuallyDrop::new(landlock),
    };
    // SAFETY: the stack grows down from the mapping's top (16-byte aligned); `args` outlives the
    // child's use of it, since CLONE_VFORK returns only after the child's exec or exit;
    // `command_main` never returns into this frame.
    let pid = unsafe {
        libc::clone(
            command_main,
            stack.cast::<u8>().add(COMMAND_STACK).cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::addr_of_mut!(args).cast(),
        )
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: the child no longer runs on it (it exec'd or exited).
    unsafe { libc::munmap(stack, COMMAND_STACK) };
    if pid < 0 {
        // The child never ran: the ruleset is still ours to drop.
        drop(std::mem::ManuallyDrop::into_inner(args.landlock));
        return Err(err);
    }
    Ok(pid)
}

/// This process's children as the kernel lists them.
fn children() -> Vec<i32> {
    let me = std::process::id();
    std::fs::read_to_string(format!("/proc/self/task/{me}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The exec's main process and, once reaped, how it ended.
struct MainStatus {
    pid: i32,
    result: Option<(Option<i32>, Option<i32>)>,
    cpu_ms: u64,
    max_rss_bytes: u64,
    /// Some process of the exec died of SIGXFSZ.
    file_size_exceeded: bool,
}

/// Reaps one child (blocking unless `flags` has WNOHANG), recording the main process's status.
/// Returns false when there is nothing (left) to reap.
fn reap_one(main: &mut MainStatus, flags: i32) -> bool {
    let mut status = 0;
    // SAFETY: rusage is plain old data; all-zero is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `usage` are valid for writes for the duration of the call.
    let pid = unsafe { libc::wait4(-1, &mut status, libc::__WALL | flags, &mut usage) };
    if pid < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR);
    }
    if pid == 0 {
        return false;
    }
    if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGXFSZ {
        main.file_size_exceeded = true;
    }
    if pid == main.pid {
        let ms = |tv: libc::timeval| tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000;
        main.cpu_ms = ms(usage.ru_utime) + ms(usage.ru_stime);
        main.max_rss_bytes = usage.ru_maxrss as u64 * 1024;
        if libc::WIFEXITED(status) {
            main.result = Some((Some(libc::WEXITSTATUS(status)), None));
        } else if libc::WIFSIGNALED(status) {
            main.result = Some((None, Some(libc::WTERMSIG(status))));
        }
    }
    true
}

/// Kills every descendant: orphans of the exec re-parent to this subreaper, so repeating "kill my
/// children, reap them" until none is left reaches the whole tree, however it forked.
fn kill_children(main: &mut MainStatus) {
    loop {
        let kids = children();
        if kids.is_empty() {
            // Reap what is left as zombies; done when nothing remains.
            while reap_one(main, libc::WNOHANG) {}
            if children().is_empty() {
                return;
            }
            continue;
        }
        for pid in &kids {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        for _ in &kids {
            if !reap_one(main, 0) {
                break;
            }
        }
    }
}
