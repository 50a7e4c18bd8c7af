//! A tool call's arguments, checked against the tool's schema and parsed into the API request
//! the call asks for. Every refusal names the tool, and the field where there is one, in words a
//! model can act on.

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use taskbox_contract::api::{
    DiffRequest, EditRequest, ExecRequest, ForkRequest, ListRequest, PatchRequest, ReadRequest,
    SearchRequest, WriteRequest,
};

use crate::{JsonObject, Tool};

/// A parsed tool call: the operation and its request.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    Exec(ExecRequest),
    Read(ReadRequest),
    Write(WriteRequest),
    Edit(EditRequest),
    Patch(PatchRequest),
    List(ListRequest),
    Search(SearchRequest),
    Diff(DiffRequest),
    Fork(ForkRequest),
    Plan {
        steps: Vec<String>,
        files: Vec<String>,
    },
    Finish {
        summary: String,
    },
    Subtask(SubtaskArgs),
}

impl Call {
    /// The tool that was called.
    pub fn tool(&self) -> Tool {
        match self {
            Call::Exec(_) => Tool::Exec,
            Call::Read(_) => Tool::ReadFile,
            Call::Write(_) => Tool::WriteFile,
            Call::Edit(_) => Tool::EditFile,
            Call::Patch(_) => Tool::ApplyPatch,
            Call::List(_) => Tool::List,
            Call::Search(_) => Tool::Search,
            Call::Diff(_) => Tool::Diff,
            Call::Fork(_) => Tool::Fork,
            Call::Plan { .. } => Tool::Plan,
            Call::Finish { .. } => Tool::Finish,
            Call::Subtask(_) => Tool::Subtask,
        }
    }

    /// Whether the call edits files (an exec may too, but is not an edit).
    pub fn is_edit(&self) -> bool {
        matches!(self, Call::Write(_) | Call::Edit(_) | Call::Patch(_))
    }
}

/// Why a tool call's arguments were refused. The message is what the model reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgsError {
    /// no tool of that name is offered
    #[error("unknown tool {name:?}: the tools are {}", .offered.join(", "))]
    UnknownTool {
        name: String,
        offered: Vec<&'static str>,
    },
    /// the arguments are not one JSON object
    #[error("invalid arguments for {tool}: {reason}; send one JSON object")]
    NotAnObject { tool: &'static str, reason: String },
    /// a field the schema does not have
    #[error("invalid arguments for {tool}: unknown field `{field}` (fields: {})", list(.offered))]
    Unknown {
        tool: &'static str,
        field: String,
        offered: Vec<String>,
    },
    /// a field of the API that the tool does not offer
    #[error("invalid arguments for {tool}: field `{field}` is not offered: {why}")]
    NotOffered {
        tool: &'static str,
        field: &'static str,
        why: &'static str,
    },
    /// a required field is missing
    #[error("invalid arguments for {tool}: missing field `{field}`")]
    Missing { tool: &'static str, field: String },
    /// a field's value is of the wrong type or out of bounds
    #[error("invalid arguments for {tool}: field `{field}`: {reason}")]
    Value {
        tool: &'static str,
        field: String,
        reason: String,
    },
    /// the fields do not fit together
    #[error("invalid arguments for {tool}: {reason}")]
    Invalid { tool: &'static str, reason: String },
}

fn list(fields: &[String]) -> String {
    if fields.is_empty() {
        "none".to_owned()
    } else {
        fields.join(", ")
    }
}

impl ArgsError {
    /// The field the refusal is about, if it is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            ArgsError::Unknown { field, .. }
            | ArgsError::Missing { field, .. }
            | ArgsError::Value { field, .. } => Some(field),
            ArgsError::NotOffered { field, .. } => Some(field),
            ArgsError::UnknownTool { .. }
            | ArgsError::NotAnObject { .. }
            | ArgsError::Invalid { .. } => None,
        }
    }

    /// The API error code of a refusal (as an HTTP API client would get for a bad request).
    pub fn code(&self) -> &'static str {
        "invalid_argument"
    }
}

/// Submit a plan.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PlanArgs {
    /// The steps, in order.
    steps: Vec<String>,
    /// Files you expect to change.
    #[serde(default)]
    files: Vec<String>,
}

/// Hand a sub-goal to a sub-agent in a fork.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubtaskArgs {
    /// The sub-goal, in one or two sentences: what the sub-agent must achieve.
    pub goal: String,
    /// The paths the sub-agent may change (prefixes or globs, within yours).
    pub scope: Vec<String>,
    /// The sub-agent's turns (default 10, at most 30).
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Commands that must exit 0 for its change to count (default: the contract's).
    #[serde(default)]
    pub verify: Option<Vec<String>>,
}

/// Say you are done.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FinishArgs {
    /// What you changed and why.
    summary: String,
}

/// Parses a call of the tool named `name`, one of `offered`, whose arguments are the JSON text
/// `arguments` as a model wrote it (empty text is taken as no arguments).
pub fn parse_call(offered: &[Tool], name: &str, arguments: &str) -> Result<Call, ArgsError> {
    let tool = offered
        .iter()
        .copied()
        .find(|t| t.name() == name)
        .ok_or_else(|| ArgsError::UnknownTool {
            name: name.to_owned(),
            offered: offered.iter().map(|t| t.name()).collect(),
        })?;
    let trimmed = arguments.trim();
    let args = if trimmed.is_empty() {
        Value::Object(JsonObject::new())
    } else {
        serde_json::from_str(trimmed).map_err(|e| ArgsError::NotAnObject {
            tool: tool.name(),
            reason: format!("not valid JSON ({e})"),
        })?
    };
    tool.parse(args)
}

pub(crate) fn parse(tool: Tool, args: Value) -> Result<Call, ArgsError> {
    let name = tool.name();
    let mut args = match args {
        Value::Object(args) => args,
        other => {
            return Err(ArgsError::NotAnObject {
                tool: name,
                reason: format!("expected a JSON object, got {}", kind(&other)),
            });
        }
    };
    check_fields(tool, &mut args)?;
    let args = Value::Object(args);
    Ok(match tool {
        Tool::Exec => {
            let req: ExecRequest = typed(name, args)?;
            check_exec(&req)?;
            Call::Exec(req)
        }
        Tool::ReadFile => Call::Read(typed(name, args)?),
        Tool::WriteFile => Call::Write(typed(name, args)?),
        Tool::EditFile => Call::Edit(typed(name, args)?),
        Tool::ApplyPatch => Call::Patch(typed(name, args)?),
        Tool::List => Call::List(typed(name, args)?),
        Tool::Search => Call::Search(typed(name, args)?),
        Tool::Diff => Call::Diff(typed(name, args)?),
        Tool::Fork => Call::Fork(typed(name, args)?),
        Tool::Plan => {
            let PlanArgs { steps, files } = typed(name, args)?;
            if steps.is_empty() {
                return Err(ArgsError::Value {
                    tool: name,
                    field: "steps".into(),
                    reason: "is empty: give at least one step".into(),
                });
            }
            Call::Plan { steps, files }
        }
        Tool::Finish => {
            let FinishArgs { summary } = typed(name, args)?;
            Call::Finish { summary }
        }
        Tool::Subtask => {
            let a: SubtaskArgs = typed(name, args)?;
            if a.goal.trim().is_empty() {
                return Err(ArgsError::Value {
                    tool: name,
                    field: "goal".into(),
                    reason: "is empty: say what the sub-agent must achieve".into(),
                });
            }
            if a.scope.is_empty() {
                return Err(ArgsError::Value {
                    tool: name,
                    field: "scope".into(),
                    reason: "is empty: give the paths the sub-agent may change".into(),
                });
            }
            if a.max_turns.is_some_and(|n| n == 0 || n > 30) {
                return Err(ArgsError::Value {
                    tool: name,
                    field: "max_turns".into(),
                    reason: "must be 1 to 30".into(),
                });
            }
            Call::Subtask(a)
        }
    })
}

/// Renames old field names, refuses hidden and unknown fields and missing required ones, fills in
/// the tool's defaults and checks its maxima.
fn check_fields(tool: Tool, args: &mut JsonObject) -> Result<(), ArgsError> {
    let name = tool.name();
    let def = tool.def();
    let schema = tool.input_schema();
    for alias in def.aliases {
        if let Some(v) = args.remove(alias.old) {
            if args.contains_key(alias.new) {
                return Err(ArgsError::Invalid {
                    tool: name,
                    reason: format!(
                        "`{}` is an older name of `{}`: give only `{}`",
                        alias.old, alias.new, alias.new
                    ),
                });
            }
            args.insert(alias.new.to_owned(), v);
        }
    }
    if let Some(hidden) = def.hidden.iter().find(|h| args.contains_key(h.name)) {
        return Err(ArgsError::NotOffered {
            tool: name,
            field: hidden.name,
            why: hidden.why,
        });
    }
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if let Some(key) = args.keys().find(|k| !props.contains_key(*k)) {
        return Err(ArgsError::Unknown {
            tool: name,
            field: key.clone(),
            offered: props.keys().cloned().collect(),
        });
    }
    let required = schema.get("required").and_then(Value::as_array);
    for field in required.into_iter().flatten().filter_map(Value::as_str) {
        if args.get(field).is_none_or(Value::is_null) {
            return Err(ArgsError::Missing {
                tool: name,
                field: field.to_owned(),
            });
        }
    }
    for field in def.fields {
        if let Some(default) = field.default
            && args.get(field.name).is_none_or(Value::is_null)
        {
            args.insert(field.name.to_owned(), default.value());
        }
        if let (Some(max), Some(n)) = (field.max, args.get(field.name).and_then(Value::as_u64))
            && n > max
        {
            return Err(ArgsError::Value {
                tool: name,
                field: field.name.to_owned(),
                reason: format!("must be at most {max}, got {n}"),
            });
        }
    }
    Ok(())
}

/// Exactly one of `shell` and `argv`, and neither empty (the API says so too, later and in its
/// own words).
fn check_exec(req: &ExecRequest) -> Result<(), ArgsError> {
    let empty = |field: &str| ArgsError::Value {
        tool: Tool::Exec.name(),
        field: field.to_owned(),
        reason: "is empty".into(),
    };
    match (&req.shell, &req.argv) {
        (Some(_), Some(_)) => Err(ArgsError::Invalid {
            tool: Tool::Exec.name(),
            reason: "give either `shell` (a command line) or `argv` (program and arguments), \
                     not both"
                .into(),
        }),
        (None, None) => Err(ArgsError::Invalid {
            tool: Tool::Exec.name(),
            reason: "missing field `shell` (a command line) or `argv` (program and arguments)"
                .into(),
        }),
        (Some(shell), None) if shell.trim().is_empty() => Err(empty("shell")),
        (None, Some(argv)) if argv.is_empty() => Err(empty("argv")),
        _ => Ok(()),
    }
}

/// Deserializes checked arguments, naming the field a value does not fit.
fn typed<T: DeserializeOwned>(tool: &'static str, args: Value) -> Result<T, ArgsError> {
    serde_path_to_error::deserialize(args).map_err(|e| {
        let field = e.path().to_string();
        // serde names Rust's types; a model knows JSON's.
        let reason = e
            .into_inner()
            .to_string()
            .replace("expected u64", "expected a non-negative integer")
            .replace("expected u32", "expected a non-negative integer below 2^32")
            .replace("expected a sequence", "expected an array");
        if field == "." {
            ArgsError::Invalid { tool, reason }
        } else {
            ArgsError::Value {
                tool,
                field,
                reason,
            }
        }
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde_json::json;

    use super::*;
    use crate::{EXEC_OUTPUT_LIMIT, LIST_LIMIT, READ_LIMIT, SANDBOX_TOOLS, SEARCH_LIMIT};

    fn err(tool: Tool, args: Value) -> ArgsError {
        tool.parse(args).unwrap_err()
    }

    #[test]
    fn errors_name_the_tool_and_the_field() {
        let e = err(Tool::EditFile, json!({"path": "a", "old": "x"}));
        assert_eq!(e.field(), Some("new"));
        assert_eq!(
            e.to_string(),
            "invalid arguments for edit_file: missing field `new`"
        );
        assert_eq!(e.code(), "invalid_argument");

        let e = err(Tool::Exec, json!({"shell": "true", "timeout_ms": "soon"}));
        assert_eq!(e.field(), Some("timeout_ms"));
        assert_eq!(
            e.to_string(),
            "invalid arguments for exec: field `timeout_ms`: invalid type: string \"soon\", \
             expected a non-negative integer"
        );

        let e = err(Tool::ReadFile, json!({"file": "src/a.rs"}));
        assert_eq!(e.field(), Some("file"));
        assert_eq!(
            e.to_string(),
            "invalid arguments for read_file: unknown field `file` (fields: length, line_end, \
             line_start, max_bytes, offset, path)"
        );
        let e = err(Tool::Diff, json!({"bogus": 1}));
        assert!(
            e.to_string()
                .contains("unknown field `bogus` (fields: include_ignored, since)"),
            "{e}"
        );
        let e = err(Tool::ApplyPatch, json!({"patch": "x", "strip": 1}));
        assert_eq!(e.field(), Some("strip"));

        let e = err(Tool::ReadFile, json!({}));
        assert_eq!(
            e.to_string(),
            "invalid arguments for read_file: missing field `path`"
        );
        let e = err(Tool::ReadFile, json!({"path": null}));
        assert_eq!(e.field(), Some("path"));

        let e = err(Tool::Exec, json!({"argv": ["ls", 3]}));
        assert_eq!(e.field(), Some("argv[1]"), "{e}");
        let e = err(Tool::List, json!({"max_depth": -1}));
        assert_eq!(e.field(), Some("max_depth"));
        let e = err(
            Tool::Search,
            json!({"pattern": "x", "case_insensitive": "yes"}),
        );
        assert_eq!(e.field(), Some("case_insensitive"));
        let e = err(Tool::Plan, json!({"steps": []}));
        assert_eq!(e.field(), Some("steps"));
        assert!(e.to_string().contains("`steps`: is empty"), "{e}");

        let e = err(Tool::Exec, json!(["ls"]));
        assert_eq!(
            e.to_string(),
            "invalid arguments for exec: expected a JSON object, got an array; send one JSON object"
        );
    }

    #[test]
    fn exec_takes_exactly_one_command_and_no_background() {
        let e = err(Tool::Exec, json!({"shell": "ls", "argv": ["ls"]}));
        assert!(e.to_string().contains("not both"), "{e}");
        let e = err(Tool::Exec, json!({"cwd": "src"}));
        assert!(e.to_string().contains("missing field `shell`"), "{e}");
        assert_eq!(err(Tool::Exec, json!({"argv": []})).field(), Some("argv"));
        assert_eq!(
            err(Tool::Exec, json!({"shell": "  "})).field(),
            Some("shell")
        );
        let e = err(Tool::Exec, json!({"shell": "sleep 9", "background": true}));
        assert_eq!(e.field(), Some("background"));
        assert!(
            e.to_string()
                .contains("not offered: exec always waits for the command"),
            "{e}"
        );
    }

    #[test]
    fn the_old_name_of_shell_is_still_taken() {
        let Call::Exec(r) = Tool::Exec.parse(json!({"command": "ls -l"})).unwrap() else {
            panic!("not an exec")
        };
        assert_eq!(r.shell.as_deref(), Some("ls -l"));
        let e = err(Tool::Exec, json!({"command": "ls", "shell": "ls"}));
        assert!(e.to_string().contains("older name of `shell`"), "{e}");
        // It is not advertised.
        assert!(
            Tool::Exec.input_schema()["properties"]
                .get("command")
                .is_none()
        );
    }

    #[test]
    fn defaults_fill_what_the_model_left_out_and_maxima_hold() {
        let Call::Exec(r) = Tool::Exec.parse(json!({"shell": "ls"})).unwrap() else {
            panic!()
        };
        assert_eq!(r.output_limit, Some(EXEC_OUTPUT_LIMIT));
        assert_eq!(r.timeout_ms, None);
        assert!(!r.background);
        let Call::Exec(r) = Tool::Exec
            .parse(json!({"shell": "ls", "output_limit": null}))
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(r.output_limit, Some(EXEC_OUTPUT_LIMIT));
        let e = err(Tool::Exec, json!({"shell": "ls", "output_limit": 1 << 20}));
        assert_eq!(e.field(), Some("output_limit"));
        assert!(
            e.to_string().contains("must be at most 65536, got 1048576"),
            "{e}"
        );

        let Call::Read(r) = Tool::ReadFile
            .parse(json!({"path": "a", "line_start": 3}))
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(
            r,
            ReadRequest {
                path: "a".into(),
                line_start: Some(3),
                max_bytes: Some(READ_LIMIT),
                ..ReadRequest::default()
            }
        );
        let Call::Write(w) = Tool::WriteFile
            .parse(json!({"path": "d/a", "content": "x"}))
            .unwrap()
        else {
            panic!()
        };
        assert!(w.create_parents);
        let Call::Write(w) = Tool::WriteFile
            .parse(json!({"path": "d/a", "content": "x", "create_parents": false}))
            .unwrap()
        else {
            panic!()
        };
        assert!(!w.create_parents);
        let Call::List(l) = Tool::List.parse(json!({})).unwrap() else {
            panic!()
        };
        assert_eq!(l.limit, Some(LIST_LIMIT));
        let Call::Search(s) = Tool::Search.parse(json!({"pattern": "fn"})).unwrap() else {
            panic!()
        };
        assert_eq!(s.max_matches, Some(SEARCH_LIMIT));
        assert_eq!(
            Tool::Diff.parse(json!({})).unwrap(),
            Call::Diff(DiffRequest::default())
        );
    }

    #[test]
    fn raw_calls_name_unknown_tools_and_bad_json() {
        let e = parse_call(&SANDBOX_TOOLS, "plan", "{}").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown tool \"plan\": the tools are exec, read_file"),
            "{e}"
        );
        let e = parse_call(&Tool::ALL, "write_file", "{\"path\": ").unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        assert_eq!(
            parse_call(&Tool::ALL, "diff", "  ").unwrap(),
            Call::Diff(DiffRequest::default())
        );
        let call = parse_call(&Tool::ALL, "plan", r#"{"steps": ["a", "b"]}"#).unwrap();
        assert_eq!(
            call,
            Call::Plan {
                steps: vec!["a".into(), "b".into()],
                files: vec![]
            }
        );
        assert_eq!(call.tool(), Tool::Plan);
        assert!(!call.is_edit());
        let call = parse_call(&Tool::ALL, "apply_patch", r#"{"patch": "p"}"#).unwrap();
        assert!(call.is_edit());
        assert_eq!(
            parse_call(&Tool::ALL, "finish", r#"{"summary": "done"}"#).unwrap(),
            Call::Finish {
                summary: "done".into()
            }
        );
    }

    #[test]
    fn every_tool_parses_what_its_schema_requires() {
        for t in Tool::ALL {
            let schema = t.input_schema();
            let mut args = JsonObject::new();
            for field in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                let v = match schema["properties"][field]["type"].as_str() {
                    Some("array") => json!(["x"]),
                    _ => json!("x"),
                };
                args.insert(field.to_owned(), v);
            }
            if t == Tool::Exec {
                args.insert("shell".into(), json!("true"));
            }
            let call = t.parse(Value::Object(args)).unwrap();
            assert_eq!(call.tool(), t);
        }
    }
}
