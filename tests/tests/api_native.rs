//! The narrow API through the Rust library on the native backend: long-lived sandboxes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::{Env, host_processes_with};

struct Fixture {
    env: Env,
    backend: NativeBackend,
    id: SandboxId,
}

fn fixture() -> Fixture {
    let env = Env::new();
    // SAFETY: tests of this binary set HOME only to a per-test scratch value before any thread
    // of theirs reads it; the sandbox plan reads it once at create.
    let backend = NativeBackend::new(env.state()).unwrap();
    let info = backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            ..CreateRequest::default()
        })
        .unwrap();
    Fixture {
        id: info.id,
        env,
        backend,
    }
}

fn sh(f: &Fixture, script: &str) -> taskbox_core::result::ExecResult {
    match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some(script.into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("expected a finished exec, got {other:?}"),
    }
}

#[test]
fn execs_share_files_and_tmp_across_calls() {
    let f = fixture();
    let r = sh(&f, "echo one > /tmp/state && echo two > work.txt");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = sh(&f, "cat /tmp/state work.txt");
    assert_eq!(r.stdout.text, "one\ntwo\n", "{r:?}");
    assert_eq!(r.enforcement.landlock, "full");
    assert!(r.enforcement.seccomp);
    assert!(
        !f.env.ws().join("work.txt").exists(),
        "the host workspace changed"
    );
}

#[test]
fn exec_reports_its_own_changes() {
    let f = fixture();
    f.env.write("a.txt", "a\n");
    let r = sh(&f, "echo x >> a.txt; echo new > b.txt");
    let paths: Vec<_> = r.changes.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(paths, ["a.txt", "b.txt"], "{r:?}");
    let r = sh(&f, "echo c > c.txt");
    let paths: Vec<_> = r.changes.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(paths, ["c.txt"], "{r:?}");
}

#[test]
fn exit_codes_signals_and_timeouts_match_one_shot_runs() {
    let f = fixture();
    assert_eq!(sh(&f, "exit 7").exit_code, Some(7));
    let r = sh(&f, "kill -TERM $$");
    assert_eq!((r.exit_code, r.signal), (None, Some(15)));
    let marker = format!("55{}.5", std::process::id());
    let start = Instant::now();
    let r = match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some(format!("echo partial; sleep {marker} & sleep {marker}")),
                timeout_ms: Some(700),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    assert!(r.timed_out);
    assert_eq!(r.stdout.text, "partial\n");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        host_processes_with(&marker).is_empty(),
        "the tree survived its timeout"
    );
    // The sandbox is still usable.
    assert_eq!(sh(&f, "echo alive").stdout.text, "alive\n");
}

#[test]
fn a_foreground_execs_leftovers_are_killed_but_background_execs_live_on() {
    let f = fixture();
    let marker = format!("66{}.5", std::process::id());
    let r = sh(&f, &format!("sleep {marker} & echo started"));
    assert_eq!(r.stdout.text, "started\n");
    assert!(
        host_processes_with(&marker).is_empty(),
        "a foreground leftover survived"
    );
    let bg = match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some(format!("echo ready; exec sleep {marker}")),
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
    assert!(bg.running);
    std::thread::sleep(Duration::from_millis(300));
    let p = f.backend.process(&f.id, bg.exec_id).unwrap();
    assert!(p.running, "{p:?}");
    assert_eq!(p.stdout.text, "ready\n");
    assert_eq!(host_processes_with(&marker).len(), 1);
    assert_eq!(sh(&f, "echo in-between").exit_code, Some(0));
    let p = f.backend.kill(&f.id, bg.exec_id, 9).unwrap();
    let _ = p;
    let p = f
        .backend
        .wait(&f.id, bg.exec_id, Duration::from_secs(5))
        .unwrap();
    assert!(!p.running, "{p:?}");
    assert_eq!(p.result.unwrap().signal, Some(9));
    assert!(host_processes_with(&marker).is_empty());
}

#[test]
fn background_stdin_can_be_written() {
    let f = fixture();
    let bg = match f
        .backend
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
    f.backend
        .write_stdin(&f.id, bg.exec_id, b"hello\n", true)
        .unwrap();
    let p = f
        .backend
        .wait(&f.id, bg.exec_id, Duration::from_secs(5))
        .unwrap();
    let r = p.result.expect("ended");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.stdout.text, "hello\n");
}

#[test]
fn streaming_events_arrive_in_order() {
    let f = fixture();
    let mut events = Vec::new();
    let mut sink = |e: ExecEvent| events.push(e);
    let out = f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("echo a; echo b >&2".into()),
                ..ExecRequest::default()
            },
            Some(&mut sink),
        )
        .unwrap();
    assert!(matches!(out, ExecOutcome::Finished(_)));
    assert!(matches!(events.first(), Some(ExecEvent::Started { .. })));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ExecEvent::Stdout { data } if data == "a\n"))
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ExecEvent::Stderr { data } if data == "b\n"))
    );
}

#[test]
fn destroy_leaves_nothing_behind() {
    let f = fixture();
    let marker = format!("77{}.5", std::process::id());
    let _ = f.backend.exec(
        &f.id,
        ExecRequest {
            shell: Some(format!("exec sleep {marker}")),
            background: true,
            ..ExecRequest::default()
        },
        None,
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(host_processes_with(&marker).len(), 1);
    f.backend.destroy(&f.id).unwrap();
    assert!(host_processes_with(&marker).is_empty());
    let dir = f.env.state().join("sandboxes").join(f.id.as_str());
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(matches!(f.backend.info(&f.id), Err(ApiError::NotFound(_))));
}

#[test]
fn missing_commands_and_bad_requests_are_clear() {
    let f = fixture();
    let r = match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                argv: Some(vec!["no-such-cmd-zz".into()]),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(r.exit_code, Some(127));
    assert!(r.stderr.text.contains("command not found"));
    let e = f
        .backend
        .exec(&f.id, ExecRequest::default(), None)
        .unwrap_err();
    assert!(matches!(e, ApiError::InvalidArgument(_)), "{e:?}");
    let e = f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("true".into()),
                cwd: Some("does/not/exist".into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap_err();
    assert!(matches!(e, ApiError::InvalidArgument(_)), "{e:?}");
    let other = SandboxId::parse("sb-0000000000000000").unwrap();
    assert!(matches!(f.backend.info(&other), Err(ApiError::NotFound(_))));
}

fn write(f: &Fixture, path: &str, content: &str) {
    f.backend
        .write(
            &f.id,
            WriteRequest {
                path: path.into(),
                content: content.into(),
                create_parents: true,
                ..WriteRequest::default()
            },
        )
        .unwrap();
}

fn read(f: &Fixture, path: &str) -> Result<String, ApiError> {
    f.backend
        .read(
            &f.id,
            ReadRequest {
                path: path.into(),
                ..ReadRequest::default()
            },
        )
        .map(|r| r.content)
}

#[test]
fn file_operations_see_what_execs_see_and_the_reverse() {
    let f = fixture();
    f.env.write("src/lib.rs", "fn a() {}\nfn b() {}\n");
    write(&f, "notes/todo.txt", "one\n");
    assert_eq!(sh(&f, "cat notes/todo.txt").stdout.text, "one\n");
    sh(&f, "echo from-exec > made.txt");
    assert_eq!(read(&f, "made.txt").unwrap(), "from-exec\n");
    let e = f
        .backend
        .edit(
            &f.id,
            EditRequest {
                path: "src/lib.rs".into(),
                old: "fn b() {}".into(),
                new: "fn b() { todo() }".into(),
                expected_count: None,
            },
        )
        .unwrap();
    assert!(e.diff.contains("+fn b() { todo() }"), "{}", e.diff);
    let found = f
        .backend
        .search(
            &f.id,
            SearchRequest {
                pattern: "todo".into(),
                ..SearchRequest::default()
            },
        )
        .unwrap();
    let paths: Vec<_> = found.matches.iter().map(|m| m.path.as_str()).collect();
    assert!(paths.contains(&"src/lib.rs"), "{found:?}");
    let listed = f
        .backend
        .list_dir(
            &f.id,
            ListRequest {
                max_depth: Some(3),
                ..ListRequest::default()
            },
        )
        .unwrap();
    assert!(
        listed.entries.iter().any(|e| e.path == "notes/todo.txt"),
        "{listed:?}"
    );
    // None of it reached the host.
    assert!(!f.env.ws().join("notes").exists());
    assert_eq!(
        std::fs::read_to_string(f.env.ws().join("src/lib.rs")).unwrap(),
        "fn a() {}\nfn b() {}\n"
    );
    // A planted symlink to a host secret leads nowhere.
    sh(&f, "ln -s /etc/shadow shadow-link");
    let r = read(&f, "shadow-link");
    assert!(r.is_err() || matches!(r.as_deref(), Ok("")), "{r:?}");
    assert!(matches!(
        read(&f, "../../etc/passwd"),
        Err(ApiError::PathRefused(_))
    ));
}

#[test]
fn diff_checkpoint_restore_and_export() {
    let f = fixture();
    f.env.write("a.txt", "a\n");
    write(&f, "a.txt", "a2\n");
    let d = f.backend.diff(&f.id, DiffRequest::default()).unwrap();
    assert_eq!(d.files.len(), 1);
    assert!(d.diff.contains("-a\n+a2\n"), "{}", d.diff);
    let c = f
        .backend
        .checkpoint(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    assert_eq!(c.files, 1);
    sh(&f, "echo b > b.txt; rm a.txt");
    let d = f
        .backend
        .diff(
            &f.id,
            DiffRequest {
                since: Some("one".into()),
            },
        )
        .unwrap();
    let got: Vec<_> = d
        .files
        .iter()
        .map(|x| (x.path.as_str(), x.status))
        .collect();
    assert_eq!(
        got,
        [
            ("a.txt", taskbox_core::result::ChangeKind::Deleted),
            ("b.txt", taskbox_core::result::ChangeKind::Added)
        ]
    );
    f.backend
        .restore(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    assert_eq!(
        sh(&f, "cat a.txt; ls b.txt 2>&1 || true")
            .stdout
            .text
            .lines()
            .next(),
        Some("a2")
    );
    assert_eq!(read(&f, "a.txt").unwrap(), "a2\n");
    assert!(read(&f, "b.txt").is_err());
    // Restore again: the checkpoint is reusable.
    write(&f, "c.txt", "c\n");
    f.backend
        .restore(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    assert!(read(&f, "c.txt").is_err());
    let e = f.backend.export(&f.id, ExportRequest::default()).unwrap();
    assert!(e.patch.unwrap().contains("+a2"));
    assert!(!e.applied);
    assert_eq!(
        std::fs::read_to_string(f.env.ws().join("a.txt")).unwrap(),
        "a\n"
    );
    let e = f
        .backend
        .export(
            &f.id,
            ExportRequest {
                format: ExportFormat::Tar,
                apply: true,
            },
        )
        .unwrap();
    assert!(e.applied);
    assert!(std::path::Path::new(&e.tar_path.unwrap()).is_file());
    assert_eq!(
        std::fs::read_to_string(f.env.ws().join("a.txt")).unwrap(),
        "a2\n"
    );
    assert!(matches!(
        f.backend.restore(
            &f.id,
            CheckpointRequest {
                name: "nope".into()
            }
        ),
        Err(ApiError::NotFound(_))
    ));
    assert!(matches!(
        f.backend.checkpoint(
            &f.id,
            CheckpointRequest {
                name: "../x".into()
            }
        ),
        Err(ApiError::InvalidArgument(_))
    ));
}

#[test]
fn spill_files_are_readable_through_the_api() {
    let f = fixture();
    let r = match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("seq 1 20000".into()),
                output_limit: Some(1000),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    assert!(r.stdout.truncated);
    let spill = r.stdout.spill_path.clone().unwrap();
    assert!(spill.starts_with("/tmp/.taskbox/out/"), "{spill}");
    let full = f
        .backend
        .read(
            &f.id,
            ReadRequest {
                path: spill.clone(),
                max_bytes: Some(10 << 20),
                ..ReadRequest::default()
            },
        )
        .unwrap();
    assert_eq!(full.total_bytes, r.stdout.bytes);
    assert!(full.content.ends_with("19999\n20000\n"));
    // The sandbox can read it too, but not write it.
    let r = sh(
        &f,
        &format!("tail -n 1 {spill}; echo x >> {spill} || echo refused"),
    );
    assert_eq!(r.stdout.text, "20000\nrefused\n", "{r:?}");
}

#[test]
fn the_sandbox_cannot_reach_pid1s_private_state_or_descriptors() {
    let f = fixture();
    let r = sh(
        &f,
        "ls /run/.taskbox 2>/dev/null && echo LISTED; chmod 755 /run/.taskbox 2>/dev/null && echo CHMODDED; \
         ls /run/.taskbox/state 2>/dev/null && echo ENTERED; ls -l /proc/1/fd/ 2>/dev/null | grep -c socket; \
         kill -9 1 2>/dev/null && echo KILLED; true",
    );
    let out = r.stdout.text.clone();
    for bad in ["LISTED", "CHMODDED", "ENTERED", "KILLED"] {
        assert!(!out.contains(bad), "{bad}: {out}");
    }
    assert_eq!(out.trim(), "0", "{out}");
    // pid 1 is alive: the next exec works.
    assert_eq!(sh(&f, "echo ok").stdout.text, "ok\n");
}

#[test]
fn protected_git_paths_read_through_the_api_but_never_write() {
    let f_env = Env::new();
    f_env.write(".git/config", "[core]\n");
    f_env.write(".git/hooks/README", "hooks\n");
    let backend = NativeBackend::new(f_env.state()).unwrap();
    let id = backend
        .create(CreateRequest {
            workspace: f_env.ws().display().to_string(),
            ..CreateRequest::default()
        })
        .unwrap()
        .id;
    let r = backend
        .read(
            &id,
            ReadRequest {
                path: ".git/config".into(),
                ..ReadRequest::default()
            },
        )
        .unwrap();
    assert_eq!(r.content, "[core]\n");
    let w = backend.write(
        &id,
        WriteRequest {
            path: ".git/hooks/pre-commit".into(),
            content: "evil".into(),
            ..WriteRequest::default()
        },
    );
    assert!(w.is_err(), "{w:?}");
    let e = backend.edit(
        &id,
        EditRequest {
            path: ".git/config".into(),
            old: "[core]".into(),
            new: "[core]\nhooksPath = /tmp".into(),
            expected_count: None,
        },
    );
    assert!(matches!(e, Err(ApiError::PathRefused(_))), "{e:?}");
    let p = backend.patch(
        &id,
        PatchRequest {
            patch: "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+evil\n".into(),
        },
    );
    assert!(matches!(p, Err(ApiError::PathRefused(_))), "{p:?}");
    for r in [
        backend.remove(
            &id,
            RemoveRequest {
                path: ".git".into(),
                recursive: true,
            },
        ),
        backend.rename(
            &id,
            MoveRequest {
                from: ".git/config".into(),
                to: "config".into(),
                overwrite: false,
            },
        ),
    ] {
        assert!(matches!(r, Err(ApiError::PathRefused(_))), "{r:?}");
    }
    // Inside, the protection still holds.
    let r = match backend
        .exec(
            &id,
            ExecRequest {
                shell: Some("echo x >> .git/config || echo refused".into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(r.stdout.text, "refused\n");
    assert_eq!(
        std::fs::read_to_string(f_env.ws().join(".git/config")).unwrap(),
        "[core]\n"
    );
}

#[test]
fn diff_reports_binary_files_and_mode_changes() {
    let f = fixture();
    f.env.write("run.sh", "echo hi\n");
    sh(&f, "chmod 755 run.sh; printf 'a\\000b' > blob.bin");
    let d = f.backend.diff(&f.id, DiffRequest::default()).unwrap();
    let run = d.files.iter().find(|x| x.path == "run.sh").unwrap();
    assert_eq!(
        run.mode_change.as_deref(),
        Some("100644 -> 100755"),
        "{d:?}"
    );
    assert!(!run.binary);
    let blob = d.files.iter().find(|x| x.path == "blob.bin").unwrap();
    assert!(blob.binary, "{d:?}");
    assert_eq!(blob.mode_change, None);
}
