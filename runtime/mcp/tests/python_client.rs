//! The MCP server against a real MCP client: the Python `mcp` package (the reference SDK).
//!
//! The test runs `python3` from PATH (the interpreter whose pip installs `mcp`; scripts/ci.sh
//! installs it there) on a client script that spawns `taskbox-mcp-test-server` over stdio and
//! drives a session; the script prints a JSON summary that the test checks. A second script drives
//! the command policy's asks through elicitation with three clients (answering, declining, and
//! one without the capability). Without python3 or
//! its `mcp` package the test skips with the reason (a failure under `TASKBOX_REQUIRE_ALL=1`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::path::PathBuf;
use std::process::{Command, Stdio};

use taskbox_tests::{Env, host_processes_with, require};

const CLIENT: &str = r#"
import asyncio, json, os, sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

server, workspace, state = sys.argv[1:4]
summary = {"failures": []}


def field(obj, *names):
    """Reads a field under its snake_case (mcp 2.x) or camelCase (mcp 1.x) name."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(f"none of {names} on {type(obj).__name__}")


def check(ok, what):
    if not ok:
        summary["failures"].append(what)


def text(result):
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def is_error(result):
    return bool(field(result, "is_error", "isError"))


def structured(result):
    return field(result, "structured_content", "structuredContent") or {}


async def main():
    params = StdioServerParameters(
        command=server,
        args=[workspace, state],
        env={"TASKBOX_INIT": os.environ["TASKBOX_INIT"]},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            info = field(init, "server_info", "serverInfo")
            summary["server"] = {"name": info.name, "version": info.version}
            summary["instructions_name_workspace"] = workspace in (init.instructions or "")

            tools = (await session.list_tools()).tools
            summary["tools"] = sorted(t.name for t in tools)
            summary["schema_fields"] = {}
            for t in tools:
                schema = field(t, "input_schema", "inputSchema")
                props = schema.get("properties") or {}
                check(schema.get("type") == "object", f"{t.name}: schema is not an object")
                check(len(props) > 0, f"{t.name}: schema has no properties")
                check(bool(t.description), f"{t.name}: no description")
                summary["schema_fields"][t.name] = sorted(props)

            r = await session.call_tool("exec", {"shell": "echo hi; echo x > f.txt"})
            out = text(r)
            summary["exec_text"] = out
            check(not is_error(r), "exec: isError")
            check("exit_code: 0 (" in out, "exec: no exit status line")
            check("hi" in out, "exec: no stdout")
            check("added f.txt" in out, "exec: f.txt not among the changes in the text")
            changes = [c["path"] for c in structured(r).get("changes", [])]
            check("f.txt" in changes, f"exec: f.txt not in structured changes {changes}")
            check(structured(r).get("exit_code") == 0, "exec: structured exit_code is not 0")

            r = await session.call_tool(
                "edit_file", {"path": "notes.txt", "old": "beta", "new": "BETA"}
            )
            out = text(r)
            summary["edit_text"] = out
            check(not is_error(r), f"edit_file: isError: {out}")
            check("-beta" in out and "+BETA" in out, "edit_file: the diff is not shown")

            r = await session.call_tool(
                "edit_file", {"path": "notes.txt", "old": "same", "new": "other"}
            )
            out = text(r)
            summary["ambiguous_text"] = out
            check(is_error(r), "ambiguous edit_file: not isError")
            check("ambiguous" in out, "ambiguous edit_file: the word 'ambiguous' is missing")

            r = await session.call_tool("edit_file", {"path": "notes.txt", "old": "beta"})
            out = text(r)
            summary["invalid_args_text"] = out
            check(is_error(r), "edit_file without `new`: not isError")
            check("`new`" in out, "edit_file without `new`: the field is not named")

            r = await session.call_tool("exec", {"shell": "true", "background": True})
            check(is_error(r), "exec with background: not isError")

            r = await session.call_tool("read_file", {"path": "notes.txt"})
            check("BETA" in text(r), "read_file: the edit is not visible")

            r = await session.call_tool("diff", {})
            out = text(r)
            summary["diff_text"] = out
            check(not is_error(r), "diff: isError")
            check("notes.txt" in out and "+BETA" in out, "diff: the edited file is not in it")
            check("f.txt" in out, "diff: the exec's file is not in it")

    summary["ok"] = not summary["failures"]
    print(json.dumps(summary))


asyncio.run(main())
"#;

/// Three sessions against a sandbox whose command rules ask before `touch` and forbid `git push`:
/// a client that answers the elicitation (first approve, then deny with a reason), one that
/// declines, and one without the elicitation capability.
const APPROVALS_CLIENT: &str = r#"
import asyncio, json, os, sys

from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

server, workspace, state, policy = sys.argv[1:5]
summary = {"failures": [], "asked": []}


def field(obj, *names):
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(f"none of {names} on {type(obj).__name__}")


def check(ok, what):
    if not ok:
        summary["failures"].append(what)


def text(result):
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def structured(result):
    return field(result, "structured_content", "structuredContent") or {}


def violations(result):
    return [v["detail"] for v in structured(result).get("violations", []) if v["kind"] == "command"]


async def session(callback, body):
    params = StdioServerParameters(
        command=server,
        args=[workspace, state, policy],
        env={"TASKBOX_INIT": os.environ["TASKBOX_INIT"]},
    )
    async with stdio_client(params) as (read, write):
        kwargs = {"elicitation_callback": callback} if callback else {}
        async with ClientSession(read, write, **kwargs) as s:
            await s.initialize()
            await body(s)


answers = []


async def answering(context, params):
    summary["asked"].append(params.message)
    schema = field(params, "requested_schema", "requestedSchema")
    check("approve" in (schema.get("properties") or {}), f"no approve field in {schema}")
    return answers.pop(0)


async def declining(context, params):
    summary["asked"].append(params.message)
    return types.ElicitResult(action="decline")


async def approving_session(s):
    answers.append(types.ElicitResult(action="accept", content={"approve": True}))
    r = await s.call_tool("exec", {"shell": "touch approved.txt && echo ran"})
    out = text(r)
    summary["approved_text"] = out
    check(structured(r).get("exit_code") == 0, f"approved exec did not run: {out}")
    check("ran" in out, "approved exec: no output")

    answers.append(
        types.ElicitResult(action="accept", content={"approve": False, "reason": "use make instead"})
    )
    r = await s.call_tool("exec", {"shell": "touch denied.txt"})
    v = violations(r)
    summary["denied_violations"] = v
    check(structured(r).get("exit_code") is None, "denied exec has an exit code")
    check(any("use make instead" in d for d in v), f"the reason is not in {v}")
    check("use make instead" in text(r), "the reason is not in the text")

    asked = len(summary["asked"])
    r = await s.call_tool("exec", {"argv": ["git", "push", "origin", "main"]})
    v = violations(r)
    summary["forbidden_violations"] = v
    check(any("forbidden" in d for d in v), f"git push is not forbidden: {v}")
    check(len(summary["asked"]) == asked, "a forbidden command was put to the user")

    r = await s.call_tool("exec", {"argv": ["ls"]})
    summary["ls_after_approving"] = text(r)


async def declining_session(s):
    r = await s.call_tool("exec", {"shell": "touch declined.txt"})
    v = violations(r)
    summary["declined_violations"] = v
    check(any("declined by the user" in d for d in v), f"no decline in {v}")
    r = await s.call_tool("exec", {"argv": ["ls"]})
    summary["ls_after_declining"] = text(r)


async def incapable_session(s):
    r = await s.call_tool("exec", {"shell": "touch unasked.txt"})
    v = violations(r)
    summary["incapable_violations"] = v
    check(any("does not support elicitation" in d for d in v), f"no reason in {v}")


async def main():
    await asyncio.wait_for(session(answering, approving_session), 120)
    await asyncio.wait_for(session(declining, declining_session), 120)
    await asyncio.wait_for(session(None, incapable_session), 120)
    summary["ok"] = not summary["failures"]
    print(json.dumps(summary))


asyncio.run(main())
"#;

/// The sandbox helper the server needs: `$TASKBOX_INIT`, else `taskbox-init` beside the server.
fn taskbox_init(server: &std::path::Path) -> PathBuf {
    let init = std::env::var_os("TASKBOX_INIT")
        .map(PathBuf::from)
        .unwrap_or_else(|| server.with_file_name("taskbox-init"));
    assert!(
        init.is_file(),
        "the sandbox helper {} is missing: build it first (`cargo build --workspace --bins`, as \
         scripts/test.sh does) or set TASKBOX_INIT",
        init.display()
    );
    init
}

/// Whether `python3` on PATH imports the MCP client, or why not.
fn python_mcp() -> Result<(), String> {
    match Command::new("python3")
        .args(["-c", "import mcp.client.stdio"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "python3 on PATH cannot import the mcp package (install it with `python3 -m pip \
             install mcp`): {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("python3 is not on PATH: {e}")),
    }
}

#[test]
fn a_python_mcp_client_drives_a_sandbox() {
    if let Err(reason) = python_mcp() {
        require(false, &reason);
        return;
    }
    let server = PathBuf::from(env!("CARGO_BIN_EXE_taskbox-mcp-test-server"));
    let init = taskbox_init(&server);
    let env = Env::new();
    env.write("notes.txt", "alpha\nbeta\nsame\nsame\n");
    let script = env.dir.path().join("client.py");
    std::fs::write(&script, CLIENT).unwrap();

    let out = Command::new("python3")
        .arg(&script)
        .arg(&server)
        .arg(env.ws())
        .arg(env.state())
        .env("TASKBOX_INIT", &init)
        .env("HOME", env.home())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the client failed ({})\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let summary: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary\nstdout: {stdout}\nstderr: {stderr}"));
    assert_eq!(
        summary["failures"],
        serde_json::json!([]),
        "{summary:#}\nstderr: {stderr}"
    );
    assert_eq!(summary["ok"], true);
    assert_eq!(summary["server"]["name"], "taskbox");
    assert_eq!(summary["server"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(summary["instructions_name_workspace"], true, "{summary:#}");
    let mut names: Vec<&str> = taskbox_mcp::TOOL_NAMES.to_vec();
    names.sort_unstable();
    assert_eq!(summary["tools"], serde_json::json!(names));
    assert_eq!(
        summary["schema_fields"]["edit_file"],
        serde_json::json!(["expected_count", "new", "old", "path", "sandbox"])
    );
    assert!(
        summary["ambiguous_text"]
            .as_str()
            .unwrap()
            .starts_with("edit_ambiguous: "),
        "{summary:#}"
    );

    // The host workspace is untouched, and the sandbox is gone once the client has disconnected.
    assert!(
        !env.ws().join("f.txt").exists(),
        "the host workspace changed"
    );
    assert_eq!(
        std::fs::read_to_string(env.ws().join("notes.txt")).unwrap(),
        "alpha\nbeta\nsame\nsame\n"
    );
    let state = env.state().display().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !host_processes_with(&state).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        host_processes_with(&state).is_empty(),
        "the server or the sandbox's processes outlived the session"
    );
    let sandboxes = env.state().join("sandboxes");
    // The backend's lock file (`.lock`) stays; no sandbox directory may.
    let left: Vec<_> = std::fs::read_dir(&sandboxes)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name())
                .filter(|n| !n.to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "sandboxes left after the session: {left:?}"
    );
}

#[test]
fn asks_go_to_the_user_through_elicitation() {
    if let Err(reason) = python_mcp() {
        require(false, &reason);
        return;
    }
    let server = PathBuf::from(env!("CARGO_BIN_EXE_taskbox-mcp-test-server"));
    let init = taskbox_init(&server);
    let env = Env::new();
    env.write("notes.txt", "x\n");
    let policy = env.policy(
        "asks",
        "[commands]\nask = [\"touch\"]\nforbid = [\"git push\"]\n",
    );
    let script = env.dir.path().join("approvals.py");
    std::fs::write(&script, APPROVALS_CLIENT).unwrap();

    let out = Command::new("python3")
        .arg(&script)
        .arg(&server)
        .arg(env.ws())
        .arg(env.state())
        .arg(&policy)
        .env("TASKBOX_INIT", &init)
        .env("HOME", env.home())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the client failed ({})\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let summary: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary\nstdout: {stdout}\nstderr: {stderr}"));
    assert_eq!(
        summary["failures"],
        serde_json::json!([]),
        "{summary:#}\nstderr: {stderr}"
    );
    // Asked twice in the first session, once in the second, never in the third.
    let asked = summary["asked"].as_array().unwrap();
    assert_eq!(asked.len(), 3, "{summary:#}");
    let first = asked[0].as_str().unwrap();
    assert!(
        first.contains("`touch approved.txt`") && first.contains("ask \"touch\""),
        "{first}"
    );
    // Only the approved command ran (each session's workspace starts from the host copy).
    let ls = summary["ls_after_approving"].as_str().unwrap();
    assert!(ls.contains("approved.txt"), "{ls}");
    assert!(!ls.contains("denied.txt"), "{ls}");
    let ls = summary["ls_after_declining"].as_str().unwrap();
    assert!(!ls.contains("declined.txt"), "{ls}");
    assert!(
        !env.ws().join("approved.txt").exists(),
        "the host workspace changed"
    );
}
