//! Real clients through the proxy, each against a server on loopback whose name is mapped by
//! `[network.hosts]`: python's urllib (HTTP_PROXY, and HTTPS_PROXY against a TLS server),
//! `git clone` over HTTP, and `pip download` from a local simple index. Each skips with a reason
//! when its tool is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use taskbox_egress::{Outcome, Protocol};

const URLLIB: &str = r#"
import ssl, sys, urllib.request
context = ssl.create_default_context(cafile=sys.argv[2]) if len(sys.argv) > 2 else None
with urllib.request.urlopen(sys.argv[1], timeout=20, context=context) as response:
    sys.stdout.write(response.read().decode())
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_urllib_over_http_proxy() {
    if !have("python3") {
        return;
    }
    let server = FileServer::start(None).await;
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        URLLIB,
        &format!("http://app.test:{}/hello", server.port()),
    ]);
    let mut with_proxy = cmd;
    with_proxy.env("HTTP_PROXY", proxy.url());
    // `run` drops the proxy variables of the environment first, then these apply.
    let out = run_keeping(with_proxy, &["HTTP_PROXY"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello from the test server\n");
    let d = proxy.events.wait_for("allowed", |d| d.allowed()).await;
    assert_eq!(d.protocol, Protocol::Forward);

    // A denied name: urllib raises HTTPError 403 with the proxy's reason.
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        URLLIB,
        &format!("http://other.test:{}/hello", server.port()),
    ])
    .env("HTTP_PROXY", proxy.url());
    let out = run_keeping(cmd, &["HTTP_PROXY"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("HTTP Error 403"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_urllib_over_https_proxy_with_tls() {
    if !have("python3") || !have("openssl") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=app.test",
        ])
        .args(["-addext", "subjectAltName=DNS:app.test", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A TLS server on loopback that prints its port, then answers every GET.
    let server_py = r#"
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello over tls\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), H)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;
    let mut child = Command::new("python3")
        .args(["-c", server_py])
        .arg(&cert)
        .arg(&key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().unwrap();
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", URLLIB, &format!("https://app.test:{port}/")])
        .arg(&cert)
        .env("HTTPS_PROXY", proxy.url());
    let out = run_keeping(cmd, &["HTTPS_PROXY"]).await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello over tls\n");
    let d = proxy.events.wait_for("allowed", |d| d.allowed()).await;
    assert_eq!(d.protocol, Protocol::Connect);
}

/// `run`, but keeping the listed proxy variables the command sets itself.
async fn run_keeping(cmd: Command, keep: &[&str]) -> std::process::Output {
    let set: Vec<(String, String)> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some((k.to_str()?.to_owned(), v?.to_str()?.to_owned())))
        .filter(|(k, _)| keep.contains(&k.as_str()))
        .collect();
    let mut cmd = cmd;
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
    for (k, v) in set {
        cmd.env(k, v);
    }
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

fn git(dir: &Path, args: &[&str]) {
    let out = Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", text(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_clone_over_http() {
    if !have("git") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    git(&src, &["init", "-q"]);
    fs::write(src.join("README"), "cloned through the egress proxy\n").unwrap();
    git(&src, &["add", "README"]);
    git(&src, &["commit", "-q", "-m", "first"]);
    let root = dir.path().join("www");
    fs::create_dir(&root).unwrap();
    git(
        dir.path(),
        &["clone", "-q", "--bare", "src", "www/repo.git"],
    );
    // The dumb HTTP protocol: static files plus the index update-server-info writes.
    git(&root.join("repo.git"), &["update-server-info"]);
    let server = FileServer::start(Some(root)).await;
    let proxy = TestProxy::start(rules(&["git.test"], &[], &[("git.test", "127.0.0.1")])).await;
    let url = format!("http://git.test:{}/repo.git", server.port());
    let mut cmd = Command::new("git");
    cmd.args([
        "-c",
        &format!("http.proxy={}", proxy.url()),
        "clone",
        "-q",
        &url,
        "out",
    ])
    .current_dir(dir.path())
    .env("GIT_CONFIG_GLOBAL", "/dev/null")
    .env("GIT_CONFIG_NOSYSTEM", "1")
    .env("GIT_TERMINAL_PROMPT", "0");
    let out = run(cmd).await;
    assert!(out.status.success(), "git clone: {}", text(&out.stderr));
    assert_eq!(
        fs::read_to_string(dir.path().join("out/README")).unwrap(),
        "cloned through the egress proxy\n"
    );
    let allowed = proxy
        .events
        .all()
        .iter()
        .filter(|d| d.allowed() && d.end.is_none())
        .count();
    assert!(allowed >= 2, "one connection per request: {allowed}");

    // The same clone from a name the policy does not allow fails with the proxy's 403.
    let url = format!("http://other.test:{}/repo.git", server.port());
    let mut cmd = Command::new("git");
    cmd.args([
        "-c",
        &format!("http.proxy={}", proxy.url()),
        "clone",
        "-q",
        &url,
        "out2",
    ])
    .current_dir(dir.path())
    .env("GIT_CONFIG_GLOBAL", "/dev/null")
    .env("GIT_CONFIG_NOSYSTEM", "1")
    .env("GIT_TERMINAL_PROMPT", "0");
    let out = run(cmd).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("403"), "{}", text(&out.stderr));
    proxy
        .events
        .wait_for("denied", |d| {
            d.outcome == Outcome::Denied && d.host == "other.test"
        })
        .await;
}

/// A wheel of the package `demo-pkg` 1.0, built by hand (a wheel is a zip with metadata).
const MAKE_WHEEL: &str = include_str!("../../../tests/fixtures/make_wheel.py");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pip_download_from_a_local_index() {
    if !have("python3") {
        return;
    }
    let pip_ok = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !pip_ok {
        skip("python3 -m pip is not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("www");
    let wheel_name = "demo_pkg-1.0-py3-none-any.whl";
    fs::create_dir_all(root.join("files")).unwrap();
    fs::create_dir_all(root.join("simple/demo-pkg")).unwrap();
    let out = Command::new("python3")
        .args(["-c", MAKE_WHEEL])
        .arg(root.join("files").join(wheel_name))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let sha = text(&out.stdout).trim().to_owned();
    fs::write(
        root.join("simple/index.html"),
        "<!DOCTYPE html><html><body><a href=\"demo-pkg/\">demo-pkg</a></body></html>\n",
    )
    .unwrap();
    fs::write(
        root.join("simple/demo-pkg/index.html"),
        format!(
            "<!DOCTYPE html><html><body><a href=\"/files/{wheel_name}#sha256={sha}\">{wheel_name}</a></body></html>\n"
        ),
    )
    .unwrap();
    let server = FileServer::start(Some(root)).await;
    let proxy = TestProxy::start(rules(&["pkg.test"], &[], &[("pkg.test", "127.0.0.1")])).await;
    let dest = dir.path().join("downloads");
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
    ])
    .args(["--retries", "0", "--timeout", "20"])
    .args([
        "--index-url",
        &format!("http://pkg.test:{}/simple/", server.port()),
    ])
    .args(["--trusted-host", "pkg.test", "--proxy", &proxy.url(), "-d"])
    .arg(&dest)
    .arg("demo-pkg")
    .env("PIP_CONFIG_FILE", "/dev/null");
    for (name, _) in std::env::vars() {
        if name.starts_with("PIP_") && name != "PIP_CONFIG_FILE" {
            cmd.env_remove(name);
        }
    }
    let out = run(cmd).await;
    assert!(
        out.status.success(),
        "pip download: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(dest.join(wheel_name).exists());
    let hosts: Vec<String> = proxy
        .events
        .all()
        .iter()
        .filter(|d| d.allowed())
        .map(|d| d.host.clone())
        .collect();
    assert!(hosts.iter().all(|h| h == "pkg.test"), "{hosts:?}");
}
