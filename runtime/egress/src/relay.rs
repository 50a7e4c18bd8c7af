//! Moving bytes both ways between a client and its destination: metered, with an idle timeout,
//! and zero-copy with splice(2) where the kernel allows (else through a buffer).

use std::io;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::http;
pub(crate) use crate::meter::Meter;
use crate::splice::{self, Pipe, Socket};

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
        if let Ok(mut pipe) = Pipe::new(copy.pipe_bytes) {
            match splice_pump(&mut pipe, from, to, counter, meter).await {
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

/// Relays through `pipe`, which starts small (a request, a TLS handshake) and grows while the
/// direction keeps it full: a bulk transfer then moves up to `pipe_bytes` per pair of splice
/// calls, and other connections pin no more than the default per direction.
async fn splice_pump<R: Socket, W: Socket>(
    pipe: &mut Pipe,
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
                // The source had at least a pipeful: more was probably waiting.
                if n >= pipe.size() {
                    pipe.grow();
                }
            }
            // Bytes may be in the pipe: too late to fall back to copying.
            Err(err) if moved && splice::unsupported(&err) => return Err(io::Error::other(err)),
            Err(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// Both ends of a TCP connection on loopback: (the one that connected, the accepted one).
    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (near, far) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (near.unwrap(), far.unwrap().0)
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        let mut seed = seed;
        (0..len)
            .map(|_| {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (seed >> 16) as u8
            })
            .collect()
    }

    /// A relay between a client and a server on loopback, as the proxy runs it.
    struct Relayed {
        /// The client's end (the far side of the proxy's client socket).
        client: TcpStream,
        /// The server's end (the far side of the proxy's upstream socket).
        server: TcpStream,
        meter: Arc<Meter>,
        relay: tokio::task::JoinHandle<Result<(), RelayEnd>>,
    }

    async fn relayed(prefix: &[u8], pipe_bytes: usize) -> Relayed {
        let (client, proxy_client) = tcp_pair().await;
        let (proxy_upstream, server) = tcp_pair().await;
        let meter = Arc::new(Meter::new());
        let copy = Copy {
            pipe_bytes,
            buffer_bytes: 16 * 1024,
        };
        let prefix = prefix.to_vec();
        let relay_meter = meter.clone();
        let relay = tokio::spawn(async move {
            relay(
                &proxy_client,
                &proxy_upstream,
                &prefix,
                Down::Raw,
                copy,
                Duration::from_secs(30),
                &relay_meter,
                &CancellationToken::new(),
            )
            .await
        });
        Relayed {
            client,
            server,
            meter,
            relay,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_transfers_both_ways_are_intact_and_counted_exactly() {
        let down = pattern(48 << 20, 1);
        let up = pattern((3 << 20) + 17, 2);
        for pipe_bytes in [1 << 20, 64 * 1024, 0] {
            let Relayed {
                mut client,
                mut server,
                meter,
                relay,
            } = relayed(b"prefix:", pipe_bytes).await;
            let (down_w, up_w) = (down.clone(), up.clone());
            let server_side = tokio::spawn(async move {
                let (mut read, mut write) = server.split();
                let mut got = Vec::new();
                let (r, w) = tokio::join!(read.read_to_end(&mut got), async {
                    write.write_all(&down_w).await?;
                    write.shutdown().await
                });
                r.unwrap();
                w.unwrap();
                got
            });
            let (mut read, mut write) = client.split();
            let mut got = Vec::new();
            let (r, w) = tokio::join!(read.read_to_end(&mut got), async {
                write.write_all(&up_w).await?;
                write.shutdown().await
            });
            r.unwrap();
            w.unwrap();
            let server_got = server_side.await.unwrap();
            relay.await.unwrap().unwrap();
            assert!(got == down, "pipe {pipe_bytes}: the download differs");
            assert_eq!(&server_got[..7], b"prefix:");
            assert!(
                server_got[7..] == up[..],
                "pipe {pipe_bytes}: upload differs"
            );
            assert_eq!(meter.down.load(Ordering::Relaxed), down.len() as u64);
            assert_eq!(meter.up.load(Ordering::Relaxed), 7 + up.len() as u64);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_half_close_is_passed_on_and_the_other_way_keeps_going() {
        for pipe_bytes in [1 << 20, 0] {
            let Relayed {
                mut client,
                mut server,
                meter,
                relay,
            } = relayed(b"", pipe_bytes).await;
            // The client sends its request and ends its side; the server sees the end of
            // stream, and only then answers, at length.
            client.write_all(b"request").await.unwrap();
            client.shutdown().await.unwrap();
            let mut request = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), server.read_to_end(&mut request))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(request, b"request");
            let answer = pattern(5 << 20, 3);
            server.write_all(&answer).await.unwrap();
            server.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            assert!(got == answer, "pipe {pipe_bytes}: the answer differs");
            relay.await.unwrap().unwrap();
            assert_eq!(meter.up.load(Ordering::Relaxed), 7);
            assert_eq!(meter.down.load(Ordering::Relaxed), answer.len() as u64);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_reader_gets_every_byte() {
        let data = pattern(12 << 20, 4);
        let Relayed {
            mut client,
            mut server,
            meter,
            relay,
        } = relayed(b"", 1 << 20).await;
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            server.write_all(&sent).await.unwrap();
            server.shutdown().await.unwrap();
            // Keep the server's end open until the client has read everything.
            let mut rest = Vec::new();
            server.read_to_end(&mut rest).await.unwrap();
        });
        // Small reads with pauses: the proxy's writes block on a full socket again and again.
        let mut got = Vec::new();
        let mut buf = vec![0u8; 7 * 1024];
        let mut reads = 0u32;
        loop {
            let n = client.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            reads += 1;
            if reads.is_multiple_of(64) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        client.shutdown().await.unwrap();
        writer.await.unwrap();
        relay.await.unwrap().unwrap();
        assert!(
            got == data,
            "the data differs ({} bytes of {})",
            got.len(),
            data.len()
        );
        assert_eq!(meter.down.load(Ordering::Relaxed), data.len() as u64);
    }
}
