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
    /// The places the backend's warm pool of forks holds: counted in the total of live
    /// sandboxes (never a tenant's), and given back when a create needs them.
    pub warm: Option<std::sync::Arc<taskbox_core::warm::WarmGauge>>,
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
            warm: None,
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

/// A rate of events: `per_sec` on average, up to `burst` at once (a token bucket).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_sec: f64,
    pub burst: u32,
}

impl Rate {
    /// `per_sec` events a second, a second's worth at once (at least one).
    pub fn per_second(per_sec: f64) -> Rate {
        Rate {
            per_sec,
            burst: per_sec.ceil().max(1.0) as u32,
        }
    }

    /// Parses `N` or `N/s` (events a second), `N/m` (a minute) or `N/h` (an hour); the burst is
    /// a second's worth, at least one.
    pub fn parse(s: &str) -> Result<Rate, String> {
        let (n, per) = match s.split_once('/') {
            Some((n, unit)) => (n, unit.trim()),
            None => (s, "s"),
        };
        let secs = match per {
            "s" | "sec" | "second" => 1.0,
            "m" | "min" | "minute" => 60.0,
            "h" | "hour" => 3600.0,
            other => {
                return Err(format!(
                    "unknown unit {other:?} in rate {s:?}: use /s, /m or /h"
                ));
            }
        };
        let n: f64 = n
            .trim()
            .parse()
            .map_err(|_| format!("invalid rate {s:?}: expected N, N/s, N/m or N/h"))?;
        if !(n.is_finite() && n > 0.0) {
            return Err(format!("invalid rate {s:?}: it must be greater than zero"));
        }
        Ok(Rate::per_second(n / secs))
    }
}

/// Quotas. A request that would pass one is answered 429 naming the limit and its value, with
/// `Retry-After`, at once: nothing waits for a place.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Live sandboxes across all tenants, those still starting included (default 64).
    pub max_sandboxes_total: usize,
    /// Live sandboxes of one tenant, those still starting included (default 16).
    pub max_sandboxes_per_tenant: usize,
    /// Sandboxes being created or forked at once across all tenants (default 16).
    pub max_starting_total: usize,
    /// Sandboxes being created or forked at once by one tenant (default 8).
    pub max_starting_per_tenant: usize,
    /// Sandboxes created (or forked) per second across all tenants (default: unbounded).
    pub create_rate_total: Option<Rate>,
    /// Sandboxes created (or forked) per second by one tenant (default: unbounded).
    pub create_rate_per_tenant: Option<Rate>,
    /// The hard lifetime of a sandbox, from its creation: no lease, and no renew, goes past it
    /// (default one week; `None`: none).
    pub max_lifetime: Option<Duration>,
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
            max_starting_total: 16,
            max_starting_per_tenant: 8,
            create_rate_total: None,
            create_rate_per_tenant: None,
            max_lifetime: Some(Duration::from_secs(7 * 24 * 3600)),
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
    /// The lease end (ms since the epoch) of a create or renew at `now_ms` asking for `asked`
    /// seconds, of a sandbox created at `created_ms`: [`Limits::lease`] from now, never past the
    /// hard lifetime. `None` means no lease.
    pub fn lease_end(&self, asked: Option<u64>, created_ms: u64, now_ms: u64) -> Option<u64> {
        let lease = self
            .lease(asked)
            .map(|d| now_ms.saturating_add(d.as_millis() as u64));
        let hard = self.hard_end(created_ms);
        match (lease, hard) {
            (Some(l), Some(h)) => Some(l.min(h)),
            (l, h) => l.or(h),
        }
    }

    /// When a sandbox created at `created_ms` must end, whatever its lease says.
    pub fn hard_end(&self, created_ms: u64) -> Option<u64> {
        self.max_lifetime
            .map(|d| created_ms.saturating_add(d.as_millis() as u64))
    }

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

    #[test]
    fn no_lease_passes_the_hard_lifetime() {
        let l = Limits {
            max_lifetime: Some(Duration::from_secs(100)),
            ..Limits::default()
        };
        // At creation: the asked lease, under the lifetime.
        assert_eq!(l.lease_end(Some(10), 1_000, 1_000), Some(11_000));
        // A renew late in life is cut at the lifetime, however long it asks.
        assert_eq!(l.lease_end(Some(3600), 1_000, 90_000), Some(101_000));
        assert_eq!(l.lease_end(None, 1_000, 1_000), Some(101_000));
        let unbounded = Limits {
            max_lifetime: None,
            default_ttl: None,
            max_ttl: None,
            ..Limits::default()
        };
        assert_eq!(unbounded.lease_end(None, 1_000, 5_000), None);
        let only_life = Limits {
            default_ttl: None,
            max_ttl: None,
            ..l
        };
        assert_eq!(only_life.lease_end(None, 1_000, 5_000), Some(101_000));
    }

    #[test]
    fn rates_parse() {
        assert_eq!(Rate::parse("5").unwrap(), Rate::per_second(5.0));
        assert_eq!(Rate::parse("10/s").unwrap().burst, 10);
        let m = Rate::parse("30/m").unwrap();
        assert!((m.per_sec - 0.5).abs() < 1e-9 && m.burst == 1, "{m:?}");
        assert!(Rate::parse("0").is_err() && Rate::parse("x/s").is_err());
        assert!(Rate::parse("3/d").unwrap_err().contains("unit"));
    }
}
