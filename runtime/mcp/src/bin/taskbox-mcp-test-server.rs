//! Test-only: serves one native sandbox over MCP on stdin/stdout, for the MCP client tests.
//!
//! `taskbox-mcp-test-server WORKSPACE STATE_DIR [POLICY]` opens a native backend in STATE_DIR
//! (the test's scratch directory) under the command policy, creates a sandbox around WORKSPACE
//! with POLICY (default: the default policy), and serves it until the client disconnects. It is not installed or shipped: `taskbox mcp` is the real entry.
//! The sandbox helper is found as for `taskbox` (`$TASKBOX_INIT`, else `taskbox-init` beside this
//! executable).

use std::path::PathBuf;
use std::process::ExitCode;

use taskbox_core::api::CreateRequest;
use taskbox_mcp::McpOptions;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (workspace, state_dir, policy) = match args.as_slice() {
        [w, s] => (w, s, None),
        [w, s, p] => (w, s, Some(p.clone())),
        _ => {
            eprintln!("usage: taskbox-mcp-test-server WORKSPACE STATE_DIR [POLICY]");
            return ExitCode::from(2);
        }
    };
    let options = McpOptions {
        create: CreateRequest {
            workspace: workspace.clone(),
            policy,
            ..CreateRequest::default()
        },
        state_dir: PathBuf::from(state_dir),
    };
    match options.serve_stdio().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("taskbox-mcp-test-server: {e}");
            ExitCode::from(125)
        }
    }
}
