//! The loop: the model proposes tool calls, the harness checks them against the work contract,
//! runs them through the narrow API, and hands back structured observations; budgets and the
//! verification gate decide when it ends.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::commands::{Commands, Verdict};
use taskbox_core::result::ChangeKind;
use taskbox_core::support::now_ms;
use taskbox_tools::render;

use crate::context;
use crate::contract::{Contract, Scope, normalise};
use crate::model::{Finish, Message, Model, ModelError, ModelRequest, ToolCall};
use crate::report::Report;
use crate::state::{ApprovalNote, Plan, TaskState, Termination};
use crate::tools::{self, Action};
use crate::trajectory::{Record, Trajectory, VerifyRun};

#[path = "subtask.rs"]
mod subtask;

/// File names in a task directory.
pub const STATE_FILE: &str = "state.json";
pub const TRACE_FILE: &str = "trace.jsonl";
pub const REPORT_JSON: &str = "report.json";
pub const REPORT_MD: &str = "report.md";

/// Bytes of each verification command's output kept in the report.
const VERIFY_TAIL_BYTES: usize = 2000;

/// The message that asks a model to go on after a length cut.
pub const CONTINUE_PROMPT: &str = "Your reply was cut off at the output token limit. Continue \
    exactly where you stopped; do not repeat what you already wrote.";

/// Errors of the harness itself (a model or tool failure is not one: it ends the task with a
/// termination reason and a report).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// the task directory, trace, state or report cannot be written or read
    #[error("{0}")]
    Io(String),
    /// the sandbox cannot be created or restored
    #[error("cannot prepare the sandbox: {0}")]
    Sandbox(#[from] ApiError),
    /// the contract is invalid
    #[error("{0}")]
    Contract(#[from] crate::contract::ContractError),
    /// the task cannot be resumed or replayed
    #[error("{0}")]
    State(String),
}

fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> AgentError {
    AgentError::Io(format!("cannot {what} {}: {e}", path.display()))
}

/// A person's (or a rule's) answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Deny(String),
    /// Leave it to someone else: the approval stays pending for a person to answer through the
    /// API (`taskbox approve`, the HTTP routes) until the policy's `ask_timeout` denies it.
    Defer,
}

/// Answers the execs the command policy `ask`s about.
pub trait Approver: Send + Sync {
    fn decide(&self, approval: &Approval) -> Decision;
}

/// Reviews a plan (`--confirm-plan`).
pub trait PlanReviewer: Send + Sync {
    fn review(&self, plan: &Plan) -> Decision;
}

/// No one to ask: every `ask` is denied with that reason.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoOneToAsk;

impl Approver for NoOneToAsk {
    fn decide(&self, _approval: &Approval) -> Decision {
        Decision::Deny("no one is there to approve it (the agent runs unattended)".into())
    }
}

/// Leaves every `ask` pending for a person to answer through the API.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThroughTheApi;

impl Approver for ThroughTheApi {
    fn decide(&self, _approval: &Approval) -> Decision {
        Decision::Defer
    }
}

/// Told of every completed turn, once its `state.json` and trace lines are written: a queue
/// worker copies them to shared storage there, so that another machine can resume the task
/// from that turn. It runs on the loop's thread; to end the task it sets [`Options::cancel`].
pub trait TurnObserver: Send + Sync {
    fn turn_ended(&self, task_dir: &Path, turn: u32);
}

/// How a task runs.
#[derive(Clone)]
pub struct Options {
    /// Where the trace, the state and the report go.
    pub task_dir: PathBuf,
    pub approver: Arc<dyn Approver>,
    /// With `--confirm-plan`: who confirms the plan.
    pub plan_reviewer: Option<Arc<dyn PlanReviewer>>,
    /// Set to end the task at the next step (`cancelled`).
    pub cancel: Arc<AtomicBool>,
    /// Set to end the task now: a model call in flight gives up too (a queue worker's cancel,
    /// or a task past its maximum duration), where `cancel` lets the step in flight finish.
    pub interrupt: Arc<AtomicBool>,
    /// Told of every completed turn.
    pub on_turn: Option<Arc<dyn TurnObserver>>,
    /// Builds models for runs of their own: with it the model may hand a sub-goal to a
    /// sub-agent in a fork (the `subtask` tool); without it the tool is not offered.
    pub models: Option<ModelFactory>,
    /// Said to the model after the task (e.g. which of several attempts this one is).
    pub note: Option<String>,
}

/// Builds a model for a run of its own (an attempt, a sub-agent).
pub type ModelFactory = Arc<dyn Fn() -> Result<Box<dyn Model>, ModelError> + Send + Sync>;

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("task_dir", &self.task_dir)
            .finish_non_exhaustive()
    }
}

impl Options {
    pub fn new(task_dir: impl Into<PathBuf>) -> Options {
        Options {
            task_dir: task_dir.into(),
            approver: Arc::new(NoOneToAsk),
            plan_reviewer: None,
            cancel: Arc::new(AtomicBool::new(false)),
            interrupt: Arc::new(AtomicBool::new(false)),
            on_turn: None,
            models: None,
            note: None,
        }
    }
}

/// What to work on.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    pub contract: Contract,
    /// Host directory of the repository.
    pub workspace: String,
    /// Policy name or file (default: the default policy).
    pub policy: Option<String>,
    /// The sandbox's image (default: the host view) and backend (default: the API's).
    pub image: Option<String>,
    pub backend: Option<String>,
}

/// The system prompt for a contract and the repository's rules.
pub fn system_prompt(c: &Contract, rules: &str) -> String {
    let mut s = String::from(
        "You are a coding agent working on a repository inside a sandbox. You act only through \
         the tools; every command runs in the sandbox and the harness enforces the work contract \
         below. Work in small steps: look before you change, run the relevant check after a \
         change, and call finish with a summary when the goal is met.\n\n## Work contract\n",
    );
    s.push_str(&format!("Goal: {}\n", c.goal));
    if c.scope.is_empty() {
        s.push_str("Scope: you may change any file of the workspace.\n");
    } else {
        s.push_str(&format!(
            "Scope: you may change only these paths: {}. Edits elsewhere are refused.\n",
            c.scope.join(", ")
        ));
    }
    if !c.forbidden.is_empty() {
        s.push_str(&format!(
            "Forbidden commands (refused without running): {}\n",
            c.forbidden.join(", ")
        ));
    }
    if c.verify.is_empty() {
        s.push_str("Verification: none is configured; finish ends the task.\n");
    } else {
        s.push_str(&format!(
            "Verification: when you call finish the harness runs {}; the task is complete only \
             when every one exits 0.\n",
            c.verify
                .iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if !c.deliverables.is_empty() {
        s.push_str(&format!("Deliverables: {}\n", c.deliverables.join("; ")));
    }
    if c.plan_first {
        s.push_str("Plan first: call plan(steps, files) before your first edit.\n");
    }
    s.push_str(&format!(
        "Budget: at most {} turns and {} of wall time.\n",
        c.budget.max_turns,
        humantime::format_duration(c.budget.time)
    ));
    if !rules.is_empty() {
        s.push_str("\n## Repository rules (from the repository's own files, cut to size)\n");
        s.push_str(rules);
    }
    s
}

/// The first user message.
pub fn task_message(c: &Contract) -> String {
    let mut s = format!("Task: {}", c.goal);
    if !c.deliverables.is_empty() {
        s.push_str(&format!("\nDeliver: {}", c.deliverables.join("; ")));
    }
    s
}

/// Starts a task: creates its sandbox, then runs the loop to the end.
pub fn start(
    api: Arc<dyn SandboxApi>,
    model: Box<dyn Model>,
    spec: TaskSpec,
    opts: Options,
) -> Result<Report, AgentError> {
    let info = prepare(&api, &spec, &opts)?;
    start_in(api, model, spec, opts, info)
}

/// Checks the task and its directory, and creates its sandbox.
pub fn prepare(
    api: &Arc<dyn SandboxApi>,
    spec: &TaskSpec,
    opts: &Options,
) -> Result<SandboxInfo, AgentError> {
    spec.contract.check("the contract")?;
    std::fs::create_dir_all(&opts.task_dir)
        .map_err(|e| io("create the task directory", &opts.task_dir, e))?;
    let state_path = opts.task_dir.join(STATE_FILE);
    if state_path.exists() {
        return Err(AgentError::State(format!(
            "{} already holds a task; use `taskbox agent resume` or another directory",
            opts.task_dir.display()
        )));
    }
    Ok(api.create(CreateRequest {
        workspace: spec.workspace.clone(),
        policy: spec.policy.clone(),
        image: spec.image.clone(),
        backend: spec.backend.clone(),
        labels: [("agent.task".to_owned(), task_label(&opts.task_dir))].into(),
        ..CreateRequest::default()
    })?)
}

/// Runs a task to the end in the sandbox `info` (made for it: by [`prepare`], or a fork).
pub fn start_in(
    api: Arc<dyn SandboxApi>,
    model: Box<dyn Model>,
    spec: TaskSpec,
    opts: Options,
    info: SandboxInfo,
) -> Result<Report, AgentError> {
    spec.contract.check("the contract")?;
    std::fs::create_dir_all(&opts.task_dir)
        .map_err(|e| io("create the task directory", &opts.task_dir, e))?;
    let state_path = opts.task_dir.join(STATE_FILE);
    let rules = context::rule_files(&api, &info.id);
    let system = system_prompt(&spec.contract, &rules);
    let task_id = opts
        .task_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "task".into());
    let mut first = task_message(&spec.contract);
    if let Some(note) = &opts.note {
        first.push_str(&format!("\n({note})"));
    }
    let st = TaskState {
        messages: vec![Message::user(first)],
        workspace: spec.workspace.clone(),
        policy: info.policy.clone(),
        image: spec.image.clone(),
        backend: spec.backend.clone(),
        model: model.describe(),
        system_prompt: system.clone(),
        sandbox: info.id.to_string(),
        ..TaskState::new(task_id.clone(), spec.contract.clone())
    };
    let trace_path = opts.task_dir.join(TRACE_FILE);
    let mut trace =
        Trajectory::open(&trace_path).map_err(|e| io("open the trace", &trace_path, e))?;
    trace
        .record(&Record::Task {
            version: 1,
            task_id,
            model: st.model.clone(),
            workspace: st.workspace.clone(),
            policy: spec.policy.clone().unwrap_or_else(|| info.policy.clone()),
            image: spec.image.clone(),
            backend: spec.backend.clone(),
            sandbox: st.sandbox.clone(),
            contract: serde_json::to_value(&st.contract).unwrap_or_default(),
            system_prompt: system,
            at_ms: now_ms(),
        })
        .map_err(|e| io("write the trace", &trace_path, e))?;
    st.save(&state_path)
        .map_err(|e| io("write the state", &state_path, e))?;
    Runner::new(api, model, opts, st, trace, info)?.run()
}

/// Continues a task whose process ended before it did, from its last completed turn: the
/// sandbox is rolled back to that turn's checkpoint, or, when it is gone, a fresh sandbox gets
/// that turn's workspace change.
pub fn resume(
    api: Arc<dyn SandboxApi>,
    model: Box<dyn Model>,
    opts: Options,
) -> Result<Report, AgentError> {
    let state_path = opts.task_dir.join(STATE_FILE);
    let mut st = TaskState::load(&state_path).map_err(AgentError::State)?;
    if let Some(t) = st.termination {
        return Err(AgentError::State(format!(
            "task {} already ended ({t}); its report is in {}",
            st.task_id,
            opts.task_dir.join(REPORT_MD).display()
        )));
    }
    let old = SandboxId::parse(&st.sandbox).ok();
    let alive = old
        .as_ref()
        .and_then(|id| api.info(id).ok())
        .filter(|i| i.state == "running");
    let (info, restored_by) = match (alive, &st.checkpoint) {
        (Some(info), Some(cp)) if info.checkpoints.contains(cp) => {
            api.restore(&info.id, CheckpointRequest { name: cp.clone() })?;
            (api.info(&info.id)?, format!("checkpoint {cp}"))
        }
        _ => {
            let info = api.create(CreateRequest {
                workspace: st.workspace.clone(),
                policy: Some(st.policy.clone()),
                image: st.image.clone(),
                backend: st.backend.clone(),
                labels: [("agent.task".to_owned(), task_label(&opts.task_dir))].into(),
                ..CreateRequest::default()
            })?;
            if !st.workspace_patch.is_empty() {
                api.patch(
                    &info.id,
                    PatchRequest {
                        patch: st.workspace_patch.clone(),
                    },
                )?;
            }
            for (path, content) in &st.binary_files {
                match content {
                    Some(b64) => {
                        api.write(
                            &info.id,
                            WriteRequest {
                                path: path.clone(),
                                content: b64.clone(),
                                encoding: Some("base64".into()),
                                create_parents: true,
                                mode: None,
                            },
                        )?;
                    }
                    None => api.remove(
                        &info.id,
                        RemoveRequest {
                            path: path.clone(),
                            recursive: false,
                        },
                    )?,
                }
            }
            (info, "a fresh sandbox with the recorded change".to_owned())
        }
    };
    tracing::info!(task = %st.task_id, sandbox = %info.id, turn = st.turn, restored_by = %restored_by, "resuming");
    st.sandbox = info.id.to_string();
    st.model = model.describe();
    // The time budget counts the earlier runs up to their last completed turn.
    st.elapsed_before_ms = st.metrics.wall_ms;
    let trace_path = opts.task_dir.join(TRACE_FILE);
    let mut trace =
        Trajectory::open(&trace_path).map_err(|e| io("open the trace", &trace_path, e))?;
    trace
        .record(&Record::Resume {
            from_turn: st.turn,
            sandbox: st.sandbox.clone(),
            restored_by,
        })
        .map_err(|e| io("write the trace", &trace_path, e))?;
    Runner::new(api, model, opts, st, trace, info)?.run()
}

/// One running task.
struct Runner {
    api: Arc<dyn SandboxApi>,
    model: Box<dyn Model>,
    opts: Options,
    st: TaskState,
    trace: Trajectory,
    id: SandboxId,
    workspace_root: String,
    scope: Scope,
    forbidden: Commands,
    started: Instant,
    deadline: Instant,
    /// Messages already recorded in the trace.
    recorded: usize,
    summary: Option<String>,
    last_verify: Vec<VerifyRun>,
    overheads_us: Vec<u64>,
    /// Time spent in the model and the sandbox during the current turn.
    external: Duration,
    /// Why the task cannot go on, and how it ends: `infrastructure` when the sandbox itself
    /// failed, else `unrecoverable_error`.
    fatal: Option<(Termination, String)>,
    tools: Vec<crate::model::ToolSpec>,
    /// The tools offered (`subtask` among them when sub-agents can run).
    offered: Vec<taskbox_tools::Tool>,
    /// What the sub-agents did.
    subtasks: Vec<crate::report::SubtaskSummary>,
}

impl Runner {
    fn new(
        api: Arc<dyn SandboxApi>,
        model: Box<dyn Model>,
        opts: Options,
        st: TaskState,
        trace: Trajectory,
        info: SandboxInfo,
    ) -> Result<Runner, AgentError> {
        let scope = st
            .contract
            .scope_matcher()
            .map_err(|e| AgentError::State(format!("scope: {e}")))?;
        let forbidden = st
            .contract
            .forbidden_rules()
            .map_err(|e| AgentError::State(format!("forbidden: {e}")))?;
        let left = st
            .contract
            .budget
            .time
            .saturating_sub(Duration::from_millis(st.elapsed_before_ms));
        let started = Instant::now();
        let recorded = st.messages.len();
        let offered = match opts.models {
            Some(_) => tools::with_subtask(),
            None => tools::TOOLS.to_vec(),
        };
        Ok(Runner {
            api,
            model,
            opts,
            trace,
            id: info.id,
            workspace_root: info.workspace,
            scope,
            forbidden,
            started,
            deadline: started + left,
            recorded: if st.turn == 0 { 0 } else { recorded },
            summary: None,
            last_verify: Vec::new(),
            overheads_us: Vec::new(),
            external: Duration::ZERO,
            fatal: None,
            tools: tools::specs_of(&offered),
            offered,
            subtasks: Vec::new(),
            st,
        })
    }

    fn cancelled(&self) -> bool {
        self.opts.cancel.load(Ordering::SeqCst) || self.opts.interrupt.load(Ordering::SeqCst)
    }

    fn state_path(&self) -> PathBuf {
        self.opts.task_dir.join(STATE_FILE)
    }

    fn record(&mut self, r: Record) -> Result<(), AgentError> {
        self.trace
            .record(&r)
            .map_err(|e| io("write the trace", &self.opts.task_dir.join(TRACE_FILE), e))
    }

    fn budget_exhausted(&self) -> Option<(Termination, String)> {
        let b = &self.st.contract.budget;
        let m = &self.st.metrics;
        if self.cancelled() {
            return Some((Termination::Cancelled, "cancelled by the operator".into()));
        }
        if self.st.turn >= b.max_turns {
            return Some((
                Termination::MaxTurns,
                format!("the turn budget ({}) is used up", b.max_turns),
            ));
        }
        if Instant::now() >= self.deadline {
            return Some((
                Termination::TimeBudget,
                format!(
                    "the time budget ({}) is used up",
                    humantime::format_duration(b.time)
                ),
            ));
        }
        if let Some(max) = b.max_cost_usd
            && m.cost_usd >= max
        {
            return Some((
                Termination::CostBudget,
                format!("the cost budget (${max:.4}) is used up: ${:.4}", m.cost_usd),
            ));
        }
        if let Some(max) = b.max_tokens
            && m.tokens_in + m.tokens_out >= max
        {
            return Some((
                Termination::CostBudget,
                format!(
                    "the token budget ({max}) is used up: {} tokens",
                    m.tokens_in + m.tokens_out
                ),
            ));
        }
        None
    }

    fn run(mut self) -> Result<Report, AgentError> {
        let (term, detail) = loop {
            if let Some(end) = self.budget_exhausted() {
                break end;
            }
            let turn_started = Instant::now();
            self.external = Duration::ZERO;
            let turn = self.st.turn + 1;
            let budget = self.st.contract.budget.context_tokens;
            let mut messages = std::mem::take(&mut self.st.messages);
            let compacted =
                context::compact(&mut messages, &self.st.system_prompt, budget, &self.st);
            self.st.messages = messages;
            if compacted {
                self.st.metrics.compactions += 1;
                self.recorded = 0;
            }
            let new_messages =
                self.st.messages[self.recorded.min(self.st.messages.len())..].to_vec();
            self.record(Record::ModelRequest {
                turn,
                messages_total: self.st.messages.len(),
                new_messages,
            })?;
            // The request borrows the conversation and the tools for the call (no copies).
            let req = ModelRequest {
                system: std::mem::take(&mut self.st.system_prompt),
                messages: std::mem::take(&mut self.st.messages),
                tools: std::mem::take(&mut self.tools),
                max_tokens: self
                    .st
                    .contract
                    .model
                    .as_ref()
                    .map(|m| m.max_tokens)
                    .unwrap_or(4096),
            };
            let t = Instant::now();
            self.model.set_deadline(Some(self.deadline));
            self.model.set_cancel(self.opts.interrupt.clone());
            let result = self.model.complete(&req);
            self.external += t.elapsed();
            self.st.system_prompt = req.system;
            self.st.messages = req.messages;
            self.tools = req.tools;
            let resp = match result {
                Ok(r) => r,
                Err(e) => {
                    self.record(Record::ModelError {
                        turn,
                        error: e.to_string(),
                    })?;
                    if matches!(e, ModelError::Cancelled) {
                        break (
                            Termination::Cancelled,
                            "cancelled by the operator during a model call".into(),
                        );
                    }
                    if matches!(e, ModelError::Deadline) || Instant::now() >= self.deadline {
                        break (
                            Termination::TimeBudget,
                            format!(
                                "the time budget ({}) ran out during a model call",
                                humantime::format_duration(self.st.contract.budget.time)
                            ),
                        );
                    }
                    break (
                        Termination::UnrecoverableError,
                        format!("model call failed: {e}"),
                    );
                }
            };
            {
                let m = &mut self.st.metrics;
                m.tokens_in += resp.usage.input_tokens;
                m.tokens_out += resp.usage.output_tokens;
                m.cost_usd += resp.cost_usd;
                m.model_retries += resp.attempts.saturating_sub(1);
            }
            self.record(Record::ModelResponse {
                turn,
                response: resp.clone(),
            })?;
            if resp.finish == Finish::Length {
                self.st.metrics.continuations += 1;
                if resp.tool_calls.is_empty() {
                    self.st
                        .messages
                        .push(Message::assistant(resp.text.clone(), Vec::new()));
                    self.st.messages.push(Message::user(CONTINUE_PROMPT));
                } else {
                    // A tool call cut short has arguments that cannot be trusted: ask again.
                    self.st
                        .messages
                        .push(Message::assistant(resp.text.clone(), Vec::new()));
                    self.st.messages.push(Message::user(
                        "Your reply was cut off at the output token limit in the middle of a tool \
                         call, so it was not run. Send the call again, smaller (for example \
                         several edit_file calls instead of one large write_file).",
                    ));
                }
                self.recorded = self.st.messages.len() - 2;
                self.end_turn(turn_started)?;
                continue;
            }
            self.st.messages.push(Message::assistant(
                resp.text.clone(),
                resp.tool_calls.clone(),
            ));
            self.recorded = self.st.messages.len();
            let mut gate: Option<bool> = None;
            if resp.tool_calls.is_empty() {
                // Ending without a tool call is a claim of being done: the gate decides.
                let passed = self.finish_requested(turn, resp.text.clone(), None)?;
                gate = Some(passed);
            }
            // The turn's subtasks start first, in forks of the sandbox as the turn found it,
            // and run side by side with its other calls; each is merged at its own call.
            let mut subtasks = self.start_subtasks(turn, &resp.tool_calls);
            for call in &resp.tool_calls {
                if gate == Some(true) {
                    break;
                }
                if self.cancelled() {
                    break;
                }
                self.st.metrics.tool_calls += 1;
                let t = Instant::now();
                if let Some(running) = subtasks.remove(&call.id) {
                    let (ok, obs) = self.merge_subtask(running);
                    self.answer(turn, call, ok, obs, t)?;
                    if self.fatal.is_some() {
                        break;
                    }
                    continue;
                }
                let action = match tools::validate_among(&self.offered, &call.name, &call.arguments)
                {
                    Ok(a) => a,
                    Err(msg) => {
                        self.st.metrics.validation_errors += 1;
                        self.st.failed_attempts.push(format!("turn {turn}: {msg}"));
                        self.answer(turn, call, false, msg, t)?;
                        continue;
                    }
                };
                if let Action::Finish { summary } = action {
                    let passed = self.finish_requested(turn, summary, Some(call))?;
                    gate = Some(passed);
                    continue;
                }
                let (ok, obs) = self.act(turn, action);
                self.answer(turn, call, ok, obs, t)?;
                if self.fatal.is_some() {
                    break;
                }
            }
            // Subtasks whose calls were not reached (the gate passed, the task was cancelled):
            // their forks go.
            for (_, running) in subtasks.drain() {
                self.abandon_subtask(running);
            }
            self.end_turn(turn_started)?;
            if let Some((term, why)) = self.fatal.take() {
                break (term, why);
            }
            match gate {
                Some(true) => {
                    break (
                        Termination::Completed,
                        if self.st.contract.verify.is_empty() {
                            "the model finished; no verification command is configured".into()
                        } else {
                            "the model finished and every verification command passed".into()
                        },
                    );
                }
                Some(false)
                    if self.st.verify_attempts >= self.st.contract.budget.max_verify_attempts =>
                {
                    break (
                        Termination::VerificationFailed,
                        format!(
                            "the verification gate failed {} time(s), the most the contract allows",
                            self.st.verify_attempts
                        ),
                    );
                }
                _ => {}
            }
        };
        self.conclude(term, detail)
    }

    /// Appends a tool result to the conversation and the trace.
    fn answer(
        &mut self,
        turn: u32,
        call: &ToolCall,
        ok: bool,
        observation: String,
        started: Instant,
    ) -> Result<(), AgentError> {
        self.record(Record::Tool {
            turn,
            call: call.clone(),
            ok,
            observation: observation.clone(),
            duration_ms: started.elapsed().as_millis() as u64,
        })?;
        let message = if ok {
            Message::tool(call.id.clone(), observation)
        } else {
            Message::tool_error(call.id.clone(), observation)
        };
        self.st.messages.push(message);
        self.recorded = self.st.messages.len();
        Ok(())
    }

    /// Runs the verification gate after the model said it is done; the result goes back to the
    /// model (as the finish call's result, or as a user message when it ended without one).
    fn finish_requested(
        &mut self,
        turn: u32,
        summary: String,
        call: Option<&ToolCall>,
    ) -> Result<bool, AgentError> {
        let t = Instant::now();
        if !summary.trim().is_empty() {
            self.summary = Some(summary);
        }
        let (passed, text) = self.gate(turn)?;
        match call {
            Some(c) => self.answer(turn, c, passed, text, t)?,
            None => {
                self.st.messages.push(Message::user(text));
                self.recorded = self.st.messages.len();
            }
        }
        Ok(passed)
    }

    /// The verification gate: the change stays in scope and every verification command exits 0.
    fn gate(&mut self, turn: u32) -> Result<(bool, String), AgentError> {
        self.st.metrics.verification_runs += 1;
        self.st.verify_attempts += 1;
        let mut problems = Vec::new();
        let t = Instant::now();
        let diff = self.api.diff(&self.id, DiffRequest::default());
        self.external += t.elapsed();
        match diff {
            Ok(d) => {
                let outside: Vec<String> = d
                    .files
                    .iter()
                    .map(|f| f.path.clone())
                    .filter(|p| !self.scope.allows(p))
                    .collect();
                if !outside.is_empty() {
                    problems.push(format!(
                        "files outside the contract's scope are changed: {} (undo those changes)",
                        outside.join(", ")
                    ));
                }
            }
            Err(e) => problems.push(format!("cannot diff the workspace: {e}")),
        }
        let mut runs = Vec::new();
        for cmd in self.st.contract.verify.clone() {
            let t = Instant::now();
            let out = self.api.exec(
                &self.id,
                ExecRequest {
                    shell: Some(cmd.clone()),
                    timeout_ms: Some(self.st.contract.budget.verify_timeout_ms),
                    output_limit: Some(16 * 1024),
                    ..ExecRequest::default()
                },
                None,
            );
            self.external += t.elapsed();
            let run = match out {
                Ok(ExecOutcome::Finished(r)) => VerifyRun {
                    command: cmd.clone(),
                    exit_code: r.exit_code,
                    passed: r.exit_code == Some(0) && !r.timed_out,
                    duration_ms: r.duration_ms,
                    output_tail: tail(
                        &format!(
                            "{}{}{}",
                            r.stdout.text,
                            r.stderr.text,
                            r.violations
                                .iter()
                                .map(|v| format!("violation ({}): {}\n", v.kind, v.detail))
                                .collect::<String>()
                        ),
                        VERIFY_TAIL_BYTES,
                    ),
                    findings: r.findings.clone(),
                    tests: r.tests,
                },
                Ok(ExecOutcome::Background(_)) => VerifyRun {
                    command: cmd.clone(),
                    exit_code: None,
                    passed: false,
                    duration_ms: 0,
                    output_tail: "ran in the background unexpectedly".into(),
                    findings: Vec::new(),
                    tests: None,
                },
                Err(e) => {
                    // A lost sandbox fails no check of the model's: it ends the task.
                    self.sandbox_failed(&e);
                    VerifyRun {
                        command: cmd.clone(),
                        exit_code: None,
                        passed: false,
                        duration_ms: 0,
                        output_tail: tools::render_error(&e),
                        findings: Vec::new(),
                        tests: None,
                    }
                }
            };
            if !run.passed {
                problems.push(format!(
                    "`{}` failed (exit code {})",
                    cmd,
                    run.exit_code
                        .map(|c| c.to_string())
                        .unwrap_or_else(|| "none".into())
                ));
            }
            runs.push(run);
        }
        let passed = problems.is_empty();
        if self.st.metrics.first_attempt_verification_pass.is_none() {
            self.st.metrics.first_attempt_verification_pass = Some(passed);
        }
        self.st.pending_verification = runs
            .iter()
            .filter(|r| !r.passed)
            .map(|r| r.command.clone())
            .collect();
        let mut text = if passed {
            self.st
                .completed_steps
                .push(format!("turn {turn}: verification passed"));
            "verification passed: the task is complete.\n".to_owned()
        } else {
            self.st.failed_attempts.push(format!(
                "turn {turn}: verification failed: {}",
                problems.join("; ")
            ));
            format!(
                "verification failed (attempt {} of {}): {}\nFix it and call finish again.\n",
                self.st.verify_attempts,
                self.st.contract.budget.max_verify_attempts,
                problems.join("; ")
            )
        };
        for r in &runs {
            text.push_str(&format!(
                "$ {}\nexit_code: {}\n",
                r.command,
                r.exit_code
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "none".into()),
            ));
            // What failed and where first, then the output's tail.
            text.push_str(&render::verify_findings(&r.findings, r.tests.as_ref()));
            text.push_str(&r.output_tail);
            text.push('\n');
        }
        self.record(Record::Verify {
            turn,
            passed,
            runs: runs.clone(),
        })?;
        self.last_verify = runs;
        Ok((passed, text))
    }

    /// A path as the contract sees it: relative to the workspace root.
    fn relative(&self, path: &str) -> Option<String> {
        let p = if path.starts_with('/') {
            let root = self.workspace_root.trim_end_matches('/');
            match path.strip_prefix(root) {
                Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
                _ => return None,
            }
        } else {
            path
        };
        normalise(p)
    }

    fn refuse_out_of_scope(&mut self, paths: &[String]) -> Option<String> {
        let outside: Vec<&String> = paths
            .iter()
            .filter(|p| self.relative(p).is_none_or(|r| !self.scope.allows(&r)))
            .collect();
        if outside.is_empty() {
            return None;
        }
        self.st.metrics.refusals += 1;
        let list: Vec<&str> = outside.iter().map(|p| p.as_str()).collect();
        let msg = format!(
            "refused by the work contract: {} {} outside the scope; change only files in scope \
             (the scope is: {})",
            list.join(", "),
            if list.len() == 1 { "is" } else { "are" },
            self.st.contract.scope.join(", ")
        );
        self.st.failed_attempts.push(msg.clone());
        Some(msg)
    }

    /// Runs one validated action; returns whether it succeeded and the observation.
    fn act(&mut self, turn: u32, action: Action) -> (bool, String) {
        if action.is_edit()
            && self.st.contract.plan_first
            && !self.st.plan.as_ref().is_some_and(|p| p.accepted)
        {
            self.st.metrics.refusals += 1;
            return (
                false,
                "refused by the work contract: submit a plan first (call plan with steps and \
                 the files you expect to change), then edit"
                    .into(),
            );
        }
        let edited: Vec<String> = match &action {
            Action::Write(w) => vec![w.path.clone()],
            Action::Edit(e) => vec![e.path.clone()],
            Action::Patch(p) => tools::patch_paths(&p.patch),
            _ => Vec::new(),
        };
        if let Some(msg) = self.refuse_out_of_scope(&edited) {
            return (false, msg);
        }
        let t = Instant::now();
        let api = self.api.clone();
        let id = self.id.clone();
        let result: Result<String, ApiError> = match action {
            Action::Exec(req) => {
                let r = self.exec(req);
                self.external += t.elapsed();
                return r;
            }
            Action::Read(req) => api.read(&id, req).map(|r| render::read(&r)),
            Action::Write(req) => {
                let path = req.path.clone();
                api.write(&id, req).map(|r| {
                    self.touched(&path, turn, "wrote");
                    render::write(&r)
                })
            }
            Action::Edit(req) => {
                let path = req.path.clone();
                api.edit(&id, req).map(|r| {
                    self.touched(&path, turn, "edited");
                    render::edit(&r)
                })
            }
            Action::Patch(req) => api.patch(&id, req).map(|r| {
                for c in &r.files {
                    self.touched(&c.path, turn, "patched");
                }
                render::patch(&r)
            }),
            Action::List(req) => api.list_dir(&id, req).map(|r| render::list(&r)),
            Action::Search(req) => api.search(&id, req).map(|r| render::search(&r)),
            Action::Diff(req) => api.diff(&id, req).map(|r| render::diff(&r)),
            Action::Plan { steps, files } => {
                self.external += t.elapsed();
                return self.plan(steps, files);
            }
            Action::Finish { .. } => Ok(String::new()),
            // Not offered (see `tools::TOOLS`): a call of it never parses.
            Action::Fork(_) => Err(ApiError::invalid("fork is not one of this harness's tools")),
            // Started with the turn and merged at its call (see `start_subtasks`); one that is
            // here could not start.
            Action::Subtask(_) => Err(ApiError::invalid(
                "the subtask could not start (see the harness's log)",
            )),
        };
        self.external += t.elapsed();
        match result {
            Ok(text) => (true, text),
            Err(e) => {
                let text = tools::render_error(&e);
                self.st.failed_attempts.push(format!("turn {turn}: {text}"));
                self.sandbox_failed(&e);
                (false, text)
            }
        }
    }

    /// Ends the task when `e` says the sandbox itself failed: lost (`infrastructure`, the
    /// episode is not the model's to score), or gone after an internal error.
    fn sandbox_failed(&mut self, e: &ApiError) {
        if e.code() == "infrastructure" {
            self.fatal = Some((
                Termination::Infrastructure,
                format!("the sandbox failed: {e}"),
            ));
        } else if e.is_infrastructure() && self.api.info(&self.id).is_err() {
            self.fatal = Some((
                Termination::UnrecoverableError,
                format!("the sandbox is gone: {e}"),
            ));
        }
    }

    fn touched(&mut self, path: &str, turn: u32, verb: &str) {
        let rel = self.relative(path).unwrap_or_else(|| path.to_owned());
        self.st
            .completed_steps
            .push(format!("turn {turn}: {verb} {rel}"));
        self.st.files_touched.insert(rel);
    }

    fn plan(&mut self, steps: Vec<String>, files: Vec<String>) -> (bool, String) {
        let mut plan = Plan {
            steps,
            files,
            accepted: true,
        };
        let mut text = "plan recorded".to_owned();
        if let Some(reviewer) = &self.opts.plan_reviewer {
            match reviewer.review(&plan) {
                Decision::Approve | Decision::Defer => text = "plan approved by a person".into(),
                Decision::Deny(reason) => {
                    plan.accepted = false;
                    text = format!("plan rejected by a person: {reason}; submit a revised plan");
                }
            }
        }
        let outside: Vec<&String> = plan
            .files
            .iter()
            .filter(|f| !self.scope.allows(&normalise(f).unwrap_or_default()))
            .collect();
        if !outside.is_empty() {
            text.push_str(&format!(
                "\nnote: these files are outside the scope and edits to them will be refused: {}",
                outside
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let ok = plan.accepted;
        self.st.plan = Some(plan);
        (ok, text)
    }

    fn exec(&mut self, mut req: ExecRequest) -> (bool, String) {
        let argv = match req.resolved_argv() {
            Ok(a) => a,
            Err(e) => return (false, tools::render_error(&e)),
        };
        let check = self.forbidden.check(&argv);
        if check.verdict == Verdict::Forbid {
            self.st.metrics.refusals += 1;
            let msg = format!(
                "refused by the work contract: `{}` is forbidden ({}); nothing ran",
                check.command,
                check.rule.unwrap_or_else(|| check.reason.clone())
            );
            self.st.failed_attempts.push(msg.clone());
            return (false, msg);
        }
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .as_millis() as u64;
        let asked_limit = req
            .timeout_ms
            .unwrap_or(self.st.contract.budget.exec_timeout_ms);
        let limit = asked_limit.min(left.max(1000));
        req.timeout_ms = Some(limit);

        let asked = Arc::new(AtomicU32::new(0));
        let mut answers: Vec<std::thread::JoinHandle<()>> = Vec::new();
        let mut answered: Vec<Approval> = Vec::new();
        let outcome = {
            let api = self.api.clone();
            let id = self.id.clone();
            let approver = self.opts.approver.clone();
            let asked = asked.clone();
            let mut on_event = |ev: ExecEvent| match ev {
                ExecEvent::Approval { approval } => {
                    asked.fetch_add(1, Ordering::SeqCst);
                    let api = api.clone();
                    let id = id.clone();
                    let approver = approver.clone();
                    answers.push(std::thread::spawn(move || {
                        answer_approval(api.as_ref(), &id, &approval, approver.as_ref())
                    }));
                }
                ExecEvent::Answered { approval } => answered.push(*approval),
                _ => {}
            };
            self.api.exec(&self.id, req, Some(&mut on_event))
        };
        for h in answers {
            let _ = h.join();
        }
        self.st.metrics.approvals_asked += asked.load(Ordering::SeqCst);
        for a in answered {
            let note = ApprovalNote {
                turn: self.st.turn + 1,
                command: a.command,
                state: a.state,
                denial_reason: a.denial_reason,
            };
            self.st.approvals.push(note.clone());
            let record = Record::Approval { note, rule: a.rule };
            // The trace's next write reports a broken trace; the exec's answer stands.
            if let Err(e) = self.record(record) {
                tracing::warn!(error = %e, "cannot record an approval in the trace");
            }
        }
        match outcome {
            Ok(ExecOutcome::Finished(r)) => {
                if r.refused_by_command_policy() {
                    self.st.metrics.refusals += 1;
                }
                let mut text = tools::render_exec(&r, Some(limit));
                let turn = self.st.turn + 1;
                let mut outside = Vec::new();
                for c in &r.changes {
                    let rel = self.relative(&c.path).unwrap_or_else(|| c.path.clone());
                    if !self.scope.allows(&rel) {
                        outside.push(rel.clone());
                        self.st.out_of_scope.insert(rel.clone());
                    }
                    self.st.files_touched.insert(rel);
                }
                if !outside.is_empty() {
                    text.push_str(&format!(
                        "warning: this command changed files outside the contract's scope: {}. \
                         The verification gate refuses a result that changes them; undo it.\n",
                        outside.join(", ")
                    ));
                }
                let ok = r.exit_code == Some(0) && !r.timed_out;
                if !ok {
                    let first = text.lines().next().unwrap_or_default().to_owned();
                    self.st.failed_attempts.push(format!(
                        "turn {turn}: `{}`: {first}",
                        taskbox_core::commands::display_argv(&argv)
                    ));
                }
                (ok, text)
            }
            Ok(ExecOutcome::Background(p)) => (
                false,
                format!("the command went to the background as exec {}", p.exec_id),
            ),
            Err(e) => {
                self.sandbox_failed(&e);
                (false, tools::render_error(&e))
            }
        }
    }

    /// Closes a turn: checkpoint, record the workspace change, save the state.
    fn end_turn(&mut self, turn_started: Instant) -> Result<(), AgentError> {
        self.st.turn += 1;
        self.st.metrics.turns = self.st.turn;
        let t = Instant::now();
        let name = format!("agent-t{}-{}", self.st.turn, now_ms() % 1_000_000_000);
        match self
            .api
            .checkpoint(&self.id, CheckpointRequest { name: name.clone() })
        {
            Ok(_) => self.st.checkpoint = Some(name),
            Err(e) => tracing::warn!(error = %e, "cannot checkpoint the sandbox after a turn"),
        }
        if let Ok(d) = self.api.diff(&self.id, DiffRequest::default()) {
            self.st.workspace_patch = text_sections(&d.diff);
            self.st.binary_files = self.binary_contents(&d.files);
        }
        self.external += t.elapsed();
        self.st.metrics.wall_ms =
            self.st.elapsed_before_ms + self.started.elapsed().as_millis() as u64;
        let path = self.state_path();
        self.st
            .save(&path)
            .map_err(|e| io("write the state", &path, e))?;
        let checkpoint = self.st.checkpoint.clone();
        self.record(Record::TurnEnd {
            turn: self.st.turn,
            checkpoint,
        })?;
        let overhead = turn_started.elapsed().saturating_sub(self.external);
        self.overheads_us.push(overhead.as_micros() as u64);
        if let Some(o) = &self.opts.on_turn {
            o.turn_ended(&self.opts.task_dir, self.st.turn);
        }
        Ok(())
    }

    /// The binary files among a diff's (which its text cannot carry): their content, base64,
    /// or None when deleted. A file that cannot be read whole (over the cap) is left out, with
    /// a warning: a resume into a fresh sandbox would miss it.
    fn binary_contents(&self, files: &[FileDiff]) -> BTreeMap<String, Option<String>> {
        const CAP: u64 = 16 << 20;
        let mut out = BTreeMap::new();
        for f in files.iter().filter(|f| f.binary) {
            if f.status == ChangeKind::Deleted {
                out.insert(f.path.clone(), None);
                continue;
            }
            let read = self.api.read(
                &self.id,
                ReadRequest {
                    path: f.path.clone(),
                    max_bytes: Some(CAP),
                    ..ReadRequest::default()
                },
            );
            match read {
                Ok(r) if !r.truncated && r.encoding == "base64" => {
                    out.insert(f.path.clone(), Some(r.content));
                }
                Ok(_) => {
                    tracing::warn!(path = %f.path, "a binary file over 16 MiB is not kept for a resume")
                }
                Err(e) => {
                    tracing::warn!(path = %f.path, error = %e, "cannot keep a binary file for a resume")
                }
            }
        }
        out
    }

    /// Ends the task: the report, the final state, the last trace line.
    fn conclude(mut self, term: Termination, detail: String) -> Result<Report, AgentError> {
        tracing::info!(task = %self.st.task_id, termination = %term, detail = %detail, "task ended");
        self.st.termination = Some(term);
        self.st.metrics.wall_ms =
            self.st.elapsed_before_ms + self.started.elapsed().as_millis() as u64;
        let mut o = self.overheads_us.clone();
        o.sort_unstable();
        self.st.metrics.overhead_p50_us = o.get(o.len() / 2).copied().unwrap_or(0);
        let (diff, files) = match self.api.diff(&self.id, DiffRequest::default()) {
            Ok(d) => (d.diff, d.files.into_iter().map(|f| f.path).collect()),
            Err(_) => (self.st.workspace_patch.clone(), Vec::new()),
        };
        let report = Report {
            task_id: self.st.task_id.clone(),
            outcome: if term == Termination::Completed {
                "success".into()
            } else {
                "failure".into()
            },
            termination: term,
            detail: detail.clone(),
            goal: self.st.contract.goal.clone(),
            deliverables: self.st.contract.deliverables.clone(),
            summary: self.summary.clone(),
            model: self.st.model.clone(),
            sandbox: self.id.to_string(),
            workspace: self.st.workspace.clone(),
            diff,
            files_changed: files,
            verification: self.last_verify.clone(),
            approvals: self.st.approvals.clone(),
            metrics: self.st.metrics.clone(),
            trace: self.opts.task_dir.join(TRACE_FILE).display().to_string(),
            state: self.state_path().display().to_string(),
            attempts: None,
            subtasks: self.subtasks.clone(),
        };
        let dir = self.opts.task_dir.clone();
        let json = serde_json::to_vec_pretty(&report).map_err(|e| AgentError::Io(e.to_string()))?;
        std::fs::write(dir.join(REPORT_JSON), json)
            .map_err(|e| io("write the report", &dir.join(REPORT_JSON), e))?;
        std::fs::write(dir.join(REPORT_MD), report.to_markdown())
            .map_err(|e| io("write the report", &dir.join(REPORT_MD), e))?;
        let path = self.state_path();
        self.st
            .save(&path)
            .map_err(|e| io("write the state", &path, e))?;
        self.record(Record::End {
            termination: term.to_string(),
            detail,
        })?;
        Ok(report)
    }
}

/// Puts one pending approval to the approver and answers it through the API (so the answer is
/// recorded like any other).
fn answer_approval(
    api: &dyn SandboxApi,
    id: &SandboxId,
    approval: &Approval,
    approver: &dyn Approver,
) {
    // The exec registers the approval right after announcing it: wait until it is pending.
    let mut pending = false;
    for _ in 0..50 {
        match api.list_approvals(id, Some(Duration::from_millis(100))) {
            Ok(list) if list.iter().any(|a| a.id == approval.id) => {
                pending = true;
                break;
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => return,
        }
    }
    if !pending {
        return;
    }
    let result = match approver.decide(approval) {
        Decision::Approve => api.approve(id, &approval.id),
        Decision::Deny(reason) => api.deny(id, &approval.id, &reason),
        Decision::Defer => {
            tracing::info!(approval = %approval.id, "left pending for a person to answer through the API");
            return;
        }
    };
    if let Err(e) = result {
        tracing::warn!(approval = %approval.id, error = %e, "cannot answer an approval");
    }
}

/// The last `max` bytes of `text`, on a character boundary.
pub fn tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("[...]{}", &text[start..])
}

/// The label value that ties a sandbox to its task: the task directory's name.
fn task_label(task_dir: &Path) -> String {
    task_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "task".into())
}

/// A unified diff without its binary files' sections (`Binary files ... differ`), which a text
/// patch cannot apply; the state keeps those files' contents instead.
fn text_sections(diff: &str) -> String {
    let mut out = String::new();
    let mut section = String::new();
    let mut binary = false;
    let mut flush = |section: &mut String, binary: bool| {
        if !binary {
            out.push_str(section);
        }
        section.clear();
    };
    for line in diff.split_inclusive('\n') {
        if line.starts_with("diff --git ") {
            flush(&mut section, binary);
            binary = false;
        }
        if line.starts_with("Binary files ") || line.starts_with("GIT binary patch") {
            binary = true;
        }
        section.push_str(line);
    }
    flush(&mut section, binary);
    out
}
