//! Results as text a model reads: compact, saying what was cut and how to get the rest.
//!
//! The first line of an exec's text is its outcome (`exit_code: 0 (812 ms)`), so a harness can
//! keep that line alone as a note. Errors are `code: message`, the code being the API's.

use std::fmt::Write as _;

use taskbox_contract::api::{
    ApiError, DiffResult, EditResult, EntryKind, ExecOutcome, ForkResult, ListResult, PatchResult,
    ReadResult, SearchResult, WriteResult,
};
use taskbox_contract::result::{
    Change, ChangeKind, ExecResult, Finding, FindingKind, Output, TestCounts,
};

use crate::ArgsError;

/// An exec's outcome; `limit_ms` is the time limit that applied, when known (a timeout names it).
pub fn exec_outcome(outcome: &ExecOutcome, limit_ms: Option<u64>) -> String {
    match outcome {
        ExecOutcome::Finished(r) => exec(r, limit_ms),
        // The tools do not offer background execs; shown plainly all the same.
        ExecOutcome::Background(p) => format!(
            "started in the background as exec {} ({})\n",
            p.exec_id,
            if p.running { "running" } else { "ended" }
        ),
    }
}

/// The outcome line, then the output streams, the changed files and the policy's refusals.
pub fn exec(r: &ExecResult, limit_ms: Option<u64>) -> String {
    let mut s = if r.timed_out {
        format!(
            "timed out after {} ms: the whole process tree was killed (partial output below)",
            r.duration_ms
        )
    } else if let Some(signal) = r.signal {
        format!("killed by signal {signal} after {} ms", r.duration_ms)
    } else {
        match r.exit_code {
            Some(code) => format!("exit_code: {code} ({} ms)", r.duration_ms),
            None => "not run (no exit code)".to_owned(),
        }
    };
    if r.resources.oom_killed {
        s.push_str(" (out of memory: a process was killed at the memory limit)");
    }
    s.push('\n');
    if r.timed_out {
        let _ = writeln!(
            s,
            "hint: narrow the command (one test, a filter, a smaller input) or pass a larger \
             timeout_ms{}.",
            limit_ms
                .map(|l| format!(" (the limit was {l} ms)"))
                .unwrap_or_default()
        );
    }
    findings(&mut s, r);
    if r.stdout.bytes == 0 && r.stderr.bytes == 0 {
        s.push_str("(no output)\n");
    }
    stream(&mut s, "stdout", &r.stdout);
    stream(&mut s, "stderr", &r.stderr);
    if !r.changes.is_empty() {
        s.push_str("changed:\n");
        changes(&mut s, &r.changes);
    }
    if r.ignored_changes > 0 {
        let _ = writeln!(
            s,
            "({} more changed, ignored by git or under .git/)",
            r.ignored_changes
        );
    }
    for v in &r.violations {
        let _ = writeln!(s, "violation ({}): {}", v.kind, v.detail);
    }
    if let Some(net) = r
        .network
        .as_ref()
        .filter(|n| n.allowed + n.denied + n.failed > 0)
    {
        let _ = writeln!(
            s,
            "network (egress proxy): {} allowed, {} denied, {} failed",
            net.allowed, net.denied, net.failed
        );
    }
    s
}

/// Findings listed in an exec's text; the rest are counted.
pub const FINDINGS_SHOWN: usize = 20;
/// Findings shown with their excerpt (the first ones, the most telling).
pub const EXCERPTS_SHOWN: usize = 5;

/// The test counts and the findings of an exec, before its output: what failed and where,
/// read from the whole of the output (the text below may be cut).
pub fn findings(s: &mut String, r: &ExecResult) {
    findings_of(s, &r.findings, r.findings_omitted, r.tests.as_ref());
}

fn findings_of(s: &mut String, list: &[Finding], omitted: u64, tests: Option<&TestCounts>) {
    if let Some(t) = tests {
        let _ = writeln!(
            s,
            "tests: {} passed, {} failed, {} errored, {} skipped",
            t.passed, t.failed, t.errored, t.skipped
        );
    }
    if list.is_empty() {
        return;
    }
    let total = list.len() as u64 + omitted;
    let _ = writeln!(s, "findings ({total}, read from the whole output):");
    for (i, f) in list.iter().take(FINDINGS_SHOWN).enumerate() {
        finding_line(s, f);
        if i < EXCERPTS_SHOWN
            && let Some(ex) = &f.excerpt
        {
            for line in ex.lines() {
                let _ = writeln!(s, "    {line}");
            }
        }
    }
    let more = total.saturating_sub(FINDINGS_SHOWN.min(list.len()) as u64);
    if more > 0 {
        let _ = writeln!(s, "({more} more findings not listed)");
    }
}

/// The counts and findings of a verification command, as [`findings`] lists an exec's.
pub fn verify_findings(list: &[Finding], tests: Option<&TestCounts>) -> String {
    let mut s = String::new();
    findings_of(&mut s, list, 0, tests);
    s
}

/// One finding as a line: `- kind [tool] file:line:col name: message`.
pub fn finding_line(s: &mut String, f: &Finding) {
    let kind = match f.kind {
        FindingKind::TestFailed => "test failed",
        FindingKind::TestError => "test error",
        FindingKind::CompileError => "compile error",
        FindingKind::Lint => "lint",
    };
    let _ = write!(s, "- {kind} [{}]", f.tool);
    if let Some(l) = &f.location {
        let _ = write!(s, " {}", l.file);
        if let Some(line) = l.line {
            let _ = write!(s, ":{line}");
            if let Some(col) = l.column {
                let _ = write!(s, ":{col}");
            }
        }
    }
    if let Some(name) = &f.name {
        let _ = write!(s, " {name}");
    }
    let _ = writeln!(s, ": {}", f.message);
}

fn stream(s: &mut String, name: &str, out: &Output) {
    if out.bytes == 0 {
        return;
    }
    if out.truncated {
        let _ = write!(s, "{name} ({} bytes, cut: head and tail shown", out.bytes);
        if let Some(path) = &out.spill_path {
            let _ = write!(
                s,
                "; the whole stream is in {path}, readable with read_file"
            );
        }
        s.push_str("):\n");
    } else {
        let _ = writeln!(s, "{name}:");
    }
    s.push_str(&out.text);
    if !out.text.ends_with('\n') {
        s.push_str("\n[no newline at end]\n");
    }
}

fn kind_word(kind: ChangeKind) -> &'static str {
    match kind {
        ChangeKind::Added => "added",
        ChangeKind::Modified => "modified",
        ChangeKind::Deleted => "deleted",
    }
}

fn changes(s: &mut String, list: &[Change]) {
    for c in list {
        let _ = writeln!(s, "  {} {}", kind_word(c.kind), c.path);
    }
}

/// The content itself; a note after it when it is partial, binary or empty.
pub fn read(r: &ReadResult) -> String {
    let lines = r
        .total_lines
        .map(|l| format!(", {l} lines"))
        .unwrap_or_default();
    let mut s = if r.binary {
        format!(
            "{} is binary ({} bytes); content, base64-encoded:\n{}",
            r.path, r.total_bytes, r.content
        )
    } else if r.content.is_empty() {
        format!(
            "(nothing to show: {} has {} bytes{lines})\n",
            r.path, r.total_bytes
        )
    } else {
        r.content.clone()
    };
    if r.truncated {
        if !s.ends_with('\n') {
            s.push('\n');
        }
        let _ = writeln!(
            s,
            "[cut at max_bytes: {} has {} bytes{lines}; read more with line_start/line_end or \
             offset/length]",
            r.path, r.total_bytes
        );
    }
    s
}

pub fn write(r: &WriteResult) -> String {
    format!(
        "{} {} ({} bytes)",
        if r.created { "created" } else { "replaced" },
        r.path,
        r.bytes_written
    )
}

pub fn edit(r: &EditResult) -> String {
    format!(
        "edited {}: {}\n{}",
        r.path,
        counted(r.replacements as usize, "replacement", "replacements"),
        r.diff
    )
}

pub fn patch(r: &PatchResult) -> String {
    let mut s = format!(
        "patch applied: {}\n",
        counted(r.files.len(), "file", "files")
    );
    changes(&mut s, &r.files);
    s
}

pub fn list(r: &ListResult) -> String {
    let mut s = String::new();
    for e in &r.entries {
        match e.kind {
            EntryKind::Dir => {
                let _ = writeln!(s, "{}/", e.path);
            }
            EntryKind::Symlink => {
                let _ = writeln!(s, "{} (symlink)", e.path);
            }
            EntryKind::File | EntryKind::Other => {
                let _ = writeln!(s, "{} ({} bytes)", e.path, e.size);
            }
        }
    }
    if r.entries.is_empty() {
        s.push_str("(no entries)\n");
    }
    if r.truncated {
        let _ = writeln!(
            s,
            "[cut at {} entries; narrow it with path or glob, or raise limit]",
            r.entries.len()
        );
    }
    s
}

pub fn search(r: &SearchResult) -> String {
    let mut s = String::new();
    for m in &r.matches {
        let _ = writeln!(s, "{}:{}: {}", m.path, m.line_number, m.line.trim_end());
    }
    let _ = write!(
        s,
        "{} in {} searched",
        counted(r.matches.len(), "match", "matches"),
        counted(r.files_searched as usize, "file", "files")
    );
    if r.truncated {
        s.push_str(" (cut at max_matches; narrow the pattern, path or glob)");
    }
    s.push('\n');
    s
}

pub fn diff(r: &DiffResult) -> String {
    let mut notes = String::new();
    if r.ignored > 0 && !r.files.iter().any(|f| f.ignored) {
        let _ = writeln!(
            notes,
            "{} left out (ignored by git, or under .git/): include_ignored lists them",
            counted(r.ignored as usize, "change", "changes")
        );
    }
    for f in &r.flagged {
        let _ = writeln!(notes, "flagged {}: {}", f.path, f.reason);
    }
    if r.files.is_empty() {
        return format!("no changes\n{notes}");
    }
    let mut s = notes;
    s += &format!(
        "{}, {}(+), {}(-)\n",
        counted(r.stats.files, "file changed", "files changed"),
        counted(r.stats.insertions, "insertion", "insertions"),
        counted(r.stats.deletions, "deletion", "deletions"),
    );
    for f in &r.files {
        let binary = if f.binary { " (binary)" } else { "" };
        let ignored = if f.ignored { " (ignored)" } else { "" };
        let _ = writeln!(s, "  {} {}{binary}{ignored}", kind_word(f.status), f.path);
    }
    s.push('\n');
    s.push_str(&r.diff);
    s
}

/// An API error: `code: message`.
/// A fork's result: the new sandboxes' ids, and how to work in one.
pub fn fork(r: &ForkResult) -> String {
    let ids: Vec<&str> = r.sandboxes.iter().map(|i| i.id.as_str()).collect();
    format!(
        "forked {}: {}\nGive one of these ids as `sandbox` to the other tools to work in that \
         fork; each starts as the sandbox was, and what happens in one is seen in no other.",
        counted(ids.len(), "sandbox", "sandboxes"),
        ids.join(", ")
    )
}

pub fn api_error(e: &ApiError) -> String {
    format!("{}: {e}", e.code())
}

/// A refused call: its message alone, which says what it is (`invalid arguments for ...`).
pub fn args_error(e: &ArgsError) -> String {
    e.to_string()
}

/// `1 file`, `2 files`.
fn counted(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use taskbox_contract::api::{Entry, FileDiff, Match};
    use taskbox_contract::result::DiffStats;
    use taskbox_contract::result::{Enforcement, Resources, Violation};

    use super::*;

    fn result() -> ExecResult {
        ExecResult {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            duration_ms: 812,
            stdout: Output {
                text: "hi\n".into(),
                bytes: 3,
                truncated: false,
                spill_path: None,
            },
            stderr: Output::default(),
            changes: vec![Change {
                path: "f.txt".into(),
                kind: ChangeKind::Added,
            }],
            violations: vec![],
            resources: Resources::default(),
            enforcement: Enforcement {
                landlock: "full".into(),
                seccomp: true,
                network: "none".into(),
                limits: "cgroup-v2".into(),
                disk: "none".into(),
            },
            network: None,
            findings: Vec::new(),
            findings_omitted: 0,
            tests: None,
            ignored_changes: 0,
        }
    }

    #[test]
    fn exec_renders_status_streams_and_changes() {
        assert_eq!(
            exec(&result(), None),
            "exit_code: 0 (812 ms)\nstdout:\nhi\nchanged:\n  added f.txt\n"
        );
    }

    #[test]
    fn findings_come_before_the_output_with_locations() {
        use taskbox_contract::result::Location;
        let mut r = result();
        r.exit_code = Some(1);
        r.tests = Some(TestCounts {
            passed: 3,
            failed: 1,
            errored: 0,
            skipped: 2,
        });
        r.findings = (0..(FINDINGS_SHOWN + 2))
            .map(|i| Finding {
                kind: FindingKind::TestFailed,
                tool: "pytest".into(),
                name: Some(format!("tests/test_a.py::test_{i}")),
                location: Some(Location {
                    file: "tests/test_a.py".into(),
                    line: Some(12 + i as u32),
                    column: None,
                }),
                message: "assert 1 == 2".into(),
                excerpt: Some("E   assert 1 == 2".into()),
            })
            .collect();
        r.findings_omitted = 3;
        let text = exec(&r, None);
        assert!(
            text.starts_with(
                "exit_code: 1 (812 ms)\ntests: 3 passed, 1 failed, 0 errored, 2 skipped\n\
                 findings (25, read from the whole output):\n\
                 - test failed [pytest] tests/test_a.py:12 tests/test_a.py::test_0: assert 1 == 2\n    \
                 E   assert 1 == 2\n"
            ),
            "{text}"
        );
        assert_eq!(
            text.matches("    E   assert").count(),
            EXCERPTS_SHOWN,
            "{text}"
        );
        assert!(
            text.contains("(5 more findings not listed)\nstdout:\nhi\n"),
            "{text}"
        );
    }

    #[test]
    fn exec_renders_truncation_timeouts_and_violations() {
        let mut r = result();
        r.exit_code = None;
        r.timed_out = true;
        r.stderr = Output {
            text: "head\n[... 10 bytes omitted ...]\ntail".into(),
            bytes: 30,
            truncated: true,
            spill_path: Some("/.taskbox/out/7.stderr".into()),
        };
        r.violations = vec![Violation {
            kind: "network".into(),
            detail: "connect evil.example:443 denied".into(),
        }];
        let text = exec(&r, Some(1000));
        assert!(
            text.starts_with(
                "timed out after 812 ms: the whole process tree was killed (partial output \
                 below)\nhint: narrow the command (one test, a filter, a smaller input) or pass \
                 a larger timeout_ms (the limit was 1000 ms).\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "stderr (30 bytes, cut: head and tail shown; the whole stream is in \
                 /.taskbox/out/7.stderr, readable with read_file):\nhead\n"
            ),
            "{text}"
        );
        assert!(text.contains("tail\n[no newline at end]\n"), "{text}");
        assert!(text.contains("violation (network): connect evil.example:443 denied\n"));
    }

    #[test]
    fn empty_output_oom_and_refusals_are_said() {
        let mut r = result();
        r.stdout = Output::default();
        r.changes.clear();
        r.exit_code = Some(3);
        assert_eq!(exec(&r, None), "exit_code: 3 (812 ms)\n(no output)\n");
        r.resources.oom_killed = true;
        r.exit_code = None;
        r.signal = Some(9);
        assert!(exec(&r, None).starts_with(
            "killed by signal 9 after 812 ms (out of memory: a process was killed at the \
                 memory limit)\n"
        ));
        r.signal = None;
        r.resources.oom_killed = false;
        r.violations = vec![Violation {
            kind: "command".into(),
            detail: "`git push` is forbidden".into(),
        }];
        assert_eq!(
            exec(&r, None),
            "not run (no exit code)\n(no output)\nviolation (command): `git push` is forbidden\n"
        );
    }

    fn read_result(content: &str) -> ReadResult {
        ReadResult {
            path: "a.txt".into(),
            content: content.into(),
            encoding: "utf-8".into(),
            total_bytes: 100,
            total_lines: Some(10),
            truncated: false,
            binary: false,
        }
    }

    #[test]
    fn reads_are_the_content_with_a_note_when_partial() {
        assert_eq!(read(&read_result("one\ntwo\n")), "one\ntwo\n");
        let mut r = read_result("one");
        r.truncated = true;
        assert_eq!(
            read(&r),
            "one\n[cut at max_bytes: a.txt has 100 bytes, 10 lines; read more with \
             line_start/line_end or offset/length]\n"
        );
        assert_eq!(
            read(&read_result("")),
            "(nothing to show: a.txt has 100 bytes, 10 lines)\n"
        );
        let mut r = read_result("AP8=");
        r.binary = true;
        r.total_lines = None;
        assert_eq!(
            read(&r),
            "a.txt is binary (100 bytes); content, base64-encoded:\nAP8="
        );
    }

    #[test]
    fn file_operations_say_what_they_did() {
        let w = WriteResult {
            path: "b.txt".into(),
            bytes_written: 4,
            created: true,
            sha256: None,
        };
        assert_eq!(write(&w), "created b.txt (4 bytes)");
        let e = EditResult {
            path: "a.rs".into(),
            replacements: 2,
            diff: "@@ -1 +1 @@\n-a\n+b\n".into(),
        };
        assert_eq!(
            edit(&e),
            "edited a.rs: 2 replacements\n@@ -1 +1 @@\n-a\n+b\n"
        );
        let p = PatchResult {
            files: vec![Change {
                path: "x".into(),
                kind: ChangeKind::Modified,
            }],
        };
        assert_eq!(patch(&p), "patch applied: 1 file\n  modified x\n");
    }

    #[test]
    fn listings_searches_and_diffs_say_what_was_cut() {
        let l = ListResult {
            entries: vec![
                Entry {
                    path: "src".into(),
                    kind: EntryKind::Dir,
                    size: 0,
                },
                Entry {
                    path: "link".into(),
                    kind: EntryKind::Symlink,
                    size: 0,
                },
                Entry {
                    path: "a.rs".into(),
                    kind: EntryKind::File,
                    size: 12,
                },
            ],
            truncated: true,
        };
        assert_eq!(
            list(&l),
            "src/\nlink (symlink)\na.rs (12 bytes)\n[cut at 3 entries; narrow it with path or \
             glob, or raise limit]\n"
        );
        let s = SearchResult {
            matches: vec![Match {
                path: "b.txt".into(),
                line_number: 1,
                line: "two\n".into(),
            }],
            truncated: false,
            files_searched: 2,
        };
        assert_eq!(search(&s), "b.txt:1: two\n1 match in 2 files searched\n");
        let d = DiffResult {
            files: vec![FileDiff {
                path: "a".into(),
                status: ChangeKind::Modified,
                binary: false,
                mode_change: None,
                ignored: false,
            }],
            diff: "--- a/a\n+++ b/a\n".into(),
            stats: DiffStats {
                files: 1,
                insertions: 1,
                deletions: 0,
            },
            ignored: 0,
            flagged: Vec::new(),
        };
        assert_eq!(
            diff(&d),
            "1 file changed, 1 insertion(+), 0 deletions(-)\n  modified a\n\n--- a/a\n+++ b/a\n"
        );
    }

    #[test]
    fn errors_carry_their_code() {
        let e = ApiError::EditAmbiguous("3 matches at lines 1, 4, 9".into());
        assert_eq!(api_error(&e), "edit_ambiguous: 3 matches at lines 1, 4, 9");
    }
}
