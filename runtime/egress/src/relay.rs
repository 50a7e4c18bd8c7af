//! Moving bytes both ways between a client and its destination: metered, with an idle timeout,
//! and zero-copy with splice(2) where the kernel allows (else through a buffer).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::http;
use crate::splice::{self, Pipe, Socket};

/// Byte counts and the time of the last transfer of one connection.
#[derive(Debug)]
pub(crate) struct Meter {
    start: Instant,
    pub(crate) up: AtomicU64,
    pub(crate) down: AtomicU64,
    /// Milliseconds after `start` of the last transfer either way.
    last: AtomicU64,
}

impl Meter {
    pub(crate) fn new() -> Meter {
        Meter {
            start: Instant::now(),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            last: AtomicU64::new(0),
        }
    }

    pub(crate) fn add(&self, counter: &AtomicU64, bytes: usize) {
        counter.fetch_add(bytes as u64, Ordering::Relaxed);
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        let now = self.start.elapsed();
        now.saturating_sub(Duration::from_millis(self.last.load(Ordering::Relaxed)))
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// How the destination's bytes reach the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Down {
    /// Unchanged (CONNECT and SOCKS tunnels).
    Raw,
    /// The first response head is rewritten (hop-by-hop headers out, `Connection: close` in),
    /// the rest unchanged (forwarded HTTP).
    HttpResponse { max_head: usize },
}

/// How a relay copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    /// Pipe size for splice; 0: never splice.
    pub(crate) pipe_bytes: usize,
    /// Buffer per direction when copying through memory.
    pub(crate) buffer_bytes: usize,
}

/// Why a relay ended early.
#[derive(Debug)]
pub(crate) enum RelayEnd {
    Idle(Duration),
    Shutdown,
    Io(io::Error),
}

impl std::fmt::Display for RelayEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayEnd::Idle(after) => write!(f, "idle for {}s", after.as_secs()),
            RelayEnd::Shutdown => f.write_str("proxy shut down"),
            RelayEnd::Io(err) => write!(f, "{err}"),
        }
    }
}

/// Sends `prefix` then everything the client writes to `upstream`, and everything `upstream`
/// writes to the client, until both sides have closed, one fails, nothing moves for `idle`, or
/// `cancel` fires. A side's end of stream is passed on as a write shutdown of the other.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn relay<C: Socket>(
    client: &C,
    upstream: &TcpStream,
    prefix: &[u8],
    down_mode: Down,
    copy: Copy,
    idle: Duration,
    meter: &Meter,
    cancel: &CancellationToken,
) -> Result<(), RelayEnd> {
    let up = async {
        if !prefix.is_empty() {
            splice::write_all(upstream, prefix).await?;
            meter.add(&meter.up, prefix.len());
        }
        pump(client, upstream, &meter.up, meter, copy).await
    };
    let down = async {
        if let Down::HttpResponse { max_head } = down_mode {
            http::relay_response_head(upstream, client, max_head, meter).await?;
        }
        pump(upstream, client, &meter.down, meter, copy).await
    };
    let both = async { tokio::try_join!(up, down).map(|_| ()) };
    let watchdog = async {
        loop {
            let quiet = meter.idle_for();
            if quiet >= idle {
                return quiet;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    };
    tokio::select! {
        result = both => result.map_err(RelayEnd::Io),
        quiet = watchdog => Err(RelayEnd::Idle(quiet)),
        () = cancel.cancelled() => Err(RelayEnd::Shutdown),
    }
}

/// One direction, until `from` ends (then `to` is shut down for writing) or fails.
async fn pump<R: Socket, W: Socket>(
    from: &R,
    to: &W,
    counter: &AtomicU64,
    meter: &Meter,
    copy: Copy,
) -> io::Result<()> {
    if copy.pipe_bytes > 0 {
        // Out of descriptors or an unsplicable socket: fall back to copying.
        if let Ok(pipe) = Pipe::new(copy.pipe_bytes) {
            match splice_pump(&pipe, from, to, counter, meter).await {
                Err(err) if splice::unsupported(&err) => {}
                result => return result,
            }
        }
    }
    let mut buf = vec![0u8; copy.buffer_bytes.max(1)];
    loop {
        let n = splice::read(from, &mut buf).await?;
        if n == 0 {
            splice::shutdown_write(to);
            return Ok(());
        }
        splice::write_all(to, &buf[..n]).await?;
        meter.add(counter, n);
    }
}

async fn splice_pump<R: Socket, W: Socket>(
    pipe: &Pipe,
    from: &R,
    to: &W,
    counter: &AtomicU64,
    meter: &Meter,
) -> io::Result<()> {
    let mut moved = false;
    loop {
        let step = async {
            let n = pipe.fill(from).await?;
            if n > 0 {
                pipe.drain(to, n).await?;
            }
            io::Result::Ok(n)
        };
        match step.await {
            Ok(0) => {
                splice::shutdown_write(to);
                return Ok(());
            }
            Ok(n) => {
                moved = true;
                meter.add(counter, n);
            }
            // Bytes may be in the pipe: too late to fall back to copying.
            Err(err) if moved && splice::unsupported(&err) => return Err(io::Error::other(err)),
            Err(err) => return Err(err),
        }
    }
}
