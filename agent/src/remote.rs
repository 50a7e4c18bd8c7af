//! [`Remote`]: the narrow API over HTTP to `taskbox serve` (its Unix socket or a TCP address),
//! as a [`SandboxApi`]. The agent loop takes any `SandboxApi`, so it runs the same in-process
//! and against a supervisor; streamed execs (Server-Sent Events) carry the `approval` events
//! that let the harness put a command policy's `ask` to a person.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use taskbox_core::api::*;
use taskbox_core::policy;

use crate::http::{self, HttpError};

/// A client of the HTTP API.
#[derive(Debug, Clone)]
pub struct Remote {
    client: http::Client,
    token: Option<String>,
    /// Deadline of a request that is not an exec or a wait.
    timeout: Duration,
}

impl Remote {
    /// `url`: `unix:/PATH/taskbox.sock`, `http://HOST:PORT`, or `https://HOST[:PORT]` (a TLS
    /// proxy in front of the supervisor; the system's roots, or `SSL_CERT_FILE`, are trusted).
    pub fn new(url: &str, token: Option<String>) -> Result<Remote, HttpError> {
        Ok(Remote {
            client: http::Client::new(url, None)?,
            token,
            timeout: Duration::from_secs(120),
        })
    }

    fn headers(&self) -> Vec<(&'static str, String)> {
        self.token
            .iter()
            .map(|t| ("Authorization", format!("Bearer {t}")))
            .collect()
    }

    fn call_raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<(u16, Vec<u8>), ApiError> {
        let payload = body.map(|b| b.to_string().into_bytes());
        let mut req = http::Request::new(method, path);
        req.headers = self.headers();
        req.body = payload.as_deref();
        let resp = self.client.send(&req, timeout).map_err(transport)?;
        if (200..300).contains(&resp.status) {
            return Ok((resp.status, resp.body));
        }
        Err(api_error(resp.status, &resp.body))
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        let (_, raw) = self.call_raw(method, path, body, timeout)?;
        serde_json::from_slice(&raw).map_err(|e| unexpected(path, e))
    }

    /// A streamed exec: its events go to `events` as they come; the result ends the stream.
    fn stream_exec(
        &self,
        route: &Route,
        events: &mut (dyn FnMut(ExecEvent) + Send),
    ) -> Result<ExecOutcome, ApiError> {
        let payload = route
            .body
            .as_ref()
            .map(|b| b.to_string().into_bytes())
            .unwrap_or_default();
        let mut r = http::Request::new(route.method, &route.path);
        r.headers = self.headers();
        r.body = Some(&payload);
        r.accept = "text/event-stream";
        let mut stream = self.client.open(&r, route.timeout).map_err(transport)?;
        if stream.status != 200 {
            let status = stream.status;
            let raw = stream.read_all().map_err(transport)?;
            return Err(api_error(status, &raw));
        }
        let mut data = String::new();
        while let Some(line) = stream.next_line().map_err(transport)? {
            if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            } else if line.is_empty() && !data.is_empty() {
                let ev: Value = serde_json::from_str(&data).map_err(|e| {
                    let message = format!("malformed exec event from the supervisor: {e}");
                    ApiError::internal_with(message, e)
                })?;
                data.clear();
                if ev["type"] == "error" || ev.get("error").is_some() {
                    return Err(api_error(500, ev.to_string().as_bytes()));
                }
                let ev: ExecEvent = serde_json::from_value(ev).map_err(|e| {
                    let message = format!("unknown exec event from the supervisor: {e}");
                    ApiError::internal_with(message, e)
                })?;
                if let ExecEvent::Ended { result } = ev {
                    let result = *result;
                    events(ExecEvent::Ended {
                        result: Box::new(result.clone()),
                    });
                    return Ok(ExecOutcome::Finished(result));
                }
                events(ev);
            }
        }
        Err(ApiError::internal(
            "the supervisor ended the exec's event stream without a result",
        ))
    }
}

/// One operation as an HTTP request to the supervisor.
struct Route {
    method: &'static str,
    path: String,
    body: Option<Value>,
    /// How long to wait for the answer.
    timeout: Duration,
}

impl Route {
    fn new(method: &'static str, path: String, body: Option<Value>, timeout: Duration) -> Route {
        Route {
            method,
            path,
            body,
            timeout,
        }
    }

    /// The same request, allowed `extra` more time (an operation that waits on purpose).
    fn waiting(mut self, extra: Duration) -> Route {
        self.timeout += extra;
        self
    }
}

/// The route of each operation on sandbox `id` (the supervisor's route table), with `timeout`
/// as the deadline of an answer that does not wait on purpose.
fn route(id: &SandboxId, op: &Op<'_>, timeout: Duration) -> Result<Route, ApiError> {
    let sb = format!("/v1/sandboxes/{id}");
    let get = |path: String| Route::new("GET", path, None, timeout);
    let post = |path: String, body: Option<Value>| Route::new("POST", path, body, timeout);
    let fs = |name: &str, req: Value| post(format!("{sb}/{name}"), Some(req));
    Ok(match op {
        Op::Info => get(sb.clone()),
        // The exec's own timeout, plus a long wait for a person's approval, plus slack.
        Op::Exec { req, .. } => Route::new(
            "POST",
            format!("{sb}/exec"),
            Some(body(req)?),
            Duration::from_millis(req.timeout_ms.unwrap_or(600_000)) + Duration::from_secs(3600),
        ),
        Op::Process { exec_id } => get(format!("{sb}/processes/{exec_id}")),
        Op::Wait { exec_id, timeout } => post(
            format!(
                "{sb}/processes/{exec_id}/wait?timeout_ms={}",
                timeout.as_millis()
            ),
            None,
        )
        .waiting(*timeout),
        Op::Kill { exec_id, signal } => post(
            format!("{sb}/processes/{exec_id}/kill"),
            Some(json!({ "signal": signal })),
        ),
        Op::WriteStdin {
            exec_id,
            data,
            close,
        } => post(
            format!("{sb}/processes/{exec_id}/stdin"),
            Some(json!({"data": String::from_utf8_lossy(data), "close": close})),
        ),
        Op::Read(r) => fs("read", body(r)?),
        Op::Write(r) => fs("write", body(r)?),
        Op::Edit(r) => fs("edit", body(r)?),
        Op::Patch(r) => fs("patch", body(r)?),
        Op::ListDir(r) => fs("list", body(r)?),
        Op::Search(r) => fs("search", body(r)?),
        Op::Stat(r) => fs("stat", body(r)?),
        Op::Remove(r) => fs("remove", body(r)?),
        Op::Rename(r) => fs("move", body(r)?),
        Op::Upload { .. } | Op::Download { .. } => {
            return Err(ApiError::invalid(
                "the agent's client of the supervisor does not stream files; use write and read",
            ));
        }
        Op::Diff(r) => fs("diff", body(r)?),
        Op::Checkpoint(r) => fs("checkpoints", body(r)?),
        Op::Restore(r) => fs("restore", body(r)?),
        Op::Export(r) => fs("export", body(r)?),
        Op::Destroy => Route::new("DELETE", sb.clone(), None, timeout),
        Op::ListApprovals { wait: None } => get(format!("{sb}/approvals")),
        Op::ListApprovals { wait: Some(w) } => {
            get(format!("{sb}/approvals?wait_ms={}", w.as_millis())).waiting(*w)
        }
        Op::Approve { approval } => post(format!("{sb}/approvals/{approval}/approve"), None),
        Op::Deny { approval, reason } => post(
            format!("{sb}/approvals/{approval}/deny"),
            Some(json!({ "reason": reason })),
        ),
        Op::SetNetwork(r) => Route::new("PUT", format!("{sb}/network"), Some(body(r)?), timeout),
        Op::SetSecret(u) => {
            let path = format!("{sb}/secrets/{}", u.name);
            match &u.value {
                Some(value) => Route::new("PUT", path, Some(json!({ "value": value })), timeout),
                None => Route::new("DELETE", path, None, timeout),
            }
        }
        Op::Fork(r) => fs("fork", body(r)?),
    })
}

/// A request as its JSON body.
fn body<T: Serialize>(req: &T) -> Result<Value, ApiError> {
    serde_json::to_value(req).map_err(|e| ApiError::internal_with(e.to_string(), e))
}

/// An answer of the supervisor that is not what the API promises.
fn unexpected(path: &str, e: serde_json::Error) -> ApiError {
    let message = format!("unexpected answer from the supervisor to {path}: {e}");
    ApiError::internal_with(message, e)
}

fn transport(e: HttpError) -> ApiError {
    ApiError::Unavailable(format!("the supervisor cannot be reached: {e}"))
}

/// The API's JSON error body as an [`ApiError`] of the same code.
fn api_error(status: u16, body: &[u8]) -> ApiError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let code = v["error"]["code"].as_str().unwrap_or("");
    let msg = v["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| format!("the supervisor answered HTTP {status}"));
    match (code, status) {
        ("", 404) => ApiError::NotFound(msg),
        ("", 400) => ApiError::InvalidArgument(msg),
        ("", 413) => ApiError::TooLarge(msg),
        ("", _) => ApiError::Internal(msg),
        (code, _) => ApiError::from_code(code, msg),
    }
}

impl OpHandler for Remote {
    fn handle_create(&self, mut req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        // The supervisor takes a policy's name or text, never a path: a file is read here, by
        // the client's own user, and sent as text.
        if req.policy_toml.is_none()
            && let Some(p) = req.policy.as_deref().filter(|p| policy::is_path(p))
        {
            let text = policy::read_policy_file(std::path::Path::new(p))
                .map_err(|e| ApiError::invalid(e.to_string()))?;
            req.policy_toml = Some(text);
        }
        self.call("POST", "/v1/sandboxes", Some(&body(&req)?), self.timeout)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.call("GET", "/v1/sandboxes", None, self.timeout)
            .unwrap_or_default()
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        let name = op.name();
        let route = route(id, &op, self.timeout)?;
        if let Op::Exec {
            req,
            events: Some(events),
        } = op
            && !req.background
        {
            return self.stream_exec(&route, events).map(Answer::Exec);
        }
        let (_, raw) = self.call_raw(
            route.method,
            &route.path,
            route.body.as_ref(),
            route.timeout,
        )?;
        // The operations that answer nothing answer 204 and no body.
        let v = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&raw).map_err(|e| unexpected(&route.path, e))?
        };
        Answer::from_json(name, v).map_err(|e| unexpected(&route.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_take_their_routes() {
        let id = SandboxId::parse("sb-1").unwrap();
        let t = Duration::from_secs(2);
        let shown = |op: Op<'_>| {
            let r = route(&id, &op, t).unwrap();
            (r.method, r.path, r.body, r.timeout)
        };
        let wait = Op::Wait {
            exec_id: 3,
            timeout: Duration::from_secs(5),
        };
        assert_eq!(
            shown(wait),
            (
                "POST",
                "/v1/sandboxes/sb-1/processes/3/wait?timeout_ms=5000".into(),
                None,
                Duration::from_secs(7)
            )
        );
        let stdin = Op::WriteStdin {
            exec_id: 3,
            data: b"hi".as_slice().into(),
            close: true,
        };
        let (_, path, body, _) = shown(stdin);
        assert_eq!(path, "/v1/sandboxes/sb-1/processes/3/stdin");
        assert_eq!(body, Some(json!({"data": "hi", "close": true})));
        let moved = shown(Op::Rename(MoveRequest::default()));
        assert_eq!(
            (moved.0, moved.1.as_str()),
            ("POST", "/v1/sandboxes/sb-1/move")
        );
        let cp = shown(Op::Checkpoint(CheckpointRequest::default()));
        assert_eq!(cp.1, "/v1/sandboxes/sb-1/checkpoints");
        let net = shown(Op::SetNetwork(NetworkRules::default()));
        assert_eq!(
            (net.0, net.1.as_str()),
            ("PUT", "/v1/sandboxes/sb-1/network")
        );
        let gone = shown(Op::Destroy);
        assert_eq!(
            (gone.0, gone.1.as_str(), gone.2),
            ("DELETE", "/v1/sandboxes/sb-1", None)
        );
        let polled = shown(Op::ListApprovals {
            wait: Some(Duration::from_millis(1500)),
        });
        assert_eq!(polled.1, "/v1/sandboxes/sb-1/approvals?wait_ms=1500");
        assert_eq!(polled.3, Duration::from_millis(3500));
    }

    #[test]
    fn error_bodies_keep_their_codes() {
        let e = api_error(
            422,
            br#"{"error":{"code":"edit_not_found","message":"old text not found"}}"#,
        );
        assert!(matches!(e, ApiError::EditNotFound(ref m) if m == "old text not found"));
        assert!(matches!(api_error(404, b"nope"), ApiError::NotFound(_)));
        let gone =
            br#"{"error":{"code":"sandbox_not_found","message":"sandbox sb-1 does not exist"}}"#;
        assert!(matches!(api_error(404, gone), ApiError::SandboxNotFound(_)));
        assert!(matches!(api_error(502, b""), ApiError::Internal(_)));
    }
}
