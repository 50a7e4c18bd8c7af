//! pytest's terminal report: the `FAILURES` and `ERRORS` sections (a `____ name ____` header per
//! test, `E   ` lines, `file.py:LINE: Error` places, in the long, short and line styles of
//! `--tb`), the `short test summary info` (`FAILED id - message`, `ERROR id`) and the final
//! counts line.
//!
//! A section's record gives the place and the assertion; the summary line gives the test's id.
//! A summary line with no record (`--tb=no`) is reported with the test's file; a record with no
//! summary line (a log cut short, `-rN`) is reported at the counts line or at the end.

use super::{BLOCK_LINES, Excerpt, count_items, file_line, indent, inside};
use crate::{Finding, FindingKind, Line, Location, MAX_FINDINGS, Reader, Sink, TestCounts};

const TOOL: &str = "pytest";

#[derive(Default)]
pub struct Pytest {
    /// Inside a `FAILURES` or `ERRORS` section: whether the latter.
    section: Option<bool>,
    /// The test's record being read.
    rec: Option<Record>,
    /// Records read, waiting for their summary line.
    done: Vec<Record>,
    /// Inside the `short test summary info`.
    summary: bool,
}

#[derive(Default)]
struct Record {
    error: bool,
    /// The header's name (`test_b`, `TestA.test_b`, a collected file); empty for a record of
    /// `--tb=line`, which has no header.
    key: String,
    /// The first place of the record's frames (the test's own file).
    first_file: Option<String>,
    /// The last place inside the workspace.
    place: Option<(String, u32)>,
    message: Option<(usize, String)>,
    /// The exception type of the last place line (`AssertionError`), a message of last resort.
    kind_word: Option<String>,
    excerpt: Excerpt,
    /// Source lines (`>   code`) of the current long-style frame, until its place line.
    source: Vec<String>,
    /// The current short-style frame is inside the workspace.
    short_inside: bool,
    lines: usize,
    /// In a `Captured ...` part: nothing more of the failure itself.
    captured: bool,
    complete: bool,
}

impl Reader for Pytest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &[
            "=====",
            // The rules are as wide as the terminal: narrow ones too.
            "= FAILURES =",
            "= ERRORS =",
            "short test summary info",
            "___ ",
            "FAILED",
            "ERROR",
            " passed",
            " failed",
            " error",
            " skipped",
            " xfailed",
            " xpassed",
            " deselected",
            "no tests ran",
        ]
    }

    fn wants_all(&self) -> bool {
        self.section.is_some()
            && self
                .rec
                .as_ref()
                .is_none_or(|r| r.lines < BLOCK_LINES && !r.captured)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        if let Some(title) = separator(t, '=') {
            self.end_record();
            self.section = match title {
                "FAILURES" => Some(false),
                "ERRORS" => Some(true),
                _ => None,
            };
            if title.contains("short test summary info") {
                self.summary = true;
                return;
            }
            if self.counts_line(title, sink) {
                self.flush(sink);
            }
            return;
        }
        if let Some(errors) = self.section {
            self.section_line(t, errors, sink);
            return;
        }
        if self.summary
            && let Some(rest) = t.strip_prefix("FAILED ")
        {
            self.summary_line(rest, false, sink);
            return;
        }
        if self.summary
            && let Some(rest) = t.strip_prefix("ERROR ")
        {
            self.summary_line(rest, true, sink);
            return;
        }
        // `-q` gives the counts line without its rule.
        if !t.starts_with(' ') && self.counts_line(t, sink) {
            self.flush(sink);
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.end_record();
        self.flush(sink);
    }
}

impl Pytest {
    fn section_line(&mut self, t: &str, errors: bool, sink: &mut Sink) {
        if let Some(title) = separator(t, '_') {
            self.end_record();
            let (error, key) = if let Some(k) = title
                .strip_prefix("ERROR at setup of ")
                .or_else(|| title.strip_prefix("ERROR at teardown of "))
            {
                (true, k)
            } else if let Some(k) = title.strip_prefix("ERROR collecting ") {
                (true, k)
            } else {
                (errors, title)
            };
            self.rec = Some(Record {
                error,
                key: key.to_string(),
                ..Record::default()
            });
            return;
        }
        let rec = self.rec.get_or_insert_with(|| Record {
            error: errors,
            ..Record::default()
        });
        rec.lines += 1;
        if rec.captured {
            return;
        }
        if separator(t, '-').is_some_and(|s| s.starts_with("Captured ")) {
            rec.captured = true;
            return;
        }
        if let Some(e) = t
            .strip_prefix('E')
            .filter(|e| e.starts_with(' ') || e.is_empty())
        {
            let body = e.trim_start();
            let ind = indent(e);
            if !body.is_empty() {
                if rec.message.as_ref().is_none_or(|(i, _)| ind < *i) {
                    rec.message = Some((ind, body.to_string()));
                }
                // A SyntaxError's own place: `File "x.py", line 3`.
                if let Some((f, n)) = python_file_line(body)
                    && inside(sink, f)
                {
                    rec.place = Some((f.to_string(), n));
                }
            }
            rec.excerpt.push(t);
            return;
        }
        if let Some(src) = t.strip_prefix('>') {
            if rec.source.len() < 4 {
                rec.source.push(format!(">{src}"));
            }
            return;
        }
        if !t.starts_with(' ')
            && let Some((file, n, _, rest)) = file_line(t)
        {
            let ins = inside(sink, file);
            if rec.first_file.is_none() {
                rec.first_file = Some(file.to_string());
            }
            if ins {
                rec.place = Some((file.to_string(), n));
            }
            let source = std::mem::take(&mut rec.source);
            if rest.starts_with("in ") {
                // Short style: the place starts its frame.
                rec.short_inside = ins;
                if ins {
                    rec.excerpt.push(t);
                }
            } else {
                rec.short_inside = false;
                if ins {
                    for s in &source {
                        rec.excerpt.push(s);
                    }
                    rec.excerpt.push(t);
                }
                if !rest.is_empty() {
                    rec.kind_word = Some(rest.to_string());
                }
                if rec.key.is_empty() {
                    // `--tb=line`: this place ends the test's record.
                    if rec.message.is_none() && !rest.is_empty() {
                        rec.message = Some((0, rest.to_string()));
                    }
                    rec.complete = true;
                    self.end_record();
                }
            }
            return;
        }
        if rec.short_inside && t.starts_with("    ") {
            rec.excerpt.push(t);
        }
    }

    fn end_record(&mut self) {
        if let Some(rec) = self.rec.take()
            && (!rec.key.is_empty() || rec.complete)
            && self.done.len() < MAX_FINDINGS
        {
            self.done.push(rec);
        }
    }

    fn summary_line(&mut self, rest: &str, error: bool, sink: &mut Sink) {
        let (id, msg) = match rest.split_once(" - ") {
            Some((id, msg)) => (id.trim(), Some(msg.trim())),
            None => (rest.trim(), None),
        };
        let file = match id.split_once("::") {
            Some((f, _)) => f,
            None if id.ends_with(".py") => id,
            None => return,
        };
        if file.is_empty() || file.contains(' ') {
            return;
        }
        let key = key_of(id);
        let at = self
            .done
            .iter()
            .position(|r| r.error == error && r.key == key)
            .or_else(|| {
                let want = sink.paths().locate(file);
                self.done.iter().position(|r| {
                    r.key.is_empty()
                        && r.error == error
                        && r.place
                            .as_ref()
                            .is_some_and(|(f, _)| sink.paths().locate(f) == want)
                })
            });
        let rec = at.map(|i| self.done.remove(i));
        report(sink, rec, Some(id), Some(file), msg, error);
    }

    /// A counts line (`3 failed, 1 passed, 1 skipped in 0.12s`): reports them.
    fn counts_line(&mut self, t: &str, sink: &mut Sink) -> bool {
        let t = t.trim();
        let Some(at) = t.rfind(" in ") else {
            return false;
        };
        let (items, time) = (&t[..at], &t[at + 4..]);
        let time = time.split(' ').next().unwrap_or("");
        let Some(secs) = time.strip_suffix('s') else {
            return false;
        };
        if secs.is_empty() || !secs.bytes().all(|c| c.is_ascii_digit() || c == b'.') {
            return false;
        }
        let mut c = TestCounts::default();
        let mut known = false;
        let ok = items == "no tests ran"
            || count_items(items, ',', |n, w| {
                known = true;
                match w {
                    "passed" | "xpassed" => c.passed += n,
                    "failed" => c.failed += n,
                    "error" | "errors" => c.errored += n,
                    "skipped" | "xfailed" => c.skipped += n,
                    "deselected" | "warning" | "warnings" | "rerun" => {}
                    _ => known = false,
                }
            }) && known;
        if ok {
            self.summary = false;
            sink.add_counts(TOOL, c);
        }
        ok
    }

    /// Reports the records that no summary line named.
    fn flush(&mut self, sink: &mut Sink) {
        for rec in std::mem::take(&mut self.done) {
            let error = rec.error;
            report(sink, Some(rec), None, None, None, error);
        }
        self.summary = false;
    }
}

fn report(
    sink: &mut Sink,
    rec: Option<Record>,
    id: Option<&str>,
    file: Option<&str>,
    summary: Option<&str>,
    error: bool,
) {
    let mut rec = rec.unwrap_or_default();
    let name = match id {
        Some(id) => Some(id.to_string()),
        None if rec.key.is_empty() => None,
        None if rec.key.ends_with(".py") => Some(rec.key.clone()),
        None => {
            // The header's name as a test id: the file when a place gave it.
            let (head, params) = match rec.key.find('[') {
                Some(i) => rec.key.split_at(i),
                None => (rec.key.as_str(), ""),
            };
            let id = format!("{}{params}", head.replace('.', "::"));
            Some(match &rec.first_file {
                Some(f) => format!("{f}::{id}"),
                None => id,
            })
        }
    };
    let location = match (&rec.place, file.or(rec.first_file.as_deref())) {
        (Some((f, n)), _) => Some(sink.location(f, Some(*n), None)),
        (None, Some(f)) => Some(sink.location(f, None, None)),
        (None, None) => None,
    };
    let message = rec
        .message
        .take()
        .map(|(_, m)| m)
        .or_else(|| summary.map(str::to_string))
        .or_else(|| rec.kind_word.take())
        .unwrap_or_else(|| if error { "error" } else { "failed" }.to_string());
    sink.push(Finding {
        kind: if error {
            FindingKind::TestError
        } else {
            FindingKind::TestFailed
        },
        tool: TOOL.into(),
        name,
        location: location.filter(|l: &Location| !l.file.is_empty()),
        message,
        excerpt: rec.excerpt.take(),
    });
}

/// The header's name of a test id: `tests/a.py::TestA::test_b[x]` -> `TestA.test_b[x]`.
fn key_of(id: &str) -> String {
    match id.split_once("::") {
        Some((_, rest)) => {
            let (head, params) = match rest.find('[') {
                Some(i) => rest.split_at(i),
                None => (rest, ""),
            };
            format!("{}{params}", head.replace("::", "."))
        }
        None => id.to_string(),
    }
}

/// The title of a pytest rule (`==== FAILURES ====`, `____ test_b ____`): a line of `c` runs
/// around a title, or none for a line that is not one.
fn separator(t: &str, c: char) -> Option<&str> {
    let run: String = std::iter::repeat_n(c, 3).collect();
    if !t.starts_with(&run) || !t.ends_with(&run) {
        return None;
    }
    let title = t.trim_matches(|x| x == c || x == ' ');
    if title.is_empty() {
        return None;
    }
    Some(title)
}

/// `File "x.py", line 3` (a traceback's frame, or a SyntaxError's place).
pub(crate) fn python_file_line(s: &str) -> Option<(&str, u32)> {
    let rest = s.trim_start().strip_prefix("File \"")?;
    let (file, rest) = rest.split_once("\", line ")?;
    let (n, _) = super::digits(rest);
    Some((file, n?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ids_give_their_header() {
        assert_eq!(key_of("tests/a.py::test_b"), "test_b");
        assert_eq!(
            key_of("tests/a.py::TestA::test_b[x::y]"),
            "TestA.test_b[x::y]"
        );
        assert_eq!(key_of("tests/a.py"), "tests/a.py");
        assert_eq!(separator("==== FAILURES ====", '='), Some("FAILURES"));
        assert_eq!(separator("___ TestA.test_b ___", '_'), Some("TestA.test_b"));
        assert_eq!(separator("_ _ _ _", '_'), None);
        assert_eq!(separator("=========", '='), None);
    }
}
