//! `taskbox agent eval TASKS_DIR`: runs a set of tasks in parallel sandboxes and prints the
//! baseline metrics table, so that harness changes can be compared.
//!
//! Each subdirectory of TASKS_DIR is one task: `contract.toml` (a work contract, with its
//! verification commands) and the repository, as a directory `repo/` or a tarball `repo.tar`
//! (unpacked into the output directory first). Tasks run in name order, `parallel` at a time,
//! each in its own sandbox, with its trace, state and report in `OUT/NAME/`; the whole
//! evaluation is written to `OUT/eval.json`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use taskbox_core::api::{SandboxApi, SandboxId};

use crate::agent::{self, AgentError, Options, TaskSpec};
use crate::contract::Contract;
use crate::model::ModelConfig;
use crate::state::Metrics;

/// One task's line of the table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskResult {
    pub name: String,
    pub termination: String,
    pub succeeded: bool,
    pub detail: String,
    pub metrics: Metrics,
}

/// The evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub model: String,
    pub tasks: Vec<TaskResult>,
    pub success_rate: f64,
    pub first_attempt_success_rate: f64,
    pub mean_turns: f64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
    pub mean_wall_ms: f64,
    pub total_wall_ms: u64,
}

/// A task found in the tasks directory.
#[derive(Debug, Clone)]
pub struct EvalTask {
    pub name: String,
    pub dir: PathBuf,
    pub contract: Contract,
}

/// Finds the tasks of `dir` (see the module docs).
pub fn discover(dir: &Path) -> Result<Vec<EvalTask>, AgentError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        AgentError::Io(format!(
            "cannot read tasks directory {}: {e}",
            dir.display()
        ))
    })?;
    let mut tasks = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let contract = path.join("contract.toml");
        if !path.is_dir() || !contract.is_file() {
            continue;
        }
        if !path.join("repo").is_dir() && !path.join("repo.tar").is_file() {
            return Err(AgentError::State(format!(
                "task {} has neither repo/ nor repo.tar",
                path.display()
            )));
        }
        tasks.push(EvalTask {
            name: e.file_name().to_string_lossy().into_owned(),
            contract: Contract::load(&contract)?,
            dir: path,
        });
    }
    tasks.sort_by(|a, b| a.name.cmp(&b.name));
    if tasks.is_empty() {
        return Err(AgentError::State(format!(
            "no tasks in {}: each task is a directory with contract.toml and repo/ or repo.tar",
            dir.display()
        )));
    }
    Ok(tasks)
}

fn workspace_of(task: &EvalTask, out: &Path) -> Result<PathBuf, AgentError> {
    let repo = task.dir.join("repo");
    if repo.is_dir() {
        return std::fs::canonicalize(&repo)
            .map_err(|e| AgentError::Io(format!("cannot resolve {}: {e}", repo.display())));
    }
    let tarball = task.dir.join("repo.tar");
    let dest = out.join(format!("{}-repo", task.name));
    std::fs::create_dir_all(&dest)
        .map_err(|e| AgentError::Io(format!("cannot create {}: {e}", dest.display())))?;
    let file = std::fs::File::open(&tarball)
        .map_err(|e| AgentError::Io(format!("cannot open {}: {e}", tarball.display())))?;
    tar::Archive::new(file)
        .unpack(&dest)
        .map_err(|e| AgentError::Io(format!("cannot unpack {}: {e}", tarball.display())))?;
    Ok(dest)
}

/// Runs every task of `tasks_dir` with models built from `model` (each task's contract may
/// carry its own `[model]`), `parallel` at a time, writing to `out`.
pub fn run(
    api: Arc<dyn SandboxApi>,
    tasks_dir: &Path,
    model: &ModelConfig,
    parallel: usize,
    out: &Path,
) -> Result<EvalReport, AgentError> {
    let tasks = discover(tasks_dir)?;
    std::fs::create_dir_all(out)
        .map_err(|e| AgentError::Io(format!("cannot create {}: {e}", out.display())))?;
    let started = Instant::now();
    let queue = Mutex::new(tasks.clone().into_iter().enumerate().collect::<Vec<_>>());
    let results: Mutex<Vec<Option<TaskResult>>> = Mutex::new(vec![None; tasks.len()]);
    std::thread::scope(|s| {
        for _ in 0..parallel.max(1).min(tasks.len()) {
            s.spawn(|| {
                loop {
                    let next = queue.lock().ok().and_then(|mut q| {
                        if q.is_empty() {
                            None
                        } else {
                            Some(q.remove(0))
                        }
                    });
                    let Some((i, task)) = next else { break };
                    let r = run_one(api.clone(), &task, model, out);
                    if let Ok(mut res) = results.lock() {
                        res[i] = Some(r);
                    }
                }
            });
        }
    });
    let tasks: Vec<TaskResult> = results
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect();
    let n = tasks.len().max(1) as f64;
    let report = EvalReport {
        model: format!("{:?}:{}", model.provider, model.model).to_lowercase(),
        success_rate: tasks.iter().filter(|t| t.succeeded).count() as f64 / n,
        first_attempt_success_rate: tasks
            .iter()
            .filter(|t| t.succeeded && t.metrics.first_attempt_verification_pass == Some(true))
            .count() as f64
            / n,
        mean_turns: tasks.iter().map(|t| t.metrics.turns as f64).sum::<f64>() / n,
        tokens_in: tasks.iter().map(|t| t.metrics.tokens_in).sum(),
        tokens_out: tasks.iter().map(|t| t.metrics.tokens_out).sum(),
        cost_usd: tasks.iter().map(|t| t.metrics.cost_usd).sum(),
        mean_wall_ms: tasks.iter().map(|t| t.metrics.wall_ms as f64).sum::<f64>() / n,
        total_wall_ms: started.elapsed().as_millis() as u64,
        tasks,
    };
    let json = serde_json::to_vec_pretty(&report).map_err(|e| AgentError::Io(e.to_string()))?;
    let path = out.join("eval.json");
    std::fs::write(&path, json)
        .map_err(|e| AgentError::Io(format!("cannot write {}: {e}", path.display())))?;
    Ok(report)
}

fn run_one(
    api: Arc<dyn SandboxApi>,
    task: &EvalTask,
    model: &ModelConfig,
    out: &Path,
) -> TaskResult {
    let failed = |detail: String| TaskResult {
        name: task.name.clone(),
        termination: "harness_error".into(),
        succeeded: false,
        detail,
        metrics: Metrics::default(),
    };
    let workspace = match workspace_of(task, out) {
        Ok(w) => w,
        Err(e) => return failed(e.to_string()),
    };
    let cfg = task.contract.model.clone().unwrap_or_else(|| model.clone());
    let built = match cfg.build() {
        Ok(m) => m,
        Err(e) => return failed(e.to_string()),
    };
    let spec = TaskSpec {
        contract: task.contract.clone(),
        workspace: workspace.display().to_string(),
        policy: None,
        image: None,
        backend: None,
    };
    match agent::start(api.clone(), built, spec, Options::new(out.join(&task.name))) {
        Ok(r) => {
            if let Ok(id) = SandboxId::parse(&r.sandbox) {
                let _ = api.destroy(&id);
            }
            TaskResult {
                name: task.name.clone(),
                termination: r.termination.to_string(),
                succeeded: r.succeeded(),
                detail: r.detail,
                metrics: r.metrics,
            }
        }
        Err(e) => failed(e.to_string()),
    }
}

/// The metrics table for a person.
pub fn render_table(r: &EvalReport) -> String {
    let mut s = format!(
        "{:<20} {:<22} {:>5} {:>6} {:>6} {:>10} {:>10} {:>9} {:>8}\n",
        "task",
        "termination",
        "ok",
        "first",
        "turns",
        "tokens in",
        "tokens out",
        "cost $",
        "wall s"
    );
    for t in &r.tasks {
        let m = &t.metrics;
        s.push_str(&format!(
            "{:<20} {:<22} {:>5} {:>6} {:>6} {:>10} {:>10} {:>9.4} {:>8.1}\n",
            t.name,
            t.termination,
            if t.succeeded { "yes" } else { "no" },
            match m.first_attempt_verification_pass {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            },
            m.turns,
            m.tokens_in,
            m.tokens_out,
            m.cost_usd,
            m.wall_ms as f64 / 1000.0
        ));
    }
    let n = r.tasks.len();
    s.push_str(&format!(
        "\nmodel {}: success rate {:.0}% ({} of {n}), first-attempt success {:.0}%, mean turns {:.1}, \
         tokens {} in / {} out, cost ${:.4}, mean wall time {:.1} s (all tasks {:.1} s)\n",
        r.model,
        r.success_rate * 100.0,
        r.tasks.iter().filter(|t| t.succeeded).count(),
        r.first_attempt_success_rate * 100.0,
        r.mean_turns,
        r.tokens_in,
        r.tokens_out,
        r.cost_usd,
        r.mean_wall_ms / 1000.0,
        r.total_wall_ms as f64 / 1000.0
    ));
    s
}
