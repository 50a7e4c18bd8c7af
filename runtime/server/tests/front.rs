//! The connection front against the real `taskbox serve` binary, a process of its own (so its
//! resident size is its own), over its Unix socket: the header and body timeouts, the 413 before
//! the body, the connection caps, the memory after 5,000 idle connections, and SIGTERM with an
//! exec stuck in the backend. Needs the binaries built (`cargo build --workspace --bins`, as
//! scripts/test.sh does); skips with a reason without them, or fails under
//! `TASKBOX_REQUIRE_ALL=1`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taskbox_tests::{Env, Supervisor, host_processes_with, http, require};

/// Whether the `taskbox` binary is there to be started (see `taskbox_tests::bin_dir`).
fn built() -> bool {
    let dir = match std::env::var_os("TASKBOX_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().unwrap();
            let deps = exe.parent().unwrap();
            if deps.ends_with("deps") {
                deps.parent().unwrap().to_path_buf()
            } else {
                deps.to_path_buf()
            }
        }
    };
    require(
        dir.join("taskbox").is_file() && dir.join("taskbox-init").is_file(),
        "the taskbox binaries are not built (run `cargo build --workspace --bins`)",
    )
}

fn start(env: &Env, flags: &[&str]) -> Option<Supervisor> {
    built().then(|| Supervisor::start(env, flags))
}

/// Sends `request` raw and reads the answer until the server closes (or `wait` passes).
fn raw(socket: &Path, request: &[u8], wait: Duration) -> (String, Duration) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    let start = Instant::now();
    s.write_all(request).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    (
        String::from_utf8_lossy(&answer).into_owned(),
        start.elapsed(),
    )
}

fn metric(socket: &Path, line: &str) -> u64 {
    let (answer, _) = raw(
        socket,
        b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    );
    answer
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn create(sup: &Supervisor, env: &Env) -> String {
    let (st, info) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws().display().to_string()})),
    );
    assert_eq!(st, 201, "{info}");
    info["id"].as_str().unwrap().to_string()
}

/// 200 connections that send a byte of a request's headers every second but never finish
/// them are all closed once the header timeout (3 s) has passed, not before; the server keeps
/// answering meanwhile.
#[test]
fn slowloris_connections_are_closed_after_the_header_timeout() {
    let env = Env::new();
    let Some(sup) = start(&env, &["--header-timeout", "3s", "--idle-timeout", "60s"]) else {
        return;
    };
    let head = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut conns: Vec<UnixStream> = (0..200)
        .map(|_| {
            let s = UnixStream::connect(&sup.socket).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    let start = Instant::now();
    let mut closed: Vec<Option<Duration>> = vec![None; conns.len()];
    let mut sent = 0;
    while start.elapsed() < Duration::from_secs(12) && closed.iter().any(Option::is_none) {
        for (c, at) in conns.iter_mut().zip(closed.iter_mut()) {
            if at.is_some() {
                continue;
            }
            let mut buf = [0u8; 256];
            match c.read(&mut buf) {
                Ok(0) => *at = Some(start.elapsed()),
                Ok(n) => panic!(
                    "an unfinished request got an answer: {}",
                    String::from_utf8_lossy(&buf[..n])
                ),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if c.write_all(&head[sent % head.len()..][..1]).is_err() {
                        *at = Some(start.elapsed());
                    }
                }
                Err(_) => *at = Some(start.elapsed()),
            }
        }
        sent += 1;
        let (st, _) = sup.call("GET", "/healthz", None);
        assert_eq!(st, 200, "the server answers others meanwhile");
        std::thread::sleep(Duration::from_secs(1));
    }
    let open = closed.iter().filter(|c| c.is_none()).count();
    assert_eq!(open, 0, "{open} slow connections still open after 12 s");
    let earliest = closed.iter().flatten().min().unwrap();
    let latest = closed.iter().flatten().max().unwrap();
    assert!(
        *earliest >= Duration::from_millis(2500),
        "closed before the timeout: {earliest:?}"
    );
    assert!(*latest <= Duration::from_secs(7), "closed late: {latest:?}");
    assert_eq!(
        metric(
            &sup.socket,
            "taskbox_connections_timed_out_total{reason=\"header_timeout\"}"
        ),
        200
    );
}

/// A request whose body stops halfway is answered 408 naming the limit once no byte of it has
/// come for the body timeout (2 s), and its connection closed.
#[test]
fn a_half_sent_body_is_cut_off() {
    let env = Env::new();
    let Some(sup) = start(&env, &["--body-timeout", "2s"]) else {
        return;
    };
    let (answer, took) = raw(
        &sup.socket,
        b"POST /v1/sandboxes HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"workspace\":",
        Duration::from_secs(15),
    );
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "{answer:?} after {took:?}"
    );
    assert!(
        answer.contains("\"request_timeout\"") && answer.contains("body_timeout"),
        "{answer}"
    );
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(8),
        "{took:?}"
    );
    // `raw` read to the end: the server closed the connection after the answer.
    let (st, list) = sup.call("GET", "/v1/sandboxes", None);
    assert_eq!((st, list), (200, json!([])), "nothing was created");
}

/// A declared body of 2 GiB is answered 413 at once, naming the size and the limit, without
/// waiting for a byte of it; a request head over 64 KiB is 431.
#[test]
fn a_huge_content_length_is_refused_before_the_body() {
    let env = Env::new();
    let Some(sup) = start(&env, &[]) else {
        return;
    };
    let (answer, took) = raw(
        &sup.socket,
        b"POST /v1/sandboxes HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
          Content-Length: 2147483648\r\n\r\n{\"workspace\":",
        Duration::from_secs(10),
    );
    assert!(
        answer.starts_with("HTTP/1.1 413"),
        "{answer:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(
        answer.contains("\"too_large\"")
            && answer.contains("2147483648")
            && answer.contains("max_body_bytes"),
        "{answer}"
    );
    // A request head of 100 KiB is more than a connection may make the server hold.
    let mut big = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 100 << 10));
    big.extend_from_slice(b"\r\n\r\n");
    let (answer, _) = raw(&sup.socket, &big, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
}

/// Opens `n` idle connections once the start-up probe's connection is gone, and checks that
/// the server let them all in.
fn hold(socket: &Path, n: usize) -> Vec<UnixStream> {
    std::thread::sleep(Duration::from_millis(300));
    let held: Vec<UnixStream> = (0..n)
        .map(|_| UnixStream::connect(socket).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for c in &held {
        c.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        match (&*c).read(&mut buf) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            other => panic!("a connection under the cap was not let in: {other:?}"),
        }
    }
    held
}

/// Past the per-client cap a connection is answered 429 with `Retry-After`, past the total cap
/// 503; closing connections frees their places.
#[test]
fn connections_over_a_cap_are_turned_away_with_retry_after() {
    let env = Env::new();
    let Some(sup) = start(&env, &["--max-connections-per-client", "4"]) else {
        return;
    };
    let held = hold(&sup.socket, 4);
    let get = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n";
    let (answer, _) = raw(&sup.socket, get, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    assert!(
        answer.contains("\"limit_exceeded\"") && answer.contains("max_connections_per_client"),
        "{answer}"
    );
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sup.call("GET", "/healthz", None).0, 200);
    drop(sup);

    let env = Env::new();
    let Some(sup) = start(
        &env,
        &[
            "--max-connections",
            "3",
            "--max-connections-per-client",
            "100",
        ],
    ) else {
        return;
    };
    let held = hold(&sup.socket, 3);
    let (answer, _) = raw(&sup.socket, get, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.contains("\"unavailable\"") && answer.contains("max_connections"),
        "{answer}"
    );
    drop(held);
}

/// Runs `exec true` over a fresh connection; returns how long the answer took.
fn exec_true(socket: &Path, id: &str) -> Duration {
    let start = Instant::now();
    let (st, r) = http::call(
        socket,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"argv": ["true"]})),
    );
    let took = start.elapsed();
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    took
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// 5,000 idle connections: an `exec true` from a normal client meanwhile answers in under
/// 50 ms (the median of five), and once they close the supervisor's resident size falls back
/// under twice what it was before.
#[test]
fn memory_falls_back_after_5000_idle_connections() {
    const N: usize = 5000;
    let limit = taskbox_server::sys::raise_open_files().unwrap_or(0);
    if !require(
        limit >= N as u64 + 200,
        &format!(
            "the open-file limit ({limit}) is below {} connections",
            N + 200
        ),
    ) {
        return;
    }
    let env = Env::new();
    let Some(sup) = start(
        &env,
        &[
            "--max-connections",
            "6000",
            "--max-connections-per-client",
            "6000",
        ],
    ) else {
        return;
    };
    let pid = sup.child.id();
    let id = create(&sup, &env);
    for _ in 0..5 {
        exec_true(&sup.socket, &id);
    }
    std::thread::sleep(Duration::from_secs(1));
    let idle = rss_kib(pid);

    let conns: Vec<UnixStream> = (0..N)
        .map(|_| UnixStream::connect(&sup.socket).unwrap())
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        metric(&sup.socket, "taskbox_connections_open"),
        N as u64 + 1,
        "all are open (and the metrics request)"
    );
    let open = rss_kib(pid);
    let execs: Vec<Duration> = (0..5).map(|_| exec_true(&sup.socket, &id)).collect();
    drop(conns);

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = rss_kib(pid);
    while after >= 2 * idle && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        after = rss_kib(pid);
    }
    eprintln!(
        "rss: idle {idle} KiB, {N} connections open {open} KiB, after they closed {after} KiB; \
         exec true meanwhile: {execs:?}"
    );
    assert!(after < 2 * idle, "rss {after} KiB, idle was {idle} KiB");
    let m = median(execs.clone());
    assert!(m < Duration::from_millis(50), "exec true took {execs:?}");
}

/// SIGTERM ends a supervisor whose exec is stuck in the backend (`sleep` for hours) within a
/// bound (drain 10 s, cleanup at most 10 s), with status 0; nothing of the sandbox is left, and a
/// new supervisor on the same state starts clean.
#[test]
fn sigterm_ends_a_supervisor_with_an_exec_in_flight() {
    let env = Env::new();
    let Some(mut sup) = start(&env, &[]) else {
        return;
    };
    let id = create(&sup, &env);
    let marker = format!("33{}.5", std::process::id());
    let sock = sup.socket.clone();
    let shell = format!("sleep {marker}");
    let sandbox = id.clone();
    let exec = std::thread::spawn(move || {
        // The answer never comes: the supervisor closes the connection when it stops, and the
        // helper panics on the cut answer (its message is expected in the output).
        std::panic::catch_unwind(|| {
            http::call(
                &sock,
                "POST",
                &format!("/v1/sandboxes/{sandbox}/exec"),
                Some(&json!({ "shell": shell })),
            )
        })
        .ok()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_processes_with(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!host_processes_with(&marker).is_empty(), "the exec runs");

    let pid = sup.child.id() as i32;
    // SAFETY: kill has no memory arguments; the pid is our child's, not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let start = Instant::now();
    let status = loop {
        if let Some(st) = sup.child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > Duration::from_secs(40) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = start.elapsed();
    let Some(status) = status else {
        panic!("the supervisor ignored SIGTERM for {took:?}");
    };
    eprintln!("the supervisor stopped {took:?} after SIGTERM");
    assert!(took < Duration::from_secs(25), "it took {took:?} to stop");
    assert!(status.success(), "{status:?}");
    let answered: Option<(u16, Value)> = exec.join().unwrap();
    assert!(
        answered.is_none(),
        "the stuck exec got an answer: {answered:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !host_processes_with(&marker).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        host_processes_with(&marker).is_empty(),
        "the sandbox's processes outlived the supervisor"
    );

    // A new supervisor on the same state finds nothing and leaves nothing behind. (The old one
    // is reaped: its drop must not signal a pid that may be someone else's by now.)
    std::mem::forget(sup);
    let sup = Supervisor::start(&env, &[]);
    let (st, list) = sup.call("GET", "/v1/sandboxes", None);
    assert_eq!((st, list), (200, json!([])));
    let left: Vec<_> = std::fs::read_dir(env.state().join("sandboxes"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name())
                // The backend's own: its lock, and the mount point and mask file every
                // sandbox shares.
                .filter(|n| {
                    ![".lock", ".root", ".empty", ".disk"]
                        .iter()
                        .any(|own| n == own)
                })
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "state left behind: {left:?}");
    let cgroups = taskbox_tests::host_cgroups(&format!("taskbox-sb-{id}"));
    assert!(cgroups.is_empty(), "cgroups left behind: {cgroups:?}");
}
