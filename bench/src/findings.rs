//! `taskbox-bench findings-cost` and `findings-text`: what reading findings costs, and what
//! they save the model.
//!
//! - cost: the same commands (a test log of 100 MB written by a test-runner-like generator, and
//!   the same log by `cat`) through two supervisors of one build, one of them started with
//!   `TASKBOX_FINDINGS=off`, in rounds whose order alternates; the exec's wall time through the
//!   API on each side, and the ratio. Each answer is checked: the reading side found the planted
//!   failure, the other found nothing.
//! - text: for each case (a project, a command with a planted failure, the failing test's name
//!   and `file:line`), the exec's result rendered as the model reads it (the tool result of the
//!   agent and the MCP server, with the agent's output limit) with its findings first, and the
//!   same result without them (the head and tail of the output alone): the bytes of each, and
//!   whether the name and the location are in it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Args;
use serde_json::{Value, json};
use taskbox_core::result::ExecResult;

use crate::{http, stats};

#[derive(Args)]
pub struct CostArgs {
    /// The supervisor that reads findings.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The same build's supervisor, started with `TASKBOX_FINDINGS=off`.
    #[arg(long, value_name = "PATH")]
    socket_off: PathBuf,
    /// The workspace of both sandboxes.
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// A command measured, as NAME=SHELL LINE (repeatable).
    #[arg(long, value_name = "NAME=LINE", required = true)]
    command: Vec<String>,
    /// The failing test's name that the reading side must find.
    #[arg(long)]
    expect: String,
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

#[derive(Args)]
pub struct TextArgs {
    /// The supervisor (reading findings).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// A case, as NAME|WORKSPACE|SHELL LINE|TEST NAME|FILE:LINE (repeatable).
    #[arg(long, value_name = "CASE", required = true)]
    case: Vec<String>,
}

struct Side {
    client: http::Client,
    exec: String,
    base: String,
}

impl Side {
    fn create(socket: &std::path::Path, ws: &std::path::Path) -> Result<Side> {
        let mut client = http::Client::connect(socket)?;
        let body = serde_json::to_vec(&json!({ "workspace": ws }))?;
        let info = client
            .post("/v1/sandboxes", &body)?
            .expect_status(201, "create")?
            .json()?;
        let id = info["id"]
            .as_str()
            .ok_or_else(|| anyhow!("create answered no id: {info}"))?;
        let base = format!("/v1/sandboxes/{id}");
        Ok(Side {
            client,
            exec: format!("{base}/exec"),
            base,
        })
    }

    fn exec(&mut self, body: &Value) -> Result<(f64, ExecResult)> {
        let body = serde_json::to_vec(body)?;
        let t = Instant::now();
        let r = self.client.post(&self.exec, &body)?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let v = r.expect_status(200, "exec")?.json()?;
        let r: ExecResult = serde_json::from_value(v).context("the exec's answer")?;
        Ok((ms, r))
    }

    fn destroy(mut self) {
        let _ = self.client.delete(&self.base);
    }
}

pub fn cost(a: &CostArgs) -> Result<Value> {
    let commands: Vec<(String, String)> = a
        .command
        .iter()
        .map(|c| {
            c.split_once('=')
                .map(|(n, l)| (n.to_string(), l.to_string()))
                .ok_or_else(|| anyhow!("--command {c:?}: expected NAME=LINE"))
        })
        .collect::<Result<_>>()?;
    let mut on = Side::create(&a.socket, &a.workspace)?;
    let mut off = Side::create(&a.socket_off, &a.workspace)?;
    let mut figures = Vec::new();
    for (name, line) in &commands {
        let body = json!({ "shell": line, "timeout_ms": 600_000 });
        // One unmeasured run each: the page cache, the interpreter.
        on.exec(&body)?;
        off.exec(&body)?;
        let (mut t_on, mut t_off, mut own_on, mut own_off) = (vec![], vec![], vec![], vec![]);
        let mut ratios = Vec::new();
        for round in 0..a.rounds {
            let one = |side: &mut Side, reading: bool| -> Result<(f64, f64)> {
                let (ms, r) = side.exec(&body)?;
                let found = r
                    .findings
                    .iter()
                    .any(|f| f.name.as_deref().is_some_and(|n| n.contains(&a.expect)));
                if reading {
                    ensure!(
                        found,
                        "{name}: the reading side did not find {:?}: {:?}",
                        a.expect,
                        r.findings
                    );
                } else {
                    ensure!(
                        r.findings.is_empty(),
                        "{name}: the supervisor with TASKBOX_FINDINGS=off gave findings"
                    );
                }
                Ok((ms, r.duration_ms as f64))
            };
            let (x, y) = if round % 2 == 0 {
                let x = one(&mut on, true)?;
                (x, one(&mut off, false)?)
            } else {
                let y = one(&mut off, false)?;
                (one(&mut on, true)?, y)
            };
            t_on.push(x.0);
            own_on.push(x.1);
            t_off.push(y.0);
            own_off.push(y.1);
            ratios.push(x.0 / y.0);
        }
        let (m_on, m_off) = (stats::median(&t_on), stats::median(&t_off));
        figures.push(json!({
            "command": name,
            "line": line,
            "rounds": a.rounds,
            "findings_on_ms": m_on,
            "findings_off_ms": m_off,
            "exec_own_ms_on": stats::median(&own_on),
            "exec_own_ms_off": stats::median(&own_off),
            "ratio": m_on / m_off,
            // Robust to the machine's drift within a run: each pair ran back to back.
            "ratio_pairs": stats::median(&ratios),
            "ratio_min": ratios.iter().cloned().fold(f64::INFINITY, f64::min),
            "ratio_max": ratios.iter().cloned().fold(0.0, f64::max),
        }));
    }
    on.destroy();
    off.destroy();
    Ok(json!({ "figure": "findings-cost", "commands": figures }))
}

pub fn text(a: &TextArgs) -> Result<Value> {
    let mut rows = Vec::new();
    for case in &a.case {
        let parts: Vec<&str> = case.split('|').collect();
        let [name, ws, line, test, location] = parts[..] else {
            bail!("--case {case:?}: expected NAME|WORKSPACE|LINE|TEST NAME|FILE:LINE");
        };
        let mut side = Side::create(&a.socket, std::path::Path::new(ws))?;
        let (_, r) = side.exec(&json!({
            "shell": line,
            "timeout_ms": 600_000,
            "output_limit": taskbox_tools::EXEC_OUTPUT_LIMIT,
        }))?;
        side.destroy();
        let with = taskbox_tools::render::exec(&r, None);
        let mut bare = r.clone();
        bare.findings.clear();
        bare.findings_omitted = 0;
        bare.tests = None;
        let without = taskbox_tools::render::exec(&bare, None);
        // What the model reads before it knows where the failure is: the bytes up to the end
        // of the location's first mention (all of them when it is not there).
        let has = |t: &str| {
            json!({
                "name": t.contains(test),
                "location": t.contains(location),
                "bytes_to_location": t.find(location).map(|i| i + location.len()),
            })
        };
        rows.push(json!({
            "case": name,
            "exit_code": r.exit_code,
            "output_bytes": r.stdout.bytes + r.stderr.bytes,
            "findings": r.findings.len(),
            "with_findings_bytes": with.len(),
            "with_findings_has": has(&with),
            "head_tail_bytes": without.len(),
            "head_tail_has": has(&without),
            // The findings' part alone: what a harness that keeps only it would send.
            "findings_part_bytes": with.len().saturating_sub(without.len()),
        }));
    }
    Ok(json!({ "figure": "findings-text", "cases": rows }))
}
