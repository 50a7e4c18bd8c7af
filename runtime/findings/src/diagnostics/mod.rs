//! Readers of compilers', type checkers' and linters' diagnostics: rustc and cargo, gcc and
//! clang, tsc, mypy, ruff, eslint.
//!
//! Each reads its tool's default human format. A diagnostic is recognised by its tool's exact
//! shape (`file:line:col: error: ...` with a source file of the tool's languages, a header
//! followed by ` --> file:line:col`, ...), never by a word such as `error` alone, so an
//! ordinary program's log gives nothing. The snippet after a header is read as a block
//! ([`crate::Reader::wants_all`]) of a bounded number of lines.

use crate::{MAX_EXCERPT, MAX_EXCERPT_LINES, MAX_NAME, Reader};

mod eslint;
mod gcc;
mod mypy;
mod ruff;
mod rustc;
mod tsc;

/// The diagnostics' readers.
pub fn readers() -> Vec<Box<dyn Reader>> {
    vec![
        Box::new(rustc::Rustc::default()),
        Box::new(gcc::Gcc::default()),
        Box::new(tsc::Tsc::default()),
        Box::new(mypy::Mypy::default()),
        Box::new(ruff::Ruff::default()),
        Box::new(eslint::Eslint::default()),
    ]
}

/// Most lines a reader stays in one diagnostic's block.
const MAX_BLOCK: usize = 64;

/// A location at the start of a line: `file:line[:column]` and what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct At<'a> {
    file: &'a str,
    line: u32,
    column: Option<u32>,
    /// After the location and its `:` (start trimmed); empty when the location ends the text.
    rest: &'a str,
}

/// `file:line[:column]` at the start of `s`, then the end of `s` or `:` and the rest. The file
/// must look like one ([`plausible_file`]).
fn split_location(s: &str) -> Option<At<'_>> {
    let colon = s.find(':')?;
    let file = &s[..colon];
    if !plausible_file(file) {
        return None;
    }
    let (line, after) = number(&s[colon + 1..])?;
    let (column, after) = match after.strip_prefix(':').and_then(number) {
        Some((c, a)) => (Some(c), a),
        None => (None, after),
    };
    let rest = if after.is_empty() {
        ""
    } else {
        after.strip_prefix(':')?.trim_start()
    };
    Some(At {
        file,
        line,
        column,
        rest,
    })
}

/// A decimal number (at most 9 digits) at the start of `s`, and what follows.
fn number(s: &str) -> Option<(u32, &str)> {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 || n > 9 {
        return None;
    }
    Some((s[..n].parse().ok()?, &s[n..]))
}

/// Whether `f` looks like a file a tool names: not empty, bounded, no white space or control
/// characters, no quotes or brackets a log's prose would have.
fn plausible_file(f: &str) -> bool {
    // Bytes, not chars: this runs on every line that holds an anchor.
    let odd = |b: u8| b <= b' ' || b == 0x7f || b"\"'`()[]{}<>|*?".contains(&b);
    !f.is_empty() && f.len() <= MAX_NAME && !f.starts_with('-') && !f.bytes().any(odd)
}

/// The extension of `f`'s last component (after its last dot), when it has one.
fn extension(f: &str) -> Option<&str> {
    let name = f.rsplit('/').next().unwrap_or(f);
    let dot = name.rfind('.')?;
    (dot > 0 && dot + 1 < name.len()).then(|| &name[dot + 1..])
}

/// Whether `f` has one of these extensions.
fn has_extension(f: &str, exts: &[&str]) -> bool {
    extension(f).is_some_and(|e| exts.contains(&e))
}

/// An excerpt being gathered: lines up to the bounds a finding keeps.
#[derive(Debug, Default, Clone)]
struct Excerpt {
    text: String,
    lines: usize,
}

impl Excerpt {
    fn push(&mut self, line: &str) {
        let line = line.trim_end();
        if self.lines > MAX_EXCERPT_LINES || self.text.len() + line.len() + 1 > MAX_EXCERPT + 64 {
            return;
        }
        let line = crate::bound(line, crate::MAX_MESSAGE);
        self.text.push_str(&line);
        self.text.push('\n');
        self.lines += 1;
    }

    fn take(&mut self) -> Option<String> {
        self.lines = 0;
        let t = std::mem::take(&mut self.text);
        let t = t.trim_end();
        (!t.is_empty()).then(|| t.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_split() {
        let at = split_location("src/a.c:6:13: error: x").unwrap_or_else(|| panic!());
        assert_eq!(
            (at.file, at.line, at.column, at.rest),
            ("src/a.c", 6, Some(13), "error: x")
        );
        let at = split_location("a.py:7: error: y").unwrap_or_else(|| panic!());
        assert_eq!((at.line, at.column, at.rest), (7, None, "error: y"));
        let at = split_location("src/main.rs:4:18").unwrap_or_else(|| panic!());
        assert_eq!((at.line, at.column, at.rest), (4, Some(18), ""));
        assert!(split_location("2024-01-01 12:00:00: error: refused").is_none());
        assert!(split_location("a.c:x: error").is_none());
        assert!(split_location("a.c:12x: error").is_none());
        assert!(split_location("a.c:99999999999: error").is_none());
        assert!(split_location("").is_none());
        assert_eq!(extension("dir.d/file"), None);
        assert_eq!(extension("a/.hidden"), None);
        assert_eq!(extension("a/b.tar.gz"), Some("gz"));
    }
}
