//! The small helpers every layer needs the same way: the wall clock in the unit the API speaks
//! (milliseconds since the Unix epoch), a mutex that a panicking holder does not make unusable,
//! and git run on a repository taskbox does not trust, bounded in time and output.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Locks `m`, also when a holder panicked: the data it guards stays consistent, since each
/// holder makes whole changes.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// git in `dir`, kept from running anything a repository's config names (its fsmonitor, its
/// hooks) and from prompting; standard input empty.
pub fn git_command(dir: &Path) -> Command {
    let mut c = Command::new("git");
    c.arg("-C")
        .arg(dir)
        .args([
            "-c",
            "core.fsmonitor=false",
            "-c",
            "core.hooksPath=/dev/null",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null());
    c
}

/// Runs `cmd` (stdout piped here, stderr dropped) and reads at most `limit` bytes of its
/// output; its output when it exited successfully within `timeout`. `None` when it could not
/// start, failed, or ran out of time (it is then killed).
pub fn output_within(cmd: &mut Command, limit: u64, timeout: Duration) -> Option<Vec<u8>> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let stdout = child.stdout.take()?;
    // Read in a thread so a large output cannot fill the pipe and stall the timeout loop.
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.take(limit).read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = reader.join();
                return None;
            }
        }
    };
    let out = reader.join().ok()?;
    status.success().then_some(out)
}
