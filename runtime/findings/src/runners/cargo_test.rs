//! `cargo test` (libtest's default output): `test path::name ... FAILED` (`path::name --- FAILED`
//! with `-q`), a `---- path::name stdout ----` block per failed test with its panic, and one
//! `test result: FAILED. 3 passed; 1 failed; 0 ignored; ...` per test binary, summed. Doctests
//! (`src/lib.rs - add (line 3)`) are placed at their line in the file.
//!
//! Inside a nextest run (which prints libtest's output of each test indented, or under
//! `--- STDOUT:` in older versions) this reader stands aside.

use super::rust_panic::RustFailure;
use super::{BLOCK_LINES, digits};
use crate::{Finding, FindingKind, Line, MAX_FINDINGS, MAX_NAME, Reader, Sink, TestCounts};

const TOOL: &str = "cargo-test";

#[derive(Default)]
pub struct CargoTest {
    block: Option<Block>,
    /// Tests that the run reported FAILED, without a block yet (at most [`MAX_FINDINGS`]).
    failed: Vec<String>,
    /// Inside a nextest run.
    nextest: bool,
}

struct Block {
    name: String,
    failure: RustFailure,
    lines: usize,
}

impl Reader for CargoTest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &[
            // Colour codes may stand between a word and the next: one word each.
            "FAILED",
            "---- ",
            "result: ",
            "failures:",
            "Nextest run",
            " across ",
            "Summary",
            "Running ",
        ]
    }

    fn wants_all(&self) -> bool {
        self.block.as_ref().is_some_and(|b| b.lines < BLOCK_LINES)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        if self.nextest {
            // Nextest's summary ends its run; cargo's `Running` starts a libtest one.
            if t.trim_start().starts_with("Summary [")
                || t.trim_start().starts_with("Running unittests ")
            {
                self.nextest = false;
            }
            return;
        }
        if t.contains("Nextest run ID")
            || (t.trim_start().starts_with("Starting ") && t.contains(" tests across "))
        {
            self.end_block(sink);
            self.failed.clear();
            self.nextest = true;
            return;
        }
        if let Some(name) = block_header(t) {
            self.end_block(sink);
            self.failed.retain(|f| f != name);
            self.block = Some(Block {
                name: name.to_string(),
                failure: RustFailure::default(),
                lines: 0,
            });
            return;
        }
        if t == "failures:" {
            self.end_block(sink);
            return;
        }
        if let Some(rest) = t.strip_prefix("test result: ") {
            self.end_block(sink);
            self.result(rest, sink);
            return;
        }
        if let Some(b) = &mut self.block {
            b.lines += 1;
            b.failure.line(t, sink);
            return;
        }
        let name = t
            .strip_prefix("test ")
            .and_then(|r| r.strip_suffix(" ... FAILED"))
            .or_else(|| t.strip_suffix(" --- FAILED"));
        if let Some(name) = name
            && !name.is_empty()
            && !t.starts_with(' ')
            && self.failed.len() < MAX_FINDINGS
            && name.len() <= MAX_NAME
        {
            self.failed.push(name.to_string());
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_block(sink);
        self.report_unblocked(sink);
    }
}

impl CargoTest {
    fn end_block(&mut self, sink: &mut Sink) {
        let Some(mut b) = self.block.take() else {
            return;
        };
        let doctest = doctest_place(&b.name);
        let location = match (&doctest, b.failure.place()) {
            (Some((f, n)), _) => Some(sink.location(f, Some(*n), None)),
            (None, Some((f, n, c))) => Some(sink.location(f, Some(*n), *c)),
            (None, None) => None,
        };
        let message = b.failure.message().unwrap_or("failed").to_string();
        sink.push(Finding {
            kind: FindingKind::TestFailed,
            tool: TOOL.into(),
            name: Some(b.name),
            location,
            message,
            excerpt: b.failure.excerpt.take(),
        });
    }

    /// `ok. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s`.
    fn result(&mut self, rest: &str, sink: &mut Sink) {
        let Some((_, items)) = rest.split_once(". ") else {
            return;
        };
        let mut c = TestCounts::default();
        let mut known = 0;
        for item in items.split("; ") {
            let (n, word) = digits(item);
            let Some(n) = n else { continue };
            match word.trim() {
                "passed" => c.passed += u64::from(n),
                "failed" => c.failed += u64::from(n),
                "ignored" => c.skipped += u64::from(n),
                _ => continue,
            }
            known += 1;
        }
        if known == 3 {
            sink.add_counts(TOOL, c);
            self.report_unblocked(sink);
        }
    }

    /// Tests reported FAILED that had no block (their output was not captured).
    fn report_unblocked(&mut self, sink: &mut Sink) {
        for name in std::mem::take(&mut self.failed) {
            if sink.has(FindingKind::TestFailed, &name) {
                continue;
            }
            let location = doctest_place(&name).map(|(f, n)| sink.location(&f, Some(n), None));
            sink.push(Finding {
                kind: FindingKind::TestFailed,
                tool: TOOL.into(),
                name: Some(name),
                location,
                message: "failed".into(),
                excerpt: None,
            });
        }
    }
}

/// `---- path::name stdout ----`: the test's name.
fn block_header(t: &str) -> Option<&str> {
    let name = t
        .strip_prefix("---- ")?
        .strip_suffix(" stdout ----")
        .or_else(|| t.strip_prefix("---- ")?.strip_suffix(" stderr ----"))?;
    (!name.is_empty() && name.len() <= MAX_NAME).then_some(name)
}

/// A doctest's file and line from its name: `src/lib.rs - add (line 3)`.
fn doctest_place(name: &str) -> Option<(String, u32)> {
    let (file, rest) = name.split_once(" - ")?;
    let at = rest.rfind("(line ")?;
    let (n, tail) = digits(&rest[at + "(line ".len()..]);
    if !tail.starts_with(')') || file.contains(' ') {
        return None;
    }
    Some((file.to_string(), n?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doctests_are_placed() {
        assert_eq!(
            doctest_place("src/lib.rs - add (line 3)"),
            Some(("src/lib.rs".to_string(), 3))
        );
        assert_eq!(
            doctest_place("src/lib.rs - Foo<T>::bar (line 10)"),
            Some(("src/lib.rs".to_string(), 10))
        );
        assert_eq!(doctest_place("tests::adds"), None);
        assert_eq!(block_header("---- tests::a stdout ----"), Some("tests::a"));
    }
}
