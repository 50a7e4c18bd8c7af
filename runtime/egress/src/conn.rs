//! One client connection: sniff the protocol, read the request, decide, connect, relay.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use taskbox_core::netpattern::Host;
use taskbox_core::support::now_ms;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::event::{ConnectionEnd, Decision, Outcome, Protocol};
use crate::relay::{Copy, Down, Meter, relay};
use crate::rules::{Verdict, decide};
use crate::splice::Socket;
use crate::{Shared, http, socks};

/// Serves one client until its connection ends.
pub(crate) async fn serve<S>(shared: Arc<Shared>, id: u64, client: String, mut stream: S)
where
    S: AsyncRead + AsyncWrite + Socket + Unpin + 'static,
{
    let limits = &shared.limits;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let request = match timeout(
        limits.handshake_timeout,
        handshake(&shared, &mut stream, &mut buf),
    )
    .await
    {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return,
        Ok(Err(err)) => {
            tracing::debug!(id, %client, error = %err, "egress handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(id, %client, "egress handshake timed out");
            if buf.first().is_some_and(|b| *b != 0x05 && *b != 0x04) {
                let body = format!(
                    "no complete request within {}s",
                    limits.handshake_timeout.as_secs()
                );
                let _ = stream
                    .write_all(&http::response(408, "Request Timeout", &body))
                    .await;
            }
            return;
        }
    };
    let Target {
        protocol,
        host,
        port,
        head,
        raw,
    } = request;
    let mut decision = Decision {
        id,
        time_ms: 0,
        tag: shared.tag.clone(),
        client,
        protocol,
        host: match &host {
            Ok(host) => host.to_string(),
            Err((text, _)) => text.clone(),
        },
        port,
        ip: None,
        addresses: Vec::new(),
        outcome: Outcome::Denied,
        rule: None,
        reason: None,
        hint: None,
        end: None,
        inspected: false,
        request: None,
    };
    let name = match &host {
        Ok(Host::Name(name)) => Some(name.clone()),
        _ => None,
    };
    let upstream = match host {
        Ok(host) => open(&shared, &host, port, &mut decision).await,
        Err((_, why)) => {
            decision.reason = Some(why);
            Err(Failure::Denied)
        }
    };
    // A host with secrets or request rules: its HTTP is read, request by request; its
    // decision is told once the upstream's TLS is known.
    let inspection = match (&upstream, &name, &shared.inspection) {
        (Ok(_), Some(name), Some(inspection)) if inspection.covers(name, port) => {
            Some(inspection.clone())
        }
        _ => None,
    };
    decision.inspected = inspection.is_some();
    if inspection.is_none() {
        decision.time_ms = now_ms();
        shared.emit(&decision);
    }
    let upstream = match upstream {
        Ok(upstream) => upstream,
        Err(failure) => {
            let reply = match protocol {
                Protocol::Socks5 => socks::reply(failure.socks_code()).to_vec(),
                Protocol::Connect | Protocol::Forward => {
                    let (code, reason) = failure.http_status();
                    http::response(code, reason, &decision.message())
                }
            };
            let _ = stream.write_all(&reply).await;
            let _ = stream.shutdown().await;
            return;
        }
    };
    let reply: Vec<u8> = match protocol {
        Protocol::Socks5 => socks::reply(socks::SUCCEEDED).to_vec(),
        Protocol::Connect => b"HTTP/1.1 200 Connection established\r\n\r\n".to_vec(),
        Protocol::Forward => Vec::new(),
    };
    if let Some(inspection) = inspection {
        if !reply.is_empty() && stream.write_all(&reply).await.is_err() {
            decision.time_ms = now_ms();
            shared.emit(&decision);
            return;
        }
        // A forwarded request's own head goes first, as the client sent it.
        let mut prefix = raw;
        prefix.extend_from_slice(&buf);
        crate::inspect::serve(shared, inspection, decision, stream, prefix, upstream).await;
        return;
    }
    let meter = Meter::new();
    let mut result = Ok(());
    if !reply.is_empty() {
        result = stream
            .write_all(&reply)
            .await
            .map_err(crate::relay::RelayEnd::Io);
    }
    if result.is_ok() {
        // What the client sent after its request goes first: a forwarded request's body, or
        // the start of a tunnelled protocol from a client that did not wait for the reply.
        let mut prefix = head;
        prefix.extend_from_slice(&buf);
        let down = match protocol {
            Protocol::Forward => Down::HttpResponse {
                max_head: limits.max_header_bytes,
            },
            Protocol::Connect | Protocol::Socks5 => Down::Raw,
        };
        let copy = Copy {
            pipe_bytes: limits.pipe_bytes,
            buffer_bytes: limits.buffer_bytes,
        };
        result = relay(
            &stream,
            &upstream,
            &prefix,
            down,
            copy,
            limits.idle_timeout,
            &meter,
            &shared.cancel,
        )
        .await;
    }
    decision.time_ms = now_ms();
    decision.end = Some(ConnectionEnd {
        bytes_up: meter.up.load(Ordering::Relaxed),
        bytes_down: meter.down.load(Ordering::Relaxed),
        duration_ms: u64::try_from(meter.elapsed().as_millis()).unwrap_or(u64::MAX),
        error: result.err().map(|end| end.to_string()),
    });
    shared.emit(&decision);
}

/// What a client asked for.
struct Target {
    protocol: Protocol,
    /// The parsed host, or the text sent and why it is not a host.
    host: Result<Host, (String, String)>,
    port: u16,
    /// For a forwarded request: the rewritten head to send first.
    head: Vec<u8>,
    /// For a forwarded request: its head as the client sent it (what an inspected host's
    /// connection parses itself).
    raw: Vec<u8>,
}

/// Reads the request. `Ok(None)`: the client was answered (refused) or went away; `buf` keeps
/// the bytes read past the request.
async fn handshake<S>(
    shared: &Shared,
    stream: &mut S,
    buf: &mut Vec<u8>,
) -> io::Result<Option<Target>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if read_more(stream, buf, 1).await? == 0 {
        return Ok(None);
    }
    match buf[0] {
        0x05 => socks_handshake(stream, buf).await,
        0x04 => {
            stream.write_all(&socks::SOCKS4_REJECTED).await?;
            Ok(None)
        }
        _ => http_handshake(shared, stream, buf).await,
    }
}

async fn http_handshake<S>(
    shared: &Shared,
    stream: &mut S,
    buf: &mut Vec<u8>,
) -> io::Result<Option<Target>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let max = shared.limits.max_header_bytes;
    loop {
        let parsed = http::parse_request(&buf[..buf.len().min(max)]);
        match parsed {
            Ok(Some((request, len))) => {
                let raw: Vec<u8> = buf.drain(..len).collect();
                let (protocol, host, port, head, raw) = match request {
                    http::Request::Connect { host, port } => {
                        (Protocol::Connect, host, port, Vec::new(), Vec::new())
                    }
                    http::Request::Forward { host, port, head } => {
                        (Protocol::Forward, host, port, head, raw)
                    }
                };
                return Ok(Some(Target {
                    protocol,
                    host: Host::parse(&host).map_err(|why| (host.clone(), why)),
                    port,
                    head,
                    raw,
                }));
            }
            Ok(None) if buf.len() >= max => {
                let why = http::BadRequest::TooLarge(format!(
                    "the request head is larger than {max} bytes"
                ));
                let (code, reason) = why.status();
                stream
                    .write_all(&http::response(code, reason, why.message()))
                    .await?;
                return Ok(None);
            }
            Ok(None) => {
                if read_more(stream, buf, max).await? == 0 {
                    return Ok(None);
                }
            }
            Err(why) => {
                let (code, reason) = why.status();
                stream
                    .write_all(&http::response(code, reason, why.message()))
                    .await?;
                return Ok(None);
            }
        }
    }
}

async fn socks_handshake<S>(stream: &mut S, buf: &mut Vec<u8>) -> io::Result<Option<Target>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // At most 2 + 255 bytes of greeting and 4 + 1 + 255 + 2 of request.
    const MAX: usize = 1024;
    let greeting = loop {
        if let Some(len) = socks::greeting_len(buf) {
            break buf.drain(..len).collect::<Vec<u8>>();
        }
        if read_more(stream, buf, MAX).await? == 0 {
            return Ok(None);
        }
    };
    if !socks::offers_no_auth(&greeting) {
        stream.write_all(&socks::NO_ACCEPTABLE_METHOD).await?;
        return Ok(None);
    }
    stream.write_all(&socks::METHOD_SELECTED).await?;
    loop {
        if let Some((request, len)) = socks::parse_request(buf) {
            buf.drain(..len.min(buf.len()));
            return match request {
                socks::Request::Connect { host, port } => Ok(Some(Target {
                    protocol: Protocol::Socks5,
                    host: match host {
                        Ok(text) => Host::parse(&text).map_err(|why| (text, why)),
                        Err(why) => Err(("(invalid)".to_owned(), why)),
                    },
                    port,
                    head: Vec::new(),
                    raw: Vec::new(),
                })),
                socks::Request::Refuse { code, why } => {
                    tracing::debug!(%why, "egress socks request refused");
                    stream.write_all(&socks::reply(code)).await?;
                    Ok(None)
                }
            };
        }
        if read_more(stream, buf, MAX).await? == 0 {
            return Ok(None);
        }
    }
}

/// Appends what the stream has (up to `max` buffered bytes in all); returns the bytes read.
/// Cancel-safe: `buf` only grows by bytes actually read.
async fn read_more<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<usize> {
    let room = max.saturating_sub(buf.len()).clamp(1, 16 * 1024);
    let mut chunk = vec![0u8; room];
    let n = stream.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

/// Why no connection was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Denied,
    Unresolved,
    Refused,
    Unreachable,
    Timeout,
    Other,
}

impl Failure {
    fn http_status(self) -> (u16, &'static str) {
        match self {
            Failure::Denied => (403, "Forbidden"),
            Failure::Timeout => (504, "Gateway Timeout"),
            _ => (502, "Bad Gateway"),
        }
    }

    fn socks_code(self) -> u8 {
        match self {
            Failure::Denied => socks::NOT_ALLOWED,
            Failure::Unresolved => socks::HOST_UNREACHABLE,
            Failure::Refused => socks::CONNECTION_REFUSED,
            Failure::Unreachable => socks::NETWORK_UNREACHABLE,
            Failure::Timeout => socks::TTL_EXPIRED,
            Failure::Other => socks::GENERAL_FAILURE,
        }
    }
}

/// Decides and connects, filling in `decision`.
async fn open(
    shared: &Shared,
    host: &Host,
    port: u16,
    decision: &mut Decision,
) -> Result<TcpStream, Failure> {
    let rules = shared.rules.current();
    let connect_timeout = shared.limits.connect_timeout;
    let verdict = match timeout(
        connect_timeout,
        decide(&rules, shared.resolver.as_ref(), host, port),
    )
    .await
    {
        Ok(verdict) => verdict,
        Err(_) => Verdict::Unresolved {
            reason: format!(
                "resolving {host} took longer than {}s",
                connect_timeout.as_secs()
            ),
        },
    };
    let (rule, addrs) = match verdict {
        Verdict::Allow { rule, addrs } => (rule, addrs),
        Verdict::Deny { denial, addrs } => {
            decision.addresses = addrs;
            decision.ip = denial.ip;
            decision.rule = denial.rule;
            decision.reason = Some(denial.reason);
            decision.hint = denial.hint;
            decision.outcome = Outcome::Denied;
            return Err(Failure::Denied);
        }
        Verdict::Unresolved { reason } => {
            decision.reason = Some(reason);
            decision.outcome = Outcome::Failed;
            return Err(Failure::Unresolved);
        }
    };
    decision.rule = Some(format!("allow {rule}"));
    decision.addresses.clone_from(&addrs);
    // Only the addresses just checked: never resolve again (no DNS rebinding).
    let (stream, failure) = connect_any(&addrs, port, connect_timeout).await;
    match stream {
        Some((stream, ip)) => {
            decision.ip = Some(ip);
            decision.outcome = Outcome::Allowed;
            Ok(stream)
        }
        None => {
            let (kind, reason) = failure.unwrap_or((Failure::Other, "no address".to_owned()));
            decision.outcome = Outcome::Failed;
            decision.reason = Some(reason);
            Err(kind)
        }
    }
}

/// Connects to the first of `addrs` that answers, within `limit` in all.
async fn connect_any(
    addrs: &[IpAddr],
    port: u16,
    limit: Duration,
) -> (Option<(TcpStream, IpAddr)>, Option<(Failure, String)>) {
    let deadline = tokio::time::Instant::now() + limit;
    let mut last = None;
    for ip in addrs {
        let addr = SocketAddr::new(*ip, port);
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return (Some((stream, *ip)), None);
            }
            Ok(Err(err)) => {
                let kind = match err.kind() {
                    io::ErrorKind::ConnectionRefused => Failure::Refused,
                    io::ErrorKind::NetworkUnreachable | io::ErrorKind::HostUnreachable => {
                        Failure::Unreachable
                    }
                    io::ErrorKind::TimedOut => Failure::Timeout,
                    _ => Failure::Other,
                };
                last = Some((
                    kind,
                    format!("cannot connect to {addr}: {}", io_reason(&err)),
                ));
            }
            Err(_) => {
                last = Some((
                    Failure::Timeout,
                    format!(
                        "cannot connect to {addr}: no answer within {}s",
                        limit.as_secs()
                    ),
                ));
                break;
            }
        }
    }
    (None, last)
}

fn io_reason(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}
