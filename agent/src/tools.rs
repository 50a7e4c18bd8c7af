//! The tools offered to the model: the narrow API (exec, read_file, write_file, edit_file,
//! apply_patch, list, search, diff) plus `plan` and `finish`. Each has a JSON schema; arguments
//! are checked against it before anything runs, and a bad one comes back to the model as a
//! validation message naming the field. Results are rendered as compact text observations.

use serde_json::{Map, Value, json};
use taskbox_core::api::*;
use taskbox_core::result::ExecResult;

use crate::model::ToolSpec;

/// Bytes of each output stream an exec keeps for the model (head and tail).
pub const EXEC_OUTPUT_LIMIT: u64 = 8 * 1024;
/// Bytes of a file read returned to the model.
pub const READ_LIMIT: u64 = 32 * 1024;

/// The type of one argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Int,
    Bool,
    StrList,
}

impl Kind {
    fn schema(self) -> Value {
        match self {
            Kind::Str => json!({"type": "string"}),
            Kind::Int => json!({"type": "integer", "minimum": 0}),
            Kind::Bool => json!({"type": "boolean"}),
            Kind::StrList => json!({"type": "array", "items": {"type": "string"}}),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Str => "a string",
            Kind::Int => "a non-negative integer",
            Kind::Bool => "a boolean",
            Kind::StrList => "an array of strings",
        }
    }

    fn accepts(self, v: &Value) -> bool {
        match self {
            Kind::Str => v.is_string(),
            Kind::Int => v.is_u64(),
            Kind::Bool => v.is_boolean(),
            Kind::StrList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
        }
    }
}

struct Param {
    name: &'static str,
    kind: Kind,
    required: bool,
    doc: &'static str,
}

const fn p(name: &'static str, kind: Kind, required: bool, doc: &'static str) -> Param {
    Param {
        name,
        kind,
        required,
        doc,
    }
}

struct Tool {
    name: &'static str,
    doc: &'static str,
    params: &'static [Param],
}

const TOOLS: &[Tool] = &[
    Tool {
        name: "exec",
        doc: "Run a command in the sandbox (the workspace is the working directory). Returns the \
              exit code, duration, head and tail of stdout/stderr (with the path of the full \
              output when cut), the files it changed and anything the policy refused.",
        params: &[
            p(
                "command",
                Kind::Str,
                false,
                "A shell command line (run with /bin/sh -c). Give this or argv.",
            ),
            p(
                "argv",
                Kind::StrList,
                false,
                "The program and its arguments. Give this or command.",
            ),
            p(
                "cwd",
                Kind::Str,
                false,
                "Working directory relative to the workspace root.",
            ),
            p(
                "timeout_ms",
                Kind::Int,
                false,
                "Wall-clock limit in milliseconds.",
            ),
        ],
    },
    Tool {
        name: "read_file",
        doc: "Read a text file of the workspace, optionally a line range.",
        params: &[
            p(
                "path",
                Kind::Str,
                true,
                "Path relative to the workspace root.",
            ),
            p("line_start", Kind::Int, false, "First line (1-based)."),
            p("line_end", Kind::Int, false, "Last line (inclusive)."),
        ],
    },
    Tool {
        name: "write_file",
        doc: "Create or replace a file with the given content.",
        params: &[
            p(
                "path",
                Kind::Str,
                true,
                "Path relative to the workspace root.",
            ),
            p("content", Kind::Str, true, "The whole new content."),
        ],
    },
    Tool {
        name: "edit_file",
        doc: "Replace exact text in a file. `old` must occur exactly `expected_count` times \
              (default 1); all occurrences are replaced. Returns the edit's diff.",
        params: &[
            p(
                "path",
                Kind::Str,
                true,
                "Path relative to the workspace root.",
            ),
            p("old", Kind::Str, true, "The exact text to replace."),
            p("new", Kind::Str, true, "The replacement."),
            p(
                "expected_count",
                Kind::Int,
                false,
                "How many occurrences must exist.",
            ),
        ],
    },
    Tool {
        name: "apply_patch",
        doc: "Apply a unified diff (paths relative to the workspace root, a/ b/ prefixes \
              allowed), all or nothing.",
        params: &[p("patch", Kind::Str, true, "The unified diff.")],
    },
    Tool {
        name: "list",
        doc: "List a directory (gitignore-aware).",
        params: &[
            p(
                "path",
                Kind::Str,
                false,
                "Directory relative to the workspace root (default .).",
            ),
            p(
                "glob",
                Kind::Str,
                false,
                "Only entries matching this glob, e.g. **/*.rs.",
            ),
            p("max_depth", Kind::Int, false, "Depth limit."),
        ],
    },
    Tool {
        name: "search",
        doc: "Search file contents with a regular expression; returns matches with line numbers.",
        params: &[
            p("pattern", Kind::Str, true, "A regular expression."),
            p("path", Kind::Str, false, "Directory to search (default .)."),
            p("glob", Kind::Str, false, "Only files matching this glob."),
            p("case_insensitive", Kind::Bool, false, "Ignore case."),
        ],
    },
    Tool {
        name: "diff",
        doc: "The unified diff of everything changed in the workspace so far.",
        params: &[],
    },
    Tool {
        name: "plan",
        doc: "Submit your plan: the steps and the files you expect to change. Required before \
              the first edit when the contract asks for a plan.",
        params: &[
            p("steps", Kind::StrList, true, "The steps, in order."),
            p("files", Kind::StrList, false, "Files you expect to change."),
        ],
    },
    Tool {
        name: "finish",
        doc: "Say you are done. The harness then runs the contract's verification commands; the \
              task completes only if they pass, otherwise you get their output and continue.",
        params: &[p("summary", Kind::Str, true, "What you changed and why.")],
    },
];

/// The tool specifications sent to the model.
pub fn specs() -> Vec<ToolSpec> {
    TOOLS
        .iter()
        .map(|t| {
            let mut props = Map::new();
            let mut required = Vec::new();
            for prm in t.params {
                let mut s = prm.kind.schema();
                s["description"] = Value::String(prm.doc.to_owned());
                props.insert(prm.name.to_owned(), s);
                if prm.required {
                    required.push(Value::String(prm.name.to_owned()));
                }
            }
            ToolSpec {
                name: t.name.to_owned(),
                description: t.doc.to_owned(),
                parameters: json!({"type": "object", "properties": props,
                    "required": required, "additionalProperties": false}),
            }
        })
        .collect()
}

/// A validated tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Exec(ExecRequest),
    Read(ReadRequest),
    Write(WriteRequest),
    Edit(EditRequest),
    Patch(PatchRequest),
    List(ListRequest),
    Search(SearchRequest),
    Diff,
    Plan {
        steps: Vec<String>,
        files: Vec<String>,
    },
    Finish {
        summary: String,
    },
}

impl Action {
    /// Whether the action changes files.
    pub fn is_edit(&self) -> bool {
        matches!(self, Action::Write(_) | Action::Edit(_) | Action::Patch(_))
    }
}

/// Checks a tool call's arguments against the tool's schema; the error is the message for the
/// model (it names the tool and the field).
pub fn validate(name: &str, arguments: &str) -> Result<Action, String> {
    let tool = TOOLS.iter().find(|t| t.name == name).ok_or_else(|| {
        format!(
            "unknown tool {name:?}: the tools are {}",
            TOOLS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
        )
    })?;
    let trimmed = arguments.trim();
    let args: Value = if trimmed.is_empty() {
        json!({})
    } else {
        serde_json::from_str(trimmed).map_err(|e| {
            format!("invalid arguments for {name}: not valid JSON ({e}); send one JSON object")
        })?
    };
    let obj = args
        .as_object()
        .ok_or_else(|| format!("invalid arguments for {name}: expected a JSON object"))?;
    for key in obj.keys() {
        if !tool.params.iter().any(|p| p.name == key) {
            let known: Vec<&str> = tool.params.iter().map(|p| p.name).collect();
            return Err(format!(
                "invalid arguments for {name}: unknown field `{key}` (fields: {})",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ));
        }
    }
    for prm in tool.params {
        match obj.get(prm.name) {
            None | Some(Value::Null) if prm.required => {
                return Err(format!(
                    "invalid arguments for {name}: missing required field `{}` ({})",
                    prm.name,
                    prm.kind.name()
                ));
            }
            Some(v) if !v.is_null() && !prm.kind.accepts(v) => {
                return Err(format!(
                    "invalid arguments for {name}: field `{}` must be {}, got {}",
                    prm.name,
                    prm.kind.name(),
                    short_json(v)
                ));
            }
            _ => {}
        }
    }
    let s = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_owned);
    let n = |k: &str| obj.get(k).and_then(Value::as_u64);
    let list = |k: &str| -> Vec<String> {
        obj.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let req_s = |k: &str| s(k).unwrap_or_default();
    Ok(match name {
        "exec" => {
            let argv = obj
                .get("argv")
                .filter(|v| !v.is_null())
                .map(|_| list("argv"));
            let command = s("command");
            match (&argv, &command) {
                (Some(_), Some(_)) => {
                    return Err(
                        "invalid arguments for exec: give either `command` or `argv`, not both"
                            .into(),
                    );
                }
                (None, None) => {
                    return Err(
                        "invalid arguments for exec: missing field `command` (a shell command \
                         line) or `argv`"
                            .into(),
                    );
                }
                (Some(a), None) if a.is_empty() => {
                    return Err("invalid arguments for exec: field `argv` is empty".into());
                }
                (None, Some(c)) if c.trim().is_empty() => {
                    return Err("invalid arguments for exec: field `command` is empty".into());
                }
                _ => {}
            }
            Action::Exec(ExecRequest {
                argv,
                shell: command,
                cwd: s("cwd"),
                timeout_ms: n("timeout_ms"),
                output_limit: Some(EXEC_OUTPUT_LIMIT),
                ..ExecRequest::default()
            })
        }
        "read_file" => Action::Read(ReadRequest {
            path: req_s("path"),
            line_start: n("line_start"),
            line_end: n("line_end"),
            max_bytes: Some(READ_LIMIT),
            ..ReadRequest::default()
        }),
        "write_file" => Action::Write(WriteRequest {
            path: req_s("path"),
            content: req_s("content"),
            create_parents: true,
            ..WriteRequest::default()
        }),
        "edit_file" => Action::Edit(EditRequest {
            path: req_s("path"),
            old: req_s("old"),
            new: req_s("new"),
            expected_count: n("expected_count"),
        }),
        "apply_patch" => Action::Patch(PatchRequest {
            patch: req_s("patch"),
        }),
        "list" => Action::List(ListRequest {
            path: s("path"),
            glob: s("glob"),
            max_depth: n("max_depth").map(|d| d.min(u32::MAX as u64) as u32),
            limit: Some(300),
            ..ListRequest::default()
        }),
        "search" => Action::Search(SearchRequest {
            pattern: req_s("pattern"),
            path: s("path"),
            glob: s("glob"),
            case_insensitive: obj
                .get("case_insensitive")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_matches: Some(100),
            ..SearchRequest::default()
        }),
        "diff" => Action::Diff,
        "plan" => {
            let steps = list("steps");
            if steps.is_empty() {
                return Err("invalid arguments for plan: field `steps` is empty".into());
            }
            Action::Plan {
                steps,
                files: list("files"),
            }
        }
        "finish" => Action::Finish {
            summary: req_s("summary"),
        },
        _ => return Err(format!("unknown tool {name:?}")),
    })
}

fn short_json(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...", s.chars().take(60).collect::<String>())
    } else {
        s
    }
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

/// Renders an exec result for the model. `limit_ms` is the timeout that applied.
pub fn render_exec(r: &ExecResult, limit_ms: Option<u64>) -> String {
    let mut s = String::new();
    if r.timed_out {
        s.push_str(&format!(
            "timed out after {} ms: the whole process tree was killed (partial output below).\n\
             hint: narrow the command (one test, a filter, a smaller input) or pass a larger \
             timeout_ms{}.\n",
            r.duration_ms,
            limit_ms
                .map(|l| format!(" (the limit was {l} ms)"))
                .unwrap_or_default()
        ));
    } else if let Some(sig) = r.signal {
        s.push_str(&format!(
            "killed by signal {sig} after {} ms\n",
            r.duration_ms
        ));
    } else if let Some(code) = r.exit_code {
        s.push_str(&format!("exit_code: {code} ({} ms)\n", r.duration_ms));
    } else {
        s.push_str("not run\n");
    }
    for (name, out) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
        if out.bytes == 0 {
            continue;
        }
        if out.truncated {
            s.push_str(&format!(
                "{name} ({} bytes, cut: head and tail shown{}):\n",
                out.bytes,
                out.spill_path
                    .as_ref()
                    .map(|p| format!("; the whole stream is in {p}"))
                    .unwrap_or_default()
            ));
        } else {
            s.push_str(&format!("{name}:\n"));
        }
        s.push_str(&out.text);
        if !out.text.ends_with('\n') {
            s.push('\n');
        }
    }
    if !r.changes.is_empty() {
        let list: Vec<String> = r
            .changes
            .iter()
            .map(|c| format!("{} ({:?})", c.path, c.kind).to_lowercase())
            .collect();
        s.push_str(&format!("changed files: {}\n", list.join(", ")));
    }
    for v in &r.violations {
        s.push_str(&format!("violation ({}): {}\n", v.kind, v.detail));
    }
    if r.resources.oom_killed {
        s.push_str("the memory limit was reached: a process was killed by the OOM killer\n");
    }
    s
}

/// Renders an API error for the model.
pub fn render_error(e: &ApiError) -> String {
    format!("error ({}): {e}", e.code())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_an_object_schema() {
        let specs = specs();
        assert_eq!(specs.len(), 10);
        for s in &specs {
            assert_eq!(s.parameters["type"], "object", "{}", s.name);
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
        assert!(e.contains("missing required field `path`"), "{e}");
        let e = validate("exec", r#"{"command": "ls", "timeout_ms": "ten"}"#).unwrap_err();
        assert!(
            e.contains("field `timeout_ms` must be a non-negative integer"),
            "{e}"
        );
        let e = validate("exec", r#"{"cmd": "ls"}"#).unwrap_err();
        assert!(e.contains("unknown field `cmd`"), "{e}");
        let e = validate("exec", r#"{"command": "ls", "argv": ["ls"]}"#).unwrap_err();
        assert!(e.contains("not both"), "{e}");
        let e = validate("write_file", "{\"path\": ").unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = validate("rm", "{}").unwrap_err();
        assert!(e.contains("unknown tool"), "{e}");
        let e = validate("plan", r#"{"steps": []}"#).unwrap_err();
        assert!(e.contains("`steps` is empty"), "{e}");
        assert!(matches!(validate("diff", ""), Ok(Action::Diff)));
        match validate("exec", r#"{"command": "ls"}"#).unwrap() {
            Action::Exec(r) => {
                assert_eq!(r.shell.as_deref(), Some("ls"));
                assert_eq!(r.output_limit, Some(EXEC_OUTPUT_LIMIT));
            }
            other => panic!("{other:?}"),
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
