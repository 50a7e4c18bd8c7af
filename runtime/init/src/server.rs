//! Long-lived mode of the sandbox's pid 1: serve exec requests on the control socket.
//!
//! Each exec gets its own reaper process (E), a child subreaper of pid 1: every process the
//! command starts, however it daemonises, stays beneath E, so E can kill exactly that exec's
//! tree (on request, on timeout, and always once the command's main process has ended) and
//! report the status only when nothing of the exec is left.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, dup2, fork};

use crate::command::{exec_command, fail};
use crate::config::{InitConfig, STATUS_FD, Status};
use crate::control::{self, CONTROL_FD, Event, Request};
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
pub fn serve(config: &InitConfig) -> ! {
    // SIGUSR1 asks an exec reaper to kill its tree. Blocked here so a reaper inherits it blocked
    // and cannot die of it before installing its handler.
    let mut usr1 = SigSet::empty();
    usr1.add(Signal::SIGUSR1);
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&usr1), None);

    emit(&Event::Ready);
    let mut reapers: HashMap<u64, Pid> = HashMap::new();
    let mut buf = Vec::new();
    loop {
        // Collect reapers that ended (and any orphan that reached pid 1 despite the subreapers).
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
            // A message that cannot be read is answered (for its exec, when its id can be
            // read, so the runtime does not wait for it); a broken socket ends the sandbox
            // (spinning on it would only burn CPU).
            Err(control::RecvError::Malformed { reason, exec_id }) => {
                let message = format!("bad control message: {reason}");
                match exec_id {
                    Some(id) => emit(&Event::Exited {
                        id,
                        code: None,
                        signal: None,
                        landlock: "none".into(),
                        seccomp: false,
                        exec_failed: None,
                        setup_error: Some(message),
                        cpu_ms: 0,
                        max_rss_bytes: 0,
                        file_size_exceeded: false,
                    }),
                    None => emit(&Event::Error { message }),
                }
                continue;
            }
            Err(control::RecvError::Channel(_)) => std::process::exit(125),
        };
        match request {
            Request::Exec { id, argv, cwd, env } => {
                let Ok(stdio) = <[OwnedFd; 3]>::try_from(fds) else {
                    emit(&Event::Exited {
                        id,
                        code: None,
                        signal: None,
                        landlock: "none".into(),
                        seccomp: false,
                        exec_failed: None,
                        setup_error: Some("exec request without its three descriptors".into()),
                        cpu_ms: 0,
                        max_rss_bytes: 0,
                        file_size_exceeded: false,
                    });
                    continue;
                };
                let mut exec_config = config.clone();
                exec_config.argv = argv;
                exec_config.cwd = PathBuf::from(cwd);
                exec_config.env = env;
                // SAFETY: pid 1 is single-threaded.
                match unsafe { fork() } {
                    Ok(ForkResult::Child) => reap_exec(id, &exec_config, stdio),
                    Ok(ForkResult::Parent { child }) => {
                        reapers.insert(id, child);
                    }
                    Err(e) => emit(&Event::Exited {
                        id,
                        code: None,
                        signal: None,
                        landlock: "none".into(),
                        seccomp: false,
                        exec_failed: None,
                        setup_error: Some(format!("fork: {e}")),
                        cpu_ms: 0,
                        max_rss_bytes: 0,
                        file_size_exceeded: false,
                    }),
                }
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
            Request::Remount { path, ops } => {
                let error = remount(Path::new(&path), &ops).err();
                drop(fds);
                emit(&Event::Remounted { error });
            }
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
fn reap_exec(id: u64, config: &InitConfig, stdio: [OwnedFd; 3]) -> ! {
    let fail_early = |why: String| -> ! {
        emit(&Event::Exited {
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
        });
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
    // SAFETY: E is single-threaded.
    let command = match unsafe { fork() } {
        Err(e) => fail_early(format!("fork: {e}")),
        Ok(ForkResult::Child) => {
            for (fd, target) in stdio.iter().zip(0..) {
                if dup2(fd.as_raw_fd(), target).is_err() {
                    std::process::exit(125);
                }
            }
            // The command reports its confinement on fd 3, a pipe to this reaper.
            if dup2(status_write.as_raw_fd(), STATUS_FD).is_err() {
                std::process::exit(125);
            }
            let _ = crate::sys::set_cloexec(STATUS_FD);
            exec_command(config)
        }
        Ok(ForkResult::Parent { child }) => child,
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
