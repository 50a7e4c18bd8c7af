//! `taskbox submit` and `taskbox tasks`: tasks on the shared queue (NATS JetStream,
//! `taskbox-queue`) that workers on any machine take.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use sha2::Digest;
use taskbox_queue::{
    Overlap, Queue, QueueError, Schedule, ScheduleTiming, TaskRecord, TaskSpec, WorkspaceSource,
};

/// Where the queue is.
#[derive(Args, Clone)]
pub struct NatsArgs {
    /// The NATS server(s) with JetStream (comma-separated for a cluster).
    #[arg(
        long,
        value_name = "URL",
        env = "TASKBOX_NATS",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats: String,
}

impl NatsArgs {
    pub fn url(&self) -> &str {
        &self.nats
    }
}

#[derive(Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    task: TaskArgs,
    /// A submit retried with the same key is the same task (it prints that task).
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// The longest the task may run over all its attempts (e.g. 30m); past it the worker stops
    /// it and the task fails saying so.
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration)]
    max_duration: Option<std::time::Duration>,
    /// Print the task record as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
pub enum TasksCommand {
    /// Every task, oldest first: id, state, attempts, workspace.
    List {
        #[command(flatten)]
        nats: NatsArgs,
        #[arg(long)]
        json: bool,
    },
    /// One task's record.
    Status {
        #[command(flatten)]
        nats: NatsArgs,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Cancel a task: a queued one never starts, a running one stops at its next turn.
    Cancel {
        #[command(flatten)]
        nats: NatsArgs,
        id: String,
        /// Why (kept in the task's reasons).
        #[arg(long, value_name = "TEXT", default_value = "by request")]
        reason: String,
    },
    /// An ended task's results: prints its report (Markdown, or JSON with --json) and, with
    /// --out DIR, writes report.md, report.json, diff.patch, trace.jsonl and state.json there.
    Results {
        #[command(flatten)]
        nats: NatsArgs,
        id: String,
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Add a recurring task: one task per window (--every DUR: windows start at multiples of
    /// DUR since the epoch; --cron EXPR: at each time the expression matches, in UTC; 5
    /// fields, or 6 with seconds first), fired by whichever worker sees the window first,
    /// exactly once.
    Add(Box<ScheduleAddArgs>),
    /// Every schedule: name, timing, overlap rule, last window.
    #[command(alias = "ls")]
    List {
        #[command(flatten)]
        nats: NatsArgs,
        #[arg(long)]
        json: bool,
    },
    /// Remove a schedule (its tasks stay).
    #[command(alias = "rm")]
    Remove {
        #[command(flatten)]
        nats: NatsArgs,
        name: String,
    },
}

#[derive(Args)]
pub struct ScheduleAddArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The schedule's name (default: the contract file's name without its extension).
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// A window every DUR (at least 1s), e.g. 1h.
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration, conflicts_with = "cron", required_unless_present = "cron")]
    every: Option<std::time::Duration>,
    /// A window at each time the cron expression matches, in UTC.
    #[arg(long, value_name = "EXPR")]
    cron: Option<String>,
    /// What a window gets while the previous window's task still runs: skip (no task) or
    /// queue (a task that starts once that one has ended).
    #[arg(long, value_name = "skip|queue", default_value = "skip")]
    overlap: String,
    /// The longest each window's task may run; past it the worker stops it and reports it.
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration)]
    max_duration: Option<std::time::Duration>,
    #[command(flatten)]
    task: TaskArgs,
}

/// What a task is: its contract and workspace (shared by submit and schedule add).
#[derive(Args)]
pub struct TaskArgs {
    /// The work contract (TOML, as for `taskbox agent run --contract`); checked first.
    #[arg(long, value_name = "FILE")]
    contract: PathBuf,
    /// The workspace: a git repository (with --commit).
    #[arg(
        long,
        value_name = "URL",
        requires = "commit",
        conflicts_with = "workspace_object"
    )]
    git: Option<String>,
    /// The commit of --git to work on (a commit id: a task runs on exactly one tree).
    #[arg(long, value_name = "SHA")]
    commit: Option<String>,
    /// The workspace: a tar already in the queue's object store, by name.
    #[arg(long, value_name = "NAME", conflicts_with = "workspace")]
    workspace_object: Option<String>,
    /// The workspace: this directory, packed as a tar (its .git too) and put in the queue's
    /// object store, named by its SHA-256 (the same tree is stored once).
    #[arg(long, value_name = "DIR", conflicts_with = "git")]
    workspace: Option<PathBuf>,
    /// The tenant the task counts against.
    #[arg(long, value_name = "NAME")]
    tenant: Option<String>,
    /// Attempts before the task is dead.
    #[arg(long, value_name = "N", default_value_t = taskbox_queue::DEFAULT_ATTEMPTS)]
    attempts: u32,
}

/// A task's spec, and the workspace tar to put in the object store first (`--workspace DIR`).
struct Prepared {
    spec: TaskSpec,
    upload: Option<(String, Vec<u8>)>,
}

impl Prepared {
    /// Puts the workspace tar in the object store, unless one of its name is there already.
    async fn upload(&self, q: &Queue) -> Result<()> {
        if let Some((name, data)) = &self.upload
            && q.get_artifact(name).await?.is_none()
        {
            q.put_artifact(name, data).await?;
            eprintln!(
                "taskbox: stored the workspace as {name} ({} bytes)",
                data.len()
            );
        }
        Ok(())
    }
}

/// Packs `dir` as a tar whose bytes depend on the tree alone: entries sorted, owners and
/// times fixed, permission bits kept; symbolic links as links; other special files left out.
fn pack_workspace(dir: &std::path::Path) -> Result<Vec<u8>> {
    fn walk(
        root: &std::path::Path,
        rel: &std::path::Path,
        out: &mut Vec<PathBuf>,
    ) -> std::io::Result<()> {
        let mut entries: Vec<_> =
            std::fs::read_dir(root.join(rel))?.collect::<std::io::Result<Vec<_>>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let r = rel.join(e.file_name());
            let t = e.file_type()?;
            out.push(r.clone());
            if t.is_dir() {
                walk(root, &r, out)?;
            }
        }
        Ok(())
    }
    use std::os::unix::fs::PermissionsExt;
    let mut paths = Vec::new();
    walk(dir, std::path::Path::new(""), &mut paths)
        .with_context(|| format!("cannot read the workspace {}", dir.display()))?;
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    for rel in paths {
        let full = dir.join(&rel);
        let meta = std::fs::symlink_metadata(&full)?;
        let mut h = tar::Header::new_gnu();
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(meta.permissions().mode() & 0o777);
        let t = meta.file_type();
        if t.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            b.append_data(&mut h, &rel, std::io::empty())?;
        } else if t.is_symlink() {
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, &rel, std::fs::read_link(&full)?)?;
        } else if t.is_file() {
            h.set_size(meta.len());
            b.append_data(&mut h, &rel, std::fs::File::open(&full)?)?;
        }
    }
    Ok(b.into_inner()?)
}

impl TaskArgs {
    /// The spec, or the exit status of why there is none (the reason printed).
    fn spec(self) -> Result<std::result::Result<Prepared, u8>> {
        let text = std::fs::read_to_string(&self.contract)
            .with_context(|| format!("cannot read the contract {}", self.contract.display()))?;
        if let Err(e) =
            taskbox_agent::contract::Contract::parse(&text, &self.contract.display().to_string())
        {
            eprintln!("taskbox: {e}");
            return Ok(Err(1));
        }
        let mut upload = None;
        let workspace = match (self.git, self.commit, self.workspace_object, self.workspace) {
            (Some(url), Some(commit), None, None) => WorkspaceSource::Git { url, commit },
            (None, None, Some(name), None) => WorkspaceSource::Object { name },
            (None, None, None, Some(dir)) => {
                if !dir.is_dir() {
                    eprintln!(
                        "taskbox: the workspace {} is not a directory",
                        dir.display()
                    );
                    return Ok(Err(2));
                }
                let data = pack_workspace(&dir)?;
                let digest = sha2::Sha256::digest(&data);
                let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
                let name = format!("workspaces/{hex}.tar");
                upload = Some((name.clone(), data));
                WorkspaceSource::Object { name }
            }
            _ => {
                eprintln!(
                    "taskbox: name the workspace: --git URL --commit SHA, --workspace DIR, or \
                     --workspace-object NAME"
                );
                return Ok(Err(2));
            }
        };
        let mut spec = TaskSpec::new(text, workspace);
        spec.tenant = self.tenant;
        spec.max_attempts = self.attempts;
        Ok(Ok(Prepared { spec, upload }))
    }
}

fn block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(f)
}

/// Exit status of a queue error: 1 for what the user asked of a task that cannot be (no such
/// task, an ended one, a bad spec), 125 for taskbox's own trouble (the server unreachable).
fn report(e: QueueError) -> Result<u8> {
    match e {
        QueueError::NotFound(_)
        | QueueError::NoSchedule(_)
        | QueueError::Ended { .. }
        | QueueError::Invalid { .. } => {
            eprintln!("taskbox: {e}");
            Ok(1)
        }
        e => Err(e.into()),
    }
}

fn unix_ms_text(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

fn workspace_text(w: &WorkspaceSource) -> String {
    match w {
        WorkspaceSource::Git { url, commit } => {
            format!("{url}@{}", &commit[..commit.len().min(12)])
        }
        WorkspaceSource::Object { name } => format!("object {name}"),
    }
}

fn print_task(t: &TaskRecord, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(t)?);
        return Ok(());
    }
    println!("task:      {}", t.id);
    println!("state:     {}", t.state);
    println!("attempts:  {} of {}", t.attempts, t.spec.max_attempts);
    println!("workspace: {}", workspace_text(&t.spec.workspace));
    if let Some(tenant) = &t.spec.tenant {
        println!("tenant:    {tenant}");
    }
    if let Some((name, window)) = &t.spec.schedule {
        println!("schedule:  {name} (window {})", unix_ms_text(*window));
    }
    if let Some(c) = &t.claim {
        println!("worker:    {} (attempt {})", c.worker, c.attempt);
    }
    if let Some(cp) = &t.checkpoint {
        println!("turn:      {} (saved by attempt {})", cp.turn, cp.attempt);
    }
    if let Some(r) = &t.result {
        println!(
            "result:    {} after {} turns, {} tokens, ${:.4} (attempt {} on {}; taskbox tasks results {})",
            r.termination,
            r.turns,
            r.tokens_in + r.tokens_out,
            r.cost_usd,
            r.attempt,
            r.worker,
            t.id
        );
    }
    for a in &t.actions {
        println!(
            "action:    {} ({}): {:?}: {}",
            a.name, a.kind, a.state, a.detail
        );
    }
    for r in &t.reasons {
        println!("reason:    {r}");
    }
    Ok(())
}

pub fn submit(args: SubmitArgs) -> Result<u8> {
    let prepared = match args.task.spec()? {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    let mut spec = prepared.spec.clone();
    spec.max_duration_ms = args.max_duration.map(|d| d.as_millis() as u64);
    block_on(async move {
        let q = Queue::connect(&args.nats.nats).await?;
        prepared.upload(&q).await?;
        match q.submit(spec, args.idempotency_key.as_deref()).await {
            Ok(done) => {
                if args.json {
                    print_task(&done.task, true)?;
                } else {
                    println!("{}", done.task.id);
                }
                if !done.new {
                    eprintln!(
                        "taskbox: the idempotency key already names this task ({}); nothing new was queued",
                        done.task.state
                    );
                }
                Ok(0)
            }
            Err(e) => report(e),
        }
    })
}

pub fn tasks(cmd: TasksCommand) -> Result<u8> {
    block_on(async move {
        match cmd {
            TasksCommand::List { nats, json } => {
                let q = Queue::connect(&nats.nats).await?;
                let all = match q.tasks().await {
                    Ok(all) => all,
                    Err(e) => return report(e),
                };
                if json {
                    println!("{}", serde_json::to_string_pretty(&all)?);
                } else if all.is_empty() {
                    eprintln!("taskbox: no tasks");
                } else {
                    println!(
                        "{:<22} {:<10} {:>8}  WORKSPACE",
                        "TASK", "STATE", "ATTEMPTS"
                    );
                    for t in &all {
                        println!(
                            "{:<22} {:<10} {:>8}  {}",
                            t.id,
                            t.state.as_str(),
                            format!("{}/{}", t.attempts, t.spec.max_attempts),
                            workspace_text(&t.spec.workspace)
                        );
                    }
                }
                Ok(0)
            }
            TasksCommand::Status { nats, id, json } => {
                let q = Queue::connect(&nats.nats).await?;
                match q.task(&id).await {
                    Ok(t) => {
                        print_task(&t, json)?;
                        Ok(0)
                    }
                    Err(e) => report(e),
                }
            }
            TasksCommand::Results {
                nats,
                id,
                out,
                json,
            } => {
                let q = Queue::connect(&nats.nats).await?;
                let t = match q.task(&id).await {
                    Ok(t) => t,
                    Err(e) => return report(e),
                };
                let Some(result) = &t.result else {
                    eprintln!(
                        "taskbox: task {id} has no results ({}{})",
                        t.state,
                        if t.state.is_final() {
                            ""
                        } else {
                            ": it has not ended"
                        }
                    );
                    return Ok(1);
                };
                let files = [
                    "report.md",
                    "report.json",
                    "diff.patch",
                    "trace.jsonl",
                    "state.json",
                ];
                let mut got = std::collections::BTreeMap::new();
                for f in files {
                    let name = taskbox_queue::artifact_name(&id, result.attempt, f);
                    if let Some(data) = q.get_artifact(&name).await? {
                        got.insert(f, data);
                    }
                }
                if let Some(dir) = &out {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("cannot create {}", dir.display()))?;
                    for (f, data) in &got {
                        std::fs::write(dir.join(f), data)
                            .with_context(|| format!("cannot write {}", dir.join(f).display()))?;
                    }
                    eprintln!("taskbox: wrote {} files to {}", got.len(), dir.display());
                }
                let shown = if json { "report.json" } else { "report.md" };
                match got.get(shown) {
                    Some(data) => print!("{}", String::from_utf8_lossy(data)),
                    None => {
                        eprintln!(
                            "taskbox: task {id}'s {shown} is missing from the artifact store"
                        );
                        return Ok(1);
                    }
                }
                Ok(0)
            }
            TasksCommand::Cancel { nats, id, reason } => {
                let q = Queue::connect(&nats.nats).await?;
                match q.cancel(&id, &reason).await {
                    Ok(t) => {
                        println!("{}: {}", t.id, t.state);
                        Ok(0)
                    }
                    Err(e) => report(e),
                }
            }
        }
    })
}

pub fn schedule(cmd: ScheduleCommand) -> Result<u8> {
    match cmd {
        ScheduleCommand::Add(a) => {
            let a = *a;
            let name = match &a.name {
                Some(n) => n.clone(),
                None => a
                    .task
                    .contract
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            };
            let timing = match (&a.every, &a.cron) {
                (Some(d), None) => ScheduleTiming::Every {
                    ms: d.as_millis() as u64,
                },
                (None, Some(c)) => ScheduleTiming::Cron { expr: c.clone() },
                _ => {
                    eprintln!("taskbox: give --every DUR or --cron EXPR");
                    return Ok(2);
                }
            };
            let overlap: Overlap = match a.overlap.parse() {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("taskbox: {e}");
                    return Ok(2);
                }
            };
            let max_duration = a.max_duration;
            let nats = a.nats.nats.clone();
            let prepared = match a.task.spec()? {
                Ok(s) => s,
                Err(code) => return Ok(code),
            };
            let mut spec = prepared.spec.clone();
            spec.max_duration_ms = max_duration.map(|d| d.as_millis() as u64);
            let s = Schedule {
                name: name.clone(),
                timing,
                spec,
                overlap,
                created_unix_ms: taskbox_queue::now_ms(),
            };
            block_on(async move {
                let q = Queue::connect(&nats).await?;
                prepared.upload(&q).await?;
                match q.add_schedule(&s).await {
                    Ok(()) => {
                        println!("{name}");
                        Ok(0)
                    }
                    Err(e) => report(e),
                }
            })
        }
        ScheduleCommand::List { nats, json } => block_on(async move {
            let q = Queue::connect(&nats.nats).await?;
            let all = match q.schedules().await {
                Ok(a) => a,
                Err(e) => return report(e),
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(0);
            }
            if all.is_empty() {
                eprintln!("taskbox: no schedules");
            }
            for s in &all {
                let timing = match &s.timing {
                    ScheduleTiming::Every { ms } => format!(
                        "every {}",
                        humantime::format_duration(std::time::Duration::from_millis(*ms))
                    ),
                    ScheduleTiming::Cron { expr } => format!("cron {expr:?} (UTC)"),
                };
                let last = match q.window_state(&s.name).await? {
                    Some(w) => format!(
                        "last window {} (task {}), {} skipped",
                        unix_ms_text(w.window_unix_ms),
                        w.task.as_deref().unwrap_or("-"),
                        w.skipped
                    ),
                    None => "not fired yet".into(),
                };
                println!("{}: {timing}, overlap {:?}; {last}", s.name, s.overlap);
            }
            Ok(0)
        }),
        ScheduleCommand::Remove { nats, name } => block_on(async move {
            let q = Queue::connect(&nats.nats).await?;
            match q.remove_schedule(&name).await {
                Ok(()) => {
                    println!("removed {name}");
                    Ok(0)
                }
                Err(e) => report(e),
            }
        }),
    }
}
