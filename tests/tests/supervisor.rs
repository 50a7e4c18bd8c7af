//! `taskbox serve` and the CLI verbs that talk to it: the verbs end to end, the supervisor
//! started on demand, a supervisor killed with SIGKILL mid-exec and restarted (nothing leaks),
//! and a load of 64 live sandboxes with 8 clients issuing 2,000 execs.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::json;
use taskbox_tests::{Env, Supervisor, children_with, host_processes_with, http, parent_of};

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn cli_verbs_drive_a_sandbox_end_to_end() {
    let env = Env::new();
    env.write("src/lib.rs", "pub fn one() -> u32 { 1 }\n");
    let sup = Supervisor::start(&env, &[]);
    let s = sup.socket.clone();
    let o = env.cli(&s, &["create", "--workspace", env.ws().to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let id = text(&o).trim().to_string();
    assert!(id.starts_with("sb-"), "{id}");

    let o = env.cli(
        &s,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo hello; echo warn >&2; exit 3",
        ],
    );
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(text(&o), "hello\n");
    assert!(String::from_utf8_lossy(&o.stderr).contains("warn"));

    let o = env.cli(
        &s,
        &[
            "edit",
            &id,
            "src/lib.rs",
            "--old",
            "{ 1 }",
            "--new",
            "{ 2 }",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(
        text(&o).contains("+pub fn one() -> u32 { 2 }"),
        "{}",
        text(&o)
    );
    let o = env.cli(&s, &["read", &id, "src/lib.rs"]);
    assert_eq!(text(&o), "pub fn one() -> u32 { 2 }\n");
    // Absolute paths are the sandbox's: write and read its /tmp (the bytes sent as they are).
    let local = env.dir.path().join("local.bin");
    std::fs::write(&local, b"bytes \xff\x00 as they are\n").unwrap();
    let o = env.cli(
        &s,
        &[
            "write",
            &id,
            "/tmp/a dir/cli.bin",
            "-p",
            "--from",
            local.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let o = env.cli(
        &s,
        &["exec", &id, "--", "od", "-An", "-c", "/tmp/a dir/cli.bin"],
    );
    assert!(text(&o).contains("377  \\0"), "{}", text(&o));
    let o = env.cli(&s, &["ls", &id, "/tmp/a dir"]);
    assert!(text(&o).contains("/tmp/a dir/cli.bin"), "{}", text(&o));
    let o = env.cli(&s, &["search", &id, "fn one"]);
    assert!(text(&o).starts_with("src/lib.rs:1:"), "{}", text(&o));
    let o = env.cli(&s, &["ls", &id, "src"]);
    assert!(text(&o).contains("src/lib.rs"), "{}", text(&o));
    let o = env.cli(&s, &["checkpoint", &id, "edited"]);
    assert!(o.status.success(), "{o:?}");
    env.cli(&s, &["exec", &id, "--", "rm", "src/lib.rs"]);
    let o = env.cli(&s, &["diff", &id, "--since", "edited"]);
    assert!(text(&o).contains("deleted file mode"), "{}", text(&o));
    let o = env.cli(&s, &["restore", &id, "edited"]);
    assert!(o.status.success(), "{o:?}");
    let o = env.cli(&s, &["diff", &id]);
    assert!(
        text(&o).contains("+pub fn one() -> u32 { 2 }"),
        "{}",
        text(&o)
    );
    // The host copy is untouched until export --apply.
    assert_eq!(
        std::fs::read_to_string(env.ws().join("src/lib.rs")).unwrap(),
        "pub fn one() -> u32 { 1 }\n"
    );
    let o = env.cli(&s, &["export", &id, "--apply"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        std::fs::read_to_string(env.ws().join("src/lib.rs")).unwrap(),
        "pub fn one() -> u32 { 2 }\n"
    );
    let o = env.cli(&s, &["ps"]);
    assert!(text(&o).contains(&id), "{}", text(&o));
    let o = env.cli(&s, &["rm", &id]);
    assert!(o.status.success(), "{o:?}");
    let o = env.cli(&s, &["read", &id, "src/lib.rs"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not_found"),
        "{o:?}"
    );
}

#[test]
fn cli_diff_counts_and_lists_ignored_changes_and_export_apply_needs_leave_for_autorun_files() {
    let env = Env::new();
    env.write(".gitignore", "*.log\n");
    env.write("notes.txt", "n\n");
    let sup = Supervisor::start(&env, &[]);
    let s = sup.socket.clone();
    let o = env.cli(&s, &["create", "--workspace", env.ws().to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let id = text(&o).trim().to_string();
    let o = env.cli(
        &s,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo x > run.log; echo 'echo hi' > .envrc; echo n2 > notes.txt",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let err = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();

    // The default diff: run.log left out and counted, .envrc flagged.
    let o = env.cli(&s, &["diff", &id]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        !text(&o).contains("run.log") && text(&o).contains("b/.envrc"),
        "{}",
        text(&o)
    );
    assert!(err(&o).contains("1 change left out"), "{}", err(&o));
    assert!(err(&o).contains("flagged .envrc: direnv"), "{}", err(&o));
    let o = env.cli(&s, &["diff", &id, "--include-ignored", "--json"]);
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(d["ignored"], 1, "{d}");
    let listed: Vec<&str> = d["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["ignored"] == true)
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["run.log"]);

    // export --apply: refused without --allow-autorun, naming the file and why; nothing written.
    let o = env.cli(&s, &["export", &id, "--apply"]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(
        err(&o).contains(".envrc (direnv") && err(&o).contains("--allow-autorun"),
        "{}",
        err(&o)
    );
    assert!(!env.ws().join(".envrc").exists());
    assert_eq!(
        std::fs::read_to_string(env.ws().join("notes.txt")).unwrap(),
        "n\n"
    );
    let o = env.cli(&s, &["export", &id, "--allow-autorun"]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(
        err(&o).contains("--apply"),
        "--allow-autorun needs --apply: {}",
        err(&o)
    );
    let o = env.cli(&s, &["export", &id, "--apply", "--allow-autorun"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        std::fs::read_to_string(env.ws().join(".envrc")).unwrap(),
        "echo hi\n"
    );
    assert_eq!(
        std::fs::read_to_string(env.ws().join("notes.txt")).unwrap(),
        "n2\n"
    );
    assert!(
        !env.ws().join("run.log").exists(),
        "an ignored file was applied"
    );
    env.cli(&s, &["rm", &id]);
}

#[test]
fn cli_create_and_export_apply_with_an_idempotency_key_happen_once() {
    let env = Env::new();
    env.write("notes.txt", "n\n");
    let sup = Supervisor::start(&env, &[]);
    let s = sup.socket.clone();
    let err = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();
    let ws = env.ws().to_str().unwrap().to_string();
    let create = |extra: &[&str]| {
        let mut args = vec![
            "create",
            "--workspace",
            &ws,
            "--idempotency-key",
            "job-7/create",
        ];
        args.extend_from_slice(extra);
        env.cli(&s, &args)
    };

    // A retried create prints the same sandbox and says so; one sandbox is live.
    let o = create(&[]);
    assert!(o.status.success(), "{o:?}");
    let id = text(&o).trim().to_string();
    assert!(id.starts_with("sb-"), "{id}");
    let o = create(&[]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(text(&o).trim(), id);
    assert!(err(&o).contains("already names sandbox"), "{}", err(&o));
    let o = env.cli(&s, &["ps", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    // The key with other options is refused, naming why.
    let o = create(&["--ttl", "5m"]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(err(&o).contains("idempotency_key_reused"), "{}", err(&o));
    // A key the supervisor would refuse is refused before anything is sent.
    let long = "k".repeat(256);
    let o = env.cli(
        &s,
        &["create", "--workspace", &ws, "--idempotency-key", &long],
    );
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(err(&o).contains("Idempotency-Key"), "{}", err(&o));

    // export --apply with a key writes the host once; its retry writes nothing again.
    let o = env.cli(&s, &["exec", &id, "--", "sh", "-c", "echo n2 > notes.txt"]);
    assert!(o.status.success(), "{o:?}");
    let apply = ["export", &id, "--apply", "--idempotency-key", "job-7/apply"];
    let o = env.cli(&s, &apply);
    assert!(o.status.success(), "{o:?}");
    assert!(err(&o).contains("applied 1 changes"), "{}", err(&o));
    let notes = || std::fs::read_to_string(env.ws().join("notes.txt")).unwrap();
    assert_eq!(notes(), "n2\n");
    std::fs::write(env.ws().join("notes.txt"), "edited on the host\n").unwrap();
    let o = env.cli(&s, &apply);
    assert!(o.status.success(), "{o:?}");
    assert!(
        text(&o).contains("+n2"),
        "the first answer's patch: {}",
        text(&o)
    );
    assert!(err(&o).contains("nothing was written again"), "{}", err(&o));
    assert_eq!(notes(), "edited on the host\n");
    // The key is for an apply only.
    let o = env.cli(&s, &["export", &id, "--idempotency-key", "job-7/look"]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(err(&o).contains("--apply"), "{}", err(&o));
    env.cli(&s, &["rm", &id]);
}

#[test]
fn a_verb_starts_a_supervisor_when_none_runs() {
    let env = Env::new();
    let socket = env.state().join("auto.sock");
    let o = env.cli(
        &socket,
        &["create", "--workspace", env.ws().to_str().unwrap()],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("started one in the background"),
        "{o:?}"
    );
    let id = text(&o).trim().to_string();
    let o = env.cli(&socket, &["exec", &id, "--", "echo", "ok"]);
    assert_eq!(text(&o), "ok\n");
    // Stop the background supervisor: its sandboxes end with it.
    let pids = host_processes_with(socket.to_str().unwrap());
    assert!(!pids.is_empty());
    for pid in pids {
        // SAFETY: test code; signals a process this test started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}

#[test]
fn a_policy_file_is_read_once_by_the_cli_and_never_by_the_supervisor() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let s = sup.socket.clone();
    let ws = env.ws().to_str().unwrap().to_string();

    // A FIFO as the policy: refused at once, nothing starts (it used to block the create with
    // the sandbox's init already running, in no list and holding a quota slot).
    let fifo = env.dir.path().join("fifo.toml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo touches nothing else.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let started = Instant::now();
    let o = env.cli(
        &s,
        &[
            "create",
            "--workspace",
            &ws,
            "--policy",
            fifo.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not a regular file"),
        "{o:?}"
    );
    let o = env.cli(&s, &["create", "--workspace", &ws, "--policy", "/dev/zero"]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    // A 100 MB file: refused by its size, not read.
    let big = env.dir.path().join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(100_000_000)
        .unwrap();
    let o = env.cli(
        &s,
        &[
            "create",
            "--workspace",
            &ws,
            "--policy",
            big.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("at most 262144 bytes"),
        "{o:?}"
    );
    let (status, list) = http::call(&s, "GET", "/v1/sandboxes", None);
    assert_eq!(status, 200);
    assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");

    // The file's rules hold for the sandbox's whole life: changing or breaking the file after
    // the create neither changes them nor loses the sandbox.
    let rules = env.policy("rules", "[commands]\nforbid = [\"git push\"]\n");
    let o = env.cli(
        &s,
        &[
            "create",
            "--workspace",
            &ws,
            "--policy",
            rules.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let id = text(&o).trim().to_string();
    std::fs::write(&rules, "this is [not toml\n").unwrap();
    let o = env.cli(&s, &["exec", &id, "--", "echo", "alive"]);
    assert_eq!(text(&o), "alive\n", "{o:?}");
    let o = env.cli(&s, &["exec", &id, "--", "git", "push"]);
    assert_eq!(o.status.code(), Some(126), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("forbidden"),
        "{o:?}"
    );
    let (status, info) = http::call(&s, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["state"], "running", "{info}");
    // Its trace header holds the text the sandbox runs under.
    let trace =
        std::fs::read_to_string(env.state().join("traces").join(format!("{id}.jsonl"))).unwrap();
    let header: serde_json::Value = serde_json::from_str(trace.lines().next().unwrap()).unwrap();
    assert!(
        header["policy_toml"].as_str().unwrap().contains("git push"),
        "{header}"
    );
    assert!(env.cli(&s, &["rm", &id]).status.success());
}

fn leftover_cgroups() -> Vec<String> {
    taskbox_tests::host_cgroups("taskbox-sb-*")
}

/// What a sandbox of `id` may leave on the host: its state directory and its cgroups.
fn leftovers_of(env: &Env, id: &str) -> Vec<String> {
    let mut left: Vec<String> = leftover_cgroups()
        .into_iter()
        .filter(|c| c.ends_with(&format!("taskbox-sb-{id}")))
        .collect();
    let dir = env.state().join("sandboxes").join(id);
    if dir.exists() {
        left.push(dir.display().to_string());
    }
    left
}

/// A helper that says which sandbox it was started for (`taskbox-init - ID`) and then fails,
/// or hangs. It cannot be the helpers' zygote (started as one, it exits at once), so the
/// supervisor spawns each of its helpers.
fn fake_helper(env: &Env, name: &str, then: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let said = env.dir.path().join(format!("{name}.said"));
    let helper = env.dir.path().join(name);
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n[ \"$1\" = --zygote ] && exit 0\n[ \"$1\" = - ] && echo \"$2\" > {}\n{then}\n",
            said.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    (helper, said)
}

/// A create is all or nothing: one whose sandbox cannot start leaves no directory, cgroup or
/// process; one whose supervisor dies in the middle is cleaned up by the next supervisor.
#[test]
fn a_failed_create_leaves_nothing_also_after_a_restart() {
    let env = Env::new();
    let body = json!({"workspace": env.ws().display().to_string()});
    for (name, then) in [("fails", "exit 3"), ("crashes", "kill -SEGV $$")] {
        let (helper, said) = fake_helper(&env, name, then);
        let sup = Supervisor::start_with(&env, &[], |c| {
            c.env("TASKBOX_INIT", &helper);
        });
        let (st, v) = sup.call("POST", "/v1/sandboxes", Some(body.clone()));
        assert!(st >= 400, "{st} {v}");
        let id = std::fs::read_to_string(&said).unwrap().trim().to_string();
        assert!(id.starts_with("sb-"), "{id}");
        assert_eq!(leftovers_of(&env, &id), Vec::<String>::new(), "{name}");
        let (_, list) = sup.call("GET", "/v1/sandboxes", None);
        assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");
        drop(sup);
    }

    // The helper cannot even be started: the cgroup made for the sandbox goes as well.
    let log = env.dir.path().join("missing.log");
    let sup = Supervisor::start_with(&env, &[], |c| {
        c.env("TASKBOX_INIT", "/nonexistent/taskbox-init")
            .env("TASKBOX_LOG", "taskbox_native=debug")
            .stderr(std::fs::File::create(&log).unwrap());
    });
    let (st, v) = sup.call("POST", "/v1/sandboxes", Some(body.clone()));
    assert_eq!(st, 500, "{v}");
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("starting a sandbox"))
        .unwrap_or_else(|| panic!("the start is logged: {text}"));
    let at = line.find("sb-").unwrap();
    let id = &line[at..at + 19];
    assert_eq!(
        leftovers_of(&env, id),
        Vec::<String>::new(),
        "missing helper"
    );
    drop(sup);

    // Killed while a create waits for its sandbox: the next supervisor removes the rest.
    let marker = format!("4711{}", std::process::id());
    let (helper, said) = fake_helper(&env, "hangs", &format!("exec sleep {marker}"));
    let sup = Supervisor::start_with(&env, &[], |c| {
        c.env("TASKBOX_INIT", &helper);
    });
    let sock = sup.socket.clone();
    let b = body.clone();
    let pending = std::thread::spawn(move || {
        let _ = std::panic::catch_unwind(|| http::call(&sock, "POST", "/v1/sandboxes", Some(&b)));
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_processes_with(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = std::fs::read_to_string(&said).unwrap().trim().to_string();
    assert!(
        !leftovers_of(&env, &id).is_empty(),
        "the create should be in flight"
    );
    sup.kill9();
    let _ = pending.join();
    for pid in host_processes_with(&marker) {
        // SAFETY: kill has no memory arguments; the fake helper is this test's.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let sup = Supervisor::start(&env, &[]);
    assert_eq!(leftovers_of(&env, &id), Vec::<String>::new());
    let (st, _) = sup.call("POST", "/v1/sandboxes", Some(body));
    assert_eq!(st, 201, "a create works again");
}

#[test]
fn a_supervisor_killed_mid_exec_leaves_nothing_and_restarts_clean() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let marker = format!("44{}.5", std::process::id());
    let (st, _) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": format!("sleep {marker}"), "background": true})),
    );
    assert_eq!(st, 200);
    let sock = sup.socket.clone();
    let fg_marker = marker.clone();
    let fg = std::thread::spawn(move || {
        http::call(
            &sock,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": format!("echo started; sleep {fg_marker}")})),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_processes_with(&marker).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        host_processes_with(&marker).len() >= 2,
        "both execs should run"
    );
    let zygotes = children_with(sup.child.id(), "--zygote");
    assert_eq!(zygotes.len(), 1, "one zygote of the helpers");
    sup.kill9();
    let _ = fg.join();
    // The sandboxes die with their supervisor, and so does the helpers' zygote.
    let deadline = Instant::now() + Duration::from_secs(10);
    while (!host_processes_with(&marker).is_empty() || parent_of(zygotes[0]).is_some())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        host_processes_with(&marker).is_empty(),
        "sandbox processes outlived the supervisor"
    );
    assert_eq!(
        parent_of(zygotes[0]),
        None,
        "the zygote outlived the supervisor"
    );
    // A new supervisor removes what the old one left.
    let sup = Supervisor::start(&env, &[]);
    let (st, list) = sup.call("GET", "/v1/sandboxes", None);
    assert_eq!(st, 200);
    assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");
    let sandboxes = env.state().join("sandboxes");
    let left: Vec<_> = std::fs::read_dir(&sandboxes)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name())
                // The backend's own: its lock, and the mount point and mask file every
                // sandbox shares.
                .filter(|n| {
                    ![".lock", ".root", ".empty", ".disk"]
                        .iter()
                        .any(|own| n == own)
                })
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "state left behind: {left:?}");
    let state = env.state().display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&state), "a mount of the state dir leaked");
    // The trace holds everything that was acknowledged before the kill.
    let trace_path = env
        .state()
        .join("traces")
        .join(format!("{}.jsonl", info["id"].as_str().unwrap()));
    let trace = taskbox_core::trace::read_trace(&trace_path).unwrap();
    let ops: Vec<&str> = trace.ops.iter().map(|o| o.op.as_str()).collect();
    assert_eq!(&ops[..2], ["create", "exec"], "{ops:?}");
    assert_eq!(trace.header.sandbox.as_str(), info["id"].as_str().unwrap());
    let leaf = format!("taskbox-sb-{}", info["id"].as_str().unwrap());
    let mine: Vec<String> = leftover_cgroups()
        .into_iter()
        .filter(|c| c.ends_with(&leaf))
        .collect();
    assert!(mine.is_empty(), "cgroups leaked: {mine:?}");
    drop(sup);
}

#[test]
fn load_64_sandboxes_8_clients_2000_execs_without_errors() {
    let env = Env::new();
    let sup = Supervisor::start(
        &env,
        &[
            "--max-sandboxes",
            "64",
            "--max-sandboxes-per-tenant",
            "64",
            "--max-execs",
            "64",
            "--max-execs-per-tenant",
            "64",
        ],
    );
    let mut ids = Vec::new();
    for _ in 0..64 {
        let (st, info) = sup.call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"workspace": env.ws().display().to_string()})),
        );
        assert_eq!(st, 201, "{info}");
        ids.push(info["id"].as_str().unwrap().to_string());
    }
    let ids = std::sync::Arc::new(ids);
    let start = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let ids = ids.clone();
            let socket = sup.socket.clone();
            std::thread::spawn(move || {
                let mut errors = Vec::new();
                for i in 0..250 {
                    let id = &ids[(w * 250 + i) % ids.len()];
                    let (st, r) = http::call(
                        &socket,
                        "POST",
                        &format!("/v1/sandboxes/{id}/exec"),
                        Some(&json!({"argv": ["/bin/echo", format!("{w}-{i}")]})),
                    );
                    if st != 200 || r["stdout"]["text"] != format!("{w}-{i}\n") {
                        errors.push(format!("{st} {r}"));
                    }
                }
                errors
            })
        })
        .collect();
    let errors: Vec<String> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    let took = start.elapsed();
    eprintln!("2000 execs over 64 sandboxes from 8 clients in {took:?}");
    assert!(
        errors.is_empty(),
        "{} errors, first: {}",
        errors.len(),
        errors[0]
    );
    for id in ids.iter() {
        let (st, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert!(st == 204 || st == 200, "{st}");
    }
}

#[test]
fn malformed_requests_get_clear_4xx_answers() {
    use std::io::{Read, Write};
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    let id = info["id"].as_str().unwrap();
    // A path that is not UTF-8 cannot be JSON: the body is refused, nothing is written.
    let mut body = br#"{"path":"bad"#.to_vec();
    body.extend_from_slice(&[0xff, 0xfe]);
    body.extend_from_slice(br#"","content":"x"}"#);
    let mut s = std::os::unix::net::UnixStream::connect(&sup.socket).unwrap();
    let head = format!(
        "POST /v1/sandboxes/{id}/write HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("invalid_argument"), "{answer}");
    for (path, body) in [
        ("write", json!({"path": "x", "content": "y", "bogus": 1})),
        ("exec", json!({"argv": "not-a-list"})),
        (
            "edit",
            json!({"path": "missing.txt", "old": "a", "new": "b"}),
        ),
        (
            "patch",
            json!({"patch": "--- a/nope\n+++ b/nope\n@@ -1 +1 @@\n-a\n+b\n"}),
        ),
        ("read", json!({"path": "../../etc/passwd"})),
    ] {
        let (st, r) = sup.call("POST", &format!("/v1/sandboxes/{id}/{path}"), Some(body));
        assert!((400..500).contains(&st), "{path}: {st} {r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{path}: {r}"
        );
    }
    assert!(
        std::fs::read_dir(env.ws()).unwrap().next().is_none(),
        "something was written"
    );
}

/// A background process's stdin takes a raw body streamed of any size: 100 MiB of binary
/// input reach the command intact, while the supervisor's memory stays far below the input's
/// size; the JSON form takes base64.
#[test]
fn stdin_streams_binary_input_of_any_size_in_bounded_memory() {
    use sha2::Digest as _;
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    let id = info["id"].as_str().unwrap();
    let start = |argv: serde_json::Value| {
        let (st, p) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": argv, "background": true})),
        );
        assert_eq!(st, 200, "{p}");
        p["exec_id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no exec_id in {p}"))
    };
    let wait = |exec_id: u64| {
        let (st, p) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{id}/processes/{exec_id}/wait?timeout_ms=120000"),
            None,
        );
        assert_eq!(st, 200, "{p}");
        p
    };

    let size = 100usize << 20;
    let mut data = vec![0u8; size];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let want: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let exec_id = start(json!(["sha256sum"]));
    let path = format!("/v1/sandboxes/{id}/processes/{exec_id}/stdin?close=true");
    let mut req = taskbox_agent::http::Request::new("POST", &path);
    req.headers = vec![("Content-Type", "application/octet-stream".into())];
    req.body = Some(&data);
    let r = taskbox_agent::http::Client::unix(&sup.socket)
        .and_then(|c| c.send(&req, std::time::Duration::MAX))
        .unwrap();
    assert_eq!(r.status, 204, "{}", String::from_utf8_lossy(&r.body));
    let p = wait(exec_id);
    let out = p["result"]["stdout"]["text"].as_str().unwrap_or_default();
    assert!(out.starts_with(&want), "{p}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", sup.child.id())).unwrap();
    let hwm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(
        hwm_kib < 64 * 1024,
        "the supervisor's peak memory reached {hwm_kib} KiB for a 100 MiB input"
    );

    // JSON: base64 of any bytes; a bad encoding is refused.
    let exec_id = start(json!(["od", "-An", "-tx1"]));
    let stdin = format!("/v1/sandboxes/{id}/processes/{exec_id}/stdin");
    let (st, r) = sup.call(
        "POST",
        &stdin,
        Some(json!({"data": "AP+A", "encoding": "bogus"})),
    );
    assert_eq!(
        (st, r["error"]["code"].as_str()),
        (400, Some("invalid_argument")),
        "{r}"
    );
    let (st, r) = sup.call(
        "POST",
        &stdin,
        Some(json!({"data": "AP+A", "encoding": "base64", "close": true})),
    );
    assert_eq!(st, 204, "{r}");
    let p = wait(exec_id);
    let out = p["result"]["stdout"]["text"].as_str().unwrap_or_default();
    assert_eq!(
        out.split_whitespace().collect::<Vec<_>>(),
        ["00", "ff", "80"],
        "{p}"
    );
}

/// Deterministic bytes, 1 MiB at a time (xorshift: nothing a file system could compress away).
fn noise(seed: &mut u64, out: &mut [u8]) {
    for b in out {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *b = *seed as u8;
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The resident size of process `pid` now, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Samples the resident size of `pid` every few milliseconds until the returned flag is set;
/// the thread answers the highest seen.
fn watch_rss(
    pid: u32,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<u64>,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let t = std::thread::spawn(move || {
        let mut high = 0;
        while !s.load(Ordering::SeqCst) {
            high = high.max(rss(pid));
            std::thread::sleep(Duration::from_millis(5));
        }
        high.max(rss(pid))
    });
    (stop, t)
}

/// The head of an HTTP answer read from `s`: its status and headers (lowercased names); the
/// body follows in `s`.
fn read_head(s: &mut impl std::io::BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    s.read_line(&mut line).unwrap();
    let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        s.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            return (status, headers);
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
    }
}

#[test]
fn a_100_mib_file_streams_through_the_supervisor_in_bounded_memory() {
    use sha2::Digest as _;
    use std::io::{BufRead as _, Read as _, Write as _};
    use std::sync::atomic::Ordering;
    const SIZE: usize = 100 << 20;
    let env = Env::new();
    // A small JSON body limit: the file goes past it streamed.
    let sup = Supervisor::start(&env, &["--max-body-bytes", "65536"]);
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    // The JSON route is held to the operator's limit, and says so.
    let (st, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/write"),
        Some(json!({"path": "/tmp/x", "content": "x".repeat(100_000)})),
    );
    assert_eq!(st, 413, "{r}");
    assert_eq!(r["error"]["code"], "too_large", "{r}");
    let m = r["error"]["message"].as_str().unwrap();
    assert!(m.contains("65536") && m.contains("--max-body-bytes"), "{m}");

    let pid = sup.child.id();
    let before = rss(pid);
    // Up: 100 MiB on a raw connection, a piece at a time, hashed as it goes.
    let (stop, watcher) = watch_rss(pid);
    let mut s = std::os::unix::net::UnixStream::connect(&sup.socket).unwrap();
    write!(
        s,
        "PUT /v1/sandboxes/{id}/files?path=/tmp/big.bin HTTP/1.1\r\nHost: t\r\n\
         Connection: close\r\nContent-Length: {SIZE}\r\n\r\n"
    )
    .unwrap();
    let (mut seed, mut sent, mut hasher) = (0x9e37_79b9_7f4a_7c15u64, 0, sha2::Sha256::new());
    let mut piece = vec![0u8; 1 << 20];
    while sent < SIZE {
        noise(&mut seed, &mut piece);
        hasher.update(&piece);
        s.write_all(&piece).unwrap();
        sent += piece.len();
    }
    let expected = hex(&hasher.finalize());
    let mut answer = std::io::BufReader::new(s);
    let (status, _) = read_head(&mut answer);
    let mut body = String::new();
    answer.read_to_string(&mut body).unwrap();
    assert_eq!(status, 200, "{body}");
    let w: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(w["bytes_written"], SIZE as u64, "{w}");
    assert_eq!(w["sha256"], expected.as_str(), "{w}");

    // The sandbox has the same bytes.
    let (st, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"argv": ["sha256sum", "/tmp/big.bin"]})),
    );
    assert_eq!(st, 200, "{r}");
    assert!(
        r["stdout"]["text"].as_str().unwrap().starts_with(&expected),
        "{r}"
    );

    // Down: the same file, its length announced, hashed as it comes.
    let mut s = std::os::unix::net::UnixStream::connect(&sup.socket).unwrap();
    write!(
        s,
        "GET /v1/sandboxes/{id}/files?path=/tmp/big.bin HTTP/1.1\r\nHost: t\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = std::io::BufReader::with_capacity(1 << 16, s);
    let (status, headers) = read_head(&mut answer);
    assert_eq!(status, 200, "{headers:?}");
    let length = headers.iter().find(|(k, _)| k == "content-length");
    assert_eq!(
        length.map(|(_, v)| v.as_str()),
        Some("104857600"),
        "{headers:?}"
    );
    let (mut got, mut hasher) = (0usize, sha2::Sha256::new());
    loop {
        let buf = answer.fill_buf().unwrap();
        if buf.is_empty() {
            break;
        }
        let n = buf.len();
        hasher.update(buf);
        answer.consume(n);
        got += n;
    }
    assert_eq!(got, SIZE);
    assert_eq!(hex(&hasher.finalize()), expected);
    stop.store(true, Ordering::SeqCst);
    let high = watcher.join().unwrap();
    // Neither way held the file: the supervisor grew by a few pieces in flight, not 100 MiB.
    let grew = high.saturating_sub(before);
    eprintln!(
        "supervisor rss: {} MiB before, {} MiB at most during 2 x 100 MiB",
        before >> 20,
        high >> 20
    );
    assert!(grew < 32 << 20, "the supervisor grew by {} MiB", grew >> 20);
}

#[test]
fn file_errors_answer_their_codes_and_statuses_over_http() {
    let env = Env::new();
    env.write("f.txt", "f\n");
    let sup = Supervisor::start(&env, &[]);
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    let id = info["id"].as_str().unwrap().to_string();
    let (st, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(
            json!({"shell": "mkdir -p /tmp/d && echo s > /tmp/s && chmod a-r /tmp/s && \
                     echo k > /tmp/k && chmod 444 /tmp/k"}),
        ),
    );
    assert_eq!((st, &r["exit_code"]), (200, &json!(0)), "{r}");
    let ghost = "sb-00000000deadbeef";
    let cases: Vec<(String, &str, serde_json::Value, u16, &str)> = vec![
        (
            ghost.into(),
            "read",
            json!({"path": "f.txt"}),
            404,
            "sandbox_not_found",
        ),
        (
            id.clone(),
            "read",
            json!({"path": "/tmp/nope"}),
            404,
            "not_found",
        ),
        (
            id.clone(),
            "read",
            json!({"path": "/tmp/d"}),
            400,
            "is_a_directory",
        ),
        (
            id.clone(),
            "write",
            json!({"path": "/tmp/d", "content": "x"}),
            400,
            "is_a_directory",
        ),
        (
            id.clone(),
            "list",
            json!({"path": "/tmp/s"}),
            400,
            "not_a_directory",
        ),
        (
            id.clone(),
            "read",
            json!({"path": "/tmp/s"}),
            403,
            "permission_denied",
        ),
        (
            id.clone(),
            "write",
            json!({"path": "/tmp/k", "content": "x"}),
            403,
            "permission_denied",
        ),
        (
            id.clone(),
            "write",
            json!({"path": "/etc/x", "content": "x"}),
            403,
            "permission_denied",
        ),
        (
            id.clone(),
            "read",
            json!({"path": "/proc/1/root/etc/passwd"}),
            403,
            "path_refused",
        ),
        (
            id.clone(),
            "read",
            json!({"path": "../f.txt"}),
            403,
            "path_refused",
        ),
    ];
    for (sb, op, body, status, code) in cases {
        let (st, r) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{sb}/{op}"),
            Some(body.clone()),
        );
        assert_eq!(
            (st, r["error"]["code"].as_str()),
            (status, Some(code)),
            "{op} {body}: {r}"
        );
        assert!(!r["error"]["message"].as_str().unwrap().is_empty(), "{r}");
    }
    // The streamed routes answer the same codes, before any byte.
    for (method, path, status, code) in [
        ("GET", "/tmp/s", 403, "permission_denied"),
        ("GET", "/tmp/d", 400, "is_a_directory"),
        ("GET", "/tmp/nope", 404, "not_found"),
        ("PUT", "/tmp/k", 403, "permission_denied"),
    ] {
        let (st, r) = sup.call(
            method,
            &format!("/v1/sandboxes/{id}/files?path={path}"),
            None,
        );
        assert_eq!(
            (st, r["error"]["code"].as_str()),
            (status, Some(code)),
            "{method} {path}: {r}"
        );
    }
    // The OpenAPI document lists every code with its status.
    let (st, doc) = sup.call("GET", "/openapi.json", None);
    assert_eq!(st, 200);
    let codes = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["x-codes"]
        .as_array()
        .unwrap()
        .clone();
    let status_of = |c: &str| {
        codes
            .iter()
            .find(|e| e["code"] == c)
            .map(|e| e["status"].clone())
    };
    for (c, status) in [
        ("sandbox_not_found", 404),
        ("not_found", 404),
        ("is_a_directory", 400),
        ("not_a_directory", 400),
        ("permission_denied", 403),
        ("too_large", 413),
    ] {
        assert_eq!(status_of(c), Some(json!(status)), "{c}: {codes:?}");
    }
    assert!(doc["paths"]["/v1/sandboxes/{id}/files"]["put"].is_object());
    assert!(doc["paths"]["/v1/sandboxes/{id}/files"]["get"].is_object());
}

/// `--trace-sync`: either way every answered call is in its trace when the answer comes (the
/// trace is read right after it), and a value that is neither is refused naming the flag.
#[test]
fn the_trace_holds_every_answered_call_whichever_sync_the_operator_chose() {
    let env = Env::new();
    let bad = Command::new(taskbox_tests::taskbox())
        .args(["--state-dir"])
        .arg(env.state())
        .args(["serve", "--trace-sync", "sometimes"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--trace-sync") && err.contains("each-op") && err.contains("batched"),
        "{err}"
    );
    for mode in ["each-op", "batched"] {
        let env = Env::new();
        let sup = Supervisor::start(&env, &["--trace-sync", mode]);
        let id = sup.create_sandbox(&env);
        for n in 0..20 {
            let (st, r) = sup.call(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"argv": ["echo", format!("call-{n}")]})),
            );
            assert_eq!(st, 200, "{r}");
            let trace =
                std::fs::read_to_string(env.state().join("traces").join(format!("{id}.jsonl")))
                    .unwrap();
            assert!(
                trace.contains(&format!("call-{n}\\n")),
                "{mode}: exec {n} is answered but not in the trace"
            );
        }
    }
}
