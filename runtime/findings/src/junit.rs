//! JUnit XML files that a runner wrote during the exec (Maven Surefire, Gradle, pytest's
//! `--junitxml`, node's `--test-reporter=junit`, jest-junit, any runner that writes them).
//!
//! A `<testcase>` with a `<failure>` is a failed test, one with an `<error>` a test error; the
//! counts are those of the test cases (nested `<testsuite>` totals would count twice). The
//! test's place is its `file`/`line` attributes, else the first frame inside the workspace in
//! the failure's text (a JavaScript `at f (file:line:col)`, a Python `File "x.py", line N` or
//! pytest's `x.py:N: Error` (the last one: the innermost), a Java `at a.B.c(B.java:17)` of the
//! test's class (else the first outside the JDK and the test frameworks), which names a file
//! without its directory and is given as printed).
//!
//! The parser (quick-xml) expands no DTD entity, so a billion-laughs document stays small; the
//! input, the events read and each text kept are bounded, and malformed XML ends the reading
//! with what was found before it.

use std::borrow::Cow;

use quick_xml::events::{BytesStart, Event};

use crate::runners::{file_line, inside};
use crate::{
    Finding, FindingKind, Findings, Location, MAX_EXCERPT_LINES, MAX_NAME, Paths, Sink, TestCounts,
    bound, one_line,
};

const TOOL: &str = "junit";
/// Most bytes of a document read.
const MAX_INPUT: usize = 64 << 20;
/// Most XML events read of one document.
const MAX_EVENTS: usize = 4_000_000;
/// Most bytes of a failure's text kept.
const MAX_TEXT: usize = 16 << 10;
/// Most bytes of an attribute's value kept.
const MAX_ATTR: usize = 4 << 10;
/// Deepest nesting of test suites whose names are kept.
const MAX_DEPTH: usize = 32;

/// The failed and errored test cases of one JUnit XML document, and its counts; a document
/// that is not JUnit XML gives nothing.
pub fn read_junit(xml: &[u8], paths: &Paths) -> Findings {
    let xml = &xml[..xml.len().min(MAX_INPUT)];
    let mut r = quick_xml::Reader::from_reader(xml);
    r.config_mut().check_end_names = false;
    let mut sink = Sink::new(paths.clone());
    let mut counts = TestCounts::default();
    let mut cases = 0u64;
    // The names of the enclosing suites (the outer [`MAX_DEPTH`]), and the nesting depth.
    let mut suites: Vec<String> = Vec::new();
    let mut depth = 0usize;
    let mut case: Option<Case> = None;
    // Inside a <failure> or <error>: its text is kept.
    let mut in_text = false;
    for _ in 0..MAX_EVENTS {
        let ev = match r.read_event() {
            Ok(Event::Eof) | Err(_) => break,
            Ok(ev) => ev,
        };
        match ev {
            Event::Start(e) if is(&e, b"testsuite") => {
                depth += 1;
                if suites.len() < MAX_DEPTH {
                    suites.push(attr(&e, b"name").unwrap_or_default());
                }
            }
            Event::End(e) if e.local_name().as_ref() == b"testsuite" => {
                if depth == suites.len() {
                    suites.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Event::Start(e) if is(&e, b"testcase") => {
                if let Some(c) = case.take() {
                    finish(c, &mut sink, &mut counts);
                }
                case = Some(Case::new(&e, &suites));
                cases += 1;
            }
            Event::Empty(e) if is(&e, b"testcase") => {
                if let Some(c) = case.take() {
                    finish(c, &mut sink, &mut counts);
                }
                finish(Case::new(&e, &suites), &mut sink, &mut counts);
                cases += 1;
            }
            Event::End(e) if e.local_name().as_ref() == b"testcase" => {
                if let Some(c) = case.take() {
                    finish(c, &mut sink, &mut counts);
                }
                in_text = false;
            }
            Event::Start(e) | Event::Empty(e)
                if is(&e, b"failure") || is(&e, b"error") || is(&e, b"skipped") =>
            {
                let start = matches!(ev_kind(&e), Kind::Failure | Kind::Error);
                if let Some(c) = &mut case
                    && c.outcome.is_none()
                {
                    c.outcome = Some(ev_kind(&e));
                    c.message = attr(&e, b"message");
                    c.kind_attr = attr(&e, b"type");
                    in_text = start;
                }
            }
            Event::End(e)
                if matches!(e.local_name().as_ref(), b"failure" | b"error" | b"skipped") =>
            {
                in_text = false;
            }
            Event::Text(t) if in_text => {
                if let Some(c) = &mut case {
                    c.text(&String::from_utf8_lossy(&t));
                }
            }
            Event::CData(t) if in_text => {
                if let Some(c) = &mut case {
                    c.text(&String::from_utf8_lossy(&t));
                }
            }
            Event::GeneralRef(g) if in_text => {
                if let Some(c) = &mut case {
                    let name = String::from_utf8_lossy(&g);
                    if let Ok(Some(ch)) = g.resolve_char_ref() {
                        c.text(ch.encode_utf8(&mut [0; 4]));
                    } else if let Some(s) = quick_xml::escape::resolve_predefined_entity(&name) {
                        c.text(s);
                    }
                    // Any other entity (one a DTD declares) is left out, not expanded.
                }
            }
            _ => {}
        }
    }
    if let Some(c) = case.take() {
        finish(c, &mut sink, &mut counts);
    }
    let mut f = sink.finish();
    if cases > 0 {
        f.tests = Some(counts);
    }
    f
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Failure,
    Error,
    Skipped,
}

fn ev_kind(e: &BytesStart<'_>) -> Kind {
    match e.local_name().as_ref() {
        b"failure" => Kind::Failure,
        b"error" => Kind::Error,
        _ => Kind::Skipped,
    }
}

struct Case {
    name: String,
    class: String,
    file: Option<String>,
    line: Option<u32>,
    outcome: Option<Kind>,
    message: Option<String>,
    kind_attr: Option<String>,
    text: String,
}

impl Case {
    fn new(e: &BytesStart<'_>, suites: &[String]) -> Case {
        let name = attr(e, b"name").unwrap_or_default();
        let class = attr(e, b"classname").unwrap_or_default();
        let suite = suites.iter().rev().find(|s| !s.is_empty());
        Case {
            name: join(class.trim(), name.trim(), suite.map(String::as_str)),
            class: class.trim().to_string(),
            file: attr(e, b"file").filter(|f| !f.is_empty()),
            line: attr(e, b"line").and_then(|l| l.trim().parse().ok()),
            outcome: None,
            message: None,
            kind_attr: None,
            text: String::new(),
        }
    }

    fn text(&mut self, s: &str) {
        if self.text.len() < MAX_TEXT {
            self.text.push_str(&bound(s, MAX_TEXT - self.text.len()));
        }
    }
}

/// The test's id as its runner gives it: `com.x.FooTest.testBar`, `tests.test_a.test_b`;
/// the name alone where the class repeats it (jest-junit); the suite's name before the
/// name where the class is node's fixed `test`.
fn join(class: &str, name: &str, suite: Option<&str>) -> String {
    if class.is_empty() || class == name || name.starts_with(&format!("{class} ")) {
        return name.to_string();
    }
    if class == "test"
        && let Some(s) = suite.filter(|s| !s.contains('/') && !s.contains('\\'))
    {
        return format!("{s} > {name}");
    }
    if name.is_empty() {
        return class.to_string();
    }
    if class.contains(' ') {
        format!("{class} {name}")
    } else {
        format!("{class}.{name}")
    }
}

fn finish(c: Case, sink: &mut Sink, counts: &mut TestCounts) {
    let kind = match c.outcome {
        None => {
            counts.passed += 1;
            return;
        }
        Some(Kind::Skipped) => {
            counts.skipped += 1;
            return;
        }
        Some(Kind::Failure) => {
            counts.failed += 1;
            FindingKind::TestFailed
        }
        Some(Kind::Error) => {
            counts.errored += 1;
            FindingKind::TestError
        }
    };
    let location = match (&c.file, c.line) {
        (Some(f), line) => Some(sink.location(f, line, None)),
        (None, _) => place_in(&c.text, &c.class, sink),
    };
    let message = c
        .message
        .as_deref()
        .map(one_line)
        .filter(|m| !m.is_empty())
        .or_else(|| Some(one_line(&c.text)).filter(|m| !m.is_empty()))
        .or(c.kind_attr.as_deref())
        .unwrap_or(if kind == FindingKind::TestError {
            "error"
        } else {
            "failed"
        })
        .to_string();
    let excerpt = excerpt_of(&c.text, sink);
    sink.push(Finding {
        kind,
        tool: TOOL.into(),
        name: Some(c.name).filter(|n| !n.is_empty()),
        location,
        message,
        excerpt,
    });
}

/// The failure's place from its text: see the module's doc.
fn place_in(text: &str, class: &str, sink: &Sink) -> Option<Location> {
    let mut last_py: Option<(String, u32)> = None;
    // A Java frame: of the test's class, else the first outside the JDK and test frameworks.
    let mut java: Option<(String, u32)> = None;
    let mut java_other: Option<(String, u32)> = None;
    for l in text.lines() {
        let s = l.trim();
        if let Some(frame) = s.strip_prefix("at ") {
            let place = match frame.rfind('(') {
                Some(i) if frame.ends_with(')') => &frame[i + 1..frame.len() - 1],
                _ => frame,
            };
            if let Some((file, n, col, _)) = file_line(place) {
                if file.contains('/') || file.starts_with("file:") {
                    if inside(sink, file) && !sink.paths().locate(file).contains("node_modules/") {
                        return Some(sink.location(file, Some(n), col));
                    }
                } else if !file.starts_with("node:") && file.contains('.') {
                    let func = frame.split('(').next().unwrap_or("");
                    let func = func.rsplit('/').next().unwrap_or(func);
                    if java.is_none() && !class.is_empty() && func.starts_with(&format!("{class}."))
                    {
                        java = Some((file.to_string(), n));
                    } else if java_other.is_none()
                        && !JAVA_LIBRARIES.iter().any(|l| func.starts_with(l))
                    {
                        java_other = Some((file.to_string(), n));
                    }
                }
            }
            continue;
        }
        if let Some((file, n)) = crate::runners::python_file_line(s) {
            if inside(sink, file) {
                last_py = Some((file.to_string(), n));
            }
            continue;
        }
        if !l.starts_with(' ')
            && let Some((file, n, _, _)) = file_line(s)
            && file.contains('.')
            && inside(sink, file)
        {
            last_py = Some((file.to_string(), n));
        }
    }
    if let Some((f, n)) = last_py {
        return Some(sink.location(&f, Some(n), None));
    }
    // A Java frame names the file without its directory: given as printed.
    java.or(java_other).map(|(f, n)| Location {
        file: bound(&f, MAX_NAME),
        line: Some(n),
        column: None,
    })
}

/// Packages of the JDK and of test frameworks, whose frames are not the test's place.
const JAVA_LIBRARIES: &[&str] = &[
    "java.",
    "javax.",
    "jdk.",
    "sun.",
    "kotlin.",
    "scala.",
    "org.junit.",
    "junit.",
    "org.opentest4j.",
    "org.testng.",
    "org.assertj.",
    "org.hamcrest.",
    "org.mockito.",
    "org.apache.maven.",
    "org.gradle.",
];

/// The failure's first lines, frames outside the workspace left out.
fn excerpt_of(text: &str, sink: &Sink) -> Option<String> {
    let mut out = String::new();
    let mut n = 0;
    for l in text.lines() {
        let s = l.trim();
        if s.is_empty() {
            continue;
        }
        if let Some(frame) = s.strip_prefix("at ") {
            let place = match frame.rfind('(') {
                Some(i) if frame.ends_with(')') => &frame[i + 1..frame.len() - 1],
                _ => frame,
            };
            let keep = file_line(place).is_some_and(|(f, ..)| {
                !f.contains('/') && !f.starts_with("node:")
                    || inside(sink, f) && !sink.paths().locate(f).contains("node_modules/")
            });
            if !keep {
                continue;
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
        n += 1;
        if n >= MAX_EXCERPT_LINES {
            break;
        }
    }
    (!out.is_empty()).then_some(out)
}

fn is(e: &BytesStart<'_>, name: &[u8]) -> bool {
    e.local_name().as_ref() == name
}

/// An attribute's value, its references resolved (those it cannot, left as written), invalid
/// UTF-8 replaced, bounded.
fn attr(e: &BytesStart<'_>, name: &[u8]) -> Option<String> {
    for a in e.attributes().with_checks(false).flatten() {
        if a.key.local_name().as_ref() != name {
            continue;
        }
        let raw = &a.value[..a.value.len().min(MAX_ATTR)];
        let raw = String::from_utf8_lossy(raw);
        let value = match quick_xml::escape::unescape(&raw) {
            Ok(v) => Cow::Owned(v.into_owned()),
            Err(_) => raw,
        };
        return Some(value.into_owned());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_joined_as_their_runner_does() {
        assert_eq!(
            join("com.x.FooTest", "testBar", None),
            "com.x.FooTest.testBar"
        );
        assert_eq!(join("add adds", "add adds", None), "add adds");
        assert_eq!(join("test", "adds wrong", Some("add")), "add > adds wrong");
        assert_eq!(join("", "t", None), "t");
    }
}
