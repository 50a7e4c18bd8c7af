//! The command's side of the helper: its confinement (session, umask, working directory,
//! rlimits, no_new_privs, Landlock, capabilities, seccomp) and its exec, and the status lines
//! every process of the helper writes. Used by the one-shot sandbox's pid 1 ([`crate::run`]) and
//! by a long-lived sandbox's exec reapers alike.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};

use nix::sys::signal::{SigHandler, Signal, signal};
use nix::unistd::setsid;

use crate::config::{InitConfig, RlimitResource, STATUS_FD, Status, USERNS_FD};
use crate::control::ExecIds;
use crate::{landlock_rules, seccomp, sys};

/// Writes one status line. Best effort: if the runtime is gone there is nobody to tell.
pub fn report(status: &Status) {
    // SAFETY: STATUS_FD is inherited from the runtime and stays open for the life of the
    // helper.
    write_line(unsafe { BorrowedFd::borrow_raw(STATUS_FD) }, status);
}

/// Writes `value` as one JSON line on `fd` (one write for a short line). Best effort.
pub(crate) fn write_line(fd: BorrowedFd<'_>, value: &impl serde::Serialize) {
    // ManuallyDrop: this temporary File must not close the borrowed descriptor.
    // SAFETY: `fd` is open for the duration of the call (borrowed).
    let mut out = ManuallyDrop::new(unsafe { File::from_raw_fd(fd.as_raw_fd()) });
    if let Ok(mut line) = serde_json::to_vec(value) {
        line.push(b'\n');
        let _ = out.write_all(&line);
    }
}

pub(crate) fn fail(stage: &str, message: impl std::fmt::Display) -> ! {
    report(&Status::SetupFailed {
        stage: stage.to_string(),
        message: message.to_string(),
    });
    // _exit: the command's process may share its reaper's memory until its exec (see the
    // server's spawn_command); nothing here has buffered output to flush.
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(125) }
}

/// A shell (and most tools that run others) exits with 128 + N when a child died of signal N:
/// the command's own report that a process it waited for hit the file size limit, which pid 1
/// cannot see when that process's parent reaped it.
pub(crate) fn reports_file_size_kill(code: Option<i32>) -> bool {
    code == Some(128 + libc::SIGXFSZ)
}

/// The descriptor on which the command sends its setid filter's listener to pid 1.
const SETID_FD: i32 = STATUS_FD + 1;

/// The one-shot command's process: confine it wholly (session, umask, working directory,
/// rlimits, no_new_privs, Landlock, capabilities, seccomp), then exec. With `setid_to`
/// (`--write-through`) the setid filter's listener is sent there; without it the filter's calls
/// are answered `ENOSYS` by the kernel. Never returns.
pub(crate) fn exec_command_with(config: &InitConfig, setid_to: Option<std::os::fd::OwnedFd>) -> ! {
    enter_session(config);
    // Entered before the namespace's descriptor goes with the others below.
    let ids = match enter_commands_namespace(config, None) {
        Ok(ids) => ids,
        Err((stage, e)) => fail(stage, e),
    };
    // The socket to pid 1 goes on SETID_FD; its old number is closed below with the rest.
    let hand_over = setid_to.is_some();
    if let Some(fd) = setid_to {
        if nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&fd), SETID_FD).is_err() {
            fail("seccomp", "cannot place the listener's socket");
        }
        let _ = sys::set_cloexec(SETID_FD);
        let _ = std::os::fd::IntoRawFd::into_raw_fd(fd);
    }
    let last_kept = if hand_over { SETID_FD } else { STATUS_FD };
    sys::close_fds_from(last_kept as u32 + 1);
    if let Err(e) = sys::set_no_new_privs() {
        fail("no_new_privs", e);
    }
    let landlock = match landlock_rules::apply(&config.landlock) {
        Ok(outcome) => outcome,
        Err(e) => fail("landlock", e),
    };
    report(&Status::Landlock {
        status: landlock.as_str().to_string(),
    });
    if let Err(e) = become_user(config, ids.as_ref()) {
        fail("capabilities", e);
    }
    let rules = seccomp::Rules {
        deny_list: config.seccomp,
        refuse_setid_modes: config.refuse_setid_modes,
    };
    if rules.any() {
        match seccomp::install(rules) {
            Err(e) => fail("seccomp", e),
            Ok(Some(listener)) => {
                if hand_over {
                    // SAFETY: SETID_FD was placed above and is open until the exec.
                    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(SETID_FD) };
                    let raw = std::os::fd::AsRawFd::as_raw_fd(&listener);
                    if let Err(e) = crate::control::send(sock, &0u8, &[raw]) {
                        fail(
                            "seccomp",
                            format!("cannot hand the setid listener over: {e}"),
                        );
                    }
                }
                // pid 1 holds its copy; the command keeps none (the kernel's is close-on-exec).
                drop(listener);
            }
            Ok(None) => {}
        }
    }
    if hand_over {
        let _ = nix::unistd::close(SETID_FD);
    }
    report(&Status::Seccomp {
        installed: config.seccomp,
    });
    exec(config)
}

/// What every command's process does first, whoever confines it: default signals, a session of
/// its own, a fixed umask, its working directory, its rlimits.
fn enter_session(config: &InitConfig) {
    let _ = nix::sys::signal::sigprocmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&nix::sys::signal::SigSet::empty()),
        None,
    );
    for sig in [
        Signal::SIGPIPE,
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGTERM,
    ] {
        // SAFETY: restoring the default disposition installs no Rust handler.
        let _ = unsafe { signal(sig, SigHandler::SigDfl) };
    }
    if let Err(e) = setsid() {
        fail("setsid", e);
    }
    // A fixed umask, whatever the caller's: files the command creates get the same modes on
    // every host and in every backend (Docker's default is 022 too), so replays can match.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    if let Err(e) = std::env::set_current_dir(&config.cwd) {
        fail(
            "cwd",
            format!(
                "cannot enter working directory {}: {e}",
                config.cwd.display()
            ),
        );
    }
    for limit in &config.rlimits {
        if let Err(e) = set_rlimit(limit.resource, limit.limit) {
            fail("rlimit", format!("{:?}: {e}", limit.resource));
        }
    }
}

/// Confines the calling process the way [`exec_command_with`] confines a command, except for
/// Landlock, whose ruleset it builds but does not apply: `no_new_privs`, no capabilities, the
/// seccomp filter. A long-lived sandbox's exec starter does this once, and each command it
/// starts only restricts itself with the returned ruleset ([`exec_confined`]), so an exec does
/// not compile and attach a filter, drop 40-odd capabilities and open the rule paths again.
/// The filter's setid listener (`--write-through` only) is not kept: its calls get `ENOSYS`.
pub(crate) fn confine_starter(
    config: &InitConfig,
    user: Option<&ExecIds>,
) -> Result<landlock_rules::Prepared, (&'static str, String)> {
    let ids = enter_commands_namespace(config, user)?;
    sys::set_no_new_privs().map_err(|e| ("no_new_privs", e.to_string()))?;
    // Before the capabilities go: the rule paths are opened with the sandbox's privilege.
    let landlock =
        landlock_rules::prepare(&config.landlock).map_err(|e| ("landlock", e.to_string()))?;
    become_user(config, ids.as_ref()).map_err(|e| ("capabilities", e.to_string()))?;
    let rules = seccomp::Rules {
        deny_list: config.seccomp,
        refuse_setid_modes: config.refuse_setid_modes,
    };
    if rules.any() {
        seccomp::install(rules).map_err(|e| ("seccomp", e.to_string()))?;
    }
    Ok(landlock)
}

/// A root-run sandbox's commands are ids of their own user namespace (see `IdRange`): this
/// enters it and says who to become there, `user` or else the sandbox's own ids. Without a
/// range there is nothing to enter, and the one user there is may be asked for only by its uid.
fn enter_commands_namespace(
    config: &InitConfig,
    user: Option<&ExecIds>,
) -> Result<Option<ExecIds>, (&'static str, String)> {
    match (&config.id_range, user) {
        (Some(_), user) => {
            sys::enter_user_namespace(USERNS_FD)
                .map_err(|e| ("user namespace", format!("cannot enter: {e}")))?;
            Ok(Some(user.cloned().unwrap_or(ExecIds {
                uid: config.inner_uid.unwrap_or(0),
                gid: config.inner_gid.unwrap_or(0),
                groups: Vec::new(),
            })))
        }
        (None, Some(u)) if u.uid != nix::unistd::getuid().as_raw() => Err((
            "user",
            format!(
                "this sandbox has one user (uid {}); it cannot run a command as uid {}",
                nix::unistd::getuid(),
                u.uid
            ),
        )),
        (None, _) => Ok(None),
    }
}

/// Cuts the capabilities to what the command's user keeps (the policy's root capabilities for
/// uid 0, which the runtime gives only where uid 0 is not the host's root; none for anyone
/// else), becoming `ids` (if any) once the bounding set is cut.
fn become_user(config: &InitConfig, ids: Option<&ExecIds>) -> std::io::Result<()> {
    let uid = ids.map_or_else(|| nix::unistd::getuid().as_raw(), |i| i.uid);
    let keep: &[u32] = if uid == 0 {
        &config.root_capabilities
    } else {
        &[]
    };
    sys::limit_capabilities(keep, || match ids {
        Some(i) => sys::switch_ids(i.uid, i.gid, &i.groups),
        None => Ok(()),
    })
}

/// The command's process under a starter that [`confine_starter`] confined: enters its session,
/// restricts itself with the starter's Landlock ruleset (a domain of its own, so it cannot
/// signal the starter or its reaper), closes every other descriptor, and execs. Never returns.
pub(crate) fn exec_confined(config: &InitConfig, landlock: landlock_rules::Prepared) -> ! {
    enter_session(config);
    let landlock = match landlock.restrict() {
        Ok(outcome) => outcome,
        Err(e) => fail("landlock", e),
    };
    // After the restriction: the ruleset's descriptor is among those closed.
    sys::close_fds_from(STATUS_FD as u32 + 1);
    report(&Status::Landlock {
        status: landlock.as_str().to_string(),
    });
    report(&Status::Seccomp {
        installed: config.seccomp,
    });
    exec(config)
}

fn exec(config: &InitConfig) -> ! {
    let program = config.argv.first().cloned().unwrap_or_default();
    let to_c = |s: &str| CString::new(s.as_bytes()).ok();
    let args: Option<Vec<CString>> = config.argv.iter().map(|a| to_c(a)).collect();
    let env: Option<Vec<CString>> = config
        .env
        .iter()
        .map(|(k, v)| to_c(&format!("{k}={v}")))
        .collect();
    let (Some(args), Some(env)) = (args, env) else {
        fail(
            "exec",
            "an argument or environment variable contains a NUL byte",
        )
    };
    let path = config
        .env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or("/usr/local/bin:/usr/bin:/bin");
    let mut errno = libc::ENOENT;
    let candidates: Vec<String> = if program.contains('/') {
        vec![program.clone()]
    } else {
        path.split(':')
            .filter(|d| !d.is_empty())
            .map(|d| format!("{d}/{program}"))
            .collect()
    };
    for candidate in candidates {
        let Some(c) = to_c(&candidate) else { continue };
        // execve only returns on failure.
        let e = nix::unistd::execve(&c, &args, &env).err();
        match e {
            Some(nix::Error::ENOENT) | Some(nix::Error::ENOTDIR) => {}
            Some(other) => {
                errno = other as i32;
                // Permission problems are remembered but the search goes on, like execvp(3).
                if other != nix::Error::EACCES {
                    break;
                }
            }
            None => {}
        }
    }
    report(&Status::ExecFailed { errno, program });
    // SAFETY: _exit has no preconditions (see `fail`).
    unsafe { libc::_exit(if errno == libc::ENOENT { 127 } else { 126 }) }
}

fn set_rlimit(resource: RlimitResource, limit: u64) -> nix::Result<()> {
    use nix::sys::resource::{Resource, setrlimit};
    let r = match resource {
        RlimitResource::AddressSpace => Resource::RLIMIT_AS,
        RlimitResource::Processes => Resource::RLIMIT_NPROC,
        RlimitResource::CpuSeconds => Resource::RLIMIT_CPU,
        RlimitResource::FileSize => Resource::RLIMIT_FSIZE,
        RlimitResource::OpenFiles => Resource::RLIMIT_NOFILE,
        RlimitResource::CoreSize => Resource::RLIMIT_CORE,
    };
    // Never raise: a limit above the current hard limit is clamped to it.
    let (_, hard) = nix::sys::resource::getrlimit(r)?;
    let value = limit.min(hard);
    setrlimit(r, value, value)
}
