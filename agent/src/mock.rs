//! Scripted model servers for tests and offline evaluation: they speak the real OpenAI
//! chat-completions or Anthropic Messages protocol over real HTTP (or HTTPS, with a certificate
//! the caller brings: [`MockTls`]) on a local TCP socket, answer each request with the next
//! [`Step`] of a script, and record every request they receive.
//!
//! Several scripts can share one server: each has a key, and a request goes to the first script
//! whose key occurs in the request body (e.g. a word of the task's goal), so parallel tasks each
//! follow their own script.
//!
//! A script *by turn* ([`MockServer::by_turn`]) answers with the step of the request's turn (the
//! number of assistant messages in its conversation) instead of the next one, so a task resumed
//! after its process died, which asks again for the turn it had begun, gets the same answer; a
//! [`Step::Delay`] there waits only the first time its turn is asked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ServerConfig, ServerConnection, StreamOwned};
use serde_json::{Value, json};
use taskbox_core::support::lock;

use crate::model::Provider;

/// One scripted answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A model answer: text, tool calls (name and raw JSON arguments), and why it stopped.
    Reply {
        text: String,
        calls: Vec<(String, String)>,
        cut: bool,
        usage: Option<(u64, u64)>,
    },
    /// An HTTP error status (429, 500, ...), with an optional `Retry-After` in seconds.
    Status {
        status: u16,
        retry_after: Option<String>,
    },
    /// Waits before answering with the inner step.
    Delay(Duration, Box<Step>),
    /// Sends the inner step's answer with chunked transfer encoding, in small chunks.
    Chunked(Box<Step>),
}

impl Step {
    /// One tool call.
    pub fn call(name: &str, args: Value) -> Step {
        Step::calls(vec![(name, args)])
    }

    /// Several tool calls in one answer.
    pub fn calls(calls: Vec<(&str, Value)>) -> Step {
        Step::Reply {
            text: String::new(),
            calls: calls
                .into_iter()
                .map(|(n, a)| (n.to_owned(), a.to_string()))
                .collect(),
            cut: false,
            usage: None,
        }
    }

    /// A tool call whose arguments are given as raw text (possibly invalid JSON).
    pub fn raw_call(name: &str, arguments: &str) -> Step {
        Step::Reply {
            text: String::new(),
            calls: vec![(name.to_owned(), arguments.to_owned())],
            cut: false,
            usage: None,
        }
    }

    /// A text answer that ends the model's turn.
    pub fn text(text: &str) -> Step {
        Step::Reply {
            text: text.to_owned(),
            calls: Vec::new(),
            cut: false,
            usage: None,
        }
    }

    /// A text answer cut off at the length limit.
    pub fn cut(text: &str) -> Step {
        Step::Reply {
            text: text.to_owned(),
            calls: Vec::new(),
            cut: true,
            usage: None,
        }
    }

    /// An HTTP error.
    pub fn status(status: u16, retry_after: Option<&str>) -> Step {
        Step::Status {
            status,
            retry_after: retry_after.map(str::to_owned),
        }
    }

    /// Sets the usage the answer reports (input, output tokens).
    pub fn with_usage(mut self, input: u64, output: u64) -> Step {
        if let Step::Reply { usage, .. } = &mut self {
            *usage = Some((input, output));
        }
        self
    }

    /// Waits `d` before answering.
    pub fn delayed(self, d: Duration) -> Step {
        Step::Delay(d, Box::new(self))
    }

    /// Answers with a chunked body.
    pub fn chunked(self) -> Step {
        Step::Chunked(Box::new(self))
    }
}

/// The certificate a mock server presents over HTTPS.
#[derive(Clone)]
pub struct MockTls {
    config: Arc<ServerConfig>,
}

impl std::fmt::Debug for MockTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockTls").finish_non_exhaustive()
    }
}

impl MockTls {
    /// The server's certificate chain (PEM, leaf first) and its private key (PEM).
    pub fn from_pem_files(chain: &Path, key: &Path) -> std::io::Result<MockTls> {
        let bad = |what: &Path, e: &dyn std::fmt::Display| {
            std::io::Error::other(format!("{}: {e}", what.display()))
        };
        let certs = CertificateDer::pem_file_iter(chain)
            .map_err(|e| bad(chain, &e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(chain, &e))?;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, &e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(std::io::Error::other)?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(std::io::Error::other)?;
        Ok(MockTls {
            config: Arc::new(config),
        })
    }
}

/// A request the server received.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Value,
    /// The script that answered it.
    pub script: usize,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct Script {
    key: String,
    steps: Vec<Step>,
    next: usize,
    /// The turns already answered (by-turn scripts).
    served: std::collections::BTreeSet<usize>,
}

struct Shared {
    provider: Provider,
    tls: Option<MockTls>,
    scripts: Mutex<Vec<Script>>,
    received: Mutex<Vec<Received>>,
    stop: AtomicBool,
    by_turn: bool,
}

/// A running mock model server; stopped when dropped.
pub struct MockServer {
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for MockServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MockServer {
    /// A server with one script.
    pub fn start(provider: Provider, steps: Vec<Step>) -> std::io::Result<MockServer> {
        MockServer::keyed(provider, vec![(String::new(), steps)])
    }

    /// A server with several scripts, chosen by key (see the module docs).
    pub fn keyed(
        provider: Provider,
        scripts: Vec<(String, Vec<Step>)>,
    ) -> std::io::Result<MockServer> {
        MockServer::serve("127.0.0.1:0", provider, scripts, None, false)
    }

    /// A server with several scripts answered by turn (see the module docs), listening on
    /// `addr` (`127.0.0.1:0`, or an address of a test's own network namespace link).
    pub fn by_turn(
        addr: &str,
        provider: Provider,
        scripts: Vec<(String, Vec<Step>)>,
    ) -> std::io::Result<MockServer> {
        MockServer::serve(addr, provider, scripts, None, true)
    }

    /// A server with one script that speaks HTTPS with the certificate of `tls`.
    pub fn start_tls(
        provider: Provider,
        steps: Vec<Step>,
        tls: MockTls,
    ) -> std::io::Result<MockServer> {
        MockServer::serve(
            "127.0.0.1:0",
            provider,
            vec![(String::new(), steps)],
            Some(tls),
            false,
        )
    }

    fn serve(
        addr: &str,
        provider: Provider,
        scripts: Vec<(String, Vec<Step>)>,
        tls: Option<MockTls>,
        by_turn: bool,
    ) -> std::io::Result<MockServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            provider,
            tls,
            scripts: Mutex::new(
                scripts
                    .into_iter()
                    .map(|(key, steps)| Script {
                        key,
                        steps,
                        next: 0,
                        served: Default::default(),
                    })
                    .collect(),
            ),
            received: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            by_turn,
        });
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || {
                    let _ = accept(&s, conn);
                });
            }
        });
        Ok(MockServer {
            shared,
            addr,
            thread: Some(thread),
        })
    }

    /// The base URL to configure: `http://127.0.0.1:PORT/v1` for OpenAI (whose paths are
    /// `/chat/completions` below it), `http://127.0.0.1:PORT` for Anthropic. Over HTTPS the
    /// host is `localhost` (`https://localhost:PORT/v1`), the name a test certificate is
    /// usually made for.
    pub fn base_url(&self) -> String {
        match self.shared.tls {
            Some(_) => self.base_url_for("localhost"),
            None => self.base_url_for(&self.addr.ip().to_string()),
        }
    }

    /// The base URL with another host name for this server's address (which must resolve to
    /// 127.0.0.1).
    pub fn base_url_for(&self, host: &str) -> String {
        let scheme = match self.shared.tls {
            Some(_) => "https",
            None => "http",
        };
        let port = self.addr.port();
        match self.shared.provider {
            Provider::Openai => format!("{scheme}://{host}:{port}/v1"),
            Provider::Anthropic => format!("{scheme}://{host}:{port}"),
        }
    }

    /// The requests received so far.
    pub fn received(&self) -> Vec<Received> {
        lock(&self.shared.received).clone()
    }

    /// How many steps of each script have been used.
    pub fn used(&self) -> Vec<usize> {
        lock(&self.shared.scripts).iter().map(|s| s.next).collect()
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept(s: &Shared, conn: TcpStream) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    match &s.tls {
        None => serve(s, conn),
        Some(tls) => {
            let session =
                ServerConnection::new(tls.config.clone()).map_err(std::io::Error::other)?;
            let mut stream = StreamOwned::new(session, conn);
            // A client that refuses the certificate fails the handshake here: nothing is
            // recorded, since no request arrived.
            serve(s, &mut stream)?;
            stream.conn.send_close_notify();
            stream.flush()
        }
    }
}

fn serve<S: Read + Write>(s: &Shared, conn: S) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    let mut length = 0usize;
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
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let mut raw = vec![0u8; length];
    reader.read_exact(&mut raw)?;
    let out = reader.get_mut();
    let expected = match s.provider {
        Provider::Openai => "/v1/chat/completions",
        Provider::Anthropic => "/v1/messages",
    };
    if method != "POST" || path != expected {
        return respond(
            out,
            404,
            None,
            &json!({"error": {"message": "no such route"}}),
        );
    }
    let Ok(body) = serde_json::from_slice::<Value>(&raw) else {
        return respond(
            out,
            400,
            None,
            &json!({"error": {"message": "body is not JSON"}}),
        );
    };
    let text = body.to_string();
    let (index, step) = {
        let mut scripts = lock(&s.scripts);
        let found = scripts
            .iter()
            .position(|sc| !sc.key.is_empty() && text.contains(&sc.key))
            .or_else(|| scripts.iter().position(|sc| sc.key.is_empty()));
        match found {
            Some(i) if s.by_turn => {
                let sc = &mut scripts[i];
                let turn = body["messages"]
                    .as_array()
                    .map(|m| m.iter().filter(|m| m["role"] == "assistant").count())
                    .unwrap_or(0);
                let mut step = sc.steps.get(turn).cloned();
                if !sc.served.insert(turn) {
                    while let Some(Step::Delay(_, inner)) = step {
                        step = Some(*inner);
                    }
                }
                sc.next = sc.next.max(turn + 1);
                (i, step)
            }
            Some(i) => {
                let sc = &mut scripts[i];
                let step = sc.steps.get(sc.next).cloned();
                if step.is_some() {
                    sc.next += 1;
                }
                (i, step)
            }
            None => (usize::MAX, None),
        }
    };
    lock(&s.received).push(Received {
        method,
        path,
        headers,
        body: body.clone(),
        script: index,
    });
    let Some(mut step) = step else {
        return respond(
            out,
            400,
            None,
            &json!({"error": {"message": "mock script exhausted"}}),
        );
    };
    let mut chunked = false;
    loop {
        match step {
            Step::Delay(d, inner) => {
                std::thread::sleep(d);
                step = *inner;
            }
            Step::Chunked(inner) => {
                chunked = true;
                step = *inner;
            }
            _ => break,
        }
    }
    let respond = |out: &mut S, status, retry_after: Option<&str>, body: &Value| {
        if chunked {
            respond_chunked(out, status, body)
        } else {
            respond(out, status, retry_after, body)
        }
    };
    match step {
        Step::Status {
            status,
            retry_after,
        } => respond(
            out,
            status,
            retry_after.as_deref(),
            &json!({"error": {"message": format!("scripted status {status}")}}),
        ),
        Step::Reply {
            text,
            calls,
            cut,
            usage,
        } => {
            let (input, output) = usage.unwrap_or(((raw.len() as u64).div_ceil(4), 20));
            let seq = lock(&s.received).len();
            let answer = match s.provider {
                Provider::Openai => openai_answer(&text, &calls, cut, input, output, seq),
                Provider::Anthropic => anthropic_answer(&text, &calls, cut, input, output, seq),
            };
            respond(out, 200, None, &answer)
        }
        Step::Delay(..) | Step::Chunked(..) => Ok(()),
    }
}

fn openai_answer(
    text: &str,
    calls: &[(String, String)],
    cut: bool,
    input: u64,
    output: u64,
    seq: usize,
) -> Value {
    let tool_calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, (name, args))| {
            json!({"id": format!("call_{seq}_{i}"), "type": "function",
                   "function": {"name": name, "arguments": args}})
        })
        .collect();
    let mut message = json!({"role": "assistant",
        "content": if text.is_empty() { Value::Null } else { Value::String(text.to_owned()) }});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls);
    }
    let finish = if cut {
        "length"
    } else if calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    json!({
        "id": format!("chatcmpl-{seq}"), "object": "chat.completion", "model": "mock",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": input, "completion_tokens": output,
                  "total_tokens": input + output}
    })
}

fn anthropic_answer(
    text: &str,
    calls: &[(String, String)],
    cut: bool,
    input: u64,
    output: u64,
    seq: usize,
) -> Value {
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for (i, (name, args)) in calls.iter().enumerate() {
        // The protocol carries arguments as an object; invalid JSON is sent as a string field
        // so that the harness sees it as a bad argument.
        let input =
            serde_json::from_str::<Value>(args).unwrap_or_else(|_| json!({"_unparsed": args}));
        content.push(json!({"type": "tool_use", "id": format!("toolu_{seq}_{i}"),
                            "name": name, "input": input}));
    }
    let stop = if cut {
        "max_tokens"
    } else if calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    };
    json!({
        "id": format!("msg_{seq}"), "type": "message", "role": "assistant", "model": "mock",
        "content": content, "stop_reason": stop,
        "usage": {"input_tokens": input, "output_tokens": output}
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// The answer in chunks of at most 64 bytes, each flushed on its own (so each is its own TLS
/// record over HTTPS).
fn respond_chunked(out: &mut impl Write, status: u16, body: &Value) -> std::io::Result<()> {
    let payload = body.to_string();
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        reason(status)
    );
    out.write_all(head.as_bytes())?;
    out.flush()?;
    for chunk in payload.as_bytes().chunks(64) {
        out.write_all(format!("{:x};piece\r\n", chunk.len()).as_bytes())?;
        out.write_all(chunk)?;
        out.write_all(b"\r\n")?;
        out.flush()?;
    }
    out.write_all(b"0\r\n\r\n")?;
    out.flush()
}

fn respond(
    out: &mut impl Write,
    status: u16,
    retry_after: Option<&str>,
    body: &Value,
) -> std::io::Result<()> {
    let payload = body.to_string();
    let reason = reason(status);
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        payload.len()
    );
    if let Some(r) = retry_after {
        head.push_str(&format!("Retry-After: {r}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    out.write_all(payload.as_bytes())?;
    out.flush()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Posts a chat request with `assistant` earlier answers; returns the answer's body and
    /// how long it took.
    fn ask(server: &MockServer, key: &str, assistant: usize) -> (Value, Duration) {
        let mut messages = vec![json!({"role": "user", "content": key})];
        for _ in 0..assistant {
            messages.push(json!({"role": "assistant", "content": "ok"}));
            messages.push(json!({"role": "user", "content": "go on"}));
        }
        let body = json!({"model": "m", "messages": messages}).to_string();
        let started = std::time::Instant::now();
        let mut c = TcpStream::connect(server.addr).unwrap();
        write!(
            c,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        let json = out.split_once("\r\n\r\n").unwrap().1;
        (serde_json::from_str(json).unwrap(), started.elapsed())
    }

    fn said(answer: &Value) -> String {
        answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn a_by_turn_script_answers_the_turn_asked_and_delays_only_once() {
        let server = MockServer::by_turn(
            "127.0.0.1:0",
            Provider::Openai,
            vec![
                (
                    "alpha".into(),
                    vec![
                        Step::text("a0"),
                        Step::text("a1").delayed(Duration::from_millis(400)),
                    ],
                ),
                ("beta".into(), vec![Step::text("b0")]),
            ],
        )
        .unwrap();
        assert_eq!(said(&ask(&server, "alpha", 0).0), "a0");
        let (first, took) = ask(&server, "alpha", 1);
        assert_eq!(said(&first), "a1");
        assert!(took >= Duration::from_millis(400), "{took:?}");
        // Asked again (a resumed task): the same answer, at once.
        let (again, took) = ask(&server, "alpha", 1);
        assert_eq!(said(&again), "a1");
        assert!(took < Duration::from_millis(300), "{took:?}");
        assert_eq!(said(&ask(&server, "alpha", 0).0), "a0");
        assert_eq!(said(&ask(&server, "beta", 0).0), "b0");
        // Past the script: the exhausted error.
        let (past, _) = ask(&server, "alpha", 2);
        assert!(
            past["error"]["message"]
                .as_str()
                .unwrap()
                .contains("exhausted")
        );
        assert_eq!(server.used(), [3, 1]);
    }
}
