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
    /// With `--attempts N`: every attempt, and which was kept (this report is the kept one's,
    /// or the first's when none passed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Attempts>,
    /// What the sub-agents the model started (`subtask`) did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subtasks: Vec<SubtaskSummary>,
}

/// The attempts of a task run N times in parallel forks of one prepared sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attempts {
    pub n: u32,
    /// How many passed the verification gate.
    pub passed: u32,
    /// Whether one did (pass@N).
    pub pass_at_n: bool,
    /// The rule that chose the kept attempt (`first`, `fewest-turns`, `smallest-diff`,
    /// `cheapest`).
    pub keep: String,
    /// The kept attempt (1-based), if one passed.
    pub kept: Option<u32>,
    pub list: Vec<AttemptSummary>,
}

/// One attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptSummary {
    pub attempt: u32,
    pub sandbox: String,
    pub termination: Termination,
    pub detail: String,
    pub turns: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
    /// Lines added and removed by its change.
    pub diff_lines: u64,
    pub task_dir: String,
}

/// One sub-agent's work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubtaskSummary {
    pub goal: String,
    pub scope: Vec<String>,
    /// How its task ended (none when it could not run).
    pub termination: Option<Termination>,
    /// Its verified change was merged into the parent's workspace.
    pub applied: bool,
    /// The files its change touched.
    pub files: Vec<String>,
    /// Why it was not merged: the files and hunks that clash with the parent's change.
    pub conflicts: Vec<String>,
    pub turns: u32,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
    pub task_dir: String,
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
        if let Some(a) = &self.attempts {
            let _ = writeln!(
                s,
                "\n## Attempts\n\npass@{}: {} ({} of {} passed); kept by `{}`: {}\n",
                a.n,
                if a.pass_at_n { "yes" } else { "no" },
                a.passed,
                a.n,
                a.keep,
                a.kept
                    .map(|k| format!("attempt {k}"))
                    .unwrap_or_else(|| "none".into())
            );
            let _ = writeln!(
                s,
                "| attempt | termination | turns | tokens in | tokens out | cost (USD) | diff lines |\n|---|---|---|---|---|---|---|"
            );
            for t in &a.list {
                let _ = writeln!(
                    s,
                    "| {}{} | {} | {} | {} | {} | {:.4} | {} |",
                    t.attempt,
                    if a.kept == Some(t.attempt) {
                        " (kept)"
                    } else {
                        ""
                    },
                    t.termination,
                    t.turns,
                    t.tokens_in,
                    t.tokens_out,
                    t.cost_usd,
                    t.diff_lines
                );
            }
        }
        if !self.subtasks.is_empty() {
            let _ = writeln!(s, "\n## Subtasks\n");
            for t in &self.subtasks {
                let how = match (&t.termination, t.applied) {
                    (_, true) => format!("merged ({})", t.files.join(", ")),
                    (Some(Termination::Completed), false) => {
                        format!("verified, not merged: {}", t.conflicts.join("; "))
                    }
                    (Some(term), false) => format!("ended as `{term}`, not merged"),
                    (None, false) => "could not run".to_owned(),
                };
                let _ = writeln!(
                    s,
                    "- {} (scope {}): {how}; {} turns, {} + {} tokens",
                    t.goal,
                    t.scope.join(", "),
                    t.turns,
                    t.tokens_in,
                    t.tokens_out
                );
            }
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
