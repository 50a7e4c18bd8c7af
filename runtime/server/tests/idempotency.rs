//! `Idempotency-Key` on create and on an applying export, over a real TCP socket with a real
//! client, against the recording `FakeBackend` (tests/common), which counts what reaches the
//! backend. `native.rs` checks an apply on a real host workspace.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use taskbox_server::Limits;

const KEY: &str = "idempotency-key";
const REPLAYED: &str = "idempotent-replayed";

/// An answer's status, whether it says it was replayed, and its JSON body.
async fn read(r: reqwest::Response) -> (u16, bool, Value) {
    let status = r.status().as_u16();
    let replayed = match r.headers().get(REPLAYED) {
        None => false,
        Some(v) => {
            assert_eq!(v, "true", "the replay header is true or absent");
            true
        }
    };
    let text = r.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, replayed, body)
}

impl TestServer {
    async fn create_keyed(&self, token: &str, key: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url("/v1/sandboxes"))
            .bearer_auth(token)
            .header(KEY, key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    async fn export_keyed(
        &self,
        token: &str,
        id: &str,
        key: &str,
        body: Value,
    ) -> reqwest::Response {
        self.client
            .post(self.url(&format!("/v1/sandboxes/{id}/export")))
            .bearer_auth(token)
            .header(KEY, key)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// The ids of the tenant's sandboxes, as it lists them.
    async fn ids(&self, token: &str) -> BTreeSet<String> {
        let v: Value = self.get(token, "/v1/sandboxes").await.json().await.unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap().to_string())
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_create_with_a_key_makes_one_sandbox_and_gets_its_answer_again() {
    let s = start(Limits::default()).await;
    let body = json!({"workspace": s.ws(), "labels": {"b": "2", "a": "1"}});
    let (status, replayed, first) = read(s.create_keyed(ALICE, "k-1", &body).await).await;
    assert_eq!((status, replayed), (201, false), "{first}");

    // The same request, spelled otherwise: fields reordered, spacing, a default made explicit,
    // and the key in the draft's quoted form.
    let respelled = format!(
        r#"{{ "labels": {{"a": "1", "b": "2"}}, "env": {{}},  "workspace": {:?} }}"#,
        s.ws()
    );
    let r = s
        .client
        .post(s.url("/v1/sandboxes"))
        .bearer_auth(ALICE)
        .header(KEY, "\"k-1\"")
        .body(respelled)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "application/json");
    let (status, replayed, again) = read(r).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, first, "the first answer, as it was");

    assert_eq!(s.backend.count("create"), 1, "{:?}", s.backend.calls());
    let id = first["id"].as_str().unwrap();
    assert_eq!(s.ids(ALICE).await, BTreeSet::from([id.to_string()]));

    // A new key is a new sandbox.
    let (status, replayed, other) = read(s.create_keyed(ALICE, "k-2", &body).await).await;
    assert_eq!((status, replayed), (201, false));
    assert_ne!(other["id"], first["id"]);
    assert_eq!(s.ids(ALICE).await.len(), 2);

    let metrics = s.get(ALICE, "/metrics").await.text().await.unwrap();
    assert!(
        metrics.contains("taskbox_idempotent_replays_total{operation=\"create_sandbox\"} 1\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_creates_with_one_key_make_one_sandbox_and_all_get_it() {
    let s = start(Limits::default()).await;
    // Long enough that all sixteen arrive while the first still runs.
    s.backend.set_create_delay(Duration::from_millis(500));
    let body = json!({"workspace": s.ws()});
    let answers = futures_util::future::join_all(
        (0..16).map(|_| async { read(s.create_keyed(ALICE, "together", &body).await).await }),
    )
    .await;
    let ids: BTreeSet<String> = answers
        .iter()
        .map(|(_, _, b)| b["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 1, "one sandbox for all: {answers:?}");
    assert!(
        answers.iter().all(|(status, _, _)| *status == 201),
        "{answers:?}"
    );
    let fresh = answers.iter().filter(|(_, replayed, _)| !replayed).count();
    assert_eq!(fresh, 1, "exactly one answer is not a replay: {answers:?}");
    assert_eq!(s.backend.count("create"), 1, "{:?}", s.backend.calls());
    assert_eq!(s.ids(ALICE).await, ids, "the one sandbox listed is theirs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_request_is_422_and_does_nothing() {
    let s = start(Limits::default()).await;
    let (status, _, first) = read(
        s.create_keyed(ALICE, "k", &json!({"workspace": s.ws()}))
            .await,
    )
    .await;
    assert_eq!(status, 201);
    s.backend.clear_calls();

    let r = s
        .create_keyed(ALICE, "k", &json!({"workspace": s.ws(), "ttl_secs": 60}))
        .await;
    let m = expect_error(r, 422, "idempotency_key_reused").await;
    assert!(m.contains("\"k\"") && m.contains("another request"), "{m}");
    // Another operation with the key is another request too.
    let id = first["id"].as_str().unwrap();
    let r = s.export_keyed(ALICE, id, "k", json!({"apply": true})).await;
    expect_error(r, 422, "idempotency_key_reused").await;
    assert!(
        s.backend.calls().iter().all(|c| c == "list"),
        "{:?}",
        s.backend.calls()
    );
    assert_eq!(s.ids(ALICE).await.len(), 1);

    // The first request still gets its answer.
    let (status, replayed, again) = read(
        s.create_keyed(ALICE, "k", &json!({"workspace": s.ws()}))
            .await,
    )
    .await;
    assert_eq!((status, replayed, &again["id"]), (201, true, &first["id"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_with_the_same_key_gets_a_sandbox_of_its_own() {
    let s = start(Limits::default()).await;
    let body = json!({"workspace": s.ws()});
    let (_, _, alice) = read(s.create_keyed(ALICE, "shared", &body).await).await;
    let (status, replayed, bob) = read(s.create_keyed(BOB, "shared", &body).await).await;
    assert_eq!((status, replayed), (201, false), "{bob}");
    assert_ne!(alice["id"], bob["id"]);
    assert_eq!(bob["labels"]["taskbox.tenant"], "bob");
    // Bob's key does not collide with Alice's even with another body.
    let r = s
        .create_keyed(BOB, "shared", &json!({"workspace": s.ws(), "ttl_secs": 5}))
        .await;
    expect_error(r, 422, "idempotency_key_reused").await;
    let (_, replayed, alice_again) = read(s.create_keyed(ALICE, "shared", &body).await).await;
    assert!(replayed);
    assert_eq!(alice_again["id"], alice["id"]);
    assert_eq!(s.ids(ALICE).await.len(), 1);
    assert_eq!(s.ids(BOB).await.len(), 1);
    assert_eq!(s.backend.count("create"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_is_400_naming_the_header() {
    let s = start(Limits::default()).await;
    let body = json!({"workspace": s.ws()});
    let long = "k".repeat(256);
    let bad: Vec<(&str, Vec<&[u8]>)> = vec![
        ("empty", vec![b""]),
        ("256 bytes", vec![long.as_bytes()]),
        ("not ASCII", vec!["caf\u{e9}".as_bytes()]),
        ("a bad escape", vec![br#""a\nb""#]),
        ("two keys", vec![b"a", b"b"]),
    ];
    for (what, values) in bad {
        let mut req = s
            .client
            .post(s.url("/v1/sandboxes"))
            .bearer_auth(ALICE)
            .json(&body);
        for v in values {
            req = req.header(KEY, reqwest::header::HeaderValue::from_bytes(v).unwrap());
        }
        let m = expect_error(req.send().await.unwrap(), 400, "invalid_argument").await;
        assert!(m.contains("Idempotency-Key"), "{what}: {m}");
    }
    // The longest key is fine.
    let ok = "k".repeat(255);
    let (status, _, _) = read(s.create_keyed(ALICE, &ok, &body).await).await;
    assert_eq!(status, 201);
    assert_eq!(s.backend.count("create"), 1, "{:?}", s.backend.calls());
    // On the export route as well, even where the key would not be kept.
    let id = s.ids(ALICE).await.pop_first().unwrap();
    let r = s.export_keyed(ALICE, &id, "", json!({})).await;
    let m = expect_error(r, 400, "invalid_argument").await;
    assert!(m.contains("Idempotency-Key"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_leaves_its_key_free_for_the_retry() {
    let s = start(Limits::default()).await;
    let body = json!({"workspace": s.ws()});
    s.backend.fail_next_create("the daemon is restarting");
    let r = s.create_keyed(ALICE, "retry-me", &body).await;
    assert!(r.headers().get(REPLAYED).is_none());
    let m = expect_error(r, 503, "unavailable").await;
    assert!(m.contains("restarting"), "{m}");
    assert!(s.ids(ALICE).await.is_empty());

    let (status, replayed, made) = read(s.create_keyed(ALICE, "retry-me", &body).await).await;
    assert_eq!((status, replayed), (201, false), "the retry runs: {made}");
    let (status, replayed, again) = read(s.create_keyed(ALICE, "retry-me", &body).await).await;
    assert_eq!((status, replayed, &again["id"]), (201, true, &made["id"]));
    assert_eq!(s.backend.count("create"), 2);
    assert_eq!(s.ids(ALICE).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_client_went_away_is_finished_and_given_to_its_retry() {
    let s = start(Limits::default()).await;
    s.backend.set_create_delay(Duration::from_millis(600));
    let body = json!({"workspace": s.ws()});
    let gone = s
        .client
        .post(s.url("/v1/sandboxes"))
        .bearer_auth(ALICE)
        .header(KEY, "impatient")
        .json(&body)
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up first: {gone:?}");
    // The retry finds the first attempt running (or done) and gets its sandbox.
    let (status, replayed, made) = read(s.create_keyed(ALICE, "impatient", &body).await).await;
    assert_eq!((status, replayed), (201, true), "{made}");
    assert_eq!(s.backend.count("create"), 1);
    assert_eq!(
        s.ids(ALICE).await,
        BTreeSet::from([made["id"].as_str().unwrap().to_string()])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_apply_with_a_key_reaches_the_backend_once() {
    let s = start(Limits::default()).await;
    let a = s.sandbox(ALICE).await;
    let b = s.sandbox(ALICE).await;
    s.backend.clear_calls();

    let (status, replayed, first) = read(
        s.export_keyed(ALICE, &a, "apply-1", json!({"apply": true}))
            .await,
    )
    .await;
    assert_eq!(
        (status, replayed, &first["applied"]),
        (200, false, &json!(true))
    );
    let (status, replayed, again) = read(
        s.export_keyed(
            ALICE,
            &a,
            "apply-1",
            json!({"format": "patch", "apply": true}),
        )
        .await,
    )
    .await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(again, first);
    assert_eq!(s.backend.count("export"), 1, "{:?}", s.backend.calls());

    // The key names an apply of sandbox a: on sandbox b it is another request.
    let r = s
        .export_keyed(ALICE, &b, "apply-1", json!({"apply": true}))
        .await;
    expect_error(r, 422, "idempotency_key_reused").await;
    // Bob cannot reach Alice's sandbox with her key (404 first, as without one).
    let r = s
        .export_keyed(BOB, &a, "apply-1", json!({"apply": true}))
        .await;
    expect_error(r, 404, "sandbox_not_found").await;
    assert_eq!(s.backend.count("export"), 1);

    // Without apply nothing is kept: each export runs.
    for _ in 0..2 {
        let (status, replayed, _) = read(s.export_keyed(ALICE, &a, "look", json!({})).await).await;
        assert_eq!((status, replayed), (200, false));
    }
    assert_eq!(s.backend.count("export"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_shows_the_header_on_the_two_routes_only() {
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
    let mut keyed = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (verb, op) in item.as_object().unwrap() {
            let params = op["parameters"].as_array().cloned().unwrap_or_default();
            let header: Vec<&Value> = params
                .iter()
                .filter(|p| p["in"] == "header" && p["name"] == "Idempotency-Key")
                .collect();
            if header.is_empty() {
                continue;
            }
            assert_eq!(header[0]["required"], false);
            assert_eq!(header[0]["schema"]["maxLength"], 255);
            let ok = op["responses"]
                .as_object()
                .unwrap()
                .iter()
                .find(|(status, _)| status.starts_with('2'))
                .unwrap()
                .1;
            assert!(
                ok["headers"]["Idempotent-Replayed"].is_object(),
                "{verb} {path}: {ok}"
            );
            keyed.insert(format!("{verb} {path}"));
        }
    }
    assert_eq!(
        keyed,
        BTreeSet::from([
            "post /v1/sandboxes".to_string(),
            "post /v1/sandboxes/{id}/export".to_string()
        ])
    );
    let codes = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["x-codes"]
        .as_array()
        .unwrap();
    assert!(
        codes
            .iter()
            .any(|c| c["code"] == "idempotency_key_reused" && c["status"] == 422),
        "{codes:?}"
    );
}
