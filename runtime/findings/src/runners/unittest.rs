//! Python's unittest (`python -m unittest`): `FAIL: test_x (pkg.mod.Case.test_x)` and `ERROR:`
//! blocks between rules of 70 `=` and `-`, with their traceback, and `Ran N tests` followed by
//! `OK` or `FAILED (failures=1, errors=1, skipped=2)`.
//!
//! A block's place is its innermost frame inside the workspace; its message is the exception's
//! line after the last frame.

use super::pytest::python_file_line;
use super::{BLOCK_LINES, Excerpt, inside};
use crate::{Finding, FindingKind, Line, Reader, Sink, TestCounts};

const TOOL: &str = "unittest";
const RULE: usize = 70;

#[derive(Default)]
pub struct Unittest {
    /// The previous line was a rule of `=`: a block's header may follow.
    after_rule: bool,
    block: Option<Block>,
    /// Tests run, after `Ran N tests`, until the line with the outcome (a few lines on).
    ran: Option<(u64, u8)>,
}

#[derive(Default)]
struct Block {
    error: bool,
    name: String,
    /// The rule under the header was seen.
    started: bool,
    place: Option<(String, u32)>,
    message: Option<String>,
    /// A frame was seen since the message: the next exception line is the message.
    want_message: bool,
    frame_inside: bool,
    excerpt: Excerpt,
    exception_lines: usize,
    lines: usize,
    /// The captured output (`-b`): nothing more of the failure.
    captured: bool,
}

impl Reader for Unittest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &["=====", "Ran "]
    }

    fn wants_all(&self) -> bool {
        self.after_rule
            || self.ran.is_some()
            || self
                .block
                .as_ref()
                .is_some_and(|b| b.lines < BLOCK_LINES && !b.captured)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        if is_rule(t, '=') {
            self.end_block(sink);
            self.after_rule = true;
            return;
        }
        if std::mem::take(&mut self.after_rule) {
            self.block = header(t);
            return;
        }
        if let Some((n, left)) = self.ran {
            self.ran = if left > 0 { Some((n, left - 1)) } else { None };
            if outcome(t, n, sink) {
                self.ran = None;
            }
            return;
        }
        if let Some(rest) = t.strip_prefix("Ran ") {
            self.end_block(sink);
            if let Some((n, tail)) = rest.split_once(' ')
                && (tail.starts_with("tests in ") || tail.starts_with("test in "))
                && let Ok(n) = n.parse::<u64>()
            {
                self.ran = Some((n, 3));
            }
            return;
        }
        let Some(b) = &mut self.block else {
            return;
        };
        b.lines += 1;
        if is_rule(t, '-') {
            if b.started {
                self.end_block(sink);
            } else {
                b.started = true;
            }
            return;
        }
        if !b.started || b.captured || t.trim().is_empty() {
            return;
        }
        if t == "Stdout:" || t == "Stderr:" {
            b.captured = true;
            return;
        }
        if let Some((file, n)) = python_file_line(t).filter(|_| t.starts_with("  File \"")) {
            b.frame_inside = inside(sink, file);
            if b.frame_inside {
                b.place = Some((file.to_string(), n));
                b.excerpt.push(t);
            }
            b.want_message = true;
            return;
        }
        if t.starts_with(' ') {
            let marks = t.trim().bytes().all(|c| matches!(c, b'^' | b'~'));
            if b.frame_inside && !marks {
                b.excerpt.push(t);
            }
            return;
        }
        if t.starts_with("Traceback (most recent call last)")
            || t.starts_with("During handling of the above exception")
            || t.starts_with("The above exception was the direct cause")
        {
            b.frame_inside = false;
            return;
        }
        b.frame_inside = false;
        if b.want_message || b.message.is_none() {
            b.message = Some(t.to_string());
            b.want_message = false;
        }
        if b.exception_lines < 12 {
            b.exception_lines += 1;
            b.excerpt.push(t);
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_block(sink);
    }
}

impl Unittest {
    fn end_block(&mut self, sink: &mut Sink) {
        let Some(mut b) = self.block.take() else {
            return;
        };
        if !b.started {
            return;
        }
        let location = b
            .place
            .as_ref()
            .map(|(f, n)| sink.location(f, Some(*n), None));
        sink.push(Finding {
            kind: if b.error {
                FindingKind::TestError
            } else {
                FindingKind::TestFailed
            },
            tool: TOOL.into(),
            name: Some(b.name),
            location,
            message: b
                .message
                .unwrap_or_else(|| if b.error { "error" } else { "failed" }.to_string()),
            excerpt: b.excerpt.take(),
        });
    }
}

fn is_rule(t: &str, c: char) -> bool {
    t.len() == RULE && t.chars().all(|x| x == c)
}

/// `FAIL: test_x (pkg.mod.Case.test_x)`, with a subtest's ` (i=1)` after it; Python before
/// 3.11 gives the class only (`(pkg.mod.Case)`).
fn header(t: &str) -> Option<Block> {
    let (error, rest) = if let Some(r) = t.strip_prefix("FAIL: ") {
        (false, r)
    } else if let Some(r) = t.strip_prefix("ERROR: ") {
        (true, r)
    } else {
        return None;
    };
    let (method, rest) = rest.split_once(" (")?;
    let (id, sub) = rest.split_once(')')?;
    if method.is_empty()
        || method.contains(' ')
        || id.is_empty()
        || !id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
    {
        return None;
    }
    let id = id
        .strip_prefix("unittest.loader._FailedTest.")
        .unwrap_or(id);
    let mut name = if id == method || id.ends_with(&format!(".{method}")) {
        id.to_string()
    } else {
        format!("{id}.{method}")
    };
    let sub = sub.trim();
    if !sub.is_empty() {
        name.push(' ');
        name.push_str(sub);
    }
    Some(Block {
        error,
        name,
        ..Block::default()
    })
}

/// `OK`, `OK (skipped=1)` or `FAILED (failures=1, errors=2)` after `Ran n tests`.
fn outcome(t: &str, ran: u64, sink: &mut Sink) -> bool {
    let t = t.trim();
    let inner = if t == "OK" || t == "FAILED" {
        ""
    } else if let Some(r) = t
        .strip_prefix("OK (")
        .or_else(|| t.strip_prefix("FAILED ("))
    {
        match r.strip_suffix(')') {
            Some(r) => r,
            None => return false,
        }
    } else {
        return false;
    };
    let mut c = TestCounts::default();
    let mut not_passed = 0u64;
    let parsed = inner.is_empty()
        || inner.split(", ").all(|item| {
            let Some((k, v)) = item.split_once('=') else {
                return false;
            };
            let Ok(v) = v.parse::<u64>() else {
                return false;
            };
            match k {
                "failures" | "unexpected successes" => c.failed += v,
                "errors" => c.errored += v,
                "skipped" | "expected failures" => c.skipped += v,
                _ => return false,
            }
            not_passed += v;
            true
        });
    if !parsed {
        return false;
    }
    c.passed = ran.saturating_sub(not_passed);
    sink.add_counts(TOOL, c);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_give_the_test_id() {
        let b = header("FAIL: test_x (pkg.mod.Case.test_x)").map(|b| b.name);
        assert_eq!(b.as_deref(), Some("pkg.mod.Case.test_x"));
        let b = header("ERROR: test_x (pkg.mod.Case)").map(|b| b.name);
        assert_eq!(b.as_deref(), Some("pkg.mod.Case.test_x"));
        let b = header("FAIL: test_s (m.C.test_s) (i=1)").map(|b| b.name);
        assert_eq!(b.as_deref(), Some("m.C.test_s (i=1)"));
        assert!(header("FAIL: not really, this is a log line").is_none());
    }
}
