//! The supervisor's client: the CLI verbs are thin clients of `taskbox serve` on its Unix socket,
//! over the agent's HTTP client (hyper). If no supervisor answers, one is started in the
//! background.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use taskbox_agent::http;
use taskbox_server::idempotency::{IdempotencyKey, REPLAYED_HEADER};

/// A command may run as long as it likes: the CLI waits for the supervisor's answer.
const NO_DEADLINE: Duration = Duration::MAX;

/// A connection target: the supervisor's Unix socket.
pub struct Client {
    http: http::Client,
}

/// An HTTP response: status and JSON body (`Value::Null` when empty).
pub struct Response {
    pub status: u16,
    pub body: Value,
    /// The answer is a replay of an earlier request with the same idempotency key
    /// (`Idempotent-Replayed: true`).
    pub replayed: bool,
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
            http: http::Client::unix(socket)?,
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

    /// Sends one request and reads the whole JSON response.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Response> {
        self.request_keyed(method, path, body, None)
    }

    /// As [`Client::request`], with an `Idempotency-Key` when `key` is given: a retry with the
    /// same key is done once by the supervisor, and answered as the first time.
    pub fn request_keyed(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        key: Option<&IdempotencyKey>,
    ) -> Result<Response> {
        let payload = body.map(serde_json::to_vec).transpose()?;
        let mut req = http::Request::new(method, path);
        req.body = payload.as_deref();
        if let Some(k) = key {
            req.headers.push(("Idempotency-Key", k.header_value()));
        }
        self.send(&req)
    }

    /// A request whose body is `body` as it is (a file's content), answered with JSON.
    pub fn request_raw(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<Response> {
        let mut req = http::Request::new(method, path);
        req.body = body;
        self.send(&req)
    }

    fn send(&self, req: &http::Request<'_>) -> Result<Response> {
        let r = self.http.send(req, NO_DEADLINE)?;
        let body = if r.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&r.body)
                .unwrap_or(Value::String(String::from_utf8_lossy(&r.body).into_owned()))
        };
        Ok(Response {
            status: r.status,
            replayed: r.header(REPLAYED_HEADER) == Some("true"),
            body,
        })
    }

    /// POSTs `body` and reads the answer as Server-Sent Events, calling `on_event(name, data)`
    /// for each. Returns the status when the server answered with an error instead.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        mut on_event: impl FnMut(&str, &str) -> Result<()>,
    ) -> Result<Option<Response>> {
        let payload = serde_json::to_vec(body)?;
        let mut req = http::Request::new("POST", path);
        req.body = Some(&payload);
        req.accept = "text/event-stream";
        let mut stream = self.http.open(&req, NO_DEADLINE)?;
        if stream.status != 200 {
            let status = stream.status;
            let raw = stream.read_all()?;
            let body = serde_json::from_slice(&raw).unwrap_or(Value::Null);
            return Ok(Some(Response {
                status,
                body,
                replayed: false,
            }));
        }
        let mut event = String::new();
        let mut data = String::new();
        loop {
            let Some(l) = stream.next_line()? else {
                return Ok(None);
            };
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
