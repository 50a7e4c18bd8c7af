//! Inspected hosts: secrets presented by the proxy and request rules, against TLS servers on
//! loopback whose certificates a CA made by the test signs (the proxy is told to trust it, as a
//! supervisor would be). The clients trust the sandbox's CA the proxy made, and the test CA for
//! the hosts that stay plain tunnels.
//!
//! Shown here: a bound host gets the secret, in each way it can be presented; another host, a
//! look-alike name, a redirect target and a plain-HTTP request do not; rotation and revocation
//! apply to the next request; an upstream with a bad certificate is refused with a denial that
//! says so; method and path rules refuse with the policy's reason, in the 403 and the event;
//! ambiguous paths, another `Host` and protocol upgrades are refused; SOCKS5 by name is inspected
//! like `CONNECT`; curl and python's
//! `requests` work with the CA bundle the sandbox is given.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;
mod tlsutil;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};

use common::{Events, have, run, text};
use taskbox_core::api::SecretValue;
use taskbox_core::egress::{EgressConfig, SandboxTrust, resolve_secrets};
use taskbox_egress::{Decision, Outcome, Proxy, Rules};
use tlsutil::{TestCa, Upstream, client_config, http_forward, https};

const GH: &str = "gh-s3cret-value-0a1b2c3d4e5f";
const QK: &str = "qk-s3cret/value+with=odd&chars";
const IDX: &str = "idx-s3cret-value-99887766";

/// Every name the tests use, and the certificate's names.
const NAMES: &[&str] = &[
    "api.test",
    "sub.api.test",
    "other.test",
    "api.test.evil.test",
    "apitest",
    "pkg.test",
];

fn policy_text() -> String {
    let hosts: String = NAMES
        .iter()
        .map(|n| format!("\"{n}\" = [\"127.0.0.1\"]\n"))
        .collect();
    format!(
        r#"
[network]
mode = "proxy"
allow = ["api.test", "*.api.test", "other.test", "api.test.evil.test", "apitest", "pkg.test"]

[network.hosts]
{hosts}
[[network.requests]]
hosts = ["pkg.test"]
allow = ["GET /simple/**", "HEAD /simple/**"]
deny = ["POST"]
deny_reason = "the package index is read-only for this task"

[secrets.gh]
from_api = true
hosts = ["api.test"]
header = "Authorization"

[secrets.qk]
from_api = true
hosts = ["api.test"]
query = "key"

[secrets.idx]
from_api = true
hosts = ["*.api.test"]
basic_user = "ci"
"#
    )
}

struct Setup {
    proxy: Proxy,
    addr: std::net::SocketAddr,
    events: Events,
    upstream: Upstream,
    ca: TestCa,
    trust: SandboxTrust,
}

impl Setup {
    async fn start() -> Setup {
        let ca = TestCa::new("test CA of the secrets suite");
        let upstream = Upstream::start(Some(ca.server(NAMES))).await;
        let policy = taskbox_core::policy::parse(&policy_text(), "secrets.toml").unwrap();
        let given: BTreeMap<String, SecretValue> = [("gh", GH), ("qk", QK), ("idx", IDX)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), SecretValue::new(v)))
            .collect();
        let secrets = resolve_secrets(&policy, &given).unwrap();
        let events = Events::default();
        let log: Arc<Mutex<Vec<Decision>>> = events_log(&events);
        let proxy = Proxy::builder(Rules::from_policy(&policy.network))
            .tag("sb-secrets")
            .on_decision(move |d| log.lock().unwrap().push(d.clone()))
            .inspect(
                EgressConfig {
                    network: policy.network.clone(),
                    secrets,
                },
                Some(ca.pem.as_bytes()),
            )
            .unwrap()
            .build();
        let addr = proxy
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let trust = proxy.trust().unwrap();
        Setup {
            proxy,
            addr,
            events,
            upstream,
            ca,
            trust,
        }
    }

    fn placeholder(&self, var: &str) -> String {
        self.trust
            .placeholders
            .iter()
            .find(|(k, _)| k == var)
            .map(|(_, v)| v.clone())
            .unwrap()
    }

    /// A client that trusts the sandbox's CA and the test CA (for the plain tunnels).
    fn client(&self) -> Arc<rustls::ClientConfig> {
        client_config(&[&self.trust.ca_cert, &self.ca.pem])
    }

    async fn get(
        &self,
        host: &str,
        target: &str,
        headers: &[(&str, &str)],
    ) -> Result<tlsutil::Got, String> {
        let mut got = https(
            self.addr,
            host,
            self.upstream.port(),
            self.client(),
            &[("GET", target, headers)],
        )
        .await?;
        Ok(got.remove(0))
    }
}

/// The list the proxy's subscriber pushes into, which `events` reads.
fn events_log(events: &Events) -> Arc<Mutex<Vec<Decision>>> {
    events.0.clone()
}

fn no_value_in(what: &str, text: &str) {
    for value in [GH, QK, IDX, "qk-s3cret%2Fvalue%2Bwith%3Dodd%26chars"] {
        assert!(!text.contains(value), "{what} holds a secret: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_host_gets_the_secret_and_no_other_host_does() {
    let s = Setup::start().await;
    let gh = s.placeholder("TASKBOX_SECRET_GH");
    let qk = s.placeholder("TASKBOX_SECRET_QK");
    let bearer = format!("Bearer {gh}");
    let custom = format!("token {gh}");
    let headers: &[(&str, &str)] = &[("authorization", &bearer), ("x-custom", &custom)];
    let target = format!("/echo?x=1&key={qk}");

    // The bound host: each placeholder replaced, each presentation made.
    let got = s.get("api.test", &target, headers).await.unwrap();
    assert_eq!(got.status, 200, "{got:?}");
    assert!(
        got.body
            .starts_with("GET /echo?x=1&key=qk-s3cret%2Fvalue%2Bwith%3Dodd%26chars\n"),
        "{}",
        got.body
    );
    assert!(
        got.body.contains(&format!("authorization: Bearer {GH}\n")),
        "{}",
        got.body
    );
    assert!(
        got.body.contains(&format!("x-custom: token {GH}\n")),
        "{}",
        got.body
    );
    assert!(
        !got.body.contains(&gh) && !got.body.contains(&qk),
        "{}",
        got.body
    );

    // A subdomain carries only what is bound to it (basic authentication of "ci").
    let got = s.get("sub.api.test", "/echo", headers).await.unwrap();
    use base64::Engine as _;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("ci:{IDX}"));
    assert!(
        got.body
            .contains(&format!("authorization: Basic {basic}\n")),
        "{}",
        got.body
    );
    assert!(
        got.body.contains(&format!("x-custom: token {gh}\n")),
        "{}",
        got.body
    );

    // Another host, and names that only look like the bound one: the placeholder goes out as
    // the client sent it (they are plain tunnels, the proxy does not even read them).
    for host in ["other.test", "api.test.evil.test", "apitest"] {
        let got = s.get(host, &target, headers).await.unwrap();
        assert_eq!(got.status, 200, "{host}: {got:?}");
        assert!(
            got.body.contains(&format!("authorization: Bearer {gh}\n")),
            "{host}: {}",
            got.body
        );
        assert!(
            got.body.contains(&format!("key={qk}")),
            "{host}: {}",
            got.body
        );
        no_value_in(host, &got.body);
    }

    // A redirect to another host: the proxy does not follow it; the client that follows it
    // and sends the placeholder again gets it sent as is.
    let to = format!("https://other.test:{}/landing", s.upstream.port());
    let got = s
        .get("api.test", &format!("/redirect?to={to}"), headers)
        .await
        .unwrap();
    assert_eq!(got.status, 302);
    assert!(
        got.headers.contains(&format!("location: {to}")),
        "{}",
        got.headers
    );
    let got = s.get("other.test", "/landing", headers).await.unwrap();
    assert!(got.body.starts_with("GET /landing\n"), "{}", got.body);
    assert!(got.body.contains(&format!("authorization: Bearer {gh}\n")));
    no_value_in("the redirect target", &got.body);

    // What the upstream saw: the value only on the bound names.
    for head in s.upstream.seen() {
        let first = head.lines().next().unwrap_or("");
        let host = head
            .lines()
            .find_map(|l| l.strip_prefix("host: "))
            .unwrap_or("")
            .split(':')
            .next()
            .unwrap_or("")
            .to_owned();
        match host.as_str() {
            "api.test" | "sub.api.test" => {}
            _ => no_value_in(&format!("{host} {first}"), &head),
        }
    }

    // The audit: one event per request that carried secrets, with their names only; and the
    // process-wide counts.
    let events = s.events.all();
    let uses: Vec<(String, Vec<String>)> = events
        .iter()
        .filter_map(|d| {
            d.request
                .as_ref()
                .map(|r| (d.host.clone(), r.secrets.clone()))
        })
        .collect();
    assert!(
        uses.contains(&("api.test".into(), vec!["gh".into(), "qk".into()])),
        "{uses:?}"
    );
    assert!(
        uses.contains(&("sub.api.test".into(), vec!["idx".into()])),
        "{uses:?}"
    );
    assert!(
        uses.iter()
            .all(|(h, _)| h == "api.test" || h == "sub.api.test"),
        "{uses:?}"
    );
    let inspected: Vec<&Decision> = events.iter().filter(|d| d.inspected).collect();
    assert!(
        inspected.iter().all(|d| d.host.ends_with("api.test")),
        "{inspected:#?}"
    );
    no_value_in("the events", &serde_json::to_string(&events).unwrap());
    no_value_in("the events' Debug", &format!("{events:?}"));
    no_value_in("the trust", &format!("{:?}", s.trust));
    no_value_in(
        "the trust's placeholders",
        &format!("{:?}", s.trust.placeholders),
    );
    let counted = taskbox_egress::audit::secret_uses();
    let gh_uses = counted
        .iter()
        .find(|u| u.sandbox == "sb-secrets" && u.secret == "gh" && u.host == "api.test")
        .unwrap();
    assert!(gh_uses.uses >= 2, "{counted:?}");
    s.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socks5_to_a_bound_name_is_inspected_too() {
    let s = Setup::start().await;
    let gh = s.placeholder("TASKBOX_SECRET_GH");
    let bearer = format!("Bearer {gh}");
    let got = tlsutil::socks5_https(
        s.addr,
        "api.test",
        s.upstream.port(),
        s.client(),
        &[("GET", "/via-socks", &[("authorization", &bearer)])],
    )
    .await
    .unwrap();
    assert!(
        got[0]
            .body
            .contains(&format!("authorization: Bearer {GH}\n")),
        "{}",
        got[0].body
    );
    let d = s
        .events
        .wait_for("the socks connection", |d| {
            d.protocol == taskbox_egress::Protocol::Socks5 && d.inspected
        })
        .await;
    assert_eq!(d.host, "api.test");
    s.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_and_revocation_apply_to_the_next_request() {
    let s = Setup::start().await;
    let gh = s.placeholder("TASKBOX_SECRET_GH");
    let bearer = format!("Bearer {gh}");
    let headers: &[(&str, &str)] = &[("authorization", &bearer)];
    let client = s.client();
    let tcp_requests: &[tlsutil::Req<'_>] = &[("GET", "/one", headers)];
    let got = https(
        s.addr,
        "api.test",
        s.upstream.port(),
        client.clone(),
        tcp_requests,
    )
    .await
    .unwrap();
    assert!(
        got[0].body.contains(&format!("Bearer {GH}")),
        "{}",
        got[0].body
    );
    let status = s
        .proxy
        .set_secret("gh", Some(SecretValue::new("gh-rotated-value-1234")))
        .unwrap();
    assert_eq!((status.state.as_str(), status.rotations), ("active", 1));
    let got = s.get("api.test", "/two", headers).await.unwrap();
    assert!(
        got.body.contains("Bearer gh-rotated-value-1234"),
        "{}",
        got.body
    );
    assert!(!got.body.contains(GH));
    // Revoked: the request goes out as the client sent it, placeholder and all.
    let status = s.proxy.set_secret("gh", None).unwrap();
    assert_eq!(status.state, "revoked");
    let got = s.get("api.test", "/three", headers).await.unwrap();
    assert!(
        got.body.contains(&format!("authorization: Bearer {gh}\n")),
        "{}",
        got.body
    );
    assert!(!got.body.contains("gh-rotated-value-1234"));
    // The other secrets of the host are still presented.
    assert!(got.body.contains("key=qk-s3cret"), "{}", got.body);
    // A rotation brings it back.
    s.proxy
        .set_secret("gh", Some(SecretValue::new("gh-third-value-5678")))
        .unwrap();
    let got = s.get("api.test", "/four", headers).await.unwrap();
    assert!(
        got.body.contains("Bearer gh-third-value-5678"),
        "{}",
        got.body
    );
    let err = s.proxy.set_secret("nope", None).unwrap_err();
    assert_eq!(err.code(), "not_found");
    assert!(err.to_string().contains("gh, qk, idx") || err.to_string().contains("its secrets"));
    assert_eq!(s.proxy.secrets().len(), 3);
    s.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_with_a_bad_certificate_is_refused_with_a_denial_that_says_so() {
    let s = Setup::start().await;
    // A server whose certificate a CA the proxy does not trust signed, and one whose
    // certificate (by the trusted CA) is for another name.
    let stranger = TestCa::new("a CA nobody trusts");
    for (upstream, why) in [
        (
            Upstream::start(Some(stranger.server(NAMES))).await,
            "UnknownIssuer",
        ),
        (
            Upstream::start(Some(s.ca.server(&["elsewhere.test"]))).await,
            "not valid for name \"api.test\"",
        ),
    ] {
        let got = https(
            s.addr,
            "api.test",
            upstream.port(),
            s.client(),
            &[("GET", "/x", &[("authorization", "Bearer x")])],
        )
        .await
        .unwrap();
        assert_eq!(got[0].status, 502, "{got:?}");
        assert!(
            got[0].body.contains(&format!(
                "connect api.test:{} denied: the certificate of api.test:{} is not valid",
                upstream.port(),
                upstream.port()
            )),
            "{}",
            got[0].body
        );
        assert!(got[0].body.contains(why), "{}", got[0].body);
        assert!(
            got[0].headers.contains("x-taskbox-egress: denied"),
            "{}",
            got[0].headers
        );
        assert!(
            upstream.seen().is_empty(),
            "the request reached the upstream"
        );
        let port = upstream.port();
        let d = s
            .events
            .wait_for("denial", |d| d.port == port && d.outcome == Outcome::Denied)
            .await;
        let v = d.violation().unwrap();
        assert_eq!(v.kind, "network");
        assert!(v.detail.contains("is not valid"), "{}", v.detail);
        assert!(d.hint.as_deref().unwrap_or("").contains("certificate"));
    }
    s.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_and_path_rules_refuse_with_the_policys_reason() {
    let s = Setup::start().await;
    let reason = "the package index is read-only for this task";
    let got = https(
        s.addr,
        "pkg.test",
        s.upstream.port(),
        s.client(),
        &[
            ("GET", "/simple/demo/", &[]),
            ("HEAD", "/simple/", &[]),
            ("POST", "/simple/demo/", &[]),
            ("GET", "/admin", &[]),
            ("GET", "/simple/../admin", &[]),
            ("GET", "/simple/%2e%2e/admin", &[]),
            ("GET", "/simple/x", &[]),
        ],
    )
    .await
    .unwrap();
    let statuses: Vec<u16> = got.iter().map(|g| g.status).collect();
    assert_eq!(statuses, [200, 200, 403, 403, 400, 400, 200], "{got:#?}");
    let port = s.upstream.port();
    assert_eq!(
        got[2].body,
        format!(
            "request POST pkg.test:{port}/simple/demo/ denied: {reason}; the policy's network.requests[0] decides requests to this host\n"
        )
    );
    assert!(
        got[3].body.contains(&format!(
            "request GET pkg.test:{port}/admin denied: {reason}"
        )),
        "{}",
        got[3].body
    );
    assert!(got[4].body.contains("ambiguous paths"), "{}", got[4].body);
    // Only the allowed requests reached the server.
    let seen: Vec<String> = s
        .upstream
        .seen()
        .iter()
        .map(|h| h.lines().next().unwrap().to_owned())
        .collect();
    assert_eq!(
        seen,
        ["GET /simple/demo/", "HEAD /simple/", "GET /simple/x"]
    );
    // Each refusal is an event, hence a violation of the exec, with the reason.
    let denied: Vec<Decision> = s
        .events
        .all()
        .into_iter()
        .filter(|d| d.request.is_some() && d.outcome == Outcome::Denied)
        .collect();
    assert_eq!(denied.len(), 4, "{denied:#?}");
    assert_eq!(denied[0].rule.as_deref(), Some("deny POST"));
    assert_eq!(
        denied[1].rule.as_deref(),
        Some("not in network.requests[0].allow")
    );
    assert!(denied[0].violation().unwrap().detail.contains(reason));
    let r = denied[0].request.as_ref().unwrap();
    assert_eq!(
        (r.method.as_str(), r.path.as_str()),
        ("POST", "/simple/demo/")
    );

    // The same rules over plain HTTP (forwarded), one request per connection.
    let plain = Upstream::start(None).await;
    let got = http_forward(s.addr, "pkg.test", plain.port(), "GET", "/simple/a/", &[]).await;
    assert_eq!(got.status, 200, "{got:?}");
    let got = http_forward(s.addr, "pkg.test", plain.port(), "POST", "/simple/a/", &[]).await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(got.body.contains(reason), "{}", got.body);
    assert_eq!(plain.seen().len(), 1);
    s.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_another_host_and_upgrades_are_refused_on_a_bound_host() {
    let s = Setup::start().await;
    let gh = s.placeholder("TASKBOX_SECRET_GH");
    let bearer = format!("Bearer {gh}");
    // Plain HTTP to a host that carries a secret: refused, the secret never in clear text.
    let plain = Upstream::start(None).await;
    let got = http_forward(
        s.addr,
        "api.test",
        plain.port(),
        "GET",
        "/x",
        &[("Authorization", &bearer)],
    )
    .await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(got.body.contains("only over HTTPS"), "{}", got.body);
    assert!(plain.seen().is_empty());
    // Another host named in the request (domain fronting): refused before any secret is
    // presented.
    let before = s.upstream.seen().len();
    let got = https_with_host(&s, "other.test").await;
    assert_eq!(got.status, 403, "{got:?}");
    assert!(got.body.contains("names the host"), "{}", got.body);
    assert_eq!(s.upstream.seen().len(), before);
    // A websocket upgrade: refused.
    let got = https(
        s.addr,
        "api.test",
        s.upstream.port(),
        s.client(),
        &[(
            "GET",
            "/ws",
            &[("connection", "upgrade"), ("upgrade", "websocket")],
        )],
    )
    .await
    .unwrap();
    assert_eq!(got[0].status, 501, "{got:?}");
    for head in s.upstream.seen() {
        assert!(!head.starts_with("GET /ws"), "{head}");
    }
    s.proxy.shutdown().await;
}

/// A request on a connection to api.test whose `Host` names `other`.
async fn https_with_host(s: &Setup, other: &str) -> tlsutil::Got {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let port = s.upstream.port();
    let mut tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    tcp.write_all(format!("CONNECT api.test:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(tcp.read(&mut byte).await.unwrap(), 1);
        head.push(byte[0]);
    }
    let name = rustls::pki_types::ServerName::try_from("api.test").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(s.client())
        .connect(name, tcp)
        .await
        .unwrap();
    tls.write_all(
        format!("GET /x HTTP/1.1\r\nHost: {other}:{port}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out).await;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    tlsutil::Got {
        status: head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_and_python_requests_trust_the_bundle_and_get_the_secret_added() {
    if !have("curl") || !have("python3") {
        return;
    }
    let s = Setup::start().await;
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("ca.pem");
    std::fs::write(&bundle, &s.trust.ca_bundle).unwrap();
    let gh = s.placeholder("TASKBOX_SECRET_GH");
    let url = format!("https://api.test:{}/from-curl", s.upstream.port());
    // curl as a sandbox runs it: the proxy and the bundle from the variables alone.
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--fail", "-H"])
        .arg(format!("Authorization: Bearer {gh}"))
        .arg(&url)
        .env("HTTPS_PROXY", format!("http://{}", s.addr))
        .env("CURL_CA_BUNDLE", &bundle);
    let out = run_keeping(cmd).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&format!("authorization: Bearer {GH}")),
        "{}",
        text(&out.stdout)
    );

    let has_requests = Command::new("python3")
        .args(["-c", "import requests"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_requests {
        common::skip("python3 has no requests module");
        return;
    }
    let script = r#"
import os, sys, requests
r = requests.get(sys.argv[1], headers={"Authorization": "Bearer " + os.environ["TASKBOX_SECRET_GH"]}, timeout=20)
print(r.status_code)
sys.stdout.write(r.text)
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script])
        .arg(format!(
            "https://api.test:{}/from-requests",
            s.upstream.port()
        ))
        .env("HTTPS_PROXY", format!("http://{}", s.addr))
        .env("REQUESTS_CA_BUNDLE", &bundle)
        .env("TASKBOX_SECRET_GH", &gh);
    let out = run_keeping(cmd).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("200\nGET /from-requests"), "{stdout}");
    assert!(
        stdout.contains(&format!("authorization: Bearer {GH}")),
        "{stdout}"
    );
    s.proxy.shutdown().await;
}

/// Runs a command with the variables it was given (the proxy's included: `run` takes the
/// environment's away), through env(1).
async fn run_keeping(cmd: Command) -> std::process::Output {
    let mut wrapped = Command::new("env");
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            wrapped.arg(format!("{}={}", k.to_string_lossy(), v.to_string_lossy()));
        }
    }
    wrapped.arg(cmd.get_program()).args(cmd.get_args());
    run(wrapped).await
}
