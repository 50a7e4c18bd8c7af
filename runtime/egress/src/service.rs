//! [`ProxyService`]: the proxy behind `taskbox_core::egress::EgressService`, so that backends
//! (which do not link this crate) can start one proxy per sandbox.
//!
//! The service owns a small tokio runtime of its own: the backends are synchronous, and the
//! proxy's relaying stays off the threads of whoever calls them (the HTTP server's workers, or a
//! single-threaded `taskbox run`). Every proxy the service starts runs on it.

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use taskbox_core::egress::{DecisionSink, EgressError, EgressProxy, EgressService};
use taskbox_core::policy::Network;
use tokio::runtime::{Handle, Runtime};

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
        })
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
        network: &Network,
        sink: DecisionSink,
    ) -> Result<Box<dyn EgressProxy>, EgressError> {
        let mut builder = Proxy::builder(Rules::from_policy(network))
            .tag(tag)
            .limits(self.limits.clone())
            .on_decision(move |decision| sink(decision));
        if let Some(resolver) = &self.resolver {
            builder = builder.resolver(resolver.clone());
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
