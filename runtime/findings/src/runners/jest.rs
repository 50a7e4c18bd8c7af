//! jest's default reporter: `FAIL path/x.test.js`, then a `● Suite › test` block per failed
//! test (the error, `Expected:`/`Received:`, the code frame with its `>` line, `at ...
//! (path/x.test.js:12:17)` frames), `● Test suite failed to run` for a file that did not load,
//! and `Tests:       1 failed, 2 passed, 3 total`.

use super::{BLOCK_LINES, Excerpt, count_items, file_line, inside};
use crate::{Finding, FindingKind, Line, MAX_NAME, Reader, Sink, TestCounts};

const TOOL: &str = "jest";
/// Most lines of an error's message kept in the excerpt.
const MESSAGE_LINES: usize = 14;
/// Most frames kept in the excerpt.
const FRAMES: usize = 3;

#[derive(Default)]
pub struct Jest {
    /// Inside the report of a failed file: the file.
    file: Option<String>,
    entry: Option<Entry>,
    /// Suites that failed to run since the last counts.
    suites: u64,
}

#[derive(Default)]
struct Entry {
    /// The test (`Suite › test`); none for a suite that failed to run.
    name: Option<String>,
    /// `● Console`: nothing to report.
    console: bool,
    message: Option<String>,
    message_lines: usize,
    /// Past the message: the code frame or the frames.
    past_message: bool,
    place: Option<(String, u32, Option<u32>)>,
    frames: usize,
    excerpt: Excerpt,
    lines: usize,
}

impl Reader for Jest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &["FAIL ", "PASS ", "\u{25cf} ", "Tests:"]
    }

    fn wants_all(&self) -> bool {
        self.entry
            .as_ref()
            .is_some_and(|e| !e.console && e.lines < BLOCK_LINES)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        if let Some(rest) = t.strip_prefix("FAIL ").or_else(|| t.strip_prefix(" FAIL ")) {
            self.end_entry(sink);
            let path = rest.trim();
            self.file = (!path.is_empty()
                && path.len() <= MAX_NAME
                && path.contains('.')
                && !path.contains(" > "))
            .then(|| path.to_string());
            return;
        }
        if t.starts_with("PASS ") || t.starts_with(" PASS ") {
            self.end_entry(sink);
            self.file = None;
            return;
        }
        if let Some(rest) = t.strip_prefix("Tests:") {
            self.end_entry(sink);
            self.file = None;
            self.counts(rest, sink);
            return;
        }
        if t.starts_with("Test Suites:") {
            self.end_entry(sink);
            self.file = None;
            return;
        }
        if self.file.is_none() {
            return;
        }
        if let Some(title) = t.strip_prefix("  \u{25cf} ") {
            self.end_entry(sink);
            let title = title.trim();
            self.entry = Some(match title {
                "Console" => Entry {
                    console: true,
                    ..Entry::default()
                },
                "Test suite failed to run" => Entry::default(),
                _ => Entry {
                    name: Some(title.to_string()),
                    ..Entry::default()
                },
            });
            return;
        }
        let Some(e) = &mut self.entry else {
            return;
        };
        if e.console {
            return;
        }
        e.lines += 1;
        let s = t.trim();
        if s.is_empty() {
            return;
        }
        if let Some(frame) = s.strip_prefix("at ") {
            e.past_message = true;
            let place = match frame.rfind(" (") {
                Some(i) if frame.ends_with(')') => &frame[i + 2..frame.len() - 1],
                _ => frame,
            };
            if let Some((file, n, col, _)) = file_line(place)
                && inside(sink, file)
                && !sink.paths().locate(file).contains("node_modules/")
            {
                if e.place.is_none() {
                    e.place = Some((file.to_string(), n, col));
                }
                if e.frames < FRAMES {
                    e.frames += 1;
                    e.excerpt.push(s);
                }
            }
            return;
        }
        if let Some(code) = code_frame(s) {
            e.past_message = true;
            if code {
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
            e.excerpt.push(t.strip_prefix("    ").unwrap_or(t));
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_entry(sink);
    }
}

impl Jest {
    fn end_entry(&mut self, sink: &mut Sink) {
        let Some(mut e) = self.entry.take() else {
            return;
        };
        if e.console {
            return;
        }
        let suite = e.name.is_none();
        if suite {
            self.suites += 1;
        }
        let location = match (&e.place, &self.file) {
            (Some((f, n, c)), _) => Some(sink.location(f, Some(*n), *c)),
            (None, Some(f)) => Some(sink.location(f, None, None)),
            (None, None) => None,
        };
        sink.push(Finding {
            kind: if suite {
                FindingKind::TestError
            } else {
                FindingKind::TestFailed
            },
            tool: TOOL.into(),
            name: e.name.take(),
            location,
            message: e.message.take().unwrap_or_else(|| "failed".into()),
            excerpt: e.excerpt.take(),
        });
    }

    /// `       3 failed, 1 skipped, 2 passed, 6 total` (after `Tests:`).
    fn counts(&mut self, rest: &str, sink: &mut Sink) {
        let mut c = TestCounts::default();
        let mut total = false;
        let ok = count_items(rest, ',', |n, w| match w {
            "passed" => c.passed += n,
            "failed" => c.failed += n,
            "skipped" | "todo" => c.skipped += n,
            "total" => total = true,
            _ => {}
        });
        if ok && total {
            c.errored += std::mem::take(&mut self.suites);
            sink.add_counts(TOOL, c);
        }
    }
}

/// A code frame's line (`> 12 |   code`, `  13 |`, `     |   ^`): whether it is the `>` one.
fn code_frame(s: &str) -> Option<bool> {
    let (marked, rest) = match s.strip_prefix('>') {
        Some(r) => (true, r.trim_start()),
        None => (false, s),
    };
    let n = rest.bytes().take_while(u8::is_ascii_digit).count();
    let after = rest[n..].trim_start();
    after.starts_with('|').then_some(marked && n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_frames_are_told_apart() {
        assert_eq!(
            code_frame(">  9 |     expect(add(1, 2)).toBe(4);"),
            Some(true)
        );
        assert_eq!(code_frame("10 |   });"), Some(false));
        assert_eq!(code_frame("|                       ^"), Some(false));
        assert_eq!(code_frame("Expected: 4"), None);
    }
}
