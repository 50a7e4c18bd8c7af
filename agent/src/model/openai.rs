//! OpenAI-compatible chat completions with tool calls (`POST {base}/chat/completions`).

use std::time::Instant;

use serde_json::{Value, json};

use super::{
    Finish, Message, Model, ModelConfig, ModelError, ModelRequest, ModelResponse, Role, ToolCall,
    Transport, Usage, finish_response,
};

/// The OpenAI chat-completions adapter.
#[derive(Debug)]
pub struct OpenAi {
    cfg: ModelConfig,
    transport: Transport,
}

impl OpenAi {
    pub fn new(cfg: ModelConfig, transport: Transport) -> OpenAi {
        OpenAi { cfg, transport }
    }
}

/// The request body for `req`.
pub fn body(model: &str, req: &ModelRequest) -> Value {
    let mut messages = vec![json!({"role": "system", "content": req.system})];
    for m in &req.messages {
        messages.push(message(m));
    }
    let tools: Vec<Value> = req
        .tools
        .iter()
        .map(|t| {
            json!({"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}})
        })
        .collect();
    let mut body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": req.max_tokens,
    });
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools);
    }
    body
}

fn message(m: &Message) -> Value {
    match m.role {
        Role::User => json!({"role": "user", "content": m.content}),
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": m.tool_call_id.clone().unwrap_or_default(),
            "content": m.content,
        }),
        Role::Assistant => {
            let mut v = json!({"role": "assistant"});
            v["content"] = if m.content.is_empty() && !m.tool_calls.is_empty() {
                Value::Null
            } else {
                Value::String(m.content.clone())
            };
            if !m.tool_calls.is_empty() {
                v["tool_calls"] = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}})
                    })
                    .collect();
            }
            v
        }
    }
}

/// Reads a chat-completions answer.
pub fn parse(body: &Value) -> Result<ModelResponse, ModelError> {
    let choice = body["choices"]
        .get(0)
        .ok_or_else(|| ModelError::Malformed(format!("no choices in {}", short(body))))?;
    let msg = &choice["message"];
    let text = msg["content"].as_str().unwrap_or_default().to_owned();
    let mut tool_calls = Vec::new();
    if let Some(calls) = msg["tool_calls"].as_array() {
        for (i, c) in calls.iter().enumerate() {
            let name = c["function"]["name"].as_str().ok_or_else(|| {
                ModelError::Malformed(format!("tool call {i} has no function name"))
            })?;
            let arguments = match &c["function"]["arguments"] {
                Value::String(s) => s.clone(),
                Value::Null => "{}".to_owned(),
                // Some servers send the object itself.
                other => other.to_string(),
            };
            let id = c["id"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("call_{i}"));
            tool_calls.push(ToolCall {
                id,
                name: name.to_owned(),
                arguments,
            });
        }
    }
    let finish = match choice["finish_reason"].as_str() {
        Some("stop") | None if tool_calls.is_empty() => Finish::Stop,
        Some("tool_calls") | Some("function_call") => Finish::ToolCalls,
        Some("stop") | None => Finish::ToolCalls,
        Some("length") => Finish::Length,
        Some(other) => Finish::Other(other.to_owned()),
    };
    let usage = Usage {
        input_tokens: body["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        output_tokens: body["usage"]["completion_tokens"].as_u64().unwrap_or(0),
    };
    Ok(ModelResponse {
        text,
        tool_calls,
        finish,
        usage,
        cost_usd: 0.0,
        attempts: 1,
        latency_ms: 0,
    })
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    s.chars().take(300).collect()
}

impl Model for OpenAi {
    fn describe(&self) -> String {
        format!("openai:{}", self.cfg.model)
    }

    fn complete(&mut self, req: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let started = Instant::now();
        let mut headers = Vec::new();
        if let Some(key) = &self.cfg.api_key {
            headers.push(("Authorization", format!("Bearer {key}")));
        }
        let answer =
            self.transport
                .post("/chat/completions", &headers, &body(&self.cfg.model, req))?;
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
    use crate::model::ToolSpec;

    #[test]
    fn round_trip_of_tool_calls() {
        let req = ModelRequest {
            system: "sys".into(),
            messages: vec![
                Message::user("task"),
                Message::assistant(
                    "",
                    vec![ToolCall {
                        id: "c1".into(),
                        name: "exec".into(),
                        arguments: "{\"shell\":\"ls\"}".into(),
                    }],
                ),
                Message::tool("c1", "exit 0"),
            ],
            tools: vec![ToolSpec {
                name: "exec".into(),
                description: "run".into(),
                parameters: json!({"type": "object"}),
            }],
            max_tokens: 100,
        };
        let b = body("m", &req);
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["messages"][2]["content"], Value::Null);
        assert_eq!(
            b["messages"][2]["tool_calls"][0]["function"]["name"],
            "exec"
        );
        assert_eq!(b["messages"][3]["tool_call_id"], "c1");
        assert_eq!(b["tools"][0]["function"]["name"], "exec");

        let r = parse(&json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))
        .unwrap();
        assert_eq!(r.finish, Finish::ToolCalls);
        assert_eq!(r.tool_calls[0].name, "read_file");
        assert_eq!(r.usage.input_tokens, 7);
        let r = parse(
            &json!({"choices": [{"message": {"content": "par"}, "finish_reason": "length"}]}),
        )
        .unwrap();
        assert_eq!(r.finish, Finish::Length);
        assert!(parse(&json!({"error": "x"})).is_err());
    }
}
