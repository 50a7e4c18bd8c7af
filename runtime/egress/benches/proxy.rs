//! Throughput and per-connection latency of the egress proxy on loopback, beside the same
//! transfers without it.
//!
//!   cargo bench -p taskbox-egress --bench proxy
//!
//! Throughput: `curl` downloads EGRESS_BENCH_BYTES (default 1 GiB) from an HTTP server in this
//! process, directly and through the proxy (HTTP forwarding, CONNECT, SOCKS5), EGRESS_BENCH_ROUNDS
//! times each (default 3, the variants alternating); the median of each is reported and its ratio
//! to the direct one (target >= 0.8). Without curl, a Rust client does the same.
//!
//! Latency: EGRESS_BENCH_CONNS (default 2000) new connections one after another from a blocking
//! client thread, each sending a small request and reading the whole response: directly, and
//! through the proxy with CONNECT (what an HTTPS client does before its TLS handshake; the TLS
//! cost is the same on both paths). Reported: p50 and p99 of both and the added p50 (target
//! < 1 ms). EGRESS_BENCH_PIPE sets the proxy's largest splice pipe per direction (0: copy through memory),
//! EGRESS_BENCH_BUFFER its copy buffer (defaults: the proxy's).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use taskbox_egress::{Limits, Proxy, Rules};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn env_u64(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .with_context(|| format!("{name}={text}: not a number")),
        Err(_) => Ok(default),
    }
}

/// Serves `GET /big` (`bytes` bytes) and anything else as a 2-byte body, one request per
/// connection.
async fn server(bytes: u64) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let block = vec![b'x'; 256 * 1024];
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let block = block.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 2048];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let big =
                    head.starts_with(b"GET /big") || head.starts_with(b"GET http://bench.test");
                let big = big && head.windows(4).any(|w| w == b"/big");
                let length = if big { bytes } else { 2 };
                let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n");
                if stream.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                if !big {
                    let _ = stream.write_all(b"ok").await;
                    return;
                }
                let mut left = bytes;
                while left > 0 {
                    let n = usize::try_from(left.min(block.len() as u64)).unwrap_or(block.len());
                    if stream.write_all(&block[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(addr)
}

/// The proxy's Unix socket in this run.
fn unix_path() -> String {
    std::env::temp_dir()
        .join(format!("taskbox-egress-bench-{}.sock", std::process::id()))
        .display()
        .to_string()
}

fn have_curl() -> bool {
    Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// CPU seconds (user + system) this process and its waited-for children have used.
fn cpu_seconds() -> Result<(f64, f64)> {
    use nix::sys::resource::{UsageWho, getrusage};
    let secs = |usage: nix::sys::resource::Usage| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(usage.user_time()) + t(usage.system_time())
    };
    Ok((
        secs(getrusage(UsageWho::RUSAGE_SELF)?),
        secs(getrusage(UsageWho::RUSAGE_CHILDREN)?),
    ))
}

/// Downloads /big with curl (or a Rust client); returns the seconds it took.
fn download(variant: &str, server: SocketAddr, proxy: SocketAddr, bytes: u64) -> Result<f64> {
    let port = server.port();
    let url = format!("http://bench.test:{port}/big");
    let direct = format!("http://{server}/big");
    let start = Instant::now();
    if !variant.starts_with("rust-") {
        let mut cmd = Command::new("curl");
        cmd.args([
            "--silent",
            "--show-error",
            "--fail",
            "--output",
            "/dev/null",
            "--write-out",
            "%{size_download}",
        ]);
        match variant {
            "direct" => cmd.arg(&direct),
            "forward" => cmd.args(["--proxy", &format!("http://{proxy}"), &url]),
            "connect" => cmd.args(["--proxytunnel", "--proxy", &format!("http://{proxy}"), &url]),
            "socks5" => cmd.args(["--proxy", &format!("socks5h://{proxy}"), &url]),

            other => bail!("unknown variant {other}"),
        };
        for var in [
            "http_proxy",
            "HTTP_PROXY",
            "https_proxy",
            "HTTPS_PROXY",
            "all_proxy",
            "ALL_PROXY",
            "no_proxy",
            "NO_PROXY",
        ] {
            cmd.env_remove(var);
        }
        let out = cmd.output()?;
        if !out.status.success() {
            bail!("curl {variant}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let got: u64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
        if got != bytes {
            bail!("curl {variant}: {got} bytes, expected {bytes}");
        }
    } else {
        let request = b"GET /big HTTP/1.1\r\nHost: bench.test\r\n\r\n";
        let total = match variant {
            "rust-direct" => read_all(TcpStream::connect(server)?, request)?,
            "rust-connect" => read_all(tunnel(TcpStream::connect(proxy)?, port)?, request)?,
            // As from a sandbox: the client reaches the proxy's Unix socket.
            "rust-unix-connect" => {
                read_all(tunnel(UnixStream::connect(unix_path())?, port)?, request)?
            }
            _ => bail!("{variant} needs curl"),
        };
        if total < bytes {
            bail!("{variant}: {total} bytes");
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Sends `request` and reads until the end of the stream; the bytes read.
fn read_all<S: Read + Write>(mut stream: S, request: &[u8]) -> Result<u64> {
    stream.write_all(request)?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// A CONNECT tunnel through the proxy connection `stream` to bench.test:port.
fn tunnel<S: Read + Write>(mut stream: S, port: u16) -> Result<S> {
    stream.write_all(format!("CONNECT bench.test:{port} HTTP/1.1\r\n\r\n").as_bytes())?;
    let mut head = Vec::with_capacity(64);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte)? == 0 {
            bail!(
                "the proxy closed the tunnel: {}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT refused: {}", String::from_utf8_lossy(&head));
    }
    Ok(stream)
}

/// One new connection with a small request and its whole response; microseconds.
fn one_request(server: SocketAddr, proxy: Option<SocketAddr>) -> Result<f64> {
    let start = Instant::now();
    let mut stream = match proxy {
        Some(proxy) => {
            let stream = TcpStream::connect(proxy)?;
            stream.set_nodelay(true)?;
            tunnel(stream, server.port())?
        }
        None => {
            let stream = TcpStream::connect(server)?;
            stream.set_nodelay(true)?;
            stream
        }
    };
    stream.write_all(b"GET /small HTTP/1.1\r\nHost: bench.test\r\n\r\n")?;
    let mut response = Vec::with_capacity(64);
    stream.read_to_end(&mut response)?;
    if !response.ends_with(b"ok") {
        bail!("unexpected response {}", String::from_utf8_lossy(&response));
    }
    Ok(start.elapsed().as_secs_f64() * 1e6)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted
        .get(index.min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(values, 0.5)
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; nothing else is accepted.
    let bytes = env_u64("EGRESS_BENCH_BYTES", 1 << 30)?;
    let rounds = env_u64("EGRESS_BENCH_ROUNDS", 3)?.max(1);
    let conns = env_u64("EGRESS_BENCH_CONNS", 2000)?.max(10);
    let mut limits = Limits::default();
    if let Ok(buffer) = std::env::var("EGRESS_BENCH_BUFFER") {
        limits.buffer_bytes = buffer.parse().context("EGRESS_BENCH_BUFFER")?;
    }
    if let Ok(pipe) = std::env::var("EGRESS_BENCH_PIPE") {
        limits.pipe_bytes = pipe.parse().context("EGRESS_BENCH_PIPE")?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (server, proxy_addr, _proxy) = runtime.block_on(async {
        let server = server(bytes).await?;
        let hosts = BTreeMap::from([("bench.test".to_owned(), vec!["127.0.0.1".parse()?])]);
        let rules = Rules::new(
            vec!["bench.test".parse().map_err(anyhow::Error::msg)?],
            vec![],
            hosts,
        );
        let proxy = Proxy::builder(rules)
            .tag("bench")
            .limits(limits.clone())
            .build();
        let addr = proxy.listen_tcp("127.0.0.1:0".parse()?).await?;
        proxy.listen_unix(unix_path().as_ref())?;
        anyhow::Ok((server, addr, proxy))
    })?;
    let curl = have_curl();
    let mut variants: Vec<&str> = Vec::new();
    if curl {
        variants.extend(["direct", "forward", "connect", "socks5"]);
    } else {
        eprintln!("curl not found: throughput with the Rust client only");
    }
    variants.extend(["rust-direct", "rust-connect", "rust-unix-connect"]);
    println!(
        "egress proxy benchmark: {} MiB per download, {rounds} rounds, {conns} connections, {}, client {}",
        bytes >> 20,
        if limits.pipe_bytes > 0 {
            format!("splice with {} KiB pipes", limits.pipe_bytes >> 10)
        } else {
            format!("copy through {} KiB buffers", limits.buffer_bytes >> 10)
        },
        if curl { "curl" } else { "rust" }
    );
    let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    // CPU seconds of this process (server + proxy) and of curl, per variant, summed over rounds.
    let mut cpu: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for round in 0..rounds {
        let order: Vec<&str> = if round % 2 == 0 {
            variants.clone()
        } else {
            variants.iter().rev().copied().collect()
        };
        for variant in order {
            let before = cpu_seconds()?;
            let seconds = download(variant, server, proxy_addr, bytes)?;
            let after = cpu_seconds()?;
            times.entry(variant).or_default().push(seconds);
            let entry = cpu.entry(variant).or_default();
            entry.0 += after.0 - before.0;
            entry.1 += after.1 - before.1;
        }
    }
    let mib = bytes as f64 / f64::from(1 << 20);
    println!();
    println!(
        "| download ({} MiB) | median time | throughput | vs direct: median of per-round ratios | best time | vs direct: best | CPU s/GiB: server+proxy | client |",
        bytes >> 20
    );
    println!("|---|---|---|---|---|---|---|---|");
    let gib = bytes as f64 / f64::from(1 << 30) * rounds as f64;
    for variant in &variants {
        let base = if variant.starts_with("rust-") {
            "rust-direct"
        } else {
            "direct"
        };
        let own_times = times.get(variant).cloned().context("missing runs")?;
        let base_times = times.get(base).cloned().context("missing direct runs")?;
        // Each round's ratio to the direct download of the same round: noise that hits a whole
        // round cancels out.
        let mut ratios: Vec<f64> = own_times
            .iter()
            .zip(&base_times)
            .map(|(t, d)| d / t)
            .collect();
        let best = own_times.iter().copied().fold(f64::INFINITY, f64::min);
        let best_base = base_times.iter().copied().fold(f64::INFINITY, f64::min);
        let t = median(&mut own_times.clone());
        let (own, child) = cpu.get(variant).copied().unwrap_or_default();
        println!(
            "| {variant} | {t:.3} s | {:.0} MiB/s | {:.2}x | {best:.3} s | {:.2}x | {:.2} | {:.2} |",
            mib / t,
            median(&mut ratios),
            best_base / best,
            own / gib,
            child / gib
        );
    }

    let mut direct_us = Vec::new();
    let mut proxied_us = Vec::new();
    for _ in 0..50 {
        one_request(server, None)?;
        one_request(server, Some(proxy_addr))?;
    }
    for i in 0..conns {
        if i % 2 == 0 {
            direct_us.push(one_request(server, None)?);
            proxied_us.push(one_request(server, Some(proxy_addr))?);
        } else {
            proxied_us.push(one_request(server, Some(proxy_addr))?);
            direct_us.push(one_request(server, None)?);
        }
    }
    direct_us.sort_by(f64::total_cmp);
    proxied_us.sort_by(f64::total_cmp);
    println!();
    println!("| new connection + small request | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| direct | {:.0} µs | {:.0} µs |",
        percentile(&direct_us, 0.5),
        percentile(&direct_us, 0.99)
    );
    println!(
        "| through CONNECT | {:.0} µs | {:.0} µs |",
        percentile(&proxied_us, 0.5),
        percentile(&proxied_us, 0.99)
    );
    println!(
        "| added by the proxy | {:.0} µs | |",
        percentile(&proxied_us, 0.5) - percentile(&direct_us, 0.5)
    );
    runtime.block_on(_proxy.shutdown());
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
