//! The externalised task state: everything needed to continue a task after its process died,
//! kept as `state.json` beside the trace and replaced (atomically) after every completed turn.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};
use taskbox_core::api::ApprovalState;

use crate::contract::Contract;
use crate::model::Message;

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

/// Why a task ended. Never only the model's word: `completed` needs the verification gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Termination {
    /// The model finished and the verification gate passed.
    Completed,
    /// The model finished, but the gate failed more often than the contract allows.
    VerificationFailed,
    MaxTurns,
    TimeBudget,
    /// The cost or token budget ran out.
    CostBudget,
    /// The model or the sandbox failed in a way retrying did not fix.
    UnrecoverableError,
    Cancelled,
    /// The sandbox itself failed (lost: its init died, its supervisor restarted, its daemon
    /// went away): not the model's doing, an episode to drop rather than score.
    Infrastructure,
}

impl Termination {
    pub fn as_str(self) -> &'static str {
        match self {
            Termination::Completed => "completed",
            Termination::VerificationFailed => "verification_failed",
            Termination::MaxTurns => "max_turns",
            Termination::TimeBudget => "time_budget",
            Termination::CostBudget => "cost_budget",
            Termination::UnrecoverableError => "unrecoverable_error",
            Termination::Cancelled => "cancelled",
            Termination::Infrastructure => "infrastructure",
        }
    }
}

impl std::fmt::Display for Termination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counters of a task.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Metrics {
    pub turns: u32,
    pub tool_calls: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
    pub wall_ms: u64,
    /// Execs the command policy put to a person.
    pub approvals_asked: u32,
    /// Whether the first run of the verification gate passed (null: it never ran).
    pub first_attempt_verification_pass: Option<bool>,
    pub verification_runs: u32,
    /// Responses cut at the length limit and continued.
    pub continuations: u32,
    pub compactions: u32,
    /// HTTP retries of model calls.
    pub model_retries: u32,
    /// Tool calls whose arguments failed validation.
    pub validation_errors: u32,
    /// Tool calls the harness or the policy refused.
    pub refusals: u32,
    /// Median harness time per turn in microseconds (all but model latency and sandbox calls).
    pub overhead_p50_us: u64,
}

/// A submitted plan.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub steps: Vec<String>,
    pub files: Vec<String>,
    /// Whether it may be followed (a person confirmed it, or no confirmation was asked).
    pub accepted: bool,
}

/// How an `ask` of the command policy ended, for the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalNote {
    pub turn: u32,
    pub command: String,
    pub state: ApprovalState,
    pub denial_reason: Option<String>,
}

/// The task state (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskState {
    pub version: u32,
    pub task_id: String,
    pub contract: Contract,
    pub workspace: String,
    pub policy: String,
    /// The sandbox's image and backend, as the task asked (none: the defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    pub model: String,
    pub system_prompt: String,
    /// The sandbox the task last ran in.
    pub sandbox: String,
    /// Completed turns.
    pub turn: u32,
    /// The conversation as of the last completed turn (older turns possibly compacted).
    pub messages: Vec<Message>,
    pub plan: Option<Plan>,
    /// What has been done, one line per successful change or passing check.
    pub completed_steps: Vec<String>,
    /// What failed and why.
    pub failed_attempts: Vec<String>,
    /// Verification commands that have not passed yet.
    pub pending_verification: Vec<String>,
    pub files_touched: BTreeSet<String>,
    /// Files changed outside the contract's scope (by commands; the harness refuses edits).
    pub out_of_scope: BTreeSet<String>,
    pub verify_attempts: u32,
    pub metrics: Metrics,
    /// The sandbox checkpoint taken after the last completed turn.
    pub checkpoint: Option<String>,
    /// The workspace change (unified diff against the baseline) after the last completed turn:
    /// applied to a fresh sandbox when the old one is gone. Binary files are not in it.
    pub workspace_patch: String,
    /// The binary files of that change, which a text patch cannot carry: path to content
    /// (base64), or None for a deleted one. Written to a fresh sandbox after the patch.
    #[serde(default)]
    pub binary_files: BTreeMap<String, Option<String>>,
    /// How each `ask` of the command policy ended, in order.
    #[serde(default)]
    pub approvals: Vec<ApprovalNote>,
    /// Wall time of earlier runs of this task (before a resume), in ms.
    pub elapsed_before_ms: u64,
    /// Set when the task ended.
    pub termination: Option<Termination>,
}

impl TaskState {
    /// The state of a task that has not started: no turns, nothing done, every verification
    /// command pending; the other fields empty, for the caller to fill.
    pub fn new(task_id: String, contract: Contract) -> TaskState {
        TaskState {
            version: STATE_VERSION,
            task_id,
            pending_verification: contract.verify.clone(),
            contract,
            workspace: String::new(),
            policy: String::new(),
            image: None,
            backend: None,
            model: String::new(),
            system_prompt: String::new(),
            sandbox: String::new(),
            turn: 0,
            messages: Vec::new(),
            plan: None,
            completed_steps: Vec::new(),
            failed_attempts: Vec::new(),
            files_touched: BTreeSet::new(),
            out_of_scope: BTreeSet::new(),
            verify_attempts: 0,
            metrics: Metrics::default(),
            checkpoint: None,
            workspace_patch: String::new(),
            binary_files: BTreeMap::new(),
            approvals: Vec::new(),
            elapsed_before_ms: 0,
            termination: None,
        }
    }

    /// Writes the state to `path` atomically (a temporary file renamed into place), readable by
    /// its owner only: it holds the conversation unmasked.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("json.tmp");
        let data = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&data)?;
        drop(f);
        std::fs::rename(&tmp, path)
    }

    pub fn load(path: &Path) -> Result<TaskState, String> {
        let data =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let s: TaskState = serde_json::from_slice(&data)
            .map_err(|e| format!("{} is not a task state: {e}", path.display()))?;
        if s.version != STATE_VERSION {
            return Err(format!(
                "{}: state version {} is not supported (this taskbox writes {STATE_VERSION})",
                path.display(),
                s.version
            ));
        }
        Ok(s)
    }
}
