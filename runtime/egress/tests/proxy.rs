//! The proxy against real servers on loopback and real clients: curl through HTTP forwarding,
//! CONNECT and SOCKS5; what it refuses and why; the events it emits.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use taskbox_egress::{Limits, Outcome, Protocol};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn curl(args: &[&str]) -> Command {
    let mut cmd = Command::new("curl");
    cmd.args(["--silent", "--show-error", "--max-time", "20"])
        .args(args);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_reaches_an_allowed_name_three_ways() {
    if !have("curl") {
        return;
    }
    let server = FileServer::start(None).await;
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let url = format!("http://app.test:{}/hello", server.port());
    let socks = format!("socks5h://{}", proxy.addr);
    for (args, protocol) in [
        (
            vec!["--proxy", proxy.url().as_str(), url.as_str()],
            Protocol::Forward,
        ),
        (
            vec![
                "--proxytunnel",
                "--proxy",
                proxy.url().as_str(),
                url.as_str(),
            ],
            Protocol::Connect,
        ),
        (
            vec!["--proxy", socks.as_str(), url.as_str()],
            Protocol::Socks5,
        ),
    ] {
        let out = run(curl(&args)).await;
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert_eq!(
            text(&out.stdout),
            "hello from the test server\n",
            "{args:?}"
        );
        let allowed = proxy
            .events
            .wait_for("allowed", |d| d.protocol == protocol && d.end.is_none())
            .await;
        assert_eq!(allowed.outcome, Outcome::Allowed);
        assert_eq!(allowed.host, "app.test");
        assert_eq!(allowed.port, server.port());
        assert_eq!(allowed.ip, Some("127.0.0.1".parse().unwrap()));
        assert_eq!(allowed.rule.as_deref(), Some("allow app.test"));
        assert_eq!(allowed.tag, "test-sandbox");
        assert_eq!(allowed.violation(), None);
        let ended = proxy
            .events
            .wait_for("closed", |d| d.id == allowed.id && d.end.is_some())
            .await;
        let end = ended.end.unwrap();
        assert!(end.bytes_down > 27, "{end:?}");
        assert!(end.bytes_up > 10, "{end:?}");
        assert_eq!(end.error, None);
    }
    proxy.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_name_gets_403_and_a_violation() {
    if !have("curl") {
        return;
    }
    let server = FileServer::start(None).await;
    let proxy = TestProxy::start(rules(
        &["app.test"],
        &[],
        &[("app.test", "127.0.0.1"), ("evil.test", "127.0.0.1")],
    ))
    .await;
    let url = format!("http://evil.test:{}/hello", server.port());
    let out = run(curl(&["--include", "--proxy", &proxy.url(), &url])).await;
    let response = text(&out.stdout);
    assert!(
        response.starts_with("HTTP/1.1 403 Forbidden\r\n"),
        "{response}"
    );
    let expected = format!(
        "connect evil.test:{port} denied: not in allowlist; to allow it, add \"evil.test:{port}\" to network.allow\n",
        port = server.port()
    );
    assert!(response.ends_with(&expected), "{response}");
    let denied = proxy
        .events
        .wait_for("denied", |d| d.outcome == Outcome::Denied)
        .await;
    assert_eq!(denied.reason.as_deref(), Some("not in allowlist"));
    assert!(denied.addresses.is_empty());
    let violation = denied.violation().unwrap();
    assert_eq!(violation.kind, "network");
    assert_eq!(format!("{}\n", violation.detail), expected);

    // CONNECT: curl reports the proxy's refusal.
    let out = run(curl(&["--proxytunnel", "--proxy", &proxy.url(), &url])).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("403"), "{}", text(&out.stderr));
    // SOCKS5: "connection not allowed by ruleset".
    let out = run(curl(&[
        "--proxy",
        &format!("socks5h://{}", proxy.addr),
        &url,
    ]))
    .await;
    assert!(!out.status.success());
    // curl names the reply code: 2, "connection not allowed by ruleset".
    assert!(text(&out.stderr).contains("(2)"), "{}", text(&out.stderr));
    let socks = proxy
        .events
        .wait_for("socks denial", |d| d.protocol == Protocol::Socks5)
        .await;
    assert_eq!(socks.outcome, Outcome::Denied);
}

/// Requests `host:port` through the proxy with CONNECT from a raw client: the status line, and
/// for a refusal the body after a newline.
async fn connect_status(proxy: &TestProxy, target: &str) -> String {
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        response.extend_from_slice(&chunk[..n]);
        // A tunnel stays open: its head is all there is to read.
        if n == 0 || response.starts_with(b"HTTP/1.1 200") && response.ends_with(b"\r\n\r\n") {
            break;
        }
    }
    let response = text(&response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    format!("{}\n{body}", head.lines().next().unwrap_or(""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcards_lookalikes_and_ports() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let hosts = [
        ("app.test", "127.0.0.1"),
        ("a.app.test", "127.0.0.1"),
        ("a.b.app.test", "127.0.0.1"),
        ("exact.test", "127.0.0.1"),
        ("exact.test.evil", "127.0.0.1"),
        ("badapp.test", "127.0.0.1"),
        ("blocked.app.test", "127.0.0.1"),
    ];
    let allow_port = format!("exact.test:{port}");
    let proxy = TestProxy::start(rules(
        &["*.app.test", &allow_port],
        &["blocked.app.test"],
        &hosts,
    ))
    .await;
    for (target, ok) in [
        (format!("a.app.test:{port}"), true),
        (format!("A.B.App.Test.:{port}"), true),
        (format!("app.test:{port}"), false), // the apex is not a subdomain
        (format!("badapp.test:{port}"), false),
        (format!("exact.test:{port}"), true),
        (format!("exact.test.evil:{port}"), false), // look-alike
        (format!("exact.test:{}", port.wrapping_add(1).max(1)), false), // another port
        (format!("blocked.app.test:{port}"), false), // deny wins
    ] {
        let status = connect_status(&proxy, &target).await;
        let expected = if ok {
            "HTTP/1.1 200 Connection established"
        } else {
            "HTTP/1.1 403 Forbidden"
        };
        assert!(status.starts_with(expected), "{target}: {status}");
    }
    let deny = proxy
        .events
        .wait_for("deny rule", |d| d.host == "blocked.app.test")
        .await;
    assert_eq!(deny.rule.as_deref(), Some("deny blocked.app.test"));
    assert!(
        deny.hint
            .unwrap()
            .contains("remove \"blocked.app.test\" from network.deny")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_resolving_to_internal_addresses_are_refused() {
    let server = FileServer::start(None).await;
    let port = server.port();
    for (answer, reason) in [
        (&["127.0.0.1"][..], "a loopback address"),
        (&["169.254.169.254"], "a cloud metadata endpoint"),
        (&["192.0.2.1", "10.0.0.7"], "a private address"),
        (&["::ffff:127.0.0.1"], "a loopback address"),
        (&["fd00:ec2::254"], "a cloud metadata endpoint"),
    ] {
        let resolver = ScriptedResolver::new(&[answer]);
        let proxy = TestProxy::start_with(
            rules(&["public.test"], &[], &[]),
            Some(resolver.clone()),
            Limits::default(),
        )
        .await;
        let status = connect_status(&proxy, &format!("public.test:{port}")).await;
        assert!(status.starts_with("HTTP/1.1 403"), "{answer:?}: {status}");
        assert!(status.contains(reason), "{answer:?}: {status}");
        let d = proxy
            .events
            .wait_for("denied", |d| d.outcome == Outcome::Denied)
            .await;
        assert_eq!(d.addresses.len(), answer.len());
        assert!(d.ip.is_some());
        assert_eq!(resolver.calls(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebinding_resolver_cannot_change_the_checked_address() {
    let server = FileServer::start(None).await;
    let port = server.port();
    // The first answer passes (an allow rule names the address); any later one would be the
    // metadata endpoint. The proxy must connect to the address it checked, asking only once.
    let resolver = ScriptedResolver::new(&[&["127.0.0.1"], &["169.254.169.254"]]);
    let allow_ip = format!("127.0.0.1:{port}");
    let proxy = TestProxy::start_with(
        rules(&["rebind.test", &allow_ip], &[], &[]),
        Some(resolver.clone()),
        Limits::default(),
    )
    .await;
    let response = exchange(
        proxy.addr,
        format!("GET http://rebind.test:{port}/hello HTTP/1.1\r\nHost: rebind.test\r\n\r\n")
            .as_bytes(),
    )
    .await;
    let response = text(&response);
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.ends_with("hello from the test server\n"),
        "{response}"
    );
    assert_eq!(resolver.calls(), 1);
    let d = proxy
        .events
        .wait_for("allowed", |d| d.outcome == Outcome::Allowed)
        .await;
    assert_eq!(d.ip, Some("127.0.0.1".parse().unwrap()));
    // The next connection gets the rebound answer, and is refused.
    let status = connect_status(&proxy, &format!("rebind.test:{port}")).await;
    assert!(status.starts_with("HTTP/1.1 403"), "{status}");
    assert!(status.contains("169.254.169.254"), "{status}");
    assert_eq!(resolver.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_literals_need_an_address_rule_and_rules_change_live() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[])).await;
    let target = format!("127.0.0.1:{port}");
    let status = connect_status(&proxy, &target).await;
    assert!(status.starts_with("HTTP/1.1 403"), "{status}");
    assert!(
        status.contains(&format!("add \"127.0.0.1:{port}\" to network.allow")),
        "{status}"
    );
    let status = connect_status(&proxy, &format!("[::1]:{port}")).await;
    assert!(status.starts_with("HTTP/1.1 403"), "{status}");

    // Replace the allowlist of the live proxy: a CIDR rule admits the literal.
    proxy
        .proxy
        .rules()
        .replace(rules(&["127.0.0.0/8"], &[], &[]));
    let status = connect_status(&proxy, &target).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let d = proxy
        .events
        .wait_for("allowed literal", |d| d.outcome == Outcome::Allowed)
        .await;
    assert_eq!(d.rule.as_deref(), Some("allow 127.0.0.0/8"));
    // A name is still not allowed by an address rule.
    let status = connect_status(&proxy, &format!("localhost:{port}")).await;
    assert!(status.starts_with("HTTP/1.1 403"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_requests_are_rewritten() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let response = exchange(
        proxy.addr,
        format!(
            "POST http://user:secret@app.test:{port}/echo-head?x=1 HTTP/1.1\r\nHost: elsewhere\r\n\
             Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n\
             Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Kept: 2\r\nContent-Length: 4\r\n\r\nbody"
        )
        .as_bytes(),
    )
    .await;
    let response = text(&response);
    let (head, echoed) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    // The server's keep-alive became close.
    assert!(head.contains("\r\nConnection: close"), "{head}");
    assert!(!head.contains("keep-alive"), "{head}");
    assert_eq!(
        echoed,
        format!(
            "POST /echo-head?x=1 HTTP/1.1\r\nHost: app.test:{port}\r\nX-Kept: 2\r\nContent-Length: 4\r\n\
             Connection: close\r\n\r\nbody"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_listener() {
    let server = FileServer::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.sock");
    let proxy =
        taskbox_egress::Proxy::builder(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")]))
            .build();
    proxy.listen_unix(&path).unwrap();
    let mut stream = tokio::net::UnixStream::connect(&path).await.unwrap();
    let port = server.port();
    stream
        .write_all(
            format!(
                "CONNECT app.test:{port} HTTP/1.1\r\n\r\nGET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let out = text(&out);
    assert!(
        out.starts_with("HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 OK"),
        "{out}"
    );
    assert!(out.ends_with("hello from the test server\n"), "{out}");
    proxy.shutdown().await;
    assert!(!path.exists(), "the socket is removed at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socks5_protocol_details() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let socks = |request: Vec<u8>| {
        let addr = proxy.addr;
        async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(&[5, 1, 0]).await.unwrap();
            let mut method = [0u8; 2];
            stream.read_exact(&mut method).await.unwrap();
            assert_eq!(method, [5, 0]);
            stream.write_all(&request).await.unwrap();
            let mut reply = [0u8; 10];
            stream.read_exact(&mut reply).await.unwrap();
            (reply, stream)
        }
    };
    let domain = |name: &str, port: u16| {
        let mut r = vec![5, 1, 0, 3, u8::try_from(name.len()).unwrap()];
        r.extend_from_slice(name.as_bytes());
        r.extend_from_slice(&port.to_be_bytes());
        r
    };
    // Allowed, then HTTP through the tunnel.
    let (reply, mut stream) = socks(domain("app.test", port)).await;
    assert_eq!(reply[1], 0x00);
    stream
        .write_all(b"GET /hello HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut body = Vec::new();
    stream.read_to_end(&mut body).await.unwrap();
    assert!(text(&body).ends_with("hello from the test server\n"));
    // Denied by the ruleset.
    assert_eq!(socks(domain("other.test", port)).await.0[1], 0x02);
    // A literal without an address rule.
    let mut v4 = vec![5, 1, 0, 1, 127, 0, 0, 1];
    v4.extend_from_slice(&port.to_be_bytes());
    assert_eq!(socks(v4).await.0[1], 0x02);
    // UDP ASSOCIATE and BIND: command not supported.
    assert_eq!(socks(vec![5, 3, 0, 1, 0, 0, 0, 0, 0, 0]).await.0[1], 0x07);
    assert_eq!(socks(vec![5, 2, 0, 1, 0, 0, 0, 0, 0, 0]).await.0[1], 0x07);
    // Unknown address type.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(&[5, 1, 0, 5, 1, 0, 9, 9, 9, 9])
        .await
        .unwrap();
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.unwrap();
    assert_eq!(reply, [5, 0, 5, 8, 0, 1, 0, 0, 0, 0, 0, 0]);
    // Only authentication methods offered: no acceptable method.
    let reply = exchange(proxy.addr, &[5, 1, 2]).await;
    assert_eq!(reply, [5, 0xff]);
    // SOCKS4 gets a SOCKS4 rejection.
    let reply = exchange(proxy.addr, &[4, 1, 0, 80, 127, 0, 0, 1, 0]).await;
    assert_eq!(reply, [0, 0x5b, 0, 0, 0, 0, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_gets_an_error_and_no_panic() {
    let panicked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = panicked.clone();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        default_hook(info);
    }));
    let server = FileServer::start(None).await;
    let limits = Limits {
        max_header_bytes: 4096,
        handshake_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let proxy = TestProxy::start_with(
        rules(&["app.test"], &[], &[("app.test", "127.0.0.1")]),
        None,
        limits,
    )
    .await;

    let response = text(&exchange(proxy.addr, b"hello there\r\n\r\n").await);
    assert!(
        response.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{response}"
    );
    assert!(response.contains("not an HTTP proxy request"), "{response}");
    let response =
        text(&exchange(proxy.addr, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03").await);
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    let response = text(&exchange(proxy.addr, b"GET /local HTTP/1.1\r\nHost: x\r\n\r\n").await);
    assert!(response.contains("needs an absolute URL"), "{response}");
    let response = text(&exchange(proxy.addr, b"GET https://app.test/ HTTP/1.1\r\n\r\n").await);
    assert!(response.contains("use CONNECT"), "{response}");
    let huge = format!(
        "GET http://app.test/ HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(8000)
    );
    let response = text(&exchange(proxy.addr, huge.as_bytes()).await);
    assert!(response.starts_with("HTTP/1.1 431"), "{response}");
    let response = text(&exchange(proxy.addr, b"CONNECT bad_name!:443 HTTP/1.1\r\n\r\n").await);
    assert!(response.starts_with("HTTP/1.1 403"), "{response}");
    assert!(response.contains("contains '!'"), "{response}");
    // Slow or silent clients are dropped after the handshake timeout.
    let response = text(&exchange(proxy.addr, b"GET http://app.test/ HT").await);
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    let silent = exchange(proxy.addr, b"").await;
    assert!(silent.is_empty());
    let silent = exchange(proxy.addr, &[5, 1]).await;
    assert!(silent.is_empty());

    // Pseudo-random bytes, many times: an answer or a close, never a panic.
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    for round in 0..200u32 {
        let len = 1 + (round as usize * 37) % 300;
        let mut bytes = Vec::with_capacity(len);
        for _ in 0..len {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            bytes.push((seed >> 24) as u8);
        }
        if round % 3 == 0 {
            bytes[0] = 5; // exercise the SOCKS parser too
        }
        let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
        let _ = stream.write_all(&bytes).await;
        let _ = stream.shutdown().await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    }
    // Still serving.
    let port = server.port();
    let status = connect_status(&proxy, &format!("app.test:{port}")).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while proxy.proxy.active_connections() > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(proxy.proxy.active_connections(), 0);
    proxy.proxy.shutdown().await;
    assert!(
        !panicked.load(std::sync::atomic::Ordering::SeqCst),
        "a connection task panicked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_shutdown_ends_the_rest() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let limits = Limits {
        idle_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let proxy = TestProxy::start_with(
        rules(&["app.test"], &[], &[("app.test", "127.0.0.1")]),
        None,
        limits,
    )
    .await;
    // A tunnel with nothing moving: closed after the idle timeout.
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(format!("CONNECT app.test:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let ended = proxy.events.wait_for("idle end", |d| d.end.is_some()).await;
    assert!(ended.end.unwrap().error.unwrap().starts_with("idle for"));

    // Shutdown ends an open tunnel and reports it.
    let proxy = TestProxy::start(rules(&["app.test"], &[], &[("app.test", "127.0.0.1")])).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(format!("CONNECT app.test:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut status = [0u8; 39];
    stream.read_exact(&mut status).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), proxy.proxy.shutdown())
        .await
        .unwrap();
    let ended = proxy
        .events
        .wait_for("shutdown end", |d| d.end.is_some())
        .await;
    assert_eq!(ended.end.unwrap().error.as_deref(), Some("proxy shut down"));
    assert!(TcpStream::connect(proxy.addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_file_drives_the_proxy_and_bad_patterns_are_named() {
    let server = FileServer::start(None).await;
    let port = server.port();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net.toml");
    std::fs::write(
        &path,
        format!(
            "[network]\nmode = \"proxy\"\nallow = [\"*.pkg.test:{port}\"]\ndeny = [\"bad.pkg.test\"]\n\
             [network.hosts]\n\"files.pkg.test\" = [\"127.0.0.1\"]\n\"bad.pkg.test\" = [\"127.0.0.1\"]\n"
        ),
    )
    .unwrap();
    let (policy, _) = taskbox_core::policy::resolve(path.to_str().unwrap()).unwrap();
    let proxy = TestProxy::start(taskbox_egress::Rules::from_policy(&policy.network)).await;
    let status = connect_status(&proxy, &format!("files.pkg.test:{port}")).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let status = connect_status(&proxy, &format!("bad.pkg.test:{port}")).await;
    assert!(
        status.contains("matches \"bad.pkg.test\" in network.deny"),
        "{status}"
    );

    for (pattern, why) in [
        (
            "*.pkg.test:http",
            "port \"http\" is not a number from 1 to 65535",
        ),
        (
            "pkg.*.test",
            "'*' may only be the whole first label, as in *.example.com",
        ),
        (
            "10.0.0.1/8",
            "host bits are set past the prefix; did you mean 10.0.0.0/8?",
        ),
    ] {
        std::fs::write(
            &path,
            format!("[network]\nmode = \"proxy\"\nallow = [\"ok.test\", \"{pattern}\"]\n"),
        )
        .unwrap();
        let err = taskbox_core::policy::resolve(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "{}: network.allow[1]: invalid pattern \"{pattern}\": {why}",
                path.display()
            )
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_are_intact_spliced_and_copied() {
    let dir = tempfile::tempdir().unwrap();
    let mut data = Vec::with_capacity(8 << 20);
    let mut seed: u32 = 12345;
    while data.len() < 8 << 20 {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
        data.extend_from_slice(&seed.to_le_bytes());
    }
    std::fs::write(dir.path().join("big.bin"), &data).unwrap();
    let server = FileServer::start(Some(dir.path().to_owned())).await;
    let port = server.port();
    for pipe_bytes in [256 * 1024, 0] {
        let limits = Limits {
            pipe_bytes,
            buffer_bytes: 8 * 1024,
            ..Limits::default()
        };
        let proxy = TestProxy::start_with(
            rules(&["app.test"], &[], &[("app.test", "127.0.0.1")]),
            None,
            limits,
        )
        .await;
        for request in [
            format!(
                "CONNECT app.test:{port} HTTP/1.1\r\n\r\nGET /big.bin HTTP/1.1\r\nHost: app.test\r\n\r\n"
            ),
            format!("GET http://app.test:{port}/big.bin HTTP/1.1\r\n\r\n"),
        ] {
            let response = exchange(proxy.addr, request.as_bytes()).await;
            // Heads first, the body last: compare the tail.
            assert!(
                response.len() >= data.len(),
                "pipe {pipe_bytes}: {} bytes",
                response.len()
            );
            assert!(
                response[response.len() - data.len()..] == data[..],
                "pipe {pipe_bytes}: body differs"
            );
        }
        let ended = proxy.events.wait_for("end", |d| d.end.is_some()).await;
        assert!(ended.end.unwrap().bytes_down >= data.len() as u64);
        proxy.proxy.shutdown().await;
    }
}
