//! `go test`, in its default text (`--- FAIL: TestX (0.00s)` with the test's `x_test.go:12:
//! message` lines indented under it, or above it with `-v`; `FAIL\tpkg\t0.01s`; panics with
//! their goroutine's frames) and with `-json` (one event a line, a failed test's output lines
//! reassembled). A package that does not build (`# pkg` then `./x.go:3:2: undefined: foo`,
//! then `FAIL\tpkg [build failed]`) gives compile errors (tool `go`).
//!
//! Go prints a test's file relative to its package's directory, and the package by its import
//! path, so the directory is found from the import paths: a panic's frame, when one is inside
//! the workspace, says where the module's root is; else the packages of the run share the
//! module's path as their prefix (one package alone is taken to be the working directory's).
//! Findings are reported at the end, when every package is known.

use serde::Deserialize;

use super::{Excerpt, file_line, indent};
use crate::bytes::stops;
use crate::{
    Finding, FindingKind, Line, MAX_FINDINGS, MAX_NAME, Reader, Sink, TestCounts, one_line,
};

const TOOL: &str = "go-test";
const BUILD_TOOL: &str = "go";
/// Most tests with output kept at once (tests that run in parallel, failed tests).
const MAX_TESTS: usize = 2 * MAX_FINDINGS;
/// Most lines of a panic's trace read.
const PANIC_LINES: usize = 120;
/// Most continuation lines of one log line.
const CONTINUATION: usize = 8;
/// Most strings kept for reuse ([`GoTest::pool`]).
const POOL: usize = 16;

#[derive(Default)]
pub struct GoTest {
    tests: Vec<Test>,
    /// Text output: the test whose output lines these are (`=== RUN`, or the `--- FAIL` block).
    current: Option<String>,
    /// The log line whose continuation lines may follow: (test, its indent, lines left).
    cont: Option<(String, usize, usize)>,
    panic: Option<Panic>,
    /// Errors of a package that does not build, until `[build failed]` confirms them.
    build: Vec<(String, u32, Option<u32>, String)>,
    /// Inside a `# pkg` block: lines left.
    build_lines: usize,
    /// The module's import path and the absolute directory of its root, from a panic's frame.
    module: Option<(String, String)>,
    /// The longest import path prefix (by segment) shared by every package seen.
    common: Option<String>,
    packages: u32,
    counts: TestCounts,
    /// The output says what passed (`-v`, `-json`): the counts are whole.
    counted: bool,
    /// The strings of tests that passed, for the next tests' records (with `-v`, a test that
    /// logs a line and passes made and dropped six).
    pool: Vec<String>,
}

#[derive(Default)]
struct Test {
    name: String,
    pkg: Option<String>,
    failed: bool,
    panicked: bool,
    message: Option<String>,
    /// The place as printed and whether it is absolute (a panic's frame) rather than relative
    /// to the package's directory.
    place: Option<(String, u32, bool)>,
    excerpt: Excerpt,
}

struct Panic {
    test: Option<String>,
    pkg: Option<String>,
    left: usize,
    /// The function of the frame whose file line comes next.
    func: Option<String>,
    placed: bool,
    frames: bool,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "Action", borrow)]
    action: std::borrow::Cow<'a, str>,
    #[serde(rename = "Package", alias = "ImportPath", default, borrow)]
    package: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "Test", default, borrow)]
    test: Option<std::borrow::Cow<'a, str>>,
    #[serde(rename = "Output", default, borrow)]
    output: Option<std::borrow::Cow<'a, str>>,
}

impl Reader for GoTest {
    fn tool(&self) -> &'static str {
        TOOL
    }

    fn anchors(&self) -> &'static [&'static str] {
        &[
            "\"Action\":\"",
            "=== RUN",
            "=== CONT",
            "=== NAME",
            "--- FAIL: ",
            "--- PASS: ",
            "--- SKIP: ",
            ".go:",
            "FAIL\t",
            "ok  \t",
            "[no test files]",
            "panic: ",
            "[build failed]",
            "[setup failed]",
        ]
    }

    fn wants_all(&self) -> bool {
        self.panic.is_some() || self.cont.is_some() || self.build_lines > 0
    }

    /// With `-v`, two lines for every test that passed (`=== RUN`, `--- PASS: `, [`skimmed`]):
    /// every line of such a log holds an anchor.
    fn skims(&self) -> bool {
        true
    }

    fn skim(&mut self, lines: &[u8]) -> (usize, u64) {
        // A package's errors take the lines after `# pkg` first. A log line's continuation ends
        // at a test's `=== RUN` or result, as `text` ends it, and a panic's trace does not see
        // them (`text` reads them before it).
        if self.build_lines > 0 {
            return (0, 0);
        }
        let (mut pos, mut n) = (0, 0);
        // Only the last `=== RUN` of a run names the test whose output may come next.
        let mut run: Option<&[u8]> = None;
        // Most often no test is kept but a failed one, which a result of its name leaves kept
        // ([`GoTest::passed`]); a run keeps no new one.
        let mut unfailed = self.unfailed();
        while let Some((end, line)) = skimmed(lines, pos) {
            match line {
                Skimmed::Run(name) => run = Some(name),
                Skimmed::Status(name, status) => {
                    self.count(status);
                    if unfailed && self.passed(name, None) {
                        unfailed = self.unfailed();
                    }
                }
            }
            pos = end + 1;
            n += 1;
        }
        if n > 0
            && let Some((owner, ..)) = self.cont.take()
        {
            self.recycle(owner);
        }
        if let Some(name) = run {
            self.counted = true;
            let name = std::str::from_utf8(name)
                .ok()
                .filter(|n| !n.is_empty() && n.len() <= MAX_NAME)
                .map(|n| self.string(n));
            if let Some(was) = std::mem::replace(&mut self.current, name) {
                self.recycle(was);
            }
        }
        (pos, n)
    }

    fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
        let t = line.text;
        if t.starts_with('{') {
            if t.contains("\"Action\":\"") {
                self.event(t, sink);
            }
            return;
        }
        // `# pkg` holds no anchor (two bytes that would slow the search of every log): it is
        // the line before the first error of a package that does not build.
        if self.build_lines == 0 && t.contains(".go:") && line.previous_starts_with("# ") {
            self.text(&line.previous(), None, None, sink);
        }
        self.text(t, None, None, sink);
    }

    fn end(&mut self, sink: &mut Sink) {
        self.panic = None;
        let tests = std::mem::take(&mut self.tests);
        for (i, t) in tests.iter().enumerate() {
            if !t.failed {
                continue;
            }
            let own = t.message.is_some() || t.place.is_some();
            let prefix = format!("{}/", t.name);
            if !own
                && tests
                    .iter()
                    .enumerate()
                    .any(|(j, c)| j != i && c.failed && c.name.starts_with(&prefix))
            {
                // A parent that failed because a subtest did.
                continue;
            }
            let location = t.place.as_ref().map(|(f, n, abs)| {
                let path = if *abs {
                    f.clone()
                } else {
                    match self.dir(t.pkg.as_deref()) {
                        Some(d) if !d.is_empty() => format!("{d}/{f}"),
                        _ => f.clone(),
                    }
                };
                sink.location(&path, Some(*n), None)
            });
            sink.push(Finding {
                kind: if t.panicked {
                    FindingKind::TestError
                } else {
                    FindingKind::TestFailed
                },
                tool: TOOL.into(),
                name: Some(t.name.clone()),
                location,
                message: t.message.clone().unwrap_or_else(|| "failed".into()),
                excerpt: t.excerpt.clone().take(),
            });
        }
        if self.counted {
            sink.counts(TOOL, self.counts);
        }
    }
}

impl GoTest {
    /// One event of `go test -json`.
    fn event(&mut self, t: &str, sink: &mut Sink) {
        let Ok(e) = serde_json::from_str::<Event<'_>>(t) else {
            return;
        };
        let pkg = e.package.as_deref();
        let test = e.test.as_deref().filter(|n| n.len() <= MAX_NAME);
        match (e.action.as_ref(), test) {
            ("run", Some(_)) => self.counted = true,
            ("output" | "build-output", _) => {
                if let Some(out) = e.output.as_deref() {
                    let out = out.strip_suffix('\n').unwrap_or(out);
                    let out = out.strip_suffix('\r').unwrap_or(out);
                    if test.is_some() {
                        self.test_output(test, pkg, out, sink);
                    } else {
                        self.text(out, None, pkg, sink);
                    }
                }
            }
            ("pass", Some(n)) => self.status(n, pkg, Status::Pass),
            ("skip", Some(n)) => self.status(n, pkg, Status::Skip),
            ("fail", Some(n)) => self.status(n, pkg, Status::Fail),
            ("pass" | "fail" | "skip", None) => {
                if let Some(p) = pkg {
                    self.package(p);
                }
            }
            ("build-fail", _) => self.confirm_build(sink),
            _ => {}
        }
    }

    /// A line of the text output, or an event's output line outside a test (`pkg` known).
    fn text(&mut self, t: &str, test: Option<&str>, pkg: Option<&str>, sink: &mut Sink) {
        if self.build_lines > 0 {
            self.build_lines -= 1;
            if let Some((file, n, col, msg)) = file_line(t.trim_start_matches("./"))
                && file.ends_with(".go")
                && !t.starts_with(' ')
            {
                if self.build.len() < MAX_FINDINGS {
                    self.build
                        .push((file.to_string(), n, col, one_line(msg).to_string()));
                }
                return;
            }
            if !t.starts_with('\t') && !t.starts_with("  ") {
                self.build_lines = 0;
            } else {
                return;
            }
        }
        if let Some(rest) = t.strip_prefix("# ") {
            // `# pkg` or `# pkg [pkg.test]`: the errors of a package that does not build.
            let path = rest.split(' ').next().unwrap_or("");
            if !path.is_empty()
                && path
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"./_-~".contains(&c))
            {
                self.build_lines = 50;
            }
            return;
        }
        if t.ends_with("[build failed]") || t.ends_with("[setup failed]") {
            self.confirm_build(sink);
        }
        if let Some(p) = package_line(t) {
            self.package(p);
            self.current = None;
            self.cont = None;
            self.panic = None;
            return;
        }
        if t == "FAIL" || t == "PASS" {
            self.current = None;
            self.cont = None;
            return;
        }
        if let Some(rest) = t
            .strip_prefix("=== RUN")
            .or_else(|| t.strip_prefix("=== CONT"))
            .or_else(|| t.strip_prefix("=== NAME"))
        {
            let name = rest.trim();
            self.counted = true;
            self.cont = None;
            self.current = (!name.is_empty() && name.len() <= MAX_NAME).then(|| name.to_string());
            return;
        }
        let s = t.trim_start();
        for (prefix, status) in [
            ("--- FAIL: ", Status::Fail),
            ("--- PASS: ", Status::Pass),
            ("--- SKIP: ", Status::Skip),
        ] {
            if let Some(rest) = s.strip_prefix(prefix) {
                let name = match rest.rsplit_once(" (") {
                    Some((n, time)) if time.ends_with("s)") => n,
                    _ => rest,
                };
                if name.is_empty() || name.len() > MAX_NAME || name.contains(' ') {
                    return;
                }
                self.status(name, pkg, status);
                if status == Status::Fail {
                    // Without -v, its output lines follow, indented.
                    self.current = Some(name.to_string());
                }
                self.cont = None;
                return;
            }
        }
        // The current test's name is lent to `output`, which does not change it.
        let current = self.current.take();
        self.output(test.or(current.as_deref()), pkg, t, sink);
        self.current = current;
    }

    /// An output line of a test (`-json`).
    fn test_output(&mut self, test: Option<&str>, pkg: Option<&str>, t: &str, sink: &mut Sink) {
        let s = t.trim_start();
        if s.starts_with("=== ")
            || s.starts_with("--- FAIL: ")
            || s.starts_with("--- PASS: ")
            || s.starts_with("--- SKIP: ")
        {
            self.cont = None;
            return;
        }
        self.output(test, pkg, t, sink);
    }

    /// A line that may belong to a test: a log line, its continuation, a panic and its trace.
    fn output(&mut self, test: Option<&str>, pkg: Option<&str>, t: &str, sink: &mut Sink) {
        if t.starts_with("panic: ") {
            self.cont = None;
            let owner = test.map(str::to_string).or_else(|| {
                self.tests
                    .iter()
                    .rev()
                    .find(|x| x.failed)
                    .map(|x| x.name.clone())
            });
            if self.panic.is_none() {
                if let Some(name) = &owner
                    && let Some(x) = self.test(name, pkg)
                    && !x.panicked
                {
                    x.panicked = true;
                    let msg = t.strip_suffix(" [recovered]").unwrap_or(t);
                    x.message = Some(msg.to_string());
                    x.excerpt.push(msg);
                }
                self.panic = Some(Panic {
                    test: owner,
                    pkg: pkg.map(str::to_string),
                    left: PANIC_LINES,
                    func: None,
                    placed: false,
                    frames: false,
                });
            }
            return;
        }
        if self.panic.is_some() {
            self.panic_line(t, sink);
            return;
        }
        let Some(test) = test else {
            return;
        };
        let s = t.trim_start();
        if let Some((file, n, _, msg)) = file_line(s)
            && file.ends_with(".go")
            && !file.contains('/')
            && t.starts_with(' ')
        {
            let ind = indent(t);
            let (msg, file) = (self.string(msg), self.string(file));
            if let Some(x) = self.test(test, pkg) {
                x.message = Some(msg);
                x.place = Some((file, n, false));
                x.excerpt.push(s);
            }
            let owner = self.string(test);
            if let Some((was, ..)) = self.cont.replace((owner, ind, CONTINUATION)) {
                self.recycle(was);
            }
            return;
        }
        if let Some((owner, ind, left)) = self.cont.take()
            && owner == test
            && left > 0
            && indent(t) > ind
            && !s.is_empty()
        {
            if let Some(x) = self.test(test, pkg) {
                x.excerpt.push(s);
            }
            self.cont = Some((owner, ind, left - 1));
        }
    }

    fn panic_line(&mut self, t: &str, sink: &mut Sink) {
        let Some(p) = &mut self.panic else {
            return;
        };
        p.left = p.left.saturating_sub(1);
        if p.left == 0 || (t.is_empty() && p.frames) || package_line(t).is_some() {
            self.panic = None;
            return;
        }
        let s = t.trim();
        if s.starts_with("goroutine ") {
            p.frames = true;
            return;
        }
        if !t.starts_with('\t') {
            p.func = (!s.starts_with("created by")).then(|| s.to_string());
            return;
        }
        let Some((file, n, _, _)) = file_line(s) else {
            return;
        };
        let located = sink.paths().locate(file);
        if !file.starts_with('/') || !sink.paths().inside(&located) {
            return;
        }
        let func = p.func.take();
        if self.module.is_none()
            && let Some(f) = &func
        {
            self.module = module_of(f, file);
        }
        let (owner, pkg, first) = (p.test.clone(), p.pkg.clone(), !p.placed);
        p.placed = true;
        if let Some(name) = owner
            && let Some(x) = self.test(&name, pkg.as_deref())
        {
            if first {
                x.place = Some((file.to_string(), n, true));
            }
            x.excerpt
                .push(&format!("{} at {located}:{n}", func.unwrap_or_default()));
        }
    }

    /// The test of this name (of this package when known), added when there is room.
    fn test(&mut self, name: &str, pkg: Option<&str>) -> Option<&mut Test> {
        let at = self.tests.iter().rposition(|t| {
            t.name == name && (pkg.is_none() || t.pkg.is_none() || t.pkg.as_deref() == pkg)
        });
        let at = match at {
            Some(i) => i,
            None if self.tests.len() < MAX_TESTS => {
                let test = Test {
                    name: self.string(name),
                    pkg: pkg.map(str::to_string),
                    excerpt: Excerpt::with(self.string("")),
                    ..Test::default()
                };
                self.tests.push(test);
                self.tests.len() - 1
            }
            None => return None,
        };
        Some(&mut self.tests[at])
    }

    fn count(&mut self, status: Status) {
        match status {
            Status::Pass => self.counts.passed += 1,
            Status::Skip => self.counts.skipped += 1,
            Status::Fail => self.counts.failed += 1,
        }
    }

    fn status(&mut self, name: &str, pkg: Option<&str>, status: Status) {
        self.count(status);
        if status == Status::Fail {
            if let Some(t) = self.test(name, pkg) {
                t.failed = true;
            }
        } else {
            self.passed(name.as_bytes(), pkg);
        }
    }

    /// A test passed or was skipped: its output is kept no longer (a failed one of the same
    /// name, in a package run before, stays). Whether a test's was.
    fn passed(&mut self, name: &[u8], pkg: Option<&str>) -> bool {
        let Some(i) = self.tests.iter().rposition(|t| {
            !t.failed && t.name.as_bytes() == name && (pkg.is_none() || t.pkg.as_deref() == pkg)
        }) else {
            return false;
        };
        let t = self.tests.remove(i);
        let strings = [Some(t.name), t.message, t.place.map(|p| p.0)];
        for s in strings.into_iter().flatten().chain([t.excerpt.into_text()]) {
            self.recycle(s);
        }
        true
    }

    /// Some test is kept that has not failed: a result may end its keeping.
    fn unfailed(&self) -> bool {
        self.tests.iter().any(|t| !t.failed)
    }

    /// `s` in a string of the pool's, or a new one.
    fn string(&mut self, s: &str) -> String {
        let mut out = self.pool.pop().unwrap_or_default();
        out.push_str(s);
        out
    }

    /// `s` emptied, for [`GoTest::string`].
    fn recycle(&mut self, mut s: String) {
        if self.pool.len() < POOL {
            s.clear();
            self.pool.push(s);
        }
    }

    /// A package's run ended: its tests of unknown package are its own.
    fn package(&mut self, pkg: &str) {
        for t in &mut self.tests {
            if t.pkg.is_none() {
                t.pkg = Some(pkg.to_string());
            }
        }
        self.tests.retain(|t| t.failed);
        self.packages += 1;
        self.common = Some(match self.common.take() {
            None => pkg.to_string(),
            Some(c) => common_prefix(&c, pkg),
        });
    }

    fn confirm_build(&mut self, sink: &mut Sink) {
        self.build_lines = 0;
        for (file, n, col, msg) in std::mem::take(&mut self.build) {
            let location = Some(sink.location(&file, Some(n), col));
            sink.push(Finding {
                kind: FindingKind::CompileError,
                tool: BUILD_TOOL.into(),
                name: None,
                location,
                message: msg,
                excerpt: None,
            });
        }
    }

    /// The directory of a package (relative to the working directory, or absolute).
    fn dir(&self, pkg: Option<&str>) -> Option<String> {
        let pkg = pkg?;
        if let Some((m, root)) = &self.module {
            if pkg == m {
                return Some(root.clone());
            }
            if let Some(rest) = pkg
                .strip_prefix(m.as_str())
                .and_then(|r| r.strip_prefix('/'))
            {
                return Some(format!("{root}/{rest}"));
            }
        }
        if self.packages > 1
            && let Some(c) = &self.common
        {
            if pkg == c {
                return Some(String::new());
            }
            if let Some(rest) = pkg
                .strip_prefix(c.as_str())
                .and_then(|r| r.strip_prefix('/'))
            {
                return Some(rest.to_string());
            }
        }
        Some(String::new())
    }
}

/// A line [`GoTest::skim`] takes: one it reads as `line` would, but for its own block.
enum Skimmed<'a> {
    /// `=== RUN`, `=== CONT` or `=== NAME`, and the name after the padding.
    Run(&'a [u8]),
    /// `--- PASS: ` or `--- SKIP: ` (indented for a subtest) and the test's name.
    Status(&'a [u8], Status),
}

/// The line of `lines` at `at` and where it ends (its newline) when it is one [`Skimmed`]
/// stands for, in the shape go prints: `=== RUN   `, `=== CONT  ` or `=== NAME  ` (padded to
/// ten bytes) and the name, or a lead of spaces, `--- PASS: `, the name and ` (0.01s)`; the
/// name of printable ASCII (what [`Line::text`] gives unchanged) but a space or a colon (so no
/// `.go:` file line, whose line before [`GoTest::line`] reads). `None` for every other line,
/// which is read as any other. On the bytes' classes 64 at a time ([`stops`]): a line of a
/// passed test is 30 bytes, and a search per line cost more than the line.
fn skimmed(lines: &[u8], at: usize) -> Option<(usize, Skimmed<'_>)> {
    let head = word(lines, at)?;
    // Neither `=== `, `--- ` nor a lead: turned down before its bytes are classed.
    if !matches!(head as u8, b'=' | b'-' | b' ') {
        return None;
    }
    let stop = stops(lines, at);
    if head == u64::from_le_bytes(*b"=== RUN ")
        || head == u64::from_le_bytes(*b"=== CONT")
        || head == u64::from_le_bytes(*b"=== NAME")
    {
        if lines.get(at + 8..at + 10)? != b"  " {
            return None;
        }
        // The name, up to the line's end.
        let from = at + 10;
        let end = name_end(lines, from, stop, at)?;
        return (lines[end] == b'\n').then(|| (end, Skimmed::Run(&lines[from..end])));
    }
    let lead = at + lead(lines, at)?;
    let status = match (word(lines, lead)?, lines.get(lead + 8..lead + 10)?) {
        (w, b": ") if w == u64::from_le_bytes(*b"--- PASS") => Status::Pass,
        (w, b": ") if w == u64::from_le_bytes(*b"--- SKIP") => Status::Skip,
        _ => return None,
    };
    let from = lead + 10;
    let end = name_end(lines, from, stop, at)?;
    if end == from || lines.get(end..end + 2)? != b" (" {
        return None;
    }
    let time = end + 2;
    let digits = lines[time..]
        .iter()
        .take(SKIM_NAME_MAX)
        .take_while(|&&b| b.is_ascii_digit() || b == b'.')
        .count();
    let close = time + digits;
    (lines.get(close..close + 3)? == b"s)\n")
        .then(|| (close + 2, Skimmed::Status(&lines[from..end], status)))
}

/// The 8 bytes of `lines` at `at`, the first in the lowest byte.
fn word(lines: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(*lines.get(at..)?.first_chunk()?))
}

/// The spaces that start the line at `at`; more than [`SKIM_LEAD_MAX`] are left to the
/// line-by-line reading.
fn lead(lines: &[u8], at: usize) -> Option<usize> {
    let n = lines[at..]
        .iter()
        .take(SKIM_LEAD_MAX + 1)
        .take_while(|&&b| b == b' ')
        .count();
    (n <= SKIM_LEAD_MAX).then_some(n)
}

/// The longest name [`skimmed`] takes (a line with a longer one is read as any other).
const SKIM_NAME_MAX: usize = 256;

/// The longest lead [`skimmed`] takes: a subtest's result is indented by four spaces a level.
const SKIM_LEAD_MAX: usize = 48;

/// Where the name that starts at `from` in `lines` ends: the first byte it does not hold
/// ([`stops`]), within [`SKIM_NAME_MAX`] bytes and before the end of `lines`. `stop` is the
/// mask of the 64 bytes from `at`, at or before `from`. Inlined where the name ends within
/// them, as most do (a call a line cost 7% of reading a go log).
#[inline(always)]
fn name_end(lines: &[u8], from: usize, stop: u64, at: usize) -> Option<usize> {
    let skip = from - at;
    if skip < 64 {
        let stop = stop & u64::MAX << skip;
        if stop != 0 {
            // Within 64 bytes of `from`, so within [`SKIM_NAME_MAX`].
            let end = at + stop.trailing_zeros() as usize;
            return (end < lines.len()).then_some(end);
        }
    }
    far_name_end(lines, from, at)
}

/// [`name_end`] past the 64 bytes from `at`.
#[inline(never)]
fn far_name_end(lines: &[u8], from: usize, at: usize) -> Option<usize> {
    let mut at = if from - at < 64 { at + 64 } else { from };
    loop {
        if at > from + SKIM_NAME_MAX {
            return None;
        }
        let stop = stops(lines, at);
        if stop != 0 {
            let end = at + stop.trailing_zeros() as usize;
            return (end < lines.len() && end <= from + SKIM_NAME_MAX).then_some(end);
        }
        // Past the end, zeros: they stop the name.
        at += 64;
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Skip,
    Fail,
}

/// `FAIL\tpkg\t0.01s`, `ok  \tpkg\t0.01s`, `FAIL\tpkg [build failed]`, `?   \tpkg\t[no test
/// files]`: the package (one without tests counts for the module's common prefix).
fn package_line(t: &str) -> Option<&str> {
    let rest = t
        .strip_prefix("FAIL\t")
        .or_else(|| t.strip_prefix("ok  \t"))
        .or_else(|| t.strip_prefix("?   \t"))?;
    let pkg = rest.split(['\t', ' ']).next()?;
    (!pkg.is_empty() && pkg.len() <= MAX_NAME).then_some(pkg)
}

/// The module's import path and root directory, from a frame's function
/// (`example.com/m/pkg.TestX(...)`, `example.com/m/pkg.(*T).M(...)`) and its absolute file.
fn module_of(func: &str, file: &str) -> Option<(String, String)> {
    let head = &func[..func.find('(').unwrap_or(func.len())];
    let slash = head.rfind('/').map_or(0, |i| i + 1);
    let dot = head[slash..].find('.')? + slash;
    let pkg = &head[..dot];
    let dir = &file[..file.rfind('/')?];
    // Strip the segments the package path and the directory end with alike.
    let (mut p, mut d) = (pkg, dir);
    while let (Some((p2, ps)), Some((d2, ds))) = (p.rsplit_once('/'), d.rsplit_once('/')) {
        if ps != ds {
            break;
        }
        p = p2;
        d = d2;
    }
    Some((p.to_string(), d.to_string()))
}

fn common_prefix(a: &str, b: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for (x, y) in a.split('/').zip(b.split('/')) {
        if x != y {
            break;
        }
        out.push(x);
    }
    out.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name's end found on the masks of 64 bytes is the one found a byte at a time: every
    /// length around the masks' edges and the longest name, a name from the mask's start, within
    /// it and past it, a colon, a space or an odd byte at every place, and what follows.
    #[test]
    fn a_names_end_is_found_exactly() {
        for len in (0..40)
            .chain(60..72)
            .chain(SKIM_NAME_MAX - 9..SKIM_NAME_MAX + 9)
            .chain(SKIM_NAME_MAX + 60..SKIM_NAME_MAX + 76)
        {
            for at in 0..len.max(1) {
                for put in [b':', b' ', b'\t', 0x7f, 0xc3, 0x1b, 0x00, b'a'] {
                    for after in [&b""[..], b"\n", b" : x\n"] {
                        for from in [0, 3, 63, 64, 70] {
                            let mut lines = vec![b'a'; len];
                            if at < len {
                                lines[at] = put;
                            }
                            lines.extend_from_slice(after);
                            if from > lines.len() {
                                continue;
                            }
                            assert_eq!(
                                name_end(&lines, from, stops(&lines, 0), 0),
                                naive_name_end(&lines, from),
                                "{lines:?} from {from}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Where the name that starts at `from` ends, a byte at a time ([`name_end`]).
    fn naive_name_end(lines: &[u8], from: usize) -> Option<usize> {
        let n = lines[from..]
            .iter()
            .position(|&b| !(0x21..0x7f).contains(&b) || b == b':')?;
        (n <= SKIM_NAME_MAX).then_some(from + n)
    }

    /// The shapes [`skimmed`] takes, a byte at a time: where the line ends, the name, and `R`
    /// (a test's start), `P` or `S`.
    fn bytewise(lines: &[u8]) -> Option<(usize, Vec<u8>, u8)> {
        let name_end = |from| naive_name_end(lines, from);
        if lines.len() < 8 {
            return None;
        }
        for start in [b"=== RUN   ", b"=== CONT  ", b"=== NAME  "] {
            if lines.starts_with(start) {
                let end = name_end(10)?;
                return (lines[end] == b'\n').then(|| (end, lines[10..end].to_vec(), b'R'));
            }
        }
        let lead = lines.iter().take_while(|&&b| b == b' ').count();
        let kind = match &lines[lead..] {
            l if l.starts_with(b"--- PASS: ") => b'P',
            l if l.starts_with(b"--- SKIP: ") => b'S',
            _ => return None,
        };
        let from = lead + 10;
        let end = name_end(from)?;
        if end == from || !lines[end..].starts_with(b" (") {
            return None;
        }
        // The time: digits and dots (at most as many as a name's bytes), then `s)`.
        let time = &lines[end + 2..];
        let digits = time
            .iter()
            .position(|b| !b"0123456789.".contains(b))
            .unwrap_or(time.len())
            .min(SKIM_NAME_MAX);
        time[digits..]
            .starts_with(b"s)\n")
            .then(|| (end + 2 + digits + 2, lines[from..end].to_vec(), kind))
    }

    /// Lines of go's shapes and near them, long and short, odd bytes in their names, after
    /// another line and before one: [`skimmed`] reads each as it is read a byte at a time, but
    /// leaves a lead of more than [`SKIM_LEAD_MAX`] spaces to the line-by-line reading.
    #[test]
    fn every_shape_is_skimmed_as_bytewise() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let starts: [&[u8]; 10] = [
            b"=== RUN",
            b"=== CONT",
            b"=== NAME",
            b"--- PASS: ",
            b"--- SKIP: ",
            b"--- FAIL: ",
            b"--- PASS:",
            b"=== RU",
            b"ok  \t",
            b"",
        ];
        let times: [&[u8]; 15] = [
            b" (0.00s)",
            b" (12.345s)",
            b" (123456.789s)",
            b" (0.0\xb0s)",
            b" (0:00s)",
            b" (0.0/s)",
            b" ()",
            b" (s)",
            b" (0.0x0s)",
            b"",
            b" (0.00s) ",
            b"s)",
            b" (0.00s",
            b" (0.01s)s)",
            b" (/.5s)",
        ];
        let odd = [
            b' ', b':', b'\t', 0x7f, 0xc3, 0x1b, 0x00, b'\n', b'\r', b'(',
        ];
        let name_bytes = b"abcXYZ019_/-.()=";
        for _ in 0..300_000 {
            let mut buf = Vec::new();
            if rand(3) == 0 {
                buf.extend_from_slice(b"    x_test.go:3: before\n");
            }
            let at = buf.len();
            let lead = [0, 0, 0, 4, 8, rand(70)][rand(6)];
            buf.resize(at + lead, b' ');
            let start = starts[rand(starts.len())];
            buf.extend_from_slice(start);
            let pad = if start.starts_with(b"===") {
                [3, 2, 1, 0, rand(70)][rand(5)]
            } else {
                0
            };
            buf.resize(buf.len() + pad, b' ');
            let len = [rand(20), rand(90), 50 + rand(10)][rand(3)];
            for _ in 0..len {
                buf.push(name_bytes[rand(name_bytes.len())]);
            }
            if len > 0 && rand(6) == 0 {
                let i = buf.len() - 1 - rand(len);
                buf[i] = odd[rand(odd.len())];
            }
            buf.extend_from_slice(times[rand(times.len())]);
            buf.extend_from_slice([&b"\n"[..], b"", b"\r\n", b"\n"][rand(4)]);
            buf.extend_from_slice([&b""[..], b"=== RUN   TestNext\n", b"s)\n"][rand(3)]);
            let got = skimmed(&buf, at).map(|(end, line)| match line {
                Skimmed::Run(name) => (end - at, name.to_vec(), b'R'),
                Skimmed::Status(name, Status::Pass) => (end - at, name.to_vec(), b'P'),
                Skimmed::Status(name, _) => (end - at, name.to_vec(), b'S'),
            });
            let want = bytewise(&buf[at..]);
            if lead > SKIM_LEAD_MAX {
                assert!(got.is_none(), "{:?}", String::from_utf8_lossy(&buf));
            } else {
                assert_eq!(got, want, "{:?}", String::from_utf8_lossy(&buf));
            }
        }
    }

    #[test]
    fn a_frame_gives_the_module_root() {
        assert_eq!(
            module_of(
                "example.com/calc/panics.TestPanics(0x0?)",
                "/workspace/panics/p_test.go"
            ),
            Some(("example.com/calc".into(), "/workspace".into()))
        );
        assert_eq!(
            module_of("example.com/m/a/b.(*T).M(0x1)", "/ws/sub/a/b/x.go"),
            Some(("example.com/m".into(), "/ws/sub".into()))
        );
        assert_eq!(common_prefix("a.com/m/x", "a.com/m/y"), "a.com/m");
        assert_eq!(
            package_line("FAIL\texample.com/m/b [build failed]"),
            Some("example.com/m/b")
        );
        assert_eq!(
            package_line("?   \texample.com/m\t[no test files]"),
            Some("example.com/m")
        );
    }
}
