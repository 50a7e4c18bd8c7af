//! The trace format, pinned: a session of every operation through [`Traced`] over a scripted
//! backend writes exactly the lines in `fixtures/session.jsonl` (times masked), and replaying it
//! gives exactly the report in `fixtures/replay.json`. Old traces must keep replaying, so a
//! change to a recorded name or request shape shows here first. `TASKBOX_BLESS=1` rewrites the
//! fixtures (for a deliberate change of the format, with a new trace version; run the two
//! tests one after the other: the second reads what the first writes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use taskbox_contract::api::*;
use taskbox_trace::replay::{self, ReplayOptions};
use taskbox_trace::trace::{Traced, read_trace};

use common::Scripted;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `text` with what differs from run to run (times) and what belongs to the policy model, not
/// to the format (the default policy's text and hash), masked.
fn masked(text: &str) -> String {
    let mut text = text.to_string();
    for (pattern, with) in [
        (
            r#""(started_at_ms|duration_ms|recorded_ms|replay_ms)":( ?)\d+"#,
            "\"$1\":${2}0",
        ),
        (r#""(backend_ms|total_ms)": ?[0-9.e+-]+"#, "\"$1\": 0"),
        (
            r#""policy_hash":"[0-9a-f]{64}""#,
            "\"policy_hash\":\"<hash>\"",
        ),
        (
            r#""policy_toml":"(?:[^"\\]|\\.)*""#,
            "\"policy_toml\":\"<policy>\"",
        ),
    ] {
        let re = regex::Regex::new(pattern).unwrap();
        text = re.replace_all(&text, with).into_owned();
    }
    text
}

/// Compares `actual` with the fixture `name`, or rewrites it when blessing.
fn assert_fixture(name: &str, actual: &str) {
    let path = fixture(name);
    if std::env::var_os("TASKBOX_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    for (i, (e, a)) in expected.lines().zip(actual.lines()).enumerate() {
        assert_eq!(e, a, "{name}: line {} differs", i + 1);
    }
    assert_eq!(expected.lines().count(), actual.lines().count(), "{name}");
    assert_eq!(expected, actual, "{name}");
}

/// One call of every operation, with the shapes the trace treats apart: background execs and
/// their process calls, text, binary and large stdin, large file contents both ways, errors,
/// secrets, export with and without apply, calls that are not recorded.
fn session(api: &dyn SandboxApi) -> SandboxId {
    let info = api
        .create(CreateRequest {
            workspace: "/nonexistent-workspace".into(),
            env: [("GITHUB_TOKEN".to_string(), "plain".to_string())].into(),
            ..CreateRequest::default()
        })
        .unwrap();
    let id = info.id;
    let shell = |s: &str, background: bool| ExecRequest {
        shell: Some(s.into()),
        background,
        ..ExecRequest::default()
    };
    api.exec(&id, shell("echo hi", false), None).unwrap();
    let mut events = Vec::new();
    let mut on = |e: ExecEvent| events.push(e);
    api.exec(&id, shell("echo streamed", false), Some(&mut on))
        .unwrap();
    assert_eq!(
        events.len(),
        2,
        "the events reach the caller through the trace"
    );
    api.exec(
        &id,
        ExecRequest {
            argv: Some(vec!["env".into()]),
            env: [("API_KEY".to_string(), "k".to_string())].into(),
            stdin: Some("token ghp_0123456789abcdef0123456789\n".into()),
            timeout_ms: Some(5000),
            ..ExecRequest::default()
        },
        None,
    )
    .unwrap();
    api.exec(&id, shell("cat", true), None).unwrap();
    api.process(&id, 7).unwrap();
    api.wait(&id, 7, Duration::from_millis(1500)).unwrap();
    api.kill(&id, 7, 15).unwrap();
    api.write_stdin(&id, 7, b"hello\n", false).unwrap();
    api.write_stdin(&id, 7, &[0xff, 0, 1], false).unwrap();
    api.write_stdin(&id, 7, "y".repeat(70_000).as_bytes(), true)
        .unwrap();
    api.process(&id, 99).unwrap_err();
    let read = |path: &str| ReadRequest {
        path: path.into(),
        ..ReadRequest::default()
    };
    api.read(&id, read("small.txt")).unwrap();
    api.read(&id, read("large.txt")).unwrap();
    api.read(&id, read("missing.txt")).unwrap_err();
    let write = |path: &str, content: String| WriteRequest {
        path: path.into(),
        content,
        create_parents: true,
        ..WriteRequest::default()
    };
    api.write(&id, write("a.txt", "alpha\n".into())).unwrap();
    api.write(&id, write("big.txt", "z".repeat(70_000)))
        .unwrap();
    api.edit(
        &id,
        EditRequest {
            path: "a.txt".into(),
            old: "beta".into(),
            new: "gamma".into(),
            expected_count: None,
        },
    )
    .unwrap_err();
    api.edit(
        &id,
        EditRequest {
            path: "a.txt".into(),
            old: "alpha".into(),
            new: "beta".into(),
            expected_count: Some(1),
        },
    )
    .unwrap();
    api.patch(
        &id,
        PatchRequest {
            patch: "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-beta\n+delta\n".into(),
        },
    )
    .unwrap();
    api.list_dir(
        &id,
        ListRequest {
            glob: Some("**/*.txt".into()),
            ..ListRequest::default()
        },
    )
    .unwrap();
    api.search(
        &id,
        SearchRequest {
            pattern: "delta".into(),
            ..SearchRequest::default()
        },
    )
    .unwrap();
    api.stat(
        &id,
        PathRequest {
            path: "a.txt".into(),
        },
    )
    .unwrap();
    api.remove(
        &id,
        RemoveRequest {
            path: "big.txt".into(),
            recursive: false,
        },
    )
    .unwrap();
    api.rename(
        &id,
        MoveRequest {
            from: "a.txt".into(),
            to: "b.txt".into(),
            overwrite: false,
        },
    )
    .unwrap();
    api.diff(&id, DiffRequest::default()).unwrap();
    let cp = CheckpointRequest { name: "one".into() };
    api.checkpoint(&id, cp.clone()).unwrap();
    api.restore(&id, cp).unwrap();
    api.export(&id, ExportRequest::default()).unwrap();
    api.export(
        &id,
        ExportRequest {
            format: ExportFormat::Patch,
            apply: true,
        },
    )
    .unwrap();
    api.set_network(
        &id,
        NetworkRules {
            allow: vec!["example.org".into()],
            ..NetworkRules::default()
        },
    )
    .unwrap();
    // Not recorded: reports on the sandbox itself.
    api.info(&id).unwrap();
    api.list_approvals(&id, None).unwrap();
    let ap = ApprovalId::parse("ap-0123").unwrap();
    api.approve(&id, &ap).unwrap_err();
    api.deny(&id, &ap, "not now").unwrap_err();
    // Not recorded: the sandbox does not exist, so there is no trace to go to.
    let ghost = SandboxId::parse("sb-ghost").unwrap();
    api.stat(
        &ghost,
        PathRequest {
            path: "a.txt".into(),
        },
    )
    .unwrap_err();
    api.destroy(&id).unwrap();
    id
}

#[test]
fn a_session_of_every_operation_writes_the_pinned_trace() {
    let dir = tempfile::tempdir().unwrap();
    let api = Traced::new(Scripted::default(), dir.path().join("traces"));
    let id = session(&api);
    let text = std::fs::read_to_string(api.trace_path(&id)).unwrap();
    assert_fixture("session.jsonl", &masked(&text));
}

#[test]
fn the_pinned_trace_replays_as_before() {
    let (policy, _) = taskbox_policy::resolve("default").unwrap();
    // The fixture with this taskbox's default policy in place of the masked one.
    let text = std::fs::read_to_string(fixture("session.jsonl"))
        .unwrap()
        .replace("<hash>", &policy.hash());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("session.jsonl");
    std::fs::write(&path, text).unwrap();
    let trace = read_trace(&path).unwrap();
    let create = CreateRequest {
        workspace: "/nonexistent-workspace".into(),
        ..CreateRequest::default()
    };
    let report = replay::replay(
        &trace,
        &Scripted::default(),
        create,
        &policy,
        &ReplayOptions::default(),
    )
    .unwrap();
    let json = serde_json::to_string_pretty(&report).unwrap() + "\n";
    assert_fixture("replay.json", &masked(&json));
}
