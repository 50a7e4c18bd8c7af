//! `taskbox-bench egress`: the egress path of a sandbox against the host's own, with the same
//! clients on both sides and the same local server.
//!
//! - Throughput: curl downloads `--bytes` (1 GiB) from a server on the host's 127.0.0.1, directly
//!   on the host, and inside a long-lived sandbox (network mode "proxy") through its listener
//!   and the proxy, by HTTP forwarding (`HTTP_PROXY`) and by `CONNECT` (`--proxytunnel`). curl's
//!   own `time_total` is the time, so neither side pays for starting a process or an exec.
//! - Latency: `--conns` new connections one after another, each a small request and its whole
//!   response, timed by this binary's client mode (run on the host, and inside the sandbox where
//!   it goes through `CONNECT`): the added latency per new connection is the difference of the
//!   medians.
//!
//! Rounds alternate which side goes first.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use taskbox_core::api::{CreateRequest, ExecOutcome, ExecRequest, SandboxApi, SandboxId};
use taskbox_core::sandbox::NativeBackend;

use crate::stats;

#[derive(Args)]
pub struct EgressArgs {
    /// State directory of the sandbox (its backend's).
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The sandbox's workspace.
    #[arg(long, value_name = "DIR")]
    workspace: PathBuf,
    /// Bytes per download.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// New connections timed per side per round.
    #[arg(long, default_value_t = 500)]
    conns: usize,
    /// Worker threads of the proxy's service (the supervisor's has 1 or 2).
    #[arg(long, default_value_t = 2)]
    proxy_threads: usize,
    /// The proxy's splice pipe per direction (0: copy through buffers); default the proxy's own.
    #[arg(long)]
    pipe_bytes: Option<usize>,
}

/// CPU seconds (user + system) this process (the server and the proxy) has used so far, and
/// the part of it on the proxy's threads (named `taskbox-egress` by its service).
fn own_cpu_secs() -> (f64, f64) {
    let all = stat_cpu_secs("/proc/self/stat");
    let mut proxy = 0.0;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == "taskbox-egress" {
                proxy += stat_cpu_secs(&task.path().join("stat").display().to_string());
            }
        }
    }
    (all, proxy)
}

/// CPU seconds used since `before` (an [`own_cpu_secs`]): in all, and by the proxy.
fn cpu_since(before: (f64, f64)) -> (f64, f64) {
    let now = own_cpu_secs();
    (now.0 - before.0, now.1 - before.1)
}

/// utime + stime of a /proc stat file, in seconds.
fn stat_cpu_secs(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // The fields after the command name, which ends in the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name and state.
    (ticks(11) + ticks(12)) / 100.0
}

/// The client half, also run inside the sandbox.
#[derive(Subcommand)]
pub enum ClientCmd {
    /// COUNT new connections one after another, each `GET /small` and its whole response:
    /// directly to ADDR, or with --proxy through `CONNECT TARGET` first. Prints the times in
    /// microseconds as a JSON array.
    Latency {
        #[arg(long)]
        addr: String,
        /// Connect to ADDR as an HTTP proxy and tunnel to TARGET (host:port).
        #[arg(long, value_name = "TARGET")]
        via_connect: Option<String>,
        #[arg(long, default_value_t = 500)]
        count: usize,
    },
}

/// The local server: `GET /bytes/N` answers N zero bytes, `GET /small` three bytes; one request
/// per connection.
fn start_server() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = serve(conn);
            });
        }
    });
    Ok(port)
}

fn serve(conn: TcpStream) -> std::io::Result<()> {
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
    }
    let path = target
        .split_once("://")
        .map_or(target.as_str(), |(_, rest)| {
            rest.find('/').map_or("/", |i| &rest[i..])
        });
    let mut out = conn;
    if let Some(n) = path.strip_prefix("/bytes/") {
        let n: u64 = n.parse().unwrap_or(0);
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
        )?;
        let chunk = vec![0u8; 1 << 20];
        let mut left = n;
        while left > 0 {
            let k = left.min(chunk.len() as u64) as usize;
            out.write_all(&chunk[..k])?;
            left -= k as u64;
        }
    } else {
        out.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")?;
    }
    out.flush()
}

/// Runs the client half; prints its JSON.
pub fn client(cmd: ClientCmd) -> Result<()> {
    let ClientCmd::Latency {
        addr,
        via_connect,
        count,
    } = cmd;
    let mut times = Vec::with_capacity(count);
    let mut buf = vec![0u8; 4096];
    for _ in 0..count {
        let start = Instant::now();
        let mut s = TcpStream::connect(&addr).with_context(|| format!("connect {addr}"))?;
        s.set_nodelay(true)?;
        if let Some(target) = &via_connect {
            write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n")?;
            // The reply head ends the first read on loopback; check it is a 200.
            let mut head = Vec::new();
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf)?;
                ensure!(n > 0, "the proxy closed during CONNECT");
                head.extend_from_slice(&buf[..n]);
            }
            ensure!(
                head.starts_with(b"HTTP/1.1 200"),
                "CONNECT refused: {}",
                String::from_utf8_lossy(&head)
            );
        }
        s.write_all(b"GET /small HTTP/1.1\r\nHost: bench.test\r\nConnection: close\r\n\r\n")?;
        let mut got = Vec::new();
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        ensure!(got.ends_with(b"ok\n"), "short response");
        times.push(start.elapsed().as_micros() as u64);
    }
    println!("{}", serde_json::to_string(&times)?);
    Ok(())
}

/// curl's download of `url`: (seconds, bytes).
fn parse_curl(out: &str) -> Result<(f64, u64)> {
    let mut it = out.split_whitespace();
    let secs: f64 = it
        .next()
        .ok_or_else(|| anyhow!("no time from curl: {out:?}"))?
        .parse()?;
    let bytes: u64 = it
        .next()
        .ok_or_else(|| anyhow!("no size from curl: {out:?}"))?
        .parse()?;
    Ok((secs, bytes))
}

const CURL_FORMAT: &str = "%{time_total} %{size_download}";

fn curl_host(url: &str) -> Result<(f64, u64)> {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "*",
            "-o",
            "/dev/null",
            "-w",
            CURL_FORMAT,
            url,
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_curl(&String::from_utf8_lossy(&out.stdout))
}

fn sandbox_exec(api: &dyn SandboxApi, id: &SandboxId, argv: Vec<String>) -> Result<String> {
    let r = match api.exec(
        id,
        ExecRequest {
            argv: Some(argv.clone()),
            timeout_ms: Some(600_000),
            ..ExecRequest::default()
        },
        None,
    )? {
        ExecOutcome::Finished(r) => r,
        other => bail!("unexpected {other:?}"),
    };
    ensure!(
        r.exit_code == Some(0) && r.violations.is_empty(),
        "{argv:?} in the sandbox: exit {:?}, {}, {:?}",
        r.exit_code,
        r.stderr.text,
        r.violations
    );
    Ok(r.stdout.text)
}

fn latency(out: &str) -> Result<Vec<Duration>> {
    let us: Vec<u64> = serde_json::from_str(out.trim()).context("latency client output")?;
    Ok(us.into_iter().map(Duration::from_micros).collect())
}

pub fn run(a: &EgressArgs) -> Result<Value> {
    let port = start_server()?;
    let exe = std::env::current_exe()?;
    std::fs::create_dir_all(&a.state_dir)?;
    let policy = a.state_dir.join("egress-bench.toml");
    std::fs::write(
        &policy,
        "[network]\nmode = \"proxy\"\nallow = [\"bench.test\"]\n[network.hosts]\n\"bench.test\" = [\"127.0.0.1\"]\n",
    )?;
    let mut service = taskbox_egress::ProxyService::new(a.proxy_threads)?;
    if let Some(pipe) = a.pipe_bytes {
        service = service.limits(taskbox_egress::Limits {
            pipe_bytes: pipe,
            ..taskbox_egress::Limits::default()
        });
    }
    let backend = NativeBackend::new(a.state_dir.join("backend"))?.with_egress(Arc::new(service));
    let info = backend.create(CreateRequest {
        workspace: a.workspace.display().to_string(),
        policy: Some(policy.display().to_string()),
        ..CreateRequest::default()
    })?;
    let id = info.id;
    let url = format!("http://bench.test:{port}/bytes/{}", a.bytes);
    let host_url = format!("http://127.0.0.1:{port}/bytes/{}", a.bytes);
    let curl_in = |extra: &[&str], url: &str| -> Result<(f64, u64)> {
        let mut argv: Vec<String> = vec!["curl".into(), "-sS".into()];
        argv.extend(extra.iter().map(|s| s.to_string()));
        argv.extend(
            ["-o", "/dev/null", "-w", CURL_FORMAT, url]
                .iter()
                .map(|s| s.to_string()),
        );
        parse_curl(&sandbox_exec(&backend, &id, argv)?)
    };
    // Warm up every path once.
    curl_host(&host_url)?;
    curl_in(&[], &url)?;
    let (mut direct, mut forward, mut connect) = (Vec::new(), Vec::new(), Vec::new());
    // CPU seconds of this process (server, and proxy for the sandbox's downloads) per download.
    let (mut cpu_direct, mut cpu_forward, mut cpu_connect) = (Vec::new(), Vec::new(), Vec::new());
    let (mut r_forward, mut r_connect) = (Vec::new(), Vec::new());
    let (mut lat_direct, mut lat_proxy) = (Vec::new(), Vec::new());
    let exe_s = exe.display().to_string();
    let latency_in = |count: usize| -> Result<Vec<Duration>> {
        latency(&sandbox_exec(
            &backend,
            &id,
            vec![
                exe_s.clone(),
                "egress-client".into(),
                "latency".into(),
                "--addr".into(),
                format!("127.0.0.1:{}", taskbox_core::egress::PROXY_PORT),
                "--via-connect".into(),
                format!("bench.test:{port}"),
                "--count".into(),
                count.to_string(),
            ],
        )?)
    };
    let latency_host = |count: usize| -> Result<Vec<Duration>> {
        let out = Command::new(&exe)
            .args(["egress-client", "latency", "--addr"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["--count", &count.to_string()])
            .output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        latency(&String::from_utf8_lossy(&out.stdout))
    };
    for round in 0..a.rounds {
        eprintln!("egress: round {} of {}", round + 1, a.rounds);
        let mut one = |which: usize| -> Result<()> {
            let cpu = own_cpu_secs();
            match which {
                0 => {
                    let (t, b) = curl_host(&host_url)?;
                    ensure!(b == a.bytes, "direct: {b} bytes");
                    direct.push(t);
                    cpu_direct.push(cpu_since(cpu));
                }
                1 => {
                    let (t, b) = curl_in(&[], &url)?;
                    ensure!(b == a.bytes, "forward: {b} bytes");
                    forward.push(t);
                    cpu_forward.push(cpu_since(cpu));
                }
                2 => {
                    let (t, b) = curl_in(&["--proxytunnel"], &url)?;
                    ensure!(b == a.bytes, "connect: {b} bytes");
                    connect.push(t);
                    cpu_connect.push(cpu_since(cpu));
                }
                3 => lat_direct.extend(latency_host(a.conns)?),
                _ => lat_proxy.extend(latency_in(a.conns)?),
            }
            Ok(())
        };
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1, 2, 3, 4]
        } else {
            vec![4, 3, 2, 1, 0]
        };
        for which in order {
            one(which)?;
        }
        let d = direct[direct.len() - 1];
        r_forward.push(d / forward[forward.len() - 1]);
        r_connect.push(d / connect[connect.len() - 1]);
    }
    backend.destroy(&id)?;
    let gib = a.bytes as f64 / f64::from(1u32 << 30);
    let row = |name: &str,
               times: &mut Vec<f64>,
               cpu: &mut Vec<(f64, f64)>,
               ratios: Option<&mut Vec<f64>>|
     -> Value {
        let best = times.iter().copied().fold(f64::INFINITY, f64::min);
        let med = stats::median(times);
        json!({
            "name": name,
            "server_proxy_cpu_s_per_gib": ((stats::median(&cpu.iter().map(|c| c.0).collect::<Vec<_>>()) / gib) * 100.0).round() / 100.0,
            "proxy_cpu_s_per_gib": ((stats::median(&cpu.iter().map(|c| c.1).collect::<Vec<_>>()) / gib) * 100.0).round() / 100.0,
            "median_s": (med * 1000.0).round() / 1000.0,
            "best_s": (best * 1000.0).round() / 1000.0,
            "mib_per_s": ((a.bytes as f64 / (1 << 20) as f64) / med).round(),
            "gib": gib,
            "vs_direct_median_of_rounds": ratios.map(|r| (stats::median(r) * 100.0).round() / 100.0),
        })
    };
    let mut lat = [
        stats::summary("direct", &lat_direct),
        stats::summary("sandbox, CONNECT", &lat_proxy),
    ];
    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let added = p50(&lat[1]) - p50(&lat[0]);
    lat[1]["added_p50_ms"] = json!((added * 1000.0).round() / 1000.0);
    Ok(json!({
        "figure": "egress",
        "download": [
            row("curl direct (host)", &mut direct, &mut cpu_direct, None),
            row(
                "curl in sandbox, HTTP forwarding",
                &mut forward,
                &mut cpu_forward,
                Some(&mut r_forward)
            ),
            row(
                "curl in sandbox, CONNECT",
                &mut connect,
                &mut cpu_connect,
                Some(&mut r_connect)
            ),
        ],
        "latency": lat,
    }))
}
