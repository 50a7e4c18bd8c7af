//! `taskbox submit` and `taskbox tasks`: tasks on the shared queue (NATS JetStream,
//! `taskbox-queue`) that workers on any machine take.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use taskbox_queue::{Queue, QueueError, TaskRecord, TaskSpec, WorkspaceSource};

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

#[derive(Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The work contract (TOML, as for `taskbox agent run --contract`); checked before it is
    /// queued.
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
    #[arg(long, value_name = "NAME")]
    workspace_object: Option<String>,
    /// A submit retried with the same key is the same task (it prints that task).
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// The tenant the task counts against.
    #[arg(long, value_name = "NAME")]
    tenant: Option<String>,
    /// Attempts before the task is dead.
    #[arg(long, value_name = "N", default_value_t = taskbox_queue::DEFAULT_ATTEMPTS)]
    attempts: u32,
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
        QueueError::NotFound(_) | QueueError::Ended { .. } | QueueError::Invalid { .. } => {
            eprintln!("taskbox: {e}");
            Ok(1)
        }
        e => Err(e.into()),
    }
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
    for r in &t.reasons {
        println!("reason:    {r}");
    }
    Ok(())
}

pub fn submit(args: SubmitArgs) -> Result<u8> {
    let text = std::fs::read_to_string(&args.contract)
        .with_context(|| format!("cannot read the contract {}", args.contract.display()))?;
    if let Err(e) =
        taskbox_agent::contract::Contract::parse(&text, &args.contract.display().to_string())
    {
        eprintln!("taskbox: {e}");
        return Ok(1);
    }
    let workspace = match (args.git, args.commit, args.workspace_object) {
        (Some(url), Some(commit), None) => WorkspaceSource::Git { url, commit },
        (None, None, Some(name)) => WorkspaceSource::Object { name },
        _ => {
            eprintln!(
                "taskbox: name the workspace: --git URL --commit SHA, or --workspace-object NAME"
            );
            return Ok(2);
        }
    };
    let spec = TaskSpec {
        contract: text,
        workspace,
        tenant: args.tenant,
        max_attempts: args.attempts,
        max_duration_ms: args.max_duration.map(|d| d.as_millis() as u64),
        after: None,
        schedule: None,
    };
    block_on(async move {
        let q = Queue::connect(&args.nats.nats).await?;
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
