//! Sub-agents: the `subtask` tool. The model hands a sub-goal, with its own scope and budget, to
//! a sub-agent that works in a fork of the sandbox; its verified change comes back and is merged
//! into the parent's workspace, three-way, or its conflicts are reported.
//!
//! The subtasks of one answer start before the answer's other calls run: each in a fork of the
//! sandbox as the turn found it (checkpoint `subtask-TURN` of the parent, `base` of the fork),
//! side by side on threads of their own, each a whole task (`start_in`) under a contract made
//! from the call and the parent's (its verification commands unless the call gives others, its
//! forbidden commands, the time the parent has left). At a subtask's own call the parent waits
//! for it, then merges: *ours* is the parent's change since its checkpoint, *theirs* the
//! sub-agent's since the fork's; where both change the same lines of a file (their hunks
//! overlap or touch in the base) nothing is applied and the model gets the files and hunks;
//! else theirs is applied to the parent as one all-or-nothing patch. The fork is destroyed
//! either way; the sub-agent's task directory (`subtasks/turn-T-K`) keeps its trace and report.

use std::collections::HashMap;

use taskbox_tools::SubtaskArgs;

use super::*;
use crate::report::SubtaskSummary;

/// The most turns a sub-agent is given when the call names none.
const DEFAULT_SUBTASK_TURNS: u32 = 10;

/// The most bytes of the sub-agent's diff shown with a conflict.
const CONFLICT_DIFF_BYTES: usize = 8 * 1024;

/// A sub-agent at work.
pub(super) struct Running {
    args: SubtaskArgs,
    /// The parent's checkpoint the fork was taken at.
    base: String,
    fork: SandboxId,
    task_dir: PathBuf,
    handle: std::thread::JoinHandle<Result<Report, AgentError>>,
}

/// One hunk of a unified diff: where it lies in the base (old) file, and its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hunk {
    pub start: u64,
    pub len: u64,
    pub header: String,
}

/// The hunks of each file of a unified diff (git's form, as `diff` writes it).
pub(super) fn hunks_by_file(diff: &str) -> BTreeMap<String, Vec<Hunk>> {
    let mut out: BTreeMap<String, Vec<Hunk>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in diff.lines() {
        if let Some(rest) = line.strip_prefix("diff --git a/") {
            current = rest.split(" b/").next().map(str::to_owned);
            if let Some(p) = &current {
                out.entry(p.clone()).or_default();
            }
            continue;
        }
        let (Some(path), Some(rest)) = (&current, line.strip_prefix("@@ -")) else {
            continue;
        };
        let old = rest.split_whitespace().next().unwrap_or("");
        let mut parts = old.split(',');
        let start = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        let len = parts
            .next()
            .map_or(Some(1), |n| n.parse().ok())
            .unwrap_or(1);
        let header = match line.find(" @@") {
            Some(end) => line[..end + 3].to_owned(),
            None => line.to_owned(),
        };
        out.entry(path.clone())
            .or_default()
            .push(Hunk { start, len, header });
    }
    out
}

/// Whether two hunks of one base file change the same lines, or lines next to each other (as
/// a three-way merge counts them: an insertion touches the line it follows).
fn clash(a: &Hunk, b: &Hunk) -> bool {
    let span = |h: &Hunk| (h.start, h.start + h.len.max(1));
    let ((a0, a1), (b0, b1)) = (span(a), span(b));
    a0 <= b1 && b0 <= a1
}

/// The files both changes touch in the same lines: for each, the hunks of ours and of theirs
/// that clash. A file one of them adds or deletes whole while the other changes it clashes
/// whole.
pub(super) fn conflicts(ours: &DiffResult, theirs: &DiffResult) -> Vec<(String, String)> {
    let (oh, th) = (hunks_by_file(&ours.diff), hunks_by_file(&theirs.diff));
    let status = |d: &DiffResult, p: &str| d.files.iter().find(|f| f.path == p).map(|f| f.status);
    let mut out = Vec::new();
    for f in &theirs.files {
        let Some(ours_status) = status(ours, &f.path) else {
            continue;
        };
        let whole = [ours_status, f.status]
            .iter()
            .any(|s| *s != ChangeKind::Modified);
        let empty = Vec::new();
        let (o, t) = (
            oh.get(&f.path).unwrap_or(&empty),
            th.get(&f.path).unwrap_or(&empty),
        );
        let mut pairs = Vec::new();
        for a in o {
            for b in t {
                if clash(a, b) {
                    pairs.push(format!("yours {} / its {}", a.header, b.header));
                }
            }
        }
        if (whole || f.binary || o.is_empty() || t.is_empty()) && pairs.is_empty() {
            pairs.push(format!(
                "both change the whole file (yours: {}, its: {})",
                kind_word(ours_status),
                kind_word(f.status)
            ));
        }
        if !pairs.is_empty() {
            out.push((f.path.clone(), pairs.join("; ")));
        }
    }
    out
}

fn kind_word(k: ChangeKind) -> &'static str {
    match k {
        ChangeKind::Added => "added",
        ChangeKind::Modified => "modified",
        ChangeKind::Deleted => "deleted",
    }
}

/// Cuts `s` to at most `max` bytes at a line end, saying how much was left out.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let end = s[..end].rfind('\n').map_or(end, |i| i + 1);
    format!("{}[... {} more bytes]\n", &s[..end], s.len() - end)
}

impl Runner {
    /// Starts the subtasks among `calls` (see the module docs); those that cannot start are left
    /// out, and their calls answer so.
    pub(super) fn start_subtasks(
        &mut self,
        turn: u32,
        calls: &[ToolCall],
    ) -> HashMap<String, Running> {
        let mut out = HashMap::new();
        let Some(models) = self.opts.models.clone() else {
            return out;
        };
        let asked: Vec<(String, SubtaskArgs)> = calls
            .iter()
            .filter(|c| c.name == taskbox_tools::Tool::Subtask.name())
            .filter_map(
                |c| match tools::validate_among(&self.offered, &c.name, &c.arguments) {
                    Ok(Action::Subtask(a)) => Some((c.id.clone(), a)),
                    _ => None,
                },
            )
            // A sub-agent works within the parent's scope.
            .filter(|(_, a)| a.scope.iter().all(|p| self.scope.allows(p)))
            .collect();
        if asked.is_empty() {
            return out;
        }
        let base = format!("subtask-{turn}");
        let forked = self
            .api
            .checkpoint(&self.id, CheckpointRequest { name: base.clone() })
            .and_then(|_| {
                self.api.fork(
                    &self.id,
                    ForkRequest {
                        count: Some(asked.len() as u32),
                        checkpoint: Some(base.clone()),
                        ..ForkRequest::default()
                    },
                )
            });
        let forks = match forked {
            Ok(f) => f.sandboxes,
            Err(e) => {
                tracing::warn!(task = %self.st.task_id, error = %e, "cannot fork for subtasks");
                return out;
            }
        };
        let left = self.deadline.saturating_duration_since(Instant::now());
        for (k, ((call_id, args), info)) in asked.into_iter().zip(forks).enumerate() {
            let fork = info.id.clone();
            let ready = self
                .api
                .checkpoint(
                    &fork,
                    CheckpointRequest {
                        name: "base".into(),
                    },
                )
                .map_err(|e| e.to_string())
                .and_then(|_| models().map_err(|e| e.to_string()));
            let model = match ready {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(task = %self.st.task_id, error = %e, "a subtask cannot start");
                    let _ = self.api.destroy(&fork);
                    continue;
                }
            };
            let mut c = Contract::with_goal(args.goal.clone());
            c.scope = args.scope.clone();
            c.verify = args
                .verify
                .clone()
                .unwrap_or_else(|| self.st.contract.verify.clone());
            c.forbidden = self.st.contract.forbidden.clone();
            c.model = self.st.contract.model.clone();
            c.budget = self.st.contract.budget.clone();
            c.budget.max_turns = args.max_turns.unwrap_or(DEFAULT_SUBTASK_TURNS);
            c.budget.time = left;
            let spec = TaskSpec {
                contract: c,
                workspace: self.st.workspace.clone(),
                policy: Some(self.st.policy.clone()),
                image: self.st.image.clone(),
                backend: self.st.backend.clone(),
            };
            let task_dir = self
                .opts
                .task_dir
                .join("subtasks")
                .join(format!("turn-{turn}-{}", k + 1));
            let opts = Options {
                task_dir: task_dir.clone(),
                approver: self.opts.approver.clone(),
                plan_reviewer: None,
                cancel: self.opts.cancel.clone(),
                interrupt: self.opts.interrupt.clone(),
                on_turn: None,
                // Sub-agents do not delegate again.
                models: None,
                note: Some("you are a sub-agent of another agent: do only this sub-goal".into()),
            };
            let api = self.api.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("subtask-{turn}-{}", k + 1))
                .spawn(move || start_in(api, model, spec, opts, info));
            match spawned {
                Ok(handle) => {
                    out.insert(
                        call_id,
                        Running {
                            args,
                            base: base.clone(),
                            fork,
                            task_dir,
                            handle,
                        },
                    );
                }
                Err(e) => {
                    tracing::warn!(task = %self.st.task_id, error = %e, "a subtask cannot start");
                    let _ = self.api.destroy(&fork);
                }
            }
        }
        out
    }

    /// Waits for a subtask and merges its verified change (see the module docs): whether it was
    /// applied, and what the model reads.
    pub(super) fn merge_subtask(&mut self, running: Running) -> (bool, String) {
        let t = Instant::now();
        let Running {
            args,
            base,
            fork,
            task_dir,
            handle,
        } = running;
        let joined = handle
            .join()
            .unwrap_or_else(|_| Err(AgentError::State("the sub-agent panicked".into())));
        self.external += t.elapsed();
        let mut summary = SubtaskSummary {
            goal: args.goal.clone(),
            scope: args.scope.clone(),
            termination: None,
            applied: false,
            files: Vec::new(),
            conflicts: Vec::new(),
            turns: 0,
            tokens_in: 0,
            tokens_out: 0,
            cost_usd: 0.0,
            task_dir: task_dir.display().to_string(),
        };
        let result = self.merge_report(&args, &base, &fork, joined, &mut summary);
        let _ = self.api.destroy(&fork);
        self.subtasks.push(summary);
        result
    }

    fn merge_report(
        &mut self,
        args: &SubtaskArgs,
        base: &str,
        fork: &SandboxId,
        joined: Result<Report, AgentError>,
        summary: &mut SubtaskSummary,
    ) -> (bool, String) {
        let report = match joined {
            Ok(r) => r,
            Err(e) => return (false, format!("the subtask could not run: {e}")),
        };
        // What the sub-agent used counts against the task's budget.
        let m = &report.metrics;
        self.st.metrics.tokens_in += m.tokens_in;
        self.st.metrics.tokens_out += m.tokens_out;
        self.st.metrics.cost_usd += m.cost_usd;
        summary.termination = Some(report.termination);
        summary.turns = m.turns;
        summary.tokens_in = m.tokens_in;
        summary.tokens_out = m.tokens_out;
        summary.cost_usd = m.cost_usd;
        if report.termination == Termination::Infrastructure {
            self.sandbox_failed(&ApiError::Infrastructure(report.detail.clone()));
        }
        if !report.succeeded() {
            let checks: Vec<String> = report
                .verification
                .iter()
                .map(|v| {
                    format!(
                        "`{}`: {}",
                        v.command,
                        if v.passed { "passed" } else { "failed" }
                    )
                })
                .collect();
            return (
                false,
                format!(
                    "the subtask \"{}\" ended as `{}` ({}); nothing of its change was applied.{}",
                    args.goal,
                    report.termination,
                    report.detail,
                    if checks.is_empty() {
                        String::new()
                    } else {
                        format!(" Its last verification: {}.", checks.join(", "))
                    }
                ),
            );
        }
        let theirs = self.api.diff(
            fork,
            DiffRequest {
                since: Some("base".into()),
                ..DiffRequest::default()
            },
        );
        let ours = self.api.diff(
            &self.id,
            DiffRequest {
                since: Some(base.to_owned()),
                ..DiffRequest::default()
            },
        );
        let (theirs, ours) = match (theirs, ours) {
            (Ok(t), Ok(o)) => (t, o),
            (Err(e), _) | (_, Err(e)) => {
                self.sandbox_failed(&e);
                return (false, format!("the subtask's change cannot be merged: {e}"));
            }
        };
        summary.files = theirs.files.iter().map(|f| f.path.clone()).collect();
        if theirs.files.is_empty() {
            return (
                true,
                format!(
                    "the subtask \"{}\" completed (verified) without changing any file",
                    args.goal
                ),
            );
        }
        let clashes = conflicts(&ours, &theirs);
        if !clashes.is_empty() {
            summary.conflicts = clashes.iter().map(|(p, h)| format!("{p}: {h}")).collect();
            let listed: Vec<String> = clashes.iter().map(|(p, h)| format!("- {p}: {h}")).collect();
            return (
                false,
                format!(
                    "conflict: the subtask \"{}\" completed (verified), but its change and yours \
                     (made since it started) change the same lines, so nothing of it was \
                     applied; your workspace is as you left it. Three-way, against the \
                     workspace as this turn found it:\n{}\nIts change, to take what you want of \
                     it by hand:\n{}",
                    args.goal,
                    listed.join("\n"),
                    cut(&theirs.diff, CONFLICT_DIFF_BYTES)
                ),
            );
        }
        match self.api.patch(
            &self.id,
            PatchRequest {
                patch: theirs.diff.clone(),
            },
        ) {
            Ok(r) => {
                summary.applied = true;
                let turn = self.st.turn + 1;
                for c in &r.files {
                    self.touched(&c.path, turn, "merged from a subtask");
                }
                (
                    true,
                    format!(
                        "the subtask \"{}\" completed (verified) in {} turn(s); its change is merged \
                         into your workspace: {}",
                        args.goal,
                        report.metrics.turns,
                        summary.files.join(", ")
                    ),
                )
            }
            Err(e) => {
                summary.conflicts = vec![e.to_string()];
                (
                    false,
                    format!(
                        "conflict: the subtask \"{}\" completed (verified), but its change does not \
                         apply to your workspace ({e}); nothing of it was applied. Its change:\n{}",
                        args.goal,
                        cut(&theirs.diff, CONFLICT_DIFF_BYTES)
                    ),
                )
            }
        }
    }

    /// A subtask whose call was not reached: cancelled, waited for, its fork destroyed.
    pub(super) fn abandon_subtask(&mut self, running: Running) {
        // The sub-agent shares the task's cancel flag; it ends within its step.
        let _ = running.handle.join();
        let _ = self.api.destroy(&running.fork);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const DIFF: &str = "diff --git a/src/a.sh b/src/a.sh\n--- a/src/a.sh\n+++ b/src/a.sh\n\
        @@ -1,3 +1,3 @@\n x\n-y\n+Y\n z\n@@ -20 +20,2 @@\n-q\n+q\n+r\n\
        diff --git a/b.txt b/b.txt\n--- a/b.txt\n+++ b/b.txt\n@@ -5,0 +6 @@\n+new\n";

    #[test]
    fn hunks_are_read_with_their_base_lines() {
        let h = hunks_by_file(DIFF);
        assert_eq!(h.len(), 2);
        let a = &h["src/a.sh"];
        assert_eq!((a[0].start, a[0].len), (1, 3));
        assert_eq!(a[0].header, "@@ -1,3 +1,3 @@");
        assert_eq!((a[1].start, a[1].len), (20, 1));
        assert_eq!((h["b.txt"][0].start, h["b.txt"][0].len), (5, 0));
    }

    #[test]
    fn hunks_clash_when_they_overlap_or_touch() {
        let h = |start, len| Hunk {
            start,
            len,
            header: String::new(),
        };
        assert!(clash(&h(1, 3), &h(3, 1)));
        assert!(clash(&h(1, 3), &h(4, 1)), "touching");
        assert!(!clash(&h(1, 3), &h(10, 2)));
        assert!(
            clash(&h(5, 0), &h(5, 1)),
            "an insertion after a changed line"
        );
        assert!(!clash(&h(5, 0), &h(20, 1)));
    }
}
