//! rustc and cargo (`build`, `check`, `test`, `clippy`): the human format, a header
//! (`error[E0308]: mismatched types`, `warning: unused variable: ...`) then ` --> file:line:col`
//! and the snippet, and the short format (`src/main.rs:3:5: error[E0308]: ...`).

use super::{Excerpt, MAX_BLOCK, has_extension, split_location};
use crate::{Finding, FindingKind, Line, Reader, Sink};

/// Lint names learned from the first diagnostic of each lint: rustc names a lint only on the
/// first of its reports, and the others share its message's shape.
const MAX_LEARNED: usize = 32;

#[derive(Debug, Default)]
pub(super) struct Rustc {
    cur: Option<Diag>,
    learned: Vec<(String, String)>,
}

#[derive(Debug, Default)]
struct Diag {
    error: bool,
    code: Option<String>,
    message: String,
    location: Option<(String, u32, Option<u32>)>,
    lint: Option<String>,
    clippy: bool,
    excerpt: Excerpt,
    /// Lines of the block read so far (the header is the first).
    lines: usize,
}

/// `error[E0308]: msg`, `error: msg`, `warning: msg` at the start of `s`: (error, code, msg).
fn header(s: &str) -> Option<(bool, Option<&str>, &str)> {
    let (error, rest) = if let Some(r) = s.strip_prefix("error") {
        (true, r)
    } else {
        (false, s.strip_prefix("warning")?)
    };
    let (code, rest) = match rest.strip_prefix('[') {
        Some(r) => {
            let end = r.find(']')?;
            let code = &r[..end];
            // rustc's codes are `E` and four digits.
            let ok = code.len() == 5
                && code.starts_with('E')
                && code[1..].bytes().all(|b| b.is_ascii_digit());
            if !ok {
                return None;
            }
            (Some(code), &r[end + 1..])
        }
        None => (None, rest),
    };
    let msg = rest.strip_prefix(": ")?.trim();
    (!msg.is_empty()).then_some((error, code, msg))
}

/// Cargo's and rustc's summaries, which are no diagnostics.
fn summary(msg: &str) -> bool {
    msg.starts_with("could not compile")
        || msg.starts_with("aborting due to")
        || msg.starts_with("build failed")
        || (msg.starts_with('`') && msg.contains(" generated "))
        || msg.ends_with(" emitted")
        || msg.contains("warnings emitted")
}

/// A message's shape: what is between backticks left out, so that `unused variable: `a`` and
/// `unused variable: `b`` are one.
fn stem(msg: &str) -> String {
    let mut out = String::new();
    for (i, part) in msg.split('`').enumerate() {
        if i % 2 == 0 {
            out.push_str(part);
        } else {
            out.push('`');
        }
    }
    out
}

/// The lint a note or help line names: `#[warn(unused_variables)]`, `-D clippy::len-zero`,
/// clippy's `...index.html#len_zero`.
fn lint_of(note: &str) -> Option<(String, bool)> {
    let note = note.trim_start().strip_prefix('=')?.trim_start();
    if let Some(i) = note.find("rust-clippy/") {
        let anchor = note[i..].rsplit('#').next()?;
        let name = anchor.trim();
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Some((format!("clippy::{name}"), true));
        }
        return None;
    }
    let name = if let Some(i) = note.find("#[") {
        let r = &note[i + 2..];
        let open = r.find('(')?;
        let level = &r[..open];
        if !matches!(level, "warn" | "deny" | "forbid") {
            return None;
        }
        let close = r.find(')')?;
        r.get(open + 1..close)?.to_string()
    } else if let Some(r) = note
        .strip_prefix("note: `-D ")
        .or(note.strip_prefix("note: `-W "))
    {
        let end = r.find('`')?;
        r[..end].replace('-', "_")
    } else {
        return None;
    };
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    ok.then(|| {
        let clippy = name.starts_with("clippy::");
        (name, clippy)
    })
}

impl Rustc {
    fn flush(&mut self, sink: &mut Sink) {
        let Some(mut d) = self.cur.take() else {
            return;
        };
        let linking = d.message.starts_with("linking with `");
        if d.location.is_none() && d.code.is_none() && !linking {
            return;
        }
        let key = stem(&d.message);
        if let Some(lint) = &d.lint {
            if self.learned.len() < MAX_LEARNED && !self.learned.iter().any(|(k, _)| *k == key) {
                self.learned.push((key, lint.clone()));
            }
        } else if d.code.is_none() {
            d.lint = self
                .learned
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, l)| l.clone());
            d.clippy = d.lint.as_deref().is_some_and(|l| l.starts_with("clippy::"));
        }
        let kind = if d.clippy || !d.error {
            FindingKind::Lint
        } else {
            FindingKind::CompileError
        };
        let location = d
            .location
            .as_ref()
            .map(|(f, l, c)| sink.location(f, Some(*l), *c));
        sink.push(Finding {
            kind,
            tool: if d.clippy { "clippy" } else { "rustc" }.into(),
            name: d.code.or(d.lint),
            location,
            message: d.message,
            excerpt: d.excerpt.take(),
        });
    }

    fn start(&mut self, text: &str, sink: &mut Sink) {
        let head = text.starts_with("error") || text.starts_with("warning");
        if !head && !text.contains(".rs:") {
            return;
        }
        // The short format: one line per diagnostic.
        if let Some(at) = split_location(text)
            && has_extension(at.file, &["rs"])
        {
            if let Some((error, code, msg)) = header(at.rest) {
                let location = Some(sink.location(at.file, Some(at.line), at.column));
                sink.push(Finding {
                    kind: if error {
                        FindingKind::CompileError
                    } else {
                        FindingKind::Lint
                    },
                    tool: "rustc".into(),
                    name: code.map(str::to_string),
                    location,
                    message: msg.to_string(),
                    excerpt: None,
                });
            }
            return;
        }
        let Some((error, code, msg)) = header(text) else {
            return;
        };
        if summary(msg) {
            return;
        }
        let mut d = Diag {
            error,
            code: code.map(str::to_string),
            message: msg.to_string(),
            lines: 1,
            ..Diag::default()
        };
        d.excerpt.push(text);
        self.cur = Some(d);
    }
}

impl Reader for Rustc {
    fn tool(&self) -> &'static str {
        "rustc"
    }

    fn anchors(&self) -> &'static [&'static str] {
        // With colour, a header is `ESC[91merror ESC[0m ESC[1m: msg`.
        &[
            "error[",
            "error: ",
            "error\x1b[",
            "warning[",
            "warning: ",
            "warning\x1b[",
        ]
    }

    fn wants_all(&self) -> bool {
        self.cur.is_some()
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        let Some(d) = &mut self.cur else {
            self.start(text, sink);
            return;
        };
        if text.starts_with("error") || text.starts_with("warning") {
            self.flush(sink);
            self.start(text, sink);
            return;
        }
        if text.trim().is_empty() || d.lines >= MAX_BLOCK {
            self.flush(sink);
            return;
        }
        d.lines += 1;
        if d.lines == 2 {
            // The line after the header must be its location, else it was no rustc header.
            let at = text
                .trim_start()
                .strip_prefix("--> ")
                .and_then(split_location)
                .filter(|at| at.rest.is_empty() && at.column.is_some());
            match at {
                Some(at) => d.location = Some((at.file.to_string(), at.line, at.column)),
                None if d.code.is_some() || d.message.starts_with("linking with `") => {}
                None => {
                    self.cur = None;
                    return;
                }
            }
        }
        if d.lint.is_none()
            && let Some((lint, clippy)) = lint_of(text)
        {
            d.lint = Some(lint);
            d.clippy |= clippy;
        }
        d.excerpt.push(text);
    }

    fn end(&mut self, sink: &mut Sink) {
        self.flush(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_lints_are_parsed() {
        assert_eq!(
            header("error[E0308]: mismatched types"),
            Some((true, Some("E0308"), "mismatched types"))
        );
        assert_eq!(header("warning: unused"), Some((false, None, "unused")));
        assert_eq!(header("errors: 3"), None);
        assert_eq!(header("error:"), None);
        assert_eq!(
            lint_of(
                "  = note: `#[warn(unused_variables)]` (part of `#[warn(unused)]`) on by default"
            ),
            Some(("unused_variables".into(), false))
        );
        assert_eq!(
            lint_of("  = note: `-D clippy::len-zero` implied by `-D warnings`"),
            Some(("clippy::len_zero".into(), true))
        );
        assert_eq!(
            lint_of(
                "  = help: for further information visit https://rust-lang.github.io/rust-clippy/rust-1.95.0/index.html#len_zero"
            ),
            Some(("clippy::len_zero".into(), true))
        );
        assert_eq!(stem("unused variable: `a`"), stem("unused variable: `bb`"));
    }
}
