//! The HTTP API end to end on the real native backend: long-lived sandboxes over a real TCP
//! socket with a real client. Needs the `taskbox-init` helper built (`cargo build --workspace
//! --bins`, as scripts/test.sh does); skips with a reason without it, or fails under
//! `TASKBOX_REQUIRE_ALL=1`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{ALICE, BOB, expect_error, tokens};
use serde_json::{Value, json};
use taskbox_core::api::SandboxApi;
use taskbox_core::sandbox::NativeBackend;
use taskbox_server::{AppState, Auth, Limits, router};

fn helper_available() -> bool {
    if taskbox_core::native::helper_path().is_ok() {
        return true;
    }
    let reason = "the taskbox-init helper is not built (run `cargo build --workspace --bins`)";
    if std::env::var("TASKBOX_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("required prerequisite missing (TASKBOX_REQUIRE_ALL=1): {reason}");
    }
    eprintln!("SKIP: {reason}");
    false
}

struct Native {
    base: String,
    client: reqwest::Client,
    state: AppState,
    backend: Arc<NativeBackend>,
    ws: std::path::PathBuf,
    _dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Native {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Native {
    async fn start() -> Native {
        Native::start_with(Limits::default()).await
    }

    async fn start_with(limits: Limits) -> Native {
        let dir = tempfile::Builder::new()
            .prefix("taskbox-server-")
            .tempdir()
            .unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(ws.join("hello.txt"), "hello\n").unwrap();
        let backend = Arc::new(NativeBackend::new(dir.path().join("state")).unwrap());
        let b: Arc<dyn SandboxApi> = backend.clone();
        let (ws_root, state_dir) = (ws.clone(), dir.path().join("state"));
        let state = tokio::task::spawn_blocking(move || {
            let rules =
                taskbox_server::workspaces::WorkspaceRules::new(&[ws_root], &state_dir, &[])
                    .unwrap()
                    .with_git_hosts(vec!["127.0.0.1".into()]);
            AppState::builder(b)
                .auth(Auth::Tokens(tokens()))
                .limits(limits)
                .workspaces(rules)
                .uploads(taskbox_server::workspaces::Uploads::open(&state_dir, 64 << 20).unwrap())
                .build()
                .unwrap()
        })
        .await
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Native {
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
            state,
            backend,
            ws,
            _dir: dir,
            task,
        }
    }

    async fn post(&self, token: &str, path: &str, body: Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn ok(&self, token: &str, path: &str, body: Value) -> Value {
        let r = self.post(token, path, body).await;
        let status = r.status();
        let text = r.text().await.unwrap();
        assert!(status.is_success(), "{path}: {status} {text}");
        if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap()
        }
    }

    async fn create(&self, token: &str, extra: Value) -> String {
        let mut body = json!({"workspace": self.ws.display().to_string()});
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        let r = self.post(token, "/v1/sandboxes", body).await;
        assert_eq!(r.status(), 201);
        let v: Value = r.json().await.unwrap();
        v["id"].as_str().unwrap().to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_works_end_to_end_on_the_native_backend() {
    if !helper_available() {
        return;
    }
    let n = Native::start().await;
    let id = n.create(ALICE, json!({"labels": {"task": "t1"}})).await;
    let sb = format!("/v1/sandboxes/{id}");

    let info: Value = n
        .client
        .get(format!("{}{sb}", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["labels"]["task"], "t1");
    assert_eq!(info["labels"]["taskbox.tenant"], "alice");
    assert!(info["expires_at_ms"].is_u64(), "the default lease: {info}");

    // JSON exec: state persists across execs.
    let r = n
        .ok(
            ALICE,
            &format!("{sb}/exec"),
            json!({"shell": "echo one > /tmp/s; cat hello.txt"}),
        )
        .await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"]["text"], "hello\n");
    let r = n
        .ok(
            ALICE,
            &format!("{sb}/exec"),
            json!({"argv": ["cat", "/tmp/s"]}),
        )
        .await;
    assert_eq!(r["stdout"]["text"], "one\n", "{r}");

    // Streamed exec.
    let body = n
        .client
        .post(format!("{}{sb}/exec", n.base))
        .bearer_auth(ALICE)
        .header("accept", "text/event-stream")
        .json(&json!({"shell": "echo a; echo b >&2; exit 3"}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events.first(), Some(&"started"), "{body}");
    assert_eq!(events.last(), Some(&"ended"), "{body}");
    assert!(
        events.contains(&"stdout") && events.contains(&"stderr"),
        "{body}"
    );
    assert_eq!(
        events.iter().filter(|e| **e == "ended").count(),
        1,
        "{body}"
    );
    let ended = body
        .split("\n\n")
        .find(|f| f.contains("event: ended"))
        .and_then(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .unwrap();
    let ended: Value = serde_json::from_str(ended).unwrap();
    assert_eq!(ended["result"]["exit_code"], 3);

    // fs operations.
    let w = n
        .ok(
            ALICE,
            &format!("{sb}/write"),
            json!({"path": "src/a.txt", "content": "x = 1\n", "create_parents": true}),
        )
        .await;
    assert_eq!(w["created"], true);
    let r = n
        .ok(ALICE, &format!("{sb}/read"), json!({"path": "src/a.txt"}))
        .await;
    assert_eq!(r["content"], "x = 1\n");
    let e = n
        .ok(
            ALICE,
            &format!("{sb}/edit"),
            json!({"path": "src/a.txt", "old": "1", "new": "2"}),
        )
        .await;
    assert_eq!(e["replacements"], 1);
    let r = n
        .post(
            ALICE,
            &format!("{sb}/edit"),
            json!({"path": "src/a.txt", "old": "nope", "new": "2"}),
        )
        .await;
    expect_error(r, 422, "edit_not_found").await;
    let l = n
        .ok(ALICE, &format!("{sb}/list"), json!({"path": "src"}))
        .await;
    assert_eq!(l["entries"][0]["path"], "src/a.txt", "{l}");
    let s = n
        .ok(ALICE, &format!("{sb}/search"), json!({"pattern": "x ="}))
        .await;
    assert_eq!(s["matches"][0]["line_number"], 1, "{s}");
    let st = n
        .ok(ALICE, &format!("{sb}/stat"), json!({"path": "src/a.txt"}))
        .await;
    assert_eq!(st["kind"], "file");
    let c = n
        .ok(ALICE, &format!("{sb}/checkpoints"), json!({"name": "c1"}))
        .await;
    assert_eq!(c["name"], "c1");
    n.ok(
        ALICE,
        &format!("{sb}/move"),
        json!({"from": "src/a.txt", "to": "src/b.txt"}),
    )
    .await;
    n.ok(ALICE, &format!("{sb}/remove"), json!({"path": "hello.txt"}))
        .await;
    let d = n.ok(ALICE, &format!("{sb}/diff"), json!({})).await;
    let changed: Vec<&str> = d["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(
        changed.contains(&"hello.txt") && changed.contains(&"src/b.txt"),
        "{d}"
    );
    n.ok(ALICE, &format!("{sb}/restore"), json!({"name": "c1"}))
        .await;
    let r = n
        .ok(ALICE, &format!("{sb}/read"), json!({"path": "hello.txt"}))
        .await;
    assert_eq!(r["content"], "hello\n", "restored");
    let x = n.ok(ALICE, &format!("{sb}/export"), json!({})).await;
    assert!(x["patch"].as_str().unwrap().contains("src/a.txt"), "{x}");
    assert_eq!(
        std::fs::read_to_string(n.ws.join("hello.txt")).unwrap(),
        "hello\n"
    );
    assert!(
        !n.ws.join("src").exists(),
        "the host workspace is untouched"
    );

    // Background process: stdin, wait, kill.
    let bg = n
        .ok(
            ALICE,
            &format!("{sb}/exec"),
            json!({"argv": ["/bin/cat"], "background": true}),
        )
        .await;
    let pid = bg["exec_id"].as_u64().unwrap();
    n.ok(
        ALICE,
        &format!("{sb}/processes/{pid}/stdin"),
        json!({"data": "hi\n", "close": true}),
    )
    .await;
    let p = n
        .ok(
            ALICE,
            &format!("{sb}/processes/{pid}/wait?timeout_ms=5000"),
            json!({}),
        )
        .await;
    assert_eq!(p["running"], false, "{p}");
    assert_eq!(p["result"]["stdout"]["text"], "hi\n");
    let bg = n
        .ok(
            ALICE,
            &format!("{sb}/exec"),
            json!({"argv": ["sleep", "60"], "background": true}),
        )
        .await;
    let pid = bg["exec_id"].as_u64().unwrap();
    n.ok(
        ALICE,
        &format!("{sb}/processes/{pid}/kill"),
        json!({"signal": 9}),
    )
    .await;
    let p = n
        .ok(
            ALICE,
            &format!("{sb}/processes/{pid}/wait?timeout_ms=5000"),
            json!({}),
        )
        .await;
    assert_eq!(p["result"]["signal"], 9, "{p}");
    let r = n
        .client
        .get(format!("{}{sb}/processes/{pid}", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Bob sees nothing of it.
    let r = n
        .post(BOB, &format!("{sb}/exec"), json!({"argv": ["true"]}))
        .await;
    expect_error(r, 404, "sandbox_not_found").await;
    let r = n
        .post(BOB, &format!("{sb}/read"), json!({"path": "hello.txt"}))
        .await;
    expect_error(r, 404, "sandbox_not_found").await;

    // Destroy.
    let r = n
        .client
        .delete(format!("{}{sb}", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(n.backend.list().is_empty());
    let r = n
        .post(ALICE, &format!("{sb}/exec"), json!({"argv": ["true"]}))
        .await;
    expect_error(r, 404, "sandbox_not_found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_lease_destroys_the_native_sandbox() {
    if !helper_available() {
        return;
    }
    let n = Native::start().await;
    let reaper = tokio::spawn(n.state.clone().run_reaper(Duration::from_millis(100)));
    let short = n.create(ALICE, json!({"ttl_secs": 1})).await;
    let long = n.create(ALICE, json!({"ttl_secs": 1})).await;
    n.ok(
        ALICE,
        &format!("/v1/sandboxes/{long}/renew"),
        json!({"ttl_secs": 60}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1800)).await;
    let ids: Vec<String> = n
        .backend
        .list()
        .into_iter()
        .map(|i| i.id.to_string())
        .collect();
    assert!(!ids.contains(&short), "{ids:?}");
    assert!(ids.contains(&long), "{ids:?}");
    reaper.abort();
}

/// A POST with an `Idempotency-Key` (or none): status, whether the answer says it was
/// replayed, and the body.
async fn keyed(n: &Native, path: &str, key: Option<&str>, body: Value) -> (u16, bool, Value) {
    let mut req = n
        .client
        .post(format!("{}{path}", n.base))
        .bearer_auth(ALICE)
        .json(&body);
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let replayed = r.headers().get("idempotent-replayed").is_some();
    let text = r.text().await.unwrap();
    (
        status,
        replayed,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_create_and_apply_with_keys_happen_once_on_the_host() {
    if !helper_available() {
        return;
    }
    let n = Native::start().await;
    let ws = n.ws.display().to_string();
    let (status, replayed, made) = keyed(
        &n,
        "/v1/sandboxes",
        Some("create-1"),
        json!({"workspace": ws}),
    )
    .await;
    assert_eq!((status, replayed), (201, false), "{made}");
    let (status, replayed, again) = keyed(
        &n,
        "/v1/sandboxes",
        Some("create-1"),
        json!({"workspace": ws}),
    )
    .await;
    assert_eq!((status, replayed, &again["id"]), (201, true, &made["id"]));
    assert_eq!(n.backend.list().len(), 1, "one sandbox");
    let sb = format!("/v1/sandboxes/{}", made["id"].as_str().unwrap());

    n.ok(
        ALICE,
        &format!("{sb}/write"),
        json!({"path": "hello.txt", "content": "from the sandbox\n"}),
    )
    .await;
    n.ok(
        ALICE,
        &format!("{sb}/write"),
        json!({"path": "new.txt", "content": "new\n"}),
    )
    .await;
    let export = format!("{sb}/export");
    let apply = json!({"apply": true});
    let (status, replayed, first) = keyed(&n, &export, Some("apply-1"), apply.clone()).await;
    assert_eq!(
        (status, replayed, &first["applied"]),
        (200, false, &json!(true)),
        "{first}"
    );
    let host = |name: &str| std::fs::read_to_string(n.ws.join(name)).ok();
    assert_eq!(host("hello.txt").as_deref(), Some("from the sandbox\n"));
    assert_eq!(host("new.txt").as_deref(), Some("new\n"));

    // The person edits the host copy after the apply; a retry of the apply must not undo that.
    std::fs::write(n.ws.join("hello.txt"), "edited on the host\n").unwrap();
    std::fs::remove_file(n.ws.join("new.txt")).unwrap();
    let (status, replayed, retried) = keyed(&n, &export, Some("apply-1"), apply.clone()).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(retried, first, "the first answer");
    assert_eq!(host("hello.txt").as_deref(), Some("edited on the host\n"));
    assert_eq!(host("new.txt"), None, "nothing written again");

    // What the key prevents: an apply without one writes the sandbox's state again.
    let (status, replayed, _) = keyed(&n, &export, None, apply).await;
    assert_eq!((status, replayed), (200, false));
    assert_eq!(host("hello.txt").as_deref(), Some("from the sandbox\n"));
    assert_eq!(host("new.txt").as_deref(), Some("new\n"));
}

/// One request on a Unix socket, from this process: the status line's code.
fn unix_status(socket: &std::path::Path, path: &str) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}

/// The value of a metric line in `/metrics`, 0 when absent.
fn metric(socket: &std::path::Path, line: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A command inside a native sandbox that can reach the supervisor's socket (here: the socket
/// is in its workspace, mounted read-only, so `connect` works) is refused before a request is
/// read; the same request from this process is answered. Runs as root and rootless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_reaches_the_socket_is_refused() {
    if !helper_available() {
        return;
    }
    if !std::path::Path::new("/usr/bin/curl").exists() {
        let reason = "no /usr/bin/curl to connect from inside the sandbox";
        if std::env::var("TASKBOX_REQUIRE_ALL").is_ok_and(|v| v == "1") {
            panic!("required prerequisite missing (TASKBOX_REQUIRE_ALL=1): {reason}");
        }
        eprintln!("SKIP: {reason}");
        return;
    }
    common::logs();
    let dir = tempfile::Builder::new()
        .prefix("taskbox-peer-")
        .tempdir()
        .unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let socket = ws.join("taskbox.sock");
    let state_dir = dir.path().join("state");
    let backend = tokio::task::spawn_blocking({
        let s = state_dir.clone();
        move || Arc::new(NativeBackend::new(s).unwrap())
    })
    .await
    .unwrap();
    let mut config = taskbox_server::ServerConfig::new(state_dir);
    config.socket = Some(socket.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let b: Arc<dyn SandboxApi> = backend.clone();
    let server = tokio::spawn(taskbox_server::serve(config, b, async move {
        let _ = stop_rx.await;
    }));
    for _ in 0..500 {
        if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Open to every uid, so that the connection reaches the server's own check whoever the
    // sandbox's commands are (run by root, they are ids no file mode lets in).
    let open = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o777);
    std::fs::set_permissions(&socket, open).unwrap();

    let sock = socket.clone();
    let out = tokio::task::spawn_blocking(move || {
        let id = backend
            .create(taskbox_core::api::CreateRequest {
                workspace: sock.parent().unwrap().display().to_string(),
                policy: Some("read-only".into()),
                ..Default::default()
            })
            .unwrap()
            .id;
        let r = match backend
            .exec(
                &id,
                taskbox_core::api::ExecRequest {
                    shell: Some(
                        "ls -l taskbox.sock; curl -sS --max-time 10 --unix-socket taskbox.sock \
                         http://localhost/v1/sandboxes; echo \" curl=$?\""
                            .into(),
                    ),
                    ..Default::default()
                },
                None,
            )
            .unwrap()
        {
            taskbox_core::api::ExecOutcome::Finished(r) => r,
            other => panic!("expected a finished exec, got {other:?}"),
        };
        (id, r)
    })
    .await
    .unwrap();
    let (id, r) = out;
    let said = format!("{}{}", r.stdout.text, r.stderr.text);
    assert!(
        said.contains("taskbox.sock"),
        "the socket is in view: {said}"
    );
    assert!(
        !said.contains(id.as_str()),
        "the sandbox got an answer: {said}"
    );
    assert!(!said.contains(" curl=0"), "curl succeeded: {said}");
    let sock = socket.clone();
    let (refused, status) = tokio::task::spawn_blocking(move || {
        (
            metric(
                &sock,
                "taskbox_connections_refused_total{reason=\"sandboxed_peer\"}",
            ),
            unix_status(&sock, "/v1/sandboxes"),
        )
    })
    .await
    .unwrap();
    assert_eq!(refused, 1, "the server refused the sandbox's connection");
    assert_eq!(status, 200, "the same request from the host is answered");

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

fn tar_with(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_come_from_the_roots_or_from_an_upload() {
    if !helper_available() {
        return;
    }
    let n = Native::start().await;
    // Over TCP a tenant names nothing outside the roots, not even taskbox's state or /etc;
    // the refusal names the roots and the way to send a workspace instead.
    for asked in ["/etc", "/var/lib/taskbox", "/", "/nonexistent"] {
        let r = n
            .post(ALICE, "/v1/sandboxes", json!({"workspace": asked}))
            .await;
        let m = expect_error(r, 403, "path_refused").await;
        assert!(m.contains(n.ws.to_str().unwrap()), "{m}");
        assert!(m.contains("POST /v1/workspaces"), "{m}");
    }

    // An upload: a tar streamed in, unpacked by the server, the workspace of a sandbox.
    let tar = tar_with(&[("src/main.py", b"print('hi')\n"), ("README", b"uploaded\n")]);
    let r = n
        .client
        .post(format!("{}/v1/workspaces", n.base))
        .bearer_auth(ALICE)
        .body(tar.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let up: Value = r.json().await.unwrap();
    let id = up["id"].as_str().unwrap().to_string();
    assert_eq!(up["bytes"], tar.len());
    assert_eq!(up["entries"], 2);
    use sha2::Digest;
    let digest: String = sha2::Sha256::digest(&tar)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(up["sha256"], digest);
    // Bob cannot see it or use it.
    let r = n
        .post(BOB, "/v1/sandboxes", json!({"workspace_id": id}))
        .await;
    expect_error(r, 404, "not_found").await;
    let sb = n
        .create(ALICE, json!({"workspace_id": id, "workspace": ""}))
        .await;
    let out = n
        .ok(
            ALICE,
            &format!("/v1/sandboxes/{sb}/exec"),
            json!({"argv": ["cat", "README"]}),
        )
        .await;
    assert_eq!(out["stdout"]["text"], "uploaded\n", "{out}");
    // In use: not removable; after the sandbox: gone.
    let del = |who: &'static str| {
        let url = format!("{}/v1/workspaces/{id}", n.base);
        let c = n.client.clone();
        async move { c.delete(url).bearer_auth(who).send().await.unwrap() }
    };
    expect_error(del(ALICE).await, 409, "conflict").await;
    expect_error(del(BOB).await, 404, "not_found").await;
    let r = n
        .client
        .delete(format!("{}/v1/sandboxes/{sb}", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(del(ALICE).await.status(), 204);
    let r = n
        .post(ALICE, "/v1/sandboxes", json!({"workspace_id": id}))
        .await;
    expect_error(r, 404, "not_found").await;

    // Too large, said by its length: answered before the body is read.
    let r = n
        .client
        .post(format!("{}/v1/workspaces", n.base))
        .bearer_auth(ALICE)
        .header("content-length", (1u64 << 31).to_string())
        .body(vec![0u8; 16])
        .send()
        .await;
    if let Ok(r) = r {
        assert_eq!(r.status(), 413);
    }
}

fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// A repository served over plain ("dumb") HTTP on loopback by Python's http.server.
struct Served {
    url: String,
    commit: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn served_repo() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    git(&src, &["init", "-q"]);
    std::fs::write(src.join("hello.txt"), "from git\n").unwrap();
    git(&src, &["add", "."]);
    git(&src, &["commit", "-qm", "one"]);
    let commit = git(&src, &["rev-parse", "HEAD"]).trim().to_string();
    let www = dir.path().join("www");
    std::fs::create_dir(&www).unwrap();
    git(
        dir.path(),
        &["clone", "-q", "--bare", "src", "www/repo.git"],
    );
    git(&www.join("repo.git"), &["update-server-info"]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new("python3")
        .args(["-m", "http.server", "--bind", "127.0.0.1"])
        .arg(port.to_string())
        .arg("--directory")
        .arg(&www)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "http.server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Served {
        url: format!("http://127.0.0.1:{port}/repo.git"),
        commit,
        child,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_is_cloned_from_a_git_url_and_commit() {
    if !helper_available() {
        return;
    }
    let n = Native::start().await;
    let repo = served_repo();
    let post = |body: Value| {
        let c = n.client.clone();
        let url = format!("{}/v1/workspaces", n.base);
        async move {
            c.post(url)
                .bearer_auth(ALICE)
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    let r = post(json!({"git": {"url": repo.url, "commit": repo.commit}})).await;
    assert_eq!(r.status(), 201);
    let up: Value = r.json().await.unwrap();
    assert_eq!(up["git"]["commit"], repo.commit.as_str());
    let id = up["id"].as_str().unwrap().to_string();
    let sb = n
        .create(ALICE, json!({"workspace_id": id, "workspace": ""}))
        .await;
    let out = n
        .ok(
            ALICE,
            &format!("/v1/sandboxes/{sb}/exec"),
            json!({"shell": "cat hello.txt; git rev-parse HEAD"}),
        )
        .await;
    assert_eq!(
        out["stdout"]["text"],
        format!("from git\n{}\n", repo.commit),
        "{out}"
    );

    // What the supervisor will not fetch: refused before it connects, naming why.
    let port_url = repo.url.replace("127.0.0.1", "localhost");
    for (url, commit, code, why) in [
        (
            port_url.as_str(),
            repo.commit.as_str(),
            "path_refused",
            "a loopback address",
        ),
        (
            "http://169.254.169.254/r.git",
            repo.commit.as_str(),
            "path_refused",
            "metadata",
        ),
        (
            "file:///etc",
            repo.commit.as_str(),
            "path_refused",
            "only https:// and http://",
        ),
        (
            repo.url.as_str(),
            "main",
            "invalid_argument",
            "full commit id",
        ),
        (
            repo.url.as_str(),
            &"0".repeat(40),
            "invalid_argument",
            "git checkout failed",
        ),
    ] {
        let r = post(json!({"git": {"url": url, "commit": commit}})).await;
        let m = expect_error(r, if code == "path_refused" { 403 } else { 400 }, code).await;
        assert!(m.contains(why), "{url}: {m}");
    }
    // Nothing of the refused ones is kept.
    let r = n
        .client
        .get(format!("{}/v1/workspaces", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    let list: Value = r.json().await.unwrap();
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_over_http_is_the_callers_with_leases_and_quotas() {
    if !helper_available() {
        return;
    }
    let n = Native::start_with(Limits {
        max_sandboxes_per_tenant: 4,
        ..Limits::default()
    })
    .await;
    let id = n.create(ALICE, json!({"labels": {"task": "t1"}})).await;
    let sb = format!("/v1/sandboxes/{id}");
    n.ok(
        ALICE,
        &format!("{sb}/exec"),
        json!({"shell": "echo forked > hello.txt; echo t > /tmp/t"}),
    )
    .await;
    n.ok(ALICE, &format!("{sb}/checkpoints"), json!({"name": "c1"}))
        .await;

    // Someone else's sandbox cannot be forked, nor can a label of the server's be set.
    let r = n
        .post(BOB, &format!("{sb}/fork"), json!({"count": 1}))
        .await;
    expect_error(r, 404, "sandbox_not_found").await;
    let r = n
        .post(
            ALICE,
            &format!("{sb}/fork"),
            json!({"labels": {"taskbox.tenant": "bob"}}),
        )
        .await;
    expect_error(r, 400, "invalid_argument").await;
    // Past the tenant's quota: 429 before anything is made (1 live + 4 > 4).
    let r = n
        .post(ALICE, &format!("{sb}/fork"), json!({"count": 4}))
        .await;
    expect_error(r, 429, "limit_exceeded").await;
    assert_eq!(n.backend.list().len(), 1);

    let r = n
        .post(
            ALICE,
            &format!("{sb}/fork"),
            json!({"count": 2, "ttl_secs": 120, "labels": {"attempt": "x"}}),
        )
        .await;
    assert_eq!(r.status(), 201);
    let forked: Value = r.json().await.unwrap();
    let forks = forked["sandboxes"].as_array().unwrap();
    assert_eq!(forks.len(), 2, "{forked}");
    let mine: Vec<Value> = n
        .client
        .get(format!("{}/v1/sandboxes", n.base))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for f in forks {
        let fid = f["id"].as_str().unwrap();
        assert_eq!(f["forked_from"]["parent"], id.as_str(), "{f}");
        assert_eq!(f["labels"]["taskbox.tenant"], "alice");
        assert_eq!(
            (&f["labels"]["task"], &f["labels"]["attempt"]),
            (&json!("t1"), &json!("x"))
        );
        let lease = f["expires_at_ms"].as_u64().unwrap();
        let created = f["created_at_ms"].as_u64().unwrap();
        assert!(
            (created + 118_000..=created + 122_000).contains(&lease),
            "{f}"
        );
        assert!(mine.iter().any(|i| i["id"] == fid), "listed as alice's");
        let r = n
            .ok(
                ALICE,
                &format!("/v1/sandboxes/{fid}/exec"),
                json!({"shell": "cat hello.txt /tmp/t"}),
            )
            .await;
        assert_eq!(r["stdout"]["text"], "forked\nt\n", "{r}");
        let r = n
            .client
            .get(format!("{}/v1/sandboxes/{fid}", n.base))
            .bearer_auth(BOB)
            .send()
            .await
            .unwrap();
        expect_error(r, 404, "sandbox_not_found").await;
    }
    // 3 live now: one more fork fits, from the checkpoint; then the quota is full.
    let r = n
        .ok(ALICE, &format!("{sb}/fork"), json!({"checkpoint": "c1"}))
        .await;
    assert_eq!(r["sandboxes"][0]["forked_from"]["checkpoint"], "c1", "{r}");
    let r = n.post(ALICE, &format!("{sb}/fork"), json!({})).await;
    expect_error(r, 429, "limit_exceeded").await;
    assert_eq!(n.backend.list().len(), 4);
    for info in n.backend.list() {
        let r = n
            .client
            .delete(format!("{}/v1/sandboxes/{}", n.base, info.id))
            .bearer_auth(ALICE)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }
    assert!(n.backend.list().is_empty());
}
