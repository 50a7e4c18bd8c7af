//! Findings: what a command's tools reported as failing, read from the whole of its output.
//!
//! A test runner or a compiler already says which test failed and where, but in a log that an
//! observation must cut to its head and tail. The readers here go over the whole stream (the
//! spill file when the stream did not fit) and keep what a model acts on: the failed test's id,
//! the file and line, the assertion, a few lines of context ([`Finding`]), and the runner's
//! counts ([`TestCounts`]).
//!
//! How a stream is read ([`Scanner`]): its lines are cut at [`MAX_LINE`] bytes, stripped of
//! terminal escapes and decoded lossily; one multi-pattern search over each chunk finds the lines
//! that hold one of a reader's [`Reader::anchors`], and only those lines reach the readers, except
//! a reader inside a block of its own ([`Reader::wants_all`]), which sees every line until it
//! leaves it. So a 200 MB log costs one pass of that search and memory of a chunk, whatever its
//! contents. A log whose every line holds an anchor (`go test -v`: two lines a test) would cost
//! a search and a reading per line: the lines a runner prints for each test that passes are
//! taken as runs by their reader ([`Reader::skim`]), without either. Output no reader
//! recognises gives no findings, and a reader never fails: what it cannot parse it leaves out.
//!
//! What a reader reports goes through a [`Sink`], which bounds every field (a finding's
//! message to one line of [`MAX_MESSAGE`] bytes, its excerpt to [`MAX_EXCERPT`] bytes of at most
//! [`MAX_EXCERPT_LINES`] lines, a name or a path to [`MAX_NAME`]), keeps at most
//! [`MAX_FINDINGS`], counts the rest, and leaves out a finding it already has.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::sync::Arc;

use aho_corasick::AhoCorasick;

pub use taskbox_contract::result::{Finding, FindingKind, Location, TestCounts};

mod bytes;
pub mod diagnostics;
pub mod junit;
pub mod paths;
pub mod runners;

pub use paths::Paths;

/// Longest line the readers see (bytes); the rest of a longer line is skipped.
pub const MAX_LINE: usize = 16 * 1024;
/// Most findings kept for one exec; the rest are counted in [`Findings::omitted`].
pub const MAX_FINDINGS: usize = 100;
/// Longest message of a finding (bytes, one line).
pub const MAX_MESSAGE: usize = 300;
/// Longest excerpt of a finding (bytes).
pub const MAX_EXCERPT: usize = 2048;
/// Most lines of an excerpt.
pub const MAX_EXCERPT_LINES: usize = 24;
/// Longest test name, diagnostic code or path (bytes).
pub const MAX_NAME: usize = 512;

/// One line of a stream as a reader sees it.
#[derive(Debug, Clone, Copy)]
pub struct Line<'a> {
    /// The line without its end, terminal escapes and carriage-return overwrites (what a
    /// terminal would show), invalid UTF-8 replaced.
    pub text: &'a str,
    /// 1-based line number in the stream.
    pub number: u64,
    /// The line before, raw (its last [`MAX_PREVIOUS`] bytes): lines without an anchor are not
    /// looked at, so a reader whose report starts with one (eslint's file line) asks for it.
    previous: &'a [u8],
}

impl Line<'_> {
    /// The line before this one, cleaned as [`Line::text`] is (empty for the first line; only
    /// the end of one longer than [`MAX_PREVIOUS`]).
    pub fn previous(&self) -> String {
        let mut out = String::new();
        clean_line(self.previous, &mut out);
        out
    }

    /// Whether [`Line::previous`] starts with `prefix`, without cleaning the line when it needs
    /// none (no escape, no carriage return).
    pub fn previous_starts_with(&self, prefix: &str) -> bool {
        if plain(self.previous) {
            return self.previous.starts_with(prefix.as_bytes());
        }
        self.previous().starts_with(prefix)
    }
}

/// A reader of one tool's reports in a stream.
pub trait Reader: Send {
    /// The tool's name as findings give it (`Finding::tool`); several readers may share one.
    fn tool(&self) -> &'static str;

    /// Literal strings of which every line that starts (or continues) a report of this tool
    /// holds one. The scanner gives the reader only such lines, unless [`Reader::wants_all`].
    fn anchors(&self) -> &'static [&'static str];

    /// The reader is inside a block of its own (a failure's section, a diagnostic's snippet)
    /// and wants the next line whatever it holds. Asked once at the start and after each line
    /// the reader is given (only [`Reader::line`] changes what it says).
    fn wants_all(&self) -> bool {
        false
    }

    /// One line: one that holds an anchor, or any while [`Reader::wants_all`].
    fn line(&mut self, line: Line<'_>, sink: &mut Sink);

    /// This reader takes runs of lines ([`Reader::skim`]): the lines a runner prints for every
    /// test that passes, each holding an anchor of its own, which would otherwise each be
    /// searched and read.
    fn skims(&self) -> bool {
        false
    }

    /// The lines at the start of `lines` (whole lines, each ending in a newline) that this
    /// reader takes as a run, each with the effect [`Reader::line`] would have had: it stops at
    /// the first it does not take (at once, for a line of another shape), and gives the bytes
    /// and lines it took. Asked, of a reader that [`Reader::skims`], at a line holding an anchor
    /// and at every line of a block, when no other reader is inside a block; this one may be
    /// inside one of its own, whose lines it does not take. It is asked often: a line of
    /// another shape must be turned down in a few comparisons.
    ///
    /// The lines a reader takes are its own: no other reader is given them, though a test's
    /// name may hold another's anchor (a test named `TestFAILED`), which is not that tool's
    /// report. So a reader takes only lines of its runner's own shape.
    fn skim(&mut self, _lines: &[u8]) -> (usize, u64) {
        (0, 0)
    }

    /// The stream has ended: report what is still pending.
    fn end(&mut self, _sink: &mut Sink) {}
}

/// Every reader, in the order their findings are listed when they are of the same kind.
pub fn readers() -> Vec<Box<dyn Reader>> {
    let mut all = runners::readers();
    all.extend(diagnostics::readers());
    all
}

/// What the readers found in an exec's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub findings: Vec<Finding>,
    /// Reports beyond [`MAX_FINDINGS`], left out (each counted, a repeated one too).
    pub omitted: u64,
    /// The counts of the test runners that reported any, summed.
    pub tests: Option<TestCounts>,
}

impl Findings {
    /// Adds `other`'s findings after this one's (those it already has left out) and sums the
    /// counts; with `counts_if_none`, `other`'s counts only where this one has none (a JUnit
    /// file that repeats what its runner printed).
    pub fn merge(&mut self, other: Findings, counts_if_none: bool) {
        let mut sink = Sink::resume(std::mem::take(self));
        for f in other.findings {
            sink.push_bounded(f);
        }
        sink.omitted += other.omitted;
        let mut merged = sink.finish();
        merged.tests = match (merged.tests, other.tests) {
            (Some(a), Some(b)) if !counts_if_none => Some(add(a, b)),
            (a, b) => a.or(b),
        };
        *self = merged;
    }
}

impl Findings {
    /// Adds the findings of a report file the exec wrote (a JUnit XML document), leaving out
    /// each one the streams already gave: the same kind at the same file and line, or a test
    /// whose name has the same last part (`test_b[1]` of `tests.test_a.TestA.test_b[1]` and of
    /// `tests/test_a.py::TestA::test_b[1]`). Its counts count only when the streams gave none.
    pub fn merge_report(&mut self, report: Findings) {
        let known = |f: &Finding| {
            self.findings.iter().any(|g| {
                g.kind == f.kind
                    && ((g.location.is_some()
                        && g.location.as_ref().map(|l| (&l.file, l.line))
                            == f.location.as_ref().map(|l| (&l.file, l.line)))
                        || match (test_leaf(g), test_leaf(f)) {
                            (Some(a), Some(b)) => a == b,
                            _ => false,
                        })
            })
        };
        let fresh: Vec<Finding> = report.findings.into_iter().filter(|f| !known(f)).collect();
        self.merge(
            Findings {
                findings: fresh,
                omitted: report.omitted,
                tests: report.tests,
            },
            true,
        );
    }
}

/// The last part of a test's name (after `::`, `.`, `/` or ` > `), with its parametrisation.
fn test_leaf(f: &Finding) -> Option<&str> {
    if !matches!(f.kind, FindingKind::TestFailed | FindingKind::TestError) {
        return None;
    }
    let n = f.name.as_deref()?;
    // Not inside a parametrisation (`test_x[1.5]`).
    let base = n.split('[').next().unwrap_or(n);
    let cut = [
        base.rfind("::").map(|i| i + 2),
        base.rfind('.').map(|i| i + 1),
        base.rfind(" > ").map(|i| i + 3),
        base.rfind('/').map(|i| i + 1),
    ]
    .into_iter()
    .flatten()
    .max()
    .unwrap_or(0);
    Some(&n[cut..])
}

fn add(a: TestCounts, b: TestCounts) -> TestCounts {
    TestCounts {
        passed: a.passed + b.passed,
        failed: a.failed + b.failed,
        errored: a.errored + b.errored,
        skipped: a.skipped + b.skipped,
    }
}

/// Where readers put what they found: it bounds every field and the number of findings, and
/// leaves out duplicates.
#[derive(Debug, Default)]
pub struct Sink {
    paths: Paths,
    findings: Vec<Finding>,
    omitted: u64,
    /// Counts by tool: a runner reports its totals once (the last report wins).
    counts: BTreeMap<&'static str, TestCounts>,
    /// Counts carried over from an earlier [`Findings`] (see [`Sink::resume`]).
    carried: Option<TestCounts>,
}

impl Sink {
    pub fn new(paths: Paths) -> Sink {
        Sink {
            paths,
            ..Sink::default()
        }
    }

    fn resume(f: Findings) -> Sink {
        Sink {
            findings: f.findings,
            omitted: f.omitted,
            carried: f.tests,
            ..Sink::default()
        }
    }

    /// The paths that [`Sink::location`] resolves against.
    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    /// A location of `file` as a tool printed it (relative to the exec's working directory, or
    /// absolute), made relative to the workspace when it is inside it.
    pub fn location(&self, file: &str, line: Option<u32>, column: Option<u32>) -> Location {
        Location {
            file: bound(&self.paths.locate(file), MAX_NAME),
            line,
            column,
        }
    }

    /// Reports a finding: its fields are bounded here, and one equal to a finding already
    /// reported (same kind, tool, name, location and message) is left out.
    pub fn push(&mut self, f: Finding) {
        self.push_bounded(f);
    }

    fn push_bounded(&mut self, mut f: Finding) {
        f.tool = bound(&f.tool, 64);
        f.name = f
            .name
            .map(|n| bound(one_line(&n), MAX_NAME))
            .filter(|n| !n.is_empty());
        f.message = bound(one_line(&f.message), MAX_MESSAGE);
        f.excerpt = f
            .excerpt
            .map(|e| bound_excerpt(&e))
            .filter(|e| !e.is_empty());
        if let Some(l) = &mut f.location {
            l.file = bound(&l.file, MAX_NAME);
        }
        let same = |g: &Finding| {
            g.kind == f.kind
                && g.tool == f.tool
                && g.name == f.name
                && g.location == f.location
                && g.message == f.message
        };
        if self.findings.iter().any(same) {
            return;
        }
        if self.findings.len() >= MAX_FINDINGS {
            self.omitted += 1;
            return;
        }
        self.findings.push(f);
    }

    /// Whether a finding of this kind and name (a test's id) was reported already, by any tool.
    pub fn has(&self, kind: FindingKind, name: &str) -> bool {
        self.findings
            .iter()
            .any(|g| g.kind == kind && g.name.as_deref() == Some(name))
    }

    /// A runner's totals: the last report of a tool replaces its earlier one.
    pub fn counts(&mut self, tool: &'static str, counts: TestCounts) {
        self.counts.insert(tool, counts);
    }

    /// A runner's totals added to what it reported before (a runner that reports per binary or
    /// per package, as `cargo test` and `go test` do).
    pub fn add_counts(&mut self, tool: &'static str, counts: TestCounts) {
        let c = self.counts.entry(tool).or_default();
        *c = add(*c, counts);
    }

    /// What was found, most telling kind first (compile errors, failed tests, test errors,
    /// lint), in the order reported within a kind.
    pub fn finish(mut self) -> Findings {
        self.findings.sort_by_key(|f| rank(f.kind));
        let mut tests = self.carried;
        for c in self.counts.into_values() {
            tests = Some(match tests {
                Some(t) => add(t, c),
                None => c,
            });
        }
        Findings {
            findings: self.findings,
            omitted: self.omitted,
            tests,
        }
    }
}

fn rank(k: FindingKind) -> u8 {
    match k {
        FindingKind::CompileError => 0,
        FindingKind::TestFailed => 1,
        FindingKind::TestError => 2,
        FindingKind::Lint => 3,
    }
}

/// The first non-empty line of `s`, trimmed.
pub fn one_line(s: &str) -> &str {
    s.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}

/// `s` cut to at most `max` bytes on a character boundary, with an ellipsis when cut.
pub fn bound(s: &str, max: usize) -> String {
    match cut(s, max) {
        (kept, false) => kept.to_string(),
        (kept, true) => format!("{kept}..."),
    }
}

/// What [`bound`] keeps of `s`, and whether it cut it (and adds an ellipsis).
pub(crate) fn cut(s: &str, max: usize) -> (&str, bool) {
    if s.len() <= max {
        return (s, false);
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (&s[..end], true)
}

/// An excerpt cut to [`MAX_EXCERPT_LINES`] lines of [`MAX_EXCERPT`] bytes in all, each line to
/// [`MAX_MESSAGE`] bytes, trailing blank lines dropped.
pub fn bound_excerpt(s: &str) -> String {
    let mut out = String::new();
    let mut lines = s.lines().peekable();
    let mut n = 0;
    while let Some(l) = lines.next() {
        if n == MAX_EXCERPT_LINES {
            out.push_str("...\n");
            break;
        }
        let l = bound(l.trim_end(), MAX_MESSAGE);
        if out.len() + l.len() + 1 > MAX_EXCERPT {
            out.push_str("...\n");
            break;
        }
        out.push_str(&l);
        out.push('\n');
        n += 1;
        if lines.peek().is_none() {
            break;
        }
    }
    out.trim_end().to_string()
}

/// Most patterns in one group of the jump search ([`Scanner`]).
const JUMP_GROUP: usize = 64;

/// Words the jump search looks for in place of every anchor holding one ([`jump_patterns`]):
/// the jump only finds the next line holding an anchor, and a line holding an anchor holds
/// every word of it, so fewer patterns find the same lines (and a few more, which the search
/// of the line for the anchors themselves then passes over). Each is a word the anchors share
/// and common log lines seldom hold: one a log line holds (pytest's `::`, cargo's `test `)
/// would stop the jump at every line.
///
/// Not `PASS` (pytest -v's `PASSED` on every line), nor `.py:` (pytest's node ids: ruff's
/// anchors are `.py:` and a digit). `ASS ` stands for jest's `PASS ` alone, to move the first
/// bytes Teddy fingerprints ([`TEDDY_MASK`]) off `PASSED`: a position whose fingerprint
/// matches is checked against each pattern of its bucket, and `PASS` matched on every line of
/// a `pytest -v` log (read at 1.7 GB/s instead of 1.2 without it). `py:1` to `py:9` for ruff's
/// anchors, likewise, made a `cargo test` log's lines match other patterns' fingerprints
/// (Teddy's are per nibble and bucket) and read it at a third of the speed.
const JUMP_WORDS: &[&str] = &[
    "FAIL", "SKIP", "ERROR", "error", "warning", "note:", "failed", "passed", "skipped", "Tests",
    "=== ", "pyi:", "no test", "ASS ",
];

/// The bytes of a pattern Teddy fingerprints (at most; a group's shortest pattern sets them for
/// all). A group fingerprinted on 3 bytes stops at many more places that hold none of its
/// patterns: jest's `✓` on every line of its log did, read at half the speed.
const TEDDY_MASK: usize = 4;

/// Most bytes of the line before kept for [`Line::previous`].
pub const MAX_PREVIOUS: usize = 1024;

/// The last line of `lines` (each ending in a newline), its last [`MAX_PREVIOUS`] bytes.
fn last_line(lines: &[u8]) -> &[u8] {
    let e = lines.len().saturating_sub(1);
    let s = memchr::memrchr(b'\n', &lines[..e]).map_or(0, |i| i + 1);
    &lines[s.max(e.saturating_sub(MAX_PREVIOUS))..e]
}

/// Reads one stream with every reader.
pub struct Scanner {
    readers: Vec<Box<dyn Reader>>,
    /// The searches for the readers' anchors (built once for the default readers).
    anchors: Arc<Anchors>,
    /// Per group: where its last search started, and the match it found (`None`: none to the
    /// chunk's end), reused while the jump has not passed it.
    jump_cache: Vec<(usize, Option<usize>)>,
    sink: Sink,
    /// Bytes of an unfinished line.
    pending: Vec<u8>,
    /// The current line was longer than [`MAX_LINE`]: the rest of it is skipped.
    skipping: bool,
    number: u64,
    /// Scratch: which readers an anchor of the current line names.
    hit: Vec<bool>,
    /// Readers may take runs of lines ([`Reader::skim`]); off only to test that they read
    /// alike without.
    skimming: bool,
    /// Lines taken in runs.
    skimmed: u64,
    /// Which readers want every line ([`Reader::wants_all`], as each said after its last
    /// line): asking each reader at every line cost a third of the time of a log whose every
    /// line holds an anchor (`go test -v`).
    wants: Vec<bool>,
    text: String,
    /// The end of the last line of the previous chunk ([`Line::previous`]).
    last: Vec<u8>,
}

impl std::fmt::Debug for Scanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scanner")
            .field("readers", &self.readers.len())
            .field("lines", &self.number)
            .finish()
    }
}

/// The searches for a set of readers' anchors.
#[derive(Debug)]
struct Anchors {
    /// Anchor pattern id -> the readers (by index) that gave it.
    owners: Vec<Vec<usize>>,
    search: Option<AhoCorasick>,
    /// For the jump to the next line holding an anchor: [`jump_patterns`] in groups of at most
    /// [`JUMP_GROUP`]. A group that small is searched with a vectorised prefilter (Teddy),
    /// where all of them at once fall back to a byte-at-a-time automaton (1.5x slower on a
    /// cargo test log, docs/findings.md). The groups are of one size ([`jump_groups`]), and the
    /// patterns under [`TEDDY_MASK`] bytes are a group of their own.
    jump: Vec<AhoCorasick>,
    /// The readers that take runs of lines ([`Reader::skims`]).
    skims: Vec<usize>,
}

impl Anchors {
    fn new(readers: &[Box<dyn Reader>]) -> Anchors {
        let mut patterns: Vec<&'static str> = Vec::new();
        let mut owners: Vec<Vec<usize>> = Vec::new();
        for (i, r) in readers.iter().enumerate() {
            for a in r.anchors() {
                match patterns.iter().position(|p| p == a) {
                    Some(k) => owners[k].push(i),
                    None => {
                        patterns.push(a);
                        owners.push(vec![i]);
                    }
                }
            }
        }
        let search = AhoCorasick::new(&patterns).ok();
        let words = jump_patterns(&patterns);
        let (long, short): (Vec<&str>, Vec<&str>) =
            words.iter().partition(|w| w.len() >= TEDDY_MASK);
        let jump = jump_groups(&long)
            .chain(jump_groups(&short))
            .filter_map(|g| {
                // Leftmost-first: the leftmost match's start is all the jump needs, and only
                // leftmost searches get the vectorised prefilter.
                AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostFirst)
                    .build(g)
                    .ok()
            })
            .collect();
        let skims = (0..readers.len()).filter(|&i| readers[i].skims()).collect();
        Anchors {
            owners,
            search,
            jump,
            skims,
        }
    }
}

/// What the jump search looks for to find every line holding one of `anchors`: each anchor's
/// [`JUMP_WORDS`] word when it holds one, else the anchor itself; once each, in the anchors'
/// order.
fn jump_patterns<'a>(anchors: &[&'a str]) -> Vec<&'a str> {
    let mut out: Vec<&'a str> = Vec::new();
    for &a in anchors {
        let p = JUMP_WORDS
            .iter()
            .copied()
            .find(|w| a.contains(w))
            .unwrap_or(a);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// `patterns` in as few groups of at most [`JUMP_GROUP`] as they need, of one size (the last
/// may be a little smaller). Teddy puts a group's patterns in 16 buckets and verifies every pattern of a bucket
/// whose fingerprint a position matches: in two groups of 64 and 30, the 64 made 4 a bucket and
/// verified at every other line of a `cargo test` log; two of 47 read it twice as fast
/// (BENCHMARKS.md, findings).
fn jump_groups<'a>(patterns: &'a [&'a str]) -> std::slice::Chunks<'a, &'a str> {
    let groups = patterns.len().div_ceil(JUMP_GROUP).max(1);
    patterns.chunks(patterns.len().div_ceil(groups).max(1))
}

impl Scanner {
    /// A scanner with every reader, locating files against `paths`.
    pub fn new(paths: Paths) -> Scanner {
        // Building the automata takes about a millisecond: once per process, not per stream.
        static DEFAULT: std::sync::LazyLock<Arc<Anchors>> =
            std::sync::LazyLock::new(|| Arc::new(Anchors::new(&readers())));
        Scanner::with_anchors(paths, readers(), DEFAULT.clone())
    }

    /// A scanner with these readers.
    pub fn with_readers(paths: Paths, readers: Vec<Box<dyn Reader>>) -> Scanner {
        let anchors = Arc::new(Anchors::new(&readers));
        Scanner::with_anchors(paths, readers, anchors)
    }

    /// `readers` with the searches for their anchors (made by [`Anchors::new`] of the same).
    fn with_anchors(paths: Paths, readers: Vec<Box<dyn Reader>>, anchors: Arc<Anchors>) -> Scanner {
        let jump = anchors.jump.len();
        let jump_cache = vec![(usize::MAX, None); jump];
        let n = readers.len();
        let wants = readers.iter().map(|r| r.wants_all()).collect();
        Scanner {
            wants,
            readers,
            anchors,
            jump_cache,
            sink: Sink::new(paths),
            pending: Vec::new(),
            skipping: false,
            number: 0,
            hit: vec![false; n],
            skimming: true,
            skimmed: 0,
            text: String::new(),
            last: Vec::new(),
        }
    }

    /// The next bytes of the stream.
    pub fn feed(&mut self, mut data: &[u8]) {
        // Finish the pending line first.
        if !self.pending.is_empty() || self.skipping {
            match memchr::memchr(b'\n', data) {
                Some(nl) => {
                    if !self.skipping {
                        let take = nl.min(MAX_LINE - self.pending.len());
                        self.pending.extend_from_slice(&data[..take]);
                    }
                    let line = std::mem::take(&mut self.pending);
                    if !self.skipping || !line.is_empty() {
                        self.lines(&line, true);
                    }
                    self.pending = line;
                    self.pending.clear();
                    self.skipping = false;
                    data = &data[nl + 1..];
                }
                None => {
                    if !self.skipping {
                        let room = MAX_LINE - self.pending.len();
                        if data.len() >= room {
                            self.pending.extend_from_slice(&data[..room]);
                            let line = std::mem::take(&mut self.pending);
                            self.lines(&line, true);
                            self.pending = line;
                            self.pending.clear();
                            self.skipping = true;
                        } else {
                            self.pending.extend_from_slice(data);
                        }
                    }
                    return;
                }
            }
        }
        // Whole lines of this chunk, straight from it.
        let end = match memchr::memrchr(b'\n', data) {
            Some(nl) => nl + 1,
            None => 0,
        };
        if end > 0 {
            self.lines(&data[..end], false);
        }
        let rest = &data[end..];
        if rest.len() >= MAX_LINE {
            self.pending.extend_from_slice(&rest[..MAX_LINE]);
            let line = std::mem::take(&mut self.pending);
            self.lines(&line, true);
            self.pending = line;
            self.pending.clear();
            self.skipping = true;
        } else {
            self.pending.extend_from_slice(rest);
        }
    }

    /// Reads `r` to its end.
    pub fn read_all(&mut self, mut r: impl Read) -> io::Result<()> {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match r.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => self.feed(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Ends the stream and gives what was found.
    pub fn finish(mut self) -> Findings {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.lines(&line, true);
        }
        for r in &mut self.readers {
            r.end(&mut self.sink);
        }
        self.sink.finish()
    }

    /// Lines of `chunk` (each ending in a newline, or, when `single`, the chunk is one line
    /// without its end). While no reader is inside a block, the search jumps from one line
    /// holding an anchor to the next, counting the lines between without looking at them.
    fn lines(&mut self, chunk: &[u8], single: bool) {
        let before = std::mem::take(&mut self.last);
        let last = if single {
            self.number += 1;
            let line = &chunk[..chunk.len().min(MAX_LINE)];
            self.line(line, &before);
            &line[line.len().saturating_sub(MAX_PREVIOUS)..]
        } else {
            self.lines_of(chunk, &before);
            last_line(chunk)
        };
        // The buffer is reused for the next chunk's line before.
        self.last = before;
        self.last.clear();
        self.last.extend_from_slice(last);
    }

    /// Some reader is inside a block of its own and wants every line.
    fn in_block(&self) -> bool {
        self.wants.contains(&true)
    }

    /// Whole lines of `chunk`, after the line `before`.
    fn lines_of(&mut self, chunk: &[u8], before: &[u8]) {
        self.jump_cache.fill((usize::MAX, None));
        let mut pos = 0;
        // A run was just taken: it stopped at the line at `pos`, which is read as it is (the
        // jump would stop there or pass a line that no reader wants).
        let mut after_run = false;
        while pos < chunk.len() {
            if !std::mem::take(&mut after_run) {
                if !self.in_block() {
                    let next = self.next_anchor(chunk, pos);
                    let Some(at) = next else {
                        self.number += memchr::memchr_iter(b'\n', &chunk[pos..]).count() as u64;
                        return;
                    };
                    let start =
                        memchr::memrchr(b'\n', &chunk[pos..at]).map_or(pos, |i| pos + i + 1);
                    self.number += memchr::memchr_iter(b'\n', &chunk[pos..start]).count() as u64;
                    pos = start;
                }
                if self.skimming {
                    let taken = self.skim(&chunk[pos..]);
                    if taken > 0 {
                        pos += taken;
                        after_run = true;
                        continue;
                    }
                }
            }
            let end = memchr::memchr(b'\n', &chunk[pos..]).map_or(chunk.len(), |i| pos + i);
            self.number += 1;
            // The chunk starts at a line's start.
            let previous = if pos == 0 {
                before
            } else {
                last_line(&chunk[..pos])
            };
            self.line(&chunk[pos..end.min(pos + MAX_LINE)], previous);
            pos = end + 1;
        }
    }

    /// Where the first anchor at or after `pos` in `chunk` starts: the nearest of each group's,
    /// each group searched again only once the jump has passed the match it last found.
    fn next_anchor(&mut self, chunk: &[u8], pos: usize) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (ac, cache) in self.anchors.jump.iter().zip(self.jump_cache.iter_mut()) {
            let (from, found) = *cache;
            let hit = if from <= pos && found.is_none_or(|f| f >= pos) {
                found
            } else {
                let f = ac.find(&chunk[pos..]).map(|m| pos + m.start());
                *cache = (pos, f);
                f
            };
            if let Some(h) = hit {
                best = Some(best.map_or(h, |b| b.min(h)));
            }
        }
        best
    }

    /// The line at the start of `lines` and those after it that a reader takes as a run
    /// ([`Reader::skim`]), when one does and no other reader is inside a block: the bytes
    /// taken.
    fn skim(&mut self, lines: &[u8]) -> usize {
        for k in 0..self.anchors.skims.len() {
            let i = self.anchors.skims[k];
            if self.wants.iter().enumerate().any(|(j, &w)| w && j != i) {
                continue;
            }
            let r = &mut self.readers[i];
            let (bytes, n) = r.skim(lines);
            if n > 0 {
                self.wants[i] = r.wants_all();
                self.number += n;
                self.skimmed += n;
                return bytes.min(lines.len());
            }
        }
        0
    }

    /// One line (already cut to [`MAX_LINE`]): to the readers whose anchors it holds, and to
    /// those inside a block.
    fn line(&mut self, raw: &[u8], previous: &[u8]) {
        let mut any = false;
        if let Some(ac) = &self.anchors.search {
            for m in ac.find_overlapping_iter(raw) {
                for &r in &self.anchors.owners[m.pattern().as_usize()] {
                    self.hit[r] = true;
                    any = true;
                }
            }
        }
        if !any && !self.in_block() {
            return;
        }
        clean_line(raw, &mut self.text);
        let l = Line {
            text: &self.text,
            number: self.number,
            previous,
        };
        for (i, r) in self.readers.iter_mut().enumerate() {
            if self.hit[i] || self.wants[i] {
                r.line(l, &mut self.sink);
                self.wants[i] = r.wants_all();
            }
            self.hit[i] = false;
        }
    }
}

/// `raw` holds neither an escape nor a carriage return: [`clean_line`] leaves it as it is.
fn plain(raw: &[u8]) -> bool {
    memchr::memchr2(0x1b, b'\r', raw).is_none()
}

/// `raw` appended to `out`, invalid UTF-8 replaced. Most lines are valid: `from_utf8` checks
/// them a word at a time where ASCII, which the lossy decoding does not.
fn push_lossy(raw: &[u8], out: &mut String) {
    match std::str::from_utf8(raw) {
        Ok(s) => out.push_str(s),
        Err(_) => out.push_str(&String::from_utf8_lossy(raw)),
    }
}

/// `raw` as a terminal would show it: CSI and OSC escapes removed, what a carriage return
/// overwrote dropped, a trailing `\r` removed, invalid UTF-8 replaced.
fn clean_line(raw: &[u8], out: &mut String) {
    out.clear();
    if plain(raw) {
        push_lossy(raw, out);
        return;
    }
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    // What a carriage return in the middle of the line overwrote (progress bars).
    let raw = match memchr::memrchr(b'\r', raw) {
        Some(i) if i + 1 < raw.len() => &raw[i + 1..],
        _ => raw,
    };
    if memchr::memchr(0x1b, raw).is_none() {
        push_lossy(raw, out);
        return;
    }
    let mut bytes = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == 0x1b && i + 1 < raw.len() {
            match raw[i + 1] {
                b'[' => {
                    // CSI: parameters and intermediates, then one final byte in 0x40..=0x7e.
                    let mut j = i + 2;
                    while j < raw.len() && !(0x40..=0x7e).contains(&raw[j]) {
                        j += 1;
                    }
                    i = j + 1;
                    continue;
                }
                b']' => {
                    // OSC: up to BEL or ST (ESC \).
                    let mut j = i + 2;
                    while j < raw.len() && raw[j] != 0x07 && raw[j] != 0x1b {
                        j += 1;
                    }
                    if j < raw.len() && raw[j] == 0x1b {
                        j += 1;
                    }
                    i = j + 1;
                    continue;
                }
                _ => {
                    // Any other: intermediates (0x20..=0x2f), then one final byte, as in
                    // `ESC ( B` (the character set that `tput sgr0` selects).
                    let mut j = i + 1;
                    while j < raw.len() && (0x20..=0x2f).contains(&raw[j]) {
                        j += 1;
                    }
                    i = j + 1;
                    continue;
                }
            }
        }
        bytes.push(raw[i]);
        i += 1;
    }
    out.push_str(&String::from_utf8_lossy(&bytes));
}

/// Reads one whole stream held in memory.
pub fn read_bytes(data: &[u8], paths: &Paths) -> Findings {
    let mut s = Scanner::new(paths.clone());
    s.feed(data);
    s.finish()
}

/// Reads one stream to its end (a spill file); a read error ends it where it happened.
pub fn read_stream(r: impl Read, paths: &Paths) -> Findings {
    let mut s = Scanner::new(paths.clone());
    let _ = s.read_all(r);
    s.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What every reader makes of `data` fed in chunks of the sizes `cuts` cycles through, with
    /// runs of lines taken whole ([`Reader::skim`]) or not; and how many were.
    fn read_in(data: &[u8], cuts: &[usize], skimming: bool) -> (Findings, u64) {
        let mut s = Scanner::new(Paths::new("/w", "/w"));
        s.skimming = skimming;
        let mut rest = data;
        for &c in cuts.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (a, b) = rest.split_at(c.min(rest.len()));
            s.feed(a);
            rest = b;
        }
        let skimmed = s.skimmed;
        (s.finish(), skimmed)
    }

    /// Lines a `go test -v` log holds, and lines near them that a run must not take.
    const GO_LINES: &[&[u8]] = &[
        b"=== RUN   TestA",
        b"=== RUN   TestB/sub_1",
        b"--- PASS: TestA (0.00s)",
        b"    --- PASS: TestB/sub_1 (0.01s)",
        b"--- SKIP: TestS (0.00s)",
        b"    --- SKIP: TestS/x (0.00s)",
        b"=== PAUSE TestP",
        b"=== CONT  TestP",
        b"=== NAME  TestB",
        b"--- FAIL: TestB (0.00s)",
        b"    --- FAIL: TestB/sub_1 (0.00s)",
        b"    calc_test.go:12: boom",
        b"        want 5",
        b"    more output of a test",
        b"=== RUN   TestFAILED now",
        b"--- PASS: TestFAILURE (0.00s)",
        b"--- PASS: Test with spaces (0.00s)",
        b"--- PASS:  (0.00s)",
        b"=== RUN   ",
        b"=== RUN   a.go:3",
        b"=== RUNNER",
        b"--- PASS: X (a.go:s)",
        b"    === RUN   TestIndented",
        b"\t--- PASS: TestTab (0.00s)",
        b"# example.com/m/b",
        b"./b.go:3:2: undefined: foo",
        b"FAIL\texample.com/m/b [build failed]",
        b"=== RUN   TestX [build failed]",
        b"=== RUN   Test\x1b[31mRed",
        b"=== RUN   T\xc3\xa9st",
        b"=== RUN   T\xffst",
        b"=== RUN   TestCR\r",
        b"--- PASS: TestCR (0.00s)\r",
        b"--- PASS: TestOver\r--- FAIL: TestOver (0.00s)",
        b"panic: boom [recovered]",
        b"goroutine 7 [running]:",
        b"example.com/m.TestB(0x0?)",
        b"\t/w/m_test.go:5 +0x1",
        b"",
        b"ok  \texample.com/m\t0.01s",
        b"FAIL\texample.com/m\t0.01s",
        b"FAIL",
        b"PASS",
        b"test result: ok. 1 passed; 0 failed",
        b"error: something",
        b"FAILED tests/test_x.py::test_a - assert 1",
        b"{\"Action\":\"pass\",\"Package\":\"m\",\"Test\":\"TestA\"}",
        // A package's errors, left pending, then confirmed by a line ending as its end does.
        b"# example.com/m/b\n./b.go:3:2: undefined: foo\nok  \tm\t0.1s\n=== RUN   X [build failed]",
        // A file line, whose line before is read when it is `# pkg`.
        b"# example.com/m/b\n=== RUN   a.go:3",
        b"# example.com/m/b\n--- PASS: X (a.go:s)",
        b"# example.com/m/b\n    --- PASS: X/y (a.go:s)",
        b"--- PASS: TestOdd (x)",
        // A panic's trace, whose frames a test's line interrupts.
        b"--- FAIL: TestP (0.00s)\npanic: boom [recovered]\n\tpanic: boom\n\ngoroutine 7 [running]:\n\
          example.com/m/sub.TestP(0x0?)\n=== RUN   TestQ\n\t/w/sub/p_test.go:9 +0x1",
        // Another reader's block, which a test's lines interrupt.
        b"error[E0308]: mismatched types\n=== RUN   TestA\n--- PASS: TestA (0.00s)\n --> src/lib.rs:3:5",
        b"--- PASS: TestNoTime",
        // A test named by a line that is not printable ASCII, whose output then comes.
        b"=== RUN   TestCR\r\n    x_test.go:3: boom\n--- FAIL: TestCR (0.00s)",
        b"=== RUN   T\xffst\n    x_test.go:4: boom\n--- FAIL: T\xef\xbf\xbdst (0.00s)",
        b"=== RUN   T\x7fst\n    x_test.go:5: boom\n--- FAIL: T\x7fst (0.00s)",
    ];

    /// A reader that takes runs of lines reads as it does line by line: on logs of go's lines
    /// and others near them in any order, fed in chunks of any size.
    #[test]
    fn runs_of_lines_read_as_the_lines_do() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut skimmed_any = 0;
        for round in 0..300 {
            let mut log = Vec::new();
            let lines = 1 + next() % 400;
            // Mostly the lines of tests that pass, as in a real log, or mostly the others.
            let common = [1, 2, 3][round % 3];
            for _ in 0..lines {
                let i = if next() % 4 < common {
                    (next() % 6) as usize
                } else {
                    (next() % GO_LINES.len() as u64) as usize
                };
                log.extend_from_slice(GO_LINES[i]);
                log.push(b'\n');
            }
            if round % 5 == 0 {
                // Without its last line's end.
                log.pop();
            }
            let cuts: Vec<usize> = (0..4).map(|_| 1 + (next() % 700) as usize).collect();
            let (on, skimmed) = read_in(&log, &cuts, true);
            let (off, none) = read_in(&log, &cuts, false);
            assert_eq!(none, 0);
            assert_eq!(on, off, "round {round}:\n{}", String::from_utf8_lossy(&log));
            skimmed_any += skimmed;
        }
        assert!(skimmed_any > 10_000, "{skimmed_any} lines taken in runs");
    }

    /// Whether the line before starts so is read as [`Line::previous`] reads it: coloured,
    /// overwritten by a carriage return, or plain.
    #[test]
    fn the_line_before_is_asked_as_it_reads() {
        let ask = |previous: &[u8]| {
            let l = Line {
                text: "",
                number: 2,
                previous,
            };
            (l.previous_starts_with("# "), l.previous().starts_with("# "))
        };
        for (raw, starts) in [
            (&b"# example.com/m"[..], true),
            (b"\x1b[1m# example.com/m\x1b[0m", true),
            (b"progress 50%\r# example.com/m\r", true),
            (b"#example.com/m", false),
            (b" # example.com/m", false),
            (b"\xff# x", false),
            (b"", false),
        ] {
            assert_eq!(ask(raw), (starts, starts), "{raw:?}");
        }
    }

    /// A test's name that holds another tool's anchor is not that tool's report: every other
    /// reader's anchor, planted in the names of tests that pass, changes no finding and no
    /// count, though those lines are now the go reader's alone ([`Reader::skim`]).
    #[test]
    fn another_tools_word_in_a_tests_name_is_not_its_report() {
        let go = readers()
            .iter()
            .position(|r| r.tool() == "go-test")
            .unwrap();
        let mut log = String::new();
        let mut planted = 0;
        for (i, r) in readers().iter().enumerate() {
            if i == go {
                continue;
            }
            for a in r.anchors() {
                let core = a.trim().replace([' ', ':'], "_");
                if core.is_empty() || !core.bytes().all(|b| (0x21..0x7f).contains(&b)) {
                    continue;
                }
                for name in [
                    core.clone(),
                    format!("Test{core}"),
                    format!("{core}Test"),
                    format!("TestX/{core}"),
                ] {
                    log.push_str(&format!("=== RUN   {name}\n--- PASS: {name} (0.00s)\n"));
                    log.push_str(&format!("    --- SKIP: {name} (0.00s)\n=== CONT  {name}\n"));
                    planted += 1;
                }
            }
        }
        assert!(planted > 200, "{planted}");
        // The other tools' own reports around them are still read.
        let around = "error[E0308]: mismatched types\n --> src/lib.rs:3:5\n\n\
                      src/a.c:7:2: error: expected ';' before '}' token\n\
                      === 1 failed, 2 passed in 0.10s ===\n";
        let log = format!("{around}{log}{around}ok  \texample.com/m\t0.01s\n");
        let (on, skimmed) = read_in(log.as_bytes(), &[4096], true);
        let (off, _) = read_in(log.as_bytes(), &[4096], false);
        // All but a few (a name ending in `]` is read line by line).
        assert!(skimmed > 3 * planted, "{skimmed} of {}", 4 * planted);
        assert_eq!(on, off);
        assert!(on.findings.len() >= 2, "{on:?}");
    }

    /// A `go test -v` log of tests that pass is taken in runs; a line of another shape (a
    /// test's output, its failure) is read as any other, and the one after it starts the next.
    #[test]
    fn a_go_log_of_passed_tests_is_taken_in_runs() {
        let mut log = Vec::new();
        for i in 0..1000 {
            log.extend_from_slice(format!("=== RUN   TestCase{i}\n").as_bytes());
            if i == 500 {
                log.extend_from_slice(b"    x_test.go:7: boom\n--- FAIL: TestCase500 (0.00s)\n");
            } else {
                log.extend_from_slice(format!("--- PASS: TestCase{i} (0.00s)\n").as_bytes());
            }
        }
        log.extend_from_slice(b"FAIL\texample.com/m\t0.01s\n");
        let (found, skimmed) = read_in(&log, &[64 * 1024], true);
        // Every `=== RUN` and `--- PASS`: all but the failed test's output and result lines
        // and the package's.
        assert_eq!(skimmed, 1000 + 999);
        assert_eq!(found.findings.len(), 1, "{found:?}");
        let f = &found.findings[0];
        assert_eq!(f.name.as_deref(), Some("TestCase500"));
        assert_eq!(f.location.as_ref().map(|l| l.line), Some(Some(7)));
        assert_eq!(found.tests.map(|t| (t.passed, t.failed)), Some((999, 1)));
        assert_eq!(found, read_in(&log, &[64 * 1024], false).0);
    }

    /// Every stream of every exec has a scanner: the default one's automata are built once per
    /// process (building them took 1 ms, twice an exec).
    #[test]
    fn default_scanners_share_their_automata() {
        let paths = || Paths::new("/w", "/w");
        let (a, b) = (Scanner::new(paths()), Scanner::new(paths()));
        assert!(Arc::ptr_eq(&a.anchors, &b.anchors));
        assert!(a.anchors.search.is_some() && !a.anchors.jump.is_empty());
        let c = Scanner::with_readers(paths(), readers());
        assert!(!Arc::ptr_eq(&a.anchors, &c.anchors));
    }

    /// Every reader's anchors, once each.
    fn all_anchors() -> Vec<&'static str> {
        let mut all: Vec<&str> = readers()
            .iter()
            .flat_map(|r| r.anchors().iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// The jump's groups: as few as the patterns need, each at most [`JUMP_GROUP`], of one size.
    #[test]
    fn the_jumps_groups_are_as_few_as_needed_and_even() {
        let sizes = |n: usize| {
            let p: Vec<&str> = vec!["x"; n];
            jump_groups(&p).map(|g| g.len()).collect::<Vec<_>>()
        };
        assert_eq!(sizes(0), Vec::<usize>::new());
        assert_eq!(sizes(10), [10]);
        assert_eq!(sizes(64), [64]);
        assert_eq!(sizes(65), [33, 32]);
        assert_eq!(sizes(94), [47, 47]);
        assert_eq!(sizes(129), [43, 43, 43]);
        let words = jump_patterns(&all_anchors());
        assert_eq!(
            Anchors::new(&readers()).jump.len(),
            words.len().div_ceil(JUMP_GROUP),
            "{words:?}"
        );
        // Patterns under TEDDY_MASK bytes are a group of their own.
        struct Short;
        impl Reader for Short {
            fn tool(&self) -> &'static str {
                "short"
            }
            fn anchors(&self) -> &'static [&'static str] {
                &["ab", "FAILED", "xy:"]
            }
            fn line(&mut self, _: Line<'_>, _: &mut Sink) {}
        }
        let mut with_short = readers();
        with_short.push(Box::new(Short));
        assert_eq!(
            Anchors::new(&with_short).jump.len(),
            words.len().div_ceil(JUMP_GROUP) + 1
        );
    }

    /// Every anchor holds one of the jump's patterns (so the jump stops at every line holding
    /// an anchor), each pattern is there once, and the words make them fewer.
    #[test]
    fn every_anchor_holds_a_pattern_of_the_jump() {
        let all = all_anchors();
        let jump = jump_patterns(&all);
        for a in &all {
            assert!(jump.iter().any(|p| a.contains(p)), "{a:?} holds no pattern");
        }
        let mut unique = jump.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), jump.len());
        assert!(
            jump.len() <= 2 * all.len() / 3,
            "{} of {}",
            jump.len(),
            all.len()
        );
        // A word no anchor holds is not searched for; a common line holds none of them, nor
        // the first TEDDY_MASK bytes of any (the fingerprint, checked against the pattern at
        // every position it matches), but for ruff's `.py:` and a digit (JUMP_WORDS says why).
        for line in [
            "tests/test_mod.py::test_something_works PASSED                        [ 42%]",
            "test foo::bar::baz_works ... ok",
            "  \u{2713} does the thing (3 ms)",
        ] {
            assert!(!jump.iter().any(|p| line.contains(p)), "{line}");
            let prints: Vec<&&str> = jump
                .iter()
                .filter(|p| !p.starts_with(".py:"))
                .filter(|p| {
                    memchr::memmem::find(line.as_bytes(), &p.as_bytes()[..TEDDY_MASK]).is_some()
                })
                .collect();
            assert!(prints.is_empty(), "{line}: {prints:?}");
        }
        assert_eq!(jump_patterns(&["abc", "FAILED", "xFAIL"]), ["abc", "FAIL"]);
        // Every pattern is fingerprinted on its first TEDDY_MASK bytes: a shorter one would be
        // a group of its own, one more pass over every byte (vitest's one `⎯` was a fifth of
        // the readers' time on a cargo test log).
        let short: Vec<&&str> = jump.iter().filter(|p| p.len() < TEDDY_MASK).collect();
        assert!(short.is_empty(), "{short:?}");
        assert_eq!(Anchors::new(&readers()).jump.len(), 1);
    }

    /// Records the lines it is given.
    struct Echo {
        seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        block: usize,
    }

    impl Reader for Echo {
        fn tool(&self) -> &'static str {
            "echo"
        }
        fn anchors(&self) -> &'static [&'static str] {
            &["FAIL"]
        }
        fn wants_all(&self) -> bool {
            self.block > 0
        }
        fn line(&mut self, line: Line<'_>, sink: &mut Sink) {
            self.seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(line.text.to_string());
            if self.block > 0 {
                self.block -= 1;
            } else {
                self.block = 1;
                sink.push(Finding {
                    kind: FindingKind::TestFailed,
                    tool: "echo".into(),
                    name: Some(line.text.to_string()),
                    location: None,
                    message: format!("line {}", line.number),
                    excerpt: None,
                });
            }
        }
    }

    fn scan(chunks: &[&[u8]]) -> (Vec<String>, Findings) {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut s = Scanner::with_readers(
            Paths::default(),
            vec![Box::new(Echo {
                seen: seen.clone(),
                block: 0,
            })],
        );
        for c in chunks {
            s.feed(c);
        }
        let f = s.finish();
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (seen, f)
    }

    #[test]
    fn only_anchored_lines_and_blocks_reach_a_reader() {
        let (seen, f) = scan(&[b"ok\nFAIL one\nnext\nafter\nFA", b"IL two\nlast"]);
        assert_eq!(seen, ["FAIL one", "next", "FAIL two", "last"]);
        assert_eq!(f.findings.len(), 2);
        assert_eq!(f.findings[0].message, "line 2");
        assert_eq!(f.findings[1].message, "line 5");
    }

    #[test]
    fn escapes_and_overwrites_are_removed() {
        let (seen, _) = scan(&[
            b"\x1b[31mFAIL\x1b[0m x\r\n",
            b"50%\r100% ok\n",
            b"FAIL \x1b[31mred\x1b(B\x1b[m\n",
        ]);
        assert_eq!(seen, ["FAIL x", "100% ok", "FAIL red"]);
    }

    #[test]
    fn a_huge_line_is_cut_and_the_next_is_read() {
        let big = vec![b'x'; 3 * MAX_LINE];
        let mut line = b"FAIL ".to_vec();
        line.extend_from_slice(&big);
        let (seen, f) = scan(&[&line[..1000], &line[1000..], b"\nFAIL after\n", b"z\n"]);
        // The cut line's rest is no line of its own; "FAIL after" is the block's next line,
        // and "z" holds no anchor.
        assert_eq!(
            seen.len(),
            2,
            "{:?}",
            seen.iter().map(String::len).collect::<Vec<_>>()
        );
        assert_eq!(seen[0].len(), MAX_LINE);
        assert_eq!(seen[1], "FAIL after");
        assert!(
            f.findings[0]
                .name
                .as_ref()
                .is_some_and(|n| n.len() <= MAX_NAME)
        );
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        let (seen, _) = scan(&[b"FAIL \xff\xfe ok\n"]);
        assert_eq!(seen, ["FAIL \u{fffd}\u{fffd} ok"]);
    }

    #[test]
    fn the_sink_bounds_and_deduplicates() {
        let mut s = Sink::new(Paths::default());
        for i in 0..(MAX_FINDINGS + 7) {
            let f = Finding {
                kind: FindingKind::Lint,
                tool: "t".into(),
                name: Some(format!("n{i}")),
                location: None,
                message: "m\nsecond line".into(),
                excerpt: Some("a\n".repeat(100)),
            };
            s.push(f.clone());
            s.push(f);
        }
        let f = s.finish();
        assert_eq!(f.findings.len(), MAX_FINDINGS);
        // Beyond the bound each report is counted (a repeated one too).
        assert_eq!(f.omitted, 14);
        assert_eq!(f.findings[0].message, "m");
        let ex = f.findings[0].excerpt.as_deref().unwrap_or("");
        assert!(ex.lines().count() <= MAX_EXCERPT_LINES + 1, "{ex}");
    }

    #[test]
    fn compile_errors_come_first() {
        let mut s = Sink::new(Paths::default());
        for kind in [
            FindingKind::Lint,
            FindingKind::TestFailed,
            FindingKind::CompileError,
        ] {
            s.push(Finding {
                kind,
                tool: "t".into(),
                name: None,
                location: None,
                message: "m".into(),
                excerpt: None,
            });
        }
        let kinds: Vec<_> = s.finish().findings.iter().map(|f| f.kind).collect();
        assert_eq!(
            kinds,
            [
                FindingKind::CompileError,
                FindingKind::TestFailed,
                FindingKind::Lint
            ]
        );
    }
}
