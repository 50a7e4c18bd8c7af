//! A small synchronous HTTP/1.1 client over TCP, TLS or a Unix socket.
//!
//! The agent loop is synchronous (so is [`taskbox_core::api::SandboxApi`]), and both of its
//! network peers speak HTTP/1.1 with JSON bodies: model servers (OpenAI-compatible or Anthropic
//! Messages, local or hosted) and `taskbox serve`. One request per connection
//! (`Connection: close`), `Content-Length` or chunked bodies, and a deadline over the whole
//! exchange, TLS handshake included. `https` URLs go through [`tls`] (rustls; the server's
//! certificate is verified against the trusted roots and the host name checked).

pub mod tls;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustls::{ClientConnection, StreamOwned};

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
/// session cache), built once.
#[derive(Debug, Clone)]
pub struct Client {
    base: BaseUrl,
    tls: Option<Tls>,
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
        Ok(Client { base, tls })
    }

    /// Where requests go.
    pub fn base(&self) -> &BaseUrl {
        &self.base
    }

    /// Sends `req` and returns once the response head has arrived.
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
        header(&self.headers, name)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

enum Conn {
    Tcp(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
    Unix(UnixStream),
}

impl Conn {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        let t = Some(t.max(Duration::from_millis(1)));
        match self {
            Conn::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Conn::Tls(s) => {
                s.sock.set_read_timeout(t)?;
                s.sock.set_write_timeout(t)
            }
            Conn::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Tls(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Tls(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Tcp(s) => s.flush(),
            Conn::Tls(s) => s.flush(),
            Conn::Unix(s) => s.flush(),
        }
    }
}

/// A connection that gives up at a deadline: each read and write may only use what is left.
struct Deadline {
    conn: Conn,
    until: Instant,
}

impl Deadline {
    fn arm(&self) -> std::io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.conn.set_timeouts(left)
    }
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.conn.read(buf)
    }
}

impl Write for Deadline {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.conn.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.conn.flush()
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
}

impl<'a> Request<'a> {
    pub fn new(method: &'a str, path: &'a str) -> Request<'a> {
        Request {
            method,
            path,
            headers: Vec::new(),
            body: None,
            accept: "application/json",
        }
    }
}

fn connect(client: &Client, until: Instant, timeout: Duration) -> Result<Deadline, HttpError> {
    let endpoint = &client.base.endpoint;
    let target = endpoint.to_string();
    let conn = match endpoint {
        Endpoint::Unix(path) => {
            UnixStream::connect(path)
                .map(Conn::Unix)
                .map_err(|e| HttpError::Connect {
                    target: target.clone(),
                    why: e.to_string(),
                })?
        }
        Endpoint::Tcp { host, port } => Conn::Tcp(tcp_connect(host, *port, &target, until)?),
        Endpoint::Tls { host, port } => {
            let tcp = tcp_connect(host, *port, &target, until)?;
            // A client is built with its TLS configuration for every https endpoint.
            let tls = client.tls.as_ref().ok_or_else(|| HttpError::Url {
                url: target.clone(),
                why: "https needs a TLS configuration (use Client::new)".into(),
            })?;
            Conn::Tls(Box::new(tls.handshake(host, tcp, &target, until, timeout)?))
        }
    };
    Ok(Deadline { conn, until })
}

fn tcp_connect(
    host: &str,
    port: u16,
    target: &str,
    until: Instant,
) -> Result<TcpStream, HttpError> {
    let addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| HttpError::Connect {
            target: target.to_owned(),
            why: format!("cannot resolve the host: {e}"),
        })?;
    let mut last = String::from("the host has no address");
    for addr in addrs {
        let left = until.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
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

fn io_err(target: &str, timeout: Duration, e: std::io::Error) -> HttpError {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => HttpError::Timeout {
            target: target.to_owned(),
            after: timeout,
        },
        _ => HttpError::Io {
            target: target.to_owned(),
            why: e.to_string(),
        },
    }
}

/// A response whose body is still being read (for Server-Sent Events).
pub struct Streaming {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: Box<dyn BufRead + Send>,
    target: String,
    timeout: Duration,
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
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| io_err(&self.target, self.timeout, e))?;
        if n == 0 {
            return Ok(None);
        }
        Ok(Some(line.trim_end_matches(['\r', '\n']).to_owned()))
    }

    /// The rest of the body.
    pub fn read_all(mut self) -> Result<Vec<u8>, HttpError> {
        let mut body = Vec::new();
        self.reader
            .read_to_end(&mut body)
            .map_err(|e| io_err(&self.target, self.timeout, e))?;
        Ok(body)
    }
}

fn open(client: &Client, req: &Request<'_>, timeout: Duration) -> Result<Streaming, HttpError> {
    let base = &client.base;
    let until = Instant::now() + timeout;
    let target = base.endpoint.to_string();
    let mut conn = connect(client, until, timeout)?;
    let host = match &base.endpoint {
        Endpoint::Tcp { host, port } => format!("{}:{port}", bracketed(host)),
        Endpoint::Tls { host, port: 443 } => bracketed(host).into_owned(),
        Endpoint::Tls { host, port } => format!("{}:{port}", bracketed(host)),
        Endpoint::Unix(_) => "taskbox".to_owned(),
    };
    let mut head = format!(
        "{} {}{} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nAccept: {}\r\nUser-Agent: taskbox-agent/{}\r\n",
        req.method,
        base.prefix,
        req.path,
        req.accept,
        env!("CARGO_PKG_VERSION"),
    );
    for (k, v) in &req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = req.body.unwrap_or_default();
    if req.body.is_some() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    let mut message = head.into_bytes();
    message.extend_from_slice(body);
    // The server may answer (e.g. 413) and close before reading the body: the response that
    // follows is the answer, not the failed write.
    if let Err(e) = conn.write_all(&message).and_then(|()| conn.flush())
        && !matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    {
        return Err(io_err(&target, timeout, e));
    }
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(|e| io_err(&target, timeout, e))?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| line.starts_with("HTTP/1."))
        .ok_or_else(|| HttpError::Malformed {
            target: target.clone(),
            why: format!("bad status line {:?}", line.trim_end()),
        })?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .map_err(|e| io_err(&target, timeout, e))?;
        let l = line.trim_end_matches(['\r', '\n']);
        if n == 0 || l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let chunked = header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let length = header(&headers, "content-length").and_then(|v| v.parse::<u64>().ok());
    let body: Box<dyn BufRead + Send> = if chunked {
        Box::new(BufReader::new(Chunked::new(reader)))
    } else if let Some(n) = length {
        Box::new(BufReader::new(reader.take(n)))
    } else {
        Box::new(reader)
    };
    Ok(Streaming {
        status,
        headers,
        reader: body,
        target,
        timeout,
    })
}

/// A reader of an HTTP/1.1 chunked body (also the CLI's, for the supervisor's answers).
pub struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Chunked<R> {
    /// Reads the chunked body that follows the headers already read from `inner`.
    pub fn new(inner: R) -> Chunked<R> {
        Chunked {
            inner,
            left: 0,
            done: false,
        }
    }
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            let mut n = self.inner.read_line(&mut line)?;
            if n > 0 && line.trim().is_empty() {
                // The CRLF that ends the previous chunk.
                line.clear();
                n = self.inner.read_line(&mut line)?;
            }
            if n == 0 {
                return Err(cut_short("before its last chunk"));
            }
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {line:?}")))?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let n = buf.len().min(self.left);
        let got = self.inner.read(&mut buf[..n])?;
        if got == 0 && n > 0 {
            return Err(cut_short("inside a chunk"));
        }
        self.left -= got;
        Ok(got)
    }
}

/// A chunked body that ends early is an error, never a shorter body.
fn cut_short(where_: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!("the connection closed {where_}: the response body is cut short"),
    )
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
