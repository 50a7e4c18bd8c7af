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
use sha2::{Digest, Sha256};

mod record;
pub mod schedule;
#[cfg(feature = "testutil")]
pub mod testserver;

pub use record::{
    ActionRecord, ActionState, Checkpoint, Claim, ClaimDecision, DEFAULT_ATTEMPTS, TaskRecord,
    TaskResult, TaskSpec, TaskState, WorkspaceSource,
};
pub use schedule::{Overlap, Schedule, ScheduleTiming};

/// The work queue's stream.
pub const STREAM: &str = "TASKBOX_TASKS";
/// The subject a task's message is published on.
pub const SUBJECT: &str = "taskbox.tasks.run";
/// The key-value bucket of task records and idempotency keys.
pub const RECORDS: &str = "taskbox_tasks";
/// The object store of workspaces, reports, diffs and traces.
pub const ARTIFACTS: &str = "taskbox_artifacts";
/// The workers' shared durable consumer of the work queue.
pub const CONSUMER: &str = "taskbox-workers";
/// The longest a JetStream request that may go unanswered is waited for.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the stream remembers a message id: a submit retried within it publishes once.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(10 * 60);
/// The longest idempotency key taken, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Compare-and-set tries of one change before it gives up (each lost race is another writer's
/// change landing first).
const CAS_TRIES: usize = 32;

/// What a submit did.
#[derive(Debug, Clone, PartialEq)]
pub struct Submitted {
    pub task: TaskRecord,
    /// False when the idempotency key already named this task (a retried submit).
    pub new: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("cannot reach NATS at {url}: {why} (is nats-server running with JetStream, -js?)")]
    Connect { url: String, why: String },
    /// A server address that is no NATS URL: no later try reaches it either.
    #[error("cannot reach NATS at {url}: {why} (is nats-server running with JetStream, -js?)")]
    BadUrl { url: String, why: String },
    #[error("NATS JetStream: {0}")]
    JetStream(String),
    #[error("no task {0}")]
    NotFound(String),
    #[error("no schedule {0}")]
    NoSchedule(String),
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
    #[error("task record {id} cannot be read: {why}")]
    Undecodable { id: String, why: String },
    /// A change that decided to change nothing (internal to compare-and-set loops).
    #[error("unchanged")]
    Unchanged,
    #[error("task {id}: attempt {attempt} lost its claim (the task is with {now} now)")]
    ClaimLost {
        id: String,
        attempt: u32,
        now: String,
    },
}

impl QueueError {
    /// Whether trying again later may succeed (the server or the network, not the request).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            QueueError::Connect { .. } | QueueError::JetStream(_) | QueueError::Contended(_)
        )
    }
}

/// How the queue's parts are made when they are missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Copies of each stream kept by a NATS cluster (1 on a single server; 3 in a cluster of
    /// three survives one server's loss).
    pub replicas: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { replicas: 1 }
    }
}

fn js_err(context: &str, e: impl std::fmt::Display) -> QueueError {
    QueueError::JetStream(format!("{context}: {e}"))
}

/// `request` within [`REQUEST_TIMEOUT`]: a clustered server may not answer a request at all
/// (while it elects a leader, or another client makes what is asked for), and the caller tries
/// again. The request's own answer is left to the caller.
async fn within<F: std::future::Future>(what: &str, request: F) -> Result<F::Output, QueueError> {
    tokio::time::timeout(REQUEST_TIMEOUT, request)
        .await
        .map_err(|e| js_err(what, format!("no answer ({e})")))
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
        Queue::connect_with(url, Settings::default()).await
    }

    /// [`Queue::connect`] with the settings of the parts it makes.
    pub async fn connect_with(url: &str, settings: Settings) -> Result<Queue, QueueError> {
        let bad = |why: String| QueueError::BadUrl {
            url: url.to_string(),
            why,
        };
        let servers = url
            .split(',')
            .map(|u| {
                u.trim()
                    .parse::<async_nats::ServerAddr>()
                    .map_err(|e| bad(format!("{:?} is not a NATS URL: {e}", u.trim())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(servers)
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
            num_replicas: settings.replicas,
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
            num_replicas: settings.replicas,
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
                    num_replicas: settings.replicas,
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
            claim: None,
            checkpoint: None,
            actions: Vec::new(),
            result: None,
            started_unix_ms: None,
            ended_unix_ms: None,
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
        self.publish_as(id, id).await
    }

    /// Publishes task `id`'s message again (a wake-up for a task whose message was lost with
    /// a server): another message id than the first, so the stream does not drop it.
    pub async fn republish(&self, id: &str) -> Result<(), QueueError> {
        self.publish_as(id, &format!("{id}.{}", now_ms())).await
    }

    async fn publish_as(&self, id: &str, msg_id: &str) -> Result<(), QueueError> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
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
    pub async fn load(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, QueueError> {
        let entry = self
            .records
            .entry(task_entry(id))
            .await
            .map_err(|e| js_err("a task record", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let task: TaskRecord =
            serde_json::from_slice(&entry.value).map_err(|e| QueueError::Undecodable {
                id: id.to_string(),
                why: e.to_string(),
            })?;
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
            if task.state == TaskState::Queued {
                task.ended_unix_ms = Some(now_ms());
            }
            task.state = TaskState::Cancelled;
            task.reasons.push(format!("cancelled: {why}"));
            Ok(())
        })
        .await
    }

    /// The work queue's stream, looked up within [`REQUEST_TIMEOUT`].
    async fn task_stream(&self) -> Result<jetstream::stream::Stream, QueueError> {
        within("the task stream", self.js.get_stream(STREAM))
            .await?
            .map_err(|e| js_err("the task stream", e))
    }

    /// The workers' shared pull consumer of the work queue. A message a worker took and then
    /// stopped answering for (no ack, no progress) for `claim_timeout` goes to another worker.
    /// The first worker makes it; later ones use it as it is (its claim timeout included).
    pub async fn consumer(
        &self,
        claim_timeout: Duration,
    ) -> Result<jetstream::consumer::PullConsumer, QueueError> {
        // Every call is bounded (see `within`).
        const WHAT: &str = "the workers' consumer";
        let s = self.task_stream().await?;
        let found = within(
            WHAT,
            s.get_consumer::<jetstream::consumer::pull::Config>(CONSUMER),
        )
        .await?;
        if let Ok(c) = found {
            return Ok(c);
        }
        let made = within(
            WHAT,
            s.create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(CONSUMER.to_string()),
                description: Some("taskbox workers".to_string()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: claim_timeout,
                max_deliver: -1,
                max_ack_pending: 100_000,
                ..Default::default()
            }),
        )
        .await?;
        match made {
            Ok(c) => Ok(c),
            // Another worker made it first.
            Err(_) => within(WHAT, s.get_consumer(CONSUMER))
                .await?
                .map_err(|e| js_err(WHAT, e)),
        }
    }

    /// Decides (and records) what `worker` does with task `id`'s message: see
    /// [`TaskRecord::claim`].
    pub async fn claim(
        &self,
        id: &str,
        worker: &str,
        claim_timeout: Duration,
    ) -> Result<(ClaimDecision, TaskRecord), QueueError> {
        let (first, _) = self
            .load(id)
            .await?
            .ok_or_else(|| QueueError::NotFound(id.to_string()))?;
        let after = match &first.spec.after {
            Some(a) => Some(match self.load(a).await? {
                Some((t, _)) => t.state,
                // A task it waits for that does not exist holds nothing up.
                None => TaskState::Cancelled,
            }),
            None => None,
        };
        let mut decision = ClaimDecision::Ended;
        let task = self
            .update(id, |t| {
                decision = t.claim(worker, now_ms(), claim_timeout, after);
                match decision {
                    ClaimDecision::Wait { .. } | ClaimDecision::Ended => Err(QueueError::Unchanged),
                    _ => Ok(()),
                }
            })
            .await;
        match task {
            Ok(t) => Ok((decision, t)),
            Err(QueueError::Unchanged) => Ok((decision, self.task(id).await?)),
            Err(e) => Err(e),
        }
    }

    /// Changes task `id` as the holder of attempt `attempt` (refused with
    /// [`QueueError::ClaimLost`] when `worker` no longer holds it).
    pub async fn update_claimed(
        &self,
        id: &str,
        worker: &str,
        attempt: u32,
        mut change: impl FnMut(&mut TaskRecord) -> Result<(), QueueError>,
    ) -> Result<TaskRecord, QueueError> {
        self.update(id, |t| {
            t.fence(worker, attempt)?;
            change(t)
        })
        .await
    }

    /// The worker is alive: its claim's heartbeat. Returns the record (a cancel shows in its
    /// state).
    pub async fn heartbeat(
        &self,
        id: &str,
        worker: &str,
        attempt: u32,
    ) -> Result<TaskRecord, QueueError> {
        self.update_claimed(id, worker, attempt, |t| {
            if let Some(c) = t.claim.as_mut() {
                c.heartbeat_unix_ms = now_ms();
            }
            Ok(())
        })
        .await
    }

    /// Marks undecodable record `id` failed (its spec is gone: an empty one takes its place),
    /// keeping the start of what it held in the reasons. Nothing happens when it can be read
    /// (another worker fixed it first).
    pub async fn fail_undecodable(&self, id: &str) -> Result<(), QueueError> {
        let entry = self
            .records
            .entry(task_entry(id))
            .await
            .map_err(|e| js_err("a task record", e))?;
        let Some(entry) = entry else {
            return Err(QueueError::NotFound(id.to_string()));
        };
        let why = match serde_json::from_slice::<TaskRecord>(&entry.value) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let held: String = String::from_utf8_lossy(&entry.value)
            .chars()
            .take(200)
            .collect();
        let task = TaskRecord {
            id: id.to_string(),
            idempotency_key: None,
            spec: TaskSpec::new(
                "",
                WorkspaceSource::Object {
                    name: String::new(),
                },
            ),
            state: TaskState::Failed,
            attempts: 0,
            reasons: vec![format!(
                "failed: the task record cannot be decoded ({why}); it held: {held:?}"
            )],
            submitted_unix_ms: 0,
            claim: None,
            checkpoint: None,
            actions: Vec::new(),
            result: None,
            started_unix_ms: None,
            ended_unix_ms: Some(now_ms()),
        };
        match self
            .records
            .update(task_entry(id), encode(&task)?, entry.revision)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(()),
            Err(e) => Err(js_err("a task record", e)),
        }
    }

    /// Writes `data` as object `name` of the artifact store (replacing one of that name).
    pub async fn put_artifact(&self, name: &str, data: &[u8]) -> Result<(), QueueError> {
        let mut reader = data;
        self.artifacts
            .put(name, &mut reader)
            .await
            .map_err(|e| js_err(&format!("storing {name}"), e))?;
        Ok(())
    }

    /// Object `name` of the artifact store, or `None` when there is none.
    pub async fn get_artifact(&self, name: &str) -> Result<Option<Vec<u8>>, QueueError> {
        use tokio::io::AsyncReadExt;
        let mut object = match self.artifacts.get(name).await {
            Ok(o) => o,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(js_err(&format!("reading {name}"), e)),
        };
        let mut out = Vec::new();
        object
            .read_to_end(&mut out)
            .await
            .map_err(|e| js_err(&format!("reading {name}"), e))?;
        Ok(Some(out))
    }

    /// Pulls waiting at the workers' consumer: how many workers (or slots) stand ready to take
    /// a task now. 0 when no worker has made the consumer yet.
    pub async fn waiting_pulls(&self) -> Result<usize, QueueError> {
        let s = self.task_stream().await?;
        match within("the workers' consumer", s.consumer_info(CONSUMER)).await? {
            Ok(info) => Ok(info.num_waiting),
            Err(e) if e.to_string().contains("not found") => Ok(0),
            Err(e) => Err(js_err("the workers' consumer", e)),
        }
    }

    /// Messages waiting in the work queue (not yet taken by a worker).
    pub async fn depth(&self) -> Result<u64, QueueError> {
        let mut s = self.task_stream().await?;
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

/// The object name of artifact `file` of task `id`'s attempt `attempt`: each attempt writes
/// under names of its own, so a worker that lost its claim cannot overwrite the next one's.
pub fn artifact_name(id: &str, attempt: u32, file: &str) -> String {
    format!("tasks/{id}/a{attempt}/{file}")
}

fn task_entry(id: &str) -> String {
    format!("task.{id}")
}

/// Milliseconds since the epoch (the records' clock).
pub fn now_ms() -> u64 {
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
        TaskSpec::new(
            "goal = \"fix the test\"\n",
            WorkspaceSource::Git {
                url: "https://example.invalid/repo.git".into(),
                commit: "0123456789abcdef0123456789abcdef01234567".into(),
            },
        )
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
            claim: None,
            checkpoint: Some(Checkpoint {
                attempt: 1,
                turn: 3,
            }),
            actions: vec![],
            result: None,
            started_unix_ms: Some(2),
            ended_unix_ms: None,
        };
        let back: TaskRecord = serde_json::from_slice(&encode(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        let minimal = r#"{"id":"task-1","spec":{"contract":"c","workspace":{"kind":"object","name":"ws.tar"}},"state":"queued","attempts":0,"submitted_unix_ms":5}"#;
        let t: TaskRecord = serde_json::from_str(minimal).unwrap();
        assert_eq!(t.spec.max_attempts, DEFAULT_ATTEMPTS);
        assert!(t.reasons.is_empty());
    }
}
