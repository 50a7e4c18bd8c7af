//! Running a reader where its failure cannot take the harness down: a panic is caught in
//! process; generated hostile input is read in a child process (this same binary with
//! `--probe`), so that a stack overflow, an abort or a hang is reported as such.

use std::io::Read;
use std::panic::{self, AssertUnwindSafe};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a child may take on one case (its reading and five timed runs).
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        let msg: String = msg.chars().take(120).collect();
        format!("panicked: {msg}")
    })
}

/// Runs `self --probe ARGS` and reads its JSON answer.
pub fn run(args: &[&str]) -> Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let mut child = Command::new(exe)
        .arg("--probe")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    // Read while it runs: a large answer would fill the pipe and stall the child.
    let reader = child.stdout.take().map(|mut s| {
        std::thread::spawn(move || {
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        })
    });
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let out = reader
                    .map(|r| r.join().unwrap_or_default())
                    .unwrap_or_default();
                if !status.success() {
                    use std::os::unix::process::ExitStatusExt;
                    return Err(match status.signal() {
                        Some(11) => "crashed (SIGSEGV: stack overflow?)".to_owned(),
                        Some(6) => "aborted (SIGABRT: stack overflow or abort)".to_owned(),
                        Some(sig) => format!("killed by signal {sig}"),
                        None => format!("exited with {status}"),
                    });
                }
                return serde_json::from_str(&out).map_err(|e| format!("bad answer: {e}"));
            }
            Ok(None) if start.elapsed() > PROBE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                drop(reader);
                return Err(format!("no answer in {} s", PROBE_TIMEOUT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("wait: {e}")),
        }
    }
}
