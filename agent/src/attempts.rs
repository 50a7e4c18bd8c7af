//! `--attempts N`: one task run N times side by side, each attempt a whole task under the
//! contract in its own fork of one prepared sandbox, the attempt kept that passes the
//! verification gate first (or best, by a named rule).
//!
//! The sandbox is prepared once (created, as for a single task), then forked N ways; attempt K
//! is told which it is ("Attempt K/N") and keeps its trace, state and report in
//! `TASK/attempt-K`. With [`Keep::First`] the first attempt to pass ends the others (they end as
//! `cancelled` at their next step); with another rule every attempt runs to its end and the
//! rule picks among those that passed. The task's report is the kept attempt's (or the first
//! attempt's when none passed), with every attempt listed: pass@N, termination, turns, tokens,
//! cost, the size of its change. The prepared sandbox and the attempts' sandboxes that are not
//! kept are destroyed.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use taskbox_core::api::{ForkRequest, SandboxApi, SandboxInfo};
use taskbox_core::support::lock;

use crate::agent::{AgentError, ModelFactory, Options, REPORT_JSON, REPORT_MD, TaskSpec};
use crate::report::{AttemptSummary, Attempts, Report};
use crate::state::Termination;

/// Which passing attempt is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The first to pass (the others are ended then).
    First,
    /// The one that passed in the fewest turns.
    FewestTurns,
    /// The one whose change has the fewest lines added and removed.
    SmallestDiff,
    /// The one that cost least (dollars, then tokens).
    Cheapest,
}

impl Keep {
    pub fn as_str(self) -> &'static str {
        match self {
            Keep::First => "first",
            Keep::FewestTurns => "fewest-turns",
            Keep::SmallestDiff => "smallest-diff",
            Keep::Cheapest => "cheapest",
        }
    }
}

impl FromStr for Keep {
    type Err = String;
    fn from_str(s: &str) -> Result<Keep, String> {
        Ok(match s {
            "first" => Keep::First,
            "fewest-turns" => Keep::FewestTurns,
            "smallest-diff" => Keep::SmallestDiff,
            "cheapest" => Keep::Cheapest,
            other => {
                return Err(format!(
                    "unknown rule {other:?}: use first, fewest-turns, smallest-diff or cheapest"
                ));
            }
        })
    }
}

/// The most attempts of one task.
pub const MAX_ATTEMPTS: u32 = 16;

/// Lines added and removed by a unified diff.
fn diff_lines(diff: &str) -> u64 {
    diff.lines()
        .filter(|l| {
            (l.starts_with('+') && !l.starts_with("+++"))
                || (l.starts_with('-') && !l.starts_with("---"))
        })
        .count() as u64
}

/// Runs `spec` as `n` attempts (see the module docs), each with a model of its own from
/// `models`, in the task directory of `opts`.
pub fn start_attempts(
    api: Arc<dyn SandboxApi>,
    models: ModelFactory,
    spec: TaskSpec,
    opts: Options,
    n: u32,
    keep: Keep,
) -> Result<Report, AgentError> {
    if !(1..=MAX_ATTEMPTS).contains(&n) {
        return Err(AgentError::State(format!(
            "--attempts {n}: give 1 to {MAX_ATTEMPTS}"
        )));
    }
    let prepared = crate::agent::prepare(&api, &spec, &opts)?;
    let forked = api.fork(
        &prepared.id,
        ForkRequest {
            count: Some(n),
            ..ForkRequest::default()
        },
    );
    // The prepared sandbox has done its part once forked.
    let _ = api.destroy(&prepared.id);
    let forks: Vec<SandboxInfo> = forked?.sandboxes;
    let cancels: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let winner: Arc<Mutex<Option<u32>>> = Arc::default();
    // The operator's cancel reaches every attempt.
    let watcher_done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (outer, cancels, done) = (opts.cancel.clone(), cancels.clone(), watcher_done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                if outer.load(Ordering::SeqCst) {
                    cancels.iter().for_each(|c| c.store(true, Ordering::SeqCst));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        })
    };
    let results: Vec<(u32, PathBuf, Result<Report, AgentError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = forks
            .iter()
            .enumerate()
            .map(|(i, info)| {
                let k = i as u32 + 1;
                let task_dir = opts.task_dir.join(format!("attempt-{k}"));
                let attempt_opts = Options {
                    task_dir: task_dir.clone(),
                    approver: opts.approver.clone(),
                    plan_reviewer: opts.plan_reviewer.clone(),
                    cancel: cancels[i].clone(),
                    interrupt: opts.interrupt.clone(),
                    on_turn: None,
                    models: opts.models.clone(),
                    note: Some(format!(
                        "Attempt {k}/{n}: {n} attempts of this task run side by side, each in a \
                         sandbox of its own; the one that passes verification {} is kept",
                        match keep {
                            Keep::First => "first",
                            _ => "best",
                        }
                    )),
                };
                let (api, models, spec, info) =
                    (api.clone(), models.clone(), spec.clone(), info.clone());
                let (cancels, winner) = (cancels.clone(), winner.clone());
                scope.spawn(move || {
                    let report = models()
                        .map_err(|e| AgentError::State(format!("attempt {k}: the model: {e}")))
                        .and_then(|model| {
                            crate::agent::start_in(api, model, spec, attempt_opts, info)
                        });
                    if keep == Keep::First && report.as_ref().is_ok_and(Report::succeeded) {
                        let mut w = lock(&winner);
                        if w.is_none() {
                            *w = Some(k);
                            for (j, c) in cancels.iter().enumerate() {
                                if j != i {
                                    c.store(true, Ordering::SeqCst);
                                }
                            }
                        }
                    }
                    (k, task_dir, report)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    (
                        0,
                        PathBuf::new(),
                        Err(AgentError::State("an attempt panicked".into())),
                    )
                })
            })
            .collect()
    });
    watcher_done.store(true, Ordering::SeqCst);
    let _ = watcher.join();

    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for (k, dir, r) in results {
        match r {
            Ok(report) => reports.push((k, dir, report)),
            Err(e) => failed.push((k, e)),
        }
    }
    if reports.is_empty() {
        for f in &forks {
            let _ = api.destroy(&f.id);
        }
        let why: Vec<String> = failed
            .iter()
            .map(|(k, e)| format!("attempt {k}: {e}"))
            .collect();
        return Err(AgentError::State(format!(
            "no attempt could run: {}",
            why.join("; ")
        )));
    }
    let passed: Vec<&(u32, PathBuf, Report)> =
        reports.iter().filter(|(_, _, r)| r.succeeded()).collect();
    let kept: Option<u32> = match keep {
        Keep::First => *lock(&winner),
        Keep::FewestTurns => passed
            .iter()
            .min_by_key(|(k, _, r)| (r.metrics.turns, *k))
            .map(|(k, _, _)| *k),
        Keep::SmallestDiff => passed
            .iter()
            .min_by_key(|(k, _, r)| (diff_lines(&r.diff), *k))
            .map(|(k, _, _)| *k),
        Keep::Cheapest => passed
            .iter()
            .min_by(|(ka, _, a), (kb, _, b)| {
                let cost = |r: &Report| {
                    (
                        r.metrics.cost_usd,
                        r.metrics.tokens_in + r.metrics.tokens_out,
                    )
                };
                let (ca, cb) = (cost(a), cost(b));
                ca.0.total_cmp(&cb.0).then(ca.1.cmp(&cb.1)).then(ka.cmp(kb))
            })
            .map(|(k, _, _)| *k),
    };
    let shown = kept.unwrap_or_else(|| reports.iter().map(|(k, _, _)| *k).min().unwrap_or(1));
    let list: Vec<AttemptSummary> = reports
        .iter()
        .map(|(k, dir, r)| AttemptSummary {
            attempt: *k,
            sandbox: r.sandbox.clone(),
            termination: r.termination,
            detail: r.detail.clone(),
            turns: r.metrics.turns,
            tokens_in: r.metrics.tokens_in,
            tokens_out: r.metrics.tokens_out,
            cost_usd: r.metrics.cost_usd,
            diff_lines: diff_lines(&r.diff),
            task_dir: dir.display().to_string(),
        })
        .chain(failed.iter().map(|(k, e)| AttemptSummary {
            attempt: *k,
            sandbox: String::new(),
            termination: Termination::UnrecoverableError,
            detail: e.to_string(),
            turns: 0,
            tokens_in: 0,
            tokens_out: 0,
            cost_usd: 0.0,
            diff_lines: 0,
            task_dir: String::new(),
        }))
        .collect();
    let mut report = reports
        .iter()
        .find(|(k, _, _)| *k == shown)
        .map(|(_, _, r)| r.clone())
        .ok_or_else(|| AgentError::State("the kept attempt has no report".into()))?;
    // The sandboxes of the attempts not kept go.
    for (_, _, r) in &reports {
        if r.sandbox != report.sandbox
            && let Ok(id) = taskbox_core::api::SandboxId::parse(&r.sandbox)
        {
            let _ = api.destroy(&id);
        }
    }
    let mut list = list;
    list.sort_by_key(|a| a.attempt);
    let passed = passed.len() as u32;
    report.task_id = opts
        .task_dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| report.task_id.clone());
    report.detail = match kept {
        Some(k) => format!(
            "attempt {k} of {n} kept ({}): {}",
            keep.as_str(),
            report.detail
        ),
        None => format!(
            "no attempt of {n} passed the verification gate; attempt {shown}: {}",
            report.detail
        ),
    };
    report.attempts = Some(Attempts {
        n,
        passed,
        pass_at_n: passed > 0,
        keep: keep.as_str().to_owned(),
        kept,
        list,
    });
    let dir = &opts.task_dir;
    let json = serde_json::to_vec_pretty(&report).map_err(|e| AgentError::Io(e.to_string()))?;
    std::fs::write(dir.join(REPORT_JSON), json).map_err(|e| {
        AgentError::Io(format!(
            "cannot write {}: {e}",
            dir.join(REPORT_JSON).display()
        ))
    })?;
    std::fs::write(dir.join(REPORT_MD), report.to_markdown()).map_err(|e| {
        AgentError::Io(format!(
            "cannot write {}: {e}",
            dir.join(REPORT_MD).display()
        ))
    })?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn rules_parse_and_diffs_are_counted() {
        for k in [
            Keep::First,
            Keep::FewestTurns,
            Keep::SmallestDiff,
            Keep::Cheapest,
        ] {
            assert_eq!(k.as_str().parse::<Keep>().unwrap(), k);
        }
        assert!("best".parse::<Keep>().is_err());
        let d = "--- a/x\n+++ b/x\n@@ -1 +1,2 @@\n-a\n+b\n+c\n";
        assert_eq!(diff_lines(d), 3);
    }
}
