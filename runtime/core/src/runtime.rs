//! The runtime assembled once: [`RuntimeBuilder`] opens the backends and stacks the decorators
//! over them in one order, for every surface that runs sandboxes in its own process (`serve`,
//! `mcp`, `agent`, `replay`, `run --backend docker`, the MCP test server).
//!
//! From the bottom up:
//!
//! 1. the backends: the native one ([`RuntimeBuilder::native`], opened first) and any other
//!    ([`RuntimeBuilder::backend`], e.g. Docker, opened after it in the order given);
//! 2. a [`BackendRouter`] over them, always, so a create names its backend (default "native")
//!    and a create asking for one that is absent gets the router's error naming those there are;
//! 3. the command policy ([`CommandPolicy`]), when asked for: every exec checked against its
//!    sandbox's `[commands]` rules before any backend sees it;
//! 4. the trace recorder ([`Traced`]), when given a directory: outermost, so refused execs,
//!    approvals and denials are recorded too.
//!
//! The policy of a create is resolved once, by the outermost layer that sees the request (the
//! server's handler before it, else [`Traced`] or [`CommandPolicy`], else the backend), and
//! travels down in [`CreateRequest::resolved_policy`]; no layer reads the policy again.

use std::path::PathBuf;
use std::sync::Arc;

use crate::api::{ApiError, SandboxApi};
use crate::approvals::CommandPolicy;
use crate::egress::EgressService;
use crate::image::ImageResolver;
use crate::kit::ForkPoolConfig;
use crate::router::{BackendRouter, DEFAULT_BACKEND};
use crate::sandbox::NativeBackend;
use crate::trace::{TraceSync, Traced};

#[cfg(doc)]
use crate::api::CreateRequest;

/// Opens a backend when the runtime is built.
type Open = Box<dyn FnOnce() -> Result<Arc<dyn SandboxApi>, ApiError>>;

/// The native backend's settings, opened by [`RuntimeBuilder::build`].
struct Native {
    state_dir: PathBuf,
    images: Option<Arc<dyn ImageResolver>>,
    egress: Option<Arc<dyn EgressService>>,
    hidden: Vec<PathBuf>,
    fork_pool: Option<ForkPoolConfig>,
}

/// Builds the [`SandboxApi`] a surface serves: backends, router, command policy, trace (see the
/// module docs for the order).
#[derive(Default)]
pub struct RuntimeBuilder {
    native: Option<Native>,
    others: Vec<(String, Open)>,
    command_policy: bool,
    trace: Option<PathBuf>,
    trace_sync: TraceSync,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("native", &self.native.as_ref().map(|n| &n.state_dir))
            .field(
                "others",
                &self.others.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("command_policy", &self.command_policy)
            .field("trace", &self.trace)
            .finish()
    }
}

impl RuntimeBuilder {
    /// A runtime with no backend yet, no command policy and no trace.
    pub fn new() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The native backend, keeping its state in `state_dir` (see [`NativeBackend::new`]).
    pub fn native(mut self, state_dir: impl Into<PathBuf>) -> Self {
        self.native = Some(Native {
            state_dir: state_dir.into(),
            images: None,
            egress: None,
            hidden: Vec::new(),
            fork_pool: None,
        });
        self
    }

    /// The native backend's images ([`NativeBackend::with_images`]); nothing without
    /// [`native`](Self::native).
    pub fn images(mut self, images: Arc<dyn ImageResolver>) -> Self {
        if let Some(n) = &mut self.native {
            n.images = Some(images);
        }
        self
    }

    /// The native backend's egress service ([`NativeBackend::with_egress`]); nothing without
    /// [`native`](Self::native). Another backend is given its own in its configuration.
    pub fn egress(mut self, egress: Arc<dyn EgressService>) -> Self {
        if let Some(n) = &mut self.native {
            n.egress = Some(egress);
        }
        self
    }

    /// More host paths the native backend hides in every sandbox
    /// ([`NativeBackend::with_hidden_paths`]); nothing without [`native`](Self::native).
    pub fn hidden_paths(mut self, paths: Vec<PathBuf>) -> Self {
        if let Some(n) = &mut self.native {
            n.hidden = paths;
        }
        self
    }

    /// The native backend's warm pool of forks ([`NativeBackend::with_fork_pool`]); nothing
    /// without [`native`](Self::native).
    pub fn fork_pool(mut self, config: ForkPoolConfig) -> Self {
        if let Some(n) = &mut self.native {
            n.fork_pool = Some(config);
        }
        self
    }

    /// Another backend, served under `name` (a create's `backend`), opened by `open` when the
    /// runtime is built: after the native one, so a native backend that cannot open leaves the
    /// others unopened.
    pub fn backend<F>(mut self, name: impl Into<String>, open: F) -> Self
    where
        F: FnOnce() -> Result<Arc<dyn SandboxApi>, ApiError> + 'static,
    {
        self.others.push((name.into(), Box::new(open)));
        self
    }

    /// Whether every exec is checked against its sandbox's command rules ([`CommandPolicy`]).
    /// Off where the surface checks them itself (`run`) or answers them as a recording did
    /// (`replay`).
    pub fn command_policy(mut self, on: bool) -> Self {
        self.command_policy = on;
        self
    }

    /// Records every operation of every sandbox in `traces_dir` (normally `STATE/traces`; see
    /// [`Traced`]).
    pub fn trace(mut self, traces_dir: impl Into<PathBuf>) -> Self {
        self.trace = Some(traces_dir.into());
        self
    }

    /// When the trace's op lines reach the disk (default [`TraceSync::Batched`]; see
    /// [`Traced`]).
    pub fn trace_sync(mut self, sync: TraceSync) -> Self {
        self.trace_sync = sync;
        self
    }

    /// Opens the backends, native first, and stacks the router, the command policy and the
    /// trace over them. Fails with the error of the first backend that cannot open (those
    /// opened before it are dropped), or when there is no backend or one name is given twice.
    pub fn build(self) -> Result<Arc<dyn SandboxApi>, ApiError> {
        let mut router = BackendRouter::new();
        if let Some(n) = self.native {
            let mut native = NativeBackend::new(n.state_dir)?.with_hidden_paths(n.hidden);
            if let Some(images) = n.images {
                native = native.with_images(images);
            }
            if let Some(egress) = n.egress {
                native = native.with_egress(egress);
            }
            if let Some(pool) = n.fork_pool {
                native = native.with_fork_pool(pool);
            }
            router = router.with(DEFAULT_BACKEND, Arc::new(native));
        }
        for (name, open) in self.others {
            if router.names().contains(&name.as_str()) {
                return Err(ApiError::internal(format!(
                    "backend {name:?} is given twice to the runtime"
                )));
            }
            router = router.with(name, open()?);
        }
        if router.names().is_empty() {
            return Err(ApiError::internal(
                "the runtime has no backend: give it the native one or another",
            ));
        }
        Ok(match (self.command_policy, self.trace) {
            (false, None) => Arc::new(router),
            (true, None) => Arc::new(CommandPolicy::new(router)),
            (false, Some(dir)) => Arc::new(Traced::new(router, dir).with_sync(self.trace_sync)),
            (true, Some(dir)) => {
                Arc::new(Traced::new(CommandPolicy::new(router), dir).with_sync(self.trace_sync))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::CreateRequest;

    #[test]
    fn no_backend_is_an_error() {
        let err = RuntimeBuilder::new().command_policy(true).build().err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("no backend"), "{err}");
    }

    #[test]
    fn a_name_given_twice_is_an_error_and_the_second_is_not_opened() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().to_path_buf();
        let err = RuntimeBuilder::new()
            .native(state.join("a"))
            .backend("native", move || {
                panic!(
                    "a duplicate backend must not be opened ({})",
                    state.display()
                )
            })
            .build()
            .err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("\"native\" is given twice"), "{err}");
    }

    #[test]
    fn the_native_backend_opens_before_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let held = NativeBackend::new(state.clone()).unwrap();
        // The native backend cannot open (its state directory is held): the other backend's
        // opener must not run, as `serve --docker` never opened Docker then.
        let err = RuntimeBuilder::new()
            .native(state)
            .backend("docker", || panic!("opened before the native backend"))
            .build()
            .err();
        drop(held);
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("another taskbox supervisor"), "{err}");
    }

    #[test]
    fn an_absent_backend_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let api = RuntimeBuilder::new()
            .native(dir.path().join("state"))
            .command_policy(true)
            .trace(dir.path().join("traces"))
            .build()
            .unwrap();
        let err = api
            .create(CreateRequest {
                workspace: dir.path().display().to_string(),
                backend: Some("docker".into()),
                ..CreateRequest::default()
            })
            .unwrap_err();
        assert_eq!(err.code(), "invalid_argument", "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("backend \"docker\" is not available here; available: native"),
            "{msg}"
        );
        assert!(api.list().is_empty());
        // Nothing was created, so nothing was traced.
        assert!(!dir.path().join("traces").exists());
    }
}
