//! Durable tasks on NATS JetStream, shared by every worker on every machine (issue 18).
//!
//! Three JetStream parts, made on first use by whoever connects first (their configuration is
//! fixed, so a second worker's "create" of the same is a no-op, not a conflict):
//!
//! - the stream [`STREAM`], a work queue on [`SUBJECT`]: one message per task, a wake-up for the
//!   workers (`Nats-Msg-Id` is the task's id, so a retried publish within [`DEDUP_WINDOW`] is
//!   stored once);
//! - the key-value bucket [`RECORDS`]: the truth about every task (`task.ID`: its
//!   [`TaskRecord`], changed only by compare-and-set on the entry's revision), and the
//!   idempotency keys (`key.SHA256`: the id of the task a key named first);
//! - the object store [`ARTIFACTS`]: workspaces handed in as tars, reports, diffs and traces.
//!
//! A message may arrive twice (a publish retried past the window, a redelivery): the record's
//! state decides what a worker does with it, never the message alone.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv, object_store, stream};
use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[cfg(feature = "testutil")]
pub mod testserver;

/// The work queue's stream.
pub const STREAM: &str = "TASKBOX_TASKS";
/// The subject a task's message is published on.
pub const SUBJECT: &str = "taskbox.tasks.run";
/// The key-value bucket of task records and idempotency keys.
pub const RECORDS: &str = "taskbox_tasks";
/// The object store of workspaces, reports, diffs and traces.
pub const ARTIFACTS: &str = "taskbox_artifacts";
/// How long the stream remembers a message id: a submit retried within it publishes once.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(10 * 60);
/// Attempts of a task before it is dead, unless its spec says otherwise.
pub const DEFAULT_ATTEMPTS: u32 = 3;
/// The longest idempotency key taken, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Compare-and-set tries of one change before it gives up (each lost race is another writer's
/// change landing first).
const CAS_TRIES: usize = 32;

/// Where a task's workspace comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkspaceSource {
    /// A git repository at one commit.
    Git { url: String, commit: String },
    /// A tar in the object store [`ARTIFACTS`], by name.
    Object { name: String },
}

/// What a task is: a work contract (the agent's TOML, checked by the worker that runs it) and
/// its workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub contract: String,
    pub workspace: WorkspaceSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Attempts before the task is dead ([`TaskState::Dead`]).
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
}

fn default_attempts() -> u32 {
    DEFAULT_ATTEMPTS
}

impl TaskSpec {
    /// Why this spec cannot be queued, if it cannot.
    pub fn check(&self) -> Result<(), QueueError> {
        let invalid = |why: &str| {
            Err(QueueError::Invalid {
                what: "task",
                why: why.to_string(),
            })
        };
        if self.contract.trim().is_empty() {
            return invalid("the contract is empty");
        }
        if self.max_attempts == 0 {
            return invalid("max_attempts must be at least 1");
        }
        match &self.workspace {
            WorkspaceSource::Git { url, commit } => {
                if url.trim().is_empty() {
                    return invalid("the workspace's git url is empty");
                }
                let hex = commit.bytes().all(|b| b.is_ascii_hexdigit());
                if !(7..=64).contains(&commit.len()) || !hex {
                    return invalid(
                        "the workspace's commit must be a commit id (7 to 64 hex digits), not a \
                         branch or tag: a task runs on exactly one tree",
                    );
                }
            }
            WorkspaceSource::Object { name } => {
                if name.trim().is_empty() {
                    return invalid("the workspace's object name is empty");
                }
            }
        }
        Ok(())
    }
}

/// Where a task is in its life. Only [`TaskState::Queued`] and [`TaskState::Running`] change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Queued,
    Running,
    Completed,
    Failed,
    /// Out of attempts: its reasons say why each failed.
    Dead,
    Cancelled,
}

impl TaskState {
    /// Whether the task has ended.
    pub fn is_final(self) -> bool {
        !matches!(self, TaskState::Queued | TaskState::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Queued => "queued",
            TaskState::Running => "running",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Dead => "dead",
            TaskState::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A task as the key-value store holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub spec: TaskSpec,
    pub state: TaskState,
    pub attempts: u32,
    /// What happened to it, oldest first (a failed attempt's cause, a cancel).
    #[serde(default)]
    pub reasons: Vec<String>,
    pub submitted_unix_ms: u64,
}

/// What a submit did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    pub task: TaskRecord,
    /// False when the idempotency key already named this task (a retried submit).
    pub new: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("cannot reach NATS at {url}: {why} (is nats-server running with JetStream, -js?)")]
    Connect { url: String, why: String },
    #[error("NATS JetStream: {0}")]
    JetStream(String),
    #[error("no task {0}")]
    NotFound(String),
    #[error("task {id} has ended ({state}), so it cannot be {what}")]
    Ended {
        id: String,
        state: TaskState,
        what: &'static str,
    },
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
    #[error("task {0} changed under {CAS_TRIES} tries in a row; try again")]
    Contended(String),
}

fn js_err(context: &str, e: impl std::fmt::Display) -> QueueError {
    QueueError::JetStream(format!("{context}: {e}"))
}

/// A connection to the queue.
#[derive(Clone)]
pub struct Queue {
    js: jetstream::Context,
    records: kv::Store,
    artifacts: object_store::ObjectStore,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("stream", &STREAM)
            .field("records", &self.records.name)
            .field("artifacts", &ARTIFACTS)
            .finish()
    }
}

impl Queue {
    /// Connects to `url` (`nats://HOST:PORT`, several comma-separated for a cluster) and makes
    /// the stream, the bucket and the object store if they are missing.
    pub async fn connect(url: &str) -> Result<Queue, QueueError> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .map_err(|e| QueueError::Connect {
                url: url.to_string(),
                why: e.to_string(),
            })?;
        let js = jetstream::new(client);
        js.get_or_create_stream(stream::Config {
            name: STREAM.to_string(),
            subjects: vec![SUBJECT.to_string()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: DEDUP_WINDOW,
            ..Default::default()
        })
        .await
        .map_err(|e| js_err("the task stream", e))?;
        // The bucket's stream is made here with the key-value layout (what the library's
        // `create_key_value` makes), because that call first reads the account's info and
        // cannot parse what a 2.9 server (Debian's) sends; binding to it then needs no account
        // info (docs/decisions.md, "The task queue on NATS JetStream").
        js.get_or_create_stream(stream::Config {
            name: format!("KV_{RECORDS}"),
            description: Some("taskbox: task records and idempotency keys".to_string()),
            subjects: vec![format!("$KV.{RECORDS}.>")],
            max_messages_per_subject: 8,
            storage: stream::StorageType::File,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .map_err(|e| js_err("the task records", e))?;
        let records = js
            .get_key_value(RECORDS)
            .await
            .map_err(|e| js_err("the task records", e))?;
        let artifacts = match js.get_object_store(ARTIFACTS).await {
            Ok(os) => os,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: ARTIFACTS.to_string(),
                    description: Some("taskbox: workspaces, reports, diffs, traces".to_string()),
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| js_err("the artifact store", e))?,
        };
        Ok(Queue {
            js,
            records,
            artifacts,
        })
    }

    /// The object store of workspaces and results.
    pub fn artifacts(&self) -> &object_store::ObjectStore {
        &self.artifacts
    }

    /// Queues `spec`. With an idempotency key, a submit that names a key already used returns
    /// that task (`new: false`) instead of making another, and one that died half-way (its key
    /// taken, its record or its message missing) is finished by the next; the same key with
    /// another spec is refused.
    pub async fn submit(&self, spec: TaskSpec, key: Option<&str>) -> Result<Submitted, QueueError> {
        spec.check()?;
        let mut id = new_task_id();
        if let Some(key) = key {
            if key.is_empty() || key.len() > MAX_KEY_BYTES {
                return Err(QueueError::Invalid {
                    what: "idempotency key",
                    why: format!("it must be 1 to {MAX_KEY_BYTES} bytes"),
                });
            }
            let entry = key_entry(key);
            match self
                .records
                .create(&entry, bytes::Bytes::from(id.clone()))
                .await
            {
                Ok(_) => {}
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    let named = self
                        .records
                        .get(entry)
                        .await
                        .map_err(|e| js_err("an idempotency key", e))?
                        .ok_or_else(|| {
                            QueueError::JetStream(
                                "an idempotency key vanished while it was read".into(),
                            )
                        })?;
                    id = String::from_utf8_lossy(&named).into_owned();
                    if let Some((task, _)) = self.load(&id).await? {
                        if task.spec != spec {
                            return Err(QueueError::Invalid {
                                what: "idempotency key",
                                why: format!("it already names task {} with another spec", id),
                            });
                        }
                        if task.state == TaskState::Queued {
                            // Its first submit may have died before its message went out.
                            self.publish(&id).await?;
                        }
                        return Ok(Submitted { task, new: false });
                    }
                    // The first submit died between its key and its record: finish it.
                }
                Err(e) => return Err(js_err("an idempotency key", e)),
            }
        }
        let task = TaskRecord {
            id: id.clone(),
            idempotency_key: key.map(str::to_string),
            spec,
            state: TaskState::Queued,
            attempts: 0,
            reasons: Vec::new(),
            submitted_unix_ms: now_ms(),
        };
        match self.records.create(task_entry(&id), encode(&task)?).await {
            Ok(_) => {}
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                // Another submit of the same key finished it first.
                let (task, _) = self
                    .load(&id)
                    .await?
                    .ok_or_else(|| QueueError::NotFound(id.clone()))?;
                return Ok(Submitted { task, new: false });
            }
            Err(e) => return Err(js_err("a task record", e)),
        }
        self.publish(&id).await?;
        Ok(Submitted { task, new: true })
    }

    /// Publishes task `id`'s message and waits for the stream to store it.
    async fn publish(&self, id: &str) -> Result<(), QueueError> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        let payload = serde_json::to_vec(&serde_json::json!({ "id": id }))
            .map_err(|e| QueueError::JetStream(e.to_string()))?;
        self.js
            .publish_with_headers(SUBJECT, headers, payload.into())
            .await
            .map_err(|e| js_err("publishing a task", e))?
            .await
            .map_err(|e| js_err("the stream's ack of a task", e))?;
        Ok(())
    }

    /// Task `id` with its entry's revision, or `None`.
    async fn load(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, QueueError> {
        let entry = self
            .records
            .entry(task_entry(id))
            .await
            .map_err(|e| js_err("a task record", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let task: TaskRecord = serde_json::from_slice(&entry.value)
            .map_err(|e| QueueError::JetStream(format!("task record {id} cannot be read: {e}")))?;
        Ok(Some((task, entry.revision)))
    }

    /// Task `id`.
    pub async fn task(&self, id: &str) -> Result<TaskRecord, QueueError> {
        self.load(id)
            .await?
            .map(|(t, _)| t)
            .ok_or_else(|| QueueError::NotFound(id.to_string()))
    }

    /// Every task, oldest first.
    pub async fn tasks(&self) -> Result<Vec<TaskRecord>, QueueError> {
        let keys: Vec<String> = self
            .records
            .keys()
            .await
            .map_err(|e| js_err("the task records' keys", e))?
            .try_collect()
            .await
            .map_err(|e| js_err("the task records' keys", e))?;
        let mut out = Vec::new();
        for key in keys {
            if let Some(id) = key.strip_prefix("task.")
                && let Some((task, _)) = self.load(id).await?
            {
                out.push(task);
            }
        }
        out.sort_by(|a, b| (a.submitted_unix_ms, &a.id).cmp(&(b.submitted_unix_ms, &b.id)));
        Ok(out)
    }

    /// Changes task `id` with `change` by compare-and-set: read, change, write at the read
    /// revision, again when another writer came first. `change` refuses with an error.
    pub async fn update(
        &self,
        id: &str,
        mut change: impl FnMut(&mut TaskRecord) -> Result<(), QueueError>,
    ) -> Result<TaskRecord, QueueError> {
        for _ in 0..CAS_TRIES {
            let (mut task, revision) = self
                .load(id)
                .await?
                .ok_or_else(|| QueueError::NotFound(id.to_string()))?;
            change(&mut task)?;
            match self
                .records
                .update(task_entry(id), encode(&task)?, revision)
                .await
            {
                Ok(_) => return Ok(task),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(js_err("a task record", e)),
            }
        }
        Err(QueueError::Contended(id.to_string()))
    }

    /// Cancels task `id`: a queued task is never started, a running one is stopped by its
    /// worker at its next turn. An ended task is refused with its state.
    pub async fn cancel(&self, id: &str, why: &str) -> Result<TaskRecord, QueueError> {
        self.update(id, |task| {
            if task.state.is_final() {
                return Err(QueueError::Ended {
                    id: task.id.clone(),
                    state: task.state,
                    what: "cancelled",
                });
            }
            task.state = TaskState::Cancelled;
            task.reasons.push(format!("cancelled: {why}"));
            Ok(())
        })
        .await
    }

    /// Messages waiting in the work queue (not yet taken by a worker).
    pub async fn depth(&self) -> Result<u64, QueueError> {
        let mut s = self
            .js
            .get_stream(STREAM)
            .await
            .map_err(|e| js_err("the task stream", e))?;
        let info = s.info().await.map_err(|e| js_err("the task stream", e))?;
        Ok(info.state.messages)
    }
}

fn encode(task: &TaskRecord) -> Result<bytes::Bytes, QueueError> {
    serde_json::to_vec(task)
        .map(bytes::Bytes::from)
        .map_err(|e| QueueError::JetStream(format!("a task record cannot be written: {e}")))
}

/// The bucket's entry of idempotency key `key`. A key-value key holds only `[-/_=.a-zA-Z0-9]`
/// and an idempotency key is any string, so its entry is named by its digest.
pub fn key_entry(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("key.{hex}")
}

fn task_entry(id: &str) -> String {
    format!("task.{id}")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A fresh task id: `task-` and 16 hex digits (the random part of a sandbox id).
pub fn new_task_id() -> String {
    let raw = taskbox_contract::api::SandboxId::generate();
    format!("task-{}", raw.as_str().trim_start_matches("sb-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git_spec() -> TaskSpec {
        TaskSpec {
            contract: "goal = \"fix the test\"\n".into(),
            workspace: WorkspaceSource::Git {
                url: "https://example.invalid/repo.git".into(),
                commit: "0123456789abcdef0123456789abcdef01234567".into(),
            },
            tenant: None,
            max_attempts: 3,
        }
    }

    #[test]
    fn a_spec_names_what_is_wrong_with_it() {
        let mut s = git_spec();
        s.workspace = WorkspaceSource::Git {
            url: "https://example.invalid/repo.git".into(),
            commit: "main".into(),
        };
        let e = s.check().unwrap_err().to_string();
        assert!(e.contains("commit id"), "{e}");
        let mut s = git_spec();
        s.contract = " \n".into();
        assert!(
            s.check()
                .unwrap_err()
                .to_string()
                .contains("contract is empty")
        );
        let mut s = git_spec();
        s.max_attempts = 0;
        assert!(s.check().unwrap_err().to_string().contains("max_attempts"));
        assert!(git_spec().check().is_ok());
    }

    #[test]
    fn idempotency_keys_become_valid_entry_names() {
        let e = key_entry("PR #12 / fix: ünïcode & spaces");
        assert!(e.starts_with("key."));
        assert!(e[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(e, key_entry("PR #12 / fix: ünïcode & spaces"));
        assert_ne!(e, key_entry("PR #13"));
    }

    #[test]
    fn records_round_trip_and_old_ones_get_defaults() {
        let t = TaskRecord {
            id: new_task_id(),
            idempotency_key: Some("k".into()),
            spec: git_spec(),
            state: TaskState::Running,
            attempts: 1,
            reasons: vec![],
            submitted_unix_ms: 1,
        };
        let back: TaskRecord = serde_json::from_slice(&encode(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        let minimal = r#"{"id":"task-1","spec":{"contract":"c","workspace":{"kind":"object","name":"ws.tar"}},"state":"queued","attempts":0,"submitted_unix_ms":5}"#;
        let t: TaskRecord = serde_json::from_str(minimal).unwrap();
        assert_eq!(t.spec.max_attempts, DEFAULT_ATTEMPTS);
        assert!(t.reasons.is_empty());
    }
}
