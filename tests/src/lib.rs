//! Shared helpers of the integration suites: find the real `taskbox` binary, run it, parse its
//! observation, and skip (or, under `TASKBOX_REQUIRE_ALL=1`, fail) when a prerequisite is absent.

// Test support: a failed expectation here is a test failure, so panicking is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

pub mod conformance;
pub mod suite;

/// Directory holding the `taskbox` and `taskbox-init` binaries: `$TASKBOX_BIN_DIR`, else the
/// cargo target directory of the running test binary.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TASKBOX_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/debug/deps/suite-HASH -> target/debug
    let deps = exe.parent().expect("deps dir");
    let dir = if deps.ends_with("deps") {
        deps.parent().expect("profile dir").to_path_buf()
    } else {
        deps.to_path_buf()
    };
    assert!(
        dir.join("taskbox").is_file(),
        "taskbox binary not found in {} (build the workspace first, or set TASKBOX_BIN_DIR)",
        dir.display()
    );
    dir
}

/// Path of the `taskbox` binary.
pub fn taskbox() -> PathBuf {
    bin_dir().join("taskbox")
}

/// Whether every skip must be a failure (CI sets this).
pub fn require_all() -> bool {
    std::env::var("TASKBOX_REQUIRE_ALL").is_ok_and(|v| v == "1")
}

/// Skips the calling test with a printed reason when `ok` is false; under
/// `TASKBOX_REQUIRE_ALL=1` that is a failure instead. Returns `ok`.
pub fn require(ok: bool, reason: &str) -> bool {
    if ok {
        return true;
    }
    if require_all() {
        panic!("required prerequisite missing (TASKBOX_REQUIRE_ALL=1): {reason}");
    }
    eprintln!("SKIP: {reason}");
    false
}

/// Whether the tests run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Where a suite's sandboxes run: the suites in `tests/` are one suite parametrised by backend
/// (see [`backend_suite!`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The native backend with the host view (the default of `taskbox run`).
    Native,
    /// The native backend with an image as the root.
    NativeImage,
    /// The Docker backend (always with an image).
    Docker,
}

/// The image the image-rooted variants run: Debian with python3, coreutils and a compiler, as
/// the escape probes need.
pub const SUITE_IMAGE: &str = "debian-dev";

/// The image store shared by the suites (root only: unpacked images may hold setuid files, so
/// the store is private to its owner). `scripts/test.sh` builds the images into it first;
/// [`ensure_image`] builds what is missing.
pub fn test_image_dir() -> PathBuf {
    std::env::var_os("TASKBOX_TEST_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/taskbox-test-images"))
}

/// Builds `name` into the shared test store unless it is there, one builder at a time (the
/// suites run as parallel processes). Returns false, with the reason printed, when it cannot.
pub fn ensure_image(name: &str) -> bool {
    use std::os::fd::AsRawFd;
    let dir = test_image_dir();
    std::fs::create_dir_all(&dir).expect("create the test image store");
    let lock = std::fs::File::create(dir.join(".suite.lock")).expect("lock file");
    // SAFETY: flock on an fd we own; released when `lock` is dropped.
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root");
    let state = tempfile::tempdir().expect("tempdir");
    let out = Command::new(taskbox())
        .args(["image", "build", name])
        .env("TASKBOX_IMAGE_DIR", &dir)
        .env("TASKBOX_STATE_DIR", state.path())
        .current_dir(repo)
        .stdin(Stdio::null())
        .output()
        .expect("spawn taskbox image build");
    require(
        out.status.success(),
        &format!(
            "cannot build the suite image {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Whether a Docker daemon answers.
pub fn docker_available() -> bool {
    Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Declares a suite once and runs it on every backend: each `fn name(env: Env) { ... }` becomes
/// `native::name`, `native_image::name` and `docker::name`. The image-rooted variants need root
/// (the shared image store) and, for docker, a daemon; they skip with the reason otherwise.
#[macro_export]
macro_rules! backend_suite {
    ($(fn $name:ident($env:ident: Env) $body:block)*) => {
        mod native {
            #[allow(unused_imports)]
            use super::*;
            $(#[test] fn $name() { let $env = $crate::Env::new(); $body })*
        }
        mod native_image {
            #[allow(unused_imports)]
            use super::*;
            $(#[test] fn $name() {
                let Some($env) = $crate::Env::for_backend($crate::Backend::NativeImage) else {
                    return;
                };
                $body
            })*
        }
        mod docker {
            #[allow(unused_imports)]
            use super::*;
            $(#[test] fn $name() {
                let Some($env) = $crate::Env::for_backend($crate::Backend::Docker) else {
                    return;
                };
                $body
            })*
        }
    };
}

/// A scratch environment for one test: a workspace, a state directory and a fake home.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub backend: Backend,
}

impl Default for Env {
    fn default() -> Self {
        Self::new()
    }
}

/// The mount points of this process's mount namespace at or beneath `dir`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect()
}

impl Drop for Env {
    /// What a test's processes left mounted under the environment is detached before its
    /// directory is removed, so nothing of a test stays on the host: a Docker supervisor killed
    /// before its shutdown ended (a test's `kill9`, or one slower to stop than its grace) leaves
    /// its private mount point of `STATE/docker`, which only the next supervisor on that state
    /// directory would take over. Each is named on stderr.
    fn drop(&mut self) {
        let mut left = mounts_under(self.dir.path());
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in left {
            eprintln!("detaching {}, left mounted by the test", p.display());
            let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
                continue;
            };
            // SAFETY: `c` is a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

impl Env {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("taskbox-test-")
            .tempdir()
            .expect("tempdir");
        for d in ["ws", "state", "home"] {
            std::fs::create_dir(dir.path().join(d)).expect("mkdir");
        }
        Env {
            dir,
            backend: Backend::Native,
        }
    }

    /// An environment on `backend`, or None (with the reason printed; a failure under
    /// `TASKBOX_REQUIRE_ALL=1`) when it cannot run here.
    pub fn for_backend(backend: Backend) -> Option<Self> {
        let usable = backend == Backend::Native
            || (require(
                is_root(),
                "the image-rooted suites use the root-owned test image store",
            ) && (backend != Backend::Docker
                || require(
                    docker_available(),
                    "no Docker daemon answers (start dockerd)",
                ))
                && ensure_image(SUITE_IMAGE));
        if !usable {
            return None;
        }
        let mut env = Env::new();
        env.backend = backend;
        Some(env)
    }

    /// The workspace's path as commands in the sandbox see it.
    pub fn inside_ws(&self) -> PathBuf {
        match self.backend {
            Backend::Native => std::fs::canonicalize(self.ws()).expect("canonical workspace"),
            Backend::NativeImage | Backend::Docker => PathBuf::from("/workspace"),
        }
    }

    /// The `run` flags that select this environment's backend.
    pub fn backend_args(&self) -> Vec<&'static str> {
        match self.backend {
            Backend::Native => vec![],
            Backend::NativeImage => vec!["--image", SUITE_IMAGE],
            Backend::Docker => vec!["--backend", "docker", "--image", SUITE_IMAGE],
        }
    }

    pub fn ws(&self) -> PathBuf {
        self.dir.path().join("ws")
    }

    pub fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Writes a file in the workspace (creating parents).
    pub fn write(&self, rel: &str, content: &str) {
        let p = self.ws().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, content).expect("write");
    }

    /// A `taskbox` command with this environment's state dir and home.
    pub fn command(&self) -> Command {
        let mut c = Command::new(taskbox());
        c.env("TASKBOX_STATE_DIR", self.state())
            .env("HOME", self.home())
            .current_dir(self.ws())
            .stdin(Stdio::null());
        if self.backend != Backend::Native {
            c.env("TASKBOX_IMAGE_DIR", test_image_dir());
        }
        c
    }

    /// A `taskbox` verb against the supervisor at `socket` (started there when none answers), in
    /// the workspace, with this environment's state directory and home.
    pub fn cli(&self, socket: &Path, args: &[&str]) -> Output {
        Command::new(taskbox())
            .arg("--socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(self.state())
            .args(args)
            .env("HOME", self.home())
            .current_dir(self.ws())
            .stdin(Stdio::null())
            .output()
            .expect("spawn taskbox")
    }

    /// `taskbox run` with this environment's backend flags.
    pub fn run_command(&self) -> Command {
        let mut c = self.command();
        c.arg("run").args(self.backend_args());
        c
    }

    /// `taskbox run --json [extra...] -- argv...`, parsed.
    pub fn run_json(&self, extra: &[&str], argv: &[&str]) -> Run {
        let mut c = self.command();
        c.arg("run")
            .arg("--json")
            .args(self.backend_args())
            .args(extra)
            .arg("--")
            .args(argv);
        Run::from_output(c.output().expect("spawn taskbox"))
    }

    /// `taskbox run --json -- sh -c SCRIPT`, parsed.
    pub fn sh(&self, script: &str) -> Run {
        self.run_json(&[], &["/bin/sh", "-c", script])
    }

    /// Like [`Env::sh`] with extra `run` flags.
    pub fn sh_with(&self, extra: &[&str], script: &str) -> Run {
        self.run_json(extra, &["/bin/sh", "-c", script])
    }

    /// Writes a policy file into the scratch directory and returns its path.
    pub fn policy(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, text).expect("write policy");
        p
    }
}

/// The text of a policy file, for a create request's `policy_toml` (the supervisor takes
/// policies as names or text, never as paths).
pub fn policy_text(path: &Path) -> String {
    std::fs::read_to_string(path).expect("read policy")
}

/// The result of one `taskbox run --json`.
#[derive(Debug)]
pub struct Run {
    pub status: i32,
    pub json: Value,
    pub raw_stderr: String,
}

impl Run {
    pub fn from_output(out: Output) -> Run {
        let status = out.status.code().unwrap_or(-1);
        let raw_stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "taskbox did not print JSON ({e}); exit {status}\nstdout: {}\nstderr: {raw_stderr}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        Run {
            status,
            json,
            raw_stderr,
        }
    }

    pub fn stdout(&self) -> &str {
        self.json["stdout"]["text"].as_str().unwrap_or_default()
    }

    pub fn stderr(&self) -> &str {
        self.json["stderr"]["text"].as_str().unwrap_or_default()
    }

    pub fn exit_code(&self) -> Option<i64> {
        self.json["exit_code"].as_i64()
    }

    /// Asserts the command exited 0, showing its output otherwise.
    pub fn ok(&self) -> &Self {
        assert_eq!(
            self.exit_code(),
            Some(0),
            "command failed: {:#}\ntaskbox stderr: {}",
            self.json,
            self.raw_stderr
        );
        self
    }
}

/// The pids of host processes whose command line contains `needle`.
pub fn host_processes_with(needle: &str) -> Vec<i32> {
    let mut found = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(needle) {
                found.push(pid);
            }
        }
    }
    found
}

/// The children of process `parent` whose command line contains `needle`.
pub fn children_with(parent: u32, needle: &str) -> Vec<i32> {
    host_processes_with(needle)
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(parent as i32))
        .collect()
}

/// The parent of process `pid`, unless it is gone.
pub fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": the name may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The open descriptor numbers of process `pid`, sorted.
pub fn descriptors_of(pid: i32) -> Vec<i32> {
    let mut fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    fds.sort_unstable();
    fds
}

/// The cgroup directories on the host whose name matches `pattern` (a `find -name` glob), in
/// every controller's hierarchy (v1) and in the unified one (v2).
pub fn host_cgroups(pattern: &str) -> Vec<String> {
    let mut found = Vec::new();
    for controller in ["memory", "pids", "cpu", "cpuacct", ""] {
        let root = Path::new("/sys/fs/cgroup").join(controller);
        let Ok(out) = Command::new("find")
            .arg(&root)
            .args(["-maxdepth", "4", "-type", "d", "-name", pattern])
            .output()
        else {
            continue;
        };
        found.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string),
        );
    }
    found
}

/// The sandbox directories in `dir` (a backend's `sandboxes` directory), by name: the entries
/// whose name starts with a dot are the backend's own (its lock, the mount points and mask file
/// its sandboxes share). None when `dir` cannot be read.
pub fn sandbox_dirs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

/// The cgroups a one-shot `taskbox run` of process `pid` made (`taskbox-ID`, whose id ends
/// with the process's pid in five hex digits) that are still on the host.
pub fn run_cgroups_of(pid: u32) -> Vec<String> {
    let suffix = format!("{:05x}", pid & 0xfffff);
    host_cgroups("taskbox-*")
        .into_iter()
        .filter(|l| !l.contains("taskbox-sb-") && l.ends_with(&suffix))
        .collect()
}

/// Stops `child` as a service manager would: SIGTERM, then SIGKILL if it is still there after
/// `grace`; reaped either way.
pub fn stop_gently(child: &mut std::process::Child, grace: std::time::Duration) {
    // SAFETY: kill has no memory arguments; the pid is the caller's child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A Python 3 interpreter from the host's system packages, usable inside the sandbox.
pub const PYTHON: &str = "/usr/bin/python3";

/// Whether `path` exists on the host.
pub fn exists(path: &str) -> bool {
    Path::new(path).exists()
}

/// Runs `args` with git in `dir`, isolated from the user's and the system's configuration (a
/// fixed identity, branch `main`, no signing); the test fails if git does. Its stdout, trimmed.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
        .args([
            "-c",
            "init.defaultBranch=main",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs `script` with `/bin/sh -c` in sandbox `id` of `api`, in the foreground; its result.
pub fn shell(
    api: &dyn taskbox_core::api::SandboxApi,
    id: &taskbox_core::api::SandboxId,
    script: &str,
) -> taskbox_core::result::ExecResult {
    let req = taskbox_core::api::ExecRequest {
        shell: Some(script.into()),
        ..Default::default()
    };
    finished(api, id, req)
}

/// Runs `req` in sandbox `id` to its end and returns its result (panics otherwise).
pub fn finished(
    api: &dyn taskbox_core::api::SandboxApi,
    id: &taskbox_core::api::SandboxId,
    req: taskbox_core::api::ExecRequest,
) -> taskbox_core::result::ExecResult {
    match api.exec(id, req, None).unwrap() {
        taskbox_core::api::ExecOutcome::Finished(r) => r,
        other => panic!("expected a finished exec, got {other:?}"),
    }
}

/// A minimal HTTP/1.1 client over a Unix socket, for driving `taskbox serve` in tests.
/// A real `taskbox serve` on `STATE/test.sock` of an environment (with `extra` flags, e.g.
/// `--docker` or `--tokens FILE`), killed when dropped.
pub struct Supervisor {
    pub child: std::process::Child,
    pub socket: PathBuf,
}

impl Supervisor {
    pub fn start(env: &Env, extra: &[&str]) -> Supervisor {
        Supervisor::start_with(env, extra, |_| {})
    }

    /// [`Supervisor::start`], with the command adjusted by `adjust` before it is spawned.
    pub fn start_with(env: &Env, extra: &[&str], adjust: impl FnOnce(&mut Command)) -> Supervisor {
        let socket = env.state().join("test.sock");
        let mut cmd = Command::new(taskbox());
        cmd.args(["serve", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(env.state())
            .args(extra)
            .env("HOME", env.home())
            .env("TASKBOX_IMAGE_DIR", test_image_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        adjust(&mut cmd);
        let mut child = cmd.spawn().expect("spawn taskbox serve");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if socket.exists() && std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return Supervisor { child, socket };
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the supervisor did not come up");
    }

    /// One request on the supervisor's socket: the status and the JSON body.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        http::call(&self.socket, method, path, body.as_ref())
    }

    /// Creates a sandbox on `env`'s workspace; its id.
    pub fn create_sandbox(&self, env: &Env) -> String {
        let (st, info) = self.call(
            "POST",
            "/v1/sandboxes",
            Some(serde_json::json!({"workspace": env.ws().display().to_string()})),
        );
        assert_eq!(st, 201, "{info}");
        info["id"].as_str().unwrap_or_default().to_string()
    }

    /// [`Supervisor::call`] with a bearer token.
    pub fn call_as(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        http::call_as(&self.socket, Some(token), method, path, body.as_ref())
    }

    /// Kills the supervisor with SIGKILL (a crash) and reaps it.
    pub fn kill9(mut self) {
        self.child.kill().expect("kill the supervisor");
        self.child.wait().expect("reap the supervisor");
    }
}

impl Drop for Supervisor {
    /// Stops the supervisor as a service manager would: SIGTERM (it destroys its sandboxes),
    /// then SIGKILL if it is still there after 20 seconds (a systemd unit's default is 90). A
    /// supervisor with Docker sandboxes, on a busy host, can take more than the 5 s this was:
    /// killed before its shutdown ended, it left its private mount point of `STATE/docker`
    /// bound on the host, about once per CI run.
    fn drop(&mut self) {
        stop_gently(&mut self.child, std::time::Duration::from_secs(20));
    }
}

/// The supervisor's JSON API over its Unix socket, through the agent's HTTP client (hyper).
pub mod http {
    use std::path::Path;
    use std::time::Duration;

    use serde_json::Value;
    use taskbox_agent::http::{Client, Request};

    /// Sends one request; returns the status and the JSON body (Null when empty).
    pub fn call(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        call_as(socket, None, method, path, body)
    }

    /// [`call`] with `Authorization: Bearer TOKEN` when a token is given.
    pub fn call_as(
        socket: &Path,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let payload = body.map(|b| serde_json::to_vec(b).unwrap());
        let mut req = Request::new(method, path);
        req.headers = token
            .map(|t| ("Authorization", format!("Bearer {t}")))
            .into_iter()
            .collect();
        req.body = payload.as_deref();
        // No deadline of its own: a test's own timeout bounds a request that hangs.
        let r = Client::unix(socket)
            .and_then(|c| c.send(&req, Duration::MAX))
            .unwrap_or_else(|e| panic!("{method} {path} on the supervisor: {e}"));
        let body = if r.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&r.body)
                .unwrap_or(Value::String(String::from_utf8_lossy(&r.body).into()))
        };
        (r.status, body)
    }
}

/// Image roots for the native backend's image tests, built here from the host's static busybox
/// (the image store is another crate; the backend only needs an [`ImageRoot`]).
pub mod image {
    use std::collections::BTreeMap;
    use std::os::unix::fs::symlink;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    use taskbox_core::api::ApiError;
    use taskbox_core::image::{ImageConfig, ImageResolver, ImageRoot};

    /// The static busybox the test images are made of.
    pub const BUSYBOX: &str = "/bin/busybox";

    /// Whether the test images can be built (skips with a reason otherwise).
    pub fn available() -> bool {
        crate::require(
            Path::new(BUSYBOX).is_file(),
            "no static busybox at /bin/busybox to build a test image from (install busybox-static)",
        )
    }

    /// Builds a busybox root filesystem in `dir`: `/bin/busybox` and its applet links, `/etc`
    /// with `passwd`, `group` and `image-marker` (content "busybox-test-image"), `/tmp`,
    /// `/var/tmp`, `/root`, `/home/dev` (owned by the caller, mode 0700). No `/workspace`,
    /// `/proc` or `/dev`: the backend must provide its mount points itself.
    pub fn busybox_rootfs(dir: &Path) -> PathBuf {
        let root = dir.to_path_buf();
        for d in [
            "bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "var/tmp", "root",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::copy(BUSYBOX, root.join("bin/busybox")).unwrap();
        let out = std::process::Command::new(BUSYBOX)
            .arg("--list-full")
            .output()
            .unwrap();
        for applet in String::from_utf8_lossy(&out.stdout).lines() {
            let link = root.join(applet);
            if applet.is_empty() || link.exists() {
                continue;
            }
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            symlink("/bin/busybox", &link).unwrap();
        }
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\ndev:x:1000:1000:dev:/home/dev:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        )
        .unwrap();
        std::fs::write(
            root.join("etc/group"),
            "root:x:0:\ndev:x:1000:\nnogroup:x:65534:\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/image-marker"), "busybox-test-image\n").unwrap();
        std::fs::create_dir_all(root.join("home/dev")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))
            .unwrap();
        std::fs::set_permissions(
            root.join("home/dev"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        root
    }

    /// An image root for `rootfs` with `config`; the digest is derived from `name`.
    pub fn image_root(name: &str, rootfs: &Path, config: ImageConfig) -> ImageRoot {
        use sha2::Digest;
        let hex = format!("{:x}", sha2::Sha256::digest(name.as_bytes()));
        ImageRoot {
            digest: format!("sha256:{hex}"),
            config_digest: format!("sha256:{:x}", sha2::Sha256::digest(hex.as_bytes())),
            rootfs: rootfs.to_path_buf(),
            config,
        }
    }

    /// Every entry of a tree with its type, mode, size and mtime: equal before and after
    /// means nothing in it was written.
    pub fn tree_state(root: &Path) -> BTreeMap<PathBuf, (u32, u64, i64, i64)> {
        use std::os::unix::fs::MetadataExt;
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let md = std::fs::symlink_metadata(&dir).unwrap();
            out.insert(
                dir.clone(),
                (md.mode(), md.size(), md.mtime(), md.mtime_nsec()),
            );
            if !md.is_dir() {
                continue;
            }
            for e in std::fs::read_dir(&dir).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
        out
    }

    /// A resolver over a fixed set of images, by name or digest.
    #[derive(Default)]
    pub struct TestImages {
        images: Mutex<BTreeMap<String, ImageRoot>>,
    }

    impl TestImages {
        pub fn add(&self, name: &str, image: ImageRoot) {
            self.images.lock().unwrap().insert(name.into(), image);
        }
    }

    impl ImageResolver for TestImages {
        fn resolve(&self, name_or_digest: &str) -> Result<ImageRoot, ApiError> {
            let images = self.images.lock().unwrap();
            images
                .get(name_or_digest)
                .or_else(|| images.values().find(|i| i.digest == name_or_digest))
                .cloned()
                .ok_or_else(|| {
                    ApiError::not_found(format!("image {name_or_digest} is not built here"))
                })
        }

        fn docker_archive(
            &self,
            digest: &str,
            _out: &mut dyn std::io::Write,
        ) -> Result<(), ApiError> {
            Err(ApiError::Unavailable(format!(
                "the test images are not exported ({digest})"
            )))
        }
    }
}

/// A static file server on the host's 127.0.0.1, for the egress suites: GET and HEAD of files
/// beneath a directory (a directory serves its `index.html`; a query string is ignored), one
/// request per connection, on a thread per connection. It stops when dropped.
pub mod web {
    use std::io::{BufRead, BufReader, Write};
    use std::net::{TcpListener, TcpStream};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    pub struct FileServer {
        pub port: u16,
        stop: Arc<AtomicBool>,
        requests: Arc<AtomicUsize>,
    }

    impl FileServer {
        pub fn start(root: &Path) -> FileServer {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let stop = Arc::new(AtomicBool::new(false));
            let requests = Arc::new(AtomicUsize::new(0));
            let (root, stop2, requests2) = (root.to_path_buf(), stop.clone(), requests.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    requests2.fetch_add(1, Ordering::SeqCst);
                    let root = root.clone();
                    std::thread::spawn(move || {
                        let _ = serve(conn, &root);
                    });
                }
            });
            FileServer {
                port,
                stop,
                requests,
            }
        }

        /// Connections accepted so far.
        pub fn requests(&self) -> usize {
            self.requests.load(Ordering::SeqCst)
        }
    }

    impl Drop for FileServer {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::SeqCst);
            // Wake the accept loop so it sees the flag.
            let _ = TcpStream::connect(("127.0.0.1", self.port));
        }
    }

    fn serve(conn: TcpStream, root: &Path) -> std::io::Result<()> {
        let mut reader = BufReader::new(conn.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_owned();
        let target = parts.next().unwrap_or("/").to_owned();
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
                break;
            }
        }
        let path = target.split(['?', '#']).next().unwrap_or("/");
        let rel = path.trim_start_matches('/');
        let body = if path == "/hello" {
            Some(b"hello from the test server\n".to_vec())
        } else if rel.split('/').any(|seg| seg == "..") {
            None
        } else {
            let mut file: PathBuf = root.join(rel);
            if file.is_dir() {
                file = file.join("index.html");
            }
            std::fs::read(&file).ok()
        };
        let mut out = conn;
        match body {
            Some(body) => {
                let kind = if path.ends_with('/') || path.ends_with(".html") {
                    "text/html"
                } else {
                    "application/octet-stream"
                };
                write!(
                    out,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: {kind}\r\n\
                     Connection: close\r\n\r\n",
                    body.len()
                )?;
                if method != "HEAD" {
                    out.write_all(&body)?;
                }
            }
            None => {
                out.write_all(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\nConnection: close\r\n\r\nnot found\n",
                )?;
            }
        }
        out.flush()
    }
}

/// Execs of the sizes a client can send (the API takes bodies up to 16 MiB): shell strings,
/// argvs and environments of 300 KB and 3 MB, inspect-ai's 16 arguments of 64 KiB, NUL bytes.
/// What execve can take must run with the right output; what it cannot must be refused with an
/// `invalid_argument` that names the limit; and after each the sandbox answers the next exec.
pub mod big_exec {
    use serde_json::{Value, json};

    /// How an exec ended: its exit code and stdout, or the error's code and message.
    pub type Outcome = Result<(Option<i64>, String), (String, String)>;

    /// One exec through whatever surface the caller tests (a JSON exec request in).
    pub type Exec<'a> = &'a dyn Fn(Value) -> Outcome;

    /// The argument space of a command that inherits this process's stack limit (sandboxes
    /// started by the test do), as the kernel computes it: a quarter, within 128 KiB..6 MiB.
    pub fn argument_space() -> u64 {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into `r`, which is valid for writes.
        let stack = if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut r) } == 0 {
            r.rlim_cur
        } else {
            8 << 20
        };
        (stack / 4).clamp(128 << 10, 6 << 20)
    }

    /// The argument space of the processes of a Docker container (they have its pid 1's stack
    /// limit).
    pub fn container_argument_space(container: &str) -> u64 {
        let out = std::process::Command::new("docker")
            .args(["inspect", "--format", "{{.State.Pid}}", container])
            .output()
            .unwrap();
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let stack = limits
            .lines()
            .find_map(|l| l.strip_prefix("Max stack size"))
            .and_then(|r| r.split_whitespace().next())
            .map_or(u64::MAX, |n| n.parse().unwrap_or(u64::MAX));
        (stack / 4).clamp(128 << 10, 6 << 20)
    }

    /// `n` arguments of `size` bytes each, each of its own letter.
    fn args(n: usize, size: usize) -> Vec<String> {
        (0..n)
            .map(|i| char::from(b'a' + (i % 26) as u8).to_string().repeat(size))
            .collect()
    }

    fn alive(exec: Exec<'_>, after: &str) {
        let r = exec(json!({"shell": "echo alive"}));
        assert_eq!(
            r,
            Ok((Some(0), "alive\n".to_string())),
            "the sandbox does not answer after {after}"
        );
    }

    fn refused(exec: Exec<'_>, what: &str, req: Value, needles: &[&str]) {
        match exec(req) {
            Err((code, message)) => {
                assert_eq!(code, "invalid_argument", "{what}: {message}");
                for n in needles {
                    assert!(
                        message.contains(n),
                        "{what}: {message:?} does not name {n:?}"
                    );
                }
                assert!(message.len() < 1000, "{what}: the error echoes the input");
            }
            Ok(r) => panic!("{what}: ran instead of being refused: {:?}", r.0),
        }
        alive(exec, what);
    }

    fn runs(exec: Exec<'_>, what: &str, argv: Vec<String>) {
        let want = format!("{}\n", argv[1..].join(" "));
        let r = exec(json!({"argv": argv, "output_limit": 16 << 20}));
        match r {
            Ok((code, out)) => {
                assert_eq!(code, Some(0), "{what}");
                assert_eq!(out.len(), want.len(), "{what}: output of the wrong size");
                assert!(out == want, "{what}: wrong output");
            }
            Err(e) => panic!("{what}: refused: {e:?}"),
        }
        alive(exec, what);
    }

    /// An exec of sandbox `id` over the HTTP API of `sup`.
    pub fn over_http(sup: &crate::Supervisor, id: &str, req: Value) -> Outcome {
        let (status, body) = sup.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(req));
        if status == 200 {
            let out = body["stdout"]["text"].as_str().unwrap_or_default();
            return Ok((body["exit_code"].as_i64(), out.to_string()));
        }
        let code = body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let message = body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if code == "invalid_argument" {
            assert_eq!(status, 400, "{message}");
        }
        Err((code, message))
    }

    /// Runs every case through `exec`. `space` is the sandbox's argument space (see
    /// [`argument_space`]; a backend may take less).
    pub fn check(exec: Exec<'_>, space: u64) {
        let strlen = ["131071", "MAX_ARG_STRLEN"];
        for size in [300_000, 3_000_000] {
            let line = format!("echo {}", "x".repeat(size));
            refused(
                exec,
                &format!("a shell string of {size} bytes"),
                json!({ "shell": line }),
                &["shell command", strlen[0], strlen[1]],
            );
            refused(
                exec,
                &format!("one argument of {size} bytes"),
                json!({"argv": ["echo", "x".repeat(size)]}),
                &["argument 2", strlen[0], strlen[1]],
            );
            refused(
                exec,
                &format!("an environment variable of {size} bytes"),
                json!({"shell": "true", "env": {"BIG": "x".repeat(size)}}),
                &["BIG", strlen[0], strlen[1]],
            );
        }
        refused(
            exec,
            "a NUL byte",
            json!({"argv": ["echo", "a\u{0}b"]}),
            &["NUL"],
        );
        // Totals of 300 KB and 3 MB in arguments of 100 KB, and inspect-ai's
        // `exec_large_command` (16 of 64 KiB): they run where they fit and are refused,
        // naming the space, where they do not.
        for (what, n, size) in [
            ("300 KB of arguments", 3, 100_000),
            ("3 MB of arguments", 30, 100_000),
            ("16 arguments of 64 KiB", 16, 64 << 10),
        ] {
            let mut argv = vec!["echo".to_string()];
            argv.extend(args(n, size));
            let total: u64 = argv.iter().map(|a| a.len() as u64 + 9).sum();
            // The environment and the program's path take a few KiB besides.
            if total + (64 << 10) < space {
                runs(exec, what, argv);
            } else if total > space {
                refused(
                    exec,
                    what,
                    json!({ "argv": argv }),
                    &[&format!("{space} bytes execve takes")],
                );
            }
        }
        if space < 3_000_000 {
            let env: serde_json::Map<String, Value> = (0..30)
                .map(|i| (format!("V{i}"), Value::String("x".repeat(100_000))))
                .collect();
            refused(
                exec,
                "3 MB of environment",
                json!({"shell": "true", "env": env}),
                &["execve takes"],
            );
        }
    }
}
