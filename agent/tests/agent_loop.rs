//! The agent loop end to end: a scripted model server speaking the real OpenAI or Anthropic
//! protocol over HTTP drives the loop against a real native sandbox.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use taskbox_agent::agent::CONTINUE_PROMPT;
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_agent::{Approver, Decision, Termination};
use taskbox_core::api::{Approval, ReadRequest, SandboxId};

#[test]
fn fixes_a_failing_test_with_an_openai_model() {
    let fx = Fx::new();
    let mock = MockServer::start(Provider::Openai, fixing_steps()).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());

    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.outcome, "success");
    assert_eq!(report.verification.len(), 1);
    assert_eq!(report.verification[0].exit_code, Some(0));
    assert!(report.verification[0].output_tail.contains("ok"));
    assert!(
        report.diff.contains("+add() { echo $(( $1 + $2 )); }"),
        "{}",
        report.diff
    );
    assert_eq!(report.files_changed, ["src/math.sh"]);
    let m = &report.metrics;
    assert_eq!(m.turns, 4);
    assert_eq!(m.tool_calls, 4);
    assert_eq!(m.first_attempt_verification_pass, Some(true));
    assert!(m.tokens_in > 0 && m.tokens_out == 80, "{m:?}");
    assert_eq!(
        report.summary.as_deref(),
        Some("add used subtraction; now it adds")
    );
    // The host copy is untouched: the change lives in the sandbox.
    assert_eq!(
        std::fs::read_to_string(fx.env.ws().join("src/math.sh")).unwrap(),
        BUGGY
    );

    // What the harness sent: the system prompt with the contract and the repository's rules,
    // the ten tools, then each observation.
    let got = mock.received();
    assert_eq!(got.len(), 4);
    assert_eq!(got[0].header("authorization"), Some("Bearer test-key"));
    let first = &got[0].body;
    assert_eq!(first["model"], "mock-model");
    assert_eq!(first["tools"].as_array().unwrap().len(), 10);
    let system = messages(first)[0]["content"].as_str().unwrap();
    assert!(
        system.contains("Goal: make tests/test_math.sh pass"),
        "{system}"
    );
    assert!(
        system.contains("Use POSIX sh only."),
        "rules injected: {system}"
    );
    assert!(system.contains("`sh tests/test_math.sh`"), "{system}");
    assert_eq!(
        messages(first)[1]["content"],
        "Task: make tests/test_math.sh pass"
    );
    assert!(
        last_content(&got[1].body).contains(BUGGY.trim()),
        "read observation"
    );
    assert!(last_content(&got[2].body).contains("+add() { echo $(( $1 + $2 )); }"));
    let exec_obs = last_content(&got[3].body);
    assert!(exec_obs.starts_with("exit_code: 0"), "{exec_obs}");
    assert!(exec_obs.contains("stdout:\nok"), "{exec_obs}");
    // The tool call and its result are paired by id.
    let msgs = messages(&got[1].body);
    assert_eq!(
        msgs[2]["tool_calls"][0]["id"], msgs[3]["tool_call_id"],
        "{msgs:#?}"
    );

    // The report, trace and state are on disk.
    let md = std::fs::read_to_string(fx.task_dir.join("report.md")).unwrap();
    assert!(md.contains("success (`completed`)"), "{md}");
    assert!(
        md.contains("`sh tests/test_math.sh`: passed (exit code 0"),
        "{md}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fx.task_dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["termination"], "completed");
    assert_eq!(json["metrics"]["first_attempt_verification_pass"], true);
    let trace = taskbox_agent::trajectory::read(&fx.task_dir.join("trace.jsonl")).unwrap();
    let tools = trace
        .iter()
        .filter(|r| matches!(r, taskbox_agent::trajectory::Record::Tool { .. }))
        .count();
    assert_eq!(tools, 4);
    let state = taskbox_agent::state::TaskState::load(&fx.task_dir.join("state.json")).unwrap();
    assert_eq!(state.termination, Some(Termination::Completed));
    assert!(state.files_touched.contains("src/math.sh"));
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(fx.task_dir.join("state.json"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(
        mode & 0o777,
        0o600,
        "the state holds the conversation unmasked"
    );
}

#[test]
fn fixes_a_failing_test_with_an_anthropic_model() {
    let fx = Fx::new();
    let steps = vec![
        Step::calls(vec![
            ("list", json!({"path": "src"})),
            (
                "edit_file",
                json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
            ),
        ]),
        Step::call("finish", json!({"summary": "fixed add"})),
    ];
    let mock = MockServer::start(Provider::Anthropic, steps).unwrap();
    let report = fx.run(&mock, Provider::Anthropic, fx.contract());
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.turns, 2);
    assert_eq!(report.metrics.tool_calls, 3);

    let got = mock.received();
    assert_eq!(got[0].path, "/v1/messages");
    assert_eq!(got[0].header("x-api-key"), Some("test-key"));
    assert_eq!(got[0].header("anthropic-version"), Some("2023-06-01"));
    assert!(got[0].body["system"].as_str().unwrap().contains("Goal:"));
    assert_eq!(got[0].body["tools"][0]["input_schema"]["type"], "object");
    // Both results of the first turn come back in one user message, as tool_result blocks.
    let msgs = got[1].body["messages"].as_array().unwrap();
    let results = msgs.last().unwrap();
    assert_eq!(results["role"], "user");
    let blocks = results["content"].as_array().unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0]["type"], "tool_result");
    assert!(
        blocks[0]["content"]
            .as_str()
            .unwrap()
            .contains("src/math.sh")
    );
    assert_eq!(blocks[1]["tool_use_id"], msgs[1]["content"][1]["id"]);
}

#[test]
fn a_bad_tool_argument_is_answered_with_a_validation_message_and_corrected() {
    let fx = Fx::new();
    let mut steps = vec![Step::raw_call("read_file", r#"{"file": "src/math.sh"}"#)];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.validation_errors, 1);
    let got = mock.received();
    let msg = last_content(&got[1].body);
    assert!(
        msg.contains("invalid arguments for read_file: unknown field `file`"),
        "{msg}"
    );
    // The corrected call went through.
    assert!(last_content(&got[2].body).contains(BUGGY.trim()));
}

#[test]
fn an_edit_outside_the_scope_is_refused() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.scope = vec!["src/".into()];
    let mut steps = vec![
        Step::call(
            "write_file",
            json!({"path": "tests/test_math.sh", "content": "exit 0\n"}),
        ),
        Step::call(
            "apply_patch",
            json!({"patch": "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-A tiny calculator.\n+Changed.\n"}),
        ),
    ];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.refusals, 2);
    let got = mock.received();
    let msg = last_content(&got[1].body);
    assert!(
        msg.contains("refused by the work contract: tests/test_math.sh is outside the scope"),
        "{msg}"
    );
    assert!(last_content(&got[2].body).contains("README.md is outside the scope"));
    assert_eq!(
        report.files_changed,
        ["src/math.sh"],
        "nothing outside the scope changed"
    );
}

#[test]
fn a_command_changing_files_outside_the_scope_fails_the_gate() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.scope = vec!["src/".into()];
    contract.budget.max_verify_attempts = 1;
    let steps = vec![
        Step::call("exec", json!({"command": "echo hacked > README.md"})),
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        Step::call("finish", json!({"summary": "done"})),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    let got = mock.received();
    assert!(
        last_content(&got[1].body)
            .contains("changed files outside the contract's scope: README.md")
    );
    assert_eq!(
        report.termination,
        Termination::VerificationFailed,
        "{report:#?}"
    );
    assert!(report.detail.contains("failed 1 time"), "{}", report.detail);
}

#[test]
fn forbidden_commands_are_refused_by_the_contract_and_by_the_policy() {
    let fx = Fx::new();
    let policy = fx.env.policy("rules", "[commands]\nforbid = [\"curl\"]\n");
    let mut contract = fx.contract();
    contract.forbidden = vec!["git push".into()];
    let mut steps = vec![
        Step::call("exec", json!({"command": "git push origin main"})),
        Step::call(
            "exec",
            json!({"command": "echo start > started.txt; curl http://example.com"}),
        ),
    ];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut spec = fx.spec(contract);
    spec.policy = Some(policy.display().to_string());
    let model = model_config(&mock, Provider::Openai).build().unwrap();
    let report = taskbox_agent::start(fx.api.clone(), model, spec, fx.options()).unwrap();
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.refusals, 2);
    let got = mock.received();
    let by_contract = last_content(&got[1].body);
    assert!(
        by_contract.contains("refused by the work contract: `git push origin main` is forbidden"),
        "{by_contract}"
    );
    let by_policy = last_content(&got[2].body);
    assert!(by_policy.contains("violation (command)"), "{by_policy}");
    assert!(by_policy.contains("forbidden"), "{by_policy}");
    assert!(
        !report.files_changed.iter().any(|f| f == "started.txt"),
        "nothing ran"
    );
}

struct Answer(Decision);
impl Approver for Answer {
    fn decide(&self, approval: &Approval) -> Decision {
        assert!(approval.command.contains("touch"), "{approval:?}");
        self.0.clone()
    }
}

#[test]
fn an_ask_goes_to_the_approver_and_its_answer_reaches_the_model() {
    for (decision, expect_file) in [
        (Decision::Deny("not today".into()), false),
        (Decision::Approve, true),
    ] {
        let fx = Fx::new();
        let policy = fx.env.policy("ask", "[commands]\nask = [\"touch\"]\n");
        let mut steps = vec![Step::call("exec", json!({"command": "touch approved.txt"}))];
        steps.extend(fixing_steps());
        let mock = MockServer::start(Provider::Openai, steps).unwrap();
        let mut spec = fx.spec(fx.contract());
        spec.policy = Some(policy.display().to_string());
        let mut opts = fx.options();
        opts.approver = Arc::new(Answer(decision.clone()));
        let model = model_config(&mock, Provider::Openai).build().unwrap();
        let report = taskbox_agent::start(fx.api.clone(), model, spec, opts).unwrap();
        assert_eq!(report.termination, Termination::Completed, "{report:#?}");
        assert_eq!(report.metrics.approvals_asked, 1);
        let obs = last_content(&mock.received()[1].body);
        if expect_file {
            assert!(obs.starts_with("exit_code: 0"), "{obs}");
        } else {
            assert!(obs.contains("not today"), "{obs}");
        }
        assert_eq!(
            report.files_changed.iter().any(|f| f == "approved.txt"),
            expect_file,
            "{decision:?}: {:?}",
            report.files_changed
        );
    }
}

#[test]
fn verification_failed_when_the_gate_keeps_failing() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.budget.max_verify_attempts = 2;
    let steps = vec![
        Step::call("finish", json!({"summary": "I think it works"})),
        Step::text("It really works now."),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(
        report.termination,
        Termination::VerificationFailed,
        "{report:#?}"
    );
    assert_eq!(report.outcome, "failure");
    assert_eq!(report.metrics.first_attempt_verification_pass, Some(false));
    assert_eq!(report.metrics.verification_runs, 2);
    assert_eq!(report.verification[0].exit_code, Some(1));
    assert!(
        report.verification[0]
            .output_tail
            .contains("FAIL: add 2 3 gave -1")
    );
    // The first failure went back to the model with the command's output.
    let obs = last_content(&mock.received()[1].body);
    assert!(
        obs.contains("verification failed (attempt 1 of 2)"),
        "{obs}"
    );
    assert!(obs.contains("FAIL: add 2 3 gave -1, want 5"), "{obs}");
}

#[test]
fn a_failed_verification_shows_its_findings_first_and_the_report_lists_them() {
    let fx = Fx::new();
    // A verification whose test runner reports one failing test in the middle of a long log:
    // the tail the model gets cannot show it, the findings do.
    let mut log = String::new();
    for i in 0..3000 {
        log.push_str(&format!("test calc::tests::case_{i:04} ... ok\n"));
    }
    log.push_str(
        "test calc::tests::adds_two ... FAILED\n\nfailures:\n\n\
         ---- calc::tests::adds_two stdout ----\n\n\
         thread 'calc::tests::adds_two' panicked at src/calc.rs:12:9:\n\
         assertion `left == right` failed\n  left: 3\n right: 4\n\n\
         failures:\n    calc::tests::adds_two\n\n\
         test result: FAILED. 3000 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; \
         finished in 0.02s\n",
    );
    for i in 0..3000 {
        log.push_str(&format!("test other::tests::case_{i:04} ... ok\n"));
    }
    log.push_str(
        "\ntest result: ok. 3000 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; \
         finished in 0.02s\n",
    );
    fx.env.write("test.log", &log);
    let mut contract = fx.contract();
    contract.verify = vec!["cat test.log; exit 101".into()];
    contract.budget.max_verify_attempts = 2;
    let steps = vec![
        Step::call("finish", json!({"summary": "done"})),
        Step::call("finish", json!({"summary": "done again"})),
        Step::text("giving up"),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::VerificationFailed);
    let v = &report.verification[0];
    assert_eq!(v.findings.len(), 1, "{v:#?}");
    assert_eq!(v.findings[0].name.as_deref(), Some("calc::tests::adds_two"));
    let loc = v.findings[0].location.as_ref().unwrap();
    assert_eq!((loc.file.as_str(), loc.line), ("src/calc.rs", Some(12)));
    assert_eq!(v.tests.map(|t| (t.passed, t.failed)), Some((6000, 1)));
    assert!(
        !v.output_tail.contains("adds_two"),
        "the tail alone misses it"
    );
    // The model saw it first, with its location.
    let obs = last_content(&mock.received()[1].body);
    let at = obs
        .find("src/calc.rs:12")
        .unwrap_or_else(|| panic!("{obs}"));
    assert!(
        at < obs.find("test other::tests").unwrap_or(usize::MAX),
        "{obs}"
    );
    // The report lists it under its verification command.
    let md = report.to_markdown();
    assert!(
        md.contains("src/calc.rs:12:9 calc::tests::adds_two"),
        "{md}"
    );
}

#[test]
fn max_turns_ends_the_task() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.budget.max_turns = 2;
    let steps = vec![Step::call("list", json!({})); 5];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::MaxTurns, "{report:#?}");
    assert_eq!(report.metrics.turns, 2);
    assert_eq!(mock.received().len(), 2);
}

#[test]
fn the_time_budget_ends_the_task_and_a_timeout_comes_with_a_hint() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.budget.time = Duration::from_millis(1500);
    let steps = vec![
        Step::call("exec", json!({"command": "sleep 5"})),
        Step::call("list", json!({})),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let started = Instant::now();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::TimeBudget, "{report:#?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the exec was cut at the budget"
    );
    let trace = std::fs::read_to_string(fx.task_dir.join("trace.jsonl")).unwrap();
    assert!(trace.contains("hint: narrow the command"), "{trace}");
}

#[test]
fn the_cost_budget_ends_the_task() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.budget.max_cost_usd = Some(0.01);
    let steps = vec![
        Step::call("list", json!({})).with_usage(1000, 100),
        Step::call("list", json!({})).with_usage(1000, 100),
        Step::call("list", json!({})).with_usage(1000, 100),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut cfg = model_config(&mock, Provider::Openai);
    cfg.price_input_per_mtok = 3.0;
    cfg.price_output_per_mtok = 15.0;
    // 1000 * 3 / 1e6 + 100 * 15 / 1e6 = $0.0045 per call: the third call would pass $0.01.
    let report = taskbox_agent::start(
        fx.api.clone(),
        cfg.build().unwrap(),
        fx.spec(contract),
        fx.options(),
    )
    .unwrap();
    assert_eq!(report.termination, Termination::CostBudget, "{report:#?}");
    assert_eq!(report.metrics.turns, 3);
    assert!(
        (report.metrics.cost_usd - 0.0135).abs() < 1e-9,
        "{:?}",
        report.metrics
    );
    assert_eq!(report.metrics.tokens_in, 3000);
}

#[test]
fn an_unrecoverable_model_error_ends_the_task() {
    let fx = Fx::new();
    let steps = vec![
        Step::call("list", json!({})),
        Step::status(500, None),
        Step::status(500, None),
        Step::status(500, None),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(
        report.termination,
        Termination::UnrecoverableError,
        "{report:#?}"
    );
    assert!(
        report.detail.contains("HTTP 500 after 3 attempts"),
        "{}",
        report.detail
    );
    assert_eq!(report.metrics.turns, 1);
}

#[test]
fn cancelling_ends_the_task_at_the_next_step() {
    let fx = Fx::new();
    let steps = vec![
        Step::call("list", json!({})).delayed(Duration::from_millis(300)),
        Step::call("list", json!({})),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let opts = fx.options();
    let cancel = opts.cancel.clone();
    let report = std::thread::scope(|scope| {
        scope.spawn(|| {
            // Cancel while the first model call is in flight.
            let until = Instant::now() + Duration::from_secs(20);
            while mock.received().is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            cancel.store(true, Ordering::SeqCst);
        });
        fx.run_with(&mock, Provider::Openai, fx.contract(), opts)
    });
    assert_eq!(report.termination, Termination::Cancelled, "{report:#?}");
    assert_eq!(mock.received().len(), 1);
    assert_eq!(
        report.metrics.turns, 1,
        "the turn in flight was completed first"
    );
}

#[test]
fn an_interrupt_ends_the_task_during_a_model_call() {
    let fx = Fx::new();
    // The model would take a minute to answer.
    let steps = vec![Step::call("list", json!({})).delayed(Duration::from_secs(60))];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let opts = fx.options();
    let interrupt = opts.interrupt.clone();
    let started = Instant::now();
    let report = std::thread::scope(|scope| {
        scope.spawn(|| {
            let until = Instant::now() + Duration::from_secs(20);
            while mock.received().is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            interrupt.store(true, Ordering::SeqCst);
        });
        fx.run_with(&mock, Provider::Openai, fx.contract(), opts)
    });
    assert_eq!(report.termination, Termination::Cancelled, "{report:#?}");
    assert!(
        report.detail.contains("during a model call"),
        "{}",
        report.detail
    );
    assert_eq!(report.metrics.turns, 0);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_length_cut_is_continued() {
    let fx = Fx::new();
    let mut steps = vec![Step::cut("The bug is in add: it subtra")];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.continuations, 1);
    let got = mock.received();
    let msgs = messages(&got[1].body);
    let n = msgs.len();
    assert_eq!(msgs[n - 2]["role"], "assistant");
    assert_eq!(msgs[n - 2]["content"], "The bug is in add: it subtra");
    assert_eq!(msgs[n - 1]["content"], CONTINUE_PROMPT);
}

#[test]
fn a_429_is_retried_after_retry_after_then_succeeds() {
    let fx = Fx::new();
    let mut steps = vec![Step::status(429, Some("1")), Step::status(503, None)];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let started = Instant::now();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After: 1 was honoured"
    );
    assert_eq!(report.metrics.model_retries, 2);
    let got = mock.received();
    assert_eq!(got.len(), 6);
    assert_eq!(got[0].body, got[2].body, "the same request was sent again");
}

#[test]
fn plan_first_refuses_edits_before_a_plan_and_a_person_can_reject_it() {
    struct Reviewer(std::sync::Mutex<u32>);
    impl taskbox_agent::PlanReviewer for Reviewer {
        fn review(&self, plan: &taskbox_agent::state::Plan) -> Decision {
            let mut n = self.0.lock().unwrap();
            *n += 1;
            if *n == 1 {
                Decision::Deny(format!("{} step(s) is too vague", plan.steps.len()))
            } else {
                Decision::Approve
            }
        }
    }
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.plan_first = true;
    let edit = Step::call(
        "edit_file",
        json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
    );
    let steps = vec![
        edit.clone(),
        Step::call("plan", json!({"steps": ["fix it"]})),
        edit.clone(),
        Step::call(
            "plan",
            json!({"steps": ["change - to + in add", "run the test"], "files": ["src/math.sh"]}),
        ),
        edit,
        Step::call("finish", json!({"summary": "fixed"})),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut opts = fx.options();
    opts.plan_reviewer = Some(Arc::new(Reviewer(std::sync::Mutex::new(0))));
    let report = fx.run_with(&mock, Provider::Openai, contract, opts);
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    let got = mock.received();
    assert!(last_content(&got[1].body).contains("submit a plan first"));
    assert!(
        last_content(&got[2].body).contains("plan rejected by a person: 1 step(s) is too vague")
    );
    assert!(last_content(&got[3].body).contains("submit a plan first"));
    assert!(last_content(&got[4].body).contains("plan approved"));
    assert!(last_content(&got[5].body).contains("edited src/math.sh"));
    assert_eq!(report.metrics.refusals, 2);
}

#[test]
fn resume_continues_a_task_from_its_last_completed_turn() {
    // A model that crashes the harness (as a kill would) on its third call.
    struct Crash {
        inner: Box<dyn taskbox_agent::model::Model>,
        calls: u32,
    }
    impl taskbox_agent::model::Model for Crash {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn complete(
            &mut self,
            req: &taskbox_agent::model::ModelRequest,
        ) -> Result<taskbox_agent::model::ModelResponse, taskbox_agent::model::ModelError> {
            self.calls += 1;
            if self.calls == 3 {
                panic!("simulated crash of the harness");
            }
            self.inner.complete(req)
        }
    }
    for sandbox_survives in [true, false] {
        let fx = Fx::new();
        let steps = vec![
            Step::call(
                "write_file",
                json!({"path": "notes.txt", "content": "turn one\n"}),
            ),
            // A binary file, which a text patch cannot carry into a fresh sandbox.
            Step::call(
                "exec",
                json!({"command": "printf 'a\\000b\\377' > data.bin"}),
            ),
            Step::call(
                "edit_file",
                json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
            ),
            Step::call("exec", json!({"command": "sh tests/test_math.sh"})),
            Step::call("finish", json!({"summary": "fixed after a resume"})),
        ];
        let mock = MockServer::start(Provider::Openai, steps).unwrap();
        let model = Box::new(Crash {
            inner: model_config(&mock, Provider::Openai).build().unwrap(),
            calls: 0,
        });
        let api = fx.api.clone();
        let spec = fx.spec(fx.contract());
        let opts = fx.options();
        let crashed =
            std::thread::spawn(move || taskbox_agent::start(api, model, spec, opts)).join();
        assert!(crashed.is_err(), "the harness crashed");
        let state = taskbox_agent::state::TaskState::load(&fx.task_dir.join("state.json")).unwrap();
        assert_eq!(state.turn, 2);
        assert_eq!(state.termination, None);
        assert_eq!(
            state.binary_files.get("data.bin"),
            Some(&Some("YQBi/w==".to_owned()))
        );
        assert!(!state.workspace_patch.contains("data.bin"));
        let old = SandboxId::parse(&state.sandbox).unwrap();
        if sandbox_survives {
            // What the interrupted turn had begun: the checkpoint restore must undo it.
            fx.api
                .write(
                    &old,
                    taskbox_core::api::WriteRequest {
                        path: "half-done.txt".into(),
                        content: "x".into(),
                        ..Default::default()
                    },
                )
                .unwrap();
        } else {
            fx.api.destroy(&old).unwrap();
        }
        let model = model_config(&mock, Provider::Openai).build().unwrap();
        let report = taskbox_agent::resume(fx.api.clone(), model, fx.options()).unwrap();
        assert_eq!(report.termination, Termination::Completed, "{report:#?}");
        assert_eq!(report.metrics.turns, 5);
        assert_eq!(report.metrics.tool_calls, 5);
        let mut files = report.files_changed.clone();
        files.sort();
        assert_eq!(
            files,
            ["data.bin", "notes.txt", "src/math.sh"],
            "survives: {sandbox_survives}"
        );
        let id = SandboxId::parse(&report.sandbox).unwrap();
        assert_eq!(id == old, sandbox_survives);
        let notes = fx
            .api
            .read(
                &id,
                ReadRequest {
                    path: "notes.txt".into(),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(notes.content, "turn one\n");
        let data = fx
            .api
            .read(
                &id,
                ReadRequest {
                    path: "data.bin".into(),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            (data.encoding.as_str(), data.content.as_str()),
            ("base64", "YQBi/w=="),
            "survives: {sandbox_survives}"
        );
        let trace = std::fs::read_to_string(fx.task_dir.join("trace.jsonl")).unwrap();
        assert!(trace.contains("\"type\":\"resume\""));
        // The resumed request carried the whole conversation of the first two turns.
        let got = mock.received();
        assert_eq!(messages(&got[2].body).len(), 6);
    }
}

#[test]
fn replay_matches_the_original_and_reports_a_divergence() {
    let fx = Fx::new();
    let mut steps = vec![Step::raw_call("read_file", "{}")];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let original = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(original.termination, Termination::Completed);
    let trace = fx.task_dir.join("trace.jsonl");

    // No model server at all: the responses come from the trace.
    drop(mock);
    let dir = fx.env.dir.path().join("replay-1");
    let r = taskbox_agent::replay::replay(fx.api.clone(), &trace, dir.clone(), None).unwrap();
    assert!(r.matched, "{}", r.render());
    assert_eq!(r.compared, 5);
    assert_eq!(r.replay_termination, "completed");
    assert_ne!(
        std::fs::read_to_string(dir.join("state.json")).unwrap(),
        "",
        "the replay has its own state"
    );
    let replayed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_ne!(
        replayed["sandbox"].as_str(),
        Some(original.sandbox.as_str()),
        "a fresh sandbox"
    );

    // The repository changed under the recording: the replay says where it diverges.
    fx.env
        .write("src/math.sh", "add() { echo $(( $1 - $2 )) ; }\n");
    let dir = fx.env.dir.path().join("replay-2");
    let r = taskbox_agent::replay::replay(fx.api.clone(), &trace, dir, None).unwrap();
    assert!(!r.matched, "{}", r.render());
    let d = r.divergence.as_ref().unwrap();
    assert_eq!(d.index, 2, "{}", r.render());
    assert_eq!(d.tool, "read_file");
    assert!(r.render().contains("DIVERGES"));
}

/// Answers by file name: `a` approved, `b` denied, anything else left to expire.
struct ByFile;
impl Approver for ByFile {
    fn decide(&self, approval: &Approval) -> Decision {
        if approval.command.contains("a.txt") {
            Decision::Approve
        } else if approval.command.contains("b.txt") {
            Decision::Deny("not b".into())
        } else {
            Decision::Defer
        }
    }
}

/// The approval records of a trace: (command, state, denial reason).
fn approvals_in(trace: &std::path::Path) -> Vec<(String, String, Option<String>)> {
    std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["type"] == "approval")
        .map(|r| {
            (
                r["command"].as_str().unwrap_or_default().to_owned(),
                r["state"].as_str().unwrap_or_default().to_owned(),
                r["denial_reason"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

#[test]
fn replay_answers_the_approvals_as_they_were_answered() {
    let fx = Fx::new();
    let policy = fx.env.policy(
        "ask",
        "[commands]\nask = [\"touch\"]\nask_timeout = \"1s\"\n",
    );
    let mut steps = vec![
        Step::call("exec", json!({"command": "touch a.txt"})),
        Step::call("exec", json!({"command": "touch b.txt"})),
        Step::call("exec", json!({"command": "touch c.txt"})),
    ];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut spec = fx.spec(fx.contract());
    spec.policy = Some(policy.display().to_string());
    let mut opts = fx.options();
    opts.approver = Arc::new(ByFile);
    let model = model_config(&mock, Provider::Openai).build().unwrap();
    let report = taskbox_agent::start(fx.api.clone(), model, spec, opts).unwrap();
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.approvals_asked, 3);
    let trace = fx.task_dir.join("trace.jsonl");
    let recorded = approvals_in(&trace);
    assert_eq!(
        recorded,
        vec![
            ("touch a.txt".to_owned(), "approved".to_owned(), None),
            (
                "touch b.txt".to_owned(),
                "denied".to_owned(),
                Some("not b".to_owned())
            ),
            ("touch c.txt".to_owned(), "expired".to_owned(), None),
        ]
    );
    let got = mock.received();
    assert!(last_content(&got[3].body).contains("no one answered within 1s"));
    drop(mock);
    // The handoff report lists them for the person who reviews the task.
    assert_eq!(report.approvals.len(), 3, "{:?}", report.approvals);
    let md = std::fs::read_to_string(fx.task_dir.join("report.md")).unwrap();
    for line in [
        "- turn 1: `touch a.txt`: approved",
        "- turn 2: `touch b.txt`: denied: not b",
        "- turn 3: `touch c.txt`: no one answered in time (denied)",
    ] {
        assert!(md.contains(line), "{line:?} not in:\n{md}");
    }

    // The replay's approver is the recording: the same answers, the same observations (before,
    // the replay denied every ask for want of a person and diverged at the first).
    let dir = fx.env.dir.path().join("replay");
    let r = taskbox_agent::replay::replay(fx.api.clone(), &trace, dir.clone(), None).unwrap();
    assert!(r.matched, "{}", r.render());
    assert_eq!(r.compared, 7);
    assert_eq!(approvals_in(&dir.join("trace.jsonl")), recorded);

    // A recording whose answer was for another command does not answer this one.
    let edited = fx.env.dir.path().join("edited.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| {
            let mut r: serde_json::Value = serde_json::from_str(l).unwrap();
            if r["type"] == "approval" && r["command"] == "touch a.txt" {
                r["command"] = "touch z.txt".into();
            }
            r.to_string()
        })
        .collect();
    std::fs::write(&edited, lines.join("\n") + "\n").unwrap();
    let r = taskbox_agent::replay::replay(
        fx.api.clone(),
        &edited,
        fx.env.dir.path().join("replay-edited"),
        None,
    )
    .unwrap();
    assert!(!r.matched, "{}", r.render());
    let d = r.divergence.as_ref().unwrap();
    assert_eq!(d.index, 1, "{}", r.render());
    assert!(d.actual.contains("touch z.txt"), "{}", r.render());
}

#[test]
fn eval_runs_the_three_sample_tasks_and_prints_the_table() {
    let fx = Fx::new();
    let tasks = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tasks");
    let scripts = vec![
        (
            "src/math.sh so that".to_owned(),
            vec![
                Step::call(
                    "edit_file",
                    json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
                ),
                Step::call("finish", json!({"summary": "fixed add"})),
            ],
        ),
        (
            "greeting typo".to_owned(),
            vec![
                Step::call(
                    "edit_file",
                    json!({"path": "greet.sh", "old": "Helo", "new": "Hello"}),
                ),
                Step::call("exec", json!({"command": "sh check.sh"})),
                Step::call("finish", json!({"summary": "fixed the typo"})),
            ],
        ),
        (
            "VERSION file".to_owned(),
            vec![
                // Plan-first: this first write is refused, the plan accepted, the write retried.
                Step::call(
                    "write_file",
                    json!({"path": "VERSION", "content": "1.0.0\n"}),
                ),
                Step::call(
                    "plan",
                    json!({"steps": ["write VERSION"], "files": ["VERSION"]}),
                ),
                Step::call(
                    "write_file",
                    json!({"path": "VERSION", "content": "1.0.0\n"}),
                ),
                Step::call("finish", json!({"summary": "added VERSION"})),
            ],
        ),
    ];
    let mock = MockServer::keyed(Provider::Openai, scripts).unwrap();
    let out = fx.env.dir.path().join("eval");
    let cfg = model_config(&mock, Provider::Openai);
    let report = taskbox_agent::eval::run(fx.api.clone(), &tasks, &cfg, 3, &out).unwrap();
    let table = taskbox_agent::eval::render_table(&report);
    println!("{table}");
    assert_eq!(report.tasks.len(), 3, "{table}");
    for t in &report.tasks {
        assert_eq!(t.termination, "completed", "{table}\n{t:#?}");
    }
    assert_eq!(report.success_rate, 1.0);
    assert_eq!(mock.used(), [2, 3, 4], "each task followed its own script");
    assert!(table.contains("add-version"), "{table}");
    assert!(table.contains("success rate 100% (3 of 3)"), "{table}");
    let names: Vec<&str> = report.tasks.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["add-version", "fix-add", "fix-greeting"]);
    assert_eq!(
        report.tasks[0].metrics.refusals, 1,
        "the write before the plan"
    );
    assert!(out.join("eval.json").is_file());
    assert!(out.join("fix-add").join("report.md").is_file());
    // The sample repositories stay pristine: the changes lived in the sandboxes.
    assert!(!tasks.join("add-version/repo/VERSION").exists());
}

#[test]
fn a_long_history_is_compacted_and_rule_files_are_bounded() {
    let fx = Fx::new();
    fx.env
        .write("AGENTS.md", &"Rule: keep it short.\n".repeat(1000));
    fx.env
        .write("big.txt", &"a line of filler text\n".repeat(200));
    let mut contract = fx.contract();
    contract.budget.context_tokens = 4000;
    let mut steps = vec![Step::call("read_file", json!({"path": "big.txt"})); 6];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert!(report.metrics.compactions >= 1, "{:?}", report.metrics);
    let got = mock.received();
    let system = messages(&got[0].body)[0]["content"].as_str().unwrap();
    assert!(system.contains("Rule: keep it short."));
    assert!(
        system.contains("[cut at 4096 of 21000 bytes"),
        "bounded rules"
    );
    assert!(system.len() < 8000, "{}", system.len());
    let last = &got.last().unwrap().body;
    let msgs = messages(last);
    assert_eq!(
        msgs[1]["content"], "Task: make tests/test_math.sh pass",
        "the task is kept"
    );
    assert!(
        msgs[2]["content"]
            .as_str()
            .unwrap()
            .starts_with("[context compacted"),
        "{:#?}",
        msgs[2]
    );
    let sent: usize = msgs.iter().map(|m| m.to_string().len()).sum();
    assert!(
        sent < 4 * 4000 * 2,
        "the request stays near its budget: {sent} bytes"
    );
}

/// Harness time per turn: everything but the model and the sandbox calls (validation, context,
/// rendering, the trace line, the state file). Measured with recorded responses, so no HTTP.
/// In the suite (a debug build, a few seconds) it only guards against a gross regression; the
/// figure in BENCHMARKS.md is this test in a release build:
/// `cargo nextest run -p taskbox-agent --cargo-profile release -E 'test(harness_overhead)'
/// --no-capture`
#[test]
fn harness_overhead_per_turn() {
    use taskbox_agent::model::{Finish, ModelResponse, Recorded, ToolCall, Usage};
    let fx = Fx::new();
    let turns = 200;
    let mut responses = Vec::new();
    for i in 0..turns {
        responses.push(ModelResponse {
            text: String::new(),
            tool_calls: vec![ToolCall {
                id: format!("c{i}"),
                name: "read_file".into(),
                arguments: json!({"path": "src/math.sh"}).to_string(),
            }],
            finish: Finish::ToolCalls,
            usage: Usage {
                input_tokens: 1000,
                output_tokens: 20,
            },
            cost_usd: 0.0,
            attempts: 1,
            latency_ms: 0,
        });
    }
    let mut contract = fx.contract();
    contract.budget.max_turns = turns;
    let report = taskbox_agent::start(
        fx.api.clone(),
        Box::new(Recorded::new(responses)),
        fx.spec(contract),
        fx.options(),
    )
    .unwrap();
    assert_eq!(report.termination, Termination::MaxTurns);
    println!(
        "harness overhead per turn over {turns} turns: p50 {} us",
        report.metrics.overhead_p50_us
    );
    assert!(report.metrics.overhead_p50_us < 50_000);
}

#[test]
fn secrets_in_observations_are_masked_in_the_trace() {
    let fx = Fx::new();
    let token = format!("ghp_{}", "a1B2c3D4e5".repeat(4));
    fx.env.write("config.env", &format!("TOKEN={token}\n"));
    let mut steps = vec![Step::call("read_file", json!({"path": "config.env"}))];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(report.termination, Termination::Completed);
    // The model saw the file as it is; the trace does not keep the token.
    assert!(last_content(&mock.received()[1].body).contains(&token));
    let trace = std::fs::read_to_string(fx.task_dir.join("trace.jsonl")).unwrap();
    assert!(trace.contains("config.env"));
    assert!(!trace.contains(&token), "the token leaked into the trace");
}

#[test]
fn a_long_output_comes_back_as_head_and_tail_with_the_spill_path() {
    let fx = Fx::new();
    let mut steps = vec![Step::call(
        "exec",
        json!({"command": "echo FIRST; seq 1 20000; echo LAST; echo oops >&2; exit 3"}),
    )];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let report = fx.run(&mock, Provider::Openai, fx.contract());
    assert_eq!(report.termination, Termination::Completed);
    let obs = last_content(&mock.received()[1].body);
    assert!(obs.starts_with("exit_code: 3 ("), "{obs}");
    assert!(
        obs.contains("cut: head and tail shown; the whole stream is in "),
        "{obs}"
    );
    assert!(
        obs.contains("FIRST") && obs.contains("LAST"),
        "head and tail: {obs}"
    );
    assert!(obs.contains("stderr:\noops"), "{obs}");
    assert!(obs.len() < 20_000, "bounded: {} bytes", obs.len());
}

#[test]
fn a_slow_model_is_cut_at_the_time_budget() {
    let fx = Fx::new();
    let mut contract = fx.contract();
    contract.budget.time = Duration::from_millis(1500);
    let steps = vec![Step::call("list", json!({})).delayed(Duration::from_secs(30))];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let started = Instant::now();
    let report = fx.run(&mock, Provider::Openai, contract);
    assert_eq!(report.termination, Termination::TimeBudget, "{report:#?}");
    assert!(
        report.detail.contains("during a model call"),
        "{}",
        report.detail
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
