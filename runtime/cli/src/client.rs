//! A small synchronous HTTP/1.1 client for the supervisor's Unix socket: the CLI verbs are thin
//! clients of `taskbox serve`. If no supervisor answers, one is started in the background.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use taskbox_agent::http::Chunked;

/// A connection target: the supervisor's Unix socket.
pub struct Client {
    socket: PathBuf,
}

/// An HTTP response: status and JSON body (`Value::Null` when empty).
pub struct Response {
    pub status: u16,
    pub body: Value,
}

impl Response {
    /// The body, or the API's error as an `anyhow` error (`code: message`).
    pub fn ok(self) -> Result<Value> {
        if (200..300).contains(&self.status) {
            return Ok(self.body);
        }
        let code = self.body["error"]["code"].as_str().unwrap_or("error");
        let message = self.body["error"]["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("the supervisor answered HTTP {}", self.status));
        Err(anyhow!("{code}: {message}"))
    }
}

/// The default socket: `STATE/taskbox.sock`.
pub fn default_socket(state_dir: &Path) -> PathBuf {
    state_dir.join("taskbox.sock")
}

impl Client {
    /// Connects to the supervisor at `socket`, starting one in the background (and saying so on
    /// stderr) when none answers.
    pub fn connect_or_start(socket: &Path, state_dir: &Path) -> Result<Client> {
        let client = Client {
            socket: socket.to_path_buf(),
        };
        if client.healthy() {
            return Ok(client);
        }
        fs_create_dir(state_dir)?;
        let log_path = state_dir.join("serve.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let exe = std::env::current_exe().context("cannot find the taskbox executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .arg("--socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(state_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        // SAFETY: setsid is async-signal-safe; the supervisor gets its own session so it outlives
        // this command and the terminal's signals.
        unsafe {
            cmd.pre_exec(|| {
                let _ = nix::unistd::setsid();
                Ok(())
            });
        }
        cmd.spawn().context("cannot start a supervisor")?;
        eprintln!(
            "taskbox: no supervisor was running; started one in the background (socket {}, log {})",
            socket.display(),
            log_path.display()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if client.healthy() {
                return Ok(client);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "the supervisor did not come up within 10s; see {}",
            log_path.display()
        )
    }

    fn healthy(&self) -> bool {
        self.request("GET", "/healthz", None)
            .is_ok_and(|r| r.status == 200)
    }

    fn open(&self) -> Result<UnixStream> {
        UnixStream::connect(&self.socket)
            .with_context(|| format!("cannot connect to {}", self.socket.display()))
    }

    /// Sends one request and reads the whole JSON response.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Response> {
        let mut stream = self.open()?;
        send(&mut stream, method, path, body, "application/json")?;
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader)?;
        let raw = read_body(&mut reader, &headers)?;
        let body = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&raw)
                .unwrap_or(Value::String(String::from_utf8_lossy(&raw).into_owned()))
        };
        Ok(Response { status, body })
    }

    /// POSTs `body` and reads the answer as Server-Sent Events, calling `on_event(name, data)`
    /// for each. Returns the status when the server answered with an error instead.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        mut on_event: impl FnMut(&str, &str) -> Result<()>,
    ) -> Result<Option<Response>> {
        let mut stream = self.open()?;
        send(&mut stream, "POST", path, Some(body), "text/event-stream")?;
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader)?;
        if status != 200 {
            let raw = read_body(&mut reader, &headers)?;
            let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
            return Ok(Some(Response { status, body }));
        }
        let chunked = header(&headers, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
        let mut source: Box<dyn BufRead> = if chunked {
            Box::new(BufReader::new(Chunked::new(reader)))
        } else {
            Box::new(reader)
        };
        let mut event = String::new();
        let mut data = String::new();
        let mut line = String::new();
        loop {
            line.clear();
            if source.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                if !data.is_empty() || !event.is_empty() {
                    on_event(&event, &data)?;
                }
                event.clear();
                data.clear();
            } else if let Some(v) = l.strip_prefix("event:") {
                event = v.trim_start().to_string();
            } else if let Some(v) = l.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
    }
}

fn fs_create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

fn send(
    stream: &mut UnixStream,
    method: &str,
    path: &str,
    body: Option<&Value>,
    accept: &str,
) -> Result<()> {
    let payload = match body {
        Some(b) => serde_json::to_vec(b)?,
        None => Vec::new(),
    };
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: taskbox\r\nConnection: close\r\nAccept: {accept}\r\n"
    );
    if body.is_some() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            payload.len()
        ));
    }
    head.push_str("\r\n");
    let mut message = head.into_bytes();
    message.extend_from_slice(&payload);
    // The server may answer (e.g. 404) and close before reading a body: a failed write is not
    // the answer, the response that follows is.
    if let Err(e) = stream.write_all(&message).and_then(|()| stream.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
        && e.kind() != std::io::ErrorKind::ConnectionReset
    {
        return Err(e.into());
    }
    Ok(())
}

type Headers = Vec<(String, String)>;

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn read_head(reader: &mut impl BufRead) -> Result<(u16, Headers)> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("malformed HTTP status line from the supervisor: {line:?}"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

fn read_body(reader: &mut impl BufRead, headers: &Headers) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    if header(headers, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut chunked = Chunked::new(reader);
        chunked.read_to_end(&mut body)?;
    } else if let Some(n) = header(headers, "content-length").and_then(|v| v.parse::<usize>().ok())
    {
        body.resize(n, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(body)
}
