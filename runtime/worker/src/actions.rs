//! A contract's actions: side effects of a completed task, run by the worker on its own host
//! (with its credentials), never in the sandbox. Each runs at most once per task: the worker
//! records it as begun in the task's record (compare-and-set, under its claim) before it starts
//! it, so no redelivery and no other attempt starts it again; one whose worker died while it ran
//! is `unknown`, and is not run again.
//!
//! - `git_push`: the change as one commit on the task's commit, pushed to a branch. The commit
//!   is the same whoever makes it (its author, committer and dates are fixed by the task), so a
//!   push retried by hand is a no-op, not a second commit. Never forced.
//! - `webhook`: a POST of the task's outcome as JSON, with `Idempotency-Key: taskbox-TASK-NAME`
//!   for a receiver that dedupes.

use std::net::ToSocketAddrs;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use taskbox_agent::Report;
use taskbox_agent::contract::{ActionSpec, check_git_url};
use taskbox_agent::http::{Client, Request};

use crate::source::{git_command, run_git};

/// What an action needs of its task.
pub struct ActionContext<'a> {
    pub task: &'a str,
    pub report: &'a Report,
    /// The workspace clone with the task's change applied (git workspaces).
    pub workspace: Option<&'a Path>,
    /// The task's git URL, the default remote of a push.
    pub git_url: Option<&'a str>,
    /// The task's submit time: the commit's dates.
    pub submitted_unix_ms: u64,
}

/// Runs `action`; the detail of what it did, or why it failed.
pub fn run(name: &str, action: &ActionSpec, cx: &ActionContext<'_>) -> Result<String, String> {
    match action {
        ActionSpec::GitPush {
            remote,
            branch,
            message,
            ..
        } => {
            let remote = remote
                .as_deref()
                .or(cx.git_url)
                .ok_or("git_push needs a remote: the task's workspace is not a git repository")?;
            check_git_url(remote)?;
            let ws = cx
                .workspace
                .ok_or("git_push needs the task's git workspace")?;
            let message = message.clone().unwrap_or_else(|| cx.report.goal.clone());
            git_push(ws, remote, branch, &message, cx)
        }
        ActionSpec::Webhook { url, .. } => webhook(name, url, cx),
    }
}

fn git_push(
    ws: &Path,
    remote: &str,
    branch: &str,
    message: &str,
    cx: &ActionContext<'_>,
) -> Result<String, String> {
    let ws_s = ws.display().to_string();
    let git = |args: &[&str], what: &str| {
        let mut c = git_command(&[&["-C", &ws_s], args].concat());
        let date = format!("@{} +0000", cx.submitted_unix_ms / 1000);
        c.env("GIT_AUTHOR_NAME", "taskbox")
            .env("GIT_AUTHOR_EMAIL", "taskbox@localhost")
            .env("GIT_COMMITTER_NAME", "taskbox")
            .env("GIT_COMMITTER_EMAIL", "taskbox@localhost")
            .env("GIT_AUTHOR_DATE", &date)
            .env("GIT_COMMITTER_DATE", &date);
        run_git(c, what, Duration::from_secs(300))
    };
    git(&["add", "--all", "--", "."], "git add")?;
    let staged = git(&["diff", "--cached", "--name-only"], "git diff")?;
    if staged.trim().is_empty() {
        return Ok("no change to push".to_owned());
    }
    let full = format!("{message}\n\ntaskbox task {}\n", cx.task);
    git(
        &[
            "commit",
            "--quiet",
            "--no-verify",
            "--no-gpg-sign",
            "-m",
            &full,
        ],
        "git commit",
    )?;
    let commit = git(&["rev-parse", "HEAD"], "git rev-parse")?
        .trim()
        .to_owned();
    let target = format!("HEAD:refs/heads/{branch}");
    git(
        &["push", "--quiet", "--no-verify", "--", remote, &target],
        &format!("git push to {branch}"),
    )?;
    Ok(format!("pushed {commit} to branch {branch} of {remote}"))
}

/// Whether `ip` is an address a webhook may not be sent to from the worker's host: link-local
/// (the cloud metadata service among them).
fn forbidden(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => {
            (v6.segments()[0] & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_link_local())
                // AWS's IPv6 metadata address.
                || v6.segments()[..4] == [0xfd00, 0x0ec2, 0, 0]
        }
    }
}

fn webhook(name: &str, url: &str, cx: &ActionContext<'_>) -> Result<String, String> {
    let u = url::Url::parse(url).map_err(|e| format!("url {url:?}: {e}"))?;
    let host = u
        .host_str()
        .ok_or_else(|| format!("url {url:?} has no host"))?;
    let port = u.port_or_known_default().unwrap_or(80);
    let host_plain = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<_> = (host_plain, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .collect();
    if let Some(a) = addrs.iter().find(|a| forbidden(a.ip())) {
        return Err(format!(
            "{host} resolves to {}, a link-local address (such as the cloud metadata service): \
             refused before connecting",
            a.ip()
        ));
    }
    let base = format!(
        "{}://{}:{port}",
        u.scheme(),
        if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        }
    );
    let mut path = u.path().to_owned();
    if let Some(q) = u.query() {
        path.push('?');
        path.push_str(q);
    }
    let r = cx.report;
    let body = json!({
        "task": cx.task,
        "action": name,
        "outcome": r.outcome,
        "termination": r.termination,
        "detail": r.detail,
        "goal": r.goal,
        "summary": r.summary,
        "files_changed": r.files_changed,
        "diff": r.diff,
        "turns": r.metrics.turns,
        "cost_usd": r.metrics.cost_usd,
    })
    .to_string();
    let client = Client::new(&base, None).map_err(|e| e.to_string())?;
    let mut req = Request::new("POST", &path);
    req.headers
        .push(("content-type", "application/json".to_owned()));
    req.headers
        .push(("idempotency-key", format!("taskbox-{}-{name}", cx.task)));
    req.body = Some(body.as_bytes());
    let resp = client
        .send(&req, Duration::from_secs(30))
        .map_err(|e| format!("POST {url}: {e}"))?;
    if (200..300).contains(&resp.status) {
        Ok(format!("POST {url}: {}", resp.status))
    } else {
        let text: String = String::from_utf8_lossy(&resp.body)
            .chars()
            .take(200)
            .collect();
        Err(format!("POST {url}: {} {text}", resp.status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_and_metadata_addresses_are_forbidden() {
        for ip in [
            "169.254.169.254",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:169.254.1.1",
        ] {
            assert!(
                forbidden(ip.parse().unwrap_or(std::net::IpAddr::from([0; 4]))),
                "{ip}"
            );
        }
        for ip in ["127.0.0.1", "10.1.2.3", "::1", "2001:db8::1"] {
            assert!(
                !forbidden(
                    ip.parse()
                        .unwrap_or(std::net::IpAddr::from([169, 254, 0, 1]))
                ),
                "{ip}"
            );
        }
    }
}
