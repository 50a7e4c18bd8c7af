//! Lifecycle of Docker sandboxes: a supervisor killed mid-exec leaves orphans that the next one
//! removes; dockerd restarted under a live sandbox is reported and recovered from; a container
//! whose init is killed is an infrastructure failure; the warm pool.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use taskbox_core::api::*;
use taskbox_docker::{Docker, DockerConfig, LABEL_OWNER};

/// Set in the re-executed test binary that plays the supervisor.
const CHILD_ENV: &str = "TASKBOX_DOCKER_SUPERVISOR_CHILD";

/// The supervisor child: a backend on the given state directory, one sandbox with a command
/// running in the foreground; prints `ready ID CONTAINER` and waits to be killed.
#[test]
fn supervisor_child() {
    let Some(state) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let state = std::path::PathBuf::from(state);
    let ws = state.parent().unwrap().join("ws");
    let backend = Docker::open(&state, images(), DockerConfig::default()).unwrap();
    let info = backend
        .create(CreateRequest {
            workspace: ws.display().to_string(),
            backend: Some("docker".into()),
            image: Some("busybox".into()),
            ..Default::default()
        })
        .unwrap();
    let name = backend.container_name(&info.id).unwrap();
    let backend = std::sync::Arc::new(backend);
    let b2 = backend.clone();
    let id = info.id.clone();
    std::thread::spawn(move || {
        let _ = b2.exec(
            &id,
            ExecRequest {
                shell: Some("echo x > inside.txt; sleep 1000".into()),
                ..Default::default()
            },
            None,
        );
    });
    std::thread::sleep(Duration::from_millis(500));
    println!("ready {} {name}", info.id);
    // Wait to be killed. Should the parent go away first, its end of our stdin closes and we
    // end too, rather than linger.
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
}

#[test]
fn a_killed_supervisors_containers_and_mounts_are_removed_by_the_next() {
    if !docker_ready() {
        return;
    }
    let _lock = test_lock(false);
    let dir = tempfile::Builder::new()
        .prefix("taskbox-docker-test-")
        .tempdir()
        .unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(dir.path().join("ws")).unwrap();
    std::fs::write(dir.path().join("ws/keep.txt"), "keep\n").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "supervisor_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &state)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = loop {
        let line = lines.next().expect("the child ended early").unwrap();
        // The harness prints the test's name on the same line.
        if let Some(at) = line.find("ready sb-") {
            break line[at + "ready ".len()..].to_string();
        }
    };
    let (id, name) = ready.split_once(' ').unwrap();
    // SIGKILL mid-exec: nothing of the supervisor runs its cleanup.
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        inspect(name)["State"]["Running"],
        true,
        "the orphan still runs"
    );
    assert!(
        !mounts_under(&state.join("docker/sandboxes")).is_empty(),
        "its workspace is still mounted"
    );

    // The next supervisor on the same state directory removes the orphan and its mounts.
    let backend = Docker::open(&state, images(), DockerConfig::default()).unwrap();
    let owner = backend.owner().to_string();
    assert!(containers_with_label(LABEL_OWNER, &owner).is_empty());
    assert!(
        mounts_under(&state.join("docker/sandboxes")).is_empty(),
        "{:?}",
        mounts_under(&state.join("docker/sandboxes"))
    );
    let sandboxes = state.join("docker/sandboxes");
    assert_eq!(std::fs::read_dir(&sandboxes).unwrap().count(), 0);
    assert!(backend.info(&SandboxId::parse(id).unwrap()).is_err());
    // The host workspace was never touched.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ws/keep.txt")).unwrap(),
        "keep\n"
    );
    assert!(!dir.path().join("ws/inside.txt").exists());
}

#[test]
fn the_warm_pool_serves_creates_and_refills() {
    let Some(h) = Harness::with_config(DockerConfig {
        pool_size: 2,
        warm: vec![("busybox".into(), "default".into())],
        ..DockerConfig::default()
    }) else {
        return;
    };
    assert!(
        wait_until(Duration::from_secs(60), || h
            .backend
            .pooled("busybox", "default")
            == 2),
        "the pool fills"
    );
    h.write("f.txt", "pooled\n");
    // The pooled containers, before the create that takes one (the refill that follows may
    // already be done when the pool is counted again, so the count proves nothing).
    let owner = h.backend.owner().to_string();
    let waiting = containers_with_label(LABEL_OWNER, &owner);
    let start = Instant::now();
    let id = h.create();
    let r = h.sh(&id, "cat f.txt; echo y > g.txt");
    let first_exec = start.elapsed();
    assert_eq!(r.stdout.text, "pooled\n");
    assert_eq!(r.exit_code, Some(0));
    assert!(first_exec < Duration::from_secs(2), "took {first_exec:?}");
    let taken = h.backend.container_name(&id).unwrap();
    assert!(
        waiting.contains(&taken),
        "{taken} was not among the pooled {waiting:?}"
    );
    assert!(
        wait_until(Duration::from_secs(60), || h
            .backend
            .pooled("busybox", "default")
            == 2),
        "the pool refills"
    );
    // Pooled sandboxes are isolated from each other like any.
    let other = h.create();
    let r = h.sh(&other, "ls g.txt 2>&1");
    assert!(
        r.stdout.text.contains("No such file"),
        "{:?}",
        r.stdout.text
    );
    // Two sandboxes and a full pool again.
    assert!(wait_until(Duration::from_secs(60), || {
        h.backend.pooled("busybox", "default") == 2
            && containers_with_label(LABEL_OWNER, &owner).len() == 4
    }));
    let state = h.state();
    drop(h.backend);
    assert!(containers_with_label(LABEL_OWNER, &owner).is_empty());
    assert!(
        mounts_under(&state).is_empty(),
        "{:?}",
        mounts_under(&state)
    );
}

fn dockerd_pid() -> Option<i32> {
    let out = Command::new("pidof").arg("dockerd").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn daemon_answers() -> bool {
    Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Stops dockerd (SIGTERM) and returns the command line to start it again.
fn stop_dockerd() -> Vec<String> {
    let pid = dockerd_pid().expect("dockerd runs");
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    // SAFETY: kill has no memory arguments.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(
        wait_until(Duration::from_secs(60), || !std::path::Path::new(&format!(
            "/proc/{pid}"
        ))
        .exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z"))),
        "dockerd stops"
    );
    cmdline
}

fn start_dockerd(cmdline: &[String]) {
    // Through a shell that backgrounds it in its own session and exits: dockerd is reparented
    // to init and outlives this test.
    let status = Command::new("sh")
        .args([
            "-c",
            "setsid \"$@\" </dev/null >/tmp/dockerd.log 2>&1 &",
            "sh",
        ])
        .args(cmdline)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        wait_until(Duration::from_secs(90), daemon_answers),
        "dockerd answers again"
    );
}

#[test]
fn a_dockerd_restart_is_reported_and_recovered_from() {
    if !docker_ready() {
        return;
    }
    // Exclusive: no other Docker test runs while the daemon is down.
    let lock = test_lock(true);
    let h = Harness::with_lock(lock).unwrap();
    h.write("f", "x\n");
    let id = h.create();
    assert_eq!(h.sh(&id, "cat f").stdout.text, "x\n");

    let cmdline = stop_dockerd();
    let restart = scopeguard(cmdline.clone());
    // The container stopped with the daemon: the sandbox is lost, and says so at once.
    assert!(wait_until(Duration::from_secs(10), || {
        h.backend.info(&id).unwrap().state == "lost"
    }));
    let start = Instant::now();
    let e = h
        .backend
        .exec(
            &id,
            ExecRequest {
                argv: Some(vec!["true".into()]),
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
    assert_eq!(e.code(), "infrastructure", "{e}");
    assert!(e.to_string().contains("lost"), "{e}");
    let e = h.backend.create(h.create_req()).unwrap_err();
    assert_eq!(e.code(), "unavailable", "{e}");
    assert!(
        e.to_string().contains("Docker daemon is not reachable"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(40),
        "no hang: {:?}",
        start.elapsed()
    );
    // File operations of a lost sandbox are refused clearly too.
    let e = h
        .backend
        .read(
            &id,
            ReadRequest {
                path: "f".into(),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.code(), "infrastructure");

    drop(restart);
    assert_eq!(h.backend.info(&id).unwrap().state, "lost");
    h.backend.destroy(&id).unwrap();
    // New sandboxes work again.
    let id = h.create();
    assert_eq!(h.sh(&id, "cat f").stdout.text, "x\n");
    h.backend.destroy(&id).unwrap();
    assert!(mounts_under(&h.state().join("docker/sandboxes")).is_empty());
}

#[test]
fn a_container_whose_init_is_killed_is_an_infrastructure_failure() {
    if !docker_ready() {
        return;
    }
    let h = Harness::new().unwrap();
    let id = h.create();
    // The command's own failures are observations.
    let r = h.sh(&id, "kill -9 $$");
    assert_eq!((r.exit_code, r.signal), (None, Some(9)), "{r:?}");
    let info = h.backend.info(&id).unwrap();
    assert_eq!(info.state, "running");
    // An exec in flight when the container's init is killed from the host.
    let backend = &h.backend;
    let container = backend.container_name(&id).unwrap();
    let pid = inspect(&container)["State"]["Pid"].as_i64().unwrap() as i32;
    let e = std::thread::scope(|s| {
        let fg = s.spawn(|| {
            h.exec_err(
                &id,
                ExecRequest {
                    shell: Some("sleep 300".into()),
                    ..Default::default()
                },
            )
        });
        std::thread::sleep(Duration::from_millis(800));
        // SAFETY: kill has no memory arguments; the pid is this test's container's init.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        fg.join().unwrap()
    });
    assert_eq!(e.code(), "infrastructure", "{e}");
    // Every later operation, and the sandbox's info, say so with the cause.
    for e in [
        h.exec_err(
            &id,
            ExecRequest {
                argv: Some(vec!["true".into()]),
                ..Default::default()
            },
        ),
        h.backend
            .read(
                &id,
                ReadRequest {
                    path: "f".into(),
                    ..Default::default()
                },
            )
            .unwrap_err(),
        h.backend.diff(&id, DiffRequest::default()).unwrap_err(),
    ] {
        assert_eq!(e.code(), "infrastructure", "{e}");
        assert!(e.to_string().contains("container"), "{e}");
    }
    let info = h.backend.info(&id).unwrap();
    assert_eq!(info.state, "lost");
    let cause = info.lost_cause.unwrap();
    assert!(cause.contains("container"), "{cause}");
    h.backend.destroy(&id).unwrap();
}

/// Starts dockerd again when dropped (also when the test fails midway).
struct Restart(Vec<String>);

fn scopeguard(cmdline: Vec<String>) -> Restart {
    Restart(cmdline)
}

impl Drop for Restart {
    fn drop(&mut self) {
        if !daemon_answers() {
            start_dockerd(&self.0);
        }
    }
}
