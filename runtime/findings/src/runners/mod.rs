//! Readers of test runners' output: pytest, unittest, cargo test, nextest, go test, jest, vitest.
//!
//! Each reader follows one runner's default report: it recognises the start of a failure's
//! block by a line only that runner prints, reads the block (bounded in lines), and reports the
//! failure once it knows its test, file and line. Lines a reader does not recognise are left
//! alone, so another tool's output gives nothing.

use crate::{MAX_EXCERPT, MAX_EXCERPT_LINES, MAX_MESSAGE, Reader, Sink, cut};

mod cargo_test;
mod go_test;
mod jest;
mod nextest;
mod pytest;
mod rust_panic;
mod unittest;
mod vitest;

pub use cargo_test::CargoTest;
pub use go_test::GoTest;
pub use jest::Jest;
pub use nextest::Nextest;
pub use pytest::Pytest;
pub use unittest::Unittest;
pub use vitest::Vitest;

pub(crate) use pytest::python_file_line;

/// The test runners' readers.
pub fn readers() -> Vec<Box<dyn Reader>> {
    vec![
        Box::new(Pytest::default()),
        Box::new(Unittest::default()),
        Box::new(CargoTest::default()),
        Box::new(Nextest::default()),
        Box::new(GoTest::default()),
        Box::new(Jest::default()),
        Box::new(Vitest::default()),
    ]
}

/// Most lines a reader reads of one failure's block before it stops asking for every line.
pub(crate) const BLOCK_LINES: usize = 400;

/// An excerpt collected line by line, bounded as it grows (the sink bounds it again).
#[derive(Debug, Default, Clone)]
pub(crate) struct Excerpt {
    text: String,
    lines: usize,
}

impl Excerpt {
    /// An empty excerpt written into `text` (emptied).
    pub(crate) fn with(mut text: String) -> Excerpt {
        text.clear();
        Excerpt { text, lines: 0 }
    }

    /// The string it was written into, whatever it holds.
    pub(crate) fn into_text(self) -> String {
        self.text
    }

    /// Appends one line while there is room; a line beyond the bounds is dropped.
    pub(crate) fn push(&mut self, line: &str) {
        let line = line.trim_end();
        if self.lines > MAX_EXCERPT_LINES || self.text.len() >= MAX_EXCERPT {
            return;
        }
        // As `bound` cuts it, without a string of its own.
        let (kept, cut) = cut(line, MAX_MESSAGE);
        let len = kept.len() + if cut { 3 } else { 0 };
        if self.text.len() + len + 1 > MAX_EXCERPT + 4 {
            self.lines = MAX_EXCERPT_LINES + 1;
            return;
        }
        self.text.reserve(len + 1);
        self.text.push_str(kept);
        if cut {
            self.text.push_str("...");
        }
        self.text.push('\n');
        self.lines += 1;
    }

    /// The excerpt, or none when it holds nothing.
    pub(crate) fn take(&mut self) -> Option<String> {
        let t = std::mem::take(&mut self.text);
        self.lines = 0;
        if t.trim().is_empty() { None } else { Some(t) }
    }
}

/// A place as tools print it at the start of a text: `file:line`, `file:line:col`, followed by
/// the end, a colon or a space. Gives the file, line, column and the rest after the place.
pub(crate) fn file_line(s: &str) -> Option<(&str, u32, Option<u32>, &str)> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(i) = memchr::memchr(b':', &b[from..]).map(|i| from + i) {
        let file = &s[..i];
        if file.is_empty() || file.bytes().any(|c| c.is_ascii_whitespace()) || file.starts_with('<')
        {
            return None;
        }
        let (line, after) = digits(&s[i + 1..]);
        if let Some(line) = line {
            let (col, rest) = match after.strip_prefix(':') {
                Some(r) => match digits(r) {
                    (Some(c), r2) => (Some(c), r2),
                    (None, _) => (None, after),
                },
                None => (None, after),
            };
            if rest.is_empty() || rest.starts_with(':') || rest.starts_with(' ') {
                let rest = rest.strip_prefix(':').unwrap_or(rest);
                return Some((file, line, col, rest.trim_start()));
            }
        }
        from = i + 1;
    }
    None
}

/// The number at the start of `s` (at most 9 digits) and the rest.
pub(crate) fn digits(s: &str) -> (Option<u32>, &str) {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 || n > 9 {
        return (None, s);
    }
    (s[..n].parse().ok(), &s[n..])
}

/// Leading spaces and tabs of a line.
pub(crate) fn indent(s: &str) -> usize {
    s.len() - s.trim_start_matches([' ', '\t']).len()
}

/// `N word` items of a counts line (`3 failed, 1 passed`, `3 failed | 2 passed`): calls
/// `each(n, word)` for each; false when an item is not of that shape.
pub(crate) fn count_items(s: &str, sep: char, mut each: impl FnMut(u64, &str)) -> bool {
    let mut any = false;
    for item in s.split(sep) {
        let item = item.trim();
        let Some((n, word)) = item.split_once(' ') else {
            return false;
        };
        let Ok(n) = n.parse::<u64>() else {
            return false;
        };
        each(n, word.trim());
        any = true;
    }
    any
}

/// Whether the line is a file inside the workspace, as `sink` locates it.
pub(crate) fn inside(sink: &Sink, file: &str) -> bool {
    let p = sink.paths();
    p.inside(&p.locate(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_parsed() {
        assert_eq!(
            file_line("tests/test_a.py:17: AssertionError"),
            Some(("tests/test_a.py", 17, None, "AssertionError"))
        );
        assert_eq!(
            file_line("src/lib.rs:12:5:"),
            Some(("src/lib.rs", 12, Some(5), ""))
        );
        assert_eq!(
            file_line("x_test.go:12: got 1"),
            Some(("x_test.go", 12, None, "got 1"))
        );
        assert_eq!(file_line("http://x:80/a"), None);
        assert_eq!(file_line("a b.py:1: x"), None);
        assert_eq!(file_line("<frozen x>:1: in y"), None);
        assert_eq!(file_line("no place here"), None);
    }

    #[test]
    fn an_excerpt_stays_bounded() {
        let mut e = Excerpt::default();
        for _ in 0..1000 {
            e.push(&"x".repeat(1000));
        }
        let t = e.take().unwrap_or_default();
        assert!(t.len() <= MAX_EXCERPT + 4 + MAX_MESSAGE, "{}", t.len());
    }
}
