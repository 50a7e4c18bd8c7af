//! The HTTP surface over a real TCP socket with a real client, against the recording
//! `FakeBackend` (tests/common). See `native.rs` for the real backend.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;

use std::time::Duration;

use common::*;
use reqwest::Method;
use serde_json::{Value, json};
use taskbox_server::routes::Verb;
use taskbox_server::{Limits, route_specs};

fn method(v: Verb) -> Method {
    match v {
        Verb::Get => Method::GET,
        Verb::Post => Method::POST,
        Verb::Put => Method::PUT,
        Verb::Delete => Method::DELETE,
    }
}

fn concrete(path: &str, id: &str) -> String {
    path.replace("{id}", id)
        .replace("{exec_id}", "1")
        .replace("{approval}", "ap-0000000000000001")
        .replace("{name}", "gh")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_unknown_token_is_401_and_public_routes_need_none() {
    let s = start(Limits::default()).await;
    let r = s.client.get(s.url("/v1/sandboxes")).send().await.unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    expect_error(r, 401, "unauthorized").await;
    let r = s.get("not-a-token", "/v1/sandboxes").await;
    expect_error(r, 401, "unauthorized").await;
    let r = s
        .client
        .get(s.url("/v1/sandboxes"))
        .header("authorization", format!("Basic {ALICE}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 401, "unauthorized").await;
    let r = s.client.get(s.url("/metrics")).send().await.unwrap();
    expect_error(r, 401, "unauthorized").await;
    let r = s
        .client
        .post(s.url("/v1/sandboxes"))
        .body("{}")
        .send()
        .await
        .unwrap();
    expect_error(r, 401, "unauthorized").await;
    assert!(
        s.backend.calls().iter().all(|c| c == "list"),
        "{:?}",
        s.backend.calls()
    );

    let r = s.client.get(s.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["sandboxes"], 0);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    let r = s.client.get(s.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_never_sees_another_tenants_sandbox() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    let missing = "sb-00000000deadbeef";

    let mine: Value = s.get(ALICE, "/v1/sandboxes").await.json().await.unwrap();
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!(mine[0]["labels"]["taskbox.tenant"], "alice");
    let theirs: Value = s.get(BOB, "/v1/sandboxes").await.json().await.unwrap();
    assert_eq!(theirs, json!([]));

    s.backend.clear_calls();
    let mut checked = 0;
    for spec in route_specs().iter().filter(|r| r.path.contains("{id}")) {
        for id in [a.as_str(), missing] {
            let r = s
                .client
                .request(method(spec.verb), s.url(&concrete(spec.path, id)))
                .bearer_auth(BOB)
                .header("accept", "text/event-stream")
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            let msg = expect_error(r, 404, "sandbox_not_found").await;
            assert_eq!(
                msg,
                format!("sandbox {id} does not exist"),
                "{} {}",
                spec.verb.as_str(),
                spec.path
            );
        }
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} routes with an id");
    assert!(
        s.backend.calls().is_empty(),
        "bob reached the backend: {:?}",
        s.backend.calls()
    );

    // Alice still has it, and can use it.
    let r = s.get(ALICE, &format!("/v1/sandboxes/{a}")).await;
    assert_eq!(r.status(), 200);
    let r = s
        .post(
            BOB,
            &format!("/v1/sandboxes/{a}/exec"),
            json!({"argv": ["echo", "x"]}),
        )
        .await;
    expect_error(r, 404, "sandbox_not_found").await;
    let r = s
        .client
        .delete(s.url(&format!("/v1/sandboxes/{a}")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = s.get(ALICE, &format!("/v1/sandboxes/{a}")).await;
    expect_error(r, 404, "sandbox_not_found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_table_is_served() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    s.post(
        ALICE,
        &format!("/v1/sandboxes/{a}/write"),
        json!({"path": "f", "content": "x"}),
    )
    .await;
    for spec in route_specs() {
        let body = match spec.operation_id {
            "create_sandbox" => json!({"workspace": s.ws()}),
            "renew_lease" => json!({"ttl_secs": 60}),
            "exec" => json!({"argv": ["true"]}),
            "read" | "stat" => json!({"path": "f"}),
            "write" => json!({"path": "g", "content": ""}),
            "edit" => json!({"path": "f", "old": "x", "new": "y"}),
            "patch" => json!({"patch": ""}),
            "search" => json!({"pattern": "x"}),
            "remove" => json!({"path": "g"}),
            "move" => json!({"from": "f", "to": "h"}),
            "create_checkpoint" | "restore" => json!({"name": "c1"}),
            "rotate_secret" => json!({"value": "v"}),
            _ => json!({}),
        };
        if spec.operation_id == "destroy_sandbox" {
            continue;
        }
        let mut path = concrete(spec.path, &a);
        match spec.operation_id {
            "upload" => path.push_str("?path=g"),
            "download" => path.push_str("?path=f"),
            _ => {}
        }
        let mut req = s
            .client
            .request(method(spec.verb), s.url(&path))
            .bearer_auth(ALICE);
        req = match spec.operation_id {
            // An empty tar: two zero blocks.
            "upload_workspace" => req.body(vec![0u8; 1024]),
            "upload" => req.body("streamed content"),
            "delete_workspace" => {
                let r = s
                    .client
                    .post(s.url("/v1/workspaces"))
                    .bearer_auth(ALICE)
                    .body(vec![0u8; 1024])
                    .send()
                    .await
                    .unwrap();
                let up: Value = r.json().await.unwrap();
                path = spec
                    .path
                    .replace("{workspace_id}", up["id"].as_str().unwrap());
                s.client.delete(s.url(&path)).bearer_auth(ALICE)
            }
            _ => req.json(&body),
        };
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let expected = match spec.operation_id {
            "edit" => 422,
            // Nothing waits for approval in the fake backend.
            "approve" | "deny" => 404,
            // The fake backend has no egress proxy, so no secrets.
            "rotate_secret" | "revoke_secret" => 400,
            _ => spec.status,
        };
        assert_eq!(
            status,
            expected,
            "{} {}: {text}",
            spec.verb.as_str(),
            spec.path
        );
    }
    let r = s
        .client
        .delete(s.url(&format!("/v1/sandboxes/{a}")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_with_the_reason() {
    let s = start(Limits::default()).await;
    let r = s
        .client
        .post(s.url("/v1/sandboxes"))
        .bearer_auth(ALICE)
        .body("{\"workspace\": ")
        .send()
        .await
        .unwrap();
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("invalid request body"), "{m}");

    let r = s
        .create(ALICE, json!({"workspace": s.ws(), "bogus": 1}))
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("unknown field `bogus`"), "{m}");

    let r = s.create(ALICE, json!({"workspace": 7})).await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("invalid type"), "{m}");

    let r = s
        .create(
            ALICE,
            json!({"workspace": s.ws(), "labels": {"taskbox.tenant": "bob"}}),
        )
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("reserved"), "{m}");

    let r = s
        .create(ALICE, json!({"workspace": s.ws(), "ttl_secs": 0}))
        .await;
    expect_error(r, 400, "invalid_argument").await;

    // Policies come as profile names or inline text: a path on the supervisor's host is never
    // opened (a device would grow its memory, a FIFO block the create, a parse error quote a
    // host file), and the refusal is the same whatever is there.
    for path in ["/dev/zero", "/etc/shadow", "/nonexistent/p.toml", "p.toml"] {
        let r = s
            .create(ALICE, json!({"workspace": s.ws(), "policy": path}))
            .await;
        let m = expect_error(r, 400, "invalid_argument").await;
        assert!(
            m.contains("looks like a path") && m.contains("policy_toml"),
            "{m}"
        );
        assert!(!m.contains("root:"), "{m}");
    }
    let r = s
        .create(
            ALICE,
            json!({"workspace": s.ws(), "policy": "no-such-profile"}),
        )
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("unknown policy") && m.contains("default"), "{m}");
    let r = s
        .create(
            ALICE,
            json!({"workspace": s.ws(), "policy_toml": "[limits]\nmemory = \"lots\"\n"}),
        )
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(
        m.contains("inline policy") && m.contains("limits.memory"),
        "{m}"
    );
    let big = format!("description = \"{}\"\n", "x".repeat(300 * 1024));
    let r = s
        .create(ALICE, json!({"workspace": s.ws(), "policy_toml": big}))
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("at most 262144 bytes"), "{m}");
    assert_eq!(
        s.backend
            .calls()
            .iter()
            .filter(|c| c.starts_with("create"))
            .count(),
        0,
        "a create with a refused policy reached the backend"
    );

    let r = s.get(ALICE, "/v1/sandboxes/NOT_AN_ID").await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("invalid sandbox id"), "{m}");

    let a = s.sandbox(ALICE).await;
    let r = s
        .get(ALICE, &format!("/v1/sandboxes/{a}/processes/x1"))
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("invalid exec id"), "{m}");

    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/processes/1/wait?timeout_ms=soon"),
            json!({}),
        )
        .await;
    expect_error(r, 400, "invalid_argument").await;

    let r = s
        .post(ALICE, &format!("/v1/sandboxes/{a}/exec"), json!({}))
        .await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("argv or shell"), "{m}");

    let r = s.get(ALICE, "/v2/nothing").await;
    expect_error(r, 404, "not_found").await;
    let r = s
        .client
        .put(s.url("/v1/sandboxes"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    expect_error(r, 405, "method_not_allowed").await;

    // A backend error keeps its code and status.
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/edit"),
            json!({"path": "f", "old": "x", "new": "y"}),
        )
        .await;
    expect_error(r, 422, "edit_not_found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_bad_input_is_echoed_in_part_only() {
    let s = start(Limits::default()).await;
    let huge = "x".repeat(10_000);
    let a = s.sandbox(ALICE).await;
    for (path, len) in [
        (format!("/v1/sandboxes/{huge}"), 10_000),
        (format!("/v1/sandboxes/{a}/processes/{huge}"), 10_000),
        (format!("/v1/{huge}"), 10_004),
    ] {
        let r = s.get(ALICE, &path).await;
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert!(status == 400 || status == 404, "{status} {text}");
        assert!(text.len() < 400, "{} bytes echoed: {text}", text.len());
        assert!(text.contains(&format!("({len} bytes)")), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_413() {
    let s = start(Limits {
        max_body_bytes: 1024,
        ..Limits::default()
    })
    .await;
    let a = s.sandbox(ALICE).await;
    let big = "x".repeat(4096);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/write"),
            json!({"path": "f", "content": big}),
        )
        .await;
    let m = expect_error(r, 413, "too_large").await;
    // It names the limit, the flag that sets it, and the way around it.
    assert!(m.contains("1024") && m.contains("max_body_bytes"), "{m}");
    assert!(
        m.contains("--max-body-bytes") && m.contains("/files"),
        "{m}"
    );
    // Just under the limit is fine.
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/write"),
            json!({"path": "f", "content": "x".repeat(900)}),
        )
        .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_streams_past_the_body_limit_up_to_the_upload_limit() {
    let s = start(Limits {
        max_body_bytes: 1024,
        max_upload_bytes: 8192,
        ..Limits::default()
    })
    .await;
    let a = s.sandbox(ALICE).await;
    let files = |q: &str| s.url(&format!("/v1/sandboxes/{a}/files?{q}"));
    // Over the JSON body limit, under the upload limit: written.
    let content = "y".repeat(4096);
    let r = s
        .client
        .put(files("path=big.txt"))
        .bearer_auth(ALICE)
        .body(content.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let w: Value = r.json().await.unwrap();
    assert_eq!(w["bytes_written"], 4096);
    // And read back whole, with its length announced.
    let r = s
        .client
        .get(files("path=big.txt"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-length"], "4096");
    assert_eq!(r.headers()["content-type"], "application/octet-stream");
    assert_eq!(r.text().await.unwrap(), content);
    // A missing file is a JSON error, before any byte.
    let r = s
        .client
        .get(files("path=nope"))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "not_found").await;
    let r = s
        .client
        .get(files(""))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("path"), "{m}");
    // Over the upload limit: refused before the body is read when its length says so...
    let r = s
        .client
        .put(files("path=huge.txt"))
        .bearer_auth(ALICE)
        .body("z".repeat(10_000))
        .send()
        .await
        .unwrap();
    let m = expect_error(r, 413, "too_large").await;
    assert!(
        m.contains("8192") && m.contains("--max-upload-bytes"),
        "{m}"
    );
    // ... and cut when a body without a length runs past it.
    let pieces = futures_util::stream::iter(
        (0..10).map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'z'; 1000]))),
    );
    let r = s
        .client
        .put(files("path=huge.txt"))
        .bearer_auth(ALICE)
        .body(reqwest::Body::wrap_stream(pieces))
        .send()
        .await
        .unwrap();
    let m = expect_error(r, 413, "too_large").await;
    assert!(m.contains("max_upload_bytes"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_quotas_are_429_naming_the_limit() {
    let s = start(Limits {
        max_sandboxes_per_tenant: 2,
        max_sandboxes_total: 3,
        ..Limits::default()
    })
    .await;
    s.sandbox(ALICE).await;
    let a2 = s.sandbox(ALICE).await;
    let r = s.create(ALICE, json!({"workspace": s.ws()})).await;
    let m = expect_error(r, 429, "limit_exceeded").await;
    assert!(
        m.contains("max_sandboxes_per_tenant") && m.contains('2'),
        "{m}"
    );

    s.sandbox(BOB).await;
    let r = s.create(BOB, json!({"workspace": s.ws()})).await;
    let m = expect_error(r, 429, "limit_exceeded").await;
    assert!(m.contains("max_sandboxes_total") && m.contains('3'), "{m}");

    // Destroying one frees a place.
    let r = s
        .client
        .delete(s.url(&format!("/v1/sandboxes/{a2}")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    s.sandbox(BOB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exec_quotas_count_requests_in_flight_including_streams() {
    let s = start(Limits {
        max_execs_per_tenant: 1,
        max_execs_total: 2,
        ..Limits::default()
    })
    .await;
    let a = s.sandbox(ALICE).await;
    let b = s.sandbox(BOB).await;
    let exec = |token: &'static str, id: String, ms: u64, sse: bool| {
        let client = s.client.clone();
        let url = s.url(&format!("/v1/sandboxes/{id}/exec"));
        async move {
            let mut rq = client
                .post(url)
                .bearer_auth(token)
                .json(&json!({"argv": ["sleep", ms.to_string()]}));
            if sse {
                rq = rq.header("accept", "text/event-stream");
            }
            let r = rq.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };

    // A plain exec holds alice's one place while it runs.
    let held = tokio::spawn(exec(ALICE, a.clone(), 800, false));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, text) = exec(ALICE, a.clone(), 1, false).await;
    assert_eq!(status, 429, "{text}");
    assert!(
        text.contains("max_execs_per_tenant") && text.contains("limit of 1"),
        "{text}"
    );
    // Bob has his own place; then the total (2) is reached for a third tenant-free slot.
    let bob_held = tokio::spawn(exec(BOB, b.clone(), 800, true));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, text) = exec(BOB, b.clone(), 1, false).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(held.await.unwrap().0, 200);
    let (status, text) = bob_held.await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("event: ended"), "{text}");
    // Both places are free again.
    assert_eq!(exec(ALICE, a.clone(), 1, false).await.0, 200);
    assert_eq!(exec(BOB, b.clone(), 1, true).await.0, 200);

    // The total: with bob's stream holding one place and alice's exec the other, a third waits.
    let s2 = start(Limits {
        max_execs_per_tenant: 5,
        max_execs_total: 1,
        ..Limits::default()
    })
    .await;
    let a = s2.sandbox(ALICE).await;
    let b = s2.sandbox(BOB).await;
    let url = s2.url(&format!("/v1/sandboxes/{a}/exec"));
    let client = s2.client.clone();
    let held = tokio::spawn(async move {
        client
            .post(url)
            .bearer_auth(ALICE)
            .header("accept", "text/event-stream")
            .json(&json!({"argv": ["sleep", "600"]}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = s2
        .post(
            BOB,
            &format!("/v1/sandboxes/{b}/exec"),
            json!({"argv": ["true"]}),
        )
        .await;
    let m = expect_error(r, 429, "limit_exceeded").await;
    assert!(
        m.contains("max_execs_total") && m.contains("limit of 1"),
        "{m}"
    );
    assert!(held.await.unwrap().contains("event: ended"));
}

/// Splits an SSE body into (event, data) pairs.
fn sse_frames(body: &str) -> Vec<(String, String)> {
    body.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .filter_map(|frame| {
            let mut event = None;
            let mut data = Vec::new();
            for line in frame.lines() {
                if let Some(e) = line
                    .strip_prefix("event: ")
                    .or_else(|| line.strip_prefix("event:"))
                {
                    event = Some(e.to_string());
                } else if let Some(d) = line
                    .strip_prefix("data: ")
                    .or_else(|| line.strip_prefix("data:"))
                {
                    data.push(d.to_string());
                }
            }
            // Keep-alive comments have neither.
            event.map(|e| (e, data.join("\n")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_server_sent_events() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    let r = s
        .client
        .post(s.url(&format!("/v1/sandboxes/{a}/exec")))
        .bearer_auth(ALICE)
        .header("accept", "text/event-stream")
        .json(&json!({"argv": ["echo", "one", "two"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"),
        "{:?}",
        r.headers()
    );
    let body = r.text().await.unwrap();
    let frames = sse_frames(&body);
    let names: Vec<&str> = frames.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names,
        ["started", "stdout", "stdout", "stderr", "ended"],
        "{body}"
    );
    for (event, data) in &frames {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], event.as_str(), "{data}");
        let _: taskbox_core::api::ExecEvent = serde_json::from_str(data).unwrap();
    }
    let stdout: Vec<Value> = frames
        .iter()
        .filter(|(e, _)| e == "stdout")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(stdout[0]["data"], "one\n");
    assert_eq!(stdout[1]["data"], "two\n");
    let ended: Value = serde_json::from_str(&frames[4].1).unwrap();
    assert_eq!(ended["result"]["exit_code"], 0);
    assert_eq!(ended["result"]["stdout"]["text"], "one\ntwo\n");

    // Without the Accept header: one JSON ExecResult.
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/exec"),
            json!({"argv": ["echo", "one"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["stdout"]["text"], "one\n");

    // A command that fails before it starts is a plain JSON error even when streaming.
    let r = s
        .client
        .post(s.url(&format!("/v1/sandboxes/{a}/exec")))
        .bearer_auth(ALICE)
        .header("accept", "text/event-stream")
        .json(&json!({"argv": ["false-start"]}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, "invalid_argument").await;

    // A background exec answers its process handle as JSON.
    let r = s
        .client
        .post(s.url(&format!("/v1/sandboxes/{a}/exec")))
        .bearer_auth(ALICE)
        .header("accept", "text/event-stream")
        .json(&json!({"argv": ["sleep", "1"], "background": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["exec_id"], 7);
    assert_eq!(v["running"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_routes_reach_the_backend() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/processes/3/wait?timeout_ms=5"),
            json!(null),
        )
        .await;
    assert_eq!(r.status(), 200);
    let r = s
        .client
        .post(s.url(&format!(
            "/v1/sandboxes/{a}/processes/3/wait?timeout_ms=99999999"
        )))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/processes/3/kill"),
            json!({}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/processes/3/kill"),
            json!({"signal": 15}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/processes/3/stdin"),
            json!({"data": "hi", "close": true}),
        )
        .await;
    assert_eq!(r.status(), 204);
    let calls = s.backend.calls();
    for want in [
        format!("wait {a} 3 5ms"),
        format!("wait {a} 3 300000ms"),
        format!("kill {a} 3 9"),
        format!("kill {a} 3 15"),
        format!("stdin {a} 3 hi true"),
    ] {
        assert!(calls.contains(&want), "{want} not in {calls:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_routes_round_trip() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/write"),
            json!({"path": "src/x.rs", "content": "fn x() {}\n"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"path": "src/x.rs", "bytes_written": 10, "created": true})
    );
    let v: Value = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/read"),
            json!({"path": "src/x.rs"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["content"], "fn x() {}\n");
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/read"),
            json!({"path": "nope"}),
        )
        .await;
    expect_error(r, 404, "not_found").await;
    // An empty body reads as {} for routes whose fields are all optional.
    let r = s
        .client
        .post(s.url(&format!("/v1/sandboxes/{a}/diff")))
        .bearer_auth(ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/checkpoints"),
            json!({"name": "c1"}),
        )
        .await;
    assert_eq!(r.status(), 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_capped_renewed_and_reaped() {
    let s = start(Limits {
        default_ttl: Some(Duration::from_secs(600)),
        max_ttl: Some(Duration::from_secs(3600)),
        ..Limits::default()
    })
    .await;
    let reaper = tokio::spawn(s.state.clone().run_reaper(Duration::from_millis(100)));

    let now = taskbox_server::state::now_ms();
    let v: Value = s
        .create(ALICE, json!({"workspace": s.ws()}))
        .await
        .json()
        .await
        .unwrap();
    let exp = v["expires_at_ms"].as_u64().unwrap();
    assert!(
        exp >= now + 599_000 && exp <= now + 601_000 + 5_000,
        "{exp} vs {now}"
    );

    let v: Value = s
        .create(ALICE, json!({"workspace": s.ws(), "ttl_secs": 1_000_000}))
        .await
        .json()
        .await
        .unwrap();
    let exp = v["expires_at_ms"].as_u64().unwrap();
    assert!(exp <= now + 3_600_000 + 5_000, "capped by max_ttl: {exp}");
    assert!(
        s.backend
            .calls()
            .contains(&"create ttl=Some(3600)".to_string()),
        "{:?}",
        s.backend.calls()
    );

    let short: Value = s
        .create(ALICE, json!({"workspace": s.ws(), "ttl_secs": 1}))
        .await
        .json()
        .await
        .unwrap();
    let short = short["id"].as_str().unwrap().to_string();
    let renewed: Value = s
        .create(ALICE, json!({"workspace": s.ws(), "ttl_secs": 1}))
        .await
        .json()
        .await
        .unwrap();
    let renewed = renewed["id"].as_str().unwrap().to_string();
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{renewed}/renew"),
            json!({"ttl_secs": 120}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["expires_at_ms"].as_u64().unwrap() >= now + 119_000);
    let r = s
        .post(
            BOB,
            &format!("/v1/sandboxes/{renewed}/renew"),
            json!({"ttl_secs": 1}),
        )
        .await;
    expect_error(r, 404, "sandbox_not_found").await;

    tokio::time::sleep(Duration::from_millis(1600)).await;
    let r = s.get(ALICE, &format!("/v1/sandboxes/{short}")).await;
    expect_error(r, 404, "sandbox_not_found").await;
    assert!(
        !s.backend
            .exists(&taskbox_core::api::SandboxId::parse(&short).unwrap())
    );
    assert!(s.backend.calls().contains(&format!("destroy {short}")));
    let r = s.get(ALICE, &format!("/v1/sandboxes/{renewed}")).await;
    assert_eq!(r.status(), 200);
    let listed: Value = s.get(ALICE, "/v1/sandboxes").await.json().await.unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 3);
    reaper.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_and_leases_are_rebuilt_from_the_backend() {
    use std::sync::Arc;
    use taskbox_server::{AppState, Auth};
    let backend = FakeBackend::default();
    let alices = backend.preload(&[("taskbox.tenant", "alice")], Some(u64::MAX / 2));
    let unlabeled = backend.preload(&[], None);
    let dir = tempfile::tempdir().unwrap();
    let lease_file = dir.path().join("server/leases.json");
    std::fs::create_dir_all(lease_file.parent().unwrap()).unwrap();
    std::fs::write(&lease_file, format!("{{\"{alices}\": 4102444800000}}")).unwrap();
    let b = backend.clone();
    let lf = lease_file.clone();
    let state = tokio::task::spawn_blocking(move || {
        AppState::builder(Arc::new(b))
            .auth(Auth::Tokens(tokens()))
            .lease_file(lf)
            // Without a hard lifetime, which would cut the saved lease (see native.rs).
            .limits(Limits {
                max_lifetime: None,
                ..Limits::default()
            })
            .build()
            .unwrap()
    })
    .await
    .unwrap();
    let s = serve_state(state, backend).await;
    let v: Value = s
        .get(ALICE, &format!("/v1/sandboxes/{alices}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["expires_at_ms"], 4102444800000u64, "the saved lease wins");
    let r = s.get(BOB, &format!("/v1/sandboxes/{alices}")).await;
    expect_error(r, 404, "sandbox_not_found").await;
    let r = s.get(ALICE, &format!("/v1/sandboxes/{unlabeled}")).await;
    expect_error(r, 404, "sandbox_not_found").await;
    assert_eq!(s.state.live_per_tenant().get("local"), Some(&1));

    // Renewals are saved.
    s.post(
        ALICE,
        &format!("/v1/sandboxes/{alices}/renew"),
        json!({"ttl_secs": 50}),
    )
    .await;
    let saved: Value = serde_json::from_slice(&std::fs::read(&lease_file).unwrap()).unwrap();
    assert!(saved[alices.as_str()].as_u64().unwrap() < 4102444800000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_lists_every_route_and_every_schema_resolves() {
    let s = start(Limits::default()).await;
    let doc: Value = s
        .client
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let specs = route_specs();
    for spec in &specs {
        let op = &doc["paths"][spec.path][spec.verb.as_str()];
        assert!(
            op.is_object(),
            "{} {} missing",
            spec.verb.as_str(),
            spec.path
        );
        assert_eq!(op["operationId"], spec.operation_id);
        if spec.request.is_some() {
            assert!(
                op["requestBody"]["content"]["application/json"]["schema"].is_object(),
                "{} request schema",
                spec.path
            );
        }
        let ok = &op["responses"][spec.status.to_string()];
        assert!(ok.is_object(), "{} {} response", spec.path, spec.status);
        assert!(op["responses"]["default"]["content"]["application/json"]["schema"].is_object());
        for p in spec.path_params() {
            let params = op["parameters"].as_array().unwrap();
            assert!(
                params.iter().any(|x| x["name"] == p && x["in"] == "path"),
                "{p} of {}",
                spec.path
            );
        }
        assert_eq!(op["security"].as_array().unwrap().is_empty(), !spec.auth);
    }
    let n_ops: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|item| item.as_object().unwrap().len())
        .sum();
    assert_eq!(
        n_ops,
        specs.len(),
        "the document has exactly the table's routes"
    );
    for want in [
        "CreateRequest",
        "SandboxInfo",
        "ExecRequest",
        "ExecOutcome",
        "ExecEvent",
        "ErrorBody",
        "ReadResult",
    ] {
        assert!(
            doc["components"]["schemas"][want].is_object(),
            "{want} missing"
        );
    }

    // What a reviewer sees: the fields of diff, export and exec results, in the document.
    let schemas = &doc["components"]["schemas"];
    for (schema, field) in [
        ("DiffRequest", "include_ignored"),
        ("DiffResult", "ignored"),
        ("DiffResult", "flagged"),
        ("FileDiff", "ignored"),
        ("ExportRequest", "include_ignored"),
        ("ExportRequest", "allow_autorun"),
        ("ExportResult", "ignored"),
        ("ExportResult", "flagged"),
        ("ExecResult", "ignored_changes"),
        ("AutorunFile", "reason"),
    ] {
        assert!(
            schemas[schema]["properties"][field].is_object(),
            "{schema}.{field} missing: {}",
            schemas[schema]
        );
    }

    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if k == "$ref" {
                        out.push(x.as_str().unwrap().to_string());
                    } else {
                        refs(x, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(all.len() > 20, "{all:?}");
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("ref outside components: {r}"));
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "{r} does not resolve"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    s.sandbox(BOB).await;
    s.post(
        ALICE,
        &format!("/v1/sandboxes/{a}/exec"),
        json!({"argv": ["violate", "network"]}),
    )
    .await;
    s.post(
        ALICE,
        &format!("/v1/sandboxes/{a}/exec"),
        json!({"argv": ["echo", "x"]}),
    )
    .await;
    s.client.get(s.url("/v1/sandboxes")).send().await.unwrap();
    let r = s.get(BOB, "/metrics").await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = r.text().await.unwrap();

    let mut typed = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            typed.insert(name.to_string(), kind.to_string());
        } else if line.starts_with("# HELP ") {
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap();
            value
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("value of {line}"));
            let name = series.split('{').next().unwrap();
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suf| {
                    name.strip_suffix(suf)
                        .filter(|b| typed.get(*b).map(String::as_str) == Some("histogram"))
                })
                .unwrap_or(name);
            assert!(typed.contains_key(base), "{line}: no TYPE before it");
        }
    }
    for (name, kind) in [
        ("taskbox_sandboxes_live", "gauge"),
        ("taskbox_execs_total", "counter"),
        ("taskbox_exec_duration_seconds", "histogram"),
        ("taskbox_http_requests_total", "counter"),
        ("taskbox_violations_total", "counter"),
        ("taskbox_errors_total", "counter"),
    ] {
        assert_eq!(typed.get(name).map(String::as_str), Some(kind), "{name}");
        assert!(text.contains(&format!("# HELP {name} ")), "{name} help");
    }
    assert!(
        text.contains("taskbox_sandboxes_live{tenant=\"alice\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("taskbox_sandboxes_live{tenant=\"bob\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("taskbox_execs_total 2\n"), "{text}");
    assert!(
        text.contains("taskbox_violations_total{kind=\"network\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("taskbox_errors_total{code=\"unauthorized\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "taskbox_http_requests_total{route=\"/v1/sandboxes/{id}/exec\",status=\"200\"} 2\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("taskbox_http_requests_total{route=\"/v1/sandboxes\",status=\"201\"} 2\n"),
        "{text}"
    );
    let buckets: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with("taskbox_exec_duration_seconds_bucket"))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert!(
        buckets.windows(2).all(|w| w[0] <= w[1]),
        "cumulative: {buckets:?}"
    );
    assert_eq!(*buckets.last().unwrap(), 2);
    assert!(text.contains("le=\"+Inf\"} 2\n"));
    assert!(text.contains("taskbox_exec_duration_seconds_count 2\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_left_keeps_its_place_until_the_command_ends() {
    let s = start(Limits {
        max_execs_per_tenant: 1,
        ..Limits::default()
    })
    .await;
    let a = s.sandbox(ALICE).await;
    let mut r = s
        .client
        .post(s.url(&format!("/v1/sandboxes/{a}/exec")))
        .bearer_auth(ALICE)
        .header("accept", "text/event-stream")
        .json(&json!({"argv": ["sleep", "900"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("event: started"));
    drop(r);
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/exec"),
            json!({"argv": ["true"]}),
        )
        .await;
    expect_error(r, 429, "limit_exceeded").await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let r = s
        .post(
            ALICE,
            &format!("/v1/sandboxes/{a}/exec"),
            json!({"argv": ["true"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
}
