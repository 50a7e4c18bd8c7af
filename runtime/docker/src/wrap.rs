//! taskbox's in-container init and exec wrapper: one small static program, std only (built by
//! the crate's build.rs with rustc alone, so it cannot use crates), bind-mounted read-only into
//! every container at `/.taskbox/init`.
//!
//! `init init`: the container's pid 1. Reaps every orphan that is reparented to it and exits on
//! SIGTERM or SIGINT (the kernel then kills whatever is left in the container).
//!
//! `init exec ID CWD [--merge] -- ARGV...`: the wrapper of one exec, started by `docker exec`
//! (with `--merge` the command's stderr is its stdout, `2>&1`). It makes
//! itself a child subreaper, starts ARGV in its own session in CWD, and waits. When the command
//! ends, or on SIGUSR1/SIGTERM (the backend's kill and timeout), it SIGKILLs every remaining
//! descendant (double-forked daemons included: orphans are reparented to it, and it finds the
//! rest by walking /proc), reaps them, writes the status file `/.taskbox/run/ID.status` and exits
//! with the command's code (128+N for signal N). The status file is the exact report, one line:
//!
//! ```text
//! exit CODE CPU_MS MAX_RSS_BYTES      the command exited with CODE
//! signal SIG CPU_MS MAX_RSS_BYTES     a signal SIG killed it
//! execfail ERRNO                      execvp failed (ENOENT: command not found)
//! cwd ERRNO                           the working directory could not be entered
//! ```
//!
//! The exit code alone could not tell `exit 137` from SIGKILL; the file can. The command runs
//! under the same uid and could forge its own status file: that only misreports its own result,
//! never anything outside the sandbox.
//!
//! The few libc calls needed are declared here by hand; the constants are the same on x86_64 and
//! aarch64 Linux.

#![allow(unsafe_code)]

use std::ffi::{CString, c_char, c_int, c_long, c_void};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;

type Pid = c_int;

#[repr(C)]
struct SigSet([u64; 16]);

#[repr(C)]
struct Timeval {
    sec: c_long,
    usec: c_long,
}

#[repr(C)]
struct Rusage {
    utime: Timeval,
    stime: Timeval,
    maxrss: c_long,
    rest: [c_long; 13],
}

unsafe extern "C" {
    fn fork() -> Pid;
    fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int;
    fn _exit(code: c_int) -> !;
    fn setsid() -> Pid;
    fn chdir(path: *const c_char) -> c_int;
    fn dup2(old: c_int, new: c_int) -> c_int;
    fn pipe2(fds: *mut c_int, flags: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize;
    fn write(fd: c_int, buf: *const c_void, n: usize) -> isize;
    fn close(fd: c_int) -> c_int;
    fn waitpid(pid: Pid, status: *mut c_int, options: c_int) -> Pid;
    fn kill(pid: Pid, sig: c_int) -> c_int;
    fn getpid() -> Pid;
    fn prctl(option: c_int, ...) -> c_int;
    fn sigemptyset(set: *mut SigSet) -> c_int;
    fn sigaddset(set: *mut SigSet, sig: c_int) -> c_int;
    fn sigprocmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
    fn sigwaitinfo(set: *const SigSet, info: *mut [u8; 128]) -> c_int;
    fn getrusage(who: c_int, usage: *mut Rusage) -> c_int;
}

const SIGHUP: c_int = 1;
const SIGINT: c_int = 2;
const SIGKILL: c_int = 9;
const SIGUSR1: c_int = 10;
const SIGTERM: c_int = 15;
const SIGCHLD: c_int = 17;
const SIG_BLOCK: c_int = 0;
const SIG_SETMASK: c_int = 2;
const WNOHANG: c_int = 1;
const PR_SET_CHILD_SUBREAPER: c_int = 36;
const O_CLOEXEC: c_int = 0o2000000;
const RUSAGE_CHILDREN: c_int = -1;
const EPERM: c_int = 1;
const ENOENT: c_int = 2;
const EINTR: c_int = 4;
const ECHILD: c_int = 10;

const RUN_DIR: &str = "/.taskbox/run";

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn die(msg: &str) -> ! {
    let _ = writeln!(std::io::stderr(), "taskbox-init: {msg}");
    std::process::exit(125)
}

fn signal_set(signals: &[c_int]) -> SigSet {
    let mut set = SigSet([0; 16]);
    // SAFETY: `set` is a valid, writable sigset_t-sized buffer.
    unsafe {
        sigemptyset(&mut set);
        for &s in signals {
            sigaddset(&mut set, s);
        }
    }
    set
}

/// Blocks `signals` and returns the set, for sigwaitinfo.
fn block(signals: &[c_int]) -> SigSet {
    let set = signal_set(signals);
    // SAFETY: `set` is a valid sigset_t; the old mask is not asked for.
    unsafe { sigprocmask(SIG_BLOCK, &set, std::ptr::null_mut()) };
    set
}

fn wait_signal(set: &SigSet) -> c_int {
    let mut info = [0u8; 128];
    loop {
        // SAFETY: `set` is a valid sigset_t and `info` has the size of siginfo_t.
        let sig = unsafe { sigwaitinfo(set, &mut info) };
        if sig > 0 {
            return sig;
        }
        if errno() != EINTR {
            die("sigwaitinfo failed");
        }
    }
}

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match args.get(1).map(|a| a.as_bytes()) {
        Some(b"init") => init(),
        Some(b"exec") => exec(&args[2..]),
        _ => die("usage: init init | init exec ID CWD [--merge] -- ARGV..."),
    }
}

/// pid 1: reap orphans, exit on SIGTERM/SIGINT.
fn init() -> ! {
    let set = block(&[SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGUSR1]);
    loop {
        match wait_signal(&set) {
            SIGCHLD => reap_all(None),
            SIGTERM | SIGINT => std::process::exit(0),
            _ => {}
        }
    }
}

/// Reaps every child that has ended; records `main`'s wait status when it is among them.
fn reap_all(mut main: Option<(&mut Pid, &mut Option<c_int>)>) {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid place for the kernel to write.
        let pid = unsafe { waitpid(-1, &mut status, WNOHANG) };
        if pid <= 0 {
            return;
        }
        if let Some((main_pid, main_status)) = main.as_mut()
            && pid == **main_pid
        {
            **main_status = Some(status);
        }
    }
}

/// Whether this process has any child left (ended or not). A child it reaps meanwhile is
/// recorded as [`reap_all`] records it: `main` can end between the two (the backend also
/// kills the tree from the host), and its status must not be lost.
fn has_children(main: &mut Pid, main_status: &mut Option<c_int>) -> bool {
    let mut status = 0;
    // SAFETY: as in reap_all; WNOHANG never blocks. -1 with ECHILD: no children at all.
    let pid = unsafe { waitpid(-1, &mut status, WNOHANG) };
    if pid > 0 && pid == *main {
        *main_status = Some(status);
    }
    !(pid < 0 && errno() == ECHILD)
}

/// The live (not zombie) descendants of this process, from /proc.
fn descendants() -> Vec<Pid> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { getpid() };
    let mut parent_of: Vec<(Pid, Pid)> = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<Pid>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "PID (COMM) STATE PPID ...": COMM may hold anything; parse after the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        let ppid = fields.next().and_then(|p| p.parse::<Pid>().ok()).unwrap_or(0);
        if state != "Z" {
            parent_of.push((pid, ppid));
        }
    }
    let mut found = vec![me];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        for &(child, parent) in &parent_of {
            if parent == p && !found.contains(&child) {
                found.push(child);
            }
        }
        i += 1;
    }
    found.remove(0);
    found
}

/// SIGKILLs every descendant until none is left, reaping as they end. Descendants this
/// process may not signal (a command as root with `setuid` but not `kill` became another user)
/// are left after a while, for the backend to kill from the host: they are reparented to the
/// container's pid 1 once this process exits.
fn kill_tree(main: &mut Pid, main_status: &mut Option<c_int>) {
    let mut refused_rounds = 0;
    loop {
        reap_all(Some((main, main_status)));
        let live = descendants();
        if live.is_empty() {
            if !has_children(main, main_status) {
                return;
            }
        } else {
            let mut refused = true;
            for pid in live {
                // SAFETY: kill has no memory arguments.
                if unsafe { kill(pid, SIGKILL) } == 0 || errno() != EPERM {
                    refused = false;
                }
            }
            refused_rounds = if refused { refused_rounds + 1 } else { 0 };
            if refused_rounds > REFUSED_ROUNDS {
                return;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Rounds of [`kill_tree`] in which every kill was refused before it gives up (about 200 ms).
const REFUSED_ROUNDS: u32 = 200;

fn write_status(id: &str, line: &str) {
    let tmp = format!("{RUN_DIR}/.{id}.tmp");
    let path = format!("{RUN_DIR}/{id}.status");
    if std::fs::write(&tmp, line).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

fn cstring(b: &[u8]) -> CString {
    CString::new(b).unwrap_or_else(|_| die("an argument contains a NUL byte"))
}

/// The exec wrapper.
fn exec(args: &[std::ffi::OsString]) -> ! {
    let merge = args.get(2).is_some_and(|a| a.as_bytes() == b"--merge");
    let args: Vec<std::ffi::OsString> = if merge {
        args[..2].iter().chain(&args[3..]).cloned().collect()
    } else {
        args.to_vec()
    };
    if args.len() < 4 || args[2].as_bytes() != b"--" {
        die("usage: init exec ID CWD [--merge] -- ARGV...");
    }
    let id = args[0].to_string_lossy().into_owned();
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        die("the exec id must be a number");
    }
    let cwd = cstring(args[1].as_bytes());
    let argv: Vec<CString> = args[3..].iter().map(|a| cstring(a.as_bytes())).collect();
    let mut argv_ptrs: Vec<*const c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());

    // SAFETY: prctl with integer arguments only.
    unsafe { prctl(PR_SET_CHILD_SUBREAPER, 1 as c_long, 0 as c_long, 0 as c_long, 0 as c_long) };
    let set = block(&[SIGCHLD, SIGTERM, SIGUSR1, SIGINT, SIGHUP]);
    let mut fds = [0 as c_int; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { pipe2(fds.as_mut_ptr(), O_CLOEXEC) } != 0 {
        die("pipe2 failed");
    }
    // SAFETY: this process is single-threaded; the child only makes raw syscalls on memory
    // prepared before the fork, then execs or _exits.
    let child = unsafe { fork() };
    if child < 0 {
        die("fork failed");
    }
    if child == 0 {
        let empty = signal_set(&[]);
        // SAFETY: raw syscalls on valid buffers and NUL-terminated strings prepared before the
        // fork; the child ends in execvp or _exit.
        unsafe {
            sigprocmask(SIG_SETMASK, &empty, std::ptr::null_mut());
            close(fds[0]);
            if merge {
                dup2(1, 2);
            }
            setsid();
            let (kind, err): (u8, c_int) = if chdir(cwd.as_ptr()) != 0 {
                (b'c', errno())
            } else {
                execvp(argv_ptrs[0], argv_ptrs.as_ptr());
                (b'x', errno())
            };
            let msg = [kind, err as u8, (err >> 8) as u8];
            write(fds[1], msg.as_ptr().cast(), msg.len());
            _exit(if err == ENOENT { 127 } else { 126 });
        }
    }
    // SAFETY: closing our copy of the write end; reading into a valid 3-byte buffer.
    let failed = unsafe {
        close(fds[1]);
        let mut msg = [0u8; 3];
        let mut got = 0usize;
        loop {
            let n = read(fds[0], msg[got..].as_mut_ptr().cast(), 3 - got);
            if n > 0 {
                got += n as usize;
                if got == 3 {
                    break;
                }
            } else if n == 0 || errno() != EINTR {
                break;
            }
        }
        close(fds[0]);
        (got == 3).then(|| (msg[0], c_int::from(msg[1]) | (c_int::from(msg[2]) << 8)))
    };
    let mut main = child;
    let mut main_status: Option<c_int> = None;
    if let Some((kind, err)) = failed {
        kill_tree(&mut main, &mut main_status);
        let what = if kind == b'c' { "cwd" } else { "execfail" };
        write_status(&id, &format!("{what} {err}\n"));
        std::process::exit(if err == ENOENT { 127 } else { 126 });
    }
    while main_status.is_none() {
        match wait_signal(&set) {
            SIGCHLD => reap_all(Some((&mut main, &mut main_status))),
            _ => kill_tree(&mut main, &mut main_status),
        }
    }
    // Nothing of the exec outlives its main process.
    kill_tree(&mut main, &mut main_status);
    let mut usage = Rusage {
        utime: Timeval { sec: 0, usec: 0 },
        stime: Timeval { sec: 0, usec: 0 },
        maxrss: 0,
        rest: [0; 13],
    };
    // SAFETY: `usage` has the layout of struct rusage.
    unsafe { getrusage(RUSAGE_CHILDREN, &mut usage) };
    let cpu_ms = (usage.utime.sec + usage.stime.sec) * 1000
        + (usage.utime.usec + usage.stime.usec) / 1000;
    let rss = usage.maxrss.max(0) * 1024;
    let status = main_status.unwrap_or(0);
    let (line, code) = if status & 0x7f == 0 {
        let code = (status >> 8) & 0xff;
        (format!("exit {code} {cpu_ms} {rss}\n"), code)
    } else {
        let sig = status & 0x7f;
        (format!("signal {sig} {cpu_ms} {rss}\n"), 128 + sig)
    };
    write_status(&id, &line);
    std::process::exit(code)
}
