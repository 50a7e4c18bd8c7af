//! Replay: re-run a task with the model responses its trace recorded instead of a live model,
//! in a fresh sandbox over the same workspace, and compare each tool observation with the
//! recorded one (under the normalisations of [`normalise`]: durations and generated ids).
//!
//! Turns that a resume re-did are taken from the run that completed them: a `resume` record
//! drops what the interrupted run recorded after its last completed turn.
//!
//! Approvals the command policy asked for are answered as the recording says they were
//! ([`RecordedApprovals`]), whoever answered them then: the agent's approver or a person.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use regex::Regex;
use serde::{Deserialize, Serialize};
use taskbox_core::api::{Approval, ApprovalState, SandboxApi};

use crate::agent::{self, AgentError, Approver, Decision, Options, TRACE_FILE, TaskSpec};
use crate::contract::Contract;
use crate::model::{ModelResponse, Recorded};
use crate::trajectory::{self, Record};

/// The first place where the replay saw something else than the original.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Divergence {
    /// 1-based position of the tool call in the task.
    pub index: usize,
    pub tool: String,
    pub expected: String,
    pub actual: String,
}

/// The outcome of a replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// Every observation and the termination matched.
    pub matched: bool,
    /// Tool observations compared.
    pub compared: usize,
    pub original_tool_calls: usize,
    pub replayed_tool_calls: usize,
    pub original_termination: Option<String>,
    pub replay_termination: String,
    pub divergence: Option<Divergence>,
    /// Where the replay's own trace and report are.
    pub task_dir: String,
}

impl ReplayReport {
    /// A few lines for a person.
    pub fn render(&self) -> String {
        let mut s = format!(
            "replay {}: {} of {} tool observations compared; termination {} (original {})\n",
            if self.matched { "MATCHES" } else { "DIVERGES" },
            self.compared,
            self.original_tool_calls,
            self.replay_termination,
            self.original_termination
                .as_deref()
                .unwrap_or("none recorded"),
        );
        if let Some(d) = &self.divergence {
            s.push_str(&format!(
                "first divergence at tool call {} ({}):\n--- recorded\n{}\n+++ replayed\n{}\n",
                d.index, d.tool, d.expected, d.actual
            ));
        }
        s.push_str(&format!("replay trace and report: {}\n", self.task_dir));
        s
    }
}

static MS: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"\b\d+ ms\b").ok());
static IDS: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"\b(sb|ap)-[0-9a-f]{8,}\b|/out/\d+\.").ok());

/// An observation without what legitimately changes between runs: durations and generated ids.
pub fn normalise(text: &str) -> String {
    let mut s = text.to_owned();
    if let Some(re) = MS.as_ref() {
        s = re.replace_all(&s, "N ms").into_owned();
    }
    if let Some(re) = IDS.as_ref() {
        s = re.replace_all(&s, "<id>").into_owned();
    }
    s
}

struct Recording {
    spec: TaskSpec,
    responses: Vec<ModelResponse>,
    tools: Vec<(String, String)>,
    /// How each `ask` was answered, in order.
    approvals: Vec<Answer>,
    termination: Option<String>,
}

/// A recorded answer to an approval.
#[derive(Debug, Clone)]
struct Answer {
    command: String,
    state: ApprovalState,
    denial_reason: Option<String>,
}

/// Answers the replay's approvals as the recorded ones were answered, in order: approved,
/// denied with the recorded reason, or left to expire as it did (the replay then waits the
/// policy's `ask_timeout`). An ask the recording does not have, or for another command, is
/// denied with a reason that says so, and the observation shows the divergence.
struct RecordedApprovals {
    answers: Mutex<VecDeque<Answer>>,
}

impl Approver for RecordedApprovals {
    fn decide(&self, approval: &Approval) -> Decision {
        let next = self
            .answers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop_front();
        let Some(answer) = next else {
            return Decision::Deny("the recording answered no more approvals".into());
        };
        if answer.command != approval.command {
            return Decision::Deny(format!(
                "the recording's next approval was for `{}`, not this command",
                answer.command
            ));
        }
        match answer.state {
            ApprovalState::Approved => Decision::Approve,
            ApprovalState::Denied => Decision::Deny(answer.denial_reason.unwrap_or_default()),
            ApprovalState::Expired | ApprovalState::Pending => Decision::Defer,
        }
    }
}

fn load(trace: &Path) -> Result<Recording, AgentError> {
    let records = trajectory::read(trace).map_err(AgentError::State)?;
    let mut spec = None;
    let mut responses: Vec<(u32, ModelResponse)> = Vec::new();
    let mut tools: Vec<(u32, String, String)> = Vec::new();
    let mut approvals: Vec<(u32, Answer)> = Vec::new();
    let mut termination = None;
    for r in records {
        match r {
            Record::Task {
                contract,
                workspace,
                policy,
                image,
                backend,
                ..
            } => {
                let contract: Contract = serde_json::from_value(contract).map_err(|e| {
                    AgentError::State(format!("the trace's contract cannot be read: {e}"))
                })?;
                spec = Some(TaskSpec {
                    contract,
                    workspace,
                    policy: Some(policy),
                    image,
                    backend,
                });
            }
            Record::ModelResponse { turn, response } => responses.push((turn, response)),
            Record::Tool {
                turn,
                call,
                observation,
                ..
            } => tools.push((turn, call.name, observation)),
            Record::Approval { note, .. } => approvals.push((
                note.turn,
                Answer {
                    command: note.command,
                    state: note.state,
                    denial_reason: note.denial_reason,
                },
            )),
            Record::Resume { from_turn, .. } => {
                responses.retain(|(t, _)| *t <= from_turn);
                tools.retain(|(t, _, _)| *t <= from_turn);
                approvals.retain(|(t, _)| *t <= from_turn);
            }
            Record::End { termination: t, .. } => termination = Some(t),
            _ => {}
        }
    }
    let spec = spec.ok_or_else(|| AgentError::State("the trace has no task record".into()))?;
    Ok(Recording {
        spec,
        responses: responses.into_iter().map(|(_, r)| r).collect(),
        tools: tools.into_iter().map(|(_, n, o)| (n, o)).collect(),
        approvals: approvals.into_iter().map(|(_, a)| a).collect(),
        termination,
    })
}

/// Replays the task recorded in `trace` into `task_dir` (see the module docs). `workspace`
/// overrides the recorded workspace directory.
pub fn replay(
    api: Arc<dyn SandboxApi>,
    trace: &Path,
    task_dir: PathBuf,
    workspace: Option<String>,
) -> Result<ReplayReport, AgentError> {
    let mut rec = load(trace)?;
    if let Some(w) = workspace {
        rec.spec.workspace = w;
    }
    let model = Box::new(Recorded::new(rec.responses));
    let mut opts = Options::new(&task_dir);
    opts.approver = Arc::new(RecordedApprovals {
        answers: Mutex::new(rec.approvals.into()),
    });
    let report = agent::start(api, model, rec.spec, opts)?;
    let replayed = load(&task_dir.join(TRACE_FILE))?;
    let mut divergence = None;
    let mut compared = 0;
    for (i, (expected, actual)) in rec.tools.iter().zip(replayed.tools.iter()).enumerate() {
        compared += 1;
        let (e, a) = (normalise(&expected.1), normalise(&actual.1));
        if expected.0 != actual.0 || e != a {
            divergence = Some(Divergence {
                index: i + 1,
                tool: actual.0.clone(),
                expected: e,
                actual: a,
            });
            break;
        }
    }
    if divergence.is_none() && rec.tools.len() != replayed.tools.len() {
        let i = compared;
        divergence = Some(Divergence {
            index: i + 1,
            tool: rec
                .tools
                .get(i)
                .or(replayed.tools.get(i))
                .map(|t| t.0.clone())
                .unwrap_or_default(),
            expected: rec
                .tools
                .get(i)
                .map(|t| normalise(&t.1))
                .unwrap_or_else(|| "(no more tool calls)".into()),
            actual: replayed
                .tools
                .get(i)
                .map(|t| normalise(&t.1))
                .unwrap_or_else(|| "(no more tool calls)".into()),
        });
    }
    let replay_termination = report.termination.to_string();
    let matched = divergence.is_none()
        && rec
            .termination
            .as_deref()
            .is_none_or(|t| t == replay_termination);
    Ok(ReplayReport {
        matched,
        compared,
        original_tool_calls: rec.tools.len(),
        replayed_tool_calls: replayed.tools.len(),
        original_termination: rec.termination,
        replay_termination,
        divergence,
        task_dir: task_dir.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_removes_durations_and_ids() {
        assert_eq!(
            normalise("exit_code: 0 (812 ms) in sb-0123456789abcdef, see /x/out/7.stdout"),
            "exit_code: 0 (N ms) in <id>, see /x<id>stdout"
        );
    }
}
