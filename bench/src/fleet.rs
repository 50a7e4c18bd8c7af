//! The fleet figures of issue 19 (`scripts/bench.sh fork`), against a supervisor on its Unix
//! socket and through the library in this process:
//!
//! - `fork`: a parent with CHANGED changed files in the workspace, forked into COUNT; the time
//!   from the fork request until every fork has answered an `exec /bin/true` (each fork's exec
//!   on a connection of its own, all at once), and the fork request alone. With a second
//!   supervisor (`--cold-socket`, started without a warm pool) and `--lib-pool N`, the same
//!   series with and without the warm pool of forks are measured round by round, interleaved
//!   (A, B, then B, A), and each round's ratio pool / no pool is reported: the machine is
//!   shared, so only figures taken side by side compare;
//! - `density`: sandboxes created one after the other, each with one exec, until a create fails
//!   or MAX is reached or the host's available memory falls under a floor; the host memory they
//!   take each (`MemAvailable` before and after) and the supervisor's RSS;
//! - `rate`: CLIENTS clients each creating a sandbox, running one exec in it and destroying it,
//!   over and over for SECS seconds: cycles per second, and each cycle's latency.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Args;
use serde_json::{Value, json};
use taskbox_core::api::{
    CreateRequest, ExecOutcome, ForkRequest, SandboxApi, SandboxId, WriteRequest,
};
use taskbox_core::kit::ForkPoolConfig;
use taskbox_core::sandbox::NativeBackend;

use crate::{EXEC_TRUE, exec_true_req, http, procfs, stats};

#[derive(Args)]
pub struct ForkArgs {
    /// The supervisor's Unix socket: the series "http".
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also through the library in this process, state kept under DIR: the series "lib".
    #[arg(long, value_name = "DIR")]
    lib_state_dir: Option<PathBuf>,
    /// A second supervisor, without a warm pool of forks: the series "http-cold", measured
    /// interleaved with "http".
    #[arg(long, value_name = "PATH")]
    cold_socket: Option<PathBuf>,
    /// The library series with a warm pool of N forks per origin ("lib"), and a second library
    /// backend without one ("lib-cold", state in DIR-cold), interleaved (0: "lib" alone, no
    /// pool).
    #[arg(long, value_name = "N", default_value_t = 0)]
    lib_pool: usize,
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// Forks per request.
    #[arg(long, default_value_t = 16)]
    count: u32,
    /// Files changed in the parent (d{k}/f1.txt, which must exist).
    #[arg(long, default_value_t = 10)]
    changed: usize,
    /// Measured forks per series.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Pause after each round's destroys, so that their cleanup (a detached removal of each
    /// sandbox's directory) is not measured as the next fork's.
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
}

#[derive(Args)]
pub struct DensityArgs {
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The supervisor's process id (its VmRSS).
    #[arg(long)]
    pid: u32,
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// At most this many sandboxes.
    #[arg(long, default_value_t = 768)]
    max: usize,
    /// Stop before the host's available memory falls under this many MiB (the machine is
    /// shared).
    #[arg(long, default_value_t = 4096)]
    floor_mib: u64,
    #[arg(long, default_value_t = 5)]
    settle_secs: u64,
}

#[derive(Args)]
pub struct RateArgs {
    /// The supervisor's Unix socket: the series "http".
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also through the library in this process, state under DIR: the series "lib".
    #[arg(long, value_name = "DIR")]
    lib_state_dir: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    #[arg(long, default_value_t = 8)]
    clients: usize,
    #[arg(long, default_value_t = 20)]
    secs: u64,
}

/// A client of the supervisor's API for one thread: JSON in, JSON out.
fn post(c: &mut http::Client, path: &str, body: &Value, want: u16) -> Result<Value> {
    let body = serde_json::to_vec(body)?;
    c.post(path, &body)?.expect_status(want, path)?.json()
}

/// What a series drives: the supervisor over HTTP, or the library.
#[derive(Clone)]
enum Api {
    Http(PathBuf),
    Lib(Arc<dyn SandboxApi>),
}

impl Api {
    fn name(&self) -> &'static str {
        match self {
            Api::Http(_) => "http",
            Api::Lib(_) => "lib",
        }
    }

    fn create(&self, ws: &Path) -> Result<String> {
        match self {
            Api::Http(socket) => {
                let mut c = http::Client::connect(socket)?;
                let info = post(&mut c, "/v1/sandboxes", &json!({ "workspace": ws }), 201)?;
                Ok(info["id"]
                    .as_str()
                    .ok_or_else(|| anyhow!("no id: {info}"))?
                    .to_string())
            }
            Api::Lib(api) => Ok(api
                .create(CreateRequest {
                    workspace: ws.display().to_string(),
                    ..CreateRequest::default()
                })
                .map_err(|e| anyhow!("create: {e}"))?
                .id
                .to_string()),
        }
    }

    fn write(&self, id: &str, path: &str, content: &str) -> Result<()> {
        match self {
            Api::Http(socket) => {
                let mut c = http::Client::connect(socket)?;
                post(
                    &mut c,
                    &format!("/v1/sandboxes/{id}/write"),
                    &json!({"path": path, "content": content}),
                    200,
                )
                .map(drop)
            }
            Api::Lib(api) => api
                .write(
                    &SandboxId::parse(id)?,
                    WriteRequest {
                        path: path.into(),
                        content: content.into(),
                        ..WriteRequest::default()
                    },
                )
                .map(drop)
                .map_err(|e| anyhow!("write: {e}")),
        }
    }

    fn fork(&self, id: &str, count: u32) -> Result<Vec<String>> {
        match self {
            Api::Http(socket) => {
                let mut c = http::Client::connect(socket)?;
                let r = post(
                    &mut c,
                    &format!("/v1/sandboxes/{id}/fork"),
                    &json!({ "count": count }),
                    201,
                )?;
                Ok(r["sandboxes"]
                    .as_array()
                    .ok_or_else(|| anyhow!("no sandboxes: {r}"))?
                    .iter()
                    .filter_map(|i| i["id"].as_str().map(str::to_string))
                    .collect())
            }
            Api::Lib(api) => Ok(api
                .fork(
                    &SandboxId::parse(id)?,
                    ForkRequest {
                        count: Some(count),
                        ..ForkRequest::default()
                    },
                )
                .map_err(|e| anyhow!("fork: {e}"))?
                .sandboxes
                .into_iter()
                .map(|i| i.id.to_string())
                .collect()),
        }
    }

    /// One `exec /bin/true`, checked.
    fn exec_true(&self, c: Option<&mut http::Client>, id: &str) -> Result<()> {
        match self {
            Api::Http(_) => {
                let c = c.ok_or_else(|| anyhow!("no connection"))?;
                let r = c.post(&format!("/v1/sandboxes/{id}/exec"), EXEC_TRUE)?;
                let v = r.expect_status(200, "exec")?.json()?;
                ensure!(v["exit_code"] == 0, "exec /bin/true failed: {v}");
                Ok(())
            }
            Api::Lib(api) => match api
                .exec(&SandboxId::parse(id)?, exec_true_req(), None)
                .map_err(|e| anyhow!("exec: {e}"))?
            {
                ExecOutcome::Finished(r) if r.exit_code == Some(0) => Ok(()),
                other => bail!("exec /bin/true failed: {other:?}"),
            },
        }
    }

    fn destroy(&self, c: Option<&mut http::Client>, id: &str) -> Result<()> {
        match self {
            Api::Http(_) => {
                let c = c.ok_or_else(|| anyhow!("no connection"))?;
                c.delete(&format!("/v1/sandboxes/{id}"))?
                    .expect_status(204, "destroy")
                    .map(drop)
            }
            Api::Lib(api) => api
                .destroy(&SandboxId::parse(id)?)
                .map_err(|e| anyhow!("destroy: {e}")),
        }
    }

    /// A connection of its own for a thread (HTTP), or none (the library).
    fn connection(&self) -> Result<Option<http::Client>> {
        match self {
            Api::Http(socket) => http::Client::connect(socket).map(Some),
            Api::Lib(_) => Ok(None),
        }
    }
}

fn lib(state: &Path) -> Result<Api> {
    let backend = NativeBackend::new(state.to_path_buf()).map_err(|e| anyhow!("{e}"))?;
    Ok(Api::Lib(Arc::new(backend)))
}

/// Forks served from the pool so far: `/metrics`' `taskbox_fork_pool_served` of a supervisor, or
/// the status of a library backend's pool.
type Served = Box<dyn Fn() -> Option<u64>>;

fn served_over_http(socket: PathBuf) -> Served {
    Box::new(move || {
        let mut c = http::Client::connect(&socket).ok()?;
        let r = c.request("GET", "/metrics", None).ok()?;
        String::from_utf8_lossy(&r.body).lines().find_map(|l| {
            l.strip_prefix("taskbox_fork_pool_served ")?
                .trim()
                .parse()
                .ok()
        })
    })
}

/// One series of the fork figure: what it drives, its parent and connections, its samples.
struct Arm {
    name: String,
    api: Api,
    served: Served,
    parent: String,
    conns: Vec<Option<http::Client>>,
    all: Vec<Duration>,
    forks_only: Vec<Duration>,
    first: Vec<Duration>,
    from_pool: u64,
    measured_forks: u64,
}

impl Arm {
    fn new(name: &str, api: Api, served: Served, a: &ForkArgs) -> Result<Arm> {
        let parent = api.create(&a.workspace)?;
        for k in 0..a.changed {
            api.write(&parent, &format!("d{k}/f1.txt"), &format!("changed {k}\n"))?;
        }
        // One connection per fork, opened ahead: what is timed is the fork and the execs.
        let conns: Vec<Option<http::Client>> = (0..a.count)
            .map(|_| api.connection())
            .collect::<Result<_>>()?;
        Ok(Arm {
            name: name.to_string(),
            api,
            served,
            parent,
            conns,
            all: Vec::new(),
            forks_only: Vec::new(),
            first: Vec::new(),
            from_pool: 0,
            measured_forks: 0,
        })
    }

    /// One round: fork, every fork's exec, destroys, the pause; kept unless a warm-up. The time
    /// to all answering.
    fn round(&mut self, a: &ForkArgs, label: &str, keep: bool) -> Result<Duration> {
        let api = &self.api;
        let served_before = (self.served)();
        let t = Instant::now();
        let ids = api.fork(&self.parent, a.count)?;
        let forked = t.elapsed();
        ensure!(ids.len() == a.count as usize, "{} forks", ids.len());
        let firsts: Vec<Result<Duration>> = std::thread::scope(|s| {
            let handles: Vec<_> = ids
                .iter()
                .zip(self.conns.iter_mut())
                .map(|(id, c)| {
                    s.spawn(move || {
                        api.exec_true(c.as_mut(), id)?;
                        Ok(t.elapsed())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
                .collect()
        });
        let firsts: Vec<Duration> = firsts.into_iter().collect::<Result<_>>()?;
        let last = firsts.iter().max().copied().unwrap_or_default();
        let pooled = match (served_before, (self.served)()) {
            (Some(b), Some(a)) => a.saturating_sub(b),
            _ => 0,
        };
        if keep {
            self.all.push(last);
            self.forks_only.push(forked);
            self.first.extend(firsts);
            self.from_pool += pooled;
            self.measured_forks += u64::from(a.count);
        }
        let mut c = api.connection()?;
        for id in &ids {
            api.destroy(c.as_mut(), id)?;
        }
        std::thread::sleep(std::time::Duration::from_millis(a.settle_ms));
        eprintln!(
            "  fork {label} {}: {:.1} ms to all {} answering ({:.1} ms the fork, {pooled} from the pool)",
            self.name,
            last.as_secs_f64() * 1000.0,
            a.count,
            forked.as_secs_f64() * 1000.0
        );
        Ok(last)
    }

    fn finish(self) -> Result<Value> {
        let mut c = self.api.connection()?;
        self.api.destroy(c.as_mut(), &self.parent)?;
        Ok(json!({
            "api": self.name,
            "fork_to_all_answering": stats::summary("fork -> all answered an exec", &self.all),
            "fork_request": stats::summary("fork request alone", &self.forks_only),
            "each_fork_first_exec": stats::summary("fork -> each fork's exec answered", &self.first),
            "forks_from_the_pool": self.from_pool,
            "forks_measured": self.measured_forks,
        }))
    }
}

/// `fork`: see the module docs.
pub fn fork(a: &ForkArgs) -> Result<Value> {
    // Pairs (with the pool, without): measured round by round, interleaved.
    let mut pairs: Vec<(Arm, Option<Arm>)> = Vec::new();
    if let Some(s) = &a.socket {
        let warm = Arm::new("http", Api::Http(s.clone()), served_over_http(s.clone()), a)?;
        let cold = match &a.cold_socket {
            Some(c) => Some(Arm::new(
                "http-cold",
                Api::Http(c.clone()),
                served_over_http(c.clone()),
                a,
            )?),
            None => None,
        };
        pairs.push((warm, cold));
    }
    if let Some(d) = &a.lib_state_dir {
        let backend = NativeBackend::new(d.clone()).map_err(|e| anyhow!("{e}"))?;
        let backend = Arc::new(if a.lib_pool > 0 {
            backend.with_fork_pool(ForkPoolConfig::new(a.lib_pool))
        } else {
            backend
        });
        let b = backend.clone();
        let served: Served = Box::new(move || b.fork_pool_status().map(|s| s.served));
        let warm = Arm::new("lib", Api::Lib(backend), served, a)?;
        let cold = if a.lib_pool > 0 {
            let mut dir = d.as_os_str().to_owned();
            dir.push("-cold");
            Some(Arm::new(
                "lib-cold",
                lib(Path::new(&dir))?,
                Box::new(|| None),
                a,
            )?)
        } else {
            None
        };
        pairs.push((warm, cold));
    }
    ensure!(!pairs.is_empty(), "give --socket and/or --lib-state-dir");
    let mut series = Vec::new();
    for (mut warm, mut cold) in pairs {
        let mut ratios = Vec::new();
        for i in 0..a.warmup + a.runs {
            let keep = i >= a.warmup;
            let label = format!("{}/{}", i + 1, a.warmup + a.runs);
            let Some(cold) = cold.as_mut() else {
                warm.round(a, &label, keep)?;
                continue;
            };
            // A, B then B, A: neither side always runs first.
            let (w, c) = if i % 2 == 0 {
                let w = warm.round(a, &label, keep)?;
                (w, cold.round(a, &label, keep)?)
            } else {
                let c = cold.round(a, &label, keep)?;
                (warm.round(a, &label, keep)?, c)
            };
            if keep {
                ratios.push(w.as_secs_f64() / c.as_secs_f64());
            }
        }
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        let ab = (!ratios.is_empty()).then(|| {
            json!({
                "pool_over_no_pool_p50": stats::median(&ratios),
                "min": sorted.first(),
                "max": sorted.last(),
                "rounds": ratios,
            })
        });
        let mut w = warm.finish()?;
        if let Some(ab) = ab {
            w["ab"] = ab;
        }
        series.push(w);
        if let Some(c) = cold {
            series.push(c.finish()?);
        }
    }
    Ok(json!({
        "figure": "fork",
        "count": a.count,
        "changed": a.changed,
        "series": series,
    }))
}

/// `MemAvailable` of the host, KiB.
fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("MemAvailable:")
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
        })
        .unwrap_or(0)
}

/// `density`: see the module docs.
pub fn density(a: &DensityArgs) -> Result<Value> {
    let settle = Duration::from_secs(a.settle_secs);
    let before = procfs::snapshot(a.pid);
    let avail_before = mem_available_kib();
    let mut c = http::Client::connect(&a.socket)?;
    let mut ids = Vec::new();
    let mut stopped = String::from("the maximum was reached");
    let mut creates = Vec::new();
    while ids.len() < a.max {
        if mem_available_kib() < a.floor_mib * 1024 {
            stopped = format!(
                "the host's available memory fell under {} MiB (a floor for a shared machine)",
                a.floor_mib
            );
            break;
        }
        let t = Instant::now();
        let body = serde_json::to_vec(&json!({ "workspace": a.workspace }))?;
        let r = c.post("/v1/sandboxes", &body)?;
        if r.status != 201 {
            stopped = format!(
                "create {} failed: {} {}",
                ids.len() + 1,
                r.status,
                String::from_utf8_lossy(&r.body)
            );
            break;
        }
        creates.push(t.elapsed());
        let id = r.json()?["id"].as_str().unwrap_or_default().to_string();
        let e = c.post(&format!("/v1/sandboxes/{id}/exec"), EXEC_TRUE)?;
        ids.push(id);
        if e.status != 200 {
            stopped = format!(
                "the exec in sandbox {} failed: {} {}",
                ids.len(),
                e.status,
                String::from_utf8_lossy(&e.body)
            );
            break;
        }
        if ids.len() % 64 == 0 {
            eprintln!(
                "  density: {} sandboxes, MemAvailable {} MiB",
                ids.len(),
                mem_available_kib() / 1024
            );
        }
    }
    std::thread::sleep(settle);
    let avail_with = mem_available_kib();
    let with = procfs::snapshot(a.pid);
    // Every one still answers.
    let mut answering = 0;
    for id in &ids {
        let r = c.post(&format!("/v1/sandboxes/{id}/exec"), EXEC_TRUE)?;
        if r.status == 200 {
            answering += 1;
        }
    }
    eprintln!("  density: {} sandboxes ({stopped}); destroying", ids.len());
    for id in &ids {
        c.delete(&format!("/v1/sandboxes/{id}"))?
            .expect_status(204, "destroy")
            .with_context(|| format!("destroy {id}"))?;
    }
    std::thread::sleep(settle);
    let after = procfs::snapshot(a.pid);
    let n = ids.len().max(1) as u64;
    Ok(json!({
        "figure": "density",
        "sandboxes": ids.len(),
        "answering_at_the_end": answering,
        "stopped_because": stopped,
        "host_mem_available_mib": {
            "before": avail_before / 1024,
            "with_sandboxes": avail_with / 1024,
            "per_sandbox_kib": avail_before.saturating_sub(avail_with) / n,
        },
        "supervisor": {"before": before, "with_sandboxes": with, "after_destroy": after},
        "create": stats::summary("create (one after the other)", &creates),
    }))
}

/// `rate`: see the module docs.
pub fn rate(a: &RateArgs) -> Result<Value> {
    let mut apis = Vec::new();
    if let Some(s) = &a.socket {
        apis.push(Api::Http(s.clone()));
    }
    if let Some(d) = &a.lib_state_dir {
        apis.push(lib(d)?);
    }
    ensure!(!apis.is_empty(), "give --socket and/or --lib-state-dir");
    let mut series = Vec::new();
    for api in apis {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let workers: Vec<_> = (0..a.clients)
            .map(|_| {
                let (api, stop, done, ws) =
                    (api.clone(), stop.clone(), done.clone(), a.workspace.clone());
                std::thread::spawn(move || -> Result<[Vec<Duration>; 4]> {
                    let mut c = api.connection()?;
                    let [mut cycles, mut creates, mut execs, mut destroys] =
                        [(); 4].map(|()| Vec::new());
                    while !stop.load(Ordering::SeqCst) {
                        let t = Instant::now();
                        let id = match &mut c {
                            Some(conn) => {
                                let info =
                                    post(conn, "/v1/sandboxes", &json!({ "workspace": ws }), 201)?;
                                info["id"].as_str().unwrap_or_default().to_string()
                            }
                            None => api.create(&ws)?,
                        };
                        let created = Instant::now();
                        api.exec_true(c.as_mut(), &id)?;
                        let ran = Instant::now();
                        api.destroy(c.as_mut(), &id)?;
                        cycles.push(t.elapsed());
                        creates.push(created - t);
                        execs.push(ran - created);
                        destroys.push(ran.elapsed());
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok([cycles, creates, execs, destroys])
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(a.secs));
        stop.store(true, Ordering::SeqCst);
        let [mut cycles, mut creates, mut execs, mut destroys] = [(); 4].map(|()| Vec::new());
        for w in workers {
            let [c, cr, e, d] = w.join().map_err(|_| anyhow!("a client panicked"))??;
            cycles.extend(c);
            creates.extend(cr);
            execs.extend(e);
            destroys.extend(d);
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let n = done.load(Ordering::SeqCst);
        eprintln!(
            "  rate ({}): {n} cycles in {elapsed:.1} s: {:.1}/s",
            api.name(),
            n as f64 / elapsed
        );
        series.push(json!({
            "api": api.name(),
            "cycles": n,
            "seconds": elapsed,
            "per_second": n as f64 / elapsed,
            "cycle": stats::summary("create + exec + destroy", &cycles),
            "steps": {
                "create": stats::summary("create", &creates),
                "exec": stats::summary("exec", &execs),
                "destroy": stats::summary("destroy", &destroys),
            },
        }));
    }
    Ok(json!({
        "figure": "rate",
        "clients": a.clients,
        "series": series,
    }))
}
