//! taskbox-server: the narrow API ([`taskbox_core::api`]) over HTTP.
//!
//! It owns the HTTP surface of `taskbox serve`: routes under `/v1` (one per operation, JSON bodies
//! that are the API's request types, SSE for streamed execs), authentication by bearer tokens
//! mapped to tenants, tenant isolation, quotas, leases and their reaper, `/healthz`, Prometheus
//! `/metrics` and `/openapi.json`. Any backend implementing
//! [`SandboxApi`](taskbox_core::api::SandboxApi) sits behind it; the server calls it on tokio's
//! blocking pool.
//!
//! Entry points: [`serve`] (with [`shutdown_signal`]) for the `taskbox serve` binary:
//!
//! ```no_run
//! # async fn run(state_dir: std::path::PathBuf) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! let mut config = taskbox_server::ServerConfig::new(state_dir.clone());
//! config.socket = Some(state_dir.join("taskbox.sock"));
//! let backend = Arc::new(taskbox_core::sandbox::NativeBackend::new(state_dir)?);
//! taskbox_server::serve(config, backend, taskbox_server::shutdown_signal()).await?;
//! # Ok(()) }
//! ```
//!
//! and [`router`] over an [`AppState`] to serve the API on a listener of one's own (tests). The
//! routes are [`route_specs`], the one table both the router and the OpenAPI document read.
//!
//! | route | body | answer |
//! |---|---|---|
//! | `GET /healthz` (no token) | | 200 `{"status":"ok","version","sandboxes"}` |
//! | `GET /metrics` | | 200 Prometheus text |
//! | `GET /openapi.json` (no token) | | 200 OpenAPI 3.1 |
//! | `POST /v1/sandboxes` (optional `Idempotency-Key`) | `CreateRequest` | 201 `SandboxInfo` |
//! | `GET /v1/sandboxes` | | 200 `[SandboxInfo]` (the caller's) |
//! | `GET /v1/sandboxes/{id}` | | 200 `SandboxInfo` |
//! | `DELETE /v1/sandboxes/{id}` | | 204 |
//! | `POST /v1/sandboxes/{id}/renew` | `{"ttl_secs":N}` | 200 `SandboxInfo` |
//! | `POST /v1/sandboxes/{id}/exec` | `ExecRequest` | 200 `ExecOutcome`, or SSE with `Accept: text/event-stream` |
//! | `GET /v1/sandboxes/{id}/processes/{exec_id}` | | 200 `ProcessInfo` |
//! | `POST .../processes/{exec_id}/wait?timeout_ms=` | | 200 `ProcessInfo` |
//! | `POST .../processes/{exec_id}/kill` | `{"signal":9}` | 200 `ProcessInfo` |
//! | `POST .../processes/{exec_id}/stdin` | `{"data":"..","close":false}` | 204 |
//! | `POST /v1/sandboxes/{id}/read`, `write`, `edit`, `patch`, `list`, `search`, `stat`, `diff`, `export` (optional `Idempotency-Key` with `apply`) | the request type | 200 the result type |
//! | `POST /v1/sandboxes/{id}/checkpoints` | `CheckpointRequest` | 201 `CheckpointInfo` |
//! | `POST /v1/sandboxes/{id}/remove`, `move`, `restore` | the request type | 204 |
//! | `POST /v1/sandboxes/{id}/fork` | `ForkRequest` | 201 `ForkResult` (each fork a place in the quotas) |
//! | `PUT /v1/sandboxes/{id}/files?path=` | the file's raw content, streamed | 200 `WriteResult` |
//! | `GET /v1/sandboxes/{id}/files?path=` | | 200 the file's raw content, streamed |
//!
//! Errors are `{"error":{"code","message"}}` with the status of
//! [`ApiError::http_status`](taskbox_core::api::ApiError::http_status), plus 401 `unauthorized`, 413 `too_large` (a body over `max_body_bytes`, or an upload over `max_upload_bytes`), 405
//! `method_not_allowed` and 422 `idempotency_key_reused` ([`HttpError`]). Bodies: malformed JSON, unknown fields and wrong types
//! are 400 with serde's message; an empty body reads as `{}`; no `Content-Type` is required. A
//! body that does not arrive in time is 408 `request_timeout`; a connection over a cap gets 429
//! `limit_exceeded` (its client's) or 503 `unavailable` (the total), with `Retry-After`.
//!
//! Decisions:
//! - **Connections** are served by the server's own front ([`serve`]), not `axum::serve`: a
//!   Unix-socket peer inside a sandbox is refused before a request is read ([`peer`]), and
//!   every connection has header, body and idle timeouts and counts against caps per client and
//!   in total ([`Connections`]). A declared `Content-Length` over `max_body_bytes` is 413 before
//!   the body is read.
//! - **Auth without tokens.** Without a tokens file every request is the tenant `local`, and
//!   `serve` accepts only the Unix socket (mode 0600, so the file system is the access check) and
//!   loopback TCP addresses; any other TCP address is refused at start. With a tokens file every
//!   listener, the Unix socket included, needs `Authorization: Bearer TOKEN`.
//! - **Tenancy.** A sandbox's owner is its `taskbox.tenant` label, set by the server; labels
//!   starting with `taskbox.` are refused in create requests. Every route naming a sandbox the
//!   caller does not own answers 404 with the same message as a missing one, before the backend
//!   is called.
//! - **Metrics need a token** (any tenant's) because they name tenants; `/healthz` and
//!   `/openapi.json` need none.
//! - **Leases are the server's** (see [`state`]): `ttl_secs` defaults to `default_ttl`, is capped
//!   by `max_ttl`, and is passed to the backend; renewals live in the server's table (saved in
//!   `STATE/server/leases.json`), which the reaper checks every second and which sets every
//!   answer's `expires_at_ms`. Backends should not reap on their own.
//! - **Idempotency keys** ([`idempotency`]): a create, or an export with `apply`, sent with an
//!   `Idempotency-Key` is done once per tenant and key; its retries get the first answer again
//!   (`Idempotent-Replayed: true`), one sent while it runs waits for it, the same key with
//!   another request is 422 `idempotency_key_reused`. Errors are not kept. Kept a day, in
//!   memory, bounded per tenant.
//! - **Quotas** (429 naming the limit, always with `Retry-After`, at once: nothing waits for a
//!   place): live sandboxes per tenant and in total (creates in flight count), sandboxes starting
//!   (being created or forked) per tenant and in total, and a creation rate per tenant and in
//!   total (token buckets), all checked and taken under one lock before the request does
//!   anything else, so no burst passes them (`docs/limits.md`); exec requests in flight per
//!   tenant and in total, streamed ones included, held until the command ends even if the client
//!   leaves. Background execs hold a place only while the request runs.
//! - **A hard lifetime** (`max_lifetime`, default a week): no lease, however renewed, goes past a
//!   sandbox's creation plus it; the reaper ends it then.
//! - **A request is served to its end when its client goes away**: connections are half-closed
//!   (a client that sends a destroy and hangs up still has it done), and a create, fork or
//!   destroy runs on the blocking pool, which a dropped request does not stop.

pub mod auth;
mod body;
pub mod caller;
mod clock;
pub mod config;
pub mod error;
pub mod extract;
mod files;
mod front;
pub mod gitsource;
mod handlers;
pub mod idempotency;
pub mod metrics;
pub mod openapi;
pub mod peer;
pub mod routes;
mod serve;
mod spec;
pub mod state;
pub mod sys;
pub mod types;
pub mod ui;
pub mod workspaces;

pub use auth::{Auth, Tenant, Tokens};
pub use caller::Caller;
pub use config::{Connections, Limits, Rate, ServerConfig};
pub use error::{ErrorBody, HttpError, ServerError};
pub use routes::{RouteSpec, route_specs, router};
pub use serve::{DRAIN, serve, shutdown_signal};
pub use state::AppState;
