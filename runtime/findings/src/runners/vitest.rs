//! vitest's default reporter: after the `⎯⎯ Failed Tests 3 ⎯⎯` (or `Failed Suites`) banner, a
//! block per failure (` FAIL  path/x.test.ts > suite > name`, the error, its diff, the
//! ` ❯ path/x.test.ts:5:15` place and a code frame) closed by `⎯⎯[1/3]⎯`, and
//! ` Tests  1 failed | 2 passed (3)`.
//!
//! A `FAIL` line before the banner is a test's own output, not a failure.

use super::{BLOCK_LINES, Excerpt, count_items, file_line, inside};
use crate::{Finding, FindingKind, Line, MAX_NAME, Reader, Sink, TestCounts};

const TOOL: &str = "vitest";
const MESSAGE_LINES: usize = 14;
/// Most tests that share one error (vitest lists them one `FAIL` line each, then the error).
const SHARED: usize = 8;

#[derive(Default)]
pub struct Vitest {
    /// After a `Failed Tests` or `Failed Suites` banner, until the counts.
    failures: bool,
    entry: Option<Entry>,
    suites: u64,
}

#[derive(Default)]
struct Entry {
    /// The tests (file, name) this error is of; no name for a suite that failed to load.
    tests: Vec<(String, Option<String>)>,
    message: Option<String>,
    message_lines: usize,
    past_message: bool,
    place: Option<(String, u32, Option<u32>)>,
    excerpt: Excerpt,
    lines: usize,
}

impl Reader for Vitest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        // Two `⎯`: vitest pads its banners and closers with many (to the width of a terminal,
        // 80 without one), and the pattern's six bytes join the jump's one search where a
        // single `⎯`'s three were a search of their own over every byte (docs/decisions.md).
        &["\u{23af}\u{23af}", " FAIL ", " Tests "]
    }

    fn wants_all(&self) -> bool {
        self.entry.as_ref().is_some_and(|e| e.lines < BLOCK_LINES)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        let s = t.trim();
        if s.starts_with('\u{23af}') {
            self.end_entry(sink);
            let title = s.trim_matches(|c| c == '\u{23af}' || c == ' ');
            if title.starts_with("Failed Tests ")
                || title.starts_with("Failed Suites ")
                || title.starts_with("Unhandled Error")
            {
                self.failures = true;
            }
            return;
        }
        if let Some(rest) = s.strip_prefix("Tests  ") {
            if self.failures || self.entry.is_some() || rest.ends_with(')') {
                self.end_entry(sink);
                self.counts(rest, sink);
                self.failures = false;
            }
            return;
        }
        if !self.failures {
            return;
        }
        if let Some(rest) = t.strip_prefix(" FAIL  ") {
            if self.entry.as_ref().is_some_and(|e| e.message.is_some()) {
                self.end_entry(sink);
            }
            let test = header(rest);
            let e = self.entry.get_or_insert_with(Entry::default);
            if let Some(test) = test
                && e.tests.len() < SHARED
            {
                e.tests.push(test);
            }
            return;
        }
        if s.starts_with("Test Files ") {
            self.end_entry(sink);
            return;
        }
        let Some(e) = &mut self.entry else {
            return;
        };
        e.lines += 1;
        if s.is_empty() {
            return;
        }
        if let Some(place) = s.strip_prefix('\u{276f}') {
            e.past_message = true;
            // `❯ file:line:col` or `❯ function file:line:col`.
            let place = place.trim();
            let place = place.rsplit(' ').next().unwrap_or(place);
            if let Some((file, n, col, _)) = file_line(place)
                && inside(sink, file)
                && !sink.paths().locate(file).contains("node_modules/")
            {
                if e.place.is_none() {
                    e.place = Some((file.to_string(), n, col));
                }
                e.excerpt.push(s);
            }
            return;
        }
        if e.past_message {
            return;
        }
        if e.message.is_none() {
            e.message = Some(s.to_string());
        }
        if e.message_lines < MESSAGE_LINES {
            e.message_lines += 1;
            e.excerpt.push(t);
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_entry(sink);
    }
}

impl Vitest {
    fn end_entry(&mut self, sink: &mut Sink) {
        let Some(mut e) = self.entry.take() else {
            return;
        };
        let excerpt = e.excerpt.take();
        let message = e.message.take().unwrap_or_else(|| "failed".into());
        for (file, name) in e.tests {
            let suite = name.is_none();
            if suite {
                self.suites += 1;
            }
            let location = match &e.place {
                Some((f, n, c)) => sink.location(f, Some(*n), *c),
                None => sink.location(&file, None, None),
            };
            sink.push(Finding {
                kind: if suite {
                    FindingKind::TestError
                } else {
                    FindingKind::TestFailed
                },
                tool: TOOL.into(),
                name,
                location: Some(location),
                message: message.clone(),
                excerpt: excerpt.clone(),
            });
        }
    }

    /// `3 failed | 2 passed | 1 skipped (6)` (after `Tests`).
    fn counts(&mut self, rest: &str, sink: &mut Sink) {
        let rest = match rest.rfind(" (") {
            Some(i) => &rest[..i],
            None => rest,
        };
        let mut c = TestCounts::default();
        let ok = count_items(rest, '|', |n, w| match w {
            "passed" => c.passed += n,
            "failed" => c.failed += n,
            "skipped" | "todo" => c.skipped += n,
            _ => {}
        });
        if ok {
            c.errored += std::mem::take(&mut self.suites);
            sink.add_counts(TOOL, c);
        }
    }
}

/// `src/x.test.ts > suite > name` (a test) or `src/x.test.ts [ src/x.test.ts ]` (a suite).
fn header(rest: &str) -> Option<(String, Option<String>)> {
    let rest = rest.trim();
    if let Some((file, name)) = rest.split_once(" > ") {
        let (file, name) = (file.trim(), name.trim());
        if file.is_empty() || name.is_empty() || file.len() > MAX_NAME {
            return None;
        }
        return Some((file.to_string(), Some(name.to_string())));
    }
    let file = rest.split(" [").next().unwrap_or(rest).trim();
    (!file.is_empty() && file.len() <= MAX_NAME).then(|| (file.to_string(), None))
}
