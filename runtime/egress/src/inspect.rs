//! Inspected connections: for a host that carries secrets or request rules, the proxy reads
//! every HTTP request instead of relaying bytes.
//!
//! After `CONNECT` (or SOCKS5) to such a host the proxy looks at the client's first byte: a TLS
//! handshake (`0x16`) is answered with a certificate for the host minted by the sandbox's own
//! CA ([`crate::tls`]) while the proxy makes its own TLS connection to the real upstream and
//! checks its certificate; anything else is taken as plain HTTP inside the tunnel. A plain
//! forwarded request (`GET http://host/...`) to such a host is served the same way, one request
//! per connection. Both sides speak HTTP/1.1 through hyper (its parser and its body framing:
//! `docs/decisions.md` says why no hand-written parser is used here).
//!
//! Each request is then checked, in this order:
//!
//! 1. it must be for the connection's host (its `Host` and its URL's authority, when it has
//!    one): a secret bound to a host never reaches another that shares its server;
//! 2. protocol upgrades (websockets) are refused: the proxy would lose sight of the bytes;
//! 3. the request rules of the host ([`taskbox_core::policy::requests`]), over a path that must
//!    have no dot segments, encoded slashes or empty segments (what a server would read
//!    differently from the rule);
//! 4. the secrets bound to the host are presented (only inside TLS: over plain HTTP such a
//!    request is refused), and their placeholders replaced in header values and the query.
//!
//! A refusal is a response of the proxy's own (403 with the reason as its one-line body) and a
//! [`Decision`] with the request; a request that carried secrets is another (the audit record,
//! with the secrets' names only).

use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use taskbox_core::api::{ApiError, SecretStatus, SecretValue};
use taskbox_core::egress::{EgressConfig, RequestEvent, SandboxTrust};
use taskbox_core::policy::RequestRules;
use taskbox_core::policy::requests::{RequestVerdict, check_request};
use taskbox_core::policy::secrets::Presentation;
use taskbox_core::support::now_ms;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::event::{ConnectionEnd, Decision, Outcome, Protocol};
use crate::meter::Meter;
use crate::secrets::{LiveSecret, render};
use crate::tls::{SandboxCa, UpstreamTls, upstream_failure};
use crate::{Shared, audit, http};

type Body = BoxBody<Bytes, hyper::Error>;

/// What a proxy inspects, and with what: its CA, its secrets, its request rules.
pub(crate) struct Inspection {
    ca: SandboxCa,
    upstream: Arc<rustls::ClientConfig>,
    secrets: Vec<LiveSecret>,
    requests: Vec<RequestRules>,
    trust: SandboxTrust,
}

impl Inspection {
    /// The inspection of sandbox `tag`'s proxy: a new CA, the secrets with fresh placeholders.
    pub(crate) fn new(
        tag: &str,
        config: EgressConfig,
        upstream: &UpstreamTls,
    ) -> Result<Inspection, String> {
        let mut hosts = Vec::new();
        for s in &config.secrets {
            hosts.extend(s.spec.hosts.iter().cloned());
        }
        for r in &config.network.requests {
            hosts.extend(r.hosts.iter().cloned());
        }
        let ca = SandboxCa::new(tag, &hosts).map_err(|e| e.to_string())?;
        let secrets = config
            .secrets
            .into_iter()
            .map(LiveSecret::new)
            .collect::<Result<Vec<_>, _>>()?;
        let mut ca_bundle = upstream.roots_pem.clone().into_bytes();
        ca_bundle.extend_from_slice(ca.pem().as_bytes());
        let trust = SandboxTrust {
            ca_bundle,
            ca_cert: ca.pem().to_owned(),
            placeholders: secrets
                .iter()
                .map(|s| (s.placeholder_var.clone(), s.placeholder.clone()))
                .collect(),
        };
        Ok(Inspection {
            ca,
            upstream: upstream.config.clone(),
            secrets,
            requests: config.network.requests,
            trust,
        })
    }

    /// Whether requests to `host:port` (a normalised name) are inspected.
    pub(crate) fn covers(&self, host: &str, port: u16) -> bool {
        self.secrets.iter().any(|s| s.bound_to(host, port))
            || self
                .requests
                .iter()
                .any(|r| r.hosts.iter().any(|h| h.matches_name(host, port)))
    }

    fn has_rules(&self, host: &str, port: u16) -> bool {
        self.requests
            .iter()
            .any(|r| r.hosts.iter().any(|h| h.matches_name(host, port)))
    }

    pub(crate) fn trust(&self) -> &SandboxTrust {
        &self.trust
    }

    /// Rotates or revokes a secret.
    pub(crate) fn set_secret(
        &self,
        name: &str,
        value: Option<SecretValue>,
    ) -> Result<SecretStatus, ApiError> {
        let Some(secret) = self.secrets.iter().find(|s| s.name == name) else {
            let names: Vec<&str> = self.secrets.iter().map(|s| s.name.as_str()).collect();
            return Err(ApiError::not_found(format!(
                "this sandbox's policy has no secret {name:?} (its secrets: {})",
                names.join(", ")
            )));
        };
        secret.set(value);
        Ok(secret.status())
    }

    pub(crate) fn secret_statuses(&self) -> Vec<SecretStatus> {
        self.secrets.iter().map(LiveSecret::status).collect()
    }
}

/// Serves an inspected connection to `decision`'s host, whose TCP connection to the upstream
/// (`upstream`, to a checked address) is made. For `CONNECT` and SOCKS5 the client has had its
/// success reply; `prefix` is what it sent after its request (a forwarded request's own head
/// first). Emits the connection's decision (and its end), and one per refused or
/// secret-carrying request.
pub(crate) async fn serve<S>(
    shared: Arc<Shared>,
    inspection: Arc<Inspection>,
    mut decision: Decision,
    client: S,
    mut prefix: Vec<u8>,
    upstream: TcpStream,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let meter = Arc::new(Meter::new());
    let host = decision.host.clone();
    let port = decision.port;
    let Some(ip) = decision.ip else {
        return;
    };
    let limits = shared.limits.clone();
    let mut client = Prefixed {
        prefix: Vec::new(),
        at: 0,
        inner: client,
    };
    let absolute = decision.protocol == Protocol::Forward;
    // The first byte tells TLS from plain HTTP inside a tunnel.
    if prefix.is_empty() && !absolute {
        let mut byte = [0u8; 1];
        match timeout(limits.handshake_timeout, client.inner.read(&mut byte)).await {
            Ok(Ok(1)) => prefix.push(byte[0]),
            _ => {
                emit(&shared, &mut decision);
                end(&shared, &mut decision, &meter, None);
                return;
            }
        }
    }
    let tls = !absolute && prefix.first() == Some(&0x16);
    client.prefix = prefix;
    let client = Metered {
        inner: client,
        meter: meter.clone(),
    };
    let exchange = |first: Upstream, decision: &Decision| {
        Arc::new(Exchange {
            shared: shared.clone(),
            inspection: inspection.clone(),
            decision: decision.clone(),
            host: host.clone(),
            port,
            ip,
            tls,
            absolute,
            has_rules: inspection.has_rules(&host, port),
            upstream: Mutex::new(first),
        })
    };
    if !tls {
        emit(&shared, &mut decision);
        let first = match Upstream::over(upstream).await {
            Ok(u) => u,
            Err(why) => {
                end(&shared, &mut decision, &meter, Some(why));
                return;
            }
        };
        let result = serve_http(exchange(first, &decision), client, &meter).await;
        end(&shared, &mut decision, &meter, result.err());
        return;
    }
    let accept = async {
        let config = inspection
            .ca
            .server_config(&host)
            .map_err(|e| e.to_string())?;
        match timeout(
            limits.handshake_timeout,
            TlsAcceptor::from(config).accept(client),
        )
        .await
        {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(format!(
                "the client's TLS handshake failed ({e}); it must trust the sandbox's CA \
                 (SSL_CERT_FILE and the like point at it)"
            )),
            Err(_) => Err("the client's TLS handshake timed out".to_owned()),
        }
    };
    let connect = async {
        let name = ServerName::try_from(host.clone()).map_err(|e| (false, e.to_string()))?;
        match timeout(
            limits.connect_timeout,
            TlsConnector::from(inspection.upstream.clone()).connect(name, upstream),
        )
        .await
        {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(upstream_failure(&host, port, &e)),
            Err(_) => Err((
                false,
                format!("the TLS handshake with {host}:{port} timed out"),
            )),
        }
    };
    let (client, upstream) = tokio::join!(accept, connect);
    let upstream = match upstream {
        Ok(u) => u,
        Err((certificate, reason)) => {
            decision.outcome = if certificate {
                Outcome::Denied
            } else {
                Outcome::Failed
            };
            decision.reason = Some(reason);
            decision.hint = certificate.then(|| {
                "a host whose secrets or requests the proxy handles must present a certificate \
                 the proxy trusts (the host's roots, and the supervisor's extra CA if it has one)"
                    .to_owned()
            });
            emit(&shared, &mut decision);
            if let Ok(client) = client {
                answer_all(
                    client,
                    StatusCode::BAD_GATEWAY,
                    decision.message(),
                    certificate,
                )
                .await;
            }
            return;
        }
    };
    emit(&shared, &mut decision);
    let client = match client {
        Ok(c) => c,
        Err(why) => {
            end(&shared, &mut decision, &meter, Some(why));
            return;
        }
    };
    let first = match Upstream::over(upstream).await {
        Ok(u) => u,
        Err(why) => {
            end(&shared, &mut decision, &meter, Some(why));
            return;
        }
    };
    let result = serve_http(exchange(first, &decision), client, &meter).await;
    end(&shared, &mut decision, &meter, result.err());
}

fn emit(shared: &Shared, decision: &mut Decision) {
    decision.time_ms = now_ms();
    shared.emit(decision);
}

/// The end event of an allowed connection.
fn end(shared: &Shared, decision: &mut Decision, meter: &Meter, error: Option<String>) {
    if decision.outcome != Outcome::Allowed {
        return;
    }
    decision.end = Some(ConnectionEnd {
        bytes_up: meter.up.load(Ordering::Relaxed),
        bytes_down: meter.down.load(Ordering::Relaxed),
        duration_ms: u64::try_from(meter.elapsed().as_millis()).unwrap_or(u64::MAX),
        error,
    });
    emit(shared, decision);
}

/// Answers every request of `client` with `status` and `message` (the upstream could not be
/// used), then closes.
async fn answer_all<C>(client: C, status: StatusCode, message: String, denied: bool)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
        let response = own_response(status, &message, denied);
        async move { Ok::<_, Infallible>(response) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(client), service);
    let _ = timeout(Duration::from_secs(10), conn).await;
}

/// One inspected connection's state, shared by its requests.
struct Exchange {
    shared: Arc<Shared>,
    inspection: Arc<Inspection>,
    /// The connection's decision: what each request's event starts from.
    decision: Decision,
    host: String,
    port: u16,
    /// The checked address of the upstream: reconnections go there and nowhere else.
    ip: IpAddr,
    /// TLS on both sides (else plain HTTP on both).
    tls: bool,
    /// Requests come in absolute form (`GET http://host/...`, forwarded HTTP).
    absolute: bool,
    /// The host has request rules.
    has_rules: bool,
    upstream: Mutex<Upstream>,
}

/// The HTTP connection to the upstream; made again when the upstream closed it.
struct Upstream {
    sender: Option<SendRequest<Incoming>>,
    driver: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(driver) = self.driver.take() {
            driver.abort();
        }
    }
}

impl Upstream {
    /// HTTP/1.1 over `io`.
    async fn over<I>(io: I) -> Result<Upstream, String>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake::<_, Incoming>(TokioIo::new(io))
            .await
            .map_err(|e| format!("cannot speak HTTP to the upstream: {e}"))?;
        let driver = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "inspected upstream connection ended");
            }
        });
        Ok(Upstream {
            sender: Some(sender),
            driver: Some(driver),
        })
    }

    /// A sender ready for a request: the current connection, or a new one to the same checked
    /// address.
    async fn ready(&mut self, x: &Exchange) -> Result<&mut SendRequest<Incoming>, String> {
        let usable = match self.sender.as_mut() {
            Some(s) if !s.is_closed() => s.ready().await.is_ok(),
            _ => false,
        };
        if !usable {
            let limit = x.shared.limits.connect_timeout;
            let addr = SocketAddr::new(x.ip, x.port);
            let tcp = match timeout(limit, TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => tcp,
                Ok(Err(e)) => return Err(format!("cannot connect to {addr}: {e}")),
                Err(_) => return Err(format!("cannot connect to {addr}: timed out")),
            };
            let _ = tcp.set_nodelay(true);
            let fresh = if x.tls {
                let name = ServerName::try_from(x.host.clone()).map_err(|e| e.to_string())?;
                let connect = TlsConnector::from(x.inspection.upstream.clone()).connect(name, tcp);
                let stream = match timeout(limit, connect).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return Err(upstream_failure(&x.host, x.port, &e).1),
                    Err(_) => return Err("the TLS handshake with the upstream timed out".into()),
                };
                Upstream::over(stream).await?
            } else {
                Upstream::over(tcp).await?
            };
            *self = fresh;
        }
        self.sender
            .as_mut()
            .ok_or_else(|| "no upstream connection".to_owned())
    }
}

/// Serves the client's requests until it closes, the connection idles out, or the proxy shuts
/// down.
async fn serve_http<C>(x: Arc<Exchange>, client: C, meter: &Meter) -> Result<(), String>
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = x.shared.limits.clone();
    let cancel = x.shared.cancel.clone();
    let service = {
        let x = x.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let x = x.clone();
            async move { Ok::<_, Infallible>(handle(&x, req).await) }
        })
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(limits.max_header_bytes.max(8192))
        .serve_connection(TokioIo::new(client), service);
    let watchdog = async {
        loop {
            let quiet = meter.idle_for();
            if quiet >= limits.idle_timeout {
                return quiet;
            }
            tokio::time::sleep(limits.idle_timeout - quiet).await;
        }
    };
    tokio::select! {
        r = conn => r.map_err(|e| e.to_string()),
        quiet = watchdog => Err(format!("idle for {}s", quiet.as_secs())),
        () = cancel.cancelled() => Err("proxy shut down".to_owned()),
    }
}

/// A response of the proxy's own: a one-line plain-text body.
fn own_response(status: StatusCode, message: &str, denied: bool) -> Response<Body> {
    let body = format!("{}\n", message.replace(['\r', '\n'], " "));
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        HeaderName::from_static("x-taskbox-egress"),
        HeaderValue::from_static(if denied { "denied" } else { "error" }),
    );
    response
}

/// Why a request is refused: its status, and the event's rule, reason and hint.
struct Refusal {
    status: StatusCode,
    rule: Option<String>,
    reason: String,
    hint: Option<String>,
}

impl Refusal {
    fn new(status: StatusCode, reason: impl Into<String>) -> Refusal {
        Refusal {
            status,
            rule: None,
            reason: reason.into(),
            hint: None,
        }
    }
}

impl Exchange {
    /// The event of one request, from the connection's.
    fn event(&self, method: &str, path: &str) -> Decision {
        Decision {
            time_ms: now_ms(),
            end: None,
            request: Some(RequestEvent {
                method: method.to_owned(),
                path: path.to_owned(),
                secrets: Vec::new(),
                status: None,
            }),
            rule: None,
            reason: None,
            hint: None,
            ..self.decision.clone()
        }
    }

    /// Refuses a request: its event, and the proxy's response.
    fn refuse(&self, method: &str, path: &str, refusal: Refusal) -> Response<Body> {
        let mut d = self.event(method, path);
        d.outcome = Outcome::Denied;
        d.rule = refusal.rule;
        d.reason = Some(refusal.reason);
        d.hint = refusal.hint;
        self.shared.emit(&d);
        let mut response = own_response(refusal.status, &d.message(), true);
        if self.absolute {
            close(response.headers_mut());
        }
        response
    }

    /// Whether `authority` (a URL's, or a `Host` header's) names this connection's host.
    fn same_host(&self, authority: &str) -> bool {
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.contains(']') => (h, p.parse::<u16>().ok()),
            _ => (authority, None),
        };
        let host = host.strip_suffix('.').unwrap_or(host);
        let default = if self.tls { 443 } else { 80 };
        host.eq_ignore_ascii_case(&self.host)
            && port.is_none_or(|p| p == self.port)
            && (port.is_some() || self.port == default || !self.absolute)
    }
}

/// Marks a response as the connection's last (forwarded HTTP: one request per connection, so
/// that the next, perhaps to another host, is decided anew).
fn close(headers: &mut HeaderMap) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
}

async fn handle(x: &Exchange, mut req: Request<Incoming>) -> Response<Body> {
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    if let Err(refusal) = check(x, &req, &method, &path) {
        return x.refuse(&method, &path, refusal);
    }
    // The secrets bound to this host, still in force.
    let bound: Vec<(&LiveSecret, Arc<SecretValue>)> = x
        .inspection
        .secrets
        .iter()
        .filter(|s| s.bound_to(&x.host, x.port))
        .filter_map(|s| s.value().map(|v| (s, v)))
        .collect();
    if !bound.is_empty() && !x.tls {
        let names: Vec<&str> = bound.iter().map(|(s, _)| s.name.as_str()).collect();
        let refusal = Refusal {
            status: StatusCode::FORBIDDEN,
            rule: Some(format!("secrets.{}", names.join(", secrets."))),
            reason: format!(
                "{} carries the secret {}, which the proxy presents only over HTTPS",
                x.host,
                names.join(", ")
            ),
            hint: Some(format!("use https://{}:{}", x.host, x.port)),
        };
        return x.refuse(&method, &path, refusal);
    }
    let mut query = req.uri().query().map(str::to_owned);
    let mut used: Vec<String> = Vec::new();
    for (secret, value) in &bound {
        present(secret, value.expose(), req.headers_mut(), &mut query);
        used.push(secret.name.clone());
    }
    strip_hop_by_hop(req.headers_mut());
    req.headers_mut().remove(header::EXPECT);
    if !req.headers().contains_key(header::HOST) {
        let default = if x.tls { 443 } else { 80 };
        let value = if x.port == default {
            x.host.clone()
        } else {
            format!("{}:{}", x.host, x.port)
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let target = match &query {
        Some(q) => format!("{path}?{q}"),
        None => path.clone(),
    };
    match target.parse::<Uri>() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(e) => {
            return x.refuse(
                &method,
                &path,
                Refusal::new(
                    StatusCode::BAD_REQUEST,
                    format!("invalid request target: {e}"),
                ),
            );
        }
    }
    let response = {
        let mut upstream = x.upstream.lock().await;
        match upstream.ready(x).await {
            Ok(sender) => sender.send_request(req).await.map_err(|e| e.to_string()),
            Err(why) => Err(why),
        }
    };
    let mut response = match response {
        Ok(r) => r,
        Err(why) => {
            tracing::debug!(tag = %x.shared.tag, host = %x.host, %why, "inspected request failed");
            let mut r = own_response(
                StatusCode::BAD_GATEWAY,
                &format!("the request to {}:{} failed: {why}", x.host, x.port),
                false,
            );
            close(r.headers_mut());
            return r;
        }
    };
    if !used.is_empty() {
        let mut d = x.event(&method, &path);
        d.outcome = Outcome::Allowed;
        if let Some(r) = d.request.as_mut() {
            r.secrets = used.clone();
            r.status = Some(response.status().as_u16());
        }
        for name in &used {
            audit::record(&x.shared.tag, name, &x.host);
        }
        x.shared.emit(&d);
    }
    strip_hop_by_hop(response.headers_mut());
    if x.absolute {
        close(response.headers_mut());
    }
    response.map(BodyExt::boxed)
}

/// Steps 1–3 of the module doc: the destination, upgrades, the request rules.
fn check(x: &Exchange, req: &Request<Incoming>, method: &str, path: &str) -> Result<(), Refusal> {
    let other_host = |named: &str| {
        Refusal::new(
            StatusCode::FORBIDDEN,
            format!(
                "the request names the host {named:?}, and this connection is to {}:{}; send \
                 each host its own connection",
                x.host, x.port
            ),
        )
    };
    match req.uri().authority() {
        Some(a) if !x.same_host(a.as_str()) => return Err(other_host(a.as_str())),
        Some(_) => {}
        None if x.absolute => {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "a request to a proxy needs an absolute URL",
            ));
        }
        None => {}
    }
    for value in req.headers().get_all(header::HOST) {
        let named = String::from_utf8_lossy(value.as_bytes());
        if !x.same_host(&named) {
            return Err(other_host(&named));
        }
    }
    if req.method() == Method::CONNECT || req.headers().contains_key(header::UPGRADE) {
        return Err(Refusal::new(
            StatusCode::NOT_IMPLEMENTED,
            "protocol upgrades (websockets) and CONNECT are not relayed to a host whose \
             requests the proxy inspects",
        ));
    }
    if !x.has_rules {
        return Ok(());
    }
    let decoded = clean_path(path).map_err(|why| Refusal::new(StatusCode::BAD_REQUEST, why))?;
    match check_request(&x.inspection.requests, &x.host, x.port, method, &decoded) {
        RequestVerdict::NotInspected | RequestVerdict::Allow { .. } => Ok(()),
        RequestVerdict::Deny {
            entry,
            rule,
            reason,
        } => {
            let key = format!("network.requests[{entry}]");
            let rule = rule.unwrap_or_else(|| format!("not in {key}.allow"));
            Err(Refusal {
                status: StatusCode::FORBIDDEN,
                reason: match reason {
                    Some(reason) => reason,
                    None => format!("refused by {key} ({rule})"),
                },
                hint: Some(format!("the policy's {key} decides requests to this host")),
                rule: Some(rule),
            })
        }
    }
}

/// The path a rule is matched against: percent-decoded, and refused when a server could read
/// it as another path than the rule does (dot segments, encoded `/` or `\`, NUL, empty
/// segments but a trailing one).
fn clean_path(raw: &str) -> Result<String, String> {
    let bad = |why: &str| format!("the path {raw:?} {why}; the proxy refuses ambiguous paths");
    if !raw.starts_with('/') {
        return Err(bad("does not start with '/'"));
    }
    let lower = raw.to_ascii_lowercase();
    if raw.contains('\\') || lower.contains("%2f") || lower.contains("%5c") || lower.contains("%00")
    {
        return Err(bad("holds an encoded or backward slash, or NUL"));
    }
    let decoded = percent_decode(raw).ok_or_else(|| bad("has a malformed %-escape"))?;
    let segments: Vec<&str> = decoded[1..].split('/').collect();
    for (i, segment) in segments.iter().enumerate() {
        if *segment == "." || *segment == ".." {
            return Err(bad("has a dot segment"));
        }
        if segment.is_empty() && i + 1 < segments.len() {
            return Err(bad("has an empty segment"));
        }
    }
    Ok(decoded)
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// Everything but unreserved characters, %-encoded (for a value in a query).
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Presents `value` of `secret` on a request: its placeholder replaced in header values and the
/// query, then the presentation the policy names (a header set, basic authentication, a query
/// parameter set), replacing what the client put there.
fn present(secret: &LiveSecret, value: &str, headers: &mut HeaderMap, query: &mut Option<String>) {
    let placeholder = secret.placeholder.as_bytes();
    let finder = memchr::memmem::Finder::new(placeholder);
    for header_value in headers.values_mut() {
        let bytes = header_value.as_bytes();
        if finder.find(bytes).is_none() {
            continue;
        }
        let replaced = replace_all(bytes, placeholder, value.as_bytes());
        if let Ok(v) = HeaderValue::from_bytes(&replaced) {
            let mut v = v;
            v.set_sensitive(true);
            *header_value = v;
        }
    }
    if let Some(q) = query.as_mut()
        && q.contains(&secret.placeholder)
    {
        *q = q.replace(&secret.placeholder, &percent_encode(value));
    }
    match &secret.presentation {
        Presentation::Header { name, template } => {
            if let (Ok(name), Ok(mut v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&render(template, value)),
            ) {
                v.set_sensitive(true);
                headers.insert(name, v);
            }
        }
        Presentation::Basic { user } => {
            use base64::Engine as _;
            let credentials = zeroize::Zeroizing::new(format!("{user}:{value}"));
            let encoded = zeroize::Zeroizing::new(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(credentials.as_bytes())
            ));
            if let Ok(mut v) = HeaderValue::from_str(&encoded) {
                v.set_sensitive(true);
                headers.insert(header::AUTHORIZATION, v);
            }
        }
        Presentation::Query { name } => {
            let pair = format!("{name}={}", percent_encode(value));
            let kept: Vec<&str> = query
                .as_deref()
                .unwrap_or("")
                .split('&')
                .filter(|p| !p.is_empty() && p.split('=').next() != Some(name.as_str()))
                .collect();
            let mut joined = kept.join("&");
            if !joined.is_empty() {
                joined.push('&');
            }
            joined.push_str(&pair);
            *query = Some(joined);
        }
    }
}

fn replace_all(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len() + with.len());
    let mut rest = haystack;
    while let Some(at) = memchr::memmem::find(rest, needle) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(with);
        rest = &rest[at + needle.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// Hop-by-hop headers (and those `Connection` names) and proxy headers: hyper frames each side
/// itself.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty() && t != "content-length" && t != "host")
        .collect();
    for name in listed {
        headers.remove(name.as_str());
    }
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|name| http::is_hop_by_hop(name.as_str()) && *name != header::HOST)
        .cloned()
        .collect();
    for name in hop {
        headers.remove(name);
    }
    // hyper framed the body it read by Transfer-Encoding when there was one, so a
    // Content-Length beside it is not the body's length: neither goes on (hyper frames what it
    // sends by the body itself), or a request could be read as two by the upstream.
    if headers.remove(header::TRANSFER_ENCODING).is_some() {
        headers.remove(header::CONTENT_LENGTH);
    }
}

/// The client's stream with bytes already read from it put back in front.
struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.at < this.prefix.len() {
            let n = (this.prefix.len() - this.at).min(buf.remaining());
            buf.put_slice(&this.prefix[this.at..this.at + n]);
            this.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts the bytes of the client's hop (what the connection's end event reports) and marks
/// activity for the idle timeout.
struct Metered<S> {
    inner: S,
    meter: Arc<Meter>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            this.meter.add(&this.meter.up, n);
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = result {
            this.meter.add(&this.meter.down, n);
        }
        result
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ambiguous_paths_are_refused() {
        assert_eq!(clean_path("/simple/a%2Db/").unwrap(), "/simple/a-b/");
        assert_eq!(clean_path("/").unwrap(), "/");
        for bad in [
            "/simple/../upload",
            "/simple/%2e%2e/upload",
            "/simple/%2E/x",
            "/a%2fb",
            "/a%5Cb",
            "/a\\b",
            "/a//b",
            "/a/%00",
            "/a/%zz",
            "/a/%4",
        ] {
            assert!(clean_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_a_conflicting_length_do_not_go_on() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("host", "api.test"),
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "5"),
            ("proxy-authorization", "Basic eA=="),
            ("transfer-encoding", "chunked"),
            ("content-length", "5"),
            ("x-kept", "yes"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["host", "x-kept"]);
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        strip_hop_by_hop(&mut h);
        assert!(h.contains_key(header::CONTENT_LENGTH));
    }

    #[test]
    fn encoding_and_replacing() {
        assert_eq!(percent_encode("a b&c=d~"), "a%20b%26c%3Dd~");
        assert_eq!(replace_all(b"xPHyPH", b"PH", b"sec"), b"xsecysec".to_vec());
        assert_eq!(replace_all(b"nothing", b"PH", b"sec"), b"nothing".to_vec());
    }
}
