//! The connection to the Docker daemon: a bollard client on the backend's own tokio runtime,
//! every call bounded by a timeout, every failure sorted into what the API reports.

use std::future::Future;
use std::time::Duration;

use bollard::{ClientVersion, Docker};
use taskbox_core::api::ApiError;

/// Where the daemon listens unless `DOCKER_HOST` names another Unix socket.
pub const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";

/// Engine API 1.41 (Docker 20.10): the oldest daemon this backend supports, and every call used
/// exists there.
const API_VERSION: ClientVersion = ClientVersion {
    major_version: 1,
    minor_version: 41,
};

/// What went wrong with a daemon call.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// the daemon cannot be reached, or did not answer in time
    #[error("the Docker daemon is not reachable at {socket}: {why}")]
    Unavailable { socket: String, why: String },
    /// the object does not exist (404)
    #[error("{0}")]
    NotFound(String),
    /// the object is in the wrong state (409), e.g. a stopped container
    #[error("{0}")]
    Conflict(String),
    /// the daemon refused the request
    #[error("the Docker daemon refused to {what}: {message}")]
    Refused { what: String, message: String },
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> ApiError {
        match e {
            DaemonError::Unavailable { .. } => ApiError::Unavailable(format!(
                "{e}; check that dockerd is running (the next request tries again)"
            )),
            DaemonError::NotFound(m) => ApiError::NotFound(m),
            DaemonError::Conflict(m) => ApiError::Conflict(m),
            DaemonError::Refused { .. } => ApiError::Internal(e.to_string()),
        }
    }
}

/// The daemon client and the runtime its calls run on.
pub struct Daemon {
    pub(crate) docker: Docker,
    rt: Option<tokio::runtime::Runtime>,
    socket: String,
    /// The limit of one ordinary call.
    pub(crate) timeout: Duration,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("socket", &self.socket)
            .finish()
    }
}

impl Daemon {
    /// A client for the daemon at `socket` (`unix://PATH` or a path). Connects lazily: a daemon
    /// that is down now fails the first call, not this.
    pub fn new(socket: &str, timeout: Duration) -> Result<Daemon, ApiError> {
        let path = socket.trim_start_matches("unix://");
        if !path.starts_with('/') {
            return Err(ApiError::invalid(format!(
                "docker socket {socket:?}: only a local Unix socket (unix:///PATH) is supported"
            )));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("taskbox-docker")
            .enable_all()
            .build()
            .map_err(|e| ApiError::internal(format!("cannot start the docker runtime: {e}")))?;
        let secs = timeout.as_secs().max(1);
        let docker = Docker::connect_with_unix(path, secs, &API_VERSION).map_err(|e| {
            ApiError::Unavailable(format!(
                "the Docker daemon is not reachable at unix://{path}: {e}"
            ))
        })?;
        Ok(Daemon {
            docker,
            rt: Some(rt),
            socket: format!("unix://{path}"),
            timeout,
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &str {
        &self.socket
    }

    /// Runs `f` on the backend's runtime from a synchronous caller.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        match &self.rt {
            Some(rt) => rt.block_on(f),
            None => unreachable_runtime(),
        }
    }

    /// Spawns `f` on the backend's runtime.
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.rt {
            Some(rt) => rt.spawn(f),
            None => unreachable_runtime(),
        }
    }

    pub fn unavailable(&self, why: impl Into<String>) -> DaemonError {
        DaemonError::Unavailable {
            socket: self.socket.clone(),
            why: why.into(),
        }
    }

    /// Sorts a bollard error.
    pub fn classify(&self, what: &str, e: bollard::errors::Error) -> DaemonError {
        use bollard::errors::Error as E;
        match e {
            E::DockerResponseServerError {
                status_code,
                message,
            } => match status_code {
                404 => DaemonError::NotFound(message),
                409 => DaemonError::Conflict(message),
                // A daemon shutting down answers 5xx to what it can no longer do.
                502..=504 => self.unavailable(message),
                _ => DaemonError::Refused {
                    what: what.to_string(),
                    message,
                },
            },
            E::RequestTimeoutError => self.unavailable(format!("no answer to {what}")),
            E::IOError { .. }
            | E::HyperResponseError { .. }
            | E::HyperLegacyError { .. }
            | E::SocketNotFoundError(_)
            | E::HttpClientError { .. } => self.unavailable(e.to_string()),
            other => DaemonError::Refused {
                what: what.to_string(),
                message: other.to_string(),
            },
        }
    }

    /// Awaits one daemon call within `limit`.
    pub async fn call<T>(
        &self,
        what: &str,
        limit: Duration,
        f: impl Future<Output = Result<T, bollard::errors::Error>>,
    ) -> Result<T, DaemonError> {
        match tokio::time::timeout(limit, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.classify(what, e)),
            Err(_) => {
                Err(self.unavailable(format!("no answer to {what} within {}s", limit.as_secs())))
            }
        }
    }

    /// Whether the daemon answers `/_ping` within the call timeout.
    pub async fn ping(&self) -> Result<(), DaemonError> {
        self.call("ping", self.timeout, self.docker.ping())
            .await
            .map(|_| ())
    }
}

fn unreachable_runtime() -> ! {
    // The runtime is only taken in Drop.
    std::process::abort()
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Dropping may happen on one of the runtime's own threads (the last background exec
        // ending): shut down without waiting for it.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
