//! What an in-process backend of a killed `taskbox agent` or `taskbox worker` left.
//!
//! Each runs its sandboxes in a directory of its own process (`STATE/agent/sessions/PID`,
//! `STATE/worker/HOST-PID/sandboxes` by default). A process that ends normally destroys its
//! sandboxes; one that is killed leaves their directories and cgroups (its sandboxes' processes
//! end with it, when their control sockets close), and the next process, of another pid, never
//! looked there. Each start now sweeps the directories of processes of this host that are gone:
//! the native backend, opened on such a directory, takes its lock and removes what its sandboxes
//! left, as a restarted supervisor does with its own.

use std::path::Path;

use taskbox_core::sandbox::NativeBackend;

/// Whether process `pid` is gone (no such process; a process we may not signal is alive).
fn gone(pid: i32) -> bool {
    pid > 0
        && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::Error::ESRCH)
}

/// Sweeps `dir` (a native backend's state directory) if no backend holds it; false if one does.
fn sweep(dir: &Path) -> bool {
    NativeBackend::new(dir.to_path_buf())
        .inspect_err(|e| tracing::debug!(dir = %dir.display(), error = %e, "not swept"))
        .is_ok()
}

/// The agent's sessions in `sessions` (`STATE/agent/sessions`) whose process is gone: swept,
/// then removed.
pub fn sweep_agent_sessions(sessions: &Path) {
    let Ok(entries) = std::fs::read_dir(sessions) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if gone(pid) && sweep(&e.path()) {
            tracing::info!(session = pid, "removing what a killed agent left");
            taskbox_core::native::remove_tree(&e.path());
        }
    }
}

/// The sandboxes of workers in `workers` (`STATE/worker`) named by default (`HOST-PID`, this
/// host) whose process is gone: swept. A worker given a `--name` sweeps its own when it starts
/// again under that name.
pub fn sweep_worker_sandboxes(workers: &Path, host: &str) {
    let Ok(entries) = std::fs::read_dir(workers) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(host))
            .and_then(|n| n.strip_prefix('-'))
            .and_then(|n| n.parse::<i32>().ok());
        let sandboxes = e.path().join("sandboxes");
        if pid.is_some_and(gone) && sandboxes.is_dir() && sweep(&sandboxes) {
            tracing::info!(worker = %name.to_string_lossy(), "removed what a killed worker left");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that was a process of this host and is gone.
    fn dead_pid() -> i32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        pid
    }

    /// What a killed process's backend left: a sandbox's directory in `state/sandboxes`.
    fn leftover(state: &Path) -> std::path::PathBuf {
        let sb = state.join("sandboxes").join("sb-0123456789abcdef");
        std::fs::create_dir_all(sb.join("checkpoints")).unwrap();
        sb
    }

    #[test]
    fn only_what_processes_that_are_gone_left_is_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let (dead, own) = (dead_pid(), std::process::id());
        let sessions = tmp.path().join("agent/sessions");
        let stale = leftover(&sessions.join(dead.to_string()));
        let live = leftover(&sessions.join(own.to_string()));
        sweep_agent_sessions(&sessions);
        assert!(
            !sessions.join(dead.to_string()).exists(),
            "{}",
            stale.display()
        );
        assert!(live.exists(), "a live process's session was swept");

        let workers = tmp.path().join("worker");
        let stale = leftover(&workers.join(format!("host-{dead}/sandboxes")));
        let named = leftover(&workers.join("builder-1/sandboxes"));
        let live = leftover(&workers.join(format!("host-{own}/sandboxes")));
        let other_host = leftover(&workers.join(format!("elsewhere-{dead}/sandboxes")));
        sweep_worker_sandboxes(&workers, "host");
        assert!(!stale.exists(), "a killed worker's sandbox is left");
        assert!(named.exists() && live.exists() && other_host.exists());
    }
}
