//! The harness's HTTP/1.1 client on a Unix socket: hyper's client connection, kept alive across
//! requests (one connection for a whole run, so that what is timed is the API, not connection
//! set-up), on a current-thread tokio runtime of its own that the synchronous harness blocks on.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::runtime::Runtime;

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
    /// Boxed: a runtime is large, and a client lives in the harness's enums.
    runtime: Box<Runtime>,
    /// The open connection's request side; its connection task runs whenever `runtime` does.
    sender: Option<SendRequest<Full<Bytes>>>,
    /// Connections opened; 1 when the server kept the first one alive throughout.
    pub connections: u64,
}

impl Client {
    pub fn connect(socket: &Path) -> Result<Client> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .context("cannot start the client's I/O runtime")?;
        let mut c = Client {
            socket: socket.to_path_buf(),
            runtime: Box::new(runtime),
            sender: None,
            connections: 0,
        };
        c.open()?;
        Ok(c)
    }

    fn open(&mut self) -> Result<()> {
        let socket = &self.socket;
        let sender = self.runtime.block_on(async {
            let s = UnixStream::connect(socket)
                .await
                .with_context(|| format!("cannot connect to {}", socket.display()))?;
            let (sender, conn) = http1::handshake(TokioIo::new(s))
                .await
                .context("cannot start HTTP/1.1 on the connection")?;
            // Ends by itself when the server closes the connection or `sender` is dropped.
            tokio::spawn(conn);
            anyhow::Ok(sender)
        })?;
        self.sender = Some(sender);
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
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "localhost");
        if let Some(b) = body {
            req = req
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, b.len());
        }
        let mut req = req
            .body(Full::new(Bytes::copy_from_slice(body.unwrap_or_default())))
            .with_context(|| format!("cannot make a request of {method} {path}"))?;
        for attempt in 0..2 {
            let sender = match self.sender.as_mut().filter(|s| !s.is_closed()) {
                Some(s) => s,
                None => {
                    self.open()?;
                    self.sender
                        .as_mut()
                        .context("no connection after opening one")?
                }
            };
            match self.runtime.block_on(exchange(sender, req)) {
                Ok(r) => return Ok(r),
                Err(Unsent(back)) if attempt == 0 => {
                    self.sender = None;
                    req = *back;
                }
                Err(Unsent(_)) => bail!("the server closed the connection without an answer"),
                Err(Failed(e)) => {
                    self.sender = None;
                    return Err(e);
                }
            }
        }
        bail!("unreachable: no answer after a reconnect")
    }
}

enum ExchangeError {
    /// The connection closed before the request went out: safe to send again.
    Unsent(Box<hyper::Request<Full<Bytes>>>),
    Failed(anyhow::Error),
}
use ExchangeError::{Failed, Unsent};

async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    req: hyper::Request<Full<Bytes>>,
) -> std::result::Result<Response, ExchangeError> {
    let resp = match sender.try_send_request(req).await {
        Ok(resp) => resp,
        Err(mut e) => {
            return Err(match e.take_message() {
                Some(req) => Unsent(Box::new(req)),
                None => Failed(e.into_error().into()),
            });
        }
    };
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Failed(anyhow::Error::from(e).context("reading the answer")))?
        .to_bytes()
        .to_vec();
    Ok(Response { status, body })
}
