//! Traces of real native sandboxes: every operation and its observation lands in
//! `STATE/traces/ID.jsonl` before the caller sees it, in order, redacted, and reads back.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};
use taskbox_core::api::*;
use taskbox_core::result::ExecResult;
use taskbox_core::sandbox::NativeBackend;
use taskbox_core::trace::{Outcome, TraceError, Traced, read_trace, render_text};
use taskbox_tests::Env;

/// A token of GitHub's shape, made at run time so no token-shaped literal sits in the source.
fn fake_token() -> String {
    format!("ghp_{}", "T0k3n".repeat(8))
}

struct Fixture {
    env: Env,
    api: Traced<NativeBackend>,
    id: SandboxId,
    trace: PathBuf,
}

fn fixture(env_vars: BTreeMap<String, String>) -> Fixture {
    let env = Env::new();
    env.write("a.txt", "alpha\n");
    let backend = NativeBackend::new(env.state()).unwrap();
    let api = Traced::new(backend, env.state().join("traces"));
    let info = api
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            env: env_vars,
            labels: BTreeMap::from([("task".to_string(), "trace-test".to_string())]),
            ..CreateRequest::default()
        })
        .unwrap();
    let trace = api.trace_path(&info.id);
    Fixture {
        id: info.id,
        env,
        api,
        trace,
    }
}

fn sh(f: &Fixture, script: &str) -> ExecResult {
    taskbox_tests::shell(&f.api, &f.id, script)
}

/// The trace file's lines, each parsed (every line must be valid JSON and end in a newline).
fn all_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.ends_with('\n'), "the last line is incomplete");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The header and op lines (without the starts recorded before changing operations).
fn lines(path: &Path) -> Vec<Value> {
    all_lines(path)
        .into_iter()
        .filter(|v| v["type"] != "started")
        .collect()
}

fn last(path: &Path) -> Value {
    lines(path).pop().unwrap()
}

fn sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn a_session_is_recorded_line_by_line_before_each_call_returns() {
    let token = fake_token();
    let f = fixture(BTreeMap::from([
        ("GITHUB_TOKEN".to_string(), token.clone()),
        ("GREETING".to_string(), "hi".to_string()),
    ]));

    // create: the header and op 1 are on disk when create returns.
    let l = lines(&f.trace);
    assert_eq!(l.len(), 2);
    let h = &l[0];
    assert_eq!(h["type"], "header");
    assert_eq!(h["version"], 2);
    assert_eq!(h["sandbox"], f.id.as_str());
    assert_eq!(h["backend"], "native");
    assert_eq!(h["policy"], "default");
    // A plain directory: its content digest is the base.
    assert_eq!(h["workspace_base"]["kind"], "dir");
    assert_eq!(
        h["workspace_base"]["sha256"].as_str().map(str::len),
        Some(64)
    );
    assert_eq!(h["env"]["GITHUB_TOKEN"], "[redacted]");
    assert_eq!(h["env"]["GREETING"], "hi");
    assert_eq!(h["labels"]["task"], "trace-test");
    let policy = taskbox_core::policy::parse(h["policy_toml"].as_str().unwrap(), "trace").unwrap();
    assert_eq!(policy.hash(), h["policy_hash"].as_str().unwrap());
    assert_eq!(l[1]["op"], "create");
    assert_eq!(l[1]["seq"], 1);
    assert_eq!(l[1]["outcome"]["ok"]["id"], f.id.as_str());
    assert_eq!(l[1]["request"]["env"]["GITHUB_TOKEN"], "[redacted]");

    // An exec whose output holds the token: the caller sees it raw, the trace does not.
    let r = sh(&f, "echo \"token=$GITHUB_TOKEN\"; echo oops >&2");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(
        r.stdout.text,
        format!("token={token}\n"),
        "the caller gets the raw output"
    );
    let op = last(&f.trace);
    assert_eq!(
        (op["seq"].as_u64(), op["op"].as_str()),
        (Some(2), Some("exec"))
    );
    let ok = &op["outcome"]["ok"];
    assert_eq!(ok["exit_code"], 0);
    assert_eq!(ok["stdout"]["text"], "token=[redacted]\n");
    assert_eq!(
        ok["stdout_sha256"],
        sha256(&r.stdout.text),
        "digest of the raw output"
    );
    assert_eq!(ok["stderr_sha256"], sha256("oops\n"));
    assert_eq!(
        op["request"]["shell"],
        "echo \"token=$GITHUB_TOKEN\"; echo oops >&2"
    );
    assert!(op["started_at_ms"].as_u64().unwrap() >= h["created_at_ms"].as_u64().unwrap());

    // A failing exec.
    let r = sh(&f, "echo failing; exit 3");
    assert_eq!(r.exit_code, Some(3));
    let op = last(&f.trace);
    assert_eq!(op["seq"], 3);
    assert_eq!(op["outcome"]["ok"]["exit_code"], 3);
    assert_eq!(op["outcome"]["ok"]["stdout_sha256"], sha256("failing\n"));

    // write, edit, a failing edit.
    f.api
        .write(
            &f.id,
            WriteRequest {
                path: "src/lib.rs".into(),
                content: "fn one() {}\n".into(),
                create_parents: true,
                ..WriteRequest::default()
            },
        )
        .unwrap();
    let op = last(&f.trace);
    assert_eq!(
        (op["seq"].as_u64(), op["op"].as_str()),
        (Some(4), Some("write"))
    );
    assert_eq!(op["request"]["content"], "fn one() {}\n");
    assert_eq!(op["outcome"]["ok"]["created"], true);

    let e = f
        .api
        .edit(
            &f.id,
            EditRequest {
                path: "src/lib.rs".into(),
                old: "fn one".into(),
                new: "fn two".into(),
                expected_count: None,
            },
        )
        .unwrap();
    assert_eq!(e.replacements, 1);
    let op = last(&f.trace);
    assert_eq!(
        (op["seq"].as_u64(), op["op"].as_str()),
        (Some(5), Some("edit"))
    );
    assert_eq!(op["outcome"]["ok"]["diff"], e.diff);

    let err = f
        .api
        .edit(
            &f.id,
            EditRequest {
                path: "src/lib.rs".into(),
                old: "not there".into(),
                new: "x".into(),
                expected_count: None,
            },
        )
        .unwrap_err();
    let op = last(&f.trace);
    assert_eq!(op["seq"], 6);
    assert_eq!(op["outcome"]["error"]["code"], err.code());
    assert_eq!(op["outcome"]["error"]["message"], err.to_string());

    // checkpoint, change, restore.
    f.api
        .checkpoint(&f.id, CheckpointRequest { name: "c1".into() })
        .unwrap();
    assert_eq!(last(&f.trace)["op"], "checkpoint");
    assert_eq!(sh(&f, "echo changed > src/lib.rs").exit_code, Some(0));
    f.api
        .restore(&f.id, CheckpointRequest { name: "c1".into() })
        .unwrap();
    let op = last(&f.trace);
    assert_eq!(
        (op["seq"].as_u64(), op["op"].as_str()),
        (Some(9), Some("restore"))
    );
    assert_eq!(op["outcome"], serde_json::json!({ "ok": null }));
    assert_eq!(sh(&f, "cat src/lib.rs").stdout.text, "fn two() {}\n");

    // A big write is recorded as its digest and size.
    let big = "x".repeat(70 * 1024);
    f.api
        .write(
            &f.id,
            WriteRequest {
                path: "big.txt".into(),
                content: big.clone(),
                ..WriteRequest::default()
            },
        )
        .unwrap();
    let op = last(&f.trace);
    assert_eq!(op["request"]["content"]["bytes"], big.len());
    assert_eq!(op["request"]["content"]["sha256"], sha256(&big));
    let read = f
        .api
        .read(
            &f.id,
            ReadRequest {
                path: "big.txt".into(),
                ..ReadRequest::default()
            },
        )
        .unwrap();
    assert_eq!(read.content, big);
    assert_eq!(
        last(&f.trace)["outcome"]["ok"]["content"]["bytes"],
        big.len()
    );

    f.api.destroy(&f.id).unwrap();
    let op = last(&f.trace);
    assert_eq!(op["op"], "destroy");
    assert_eq!(op["outcome"], serde_json::json!({ "ok": null }));
    // After destroy nothing more is recorded, and the trace stays.
    assert!(f.api.destroy(&f.id).is_err());
    assert_eq!(last(&f.trace)["op"], "destroy");

    let text = std::fs::read_to_string(&f.trace).unwrap();
    assert!(!text.contains(&token), "the token leaked into the trace");

    let t = read_trace(&f.trace).unwrap();
    assert_eq!(t.torn_tail, None);
    let names: Vec<&str> = t.ops.iter().map(|o| o.op.as_str()).collect();
    assert_eq!(
        names,
        [
            "create",
            "exec",
            "exec",
            "write",
            "edit",
            "edit",
            "checkpoint",
            "exec",
            "restore",
            "exec",
            "write",
            "read",
            "destroy"
        ]
    );
    let seqs: Vec<u64> = t.ops.iter().map(|o| o.seq).collect();
    assert_eq!(seqs, (1..=13).collect::<Vec<_>>());
    assert!(matches!(t.ops[5].outcome, Outcome::Error(_)));

    let shown = render_text(&t);
    assert!(shown.contains(&format!("sandbox {}", f.id)), "{shown}");
    assert!(shown.contains("exit 3"), "{shown}");
    assert!(shown.contains("echo failing; exit 3"), "{shown}");
    assert!(shown.contains("exit 0"), "{shown}");
    assert!(shown.contains("edit_not_found"), "{shown}");
    assert!(
        shown.contains("13 ops, 4 execs (1 not exit 0), 1 failed"),
        "{shown}"
    );
    drop(f.env);
}

#[test]
fn concurrent_execs_on_one_sandbox_give_a_consistent_trace() {
    let f = fixture(BTreeMap::new());
    std::thread::scope(|s| {
        for t in 0..4 {
            let f = &f;
            s.spawn(move || {
                for i in 0..5 {
                    let r = sh(f, &format!("echo thread{t}-{i}"));
                    assert_eq!(r.stdout.text, format!("thread{t}-{i}\n"));
                }
            });
        }
    });
    f.api.destroy(&f.id).unwrap();
    let l = lines(&f.trace);
    assert_eq!(l.len(), 1 + 1 + 20 + 1, "header, create, 20 execs, destroy");
    let seqs: Vec<u64> = l[1..].iter().map(|v| v["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=22).collect::<Vec<_>>(), "seq follows file order");
    let mut seen: Vec<String> = l[2..22]
        .iter()
        .map(|v| {
            let ok = &v["outcome"]["ok"];
            let text = ok["stdout"]["text"].as_str().unwrap().to_string();
            assert_eq!(ok["stdout_sha256"], sha256(&text));
            text
        })
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 20, "every exec is recorded once");
    let t = read_trace(&f.trace).unwrap();
    assert_eq!(t.ops.len(), 22);
    // Each exec was recorded before it ran, and its op names that start.
    let starts: Vec<Value> = all_lines(&f.trace)
        .into_iter()
        .filter(|v| v["type"] == "started")
        .collect();
    assert_eq!(starts.len(), 20);
    let mut named: Vec<u64> = l[2..22]
        .iter()
        .map(|v| v["start"].as_u64().unwrap())
        .collect();
    named.sort();
    assert_eq!(named, (1..=20).collect::<Vec<_>>());
    assert!(t.unfinished.is_empty());
}

#[test]
fn a_torn_or_newer_trace_reads_clearly() {
    let f = fixture(BTreeMap::new());
    assert_eq!(sh(&f, "echo one").exit_code, Some(0));
    assert_eq!(sh(&f, "exit 1").exit_code, Some(1));
    f.api.destroy(&f.id).unwrap();
    let full = std::fs::read(&f.trace).unwrap();

    // Cut in the middle of the last line (destroy).
    let cut = f.env.dir.path().join("cut.jsonl");
    std::fs::write(&cut, &full[..full.len() - 10]).unwrap();
    let t = read_trace(&cut).unwrap();
    let names: Vec<&str> = t.ops.iter().map(|o| o.op.as_str()).collect();
    assert_eq!(names, ["create", "exec", "exec"]);
    assert!(t.torn_tail.as_deref().unwrap().contains("\"destroy\""));
    let shown = render_text(&t);
    assert!(
        shown.contains("echo one") && shown.contains("exit 1"),
        "{shown}"
    );
    assert!(shown.contains("incomplete line"), "{shown}");

    let text = String::from_utf8(full).unwrap();
    let newer = f.env.dir.path().join("newer.jsonl");
    std::fs::write(&newer, text.replacen("\"version\":2", "\"version\":99", 1)).unwrap();
    let e = read_trace(&newer).unwrap_err();
    assert!(matches!(e, TraceError::TooNew { found: 99, .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "trace version 99 is newer than this taskbox understands (2); upgrade taskbox"
    );
}

#[test]
fn calls_on_unknown_sandboxes_leave_no_trace() {
    let env = Env::new();
    let api = Traced::new(
        NativeBackend::new(env.state()).unwrap(),
        env.state().join("traces"),
    );
    let id = SandboxId::parse("sb-nope").unwrap();
    let e = api
        .exec(
            &id,
            ExecRequest {
                shell: Some("true".into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap_err();
    assert_eq!(e.code(), "sandbox_not_found");
    assert!(!api.trace_path(&id).exists());
}

#[test]
fn background_processes_and_streams_are_recorded_by_their_results() {
    let f = fixture(BTreeMap::new());
    let bg = match f
        .api
        .exec(
            &f.id,
            ExecRequest {
                argv: Some(vec!["/bin/cat".into()]),
                background: true,
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Background(p) => p,
        other => panic!("{other:?}"),
    };
    assert_eq!(last(&f.trace)["outcome"]["ok"]["exec_id"], bg.exec_id);
    f.api
        .write_stdin(&f.id, bg.exec_id, b"hello\n", true)
        .unwrap();
    let op = last(&f.trace);
    assert_eq!(op["op"], "stdin");
    assert_eq!(op["request"]["data"], "hello\n");
    assert_eq!(op["request"]["close"], true);
    let p = f
        .api
        .wait(&f.id, bg.exec_id, std::time::Duration::from_secs(5))
        .unwrap();
    assert_eq!(p.result.unwrap().stdout.text, "hello\n");
    let op = last(&f.trace);
    assert_eq!(op["op"], "wait");
    assert_eq!(op["request"]["timeout_ms"], 5000);
    assert_eq!(
        op["outcome"]["ok"]["result"]["stdout_sha256"],
        sha256("hello\n")
    );

    // A streamed exec: the events reach the caller; the trace holds one op with the result.
    let mut chunks = 0;
    let mut sink = |e: ExecEvent| {
        if matches!(e, ExecEvent::Stdout { .. }) {
            chunks += 1;
        }
    };
    f.api
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("echo a; echo b".into()),
                ..ExecRequest::default()
            },
            Some(&mut sink),
        )
        .unwrap();
    assert!(chunks >= 1);
    let l = lines(&f.trace);
    assert_eq!(l.len(), 1 + 5, "header, create, exec, stdin, wait, exec");
    assert_eq!(l[5]["outcome"]["ok"]["stdout"]["text"], "a\nb\n");
    f.api.destroy(&f.id).unwrap();
}

/// When the trace cannot be written, an exec is refused before it runs: nothing runs that the
/// trace would miss. The supervisor runs with a small file-size limit (SIGXFSZ ignored, so a
/// write past it fails with EFBIG as a full disk fails with ENOSPC); execs go on until the
/// trace reaches it.
#[test]
fn an_exec_the_trace_cannot_record_is_refused_before_it_runs() {
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    let sup = taskbox_tests::Supervisor::start_with(&env, &[], |cmd| {
        // SAFETY: runs in the forked child before exec; setrlimit and signal are
        // async-signal-safe and touch only the child.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 48 * 1024,
                    rlim_max: libc::RLIM_INFINITY,
                };
                libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
    });
    let (status, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(serde_json::json!({"workspace": env.ws()})),
    );
    assert_eq!(status, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let pad = "x".repeat(3000);
    let (mut ran, mut unrecorded) = (0, 0);
    let refusal = loop {
        assert!(ran < 200, "the trace never filled up");
        let (status, v) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(serde_json::json!({
                "shell": format!("echo {} >> ran", ran + 1),
                "env": {"PAD": pad},
            })),
        );
        match status {
            200 => assert_eq!(v["exit_code"], 0, "{v}"),
            // Its start was recorded but not its end: it ran, and says so.
            500 => {
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(
                    msg.contains("ran but its observation could not be recorded"),
                    "{msg}"
                );
                unrecorded += 1;
            }
            _ => break (status, v),
        }
        ran += 1;
    };
    assert!(ran > unrecorded, "not one exec was recorded");
    assert_eq!(refusal.0, 503, "{}", refusal.1);
    assert_eq!(refusal.1["error"]["code"], "unavailable", "{}", refusal.1);
    let msg = refusal.1["error"]["message"].as_str().unwrap();
    assert!(msg.contains("refused before it ran"), "{msg}");
    // Read the trace now, before room is made for more.
    let trace = read_trace(&env.state().join("traces").join(format!("{id}.jsonl"))).unwrap();
    // Room again (the limit lifted, as freeing the disk would): the refused exec left nothing
    // in the sandbox, the file holds exactly the execs that ran.
    let lifted = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: prlimit on the supervisor this test started; `lifted` lives across the call.
    let rc = unsafe {
        libc::prlimit(
            sup.child.id() as libc::pid_t,
            libc::RLIMIT_FSIZE,
            &lifted,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/read"),
        Some(serde_json::json!({"path": "ran"})),
    );
    assert_eq!(status, 200, "{v}");
    let expected: String = (1..=ran).map(|i| format!("{i}\n")).collect();
    assert_eq!(v["content"], expected, "{v}");
    // And the trace read back whole: every exec that ran, none half-recorded.
    let execs = trace.ops.iter().filter(|o| o.op == "exec").count();
    assert_eq!(execs, ran - unrecorded);
    assert_eq!(trace.unfinished.len(), unrecorded, "{:?}", trace.unfinished);
    assert!(trace.unfinished.iter().all(|s| s.op == "exec"));
    assert!(
        trace
            .ops
            .iter()
            .filter(|o| o.op == "exec")
            .all(|o| o.start.is_some())
    );
}

/// The same with a state directory that is really full (as root: the traces on a small tmpfs
/// filled to the last block): the exec is refused with ENOSPC's reason, and nothing ran.
#[test]
fn an_exec_on_a_full_state_directory_is_refused_before_it_runs() {
    // Unprivileged, no file system can be mounted to fill (scripts/test.sh skips this test in
    // its rootless pass): the file-size limit test above stands for it there.
    if !taskbox_tests::require(
        taskbox_tests::is_root(),
        "mounting a small file system for the state directory needs root",
    ) {
        return;
    }
    let env = Env::new();
    let traces = env.state().join("traces");
    std::fs::create_dir_all(&traces).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&traces)
        .status()
        .unwrap();
    assert!(status.success());
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(traces.clone());
    let sup = taskbox_tests::Supervisor::start(&env, &[]);
    let (status, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(serde_json::json!({"workspace": env.ws()})),
    );
    assert_eq!(status, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    // Fill the file system.
    let filler = traces.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    let block = vec![0u8; 4096];
    while std::io::Write::write_all(&mut f, &block).is_ok() {}
    drop(f);
    // The start line is larger than a page, so the room left in the trace's last page (tmpfs
    // allocates by pages) cannot hold it.
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(serde_json::json!({"shell": "echo ran > marker", "env": {"PAD": "x".repeat(8192)}})),
    );
    assert_eq!(status, 503, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("refused before it ran") && msg.contains("No space left"),
        "{msg}"
    );
    // Room again: the marker was never written.
    std::fs::remove_file(&filler).unwrap();
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(serde_json::json!({"shell": "test -e marker && echo present || echo absent"})),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stdout"]["text"], "absent\n", "{v}");
}
