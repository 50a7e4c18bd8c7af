//! The Docker backend through the real `taskbox` binary: one `taskbox serve --docker` serving
//! both backends (a create picks by `backend`), a supervisor SIGKILLed mid-exec and restarted
//! (its orphaned container and mounts are gone), and `taskbox run --backend docker`.
//!
//! The image is a busybox root file system imported into the daemon (`docker import`); the CLI
//! resolves images the daemon has until the image store is wired in.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::json;
use taskbox_tests::{Env, Run, Supervisor, big_exec, is_root, require};

const IMAGE: &str = "taskbox-test/serve:busybox";

fn docker_ok() -> bool {
    Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn ready() -> bool {
    require(is_root(), "the docker backend needs root")
        && require(
            Path::new("/bin/busybox").is_file(),
            "no static /bin/busybox",
        )
        && require(docker_ok(), "no Docker daemon answers (start dockerd)")
}

/// A shared lock on the file the Docker backend's suite uses: its dockerd restart test holds
/// it exclusively, so these tests never run while the daemon is down.
fn docker_lock() -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/taskbox-docker-tests.lock")
        .unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) }, 0);
    f
}

/// Imports a busybox image (user 1000:1000, workdir /workspace) into the daemon.
fn import_image(dir: &Path) {
    let root = dir.join("rootfs");
    for d in ["bin", "etc", "tmp", "workspace"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if !applet.is_empty() && applet != "busybox" {
            let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(applet));
        }
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\nu:x:1000:1000::/tmp:/bin/sh\n",
    )
    .unwrap();
    let tar = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .args(["-c", "."])
        .output()
        .unwrap();
    assert!(tar.status.success());
    let mut import = Command::new("docker")
        .args([
            "import",
            "-c",
            "USER 1000:1000",
            "-c",
            "WORKDIR /workspace",
            "-c",
            "ENV PATH=/bin",
            "-",
            IMAGE,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    import.stdin.take().unwrap().write_all(&tar.stdout).unwrap();
    assert!(import.wait().unwrap().success());
}

/// When a test ends, also by a failure, a last supervisor on its state directory removes what
/// the test's supervisors left (the start-up sweep) and stops cleanly.
struct Sweep<'a>(&'a Env);

impl Drop for Sweep<'_> {
    fn drop(&mut self) {
        let mut sup = Supervisor::start(self.0, &["--docker"]);
        // SAFETY: kill has no memory arguments; the pid is our child's.
        unsafe { libc::kill(sup.child.id() as i32, libc::SIGTERM) };
        let _ = sup.child.wait();
    }
}

fn container_exists(name: &str) -> bool {
    Command::new("docker")
        .args(["inspect", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn mounts_under(dir: &Path) -> usize {
    taskbox_tests::mounts_under(dir).len()
}

#[test]
fn one_supervisor_serves_both_backends_and_a_restart_reaps_orphans() {
    if !ready() {
        return;
    }
    let _lock = docker_lock();
    let env = Env::new();
    let _sweep = Sweep(&env);
    import_image(env.dir.path());
    env.write("hello.txt", "hello\n");
    let ws = env.ws().display().to_string();
    let sup = Supervisor::start(&env, &["--docker"]);

    let (status, docker) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": ws, "backend": "docker", "image": IMAGE})),
    );
    assert_eq!(status, 201, "{docker}");
    assert_eq!(docker["backend"], "docker");
    let (status, native) = sup.call("POST", "/v1/sandboxes", Some(json!({"workspace": ws})));
    assert_eq!(status, 201, "{native}");
    assert_eq!(native["backend"], "native");
    let (status, bad) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": ws, "backend": "kvm"})),
    );
    assert_eq!(status, 400, "{bad}");

    let (_, list) = sup.call("GET", "/v1/sandboxes", None);
    let mut backends: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["backend"].as_str().unwrap())
        .collect();
    backends.sort();
    assert_eq!(backends, ["docker", "native"]);

    let did = docker["id"].as_str().unwrap().to_string();
    let nid = native["id"].as_str().unwrap();
    for id in [did.as_str(), nid] {
        let (status, r) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "cat hello.txt; echo changed > hello.txt; id -u"})),
        );
        assert_eq!(status, 200, "{r}");
        assert!(
            r["stdout"]["text"].as_str().unwrap().starts_with("hello\n"),
            "{r}"
        );
        let (_, d) = sup.call("POST", &format!("/v1/sandboxes/{id}/diff"), Some(json!({})));
        assert!(d["diff"].as_str().unwrap().contains("+changed"), "{d}");
    }
    let (_, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{did}/exec"),
        Some(json!({"shell": "id -u"})),
    );
    assert_eq!(r["stdout"]["text"], "1000\n");
    let (status, _) = sup.call("DELETE", &format!("/v1/sandboxes/{nid}"), None);
    assert_eq!(status, 204);

    // The CLI verbs reach the docker backend too.
    let verb = |args: &[&str]| {
        let out = env
            .command()
            .arg("--socket")
            .arg(&sup.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let vid = verb(&[
        "create",
        "--backend",
        "docker",
        "--image",
        IMAGE,
        "--workspace",
        &ws,
    ]);
    assert_eq!(verb(&["exec", &vid, "--", "id", "-u"]), "1000");
    verb(&["rm", &vid]);

    // Mid-exec, SIGKILL: the container and the host-side mounts are orphaned...
    let (status, bg) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{did}/exec"),
        Some(json!({"shell": "sleep 1000", "background": true})),
    );
    assert_eq!(status, 200, "{bg}");
    let name = format!("taskbox-{did}");
    assert!(container_exists(&name));
    sup.kill9();
    assert!(
        container_exists(&name),
        "the orphan outlives its supervisor"
    );
    assert!(mounts_under(&env.state().join("docker/sandboxes")) > 0);
    // ...and the next supervisor removes them.
    let sup = Supervisor::start(&env, &["--docker"]);
    assert!(!container_exists(&name), "the orphaned container is gone");
    assert_eq!(mounts_under(&env.state().join("docker/sandboxes")), 0);
    // The sandbox it owned is an infrastructure failure, not an unknown id, until destroyed.
    let (status, v) = sup.call("GET", &format!("/v1/sandboxes/{did}"), None);
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["error"]["code"], "infrastructure", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("the supervisor restarted")),
        "{v}"
    );
    let (status, _) = sup.call("DELETE", &format!("/v1/sandboxes/{did}"), None);
    assert_eq!(status, 204);
    let (status, _) = sup.call("GET", &format!("/v1/sandboxes/{did}"), None);
    assert_eq!(status, 404);
    assert_eq!(
        std::fs::read_to_string(env.ws().join("hello.txt")).unwrap(),
        "hello\n"
    );
}

#[test]
fn run_with_the_docker_backend_follows_the_run_conventions() {
    if !ready() {
        return;
    }
    let _lock = docker_lock();
    let env = Env::new();
    import_image(env.dir.path());
    env.write("a.txt", "a\n");
    let run = env.run_json(
        &["--backend", "docker", "--image", IMAGE, "--diff"],
        &[
            "sh",
            "-c",
            "echo out; echo err >&2; echo b >> a.txt; exit 3",
        ],
    );
    assert_eq!(run.status, 3, "{}", run.raw_stderr);
    assert_eq!(run.stdout(), "out\n");
    assert_eq!(run.stderr(), "err\n");
    assert!(run.json["diff"].as_str().unwrap().contains("+b"));
    assert_eq!(
        std::fs::read_to_string(env.ws().join("a.txt")).unwrap(),
        "a\n"
    );
    let run = env.run_json(
        &["--backend", "docker", "--image", IMAGE],
        &["no-such-command"],
    );
    assert_eq!(run.status, 127);
    let run = env.run_json(
        &["--backend", "docker", "--image", IMAGE, "--timeout", "1s"],
        &["sleep", "100"],
    );
    assert_eq!(run.status, 124);
    // taskbox's own failures: 125 and one line.
    let out = env
        .command()
        .args(["run", "--backend", "docker", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--image"));
    let r = Run::from_output(
        env.command()
            .args([
                "run",
                "--json",
                "--backend",
                "docker",
                "--image",
                IMAGE,
                "--",
                "true",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(r.exit_code(), Some(0));
    let runs = env.state().join("docker-runs");
    assert_eq!(std::fs::read_dir(&runs).map(|d| d.count()).unwrap_or(0), 0);
}

#[test]
fn execs_of_every_size_over_http_run_or_are_refused_naming_the_limit() {
    if !ready() {
        return;
    }
    let _lock = docker_lock();
    let env = Env::new();
    let _sweep = Sweep(&env);
    import_image(env.dir.path());
    let ws = env.ws().display().to_string();
    let sup = Supervisor::start(&env, &["--docker"]);
    let (status, created) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": ws, "backend": "docker", "image": IMAGE})),
    );
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let exec = |req: serde_json::Value| big_exec::over_http(&sup, &id, req);
    big_exec::check(
        &exec,
        big_exec::container_argument_space(&format!("taskbox-{id}")),
    );
    let (_, info) = sup.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(info["state"], "running", "{info}");
    let (status, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
}
