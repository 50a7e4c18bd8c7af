//! How an exec ended, in one shape every backend fills in, and the one place an [`ExecResult`]
//! is put together from it.
//!
//! Each backend learns of an exec's end its own way (the native helper's status lines and
//! pid 1's events, the Docker wrapper's status file); what it learned goes into an [`ExecEnd`],
//! and [`ExecEnd::into_result`] applies the rules that must read the same on every surface: a
//! timeout means killed by SIGKILL with no exit code, a program that could not be run is said
//! on stderr, and the violations come in one order (timeout, memory, file size, setid, disk,
//! paths too long to name, then the egress proxy's denials), each worded once in
//! [`Violation`].

use std::time::Duration;

use crate::result::{
    Change, Enforcement, ExecResult, NetworkActivity, Output, Resources, Violation,
};

/// What a backend learned of an exec's end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecEnd {
    /// The command's exit code (`None` when a signal ended it).
    pub exit_code: Option<i32>,
    /// The signal that ended the command.
    pub signal: Option<i32>,
    /// The wall-clock limit, when it fired and the whole tree was killed.
    pub timed_out: Option<Duration>,
    /// The program could not be run: execve's errno and the program.
    pub exec_failed: Option<(i32, String)>,
    pub cpu_ms: u64,
    pub max_rss_bytes: u64,
    /// The kernel OOM-killed a process of the exec at this memory limit (bytes).
    pub oom_killed_at: Option<u64>,
    /// A write went past this per-file size limit (bytes).
    pub file_size_limit: Option<u64>,
    /// With `--write-through`: the setid calls refused, and their names.
    pub setid_refused: Option<(u32, Vec<String>)>,
    /// The sandbox's disk of this size (bytes) is full.
    pub disk_full_at: Option<u64>,
    /// The workspace holds paths too long to name, beneath this directory (relative to it).
    pub unnamed_paths: Option<String>,
    /// The egress proxy's decisions while the exec ran: its denials and the activity.
    pub network: Option<(Vec<Violation>, NetworkActivity)>,
    pub duration_ms: u64,
}

impl ExecEnd {
    /// The observation of the exec: `stderr` gains the line saying why the program could not
    /// run, empty output is the empty [`Output`], and the violations are in their one order.
    pub fn into_result(
        self,
        stdout: Output,
        mut stderr: Output,
        changes: Vec<Change>,
        enforcement: Enforcement,
    ) -> ExecResult {
        let (mut exit_code, mut signal) = (self.exit_code, self.signal);
        if self.timed_out.is_some() {
            exit_code = None;
            signal = Some(libc::SIGKILL);
        }
        if let Some((errno, program)) = &self.exec_failed {
            stderr.note_exec_failure(*errno, program);
        }
        let mut violations = Vec::new();
        if let Some(limit) = self.timed_out {
            violations.push(Violation::timeout(limit));
        }
        if let Some(bytes) = self.oom_killed_at {
            violations.push(Violation::memory_limit(bytes));
        }
        if let Some(bytes) = self.file_size_limit {
            violations.push(Violation::file_size_limit(bytes));
        }
        if let Some((count, calls)) = &self.setid_refused {
            violations.push(Violation::setid_refused(*count, calls));
        }
        if let Some(bytes) = self.disk_full_at {
            violations.push(Violation::disk_limit(bytes));
        }
        if let Some(dir) = &self.unnamed_paths {
            violations.push(Violation::unnamed_paths(dir));
        }
        let network = self.network.map(|(denials, activity)| {
            violations.extend(denials);
            activity
        });
        let empty = |o: Output| {
            if o.text.is_empty() && o.bytes == 0 {
                Output::default()
            } else {
                o
            }
        };
        ExecResult {
            exit_code,
            signal,
            timed_out: self.timed_out.is_some(),
            duration_ms: self.duration_ms,
            stdout: empty(stdout),
            stderr,
            changes,
            violations,
            resources: Resources {
                cpu_ms: self.cpu_ms,
                max_rss_bytes: self.max_rss_bytes,
                oom_killed: self.oom_killed_at.is_some(),
            },
            enforcement,
            network,
            ignored_changes: 0,
            findings: Vec::new(),
            findings_omitted: 0,
            tests: None,
        }
    }
}

impl ExecResult {
    /// The answer to an exec that did not run because the command policy refused it: the
    /// violation and nothing else (see [`ExecResult::refused_by_command_policy`]).
    pub fn refused(detail: String, duration_ms: u64, enforcement: Enforcement) -> ExecResult {
        ExecResult {
            exit_code: None,
            signal: None,
            timed_out: false,
            duration_ms,
            stdout: Output::default(),
            stderr: Output::default(),
            changes: Vec::new(),
            violations: vec![Violation {
                kind: "command".to_owned(),
                detail,
            }],
            resources: Resources::default(),
            enforcement,
            ignored_changes: 0,
            network: None,
            findings: Vec::new(),
            findings_omitted: 0,
            tests: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enforcement() -> Enforcement {
        Enforcement {
            landlock: "full".into(),
            seccomp: true,
            network: "none".into(),
            limits: "rlimit".into(),
            disk: "none".into(),
        }
    }

    #[test]
    fn a_timeout_is_a_kill_whatever_the_status_said() {
        let end = ExecEnd {
            exit_code: Some(0),
            timed_out: Some(Duration::from_millis(300)),
            oom_killed_at: Some(1 << 20),
            ..ExecEnd::default()
        };
        let r = end.into_result(Output::default(), Output::default(), vec![], enforcement());
        assert_eq!((r.exit_code, r.signal, r.timed_out), (None, Some(9), true));
        let kinds: Vec<&str> = r.violations.iter().map(|v| v.kind.as_str()).collect();
        assert_eq!(kinds, ["timeout", "limit"]);
        assert!(r.resources.oom_killed);
        assert_eq!(r.cli_exit_status(), 124);
    }

    #[test]
    fn a_program_that_cannot_run_is_said_on_stderr() {
        let end = ExecEnd {
            exit_code: Some(127),
            exec_failed: Some((libc::ENOENT, "nope".into())),
            ..ExecEnd::default()
        };
        let r = end.into_result(Output::default(), Output::default(), vec![], enforcement());
        assert!(
            r.stderr
                .text
                .contains("cannot run `nope`: command not found")
        );
        assert_eq!(r.stderr.bytes, r.stderr.text.len() as u64);
        assert!(r.violations.is_empty());
    }

    #[test]
    fn a_refusal_ran_nothing() {
        let r = ExecResult::refused("forbidden".into(), 3, enforcement());
        assert!(r.refused_by_command_policy());
        assert_eq!(r.cli_exit_status(), 126);
    }
}
