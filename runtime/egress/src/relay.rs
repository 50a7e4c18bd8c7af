//! Copying bytes both ways between a client and its destination, metered, with an idle timeout.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::http;

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

    fn touch(&self) {
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
pub(crate) async fn relay<C>(
    client: C,
    upstream: TcpStream,
    prefix: &[u8],
    down_mode: Down,
    buffer: usize,
    idle: Duration,
    meter: &Meter,
    cancel: &CancellationToken,
) -> Result<(), RelayEnd>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut up_read, mut up_write) = upstream.into_split();
    let up = async {
        if !prefix.is_empty() {
            up_write.write_all(prefix).await?;
            meter.up.fetch_add(prefix.len() as u64, Ordering::Relaxed);
            meter.touch();
        }
        pump(&mut client_read, &mut up_write, &meter.up, meter, buffer).await
    };
    let down = async {
        if let Down::HttpResponse { max_head } = down_mode {
            let mut counted = CountingWriter {
                inner: &mut client_write,
                meter,
            };
            http::relay_response_head(&mut up_read, &mut counted, max_head).await?;
        }
        pump(&mut up_read, &mut client_write, &meter.down, meter, buffer).await
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

async fn pump<R, W>(
    reader: &mut R,
    writer: &mut W,
    counter: &AtomicU64,
    meter: &Meter,
    buffer: usize,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; buffer];
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            // The peer may be gone already; its end of stream is passed on best-effort.
            let _ = writer.shutdown().await;
            return Ok(());
        }
        writer.write_all(&buf[..n]).await?;
        counter.fetch_add(n as u64, Ordering::Relaxed);
        meter.touch();
    }
}

/// Writes through to `inner`, counting the bytes as going down.
pub(crate) struct CountingWriter<'a, W> {
    inner: &'a mut W,
    meter: &'a Meter,
}

impl<W: AsyncWrite + Unpin> CountingWriter<'_, W> {
    pub(crate) async fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_all(bytes).await?;
        self.meter
            .down
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.meter.touch();
        Ok(())
    }
}
