//! A synchronous HTTP/1.1 client over TCP, TLS or a Unix socket, on hyper's client.
//!
//! The agent loop is synchronous (so is [`taskbox_core::api::SandboxApi`]), and both of its
//! network peers speak HTTP/1.1 with JSON bodies: model servers (OpenAI-compatible or Anthropic
//! Messages, local or hosted) and `taskbox serve`. hyper speaks the protocol (the request,
//! `Content-Length`, chunked and close-delimited bodies, an answer that comes before the body was
//! sent); this module picks the transport, bounds the whole exchange, TLS handshake included, by
//! one deadline, and runs it on the client's own current-thread tokio runtime, so callers stay
//! synchronous. One request per connection (`Connection: close`). `https` URLs go through
//! [`tls`] (rustls; the server's certificate is verified against the trusted roots and the host
//! name checked).

pub mod tls;

use std::future::Future;
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1;
use hyper::header;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::runtime::Runtime;

pub use tls::{Tls, TlsError};

/// Errors of one HTTP exchange.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// the URL cannot be used
    #[error("invalid URL {url:?}: {why}")]
    Url { url: String, why: String },
    /// no connection could be made
    #[error("cannot connect to {target}: {why}")]
    Connect { target: String, why: String },
    /// the exchange took longer than its deadline
    #[error("no complete answer from {target} within {after:?}")]
    Timeout { target: String, after: Duration },
    /// reading or writing failed half way
    #[error("connection to {target} failed: {why}")]
    Io { target: String, why: String },
    /// the peer did not speak HTTP/1.1
    #[error("malformed HTTP answer from {target}: {why}")]
    Malformed { target: String, why: String },
    /// the TLS handshake failed: most often the server's certificate was refused
    #[error("TLS handshake with {target} failed: {why}")]
    Tls {
        target: String,
        why: String,
        /// The certificate does not chain to a trusted root (a CA file may fix that).
        unknown_issuer: bool,
    },
    /// TLS cannot be set up (CA file, trusted roots)
    #[error(transparent)]
    TlsSetup(#[from] TlsError),
    /// the caller's cancel flag was set before the answer came
    #[error("the exchange with {target} was cancelled")]
    Cancelled { target: String },
}

impl HttpError {
    /// Whether trying again might succeed (connection refused, reset, timed out).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            HttpError::Connect { .. } | HttpError::Timeout { .. } | HttpError::Io { .. }
        )
    }
}

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// Plain HTTP over TCP.
    Tcp {
        host: String,
        port: u16,
    },
    /// HTTPS: TLS over TCP.
    Tls {
        host: String,
        port: u16,
    },
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp { host, port } => write!(f, "{}:{port}", bracketed(host)),
            Endpoint::Tls { host, port } => write!(f, "https://{}:{port}", bracketed(host)),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// An IPv6 address in brackets, as URLs and `Host` headers write it.
fn bracketed(host: &str) -> std::borrow::Cow<'_, str> {
    if host.contains(':') {
        format!("[{host}]").into()
    } else {
        host.into()
    }
}

/// A base URL split into where to connect and the path prefix of every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    pub endpoint: Endpoint,
    /// Without a trailing `/` (empty for the root).
    pub prefix: String,
}

impl BaseUrl {
    /// Parses `http://HOST[:PORT][/PREFIX]`, `https://HOST[:PORT][/PREFIX]` or
    /// `unix:/PATH/TO.sock`.
    pub fn parse(url: &str) -> Result<BaseUrl, HttpError> {
        let bad = |why: &str| HttpError::Url {
            url: url.to_owned(),
            why: why.to_owned(),
        };
        if let Some(path) = url.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("give the socket's path after unix:"));
            }
            return Ok(BaseUrl {
                endpoint: Endpoint::Unix(PathBuf::from(path)),
                prefix: String::new(),
            });
        }
        let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err(bad(
                "expected http://HOST[:PORT][/PATH], https://HOST[:PORT][/PATH] or unix:/PATH",
            ));
        };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(bad("the host is missing"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                let port = p
                    .parse::<u16>()
                    .map_err(|_| bad("the port is not a number"))?;
                (h.trim_start_matches('[').trim_end_matches(']'), port)
            }
            _ => (authority, if tls { 443 } else { 80 }),
        };
        if host.is_empty() {
            return Err(bad("the host is missing"));
        }
        let host = host.to_owned();
        Ok(BaseUrl {
            endpoint: if tls {
                Endpoint::Tls { host, port }
            } else {
                Endpoint::Tcp { host, port }
            },
            prefix: prefix.to_owned(),
        })
    }
}

/// A base URL ready for requests: for `https`, with its TLS configuration (trusted roots and
/// session cache), built once; and the runtime its exchanges run on.
#[derive(Debug, Clone)]
pub struct Client {
    base: BaseUrl,
    tls: Option<Tls>,
    runtime: Arc<Runtime>,
}

impl Client {
    /// A client of `url` (see [`BaseUrl::parse`]). An `https` URL trusts the system's roots
    /// and, when given, the certificates of `ca_file` (PEM); other URLs ignore `ca_file`.
    pub fn new(url: &str, ca_file: Option<&Path>) -> Result<Client, HttpError> {
        let base = BaseUrl::parse(url)?;
        let tls = match base.endpoint {
            Endpoint::Tls { .. } => Some(Tls::new(ca_file)?),
            _ => None,
        };
        Client::with(base, tls)
    }

    /// A client of the Unix socket at `path` (any path, not only one a URL can spell).
    pub fn unix(path: &Path) -> Result<Client, HttpError> {
        let base = BaseUrl {
            endpoint: Endpoint::Unix(path.to_owned()),
            prefix: String::new(),
        };
        Client::with(base, None)
    }

    fn with(base: BaseUrl, tls: Option<Tls>) -> Result<Client, HttpError> {
        // One small runtime per client: the exchanges of a synchronous caller run one at a time.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| HttpError::Io {
                target: base.endpoint.to_string(),
                why: format!("cannot start the client's I/O runtime: {e}"),
            })?;
        Ok(Client {
            base,
            tls,
            runtime: Arc::new(runtime),
        })
    }

    /// Where requests go.
    pub fn base(&self) -> &BaseUrl {
        &self.base
    }

    /// Sends `req` and returns once the response head has arrived. `timeout` bounds the whole
    /// exchange, reading the body included; one too long to be a deadline (`Duration::MAX`)
    /// bounds nothing.
    pub fn open(&self, req: &Request<'_>, timeout: Duration) -> Result<Streaming, HttpError> {
        open(self, req, timeout)
    }

    /// Sends `req` and reads the whole response.
    pub fn send(&self, req: &Request<'_>, timeout: Duration) -> Result<Response, HttpError> {
        let s = self.open(req, timeout)?;
        let status = s.status;
        let headers = s.headers.clone();
        let body = s.read_all()?;
        Ok(Response {
            status,
            headers,
            body,
        })
    }
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A request ready to send.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub method: &'a str,
    /// The path and query, starting with `/`.
    pub path: &'a str,
    pub headers: Vec<(&'static str, String)>,
    pub body: Option<&'a [u8]>,
    pub accept: &'a str,
    /// Set (by another thread) to give up waiting for the answer's head.
    pub cancel: Option<&'a std::sync::atomic::AtomicBool>,
}

impl<'a> Request<'a> {
    pub fn new(method: &'a str, path: &'a str) -> Request<'a> {
        Request {
            method,
            path,
            headers: Vec::new(),
            body: None,
            accept: "application/json",
            cancel: None,
        }
    }
}

/// A byte stream hyper can speak over: TCP, TLS over TCP, or a Unix socket.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A socket whose writes are dropped once the peer has stopped reading (`EPIPE`,
/// `ECONNRESET`). A server may answer (413) and close before it has read the whole body: the
/// answer already on its way is the outcome, not the failed write, and hyper reads it only
/// while its writes succeed. A peer that closed without answering still ends the exchange,
/// as a response cut short.
struct KeepReading<T> {
    inner: T,
    stopped: bool,
}

impl<T> KeepReading<T> {
    fn new(inner: T) -> KeepReading<T> {
        KeepReading {
            inner,
            stopped: false,
        }
    }

    /// `result` of a write of `n` bytes, with a peer that stopped reading taken as written.
    fn written<R>(&mut self, result: Poll<std::io::Result<R>>, n: R) -> Poll<std::io::Result<R>> {
        match result {
            Poll::Ready(Err(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                self.stopped = true;
                Poll::Ready(Ok(n))
            }
            other => other,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for KeepReading<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for KeepReading<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.stopped {
            return Poll::Ready(Ok(buf.len()));
        }
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.written(r, buf.len())
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let n = bufs.iter().map(|b| b.len()).sum();
        if this.stopped {
            return Poll::Ready(Ok(n));
        }
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.written(r, n)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().settle(cx, T::poll_flush)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().settle(cx, T::poll_shutdown)
    }
}

impl<T: AsyncWrite + Unpin> KeepReading<T> {
    /// A flush or shutdown, done at once when the peer has stopped reading.
    fn settle(
        &mut self,
        cx: &mut Context<'_>,
        op: fn(Pin<&mut T>, &mut Context<'_>) -> Poll<std::io::Result<()>>,
    ) -> Poll<std::io::Result<()>> {
        if self.stopped {
            return Poll::Ready(Ok(()));
        }
        let r = op(Pin::new(&mut self.inner), cx);
        self.written(r, ())
    }
}

type Connection = http1::Connection<TokioIo<Box<dyn Io>>, Full<Bytes>>;

/// One exchange's connection and deadline. hyper's connection future does the reading and
/// writing: it is polled together with whatever waits on it (the response, a body frame), so
/// nothing runs in the background and dropping the exchange closes the socket.
struct Exchange {
    conn: Pin<Box<Connection>>,
    /// Kept until the exchange ends: the connection stays up while its sender lives.
    _sender: http1::SendRequest<Full<Bytes>>,
    /// The connection future has finished (cleanly or not); only `work` is polled then.
    finished: bool,
    until: Option<Instant>,
    target: String,
    timeout: Duration,
}

impl Exchange {
    /// Runs `work` while driving the connection, within the deadline.
    async fn drive<T>(
        &mut self,
        work: impl Future<Output = Result<T, HttpError>>,
    ) -> Result<T, HttpError> {
        let (until, target, timeout) = (self.until, self.target.clone(), self.timeout);
        let conn = &mut self.conn;
        let finished = &mut self.finished;
        let both = async move {
            tokio::pin!(work);
            loop {
                if *finished {
                    return work.await;
                }
                tokio::select! {
                    biased;
                    out = &mut work => return out,
                    // A failed connection fails `work` too, with hyper's reason.
                    _ = conn.as_mut() => *finished = true,
                }
            }
        };
        bounded(until, &target, timeout, both).await
    }
}

/// `work`, or [`HttpError::Timeout`] once `until` has passed.
async fn bounded<T>(
    until: Option<Instant>,
    target: &str,
    timeout: Duration,
    work: impl Future<Output = Result<T, HttpError>>,
) -> Result<T, HttpError> {
    let Some(until) = until else {
        return work.await;
    };
    tokio::time::timeout_at(until.into(), work)
        .await
        .unwrap_or_else(|_| {
            Err(HttpError::Timeout {
                target: target.to_owned(),
                after: timeout,
            })
        })
}

async fn connect(client: &Client, target: &str) -> Result<Box<dyn Io>, HttpError> {
    match &client.base.endpoint {
        Endpoint::Unix(path) => {
            let s = UnixStream::connect(path)
                .await
                .map_err(|e| HttpError::Connect {
                    target: target.to_owned(),
                    why: e.to_string(),
                })?;
            Ok(Box::new(KeepReading::new(s)))
        }
        Endpoint::Tcp { host, port } => Ok(Box::new(KeepReading::new(
            tcp_connect(host, *port, target).await?,
        ))),
        Endpoint::Tls { host, port } => {
            let tcp = tcp_connect(host, *port, target).await?;
            // A client is built with its TLS configuration for every https endpoint.
            let tls = client.tls.as_ref().ok_or_else(|| HttpError::Url {
                url: target.to_owned(),
                why: "https needs a TLS configuration (use Client::new)".into(),
            })?;
            Ok(Box::new(
                tls.handshake(host, KeepReading::new(tcp), target).await?,
            ))
        }
    }
}

async fn tcp_connect(host: &str, port: u16, target: &str) -> Result<TcpStream, HttpError> {
    let addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| HttpError::Connect {
            target: target.to_owned(),
            why: format!("cannot resolve the host: {e}"),
        })?;
    let mut last = String::from("the host has no address");
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = e.to_string(),
        }
    }
    Err(HttpError::Connect {
        target: target.to_owned(),
        why: last,
    })
}

/// hyper's error, with its causes: a peer that does not speak HTTP/1.1 is [`HttpError::Malformed`],
/// anything else (a reset, a body cut short) [`HttpError::Io`].
fn hyper_err(target: &str, e: &hyper::Error) -> HttpError {
    let mut why = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        why.push_str(": ");
        why.push_str(&cause.to_string());
        source = cause.source();
    }
    let target = target.to_owned();
    if e.is_parse() || e.is_parse_status() {
        HttpError::Malformed { target, why }
    } else {
        HttpError::Io { target, why }
    }
}

fn build_request(
    client: &Client,
    req: &Request<'_>,
) -> Result<hyper::Request<Full<Bytes>>, HttpError> {
    let base = &client.base;
    let host = match &base.endpoint {
        Endpoint::Tcp { host, port } => format!("{}:{port}", bracketed(host)),
        Endpoint::Tls { host, port: 443 } => bracketed(host).into_owned(),
        Endpoint::Tls { host, port } => format!("{}:{port}", bracketed(host)),
        Endpoint::Unix(_) => "taskbox".to_owned(),
    };
    let mut b = hyper::Request::builder()
        .method(req.method)
        .uri(format!("{}{}", base.prefix, req.path))
        .header(header::HOST, host)
        .header(header::CONNECTION, "close")
        .header(header::ACCEPT, req.accept)
        .header(
            header::USER_AGENT,
            concat!("taskbox-agent/", env!("CARGO_PKG_VERSION")),
        );
    for (k, v) in &req.headers {
        b = b.header(*k, v.as_str());
    }
    let body = match req.body {
        Some(body) => {
            b = b
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, body.len());
            Full::new(Bytes::copy_from_slice(body))
        }
        None => Full::new(Bytes::new()),
    };
    b.body(body).map_err(|e| HttpError::Url {
        url: format!("{}{}{}", base.endpoint, base.prefix, req.path),
        why: format!("cannot make a request of it: {e}"),
    })
}

/// A response whose body is still being read (for Server-Sent Events).
pub struct Streaming {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    runtime: Arc<Runtime>,
    exchange: Exchange,
    body: Incoming,
    /// Bytes of the body received and not yet returned.
    pending: Vec<u8>,
    ended: bool,
}

impl std::fmt::Debug for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Streaming {
    /// The next line of the body without its line end; `None` at the end.
    pub fn next_line(&mut self) -> Result<Option<String>, HttpError> {
        loop {
            if let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(i + 1);
                let line = std::mem::replace(&mut self.pending, rest);
                return self.text(line).map(Some);
            }
            if !self.receive()? {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                let line = std::mem::take(&mut self.pending);
                return self.text(line).map(Some);
            }
        }
    }

    /// The rest of the body.
    pub fn read_all(mut self) -> Result<Vec<u8>, HttpError> {
        while self.receive()? {}
        Ok(self.pending)
    }

    /// Waits for the next frame of the body and keeps its data; false at the end of the body.
    fn receive(&mut self) -> Result<bool, HttpError> {
        if self.ended {
            return Ok(false);
        }
        let Streaming {
            runtime,
            exchange,
            body,
            ..
        } = self;
        let target = exchange.target.clone();
        let frame = runtime.block_on(exchange.drive(async {
            body.frame()
                .await
                .transpose()
                .map_err(|e| hyper_err(&target, &e))
        }))?;
        match frame {
            None => {
                self.ended = true;
                Ok(false)
            }
            Some(frame) => {
                // Trailers carry no data.
                if let Ok(data) = frame.into_data() {
                    self.pending.extend_from_slice(&data);
                }
                Ok(true)
            }
        }
    }

    fn text(&self, mut line: Vec<u8>) -> Result<String, HttpError> {
        while line.last().is_some_and(|b| matches!(b, b'\r' | b'\n')) {
            line.pop();
        }
        String::from_utf8(line).map_err(|_| HttpError::Malformed {
            target: self.exchange.target.clone(),
            why: "a line of the body is not UTF-8".into(),
        })
    }
}

fn open(client: &Client, req: &Request<'_>, timeout: Duration) -> Result<Streaming, HttpError> {
    let until = Instant::now().checked_add(timeout);
    let target = client.base.endpoint.to_string();
    let request = build_request(client, req)?;
    let cancelled = async {
        match req.cancel {
            Some(flag) => {
                while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            None => std::future::pending::<()>().await,
        }
    };
    let exchange = async {
        let (mut sender, conn) = bounded(until, &target, timeout, async {
            let io = connect(client, &target).await?;
            http1::handshake(TokioIo::new(io))
                .await
                .map_err(|e| hyper_err(&target, &e))
        })
        .await?;
        let sent = sender.send_request(request);
        let mut exchange = Exchange {
            conn: Box::pin(conn),
            _sender: sender,
            finished: false,
            until,
            target: target.clone(),
            timeout,
        };
        let response = exchange
            .drive(async { sent.await.map_err(|e| hyper_err(&target, &e)) })
            .await?;
        Ok::<_, HttpError>((exchange, response))
    };
    let (exchange, response) = client.runtime.block_on(async {
        tokio::select! {
            r = exchange => r,
            () = cancelled => Err(HttpError::Cancelled { target: target.clone() }),
        }
    })?;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    Ok(Streaming {
        status,
        headers,
        runtime: client.runtime.clone(),
        exchange,
        body: response.into_body(),
        pending: Vec::new(),
        ended: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_parse_or_say_why_not() {
        let b = BaseUrl::parse("http://127.0.0.1:8080/v1/").unwrap();
        assert_eq!(
            b.endpoint,
            Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 8080
            }
        );
        assert_eq!(b.prefix, "/v1");
        let b = BaseUrl::parse("http://localhost").unwrap();
        assert_eq!(b.prefix, "");
        assert!(matches!(b.endpoint, Endpoint::Tcp { port: 80, .. }));
        let b = BaseUrl::parse("unix:/run/x.sock").unwrap();
        assert_eq!(b.endpoint, Endpoint::Unix("/run/x.sock".into()));
        let b = BaseUrl::parse("https://api.example.com/v1").unwrap();
        assert_eq!(
            b.endpoint,
            Endpoint::Tls {
                host: "api.example.com".into(),
                port: 443
            }
        );
        assert_eq!(b.prefix, "/v1");
        let b = BaseUrl::parse("https://[::1]:8443").unwrap();
        assert_eq!(b.endpoint.to_string(), "https://[::1]:8443");
        let e = BaseUrl::parse("ftp://x").unwrap_err();
        assert!(e.to_string().contains("https://HOST"), "{e}");
        assert!(BaseUrl::parse("http://:80").is_err());
        assert!(BaseUrl::parse("http://h:port").is_err());
    }

    #[test]
    fn a_refused_connection_is_transient() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let client = Client::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
        let e = client
            .send(&Request::new("GET", "/"), Duration::from_secs(2))
            .unwrap_err();
        assert!(e.is_transient(), "{e}");
    }

    /// A server of one connection: it reads the request head, answers `answer` and closes,
    /// leaving whatever body the request had unread.
    fn answering(answer: &[u8]) -> (Client, std::thread::JoinHandle<()>) {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = Client::new(&format!("http://{}", l.local_addr().unwrap()), None).unwrap();
        let answer = answer.to_vec();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            s.write_all(&answer).unwrap();
        });
        (client, server)
    }

    #[test]
    fn chunked_bodies_are_read_whole_and_line_by_line() {
        let (client, server) = answering(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              9\r\ndata: a\n\n\r\n4\r\ndata\r\n5\r\n: b\r\n\r\n0\r\n\r\n",
        );
        let mut s = client
            .open(&Request::new("GET", "/"), Duration::from_secs(10))
            .unwrap();
        assert_eq!(s.status, 200);
        let mut lines = Vec::new();
        while let Some(l) = s.next_line().unwrap() {
            lines.push(l);
        }
        assert_eq!(lines, ["data: a", "", "data: b"]);
        server.join().unwrap();

        let (client, server) = answering(
            b"HTTP/1.1 201 Created\r\nX-Id: 7\r\nTransfer-Encoding: chunked\r\n\r\n\
              3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n",
        );
        let r = client
            .send(&Request::new("GET", "/"), Duration::from_secs(10))
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (201, &b"{\"a\":1}"[..]));
        assert_eq!(r.header("x-id"), Some("7"));
        server.join().unwrap();
    }

    #[test]
    fn a_body_cut_short_is_an_error_not_a_shorter_body() {
        for answer in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n wo"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",
        ] {
            let (client, server) = answering(answer);
            let e = client
                .send(&Request::new("GET", "/"), Duration::from_secs(10))
                .unwrap_err();
            assert!(matches!(e, HttpError::Io { .. }), "{e}");
            server.join().unwrap();
        }
    }

    #[test]
    fn a_peer_that_is_no_http_server_is_malformed() {
        let (client, server) = answering(b"SSH-2.0-OpenSSH_9.6\r\n");
        let e = client
            .send(&Request::new("GET", "/"), Duration::from_secs(10))
            .unwrap_err();
        assert!(matches!(e, HttpError::Malformed { .. }), "{e}");
        assert!(!e.is_transient(), "{e}");
        server.join().unwrap();
    }

    #[test]
    fn an_answer_before_the_body_was_read_is_the_answer() {
        use std::io::{Read, Write};
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut head = [0u8; 64];
            let _ = s.read(&mut head).unwrap();
            s.write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!")
                .unwrap();
        });
        let client = Client::unix(&sock).unwrap();
        let body = vec![b'x'; 8 << 20];
        let mut req = Request::new("POST", "/upload");
        req.body = Some(&body);
        let r = client.send(&req, Duration::from_secs(10)).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (413, &b"too big!"[..]));
        server.join().unwrap();
    }

    #[test]
    fn a_tls_handshake_is_bounded_by_the_deadline() {
        // A server that accepts and never answers the client hello.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let hold = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let ca = std::env::temp_dir().join(format!("taskbox-no-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, "").unwrap();
        // An empty CA file is refused up front, with its path.
        let e = Client::new(&format!("https://localhost:{port}"), Some(&ca)).unwrap_err();
        assert!(
            matches!(e, HttpError::TlsSetup(TlsError::CaFileEmpty { .. })),
            "{e}"
        );
        assert!(e.to_string().contains(&ca.display().to_string()), "{e}");
        std::fs::remove_file(&ca).unwrap();
        let client = match Client::new(&format!("https://localhost:{port}"), None) {
            Ok(c) => c,
            Err(e) => {
                taskbox_tests::require(false, &format!("no system root certificates: {e}"));
                return;
            }
        };
        let started = Instant::now();
        let e = client
            .send(&Request::new("GET", "/"), Duration::from_millis(300))
            .unwrap_err();
        assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        drop(hold.join());
    }
}
