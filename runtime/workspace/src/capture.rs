//! Bounded capture of one output stream: the head and tail within a byte limit stay in memory,
//! the whole stream goes to a spill file once it outgrows the limit.
//!
//! Memory use is at most `limit` bytes per stream whatever the command writes; the spill file is
//! created lazily, so a command with short output leaves no file behind. With
//! [`Capture::with_findings`], every byte of the stream also goes through the findings readers
//! as it arrives (docs/findings.md): the whole stream is read, even past the spill file's cap,
//! while the command still runs. The first [`INLINE_READ`] bytes are read in the capture's own
//! thread; a longer stream is read in a thread of its own, so a long log is read beside the
//! command's run, not in the way of its output. That thread reads what the spill file already
//! holds (the capture copies nothing for it, and tells it of the file's growth every 4 MiB;
//! a thread that has caught up also looks again on its own, soon after, so little is left to
//! read when the stream ends); past the file's cap, or without a file, the
//! capture hands it copies of the chunks. A stream that reaches the thread before its spill file
//! is made (an output limit of [`INLINE_READ`] or more) is handed copies until the file is made,
//! then read from the file.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

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
    spill: Option<Spill>,
    spill_error: Option<io::Error>,
    shown_path: Option<PathBuf>,
    /// Most bytes the spill file may hold (its share of `limits.disk` where it lives outside
    /// the sandbox's disk).
    spill_cap: u64,
    /// Bytes given to the spill file (written, or in its buffer).
    spilled: u64,
    /// Bytes written to the spill file: the stream's first `in_file` bytes are in it.
    in_file: u64,
    /// What a failed write of the spill file did not write (for the findings readers, who
    /// read the file up to `in_file` only).
    unwritten: Vec<u8>,
    capped: bool,
    /// The findings readers, reading the stream as it arrives.
    scanner: Option<Reading>,
}

/// The spill file and the small writes gathered for it.
#[derive(Debug)]
struct Spill {
    file: Arc<File>,
    buf: Vec<u8>,
}

impl Spill {
    /// Writes the buffer out (it keeps its bytes when that fails).
    fn write_buf(&mut self) -> io::Result<()> {
        spill_out(&self.file, &self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

/// Writes `data` to the spill file.
fn spill_out(file: &File, data: &[u8]) -> io::Result<()> {
    #[cfg(test)]
    tests::spill_budget(data.len())?;
    (&*file).write_all(data)
}

/// Bytes of small pushes gathered before they are written to the spill file; a push this
/// long is written as it comes, without a copy.
const SPILL_BUF: usize = 32 * 1024;

/// Bytes of a stream its findings readers read in the capture's thread; past them, in a thread
/// of their own.
pub const INLINE_READ: u64 = 1 << 20;
/// The size of the pieces the reading thread reads (from the spill file, or handed over).
const HANDOFF_CHUNK: usize = 256 * 1024;
/// How much the spill file gains before the readers' thread is told: each telling wakes a
/// thread that has caught up, and on two cores busy with `cat` of a 100 MB log and its
/// capture, telling every 256 KiB made the exec 1.07x as long with findings as without, every
/// 4 MiB 0.99x to 1.04x (0.955x of the exec told every 256 KiB, the two alternating; telling
/// every sixteenth of the stream so far, up to 4 MiB, 1.07x: BENCHMARKS.md, findings). What
/// the thread has not been told of, it finds when it looks again ([`POLL_FIRST`]).
const TELL_STEP: u64 = 4 << 20;
/// How soon a thread that has read all it was told of looks again at how far the capture has
/// written the spill file ([`Feed::grown`], which costs the capture no wake-up); doubled while
/// the file has not grown, up to [`POLL_LAST`]. Waiting for the next tell instead left up to
/// 4 MiB to read once a `cat` of a 100 MB `go test -v` log had ended (about 3 ms of its 90):
/// the exec took 1.05x to 1.12x as long with findings as without, and 0.99x to 1.03x looking
/// again every 250 us (0.95x to 0.97x of the exec that waited, the two alternating;
/// BENCHMARKS.md, findings).
const POLL_FIRST: Duration = Duration::from_micros(250);
/// The longest a thread that has caught up waits before it looks again (while a command writes
/// nothing for a while): 50 wake-ups a second.
const POLL_LAST: Duration = Duration::from_millis(20);
/// Chunks handed over and not yet read: when the thread falls behind, the capture waits (the
/// memory a stream's reading holds is bounded by these; what it reads from the spill file
/// costs none).
const HANDOFF_DEPTH: usize = 8;
/// How much lower the readers' thread runs than the capture (nice values, up to 19): the
/// command and the capture get a core whenever they wake, and the readers the time between.
/// At the same priority, on two cores busy with `cat` of a 100 MB log and its capture, the
/// readers delayed both at every wake-up and made the exec 1.34x as long as without them;
/// 10 lower, 0.98x (BENCHMARKS.md, findings; docs/decisions.md).
const READERS_NICE: libc::c_int = 10;

/// Lowers the calling thread's priority by [`READERS_NICE`]; gives the nice value it had.
fn lower_priority() -> Option<libc::c_int> {
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    nix::errno::Errno::clear();
    // SAFETY: getpriority and setpriority touch no memory; a thread's id names the thread.
    let was = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    if was == -1 && nix::errno::Errno::last_raw() != 0 {
        return None;
    }
    let lower = (was + READERS_NICE).min(19);
    // SAFETY: as above.
    (unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, lower) } == 0).then_some(was)
}

/// Gives the calling thread back the nice value `was` (allowed where the process may raise a
/// priority, as a supervisor run by root may; elsewhere it stays lower).
fn restore_priority(was: libc::c_int) {
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    // SAFETY: as above.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, was) };
}

/// Where a stream's findings are read.
#[derive(Debug)]
enum Reading {
    /// Nothing arrived yet: the readers are made with the first bytes (a stream that stays
    /// empty never makes them).
    Pending(Paths),
    Inline(Box<Scanner>),
    /// Only while the readers move to their thread.
    Moving,
    Thread(Box<ReadingThread>),
}

/// The readers in a thread of their own.
#[derive(Debug)]
struct ReadingThread {
    feed: Arc<Feed>,
    /// Reading the spill file: up to where the thread was last told it has bytes.
    /// `None`: reading copies handed over.
    told: Option<u64>,
    /// Bytes of the stream handed over as copies.
    copied: u64,
    /// Times the thread was told the file holds more (each may wake it).
    tells: u64,
    /// Bytes gathered for the next chunk handed over.
    batch: Vec<u8>,
    /// Taken when the readers' findings are: a capture dropped without them stops the thread.
    done: Option<std::thread::JoinHandle<Findings>>,
}

impl Drop for ReadingThread {
    fn drop(&mut self) {
        if self.done.is_some() {
            let mut st = self.feed.lock();
            st.dropped = true;
            drop(st);
            self.feed.cond.notify_all();
        }
    }
}

/// What the capture gives its reading thread: the stream in order, as stretches of the spill
/// file and chunks handed over.
#[derive(Debug, Default)]
struct Feed {
    state: Mutex<FeedState>,
    cond: Condvar,
    /// How far the spill file holds the stream, as the capture last wrote it (while its
    /// readers read the file): the last part, a stretch of the file, reaches at least this far.
    /// The thread looks at it whenever it has caught up, without being told.
    grown: AtomicU64,
}

/// A stretch of the stream for the reading thread.
#[derive(Debug)]
enum Part {
    /// The stream is in the spill file from where the thread is up to this byte (the last part
    /// grows as the file does).
    File(u64),
    /// Bytes handed over.
    Chunk(Vec<u8>),
}

#[derive(Debug, Default)]
struct FeedState {
    /// The spill file, once there is one: it holds the stream from its first byte.
    file: Option<Arc<File>>,
    /// The stream after what the thread has read, in order.
    parts: VecDeque<Part>,
    /// Chunks among the parts.
    chunks: usize,
    /// Chunks read, for reuse.
    spare: Vec<Vec<u8>>,
    /// The stream has ended.
    ended: bool,
    /// The capture went without asking for the findings: the thread stops.
    dropped: bool,
    /// The thread has ended (it can only have panicked before the stream's end): what is
    /// handed over is dropped, not waited on.
    gone: bool,
    /// The reading thread's id, once it runs.
    tid: Option<libc::pid_t>,
    /// How far the thread has read the stream (for a test).
    #[cfg(test)]
    reached: u64,
}

impl Feed {
    fn lock(&self) -> MutexGuard<'_, FeedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The spill file is `file`, which holds the stream up to `end`.
    fn file_made(&self, file: &Arc<File>, end: u64) {
        self.lock().file.get_or_insert_with(|| file.clone());
        self.file_holds(end);
    }

    /// The spill file holds the stream up to `end`: what follows the parts before is read from
    /// it.
    fn file_holds(&self, end: u64) {
        let mut st = self.lock();
        match st.parts.back_mut() {
            Some(Part::File(e)) => *e = (*e).max(end),
            _ => st.parts.push_back(Part::File(end)),
        }
        drop(st);
        self.cond.notify_all();
    }

    /// Hands over a chunk (after the parts before), waiting while [`HANDOFF_DEPTH`] are unread.
    fn hand(&self, mut chunk: Vec<u8>) -> Vec<u8> {
        let mut st = self.lock();
        while st.chunks >= HANDOFF_DEPTH && !st.gone {
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.gone {
            chunk.clear();
            return chunk;
        }
        st.chunks += 1;
        st.parts.push_back(Part::Chunk(chunk));
        let next = st.spare.pop();
        drop(st);
        self.cond.notify_all();
        next.unwrap_or_else(|| Vec::with_capacity(HANDOFF_CHUNK * 2))
    }

    fn end(&self) {
        let mut st = self.lock();
        st.ended = true;
        drop(st);
        self.cond.notify_all();
    }
}

/// Marks the feed's thread gone when it ends, however it ends.
struct Gone(Arc<Feed>);

impl Drop for Gone {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.gone = true;
        drop(st);
        self.0.cond.notify_all();
    }
}

impl Reading {
    /// The readers in a thread of their own (still inline when none can be started), reading
    /// on from byte `from` of the stream: from the spill file `file` while it has them.
    fn hand_off(scanner: Box<Scanner>, from: u64, file: Option<(Arc<File>, u64)>) -> Reading {
        let told = file.as_ref().map(|(_, end)| *end);
        let feed = Arc::new(Feed::default());
        if let Some((f, end)) = &file {
            feed.file_made(f, *end);
        }
        // The readers go over once the thread runs: a thread that cannot start leaves them here.
        let (give, take) = std::sync::mpsc::channel::<Box<Scanner>>();
        let theirs = feed.clone();
        let spawned = std::thread::Builder::new()
            .name("findings".into())
            .spawn(move || {
                let gone = Gone(theirs);
                gone.0.lock().tid = Some(nix::unistd::gettid().as_raw());
                let Ok(s) = take.recv() else {
                    return Findings::default();
                };
                read_feed(s, &gone.0, from)
            });
        match spawned {
            Ok(done) => match give.send(scanner) {
                Ok(()) => Reading::Thread(Box::new(ReadingThread {
                    feed,
                    told,
                    copied: 0,
                    tells: 0,
                    batch: Vec::with_capacity(HANDOFF_CHUNK * 2),
                    done: Some(done),
                })),
                Err(std::sync::mpsc::SendError(scanner)) => Reading::Inline(scanner),
            },
            Err(_) => Reading::Inline(scanner),
        }
    }

    /// Hands `data` over to the thread (in chunks of [`HANDOFF_CHUNK`]).
    fn hand(t: &mut ReadingThread, data: &[u8]) {
        t.copied += data.len() as u64;
        t.batch.extend_from_slice(data);
        if t.batch.len() >= HANDOFF_CHUNK {
            let full = std::mem::take(&mut t.batch);
            t.batch = t.feed.hand(full);
        }
    }

    /// What the readers found; `file_end`: the spill file's bytes, all of them written.
    fn finish(self, file_end: u64) -> Findings {
        match self {
            Reading::Inline(s) => s.finish(),
            // The readers find nothing in no bytes.
            Reading::Pending(_) => Findings::default(),
            Reading::Moving => Findings::default(),
            Reading::Thread(mut t) => {
                if t.told.is_some() {
                    t.feed.file_holds(file_end);
                }
                let batch = std::mem::take(&mut t.batch);
                if !batch.is_empty() {
                    t.feed.hand(batch);
                }
                t.feed.end();
                t.done
                    .take()
                    .and_then(|d| d.join().ok())
                    .unwrap_or_default()
            }
        }
    }
}

/// The reading thread: the stream from byte `pos`, its parts in order (a stretch of the spill
/// file is read from it as far as the capture says it holds the stream). It reads at a lower
/// priority until the stream has ended, then at its own where it may (what is left is all that
/// keeps the exec's answer).
fn read_feed(mut s: Box<Scanner>, feed: &Feed, mut pos: u64) -> Findings {
    enum Next {
        File(u64, Option<Arc<File>>),
        Chunk(Vec<u8>),
        End,
    }
    let mut buf = vec![0u8; HANDOFF_CHUNK];
    let mut lowered = lower_priority();
    let mut poll = POLL_FIRST;
    loop {
        let next = {
            let mut st = feed.lock();
            #[cfg(test)]
            {
                st.reached = pos;
            }
            loop {
                if st.dropped {
                    return Findings::default();
                }
                if st.ended
                    && let Some(was) = lowered.take()
                {
                    restore_priority(was);
                }
                let last = st.parts.len() == 1;
                match st.parts.front() {
                    Some(Part::File(told)) => {
                        // The last part reaches as far as the file has grown, told or not.
                        let end = if last {
                            (*told).max(feed.grown.load(Ordering::Acquire))
                        } else {
                            *told
                        };
                        if end > pos {
                            break Next::File(end, st.file.clone());
                        }
                        // A stretch read to its end, with more after it.
                        if !last {
                            st.parts.pop_front();
                            continue;
                        }
                    }
                    Some(Part::Chunk(_)) => {
                        if let Some(Part::Chunk(c)) = st.parts.pop_front() {
                            st.chunks -= 1;
                            break Next::Chunk(c);
                        }
                    }
                    None => {}
                }
                if st.ended {
                    break Next::End;
                }
                st = feed
                    .cond
                    .wait_timeout(st, poll)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                poll = (poll * 2).min(POLL_LAST);
            }
        };
        poll = POLL_FIRST;
        match next {
            Next::File(end, file) => {
                let want = (end - pos).min(HANDOFF_CHUNK as u64) as usize;
                match file.as_ref().map(|f| f.read_at(&mut buf[..want], pos)) {
                    Some(Ok(n)) if n > 0 => {
                        s.feed(&buf[..n]);
                        pos += n as u64;
                    }
                    // The file is shorter than what was written to it (cut from outside) or
                    // cannot be read: those bytes are not read, the rest of the stream is.
                    _ => pos += want as u64,
                }
            }
            Next::Chunk(mut c) => {
                s.feed(&c);
                pos += c.len() as u64;
                c.clear();
                let mut st = feed.lock();
                if st.spare.len() < 2 {
                    st.spare.push(c);
                }
                drop(st);
                // The capture may wait for room.
                feed.cond.notify_all();
            }
            Next::End => return s.finish(),
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
            in_file: 0,
            unwritten: Vec::new(),
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

    /// Writes `data` to the spill file within its cap (small pieces gathered first).
    fn spill_write(&mut self, data: &[u8]) {
        let Some(sp) = self.spill.as_mut() else {
            return;
        };
        let room = self.spill_cap.saturating_sub(self.spilled);
        let take = (data.len() as u64).min(room) as usize;
        let part = &data[..take];
        let capped = take < data.len();
        self.spilled += take as u64;
        let written = if take >= SPILL_BUF {
            // As it comes, after what the buffer holds (kept there when it cannot be written).
            sp.write_buf()
                .and_then(|()| spill_out(&sp.file, part))
                .inspect_err(|_| sp.buf.extend_from_slice(part))
        } else {
            sp.buf.extend_from_slice(part);
            if capped || sp.buf.len() >= SPILL_BUF {
                sp.write_buf()
            } else {
                Ok(())
            }
        };
        match written {
            Err(e) => self.spill_failed(e),
            Ok(()) => {
                self.in_file = self.spilled - sp.buf.len() as u64;
                if capped {
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
            }
        }
    }

    /// The spill file could not be written: the bytes after those it holds (its buffer's) are
    /// kept for the readers, who read the file only that far.
    fn spill_failed(&mut self, e: io::Error) {
        if let Some(sp) = self.spill.take() {
            self.in_file = self.spilled - sp.buf.len() as u64;
            if matches!(&self.scanner, Some(Reading::Thread(t)) if t.told.is_some()) {
                self.unwritten = sp.buf;
            }
        }
        self.spill_error = Some(e);
    }

    /// Writes out the spill file's buffer; whether the file holds all it was given.
    fn spill_flush(&mut self) -> bool {
        let Some(sp) = self.spill.as_mut() else {
            return false;
        };
        match sp.write_buf() {
            Ok(()) => {
                self.in_file = self.spilled;
                true
            }
            Err(e) => {
                self.spill_failed(e);
                false
            }
        }
    }

    /// Total bytes seen so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds a chunk of the stream.
    pub fn push(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
        self.keep(data);
        self.read_findings(data);
    }

    /// The head, the tail and the spill file.
    fn keep(&mut self, data: &[u8]) {
        let mut rest = data;
        if self.spill.is_none() && self.spill_error.is_none() {
            if self.head.len() + data.len() <= self.limit {
                self.head.extend_from_slice(data);
                return;
            }
            // First overflow: everything so far goes to the spill file; the head keeps its half
            // (topped up from this chunk), the remainder starts the tail.
            // Readable too: the findings readers read it.
            let made = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&self.spill_path);
            match made {
                Ok(f) => {
                    self.spill = Some(Spill {
                        file: Arc::new(f),
                        buf: Vec::with_capacity(SPILL_BUF),
                    });
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

    /// The stream's bytes after the spill file's, once it has stopped (at its cap, or when it
    /// failed), `data` the last push: what the file was given and could not write, then what
    /// it was not given.
    fn after_file(&mut self, data: &[u8]) -> Vec<u8> {
        let beyond = (self.bytes - self.spilled) as usize;
        let mut out = std::mem::take(&mut self.unwritten);
        out.extend_from_slice(&data[data.len().saturating_sub(beyond)..]);
        out
    }

    /// Whether the readers read the spill file, which has stopped: the rest of the stream is
    /// to be handed over.
    fn file_stopped(&self) -> bool {
        self.spill.is_none()
            && matches!(&self.scanner, Some(Reading::Thread(t)) if t.told.is_some())
    }

    /// `data`, just kept, to the findings readers.
    fn read_findings(&mut self, data: &[u8]) {
        let rest = self.file_stopped().then(|| self.after_file(data));
        let Some(reading) = self.scanner.as_mut() else {
            return;
        };
        if let Reading::Pending(paths) = reading {
            *reading = Reading::Inline(Box::new(Scanner::new(paths.clone())));
        }
        if let Reading::Inline(s) = reading {
            s.feed(data);
            if self.bytes >= INLINE_READ
                && let Reading::Inline(s) = std::mem::replace(reading, Reading::Moving)
            {
                let file = self
                    .spill
                    .as_ref()
                    .map(|sp| (sp.file.clone(), self.in_file));
                *reading = Reading::hand_off(s, self.bytes, file);
            }
            return;
        }
        let Reading::Thread(t) = reading else { return };
        match (t.told, rest, self.spill.as_ref()) {
            (_, Some(rest), _) => {
                // The file has stopped: what follows its bytes is handed over.
                t.feed.file_holds(self.in_file);
                t.told = None;
                Reading::hand(t, &rest);
            }
            (Some(told), None, _) => {
                t.feed.grown.store(self.in_file, Ordering::Release);
                if self.in_file >= told + TELL_STEP {
                    t.tells += 1;
                    t.feed.file_holds(self.in_file);
                    t.told = Some(self.in_file);
                }
            }
            // The spill file was made after the readers moved (it holds the stream from its
            // first byte): the thread reads it after the copies it was handed, and what is
            // gathered for the next copy is in it.
            (None, None, Some(sp)) => {
                t.batch.clear();
                t.feed.file_made(&sp.file, self.in_file);
                t.told = Some(self.in_file);
            }
            (None, None, _) => Reading::hand(t, data),
        }
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
        let spill_ok = self.spill_flush();
        if self.file_stopped() {
            // The last write failed: its bytes are handed over.
            self.read_findings(&[]);
        }
        let in_file = self.in_file;
        let found = self.scanner.take().map(|r| r.finish(in_file));
        (self.render(spill_ok), found)
    }

    /// Ends the capture and renders the observation.
    pub fn finish(mut self) -> Output {
        let spill_ok = self.spill_flush();
        self.render(spill_ok)
    }

    /// Renders what was captured so far.
    pub fn snapshot(&mut self) -> Output {
        let spill_ok = self.spill_flush();
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

    thread_local! {
        /// Bytes this thread's spill files may still take before a write fails (none: no end).
        static SPILL_BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    /// A write of `n` bytes to a spill file: fails once the thread's budget is spent.
    pub(super) fn spill_budget(n: usize) -> io::Result<()> {
        SPILL_BUDGET.with(|b| match b.get() {
            Some(left) if n > left => Err(io::Error::other("the test's budget of spill bytes")),
            Some(left) => {
                b.set(Some(left - n));
                Ok(())
            }
            None => Ok(()),
        })
    }

    /// A `cargo test` log of about `len` bytes with failing tests 1 to 4 at (about) the
    /// fractions `at` of it.
    fn log_with_failures(len: usize, at: [f64; 4]) -> String {
        let fail = |n: usize| {
            format!(
                "test m::t{n} ... FAILED\n\nfailures:\n\n---- m::t{n} stdout ----\n\n\
                 thread 'm::t{n}' panicked at src/m.rs:{n}:5:\nboom\n\n"
            )
        };
        let mut log = String::new();
        for (i, f) in at.iter().enumerate() {
            while log.len() < (len as f64 * f) as usize {
                log.push_str("test m::ok ... ok\n");
            }
            log.push_str(&fail(i + 1));
        }
        log.push_str("test result: FAILED. 1 passed; 4 failed; 0 ignored; 0 measured\n");
        log
    }

    /// Pushes `log` to `c` in chunks of `chunk` bytes and ends it.
    fn capture_log(mut c: Capture, log: &str, chunk: usize) -> (Output, Findings) {
        for part in log.as_bytes().chunks(chunk) {
            c.push(part);
        }
        let (out, found) = c.finish_with_findings();
        (out, found.unwrap())
    }

    fn failed_lines(found: &Findings) -> Vec<Option<u32>> {
        found
            .findings
            .iter()
            .map(|f| f.location.as_ref().and_then(|l| l.line))
            .collect()
    }

    /// The readers read the spill file up to its cap, then the copies handed over: failures
    /// before the hand-off, in the file, across the cap and past it are all found.
    #[test]
    fn findings_past_the_spill_files_cap_are_read_from_copies() {
        let log = log_with_failures(4 << 20, [0.01, 0.4, 0.6, 0.9]);
        // The cap falls inside the third failure's report.
        let cap = log.find("thread 'm::t3'").unwrap() as u64;
        for chunk in [7usize, 4093, 65536, 1 << 20] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("out");
            let mut c = Capture::new(1000, path.clone())
                .with_spill_cap(cap)
                .with_findings(Paths::new("/w", "/w"));
            for part in log.as_bytes().chunks(chunk) {
                c.push(part);
            }
            assert!(c.spill_capped());
            let (out, found) = c.finish_with_findings();
            let found = found.unwrap();
            assert_eq!(out.bytes, log.len() as u64);
            assert_eq!(std::fs::read(&path).unwrap().len() as u64, cap);
            assert_eq!(
                failed_lines(&found),
                [Some(1), Some(2), Some(3), Some(4)],
                "chunks of {chunk}"
            );
            assert_eq!(found.tests.map(|t| t.failed), Some(4));
        }
    }

    /// An output limit of [`INLINE_READ`] or more: the readers move to their thread before the
    /// spill file is made, are handed copies until it is, then read the file. Nothing is
    /// missed or read twice, and past the limit nothing more is copied.
    #[test]
    fn readers_that_move_before_the_spill_file_is_made_read_it_once_it_is() {
        let log = log_with_failures(6 << 20, [0.05, 0.3, 0.55, 0.9]);
        let mb = INLINE_READ as usize;
        for (limit, chunk) in [
            (mb, 65536usize),
            (mb, 4093),
            (mb + 100, 65536),
            (3 * mb, 65536),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("out");
            let mut c = Capture::new(limit, path.clone()).with_findings(Paths::new("/w", "/w"));
            for part in log.as_bytes().chunks(chunk) {
                c.push(part);
            }
            let t = their_thread(&c);
            assert!(
                t.told.is_some(),
                "limit {limit}, chunks of {chunk}: the readers do not read the file"
            );
            let most = (limit as u64 + chunk as u64).saturating_sub(INLINE_READ);
            assert!(
                t.copied <= most,
                "limit {limit}, chunks of {chunk}: {} bytes copied, at most {most} expected",
                t.copied
            );
            let (out, found) = c.finish_with_findings();
            let found = found.unwrap();
            assert_eq!(out.bytes, log.len() as u64);
            assert_eq!(std::fs::read(&path).unwrap().len(), log.len());
            assert_eq!(
                failed_lines(&found),
                [Some(1), Some(2), Some(3), Some(4)],
                "limit {limit}, chunks of {chunk}"
            );
            assert_eq!(found.tests.map(|t| t.failed), Some(4));
        }
    }

    /// The readers' thread is told the spill file grew once per [`TELL_STEP`], not per push,
    /// and what it was not told of by the stream's end is read then: nothing is missed.
    #[test]
    fn the_readers_are_woken_once_per_tell_step() {
        let log = log_with_failures(40 << 20, [0.01, 0.5, 0.97, 0.9999]);
        let dir = tempfile::tempdir().unwrap();
        let mut c =
            Capture::new(1000, dir.path().join("out")).with_findings(Paths::new("/w", "/w"));
        for part in log.as_bytes().chunks(65536) {
            c.push(part);
        }
        let t = their_thread(&c);
        let most = (log.len() as u64).div_ceil(TELL_STEP);
        assert!(
            t.tells <= most && t.tells >= most / 2,
            "told {} times for {} bytes (at most {most} expected)",
            t.tells,
            log.len()
        );
        let (_, found) = c.finish_with_findings();
        assert_eq!(
            failed_lines(&found.unwrap()),
            [Some(1), Some(2), Some(3), Some(4)]
        );
    }

    /// A thread that has caught up finds what the file gained though it was not told of it
    /// (less than [`TELL_STEP`]), before the stream ends.
    #[test]
    fn the_readers_follow_the_file_between_tells() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, feed) = read_in_their_thread(dir.path());
        let t = their_thread(&c);
        let tells = t.tells;
        let line = b"test m::ok ... ok\n".repeat(4096);
        for _ in 0..8 {
            c.push(&line);
        }
        let t = their_thread(&c);
        assert_eq!(t.tells, tells, "told of less than a step");
        let end = c.bytes();
        let t0 = std::time::Instant::now();
        while feed.lock().reached < end {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the thread read to {} of {end} bytes and waits to be told",
                feed.lock().reached
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        c.push(b"test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured\n");
        let (_, found) = c.finish_with_findings();
        assert_eq!(found.unwrap().tests.map(|t| t.failed), Some(1));
    }

    /// A spill file whose writes fail (its disk full) on the way: the bytes it was given and
    /// did not write reach the readers as copies, and nothing is found twice or missed.
    #[test]
    fn findings_survive_a_spill_file_that_fails() {
        let log = log_with_failures(4 << 20, [0.01, 0.4, 0.6, 0.9]);
        for (budget, chunk) in [
            (2 << 20, 65536usize),
            (2 << 20, 7),
            ((2 << 20) + 12345, 4093),
            (100, 65536),
            (0, 1 << 20),
            (log.len() - 10, 65536),
        ] {
            let dir = tempfile::tempdir().unwrap();
            SPILL_BUDGET.with(|b| b.set(Some(budget)));
            let c =
                Capture::new(1000, dir.path().join("out")).with_findings(Paths::new("/w", "/w"));
            let (out, found) = capture_log(c, &log, chunk);
            SPILL_BUDGET.with(|b| b.set(None));
            assert!(out.text.contains("could not be kept"), "{}", out.text);
            assert_eq!(
                failed_lines(&found),
                [Some(1), Some(2), Some(3), Some(4)],
                "budget {budget}, chunks of {chunk}"
            );
            assert_eq!(found.tests.map(|t| t.failed), Some(4));
        }
    }

    /// Without a spill file (it cannot be made), the readers' thread reads copies.
    #[test]
    fn findings_are_read_without_a_spill_file() {
        let log = log_with_failures(4 << 20, [0.01, 0.3, 0.6, 0.9]);
        let dir = tempfile::tempdir().unwrap();
        let c = Capture::new(1000, dir.path().join("missing/out"))
            .with_findings(Paths::new("/w", "/w"));
        let (_, found) = capture_log(c, &log, 65536);
        assert_eq!(failed_lines(&found), [Some(1), Some(2), Some(3), Some(4)]);
    }

    /// A spill file cut short from outside while it is read: the readers skip what is gone,
    /// read the rest, and end.
    #[test]
    fn a_spill_file_cut_from_outside_ends_its_reading() {
        let log = log_with_failures(4 << 20, [0.01, 0.6, 0.7, 0.99]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut c = Capture::new(1000, path.clone()).with_findings(Paths::new("/w", "/w"));
        let bytes = log.as_bytes();
        let half = bytes.len() / 2;
        for part in bytes[..half].chunks(65536) {
            c.push(part);
        }
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        for part in bytes[half..].chunks(65536) {
            c.push(part);
        }
        let t0 = std::time::Instant::now();
        let (out, found) = c.finish_with_findings();
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(out.bytes, log.len() as u64);
        // The first failure was read before the hand-off; what the cut left is read or skipped.
        assert_eq!(failed_lines(&found.unwrap()).first(), Some(&Some(1)));
    }

    /// The readers' thread of `c`, which they must have moved to.
    fn their_thread(c: &Capture) -> &ReadingThread {
        match c.scanner.as_ref() {
            Some(Reading::Thread(t)) => t,
            _ => panic!("the readers did not move to their thread"),
        }
    }

    /// A capture in `dir` whose readers have moved to their thread (2 MiB of passing tests
    /// pushed), and the thread's feed.
    fn read_in_their_thread(dir: &std::path::Path) -> (Capture, Arc<Feed>) {
        let mut c = Capture::new(1000, dir.join("out")).with_findings(Paths::new("/w", "/w"));
        let line = b"test m::ok ... ok\n".repeat(4096);
        while c.bytes() < 2 * INLINE_READ {
            c.push(&line);
        }
        let t = their_thread(&c);
        let feed = t.feed.clone();
        (c, feed)
    }

    /// A capture dropped without its findings stops its readers' thread (it would otherwise
    /// wait for the rest of the stream for ever, holding the spill file open).
    #[test]
    fn a_capture_dropped_without_its_findings_stops_its_reading() {
        let dir = tempfile::tempdir().unwrap();
        let (c, feed) = read_in_their_thread(dir.path());
        drop(c.finish());
        let t0 = std::time::Instant::now();
        while !feed.lock().gone {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the thread still runs"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A thread's nice value, from /proc.
    fn nice_of(tid: libc::pid_t) -> i64 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        // Fields from the third (state) on: nice is the 19th field of the line.
        after.split(' ').nth(16).unwrap().parse().unwrap()
    }

    /// The readers' thread reads at a lower priority than the capture's while the stream runs,
    /// so the command and the capture get a core whenever they wake.
    #[test]
    fn the_readers_thread_reads_at_a_lower_priority() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, feed) = read_in_their_thread(dir.path());
        let t0 = std::time::Instant::now();
        let tid = loop {
            if let Some(tid) = feed.lock().tid {
                break tid;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let own = nice_of(nix::unistd::gettid().as_raw());
        let want = (own + i64::from(READERS_NICE)).min(19);
        // The thread lowers itself as it starts reading.
        while nice_of(tid) != want {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the readers' thread runs at nice {}, not {want}",
                nice_of(tid)
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        c.push(b"test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured\n");
        let (_, found) = c.finish_with_findings();
        assert_eq!(found.unwrap().tests.map(|t| t.failed), Some(1));
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
