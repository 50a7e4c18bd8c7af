//! The command policy, enforced over any backend, and the execs waiting for a person.
//!
//! [`CommandPolicy`] wraps a [`SandboxApi`] (like [`crate::trace::Traced`]) and checks every
//! exec against the `[commands]` rules of its sandbox's policy ([`crate::commands`]) before the
//! backend sees it:
//!
//! - `allow`: the exec runs as if there were no rules.
//! - `forbid`: nothing runs. The answer is an [`ExecResult`] with `exit_code` null, no signal,
//!   and one violation of kind `"command"` naming the command, the rule and what to change. (The
//!   CLI exits 126 for it, "found but not run".)
//! - `ask`: the exec waits as an [`Approval`] until a person answers through
//!   [`SandboxApi::approve`] or [`SandboxApi::deny`] (HTTP, CLI, or an MCP client's elicitation),
//!   or until the policy's `ask_timeout` passes, which denies it. Approved, it runs; denied, it
//!   returns a violation whose detail carries the person's reason, which the model sees. A
//!   streamed exec first sends an `approval` event. The wait does not count against the exec's
//!   own timeout.
//!
//! The rules of a sandbox are resolved from its policy when it is created (the policy is loaded
//! again by name and must still have the hash the sandbox was created with); a sandbox this
//! wrapper did not create is looked up the same way on first use, and refused with an error when
//! its policy can no longer be loaded unchanged. Destroying a sandbox denies its pending
//! approvals.
//!
//! Place it inside [`crate::trace::Traced`] (`Traced<CommandPolicy<B>>`): refused execs and
//! their violations, and every approve and deny, are then recorded in the trace.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::api::*;
use crate::commands::{Check, Commands, Verdict};
use crate::exec_limits;
use crate::policy;
use crate::result::ExecResult;
use crate::support::{lock, now_ms};

/// The longest denial reason kept (longer ones are cut): it goes into the model's context.
const MAX_REASON_BYTES: usize = 2048;

/// A [`SandboxApi`] that applies the command policy of each sandbox to its execs (see the module
/// docs).
pub struct CommandPolicy<B: SandboxApi> {
    inner: B,
    rules: Mutex<HashMap<SandboxId, Arc<SandboxRules>>>,
    queue: Queue,
}

impl<B: SandboxApi> std::fmt::Debug for CommandPolicy<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandPolicy").finish_non_exhaustive()
    }
}

/// The command rules of one sandbox and the policy they come from.
#[derive(Debug)]
struct SandboxRules {
    policy: String,
    commands: Commands,
}

impl<B: SandboxApi> CommandPolicy<B> {
    pub fn new(inner: B) -> CommandPolicy<B> {
        CommandPolicy {
            inner,
            rules: Mutex::new(HashMap::new()),
            queue: Queue::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Loads the command rules of a sandbox from its policy, which must still have the hash the
    /// sandbox was created with.
    fn load(info: &SandboxInfo) -> Result<SandboxRules, ApiError> {
        let (policy, _) = policy::resolve(&info.policy).map_err(|e| {
            ApiError::Conflict(format!(
                "cannot apply the command rules of sandbox {}: its policy cannot be loaded \
                 again: {e}",
                info.id
            ))
        })?;
        if policy.hash() != info.policy_hash {
            return Err(ApiError::Conflict(format!(
                "cannot apply the command rules of sandbox {}: policy {} changed since the \
                 sandbox was created; create a new sandbox",
                info.id, info.policy
            )));
        }
        Ok(SandboxRules {
            policy: info.policy.clone(),
            commands: policy.commands,
        })
    }

    fn rules_for(&self, id: &SandboxId) -> Result<Arc<SandboxRules>, ApiError> {
        if let Some(r) = lock(&self.rules).get(id) {
            return Ok(r.clone());
        }
        let info = self.inner.info(id)?;
        let rules = Arc::new(Self::load(&info)?);
        lock(&self.rules).insert(id.clone(), rules.clone());
        Ok(rules)
    }

    fn known(&self, id: &SandboxId) -> bool {
        lock(&self.rules).contains_key(id)
    }

    /// The answer to an exec that does not run: a violation and nothing else.
    fn refuse(
        &self,
        id: &SandboxId,
        started: Instant,
        detail: String,
        events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let info = self.inner.info(id)?;
        let result = ExecResult::refused(
            detail,
            started.elapsed().as_millis() as u64,
            info.enforcement,
        );
        if let Some(events) = events {
            events(ExecEvent::Ended {
                result: Box::new(result.clone()),
            });
        }
        Ok(ExecOutcome::Finished(result))
    }
}

/// Why a command was not run (see [`refusal_detail`]).
#[derive(Debug, Clone, Copy)]
pub enum Refusal<'a> {
    /// The rules forbid it; `policy` names the policy.
    Forbidden { policy: &'a str },
    /// It needed approval and a person (or the one-shot CLI, for want of one) denied it.
    Denied {
        reason: &'a str,
        approval: Option<&'a ApprovalId>,
    },
    /// It needed approval and no one answered in time.
    Expired {
        after: Duration,
        approval: Option<&'a ApprovalId>,
    },
}

/// The detail of the `command` violation for a refused command: what, which rule, and what to
/// do, in words a model can act on. The same text on every surface.
pub fn refusal_detail(check: &Check, refusal: Refusal<'_>) -> String {
    let asked = format!(
        "`{}` needs a person's approval ({})",
        check.command, check.reason
    );
    let which = |approval: Option<&ApprovalId>| match approval {
        Some(id) => format!(" (approval {id})"),
        None => String::new(),
    };
    match refusal {
        Refusal::Forbidden { policy } => match &check.rule {
            Some(rule) => format!(
                "`{}` is forbidden by the command policy (rule {rule} of policy {policy}); \
                 nothing was run. Do not retry it in another form; if it is needed, ask the user \
                 to run it or to change [commands] in the policy.",
                check.command
            ),
            None => format!(
                "`{}` is not allowed: {} (policy {policy}); nothing was run. Use an allowed \
                 command, or ask the user to allow this one in [commands] of the policy.",
                check.command, check.reason
            ),
        },
        Refusal::Denied { reason, approval } => format!(
            "{asked} and was denied: {reason}. Nothing was run{}.",
            which(approval)
        ),
        Refusal::Expired { after, approval } => format!(
            "{asked} and no one answered within {}, so it was denied. Nothing was run{}; ask \
             the user to approve it while it waits, or to run it themselves.",
            humantime::format_duration(after),
            which(approval)
        ),
    }
}

impl<B: SandboxApi> OpHandler for CommandPolicy<B> {
    fn handle_create(&self, mut req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        // The rules come from the policy the request resolved once, never from reading it again.
        let resolved = req.resolve_policy(PolicySources::Local)?;
        let info = self.inner.create(req)?;
        let rules = SandboxRules {
            policy: info.policy.clone(),
            commands: resolved.policy.commands.clone(),
        };
        lock(&self.rules).insert(info.id.clone(), Arc::new(rules));
        Ok(info)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.inner.list()
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        match op {
            Op::Exec { req, events } => self.exec_under_rules(id, req, events).map(Answer::Exec),
            Op::Destroy => {
                let r = self.inner.call(id, Op::Destroy);
                if r.is_ok() || matches!(r, Err(ApiError::SandboxNotFound(_))) {
                    lock(&self.rules).remove(id);
                    self.queue.cancel(id, "the sandbox was destroyed");
                }
                r
            }
            Op::ListApprovals { wait } => {
                self.rules_for(id)?;
                let pending = self.queue.pending(id, wait, || self.known(id));
                Ok(Answer::Approvals(pending))
            }
            Op::Approve { approval } => {
                self.rules_for(id)?;
                let answered = self.queue.answer(id, &approval, Reply::Approved)?;
                Ok(Answer::Approval(answered))
            }
            Op::Deny { approval, reason } => {
                self.rules_for(id)?;
                let answered =
                    self.queue
                        .answer(id, &approval, Reply::Denied(reason_kept(&reason)))?;
                Ok(Answer::Approval(answered))
            }
            Op::Fork(req) => {
                // A fork is under its parent's rules, whatever its policy's name resolves to now.
                let rules = self.rules_for(id)?;
                let forked = self.inner.fork(id, req)?;
                let mut known = lock(&self.rules);
                for f in &forked.sandboxes {
                    known.insert(f.id.clone(), rules.clone());
                }
                Ok(Answer::Fork(forked))
            }
            op => self.inner.call(id, op),
        }
    }
}

/// A denial's reason as it is kept: trimmed, never empty, at most [`MAX_REASON_BYTES`].
fn reason_kept(reason: &str) -> String {
    let mut reason = reason.trim().to_owned();
    if reason.is_empty() {
        reason = "no reason was given".to_owned();
    }
    if reason.len() > MAX_REASON_BYTES {
        let mut cut = MAX_REASON_BYTES;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        reason.push_str(" [...]");
    }
    reason
}

impl<B: SandboxApi> CommandPolicy<B> {
    /// An exec, checked against the sandbox's command rules first (see the module docs).
    fn exec_under_rules(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        mut events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let rules = self.rules_for(id)?;
        if !rules.commands.is_active() {
            return self.inner.exec(id, req, events);
        }
        // An invalid request is the backend's to refuse, with its own error.
        let Ok(argv) = req.resolved_argv() else {
            return self.inner.exec(id, req, events);
        };
        // Nor is a command no kernel would run (an argument over execve's per-string limit):
        // the backend refuses it naming the limit, and the shell reader never reads a line of
        // megabytes.
        let runnable = exec_limits::Command {
            argv: &argv,
            env: &[],
            shell: req.shell.is_some(),
            extra: &[],
        }
        .check(exec_limits::MAX_ARG_SPACE);
        if runnable.is_err() {
            return self.inner.exec(id, req, events);
        }
        let started = Instant::now();
        let check = rules.commands.check(&argv);
        match check.verdict {
            Verdict::Allow => self.inner.exec(id, req, events),
            Verdict::Forbid => {
                tracing::info!(sandbox = %id, command = %check.command, rule = ?check.rule, "command forbidden");
                let detail = refusal_detail(
                    &check,
                    Refusal::Forbidden {
                        policy: &rules.policy,
                    },
                );
                self.refuse(id, started, detail, events)
            }
            Verdict::Ask => {
                let timeout = rules.commands.ask_timeout;
                let now = now_ms();
                let approval = Approval {
                    id: ApprovalId::generate(),
                    sandbox: id.clone(),
                    argv,
                    command: check.command.clone(),
                    rule: check.rule.clone(),
                    reason: check.reason.clone(),
                    created_at_ms: now,
                    expires_at_ms: now.saturating_add(timeout.as_millis() as u64),
                    state: ApprovalState::Pending,
                    denial_reason: None,
                };
                tracing::info!(sandbox = %id, approval = %approval.id, command = %check.command, "exec waits for approval");
                if let Some(events) = events.as_mut() {
                    events(ExecEvent::Approval {
                        approval: Box::new(approval.clone()),
                    });
                }
                let approval_id = approval.id.clone();
                // Kept only for a streamed exec, to tell it how the approval ended.
                let mut answered = events.is_some().then(|| approval.clone());
                let answer = self.queue.wait(approval, timeout);
                if let (Some(events), Some(mut answered)) = (events.as_mut(), answered.take()) {
                    answer.apply(&mut answered);
                    events(ExecEvent::Answered {
                        approval: Box::new(answered),
                    });
                }
                match answer {
                    Reply::Approved => {
                        tracing::info!(sandbox = %id, approval = %approval_id, "approved; the exec runs");
                        self.inner.exec(id, req, events)
                    }
                    Reply::Denied(reason) => {
                        tracing::info!(sandbox = %id, approval = %approval_id, reason = %reason, "denied");
                        let detail = refusal_detail(
                            &check,
                            Refusal::Denied {
                                reason: &reason,
                                approval: Some(&approval_id),
                            },
                        );
                        self.refuse(id, started, detail, events)
                    }
                    Reply::Expired => {
                        tracing::info!(sandbox = %id, approval = %approval_id, "no answer; denied");
                        let detail = refusal_detail(
                            &check,
                            Refusal::Expired {
                                after: timeout,
                                approval: Some(&approval_id),
                            },
                        );
                        self.refuse(id, started, detail, events)
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The queue of pending approvals
// ---------------------------------------------------------------------------------------------

/// A person's answer to a pending approval (or its absence).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Approved,
    Denied(String),
    /// Nobody answered in time.
    Expired,
}

impl Reply {
    /// `approval` as this answer leaves it: its state, and a denial's reason.
    fn apply(&self, approval: &mut Approval) {
        match self {
            Reply::Approved => approval.state = ApprovalState::Approved,
            Reply::Denied(reason) => {
                approval.state = ApprovalState::Denied;
                approval.denial_reason = Some(reason.clone());
            }
            Reply::Expired => approval.state = ApprovalState::Expired,
        }
    }
}

#[derive(Debug)]
struct Entry {
    approval: Approval,
    answer: Option<Reply>,
}

/// Pending approvals of every sandbox. One condition variable signals every change: an exec
/// parked, answered or gone; the waiting execs and the long-polling lists wake on it.
#[derive(Debug, Default)]
struct Queue {
    entries: Mutex<HashMap<ApprovalId, Entry>>,
    changed: Condvar,
}

impl Queue {
    /// Parks `approval` until it is answered or `timeout` passes.
    fn wait(&self, approval: Approval, timeout: Duration) -> Reply {
        let id = approval.id.clone();
        let deadline = Instant::now() + timeout;
        let mut entries = lock(&self.entries);
        entries.insert(
            id.clone(),
            Entry {
                approval,
                answer: None,
            },
        );
        self.changed.notify_all();
        loop {
            let answered = entries.get(&id).and_then(|e| e.answer.clone());
            let now = Instant::now();
            if answered.is_some() || now >= deadline {
                entries.remove(&id);
                self.changed.notify_all();
                return answered.unwrap_or(Reply::Expired);
            }
            entries = self
                .changed
                .wait_timeout(entries, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }

    /// The pending approvals of `sandbox`, oldest first; with `wait`, blocks until there is one
    /// or `wait` passes (or `alive` says the sandbox is gone).
    fn pending(
        &self,
        sandbox: &SandboxId,
        wait: Option<Duration>,
        alive: impl Fn() -> bool,
    ) -> Vec<Approval> {
        let deadline = wait.map(|w| Instant::now() + w);
        let mut entries = lock(&self.entries);
        loop {
            let mut found: Vec<Approval> = entries
                .values()
                .filter(|e| e.approval.sandbox == *sandbox && e.answer.is_none())
                .map(|e| e.approval.clone())
                .collect();
            let now = Instant::now();
            let waiting = deadline.filter(|d| *d > now);
            match waiting {
                Some(deadline) if found.is_empty() && alive() => {
                    entries = self
                        .changed
                        .wait_timeout(entries, deadline - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|poisoned| poisoned.into_inner().0);
                }
                _ => {
                    found.sort_by(|a, b| {
                        (a.created_at_ms, a.id.as_str()).cmp(&(b.created_at_ms, b.id.as_str()))
                    });
                    return found;
                }
            }
        }
    }

    /// Answers a pending approval of `sandbox`; returns it as answered.
    fn answer(
        &self,
        sandbox: &SandboxId,
        id: &ApprovalId,
        answer: Reply,
    ) -> Result<Approval, ApiError> {
        let mut entries = lock(&self.entries);
        let entry = entries
            .get_mut(id)
            .filter(|e| e.approval.sandbox == *sandbox && e.answer.is_none())
            .ok_or_else(|| approval_not_found(sandbox, id))?;
        let mut approval = entry.approval.clone();
        answer.apply(&mut approval);
        entry.answer = Some(answer);
        self.changed.notify_all();
        Ok(approval)
    }

    /// Denies every pending approval of `sandbox`.
    fn cancel(&self, sandbox: &SandboxId, reason: &str) {
        let mut entries = lock(&self.entries);
        for e in entries.values_mut() {
            if e.approval.sandbox == *sandbox && e.answer.is_none() {
                e.answer = Some(Reply::Denied(reason.to_owned()));
            }
        }
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::result::Enforcement;
    use crate::result::{Output, Resources};

    /// A backend that only knows create, info, exec (counted) and destroy.
    #[derive(Default)]
    struct Fake {
        sandboxes: Mutex<HashMap<SandboxId, SandboxInfo>>,
        execs: AtomicUsize,
    }

    impl OpHandler for Fake {
        fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
            let name = req.policy.unwrap_or_else(|| "default".into());
            let (p, _) = policy::resolve(&name).map_err(|e| ApiError::invalid(e.to_string()))?;
            let info = SandboxInfo {
                id: SandboxId::generate(),
                backend: "fake".into(),
                workspace: req.workspace,
                policy: name,
                policy_hash: p.hash(),
                image: "host".into(),
                enforcement: Enforcement {
                    landlock: "full".into(),
                    seccomp: true,
                    network: "none".into(),
                    limits: "rlimit".into(),
                    disk: "none".into(),
                },
                labels: BTreeMap::new(),
                created_at_ms: 0,
                expires_at_ms: None,
                state: "running".into(),
                checkpoints: Vec::new(),
                lost_cause: None,
                forked_from: None,
            };
            lock(&self.sandboxes).insert(info.id.clone(), info.clone());
            Ok(info)
        }

        fn handle_list(&self) -> Vec<SandboxInfo> {
            lock(&self.sandboxes).values().cloned().collect()
        }

        fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
            let not_found = || ApiError::sandbox_not_found(id);
            let info = lock(&self.sandboxes).get(id).cloned();
            match op {
                Op::Info => info.map(Answer::Info).ok_or_else(not_found),
                Op::Exec { .. } => {
                    let info = info.ok_or_else(not_found)?;
                    self.execs.fetch_add(1, Ordering::SeqCst);
                    Ok(Answer::Exec(ExecOutcome::Finished(ExecResult {
                        exit_code: Some(0),
                        signal: None,
                        timed_out: false,
                        duration_ms: 1,
                        stdout: Output {
                            text: "ran\n".into(),
                            bytes: 4,
                            truncated: false,
                            spill_path: None,
                        },
                        stderr: Output::default(),
                        changes: Vec::new(),
                        violations: Vec::new(),
                        resources: Resources::default(),
                        enforcement: info.enforcement,
                        network: None,
                        findings: Vec::new(),
                        findings_omitted: 0,
                        tests: None,
                        ignored_changes: 0,
                    })))
                }
                Op::Destroy => lock(&self.sandboxes)
                    .remove(id)
                    .map(|_| Answer::Done)
                    .ok_or_else(not_found),
                op => Err(ApiError::internal(format!(
                    "{} is not in this fake",
                    op.name()
                ))),
            }
        }
    }

    struct Setup {
        _dir: tempfile::TempDir,
        api: Arc<CommandPolicy<Fake>>,
        id: SandboxId,
    }

    fn setup(commands: &str) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(&path, format!("[commands]\n{commands}\n")).unwrap();
        let api = Arc::new(CommandPolicy::new(Fake::default()));
        let info = api
            .create(CreateRequest {
                workspace: "/ws".into(),
                policy: Some(path.display().to_string()),
                ..CreateRequest::default()
            })
            .unwrap();
        Setup {
            _dir: dir,
            api,
            id: info.id,
        }
    }

    fn shell(s: &str) -> ExecRequest {
        ExecRequest {
            shell: Some(s.into()),
            ..ExecRequest::default()
        }
    }

    fn result(o: ExecOutcome) -> ExecResult {
        match o {
            ExecOutcome::Finished(r) => r,
            ExecOutcome::Background(_) => panic!("background"),
        }
    }

    /// Runs `req` on a thread; returns its handle once its approval is pending.
    fn parked(
        s: &Setup,
        req: ExecRequest,
    ) -> (
        std::thread::JoinHandle<Result<ExecOutcome, ApiError>>,
        Approval,
    ) {
        let api = s.api.clone();
        let id = s.id.clone();
        let h = std::thread::spawn(move || api.exec(&id, req, None));
        let pending = s
            .api
            .list_approvals(&s.id, Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(pending.len(), 1, "{pending:?}");
        (h, pending[0].clone())
    }

    #[test]
    fn forbid_refuses_without_running() {
        let s = setup("forbid = [\"git push\"]");
        let r = result(
            s.api
                .exec(&s.id, shell("true && git push origin"), None)
                .unwrap(),
        );
        assert_eq!(s.api.inner().execs.load(Ordering::SeqCst), 0);
        assert_eq!(r.exit_code, None);
        assert_eq!(r.signal, None);
        assert_eq!(r.violations.len(), 1);
        assert_eq!(r.violations[0].kind, "command");
        let d = &r.violations[0].detail;
        assert!(d.contains("`git push origin` is forbidden"), "{d}");
        assert!(d.contains("rule forbid \"git push\""), "{d}");
        assert!(d.contains("nothing was run"), "{d}");
        assert_eq!(r.cli_exit_status(), 126);
        // Allowed commands run.
        let r = result(s.api.exec(&s.id, shell("git status"), None).unwrap());
        assert_eq!(r.exit_code, Some(0));
    }

    #[test]
    fn a_command_no_kernel_would_run_is_left_to_the_backend_unread() {
        let s = setup("forbid = [\"git push\"]");
        // Over execve's per-string limit: the backend refuses it (the fake runs it), and the
        // policy does not read the megabyte line (it would forbid the git push in it).
        let line = format!("git push; echo {}", "x".repeat(1 << 20));
        let started = Instant::now();
        s.api.exec(&s.id, shell(&line), None).unwrap();
        assert_eq!(s.api.inner().execs.load(Ordering::SeqCst), 1);
        assert!(started.elapsed() < Duration::from_secs(1));
        // Within the limit the same command is read and forbidden.
        let r = result(s.api.exec(&s.id, shell("git push; echo x"), None).unwrap());
        assert!(r.refused_by_command_policy(), "{r:?}");
    }

    #[test]
    fn a_forbidden_stream_ends_with_the_result() {
        let s = setup("forbid = [\"rm\"]");
        let mut seen = Vec::new();
        let mut on = |e: ExecEvent| seen.push(e);
        s.api.exec(&s.id, shell("rm x"), Some(&mut on)).unwrap();
        assert!(
            matches!(seen.as_slice(), [ExecEvent::Ended { .. }]),
            "{seen:?}"
        );
    }

    #[test]
    fn ask_then_approve_runs() {
        let s = setup("ask = [\"git push\"]");
        let (h, a) = parked(&s, shell("git push"));
        assert_eq!(a.state, ApprovalState::Pending);
        assert_eq!(a.command, "git push");
        assert_eq!(a.rule.as_deref(), Some("ask \"git push\""));
        assert_eq!(a.argv, ["/bin/sh", "-c", "git push"]);
        assert!(a.expires_at_ms >= a.created_at_ms + 299_000);
        let answered = s.api.approve(&s.id, &a.id).unwrap();
        assert_eq!(answered.state, ApprovalState::Approved);
        let r = result(h.join().unwrap().unwrap());
        assert_eq!(r.exit_code, Some(0));
        assert_eq!(s.api.inner().execs.load(Ordering::SeqCst), 1);
        // Answered once: a second answer finds nothing.
        let e = s.api.approve(&s.id, &a.id).unwrap_err();
        assert_eq!(e.code(), "not_found");
        assert!(s.api.list_approvals(&s.id, None).unwrap().is_empty());
    }

    #[test]
    fn ask_then_deny_carries_the_reason() {
        let s = setup("ask = [\"git push\"]");
        let (h, a) = parked(&s, shell("git push"));
        let answered = s
            .api
            .deny(&s.id, &a.id, "  not before the review  ")
            .unwrap();
        assert_eq!(answered.state, ApprovalState::Denied);
        assert_eq!(
            answered.denial_reason.as_deref(),
            Some("not before the review")
        );
        let r = result(h.join().unwrap().unwrap());
        assert_eq!(r.exit_code, None);
        let d = &r.violations[0].detail;
        assert!(d.contains("was denied: not before the review"), "{d}");
        assert!(d.contains(a.id.as_str()), "{d}");
        assert_eq!(s.api.inner().execs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn ask_times_out_as_a_denial() {
        let s = setup("ask = [\"git push\"]\nask_timeout = \"200ms\"");
        let start = Instant::now();
        let r = result(s.api.exec(&s.id, shell("git push"), None).unwrap());
        assert!(start.elapsed() >= Duration::from_millis(200));
        let d = &r.violations[0].detail;
        assert!(d.contains("no one answered within 200ms"), "{d}");
        assert!(s.api.list_approvals(&s.id, None).unwrap().is_empty());
    }

    #[test]
    fn approvals_belong_to_their_sandbox() {
        let s = setup("ask = [\"git push\"]");
        let other = s
            .api
            .create(CreateRequest {
                workspace: "/ws".into(),
                policy: Some(s._dir.path().join("p.toml").display().to_string()),
                ..CreateRequest::default()
            })
            .unwrap()
            .id;
        let (h, a) = parked(&s, shell("git push"));
        assert!(s.api.list_approvals(&other, None).unwrap().is_empty());
        assert_eq!(
            s.api.approve(&other, &a.id).unwrap_err().code(),
            "not_found"
        );
        assert_eq!(
            s.api.deny(&other, &a.id, "x").unwrap_err().code(),
            "not_found"
        );
        let bogus = ApprovalId::parse("ap-nope").unwrap();
        assert_eq!(
            s.api.approve(&s.id, &bogus).unwrap_err().code(),
            "not_found"
        );
        s.api.approve(&s.id, &a.id).unwrap();
        h.join().unwrap().unwrap();
    }

    #[test]
    fn destroy_denies_pending_and_wakes_listeners() {
        let s = setup("ask = [\"git push\"]");
        let (h, _a) = parked(&s, shell("git push"));
        let api = s.api.clone();
        let id = s.id.clone();
        let listener = std::thread::spawn(move || {
            // Wait for the exec to be gone, then long-poll: destroy must end the wait.
            while !api
                .list_approvals(&id, None)
                .map(|l| l.is_empty())
                .unwrap_or(true)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            let start = Instant::now();
            let _ = api.list_approvals(&id, Some(Duration::from_secs(30)));
            start.elapsed()
        });
        s.api.destroy(&s.id).unwrap();
        let r = h.join().unwrap();
        // The exec was denied; answering it needs the sandbox, which is gone.
        match r {
            Ok(o) => assert!(result(o).violations[0].detail.contains("destroyed")),
            Err(e) => assert_eq!(e.code(), "sandbox_not_found"),
        }
        assert!(listener.join().unwrap() < Duration::from_secs(10));
        assert_eq!(
            s.api.list_approvals(&s.id, None).unwrap_err().code(),
            "sandbox_not_found"
        );
    }

    #[test]
    fn without_rules_nothing_changes() {
        let s = setup("");
        let r = result(
            s.api
                .exec(&s.id, shell("echo $(date) 'unclosed"), None)
                .unwrap(),
        );
        assert_eq!(r.exit_code, Some(0));
        let start = Instant::now();
        assert!(
            s.api
                .list_approvals(&s.id, Some(Duration::from_millis(50)))
                .unwrap()
                .is_empty()
        );
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn unknown_sandboxes_are_sandbox_not_found() {
        let s = setup("");
        let ghost = SandboxId::parse("sb-ghost").unwrap();
        assert_eq!(
            s.api.exec(&ghost, shell("true"), None).unwrap_err().code(),
            "sandbox_not_found"
        );
        assert_eq!(
            s.api.list_approvals(&ghost, None).unwrap_err().code(),
            "sandbox_not_found"
        );
    }

    #[test]
    fn a_changed_policy_is_refused() {
        let s = setup("forbid = [\"rm\"]");
        // Forget the cached rules, then change the policy file behind the sandbox's back.
        lock(&s.api.rules).clear();
        std::fs::write(
            s._dir.path().join("p.toml"),
            "[commands]\nforbid = [\"ls\"]\n",
        )
        .unwrap();
        let e = s.api.exec(&s.id, shell("rm x"), None).unwrap_err();
        assert_eq!(e.code(), "conflict");
        assert!(
            e.to_string()
                .contains("changed since the sandbox was created"),
            "{e}"
        );
    }
}
