//! Observations: the structured results an agent sees. JSON field names here are the contract of
//! DESIGN.md and must not change.

use serde::{Deserialize, Serialize};

/// The observation of one command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExecResult {
    /// The command's exit code; `null` when it was killed by a signal.
    pub exit_code: Option<i32>,
    /// The signal that killed the command, if any.
    pub signal: Option<i32>,
    /// The wall-clock timeout fired and the whole process tree was killed.
    pub timed_out: bool,
    pub duration_ms: u64,
    pub stdout: Output,
    pub stderr: Output,
    /// What the command changed in the workspace, less what a reviewer does not review: paths
    /// the workspace's git ignores (and does not track) and git's own files under `.git/`.
    pub changes: Vec<Change>,
    /// How many changes `changes` leaves out for that reason (`diff` with `include_ignored`
    /// lists them); absent when none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ignored_changes: u64,
    /// What the policy refused, in words a model can act on.
    pub violations: Vec<Violation>,
    pub resources: Resources,
    pub enforcement: Enforcement,
    /// What went through the egress proxy while the command ran (network mode "proxy" only;
    /// absent otherwise, and in results recorded before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkActivity>,
    /// What the tools of the command reported as failing, read from the whole of its output
    /// (and the JUnit XML files it wrote): failed tests, compiler errors, lint findings, most
    /// telling first. Empty when no tool of the command was recognised; never a cause of the
    /// exec's outcome (docs/findings.md).
    #[serde(default)]
    pub findings: Vec<Finding>,
    /// Findings left out of `findings` beyond its bound (100); absent when none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub findings_omitted: u64,
    /// The test counts the command's test runners reported (summed over them), when any did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests: Option<TestCounts>,
}

impl ExecResult {
    /// The exit status a CLI reports for this result: the command's own, 128+N for signal N, 124
    /// on timeout (the conventions of timeout(1)), 126 when the command policy refused it (a
    /// command that was found but not run, as the shell says).
    pub fn cli_exit_status(&self) -> i32 {
        if self.timed_out {
            124
        } else if let Some(signal) = self.signal {
            128 + signal
        } else if let Some(code) = self.exit_code {
            code
        } else if self.refused_by_command_policy() {
            126
        } else {
            125
        }
    }

    /// Nothing ran because the command policy refused it (forbidden, or an approval denied).
    pub fn refused_by_command_policy(&self) -> bool {
        self.exit_code.is_none()
            && self.signal.is_none()
            && !self.timed_out
            && self.violations.iter().any(|v| v.kind == "command")
    }
}

/// What a tool of the command reported as failing: a failed test, a compiler error, a lint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Finding {
    pub kind: FindingKind,
    /// The tool that reported it: "pytest", "unittest", "cargo-test", "nextest", "go-test",
    /// "jest", "vitest", "junit", "rustc", "gcc", "clang", "tsc", "mypy", "ruff", "eslint".
    pub tool: String,
    /// The test's id (`tests/test_a.py::test_b`, `module::test`, `TestX/sub`) or the
    /// diagnostic's code (`E0308`, `TS2322`, `F401`, `no-unused-vars`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where: a file relative to the workspace when it is inside it (as the tool gave it
    /// otherwise), with line and column when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<Location>,
    /// One line: the assertion, the error's message.
    pub message: String,
    /// A few lines of context (expected and actual, the source line, the first frames inside
    /// the workspace), bounded in size; absent when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excerpt: Option<String>,
}

/// What kind of finding.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// A test ran and its assertion failed.
    TestFailed,
    /// A test could not run to its assertion: an exception outside it, a failed setup, a crash.
    TestError,
    /// A compiler or type checker refused the code.
    CompileError,
    /// A linter's finding (or a compiler's warning).
    Lint,
}

/// A place in a file.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Location {
    pub file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<u32>,
}

/// Test counts as the runners reported them.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct TestCounts {
    pub passed: u64,
    pub failed: u64,
    pub errored: u64,
    pub skipped: u64,
}

/// One captured output stream: head and tail within the output limit, the byte count, and the
/// path of the full stream when it did not fit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Output {
    /// Head and tail of the stream as text (invalid UTF-8 replaced), joined by a marker line that
    /// says how many bytes were left out.
    pub text: String,
    /// Total bytes the command wrote to the stream.
    pub bytes: u64,
    /// `text` does not hold the whole stream.
    pub truncated: bool,
    /// The file that holds the whole stream, when `truncated`.
    pub spill_path: Option<String>,
}

impl Output {
    /// Appends, to this stream (stderr), why `program` could not be run: `errno` from execve.
    pub fn note_exec_failure(&mut self, errno: i32, program: &str) {
        let line = exec_failure_line(errno, program) + "\n";
        self.text.push_str(&line);
        self.bytes += line.len() as u64;
    }
}

/// The line that says why `program` could not be run (`errno` from execve), the same on every
/// surface.
pub fn exec_failure_line(errno: i32, program: &str) -> String {
    let why = if errno == libc::ENOENT {
        "command not found".to_string()
    } else {
        std::io::Error::from_raw_os_error(errno).to_string()
    };
    format!("taskbox: cannot run `{program}`: {why}")
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A changed file that a tool runs, or reads to decide what to run, on its own when a person
/// opens the repository, enters its directory, commits or pushes (`.envrc`, `.vscode/tasks.json`,
/// git hooks, CI definitions; the list is in docs/security.md). `export` with `apply` refuses to
/// write one unless the request allows it.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct AutorunFile {
    pub path: String,
    /// What runs it, and when.
    pub reason: String,
    /// The change is also left out of the files shown (ignored by git, or under `.git/`): it is
    /// listed here all the same, and exported only on request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignored: bool,
}

/// One changed path in the workspace, relative to the workspace root.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
}

/// How a path changed.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// Something the policy refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Violation {
    /// "network", "filesystem", "limit", "command", ...
    pub kind: String,
    /// What happened and what to change to allow it.
    pub detail: String,
}

impl Violation {
    /// The exec ran longer than `limit`, and its whole process tree was killed.
    pub fn timeout(limit: std::time::Duration) -> Violation {
        Violation {
            kind: "timeout".into(),
            detail: format!(
                "the command ran longer than {} and its whole process tree was killed; narrow \
                 the command or raise timeout_ms",
                humantime::format_duration(limit)
            ),
        }
    }

    /// The kernel killed a process of the exec at the memory limit of `bytes`.
    pub fn memory_limit(bytes: u64) -> Violation {
        Violation {
            kind: "limit".into(),
            detail: format!(
                "memory limit of {} reached: the kernel killed a process; raise limits.memory \
                 in the policy or use less memory",
                crate::policy::human_size(bytes)
            ),
        }
    }
}

impl Violation {
    /// The workspace holds entries whose paths are longer than a path can be (4,095 bytes),
    /// beneath `dir` (relative to the workspace): no look-up by path reaches them, so they are
    /// left out of the exec's changes, and the operations that read every path refuse.
    pub fn unnamed_paths(dir: &str) -> Violation {
        let top = dir.split('/').next().unwrap_or(dir);
        let shown = crate::api::excerpt(dir);
        Violation {
            kind: "limit".into(),
            detail: format!(
                "the workspace nests directories past the 4,095 bytes a path can hold, beneath \
                 {shown}: what is deeper cannot be named, so its changes are not listed, and \
                 diff, export, checkpoint and fork refuse until it is gone; remove it (rm -rf \
                 {top})"
            ),
        }
    }

    /// The sandbox's disk quota of `bytes` is full: its writes fail with `ENOSPC`.
    pub fn disk_limit(bytes: u64) -> Violation {
        Violation {
            kind: "limit".into(),
            detail: format!(
                "disk limit of {} reached: writes fail with \"no space left on device\"; raise \
                 limits.disk in the policy or write less (remove files the sandbox no longer \
                 needs)",
                crate::policy::human_size(bytes)
            ),
        }
    }

    /// With `--write-through`, `count` calls (`calls` by name) that would have given a file in
    /// the host's directory a setuid or setgid mode were refused with `EPERM`.
    pub fn setid_refused(count: u32, calls: &[String]) -> Violation {
        let what = if calls.is_empty() {
            String::new()
        } else {
            format!(" ({})", calls.join(", "))
        };
        Violation {
            kind: "filesystem".into(),
            detail: format!(
                "{count} call{s}{what} that would have given a file a setuid or setgid mode \
                 {were} refused (EPERM): with --write-through the workspace is the host's own \
                 directory, where such a file would run with its owner's ids for any local \
                 user; leave the bits off, or run without --write-through and review the diff",
                s = if count == 1 { "" } else { "s" },
                were = if count == 1 { "was" } else { "were" },
            ),
        }
    }

    /// A process of the exec tried to make a file larger than `bytes`: the kernel stopped the
    /// write (`SIGXFSZ`, or `EFBIG` where the signal is ignored).
    pub fn file_size_limit(bytes: u64) -> Violation {
        Violation {
            kind: "limit".into(),
            detail: format!(
                "file size limit of {} reached: the kernel stopped a write past it (SIGXFSZ); \
                 raise limits.file_size in the policy or write smaller files",
                crate::policy::human_size(bytes)
            ),
        }
    }
}

/// The egress proxy's decisions during one exec: counts, bytes, and the connections one by one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NetworkActivity {
    /// Connections the proxy allowed and made.
    pub allowed: u64,
    /// Connections the policy refused (each distinct one is also a violation).
    pub denied: u64,
    /// Connections allowed but not made: the name did not resolve, or the destination refused.
    pub failed: u64,
    /// Bytes sent by the sandbox and received by it over the allowed connections that ended.
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// Allowed connections still open when the exec's result was made.
    pub open: u64,
    /// The connections in order, at most 64.
    pub connections: Vec<NetworkConnection>,
    /// Connections not listed in `connections` (beyond the first 64).
    pub omitted: u64,
    /// HTTP requests refused by the policy's request rules on inspected hosts (each listed in
    /// `connections` with its `request`, and a violation).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub requests_denied: u64,
    /// The secrets the proxy presented, per secret and host: every use is counted (the values
    /// never appear anywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretUse>,
}

/// How many requests to one host carried one secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SecretUse {
    /// The secret's name in the policy.
    pub secret: String,
    pub host: String,
    pub port: u16,
    pub requests: u64,
}

/// One connection the sandbox asked the egress proxy for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NetworkConnection {
    /// The host asked for (a name, or an address; IPv6 in brackets).
    pub host: String,
    pub port: u16,
    /// "connect" (HTTP CONNECT), "forward" (plain HTTP) or "socks5".
    pub protocol: String,
    /// "allowed", "denied" or "failed".
    pub outcome: String,
    /// The address connected to, or the one refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// The rule that decided: "allow PATTERN" or "deny PATTERN".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Why it was refused or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What to change in the policy to allow it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Set once an allowed connection has ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_up: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_down: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Why an allowed connection ended abnormally (idle, I/O error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its HTTP was inspected (the host has secrets or request rules).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inspected: bool,
    /// For a request refused by the request rules: its method and path ("POST /upload").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
}

/// Resources the command used.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Resources {
    pub cpu_ms: u64,
    pub max_rss_bytes: u64,
    /// The kernel's OOM killer ended a process of the command (memory limit reached).
    pub oom_killed: bool,
}

/// Which confinement mechanisms were in force for the command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Enforcement {
    /// "full", "partial" or "none".
    pub landlock: String,
    pub seccomp: bool,
    /// "none" (loopback only), "proxy" or "host".
    pub network: String,
    /// "cgroup-v2", "cgroup-v1" or "rlimit".
    pub limits: String,
    /// How `limits.disk` is held: "loop-ext4" (a file system of that size on a loop device),
    /// "tmpfs" (a tmpfs of that size, in memory) or "none"; empty in results recorded before
    /// the disk quota existed.
    #[serde(default)]
    pub disk: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_field_names_are_the_contract() {
        let r = ExecResult {
            exit_code: Some(1),
            signal: None,
            timed_out: false,
            duration_ms: 812,
            stdout: Output {
                text: "x".into(),
                bytes: 1,
                truncated: false,
                spill_path: None,
            },
            stderr: Output::default(),
            changes: vec![Change {
                path: "src/lib.rs".into(),
                kind: ChangeKind::Modified,
            }],
            violations: vec![],
            resources: Resources::default(),
            enforcement: Enforcement {
                landlock: "full".into(),
                seccomp: true,
                network: "none".into(),
                limits: "cgroup-v1".into(),
                disk: "loop-ext4".into(),
            },
            network: None,
            findings: Vec::new(),
            findings_omitted: 0,
            tests: None,
            ignored_changes: 0,
        };
        let v = serde_json::to_value(&r).unwrap();
        let mut keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "changes",
                "duration_ms",
                "enforcement",
                "exit_code",
                "findings",
                "resources",
                "signal",
                "stderr",
                "stdout",
                "timed_out",
                "violations"
            ]
        );
        assert_eq!(v["changes"][0]["kind"], "modified");
        assert_eq!(v["stdout"]["spill_path"], serde_json::Value::Null);
        for k in ["cpu_ms", "max_rss_bytes", "oom_killed"] {
            assert!(v["resources"].get(k).is_some(), "{k}");
        }
        for k in ["landlock", "seccomp", "network", "limits", "disk"] {
            assert!(v["enforcement"].get(k).is_some(), "{k}");
        }
        // Under mode "proxy" the proxy's activity comes along.
        let mut r = r;
        r.network = Some(NetworkActivity::default());
        let v = serde_json::to_value(&r).unwrap();
        for k in [
            "allowed",
            "denied",
            "failed",
            "bytes_up",
            "bytes_down",
            "open",
            "connections",
            "omitted",
        ] {
            assert!(v["network"].get(k).is_some(), "{k}");
        }
    }

    #[test]
    fn exit_status_conventions() {
        let mut r: ExecResult = serde_json::from_value(serde_json::json!({
            "exit_code": 3, "signal": null, "timed_out": false, "duration_ms": 1,
            "stdout": {"text": "", "bytes": 0, "truncated": false, "spill_path": null},
            "stderr": {"text": "", "bytes": 0, "truncated": false, "spill_path": null},
            "changes": [], "violations": [],
            "resources": {"cpu_ms": 0, "max_rss_bytes": 0, "oom_killed": false},
            "enforcement": {"landlock": "full", "seccomp": true, "network": "none", "limits": "rlimit"}
        }))
        .unwrap();
        assert_eq!(r.cli_exit_status(), 3);
        r.exit_code = None;
        r.signal = Some(9);
        assert_eq!(r.cli_exit_status(), 137);
        r.timed_out = true;
        assert_eq!(r.cli_exit_status(), 124);
        r.timed_out = false;
        r.signal = None;
        assert_eq!(r.cli_exit_status(), 125);
        r.violations.push(Violation {
            kind: "command".into(),
            detail: "`git push` is forbidden".into(),
        });
        assert_eq!(r.cli_exit_status(), 126);
    }
}

/// Line counts of a rendered diff.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct DiffStats {
    /// Changes rendered (directory entries, `path/`, are not files and are not counted).
    pub files: usize,
    /// Lines added across all text hunks.
    pub insertions: usize,
    /// Lines removed across all text hunks.
    pub deletions: usize,
}
