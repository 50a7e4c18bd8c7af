//! `taskbox-bench docker`: the Docker backend beside the docker CLI, in one run.
//!
//! - create-to-first-exec of a sandbox taken from the warm pool (create + `exec true`), beside a
//!   cold `docker run --rm IMAGE true` (target: the pool at least 5x faster), and a cold create
//!   without a pool for reference;
//! - the round trip of `exec true` through the backend, beside `docker exec CONTAINER true` on
//!   the same container (target: no slower).
//!
//! Series alternate in rounds (the order reversed every other round), so noise lands on all.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use clap::Args;
use serde_json::{Value, json};
use taskbox_core::api::{CreateRequest, ExecOutcome, ExecRequest, SandboxApi, SandboxId};
use taskbox_docker::{DaemonImages, Docker, DockerBackend, DockerConfig};

use crate::stats::summary;

#[derive(Args)]
pub struct DockerArgs {
    /// An image the daemon has (name or ID), with /bin/true, a non-root user.
    #[arg(long)]
    image: String,
    /// The sandboxes' workspace.
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// A scratch state directory (created; the backends keep their state there).
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Measured creates from the pool, and cold `docker run`s (over all rounds).
    #[arg(long, default_value_t = 40)]
    create_runs: usize,
    /// Measured exec round trips per series (over all rounds).
    #[arg(long, default_value_t = 400)]
    exec_runs: usize,
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// The pool size.
    #[arg(long, default_value_t = 2)]
    pool: usize,
}

fn create_req(a: &DockerArgs) -> CreateRequest {
    CreateRequest {
        workspace: a.workspace.display().to_string(),
        backend: Some("docker".into()),
        image: Some(a.image.clone()),
        ..Default::default()
    }
}

fn exec_true(b: &DockerBackend, id: &SandboxId) -> Result<()> {
    let out = b
        .exec(
            id,
            ExecRequest {
                argv: Some(vec!["true".into()]),
                ..Default::default()
            },
            None,
        )
        .map_err(|e| anyhow!(e))?;
    match out {
        ExecOutcome::Finished(r) if r.exit_code == Some(0) => Ok(()),
        other => Err(anyhow!("exec true failed: {other:?}")),
    }
}

fn timed_cmd(args: &[&str]) -> Result<Duration> {
    let t = Instant::now();
    let status = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {}", args[0]))?;
    let took = t.elapsed();
    ensure!(status.success(), "{args:?} failed: {status}");
    Ok(took)
}

pub fn run(a: &DockerArgs) -> Result<Value> {
    let config = DockerConfig::default();
    let images: Arc<DaemonImages> =
        Arc::new(DaemonImages::new(&config.socket).map_err(|e| anyhow!(e))?);
    let pooled = Docker::open(
        &a.state_dir.join("pooled"),
        images.clone(),
        DockerConfig {
            pool_size: a.pool,
            warm: vec![(a.image.clone(), "default".into())],
            ..config.clone()
        },
    )
    .map_err(|e| anyhow!(e))?;
    let cold = Docker::open(&a.state_dir.join("cold"), images, config).map_err(|e| anyhow!(e))?;
    let wait_pool = |b: &DockerBackend| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        while b.pooled(&a.image, "default") < a.pool {
            ensure!(Instant::now() < deadline, "the pool did not fill in 120s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    // Warm up: the image in the daemon, the pool full, one cold create.
    let id = cold.create(create_req(a)).map_err(|e| anyhow!(e))?.id;
    exec_true(&cold, &id)?;
    let container = cold.container_name(&id).map_err(|e| anyhow!(e))?;
    timed_cmd(&["docker", "run", "--rm", &a.image, "true"])?;
    timed_cmd(&["docker", "exec", &container, "true"])?;
    wait_pool(&pooled)?;

    let rounds = a.rounds.max(1);
    let per_create = a.create_runs.div_ceil(rounds);
    let per_exec = a.exec_runs.div_ceil(rounds);
    let (mut pool_create, mut cold_create, mut docker_run) = (Vec::new(), Vec::new(), Vec::new());
    let (mut exec_backend, mut exec_cli) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        eprintln!("docker bench: round {}/{rounds}", round + 1);
        let mut series: Vec<u8> = vec![0, 1, 2, 3, 4];
        if round % 2 == 1 {
            series.reverse();
        }
        for s in series {
            match s {
                0 => {
                    for _ in 0..per_create {
                        wait_pool(&pooled)?;
                        let t = Instant::now();
                        let sid = pooled.create(create_req(a)).map_err(|e| anyhow!(e))?.id;
                        exec_true(&pooled, &sid)?;
                        pool_create.push(t.elapsed());
                        pooled.destroy(&sid).map_err(|e| anyhow!(e))?;
                    }
                }
                1 => {
                    for _ in 0..per_create.div_ceil(4) {
                        let t = Instant::now();
                        let sid = cold.create(create_req(a)).map_err(|e| anyhow!(e))?.id;
                        exec_true(&cold, &sid)?;
                        cold_create.push(t.elapsed());
                        cold.destroy(&sid).map_err(|e| anyhow!(e))?;
                    }
                }
                2 => {
                    for _ in 0..per_create {
                        docker_run.push(timed_cmd(&["docker", "run", "--rm", &a.image, "true"])?);
                    }
                }
                3 => {
                    for _ in 0..per_exec {
                        let t = Instant::now();
                        exec_true(&cold, &id)?;
                        exec_backend.push(t.elapsed());
                    }
                }
                _ => {
                    for _ in 0..per_exec.div_ceil(4) {
                        exec_cli.push(timed_cmd(&["docker", "exec", &container, "true"])?);
                    }
                }
            }
        }
    }
    let _ = cold.destroy(&id);
    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let pool_s = summary("create+first exec, warm pool (backend)", &pool_create);
    let cold_s = summary("create+first exec, no pool (backend)", &cold_create);
    let run_s = summary("docker run --rm IMAGE true (cold, CLI)", &docker_run);
    let exec_s = summary("exec true (backend)", &exec_backend);
    let cli_s = summary("docker exec CONTAINER true (CLI)", &exec_cli);
    let speedup = p50(&run_s) / p50(&pool_s);
    let exec_ratio = p50(&exec_s) / p50(&cli_s);
    Ok(json!({
        "benchmark": "docker",
        "image": a.image,
        "pool": a.pool,
        "series": [pool_s, cold_s, run_s, exec_s, cli_s],
        "docker_run_over_pool_create_p50": (speedup * 100.0).round() / 100.0,
        "pool_create_target_met": speedup >= 5.0,
        "backend_exec_over_docker_exec_p50": (exec_ratio * 100.0).round() / 100.0,
        "exec_target_met": exec_ratio <= 1.0,
    }))
}
