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
use taskbox_tools::{ArgsError, Call, Effect, SANDBOX_TOOLS, SESSION_TOOLS, render};

use crate::instructions;

/// The tools' names, in the order they are listed (the names are the contract): the sandbox
/// tools, then `fork`.
pub const TOOL_NAMES: [&str; 9] = {
    let sandbox = taskbox_tools::names(SANDBOX_TOOLS);
    let session = taskbox_tools::names(SESSION_TOOLS);
    let mut all = [""; 9];
    let mut i = 0;
    while i < all.len() {
        all[i] = if i < sandbox.len() {
            sandbox[i]
        } else {
            session[i - sandbox.len()]
        };
        i += 1;
    }
    all
};

/// The argument every tool takes besides its own: the sandbox it acts on.
pub const SANDBOX_ARG: &str = "sandbox";

/// The most forks one session keeps alive.
pub const MAX_SESSION_FORKS: usize = 16;

/// The MCP server of one sandbox and the forks made from it in the session.
pub(crate) struct SandboxServer {
    backend: Arc<dyn SandboxApi>,
    info: SandboxInfo,
    tools: Vec<Tool>,
    /// The forks made in this session (destroyed when it ends, by whoever holds this too).
    forks: Arc<std::sync::Mutex<Vec<SandboxId>>>,
}

impl SandboxServer {
    pub(crate) fn new(
        backend: Arc<dyn SandboxApi>,
        info: SandboxInfo,
        forks: Arc<std::sync::Mutex<Vec<SandboxId>>>,
    ) -> SandboxServer {
        SandboxServer {
            backend,
            info,
            tools: tool_list(),
            forks,
        }
    }

    fn id(&self) -> &SandboxId {
        &self.info.id
    }

    /// The sandbox a call names in its `sandbox` argument (taken out of `args`): the session's
    /// own, or one of its forks; the session's own when it names none.
    fn target(&self, args: &mut JsonObject) -> Result<SandboxId, ApiError> {
        let Some(v) = args.remove(SANDBOX_ARG) else {
            return Ok(self.id().clone());
        };
        let Some(raw) = v.as_str() else {
            return Err(ApiError::invalid(
                "invalid arguments: field `sandbox`: expected a sandbox id (a string)",
            ));
        };
        let id = SandboxId::parse(raw)?;
        let known = id == *self.id() || crate::lock_forks(&self.forks).contains(&id);
        if !known {
            return Err(ApiError::SandboxNotFound(format!(
                "sandbox {id} is not this session's: give {} or the id of one of its forks",
                self.id()
            )));
        }
        Ok(id)
    }

    /// Runs `op` on sandbox `id` on the blocking pool and renders its result (or error).
    async fn run<Res, Op>(
        &self,
        tool: &'static str,
        id: &SandboxId,
        op: Op,
        text: impl Fn(&Res) -> String,
    ) -> CallToolResult
    where
        Res: Serialize + Send + 'static,
        Op: FnOnce(&dyn SandboxApi, &SandboxId) -> Result<Res, ApiError> + Send + 'static,
    {
        let target = id.clone();
        let backend = Arc::clone(&self.backend);
        let outcome = tokio::task::spawn_blocking(move || op(backend.as_ref(), &target))
            .await
            .unwrap_or_else(|e| Err(ApiError::internal(format!("{tool} failed: {e}"))));
        match outcome {
            Ok(res) => success_result(text(&res), &res),
            Err(e) => {
                tracing::debug!(sandbox = %id, tool, code = e.code(), error = %e, "tool failed");
                error_result(&e)
            }
        }
    }

    /// A fork of `id` for this session, within [`MAX_SESSION_FORKS`].
    async fn fork(&self, id: &SandboxId, req: taskbox_core::api::ForkRequest) -> CallToolResult {
        let asked = req.count.unwrap_or(1) as usize;
        let live = crate::lock_forks(&self.forks).len();
        if live + asked > MAX_SESSION_FORKS {
            return error_result(&ApiError::LimitExceeded(format!(
                "this session has {live} forks and keeps at most {MAX_SESSION_FORKS}: fork \
                 fewer"
            )));
        }
        let forks = Arc::clone(&self.forks);
        self.run(
            "fork",
            id,
            move |b, id| {
                let r = b.fork(id, req)?;
                crate::lock_forks(&forks).extend(r.sandboxes.iter().map(|i| i.id.clone()));
                Ok(r)
            },
            render::fork,
        )
        .await
    }

    /// The result of a call of the sandbox tool `name`; `None` when there is no such tool.
    async fn dispatch(&self, name: &str, mut args: JsonObject) -> Option<CallToolResult> {
        let tool = SANDBOX_TOOLS
            .into_iter()
            .chain(SESSION_TOOLS)
            .find(|t| t.name() == name)?;
        let id = match self.target(&mut args) {
            Ok(id) => id,
            Err(e) => return Some(error_result(&e)),
        };
        let call = match tool.parse(Value::Object(args)) {
            Ok(call) => call,
            Err(e) => return Some(args_error_result(&e)),
        };
        let name = tool.name();
        let id = &id;
        Some(match call {
            Call::Exec(req) => {
                let limit = req.timeout_ms;
                self.run(
                    name,
                    id,
                    |b, id| b.exec(id, req, None),
                    |o| render::exec_outcome(o, limit),
                )
                .await
            }
            Call::Read(req) => {
                self.run(name, id, |b, id| b.read(id, req), render::read)
                    .await
            }
            Call::Write(req) => {
                self.run(name, id, |b, id| b.write(id, req), render::write)
                    .await
            }
            Call::Edit(req) => {
                self.run(name, id, |b, id| b.edit(id, req), render::edit)
                    .await
            }
            Call::Patch(req) => {
                self.run(name, id, |b, id| b.patch(id, req), render::patch)
                    .await
            }
            Call::List(req) => {
                self.run(name, id, |b, id| b.list_dir(id, req), render::list)
                    .await
            }
            Call::Search(req) => {
                self.run(name, id, |b, id| b.search(id, req), render::search)
                    .await
            }
            Call::Diff(req) => {
                self.run(name, id, |b, id| b.diff(id, req), render::diff)
                    .await
            }
            Call::Fork(req) => self.fork(id, req).await,
            // Harness tools are not offered here.
            Call::Plan { .. } | Call::Finish { .. } | Call::Subtask(_) => return None,
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

/// The sandbox tools and `fork` as MCP tools: `taskbox_tools`'s names, descriptions and input
/// schemas, each with the `sandbox` argument added, and annotations from each tool's effect.
pub fn tool_list() -> Vec<Tool> {
    SANDBOX_TOOLS
        .into_iter()
        .chain(SESSION_TOOLS)
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
            Tool::new(
                t.name(),
                t.description(),
                with_sandbox_arg(t.input_schema()),
            )
            .annotate(annotations)
        })
        .collect()
}

/// A tool's input schema with the `sandbox` argument.
pub fn with_sandbox_arg(schema: &JsonObject) -> Arc<JsonObject> {
    let mut schema = schema.clone();
    if let Some(Value::Object(props)) = schema.get_mut("properties") {
        props.insert(
            SANDBOX_ARG.into(),
            serde_json::json!({
                "type": "string",
                "description": "The sandbox to act on: this session's own (the default) or \
                    one of its forks, by the id `fork` returned."
            }),
        );
    }
    Arc::new(schema)
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
        for (t, def) in tools
            .iter()
            .zip(SANDBOX_TOOLS.into_iter().chain(SESSION_TOOLS))
        {
            assert_eq!(t.description.as_deref(), Some(def.description()));
            assert_eq!(t.input_schema, with_sandbox_arg(def.input_schema()));
            assert!(t.input_schema["properties"][SANDBOX_ARG].is_object());
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
