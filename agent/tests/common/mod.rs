//! Shared fixture of the agent suites: a small sample repository with a failing test, a real
//! native sandbox backend (under the command policy and the trace, built as the CLI builds it), and
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
use taskbox_core::runtime::RuntimeBuilder;
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
        let api = RuntimeBuilder::new()
            .native(state.clone())
            .command_policy(true)
            .trace(state.join("traces"))
            .build()
            .unwrap();
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
            image: None,
            backend: None,
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

/// A throwaway certificate authority and a server certificate it signed, made with the
/// `openssl` command-line tool in a temporary directory.
pub struct Pki {
    pub dir: tempfile::TempDir,
    /// The CA's certificate (PEM): what a client is given to trust the server.
    pub ca: PathBuf,
    /// The CA's private key (PEM).
    pub ca_key: PathBuf,
    /// The server's certificate (PEM).
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
}

impl Pki {
    /// A CA (with a name of its own) and a server certificate for the DNS names `names`
    /// (subjectAltName). `None` (the test skips, or fails under `TASKBOX_REQUIRE_ALL=1`) when
    /// `openssl` is not installed.
    pub fn new(names: &[&str]) -> Option<Pki> {
        Pki::with_ca_name(None, names)
    }

    /// The same with the CA's subject common name given (two CAs of one name, different keys).
    pub fn with_ca_name(ca_name: Option<&str>, names: &[&str]) -> Option<Pki> {
        let have = std::process::Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !taskbox_tests::require(
            have,
            "the openssl command is not installed (apt-get install openssl)",
        ) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = |name: &str| dir.path().join(name);
        let unique = dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let ca_subject = format!(
            "/CN={}",
            ca_name.map_or_else(|| format!("taskbox test CA {unique}"), str::to_owned)
        );
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-keyout", "ca.key", "-out", "ca.pem", "-days", "2"],
                &["-subj", &ca_subject],
                &["-addext", "basicConstraints=critical,CA:TRUE"],
                &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ]
            .concat(),
        );
        openssl(
            &[
                &["req", "-new"][..],
                &ec,
                &["-keyout", "server.key", "-out", "server.csr"],
                &["-subj", &format!("/CN={}", names[0])],
            ]
            .concat(),
        );
        let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
        std::fs::write(
            p("server.ext"),
            format!(
                "subjectAltName={}\nbasicConstraints=critical,CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
                san.join(",")
            ),
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ]);
        Some(Pki {
            ca: p("ca.pem"),
            ca_key: p("ca.key"),
            cert: p("server.pem"),
            key: p("server.key"),
            dir,
        })
    }

    /// What a mock server presents.
    pub fn server(&self) -> taskbox_agent::mock::MockTls {
        taskbox_agent::mock::MockTls::from_pem_files(&self.cert, &self.key).unwrap()
    }
}
