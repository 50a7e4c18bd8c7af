//! The narrow API through the Rust library on the native backend: long-lived sandboxes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::{Env, big_exec, children_with, descriptors_of, host_processes_with, parent_of};

struct Fixture {
    env: Env,
    backend: NativeBackend,
    id: SandboxId,
}

fn fixture() -> Fixture {
    fixture_with(|_| ()).0
}

/// [`fixture`], with `before` run on the environment before the sandbox is made (what it
/// returns is kept alive beside the fixture).
fn fixture_with<T>(before: impl FnOnce(&Env) -> T) -> (Fixture, T) {
    let env = Env::new();
    let kept = before(&env);
    // SAFETY: tests of this binary set HOME only to a per-test scratch value before any thread
    // of theirs reads it; the sandbox plan reads it once at create.
    let backend = NativeBackend::new(env.state()).unwrap();
    let info = backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            ..CreateRequest::default()
        })
        .unwrap();
    let f = Fixture {
        id: info.id,
        env,
        backend,
    };
    (f, kept)
}

fn sh(f: &Fixture, script: &str) -> taskbox_core::result::ExecResult {
    taskbox_tests::shell(&f.backend, &f.id, script)
}

/// A long-lived sandbox's helper is forked by the backend's zygote, which loaded the helper
/// binary once: this process is the helper's parent, the helper holds its own descriptors and
/// nothing of the zygote's, and `ps` names its sandbox. A zygote that dies is replaced at the
/// next create, and reaped.
#[test]
fn helpers_are_forked_by_one_zygote_and_hold_only_their_own_descriptors() {
    let f = fixture();
    let me = std::process::id();
    let helpers = children_with(me, f.id.as_str());
    assert_eq!(
        helpers.len(),
        1,
        "one helper, a child of this process, named by its sandbox"
    );
    // Its standard streams, its status pipe and the pipe its pid 1 watches, as a spawned helper
    // has: no zygote socket, no descriptor of another sandbox, nothing this process inherited.
    let fds = descriptors_of(helpers[0]);
    let link = |fd: i32| {
        std::fs::read_link(format!("/proc/{}/fd/{fd}", helpers[0]))
            .unwrap()
            .display()
            .to_string()
    };
    assert_eq!(&fds[..4], [0, 1, 2, 3], "{fds:?}");
    assert!(link(2).contains("taskbox-helper-log"), "{}", link(2));
    assert_eq!(fds.len(), 5, "{fds:?}");
    assert!(link(fds[4]).starts_with("pipe:"), "{}", link(fds[4]));
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", helpers[0])).unwrap();
    let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    assert_eq!(
        &words[1..3],
        [b"-".as_slice(), f.id.as_str().as_bytes()],
        "its label"
    );
    // This backend's (the tests of a binary may share one process, each with its backend).
    let zygote = format!("--zygote {}", f.env.state().display());
    let zygotes = children_with(me, &zygote);
    assert_eq!(zygotes.len(), 1, "one zygote");

    let create = || {
        f.backend
            .create(CreateRequest {
                workspace: f.env.ws().display().to_string(),
                ..CreateRequest::default()
            })
            .unwrap()
            .id
    };
    let second = create();
    assert_eq!(children_with(me, &zygote), zygotes, "the same zygote");
    assert_eq!(children_with(me, second.as_str()).len(), 1);

    // SAFETY: kill has no memory arguments; the zygote is this test's child.
    unsafe { libc::kill(zygotes[0], libc::SIGKILL) };
    // Dead (a zombie until the backend reaps it): the next create finds it gone.
    let dead = || {
        std::fs::read_to_string(format!("/proc/{}/stat", zygotes[0])).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dead() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(dead(), "the zygote did not die");
    let third = create();
    let now = children_with(me, &zygote);
    assert_eq!(now.len(), 1, "a new zygote: {now:?}");
    assert_ne!(now, zygotes);
    assert_eq!(parent_of(zygotes[0]), None, "the dead zygote was reaped");
    for id in [&f.id, &second, &third] {
        let r = taskbox_tests::shell(&f.backend, id, "echo ok");
        assert_eq!(r.stdout.text, "ok\n", "{id}: {r:?}");
    }
}

/// A host socket bound inside the workspace is masked by the shared mask file, and stays
/// masked through a restore (which remounts the workspace with its guards, from pid 1's private
/// view of the layers and the mask file).
#[test]
fn a_masked_host_socket_in_the_workspace_stays_masked_after_a_restore() {
    let (f, _svc) = fixture_with(|env| {
        std::os::unix::net::UnixListener::bind(env.ws().join("svc.sock")).unwrap()
    });
    let probe = "if test -S svc.sock; then echo socket; else echo masked; fi";
    assert_eq!(sh(&f, probe).stdout.text, "masked\n");
    f.backend
        .checkpoint(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    sh(&f, "echo x > x.txt");
    f.backend
        .restore(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    let r = sh(&f, &format!("{probe}; test -e x.txt || echo restored"));
    assert_eq!(r.stdout.text, "masked\nrestored\n", "{r:?}");
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
    let r = taskbox_tests::finished(
        &f.backend,
        &f.id,
        ExecRequest {
            shell: Some(format!("echo partial; sleep {marker} & sleep {marker}")),
            timeout_ms: Some(700),
            ..ExecRequest::default()
        },
    );
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
    let bg = background(&f, &format!("echo ready; exec sleep {marker}"));
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

/// One reaper serves exec after exec (no fork and no exit per exec): sequential commands have
/// the same parent; each is confined as the first was, and nothing of one exec (a leftover, a
/// timed-out tree) reaches the next; after 256 execs the reaper retires and the spare takes
/// over, seamlessly.
#[test]
fn a_reaper_serves_exec_after_exec_and_each_starts_clean() {
    let f = fixture();
    let parent = |f: &Fixture| {
        let r = sh(f, "echo $PPID");
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        r.stdout.text.trim().to_string()
    };
    let first = parent(&f);
    let marker = format!("67{}.5", std::process::id());
    let r = sh(&f, &format!("sleep {marker} & echo started"));
    assert_eq!(r.stdout.text, "started\n");
    assert!(
        host_processes_with(&marker).is_empty(),
        "a leftover survived"
    );
    let r = taskbox_tests::finished(
        &f.backend,
        &f.id,
        ExecRequest {
            shell: Some(format!("sleep {marker} & sleep {marker}")),
            timeout_ms: Some(300),
            ..ExecRequest::default()
        },
    );
    assert!(r.timed_out, "{r:?}");
    assert!(
        host_processes_with(&marker).is_empty(),
        "the timed-out tree survived"
    );
    // The same reaper, and the next command as confined as the first: Landlock refuses a write
    // outside the workspace and /tmp, seccomp refuses unshare.
    let r = sh(
        &f,
        "echo $PPID; touch /usr/taskbox-reaper-probe 2>/dev/null && echo wrote; \
         unshare -U true 2>/dev/null && echo unshared; echo done",
    );
    assert_eq!(r.stdout.text, format!("{first}\ndone\n"), "{r:?}");
    assert_eq!(r.enforcement.landlock, "full");
    assert!(r.enforcement.seccomp);
    // 256 execs per reaper (the first has served those above, and whatever the sandbox's
    // start ran): one change of parent, to the spare, which serves on.
    let parents: Vec<String> = (0..256).map(|_| parent(&f)).collect();
    let served = parents.iter().take_while(|p| **p == first).count();
    assert!((240..=252).contains(&served), "{served}: {parents:?}");
    let next = &parents[served];
    assert_ne!(*next, first);
    assert!(parents[served..].iter().all(|p| p == next), "{parents:?}");
}

#[test]
fn background_stdin_can_be_written() {
    let f = fixture();
    let bg = start(
        &f,
        ExecRequest {
            argv: Some(vec!["/bin/cat".into()]),
            ..ExecRequest::default()
        },
    );
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
    assert!(matches!(
        f.backend.info(&f.id),
        Err(ApiError::SandboxNotFound(_))
    ));
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
    assert!(matches!(e, ApiError::NotFound(_)), "{e:?}");
    let other = SandboxId::parse("sb-0000000000000000").unwrap();
    assert!(matches!(
        f.backend.info(&other),
        Err(ApiError::SandboxNotFound(_))
    ));
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
                ..Default::default()
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
                ..Default::default()
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
    let req = ExecRequest {
        shell: Some("seq 1 20000".into()),
        output_limit: Some(1000),
        ..ExecRequest::default()
    };
    let r = taskbox_tests::finished(&f.backend, &f.id, req);
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

/// The first create of an origin (the same request: workspace, policy, environment) is proven
/// by a probe exec, which finds the enforcement in force; a later create of the same origin
/// takes what it found and runs nothing before the caller's first exec (a spill file is named
/// by its exec's number: the probe was exec 1 of the first sandbox). Another origin probes.
#[test]
fn a_later_create_of_an_origin_takes_the_probed_enforcement_without_a_probe() {
    let env = Env::new();
    let backend = NativeBackend::new(env.state()).unwrap();
    let request = |env_var: &str| CreateRequest {
        workspace: env.ws().display().to_string(),
        env: [("ORIGIN".to_string(), env_var.to_string())].into(),
        ..CreateRequest::default()
    };
    let first_spill = |id: &SandboxId| {
        let req = ExecRequest {
            shell: Some("seq 1 2000".into()),
            output_limit: Some(100),
            ..ExecRequest::default()
        };
        let r = taskbox_tests::finished(&backend, id, req);
        (r.stdout.spill_path.unwrap(), r.enforcement)
    };
    let a = backend.create(request("one")).unwrap();
    let b = backend.create(request("one")).unwrap();
    let c = backend.create(request("two")).unwrap();
    assert_ne!(a.enforcement.landlock, "unknown", "{a:?}");
    assert_eq!(b.enforcement, a.enforcement);
    assert_eq!(c.enforcement, a.enforcement);
    let (spill_a, in_a) = first_spill(&a.id);
    let (spill_b, in_b) = first_spill(&b.id);
    let (spill_c, _) = first_spill(&c.id);
    assert_eq!(spill_a, "/tmp/.taskbox/out/2.stdout", "the probe ran first");
    assert_eq!(spill_b, "/tmp/.taskbox/out/1.stdout", "no probe ran");
    assert_eq!(
        spill_c, "/tmp/.taskbox/out/2.stdout",
        "another origin is probed"
    );
    // What the later sandbox was given is what its execs find.
    assert_eq!(in_b, b.enforcement);
    assert_eq!(in_a, in_b);
    for id in [a.id, b.id, c.id] {
        backend.destroy(&id).unwrap();
    }
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

// ---- Image roots -------------------------------------------------------------------------------

use std::path::{Path, PathBuf};
use std::sync::Arc;

use taskbox_core::image::{ImageConfig, ImageRoot};
use taskbox_core::native::{RunOutcome, RunRequest, StdinSource};
use taskbox_core::result::ChangeKind;
use taskbox_tests::image::{self, TestImages};

/// A one-shot run of `script` with `image` as the root (and `root_upper` for build mode).
fn run_in_image(
    env: &Env,
    image: &ImageRoot,
    root_upper: Option<PathBuf>,
    script: &str,
) -> RunOutcome {
    taskbox_core::native::run(&RunRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        workspace: env.ws(),
        policy: taskbox_core::policy::Policy::default(),
        timeout: Some(Duration::from_secs(60)),
        write_through: false,
        env: Vec::new(),
        cwd: None,
        stdin: StdinSource::Null,
        echo: false,
        detach_cleanup: false,
        want_diff: true,
        state_dir: env.state(),
        image: Some(image.clone()),
        root_upper,
    })
    .unwrap()
}

/// A busybox image in `env`'s scratch directory.
fn busybox_image(env: &Env, config: ImageConfig) -> ImageRoot {
    let rootfs = image::busybox_rootfs(&env.dir.path().join("rootfs"));
    image::image_root("busybox-test", &rootfs, config)
}

/// A long-lived sandbox with `image` as its root, on a backend that knows only that image.
fn image_fixture(env: Env, image: &ImageRoot) -> Fixture {
    let images = Arc::new(TestImages::default());
    images.add("busybox-test", image.clone());
    let backend = NativeBackend::new(env.state()).unwrap().with_images(images);
    let info = backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            image: Some("busybox-test".into()),
            ..CreateRequest::default()
        })
        .unwrap();
    assert_eq!(info.image, image.digest);
    Fixture {
        id: info.id,
        env,
        backend,
    }
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn an_image_run_sees_the_image_not_the_host_and_writes_only_the_workspace_and_tmp() {
    if !image::available() {
        return;
    }
    let env = Env::new();
    let img = busybox_image(&env, ImageConfig::default());
    env.write("a.txt", "a\n");
    env.write("del.txt", "gone\n");
    let before = image::tree_state(&img.rootfs);
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        r#"
        echo "pwd=$(pwd)"
        echo "marker=$(cat /etc/image-marker)"
        test -x /bin/busybox && echo busybox=yes
        for p in {exe} {ws} {rootfs} /usr/bin/python3 /etc/hostname /etc/os-release; do
          test -e "$p" && echo "visible=$p"
        done
        echo "path=$PATH"
        echo "home=$HOME"
        touch /etc/new 2>/dev/null; echo "touch-etc=$?"
        mkdir /newdir 2>/dev/null; echo "mkdir-root=$?"
        touch /bin/busybox 2>/dev/null; echo "touch-busybox=$?"
        touch /run/x 2>/dev/null; echo "touch-run=$?"
        echo t > /tmp/t && echo "tmp=$(cat /tmp/t)"
        echo new > new.txt; echo more >> a.txt; rm del.txt
        "#,
        exe = exe.display(),
        ws = env.ws().display(),
        rootfs = img.rootfs.display(),
    );
    let out = run_in_image(&env, &img, None, &script);
    let r = &out.result;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let home = if taskbox_tests::is_root() {
        "/root"
    } else {
        "/"
    };
    assert_eq!(
        lines(&r.stdout.text),
        [
            "pwd=/workspace",
            "marker=busybox-test-image",
            "busybox=yes",
            "path=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            &format!("home={home}"),
            "touch-etc=1",
            "mkdir-root=1",
            "touch-busybox=1",
            // A private tmpfs the command's uid may write, but Landlock does not allow.
            "touch-run=1",
            "tmp=t",
        ],
        "{r:?}"
    );
    // Writes to the root fail as a read-only file system, not by accident.
    let r2 = run_in_image(&env, &img, None, "touch /etc/new");
    assert!(
        r2.result.stderr.text.contains("Read-only file system"),
        "{:?}",
        r2.result
    );
    // The observation is the host view's: changes, diff, enforcement.
    let mut changes: Vec<_> = r
        .changes
        .iter()
        .map(|c| (c.path.as_str(), c.kind))
        .collect();
    changes.sort();
    assert_eq!(
        changes,
        [
            ("a.txt", ChangeKind::Modified),
            ("del.txt", ChangeKind::Deleted),
            ("new.txt", ChangeKind::Added)
        ]
    );
    let diff = out.diff.unwrap();
    assert!(diff.contains("+more") && diff.contains("-gone") && diff.contains("+new"));
    assert_eq!(r.enforcement.landlock, "full");
    assert!(r.enforcement.seccomp);
    assert_eq!(r.enforcement.network, "none");
    // Nothing reached the host workspace or the image.
    assert_eq!(
        std::fs::read_to_string(env.ws().join("a.txt")).unwrap(),
        "a\n"
    );
    assert!(env.ws().join("del.txt").exists());
    assert!(!env.ws().join("new.txt").exists());
    assert_eq!(image::tree_state(&img.rootfs), before);
}

#[test]
fn an_image_user_is_who_commands_are_and_the_workspace_stays_writable() {
    if !image::available() {
        return;
    }
    let env = Env::new();
    let img = busybox_image(
        &env,
        ImageConfig {
            user: Some("1000:1000".into()),
            ..ImageConfig::default()
        },
    );
    env.write("sub/a.txt", "a\n");
    let out = run_in_image(
        &env,
        &img,
        None,
        "id -u; id -g; echo $HOME; echo b >> sub/a.txt && echo x > w.txt && echo wrote; \
         stat -c %u w.txt",
    );
    let r = &out.result;
    assert_eq!(
        lines(&r.stdout.text),
        ["1000", "1000", "/home/dev", "wrote", "1000"],
        "{r:?}"
    );
    // A user given by uid alone takes its group from the image's /etc/passwd.
    let img = ImageRoot {
        config: ImageConfig {
            user: Some("1000".into()),
            ..ImageConfig::default()
        },
        ..img
    };
    let r = run_in_image(&env, &img, None, "id -g").result;
    assert_eq!(r.stdout.text, "1000\n", "{r:?}");
}

#[test]
fn build_mode_writes_the_steps_changes_into_root_upper_and_leaves_the_image_alone() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if !image::available() {
        return;
    }
    let env = Env::new();
    let img = busybox_image(
        &env,
        ImageConfig {
            user: Some("0:0".into()),
            ..ImageConfig::default()
        },
    );
    std::fs::write(img.rootfs.join("etc/to-delete"), "old\n").unwrap();
    std::fs::write(img.rootfs.join("etc/to-modify"), "old\n").unwrap();
    std::fs::create_dir_all(img.rootfs.join("opt/dir")).unwrap();
    std::fs::write(img.rootfs.join("opt/dir/old-file"), "old\n").unwrap();
    let before = image::tree_state(&img.rootfs);
    let layer = env.dir.path().join("layer");
    let upper = layer.join("upper");
    let out = run_in_image(
        &env,
        &img,
        Some(upper.clone()),
        "set -e; id -u; echo created > /etc/created; rm /etc/to-delete; \
         echo changed >> /etc/to-modify; rm -r /opt/dir; mkdir /opt/dir; echo fresh > /opt/dir/new; \
         mkdir -p /usr/local/bin; busybox --install -s /usr/local/bin; \
         test -L /usr/local/bin/vi && echo installed; echo ws > ws.txt; \
         cp /bin/busybox /usr/local/bin/suid; chmod 4755 /usr/local/bin/suid",
    );
    let r = &out.result;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout.text, "0\ninstalled\n", "{r:?}");
    assert_eq!(r.enforcement.landlock, "full");
    assert!(r.enforcement.seccomp);
    // The step's changes are an overlay upper layer.
    assert_eq!(
        std::fs::read_to_string(upper.join("etc/created")).unwrap(),
        "created\n"
    );
    assert_eq!(
        std::fs::read_to_string(upper.join("etc/to-modify")).unwrap(),
        "old\nchanged\n"
    );
    let wh = std::fs::symlink_metadata(upper.join("etc/to-delete")).unwrap();
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0, "{wh:?}");
    assert_eq!(
        xattr(&upper.join("opt/dir"), "user.overlay.opaque"),
        Some(b"y".to_vec())
    );
    assert!(!upper.join("opt/dir/old-file").exists());
    assert_eq!(
        std::fs::read_link(upper.join("usr/local/bin/vi")).unwrap(),
        Path::new("/bin/busybox")
    );
    // A step may set setuid bits (package installs do): only write-through refuses them.
    let suid = std::fs::metadata(upper.join("usr/local/bin/suid")).unwrap();
    assert_eq!(suid.mode() & 0o7777, 0o4755);
    // Mount points are not part of the layer, nor is the workspace.
    for p in [
        "proc",
        "dev",
        "tmp",
        "run",
        "workspace",
        "ws.txt",
        "workspace/ws.txt",
    ] {
        assert!(!upper.join(p).exists(), "{p} in the layer");
    }
    // The workspace still behaves as in any run.
    assert_eq!(
        r.changes
            .iter()
            .map(|c| c.path.as_str())
            .collect::<Vec<_>>(),
        ["ws.txt"]
    );
    assert!(!env.ws().join("ws.txt").exists());
    // The image is untouched, and the overlay's work directory is gone.
    assert_eq!(image::tree_state(&img.rootfs), before);
    let left: Vec<_> = std::fs::read_dir(&layer)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["upper"]);
    // A second step on the same layer sees the first one's changes.
    let r = run_in_image(
        &env,
        &img,
        Some(upper),
        "cat /etc/created; ls /etc/to-delete 2>&1",
    )
    .result;
    assert!(r.stdout.text.starts_with("created\n"), "{r:?}");
    assert!(r.stdout.text.contains("No such file"), "{r:?}");
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: both strings are NUL-terminated and live; `buf` is writable for its length.
    let len =
        unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if len < 0 {
        return None;
    }
    buf.truncate(len as usize);
    Some(buf)
}

#[test]
fn sandboxes_share_one_read_only_image_root() {
    if !image::available() {
        return;
    }
    let env = Env::new();
    let img = busybox_image(&env, ImageConfig::default());
    let before = image::tree_state(&img.rootfs);
    let images = Arc::new(TestImages::default());
    images.add("busybox-test", img.clone());
    let backend = NativeBackend::new(env.state()).unwrap().with_images(images);
    let create = || {
        backend
            .create(CreateRequest {
                workspace: env.ws().display().to_string(),
                image: Some(img.digest.clone()),
                ..CreateRequest::default()
            })
            .unwrap()
    };
    let (a, b) = (create(), create());
    assert_eq!(
        (a.image.as_str(), b.image.as_str()),
        (img.digest.as_str(), img.digest.as_str())
    );
    let exec = |id: &SandboxId, script: &str| match backend
        .exec(
            id,
            ExecRequest {
                shell: Some(script.into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    let r = exec(
        &a.id,
        "echo a > /tmp/mine; echo a > ws.txt; touch /etc/evil 2>/dev/null || echo ro",
    );
    assert_eq!(r.stdout.text, "ro\n", "{r:?}");
    let r = exec(
        &b.id,
        "cat /tmp/mine ws.txt 2>/dev/null; echo b > /tmp/mine; touch /etc/evil 2>/dev/null || echo ro",
    );
    assert_eq!(r.stdout.text, "ro\n", "{r:?}");
    assert_eq!(exec(&a.id, "cat /tmp/mine ws.txt").stdout.text, "a\na\n");
    // The root is an overlay mounted read-only (and nosuid, nodev).
    let r = exec(
        &a.id,
        r#"awk '$5 == "/" { for (i = 7; i <= NF; i++) if ($i == "-") print $(i+1), $6 }' /proc/self/mountinfo"#,
    );
    let root = r.stdout.text.trim();
    assert!(root.starts_with("overlay ro,nosuid,nodev"), "{r:?}");
    backend.destroy(&a.id).unwrap();
    backend.destroy(&b.id).unwrap();
    assert_eq!(image::tree_state(&img.rootfs), before);
}

#[test]
fn an_image_sandbox_offers_the_whole_api_at_the_image_workdir() {
    if !image::available() {
        return;
    }
    let env = Env::new();
    env.write("a.txt", "a\n");
    env.write(".git/config", "[core]\n");
    env.write(".git/hooks/README", "hooks\n");
    let img = busybox_image(
        &env,
        ImageConfig {
            env: vec![
                ("PATH".into(), "/bin:/usr/bin:/sbin:/usr/sbin".into()),
                ("IMAGE_VAR".into(), "from-image".into()),
            ],
            workdir: "/src/app".into(),
            user: Some("1000:1000".into()),
            shell: vec!["/bin/ash".into(), "-c".into()],
        },
    );
    let f = image_fixture(env, &img);
    let info = f.backend.info(&f.id).unwrap();
    assert_eq!(
        Path::new(&info.workspace),
        std::fs::canonicalize(f.env.ws()).unwrap()
    );
    assert_eq!(info.enforcement.landlock, "full");
    let r = sh(&f, "pwd; echo $0; echo $IMAGE_VAR; echo $PATH; id -u");
    assert_eq!(
        lines(&r.stdout.text),
        [
            "/src/app",
            "/bin/ash",
            "from-image",
            "/bin:/usr/bin:/sbin:/usr/sbin",
            "1000"
        ],
        "{r:?}"
    );
    // File operations and execs see one workspace; absolute paths are the sandbox's.
    write(&f, "notes.txt", "one\n");
    assert_eq!(sh(&f, "cat /src/app/notes.txt").stdout.text, "one\n");
    assert_eq!(read(&f, "/src/app/notes.txt").unwrap(), "one\n");
    assert_eq!(
        read(&f, "/etc/image-marker").unwrap(),
        sh(&f, "cat /etc/image-marker").stdout.text
    );
    let r = sh(
        &f,
        "mkdir sub && echo b > sub/b.txt && ln -s /etc/image-marker link",
    );
    assert_eq!(
        r.changes
            .iter()
            .map(|c| c.path.as_str())
            .collect::<Vec<_>>(),
        ["link", "sub/b.txt"]
    );
    // A planted absolute symlink resolves inside the workspace for the supervisor.
    assert!(read(&f, "link").is_err());
    let r = match f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                argv: Some(vec!["pwd".into()]),
                cwd: Some("sub".into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Finished(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(r.stdout.text, "/src/app/sub\n");
    // Diff, checkpoint, restore.
    let d = f.backend.diff(&f.id, DiffRequest::default()).unwrap();
    let files: Vec<_> = d.files.iter().map(|x| x.path.as_str()).collect();
    assert_eq!(files, ["link", "notes.txt", "sub/b.txt"], "{d:?}");
    f.backend
        .checkpoint(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    sh(&f, "rm a.txt notes.txt; echo late > late.txt");
    f.backend
        .restore(&f.id, CheckpointRequest { name: "one".into() })
        .unwrap();
    assert_eq!(sh(&f, "cat a.txt notes.txt").stdout.text, "a\none\n");
    assert!(read(&f, "late.txt").is_err());
    assert_eq!(sh(&f, "pwd").stdout.text, "/src/app\n");
    // Protected paths hold at the workdir, before and after a restore.
    assert_eq!(
        sh(&f, "echo x >> .git/config || echo refused").stdout.text,
        "refused\n"
    );
    let w = f.backend.write(
        &f.id,
        WriteRequest {
            path: ".git/hooks/pre-commit".into(),
            content: "evil".into(),
            ..WriteRequest::default()
        },
    );
    assert!(matches!(w, Err(ApiError::PathRefused(_))), "{w:?}");
    // Export, then apply to the host.
    let e = f.backend.export(&f.id, ExportRequest::default()).unwrap();
    assert!(e.patch.unwrap().contains("+one"));
    let e = f
        .backend
        .export(
            &f.id,
            ExportRequest {
                format: ExportFormat::Patch,
                apply: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(e.applied);
    assert_eq!(
        std::fs::read_to_string(f.env.ws().join("sub/b.txt")).unwrap(),
        "b\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.env.ws().join(".git/config")).unwrap(),
        "[core]\n"
    );
}

#[test]
fn nothing_of_the_host_is_reachable_from_an_image_root() {
    use std::os::unix::fs::symlink;
    if !image::available() {
        return;
    }
    let env = Env::new();
    let img = busybox_image(&env, ImageConfig::default());
    let exe = std::env::current_exe().unwrap();
    let host_file = env.ws().join("host-secret");
    std::fs::write(&host_file, "secret\n").unwrap();
    // Symlinks in the image that name host paths, absolute and climbing.
    let etc = img.rootfs.join("etc");
    symlink("/etc/hostname", etc.join("host-hostname")).unwrap();
    symlink(&exe, etc.join("host-exe")).unwrap();
    symlink(&host_file, etc.join("host-secret")).unwrap();
    symlink("../../../../../../../../../etc/hostname", etc.join("climb")).unwrap();
    symlink("/", etc.join("slash")).unwrap();
    let targets = [
        "/etc/host-hostname".to_string(),
        "/etc/host-exe".into(),
        "/etc/host-secret".into(),
        "/etc/climb".into(),
        "/etc/slash/etc/hostname".into(),
        "/proc/1/root/etc/hostname".into(),
        "/proc/self/root/etc/hostname".into(),
        format!("/proc/1/root{}", exe.display()),
        format!("/proc/self/root{}", exe.display()),
        format!("/proc/self/cwd/../../..{}", host_file.display()),
        exe.display().to_string(),
        host_file.display().to_string(),
        img.rootfs.join("etc/image-marker").display().to_string(),
    ];
    let script = format!(
        r#"
        for p in {}; do
          if cat "$p" >/dev/null 2>&1; then echo "LEAK $p"; fi
        done
        cd /; cd ../../..; echo "top=$(pwd)"
        echo "root=$(ls / | tr '\n' ' ')"
        echo "up=$(ls ../../.. | tr '\n' ' ')"
        echo "self=$(ls /proc/self/root/ | tr '\n' ' ')"
        cat /etc/slash/etc/image-marker
        "#,
        targets.join(" ")
    );
    let r = run_in_image(&env, &img, None, &script).result;
    // The image's own top level, and the mount points the sandbox adds.
    let mut top: Vec<String> = std::fs::read_dir(&img.rootfs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .chain(["dev", "proc", "run", "workspace"].map(String::from))
        .collect();
    top.sort();
    top.dedup();
    let image_top = format!("{} ", top.join(" "));
    assert_eq!(
        lines(&r.stdout.text),
        [
            "top=/",
            &format!("root={image_top}"),
            &format!("up={image_top}"),
            &format!("self={image_top}"),
            "busybox-test-image",
        ],
        "{r:?}"
    );
    // The same from a long-lived sandbox, whose pid 1 keeps capabilities.
    let f = image_fixture(env, &img);
    let r = sh(&f, &script);
    assert_eq!(r.stdout.text.lines().next(), Some("top=/"), "{r:?}");
    assert!(!r.stdout.text.contains("LEAK"), "{r:?}");
}

#[test]
fn images_need_an_image_store_and_a_usable_config() {
    let env = Env::new();
    let backend = NativeBackend::new(env.state()).unwrap();
    let e = backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            image: Some("busybox".into()),
            ..CreateRequest::default()
        })
        .unwrap_err();
    assert!(
        matches!(&e, ApiError::InvalidArgument(m) if m.contains("image store")),
        "{e:?}"
    );
    // "host" is the host view, as SandboxInfo and traces name it.
    let info = backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            image: Some("host".into()),
            ..CreateRequest::default()
        })
        .unwrap();
    assert_eq!(info.image, "host");
    backend.destroy(&info.id).unwrap();
    drop(backend);

    if !image::available() {
        return;
    }
    let img = busybox_image(&env, ImageConfig::default());
    let images = Arc::new(TestImages::default());
    images.add("busybox-test", img.clone());
    images.add(
        "bad-workdir",
        ImageRoot {
            config: ImageConfig {
                workdir: "/proc/x".into(),
                ..ImageConfig::default()
            },
            ..img.clone()
        },
    );
    images.add(
        "bad-user",
        ImageRoot {
            config: ImageConfig {
                user: Some("dev".into()),
                ..ImageConfig::default()
            },
            ..img.clone()
        },
    );
    let backend = NativeBackend::new(env.state()).unwrap().with_images(images);
    let create = |image: &str| {
        backend.create(CreateRequest {
            workspace: env.ws().display().to_string(),
            image: Some(image.into()),
            ..CreateRequest::default()
        })
    };
    assert!(matches!(create("missing"), Err(ApiError::NotFound(_))));
    for bad in ["bad-workdir", "bad-user"] {
        let e = create(bad).unwrap_err();
        assert!(
            matches!(&e, ApiError::InvalidArgument(m) if m.contains(&img.digest)),
            "{e:?}"
        );
    }
    // A one-shot build step needs an image.
    let e = taskbox_core::native::run(&RunRequest {
        argv: vec!["true".into()],
        workspace: env.ws(),
        policy: taskbox_core::policy::Policy::default(),
        timeout: None,
        write_through: false,
        env: Vec::new(),
        cwd: None,
        stdin: StdinSource::Null,
        echo: false,
        detach_cleanup: false,
        want_diff: false,
        state_dir: env.state(),
        image: None,
        root_upper: Some(env.dir.path().join("upper")),
    })
    .unwrap_err();
    assert!(e.to_string().contains("needs an image"), "{e}");
}

#[test]
fn moving_the_directories_above_the_workspace_cannot_redirect_file_operations() {
    // The scratch workspace lies under /tmp, which the sandbox may write: its parent can be
    // moved away and replaced by a symlink to a host directory, or by a directory of its own.
    let env = Env::new();
    let parent = env.dir.path().join("p");
    let ws = parent.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "workspace\n").unwrap();
    let target = env.dir.path().join("host-target");
    std::fs::create_dir_all(target.join("ws")).unwrap();
    std::fs::write(target.join("ws/a.txt"), "host\n").unwrap();
    let backend = NativeBackend::new(env.state()).unwrap();
    let id = backend
        .create(CreateRequest {
            workspace: ws.display().to_string(),
            ..CreateRequest::default()
        })
        .unwrap()
        .id;
    let f = Fixture { env, backend, id };
    assert_eq!(read(&f, "a.txt").unwrap(), "workspace\n");
    f.backend
        .checkpoint(&f.id, CheckpointRequest { name: "c".into() })
        .unwrap();
    let p = parent.display();
    for attack in [
        format!("mv {p} {p}.moved && ln -s {} {p}", target.display()),
        format!("rm {p} && mkdir -p {p}/ws && echo fake > {p}/ws/a.txt"),
    ] {
        let r = match f
            .backend
            .exec(
                &f.id,
                ExecRequest {
                    shell: Some(attack),
                    cwd: Some("/".into()),
                    ..ExecRequest::default()
                },
                None,
            )
            .unwrap()
        {
            ExecOutcome::Finished(r) => r,
            other => panic!("{other:?}"),
        };
        if taskbox_tests::is_root() && r.exit_code != Some(0) {
            // Run by root, the commands are ids of their own namespace, to whom the directory
            // above the workspace (the host root's) is not writable: the move itself fails,
            // and the file operations go on reaching the workspace. (The rootless pass of
            // this suite, where the commands own that directory, tries the rest.)
            assert!(r.stderr.text.contains("Permission denied"), "{r:?}");
            assert_eq!(read(&f, "a.txt").unwrap(), "workspace\n");
            return;
        }
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        let got = read(&f, "a.txt");
        assert!(matches!(got, Err(ApiError::Conflict(_))), "{got:?}");
        let w = f.backend.write(
            &f.id,
            WriteRequest {
                path: "a.txt".into(),
                content: "written\n".into(),
                ..WriteRequest::default()
            },
        );
        assert!(matches!(w, Err(ApiError::Conflict(_))), "{w:?}");
    }
    // Nor a restore: pid 1 refuses to detach what the path now leads to (a symlink to a
    // mount of its own choosing, e.g. a mask).
    sh(
        &f,
        &format!("cd / && rm -r {p} && mkdir {p} && ln -s /proc/sys {p}/ws"),
    );
    let r = f
        .backend
        .restore(&f.id, CheckpointRequest { name: "c".into() });
    assert!(
        matches!(&r, Err(ApiError::Internal(m)) if m.contains("cannot reach")),
        "{r:?}"
    );
    assert_eq!(
        std::fs::read_to_string(target.join("ws/a.txt")).unwrap(),
        "host\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "workspace\n"
    );
}

#[test]
fn execs_of_every_size_run_or_are_refused_naming_the_limit() {
    let f = fixture();
    let exec = |req: serde_json::Value| -> big_exec::Outcome {
        let req: ExecRequest = serde_json::from_value(req).unwrap();
        match f.backend.exec(&f.id, req, None) {
            Ok(ExecOutcome::Finished(r)) => Ok((r.exit_code.map(i64::from), r.stdout.text)),
            Ok(other) => panic!("expected a finished exec, got {other:?}"),
            Err(e) => Err((e.code().to_string(), e.to_string())),
        }
    };
    big_exec::check(&exec, big_exec::argument_space());
    assert_eq!(f.backend.info(&f.id).unwrap().state, "running");
    // A background process of 300 KB of arguments starts and ends like any other.
    let started = f.backend.exec(
        &f.id,
        ExecRequest {
            argv: Some(vec![
                "echo".into(),
                "y".repeat(100_000),
                "z".repeat(100_000),
                "w".repeat(100_000),
            ]),
            background: true,
            ..ExecRequest::default()
        },
        None,
    );
    let Ok(ExecOutcome::Background(p)) = started else {
        panic!("{started:?}")
    };
    let p = f
        .backend
        .wait(&f.id, p.exec_id, Duration::from_secs(20))
        .unwrap();
    assert_eq!(p.result.unwrap().stdout.bytes, 300_003);
}

#[test]
fn a_sandbox_whose_control_channel_breaks_is_lost_everywhere_and_destroy_cleans_it() {
    let f = fixture();
    let marker = format!("68{}.5", std::process::id());
    let bg = f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                argv: Some(vec!["sleep".into(), marker.clone()]),
                background: true,
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap();
    let ExecOutcome::Background(bg) = bg else {
        panic!("{bg:?}")
    };
    // The sandbox's helper and pid 1 (its id is on their command line) die.
    let label = format!("taskbox-init - {} ", f.id);
    let procs = host_processes_with(&label);
    assert!(!procs.is_empty(), "no process of the sandbox found");
    for pid in procs {
        // SAFETY: kill has no memory arguments; the pids are the sandbox's, found just above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.backend.info(&f.id).unwrap().state != "lost" {
        assert!(Instant::now() < deadline, "the sandbox is not marked lost");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every call says so, and nothing of it runs on.
    let e = f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("true".into()),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap_err();
    // An infrastructure failure, with its cause: not the command's.
    assert!(
        matches!(&e, ApiError::Infrastructure(m) if m.contains("lost") && m.contains("SIGKILL")),
        "{e}"
    );
    let e = read(&f, "anything").unwrap_err();
    assert_eq!(e.code(), "infrastructure", "{e}");
    assert!(e.to_string().contains("lost"), "{e}");
    // So is the background exec's state: it ended with the sandbox.
    let e = f
        .backend
        .wait(&f.id, bg.exec_id, Duration::from_secs(5))
        .unwrap_err();
    assert_eq!(e.code(), "infrastructure", "{e}");
    while !host_processes_with(&marker).is_empty() {
        assert!(
            Instant::now() < deadline,
            "a process of the lost sandbox lives on"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    f.backend.destroy(&f.id).unwrap();
    assert!(matches!(
        f.backend.info(&f.id),
        Err(ApiError::SandboxNotFound(_))
    ));
    assert!(host_processes_with(&label).is_empty());
}

/// The one `command` violation of an exec the command policy refused: nothing ran.
fn command_refusal(r: &taskbox_core::result::ExecResult) -> &str {
    assert_eq!(r.exit_code, None, "{r:?}");
    assert_eq!(r.signal, None, "{r:?}");
    assert_eq!(r.violations.len(), 1, "{r:?}");
    assert_eq!(r.violations[0].kind, "command", "{r:?}");
    &r.violations[0].detail
}

/// The runtime every in-process surface builds (`serve`, `mcp`, `agent`): the command policy
/// over the native backend, inside the trace. A forbidden exec and a denied ask never reach the
/// backend, and both are in the trace with their violation, as is the denial (none of which the
/// trace would hold were it inside the policy, or the policy missing).
#[test]
fn the_built_runtime_polices_commands_inside_its_trace() {
    use taskbox_core::runtime::RuntimeBuilder;
    let env = Env::new();
    let policy = env.policy(
        "rules",
        "[commands]\nforbid = [\"git push\"]\nask = [\"touch\"]\n",
    );
    let traces = env.state().join("traces");
    let api = RuntimeBuilder::new()
        .native(env.state())
        .command_policy(true)
        .trace(&traces)
        .build()
        .unwrap();
    let info = api
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            policy: Some(policy.display().to_string()),
            ..CreateRequest::default()
        })
        .unwrap();
    assert_eq!(info.backend, "native");
    let id = info.id.clone();

    let r = taskbox_tests::shell(&*api, &id, "echo ran > ran.txt && git push origin main");
    let detail = command_refusal(&r);
    assert!(
        detail.contains("is forbidden by the command policy"),
        "{detail}"
    );

    let asking = {
        let api = api.clone();
        let id = id.clone();
        std::thread::spawn(move || {
            let req = ExecRequest {
                argv: Some(vec!["touch".into(), "asked.txt".into()]),
                ..ExecRequest::default()
            };
            match api.exec(&id, req, None).unwrap() {
                ExecOutcome::Finished(r) => r,
                other => panic!("expected a finished exec, got {other:?}"),
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let pending = loop {
        let pending = api
            .list_approvals(&id, Some(Duration::from_secs(5)))
            .unwrap();
        if !pending.is_empty() || Instant::now() > deadline {
            break pending;
        }
    };
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].command, "touch asked.txt");
    let denied = api.deny(&id, &pending[0].id, "not in this task").unwrap();
    assert_eq!(denied.state, ApprovalState::Denied, "{denied:?}");
    let r = asking.join().unwrap();
    let detail = command_refusal(&r);
    assert!(detail.contains("was denied: not in this task"), "{detail}");

    // Neither refused command ran; an allowed one does.
    let r = taskbox_tests::shell(&*api, &id, "ls; echo ok");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout.text, "ok\n", "{r:?}");
    api.destroy(&id).unwrap();

    let trace = taskbox_core::trace::read_trace(&traces.join(format!("{id}.jsonl"))).unwrap();
    assert_eq!(trace.header.policy_hash, info.policy_hash);
    assert!(
        trace
            .header
            .policy_toml
            .as_deref()
            .is_some_and(|t| t.contains("git push")),
        "{:?}",
        trace.header
    );
    // The denial and the exec it ended finish together: either may be recorded first.
    let mut ops: Vec<&str> = trace.ops.iter().map(|o| o.op.as_str()).collect();
    ops[1..5].sort_unstable();
    assert_eq!(
        ops,
        ["create", "deny", "exec", "exec", "exec", "destroy"],
        "{:#?}",
        trace.ops
    );
    let refused: Vec<String> = trace
        .ops
        .iter()
        .filter(|o| o.op == "exec")
        .map(|o| serde_json::to_value(&o.outcome).unwrap())
        .filter(|o| o["ok"]["violations"][0]["kind"] == "command")
        .map(|o| o.to_string())
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
}

/// Without the Docker backend the built runtime is native only, and a create asking for
/// docker is refused, naming what there is.
#[test]
fn a_runtime_without_docker_refuses_a_docker_create_naming_its_backends() {
    use taskbox_core::runtime::RuntimeBuilder;
    let env = Env::new();
    let api = RuntimeBuilder::new()
        .native(env.state())
        .command_policy(true)
        .trace(env.state().join("traces"))
        .build()
        .unwrap();
    let e = api
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            backend: Some("docker".into()),
            image: Some("busybox".into()),
            ..CreateRequest::default()
        })
        .unwrap_err();
    assert!(matches!(e, ApiError::InvalidArgument(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("backend \"docker\" is not available here; available: native"),
        "{e}"
    );
    assert!(api.list().is_empty());
    // The native backend serves the same runtime.
    let info = api
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            ..CreateRequest::default()
        })
        .unwrap();
    assert_eq!(info.backend, "native");
    api.destroy(&info.id).unwrap();
}

/// Run by root, a long-lived sandbox's commands are ids of a namespace of their own: a host
/// file only root may read stays unreadable to them, to their uid 0 too, and even to a root
/// that keeps `dac_override` (it reaches only the sandbox's own ids' files); the host sees the
/// commands' processes as unprivileged ids of the sandbox range.
#[test]
fn root_owned_host_files_stay_unreadable_to_every_user_of_a_root_run_sandbox() {
    if !taskbox_tests::is_root() {
        // The rootless pass: its commands are the caller's own uid by design, and it cannot
        // make a file only root reads. Nothing to try.
        eprintln!(
            "rootless: the commands are the caller's uid; this check is for root-run sandboxes"
        );
        return;
    }
    let dir = std::path::PathBuf::from(format!("/opt/taskbox-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _gone = Gone(dir.clone());
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "root only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

    let env = Env::new();
    let backend = NativeBackend::new(env.state()).unwrap();
    let policy = "[security]\nroot_capabilities = [\"dac_override\", \"fowner\", \"chown\"]\n";
    for policy_toml in [None, Some(policy.to_string())] {
        let id = backend
            .create(CreateRequest {
                workspace: env.ws().display().to_string(),
                policy: policy_toml.as_ref().map(|_| "root-caps".into()),
                policy_toml,
                ..CreateRequest::default()
            })
            .unwrap()
            .id;
        for user in [None, Some("root"), Some("nobody")] {
            let r = match backend
                .exec(
                    &id,
                    ExecRequest {
                        shell: Some(format!(
                            "cat {} || echo refused; cat /proc/self/uid_map",
                            secret.display()
                        )),
                        user: user.map(Into::into),
                        ..ExecRequest::default()
                    },
                    None,
                )
                .unwrap()
            {
                ExecOutcome::Finished(r) => r,
                other => panic!("{other:?}"),
            };
            assert!(r.stdout.text.starts_with("refused\n"), "{user:?}: {r:?}");
            assert!(!r.stdout.text.contains("root only"), "{user:?}: {r:?}");
            let map: Vec<&str> = r
                .stdout
                .text
                .lines()
                .nth(1)
                .unwrap()
                .split_whitespace()
                .collect();
            assert_eq!(map[0], "0", "{r:?}");
            assert_ne!(map[1], "0", "the sandbox's ids are not the host's: {r:?}");
        }
        // From the host, the command is an id of that range, not root.
        let marker = format!("31.{}", std::process::id());
        let bg = match backend
            .exec(
                &id,
                ExecRequest {
                    argv: Some(vec!["sleep".into(), marker.clone()]),
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
        let want = format!("sleep\0{marker}\0").into_bytes();
        let mut uids: Vec<u32> = Vec::new();
        for _ in 0..100 {
            uids = std::fs::read_dir("/proc")
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| {
                    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                    (cmd == want).then_some(())?;
                    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                    let uid = status.lines().find(|l| l.starts_with("Uid:"))?;
                    uid.split_whitespace().nth(1)?.parse().ok()
                })
                .collect();
            if !uids.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        backend.kill(&id, bg.exec_id, libc::SIGKILL).unwrap();
        assert!(!uids.is_empty(), "the sleep is seen from the host");
        assert!(uids.iter().all(|u| *u >= 0x6000_0000), "{uids:?}");
        backend.destroy(&id).unwrap();
    }
}

/// Starts `req` as a background exec.
fn start(f: &Fixture, req: ExecRequest) -> ProcessInfo {
    let req = ExecRequest {
        background: true,
        ..req
    };
    match f.backend.exec(&f.id, req, None).unwrap() {
        ExecOutcome::Background(p) => p,
        other => panic!("{other:?}"),
    }
}

/// Starts `shell` as a background exec.
fn background(f: &Fixture, shell: &str) -> ProcessInfo {
    start(
        f,
        ExecRequest {
            shell: Some(shell.into()),
            ..ExecRequest::default()
        },
    )
}

/// An exec whose reaper is killed from outside ends (an error that says so, not a wait without
/// end), what it started is ended with it, and the sandbox goes on serving execs, signals and
/// timeouts.
#[test]
fn an_exec_whose_reaper_dies_ends_and_the_sandbox_serves_on() {
    let f = fixture();
    let marker = format!("69{}.5", std::process::id());
    let bg = background(&f, &format!("exec sleep {marker}"));
    // Taken from the scan that saw it: a second scan can miss it while its shell execs (its
    // command line is briefly unreadable then).
    let deadline = Instant::now() + Duration::from_secs(10);
    let command = loop {
        if let Some(pid) = host_processes_with(&marker).first() {
            break Some(*pid);
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let command = command.expect("the exec runs");
    let reaper = parent_of(command).expect("the command's reaper");
    // SAFETY: kill with plain values; the pid is the reaper's, alive (its command is).
    assert_eq!(unsafe { libc::kill(reaper, libc::SIGKILL) }, 0);
    let p = f
        .backend
        .wait(&f.id, bg.exec_id, Duration::from_secs(10))
        .unwrap();
    assert!(!p.running, "the exec still runs: {p:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !host_processes_with(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        host_processes_with(&marker).is_empty(),
        "what the dead reaper started lives on"
    );
    // The sandbox serves on: an exec, a signal to a background exec, a timeout.
    assert_eq!(sh(&f, "echo on").stdout.text, "on\n");
    let bg = background(
        &f,
        "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.05; done",
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f
        .backend
        .process(&f.id, bg.exec_id)
        .unwrap()
        .stdout
        .text
        .contains("ready")
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    f.backend.kill(&f.id, bg.exec_id, libc::SIGTERM).unwrap();
    let p = f
        .backend
        .wait(&f.id, bg.exec_id, Duration::from_secs(5))
        .unwrap();
    let r = p.result.expect("the exec ended");
    assert_eq!(r.exit_code, Some(3), "{r:?}");
    assert!(r.stdout.text.contains("got-term"), "{r:?}");
    let r = f
        .backend
        .exec(
            &f.id,
            ExecRequest {
                shell: Some("sleep 30".into()),
                timeout_ms: Some(1000),
                ..ExecRequest::default()
            },
            None,
        )
        .unwrap();
    let ExecOutcome::Finished(r) = r else {
        panic!("{r:?}")
    };
    assert!(r.timed_out, "{r:?}");
}
