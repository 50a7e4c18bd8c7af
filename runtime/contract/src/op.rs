//! Operations as data: every operation on a sandbox is a value of [`Op`], every answer a value
//! of [`Answer`], and every operation has a stable name, [`OpName`].
//!
//! [`SandboxApi`]'s typed methods stay the way backends are written and callers call; the two
//! meet here, once each way:
//!
//! - [`SandboxApi::call`] takes an [`Op`] to the typed method that serves it (provided for
//!   every backend by [`dispatch`]);
//! - a type that implements [`OpHandler`] (one `handle` for every operation, besides
//!   `handle_create` and `handle_list`) is a [`SandboxApi`]: each typed method builds its [`Op`], hands it to `handle`
//!   and takes the answer back out.
//!
//! So a decorator (trace, command policy, router, a timer), a client or a fake matches the
//! operations it treats apart and hands every other one on whole with `inner.call(id, op)`,
//! instead of spelling out each method. The names ([`OpName::as_str`]) are the ones traces
//! record and replay reads back: they must never change.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::api::*;

/// Where an exec's streamed events go, if anywhere (the `events` of [`SandboxApi::exec`]).
pub type ExecEvents<'a> = Option<&'a mut (dyn FnMut(ExecEvent) + Send)>;

/// One operation on one sandbox: what [`SandboxApi::call`] takes and [`OpHandler::handle`]
/// serves. (`create` and `list` are not on one sandbox and are not operations here.)
pub enum Op<'a> {
    /// [`SandboxApi::info`]
    Info,
    /// [`SandboxApi::exec`], with the sink of its streamed events.
    Exec {
        req: ExecRequest,
        events: ExecEvents<'a>,
    },
    /// [`SandboxApi::process`]
    Process {
        exec_id: u64,
    },
    /// [`SandboxApi::wait`]
    Wait {
        exec_id: u64,
        timeout: Duration,
    },
    /// [`SandboxApi::kill`]
    Kill {
        exec_id: u64,
        signal: i32,
    },
    /// [`SandboxApi::write_stdin`]
    WriteStdin {
        exec_id: u64,
        data: Cow<'a, [u8]>,
        close: bool,
    },
    Read(ReadRequest),
    Write(WriteRequest),
    Edit(EditRequest),
    Patch(PatchRequest),
    /// [`SandboxApi::list_dir`]
    ListDir(ListRequest),
    Search(SearchRequest),
    Stat(PathRequest),
    Remove(RemoveRequest),
    /// [`SandboxApi::rename`]
    Rename(MoveRequest),
    /// [`SandboxApi::upload`], with the content to stream.
    Upload {
        req: UploadRequest,
        body: &'a mut (dyn std::io::Read + Send),
    },
    /// [`SandboxApi::download`], with where the bytes go.
    Download {
        req: DownloadRequest,
        sink: &'a mut dyn ByteSink,
    },
    Diff(DiffRequest),
    Checkpoint(CheckpointRequest),
    Restore(CheckpointRequest),
    Export(ExportRequest),
    Destroy,
    /// [`SandboxApi::list_approvals`]
    ListApprovals {
        wait: Option<Duration>,
    },
    Approve {
        approval: Cow<'a, ApprovalId>,
    },
    Deny {
        approval: Cow<'a, ApprovalId>,
        reason: Cow<'a, str>,
    },
    /// [`SandboxApi::set_network`]
    SetNetwork(NetworkRules),
    /// [`SandboxApi::set_secret`]
    SetSecret(SecretUpdate),
    /// [`SandboxApi::fork`]
    Fork(ForkRequest),
}

/// The answer to an [`Op`]: one variant per result type. It serialises as the result itself
/// (`Done` as `null`), the JSON the HTTP API answers and traces record.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Answer {
    /// info
    Info(SandboxInfo),
    /// exec
    Exec(ExecOutcome),
    /// process, wait, kill
    Process(ProcessInfo),
    Read(ReadResult),
    Write(WriteResult),
    Edit(EditResult),
    Patch(PatchResult),
    /// list_dir
    List(ListResult),
    Search(SearchResult),
    Stat(StatResult),
    Download(DownloadResult),
    Diff(DiffResult),
    Checkpoint(CheckpointInfo),
    Export(ExportResult),
    /// list_approvals
    Approvals(Vec<Approval>),
    /// approve, deny
    Approval(Approval),
    /// set_network: the rules now in force
    Network(NetworkRules),
    /// set_secret: the secret's state (never its value)
    Secret(SecretStatus),
    /// fork: the new sandboxes
    Fork(ForkResult),
    /// write_stdin, remove, rename, restore, destroy: nothing to say but that it was done
    Done,
}

/// The name of an operation: what a trace records (`"op"`), a log line or a metric shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpName {
    /// [`SandboxApi::create`]: not an [`Op`] (there is no sandbox yet), but recorded as one.
    Create,
    Info,
    Exec,
    Process,
    Wait,
    Kill,
    WriteStdin,
    Read,
    Write,
    Edit,
    Patch,
    ListDir,
    Search,
    Stat,
    Remove,
    Rename,
    Upload,
    Download,
    Diff,
    Checkpoint,
    Restore,
    Export,
    Destroy,
    ListApprovals,
    Approve,
    Deny,
    SetNetwork,
    SetSecret,
    Fork,
}

impl OpName {
    /// Every name.
    pub const ALL: [OpName; 29] = [
        OpName::Create,
        OpName::Info,
        OpName::Exec,
        OpName::Process,
        OpName::Wait,
        OpName::Kill,
        OpName::WriteStdin,
        OpName::Read,
        OpName::Write,
        OpName::Edit,
        OpName::Patch,
        OpName::ListDir,
        OpName::Search,
        OpName::Stat,
        OpName::Remove,
        OpName::Rename,
        OpName::Upload,
        OpName::Download,
        OpName::Diff,
        OpName::Checkpoint,
        OpName::Restore,
        OpName::Export,
        OpName::Destroy,
        OpName::ListApprovals,
        OpName::Approve,
        OpName::Deny,
        OpName::SetNetwork,
        OpName::SetSecret,
        OpName::Fork,
    ];

    /// The name as traces record it (and as the HTTP routes mostly spell it: `list`, `move`,
    /// `stdin`, `network`). Recorded names never change: old traces must replay.
    pub fn as_str(self) -> &'static str {
        match self {
            OpName::Create => "create",
            OpName::Info => "info",
            OpName::Exec => "exec",
            OpName::Process => "process",
            OpName::Wait => "wait",
            OpName::Kill => "kill",
            OpName::WriteStdin => "stdin",
            OpName::Read => "read",
            OpName::Write => "write",
            OpName::Edit => "edit",
            OpName::Patch => "patch",
            OpName::ListDir => "list",
            OpName::Search => "search",
            OpName::Stat => "stat",
            OpName::Remove => "remove",
            OpName::Rename => "move",
            OpName::Upload => "upload",
            OpName::Download => "download",
            OpName::Diff => "diff",
            OpName::Checkpoint => "checkpoint",
            OpName::Restore => "restore",
            OpName::Export => "export",
            OpName::Destroy => "destroy",
            OpName::ListApprovals => "approvals",
            OpName::Approve => "approve",
            OpName::Deny => "deny",
            OpName::SetNetwork => "network",
            OpName::SetSecret => "secret",
            OpName::Fork => "fork",
        }
    }

    /// The request field that carries the operation's payload (a file's content, bytes for a
    /// process's stdin): it may be large, and a record may keep only its digest.
    pub fn payload_field(self) -> Option<&'static str> {
        match self {
            OpName::Write => Some("content"),
            OpName::WriteStdin => Some("data"),
            _ => None,
        }
    }
}

impl fmt::Display for OpName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no operation's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown operation {0:?}")]
pub struct UnknownOp(pub String);

impl FromStr for OpName {
    type Err = UnknownOp;
    fn from_str(s: &str) -> Result<OpName, UnknownOp> {
        match OpName::ALL.into_iter().find(|n| n.as_str() == s) {
            Some(name) => Ok(name),
            None => Err(UnknownOp(s.to_owned())),
        }
    }
}

/// Why a recorded request does not make an [`Op`].
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// `create` makes a sandbox; it is not an operation on one.
    #[error("{0} is not an operation on a sandbox")]
    NotAnOp(OpName),
    /// The JSON is not the operation's request.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Stdin data said to be base64 is not.
    #[error("its base64 data does not decode: {0}")]
    Base64(#[from] base64::DecodeError),
    /// An upload or a download streams its content, which no record holds.
    #[error("{0} streams its content, which the record does not hold")]
    Streamed(OpName),
    /// A rotation carries a secret's value, which no record holds.
    #[error("a secret's rotation carries its value, which the record does not hold")]
    SecretValue,
}

// The requests of the operations that take no request type of their own, as traces record
// them (field order as written: the JSON keys sort anyway).

#[derive(Serialize, Deserialize)]
struct ProcessCall {
    exec_id: u64,
}

#[derive(Serialize, Deserialize)]
struct WaitCall {
    exec_id: u64,
    #[serde(default)]
    timeout_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct KillCall {
    exec_id: u64,
    signal: i32,
}

#[derive(Serialize, Deserialize)]
struct StdinCall {
    exec_id: u64,
    /// UTF-8 text, or base64 when `encoding` is "base64".
    data: String,
    #[serde(default)]
    encoding: Option<String>,
    #[serde(default)]
    close: bool,
}

#[derive(Serialize, Deserialize)]
struct ApprovalsCall {
    #[serde(default)]
    wait_ms: Option<u64>,
}

/// A change of a secret as recorded: its name and what was done, never the value.
#[derive(Serialize, Deserialize)]
struct SecretCall {
    name: String,
    /// "rotate" or "revoke".
    action: String,
}

#[derive(Serialize, Deserialize)]
struct ApprovalCall {
    approval: ApprovalId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

/// `v` as JSON (the contract's types always serialise; the fallback says so if one did not).
fn to_value<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v)
        .unwrap_or_else(|e| json!({ "unserializable": format!("cannot serialize: {e}") }))
}

impl Op<'_> {
    pub fn name(&self) -> OpName {
        match self {
            Op::Info => OpName::Info,
            Op::Exec { .. } => OpName::Exec,
            Op::Process { .. } => OpName::Process,
            Op::Wait { .. } => OpName::Wait,
            Op::Kill { .. } => OpName::Kill,
            Op::WriteStdin { .. } => OpName::WriteStdin,
            Op::Read(_) => OpName::Read,
            Op::Write(_) => OpName::Write,
            Op::Edit(_) => OpName::Edit,
            Op::Patch(_) => OpName::Patch,
            Op::ListDir(_) => OpName::ListDir,
            Op::Search(_) => OpName::Search,
            Op::Stat(_) => OpName::Stat,
            Op::Remove(_) => OpName::Remove,
            Op::Rename(_) => OpName::Rename,
            Op::Upload { .. } => OpName::Upload,
            Op::Download { .. } => OpName::Download,
            Op::Diff(_) => OpName::Diff,
            Op::Checkpoint(_) => OpName::Checkpoint,
            Op::Restore(_) => OpName::Restore,
            Op::Export(_) => OpName::Export,
            Op::Destroy => OpName::Destroy,
            Op::ListApprovals { .. } => OpName::ListApprovals,
            Op::Approve { .. } => OpName::Approve,
            Op::Deny { .. } => OpName::Deny,
            Op::SetNetwork(_) => OpName::SetNetwork,
            Op::SetSecret(_) => OpName::SetSecret,
            Op::Fork(_) => OpName::Fork,
        }
    }

    /// Whether the operation may change the sandbox: its files, its processes, its rules, its
    /// existence, or let a waiting exec run. What a write-ahead record must catch before it
    /// runs. Only the operations that just look (and a denial, which ends a waiting exec
    /// without running it) are listed as not changing it: a new operation is on the safe side.
    pub fn changes_sandbox(&self) -> bool {
        match self {
            Op::Export(req) => req.apply,
            Op::Info
            | Op::Process { .. }
            | Op::Wait { .. }
            | Op::Read(_)
            | Op::ListDir(_)
            | Op::Search(_)
            | Op::Stat(_)
            | Op::Download { .. }
            | Op::Diff(_)
            | Op::ListApprovals { .. }
            | Op::Deny { .. } => false,
            _ => true,
        }
    }

    /// The background exec the operation is about (process, wait, kill, stdin), to rewrite it
    /// where exec ids differ (a replay).
    pub fn exec_id_mut(&mut self) -> Option<&mut u64> {
        match self {
            Op::Process { exec_id }
            | Op::Wait { exec_id, .. }
            | Op::Kill { exec_id, .. }
            | Op::WriteStdin { exec_id, .. } => Some(exec_id),
            _ => None,
        }
    }

    /// The operation's request as JSON, as traces record it: the request type's own JSON, or
    /// for the operations without one their arguments (`{"exec_id": 3, "timeout_ms": 500}`;
    /// stdin bytes as UTF-8 text, or base64 with `"encoding": "base64"`). The event sink is not
    /// part of it. [`Op::from_request`] reads it back.
    pub fn request(&self) -> Value {
        match self {
            Op::Info | Op::Destroy => json!({}),
            Op::Exec { req, .. } => to_value(req),
            Op::Process { exec_id } => to_value(&ProcessCall { exec_id: *exec_id }),
            Op::Wait { exec_id, timeout } => to_value(&WaitCall {
                exec_id: *exec_id,
                timeout_ms: timeout.as_millis() as u64,
            }),
            Op::Kill { exec_id, signal } => to_value(&KillCall {
                exec_id: *exec_id,
                signal: *signal,
            }),
            Op::WriteStdin {
                exec_id,
                data,
                close,
            } => {
                let (data, encoding) = match std::str::from_utf8(data) {
                    Ok(s) => (s.to_owned(), "utf-8"),
                    Err(_) => {
                        use base64::Engine as _;
                        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
                        (b64, "base64")
                    }
                };
                to_value(&StdinCall {
                    exec_id: *exec_id,
                    data,
                    encoding: Some(encoding.to_owned()),
                    close: *close,
                })
            }
            Op::Read(r) => to_value(r),
            Op::Write(r) => to_value(r),
            Op::Edit(r) => to_value(r),
            Op::Patch(r) => to_value(r),
            Op::ListDir(r) => to_value(r),
            Op::Search(r) => to_value(r),
            Op::Stat(r) => to_value(r),
            Op::Remove(r) => to_value(r),
            Op::Rename(r) => to_value(r),
            Op::Upload { req, .. } => to_value(req),
            Op::Download { req, .. } => to_value(req),
            Op::Diff(r) => to_value(r),
            Op::Checkpoint(r) | Op::Restore(r) => to_value(r),
            Op::Export(r) => to_value(r),
            Op::ListApprovals { wait } => to_value(&ApprovalsCall {
                wait_ms: wait.map(|w| w.as_millis() as u64),
            }),
            Op::Approve { approval } => to_value(&ApprovalCall {
                approval: approval.as_ref().clone(),
                reason: None,
            }),
            Op::Deny { approval, reason } => to_value(&ApprovalCall {
                approval: approval.as_ref().clone(),
                reason: Some(reason.as_ref().to_owned()),
            }),
            Op::SetNetwork(r) => to_value(r),
            // Never the value: this is what traces record and logs print.
            Op::SetSecret(u) => to_value(&SecretCall {
                name: u.name.clone(),
                action: if u.value.is_some() {
                    "rotate"
                } else {
                    "revoke"
                }
                .to_owned(),
            }),
            Op::Fork(r) => to_value(r),
        }
    }
}

impl Op<'static> {
    /// The operation `name` with the request `request` as [`Op::request`] writes it (an exec
    /// without an event sink).
    pub fn from_request(name: OpName, request: &Value) -> Result<Op<'static>, RequestError> {
        fn parse<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, RequestError> {
            Ok(T::deserialize(v)?)
        }
        Ok(match name {
            OpName::Create => return Err(RequestError::NotAnOp(name)),
            OpName::Upload | OpName::Download => return Err(RequestError::Streamed(name)),
            OpName::Info => Op::Info,
            OpName::Exec => Op::Exec {
                req: parse(request)?,
                events: None,
            },
            OpName::Process => {
                let c: ProcessCall = parse(request)?;
                Op::Process { exec_id: c.exec_id }
            }
            OpName::Wait => {
                let c: WaitCall = parse(request)?;
                Op::Wait {
                    exec_id: c.exec_id,
                    timeout: Duration::from_millis(c.timeout_ms),
                }
            }
            OpName::Kill => {
                let c: KillCall = parse(request)?;
                Op::Kill {
                    exec_id: c.exec_id,
                    signal: c.signal,
                }
            }
            OpName::WriteStdin => {
                let c: StdinCall = parse(request)?;
                let data = match c.encoding.as_deref() {
                    Some("base64") => {
                        use base64::Engine as _;
                        base64::engine::general_purpose::STANDARD.decode(&c.data)?
                    }
                    _ => c.data.into_bytes(),
                };
                Op::WriteStdin {
                    exec_id: c.exec_id,
                    data: Cow::Owned(data),
                    close: c.close,
                }
            }
            OpName::Read => Op::Read(parse(request)?),
            OpName::Write => Op::Write(parse(request)?),
            OpName::Edit => Op::Edit(parse(request)?),
            OpName::Patch => Op::Patch(parse(request)?),
            OpName::ListDir => Op::ListDir(parse(request)?),
            OpName::Search => Op::Search(parse(request)?),
            OpName::Stat => Op::Stat(parse(request)?),
            OpName::Remove => Op::Remove(parse(request)?),
            OpName::Rename => Op::Rename(parse(request)?),
            OpName::Diff => Op::Diff(parse(request)?),
            OpName::Checkpoint => Op::Checkpoint(parse(request)?),
            OpName::Restore => Op::Restore(parse(request)?),
            OpName::Export => Op::Export(parse(request)?),
            OpName::Destroy => Op::Destroy,
            OpName::ListApprovals => {
                let c: ApprovalsCall = parse(request)?;
                Op::ListApprovals {
                    wait: c.wait_ms.map(Duration::from_millis),
                }
            }
            OpName::Approve => {
                let c: ApprovalCall = parse(request)?;
                Op::Approve {
                    approval: Cow::Owned(c.approval),
                }
            }
            OpName::Deny => {
                let c: ApprovalCall = parse(request)?;
                Op::Deny {
                    approval: Cow::Owned(c.approval),
                    reason: Cow::Owned(c.reason.unwrap_or_default()),
                }
            }
            OpName::SetNetwork => Op::SetNetwork(parse(request)?),
            OpName::SetSecret => {
                let c: SecretCall = parse(request)?;
                if c.action != "revoke" {
                    return Err(RequestError::SecretValue);
                }
                Op::SetSecret(SecretUpdate {
                    name: c.name,
                    value: None,
                })
            }
            OpName::Fork => Op::Fork(parse(request)?),
        })
    }
}

impl fmt::Debug for Op<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.name(), self.request())
    }
}

impl Answer {
    /// What kind of answer it is, for messages ("operation read was answered with nothing").
    pub fn kind(&self) -> &'static str {
        match self {
            Answer::Info(_) => "sandbox info",
            Answer::Exec(_) => "an exec outcome",
            Answer::Process(_) => "a process",
            Answer::Read(_) => "a read result",
            Answer::Write(_) => "a write result",
            Answer::Edit(_) => "an edit result",
            Answer::Patch(_) => "a patch result",
            Answer::List(_) => "a list result",
            Answer::Search(_) => "a search result",
            Answer::Stat(_) => "a stat result",
            Answer::Download(_) => "a download result",
            Answer::Diff(_) => "a diff result",
            Answer::Checkpoint(_) => "a checkpoint",
            Answer::Export(_) => "an export result",
            Answer::Approvals(_) => "a list of approvals",
            Answer::Approval(_) => "an approval",
            Answer::Network(_) => "network rules",
            Answer::Secret(_) => "a secret's state",
            Answer::Fork(_) => "the forks",
            Answer::Done => "nothing",
        }
    }

    /// The answer to operation `name` from its JSON (as [`Answer`] serialises it, the HTTP API's
    /// answer body: `null` or an empty body for the operations that answer nothing).
    pub fn from_json(name: OpName, v: Value) -> Result<Answer, serde_json::Error> {
        let v = &v;
        Ok(match name {
            OpName::Create | OpName::Info => Answer::Info(Deserialize::deserialize(v)?),
            OpName::Exec => Answer::Exec(Deserialize::deserialize(v)?),
            OpName::Process | OpName::Wait | OpName::Kill => {
                Answer::Process(Deserialize::deserialize(v)?)
            }
            OpName::Read => Answer::Read(Deserialize::deserialize(v)?),
            OpName::Write | OpName::Upload => Answer::Write(Deserialize::deserialize(v)?),
            OpName::Download => Answer::Download(Deserialize::deserialize(v)?),
            OpName::Edit => Answer::Edit(Deserialize::deserialize(v)?),
            OpName::Patch => Answer::Patch(Deserialize::deserialize(v)?),
            OpName::ListDir => Answer::List(Deserialize::deserialize(v)?),
            OpName::Search => Answer::Search(Deserialize::deserialize(v)?),
            OpName::Stat => Answer::Stat(Deserialize::deserialize(v)?),
            OpName::Diff => Answer::Diff(Deserialize::deserialize(v)?),
            OpName::Checkpoint => Answer::Checkpoint(Deserialize::deserialize(v)?),
            OpName::Export => Answer::Export(Deserialize::deserialize(v)?),
            OpName::ListApprovals => Answer::Approvals(Deserialize::deserialize(v)?),
            OpName::Approve | OpName::Deny => Answer::Approval(Deserialize::deserialize(v)?),
            OpName::SetNetwork => Answer::Network(Deserialize::deserialize(v)?),
            OpName::SetSecret => Answer::Secret(Deserialize::deserialize(v)?),
            OpName::Fork => Answer::Fork(Deserialize::deserialize(v)?),
            OpName::WriteStdin
            | OpName::Remove
            | OpName::Rename
            | OpName::Restore
            | OpName::Destroy => Answer::Done,
        })
    }
}

/// The internal error for an answer that is not the one its operation gives: a bug in the
/// handler that gave it.
pub fn wrong_answer(op: OpName, answer: &Answer) -> ApiError {
    ApiError::internal(format!(
        "internal error: operation {op} was answered with {}",
        answer.kind()
    ))
}

/// Serves `op` with the typed method of `api` that it names: [`SandboxApi::call`] of every
/// backend, the one place that maps an operation to its method.
pub fn dispatch<A: SandboxApi + ?Sized>(
    api: &A,
    id: &SandboxId,
    op: Op<'_>,
) -> Result<Answer, ApiError> {
    Ok(match op {
        Op::Info => Answer::Info(api.info(id)?),
        Op::Exec { req, events } => Answer::Exec(api.exec(id, req, events)?),
        Op::Process { exec_id } => Answer::Process(api.process(id, exec_id)?),
        Op::Wait { exec_id, timeout } => Answer::Process(api.wait(id, exec_id, timeout)?),
        Op::Kill { exec_id, signal } => Answer::Process(api.kill(id, exec_id, signal)?),
        Op::WriteStdin {
            exec_id,
            data,
            close,
        } => {
            api.write_stdin(id, exec_id, &data, close)?;
            Answer::Done
        }
        Op::Read(r) => Answer::Read(api.read(id, r)?),
        Op::Write(r) => Answer::Write(api.write(id, r)?),
        Op::Edit(r) => Answer::Edit(api.edit(id, r)?),
        Op::Patch(r) => Answer::Patch(api.patch(id, r)?),
        Op::ListDir(r) => Answer::List(api.list_dir(id, r)?),
        Op::Search(r) => Answer::Search(api.search(id, r)?),
        Op::Stat(r) => Answer::Stat(api.stat(id, r)?),
        Op::Remove(r) => api.remove(id, r).map(|()| Answer::Done)?,
        Op::Rename(r) => api.rename(id, r).map(|()| Answer::Done)?,
        Op::Upload { req, body } => Answer::Write(api.upload(id, req, body)?),
        Op::Download { req, sink } => Answer::Download(api.download(id, req, sink)?),
        Op::Diff(r) => Answer::Diff(api.diff(id, r)?),
        Op::Checkpoint(r) => Answer::Checkpoint(api.checkpoint(id, r)?),
        Op::Restore(r) => api.restore(id, r).map(|()| Answer::Done)?,
        Op::Export(r) => Answer::Export(api.export(id, r)?),
        Op::Destroy => api.destroy(id).map(|()| Answer::Done)?,
        Op::ListApprovals { wait } => Answer::Approvals(api.list_approvals(id, wait)?),
        Op::Approve { approval } => Answer::Approval(api.approve(id, &approval)?),
        Op::Deny { approval, reason } => Answer::Approval(api.deny(id, &approval, &reason)?),
        Op::SetNetwork(r) => Answer::Network(api.set_network(id, r)?),
        Op::SetSecret(u) => Answer::Secret(api.set_secret(id, u)?),
        Op::Fork(r) => Answer::Fork(api.fork(id, r)?),
    })
}

/// A [`SandboxApi`] written as one function over operations: implement this, and the blanket
/// implementation gives every typed method. For decorators (match the operations you treat
/// apart, hand the rest on with `inner.call(id, op)`), clients and fakes.
pub trait OpHandler: Send + Sync {
    /// [`SandboxApi::create`] (named apart, so that calling `create` on a handler is not
    /// ambiguous between the two traits).
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError>;
    /// [`SandboxApi::list`]
    fn handle_list(&self) -> Vec<SandboxInfo>;
    /// Serves one operation on sandbox `id`; the answer must be the one the operation gives
    /// (else the typed method returns an internal error naming both).
    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError>;
}

/// The typed methods of an [`OpHandler`], one row each: `method(arguments) -> result = the
/// operation it builds => the answer it takes back out` (`Done` for the methods that return
/// nothing). Any other answer is a [`wrong_answer`].
macro_rules! handler_methods {
    ($( $m:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty = $op:expr => $answer:ident; )*) => {
        $(
            fn $m(&self, id: &SandboxId $(, $arg: $ty)*) -> Result<$out, ApiError> {
                let op = $op;
                let name = op.name();
                match self.handle(id, op)? {
                    handler_methods!(@pattern $answer v) => Ok(handler_methods!(@value $answer v)),
                    other => Err(wrong_answer(name, &other)),
                }
            }
        )*
    };
    (@pattern Done $v:ident) => { Answer::Done };
    (@pattern $answer:ident $v:ident) => { Answer::$answer($v) };
    (@value Done $v:ident) => { () };
    (@value $answer:ident $v:ident) => { $v };
}

impl<H: OpHandler> SandboxApi for H {
    fn create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        self.handle_create(req)
    }

    fn list(&self) -> Vec<SandboxInfo> {
        self.handle_list()
    }

    fn call(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        self.handle(id, op)
    }

    handler_methods! {
        info() -> SandboxInfo = Op::Info => Info;
        exec(req: ExecRequest, events: Option<&mut (dyn FnMut(ExecEvent) + Send)>) -> ExecOutcome
            = Op::Exec { req, events } => Exec;
        process(exec_id: u64) -> ProcessInfo = Op::Process { exec_id } => Process;
        wait(exec_id: u64, timeout: Duration) -> ProcessInfo = Op::Wait { exec_id, timeout }
            => Process;
        kill(exec_id: u64, signal: i32) -> ProcessInfo = Op::Kill { exec_id, signal } => Process;
        write_stdin(exec_id: u64, data: &[u8], close: bool) -> ()
            = Op::WriteStdin { exec_id, data: Cow::Borrowed(data), close } => Done;
        read(req: ReadRequest) -> ReadResult = Op::Read(req) => Read;
        write(req: WriteRequest) -> WriteResult = Op::Write(req) => Write;
        edit(req: EditRequest) -> EditResult = Op::Edit(req) => Edit;
        patch(req: PatchRequest) -> PatchResult = Op::Patch(req) => Patch;
        list_dir(req: ListRequest) -> ListResult = Op::ListDir(req) => List;
        search(req: SearchRequest) -> SearchResult = Op::Search(req) => Search;
        stat(req: PathRequest) -> StatResult = Op::Stat(req) => Stat;
        remove(req: RemoveRequest) -> () = Op::Remove(req) => Done;
        rename(req: MoveRequest) -> () = Op::Rename(req) => Done;
        upload(req: UploadRequest, body: &mut (dyn std::io::Read + Send)) -> WriteResult
            = Op::Upload { req, body } => Write;
        download(req: DownloadRequest, sink: &mut dyn ByteSink) -> DownloadResult
            = Op::Download { req, sink } => Download;
        diff(req: DiffRequest) -> DiffResult = Op::Diff(req) => Diff;
        checkpoint(req: CheckpointRequest) -> CheckpointInfo = Op::Checkpoint(req) => Checkpoint;
        restore(req: CheckpointRequest) -> () = Op::Restore(req) => Done;
        export(req: ExportRequest) -> ExportResult = Op::Export(req) => Export;
        destroy() -> () = Op::Destroy => Done;
        list_approvals(wait: Option<Duration>) -> Vec<Approval> = Op::ListApprovals { wait }
            => Approvals;
        approve(approval: &ApprovalId) -> Approval
            = Op::Approve { approval: Cow::Borrowed(approval) } => Approval;
        deny(approval: &ApprovalId, reason: &str) -> Approval
            = Op::Deny { approval: Cow::Borrowed(approval), reason: Cow::Borrowed(reason) }
            => Approval;
        set_network(rules: NetworkRules) -> NetworkRules = Op::SetNetwork(rules) => Network;
        set_secret(update: SecretUpdate) -> SecretStatus = Op::SetSecret(update) => Secret;
        fork(req: ForkRequest) -> ForkResult = Op::Fork(req) => Fork;
    }
}
