//! tsc: `src/a.ts(3,7): error TS2322: ...` (its default when not on a terminal) with the
//! indented lines of an elaborated message, and `--pretty`'s `src/a.ts:3:7 - error TS2322: ...`
//! with its snippet and related locations. Errors of the whole project (`error TS18003: No
//! inputs were found ...`) have no location.

use super::{Excerpt, MAX_BLOCK, has_extension, plausible_file, split_location};
use crate::{Finding, FindingKind, Line, Reader, Sink};

const EXTENSIONS: &[&str] = &[
    "ts", "tsx", "mts", "cts", "js", "jsx", "mjs", "cjs", "json", "vue", "svelte",
];

#[derive(Debug, Default)]
pub(super) struct Tsc {
    cur: Option<Pending>,
}

#[derive(Debug)]
struct Pending {
    finding: Finding,
    excerpt: Excerpt,
    pretty: bool,
    lines: usize,
    blanks: usize,
}

/// `error TS2322: msg` at the start of `s`: (code, msg).
fn error(s: &str) -> Option<(&str, &str)> {
    let r = s.strip_prefix("error TS")?;
    let n = r.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 || n > 6 {
        return None;
    }
    let msg = r[n..].strip_prefix(": ")?.trim();
    (!msg.is_empty()).then_some((&s[6..8 + n], msg))
}

/// A header: (file, line, column, code, msg, pretty); no file for a project's error.
type Header<'a> = (Option<&'a str>, u32, u32, &'a str, &'a str, bool);

fn header(s: &str) -> Option<Header<'_>> {
    if let Some((code, msg)) = error(s) {
        return Some((None, 0, 0, code, msg, false));
    }
    // `file(line,col): error TS...`
    if let Some(i) = s.find("): error TS") {
        let (file, pos) = s[..i].rsplit_once('(')?;
        let (l, c) = pos.split_once(',')?;
        let (code, msg) = error(&s[i + 3..])?;
        if plausible_file(file) && has_extension(file, EXTENSIONS) {
            return Some((
                Some(file),
                l.parse().ok()?,
                c.parse().ok()?,
                code,
                msg,
                false,
            ));
        }
        return None;
    }
    // `file:line:col - error TS...`
    let (loc, rest) = s.split_once(" - ")?;
    let at = split_location(loc)?;
    let (code, msg) = error(rest)?;
    (at.rest.is_empty() && has_extension(at.file, EXTENSIONS)).then_some((
        Some(at.file),
        at.line,
        at.column?,
        code,
        msg,
        true,
    ))
}

impl Tsc {
    fn flush(&mut self, sink: &mut Sink) {
        if let Some(mut p) = self.cur.take() {
            p.finding.excerpt = p.excerpt.take();
            sink.push(p.finding);
        }
    }

    fn start(&mut self, text: &str, sink: &mut Sink) {
        let Some((file, line, col, code, msg, pretty)) = header(text) else {
            return;
        };
        let location = file.map(|f| sink.location(f, Some(line), Some(col)));
        let mut excerpt = Excerpt::default();
        excerpt.push(text);
        self.cur = Some(Pending {
            finding: Finding {
                kind: FindingKind::CompileError,
                tool: "tsc".into(),
                name: Some(code.to_string()),
                location,
                message: msg.to_string(),
                excerpt: None,
            },
            excerpt,
            pretty,
            lines: 1,
            blanks: 0,
        });
    }
}

impl Reader for Tsc {
    fn tool(&self) -> &'static str {
        "tsc"
    }

    fn anchors(&self) -> &'static [&'static str] {
        // `--pretty` colours it as `ESC[91merror ESC[0m ESC[90m TS2322: `.
        &["error TS", "\x1b[90m TS"]
    }

    fn wants_all(&self) -> bool {
        self.cur.is_some()
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        let Some(p) = &mut self.cur else {
            self.start(text, sink);
            return;
        };
        let new = header(text).is_some();
        let keep = !new
            && p.lines < MAX_BLOCK
            && if p.pretty {
                // Blank, snippet, blank, related locations, then two blank lines.
                if text.trim().is_empty() {
                    p.blanks += 1;
                    p.blanks < 2
                } else {
                    p.blanks = 0;
                    !text.starts_with("Found ")
                }
            } else {
                // An elaborated message's lines are indented.
                text.starts_with("  ") && !text.trim().is_empty()
            };
        if keep {
            p.lines += 1;
            if !text.trim().is_empty() {
                p.excerpt.push(text);
            }
            return;
        }
        self.flush(sink);
        if new {
            self.start(text, sink);
        }
    }

    fn end(&mut self, sink: &mut Sink) {
        self.flush(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(
            header("src/a.ts(3,7): error TS2322: Type 'string'."),
            Some((Some("src/a.ts"), 3, 7, "TS2322", "Type 'string'.", false))
        );
        assert_eq!(
            header("src/a.ts:3:7 - error TS2322: T"),
            Some((Some("src/a.ts"), 3, 7, "TS2322", "T", true))
        );
        assert_eq!(
            header("error TS18003: No inputs."),
            Some((None, 0, 0, "TS18003", "No inputs.", false))
        );
        assert_eq!(header("log (3,7): error TS2322: x"), None);
        assert_eq!(header("error TS: x"), None);
    }
}
