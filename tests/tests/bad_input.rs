//! Bad input to the CLI: every mistake gets one clear line naming the problem and exit 125 (127
//! for a command that does not exist), never a panic or a hang. And to the HTTP API: commands
//! of any size a body may hold run, or are refused naming the limit, and never lose a sandbox.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use serde_json::json;
use taskbox_tests::{Env, Supervisor, big_exec};

fn run_raw(env: &Env, args: &[&str]) -> (i32, String, String) {
    let out = env.command().args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_no_panic(stderr: &str) {
    assert!(!stderr.contains("panicked"), "taskbox panicked: {stderr}");
    assert!(
        !stderr.contains("RUST_BACKTRACE"),
        "taskbox panicked: {stderr}"
    );
}

#[test]
fn malformed_policies_are_refused_naming_the_key() {
    let env = Env::new();
    let cases = [
        ("unknown-top", "colour = \"red\"\n", "colour"),
        (
            "unknown-nested",
            "[limits]\nmemroy = \"1GiB\"\n",
            "limits.memroy",
        ),
        ("bad-size", "[limits]\nmemory = \"lots\"\n", "limits.memory"),
        ("bad-type", "[limits]\npids = \"many\"\n", "limits.pids"),
        (
            "bad-duration",
            "[limits]\ntimeout = \"soon\"\n",
            "limits.timeout",
        ),
        (
            "zero-timeout",
            "[limits]\ntimeout = \"0s\"\n",
            "limits.timeout",
        ),
        ("bad-enum", "[network]\nmode = \"wifi\"\n", "network.mode"),
        (
            "escape-protected",
            "[filesystem]\nprotected = [\"../x\"]\n",
            "filesystem.protected",
        ),
        ("syntax", "[limits\nmemory = 1\n", ":1:"),
    ];
    for (name, text, key) in cases {
        let path = env.policy(name, text);
        let p = path.to_str().unwrap();
        let (code, _, stderr) = run_raw(&env, &["policy", "check", p]);
        assert_eq!(code, 125, "{name}: {stderr}");
        assert_no_panic(&stderr);
        assert!(
            stderr.contains(key),
            "{name}: error does not name {key}: {stderr}"
        );
        assert!(
            stderr.contains(name),
            "{name}: error does not name the file: {stderr}"
        );
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{name}: not one line: {stderr}"
        );
        // `run` refuses it the same way, before running anything.
        let (code, _, stderr) = run_raw(&env, &["run", "--policy", p, "--", "touch", "ran"]);
        assert_eq!(code, 125, "{name}: {stderr}");
        assert!(!env.ws().join("ran").exists());
    }
}

#[test]
fn shipped_policies_check_and_explain() {
    let env = Env::new();
    for name in ["default", "read-only"] {
        let (code, out, err) = run_raw(&env, &["policy", "check", name]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("ok"), "{out}");
        let (code, out, err) = run_raw(&env, &["policy", "explain", name]);
        assert_eq!(code, 0, "{err}");
        assert!(out.to_lowercase().contains("network"), "{out}");
        assert!(out.contains("GiB"), "{out}");
    }
    let (code, _, err) = run_raw(&env, &["policy", "explain", "no-such-policy"]);
    assert_eq!(code, 125);
    assert!(
        err.contains("default") && err.contains("read-only"),
        "{err}"
    );
}

#[test]
fn a_missing_workspace_is_a_clear_error() {
    let env = Env::new();
    let missing = env.dir.path().join("nope");
    let (code, _, err) = run_raw(
        &env,
        &[
            "run",
            "--workspace",
            missing.to_str().unwrap(),
            "--",
            "true",
        ],
    );
    assert_eq!(code, 125);
    assert_no_panic(&err);
    assert!(err.contains("does not exist"), "{err}");
    let file = env.dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let (code, _, err) = run_raw(
        &env,
        &["run", "--workspace", file.to_str().unwrap(), "--", "true"],
    );
    assert_eq!(code, 125);
    assert!(err.contains("not a directory"), "{err}");
}

/// A command that nests directories past what a path can name (each `mkdir` relative to the
/// last) got exit 125 and an internal error after its output, its changes lost: now the run
/// answers with the changes it can name and a `limit` violation that names the tree.
#[test]
fn a_tree_deeper_than_a_path_can_name_is_a_violation_not_a_failure() {
    let env = Env::new();
    let r = env.run_json(
        &[],
        &[
            "sh",
            "-c",
            "echo kept > kept.txt && python3 -c 'import os\nfor i in range(3000):\n    \
             os.mkdir(\"e\"); os.chdir(\"e\")'",
        ],
    );
    assert_eq!(r.exit_code(), Some(0), "{:#}", r.json);
    let changes: Vec<&str> = r.json["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["kept.txt"], "{:#}", r.json);
    let violations = r.json["violations"].as_array().unwrap();
    assert_eq!(violations.len(), 1, "{:#}", r.json);
    assert_eq!(violations[0]["kind"], "limit");
    let detail = violations[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("4,095 bytes") && detail.contains("(rm -rf e)"),
        "{detail}"
    );
    assert!(detail.len() < 600, "{detail}");
}

#[test]
fn a_missing_command_exits_127_with_a_clear_message() {
    let env = Env::new();
    let (code, _, err) = run_raw(&env, &["run", "--", "no-such-command-xyz"]);
    assert_eq!(code, 127, "{err}");
    assert!(err.contains("no-such-command-xyz"), "{err}");
    assert!(err.contains("command not found"), "{err}");
    let r = env.run_json(&[], &["no-such-command-xyz"]);
    assert_eq!(r.exit_code(), Some(127));
    assert!(r.stderr().contains("command not found"), "{:#}", r.json);
    // A file that is not executable: 126, like a shell.
    env.write("script.sh", "echo hi\n");
    let (code, _, err) = run_raw(&env, &["run", "--", "./script.sh"]);
    assert_eq!(code, 126, "{err}");
}

#[test]
fn zero_and_malformed_timeouts_are_refused() {
    let env = Env::new();
    for t in ["0", "0s", "soon", "-5s"] {
        let (code, _, err) = run_raw(&env, &["run", "--timeout", t, "--", "true"]);
        assert_eq!(code, 125, "{t}: {err}");
        assert_no_panic(&err);
        assert!(
            err.contains("timeout") || err.contains("duration"),
            "{t}: {err}"
        );
    }
}

#[test]
fn no_command_and_bad_env_are_refused() {
    let env = Env::new();
    let (code, _, err) = run_raw(&env, &["run"]);
    assert_eq!(code, 125, "{err}");
    let (code, _, err) = run_raw(&env, &["run", "--env", "NOEQUALS", "--", "true"]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("K=V"), "{err}");
}

#[test]
fn help_describes_run() {
    let env = Env::new();
    let (code, out, _) = run_raw(&env, &["run", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--workspace",
        "--policy",
        "--timeout",
        "--json",
        "--diff",
        "--write-through",
        "--env",
    ] {
        assert!(out.contains(flag), "{flag} missing from --help");
    }
}

#[test]
fn execs_of_every_size_over_http_run_or_are_refused_naming_the_limit() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let ws = env.ws().display().to_string();
    let (status, created) = sup.call("POST", "/v1/sandboxes", Some(json!({ "workspace": ws })));
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let exec = |req: serde_json::Value| big_exec::over_http(&sup, &id, req);
    big_exec::check(&exec, big_exec::argument_space());
    let (_, info) = sup.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(info["state"], "running", "{info}");
    let (status, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
}
