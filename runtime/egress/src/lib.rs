//! taskbox-egress: the egress proxy, the only way out of a sandbox.
//!
//! A sandbox has no network interface but loopback; its clients reach the network through this
//! proxy, bridged into the sandbox as a Unix socket. One socket serves HTTP `CONNECT`, plain
//! HTTP forwarding (absolute-form requests) and SOCKS5 with remote name resolution, told apart by
//! the first byte (`0x05`: SOCKS5). Every request is decided by the policy's `[network]` rules
//! ([`rules`]): the proxy resolves names itself, checks every address, and connects only to the
//! addresses it checked. A denial reaches the client (HTTP 403 with a one-line reason, SOCKS5
//! reply "connection not allowed by ruleset") and the subscriber (a [`Decision`] event, which the
//! sandbox layer turns into an ExecResult violation with [`Decision::violation`]).
//!
//! ```no_run
//! # async fn example(policy: taskbox_core::policy::Policy) -> Result<(), taskbox_egress::EgressError> {
//! use taskbox_egress::{Proxy, Rules};
//! let proxy = Proxy::builder(Rules::from_policy(&policy.network))
//!     .tag("sandbox-1")
//!     .on_decision(|decision| eprintln!("{}", decision.message()))
//!     .build();
//! proxy.listen_unix("/run/taskbox/sandbox-1/egress.sock".as_ref())?;
//! // ... later, a new allowlist for the live sandbox:
//! proxy.rules().replace(Rules::default());
//! proxy.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! The matching rules, what "named by the policy" means for internal addresses, the events and
//! the limits are documented in `docs/egress.md`.

pub mod addr;
pub mod audit;
mod conn;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
mod http;
mod inspect;
mod meter;
mod relay;
pub mod rules;
mod secrets;
pub mod service;
mod socks;
mod splice;
mod tls;

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use event::{ConnectionEnd, Decision, Outcome, Protocol, Subscriber};
pub use rules::{Denial, Resolver, Rules, RulesHandle, SystemResolver, Verdict, decide};
pub use service::ProxyService;
pub use tls::TlsError;

/// Bounds on what one client can make the proxy hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest HTTP request or response head (the request line or status line and headers).
    pub max_header_bytes: usize,
    /// Time from accepting a connection to a complete request.
    pub handshake_timeout: Duration,
    /// Time to resolve a name and connect to one of its addresses.
    pub connect_timeout: Duration,
    /// A connection with no byte moving either way for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; further clients wait to be accepted.
    pub max_connections: usize,
    /// Largest pipe per direction of a connection for zero-copy relaying with splice(2); 0
    /// copies through `buffer_bytes` of memory instead (also the fallback when a pipe cannot be
    /// had). A pipe starts at the system's default (64 KiB) and grows while its direction keeps
    /// it full, so only bulk transfers hold large pipes.
    pub pipe_bytes: usize,
    /// Copy buffer per direction when not splicing.
    pub buffer_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 64 * 1024,
            handshake_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            max_connections: 256,
            pipe_bytes: 1024 * 1024,
            buffer_bytes: 64 * 1024,
        }
    }
}

/// Why the proxy could not start listening.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// Binding the TCP listener failed.
    #[error("cannot listen on {addr}: {source}")]
    ListenTcp {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// Binding the Unix socket failed.
    #[error("cannot listen on {}: {source}", path.display())]
    ListenUnix {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A listener handed to the proxy cannot be served.
    #[error("cannot serve the listener: {source}")]
    Serve {
        #[source]
        source: io::Error,
    },
    /// The proxy was shut down.
    #[error("the egress proxy is shut down")]
    ShutDown,
    /// The inspection of HTTPS (the sandbox's CA, the upstream's roots) could not be set up.
    #[error("cannot inspect HTTPS: {0}")]
    Inspection(String),
}

/// What every connection of a proxy shares.
pub(crate) struct Shared {
    pub(crate) rules: RulesHandle,
    pub(crate) resolver: Arc<dyn Resolver>,
    subscriber: Option<Subscriber>,
    pub(crate) tag: String,
    pub(crate) limits: Limits,
    pub(crate) cancel: CancellationToken,
    next_id: AtomicU64,
    active: AtomicUsize,
    /// The hosts whose HTTP the proxy reads (secrets, request rules), and how.
    pub(crate) inspection: Option<Arc<inspect::Inspection>>,
}

impl Shared {
    pub(crate) fn emit(&self, decision: &Decision) {
        match (decision.outcome, &decision.end) {
            (Outcome::Allowed, None) => tracing::debug!(
                tag = %decision.tag, id = decision.id, target = %decision.target(),
                ip = ?decision.ip, rule = ?decision.rule, "egress allowed"
            ),
            (_, Some(end)) => tracing::debug!(
                tag = %decision.tag, id = decision.id, target = %decision.target(),
                up = end.bytes_up, down = end.bytes_down, error = ?end.error, "egress closed"
            ),
            _ => tracing::info!(
                tag = %decision.tag, id = decision.id, target = %decision.target(),
                "{}", decision.message()
            ),
        }
        if let Some(subscriber) = &self.subscriber {
            subscriber(decision);
        }
    }
}

/// Configures a [`Proxy`].
pub struct ProxyBuilder {
    rules: Rules,
    resolver: Arc<dyn Resolver>,
    subscriber: Option<Subscriber>,
    tag: String,
    limits: Limits,
    inspection: Option<Arc<inspect::Inspection>>,
}

impl ProxyBuilder {
    /// The tag every [`Decision`] carries (the sandbox id).
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = tag.into();
        self
    }

    /// Resolves names with `resolver` instead of the host's resolver (`[network.hosts]` still
    /// comes first).
    pub fn resolver(mut self, resolver: Arc<dyn Resolver>) -> Self {
        self.resolver = resolver;
        self
    }

    /// Calls `subscriber` with every decision and every end of an allowed connection.
    pub fn on_decision(mut self, subscriber: impl Fn(&Decision) + Send + Sync + 'static) -> Self {
        self.subscriber = Some(Arc::new(subscriber));
        self
    }

    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Inspects the hosts of `config`'s secrets and request rules (`config.network`'s
    /// `requests`): the proxy makes the sandbox's CA, presents the secrets and applies the rules
    /// (docs/secrets.md). Upstreams are checked against the host's roots and `extra_ca` (PEM),
    /// the supervisor's own addition for private or test CAs.
    /// Fails when the sandbox's CA cannot be made or the host has no usable roots. Without
    /// secrets or request rules in `config`, nothing is inspected.
    pub fn inspect(
        self,
        config: taskbox_core::egress::EgressConfig,
        extra_ca: Option<&[u8]>,
    ) -> Result<Self, EgressError> {
        if !config.inspects() {
            return Ok(self);
        }
        let upstream =
            tls::UpstreamTls::new(extra_ca).map_err(|e| EgressError::Inspection(e.to_string()))?;
        self.inspect_with(config, &upstream)
    }

    /// [`ProxyBuilder::inspect`] with upstream roots loaded once for many proxies.
    pub(crate) fn inspect_with(
        mut self,
        config: taskbox_core::egress::EgressConfig,
        upstream: &tls::UpstreamTls,
    ) -> Result<Self, EgressError> {
        if config.inspects() {
            let inspection = inspect::Inspection::new(&self.tag, config, upstream)
                .map_err(EgressError::Inspection)?;
            self.inspection = Some(Arc::new(inspection));
        }
        Ok(self)
    }

    /// The proxy, not yet listening.
    pub fn build(self) -> Proxy {
        let inspection = self.inspection;
        let max = self.limits.max_connections.max(1);
        Proxy {
            shared: Arc::new(Shared {
                rules: RulesHandle::new(self.rules),
                resolver: self.resolver,
                subscriber: self.subscriber,
                tag: self.tag,
                limits: self.limits,
                cancel: CancellationToken::new(),
                next_id: AtomicU64::new(1),
                active: AtomicUsize::new(0),
                inspection,
            }),
            tracker: TaskTracker::new(),
            slots: Arc::new(Semaphore::new(max)),
            unix_paths: Mutex::new(Vec::new()),
        }
    }
}

/// A running egress proxy: its listeners and connections. Dropping it stops them (without
/// waiting); [`Proxy::shutdown`] stops them and waits.
pub struct Proxy {
    shared: Arc<Shared>,
    tracker: TaskTracker,
    /// One permit per connection being served (listeners of a proxy share them).
    slots: Arc<Semaphore>,
    unix_paths: Mutex<Vec<PathBuf>>,
}

impl Proxy {
    pub fn builder(rules: Rules) -> ProxyBuilder {
        ProxyBuilder {
            rules,
            resolver: Arc::new(SystemResolver),
            subscriber: None,
            tag: String::new(),
            limits: Limits::default(),
            inspection: None,
        }
    }

    /// What the sandbox must see for its inspected hosts (its CA bundle, its secrets'
    /// placeholders); `None` when nothing is inspected.
    pub fn trust(&self) -> Option<taskbox_core::egress::SandboxTrust> {
        self.shared.inspection.as_ref().map(|i| i.trust().clone())
    }

    /// Rotates (a new value) or revokes (`None`) one of the proxy's secrets, for every request
    /// from now on (requests already sent keep what they had).
    pub fn set_secret(
        &self,
        name: &str,
        value: Option<taskbox_core::api::SecretValue>,
    ) -> Result<taskbox_core::api::SecretStatus, taskbox_core::api::ApiError> {
        match &self.shared.inspection {
            Some(i) => i.set_secret(name, value),
            None => Err(taskbox_core::api::ApiError::not_found(format!(
                "this sandbox's policy has no secret {name:?}"
            ))),
        }
    }

    /// The state of every secret (never a value).
    pub fn secrets(&self) -> Vec<taskbox_core::api::SecretStatus> {
        self.shared
            .inspection
            .as_ref()
            .map(|i| i.secret_statuses())
            .unwrap_or_default()
    }

    /// The live rules; [`RulesHandle::replace`] changes them for every later request.
    pub fn rules(&self) -> RulesHandle {
        self.shared.rules.clone()
    }

    /// Listens on TCP `addr` (port 0: any free port); returns the bound address. For tests and
    /// tools; sandboxes reach the proxy through [`Proxy::listen_unix`].
    pub async fn listen_tcp(&self, addr: SocketAddr) -> Result<SocketAddr, EgressError> {
        if self.shared.cancel.is_cancelled() {
            return Err(EgressError::ShutDown);
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EgressError::ListenTcp { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| EgressError::ListenTcp { addr, source })?;
        self.accept_tcp(listener);
        Ok(local)
    }

    /// Serves the clients of `listener` until shutdown.
    fn accept_tcp(&self, listener: TcpListener) {
        let shared = self.shared.clone();
        let slots = self.slots.clone();
        let tracker = self.tracker.clone();
        self.tracker.spawn(async move {
            accept_loop(&shared, &slots, &tracker, || async {
                let (stream, peer) = listener.accept().await?;
                tune_client(&stream, &peer);
                Ok((stream, peer.to_string()))
            })
            .await;
        });
    }

    /// Accepts clients on `listener`, a listening TCP socket made elsewhere: the native backend's,
    /// bound to `127.0.0.1:3128` inside a sandbox's network namespace by the sandbox's pid 1 and
    /// handed out, so the proxy accepts the sandbox's connections directly. Returns its address.
    /// Call it within the proxy's tokio runtime (`Handle::enter`).
    pub fn serve_tcp_listener(
        &self,
        listener: std::net::TcpListener,
    ) -> Result<SocketAddr, EgressError> {
        if self.shared.cancel.is_cancelled() {
            return Err(EgressError::ShutDown);
        }
        let serve_err = |source| EgressError::Serve { source };
        let local = listener.local_addr().map_err(serve_err)?;
        listener.set_nonblocking(true).map_err(serve_err)?;
        self.accept_tcp(TcpListener::from_std(listener).map_err(serve_err)?);
        Ok(local)
    }

    /// Listens on a Unix socket at `path`, which must not exist; it is removed at shutdown.
    pub fn listen_unix(&self, path: &Path) -> Result<(), EgressError> {
        if self.shared.cancel.is_cancelled() {
            return Err(EgressError::ShutDown);
        }
        let listener = UnixListener::bind(path).map_err(|source| EgressError::ListenUnix {
            path: path.to_owned(),
            source,
        })?;
        self.unix_paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(path.to_owned());
        let shared = self.shared.clone();
        let slots = self.slots.clone();
        let tracker = self.tracker.clone();
        self.tracker.spawn(async move {
            accept_loop(&shared, &slots, &tracker, || async {
                let (stream, _) = listener.accept().await?;
                Ok((stream, "unix".to_owned()))
            })
            .await;
        });
        Ok(())
    }

    /// Stops accepting, ends every connection (allowed ones report their end with the error
    /// "proxy shut down"), waits for them, and removes the Unix sockets.
    pub async fn shutdown(&self) {
        self.shared.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        let paths = std::mem::take(
            &mut *self
                .unix_paths
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for path in paths {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Connections being served now.
    pub fn active_connections(&self) -> usize {
        self.shared.active.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

async fn accept_loop<S, F, Fut>(
    shared: &Arc<Shared>,
    slots: &Arc<Semaphore>,
    tracker: &TaskTracker,
    accept: F,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + splice::Socket + Unpin + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = io::Result<(S, String)>>,
{
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = shared.cancel.cancelled() => return,
        };
        let accepted = tokio::select! {
            accepted = accept() => accepted,
            () = shared.cancel.cancelled() => return,
        };
        let (stream, client) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(tag = %shared.tag, error = %err, "egress proxy cannot accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let shared = shared.clone();
        shared.active.fetch_add(1, Ordering::Relaxed);
        tracker.spawn(async move {
            conn::serve(shared.clone(), id, client, stream).await;
            shared.active.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
}

/// Congestion controls for the client's hop, best first: neither paces its sending.
const LOCAL_CONGESTION_CONTROL: [&str; 2] = ["cubic", "reno"];

/// Sets up an accepted TCP client: no Nagle delay (requests and TLS handshakes are small), and
/// on loopback (the sandbox's listener) a congestion control that does not pace. The host's
/// default may be BBR, which paces every send with a timer: on a hop with no queue and no loss
/// that only costs CPU, and switching it off about halved the proxy's CPU per GiB of a bulk
/// download on a 2-core host (docs/egress.md). Either control is only tried; the default stays
/// when the kernel refuses both.
fn tune_client(stream: &tokio::net::TcpStream, peer: &SocketAddr) {
    let _ = stream.set_nodelay(true);
    if !peer.ip().is_loopback() {
        return;
    }
    for name in LOCAL_CONGESTION_CONTROL {
        let name = std::ffi::OsString::from(name);
        match nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::TcpCongestion, &name)
        {
            Ok(()) => return,
            Err(err) => tracing::trace!(control = ?name, %err, "congestion control refused"),
        }
    }
}
