//! `taskbox agent run|resume|replay|eval`: the agent loop of `taskbox-agent` on the command
//! line. Sandboxes come from an in-process native backend (the default; the sandbox ends with
//! the command, so `--apply` exports the change first) or, with `--remote`, from the supervisor
//! (`taskbox serve`), where they outlive the command.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Subcommand};
use taskbox_agent::agent::{Decision, Options, TaskSpec};
use taskbox_agent::contract::Contract;
use taskbox_agent::model::{ModelConfig, Provider};
use taskbox_agent::state::Plan;
use taskbox_agent::{Approver, PlanReviewer};
use taskbox_core::api::{Approval, ExportRequest, SandboxApi, SandboxId};

use crate::verbs::Conn;

#[derive(Subcommand)]
pub enum AgentCommand {
    /// Run a task: the model proposes tool calls, the harness enforces the work contract, and
    /// the task ends with a report (STATE/agent/TASK/report.md and report.json).
    ///
    /// The contract comes from --contract FILE and/or the flags (flags win). The model from
    /// the contract's [model] table, the flags, or TASKBOX_MODEL_PROVIDER, TASKBOX_MODEL_BASE_URL,
    /// TASKBOX_MODEL, TASKBOX_MODEL_API_KEY (or OPENAI_API_KEY / ANTHROPIC_API_KEY),
    /// TASKBOX_MODEL_CA_FILE.
    /// Exit status: 0 when the task completed (the verification gate passed), 1 when it ended
    /// otherwise, 125 when taskbox itself failed.
    Run(RunArgs),
    /// Continue a task whose process was killed, from its last completed turn (the sandbox is
    /// rolled back to that turn's checkpoint, or rebuilt from the recorded change).
    Resume(ResumeArgs),
    /// Re-run a task from its trace with the recorded model responses in a fresh sandbox, and
    /// report whether every observation matches (exit 0) or where it diverges (exit 1).
    Replay(ReplayArgs),
    /// Run every task of a directory (each: contract.toml and repo/ or repo.tar) in parallel
    /// sandboxes and print the metrics table.
    Eval(EvalArgs),
}

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model protocol: openai (chat completions) or anthropic (Messages).
    #[arg(long, value_name = "openai|anthropic")]
    provider: Option<String>,
    /// Model server base URL, e.g. http://127.0.0.1:8000/v1, https://api.openai.com/v1 or
    /// unix:/PATH.
    #[arg(long, value_name = "URL")]
    base_url: Option<String>,
    /// CA certificates (PEM) trusted for an https model server, besides the system's roots
    /// (also TASKBOX_MODEL_CA_FILE, or [model] ca_file in the contract).
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// Model name.
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Use the supervisor's sandboxes (taskbox serve) instead of an in-process backend.
    #[arg(long)]
    remote: bool,
    /// Who answers the command policy's `ask`: terminal (the default when stdin is one), api
    /// (left pending for `taskbox approve`/`deny` or the HTTP API; needs --remote), or deny.
    #[arg(long, value_name = "terminal|api|deny")]
    approvals: Option<String>,
}

#[derive(Args)]
pub struct RunArgs {
    /// Work contract file (TOML: goal, scope, forbidden, verify, deliverables, [budget], [model]).
    #[arg(long, value_name = "FILE")]
    contract: Option<PathBuf>,
    /// The goal, in one sentence.
    #[arg(long, value_name = "TEXT")]
    goal: Option<String>,
    /// A path the agent may change (repeatable; prefix or glob).
    #[arg(long = "scope", value_name = "PATH")]
    scope: Vec<String>,
    /// A command the harness refuses (repeatable; a prefix such as "git push").
    #[arg(long = "forbid", value_name = "CMD")]
    forbid: Vec<String>,
    /// A verification command (repeatable); the task completes only when all exit 0.
    #[arg(long = "verify", value_name = "CMD")]
    verify: Vec<String>,
    /// The agent must submit a plan before its first edit.
    #[arg(long)]
    plan_first: bool,
    /// A person confirms the plan on the terminal (implies --plan-first).
    #[arg(long)]
    confirm_plan: bool,
    #[arg(long, value_name = "N")]
    max_turns: Option<u32>,
    /// Wall-time budget, e.g. 10m.
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration)]
    time: Option<Duration>,
    /// Cost budget in US dollars.
    #[arg(long, value_name = "USD")]
    max_cost: Option<f64>,
    /// Token budget (input plus output over the task).
    #[arg(long, value_name = "N")]
    max_tokens: Option<u64>,
    /// The repository (default: the current directory).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Policy name or file for the sandbox.
    #[arg(long, value_name = "NAME|FILE")]
    policy: Option<String>,
    /// Where the trace, state and report go (default: STATE/agent/task-TIME).
    #[arg(long, value_name = "DIR")]
    task_dir: Option<PathBuf>,
    /// Apply the change to the workspace when the task completed.
    #[arg(long)]
    apply: bool,
    /// With --apply: also write files that tools run on their own (.envrc, .vscode/tasks.json,
    /// git hooks, CI definitions, ...); without it such an apply is refused, naming them (the
    /// report keeps the diff).
    #[arg(long, requires = "apply")]
    allow_autorun: bool,
    /// Run N attempts of the task side by side, each in its own fork of one prepared sandbox
    /// and under the contract; the one --keep chooses among those that pass verification is
    /// the task's result. The report lists every attempt (pass@N, turns, tokens, cost).
    #[arg(long, value_name = "N", default_value_t = 1)]
    attempts: u32,
    /// Which passing attempt is kept: first (the others are ended then), fewest-turns,
    /// smallest-diff or cheapest.
    #[arg(long, value_name = "RULE", default_value = "first", value_parser = |s: &str| s.parse::<taskbox_agent::Keep>())]
    keep: taskbox_agent::Keep,
    /// Offer the model the `subtask` tool: it hands a sub-goal with its own scope and budget to
    /// a sub-agent in a fork, whose verified change is merged back (or its conflicts reported).
    #[arg(long)]
    subtasks: bool,
    /// Print the report as JSON instead of Markdown.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Args)]
pub struct ResumeArgs {
    /// The task directory (holding state.json and trace.jsonl).
    task_dir: PathBuf,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The agent trace (TASK/trace.jsonl).
    trace: PathBuf,
    /// Use this repository instead of the recorded workspace directory.
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Where the replay's own trace and report go (default: beside the trace, replay-TIME).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
    #[arg(long)]
    remote: bool,
}

#[derive(Args)]
pub struct EvalArgs {
    /// A directory of tasks.
    tasks_dir: PathBuf,
    /// Tasks run at the same time.
    #[arg(long, value_name = "N", default_value_t = 2)]
    parallel: usize,
    /// Output directory (default: STATE/agent/eval-TIME).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    model: ModelArgs,
}

/// The sandboxes: in-process, or the supervisor's.
struct Backend {
    api: Arc<dyn SandboxApi>,
    /// The in-process backend's own directory, removed at the end.
    session_dir: Option<PathBuf>,
    remote: bool,
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(d) = &self.session_dir {
            for info in self.api.list() {
                let _ = self.api.destroy(&info.id);
            }
            taskbox_core::native::remove_tree(d);
        }
    }
}

fn backend(conn: &Conn, remote: bool) -> Result<Backend> {
    let state_dir = conn.state_dir();
    if remote {
        let socket = conn.socket();
        crate::client::Client::connect_or_start(&socket, &state_dir)?;
        let api = taskbox_agent::remote::Remote::new(&format!("unix:{}", socket.display()), None)
            .map_err(|e| anyhow!(e))?;
        return Ok(Backend {
            api: Arc::new(api),
            session_dir: None,
            remote: true,
        });
    }
    let sessions = state_dir.join("agent").join("sessions");
    crate::orphans::sweep_agent_sessions(&sessions);
    let session_dir = sessions.join(std::process::id().to_string());
    let api = taskbox_core::runtime::RuntimeBuilder::new()
        .native(session_dir.clone())
        .images(crate::docker::image_resolver(&state_dir))
        .egress(crate::egress_service(1)?)
        .command_policy(true)
        .trace(state_dir.join("traces"))
        .build()
        .map_err(|e| anyhow!(e))?;
    Ok(Backend {
        api,
        session_dir: Some(session_dir),
        remote: false,
    })
}

fn model_config(base: Option<ModelConfig>, args: &ModelArgs) -> Result<ModelConfig> {
    let mut cfg = match (base, &args.base_url, &args.model) {
        (Some(c), _, _) => c,
        (None, Some(url), Some(model)) => {
            let provider = match &args.provider {
                Some(p) => p.parse::<Provider>()?,
                None => Provider::Openai,
            };
            ModelConfig::new(provider, url, model)
        }
        (None, _, _) => ModelConfig::from_env(None)?,
    };
    if let Some(p) = &args.provider {
        cfg.provider = p.parse()?;
    }
    if let Some(u) = &args.base_url {
        cfg.base_url = u.clone();
    }
    if let Some(m) = &args.model {
        cfg.model = m.clone();
    }
    if let Some(f) = &args.ca_file {
        cfg.ca_file = Some(f.clone());
    }
    Ok(ModelConfig::from_env(Some(cfg))?)
}

fn stamp() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}-{:03}", t.as_secs(), t.subsec_millis())
}

/// Ctrl-C ends the task at its next step (`cancelled`) instead of killing it.
fn cancel_on_interrupt() -> Arc<AtomicBool> {
    static INTERRUPTED: AtomicBool = AtomicBool::new(false);
    extern "C" fn on_sigint(_: nix::libc::c_int) {
        INTERRUPTED.store(true, Ordering::SeqCst);
    }
    let flag = Arc::new(AtomicBool::new(false));
    let action = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_sigint),
        nix::sys::signal::SaFlags::SA_RESTART,
        nix::sys::signal::SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let installed = unsafe { nix::sys::signal::sigaction(nix::sys::signal::SIGINT, &action) };
    if installed.is_ok() {
        let f = flag.clone();
        std::thread::spawn(move || {
            while !INTERRUPTED.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("taskbox: interrupted; the task ends after its current step");
            f.store(true, Ordering::SeqCst);
        });
    }
    flag
}

/// Asks the person at the terminal.
struct Terminal;

fn ask(question: &str) -> Decision {
    let mut err = std::io::stderr();
    let _ = write!(err, "{question} [y/N/reason to deny] ");
    let _ = err.flush();
    let mut answer = String::new();
    if std::io::stdin().lock().read_line(&mut answer).is_err() {
        return Decision::Deny("no answer".into());
    }
    match answer.trim() {
        "y" | "Y" | "yes" => Decision::Approve,
        "" | "n" | "N" | "no" => Decision::Deny("declined at the terminal".into()),
        reason => Decision::Deny(reason.to_owned()),
    }
}

impl Approver for Terminal {
    fn decide(&self, a: &Approval) -> Decision {
        ask(&format!(
            "taskbox: the agent wants to run `{}`; the command policy asks first because {}.\n\
             taskbox: run it?",
            a.command, a.reason
        ))
    }
}

impl PlanReviewer for Terminal {
    fn review(&self, plan: &Plan) -> Decision {
        let mut text = String::from("taskbox: the agent's plan:\n");
        for (i, s) in plan.steps.iter().enumerate() {
            text.push_str(&format!("  {}. {s}\n", i + 1));
        }
        if !plan.files.is_empty() {
            text.push_str(&format!("  files: {}\n", plan.files.join(", ")));
        }
        text.push_str("taskbox: approve it?");
        ask(&text)
    }
}

fn options(task_dir: PathBuf, confirm_plan: bool, model: &ModelArgs) -> Result<Options> {
    let mut opts = Options::new(task_dir);
    let terminal = std::io::stdin().is_terminal();
    match model.approvals.as_deref() {
        None if terminal => opts.approver = Arc::new(Terminal),
        None | Some("deny") => {}
        Some("terminal") if terminal => opts.approver = Arc::new(Terminal),
        Some("terminal") => bail!("--approvals terminal needs a terminal on stdin"),
        Some("api") if model.remote => {
            opts.approver = Arc::new(taskbox_agent::agent::ThroughTheApi)
        }
        Some("api") => bail!(
            "--approvals api needs --remote: an in-process sandbox has no API for a person to answer through"
        ),
        Some(other) => bail!("unknown --approvals {other:?}: use terminal, api or deny"),
    }
    if confirm_plan {
        if !terminal {
            bail!("--confirm-plan needs a person at a terminal (stdin is not one)");
        }
        opts.plan_reviewer = Some(Arc::new(Terminal));
    }
    opts.cancel = cancel_on_interrupt();
    Ok(opts)
}

fn print_report(report: &taskbox_agent::Report, json: bool) -> Result<u8> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{}", report.to_markdown());
    }
    Ok(if report.succeeded() { 0 } else { 1 })
}

pub fn run(cmd: AgentCommand, conn: &Conn) -> Result<u8> {
    match cmd {
        AgentCommand::Run(a) => run_task(a, conn),
        AgentCommand::Resume(a) => {
            let b = backend(conn, a.model.remote)?;
            let state = taskbox_agent::state::TaskState::load(
                &a.task_dir.join(taskbox_agent::agent::STATE_FILE),
            )
            .map_err(|e| anyhow!(e))?;
            let cfg = model_config(state.contract.model.clone(), &a.model)?;
            let opts = options(a.task_dir.clone(), false, &a.model)?;
            let report = taskbox_agent::resume(b.api.clone(), cfg.build()?, opts)?;
            finish_sandbox(&b, &report, false, false)?;
            print_report(&report, a.json)
        }
        AgentCommand::Replay(a) => {
            let b = backend(conn, a.remote)?;
            let out = match a.out {
                Some(o) => o,
                None => a
                    .trace
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join(format!("replay-{}", stamp())),
            };
            let workspace = a
                .workspace
                .map(|w| std::fs::canonicalize(&w).map(|p| p.display().to_string()))
                .transpose()
                .context("the --workspace directory does not exist")?;
            let r = taskbox_agent::replay::replay(b.api.clone(), &a.trace, out, workspace)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", r.render());
            }
            Ok(if r.matched { 0 } else { 1 })
        }
        AgentCommand::Eval(a) => {
            let b = backend(conn, a.model.remote)?;
            let cfg = model_config(None, &a.model)?;
            let out = a.out.unwrap_or_else(|| {
                conn.state_dir()
                    .join("agent")
                    .join(format!("eval-{}", stamp()))
            });
            let r = taskbox_agent::eval::run(b.api.clone(), &a.tasks_dir, &cfg, a.parallel, &out)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", taskbox_agent::eval::render_table(&r));
                println!("reports: {}", out.display());
            }
            Ok(if r.tasks.iter().all(|t| t.succeeded) {
                0
            } else {
                1
            })
        }
    }
}

fn run_task(a: RunArgs, conn: &Conn) -> Result<u8> {
    let mut contract = match &a.contract {
        Some(p) => Contract::load(p)?,
        None => Contract::with_goal(
            a.goal
                .clone()
                .ok_or_else(|| anyhow!("give the task: --goal TEXT or --contract FILE"))?,
        ),
    };
    if let Some(g) = a.goal {
        contract.goal = g;
    }
    contract.scope.extend(a.scope);
    contract.forbidden.extend(a.forbid);
    contract.verify.extend(a.verify);
    contract.plan_first |= a.plan_first || a.confirm_plan;
    if let Some(n) = a.max_turns {
        contract.budget.max_turns = n;
    }
    if let Some(t) = a.time {
        contract.budget.time = t;
    }
    if a.max_cost.is_some() {
        contract.budget.max_cost_usd = a.max_cost;
    }
    if a.max_tokens.is_some() {
        contract.budget.max_tokens = a.max_tokens;
    }
    contract.check("the contract")?;
    let cfg = model_config(contract.model.clone(), &a.model)?;
    let model = cfg.build()?;
    let workspace = match a.workspace {
        Some(w) => w,
        None => std::env::current_dir().context("cannot determine the current directory")?,
    };
    let workspace = std::fs::canonicalize(&workspace)
        .with_context(|| format!("workspace {} does not exist", workspace.display()))?;
    let policy = match a.policy {
        Some(p) if Path::new(&p).exists() => Some(std::fs::canonicalize(&p)?.display().to_string()),
        other => other,
    };
    let task_dir = a.task_dir.unwrap_or_else(|| {
        conn.state_dir()
            .join("agent")
            .join(format!("task-{}", stamp()))
    });
    let b = backend(conn, a.model.remote)?;
    let opts = options(task_dir.clone(), a.confirm_plan, &a.model)?;
    eprintln!("taskbox: task directory {}", task_dir.display());
    let spec = TaskSpec {
        contract,
        workspace: workspace.display().to_string(),
        policy,
        image: None,
        backend: None,
    };
    let mut opts = opts;
    let factory: taskbox_agent::ModelFactory = {
        let cfg = cfg.clone();
        Arc::new(move || cfg.build())
    };
    if a.subtasks {
        opts.models = Some(factory.clone());
    }
    let report = if a.attempts > 1 {
        drop(model);
        taskbox_agent::start_attempts(b.api.clone(), factory, spec, opts, a.attempts, a.keep)?
    } else {
        taskbox_agent::start(b.api.clone(), model, spec, opts)?
    };
    finish_sandbox(&b, &report, a.apply, a.allow_autorun)?;
    print_report(&report, a.json)
}

/// Applies the change when asked (and the task completed); an in-process sandbox then ends
/// with the command, a supervisor's lives on.
fn finish_sandbox(
    b: &Backend,
    report: &taskbox_agent::Report,
    apply: bool,
    allow_autorun: bool,
) -> Result<()> {
    let id = SandboxId::parse(&report.sandbox)?;
    if apply && report.succeeded() {
        let r = b.api.export(
            &id,
            ExportRequest {
                apply: true,
                allow_autorun,
                ..ExportRequest::default()
            },
        )?;
        eprintln!(
            "taskbox: applied {} change(s) to {}",
            r.changes.len(),
            report.workspace
        );
    } else if apply {
        eprintln!("taskbox: not applying the change: the task did not complete");
    }
    if b.remote {
        eprintln!(
            "taskbox: sandbox {id} lives on in the supervisor (taskbox export --apply {id}; taskbox rm {id})"
        );
    }
    Ok(())
}
