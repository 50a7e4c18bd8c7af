//! Infrastructure failures, apart from the command's own, through a real `taskbox serve` on
//! native sandboxes: when a sandbox's init is SIGKILLed mid-exec, or its supervisor is, every
//! observation and error after says `infrastructure` with the cause (the exec in flight, every
//! later operation, the sandbox's info, its trace, and after a restart the sandbox the old
//! supervisor ran); a command that fails, is killed or times out stays an observation of the
//! command.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taskbox_agent::http::{Client, Request};
use taskbox_tests::{Env, Supervisor, host_processes_with, http};

/// The pid of the sandbox's init (pid 1 inside): the child of its helper, both started with
/// the sandbox's id on their command line (as are the exec starters and reapers pid 1 forks).
fn init_pid(id: &str) -> i32 {
    let procs: Vec<(i32, i32)> = host_processes_with(&format!("taskbox-init - {id} "))
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let helper: Vec<i32> = procs
        .iter()
        .filter(|(_, ppid)| !procs.iter().any(|(p, _)| p == ppid))
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(helper.len(), 1, "{procs:?}");
    let init: Vec<i32> = procs
        .iter()
        .filter(|(_, ppid)| *ppid == helper[0])
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(init.len(), 1, "{procs:?}");
    init[0]
}

fn sigkill(pid: i32) {
    // SAFETY: kill has no memory arguments; the pid is a process of this test's sandbox.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

/// Asserts an error answer says `infrastructure` with a message holding `cause`.
fn assert_infrastructure(what: &str, (status, v): &(u16, Value), cause: &str) {
    assert_eq!(*status, 500, "{what}: {v}");
    assert_eq!(v["error"]["code"], "infrastructure", "{what}: {v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains(cause), "{what}: {message}");
}

#[test]
fn a_killed_init_is_an_infrastructure_failure_in_every_observation_after() {
    let env = Env::new();
    env.write("a.txt", "alpha\n");
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create_sandbox(&env);
    let sb = |op: &str| format!("/v1/sandboxes/{id}/{op}");

    // The command's own failures are observations of the command.
    for (shell, exit, signal) in [
        ("exit 3", json!(3), json!(null)),
        ("kill -9 $$", json!(null), json!(9)),
    ] {
        let (st, r) = sup.call("POST", &sb("exec"), Some(json!({"shell": shell})));
        assert_eq!(st, 200, "{r}");
        assert_eq!((&r["exit_code"], &r["signal"]), (&exit, &signal), "{r}");
    }
    let (st, r) = sup.call(
        "POST",
        &sb("exec"),
        Some(json!({"shell": "sleep 5", "timeout_ms": 200})),
    );
    assert_eq!((st, &r["timed_out"]), (200, &json!(true)), "{r}");

    let (st, bg) = sup.call(
        "POST",
        &sb("exec"),
        Some(json!({"shell": "sleep 300", "background": true})),
    );
    assert_eq!(st, 200, "{bg}");
    let exec_id = bg["exec_id"].as_u64().unwrap();
    // An exec in flight when the init is killed.
    let socket = sup.socket.clone();
    let path = sb("exec");
    let fg = std::thread::spawn(move || {
        http::call(&socket, "POST", &path, Some(&json!({"shell": "sleep 300"})))
    });
    std::thread::sleep(Duration::from_millis(800));
    let t = Instant::now();
    sigkill(init_pid(&id));
    let answer = fg.join().unwrap();
    eprintln!(
        "the exec in flight answered {:?} after the kill",
        t.elapsed()
    );
    assert_infrastructure("the exec in flight", &answer, "SIGKILL");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // Every later operation says so, with the cause.
    let later = [
        ("POST", sb("exec"), Some(json!({"shell": "true"}))),
        ("POST", sb("read"), Some(json!({"path": "a.txt"}))),
        (
            "POST",
            sb("write"),
            Some(json!({"path": "b.txt", "content": "x"})),
        ),
        ("POST", sb("diff"), Some(json!({}))),
        ("POST", sb("checkpoints"), Some(json!({"name": "c"}))),
        ("POST", sb("fork"), Some(json!({}))),
        ("GET", sb(&format!("processes/{exec_id}")), None),
        (
            "POST",
            sb(&format!("processes/{exec_id}/wait?timeout_ms=10")),
            None,
        ),
    ];
    for (method, path, body) in later {
        assert_infrastructure(&path, &sup.call(method, &path, body), "SIGKILL");
    }
    // The sandbox's own observation: lost, and why.
    let (st, info) = sup.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(st, 200);
    assert_eq!(info["state"], "lost", "{info}");
    let cause = info["lost_cause"].as_str().unwrap();
    assert!(
        cause.contains("its init (pid 1) was killed by SIGKILL"),
        "{cause}"
    );
    // The trace records each as what it was.
    let (st, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(st, 204);
    let trace =
        taskbox_core::trace::read_trace(&env.state().join("traces").join(format!("{id}.jsonl")))
            .unwrap();
    let codes: Vec<String> = trace
        .ops
        .iter()
        .filter_map(|o| match &o.outcome {
            taskbox_core::trace::Outcome::Error(e) => Some(e.code.clone()),
            taskbox_core::trace::Outcome::Ok(_) => None,
        })
        .collect();
    assert!(codes.len() >= 7, "{codes:?}");
    assert!(codes.iter().all(|c| c == "infrastructure"), "{codes:?}");
    assert!(host_processes_with(&env.state().join("sandboxes").display().to_string()).is_empty());
}

#[test]
fn a_supervisor_killed_mid_exec_leaves_infrastructure_failures_after_a_restart() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create_sandbox(&env);
    let other = sup.create_sandbox(&env);
    let socket = sup.socket.clone();
    let path = format!("/v1/sandboxes/{id}/exec");
    let fg = std::thread::spawn(move || {
        let body = serde_json::to_vec(&json!({"shell": "sleep 300"})).unwrap();
        let mut req = Request::new("POST", &path);
        req.body = Some(&body);
        Client::unix(&socket).and_then(|c| c.send(&req, Duration::from_secs(120)))
    });
    std::thread::sleep(Duration::from_millis(800));
    sup.kill9();
    // The client of the exec in flight gets no answer: a transport failure (the Python SDK's
    // TaskboxConnectionError, an InfrastructureError).
    assert!(fg.join().unwrap().is_err());

    let sup = Supervisor::start(&env, &[]);
    let cause = "the supervisor restarted";
    for sandbox in [&id, &other] {
        let sb = |op: &str| format!("/v1/sandboxes/{sandbox}/{op}");
        assert_infrastructure(
            "info",
            &sup.call("GET", &format!("/v1/sandboxes/{sandbox}"), None),
            cause,
        );
        assert_infrastructure(
            "exec",
            &sup.call("POST", &sb("exec"), Some(json!({"shell": "true"}))),
            cause,
        );
        assert_infrastructure(
            "read",
            &sup.call("POST", &sb("read"), Some(json!({"path": "x"}))),
            cause,
        );
    }
    // Not listed (nothing of it runs), and a destroy only forgets it.
    let (_, list) = sup.call("GET", "/v1/sandboxes", None);
    assert_eq!(list, json!([]));
    let (st, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(st, 204);
    let (st, v) = sup.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("sandbox_not_found"))
    );
    // An id that never was a sandbox is still not found.
    let (st, v) = sup.call("GET", "/v1/sandboxes/sb-0000000000000bad", None);
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("sandbox_not_found"))
    );
    // New sandboxes work.
    let fresh = sup.create_sandbox(&env);
    let (st, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{fresh}/exec"),
        Some(json!({"shell": "echo ok"})),
    );
    assert_eq!((st, &r["stdout"]["text"]), (200, &json!("ok\n")));
}

/// A private mount point a killed Docker supervisor leaves on `STATE/docker` (and anything
/// mounted under a test's environment) is detached when the environment is dropped: nothing of
/// a test stays mounted on the host.
#[test]
fn an_environment_detaches_what_was_left_mounted_under_it() {
    if !taskbox_tests::require(taskbox_tests::is_root(), "binding a mount point needs root") {
        return;
    }
    let env = Env::new();
    let dir = env.state().join("docker");
    std::fs::create_dir(&dir).unwrap();
    let status = std::process::Command::new("mount")
        .args(["--bind", "--make-private"])
        .arg(&dir)
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        taskbox_tests::mounts_under(&dir),
        std::slice::from_ref(&dir)
    );
    let top = env.dir.path().to_path_buf();
    drop(env);
    assert!(taskbox_tests::mounts_under(&dir).is_empty());
    assert!(!top.exists(), "the environment's directory is removed");
}
