//! taskbox-server: the narrow API ([`taskbox_core::api`]) over HTTP.
//!
//! It owns the HTTP surface of `taskbox serve`: routes under `/v1` (one per operation, JSON bodies
//! that are the API's request types, SSE for streamed execs), authentication by bearer tokens
//! mapped to tenants, tenant isolation (another tenant's sandbox answers 404 like a missing one),
//! quotas (429), leases and their reaper, `/healthz`, Prometheus `/metrics` and `/openapi.json`.
//! Any backend implementing [`SandboxApi`](taskbox_core::api::SandboxApi) can sit behind it; the
//! server calls it on tokio's blocking pool.
//!
//! Entry points: [`serve`] for the `taskbox serve` binary; [`router`] with an [`AppState`] to
//! serve the API on a listener of one's own (tests).
//!
//! Decisions:
//! - Without a tokens file every request is the tenant `local`; `serve` then accepts only the
//!   Unix socket and loopback TCP addresses. With a tokens file every listener needs a token.
//! - `/healthz` and `/openapi.json` need no token; `/metrics` does (any tenant's), since it names
//!   tenants.
//! - The server keeps the leases (see [`state`]); the reaper runs every second.

pub mod auth;
pub mod config;
pub mod error;
pub mod extract;
mod handlers;
pub mod metrics;
pub mod openapi;
pub mod routes;
mod serve;
pub mod state;
pub mod types;

pub use auth::{Auth, Tenant, Tokens};
pub use config::{Limits, ServerConfig};
pub use error::{ErrorBody, HttpError, ServerError};
pub use routes::{RouteSpec, route_specs, router};
pub use serve::serve;
pub use state::AppState;
