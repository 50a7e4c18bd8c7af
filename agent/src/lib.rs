//! taskbox-agent: a harness in which the model proposes and the runtime enforces.
//!
//! It owns the model adapters ([`model`]: OpenAI-compatible chat completions and Anthropic
//! Messages behind one trait, over the small HTTP client of [`http`]), the tools the model may
//! call ([`tools`]: every tool of `taskbox_tools`, the narrow API's operations as the MCP
//! server offers them plus `plan` and `finish`), the work contract ([`contract`]), the loop with its budgets and verification
//! gate ([`agent`]), its attempts in parallel forks ([`attempts`]) and sub-agents in forks (the
//! `subtask` tool), context management ([`context`]), the externalised task state ([`state`]),
//! the agent's trace ([`trajectory`]) and its replay ([`replay`]), the handoff report
//! ([`report`]) and the evaluation of task sets ([`eval`]).
//!
//! It reaches sandboxes only through [`taskbox_core::api::SandboxApi`]: in-process (a backend
//! wrapped in the command policy and the trace) or over HTTP to `taskbox serve`
//! ([`remote::Remote`]). [`mock`] holds scripted model servers that speak both protocols over
//! real HTTP, for tests and offline evaluation.

pub mod agent;
pub mod attempts;
pub mod context;
pub mod contract;
pub mod eval;
pub mod http;
pub mod mock;
pub mod model;
pub mod remote;
pub mod replay;
pub mod report;
pub mod state;
pub mod tools;
pub mod trajectory;

pub use agent::{
    Approver, Decision, ModelFactory, NoOneToAsk, Options, PlanReviewer, TaskSpec, TurnObserver,
    resume, start, start_in,
};
pub use attempts::{Keep, start_attempts};
pub use contract::Contract;
pub use report::Report;
pub use state::Termination;
