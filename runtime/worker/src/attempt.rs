//! One attempt of one task on this worker: its workspace, the agent (started, or resumed from
//! the last turn another attempt saved), the turn checkpoints, the heartbeat that keeps the
//! claim and sees a cancel, the maximum duration, the results, the actions, the record's end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::Message;
use taskbox_agent::agent::{REPORT_JSON, REPORT_MD, STATE_FILE, TRACE_FILE};
use taskbox_agent::contract::Contract;
use taskbox_agent::model::ModelConfig;
use taskbox_agent::state::TaskState as AgentState;
use taskbox_agent::{Options, Report, TaskSpec as AgentTask, TurnObserver};
use taskbox_core::api::{ExportRequest, SandboxApi};
use taskbox_queue::{
    Queue, QueueError, TaskRecord, TaskResult, TaskState, WorkspaceSource, artifact_name, now_ms,
};

use crate::actions::{self, ActionContext};
use crate::{Failure, Worker, source};

/// The flags an attempt's helpers set.
#[derive(Default)]
struct Flags {
    /// Set to stop the agent at its next step.
    cancel: Arc<AtomicBool>,
    /// The claim moved to another worker: nothing of this attempt may be recorded.
    lost: AtomicBool,
    /// The task ran past its maximum duration.
    overtime: AtomicBool,
    /// The task was cancelled through the queue.
    cancelled: AtomicBool,
}

/// Copies each completed turn's state and trace to the object store and records the turn as
/// the task's checkpoint, under the attempt's claim.
struct Uploader {
    queue: Queue,
    handle: tokio::runtime::Handle,
    id: String,
    worker: String,
    attempt: u32,
    flags: Arc<Flags>,
}

impl TurnObserver for Uploader {
    fn turn_ended(&self, task_dir: &Path, turn: u32) {
        let read = |f: &str| std::fs::read(task_dir.join(f));
        let (Ok(state), Ok(trace)) = (read(STATE_FILE), read(TRACE_FILE)) else {
            tracing::warn!(task = %self.id, turn, "cannot read the turn's state to checkpoint it");
            return;
        };
        let saved = self.handle.block_on(retrying(|| async {
            let q = &self.queue;
            q.put_artifact(&artifact_name(&self.id, self.attempt, STATE_FILE), &state)
                .await?;
            q.put_artifact(&artifact_name(&self.id, self.attempt, TRACE_FILE), &trace)
                .await?;
            q.update_claimed(&self.id, &self.worker, self.attempt, |t| {
                t.checkpoint = Some(taskbox_queue::Checkpoint {
                    attempt: self.attempt,
                    turn,
                });
                Ok(())
            })
            .await
        }));
        match saved {
            Ok(_) => tracing::debug!(task = %self.id, turn, "turn checkpointed"),
            Err(QueueError::ClaimLost { .. }) => {
                tracing::warn!(task = %self.id, turn, "the claim was lost: stopping this attempt");
                self.flags.lost.store(true, Ordering::SeqCst);
                self.flags.cancel.store(true, Ordering::SeqCst);
            }
            Err(e) => {
                tracing::warn!(task = %self.id, turn, error = %e, "cannot checkpoint a turn; a takeover would resume from an earlier one")
            }
        }
    }
}

/// Calls `op` until it succeeds or fails for a reason other than the server (a transient
/// error is tried again for about half a minute: a NATS server restarting, a cluster electing).
pub async fn retrying<T, F, Fut>(mut op: F) -> Result<T, QueueError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, QueueError>>,
{
    let mut wait = Duration::from_millis(100);
    let mut tries = 0;
    loop {
        match op().await {
            Err(e) if e.is_transient() && tries < 12 => {
                tracing::debug!(error = %e, "queue call failed; trying again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
                tries += 1;
            }
            other => return other,
        }
    }
}

/// How an attempt ended, for the message and the metrics.
enum Ending {
    /// The task ended (its record is final): ack.
    Ended {
        state: TaskState,
        cost_usd: f64,
        record: Box<TaskRecord>,
    },
    /// Back in the queue for another attempt after `delay`.
    Retry(Duration),
    /// Handed back at shutdown: another worker resumes it at once.
    HandedBack,
    /// The claim was lost: the message is another attempt's now.
    Lost,
}

pub async fn run(
    worker: Arc<Worker>,
    msg: Message,
    record: TaskRecord,
    attempt: u32,
    takeover: bool,
) {
    let id = record.id.clone();
    let tenant = record.spec.tenant.clone().unwrap_or_default();
    let wait = (!takeover && attempt == 1)
        .then(|| now_ms().saturating_sub(record.submitted_unix_ms) as f64 / 1000.0);
    worker.metrics.started(&tenant, takeover, wait);
    tracing::info!(task = %id, attempt, takeover, "attempt started");
    let msg = Arc::new(msg);
    let flags = Arc::new(Flags::default());
    let beat = tokio::spawn(heartbeat(
        worker.clone(),
        msg.clone(),
        id.clone(),
        attempt,
        flags.clone(),
    ));
    let deadline = record.spec.max_duration_ms.map(|max| {
        let started = record.started_unix_ms.unwrap_or_else(now_ms);
        let left = (started + max).saturating_sub(now_ms());
        let (flags, api, id) = (flags.clone(), worker.api.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(left)).await;
            tracing::info!(task = %id, "past its maximum duration: stopping it");
            flags.overtime.store(true, Ordering::SeqCst);
            flags.cancel.store(true, Ordering::SeqCst);
            // A command that runs on does not see the cancel: its sandbox goes.
            tokio::time::sleep(Duration::from_secs(5)).await;
            let _ = tokio::task::spawn_blocking(move || destroy_sandboxes(api.as_ref(), &id)).await;
        })
    });
    let ending = attempt_task(&worker, &record, attempt, &flags).await;
    beat.abort();
    if let Some(d) = deadline {
        d.abort();
    }
    // The attempt's sandboxes, known now: a later attempt of the same task on this worker makes
    // its own, which the cleanup below must not touch.
    let sandboxes: Vec<_> = worker
        .api
        .list()
        .into_iter()
        .filter(|i| i.labels.get("agent.task").map(String::as_str) == Some(id.as_str()))
        .map(|i| i.id)
        .collect();
    worker.metrics.stopped();
    match ending {
        Ending::Ended {
            state,
            cost_usd,
            record,
        } => {
            let total = record
                .ended_unix_ms
                .map(|e| e.saturating_sub(record.submitted_unix_ms) as f64 / 1000.0);
            worker
                .metrics
                .ended(&tenant, state.as_str(), cost_usd, total);
            tracing::info!(task = %id, attempt, state = %state, "task ended");
            ack(&msg, AckKind::Ack).await;
        }
        Ending::Retry(delay) => {
            tracing::info!(task = %id, attempt, ?delay, "attempt failed; the task is queued again");
            ack(&msg, AckKind::Nak(Some(delay))).await;
        }
        Ending::HandedBack => {
            tracing::info!(task = %id, attempt, "handed back");
            ack(&msg, AckKind::Nak(None)).await;
        }
        Ending::Lost => {
            tracing::warn!(task = %id, attempt, "the claim was lost; this attempt's result is dropped");
        }
    }
    // Unmounts and a directory tree, after the ack and beside the next task (at most one
    // cleanup per slot; shutdown waits for them).
    let (api, ws) = (worker.api.clone(), worker.workspace_dir(&id, attempt));
    let slot = worker.cleanups.clone().acquire_owned().await;
    tokio::task::spawn_blocking(move || {
        for sb in sandboxes {
            let _ = api.destroy(&sb);
        }
        let _ = std::fs::remove_dir_all(ws);
        drop(slot);
    });
}

async fn ack(msg: &Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::debug!(error = %e, "the message's ack did not reach the server (it comes back, and its record says what to do)");
    }
}

/// Keeps the claim: an in-progress ack of the message and the record's heartbeat, a third of
/// the claim timeout apart. Sees a cancel, and a lost claim.
async fn heartbeat(
    worker: Arc<Worker>,
    msg: Arc<Message>,
    id: String,
    attempt: u32,
    flags: Arc<Flags>,
) {
    let every = (worker.cfg.claim_timeout / 3).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(every).await;
        let _ = msg.ack_with(AckKind::Progress).await;
        match worker.queue.heartbeat(&id, &worker.cfg.name, attempt).await {
            Ok(t) if t.state == TaskState::Cancelled => {
                flags.cancelled.store(true, Ordering::SeqCst);
                flags.cancel.store(true, Ordering::SeqCst);
            }
            Ok(_) => {}
            Err(QueueError::ClaimLost { .. }) => {
                flags.lost.store(true, Ordering::SeqCst);
                flags.cancel.store(true, Ordering::SeqCst);
                return;
            }
            Err(e) => tracing::warn!(task = %id, error = %e, "heartbeat failed"),
        }
    }
}

/// Destroys the sandboxes of task `id` still alive on this worker.
fn destroy_sandboxes(api: &dyn SandboxApi, id: &str) {
    for info in api.list() {
        if info.labels.get("agent.task").map(String::as_str) == Some(id) {
            let _ = api.destroy(&info.id);
        }
    }
}

/// The attempt's body: everything between the claim and the message's ack.
async fn attempt_task(
    worker: &Arc<Worker>,
    record: &TaskRecord,
    attempt: u32,
    flags: &Arc<Flags>,
) -> Ending {
    let id = &record.id;
    let prepared = prepare(worker, record, attempt).await;
    let (contract, task_dir, ws) = match prepared {
        Ok(p) => p,
        Err(f) => return fail(worker, record, attempt, f).await,
    };
    let model = match ModelConfig::from_env(contract.model.clone()) {
        Ok(m) => m,
        Err(e) => {
            return fail(
                worker,
                record,
                attempt,
                Failure::transient(format!("no model for the task: {e}")),
            )
            .await;
        }
    };
    let resume = record.checkpoint.is_some();
    let uploader = Arc::new(Uploader {
        queue: worker.queue.clone(),
        handle: tokio::runtime::Handle::current(),
        id: id.clone(),
        worker: worker.cfg.name.clone(),
        attempt,
        flags: flags.clone(),
    });
    let mut opts = Options::new(&task_dir);
    // The worker's stops (a cancel, the maximum duration, a lost claim, shutdown) do not wait
    // for a model call in flight.
    opts.interrupt = flags.cancel.clone();
    opts.on_turn = Some(uploader);
    let api = worker.api.clone();
    let spec = AgentTask {
        contract: contract.clone(),
        workspace: ws.display().to_string(),
        policy: worker.cfg.policy.clone(),
        image: worker.cfg.image.clone(),
        backend: worker.cfg.backend.clone(),
    };
    let draining = worker.draining.clone();
    let cancel = flags.cancel.clone();
    // The worker's shutdown stops the agent at its next step too.
    let watch = tokio::spawn(async move {
        loop {
            if draining.load(Ordering::SeqCst) {
                cancel.store(true, Ordering::SeqCst);
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let ran = tokio::task::spawn_blocking(move || {
        let model = model.build().map_err(|e| e.to_string())?;
        let r = if resume {
            taskbox_agent::resume(api, model, opts)
        } else {
            taskbox_agent::start(api, model, spec, opts)
        };
        r.map_err(|e| e.to_string())
    })
    .await;
    watch.abort();
    if flags.lost.load(Ordering::SeqCst) {
        return Ending::Lost;
    }
    let report = match ran {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return fail(worker, record, attempt, Failure::transient(e)).await;
        }
        Err(e) => {
            return fail(
                worker,
                record,
                attempt,
                Failure::transient(format!("the agent's thread failed: {e}")),
            )
            .await;
        }
    };
    let overtime = flags.overtime.load(Ordering::SeqCst);
    if worker.draining.load(Ordering::SeqCst)
        && !overtime
        && !flags.cancelled.load(Ordering::SeqCst)
        && !report.succeeded()
    {
        return hand_back(worker, record, attempt, report.metrics.turns).await;
    }
    finish(
        worker, record, attempt, &contract, &task_dir, &ws, report, overtime,
    )
    .await
}

/// The task's directory, workspace and contract, ready for the agent: on a resume, the state
/// and trace of the last checkpoint, with the workspace's path of this worker.
async fn prepare(
    worker: &Arc<Worker>,
    record: &TaskRecord,
    attempt: u32,
) -> Result<(Contract, PathBuf, PathBuf), Failure> {
    let id = &record.id;
    let contract = Contract::parse(&record.spec.contract, "the task's contract")
        .map_err(|e| Failure::permanent(e.to_string()))?;
    let task_dir = worker.cfg.dir.join("tasks").join(id);
    let ws = worker.workspace_dir(id, attempt);
    for d in [&task_dir, &ws] {
        if d.exists() {
            std::fs::remove_dir_all(d)
                .map_err(|e| Failure::transient(format!("cannot clear {}: {e}", d.display())))?;
        }
    }
    if let Some(parent) = ws.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Failure::transient(format!("cannot create {}: {e}", parent.display())))?;
    }
    match &record.spec.workspace {
        WorkspaceSource::Git { url, commit } => {
            let (url, commit, ws) = (url.clone(), commit.clone(), ws.clone());
            tokio::task::spawn_blocking(move || source::git_checkout(&url, &commit, &ws))
                .await
                .map_err(|e| Failure::transient(e.to_string()))??;
        }
        WorkspaceSource::Object { name } => {
            let data = retrying(|| worker.queue.get_artifact(name))
                .await
                .map_err(|e| Failure::transient(e.to_string()))?
                .ok_or_else(|| {
                    Failure::permanent(format!(
                        "no workspace object {name:?} in the artifact store"
                    ))
                })?;
            let (name, ws) = (name.clone(), ws.clone());
            tokio::task::spawn_blocking(move || source::untar(&name, &data, &ws))
                .await
                .map_err(|e| Failure::transient(e.to_string()))??;
        }
    }
    std::fs::create_dir_all(&task_dir)
        .map_err(|e| Failure::transient(format!("cannot create {}: {e}", task_dir.display())))?;
    if let Some(cp) = record.checkpoint {
        for file in [STATE_FILE, TRACE_FILE] {
            let object = artifact_name(id, cp.attempt, file);
            let data = retrying(|| worker.queue.get_artifact(&object))
                .await
                .map_err(|e| Failure::transient(e.to_string()))?
                .ok_or_else(|| {
                    Failure::transient(format!(
                        "the checkpoint of turn {} (attempt {}) has no {file}",
                        cp.turn, cp.attempt
                    ))
                })?;
            std::fs::write(task_dir.join(file), data)
                .map_err(|e| Failure::transient(format!("cannot write {file}: {e}")))?;
        }
        let state_path = task_dir.join(STATE_FILE);
        let mut st = AgentState::load(&state_path).map_err(Failure::transient)?;
        st.workspace = ws.display().to_string();
        st.save(&state_path)
            .map_err(|e| Failure::transient(format!("cannot write the state: {e}")))?;
        tracing::info!(task = %id, from_turn = cp.turn, from_attempt = cp.attempt, "resuming from a checkpoint");
    }
    Ok((contract, task_dir, ws))
}

/// A failed attempt: recorded (queued again, dead, or failed when retrying cannot help).
async fn fail(worker: &Arc<Worker>, record: &TaskRecord, attempt: u32, f: Failure) -> Ending {
    tracing::warn!(task = %record.id, attempt, permanent = f.permanent, why = %f.why, "attempt failed");
    let updated = retrying(|| {
        worker
            .queue
            .update_claimed(&record.id, &worker.cfg.name, attempt, |t| {
                t.fail_attempt(&f.why, f.permanent, now_ms());
                Ok(())
            })
    })
    .await;
    match updated {
        Ok(t) if t.state.is_final() => Ending::Ended {
            state: t.state,
            cost_usd: 0.0,
            record: Box::new(t),
        },
        Ok(_) => Ending::Retry(backoff(attempt)),
        Err(QueueError::ClaimLost { .. }) => Ending::Lost,
        Err(e) => {
            tracing::warn!(task = %record.id, error = %e, "cannot record the failed attempt; the message comes back");
            Ending::Retry(backoff(attempt))
        }
    }
}

/// The wait before another attempt: 1 s, 2 s, 4 s, ... at most a minute.
fn backoff(attempt: u32) -> Duration {
    Duration::from_secs(1u64 << attempt.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

async fn hand_back(worker: &Arc<Worker>, record: &TaskRecord, attempt: u32, turns: u32) -> Ending {
    let name = worker.cfg.name.clone();
    let r = retrying(|| {
        worker
            .queue
            .update_claimed(&record.id, &name, attempt, |t| {
                t.claim = None;
                t.state = TaskState::Queued;
                // Not a failure: the attempt does not count.
                t.attempts = t.attempts.saturating_sub(1);
                t.reasons.push(format!(
                    "handed back by worker {name} as it shut down, after turn {turns}"
                ));
                Ok(())
            })
    })
    .await;
    match r {
        Ok(_) => Ending::HandedBack,
        Err(QueueError::ClaimLost { .. }) => Ending::Lost,
        Err(_) => Ending::Retry(Duration::ZERO),
    }
}

/// The agent ended: its results to the object store, the actions when it completed, the
/// record's end.
#[allow(clippy::too_many_arguments)]
async fn finish(
    worker: &Arc<Worker>,
    record: &TaskRecord,
    attempt: u32,
    contract: &Contract,
    task_dir: &Path,
    ws: &Path,
    report: Report,
    overtime: bool,
) -> Ending {
    let id = &record.id;
    let name = worker.cfg.name.clone();
    let mut files: Vec<(&str, Vec<u8>)> = vec![("diff.patch", report.diff.clone().into_bytes())];
    for f in [REPORT_JSON, REPORT_MD, TRACE_FILE, STATE_FILE] {
        if let Ok(data) = std::fs::read(task_dir.join(f)) {
            files.push((f, data));
        }
    }
    for (f, data) in &files {
        let object = artifact_name(id, attempt, f);
        if let Err(e) = retrying(|| worker.queue.put_artifact(&object, data)).await {
            return fail(
                worker,
                record,
                attempt,
                Failure::transient(format!("cannot store the task's {f}: {e}")),
            )
            .await;
        }
    }
    let mut why = None;
    let mut completed = report.succeeded() && !overtime;
    if overtime {
        why = Some(format!(
            "stopped: it ran past its maximum duration of {}",
            fmt_ms(record.spec.max_duration_ms.unwrap_or(0))
        ));
    }
    if completed && !contract.actions.is_empty() {
        match run_actions(worker, record, attempt, contract, ws, &report).await {
            Ok(failed) if failed.is_empty() => {}
            Ok(failed) => {
                completed = false;
                why = Some(format!("actions failed: {}", failed.join("; ")));
            }
            Err(QueueError::ClaimLost { .. }) => return Ending::Lost,
            Err(e) => {
                return fail(worker, record, attempt, Failure::transient(e.to_string())).await;
            }
        }
    }
    let m = &report.metrics;
    let result = TaskResult {
        attempt,
        worker: name.clone(),
        termination: report.termination.to_string(),
        detail: report.detail.clone(),
        turns: m.turns,
        tokens_in: m.tokens_in,
        tokens_out: m.tokens_out,
        cost_usd: m.cost_usd,
        wall_ms: m.wall_ms,
        files_changed: report.files_changed.clone(),
    };
    let done = retrying(|| {
        worker.queue.update_claimed(id, &name, attempt, |t| {
            t.finish(result.clone(), completed, why.clone(), now_ms());
            Ok(())
        })
    })
    .await;
    match done {
        Ok(t) => Ending::Ended {
            state: t.state,
            cost_usd: m.cost_usd,
            record: Box::new(t),
        },
        Err(QueueError::ClaimLost { .. }) => Ending::Lost,
        Err(e) => {
            tracing::warn!(task = %id, error = %e, "cannot record the task's end; the message comes back");
            Ending::Retry(Duration::from_secs(1))
        }
    }
}

fn fmt_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Runs each action that no attempt has begun; the names and errors of those that failed.
async fn run_actions(
    worker: &Arc<Worker>,
    record: &TaskRecord,
    attempt: u32,
    contract: &Contract,
    ws: &Path,
    report: &Report,
) -> Result<Vec<String>, QueueError> {
    let id = &record.id;
    let name = worker.cfg.name.clone();
    let mut failed = Vec::new();
    let mut applied = false;
    for (i, action) in contract.actions.iter().enumerate() {
        let action_name = contract.action_name(i);
        let begun = retrying(|| {
            worker.queue.update_claimed(id, &name, attempt, |t| {
                match t.begin_action(&action_name, action.kind(), attempt)? {
                    Some(_) => Err(QueueError::Unchanged),
                    None => Ok(()),
                }
            })
        })
        .await;
        match begun {
            Ok(_) => {}
            Err(QueueError::Unchanged) => {
                tracing::info!(task = %id, action = %action_name, "action already run or begun by an earlier attempt: not run again");
                continue;
            }
            Err(e) => return Err(e),
        }
        let git_url = match &record.spec.workspace {
            WorkspaceSource::Git { url, .. } => Some(url.clone()),
            WorkspaceSource::Object { .. } => None,
        };
        if matches!(action, taskbox_agent::contract::ActionSpec::GitPush { .. }) && !applied {
            // The change onto the worker's clone (the sandbox's lower layer, done with now).
            let sandbox = taskbox_core::api::SandboxId::parse(&report.sandbox);
            let api = worker.api.clone();
            let exported = tokio::task::spawn_blocking(move || {
                let id = sandbox.map_err(|e| e.to_string())?;
                api.export(
                    &id,
                    ExportRequest {
                        apply: true,
                        ..ExportRequest::default()
                    },
                )
                .map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            if let Err(e) = exported {
                let why = format!("cannot apply the change to push it: {e}");
                end_action(worker, id, attempt, &action_name, false, &why).await?;
                failed.push(format!("{action_name}: {why}"));
                continue;
            }
            applied = true;
        }
        let (a, n, task, rep, ws, submitted) = (
            action.clone(),
            action_name.clone(),
            id.clone(),
            report.clone(),
            ws.to_path_buf(),
            record.submitted_unix_ms,
        );
        let outcome = tokio::task::spawn_blocking(move || {
            let cx = ActionContext {
                task: &task,
                report: &rep,
                workspace: git_url.as_ref().map(|_| ws.as_path()),
                git_url: git_url.as_deref(),
                submitted_unix_ms: submitted,
            };
            actions::run(&n, &a, &cx)
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        tracing::info!(task = %id, action = %action_name, outcome = ?outcome, "action ran");
        let (ok, detail) = match outcome {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        end_action(worker, id, attempt, &action_name, ok, &detail).await?;
        if !ok {
            failed.push(format!("{action_name}: {detail}"));
        }
    }
    Ok(failed)
}

async fn end_action(
    worker: &Arc<Worker>,
    id: &str,
    attempt: u32,
    name: &str,
    ok: bool,
    detail: &str,
) -> Result<(), QueueError> {
    retrying(|| {
        worker
            .queue
            .update_claimed(id, &worker.cfg.name, attempt, |t| {
                t.end_action(name, ok, detail);
                Ok(())
            })
    })
    .await
    .map(|_| ())
}
