//! eslint's default "stylish" formatter: a file's absolute path on a line of its own, then one
//! indented line per problem (`  3:7  error  'x' is assigned a value but never used
//! no-unused-vars`), a blank line, the next file, and the `✖ 2 problems` total. Both severities
//! are lint; the severity is in the excerpt, the rule is the name.

use super::{has_extension, number};
use crate::{Finding, FindingKind, Line, MAX_NAME, Reader, Sink};

const EXTENSIONS: &[&str] = &[
    "js", "jsx", "mjs", "cjs", "ts", "tsx", "mts", "cts", "vue", "svelte", "astro", "json", "md",
    "html",
];

#[derive(Debug, Default)]
pub(super) struct Eslint {
    state: State,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Idle,
    /// A line that may be a file's: its problems must follow.
    File(String),
    /// Among a file's problems (a file not seen: see [`Eslint::anchors`]).
    Problems(Option<String>),
    /// A blank line after a file's problems: the next file may follow.
    Between,
}

/// A file's line: an absolute path with a linted extension, alone on its line.
fn file_line(s: &str) -> Option<&str> {
    let s = s.trim_end();
    let ok = (s.starts_with('/') || s.as_bytes().get(1..3) == Some(b":\\"))
        && s.len() <= MAX_NAME
        && !s.contains("  ")
        && !s.chars().any(char::is_control)
        && has_extension(s, EXTENSIONS);
    ok.then_some(s)
}

/// `  3:7  error  msg  rule`: (line, column, is error, message, rule).
fn problem(s: &str) -> Option<(u32, u32, bool, &str, Option<&str>)> {
    let t = s.strip_prefix("  ")?;
    let (line, r) = number(t)?;
    let (col, r) = number(r.strip_prefix(':')?)?;
    let r = r.strip_prefix("  ")?.trim_start();
    let (error, r) = if let Some(r) = r.strip_prefix("error  ") {
        (true, r)
    } else {
        (false, r.strip_prefix("warning  ")?)
    };
    let r = r.trim();
    let (msg, rule) = match r.rsplit_once("  ") {
        Some((m, rule)) if rule_id(rule.trim()) => (m.trim_end(), Some(rule.trim())),
        _ => (r, None),
    };
    (!msg.is_empty()).then_some((line, col, error, msg, rule))
}

/// `no-unused-vars`, `@typescript-eslint/no-explicit-any`, `react/jsx-key`.
fn rule_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_/@.".contains(&b))
        && s.bytes().any(|b| b.is_ascii_lowercase())
}

impl Reader for Eslint {
    fn tool(&self) -> &'static str {
        "eslint"
    }

    fn anchors(&self) -> &'static [&'static str] {
        // A file's line holds nothing but its path, so only with colour (the underline's end)
        // is it an anchor; the files after the first are read as the report's block.
        &["  error  ", "  warning  ", "\x1b[24m"]
    }

    fn wants_all(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        let (in_problems, mut file) = match std::mem::take(&mut self.state) {
            State::File(f) => (true, Some(f)),
            State::Problems(f) => (true, f),
            State::Idle | State::Between => (false, None),
        };
        if let Some((l, c, error, msg, rule)) = problem(text) {
            // Without colour the first file's line is no anchor: it is the line before its
            // first problem, when at hand.
            if file.is_none() && !in_problems {
                file = file_line(&line.previous()).map(str::to_string);
            }
            // Problems without a file must name a rule, or be a parsing error, to be taken
            // for eslint's.
            if file.is_none() && rule.is_none() && !msg.starts_with("Parsing error: ") {
                return;
            }
            let severity = if error { "error" } else { "warning" };
            let excerpt = match rule {
                Some(r) => format!("{l}:{c} {severity} {msg} ({r})"),
                None => format!("{l}:{c} {severity} {msg}"),
            };
            sink.push(Finding {
                kind: FindingKind::Lint,
                tool: "eslint".into(),
                name: rule.map(str::to_string),
                location: file.as_deref().map(|f| sink.location(f, Some(l), Some(c))),
                message: msg.to_string(),
                excerpt: Some(excerpt),
            });
            self.state = State::Problems(file);
            return;
        }
        if text.trim().is_empty() && in_problems {
            self.state = State::Between;
            return;
        }
        if let Some(f) = file_line(text) {
            self.state = State::File(f.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_and_files() {
        assert_eq!(
            problem("  3:13  error    'v' is not defined                no-undef"),
            Some((3, 13, true, "'v' is not defined", Some("no-undef")))
        );
        assert_eq!(
            problem("  1:10  error  Parsing error: Unexpected token ("),
            Some((1, 10, true, "Parsing error: Unexpected token (", None))
        );
        assert_eq!(problem("  error  something"), None);
        assert_eq!(file_line("/w/src/a.js"), Some("/w/src/a.js"));
        assert_eq!(file_line("src/a.js"), None);
        assert_eq!(file_line("/w/a.txt"), None);
    }
}
