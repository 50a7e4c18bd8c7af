//! The helper's three processes: the outer helper (H), the sandbox's pid 1 (C) and the command (X).

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use nix::sched::{CloneFlags, unshare};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, fork, sethostname};

pub use crate::command::report;
use crate::command::{exec_command_with, fail, reports_file_size_kill};
use crate::config::{
    DISK_FD, DiskPlan, EGRESS_FD, EgressPlan, InitConfig, PLAN_FD, STATUS_FD, Status, USERNS_FD,
};
use crate::{mounts, seccomp, sys};

/// Entry point of the helper: carries out `config` and never returns.
pub fn run(config: &InitConfig) -> ! {
    if let Err(e) = sys::set_cloexec(STATUS_FD) {
        fail("status pipe", e);
    }
    // A one-shot run dies with its caller. A long-lived sandbox dies when its control socket
    // closes instead: the caller may start it from a thread that exits long before it does.
    if !config.control
        && let Err(e) = sys::set_parent_death_signal(libc::SIGKILL)
    {
        fail("parent-death signal", e);
    }
    // "0" is the writer itself. This process has one thread, so on v1 writing it to `tasks` moves
    // the whole process without the global threadgroup lock (see Cgroup::join_files).
    for procs in &config.cgroup_procs {
        if let Err(e) = std::fs::write(procs, "0") {
            fail("cgroup", format!("cannot join {}: {e}", procs.display()));
        }
    }
    // Run by root: the commands' user namespace, made now (only the host's root may map a
    // range of ids) and kept by pid 1 on USERNS_FD for the exec starters. Placed there before
    // anything else is opened, so that nothing is on that number.
    if let Some(range) = &config.id_range {
        match crate::idmap::range_namespace(range) {
            Ok(ns) => {
                let raw = std::os::fd::IntoRawFd::into_raw_fd(ns);
                if raw != USERNS_FD {
                    if let Err(e) = nix::unistd::dup2(raw, USERNS_FD) {
                        fail("user namespace", format!("cannot keep its descriptor: {e}"));
                    }
                    let _ = nix::unistd::close(raw);
                }
            }
            Err(e) => fail(
                "user namespace",
                format!("cannot map the sandbox's ids: {e}"),
            ),
        }
    }
    // SAFETY: USERNS_FD was placed just above and stays open for the helper's life.
    let range_ns = config
        .id_range
        .map(|_| unsafe { std::os::fd::BorrowedFd::borrow_raw(USERNS_FD) });
    // Idmapped mounts need the host's root: made now, attached by pid 1.
    let prepared = match mounts::prepare(&config.root, &config.mounts, range_ns) {
        Ok(p) => p,
        Err(e) => fail("mounts", e),
    };
    // An ext4 disk needs the host's privilege to mount: before the user namespace, in a mount
    // namespace of its own, which the sandbox's (below) copies.
    let mut own_mount_namespace = false;
    if let Some(plan) = &config.disk
        && plan.device.is_some()
    {
        own_mount_namespace = true;
        if let Err(e) = unshare(CloneFlags::CLONE_NEWNS) {
            fail("disk", format!("unshare(CLONE_NEWNS): {e}"));
        }
        if let Err(e) = mount_disk(plan) {
            fail("disk", e);
        }
    }
    if config.user_namespace
        && let Err(e) = enter_user_namespace(
            (config.inner_uid.unwrap_or(config.uid), config.uid),
            (config.inner_gid.unwrap_or(config.gid), config.gid),
        )
    {
        fail("user namespace", e);
    }
    let mut flags = CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWCGROUP;
    if config.isolate_network {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    // The disk's mount namespace is already this helper's own, and private: without a user
    // namespace in between (whose mounts must be its own), a second copy of the host's mount
    // table would only cost its making and its teardown.
    if !own_mount_namespace || config.user_namespace {
        flags |= CloneFlags::CLONE_NEWNS;
    }
    if let Err(e) = unshare(flags) {
        fail("namespaces", format!("unshare: {e}"));
    }
    // The disk quota's tmpfs, in the new mount namespace before the sandbox's tree is built
    // (which binds its directories), so every later mount sees it.
    if let Some(plan) = &config.disk
        && plan.device.is_none()
        && let Err(e) = mount_disk(plan)
    {
        fail("disk", e);
    }
    // The child watches this pipe to learn whether the helper died before the child could arm
    // its parent-death signal.
    let (alive_read, alive_write) = match nix::unistd::pipe() {
        Ok(p) => p,
        Err(e) => fail("pipe", e),
    };
    // SAFETY: the helper is single-threaded (it never starts a thread), so the child may run
    // arbitrary code after fork.
    match unsafe { fork() } {
        Err(e) => fail("fork", e),
        Ok(ForkResult::Child) => {
            drop(alive_write);
            if let Err(e) = sys::set_parent_death_signal(libc::SIGKILL) {
                fail("parent-death signal", e);
            }
            let mut fds = [nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(&alive_read),
                nix::poll::PollFlags::POLLIN,
            )];
            if nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).unwrap_or(0) > 0 {
                // Only a hang-up can make it ready: the helper is gone.
                std::process::exit(125);
            }
            drop(alive_read);
            sandbox_init(config, prepared)
        }
        Ok(ForkResult::Parent { child }) => {
            drop(alive_read);
            drop(prepared);
            if config.control {
                // Only the runtime and the sandbox may hold the control socket: its closing is
                // what ends the sandbox.
                let _ = nix::unistd::close(crate::control::CONTROL_FD);
            }
            if config.egress.is_some() {
                // pid 1 sends the listener; once it has, or has died, the runtime sees the end.
                let _ = nix::unistd::close(EGRESS_FD);
            }
            if config.id_range.is_some() {
                let _ = nix::unistd::close(USERNS_FD);
            }
            report(&Status::Started {
                pid: child.as_raw(),
            });
            // The helper only waits: C reports the command's status itself.
            loop {
                match waitpid(child, None) {
                    Ok(WaitStatus::Exited(_, code)) => std::process::exit(code),
                    Ok(WaitStatus::Signaled(_, sig, _)) => std::process::exit(128 + sig as i32),
                    Ok(_) => continue,
                    Err(nix::Error::EINTR) => continue,
                    Err(e) => fail("wait", e),
                }
            }
        }
    }
}

/// Enters a new user namespace in which exactly one uid and one gid exist: `(inside, host)`
/// pairs, the host side being the caller's own ids.
fn enter_user_namespace(uid: (u32, u32), gid: (u32, u32)) -> Result<(), String> {
    unshare(CloneFlags::CLONE_NEWUSER).map_err(|e| format!("unshare(CLONE_NEWUSER): {e}"))?;
    std::fs::write("/proc/self/setgroups", "deny")
        .map_err(|e| format!("cannot write /proc/self/setgroups: {e}"))?;
    std::fs::write("/proc/self/uid_map", format!("{} {} 1\n", uid.0, uid.1))
        .map_err(|e| format!("cannot write uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("{} {} 1\n", gid.0, gid.1))
        .map_err(|e| format!("cannot write gid_map: {e}"))?;
    Ok(())
}

/// The sandbox's pid 1: builds the mount tree, starts the command, reaps every process, and
/// reports the command's status. Its exit makes the kernel kill all that is left in the sandbox.
fn sandbox_init(config: &InitConfig, prepared: mounts::Prepared) -> ! {
    if let Err(e) = sethostname(&config.hostname) {
        fail("hostname", e);
    }
    if let Err(e) = mounts::build(&config.new_root, &config.root, &config.mounts, prepared) {
        fail("mounts", e);
    }
    if config.isolate_network
        && let Err(e) = sys::loopback_up()
    {
        fail("network", format!("cannot bring loopback up: {e}"));
    }
    if let Some(plan) = config.egress {
        if !config.isolate_network {
            fail(
                "egress",
                "the egress listener needs the sandbox's own network namespace",
            );
        }
        if let Err(e) = hand_out_egress_listener(plan) {
            fail("egress", e);
        }
    }
    if config.control {
        crate::server::serve(config)
    }
    // With `--write-through` the command hands pid 1 the listener of its setid filter, and pid 1
    // answers (refuses) and counts those calls.
    let setid_channel = if config.refuse_setid_modes {
        match nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        ) {
            Ok(pair) => Some(pair),
            Err(e) => fail("seccomp", format!("socketpair: {e}")),
        }
    } else {
        None
    };
    // SAFETY: pid 1 is single-threaded; see `run`.
    let command = match unsafe { fork() } {
        Err(e) => fail("fork", e),
        Ok(ForkResult::Child) => {
            let to_parent = setid_channel.map(|(_, theirs)| theirs);
            exec_command_with(config, to_parent)
        }
        Ok(ForkResult::Parent { child }) => child,
    };
    // The command sends the listener just before its exec, or ends without (its end then
    // closes). pid 1 forks nothing after this, so its answering thread is safe.
    let setid_refusals = setid_channel.and_then(|(ours, theirs)| {
        drop(theirs);
        let mut buf = Vec::new();
        match crate::control::recv::<u8>(std::os::fd::AsFd::as_fd(&ours), &mut buf) {
            Ok(Some((_, mut fds))) => fds
                .pop()
                .and_then(|listener| seccomp::answer_setid_refusals(listener).ok()),
            _ => None,
        }
    });
    // pid 1 keeps no copy of the command's output: its end of the pipes closes when the command
    // and what it started are gone, not when the namespaces are torn down after pid 1 exits.
    release_stdio();
    // Signals sent to pid 1 from inside the sandbox are dropped by the kernel unless handled;
    // SIGTERM from outside cannot reach us (only SIGKILL via the helper's death), so reaping is
    // all there is to do.
    let mut file_size_exceeded = false;
    loop {
        let mut status = 0;
        // SAFETY: rusage is plain old data; all-zero is valid.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `status` and `usage` are valid for writes for the duration of the call.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::__WALL, &mut usage) };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            fail("wait", e);
        }
        if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGXFSZ {
            file_size_exceeded = true;
        }
        if pid != command.as_raw() {
            continue;
        }
        let ms = |tv: libc::timeval| tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000;
        let (code, signal) = if libc::WIFEXITED(status) {
            (Some(libc::WEXITSTATUS(status)), None)
        } else if libc::WIFSIGNALED(status) {
            (None, Some(libc::WTERMSIG(status)))
        } else {
            continue;
        };
        report(&Status::Exited {
            code,
            signal,
            cpu_ms: ms(usage.ru_utime) + ms(usage.ru_stime),
            max_rss_bytes: usage.ru_maxrss as u64 * 1024,
            file_size_exceeded: file_size_exceeded || reports_file_size_kill(code),
            setid_refused: setid_refusals.as_ref().map_or(0, |r| r.count()),
            setid_calls: setid_refusals
                .as_ref()
                .map(|r| r.calls())
                .unwrap_or_default(),
        });
        std::process::exit(0)
    }
}

/// Mounts the disk quota's tmpfs on `plan.dir` (its owner's alone), makes its directories, and
/// sends a descriptor of its root to the runtime on [`DISK_FD`], which reads and writes the
/// sandbox's layers through it: the mount exists only in this namespace.
fn mount_disk(plan: &DiskPlan) -> Result<(), String> {
    use nix::mount::{MsFlags, mount};
    // Nothing mounted here may propagate back to the host's namespace.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("cannot make mounts private: {e}"))?;
    match &plan.device {
        Some(device) => mount(
            Some(device.as_path()),
            &plan.dir,
            Some("ext4"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
            Some(crate::config::EXT4_MOUNT_OPTIONS),
        )
        .map_err(|e| {
            format!(
                "cannot mount {} on {}: {e}",
                device.display(),
                plan.dir.display()
            )
        })?,
        None => {
            let data = format!("mode=700,size={}", plan.size_bytes);
            mount(
                Some("tmpfs"),
                &plan.dir,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(data.as_str()),
            )
            .map_err(|e| {
                format!(
                    "cannot mount a tmpfs of {} bytes on {}: {e}",
                    plan.size_bytes,
                    plan.dir.display()
                )
            })?
        }
    }
    std::fs::set_permissions(&plan.dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot set the mode of {}: {e}", plan.dir.display()))?;
    for (name, mode) in &plan.subdirs {
        let dir = plan.dir.join(name);
        // An ext4 disk's template has them already (with their modes); a tmpfs starts empty.
        match std::fs::create_dir(&dir) {
            Ok(()) => std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(*mode))
                .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && plan.device.is_some() => {}
            Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
        }
    }
    for (name, uid, gid) in &plan.owners {
        let dir = plan.dir.join(name);
        std::os::unix::fs::chown(&dir, Some(*uid), Some(*gid))
            .map_err(|e| format!("cannot give {} its owner: {e}", dir.display()))?;
    }
    let root = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&plan.dir)
        .map_err(|e| format!("cannot open {}: {e}", plan.dir.display()))?;
    // SAFETY: DISK_FD is inherited from the runtime and open until closed just below.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(DISK_FD) };
    let sent = crate::control::send(
        sock,
        &plan.size_bytes,
        &[std::os::fd::AsRawFd::as_raw_fd(&root)],
    )
    .map_err(|e| format!("cannot hand the disk to the runtime: {e}"));
    if sent.is_ok() && plan.hold {
        // A fork: the runtime copies its parent's layers onto the disk before anything is
        // mounted from it, and says when it is done (or that it failed, or it dies: the end of
        // the stream).
        let mut buf = Vec::new();
        match crate::control::recv::<crate::config::DiskGo>(sock, &mut buf) {
            Ok(Some((crate::config::DiskGo { ok: true }, _))) => {}
            Ok(Some(_)) => return Err("the runtime could not fill the disk of a fork".into()),
            Ok(None) => return Err("the runtime went away while it filled the disk".into()),
            Err(e) => return Err(format!("cannot hear from the runtime about the disk: {e}")),
        }
    }
    let _ = nix::unistd::close(DISK_FD);
    sent
}

/// Binds the egress proxy's listener on `127.0.0.1:port` in the sandbox's network namespace and
/// sends it to the runtime on [`EGRESS_FD`], keeping no copy: the proxy outside accepts the
/// sandbox's connections on it. Runs before any command exists, so the port is pid 1's.
fn hand_out_egress_listener(plan: EgressPlan) -> Result<(), String> {
    let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, plan.port))
        .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", plan.port))?;
    // SAFETY: EGRESS_FD is inherited from the runtime and open until closed just below.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(EGRESS_FD) };
    let sent = crate::control::send(sock, &plan, &[std::os::fd::AsRawFd::as_raw_fd(&listener)])
        .map_err(|e| format!("cannot hand the listener to the runtime: {e}"));
    let _ = nix::unistd::close(EGRESS_FD);
    sent
}

/// Points stdin, stdout and stderr at /dev/null: the helper and pid 1 need none of them, and
/// holding the output pipes would delay their end.
fn release_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), fd);
        }
    }
}

/// Reads the plan from `path`, then runs it.
pub fn run_from_file(path: &Path) -> ! {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) => fail("config", format!("cannot read {}: {e}", path.display())),
    };
    let config: InitConfig = match serde_json::from_slice(&text) {
        Ok(c) => c,
        Err(e) => fail("config", format!("invalid plan {}: {e}", path.display())),
    };
    run(&config)
}

/// Reads the plan from [`PLAN_FD`] (closed once read, so nothing the helper starts holds it),
/// then runs it.
pub fn run_from_plan_fd() -> ! {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: the runtime placed the plan on PLAN_FD for this process alone; taking it here,
    // once, closes it when read.
    let mut file = unsafe { std::fs::File::from_raw_fd(PLAN_FD) };
    let mut text = Vec::new();
    if let Err(e) = file.read_to_end(&mut text) {
        fail(
            "config",
            format!("cannot read the plan on descriptor {PLAN_FD}: {e}"),
        );
    }
    drop(file);
    let config: InitConfig = match serde_json::from_slice(&text) {
        Ok(c) => c,
        Err(e) => fail(
            "config",
            format!("invalid plan on descriptor {PLAN_FD}: {e}"),
        ),
    };
    run(&config)
}
