//! `taskbox worker`: takes tasks from the shared queue and runs them (`taskbox-worker`), in
//! sandboxes of an in-process backend (native, or Docker with `--backend docker`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use taskbox_core::runtime::RuntimeBuilder;
use taskbox_worker::{Metrics, Worker, WorkerConfig};

use crate::queue::NatsArgs;
use crate::verbs::Conn;

#[derive(Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The worker's name in task records; unique among the workers (default: the host's name
    /// and the process id).
    #[arg(long, value_name = "NAME", env = "TASKBOX_WORKER_NAME")]
    name: Option<String>,
    /// The sandboxes' backend.
    #[arg(long, value_name = "native|docker", default_value = "native")]
    backend: String,
    /// Tasks run at once.
    #[arg(long, value_name = "N", default_value_t = 1)]
    concurrency: usize,
    /// Serve Prometheus metrics at /metrics, and /healthz, on this address (e.g.
    /// 0.0.0.0:9464).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// The sandboxes' policy (name or file).
    #[arg(long, value_name = "NAME|FILE")]
    policy: Option<String>,
    /// The sandboxes' image (name or digest; default: the host view, on native).
    #[arg(long, value_name = "NAME")]
    image: Option<String>,
    /// Copies JetStream keeps of the streams and buckets this worker makes when they are
    /// missing (3 in a cluster of three NATS servers survives the loss of one).
    #[arg(long, value_name = "N", default_value_t = 1)]
    replicas: usize,
    /// A worker silent this long loses its task to another, which resumes it from its last
    /// turn (set by the first worker, when it makes the queue's consumer).
    #[arg(long, value_name = "DUR", default_value = "30s", value_parser = crate::parse_duration)]
    claim_timeout: Duration,
    /// Where the tasks' workspaces are checked out (default: $TMPDIR, else /var/tmp, in
    /// taskbox-worker-NAME); outside the state directory, which no sandbox may have as its
    /// workspace.
    #[arg(long, value_name = "DIR")]
    workspaces: Option<std::path::PathBuf>,
    /// Do not fire schedules from this worker (another worker does; each window is fired once
    /// whoever sees it).
    #[arg(long)]
    no_schedules: bool,
}

fn default_name() -> String {
    format!("{}-{}", default_host(), std::process::id())
}

/// The host part of a worker's default name.
fn default_host() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "worker".into())
}

pub fn run(args: WorkerArgs, conn: &Conn) -> Result<u8> {
    if args.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    if !(1..=5).contains(&args.replicas) {
        bail!("--replicas must be 1 to 5 (JetStream's limit)");
    }
    let state_dir = conn.state_dir();
    let name = args.name.clone().unwrap_or_else(default_name);
    if name.is_empty() || name.len() > 128 || name.chars().any(|c| c.is_control()) {
        bail!("--name {name:?}: give 1 to 128 printable characters");
    }
    crate::orphans::sweep_worker_sandboxes(&state_dir.join("worker"), &default_host());
    let dir = state_dir.join("worker").join(&name);
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the worker's directory {}", dir.display()))?;
    let workspaces = args.workspaces.clone().unwrap_or_else(|| {
        std::env::var_os("TMPDIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"))
            .join(format!("taskbox-worker-{name}"))
    });
    std::fs::create_dir_all(&workspaces).with_context(|| {
        format!(
            "cannot create the workspaces' directory {}",
            workspaces.display()
        )
    })?;
    let workspaces = std::fs::canonicalize(&workspaces)?;
    if workspaces.starts_with(std::fs::canonicalize(&state_dir)?) {
        bail!(
            "--workspaces {} is inside the state directory {}; choose a directory apart from it",
            workspaces.display(),
            state_dir.display()
        );
    }
    let egress = crate::egress_service(2)?;
    let native = RuntimeBuilder::new()
        .native(dir.join("sandboxes"))
        .images(crate::docker::image_resolver(&state_dir))
        .egress(egress.clone());
    let backend = match args.backend.as_str() {
        "native" => None,
        "docker" => Some("docker".to_owned()),
        other => bail!("--backend {other:?}: use native or docker"),
    };
    let docker = crate::docker::ServeDocker {
        docker: backend.is_some(),
        docker_pool: None,
    };
    let api = crate::docker::serve_docker(native, &docker, &state_dir, egress)
        .command_policy(true)
        .trace(state_dir.join("traces"))
        .build()
        .map_err(|e| anyhow!(e))?;
    let policy = match args.policy {
        Some(p) if std::path::Path::new(&p).exists() => {
            Some(std::fs::canonicalize(&p)?.display().to_string())
        }
        other => other,
    };
    let cfg = WorkerConfig {
        policy,
        image: args.image.clone(),
        backend,
        concurrency: args.concurrency,
        claim_timeout: args.claim_timeout,
        replicas: args.replicas,
        schedules: !args.no_schedules,
        ..WorkerConfig::new(args.nats.url(), name.clone(), dir, workspaces)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let metrics = Arc::new(Metrics::new());
    let served = runtime.block_on(async {
        // Listened for from here on: a stop asked while the worker connects, or right after it
        // says it takes tasks, is kept, not the signal's default (death).
        let mut stop = Box::pin(shutdown());
        if let Some(addr) = args.metrics_listen {
            let bound = taskbox_worker::metrics::serve(addr, metrics.clone())
                .await
                .with_context(|| format!("cannot serve metrics on {addr}"))?;
            eprintln!("taskbox: worker {name}: metrics on http://{bound}/metrics");
        }
        let worker = tokio::select! {
            w = Worker::connect(cfg, api.clone(), metrics.clone()) => w?,
            () = &mut stop => return anyhow::Ok(()),
        };
        eprintln!(
            "taskbox: worker {name} takes tasks from {} ({} at once)",
            args.nats.url(),
            args.concurrency
        );
        worker.run(stop).await?;
        anyhow::Ok(())
    });
    for info in api.list() {
        let _ = api.destroy(&info.id);
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    served?;
    eprintln!("taskbox: worker {name} stopped");
    Ok(0)
}

/// SIGTERM or SIGINT, listened for from the call on (not from the first poll: a signal in
/// between would otherwise kill the process). Call it inside the runtime.
fn shutdown() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let signals =
        signal(SignalKind::terminate()).and_then(|t| Ok((t, signal(SignalKind::interrupt())?)));
    async move {
        let Ok((mut term, mut int)) = signals else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        eprintln!(
            "taskbox: stopping: no new tasks; the running ones are handed back at their next step"
        );
    }
}
