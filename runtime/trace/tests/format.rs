//! The trace format, pinned: a session of every operation through [`Traced`] over a scripted
//! backend writes exactly the lines in `fixtures/session.jsonl` (times masked), and replaying it
//! gives exactly the report in `fixtures/replay.json`. Old traces must keep replaying, so a
//! change to a recorded name or request shape shows here first. `TASKBOX_BLESS=1` rewrites the
//! fixtures (for a deliberate change of the format, with a new trace version; run the two
//! tests one after the other: the second reads what the first writes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use taskbox_contract::api::*;
use taskbox_trace::replay::{self, ReplayOptions};
use taskbox_trace::trace::{Traced, read_trace};

use common::{Scripted, session};

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
