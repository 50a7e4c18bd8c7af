//! The agent's trace (`trace.jsonl` in the task directory): every model request and response,
//! every tool call with its observation, every verification run, one JSON object per line.
//! The sandbox's own trace (`STATE/traces/ID.jsonl`, by `taskbox_core::trace`) records the same
//! operations from the runtime's side; this one records what the model saw and said.
//!
//! Records (`type`): `task` (contract, model, system prompt, sandbox), `model_request` (the
//! messages added since the previous request, and the total), `model_response`, `model_error`,
//! `tool` (the call and the observation as rendered for the model), `approval` (how an `ask` of
//! the command policy was answered), `verify`, `turn_end`, `resume`, `end`. Each line is written with one `write` and flushed; it is not synced to
//! disk (the state file is what resume relies on). Secrets are masked as in the sandbox's
//! trace; the state file keeps the conversation as the model saw it (resume needs it), so it
//! is written beside the trace with the same care.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::{Message, ModelResponse, ToolCall};
use crate::state::ApprovalNote;

/// One verification command's run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyRun {
    pub command: String,
    pub exit_code: Option<i32>,
    pub passed: bool,
    pub duration_ms: u64,
    /// The last lines of stdout and stderr.
    pub output_tail: String,
    /// What its tools reported as failing (the exec's findings), read from its whole output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<taskbox_core::result::Finding>,
    /// Its test runners' counts, when they gave them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests: Option<taskbox_core::result::TestCounts>,
}

/// One line of the trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    Task {
        version: u32,
        task_id: String,
        model: String,
        workspace: String,
        policy: String,
        /// The sandbox's image and backend when the task named them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        backend: Option<String>,
        sandbox: String,
        contract: Value,
        system_prompt: String,
        at_ms: u64,
    },
    ModelRequest {
        turn: u32,
        messages_total: usize,
        new_messages: Vec<Message>,
    },
    ModelResponse {
        turn: u32,
        response: ModelResponse,
    },
    ModelError {
        turn: u32,
        error: String,
    },
    Tool {
        turn: u32,
        call: ToolCall,
        ok: bool,
        observation: String,
        duration_ms: u64,
    },
    Verify {
        turn: u32,
        passed: bool,
        runs: Vec<VerifyRun>,
    },
    TurnEnd {
        turn: u32,
        checkpoint: Option<String>,
    },
    /// How an approval the command policy asked for during a tool call was answered: by the
    /// agent's approver or by a person through the API. A replay answers the same way.
    Approval {
        #[serde(flatten)]
        note: ApprovalNote,
        rule: Option<String>,
    },
    Resume {
        from_turn: u32,
        sandbox: String,
        restored_by: String,
    },
    End {
        termination: String,
        detail: String,
    },
}

/// An open trace.
#[derive(Debug)]
pub struct Trajectory {
    file: File,
    path: PathBuf,
}

impl Trajectory {
    /// Opens (or creates) the trace for appending.
    pub fn open(path: &Path) -> std::io::Result<Trajectory> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Trajectory {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record, with secrets masked as in the sandbox's trace
    /// ([`taskbox_core::trace::redact`]: token shapes, `Bearer` credentials, secret-named
    /// variables).
    pub fn record(&mut self, r: &Record) -> std::io::Result<()> {
        let mut value = serde_json::to_value(r).map_err(std::io::Error::other)?;
        taskbox_core::trace::redact(&mut value);
        let mut line = serde_json::to_vec(&value).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.flush()
    }
}

/// Reads a trace; a torn last line (a crash mid-write) is skipped.
pub fn read(path: &Path) -> Result<Vec<Record>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Record>(line) {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => {
                return Err(format!(
                    "{}:{}: not an agent trace record: {e}",
                    path.display(),
                    i + 1
                ));
            }
        }
    }
    if !matches!(out.first(), Some(Record::Task { .. })) {
        return Err(format!(
            "{}: not an agent trace (it does not start with a task record)",
            path.display()
        ));
    }
    Ok(out)
}
