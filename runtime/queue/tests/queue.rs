//! The queue against real nats-server processes (JetStream on, loopback, a store directory of
//! their own), started and killed by each test.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::time::{Duration, Instant};

use taskbox_queue::schedule::Fired;
use taskbox_queue::testserver::{NatsServer, free_port};
use taskbox_queue::{
    ClaimDecision, Overlap, Queue, QueueError, Schedule, ScheduleTiming, TaskSpec, TaskState,
    WorkspaceSource, artifact_name, key_entry,
};
use taskbox_workspace::testutil::skip;

/// Starts a server, or says why it cannot (and the test returns).
fn server() -> Option<NatsServer> {
    NatsServer::start().map_err(|why| skip(&why)).ok()
}

fn spec(commit: &str) -> TaskSpec {
    TaskSpec {
        contract: "goal = \"make the tests pass\"\n".into(),
        workspace: WorkspaceSource::Git {
            url: "https://example.invalid/repo.git".into(),
            commit: commit.into(),
        },
        tenant: Some("team-a".into()),
        max_attempts: 3,
        max_duration_ms: None,
        after: None,
        schedule: None,
    }
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[tokio::test]
async fn a_retried_submit_is_the_same_task() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let first = q.submit(spec(COMMIT), Some("pr-12")).await.unwrap();
    let again = q.submit(spec(COMMIT), Some("pr-12")).await.unwrap();
    assert!(first.new);
    assert!(!again.new);
    assert_eq!(first.task.id, again.task.id);
    assert_eq!(again.task.state, TaskState::Queued);
    // The retry published again (its first submit might have died before its message): the
    // stream kept one, by the message id.
    assert_eq!(q.depth().await.unwrap(), 1);
    let other = q.submit(spec(COMMIT), Some("pr-13")).await.unwrap();
    assert!(other.new);
    assert_ne!(other.task.id, first.task.id);
    let unkeyed = q.submit(spec(COMMIT), None).await.unwrap();
    assert!(unkeyed.new);
    let all = q.tasks().await.unwrap();
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!(q.depth().await.unwrap(), 3);
    assert_eq!(q.task(&first.task.id).await.unwrap(), first.task);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submits_racing_with_one_key_make_one_task() {
    let Some(s) = server() else { return };
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(Queue::connect(&s.url).await.unwrap());
    }
    let handles: Vec<_> = clients
        .into_iter()
        .map(|q| tokio::spawn(async move { q.submit(spec(COMMIT), Some("nightly-1")).await }))
        .collect();
    let mut ids = Vec::new();
    let mut fresh = 0;
    for h in handles {
        let done = h.await.unwrap().unwrap();
        fresh += usize::from(done.new);
        ids.push(done.task.id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(fresh, 1, "exactly one submit made the task");
    let q = Queue::connect(&s.url).await.unwrap();
    assert_eq!(q.tasks().await.unwrap().len(), 1);
    assert_eq!(q.depth().await.unwrap(), 1);
}

#[tokio::test]
async fn the_same_key_with_another_spec_is_refused() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let first = q.submit(spec(COMMIT), Some("k")).await.unwrap();
    let e = q
        .submit(spec("89abcdef0123456789abcdef0123456789abcdef"), Some("k"))
        .await
        .unwrap_err();
    assert!(matches!(e, QueueError::Invalid { .. }), "{e}");
    assert!(e.to_string().contains(&first.task.id), "{e}");
    assert_eq!(q.tasks().await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_submit_that_died_after_taking_its_key_is_finished_by_the_next() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    // What a submit leaves when it dies right after its key: the key names an id that has no
    // record and no message.
    let client = async_nats::connect(&s.url).await.unwrap();
    let kv = async_nats::jetstream::new(client)
        .get_key_value(taskbox_queue::RECORDS)
        .await
        .unwrap();
    kv.create(key_entry("half-done"), "task-00000000000000ab".into())
        .await
        .unwrap();
    let done = q.submit(spec(COMMIT), Some("half-done")).await.unwrap();
    assert_eq!(done.task.id, "task-00000000000000ab");
    assert_eq!(done.task.state, TaskState::Queued);
    assert_eq!(q.depth().await.unwrap(), 1);
    let again = q.submit(spec(COMMIT), Some("half-done")).await.unwrap();
    assert!(!again.new);
    assert_eq!(q.depth().await.unwrap(), 1);
}

#[tokio::test]
async fn cancel_ends_a_queued_task_and_refuses_an_ended_one() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let t = q.submit(spec(COMMIT), None).await.unwrap().task;
    let cancelled = q.cancel(&t.id, "superseded").await.unwrap();
    assert_eq!(cancelled.state, TaskState::Cancelled);
    assert_eq!(cancelled.reasons, vec!["cancelled: superseded".to_string()]);
    assert_eq!(q.task(&t.id).await.unwrap().state, TaskState::Cancelled);
    let e = q.cancel(&t.id, "again").await.unwrap_err();
    assert!(
        matches!(
            e,
            QueueError::Ended {
                state: TaskState::Cancelled,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cancelled"), "{e}");
    let e = q.cancel("task-ffffffffffffffff", "x").await.unwrap_err();
    assert!(matches!(e, QueueError::NotFound(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_changes_of_one_record_all_land() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let id = q.submit(spec(COMMIT), None).await.unwrap().task.id;
    // Sixteen writers each count one attempt: compare-and-set loses none of them.
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let q = q.clone();
            let id = id.clone();
            tokio::spawn(async move {
                q.update(&id, |t| {
                    t.attempts += 1;
                    t.reasons.push(format!("writer {i}"));
                    Ok(())
                })
                .await
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap().unwrap();
    }
    let t = q.task(&id).await.unwrap();
    assert_eq!(t.attempts, 16);
    assert_eq!(t.reasons.len(), 16);
}

#[tokio::test]
async fn a_second_worker_shares_the_queue_and_a_bad_spec_is_refused() {
    let Some(s) = server() else { return };
    let a = Queue::connect(&s.url).await.unwrap();
    let b = Queue::connect(&s.url).await.unwrap();
    let t = a.submit(spec(COMMIT), Some("shared")).await.unwrap().task;
    assert_eq!(b.task(&t.id).await.unwrap(), t);
    let e = b.submit(spec("main"), None).await.unwrap_err();
    assert!(e.to_string().contains("commit id"), "{e}");
    let e = b.submit(spec(COMMIT), Some("")).await.unwrap_err();
    assert!(e.to_string().contains("idempotency key"), "{e}");
    assert_eq!(a.tasks().await.unwrap().len(), 1);
}

#[tokio::test]
async fn an_unreachable_server_is_a_clear_error() {
    let url = format!("nats://127.0.0.1:{}", free_port());
    let since = Instant::now();
    let e = Queue::connect(&url).await.unwrap_err();
    assert!(since.elapsed() < Duration::from_secs(10));
    let text = e.to_string();
    assert!(text.contains(&url) && text.contains("-js"), "{text}");
}

#[tokio::test]
async fn a_claim_fences_the_worker_and_a_silent_one_is_taken_over() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let id = q.submit(spec(COMMIT), None).await.unwrap().task.id;
    let timeout = Duration::from_millis(600);
    let (d, t) = q.claim(&id, "w1", timeout).await.unwrap();
    assert_eq!(
        d,
        ClaimDecision::Run {
            attempt: 1,
            takeover: false
        }
    );
    assert_eq!(t.state, TaskState::Running);
    // A second worker at once: it must wait, and nothing changes.
    let (d, t2) = q.claim(&id, "w2", timeout).await.unwrap();
    assert!(matches!(d, ClaimDecision::Wait { .. }), "{d:?}");
    assert_eq!(t2, t);
    q.heartbeat(&id, "w1", 1).await.unwrap();
    q.put_artifact(&artifact_name(&id, 1, "state.json"), b"{\"turn\":1}")
        .await
        .unwrap();
    // w1 goes silent: w2 takes over, and w1's next change is refused.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (d, t) = q.claim(&id, "w2", timeout).await.unwrap();
    assert_eq!(
        d,
        ClaimDecision::Run {
            attempt: 2,
            takeover: true
        }
    );
    assert_eq!(t.claim.as_ref().unwrap().worker, "w2");
    let e = q.heartbeat(&id, "w1", 1).await.unwrap_err();
    assert!(matches!(e, QueueError::ClaimLost { .. }), "{e}");
    assert!(e.to_string().contains("attempt 2 on worker w2"), "{e}");
    // The artifacts of attempt 1 are there for the resume; a missing one is None.
    assert_eq!(
        q.get_artifact(&artifact_name(&id, 1, "state.json"))
            .await
            .unwrap()
            .unwrap(),
        b"{\"turn\":1}"
    );
    assert!(
        q.get_artifact(&artifact_name(&id, 2, "state.json"))
            .await
            .unwrap()
            .is_none()
    );
    // A cancel is seen by the holder's heartbeat, which may still finish it.
    q.cancel(&id, "by a test").await.unwrap();
    let t = q.heartbeat(&id, "w2", 2).await.unwrap();
    assert_eq!(t.state, TaskState::Cancelled);
}

#[tokio::test]
async fn an_undecodable_record_is_marked_failed() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let client = async_nats::connect(&s.url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let kv = js.get_key_value(taskbox_queue::RECORDS).await.unwrap();
    kv.put("task.task-broken", "{not json".into())
        .await
        .unwrap();
    let e = q.task("task-broken").await.unwrap_err();
    assert!(e.to_string().contains("cannot be read"), "{e}");
    q.fail_undecodable("task-broken").await.unwrap();
    let t = q.task("task-broken").await.unwrap();
    assert_eq!(t.state, TaskState::Failed);
    assert!(
        t.reasons[0].contains("cannot be decoded"),
        "{:?}",
        t.reasons
    );
    assert!(t.reasons[0].contains("{not json"), "{:?}", t.reasons);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_schedule_seen_by_three_workers_fires_once_per_window() {
    let Some(s) = server() else { return };
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(Queue::connect(&s.url).await.unwrap());
    }
    let now = taskbox_queue::now_ms();
    let sched = Schedule {
        name: "every-second".into(),
        timing: ScheduleTiming::Every { ms: 1000 },
        spec: spec(COMMIT),
        overlap: Overlap::Queue,
        created_unix_ms: now,
    };
    workers[0].add_schedule(&sched).await.unwrap();
    let e = workers[1].add_schedule(&sched).await.unwrap_err();
    assert!(e.to_string().contains("exists already"), "{e}");
    // Each worker looks every 100 ms for 3.5 s.
    let mut handles = Vec::new();
    for q in workers.clone() {
        let sched = sched.clone();
        handles.push(tokio::spawn(async move {
            let mut fired = Vec::new();
            let until = Instant::now() + Duration::from_millis(3500);
            while Instant::now() < until {
                if let Some(f) = q.fire(&sched, taskbox_queue::now_ms()).await.unwrap() {
                    fired.push(f);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            fired
        }));
    }
    let mut fired = Vec::new();
    for h in handles {
        fired.extend(h.await.unwrap());
    }
    let tasks = workers[0].tasks().await.unwrap();
    let mut windows: Vec<u64> = tasks
        .iter()
        .map(|t| t.spec.schedule.as_ref().unwrap().1)
        .collect();
    windows.sort();
    let n = windows.len();
    windows.dedup();
    assert_eq!(windows.len(), n, "a window got two tasks: {tasks:#?}");
    assert!((3..=4).contains(&n), "{n} windows in 3.5 s: {fired:?}");
    assert_eq!(fired.len(), n, "{fired:?}");
    // Overlap `queue`: each window's task runs after the one before (none ended here).
    let mut by_window = tasks.clone();
    by_window.sort_by_key(|t| t.spec.schedule.as_ref().unwrap().1);
    for pair in by_window.windows(2) {
        assert_eq!(pair[1].spec.after.as_deref(), Some(pair[0].id.as_str()));
    }
    // Removed: no more windows.
    workers[0].remove_schedule("every-second").await.unwrap();
    assert!(workers[0].schedules().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_skipping_schedule_gives_no_task_while_the_last_one_runs() {
    let Some(s) = server() else { return };
    let q = Queue::connect(&s.url).await.unwrap();
    let sched = Schedule {
        name: "nightly".into(),
        timing: ScheduleTiming::Every { ms: 1000 },
        spec: spec(COMMIT),
        overlap: Overlap::Skip,
        created_unix_ms: 0,
    };
    q.add_schedule(&sched).await.unwrap();
    let first = match q.fire(&sched, 10_500).await.unwrap() {
        Some(Fired::Submitted { task, .. }) => task,
        f => panic!("{f:?}"),
    };
    assert_eq!(
        q.fire(&sched, 10_900).await.unwrap(),
        None,
        "the same window"
    );
    // Its task is queued (not ended): the next window is skipped.
    assert_eq!(
        q.fire(&sched, 11_100).await.unwrap(),
        Some(Fired::Skipped {
            window_unix_ms: 11_000,
            running: first.clone()
        })
    );
    q.cancel(&first, "done with it").await.unwrap();
    match q.fire(&sched, 12_100).await.unwrap() {
        Some(Fired::Submitted { window_unix_ms, .. }) => assert_eq!(window_unix_ms, 12_000),
        f => panic!("{f:?}"),
    }
    assert_eq!(q.window_state("nightly").await.unwrap().unwrap().skipped, 1);
}
