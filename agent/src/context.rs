//! Context management: a token estimate per request, compaction of older turns into a summary of
//! kept facts (the task state stays whole), and the repository's rule files in bounded form.

use std::sync::Arc;

use taskbox_core::api::{ReadRequest, SandboxApi, SandboxId};
use taskbox_tools::Tool;

use crate::model::{Message, Role};
use crate::state::TaskState;

/// Files whose rules are injected into the system prompt, in this order.
pub const RULE_FILES: &[&str] = &["AGENTS.md", "CONTRIBUTING.md", ".editorconfig"];
/// Bytes of one rule file kept.
pub const RULE_FILE_BYTES: usize = 4096;
/// Bytes of all rule files kept together.
pub const RULES_TOTAL_BYTES: usize = 8192;

/// A rough token count: about four bytes per token, plus a little per message.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

pub fn estimate_messages(messages: &[Message]) -> u64 {
    messages
        .iter()
        .map(|m| {
            8 + estimate_tokens(&m.content)
                + m.tool_calls
                    .iter()
                    .map(|c| estimate_tokens(&c.arguments) + 8)
                    .sum::<u64>()
        })
        .sum()
}

/// When `system` plus `messages` would exceed `budget` tokens, replaces the older turns (all but
/// the task message and the newest turns that fit in half the budget) by one message that
/// summarises the kept facts of `state`. Returns whether it compacted.
pub fn compact(messages: &mut Vec<Message>, system: &str, budget: u64, state: &TaskState) -> bool {
    let total = estimate_tokens(system) + estimate_messages(messages);
    if total <= budget || messages.len() < 4 {
        return false;
    }
    let keep_budget = budget / 2;
    // Walk back from the end; a kept suffix must start at an assistant message so that tool
    // results stay with the call that asked for them.
    let mut cut = messages.len();
    let mut kept = 0u64;
    for i in (1..messages.len()).rev() {
        kept += estimate_messages(&messages[i..=i]);
        if kept > keep_budget {
            break;
        }
        if messages[i].role == Role::Assistant {
            cut = i;
        }
    }
    if cut <= 2 {
        return false;
    }
    let dropped = cut - 1;
    let summary = summary(state, dropped);
    let mut out = Vec::with_capacity(messages.len() - dropped + 1);
    out.push(messages[0].clone());
    out.push(Message::user(summary));
    out.extend(messages.drain(cut..));
    *messages = out;
    true
}

/// The kept facts of a task, for a compacted history.
pub fn summary(state: &TaskState, dropped: usize) -> String {
    let mut s = format!(
        "[context compacted: {dropped} earlier messages were replaced by this summary of kept facts]\n"
    );
    if let Some(plan) = &state.plan {
        s.push_str("plan:\n");
        for (i, step) in plan.steps.iter().enumerate() {
            s.push_str(&format!("  {}. {step}\n", i + 1));
        }
    }
    let list = |title: &str, items: &mut dyn Iterator<Item = &String>, s: &mut String| {
        let items: Vec<&String> = items.collect();
        if !items.is_empty() {
            s.push_str(title);
            s.push_str(":\n");
            // The newest facts matter most; keep the last 20.
            for i in items.iter().rev().take(20).rev() {
                s.push_str(&format!("  - {i}\n"));
            }
        }
    };
    list("files touched", &mut state.files_touched.iter(), &mut s);
    list("done", &mut state.completed_steps.iter(), &mut s);
    list(
        "failed attempts (and why)",
        &mut state.failed_attempts.iter(),
        &mut s,
    );
    list(
        "checks still pending",
        &mut state.pending_verification.iter(),
        &mut s,
    );
    s
}

/// The repository's rule files, read through the sandbox, each cut to [`RULE_FILE_BYTES`] and
/// all to [`RULES_TOTAL_BYTES`]. Empty when there are none.
pub fn rule_files(api: &Arc<dyn SandboxApi>, id: &SandboxId) -> String {
    let mut out = String::new();
    for name in RULE_FILES {
        let left = RULES_TOTAL_BYTES.saturating_sub(out.len());
        if left < 64 {
            break;
        }
        let cap = RULE_FILE_BYTES.min(left);
        let Ok(r) = api.read(
            id,
            ReadRequest {
                path: (*name).to_owned(),
                max_bytes: Some(cap as u64),
                ..ReadRequest::default()
            },
        ) else {
            continue;
        };
        if r.binary {
            continue;
        }
        out.push_str(&format!("--- {name} ---\n{}", r.content));
        if !r.content.ends_with('\n') {
            out.push('\n');
        }
        if r.truncated {
            out.push_str(&format!(
                "[cut at {cap} of {} bytes; {} {name} for the rest]\n",
                r.total_bytes,
                Tool::ReadFile.name()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Contract;
    use crate::model::ToolCall;

    fn state() -> TaskState {
        TaskState {
            workspace: "/w".into(),
            policy: "default".into(),
            model: "m".into(),
            sandbox: "sb-1".into(),
            completed_steps: vec!["turn 2: edited src/a.rs".into()],
            failed_attempts: vec!["turn 3: `cargo test` exit 101".into()],
            pending_verification: vec!["cargo test".into()],
            files_touched: ["src/a.rs".to_owned()].into(),
            ..TaskState::new("t".into(), Contract::with_goal("g"))
        }
    }

    #[test]
    fn old_turns_become_a_summary_of_kept_facts() {
        let mut messages = vec![Message::user("Task: fix it")];
        for i in 0..20 {
            messages.push(Message::assistant(
                "",
                vec![ToolCall {
                    id: format!("c{i}"),
                    name: Tool::ReadFile.name().into(),
                    arguments: "{}".into(),
                }],
            ));
            messages.push(Message::tool(format!("c{i}"), "x".repeat(2000)));
        }
        let before = messages.len();
        assert!(compact(&mut messages, "sys", 4000, &state()));
        assert!(messages.len() < before);
        assert_eq!(messages[0].content, "Task: fix it");
        let summary = &messages[1].content;
        assert!(summary.starts_with("[context compacted"), "{summary}");
        for fact in ["src/a.rs", "`cargo test` exit 101", "checks still pending"] {
            assert!(summary.contains(fact), "{summary}");
        }
        assert_eq!(
            messages[2].role,
            Role::Assistant,
            "a kept turn starts with its call"
        );
        assert!(estimate_messages(&messages) <= 4000);
        // Under the budget nothing changes.
        let mut small = vec![Message::user("t"), Message::user("u")];
        assert!(!compact(&mut small, "sys", 4000, &state()));
    }
}
