//! Input schemas: the request type's schema (schemars), shaped for a model: the tool's own
//! field descriptions, defaults and maxima, without the fields it does not offer, and without what
//! speaks of Rust (the type's title) or repeats the tool's description.

use schemars::JsonSchema;
use serde_json::Value;
use taskbox_contract::api::{
    DiffRequest, EditRequest, ExecRequest, ForkRequest, ListRequest, PatchRequest, ReadRequest,
    SearchRequest, WriteRequest,
};

use crate::call::{FinishArgs, PlanArgs, SubtaskArgs};
use crate::{JsonObject, Tool};

/// The schema of the type a tool's arguments are parsed into, as schemars derives it.
pub(crate) fn derived(tool: Tool) -> JsonObject {
    match tool {
        Tool::Exec => of::<ExecRequest>(),
        Tool::ReadFile => of::<ReadRequest>(),
        Tool::WriteFile => of::<WriteRequest>(),
        Tool::EditFile => of::<EditRequest>(),
        Tool::ApplyPatch => of::<PatchRequest>(),
        Tool::List => of::<ListRequest>(),
        Tool::Search => of::<SearchRequest>(),
        Tool::Diff => of::<DiffRequest>(),
        Tool::Fork => of::<ForkRequest>(),
        Tool::Plan => of::<PlanArgs>(),
        Tool::Finish => of::<FinishArgs>(),
        Tool::Subtask => of::<SubtaskArgs>(),
    }
}

fn of<T: JsonSchema>() -> JsonObject {
    match serde_json::to_value(schemars::schema_for!(T)) {
        Ok(Value::Object(schema)) => schema,
        _ => JsonObject::new(),
    }
}

/// The input schema a model reads.
pub(crate) fn build(tool: Tool) -> JsonObject {
    let def = tool.def();
    let mut schema = derived(tool);
    for key in ["$schema", "title", "description"] {
        schema.remove(key);
    }
    schema.insert("type".into(), Value::String("object".into()));
    // MCP requires properties even for a tool without arguments.
    let props = schema
        .entry("properties")
        .or_insert_with(|| Value::Object(JsonObject::new()));
    if let Value::Object(props) = props {
        for hidden in def.hidden {
            props.remove(hidden.name);
        }
        for prop in props.values_mut() {
            if let Value::Object(prop) = prop {
                drop_null_type(prop);
            }
        }
        for field in def.fields {
            let Some(Value::Object(prop)) = props.get_mut(field.name) else {
                continue;
            };
            if let Some(doc) = field.doc {
                prop.insert("description".into(), Value::String(doc.into()));
            }
            if let Some(default) = field.default {
                prop.insert("default".into(), default.value());
            }
            if let Some(max) = field.max {
                prop.insert("maximum".into(), Value::from(max));
            }
        }
    }
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.retain(|r| !def.hidden.iter().any(|h| r == h.name));
    }
    schema
        .entry("additionalProperties")
        .or_insert(Value::Bool(false));
    schema
}

/// `"type": ["integer", "null"]` becomes `"type": "integer"`: an optional field is one the model
/// leaves out (a null is taken as left out all the same).
fn drop_null_type(prop: &mut JsonObject) {
    let Some(Value::Array(types)) = prop.get("type") else {
        return;
    };
    let kept: Vec<Value> = types.iter().filter(|t| *t != "null").cloned().collect();
    let kept = match <[Value; 1]>::try_from(kept) {
        Ok([one]) => one,
        Err(many) => Value::Array(many),
    };
    prop.insert("type".into(), kept);
    if prop.get("default") == Some(&Value::Null) {
        prop.remove("default");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde_json::json;

    use super::*;
    use crate::{EXEC_OUTPUT_LIMIT, EXEC_OUTPUT_MAX, READ_LIMIT, READ_MAX, SANDBOX_TOOLS};

    fn props(tool: Tool) -> &'static JsonObject {
        tool.input_schema()["properties"].as_object().unwrap()
    }

    fn fields(tool: Tool) -> Vec<&'static str> {
        let mut f: Vec<&str> = props(tool).keys().map(String::as_str).collect();
        f.sort_unstable();
        f
    }

    #[test]
    fn every_tool_has_a_closed_object_schema_with_described_properties() {
        for t in Tool::ALL {
            let s = t.input_schema();
            assert_eq!(s["type"], "object", "{t:?}");
            assert_eq!(s["additionalProperties"], false, "{t:?}");
            assert!(
                s.get("title").is_none() && s.get("$schema").is_none(),
                "{t:?}"
            );
            assert!(!props(t).is_empty(), "{t:?} has no properties");
            for (name, p) in props(t) {
                assert!(
                    p["description"].as_str().is_some_and(|d| d.len() > 5),
                    "{t:?}.{name} has no description"
                );
                assert!(!p["type"].is_array(), "{t:?}.{name}: {}", p["type"]);
                assert!(
                    !p.get("default").is_some_and(Value::is_null),
                    "{t:?}.{name}"
                );
            }
            assert!(t.description().len() > 40, "{t:?}");
        }
    }

    #[test]
    fn the_fields_of_each_tool() {
        let expect = [
            (
                Tool::Exec,
                &[
                    "argv",
                    "cwd",
                    "env",
                    "merge_output",
                    "output_limit",
                    "shell",
                    "stdin",
                    "stdin_encoding",
                    "timeout_ms",
                    "user",
                ][..],
            ),
            (
                Tool::ReadFile,
                &[
                    "length",
                    "line_end",
                    "line_start",
                    "max_bytes",
                    "offset",
                    "path",
                ],
            ),
            (
                Tool::WriteFile,
                &["content", "create_parents", "encoding", "mode", "path"],
            ),
            (Tool::EditFile, &["expected_count", "new", "old", "path"]),
            (Tool::ApplyPatch, &["patch"]),
            (
                Tool::List,
                &[
                    "glob",
                    "include_hidden",
                    "include_ignored",
                    "limit",
                    "max_depth",
                    "path",
                ],
            ),
            (
                Tool::Search,
                &[
                    "case_insensitive",
                    "glob",
                    "include_hidden",
                    "include_ignored",
                    "max_matches",
                    "path",
                    "pattern",
                ],
            ),
            (Tool::Diff, &["include_ignored", "since"]),
            (Tool::Plan, &["files", "steps"]),
            (Tool::Finish, &["summary"]),
        ];
        for (tool, want) in expect {
            assert_eq!(fields(tool), want, "{tool:?}");
        }
        let required = |t: Tool| t.input_schema().get("required").cloned();
        assert_eq!(required(Tool::Exec), None);
        assert_eq!(required(Tool::ReadFile), Some(json!(["path"])));
        assert_eq!(
            required(Tool::EditFile),
            Some(json!(["path", "old", "new"]))
        );
        assert_eq!(required(Tool::Search), Some(json!(["pattern"])));
        assert_eq!(required(Tool::Plan), Some(json!(["steps"])));
        assert_eq!(required(Tool::Finish), Some(json!(["summary"])));
    }

    #[test]
    fn exec_hides_background_and_says_nothing_of_it() {
        let derived = derived(Tool::Exec);
        assert!(derived["properties"].get("background").is_some());
        let exec = props(Tool::Exec);
        assert!(exec.get("background").is_none());
        for (name, p) in exec {
            let d = p["description"].as_str().unwrap();
            assert!(!d.contains("background"), "{name}: {d}");
        }
        assert!(!Tool::Exec.description().contains("background"));
    }

    #[test]
    fn bounds_are_in_the_schema() {
        let exec = &props(Tool::Exec)["output_limit"];
        assert_eq!(exec["type"], "integer");
        assert_eq!(exec["default"], EXEC_OUTPUT_LIMIT);
        assert_eq!(exec["maximum"], EXEC_OUTPUT_MAX);
        let read = &props(Tool::ReadFile)["max_bytes"];
        assert_eq!(read["default"], READ_LIMIT);
        assert_eq!(read["maximum"], READ_MAX);
        assert_eq!(props(Tool::WriteFile)["create_parents"]["default"], true);
        assert_eq!(props(Tool::Exec)["timeout_ms"]["type"], "integer");
        assert_eq!(props(Tool::Exec)["argv"]["type"], "array");
        assert_eq!(props(Tool::Exec)["argv"]["items"]["type"], "string");
    }

    #[test]
    fn the_sandbox_tools_describe_no_harness() {
        for t in SANDBOX_TOOLS {
            let d = t.description();
            for word in ["contract", "harness", "verification"] {
                assert!(!d.contains(word), "{t:?}: {d}");
            }
        }
    }
}
