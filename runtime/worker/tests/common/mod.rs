//! Shared fixture of the worker suites: a real nats-server, a git repository with a failing
//! test (the agent's sample task), a scripted model server answering by turn, `taskbox worker`
//! processes, and a webhook receiver that counts what it gets.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_queue::testserver::NatsServer;
use taskbox_queue::{Queue, TaskRecord, TaskSpec, WorkspaceSource};
use taskbox_tests::{is_root, require, taskbox};

pub const BUGGY: &str = "add() { echo $(( $1 - $2 )); }\n";
pub const FIXED: &str = "add() { echo $(( $1 + $2 )); }\n";
pub const TEST: &str = ". ./src/math.sh\nr=$(add 2 3)\n[ \"$r\" = 5 ] || { echo \"FAIL: add 2 3 gave $r, want 5\"; exit 1; }\necho ok\n";

/// Whether the suite can run here: a nats-server and root (the native backend's sandboxes
/// as the workers make them; the rootless path has suites of its own).
pub fn ready() -> Option<NatsServer> {
    if !require(is_root(), "the worker suites run sandboxes as root") {
        return None;
    }
    match NatsServer::start() {
        Ok(s) => Some(s),
        Err(why) => {
            require(false, &why);
            None
        }
    }
}

pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@localhost")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@localhost")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A bare repository holding the sample task (a failing test of `add`), and its commit.
pub struct Repo {
    pub bare: PathBuf,
    pub commit: String,
}

pub fn repo(dir: &Path) -> Repo {
    let src = dir.join("src-repo");
    std::fs::create_dir_all(src.join("src")).unwrap();
    std::fs::create_dir_all(src.join("tests")).unwrap();
    std::fs::write(src.join("src/math.sh"), BUGGY).unwrap();
    std::fs::write(src.join("tests/test_math.sh"), TEST).unwrap();
    git(&src, &["init", "-q", "-b", "main"]);
    git(&src, &["add", "."]);
    git(&src, &["commit", "-q", "-m", "a calculator with a bug"]);
    let commit = git(&src, &["rev-parse", "HEAD"]);
    let bare = dir.join("repo.git");
    let out = Command::new("git")
        .args(["clone", "-q", "--bare"])
        .arg(&src)
        .arg(&bare)
        .output()
        .unwrap();
    assert!(out.status.success());
    Repo { bare, commit }
}

/// The sample task's contract; `word` is in its goal (the mock's script key).
pub fn contract(word: &str, extra: &str) -> String {
    format!(
        "goal = \"fix add in src/math.sh so that tests/test_math.sh passes ({word})\"\n\
         scope = [\"src/\"]\nverify = [\"sh tests/test_math.sh\"]\n{extra}\n\
         [budget]\nmax_turns = 10\ntime = \"5m\"\nexec_timeout_ms = 30000\n"
    )
}

/// The three turns that fix the sample task; `delay` holds the second the first time it is
/// asked (a worker to kill meanwhile).
pub fn fix_steps(delay: Option<Duration>) -> Vec<Step> {
    let run = Step::call("exec", json!({"shell": "sh tests/test_math.sh"}));
    vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        match delay {
            Some(d) => run.delayed(d),
            None => run,
        },
        Step::call("finish", json!({"summary": "fixed add"})),
    ]
}

/// A model server whose scripts are keyed by words of the goal and answered by turn.
pub fn model(addr: &str, scripts: Vec<(&str, Vec<Step>)>) -> MockServer {
    MockServer::by_turn(
        addr,
        Provider::Openai,
        scripts
            .into_iter()
            .map(|(k, s)| (k.to_owned(), s))
            .collect(),
    )
    .unwrap()
}

pub fn git_spec(repo: &Repo, contract: String) -> TaskSpec {
    TaskSpec::new(
        contract,
        WorkspaceSource::Git {
            url: repo.bare.display().to_string(),
            commit: repo.commit.clone(),
        },
    )
}

/// A `taskbox worker` process; killed (SIGKILL) when dropped unless stopped.
pub struct WorkerProc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
    pub state: PathBuf,
    pub workspaces: PathBuf,
}

impl WorkerProc {
    /// The worker's log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for the exit (at most `within`).
    pub fn term(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        self.exit_within(within)
    }

    /// Waits for the worker to exit on its own (at most `within`).
    pub fn exit_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let since = Instant::now();
        while since.elapsed() < within {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for WorkerProc {
    /// Stops it as a worker is stopped (SIGTERM: it ends its attempts and their sandboxes),
    /// then kills it if it is still there; then sweeps what a worker killed (here, or by the
    /// test) left of its sandboxes, as its next start under the same name would: their cgroups
    /// would otherwise stay on the host.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.term(Duration::from_secs(10));
        }
        self.kill9();
        let sandboxes = self.state.join("worker").join(&self.name).join("sandboxes");
        if sandboxes.is_dir() {
            let _ = taskbox_core::sandbox::NativeBackend::new(sandboxes);
        }
    }
}

/// How to start a worker.
pub struct WorkerOpts<'a> {
    pub nats: &'a str,
    pub model: &'a str,
    pub claim_timeout: &'a str,
    pub extra: Vec<String>,
    /// Run it in this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// More environment.
    pub env: Vec<(String, String)>,
}

impl<'a> WorkerOpts<'a> {
    pub fn new(nats: &'a str, model: &'a str) -> WorkerOpts<'a> {
        WorkerOpts {
            nats,
            model,
            claim_timeout: "3s",
            extra: Vec::new(),
            netns: None,
            env: Vec::new(),
        }
    }
}

pub fn start_worker(dir: &Path, name: &str, o: &WorkerOpts<'_>) -> WorkerProc {
    let state = dir.join(format!("state-{name}"));
    std::fs::create_dir_all(&state).unwrap();
    let workspaces = dir.join(format!("workspaces-{name}"));
    let log = dir.join(format!("{name}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let mut c = match &o.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(taskbox());
            c
        }
        None => Command::new(taskbox()),
    };
    c.args([
        "worker",
        "--nats",
        o.nats,
        "--name",
        name,
        "--claim-timeout",
        o.claim_timeout,
    ])
    .arg("--state-dir")
    .arg(&state)
    .arg("--workspaces")
    .arg(&workspaces)
    .args(&o.extra)
    .env("TASKBOX_MODEL_PROVIDER", "openai")
    .env("TASKBOX_MODEL_BASE_URL", o.model)
    .env("TASKBOX_MODEL", "scripted")
    .env(
        "TASKBOX_LOG",
        "warn,taskbox_worker=debug,taskbox_queue=debug",
    )
    .env("NO_COLOR", "1")
    .env_remove("TASKBOX_NATS")
    .envs(o.env.iter().map(|(k, v)| (k, v)))
    .stdin(Stdio::null())
    .stdout(f.try_clone().unwrap())
    .stderr(f);
    let child = c.spawn().unwrap();
    WorkerProc {
        name: name.to_owned(),
        child,
        log,
        state,
        workspaces,
    }
}

/// Waits until task `id`'s record satisfies `done`; panics after `within` with the record
/// and `context()`.
pub async fn wait_for(
    q: &Queue,
    id: &str,
    within: Duration,
    context: impl Fn() -> String,
    done: impl Fn(&TaskRecord) -> bool,
) -> TaskRecord {
    let since = Instant::now();
    loop {
        if let Ok(t) = q.task(id).await
            && done(&t)
        {
            return t;
        }
        if since.elapsed() > within {
            let t = q.task(id).await;
            panic!(
                "task {id} not there within {within:?}: {t:#?}\n{}",
                context()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a webhook receiver got: the idempotency key and body of each POST.
#[derive(Default, Clone)]
pub struct Hooks(pub Arc<Mutex<Vec<(String, serde_json::Value)>>>);

impl Hooks {
    pub fn got(&self) -> Vec<(String, serde_json::Value)> {
        self.0.lock().unwrap().clone()
    }
}

/// A webhook receiver on `addr` (port 0: any); answers 200. Returns its URL.
pub fn webhook(addr: &str) -> (String, Hooks) {
    let listener = TcpListener::bind(addr).unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let hooks = Hooks::default();
    let h = hooks.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            let mut headers = BTreeMap::new();
            if r.read_line(&mut line).is_err() {
                continue;
            }
            loop {
                let mut l = String::new();
                if r.read_line(&mut l).unwrap_or(0) == 0 || l.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = l.split_once(':') {
                    headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
                }
            }
            let n: usize = headers
                .get("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut body = vec![0; n];
            let _ = r.read_exact(&mut body);
            let key = headers.get("idempotency-key").cloned().unwrap_or_default();
            let value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
            h.0.lock().unwrap().push((key, value));
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    (url, hooks)
}

/// Hosts of a test's own: network namespaces on a bridge of their own, on a private /24 the
/// host holds `.1` of. Nothing routes beyond it; all is removed when dropped.
pub struct TestNet {
    pub bridge: String,
    /// The host's address on the bridge.
    pub host: String,
    /// The namespaces, and each one's address.
    pub hosts: Vec<(String, String)>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestNet {
    /// `n` namespaces, or why there cannot be any here.
    pub fn new(n: usize) -> Result<TestNet, String> {
        if Command::new("ip").arg("-V").output().is_err() {
            return Err("iproute2's ip is not installed".into());
        }
        // A name and a /24 in 10.213.0.0/16 no one on the host uses (tests run side by side).
        let (tag, net, bridge) = loop {
            let id = taskbox_queue::new_task_id();
            let tag = id[id.len() - 6..].to_owned();
            let third = u8::from_str_radix(&tag[4..], 16).unwrap_or(7).clamp(1, 250);
            let net = format!("10.213.{third}");
            let bridge = format!("tbq{tag}");
            let used = Command::new("ip").args(["-o", "addr"]).output().unwrap();
            if String::from_utf8_lossy(&used.stdout).contains(&format!("{net}.")) {
                continue;
            }
            let made = Command::new("ip")
                .args(["link", "add", "name", &bridge, "type", "bridge"])
                .output()
                .unwrap();
            if made.status.success() {
                break (tag, net, bridge);
            }
        };
        let tag = tag.as_str();
        let mut me = TestNet {
            bridge: bridge.clone(),
            host: format!("{net}.1"),
            hosts: Vec::new(),
        };
        ip(&["addr", "add", &format!("{net}.1/24"), "dev", &bridge]);
        ip(&["link", "set", &bridge, "up"]);
        for i in 0..n {
            let ns = format!("tbq{tag}n{i}");
            let (outer, inner) = (format!("tbq{tag}h{i}"), format!("tbq{tag}v{i}"));
            let addr = format!("{net}.{}", 11 + i);
            ip(&["netns", "add", &ns]);
            me.hosts.push((ns.clone(), addr.clone()));
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ]);
            ip(&["link", "set", &inner, "netns", &ns]);
            ip(&["link", "set", &outer, "master", &bridge, "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &inner,
            ]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        Ok(me)
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for (ns, _) in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}
