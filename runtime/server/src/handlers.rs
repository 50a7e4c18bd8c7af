//! Request handlers: authenticate, check ownership and quotas, call the backend on a blocking
//! thread, answer JSON (or SSE for a streamed exec).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use taskbox_core::api::{
    ApiError, Approval, CreateRequest, ExecEvent, ExecOutcome, ExecRequest, ExportRequest,
    ForkRequest, ForkResult, PolicySources, SandboxApi, SandboxId, SandboxInfo, SecretRotation,
    SecretStatus, SecretUpdate, SecretValue, WORKSPACE_DIGEST_LABEL, excerpt,
};
use tokio::sync::mpsc;

use crate::auth::{RESERVED_LABEL_PREFIX, TENANT_LABEL, Tenant};
use crate::caller::Caller;
use crate::error::HttpError;
use crate::extract::{ApiJson, ApiQuery, ApprovalPath, ExecId, Owned, SecretPath};
use crate::idempotency::{Answer, Fingerprint, KeyHeader};
use crate::state::AppState;
use crate::types::{
    ApprovalsQuery, DenyRequest, Health, KillRequest, RenewRequest, StdinQuery, StdinRequest,
    WaitQuery,
};
use crate::workspaces::{Digesting, UPLOAD_LABEL, WorkspaceUpload};

const DEFAULT_WAIT: Duration = Duration::from_secs(30);
const MAX_WAIT: Duration = Duration::from_secs(300);

/// Runs a blocking backend call on the blocking pool.
async fn blocking<T, F>(f: F) -> Result<T, HttpError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(HttpError::from),
        Err(e) => Err(HttpError::Api(ApiError::internal(format!(
            "backend call failed: {e}"
        )))),
    }
}

/// Runs a blocking backend call on this worker thread (`block_in_place`: the worker's other
/// tasks move to another thread first), or on the blocking pool where that cannot be done (a
/// current-thread runtime). For a call on the way of every request, an exec above all: the
/// pool's hand-offs (a thread woken to run the call, a worker woken for its result) were about
/// 65 µs of an `exec true` round trip of 1.5 ms on a 2-vCPU machine (BENCHMARKS.md).
async fn in_place<T, F>(f: F) -> Result<T, HttpError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        // A panic is the same 500 as one on the pool.
        let caught = tokio::task::block_in_place(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        });
        match caught {
            Ok(r) => r.map_err(HttpError::from),
            Err(_) => Err(HttpError::Api(ApiError::internal(
                "backend call failed: it panicked",
            ))),
        }
    } else {
        blocking(f).await
    }
}

/// `POST /v1/sandboxes`. With an `Idempotency-Key`, a retry gets the first sandbox (see
/// [`crate::idempotency`]).
pub async fn create(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    caller: Caller,
    KeyHeader(key): KeyHeader,
    ApiJson(req): ApiJson<CreateRequest>,
) -> Result<Response, HttpError> {
    const OPERATION: &str = "create_sandbox";
    let Some(key) = key else {
        let info = create_sandbox(state, tenant, caller, req).await?;
        return Ok((StatusCode::CREATED, Json(info)).into_response());
    };
    let fingerprint = Fingerprint::of(OPERATION, "", &req);
    let (st, t) = (state.clone(), tenant.clone());
    let work = async move {
        let info = create_sandbox(st, t, caller, req).await?;
        Answer::json(StatusCode::CREATED, &info)
    };
    state
        .idempotency()
        .run(&state, OPERATION, &tenant, key, fingerprint, work)
        .await
}

/// Creates a sandbox of `tenant`: checks the request, resolves its policy and workspace, takes
/// a place in the quotas, and registers the sandbox as the tenant's with its lease.
async fn create_sandbox(
    state: AppState,
    tenant: String,
    caller: Caller,
    mut req: CreateRequest,
) -> Result<SandboxInfo, HttpError> {
    if let Some(key) = req
        .labels
        .keys()
        .find(|k| k.starts_with(RESERVED_LABEL_PREFIX))
    {
        return Err(ApiError::invalid(format!(
            "label {key:?} is reserved: labels starting with {RESERVED_LABEL_PREFIX:?} are set by the server"
        ))
        .into());
    }
    if req.ttl_secs == Some(0) {
        return Err(ApiError::invalid("ttl_secs must be at least 1").into());
    }
    // Resolved once, here, before anything starts: a profile name or inline text, never a path
    // on the supervisor's host (which the supervisor would read with its own rights).
    req.resolve_policy(PolicySources::Remote)?;
    // A place in the limits first: a create over one is refused at once, before anything else
    // is looked at (the workspace's check waits for the blocking pool, busy in a burst).
    let slot = state.reserve_create(&tenant)?;
    // The workspace: an upload of this tenant, or a directory the operator lets this caller
    // name (checked on the blocking pool: it asks the file system).
    let st = state.clone();
    let t = tenant.clone();
    let asked = std::mem::take(&mut req.workspace);
    let upload = req.workspace_id.take();
    let (workspace, upload) = blocking(move || match upload {
        Some(_) if !asked.is_empty() => Err(ApiError::invalid(
            "give either workspace or workspace_id, not both",
        )),
        Some(id) => {
            let (tree, u) = st.uploads()?.tree(&t, &id)?;
            Ok((tree, Some(u)))
        }
        None => Ok((st.workspaces().check(&asked, &caller)?, None)),
    })
    .await?;
    req.workspace = workspace.display().to_string();
    if let Some(u) = upload {
        req.labels.insert(UPLOAD_LABEL.to_string(), u.id);
        if let Some(sha256) = u.sha256 {
            req.labels
                .insert(WORKSPACE_DIGEST_LABEL.to_string(), sha256);
        }
    }
    let asked = req.ttl_secs;
    let lease = state.limits().lease(asked);
    req.ttl_secs = lease.map(|d| d.as_secs().max(1));
    req.labels.insert(TENANT_LABEL.to_string(), tenant.clone());
    let backend = state.backend().clone();
    // Registered on the blocking thread: a client that goes away mid-create still leaves an owned,
    // leased sandbox behind, never an orphan.
    let (info, expires) = blocking(move || {
        let info = backend.create(req)?;
        let expires = slot.commit(&info, asked);
        Ok((info, expires))
    })
    .await?;
    tracing::Span::current().record("sandbox", info.id.as_str());
    tracing::info!(sandbox = %info.id, tenant = %tenant, expires_at_ms = ?expires, "sandbox created");
    Ok(state.with_lease(info))
}

/// `POST /v1/sandboxes/{id}/fork`: `count` new sandboxes of the caller's from one of its own,
/// each taking a place in the quotas and a lease of its own, as a create does.
pub async fn fork(
    State(state): State<AppState>,
    o: Owned,
    ApiJson(mut req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<ForkResult>), HttpError> {
    if let Some(key) = req
        .labels
        .keys()
        .find(|k| k.starts_with(RESERVED_LABEL_PREFIX))
    {
        return Err(ApiError::invalid(format!(
            "label {key:?} is reserved: labels starting with {RESERVED_LABEL_PREFIX:?} are set by the server"
        ))
        .into());
    }
    if req.ttl_secs == Some(0) {
        return Err(ApiError::invalid("ttl_secs must be at least 1").into());
    }
    let count = req.count()?;
    let slots = state.reserve_creates(&o.tenant, count as usize)?;
    let asked = req.ttl_secs;
    let lease = state.limits().lease(asked);
    req.ttl_secs = lease.map(|d| d.as_secs().max(1));
    let backend = state.backend().clone();
    let id = o.id.clone();
    // Registered on the blocking thread, as a create's: a client that goes away mid-fork leaves
    // owned, leased sandboxes behind, never orphans.
    let forked = blocking(move || {
        let forked = backend.fork(&id, req)?;
        for (slot, info) in slots.into_iter().zip(&forked.sandboxes) {
            slot.commit(info, asked);
        }
        Ok(forked)
    })
    .await?;
    let ids: Vec<&str> = forked.sandboxes.iter().map(|i| i.id.as_str()).collect();
    tracing::info!(sandbox = %o.id, tenant = %o.tenant, forks = ?ids, "sandbox forked");
    let sandboxes = forked
        .sandboxes
        .into_iter()
        .map(|i| state.with_lease(i))
        .collect();
    Ok((StatusCode::CREATED, Json(ForkResult { sandboxes })))
}

pub async fn list(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
) -> Result<Json<Vec<SandboxInfo>>, HttpError> {
    let mine = state.owned_ids(&tenant);
    let backend = state.backend().clone();
    let all = blocking(move || Ok(backend.list())).await?;
    let out = all
        .into_iter()
        .filter(|i| mine.contains(&i.id))
        .map(|i| state.with_lease(i))
        .collect();
    Ok(Json(out))
}

pub async fn info(State(state): State<AppState>, o: Owned) -> Result<Json<SandboxInfo>, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    match blocking(move || backend.info(&id)).await {
        Ok(info) => Ok(Json(state.with_lease(info))),
        Err(HttpError::Api(ApiError::SandboxNotFound(_))) => {
            state.forget(&o.id);
            Err(crate::state::not_found(&o.id).into())
        }
        Err(e) => Err(e),
    }
}

pub async fn destroy(State(state): State<AppState>, o: Owned) -> Result<StatusCode, HttpError> {
    let st = state.clone();
    let id = o.id.clone();
    blocking(move || match st.backend().destroy(&id) {
        Ok(()) | Err(ApiError::SandboxNotFound(_)) => {
            st.forget(&id);
            Ok(())
        }
        Err(e) => Err(e),
    })
    .await?;
    tracing::info!(sandbox = %o.id, tenant = %o.tenant, "sandbox destroyed");
    Ok(StatusCode::NO_CONTENT)
}

pub async fn renew(
    State(state): State<AppState>,
    o: Owned,
    ApiJson(req): ApiJson<RenewRequest>,
) -> Result<Json<SandboxInfo>, HttpError> {
    if req.ttl_secs == 0 {
        return Err(ApiError::invalid("ttl_secs must be at least 1").into());
    }
    // Never past the sandbox's hard lifetime, however long the renew asks.
    state.renew(&o.id, Some(req.ttl_secs));
    let backend = state.backend().clone();
    let id = o.id.clone();
    let info = blocking(move || backend.info(&id)).await?;
    Ok(Json(state.with_lease(info)))
}

fn wants_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.to_ascii_lowercase().contains("text/event-stream"))
}

/// What the blocking exec thread sends to the streaming response.
enum Msg {
    Event(ExecEvent),
    Done(Box<Result<ExecOutcome, ApiError>>, bool),
}

fn event_name(ev: &ExecEvent) -> &'static str {
    match ev {
        ExecEvent::Approval { .. } => "approval",
        ExecEvent::Answered { .. } => "answered",
        ExecEvent::Started { .. } => "started",
        ExecEvent::Stdout { .. } => "stdout",
        ExecEvent::Stderr { .. } => "stderr",
        ExecEvent::Ended { .. } => "ended",
    }
}

fn sse_event(ev: &ExecEvent) -> Event {
    let data = serde_json::to_string(ev).unwrap_or_else(|e| {
        format!(r#"{{"type":"error","message":"cannot encode the event: {e}"}}"#)
    });
    Event::default().event(event_name(ev)).data(data)
}

/// The SSE events a message becomes; `None` ends the stream.
fn sse_events(state: &AppState, msg: Msg) -> Vec<Event> {
    match msg {
        Msg::Event(ev) => vec![sse_event(&ev)],
        Msg::Done(done, ended) => match *done {
            Ok(ExecOutcome::Finished(result)) if !ended => vec![sse_event(&ExecEvent::Ended {
                result: Box::new(result),
            })],
            Ok(_) => Vec::new(),
            Err(e) => {
                let e = HttpError::Api(e);
                state.metrics().error(e.code());
                let data = serde_json::to_string(&e.body()).unwrap_or_default();
                vec![Event::default().event("error").data(data)]
            }
        },
    }
}

/// `POST /v1/sandboxes/{id}/exec`: JSON, or with `Accept: text/event-stream` (and not
/// `background`) an SSE stream `started`, `stdout`/`stderr`..., `ended` (an `error` event if the
/// exec fails after it started). The exec holds its quota place until the command ends, also
/// when the client goes away.
pub async fn exec(
    State(state): State<AppState>,
    o: Owned,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Response, HttpError> {
    req.resolved_argv()?;
    let permit = state.exec_permit(&o.tenant)?;
    let backend = state.backend().clone();
    let id = o.id.clone();

    if req.background || !wants_event_stream(&headers) {
        let st = state.clone();
        let outcome = in_place(move || {
            let _permit = permit;
            let start = Instant::now();
            let r = backend.exec(&id, req, None);
            st.metrics().exec(start.elapsed(), r.as_ref().ok());
            r
        })
        .await;
        if state.closing() {
            // The server cut this connection while the exec ran (as it does when the call
            // runs on the blocking pool): the client gets no answer, whatever came back.
            std::future::pending::<()>().await;
        }
        return Ok(Json(outcome?).into_response());
    }

    let (tx, mut rx) = mpsc::channel::<Msg>(256);
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let start = Instant::now();
        let mut ended = false;
        let events = tx.clone();
        let mut on_event = |ev: ExecEvent| {
            if matches!(ev, ExecEvent::Ended { .. }) {
                ended = true;
            }
            // A client that went away stops receiving; the exec still runs to its end.
            let _ = events.blocking_send(Msg::Event(ev));
        };
        let r = backend.exec(&id, req, Some(&mut on_event));
        st.metrics().exec(start.elapsed(), r.as_ref().ok());
        let _ = tx.blocking_send(Msg::Done(Box::new(r), ended));
    });

    // Errors before the first event (e.g. the command cannot start) get a proper status.
    let first = match rx.recv().await {
        None => return Err(ApiError::internal("the exec ended without an answer").into()),
        Some(Msg::Done(done, ended)) => match *done {
            Err(e) => return Err(e.into()),
            ok => Msg::Done(Box::new(ok), ended),
        },
        Some(m) => m,
    };
    let st = state.clone();
    let first_events = sse_events(&st, first);
    let rest = stream::unfold((rx, st), |(mut rx, st)| async move {
        let msg = rx.recv().await?;
        let events = sse_events(&st, msg);
        Some((stream::iter(events), (rx, st)))
    });
    use futures_util::StreamExt as _;
    let all = stream::iter(first_events)
        .chain(rest.flatten())
        .map(Ok::<Event, Infallible>);
    Ok(Sse::new(all)
        .keep_alive(KeepAlive::default())
        .into_response())
}

pub async fn process(
    State(state): State<AppState>,
    o: Owned,
    ExecId(exec_id): ExecId,
) -> Result<Response, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    let p = blocking(move || backend.process(&id, exec_id)).await?;
    Ok(Json(p).into_response())
}

pub async fn wait(
    State(state): State<AppState>,
    o: Owned,
    ExecId(exec_id): ExecId,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Response, HttpError> {
    let timeout = q
        .timeout_ms
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_WAIT)
        .min(MAX_WAIT);
    let backend = state.backend().clone();
    let id = o.id.clone();
    let p = blocking(move || backend.wait(&id, exec_id, timeout)).await?;
    Ok(Json(p).into_response())
}

pub async fn kill(
    State(state): State<AppState>,
    o: Owned,
    ExecId(exec_id): ExecId,
    ApiJson(req): ApiJson<KillRequest>,
) -> Result<Response, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    let p = blocking(move || backend.kill(&id, exec_id, req.signal)).await?;
    Ok(Json(p).into_response())
}

pub async fn stdin(
    State(state): State<AppState>,
    o: Owned,
    ExecId(exec_id): ExecId,
    req: axum::extract::Request,
) -> Result<StatusCode, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    if !is_raw_body(req.headers()) {
        let ApiJson(body) =
            <ApiJson<StdinRequest> as axum::extract::FromRequest<AppState>>::from_request(
                req, &state,
            )
            .await?;
        let data = taskbox_core::api::decode_bytes("data", &body.data, body.encoding.as_deref())?;
        blocking(move || backend.write_stdin(&id, exec_id, &data, body.close)).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    let (mut parts, body) = req.into_parts();
    let ApiQuery(StdinQuery { close }) =
        <ApiQuery<StdinQuery> as axum::extract::FromRequestParts<AppState>>::from_request_parts(
            &mut parts, &state,
        )
        .await?;
    use futures_util::StreamExt as _;
    // The body goes on in chunks of up to STDIN_CHUNK as it arrives; each waits until the
    // process has taken it (a pipe's backpressure), so memory stays bounded whatever the size.
    let mut body = body.into_data_stream();
    let mut pending: Vec<u8> = Vec::with_capacity(STDIN_CHUNK);
    loop {
        let next = body.next().await;
        let done = next.is_none();
        if let Some(chunk) = next {
            let chunk = chunk.map_err(|e| match crate::body::BodyTimeout::find(&e) {
                Some(t) => HttpError::RequestTimeout(t.to_string()),
                None => HttpError::Api(ApiError::invalid(format!("the input was cut short: {e}"))),
            })?;
            pending.extend_from_slice(&chunk);
            if pending.len() < STDIN_CHUNK {
                continue;
            }
        }
        let data = std::mem::replace(&mut pending, Vec::with_capacity(STDIN_CHUNK));
        let (b, i) = (backend.clone(), id.clone());
        let last = done && close;
        if !data.is_empty() || last {
            blocking(move || b.write_stdin(&i, exec_id, &data, last)).await?;
        }
        if done {
            return Ok(StatusCode::NO_CONTENT);
        }
    }
}

/// The most of a streamed stdin body handed to the process in one write.
const STDIN_CHUNK: usize = 1 << 20;

/// The request's body is raw bytes (`application/octet-stream`), not JSON.
pub(crate) fn is_raw_body(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/octet-stream"))
        })
}

/// `GET /v1/approvals`: the pending approvals of all the caller's sandboxes, oldest first.
pub async fn all_approvals(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
) -> Result<Json<Vec<Approval>>, HttpError> {
    let ids = state.owned_ids(&tenant);
    let backend = state.backend().clone();
    let all = blocking(move || {
        let mut all = Vec::new();
        for id in ids {
            match backend.list_approvals(&id, None) {
                Ok(pending) => all.extend(pending),
                // Destroyed meanwhile.
                Err(ApiError::SandboxNotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        all.sort_by_key(|a: &Approval| a.created_at_ms);
        Ok(all)
    })
    .await?;
    Ok(Json(all))
}

/// `GET /v1/sandboxes/{id}/approvals`: the sandbox's pending approvals; with `wait_ms`, waits
/// for one when there is none.
pub async fn approvals(
    State(state): State<AppState>,
    o: Owned,
    ApiQuery(q): ApiQuery<ApprovalsQuery>,
) -> Result<Json<Vec<Approval>>, HttpError> {
    let wait = q.wait_ms.map(|ms| Duration::from_millis(ms).min(MAX_WAIT));
    let backend = state.backend().clone();
    let id = o.id.clone();
    let pending = blocking(move || backend.list_approvals(&id, wait)).await?;
    Ok(Json(pending))
}

pub async fn approve(
    State(state): State<AppState>,
    o: Owned,
    ApprovalPath(approval): ApprovalPath,
) -> Result<Json<Approval>, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    let answered = blocking(move || backend.approve(&id, &approval)).await?;
    tracing::info!(sandbox = %o.id, tenant = %o.tenant, approval = %answered.id, "approved");
    Ok(Json(answered))
}

/// `PUT /v1/sandboxes/{id}/secrets/{name}`: a new value for every request from now on.
pub async fn rotate_secret(
    State(state): State<AppState>,
    o: Owned,
    SecretPath(name): SecretPath,
    ApiJson(req): ApiJson<SecretRotation>,
) -> Result<Json<SecretStatus>, HttpError> {
    set_secret(state, o, name, Some(req.value)).await
}

/// `DELETE /v1/sandboxes/{id}/secrets/{name}`: requests go out without it from now on.
pub async fn revoke_secret(
    State(state): State<AppState>,
    o: Owned,
    SecretPath(name): SecretPath,
) -> Result<Json<SecretStatus>, HttpError> {
    set_secret(state, o, name, None).await
}

async fn set_secret(
    state: AppState,
    o: Owned,
    name: String,
    value: Option<SecretValue>,
) -> Result<Json<SecretStatus>, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    let update = SecretUpdate { name, value };
    let status = blocking(move || backend.set_secret(&id, update)).await?;
    tracing::info!(sandbox = %o.id, tenant = %o.tenant, secret = %status.name, state = %status.state, "secret changed");
    Ok(Json(status))
}

pub async fn deny(
    State(state): State<AppState>,
    o: Owned,
    ApprovalPath(approval): ApprovalPath,
    ApiJson(req): ApiJson<DenyRequest>,
) -> Result<Json<Approval>, HttpError> {
    let backend = state.backend().clone();
    let id = o.id.clone();
    let reason = req.reason.unwrap_or_default();
    let answered = blocking(move || backend.deny(&id, &approval, &reason)).await?;
    tracing::info!(sandbox = %o.id, tenant = %o.tenant, approval = %answered.id, "denied");
    Ok(Json(answered))
}

/// A file-system operation answering JSON.
pub async fn fs_json<Req, Res, F>(
    state: AppState,
    o: Owned,
    req: Req,
    status: StatusCode,
    op: F,
) -> Result<Response, HttpError>
where
    Req: Send + 'static,
    Res: serde::Serialize + Send + 'static,
    F: FnOnce(&dyn SandboxApi, &SandboxId, Req) -> Result<Res, ApiError> + Send + 'static,
{
    let backend = state.backend().clone();
    let id = o.id.clone();
    let res = blocking(move || op(backend.as_ref(), &id, req)).await?;
    Ok((status, Json(res)).into_response())
}

/// A file-system operation answering 204 No Content.
pub async fn fs_unit<Req, F>(
    state: AppState,
    o: Owned,
    req: Req,
    op: F,
) -> Result<Response, HttpError>
where
    Req: Send + 'static,
    F: FnOnce(&dyn SandboxApi, &SandboxId, Req) -> Result<(), ApiError> + Send + 'static,
{
    let backend = state.backend().clone();
    let id = o.id.clone();
    blocking(move || op(backend.as_ref(), &id, req)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v1/sandboxes/{id}/export`. With `apply` and an `Idempotency-Key`, a retry gets the
/// first answer and the change is written to the host once (see [`crate::idempotency`]);
/// without `apply` the key is checked and not kept (an export that writes nothing needs none).
pub async fn export(
    State(state): State<AppState>,
    o: Owned,
    KeyHeader(key): KeyHeader,
    ApiJson(req): ApiJson<ExportRequest>,
) -> Result<Response, HttpError> {
    const OPERATION: &str = "export";
    let key = key.filter(|_| req.apply);
    let Some(key) = key else {
        return fs_json(state, o, req, StatusCode::OK, |b, id, r| b.export(id, r)).await;
    };
    let fingerprint = Fingerprint::of(OPERATION, o.id.as_str(), &req);
    let backend = state.backend().clone();
    let id = o.id.clone();
    let work = async move {
        let res = blocking(move || backend.export(&id, req)).await?;
        Answer::json(StatusCode::OK, &res)
    };
    state
        .idempotency()
        .run(&state, OPERATION, &o.tenant, key, fingerprint, work)
        .await
}

pub async fn healthz(State(state): State<AppState>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        sandboxes: state.live_total() as u64,
    })
}

pub async fn metrics(State(state): State<AppState>, _tenant: Tenant) -> Response {
    state
        .metrics()
        .set_pooled(state.pooled(), state.pooled_ready(), state.pooled_served());
    let text = state
        .metrics()
        .render(&state.live_per_tenant(), &state.starting_per_tenant());
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

pub async fn no_route(method: Method, uri: Uri) -> HttpError {
    HttpError::Api(ApiError::not_found(format!(
        "no route for {method} {}",
        excerpt(uri.path())
    )))
}

pub async fn wrong_method(method: Method, uri: Uri) -> HttpError {
    HttpError::MethodNotAllowed(format!("{} does not accept {method}", excerpt(uri.path())))
}

/// `POST /v1/workspaces`: a workspace sent as a tar (the body, streamed to disk up to
/// `max_upload_bytes`), unpacked into a directory of the server's own. `?ttl_secs=N` sets how
/// long it is kept when no sandbox uses it (the sandbox lease's default and cap apply).
pub async fn upload_workspace(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiQuery(q): ApiQuery<crate::types::UploadQuery>,
    req: axum::extract::Request,
) -> Result<(StatusCode, Json<WorkspaceUpload>), HttpError> {
    use futures_util::StreamExt;
    use std::io::Write;
    let uploads = state.uploads()?;
    let lease = state
        .limits()
        .lease(q.ttl_secs)
        .unwrap_or(Duration::from_secs(24 * 3600));
    let json = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if json {
        // A repository to clone: `{"git": {"url": ..., "commit": ...}}`.
        let ApiJson(source) =
            <ApiJson<crate::gitsource::WorkspaceSource> as axum::extract::FromRequest<AppState>>::from_request(req, &state)
                .await?;
        let st = state.clone();
        let t = tenant.clone();
        let up = blocking(move || {
            let allowed = st.workspaces().git_hosts().to_vec();
            st.uploads()?
                .add_git(&t, &source.git, &allowed, lease.as_millis() as u64)
        })
        .await?;
        tracing::info!(upload = %up.id, tenant = %tenant, "workspace cloned");
        return Ok((StatusCode::CREATED, Json(up)));
    }
    let max = uploads.max_bytes();
    let too_large = |n: u64| HttpError::upload_too_large("workspace tar", n, max);
    if let Some(n) = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && n > max
    {
        return Err(too_large(n));
    }
    let (path, file) = uploads.incoming()?;
    let mut out = Digesting {
        inner: std::io::BufWriter::new(file),
        hash: sha2::Sha256::default(),
        bytes: 0,
    };
    let mut body = req.into_body().into_data_stream();
    let received: Result<(), HttpError> = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| match crate::body::BodyTimeout::find(&e) {
                Some(t) => HttpError::RequestTimeout(t.to_string()),
                None => HttpError::Api(ApiError::invalid(format!("the upload was cut short: {e}"))),
            })?;
            if out.bytes + chunk.len() as u64 > max {
                return Err(too_large(out.bytes + chunk.len() as u64));
            }
            // Small buffered writes to a local file: cheap enough not to leave the runtime.
            out.write_all(&chunk).map_err(|e| {
                HttpError::Api(ApiError::internal(format!("cannot store the upload: {e}")))
            })?;
        }
        out.flush().map_err(|e| {
            HttpError::Api(ApiError::internal(format!("cannot store the upload: {e}")))
        })
    }
    .await;
    if let Err(e) = received {
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    use sha2::Digest;
    let Digesting {
        inner, hash, bytes, ..
    } = out;
    drop(inner);
    let sha256: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let st = state.clone();
    let t = tenant.clone();
    let up = blocking(move || {
        st.uploads()?
            .add(&t, &path, bytes, sha256, lease.as_millis() as u64)
    })
    .await?;
    tracing::info!(upload = %up.id, tenant = %tenant, bytes, entries = up.entries, "workspace uploaded");
    Ok((StatusCode::CREATED, Json(up)))
}

/// `GET /v1/workspaces`: the caller's uploaded workspaces.
pub async fn list_workspaces(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
) -> Result<Json<Vec<WorkspaceUpload>>, HttpError> {
    Ok(Json(state.uploads()?.list(&tenant)))
}

/// `DELETE /v1/workspaces/{id}`: removes an upload no live sandbox uses.
pub async fn delete_workspace(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<StatusCode, HttpError> {
    let st = state.clone();
    blocking(move || {
        let in_use = st
            .backend()
            .list()
            .iter()
            .any(|i| i.labels.get(UPLOAD_LABEL) == Some(&id));
        st.uploads()?.remove(&tenant, &id, in_use)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
