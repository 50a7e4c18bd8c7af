//! The command policy end to end over a real `taskbox serve` on its Unix socket, with real
//! native sandboxes: forbid (also inside compound commands), ask then approve, deny (the reason
//! reaches the caller) or time out, tenant isolation of approvals, the CLI verbs, the trace, a
//! malformed `[commands]` section, and `taskbox run`; and the same rules over Docker sandboxes
//! (`serve --docker`), since the policy sits above every backend.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taskbox_tests::{Env, Supervisor, http, require, taskbox};

const ALICE: &str = "alice-token-0123456789abcdef";
const BOB: &str = "bob-token-0123456789abcdef01";

/// No pushes; ask before `touch` (a command whose effect is easy to see).
const RULES: &str = "[commands]\nforbid = [\"git push\"]\nask = [\"touch\"]\n";

/// What these tests do with a supervisor, beyond the shared helper.
trait Approvals {
    /// A supervisor whose tokens file maps ALICE and BOB to their tenants.
    fn with_tenants(env: &Env) -> Self;
    /// Creates a sandbox around the workspace under `policy` (as `token`'s tenant).
    fn create(&self, env: &Env, policy: &Path, token: Option<&str>) -> String;
    /// Starts an exec on its own thread (it blocks while it waits for approval).
    fn exec_later(&self, token: Option<&str>, id: &str, body: Value) -> JoinHandle<(u16, Value)>;
    /// The sandbox's pending approvals, waiting (long-polling) until there is one.
    fn pending(&self, token: Option<&str>, id: &str) -> Vec<Value>;
    /// The workspace's top-level names, as the sandbox sees them.
    fn ls(&self, token: Option<&str>, id: &str) -> String;
}

impl Approvals for Supervisor {
    fn with_tenants(env: &Env) -> Self {
        let tokens = env.dir.path().join("tokens.toml");
        std::fs::write(
            &tokens,
            format!(
                "[[token]]\ntoken = \"{ALICE}\"\ntenant = \"alice\"\n\
                 [[token]]\ntoken = \"{BOB}\"\ntenant = \"bob\"\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
        Supervisor::start(env, &["--tokens", tokens.to_str().unwrap()])
    }

    fn create(&self, env: &Env, policy: &Path, token: Option<&str>) -> String {
        let body = json!({"workspace": env.ws(), "policy": policy,
                           "policy_toml": taskbox_tests::policy_text(policy)});
        let (status, v) = http::call_as(&self.socket, token, "POST", "/v1/sandboxes", Some(&body));
        assert_eq!(status, 201, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    fn exec_later(&self, token: Option<&str>, id: &str, body: Value) -> JoinHandle<(u16, Value)> {
        let socket = self.socket.clone();
        let token = token.map(str::to_owned);
        let path = format!("/v1/sandboxes/{id}/exec");
        std::thread::spawn(move || {
            http::call_as(&socket, token.as_deref(), "POST", &path, Some(&body))
        })
    }

    fn pending(&self, token: Option<&str>, id: &str) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let path = format!("/v1/sandboxes/{id}/approvals?wait_ms=5000");
            let (status, v) = http::call_as(&self.socket, token, "GET", &path, None);
            assert_eq!(status, 200, "{v}");
            let list = v.as_array().unwrap().clone();
            if !list.is_empty() || Instant::now() > deadline {
                return list;
            }
        }
    }

    fn ls(&self, token: Option<&str>, id: &str) -> String {
        let (status, v) = http::call_as(
            &self.socket,
            token,
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"argv": ["ls"]})),
        );
        assert_eq!(status, 200, "{v}");
        v["stdout"]["text"].as_str().unwrap().to_string()
    }
}

/// The one `command` violation of a refused exec.
fn refusal(result: &Value) -> String {
    assert_eq!(result["exit_code"], Value::Null, "{result}");
    assert_eq!(result["signal"], Value::Null, "{result}");
    let v = result["violations"].as_array().unwrap();
    assert_eq!(v.len(), 1, "{result}");
    assert_eq!(v[0]["kind"], "command", "{result}");
    v[0]["detail"].as_str().unwrap().to_string()
}

fn trace_ops(env: &Env, id: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(env.state().join("traces").join(format!("{id}.jsonl"))).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["type"] == "op")
        .collect()
}

#[test]
fn forbid_refuses_every_form_without_running_anything() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create(&env, &policy, None);

    for body in [
        json!({"shell": "echo hi > ran.txt && git push origin main"}),
        json!({"shell": "echo hi > ran.txt; g\"\"it push"}),
        json!({"argv": ["env", "GIT_TRACE=1", "git", "-C", ".", "push"]}),
        json!({"argv": ["/usr/bin/git", "push"]}),
        json!({"argv": ["bash", "-c", "if true; then (git push); fi"]}),
    ] {
        let (status, r) = sup.call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(body.clone()),
        );
        assert_eq!(status, 200, "{body}: {r}");
        let detail = refusal(&r);
        assert!(
            detail.contains("is forbidden by the command policy"),
            "{detail}"
        );
        assert!(detail.contains("rule forbid \"git push\""), "{detail}");
        assert!(detail.contains("nothing was run"), "{detail}");
        assert_eq!(r["stdout"]["bytes"], 0);
    }
    let (_, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "true && git push origin main"})),
    );
    assert!(
        refusal(&r).starts_with("`git push origin main` is forbidden"),
        "{r}"
    );
    // Nothing before the forbidden part ran either.
    assert!(!sup.ls(None, &id).contains("ran.txt"));
    // Other commands run as usual.
    let (_, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "echo ok && git --version >/dev/null 2>&1; true"})),
    );
    assert_eq!(r["exit_code"], 0, "{r}");

    // The trace records the refusals as execs with their violation.
    let ops = trace_ops(&env, &id);
    let refused = ops
        .iter()
        .filter(|o| o["op"] == "exec" && o["outcome"]["ok"]["violations"][0]["kind"] == "command")
        .count();
    assert_eq!(refused, 6, "{ops:#?}");
}

#[test]
fn ask_then_approve_runs_the_command() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create(&env, &policy, None);

    let exec = sup.exec_later(None, &id, json!({"shell": "echo x && touch approved.txt"}));
    let pending = sup.pending(None, &id);
    assert_eq!(pending.len(), 1, "{pending:?}");
    let a = &pending[0];
    let aid = a["id"].as_str().unwrap();
    assert!(aid.starts_with("ap-"), "{a}");
    assert_eq!(a["sandbox"], id.as_str());
    assert_eq!(a["state"], "pending");
    assert_eq!(a["command"], "touch approved.txt");
    assert_eq!(a["rule"], "ask \"touch\"");
    assert_eq!(
        a["argv"],
        json!(["/bin/sh", "-c", "echo x && touch approved.txt"])
    );
    assert!(!exec.is_finished(), "the exec must wait");

    let (status, answered) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/approve"),
        None,
    );
    assert_eq!(status, 200, "{answered}");
    assert_eq!(answered["state"], "approved");
    let (status, r) = exec.join().unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"]["text"], "x\n");
    assert!(sup.ls(None, &id).contains("approved.txt"));

    // Answered once: it is no longer pending.
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/approve"),
        None,
    );
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "not_found");
    let (_, v) = sup.call("GET", &format!("/v1/sandboxes/{id}/approvals"), None);
    assert_eq!(v, json!([]));

    let ops = trace_ops(&env, &id);
    let approve = ops.iter().find(|o| o["op"] == "approve").unwrap();
    assert_eq!(approve["request"]["approval"], aid);
    assert_eq!(approve["outcome"]["ok"]["state"], "approved");
}

#[test]
fn ask_then_deny_returns_the_reason_to_the_caller() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create(&env, &policy, None);

    let exec = sup.exec_later(None, &id, json!({"argv": ["touch", "denied.txt"]}));
    let pending = sup.pending(None, &id);
    let aid = pending[0]["id"].as_str().unwrap();
    let (status, answered) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/deny"),
        Some(json!({"reason": "write to the build directory instead"})),
    );
    assert_eq!(status, 200, "{answered}");
    assert_eq!(answered["state"], "denied");
    assert_eq!(
        answered["denial_reason"],
        "write to the build directory instead"
    );
    let (status, r) = exec.join().unwrap();
    assert_eq!(status, 200, "{r}");
    let detail = refusal(&r);
    assert!(
        detail.contains("was denied: write to the build directory instead"),
        "{detail}"
    );
    assert!(detail.contains(aid), "{detail}");
    assert!(!sup.ls(None, &id).contains("denied.txt"));

    // A deny body with unknown fields is refused, naming the field.
    let exec = sup.exec_later(None, &id, json!({"argv": ["touch", "x"]}));
    let aid = sup.pending(None, &id)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/deny"),
        Some(json!({"why": "no"})),
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("why"),
        "{v}"
    );
    let (status, v) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/NOT-AN-ID/deny"),
        Some(json!({})),
    );
    assert_eq!(status, 400, "{v}");
    // Without a reason, the model is told none was given.
    sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/deny"),
        Some(json!({})),
    );
    let (_, r) = exec.join().unwrap();
    assert!(refusal(&r).contains("no reason was given"), "{r}");

    let ops = trace_ops(&env, &id);
    let deny = ops.iter().find(|o| o["op"] == "deny").unwrap();
    assert_eq!(
        deny["request"]["reason"],
        "write to the build directory instead"
    );
    assert_eq!(deny["outcome"]["ok"]["state"], "denied");
    let o = env.command().args(["trace", "show", &id]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(
        shown.contains("deny") && shown.contains("write to the build directory instead"),
        "{shown}"
    );
    assert!(
        shown.contains("violation command: `touch denied.txt` needs"),
        "{shown}"
    );
}

#[test]
fn an_unanswered_ask_times_out_as_a_denial() {
    let env = Env::new();
    let policy = env.policy("rules", &format!("{RULES}ask_timeout = \"1s\"\n"));
    let sup = Supervisor::start(&env, &[]);
    let id = sup.create(&env, &policy, None);
    // A command name only known at run time might be `git push`: it is asked about, not run.
    let start = Instant::now();
    let (status, r) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "$(echo git) push"})),
    );
    assert_eq!(status, 200, "{r}");
    assert!(start.elapsed() >= Duration::from_secs(1));
    let detail = refusal(&r);
    assert!(
        detail.contains("might match the rule forbid \"git push\""),
        "{detail}"
    );
    assert!(detail.contains("no one answered within 1s"), "{detail}");
    let (_, v) = sup.call("GET", &format!("/v1/sandboxes/{id}/approvals"), None);
    assert_eq!(v, json!([]));
}

#[test]
fn approvals_are_seen_and_answered_by_their_tenant_only() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::with_tenants(&env);
    let alice = sup.create(&env, &policy, Some(ALICE));
    let bobs = sup.create(&env, &policy, Some(BOB));

    let exec = sup.exec_later(Some(ALICE), &alice, json!({"argv": ["touch", "mine.txt"]}));
    let pending = sup.pending(Some(ALICE), &alice);
    let aid = pending[0]["id"].as_str().unwrap();

    let (status, all) = sup.call_as(ALICE, "GET", "/v1/approvals", None);
    assert_eq!(status, 200);
    assert_eq!(all.as_array().unwrap().len(), 1, "{all}");
    assert_eq!(all[0]["id"], aid);
    let (status, all) = sup.call_as(BOB, "GET", "/v1/approvals", None);
    assert_eq!(status, 200);
    assert_eq!(all, json!([]));

    for (method, path, body) in [
        ("GET", format!("/v1/sandboxes/{alice}/approvals"), None),
        (
            "POST",
            format!("/v1/sandboxes/{alice}/approvals/{aid}/approve"),
            None,
        ),
        (
            "POST",
            format!("/v1/sandboxes/{alice}/approvals/{aid}/deny"),
            Some(json!({"reason": "mine now"})),
        ),
    ] {
        let (status, v) = sup.call_as(BOB, method, &path, body);
        assert_eq!(status, 404, "{method} {path}: {v}");
        assert_eq!(
            v["error"]["message"],
            format!("sandbox {alice} does not exist")
        );
        assert_eq!(v["error"]["code"], "sandbox_not_found");
    }
    // Through his own sandbox, Bob does not reach Alice's approval either.
    let (status, v) = sup.call_as(
        BOB,
        "POST",
        &format!("/v1/sandboxes/{bobs}/approvals/{aid}/approve"),
        None,
    );
    assert_eq!(status, 404, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("is not pending"),
        "{v}"
    );
    // No token: 401.
    let (status, _) = sup.call("GET", "/v1/approvals", None);
    assert_eq!(status, 401);

    // Still pending for Alice, who approves it.
    assert!(!exec.is_finished());
    let (status, _) = sup.call_as(
        ALICE,
        "POST",
        &format!("/v1/sandboxes/{alice}/approvals/{aid}/approve"),
        None,
    );
    assert_eq!(status, 200);
    let (_, r) = exec.join().unwrap();
    assert_eq!(r["exit_code"], 0, "{r}");
}

#[test]
fn cli_verbs_show_and_answer_approvals() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::start(&env, &[]);
    let s = sup.socket.clone();
    let o = env.cli(
        &s,
        &[
            "create",
            "--policy",
            policy.to_str().unwrap(),
            "--workspace",
            env.ws().to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let id = String::from_utf8_lossy(&o.stdout).trim().to_string();

    // Forbidden: exit status 126, the violation on stderr.
    let o = env.cli(&s, &["exec", &id, "--", "sh", "-c", "git push"]);
    assert_eq!(o.status.code(), Some(126), "{o:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("taskbox: command: `git push` is forbidden"),
        "{stderr}"
    );
    let o = env.cli(&s, &["exec", &id, "--json", "--", "git", "push"]);
    assert_eq!(o.status.code(), Some(126), "{o:?}");

    // Asked, then denied from the command line: the waiting exec says so and exits 126.
    let waiting = |file: &str| {
        Command::new(taskbox())
            .arg("--socket")
            .arg(&s)
            .arg("--state-dir")
            .arg(env.state())
            .args(["exec", &id, "--", "touch", file])
            .env("HOME", env.home())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let child = waiting("nope.txt");
    let aid = sup.pending(None, &id)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let o = env.cli(&s, &["approvals"]);
    assert!(o.status.success(), "{o:?}");
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains(&aid) && table.contains("touch nope.txt"),
        "{table}"
    );
    let o = env.cli(&s, &["approvals", &id, "--json"]);
    let listed: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(listed[0]["id"], aid.as_str());
    let o = env.cli(&s, &["deny", &aid, "--reason", "not in this task"]);
    assert!(o.status.success(), "{o:?}");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(126), "{o:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(&format!("taskbox approve {aid}")),
        "{stderr}"
    );
    assert!(stderr.contains("was denied: not in this task"), "{stderr}");

    // Asked, then approved: it runs.
    let child = waiting("yes.txt");
    let aid = sup.pending(None, &id)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let o = env.cli(&s, &["approve", &aid]);
    assert!(o.status.success(), "{o:?}");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert!(sup.ls(None, &id).contains("yes.txt"));

    // An approval that is not pending is named in the error.
    let o = env.cli(&s, &["approve", &aid]);
    assert_eq!(o.status.code(), Some(125), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not pending"),
        "{o:?}"
    );
}

#[test]
fn malformed_command_rules_are_refused_naming_the_pattern() {
    let env = Env::new();
    let bad = env.policy(
        "bad",
        "[commands]\nforbid = [\"git push\", \"git $REMOTE\"]\n",
    );
    let sup = Supervisor::start(&env, &[]);
    let (status, v) = sup.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws(), "policy": bad,
                    "policy_toml": taskbox_tests::policy_text(&bad)})),
    );
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(bad.to_str().unwrap()), "{msg}");
    assert!(
        msg.contains("commands.forbid[1]: invalid command prefix \"git $REMOTE\""),
        "{msg}"
    );

    let o = env
        .command()
        .args(["policy", "check"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("commands.forbid[1]"), "{stderr}");
    assert!(stderr.contains("\"git $REMOTE\""), "{stderr}");

    let bad = env.policy("bad2", "[commands]\nask = [[\"/usr/bin/git\", \"push\"]]\n");
    let o = env
        .command()
        .args(["policy", "check"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("commands.ask[0]") && stderr.contains("write \"git\""),
        "{stderr}"
    );

    let good = env.policy("good", RULES);
    let o = env
        .command()
        .args(["policy", "explain"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("Refused without running: commands starting with git push"),
        "{text}"
    );
}

#[test]
fn run_refuses_forbidden_commands_and_has_no_one_to_ask_without_a_terminal() {
    let env = Env::new();
    let policy = env.policy("rules", RULES);
    let p = policy.to_str().unwrap();

    let r = env.run_json(
        &["--policy", p],
        &["sh", "-c", "echo hi > ran.txt && git push"],
    );
    assert_eq!(r.status, 126, "{}", r.raw_stderr);
    let detail = refusal(&r.json);
    assert!(detail.contains("`git push` is forbidden"), "{detail}");
    assert_eq!(r.json["enforcement"]["landlock"], "none");

    // Without --json: the violation on stderr.
    let o = env
        .command()
        .args(["run", "--policy", p, "--", "git", "push"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(126));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("taskbox: command: `git push` is forbidden")
    );

    // Stdin is not a terminal: there is no one to ask.
    let r = env.run_json(&["--policy", p, "--write-through"], &["touch", "asked.txt"]);
    assert_eq!(r.status, 126, "{}", r.raw_stderr);
    assert!(
        refusal(&r.json).contains("denied: no one to ask"),
        "{}",
        r.json
    );
    assert!(!env.ws().join("asked.txt").exists());

    // Allowed commands run.
    let r = env.run_json(&["--policy", p], &["sh", "-c", "echo fine"]);
    assert_eq!(r.status, 0, "{}", r.raw_stderr);
}

/// `taskbox run` under a terminal (util-linux `script` gives it one) with `answer` typed after a
/// moment; returns what the terminal showed.
fn run_on_a_terminal(env: &Env, policy: &Path, file: &str, answer: Option<&str>) -> String {
    use std::io::Write;
    let inner = format!(
        "{} run --write-through --policy {} -- touch {file}; echo rc=$?",
        taskbox().display(),
        policy.display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .env("TASKBOX_STATE_DIR", env.state())
        .env("HOME", env.home())
        .current_dir(env.ws())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kept open until the end: end of input would be an answer too.
    let mut stdin = child.stdin.take().unwrap();
    if let Some(answer) = answer {
        std::thread::sleep(Duration::from_millis(1500));
        writeln!(stdin, "{answer}").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    String::from_utf8_lossy(&out.stdout).replace('\r', "")
}

#[test]
fn run_asks_at_the_terminal() {
    let has_script = Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !require(
        has_script,
        "util-linux `script` is needed to give taskbox run a terminal",
    ) {
        return;
    }
    let env = Env::new();
    let policy = env.policy("rules", &format!("{RULES}ask_timeout = \"3s\"\n"));

    let shown = run_on_a_terminal(&env, &policy, "yes.txt", Some("y"));
    assert!(
        shown.contains("the command policy asks before running `touch yes.txt`"),
        "{shown}"
    );
    assert!(shown.contains("run it? [y/N]"), "{shown}");
    assert!(shown.contains("rc=0"), "{shown}");
    assert!(env.ws().join("yes.txt").exists(), "{shown}");

    let shown = run_on_a_terminal(&env, &policy, "no.txt", Some("not now, use make"));
    assert!(shown.contains("was denied: not now, use make"), "{shown}");
    assert!(shown.contains("rc=126"), "{shown}");
    assert!(!env.ws().join("no.txt").exists());

    let shown = run_on_a_terminal(&env, &policy, "late.txt", None);
    assert!(shown.contains("no one answered within 3s"), "{shown}");
    assert!(shown.contains("rc=126"), "{shown}");
    assert!(!env.ws().join("late.txt").exists());
}

#[test]
fn the_same_rules_hold_for_docker_sandboxes() {
    let Some(env) = Env::for_backend(taskbox_tests::Backend::Docker) else {
        return;
    };
    let policy = env.policy("rules", RULES);
    let sup = Supervisor::start(&env, &["--docker"]);
    let body = json!({"workspace": env.ws(), "policy": policy, "backend": "docker",
                      "policy_toml": taskbox_tests::policy_text(&policy),
                      "image": taskbox_tests::SUITE_IMAGE});
    let (status, v) = sup.call("POST", "/v1/sandboxes", Some(body));
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["backend"], "docker");
    let id = v["id"].as_str().unwrap().to_string();
    let exec = |body: Value| {
        let (status, r) = sup.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(body));
        assert_eq!(status, 200, "{r}");
        r
    };

    // forbid, also behind quoting tricks and inside compound commands: nothing runs.
    for body in [
        json!({"shell": "echo hi > ran.txt && git push origin main"}),
        json!({"shell": "echo hi > ran.txt; g\"\"it push"}),
        json!({"argv": ["env", "git", "push"]}),
    ] {
        let detail = refusal(&exec(body.clone()));
        assert!(
            detail.contains("rule forbid \"git push\""),
            "{body}: {detail}"
        );
    }
    assert!(!sup.ls(None, &id).contains("ran.txt"));

    // ask, approved: it runs in the container.
    let later = sup.exec_later(None, &id, json!({"shell": "touch approved.txt && id -u"}));
    let pending = sup.pending(None, &id);
    assert_eq!(pending.len(), 1, "{pending:?}");
    let aid = pending[0]["id"].as_str().unwrap().to_string();
    let (status, _) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/approve"),
        None,
    );
    assert_eq!(status, 200);
    let (status, r) = later.join().unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"]["text"], "1000\n", "{r}");
    assert!(sup.ls(None, &id).contains("approved.txt"));

    // ask, denied: the reason comes back and nothing ran.
    let later = sup.exec_later(None, &id, json!({"shell": "touch denied.txt"}));
    let pending = sup.pending(None, &id);
    let aid = pending[0]["id"].as_str().unwrap().to_string();
    let (status, _) = sup.call(
        "POST",
        &format!("/v1/sandboxes/{id}/approvals/{aid}/deny"),
        Some(json!({"reason": "use the fixture instead"})),
    );
    assert_eq!(status, 200);
    let (_, r) = later.join().unwrap();
    assert!(refusal(&r).contains("use the fixture instead"), "{r}");
    assert!(!sup.ls(None, &id).contains("denied.txt"));
    let (status, _) = sup.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
}
