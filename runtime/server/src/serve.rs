//! Serving the router on a TCP address and/or a Unix socket until shutdown, through the
//! connection front ([`crate::front`]: peer check, caps, timeouts).

use std::future::Future;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use taskbox_core::api::SandboxApi;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::auth::{Auth, Tokens};
use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::front::{Front, Phase};
use crate::routes::router;
use crate::state::AppState;
use crate::workspaces::{Uploads, WorkspaceRules};

/// How long in-flight requests get to finish after shutdown is asked for; then their
/// connections are closed.
pub const DRAIN: Duration = Duration::from_secs(10);

/// Serves the API until `shutdown` completes: on `config.listen` (TCP) and/or `config.socket`
/// (a Unix socket, mode 0600; a stale socket file is replaced; a live server on it is an error).
/// Without a tokens file TCP is refused unless the address is loopback; every caller is then the
/// tenant `local`. Runs the lease reaper every second. Needs a multi-threaded tokio runtime.
///
/// On shutdown it stops accepting, closes idle connections and gives requests in progress
/// [`DRAIN`] to finish, then closes their connections. Backend calls still running on tokio's
/// blocking pool are not waited for here: the caller bounds them when it shuts its runtime down.
pub async fn serve(
    config: ServerConfig,
    backend: Arc<dyn SandboxApi>,
    shutdown: impl Future + Send,
) -> Result<(), ServerError> {
    if config.listen.is_none() && config.socket.is_none() {
        return Err(ServerError::Config(
            "nothing to serve on: give a tcp address, a unix socket or both".into(),
        ));
    }
    let auth = match &config.tokens {
        Some(path) => Auth::Tokens(Tokens::load(path)?),
        None => Auth::Local,
    };
    if let (Some(addr), Auth::Local) = (config.listen, &auth)
        && !addr.ip().is_loopback()
    {
        return Err(ServerError::Config(format!(
            "refusing to serve tcp on {addr} without a tokens file: anyone who can reach it \
                 could run commands; give a tokens file or a loopback address"
        )));
    }

    // Bind first: a second server on the same socket stops here, before touching any state.
    let tcp = match config.listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Listen { addr, source })?,
        ),
        None => None,
    };
    let unix = match &config.socket {
        Some(path) => Some(bind_unix(path)?),
        None => None,
    };

    let lease_file = config.state_dir.join("server").join("leases.json");
    let limits = config.limits.clone();
    let hidden = config.own_files();
    let roots = config.workspace_roots.clone();
    let git_hosts = config.git_allow_hosts.clone();
    let state_dir = config.state_dir.clone();
    let warm = config.warm.clone();
    let state = tokio::task::spawn_blocking(move || {
        let uploads = Uploads::open(&state_dir, limits.max_upload_bytes)?;
        let rules = WorkspaceRules::new(&roots, &state_dir, &hidden)?.with_git_hosts(git_hosts);
        AppState::builder(backend)
            .auth(auth)
            .limits(limits)
            .lease_file(lease_file)
            .workspaces(rules)
            .uploads(uploads)
            .warm(warm)
            .build()
    })
    .await
    .map_err(|e| ServerError::Serve(io::Error::other(e)))
    .and_then(|built| built);
    let state = match state {
        Ok(s) => s,
        Err(e) => {
            if let Some(path) = &config.socket {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
    };

    // The trace pages (`/ui`) beside the API; the body limit covers them as well.
    let app = router(state.clone())
        .merge(crate::ui::router(
            state.clone(),
            config.state_dir.join("traces"),
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::routes::refuse_large_bodies,
        ));
    let front = Front::new(config.connections.clone(), state.clone());
    let (phase_tx, phase_rx) = watch::channel(Phase::Serving);
    let mut servers = JoinSet::new();
    if let Some(listener) = tcp {
        tracing::info!(addr = ?listener.local_addr().ok(), "serving on tcp");
        servers.spawn(front.clone().serve(listener, app.clone(), phase_rx.clone()));
    }
    if let Some(listener) = unix {
        tracing::info!(socket = ?config.socket, "serving on unix socket");
        servers.spawn(front.clone().serve(listener, app, phase_rx.clone()));
    }
    let reaper = tokio::spawn(state.clone().run_reaper(Duration::from_secs(1)));
    let trimmer = tokio::spawn(front.clone().run_trimmer());

    let outcome = tokio::select! {
        _ = shutdown => Ok(()),
        Some(done) = servers.join_next() => match done {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ServerError::Serve(e)),
            Err(e) => Err(ServerError::Serve(io::Error::other(e))),
        },
    };
    tracing::info!(connections = front.open(), "shutting down");
    let _ = phase_tx.send(Phase::Draining);
    reaper.abort();
    trimmer.abort();
    if tokio::time::timeout(DRAIN, join_all(&mut servers))
        .await
        .is_err()
    {
        tracing::warn!(
            connections = front.open(),
            "requests still running after {DRAIN:?}; closing their connections"
        );
        state.set_closing();
        let _ = phase_tx.send(Phase::Closing);
        if tokio::time::timeout(Duration::from_secs(1), join_all(&mut servers))
            .await
            .is_err()
        {
            servers.abort_all();
        }
    }
    if let Some(path) = &config.socket {
        let _ = std::fs::remove_file(path);
    }
    outcome
}

async fn join_all(servers: &mut JoinSet<io::Result<()>>) {
    while servers.join_next().await.is_some() {}
}

/// Completes on SIGINT or SIGTERM: the usual `shutdown` argument of [`serve`] for a binary.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

fn socket_err(path: &Path, why: impl Into<String>) -> ServerError {
    ServerError::Socket {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// Binds `path` as a Unix socket, mode 0600. The socket is bound in a fresh private directory
/// and renamed into place, so it is never reachable with wider permissions.
fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(socket_err(
                path,
                "exists and is not a socket; not removing it",
            ));
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(socket_err(
                    path,
                    "another server is listening on it; stop it first",
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %path.display(), "removing a stale socket");
                std::fs::remove_file(path).map_err(|e| {
                    socket_err(path, format!("cannot remove the stale socket: {e}"))
                })?;
            }
            Err(e) => {
                return Err(socket_err(
                    path,
                    format!("cannot probe the existing socket: {e}"),
                ));
            }
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_err(path, e.to_string())),
    }

    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "socket".into());
    let private = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(|e| socket_err(path, format!("cannot create {}: {e}", private.display())))?;
    let bound = (|| -> io::Result<std::os::unix::net::UnixListener> {
        let tmp = private.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    let listener = bound.map_err(|e| socket_err(path, format!("cannot bind: {e}")))?;
    UnixListener::from_std(listener).map_err(|e| socket_err(path, e.to_string()))
}
