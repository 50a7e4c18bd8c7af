//! gcc and clang (C, C++, Objective-C): `file.c:3:5: error: ...`, `warning: ... [-Wflag]`,
//! `fatal error: ...`, `note:` lines and the caret snippet folded into the finding before them,
//! the `In function 'main':` context, the drivers' own errors, and the linker's
//! `undefined reference to`. Which compiler it was shows in the output (clang's `N errors
//! generated.`, gcc's `In function` and `collect2:`), so findings wait for such a line; without
//! one they are gcc's.

use super::{Excerpt, MAX_BLOCK, has_extension, plausible_file, split_location};
use crate::{Finding, FindingKind, Line, MAX_FINDINGS, Reader, Sink};

/// Source files of the C family (a header of the C++ library has no extension: see
/// [`source_file`]).
const EXTENSIONS: &[&str] = &[
    "c", "h", "cc", "cp", "cpp", "cxx", "c++", "C", "hh", "hpp", "hxx", "h++", "H", "m", "mm", "M",
    "i", "ii", "s", "S", "sx", "inl", "ipp", "tcc", "tpp", "cu", "cuh",
];

fn source_file(f: &str) -> bool {
    has_extension(f, EXTENSIONS)
        || (f.starts_with('/') && f.contains("/include/") && super::extension(f).is_none())
}

#[derive(Debug, Default)]
pub(super) struct Gcc {
    /// The diagnostic whose snippet and notes are being read.
    cur: Option<Pending>,
    /// Findings that wait for a line telling which compiler it was.
    held: Vec<Finding>,
    /// The last `file: In function 'f':` line, for the next diagnostic in that file.
    context: Option<(String, String)>,
}

#[derive(Debug)]
struct Pending {
    finding: Finding,
    excerpt: Excerpt,
    lines: usize,
    /// gcc's snippet (`  6 |     int y = x;`) was seen: clang's has no `|` (before clang 19).
    gutter: bool,
}

enum Severity {
    Error,
    Fatal,
    Warning,
    Note,
}

fn severity(rest: &str) -> Option<(Severity, &str)> {
    for (p, s) in [
        ("error: ", Severity::Error),
        ("fatal error: ", Severity::Fatal),
        ("warning: ", Severity::Warning),
        ("note: ", Severity::Note),
    ] {
        if let Some(m) = rest.strip_prefix(p) {
            let m = m.trim();
            return (!m.is_empty()).then_some((s, m));
        }
    }
    None
}

/// The `[-Wflag]` or `[-Werror=flag]` that ends a warning, as `-Wflag`.
fn flag(msg: &str) -> Option<String> {
    let open = msg.rfind(" [-W")?;
    let inner = msg[open + 2..].strip_suffix(']')?;
    let name = inner
        .strip_prefix("-Werror=")
        .map(|f| format!("-W{f}"))
        .unwrap_or_else(|| inner.to_string());
    (name.len() > 2 && !name.contains(' ')).then_some(name)
}

/// A compiler driver's name (`gcc`, `x86_64-linux-gnu-g++-12`, `clang++`, `cc1plus`).
fn driver(name: &str) -> Option<&'static str> {
    let word = |b: u8| b.is_ascii_alphanumeric() || b"_+-".contains(&b);
    if name.is_empty() || name.len() > 64 || !name.bytes().all(word) {
        return None;
    }
    if name.contains("clang") {
        Some("clang")
    } else if name.contains("gcc")
        || name.contains("g++")
        || name.starts_with("cc1")
        || name == "cc"
        || name == "c++"
    {
        Some("gcc")
    } else {
        None
    }
}

/// A line of a snippet: gcc's `    6 |     int y = x;` and `      |     ^`, clang's caret line.
fn gutter_line(s: &str) -> bool {
    let t = s.trim_start();
    let t = t.trim_start_matches(|c: char| c.is_ascii_digit());
    t.starts_with("| ") || t == "|" || t.starts_with("|\t")
}

fn caret_line(s: &str) -> bool {
    let t = s.trim();
    t.starts_with('^') || t.starts_with('~') && t.contains('^')
}

impl Gcc {
    fn flush(&mut self, sink: &mut Sink) {
        let Some(mut p) = self.cur.take() else {
            return;
        };
        p.finding.excerpt = p.excerpt.take();
        if p.gutter {
            // A snippet with a gutter is gcc's; so are those held before it.
            self.release("gcc", sink);
        }
        if self.held.len() >= MAX_FINDINGS {
            self.release("gcc", sink);
        }
        self.held.push(p.finding);
    }

    /// The held findings, as this compiler's.
    fn release(&mut self, tool: &str, sink: &mut Sink) {
        for mut f in self.held.drain(..) {
            f.tool = tool.into();
            sink.push(f);
        }
    }

    fn start(&mut self, text: &str, finding: Finding, sink: &mut Sink) {
        self.flush(sink);
        let mut excerpt = Excerpt::default();
        if let (Some((file, ctx)), Some(loc)) = (&self.context, &finding.location)
            && sink.paths().locate(file) == loc.file
        {
            excerpt.push(ctx);
        }
        excerpt.push(text);
        self.cur = Some(Pending {
            finding,
            excerpt,
            lines: 1,
            gutter: false,
        });
    }

    /// A line that holds an anchor (or any, in a snippet) but is no snippet line.
    fn other(&mut self, text: &str, sink: &mut Sink) {
        let t = text.trim();
        // What tells which compiler it was.
        if t.ends_with(" generated.")
            && (t.contains(" error") || t.contains(" warning"))
            && t.starts_with(|c: char| c.is_ascii_digit())
        {
            self.flush(sink);
            self.release("clang", sink);
            return;
        }
        if let Some(at) = split_location(text)
            && source_file(at.file)
            && let Some((sev, msg)) = severity(at.rest)
        {
            if let Severity::Note = sev {
                if let Some(p) = &mut self.cur {
                    p.excerpt.push(text);
                    p.lines += 1;
                }
                return;
            }
            let name = flag(msg);
            let kind = match sev {
                Severity::Warning => FindingKind::Lint,
                _ => FindingKind::CompileError,
            };
            let message = match (&name, msg.rfind(" [-W")) {
                (Some(_), Some(i)) => &msg[..i],
                _ => msg,
            };
            let finding = Finding {
                kind,
                tool: "gcc".into(),
                name,
                location: Some(sink.location(at.file, Some(at.line), at.column)),
                message: message.to_string(),
                excerpt: None,
            };
            self.start(text, finding, sink);
            return;
        }
        // `src/a.c: In function 'main':` (gcc only).
        if text.ends_with(':')
            && let Some((file, _)) = text.split_once(": In ")
            && source_file(file)
            && plausible_file(file)
        {
            self.flush(sink);
            self.release("gcc", sink);
            self.context = Some((file.to_string(), text.to_string()));
            return;
        }
        if let Some(i) = text.find("undefined reference to ") {
            self.linker(text, i, sink);
            return;
        }
        // The drivers: `gcc: error: x.c: No such file`, `clang: error: linker command failed`,
        // `collect2: error: ld returned 1 exit status`.
        if let Some((name, rest)) = text.split_once(": ")
            && name.len() <= 64
        {
            if name == "collect2" {
                self.flush(sink);
                self.release("gcc", sink);
                return;
            }
            if let Some(tool) = driver(name) {
                self.flush(sink);
                self.release(tool, sink);
                let Some((Severity::Error | Severity::Fatal, msg)) = severity(rest) else {
                    return;
                };
                if msg.starts_with("linker command failed") || msg.starts_with("ld returned") {
                    return;
                }
                let f = Finding {
                    kind: FindingKind::CompileError,
                    tool: tool.into(),
                    name: None,
                    location: None,
                    message: msg.to_string(),
                    excerpt: Some(text.to_string()),
                };
                self.held.push(f);
                self.release(tool, sink);
            }
        }
    }

    /// `/usr/bin/ld: link.c:(.text+0x5): undefined reference to `foo'` and gcc's
    /// `link.c:(.text+0x5): undefined reference to `foo'` (the object's file in the line before).
    fn linker(&mut self, text: &str, at: usize, sink: &mut Sink) {
        self.flush(sink);
        let head = text[..at].trim_end().trim_end_matches(':');
        let head = match head.find("ld: ") {
            Some(i) if !head[..i].contains(' ') => &head[i + 4..],
            _ => head,
        };
        // `file.c:(.text+0x5)`, `file.c:12`, `/tmp/x.o:(.text+0x5)` or nothing.
        let file = head.split(':').next().unwrap_or("");
        let location = if source_file(file) && plausible_file(file) {
            let line = head[file.len()..]
                .strip_prefix(':')
                .and_then(super::number)
                .map(|(n, _)| n);
            Some(sink.location(file, line, None))
        } else {
            None
        };
        let message = text[at..].trim();
        self.held.push(Finding {
            kind: FindingKind::CompileError,
            tool: "gcc".into(),
            name: None,
            location,
            message: message.to_string(),
            excerpt: Some(text.to_string()),
        });
    }
}

impl Reader for Gcc {
    fn tool(&self) -> &'static str {
        "gcc"
    }

    fn anchors(&self) -> &'static [&'static str] {
        &[
            "error: ",
            "warning: ",
            "note: ",
            ": In ",
            "undefined reference to ",
            " generated.",
            "collect2: ",
        ]
    }

    fn wants_all(&self) -> bool {
        self.cur.is_some()
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let text = line.text;
        if let Some(p) = &mut self.cur
            && p.lines < MAX_BLOCK
        {
            let snippet = if gutter_line(text) {
                p.gutter = true;
                true
            } else if p.gutter {
                false
            } else {
                // clang: the source line right after the header, then the caret line.
                caret_line(text) || (p.lines == 1 && !text.trim().is_empty() && !looks_new(text))
            };
            if snippet {
                p.excerpt.push(text);
                p.lines += 1;
                return;
            }
        }
        if self.cur.is_some() && !is_note(text) {
            self.flush(sink);
        }
        self.other(text, sink);
    }

    fn end(&mut self, sink: &mut Sink) {
        self.flush(sink);
        self.release("gcc", sink);
    }
}

/// A line that starts something else: a diagnostic, a summary, a driver's line.
fn looks_new(text: &str) -> bool {
    split_location(text).is_some_and(|at| severity(at.rest).is_some())
        || text.ends_with(" generated.")
        || text.starts_with("In file included from ")
        || text.contains(": error: ")
        || text.contains(": warning: ")
}

fn is_note(text: &str) -> bool {
    split_location(text).is_some_and(|at| at.rest.starts_with("note: "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_drivers() {
        assert_eq!(
            flag("unused variable 'x' [-Wunused-variable]").as_deref(),
            Some("-Wunused-variable")
        );
        assert_eq!(
            flag("unused variable 'x' [-Werror=unused-variable]").as_deref(),
            Some("-Wunused-variable")
        );
        assert_eq!(flag("x undeclared"), None);
        assert_eq!(driver("x86_64-linux-gnu-gcc-12"), Some("gcc"));
        assert_eq!(driver("clang++"), Some("clang"));
        assert_eq!(driver("mygcc tool"), None);
        assert!(source_file("/usr/include/c++/12/vector"));
        assert!(!source_file("/usr/lib/x.py"));
    }
}
