//! Execs in Docker sandboxes against the real daemon: streams, exit codes, signals, timeouts
//! that kill the whole tree, stdin, background processes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use taskbox_core::api::*;
use taskbox_tests::big_exec;

#[test]
fn stdout_stderr_and_exit_codes_are_separate() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let r = h.sh(&id, "echo out; echo err >&2; exit 3");
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.signal, None);
    assert!(!r.timed_out);
    assert_eq!(r.stdout.text, "out\n");
    assert_eq!(r.stderr.text, "err\n");
    assert!(r.enforcement.seccomp);
    assert_eq!(r.enforcement.network, "none");
    assert!(r.enforcement.limits.starts_with("cgroup"));

    let r = h.sh(&id, "exit 137");
    assert_eq!(
        (r.exit_code, r.signal),
        (Some(137), None),
        "a code, not a signal"
    );
    let r = h.sh(&id, "kill -TERM $$");
    assert_eq!((r.exit_code, r.signal), (None, Some(15)));
    assert_eq!(r.cli_exit_status(), 143);

    // The environment: the image's, the request's; the user is the image's; cwd the workdir.
    let r = h.exec(
        &id,
        ExecRequest {
            shell: Some("echo $IMAGE_VAR $MINE; id -u; pwd".into()),
            env: [("MINE".to_string(), "yes".to_string())].into(),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout.text, "from-image yes\n1000\n/workspace\n");
    h.backend.destroy(&id).unwrap();
}

#[test]
fn missing_commands_and_directories_are_reported() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let r = h.exec(
        &id,
        ExecRequest {
            argv: Some(vec!["no-such-command".into()]),
            ..Default::default()
        },
    );
    assert_eq!(r.exit_code, Some(127));
    assert!(
        r.stderr.text.contains("command not found"),
        "{}",
        r.stderr.text
    );
    let e = h
        .backend
        .exec(
            &id,
            ExecRequest {
                argv: Some(vec!["true".into()]),
                cwd: Some("no/such/dir".into()),
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
    assert_eq!(e.code(), "not_found", "{e}");
    assert!(e.to_string().contains("working directory"), "{e}");
    // A relative cwd is inside the workspace.
    h.write("sub/f", "x");
    let r = h.exec(
        &id,
        ExecRequest {
            argv: Some(vec!["pwd".into()]),
            cwd: Some("sub".into()),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout.text, "/workspace/sub\n");
    let e = h
        .backend
        .exec(&id, ExecRequest::default(), None)
        .unwrap_err();
    assert_eq!(e.code(), "invalid_argument");
}

#[test]
fn a_timeout_kills_the_whole_tree_and_keeps_partial_output() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let start = Instant::now();
    let r = h.exec(
        &id,
        ExecRequest {
            // A double-forked daemon in its own session that keeps the output pipe open, and a
            // foreground sleep.
            shell: Some(
                "echo before; (setsid sh -c 'sleep 1000 & echo daemon-$$' &); sleep 1000".into(),
            ),
            timeout_ms: Some(1500),
            ..Default::default()
        },
    );
    let took = start.elapsed();
    assert!(r.timed_out);
    assert_eq!(r.exit_code, None);
    assert_eq!(r.signal, Some(9));
    assert_eq!(r.cli_exit_status(), 124);
    assert!(r.stdout.text.starts_with("before\n"), "{:?}", r.stdout.text);
    assert!(r.stdout.text.contains("daemon-"), "{:?}", r.stdout.text);
    assert!(r.violations.iter().any(|v| v.kind == "timeout"));
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // Nothing of the exec is left in the container: pid 1, and this check's own processes (its
    // exec wrapper, and runc's `[exe]` while it still sets that exec up). A killed process the
    // container's pid 1 has not reaped yet shows as `[sh]` for a moment: looked at again for up
    // to 3 s; a live leftover stays, and fails.
    let deadline = Instant::now() + Duration::from_secs(3);
    let ps = loop {
        let ps = h.sh(
            &id,
            "ps -o pid,args | grep -v -e PID -e 'init exec' -e 'ps -o' -e grep -e '\\[exe\\]'",
        );
        if ps.stdout.text.trim() == "1 /.taskbox/init init" || Instant::now() > deadline {
            break ps;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        ps.stdout.text.trim(),
        "1 /.taskbox/init init",
        "{}",
        ps.stdout.text
    );
}

#[test]
fn what_an_exec_leaves_running_ends_with_it() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let r = h.sh(
        &id,
        "(setsid sleep 1000 &); (nohup sleep 999 >/dev/null 2>&1 &); echo done",
    );
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout.text, "done\n");
    let ps = h.sh(&id, "ps -o comm | grep -c sleep");
    assert_eq!(ps.stdout.text.trim(), "0", "{}", ps.stdout.text);
}

#[test]
fn stdin_text_is_given_and_closed() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let r = h.exec(
        &id,
        ExecRequest {
            argv: Some(vec![
                "sh".into(),
                "-c".into(),
                "tr a-z A-Z; echo end".into(),
            ]),
            stdin: Some("hello\n".into()),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout.text, "HELLO\nend\n");
    // Without stdin text, stdin is empty.
    let r = h.sh(&id, "cat; echo rc=$?");
    assert_eq!(r.stdout.text, "rc=0\n");
}

#[test]
fn long_output_is_cut_to_head_and_tail_and_spilled() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let r = h.exec(
        &id,
        ExecRequest {
            shell: Some("i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done".into()),
            output_limit: Some(200),
            ..Default::default()
        },
    );
    assert!(r.stdout.truncated);
    assert!(r.stdout.text.starts_with("line 0\n"));
    assert!(r.stdout.text.ends_with("line 1999\n"));
    let spill = r.stdout.spill_path.clone().unwrap();
    assert!(spill.starts_with(taskbox_core::kit::SPILL_MOUNT), "{spill}");
    // The spill file is readable through the API and inside the sandbox.
    let read = h
        .backend
        .read(
            &id,
            ReadRequest {
                path: spill.clone(),
                max_bytes: Some(1 << 20),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(read.total_lines, Some(2000));
    let inside = h.sh(&id, &format!("wc -l < {spill}"));
    assert_eq!(inside.stdout.text.trim(), "2000");
    let w = h.sh(&id, &format!("echo x > {spill}"));
    assert_ne!(w.exit_code, Some(0), "spill files are read-only inside");
}

#[test]
fn background_execs_can_be_fed_waited_for_and_killed() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let bg = |script: &str| match h
        .backend
        .exec(
            &id,
            ExecRequest {
                shell: Some(script.into()),
                background: true,
                ..Default::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Background(p) => p,
        other => panic!("{other:?}"),
    };
    // stdin through write_stdin.
    let p = bg("while read l; do echo got $l; done; echo eof");
    assert!(p.running);
    h.backend
        .write_stdin(&id, p.exec_id, b"one\n", false)
        .unwrap();
    h.backend
        .write_stdin(&id, p.exec_id, b"two\n", true)
        .unwrap();
    let done = h
        .backend
        .wait(&id, p.exec_id, Duration::from_secs(20))
        .unwrap();
    assert!(!done.running);
    let r = done.result.unwrap();
    assert_eq!(r.stdout.text, "got one\ngot two\neof\n");
    assert_eq!(r.exit_code, Some(0));

    // Output so far, then a kill of the whole tree.
    let p = bg("echo started; (setsid sleep 1000 &); sleep 1000");
    assert!(wait_until(Duration::from_secs(10), || {
        h.backend.process(&id, p.exec_id).unwrap().stdout.text == "started\n"
    }));
    let still = h
        .backend
        .wait(&id, p.exec_id, Duration::from_millis(200))
        .unwrap();
    assert!(still.running);
    h.backend.kill(&id, p.exec_id, 9).unwrap();
    let killed = h
        .backend
        .wait(&id, p.exec_id, Duration::from_secs(20))
        .unwrap();
    assert!(!killed.running);
    let r = killed.result.unwrap();
    assert_eq!(r.signal, Some(9));
    assert_eq!(r.stdout.text, "started\n");
    let ps = h.sh(&id, "ps -o comm | grep -c sleep");
    assert_eq!(ps.stdout.text.trim(), "0");

    // Another signal goes to the main process only.
    let p = bg("trap 'echo term; exit 7' TERM; echo ready; while true; do sleep 0.1; done");
    assert!(wait_until(Duration::from_secs(10), || {
        h.backend.process(&id, p.exec_id).unwrap().stdout.text == "ready\n"
    }));
    h.backend.kill(&id, p.exec_id, 15).unwrap();
    let r = h
        .backend
        .wait(&id, p.exec_id, Duration::from_secs(20))
        .unwrap()
        .result
        .unwrap();
    assert_eq!(r.exit_code, Some(7));
    assert!(r.stdout.text.contains("term"));
    let e = h
        .backend
        .write_stdin(&id, p.exec_id, b"x", false)
        .unwrap_err();
    assert_eq!(e.code(), "conflict");
    assert_eq!(h.backend.process(&id, 999).unwrap_err().code(), "not_found");
}

#[test]
fn streamed_events_arrive_in_order() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    // As the server does: the callback blocks on a tokio channel (which panics inside an async
    // context, so the backend must call it from a plain thread).
    let (tx, mut rx) = tokio::sync::mpsc::channel::<ExecEvent>(1024);
    let mut cb = |e: ExecEvent| {
        tx.blocking_send(e).unwrap();
    };
    let out = h
        .backend
        .exec(
            &id,
            ExecRequest {
                shell: Some("echo a; echo b >&2".into()),
                ..Default::default()
            },
            Some(&mut cb),
        )
        .unwrap();
    assert!(matches!(out, ExecOutcome::Finished(_)));
    let mut seen = Vec::new();
    while let Ok(e) = rx.try_recv() {
        seen.push(e);
    }
    assert!(matches!(seen.first(), Some(ExecEvent::Started { .. })));
    let text: String = seen
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout { data } => Some(format!("out:{data}")),
            ExecEvent::Stderr { data } => Some(format!("err:{data}")),
            _ => None,
        })
        .collect();
    assert!(
        text.contains("out:a\n") && text.contains("err:b\n"),
        "{text}"
    );
}

#[test]
fn execs_of_every_size_run_or_are_refused_naming_the_limit() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let exec = |req: serde_json::Value| -> big_exec::Outcome {
        let req: ExecRequest = serde_json::from_value(req).unwrap();
        match h.backend.exec(&id, req, None) {
            Ok(ExecOutcome::Finished(r)) => Ok((r.exit_code.map(i64::from), r.stdout.text)),
            Ok(other) => panic!("expected a finished exec, got {other:?}"),
            Err(e) => Err((e.code().to_string(), e.to_string())),
        }
    };
    let name = h.backend.container_name(&id).unwrap();
    big_exec::check(&exec, big_exec::container_argument_space(&name));
    assert_eq!(h.backend.info(&id).unwrap().state, "running");
    h.backend.destroy(&id).unwrap();
}

/// Findings on the Docker backend: a failing test in the middle of a log longer than the
/// output limit (found though the text shows only its head and tail), and a JUnit XML file
/// the exec wrote in the workspace, at their files and lines relative to the workspace.
#[test]
fn findings_come_from_the_whole_stream_and_the_junit_files_the_exec_wrote() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let script = r#"
i=0; while [ $i -lt 3000 ]; do echo "test calc::tests::case_$i ... ok"; i=$((i+1)); done
printf 'test calc::tests::adds_two ... FAILED\n\nfailures:\n\n---- calc::tests::adds_two stdout ----\n\n'
printf "thread 'calc::tests::adds_two' panicked at src/calc.rs:12:9:\nassertion failed\n\n"
i=0; while [ $i -lt 3000 ]; do echo "test other::tests::case_$i ... ok"; i=$((i+1)); done
echo 'test result: FAILED. 6000 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out'
mkdir -p reports
printf '<testsuite name="s"><testcase classname="a.B" name="c" file="tests/b.py" line="4"><failure message="boom">x</failure></testcase></testsuite>' > reports/junit.xml
exit 101
"#;
    let r = h.exec(
        &id,
        ExecRequest {
            shell: Some(script.into()),
            output_limit: Some(4096),
            ..Default::default()
        },
    );
    assert_eq!(r.exit_code, Some(101), "the findings change no outcome");
    assert!(r.stdout.truncated && !r.stdout.text.contains("adds_two"));
    let got: Vec<_> = r
        .findings
        .iter()
        .map(|f| {
            let l = f.location.as_ref().unwrap();
            (f.tool.as_str(), f.name.as_deref(), l.file.as_str(), l.line)
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "cargo-test",
                Some("calc::tests::adds_two"),
                "src/calc.rs",
                Some(12)
            ),
            ("junit", Some("a.B.c"), "tests/b.py", Some(4)),
        ],
        "{:#?}",
        r.findings
    );
    assert_eq!(r.tests.map(|t| (t.passed, t.failed)), Some((6000, 1)));
}
