//! `taskbox worker` processes against a real nats-server, a scripted model server and real
//! native sandboxes: a task run to its end with its results and actions, a worker killed
//! mid-task and its task resumed by another from its last turn, bad input that ends in a clear
//! state while the worker goes on, cancel, the maximum duration, SIGTERM's hand-back, metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use taskbox_queue::{ActionState, Queue, TaskState, WorkspaceSource};
use taskbox_tests::taskbox;

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_runs_to_its_end_with_its_results_and_actions_once() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let mock = model("127.0.0.1:0", vec![("(one)", fix_steps(None))]);
    let (hook, hooks) = webhook("127.0.0.1:0");
    let push_to = dir.path().join("pushed.git");
    git(
        dir.path(),
        &["init", "-q", "--bare", push_to.to_str().unwrap()],
    );
    let q = Queue::connect(&nats.url).await.unwrap();
    let actions = format!(
        "[[actions]]\nkind = \"git_push\"\nbranch = \"taskbox/fix-add\"\nremote = \"{}\"\n\
         [[actions]]\nkind = \"webhook\"\nurl = \"{hook}\"\n",
        push_to.display()
    );
    let mut spec = git_spec(&repo, contract("one", &actions));
    spec.tenant = Some("team-a".into());
    let id = q.submit(spec, Some("first")).await.unwrap().task.id;
    let w = start_worker(
        dir.path(),
        "w1",
        &WorkerOpts {
            extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
            ..WorkerOpts::new(&nats.url, &mock.base_url())
        },
    );
    let t = wait_for(&q, &id, MINUTE, || w.log(), |t| t.state.is_final()).await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", w.log());
    assert_eq!(t.attempts, 1);
    let r = t.result.as_ref().unwrap();
    assert_eq!(r.termination, "completed");
    assert_eq!(r.turns, 3);
    assert_eq!(r.worker, "w1");
    assert_eq!(r.files_changed, ["src/math.sh"]);
    assert!(t.claim.is_none());
    // Both actions ran, once each, in order.
    assert_eq!(t.actions.len(), 2, "{:#?}", t.actions);
    assert!(
        t.actions.iter().all(|a| a.state == ActionState::Done),
        "{:#?}",
        t.actions
    );
    let got = hooks.got();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, format!("taskbox-{id}-webhook"));
    assert_eq!(got[0].1["outcome"], "success");
    assert_eq!(got[0].1["files_changed"][0], "src/math.sh");
    // The branch holds one commit on the task's, with the fix; made again, it would be the
    // same commit (fixed author and dates).
    let pushed = git(&push_to, &["rev-parse", "taskbox/fix-add"]);
    assert!(t.actions[0].detail.contains(&pushed), "{:#?}", t.actions);
    assert_eq!(
        git(&push_to, &["rev-parse", "taskbox/fix-add^"]),
        repo.commit
    );
    assert_eq!(
        git(&push_to, &["show", "taskbox/fix-add:src/math.sh"]),
        FIXED.trim()
    );
    assert_eq!(
        git(
            &push_to,
            &["log", "-1", "--format=%an <%ae> %at", "taskbox/fix-add"]
        ),
        format!("taskbox <taskbox@localhost> {}", t.submitted_unix_ms / 1000)
    );

    // The results through the CLI: the report, and the files.
    let out_dir = dir.path().join("results");
    let out = Command::new(taskbox())
        .args(["tasks", "results", &id, "--nats", &nats.url, "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(md.contains("completed"), "{md}");
    let diff = std::fs::read_to_string(out_dir.join("diff.patch")).unwrap();
    assert!(diff.contains("+add() { echo $(( $1 + $2 )); }"), "{diff}");
    for f in ["report.json", "trace.jsonl", "state.json"] {
        assert!(out_dir.join(f).is_file(), "{f}");
    }
    let status = Command::new(taskbox())
        .args(["tasks", "status", &id, "--nats", &nats.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("completed after 3 turns"), "{text}");
    assert!(text.contains("action:    webhook"), "{text}");

    // The metrics: the task, its tenant and its attempt.
    let log = w.log();
    let addr = log
        .lines()
        .find_map(|l| l.split("metrics on http://").nth(1))
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics address in {log}"))
        .to_owned();
    let body = http_get(&addr, "/metrics");
    assert!(
        body.contains("taskbox_worker_tasks_total{tenant=\"team-a\",outcome=\"completed\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("taskbox_worker_attempts_total{tenant=\"team-a\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("taskbox_worker_task_seconds_count{tenant=\"team-a\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("taskbox_worker_queue_wait_seconds_count{tenant=\"team-a\"} 1"),
        "{body}"
    );
    assert!(body.contains("taskbox_worker_running 0"), "{body}");
    assert!(body.contains("taskbox_queue_depth"), "{body}");
    assert!(http_get(&addr, "/healthz").contains("ok"));
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_task_is_resumed_by_another_from_its_last_turn() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    // The second turn's answer waits a minute the first time: the worker is killed then.
    let mock = model(
        "127.0.0.1:0",
        vec![("(kill)", fix_steps(Some(Duration::from_secs(60))))],
    );
    let (hook, hooks) = webhook("127.0.0.1:0");
    let q = Queue::connect(&nats.url).await.unwrap();
    let actions = format!("[[actions]]\nkind = \"webhook\"\nurl = \"{hook}\"\n");
    let id = q
        .submit(git_spec(&repo, contract("kill", &actions)), None)
        .await
        .unwrap()
        .task
        .id;
    let model_url = mock.base_url();
    let opts = WorkerOpts::new(&nats.url, &model_url);
    let mut first = start_worker(dir.path(), "first", &opts);
    // Turn 1 is checkpointed, turn 2 has begun.
    wait_for(
        &q,
        &id,
        MINUTE,
        || first.log(),
        |t| t.checkpoint.is_some_and(|c| c.turn == 1),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.kill9();
    let second = start_worker(dir.path(), "second", &opts);
    let t = wait_for(&q, &id, MINUTE, || second.log(), |t| t.state.is_final()).await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", second.log());
    assert_eq!(t.attempts, 2, "{t:#?}");
    assert!(
        t.reasons[0].contains("attempt 1 on worker first went silent"),
        "{:?}",
        t.reasons
    );
    let r = t.result.as_ref().unwrap();
    assert_eq!(r.worker, "second");
    // Three turns in all: the first by the killed worker, counted once.
    assert_eq!(r.turns, 3, "{r:#?}");
    assert!(
        second.log().contains("resuming from a checkpoint"),
        "{}",
        second.log()
    );
    // The model was asked turn 1 once (done before the kill), turn 2 twice (the killed one
    // and the resumed one), turn 3 once.
    let asked: Vec<usize> = mock
        .received()
        .iter()
        .map(|r| {
            r.body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "assistant")
                .count()
        })
        .collect();
    assert_eq!(asked, [0, 1, 1, 2], "{asked:?}");
    // The action ran once.
    assert_eq!(hooks.got().len(), 1);
    assert_eq!(t.actions[0].state, ActionState::Done);
    assert_eq!(t.actions[0].attempt, 2);
    // The trace of the whole task is one: the resume is in it, after turn 1.
    let trace = q
        .get_artifact(&taskbox_queue::artifact_name(&id, 2, "trace.jsonl"))
        .await
        .unwrap()
        .unwrap();
    let trace = String::from_utf8_lossy(&trace);
    let ends = trace.matches("\"turn_end\"").count();
    assert_eq!(ends, 3, "{trace}");
    assert_eq!(trace.matches("\"resume\"").count(), 1, "{trace}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_ends_in_a_clear_state_and_the_worker_goes_on() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let mock = model("127.0.0.1:0", vec![("(good)", fix_steps(None))]);
    let q = Queue::connect(&nats.url).await.unwrap();
    let w = start_worker(
        dir.path(),
        "w",
        &WorkerOpts::new(&nats.url, &mock.base_url()),
    );
    // A contract the agent cannot read (the CLI would refuse it; the queue takes any text).
    let bad_contract = q
        .submit(git_spec(&repo, "goal = 42\n".into()), None)
        .await
        .unwrap()
        .task
        .id;
    // A repository that is not there: tried twice, then dead.
    let mut unreachable = git_spec(&repo, contract("gone", ""));
    unreachable.workspace = WorkspaceSource::Git {
        url: dir.path().join("no-such-repo.git").display().to_string(),
        commit: repo.commit.clone(),
    };
    unreachable.max_attempts = 2;
    let unreachable = q.submit(unreachable, None).await.unwrap().task.id;
    // A commit the repository does not have: failed at once.
    let mut no_commit = git_spec(&repo, contract("gone", ""));
    no_commit.workspace = WorkspaceSource::Git {
        url: repo.bare.display().to_string(),
        commit: "0123456789abcdef0123456789abcdef01234567".into(),
    };
    let no_commit = q.submit(no_commit, None).await.unwrap().task.id;
    // A workspace object that is not in the store, and a tar that is hostile.
    let mut missing = git_spec(&repo, contract("gone", ""));
    missing.workspace = WorkspaceSource::Object {
        name: "nothing-here.tar".into(),
    };
    let missing = q.submit(missing, None).await.unwrap().task.id;
    q.put_artifact("evil.tar", &evil_tar()).await.unwrap();
    let mut evil = git_spec(&repo, contract("gone", ""));
    evil.workspace = WorkspaceSource::Object {
        name: "evil.tar".into(),
    };
    let evil = q.submit(evil, None).await.unwrap().task.id;
    // A message that is no task, and a task whose record cannot be decoded.
    let client = async_nats::connect(&nats.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.publish(taskbox_queue::SUBJECT, "\u{0}garbage".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let kv = js.get_key_value(taskbox_queue::RECORDS).await.unwrap();
    kv.put("task.task-undecodable", "{\"id\": 7".into())
        .await
        .unwrap();
    js.publish(
        taskbox_queue::SUBJECT,
        "{\"id\":\"task-undecodable\"}".into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    // And then a good task, which the same worker completes.
    let good = q
        .submit(git_spec(&repo, contract("good", "")), None)
        .await
        .unwrap()
        .task
        .id;

    let end = |id: String| {
        let q = q.clone();
        let log = w.log.clone();
        async move {
            wait_for(
                &q,
                &id,
                MINUTE,
                || std::fs::read_to_string(&log).unwrap_or_default(),
                |t| t.state.is_final(),
            )
            .await
        }
    };
    let t = end(bad_contract).await;
    assert_eq!(t.state, TaskState::Failed);
    assert_eq!(t.attempts, 1);
    assert!(t.reasons[0].contains("invalid contract"), "{:?}", t.reasons);
    let t = end(unreachable).await;
    assert_eq!(t.state, TaskState::Dead, "{t:#?}");
    assert_eq!(t.attempts, 2);
    assert!(t.reasons[0].contains("git clone"), "{:?}", t.reasons);
    assert!(
        t.reasons.last().unwrap().contains("out of attempts"),
        "{:?}",
        t.reasons
    );
    let t = end(no_commit).await;
    assert_eq!(t.state, TaskState::Failed, "{t:#?}");
    assert!(
        t.reasons[0].contains("has no commit 0123456789ab"),
        "{:?}",
        t.reasons
    );
    let t = end(missing).await;
    assert_eq!(t.state, TaskState::Failed, "{t:#?}");
    assert!(
        t.reasons[0].contains("no workspace object"),
        "{:?}",
        t.reasons
    );
    let t = end(evil).await;
    assert_eq!(t.state, TaskState::Failed, "{t:#?}");
    assert!(t.reasons[0].contains("refused"), "{:?}", t.reasons);
    // The link led to the test's directory (from WORKSPACES/ID-a1/): nothing was written there.
    assert!(!dir.path().join("escaped").exists());
    let t = end("task-undecodable".into()).await;
    assert_eq!(t.state, TaskState::Failed, "{t:#?}");
    assert!(
        t.reasons[0].contains("cannot be decoded"),
        "{:?}",
        t.reasons
    );
    let t = end(good).await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", w.log());
    assert!(w.log().contains("a message that is no task"), "{}", w.log());
    // Nothing is left waiting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(q.depth().await.unwrap(), 0);
}

/// A tar with an entry that climbs out of the workspace.
fn evil_tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    let data = b"owned\n";
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_link_name("../../escaped").unwrap();
    h.set_size(0);
    b.append_data(&mut h, "link", &[][..]).unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    b.append_data(&mut h, "link/owned", &data[..]).unwrap();
    b.into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_the_maximum_duration_stop_a_running_task() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let slow = || fix_steps(Some(Duration::from_secs(120)));
    let mock = model(
        "127.0.0.1:0",
        vec![("(cancel)", slow()), ("(overtime)", slow())],
    );
    let q = Queue::connect(&nats.url).await.unwrap();
    let w = start_worker(
        dir.path(),
        "w",
        &WorkerOpts {
            claim_timeout: "1500ms",
            extra: vec!["--concurrency".into(), "2".into()],
            ..WorkerOpts::new(&nats.url, &mock.base_url())
        },
    );
    let cancelled = q
        .submit(git_spec(&repo, contract("cancel", "")), None)
        .await
        .unwrap()
        .task
        .id;
    let mut over = git_spec(&repo, contract("overtime", ""));
    over.max_duration_ms = Some(4000);
    let over = q.submit(over, None).await.unwrap().task.id;
    wait_for(
        &q,
        &cancelled,
        MINUTE,
        || w.log(),
        |t| t.checkpoint.is_some(),
    )
    .await;
    let out = Command::new(taskbox())
        .args([
            "tasks",
            "cancel",
            &cancelled,
            "--nats",
            &nats.url,
            "--reason",
            "not needed",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = wait_for(&q, &cancelled, MINUTE, || w.log(), |t| t.result.is_some()).await;
    assert_eq!(t.state, TaskState::Cancelled);
    assert!(
        t.reasons.iter().any(|r| r.contains("not needed")),
        "{:?}",
        t.reasons
    );
    assert!(t.ended_unix_ms.is_some());
    let t = wait_for(&q, &over, MINUTE, || w.log(), |t| t.state.is_final()).await;
    assert_eq!(t.state, TaskState::Failed, "{t:#?}");
    assert!(
        t.reasons
            .iter()
            .any(|r| r.contains("past its maximum duration of 4s")),
        "{:?}",
        t.reasons
    );
    let took = t.ended_unix_ms.unwrap() - t.started_unix_ms.unwrap();
    assert!((4000..15_000).contains(&took), "{took} ms");
    // Its report is stored: the run was stopped and reported, not lost.
    assert!(t.result.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_a_running_task_back_to_another_worker() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    // The second turn waits 3 s the first time; the worker is stopped meanwhile.
    let mock = model(
        "127.0.0.1:0",
        vec![("(handback)", fix_steps(Some(Duration::from_secs(3))))],
    );
    let q = Queue::connect(&nats.url).await.unwrap();
    let id = q
        .submit(git_spec(&repo, contract("handback", "")), None)
        .await
        .unwrap()
        .task
        .id;
    let model_url = mock.base_url();
    let opts = WorkerOpts::new(&nats.url, &model_url);
    let mut first = start_worker(dir.path(), "first", &opts);
    wait_for(&q, &id, MINUTE, || first.log(), |t| t.checkpoint.is_some()).await;
    let status = first.term(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        first.log()
    );
    let t = q.task(&id).await.unwrap();
    assert_eq!(t.state, TaskState::Queued, "{t:#?}\n{}", first.log());
    assert_eq!(t.attempts, 0, "a hand-back is not a failed attempt");
    assert!(
        t.reasons[0].contains("handed back by worker first"),
        "{:?}",
        t.reasons
    );
    let second = start_worker(dir.path(), "second", &opts);
    let t = wait_for(&q, &id, MINUTE, || second.log(), |t| t.state.is_final()).await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}");
    assert_eq!(t.attempts, 1);
    assert_eq!(t.result.unwrap().turns, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_handed_in_as_a_tar_is_the_task_s_workspace() {
    let Some(nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let mock = model("127.0.0.1:0", vec![("(tarball)", fix_steps(None))]);
    let q = Queue::connect(&nats.url).await.unwrap();
    // The source tree (with its .git), and a symbolic link in it.
    let src = dir.path().join("src-repo");
    std::os::unix::fs::symlink("src/math.sh", src.join("math-link")).unwrap();
    let c = dir.path().join("contract.toml");
    std::fs::write(&c, contract("tarball", "")).unwrap();
    let submit = || {
        Command::new(taskbox())
            .args(["submit", "--nats", &nats.url, "--contract"])
            .arg(&c)
            .arg("--workspace")
            .arg(&src)
            .output()
            .unwrap()
    };
    let first = submit();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(String::from_utf8_lossy(&first.stderr).contains("stored the workspace as workspaces/"));
    let id = String::from_utf8_lossy(&first.stdout).trim().to_owned();
    // The same tree again: the same object, not stored twice.
    let second = submit();
    assert!(second.status.success());
    assert!(!String::from_utf8_lossy(&second.stderr).contains("stored the workspace"));
    let t = q.task(&id).await.unwrap();
    let WorkspaceSource::Object { name } = &t.spec.workspace else {
        panic!("{t:#?}")
    };
    assert!(
        name.starts_with("workspaces/") && name.ends_with(".tar"),
        "{name}"
    );
    let w = start_worker(
        dir.path(),
        "w",
        &WorkerOpts::new(&nats.url, &mock.base_url()),
    );
    let t = wait_for(&q, &id, MINUTE, || w.log(), |t| t.state.is_final()).await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", w.log());
    let diff = q
        .get_artifact(&taskbox_queue::artifact_name(&id, 1, "diff.patch"))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&diff).contains("+add() { echo $(( $1 + $2 )); }"));
    let _ = repo;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_the_docker_backend_runs_its_task_in_a_container() {
    let Some(nats) = ready() else { return };
    if !taskbox_tests::require(
        taskbox_tests::docker_available(),
        "no Docker daemon answers (the worker's Docker backend)",
    ) || !taskbox_tests::ensure_image("busybox")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path());
    let mock = model("127.0.0.1:0", vec![("(docker)", fix_steps(None))]);
    let q = Queue::connect(&nats.url).await.unwrap();
    let id = q
        .submit(git_spec(&repo, contract("docker", "")), None)
        .await
        .unwrap()
        .task
        .id;
    let mut w = start_worker(
        dir.path(),
        "w",
        &WorkerOpts {
            extra: ["--backend", "docker", "--image", "busybox"]
                .map(String::from)
                .to_vec(),
            env: vec![(
                "TASKBOX_IMAGE_DIR".into(),
                taskbox_tests::test_image_dir().display().to_string(),
            )],
            ..WorkerOpts::new(&nats.url, &mock.base_url())
        },
    );
    let t = wait_for(
        &q,
        &id,
        Duration::from_secs(180),
        || w.log(),
        |t| t.state.is_final(),
    )
    .await;
    assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", w.log());
    // The sandbox was a container of the image: its trace says so.
    let state = q
        .get_artifact(&taskbox_queue::artifact_name(&id, 1, "state.json"))
        .await
        .unwrap()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state).unwrap();
    assert_eq!(state["backend"], "docker", "{state:#}");
    assert_eq!(state["image"], "busybox");
    let trace = std::fs::read_dir(w.state.join("traces"))
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect::<String>();
    assert!(trace.contains("\"backend\":\"docker\""), "{trace}");
    // Stopped as a worker is: it finishes the ended attempt's cleanup (which runs after the
    // ack), and the container's host mounts (its disk, overlay and lower layer) go with it.
    let status = w.term(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        w.log()
    );
    let state_dir = w.state.display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let left: Vec<&str> = mounts.lines().filter(|l| l.contains(&state_dir)).collect();
    assert!(left.is_empty(), "mounts left on the host: {left:#?}");
}

/// A worker started before its queue answers waits for it (saying so), and one given a
/// `--nats` that is no URL stops at once with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_before_its_queue_waits_for_it() {
    let Some(_nats) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mock = model("127.0.0.1:0", vec![]);
    let port = taskbox_queue::testserver::free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let mut w = start_worker(
        dir.path(),
        "early",
        &WorkerOpts::new(&url, &mock.base_url()),
    );
    let until = |w: &WorkerProc, what: &str, within: Duration| {
        let since = Instant::now();
        while !w.log().contains(what) {
            assert!(since.elapsed() < within, "no {what:?} in: {}", w.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    until(&w, "does not answer yet", Duration::from_secs(30));
    assert!(w.child.try_wait().unwrap().is_none(), "{}", w.log());
    let _late = taskbox_queue::testserver::NatsServer::start_on(port).unwrap();
    until(&w, "takes tasks from", Duration::from_secs(30));
    let status = w.term(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        w.log()
    );

    let mut bad = start_worker(
        dir.path(),
        "bad",
        &WorkerOpts::new("http://127.0.0.1:1", &mock.base_url()),
    );
    let status = bad.exit_within(Duration::from_secs(20));
    let status = status.unwrap_or_else(|| panic!("still running: {}", bad.log()));
    assert!(!status.success());
    assert!(bad.log().contains("is not a NATS URL"), "{}", bad.log());
}
