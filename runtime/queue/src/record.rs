//! What the key-value store holds about a task, and the changes a worker may make to it.
//!
//! Every change here is a pure function of a record (and the time), applied by compare-and-set
//! ([`crate::Queue::update`]): two workers can race for a task, but only one change lands on a
//! given revision, and the loser sees the winner's record when it tries again. A worker's
//! changes to a running task are fenced by its claim (the worker's name and the attempt's
//! number): a worker that lost its claim (it went silent, another took the task over) can no
//! longer change the task, checkpoint it, run its actions or finish it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::QueueError;

/// Attempts of a task before it is dead, unless its spec says otherwise.
pub const DEFAULT_ATTEMPTS: u32 = 3;

/// Where a task's workspace comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkspaceSource {
    /// A git repository at one commit.
    Git { url: String, commit: String },
    /// A tar in the object store [`crate::ARTIFACTS`], by name.
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
    /// The longest the task may run, from its first start over all its attempts: past it, the
    /// worker stops it and the task fails saying so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration_ms: Option<u64>,
    /// A task that must end before this one starts (a recurring task whose overlap rule is
    /// `queue`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// The schedule that made it, and the start of its window (unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<(String, u64)>,
}

fn default_attempts() -> u32 {
    DEFAULT_ATTEMPTS
}

impl TaskSpec {
    /// A spec with the defaults: the contract's text and a workspace.
    pub fn new(contract: impl Into<String>, workspace: WorkspaceSource) -> TaskSpec {
        TaskSpec {
            contract: contract.into(),
            workspace,
            tenant: None,
            max_attempts: DEFAULT_ATTEMPTS,
            max_duration_ms: None,
            after: None,
            schedule: None,
        }
    }

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
        if self.max_duration_ms == Some(0) {
            return invalid("max_duration must be greater than zero");
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

/// The worker that runs a task now: its fence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub worker: String,
    /// The attempt's number (1 for the first).
    pub attempt: u32,
    pub since_unix_ms: u64,
    /// The worker's last sign of life; older than the claim timeout, another worker takes
    /// the task over.
    pub heartbeat_unix_ms: u64,
}

/// The last completed turn whose state is in the object store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The attempt that wrote it (its objects are under `tasks/ID/aN/`).
    pub attempt: u32,
    pub turn: u32,
}

/// Where one of a contract's actions is. It runs at most once per task: `running` is written
/// (by compare-and-set, under the claim) before it starts, so no other attempt starts it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionState {
    Running,
    Done,
    Failed,
    /// Its worker died while it ran: whether it took effect is not known, and it is not run
    /// again.
    Unknown,
}

/// One action's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRecord {
    pub name: String,
    pub kind: String,
    pub state: ActionState,
    /// The attempt that started it.
    pub attempt: u32,
    /// What it did, or why it failed.
    #[serde(default)]
    pub detail: String,
}

/// How a task's agent run ended (the report's figures; the report itself, the diff and the
/// trace are objects under `tasks/ID/aN/`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskResult {
    /// The attempt whose objects hold the report.
    pub attempt: u32,
    pub worker: String,
    /// The agent's termination (`completed`, `verification_failed`, `max_turns`, ...).
    pub termination: String,
    pub detail: String,
    pub turns: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
    pub wall_ms: u64,
    #[serde(default)]
    pub files_changed: Vec<String>,
}

/// A task as the key-value store holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub spec: TaskSpec,
    pub state: TaskState,
    /// Attempts started (a worker that died counts).
    pub attempts: u32,
    /// What happened to it, oldest first (a failed attempt's cause, a cancel).
    #[serde(default)]
    pub reasons: Vec<String>,
    pub submitted_unix_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<ActionRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<TaskResult>,
    /// When its first attempt started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_unix_ms: Option<u64>,
}

/// What a worker does with a task's message.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimDecision {
    /// Run it as this attempt (the record, claimed; a takeover when `resumes`).
    Run { attempt: u32, takeover: bool },
    /// Not now: another worker's claim is alive, or the task it waits for has not ended.
    /// Ask again after the delay.
    Wait { delay: Duration, why: String },
    /// Nothing to do: it has ended (the message is dropped).
    Ended,
    /// Out of attempts: it is dead now.
    Dead,
}

impl TaskRecord {
    /// Decides what worker `worker` does with this task's message at `now`, and makes the
    /// change (claim, or dead) on `self`. `after` is the state of the task it waits for, if
    /// any.
    pub fn claim(
        &mut self,
        worker: &str,
        now_ms: u64,
        claim_timeout: Duration,
        after: Option<TaskState>,
    ) -> ClaimDecision {
        let timeout_ms = claim_timeout.as_millis() as u64;
        match self.state {
            s if s.is_final() => return ClaimDecision::Ended,
            TaskState::Running => {
                let beat = self
                    .claim
                    .as_ref()
                    .map(|c| c.heartbeat_unix_ms)
                    .unwrap_or(0);
                let silent = now_ms.saturating_sub(beat);
                if silent < timeout_ms {
                    return ClaimDecision::Wait {
                        delay: Duration::from_millis(timeout_ms - silent).max(claim_timeout / 4),
                        why: format!(
                            "worker {} runs it",
                            self.claim
                                .as_ref()
                                .map(|c| c.worker.as_str())
                                .unwrap_or("?")
                        ),
                    };
                }
            }
            _ => {}
        }
        if let (Some(after_id), Some(state)) = (&self.spec.after, after)
            && !state.is_final()
        {
            return ClaimDecision::Wait {
                delay: (claim_timeout / 4).max(Duration::from_millis(200)),
                why: format!("it runs after task {after_id}, which is {state}"),
            };
        }
        let takeover = self.state == TaskState::Running;
        if let Some(c) = self.claim.take() {
            self.reasons.push(format!(
                "attempt {} on worker {} went silent (no heartbeat for {} ms); taken over by {worker}",
                c.attempt,
                c.worker,
                now_ms.saturating_sub(c.heartbeat_unix_ms)
            ));
            // An action its worker had begun: it may or may not have taken effect.
            for a in self.actions.iter_mut() {
                if a.state == ActionState::Running {
                    a.state = ActionState::Unknown;
                    a.detail = format!(
                        "worker {} stopped while it ran; not run again (an action runs at most once)",
                        c.worker
                    );
                }
            }
        }
        if self.attempts >= self.spec.max_attempts {
            self.state = TaskState::Dead;
            self.ended_unix_ms = Some(now_ms);
            self.reasons.push(format!(
                "dead: out of attempts ({} of {})",
                self.attempts, self.spec.max_attempts
            ));
            return ClaimDecision::Dead;
        }
        self.attempts += 1;
        self.state = TaskState::Running;
        self.started_unix_ms.get_or_insert(now_ms);
        self.claim = Some(Claim {
            worker: worker.to_string(),
            attempt: self.attempts,
            since_unix_ms: now_ms,
            heartbeat_unix_ms: now_ms,
        });
        ClaimDecision::Run {
            attempt: self.attempts,
            takeover,
        }
    }

    /// Refuses a change by a worker that no longer holds this task (or never did).
    pub fn fence(&self, worker: &str, attempt: u32) -> Result<(), QueueError> {
        match &self.claim {
            Some(c) if c.worker == worker && c.attempt == attempt => Ok(()),
            // A cancelled task keeps its claim until its worker sees the cancel and finishes.
            _ => Err(QueueError::ClaimLost {
                id: self.id.clone(),
                attempt,
                now: match &self.claim {
                    Some(c) => format!("attempt {} on worker {}", c.attempt, c.worker),
                    None => format!("no one ({})", self.state),
                },
            }),
        }
    }

    /// A failed attempt: back in the queue for another, or dead when it was the last (or
    /// `permanent`: retrying cannot help, such as a contract that does not parse: failed).
    /// Returns the new state.
    pub fn fail_attempt(&mut self, reason: &str, permanent: bool, now_ms: u64) -> TaskState {
        self.claim = None;
        self.reasons
            .push(format!("attempt {} failed: {reason}", self.attempts));
        if self.state == TaskState::Cancelled {
            return self.state;
        }
        self.state = if permanent {
            TaskState::Failed
        } else if self.attempts >= self.spec.max_attempts {
            self.reasons.push(format!(
                "dead: out of attempts ({} of {})",
                self.attempts, self.spec.max_attempts
            ));
            TaskState::Dead
        } else {
            TaskState::Queued
        };
        if self.state.is_final() {
            self.ended_unix_ms = Some(now_ms);
        }
        self.state
    }

    /// The task ended with `result`: completed, or failed (a cancelled task stays cancelled).
    pub fn finish(
        &mut self,
        result: TaskResult,
        completed: bool,
        why: Option<String>,
        now_ms: u64,
    ) {
        self.claim = None;
        if self.state != TaskState::Cancelled {
            self.state = if completed {
                TaskState::Completed
            } else {
                TaskState::Failed
            };
        }
        if let Some(why) = why {
            self.reasons.push(why);
        }
        self.result = Some(result);
        self.ended_unix_ms = Some(now_ms);
    }

    /// Marks action `name` as begun by `attempt`, if it may begin: `Ok(None)` when it may run
    /// now, `Ok(Some(record))` when it already ran or began (it is not run again).
    pub fn begin_action(
        &mut self,
        name: &str,
        kind: &str,
        attempt: u32,
    ) -> Result<Option<ActionRecord>, QueueError> {
        if let Some(a) = self.actions.iter().find(|a| a.name == name) {
            return Ok(Some(a.clone()));
        }
        self.actions.push(ActionRecord {
            name: name.to_string(),
            kind: kind.to_string(),
            state: ActionState::Running,
            attempt,
            detail: String::new(),
        });
        Ok(None)
    }

    /// Records how action `name` ended.
    pub fn end_action(&mut self, name: &str, done: bool, detail: &str) {
        if let Some(a) = self.actions.iter_mut().find(|a| a.name == name) {
            a.state = if done {
                ActionState::Done
            } else {
                ActionState::Failed
            };
            a.detail = detail.to_string();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn record() -> TaskRecord {
        TaskRecord {
            id: "task-1".into(),
            idempotency_key: None,
            spec: TaskSpec::new(
                "goal = \"x\"\n",
                WorkspaceSource::Object {
                    name: "ws.tar".into(),
                },
            ),
            state: TaskState::Queued,
            attempts: 0,
            reasons: vec![],
            submitted_unix_ms: 1,
            claim: None,
            checkpoint: None,
            actions: vec![],
            result: None,
            started_unix_ms: None,
            ended_unix_ms: None,
        }
    }

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn a_live_claim_is_waited_for_and_a_silent_one_taken_over() {
        let mut r = record();
        assert_eq!(
            r.claim("w1", 1_000, T, None),
            ClaimDecision::Run {
                attempt: 1,
                takeover: false
            }
        );
        assert!(r.fence("w1", 1).is_ok());
        assert!(r.fence("w2", 1).is_err());
        assert!(r.fence("w1", 2).is_err());
        // Another worker, 5 s later: the claim is alive.
        let before = r.clone();
        match r.claim("w2", 6_000, T, None) {
            ClaimDecision::Wait { delay, why } => {
                assert_eq!(delay, Duration::from_secs(5));
                assert!(why.contains("w1"), "{why}");
            }
            d => panic!("{d:?}"),
        }
        assert_eq!(r, before, "waiting changes nothing");
        // 11 s after its last heartbeat: taken over, with the reason, and an action w1 had
        // begun is unknown now (never run again).
        r.begin_action("push", "git_push", 1).unwrap();
        assert_eq!(
            r.claim("w2", 12_000, T, None),
            ClaimDecision::Run {
                attempt: 2,
                takeover: true
            }
        );
        assert!(r.fence("w1", 1).is_err());
        assert!(r.fence("w2", 2).is_ok());
        assert!(r.reasons[0].contains("went silent"), "{:?}", r.reasons);
        assert_eq!(r.actions[0].state, ActionState::Unknown);
        assert_eq!(
            r.begin_action("push", "git_push", 2)
                .unwrap()
                .unwrap()
                .state,
            ActionState::Unknown
        );
        assert_eq!(r.started_unix_ms, Some(1_000));
    }

    #[test]
    fn attempts_run_out_into_dead_and_ended_tasks_are_dropped() {
        let mut r = record();
        r.spec.max_attempts = 2;
        assert!(matches!(
            r.claim("w", 0, T, None),
            ClaimDecision::Run { .. }
        ));
        assert_eq!(
            r.fail_attempt("git clone failed", false, 5),
            TaskState::Queued
        );
        assert!(r.claim.is_none());
        assert!(matches!(
            r.claim("w", 10, T, None),
            ClaimDecision::Run { .. }
        ));
        assert_eq!(
            r.fail_attempt("git clone failed", false, 15),
            TaskState::Dead
        );
        assert_eq!(r.ended_unix_ms, Some(15));
        assert!(r.reasons.iter().any(|x| x.contains("out of attempts")));
        assert_eq!(r.claim("w", 20, T, None), ClaimDecision::Ended);
        // A permanent failure ends it at once.
        let mut r = record();
        r.claim("w", 0, T, None);
        assert_eq!(r.fail_attempt("bad contract", true, 1), TaskState::Failed);
        // A silent worker on the last attempt: dead, not run again.
        let mut r = record();
        r.spec.max_attempts = 1;
        r.claim("w1", 0, T, None);
        assert_eq!(r.claim("w2", 20_000, T, None), ClaimDecision::Dead);
        assert_eq!(r.state, TaskState::Dead);
    }

    #[test]
    fn a_task_after_another_waits_for_it_to_end() {
        let mut r = record();
        r.spec.after = Some("task-0".into());
        assert!(matches!(
            r.claim("w", 0, T, Some(TaskState::Running)),
            ClaimDecision::Wait { .. }
        ));
        assert_eq!(r.state, TaskState::Queued);
        assert!(matches!(
            r.claim("w", 0, T, Some(TaskState::Completed)),
            ClaimDecision::Run { .. }
        ));
    }

    #[test]
    fn a_cancelled_task_stays_cancelled_when_its_worker_finishes() {
        let mut r = record();
        r.claim("w", 0, T, None);
        r.state = TaskState::Cancelled;
        let result = TaskResult {
            attempt: 1,
            worker: "w".into(),
            termination: "cancelled".into(),
            detail: String::new(),
            turns: 1,
            tokens_in: 0,
            tokens_out: 0,
            cost_usd: 0.0,
            wall_ms: 1,
            files_changed: vec![],
        };
        r.finish(result, false, None, 9);
        assert_eq!(r.state, TaskState::Cancelled);
        assert!(r.result.is_some());
    }
}
