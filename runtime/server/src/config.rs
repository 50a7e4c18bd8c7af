//! What `serve` needs to know: where to listen, who may call, and the quotas.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The server's configuration. `ServerConfig::new(state_dir)` gives the defaults: no listener
/// (set `listen` and/or `socket`), no tokens file, and [`Limits::default`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// TCP address to serve on. Without a tokens file it must be a loopback address.
    pub listen: Option<SocketAddr>,
    /// Unix socket to serve on (created mode 0600).
    pub socket: Option<PathBuf>,
    /// Tokens file (TOML, see [`crate::auth::Tokens`]). Without one, every caller is the tenant
    /// `local` and only the Unix socket or a loopback TCP address may be served.
    pub tokens: Option<PathBuf>,
    /// The state directory; the server keeps its lease table in `STATE/server/leases.json`.
    pub state_dir: PathBuf,
    pub limits: Limits,
    /// Timeouts and caps of connections (see [`Connections`]).
    pub connections: Connections,
    /// Directories under which any caller may name a workspace (`--workspace-root`); callers
    /// on the Unix socket may also name a directory their own user can read.
    pub workspace_roots: Vec<PathBuf>,
    /// Hosts a workspace clone may reach although they resolve to internal addresses
    /// (`--git-allow-host`).
    pub git_allow_hosts: Vec<String>,
}

impl ServerConfig {
    /// The supervisor's own files outside its state directory (its socket, its tokens file):
    /// hidden in every sandbox, never a workspace.
    pub fn own_files(&self) -> Vec<PathBuf> {
        self.socket
            .iter()
            .chain(self.tokens.iter())
            .cloned()
            .collect()
    }

    pub fn new(state_dir: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            listen: None,
            socket: None,
            tokens: None,
            state_dir: state_dir.into(),
            limits: Limits::default(),
            connections: Connections::default(),
            workspace_roots: Vec::new(),
            git_allow_hosts: Vec::new(),
        }
    }
}

/// How long a connection may take and how many may be open. A client is a peer uid on the
/// Unix socket and an IP address over TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connections {
    /// From the first byte of a request to the end of its headers (default 10 s); then the
    /// connection is closed.
    pub header_timeout: Duration,
    /// How long a connection may stay open without a request, before its first one and between
    /// requests, and how long an answer may wait for a client that does not read it (default
    /// 60 s).
    pub idle_timeout: Duration,
    /// How long a request's body may pause, after its headers or a piece of it (default 30 s);
    /// then the request is answered 408 and the connection closed. A large upload may take
    /// longer as long as it keeps coming.
    pub body_timeout: Duration,
    /// Open connections in total (default 1024). Past it a connection is answered 503 with
    /// `Retry-After`, or closed when many are being turned away at once.
    pub max_total: usize,
    /// Open connections of one client (default 256). Past it: 429 with `Retry-After`, or
    /// closed.
    pub max_per_client: usize,
}

impl Default for Connections {
    fn default() -> Connections {
        Connections {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            max_total: 1024,
            max_per_client: 256,
        }
    }
}

/// Quotas. A request that would pass one is answered 429 naming the limit and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Live sandboxes across all tenants (default 64).
    pub max_sandboxes_total: usize,
    /// Live sandboxes of one tenant (default 16).
    pub max_sandboxes_per_tenant: usize,
    /// Exec requests in flight across all tenants, streaming ones included (default 64).
    pub max_execs_total: usize,
    /// Exec requests in flight of one tenant (default 16).
    pub max_execs_per_tenant: usize,
    /// Largest JSON request body accepted (`taskbox serve --max-body-bytes`); more is answered
    /// 413 `too_large` naming the limit (default 16 MiB).
    pub max_body_bytes: usize,
    /// Largest streamed upload (`--max-upload-bytes`): a workspace tar (`POST /v1/workspaces`)
    /// or a file (`PUT /v1/sandboxes/{id}/files`), which `max_body_bytes` does not bound
    /// (default 2 GiB).
    pub max_upload_bytes: u64,
    /// Lease of a sandbox created without `ttl_secs` (default one hour; `None`: no lease unless
    /// `max_ttl` is set, which then applies).
    pub default_ttl: Option<Duration>,
    /// Longest lease a create or renew may ask for; longer requests are cut to it (default one
    /// day; `None`: unbounded).
    pub max_ttl: Option<Duration>,
    /// How long the answer of a request with an `Idempotency-Key` is kept for its retries
    /// (default one day; see [`crate::idempotency`]).
    pub idempotency_ttl: Duration,
    /// Idempotency keys one tenant holds at most, running and answered (default 10000); past
    /// it the oldest answer is dropped first.
    pub max_idempotency_keys_per_tenant: usize,
    /// Bytes of kept answers one tenant holds at most (default 64 MiB); past it the oldest
    /// answers are dropped first (the newest is kept whatever its size).
    pub max_idempotency_bytes_per_tenant: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_sandboxes_total: 64,
            max_sandboxes_per_tenant: 16,
            max_execs_total: 64,
            max_execs_per_tenant: 16,
            max_body_bytes: 16 << 20,
            max_upload_bytes: 2 << 30,
            default_ttl: Some(Duration::from_secs(3600)),
            max_ttl: Some(Duration::from_secs(24 * 3600)),
            idempotency_ttl: Duration::from_secs(24 * 3600),
            max_idempotency_keys_per_tenant: 10_000,
            max_idempotency_bytes_per_tenant: 64 << 20,
        }
    }
}

impl Limits {
    /// The lease a create or renew gets for `asked` seconds: the default when not asked, capped
    /// by `max_ttl`. `None` means no lease.
    pub fn lease(&self, asked: Option<u64>) -> Option<Duration> {
        let wanted = asked.map(Duration::from_secs).or(self.default_ttl);
        match (wanted, self.max_ttl) {
            (Some(w), Some(max)) => Some(w.min(max)),
            (Some(w), None) => Some(w),
            (None, max) => max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_default_and_cap() {
        let mut l = Limits::default();
        assert_eq!(l.lease(None), Some(Duration::from_secs(3600)));
        assert_eq!(l.lease(Some(10)), Some(Duration::from_secs(10)));
        assert_eq!(l.lease(Some(10 << 20)), Some(Duration::from_secs(86400)));
        l.default_ttl = None;
        assert_eq!(l.lease(None), Some(Duration::from_secs(86400)));
        l.max_ttl = None;
        assert_eq!(l.lease(None), None);
        assert_eq!(l.lease(Some(5)), Some(Duration::from_secs(5)));
    }
}
