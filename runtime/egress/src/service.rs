//! [`ProxyService`]: the proxy behind `taskbox_core::egress::EgressService`, so that backends
//! (which do not link this crate) can start one proxy per sandbox.
//!
//! The service owns a small tokio runtime of its own: the backends are synchronous, and the
//! proxy's relaying stays off the threads of whoever calls them (the HTTP server's workers, or a
//! single-threaded `taskbox run`). Every proxy the service starts runs on it.

use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use taskbox_core::api::{ApiError, SecretStatus, SecretValue};
use taskbox_core::egress::{
    DecisionSink, EgressConfig, EgressError, EgressProxy, EgressService, SandboxTrust,
};
use taskbox_core::policy::Network;
use tokio::runtime::{Handle, Runtime};

use crate::tls::UpstreamTls;
use crate::{Limits, Proxy, Resolver, Rules};

/// How long [`EgressProxy::shutdown`] waits for the proxy's connections to end.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Starts egress proxies on a runtime of its own (see the module doc).
pub struct ProxyService {
    /// `None` only while dropping.
    runtime: Option<Runtime>,
    handle: Handle,
    resolver: Option<Arc<dyn Resolver>>,
    limits: Limits,
    /// PEM certificates the proxy trusts for upstreams beside the host's roots.
    extra_ca: Option<Vec<u8>>,
    /// The roots upstreams of inspected hosts are checked against, loaded on first use.
    upstream: OnceLock<Result<Arc<UpstreamTls>, String>>,
}

impl std::fmt::Debug for ProxyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyService")
            .field("limits", &self.limits)
            .finish()
    }
}

impl ProxyService {
    /// A service whose proxies share `threads` worker threads (at least one).
    pub fn new(threads: usize) -> Result<ProxyService, EgressError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("taskbox-egress")
            .enable_all()
            .build()
            .map_err(|e| EgressError::Start(format!("cannot start its runtime: {e}")))?;
        Ok(ProxyService {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            resolver: None,
            limits: Limits::default(),
            extra_ca: None,
            upstream: OnceLock::new(),
        })
    }

    /// Trusts the CA certificates of `pem` for the upstreams of inspected hosts, beside the
    /// host's roots: the supervisor's setting for a private CA (or a test's), never the
    /// sandbox's. Fails when `pem` holds no usable certificate.
    pub fn upstream_ca(mut self, pem: Vec<u8>) -> Result<ProxyService, EgressError> {
        UpstreamTls::new(Some(&pem)).map_err(|e| EgressError::Tls(e.to_string()))?;
        self.extra_ca = Some(pem);
        self.upstream = OnceLock::new();
        Ok(self)
    }

    fn upstream_tls(&self) -> Result<Arc<UpstreamTls>, EgressError> {
        self.upstream
            .get_or_init(|| {
                UpstreamTls::new(self.extra_ca.as_deref())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(EgressError::Tls)
    }

    /// Resolves names with `resolver` instead of the host's (tests: a resolver that answers
    /// with a metadata address, or changes its answer).
    pub fn resolver(mut self, resolver: Arc<dyn Resolver>) -> ProxyService {
        self.resolver = Some(resolver);
        self
    }

    pub fn limits(mut self, limits: Limits) -> ProxyService {
        self.limits = limits;
        self
    }
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which panics inside another runtime's context; this neither
        // blocks nor panics. Proxies still running are cancelled with it.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl EgressService for ProxyService {
    fn start(
        &self,
        tag: &str,
        config: EgressConfig,
        sink: DecisionSink,
    ) -> Result<Box<dyn EgressProxy>, EgressError> {
        let mut builder = Proxy::builder(Rules::from_policy(&config.network))
            .tag(tag)
            .limits(self.limits.clone())
            .on_decision(move |decision| sink(decision));
        if let Some(resolver) = &self.resolver {
            builder = builder.resolver(resolver.clone());
        }
        if config.inspects() {
            let upstream = self.upstream_tls()?;
            builder = builder
                .inspect_with(config, &upstream)
                .map_err(|e| EgressError::Tls(e.to_string()))?;
        }
        Ok(Box::new(ServiceProxy {
            proxy: Arc::new(builder.build()),
            handle: self.handle.clone(),
        }))
    }
}

/// A proxy of a [`ProxyService`].
struct ServiceProxy {
    proxy: Arc<Proxy>,
    handle: Handle,
}

impl EgressProxy for ServiceProxy {
    fn serve_listener(&self, listener: TcpListener) -> Result<(), EgressError> {
        let _entered = self.handle.enter();
        self.proxy
            .serve_tcp_listener(listener)
            .map(|_| ())
            .map_err(|e| EgressError::Listen(e.to_string()))
    }

    fn listen_unix(&self, path: &Path) -> Result<(), EgressError> {
        let _entered = self.handle.enter();
        self.proxy
            .listen_unix(path)
            .map_err(|e| EgressError::Listen(e.to_string()))
    }

    fn set_rules(&self, network: &Network) {
        self.proxy.rules().replace(Rules::from_policy(network));
    }

    fn trust(&self) -> Option<SandboxTrust> {
        self.proxy.trust()
    }

    fn set_secret(&self, name: &str, value: Option<SecretValue>) -> Result<SecretStatus, ApiError> {
        self.proxy.set_secret(name, value)
    }

    fn shutdown(&self) {
        // Waits on a channel rather than `block_on`, which panics when the caller is itself
        // inside a runtime.
        let (done, wait) = std::sync::mpsc::channel();
        let proxy = self.proxy.clone();
        self.handle.spawn(async move {
            proxy.shutdown().await;
            let _ = done.send(());
        });
        if wait.recv_timeout(SHUTDOWN_WAIT).is_err() {
            tracing::warn!(
                "the egress proxy did not shut down within {}s",
                SHUTDOWN_WAIT.as_secs()
            );
        }
    }
}
