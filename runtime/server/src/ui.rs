//! `/ui`: the trace pages of the caller's sandboxes, live and finished, for a browser.
//!
//! `GET /ui` lists the tenant's traces (newest first) with links; `GET /ui/{id}` is the
//! self-contained page of [`taskbox_core::trace_html`] for one sandbox, read from
//! `STATE/traces/ID.jsonl` at request time (a live sandbox's page reloads itself every few
//! seconds). A trace belongs to the tenant its header's `taskbox.tenant` label names (no label:
//! `local`); another tenant's trace answers 404, as the API does.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use axum::Router;
use axum::extract::{Extension, RawPathParams, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use taskbox_core::api::{ApiError, SandboxId};
use taskbox_core::trace::{self, TraceHeader};
use taskbox_core::trace_html::{esc, render_html};

use crate::auth::{LOCAL_TENANT, TENANT_LABEL, Tenant};
use crate::error::HttpError;
use crate::state::AppState;

/// Where the traces are.
#[derive(Debug, Clone)]
struct TraceDir(PathBuf);

/// The `/ui` routes, reading traces from `traces_dir`.
pub fn router(state: AppState, traces_dir: PathBuf) -> Router {
    Router::new()
        .route("/ui", get(index))
        .route("/ui/{id}", get(page))
        .layer(Extension(TraceDir(traces_dir)))
        .with_state(state)
}

/// The first line of a trace, at most 1 MiB of it.
fn read_header(path: &Path) -> Option<TraceHeader> {
    let f = std::fs::File::open(path).ok()?;
    let mut line = String::new();
    BufReader::new(f.take(1 << 20)).read_line(&mut line).ok()?;
    let mut v: serde_json::Value = serde_json::from_str(&line).ok()?;
    v.as_object_mut()?.remove("type");
    serde_json::from_value(v).ok()
}

fn owner(h: &TraceHeader) -> &str {
    h.labels
        .get(TENANT_LABEL)
        .map_or(LOCAL_TENANT, String::as_str)
}

fn html(body: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn index(
    State(_): State<AppState>,
    Tenant(tenant): Tenant,
    Extension(TraceDir(dir)): Extension<TraceDir>,
) -> Result<Response, HttpError> {
    let mut rows = tokio::task::spawn_blocking(move || {
        let mut rows: Vec<(TraceHeader, bool)> = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "jsonl") {
                continue;
            }
            if let Some(h) = read_header(&p)
                && owner(&h) == tenant
            {
                let live = !ends_with_destroy(&p);
                rows.push((h, live));
            }
        }
        rows
    })
    .await
    .map_err(|e| HttpError::Api(ApiError::internal(e)))?;
    rows.sort_by_key(|r| std::cmp::Reverse(r.0.created_at_ms));
    let mut out = String::from(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>taskbox \
         sandboxes</title><style>body{font:14px system-ui,sans-serif;margin:20px}\
         td{padding:2px 12px 2px 0}</style></head><body><h1>Sandboxes</h1><table id=\"sandboxes\">\
         <tr><th>sandbox</th><th>state</th><th>backend</th><th>image</th><th>workspace</th></tr>",
    );
    for (h, live) in &rows {
        out.push_str(&format!(
            "<tr><td><a href=\"/ui/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            if *live { "live" } else { "finished" },
            esc(&h.backend),
            esc(h.image.get(..19).unwrap_or(&h.image)),
            esc(&h.workspace),
            id = esc(&h.sandbox),
        ));
    }
    out.push_str("</table></body></html>\n");
    Ok(html(out))
}

/// Whether the trace's last complete line records a destroy (read from the last 64 KiB).
fn ends_with_destroy(path: &Path) -> bool {
    use std::io::{Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut tail = String::new();
    let _ = f.read_to_string(&mut tail);
    tail.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .is_some_and(|l| l.contains("\"op\":\"destroy\"") && l.contains("\"outcome\":{\"ok\""))
}

async fn page(
    State(_): State<AppState>,
    Tenant(tenant): Tenant,
    Extension(TraceDir(dir)): Extension<TraceDir>,
    params: Result<RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
) -> Result<Response, HttpError> {
    // Axum's own rejection is plain text; the API's errors are JSON.
    let params = params.map_err(|rej| {
        HttpError::Api(ApiError::invalid(format!(
            "invalid path: {}",
            rej.body_text()
        )))
    })?;
    let raw = crate::extract::path_param(&params, "id")?;
    let id = SandboxId::parse(&raw)?;
    let not_found = || HttpError::Api(ApiError::sandbox_not_found(&id));
    let path = dir.join(format!("{id}.jsonl"));
    let read = tokio::task::spawn_blocking(move || {
        let live = !ends_with_destroy(&path);
        trace::read_trace(&path).map(|t| (t, live))
    })
    .await
    .map_err(|e| HttpError::Api(ApiError::internal(e)))?;
    let (t, live) = match read {
        Ok(x) => x,
        Err(trace::TraceError::Read { .. }) => return Err(not_found()),
        Err(e) => return Err(HttpError::Api(ApiError::internal(e))),
    };
    if owner(&t.header) != tenant {
        return Err(not_found());
    }
    let mut body = render_html(&t);
    if live {
        body = body.replacen(
            "<head>",
            "<head><meta http-equiv=\"refresh\" content=\"5\">",
            1,
        );
    }
    Ok(html(body))
}
