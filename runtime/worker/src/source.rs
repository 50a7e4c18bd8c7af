//! A task's workspace on the worker's disk: a git repository checked out at the task's commit,
//! or a tar from the object store unpacked as untrusted input. Every attempt of a task gets the
//! same tree (a commit, or a tar by name), so a resumed task continues on what it began with.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use taskbox_agent::contract::check_git_url;

use crate::Failure;

/// How long a clone may take before the attempt fails (and is tried again).
const GIT_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment of every git the worker runs: no prompt for credentials (a worker has no
/// one to ask), and only the transports a task may name (never `ext::`, which runs commands).
pub fn git_command(args: &[&str]) -> Command {
    let mut c = Command::new("git");
    c.args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_ALLOW_PROTOCOL", "file:https:http:ssh:git")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_ASKPASS", "true")
        .env("SSH_ASKPASS", "true")
        .env("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
        .stdin(Stdio::null());
    c
}

/// Runs `c` to its end, or kills it after `timeout`; its stderr's end on failure.
pub fn run_git(mut c: Command, what: &str, timeout: Duration) -> Result<String, String> {
    let out_file = tempfile_for_output()?;
    let err_file = tempfile_for_output()?;
    let mut child = c
        .stdout(out_file.try_clone().map_err(|e| format!("{what}: {e}"))?)
        .stderr(err_file.try_clone().map_err(|e| format!("{what}: {e}"))?)
        .spawn()
        .map_err(|e| format!("{what}: cannot run git: {e}"))?;
    let since = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if since.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{what}: git ran longer than {timeout:?} and was stopped"
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("{what}: {e}")),
        }
    };
    let read = |mut f: std::fs::File| {
        use std::io::{Read, Seek};
        let mut s = String::new();
        let _ = f.seek(std::io::SeekFrom::Start(0));
        let _ = f.take(64 << 10).read_to_string(&mut s);
        s
    };
    if status.success() {
        Ok(read(out_file))
    } else {
        let err = read(err_file);
        let tail: String = err
            .trim()
            .lines()
            .rev()
            .take(3)
            .collect::<Vec<_>>()
            .join(" / ");
        Err(format!("{what}: {tail}"))
    }
}

fn tempfile_for_output() -> Result<std::fs::File, String> {
    tempfile::tempfile().map_err(|e| format!("cannot make a temporary file: {e}"))
}

/// Clones `url` into `dir` (which must not exist) and checks out `commit`, detached.
/// An unreachable repository may come back: a transient failure; a commit it does not hold
/// will not: a permanent one.
pub fn git_checkout(url: &str, commit: &str, dir: &Path) -> Result<(), Failure> {
    check_git_url(url).map_err(|e| Failure::permanent(format!("the workspace's git url: {e}")))?;
    let dir_s = dir.display().to_string();
    run_git(
        git_command(&["clone", "--quiet", "--no-checkout", "--", url, &dir_s]),
        &format!("git clone {url}"),
        GIT_TIMEOUT,
    )
    .map_err(Failure::transient)?;
    let checkout = run_git(
        git_command(&[
            "-C", &dir_s, "checkout", "--quiet", "--detach", commit, "--",
        ]),
        &format!("git checkout {commit}"),
        GIT_TIMEOUT,
    );
    if let Err(e) = checkout {
        // A shallow or partial server may need the commit fetched by name.
        let fetched = run_git(
            git_command(&["-C", &dir_s, "fetch", "--quiet", "origin", commit]),
            &format!("git fetch {commit}"),
            GIT_TIMEOUT,
        );
        let again = fetched.and_then(|_| {
            run_git(
                git_command(&[
                    "-C", &dir_s, "checkout", "--quiet", "--detach", commit, "--",
                ]),
                &format!("git checkout {commit}"),
                GIT_TIMEOUT,
            )
        });
        if again.is_err() {
            return Err(Failure::permanent(format!(
                "{url} has no commit {commit} ({e})"
            )));
        }
    }
    Ok(())
}

/// Unpacks tar `data` (an object of the artifact store) into `dir` as untrusted input.
pub fn untar(name: &str, data: &[u8], dir: &Path) -> Result<(), Failure> {
    taskbox_core::untar::unpack_untrusted(data, dir)
        .map(|_| ())
        .map_err(|e| Failure::permanent(format!("the workspace tar {name} is refused: {e}")))
}
