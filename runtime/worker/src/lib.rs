//! `taskbox worker`: takes tasks from the shared queue (NATS JetStream, `taskbox-queue`) and
//! runs each with the agent (`taskbox-agent`) in a fresh sandbox of the worker's backend.
//!
//! Any number of workers, on any machines, share one queue; none knows of the others. What
//! keeps them apart is the task's record in the key-value store, changed only by
//! compare-and-set: a worker claims a task (its name and the attempt's number become the
//! record's fence), keeps the claim alive with heartbeats and in-progress acks of the task's
//! message, checkpoints the task's state and trace to the object store after every turn, and
//! ends the task under the same fence. A worker that dies (or goes silent past the claim
//! timeout) loses the claim: the message comes back to another worker, which resumes the task
//! from its last checkpoint in a fresh sandbox; whatever the silent one still tries to write is
//! refused. See `docs/worker.md`.

mod actions;
mod attempt;
pub mod metrics;
mod source;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use futures_util::StreamExt;
use serde::Deserialize;
use taskbox_core::api::SandboxApi;
use taskbox_queue::{ClaimDecision, Queue, QueueError, Settings, now_ms};

pub use metrics::Metrics;

/// Why an attempt failed, and whether trying again can help.
#[derive(Debug, Clone)]
pub struct Failure {
    pub why: String,
    /// Retrying cannot help (a contract that does not parse, a tar that is refused): the task
    /// fails at once instead of using up its attempts.
    pub permanent: bool,
}

impl Failure {
    pub fn permanent(why: impl Into<String>) -> Failure {
        Failure {
            why: why.into(),
            permanent: true,
        }
    }

    pub fn transient(why: impl Into<String>) -> Failure {
        Failure {
            why: why.into(),
            permanent: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("cannot serve metrics on {addr}: {why}")]
    Metrics { addr: String, why: String },
}

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The NATS server(s), comma-separated.
    pub nats: String,
    /// The worker's name in task records (unique among the workers).
    pub name: String,
    /// The worker's own directory: task directories (the agent's state, trace and report).
    pub dir: PathBuf,
    /// Where the tasks' workspaces are checked out: outside the state directory, which no
    /// sandbox may have as its workspace.
    pub workspaces: PathBuf,
    /// Tasks run at once.
    pub concurrency: usize,
    /// A worker silent this long loses its task to another (the consumer's ack wait; the first
    /// worker to make the consumer sets it).
    pub claim_timeout: Duration,
    pub replicas: usize,
    /// The sandboxes' policy (name or file); default: the default policy.
    pub policy: Option<String>,
    /// The sandboxes' image (default: the host view) and backend (default: the API's first).
    pub image: Option<String>,
    pub backend: Option<String>,
    /// Whether this worker fires schedules (every worker may: each window is decided once).
    pub schedules: bool,
}

impl WorkerConfig {
    pub fn new(
        nats: impl Into<String>,
        name: impl Into<String>,
        dir: PathBuf,
        workspaces: PathBuf,
    ) -> WorkerConfig {
        WorkerConfig {
            nats: nats.into(),
            name: name.into(),
            dir,
            workspaces,
            concurrency: 1,
            claim_timeout: Duration::from_secs(30),
            replicas: 1,
            policy: None,
            image: None,
            backend: None,
            schedules: true,
        }
    }
}

/// A worker connected to the queue.
pub struct Worker {
    cfg: WorkerConfig,
    api: Arc<dyn SandboxApi>,
    queue: Queue,
    metrics: Arc<Metrics>,
    /// Set at shutdown: running attempts stop at their next step and hand their task back.
    draining: Arc<AtomicBool>,
    /// Ended attempts' cleanups in flight (one per slot).
    cleanups: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.cfg.name)
            .finish_non_exhaustive()
    }
}

/// A task's message: its id.
#[derive(Deserialize)]
struct Wake {
    id: String,
}

impl Worker {
    /// Connects to the queue (making its parts when missing).
    pub async fn connect(
        cfg: WorkerConfig,
        api: Arc<dyn SandboxApi>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Worker>, WorkerError> {
        let queue = connect_patiently(&cfg).await?;
        let slots = cfg.concurrency.max(1);
        Ok(Arc::new(Worker {
            cleanups: Arc::new(tokio::sync::Semaphore::new(slots)),
            cfg,
            api,
            queue,
            metrics,
            draining: Arc::new(AtomicBool::new(false)),
        }))
    }

    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    fn workspace_dir(&self, id: &str, attempt: u32) -> PathBuf {
        self.cfg.workspaces.join(format!("{id}-a{attempt}"))
    }

    /// Takes and runs tasks until `shutdown` resolves; then takes no more, stops the running
    /// ones at their next step, hands them back to the queue and returns.
    pub async fn run(
        self: Arc<Self>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), WorkerError> {
        let consumer = attempt::retrying(|| self.queue.consumer(self.cfg.claim_timeout)).await?;
        self.metrics.set_healthy(true);
        tracing::info!(worker = %self.cfg.name, nats = %self.cfg.nats, concurrency = self.cfg.concurrency, "worker started");
        let stop = Arc::new(AtomicBool::new(false));
        let background = tokio::spawn(background(self.clone(), stop.clone()));
        let slots = Arc::new(tokio::sync::Semaphore::new(self.cfg.concurrency.max(1)));
        let mut running = tokio::task::JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                _ = &mut shutdown => break,
                p = slots.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let fetched = tokio::select! {
                _ = &mut shutdown => break,
                m = fetch_one(&consumer) => m,
            };
            match fetched {
                Ok(Some(msg)) => {
                    self.metrics.set_healthy(true);
                    let w = self.clone();
                    running.spawn(async move {
                        w.handle(msg).await;
                        drop(permit);
                    });
                }
                Ok(None) => self.metrics.set_healthy(true),
                Err(e) => {
                    self.metrics.set_healthy(false);
                    tracing::warn!(error = %e, "cannot take a task from the queue; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            while running.try_join_next().is_some() {}
        }
        tracing::info!(worker = %self.cfg.name, running = running.len(), "shutting down: handing the running tasks back");
        self.draining.store(true, Ordering::SeqCst);
        stop.store(true, Ordering::SeqCst);
        while running.join_next().await.is_some() {}
        // The ended attempts' cleanups too.
        let _ = self
            .cleanups
            .acquire_many(self.cfg.concurrency.max(1) as u32)
            .await;
        background.abort();
        Ok(())
    }

    /// One message: decide by the task's record, then run an attempt or let it be.
    async fn handle(self: Arc<Self>, msg: async_nats::jetstream::Message) {
        let id = match serde_json::from_slice::<Wake>(&msg.payload) {
            Ok(w) => w.id,
            Err(e) => {
                let shown: String = String::from_utf8_lossy(&msg.payload)
                    .chars()
                    .take(100)
                    .collect();
                tracing::warn!(error = %e, payload = %shown, "a message that is no task: dropped");
                let _ = msg.ack().await;
                return;
            }
        };
        let claimed = attempt::retrying(|| {
            self.queue
                .claim(&id, &self.cfg.name, self.cfg.claim_timeout)
        })
        .await;
        let (decision, record) = match claimed {
            Ok(c) => c,
            Err(QueueError::NotFound(_)) => {
                tracing::warn!(task = %id, "a message for a task with no record: dropped");
                let _ = msg.ack().await;
                return;
            }
            Err(QueueError::Undecodable { why, .. }) => {
                tracing::warn!(task = %id, why = %why, "a task record that cannot be decoded: failed");
                let _ = attempt::retrying(|| self.queue.fail_undecodable(&id)).await;
                self.metrics.ended("", "failed", 0.0, None);
                let _ = msg.ack().await;
                return;
            }
            Err(e) => {
                tracing::warn!(task = %id, error = %e, "cannot claim a task; its message comes back");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                return;
            }
        };
        match decision {
            ClaimDecision::Run { attempt, takeover } => {
                attempt::run(self.clone(), msg, record, attempt, takeover).await
            }
            ClaimDecision::Wait { delay, why } => {
                tracing::debug!(task = %id, why = %why, ?delay, "not now");
                let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            }
            ClaimDecision::Ended => {
                let _ = msg.ack().await;
            }
            ClaimDecision::Dead => {
                tracing::warn!(task = %id, "out of attempts: dead");
                self.metrics.ended(
                    record.spec.tenant.as_deref().unwrap_or_default(),
                    "dead",
                    0.0,
                    record
                        .ended_unix_ms
                        .map(|e| e.saturating_sub(record.submitted_unix_ms) as f64 / 1000.0),
                );
                let _ = msg.ack().await;
            }
        }
    }
}

/// How long a starting worker keeps trying to reach its queue: a worker may start before its
/// NATS servers, or while a cluster elects the leader of its streams (whose requests then time
/// out), as deployments start their parts in any order.
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

/// [`Queue::connect_with`], tried again every second for [`CONNECT_PATIENCE`] while the queue
/// cannot be reached or does not answer (a transient error); a URL that is not one fails at once.
async fn connect_patiently(cfg: &WorkerConfig) -> Result<Queue, WorkerError> {
    let since = std::time::Instant::now();
    let settings = Settings {
        replicas: cfg.replicas,
    };
    loop {
        match Queue::connect_with(&cfg.nats, settings).await {
            Ok(q) => return Ok(q),
            Err(e) if !e.is_transient() || since.elapsed() >= CONNECT_PATIENCE => {
                return Err(e.into());
            }
            Err(e) => {
                tracing::warn!(error = %e, "the queue does not answer yet; trying again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The next message of the work queue, or none within a second (a pull that waits at the
/// server: `fetch` would return at once when the queue is empty, and the loop would spin).
async fn fetch_one(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
) -> Result<Option<async_nats::jetstream::Message>, String> {
    let pull = async {
        let mut batch = consumer
            .batch()
            .max_messages(1)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .map_err(|e| e.to_string())?;
        match batch.next().await {
            Some(Ok(m)) => Ok(Some(m)),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(None),
        }
    };
    // A pull whose answer never comes (a request lost while a cluster forms or a server goes)
    // must not stop the worker: after the expiry and a margin, pull again. The server ends a
    // pull at its expiry (1 s) with a status message; 1.5 s more covers a slow link, and a lost
    // pull costs a worker 2.5 s of idling, not 5.
    match tokio::time::timeout(Duration::from_millis(2500), pull).await {
        Ok(r) => r,
        Err(_) => {
            tracing::debug!("a pull went unanswered; pulling again");
            Ok(None)
        }
    }
}

/// What a worker does besides tasks: the queue's depth for the metrics, and the schedules.
async fn background(w: Arc<Worker>, stop: Arc<AtomicBool>) {
    let mut schedules = Vec::new();
    let mut listed_at = 0u64;
    let mut depth_at = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let now = now_ms();
        if now.saturating_sub(depth_at) >= 2000 {
            depth_at = now;
            match w.queue.depth().await {
                Ok(d) => w.metrics.set_depth(d),
                Err(e) => tracing::debug!(error = %e, "cannot read the queue's depth"),
            }
        }
        if w.cfg.schedules {
            if now.saturating_sub(listed_at) >= 5000 {
                match w.queue.schedules().await {
                    Ok(s) => {
                        schedules = s;
                        listed_at = now;
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot list the schedules"),
                }
            }
            for s in &schedules {
                match w.queue.fire(s, now_ms()).await {
                    Ok(Some(taskbox_queue::schedule::Fired::Submitted {
                        window_unix_ms,
                        task,
                    })) => {
                        w.metrics.fired();
                        tracing::info!(schedule = %s.name, window = window_unix_ms, task = %task, "schedule fired");
                    }
                    Ok(Some(taskbox_queue::schedule::Fired::Skipped {
                        window_unix_ms,
                        running,
                    })) => {
                        tracing::info!(schedule = %s.name, window = window_unix_ms, running = %running, "window skipped: the last task still runs");
                    }
                    Ok(None) => {}
                    // Removed since listed: gone at the next listing.
                    Err(e) => {
                        tracing::debug!(schedule = %s.name, error = %e, "cannot fire a schedule")
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
