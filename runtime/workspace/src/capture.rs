//! Bounded capture of one output stream: the head and tail within a byte limit stay in memory,
//! the whole stream goes to a spill file once it outgrows the limit.
//!
//! Memory use is at most `limit` bytes per stream whatever the command writes; the spill file is
//! created lazily, so a command with short output leaves no file behind. With
//! [`Capture::with_findings`], every byte of the stream also goes through the findings readers
//! as it arrives (docs/findings.md): the whole stream is read, even past the spill file's cap,
//! while the command still runs. The first [`INLINE_READ`] bytes are read in the capture's own
//! thread; a longer stream is handed to a thread of its own, so a long log is read beside the
//! command's run, not in the way of its output.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::mpsc;

use taskbox_findings::{Findings, Paths, Scanner};

use crate::result::Output;

/// The capture of one stream.
#[derive(Debug)]
pub struct Capture {
    limit: usize,
    /// Everything until the limit is reached; afterwards only the head half.
    head: Vec<u8>,
    /// The most recent bytes once the limit is exceeded.
    tail: VecDeque<u8>,
    tail_cap: usize,
    bytes: u64,
    spill_path: PathBuf,
    spill: Option<io::BufWriter<File>>,
    spill_error: Option<io::Error>,
    shown_path: Option<PathBuf>,
    /// Most bytes the spill file may hold (its share of `limits.disk` where it lives outside
    /// the sandbox's disk).
    spill_cap: u64,
    spilled: u64,
    capped: bool,
    /// The findings readers, reading the stream as it arrives.
    scanner: Option<Reading>,
}

/// Bytes of a stream its findings readers read in the capture's thread; past them, in a thread
/// of their own.
pub const INLINE_READ: u64 = 1 << 20;
/// The size of the chunks handed to the reading thread.
const HANDOFF_CHUNK: usize = 256 * 1024;
/// Chunks in flight to the reading thread: when it falls behind, the capture waits (the memory
/// a stream's reading holds is bounded by these).
const HANDOFF_DEPTH: usize = 8;

/// Where a stream's findings are read.
#[derive(Debug)]
enum Reading {
    /// Nothing arrived yet: the readers are made with the first bytes (a stream that stays
    /// empty never makes them).
    Pending(Paths),
    Inline(Box<Scanner>),
    /// Only while the readers move to their thread.
    Moving,
    Thread {
        /// Bytes gathered for the next chunk.
        batch: Vec<u8>,
        to: mpsc::SyncSender<Vec<u8>>,
        /// Chunks the thread has read, for reuse.
        back: mpsc::Receiver<Vec<u8>>,
        done: std::thread::JoinHandle<Findings>,
    },
}

impl Reading {
    fn feed(&mut self, data: &[u8], seen: u64) {
        if let Reading::Pending(paths) = self {
            *self = Reading::Inline(Box::new(Scanner::new(paths.clone())));
        }
        if let Reading::Inline(s) = self {
            s.feed(data);
            if seen >= INLINE_READ
                && let Reading::Inline(s) = std::mem::replace(self, Reading::Moving)
            {
                *self = Reading::hand_off(s);
            }
            return;
        }
        let Reading::Thread {
            batch, to, back, ..
        } = self
        else {
            return;
        };
        batch.extend_from_slice(data);
        if batch.len() >= HANDOFF_CHUNK {
            let next = back
                .try_recv()
                .unwrap_or_else(|_| Vec::with_capacity(HANDOFF_CHUNK * 2));
            let full = std::mem::replace(batch, next);
            // A thread that is gone (it panicked) gives what it read at the end.
            let _ = to.send(full);
        }
    }

    /// The readers in a thread of their own (still inline when none can be started).
    fn hand_off(scanner: Box<Scanner>) -> Reading {
        let (to, from) = mpsc::sync_channel::<Vec<u8>>(HANDOFF_DEPTH);
        let (give_back, back) = mpsc::channel::<Vec<u8>>();
        // The readers go over once the thread runs: a thread that cannot start leaves them here.
        let (give, take) = mpsc::channel::<Box<Scanner>>();
        let spawned = std::thread::Builder::new()
            .name("findings".into())
            .spawn(move || {
                let Ok(mut s) = take.recv() else {
                    return Findings::default();
                };
                for mut chunk in from {
                    s.feed(&chunk);
                    chunk.clear();
                    let _ = give_back.send(chunk);
                }
                s.finish()
            });
        match spawned {
            Ok(done) => match give.send(scanner) {
                Ok(()) => Reading::Thread {
                    batch: Vec::with_capacity(HANDOFF_CHUNK * 2),
                    to,
                    back,
                    done,
                },
                Err(mpsc::SendError(scanner)) => Reading::Inline(scanner),
            },
            Err(_) => Reading::Inline(scanner),
        }
    }

    fn finish(self) -> Findings {
        match self {
            Reading::Inline(s) => s.finish(),
            // The readers find nothing in no bytes.
            Reading::Pending(_) => Findings::default(),
            Reading::Moving => Findings::default(),
            Reading::Thread {
                batch, to, done, ..
            } => {
                if !batch.is_empty() {
                    let _ = to.send(batch);
                }
                drop(to);
                done.join().unwrap_or_default()
            }
        }
    }
}

impl Capture {
    /// A capture keeping at most `limit` bytes in memory, spilling to `spill_path` beyond it.
    pub fn new(limit: usize, spill_path: PathBuf) -> Self {
        let limit = limit.max(2);
        Self {
            limit,
            head: Vec::new(),
            tail: VecDeque::new(),
            tail_cap: limit - limit / 2,
            bytes: 0,
            spill_path,
            spill: None,
            spill_error: None,
            shown_path: None,
            spill_cap: u64::MAX,
            spilled: 0,
            capped: false,
            scanner: None,
        }
    }

    /// Also reads the stream's findings as it arrives, with files located against `paths`.
    pub fn with_findings(mut self, paths: Paths) -> Self {
        self.scanner = Some(Reading::Pending(paths));
        self
    }

    /// Keeps the spill file to at most `cap` bytes: past it the rest of the stream is counted
    /// and its tail shown, but not kept.
    pub fn with_spill_cap(mut self, cap: u64) -> Self {
        self.spill_cap = cap;
        self
    }

    /// The spill file reached its cap, so the full stream was not kept.
    pub fn spill_capped(&self) -> bool {
        self.capped
    }

    /// Writes `data` to the spill file within its cap.
    fn spill_write(&mut self, data: &[u8]) {
        let Some(w) = self.spill.as_mut() else { return };
        let room = self.spill_cap.saturating_sub(self.spilled);
        let take = (data.len() as u64).min(room) as usize;
        let outcome = w.write_all(&data[..take]);
        self.spilled += take as u64;
        match outcome {
            Err(e) => {
                self.spill_error = Some(e);
                self.spill = None;
            }
            Ok(()) if take < data.len() => {
                let _ = w.flush();
                self.capped = true;
                self.spill_error = Some(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "it reached {} bytes, this stream's share of limits.disk",
                        self.spill_cap
                    ),
                ));
                self.spill = None;
            }
            Ok(()) => {}
        }
    }

    /// Total bytes seen so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds a chunk of the stream.
    pub fn push(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
        if let Some(s) = self.scanner.as_mut() {
            s.feed(data, self.bytes);
        }
        let mut rest = data;
        if self.spill.is_none() && self.spill_error.is_none() {
            if self.head.len() + data.len() <= self.limit {
                self.head.extend_from_slice(data);
                return;
            }
            // First overflow: everything so far goes to the spill file; the head keeps its half
            // (topped up from this chunk), the remainder starts the tail.
            match File::create(&self.spill_path) {
                Ok(f) => {
                    self.spill = Some(io::BufWriter::with_capacity(256 * 1024, f));
                    let head = std::mem::take(&mut self.head);
                    self.spill_write(&head);
                    self.head = head;
                }
                Err(e) => self.spill_error = Some(e),
            }
            let keep = self.limit / 2;
            if self.head.len() > keep {
                let moved = self.head.split_off(keep);
                self.push_tail(&moved);
            } else {
                let take = (keep - self.head.len()).min(data.len());
                self.head.extend_from_slice(&data[..take]);
                rest = &data[take..];
            }
        }
        self.spill_write(data);
        self.push_tail(rest);
    }

    fn push_tail(&mut self, data: &[u8]) {
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail
                .extend(data[data.len() - self.tail_cap..].iter().copied());
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(data.iter().copied());
    }

    /// Ends the capture: the observation, and the stream's findings when it read them
    /// ([`Capture::with_findings`]).
    pub fn finish_with_findings(mut self) -> (Output, Option<Findings>) {
        let found = self.scanner.take().map(Reading::finish);
        (self.finish(), found)
    }

    /// Ends the capture and renders the observation.
    pub fn finish(mut self) -> Output {
        let mut spill_ok = false;
        if let Some(mut w) = self.spill.take() {
            match w.flush() {
                Ok(()) => spill_ok = true,
                Err(e) => self.spill_error = Some(e),
            }
        }
        self.render(spill_ok)
    }

    /// Renders what was captured so far (the spill file may lag behind by a buffer).
    pub fn snapshot(&mut self) -> Output {
        let spill_ok = match self.spill.as_mut() {
            Some(w) => w.flush().is_ok(),
            None => false,
        };
        self.render(spill_ok)
    }

    fn render(&self, spill_ok: bool) -> Output {
        let truncated = self.bytes > self.head.len() as u64;
        if !truncated {
            return Output {
                text: String::from_utf8_lossy(&self.head).into_owned(),
                bytes: self.bytes,
                truncated: false,
                spill_path: None,
            };
        }
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let head = utf8_prefix(&self.head);
        let tail = utf8_suffix(&tail);
        let omitted = self.bytes - head.len() as u64 - tail.len() as u64;
        let where_ = if spill_ok {
            format!("full output in {}", self.shown_path())
        } else {
            match &self.spill_error {
                Some(e) => format!("the full output could not be kept: {e}"),
                None => "the full output was not kept".to_string(),
            }
        };
        let text = format!(
            "{}\n[... {omitted} bytes omitted; {where_} ...]\n{}",
            String::from_utf8_lossy(head),
            String::from_utf8_lossy(tail)
        );
        Output {
            text,
            bytes: self.bytes,
            truncated: true,
            spill_path: spill_ok.then(|| self.shown_path()),
        }
    }

    /// The spill file's name as the reader should see it.
    fn shown_path(&self) -> String {
        self.shown_path
            .as_ref()
            .unwrap_or(&self.spill_path)
            .display()
            .to_string()
    }

    /// Names the spill file differently in the observation (e.g. its path inside the sandbox).
    pub fn with_shown_path(mut self, path: PathBuf) -> Self {
        self.shown_path = Some(path);
        self
    }
}

/// The longest prefix that does not end inside a UTF-8 sequence (invalid bytes elsewhere are
/// left for lossy conversion).
fn utf8_prefix(b: &[u8]) -> &[u8] {
    match std::str::from_utf8(b) {
        Ok(_) => b,
        Err(e) if e.error_len().is_none() => &b[..e.valid_up_to()],
        Err(_) => b,
    }
}

/// The suffix that does not start inside a UTF-8 sequence (skips at most 3 continuation bytes).
fn utf8_suffix(b: &[u8]) -> &[u8] {
    let skip = b
        .iter()
        .take(3)
        .take_while(|&&c| (c & 0xC0) == 0x80)
        .count();
    &b[skip..]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Failures before the hand-off to the reading thread, across it (a line cut by it) and far
    /// past it are all found, in order, whatever the sizes of the chunks pushed.
    #[test]
    fn an_empty_stream_makes_no_readers_and_finds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = Capture::new(1000, dir.path().join("out")).with_findings(Paths::new("/w", "/w"));
        assert!(matches!(c.scanner, Some(Reading::Pending(_))));
        let (_, found) = c.finish_with_findings();
        let found = found.unwrap();
        assert!(found.findings.is_empty() && found.tests.is_none() && found.omitted == 0);
        // The same as the readers give for no bytes.
        let empty = Scanner::new(Paths::new("/w", "/w")).finish();
        assert_eq!(
            (empty.findings.len(), empty.tests, empty.omitted),
            (0, None, 0)
        );
    }

    #[test]
    fn findings_before_across_and_after_the_hand_off_are_all_read() {
        let fail = |n: u32| {
            format!(
                "test m::t{n} ... FAILED\n\nfailures:\n\n---- m::t{n} stdout ----\n\n\
                 thread 'm::t{n}' panicked at src/m.rs:{n}:5:\nboom\n\n"
            )
        };
        let mut log = String::new();
        log.push_str(&fail(1));
        while log.len() < INLINE_READ as usize - 40 {
            log.push_str("test m::ok ... ok\n");
        }
        log.push_str(&fail(2));
        while log.len() < 6 << 20 {
            log.push_str("test m::ok ... ok\n");
        }
        log.push_str(&fail(3));
        log.push_str("test result: FAILED. 1 passed; 3 failed; 0 ignored; 0 measured\n");
        for chunk in [7usize, 4093, 65536, 1 << 20] {
            let dir = tempfile::tempdir().unwrap();
            let mut c =
                Capture::new(1000, dir.path().join("out")).with_findings(Paths::new("/w", "/w"));
            for part in log.as_bytes().chunks(chunk) {
                c.push(part);
            }
            let (out, found) = c.finish_with_findings();
            assert_eq!(out.bytes, log.len() as u64);
            let found = found.unwrap();
            let lines: Vec<_> = found
                .findings
                .iter()
                .map(|f| f.location.as_ref().and_then(|l| l.line))
                .collect();
            assert_eq!(lines, [Some(1), Some(2), Some(3)], "chunks of {chunk}");
            assert_eq!(found.tests.map(|t| t.failed), Some(3));
        }
    }

    #[test]
    fn the_spill_file_stops_at_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut c = Capture::new(10, path.clone()).with_spill_cap(25);
        for _ in 0..10 {
            c.push(b"0123456789");
        }
        assert!(c.spill_capped());
        let out = c.finish();
        assert_eq!(out.bytes, 100);
        assert_eq!(std::fs::read(&path).unwrap().len(), 25);
        assert!(out.text.contains("limits.disk"), "{}", out.text);
        assert!(out.text.ends_with("56789"), "{}", out.text);
    }

    #[test]
    fn short_output_is_kept_whole_without_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut c = Capture::new(100, path.clone());
        c.push(b"hello ");
        c.push(b"world");
        let o = c.finish();
        assert_eq!(o.text, "hello world");
        assert_eq!(o.bytes, 11);
        assert!(!o.truncated);
        assert_eq!(o.spill_path, None);
        assert!(!path.exists());
    }

    #[test]
    fn long_output_keeps_head_and_tail_and_spills_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut c = Capture::new(20, path.clone());
        let mut all = Vec::new();
        for i in 0..1000u32 {
            let line = format!("line {i}\n");
            all.extend_from_slice(line.as_bytes());
            c.push(line.as_bytes());
        }
        let o = c.finish();
        assert!(o.truncated);
        assert_eq!(o.bytes, all.len() as u64);
        assert!(o.text.starts_with("line 0\nlin\n[..."), "{}", o.text);
        assert!(o.text.ends_with("\nline 999\n"), "{}", o.text);
        assert!(o.text.contains("bytes omitted"));
        assert_eq!(o.spill_path.as_deref(), Some(path.to_str().unwrap()));
        assert_eq!(std::fs::read(&path).unwrap(), all);
    }

    #[test]
    fn a_single_huge_chunk_is_split_correctly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut c = Capture::new(10, path.clone());
        let data: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        c.push(&data);
        let o = c.finish();
        assert_eq!(std::fs::read(&path).unwrap(), data);
        assert_eq!(o.bytes, 5000);
    }

    #[test]
    fn utf8_is_not_cut_inside_a_character() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Capture::new(8, dir.path().join("out"));
        c.push("ééééééééééé".as_bytes());
        let o = c.finish();
        assert!(!o.text.contains('\u{FFFD}'), "{}", o.text);
        assert!(o.text.starts_with("éé"));
        assert!(o.text.ends_with("éé"));
    }

    #[test]
    fn invalid_utf8_is_replaced_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Capture::new(100, dir.path().join("out"));
        c.push(&[0xff, 0xfe, b'a']);
        let o = c.finish();
        assert_eq!(o.bytes, 3);
        assert!(o.text.ends_with('a'));
    }
}
