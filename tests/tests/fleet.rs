//! Fleet limits of `taskbox serve` on real native sandboxes: a burst of creates from many
//! clients never passes the live, starting or per-tenant limits (sampled from `/metrics`, the
//! sandbox table and the host while it runs), every refusal is an immediate 429 with
//! `Retry-After`, and everything made is gone at the end; the creation rate refuses past its
//! burst and lets through again when `Retry-After` says; no renew passes a sandbox's hard
//! lifetime; a destroy whose client hangs up mid-request completes; the warm pool of forks
//! counts in the total and in no tenant's, gives its places back when tenants need them, is
//! never listed, and leaves nothing on the host.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taskbox_agent::http::{Client, Request, Response};
use taskbox_tests::{Env, Supervisor, host_processes_with};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";

/// One request with its headers and the time it took.
fn send(
    socket: &Path,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (Response, Duration) {
    let payload = body.map(|b| serde_json::to_vec(b).unwrap());
    let mut req = Request::new(method, path);
    req.headers = token
        .map(|t| ("Authorization", format!("Bearer {t}")))
        .into_iter()
        .collect();
    req.body = payload.as_deref();
    let t = Instant::now();
    let r = Client::unix(socket)
        .and_then(|c| c.send(&req, Duration::from_secs(120)))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r, t.elapsed())
}

fn json_of(r: &Response) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

fn tokens_file(env: &Env) -> PathBuf {
    let p = env.dir.path().join("tokens.toml");
    std::fs::write(
        &p,
        format!(
            "[[token]]\ntoken = \"{ALICE}\"\ntenant = \"alice\"\n\
             [[token]]\ntoken = \"{BOB}\"\ntenant = \"bob\"\n"
        ),
    )
    .unwrap();
    p
}

/// The sum of a gauge's series per tenant in a Prometheus text.
fn gauge(text: &str, name: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix("{tenant=\"") else {
            continue;
        };
        let (tenant, value) = rest.split_once("\"} ").unwrap();
        out.insert(tenant.to_string(), value.trim().parse().unwrap());
    }
    out
}

/// The sandboxes of this supervisor on the host: their directories under `STATE/sandboxes`.
fn host_sandboxes(state: &Path) -> usize {
    taskbox_tests::sandbox_dirs(&state.join("sandboxes")).len()
}

/// What sandboxes of `ids` left on the host: directories, cgroups, processes, mounts.
fn leftovers(env: &Env, ids: &[String]) -> Vec<String> {
    let mut left = Vec::new();
    let state = env.state();
    if host_sandboxes(&state) != 0 {
        left.push(format!("{} sandbox directories", host_sandboxes(&state)));
    }
    for id in ids {
        left.extend(taskbox_tests::host_cgroups(&format!("taskbox-sb-{id}")));
    }
    let plans = host_processes_with(&state.join("sandboxes").display().to_string());
    if !plans.is_empty() {
        left.push(format!("processes {plans:?}"));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    if mounts.contains(&state.display().to_string()) {
        left.push("a mount of the state directory".into());
    }
    left
}

#[test]
fn a_burst_of_1000_creates_from_16_clients_never_passes_a_limit() {
    let env = Env::new();
    env.write("README", "burst\n");
    let tokens = tokens_file(&env);
    let sup = Supervisor::start(
        &env,
        &[
            "--tokens",
            tokens.to_str().unwrap(),
            "--max-sandboxes",
            "64",
            "--max-sandboxes-per-tenant",
            "40",
            "--max-starting",
            "16",
            "--max-starting-per-tenant",
            "10",
        ],
    );
    let socket = sup.socket.clone();
    let state = env.state();
    let requests = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let made: Arc<Mutex<Vec<String>>> = Arc::default();

    // The samplers, as fast as each answers: /metrics; each tenant's table; the host.
    let sample_metrics = {
        let (socket, done) = (socket.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut samples, mut max_live, mut max_starting) = (0u32, 0u64, 0u64);
            let mut violations = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let (m, _) = send(&socket, Some(ALICE), "GET", "/metrics", None);
                assert_eq!(m.status, 200);
                let text = String::from_utf8_lossy(&m.body).into_owned();
                let live = gauge(&text, "taskbox_sandboxes_live");
                let starting = gauge(&text, "taskbox_sandboxes_starting");
                let (live_total, starting_total): (u64, u64) =
                    (live.values().sum(), starting.values().sum());
                if live_total + starting_total > 64 || starting_total > 16 {
                    violations.push(format!("live {live:?} starting {starting:?}"));
                }
                for tenant in ["alice", "bob"] {
                    let (l, st) = (
                        live.get(tenant).copied().unwrap_or(0),
                        starting.get(tenant).copied().unwrap_or(0),
                    );
                    if l + st > 40 || st > 10 {
                        violations.push(format!("{tenant}: live {l} starting {st}"));
                    }
                }
                max_live = max_live.max(live_total + starting_total);
                max_starting = max_starting.max(starting_total);
                samples += 1;
            }
            (samples, max_live, max_starting, violations)
        })
    };
    let sample_tables = {
        let (socket, done) = (socket.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut samples, mut max) = (0u32, 0usize);
            let mut violations = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let mut total = 0;
                for token in [ALICE, BOB] {
                    let (r, _) = send(&socket, Some(token), "GET", "/v1/sandboxes", None);
                    let n = json_of(&r).as_array().map_or(0, Vec::len);
                    if n > 40 {
                        violations.push(format!("a tenant's table has {n}"));
                    }
                    total += n;
                }
                if total > 64 {
                    violations.push(format!("the tables have {total}"));
                }
                max = max.max(total);
                samples += 1;
            }
            (samples, max, violations)
        })
    };
    let sample_host = {
        let (state, done) = (state.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut samples, mut max) = (0u32, 0usize);
            while !done.load(Ordering::SeqCst) {
                max = max.max(host_sandboxes(&state));
                samples += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (samples, max)
        })
    };

    // 16 clients, each with 4 requests in flight at once (so that more than 16 creates can be
    // asked for at a time), each keeping up to 6 sandboxes (so that more than 64 would live).
    let t0 = Instant::now();
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let (socket, requests, made) = (socket.clone(), requests.clone(), made.clone());
            let (token, ws) = (if c % 2 == 0 { ALICE } else { BOB }, env.ws());
            let mine: Arc<Mutex<Vec<String>>> = Arc::default();
            let lanes: Vec<_> = (0..4)
                .map(|_| {
                    let (socket, requests, made, mine, ws) = (
                        socket.clone(),
                        requests.clone(),
                        made.clone(),
                        mine.clone(),
                        ws.clone(),
                    );
                    std::thread::spawn(move || {
                        let mut statuses = BTreeMap::<u16, usize>::new();
                        let (mut ok_times, mut refused_times) = (Vec::new(), Vec::new());
                        let mut bad = Vec::new();
                        let body = json!({"workspace": ws.display().to_string()});
                        while requests.fetch_add(1, Ordering::SeqCst) < 1000 {
                            let (r, took) =
                                send(&socket, Some(token), "POST", "/v1/sandboxes", Some(&body));
                            *statuses.entry(r.status).or_default() += 1;
                            match r.status {
                                201 => {
                                    ok_times.push(took);
                                    let id = json_of(&r)["id"].as_str().unwrap().to_string();
                                    made.lock().unwrap().push(id.clone());
                                    mine.lock().unwrap().push(id);
                                }
                                429 => {
                                    refused_times.push(took);
                                    let v = json_of(&r);
                                    let after =
                                        r.header("retry-after").and_then(|v| v.parse::<u64>().ok());
                                    if v["error"]["code"] != "limit_exceeded"
                                        || after.is_none_or(|s| s < 1)
                                    {
                                        bad.push(format!(
                                            "429 without its code or Retry-After: {v}"
                                        ));
                                    }
                                }
                                s => bad.push(format!("{s}: {}", String::from_utf8_lossy(&r.body))),
                            }
                            // Past six, or past three once refused, the oldest goes: places
                            // free up and the burst goes on creating.
                            let old = {
                                let mut m = mine.lock().unwrap();
                                let keep = if r.status == 429 { 3 } else { 6 };
                                (m.len() > keep).then(|| m.remove(0))
                            };
                            if let Some(id) = old {
                                let (r, _) = send(
                                    &socket,
                                    Some(token),
                                    "DELETE",
                                    &format!("/v1/sandboxes/{id}"),
                                    None,
                                );
                                if r.status != 204 {
                                    bad.push(format!("destroy {id}: {}", r.status));
                                }
                            }
                        }
                        (statuses, ok_times, refused_times, bad)
                    })
                })
                .collect();
            (token, mine, lanes)
        })
        .collect();
    let mut statuses = BTreeMap::<u16, usize>::new();
    let (mut ok_times, mut refused_times, mut bad) = (Vec::new(), Vec::new(), Vec::new());
    let mut left = Vec::new();
    for (token, mine, lanes) in clients {
        for lane in lanes {
            let (s, ok, refused, b) = lane.join().unwrap();
            for (k, v) in s {
                *statuses.entry(k).or_default() += v;
            }
            ok_times.extend(ok);
            refused_times.extend(refused);
            bad.extend(b);
        }
        left.extend(mine.lock().unwrap().drain(..).map(|id| (token, id)));
    }
    let burst = t0.elapsed();
    // The table is full of what the clients kept: more creates are refused at once.
    let (m, _) = send(&socket, Some(ALICE), "GET", "/metrics", None);
    let metrics = String::from_utf8_lossy(&m.body).into_owned();
    done.store(true, Ordering::SeqCst);
    let (m_samples, max_live, max_starting, mut violations) = sample_metrics.join().unwrap();
    let (t_samples, max_tables, v) = sample_tables.join().unwrap();
    violations.extend(v);
    let (h_samples, max_host) = sample_host.join().unwrap();
    if max_host > 64 {
        violations.push(format!("{max_host} sandboxes on the host"));
    }
    for (token, id) in &left {
        let (r, _) = send(
            &socket,
            Some(token),
            "DELETE",
            &format!("/v1/sandboxes/{id}"),
            None,
        );
        assert_eq!(r.status, 204, "destroy {id}");
    }
    ok_times.sort();
    refused_times.sort();
    let pct = |v: &[Duration], p: usize| v.get(v.len().saturating_sub(1) * p / 100).copied();
    eprintln!(
        "1000 creates from 16 clients in {burst:?}: {statuses:?}; samples: {m_samples} of /metrics \
         (max live+starting {max_live}, starting {max_starting}), {t_samples} of the tables (max \
         {max_tables}), {h_samples} of the host (max {max_host}); create p50 {:?} p95 {:?}; 429 \
         p50 {:?} p95 {:?} max {:?}",
        pct(&ok_times, 50),
        pct(&ok_times, 95),
        pct(&refused_times, 50),
        pct(&refused_times, 95),
        refused_times.last()
    );
    assert!(
        bad.is_empty(),
        "{} bad answers, first: {}",
        bad.len(),
        bad[0]
    );
    assert!(violations.is_empty(), "limits passed: {violations:?}");
    assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), [201, 429]);
    assert_eq!(statuses.values().sum::<usize>(), 1000);
    assert!(
        m_samples >= 5 && t_samples >= 5 && h_samples >= 100,
        "too few samples: {m_samples}, {t_samples}, {h_samples}"
    );
    // The limits were reached, not merely respected.
    assert!(
        max_starting >= 12,
        "starting never came near its limit: {max_starting}"
    );
    assert!(
        max_live >= 56 || max_host >= 56,
        "live never came near its limit"
    );
    // A refusal never waits for a place: on a machine as busy as this one it comes back faster
    // than a create, and never after the seconds a slow failure (a timeout) would take.
    assert!(
        pct(&refused_times, 50) < pct(&ok_times, 50),
        "429 p50 {:?} vs create p50 {:?}",
        pct(&refused_times, 50),
        pct(&ok_times, 50)
    );
    assert!(
        refused_times.last() < Some(&Duration::from_secs(10)),
        "a refusal took {:?}",
        refused_times.last()
    );
    let refused: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("taskbox_creates_refused_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(refused as usize, statuses[&429], "{metrics}");
    // Nothing is left: not in the tables, not on the host.
    for token in [ALICE, BOB] {
        let (r, _) = send(&socket, Some(token), "GET", "/v1/sandboxes", None);
        assert_eq!(json_of(&r), json!([]));
    }
    let all = made.lock().unwrap().clone();
    assert_eq!(all.len(), statuses[&201]);
    assert_eq!(leftovers(&env, &all), Vec::<String>::new());
}

#[test]
fn the_creation_rate_refuses_past_its_burst_and_lets_through_after_retry_after() {
    let env = Env::new();
    let sup = Supervisor::start(&env, &["--create-rate", "2/s", "--max-starting", "16"]);
    let body = json!({"workspace": env.ws().display().to_string()});
    let socket = sup.socket.clone();
    // Eight at once: the bucket holds two.
    let t0 = Instant::now();
    let answers: Vec<(Response, Duration)> = (0..8)
        .map(|_| {
            let (socket, body) = (socket.clone(), body.clone());
            std::thread::spawn(move || send(&socket, None, "POST", "/v1/sandboxes", Some(&body)))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let elapsed = t0.elapsed().as_secs_f64();
    let mut ids = Vec::new();
    let mut waits = Vec::new();
    for (r, _) in &answers {
        match r.status {
            201 => ids.push(json_of(r)["id"].as_str().unwrap().to_string()),
            429 => {
                let v = json_of(r);
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("create_rate_total"),
                    "{v}"
                );
                waits.push(r.header("retry-after").unwrap().parse::<u64>().unwrap());
            }
            s => panic!("{s}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    // Two at once, and what refilled while the others waited for their answers.
    let allowed = 2 + (elapsed * 2.0).floor() as usize;
    assert!(
        (2..=allowed).contains(&ids.len()),
        "{} created in {elapsed:.2}s",
        ids.len()
    );
    assert!(
        !waits.is_empty() && waits.iter().all(|w| (1..=2).contains(w)),
        "{waits:?}"
    );
    // After Retry-After, a create goes through again.
    std::thread::sleep(Duration::from_secs(*waits.iter().max().unwrap()));
    let (r, _) = send(&socket, None, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    ids.push(json_of(&r)["id"].as_str().unwrap().to_string());
    // A fork takes tokens as creates do: three at once are more than the bucket holds now.
    let (r, _) = send(
        &socket,
        None,
        "POST",
        &format!("/v1/sandboxes/{}/fork", ids[0]),
        Some(&json!({"count": 3})),
    );
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("retry-after").is_some());
    for id in &ids {
        let (r, _) = send(
            &socket,
            None,
            "DELETE",
            &format!("/v1/sandboxes/{id}"),
            None,
        );
        assert_eq!(r.status, 204);
    }
    assert_eq!(leftovers(&env, &ids), Vec::<String>::new());
}

#[test]
fn no_renew_passes_the_hard_lifetime() {
    let env = Env::new();
    // No warm pool of forks: its sandboxes would be on the host while the supervisor runs,
    // and this test counts the host's.
    let sup = Supervisor::start(
        &env,
        &[
            "--max-lifetime",
            "3s",
            "--default-ttl",
            "1h",
            "--fork-pool",
            "0",
        ],
    );
    let socket = sup.socket.clone();
    let (r, _) = send(
        &socket,
        None,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"workspace": env.ws().display().to_string(), "ttl_secs": 600})),
    );
    assert_eq!(r.status, 201);
    let info = json_of(&r);
    let id = info["id"].as_str().unwrap().to_string();
    let created = info["created_at_ms"].as_u64().unwrap();
    let hard = created + 3000;
    assert_eq!(info["expires_at_ms"].as_u64(), Some(hard), "{info}");
    // A renew asks for an hour; the lease stays at the lifetime's end.
    std::thread::sleep(Duration::from_millis(500));
    let (r, _) = send(
        &socket,
        None,
        "POST",
        &format!("/v1/sandboxes/{id}/renew"),
        Some(&json!({"ttl_secs": 3600})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(json_of(&r)["expires_at_ms"].as_u64(), Some(hard));
    // A fork of it has a lifetime of its own, from its own creation.
    let (r, _) = send(
        &socket,
        None,
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        Some(&json!({"ttl_secs": 3600})),
    );
    assert_eq!(r.status, 201);
    let fork = &json_of(&r)["sandboxes"][0];
    let fid = fork["id"].as_str().unwrap().to_string();
    assert_eq!(
        fork["expires_at_ms"].as_u64(),
        Some(fork["created_at_ms"].as_u64().unwrap() + 3000),
        "{fork}"
    );
    // The reaper ends both at their lifetime, renewed or not.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (r, _) = send(&socket, None, "GET", "/v1/sandboxes", None);
        if json_of(&r) == json!([]) {
            break;
        }
        assert!(Instant::now() < deadline, "still there: {}", json_of(&r));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(crate::now_ms() >= hard, "ended before its lifetime");
    let (r, _) = send(&socket, None, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.status, 404);
    // A sandbox leaves the table before its destroy has removed it from the host.
    let ids = [id, fid];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !leftovers(&env, &ids).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(leftovers(&env, &ids), Vec::<String>::new());
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn a_destroy_whose_client_hangs_up_completes() {
    use std::io::Write;
    let env = Env::new();
    let sup = Supervisor::start(&env, &[]);
    let socket = sup.socket.clone();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = sup.create_sandbox(&env);
        // Something to end: a process that ignores SIGTERM.
        let (r, _) = send(
            &socket,
            None,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": "trap '' TERM; sleep 300", "background": true})),
        );
        assert_eq!(r.status, 200);
        ids.push(id);
    }
    // Each DELETE is written whole and the connection closed at once, before any answer.
    for id in &ids {
        let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        write!(
            s,
            "DELETE /v1/sandboxes/{id} HTTP/1.1\r\nHost: taskbox\r\nContent-Length: 0\r\n\r\n"
        )
        .unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
        drop(s);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (r, _) = send(&socket, None, "GET", "/v1/sandboxes", None);
        if json_of(&r) == json!([]) && leftovers(&env, &ids).is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "destroys did not complete: {} / {:?}",
            json_of(&r),
            leftovers(&env, &ids)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for id in &ids {
        let (r, _) = send(&socket, None, "GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(r.status, 404);
    }
}

/// The one value of an unlabelled gauge in a Prometheus text.
fn plain_gauge(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn the_fork_pool_counts_in_the_total_not_in_a_tenants_and_yields_its_places() {
    let env = Env::new();
    env.write("README", "pool\n");
    let tokens = tokens_file(&env);
    let sup = Supervisor::start(
        &env,
        &[
            "--tokens",
            tokens.to_str().unwrap(),
            "--max-sandboxes",
            "6",
            "--max-sandboxes-per-tenant",
            "4",
            "--fork-pool",
            "3",
        ],
    );
    let socket = sup.socket.clone();
    let metrics = || {
        let (m, _) = send(&socket, Some(ALICE), "GET", "/metrics", None);
        String::from_utf8_lossy(&m.body).into_owned()
    };
    // The places the pool holds, and of them those started (not starting): a fork finds only
    // the started ones.
    let pooled = || {
        let text = metrics();
        (
            plain_gauge(&text, "taskbox_fork_pool_sandboxes"),
            plain_gauge(&text, "taskbox_fork_pool_ready"),
        )
    };
    let wait_pooled = |what: &str, want: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while pooled() != (want, want) {
            assert!(Instant::now() < deadline, "{what}: {}", metrics());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let create = |token: &str| {
        send(
            &socket,
            Some(token),
            "POST",
            "/v1/sandboxes",
            Some(&json!({"workspace": env.ws().display().to_string()})),
        )
        .0
    };
    let listed = |token: &str| -> Vec<String> {
        let (r, _) = send(&socket, Some(token), "GET", "/v1/sandboxes", None);
        json_of(&r)
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap().to_string())
            .collect()
    };

    // Alice's parent and one fork: the pool of that origin fills to 3 (room: 6 - 2).
    let r = create(ALICE);
    assert_eq!(r.status, 201);
    let parent = json_of(&r)["id"].as_str().unwrap().to_string();
    let (r, _) = send(
        &socket,
        Some(ALICE),
        "POST",
        &format!("/v1/sandboxes/{parent}/exec"),
        Some(&json!({"shell": "echo forked > f.txt"})),
    );
    assert_eq!(r.status, 200);
    let fork_path = format!("/v1/sandboxes/{parent}/fork");
    let (r, _) = send(&socket, Some(ALICE), "POST", &fork_path, Some(&json!({})));
    assert_eq!(r.status, 201, "{}", json_of(&r));
    wait_pooled("the pool fills", 3);
    // No tenant sees a pooled sandbox, nor counts it.
    assert_eq!(listed(ALICE).len(), 2);
    assert_eq!(listed(BOB), Vec::<String>::new());
    let text = metrics();
    assert_eq!(
        gauge(&text, "taskbox_sandboxes_live"),
        BTreeMap::from([("alice".to_string(), 2)])
    );
    assert_eq!(
        host_sandboxes(&env.state()),
        5,
        "2 live and 3 pooled on the host"
    );

    // Bob's creates take the places the pool held: none refused, and the pool shrinks so that
    // the host never holds more than the total.
    for n in 1..=4 {
        let r = create(BOB);
        assert_eq!(r.status, 201, "bob's create {n}: {}", json_of(&r));
    }
    wait_pooled("the pool gives its places back", 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_sandboxes(&env.state()) > 6 {
        assert!(Instant::now() < deadline, "the host holds past the total");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The total is reached by tenants' sandboxes alone: the next create is refused.
    let r = create(ALICE);
    assert_eq!(r.status, 429, "{}", json_of(&r));
    assert!(
        json_of(&r)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_sandboxes_total"),
        "{}",
        json_of(&r)
    );

    // Once bob's are gone, a fork is served from the pool again (it refills within the room).
    let mut ids: Vec<String> = listed(BOB);
    for id in &ids {
        let (r, _) = send(
            &socket,
            Some(BOB),
            "DELETE",
            &format!("/v1/sandboxes/{id}"),
            None,
        );
        assert_eq!(r.status, 204);
    }
    wait_pooled("the pool refills", 3);
    let served = plain_gauge(&metrics(), "taskbox_fork_pool_served");
    let (r, _) = send(
        &socket,
        Some(ALICE),
        "POST",
        &fork_path,
        Some(&json!({"count": 2})),
    );
    assert_eq!(r.status, 201, "{}", json_of(&r));
    let text = metrics();
    assert_eq!(
        plain_gauge(&text, "taskbox_fork_pool_served"),
        served + 2,
        "{text}"
    );
    for f in json_of(&r)["sandboxes"].as_array().unwrap() {
        let id = f["id"].as_str().unwrap();
        let (r, _) = send(
            &socket,
            Some(ALICE),
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": "cat f.txt"})),
        );
        assert_eq!(json_of(&r)["stdout"]["text"], "forked\n", "{}", json_of(&r));
    }
    ids.extend(listed(ALICE));

    // A supervisor that stops leaves nothing of its pool, or of anything else, on the host.
    drop(sup);
    assert_eq!(leftovers(&env, &ids), Vec::<String>::new());
}
