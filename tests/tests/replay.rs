//! `taskbox replay` end to end: a session recorded through a real `taskbox serve` (edits, a
//! failing then passing test run, a checkpoint and restore, a background process fed on stdin,
//! an exec with stdin, file operations) replays without divergence on the same backend and, for
//! image-rooted traces, on the other backend; a tampered workspace base, image or output is
//! reported at the right operation; truncated and hostile traces get a clear report.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taskbox_tests::{
    Env, SUITE_IMAGE, Supervisor, docker_available, ensure_image, git, http, is_root, require,
    taskbox, test_image_dir,
};

/// A call to the supervisor that must succeed: its JSON answer (`body` Null: no body).
fn ok(sup: &Supervisor, method: &str, path: &str, body: Value) -> Value {
    let body = (!body.is_null()).then_some(body);
    let (status, v) = http::call(&sup.socket, method, path, body.as_ref());
    assert!(
        (200..300).contains(&status),
        "{method} {path}: {status} {v}"
    );
    v
}

/// A repository with two commits; HEAD's README says "v2". Returns the first commit.
fn repo(env: &Env) -> String {
    let ws = env.ws();
    git(&ws, &["init", "-q"]);
    env.write("README", "v1\n");
    git(&ws, &["add", "README"]);
    git(&ws, &["commit", "-qm", "one"]);
    let first = git(&ws, &["rev-parse", "HEAD"]);
    env.write("README", "v2\n");
    git(&ws, &["commit", "-qam", "two"]);
    first
}

/// `cargo test`'s report of one failing test (`calc::tests::adds_two`, at src/calc.rs:12:9).
const FAILING_TEST_LOG: &str = "running 2 tests
test calc::tests::adds_one ... ok
test calc::tests::adds_two ... FAILED

failures:

---- calc::tests::adds_two stdout ----

thread 'calc::tests::adds_two' panicked at src/calc.rs:12:9:
assertion `left == right` failed
  left: 3
 right: 4
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace


failures:
    calc::tests::adds_two

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
";

/// Records the session; returns the trace path and the number of ops.
fn record(env: &Env, backend: &str, image: Option<&str>) -> (PathBuf, usize) {
    let sup = Supervisor::start(
        env,
        if backend == "docker" {
            &["--docker"]
        } else {
            &[]
        },
    );
    let mut create = json!({"workspace": env.ws().display().to_string(), "backend": backend});
    if let Some(i) = image {
        create["image"] = json!(i);
    }
    let info = ok(&sup, "POST", "/v1/sandboxes", create);
    let id = info["id"].as_str().unwrap().to_string();
    let p = |s: &str| format!("/v1/sandboxes/{id}/{s}");
    let exec = |body: Value| ok(&sup, "POST", &p("exec"), body);

    let r = exec(json!({"shell": "cat README"})); // #2: the workspace base shows here
    assert_eq!(r["stdout"]["text"], "v2\n", "{r}");
    ok(
        &sup,
        "POST",
        &p("write"),
        json!({"path": "status.txt", "content": "broken\n"}),
    );
    ok(
        &sup,
        "POST",
        &p("write"),
        json!({"path": "check.sh", "content":
            "if grep -q fixed status.txt; then echo PASS; else echo FAIL >&2; exit 1; fi\n"}),
    );
    let r = exec(json!({"argv": ["/bin/sh", "check.sh"]}));
    assert_eq!(r["exit_code"], 1, "{r}");
    ok(
        &sup,
        "POST",
        &p("edit"),
        json!({"path": "status.txt", "old": "broken", "new": "fixed"}),
    );
    let r = exec(json!({"argv": ["/bin/sh", "check.sh"]}));
    assert_eq!(r["exit_code"], 0, "{r}");
    ok(&sup, "POST", &p("checkpoints"), json!({"name": "good"}));
    ok(
        &sup,
        "POST",
        &p("write"),
        json!({"path": "status.txt", "content": "oops\n"}),
    );
    let r = exec(json!({"shell": "cat status.txt"})); // #10
    assert_eq!(r["stdout"]["text"], "oops\n");
    ok(&sup, "POST", &p("restore"), json!({"name": "good"}));
    let r = exec(json!({"shell": "cat status.txt"}));
    assert_eq!(r["stdout"]["text"], "fixed\n");
    let bg = exec(json!({"shell": "cat > from-stdin.txt; echo got", "background": true}));
    let pid = bg["exec_id"].as_u64().unwrap();
    ok(
        &sup,
        "POST",
        &p(&format!("processes/{pid}/stdin")),
        json!({"data": "hello\n", "close": true}),
    );
    let w = ok(
        &sup,
        "POST",
        &p(&format!("processes/{pid}/wait?timeout_ms=20000")),
        Value::Null,
    );
    assert_eq!(w["result"]["stdout"]["text"], "got\n", "{w}");
    let r = exec(json!({"argv": ["tr", "a-z", "A-Z"], "stdin": "abc\n"}));
    assert_eq!(r["stdout"]["text"], "ABC\n");
    ok(&sup, "POST", &p("read"), json!({"path": "from-stdin.txt"}));
    ok(&sup, "POST", &p("list"), json!({}));
    ok(&sup, "POST", &p("search"), json!({"pattern": "fix"}));
    ok(&sup, "POST", &p("diff"), json!({}));
    ok(
        &sup,
        "POST",
        &p("move"),
        json!({"from": "from-stdin.txt", "to": "stdin.txt"}),
    );
    ok(&sup, "POST", &p("remove"), json!({"path": "stdin.txt"}));
    ok(
        &sup,
        "POST",
        &p("patch"),
        json!({"patch": "--- a/status.txt\n+++ b/status.txt\n@@ -1 +1 @@\n-fixed\n+patched\n"}),
    );
    ok(&sup, "POST", &p("stat"), json!({"path": "status.txt"}));
    ok(&sup, "POST", &p("export"), json!({}));
    let bg = exec(json!({"argv": ["sleep", "60"], "background": true}));
    let pid = bg["exec_id"].as_u64().unwrap();
    let running = ok(&sup, "GET", &p(&format!("processes/{pid}")), Value::Null);
    assert_eq!(running["running"], true);
    ok(
        &sup,
        "POST",
        &p(&format!("processes/{pid}/kill")),
        json!({"signal": 9}),
    );
    // #29: what the root file system is (the host's, or the image's).
    exec(json!({"argv": ["head", "-n1", "/etc/os-release"]}));
    // #30, #31: a test log with a failing test: its finding is compared on replay.
    ok(
        &sup,
        "POST",
        &p("write"),
        json!({"path": "test.log", "content": FAILING_TEST_LOG}),
    );
    let r = exec(json!({"argv": ["cat", "test.log"]}));
    assert_eq!(r["findings"][0]["name"], "calc::tests::adds_two", "{r}");
    assert_eq!(r["findings"][0]["location"]["line"], 12, "{r}");
    let (status, _) = http::call(&sup.socket, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    drop(sup);
    let path = env.state().join("traces").join(format!("{id}.jsonl"));
    let ops = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("{\"type\":\"op\""))
        .count();
    (path, ops)
}

fn replay(env: &Env, trace: &Path, extra: &[&str]) -> Output {
    Command::new(taskbox())
        .arg("replay")
        .arg(trace)
        .args(extra)
        .arg("--state-dir")
        .arg(env.state())
        .env("HOME", env.home())
        .env("TASKBOX_IMAGE_DIR", test_image_dir())
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn replay_json(env: &Env, trace: &Path, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let out = replay(env, trace, &args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}); exit {:?}\nstdout: {}\nstderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

fn assert_clean(code: i32, report: &Value, ops: usize) {
    let bad: Vec<&Value> = report["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["status"] != "match")
        .collect();
    assert_eq!(code, 0, "divergent or skipped ops: {bad:#?}");
    assert!(bad.is_empty(), "{bad:#?}");
    assert_eq!(report["ops"].as_array().unwrap().len(), ops);
    assert_eq!(report["diverged"], 0);
}

/// Rewrites one JSON line of a trace file: the op with this seq, or the header for 0.
fn tamper(src: &Path, dst: &Path, seq: u64, f: impl FnOnce(&mut Value)) {
    let text = std::fs::read_to_string(src).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let at = lines
        .iter()
        .position(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            if seq == 0 {
                v["type"] == "header"
            } else {
                v["type"] == "op" && v["seq"] == seq
            }
        })
        .unwrap_or_else(|| panic!("no line for seq {seq}"));
    let mut v: Value = serde_json::from_str(&lines[at]).unwrap();
    f(&mut v);
    lines[at] = serde_json::to_string(&v).unwrap();
    std::fs::write(dst, lines.join("\n") + "\n").unwrap();
}

/// A trace's header and op lines, without the starts recorded before changing operations.
fn op_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| !l.starts_with("{\"type\":\"started\""))
        .collect()
}

/// The report's first diverged operation.
fn first_divergence(report: &Value) -> &Value {
    report["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["status"] == "diverged")
        .unwrap_or_else(|| panic!("no divergence: {report:#}"))
}

/// A replay that refuses `trace` before doing anything (exit 125), saying `why` on stderr.
fn assert_refused(env: &Env, trace: &Path, why: &str) {
    let out = replay(env, trace, &[]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains(why), "{}", stderr(&out));
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_native_session_replays_and_tampering_is_found_at_the_right_operation() {
    let env = Env::new();
    let first_commit = repo(&env);
    let (trace, ops) = record(&env, "native", None);
    assert_eq!(ops, 32);

    // Same backend: everything matches.
    let (code, report) = replay_json(&env, &trace, &[]);
    assert_clean(code, &report, ops);

    // The text report of a clean replay.
    let out = replay(&env, &trace, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("32 ops: 32 match, 0 diverged, 0 skipped"),
        "{text}"
    );

    // A tampered output: the divergence is at that op, side by side, with a diff.
    let t = env.dir.path().join("output.jsonl");
    tamper(&trace, &t, 10, |v| {
        assert_eq!(v["seq"], 10);
        v["outcome"]["ok"]["stdout"]["text"] = json!("oops!\n");
    });
    let out = replay(&env, &t, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("first divergence at #10 exec"), "{text}");
    assert!(text.contains("-oops!\n  +oops\n"), "{text}");
    assert!(text.contains("1 diverged"), "{text}");

    // A tampered finding (its line): the exec that reported it diverges, on its findings
    // alone (the output is the same).
    let t = env.dir.path().join("finding.jsonl");
    tamper(&trace, &t, 31, |v| {
        assert_eq!(v["outcome"]["ok"]["findings"][0]["location"]["line"], 12);
        v["outcome"]["ok"]["findings"][0]["location"]["line"] = json!(13);
    });
    let (code, report) = replay_json(&env, &t, &[]);
    assert_eq!(code, 1, "{report:#}");
    let first = first_divergence(&report);
    assert_eq!(first["seq"], 31, "{first:#}");
    let fields: Vec<&str> = first["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["findings"], "{first:#}");

    // A tampered workspace base: the first op that sees the workspace diverges.
    let t = env.dir.path().join("base.jsonl");
    tamper(&trace, &t, 0, |v| {
        v["workspace_base"]["commit"] = json!(first_commit);
    });
    let (code, report) = replay_json(&env, &t, &[]);
    assert_eq!(code, 1);
    let first = first_divergence(&report);
    assert_eq!(first["seq"], 2, "{first:#}");
    assert_eq!(first["mismatches"][0]["field"], "stdout");

    // A truncated trace (the destroy line torn): replayed, and the tear reported.
    let bytes = std::fs::read(&trace).unwrap();
    let t = env.dir.path().join("torn.jsonl");
    std::fs::write(&t, &bytes[..bytes.len() - 10]).unwrap();
    let out = replay(&env, &t, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(text.contains("incomplete line"), "{text}");
    assert!(text.contains("31 ops: 31 match"), "{text}");

    // No repository with the commit: a clear error naming what is missing and the flag.
    let empty = env.dir.path().join("empty-repo");
    std::fs::create_dir(&empty).unwrap();
    git(&empty, &["init", "-q"]);
    let out = replay(&env, &trace, &["--repo", empty.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(125));
    let e = stderr(&out);
    assert!(e.contains("is not in") && e.contains("--repo DIR"), "{e}");
}

/// The first pending approval of sandbox `id` (waiting up to 30 s for one): its id.
fn first_pending(sup: &Supervisor, id: &str) -> String {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let list = ok(
            sup,
            "GET",
            &format!("/v1/sandboxes/{id}/approvals?wait_ms=2000"),
            Value::Null,
        );
        if let Some(a) = list.as_array().and_then(|l| l.first()) {
            return a["id"].as_str().unwrap().to_string();
        }
    }
    panic!("no approval appeared");
}

#[test]
fn execs_the_command_policy_asked_about_replay_as_they_were_answered() {
    let env = Env::new();
    repo(&env);
    let policy = env.policy(
        "ask",
        "[commands]\nask = [\"touch\"]\nask_timeout = \"1s\"\n",
    );
    let sup = Supervisor::start(&env, &[]);
    let info = ok(
        &sup,
        "POST",
        "/v1/sandboxes",
        json!({"workspace": env.ws().display().to_string(), "policy": policy,
               "policy_toml": taskbox_tests::policy_text(&policy)}),
    );
    let id = info["id"].as_str().unwrap().to_string();
    let exec_path = format!("/v1/sandboxes/{id}/exec");
    let later = |body: Value| {
        let socket = sup.socket.clone();
        let path = exec_path.clone();
        std::thread::spawn(move || http::call(&socket, "POST", &path, Some(&body)))
    };
    // Approved: it runs.
    let exec = later(json!({"shell": "touch approved.txt && echo ran"}));
    let aid = first_pending(&sup, &id);
    ok(
        &sup,
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/approve"),
        Value::Null,
    );
    let (status, r) = exec.join().unwrap();
    assert_eq!(
        (status, r["stdout"]["text"].as_str()),
        (200, Some("ran\n")),
        "{r}"
    );
    // Denied with a reason, and left to expire: neither runs.
    let exec = later(json!({"argv": ["touch", "denied.txt"]}));
    let aid = first_pending(&sup, &id);
    ok(
        &sup,
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/deny"),
        json!({"reason": "not this one"}),
    );
    let (_, r) = exec.join().unwrap();
    assert_eq!(r["violations"][0]["kind"], "command", "{r}");
    let r = ok(
        &sup,
        "POST",
        &exec_path,
        json!({"argv": ["touch", "expired.txt"]}),
    );
    assert!(
        r["violations"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("no one answered within 1s"),
        "{r}"
    );
    let r = ok(&sup, "POST", &exec_path, json!({"shell": "ls *.txt"}));
    assert_eq!(r["stdout"]["text"], "approved.txt\n", "{r}");
    ok(&sup, "DELETE", &format!("/v1/sandboxes/{id}"), Value::Null);
    drop(sup);

    let trace = env.state().join("traces").join(format!("{id}.jsonl"));
    let (code, report) = replay_json(&env, &trace, &[]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["diverged"], 0, "{report:#}");
    let ops = report["ops"].as_array().unwrap();
    let status = |op: &str| -> Vec<String> {
        ops.iter()
            .filter(|o| o["op"] == op)
            .map(|o| o["status"].as_str().unwrap().to_string())
            .collect()
    };
    // Every exec was re-issued and matched: the approved one ran again (the last `ls` shows it),
    // the denied and the expired ones were refused again.
    assert_eq!(status("exec"), ["match"; 4], "{report:#}");
    // The answers themselves are carried by the execs they answered.
    assert_eq!(status("approve"), ["skipped"], "{report:#}");
    assert_eq!(status("deny"), ["skipped"], "{report:#}");

    // Had the recording refused the approved exec, the replay refuses it too (the answer is the
    // recording's): the first divergence is the later `ls`, which no longer finds the file.
    let tampered = env.dir.path().join("tampered.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let at = lines
        .iter()
        .find(|l| {
            l.starts_with("{\"type\":\"op\"")
                && l.contains("\"op\":\"exec\"")
                && l.contains("touch approved.txt")
        })
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .unwrap();
    tamper(&trace, &tampered, at, |v| {
        v["outcome"]["ok"]["violations"] = json!([{"kind": "command", "detail": "denied"}]);
    });
    let (code, report) = replay_json(&env, &tampered, &[]);
    assert_eq!(code, 1, "{report:#}");
    let first = first_divergence(&report);
    assert!(
        first["detail"].as_str().unwrap().contains("ls *.txt"),
        "{first:#}"
    );
}

#[test]
fn hostile_traces_get_clear_reports() {
    let env = Env::new();
    repo(&env);
    let (trace, _) = record(&env, "native", None);
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = op_lines(&text);

    // A recorded read of a path outside the workspace, and an op kind this taskbox does not
    // know: the read is refused by the sandbox (a divergence, never the host file), the
    // unknown op is skipped.
    let mut evil: Vec<String> = lines[..3].iter().map(|s| s.to_string()).collect();
    evil.push(
        json!({"type": "op", "seq": 3, "op": "read", "started_at_ms": 1, "duration_ms": 1,
            "request": {"path": "../../../../etc/passwd"},
            "outcome": {"ok": {"path": "x", "content": "root:x:0:0", "encoding": "utf-8",
                "total_bytes": 10, "total_lines": 1, "truncated": false, "binary": false}}})
        .to_string(),
    );
    evil.push(
        json!({"type": "op", "seq": 4, "op": "teleport", "started_at_ms": 1, "duration_ms": 1,
            "request": {"allow": ["example.org"]}, "outcome": {"ok": null}})
        .to_string(),
    );
    // A rule change is re-issued: this sandbox has no proxy, so it is refused as recorded.
    evil.push(
        json!({"type": "op", "seq": 5, "op": "network", "started_at_ms": 1, "duration_ms": 1,
            "request": {"allow": ["example.org"]},
            "outcome": {"error": {"code": "conflict", "message": "no proxy"}}})
        .to_string(),
    );
    let t = env.dir.path().join("evil.jsonl");
    std::fs::write(&t, evil.join("\n") + "\n").unwrap();
    let (code, report) = replay_json(&env, &t, &[]);
    assert_eq!(code, 1, "{report:#}");
    let ops = report["ops"].as_array().unwrap();
    assert_eq!(ops[2]["status"], "diverged");
    assert_eq!(ops[2]["mismatches"][0]["field"], "outcome");
    let actual = ops[2]["mismatches"][0]["actual"].as_str().unwrap();
    assert!(actual.starts_with("error "), "{actual}");
    assert!(!report.to_string().contains("root:x:0:0:"), "no host file");
    assert_eq!(ops[3]["status"], "skipped");
    assert!(
        ops[3]["reason"].as_str().unwrap().contains("\"teleport\""),
        "{}",
        ops[3]
    );
    assert_eq!(ops[4]["status"], "match", "{}", ops[4]);

    // Bad JSON in the middle: refused with the line number.
    let mut bad: Vec<&str> = lines.clone();
    bad[3] = "{\"type\":\"op\",";
    let t = env.dir.path().join("bad.jsonl");
    std::fs::write(&t, bad.join("\n") + "\n").unwrap();
    assert_refused(&env, &t, "line 4: invalid json");

    // A newer trace version: refused with what to do.
    let t = env.dir.path().join("newer.jsonl");
    std::fs::write(&t, text.replacen("\"version\":2", "\"version\":7", 1)).unwrap();
    assert_refused(&env, &t, "upgrade taskbox");

    // An altered policy text: its hash no longer matches.
    let t = env.dir.path().join("policy.jsonl");
    tamper(&trace, &t, 0, |v| {
        let p = v["policy_toml"]
            .as_str()
            .unwrap()
            .replacen("true", "false", 1);
        v["policy_toml"] = json!(p);
    });
    assert_refused(&env, &t, "does not match its hash");

    // Not a trace at all.
    let t = env.dir.path().join("garbage.jsonl");
    std::fs::write(&t, vec![b'x'; 3 << 20]).unwrap();
    assert_refused(&env, &t, "has no header");
}

fn cross_ready() -> bool {
    require(
        is_root(),
        "the docker backend and the image store need root",
    ) && require(
        docker_available(),
        "no Docker daemon answers (start dockerd)",
    ) && ensure_image(SUITE_IMAGE)
}

#[test]
fn an_image_session_replays_on_the_other_backend() {
    if !cross_ready() {
        return;
    }
    // Recorded on docker, replayed on native with the same image digest, and the reverse.
    for (recorded, other) in [("docker", "native"), ("native", "docker")] {
        let env = Env::new();
        repo(&env);
        let (trace, ops) = record(&env, recorded, Some(SUITE_IMAGE));
        let (code, report) = replay_json(&env, &trace, &["--backend", other]);
        assert_eq!(report["backend"], other);
        assert!(
            report["image"].as_str().unwrap().starts_with("sha256:"),
            "{report:#}"
        );
        assert_clean(code, &report, ops);
        if recorded == "docker" {
            // The same backend, too.
            let (code, report) = replay_json(&env, &trace, &[]);
            assert_clean(code, &report, ops);
            // An image that is not in the store: what is missing and how to supply it.
            let t = env.dir.path().join("image.jsonl");
            let fake = format!("sha256:{}", "0".repeat(64));
            tamper(&trace, &t, 0, |v| v["image"] = json!(fake));
            let out = replay(&env, &t, &["--backend", other]);
            assert_eq!(out.status.code(), Some(125));
            let e = stderr(&out);
            assert!(
                e.contains(&fake) && e.contains("taskbox image build"),
                "{e}"
            );
            // Another image: the create says so, and the first op that shows the root file
            // system diverges; nothing else does.
            if ensure_image("busybox") {
                let (code, report) =
                    replay_json(&env, &trace, &["--backend", other, "--image", "busybox"]);
                assert_eq!(code, 1, "{report:#}");
                let diverged: Vec<&Value> = report["ops"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|o| o["status"] != "match")
                    .collect();
                let seqs: Vec<u64> = diverged
                    .iter()
                    .map(|o| o["seq"].as_u64().unwrap())
                    .collect();
                assert_eq!(seqs, [1, 29], "{diverged:#?}");
                assert_eq!(diverged[0]["mismatches"][0]["field"], "image");
                assert_eq!(diverged[1]["mismatches"][0]["field"], "exit_code");
            }
        }
    }
}

/// Chromium from Debian's `chromium` package (or a path in `$TASKBOX_CHROMIUM`).
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TASKBOX_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// Where CI collects artifacts: `$TASKBOX_ARTIFACT_DIR`, else `target/artifacts`.
fn artifact_dir() -> PathBuf {
    let dir = std::env::var_os("TASKBOX_ARTIFACT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap()
                .join("target/artifacts")
        });
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs headless Chromium with `args` (at most 90 s); its stdout.
fn headless(browser: &Path, profile: &Path, args: &[String]) -> String {
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).unwrap();
        s
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish in 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap()
}

fn unescape_attr(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

#[test]
fn the_html_report_renders_in_headless_chromium() {
    let Some(browser) = chromium() else {
        require(
            false,
            "chromium is not installed (apt-get install chromium)",
        );
        return;
    };
    let env = Env::new();
    repo(&env);
    let (trace, ops) = record(&env, "native", None);
    let out = Command::new(taskbox())
        .args(["trace", "html"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let page = env.dir.path().join("report.html");
    std::fs::write(&page, &out.stdout).unwrap();
    let html = String::from_utf8(out.stdout).unwrap();
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "no network"
    );

    // Op 10 printed "oops": opening its item (a click on its summary, by the page's test
    // hook) shows that output with a height on the page.
    let url = format!("file://{}?open=10", page.display());
    let profile = env.dir.path().join("chromium");
    let dom = headless(&browser, &profile, &["--dump-dom".to_string(), url.clone()]);
    let start = dom.find("data-check=\"").expect("the page's script ran") + 12;
    let end = start + dom[start..].find('"').unwrap();
    let check: Value = serde_json::from_str(&unescape_attr(&dom[start..end])).unwrap();
    assert_eq!(check["bars"], ops, "{check}");
    assert_eq!(check["items"], ops, "{check}");
    let open = check["open"].as_array().unwrap();
    assert_eq!(open.len(), 1, "{check}");
    assert_eq!(open[0]["seq"], "10");
    assert!(open[0]["height"].as_f64().unwrap() > 0.0, "{check}");
    assert!(
        open[0]["text"].as_str().unwrap().contains("oops"),
        "{check}"
    );
    assert!(dom.contains("id=\"op-10\" open=\"\""), "the item is open");
    assert!(!dom.contains("id=\"op-9\" open"), "only that one");

    // A screenshot of the page with that item open, kept as a CI artifact.
    let shot = artifact_dir().join("trace-report.png");
    let _ = std::fs::remove_file(&shot);
    headless(
        &browser,
        &profile,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1280,2400".to_string(),
            url,
        ],
    );
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{}",
        png.len()
    );
}

#[test]
fn serve_offers_the_trace_pages_at_ui() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let info = ok(
        &sup,
        "POST",
        "/v1/sandboxes",
        json!({"workspace": env.ws().display().to_string()}),
    );
    let id = info["id"].as_str().unwrap().to_string();
    ok(
        &sup,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        json!({"shell": "echo live-output"}),
    );
    let get = |path: &str| {
        let (status, body) = http::call(&sup.socket, "GET", path, None);
        (status, body.as_str().unwrap_or_default().to_string())
    };

    // Live: listed, and its page shows both ops so far and reloads itself.
    let (status, index) = get("/ui");
    assert_eq!(status, 200, "{index}");
    assert!(
        index.contains(&format!("<a href=\"/ui/{id}\">{id}</a></td><td>live")),
        "{index}"
    );
    let (status, page) = get(&format!("/ui/{id}"));
    assert_eq!(status, 200);
    assert_eq!(page.matches("class=\"bar ").count(), 2, "{page}");
    assert!(page.contains("live-output"));
    assert!(page.contains("http-equiv=\"refresh\""));

    // Finished: the destroy is on the page, which no longer reloads.
    let (status, _) = http::call(&sup.socket, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    let (_, page) = get(&format!("/ui/{id}"));
    assert_eq!(page.matches("class=\"bar ").count(), 3);
    assert!(!page.contains("http-equiv=\"refresh\""));
    let (_, index) = get("/ui");
    assert!(index.contains("finished"), "{index}");

    // Unknown and invalid ids.
    assert_eq!(get("/ui/sb-0000000000000000").0, 404);
    assert_eq!(get("/ui/..%2Fetc").0, 400);
}

#[test]
fn a_workspace_without_a_commit_comes_from_a_tar_or_a_directory_and_normalisations_apply() {
    let env = Env::new();
    env.write("data.txt", "plain\n");
    let sup = Supervisor::start(&env, &[]);
    let info = ok(
        &sup,
        "POST",
        "/v1/sandboxes",
        json!({"workspace": env.ws().display().to_string()}),
    );
    let id = info["id"].as_str().unwrap().to_string();
    let exec = |shell: &str| {
        ok(
            &sup,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            json!({ "shell": shell }),
        )
    };
    exec("cat data.txt");
    exec("date -u +%Y-%m-%dT%H:%M:%S.%NZ; echo took 0.$(date +%N | cut -c1-3)s");
    let (status, _) = http::call(&sup.socket, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    drop(sup);
    let trace = env.state().join("traces").join(format!("{id}.jsonl"));

    // The base recorded is the directory's content digest.
    let header: Value =
        serde_json::from_str(fs::read_to_string(&trace).unwrap().lines().next().unwrap()).unwrap();
    let base = &header["workspace_base"];
    assert_eq!(base["kind"], "dir", "{header:#}");
    let digest = base["sha256"].as_str().unwrap().to_string();
    assert_eq!(digest.len(), 64);

    // Content that differs is refused, naming both digests, from wherever it comes: the
    // recorded directory, another directory, a tar.
    let tar_of = |name: &str| {
        let tar = env.dir.path().join(name);
        let ok = Command::new("tar")
            .arg("-C")
            .arg(env.ws())
            .args(["-cf"])
            .arg(&tar)
            .arg(".")
            .status()
            .unwrap();
        assert!(ok.success());
        tar
    };
    env.write("data.txt", "plain, edited\n");
    let changed_tar = tar_of("changed.tar");
    for extra in [
        vec![],
        vec!["--workspace-dir", env.ws().to_str().unwrap()],
        vec!["--workspace-tar", changed_tar.to_str().unwrap()],
    ] {
        let out = replay(&env, &trace, &extra);
        assert_eq!(out.status.code(), Some(125), "{extra:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("content digest") && err.contains(&digest),
            "{extra:?}: {err}"
        );
    }
    env.write("data.txt", "plain\n");

    // The recorded directory (its content as recorded), a copy of it, and a tar of it: the
    // clock output differs unless normalised.
    let tar = tar_of("ws.tar");
    for source in [
        vec![],
        vec!["--workspace-dir", env.ws().to_str().unwrap()],
        vec!["--workspace-tar", tar.to_str().unwrap()],
    ] {
        let (code, report) = replay_json(&env, &trace, &source);
        assert_eq!(code, 1, "{report:#}");
        let ops = report["ops"].as_array().unwrap();
        assert_eq!(ops[1]["status"], "match", "{report:#}");
        assert_eq!(ops[2]["status"], "diverged", "{report:#}");
        assert_eq!(ops[2]["mismatches"][0]["field"], "stdout");
        let mut args = source.clone();
        args.extend(["--normalize", "timestamps,durations"]);
        let (code, report) = replay_json(&env, &trace, &args);
        assert_eq!(code, 0, "{report:#}");
        assert_eq!(report["normalizations"], json!(["timestamps", "durations"]));
    }
}

/// Runs a CLI verb against the supervisor; its stdout (the verb must succeed).
fn verb(env: &Env, sup: &Supervisor, args: &[&str]) -> String {
    let out = Command::new(taskbox())
        .args(args)
        .arg("--socket")
        .arg(&sup.socket)
        .arg("--state-dir")
        .arg(env.state())
        .env("HOME", env.home())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "taskbox {args:?}: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_fork_is_traced_from_its_parent_and_replays_from_the_parents_trace() {
    let env = Env::new();
    repo(&env);
    // A warm pool of 2: the first fork (of 2) is started, the later ones are served from the
    // pool once it is filled; both kinds are traced and replayed alike.
    let sup = Supervisor::start(&env, &["--fork-pool", "2"]);
    let pool = |name: &str| -> u64 {
        let req = taskbox_agent::http::Request::new("GET", "/metrics");
        let r = taskbox_agent::http::Client::unix(&sup.socket)
            .and_then(|c| c.send(&req, Duration::from_secs(30)))
            .unwrap();
        String::from_utf8_lossy(&r.body)
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0)
    };
    let pool_filled = || {
        let deadline = Instant::now() + Duration::from_secs(30);
        // Held and started: a place still starting serves no fork.
        while pool("taskbox_fork_pool_sandboxes") != 2 || pool("taskbox_fork_pool_ready") != 2 {
            assert!(Instant::now() < deadline, "the pool does not fill");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let info = ok(
        &sup,
        "POST",
        "/v1/sandboxes",
        json!({"workspace": env.ws().display().to_string()}),
    );
    let id = info["id"].as_str().unwrap().to_string();
    let exec = |id: &str, shell: &str| {
        let r = ok(
            &sup,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"shell": shell}),
        );
        assert_eq!(r["exit_code"], 0, "{r}");
        r
    };
    exec(&id, "echo one > notes.txt && echo scratch > /tmp/scratch");
    ok(
        &sup,
        "POST",
        &format!("/v1/sandboxes/{id}/checkpoints"),
        json!({"name": "first"}),
    );
    exec(&id, "echo two >> notes.txt");
    // Through the CLI: `taskbox fork ID -n 2`, then `--from CHECKPOINT`.
    let forks: Vec<String> = verb(&env, &sup, &["fork", &id, "-n", "2"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(forks.len(), 2, "{forks:?}");
    pool_filled();
    let from_ckpt = verb(&env, &sup, &["fork", &id, "--from", "first"])
        .trim()
        .to_string();
    assert_eq!(pool("taskbox_fork_pool_served"), 1, "served from the pool");
    // What happens in the parent after the fork is not the fork's.
    exec(&id, "echo three >> notes.txt");
    let r = exec(
        &forks[0],
        "cat notes.txt /tmp/scratch; echo fork >> notes.txt",
    );
    assert_eq!(r["stdout"]["text"], "one\ntwo\nscratch\n", "{r}");
    let r = exec(
        &from_ckpt,
        "cat notes.txt; test -e /tmp/scratch || echo no-scratch",
    );
    assert_eq!(r["stdout"]["text"], "one\nno-scratch\n", "{r}");
    // A fork of a fork (the same origin: from the pool).
    pool_filled();
    let grandchild = verb(&env, &sup, &["fork", &forks[0]]).trim().to_string();
    assert_eq!(pool("taskbox_fork_pool_served"), 2, "served from the pool");
    let r = exec(&grandchild, "cat notes.txt");
    assert_eq!(r["stdout"]["text"], "one\ntwo\nfork\n", "{r}");
    for sb in [&grandchild, &from_ckpt, &forks[1], &forks[0], &id] {
        let (status, _) = http::call(&sup.socket, "DELETE", &format!("/v1/sandboxes/{sb}"), None);
        assert_eq!(status, 204);
    }
    drop(sup);

    // The parent's trace has the fork; each fork's header names the parent and that seq.
    let traces = env.state().join("traces");
    let parent_text = fs::read_to_string(traces.join(format!("{id}.jsonl"))).unwrap();
    let fork_seqs: Vec<u64> = op_lines(&parent_text)
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["op"] == "fork")
        .map(|v| v["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(fork_seqs.len(), 2, "{parent_text}");
    let header = |sb: &str| -> Value {
        let text = fs::read_to_string(traces.join(format!("{sb}.jsonl"))).unwrap();
        serde_json::from_str(text.lines().next().unwrap()).unwrap()
    };
    for f in &forks {
        let h = header(f);
        assert_eq!(h["fork"]["parent"], id.as_str(), "{h}");
        assert_eq!(h["fork"]["seq"], fork_seqs[0], "{h}");
    }
    let h = header(&from_ckpt);
    assert_eq!(
        (&h["fork"]["seq"], &h["fork"]["checkpoint"]),
        (&json!(fork_seqs[1]), &json!("first"))
    );
    assert_eq!(header(&grandchild)["fork"]["parent"], forks[0].as_str());

    // Each replays from its parent's trace (and its parent's): nothing diverges.
    for (sb, ops, generations) in [(&forks[0], 4, 1), (&from_ckpt, 3, 1), (&grandchild, 3, 2)] {
        let trace = traces.join(format!("{sb}.jsonl"));
        let (code, report) = replay_json(&env, &trace, &[]);
        assert_clean(code, &report, ops);
        let notes: Vec<&str> = report["notes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .filter(|n| n.starts_with("rebuilt from"))
            .collect();
        assert_eq!(notes.len(), generations, "{report:#}");
        assert!(notes.iter().all(|n| n.contains("0 diverged")), "{notes:?}");
    }
    // The fork's own observations are compared: a tampered one is found.
    let trace = traces.join(format!("{}.jsonl", forks[0]));
    let bad = env.dir.path().join("bad-fork.jsonl");
    tamper(&trace, &bad, 2, |v| {
        v["outcome"]["ok"]["stdout"]["text"] = json!("one\nthree\nscratch\n");
    });
    // Beside the parent's trace, as a fork's must be.
    let beside = traces.join("sb-0000000000000bad.jsonl");
    fs::copy(&bad, &beside).unwrap();
    let (code, report) = replay_json(&env, &beside, &[]);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(first_divergence(&report)["seq"], 2);
    // Without its parent's trace a fork cannot be rebuilt, and says so.
    let alone = env.dir.path().join("alone");
    fs::create_dir(&alone).unwrap();
    fs::copy(&trace, alone.join("fork.jsonl")).unwrap();
    assert_refused(
        &env,
        &alone.join("fork.jsonl"),
        &format!("the trace of the fork's parent {id} cannot be read"),
    );
}
