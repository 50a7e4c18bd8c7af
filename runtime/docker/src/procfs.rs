//! What the backend reads about a container's processes from the host's /proc: whether its pid
//! 1 still runs, which process is an exec's wrapper, the processes left to kill when a wrapper
//! is gone, and every process but pid 1 before a restore. The backend runs as root in the host's
//! pid namespace.

use std::fs;

/// Where the exec wrapper is mounted in every container (the first word of its processes'
/// command lines, which is how they are found here).
pub const INIT_PATH: &str = "/.taskbox/init";

/// A process named by pid and start time, so a reused pid is not mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId {
    pub pid: i32,
    pub start: u64,
}

/// Fields of /proc/PID/stat after the command name: (state, ppid, starttime).
fn stat(pid: i32) -> Option<(char, i32, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state(0) ppid(1) ... starttime is field 22 of the line, 19 here.
    Some((
        f.first()?.chars().next()?,
        f.get(1)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

impl ProcId {
    pub fn of(pid: i32) -> Option<ProcId> {
        stat(pid).map(|(_, _, start)| ProcId { pid, start })
    }
}

/// Whether the process still runs (not a zombie, same start time).
pub fn alive(p: &ProcId) -> bool {
    matches!(stat(p.pid), Some((state, _, start)) if start == p.start && state != 'Z' && state != 'X')
}

fn cmdline(pid: i32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `pid` is the wrapper of exec `exec_id` (`/.taskbox/init exec ID ...`).
pub fn is_wrapper_of(pid: i32, exec_id: u64) -> bool {
    let c = cmdline(pid);
    c.len() > 3 && c[0] == INIT_PATH && c[1] == "exec" && c[2] == exec_id.to_string()
}

fn is_wrapper(pid: i32) -> bool {
    let c = cmdline(pid);
    c.len() > 3 && c[0] == INIT_PATH && c[1] == "exec"
}

/// The children of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    if let Ok(s) = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        return s
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
    }
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir("/proc") {
        for e in rd.flatten() {
            if let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok())
                && stat(p).is_some_and(|(_, ppid, _)| ppid == pid)
            {
                out.push(p);
            }
        }
    }
    out
}

/// `pid` and every descendant, parents first.
fn tree(pid: i32) -> Vec<i32> {
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        for c in children(found[i]) {
            if !found.contains(&c) {
                found.push(c);
            }
        }
        i += 1;
    }
    found
}

/// From the host: SIGKILLs exec `exec_id`'s wrapper and its tree if it is still there, and every
/// process reparented to the container's pid 1 (the orphans of wrappers that died).
pub fn kill_orphans(init: &ProcId, exec_id: u64) {
    if !alive(init) {
        return;
    }
    for _ in 0..50 {
        let mut victims = Vec::new();
        for c in children(init.pid) {
            if is_wrapper(c) && !is_wrapper_of(c, exec_id) {
                continue;
            }
            victims.extend(tree(c));
        }
        if victims.is_empty() {
            return;
        }
        for p in victims {
            // SAFETY: kill has no memory arguments; every pid is a descendant of the container's
            // pid 1, checked just above.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// From the host: SIGKILLs every descendant of exec wrapper `wrapper` (not the wrapper, which
/// then reports how the command ended) that lives in the pid namespace of the container's pid
/// 1, whatever its user.
pub fn kill_descendants(wrapper: i32, init: &ProcId) {
    let Some(ns) = pid_ns(init.pid) else {
        return;
    };
    for pid in tree(wrapper).into_iter().skip(1) {
        kill_in_ns(pid, &ns);
    }
}

/// The pid namespace `pid` lives in (the target of `/proc/PID/ns/pid`).
fn pid_ns(pid: i32) -> Option<std::path::PathBuf> {
    fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// SIGKILLs `pid` if it still lives in the pid namespace `ns`: through a pidfd, so a pid that
/// ends and is reused meanwhile is never signalled.
fn kill_in_ns(pid: i32, ns: &std::path::Path) {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let Ok(fd) = i32::try_from(fd) else {
        return;
    };
    if fd < 0 {
        return;
    }
    // SAFETY: `fd` was just returned by pidfd_open and is owned by nothing else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // Checked after the pidfd holds the process: a reused pid is another process's, whose
    // namespace differs or whose signal goes to the (ended) process the pidfd names.
    if pid_ns(pid).as_deref() == Some(ns) {
        // SAFETY: pidfd_send_signal on a descriptor we own, with no siginfo and no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

/// From the host: SIGKILLs every process of the container but its pid 1 (every process in its
/// pid namespace), whatever its parent or command line, until none is left (or a second has
/// passed). A restore does this before it mounts the new workspace, so nothing of the sandbox
/// runs while the host mounts on paths in it.
pub fn kill_all_but_init(init: &ProcId) {
    if !alive(init) {
        return;
    }
    let Some(ns) = pid_ns(init.pid) else {
        return;
    };
    for _ in 0..100 {
        let mut found = false;
        if let Ok(rd) = fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                if pid != init.pid && pid_ns(pid).as_deref() == Some(ns.as_path()) {
                    // A zombie waits for the container's init to reap it; it runs nothing.
                    if matches!(stat(pid), Some((state, _, _)) if state != 'Z' && state != 'X') {
                        found = true;
                        kill_in_ns(pid, &ns);
                    }
                }
            }
        }
        if !found {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// How often the kernel's OOM killer has struck in the container's memory cgroup.
pub fn oom_kills(init: &ProcId) -> u64 {
    let Ok(cg) = fs::read_to_string(format!("/proc/{}/cgroup", init.pid)) else {
        return 0;
    };
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        let (Some(controllers), Some(path)) = (controllers, path) else {
            continue;
        };
        let file = if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.oom_control")
        } else if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.events")
        } else {
            continue;
        };
        if let Ok(text) = fs::read_to_string(&file) {
            for l in text.lines() {
                if let Some(n) = l.strip_prefix("oom_kill ") {
                    return n.trim().parse().unwrap_or(0);
                }
            }
        }
    }
    0
}

/// The soft stack limit of the container's pid 1, in bytes (`u64::MAX`: unlimited): what an exec
/// gets too, since Docker starts it with the container's process settings.
pub fn stack_limit(init: &ProcId) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{}/limits", init.pid)).ok()?;
    parse_stack_limit(&text)
}

fn parse_stack_limit(limits: &str) -> Option<u64> {
    let rest = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max stack size"))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stack_limit_is_read_from_proc_limits() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max cpu time              unlimited            unlimited            seconds   \n\
                    Max stack size            8388608              unlimited            bytes     \n";
        assert_eq!(parse_stack_limit(text), Some(8 << 20));
        let text = text.replace("8388608 ", "unlimited");
        assert_eq!(parse_stack_limit(&text), Some(u64::MAX));
        assert_eq!(parse_stack_limit("nothing"), None);
        // This process's own, as the kernel shows it.
        let me = ProcId::of(std::process::id() as i32).unwrap();
        assert!(stack_limit(&me).is_some());
    }
}
