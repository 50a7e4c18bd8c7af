//! The server's errors: [`ServerError`] for starting and serving, [`HttpError`] for one request.
//!
//! Statuses of API errors come from [`ApiError::http_status`]; [`HttpError`] adds only the few
//! that exist at the HTTP layer alone (no credentials, body too large, wrong method, a body
//! that does not arrive in time, an idempotency key sent with another request).

use std::io;
use std::path::PathBuf;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use taskbox_core::api::ApiError;

/// Why the server cannot start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// the configuration is inconsistent
    #[error("invalid server configuration: {0}")]
    Config(String),
    /// the tokens file cannot be read or is invalid
    #[error("tokens file {path}: {why}")]
    Tokens { path: PathBuf, why: String },
    /// a TCP address cannot be bound
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: io::Error,
    },
    /// the Unix socket cannot be set up
    #[error("unix socket {path}: {why}")]
    Socket { path: PathBuf, why: String },
    /// the lease table cannot be read or written
    #[error("lease table {path}: {why}")]
    Leases { path: PathBuf, why: String },
    /// serving failed
    #[error("serving failed: {0}")]
    Serve(io::Error),
    /// the backend failed while the server started
    #[error("backend: {0}")]
    Backend(#[from] ApiError),
}

/// The JSON body of every error answer: `{"error":{"code":"...","message":"..."}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// Stable machine-readable code (`not_found`, `invalid_argument`, `unauthorized`, ...).
    pub code: String,
    /// What failed, in words a model can act on.
    pub message: String,
}

/// The error code of an error answer, left in the response's extensions for the metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ErrorCode(pub &'static str);

/// A failed request.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// an error of the narrow API
    #[error(transparent)]
    Api(#[from] ApiError),
    /// missing or unknown bearer token
    #[error("{0}")]
    Unauthorized(String),
    /// the request body is larger than the server accepts (code `too_large`, as
    /// [`ApiError::TooLarge`]; the connection is closed, its body unread)
    #[error("{0}")]
    PayloadTooLarge(String),
    /// the route exists but not with this method
    #[error("{0}")]
    MethodNotAllowed(String),
    /// the request did not arrive whole in time
    #[error("{0}")]
    RequestTimeout(String),
    /// the `Idempotency-Key` was sent before with another request (see [`crate::idempotency`])
    #[error("{0}")]
    IdempotencyKeyReused(String),
    /// a limit of the server refused the request now; it may succeed `retry_after` from now
    /// (answered 429 `limit_exceeded` with `Retry-After`)
    #[error("{error}")]
    Limited {
        error: ApiError,
        retry_after: std::time::Duration,
    },
}

impl HttpError {
    pub fn code(&self) -> &'static str {
        match self {
            HttpError::Api(e) => e.code(),
            HttpError::Unauthorized(_) => "unauthorized",
            HttpError::PayloadTooLarge(_) => "too_large",
            HttpError::MethodNotAllowed(_) => "method_not_allowed",
            HttpError::RequestTimeout(_) => "request_timeout",
            HttpError::IdempotencyKeyReused(_) => "idempotency_key_reused",
            HttpError::Limited { error, .. } => error.code(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            HttpError::Api(e) => {
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
            HttpError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            HttpError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            HttpError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            HttpError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            HttpError::IdempotencyKeyReused(_) => StatusCode::UNPROCESSABLE_ENTITY,
            HttpError::Limited { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// A JSON request body over `max_body_bytes` (`len`: its declared length, when known): the
    /// message names the limit, how the operator sets it, and the way around it.
    pub fn body_too_large(len: Option<u64>, max: usize) -> HttpError {
        let size = len.map(|n| format!(" of {n} bytes")).unwrap_or_default();
        HttpError::PayloadTooLarge(format!(
            "request body{size} is larger than the limit of {max} bytes (max_body_bytes, set \
             with taskbox serve --max-body-bytes); send a large file streamed instead, as the \
             body of PUT /v1/sandboxes/{{id}}/files?path=PATH"
        ))
    }

    /// A streamed upload (`what`: a file, a workspace tar) of `n` bytes or more, over
    /// `max_upload_bytes`.
    pub fn upload_too_large(what: &str, n: u64, max: u64) -> HttpError {
        HttpError::PayloadTooLarge(format!(
            "the {what} is {n} bytes or more, over the limit of {max} bytes (max_upload_bytes, \
             set with taskbox serve --max-upload-bytes)"
        ))
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code().to_string(),
                message: self.to_string(),
            },
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), Json(self.body())).into_response();
        // Every 429 says when to try again: a limit's own estimate, else a second.
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            let secs = match &self {
                HttpError::Limited { retry_after, .. } => {
                    retry_after.as_millis().div_ceil(1000).max(1) as u64
                }
                _ => 1,
            };
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        match self {
            HttpError::Unauthorized(_) => {
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of the body is not read: the connection cannot carry another request.
            HttpError::PayloadTooLarge(_) | HttpError::RequestTimeout(_) => {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        resp.extensions_mut().insert(ErrorCode(self.code()));
        resp
    }
}
