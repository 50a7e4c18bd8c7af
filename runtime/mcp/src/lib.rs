//! taskbox's MCP server: one sandbox's narrow API offered as Model Context Protocol tools.
//!
//! [`serve_stdio`] creates one sandbox, serves it over stdin/stdout until the client disconnects,
//! then destroys it; `taskbox mcp` is a thin wrapper around it. The tools are the sandbox tools
//! of `taskbox_tools` (`exec`, `read_file`, `write_file`, `edit_file`, `apply_patch`, `list`,
//! `search`, `diff`) and its session tool `fork`: their names, descriptions, input schemas, argument parsing and the text of
//! their results are that crate's, the same the agent offers its model; this crate adds MCP's
//! annotations, the full JSON of each result as structured content, and the transport. API
//! errors and invalid arguments come back as tool results with `isError` set, naming the error
//! code or the field, so the model can correct itself.
//!
//! When the sandbox's command policy asks before an exec runs, the server asks the client's
//! user through MCP elicitation (a form: approve or not, and a reason), if the client declared
//! the capability; otherwise, or when the question cannot be asked, the exec is denied with the
//! reason, which the model reads in the exec's result (see [`approvals`]).
//!
//! `fork` makes new sandboxes from the session's (or from one of its forks), up to
//! [`tools::MAX_SESSION_FORKS`]; every tool takes a `sandbox` argument naming the one it acts on
//! (default: the session's own), and the forks are destroyed with the session.

use std::path::PathBuf;
use std::sync::Arc;

use rmcp::ServiceExt;
use taskbox_core::api::{ApiError, CreateRequest, SandboxApi, SandboxId, SandboxInfo};
use taskbox_core::runtime::RuntimeBuilder;
use tokio::io::{AsyncRead, AsyncWrite};

pub mod approvals;
mod instructions;
mod tools;

pub use tools::{TOOL_NAMES, tool_list};

/// Errors of serving a sandbox over MCP (tool failures are tool results, not these).
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// the backend could not be opened
    #[error("cannot open the sandbox backend in {path}: {source}")]
    Backend { path: PathBuf, source: ApiError },
    /// the sandbox could not be created
    #[error("cannot create the sandbox for workspace {workspace}: {source}")]
    Create { workspace: String, source: ApiError },
    /// the sandbox could not be destroyed after the session
    #[error("cannot destroy sandbox {id}: {source}")]
    Destroy { id: SandboxId, source: ApiError },
    /// the MCP handshake failed
    #[error("mcp handshake failed: {0}")]
    Handshake(Box<rmcp::service::ServerInitializeError>),
    /// the task serving the session failed
    #[error("mcp session task failed: {0}")]
    Session(#[from] tokio::task::JoinError),
}

/// What `taskbox mcp` needs: the sandbox to create and the native backend's state directory.
#[derive(Debug, Clone)]
pub struct McpOptions {
    pub create: CreateRequest,
    pub state_dir: PathBuf,
}

impl McpOptions {
    /// Opens the native backend in `state_dir`, under the command policy, and runs
    /// [`serve_stdio`] with it.
    pub async fn serve_stdio(self) -> Result<(), McpError> {
        let backend = RuntimeBuilder::new()
            .native(self.state_dir.clone())
            .command_policy(true)
            .build()
            .map_err(|source| McpError::Backend {
                path: self.state_dir,
                source,
            })?;
        serve_stdio(backend, self.create).await
    }
}

/// Creates one sandbox, serves it over stdin/stdout until the client disconnects, then destroys it.
pub async fn serve_stdio(
    backend: Arc<dyn SandboxApi>,
    create: CreateRequest,
) -> Result<(), McpError> {
    let (stdin, stdout) = rmcp::transport::stdio();
    serve(backend, create, stdin, stdout).await
}

/// Same as [`serve_stdio`] over any reader/writer pair (for tests).
pub async fn serve<R, W>(
    backend: Arc<dyn SandboxApi>,
    create: CreateRequest,
    read: R,
    write: W,
) -> Result<(), McpError>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let workspace = create.workspace.clone();
    let info = blocking(&backend, move |b| b.create(create))
        .await
        .map_err(|source| McpError::Create { workspace, source })?;
    let id = info.id.clone();
    tracing::info!(sandbox = %id, workspace = %info.workspace, "serving sandbox over mcp");

    let forks = Arc::new(std::sync::Mutex::new(Vec::new()));
    let served = run_session(Arc::clone(&backend), info, Arc::clone(&forks), read, write).await;

    // The session's forks go with it.
    let made: Vec<SandboxId> = std::mem::take(&mut *lock_forks(&forks));
    for fork in made {
        if let Err(e) = blocking(&backend, move |b| b.destroy(&fork)).await {
            tracing::warn!(sandbox = %id, error = %e, "cannot destroy a fork of the session");
        }
    }
    let destroy_id = id.clone();
    let destroyed = blocking(&backend, move |b| b.destroy(&destroy_id)).await;
    tracing::info!(sandbox = %id, "mcp session ended; sandbox destroyed");
    match (served, destroyed) {
        (Err(e), Err(d)) => {
            tracing::warn!(sandbox = %id, error = %d, "cannot destroy sandbox after a failed session");
            Err(e)
        }
        (Err(e), Ok(())) => Err(e),
        (Ok(()), Err(source)) => Err(McpError::Destroy { id, source }),
        (Ok(()), Ok(())) => Ok(()),
    }
}

async fn run_session<R, W>(
    backend: Arc<dyn SandboxApi>,
    info: SandboxInfo,
    forks: Arc<std::sync::Mutex<Vec<SandboxId>>>,
    read: R,
    write: W,
) -> Result<(), McpError>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let id = info.id.clone();
    let server = tools::SandboxServer::new(Arc::clone(&backend), info, forks);
    let running = server
        .serve((read, write))
        .await
        .map_err(|e| McpError::Handshake(Box::new(e)))?;
    let watcher = tokio::spawn(approvals::watch(backend, id, running.peer().clone()));
    let quit = running.waiting().await;
    watcher.abort();
    match quit? {
        rmcp::service::QuitReason::JoinError(e) => Err(McpError::Session(e)),
        reason => {
            tracing::debug!(?reason, "mcp session closed");
            Ok(())
        }
    }
}

/// The session's forks, whatever a panic left of the lock.
pub(crate) fn lock_forks(
    forks: &std::sync::Mutex<Vec<SandboxId>>,
) -> std::sync::MutexGuard<'_, Vec<SandboxId>> {
    forks.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a blocking backend call on the blocking thread pool; a panic in it becomes an internal
/// error.
async fn blocking<T, F>(backend: &Arc<dyn SandboxApi>, f: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce(&dyn SandboxApi) -> Result<T, ApiError> + Send + 'static,
{
    let backend = Arc::clone(backend);
    tokio::task::spawn_blocking(move || f(backend.as_ref()))
        .await
        .map_err(|e| ApiError::internal(format!("the sandbox call failed: {e}")))?
}
