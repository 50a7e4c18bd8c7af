//! `taskbox agent ...` through the real binary: a task killed with SIGKILL mid-turn and resumed
//! by `taskbox agent resume`, `replay` of its trace, and `eval` printing the metrics table.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_tests::require;

/// The binary has the agent subcommands (a binary built from another tree may not).
fn agent_cli() -> bool {
    let ok = Command::new(taskbox_tests::taskbox())
        .args(["agent", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    require(
        ok,
        "the taskbox binary has no `agent` subcommand (build -p taskbox)",
    )
}

fn agent(fx: &Fx, mock: &MockServer) -> Command {
    let mut c = fx.env.command();
    c.env("TASKBOX_MODEL_BASE_URL", mock.base_url())
        .env("TASKBOX_MODEL", "mock-model")
        .env("TASKBOX_MODEL_PROVIDER", "openai")
        .env("TASKBOX_MODEL_API_KEY", "test-key")
        .arg("agent");
    c
}

#[test]
fn a_killed_task_is_resumed_and_its_trace_replays() {
    if !agent_cli() {
        return;
    }
    let fx = Fx::new();
    let steps = vec![
        Step::call(
            "write_file",
            json!({"path": "notes.txt", "content": "turn one\n"}),
        ),
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        // The process is killed while it waits for this answer.
        Step::call("list", json!({})).delayed(Duration::from_secs(60)),
        Step::call("exec", json!({"command": "sh tests/test_math.sh"})),
        Step::call("finish", json!({"summary": "fixed across a kill"})),
    ];
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut child = agent(&fx, &mock)
        .args(["run", "--goal", "make tests/test_math.sh pass"])
        .args(["--verify", "sh tests/test_math.sh", "--json"])
        .arg("--task-dir")
        .arg(&fx.task_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    while mock.received().len() < 3 && Instant::now() < until {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the agent ended early ({status}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        mock.received().len(),
        3,
        "the third model call is in flight"
    );
    // What the killed process's in-process backend holds: its session and its sandbox.
    let session = fx
        .env
        .state()
        .join("agent/sessions")
        .join(child.id().to_string());
    let sandboxes = taskbox_tests::sandbox_dirs(&session.join("sandboxes"));
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    child.kill().unwrap();
    child.wait().unwrap();

    let state: Value =
        serde_json::from_slice(&std::fs::read(fx.task_dir.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["turn"], 2);
    assert_eq!(state["termination"], Value::Null);

    let out = agent(&fx, &mock)
        .args(["resume", "--json"])
        .arg(&fx.task_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["termination"], "completed", "{report:#}");
    assert_eq!(report["metrics"]["turns"], 4);
    assert_eq!(report["summary"], "fixed across a kill");
    let mut files: Vec<&str> = report["files_changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["notes.txt", "src/math.sh"]);
    assert_eq!(mock.received().len(), 5);
    // The next agent swept what the killed one left: its session and its sandbox's cgroups.
    assert!(!session.exists(), "{} is left", session.display());
    for id in &sandboxes {
        let left = taskbox_tests::host_cgroups(&format!("taskbox-sb-{id}"));
        assert!(
            left.is_empty(),
            "the killed agent's cgroups are left: {left:?}"
        );
    }

    // The trace replays without a model server, and every observation matches.
    drop(mock);
    let replay_dir = fx.env.dir.path().join("replay");
    let out = fx
        .env
        .command()
        .args(["agent", "replay", "--json", "--out"])
        .arg(&replay_dir)
        .arg(fx.task_dir.join("trace.jsonl"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(out.status.code(), Some(0), "{r:#} {stderr}");
    assert_eq!(r["matched"], true);
    assert_eq!(
        r["compared"], 4,
        "the killed turn's calls were dropped: {r:#}"
    );
}

#[test]
fn eval_prints_the_metrics_table_for_the_sample_tasks() {
    if !agent_cli() {
        return;
    }
    let fx = Fx::new();
    let edit = |path: &str, old: &str, new: &str| {
        Step::call("edit_file", json!({"path": path, "old": old, "new": new}))
    };
    let scripts = vec![
        (
            "src/math.sh so that".to_owned(),
            vec![
                edit("src/math.sh", "$1 - $2", "$1 + $2"),
                Step::call("finish", json!({"summary": "fixed"})),
            ],
        ),
        (
            "greeting typo".to_owned(),
            // Never fixed: the gate fails three times.
            vec![Step::call("finish", json!({"summary": "nothing to do"})); 3],
        ),
        (
            "VERSION file".to_owned(),
            vec![
                Step::call("plan", json!({"steps": ["write VERSION"]})),
                Step::call(
                    "write_file",
                    json!({"path": "VERSION", "content": "1.0.0\n"}),
                ),
                Step::call("finish", json!({"summary": "added"})),
            ],
        ),
    ];
    let mock = MockServer::keyed(Provider::Openai, scripts).unwrap();
    let tasks = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tasks");
    let out = agent(&fx, &mock)
        .args(["eval", "--parallel", "3", "--out"])
        .arg(fx.env.dir.path().join("eval"))
        .arg(&tasks)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "one task failed: {stdout}{stderr}"
    );
    let header = stdout.lines().next().unwrap_or_default();
    for col in [
        "task",
        "termination",
        "turns",
        "tokens in",
        "tokens out",
        "cost $",
        "wall s",
    ] {
        assert!(header.contains(col), "{stdout}");
    }
    let row = |name: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no row for {name}: {stdout}"))
            .to_owned()
    };
    assert!(row("fix-add").contains("completed"), "{stdout}");
    assert!(row("add-version").contains("completed"), "{stdout}");
    assert!(
        row("fix-greeting").contains("verification_failed"),
        "{stdout}"
    );
    assert!(stdout.contains("success rate 67% (2 of 3)"), "{stdout}");
}

#[test]
fn run_talks_https_with_the_ca_from_the_flag_or_the_environment() {
    if !agent_cli() {
        return;
    }
    let Some(pki) = Pki::new(&["localhost"]) else {
        return;
    };
    let ca = pki.ca.display().to_string();
    let none: Vec<(&str, &str)> = Vec::new();
    // How the CA is given, and whether the task completes.
    let cases = [
        (
            "--ca-file",
            vec!["--ca-file", ca.as_str()],
            none.clone(),
            true,
        ),
        (
            "TASKBOX_MODEL_CA_FILE",
            vec![],
            vec![("TASKBOX_MODEL_CA_FILE", &ca)],
            true,
        ),
        ("SSL_CERT_FILE", vec![], vec![("SSL_CERT_FILE", &ca)], true),
        ("no CA", vec![], none, false),
    ];
    for (how, flags, env, completes) in cases {
        let fx = Fx::new();
        let mock = MockServer::start_tls(Provider::Openai, fixing_steps(), pki.server()).unwrap();
        let mut cmd = agent(&fx, &mock);
        cmd.env_remove("SSL_CERT_FILE")
            .env_remove("SSL_CERT_DIR")
            .env_remove("TASKBOX_MODEL_CA_FILE")
            .envs(env)
            .args(["run", "--goal", "make tests/test_math.sh pass"])
            .args(["--verify", "sh tests/test_math.sh", "--json"])
            .args(flags)
            .arg("--task-dir")
            .arg(&fx.task_dir);
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let report: Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{how}: {e}: {stderr}"));
        if completes {
            assert_eq!(out.status.code(), Some(0), "{how}: {report:#} {stderr}");
            assert_eq!(report["termination"], "completed", "{how}: {report:#}");
            assert_eq!(mock.received().len(), 4, "{how}");
        } else {
            assert_eq!(out.status.code(), Some(1), "{how}: {report:#} {stderr}");
            assert_eq!(report["termination"], "unrecoverable_error", "{report:#}");
            let detail = report["detail"].as_str().unwrap();
            assert!(
                detail.contains("not signed by a certificate authority"),
                "{detail}"
            );
            assert!(detail.contains("--ca-file"), "{detail}");
            assert!(mock.received().is_empty(), "refused before any request");
        }
    }
}
