//! The fork server of a supervisor's helpers: `taskbox-init --zygote NAME`.
//!
//! An exec'd helper pays for its loading before it does anything: the kernel's ELF loader, the
//! dynamic linker's relocations, glibc's CPU probe (a run of `cpuid`, each one a trap to the
//! hypervisor in a VM) and the Rust runtime's set-up, about a millisecond of CPU per sandbox on
//! a 2-core VM, a seventh of what a create costs there (BENCHMARKS.md, fork section). A
//! supervisor that starts sandboxes one after the other keeps one zygote, which paid for that
//! once, and asks it for each helper ([`crate::config::ZygoteRequest`]):
//!
//! - the zygote is single-threaded, so the process it forks may run any code (as an exec'd
//!   helper's own forks do);
//! - the fork is made with `CLONE_PARENT`: the supervisor is the helper's parent, as it is of an
//!   exec'd helper, and waits for it, kills it and reads its rusage the same way;
//! - the helper puts the request's descriptors on their numbers and closes every other one (the
//!   zygote's socket included), writes its label over the zygote's `NAME` argument, and then
//!   carries out its plan exactly as an exec'd helper does ([`crate::run::run_from_plan_fd`]);
//! - the zygote keeps nothing of a sandbox: it closes the request's descriptors once the helper
//!   is forked, and it never reads a plan;
//! - it exits when the supervisor closes its socket (the supervisor's death included).
//!
//! The supervisor asks it only for long-lived sandboxes' helpers, which end with their control
//! socket: a one-shot helper sets a parent-death signal, and the parent of a `CLONE_PARENT`
//! child is the thread that started the zygote, which may end long before the helper should.
//!
//! What is shared: every helper (and the sandbox processes it forks) has the zygote's address
//! space layout and stack canary, as every process an exec'd helper forks already shares its
//! helper's. The commands are exec'd and get their own. None of these processes reads input
//! from the commands but pid 1's answers to the `--write-through` setid filter's notifications.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use crate::config::{ZYGOTE_FD, ZygoteReply, ZygoteRequest};
use crate::control;

/// The zygote's loop. Never returns: it exits when its socket closes or fails.
pub fn serve() -> ! {
    // SAFETY: the supervisor placed the socket on ZYGOTE_FD for this process alone; it is taken
    // once here and moved above the numbers a helper's descriptors take.
    let given = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(ZYGOTE_FD) };
    let sock = match nix::fcntl::fcntl(
        given.as_raw_fd(),
        nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(LIFT_FLOOR),
    ) {
        // SAFETY: a descriptor just made, owned by nothing else.
        Ok(fd) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
        Err(e) => {
            eprintln!("taskbox-init --zygote: no socket on descriptor {ZYGOTE_FD}: {e}");
            std::process::exit(125)
        }
    };
    drop(given);
    reply(&sock, &ZygoteReply::Ready);
    let mut buf = Vec::new();
    loop {
        let (request, fds) = match control::recv::<ZygoteRequest>(sock.as_fd(), &mut buf) {
            Ok(Some(r)) => r,
            // The supervisor is gone, or the socket broke: nothing more will be asked.
            Ok(None) | Err(control::RecvError::Channel(_)) => std::process::exit(0),
            Err(control::RecvError::Malformed { reason, .. }) => {
                reply(&sock, &ZygoteReply::Failed { error: reason });
                continue;
            }
        };
        let answer = match fork_helper(&request, &fds) {
            Ok(pid) => ZygoteReply::Forked { pid },
            Err(error) => ZygoteReply::Failed { error },
        };
        // The helper has its copies (or there is no helper): the zygote keeps none.
        drop(fds);
        reply(&sock, &answer);
    }
}

fn reply(sock: &OwnedFd, answer: &ZygoteReply) {
    if control::send(sock.as_fd(), answer, &[]).is_err() {
        std::process::exit(0)
    }
}

/// Descriptors are lifted at or above this number before they go to their targets, so that
/// placing one cannot overwrite another still to be placed.
const LIFT_FLOOR: RawFd = 64;

/// The highest number a target may have.
const MAX_TARGET: RawFd = LIFT_FLOOR - 1;

/// Forks the helper of `request` with `fds`; its pid.
fn fork_helper(request: &ZygoteRequest, fds: &[OwnedFd]) -> Result<i32, String> {
    if request.targets.len() != fds.len() {
        return Err(format!(
            "{} descriptor numbers for {} descriptors",
            request.targets.len(),
            fds.len()
        ));
    }
    for (i, &to) in request.targets.iter().enumerate() {
        if !(0..=MAX_TARGET).contains(&to) || request.targets[..i].contains(&to) {
            return Err(format!(
                "descriptor number {to} is out of 0..={MAX_TARGET} or named twice"
            ));
        }
    }
    // SAFETY: a raw clone without CLONE_VM is a fork: the child runs on a copy of this stack and
    // returns from this call with 0. This process is single-threaded, so the child may run any
    // code; see the module documentation for the glibc state it inherits.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    match pid {
        0 => become_helper(request, fds),
        p if p > 0 => Ok(p as i32),
        _ => Err(format!("fork: {}", std::io::Error::last_os_error())),
    }
}

/// The forked helper: its descriptors, its label, then its plan. Never returns.
fn become_helper(request: &ZygoteRequest, fds: &[OwnedFd]) -> ! {
    if let Err(e) = place_descriptors(request, fds) {
        // Nothing of the sandbox exists yet: the supervisor sees the status pipe close.
        eprintln!("taskbox-init: cannot place the helper's descriptors: {e}");
        std::process::exit(125)
    }
    set_label(&request.label);
    crate::run::run_from_plan_fd()
}

/// Puts `fds` on `request.targets` and closes every other descriptor above 2: the zygote's
/// socket, and anything else the zygote held. 0 to 2 not named stay the zygote's own.
fn place_descriptors(request: &ZygoteRequest, fds: &[OwnedFd]) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, fcntl};
    let mut lifted = Vec::with_capacity(fds.len());
    for fd in fds {
        lifted.push(fcntl(
            fd.as_raw_fd(),
            FcntlArg::F_DUPFD_CLOEXEC(LIFT_FLOOR),
        )?);
    }
    for (&from, &to) in lifted.iter().zip(&request.targets) {
        // dup2 onto the target clears its close-on-exec, as an exec'd helper's descriptors are.
        // SAFETY: dup2 on descriptors of this process.
        if unsafe { libc::dup2(from, to) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let mut keep: Vec<RawFd> = request.targets.iter().copied().chain(0..3).collect();
    keep.sort_unstable();
    keep.dedup();
    // Close every gap between the kept numbers, and everything above the last.
    let mut from: RawFd = 0;
    for &k in &keep {
        if k > from {
            crate::sys::close_fds_between(from as u32, (k - 1) as u32);
        }
        from = k + 1;
    }
    crate::sys::close_fds_from(from as u32);
    Ok(())
}

unsafe extern "C" {
    /// glibc's pointer to `argv[0]`; the other arguments follow it in memory, each after the
    /// previous one's NUL.
    static mut program_invocation_name: *mut libc::c_char;
}

/// Writes `- LABEL` over the arguments after `argv[0]` (the zygote's `--zygote NAME`), within
/// their room, NUL-padded: `/proc/PID/cmdline` then reads as an exec'd helper's.
fn set_label(label: &str) {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.len() < 2 {
        return;
    }
    let room: usize = args[1..].iter().map(|a| a.len() + 1).sum();
    let mut text = Vec::with_capacity(room);
    text.extend_from_slice(b"-\0");
    text.extend(label.bytes().filter(|&b| b != 0));
    text.truncate(room - 1);
    text.resize(room, 0);
    // SAFETY: the arguments are the process's own writable memory, contiguous after argv[0]
    // (the kernel lays them out so); exactly their `room` bytes are written, the last one NUL.
    unsafe {
        let argv0 = program_invocation_name;
        if argv0.is_null() {
            return;
        }
        let start = argv0.add(args[0].len() + 1).cast::<u8>();
        std::ptr::copy_nonoverlapping(text.as_ptr(), start, room);
    }
}
