//! `taskbox`: the command-line interface.
//!
//! Exit status of `run`: the command's own; 128+N when a signal N killed it; 124 on timeout;
//! 126 when the policy's command rules refused it (nothing ran); 125 for taskbox's own failures,
//! with one clear line on stderr (the convention of `docker run`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};

mod agent;
mod client;
mod docker;
mod image;
mod orphans;
mod queue;
mod replay;
mod verbs;
mod worker;
use taskbox_core::approvals::{Refusal, refusal_detail};
use taskbox_core::commands::{Check, Verdict};
use taskbox_core::native::{self, RunRequest, StdinSource};
use taskbox_core::policy;
use taskbox_core::runtime::RuntimeBuilder;

#[derive(Parser)]
#[command(
    name = "taskbox",
    version,
    about = "Sandboxed execution for AI coding agents: run commands in an isolated sandbox and get \
             structured observations back.",
    long_about = None,
    after_help = "Examples:\n  taskbox run -- cargo test\n  taskbox run --json --diff -- sh -c 'echo hi > notes.txt'\n  \
                  taskbox policy explain default"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    conn: verbs::Conn,
}

#[derive(Subcommand)]
enum Command {
    /// Run one command in a fresh sandbox around a workspace and report what happened.
    ///
    /// The workspace is mounted as an overlay: the command may change it, but the host copy stays
    /// untouched (use --diff to see what it changed). The exit status is the command's own
    /// (128+N for signal N, 124 on timeout, 125 for taskbox's own errors, 126 when the policy's
    /// command rules refused it, 127 when the command does not exist). A command the rules `ask`
    /// about is put to you on the terminal; without one it is denied.
    Run(RunArgs),
    /// Check and explain policies.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Serve one sandbox to an MCP client over stdin/stdout (tools: exec, read_file, write_file,
    /// edit_file, apply_patch, list, search, diff). The sandbox is destroyed when the client leaves.
    Mcp(McpArgs),
    /// Show recorded traces.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Re-run a recorded trace in a clean sandbox (same image digest, policy and workspace base)
    /// and report where it diverges: exit 0 when every operation matches, 1 when one diverges.
    Replay(replay::ReplayArgs),
    /// Serve the HTTP API (the supervisor): on a Unix socket (default STATE/taskbox.sock) and/or
    /// a TCP address. The CLI verbs talk to it; they start one when none runs.
    Serve(ServeArgs),
    /// Build, list, inspect, verify and remove reproducible images.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Run an AI coding agent in a sandbox under a work contract (run, resume, replay, eval).
    #[command(subcommand)]
    Agent(agent::AgentCommand),
    /// Queue a task (a work contract and its workspace) on the shared queue (NATS JetStream),
    /// for a worker on any machine; prints its id. Exit status 1 for a bad contract or spec.
    Submit(queue::SubmitArgs),
    /// Tasks on the shared queue: list, status, cancel, results.
    #[command(subcommand)]
    Tasks(queue::TasksCommand),
    /// Take tasks from the shared queue and run each with the agent in a fresh sandbox; any
    /// number of workers on any machines share one queue. A worker that dies loses its tasks
    /// to another, which resumes each from its last turn. SIGTERM: no new tasks, the running
    /// ones handed back at their next step.
    Worker(worker::WorkerArgs),
    /// Recurring tasks on the shared queue: add, list, remove.
    #[command(subcommand)]
    Schedule(queue::ScheduleCommand),
    #[command(flatten)]
    Verb(verbs::Verb),
}

#[derive(Args)]
struct McpArgs {
    /// The workspace directory (default: the current directory).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// A policy name or file.
    #[arg(long, value_name = "NAME|FILE", default_value = "default")]
    policy: String,
    /// Variables set in every exec.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Print a trace readably: its header, one line per operation, and a summary.
    Show {
        /// A trace file, or a sandbox id (looked up in STATE/traces).
        trace: String,
        /// Print the parsed trace as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a trace as one self-contained HTML page (timeline, outputs, diffs) to stdout.
    Html {
        /// A trace file, or a sandbox id (looked up in STATE/traces).
        trace: String,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// TCP address to listen on, e.g. 127.0.0.1:7070 (needs --tokens unless it is loopback).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// Tokens file mapping bearer tokens to tenants (TOML: [[token]] token = "..." tenant = "...").
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Live sandboxes across all tenants.
    #[arg(long, value_name = "N")]
    max_sandboxes: Option<usize>,
    /// Live sandboxes of one tenant.
    #[arg(long, value_name = "N")]
    max_sandboxes_per_tenant: Option<usize>,
    /// Sandboxes being created or forked at once across all tenants (default 16); past it: 429
    /// with Retry-After, at once.
    #[arg(long, value_name = "N")]
    max_starting: Option<usize>,
    /// Sandboxes being created or forked at once by one tenant (default 8).
    #[arg(long, value_name = "N")]
    max_starting_per_tenant: Option<usize>,
    /// Sandboxes created (or forked) per second across all tenants: N, N/s, N/m or N/h
    /// (default: unbounded); past it: 429 with Retry-After.
    #[arg(long, value_name = "RATE", value_parser = taskbox_server::Rate::parse)]
    create_rate: Option<taskbox_server::Rate>,
    /// Sandboxes created (or forked) per second by one tenant (default: unbounded).
    #[arg(long, value_name = "RATE", value_parser = taskbox_server::Rate::parse)]
    create_rate_per_tenant: Option<taskbox_server::Rate>,
    /// A sandbox's hard lifetime from its creation, which no lease or renew passes (default
    /// 7d; "none" for no limit).
    #[arg(long, value_name = "DUR|none", value_parser = parse_lifetime)]
    max_lifetime: Option<Lifetime>,
    /// Exec requests in flight across all tenants.
    #[arg(long, value_name = "N")]
    max_execs: Option<usize>,
    /// Exec requests in flight of one tenant.
    #[arg(long, value_name = "N")]
    max_execs_per_tenant: Option<usize>,
    /// Lease of a sandbox created without one (e.g. 1h).
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    default_ttl: Option<Duration>,
    /// Longest lease a client may ask for.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    max_ttl: Option<Duration>,
    /// Open API connections in total (default 1024); past it: 503 with Retry-After.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Open API connections of one client, a uid on the socket or an IP over TCP (default 256);
    /// past it: 429 with Retry-After.
    #[arg(long, value_name = "N")]
    max_connections_per_client: Option<usize>,
    /// Time a request's headers may take from its first byte (default 10s).
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    header_timeout: Option<Duration>,
    /// Time a request's body may pause, after its headers or a piece of it (default 30s);
    /// then 408.
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    body_timeout: Option<Duration>,
    /// Time a connection may wait for a request, or for its client to read an answer
    /// (default 60s).
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    idle_timeout: Option<Duration>,
    /// A directory under which any client may name workspaces (repeatable). Without one, only
    /// clients on the Unix socket may name a workspace, and only a directory their own user
    /// can read; others send the workspace as a tar (POST /v1/workspaces).
    #[arg(long = "workspace-root", value_name = "DIR")]
    workspace_roots: Vec<PathBuf>,
    /// A host a workspace clone (POST /v1/workspaces with a git URL) may reach although it
    /// resolves to a loopback, private or other internal address (repeatable; HOST or
    /// HOST:PORT).
    #[arg(long = "git-allow-host", value_name = "HOST")]
    git_allow_hosts: Vec<String>,
    /// Largest upload a client may stream, in bytes: a workspace tar, or a file (PUT
    /// /v1/sandboxes/ID/files) (default 2 GiB).
    #[arg(long, value_name = "BYTES")]
    max_upload_bytes: Option<u64>,
    /// Largest JSON request body, in bytes (default 16 MiB): a write's content, an exec's
    /// stdin and argv travel in it. Larger files go up streamed, bounded by
    /// --max-upload-bytes instead.
    #[arg(long, value_name = "BYTES")]
    max_body_bytes: Option<usize>,
    /// When each call's line in the trace (STATE/traces) reaches the disk: "batched" (default)
    /// writes it before the answer and syncs within 50 ms, so only a host crash or power loss
    /// can lose the last lines; "each-op" syncs it before the answer, and every call waits for
    /// the disk
    #[arg(long, value_name = "WHEN", default_value = "batched", value_parser = parse_trace_sync)]
    trace_sync: taskbox_core::trace::TraceSync,
    /// Native sandboxes kept started ahead for each fork origin (a parent's workspace, image,
    /// policy, environment and limits), filled after the origin's first fork: a fork takes
    /// them instead of starting sandboxes (0: no pool). They count in --max-sandboxes and in no
    /// tenant's limit, and give their places back when a create needs them
    #[arg(long, value_name = "N", default_value_t = 8)]
    fork_pool: usize,
    /// How long a pooled sandbox waits for a fork before it is retired (an origin not forked
    /// for as long is let go)
    #[arg(long, value_name = "DUR", default_value = "5m", value_parser = parse_duration)]
    fork_pool_idle: Duration,
    #[command(flatten)]
    docker: docker::ServeDocker,
}

fn parse_trace_sync(s: &str) -> Result<taskbox_core::trace::TraceSync, String> {
    use taskbox_core::trace::TraceSync;
    match s {
        "batched" => Ok(TraceSync::Batched),
        "each-op" => Ok(TraceSync::EachOp),
        other => Err(format!("{other:?}: expected \"batched\" or \"each-op\"")),
    }
}

#[derive(Args)]
struct RunArgs {
    /// The workspace directory (default: the current directory).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// A policy name (from $TASKBOX_POLICY_DIR or the built-in profiles) or a policy file.
    #[arg(long, value_name = "NAME|FILE", default_value = "default")]
    policy: String,
    /// Wall-clock timeout, e.g. 30s, 5m (default: the policy's).
    #[arg(long, value_name = "DUR", value_parser = parse_duration, allow_hyphen_values = true)]
    timeout: Option<Duration>,
    /// Print the observation (ExecResult) as JSON on stdout instead of the command's output.
    #[arg(long)]
    json: bool,
    /// Print the unified diff of what the command changed in the workspace.
    #[arg(long)]
    diff: bool,
    /// Mount the workspace read-write without the overlay: changes reach the host directory.
    #[arg(long)]
    write_through: bool,
    /// Set an environment variable in the sandbox (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Working directory inside the sandbox (default: the workspace root).
    #[arg(long, value_name = "DIR")]
    cwd: Option<PathBuf>,
    /// The backend: native (default) or docker.
    #[arg(long, value_name = "native|docker")]
    backend: Option<String>,
    /// The image (name or digest) the sandbox runs; required by the docker backend.
    #[arg(long, value_name = "NAME|DIGEST")]
    image: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Parse and validate a policy file (or name); errors name the file, the key and why.
    Check {
        /// A policy file or name.
        policy: String,
    },
    /// Say in plain words what a sandbox under this policy may and may not do.
    Explain {
        /// A policy name or file.
        #[arg(default_value = "default")]
        policy: String,
    },
    /// List the policies that can be named.
    List,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected K=V, got {s:?}"))?;
    if k.is_empty() {
        return Err("a label needs a name".into());
    }
    Ok((k.to_string(), v.to_string()))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?}: {e} (examples: 30s, 5m, 1h)"))?;
    if d.is_zero() {
        return Err("the timeout must be greater than zero".into());
    }
    Ok(d)
}

/// A hard lifetime: a duration, or none at all.
#[derive(Debug, Clone, Copy)]
struct Lifetime(Option<Duration>);

/// A duration, or "none".
fn parse_lifetime(s: &str) -> Result<Lifetime, String> {
    if s == "none" {
        return Ok(Lifetime(None));
    }
    parse_duration(s).map(|d| Lifetime(Some(d)))
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected K=V, got {s:?}"))?;
    if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("invalid variable name {k:?}"));
    }
    Ok((k.to_string(), v.to_string()))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 125 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // A worker is a long-lived daemon: its tasks' starts and ends are worth a line each.
    let default_filter = match cli.command {
        Command::Worker(_) => "warn,taskbox_worker=info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TASKBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("taskbox: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn dispatch(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Verb(v) => verbs::run(v, &cli.conn),
        Command::Agent(cmd) => agent::run(cmd, &cli.conn),
        Command::Submit(args) => queue::submit(args),
        Command::Tasks(cmd) => queue::tasks(cmd),
        Command::Worker(args) => worker::run(args, &cli.conn),
        Command::Schedule(cmd) => queue::schedule(cmd),
        Command::Serve(args) => serve(args, &cli.conn),
        Command::Mcp(args) => mcp(args, &cli.conn),
        Command::Replay(args) => {
            let path = trace_path(&cli.conn, &args.trace)?;
            replay::run(args, &path, &cli.conn.state_dir())
        }
        Command::Trace(TraceCommand::Html { trace }) => {
            let t = taskbox_core::trace::read_trace(&trace_path(&cli.conn, &trace)?)?;
            print!("{}", taskbox_core::trace_html::render_html(&t));
            Ok(0)
        }
        Command::Trace(TraceCommand::Show { trace, json }) => {
            let t = taskbox_core::trace::read_trace(&trace_path(&cli.conn, &trace)?)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                print!("{}", taskbox_core::trace::render_text(&t));
            }
            Ok(0)
        }
        Command::Run(args) => run(args, cli.conn.state_dir()),
        Command::Image(cmd) => image::run(cmd, cli.conn.state_dir()),
        Command::Policy(PolicyCommand::Check { policy }) => {
            let (p, source) = policy::resolve(&policy)?;
            println!("{}: ok (hash {})", source, p.hash());
            Ok(0)
        }
        Command::Policy(PolicyCommand::Explain { policy }) => {
            let (p, _) = policy::resolve(&policy)?;
            print!("{}", p.explain());
            Ok(0)
        }
        Command::Policy(PolicyCommand::List) => {
            for name in policy::available_names() {
                println!("{name}");
            }
            Ok(0)
        }
    }
}

/// A trace file, or the trace of a sandbox id in STATE/traces.
fn trace_path(conn: &verbs::Conn, trace: &str) -> Result<PathBuf> {
    if std::path::Path::new(trace).exists() {
        return Ok(PathBuf::from(trace));
    }
    taskbox_core::api::SandboxId::parse(trace)
        .map_err(|_| anyhow!("{trace}: no such trace file, and not a sandbox id"))?;
    Ok(conn
        .state_dir()
        .join("traces")
        .join(format!("{trace}.jsonl")))
}

fn mcp(args: McpArgs, conn: &verbs::Conn) -> Result<u8> {
    let workspace = match args.workspace {
        Some(w) => w,
        None => std::env::current_dir().context("cannot determine the current directory")?,
    };
    let workspace = std::fs::canonicalize(&workspace)
        .with_context(|| format!("workspace {} does not exist", workspace.display()))?;
    let policy = if std::path::Path::new(&args.policy).exists() {
        std::fs::canonicalize(&args.policy)?.display().to_string()
    } else {
        args.policy
    };
    let state_dir = conn.state_dir();
    // Each MCP session has a backend of its own (a supervisor may own STATE/sandboxes); its
    // trace goes with the others into STATE/traces.
    let session_dir = state_dir.join("mcp").join(std::process::id().to_string());
    let backend = RuntimeBuilder::new()
        .native(session_dir.clone())
        .images(docker::image_resolver(&state_dir))
        .egress(egress_service(1)?)
        .command_policy(true)
        .trace(state_dir.join("traces"))
        .build()
        .map_err(|e| anyhow!(e))?;
    let create = taskbox_core::api::CreateRequest {
        workspace: workspace.display().to_string(),
        policy: Some(policy),
        env: args.env.into_iter().collect(),
        ..Default::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(taskbox_mcp::serve_stdio(backend, create));
    drop(runtime);
    native::remove_tree(&session_dir);
    served?;
    Ok(0)
}

fn serve(args: ServeArgs, conn: &verbs::Conn) -> Result<u8> {
    let state_dir = conn.state_dir();
    let mut config = taskbox_server::ServerConfig::new(state_dir.clone());
    config.listen = args.listen;
    config.tokens = args.tokens;
    if conn.socket.is_some() || args.listen.is_none() {
        config.socket = Some(conn.socket());
    }
    let l = &mut config.limits;
    if let Some(n) = args.max_sandboxes {
        l.max_sandboxes_total = n;
    }
    if let Some(n) = args.max_sandboxes_per_tenant {
        l.max_sandboxes_per_tenant = n;
    }
    if let Some(n) = args.max_starting {
        l.max_starting_total = n;
    }
    if let Some(n) = args.max_starting_per_tenant {
        l.max_starting_per_tenant = n;
    }
    if args.create_rate.is_some() {
        l.create_rate_total = args.create_rate;
    }
    if args.create_rate_per_tenant.is_some() {
        l.create_rate_per_tenant = args.create_rate_per_tenant;
    }
    if let Some(Lifetime(life)) = args.max_lifetime {
        l.max_lifetime = life;
    }
    if let Some(n) = args.max_execs {
        l.max_execs_total = n;
    }
    if let Some(n) = args.max_execs_per_tenant {
        l.max_execs_per_tenant = n;
    }
    if args.default_ttl.is_some() {
        l.default_ttl = args.default_ttl;
    }
    if args.max_ttl.is_some() {
        l.max_ttl = args.max_ttl;
    }
    if let Some(n) = args.max_upload_bytes {
        l.max_upload_bytes = n;
    }
    if let Some(n) = args.max_body_bytes {
        if n == 0 {
            bail!("--max-body-bytes must be at least 1");
        }
        l.max_body_bytes = n;
    }
    config.workspace_roots = args.workspace_roots;
    config.git_allow_hosts = args.git_allow_hosts;
    // The supervisor's own files are hidden in every sandbox, wherever they are.
    let hidden = config.own_files();
    let c = &mut config.connections;
    if let Some(n) = args.max_connections {
        c.max_total = n;
    }
    if let Some(n) = args.max_connections_per_client {
        c.max_per_client = n;
    }
    if let Some(d) = args.header_timeout {
        c.header_timeout = d;
    }
    if let Some(d) = args.body_timeout {
        c.body_timeout = d;
    }
    if let Some(d) = args.idle_timeout {
        c.idle_timeout = d;
    }
    for (flag, d) in [
        ("--header-timeout", c.header_timeout),
        ("--body-timeout", c.body_timeout),
        ("--idle-timeout", c.idle_timeout),
    ] {
        if d.is_zero() {
            bail!("{flag} must be longer than zero");
        }
    }
    if c.max_total == 0 || c.max_per_client == 0 {
        bail!("--max-connections and --max-connections-per-client must be at least 1");
    }
    // Every connection holds a descriptor; sandboxes need some too.
    match taskbox_server::sys::raise_open_files() {
        Ok(n) if (n as usize) < c.max_total.saturating_add(256) => tracing::warn!(
            open_files = n,
            max_connections = c.max_total,
            "the open-file limit is close to the connection cap; connections past it wait in \
             the kernel's queue"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    // One egress service (its own threads) for the proxies of both backends' sandboxes.
    let egress = egress_service(2)?;
    let warm = taskbox_core::warm::WarmGauge::new();
    config.warm = Some(warm.clone());
    let native = RuntimeBuilder::new()
        .native(state_dir.clone())
        .images(docker::image_resolver(&state_dir))
        .egress(egress.clone())
        .hidden_paths(hidden)
        .fork_pool(taskbox_core::kit::ForkPoolConfig {
            max_idle: args.fork_pool_idle,
            gauge: Some(warm),
            ..taskbox_core::kit::ForkPoolConfig::new(args.fork_pool)
        });
    // Every exec is checked against its sandbox's command rules; every operation of every
    // surface, refusals and approvals included, is recorded in STATE/traces/ID.jsonl.
    let backend = docker::serve_docker(native, &args.docker, &state_dir, egress)
        .command_policy(true)
        .trace(state_dir.join("traces"))
        .trace_sync(args.trace_sync)
        .build()
        .map_err(|e| anyhow!(e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(taskbox_server::serve(
        config,
        backend.clone(),
        taskbox_server::shutdown_signal(),
    ));
    // Backend calls may still run on the blocking pool (an exec of `sleep 1000`, a create
    // stuck in a read): dropping the runtime would wait for them. Destroy the sandboxes
    // instead, which ends their execs, and wait a bounded time for that and for the pool.
    shut_down(backend, SHUTDOWN_CLEANUP);
    runtime.shutdown_timeout(Duration::from_secs(1));
    served?;
    Ok(0)
}

/// How long `serve` spends destroying its sandboxes after its connections are drained.
const SHUTDOWN_CLEANUP: Duration = Duration::from_secs(10);

/// Destroys every sandbox of `backend`, waiting at most `bound`. What is not destroyed by then
/// is left to the next start: the backends sweep what an earlier process left (directories,
/// cgroups, labelled containers), and a native sandbox's processes end with this process,
/// whose exit closes their control sockets.
fn shut_down(backend: std::sync::Arc<dyn taskbox_core::api::SandboxApi>, bound: Duration) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("shutdown".into())
        .spawn(move || {
            for info in backend.list() {
                if let Err(e) = backend.destroy(&info.id) {
                    tracing::warn!(sandbox = %info.id, error = %e, "cannot destroy at shutdown");
                }
            }
            // The last reference, unless a stuck call holds one: then its drop runs later.
            drop(backend);
            let _ = done_tx.send(());
        });
    if spawned.is_ok() && done_rx.recv_timeout(bound).is_err() {
        tracing::warn!(
            "sandboxes still being destroyed after {bound:?}; leaving the rest to the next start"
        );
    }
}

fn run(args: RunArgs, state_dir: PathBuf) -> Result<u8> {
    let (policy, _) = policy::resolve(&args.policy)?;
    let workspace = match args.workspace {
        Some(w) => w,
        None => std::env::current_dir().context("cannot determine the current directory")?,
    };
    if !workspace.exists() {
        bail!(
            "workspace {} does not exist (pass an existing directory with --workspace)",
            workspace.display()
        );
    }
    let check = policy.commands.check(&args.command);
    let refusal = match check.verdict {
        Verdict::Allow => None,
        Verdict::Forbid => Some(refusal_detail(
            &check,
            Refusal::Forbidden {
                policy: &args.policy,
            },
        )),
        Verdict::Ask => ask_terminal(&check, policy.commands.ask_timeout)?,
    };
    if let Some(detail) = refusal {
        return refused(&policy, detail, args.json);
    }
    match args.backend.as_deref() {
        None | Some("native") => {}
        Some("docker") if args.write_through => {
            bail!("--write-through is not supported by the docker backend")
        }
        Some("docker") => {
            // The policy read above is the sandbox's: the backend is handed it, not its name
            // to read again.
            let name = if std::path::Path::new(&args.policy).exists() {
                std::fs::canonicalize(&args.policy)?.display().to_string()
            } else {
                args.policy
            };
            return docker::run(docker::RunDocker {
                image: args.image,
                policy: taskbox_core::api::ResolvedPolicy {
                    name,
                    hash: policy.hash(),
                    policy,
                },
                workspace,
                timeout: args.timeout,
                json: args.json,
                diff: args.diff,
                env: args.env,
                cwd: args.cwd,
                command: args.command,
                state_dir,
            });
        }
        Some(other) => bail!("unknown backend {other:?}: use native or docker"),
    }
    native::prune_spill(&state_dir, Duration::from_secs(24 * 3600));
    let image = match &args.image {
        Some(name) => Some(
            docker::image_resolver(&state_dir)
                .resolve(name)
                .map_err(|e| anyhow!(e))?,
        ),
        None => None,
    };
    let req = RunRequest {
        argv: args.command,
        workspace,
        policy,
        timeout: args.timeout,
        write_through: args.write_through,
        env: args.env,
        cwd: args.cwd,
        stdin: StdinSource::Inherit,
        echo: !args.json,
        detach_cleanup: true,
        want_diff: args.diff,
        state_dir,
        image,
        root_upper: None,
    };
    // The egress proxy (and its threads) only when the policy routes the network through it.
    let egress = match req.policy.network.mode {
        policy::NetworkMode::Proxy => Some(proxy_service(1)?),
        _ => None,
    };
    let outcome = native::run_with(
        &req,
        egress
            .as_ref()
            .map(|e| e as &dyn taskbox_core::egress::EgressService),
    )
    .map_err(|e| anyhow!(e))?;
    drop(egress);
    let result = &outcome.result;
    if args.json {
        let mut value = serde_json::to_value(result)?;
        if let (Some(diff), Some(obj)) = (&outcome.diff, value.as_object_mut()) {
            obj.insert("diff".into(), serde_json::Value::String(diff.clone()));
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        if let Some((errno, program)) = &outcome.exec_failed {
            eprintln!(
                "{}",
                taskbox_core::result::exec_failure_line(*errno, program)
            );
        }
        for v in &result.violations {
            eprintln!("taskbox: {}: {}", v.kind, v.detail);
        }
        if let Some(diff) = &outcome.diff {
            print!("{diff}");
        }
    }
    Ok(u8::try_from(result.cli_exit_status()).unwrap_or(125))
}

/// The egress proxies of a backend's sandboxes (network mode "proxy"), on `threads` threads of
/// their own.
pub(crate) fn egress_service(
    threads: usize,
) -> Result<std::sync::Arc<dyn taskbox_core::egress::EgressService>> {
    Ok(std::sync::Arc::new(proxy_service(threads)?))
}

/// The variable naming a PEM file of CA certificates the egress proxy trusts, beside the
/// host's roots, for the upstreams of inspected hosts (docs/secrets.md): the supervisor's
/// setting, which no sandbox can change.
pub(crate) const EGRESS_CA_VAR: &str = "TASKBOX_EGRESS_CA";

/// An egress proxy service on `threads` threads, trusting [`EGRESS_CA_VAR`]'s CA when set.
fn proxy_service(threads: usize) -> Result<taskbox_egress::ProxyService> {
    let service = taskbox_egress::ProxyService::new(threads)?;
    match std::env::var_os(EGRESS_CA_VAR) {
        Some(path) if !path.is_empty() => {
            let pem = std::fs::read(&path).with_context(|| {
                format!(
                    "{EGRESS_CA_VAR}: cannot read {}",
                    Path::new(&path).display()
                )
            })?;
            service
                .upstream_ca(pem)
                .with_context(|| format!("{EGRESS_CA_VAR}: {}", Path::new(&path).display()))
        }
        _ => Ok(service),
    }
}

/// Reports a command the command rules refused: nothing ran, exit status 126.
fn refused(policy: &policy::Policy, detail: String, json: bool) -> Result<u8> {
    use taskbox_core::result::{Enforcement, ExecResult};
    // Nothing ran, so nothing was confined.
    let enforcement = Enforcement {
        landlock: "none".into(),
        seccomp: false,
        network: policy.network.mode.as_str().into(),
        limits: "none".into(),
        disk: "none".into(),
    };
    let result = ExecResult::refused(detail, 0, enforcement);
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        for v in &result.violations {
            eprintln!("taskbox: {}: {}", v.kind, v.detail);
        }
    }
    Ok(u8::try_from(result.cli_exit_status()).unwrap_or(125))
}

/// Puts a command the rules ask about to the person at the terminal: `None` when approved, else
/// the violation's detail. Without a terminal on stdin there is no one to ask: denied.
fn ask_terminal(check: &Check, timeout: Duration) -> Result<Option<String>> {
    use std::io::{BufRead, IsTerminal, Write};
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Ok(Some(refusal_detail(
            check,
            Refusal::Denied {
                reason: "no one to ask (stdin is not a terminal)",
                approval: None,
            },
        )));
    }
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "taskbox: the command policy asks before running `{}`,\ntaskbox: because {}.",
        check.command, check.reason
    );
    let _ = write!(
        err,
        "taskbox: run it? [y/N] (no answer in {} denies it) ",
        humantime::format_duration(timeout)
    );
    let _ = err.flush();
    let ready = {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut fds = [PollFd::new(stdin.as_fd(), PollFlags::POLLIN)];
        poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        )
        .context("cannot wait for an answer on the terminal")?
            > 0
    };
    if !ready {
        let _ = writeln!(err);
        return Ok(Some(refusal_detail(
            check,
            Refusal::Expired {
                after: timeout,
                approval: None,
            },
        )));
    }
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    let answer = answer.trim();
    match answer.to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(None),
        "" | "n" | "no" => Ok(Some(refusal_detail(
            check,
            Refusal::Denied {
                reason: "declined at the terminal",
                approval: None,
            },
        ))),
        _ => Ok(Some(refusal_detail(
            check,
            Refusal::Denied {
                reason: answer,
                approval: None,
            },
        ))),
    }
}
