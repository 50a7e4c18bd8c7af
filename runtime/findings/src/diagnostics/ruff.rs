//! ruff (`ruff check`): the default "full" format, a header (`F401 [*] `os` imported but
//! unused`, `invalid-syntax: ...`) then ` --> a.py:1:8` and a snippet, one blank line between
//! diagnostics; and the concise format (`a.py:1:8: F401 [*] ...`), whose older full form adds a
//! snippet. Rules are lint; syntax errors compile errors. `Found 1 error.` is a summary.
//!
//! A full header holds no fixed text but its code (anchoring ruff's codes would slow the search
//! of every log), so its anchors are the fixable mark and colour's header. Once in a report the
//! reader reads on across the blank line, so a later header is seen whatever its code. A first
//! header it could not see (a rule without a fix, without colour) still gives the finding, from
//! its ` --> ` line, without a name.

use super::{Excerpt, MAX_BLOCK, has_extension, plausible_file, split_location};
use crate::{Finding, FindingKind, Line, Reader, Sink};

const EXTENSIONS: &[&str] = &["py", "pyi", "ipynb", "toml"];

#[derive(Debug, Default)]
pub(super) struct Ruff {
    state: State,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Idle,
    /// A header was read: its location must follow.
    Header {
        code: String,
        message: String,
        line: String,
    },
    /// In a report's snippet.
    Block(Box<Pending>),
    /// A report ended with a blank line: the next line may be the next header.
    Between,
}

#[derive(Debug)]
struct Pending {
    finding: Finding,
    excerpt: Excerpt,
    lines: usize,
    /// No header was seen: the message is the help line's.
    headless: bool,
}

/// `F401 [*] msg`, `E741 msg`, `invalid-syntax: msg`, `SyntaxError: msg`: (code, msg).
fn header(s: &str) -> Option<(&str, &str)> {
    for syntax in ["invalid-syntax: ", "SyntaxError: "] {
        if let Some(m) = s.strip_prefix(syntax) {
            return Some((&syntax[..syntax.len() - 2], m.trim()));
        }
    }
    let (code, rest) = s.split_once(' ')?;
    let letters = code.bytes().take_while(u8::is_ascii_uppercase).count();
    let digits = code.len() - letters;
    let ok = (1..=8).contains(&letters)
        && (1..=4).contains(&digits)
        && code[letters..].bytes().all(|b| b.is_ascii_digit());
    if !ok {
        return None;
    }
    let msg = rest.strip_prefix("[*] ").unwrap_or(rest).trim();
    (!msg.is_empty()).then_some((code, msg))
}

fn kind(code: &str) -> FindingKind {
    if code == "invalid-syntax" || code == "SyntaxError" || code == "E999" {
        FindingKind::CompileError
    } else {
        FindingKind::Lint
    }
}

/// ` --> a.py:1:8`: the report's location.
fn arrow(s: &str) -> Option<super::At<'_>> {
    let at = split_location(s.trim_start().strip_prefix("--> ")?)?;
    (at.rest.is_empty() && at.column.is_some() && has_extension(at.file, EXTENSIONS)).then_some(at)
}

impl Ruff {
    fn flush(&mut self, sink: &mut Sink) {
        if let State::Block(p) = std::mem::take(&mut self.state) {
            let mut p = *p;
            p.finding.excerpt = p.excerpt.take();
            sink.push(p.finding);
        }
    }

    fn block(&mut self, text: &str, finding: Finding, headless: bool) {
        let mut excerpt = Excerpt::default();
        excerpt.push(text);
        self.state = State::Block(Box::new(Pending {
            finding,
            excerpt,
            lines: 1,
            headless,
        }));
    }

    /// A line outside a report.
    fn idle(&mut self, text: &str, sink: &mut Sink) {
        if let Some((code, msg)) = header(text) {
            self.state = State::Header {
                code: code.to_string(),
                message: msg.to_string(),
                line: text.to_string(),
            };
            return;
        }
        if let Some(at) = arrow(text) {
            let f = Finding {
                kind: FindingKind::Lint,
                tool: "ruff".into(),
                name: None,
                location: Some(sink.location(at.file, Some(at.line), at.column)),
                message: String::new(),
                excerpt: None,
            };
            self.block(text, f, true);
            return;
        }
        // The concise format (and the older full one, whose snippet follows).
        if let Some(at) = split_location(text)
            && at.column.is_some()
            && plausible_file(at.file)
            && has_extension(at.file, EXTENSIONS)
            && let Some((code, msg)) = header(at.rest)
        {
            let f = Finding {
                kind: kind(code),
                tool: "ruff".into(),
                name: Some(code.to_string()),
                location: Some(sink.location(at.file, Some(at.line), at.column)),
                message: msg.to_string(),
                excerpt: None,
            };
            self.block(text, f, false);
        }
    }
}

impl Reader for Ruff {
    fn tool(&self) -> &'static str {
        "ruff"
    }

    fn anchors(&self) -> &'static [&'static str] {
        // The arrow, the fixable mark, colour's header (`ESC[1mESC[91mF401ESC[0m`), the syntax
        // errors, and the concise format's file.
        &[
            "--> ",
            "[*] ",
            "\x1b[1m\x1b[91m",
            "invalid-syntax: ",
            "SyntaxError: ",
            // The concise format's `file.py:LINE:`: a digit after the colon, so a pytest
            // node id (`file.py::test`) on every line of a verbose run is not one.
            ".py:1",
            ".py:2",
            ".py:3",
            ".py:4",
            ".py:5",
            ".py:6",
            ".py:7",
            ".py:8",
            ".py:9",
            ".pyi:1",
            ".pyi:2",
            ".pyi:3",
            ".pyi:4",
            ".pyi:5",
            ".pyi:6",
            ".pyi:7",
            ".pyi:8",
            ".pyi:9",
        ]
    }

    fn wants_all(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        match &mut self.state {
            State::Idle => self.idle(text, sink),
            State::Between => {
                self.state = State::Idle;
                self.idle(text, sink);
            }
            State::Header {
                code,
                message,
                line: head,
            } => {
                let (code, message, head) = (
                    std::mem::take(code),
                    std::mem::take(message),
                    std::mem::take(head),
                );
                self.state = State::Idle;
                match arrow(text) {
                    Some(at) => {
                        let f = Finding {
                            kind: kind(&code),
                            tool: "ruff".into(),
                            name: Some(code),
                            location: Some(sink.location(at.file, Some(at.line), at.column)),
                            message,
                            excerpt: None,
                        };
                        self.block(&head, f, false);
                        if let State::Block(p) = &mut self.state {
                            p.excerpt.push(text);
                        }
                    }
                    None => self.idle(text, sink),
                }
            }
            State::Block(p) => {
                let t = text.trim_start();
                let part = t.starts_with('|')
                    || t.starts_with("-->")
                    || t.starts_with(":::")
                    || t.starts_with("= ")
                    || t.starts_with("help: ")
                    || t.starts_with("note: ")
                    || t.starts_with("info: ")
                    || t.starts_with("warning: ")
                    || t.starts_with("- ")
                    || t.starts_with("+ ")
                    || t.bytes().next().is_some_and(|b| b.is_ascii_digit()) && t.contains('|');
                if part && p.lines < MAX_BLOCK {
                    p.lines += 1;
                    p.excerpt.push(text);
                    if p.headless
                        && p.finding.message.is_empty()
                        && let Some(h) = t.strip_prefix("help: ")
                    {
                        p.finding.message = h.to_string();
                    }
                    return;
                }
                if let State::Block(p) = &mut self.state
                    && p.finding.message.is_empty()
                {
                    p.finding.message = "ruff reported a diagnostic here".into();
                }
                let blank = text.trim().is_empty();
                self.flush(sink);
                if blank {
                    self.state = State::Between;
                } else {
                    self.idle(text, sink);
                }
            }
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        if let State::Block(p) = &mut self.state
            && p.finding.message.is_empty()
        {
            p.finding.message = "ruff reported a diagnostic here".into();
        }
        self.flush(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(
            header("F401 [*] `os` imported"),
            Some(("F401", "`os` imported"))
        );
        assert_eq!(
            header("PLR2004 Magic value"),
            Some(("PLR2004", "Magic value"))
        );
        assert_eq!(
            header("invalid-syntax: Expected"),
            Some(("invalid-syntax", "Expected"))
        );
        assert_eq!(header("HTTP 200 OK"), None);
        assert_eq!(header("E741"), None);
        assert_eq!(header("ABC12345 x"), None);
    }
}
