//! Replay: re-run a recorded trace in a clean sandbox and say where the new run diverges.
//!
//! Three steps, each usable alone:
//!
//! 1. [`prepare_workspace`] rebuilds the workspace at its recorded base in a fresh directory: a
//!    clean checkout of the recorded git commit (from the repository given, else the recorded
//!    workspace path), a tar whose SHA-256 is checked against the header when it records one, or
//!    a copy of a directory.
//! 2. [`ReplaySetup::create_request`] turns the header into a create request: the same image
//!    digest, the recorded policy TOML (its hash checked), the recorded env.
//! 3. [`replay`] creates the sandbox through any [`SandboxApi`], re-issues the recorded
//!    operations in order and compares each new observation with the recorded one, shaped and
//!    redacted exactly as the trace writer records it ([`crate::trace::observe`]).
//!
//! What is compared, per operation, is the part of the observation that a faithful re-run must
//! reproduce: exit code, signal, timeout, output (digest and redacted text), changed files and
//! violations of execs; contents, diffs and results of file operations; ok versus error (by
//! code) for everything. Timings, ids, resource use and enforcement are not compared. Named
//! [`Normalization`]s, chosen by the user, mask volatile text (timestamps, durations,
//! temporary paths, pids) on both sides before output is compared; the trace is never altered.
//! See `docs/replay.md`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use regex::Regex;
use serde::Serialize;
use serde_json::{Value, json};

use crate::api::*;
use crate::commands::Verdict;
use crate::policy::{self, Policy};
use crate::trace::{self, ErrorBody, Outcome, Trace, TraceHeader, TraceOp, WorkspaceBase};

/// Why a replay could not start (a divergence is not an error: it is in the report).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace records no workspace base and none was given.
    #[error(
        "the trace records no workspace base (the workspace was not a git checkout): pass the \
         workspace's content with --workspace-tar FILE or --workspace-dir DIR"
    )]
    NoBase,
    /// The recorded commit is in none of the repositories looked in.
    #[error(
        "commit {commit} of the recorded workspace is not in {looked}: pass a repository that \
         has it with --repo DIR"
    )]
    MissingCommit { commit: String, looked: String },
    /// A tar's digest differs from the recorded one.
    #[error("workspace tar {} has sha256 {actual}, but the trace recorded {expected}", path.display())]
    TarDigest {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// The content of a plain-directory workspace differs from the recorded one.
    #[error(
        "workspace {} has content digest sha256 {actual}, but the trace recorded sha256 \
         {expected}: its files differ from the directory the trace began in; pass that \
         content with --workspace-dir DIR or --workspace-tar FILE",
        from.display()
    )]
    DirDigest {
        /// Where the content came from (a directory or a tar).
        from: PathBuf,
        expected: String,
        actual: String,
    },
    /// The workspace could not be rebuilt.
    #[error("cannot prepare the workspace in {}: {reason}", dir.display())]
    Workspace { dir: PathBuf, reason: String },
    /// The header has no usable policy text.
    #[error(
        "the trace has no policy text (policy {name:?} was not recorded): pass the policy with \
         --policy NAME|FILE"
    )]
    NoPolicy { name: String },
    /// The recorded policy text does not hash to the recorded hash.
    #[error(
        "the trace's policy text does not match its hash {expected} (found {actual}): the trace was altered"
    )]
    PolicyHash { expected: String, actual: String },
    /// The policy text does not parse.
    #[error("the trace's policy text is invalid: {0}")]
    Policy(#[from] policy::PolicyError),
    /// The replay sandbox could not be created.
    #[error("cannot create the replay sandbox: {0}")]
    Create(ApiError),
    /// The trace is a fork's, and its ancestors' traces are missing or do not lead to it.
    #[error("cannot rebuild the fork: {0}")]
    Ancestors(String),
    /// Local I/O around the replay failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A named normalisation of volatile text, applied to both sides before output is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Normalization {
    /// RFC 3339 / ISO 8601 date-times, `HH:MM:SS` clock times and `Mon Nov 30` style dates.
    Timestamps,
    /// Numbers with a time unit: `0.42s`, `12 ms`, `1m30s`, `in 3.1 seconds`.
    Durations,
    /// Paths under `/tmp/` and `/var/tmp/` (their last part is usually random).
    TempPaths,
    /// Process ids written as `pid 123`, `pid=123`, `pid: 123`, `[123]` after a word.
    Pids,
}

impl Normalization {
    /// Every normalisation, by name.
    pub const ALL: [Normalization; 4] = [
        Normalization::Timestamps,
        Normalization::Durations,
        Normalization::TempPaths,
        Normalization::Pids,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Normalization::Timestamps => "timestamps",
            Normalization::Durations => "durations",
            Normalization::TempPaths => "temp-paths",
            Normalization::Pids => "pids",
        }
    }

    /// Parses a comma-separated list (`all` selects every one).
    pub fn parse_list(s: &str) -> Result<Vec<Normalization>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "all" {
                out.extend(Normalization::ALL);
            } else {
                out.push(part.parse()?);
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    fn pattern(self) -> (&'static str, &'static str) {
        match self {
            Normalization::Timestamps => (
                r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b|\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun),? +(?:\d{1,2} +)?(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)(?: +\d{1,2})?\b|\b\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\b",
                "<timestamp>",
            ),
            Normalization::Durations => (
                r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|secs|seconds?|m|min|mins|minutes?|h)\b(?:\d+(?:\.\d+)?\s?(?:ms|s)\b)?",
                "<duration>",
            ),
            Normalization::TempPaths => (r"(?:/var)?/tmp/[A-Za-z0-9._/+-]*", "/tmp/<tmp>"),
            Normalization::Pids => (r"(?i)(\bpid\s*[:=]?\s*|\bprocess\s+|\w\[)\d+", "${1}<pid>"),
        }
    }
}

impl FromStr for Normalization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Normalization::ALL
            .into_iter()
            .find(|n| n.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown normalisation {s:?}: use timestamps, durations, temp-paths, pids or all"
                )
            })
    }
}

static NORMALIZERS: LazyLock<Vec<(Normalization, Option<Regex>)>> = LazyLock::new(|| {
    Normalization::ALL
        .into_iter()
        .map(|n| (n, Regex::new(n.pattern().0).ok()))
        .collect()
});

/// Applies `list` to `s` (a normalisation whose pattern failed to compile, a bug the unit
/// tests catch, masks nothing).
pub fn normalize(list: &[Normalization], s: &str) -> String {
    let mut out = s.to_string();
    for (n, re) in NORMALIZERS.iter() {
        if let (true, Some(re)) = (list.contains(n), re) {
            out = re.replace_all(&out, n.pattern().1).into_owned();
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The workspace
// ---------------------------------------------------------------------------------------------

/// Where the workspace's content comes from.
#[derive(Debug, Clone, Default)]
pub enum BaseSource {
    /// The recorded base: a git commit, looked for in `repo` when given, else in the recorded
    /// workspace path.
    #[default]
    Recorded,
    /// A git repository holding the recorded commit.
    Repo(PathBuf),
    /// A tar of the workspace (checked against the header's digest when it records one).
    Tar(PathBuf),
    /// A directory copied as the workspace.
    Dir(PathBuf),
}

/// A workspace rebuilt for replay.
#[derive(Debug, Clone)]
pub struct PreparedWorkspace {
    pub dir: PathBuf,
    /// Things the user should know (e.g. the recorded workspace was dirty).
    pub notes: Vec<String>,
}

/// Rebuilds the workspace at its recorded base in `into/workspace` (`into` must exist and be
/// empty of a `workspace` entry).
pub fn prepare_workspace(
    header: &TraceHeader,
    source: &BaseSource,
    into: &Path,
) -> Result<PreparedWorkspace, ReplayError> {
    let dir = into.join("workspace");
    let mut notes = Vec::new();
    match (source, &header.workspace_base) {
        (BaseSource::Tar(tar), base) => {
            let actual = file_sha256(tar)?;
            match base {
                WorkspaceBase::Tar { sha256 } if *sha256 != actual => {
                    return Err(ReplayError::TarDigest {
                        path: tar.clone(),
                        expected: sha256.clone(),
                        actual,
                    });
                }
                WorkspaceBase::Tar { .. } | WorkspaceBase::Dir { .. } => {}
                _ => notes.push(format!(
                    "the trace records no tar digest; workspace taken from {} (sha256 {actual}) unchecked",
                    tar.display()
                )),
            }
            unpack_tar(tar, &dir)?;
            check_content(&header.workspace_base, tar, &dir)?;
        }
        (BaseSource::Dir(src), base) => {
            if !matches!(base, WorkspaceBase::Dir { .. }) {
                notes.push(format!(
                    "workspace copied from {}; its content is not checked against the trace",
                    src.display()
                ));
            }
            copy_dir(src, &dir)?;
            check_content(base, src, &dir)?;
        }
        (BaseSource::Recorded | BaseSource::Repo(_), WorkspaceBase::Dir { .. }) => {
            // The recorded directory itself, when its content is still the recorded one.
            let src = PathBuf::from(&header.workspace);
            if !src.is_dir() {
                return Err(ReplayError::NoBase);
            }
            copy_dir(&src, &dir)?;
            check_content(&header.workspace_base, &src, &dir)?;
        }
        (BaseSource::Recorded | BaseSource::Repo(_), WorkspaceBase::Git { commit, dirty }) => {
            let repos: Vec<PathBuf> = match source {
                BaseSource::Repo(r) => vec![r.clone()],
                _ => vec![PathBuf::from(&header.workspace)],
            };
            let repo = repos
                .iter()
                .find(|r| has_commit(r, commit))
                .ok_or_else(|| ReplayError::MissingCommit {
                    commit: commit.clone(),
                    looked: repos
                        .iter()
                        .map(|r| r.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            checkout(repo, commit, &dir)?;
            if *dirty {
                notes.push(format!(
                    "the recorded workspace had changes not in commit {}; the clean checkout \
                     lacks them, so divergences may follow from that",
                    short(commit)
                ));
            }
        }
        (BaseSource::Recorded | BaseSource::Repo(_), WorkspaceBase::Tar { .. }) => {
            return Err(ReplayError::NoBase);
        }
        (BaseSource::Recorded | BaseSource::Repo(_), WorkspaceBase::None) => {
            return Err(ReplayError::NoBase);
        }
    }
    Ok(PreparedWorkspace { dir, notes })
}

/// With a recorded directory digest: the rebuilt workspace `dir` (from `source`) must have it.
/// The copy is what is checked, so a source changing meanwhile cannot slip past.
fn check_content(base: &WorkspaceBase, source: &Path, dir: &Path) -> Result<(), ReplayError> {
    let WorkspaceBase::Dir { sha256, .. } = base else {
        return Ok(());
    };
    let actual = crate::digest::dir_digest(dir)
        .map_err(|e| workspace_err(dir, format!("cannot digest the rebuilt workspace: {e}")))?;
    if actual.sha256 != *sha256 {
        return Err(ReplayError::DirDigest {
            from: source.to_path_buf(),
            expected: sha256.clone(),
            actual: actual.sha256,
        });
    }
    Ok(())
}

/// SHA-256 of a file, streamed.
pub fn file_sha256(path: &Path) -> Result<String, ReplayError> {
    use sha2::Digest;
    let io_err = |source| ReplayError::Io {
        what: "read",
        path: path.to_path_buf(),
        source,
    };
    let mut f = fs::File::open(path).map_err(io_err)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

/// Unpacks a trace's workspace base (a tar) into `dir`, which it creates; entries that would land
/// outside it are refused.
pub fn unpack_tar(tar: &Path, dir: &Path) -> Result<(), ReplayError> {
    let f = fs::File::open(tar).map_err(|source| ReplayError::Io {
        what: "read",
        path: tar.to_path_buf(),
        source,
    })?;
    fs::create_dir_all(dir).map_err(|source| ReplayError::Io {
        what: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut archive = tar::Archive::new(f);
    archive.set_preserve_permissions(true);
    archive.set_overwrite(false);
    // `unpack` refuses entries that would land outside `dir` (`..`, absolute paths, links).
    archive
        .unpack(dir)
        .map_err(|e| workspace_err(dir, format!("cannot unpack {}: {e}", tar.display())))
}

fn copy_dir(src: &Path, dir: &Path) -> Result<(), ReplayError> {
    if !src.is_dir() {
        return Err(workspace_err(
            dir,
            format!("{} is not a directory", src.display()),
        ));
    }
    let mut from = src.as_os_str().to_os_string();
    from.push("/.");
    run_tool(
        Command::new("cp").arg("-a").arg("--").arg(&from).arg(dir),
        dir,
        "cp",
    )
}

fn workspace_err(dir: &Path, reason: String) -> ReplayError {
    ReplayError::Workspace {
        dir: dir.to_path_buf(),
        reason,
    }
}

fn has_commit(repo: &Path, commit: &str) -> bool {
    repo.join(".git").exists()
        && commit.bytes().all(|b| b.is_ascii_hexdigit())
        && trace::git_command(repo)
            .args(["cat-file", "-e"])
            .arg(format!("{commit}^{{commit}}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// A clean checkout of `commit` in `dir`: a local clone (objects copied, so the checkout does
/// not depend on the source repository) detached at the commit.
fn checkout(repo: &Path, commit: &str, dir: &Path) -> Result<(), ReplayError> {
    run_tool(
        Command::new("git")
            .args(["clone", "--quiet", "--no-checkout", "--no-hardlinks", "--"])
            .arg(repo)
            .arg(dir)
            .env("GIT_TERMINAL_PROMPT", "0")
            .stdin(Stdio::null()),
        dir,
        "git clone",
    )?;
    run_tool(
        trace::git_command(dir).args([
            "-c",
            "advice.detachedHead=false",
            "checkout",
            "--quiet",
            "--detach",
            commit,
        ]),
        dir,
        "git checkout",
    )
}

fn run_tool(cmd: &mut Command, dir: &Path, what: &str) -> Result<(), ReplayError> {
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| workspace_err(dir, format!("cannot run {what}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(workspace_err(
            dir,
            format!(
                "{what} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ))
    }
}

fn short(s: &str) -> &str {
    s.get(..12).unwrap_or(s)
}

// ---------------------------------------------------------------------------------------------
// The sandbox
// ---------------------------------------------------------------------------------------------

/// How to rebuild the recorded sandbox.
#[derive(Debug, Clone, Default)]
pub struct ReplaySetup {
    /// The backend (default: the recorded one).
    pub backend: Option<String>,
    /// The image (default: the recorded digest; "host" for the host view).
    pub image: Option<String>,
    /// A policy name or file instead of the recorded policy text (whose hash is then not
    /// checked against the header).
    pub policy: Option<String>,
}

impl ReplaySetup {
    /// The policy the replay runs under (the recorded TOML, checked against its hash, or the
    /// override), resolved once for its create request.
    pub fn policy(&self, header: &TraceHeader) -> Result<ResolvedPolicy, ReplayError> {
        if let Some(p) = &self.policy {
            let (policy, _) = policy::resolve(p)?;
            return Ok(ResolvedPolicy {
                name: p.clone(),
                hash: policy.hash(),
                policy,
            });
        }
        let text = header
            .policy_toml
            .as_deref()
            .ok_or_else(|| ReplayError::NoPolicy {
                name: header.policy.clone(),
            })?;
        let policy = policy::parse(text, "the trace header")?;
        if policy.hash() != header.policy_hash {
            return Err(ReplayError::PolicyHash {
                expected: header.policy_hash.clone(),
                actual: policy.hash(),
            });
        }
        Ok(ResolvedPolicy {
            name: header.policy.clone(),
            hash: policy.hash(),
            policy,
        })
    }

    /// The create request of the replay sandbox.
    pub fn create_request(
        &self,
        header: &TraceHeader,
        workspace: &Path,
        policy: ResolvedPolicy,
    ) -> CreateRequest {
        let image = self.image.clone().unwrap_or_else(|| header.image.clone());
        let mut labels = header.labels.clone();
        labels.insert("taskbox.replay-of".into(), header.sandbox.clone());
        CreateRequest {
            workspace: workspace.display().to_string(),
            workspace_id: None,
            policy: Some(policy.name.clone()),
            policy_toml: None,
            backend: Some(
                self.backend
                    .clone()
                    .unwrap_or_else(|| header.backend.clone()),
            ),
            image: (image != "host").then_some(image),
            env: header.env.clone(),
            labels,
            ttl_secs: None,
            // No trace holds a secret's value: secrets that come from the environment or a
            // file are read again, and one that came with the create request cannot be.
            secrets: BTreeMap::new(),
            resolved_policy: Some(std::sync::Arc::new(policy)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------------

/// How one operation replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpStatus {
    /// The new observation matches the recorded one.
    Match,
    /// It does not; see the mismatches.
    Diverged,
    /// It was not re-issued; see the reason.
    Skipped,
}

/// One field that differs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mismatch {
    /// e.g. `exit_code`, `stdout`, `changes`, `outcome`.
    pub field: String,
    pub expected: Value,
    pub actual: Value,
    /// A unified diff (expected -> actual) of a text field, when there is one.
    pub diff: Option<String>,
}

/// One replayed operation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpReport {
    pub seq: u64,
    pub op: String,
    /// The operation in a few words (its command, path, ...).
    pub detail: String,
    pub status: OpStatus,
    /// Why it was skipped.
    pub reason: Option<String>,
    pub mismatches: Vec<Mismatch>,
    pub recorded_ms: u64,
    pub replay_ms: u64,
}

/// The result of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    pub recorded_sandbox: String,
    pub sandbox: String,
    pub backend: String,
    pub image: String,
    pub normalizations: Vec<Normalization>,
    pub ops: Vec<OpReport>,
    pub matched: usize,
    pub diverged: usize,
    pub skipped: usize,
    pub notes: Vec<String>,
    /// Milliseconds spent inside the backend's calls (the operations themselves), to the
    /// microsecond.
    pub backend_ms: f64,
    /// Milliseconds of the whole replay, create and destroy included.
    pub total_ms: f64,
}

impl ReplayReport {
    /// Whether every replayed operation matched.
    pub fn ok(&self) -> bool {
        self.diverged == 0
    }

    /// The first divergence.
    pub fn first_divergence(&self) -> Option<&OpReport> {
        self.ops.iter().find(|o| o.status == OpStatus::Diverged)
    }
}

/// What to compare with.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    pub normalize: Vec<Normalization>,
    /// For the trace of a fork: the traces of its ancestors, the first sandbox first
    /// ([`ancestors_of`]). The replay rebuilds the fork by replaying each up to the fork it
    /// made, forking there, and going on in the fork.
    pub ancestors: Vec<Trace>,
}

/// The traces of the ancestors of a fork whose trace is `trace` (read from `path`): its
/// parent's, its parent's parent's, ..., read from the same directory, the first sandbox first.
/// Empty for a trace that is no fork's.
pub fn ancestors_of(trace: &Trace, path: &Path) -> Result<Vec<Trace>, ReplayError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut chain = Vec::new();
    let mut point = trace.header.fork.clone();
    while let Some(p) = point {
        if chain.len() >= 64 {
            return Err(ReplayError::Ancestors(format!(
                "the chain of forks above {} is longer than 64 sandboxes",
                trace.header.sandbox
            )));
        }
        let parent_path = dir.join(format!("{}.jsonl", p.parent));
        let parent = trace::read_trace(&parent_path).map_err(|e| {
            ReplayError::Ancestors(format!(
                "the trace of the fork's parent {} cannot be read: {e}",
                p.parent
            ))
        })?;
        if !parent.ops.iter().any(|o| o.seq == p.seq && o.op == "fork") {
            return Err(ReplayError::Ancestors(format!(
                "the trace of {} has no fork at seq {}",
                p.parent, p.seq
            )));
        }
        point = parent.header.fork.clone();
        chain.push(parent);
    }
    chain.reverse();
    Ok(chain)
}

// ---------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------

/// Replays `trace` through `api`: creates the sandbox with `create` under `policy`, re-issues
/// the operations in order, compares, destroys the sandbox. Fails only when the sandbox cannot
/// be created; everything after that is in the report.
pub fn replay(
    trace: &Trace,
    api: &dyn SandboxApi,
    create: CreateRequest,
    policy: &Policy,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let started = Instant::now();
    let mut notes = Vec::new();
    if let Some(tail) = &trace.torn_tail {
        notes.push(format!(
            "the trace ends in an incomplete line ({} bytes, a write cut short by a crash); it \
             was never acknowledged and is not replayed",
            tail.len()
        ));
    }
    for st in &trace.unfinished {
        notes.push(format!(
            "{} (start {}) ran, or was running, when the recorded supervisor stopped; its \
             observation was never recorded, so it is not replayed and what follows may diverge",
            st.op, st.start
        ));
    }
    if trace.header.adopted {
        notes.push(
            "the trace's header was made after create: the create request (its env) is unknown"
                .into(),
        );
    }
    if trace.header.env.values().any(|v| v == trace::REDACTED) {
        notes.push(
            "some env values were redacted in the trace; the replay sets them to the redaction \
             marker"
                .into(),
        );
    }
    let image = create.image.clone().unwrap_or_else(|| "host".into());
    let backend_name = create.backend.clone().unwrap_or_default();
    let timed = Timed {
        inner: api,
        spent: std::sync::Mutex::new(Duration::ZERO),
    };
    let api: &dyn SandboxApi = &timed;
    let info = api.create(create).map_err(ReplayError::Create)?;
    let mut engine = Engine {
        api,
        id: info.id.clone(),
        policy,
        opts,
        processes: HashMap::new(),
        ws_subst: None,
    };
    if !opts.ancestors.is_empty() {
        // A fork: replay each ancestor up to the fork it made, then go on in the fork.
        if let Some(rec_ws) = opts.ancestors[0]
            .ops
            .first()
            .and_then(|o| match &o.outcome {
                Outcome::Ok(v) => v.get("workspace").and_then(Value::as_str),
                Outcome::Error(_) => None,
            })
            && rec_ws != info.workspace
            && image == "host"
        {
            engine.ws_subst = Some((info.workspace.clone(), rec_ws.to_string()));
        }
        let points = opts
            .ancestors
            .iter()
            .skip(1)
            .map(|t| &t.header)
            .chain(std::iter::once(&trace.header))
            .filter_map(|h| h.fork.clone());
        for (ancestor, point) in opts.ancestors.iter().zip(points) {
            let prefix = ancestor
                .ops
                .iter()
                .skip_while(|o| o.name() == Some(OpName::Create))
                .take_while(|o| o.seq < point.seq);
            let (mut matched, mut diverged, mut skipped) = (0, 0, 0);
            for op in prefix {
                match engine.step(op).status {
                    OpStatus::Match => matched += 1,
                    OpStatus::Diverged => diverged += 1,
                    OpStatus::Skipped => skipped += 1,
                }
            }
            notes.push(format!(
                "rebuilt from {}: its operations up to its fork at seq {} replayed first \
                 ({matched} matched, {diverged} diverged, {skipped} skipped), then forked{}",
                ancestor.header.sandbox,
                point.seq,
                point
                    .checkpoint
                    .as_ref()
                    .map(|c| format!(" from checkpoint {c}"))
                    .unwrap_or_default()
            ));
            let forked = api.fork(
                &engine.id,
                ForkRequest {
                    count: Some(1),
                    checkpoint: point.checkpoint.clone(),
                    ..ForkRequest::default()
                },
            );
            let _ = api.destroy(&engine.id);
            let fork = forked
                .map_err(ReplayError::Create)?
                .sandboxes
                .into_iter()
                .next()
                .ok_or_else(|| ReplayError::Ancestors("the fork made no sandbox".into()))?;
            engine.id = fork.id;
            engine.processes.clear();
        }
    }
    let info = match opts.ancestors.is_empty() {
        true => info,
        false => api.info(&engine.id).map_err(ReplayError::Create)?,
    };
    let mut ops = Vec::with_capacity(trace.ops.len());
    let mut destroyed = false;
    for (i, op) in trace.ops.iter().enumerate() {
        if i == 0 && op.name() == Some(OpName::Create) {
            let mut r = report_of(op);
            if let Outcome::Ok(rec) = &op.outcome {
                // Outputs mention the workspace where commands see it: the host path with the
                // host view, so a replay in another directory rewrites its own path back.
                if let Some(rec_ws) = rec.get("workspace").and_then(Value::as_str)
                    && engine.ws_subst.is_none()
                    && rec_ws != info.workspace
                    && image == "host"
                {
                    engine.ws_subst = Some((info.workspace.clone(), rec_ws.to_string()));
                }
                let fields = ["image", "policy_hash"];
                let actual = trace::to_json(&info);
                for f in fields {
                    if rec.get(f) != actual.get(f) {
                        r.mismatches.push(Mismatch {
                            field: f.into(),
                            expected: rec.get(f).cloned().unwrap_or(Value::Null),
                            actual: actual.get(f).cloned().unwrap_or(Value::Null),
                            diff: None,
                        });
                    }
                }
            }
            r.status = if r.mismatches.is_empty() {
                OpStatus::Match
            } else {
                OpStatus::Diverged
            };
            r.replay_ms = timed.spent().as_millis() as u64;
            ops.push(r);
            continue;
        }
        let before = timed.spent();
        let mut r = engine.step(op);
        r.replay_ms = (timed.spent() - before).as_millis() as u64;
        if op.name() == Some(OpName::Destroy) && r.status != OpStatus::Skipped {
            destroyed = true;
        }
        ops.push(r);
    }
    if !destroyed && let Err(e) = api.destroy(&info.id) {
        notes.push(format!(
            "cannot destroy the replay sandbox {}: {e}",
            info.id
        ));
    }
    let count = |s| ops.iter().filter(|o: &&OpReport| o.status == s).count();
    Ok(ReplayReport {
        recorded_sandbox: trace.header.sandbox.clone(),
        sandbox: info.id.to_string(),
        backend: if backend_name.is_empty() {
            info.backend.clone()
        } else {
            backend_name
        },
        image,
        normalizations: opts.normalize.clone(),
        matched: count(OpStatus::Match),
        diverged: count(OpStatus::Diverged),
        skipped: count(OpStatus::Skipped),
        ops,
        notes,
        backend_ms: timed.spent().as_secs_f64() * 1000.0,
        total_ms: started.elapsed().as_secs_f64() * 1000.0,
    })
}

/// The backend, with the time spent in its calls added up: what the operations themselves cost,
/// apart from the engine's own work.
struct Timed<'a> {
    inner: &'a dyn SandboxApi,
    spent: std::sync::Mutex<Duration>,
}

impl Timed<'_> {
    fn spent(&self) -> Duration {
        *self.spent.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        *self.spent.lock().unwrap_or_else(|p| p.into_inner()) += t.elapsed();
        r
    }
}

impl OpHandler for Timed<'_> {
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        self.time(|| self.inner.create(req))
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.inner.list()
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        self.time(|| self.inner.call(id, op))
    }
}

fn report_of(op: &TraceOp) -> OpReport {
    OpReport {
        seq: op.seq,
        op: op.op.clone(),
        detail: trace::op_detail(op),
        status: OpStatus::Match,
        reason: None,
        mismatches: Vec::new(),
        recorded_ms: op.duration_ms,
        replay_ms: 0,
    }
}

struct Engine<'a> {
    api: &'a dyn SandboxApi,
    id: SandboxId,
    policy: &'a Policy,
    opts: &'a ReplayOptions,
    /// Recorded background exec id -> the replay's.
    processes: HashMap<u64, u64>,
    /// (the replay's workspace path, the recorded one), rewritten in new observations.
    ws_subst: Option<(String, String)>,
}

/// Why an operation cannot be re-issued.
struct Skip(String);

impl Engine<'_> {
    fn step(&mut self, op: &TraceOp) -> OpReport {
        let mut r = report_of(op);
        match self.issue(op) {
            Ok((name, actual)) => {
                r.mismatches = self.compare(name, &op.outcome, &actual);
                r.status = if r.mismatches.is_empty() {
                    OpStatus::Match
                } else {
                    OpStatus::Diverged
                };
            }
            Err(Skip(reason)) => {
                r.status = OpStatus::Skipped;
                r.reason = Some(reason);
            }
        }
        r
    }

    /// Re-issues `op`; the new observation as the trace writer would record it.
    fn issue(&mut self, op: &TraceOp) -> Result<(OpName, Outcome), Skip> {
        let rq = &op.request;
        if let Some(cut) = find_cut(rq) {
            return Err(Skip(format!(
                "its request was cut in the trace ({cut}); it cannot be re-issued faithfully"
            )));
        }
        let name = op.name().ok_or_else(|| {
            Skip(format!(
                "operation kind {:?} is not known to this taskbox",
                op.op
            ))
        })?;
        match name {
            OpName::Create => return Err(Skip("a second create in one trace".into())),
            OpName::Upload | OpName::Download => {
                return Err(Skip(format!(
                    "a streamed {name}: the trace holds its content's digest, not the content"
                )));
            }
            OpName::Approve | OpName::Deny => {
                return Err(Skip(
                    "an answer to an approval; the exec that asked is replayed as it was \
                     answered"
                        .into(),
                ));
            }
            OpName::SetSecret if rq.get("action").and_then(Value::as_str) != Some("revoke") => {
                return Err(Skip(
                    "a secret's rotation: the trace never holds a secret's value".into(),
                ));
            }
            _ => {}
        }
        if let Some(field) = name.payload_field()
            && rq.get(field).is_some_and(Value::is_object)
        {
            return Err(Skip(format!(
                "its {field} (over 64 KiB) was recorded as a digest only"
            )));
        }
        let mut call = Op::from_request(name, rq)
            .map_err(|e| Skip(format!("its recorded request does not parse: {e}")))?;
        if let Some(exec_id) = call.exec_id_mut() {
            let old = *exec_id;
            *exec_id = *self.processes.get(&old).ok_or_else(|| {
                Skip(format!(
                    "background exec #{old} was not started by this replay"
                ))
            })?;
        }
        let mut background = false;
        match &mut call {
            Op::Exec { req, .. } => {
                if let Some(refused) = self.refused(req, &op.outcome)? {
                    return Ok((name, refused));
                }
                background = req.background;
            }
            // The replay never writes to a host workspace.
            Op::Export(req) => req.apply = false,
            _ => {}
        }
        let r = self.api.call(&self.id, call);
        // The forks it made have traces of their own, replayed on their own: they go at once.
        if let Ok(Answer::Fork(forked)) = &r {
            for f in &forked.sandboxes {
                let _ = self.api.destroy(&f.id);
            }
        }
        if let (true, Ok(Answer::Exec(ExecOutcome::Background(p))), Outcome::Ok(rec)) =
            (background, &r, &op.outcome)
            && let Some(old) = rec.get("exec_id").and_then(Value::as_u64)
        {
            self.processes.insert(old, p.exec_id);
        }
        Ok((name, trace::observe(&r)))
    }

    /// The observation of an exec the command policy refuses, as the policy would: a forbidden
    /// command, or one that asked and was refused then. `None` when it runs.
    fn refused(&self, req: &ExecRequest, recorded: &Outcome) -> Result<Option<Outcome>, Skip> {
        let argv = req
            .resolved_argv()
            .map_err(|e| Skip(format!("invalid recorded exec: {e}")))?;
        let refused = Some(Outcome::Ok(json!({ "refused": true })));
        Ok(match self.policy.commands.check(&argv).verdict {
            Verdict::Allow => None,
            // Answered as it was then: refused (denied, or no answer in time) or run.
            Verdict::Ask => match recorded {
                Outcome::Ok(rec) if violation_kinds(rec).iter().any(|k| k == "command") => refused,
                _ => None,
            },
            Verdict::Forbid => refused,
        })
    }

    /// The fields of the two observations that differ.
    fn compare(&self, name: OpName, expected: &Outcome, actual: &Outcome) -> Vec<Mismatch> {
        let mut m = Vec::new();
        let (rec, new) = match (expected, actual) {
            (Outcome::Error(a), Outcome::Error(b)) => {
                if a.code != b.code {
                    m.push(outcome_mismatch(expected, actual));
                }
                return m;
            }
            (Outcome::Ok(a), Outcome::Ok(b)) => (a, b),
            _ => {
                m.push(outcome_mismatch(expected, actual));
                return m;
            }
        };
        let new = &self.subst(new);
        match name {
            OpName::Exec if new.get("refused").is_some() => {
                let refused = violation_kinds(rec).contains(&"command".to_string());
                if !refused {
                    m.push(Mismatch {
                        field: "outcome".into(),
                        expected: json!("ran"),
                        actual: json!("refused by the command policy"),
                        diff: None,
                    });
                }
            }
            OpName::Exec if rec.get("exec_id").is_some() || new.get("exec_id").is_some() => {
                self.compare_fields(&mut m, rec, new, &["argv"]);
            }
            OpName::Exec => self.compare_exec(&mut m, "", rec, new),
            OpName::Wait => {
                self.compare_fields(&mut m, rec, new, &["running"]);
                if let (Some(a), Some(b)) = (rec.get("result"), new.get("result"))
                    && !a.is_null()
                    && !b.is_null()
                {
                    self.compare_exec(&mut m, "result.", a, b);
                }
            }
            // The forks' ids and times are new; how many were made is the observation.
            OpName::Fork => {
                let count = |v: &Value| v["sandboxes"].as_array().map(Vec::len);
                if count(rec) != count(new) {
                    m.push(Mismatch {
                        field: "sandboxes".into(),
                        expected: json!(count(rec)),
                        actual: json!(count(new)),
                        diff: None,
                    });
                }
            }
            // Snapshots of a running process and the answer to a signal depend on timing.
            OpName::Process | OpName::Kill | OpName::WriteStdin => {}
            OpName::Read => self.compare_fields(
                &mut m,
                rec,
                new,
                &["content", "encoding", "total_bytes", "truncated", "binary"],
            ),
            OpName::Write => self.compare_fields(&mut m, rec, new, &["bytes_written", "created"]),
            OpName::Edit => self.compare_fields(&mut m, rec, new, &["replacements", "diff"]),
            OpName::Patch => self.compare_fields(&mut m, rec, new, &["files"]),
            OpName::ListDir => {
                let a = entries_view(rec);
                let b = entries_view(new);
                if a != b {
                    m.push(Mismatch {
                        field: "entries".into(),
                        diff: text_diff(&pretty(&a), &pretty(&b)),
                        expected: a,
                        actual: b,
                    });
                }
                self.compare_fields(&mut m, rec, new, &["truncated"]);
            }
            OpName::Search => self.compare_fields(&mut m, rec, new, &["matches", "truncated"]),
            OpName::Stat => {
                let file = rec.get("kind") == Some(&json!("file"));
                let fields: &[&str] = if file {
                    &["kind", "size", "mode", "symlink_target"]
                } else {
                    &["kind", "mode", "symlink_target"]
                };
                self.compare_fields(&mut m, rec, new, fields);
            }
            OpName::Diff => self.compare_fields(&mut m, rec, new, &["files", "diff", "stats"]),
            OpName::Checkpoint => self.compare_fields(&mut m, rec, new, &["name", "files"]),
            OpName::Export => {
                self.compare_fields(&mut m, rec, new, &["format", "patch", "changes"])
            }
            OpName::SetNetwork => {
                self.compare_fields(&mut m, rec, new, &["allow", "deny", "hosts"])
            }
            OpName::SetSecret => self.compare_fields(&mut m, rec, new, &["name", "state"]),
            _ => {}
        }
        m
    }

    fn compare_exec(&self, m: &mut Vec<Mismatch>, prefix: &str, rec: &Value, new: &Value) {
        for f in ["exit_code", "signal", "timed_out"] {
            if rec.get(f) != new.get(f) {
                m.push(Mismatch {
                    field: format!("{prefix}{f}"),
                    expected: rec.get(f).cloned().unwrap_or(Value::Null),
                    actual: new.get(f).cloned().unwrap_or(Value::Null),
                    diff: None,
                });
            }
        }
        for stream in ["stdout", "stderr"] {
            let text = |v: &Value| {
                v.get(stream)
                    .and_then(|s| s.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            let digest = |v: &Value| {
                v.get(format!("{stream}_sha256"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            let (a, b) = (text(rec), text(new));
            let same = if self.opts.normalize.is_empty() {
                a == b && digest(rec) == digest(new)
            } else {
                normalize(&self.opts.normalize, &a) == normalize(&self.opts.normalize, &b)
            };
            if !same {
                m.push(Mismatch {
                    field: format!("{prefix}{stream}"),
                    expected: json!({ "sha256": digest(rec), "bytes": a.len() }),
                    actual: json!({ "sha256": digest(new), "bytes": b.len() }),
                    diff: text_diff(&a, &b),
                });
            }
        }
        let changes = |v: &Value| {
            let mut c: Vec<(String, String)> = v
                .get("changes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|c| {
                    let s = |k| c.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                    (s("path"), s("kind"))
                })
                .collect();
            c.sort();
            c
        };
        let (a, b) = (changes(rec), changes(new));
        if a != b {
            let lines = |c: &[(String, String)]| {
                c.iter()
                    .map(|(p, k)| format!("{k} {p}\n"))
                    .collect::<String>()
            };
            m.push(Mismatch {
                field: format!("{prefix}changes"),
                expected: json!(a),
                actual: json!(b),
                diff: text_diff(&lines(&a), &lines(&b)),
            });
        }
        // Findings: which tool reported what, where; the message and excerpt may hold times
        // and addresses. A result recorded before findings existed has none to compare.
        if rec.get("findings").is_some() {
            let (a, b) = (finding_keys(rec), finding_keys(new));
            if a != b {
                m.push(Mismatch {
                    field: format!("{prefix}findings"),
                    expected: json!(a),
                    actual: json!(b),
                    diff: text_diff(&(a.join("\n") + "\n"), &(b.join("\n") + "\n")),
                });
            }
            let (a, b) = (rec.get("tests"), new.get("tests"));
            if a != b {
                m.push(Mismatch {
                    field: format!("{prefix}tests"),
                    expected: a.cloned().unwrap_or(Value::Null),
                    actual: b.cloned().unwrap_or(Value::Null),
                    diff: None,
                });
            }
        }
        let (a, b) = (violation_kinds(rec), violation_kinds(new));
        if a != b {
            m.push(Mismatch {
                field: format!("{prefix}violations"),
                expected: json!(a),
                actual: json!(b),
                diff: None,
            });
        }
    }

    fn compare_fields(&self, m: &mut Vec<Mismatch>, rec: &Value, new: &Value, fields: &[&str]) {
        for f in fields {
            let (a, b) = (rec.get(*f), new.get(*f));
            let same = match (a.and_then(Value::as_str), b.and_then(Value::as_str)) {
                (Some(x), Some(y)) if !self.opts.normalize.is_empty() => {
                    normalize(&self.opts.normalize, x) == normalize(&self.opts.normalize, y)
                }
                _ => a == b,
            };
            if !same {
                let a = a.cloned().unwrap_or(Value::Null);
                let b = b.cloned().unwrap_or(Value::Null);
                let diff = match (a.as_str(), b.as_str()) {
                    (Some(x), Some(y)) => text_diff(x, y),
                    _ if a.is_array() || a.is_object() => text_diff(&pretty(&a), &pretty(&b)),
                    _ => None,
                };
                m.push(Mismatch {
                    field: (*f).to_string(),
                    expected: a,
                    actual: b,
                    diff,
                });
            }
        }
    }

    /// `v` with the replay's workspace path written as the recorded one; exec digests are
    /// recomputed over the rewritten text.
    fn subst(&self, v: &Value) -> Value {
        let Some((from, to)) = &self.ws_subst else {
            return v.clone();
        };
        let mut out = v.clone();
        replace_strings(&mut out, from, to);
        fix_digests(&mut out);
        if let Some(r) = out.get_mut("result") {
            fix_digests(r);
        }
        out
    }
}

fn replace_strings(v: &mut Value, from: &str, to: &str) {
    match v {
        Value::String(s) if s.contains(from) => *s = s.replace(from, to),
        Value::Array(a) => a.iter_mut().for_each(|x| replace_strings(x, from, to)),
        Value::Object(o) => o.values_mut().for_each(|x| replace_strings(x, from, to)),
        _ => {}
    }
}

/// After a rewrite, the digests of exec output follow the text (the raw text's digest is only
/// known for the rewritten text when nothing was redacted or cut, which is then the same).
fn fix_digests(v: &mut Value) {
    for stream in ["stdout", "stderr"] {
        let text = v
            .get(stream)
            .and_then(|s| s.get("text"))
            .and_then(Value::as_str)
            .map(|t| trace::sha256_hex(t.as_bytes()));
        if let (Some(d), Some(o)) = (text, v.as_object_mut())
            && o.contains_key(&format!("{stream}_sha256"))
        {
            o.insert(format!("{stream}_sha256"), Value::String(d));
        }
    }
}

/// Each finding of an exec result as `kind tool name file:line:column`, in the result's order.
fn finding_keys(v: &Value) -> Vec<String> {
    let s = |f: &Value, k: &str| f.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let n = |f: &Value, k: &str| {
        f.get(k)
            .and_then(Value::as_u64)
            .map_or(String::new(), |n| n.to_string())
    };
    v.get("findings")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|f| {
            let loc = f.get("location").map_or(String::new(), |l| {
                format!("{}:{}:{}", s(l, "file"), n(l, "line"), n(l, "column"))
            });
            format!("{} {} {} {}", s(f, "kind"), s(f, "tool"), s(f, "name"), loc)
        })
        .collect()
}

fn violation_kinds(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .get("violations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|x| x.get("kind").and_then(Value::as_str).map(str::to_string))
        .collect();
    k.sort();
    k
}

/// List entries without directory sizes (they depend on the filesystem, not the content).
fn entries_view(v: &Value) -> Value {
    let entries: Vec<Value> = v
        .get("entries")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|e| {
            let kind = e.get("kind").cloned().unwrap_or(Value::Null);
            let size = if kind == "file" {
                e.get("size").cloned().unwrap_or(Value::Null)
            } else {
                Value::Null
            };
            json!({ "path": e.get("path"), "kind": kind, "size": size })
        })
        .collect();
    Value::Array(entries)
}

fn outcome_mismatch(expected: &Outcome, actual: &Outcome) -> Mismatch {
    let show = |o: &Outcome| match o {
        Outcome::Ok(_) => json!("ok"),
        Outcome::Error(ErrorBody { code, message }) => json!(format!("error {code}: {message}")),
    };
    Mismatch {
        field: "outcome".into(),
        expected: show(expected),
        actual: show(actual),
        diff: None,
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// A unified diff of two texts (None when they are equal).
fn text_diff(a: &str, b: &str) -> Option<String> {
    if a == b {
        return None;
    }
    let d = similar::TextDiff::from_lines(a, b);
    let mut out = d
        .unified_diff()
        .context_radius(3)
        .header("expected", "actual")
        .to_string();
    if out.len() > 16 * 1024 {
        let mut cut = 16 * 1024;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("\n[diff cut at 16 KiB]\n");
    }
    Some(out)
}

/// The first string in `v` that the trace writer cut, as a short description.
fn find_cut(v: &Value) -> Option<String> {
    match v {
        Value::String(s)
            if s.ends_with("more bytes not recorded]") && s.contains("[taskbox trace: ") =>
        {
            Some(format!("a string of {} bytes", s.len()))
        }
        Value::Array(a) => a.iter().find_map(find_cut),
        Value::Object(o) => o.values().find_map(find_cut),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

/// The report for a person: the first divergence side by side, then a summary of all.
pub fn render_report(r: &ReplayReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {} as {} (backend {}, image {})",
        r.recorded_sandbox,
        r.sandbox,
        r.backend,
        short_image(&r.image)
    );
    if !r.normalizations.is_empty() {
        let names: Vec<&str> = r.normalizations.iter().map(|n| n.name()).collect();
        let _ = writeln!(out, "normalised: {}", names.join(", "));
    }
    for n in &r.notes {
        let _ = writeln!(out, "note: {n}");
    }
    if let Some(first) = r.first_divergence() {
        let _ = writeln!(
            out,
            "\nfirst divergence at #{} {}  {}",
            first.seq, first.op, first.detail
        );
        let width = 40;
        let _ = writeln!(out, "  {:<22} {:<width$} actual", "field", "expected");
        for mm in &first.mismatches {
            let _ = writeln!(
                out,
                "  {:<22} {:<width$} {}",
                mm.field,
                cell(&mm.expected, width),
                cell(&mm.actual, width)
            );
        }
        for mm in &first.mismatches {
            if let Some(d) = &mm.diff {
                let _ = writeln!(out, "\n  {}:", mm.field);
                for line in d.lines() {
                    let _ = writeln!(out, "  {line}");
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "\n{} ops: {} match, {} diverged, {} skipped",
        r.ops.len(),
        r.matched,
        r.diverged,
        r.skipped
    );
    for o in &r.ops {
        match o.status {
            OpStatus::Diverged => {
                let fields: Vec<&str> = o.mismatches.iter().map(|m| m.field.as_str()).collect();
                let _ = writeln!(
                    out,
                    "  diverged #{:<4} {:<10} {}  ({})",
                    o.seq,
                    o.op,
                    fields.join(", "),
                    o.detail
                );
            }
            OpStatus::Skipped => {
                let _ = writeln!(
                    out,
                    "  skipped  #{:<4} {:<10} {}",
                    o.seq,
                    o.op,
                    o.reason.as_deref().unwrap_or("")
                );
            }
            OpStatus::Match => {}
        }
    }
    let _ = writeln!(
        out,
        "{}",
        if r.ok() {
            "replay matches the trace"
        } else {
            "replay diverges from the trace"
        }
    );
    out
}

fn short_image(s: &str) -> &str {
    s.get(..19).unwrap_or(s)
}

fn cell(v: &Value, width: usize) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Object(o) if o.contains_key("sha256") => format!(
            "sha256 {}… ({} bytes)",
            o.get("sha256")
                .and_then(Value::as_str)
                .map(short)
                .unwrap_or(""),
            o.get("bytes").and_then(Value::as_u64).unwrap_or(0)
        ),
        other => other.to_string(),
    };
    let first = s.lines().next().unwrap_or("");
    let mut c: String = first.chars().take(width - 1).collect();
    if first.chars().count() >= width || s.lines().nth(1).is_some() {
        c.push('…');
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisations_compile_and_mask() {
        for (n, re) in NORMALIZERS.iter() {
            assert!(re.is_some(), "{n:?}");
        }
        let all = Normalization::ALL;
        assert_eq!(
            normalize(&all, "at 2026-11-30T03:55:02.123Z done"),
            "at <timestamp> done"
        );
        assert_eq!(
            normalize(&all, "Mon Nov 30 03:54:58 UTC 2026"),
            "<timestamp> <timestamp> UTC 2026"
        );
        assert_eq!(
            normalize(&[Normalization::Durations], "finished in 0.42s (12 ms)"),
            "finished in <duration> (<duration>)"
        );
        assert_eq!(
            normalize(
                &[Normalization::TempPaths],
                "wrote /tmp/tmp.Xy12ab/out.txt ok"
            ),
            "wrote /tmp/<tmp> ok"
        );
        assert_eq!(
            normalize(&[Normalization::Pids], "started pid 4242, sh[77]: x"),
            "started pid <pid>, sh[<pid>]: x"
        );
        assert_eq!(
            normalize(&[], "pid 4242 at 0.4s"),
            "pid 4242 at 0.4s",
            "nothing unless asked"
        );
        assert_eq!(
            normalize(&[Normalization::Durations], "test result: ok. 3 passed"),
            "test result: ok. 3 passed",
            "counts are not durations"
        );
    }

    #[test]
    fn normalisation_lists_parse() {
        assert_eq!(
            Normalization::parse_list("pids, timestamps,pids").unwrap(),
            [Normalization::Timestamps, Normalization::Pids]
        );
        assert_eq!(Normalization::parse_list("all").unwrap().len(), 4);
        let e = Normalization::parse_list("clock").unwrap_err();
        assert!(e.contains("unknown normalisation \"clock\""), "{e}");
    }

    #[test]
    fn cut_requests_are_found() {
        let v = json!({"a": [format!("xyz\n[taskbox trace: 5 more bytes not recorded]")]});
        assert!(find_cut(&v).is_some());
        assert!(find_cut(&json!({"a": "more bytes not recorded]"})).is_none());
    }

    #[test]
    fn text_diffs_are_unified() {
        let d = text_diff("a\nb\n", "a\nc\n").unwrap();
        assert!(d.contains("--- expected\n+++ actual\n"), "{d}");
        assert!(d.contains("-b\n+c\n"), "{d}");
        assert!(text_diff("same", "same").is_none());
    }
}
