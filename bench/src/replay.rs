//! `taskbox-bench replay`: what replay costs beyond executing the operations themselves.
//!
//! Records a trace of OPS operations in this process (the library with the trace recorder, on
//! the native backend, in a git workspace): create, then execs of `/bin/true` alternating with
//! a write and a read of a small file, then destroy. Then runs `taskbox replay TRACE --json`
//! ROUNDS times and reads from each report the time spent inside the backend's calls
//! (`backend_ms`: the operations themselves) and the engine's whole time (`total_ms`), and times
//! the process from spawn to exit. Overheads are relative to `backend_ms`:
//!
//! - engine: `total_ms - backend_ms` (re-issuing, shaping, redacting, comparing);
//! - process: wall time - `backend_ms` (also process start, reading the trace, the clean
//!   checkout of the workspace, the report).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use serde_json::{Value, json};
use taskbox_core::api::{CreateRequest, ExecRequest, ReadRequest, SandboxApi, WriteRequest};
use taskbox_core::sandbox::NativeBackend;
use taskbox_core::trace::Traced;

use crate::stats;

#[derive(Args)]
pub struct ReplayArgs {
    /// The `taskbox` binary that replays.
    #[arg(long, value_name = "PATH")]
    taskbox: PathBuf,
    /// Scratch directory (state, workspace, trace).
    #[arg(long, value_name = "DIR")]
    dir: PathBuf,
    /// Operations in the trace, create and destroy included.
    #[arg(long, default_value_t = 1000)]
    ops: usize,
    /// Replays measured.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let ok = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=b", "-c", "user.email=b@example.invalid"])
        .args(["-c", "commit.gpgsign=false"])
        .args(args)
        .stdout(Stdio::null())
        .status()?
        .success();
    ensure!(ok, "git {args:?} failed in {}", dir.display());
    Ok(())
}

/// Records the trace; returns its path.
fn record(a: &ReplayArgs) -> Result<PathBuf> {
    ensure!(a.ops >= 3, "--ops must be at least 3");
    let ws = a.dir.join("ws");
    std::fs::create_dir_all(&ws)?;
    std::fs::write(ws.join("README"), "bench\n")?;
    git(&ws, &["init", "-q"])?;
    git(&ws, &["add", "README"])?;
    git(&ws, &["commit", "-qm", "bench"])?;
    let state = a.dir.join("record-state");
    let backend = NativeBackend::new(state.clone()).map_err(|e| anyhow::anyhow!(e))?;
    let api = Traced::new(backend, state.join("traces"));
    let info = api
        .create(CreateRequest {
            workspace: ws.display().to_string(),
            ..CreateRequest::default()
        })
        .map_err(|e| anyhow::anyhow!(e))?;
    for i in 0..a.ops - 2 {
        let r = match i % 4 {
            0 | 2 => api
                .exec(
                    &info.id,
                    ExecRequest {
                        argv: Some(vec!["/bin/true".into()]),
                        ..ExecRequest::default()
                    },
                    None,
                )
                .map(|_| ()),
            1 => api
                .write(
                    &info.id,
                    WriteRequest {
                        path: "notes.txt".into(),
                        content: format!("note {i}\n"),
                        ..WriteRequest::default()
                    },
                )
                .map(|_| ()),
            _ => api
                .read(
                    &info.id,
                    ReadRequest {
                        path: "notes.txt".into(),
                        ..ReadRequest::default()
                    },
                )
                .map(|_| ()),
        };
        r.map_err(|e| anyhow::anyhow!(e))?;
    }
    api.destroy(&info.id).map_err(|e| anyhow::anyhow!(e))?;
    Ok(api.trace_path(&info.id))
}

fn ms(v: &[f64]) -> Vec<std::time::Duration> {
    v.iter()
        .map(|m| std::time::Duration::from_secs_f64(m / 1000.0))
        .collect()
}

pub fn run(a: &ReplayArgs) -> Result<Value> {
    let trace = record(a)?;
    let state = a.dir.join("replay-state");
    let (mut backend, mut engine, mut wall) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        eprintln!("replay round {}/{}", round + 1, a.rounds);
        let t = Instant::now();
        let out = Command::new(&a.taskbox)
            .arg("replay")
            .arg(&trace)
            .arg("--json")
            .arg("--state-dir")
            .arg(&state)
            .stdin(Stdio::null())
            .output()
            .context("cannot run taskbox replay")?;
        let wall_ms = t.elapsed().as_secs_f64() * 1000.0;
        let report: Value = serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "taskbox replay printed no report: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        if report["diverged"] != 0 || report["skipped"] != 0 {
            bail!("the replay did not match: {report}");
        }
        ensure!(
            report["ops"].as_array().map(Vec::len) == Some(a.ops),
            "the report has the wrong number of ops"
        );
        backend.push(report["backend_ms"].as_f64().unwrap_or(0.0));
        engine.push(report["total_ms"].as_f64().unwrap_or(0.0));
        wall.push(wall_ms);
    }
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    let (b, e, w) = (sum(&backend), sum(&engine), sum(&wall));
    Ok(json!({
        "ops": a.ops,
        "rounds": a.rounds,
        "backend_ms": stats::summary("backend", &ms(&backend)),
        "engine_ms": stats::summary("engine", &ms(&engine)),
        "wall_ms": stats::summary("wall", &ms(&wall)),
        "engine_overhead_pct": (e - b) * 100.0 / b,
        "process_overhead_pct": (w - b) * 100.0 / b,
    }))
}
