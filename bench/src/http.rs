//! A minimal HTTP/1.1 client over a Unix socket: one persistent (keep-alive) connection, one
//! `write` per request, `Content-Length` and chunked bodies. Just enough for the supervisor's
//! JSON API, with as little client overhead as possible.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    /// The body as JSON.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "the answer (status {}) is not JSON: {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// Fails unless the status is `want`.
    pub fn expect_status(self, want: u16, what: &str) -> Result<Response> {
        if self.status != want {
            bail!(
                "{what}: status {} (expected {want}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            );
        }
        Ok(self)
    }
}

#[derive(Debug)]
pub struct Client {
    socket: PathBuf,
    conn: Option<BufReader<UnixStream>>,
    out: Vec<u8>,
    line: String,
    /// Connections opened; 1 when the server kept the first one alive throughout.
    pub connections: u64,
}

impl Client {
    pub fn connect(socket: &Path) -> Result<Client> {
        let mut c = Client {
            socket: socket.to_path_buf(),
            conn: None,
            out: Vec::with_capacity(4096),
            line: String::with_capacity(256),
            connections: 0,
        };
        c.open()?;
        Ok(c)
    }

    fn open(&mut self) -> Result<()> {
        let s = UnixStream::connect(&self.socket)
            .with_context(|| format!("cannot connect to {}", self.socket.display()))?;
        self.conn = Some(BufReader::with_capacity(64 * 1024, s));
        self.connections += 1;
        Ok(())
    }

    pub fn post(&mut self, path: &str, body: &[u8]) -> Result<Response> {
        self.request("POST", path, Some(body))
    }

    pub fn delete(&mut self, path: &str) -> Result<Response> {
        self.request("DELETE", path, None)
    }

    /// Sends one request. A connection the server closed while idle is reopened once.
    pub fn request(&mut self, method: &str, path: &str, body: Option<&[u8]>) -> Result<Response> {
        self.out.clear();
        write!(self.out, "{method} {path} HTTP/1.1\r\nHost: localhost\r\n")?;
        if let Some(b) = body {
            write!(
                self.out,
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            )?;
        }
        self.out.extend_from_slice(b"\r\n");
        if let Some(b) = body {
            self.out.extend_from_slice(b);
        }
        for attempt in 0..2 {
            if self.conn.is_none() {
                self.open()?;
            }
            match self.exchange() {
                Ok(r) => return Ok(r),
                Err(Stale) if attempt == 0 => self.conn = None,
                Err(Stale) => bail!("the server closed the connection without an answer"),
                Err(Failed(e)) => {
                    self.conn = None;
                    return Err(e);
                }
            }
        }
        bail!("unreachable: no answer after a reconnect")
    }

    fn exchange(&mut self) -> std::result::Result<Response, ExchangeError> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(Stale);
        };
        if let Err(e) = conn.get_mut().write_all(&self.out) {
            return Err(match e.kind() {
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => Stale,
                _ => Failed(e.into()),
            });
        }
        self.line.clear();
        match conn.read_line(&mut self.line) {
            Ok(0) => return Err(Stale),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Err(Stale),
            Err(e) => return Err(Failed(e.into())),
        }
        let status = parse_status(&self.line).map_err(Failed)?;
        let (length, chunked, close) = read_headers(conn, &mut self.line).map_err(Failed)?;
        let mut body = Vec::new();
        let res = if chunked {
            read_chunked(conn, &mut self.line, &mut body)
        } else if let Some(n) = length {
            body.resize(n, 0);
            conn.read_exact(&mut body).map_err(Into::into)
        } else if status == 204 || status == 304 || status < 200 {
            Ok(())
        } else {
            // No length: the body runs to the end of the connection.
            conn.read_to_end(&mut body)
                .map(|_| ())
                .map_err(anyhow::Error::from)
        };
        res.map_err(Failed)?;
        if close || (length.is_none() && !chunked && status >= 200 && status != 204) {
            self.conn = None;
        }
        Ok(Response { status, body })
    }
}

enum ExchangeError {
    /// The connection was closed before the answer began: safe to send again.
    Stale,
    Failed(anyhow::Error),
}
use ExchangeError::{Failed, Stale};

fn parse_status(line: &str) -> Result<u16> {
    let mut parts = line.split_ascii_whitespace();
    match (parts.next(), parts.next()) {
        (Some(v), Some(code)) if v.starts_with("HTTP/1.") => code
            .parse()
            .with_context(|| format!("bad status line {line:?}")),
        _ => bail!("bad status line {line:?}"),
    }
}

/// Reads the header block: (content length, chunked, connection close).
fn read_headers(
    conn: &mut BufReader<UnixStream>,
    line: &mut String,
) -> Result<(Option<usize>, bool, bool)> {
    let (mut length, mut chunked, mut close) = (None, false, false);
    loop {
        line.clear();
        if conn.read_line(line)? == 0 {
            bail!("the connection ended inside the headers");
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok((length, chunked, close));
        }
        let Some((name, value)) = l.split_once(':') else {
            bail!("bad header line {l:?}");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().context("bad content-length")?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        }
    }
}

fn read_chunked(
    conn: &mut BufReader<UnixStream>,
    line: &mut String,
    body: &mut Vec<u8>,
) -> Result<()> {
    loop {
        line.clear();
        conn.read_line(line)?;
        let size = line.trim_end().split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size, 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        if n == 0 {
            // Trailers, up to the empty line.
            loop {
                line.clear();
                if conn.read_line(line)? == 0 || line.trim_end().is_empty() {
                    return Ok(());
                }
            }
        }
        let start = body.len();
        body.resize(start + n, 0);
        conn.read_exact(&mut body[start..])?;
        let mut crlf = [0u8; 2];
        conn.read_exact(&mut crlf)?;
    }
}
