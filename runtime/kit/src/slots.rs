//! The execs of a sandbox: one slot per exec, from its start until its result is read, with its
//! output so far, its standard input when it is a background exec, and what the backend keeps
//! of the process (`P`). Waiting, writing to stdin and reading a background process's state are
//! the same on every backend; only signalling it is the backend's ([`crate::Handle::signal`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::api::{ApiError, ProcessInfo};
use crate::capture::Capture;
use crate::layers::SPILL_MOUNT;
use crate::lock;
use crate::result::ExecResult;
use taskbox_findings::{Findings, Paths};

/// A sandbox keeps the spill files of at most this many of its latest ended execs...
pub const SPILL_KEEP_EXECS: usize = 16;
/// ...and of at most this many bytes (the latest ended exec's are kept whatever their size):
/// they live on the sandbox's disk quota, which the workspace needs.
pub const SPILL_KEEP_BYTES: u64 = 1 << 30;

/// What a backend keeps of an exec's process in its slot.
pub trait ProcState: Send + 'static {
    /// The process has ended (the backend learned it before the result was built).
    fn exited(&self) -> bool {
        false
    }
}

/// Where a background exec's standard input goes.
pub trait StdinSink: Send {
    fn write(&mut self, data: &[u8]) -> std::io::Result<()>;
    /// Closes the stream (dropping the sink must close it too).
    fn close(self: Box<Self>) {}
}

impl StdinSink for std::fs::File {
    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        std::io::Write::write_all(self, data)
    }
}

/// An exec's two streams once it ended, and their findings (when they were read).
#[derive(Debug, Default)]
pub struct Captured {
    pub stdout: crate::result::Output,
    pub stderr: crate::result::Output,
    pub findings: Option<Findings>,
}

/// An exec's state, under its slot's lock.
pub struct SlotState<P> {
    pub stdout: Option<Capture>,
    pub stderr: Option<Capture>,
    pub result: Option<ExecResult>,
    /// Why the exec has no result (its sandbox was lost or destroyed, or its driver failed).
    pub error: Option<String>,
    pub stdin: Option<Box<dyn StdinSink>>,
    pub proc: P,
}

impl<P: ProcState> SlotState<P> {
    /// The exec has its result, or never will.
    pub fn finished(&self) -> bool {
        self.result.is_some() || self.error.is_some()
    }

    /// Nothing of the exec runs any more.
    pub fn settled(&self) -> bool {
        self.finished() || self.proc.exited()
    }
}

/// One exec.
pub struct ExecSlot<P> {
    pub id: u64,
    pub argv: Vec<String>,
    /// Where its findings' files are located (its working directory and the workspace, inside
    /// the sandbox); `None` when findings are not read.
    pub findings: Option<Paths>,
    /// The directory of its spill files.
    spill: PathBuf,
    state: Mutex<SlotState<P>>,
    cond: Condvar,
}

impl<P: ProcState> ExecSlot<P> {
    /// A slot for exec `id` whose output is kept up to `limit` bytes a stream, spilling to
    /// `spill/ID.stdout` and `spill/ID.stderr` (shown under [`SPILL_MOUNT`]), and read for
    /// findings as it arrives when `findings` says where their files are
    /// ([`crate::findings::paths`]).
    pub fn new(
        id: u64,
        argv: Vec<String>,
        findings: Option<Paths>,
        limit: usize,
        spill: &Path,
        stdin: Option<Box<dyn StdinSink>>,
        proc: P,
    ) -> ExecSlot<P> {
        let capture = |stream: &str| {
            let name = format!("{id}.{stream}");
            let c = Capture::new(limit, spill.join(&name))
                .with_shown_path(Path::new(SPILL_MOUNT).join(name));
            match &findings {
                Some(paths) => c.with_findings(paths.clone()),
                None => c,
            }
        };
        let (stdout, stderr) = (capture("stdout"), capture("stderr"));
        ExecSlot {
            id,
            argv,
            findings,
            spill: spill.to_path_buf(),
            state: Mutex::new(SlotState {
                stdout: Some(stdout),
                stderr: Some(stderr),
                result: None,
                error: None,
                stdin,
                proc,
            }),
            cond: Condvar::new(),
        }
    }

    pub fn state(&self) -> MutexGuard<'_, SlotState<P>> {
        lock(&self.state)
    }

    /// Changes the state and wakes whoever waits on it.
    pub fn update(&self, change: impl FnOnce(&mut SlotState<P>)) {
        change(&mut self.state());
        self.cond.notify_all();
    }

    /// Appends output to stdout (or stderr).
    pub fn push(&self, stdout: bool, data: &[u8]) {
        let mut st = self.state();
        let cap = if stdout {
            &mut st.stdout
        } else {
            &mut st.stderr
        };
        if let Some(c) = cap.as_mut() {
            c.push(data);
        }
    }

    /// Takes the captured streams once the exec has ended, and what their readers found.
    pub fn take_output(&self) -> Captured {
        let mut st = self.state();
        let (stdout, out_found) = st
            .stdout
            .take()
            .map(Capture::finish_with_findings)
            .unwrap_or_default();
        let (stderr, err_found) = st
            .stderr
            .take()
            .map(Capture::finish_with_findings)
            .unwrap_or_default();
        let findings = crate::findings::both(out_found, err_found);
        Captured {
            stdout,
            stderr,
            findings,
        }
    }

    /// Keeps a background exec's result (or why it has none) and closes its stdin.
    pub fn finish(&self, outcome: Result<ExecResult, ApiError>) {
        self.update(|st| {
            match outcome {
                Ok(r) => st.result = Some(r),
                Err(e) => st.error = Some(e.to_string()),
            }
            st.stdin = None;
        });
    }

    /// Waits until `done` holds of the state or `deadline` passes; returns the state.
    pub fn wait_until(
        &self,
        deadline: Instant,
        done: impl Fn(&SlotState<P>) -> bool,
    ) -> MutexGuard<'_, SlotState<P>> {
        let mut st = self.state();
        while !done(&st) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = match self.cond.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        st
    }

    /// The process's state and output so far.
    pub fn info(&self) -> ProcessInfo {
        let mut st = self.state();
        let stdout = st.stdout.as_mut().map(Capture::snapshot);
        let stderr = st.stderr.as_mut().map(Capture::snapshot);
        let result = st.result.clone();
        ProcessInfo {
            exec_id: self.id,
            argv: self.argv.clone(),
            running: !st.finished(),
            stdout: stdout
                .or_else(|| result.as_ref().map(|r| r.stdout.clone()))
                .unwrap_or_default(),
            stderr: stderr
                .or_else(|| result.as_ref().map(|r| r.stderr.clone()))
                .unwrap_or_default(),
            result,
        }
    }

    /// Waits until the process ends or `timeout` passes.
    pub fn wait(&self, timeout: Duration) -> ProcessInfo {
        drop(self.wait_until(Instant::now() + timeout, SlotState::finished));
        self.info()
    }

    /// Writes to the process's stdin; `close` closes it afterwards.
    pub fn write_stdin(&self, data: &[u8], close: bool) -> Result<(), ApiError> {
        let mut st = self.state();
        let Some(sink) = st.stdin.as_mut() else {
            return Err(ApiError::Conflict(format!(
                "process {} has no open stdin (it ended, was started with stdin text, or stdin \
                 was closed)",
                self.id
            )));
        };
        if !data.is_empty()
            && let Err(e) = sink.write(data)
        {
            st.stdin = None;
            return Err(ApiError::Conflict(format!(
                "cannot write to process {}: {e}",
                self.id
            )));
        }
        if close && let Some(sink) = st.stdin.take() {
            sink.close();
        }
        Ok(())
    }
}

/// Removes the spill files in `dir` of ended execs (those not `running`) beyond the latest
/// [`SPILL_KEEP_EXECS`], and the oldest while they hold more than [`SPILL_KEEP_BYTES`].
fn prune_spill(dir: &Path, running: &[u64]) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    // Exec id -> its files and their bytes.
    let mut ended: BTreeMap<u64, (Vec<PathBuf>, u64)> = BTreeMap::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.split_once('.'))
            .and_then(|(n, _)| n.parse::<u64>().ok())
        else {
            continue;
        };
        if running.contains(&id) {
            continue;
        }
        let bytes = e.metadata().map(|m| m.len()).unwrap_or(0);
        let entry = ended.entry(id).or_default();
        entry.0.push(e.path());
        entry.1 += bytes;
    }
    let mut total: u64 = ended.values().map(|(_, b)| b).sum();
    let mut left = ended.len();
    for (files, bytes) in ended.into_values() {
        if left <= 1 || (left <= SPILL_KEEP_EXECS && total <= SPILL_KEEP_BYTES) {
            break;
        }
        for f in files {
            let _ = std::fs::remove_file(f);
        }
        total -= bytes;
        left -= 1;
    }
}

/// The execs of one sandbox, by id.
pub struct Slots<P> {
    map: Mutex<HashMap<u64, Arc<ExecSlot<P>>>>,
    next: AtomicU64,
}

impl<P: ProcState> Default for Slots<P> {
    fn default() -> Self {
        Slots {
            map: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }
}

impl<P: ProcState> Slots<P> {
    /// The id of the next exec.
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::SeqCst)
    }

    /// Adds an exec's slot, and removes the spill files of ended execs past what a sandbox
    /// keeps ([`SPILL_KEEP_EXECS`], [`SPILL_KEEP_BYTES`]).
    pub fn insert(&self, slot: Arc<ExecSlot<P>>) {
        let dir = slot.spill.clone();
        lock(&self.map).insert(slot.id, slot);
        let running: Vec<u64> = self
            .all()
            .iter()
            .filter(|s| !s.state().settled())
            .map(|s| s.id)
            .collect();
        prune_spill(&dir, &running);
    }

    pub fn remove(&self, id: u64) {
        lock(&self.map).remove(&id);
    }

    pub fn get(&self, id: u64) -> Result<Arc<ExecSlot<P>>, ApiError> {
        lock(&self.map)
            .get(&id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("process {id} does not exist")))
    }

    pub fn all(&self) -> Vec<Arc<ExecSlot<P>>> {
        lock(&self.map).values().cloned().collect()
    }

    /// Marks every exec that has not ended with `why` (its sandbox is going away) and wakes
    /// its waiters.
    pub fn end_all(&self, why: &str) {
        for slot in self.all() {
            slot.update(|st| {
                if !st.settled() {
                    st.error = Some(why.to_string());
                }
                st.stdin = None;
            });
        }
    }

    /// Waits (until `deadline`) for every exec to have stopped running.
    pub fn wait_settled(&self, deadline: Instant) {
        for slot in self.all() {
            drop(slot.wait_until(deadline, SlotState::settled));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Exec id -> its spill files of `bytes` (sparse), in a new directory.
    fn spills(ids: &[(u64, u64)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for &(id, bytes) in ids {
            let f = std::fs::File::create(dir.path().join(format!("{id}.stdout"))).unwrap();
            f.set_len(bytes).unwrap();
            std::fs::write(dir.path().join(format!("{id}.stderr")), b"e").unwrap();
        }
        dir
    }

    fn left(dir: &Path) -> Vec<u64> {
        let mut ids: Vec<u64> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().unwrap();
                name.strip_suffix(".stdout").map(|n| n.parse().unwrap())
            })
            .collect();
        ids.sort();
        ids
    }

    #[test]
    fn the_latest_execs_files_are_kept_by_count() {
        let ids: Vec<(u64, u64)> = (1..=20).map(|i| (i, 10)).collect();
        let dir = spills(&ids);
        prune_spill(dir.path(), &[2]);
        let mut want = vec![2];
        want.extend(5..=20);
        assert_eq!(left(dir.path()), want);
        // Both streams of a removed exec go.
        assert!(!dir.path().join("1.stderr").exists());
        assert!(dir.path().join("5.stderr").exists());
    }

    #[test]
    fn the_oldest_go_while_the_files_pass_the_byte_bound_but_never_the_latest() {
        let big = SPILL_KEEP_BYTES / 2 + 1;
        let dir = spills(&[(1, big), (2, big), (3, big), (4, 5)]);
        prune_spill(dir.path(), &[1]);
        // 1 runs (kept, not counted); 2 goes; 3 and 4 fit.
        assert_eq!(left(dir.path()), [1, 3, 4]);
        let dir = spills(&[(7, 3 * SPILL_KEEP_BYTES)]);
        prune_spill(dir.path(), &[]);
        assert_eq!(left(dir.path()), [7]);
        // Files of other names are left alone.
        std::fs::write(dir.path().join("notes"), b"x").unwrap();
        prune_spill(dir.path(), &[]);
        assert!(dir.path().join("notes").exists());
    }
}
