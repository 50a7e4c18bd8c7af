//! Workers across machines: three `taskbox worker` processes, each in a network namespace of
//! its own with its own state directory, against a three-node NATS JetStream cluster (streams
//! and buckets with three replicas), a scripted model server and a webhook receiver on the
//! host's side of the test's bridge. Thirty tasks complete once each; a NATS node killed
//! mid-run loses none and completes none twice; a schedule seen by all three fires once per
//! window.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use taskbox_queue::testserver::NatsCluster;
use taskbox_queue::{Overlap, Queue, Schedule, ScheduleTiming, Settings, TaskRecord, TaskState};
use taskbox_tests::{is_root, require};

/// The bridge, the cluster, the model and webhook servers, and three workers.
struct Fleet {
    dir: tempfile::TempDir,
    repo: Repo,
    cluster: NatsCluster,
    mock: taskbox_agent::mock::MockServer,
    hook: String,
    hooks: Hooks,
    workers: Vec<WorkerProc>,
    q: Queue,
    // Dropped last: the namespaces outlive the workers in them.
    _net: TestNet,
}

impl Fleet {
    async fn start() -> Option<Fleet> {
        if !require(
            is_root(),
            "the cluster suite makes network namespaces (root)",
        ) {
            return None;
        }
        let net = match TestNet::new(3) {
            Ok(n) => n,
            Err(why) => {
                require(false, &why);
                return None;
            }
        };
        let cluster = match NatsCluster::start(3, &net.host) {
            Ok(c) => c,
            Err(why) => {
                require(false, &why);
                return None;
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let repo = repo(dir.path());
        let mock = model(
            &format!("{}:0", net.host),
            vec![("(fleet)", fix_steps(None))],
        );
        let (hook, hooks) = webhook(&format!("{}:0", net.host));
        // The cluster elects its JetStream leader first: until then making a stream with
        // three replicas fails.
        let since = Instant::now();
        let q = loop {
            match Queue::connect_with(&cluster.url(), Settings { replicas: 3 }).await {
                Ok(q) => break q,
                Err(e) if since.elapsed() < Duration::from_secs(60) => {
                    eprintln!("waiting for the cluster: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("the cluster never formed: {e}"),
            }
        };
        let mut workers = Vec::new();
        let model_url = mock.base_url();
        let url = cluster.url();
        for (i, (ns, _)) in net.hosts.iter().enumerate() {
            workers.push(start_worker(
                dir.path(),
                &format!("w{i}"),
                &WorkerOpts {
                    claim_timeout: "5s",
                    extra: vec!["--replicas".into(), "3".into()],
                    netns: Some(ns.clone()),
                    ..WorkerOpts::new(&url, &model_url)
                },
            ));
        }
        // Every worker connected before the tasks come (a debug build starts slowly).
        let since = Instant::now();
        while !workers.iter().all(|w| w.log().contains("takes tasks from")) {
            assert!(
                since.elapsed() < Duration::from_secs(60),
                "{}",
                workers.iter().map(|w| w.log()).collect::<String>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // ...and each has a pull waiting at the consumer's leader: a pull sent while the
        // consumer's replicas elected their leader is lost, and its worker waits out its bound
        // (2.5 s) before it pulls again, by when one worker may have taken all the tasks.
        let since = Instant::now();
        loop {
            match q.waiting_pulls().await {
                Ok(n) if n >= workers.len() => break,
                r => assert!(
                    since.elapsed() < Duration::from_secs(60),
                    "the workers' pulls never all waited at the consumer: {r:?}\n{}",
                    workers.iter().map(|w| w.log()).collect::<String>()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(Fleet {
            dir,
            repo,
            cluster,
            mock,
            hook,
            hooks,
            workers,
            q,
            _net: net,
        })
    }

    fn logs(&self) -> String {
        self.workers
            .iter()
            .map(|w| format!("== {}\n{}", w.name, w.log()))
            .collect()
    }

    async fn submit(&self, n: usize) -> Vec<String> {
        let actions = format!("[[actions]]\nkind = \"webhook\"\nurl = \"{}\"\n", self.hook);
        let mut ids = Vec::new();
        for i in 0..n {
            let spec = git_spec(&self.repo, contract("fleet", &actions));
            let key = format!("fleet-{i}");
            ids.push(self.q.submit(spec, Some(&key)).await.unwrap().task.id);
        }
        ids
    }

    /// Waits for every task of `ids` to end (a queue call failing while a node is down is
    /// tried again).
    async fn wait_all(&mut self, ids: &[String], within: Duration) -> Vec<TaskRecord> {
        let since = Instant::now();
        loop {
            for w in &mut self.workers {
                if let Ok(Some(status)) = w.child.try_wait() {
                    panic!("worker {} exited ({status}):\n{}", w.name, w.log());
                }
            }
            let mut ended = Vec::new();
            for id in ids {
                match self.q.task(id).await {
                    Ok(t) if t.state.is_final() => ended.push(t),
                    _ => break,
                }
            }
            if ended.len() == ids.len() {
                return ended;
            }
            assert!(
                since.elapsed() < within,
                "{} of {} tasks ended within {within:?}\n{}",
                ended.len(),
                ids.len(),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every task completed, and its action ran exactly once (one webhook call per task, by
    /// its own key).
    fn completed_once(&self, tasks: &[TaskRecord]) {
        for t in tasks {
            assert_eq!(t.state, TaskState::Completed, "{t:#?}\n{}", self.logs());
            assert_eq!(t.result.as_ref().unwrap().turns, 3, "{t:#?}");
        }
        let got = self.hooks.got();
        let keys: BTreeSet<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.len(), got.len(), "an action ran twice: {got:?}");
        let want: BTreeSet<String> = tasks
            .iter()
            .map(|t| format!("taskbox-{}-webhook", t.id))
            .collect();
        let keys: BTreeSet<String> = keys.into_iter().map(str::to_owned).collect();
        assert_eq!(keys, want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_tasks_on_three_workers_and_a_three_node_cluster_complete_once_each() {
    let Some(mut f) = Fleet::start().await else {
        return;
    };
    let ids = f.submit(30).await;
    let tasks = f.wait_all(&ids, Duration::from_secs(240)).await;
    f.completed_once(&tasks);
    // The workers shared them; each task ran once, where a takeover would show as attempt 2.
    let by: BTreeSet<String> = tasks
        .iter()
        .map(|t| t.result.as_ref().unwrap().worker.clone())
        .collect();
    assert!(
        by.len() >= 2,
        "one worker did everything: {by:?}\n{}",
        f.logs()
    );
    assert!(tasks.iter().all(|t| t.attempts == 1), "{tasks:#?}");
    // Stopped, each worker has left no workspace behind.
    for w in &mut f.workers {
        let status = w.term(Duration::from_secs(30));
        assert!(
            status.is_some_and(|s| s.success()),
            "{}: {status:?}\n{}",
            w.name,
            w.log()
        );
    }
    for w in &f.workers {
        let left: Vec<_> = std::fs::read_dir(&w.workspaces)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{}: {left:?}", w.name);
    }
    drop(f.mock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_node_killed_mid_run_loses_no_task_and_completes_none_twice() {
    let Some(mut f) = Fleet::start().await else {
        return;
    };
    let ids = f.submit(30).await;
    // Kill a node once a few tasks have ended, while the rest run or wait.
    let since = Instant::now();
    loop {
        let mut ended = 0;
        for id in &ids {
            if f.q.task(id).await.is_ok_and(|t| t.state.is_final()) {
                ended += 1;
            }
        }
        if ended >= 5 {
            break;
        }
        assert!(since.elapsed() < Duration::from_secs(120), "{}", f.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.cluster.kill(1);
    let tasks = f.wait_all(&ids, Duration::from_secs(300)).await;
    f.completed_once(&tasks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_seen_by_three_workers_fires_once_per_window() {
    let Some(mut f) = Fleet::start().await else {
        return;
    };
    let actions = format!("[[actions]]\nkind = \"webhook\"\nurl = \"{}\"\n", f.hook);
    let sched = Schedule {
        name: "fleet-every-3s".into(),
        timing: ScheduleTiming::Every { ms: 3000 },
        spec: git_spec(&f.repo, contract("fleet", &actions)),
        overlap: Overlap::Queue,
        created_unix_ms: taskbox_queue::now_ms(),
    };
    f.q.add_schedule(&sched).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    f.q.remove_schedule(&sched.name).await.unwrap();
    // Windows already fired end; no more come.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let tasks: Vec<TaskRecord> =
        f.q.tasks()
            .await
            .unwrap()
            .into_iter()
            .filter(|t| t.spec.schedule.is_some())
            .collect();
    let ids: Vec<String> = tasks.iter().map(|t| t.id.clone()).collect();
    let tasks = f.wait_all(&ids, Duration::from_secs(120)).await;
    let windows: BTreeSet<u64> = tasks
        .iter()
        .map(|t| t.spec.schedule.as_ref().unwrap().1)
        .collect();
    assert_eq!(
        windows.len(),
        tasks.len(),
        "a window got two tasks: {tasks:#?}"
    );
    assert!(
        (3..=4).contains(&tasks.len()),
        "{} windows in 10.5 s",
        tasks.len()
    );
    for w in &windows {
        assert_eq!(w % 3000, 0);
    }
    f.completed_once(&tasks);
    // More than one worker looked at the schedule (each logs the windows it fired).
    let firing: Vec<&str> = f
        .workers
        .iter()
        .filter(|w| w.log().contains("schedule fired"))
        .map(|w| w.name.as_str())
        .collect();
    assert!(!firing.is_empty(), "{}", f.logs());
    let _ = &f.dir;
}
