//! `taskbox-bench egress-hop`: what the proxy's second loopback hop costs, and why the proxy does
//! not skip it with in-kernel redirection.
//!
//! Three threads in one process, as in the egress figure without the sandbox and curl: a server
//! writes `--bytes` on a TCP connection to the relay's upstream socket; a client reads them
//! (100 KiB reads, as a download client does) from its own TCP connection to the relay. Each
//! round times, in turn:
//! - `direct`: the client reads straight from the server's connection (one hop);
//! - `relay`: the relay moves the bytes upstream socket -> pipe -> client socket with splice(2),
//!   as the proxy does (two hops);
//! - `sockmap`: the same relay, but both ends of the client's hop are in a `sockmap` whose
//!   `sk_msg` verdict program redirects what the relay sends into the client socket's receive
//!   queue (`BPF_F_INGRESS`), so the second hop skips TCP. Needs CAP_BPF and CAP_NET_ADMIN.
//!
//! Then the safety check that decides it: a client that does not read for a second, through the
//! relay and through the redirect, and how many bytes the relay could push in that second (with
//! TCP, the socket buffers bound it; the redirect has no such bound on the kernels measured).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::stats;

#[derive(Args)]
pub struct HopArgs {
    /// Bytes per transfer.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Seconds the non-reading client waits in the safety check.
    #[arg(long, default_value_t = 1.0)]
    stall_secs: f64,
}

/// How the relay's side reaches the client.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Direct,
    Relay,
    Sockmap,
}

pub fn run(a: &HopArgs) -> Result<()> {
    let sockmap = Redirect::new();
    if let Err(err) = &sockmap {
        eprintln!(
            "egress-hop: no sockmap redirect here ({err:#}); measuring direct and relay only"
        );
    }
    let sockmap = sockmap.ok();
    let modes: Vec<Mode> = if sockmap.is_some() {
        vec![Mode::Direct, Mode::Relay, Mode::Sockmap]
    } else {
        vec![Mode::Direct, Mode::Relay]
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..a.rounds {
        // Alternate the order: whoever goes first meets a different machine.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..modes.len()).collect()
        } else {
            (0..modes.len()).rev().collect()
        };
        let mut line = Vec::new();
        for i in order {
            let secs = transfer(modes[i], a.bytes, sockmap.as_ref())?;
            times[i].push(secs);
            line.push(format!("{:?} {secs:.3} s", modes[i]));
        }
        eprintln!("egress-hop: round {}: {}", round + 1, line.join(", "));
    }
    let direct = &times[0];
    let rows: Vec<Value> = modes
        .iter()
        .zip(&times)
        .map(|(mode, t)| {
            let ratios: Vec<f64> = direct.iter().zip(t).map(|(d, x)| d / x).collect();
            json!({
                "mode": format!("{mode:?}").to_lowercase(),
                "median_s": stats::median(t),
                "best_s": t.iter().copied().fold(f64::INFINITY, f64::min),
                "vs_direct_median_of_rounds": stats::median(&ratios),
                "vs_direct_min": ratios.iter().copied().fold(f64::INFINITY, f64::min),
                "vs_direct_max": ratios.iter().copied().fold(0.0, f64::max),
                "secs": t,
            })
        })
        .collect();
    let mut stall = vec![json!({
        "mode": "relay",
        "pushed_bytes": stalled_push(Mode::Relay, a.bytes, a.stall_secs, None)?,
    })];
    if let Some(redirect) = &sockmap {
        stall.push(json!({
            "mode": "sockmap",
            "pushed_bytes": stalled_push(Mode::Sockmap, a.bytes, a.stall_secs, Some(redirect))?,
        }));
    }
    let out = json!({
        "bytes": a.bytes,
        "rounds": a.rounds,
        "transfer": rows,
        "stalled_client": {"secs": a.stall_secs, "runs": stall},
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Both ends of a fresh TCP connection on loopback: (the connecting one, the accepted one), with
/// `cubic`, as the proxy gives its loopback clients.
fn tcp_pair() -> Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let near = TcpStream::connect(listener.local_addr()?)?;
    let (far, _) = listener.accept()?;
    for s in [&near, &far] {
        let cc = b"cubic";
        // SAFETY: a valid socket and a buffer of the given length.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                cc.as_ptr().cast(),
                cc.len() as libc::socklen_t,
            );
        }
    }
    Ok((near, far))
}

/// Writes `bytes` to `out`, then ends the stream; stops quietly when the reader is gone.
fn serve(mut out: TcpStream, bytes: u64) {
    let buf = vec![b'x'; 128 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        match out.write(&buf[..n]) {
            Ok(0) | Err(_) => return,
            Ok(n) => left -= n as u64,
        }
    }
    let _ = out.shutdown(std::net::Shutdown::Write);
}

/// Moves everything from `from` to `to` through a 1 MiB pipe with splice(2), counting into
/// `pushed`, then ends `to`'s stream. Errors end it (the safety check cuts the client off).
fn relay(from: &TcpStream, to: &TcpStream, pushed: &AtomicU64) -> io::Result<()> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two descriptors we now own.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: a valid pipe descriptor.
    unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    loop {
        let n = splice(from.as_raw_fd(), write.as_raw_fd(), 1 << 20)?;
        if n == 0 {
            let _ = to.shutdown(std::net::Shutdown::Write);
            return Ok(());
        }
        let mut left = n;
        while left > 0 {
            let m = splice(read.as_raw_fd(), to.as_raw_fd(), left)?;
            if m == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= m;
            pushed.fetch_add(m as u64, Ordering::Relaxed);
        }
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain descriptors, no offsets.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Reads `from` to its end in 100 KiB reads; returns the byte count. A socket under a sockmap
/// may answer a blocking read with EAGAIN (as non-blocking clients see anyway): wait and retry.
fn drain(mut from: &TcpStream) -> Result<u64> {
    let mut buf = vec![0u8; 100 * 1024];
    let mut got = 0u64;
    loop {
        match from.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got += n as u64,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                let mut pfd = libc::pollfd {
                    fd: from.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, 1000) };
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err).context("reading the download"),
        }
    }
}

/// A relay at work: the server writing, the relay moving its bytes towards the client.
struct Running {
    /// The client's socket, for the caller to read (or not).
    client: TcpStream,
    /// Other handles on the server's and the relay's upstream sockets, to cut them off.
    server: TcpStream,
    upstream: TcpStream,
    /// Bytes the relay has pushed towards the client.
    pushed: Arc<AtomicU64>,
    writer: std::thread::JoinHandle<()>,
    relayer: std::thread::JoinHandle<io::Result<()>>,
    /// The sockmap of the client's hop (`Mode::Sockmap`), kept while the relay runs.
    _map: Option<Pair>,
}

impl Running {
    /// Connects server, relay and client for `mode` and starts the server and the relay.
    fn start(mode: Mode, bytes: u64, redirect: Option<&Redirect>) -> Result<Running> {
        let (upstream, server) = tcp_pair()?;
        let (client, near) = tcp_pair()?;
        let map = match (mode, redirect) {
            (Mode::Sockmap, Some(r)) => Some(r.pair(&client, &near)?),
            (Mode::Sockmap, None) => bail!("no sockmap redirect"),
            _ => None,
        };
        let pushed = Arc::new(AtomicU64::new(0));
        let (server_end, upstream_end) = (server.try_clone()?, upstream.try_clone()?);
        let writer = std::thread::spawn(move || serve(server, bytes));
        let relay_pushed = pushed.clone();
        let relayer = std::thread::spawn(move || relay(&upstream, &near, &relay_pushed));
        Ok(Running {
            client,
            server: server_end,
            upstream: upstream_end,
            pushed,
            writer,
            relayer,
            _map: map,
        })
    }

    /// Cuts every connection off (the relay and the server fail out of blocked calls; after a
    /// complete transfer there are none) and waits for both threads; the relay's outcome.
    fn finish(self) -> io::Result<()> {
        let Running {
            client,
            server,
            upstream,
            writer,
            relayer,
            ..
        } = self;
        for s in [&upstream, &server] {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Closed with unread data, the client's socket resets the connection: a relay blocked
        // on its full window fails out (a shutdown would leave it waiting).
        drop(client);
        writer.join().ok();
        relayer
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the relay panicked")))
    }
}

/// Seconds for the client to receive `bytes` from the server in `mode`.
fn transfer(mode: Mode, bytes: u64, redirect: Option<&Redirect>) -> Result<f64> {
    let start = Instant::now();
    if mode == Mode::Direct {
        let (client, server) = tcp_pair()?;
        let writer = std::thread::spawn(move || serve(server, bytes));
        let got = drain(&client)?;
        let secs = start.elapsed().as_secs_f64();
        writer.join().ok();
        anyhow::ensure!(got == bytes, "direct: {got} of {bytes} bytes arrived");
        return Ok(secs);
    }
    let run = Running::start(mode, bytes, redirect)?;
    let got = drain(&run.client);
    let secs = start.elapsed().as_secs_f64();
    let relayed = run.finish();
    let got = got?;
    relayed.with_context(|| format!("{mode:?}: relaying"))?;
    anyhow::ensure!(got == bytes, "{mode:?}: {got} of {bytes} bytes arrived");
    Ok(secs)
}

/// Bytes the relay pushes towards a client that reads nothing for `stall_secs`.
fn stalled_push(
    mode: Mode,
    bytes: u64,
    stall_secs: f64,
    redirect: Option<&Redirect>,
) -> Result<u64> {
    let run = Running::start(mode, bytes, redirect)?;
    std::thread::sleep(Duration::from_secs_f64(stall_secs));
    let queued = run.pushed.load(Ordering::Relaxed);
    let _ = run.finish();
    Ok(queued)
}

/// In-kernel redirection of a relay's sends: for each pair, a `sockmap` holding the client's
/// socket (entry 0) and the relay's side (entry 1), and an `sk_msg` verdict program attached to
/// it that puts every message sent on a socket of the map into entry 0's receive queue.
struct Redirect;

/// What keeps one pair's redirection alive.
struct Pair {
    _map: OwnedFd,
    _prog: OwnedFd,
}

const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_MAP_TYPE_SOCKMAP: u32 = 15;
const BPF_PROG_TYPE_SK_MSG: u32 = 16;
const BPF_SK_MSG_VERDICT: u32 = 7;
const BPF_FUNC_MSG_REDIRECT_MAP: i32 = 60;
const BPF_F_INGRESS: i32 = 1;
const BPF_PSEUDO_MAP_FD: u8 = 1;

/// One eBPF instruction.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    /// dst in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off: 0,
        imm,
    }
}

/// `union bpf_attr`, as raw words: each command fills the fields it reads.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }
    fn u32(mut self, at: usize, v: u32) -> Attr {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, at: usize, v: u64) -> Attr {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
}

fn bpf(cmd: libc::c_int, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: attr is a zero-padded bpf_attr of the size passed.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd_of(r: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this new descriptor.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

impl Redirect {
    /// Whether this process may redirect (loads a program against a map, then drops both).
    fn new() -> Result<Redirect> {
        let map = Self::map()?;
        Self::program(&map)?;
        Ok(Redirect)
    }

    fn map() -> Result<OwnedFd> {
        let mut attr = Attr::new()
            .u32(0, BPF_MAP_TYPE_SOCKMAP)
            .u32(4, 4)
            .u32(8, 4)
            .u32(12, 2);
        Ok(fd_of(
            bpf(BPF_MAP_CREATE, &mut attr).context("creating a sockmap")?,
        ))
    }

    /// The verdict program, redirecting to entry 0 of `map` (the map is part of the code).
    fn program(map: &OwnedFd) -> Result<OwnedFd> {
        let code = [
            // r2 = the map (a 64-bit immediate over two slots)
            insn(0x18, 2, BPF_PSEUDO_MAP_FD, map.as_raw_fd()),
            insn(0, 0, 0, 0),
            insn(0xb7, 3, 0, 0),             // r3 = key 0
            insn(0xb7, 4, 0, BPF_F_INGRESS), // r4 = into the receive queue
            insn(0x85, 0, 0, BPF_FUNC_MSG_REDIRECT_MAP),
            insn(0x95, 0, 0, 0), // return the helper's verdict
        ];
        let license = c"GPL";
        let mut log = vec![0u8; 16 * 1024];
        let mut attr = Attr::new()
            .u32(0, BPF_PROG_TYPE_SK_MSG)
            .u32(4, code.len() as u32)
            .u64(8, code.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1)
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64);
        let prog = bpf(BPF_PROG_LOAD, &mut attr).map_err(|err| {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            anyhow::anyhow!(
                "loading the sk_msg program: {err}: {}",
                String::from_utf8_lossy(&log[..end]).trim()
            )
        })?;
        Ok(fd_of(prog))
    }

    /// Redirects what `near` sends into `client`'s receive queue, while the result lives.
    fn pair(&self, client: &TcpStream, near: &TcpStream) -> Result<Pair> {
        let map = Self::map()?;
        let prog = Self::program(&map)?;
        let mut attr = Attr::new()
            .u32(0, map.as_raw_fd() as u32)
            .u32(4, prog.as_raw_fd() as u32)
            .u32(8, BPF_SK_MSG_VERDICT);
        bpf(BPF_PROG_ATTACH, &mut attr).context("attaching the sk_msg program")?;
        for (key, sock) in [(0u32, client), (1u32, near)] {
            let fd = sock.as_raw_fd() as u32;
            let mut attr = Attr::new()
                .u32(0, map.as_raw_fd() as u32)
                .u64(8, &key as *const u32 as u64)
                .u64(16, &fd as *const u32 as u64);
            bpf(BPF_MAP_UPDATE_ELEM, &mut attr).context("adding a socket to the sockmap")?;
        }
        Ok(Pair {
            _map: map,
            _prog: prog,
        })
    }
}
