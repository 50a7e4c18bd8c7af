//! The warm pool of forks on the native backend, on the real kernel: a fork served from the pool
//! passes the fork checks of the conformance suite (exactly its parent's files at the fork
//! point, `/tmp` included; writes isolated between forks and parent; the same info fields); a
//! fork larger than the pool mixes pooled and started sandboxes, which look the same; the pool
//! refills after a take; idle pooled sandboxes are retired; pooled sandboxes are never listed
//! or reachable by id; and nothing of the pool is left on the host (directories, cgroups,
//! processes, mounts) once it is retired or the backend is dropped.
//!
//! The native backend runs rootless too: nothing here needs root.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::kit::{ForkPoolConfig, PoolStatus};
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::suite::{Expect, Subject, expect_code};
use taskbox_tests::{Env, host_cgroups, host_processes_with, sandbox_dirs};

/// A native backend shared between a test and the [`Subject`] of the conformance checks.
struct Shared(Arc<NativeBackend>);

impl OpHandler for Shared {
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        self.0.create(req)
    }
    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.0.list()
    }
    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        self.0.call(id, op)
    }
}

fn pooled_backend(env: &Env, size: usize, max_idle: Duration) -> Arc<NativeBackend> {
    Arc::new(
        NativeBackend::new(env.state())
            .unwrap()
            .with_fork_pool(ForkPoolConfig {
                max_idle,
                ..ForkPoolConfig::new(size)
            }),
    )
}

fn status(b: &NativeBackend) -> PoolStatus {
    b.fork_pool_status().expect("a pool")
}

/// Waits (up to 30 s) until `cond` holds of the pool's status; the status then.
fn wait_pool(b: &NativeBackend, what: &str, cond: impl Fn(&PoolStatus) -> bool) -> PoolStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(b);
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The conformance suite's create request (its checks look for its env and labels).
fn template() -> CreateRequest {
    CreateRequest {
        env: BTreeMap::from([("CONF_CREATE".into(), "from-create".into())]),
        labels: BTreeMap::from([("suite".into(), "api-conformance".into())]),
        ..CreateRequest::default()
    }
}

fn subject(env: Env, backend: &Arc<NativeBackend>) -> Subject {
    let expect = Expect {
        backend: "native",
        image: "host".into(),
        landlock: "full",
    };
    Subject::new(
        expect,
        env,
        Box::new(Shared(backend.clone())),
        template(),
        None,
    )
}

fn fork(b: &NativeBackend, id: &SandboxId, count: u32) -> Vec<SandboxInfo> {
    b.fork(
        id,
        ForkRequest {
            count: Some(count),
            ..ForkRequest::default()
        },
    )
    .unwrap()
    .sandboxes
}

/// Makes the pool of `s`'s origin warm: a parent from the template forked once (both
/// destroyed), then waits until the pool holds `size`.
fn warm_up(s: &Subject, b: &NativeBackend, size: usize) {
    let parent = s.create();
    s.sh(&parent, "true");
    for f in fork(b, &parent, 1) {
        b.destroy(&f.id).unwrap();
    }
    b.destroy(&parent).unwrap();
    wait_pool(b, "the pool fills", |p| p.ready == size);
}

#[test]
fn forks_served_from_the_pool_pass_the_fork_checks() {
    let env = Env::new();
    let b = pooled_backend(&env, 3, Duration::from_secs(600));
    let s = subject(env, &b);
    warm_up(&s, &b, 3);
    let served = status(&b).served;
    // It forks 3: all from the pool.
    taskbox_tests::conformance::a_fork_sees_its_parent_and_nothing_flows_between_forks(&s);
    assert_eq!(status(&b).served, served + 3, "{:?}", status(&b));
    // From a checkpoint (2 forks), once the pool is full again.
    wait_pool(&b, "the pool refills", |p| p.ready == 3);
    taskbox_tests::conformance::a_fork_from_a_checkpoint_starts_there(&s);
    assert_eq!(status(&b).served, served + 5, "{:?}", status(&b));
}

/// What a sandbox's files are, as a test sees them: the workspace diff and `/tmp`'s notes.
fn files(s: &Subject, id: &SandboxId) -> (String, String) {
    let d = s.api.diff(id, DiffRequest::default()).unwrap();
    let r = s.sh(id, "cat /tmp/note; ls -A /tmp | grep -v '^.taskbox$'");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    (d.diff, r.stdout.text)
}

#[test]
fn a_fork_larger_than_the_pool_mixes_pooled_and_started_sandboxes_that_look_the_same() {
    let env = Env::new();
    std::fs::write(env.ws().join("a.txt"), "a\n").unwrap();
    let b = pooled_backend(&env, 2, Duration::from_secs(600));
    let s = subject(env, &b);
    warm_up(&s, &b, 2);
    let pooled = status(&b).ids;
    assert_eq!(pooled.len(), 2);
    // Pooled sandboxes are no one's: never listed, never reachable by id.
    let listed: Vec<SandboxId> = b.list().into_iter().map(|i| i.id).collect();
    for id in &pooled {
        assert!(!listed.contains(id), "{id} is listed");
        expect_code("a pooled sandbox's info", b.info(id), "sandbox_not_found");
        expect_code(
            "an exec in a pooled sandbox",
            b.exec(
                id,
                ExecRequest {
                    shell: Some("true".into()),
                    ..ExecRequest::default()
                },
                None,
            ),
            "sandbox_not_found",
        );
    }

    let parent = s.create();
    let r = s.sh(
        &parent,
        "echo changed > a.txt && echo new > b.txt && echo note > /tmp/note && touch /tmp/t1",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let before = files(&s, &parent);
    let pinfo = b.info(&parent).unwrap();
    let served = status(&b).served;
    let made = b
        .fork(
            &parent,
            ForkRequest {
                count: Some(5),
                ttl_secs: Some(600),
                labels: BTreeMap::from([("round".into(), "1".into())]),
                ..ForkRequest::default()
            },
        )
        .unwrap()
        .sandboxes;
    assert_eq!(made.len(), 5);
    assert_eq!(status(&b).served, served + 2, "two from the pool");
    let from_pool: Vec<&SandboxInfo> = made.iter().filter(|i| pooled.contains(&i.id)).collect();
    assert_eq!(from_pool.len(), 2, "the pooled ids among {made:?}");

    // Every fork, pooled or started, says the same of itself.
    let shape = |i: &SandboxInfo| {
        let mut i = i.clone();
        i.id = parent.clone();
        i.expires_at_ms = i.expires_at_ms.map(|e| e - i.created_at_ms);
        i.created_at_ms = 0;
        i
    };
    for info in &made {
        assert_eq!(shape(info), shape(&made[0]), "{info:?} and {:?}", made[0]);
        assert_eq!(info.expires_at_ms, Some(info.created_at_ms + 600_000));
        assert_eq!(info.enforcement, pinfo.enforcement);
        assert_eq!(info.labels.get("round").map(String::as_str), Some("1"));
        assert_eq!(
            info.labels.get("suite").map(String::as_str),
            Some("api-conformance")
        );
        assert_eq!(info.forked_from.as_ref().map(|f| &f.parent), Some(&parent));
        assert_eq!(b.info(&info.id).unwrap(), *info);
        // Exactly the parent's files at the fork point.
        assert_eq!(files(&s, &info.id), before, "fork {}", info.id);
    }
    // Writes are isolated: each fork's own file, seen by no other sandbox.
    for info in &made {
        let r = s.sh(
            &info.id,
            &format!("echo {0} > own-{0}.txt; echo {0} > /tmp/note", info.id),
        );
        assert_eq!(r.exit_code, Some(0), "{r:?}");
    }
    s.sh(&parent, "echo parent > /tmp/note; echo parent > a.txt");
    for info in &made {
        let r = s.sh(&info.id, "ls own-*.txt; cat /tmp/note a.txt");
        assert_eq!(
            r.stdout.text,
            format!("own-{0}.txt\n{0}\nchanged\n", info.id),
            "{r:?}"
        );
    }
    let r = s.sh(&parent, "ls own-*.txt 2>/dev/null | wc -l; cat /tmp/note");
    assert_eq!(r.stdout.text, "0\nparent\n", "{r:?}");

    // The pool refills after the take, with new sandboxes.
    let refilled = wait_pool(&b, "the pool refills", |p| p.ready == 2);
    assert!(refilled.ids.iter().all(|id| !pooled.contains(id)));
    destroy_all(&b, &made, &parent);
    assert_eq!(
        std::fs::read_to_string(s.ws().join("a.txt")).unwrap(),
        "a\n",
        "the host workspace is untouched"
    );
}

/// Destroys `forks` and their `parent`.
fn destroy_all(b: &NativeBackend, forks: &[SandboxInfo], parent: &SandboxId) {
    for info in forks {
        b.destroy(&info.id).unwrap();
    }
    b.destroy(parent).unwrap();
}

/// The directories, cgroups, processes and mounts of sandboxes `ids` under `state`.
fn leftovers(state: &Path, ids: &[SandboxId]) -> Vec<String> {
    let mut left = Vec::new();
    for id in ids {
        let dir = state.join("sandboxes").join(id.as_str());
        if dir.exists() {
            left.push(format!("{}", dir.display()));
        }
        left.extend(host_cgroups(&format!("taskbox-sb-{id}")));
        let procs = host_processes_with(&dir.display().to_string());
        if !procs.is_empty() {
            left.push(format!("processes of {id}: {procs:?}"));
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for id in ids {
        if mounts.contains(id.as_str()) {
            left.push(format!("a mount of {id}"));
        }
    }
    left
}

/// Waits (up to 10 s: an end removes its directories in the background) until nothing of
/// `ids` is left; what is left then.
fn settled_leftovers(state: &Path, ids: &[SandboxId]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = leftovers(state, ids);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn idle_pooled_sandboxes_are_retired_and_leave_nothing() {
    let env = Env::new();
    let state = env.state();
    let b = pooled_backend(&env, 2, Duration::from_secs(2));
    let s = subject(env, &b);
    warm_up(&s, &b, 2);
    let pooled = status(&b).ids;
    // No fork for the idle time: the sandboxes are retired and the origin let go.
    let after = wait_pool(&b, "the pool retires its idle sandboxes", |p| {
        p.ready == 0 && p.starting == 0 && p.origins == 0
    });
    assert!(after.retired >= 2, "{after:?}");
    assert_eq!(settled_leftovers(&state, &pooled), Vec::<String>::new());
    // A fork warms the origin again.
    let parent = s.create();
    s.sh(&parent, "true");
    for f in fork(&b, &parent, 1) {
        b.destroy(&f.id).unwrap();
    }
    wait_pool(&b, "the pool fills again", |p| p.ready == 2);
    b.destroy(&parent).unwrap();
}

#[test]
fn dropping_the_backend_ends_the_pool_and_leaves_nothing_on_the_host() {
    let env = Env::new();
    let state = env.state();
    let b = pooled_backend(&env, 3, Duration::from_secs(600));
    let s = subject(env, &b);
    warm_up(&s, &b, 3);
    let mut ids = status(&b).ids;
    let parent = s.create();
    s.sh(&parent, "echo x > x.txt");
    // A fork whose refill is under way when the backend goes.
    ids.extend(fork(&b, &parent, 2).into_iter().map(|i| i.id));
    ids.push(parent);
    std::thread::sleep(taskbox_core::kit::pool::REFILL_AFTER + Duration::from_millis(30));
    let env = s.env;
    drop(s.api);
    drop(b);
    assert_eq!(settled_leftovers(&state, &ids), Vec::<String>::new());
    assert!(state.join("sandboxes").is_dir());
    let left = sandbox_dirs(&state.join("sandboxes"));
    assert_eq!(left, Vec::<String>::new(), "sandbox directories");
    let state_text = state.display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&state_text), "a mount of the state");
    assert_eq!(
        host_processes_with(&state_text),
        Vec::<i32>::new(),
        "processes"
    );
    drop(env);
}

/// Every kind of entry a fork point can hold, over a workspace that has the entries it
/// replaces: a changed file, removed files and directories (one of them replaced by a new
/// directory), a symlink become a file, a file become a directory, a mode and an mtime changed
/// alone, new directories, a relative symlink, a fifo, hard links and a file of some size.
const EVERY_KIND: &str = "set -e
echo changed >> keep/a.txt
rm gone.txt
rm -rf gonedir
rm -rf redo && mkdir redo && echo new > redo/new.txt
rm link && echo now-a-file > link
rm f2d.txt && mkdir f2d.txt && echo in > f2d.txt/inner.txt
chmod 755 mode.sh
touch -d '2001-02-03 04:05:06' touched.txt
mkdir -p fresh/deep/er && echo deep > fresh/deep/er/file.txt && chmod 700 fresh/deep
ln -s ../keep/same.txt fresh/rel-link
mkfifo -m 640 fresh/pipe
echo hard > fresh/h1 && ln fresh/h1 fresh/h2
head -c 3000000 /dev/urandom > fresh/big.bin
echo note > /tmp/note";

/// The workspace as commands see it: every entry with its type, mode, owner and mtime (size,
/// link target and link count for all but directories), and every file's digest.
const LISTING: &str = "find . -type d -printf '%p %y %m %U %G %T@\\n' | sort
find . ! -type d -printf '%p %y %m %U %G %s %T@ %l %n\\n' | sort
find . -type f -exec sha256sum {} + | sort";

/// The lower layer [`EVERY_KIND`] changes, made on the host.
fn every_kind_workspace(ws: &Path) {
    let write = |rel: &str, text: &str| {
        let p = ws.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("keep/a.txt", "a\n");
    write("keep/same.txt", "same\n");
    write("gone.txt", "gone\n");
    write("gonedir/x/y.txt", "y\n");
    write("gonedir/z.txt", "z\n");
    write("redo/old1.txt", "1\n");
    write("redo/old2.txt", "2\n");
    write("f2d.txt", "file\n");
    write("mode.sh", "#!/bin/sh\n");
    write("touched.txt", "t\n");
    std::os::unix::fs::symlink("keep/a.txt", ws.join("link")).unwrap();
}

/// Forks `parent` once per pooled sandbox (`n`), and checks that each fork lists exactly
/// as its parent did at the fork point, with the same diff and `/tmp`; returns the forks.
fn forks_list_as_their_parent(
    s: &Subject,
    b: &NativeBackend,
    parent: &SandboxId,
    n: u32,
) -> Vec<SandboxInfo> {
    let listing = s.sh(parent, LISTING);
    assert_eq!(listing.exit_code, Some(0), "{listing:?}");
    let before = files(s, parent);
    let made = fork(b, parent, n);
    for info in &made {
        let r = s.sh(&info.id, LISTING);
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        assert_eq!(r.stdout.text, listing.stdout.text, "fork {}", info.id);
        assert_eq!(files(s, &info.id), before, "fork {}", info.id);
    }
    made
}

#[test]
fn a_fork_written_into_a_pooled_sandbox_lists_exactly_as_its_parent() {
    let env = Env::new();
    every_kind_workspace(&env.ws());
    let b = pooled_backend(&env, 2, Duration::from_secs(600));
    let s = subject(env, &b);
    warm_up(&s, &b, 2);
    let parent = s.create();
    let r = s.sh(&parent, EVERY_KIND);
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let before = status(&b);
    let made = forks_list_as_their_parent(&s, &b, &parent, 2);
    let after = status(&b);
    assert_eq!(after.served, before.served + 2, "{after:?}");
    // Both took the layer through their mount: their exec starters were not replaced.
    assert_eq!(after.merged, before.merged + 2, "{after:?}");
    // Each fork's workspace is its own from then on, and restores as any other.
    let f = &made[0].id;
    s.api
        .checkpoint(f, CheckpointRequest { name: "c".into() })
        .unwrap();
    let r = s.sh(f, "echo more >> keep/a.txt && rm -rf fresh && touch redo/x");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = s.sh(&made[1].id, "cat keep/a.txt; ls fresh; ls redo");
    assert_eq!(
        r.stdout.text, "a\nchanged\nbig.bin\ndeep\nh1\nh2\npipe\nrel-link\nnew.txt\n",
        "{r:?}"
    );
    s.api
        .restore(f, CheckpointRequest { name: "c".into() })
        .unwrap();
    let r = s.sh(f, "cat keep/a.txt; ls redo");
    assert_eq!(r.stdout.text, "a\nchanged\nnew.txt\n", "{r:?}");
    destroy_all(&b, &made, &parent);
    assert_eq!(
        std::fs::read_to_string(s.ws().join("keep/a.txt")).unwrap(),
        "a\n",
        "the host workspace is untouched"
    );
}

#[test]
fn a_fork_that_removes_too_much_to_write_is_mounted_instead_and_lists_the_same() {
    let env = Env::new();
    every_kind_workspace(&env.ws());
    // More entries under one removed directory than a merge removes (10,000).
    let many = env.ws().join("many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..10_050 {
        std::fs::write(many.join(format!("f{i}")), "").unwrap();
    }
    let b = pooled_backend(&env, 1, Duration::from_secs(600));
    let s = subject(env, &b);
    warm_up(&s, &b, 1);
    let parent = s.create();
    let r = s.sh(&parent, &format!("{EVERY_KIND}\nrm -rf many"));
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let before = status(&b);
    let made = forks_list_as_their_parent(&s, &b, &parent, 1);
    let after = status(&b);
    assert_eq!(after.served, before.served + 1, "{after:?}");
    assert_eq!(
        after.merged, before.merged,
        "mounted, not merged: {after:?}"
    );
    let r = s.sh(&made[0].id, "test ! -e many && echo gone");
    assert_eq!(r.stdout.text, "gone\n", "{r:?}");
    destroy_all(&b, &made, &parent);
}
