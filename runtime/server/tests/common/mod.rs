//! Test helpers: serve the router on 127.0.0.1:0, and a recording in-memory backend.
//!
//! `FakeBackend` is a TEST-ONLY stand-in for the native backend. It does the minimum the HTTP
//! layer needs (sandboxes in a map, files in a map, scripted execs) and records every call so
//! tests can check that refused requests never reach the backend. Suites that exercise the
//! server's own behaviour (auth, tenancy, quotas, limits, SSE framing, OpenAPI, metrics, leases)
//! use it because it is deterministic and lets a test hold an exec open; `native.rs` runs the
//! same routes against the real backend.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use taskbox_core::api::*;
use taskbox_core::changes::DiffStats;
use taskbox_core::result::{Enforcement, ExecResult, Output, Resources, Violation};
use taskbox_server::{AppState, Auth, Limits, Tokens, router};

pub const ALICE: &str = "alice-token-0123456789";
pub const BOB: &str = "bob-token-0123456789ab";

pub fn tokens() -> Tokens {
    Tokens::parse(&format!(
        "[[token]]\ntoken = \"{ALICE}\"\ntenant = \"alice\"\n\
         [[token]]\ntoken = \"{BOB}\"\ntenant = \"bob\"\n"
    ))
    .unwrap()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[derive(Default)]
struct Inner {
    sandboxes: BTreeMap<SandboxId, SandboxInfo>,
    files: BTreeMap<(SandboxId, String), String>,
    calls: Vec<String>,
    /// How long each create takes.
    create_delay: Duration,
    /// The next create fails `unavailable` with this message.
    fail_next_create: Option<String>,
}

/// TEST-ONLY in-memory backend (see the module doc).
#[derive(Default, Clone)]
pub struct FakeBackend {
    inner: Arc<Mutex<Inner>>,
}

pub fn finished(stdout: &str, violations: Vec<Violation>) -> ExecResult {
    ExecResult {
        exit_code: Some(0),
        signal: None,
        timed_out: false,
        duration_ms: 1,
        stdout: Output {
            text: stdout.to_string(),
            bytes: stdout.len() as u64,
            truncated: false,
            spill_path: None,
        },
        stderr: Output::default(),
        changes: Vec::new(),
        violations,
        resources: Resources::default(),
        enforcement: Enforcement {
            landlock: "full".into(),
            seccomp: true,
            network: "none".into(),
            limits: "rlimit".into(),
            disk: "none".into(),
        },
        network: None,
        findings: Vec::new(),
        findings_omitted: 0,
        tests: None,
        ignored_changes: 0,
    }
}

fn process_info(exec_id: u64) -> ProcessInfo {
    ProcessInfo {
        exec_id,
        argv: vec!["fake".into()],
        running: false,
        stdout: Output::default(),
        stderr: Output::default(),
        result: Some(finished("", Vec::new())),
    }
}

impl FakeBackend {
    pub fn calls(&self) -> Vec<String> {
        self.inner.lock().unwrap().calls.clone()
    }

    pub fn clear_calls(&self) {
        self.inner.lock().unwrap().calls.clear();
    }

    fn record(&self, call: String) {
        self.inner.lock().unwrap().calls.push(call);
    }

    /// Adds a sandbox as if it had been created before the server started.
    pub fn preload(&self, labels: &[(&str, &str)], expires_at_ms: Option<u64>) -> SandboxId {
        let id = SandboxId::generate();
        let info = info(
            &id,
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            expires_at_ms,
        );
        self.inner
            .lock()
            .unwrap()
            .sandboxes
            .insert(id.clone(), info);
        id
    }

    pub fn exists(&self, id: &SandboxId) -> bool {
        self.inner.lock().unwrap().sandboxes.contains_key(id)
    }

    /// Makes every create take `d` (so that requests overlap).
    pub fn set_create_delay(&self, d: Duration) {
        self.inner.lock().unwrap().create_delay = d;
    }

    /// Makes the next create fail `unavailable` (as a backend whose daemon is gone).
    pub fn fail_next_create(&self, message: &str) {
        self.inner.lock().unwrap().fail_next_create = Some(message.to_string());
    }

    /// How many calls named `op` reached the backend.
    pub fn count(&self, op: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.split(' ').next() == Some(op))
            .count()
    }
}

fn info(
    id: &SandboxId,
    labels: BTreeMap<String, String>,
    expires_at_ms: Option<u64>,
) -> SandboxInfo {
    SandboxInfo {
        id: id.clone(),
        backend: "fake".into(),
        workspace: "/nonexistent".into(),
        policy: "default".into(),
        policy_hash: "0".into(),
        image: "host".into(),
        enforcement: Enforcement {
            landlock: "full".into(),
            seccomp: true,
            network: "none".into(),
            limits: "rlimit".into(),
            disk: "none".into(),
        },
        labels,
        created_at_ms: now_ms(),
        expires_at_ms,
        state: "running".into(),
        checkpoints: Vec::new(),
        lost_cause: None,
        forked_from: None,
    }
}

impl FakeBackend {
    /// Scripted commands: `echo ARGS...` streams each arg as a stdout chunk; `sleep MS` holds
    /// the exec open; `violate KIND` reports a violation; `false-start` fails before starting.
    fn run(
        &self,
        req: ExecRequest,
        mut events: Option<&mut (dyn FnMut(ExecEvent) + Send)>,
    ) -> Result<ExecOutcome, ApiError> {
        let argv = req.resolved_argv()?;
        if argv[0] == "false-start" {
            return Err(ApiError::invalid(
                "cannot start false-start: no such command",
            ));
        }
        if req.background {
            return Ok(ExecOutcome::Background(ProcessInfo {
                running: true,
                result: None,
                argv: argv.clone(),
                ..process_info(7)
            }));
        }
        let mut emit = |ev: ExecEvent| {
            if let Some(f) = events.as_mut() {
                f(ev);
            }
        };
        emit(ExecEvent::Started { exec_id: 1 });
        let mut out = String::new();
        let mut violations = Vec::new();
        match argv[0].as_str() {
            "echo" => {
                for a in &argv[1..] {
                    let chunk = format!("{a}\n");
                    out.push_str(&chunk);
                    emit(ExecEvent::Stdout { data: chunk });
                }
                emit(ExecEvent::Stderr {
                    data: "done\n".into(),
                });
            }
            "sleep" => {
                let ms: u64 = argv.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
                std::thread::sleep(Duration::from_millis(ms));
            }
            "violate" => violations.push(Violation {
                kind: argv.get(1).cloned().unwrap_or_default(),
                detail: "refused".into(),
            }),
            _ => {}
        }
        let result = finished(&out, violations);
        emit(ExecEvent::Ended {
            result: Box::new(result.clone()),
        });
        Ok(ExecOutcome::Finished(result))
    }

    fn read_file(&self, id: &SandboxId, req: ReadRequest) -> Result<ReadResult, ApiError> {
        let g = self.inner.lock().unwrap();
        let content = g
            .files
            .get(&(id.clone(), req.path.clone()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("{} does not exist", req.path)))?;
        Ok(ReadResult {
            path: req.path,
            total_bytes: content.len() as u64,
            total_lines: Some(content.lines().count() as u64),
            content,
            encoding: "utf-8".into(),
            truncated: false,
            binary: false,
        })
    }

    fn write_file(&self, id: &SandboxId, req: WriteRequest) -> Result<WriteResult, ApiError> {
        let n = req.content.len() as u64;
        let created = self
            .inner
            .lock()
            .unwrap()
            .files
            .insert((id.clone(), req.path.clone()), req.content)
            .is_none();
        Ok(WriteResult {
            path: req.path,
            bytes_written: n,
            created,
            sha256: None,
        })
    }
}

/// What a call records besides its operation's name and sandbox: the arguments tests check.
fn call_detail(op: &Op<'_>) -> String {
    match op {
        Op::Process { exec_id } => format!(" {exec_id}"),
        Op::Wait { exec_id, timeout } => format!(" {exec_id} {}ms", timeout.as_millis()),
        Op::Kill { exec_id, signal } => format!(" {exec_id} {signal}"),
        Op::WriteStdin {
            exec_id,
            data,
            close,
        } => format!(" {exec_id} {} {close}", String::from_utf8_lossy(data)),
        _ => String::new(),
    }
}

impl OpHandler for FakeBackend {
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        self.record(format!("create ttl={:?}", req.ttl_secs));
        let (delay, fail) = {
            let mut g = self.inner.lock().unwrap();
            (g.create_delay, g.fail_next_create.take())
        };
        std::thread::sleep(delay);
        if let Some(message) = fail {
            return Err(ApiError::Unavailable(message));
        }
        let id = SandboxId::generate();
        let exp = req.ttl_secs.map(|s| now_ms() + s * 1000);
        let i = info(&id, req.labels, exp);
        self.inner.lock().unwrap().sandboxes.insert(id, i.clone());
        Ok(i)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.record("list".into());
        self.inner
            .lock()
            .unwrap()
            .sandboxes
            .values()
            .cloned()
            .collect()
    }

    /// Every call is recorded as `NAME ID` and the arguments of [`call_detail`].
    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        self.record(format!("{} {id}{}", op.name(), call_detail(&op)));
        if let Op::Destroy = op {
            return match self.inner.lock().unwrap().sandboxes.remove(id) {
                Some(_) => Ok(Answer::Done),
                None => Err(ApiError::sandbox_not_found(id)),
            };
        }
        let info = self.inner.lock().unwrap().sandboxes.get(id).cloned();
        let info = info.ok_or_else(|| ApiError::sandbox_not_found(id))?;
        Ok(match op {
            Op::Info => Answer::Info(info),
            Op::Exec { req, events } => Answer::Exec(self.run(req, events)?),
            Op::Process { exec_id } | Op::Wait { exec_id, .. } | Op::Kill { exec_id, .. } => {
                Answer::Process(process_info(exec_id))
            }
            Op::Read(req) => Answer::Read(self.read_file(id, req)?),
            Op::Write(req) => Answer::Write(self.write_file(id, req)?),
            // The fake keeps uploads in memory as text (lossily), enough for the routes.
            Op::Upload { req, body } => {
                let mut bytes = Vec::new();
                body.read_to_end(&mut bytes)
                    .map_err(|e| ApiError::invalid(format!("upload: {e}")))?;
                let n = bytes.len() as u64;
                let mut w = self.write_file(
                    id,
                    WriteRequest {
                        path: req.path,
                        content: String::from_utf8_lossy(&bytes).into_owned(),
                        ..WriteRequest::default()
                    },
                )?;
                w.bytes_written = n;
                Answer::Write(w)
            }
            Op::Download { req, sink } => {
                let content = self
                    .inner
                    .lock()
                    .unwrap()
                    .files
                    .get(&(id.clone(), req.path.clone()))
                    .cloned()
                    .ok_or_else(|| ApiError::not_found(format!("{} does not exist", req.path)))?;
                sink.start(content.len() as u64).unwrap();
                for piece in content.as_bytes().chunks(7) {
                    sink.write(piece).unwrap();
                }
                Answer::Download(DownloadResult {
                    path: req.path,
                    bytes: content.len() as u64,
                    sha256: String::new(),
                })
            }
            Op::Edit(req) => {
                return Err(ApiError::EditNotFound(format!(
                    "{:?} does not occur in {}",
                    req.old, req.path
                )));
            }
            Op::Patch(_) => Answer::Patch(PatchResult { files: Vec::new() }),
            Op::ListDir(_) => Answer::List(ListResult {
                entries: Vec::new(),
                truncated: false,
            }),
            Op::Search(_) => Answer::Search(SearchResult {
                matches: Vec::new(),
                truncated: false,
                files_searched: 0,
            }),
            Op::Stat(req) => Answer::Stat(StatResult {
                path: req.path,
                kind: EntryKind::File,
                size: 0,
                mode: 0o644,
                modified_ms: 0,
                symlink_target: None,
            }),
            Op::Diff(_) => Answer::Diff(DiffResult {
                files: Vec::new(),
                diff: String::new(),
                stats: DiffStats::default(),
                ignored: 0,
                flagged: Vec::new(),
            }),
            Op::Checkpoint(req) => Answer::Checkpoint(CheckpointInfo {
                name: req.name,
                created_at_ms: now_ms(),
                files: 0,
            }),
            Op::Export(req) => Answer::Export(ExportResult {
                format: req.format,
                patch: Some(String::new()),
                tar_path: None,
                changes: Vec::new(),
                applied: req.apply,
                ignored: 0,
                flagged: Vec::new(),
            }),
            Op::SetNetwork(rules) => {
                rules.to_network()?;
                Answer::Network(rules)
            }
            // No egress proxy: no secrets.
            Op::SetSecret(_) => return Err(no_secrets(id)),
            // New entries with the parent's labels (the native suite forks for real).
            Op::Fork(req) => {
                let mut g = self.inner.lock().unwrap();
                let parent = info;
                let mut made = Vec::new();
                for _ in 0..req.count()? {
                    let fid = SandboxId::generate();
                    let mut labels = parent.labels.clone();
                    labels.extend(req.labels.clone());
                    let exp = req.ttl_secs.map(|s| now_ms() + s * 1000);
                    let mut i = self::info(&fid, labels, exp);
                    i.forked_from = Some(ForkOrigin {
                        parent: id.clone(),
                        checkpoint: req.checkpoint.clone(),
                        forked_at_ms: now_ms(),
                    });
                    g.sandboxes.insert(fid, i.clone());
                    made.push(i);
                }
                Answer::Fork(ForkResult { sandboxes: made })
            }
            // No command policy: nothing waits for approval.
            Op::ListApprovals { .. } => Answer::Approvals(Vec::new()),
            Op::Approve { approval } | Op::Deny { approval, .. } => {
                return Err(approval_not_found(id, &approval));
            }
            Op::WriteStdin { .. }
            | Op::Remove(_)
            | Op::Rename(_)
            | Op::Restore(_)
            | Op::Destroy => Answer::Done,
        })
    }
}

/// A directory tests may name as a workspace: `ROOT/w`, under the one workspace root of the
/// test servers (made once per test process).
pub fn ws_root() -> &'static std::path::Path {
    static ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let d = tempfile::Builder::new()
            .prefix("taskbox-server-ws-")
            .tempdir()
            .unwrap()
            .keep();
        std::fs::create_dir(d.join("w")).unwrap();
        std::fs::canonicalize(d).unwrap()
    })
}

/// The workspace rules of the test servers: [`ws_root`] as the one root.
pub fn rules() -> taskbox_server::workspaces::WorkspaceRules {
    taskbox_server::workspaces::WorkspaceRules::new(
        &[ws_root().to_path_buf()],
        std::path::Path::new("/nonexistent-state"),
        &[],
    )
    .unwrap()
}

/// A server running the router on 127.0.0.1:0.
pub struct TestServer {
    pub base: String,
    pub addr: SocketAddr,
    pub state: AppState,
    pub backend: FakeBackend,
    pub client: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Logs of the server go to the test's captured output (shown when a test fails).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "taskbox_server=info".into()),
        )
        .with_test_writer()
        .try_init();
}

pub async fn serve_state(state: AppState, backend: FakeBackend) -> TestServer {
    logs();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(state.clone());
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    TestServer {
        base: format!("http://{addr}"),
        addr,
        state,
        backend,
        client: reqwest::Client::new(),
        task,
    }
}

/// Serves a fresh fake backend with the tokens of alice and bob and `limits`.
pub async fn start(limits: Limits) -> TestServer {
    let backend = FakeBackend::default();
    let b = backend.clone();
    let state = tokio::task::spawn_blocking(move || {
        AppState::builder(Arc::new(b))
            .auth(Auth::Tokens(tokens()))
            .limits(limits)
            .workspaces(rules())
            .uploads(
                taskbox_server::workspaces::Uploads::open(&ws_root().join("state"), 1 << 20)
                    .unwrap(),
            )
            .build()
            .unwrap()
    })
    .await
    .unwrap();
    serve_state(state, backend).await
}

impl TestServer {
    /// A workspace the server accepts.
    pub fn ws(&self) -> String {
        ws_root().join("w").display().to_string()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn create(&self, token: &str, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(self.url("/v1/sandboxes"))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// Creates a sandbox for `token` and returns its id.
    pub async fn sandbox(&self, token: &str) -> String {
        let r = self
            .create(token, serde_json::json!({"workspace": self.ws()}))
            .await;
        assert_eq!(r.status(), 201, "{:?}", r.text().await);
        let v: serde_json::Value = r.json().await.unwrap();
        v["id"].as_str().unwrap().to_string()
    }

    pub async fn post(
        &self,
        token: &str,
        path: &str,
        body: serde_json::Value,
    ) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    pub async fn get(&self, token: &str, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
    }
}

/// Asserts `r` is an error answer with `status` and `code`; returns its message.
pub async fn expect_error(r: reqwest::Response, status: u16, code: &str) -> String {
    let got = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(got, status, "body: {text}");
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    assert_eq!(v["error"]["code"], code, "body: {text}");
    let msg = v["error"]["message"].as_str().unwrap().to_string();
    assert_eq!(v.as_object().unwrap().len(), 1, "only `error`: {text}");
    msg
}
