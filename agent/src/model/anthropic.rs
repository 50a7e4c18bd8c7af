//! Anthropic Messages (`POST {base}/v1/messages`).

use std::time::Instant;

use serde_json::{Value, json};

use super::{
    Finish, Model, ModelConfig, ModelError, ModelRequest, ModelResponse, Role, ToolCall, Transport,
    Usage, finish_response,
};

/// The API version this adapter speaks.
pub const VERSION: &str = "2023-06-01";

/// The Anthropic Messages adapter.
#[derive(Debug)]
pub struct Anthropic {
    cfg: ModelConfig,
    transport: Transport,
}

impl Anthropic {
    pub fn new(cfg: ModelConfig, transport: Transport) -> Anthropic {
        Anthropic { cfg, transport }
    }
}

/// The request body for `req`. Tool results become `tool_result` blocks of a user message;
/// consecutive ones share a message, as the protocol requires.
pub fn body(model: &str, req: &ModelRequest) -> Value {
    let mut messages: Vec<Value> = Vec::new();
    for m in &req.messages {
        let (role, blocks) = match m.role {
            Role::User => ("user", vec![json!({"type": "text", "text": m.content})]),
            Role::Tool => {
                let mut block = json!({"type": "tool_result",
                    "tool_use_id": m.tool_call_id.clone().unwrap_or_default(),
                    "content": m.content});
                if m.is_error {
                    block["is_error"] = Value::Bool(true);
                }
                ("user", vec![block])
            }
            Role::Assistant => {
                let mut blocks = Vec::new();
                if !m.content.is_empty() {
                    blocks.push(json!({"type": "text", "text": m.content}));
                }
                for c in &m.tool_calls {
                    let input = serde_json::from_str::<Value>(&c.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({}));
                    blocks.push(
                        json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}),
                    );
                }
                if blocks.is_empty() {
                    blocks.push(json!({"type": "text", "text": "(no text)"}));
                }
                ("assistant", blocks)
            }
        };
        match messages.last_mut() {
            Some(last) if last["role"] == role => {
                if let Some(arr) = last["content"].as_array_mut() {
                    arr.extend(blocks);
                }
            }
            _ => messages.push(json!({"role": role, "content": blocks})),
        }
    }
    let tools: Vec<Value> = req
        .tools
        .iter()
        .map(
            |t| json!({"name": t.name, "description": t.description, "input_schema": t.parameters}),
        )
        .collect();
    let mut body = json!({
        "model": model,
        "system": req.system,
        "messages": messages,
        "max_tokens": req.max_tokens,
    });
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools);
    }
    body
}

/// Reads a Messages answer.
pub fn parse(body: &Value) -> Result<ModelResponse, ModelError> {
    let blocks = body["content"].as_array().ok_or_else(|| {
        ModelError::Malformed(format!(
            "no content blocks in {}",
            body.to_string().chars().take(300).collect::<String>()
        ))
    })?;
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        match b["type"].as_str() {
            Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
            Some("tool_use") => tool_calls.push(ToolCall {
                id: b["id"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("toolu_{i}")),
                name: b["name"]
                    .as_str()
                    .ok_or_else(|| {
                        ModelError::Malformed(format!("tool_use block {i} has no name"))
                    })?
                    .to_owned(),
                arguments: b["input"].to_string(),
            }),
            _ => {}
        }
    }
    let finish = match body["stop_reason"].as_str() {
        Some("tool_use") => Finish::ToolCalls,
        Some("max_tokens") => Finish::Length,
        Some("end_turn") | Some("stop_sequence") | None if tool_calls.is_empty() => Finish::Stop,
        Some("end_turn") | Some("stop_sequence") | None => Finish::ToolCalls,
        Some(other) => Finish::Other(other.to_owned()),
    };
    Ok(ModelResponse {
        text,
        tool_calls,
        finish,
        usage: Usage {
            input_tokens: body["usage"]["input_tokens"].as_u64().unwrap_or(0),
            output_tokens: body["usage"]["output_tokens"].as_u64().unwrap_or(0),
        },
        cost_usd: 0.0,
        attempts: 1,
        latency_ms: 0,
    })
}

impl Model for Anthropic {
    fn describe(&self) -> String {
        format!("anthropic:{}", self.cfg.model)
    }

    fn complete(&mut self, req: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let started = Instant::now();
        let mut headers = vec![("anthropic-version", VERSION.to_owned())];
        if let Some(key) = &self.cfg.api_key {
            headers.push(("x-api-key", key.clone()));
        }
        let answer = self
            .transport
            .post("/v1/messages", &headers, &body(&self.cfg.model, req))?;
        let resp = parse(&answer.body)?;
        Ok(finish_response(&self.cfg, started, answer.attempts, resp))
    }

    fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.transport.set_deadline(deadline);
    }

    fn set_cancel(&mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.transport.set_cancel(cancel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Message;

    #[test]
    fn tool_results_share_one_user_message() {
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "exec".into(),
            arguments: "{\"shell\":\"ls\"}".into(),
        };
        let req = ModelRequest {
            system: "sys".into(),
            messages: vec![
                Message::user("task"),
                Message::assistant("thinking", vec![call("a"), call("b")]),
                Message::tool("a", "one"),
                Message::tool_error("b", "two"),
            ],
            tools: vec![],
            max_tokens: 10,
        };
        let b = body("m", &req);
        assert_eq!(b["system"], "sys");
        let msgs = b["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1]["content"][1]["input"]["shell"], "ls");
        assert_eq!(msgs[2]["content"].as_array().unwrap().len(), 2);
        assert_eq!(msgs[2]["content"][1]["tool_use_id"], "b");
        assert_eq!(msgs[2]["content"][1]["is_error"], true);
        assert!(msgs[2]["content"][0].get("is_error").is_none());

        let r = parse(&json!({"content": [{"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "t", "name": "diff", "input": {}}],
            "stop_reason": "tool_use", "usage": {"input_tokens": 5, "output_tokens": 2}}))
        .unwrap();
        assert_eq!(r.finish, Finish::ToolCalls);
        assert_eq!(r.tool_calls[0].arguments, "{}");
        assert_eq!(r.usage.output_tokens, 2);
        let r = parse(
            &json!({"content": [{"type": "text", "text": "cut"}], "stop_reason": "max_tokens"}),
        )
        .unwrap();
        assert_eq!(r.finish, Finish::Length);
    }
}
