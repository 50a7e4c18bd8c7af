//! `taskbox-bench queue`: what the queue costs a task, and how many short tasks workers get
//! through. The task is the agent's sample (a failing test of `add`, three scripted turns:
//! edit, run the test, finish through the verification gate) against a scripted model server
//! in this process, answering by turn.
//!
//! - Overhead: the same task run directly (`taskbox agent run`, a fresh process, as a person
//!   runs it) and through the queue (`submit` to a warm `taskbox worker`), alternating: from the
//!   command's start or the submit to the start of the task's sandbox (the agent's task record,
//!   written once its sandbox exists), and to the task's end.
//! - Throughput: TASKS tasks submitted at once to 1, 2 and 3 workers (one task at a time each):
//!   tasks per second from the first submit to the last end.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use serde_json::{Value, json};
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_queue::{Queue, TaskSpec, TaskState, WorkspaceSource, artifact_name};

use crate::stats::summary;

#[derive(Args)]
pub struct QueueArgs {
    /// The NATS server (JetStream on).
    #[arg(long)]
    nats: String,
    /// The taskbox binary.
    #[arg(long)]
    taskbox: PathBuf,
    /// A scratch directory.
    #[arg(long)]
    dir: PathBuf,
    /// Alternating rounds of the overhead figure (one task each way per round).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Tasks per throughput run.
    #[arg(long, default_value_t = 30)]
    tasks: usize,
    /// Throughput with 1 to WORKERS workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
}

const BUGGY: &str = "add() { echo $(( $1 - $2 )); }\n";
const TEST: &str = ". ./src/math.sh\nr=$(add 2 3)\n[ \"$r\" = 5 ] || { echo \"FAIL: add 2 3 gave $r\"; exit 1; }\necho ok\n";

fn contract() -> String {
    "goal = \"fix add in src/math.sh so that tests/test_math.sh passes (bench)\"\n\
     scope = [\"src/\"]\nverify = [\"sh tests/test_math.sh\"]\n\
     [budget]\nmax_turns = 10\ntime = \"5m\"\n"
        .to_owned()
}

fn steps() -> Vec<Step> {
    vec![
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        Step::call("exec", json!({"shell": "sh tests/test_math.sh"})),
        Step::call("finish", json!({"summary": "fixed add"})),
    ]
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "bench")
        .env("GIT_AUTHOR_EMAIL", "bench@localhost")
        .env("GIT_COMMITTER_NAME", "bench")
        .env("GIT_COMMITTER_EMAIL", "bench@localhost")
        .output()?;
    ensure!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The `at_ms` of an agent trace's first record (its task record: the sandbox exists).
fn sandbox_started_ms(trace: &[u8]) -> Result<u64> {
    let first = trace
        .split(|b| *b == b'\n')
        .next()
        .context("an empty agent trace")?;
    let v: Value = serde_json::from_slice(first)?;
    v["at_ms"]
        .as_u64()
        .context("the trace's task record has no at_ms")
}

struct Bench<'a> {
    a: &'a QueueArgs,
    model_url: String,
    workspace: PathBuf,
    bare: PathBuf,
    commit: String,
}

impl Bench<'_> {
    fn model_env(&self, c: &mut Command) {
        c.env("TASKBOX_MODEL_PROVIDER", "openai")
            .env("TASKBOX_MODEL_BASE_URL", &self.model_url)
            .env("TASKBOX_MODEL", "scripted")
            .env_remove("TASKBOX_NATS");
    }

    fn worker(&self, name: &str) -> Result<Child> {
        let state = self.a.dir.join(format!("state-{name}"));
        std::fs::create_dir_all(&state)?;
        let log = std::fs::File::create(self.a.dir.join(format!("{name}.log")))?;
        let mut c = Command::new(&self.a.taskbox);
        c.args([
            "worker",
            "--nats",
            &self.a.nats,
            "--name",
            name,
            "--no-schedules",
        ])
        .arg("--state-dir")
        .arg(&state)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        self.model_env(&mut c);
        Ok(c.spawn()?)
    }

    /// Waits until worker `name` has connected (its log says so).
    fn connected(&self, name: &str) -> Result<()> {
        let since = Instant::now();
        let log = self.a.dir.join(format!("{name}.log"));
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("takes tasks from")
        {
            ensure!(
                since.elapsed() < Duration::from_secs(60),
                "worker {name} did not connect: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// One direct run: (to the sandbox's start, to the end).
    fn direct(&self, i: usize) -> Result<(Duration, Duration)> {
        let task_dir = self.a.dir.join(format!("direct-{i}"));
        let contract = self.a.dir.join("contract.toml");
        let t0_ms = now_ms();
        let t0 = Instant::now();
        let mut c = Command::new(&self.a.taskbox);
        c.args([
            "agent",
            "run",
            "--json",
            "--approvals",
            "deny",
            "--contract",
        ])
        .arg(&contract)
        .arg("--workspace")
        .arg(&self.workspace)
        .arg("--task-dir")
        .arg(&task_dir)
        .arg("--state-dir")
        .arg(self.a.dir.join("state-direct"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        self.model_env(&mut c);
        let out = c.output()?;
        let total = t0.elapsed();
        ensure!(
            out.status.success(),
            "taskbox agent run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let started = sandbox_started_ms(&std::fs::read(task_dir.join("trace.jsonl"))?)?;
        Ok((Duration::from_millis(started.saturating_sub(t0_ms)), total))
    }

    /// One queued run on the warm worker: (submit to the sandbox's start, to the end).
    async fn queued(&self, q: &Queue) -> Result<(Duration, Duration)> {
        let t0_ms = now_ms();
        let t0 = Instant::now();
        let id = q.submit(self.spec(), None).await?.task.id;
        let t = loop {
            let t = q.task(&id).await?;
            if t.state.is_final() {
                break t;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let total = t0.elapsed();
        ensure!(t.state == TaskState::Completed, "{t:?}");
        let attempt = t.result.as_ref().map(|r| r.attempt).unwrap_or(1);
        let trace = q
            .get_artifact(&artifact_name(&id, attempt, "trace.jsonl"))
            .await?
            .context("no trace")?;
        let started = sandbox_started_ms(&trace)?;
        Ok((Duration::from_millis(started.saturating_sub(t0_ms)), total))
    }

    fn spec(&self) -> TaskSpec {
        TaskSpec::new(
            contract(),
            WorkspaceSource::Git {
                url: self.bare.display().to_string(),
                commit: self.commit.clone(),
            },
        )
    }
}

fn stop(mut c: Child) {
    let _ = nix_term(c.id());
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

fn nix_term(pid: u32) -> std::io::Result<()> {
    // SAFETY: kill(2) with a pid this process spawned and a valid signal number; no memory is
    // touched.
    let r = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn run(a: &QueueArgs) -> Result<Value> {
    std::fs::create_dir_all(&a.dir)?;
    let workspace = a.dir.join("repo");
    std::fs::create_dir_all(workspace.join("src"))?;
    std::fs::create_dir_all(workspace.join("tests"))?;
    std::fs::write(workspace.join("src/math.sh"), BUGGY)?;
    std::fs::write(workspace.join("tests/test_math.sh"), TEST)?;
    git(&workspace, &["init", "-q", "-b", "main"])?;
    git(&workspace, &["add", "."])?;
    git(&workspace, &["commit", "-q", "-m", "bench"])?;
    let commit = git(&workspace, &["rev-parse", "HEAD"])?;
    let bare = a.dir.join("repo.git");
    let cloned = Command::new("git")
        .args(["clone", "-q", "--bare"])
        .arg(&workspace)
        .arg(&bare)
        .status()?;
    ensure!(cloned.success(), "git clone --bare failed");
    std::fs::write(a.dir.join("contract.toml"), contract())?;
    let mock = MockServer::by_turn(
        "127.0.0.1:0",
        Provider::Openai,
        vec![("(bench)".to_owned(), steps())],
    )?;
    let b = Bench {
        a,
        model_url: mock.base_url(),
        workspace,
        bare,
        commit,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let q = rt.block_on(Queue::connect(&a.nats))?;

    // Overhead: one warm worker, rounds alternating which way goes first.
    let w = b.worker("overhead")?;
    b.connected("overhead")?;
    // One task each way first, untimed: the page cache and the consumer are warm after it.
    rt.block_on(b.queued(&q))?;
    b.direct(usize::MAX)?;
    let (mut d_start, mut d_total, mut q_start, mut q_total) = (vec![], vec![], vec![], vec![]);
    for round in 0..a.rounds {
        eprintln!("queue overhead: round {} of {}", round + 1, a.rounds);
        let mut direct = || -> Result<()> {
            let (s, t) = b.direct(round)?;
            d_start.push(s);
            d_total.push(t);
            Ok(())
        };
        if round % 2 == 0 {
            direct()?;
            let (s, t) = rt.block_on(b.queued(&q))?;
            q_start.push(s);
            q_total.push(t);
        } else {
            let (s, t) = rt.block_on(b.queued(&q))?;
            q_start.push(s);
            q_total.push(t);
            direct()?;
        }
    }
    stop(w);

    // Throughput with 1..=WORKERS workers.
    let mut throughput = Vec::new();
    for n in 1..=a.workers {
        let names: Vec<String> = (0..n).map(|i| format!("tp{n}-{i}")).collect();
        let mut workers = Vec::new();
        for name in &names {
            workers.push(b.worker(name)?);
        }
        for name in &names {
            b.connected(name)?;
        }
        eprintln!("queue throughput: {} tasks on {n} worker(s)", a.tasks);
        let t0 = Instant::now();
        let ids = rt.block_on(async {
            let mut ids = Vec::new();
            for _ in 0..a.tasks {
                ids.push(q.submit(b.spec(), None).await?.task.id);
            }
            anyhow::Ok(ids)
        })?;
        rt.block_on(async {
            loop {
                let mut done = 0;
                for id in &ids {
                    let t = q.task(id).await?;
                    if t.state.is_final() {
                        ensure!(t.state == TaskState::Completed, "{t:?}");
                        done += 1;
                    }
                }
                if done == ids.len() {
                    return anyhow::Ok(());
                }
                if t0.elapsed() > Duration::from_secs(600) {
                    bail!("{done} of {} tasks ended in 10 minutes", ids.len());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })?;
        let secs = t0.elapsed().as_secs_f64();
        for w in workers {
            stop(w);
        }
        throughput.push(json!({
            "workers": n,
            "tasks": a.tasks,
            "seconds": (secs * 1000.0).round() / 1000.0,
            "tasks_per_second": ((a.tasks as f64 / secs) * 100.0).round() / 100.0,
        }));
    }
    drop(mock);
    Ok(json!({
        "overhead": {
            "rounds": a.rounds,
            "direct_to_sandbox": summary("taskbox agent run: start to sandbox", &d_start),
            "queue_to_sandbox": summary("submit to sandbox (warm worker)", &q_start),
            "direct_total": summary("taskbox agent run: start to end", &d_total),
            "queue_total": summary("submit to end (warm worker)", &q_total),
        },
        "throughput": throughput,
    }))
}
