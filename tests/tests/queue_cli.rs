//! `taskbox submit` and `taskbox tasks` against a real nats-server with JetStream, started on
//! a free loopback port by each test.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::path::Path;
use std::process::{Command, Output};

use taskbox_queue::testserver::{NatsServer, free_port};
use taskbox_tests::{require, taskbox};

fn server() -> Option<NatsServer> {
    match NatsServer::start() {
        Ok(s) => Some(s),
        Err(why) => {
            require(false, &why);
            None
        }
    }
}

fn tb(url: &str, args: &[&str]) -> Output {
    Command::new(taskbox())
        .args(args)
        .args(["--nats", url])
        .env_remove("TASKBOX_NATS")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `o` ended with `code` and said `said` on stderr.
fn refused(o: &Output, code: i32, said: &str) {
    assert_eq!(o.status.code(), Some(code), "{}", text(o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(said),
        "{}",
        text(o)
    );
}

fn contract(dir: &Path, body: &str) -> String {
    let p = dir.join("contract.toml");
    std::fs::write(&p, body).unwrap();
    p.to_str().unwrap().to_string()
}

const CONTRACT: &str = "goal = \"fix add so that the tests pass\"\nscope = [\"src/\"]\nverify = [\"sh tests/test_math.sh\"]\n";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn submit_is_idempotent_and_tasks_lists_shows_and_cancels() {
    let Some(s) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let c = contract(dir.path(), CONTRACT);
    let submit = [
        "submit",
        "--contract",
        &c,
        "--git",
        "https://example.invalid/r.git",
        "--commit",
        COMMIT,
        "--idempotency-key",
        "pr-7",
        "--tenant",
        "team-a",
    ];
    let first = tb(&s.url, &submit);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first));
    let id = String::from_utf8_lossy(&first.stdout).trim().to_string();
    assert!(id.starts_with("task-"), "{}", text(&first));
    let again = tb(&s.url, &submit);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again));
    assert_eq!(String::from_utf8_lossy(&again.stdout).trim(), id);
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already names this task"),
        "{}",
        text(&again)
    );

    let list = tb(&s.url, &["tasks", "list", "--json"]);
    assert_eq!(list.status.code(), Some(0), "{}", text(&list));
    let all: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let all = all.as_array().unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["id"], id.as_str());
    assert_eq!(all[0]["state"], "queued");
    assert_eq!(all[0]["spec"]["tenant"], "team-a");

    let status = tb(&s.url, &["tasks", "status", &id]);
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    let out = String::from_utf8_lossy(&status.stdout);
    assert!(
        out.contains("state:     queued") && out.contains(&COMMIT[..12]),
        "{out}"
    );

    let cancel = tb(
        &s.url,
        &["tasks", "cancel", &id, "--reason", "superseded by pr-8"],
    );
    assert_eq!(cancel.status.code(), Some(0), "{}", text(&cancel));
    assert!(String::from_utf8_lossy(&cancel.stdout).contains("cancelled"));
    refused(
        &tb(&s.url, &["tasks", "cancel", &id]),
        1,
        "has ended (cancelled)",
    );
    let status = tb(&s.url, &["tasks", "status", &id, "--json"]);
    let t: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(t["state"], "cancelled");
    assert_eq!(t["reasons"][0], "cancelled: superseded by pr-8");

    refused(
        &tb(&s.url, &["tasks", "status", "task-ffffffffffffffff"]),
        1,
        "no task task-ffffffffffffffff",
    );
}

#[test]
fn bad_submits_are_refused_with_the_reason_and_queue_nothing() {
    let Some(s) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bad = contract(dir.path(), "goal = [not toml");
    let o = tb(
        &s.url,
        &[
            "submit",
            "--contract",
            &bad,
            "--git",
            "https://example.invalid/r.git",
            "--commit",
            COMMIT,
        ],
    );
    refused(&o, 1, "contract.toml");

    let good = contract(dir.path(), CONTRACT);
    let o = tb(
        &s.url,
        &[
            "submit",
            "--contract",
            &good,
            "--git",
            "https://example.invalid/r.git",
            "--commit",
            "main",
        ],
    );
    refused(&o, 1, "commit id");

    refused(
        &tb(&s.url, &["submit", "--contract", &good]),
        2,
        "--workspace-object",
    );

    let list = tb(&s.url, &["tasks", "list", "--json"]);
    let all: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 0, "{}", text(&list));
}

#[test]
fn an_unreachable_queue_says_where_it_looked() {
    let url = format!("nats://127.0.0.1:{}", free_port());
    let o = tb(&url, &["tasks", "list"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&url) && err.contains("-js"), "{err}");
}

#[test]
fn schedules_are_added_listed_and_removed_and_results_wait_for_the_end() {
    let Some(s) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let c = contract(dir.path(), CONTRACT);
    let add = |extra: &[&str]| {
        let mut args = vec![
            "schedule",
            "add",
            "--contract",
            &c,
            "--git",
            "https://example.invalid/r.git",
            "--commit",
            COMMIT,
        ];
        args.extend_from_slice(extra);
        tb(&s.url, &args)
    };
    let o = add(&[
        "--every",
        "1h",
        "--max-duration",
        "20m",
        "--overlap",
        "queue",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // Named after the contract file.
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "contract");
    refused(&add(&["--every", "1h"]), 1, "exists already");
    refused(
        &add(&["--name", "bad-cron", "--cron", "61 * * * *"]),
        1,
        "cron expression",
    );
    refused(
        &add(&["--name", "fast", "--every", "10ms"]),
        1,
        "at least 1s",
    );
    refused(
        &add(&["--name", "odd", "--every", "1h", "--overlap", "sometimes"]),
        2,
        "skip or queue",
    );
    let o = add(&["--name", "nightly", "--cron", "0 3 * * *"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    let ls = tb(&s.url, &["schedule", "ls"]);
    assert_eq!(ls.status.code(), Some(0), "{}", text(&ls));
    let out = String::from_utf8_lossy(&ls.stdout);
    assert!(
        out.contains("contract: every 1h, overlap Queue; not fired yet"),
        "{out}"
    );
    assert!(out.contains("nightly: cron \"0 3 * * *\" (UTC)"), "{out}");
    let json = tb(&s.url, &["schedule", "list", "--json"]);
    let all: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(all[0]["spec"]["max_duration_ms"], 1_200_000);

    let rm = tb(&s.url, &["schedule", "rm", "nightly"]);
    assert_eq!(rm.status.code(), Some(0), "{}", text(&rm));
    refused(
        &tb(&s.url, &["schedule", "rm", "nightly"]),
        1,
        "no schedule nightly",
    );
    let ls = tb(&s.url, &["schedule", "ls"]);
    assert!(!String::from_utf8_lossy(&ls.stdout).contains("nightly"));

    // A queued task has no results yet.
    let sub = tb(
        &s.url,
        &[
            "submit",
            "--contract",
            &c,
            "--git",
            "https://example.invalid/r.git",
            "--commit",
            COMMIT,
        ],
    );
    let id = String::from_utf8_lossy(&sub.stdout).trim().to_string();
    refused(
        &tb(&s.url, &["tasks", "results", &id]),
        1,
        "it has not ended",
    );
}
