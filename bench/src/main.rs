//! taskbox-bench: the measuring client of `scripts/bench.sh api` (long-lived sandboxes and the
//! narrow API) and `house` (one build's supervisor against another's). It drives sandboxes over
//! the supervisor's HTTP API on its Unix socket (one keep-alive connection per sandbox, hyper's
//! client) and, for comparison, through the Rust library in this process, and times external
//! commands alongside. Every figure is measured in rounds, the order of the series reversed
//! every other round, so noise on a shared machine lands on all of them; each series reports
//! its whole and each round's percentiles. Prints JSON on stdout (times in ms); progress goes to
//! stderr.

mod docker;
mod egress;
mod findings;
mod fleet;
mod hop;
mod http;
mod procfs;
mod queue;
mod replay;
mod stats;
mod tls;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};
use taskbox_core::api::{
    CheckpointRequest, CreateRequest, DiffRequest, ExecOutcome, ExecRequest, ReadRequest,
    SandboxApi, SandboxId, WriteRequest,
};
use taskbox_core::sandbox::NativeBackend;
use taskbox_core::trace::Traced;

#[derive(Parser)]
#[command(
    name = "taskbox-bench",
    about = "Latency and memory of taskbox's long-lived sandboxes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Round trips of `exec` with argv ["/bin/true"] in a live sandbox.
    Exec(Common),
    /// `diff` (against the baseline) after one change: FILE rewritten with one more line.
    Diff {
        #[command(flatten)]
        common: Common,
        /// The file changed, relative to the workspace (it must exist there).
        #[arg(long, default_value = "d0/f0.txt")]
        change: String,
    },
    /// Cycles of: checkpoint c{i}, change the files, restore c{i}; with CHANGED files changed
    /// since the baseline (d0/f1.txt ... d{CHANGED-1}/f1.txt, which must exist).
    Checkpoint {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 10)]
        changed: usize,
    },
    /// Memory of the supervisor (PID) and of its sandbox helpers with COUNT idle sandboxes.
    Idle(IdleArgs),
    /// The Docker backend beside the docker CLI: create-to-first-exec from the warm pool
    /// against a cold `docker run --rm IMAGE true`, and `exec true` against `docker exec`.
    Docker(docker::DockerArgs),
    /// The egress path: a download and new connections through a sandbox's proxy against the
    /// same directly on the host.
    Egress(egress::EgressArgs),
    /// The client half of `egress`, run on the host and inside the sandbox.
    #[command(subcommand)]
    EgressClient(egress::ClientCmd),
    /// One relay hop on loopback: direct, through a splice relay as the proxy's, and through an
    /// in-kernel sockmap redirect; and what each lets pile up for a client that does not read.
    EgressHop(hop::HopArgs),
    /// Requests through the proxy to an inspected host (TLS terminated, secret presented)
    /// against a plain tunnel, interleaved: what the inspection adds.
    EgressTls(tls::TlsArgs),
    /// Replay overhead beyond the operations themselves, for a trace of OPS operations
    /// recorded here (`taskbox replay` run ROUNDS times).
    Replay(replay::ReplayArgs),
    /// What reading findings costs: commands through a supervisor that reads them and one of
    /// the same build started with TASKBOX_FINDINGS=off, in alternating rounds.
    FindingsCost(findings::CostArgs),
    /// What findings save the model: each case's result as the model reads it, with its
    /// findings first and with the head and tail of the output alone.
    FindingsText(findings::TextArgs),
    /// The task queue: a task submitted to a warm worker against the same task run directly
    /// (`taskbox agent run`), to its sandbox's start and to its end; and short tasks per second
    /// with 1, 2 and 3 workers.
    Queue(queue::QueueArgs),
    /// Fork 1 -> COUNT of a sandbox with CHANGED changed files: the time until every fork has
    /// answered an exec (issue 19).
    Fork(fleet::ForkArgs),
    /// Live idle sandboxes until a create fails (or a cap): host memory each, supervisor RSS.
    Density(fleet::DensityArgs),
    /// Sustained create + one exec + destroy by CLIENTS clients: cycles per second.
    Rate(fleet::RateArgs),
}

#[derive(Args)]
struct Common {
    /// The supervisor's Unix socket: the series "http".
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Another supervisor's Unix socket, as NAME=PATH (repeatable): the series "http NAME", in
    /// the same rounds as the others (one build's supervisor against another's).
    #[arg(long, value_name = "NAME=PATH")]
    socket_as: Vec<String>,
    /// Also through the library in this process (NativeBackend), state kept under DIR: the
    /// series "lib".
    #[arg(long, value_name = "DIR")]
    lib_state_dir: Option<PathBuf>,
    /// With --lib-state-dir: also through the library with the trace recorder around it, as
    /// `taskbox serve` runs it: the series "lib+trace".
    #[arg(long)]
    lib_traced: bool,
    /// Also through the library with its state (the sandboxes' upper layers, checkpoints) under
    /// DIR, meant to be on tmpfs: the series "lib, state on tmpfs" (a diagnostic of what the
    /// disk costs).
    #[arg(long, value_name = "DIR")]
    lib_tmpfs_state_dir: Option<PathBuf>,
    /// The workspace of the sandboxes.
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// Measured operations per API series (over all rounds).
    #[arg(long, default_value_t = 1000)]
    runs: usize,
    /// Unmeasured operations per API series at the start of each round.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Within a round, one operation of each series in turn (A B A B ...) instead of each
    /// series' share in one block.
    #[arg(long)]
    interleave: bool,
    /// A command timed alongside, as NAME=PROGRAM ARG... (split at spaces; repeatable).
    #[arg(long, value_name = "NAME=CMD")]
    compare: Vec<String>,
    /// Measured runs per compared command (over all rounds).
    #[arg(long, default_value_t = 40)]
    compare_runs: usize,
    /// Unmeasured runs per compared command at the start of each round.
    #[arg(long, default_value_t = 2)]
    compare_warmup: usize,
}

#[derive(Args)]
struct IdleArgs {
    /// The supervisor's Unix socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The supervisor's process id (its VmRSS is read from /proc/PID/status).
    #[arg(long)]
    pid: u32,
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    #[arg(long, default_value_t = 64)]
    count: usize,
    /// Seconds to wait after creating (and after destroying) before reading memory.
    #[arg(long, default_value_t = 3)]
    settle_secs: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let out = match cli.cmd {
        Cmd::Exec(c) => figure("exec", &c, Step::Exec, |_| Ok(()))?,
        Cmd::Diff { common, change } => {
            let host = std::fs::read_to_string(common.workspace.join(&change))
                .with_context(|| format!("cannot read {change} in the workspace"))?;
            let content = format!("{host}changed in the sandbox\n");
            figure("diff", &common, Step::Diff, |sb| {
                sb.write(&change, &content)?;
                let files = sb.diff_files()?;
                ensure!(files == 1, "diff after one change lists {files} files");
                Ok(())
            })?
        }
        Cmd::Checkpoint { common, changed } => {
            let files: Vec<String> = (0..changed).map(|k| format!("d{k}/f1.txt")).collect();
            figure(
                "checkpoint",
                &common,
                Step::Checkpoint(files.clone()),
                |sb| {
                    for (k, f) in files.iter().enumerate() {
                        sb.write(f, &format!("checkpointed {k}\n"))?;
                    }
                    let n = sb.diff_files()?;
                    ensure!(
                        n == files.len(),
                        "{n} files changed instead of {}",
                        files.len()
                    );
                    Ok(())
                },
            )?
        }
        Cmd::Idle(a) => idle(&a)?,
        Cmd::Docker(a) => docker::run(&a)?,
        Cmd::Egress(a) => egress::run(&a)?,
        Cmd::EgressClient(c) => return egress::client(c),
        Cmd::EgressHop(a) => return hop::run(&a),
        Cmd::EgressTls(a) => return tls::run(&a),
        Cmd::Replay(a) => replay::run(&a)?,
        Cmd::FindingsCost(a) => findings::cost(&a)?,
        Cmd::FindingsText(a) => findings::text(&a)?,
        Cmd::Queue(a) => queue::run(&a)?,
        Cmd::Fork(a) => fleet::fork(&a)?,
        Cmd::Density(a) => fleet::density(&a)?,
        Cmd::Rate(a) => fleet::rate(&a)?,
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

// ---- sandboxes ---------------------------------------------------------------------------------

/// One sandbox, reached over HTTP or through the library.
enum Sandbox {
    Http {
        client: http::Client,
        base: String,
        exec: String,
        diff: String,
    },
    Lib {
        api: Arc<dyn SandboxApi>,
        id: SandboxId,
    },
}

const EXEC_TRUE: &[u8] = br#"{"argv":["/bin/true"]}"#;

fn exec_true_req() -> ExecRequest {
    ExecRequest {
        argv: Some(vec!["/bin/true".into()]),
        ..ExecRequest::default()
    }
}

impl Sandbox {
    fn create_http(client: &mut Option<http::Client>, socket: &Path, ws: &Path) -> Result<Sandbox> {
        let mut c = match client.take() {
            Some(c) => c,
            None => http::Client::connect(socket)?,
        };
        let body = serde_json::to_vec(&json!({ "workspace": ws }))?;
        let info = c
            .post("/v1/sandboxes", &body)?
            .expect_status(201, "create")?
            .json()?;
        let id = info["id"]
            .as_str()
            .ok_or_else(|| anyhow!("create answered no id: {info}"))?;
        let base = format!("/v1/sandboxes/{id}");
        Ok(Sandbox::Http {
            exec: format!("{base}/exec"),
            diff: format!("{base}/diff"),
            base,
            client: c,
        })
    }

    fn create_lib(api: Arc<dyn SandboxApi>, ws: &Path) -> Result<Sandbox> {
        let info = api
            .create(CreateRequest {
                workspace: ws.display().to_string(),
                ..CreateRequest::default()
            })
            .map_err(|e| anyhow!("create: {e}"))?;
        Ok(Sandbox::Lib { api, id: info.id })
    }

    /// Times one `exec /bin/true` (the answer is checked after the clock stops).
    fn exec_true(&mut self) -> Result<Duration> {
        match self {
            Sandbox::Http { client, exec, .. } => {
                let t = Instant::now();
                let r = client.post(exec, EXEC_TRUE)?;
                let d = t.elapsed();
                let r = r.expect_status(200, "exec")?;
                if memfind(&r.body, br#""exit_code":0"#).is_none() {
                    bail!(
                        "exec /bin/true failed: {}",
                        String::from_utf8_lossy(&r.body)
                    );
                }
                Ok(d)
            }
            Sandbox::Lib { api, id } => {
                let t = Instant::now();
                let r = api.exec(id, exec_true_req(), None);
                let d = t.elapsed();
                match r.map_err(|e| anyhow!("exec: {e}"))? {
                    ExecOutcome::Finished(r) if r.exit_code == Some(0) => Ok(d),
                    other => bail!("exec /bin/true failed: {other:?}"),
                }
            }
        }
    }

    /// Times one `diff` against the baseline; also returns how many files it lists.
    fn diff(&mut self) -> Result<(Duration, usize)> {
        match self {
            Sandbox::Http { client, diff, .. } => {
                let t = Instant::now();
                let r = client.post(diff, b"{}")?;
                let d = t.elapsed();
                let v = r.expect_status(200, "diff")?.json()?;
                let n = v["files"]
                    .as_array()
                    .ok_or_else(|| anyhow!("diff answered no files: {v}"))?
                    .len();
                Ok((d, n))
            }
            Sandbox::Lib { api, id } => {
                let t = Instant::now();
                let r = api.diff(id, DiffRequest::default());
                let d = t.elapsed();
                Ok((d, r.map_err(|e| anyhow!("diff: {e}"))?.files.len()))
            }
        }
    }

    fn diff_files(&mut self) -> Result<usize> {
        Ok(self.diff()?.1)
    }

    fn write(&mut self, path: &str, content: &str) -> Result<()> {
        match self {
            Sandbox::Http { client, base, .. } => {
                let body = serde_json::to_vec(&json!({ "path": path, "content": content }))?;
                client
                    .post(&format!("{base}/write"), &body)?
                    .expect_status(200, "write")?;
            }
            Sandbox::Lib { api, id } => {
                api.write(
                    id,
                    WriteRequest {
                        path: path.into(),
                        content: content.into(),
                        ..WriteRequest::default()
                    },
                )
                .map_err(|e| anyhow!("write: {e}"))?;
            }
        }
        Ok(())
    }

    fn read(&mut self, path: &str) -> Result<String> {
        match self {
            Sandbox::Http { client, base, .. } => {
                let body = serde_json::to_vec(&json!({ "path": path }))?;
                let v = client
                    .post(&format!("{base}/read"), &body)?
                    .expect_status(200, "read")?
                    .json()?;
                Ok(v["content"].as_str().unwrap_or_default().to_string())
            }
            Sandbox::Lib { api, id } => Ok(api
                .read(
                    id,
                    ReadRequest {
                        path: path.into(),
                        ..ReadRequest::default()
                    },
                )
                .map_err(|e| anyhow!("read: {e}"))?
                .content),
        }
    }

    /// Times a checkpoint (`restore: false`) or a restore of checkpoint `name`.
    fn checkpoint(&mut self, name: &str, restore: bool) -> Result<Duration> {
        match self {
            Sandbox::Http { client, base, .. } => {
                let (path, want) = if restore {
                    (format!("{base}/restore"), 204)
                } else {
                    (format!("{base}/checkpoints"), 201)
                };
                let body = serde_json::to_vec(&json!({ "name": name }))?;
                let t = Instant::now();
                let r = client.post(&path, &body)?;
                let d = t.elapsed();
                r.expect_status(want, if restore { "restore" } else { "checkpoint" })?;
                Ok(d)
            }
            Sandbox::Lib { api, id } => {
                let req = CheckpointRequest { name: name.into() };
                let t = Instant::now();
                let r = if restore {
                    api.restore(id, req)
                } else {
                    api.checkpoint(id, req).map(|_| ())
                };
                let d = t.elapsed();
                r.map_err(|e| anyhow!("checkpoint/restore {name}: {e}"))?;
                Ok(d)
            }
        }
    }

    fn destroy(self) -> Result<()> {
        match self {
            Sandbox::Http {
                mut client, base, ..
            } => {
                client.delete(&base)?.expect_status(204, "destroy")?;
            }
            Sandbox::Lib { api, id } => api.destroy(&id).map_err(|e| anyhow!("destroy: {e}"))?,
        }
        Ok(())
    }

    fn connections(&self) -> Option<u64> {
        match self {
            Sandbox::Http { client, .. } => Some(client.connections),
            Sandbox::Lib { .. } => None,
        }
    }
}

fn memfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

// ---- series and rounds -------------------------------------------------------------------------

#[derive(Clone)]
enum Step {
    Exec,
    Diff,
    /// The files changed between checkpoint and restore.
    Checkpoint(Vec<String>),
}

enum Subject {
    Api(Sandbox, Step),
    Command(Vec<String>),
}

struct Series {
    name: String,
    subject: Subject,
    runs: usize,
    warmup: usize,
    next: usize,
    /// One list of samples per metric (checkpoint has two: checkpoint, restore).
    samples: Vec<Vec<Duration>>,
    /// Where each round's samples start in `samples` (for the figures of each round).
    round_starts: Vec<usize>,
}

impl Series {
    fn metrics(&self) -> Vec<String> {
        match &self.subject {
            Subject::Api(_, Step::Checkpoint(_)) => {
                vec![
                    format!("{} checkpoint", self.name),
                    format!("{} restore", self.name),
                ]
            }
            _ => vec![self.name.clone()],
        }
    }

    /// One measured step: its durations join the samples.
    fn measure(&mut self) -> Result<()> {
        let ds = self.step()?;
        self.samples.resize(ds.len(), Vec::new());
        for (acc, d) in self.samples.iter_mut().zip(ds) {
            acc.push(d);
        }
        Ok(())
    }

    fn step(&mut self) -> Result<Vec<Duration>> {
        let i = self.next;
        self.next += 1;
        match &mut self.subject {
            Subject::Api(sb, Step::Exec) => Ok(vec![sb.exec_true()?]),
            Subject::Api(sb, Step::Diff) => {
                let (d, n) = sb.diff()?;
                ensure!(n == 1, "diff listed {n} files instead of 1");
                Ok(vec![d])
            }
            Subject::Api(sb, Step::Checkpoint(files)) => {
                let name = format!("c{i}");
                let c = sb.checkpoint(&name, false)?;
                for (k, f) in files.iter().enumerate() {
                    sb.write(f, &format!("changed after {name}: {k}\n"))?;
                }
                let r = sb.checkpoint(&name, true)?;
                let back = sb.read(&files[0])?;
                ensure!(
                    back == "checkpointed 0\n",
                    "after restoring {name}, {} reads {back:?}",
                    files[0]
                );
                Ok(vec![c, r])
            }
            Subject::Command(argv) => {
                let t = Instant::now();
                let out = Command::new(&argv[0])
                    .args(&argv[1..])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .output()
                    .with_context(|| format!("cannot run {}", argv[0]))?;
                let d = t.elapsed();
                ensure!(
                    out.status.success(),
                    "{} failed ({}): {}",
                    argv.join(" "),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                Ok(vec![d])
            }
        }
    }
}

/// Sets up the series of a figure (one sandbox per API series, prepared by `prepare`), measures
/// them in rounds, and returns the figure's JSON.
fn figure(
    fig: &str,
    c: &Common,
    step: Step,
    prepare: impl Fn(&mut Sandbox) -> Result<()>,
) -> Result<Value> {
    ensure!(c.rounds >= 1, "--rounds must be at least 1");
    let mut series = Vec::new();
    let api = |name: &str, sb: Sandbox| Series {
        name: name.to_string(),
        subject: Subject::Api(sb, step.clone()),
        runs: c.runs,
        warmup: c.warmup,
        next: 0,
        samples: Vec::new(),
        round_starts: Vec::new(),
    };
    // The library backends live as long as their series (dropping one destroys its sandboxes).
    let mut backends: Vec<Arc<dyn SandboxApi>> = Vec::new();
    if let Some(socket) = &c.socket {
        let mut sb = Sandbox::create_http(&mut None, socket, &c.workspace)?;
        prepare(&mut sb)?;
        series.push(api("http", sb));
    }
    for spec in &c.socket_as {
        let (name, path) = spec
            .split_once('=')
            .ok_or_else(|| anyhow!("--socket-as {spec:?}: expected NAME=PATH"))?;
        let mut sb = Sandbox::create_http(&mut None, Path::new(path), &c.workspace)
            .with_context(|| format!("--socket-as {name}"))?;
        prepare(&mut sb)?;
        series.push(api(&format!("http {name}"), sb));
    }
    if let Some(dir) = &c.lib_state_dir {
        let native = NativeBackend::new(dir.join("lib")).map_err(|e| anyhow!("{e}"))?;
        let b: Arc<dyn SandboxApi> = Arc::new(native);
        backends.push(b.clone());
        let mut sb = Sandbox::create_lib(b, &c.workspace)?;
        prepare(&mut sb)?;
        series.push(api("lib", sb));
        if c.lib_traced {
            let native = NativeBackend::new(dir.join("traced")).map_err(|e| anyhow!("{e}"))?;
            let b: Arc<dyn SandboxApi> =
                Arc::new(Traced::new(native, dir.join("traced").join("traces")));
            backends.push(b.clone());
            let mut sb = Sandbox::create_lib(b, &c.workspace)?;
            prepare(&mut sb)?;
            series.push(api("lib+trace", sb));
        }
    }
    if let Some(dir) = &c.lib_tmpfs_state_dir {
        let native = NativeBackend::new(dir.clone()).map_err(|e| anyhow!("{e}"))?;
        let b: Arc<dyn SandboxApi> = Arc::new(native);
        backends.push(b.clone());
        let mut sb = Sandbox::create_lib(b, &c.workspace)?;
        prepare(&mut sb)?;
        series.push(api("lib, state on tmpfs", sb));
    }
    ensure!(
        !series.is_empty(),
        "give --socket, --socket-as and/or --lib-state-dir: nothing to measure"
    );
    for spec in &c.compare {
        let (name, cmd) = spec
            .split_once('=')
            .ok_or_else(|| anyhow!("--compare {spec:?}: expected NAME=CMD"))?;
        let argv: Vec<String> = cmd.split_whitespace().map(String::from).collect();
        ensure!(!argv.is_empty(), "--compare {spec:?}: empty command");
        series.push(Series {
            name: name.to_string(),
            subject: Subject::Command(argv),
            runs: c.compare_runs,
            warmup: c.compare_warmup,
            next: 0,
            samples: Vec::new(),
            round_starts: Vec::new(),
        });
    }

    let started = Instant::now();
    for r in 0..c.rounds {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..series.len()).collect()
        } else {
            (0..series.len()).rev().collect()
        };
        let share = |s: &Series| s.runs / c.rounds + usize::from(r < s.runs % c.rounds);
        if c.interleave {
            // One operation of each series in turn, so a burst of noise lands on all of them.
            for &k in &order {
                let s = &mut series[k];
                for _ in 0..s.warmup {
                    s.step()?;
                }
                s.round_starts.push(s.samples.first().map_or(0, Vec::len));
            }
            let t = Instant::now();
            let most = series.iter().map(share).max().unwrap_or(0);
            for i in 0..most {
                for &k in &order {
                    if i < share(&series[k]) {
                        series[k].measure()?;
                    }
                }
            }
            eprintln!(
                "  {fig}: round {}/{}: {} series interleaved, {most} each, in {:.1} s",
                r + 1,
                c.rounds,
                order.len(),
                t.elapsed().as_secs_f64()
            );
            continue;
        }
        for k in order {
            let s = &mut series[k];
            let share = share(s);
            for _ in 0..s.warmup {
                s.step()?;
            }
            s.round_starts.push(s.samples.first().map_or(0, Vec::len));
            let t = Instant::now();
            for _ in 0..share {
                s.measure()?;
            }
            eprintln!(
                "  {fig}: round {}/{}: {} x {} in {:.1} s",
                r + 1,
                c.rounds,
                share,
                s.name,
                t.elapsed().as_secs_f64()
            );
        }
    }

    let mut out = Vec::new();
    let mut connections = json!({});
    for s in &series {
        for (name, samples) in s.metrics().iter().zip(&s.samples) {
            let mut summary = stats::summary(name, samples);
            summary["rounds"] = stats::per_round(samples, &s.round_starts);
            out.push(summary);
        }
        if let Subject::Api(sb, _) = &s.subject
            && let Some(n) = sb.connections()
        {
            connections[&s.name] = json!(n);
        }
    }
    let result = json!({
        "figure": fig,
        "rounds": c.rounds,
        "seconds": started.elapsed().as_secs_f64(),
        "http_connections": connections,
        "series": out,
    });
    for s in series {
        if let Subject::Api(sb, _) = s.subject {
            sb.destroy()?;
        }
    }
    drop(backends);
    Ok(result)
}

// ---- idle memory -------------------------------------------------------------------------------

fn idle(a: &IdleArgs) -> Result<Value> {
    ensure!(
        Path::new(&format!("/proc/{}", a.pid)).exists(),
        "no process {}",
        a.pid
    );
    let settle = Duration::from_secs(a.settle_secs);
    let before = procfs::snapshot(a.pid);
    let mut client = http::Client::connect(&a.socket)?;
    let body = serde_json::to_vec(&json!({ "workspace": a.workspace }))?;
    let (mut ids, mut creates, mut execs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..a.count {
        let t = Instant::now();
        let info = client
            .post("/v1/sandboxes", &body)?
            .expect_status(201, "create")
            .with_context(|| format!("creating sandbox {} of {}", i + 1, a.count))?
            .json()?;
        creates.push(t.elapsed());
        let id = info["id"]
            .as_str()
            .ok_or_else(|| anyhow!("create answered no id: {info}"))?
            .to_string();
        // One exec each, so that every sandbox has served a command before it idles.
        let t = Instant::now();
        let r = client.post(&format!("/v1/sandboxes/{id}/exec"), EXEC_TRUE)?;
        execs.push(t.elapsed());
        r.expect_status(200, "exec")?;
        ids.push(id);
    }
    std::thread::sleep(settle);
    let with = procfs::snapshot(a.pid);
    eprintln!("  idle: {} sandboxes created; memory read", a.count);
    let mut destroys = Vec::new();
    for id in &ids {
        let t = Instant::now();
        client
            .delete(&format!("/v1/sandboxes/{id}"))?
            .expect_status(204, "destroy")?;
        destroys.push(t.elapsed());
    }
    std::thread::sleep(settle);
    let after = procfs::snapshot(a.pid);
    Ok(json!({
        "figure": "idle",
        "count": a.count,
        "before": before,
        "with_sandboxes": with,
        "after_destroy": after,
        "http_connections": client.connections,
        "series": [
            stats::summary("create", &creates),
            stats::summary("first exec", &execs),
            stats::summary("destroy", &destroys),
        ],
    }))
}
