//! Approvals over MCP: an exec that the command policy asks about is put to the client's user.
//!
//! [`watch`] runs beside the session. It long-polls the sandbox's pending approvals and, for each
//! new one, sends the client an elicitation (`elicitation/create`, form mode) that shows the
//! command and why it needs approval and asks for `approve` (a boolean) and an optional
//! `reason`. The answer is given to the backend as [`SandboxApi::approve`] or
//! [`SandboxApi::deny`], so it is recorded like one given over HTTP:
//!
//! - accept with `approve` true (or left out): approved, the exec runs;
//! - accept with `approve` false: denied with the given reason;
//! - decline or cancel: denied ("declined by the user", "dismissed by the user");
//! - a client without the elicitation capability, or a request that fails or is not answered
//!   before the approval expires: denied, saying so.
//!
//! The model reads the denial and its reason in the exec's result.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::Peer;
use rmcp::model::{ElicitRequestParams, ElicitationAction, ElicitationSchema};
use rmcp::service::{ElicitationMode, RoleServer};
use serde_json::json;
use taskbox_core::api::{Approval, ApprovalId, SandboxApi, SandboxId};

/// How long one long-poll for pending approvals lasts.
const POLL: Duration = Duration::from_secs(30);

/// Why an approval was not given, when the client was never asked.
pub const NO_ELICITATION: &str = "no one to ask: the MCP client does not support elicitation, so \
     it cannot put the question to its user";

/// Puts every pending approval of sandbox `id` to the client behind `peer`, until the session
/// ends (the caller aborts it) or the sandbox is gone.
pub async fn watch(backend: Arc<dyn SandboxApi>, id: SandboxId, peer: Peer<RoleServer>) {
    let mut asked: HashSet<ApprovalId> = HashSet::new();
    loop {
        let started = Instant::now();
        let b = Arc::clone(&backend);
        let sid = id.clone();
        let pending =
            match tokio::task::spawn_blocking(move || b.list_approvals(&sid, Some(POLL))).await {
                Ok(Ok(pending)) => pending,
                Ok(Err(e)) => {
                    tracing::debug!(sandbox = %id, error = %e, "no more approvals to watch");
                    return;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "the approvals watch failed");
                    return;
                }
            };
        // A backend without a command policy answers at once: do not spin on it.
        if pending.is_empty() && started.elapsed() < Duration::from_millis(100) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        asked.retain(|a| pending.iter().any(|p| p.id == *a));
        for approval in pending {
            if asked.insert(approval.id.clone()) {
                tokio::spawn(answer(Arc::clone(&backend), peer.clone(), approval));
            }
        }
    }
}

/// Asks the client about one approval and gives the backend its answer.
async fn answer(backend: Arc<dyn SandboxApi>, peer: Peer<RoleServer>, approval: Approval) {
    let decision = ask(&peer, &approval).await;
    let (sandbox, id) = (approval.sandbox.clone(), approval.id.clone());
    let outcome = tokio::task::spawn_blocking(move || match &decision {
        Ok(()) => backend.approve(&sandbox, &id),
        Err(reason) => backend.deny(&sandbox, &id, reason),
    })
    .await;
    match outcome {
        Ok(Ok(a)) => {
            tracing::info!(approval = %a.id, state = ?a.state, "approval answered over mcp")
        }
        // Timed out or answered meanwhile: nothing left to do.
        Ok(Err(e)) => tracing::debug!(approval = %approval.id, error = %e, "approval not answered"),
        Err(e) => tracing::warn!(approval = %approval.id, error = %e, "approval answer failed"),
    }
}

/// The user's answer: `Ok` to approve, else the reason of the denial.
async fn ask(peer: &Peer<RoleServer>, approval: &Approval) -> Result<(), String> {
    if !peer
        .supported_elicitation_modes()
        .contains(&ElicitationMode::Form)
    {
        return Err(NO_ELICITATION.to_owned());
    }
    let schema = ElicitationSchema::from_json_schema(
        json!({
            "type": "object",
            "properties": {
                "approve": {
                    "type": "boolean",
                    "title": "Run it",
                    "description": "Let the command run",
                    "default": true,
                },
                "reason": {
                    "type": "string",
                    "title": "Reason",
                    "description": "When not approving: why, or what to do instead (the agent reads it)",
                },
            },
            "required": ["approve"],
        })
        .as_object()
        .cloned()
        .unwrap_or_default(),
    )
    .map_err(|e| format!("cannot build the approval form: {e}"))?;
    let message = format!(
        "The agent wants to run `{}` in its sandbox; the command policy asks first because {}. \
         Let it run?",
        approval.command, approval.reason
    );
    let now = taskbox_core::support::now_ms();
    let left = Duration::from_millis(approval.expires_at_ms.saturating_sub(now).max(1));
    let params = ElicitRequestParams::FormElicitationParams {
        meta: None,
        message,
        requested_schema: schema,
    };
    let result = peer
        .create_elicitation_with_timeout(params, Some(left))
        .await
        .map_err(|e| format!("the MCP client could not ask its user: {e}"))?;
    match result.action {
        ElicitationAction::Accept => {
            let content = result.content.unwrap_or_default();
            if content.get("approve").and_then(|v| v.as_bool()) == Some(false) {
                let reason = content
                    .get("reason")
                    .and_then(|v| v.as_str())
                    .map(str::trim)
                    .filter(|r| !r.is_empty())
                    .unwrap_or("not approved by the user");
                Err(reason.to_owned())
            } else {
                Ok(())
            }
        }
        ElicitationAction::Decline => Err("declined by the user".to_owned()),
        ElicitationAction::Cancel => Err("dismissed by the user".to_owned()),
        _ => Err("the MCP client gave an answer taskbox does not know".to_owned()),
    }
}
