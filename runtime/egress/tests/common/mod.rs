//! Helpers of the egress tests: a static HTTP server on loopback, a proxy with an event log,
//! resolvers that answer from a script, and skipping when a client tool is missing.

#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use taskbox_egress::{Decision, Limits, Proxy, Resolver, Rules};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Prints why a test is skipped; fails instead when `TASKBOX_REQUIRE_ALL=1`.
pub fn skip(reason: &str) {
    if std::env::var("TASKBOX_REQUIRE_ALL").as_deref() == Ok("1") {
        panic!("required test skipped: {reason}");
    }
    eprintln!("skipped: {reason}");
}

/// Whether `tool --version` (`openssl version`) runs; otherwise skips with a reason.
pub fn have(tool: &str) -> bool {
    let version = if tool == "openssl" {
        "version"
    } else {
        "--version"
    };
    let ok = Command::new(tool)
        .arg(version)
        .output()
        .is_ok_and(|out| out.status.success());
    if !ok {
        skip(&format!("{tool} is not installed"));
    }
    ok
}

/// A static file server on 127.0.0.1: GET and HEAD of files under `root` (a directory serves its
/// index.html), one request per connection; `/hello` answers "hello from the test server".
pub struct FileServer {
    pub addr: SocketAddr,
}

impl FileServer {
    pub async fn start(root: Option<PathBuf>) -> FileServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let root = Arc::new(root);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let root = root.clone();
                tokio::spawn(async move {
                    let _ = serve_file(stream, root.as_ref().as_deref()).await;
                });
            }
        });
        FileServer { addr }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

async fn serve_file(mut stream: TcpStream, root: Option<&Path>) -> io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (method, path) = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        if let Ok(httparse::Status::Complete(_)) = req.parse(&buf) {
            break (req.method.unwrap().to_owned(), req.path.unwrap().to_owned());
        }
    };
    let path = path.split('?').next().unwrap_or("/").to_owned();
    let mut content_type = "application/octet-stream";
    let body: Option<Vec<u8>> = if path == "/hello" {
        Some(b"hello from the test server\n".to_vec())
    } else if let Some(rest) = path.strip_prefix("/echo-head") {
        let _ = rest;
        Some(buf.clone())
    } else if let Some(root) = root {
        let rel = path.trim_start_matches('/');
        if rel.split('/').any(|seg| seg == "..") {
            None
        } else {
            let mut file = root.join(rel);
            if file.is_dir() {
                file = file.join("index.html");
            }
            if file.extension().is_some_and(|e| e == "html") {
                content_type = "text/html";
            }
            std::fs::read(&file).ok()
        }
    } else {
        None
    };
    let (status, body) = match body {
        Some(body) => ("200 OK", body),
        None => ("404 Not Found", b"not found\n".to_vec()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: {content_type}\r\nConnection: keep-alive\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if method != "HEAD" {
        stream.write_all(&body).await?;
    }
    stream.shutdown().await
}

/// Every decision a proxy emitted.
#[derive(Clone, Default)]
pub struct Events(pub Arc<Mutex<Vec<Decision>>>);

impl Events {
    pub fn all(&self) -> Vec<Decision> {
        self.0.lock().unwrap().clone()
    }

    /// Waits (up to 10 s) until an event satisfies `pred`, and returns it.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&Decision) -> bool) -> Decision {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(found) = self.all().into_iter().find(|d| pred(d)) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no event {what}; events: {:#?}",
                self.all()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Rules from patterns and `[network.hosts]` entries.
pub fn rules(allow: &[&str], deny: &[&str], hosts: &[(&str, &str)]) -> Rules {
    let mut map: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for (name, ip) in hosts {
        map.entry((*name).to_owned())
            .or_default()
            .push(ip.parse().unwrap());
    }
    Rules::new(
        allow.iter().map(|p| p.parse().unwrap()).collect(),
        deny.iter().map(|p| p.parse().unwrap()).collect(),
        map,
    )
}

/// A proxy on 127.0.0.1 with its event log.
pub struct TestProxy {
    pub proxy: Proxy,
    pub addr: SocketAddr,
    pub events: Events,
}

impl TestProxy {
    pub async fn start(rules: Rules) -> TestProxy {
        TestProxy::start_with(rules, None, Limits::default()).await
    }

    pub async fn start_with(
        rules: Rules,
        resolver: Option<Arc<dyn Resolver>>,
        limits: Limits,
    ) -> TestProxy {
        let events = Events::default();
        let log = events.0.clone();
        let mut builder = Proxy::builder(rules)
            .tag("test-sandbox")
            .limits(limits)
            .on_decision(move |d| log.lock().unwrap().push(d.clone()));
        if let Some(resolver) = resolver {
            builder = builder.resolver(resolver);
        }
        let proxy = builder.build();
        let addr = proxy
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        TestProxy {
            proxy,
            addr,
            events,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Answers from a list, one answer per call (the last repeating), and counts the calls.
pub struct ScriptedResolver {
    answers: Vec<Vec<IpAddr>>,
    pub calls: AtomicUsize,
}

impl ScriptedResolver {
    pub fn new(answers: &[&[&str]]) -> Arc<ScriptedResolver> {
        Arc::new(ScriptedResolver {
            answers: answers
                .iter()
                .map(|a| a.iter().map(|ip| ip.parse().unwrap()).collect())
                .collect(),
            calls: AtomicUsize::new(0),
        })
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Resolver for ScriptedResolver {
    fn resolve<'a>(
        &'a self,
        _name: &'a str,
        _port: u16,
    ) -> Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let answer = self.answers[call.min(self.answers.len() - 1)].clone();
        Box::pin(async move { Ok(answer) })
    }
}

/// Runs a command off the async threads, without proxy variables from the environment.
pub async fn run(mut cmd: Command) -> Output {
    for var in [
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
    ] {
        cmd.env_remove(var);
    }
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Sends `request` on a new connection to `addr` and reads until the proxy closes it (at most
/// 10 s).
pub async fn exchange(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    out
}
