//! The agent loop against `taskbox serve` over its Unix socket: the same loop, the HTTP
//! implementation of the narrow API, and the command policy's `ask` answered through the
//! exec's event stream and the approvals routes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::Provider;
use taskbox_agent::remote::Remote;
use taskbox_agent::{Approver, Decision, Termination};
use taskbox_core::api::{Approval, SandboxApi};
use taskbox_core::runtime::RuntimeBuilder;

struct Supervisor {
    socket: std::path::PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn supervisor(state: &std::path::Path) -> Supervisor {
    let socket = state.join("taskbox.sock");
    let mut config = taskbox_server::ServerConfig::new(state.to_path_buf());
    config.socket = Some(socket.clone());
    let backend = RuntimeBuilder::new()
        .native(state.to_path_buf())
        .command_policy(true)
        .trace(state.join("traces"))
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(taskbox_server::serve(config, backend, async {
            let _ = rx.await;
        }))
        .unwrap();
    });
    let until = Instant::now() + Duration::from_secs(20);
    while !socket.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(socket.exists(), "the supervisor did not start");
    Supervisor {
        socket,
        stop: Some(tx),
        thread: Some(thread),
    }
}

struct Deny;
impl Approver for Deny {
    fn decide(&self, approval: &Approval) -> Decision {
        Decision::Deny(format!("no {} here", approval.command))
    }
}

#[test]
fn the_loop_runs_against_the_http_api() {
    let fx = Fx::new();
    let state = fx.env.dir.path().join("serve-state");
    std::fs::create_dir_all(&state).unwrap();
    let sup = supervisor(&state);
    let api: Arc<dyn SandboxApi> =
        Arc::new(Remote::new(&format!("unix:{}", sup.socket.display()), None).unwrap());

    let policy = fx.env.policy("ask", "[commands]\nask = [\"touch\"]\n");
    let mut steps = vec![Step::call("exec", json!({"command": "touch x.txt"}))];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut spec = fx.spec(fx.contract());
    spec.policy = Some(policy.display().to_string());
    let mut opts = fx.options();
    opts.approver = Arc::new(Deny);
    let model = model_config(&mock, Provider::Openai).build().unwrap();
    let report = taskbox_agent::start(api.clone(), model, spec, opts).unwrap();
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.approvals_asked, 1);
    let denied = last_content(&mock.received()[1].body);
    assert!(denied.contains("no touch x.txt here"), "{denied}");
    assert_eq!(report.files_changed, ["src/math.sh"]);
    // The sandbox lives on in the supervisor, with its checkpoints, for export or resume.
    let id = taskbox_core::api::SandboxId::parse(&report.sandbox).unwrap();
    let info = api.info(&id).unwrap();
    assert_eq!(info.checkpoints.len(), 5);
    // The supervisor's own trace recorded the agent's operations.
    let trace = std::fs::read_to_string(state.join("traces").join(format!("{id}.jsonl"))).unwrap();
    assert!(trace.contains("\"op\":\"edit\""));
    assert!(trace.contains("\"op\":\"deny\""));
    api.destroy(&id).unwrap();
}

#[test]
fn an_ask_left_to_the_api_is_answered_by_a_person_through_it() {
    let fx = Fx::new();
    let state = fx.env.dir.path().join("serve-state");
    std::fs::create_dir_all(&state).unwrap();
    let sup = supervisor(&state);
    let url = format!("unix:{}", sup.socket.display());
    let api: Arc<dyn SandboxApi> = Arc::new(Remote::new(&url, None).unwrap());

    let policy = fx.env.policy("ask", "[commands]\nask = [\"touch\"]\n");
    let mut steps = vec![Step::call("exec", json!({"command": "touch approved.txt"}))];
    steps.extend(fixing_steps());
    let mock = MockServer::start(Provider::Openai, steps).unwrap();
    let mut spec = fx.spec(fx.contract());
    spec.policy = Some(policy.display().to_string());
    let mut opts = fx.options();
    opts.approver = Arc::new(taskbox_agent::agent::ThroughTheApi);
    let model = model_config(&mock, Provider::Openai).build().unwrap();

    // The person: another client of the same supervisor.
    let person = std::thread::spawn(move || {
        let client = Remote::new(&url, None).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            for info in client.list() {
                if let Ok(list) = client.list_approvals(&info.id, Some(Duration::from_millis(200)))
                    && let Some(a) = list.first()
                {
                    client.approve(&info.id, &a.id).unwrap();
                    return a.command.clone();
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("no approval appeared");
    });
    let report = taskbox_agent::start(api.clone(), model, spec, opts).unwrap();
    assert_eq!(person.join().unwrap(), "touch approved.txt");
    assert_eq!(report.termination, Termination::Completed, "{report:#?}");
    assert_eq!(report.metrics.approvals_asked, 1);
    assert!(report.files_changed.iter().any(|f| f == "approved.txt"));
    // The person's answer reached the agent through the exec's event stream (`answered`), and
    // its trace keeps it for a replay.
    let trace = std::fs::read_to_string(fx.task_dir.join("trace.jsonl")).unwrap();
    let approval = trace
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["type"] == "approval")
        .expect("an approval record in the agent's trace");
    assert_eq!(approval["command"], "touch approved.txt", "{approval}");
    assert_eq!(approval["state"], "approved", "{approval}");
    api.destroy(&taskbox_core::api::SandboxId::parse(&report.sandbox).unwrap())
        .unwrap();
}
