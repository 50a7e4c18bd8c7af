//! `serve` over in-memory pipes with raw JSON-RPC lines, on the native backend: the protocol
//! edges a model's client relies on, without any SDK on the client side.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::sync::Arc;

use serde_json::{Value, json};
use taskbox_core::api::CreateRequest;
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::Env;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

struct Client {
    write: tokio::io::WriteHalf<tokio::io::DuplexStream>,
    read: tokio::io::Lines<BufReader<tokio::io::ReadHalf<tokio::io::DuplexStream>>>,
    next_id: u64,
}

impl Client {
    async fn send(&mut self, msg: Value) {
        let mut line = msg.to_string();
        line.push('\n');
        self.write.write_all(line.as_bytes()).await.unwrap();
    }

    /// Sends a request and returns its response (skipping notifications).
    async fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        loop {
            let line = self.read.next_line().await.unwrap().expect("server closed");
            let msg: Value = serde_json::from_str(&line).unwrap();
            if msg["id"] == id {
                return msg;
            }
        }
    }

    async fn call(&mut self, tool: &str, args: Value) -> Value {
        let r = self
            .request("tools/call", json!({"name": tool, "arguments": args}))
            .await;
        assert!(r.get("error").is_none(), "protocol error: {r}");
        r["result"].clone()
    }
}

fn text(result: &Value) -> String {
    result["content"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_errors_are_results_and_the_sandbox_ends_with_the_session() {
    let env = Env::new();
    env.write("a.txt", "one\n");
    let backend: Arc<NativeBackend> = Arc::new(NativeBackend::new(env.state()).unwrap());
    let (client_end, server_end) = tokio::io::duplex(1 << 16);
    let (server_read, server_write) = tokio::io::split(server_end);
    let create = CreateRequest {
        workspace: env.ws().display().to_string(),
        ..CreateRequest::default()
    };
    let server = tokio::spawn(taskbox_mcp::serve(
        backend.clone(),
        create,
        server_read,
        server_write,
    ));
    let (read, write) = tokio::io::split(client_end);
    let mut c = Client {
        write,
        read: BufReader::new(read).lines(),
        next_id: 0,
    };

    let init = c
        .request(
            "initialize",
            json!({
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"}
            }),
        )
        .await;
    assert_eq!(init["result"]["serverInfo"]["name"], "taskbox", "{init}");
    let instructions = init["result"]["instructions"].as_str().unwrap();
    assert!(instructions.contains(&env.ws().display().to_string()));
    c.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        .await;

    // A type mismatch names the field.
    let r = c
        .call("exec", json!({"shell": "true", "timeout_ms": "soon"}))
        .await;
    assert_eq!(r["isError"], true, "{r}");
    assert!(text(&r).contains("field `timeout_ms`"), "{r}");
    // An API error carries its code, as text and as structured content.
    let r = c.call("read_file", json!({"path": "missing.txt"})).await;
    assert_eq!(r["isError"], true, "{r}");
    assert_eq!(r["structuredContent"]["error"]["code"], "not_found", "{r}");
    assert!(text(&r).starts_with("not_found: "), "{r}");
    // A path out of the workspace is refused, not followed.
    let r = c
        .call("read_file", json!({"path": "../../etc/passwd"}))
        .await;
    assert_eq!(r["isError"], true, "{r}");
    // Success: text plus the full JSON.
    let r = c
        .call("write_file", json!({"path": "b.txt", "content": "two\n"}))
        .await;
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(text(&r), "created b.txt (4 bytes)");
    assert_eq!(r["structuredContent"]["created"], true);
    let r = c
        .call("exec", json!({"argv": ["cat", "a.txt", "b.txt"]}))
        .await;
    assert!(text(&r).contains("one\ntwo\n"), "{r}");
    let r = c.call("search", json!({"pattern": "t.o"})).await;
    assert!(text(&r).starts_with("b.txt:1: two\n"), "{r}");
    // A failing test's report: its finding in the text, before the output, and in the JSON.
    let log = "test calc::add ... FAILED\n\nfailures:\n\n---- calc::add stdout ----\n\n\
               thread 'calc::add' panicked at src/calc.rs:7:5:\nassertion failed: false\n\n\
               failures:\n    calc::add\n\n\
               test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; \
               finished in 0.00s\n";
    c.call("write_file", json!({"path": "test.log", "content": log}))
        .await;
    let r = c.call("exec", json!({"argv": ["cat", "test.log"]})).await;
    let f = &r["structuredContent"]["findings"][0];
    assert_eq!(f["name"], "calc::add", "{r}");
    assert_eq!(f["location"]["file"], "src/calc.rs", "{r}");
    assert_eq!(f["location"]["line"], 7, "{r}");
    let t = text(&r);
    let listed = t.find("src/calc.rs:7").unwrap_or(usize::MAX);
    assert!(listed < t.find("stdout:").unwrap_or(0), "{t}");
    // Fork: the new sandboxes start as this one is, and each tool works in the one it names.
    let r = c.call("fork", json!({"count": 2})).await;
    assert_eq!(r["isError"], false, "{r}");
    let forks: Vec<String> = r["structuredContent"]["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(forks.len(), 2, "{r}");
    assert!(text(&r).contains(&forks[0]), "{r}");
    let r = c
        .call(
            "exec",
            json!({"shell": "cat b.txt; echo fork > c.txt", "sandbox": forks[0]}),
        )
        .await;
    assert_eq!(r["structuredContent"]["exit_code"], 0, "{r}");
    assert!(text(&r).contains("two"), "{r}");
    for (where_, sandbox) in [("the session's", None), ("the other fork", Some(&forks[1]))] {
        let mut args = json!({"path": "c.txt"});
        if let Some(s) = sandbox {
            args["sandbox"] = json!(s);
        }
        let r = c.call("read_file", args).await;
        assert_eq!(
            r["structuredContent"]["error"]["code"], "not_found",
            "c.txt in {where_}: {r}"
        );
    }
    // A fork of a fork, and a sandbox that is not the session's.
    let r = c.call("fork", json!({"sandbox": forks[0]})).await;
    let grandchild = r["structuredContent"]["sandboxes"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = c
        .call("read_file", json!({"path": "c.txt", "sandbox": grandchild}))
        .await;
    assert_eq!(
        r["structuredContent"]["content"],
        "fork
",
        "{r}"
    );
    let r = c
        .call("diff", json!({"sandbox": "sb-00000000deadbeef"}))
        .await;
    assert_eq!(
        r["structuredContent"]["error"]["code"], "sandbox_not_found",
        "{r}"
    );
    let r = c.call("fork", json!({"count": 20})).await;
    assert_eq!(r["isError"], true, "{r}");
    assert!(text(&r).contains("field `count`"), "{r}");
    let r = c.call("fork", json!({"checkpoint": "x"})).await;
    assert!(text(&r).contains("not offered"), "{r}");
    assert_eq!(
        taskbox_core::api::SandboxApi::list(backend.as_ref()).len(),
        4
    );

    // An unknown tool is a protocol error (the client asked for something not listed).
    let r = c
        .request("tools/call", json!({"name": "nope", "arguments": {}}))
        .await;
    assert!(r.get("error").is_some(), "{r}");

    // The client leaves: the server destroys the sandbox and its forks, and returns.
    drop(c);
    tokio::time::timeout(std::time::Duration::from_secs(30), server)
        .await
        .expect("the server did not end with the session")
        .unwrap()
        .unwrap();
    assert!(taskbox_core::api::SandboxApi::list(backend.as_ref()).is_empty());
    assert!(
        !env.ws().join("b.txt").exists(),
        "the host workspace changed"
    );
}
