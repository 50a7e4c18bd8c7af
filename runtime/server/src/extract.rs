//! Request extractors whose rejections are the API's JSON errors.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Query, RawPathParams, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use taskbox_core::api::{ApiError, ApprovalId, SandboxId, excerpt};

use crate::auth::Tenant;
use crate::body::BodyTimeout;
use crate::error::HttpError;
use crate::state::AppState;

/// A JSON body. Malformed JSON, unknown fields and wrong types answer 400 with serde's message; a
/// body over `max_body_bytes` answers 413, one that does not arrive within `body_timeout` 408. An empty body reads as `{}`, and no `Content-Type` is
/// required.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = HttpError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, HttpError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if let Some(t) = BodyTimeout::find(&rej) {
                HttpError::RequestTimeout(t.to_string())
            } else if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                HttpError::body_too_large(None, state.limits().max_body_bytes)
            } else {
                HttpError::Api(ApiError::invalid(format!(
                    "cannot read the request body: {}",
                    rej.body_text()
                )))
            }
        })?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        serde_json::from_slice(text)
            .map(ApiJson)
            .map_err(|e| HttpError::Api(ApiError::invalid(format!("invalid request body: {e}"))))
    }
}

/// Query parameters; a bad one answers 400.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for ApiQuery<T> {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, HttpError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| ApiQuery(q))
            .map_err(|rej| {
                HttpError::Api(ApiError::invalid(format!(
                    "invalid query: {}",
                    rej.body_text()
                )))
            })
    }
}

pub(crate) fn path_param(params: &RawPathParams, name: &str) -> Result<String, HttpError> {
    params
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .ok_or_else(|| HttpError::Api(ApiError::internal(format!("route has no {{{name}}}"))))
}

async fn raw_params(parts: &mut Parts, state: &AppState) -> Result<RawPathParams, HttpError> {
    RawPathParams::from_request_parts(parts, state)
        .await
        .map_err(|rej| {
            HttpError::Api(ApiError::invalid(format!(
                "invalid path: {}",
                rej.body_text()
            )))
        })
}

/// The `{id}` of the path: authenticated (401), a valid id (400), and owned by the caller (404
/// otherwise, the same answer as for a missing sandbox).
#[derive(Debug, Clone)]
pub struct Owned {
    pub tenant: String,
    pub id: SandboxId,
}

impl FromRequestParts<AppState> for Owned {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, HttpError> {
        let Tenant(tenant) = Tenant::from_request_parts(parts, state).await?;
        let params = raw_params(parts, state).await?;
        let raw = path_param(&params, "id")?;
        // A destroy of a sandbox lost to a restart is done already: it only forgets it.
        let destroying = parts.method == axum::http::Method::DELETE
            && parts
                .extensions
                .get::<axum::extract::MatchedPath>()
                .is_some_and(|p| p.as_str() == "/v1/sandboxes/{id}");
        let id = if destroying {
            state.owned_or_forget_lost(&tenant, &raw)?
        } else {
            state.owned(&tenant, &raw)?
        };
        tracing::Span::current().record("sandbox", id.as_str());
        Ok(Owned { tenant, id })
    }
}

/// The `{name}` of a secret's path (400 unless a valid secret name).
#[derive(Debug, Clone)]
pub struct SecretPath(pub String);

impl FromRequestParts<AppState> for SecretPath {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, HttpError> {
        let params = raw_params(parts, state).await?;
        let raw = path_param(&params, "name")?;
        if !taskbox_core::policy::secrets::is_secret_name(&raw) {
            return Err(ApiError::invalid(format!(
                "invalid secret name {raw:?}: names use only a-z, 0-9, '-' and '_'"
            ))
            .into());
        }
        Ok(SecretPath(raw))
    }
}

/// The `{approval}` of the path (400 unless a valid approval id).
#[derive(Debug, Clone)]
pub struct ApprovalPath(pub ApprovalId);

impl FromRequestParts<AppState> for ApprovalPath {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, HttpError> {
        let params = raw_params(parts, state).await?;
        let raw = path_param(&params, "approval")?;
        Ok(ApprovalPath(ApprovalId::parse(&raw)?))
    }
}

/// The `{exec_id}` of the path (400 unless a decimal number).
#[derive(Debug, Clone, Copy)]
pub struct ExecId(pub u64);

impl FromRequestParts<AppState> for ExecId {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, HttpError> {
        let params = raw_params(parts, state).await?;
        let raw = path_param(&params, "exec_id")?;
        raw.parse().map(ExecId).map_err(|_| {
            HttpError::Api(ApiError::invalid(format!(
                "invalid exec id {}: expected a decimal number",
                excerpt(&raw)
            )))
        })
    }
}
