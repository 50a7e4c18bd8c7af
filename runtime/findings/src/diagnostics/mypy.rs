//! mypy: `pkg/a.py:12: error: Incompatible types ...  [assignment]` (with a column under
//! `--show-column-numbers`), the `note:` lines after an error into its excerpt, and
//! `--pretty`'s wrapped message and snippet. `Found 1 error in 1 file` and `Success: ...` are
//! summaries.

use super::{Excerpt, has_extension, plausible_file, split_location};
use crate::{Finding, FindingKind, Line, Reader, Sink};

/// Lines after a header that `--pretty` may give (the rest of a wrapped message, the snippet).
const MAX_PRETTY: usize = 8;

#[derive(Debug, Default)]
pub(super) struct Mypy {
    cur: Option<Pending>,
}

#[derive(Debug)]
struct Pending {
    finding: Finding,
    file: String,
    excerpt: Excerpt,
    /// The message still lacks its `[code]`: `--pretty` wrapped it.
    open: bool,
    lines: usize,
}

/// A header line's parts.
#[derive(Debug, PartialEq, Eq)]
struct Header<'a> {
    file: &'a str,
    line: Option<u32>,
    column: Option<u32>,
    /// `error:`, not `note:`.
    error: bool,
    message: &'a str,
}

/// `file:line[:col]: error: msg` or `file: error: msg` (or `note:`).
fn header(s: &str) -> Option<Header<'_>> {
    let (file, line, col, rest) = match split_location(s) {
        Some(at) => (at.file, Some(at.line), at.column, at.rest),
        None => {
            let (file, rest) = s.split_once(": ")?;
            (file, None, None, rest)
        }
    };
    if !plausible_file(file) || !has_extension(file, &["py", "pyi"]) {
        return None;
    }
    let (error, m) = match rest.strip_prefix("error: ") {
        Some(m) => (true, m.trim()),
        None => (false, rest.strip_prefix("note: ")?.trim()),
    };
    (!m.is_empty()).then_some(Header {
        file,
        line,
        column: col,
        error,
        message: m,
    })
}

/// `msg  [code]`: (msg, code).
fn code(msg: &str) -> Option<(&str, &str)> {
    let inner = msg.strip_suffix(']')?;
    let (m, c) = inner.rsplit_once("  [")?;
    let ok = !c.is_empty()
        && c.len() <= 64
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    ok.then_some((m.trim_end(), c))
}

impl Mypy {
    fn flush(&mut self, sink: &mut Sink) {
        if let Some(mut p) = self.cur.take() {
            p.finding.excerpt = p.excerpt.take();
            sink.push(p.finding);
        }
    }
}

impl Reader for Mypy {
    fn tool(&self) -> &'static str {
        "mypy"
    }

    fn anchors(&self) -> &'static [&'static str] {
        &["error:", "note:"]
    }

    fn wants_all(&self) -> bool {
        self.cur.as_ref().is_some_and(|p| p.lines < MAX_PRETTY)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        if self.cur.is_none() && !text.contains(".py") {
            return;
        }
        let h = header(text);
        if let Some(Header {
            file, error: false, ..
        }) = h
        {
            if let Some(p) = &mut self.cur
                && p.file == file
            {
                p.excerpt.push(text);
                p.lines = MAX_PRETTY;
            }
            return;
        }
        let Some(Header {
            file,
            line: l,
            column: c,
            message: msg,
            ..
        }) = h
        else {
            if let Some(p) = &mut self.cur
                && p.lines < MAX_PRETTY
            {
                p.lines += 1;
                let snippet = text.starts_with(' ') && !text.trim().is_empty();
                if text.starts_with("Found ")
                    || text.starts_with("Success: ")
                    || (!p.open && !snippet)
                {
                    p.lines = MAX_PRETTY;
                    return;
                }
                p.excerpt.push(text);
                if p.open {
                    // The wrapped rest of the message, up to its `[code]`.
                    let (part, code) = match code(text) {
                        Some((m, c)) => (m, Some(c)),
                        None => (text.trim(), None),
                    };
                    p.finding.message.push(' ');
                    p.finding.message.push_str(part.trim());
                    if let Some(c) = code {
                        p.finding.name = Some(c.to_string());
                        p.open = false;
                    }
                }
            }
            return;
        };
        self.flush(sink);
        let (message, name) = match code(msg) {
            Some((m, c)) => (m, Some(c.to_string())),
            None => (msg, None),
        };
        let mut excerpt = Excerpt::default();
        excerpt.push(text);
        self.cur = Some(Pending {
            finding: Finding {
                kind: FindingKind::CompileError,
                tool: "mypy".into(),
                name: name.clone(),
                location: Some(sink.location(file, l, c)),
                message: message.to_string(),
                excerpt: None,
            },
            file: file.to_string(),
            excerpt,
            open: name.is_none(),
            lines: 0,
        });
    }

    fn end(&mut self, sink: &mut Sink) {
        self.flush(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_codes() {
        assert_eq!(
            header("pkg/a.py:7:14: error: Bad  [assignment]"),
            Some(Header {
                file: "pkg/a.py",
                line: Some(7),
                column: Some(14),
                error: true,
                message: "Bad  [assignment]"
            })
        );
        assert_eq!(
            header("pkg/a.py: error: Duplicate module"),
            Some(Header {
                file: "pkg/a.py",
                line: None,
                column: None,
                error: true,
                message: "Duplicate module"
            })
        );
        assert_eq!(header("src/a.c:3: error: x"), None);
        assert_eq!(code("Bad  [assignment]"), Some(("Bad", "assignment")));
        assert_eq!(code("list[int]"), None);
    }
}
