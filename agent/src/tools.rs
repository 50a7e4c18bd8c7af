//! The tools offered to the model: every tool of `taskbox_tools` (the sandbox tools `exec`,
//! `read_file`, `write_file`, `edit_file`, `apply_patch`, `list`, `search`, `diff`, the same the
//! MCP server offers, and the harness tools `plan` and `finish`). Their names, schemas, argument
//! checks and the text of their results are that crate's; this module turns them into the
//! model adapters' [`ToolSpec`]s and the loop's [`Action`]s.

use taskbox_tools::{Tool, parse_call};

use crate::model::ToolSpec;

pub use taskbox_tools::Call as Action;
pub use taskbox_tools::render::{api_error as render_error, exec as render_exec};

/// The tools the agent offers: the sandbox tools, then the harness tools (not `fork`: the agent
/// forks through its own attempts and sub-tasks).
pub const TOOLS: [Tool; 10] = [
    Tool::Exec,
    Tool::ReadFile,
    Tool::WriteFile,
    Tool::EditFile,
    Tool::ApplyPatch,
    Tool::List,
    Tool::Search,
    Tool::Diff,
    Tool::Plan,
    Tool::Finish,
];

/// The tools offered when the harness can run sub-agents: [`TOOLS`] and `subtask`.
pub fn with_subtask() -> Vec<Tool> {
    TOOLS.into_iter().chain([Tool::Subtask]).collect()
}

/// The tool specifications sent to the model.
pub fn specs() -> Vec<ToolSpec> {
    specs_of(&TOOLS)
}

/// The specifications of `offered`.
pub fn specs_of(offered: &[Tool]) -> Vec<ToolSpec> {
    offered
        .iter()
        .map(|t| ToolSpec {
            name: t.name().to_owned(),
            description: t.description().to_owned(),
            parameters: serde_json::Value::Object(t.input_schema().clone()),
        })
        .collect()
}

/// Checks a tool call's arguments against the tool's schema; the error is the message for the
/// model (it names the tool and the field).
pub fn validate(name: &str, arguments: &str) -> Result<Action, String> {
    validate_among(&TOOLS, name, arguments)
}

/// [`validate`] among the tools `offered`.
pub fn validate_among(offered: &[Tool], name: &str, arguments: &str) -> Result<Action, String> {
    parse_call(offered, name, arguments).map_err(|e| taskbox_tools::render::args_error(&e))
}

/// The paths a patch touches (from its `---`/`+++` headers, `a/` `b/` prefixes removed).
pub fn patch_paths(patch: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in patch.lines() {
        let rest = line
            .strip_prefix("+++ ")
            .or_else(|| line.strip_prefix("--- "));
        let Some(rest) = rest else { continue };
        let path = rest.split('\t').next().unwrap_or("").trim();
        if path == "/dev/null" || path.is_empty() {
            continue;
        }
        let path = path
            .strip_prefix("a/")
            .or_else(|| path.strip_prefix("b/"))
            .unwrap_or(path);
        if !out.iter().any(|p| p == path) {
            out.push(path.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use taskbox_core::api::{DiffRequest, ExecRequest};
    use taskbox_core::result::ExecResult;
    use taskbox_tools::{EXEC_OUTPUT_LIMIT, HARNESS_TOOLS, SANDBOX_TOOLS};

    use super::*;

    #[test]
    fn the_specs_are_the_sandbox_tools_then_the_harness_tools() {
        let specs = specs();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let want: Vec<&str> = SANDBOX_TOOLS
            .iter()
            .chain(&HARNESS_TOOLS)
            .map(|t| t.name())
            .collect();
        assert_eq!(names, want);
        for s in &specs {
            assert_eq!(s.parameters["type"], "object", "{}", s.name);
            assert_eq!(s.parameters["additionalProperties"], false, "{}", s.name);
        }
        let exec = specs.iter().find(|s| s.name == "exec").unwrap();
        assert_eq!(
            exec.parameters["properties"]["timeout_ms"]["type"],
            "integer"
        );
    }

    #[test]
    fn validation_names_the_field() {
        let e = validate("read_file", "{}").unwrap_err();
        assert!(e.contains("missing field `path`"), "{e}");
        let e = validate("exec", r#"{"command": "ls", "timeout_ms": "ten"}"#).unwrap_err();
        assert!(e.contains("field `timeout_ms`: invalid type"), "{e}");
        let e = validate("exec", r#"{"cmd": "ls"}"#).unwrap_err();
        assert!(e.contains("unknown field `cmd`"), "{e}");
        let e = validate("exec", r#"{"command": "ls", "argv": ["ls"]}"#).unwrap_err();
        assert!(e.contains("not both"), "{e}");
        let e = validate("write_file", "{\"path\": ").unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = validate("rm", "{}").unwrap_err();
        assert!(e.contains("unknown tool"), "{e}");
        let e = validate("plan", r#"{"steps": []}"#).unwrap_err();
        assert!(e.contains("`steps`: is empty"), "{e}");
        assert_eq!(
            validate("diff", ""),
            Ok(Action::Diff(DiffRequest::default()))
        );
        // `command`, the agent's older name of `shell`, still parses (recorded traces use it).
        for args in [r#"{"command": "ls"}"#, r#"{"shell": "ls"}"#] {
            assert_eq!(
                validate("exec", args),
                Ok(Action::Exec(ExecRequest {
                    shell: Some("ls".into()),
                    output_limit: Some(EXEC_OUTPUT_LIMIT),
                    ..ExecRequest::default()
                }))
            );
        }
    }

    #[test]
    fn patch_paths_come_from_headers() {
        let p =
            "--- a/src/x.rs\n+++ b/src/x.rs\n@@ -1 +1 @@\n-a\n+b\n--- /dev/null\n+++ b/new.txt\n";
        assert_eq!(patch_paths(p), ["src/x.rs", "new.txt"]);
    }

    #[test]
    fn a_timeout_comes_with_a_hint() {
        // From the JSON contract, so that fields added to ExecResult later keep their defaults.
        let r: ExecResult = serde_json::from_value(json!({
            "exit_code": null, "signal": 9, "timed_out": true, "duration_ms": 1000,
            "stdout": {"text": "", "bytes": 0, "truncated": false, "spill_path": null},
            "stderr": {"text": "", "bytes": 0, "truncated": false, "spill_path": null},
            "changes": [], "violations": [],
            "resources": {"cpu_ms": 0, "max_rss_bytes": 0, "oom_killed": false},
            "enforcement": {"landlock": "full", "seccomp": true, "network": "none", "limits": "none"}
        }))
        .unwrap();
        let text = render_exec(&r, Some(1000));
        assert!(text.contains("hint: narrow the command"), "{text}");
    }
}
