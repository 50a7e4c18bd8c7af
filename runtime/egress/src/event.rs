//! Decision events: what the proxy tells its subscriber about every connection it decides.

use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use taskbox_core::result::Violation;

/// How a client asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// HTTP `CONNECT host:port` (HTTPS and other tunnels).
    Connect,
    /// A plain HTTP request in absolute form (`GET http://host/path`).
    Forward,
    /// SOCKS5 `CONNECT`.
    Socks5,
}

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The policy allowed it and the proxy connected.
    Allowed,
    /// The policy refused it.
    Denied,
    /// The policy allowed it (or could not tell, when the name did not resolve), but resolving
    /// or connecting failed.
    Failed,
}

/// One decision. A connection gives one event when it is decided (`end` unset), and an allowed
/// one a second, with the same `id`, when it ends (`end` set). Count allowed connections by the
/// events without `end`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The connection's number in this proxy, from 1.
    pub id: u64,
    /// When the decision (or the end) happened, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The proxy's tag: which sandbox the client is in.
    pub tag: String,
    /// The client's address ("unix" for a Unix socket).
    pub client: String,
    pub protocol: Protocol,
    /// The host asked for: a normalised name, or an address (IPv6 in brackets).
    pub host: String,
    pub port: u16,
    /// The address connected to; for a denial, the address that was refused (if one was).
    pub ip: Option<IpAddr>,
    /// Every address the name resolved to (the literal, for an address).
    pub addresses: Vec<IpAddr>,
    pub outcome: Outcome,
    /// The rule that decided: "allow PATTERN" or "deny PATTERN"; unset when none matched.
    pub rule: Option<String>,
    /// Why it was refused or failed, in one line.
    pub reason: Option<String>,
    /// What to change in the policy to allow it.
    pub hint: Option<String>,
    /// Set on the second event of an allowed connection.
    pub end: Option<ConnectionEnd>,
}

/// How an allowed connection ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionEnd {
    /// Bytes from the client to the destination (a forwarded request's rewritten head included).
    pub bytes_up: u64,
    /// Bytes from the destination to the client.
    pub bytes_down: u64,
    pub duration_ms: u64,
    /// Why it ended abnormally: "idle for 300s", "proxy shut down", an I/O error; unset when
    /// both sides closed.
    pub error: Option<String>,
}

impl Decision {
    pub fn allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// `host:port` as asked.
    pub fn target(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// One line for the client and the model: "connect evil.example:443 denied: not in
    /// allowlist; to allow it, add ...".
    pub fn message(&self) -> String {
        let verb = match self.outcome {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::Failed => "failed",
        };
        let mut text = format!("connect {} {verb}", self.target());
        if let Some(reason) = &self.reason {
            text.push_str(": ");
            text.push_str(reason);
        }
        if let Some(hint) = &self.hint {
            text.push_str("; ");
            text.push_str(hint);
        }
        text
    }

    /// The violation an ExecResult reports for a denial (kind "network"); `None` for allowed or
    /// failed connections and for the end events.
    pub fn violation(&self) -> Option<Violation> {
        (self.outcome == Outcome::Denied && self.end.is_none()).then(|| Violation {
            kind: "network".to_owned(),
            detail: self.message(),
        })
    }
}

/// Receives every [`Decision`]; called on the connection's task, so it should not block (push
/// into a channel).
pub type Subscriber = Arc<dyn Fn(&Decision) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denial_becomes_a_violation() {
        let decision = Decision {
            id: 1,
            time_ms: 0,
            tag: "sb".into(),
            client: "unix".into(),
            protocol: Protocol::Connect,
            host: "evil.example".into(),
            port: 443,
            ip: None,
            addresses: vec![],
            outcome: Outcome::Denied,
            rule: None,
            reason: Some("not in allowlist".into()),
            hint: Some("to allow it, add \"evil.example:443\" to network.allow".into()),
            end: None,
        };
        assert_eq!(
            decision.violation(),
            Some(Violation {
                kind: "network".into(),
                detail: "connect evil.example:443 denied: not in allowlist; to allow it, add \
                         \"evil.example:443\" to network.allow"
                    .into()
            })
        );
        let allowed = Decision {
            outcome: Outcome::Allowed,
            ..decision
        };
        assert_eq!(allowed.violation(), None);
        let json = serde_json::to_value(&allowed).unwrap();
        assert_eq!(json["outcome"], "allowed");
        assert_eq!(json["protocol"], "connect");
    }
}
