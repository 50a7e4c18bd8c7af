//! The tool list and its dispatch: one MCP tool per narrow-API operation on the served sandbox.
//!
//! The tools are written out by hand rather than with rmcp's macros so that arguments are parsed
//! here: a schema mismatch becomes a tool result with `isError` naming the field (which a model
//! can fix), not a JSON-RPC error (which clients tend to show opaquely).

use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use taskbox_core::api::{
    ApiError, DiffRequest, EditRequest, ExecRequest, ListRequest, PatchRequest, ReadRequest,
    SandboxApi, SandboxId, SandboxInfo, SearchRequest, WriteRequest,
};

use crate::render;

/// The tools' names, in the order they are listed (the names are the contract).
pub const TOOL_NAMES: [&str; 8] = [
    "exec",
    "read_file",
    "write_file",
    "edit_file",
    "apply_patch",
    "list",
    "search",
    "diff",
];

/// Fields of the API's request types that MCP does not offer: `exec` always waits (background
/// processes would need their own tools to be of use).
const EXEC_HIDDEN_FIELDS: [&str; 1] = ["background"];

/// The MCP server of one sandbox.
pub(crate) struct SandboxServer {
    backend: Arc<dyn SandboxApi>,
    info: SandboxInfo,
    tools: Vec<Tool>,
}

impl SandboxServer {
    pub(crate) fn new(backend: Arc<dyn SandboxApi>, info: SandboxInfo) -> SandboxServer {
        SandboxServer {
            backend,
            info,
            tools: tool_list(),
        }
    }

    fn id(&self) -> &SandboxId {
        &self.info.id
    }

    /// Parses `args` as `Req`, runs `op` on the blocking pool and renders its result (or error).
    async fn call<Req, Res>(
        &self,
        tool: &'static str,
        args: JsonObject,
        op: fn(&dyn SandboxApi, &SandboxId, Req) -> Result<Res, ApiError>,
        text: fn(&Res) -> String,
    ) -> CallToolResult
    where
        Req: DeserializeOwned + Send + 'static,
        Res: Serialize + Send + 'static,
    {
        let req = match parse_args::<Req>(tool, args) {
            Ok(req) => req,
            Err(e) => return error_result(&e),
        };
        let id = self.id().clone();
        let backend = Arc::clone(&self.backend);
        let outcome = tokio::task::spawn_blocking(move || op(backend.as_ref(), &id, req))
            .await
            .unwrap_or_else(|e| Err(ApiError::internal(format!("{tool} failed: {e}"))));
        match outcome {
            Ok(res) => success_result(text(&res), &res),
            Err(e) => {
                tracing::debug!(sandbox = %self.id(), tool, code = e.code(), error = %e, "tool failed");
                error_result(&e)
            }
        }
    }

    async fn dispatch(&self, name: &str, args: JsonObject) -> Option<CallToolResult> {
        let result = match name {
            "exec" => {
                if let Some(field) = EXEC_HIDDEN_FIELDS.iter().find(|f| args.contains_key(**f)) {
                    return Some(error_result(&ApiError::invalid(format!(
                        "invalid arguments for exec: field `{field}` is not offered over mcp; \
                         exec always waits for the command (use timeout_ms to bound it)"
                    ))));
                }
                self.call(
                    "exec",
                    args,
                    |b, id, req: ExecRequest| b.exec(id, req, None),
                    render::exec_outcome,
                )
                .await
            }
            "read_file" => {
                self.call(
                    "read_file",
                    args,
                    |b, id, req: ReadRequest| b.read(id, req),
                    render::read,
                )
                .await
            }
            "write_file" => {
                self.call(
                    "write_file",
                    args,
                    |b, id, req: WriteRequest| b.write(id, req),
                    render::write,
                )
                .await
            }
            "edit_file" => {
                self.call(
                    "edit_file",
                    args,
                    |b, id, req: EditRequest| b.edit(id, req),
                    render::edit,
                )
                .await
            }
            "apply_patch" => {
                self.call(
                    "apply_patch",
                    args,
                    |b, id, req: PatchRequest| b.patch(id, req),
                    render::patch,
                )
                .await
            }
            "list" => {
                self.call(
                    "list",
                    args,
                    |b, id, req: ListRequest| b.list_dir(id, req),
                    render::list,
                )
                .await
            }
            "search" => {
                self.call(
                    "search",
                    args,
                    |b, id, req: SearchRequest| b.search(id, req),
                    render::search,
                )
                .await
            }
            "diff" => {
                self.call(
                    "diff",
                    args,
                    |b, id, req: DiffRequest| b.diff(id, req),
                    render::diff,
                )
                .await
            }
            _ => return None,
        };
        Some(result)
    }
}

impl rmcp::ServerHandler for SandboxServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("taskbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(render::instructions(&self.info))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        match self.dispatch(&request.name, args).await {
            Some(result) => Ok(result.into()),
            None => Err(ErrorData::invalid_params(
                format!(
                    "unknown tool {:?}; the tools are {}",
                    request.name,
                    TOOL_NAMES.join(", ")
                ),
                None,
            )),
        }
    }
}

/// The tools, with input schemas generated from the API's request types.
pub(crate) fn tool_list() -> Vec<Tool> {
    let read_only = || ToolAnnotations::new().read_only(true).open_world(false);
    let writes = |idempotent: bool| {
        ToolAnnotations::new()
            .read_only(false)
            .destructive(true)
            .idempotent(idempotent)
            .open_world(false)
    };
    let mut exec_schema = input_schema::<ExecRequest>();
    if let Some(Value::Object(props)) = exec_schema.get_mut("properties") {
        for field in EXEC_HIDDEN_FIELDS {
            props.remove(field);
        }
        // The API's doc of stdin also speaks of background execs, which MCP does not offer.
        if let Some(Value::Object(stdin)) = props.get_mut("stdin") {
            stdin.insert(
                "description".into(),
                Value::String(
                    "Text given on standard input (then closed); without it stdin is empty.".into(),
                ),
            );
        }
    }
    vec![
        Tool::new(
            "exec",
            "Run a command in the sandbox and wait for it to finish. Give either `argv` (program \
             and arguments) or `shell` (a /bin/sh -c command line). It runs in the workspace root \
             unless `cwd` is given (relative to the workspace root). Returns the exit status, the \
             head and tail of stdout and stderr (when cut, the full stream's path, readable with \
             read_file), the workspace files it changed, and anything the policy refused. Files \
             in the workspace and /tmp persist across calls; processes do not outlive the call. \
             A command the policy's command rules forbid is not run (a `command` violation says \
             why); one they ask about waits for the user's approval, and a denial comes back with \
             the user's reason.",
            exec_schema,
        )
        .annotate(writes(false)),
        Tool::new(
            "read_file",
            "Read a file of the workspace; `path` is relative to the workspace root. Optionally a \
             1-based inclusive line range (`line_start`, `line_end`) or a byte range (`offset`, \
             `length`); at most `max_bytes` (default 256 KiB) come back, binary content \
             base64-encoded.",
            input_schema::<ReadRequest>(),
        )
        .annotate(read_only()),
        Tool::new(
            "write_file",
            "Create or replace a file with `content` (written atomically); `path` is relative to \
             the workspace root. Set `create_parents` to create missing directories.",
            input_schema::<WriteRequest>(),
        )
        .annotate(writes(true)),
        Tool::new(
            "edit_file",
            "Replace exact text in a file: `old` must occur exactly once (or exactly \
             `expected_count` times, all replaced) and becomes `new`; `path` is relative to the \
             workspace root. Returns the edit's unified diff. When `old` is missing or occurs \
             more often, nothing changes and the error says where it occurs: add surrounding \
             lines to `old` to make it unique.",
            input_schema::<EditRequest>(),
        )
        .annotate(writes(false)),
        Tool::new(
            "apply_patch",
            "Apply a unified diff (as `git diff` or `diff -u` write it) to the workspace, all or \
             nothing. Paths in the patch are relative to the workspace root (git's a/ and b/ \
             prefixes are understood).",
            input_schema::<PatchRequest>(),
        )
        .annotate(writes(false)),
        Tool::new(
            "list",
            "List a directory of the workspace (`path` relative to the workspace root, default \
             the root), skipping files ignored by .gitignore and dot files unless asked. A `glob` \
             such as \"**/*.rs\" filters entries and searches recursively. Directories end with \
             '/'.",
            input_schema::<ListRequest>(),
        )
        .annotate(read_only()),
        Tool::new(
            "search",
            "Search file contents for a regular expression (Rust regex syntax) under `path` \
             (relative to the workspace root, default the root), skipping files ignored by \
             .gitignore; `glob` restricts which files are searched. Returns matching lines as \
             path:line: text.",
            input_schema::<SearchRequest>(),
        )
        .annotate(read_only()),
        Tool::new(
            "diff",
            "Show what changed in the workspace since the sandbox was created (or since the \
             checkpoint named in `since`): each file's status, line stats and a unified diff. \
             The host copy of the workspace is untouched until the change is exported.",
            input_schema::<DiffRequest>(),
        )
        .annotate(read_only()),
    ]
}

/// The JSON schema of a request type, as an MCP input schema (a JSON object).
fn input_schema<T: JsonSchema>() -> JsonObject {
    match serde_json::to_value(schemars::schema_for!(T)) {
        Ok(Value::Object(mut schema)) => {
            // MCP requires an object schema with properties, even for a request with no fields.
            schema
                .entry("properties")
                .or_insert_with(|| Value::Object(JsonObject::new()));
            schema
        }
        _ => {
            let mut schema = JsonObject::new();
            schema.insert("type".into(), Value::String("object".into()));
            schema.insert("properties".into(), Value::Object(JsonObject::new()));
            schema
        }
    }
}

/// Parses a tool's arguments, naming the offending field when they do not fit the schema.
pub(crate) fn parse_args<T: DeserializeOwned>(tool: &str, args: JsonObject) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(Value::Object(args)).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::invalid(format!("invalid arguments for {tool}: {inner}"))
        } else {
            ApiError::invalid(format!(
                "invalid arguments for {tool}: field `{path}`: {inner}"
            ))
        }
    })
}

fn success_result<T: Serialize>(text: String, structured: &T) -> CallToolResult {
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = serde_json::to_value(structured).ok();
    result
}

/// An API error as a tool result: `isError`, the code and message as text, and the HTTP API's
/// error body as structured content.
pub(crate) fn error_result(e: &ApiError) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(format!("{}: {e}", e.code()))]);
    result.structured_content = Some(serde_json::json!({
        "error": {"code": e.code(), "message": e.to_string()}
    }));
    result
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn every_tool_has_an_object_schema_with_properties() {
        let tools = tool_list();
        let names: Vec<_> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, TOOL_NAMES);
        for t in &tools {
            assert_eq!(t.input_schema["type"], "object", "{}", t.name);
            let props = t.input_schema["properties"].as_object().unwrap();
            assert!(!props.is_empty(), "{} has no properties", t.name);
            assert!(t.description.as_deref().is_some_and(|d| d.len() > 40));
        }
        let exec = &tools[0].input_schema["properties"];
        for field in [
            "argv",
            "shell",
            "cwd",
            "env",
            "stdin",
            "timeout_ms",
            "output_limit",
        ] {
            assert!(exec.get(field).is_some(), "exec lacks {field}");
        }
        assert!(exec.get("background").is_none());
        let stdin_doc = exec["stdin"]["description"].as_str().unwrap();
        assert!(!stdin_doc.contains("background"), "{stdin_doc}");
        assert_eq!(
            tools[3].input_schema["required"],
            serde_json::json!(["path", "old", "new"])
        );
    }

    #[test]
    fn argument_errors_name_the_field() {
        let args = |v: Value| v.as_object().unwrap().clone();
        let e = parse_args::<EditRequest>("edit_file", args(serde_json::json!({"path": "a"})))
            .unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        assert!(e.to_string().contains("`old`"), "{e}");
        let e = parse_args::<ExecRequest>(
            "exec",
            args(serde_json::json!({"shell": "true", "timeout_ms": "soon"})),
        )
        .unwrap_err();
        assert!(e.to_string().contains("field `timeout_ms`"), "{e}");
        let e =
            parse_args::<DiffRequest>("diff", args(serde_json::json!({"bogus": 1}))).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn api_errors_are_tool_errors_with_their_code() {
        let r = error_result(&ApiError::EditAmbiguous(
            "3 matches at lines 1, 4, 9".into(),
        ));
        assert_eq!(r.is_error, Some(true));
        let ContentBlock::Text(t) = &r.content[0] else {
            panic!("not text")
        };
        assert_eq!(t.text, "edit_ambiguous: 3 matches at lines 1, 4, 9");
        assert_eq!(
            r.structured_content.unwrap()["error"]["code"],
            "edit_ambiguous"
        );
    }
}
