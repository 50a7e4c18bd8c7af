//! Wire types of the HTTP API that the narrow API has no type for.

use serde::{Deserialize, Serialize};

/// Extend a sandbox's lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// New lease from now, in seconds (at least 1; capped by the server's `max_ttl`).
    pub ttl_secs: u64,
}

/// Send a signal to a background process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillRequest {
    /// Signal number (default 9, SIGKILL, which kills the whole process tree).
    #[serde(default = "sigkill")]
    pub signal: i32,
}

fn sigkill() -> i32 {
    9
}

/// Write to a background process's standard input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// What to write: UTF-8 text, or base64 of any bytes with `encoding: "base64"` (or send
    /// the bytes themselves as an `application/octet-stream` body, streamed, of any size).
    #[serde(default)]
    pub data: String,
    /// "utf-8" (default) or "base64".
    #[serde(default)]
    pub encoding: Option<String>,
    /// Close stdin afterwards.
    #[serde(default)]
    pub close: bool,
}

/// Query of `POST .../processes/{exec_id}/stdin` with a raw body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct StdinQuery {
    /// Close stdin after the body's bytes (`?close=true`).
    #[serde(default)]
    pub close: bool,
}

/// Query of `POST .../processes/{exec_id}/wait`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// How long to wait at most, in milliseconds (default 30000, at most 300000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// Deny an exec that waits for approval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DenyRequest {
    /// Why; the model sees it in the exec's violation.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Query of `GET /v1/sandboxes/{id}/approvals`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsQuery {
    /// When none is pending, wait up to this many milliseconds for one (at most 300000).
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Health {
    /// "ok".
    pub status: String,
    /// The server's version.
    pub version: String,
    /// Live sandboxes of all tenants.
    pub sandboxes: u64,
}

/// Query of `POST /v1/workspaces`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// How long the upload is kept while no sandbox uses it, in seconds (default and cap: the
    /// server's sandbox lease).
    #[serde(default)]
    pub ttl_secs: Option<u64>,
}
