//! The agent in forks, against real native sandboxes and a scripted model speaking the OpenAI
//! protocol over HTTP: `--attempts 4` where only one attempt's edit is right completes with that
//! attempt's change and reports every attempt; a `subtask` whose verified change clashes with
//! the parent's own reaches the model as a conflict naming the file and hunks and leaves the
//! parent's workspace unchanged, while one that does not clash is merged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use serde_json::json;
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_agent::{Keep, ModelFactory, Termination};
use taskbox_core::api::{ReadRequest, SandboxId};

fn factory(mock: &MockServer) -> ModelFactory {
    let cfg = model_config(mock, Provider::Openai);
    Arc::new(move || cfg.build())
}

/// An attempt whose edit is wrong: the test still fails, and the gate refuses it.
fn wrong(op: &str) -> Vec<Step> {
    vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": format!("$1 {op} $2")}),
        ),
        Step::call("finish", json!({"summary": format!("used {op}")})),
    ]
}

#[test]
fn four_attempts_complete_with_the_one_right_edit() {
    let fx = Fx::new();
    let right = vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        Step::call("finish", json!({"summary": "add adds"})),
    ];
    let mock = MockServer::keyed(
        Provider::Openai,
        vec![
            ("(Attempt 1/4".into(), wrong("*")),
            ("(Attempt 2/4".into(), wrong("/")),
            ("(Attempt 3/4".into(), right),
            ("(Attempt 4/4".into(), wrong("%")),
        ],
    )
    .unwrap();
    let mut contract = fx.contract();
    contract.budget.max_verify_attempts = 1;
    let report = taskbox_agent::start_attempts(
        fx.api.clone(),
        factory(&mock),
        fx.spec(contract),
        fx.options(),
        4,
        Keep::SmallestDiff,
    )
    .unwrap();

    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert!(
        report.diff.contains("+add() { echo $(( $1 + $2 )); }"),
        "{}",
        report.diff
    );
    let a = report.attempts.as_ref().unwrap();
    assert_eq!((a.n, a.passed, a.pass_at_n, a.kept), (4, 1, true, Some(3)));
    assert_eq!(a.keep, "smallest-diff");
    let ends: Vec<Termination> = a.list.iter().map(|t| t.termination).collect();
    assert_eq!(
        ends,
        [
            Termination::VerificationFailed,
            Termination::VerificationFailed,
            Termination::Completed,
            Termination::VerificationFailed
        ]
    );
    for t in &a.list {
        assert_eq!(t.turns, 2, "{t:?}");
        assert!(t.tokens_in > 0, "{t:?}");
        assert!(
            std::path::Path::new(&t.task_dir)
                .join("report.json")
                .exists()
        );
    }
    // Each attempt ran in a sandbox of its own, all forks of one: four different sandboxes.
    let mut sandboxes: Vec<&str> = a.list.iter().map(|t| t.sandbox.as_str()).collect();
    sandboxes.sort_unstable();
    sandboxes.dedup();
    assert_eq!(sandboxes.len(), 4);
    // Only the kept attempt's sandbox is left, with the right change; the host is untouched.
    let live: Vec<String> = fx
        .api
        .list()
        .into_iter()
        .map(|i| i.id.to_string())
        .collect();
    assert_eq!(live, std::slice::from_ref(&report.sandbox));
    let kept = SandboxId::parse(&report.sandbox).unwrap();
    let content = fx
        .api
        .read(
            &kept,
            ReadRequest {
                path: "src/math.sh".into(),
                ..ReadRequest::default()
            },
        )
        .unwrap()
        .content;
    assert_eq!(content, FIXED);
    assert_eq!(
        std::fs::read_to_string(fx.env.ws().join("src/math.sh")).unwrap(),
        BUGGY
    );
    // The report shows every attempt.
    let md = std::fs::read_to_string(fx.task_dir.join("report.md")).unwrap();
    assert!(
        md.contains("pass@4: yes (1 of 4 passed); kept by `smallest-diff`: attempt 3"),
        "{md}"
    );
    assert!(md.contains("| 3 (kept) | completed | 2 |"), "{md}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fx.task_dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["attempts"]["list"].as_array().unwrap().len(), 4);
}

#[test]
fn first_keeps_the_first_to_pass_and_ends_the_others() {
    let fx = Fx::new();
    let slow_right = vec![
        Step::call("exec", json!({"shell": "sleep 3"})),
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        Step::call("finish", json!({"summary": "slow"})),
    ];
    let fast_right = vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$2 + $1"}),
        ),
        Step::call("finish", json!({"summary": "fast"})),
    ];
    let mock = MockServer::keyed(
        Provider::Openai,
        vec![
            ("(Attempt 1/2".into(), slow_right),
            ("(Attempt 2/2".into(), fast_right),
        ],
    )
    .unwrap();
    let report = taskbox_agent::start_attempts(
        fx.api.clone(),
        factory(&mock),
        fx.spec(fx.contract()),
        fx.options(),
        2,
        Keep::First,
    )
    .unwrap();
    assert_eq!(report.termination, Termination::Completed);
    assert!(report.diff.contains("$2 + $1"), "{}", report.diff);
    let a = report.attempts.unwrap();
    assert_eq!((a.kept, a.passed), (Some(2), 1));
    assert_eq!(
        a.list[0].termination,
        Termination::Cancelled,
        "{:?}",
        a.list
    );
}

#[test]
fn a_subtask_that_clashes_is_reported_and_one_that_does_not_is_merged() {
    let fx = Fx::new();
    // The parent: in one answer, a subtask on README.md, its own fix of math.sh, and a subtask
    // that fixes math.sh its own way (from the sandbox as the turn found it); then it finishes.
    let parent = vec![
        Step::calls(vec![
            (
                "subtask",
                json!({"goal": "note the fix in the readme (NOTE-SUB)", "scope": ["README.md"],
                       "max_turns": 3, "verify": ["grep -q fixed README.md"]}),
            ),
            (
                "edit_file",
                json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
            ),
            (
                "subtask",
                json!({"goal": "make add use expr (EXPR-SUB)", "scope": ["src/"], "max_turns": 3}),
            ),
        ]),
        Step::call("finish", json!({"summary": "fixed, with a note"})),
    ];
    let note = vec![
        Step::call(
            "write_file",
            json!({"path": "README.md", "content": "A tiny calculator, fixed.\n"}),
        ),
        Step::call("finish", json!({"summary": "noted"})),
    ];
    let expr = vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "echo $(( $1 - $2 ))", "new": "expr $1 + $2"}),
        ),
        Step::call("finish", json!({"summary": "expr"})),
    ];
    let mock = MockServer::keyed(
        Provider::Openai,
        vec![
            // The parent's requests hold its goal; the sub-agents' do not.
            ("make tests/test_math.sh pass".into(), parent),
            ("NOTE-SUB".into(), note),
            ("EXPR-SUB".into(), expr),
        ],
    )
    .unwrap();
    let mut opts = fx.options();
    opts.models = Some(factory(&mock));
    let report = fx.run_with(&mock, Provider::Openai, fx.contract(), opts);

    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    // The parent's own fix stands, the clashing subtask's is not there; the note is merged.
    let id = SandboxId::parse(&report.sandbox).unwrap();
    let read = |p: &str| {
        fx.api
            .read(
                &id,
                ReadRequest {
                    path: p.into(),
                    ..ReadRequest::default()
                },
            )
            .unwrap()
            .content
    };
    assert_eq!(read("src/math.sh"), FIXED);
    assert_eq!(read("README.md"), "A tiny calculator, fixed.\n");
    assert_eq!(report.subtasks.len(), 2, "{:#?}", report.subtasks);
    let (merged, clashed) = (&report.subtasks[0], &report.subtasks[1]);
    assert!(
        merged.applied && merged.files == ["README.md"],
        "{merged:?}"
    );
    assert_eq!(merged.termination, Some(Termination::Completed));
    assert!(!clashed.applied, "{clashed:?}");
    assert_eq!(
        clashed.termination,
        Some(Termination::Completed),
        "it was verified"
    );
    assert!(
        clashed
            .conflicts
            .iter()
            .any(|c| c.starts_with("src/math.sh: yours @@ -1")),
        "{clashed:?}"
    );
    // What the model read: the merge, and the conflict with the file and both hunks.
    let got = mock.received();
    let parent_turn2 = got
        .iter()
        .filter(|r| r.body.to_string().contains("make tests/test_math.sh pass"))
        .nth(1)
        .unwrap();
    let msgs = messages(&parent_turn2.body);
    let results: Vec<String> = msgs
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(results.len(), 3, "{msgs:#?}");
    assert!(
        results[0].contains("merged into your workspace: README.md"),
        "{}",
        results[0]
    );
    assert!(results[2].starts_with("conflict:"), "{}", results[2]);
    assert!(
        results[2].contains("src/math.sh: yours @@ -1"),
        "{}",
        results[2]
    );
    assert!(results[2].contains("its @@ -1"), "{}", results[2]);
    assert!(
        results[2].contains("+add() { expr $1 + $2; }"),
        "its diff is shown: {}",
        results[2]
    );
    // The sub-agents kept their own traces; their forks are gone.
    assert!(fx.task_dir.join("subtasks/turn-1-1/report.json").exists());
    assert!(fx.task_dir.join("subtasks/turn-1-2/report.json").exists());
    assert_eq!(fx.api.list().len(), 1);
    let md = std::fs::read_to_string(fx.task_dir.join("report.md")).unwrap();
    assert!(md.contains("## Subtasks"), "{md}");
    assert!(md.contains("verified, not merged: src/math.sh"), "{md}");
}
