//! The MCP side of the tools: `taskbox_tools`'s sandbox tools as MCP tools, and their dispatch
//! on the served sandbox.
//!
//! The tools are listed and parsed by hand rather than with rmcp's macros, so that a schema
//! mismatch becomes a tool result with `isError` naming the field (which a model can fix), not a
//! JSON-RPC error (which clients tend to show opaquely).

use std::sync::Arc;

use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use serde::Serialize;
use serde_json::Value;
use taskbox_core::api::{ApiError, SandboxApi, SandboxId, SandboxInfo};
use taskbox_tools::{ArgsError, Call, Effect, SANDBOX_TOOLS, render};

use crate::instructions;

/// The tools' names, in the order they are listed (the names are the contract).
pub const TOOL_NAMES: [&str; 8] = taskbox_tools::names(SANDBOX_TOOLS);

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

    /// Runs `op` on the blocking pool and renders its result (or error).
    async fn run<Res, Op>(
        &self,
        tool: &'static str,
        op: Op,
        text: impl Fn(&Res) -> String,
    ) -> CallToolResult
    where
        Res: Serialize + Send + 'static,
        Op: FnOnce(&dyn SandboxApi, &SandboxId) -> Result<Res, ApiError> + Send + 'static,
    {
        let id = self.id().clone();
        let backend = Arc::clone(&self.backend);
        let outcome = tokio::task::spawn_blocking(move || op(backend.as_ref(), &id))
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

    /// The result of a call of the sandbox tool `name`; `None` when there is no such tool.
    async fn dispatch(&self, name: &str, args: JsonObject) -> Option<CallToolResult> {
        let tool = SANDBOX_TOOLS.into_iter().find(|t| t.name() == name)?;
        let call = match tool.parse(Value::Object(args)) {
            Ok(call) => call,
            Err(e) => return Some(args_error_result(&e)),
        };
        let name = tool.name();
        Some(match call {
            Call::Exec(req) => {
                let limit = req.timeout_ms;
                self.run(
                    name,
                    |b, id| b.exec(id, req, None),
                    |o| render::exec_outcome(o, limit),
                )
                .await
            }
            Call::Read(req) => self.run(name, |b, id| b.read(id, req), render::read).await,
            Call::Write(req) => {
                self.run(name, |b, id| b.write(id, req), render::write)
                    .await
            }
            Call::Edit(req) => self.run(name, |b, id| b.edit(id, req), render::edit).await,
            Call::Patch(req) => {
                self.run(name, |b, id| b.patch(id, req), render::patch)
                    .await
            }
            Call::List(req) => {
                self.run(name, |b, id| b.list_dir(id, req), render::list)
                    .await
            }
            Call::Search(req) => {
                self.run(name, |b, id| b.search(id, req), render::search)
                    .await
            }
            Call::Diff(req) => self.run(name, |b, id| b.diff(id, req), render::diff).await,
            // Harness tools are not among SANDBOX_TOOLS.
            Call::Plan { .. } | Call::Finish { .. } => return None,
        })
    }
}

impl rmcp::ServerHandler for SandboxServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("taskbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(instructions::instructions(&self.info))
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

/// The sandbox tools as MCP tools: `taskbox_tools`'s names, descriptions and input schemas, and
/// annotations from each tool's effect.
pub fn tool_list() -> Vec<Tool> {
    SANDBOX_TOOLS
        .into_iter()
        .map(|t| {
            let annotations = match t.effect() {
                Effect::ReadOnly | Effect::Harness => {
                    ToolAnnotations::new().read_only(true).open_world(false)
                }
                Effect::Writes { idempotent } => ToolAnnotations::new()
                    .read_only(false)
                    .destructive(true)
                    .idempotent(idempotent)
                    .open_world(false),
            };
            Tool::new(t.name(), t.description(), t.input_schema().clone()).annotate(annotations)
        })
        .collect()
}

fn success_result<T: Serialize>(text: String, structured: &T) -> CallToolResult {
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = serde_json::to_value(structured).ok();
    result
}

/// An API error as a tool result: `isError`, the code and message as text, and the HTTP API's
/// error body as structured content.
pub(crate) fn error_result(e: &ApiError) -> CallToolResult {
    failed(render::api_error(e), e.code(), &e.to_string())
}

/// Arguments that do not fit the schema, as a tool result the model can correct itself from.
fn args_error_result(e: &ArgsError) -> CallToolResult {
    let text = render::args_error(e);
    failed(text.clone(), e.code(), &text)
}

fn failed(text: String, code: &str, message: &str) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(text)]);
    result.structured_content = Some(serde_json::json!({
        "error": {"code": code, "message": message}
    }));
    result
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_list_is_the_sandbox_tools_with_annotations() {
        let tools = tool_list();
        let names: Vec<_> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, TOOL_NAMES);
        for (t, def) in tools.iter().zip(SANDBOX_TOOLS) {
            assert_eq!(t.description.as_deref(), Some(def.description()));
            assert_eq!(t.input_schema.as_ref(), def.input_schema());
            let a = t.annotations.as_ref().unwrap();
            assert_eq!(
                a.read_only_hint,
                Some(def.effect() == Effect::ReadOnly),
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn refusals_are_tool_errors_with_their_code() {
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

        let e = taskbox_tools::Tool::EditFile
            .parse(serde_json::json!({"path": "a", "old": "x"}))
            .unwrap_err();
        let r = args_error_result(&e);
        assert_eq!(r.is_error, Some(true));
        let ContentBlock::Text(t) = &r.content[0] else {
            panic!("not text")
        };
        assert_eq!(
            t.text,
            "invalid arguments for edit_file: missing field `new`"
        );
        assert_eq!(
            r.structured_content.unwrap()["error"]["code"],
            "invalid_argument"
        );
    }
}
