//! Model adapters behind one trait: [`Model`].
//!
//! The loop speaks a small provider-neutral conversation ([`Message`], [`ToolCall`],
//! [`ToolSpec`]); each adapter turns it into its wire protocol and back:
//! [`openai::OpenAi`] (chat completions with tool calls: OpenAI, vLLM, llama.cpp server, Ollama)
//! and [`anthropic::Anthropic`] (Messages). Both share [`Transport`]: one deadline per attempt,
//! retries with exponential backoff on 429, 5xx and connection failures (honouring
//! `Retry-After`), and usage and cost accounting per call. [`Recorded`] answers with the
//! responses of a trace instead of a live model (replay).

pub mod anthropic;
pub mod openai;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::http::{self, HttpError};

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
    /// The result of one tool call.
    Tool,
}

/// One message of the conversation (the system prompt is kept apart, in [`ModelRequest`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// The assistant's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result that reports a failure (a refusal, a validation message, an error, a
    /// non-zero exit).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
}

impl Message {
    pub fn user(text: impl Into<String>) -> Message {
        Message {
            role: Role::User,
            content: text.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            is_error: false,
        }
    }

    pub fn assistant(text: impl Into<String>, tool_calls: Vec<ToolCall>) -> Message {
        Message {
            role: Role::Assistant,
            content: text.into(),
            tool_calls,
            tool_call_id: None,
            is_error: false,
        }
    }

    pub fn tool(call_id: impl Into<String>, text: impl Into<String>) -> Message {
        Message {
            role: Role::Tool,
            content: text.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.into()),
            is_error: false,
        }
    }

    /// A tool result that reports a failure.
    pub fn tool_error(call_id: impl Into<String>, text: impl Into<String>) -> Message {
        Message {
            is_error: true,
            ..Message::tool(call_id, text)
        }
    }
}

/// A tool call the model asked for. `arguments` is the JSON text as the model wrote it (it may
/// be invalid: the loop answers with a validation message).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: Value,
}

/// One request to a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    pub system: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    pub max_tokens: u32,
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// It finished its answer.
    Stop,
    /// It wants its tool calls run.
    ToolCalls,
    /// It was cut off at the output token limit.
    Length,
    /// Anything else the provider said.
    Other(String),
}

/// Tokens of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A model's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish: Finish,
    pub usage: Usage,
    /// US dollars, from the configured prices.
    pub cost_usd: f64,
    /// HTTP attempts it took (1 without retries).
    pub attempts: u32,
    pub latency_ms: u64,
}

/// Errors of a model call.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// the model server could not be reached, even after retries
    #[error("model server unreachable after {attempts} attempt(s): {source}")]
    Unreachable { attempts: u32, source: HttpError },
    /// the model server answered with an error status that retrying does not fix
    #[error("model server answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// the model server kept answering 429 or 5xx
    #[error("model server still answered HTTP {status} after {attempts} attempts: {body}")]
    Exhausted {
        status: u16,
        attempts: u32,
        body: String,
    },
    /// the TLS handshake with the model server failed (its certificate was refused)
    #[error("{}", tls_message(.0))]
    Tls(HttpError),
    /// the answer is not the protocol's JSON
    #[error("malformed model answer: {0}")]
    Malformed(String),
    /// replay: the trace holds no more recorded responses
    #[error("the recorded trace has no model response left (call {0})")]
    RecordingExhausted(usize),
    /// the configuration is incomplete or wrong
    #[error("model configuration: {0}")]
    Config(String),
    /// the task's time budget ran out before the model answered
    #[error("the time budget ran out during the model call")]
    Deadline,
    /// the task was cancelled while it waited for the model
    #[error("cancelled during the model call")]
    Cancelled,
}

/// A refused certificate, with where the model client takes a CA file when that would help.
fn tls_message(e: &HttpError) -> String {
    match e {
        HttpError::Tls {
            unknown_issuer: true,
            ..
        } => format!(
            "cannot verify the model server: {e}; the model client's CA file is given with \
             --ca-file, ca_file in the [model] table, or TASKBOX_MODEL_CA_FILE"
        ),
        _ => format!("cannot verify the model server: {e}"),
    }
}

/// A model: given the conversation and the tools, the next answer.
pub trait Model: Send {
    /// What this model is, for reports (`provider:model`).
    fn describe(&self) -> String;
    fn complete(&mut self, req: &ModelRequest) -> Result<ModelResponse, ModelError>;
    /// Calls must end by `deadline` (the task's time budget): attempts are cut short and no
    /// retry waits past it.
    /// The task's cancel flag: a call waiting for its answer gives up when it is set.
    fn set_cancel(&mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let _ = cancel;
    }

    fn set_deadline(&mut self, deadline: Option<Instant>) {
        let _ = deadline;
    }
}

/// Which wire protocol a model server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    /// OpenAI-compatible chat completions.
    Openai,
    /// Anthropic Messages.
    Anthropic,
}

impl std::str::FromStr for Provider {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Provider, ModelError> {
        match s {
            "openai" => Ok(Provider::Openai),
            "anthropic" => Ok(Provider::Anthropic),
            other => Err(ModelError::Config(format!(
                "unknown provider {other:?}: use openai or anthropic"
            ))),
        }
    }
}

/// How to reach a model and what it costs. From a contract's `[model]` table, flags, or the
/// environment ([`ModelConfig::from_env`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub provider: Provider,
    /// `http://HOST:PORT/PREFIX` or `https://HOST[:PORT]/PREFIX` (for OpenAI-compatible
    /// servers, the prefix before `/chat/completions`, usually `/v1`), or `unix:/PATH`.
    pub base_url: String,
    pub model: String,
    /// A PEM file of CA certificates trusted for an `https` base URL, in addition to the
    /// system's roots (for a private endpoint). A relative path is taken from the current
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Sent as a bearer token (OpenAI) or `x-api-key` (Anthropic). Never written to traces.
    #[serde(default, skip_serializing)]
    pub api_key: Option<String>,
    /// Deadline of one HTTP attempt, in seconds.
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
    /// Retries after the first attempt.
    #[serde(default = "default_retries")]
    pub max_retries: u32,
    /// First backoff in milliseconds; doubled each retry.
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
    /// Longest wait between attempts in milliseconds (also caps `Retry-After`).
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// Output token limit per call.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// US dollars per million input tokens.
    #[serde(default)]
    pub price_input_per_mtok: f64,
    /// US dollars per million output tokens.
    #[serde(default)]
    pub price_output_per_mtok: f64,
}

fn default_timeout_secs() -> u64 {
    120
}
fn default_retries() -> u32 {
    4
}
fn default_backoff_ms() -> u64 {
    500
}
fn default_max_backoff_ms() -> u64 {
    30_000
}
fn default_max_tokens() -> u32 {
    4096
}

impl ModelConfig {
    pub fn new(provider: Provider, base_url: &str, model: &str) -> ModelConfig {
        ModelConfig {
            provider,
            base_url: base_url.to_owned(),
            model: model.to_owned(),
            ca_file: None,
            api_key: None,
            timeout_secs: default_timeout_secs(),
            max_retries: default_retries(),
            backoff_ms: default_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            max_tokens: default_max_tokens(),
            price_input_per_mtok: 0.0,
            price_output_per_mtok: 0.0,
        }
    }

    /// Fills what is missing from the environment: `TASKBOX_MODEL_PROVIDER` (default openai),
    /// `TASKBOX_MODEL_BASE_URL`, `TASKBOX_MODEL`, `TASKBOX_MODEL_API_KEY` (else `OPENAI_API_KEY`
    /// or `ANTHROPIC_API_KEY` by provider), `TASKBOX_MODEL_CA_FILE`, `TASKBOX_MODEL_PRICE_IN`
    /// and `TASKBOX_MODEL_PRICE_OUT` (dollars per million tokens).
    pub fn from_env(base: Option<ModelConfig>) -> Result<ModelConfig, ModelError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut cfg = match base {
            Some(c) => c,
            None => {
                let provider = var("TASKBOX_MODEL_PROVIDER")
                    .map(|p| p.parse())
                    .transpose()?
                    .unwrap_or(Provider::Openai);
                let base_url = var("TASKBOX_MODEL_BASE_URL").ok_or_else(|| {
                    ModelError::Config(
                        "no model server: set TASKBOX_MODEL_BASE_URL (e.g. \
                         http://127.0.0.1:8000/v1) or give [model] base_url in the contract"
                            .into(),
                    )
                })?;
                let model = var("TASKBOX_MODEL").ok_or_else(|| {
                    ModelError::Config(
                        "no model name: set TASKBOX_MODEL or give [model] model in the contract"
                            .into(),
                    )
                })?;
                ModelConfig::new(provider, &base_url, &model)
            }
        };
        if cfg.api_key.is_none() {
            cfg.api_key = var("TASKBOX_MODEL_API_KEY").or_else(|| match cfg.provider {
                Provider::Openai => var("OPENAI_API_KEY"),
                Provider::Anthropic => var("ANTHROPIC_API_KEY"),
            });
        }
        if cfg.ca_file.is_none() {
            cfg.ca_file = var("TASKBOX_MODEL_CA_FILE").map(PathBuf::from);
        }
        let price = |k: &str| -> Result<Option<f64>, ModelError> {
            var(k)
                .map(|v| {
                    v.parse::<f64>()
                        .ok()
                        .filter(|p| p.is_finite() && *p >= 0.0)
                        .ok_or_else(|| ModelError::Config(format!("{k}={v:?} is not a price")))
                })
                .transpose()
        };
        if let Some(p) = price("TASKBOX_MODEL_PRICE_IN")? {
            cfg.price_input_per_mtok = p;
        }
        if let Some(p) = price("TASKBOX_MODEL_PRICE_OUT")? {
            cfg.price_output_per_mtok = p;
        }
        Ok(cfg)
    }

    /// The cost of `usage` at this configuration's prices.
    pub fn cost(&self, usage: Usage) -> f64 {
        (usage.input_tokens as f64 * self.price_input_per_mtok
            + usage.output_tokens as f64 * self.price_output_per_mtok)
            / 1_000_000.0
    }

    /// The adapter for this configuration.
    pub fn build(&self) -> Result<Box<dyn Model>, ModelError> {
        let transport = Transport::new(self)?;
        Ok(match self.provider {
            Provider::Openai => Box::new(openai::OpenAi::new(self.clone(), transport)),
            Provider::Anthropic => Box::new(anthropic::Anthropic::new(self.clone(), transport)),
        })
    }
}

/// The HTTP side shared by the adapters: deadlines, retries, backoff.
#[derive(Debug, Clone)]
pub struct Transport {
    client: http::Client,
    timeout: Duration,
    max_retries: u32,
    backoff: Duration,
    max_backoff: Duration,
    deadline: Option<Instant>,
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// A successful exchange: the JSON body and how many attempts it took.
#[derive(Debug)]
pub struct Answer {
    pub body: Value,
    pub attempts: u32,
}

impl Transport {
    pub fn new(cfg: &ModelConfig) -> Result<Transport, ModelError> {
        let client = http::Client::new(&cfg.base_url, cfg.ca_file.as_deref())
            .map_err(|e| ModelError::Config(e.to_string()))?;
        if cfg.timeout_secs == 0 {
            return Err(ModelError::Config("timeout_secs must be at least 1".into()));
        }
        Ok(Transport {
            client,
            timeout: Duration::from_secs(cfg.timeout_secs),
            max_retries: cfg.max_retries,
            backoff: Duration::from_millis(cfg.backoff_ms),
            max_backoff: Duration::from_millis(cfg.max_backoff_ms),
            deadline: None,
            cancel: None,
        })
    }

    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    pub fn set_cancel(&mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.cancel = Some(cancel);
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The time one attempt may take: the timeout, or less when the deadline is nearer.
    fn attempt_timeout(&self) -> Result<Duration, ModelError> {
        match self.deadline {
            None => Ok(self.timeout),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    Err(ModelError::Deadline)
                } else {
                    Ok(self.timeout.min(left))
                }
            }
        }
    }

    /// POSTs `body` to `path`; retries on 429, 5xx and connection failures.
    pub fn post(
        &self,
        path: &str,
        headers: &[(&'static str, String)],
        body: &Value,
    ) -> Result<Answer, ModelError> {
        let payload = serde_json::to_vec(body).map_err(|e| ModelError::Malformed(e.to_string()))?;
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            let mut req = http::Request::new("POST", path);
            req.headers = headers.to_vec();
            req.body = Some(&payload);
            req.cancel = self.cancel.as_deref();
            let timeout = self.attempt_timeout()?;
            let wait = match self.client.send(&req, timeout) {
                Ok(resp) if (200..300).contains(&resp.status) => {
                    let body = serde_json::from_slice(&resp.body).map_err(|e| {
                        ModelError::Malformed(format!(
                            "the body is not JSON ({e}): {}",
                            snippet(&resp.body)
                        ))
                    })?;
                    return Ok(Answer {
                        body,
                        attempts: attempt,
                    });
                }
                Ok(resp) if resp.status == 429 || resp.status >= 500 => {
                    if attempt > self.max_retries {
                        return Err(ModelError::Exhausted {
                            status: resp.status,
                            attempts: attempt,
                            body: snippet(&resp.body),
                        });
                    }
                    let after = resp.header("retry-after").and_then(parse_retry_after);
                    tracing::info!(status = resp.status, attempt, retry_after = ?after, "model server asks to retry");
                    after.unwrap_or_else(|| self.backoff_for(attempt))
                }
                Ok(resp) => {
                    return Err(ModelError::Status {
                        status: resp.status,
                        body: snippet(&resp.body),
                    });
                }
                Err(e @ HttpError::Tls { .. }) => return Err(ModelError::Tls(e)),
                Err(HttpError::Cancelled { .. }) => return Err(ModelError::Cancelled),
                Err(HttpError::Timeout { .. })
                    if self.deadline.is_some_and(|d| Instant::now() >= d) =>
                {
                    return Err(ModelError::Deadline);
                }
                Err(e) if e.is_transient() && attempt <= self.max_retries => {
                    tracing::info!(error = %e, attempt, "model call failed; retrying");
                    self.backoff_for(attempt)
                }
                Err(e) => {
                    return Err(ModelError::Unreachable {
                        attempts: attempt,
                        source: e,
                    });
                }
            };
            let wait = wait.min(self.max_backoff);
            if self.deadline.is_some_and(|d| Instant::now() + wait >= d) {
                return Err(ModelError::Deadline);
            }
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if self.cancelled() {
                    return Err(ModelError::Cancelled);
                }
                std::thread::sleep(
                    until
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(50)),
                );
            }
        }
    }

    fn backoff_for(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// `Retry-After` as seconds (an HTTP date is not worth a parser here: it falls back to backoff).
fn parse_retry_after(v: &str) -> Option<Duration> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(3600.0)))
}

/// The first 500 bytes of a body, for error messages.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut end = text.len().min(500);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Times one adapter call and fills in the bookkeeping fields.
pub(crate) fn finish_response(
    cfg: &ModelConfig,
    started: Instant,
    attempts: u32,
    mut resp: ModelResponse,
) -> ModelResponse {
    resp.cost_usd = cfg.cost(resp.usage);
    resp.attempts = attempts;
    resp.latency_ms = started.elapsed().as_millis() as u64;
    resp
}

/// A model that answers with recorded responses, in order (replay).
#[derive(Debug)]
pub struct Recorded {
    responses: Vec<ModelResponse>,
    next: usize,
}

impl Recorded {
    pub fn new(responses: Vec<ModelResponse>) -> Recorded {
        Recorded { responses, next: 0 }
    }
}

impl Model for Recorded {
    fn describe(&self) -> String {
        "recorded".into()
    }

    fn complete(&mut self, _req: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let r = self
            .responses
            .get(self.next)
            .cloned()
            .ok_or(ModelError::RecordingExhausted(self.next + 1))?;
        self.next += 1;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_follows_prices() {
        let mut c = ModelConfig::new(Provider::Openai, "http://x", "m");
        c.price_input_per_mtok = 3.0;
        c.price_output_per_mtok = 15.0;
        let cost = c.cost(Usage {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
        });
        assert!((cost - 4.5).abs() < 1e-9, "{cost}");
    }

    #[test]
    fn retry_after_and_backoff() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
        let mut c = ModelConfig::new(Provider::Openai, "http://x", "m");
        c.backoff_ms = 100;
        c.max_backoff_ms = 350;
        let t = Transport::new(&c).unwrap();
        assert_eq!(t.backoff_for(1), Duration::from_millis(100));
        assert_eq!(t.backoff_for(2), Duration::from_millis(200));
        assert_eq!(t.backoff_for(3), Duration::from_millis(350));
        assert_eq!(t.backoff_for(40), Duration::from_millis(350));
    }

    #[test]
    fn a_client_error_is_not_retried_and_5xx_are() {
        use crate::mock::{MockServer, Step};
        let req = ModelRequest {
            system: "s".into(),
            messages: vec![Message::user("u")],
            tools: vec![],
            max_tokens: 10,
        };
        for provider in [Provider::Openai, Provider::Anthropic] {
            let mock = MockServer::start(provider, vec![Step::status(401, None)]).unwrap();
            let mut cfg = ModelConfig::new(provider, &mock.base_url(), "m");
            cfg.backoff_ms = 1;
            let e = cfg.build().unwrap().complete(&req).unwrap_err();
            assert!(matches!(e, ModelError::Status { status: 401, .. }), "{e}");
            assert_eq!(mock.received().len(), 1, "no retry on 401");

            let mock = MockServer::start(
                provider,
                vec![Step::status(502, None), Step::cut("partial")],
            )
            .unwrap();
            let mut cfg = ModelConfig::new(provider, &mock.base_url(), "m");
            cfg.backoff_ms = 1;
            let r = cfg.build().unwrap().complete(&req).unwrap();
            assert_eq!(r.finish, Finish::Length, "{provider:?}");
            assert_eq!(r.text, "partial");
            assert_eq!(r.attempts, 2);
        }
    }

    #[test]
    fn bad_configuration_is_an_error() {
        assert!("gemini".parse::<Provider>().is_err());
        let c = ModelConfig::new(Provider::Openai, "ftp://x", "m");
        assert!(matches!(c.build(), Err(ModelError::Config(_))));
        let mut c = ModelConfig::new(Provider::Openai, "https://x", "m");
        c.ca_file = Some("/nonexistent/ca.pem".into());
        let Err(ModelError::Config(e)) = c.build() else {
            panic!("a missing CA file must be a configuration error");
        };
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
