//! The handoff report, in JSON (`report.json`) and Markdown (`report.md`).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use taskbox_core::api::ApprovalState;

use crate::state::{ApprovalNote, Metrics, Termination};
use crate::trajectory::VerifyRun;

/// What a task left behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub task_id: String,
    /// "success" (termination `completed`) or "failure".
    pub outcome: String,
    pub termination: Termination,
    /// Why it ended, in words.
    pub detail: String,
    pub goal: String,
    /// What the contract asked to be delivered.
    #[serde(default)]
    pub deliverables: Vec<String>,
    /// The model's summary (from `finish`), if it gave one.
    pub summary: Option<String>,
    pub model: String,
    pub sandbox: String,
    pub workspace: String,
    /// The workspace change as a unified diff.
    pub diff: String,
    pub files_changed: Vec<String>,
    /// The last run of the verification gate.
    pub verification: Vec<VerifyRun>,
    /// How each approval the command policy asked for ended.
    #[serde(default)]
    pub approvals: Vec<ApprovalNote>,
    pub metrics: Metrics,
    pub trace: String,
    pub state: String,
}

impl Report {
    pub fn succeeded(&self) -> bool {
        self.termination == Termination::Completed
    }

    /// The report as Markdown for a person.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.metrics;
        let _ = writeln!(s, "# Agent report: {}\n", self.task_id);
        let _ = writeln!(
            s,
            "- **Outcome**: {} (`{}`)",
            self.outcome, self.termination
        );
        let _ = writeln!(s, "- **Why**: {}", self.detail);
        let _ = writeln!(s, "- **Goal**: {}", self.goal);
        if !self.deliverables.is_empty() {
            let _ = writeln!(s, "- **Deliverables**: {}", self.deliverables.join("; "));
        }
        let _ = writeln!(s, "- **Model**: {}", self.model);
        let _ = writeln!(
            s,
            "- **Sandbox**: {} (workspace {})",
            self.sandbox, self.workspace
        );
        let _ = writeln!(
            s,
            "\n## Summary\n\n{}",
            self.summary.as_deref().unwrap_or("(none given)")
        );
        if !self.approvals.is_empty() {
            let _ = writeln!(s, "\n## Approvals\n");
            for a in &self.approvals {
                let how = match (&a.state, &a.denial_reason) {
                    (ApprovalState::Approved, _) => "approved".to_owned(),
                    (ApprovalState::Denied, Some(reason)) => format!("denied: {reason}"),
                    (ApprovalState::Denied, None) => "denied".to_owned(),
                    (ApprovalState::Expired, _) => "no one answered in time (denied)".to_owned(),
                    (ApprovalState::Pending, _) => "pending".to_owned(),
                };
                let _ = writeln!(s, "- turn {}: `{}`: {how}", a.turn, a.command);
            }
        }
        let _ = writeln!(s, "\n## Verification\n");
        if self.verification.is_empty() {
            let _ = writeln!(s, "No verification command ran.");
        }
        for v in &self.verification {
            let code = v
                .exit_code
                .map(|c| c.to_string())
                .unwrap_or_else(|| "none".into());
            let _ = writeln!(
                s,
                "- `{}`: {} (exit code {code}, {} ms)",
                v.command,
                if v.passed { "passed" } else { "FAILED" },
                v.duration_ms
            );
            if let Some(t) = &v.tests {
                let _ = writeln!(
                    s,
                    "  - tests: {} passed, {} failed, {} errored, {} skipped",
                    t.passed, t.failed, t.errored, t.skipped
                );
            }
            for f in &v.findings {
                let mut line = String::new();
                taskbox_tools::render::finding_line(&mut line, f);
                let _ = write!(s, "  {line}");
            }
            if !v.output_tail.trim().is_empty() {
                let _ = writeln!(s, "\n```text\n{}\n```\n", v.output_tail.trim_end());
            }
        }
        let _ = writeln!(s, "\n## Metrics\n");
        let _ = writeln!(s, "| metric | value |\n|---|---|");
        let first = match m.first_attempt_verification_pass {
            Some(true) => "yes",
            Some(false) => "no",
            None => "not run",
        };
        for (k, v) in [
            ("turns", m.turns.to_string()),
            ("tool calls", m.tool_calls.to_string()),
            ("tokens in", m.tokens_in.to_string()),
            ("tokens out", m.tokens_out.to_string()),
            ("cost (USD)", format!("{:.4}", m.cost_usd)),
            ("wall time", format!("{:.1} s", m.wall_ms as f64 / 1000.0)),
            ("approvals asked", m.approvals_asked.to_string()),
            ("first-attempt verification pass", first.to_string()),
            ("verification runs", m.verification_runs.to_string()),
            ("length continuations", m.continuations.to_string()),
            ("compactions", m.compactions.to_string()),
            ("model retries", m.model_retries.to_string()),
            ("validation errors", m.validation_errors.to_string()),
            ("refusals", m.refusals.to_string()),
            (
                "harness overhead per turn (p50)",
                format!("{} µs", m.overhead_p50_us),
            ),
        ] {
            let _ = writeln!(s, "| {k} | {v} |");
        }
        let _ = writeln!(s, "\n## Files changed\n");
        if self.files_changed.is_empty() {
            let _ = writeln!(s, "None.");
        }
        for f in &self.files_changed {
            let _ = writeln!(s, "- {f}");
        }
        let _ = writeln!(s, "\n## Diff\n\n```diff\n{}```", self.diff);
        let _ = writeln!(
            s,
            "\nTrace: {}\nState: {}\nApply the change to the workspace with `taskbox export --apply {}` \
             while the sandbox lives.",
            self.trace, self.state, self.sandbox
        );
        s
    }
}
