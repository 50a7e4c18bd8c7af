//! Traces: an append-only JSONL record of every operation on a sandbox and its observation.
//!
//! [`Traced`] wraps any [`SandboxApi`] and records to `STATE/traces/ID.jsonl`, one file per
//! sandbox, kept after destroy. [`read_trace`] reads a trace back (for `taskbox trace show` and
//! `taskbox replay`), and [`render_text`] summarises it for a person.
//!
//! # Format (version 2)
//!
//! Line 1 is a header: what is needed to rebuild the sandbox without the original files.
//!
//! ```json
//! {"type":"header","version":2,"taskbox":"0.1.0","sandbox":"sb-0123456789abcdef",
//!  "created_at_ms":1700000000000,"backend":"native","image":"host","policy":"default",
//!  "policy_hash":"9f2c...","policy_toml":"[filesystem]\nworkspace = \"overlay\"\n...",
//!  "workspace":"/src/app","workspace_base":{"kind":"git","commit":"4b825dc...","dirty":false},
//!  "env":{"GITHUB_TOKEN":"[redacted]","RUST_LOG":"debug"},"labels":{}}
//! ```
//!
//! `workspace_base` is a git commit (`"kind":"git"`), the digest of an uploaded tar
//! (`"kind":"tar"`), or for a plain directory the digest of its content
//! (`{"kind":"dir","sha256":"...","entries":12,"bytes":3456}`, see [`crate::digest`]; an
//! addition to version 2 that older readers refuse), else `"kind":"none"`.
//!
//! Then one line per operation, `seq` counting from 1 without gaps in file order:
//!
//! ```json
//! {"type":"op","seq":2,"op":"exec","started_at_ms":1700000000120,"duration_ms":812,
//!  "request":{"shell":"cargo test",...},
//!  "outcome":{"ok":{"exit_code":0,...,"stdout_sha256":"...","stderr_sha256":"..."}}}
//! {"type":"op","seq":3,"op":"patch",...,"outcome":{"error":{"code":"patch_failed","message":"..."}}}
//! ```
//!
//! An operation that changes the sandbox (exec, stdin, kill, write, edit, patch, remove, move,
//! checkpoint, restore, export with apply, network, approve) is also recorded *before* it runs,
//! as a start (version 2), and its op line names that start:
//!
//! ```json
//! {"type":"started","start":4,"op":"exec","started_at_ms":1700000000120,"request":{...}}
//! {"type":"op","seq":5,"op":"exec",...,"start":4}
//! ```
//!
//! A start whose op never came ([`Trace::unfinished`]) ran, or was running, when its supervisor
//! stopped: the trace knows it ran, not what it observed. Version 1 traces have no starts and
//! read as before.
//!
//! `create` is the header plus op 1 (`"op":"create"`, the [`SandboxInfo`]); a successful `destroy`
//! is the last line. `seq` is the order in which observations were recorded: concurrent calls on
//! one sandbox are recorded as they finish, and `started_at_ms` says when each began. `list` and
//! `info` only report on sandboxes and are not recorded; nor is a call on a sandbox the backend
//! does not know (it has no trace to go to; a failed create included), nor one that finishes
//! after a racing destroy.
//!
//! # Durability
//!
//! Each line is written with one `write` to a file opened for appending, and every op line is
//! written before its observation goes back to the caller: once written the kernel holds it, so
//! no crash of taskbox itself (a supervisor killed, out of memory, a panic) loses an answered
//! call. When it reaches the disk is [`TraceSync`]: by default ([`TraceSync::Batched`]) a
//! background thread `fdatasync`s within [`SYNC_INTERVAL`] (50 ms), one sync for all the lines
//! and traces of that moment, so only a host that crashes or loses power can lose the lines of
//! its last 50 ms (with the sandboxes they ran in); with [`TraceSync::EachOp`] every op line is
//! synced before its answer, nothing acknowledged is lost even then, and each call waits for the
//! disk. The header, the create and the destroy lines are synced before their answer either
//! way. A start line is written before its call runs and synced with the lines after it: a
//! supervisor that dies mid-call leaves it in the file.
//! When a start cannot be recorded (a full disk, a read-only state directory) the operation is
//! refused before it runs, with an `unavailable` error that says so: nothing runs unrecorded.
//! When the end cannot be recorded the caller gets an `internal` error instead of the
//! observation (for `create`, the new sandbox is destroyed again). A line torn by a crash was
//! never acknowledged; [`read_trace`] reports it in [`Trace::torn_tail`], and reopening the trace
//! cuts it off before appending.
//!
//! # What is recorded, and what is not
//!
//! - Secrets are redacted ([`redact`]): env values whose name looks secret, and well-known token
//!   shapes in any string (requests, outputs, file contents, error messages).
//! - Exec results carry `stdout_sha256` and `stderr_sha256`: SHA-256 of the *raw* `text` fields
//!   as the caller received them, computed before redaction and truncation, so replay can compare
//!   outputs that the trace itself does not show in full.
//! - Write content (`request.content`) and read content (`outcome.ok.content`) over 64 KiB are
//!   stored as `{"sha256": ..., "bytes": N}` (digest and length of the content string as sent,
//!   base64 text for binary content) instead of the text.
//! - Any other string over 64 KiB is cut there, with a marker saying how much was left out.
//! - Streaming exec events are not recorded one by one; the final result is.
//! - Command policy ([`crate::approvals`]): a refused exec is recorded as an exec whose result
//!   carries the `command` violation; `approve` and `deny` are recorded as operations (the
//!   approval and its answer); listing pending approvals is not.
//! - Secrets (`docs/secrets.md`): a create request's `secrets` are recorded by name with their
//!   values redacted; a rotation (op `"secret"`) is recorded as its name and action, never the
//!   value; each exec's `network.secrets` counts the requests that carried each secret, by name.
//! - Egress (network mode "proxy"): each exec's result carries `network`, the proxy's decisions
//!   while it ran (counts, bytes, the connections one by one), and its denials as violations; a
//!   change of a live sandbox's rules is an op `"network"` whose request is the new rules. Both
//!   are additions to version 1: older traces have neither, and readers that do not know them
//!   skip them.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};

use regex::{Captures, Regex, RegexSet};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::*;
use crate::policy;
use crate::result::ExecResult;
use taskbox_contract::support::{lock, now_ms};

/// The trace format version this taskbox writes and understands.
pub const TRACE_VERSION: u64 = 2;

/// Strings longer than this are cut (or, for file contents, replaced by their digest).
pub const MAX_FIELD_BYTES: usize = 64 * 1024;

/// What replaces a redacted secret.
pub const REDACTED: &str = "[redacted]";

/// The largest trace file read back (a guard against reading an arbitrary file into memory).
pub const MAX_TRACE_BYTES: u64 = 1 << 30;

/// How long each `git` query for the workspace base may take.
const GIT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a trace could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be read.
    #[error("cannot read trace {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The trace file could not be created or appended to.
    #[error("cannot write trace {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The first line is not a header.
    #[error("trace {} has no header: its first line must be a {{\"type\":\"header\"}} object", path.display())]
    MissingHeader { path: PathBuf },
    /// The file is larger than [`MAX_TRACE_BYTES`].
    #[error("trace {} is {size} bytes, more than the {max} this taskbox reads", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    /// The trace was written by a newer taskbox.
    #[error(
        "trace version {found} is newer than this taskbox understands ({supported}); upgrade taskbox"
    )]
    TooNew { found: u64, supported: u64 },
    /// A line (other than a torn last one) is not a valid trace record.
    #[error("trace {}: line {line}: {reason}", path.display())]
    InvalidLine {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// Sequence numbers skip or repeat.
    #[error("trace {}: line {line}: expected seq {expected}, found {found}", path.display())]
    Sequence {
        path: PathBuf,
        line: usize,
        expected: u64,
        found: u64,
    },
}

/// What the workspace was when the trace began.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkspaceBase {
    /// A git checkout: `HEAD` and whether the work tree differed from it (`dirty` is also true
    /// when `git status` could not tell).
    Git { commit: String, dirty: bool },
    /// A tar of the workspace, by the SHA-256 of the tar file (replay checks the tar it is
    /// given against it).
    Tar { sha256: String },
    /// A plain directory (not a git checkout), by the digest of its content
    /// ([`crate::digest`]); replay checks the directory it rebuilds against it.
    Dir {
        sha256: String,
        /// Entries and bytes of file content the digest covers.
        entries: u64,
        bytes: u64,
    },
    /// Not a git checkout and too large to digest, or neither git nor the digest could say.
    None,
}

/// The first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    pub version: u64,
    /// The taskbox version that wrote the trace.
    pub taskbox: String,
    pub sandbox: String,
    pub created_at_ms: u64,
    pub backend: String,
    /// "host" or the image digest.
    pub image: String,
    /// The policy name or file the sandbox was created with.
    pub policy: String,
    pub policy_hash: String,
    /// The resolved policy as TOML (its hash is `policy_hash`), so replay needs no policy file;
    /// null when the policy could not be loaded again or had changed since create.
    pub policy_toml: Option<String>,
    pub workspace: String,
    pub workspace_base: WorkspaceBase,
    /// The create request's env, redacted.
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    /// The sandbox was not created through this trace's writer; its header was made from the
    /// sandbox's info later, and the create request's env is unknown.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopted: bool,
    /// For a fork: where it came from (an addition to version 2; absent for other sandboxes).
    /// Its image, policy, workspace, env and base are its parent's; replay rebuilds it by
    /// replaying the parent's trace up to the fork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<ForkPoint>,
}

/// The point a fork was made from: its parent's trace (`STATE/traces/PARENT.jsonl`, beside the
/// fork's own), the `seq` of the `fork` op in it, and the parent's checkpoint it started from,
/// if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoint {
    pub parent: String,
    pub seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

/// A failed operation's error, as on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

/// The observation of one operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok(Value),
    Error(ErrorBody),
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceOp {
    pub seq: u64,
    /// The operation's [`OpName`]: "create", "exec", "read", "write", "edit", "patch", "list",
    /// "search", "stat", "remove", "move", "diff", "checkpoint", "restore", "export",
    /// "process", "wait", "kill", "stdin", "approve", "deny", "network" (new egress rules) or
    /// "destroy". Kept as text: a trace may name an operation this taskbox does not know.
    pub op: String,
    pub started_at_ms: u64,
    pub duration_ms: u64,
    pub request: Value,
    pub outcome: Outcome,
    /// The [`TraceStart`] recorded before the operation ran, when one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<u64>,
}

impl TraceOp {
    /// The operation, when this taskbox knows its name.
    pub fn name(&self) -> Option<OpName> {
        self.op.parse().ok()
    }
}

/// An operation that changes the sandbox, recorded (and synced) before it runs: the trace
/// never misses what ran, even when the operation's end is never recorded (the supervisor
/// died, the disk filled). The operation's [`TraceOp`] names it by `start`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceStart {
    /// Numbers the starts of one trace, from 1.
    pub start: u64,
    pub op: String,
    pub started_at_ms: u64,
    pub request: Value,
}

/// One line of a trace file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Line {
    Header(Box<TraceHeader>),
    Op(TraceOp),
    Started(TraceStart),
}

/// A trace read back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trace {
    pub header: TraceHeader,
    pub ops: Vec<TraceOp>,
    /// Operations recorded as started whose end the trace lacks: they ran (or were running)
    /// when their supervisor stopped, and their observations are unknown.
    pub unfinished: Vec<TraceStart>,
    /// An incomplete last line (no trailing newline, or not valid JSON): a write cut short by a
    /// crash, never acknowledged to the caller.
    pub torn_tail: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Syncing
// ---------------------------------------------------------------------------------------------

/// When an op line reaches the disk (see "Durability" in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TraceSync {
    /// Before its answer goes back: `fdatasync` per op line.
    EachOp,
    /// Written before its answer goes back (so no crash of taskbox loses it), synced within
    /// [`SYNC_INTERVAL`] by a background thread, many lines and traces to one sync each.
    #[default]
    Batched,
}

/// How long a batched op line may wait for its `fdatasync`.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(50);

/// The background syncer of [`TraceSync::Batched`]: the traces with unsynced lines.
#[derive(Default)]
struct Syncer {
    dirty: Mutex<Vec<Handle>>,
    wake: std::sync::Condvar,
}

impl Syncer {
    /// A syncer and its thread, which ends when the last `Arc` of the syncer is gone (after a
    /// last round).
    fn start() -> Arc<Syncer> {
        let syncer = Arc::new(Syncer::default());
        let weak = Arc::downgrade(&syncer);
        let spawned = std::thread::Builder::new()
            .name("trace-sync".into())
            .spawn(move || Syncer::run(weak));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the trace syncer; op lines are synced one by one");
        }
        syncer
    }

    /// `handle` has a line to sync.
    fn mark(&self, handle: &Handle) {
        let mut dirty = lock(&self.dirty);
        if !dirty.iter().any(|h| Arc::ptr_eq(h, handle)) {
            dirty.push(handle.clone());
            self.wake.notify_one();
        }
    }

    fn run(weak: std::sync::Weak<Syncer>) {
        loop {
            let Some(syncer) = weak.upgrade() else { return };
            let taken = {
                let mut dirty = lock(&syncer.dirty);
                while dirty.is_empty() {
                    let (d, _) = syncer
                        .wake
                        .wait_timeout(dirty, Duration::from_millis(500))
                        .unwrap_or_else(|p| p.into_inner());
                    dirty = d;
                    if dirty.is_empty() && Arc::strong_count(&syncer) == 1 {
                        return;
                    }
                }
                drop(dirty);
                // Lines of more calls join this round meanwhile.
                std::thread::sleep(SYNC_INTERVAL);
                std::mem::take(&mut *lock(&syncer.dirty))
            };
            drop(syncer);
            sync_all(taken);
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        sync_all(std::mem::take(&mut *lock(&self.dirty)));
    }
}

/// `fdatasync` of each trace in `handles`, on a descriptor of its own (the file's lock is not
/// held meanwhile, so calls on the sandbox do not wait for the disk).
fn sync_all(handles: Vec<Handle>) {
    for handle in handles {
        let (file, path) = {
            let tf = lock(&handle);
            (tf.sync_file.clone(), tf.path.clone())
        };
        if let Err(e) = file.sync_data() {
            tracing::warn!(path = %path.display(), error = %e, "cannot sync a trace");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// An open trace file. Its mutex orders the appends of concurrent calls on one sandbox.
struct TraceFile {
    path: PathBuf,
    file: File,
    /// The seq of the next line.
    next_seq: u64,
    /// The number of the next [`TraceStart`].
    next_start: u64,
    /// Bytes of complete lines, to cut a failed append back to.
    len: u64,
    /// Destroy was recorded: nothing more is appended.
    closed: bool,
    /// The same file on a descriptor of its own, for the background syncer.
    sync_file: Arc<File>,
}

impl TraceFile {
    /// Appends one line (one write, then fdatasync when `sync`). On failure the file is cut back
    /// to its last complete line so later appends stay parseable.
    fn append(&mut self, line: &[u8], sync: bool) -> Result<(), TraceError> {
        let res = self
            .file
            .write_all(line)
            .and_then(|()| if sync { self.file.sync_data() } else { Ok(()) });
        match res {
            Ok(()) => {
                self.len += line.len() as u64;
                Ok(())
            }
            Err(source) => {
                let _ = self.file.set_len(self.len);
                Err(TraceError::Write {
                    path: self.path.clone(),
                    source,
                })
            }
        }
    }
}

type Handle = Arc<Mutex<TraceFile>>;

/// A [`SandboxApi`] that records every operation on `inner` and its observation to a trace file
/// per sandbox (see the module docs for the format and guarantees).
pub struct Traced<B: SandboxApi> {
    inner: B,
    dir: PathBuf,
    open: Mutex<HashMap<SandboxId, Handle>>,
    /// Syncs op lines in the background ([`TraceSync::Batched`]); `None`: one by one.
    syncer: Option<Arc<Syncer>>,
}

impl<B: SandboxApi> std::fmt::Debug for Traced<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traced").field("dir", &self.dir).finish()
    }
}

/// An operation under way: what was asked and when.
struct Call {
    op: OpName,
    request: Value,
    started_at_ms: u64,
    started: Instant,
    /// Its [`TraceStart`], when it was recorded before running.
    start: Option<u64>,
}

impl Call {
    /// A call of `op` with `request`, redacted and bounded once here for both lines it may
    /// become (its start and its op).
    fn start(op: OpName, mut request: Value) -> Call {
        sanitize(&mut request);
        Call {
            op,
            request,
            started_at_ms: now_ms(),
            started: Instant::now(),
            start: None,
        }
    }

    /// The call as a trace line with its outcome (numbered when it is appended), having taken
    /// `duration_ms`.
    fn into_op(self, duration_ms: u64, outcome: Outcome) -> TraceOp {
        TraceOp {
            seq: 0,
            op: self.op.as_str().to_owned(),
            started_at_ms: self.started_at_ms,
            duration_ms,
            request: self.request,
            outcome,
            start: self.start,
        }
    }

    fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

impl<B: SandboxApi> Traced<B> {
    /// Records the sandboxes of `inner` in `traces_dir` (normally `STATE/traces`, created with
    /// mode 0700 on the first create).
    pub fn new(inner: B, traces_dir: impl Into<PathBuf>) -> Traced<B> {
        Traced {
            inner,
            dir: traces_dir.into(),
            open: Mutex::new(HashMap::new()),
            syncer: Some(Syncer::start()),
        }
    }

    /// When op lines reach the disk (default [`TraceSync::Batched`]).
    pub fn with_sync(mut self, sync: TraceSync) -> Traced<B> {
        self.syncer = match sync {
            TraceSync::EachOp => None,
            TraceSync::Batched => self.syncer.or_else(|| Some(Syncer::start())),
        };
        self
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The directory holding the traces.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the trace of sandbox `id` is written.
    pub fn trace_path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(format!("{id}.jsonl"))
    }

    /// Creates the trace file of a new sandbox and writes its header (synced, as is the new
    /// directory entry). The caller registers the handle.
    fn start_trace(&self, header: &TraceHeader) -> Result<Handle, TraceError> {
        self.start_trace_with(header, true)
    }

    /// [`Traced::start_trace`]; with `sync` false neither the header nor the directory entry is
    /// synced (the caller syncs them, several traces at once).
    fn start_trace_with(&self, header: &TraceHeader, sync: bool) -> Result<Handle, TraceError> {
        let path = self.dir.join(format!("{}.jsonl", header.sandbox));
        let write_err = |source| TraceError::Write {
            path: path.clone(),
            source,
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(write_err)?;
        // create_new: an existing trace is never overwritten.
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(write_err)?;
        if sync {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(write_err)?;
        }
        let sync_file = Arc::new(file.try_clone().map_err(write_err)?);
        let mut tf = TraceFile {
            path: path.clone(),
            file,
            next_seq: 1,
            next_start: 1,
            len: 0,
            closed: false,
            sync_file,
        };
        tf.append(&header_line(header), sync)?;
        Ok(Arc::new(Mutex::new(tf)))
    }

    /// The open trace of `id`. A sandbox the backend knows but this writer has not opened (it
    /// was created before a restart, or by another writer) has its trace reopened, or started
    /// from its info. `None` when the backend does not know the sandbox.
    fn trace_of(&self, id: &SandboxId) -> Result<Option<Handle>, TraceError> {
        let mut open = lock(&self.open);
        if let Some(h) = open.get(id) {
            return Ok(Some(h.clone()));
        }
        let Ok(info) = self.inner.info(id) else {
            return Ok(None);
        };
        let path = self.trace_path(id);
        let handle = if path.exists() {
            Arc::new(Mutex::new(reopen(&path)?))
        } else {
            tracing::warn!(sandbox = %id, "no trace for this sandbox yet; starting one from its info");
            self.start_trace(&header_for(&info, None))?
        };
        open.insert(id.clone(), handle.clone());
        Ok(Some(handle))
    }

    /// Records that `call`, which changes the sandbox, is about to run: when that cannot be done the call is refused before it runs (so the trace never misses what
    /// ran). Returns the start's number for [`Traced::finish`]; `None` for a sandbox the
    /// backend does not know (its call fails on its own).
    fn begin(&self, id: &SandboxId, call: &mut Call) -> Result<(), ApiError> {
        let handle = self.trace_of(id).map_err(|e| begin_failed(call.op, e))?;
        let Some(handle) = handle else {
            return Ok(());
        };
        let request = call.request.clone();
        let mut tf = lock(&handle);
        if tf.closed {
            return Ok(());
        }
        let start = TraceStart {
            start: tf.next_start,
            op: call.op.as_str().to_owned(),
            started_at_ms: call.started_at_ms,
            request,
        };
        let mut bytes = serde_json::to_vec(&Line::Started(start)).unwrap_or_default();
        bytes.push(b'\n');
        // Written, not synced: once written the kernel holds it, so a supervisor that dies during
        // the call leaves it behind; the op line's fdatasync makes both durable before the answer
        // goes back. Only a machine that loses power mid-call may lose a start, together with the
        // sandbox it ran in. One sync per call instead of two: on a busy disk each costs as much
        // as the exec itself.
        tf.append(&bytes, false)
            .map_err(|e| begin_failed(call.op, e))?;
        call.start = Some(tf.next_start);
        tf.next_start += 1;
        Ok(())
    }

    /// Records `call` and its result before the result goes back to the caller.
    fn finish(
        &self,
        id: &SandboxId,
        call: Call,
        result: &Result<Answer, ApiError>,
    ) -> Result<(), ApiError> {
        let duration_ms = call.elapsed_ms();
        let name = call.op;
        let handle = self.trace_of(id).map_err(|e| record_failed(name, e))?;
        let Some(handle) = handle else {
            return Ok(());
        };
        let op = call.into_op(duration_ms, outcome_of(result));
        append_op(&handle, op, false, self.syncer.as_deref()).map_err(|e| record_failed(name, e))
    }

    /// Destroys sandbox `id` and records it as the trace's last line.
    fn record_destroy(&self, id: &SandboxId) -> Result<Answer, ApiError> {
        let call = Call::start(OpName::Destroy, Op::Destroy.request());
        // The trace must be open before the backend forgets the sandbox, or its info (needed to
        // open a trace not opened yet) is gone. A trace that cannot be opened does not keep the
        // sandbox alive.
        if let Err(e) = self.trace_of(id) {
            tracing::warn!(sandbox = %id, error = %e, "destroying a sandbox whose trace cannot be opened");
        }
        let r = self.inner.call(id, Op::Destroy);
        let handle = lock(&self.open).get(id).cloned();
        if let Some(handle) = handle {
            let duration_ms = call.elapsed_ms();
            let op = call.into_op(duration_ms, outcome_of(&r));
            append_op(&handle, op, r.is_ok(), self.syncer.as_deref())
                .map_err(|e| record_failed(OpName::Destroy, e))?;
            if r.is_ok() {
                lock(&self.open).remove(id);
            }
        }
        r
    }
}

impl<B: SandboxApi> Traced<B> {
    /// Forks sandbox `id` and records it: the `fork` op in the parent's trace, and a trace of
    /// each fork whose header is the parent's with the point it forked from ([`ForkPoint`]: the
    /// seq of that op) and whose op 1 is its `create`. When a fork's trace cannot be started,
    /// every fork is destroyed again and the caller gets an `internal` error, as for a create.
    fn record_fork(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        let mut call = Call::start(OpName::Fork, op.request());
        let checkpoint = match &op {
            Op::Fork(req) => req.checkpoint.clone(),
            _ => None,
        };
        self.begin(id, &mut call)?;
        let r = self.inner.call(id, op);
        let duration_ms = call.elapsed_ms();
        let line = call.into_op(duration_ms, outcome_of(&r));
        let Some(parent) = self
            .trace_of(id)
            .map_err(|e| record_failed(OpName::Fork, e))?
        else {
            return r;
        };
        let seq = append_op_seq(&parent, line, false, self.syncer.as_deref())
            .map_err(|e| record_failed(OpName::Fork, e))?;
        let Ok(Answer::Fork(forked)) = &r else {
            return r;
        };
        let started = (|| -> Result<(), TraceError> {
            let path = lock(&parent).path.clone();
            let header = read_header(&path)?;
            let point = ForkPoint {
                parent: id.to_string(),
                seq: seq.unwrap_or(0),
                checkpoint: checkpoint.clone(),
            };
            // Written first, synced after, all at once: one sync of the directory and the
            // files' syncs, all side by side, not two syncs in a row per fork.
            let mut made = Vec::with_capacity(forked.sandboxes.len());
            for info in &forked.sandboxes {
                let h = TraceHeader {
                    sandbox: info.id.to_string(),
                    created_at_ms: info.created_at_ms,
                    labels: info.labels.clone(),
                    version: TRACE_VERSION,
                    taskbox: env!("CARGO_PKG_VERSION").to_string(),
                    fork: Some(point.clone()),
                    ..header.clone()
                };
                let handle = self.start_trace_with(&h, false)?;
                lock(&self.open).insert(info.id.clone(), handle.clone());
                let mut create = TraceOp {
                    seq: 0,
                    op: OpName::Create.as_str().to_owned(),
                    started_at_ms: info.created_at_ms,
                    duration_ms,
                    request: json!({ "fork": point }),
                    outcome: Outcome::Ok(to_json(info)),
                    start: None,
                };
                sanitize_outcome(&mut create.outcome);
                {
                    let mut tf = lock(&handle);
                    create.seq = tf.next_seq;
                    tf.append(&op_line(&create), false)?;
                    tf.next_seq += 1;
                }
                made.push(handle);
            }
            std::thread::scope(|scope| {
                // The directory's sync beside the files': each waits for the disk, and none
                // depends on another.
                let dir = scope.spawn(|| {
                    File::open(&self.dir)
                        .and_then(|d| d.sync_all())
                        .map_err(|source| TraceError::Write {
                            path: self.dir.clone(),
                            source,
                        })
                });
                let files = made.iter().map(|h| {
                    let (file, path) = {
                        let tf = lock(h);
                        (tf.sync_file.clone(), tf.path.clone())
                    };
                    scope.spawn(move || {
                        file.sync_data()
                            .map_err(|source| TraceError::Write { path, source })
                    })
                });
                let syncs: Vec<_> = std::iter::once(dir).chain(files).collect();
                syncs.into_iter().try_for_each(|s| {
                    s.join().unwrap_or_else(|_| {
                        Err(TraceError::Write {
                            path: self.dir.clone(),
                            source: io::Error::other("a trace sync panicked"),
                        })
                    })
                })
            })?;
            Ok(())
        })();
        if let Err(e) = started {
            tracing::error!(sandbox = %id, error = %e, "cannot start the traces of forks; destroying them");
            for info in &forked.sandboxes {
                lock(&self.open).remove(&info.id);
                let _ = self.inner.destroy(&info.id);
            }
            let message =
                format!("sandbox not forked: the forks' traces could not be recorded: {e}");
            return Err(ApiError::internal_with(message, e));
        }
        r
    }
}

/// The header of the trace at `path` (its first line).
pub fn read_header(path: &Path) -> Result<TraceHeader, TraceError> {
    let read_err = |source| TraceError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(read_err)?;
    let mut first = String::new();
    io::BufRead::read_line(&mut io::BufReader::new(file), &mut first).map_err(read_err)?;
    match serde_json::from_str::<Line>(&first) {
        Ok(Line::Header(h)) => Ok(*h),
        _ => Err(TraceError::MissingHeader {
            path: path.to_path_buf(),
        }),
    }
}

fn begin_failed(op: OpName, e: TraceError) -> ApiError {
    let message = format!(
        "the {op} was refused before it ran: the trace cannot be written ({e}); free space \
         for the state directory or fix its permissions, then retry"
    );
    ApiError::unavailable_with(message, e)
}

fn record_failed(op: OpName, e: TraceError) -> ApiError {
    let message = format!("the {op} ran but its observation could not be recorded: {e}");
    ApiError::internal_with(message, e)
}

/// Sanitises `op`, numbers it and appends it under the file's lock, so seq matches file order.
/// Synced before it returns without a `syncer`, and always for the trace's last line; else the
/// syncer syncs it soon.
fn append_op(
    handle: &Handle,
    op: TraceOp,
    closes: bool,
    syncer: Option<&Syncer>,
) -> Result<(), TraceError> {
    append_op_seq(handle, op, closes, syncer).map(|_| ())
}

/// [`append_op`], returning the seq the op was given (`None` when the trace was closed).
fn append_op_seq(
    handle: &Handle,
    mut op: TraceOp,
    closes: bool,
    syncer: Option<&Syncer>,
) -> Result<Option<u64>, TraceError> {
    // The request was sanitised when its call started.
    sanitize_outcome(&mut op.outcome);
    let later = syncer.filter(|_| !closes);
    let seq = {
        let mut tf = lock(handle);
        if tf.closed {
            return Ok(None);
        }
        op.seq = tf.next_seq;
        tf.append(&op_line(&op), later.is_none())?;
        tf.next_seq += 1;
        tf.closed = closes;
        op.seq
    };
    if let Some(s) = later {
        s.mark(handle);
    }
    Ok(Some(seq))
}

/// Opens an existing trace for appending: cuts off a torn tail, continues its seq.
fn reopen(path: &Path) -> Result<TraceFile, TraceError> {
    let bytes = fs::read(path).map_err(|source| TraceError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let (trace, complete, starts) = parse_trace(path, &bytes)?;
    let file = OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|source| TraceError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    if trace.torn_tail.is_some() {
        file.set_len(complete)
            .and_then(|()| file.sync_data())
            .map_err(|source| TraceError::Write {
                path: path.to_path_buf(),
                source,
            })?;
    }
    let closed = trace
        .ops
        .last()
        .is_some_and(|o| o.name() == Some(OpName::Destroy) && matches!(o.outcome, Outcome::Ok(_)));
    let sync_file = Arc::new(file.try_clone().map_err(|source| TraceError::Write {
        path: path.to_path_buf(),
        source,
    })?);
    Ok(TraceFile {
        sync_file,
        path: path.to_path_buf(),
        file,
        next_seq: trace.ops.len() as u64 + 1,
        next_start: starts + 1,
        len: complete,
        closed,
    })
}

/// The header as one line: redacted (its env) and bounded, fields in declaration order.
fn header_line(h: &TraceHeader) -> Vec<u8> {
    let mut v = to_json(h);
    sanitize(&mut v);
    // Back through the struct so "type" stays first (a JSON map would sort the keys).
    let mut bytes = match serde_json::from_value::<TraceHeader>(v.clone()) {
        Ok(h) => serde_json::to_vec(&Line::Header(Box::new(h))),
        Err(_) => {
            if let Some(o) = v.as_object_mut() {
                o.insert("type".into(), "header".into());
            }
            serde_json::to_vec(&v)
        }
    }
    .unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// An op as one line (already sanitised by [`append_op`]).
/// [`Line`] as written, borrowing what it writes (an exec's op holds its whole result).
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum LineRef<'a> {
    Op(&'a TraceOp),
}

fn op_line(op: &TraceOp) -> Vec<u8> {
    let mut bytes = serde_json::to_vec(&LineRef::Op(op)).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// Redacts secrets, then bounds every string.
fn sanitize(v: &mut Value) {
    redact(v);
    cap_strings(v);
}

pub(crate) fn to_json<T: Serialize + ?Sized>(v: &T) -> Value {
    serde_json::to_value(v)
        .unwrap_or_else(|e| json!({ "unserializable": format!("cannot serialize: {e}") }))
}

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// Adds `stdout_sha256` and `stderr_sha256` (of the raw text the caller received) to an exec
/// result's JSON.
fn add_exec_digests(r: &ExecResult, v: &mut Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "stdout_sha256".into(),
            sha256_hex(r.stdout.text.as_bytes()).into(),
        );
        o.insert(
            "stderr_sha256".into(),
            sha256_hex(r.stderr.text.as_bytes()).into(),
        );
    }
}

/// An observation as JSON: the answer shaped by [`shape`], or the error's code and message
/// (not yet redacted or bounded).
fn outcome_of(result: &Result<Answer, ApiError>) -> Outcome {
    match result {
        Ok(answer) => {
            let mut j = to_json(answer);
            shape(answer, &mut j);
            Outcome::Ok(j)
        }
        Err(e) => Outcome::Error(ErrorBody {
            code: e.code().to_string(),
            message: e.to_string(),
        }),
    }
}

/// Redacts and bounds an observation.
fn sanitize_outcome(outcome: &mut Outcome) {
    match outcome {
        Outcome::Ok(v) => sanitize(v),
        Outcome::Error(e) => {
            mask_secrets(&mut e.message);
            cap_string(&mut e.message);
        }
    }
}

/// An observation as the writer records it: shaped, redacted and bounded (what replay compares
/// with a recorded outcome).
pub(crate) fn observe(result: &Result<Answer, ApiError>) -> Outcome {
    let mut outcome = outcome_of(result);
    sanitize_outcome(&mut outcome);
    outcome
}

/// Adds to an answer's JSON what the trace records beyond the answer itself: the digests of
/// exec output (a result, or a process's), and a large read's content as its digest.
fn shape(answer: &Answer, v: &mut Value) {
    match answer {
        Answer::Exec(ExecOutcome::Finished(res)) => add_exec_digests(res, v),
        Answer::Exec(ExecOutcome::Background(p)) | Answer::Process(p) => add_process_digests(p, v),
        Answer::Read(_) => digest_large_field(v, "content"),
        _ => {}
    }
}

fn add_process_digests(p: &ProcessInfo, v: &mut Value) {
    if let (Some(r), Some(rv)) = (&p.result, v.get_mut("result")) {
        add_exec_digests(r, rv);
    }
}

/// Replaces `v[field]`, a string over [`MAX_FIELD_BYTES`], by its digest and length.
pub(crate) fn digest_large_field(v: &mut Value, field: &str) {
    if let Some(slot) = v.get_mut(field)
        && let Some(s) = slot.as_str()
        && s.len() > MAX_FIELD_BYTES
    {
        *slot = json!({ "sha256": sha256_hex(s.as_bytes()), "bytes": s.len() });
    }
}

/// Cuts every string in `v` to [`MAX_FIELD_BYTES`] with a marker.
fn cap_strings(v: &mut Value) {
    match v {
        Value::String(s) => cap_string(s),
        Value::Array(a) => a.iter_mut().for_each(cap_strings),
        Value::Object(o) => o.values_mut().for_each(cap_strings),
        _ => {}
    }
}

fn cap_string(s: &mut String) {
    if s.len() <= MAX_FIELD_BYTES {
        return;
    }
    let mut cut = MAX_FIELD_BYTES;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let left_out = s.len() - cut;
    s.truncate(cut);
    let _ = write!(s, "\n[taskbox trace: {left_out} more bytes not recorded]");
}

/// A create request as recorded: the values of its `secrets` replaced by [`REDACTED`] (their
/// names stay, saying which secrets came with the request).
fn create_request_json(req: &CreateRequest) -> Value {
    let mut v = to_json(req);
    if let Some(Value::Object(secrets)) = v.get_mut("secrets") {
        for value in secrets.values_mut() {
            *value = Value::String(REDACTED.to_owned());
        }
    }
    v
}

/// The header of sandbox `info`, from the create request when there was one.
fn header_for(info: &SandboxInfo, req: Option<&CreateRequest>) -> TraceHeader {
    TraceHeader {
        version: TRACE_VERSION,
        taskbox: env!("CARGO_PKG_VERSION").to_string(),
        sandbox: info.id.to_string(),
        created_at_ms: info.created_at_ms,
        backend: info.backend.clone(),
        image: info.image.clone(),
        policy: info.policy.clone(),
        policy_hash: info.policy_hash.clone(),
        policy_toml: match req.and_then(|r| r.resolved_policy.as_deref()) {
            Some(resolved) if resolved.hash == info.policy_hash => {
                policy_text(&resolved.policy, &info.policy)
            }
            _ => policy_toml(&info.policy, &info.policy_hash),
        },
        workspace: info.workspace.clone(),
        workspace_base: match info.labels.get(WORKSPACE_DIGEST_LABEL) {
            Some(sha256) => WorkspaceBase::Tar {
                sha256: sha256.clone(),
            },
            None => workspace_base(Path::new(&info.workspace)),
        },
        env: req.map(|r| r.env.clone()).unwrap_or_default(),
        labels: info.labels.clone(),
        adopted: req.is_none(),
        fork: None,
    }
}

/// The resolved policy as TOML, when it still has the hash the sandbox was created with.
fn policy_toml(name: &str, hash: &str) -> Option<String> {
    let policy = match policy::resolve(name) {
        Ok((p, _)) => p,
        Err(e) => {
            tracing::warn!(policy = %name, error = %e, "trace header without the policy text");
            return None;
        }
    };
    if policy.hash() != hash {
        tracing::warn!(policy = %name, "policy changed since create; trace header without its text");
        return None;
    }
    policy_text(&policy, name)
}

fn policy_text(policy: &policy::Policy, name: &str) -> Option<String> {
    match toml::to_string(policy) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(policy = %name, error = %e, "cannot serialize policy as toml");
            None
        }
    }
}

/// The git commit of the workspace and whether it is dirty, or, for a workspace that is not a
/// git checkout (or one without a commit), the digest of its content. Never fails: anything
/// git cannot answer in time, or a directory too large or unreadable to digest, is "none" (or,
/// for status, dirty).
fn workspace_base(ws: &Path) -> WorkspaceBase {
    if !ws.join(".git").exists() {
        return content_base(ws);
    }
    let Some(head) = git(ws, &["rev-parse", "--verify", "HEAD"]) else {
        return content_base(ws);
    };
    let commit = head.trim().to_string();
    if commit.len() < 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        return content_base(ws);
    }
    let dirty = git(ws, &["status", "--porcelain"]).is_none_or(|s| !s.trim().is_empty());
    WorkspaceBase::Git { commit, dirty }
}

/// The base of a plain-directory workspace: its content digest, or "none" when it has none.
fn content_base(ws: &Path) -> WorkspaceBase {
    match crate::digest::dir_digest(ws) {
        Ok(d) => WorkspaceBase::Dir {
            sha256: d.sha256,
            entries: d.entries,
            bytes: d.bytes,
        },
        Err(e) => {
            tracing::warn!(workspace = %ws.display(), error = %e,
                "trace header without a workspace base: replay will not check the directory");
            WorkspaceBase::None
        }
    }
}

pub(crate) use taskbox_contract::support::git_command;

/// Runs a read-only git query in `ws` with a timeout; its stdout when it succeeded.
fn git(ws: &Path, args: &[&str]) -> Option<String> {
    // `--no-optional-locks`: status must not rewrite the host repository's index.
    let out = taskbox_contract::support::output_within(
        git_command(ws).arg("--no-optional-locks").args(args),
        1 << 20,
        GIT_TIMEOUT,
    )?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

impl<B: SandboxApi> OpHandler for Traced<B> {
    fn handle_create(&self, mut req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        req.resolve_policy(PolicySources::Local)?;
        let call = Call::start(OpName::Create, create_request_json(&req));
        let info = self.inner.create(req.clone())?;
        let duration_ms = call.elapsed_ms();
        let header = header_for(&info, Some(&req));
        let op = call.into_op(duration_ms, Outcome::Ok(to_json(&info)));
        let started = self.start_trace(&header).and_then(|h| {
            lock(&self.open).insert(info.id.clone(), h.clone());
            // Synced at once, as the header is: a sandbox's first lines.
            append_op(&h, op, false, None)
        });
        if let Err(e) = started {
            tracing::error!(sandbox = %info.id, error = %e, "cannot start trace; destroying the sandbox");
            lock(&self.open).remove(&info.id);
            let _ = self.inner.destroy(&info.id);
            let message = format!("sandbox not created: its trace could not be recorded: {e}");
            return Err(ApiError::internal_with(message, e));
        }
        Ok(info)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.inner.list()
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        let name = op.name();
        match name {
            // They report on the sandbox itself and are not recorded (see the module docs).
            OpName::Info | OpName::ListApprovals => return self.inner.call(id, op),
            OpName::Destroy => return self.record_destroy(id),
            OpName::Fork => return self.record_fork(id, op),
            _ => {}
        }
        let mut request = op.request();
        if let Some(field) = name.payload_field() {
            digest_large_field(&mut request, field);
        }
        let mut call = Call::start(name, request);
        if op.changes_sandbox() {
            self.begin(id, &mut call)?;
        }
        let r = self.inner.call(id, op);
        self.finish(id, call, &r)?;
        r
    }
}

// ---------------------------------------------------------------------------------------------
// Redaction
// ---------------------------------------------------------------------------------------------

/// Name fragments that make an env variable's value secret (case-insensitive).
const SECRET_NAME_PARTS: &[&str] = &[
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "API_KEY",
    "APIKEY",
    "PRIVATE_KEY",
    "CREDENTIAL",
];

/// Whether an env variable named `name` holds a secret: it contains one of
/// [`SECRET_NAME_PARTS`], or `AUTH` other than as the start of `AUTHOR` (`GIT_AUTHOR_NAME` is
/// not a secret).
pub fn is_secret_name(name: &str) -> bool {
    let up = name.to_ascii_uppercase();
    SECRET_NAME_PARTS.iter().any(|p| up.contains(p))
        || up
            .match_indices("AUTH")
            .any(|(i, _)| !up[i + 4..].starts_with("OR"))
}

/// The compiled token shapes. If they failed to compile (a bug the unit tests catch), every
/// string is redacted whole: redaction fails closed.
struct Redactor {
    /// (shape, replacement template)
    shapes: Vec<(Regex, &'static str)>,
    /// `NAME=value` with a secret-looking upper-case NAME.
    assignment: Regex,
    /// All of the above in one automaton: a string none of them matches (nearly every string
    /// of an observation) is left after one pass instead of eight.
    any: RegexSet,
}

static REDACTOR: LazyLock<Result<Redactor, regex::Error>> = LazyLock::new(|| {
    let shapes = [
        (
            r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----(?s:.*?)(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\z)",
            "[redacted private key]",
        ),
        (
            r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{20,})",
            REDACTED,
        ),
        (r"\bsk-[A-Za-z0-9_-]{20,}", REDACTED),
        (r"\bxox[abposr]-[A-Za-z0-9-]{8,}", REDACTED),
        (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", REDACTED),
        (r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}", "${1}[redacted]"),
        (r"(://[^/\s:@]+:)[^/\s@]+@", "${1}[redacted]@"),
    ];
    const ASSIGNMENT: &str = r#"\b([A-Z][A-Z0-9_]*)=(["']?)([^\s'"]+)"#;
    let mut compiled = Vec::with_capacity(shapes.len());
    for (re, rep) in shapes {
        compiled.push((Regex::new(re)?, rep));
    }
    let any = RegexSet::new(shapes.iter().map(|(re, _)| *re).chain([ASSIGNMENT]))?;
    Ok(Redactor {
        shapes: compiled,
        assignment: Regex::new(ASSIGNMENT)?,
        any,
    })
});

/// Masks well-known token shapes in `s` in place.
fn mask_secrets(s: &mut String) {
    let r = match &*REDACTOR {
        Ok(r) => r,
        Err(_) => {
            *s = REDACTED.to_string();
            return;
        }
    };
    // Nothing matches: no replacement below could change anything.
    if !r.any.is_match(s) {
        return;
    }
    for (re, rep) in &r.shapes {
        if let Cow::Owned(o) = re.replace_all(s, *rep) {
            *s = o;
        }
    }
    let replaced = r.assignment.replace_all(s, |c: &Captures| {
        if is_secret_name(&c[1]) && &c[3] != REDACTED {
            format!("{}={}{REDACTED}", &c[1], &c[2])
        } else {
            c[0].to_string()
        }
    });
    if let Cow::Owned(o) = replaced {
        *s = o;
    }
}

/// Redacts secrets in a JSON value in place: the values of secret-named variables in any `env`
/// object become `"[redacted]"`, and in every string, well-known token shapes are masked
/// (GitHub `ghp_`/`gho_`/`ghu_`/`ghs_`/`ghr_`/`github_pat_` tokens, `sk-` keys, Slack `xox?-`
/// tokens, AWS `AKIA`/`ASIA` key ids, PEM private key blocks, `Bearer` credentials, the password
/// of `scheme://user:password@` URLs, and `NAME=value` with a secret-looking NAME).
pub fn redact(value: &mut Value) {
    match value {
        Value::String(s) => mask_secrets(s),
        Value::Array(a) => a.iter_mut().for_each(redact),
        Value::Object(o) => {
            for (k, v) in o.iter_mut() {
                if k == "env"
                    && let Value::Object(env) = v
                {
                    for (name, val) in env.iter_mut() {
                        if is_secret_name(name) {
                            *val = Value::String(REDACTED.into());
                        }
                    }
                }
                redact(v);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

/// Reads a trace: header and ops. A torn last line is reported in [`Trace::torn_tail`], not as
/// an error; any other invalid line, a missing header, a newer version or a gap in the sequence
/// numbers is an error.
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let read_err = |source| TraceError::Read {
        path: path.to_path_buf(),
        source,
    };
    let size = fs::metadata(path).map_err(read_err)?.len();
    if size > MAX_TRACE_BYTES {
        return Err(TraceError::TooLarge {
            path: path.to_path_buf(),
            size,
            max: MAX_TRACE_BYTES,
        });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    File::open(path)
        .and_then(|f| f.take(MAX_TRACE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(read_err)?;
    parse_trace(path, &bytes).map(|(t, _, _)| t)
}

/// Parses a trace; also returns the byte length of its complete lines.
/// The trace, the length of its complete lines, and how many starts it records.
fn parse_trace(path: &Path, bytes: &[u8]) -> Result<(Trace, u64, u64), TraceError> {
    let mut lines: Vec<(usize, &[u8])> = Vec::new();
    let mut start = 0;
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'\n' {
            lines.push((start, &bytes[start..i]));
            start = i + 1;
        }
    }
    // Bytes after the last newline: a line whose write was cut short.
    let mut torn: Option<(usize, &[u8])> = (start < bytes.len()).then(|| (start, &bytes[start..]));
    let invalid = |line: usize, reason: String| TraceError::InvalidLine {
        path: path.to_path_buf(),
        line,
        reason,
    };

    let mut parsed: Vec<(usize, Value)> = Vec::with_capacity(lines.len());
    let count = lines.len();
    for (i, (offset, text)) in lines.into_iter().enumerate() {
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Value>(text) {
            Ok(v) => parsed.push((i + 1, v)),
            Err(_) if i + 1 == count && torn.is_none() => torn = Some((offset, text)),
            Err(e) => return Err(invalid(i + 1, format!("invalid json: {e}"))),
        }
    }
    let complete = torn.map_or(bytes.len(), |(offset, _)| offset) as u64;
    let torn_tail = torn.map(|(_, t)| String::from_utf8_lossy(t).into_owned());

    let mut it = parsed.into_iter();
    let Some((hline, hvalue)) = it.next() else {
        return Err(TraceError::MissingHeader {
            path: path.to_path_buf(),
        });
    };
    if hvalue.get("type").and_then(Value::as_str) != Some("header") {
        return Err(TraceError::MissingHeader {
            path: path.to_path_buf(),
        });
    }
    match hvalue.get("version").and_then(Value::as_u64) {
        Some(v) if v > TRACE_VERSION => {
            return Err(TraceError::TooNew {
                found: v,
                supported: TRACE_VERSION,
            });
        }
        Some(1..=TRACE_VERSION) => {}
        Some(v) => {
            return Err(invalid(
                hline,
                format!(
                    "trace version {v} is older than any this taskbox reads (version \
                     {TRACE_VERSION} is the first)"
                ),
            ));
        }
        None => {
            return Err(invalid(
                hline,
                "the header has no numeric \"version\" field (this taskbox reads version \
                 1)"
                .into(),
            ));
        }
    }
    let header = match serde_json::from_value::<Line>(hvalue) {
        Ok(Line::Header(h)) => *h,
        Ok(Line::Op(_) | Line::Started(_)) => {
            return Err(TraceError::MissingHeader {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(invalid(hline, format!("invalid header: {e}"))),
    };
    let mut ops = Vec::new();
    let mut starts: Vec<TraceStart> = Vec::new();
    for (line, v) in it {
        match serde_json::from_value::<Line>(v) {
            Ok(Line::Started(st)) => {
                let expected = starts.len() as u64 + 1;
                if st.start != expected {
                    return Err(invalid(
                        line,
                        format!("start {} where start {expected} was expected", st.start),
                    ));
                }
                starts.push(st);
            }
            Ok(Line::Op(op)) => {
                let expected = ops.len() as u64 + 1;
                if op.seq != expected {
                    return Err(TraceError::Sequence {
                        path: path.to_path_buf(),
                        line,
                        expected,
                        found: op.seq,
                    });
                }
                ops.push(op);
            }
            Ok(Line::Header(_)) => return Err(invalid(line, "a second header".into())),
            Err(e) => return Err(invalid(line, format!("invalid record: {e}"))),
        }
    }
    let count = starts.len() as u64;
    let ended: std::collections::HashSet<u64> = ops.iter().filter_map(|o| o.start).collect();
    let unfinished = starts
        .into_iter()
        .filter(|s| !ended.contains(&s.start))
        .collect();
    Ok((
        Trace {
            header,
            ops,
            unfinished,
            torn_tail,
        },
        complete,
        count,
    ))
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

/// A trace's time (milliseconds since the epoch) as RFC 3339 UTC; one past the year 9999, which
/// only a damaged or forged trace holds, as the number itself.
pub fn timestamp_ms(ms: u64) -> String {
    let mut out = String::new();
    let at = UNIX_EPOCH.checked_add(Duration::from_millis(ms));
    match at.map(|t| write!(out, "{}", humantime::format_rfc3339_millis(t))) {
        Some(Ok(())) => out,
        _ => format!("{ms} ms after 1970 (out of range)"),
    }
}

/// A readable summary of a trace for `taskbox trace show`: the header, one line per operation
/// (with the violations an exec reported), and totals.
pub fn render_text(trace: &Trace) -> String {
    let h = &trace.header;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "sandbox {}  (taskbox {}, trace v{})",
        h.sandbox, h.taskbox, h.version
    );
    let _ = writeln!(out, "  created    {}", timestamp_ms(h.created_at_ms));
    let _ = writeln!(out, "  backend    {}  image {}", h.backend, h.image);
    let short_hash = h.policy_hash.get(..12).unwrap_or(&h.policy_hash);
    let _ = writeln!(out, "  policy     {} (sha256 {short_hash}…)", h.policy);
    let base = match &h.workspace_base {
        WorkspaceBase::Git { commit, dirty } => format!(
            "git {}{}",
            commit.get(..12).unwrap_or(commit),
            if *dirty { " (dirty)" } else { "" }
        ),
        WorkspaceBase::Tar { sha256 } => {
            format!("tar sha256 {}", sha256.get(..12).unwrap_or(sha256))
        }
        WorkspaceBase::Dir {
            sha256, entries, ..
        } => format!(
            "directory sha256 {} ({entries} entries)",
            sha256.get(..12).unwrap_or(sha256)
        ),
        WorkspaceBase::None => "not a git checkout".into(),
    };
    let _ = writeln!(out, "  workspace  {}  base {base}", h.workspace);
    if !h.env.is_empty() {
        let names: Vec<&str> = h.env.keys().map(String::as_str).collect();
        let _ = writeln!(out, "  env        {}", names.join(" "));
    }
    if h.adopted {
        let _ = writeln!(
            out,
            "  (header made after create: the create request is unknown)"
        );
    }
    out.push('\n');

    let base_ms = trace
        .ops
        .first()
        .map_or(h.created_at_ms, |o| o.started_at_ms.min(h.created_at_ms));
    let (mut execs, mut nonzero, mut failed, mut violations, mut busy_ms) = (0, 0, 0, 0, 0u64);
    let mut end_ms = base_ms;
    for op in &trace.ops {
        busy_ms += op.duration_ms;
        end_ms = end_ms.max(op.started_at_ms + op.duration_ms);
        let offset = format!(
            "+{:.1}s",
            op.started_at_ms.saturating_sub(base_ms) as f64 / 1000.0
        );
        let status = match &op.outcome {
            Outcome::Ok(v) if op.name() == Some(OpName::Exec) => {
                execs += 1;
                let s = exec_status(v);
                if s != "exit 0" && !s.starts_with("background") {
                    nonzero += 1;
                }
                s
            }
            Outcome::Ok(v)
                if matches!(
                    op.name(),
                    Some(OpName::Process | OpName::Wait | OpName::Kill)
                ) =>
            {
                match v.get("result") {
                    Some(r) if !r.is_null() => format!("ended, {}", exec_status(r)),
                    _ => "running".into(),
                }
            }
            Outcome::Ok(_) => "ok".into(),
            Outcome::Error(e) => {
                if op.name() == Some(OpName::Exec) {
                    execs += 1;
                }
                failed += 1;
                format!("failed: {}", e.code)
            }
        };
        let detail = op_detail(op);
        let mut line = format!(
            "#{:<4} {offset:>8}  {:<10} {status}  {}ms",
            op.seq, op.op, op.duration_ms
        );
        if !detail.is_empty() {
            let _ = write!(line, "  {detail}");
        }
        let _ = writeln!(out, "{}", line.trim_end());
        if let Outcome::Error(e) = &op.outcome {
            let _ = writeln!(out, "        {}", one_line(&e.message, 160));
        }
        if let Outcome::Ok(v) = &op.outcome {
            let vs = v
                .get("violations")
                .or_else(|| v.get("result").and_then(|r| r.get("violations")));
            for viol in vs.and_then(Value::as_array).into_iter().flatten() {
                violations += 1;
                let kind = viol.get("kind").and_then(Value::as_str).unwrap_or("?");
                let detail = viol.get("detail").and_then(Value::as_str).unwrap_or("");
                let _ = writeln!(out, "        violation {kind}: {}", one_line(detail, 160));
            }
            let net = v
                .get("network")
                .or_else(|| v.get("result").and_then(|r| r.get("network")));
            if let Some(net) = net.filter(|n| n.is_object()) {
                let n = |k: &str| net.get(k).and_then(Value::as_u64).unwrap_or(0);
                let _ = writeln!(
                    out,
                    "        network: {} allowed, {} denied, {} failed; {} bytes up, {} down",
                    n("allowed"),
                    n("denied"),
                    n("failed"),
                    n("bytes_up"),
                    n("bytes_down")
                );
                for u in net
                    .get("secrets")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let t = |k: &str| u.get(k).and_then(Value::as_str).unwrap_or("?");
                    let _ = writeln!(
                        out,
                        "        secret {} presented to {}:{} in {} requests",
                        t("secret"),
                        t("host"),
                        u.get("port").and_then(Value::as_u64).unwrap_or(0),
                        u.get("requests").and_then(Value::as_u64).unwrap_or(0)
                    );
                }
            }
        }
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "{} ops, {execs} execs ({nonzero} not exit 0), {failed} failed, {violations} violations; \
         {:.1}s from first to last, {:.1}s in operations",
        trace.ops.len(),
        end_ms.saturating_sub(base_ms) as f64 / 1000.0,
        busy_ms as f64 / 1000.0
    );
    for st in &trace.unfinished {
        let _ = writeln!(
            out,
            "note: {} started at {} (start {}) and its end was never recorded: it ran, or was \
             running, when its supervisor stopped",
            st.op,
            timestamp_ms(st.started_at_ms),
            st.start
        );
    }
    if let Some(tail) = &trace.torn_tail {
        let _ = writeln!(
            out,
            "note: the trace ends in an incomplete line ({} bytes): a write cut short, never acknowledged",
            tail.len()
        );
    }
    out
}

/// "exit 0", "signal 9", "timed out", or "background #3" for an exec observation.
fn exec_status(v: &Value) -> String {
    if let Some(id) = v.get("exec_id").and_then(Value::as_u64) {
        return format!("background #{id}");
    }
    if v.get("timed_out").and_then(Value::as_bool) == Some(true) {
        return "timed out".into();
    }
    if let Some(sig) = v.get("signal").and_then(Value::as_i64) {
        return format!("signal {sig}");
    }
    match v.get("exit_code").and_then(Value::as_i64) {
        Some(code) => format!("exit {code}"),
        None => "no exit code".into(),
    }
}

/// What an operation was about: the command, path, pattern, checkpoint...
pub(crate) fn op_detail(op: &TraceOp) -> String {
    let r = &op.request;
    let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let d = match op.name() {
        Some(OpName::Create) => match r.get("fork") {
            Some(f) => format!(
                "fork of {} at seq {}",
                f.get("parent").and_then(Value::as_str).unwrap_or("?"),
                f.get("seq").and_then(Value::as_u64).unwrap_or(0)
            ),
            None => s("workspace"),
        },
        Some(OpName::Fork) => {
            let n = r.get("count").and_then(Value::as_u64).unwrap_or(1);
            match r.get("checkpoint").and_then(Value::as_str) {
                Some(c) => format!("{n} from checkpoint {c}"),
                None => format!("{n}"),
            }
        }
        Some(OpName::Exec) => match (r.get("argv").and_then(Value::as_array), r.get("shell")) {
            (Some(argv), _) => argv
                .iter()
                .map(|a| shell_word(a.as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join(" "),
            (None, Some(Value::String(sh))) => sh.clone(),
            _ => String::new(),
        },
        Some(OpName::Read | OpName::Write | OpName::Edit | OpName::Stat | OpName::Remove) => {
            s("path")
        }
        Some(OpName::ListDir) => {
            let p = r.get("path").and_then(Value::as_str).unwrap_or(".");
            match r.get("glob").and_then(Value::as_str) {
                Some(g) => format!("{p} {g}"),
                None => p.to_string(),
            }
        }
        Some(OpName::Search) => format!("/{}/", s("pattern")),
        Some(OpName::Rename) => format!("{} -> {}", s("from"), s("to")),
        Some(OpName::Diff) => match r.get("since").and_then(Value::as_str) {
            Some(c) => format!("since {c}"),
            None => "since baseline".into(),
        },
        Some(OpName::Checkpoint | OpName::Restore) => s("name"),
        Some(OpName::Approve) => s("approval"),
        Some(OpName::Deny) => format!("{}: {}", s("approval"), s("reason")),
        Some(OpName::SetNetwork) => {
            let list = |k: &str| {
                r.get(k)
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default()
            };
            format!("allow [{}] deny [{}]", list("allow"), list("deny"))
        }
        Some(OpName::SetSecret) => format!("{} {}", s("action"), s("name")),
        Some(OpName::Export) => {
            let apply = r.get("apply").and_then(Value::as_bool) == Some(true);
            format!("{}{}", s("format"), if apply { " --apply" } else { "" })
        }
        Some(OpName::Process | OpName::Wait | OpName::Kill | OpName::WriteStdin) => r
            .get("exec_id")
            .and_then(Value::as_u64)
            .map(|id| format!("#{id}"))
            .unwrap_or_default(),
        _ => String::new(),
    };
    one_line(&d, 120)
}

fn shell_word(a: &str) -> String {
    let plain = !a.is_empty()
        && a.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', r"'\''"))
    }
}

/// The first line of `s`, cut to `max` characters with an ellipsis.
fn one_line(s: &str, max: usize) -> String {
    let first = s.lines().next().unwrap_or("");
    let mut out: String = first.chars().take(max).collect();
    if first.chars().count() > max || s.lines().nth(1).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_request_is_recorded_without_its_secret_values() {
        let req = CreateRequest {
            workspace: "/w".into(),
            secrets: [("gh".to_owned(), SecretValue::new("hunter2-secret-value"))]
                .into_iter()
                .collect(),
            ..CreateRequest::default()
        };
        let v = create_request_json(&req);
        assert_eq!(v["secrets"], json!({"gh": REDACTED}));
        assert!(!v.to_string().contains("hunter2"));
        // Without secrets the request is recorded as before (no key).
        let v = create_request_json(&CreateRequest::default());
        assert!(v.get("secrets").is_none(), "{v}");
    }

    #[test]
    fn token_shapes_compile() {
        let r = REDACTOR.as_ref().unwrap();
        assert_eq!(r.shapes.len(), 7);
    }

    fn masked(s: &str) -> String {
        let mut s = s.to_string();
        mask_secrets(&mut s);
        s
    }

    #[test]
    fn token_shapes_are_masked_in_place() {
        let gh = format!("ghp_{}", "a1B2".repeat(9));
        assert_eq!(masked(&format!("token is {gh}.")), "token is [redacted].");
        assert_eq!(
            masked(&format!("x github_pat_{} y", "A_1b".repeat(10))),
            "x [redacted] y"
        );
        assert_eq!(masked(&format!("gho_{}", "z".repeat(36))), "[redacted]");
        assert_eq!(
            masked(&format!("key: sk-proj-{}", "x9".repeat(15))),
            "key: [redacted]"
        );
        assert_eq!(masked("sk-short"), "sk-short", "too short to be a key");
        assert_eq!(
            masked("task-is-a-very-long-name-of-something"),
            "task-is-a-very-long-name-of-something",
            "sk- inside a word is not a key"
        );
        assert_eq!(
            masked("slack xoxb-12345678-abcdefgh done"),
            "slack [redacted] done"
        );
        assert_eq!(masked("aws AKIAIOSFODNN7EXAMPLE!"), "aws [redacted]!");
        assert_eq!(
            masked("curl -H 'Authorization: Bearer abc.def-123_xyz' x"),
            "curl -H 'Authorization: Bearer [redacted]' x"
        );
        assert_eq!(
            masked("git clone https://bob:hunter2secret@example.com/r.git"),
            "git clone https://bob:[redacted]@example.com/r.git"
        );
        assert_eq!(
            masked("https://example.com/a:b@c"),
            "https://example.com/a:b@c",
            "a colon in the path is not a password"
        );
        let pem = "before\n-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nAAAA\n-----END RSA PRIVATE KEY-----\nafter";
        assert_eq!(masked(pem), "before\n[redacted private key]\nafter");
        let cut = "x -----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk";
        assert_eq!(masked(cut), "x [redacted private key]", "a cut-off block");
        assert_eq!(
            masked("export GITHUB_TOKEN=abc123 DB_PASSWORD='pw' GIT_AUTHOR_NAME=me"),
            "export GITHUB_TOKEN=[redacted] DB_PASSWORD='[redacted]' GIT_AUTHOR_NAME=me"
        );
        assert_eq!(masked("nothing secret here"), "nothing secret here");
        let once = masked("Bearer abcdefghijkl https://u:p4ssword@h/ A_TOKEN=x");
        assert_eq!(masked(&once), once, "redaction is idempotent");
    }

    #[test]
    fn secret_env_names() {
        for n in [
            "GITHUB_TOKEN",
            "aws_secret_access_key",
            "PGPASSWORD",
            "MYSQL_PASSWD",
            "OPENAI_API_KEY",
            "STRIPE_APIKEY",
            "SSH_PRIVATE_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "NPM_AUTH",
            "auth",
            "OAUTH_ID",
        ] {
            assert!(is_secret_name(n), "{n}");
        }
        for n in [
            "PATH",
            "HOME",
            "RUST_LOG",
            "GIT_AUTHOR_NAME",
            "AUTHOR",
            "LANG",
        ] {
            assert!(!is_secret_name(n), "{n}");
        }
    }

    #[test]
    fn redact_walks_env_objects_and_all_strings() {
        let mut v = json!({
            "env": {"GITHUB_TOKEN": "plain", "RUST_LOG": "debug", "Api_Key": "x"},
            "argv": ["echo", "ghp_0123456789abcdef0123456789"],
            "nested": {"env": {"MY_SECRET": "s"}, "n": 5, "stdout": {"text": "AKIAIOSFODNN7EXAMPLE"}},
        });
        redact(&mut v);
        assert_eq!(v["env"]["GITHUB_TOKEN"], "[redacted]");
        assert_eq!(v["env"]["RUST_LOG"], "debug");
        assert_eq!(v["env"]["Api_Key"], "[redacted]");
        assert_eq!(v["argv"][1], "[redacted]");
        assert_eq!(v["nested"]["env"]["MY_SECRET"], "[redacted]");
        assert_eq!(v["nested"]["n"], 5);
        assert_eq!(v["nested"]["stdout"]["text"], "[redacted]");
    }

    #[test]
    fn large_contents_become_digests_and_strings_are_capped() {
        let big = "é".repeat(MAX_FIELD_BYTES); // 2 bytes each
        let mut v = json!({ "path": "a", "content": big });
        digest_large_field(&mut v, "content");
        assert_eq!(v["content"]["bytes"], 2 * MAX_FIELD_BYTES);
        assert_eq!(v["content"]["sha256"], sha256_hex(big.as_bytes()));
        let mut small = json!({ "content": "tiny" });
        digest_large_field(&mut small, "content");
        assert_eq!(small["content"], "tiny");

        let mut v = json!({ "a": [big.clone()], "b": "short" });
        cap_strings(&mut v);
        let a = v["a"][0].as_str().unwrap();
        assert!(a.len() < MAX_FIELD_BYTES + 100);
        assert!(a.ends_with(&format!(
            "[taskbox trace: {} more bytes not recorded]",
            MAX_FIELD_BYTES
        )));
        assert_eq!(v["b"], "short");
    }

    #[test]
    fn sha256_is_lowercase_hex() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn the_policy_toml_rebuilds_the_policy() {
        let (policy, _) = policy::resolve("default").unwrap();
        let text = policy_toml("default", &policy.hash()).unwrap();
        let back = policy::parse(&text, "trace").unwrap();
        assert_eq!(back.hash(), policy.hash());
        assert_eq!(policy_toml("default", "not-the-hash"), None);
    }

    #[test]
    fn workspace_base_of_a_plain_directory_and_a_git_checkout() {
        let dir = tempfile::tempdir().unwrap();
        let empty = crate::digest::dir_digest(dir.path()).unwrap();
        assert_eq!(
            workspace_base(dir.path()),
            WorkspaceBase::Dir {
                sha256: empty.sha256,
                entries: 0,
                bytes: 0
            }
        );
        let git_ok = std::process::Command::new("git")
            .arg("-C")
            .arg(dir.path())
            .args(["init", "-q"])
            .status()
            .is_ok_and(|s| s.success());
        if !git_ok {
            eprintln!("SKIP: git is not available");
            return;
        }
        // A repository without commits has no HEAD: its content is the base.
        assert!(
            matches!(workspace_base(dir.path()), WorkspaceBase::Dir { entries, .. } if entries > 0),
            "{:?}",
            workspace_base(dir.path())
        );
        fs::write(dir.path().join("f"), "x").unwrap();
        let commit = std::process::Command::new("git")
            .arg("-C")
            .arg(dir.path())
            .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
            .args([
                "-c",
                "commit.gpgsign=false",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "m",
            ])
            .status()
            .unwrap();
        assert!(commit.success());
        match workspace_base(dir.path()) {
            WorkspaceBase::Git { commit, dirty } => {
                assert_eq!(commit.len(), 40);
                assert!(dirty, "f is untracked");
            }
            other => panic!("{other:?}"),
        }
    }

    fn header() -> TraceHeader {
        TraceHeader {
            version: 1,
            taskbox: "0.1.0".into(),
            sandbox: "sb-1".into(),
            created_at_ms: 1_000,
            backend: "native".into(),
            image: "host".into(),
            policy: "default".into(),
            policy_hash: "ab".repeat(32),
            policy_toml: None,
            workspace: "/w".into(),
            workspace_base: WorkspaceBase::Git {
                commit: "c".repeat(40),
                dirty: false,
            },
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            adopted: false,
            fork: None,
        }
    }

    fn op(seq: u64, name: &str, request: Value, outcome: Outcome) -> TraceOp {
        TraceOp {
            seq,
            op: name.into(),
            started_at_ms: 1_000 + seq * 500,
            duration_ms: 12,
            request,
            outcome,
            start: None,
        }
    }

    fn sample() -> Vec<u8> {
        let mut out = header_line(&header());
        let ops = [
            op(
                1,
                "create",
                json!({"workspace": "/w"}),
                Outcome::Ok(json!({})),
            ),
            op(
                2,
                "exec",
                json!({"shell": "cargo test"}),
                Outcome::Ok(json!({"exit_code": 0, "signal": null, "timed_out": false,
                    "violations": []})),
            ),
            op(
                3,
                "exec",
                json!({"argv": ["curl", "https://evil.example"]}),
                Outcome::Ok(json!({"exit_code": 7, "signal": null, "timed_out": false,
                    "violations": [{"kind": "network", "detail": "connect evil.example:443 denied"}],
                    "network": {"allowed": 2, "denied": 1, "failed": 0, "bytes_up": 10,
                        "bytes_down": 2000, "open": 0, "connections": [], "omitted": 0}})),
            ),
            op(
                4,
                "edit",
                json!({"path": "src/lib.rs"}),
                Outcome::Ok(json!({})),
            ),
            op(
                5,
                "patch",
                json!({"patch": "--- a\n+++ b\n"}),
                Outcome::Error(ErrorBody {
                    code: "patch_failed".into(),
                    message: "hunk 1 of src/lib.rs does not apply".into(),
                }),
            ),
        ];
        for o in ops {
            out.extend(op_line(&o));
        }
        out
    }

    #[test]
    fn an_op_line_is_written_as_the_line_it_is_read_as() {
        let o = op(
            3,
            "exec",
            json!({"argv": ["true"]}),
            Outcome::Ok(json!({"exit_code": 0})),
        );
        let mut owned = serde_json::to_vec(&Line::Op(o.clone())).unwrap();
        owned.push(b'\n');
        assert_eq!(op_line(&o), owned);
    }

    fn write_tmp(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        fs::write(&p, bytes).unwrap();
        (dir, p)
    }

    #[test]
    fn a_complete_trace_reads_back() {
        let (_d, p) = write_tmp(&sample());
        let t = read_trace(&p).unwrap();
        assert_eq!(t.header, header());
        assert_eq!(t.ops.len(), 5);
        assert_eq!(t.torn_tail, None);
        assert_eq!(
            t.ops.iter().map(|o| o.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        let first = String::from_utf8(sample()).unwrap();
        assert!(
            first.starts_with(r#"{"type":"header","version":1,"#),
            "{first}"
        );
        assert!(
            first
                .lines()
                .nth(1)
                .unwrap()
                .starts_with(r#"{"type":"op","seq":1,"op":"create","#)
        );
    }

    #[test]
    fn a_torn_tail_is_reported_not_fatal() {
        let full = sample();
        // Cut in the middle of the last line.
        let cut = full.len() - 20;
        let (_d, p) = write_tmp(&full[..cut]);
        let t = read_trace(&p).unwrap();
        assert_eq!(t.ops.len(), 4);
        assert!(
            t.torn_tail
                .as_deref()
                .unwrap()
                .starts_with(r#"{"type":"op","seq":5"#)
        );
        assert!(render_text(&t).contains("incomplete line"));
        // A complete last line without its newline is torn too.
        let (_d, p) = write_tmp(&full[..full.len() - 1]);
        let t = read_trace(&p).unwrap();
        assert_eq!(t.ops.len(), 4);
        assert!(t.torn_tail.is_some());
        // Invalid JSON on a last line that does end in a newline.
        let mut bad = full.clone();
        bad.extend(b"{\"type\":\"op\",\"se\n");
        let (_d, p) = write_tmp(&bad);
        let t = read_trace(&p).unwrap();
        assert_eq!(t.ops.len(), 5);
        assert!(t.torn_tail.is_some());
    }

    #[test]
    fn reopening_cuts_the_torn_tail_and_continues_the_sequence() {
        let full = sample();
        let (_d, p) = write_tmp(&full[..full.len() - 20]);
        let tf = reopen(&p).unwrap();
        assert_eq!(tf.next_seq, 5);
        assert!(!tf.closed);
        let h = Arc::new(Mutex::new(tf));
        append_op(
            &h,
            op(0, "diff", json!({}), Outcome::Ok(json!({}))),
            false,
            None,
        )
        .unwrap();
        let t = read_trace(&p).unwrap();
        assert_eq!(t.torn_tail, None);
        assert_eq!(t.ops.len(), 5);
        assert_eq!(t.ops[4].op, "diff");
        assert_eq!(t.ops[4].seq, 5);
        append_op(
            &h,
            op(0, "destroy", json!({}), Outcome::Ok(Value::Null)),
            true,
            None,
        )
        .unwrap();
        append_op(
            &h,
            op(0, "exec", json!({}), Outcome::Ok(json!({}))),
            false,
            None,
        )
        .unwrap();
        let t = read_trace(&p).unwrap();
        assert_eq!(t.ops.last().unwrap().op, "destroy", "nothing after destroy");
        assert!(reopen(&p).unwrap().closed);
    }

    #[test]
    fn invalid_lines_missing_headers_and_new_versions_are_errors() {
        let full = String::from_utf8(sample()).unwrap();
        let mut lines: Vec<&str> = full.lines().collect();
        lines[2] = "{not json";
        let (_d, p) = write_tmp((lines.join("\n") + "\n").as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert!(e.contains("line 3: invalid json"), "{e}");

        let without_header: String = full.lines().skip(1).map(|l| format!("{l}\n")).collect();
        let (_d, p) = write_tmp(without_header.as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert!(e.contains("has no header"), "{e}");
        let (_d, p) = write_tmp(b"");
        assert!(matches!(
            read_trace(&p),
            Err(TraceError::MissingHeader { .. })
        ));

        let newer = full.replacen("\"version\":1", "\"version\":99", 1);
        let (_d, p) = write_tmp(newer.as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert_eq!(
            e,
            "trace version 99 is newer than this taskbox understands (2); upgrade taskbox"
        );

        let gap = full.replacen("\"seq\":4", "\"seq\":7", 1);
        let (_d, p) = write_tmp(gap.as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert!(e.contains("line 5: expected seq 4, found 7"), "{e}");

        let missing = tempfile::tempdir().unwrap();
        let e = read_trace(&missing.path().join("nope.jsonl")).unwrap_err();
        assert!(e.to_string().starts_with("cannot read trace"), "{e}");
    }

    #[test]
    fn older_and_unversioned_traces_are_refused_clearly() {
        let full = String::from_utf8(sample()).unwrap();
        let older = full.replacen("\"version\":1", "\"version\":0", 1);
        let (_d, p) = write_tmp(older.as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert!(
            e.contains("line 1: trace version 0 is older than any"),
            "{e}"
        );
        let none = full.replacen("\"version\":1,", "", 1);
        let (_d, p) = write_tmp(none.as_bytes());
        let e = read_trace(&p).unwrap_err().to_string();
        assert!(e.contains("no numeric \"version\" field"), "{e}");
    }

    #[test]
    fn timestamps_past_the_year_9999_read_as_numbers() {
        assert_eq!(timestamp_ms(1_000), "1970-01-01T00:00:01.000Z");
        // A forged header's time: shown as the number, and the pages still render.
        assert_eq!(
            timestamp_ms(17_960_328_326_032_832_438),
            "17960328326032832438 ms after 1970 (out of range)"
        );
        assert_eq!(
            timestamp_ms(u64::MAX),
            format!("{} ms after 1970 (out of range)", u64::MAX)
        );
    }

    #[test]
    fn render_text_summarises() {
        let (_d, p) = write_tmp(&sample());
        let text = render_text(&read_trace(&p).unwrap());
        assert!(text.contains("sandbox sb-1"), "{text}");
        assert!(text.contains("policy     default"), "{text}");
        assert!(text.contains("base git cccccccccccc"), "{text}");
        assert!(
            text.contains("exec       exit 0  12ms  cargo test"),
            "{text}"
        );
        assert!(
            text.contains("exit 7  12ms  curl https://evil.example"),
            "{text}"
        );
        assert!(
            text.contains("violation network: connect evil.example:443 denied"),
            "{text}"
        );
        assert!(
            text.contains("network: 2 allowed, 1 denied, 0 failed; 10 bytes up, 2000 down"),
            "{text}"
        );
        assert!(text.contains("edit       ok  12ms  src/lib.rs"), "{text}");
        assert!(
            text.contains("patch      failed: patch_failed  12ms"),
            "{text}"
        );
        assert!(
            text.contains("\n        hunk 1 of src/lib.rs does not apply\n"),
            "{text}"
        );
        assert!(text.contains("#2       +1.0s  exec"), "{text}");
        assert!(
            text.contains("5 ops, 2 execs (1 not exit 0), 1 failed, 1 violations"),
            "{text}"
        );
        assert!(!text.contains("incomplete"), "{text}");
    }

    #[test]
    fn shell_words_are_quoted_when_needed() {
        assert_eq!(shell_word("cargo"), "cargo");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
