//! cargo-nextest's default output: a status line per test (`FAIL [   0.003s] (1/6) crate::bin
//! path::name`; `TIMEOUT`, `SIGSEGV`, ... for a test that did not finish), the failed test's
//! output under it (`stdout ───`/`stderr ───` indented, or `--- STDOUT: ... ---` in older
//! versions) with its panic, and `Summary [...] 5 tests run: 4 passed, 1 failed, 0 skipped`.
//!
//! The status lines repeated after the summary are not read again.

use super::rust_panic::RustFailure;
use super::{BLOCK_LINES, count_items};
use crate::{Finding, FindingKind, Line, MAX_NAME, Reader, Sink, TestCounts};

const TOOL: &str = "nextest";

#[derive(Default)]
pub struct Nextest {
    block: Option<Block>,
    /// After the summary: its recap of the failures.
    summarized: bool,
}

struct Block {
    error: bool,
    status: String,
    name: String,
    failure: RustFailure,
    lines: usize,
}

impl Reader for Nextest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &[
            // Colour codes stand between the status and its time: the words alone.
            "FAIL", "TIMEOUT", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGKILL", "SIGTERM",
            "ABORT", "Summary", " across ",
        ]
    }

    fn wants_all(&self) -> bool {
        self.block.as_ref().is_some_and(|b| b.lines < BLOCK_LINES)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let s = line.text.trim_start();
        if s.starts_with("Starting ") && s.contains(" tests across ") {
            self.end_block(sink);
            self.summarized = false;
            return;
        }
        if let Some(rest) = s.strip_prefix("Summary [") {
            self.end_block(sink);
            self.summary(rest, sink);
            self.summarized = true;
            return;
        }
        if let Some((status, name)) = status_line(s) {
            self.end_block(sink);
            let failed = status == "FAIL";
            let error = matches!(status, "TIMEOUT" | "ABORT") || status.starts_with("SIG");
            if (failed || error) && !self.summarized {
                self.block = Some(Block {
                    error,
                    status: status.to_string(),
                    name: name.to_string(),
                    failure: RustFailure::default(),
                    lines: 0,
                });
            }
            return;
        }
        let Some(b) = &mut self.block else {
            return;
        };
        b.lines += 1;
        if s.starts_with("────") || s.starts_with("Cancelling ") {
            self.end_block(sink);
            return;
        }
        b.failure.line(s, sink);
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_block(sink);
    }
}

impl Nextest {
    fn end_block(&mut self, sink: &mut Sink) {
        let Some(mut b) = self.block.take() else {
            return;
        };
        let location = b
            .failure
            .place()
            .map(|(f, n, c)| sink.location(f, Some(*n), *c));
        let message = match b.failure.message() {
            Some(m) => m.to_string(),
            None if b.error => format!("{} (the test did not finish)", b.status),
            None => "failed".to_string(),
        };
        sink.push(Finding {
            kind: if b.error {
                FindingKind::TestError
            } else {
                FindingKind::TestFailed
            },
            tool: TOOL.into(),
            name: Some(b.name),
            location,
            message,
            excerpt: b.failure.excerpt.take(),
        });
    }

    /// `   0.019s] 6 tests run: 3 passed, 3 failed, 1 skipped` (after `Summary [`).
    fn summary(&mut self, rest: &str, sink: &mut Sink) {
        let Some((_, items)) = rest.split_once(" run: ") else {
            return;
        };
        let mut c = TestCounts::default();
        let ok = count_items(items, ',', |n, w| match w {
            "passed" => c.passed += n,
            "failed" => c.failed += n,
            "skipped" => c.skipped += n,
            "timed out" => c.errored += n,
            _ if w.starts_with("passed") => c.passed += n,
            _ => {}
        });
        if ok {
            sink.add_counts(TOOL, c);
        }
    }
}

/// `FAIL [   0.003s] (1/6) calc tests::adds_wrong` (the counter is absent in older versions,
/// `PASS`, `SKIP`, `SIGSEGV`, ... the other statuses): the status and the test's name.
fn status_line(s: &str) -> Option<(&str, &str)> {
    let (status, rest) = s.split_once(" [")?;
    if status.is_empty() || !status.bytes().all(|c| c.is_ascii_uppercase() || c == b'-') {
        return None;
    }
    let (time, rest) = rest.split_once("] ")?;
    if !time.trim().ends_with('s') {
        return None;
    }
    let rest = rest.trim_start();
    let rest = match rest.strip_prefix('(') {
        Some(r) => r.split_once(") ")?.1,
        None => rest,
    };
    // The binary's id, then the test's name.
    let (_, name) = rest.trim().split_once(' ')?;
    let name = name.trim();
    (!name.is_empty() && name.len() <= MAX_NAME).then_some((status, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_give_the_test() {
        assert_eq!(
            status_line("FAIL [   0.005s] (1/6) calc tests::adds_wrong"),
            Some(("FAIL", "tests::adds_wrong"))
        );
        assert_eq!(
            status_line("PASS [   0.006s] calc::it integration_ok"),
            Some(("PASS", "integration_ok"))
        );
        assert_eq!(
            status_line("Summary [   0.019s] 6 tests run: 3 passed"),
            None
        );
        assert_eq!(status_line("FAIL [not a time] x"), None);
    }
}
