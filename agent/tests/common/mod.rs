//! Shared fixture of the agent suites: a small sample repository with a failing test, a real
//! native sandbox backend (wrapped in the command policy and the trace, as the CLI does), and
//! model configurations pointing at a scripted mock server.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use taskbox_agent::contract::Contract;
use taskbox_agent::mock::{MockServer, Step};
use taskbox_agent::model::{ModelConfig, Provider};
use taskbox_agent::{Options, Report, TaskSpec};
use taskbox_core::api::SandboxApi;
use taskbox_core::approvals::CommandPolicy;
use taskbox_core::sandbox::NativeBackend;
use taskbox_core::trace::Traced;
use taskbox_tests::Env;

pub const BUGGY: &str = "add() { echo $(( $1 - $2 )); }\n";
pub const FIXED: &str = "add() { echo $(( $1 + $2 )); }\n";
pub const TEST: &str = ". ./src/math.sh\nr=$(add 2 3)\n[ \"$r\" = 5 ] || { echo \"FAIL: add 2 3 gave $r, want 5\"; exit 1; }\necho ok\n";

pub struct Fx {
    pub env: Env,
    pub api: Arc<dyn SandboxApi>,
    pub task_dir: PathBuf,
}

impl Fx {
    pub fn new() -> Fx {
        let env = Env::new();
        env.write("src/math.sh", BUGGY);
        env.write("tests/test_math.sh", TEST);
        env.write("AGENTS.md", "Use POSIX sh only.\n");
        env.write("README.md", "A tiny calculator.\n");
        let state = env.state();
        let native = NativeBackend::new(state.clone()).unwrap();
        let api: Arc<dyn SandboxApi> = Arc::new(Traced::new(
            CommandPolicy::new(native),
            state.join("traces"),
        ));
        let task_dir = env.dir.path().join("task");
        Fx { env, api, task_dir }
    }

    pub fn contract(&self) -> Contract {
        let mut c = Contract::with_goal("make tests/test_math.sh pass");
        c.verify = vec!["sh tests/test_math.sh".into()];
        c.budget.exec_timeout_ms = 30_000;
        c
    }

    pub fn spec(&self, contract: Contract) -> TaskSpec {
        TaskSpec {
            contract,
            workspace: self.env.ws().display().to_string(),
            policy: None,
        }
    }

    pub fn options(&self) -> Options {
        Options::new(&self.task_dir)
    }

    /// Runs a task with a model at `mock`.
    pub fn run(&self, mock: &MockServer, provider: Provider, contract: Contract) -> Report {
        self.run_with(mock, provider, contract, self.options())
    }

    pub fn run_with(
        &self,
        mock: &MockServer,
        provider: Provider,
        contract: Contract,
        opts: Options,
    ) -> Report {
        let model = model_config(mock, provider).build().unwrap();
        taskbox_agent::start(self.api.clone(), model, self.spec(contract), opts).unwrap()
    }
}

pub fn model_config(mock: &MockServer, provider: Provider) -> ModelConfig {
    let mut cfg = ModelConfig::new(provider, &mock.base_url(), "mock-model");
    cfg.api_key = Some("test-key".into());
    cfg.backoff_ms = 10;
    cfg.max_retries = 2;
    cfg.timeout_secs = 20;
    cfg
}

/// The steps that fix the sample repository: read, edit, test, finish.
pub fn fixing_steps() -> Vec<Step> {
    vec![
        Step::call("read_file", json!({"path": "src/math.sh"})),
        Step::call(
            "edit_file",
            json!({"path": "src/math.sh", "old": "$1 - $2", "new": "$1 + $2"}),
        ),
        Step::call("exec", json!({"command": "sh tests/test_math.sh"})),
        Step::call(
            "finish",
            json!({"summary": "add used subtraction; now it adds"}),
        ),
    ]
}

/// The messages of a received OpenAI request.
pub fn messages(body: &Value) -> &Vec<Value> {
    body["messages"].as_array().unwrap()
}

/// The last message's text of a received OpenAI request.
pub fn last_content(body: &Value) -> String {
    messages(body)
        .last()
        .unwrap()
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}
