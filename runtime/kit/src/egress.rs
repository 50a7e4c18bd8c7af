//! The egress seam: what a backend needs from the egress proxy, and what it makes of the proxy's
//! decisions.
//!
//! The proxy itself lives in `taskbox-egress`, which depends on this crate; backends reach it
//! through [`EgressService`] (one per backend or one-shot run, handed in by whoever builds the
//! backend) and [`EgressProxy`] (one per sandbox). A backend:
//!
//! 1. starts a proxy for the sandbox with the policy's `[network]` rules and a sink that feeds an
//!    [`EgressLog`];
//! 2. gives the proxy a way in: a listening TCP socket on `127.0.0.1:`[`PROXY_PORT`] created in
//!    the sandbox's network namespace ([`EgressProxy::serve_listener`], what the native backend
//!    does), or a Unix socket that a bridge inside the sandbox forwards to
//!    ([`EgressProxy::listen_unix`]);
//! 3. advertises the proxy to the command ([`proxy_env`]) and lets the command connect to that
//!    one port (Landlock);
//! 4. opens an [`EgressLog`] window when an exec starts and closes it when the exec ends: what
//!    the proxy decided meanwhile becomes the exec's violations and its `network` activity;
//! 5. replaces the rules of a live sandbox with [`EgressProxy::set_rules`].
//!
//! A policy with secrets or request rules ([`crate::policy::Policy::inspects`]) has its
//! secrets' values resolved by the supervisor ([`resolve_secrets`]) and handed to the proxy in
//! an [`EgressConfig`]; the proxy then gives the sandbox's trust ([`SandboxTrust`]: a CA bundle
//! the backend puts at [`CA_BUNDLE`], and the secrets' placeholders), which [`trust_env`]
//! advertises. `docs/secrets.md` has the whole story.
//!
//! [`Decision`] and its parts are the proxy's events, defined here so that backends and the
//! trace can read them without linking the proxy.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::{IpAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::api::{ApiError, NetworkRules, SecretStatus, SecretUpdate, SecretValue};
use crate::policy::secrets::{CA_VARIABLES, SecretSource};
use crate::policy::{Network, Policy, SecretSpec};
use crate::result::{NetworkActivity, NetworkConnection, SecretUse, Violation};

pub use crate::policy::PROXY_PORT;

/// How long the end of an exec waits for the proxy to report the end of the connections the exec
/// opened (its clients are gone by then; the proxy notices within microseconds).
pub const CLOSE_GRACE: Duration = Duration::from_millis(200);

/// Connections listed one by one in an exec's [`NetworkActivity`]; later ones are only counted.
pub const MAX_LISTED_CONNECTIONS: usize = 64;

/// Distinct network violations reported per exec; later ones are summed up in one more.
pub const MAX_NETWORK_VIOLATIONS: usize = 16;

/// How a client asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// HTTP `CONNECT host:port` (HTTPS and other tunnels).
    Connect,
    /// A plain HTTP request in absolute form (`GET http://host/path`).
    Forward,
    /// SOCKS5 `CONNECT`.
    Socks5,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Connect => "connect",
            Protocol::Forward => "forward",
            Protocol::Socks5 => "socks5",
        }
    }
}

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The policy allowed it and the proxy connected.
    Allowed,
    /// The policy refused it.
    Denied,
    /// The policy allowed it (or could not tell, when the name did not resolve), but resolving
    /// or connecting failed.
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::Failed => "failed",
        }
    }
}

/// One decision. A connection gives one event when it is decided (`end` unset), and an allowed
/// one a second, with the same `id`, when it ends (`end` set). Count allowed connections by the
/// events without `end`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The connection's number in this proxy, from 1.
    pub id: u64,
    /// When the decision (or the end) happened, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The proxy's tag: which sandbox the client is in.
    pub tag: String,
    /// The client's address ("unix" for a Unix socket).
    pub client: String,
    pub protocol: Protocol,
    /// The host asked for: a normalised name, or an address (IPv6 in brackets).
    pub host: String,
    pub port: u16,
    /// The address connected to; for a denial, the address that was refused (if one was).
    pub ip: Option<IpAddr>,
    /// Every address the name resolved to (the literal, for an address).
    pub addresses: Vec<IpAddr>,
    pub outcome: Outcome,
    /// The rule that decided: "allow PATTERN" or "deny PATTERN"; unset when none matched.
    pub rule: Option<String>,
    /// Why it was refused or failed, in one line.
    pub reason: Option<String>,
    /// What to change in the policy to allow it.
    pub hint: Option<String>,
    /// Set on the second event of an allowed connection.
    pub end: Option<ConnectionEnd>,
    /// The connection's HTTP is inspected: its host carries secrets or request rules, and the
    /// proxy reads (for HTTPS: decrypts) every request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inspected: bool,
    /// Set on an event about one HTTP request of an inspected connection (same `id`): a
    /// request refused by the request rules, or one that carried secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestEvent>,
}

/// One HTTP request on an inspected connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestEvent {
    pub method: String,
    /// The request's path, without its query (where a secret may be presented).
    pub path: String,
    /// The secrets the proxy presented on it, by name (never a value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// The upstream's status code, when it answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
}

/// How an allowed connection ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionEnd {
    /// Bytes from the client to the destination (a forwarded request's rewritten head included).
    pub bytes_up: u64,
    /// Bytes from the destination to the client.
    pub bytes_down: u64,
    pub duration_ms: u64,
    /// Why it ended abnormally: "idle for 300s", "proxy shut down", an I/O error; unset when
    /// both sides closed.
    pub error: Option<String>,
}

impl Decision {
    pub fn allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// `host:port` as asked.
    pub fn target(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// One line for the client and the model: "connect evil.example:443 denied: not in
    /// allowlist; to allow it, add ...", or for a request "request POST pkg.test:443/upload
    /// denied: ...".
    pub fn message(&self) -> String {
        let mut text = match &self.request {
            Some(r) => format!(
                "request {} {}{} {}",
                r.method,
                self.target(),
                r.path,
                self.outcome.as_str()
            ),
            None => format!("connect {} {}", self.target(), self.outcome.as_str()),
        };
        if let Some(reason) = &self.reason {
            text.push_str(": ");
            text.push_str(reason);
        }
        if let Some(hint) = &self.hint {
            text.push_str("; ");
            text.push_str(hint);
        }
        text
    }

    /// The violation an ExecResult reports for a denial (kind "network"); `None` for allowed or
    /// failed connections and for the end events.
    pub fn violation(&self) -> Option<Violation> {
        (self.outcome == Outcome::Denied && self.end.is_none()).then(|| Violation {
            kind: "network".to_owned(),
            detail: self.message(),
        })
    }
}

/// Receives every [`Decision`] of a proxy; called on the proxy's own threads, so it must not
/// block for long.
pub type DecisionSink = Arc<dyn Fn(&Decision) + Send + Sync>;

/// Why an egress proxy could not be started or given a listener.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The proxy (or its runtime) could not be started.
    #[error("cannot start the egress proxy: {0}")]
    Start(String),
    /// The proxy could not serve a listener.
    #[error("the egress proxy cannot serve its listener: {0}")]
    Listen(String),
    /// The sandbox's CA or the proxy's TLS could not be set up.
    #[error("the egress proxy cannot inspect HTTPS: {0}")]
    Tls(String),
}

/// One of a policy's secrets with its value, as the supervisor read it for one sandbox.
#[derive(Debug, Clone)]
pub struct ResolvedSecret {
    pub name: String,
    pub spec: SecretSpec,
    pub value: SecretValue,
}

/// What a sandbox's proxy is started with: the policy's `[network]` (its rules, its request
/// rules) and its secrets, resolved.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    pub network: Network,
    pub secrets: Vec<ResolvedSecret>,
}

impl EgressConfig {
    /// A proxy with `network`'s rules and no secrets.
    pub fn new(network: &Network) -> EgressConfig {
        EgressConfig {
            network: network.clone(),
            secrets: Vec::new(),
        }
    }

    /// Whether some hosts are inspected (secrets or request rules).
    pub fn inspects(&self) -> bool {
        !self.secrets.is_empty() || !self.network.requests.is_empty()
    }
}

/// The largest secret file the supervisor reads.
pub const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// Reads the values of `policy`'s secrets: from the supervisor's environment, from its files,
/// or from `given` (a create request's `secrets`, for the ones that come `from_api`). An
/// error names the secret's key and what is missing, never a value.
pub fn resolve_secrets(
    policy: &Policy,
    given: &BTreeMap<String, SecretValue>,
) -> Result<Vec<ResolvedSecret>, ApiError> {
    for name in given.keys() {
        match policy.secrets.get(name) {
            Some(spec) if spec.from_api => {}
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "secrets.{name}: the policy does not take this secret from the API                      (from_api = true); leave it out of the create request's secrets"
                )));
            }
            None => {
                return Err(ApiError::invalid(format!(
                    "secrets.{name}: the policy has no such secret (its secrets: {})",
                    policy
                        .secrets
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
    }
    let mut out = Vec::with_capacity(policy.secrets.len());
    for (name, spec) in &policy.secrets {
        let key = format!("secrets.{name}");
        let value = match spec.source() {
            SecretSource::Env(var) => match std::env::var(var) {
                Ok(v) => SecretValue::new(v),
                Err(_) => {
                    return Err(ApiError::invalid(format!(
                        "{key}.from_env: {var} is not set (as UTF-8 text) in the \
                         supervisor's environment"
                    )));
                }
            },
            SecretSource::File(path) => read_secret_file(&key, Path::new(path))?,
            SecretSource::Api => match given.get(name) {
                Some(v) => v.clone(),
                None => {
                    return Err(ApiError::invalid(format!(
                        "{key}: comes from the API (from_api = true), and the create request's                          secrets has no {name:?}"
                    )));
                }
            },
        };
        check_value(&key, &value)?;
        out.push(ResolvedSecret {
            name: name.clone(),
            spec: spec.clone(),
            value,
        });
    }
    Ok(out)
}

/// A value the proxy can put in a header: not empty, no line breaks or NUL, not too long.
pub fn check_value(key: &str, value: &SecretValue) -> Result<(), ApiError> {
    let v = value.expose();
    if v.is_empty() {
        return Err(ApiError::invalid(format!("{key}: the value is empty")));
    }
    if v.len() > MAX_SECRET_BYTES as usize {
        return Err(ApiError::invalid(format!(
            "{key}: the value is longer than {MAX_SECRET_BYTES} bytes"
        )));
    }
    if v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(ApiError::invalid(format!(
            "{key}: the value holds a line break or NUL, which no request header may carry"
        )));
    }
    Ok(())
}

/// A secret file's content, one trailing newline removed. The file is opened without following
/// a symbolic link at its end, and must be a regular file of at most [`MAX_SECRET_BYTES`].
fn read_secret_file(key: &str, path: &Path) -> Result<SecretValue, ApiError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |why: String| {
        ApiError::invalid(format!(
            "{key}.from_file: cannot read {}: {why}",
            path.display()
        ))
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| fail(e.to_string()))?;
    let md = file.metadata().map_err(|e| fail(e.to_string()))?;
    if !md.is_file() {
        return Err(fail("not a regular file".into()));
    }
    if md.len() > MAX_SECRET_BYTES {
        return Err(fail(format!("larger than {MAX_SECRET_BYTES} bytes")));
    }
    let mut bytes = zeroize::Zeroizing::new(Vec::new());
    file.take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(e.to_string()))?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| fail("not UTF-8 text".into()))?;
    Ok(SecretValue::new(text))
}

/// Where a sandbox finds the CA bundle of its inspected hosts: the host's trusted roots and the
/// sandbox's own CA, in a directory bound read-only at [`EGRESS_MOUNT`].
pub const EGRESS_MOUNT: &str = "/tmp/.taskbox/egress";

/// The CA bundle's path inside the sandbox.
pub const CA_BUNDLE: &str = "/tmp/.taskbox/egress/ca.pem";

/// The bundle's file name in the directory bound at [`EGRESS_MOUNT`].
pub const CA_BUNDLE_FILE: &str = "ca.pem";

/// What a sandbox with inspected hosts must see: the CA bundle to trust, and its secrets'
/// placeholders. Nothing here is secret.
#[derive(Clone, PartialEq, Eq)]
pub struct SandboxTrust {
    /// PEM: the roots the host trusts, then the sandbox's own CA.
    pub ca_bundle: Vec<u8>,
    /// The sandbox's own CA alone (PEM).
    pub ca_cert: String,
    /// (variable, placeholder) of each secret.
    pub placeholders: Vec<(String, String)>,
}

impl fmt::Debug for SandboxTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SandboxTrust")
            .field("ca_bundle_bytes", &self.ca_bundle.len())
            .field("placeholders", &self.placeholders)
            .finish()
    }
}

/// The variables that make common clients trust the sandbox's CA bundle ([`CA_BUNDLE`]), and
/// hold its secrets' placeholders.
pub fn trust_env(trust: &SandboxTrust) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = CA_VARIABLES
        .iter()
        .map(|name| ((*name).to_owned(), CA_BUNDLE.to_owned()))
        .collect();
    env.extend(trust.placeholders.iter().cloned());
    env
}

/// Writes the CA bundle into `dir` (the host directory bound at [`EGRESS_MOUNT`]), readable
/// by everyone: it holds certificates only.
pub fn write_trust(dir: &Path, trust: &SandboxTrust) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    let path = dir.join(CA_BUNDLE_FILE);
    std::fs::write(&path, &trust.ca_bundle)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
}

/// Starts egress proxies. One serves a whole backend (or one one-shot run); its proxies share its
/// threads.
pub trait EgressService: Send + Sync + fmt::Debug {
    /// A proxy for one sandbox, tagged `tag` (the sandbox id), deciding by `network`'s `allow`,
    /// `deny` and `hosts`, and reporting every decision to `sink`. It serves nothing until given
    /// a listener.
    fn start(
        &self,
        tag: &str,
        config: EgressConfig,
        sink: DecisionSink,
    ) -> Result<Box<dyn EgressProxy>, EgressError>;
}

/// One sandbox's proxy.
pub trait EgressProxy: Send + Sync {
    /// Accepts clients on `listener`, a listening TCP socket (the native backend's: bound to
    /// `127.0.0.1:`[`PROXY_PORT`] in the sandbox's network namespace by its pid 1).
    fn serve_listener(&self, listener: TcpListener) -> Result<(), EgressError>;
    /// Accepts clients on a new Unix socket at `path` (for a bridge inside the sandbox that
    /// forwards its own loopback listener there); the socket is removed at shutdown.
    fn listen_unix(&self, path: &Path) -> Result<(), EgressError>;
    /// Puts new rules (`network`'s `allow`, `deny` and `hosts`) in force for every later request;
    /// connections already open keep running.
    fn set_rules(&self, network: &Network);
    /// For a proxy with inspected hosts: what the sandbox must see (its CA bundle, its secrets'
    /// placeholders); `None` when nothing is inspected.
    fn trust(&self) -> Option<SandboxTrust> {
        None
    }
    /// Rotates (a new value) or revokes (`None`) secret `name` for every request from now on.
    fn set_secret(&self, name: &str, value: Option<SecretValue>) -> Result<SecretStatus, ApiError> {
        let _ = value;
        Err(ApiError::not_found(format!(
            "this sandbox's policy has no secret {name:?}"
        )))
    }
    /// Stops accepting, ends every connection (each allowed one reports its end) and waits for
    /// them, a few seconds at most.
    fn shutdown(&self);
}

/// A live sandbox's egress: its proxy, the log its decisions go to, and the rules in force. Both
/// backends keep one per sandbox with network mode "proxy".
pub struct SandboxEgress {
    pub proxy: Box<dyn EgressProxy>,
    pub log: Arc<EgressLog>,
    rules: Mutex<Network>,
}

impl SandboxEgress {
    pub fn new(
        proxy: Box<dyn EgressProxy>,
        log: Arc<EgressLog>,
        network: &Network,
    ) -> SandboxEgress {
        SandboxEgress {
            proxy,
            log,
            rules: Mutex::new(network.clone()),
        }
    }

    /// Validates `rules` like a policy file's and puts them in force for later connections.
    pub fn replace_rules(
        &self,
        sandbox: &str,
        rules: NetworkRules,
    ) -> Result<NetworkRules, ApiError> {
        let network = rules.to_network()?;
        let mut current = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        self.proxy.set_rules(&network);
        tracing::info!(%sandbox, allow = network.allow.len(), deny = network.deny.len(), "egress rules replaced");
        let answer = NetworkRules::from(&network);
        *current = network;
        Ok(answer)
    }

    /// Rotates or revokes one of the sandbox's secrets.
    pub fn set_secret(
        &self,
        sandbox: &str,
        update: SecretUpdate,
    ) -> Result<SecretStatus, ApiError> {
        if let Some(value) = &update.value {
            check_value(&format!("secrets.{}", update.name), value)?;
        }
        let action = if update.value.is_some() {
            "rotated"
        } else {
            "revoked"
        };
        let status = self.proxy.set_secret(&update.name, update.value)?;
        tracing::info!(%sandbox, secret = %update.name, "egress secret {action}");
        Ok(status)
    }
}

/// The answer to a rule change for a sandbox without a proxy: its mode is fixed at creation.
pub fn no_proxy(sandbox: &str, mode: crate::policy::NetworkMode) -> ApiError {
    ApiError::Conflict(format!(
        "sandbox {sandbox} has network mode \"{}\": allow and deny rules apply only to mode \
         \"proxy\", and the mode is fixed when the sandbox is created",
        mode.as_str()
    ))
}

/// Binds `127.0.0.1:port` in the network namespace of process `pid` and returns the listener,
/// for [`EgressProxy::serve_listener`]: how a backend whose sandboxes it does not build itself (a
/// container's network namespace, made by a container runtime) gives the proxy a way in without a
/// bridge process. A short-lived thread joins the namespace, binds and ends; the calling thread
/// and the process stay where they are. Needs `CAP_SYS_ADMIN` over the namespace (root, for a
/// container's), and the namespace's loopback up.
pub fn listen_in_netns(pid: i32, port: u16) -> std::io::Result<TcpListener> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
                TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port))
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the namespace thread panicked")))
    })
}

/// The variables that point common clients at the proxy on `127.0.0.1:port`: the `*_PROXY`
/// family in both cases (`ALL_PROXY` as `socks5h://`, so names are resolved by the proxy),
/// `NO_PROXY` for loopback, git's `http.proxy` (through `GIT_CONFIG_COUNT`, appended to what
/// `existing` already sets), pip's, npm's and cargo's own settings.
pub fn proxy_env(port: u16, existing: &[(String, String)]) -> Vec<(String, String)> {
    let http = format!("http://127.0.0.1:{port}");
    let socks = format!("socks5h://127.0.0.1:{port}");
    let no_proxy = "localhost,127.0.0.1,::1";
    let mut env = Vec::new();
    for (name, value) in [
        ("HTTP_PROXY", http.as_str()),
        ("HTTPS_PROXY", http.as_str()),
        ("ALL_PROXY", socks.as_str()),
        ("NO_PROXY", no_proxy),
    ] {
        env.push((name.to_owned(), value.to_owned()));
        env.push((name.to_ascii_lowercase(), value.to_owned()));
    }
    for name in [
        "PIP_PROXY",
        "npm_config_proxy",
        "npm_config_https_proxy",
        "CARGO_HTTP_PROXY",
    ] {
        env.push((name.to_owned(), http.clone()));
    }
    // git reads GIT_CONFIG_KEY_n/VALUE_n for n below GIT_CONFIG_COUNT: add one entry after any
    // the environment already has.
    let count = existing
        .iter()
        .rev()
        .find(|(k, _)| k == "GIT_CONFIG_COUNT")
        .and_then(|(_, v)| v.trim().parse::<u32>().ok())
        .unwrap_or(0);
    env.push((format!("GIT_CONFIG_KEY_{count}"), "http.proxy".to_owned()));
    env.push((format!("GIT_CONFIG_VALUE_{count}"), http));
    env.push(("GIT_CONFIG_COUNT".to_owned(), (count + 1).to_string()));
    env
}

/// Collects a sandbox's proxy decisions into the execs that were running when they were made.
///
/// Attribution is by time: [`EgressLog::open`] starts a window when an exec starts,
/// [`ExecWindow::close`] ends it when every process of the exec is gone, and a decision belongs
/// to every window open when it was made. A sandbox's connections all come from its execs (no
/// process outlives its exec), so nothing is lost; when execs overlap (background ones), a
/// decision appears in each of them, since the proxy cannot tell which process asked.
#[derive(Debug, Default)]
pub struct EgressLog {
    state: Mutex<LogState>,
    ended: Condvar,
}

#[derive(Debug, Default)]
struct LogState {
    next: u64,
    windows: HashMap<u64, Window>,
}

/// One exec's share of the decisions.
#[derive(Debug, Default)]
struct Window {
    activity: NetworkActivity,
    violations: Vec<Violation>,
    /// Denials beyond the first [`MAX_NETWORK_VIOLATIONS`] distinct ones.
    more_denials: u64,
    /// Allowed connections not ended yet: proxy id → index in `activity.connections` (if listed).
    open: BTreeMap<u64, Option<usize>>,
}

/// An exec's open window of an [`EgressLog`]: [`ExecWindow::close`] ends it; dropping it ends it
/// without a result (an exec that failed to start).
#[derive(Debug)]
pub struct ExecWindow {
    log: Arc<EgressLog>,
    id: u64,
}

impl ExecWindow {
    /// Ends the window: its violations (denials, in order, distinct) and its activity. Waits up
    /// to `grace` for the end of connections it allowed that are still open (their clients are
    /// gone when an exec has ended, so the proxy reports their ends at once); those still open
    /// after that are counted in `open`.
    pub fn close(self, grace: Duration) -> (Vec<Violation>, NetworkActivity) {
        self.log.close(self.id, grace)
    }
}

impl Drop for ExecWindow {
    fn drop(&mut self) {
        self.log.lock().windows.remove(&self.id);
    }
}

impl EgressLog {
    pub fn new() -> Arc<EgressLog> {
        Arc::new(EgressLog::default())
    }

    /// A sink that records into this log.
    pub fn sink(self: &Arc<Self>) -> DecisionSink {
        let log = Arc::clone(self);
        Arc::new(move |decision| log.record(decision))
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts attributing decisions to a new exec.
    pub fn open(self: &Arc<Self>) -> ExecWindow {
        let mut state = self.lock();
        state.next += 1;
        let id = state.next;
        state.windows.insert(id, Window::default());
        ExecWindow {
            log: Arc::clone(self),
            id,
        }
    }

    /// Records one decision in every open window.
    pub fn record(&self, decision: &Decision) {
        let mut state = self.lock();
        for window in state.windows.values_mut() {
            window.record(decision);
        }
        drop(state);
        if decision.end.is_some() {
            self.ended.notify_all();
        }
    }

    fn close(&self, window: u64, grace: Duration) -> (Vec<Violation>, NetworkActivity) {
        let deadline = Instant::now() + grace;
        let mut state = self.lock();
        loop {
            let pending = state
                .windows
                .get(&window)
                .is_some_and(|w| !w.open.is_empty());
            let left = deadline.saturating_duration_since(Instant::now());
            if !pending || left.is_zero() {
                break;
            }
            state = match self.ended.wait_timeout(state, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        let Some(mut w) = state.windows.remove(&window) else {
            return (Vec::new(), NetworkActivity::default());
        };
        w.activity.open = w.open.len() as u64;
        if w.more_denials > 0 {
            w.violations.push(Violation {
                kind: "network".to_owned(),
                detail: format!(
                    "{} more connections were denied (see network.connections)",
                    w.more_denials
                ),
            });
        }
        (w.violations, w.activity)
    }
}

impl Window {
    fn record(&mut self, d: &Decision) {
        let a = &mut self.activity;
        if let Some(r) = &d.request {
            for name in &r.secrets {
                match a
                    .secrets
                    .iter_mut()
                    .find(|u| u.secret == *name && u.host == d.host && u.port == d.port)
                {
                    Some(u) => u.requests += 1,
                    None => a.secrets.push(SecretUse {
                        secret: name.clone(),
                        host: d.host.clone(),
                        port: d.port,
                        requests: 1,
                    }),
                }
            }
            if d.outcome != Outcome::Denied {
                return;
            }
            a.requests_denied += 1;
            if a.connections.len() < MAX_LISTED_CONNECTIONS {
                a.connections.push(NetworkConnection {
                    request: Some(format!("{} {}", r.method, r.path)),
                    ..connection_of(d)
                });
            } else {
                a.omitted += 1;
            }
            self.push_violation(d);
            return;
        }
        if let Some(end) = &d.end {
            let Some(listed) = self.open.remove(&d.id) else {
                // Allowed before this window opened: its bytes belong to an earlier exec.
                return;
            };
            a.bytes_up += end.bytes_up;
            a.bytes_down += end.bytes_down;
            if let Some(c) = listed.and_then(|i| a.connections.get_mut(i)) {
                c.bytes_up = Some(end.bytes_up);
                c.bytes_down = Some(end.bytes_down);
                c.duration_ms = Some(end.duration_ms);
                c.error = end.error.clone();
            }
            return;
        }
        match d.outcome {
            Outcome::Allowed => a.allowed += 1,
            Outcome::Denied => a.denied += 1,
            Outcome::Failed => a.failed += 1,
        }
        let listed = if a.connections.len() < MAX_LISTED_CONNECTIONS {
            a.connections.push(connection_of(d));
            Some(a.connections.len() - 1)
        } else {
            a.omitted += 1;
            None
        };
        if d.outcome == Outcome::Allowed {
            self.open.insert(d.id, listed);
        }
        self.push_violation(d);
    }

    fn push_violation(&mut self, d: &Decision) {
        if let Some(v) = d.violation()
            && !self.violations.contains(&v)
        {
            if self.violations.len() < MAX_NETWORK_VIOLATIONS {
                self.violations.push(v);
            } else {
                self.more_denials += 1;
            }
        }
    }
}

/// A decision as a listed connection (before it ends).
fn connection_of(d: &Decision) -> NetworkConnection {
    NetworkConnection {
        host: d.host.clone(),
        port: d.port,
        protocol: d.protocol.as_str().to_owned(),
        outcome: d.outcome.as_str().to_owned(),
        ip: d.ip.map(|ip| ip.to_string()),
        rule: d.rule.clone(),
        reason: d.reason.clone(),
        hint: d.hint.clone(),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        error: None,
        inspected: d.inspected,
        request: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(id: u64, host: &str, outcome: Outcome) -> Decision {
        Decision {
            id,
            time_ms: 0,
            tag: "sb".into(),
            client: "127.0.0.1:4000".into(),
            protocol: Protocol::Connect,
            host: host.into(),
            port: 443,
            ip: None,
            addresses: vec![],
            outcome,
            rule: None,
            reason: (outcome == Outcome::Denied).then(|| "not in allowlist".into()),
            hint: (outcome == Outcome::Denied)
                .then(|| format!("to allow it, add \"{host}:443\" to network.allow")),
            end: None,
            inspected: false,
            request: None,
        }
    }

    fn ended(id: u64, up: u64, down: u64) -> Decision {
        Decision {
            end: Some(ConnectionEnd {
                bytes_up: up,
                bytes_down: down,
                duration_ms: 5,
                error: None,
            }),
            ..decision(id, "ok.test", Outcome::Allowed)
        }
    }

    #[test]
    fn denial_becomes_a_violation() {
        let d = decision(1, "evil.example", Outcome::Denied);
        assert_eq!(
            d.violation(),
            Some(Violation {
                kind: "network".into(),
                detail: "connect evil.example:443 denied: not in allowlist; to allow it, add \
                         \"evil.example:443\" to network.allow"
                    .into()
            })
        );
        assert_eq!(decision(1, "x", Outcome::Allowed).violation(), None);
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["outcome"], "denied");
        assert_eq!(json["protocol"], "connect");
    }

    #[test]
    fn windows_get_what_happened_while_they_were_open() {
        let log = EgressLog::new();
        let sink = log.sink();
        sink(&decision(1, "before.test", Outcome::Denied));
        let a = log.open();
        sink(&decision(2, "ok.test", Outcome::Allowed));
        let b = log.open();
        sink(&decision(3, "evil.test", Outcome::Denied));
        sink(&decision(4, "evil.test", Outcome::Denied));
        sink(&ended(2, 10, 2000));
        let (violations, activity) = a.close(Duration::ZERO);
        assert_eq!(violations.len(), 1, "identical denials are reported once");
        assert!(violations[0].detail.contains("evil.test:443 denied"));
        assert_eq!((activity.allowed, activity.denied), (1, 2));
        assert_eq!(
            (activity.bytes_up, activity.bytes_down, activity.open),
            (10, 2000, 0)
        );
        assert_eq!(activity.connections[0].bytes_down, Some(2000));
        // b opened after connection 2 was allowed: its end is not b's.
        let (violations, activity) = b.close(Duration::ZERO);
        assert_eq!(violations.len(), 1);
        assert_eq!(
            (activity.allowed, activity.denied, activity.bytes_down),
            (0, 2, 0)
        );
        // Windows are gone once closed (or dropped): decisions go nowhere.
        let c = log.open();
        drop(c);
        log.record(&decision(9, "late.test", Outcome::Denied));
        assert!(log.lock().windows.is_empty());
    }

    #[test]
    fn close_waits_for_open_connections_then_counts_them() {
        let log = EgressLog::new();
        let w = log.open();
        log.record(&decision(1, "ok.test", Outcome::Allowed));
        log.record(&decision(2, "ok.test", Outcome::Allowed));
        let ender = {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                log.record(&ended(1, 1, 1));
            })
        };
        let start = Instant::now();
        let (_, activity) = w.close(Duration::from_millis(300));
        ender.join().unwrap();
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert_eq!(
            (activity.allowed, activity.open, activity.bytes_up),
            (2, 1, 1)
        );
    }

    #[test]
    fn lists_and_violations_are_bounded() {
        let log = EgressLog::new();
        let w = log.open();
        for i in 0..100 {
            log.record(&decision(i, &format!("h{i}.test"), Outcome::Denied));
        }
        let (violations, activity) = w.close(Duration::ZERO);
        assert_eq!(activity.connections.len(), MAX_LISTED_CONNECTIONS);
        assert_eq!(activity.omitted, 100 - MAX_LISTED_CONNECTIONS as u64);
        assert_eq!(violations.len(), MAX_NETWORK_VIOLATIONS + 1);
        assert!(
            violations[MAX_NETWORK_VIOLATIONS]
                .detail
                .starts_with("84 more")
        );
    }

    /// A process of its own in a fresh network namespace (root only: creating one needs
    /// `CAP_SYS_ADMIN`), killed on drop.
    struct NetnsProcess(std::process::Child);

    impl Drop for NetnsProcess {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_listener_made_in_another_namespace_is_reached_from_there() {
        use std::io::{Read, Write};
        use std::os::unix::process::CommandExt;
        if !nix::unistd::geteuid().is_root() {
            // Unprivileged, a fresh network namespace needs a user namespace of its own, whose
            // namespace this process then has no capability over; what is tested is the root
            // case (a container's namespace).
            if std::env::var("TASKBOX_REQUIRE_ALL").as_deref() == Ok("1") {
                panic!("needs root (TASKBOX_REQUIRE_ALL=1)");
            }
            eprintln!("SKIP: creating a network namespace needs root");
            return;
        }
        let mut cmd = std::process::Command::new("/bin/sleep");
        cmd.arg("30");
        // SAFETY: unshare and the loopback ioctl are async-signal-safe system calls on the
        // child's own state; nothing is allocated between fork and exec but the error value.
        unsafe {
            cmd.pre_exec(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
                taskbox_init::sys::loopback_up()
            });
        }
        let child = NetnsProcess(cmd.spawn().unwrap());
        let pid = child.0.id() as i32;
        // Wait until the child is in its own namespace.
        let own = std::fs::read_link("/proc/self/ns/net").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap() == own {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        let listener = listen_in_netns(pid, PROXY_PORT).unwrap();
        let port = listener.local_addr().unwrap().port();
        // A client in that namespace reaches it; the listener is served from here.
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
        let client = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"ping").unwrap();
            let mut back = String::new();
            s.read_to_string(&mut back).unwrap();
            back
        });
        let (mut conn, _) = listener.accept().unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).unwrap();
        conn.write_all(b"pong").unwrap();
        drop(conn);
        assert_eq!(&got, b"ping");
        assert_eq!(client.join().unwrap(), "pong");
        // This thread's namespace is unchanged.
        assert_eq!(std::fs::read_link("/proc/self/ns/net").unwrap(), own);
    }

    #[test]
    fn proxy_variables_cover_both_cases_and_append_to_git_config() {
        let env = proxy_env(3128, &[("GIT_CONFIG_COUNT".into(), "2".into())]);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HTTP_PROXY"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("https_proxy"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("all_proxy"), Some("socks5h://127.0.0.1:3128"));
        assert_eq!(get("NO_PROXY"), Some("localhost,127.0.0.1,::1"));
        assert_eq!(get("PIP_PROXY"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("GIT_CONFIG_KEY_2"), Some("http.proxy"));
        assert_eq!(get("GIT_CONFIG_VALUE_2"), Some("http://127.0.0.1:3128"));
        assert_eq!(get("GIT_CONFIG_COUNT"), Some("3"));
        let env = proxy_env(3128, &[]);
        assert!(env.contains(&("GIT_CONFIG_KEY_0".into(), "http.proxy".into())));
    }
}
