//! The route table: written once, used by both the router and the OpenAPI document.

use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, on};
use taskbox_core::api::{
    Approval, CheckpointInfo, CheckpointRequest, CreateRequest, DiffRequest, DiffResult,
    EditRequest, EditResult, ExecEvent, ExecOutcome, ExecRequest, ExportRequest, ExportResult,
    ForkRequest, ForkResult, ListRequest, ListResult, MoveRequest, NetworkRules, PatchRequest,
    PatchResult, PathRequest, ProcessInfo, ReadRequest, ReadResult, RemoveRequest, SandboxInfo,
    SearchRequest, SearchResult, SecretRotation, SecretStatus, StatResult, WriteRequest,
    WriteResult,
};
use tracing::Instrument;

use crate::error::{ErrorCode, HttpError};
use crate::extract::{ApiJson, Owned};
use crate::handlers::{self, fs_json, fs_unit};
use crate::spec::schema;
pub use crate::spec::{Body, Param, RouteSpec, SchemaFn, Verb};
use crate::state::AppState;
use crate::types::{DenyRequest, Health, KillRequest, RenewRequest, StdinRequest};
use crate::workspaces::WorkspaceUpload;

/// The workspace upload's route: its body is a tar up to `max_upload_bytes`, not JSON.
const UPLOAD_PATH: &str = "/v1/workspaces";
/// The streamed file route: its `PUT` body is a file up to `max_upload_bytes`, not JSON.
const FILES_PATH: &str = "/v1/sandboxes/{id}/files";

const WAIT_QUERY: &[Param] = &[Param::int(
    "timeout_ms",
    "how long to wait at most, in milliseconds (default 30000, at most 300000)",
)];
const APPROVALS_QUERY: &[Param] = &[Param::int(
    "wait_ms",
    "when none is pending, wait up to this many milliseconds for one (at most 300000)",
)];

/// The query of the file route.
const FILE_QUERY: &[Param] = &[Param::text(
    "path",
    "the file: relative, the workspace's; absolute, the sandbox's",
)];
const UPLOAD_QUERY: &[Param] = &[
    FILE_QUERY[0],
    Param::flag("create_parents", "create missing parent directories"),
    Param::int(
        "mode",
        "permission bits of a new file, as a number (default 420, i.e. 0644)",
    ),
];

/// The stdin route, whose raw body streams (no body limit: input of any size).
const STDIN_PATH: &str = "/v1/sandboxes/{id}/processes/{exec_id}/stdin";
const STDIN_RAW: &str = "the bytes to write, streamed to the process as they arrive (input of \
    any size: no body limit); `?close=true` closes stdin after them";

struct Route {
    spec: RouteSpec,
    handler: MethodRouter<AppState>,
}

fn route<H, T>(spec: RouteSpec, handler: H) -> Route
where
    H: axum::handler::Handler<T, AppState>,
    T: 'static,
{
    Route {
        handler: on(spec.verb.filter(), handler),
        spec,
    }
}

/// A file-system route: `POST /v1/sandboxes/{id}/NAME` taking `Req`, answering `Res` as JSON.
macro_rules! fs_route {
    ($name:literal, $op:literal, $summary:literal, $req:ty => $res:ty, $status:literal, $call:expr) => {
        route(
            RouteSpec::new(
                Verb::Post,
                concat!("/v1/sandboxes/{id}/", $name),
                $op,
                $summary,
            )
            .takes(schema::<$req>)
            .answers($status, Body::Json(schema::<$res>)),
            |State(st): State<AppState>, o: Owned, ApiJson(req): ApiJson<$req>| {
                fs_json(st, o, req, status($status), $call)
            },
        )
    };
    ($name:literal, $op:literal, $summary:literal, $req:ty => (), $call:expr) => {
        route(
            RouteSpec::new(
                Verb::Post,
                concat!("/v1/sandboxes/{id}/", $name),
                $op,
                $summary,
            )
            .takes(schema::<$req>)
            .answers(204, Body::Empty),
            |State(st): State<AppState>, o: Owned, ApiJson(req): ApiJson<$req>| {
                fs_unit(st, o, req, $call)
            },
        )
    };
}

fn status(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::OK)
}

fn table() -> Vec<Route> {
    use Verb::{Delete, Get, Post, Put};
    vec![
        route(
            RouteSpec::new(
                Get,
                "/healthz",
                "healthz",
                "liveness and the number of live sandboxes",
            )
            .public()
            .answers(200, Body::Json(schema::<Health>)),
            handlers::healthz,
        ),
        route(
            RouteSpec::new(
                Get,
                "/metrics",
                "metrics",
                "Prometheus metrics (text format 0.0.4)",
            )
            .answers(200, Body::Text),
            handlers::metrics,
        ),
        route(
            RouteSpec::new(Get, "/openapi.json", "openapi", "this OpenAPI document")
                .public()
                .answers(200, Body::Json(schema::<serde_json::Value>)),
            openapi,
        ),
        route(
            RouteSpec::new(Post, "/v1/sandboxes", "create_sandbox", "create a sandbox")
                .takes(schema::<CreateRequest>)
                .answers(201, Body::Json(schema::<SandboxInfo>))
                .idempotent(
                    "a retry with the same key and request gets the first answer (the same \
                     sandbox); no second sandbox is made",
                ),
            handlers::create,
        ),
        route(
            RouteSpec::new(
                Post,
                UPLOAD_PATH,
                "upload_workspace",
                "send a workspace as a tar (the body); create a sandbox on it with workspace_id",
            )
            .answers(201, Body::Json(schema::<WorkspaceUpload>)),
            handlers::upload_workspace,
        ),
        route(
            RouteSpec::new(
                Get,
                "/v1/workspaces",
                "list_workspaces",
                "the caller's uploaded workspaces",
            )
            .answers(200, Body::Json(schema::<Vec<WorkspaceUpload>>)),
            handlers::list_workspaces,
        ),
        route(
            RouteSpec::new(
                Delete,
                "/v1/workspaces/{workspace_id}",
                "delete_workspace",
                "remove an uploaded workspace no sandbox uses",
            )
            .answers(204, Body::Empty),
            handlers::delete_workspace,
        ),
        route(
            RouteSpec::new(
                Get,
                "/v1/sandboxes",
                "list_sandboxes",
                "the caller's sandboxes",
            )
            .answers(200, Body::Json(schema::<Vec<SandboxInfo>>)),
            handlers::list,
        ),
        route(
            RouteSpec::new(Get, "/v1/sandboxes/{id}", "get_sandbox", "a sandbox's info")
                .answers(200, Body::Json(schema::<SandboxInfo>)),
            handlers::info,
        ),
        route(
            RouteSpec::new(
                Delete,
                "/v1/sandboxes/{id}",
                "destroy_sandbox",
                "destroy a sandbox",
            )
            .answers(204, Body::Empty),
            handlers::destroy,
        ),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/renew",
                "renew_lease",
                "set the lease to ttl_secs from now",
            )
            .takes(schema::<RenewRequest>)
            .answers(200, Body::Json(schema::<SandboxInfo>)),
            handlers::renew,
        ),
        route(
            RouteSpec {
                events: Some(schema::<ExecEvent>),
                ..RouteSpec::new(
                    Post,
                    "/v1/sandboxes/{id}/exec",
                    "exec",
                    "run a command (SSE with Accept: text/event-stream)",
                )
                .takes(schema::<ExecRequest>)
                .answers(200, Body::Json(schema::<ExecOutcome>))
            },
            handlers::exec,
        ),
        route(
            RouteSpec::new(
                Get,
                "/v1/sandboxes/{id}/processes/{exec_id}",
                "get_process",
                "a background process's state and output",
            )
            .answers(200, Body::Json(schema::<ProcessInfo>)),
            handlers::process,
        ),
        route(
            RouteSpec {
                query: WAIT_QUERY,
                ..RouteSpec::new(
                    Post,
                    "/v1/sandboxes/{id}/processes/{exec_id}/wait",
                    "wait_process",
                    "wait for a background process to end",
                )
                .answers(200, Body::Json(schema::<ProcessInfo>))
            },
            handlers::wait,
        ),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/processes/{exec_id}/kill",
                "kill_process",
                "signal a background process",
            )
            .takes(schema::<KillRequest>)
            .answers(200, Body::Json(schema::<ProcessInfo>)),
            handlers::kill,
        ),
        route(
            RouteSpec::new(
                Post,
                STDIN_PATH,
                "write_stdin",
                "write to a background process's stdin",
            )
            .takes(schema::<StdinRequest>)
            .takes_raw(STDIN_RAW)
            .answers(204, Body::Empty),
            handlers::stdin,
        ),
        route(
            RouteSpec::new(
                Get,
                "/v1/approvals",
                "list_all_approvals",
                "execs of all the caller's sandboxes waiting for approval",
            )
            .answers(200, Body::Json(schema::<Vec<Approval>>)),
            handlers::all_approvals,
        ),
        route(
            RouteSpec {
                query: APPROVALS_QUERY,
                ..RouteSpec::new(
                    Get,
                    "/v1/sandboxes/{id}/approvals",
                    "list_approvals",
                    "the sandbox's execs waiting for approval (the command policy's ask)",
                )
                .answers(200, Body::Json(schema::<Vec<Approval>>))
            },
            handlers::approvals,
        ),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/approvals/{approval}/approve",
                "approve",
                "approve a waiting exec: it runs",
            )
            .answers(200, Body::Json(schema::<Approval>)),
            handlers::approve,
        ),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/approvals/{approval}/deny",
                "deny",
                "deny a waiting exec: it returns a violation with the reason",
            )
            .takes(schema::<DenyRequest>)
            .answers(200, Body::Json(schema::<Approval>)),
            handlers::deny,
        ),
        route(
            RouteSpec::new(
                Put,
                "/v1/sandboxes/{id}/network",
                "set_network",
                "replace the egress allow/deny rules of a live sandbox with network mode \"proxy\"",
            )
            .takes(schema::<NetworkRules>)
            .answers(200, Body::Json(schema::<NetworkRules>)),
            |State(st): State<AppState>, o: Owned, ApiJson(req): ApiJson<NetworkRules>| {
                fs_json(st, o, req, StatusCode::OK, |b, id, r| b.set_network(id, r))
            },
        ),
        route(
            RouteSpec::new(
                Put,
                "/v1/sandboxes/{id}/secrets/{name}",
                "rotate_secret",
                "give one of the sandbox's secrets a new value, for every request from now on \
                 (the value never appears in an answer, a log or the trace)",
            )
            .takes(schema::<SecretRotation>)
            .answers(200, Body::Json(schema::<SecretStatus>)),
            handlers::rotate_secret,
        ),
        route(
            RouteSpec::new(
                Delete,
                "/v1/sandboxes/{id}/secrets/{name}",
                "revoke_secret",
                "revoke one of the sandbox's secrets: requests go out without it from now on",
            )
            .answers(200, Body::Json(schema::<SecretStatus>)),
            handlers::revoke_secret,
        ),
        fs_route!("read", "read", "read a file", ReadRequest => ReadResult, 200, |b, id, r| b.read(id, r)),
        fs_route!("write", "write", "write a file atomically", WriteRequest => WriteResult, 200, |b, id, r| b.write(id, r)),
        fs_route!("edit", "edit", "replace exact text in a file", EditRequest => EditResult, 200, |b, id, r| b.edit(id, r)),
        fs_route!("patch", "patch", "apply a unified diff, all or nothing", PatchRequest => PatchResult, 200, |b, id, r| b.patch(id, r)),
        fs_route!("list", "list", "list a directory", ListRequest => ListResult, 200, |b, id, r| b.list_dir(id, r)),
        fs_route!("search", "search", "search file contents", SearchRequest => SearchResult, 200, |b, id, r| b.search(id, r)),
        fs_route!("stat", "stat", "a path's metadata", PathRequest => StatResult, 200, |b, id, r| b.stat(id, r)),
        fs_route!("remove", "remove", "remove a file or directory", RemoveRequest => (), |b, id, r| b.remove(id, r)),
        fs_route!("move", "move", "rename a file or directory", MoveRequest => (), |b, id, r| b.rename(id, r)),
        route(
            RouteSpec::new(
                Put,
                FILES_PATH,
                "upload",
                "write a file from the raw body, streamed (up to max_upload_bytes), atomically",
            )
            .with_query(UPLOAD_QUERY)
            .takes_raw("the file's content")
            .answers(200, Body::Json(schema::<WriteResult>)),
            crate::files::upload,
        ),
        route(
            RouteSpec::new(
                Get,
                FILES_PATH,
                "download",
                "a file's content as the raw body, streamed",
            )
            .with_query(FILE_QUERY)
            .answers(200, Body::Binary),
            crate::files::download,
        ),
        fs_route!("diff", "diff", "diff against the baseline or a checkpoint: what git ignores and .git/ counted in `ignored` (listed with `include_ignored`), files that run on their own in `flagged`", DiffRequest => DiffResult, 200, |b, id, r| b.diff(id, r)),
        fs_route!("checkpoints", "create_checkpoint", "checkpoint the workspace", CheckpointRequest => CheckpointInfo, 201, |b, id, r| b.checkpoint(id, r)),
        fs_route!("restore", "restore", "roll the workspace back to a checkpoint", CheckpointRequest => (), |b, id, r| b.restore(id, r)),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/fork",
                "fork",
                "`count` new sandboxes (1-64) from this one as it is now or from one of its checkpoints: same image, policy, environment, workspace and /tmp, each with a fresh upper layer and its own lease; processes are not copied. Each fork counts against the quotas as a create does",
            )
            .takes(schema::<ForkRequest>)
            .answers(201, Body::Json(schema::<ForkResult>)),
            handlers::fork,
        ),
        route(
            RouteSpec::new(
                Post,
                "/v1/sandboxes/{id}/export",
                "export",
                "the change as a patch or tar (the default diff's files), optionally applied to the host; an apply of flagged files needs `allow_autorun`",
            )
            .takes(schema::<ExportRequest>)
            .answers(200, Body::Json(schema::<ExportResult>))
            .idempotent("with `apply`: a retry with the same key and request gets the first answer, and the change is written to the host once; without `apply` the key is checked, not kept"),
            handlers::export,
        ),
    ]
}

/// Every route the router serves.
pub fn route_specs() -> Vec<RouteSpec> {
    table().into_iter().map(|r| r.spec).collect()
}

/// The API's router, with request logging, metrics, the body limit and JSON fallbacks.
pub fn router(state: AppState) -> Router {
    let mut r: Router<AppState> = Router::new();
    for Route { spec, handler } in table() {
        r = r.route(spec.path, handler);
    }
    let max_body = state.limits().max_body_bytes;
    r.fallback(handlers::no_route)
        .method_not_allowed_fallback(handlers::wrong_method)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_large_bodies,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Answers 413 at once to a request whose `Content-Length` is over `max_body_bytes`, before a
/// byte of its body is read (a body without a length is cut at the limit while it is read). A
/// workspace upload and a streamed file have their own limit (`max_upload_bytes`), checked the
/// same way by their handlers.
pub async fn refuse_large_bodies(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let streamed = match *req.method() {
        axum::http::Method::POST => matched.as_ref().is_some_and(|m| {
            m.as_str() == UPLOAD_PATH
                || (m.as_str() == STDIN_PATH && crate::handlers::is_raw_body(req.headers()))
        }),
        axum::http::Method::PUT => matched.as_ref().is_some_and(|m| m.as_str() == FILES_PATH),
        _ => false,
    };
    if streamed {
        return next.run(req).await;
    }
    let max = state.limits().max_body_bytes;
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(len) if len > max as u64 => HttpError::body_too_large(Some(len), max).into_response(),
        _ => next.run(req).await,
    }
}

/// Logs each request (route, tenant, sandbox, status, duration) and counts it.
async fn observe(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    req: Request,
    next: Next,
) -> Response {
    let route = matched
        .as_ref()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        route = %route,
        tenant = tracing::field::Empty,
        sandbox = tracing::field::Empty,
    );
    let start = Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    state.metrics().http(&route, status);
    if let Some(ErrorCode(code)) = resp.extensions().get::<ErrorCode>() {
        state.metrics().error(code);
    }
    let duration_ms = start.elapsed().as_millis() as u64;
    span.in_scope(|| {
        if status >= 500 {
            tracing::warn!(status, duration_ms, "request failed");
        } else {
            tracing::info!(status, duration_ms, "request");
        }
    });
    resp
}

/// `GET /openapi.json`: the document of this route table.
async fn openapi() -> axum::Json<serde_json::Value> {
    axum::Json(crate::openapi::document(&route_specs()))
}
