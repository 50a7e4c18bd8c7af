//! Long-lived mode of the sandbox's pid 1: make the sandbox's exec starters and remount its
//! workspace on request.
//!
//! The runtime sends each exec straight to the exec starter of its user (Z, see
//! [`starter_main`]), a child of pid 1 confined once as every command is, whose socket pid 1
//! hands the runtime. Z keeps one exec reaper (E) forked ahead of the next exec and hands it the
//! exec; E is a child subreaper: every process the command starts, however it daemonises, stays
//! beneath E, so E can kill exactly that exec's tree (on request, on timeout, and always once
//! the command's main process has ended) and reports the exec's start and end on the exec's own
//! event pipe, its end only when nothing of the exec is left.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::{ForkResult, Pid, fork};

use crate::command::{exec_confined, fail};
use crate::config::{InitConfig, STATUS_FD, Status};
use crate::control::{self, CONTROL_FD, EXEC_FDS, Event, ExecIds, Request};
use crate::mounts;

fn control_fd() -> BorrowedFd<'static> {
    // SAFETY: CONTROL_FD is inherited from the runtime and stays open for the life of pid 1
    // (the starters close their copy).
    unsafe { BorrowedFd::borrow_raw(CONTROL_FD) }
}

fn emit(event: &Event) {
    let _ = control::send(control_fd(), event, &[]);
}

/// pid 1's request loop. Returns never: when the runtime closes the socket, pid 1 exits and the
/// kernel kills everything left in the sandbox.
///
/// pid 1 keeps its privilege (it remounts the workspace on restore) and starts no command
/// itself: it makes the exec starters and hands the runtime their sockets. Its children are
/// those starters and, should a starter die, the exec reapers it leaves: pid 1 ends those
/// execs (nothing could signal them or end them on their timeout any more; each reports its
/// end as it always does).
pub fn serve(config: &InitConfig) -> ! {
    // SIGUSR1 asks an exec reaper to kill its tree, FORWARD to pass a signal on to its command.
    // Blocked here so a reaper inherits them blocked and cannot die of one before installing its
    // handlers.
    // SAFETY: sigprocmask on this thread's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &reaper_signals(), std::ptr::null_mut()) };

    // The sandbox's own starter comes before Ready: the runtime has it from the start.
    let mut starters: Vec<Pid> = Vec::new();
    start_starter(config, None, &mut starters);
    emit(&Event::Ready);
    let mut buf = Vec::new();
    loop {
        // Collect the starters that ended, and any reaper of theirs that reached pid 1.
        let before = starters.len();
        reap_ended(|pid| starters.retain(|s| *s != pid));
        if starters.len() < before {
            end_orphans(&starters);
        }
        let mut fds = [PollFd::new(control_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(200u16)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => fail("control", e),
        }
        let (request, fds) = match control::recv::<Request>(control_fd(), &mut buf) {
            Ok(Some(r)) => r,
            // The runtime is gone: so is the sandbox.
            Ok(None) => std::process::exit(0),
            // A message that cannot be read is answered; a broken socket ends the sandbox
            // (spinning on it would only burn CPU).
            Err(control::RecvError::Malformed { reason, .. }) => {
                emit(&Event::Error {
                    message: format!("bad control message: {reason}"),
                });
                continue;
            }
            Err(control::RecvError::Channel(_)) => std::process::exit(125),
        };
        let mut fds = fds.into_iter();
        match request {
            Request::Starter { user } => start_starter(config, user, &mut starters),
            Request::Remount { path, ops } => {
                // The starters' Landlock rules name the workspace's current mount: the commands
                // after the remount need starters whose rules name the new one. The runtime
                // stopped every exec before asking.
                for pid in starters.drain(..) {
                    let _ = kill(pid, Signal::SIGKILL);
                    let _ = waitpid(pid, None);
                }
                let error = remount(Path::new(&path), &ops).err();
                start_starter(config, None, &mut starters);
                emit(&Event::Remounted { error });
            }
            // The starters stay: the mount their rules name is the same.
            Request::Merge { workspace } => {
                let error = match fds.next() {
                    Some(layer) => crate::merge::merge_layer(layer, Path::new(&workspace))
                        .err()
                        .map(|e| e.to_string()),
                    None => Some("the merge request came without its layer".into()),
                };
                emit(&Event::Merged { error });
            }
            // What the starters left: the runtime asks every starter too.
            Request::KillAll => end_orphans(&starters),
            Request::Exec { id, .. } => emit(&Event::Error {
                message: format!("exec {id} was sent to pid 1 instead of an exec starter"),
            }),
            Request::Signal { .. } | Request::KillTree { .. } => {}
        }
    }
}

/// Reaps every child that has ended, without waiting, telling `ended` each pid.
fn reap_ended(mut ended: impl FnMut(Pid)) {
    while let Ok(status) = waitpid(
        Pid::from_raw(-1),
        Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
    ) {
        match status.pid() {
            Some(pid) => ended(pid),
            None => break,
        }
    }
}

/// A socket pair for one of the sandbox's inner channels (both ends close-on-exec).
fn seqpacket_pair() -> nix::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
}

/// Ends what dead starters and reapers left, all of it a child of pid 1 then that is not a live
/// starter: a reaper (this same program) is asked to end its exec, which it reports as any
/// exec's end; a command whose reaper is gone is killed.
fn end_orphans(starters: &[Pid]) {
    use std::os::unix::fs::MetadataExt;
    let program = |pid: &str| {
        std::fs::metadata(format!("/proc/{pid}/exe"))
            .ok()
            .map(|m| (m.dev(), m.ino()))
    };
    let own = program("self");
    for pid in children() {
        if starters.iter().any(|s| s.as_raw() == pid) {
            continue;
        }
        let signal = if own.is_some() && program(&pid.to_string()) == own {
            Signal::SIGUSR1
        } else {
            Signal::SIGKILL
        };
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// Starts an exec starter for `user` and sends the runtime its socket ([`Event::Starter`]).
fn start_starter(config: &InitConfig, user: Option<ExecIds>, starters: &mut Vec<Pid>) {
    let failed = |user: Option<ExecIds>, why: String| {
        emit(&Event::Starter {
            user,
            error: Some(format!("cannot start the exec starter: {why}")),
        })
    };
    let (ours, theirs) = match seqpacket_pair() {
        Ok(pair) => pair,
        Err(e) => return failed(user, format!("socketpair: {e}")),
    };
    // SAFETY: pid 1 is single-threaded.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            drop(ours);
            starter_main(config, theirs, user.as_ref())
        }
        Ok(ForkResult::Parent { child }) => {
            drop(theirs);
            let sent = control::send(
                control_fd(),
                &Event::Starter { user, error: None },
                &[ours.as_raw_fd()],
            );
            if sent.is_err() {
                let _ = kill(child, Signal::SIGKILL);
                let _ = waitpid(child, None);
                return;
            }
            starters.push(child);
        }
        Err(e) => failed(user, format!("fork: {e}")),
    }
}

/// Writes one event on an exec's event pipe, a JSON line. Best effort: a runtime that stopped
/// reading has given the exec up.
fn write_event(events: BorrowedFd<'_>, event: &Event) {
    crate::command::write_line(events, event);
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
        reusable: false,
    }
}

/// An exec reaper forked ahead of the exec it will run. Its other socket went to the runtime,
/// which sends it the exec straight; on `note` it tells the starter which exec it took, and
/// closes it once its command runs.
struct Spare {
    pid: Pid,
    note: OwnedFd,
}

/// Kills and signals asked for execs whose reaper had not yet said it took them (the runtime's
/// request can overtake that note), applied when it does. Bounded: the oldest are let go.
const EARLY: usize = 64;

/// A kill (`None`) or a signal for exec `.0` that came before its reaper said it took it.
type Early = std::collections::VecDeque<(u64, Option<i32>)>;

/// Asks exec `id`'s reaper to kill its tree (`None`) or pass `signal` on, or keeps the request
/// for when the reaper says it took the exec.
fn ask(reapers: &HashMap<u64, Pid>, early: &mut Early, id: u64, signal: Option<i32>) {
    match reapers.get(&id) {
        Some(pid) => deliver(*pid, id, signal),
        None => {
            if early.len() == EARLY {
                early.pop_front();
            }
            early.push_back((id, signal));
        }
    }
}

/// Asks reaper `pid` to kill exec `id`'s tree (`None`) or to send `signal` to its command:
/// [`request_signal`] with the exec and the signal as its value ([`request_value`]). A reaper
/// serves one exec after another, so a request names the exec it is for; one that comes late,
/// when the reaper runs the next, is dropped there.
fn deliver(pid: Pid, id: u64, signal: Option<i32>) {
    let value = libc::sigval {
        sival_ptr: request_value(id, signal.unwrap_or(0)) as *mut libc::c_void,
    };
    // SAFETY: sigqueue with plain values; no memory is shared.
    unsafe { libc::sigqueue(pid.as_raw(), request_signal(), value) };
}

/// A request's value: the exec's id above the signal's number (0: kill the exec's tree).
fn request_value(id: u64, signal: i32) -> usize {
    ((id << 8) | (signal as u64 & 0xff)) as usize
}

/// Asks reaper `pid` to kill whatever exec it runs (SIGUSR1; a reaper that waits for its next
/// exec drops it when that starts).
fn deliver_kill_all(pid: Pid) {
    let _ = kill(pid, Signal::SIGUSR1);
}

/// The child's own copy of the starter's ruleset (its descriptor is the child's too), taken
/// once after a fork; the starter was confined, or no reaper would be forked.
fn child_ruleset(
    confined: &mut Result<crate::landlock_rules::Prepared, String>,
) -> crate::landlock_rules::Prepared {
    match std::mem::replace(confined, Err(String::new())) {
        Ok(landlock) => landlock,
        Err(_) => std::process::exit(125),
    }
}

/// The real-time signal by which a starter asks a reaper to kill its exec's tree or pass a
/// signal on to its command (the exec and the signal ride as the value, [`request_value`];
/// real-time signals queue, so none is lost).
fn request_signal() -> i32 {
    libc::SIGRTMIN()
}

/// The signals a reaper takes requests by: SIGUSR1 (kill the tree) and [`request_signal`].
fn reaper_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a set on this stack.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::sigaddset(&mut set, request_signal());
        set
    }
}

/// The exec starter's loop (Z): a child of pid 1 that confined itself once as every command is
/// confined (`no_new_privs`, no capabilities, the seccomp filter; the Landlock ruleset built, to
/// be applied by each command in a domain of its own), and that makes the reapers of its user's
/// execs. Paying for the confinement once per sandbox instead of once per exec is most of what
/// an exec costs inside the sandbox (the filter's compilation and attachment above all).
///
/// It keeps one reaper (E) forked ahead of the next exec and hands the runtime that reaper's
/// socket ([`Event::Reaper`] on its own socket): the runtime sends the exec there, so neither
/// this process nor a fork is on an exec's way. The next reaper is forked [`SPARE_AFTER`] after
/// the last one's command runs, so the fork never holds that exec up for a CPU, and a sandbox
/// destroyed right after its one exec never forks it. An exec the runtime sends here instead
/// (it had no reaper ready: execs side by side) gets a reaper forked for it at once, and the
/// next spare follows at once.
///
/// `Signal`, `KillTree` and `KillAll` come on its socket. The commands cannot signal it
/// (Landlock's signal scope keeps each in its own domain) and it is not dumpable (no command
/// reads its memory or descriptors through /proc). It exits when the runtime closes its end.
/// Never returns.
fn starter_main(config: &InitConfig, sock: OwnedFd, user: Option<&ExecIds>) -> ! {
    // SAFETY: prctl with integer arguments only. Not dumpable: the commands, which share its
    // uid, may not reach its memory or descriptors through /proc.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    // pid 1's socket is pid 1's alone.
    let _ = nix::unistd::close(CONTROL_FD);
    // What could not be confined is every exec's setup error.
    let mut confined = crate::command::confine_starter(config, user)
        .map_err(|(stage, message)| format!("{stage}: {message}"));
    let mut reapers: HashMap<u64, Pid> = HashMap::new();
    let mut early = Early::new();
    let mut spare: Option<Spare> = None;
    // When the next spare is to be forked: the sandbox's first at once.
    let mut spare_due = Some(Instant::now());
    // The reapers that ran an exec and wait for the runtime's next on their own socket.
    let mut serving: Vec<Spare> = Vec::new();
    let mut buf = Vec::new();
    let mut note_buf = Vec::new();
    loop {
        reap_ended(|pid| reapers.retain(|_, p| *p != pid));
        let now = Instant::now();
        if spare.is_none() && spare_due.is_some_and(|due| due <= now) {
            spare = fork_spare(config, &sock, &mut confined);
            // One that could not be forked is tried again at the next wake-up.
            spare_due = spare.is_none().then_some(now);
        }
        // Woken for the spare when it is due, else at least every 200 ms to reap.
        let wait = spare_due
            .filter(|_| spare.is_none())
            .map_or(IDLE_WAKE, |due| {
                due.saturating_duration_since(now).min(IDLE_WAKE)
            });
        let mut fds = vec![PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
        for s in spare.iter().chain(&serving) {
            fds.push(PollFd::new(s.note.as_fd(), PollFlags::POLLIN));
        }
        let wait = PollTimeout::try_from(wait.as_millis() as i32).unwrap_or(PollTimeout::ZERO);
        match poll(&mut fds, wait) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(_) => std::process::exit(125),
        }
        // Which of the socket, the spare's note and the serving reapers' notes have something.
        let mut ready = fds.iter().map(|f| f.any().unwrap_or(false));
        let request_ready = ready.next().unwrap_or(false);
        let spare_ready = spare.is_some() && ready.next().unwrap_or(false);
        let serving_ready: Vec<bool> = ready.collect();
        drop(fds);
        // The notes first: a signal for the exec a reaper took may be waiting behind it.
        if let Some(s) = spare.as_mut().filter(|_| spare_ready) {
            match read_note(s, &mut note_buf, &mut reapers, &mut early) {
                NoteState::Open => {}
                // Its command runs: it serves execs from now on, and the next spare is forked
                // a moment later, when the sandbox is still there (see SPARE_AFTER).
                NoteState::Running => {
                    serving.extend(spare.take());
                    spare_due = Some(Instant::now() + SPARE_AFTER);
                }
                // It died: the next one is forked at the top of the loop.
                NoteState::Closed => {
                    spare = None;
                    spare_due = Some(Instant::now());
                }
            }
        }
        let mut ready = serving_ready.into_iter();
        serving.retain_mut(|s| {
            !ready.next().unwrap_or(false)
                || read_note(s, &mut note_buf, &mut reapers, &mut early) != NoteState::Closed
        });
        if !request_ready {
            continue;
        }
        let (request, fds) = match control::recv::<Request>(sock.as_fd(), &mut buf) {
            Ok(Some(r)) => r,
            Ok(None) | Err(control::RecvError::Channel(_)) => std::process::exit(0),
            // Its descriptors, if any came, close: the runtime sees the exec's event pipe end
            // without a report.
            Err(control::RecvError::Malformed { .. }) => continue,
        };
        match request {
            Request::Exec {
                id,
                user: ref for_user,
                ..
            } => {
                if fds.len() != EXEC_FDS {
                    // Without its event pipe there is no one to tell; its end closes.
                    continue;
                }
                let events = fds[EXEC_FDS - 1].as_fd();
                let refuse = match &confined {
                    Err(why) => Some(why.clone()),
                    Ok(_) if for_user.as_ref() != user => {
                        Some(format!("exec {id} is for another user than this starter's"))
                    }
                    Ok(_) => None,
                };
                if let Some(why) = refuse {
                    write_event(events, &not_started(id, why));
                    continue;
                }
                // SAFETY: the starter is single-threaded.
                match unsafe { fork() } {
                    Ok(ForkResult::Child) => {
                        drop(sock);
                        if let Some(s) = spare.take() {
                            drop(s.note);
                        }
                        serving.clear();
                        let landlock = child_ruleset(&mut confined);
                        let Ok(fds) = <[OwnedFd; EXEC_FDS]>::try_from(fds) else {
                            std::process::exit(125)
                        };
                        become_reaper();
                        run_reaper(
                            ReaperKit::new(config, None),
                            request,
                            fds,
                            &landlock,
                            None,
                            false,
                        );
                        std::process::exit(0)
                    }
                    Ok(ForkResult::Parent { child }) => {
                        reapers.insert(id, child);
                        // Execs side by side: a spare now, for the next one.
                        spare_due = Some(Instant::now());
                    }
                    Err(e) => write_event(events, &not_started(id, format!("fork: {e}"))),
                }
            }
            Request::Signal { id, signal } => ask(&reapers, &mut early, id, Some(signal)),
            Request::KillTree { id } => ask(&reapers, &mut early, id, None),
            Request::KillAll => {
                for pid in reapers.values() {
                    deliver_kill_all(*pid);
                }
            }
            // pid 1's work; never sent here.
            Request::Starter { .. } | Request::Remount { .. } | Request::Merge { .. } => {}
        }
    }
}

/// How long after a spare's first command runs the next spare is forked. A sandbox that runs
/// one exec and is destroyed (a rollout's create, exec, destroy) never pays for a spare it
/// would not use: its fork, its stack touched ahead and its exit were 1.5% of the creation
/// rate's CPU. Execs one after the other need none (the reaper that ran one serves the next);
/// an exec that comes while every reaper is busy gets one forked at once, as before, and the
/// spare follows it without waiting.
const SPARE_AFTER: Duration = Duration::from_millis(50);

/// The longest a starter sleeps without looking at its children.
const IDLE_WAKE: Duration = Duration::from_millis(200);

/// What a reaper tells its starter on its note.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Note {
    /// It took exec `.0`: that exec's kills and signals go to it from now on.
    Took(u64),
    /// Its first command runs: the starter forks the next spare.
    Running,
}

/// What [`read_note`] found of a reaper.
#[derive(Debug, PartialEq, Eq)]
enum NoteState {
    /// Nothing new, or only the execs it took.
    Open,
    /// Its first command runs.
    Running,
    /// It closed its end: it exited.
    Closed,
}

/// Reads what a reaper says (the execs it took), applying a kill that came for such an exec
/// before.
fn read_note(
    reaper: &mut Spare,
    buf: &mut Vec<u8>,
    reapers: &mut HashMap<u64, Pid>,
    early: &mut Early,
) -> NoteState {
    let mut state = NoteState::Open;
    loop {
        match control::try_recv::<Note>(reaper.note.as_fd(), buf) {
            Ok(control::Received::Message(Note::Took(id), _)) => {
                // One exec at a time: the one it ran before is over.
                reapers.retain(|_, p| *p != reaper.pid);
                reapers.insert(id, reaper.pid);
                early.retain(|(for_id, signal)| {
                    let now = *for_id == id;
                    if now {
                        deliver(reaper.pid, id, *signal);
                    }
                    !now
                });
            }
            Ok(control::Received::Message(Note::Running, _)) => state = NoteState::Running,
            Ok(control::Received::Nothing) => return state,
            Ok(control::Received::Closed) | Err(_) => return NoteState::Closed,
        }
    }
}

/// Forks the next exec's reaper and hands the runtime its socket ([`Event::Reaper`]). None
/// when the starter is not confined (every exec is refused) or the fork failed; the starter
/// exits when the runtime's end is gone.
fn fork_spare(
    config: &InitConfig,
    link: &OwnedFd,
    confined: &mut Result<crate::landlock_rules::Prepared, String>,
) -> Option<Spare> {
    confined.as_ref().ok()?;
    let (runtime_end, exec_end) = seqpacket_pair().ok()?;
    let (note, note_end) = seqpacket_pair().ok()?;
    // SAFETY: the starter is single-threaded.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            let _ = nix::unistd::close(link.as_raw_fd());
            drop(runtime_end);
            drop(note);
            spare_main(config, exec_end, note_end, child_ruleset(confined))
        }
        Ok(ForkResult::Parent { child }) => {
            drop((exec_end, note_end));
            if control::send(link.as_fd(), &Event::Reaper, &[runtime_end.as_raw_fd()]).is_err() {
                // The runtime is gone.
                let _ = kill(child, Signal::SIGKILL);
                std::process::exit(0);
            }
            Some(Spare { pid: child, note })
        }
        Err(_) => None,
    }
}

/// What every reaper does first: it is the subreaper of its exec's processes; a SIGUSR1 asks it
/// to kill them and [`request_signal`] to pass a signal on to its command (both still blocked,
/// inherited so from pid 1).
fn become_reaper() {
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let action = SigAction::new(
        SigHandler::Handler(on_usr1),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let _ = unsafe { nix::sys::signal::sigaction(Signal::SIGUSR1, &action) };
    // SAFETY: a sigaction of plain data; the handler only updates an atomic.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_forward as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(request_signal(), &act, std::ptr::null_mut());
    }
}

/// How many execs one reaper serves before it exits and the spare takes over: what a command
/// allocates before its exec stays in the reaper's memory (it shares it until then), a few
/// KiB each time.
const REAPER_EXECS: u32 = 256;

/// A reaper forked ahead of its exec: readies what it can, then waits for the exec from the
/// runtime (or for the starter to go, and with it the reason to wait), and after it for the
/// next on the same socket, up to [`REAPER_EXECS`]: neither a fork nor an exit (with the page
/// tables and TLB shootdowns of both) is then on an exec's way or beside it. It tells the
/// starter each exec it takes (`Took` on `note`) and, once, that its first command runs.
/// Never returns.
fn spare_main(
    config: &InitConfig,
    exec_sock: OwnedFd,
    note: OwnedFd,
    landlock: crate::landlock_rules::Prepared,
) -> ! {
    become_reaper();
    // What the exec needs, made now: its page faults and system calls are then off its way.
    let mut kit = ReaperKit::new(config, None);
    if let Ok(kit) = &kit {
        kit.stack.touch();
    }
    let mut buf = vec![0u8; control::INLINE_MAX];
    for served in 0..REAPER_EXECS {
        let (request, fds) = loop {
            let mut fds = [
                PollFd::new(exec_sock.as_fd(), PollFlags::POLLIN),
                PollFd::new(note.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(_) => std::process::exit(0),
            }
            // The starter's end closed: it is gone, and so is the runtime's use for this
            // reaper.
            if fds[1].any().unwrap_or(false) {
                std::process::exit(0);
            }
            match control::recv::<Request>(exec_sock.as_fd(), &mut buf) {
                Ok(Some(r)) => break r,
                // The runtime let it go (a restore, the sandbox's end, enough idle reapers)
                // or sent nonsense.
                _ => std::process::exit(0),
            }
        };
        if !matches!(request, Request::Exec { .. }) {
            std::process::exit(0)
        }
        let Ok(fds) = <[OwnedFd; EXEC_FDS]>::try_from(fds) else {
            std::process::exit(0)
        };
        let again = served + 1 < REAPER_EXECS;
        let note = Some(Noted {
            note: &note,
            first: served == 0,
        });
        match run_reaper(kit, request, fds, &landlock, note, again) {
            Some(stack) if again => kit = ReaperKit::new(config, Some(stack)),
            _ => std::process::exit(0),
        }
    }
    std::process::exit(0)
}

/// What a reaper makes before its command: the status pipe, the command's stack, and its copy
/// of the sandbox's config (the exec's argv, cwd and environment go into it).
struct ReaperKit {
    status: (OwnedFd, OwnedFd),
    stack: CommandStack,
    config: InitConfig,
}

impl ReaperKit {
    /// A kit on `stack` (the last exec's), or on a new one.
    fn new(config: &InitConfig, stack: Option<CommandStack>) -> Result<ReaperKit, String> {
        let stack = match stack {
            Some(stack) => stack,
            None => CommandStack::new().map_err(|e| format!("mmap: {e}"))?,
        };
        Ok(ReaperKit {
            status: nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| format!("pipe: {e}"))?,
            stack,
            config: config.clone(),
        })
    }
}

/// A spare's note to its starter, and whether this is its first exec.
struct Noted<'a> {
    note: &'a OwnedFd,
    first: bool,
}

impl Noted<'_> {
    /// Tells the starter which exec this reaper took and, on its first, that the command runs.
    /// Sent once the command has exec'd: the wake-up of the starter is then off the exec's way
    /// (a request for the exec that comes before waits in the starter, as it always could).
    fn took(&self, id: u64) {
        let _ = control::send(self.note.as_fd(), &Note::Took(id), &[]);
        if self.first {
            let _ = control::send(self.note.as_fd(), &Note::Running, &[]);
        }
    }
}

/// A reaper with its exec: starts and reaps it (see [`reap_exec`]); its command applies a copy
/// of `landlock`. `note` (a spare's) is told of the exec once the command runs. `again`: the
/// reaper will wait for another exec, which its end says. Returns the command's stack for the
/// next exec, or None when this reaper must exit.
fn run_reaper(
    kit: Result<ReaperKit, String>,
    request: Request,
    [stdin, stdout, stderr, events]: [OwnedFd; EXEC_FDS],
    landlock: &crate::landlock_rules::Prepared,
    note: Option<Noted<'_>>,
    again: bool,
) -> Option<CommandStack> {
    let Request::Exec {
        id, argv, cwd, env, ..
    } = request
    else {
        return None;
    };
    // Requests for this exec are taken from here on; a kill-all of the wait before is not.
    CURRENT_EXEC.store(id, Ordering::SeqCst);
    drop_pending_kill_all();
    // SAFETY: sigprocmask on this thread's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &reaper_signals(), std::ptr::null_mut()) };
    let prepared = kit.and_then(|kit| {
        let landlock = landlock
            .try_clone()
            .map_err(|e| format!("cannot copy the Landlock ruleset: {e}"))?;
        Ok((kit, landlock))
    });
    let (mut kit, landlock) = match prepared {
        Ok(p) => p,
        Err(why) => {
            if let Some(note) = &note {
                note.took(id);
            }
            write_event(events.as_fd(), &not_started(id, why));
            return None;
        }
    };
    kit.config.argv = argv;
    kit.config.cwd = PathBuf::from(cwd);
    kit.config.env = env;
    Some(reap_exec(
        id,
        kit,
        [stdin, stdout, stderr],
        events,
        landlock,
        note,
        again,
    ))
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

/// The signals (by number, a bit each) to pass on to the command, set by [`on_forward`].
static TO_FORWARD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The exec this reaper runs now: requests ([`deliver`]) for another are dropped.
static CURRENT_EXEC: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_forward(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; sigqueue set its value.
    let value = unsafe { (*info).si_value().sival_ptr as usize };
    match request_of(value, CURRENT_EXEC.load(Ordering::SeqCst)) {
        Some(0) => KILL_REQUESTED.store(true, Ordering::SeqCst),
        Some(signal) => {
            TO_FORWARD.fetch_or(1 << signal, Ordering::SeqCst);
        }
        None => {}
    }
}

/// What a request's value ([`request_value`]) asks of a reaper running exec `current`: its
/// tree killed (`Some(0)`), a signal passed on (`Some(n)`), or nothing (it is for another
/// exec, or names no signal a process can get).
fn request_of(value: usize, current: u64) -> Option<u32> {
    let value = value as u64;
    let (id, signal) = (value >> 8, (value & 0xff) as u32);
    (id == current & (u64::MAX >> 8) && signal < 64).then_some(signal)
}

/// Drops a kill-all (SIGUSR1) that came while this reaper waited between execs: it was for the
/// execs running then, not for the one starting. Called with the reaper's signals blocked.
fn drop_pending_kill_all() {
    // SAFETY: sigemptyset/sigaddset fill a set on this stack; sigtimedwait with a zero timeout
    // only takes a pending signal of that set, if there is one.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        while libc::sigtimedwait(&set, std::ptr::null_mut(), &zero) > 0 {}
    }
}

/// Sends the command what was asked for since the last call.
fn forward_to(command: Pid) {
    let mut pending = TO_FORWARD.swap(0, Ordering::SeqCst);
    while pending != 0 {
        let signal = pending.trailing_zeros() as i32;
        pending &= pending - 1;
        // SAFETY: kill with plain values.
        unsafe { libc::kill(command.as_raw(), signal) };
    }
}

/// The exec reaper (E): starts the command, forwards its confinement report, and reports the
/// exec's start and, once every process of the exec is gone, its end on `events` (with
/// `reusable` as `again`). Returns the command's stack, with the reaper's signals blocked
/// again and nothing of the exec left.
fn reap_exec(
    id: u64,
    kit: ReaperKit,
    stdio: [OwnedFd; 3],
    events: OwnedFd,
    landlock: crate::landlock_rules::Prepared,
    note: Option<Noted<'_>>,
    again: bool,
) -> CommandStack {
    let ReaperKit {
        status: (status_read, status_write),
        stack,
        config,
    } = kit;
    let config = &config;
    let emit = |event: &Event| write_event(events.as_fd(), event);
    let fail_early = |why: String| -> ! {
        emit(&not_started(id, why));
        std::process::exit(0)
    };
    let command = match spawn_command(config, &stdio, status_write.as_raw_fd(), landlock, &stack) {
        Ok(pid) => Pid::from_raw(pid),
        Err(e) => fail_early(format!("clone: {e}")),
    };
    // The command's output pipes stay open here until the exec's end is written: the runtime then
    // sees the output end and the exec's end at once, not one after the other.
    let [stdin, stdout, stderr] = stdio;
    drop(stdin);
    let output = (stdout, stderr);
    drop(status_write);
    // The command has exec'd (or failed to): the starter learns the exec is this reaper's, and
    // may fork the next spare.
    if let Some(note) = &note {
        note.took(id);
    }
    // What was asked for before the command existed.
    forward_to(command);
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
                forward_to(command);
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
        forward_to(command);
        if KILL_REQUESTED.swap(false, Ordering::SeqCst) {
            kill_children(&mut main);
            continue;
        }
        if !reap_one(&mut main) {
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
        reusable: again,
    });
    // The end of the pipes, now: the runtime need not wait for this process's own exit.
    drop(events);
    drop(output);
    // Between execs requests wait (blocked), and none of this exec's is left to act on.
    // SAFETY: sigprocmask on this thread's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &reaper_signals(), std::ptr::null_mut()) };
    KILL_REQUESTED.store(false, Ordering::SeqCst);
    TO_FORWARD.store(0, Ordering::SeqCst);
    stack
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
    // SAFETY: taken once, here; the reaper drops its copy only once this process has exec'd or
    // exited (CLONE_VFORK), and then in its own descriptor table.
    let landlock = unsafe { std::mem::ManuallyDrop::take(&mut args.landlock) };
    exec_confined(args.config, landlock)
}

/// The stack of the command's process until its exec, below a guard page.
const COMMAND_STACK: usize = 512 * 1024;

/// How much of the command's stack a spare reaper touches ahead (the command's own use of it
/// before its exec is a few pages).
const STACK_TOUCHED: usize = 32 * 1024;

/// The command's stack: a private mapping with a guard page at its foot.
struct CommandStack {
    base: *mut libc::c_void,
}

impl CommandStack {
    fn new() -> std::io::Result<CommandStack> {
        // SAFETY: a fresh private anonymous mapping; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                COMMAND_STACK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let stack = CommandStack { base };
        // SAFETY: the lowest page of the mapping made above: an overflow faults instead of
        // writing into the reaper's memory below it.
        if unsafe { libc::mprotect(base, 4096, libc::PROT_NONE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// Faults in the top of the stack now rather than on the exec's way.
    fn touch(&self) {
        let top = self.top().cast::<u8>();
        for off in (4096..=STACK_TOUCHED).step_by(4096) {
            // SAFETY: within the mapping, above its guard page (STACK_TOUCHED is far below
            // COMMAND_STACK); a volatile write so it is not optimised away.
            unsafe { top.sub(off).write_volatile(0) };
        }
    }

    /// The stack's top (16-byte aligned), where it starts growing down.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping made in `new`.
        unsafe { self.base.cast::<u8>().add(COMMAND_STACK).cast() }
    }
}

impl Drop for CommandStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; no process runs on it any more (the command has
        // exec'd or exited before clone returns).
        unsafe { libc::munmap(self.base, COMMAND_STACK) };
    }
}

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
    stack: &CommandStack,
) -> std::io::Result<i32> {
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
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::addr_of_mut!(args).cast(),
        )
    };
    let err = std::io::Error::last_os_error();
    // The child took its copy (a bitwise one, in its own descriptor table) and has exec'd or
    // exited: this process's copy of the ruleset's descriptor is its own to close, or every
    // exec of a reaper that serves many would leave one open.
    drop(std::mem::ManuallyDrop::into_inner(args.landlock));
    if pid < 0 {
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

/// What [`wait_child`] found.
#[derive(PartialEq, Eq)]
enum Waited {
    /// A child was reaped (or the wait was interrupted): look again.
    Reaped,
    /// Children are left, none has ended (WNOHANG only).
    Running,
    /// No child is left.
    None,
}

/// Reaps one child (blocking unless `flags` has WNOHANG), recording the main process's status.
fn wait_child(main: &mut MainStatus, flags: i32) -> Waited {
    let mut status = 0;
    // SAFETY: rusage is plain old data; all-zero is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `usage` are valid for writes for the duration of the call.
    let pid = unsafe { libc::wait4(-1, &mut status, libc::__WALL | flags, &mut usage) };
    if pid < 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => Waited::Reaped,
            _ => Waited::None,
        };
    }
    if pid == 0 {
        return Waited::Running;
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
    Waited::Reaped
}

/// Reaps one child, blocking: false when there is nothing (left) to reap.
fn reap_one(main: &mut MainStatus) -> bool {
    wait_child(main, 0) == Waited::Reaped
}

/// Kills every descendant: orphans of the exec re-parent to this subreaper, so repeating "reap
/// what ended, kill my children, reap them" until no child is left reaches the whole tree,
/// however it forked. With nothing left (the common case) it costs one wait.
fn kill_children(main: &mut MainStatus) {
    loop {
        match wait_child(main, libc::WNOHANG) {
            Waited::Reaped => continue,
            Waited::None => return,
            Waited::Running => {}
        }
        let kids = children();
        if kids.is_empty() {
            // Alive by wait4 and not yet listed: look again.
            std::thread::yield_now();
            continue;
        }
        for pid in &kids {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        for _ in &kids {
            if !reap_one(main) {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reaches_only_the_exec_it_names() {
        for (id, signal) in [(1u64, 0), (1, 15), (7, 9), (300, 2), (u64::MAX >> 9, 63)] {
            let v = request_value(id, signal);
            assert_eq!(request_of(v, id), Some(signal as u32), "{id} {signal}");
            // The reaper has moved on to the next exec, or has not taken this one yet.
            assert_eq!(request_of(v, id + 1), None, "{id} {signal}");
            assert_eq!(request_of(v, id.wrapping_sub(1)), None, "{id} {signal}");
        }
        // No signal number past the kernel's.
        assert_eq!(request_of(request_value(5, 64), 5), None);
        assert_eq!(request_of(request_value(5, 200), 5), None);
    }
}
