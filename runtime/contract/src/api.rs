//! The narrow API: one contract for the Rust library, the HTTP API, the CLI verbs and MCP.
//!
//! Every type here is serialised as JSON on the wire with exactly these field names; the HTTP API
//! takes the request types as bodies and returns the result types. [`SandboxApi`] is the trait
//! the backends implement. It is synchronous: backends block on kernel work, and the server calls
//! them from a blocking thread pool.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::op::{Answer, ExecEvents, Op, OpHandler, OpName};
use crate::result::{AutorunFile, Change, ChangeKind, DiffStats, Enforcement, ExecResult};
pub use crate::secret::{SecretRotation, SecretStatus, SecretUpdate, SecretValue};

/// A sandbox's id: 1-64 characters of `[a-z0-9-]`, validated wherever it enters.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
#[schemars(with = "String")]
pub struct SandboxId(String);

/// How much of a client's bad input an error message quotes.
pub const EXCERPT_CHARS: usize = 64;

/// `s` quoted for an error message: whole when short, else its first [`EXCERPT_CHARS`]
/// characters and its length, so a huge input is not echoed back whole.
pub fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        None => format!("{s:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &s[..end], s.len()),
    }
}

impl SandboxId {
    /// Validates `s` as a sandbox id.
    pub fn parse(s: &str) -> Result<SandboxId, ApiError> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok {
            Ok(SandboxId(s.to_string()))
        } else {
            Err(ApiError::invalid(format!(
                "invalid sandbox id {}: expected 1-64 characters of a-z, 0-9 and '-'",
                excerpt(s)
            )))
        }
    }

    /// A fresh random id (`sb-` and 16 hex digits).
    pub fn generate() -> SandboxId {
        let mut bytes = [0u8; 8];
        if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
            let _ = std::io::Read::read_exact(&mut f, &mut bytes);
        }
        let n = u64::from_le_bytes(bytes)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64;
        SandboxId(format!("sb-{n:016x}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = ApiError;
    fn try_from(s: String) -> Result<Self, ApiError> {
        SandboxId::parse(&s)
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

/// The id of a pending approval: 1-64 characters of `[a-z0-9-]` (generated as `ap-` and 16 hex
/// digits), validated wherever it enters.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
#[schemars(with = "String")]
pub struct ApprovalId(String);

impl ApprovalId {
    /// Validates `s` as an approval id.
    pub fn parse(s: &str) -> Result<ApprovalId, ApiError> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok {
            Ok(ApprovalId(s.to_string()))
        } else {
            Err(ApiError::invalid(format!(
                "invalid approval id {}: expected 1-64 characters of a-z, 0-9 and '-'",
                excerpt(s)
            )))
        }
    }

    /// A fresh random id (`ap-` and 16 hex digits).
    pub fn generate() -> ApprovalId {
        let raw = SandboxId::generate();
        ApprovalId(format!("ap-{}", raw.as_str().trim_start_matches("sb-")))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ApprovalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for ApprovalId {
    type Error = ApiError;
    fn try_from(s: String) -> Result<Self, ApiError> {
        ApprovalId::parse(&s)
    }
}

impl From<ApprovalId> for String {
    fn from(id: ApprovalId) -> String {
        id.0
    }
}

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    /// The exec waits for an answer.
    Pending,
    /// Approved: the exec runs.
    Approved,
    /// Denied: the exec returns a violation with the reason.
    Denied,
    /// No one answered before it expired: the exec returns a violation saying so.
    Expired,
}

/// An exec that waits for a person's approval because of the command policy's `ask`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Approval {
    pub id: ApprovalId,
    pub sandbox: SandboxId,
    /// The exec's command (a shell string is `["/bin/sh", "-c", STRING]`).
    pub argv: Vec<String>,
    /// The part of it that needs approval, as the shell would write it (`<?>` for words only
    /// known when it runs).
    pub command: String,
    /// The rule that asks, e.g. `ask "git push"`; null for the policy's default and for a
    /// command taskbox cannot analyse.
    pub rule: Option<String>,
    /// Why approval is needed.
    pub reason: String,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// When the exec is denied if no one has answered (ms since the epoch).
    pub expires_at_ms: u64,
    pub state: ApprovalState,
    /// The reason given with a denial (shown to the model).
    pub denial_reason: Option<String>,
}

/// Create a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// Host directory mounted as the workspace (an overlay: the host copy stays untouched).
    /// Through the supervisor: a directory under one of its workspace roots, or, on its Unix
    /// socket, one the caller's user may read.
    #[serde(default)]
    pub workspace: String,
    /// Instead of `workspace`: a workspace uploaded to the supervisor (`POST /v1/workspaces`).
    #[serde(default)]
    pub workspace_id: Option<String>,
    /// A policy profile's name (default "default"): built-in, or in the operator's policy
    /// directory. With `policy_toml`, only the name the policy is shown under. The supervisor
    /// refuses paths; the CLI reads a policy file itself and sends its text.
    #[serde(default)]
    pub policy: Option<String>,
    /// The policy itself, as TOML text (at most 256 KiB).
    #[serde(default)]
    pub policy_toml: Option<String>,
    /// "native" (default) or "docker".
    #[serde(default)]
    pub backend: Option<String>,
    /// Image name or digest (default: the host view, read-only).
    #[serde(default)]
    pub image: Option<String>,
    /// Variables set in every exec (after the policy's).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels, returned with the sandbox's info.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Lease in seconds; the sandbox is destroyed when it runs out (default: the server's).
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    /// Values of the policy's secrets that come `from_api`, by name. Given to the egress
    /// proxy only: never in the sandbox, its info, its trace or a log (`docs/secrets.md`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, crate::secret::SecretValue>,
    /// The policy as resolved once, by the first layer that handles the request (see
    /// [`CreateRequest::resolve_policy`]); never on the wire.
    #[serde(skip)]
    #[schemars(skip)]
    pub resolved_policy: Option<std::sync::Arc<ResolvedPolicy>>,
}

/// The label of a sandbox whose workspace was sent as a tar: the tar's SHA-256, which its trace
/// records as the workspace's base.
pub const WORKSPACE_DIGEST_LABEL: &str = "taskbox.workspace-sha256";

/// A create's policy, read and parsed once before anything starts: every layer (the server, the
/// decorators, the backend) uses this value instead of reading the policy again.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedPolicy {
    /// The name the sandbox shows (`SandboxInfo.policy`).
    pub name: String,
    pub policy: crate::policy::Policy,
    /// [`Policy::hash`](crate::policy::Policy::hash), computed once.
    pub hash: String,
}

/// Where a create's policy may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicySources {
    /// Profile names and inline text only: what a client of the supervisor may send.
    Remote,
    /// Also a policy file by path, read by the caller's own user (the CLI, a library caller).
    Local,
}

/// The longest name a sandbox's policy is shown under.
const POLICY_NAME_MAX: usize = 256;

impl CreateRequest {
    /// The request's policy, resolved on first use and kept in the request: the name (a
    /// profile, or with [`PolicySources::Local`] a file) or the inline text.
    pub fn resolve_policy(
        &mut self,
        sources: PolicySources,
    ) -> Result<std::sync::Arc<ResolvedPolicy>, ApiError> {
        let resolved = self.policy_of(sources)?;
        self.resolved_policy = Some(resolved.clone());
        Ok(resolved)
    }

    /// What a backend resolves of the request: its policy (the one resolved before, or now,
    /// with [`PolicySources::Local`]), once the request is one a backend can take
    /// (`workspace_id` is the supervisor's to turn into a `workspace`).
    pub fn for_backend(&self) -> Result<std::sync::Arc<ResolvedPolicy>, ApiError> {
        if self.workspace_id.is_some() {
            return Err(ApiError::invalid(
                "workspace_id names an upload of the supervisor, which passes its directory as \
                 workspace; a backend takes workspace only",
            ));
        }
        self.policy_of(PolicySources::Local)
    }

    /// The request's policy: the one resolved before, or resolved now (and not kept).
    pub fn policy_of(
        &self,
        sources: PolicySources,
    ) -> Result<std::sync::Arc<ResolvedPolicy>, ApiError> {
        if let Some(r) = &self.resolved_policy {
            return Ok(r.clone());
        }
        let invalid = |e: crate::policy::PolicyError| ApiError::invalid(e.to_string());
        let (name, policy) = match (&self.policy_toml, &self.policy) {
            (Some(text), name) => {
                let name = name.clone().unwrap_or_else(|| "inline".to_owned());
                if name.len() > POLICY_NAME_MAX || name.chars().any(char::is_control) {
                    return Err(ApiError::invalid(format!(
                        "policy name of {} bytes: a policy's name is at most {POLICY_NAME_MAX}                          bytes of text without control characters",
                        name.len()
                    )));
                }
                let origin = match &self.policy {
                    Some(name) => format!("policy {name}"),
                    None => "inline policy".to_owned(),
                };
                let policy = crate::policy::parse_inline(text, &origin).map_err(invalid)?;
                (name, policy)
            }
            (None, name) => {
                let name = name.clone().unwrap_or_else(|| "default".to_owned());
                let (policy, _) = match sources {
                    PolicySources::Remote => crate::policy::resolve_profile(&name),
                    PolicySources::Local => crate::policy::resolve(&name),
                }
                .map_err(invalid)?;
                (name, policy)
            }
        };
        Ok(std::sync::Arc::new(ResolvedPolicy {
            hash: policy.hash(),
            name,
            policy,
        }))
    }
}

/// What a sandbox is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub backend: String,
    pub workspace: String,
    pub policy: String,
    pub policy_hash: String,
    /// "host" for the host view, else the image digest.
    pub image: String,
    pub enforcement: Enforcement,
    pub labels: BTreeMap<String, String>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// When the lease runs out (ms since the epoch), if it has one.
    pub expires_at_ms: Option<u64>,
    /// "running" or "lost" (its processes are gone; only destroy is possible).
    pub state: String,
    pub checkpoints: Vec<String>,
    /// Why a lost sandbox is lost (state "lost"): its init died, its supervisor restarted, its
    /// container or daemon went away. An infrastructure failure, never the command's own.
    /// (Left out of the JSON while the sandbox runs.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_cause: Option<String>,
    /// For a fork: the sandbox it was forked from and the point it was forked at. (Left out of
    /// the JSON for a sandbox that is no fork.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
}

/// Where a fork came from: its parent, and the point of the parent it starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ForkOrigin {
    /// The sandbox it was forked from.
    pub parent: SandboxId,
    /// The parent's checkpoint it starts from; null: the parent's workspace and `/tmp` as they
    /// were when it was forked.
    pub checkpoint: Option<String>,
    /// When it was forked (ms since the epoch).
    pub forked_at_ms: u64,
}

/// The most forks one fork request makes.
pub const MAX_FORKS: u32 = 64;

/// Fork a sandbox: `count` new sandboxes with its image, policy, environment and labels, each
/// starting from its workspace and `/tmp` as they are now (or from one of its checkpoints), with
/// a fresh upper layer and a lease of its own. Processes are not copied: a fork starts with none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many sandboxes (1 to 64; default 1).
    #[serde(default)]
    pub count: Option<u32>,
    /// A checkpoint of the sandbox to start from (its workspace at that checkpoint, and an
    /// empty `/tmp`: a checkpoint holds the workspace only). Default: the sandbox as it is now.
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// Lease of each fork in seconds (default: the lease the parent was created with).
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    /// Labels set on each fork, over the parent's.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl ForkRequest {
    /// How many forks the request asks for, checked against [`MAX_FORKS`].
    pub fn count(&self) -> Result<u32, ApiError> {
        match self.count.unwrap_or(1) {
            n @ 1..=MAX_FORKS => Ok(n),
            n => Err(ApiError::invalid(format!(
                "fork count {n}: give 1 to {MAX_FORKS} sandboxes per fork request"
            ))),
        }
    }
}

/// The sandboxes a fork made, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ForkResult {
    pub sandboxes: Vec<SandboxInfo>,
}

/// Run a command in a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// The command and its arguments (exactly one of `argv` and `shell`).
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// A shell command line, run with `/bin/sh -c`.
    #[serde(default)]
    pub shell: Option<String>,
    /// Working directory: relative to the workspace root, or absolute (default: the root).
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Given on standard input (then closed): UTF-8 text, or base64 of any bytes with
    /// `stdin_encoding: "base64"`. Without it stdin is empty, or, for a background exec, open
    /// for `write_stdin` (which streams input of any size).
    #[serde(default)]
    pub stdin: Option<String>,
    /// "utf-8" (default) or "base64": how `stdin` is given. (Left out of the request's JSON
    /// when unset, as `merge_output` when false: traces of requests without them read as
    /// before.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_encoding: Option<String>,
    /// The command's standard error goes to its standard output, in the order it was written
    /// (as `2>&1`): `stdout` holds both, `stderr` stays empty.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub merge_output: bool,
    /// Wall-clock limit in milliseconds (default: the policy's timeout).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Bytes of each stream kept in `text` (default: the policy's `output`).
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// Return at once with a process handle instead of waiting.
    #[serde(default)]
    pub background: bool,
    /// Who runs the command: a user of the sandbox, by name (looked up in the sandbox's own
    /// `/etc/passwd` at the time of the exec, so a user added by an earlier command counts) or
    /// as a numeric uid. Default: the sandbox's user. A name the sandbox does not know is
    /// `user_not_found`; a user the backend cannot become (a rootless native sandbox has
    /// one id) is `invalid_argument`, naming why. (Left out of the JSON when unset.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// `text` as bytes: UTF-8 as it is (`encoding` "utf-8" or none), or decoded from base64;
/// `what` names the field in the error.
pub fn decode_bytes(what: &str, text: &str, encoding: Option<&str>) -> Result<Vec<u8>, ApiError> {
    use base64::Engine as _;
    match encoding.unwrap_or("utf-8") {
        "utf-8" | "utf8" => Ok(text.as_bytes().to_vec()),
        "base64" => base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(|e| ApiError::invalid(format!("{what} is not valid base64: {e}"))),
        other => Err(ApiError::invalid(format!(
            "{what}: unknown encoding {other:?}; use \"utf-8\" or \"base64\""
        ))),
    }
}

impl ExecRequest {
    /// The argv this request runs, or why it is invalid.
    pub fn resolved_argv(&self) -> Result<Vec<String>, ApiError> {
        match (&self.argv, &self.shell) {
            (Some(a), None) if !a.is_empty() => Ok(a.clone()),
            (Some(_), None) => Err(ApiError::invalid("argv is empty")),
            (None, Some(s)) => Ok(vec!["/bin/sh".into(), "-c".into(), s.clone()]),
            (None, None) => Err(ApiError::invalid("give either argv or shell")),
            (Some(_), Some(_)) => Err(ApiError::invalid("give either argv or shell, not both")),
        }
    }

    /// The bytes of `stdin`, decoded as `stdin_encoding` says.
    pub fn stdin_bytes(&self) -> Result<Option<Vec<u8>>, ApiError> {
        let Some(text) = &self.stdin else {
            if self.stdin_encoding.is_some() {
                return Err(ApiError::invalid("stdin_encoding is given without stdin"));
            }
            return Ok(None);
        };
        decode_bytes("stdin", text, self.stdin_encoding.as_deref()).map(Some)
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }

    /// The exec's time limit: the request's, else `default` (the policy's); zero is refused.
    pub fn time_limit(&self, default: Duration) -> Result<Duration, ApiError> {
        let limit = self.timeout().unwrap_or(default);
        if limit.is_zero() {
            return Err(ApiError::invalid("timeout_ms must be greater than zero"));
        }
        Ok(limit)
    }

    /// Bytes of each output stream kept in the result: the request's, else `default` (the
    /// policy's), within 64 B to 64 MiB.
    pub fn output_cap(&self, default: u64) -> usize {
        self.output_limit.unwrap_or(default).clamp(64, 64 << 20) as usize
    }

    /// The environment of the exec: `base` with the request's variables over it (one replaces a
    /// variable of the same name); a name that is empty or holds `=` or NUL, or a value with NUL,
    /// is refused.
    pub fn layered_env(
        &self,
        base: &[(String, String)],
    ) -> Result<Vec<(String, String)>, ApiError> {
        let mut env = base.to_vec();
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "invalid environment variable {k:?}"
                )));
            }
            env.retain(|(ek, _)| ek != k);
            env.push((k.clone(), v.clone()));
        }
        Ok(env)
    }
}

/// A streamed exec event (SSE `event:` names are the `type` values).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    /// The command policy asks a person first: the exec waits until the approval is answered
    /// (then `started`, or `ended` with a violation) or times out.
    Approval {
        approval: Box<Approval>,
    },
    /// The approval was answered (its `state` says how: approved, denied with its
    /// `denial_reason`, or expired); the exec then starts or ends refused. A replay answers the
    /// same way.
    Answered {
        approval: Box<Approval>,
    },
    Started {
        exec_id: u64,
    },
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Ended {
        result: Box<ExecResult>,
    },
}

/// The answer to an exec: the result, or for a background exec its handle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum ExecOutcome {
    Finished(ExecResult),
    Background(ProcessInfo),
}

/// A background process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ProcessInfo {
    pub exec_id: u64,
    pub argv: Vec<String>,
    pub running: bool,
    /// Output so far (head and tail within the limit).
    pub stdout: crate::result::Output,
    pub stderr: crate::result::Output,
    /// Set once the process has ended.
    pub result: Option<ExecResult>,
}

/// Read a file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadRequest {
    pub path: String,
    /// First line, 1-based (with `line_end`: an inclusive line range).
    #[serde(default)]
    pub line_start: Option<u64>,
    #[serde(default)]
    pub line_end: Option<u64>,
    /// Byte range (exclusive with the line range).
    #[serde(default)]
    pub offset: Option<u64>,
    #[serde(default)]
    pub length: Option<u64>,
    /// Cap on returned bytes (default 256 KiB).
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

/// A file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ReadResult {
    pub path: String,
    /// UTF-8 text, or base64 when `encoding` is "base64" (binary content).
    pub content: String,
    pub encoding: String,
    /// Size of the whole file in bytes.
    pub total_bytes: u64,
    /// Lines in the whole file, for text.
    pub total_lines: Option<u64>,
    /// The content returned is less than what was asked for (cut at `max_bytes`).
    pub truncated: bool,
    /// The file looks binary (NUL bytes or invalid UTF-8).
    pub binary: bool,
}

/// Write a file (atomically: a temporary file renamed into place).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    pub path: String,
    pub content: String,
    /// "utf-8" (default) or "base64".
    #[serde(default)]
    pub encoding: Option<String>,
    #[serde(default)]
    pub create_parents: bool,
    /// Permission bits for a new file (default 0644; an existing file keeps its own).
    #[serde(default)]
    pub mode: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct WriteResult {
    pub path: String,
    pub bytes_written: u64,
    pub created: bool,
    /// The SHA-256 of what was written, in hex (uploads; absent for `write`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Upload a file: its content is streamed after the request (the HTTP body of
/// `PUT /v1/sandboxes/{id}/files?path=`), never held whole, and written atomically as by
/// `write`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadRequest {
    pub path: String,
    #[serde(default)]
    pub create_parents: bool,
    /// Permission bits for a new file (default 0644; an existing file keeps its own).
    #[serde(default)]
    pub mode: Option<u32>,
}

/// Download a file whole, streamed (`GET /v1/sandboxes/{id}/files?path=`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DownloadRequest {
    pub path: String,
}

/// What a download sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DownloadResult {
    pub path: String,
    pub bytes: u64,
    /// The SHA-256 of the bytes sent, in hex.
    pub sha256: String,
}

/// Where a download's bytes go: [`ByteSink::start`] once, with the file's size, before any
/// byte; then [`ByteSink::write`] with every piece in order. An error of either ends the
/// download.
pub trait ByteSink: Send {
    fn start(&mut self, size: u64) -> std::io::Result<()>;
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()>;
}

/// A [`ByteSink`] over any writer (the size is not announced): a file, a buffer, a hasher.
pub struct WriteSink<W>(pub W);

impl<W: std::io::Write + Send> ByteSink for WriteSink<W> {
    fn start(&mut self, _size: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0.write_all(bytes)
    }
}

/// Replace exact text in a file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditRequest {
    pub path: String,
    pub old: String,
    pub new: String,
    /// How many occurrences must exist (default 1); all of them are replaced.
    #[serde(default)]
    pub expected_count: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct EditResult {
    pub path: String,
    pub replacements: u64,
    /// Unified diff of the edit.
    pub diff: String,
}

/// Apply a unified diff to the workspace, all or nothing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchRequest {
    pub patch: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PatchResult {
    pub files: Vec<Change>,
}

/// List a directory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    /// Directory relative to the workspace root (default ".").
    #[serde(default)]
    pub path: Option<String>,
    /// Glob on the path relative to `path` (e.g. "**/*.rs").
    #[serde(default)]
    pub glob: Option<String>,
    /// Depth limit (default: unlimited when a glob is given, else 1).
    #[serde(default)]
    pub max_depth: Option<u32>,
    /// Include entries ignored by .gitignore (default false).
    #[serde(default)]
    pub include_ignored: bool,
    /// Include dot files (default false).
    #[serde(default)]
    pub include_hidden: bool,
    /// Cap on entries (default 1000).
    #[serde(default)]
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Entry {
    /// Relative to the workspace root.
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ListResult {
    pub entries: Vec<Entry>,
    pub truncated: bool,
}

/// Search file contents.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    /// A regular expression (Rust regex syntax).
    pub pattern: String,
    /// Directory to search (default ".").
    #[serde(default)]
    pub path: Option<String>,
    /// Only files whose relative path matches this glob.
    #[serde(default)]
    pub glob: Option<String>,
    #[serde(default)]
    pub case_insensitive: bool,
    #[serde(default)]
    pub include_ignored: bool,
    #[serde(default)]
    pub include_hidden: bool,
    /// Cap on matches (default 200).
    #[serde(default)]
    pub max_matches: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Match {
    pub path: String,
    pub line_number: u64,
    pub line: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SearchResult {
    pub matches: Vec<Match>,
    pub truncated: bool,
    pub files_searched: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct StatResult {
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    pub modified_ms: u64,
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RemoveRequest {
    pub path: String,
    /// Remove a directory and everything beneath it.
    #[serde(default)]
    pub recursive: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub from: String,
    pub to: String,
    #[serde(default)]
    pub overwrite: bool,
}

/// Diff the workspace against its baseline (the host copy) or a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffRequest {
    /// A checkpoint name; default: the baseline.
    #[serde(default)]
    pub since: Option<String>,
    /// Also list (and diff) the changes left out by default: paths the workspace's git ignores
    /// and does not track, and git's own files under `.git/`. They come marked `ignored`.
    #[serde(default)]
    pub include_ignored: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct FileDiff {
    pub path: String,
    pub status: ChangeKind,
    pub binary: bool,
    /// The permission change of a modified file, as `"100644 -> 100755"`.
    pub mode_change: Option<String>,
    /// A change left out by default (listed because the request has `include_ignored`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignored: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DiffResult {
    pub files: Vec<FileDiff>,
    pub diff: String,
    pub stats: DiffStats,
    /// How many changes are left out by default (ignored by git, or under `.git/`), whether or
    /// not the request lists them.
    #[serde(default)]
    pub ignored: u64,
    /// Changed files that tools run on their own (see [`AutorunFile`]), shown or left out.
    #[serde(default)]
    pub flagged: Vec<AutorunFile>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// `[A-Za-z0-9._-]{1,64}`.
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CheckpointInfo {
    pub name: String,
    pub created_at_ms: u64,
    /// Paths changed since the baseline at the time of the checkpoint.
    pub files: u64,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ExportFormat {
    #[default]
    Patch,
    Tar,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    #[serde(default)]
    pub format: ExportFormat,
    /// Also apply the change to the host workspace.
    #[serde(default)]
    pub apply: bool,
    /// Export the changes `diff` leaves out by default too (as `diff` with `include_ignored`
    /// shows them). Without it the export carries exactly the files of the default diff.
    #[serde(default)]
    pub include_ignored: bool,
    /// With `apply`: write files that tools run on their own (the diff's `flagged`) too; without
    /// it such an apply is refused before anything is written.
    #[serde(default)]
    pub allow_autorun: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExportResult {
    pub format: ExportFormat,
    /// The patch text (format "patch").
    pub patch: Option<String>,
    /// Path of the tar file written in the state directory (format "tar").
    pub tar_path: Option<String>,
    pub changes: Vec<Change>,
    /// The change was applied to the host workspace.
    pub applied: bool,
    /// How many changes the export leaves out (see `DiffResult::ignored`); 0 with
    /// `include_ignored`.
    #[serde(default)]
    pub ignored: u64,
    /// The exported changes that tools run on their own.
    #[serde(default)]
    pub flagged: Vec<AutorunFile>,
}

/// The egress rules of a live sandbox whose policy has network mode "proxy": they replace the
/// `allow`, `deny` and `hosts` of its policy's `[network]` (patterns as in a policy file; see
/// `docs/egress.md`). The mode itself is fixed when the sandbox is created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkRules {
    /// Host patterns the proxy lets through: `example.com`, `*.example.com` (subdomains only),
    /// an address or range, each with an optional `:PORT`. Empty: nothing.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Host patterns refused even when allowed (deny wins).
    #[serde(default)]
    pub deny: Vec<String>,
    /// For tests: names resolved to these addresses instead of by DNS.
    #[serde(default)]
    pub hosts: BTreeMap<String, Vec<String>>,
}

impl NetworkRules {
    /// The rules as a policy's `[network]` (mode "proxy"), checked like a policy file's; an
    /// invalid pattern is an `invalid_argument` error naming the key and the pattern.
    pub fn to_network(&self) -> Result<crate::policy::Network, ApiError> {
        crate::policy::Network::proxy_rules(&self.allow, &self.deny, &self.hosts)
            .map_err(|e| ApiError::invalid(e.to_string()))
    }
}

impl From<&crate::policy::Network> for NetworkRules {
    fn from(n: &crate::policy::Network) -> NetworkRules {
        NetworkRules {
            allow: n.allow.iter().map(ToString::to_string).collect(),
            deny: n.deny.iter().map(ToString::to_string).collect(),
            hosts: n
                .hosts
                .iter()
                .map(|(name, ips)| (name.clone(), ips.iter().map(ToString::to_string).collect()))
                .collect(),
        }
    }
}

/// Errors of the API. `code()` is the stable machine-readable code; the message says what
/// failed and what to do, in words a model can act on.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// the path, checkpoint, process or approval does not exist (a sandbox that does not
    /// exist is [`ApiError::SandboxNotFound`])
    #[error("{0}")]
    NotFound(String),
    /// the sandbox does not exist, or is not the caller's
    #[error("{0}")]
    SandboxNotFound(String),
    /// the path is a directory where the operation needs a file
    #[error("{0}")]
    IsADirectory(String),
    /// the path, or a component on its way, is not a directory where one is needed
    #[error("{0}")]
    NotADirectory(String),
    /// the sandbox's user may not do this: the kernel refused it with the user's own
    /// credentials and confinement (no such permission, a read-only file system, the policy's
    /// Landlock rules)
    #[error("{0}")]
    PermissionDenied(String),
    /// the request's body, or the file an operation would load, is larger than its limit
    #[error("{0}")]
    TooLarge(String),
    /// exec: the user named is not one of the sandbox's (its `/etc/passwd` has no such name)
    #[error("{0}")]
    UserNotFound(String),
    /// the request is malformed or names something invalid
    #[error("{0}")]
    InvalidArgument(String),
    /// edit: the old text does not occur
    #[error("{0}")]
    EditNotFound(String),
    /// edit: the old text occurs more often than expected
    #[error("{0}")]
    EditAmbiguous(String),
    /// patch: a hunk does not apply
    #[error("{0}")]
    PatchFailed(String),
    /// the path leaves the sandbox (or, relative, the workspace), leads through a link the file
    /// operations do not follow, or names something the policy protects or that may not be
    /// touched (a fifo, a device)
    #[error("{0}")]
    PathRefused(String),
    /// the operation conflicts with the sandbox's state (e.g. it is lost, or a name is taken)
    #[error("{0}")]
    Conflict(String),
    /// a quota or limit was reached
    #[error("{0}")]
    LimitExceeded(String),
    /// the sandbox itself failed, not the request nor the command: its init died, its
    /// supervisor restarted, its container or daemon went away, the host ran out of memory. The
    /// message says which. Nothing more runs in that sandbox; a training loop drops the episode
    /// instead of scoring it.
    #[error("{0}")]
    Infrastructure(String),
    /// the backend failed
    #[error("{0}")]
    Internal(String),
    /// the backend cannot be reached now (e.g. the Docker daemon is down or restarting)
    #[error("{0}")]
    Unavailable(String),
    /// the backend failed because of `source` ([`ApiError::internal_with`]); code `internal`
    #[error("{message}")]
    InternalCause {
        /// The whole message, cause included in words (what the JSON body says).
        message: String,
        #[source]
        source: BoxError,
    },
    /// the backend cannot be reached now because of `source` ([`ApiError::unavailable_with`]);
    /// code `unavailable`
    #[error("{message}")]
    UnavailableCause {
        /// The whole message, cause included in words (what the JSON body says).
        message: String,
        #[source]
        source: BoxError,
    },
}

/// The cause an [`ApiError`] keeps.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl ApiError {
    pub fn invalid(msg: impl Into<String>) -> ApiError {
        ApiError::InvalidArgument(msg.into())
    }

    pub fn not_found(msg: impl Into<String>) -> ApiError {
        ApiError::NotFound(msg.into())
    }

    /// The one answer for a sandbox id that names no sandbox of the caller's.
    pub fn sandbox_not_found(id: &SandboxId) -> ApiError {
        ApiError::SandboxNotFound(format!("sandbox {id} does not exist"))
    }

    pub fn internal(msg: impl fmt::Display) -> ApiError {
        ApiError::Internal(msg.to_string())
    }

    /// An internal error that keeps its cause: `message` is all the error says (the cause in
    /// words included, as the JSON body has always said it), `source` the cause itself, for a
    /// program to look at ([`std::error::Error::source`], downcasting).
    pub fn internal_with(message: impl Into<String>, source: impl Into<BoxError>) -> ApiError {
        ApiError::InternalCause {
            message: message.into(),
            source: source.into(),
        }
    }

    /// As [`ApiError::internal_with`], for a backend that cannot be reached now.
    pub fn unavailable_with(message: impl Into<String>, source: impl Into<BoxError>) -> ApiError {
        ApiError::UnavailableCause {
            message: message.into(),
            source: source.into(),
        }
    }

    /// Whether the sandbox or its backend failed (codes `infrastructure`, `internal` and
    /// `unavailable`), not the request nor the command: what DESIGN.md calls an infrastructure
    /// error.
    pub fn is_infrastructure(&self) -> bool {
        matches!(self.code(), "infrastructure" | "internal" | "unavailable")
    }

    /// The stable error code of the JSON error body.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::NotFound(_) => "not_found",
            ApiError::SandboxNotFound(_) => "sandbox_not_found",
            ApiError::IsADirectory(_) => "is_a_directory",
            ApiError::NotADirectory(_) => "not_a_directory",
            ApiError::PermissionDenied(_) => "permission_denied",
            ApiError::TooLarge(_) => "too_large",
            ApiError::UserNotFound(_) => "user_not_found",
            ApiError::InvalidArgument(_) => "invalid_argument",
            ApiError::EditNotFound(_) => "edit_not_found",
            ApiError::EditAmbiguous(_) => "edit_ambiguous",
            ApiError::PatchFailed(_) => "patch_failed",
            ApiError::PathRefused(_) => "path_refused",
            ApiError::Conflict(_) => "conflict",
            ApiError::LimitExceeded(_) => "limit_exceeded",
            ApiError::Infrastructure(_) => "infrastructure",
            ApiError::Internal(_) | ApiError::InternalCause { .. } => "internal",
            ApiError::Unavailable(_) | ApiError::UnavailableCause { .. } => "unavailable",
        }
    }

    /// Every code [`ApiError::code`] gives, with what it means: the list the OpenAPI document
    /// and the docs show, and the codes a client maps back with [`ApiError::from_code`].
    pub const CODES: &'static [(&'static str, u16, &'static str)] = &[
        (
            "not_found",
            404,
            "the path, checkpoint, process or approval does not exist",
        ),
        (
            "sandbox_not_found",
            404,
            "the sandbox does not exist, or is not the caller's",
        ),
        (
            "is_a_directory",
            400,
            "the path is a directory where a file is needed",
        ),
        (
            "not_a_directory",
            400,
            "the path, or a component on its way, is not a directory",
        ),
        (
            "permission_denied",
            403,
            "the sandbox's user may not do this (the kernel refused it)",
        ),
        (
            "too_large",
            413,
            "the request body, or the file, is larger than the limit",
        ),
        (
            "user_not_found",
            400,
            "exec: the sandbox has no user of that name",
        ),
        (
            "invalid_argument",
            400,
            "the request is malformed or names something invalid",
        ),
        ("edit_not_found", 422, "edit: the old text does not occur"),
        (
            "edit_ambiguous",
            422,
            "edit: the old text occurs more often than expected",
        ),
        ("patch_failed", 422, "patch: a hunk does not apply"),
        (
            "path_refused",
            403,
            "the path leaves the sandbox or names something not to be touched",
        ),
        (
            "conflict",
            409,
            "the operation conflicts with the sandbox's state",
        ),
        ("limit_exceeded", 429, "a quota or limit was reached"),
        (
            "infrastructure",
            500,
            "the sandbox itself failed (its init died, the supervisor restarted, its container or \
             daemon went away), not the command: the message says why",
        ),
        (
            "internal",
            500,
            "the sandbox or its backend failed (an infrastructure error)",
        ),
        (
            "unavailable",
            503,
            "the backend cannot be reached now (an infrastructure error)",
        ),
    ];

    /// The error of `code` with `message`: what a client makes of an error body. An unknown
    /// code is `internal`, its code kept in the message.
    pub fn from_code(code: &str, message: String) -> ApiError {
        match code {
            "not_found" => ApiError::NotFound(message),
            "sandbox_not_found" => ApiError::SandboxNotFound(message),
            "is_a_directory" => ApiError::IsADirectory(message),
            "not_a_directory" => ApiError::NotADirectory(message),
            "permission_denied" => ApiError::PermissionDenied(message),
            "too_large" => ApiError::TooLarge(message),
            "user_not_found" => ApiError::UserNotFound(message),
            "invalid_argument" => ApiError::InvalidArgument(message),
            "edit_not_found" => ApiError::EditNotFound(message),
            "edit_ambiguous" => ApiError::EditAmbiguous(message),
            "patch_failed" => ApiError::PatchFailed(message),
            "path_refused" => ApiError::PathRefused(message),
            "conflict" => ApiError::Conflict(message),
            "limit_exceeded" => ApiError::LimitExceeded(message),
            "infrastructure" => ApiError::Infrastructure(message),
            "unavailable" => ApiError::Unavailable(message),
            "internal" => ApiError::Internal(message),
            other => ApiError::Internal(format!("{message} (error code {other})")),
        }
    }

    /// The HTTP status for this error (the one place that maps errors to statuses).
    pub fn http_status(&self) -> u16 {
        match self {
            ApiError::NotFound(_) | ApiError::SandboxNotFound(_) => 404,
            ApiError::InvalidArgument(_)
            | ApiError::UserNotFound(_)
            | ApiError::IsADirectory(_)
            | ApiError::NotADirectory(_) => 400,
            ApiError::PermissionDenied(_) => 403,
            ApiError::TooLarge(_) => 413,
            ApiError::EditNotFound(_) | ApiError::EditAmbiguous(_) | ApiError::PatchFailed(_) => {
                422
            }
            ApiError::PathRefused(_) => 403,
            ApiError::Conflict(_) => 409,
            ApiError::LimitExceeded(_) => 429,
            ApiError::Infrastructure(_) => 500,
            ApiError::Internal(_) | ApiError::InternalCause { .. } => 500,
            ApiError::Unavailable(_) | ApiError::UnavailableCause { .. } => 503,
        }
    }
}

/// The operations of DESIGN.md. Backends implement it; the server, the CLI verbs and the MCP
/// server call it. A relative path in a request is the workspace's (resolved beneath the
/// workspace root); an absolute one is the sandbox's (resolved beneath the sandbox's root, as
/// its commands see it), and file operations run with the sandbox user's own credentials and
/// confinement; nothing resolves outside the sandbox.
pub trait SandboxApi: Send + Sync {
    fn create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError>;
    fn list(&self) -> Vec<SandboxInfo>;

    /// Serves one operation given as data (see [`crate::op`]): for a backend, the typed method
    /// it names; for an [`OpHandler`], its `handle`.
    fn call(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        crate::op::dispatch(self, id, op)
    }

    fn info(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError>;
    /// Runs a command. `events`, when given, receives the stream (started, output chunks, ended).
    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError>;
    /// A background process's state and output so far.
    fn process(&self, id: &SandboxId, exec_id: u64) -> Result<ProcessInfo, ApiError>;
    /// Waits until a background process ends or `timeout` passes.
    fn wait(
        &self,
        id: &SandboxId,
        exec_id: u64,
        timeout: Duration,
    ) -> Result<ProcessInfo, ApiError>;
    /// Sends `signal` to a background process (SIGKILL kills its whole tree).
    fn kill(&self, id: &SandboxId, exec_id: u64, signal: i32) -> Result<ProcessInfo, ApiError>;
    /// Writes to a background process's stdin; `close` closes it afterwards.
    fn write_stdin(
        &self,
        id: &SandboxId,
        exec_id: u64,
        data: &[u8],
        close: bool,
    ) -> Result<(), ApiError>;
    fn read(&self, id: &SandboxId, req: ReadRequest) -> Result<ReadResult, ApiError>;
    fn write(&self, id: &SandboxId, req: WriteRequest) -> Result<WriteResult, ApiError>;
    fn edit(&self, id: &SandboxId, req: EditRequest) -> Result<EditResult, ApiError>;
    fn patch(&self, id: &SandboxId, req: PatchRequest) -> Result<PatchResult, ApiError>;
    fn list_dir(&self, id: &SandboxId, req: ListRequest) -> Result<ListResult, ApiError>;
    fn search(&self, id: &SandboxId, req: SearchRequest) -> Result<SearchResult, ApiError>;
    fn stat(&self, id: &SandboxId, req: PathRequest) -> Result<StatResult, ApiError>;
    fn remove(&self, id: &SandboxId, req: RemoveRequest) -> Result<(), ApiError>;
    fn rename(&self, id: &SandboxId, req: MoveRequest) -> Result<(), ApiError>;

    /// Writes a file from `body`, streamed (never held whole), atomically as [`Self::write`].
    /// Backends without streaming keep this default, which refuses.
    fn upload(
        &self,
        id: &SandboxId,
        req: UploadRequest,
        body: &mut (dyn std::io::Read + Send),
    ) -> Result<WriteResult, ApiError> {
        let _ = (req, body);
        self.info(id)?;
        Err(ApiError::invalid(format!(
            "sandbox {id}: this backend cannot stream an upload; use write"
        )))
    }

    /// Sends a whole file to `sink`, streamed (never held whole). Backends without streaming
    /// keep this default, which refuses.
    fn download(
        &self,
        id: &SandboxId,
        req: DownloadRequest,
        sink: &mut dyn ByteSink,
    ) -> Result<DownloadResult, ApiError> {
        let _ = (req, sink);
        self.info(id)?;
        Err(ApiError::invalid(format!(
            "sandbox {id}: this backend cannot stream a download; use read"
        )))
    }
    fn diff(&self, id: &SandboxId, req: DiffRequest) -> Result<DiffResult, ApiError>;
    fn checkpoint(
        &self,
        id: &SandboxId,
        req: CheckpointRequest,
    ) -> Result<CheckpointInfo, ApiError>;
    fn restore(&self, id: &SandboxId, req: CheckpointRequest) -> Result<(), ApiError>;
    fn export(&self, id: &SandboxId, req: ExportRequest) -> Result<ExportResult, ApiError>;
    fn destroy(&self, id: &SandboxId) -> Result<(), ApiError>;

    /// The sandbox's execs waiting for approval (see [`crate::approvals`]). With `wait`, blocks
    /// until there is at least one or `wait` passes. A backend without a command policy has none
    /// and returns at once.
    fn list_approvals(
        &self,
        id: &SandboxId,
        wait: Option<Duration>,
    ) -> Result<Vec<Approval>, ApiError> {
        let _ = wait;
        self.info(id)?;
        Ok(Vec::new())
    }

    /// Approves a pending exec: it runs.
    fn approve(&self, id: &SandboxId, approval: &ApprovalId) -> Result<Approval, ApiError> {
        self.info(id)?;
        Err(approval_not_found(id, approval))
    }

    /// Denies a pending exec: it returns a violation that includes `reason`.
    fn deny(
        &self,
        id: &SandboxId,
        approval: &ApprovalId,
        reason: &str,
    ) -> Result<Approval, ApiError> {
        let _ = reason;
        self.info(id)?;
        Err(approval_not_found(id, approval))
    }

    /// Forks the sandbox (see [`ForkRequest`]): all the forks asked for, or none (those made
    /// before a failure are destroyed again). Backends that cannot fork keep this default, which
    /// refuses.
    fn fork(&self, id: &SandboxId, req: ForkRequest) -> Result<ForkResult, ApiError> {
        let _ = req;
        self.info(id)?;
        Err(ApiError::invalid(format!(
            "sandbox {id}: this backend cannot fork a sandbox"
        )))
    }

    /// Replaces the egress rules of a live sandbox with network mode "proxy" and returns the
    /// rules now in force; later connections are decided by them, open ones keep running.
    /// Backends without a live egress proxy keep this default, which refuses.
    fn set_network(&self, id: &SandboxId, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        let _ = rules;
        Err(ApiError::invalid(format!(
            "sandbox {id}: this backend cannot change the network rules of a live sandbox"
        )))
    }

    /// Rotates (a new value) or revokes (none) one of the policy's secrets in a live sandbox
    /// and returns its state; requests from then on use the new value, or go out without it.
    /// Backends without a live egress proxy keep this default, which refuses.
    fn set_secret(&self, id: &SandboxId, update: SecretUpdate) -> Result<SecretStatus, ApiError> {
        let _ = update;
        Err(no_secrets(id))
    }
}

/// The one answer for a change of secrets on a backend without a live egress proxy.
pub fn no_secrets(id: &SandboxId) -> ApiError {
    ApiError::invalid(format!(
        "sandbox {id}: this backend cannot change the secrets of a live sandbox"
    ))
}

/// The one answer for an approval that is not pending in this sandbox.
pub fn approval_not_found(id: &SandboxId, approval: &ApprovalId) -> ApiError {
    ApiError::not_found(format!(
        "approval {approval} is not pending in sandbox {id}: it was answered, timed out, or \
         never existed"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_validated() {
        assert!(SandboxId::parse("sb-0123abcd").is_ok());
        for bad in ["", "UPPER", "a/b", "../x", "a b", &"x".repeat(65)] {
            assert!(SandboxId::parse(bad).is_err(), "{bad:?}");
        }
        let id = SandboxId::generate();
        assert!(SandboxId::parse(id.as_str()).is_ok());
        assert_ne!(id, SandboxId::generate());
        let r: Result<SandboxId, _> = serde_json::from_str("\"../etc\"");
        assert!(r.is_err());
    }

    #[test]
    fn a_huge_bad_id_is_not_echoed_whole() {
        let huge = "X".repeat(10_000);
        let m = SandboxId::parse(&huge).unwrap_err().to_string();
        assert!(m.len() < 300, "{m}");
        assert!(m.contains("10000 bytes"), "{m}");
        let m = ApprovalId::parse(&huge).unwrap_err().to_string();
        assert!(m.len() < 300 && m.contains("10000 bytes"), "{m}");
        // Short input is quoted whole; multi-byte characters are never split.
        assert_eq!(excerpt("a/b"), "\"a/b\"");
        let long = "é".repeat(100);
        assert!(excerpt(&long).ends_with("... (200 bytes)"));
    }

    #[test]
    fn exec_request_needs_exactly_one_command_form() {
        let mut r = ExecRequest::default();
        assert!(r.resolved_argv().is_err());
        r.shell = Some("echo hi".into());
        assert_eq!(r.resolved_argv().unwrap(), ["/bin/sh", "-c", "echo hi"]);
        r.argv = Some(vec!["true".into()]);
        assert!(r.resolved_argv().is_err());
        r.shell = None;
        assert_eq!(r.resolved_argv().unwrap(), ["true"]);
        let e: Result<ExecRequest, _> = serde_json::from_str(r#"{"argv":["x"],"bogus":1}"#);
        assert!(e.is_err(), "unknown fields are refused");
    }

    #[test]
    fn a_kept_cause_changes_neither_text_nor_code() {
        let io = std::io::Error::other("disk on fire");
        let e = ApiError::internal_with(format!("cannot record the exec: {io}"), io);
        assert_eq!(e.to_string(), "cannot record the exec: disk on fire");
        assert_eq!((e.code(), e.http_status()), ("internal", 500));
        let cause = std::error::Error::source(&e).unwrap();
        let io = cause.downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::Other);
        let e = ApiError::unavailable_with("the daemon is gone", std::io::Error::other("eof"));
        assert_eq!((e.code(), e.http_status()), ("unavailable", 503));
        assert_eq!(e.to_string(), "the daemon is gone");
        assert!(std::error::Error::source(&e).is_some());
        assert!(std::error::Error::source(&ApiError::internal("x")).is_none());
        assert!(e.is_infrastructure() && ApiError::internal("x").is_infrastructure());
        assert!(ApiError::Infrastructure("lost".into()).is_infrastructure());
        assert!(!ApiError::not_found("x").is_infrastructure());
    }

    #[test]
    fn every_code_maps_back_to_itself_with_its_status() {
        for (code, status, _) in ApiError::CODES {
            let e = ApiError::from_code(code, "m".into());
            assert_eq!((e.code(), e.http_status()), (*code, *status), "{code}");
            assert_eq!(e.to_string(), "m");
        }
        let unknown = ApiError::from_code("brand_new", "m".into());
        assert_eq!(unknown.code(), "internal");
        assert!(unknown.to_string().contains("brand_new"));
        let id = SandboxId::parse("sb-1").unwrap();
        let e = ApiError::sandbox_not_found(&id);
        assert_eq!((e.code(), e.http_status()), ("sandbox_not_found", 404));
    }

    #[test]
    fn errors_map_to_codes_and_statuses() {
        assert_eq!(ApiError::not_found("x").http_status(), 404);
        assert_eq!(ApiError::LimitExceeded("x".into()).http_status(), 429);
        assert_eq!(ApiError::EditAmbiguous("x".into()).code(), "edit_ambiguous");
    }
}
