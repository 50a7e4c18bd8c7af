//! An exec request made concrete once, against a sandbox's policy: the argv, the environment,
//! the working directory and the limits, each validated here, so no backend checks them again
//! its own way.

use std::path::Path;
use std::time::Duration;

use crate::api::{ApiError, ExecRequest};
use crate::exec_limits;
use crate::policy::Policy;

/// What an exec runs, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecPlan {
    pub argv: Vec<String>,
    /// The sandbox's environment with the request's over it.
    pub env: Vec<(String, String)>,
    /// Absolute, inside the sandbox.
    pub cwd: String,
    pub timeout: Duration,
    /// Bytes of each output stream kept in the result.
    pub output_limit: usize,
    /// The command's last argument is the request's shell line.
    pub shell: bool,
    pub background: bool,
    /// Given on standard input, then closed.
    pub stdin: Option<Vec<u8>>,
    /// Standard error goes to standard output (`2>&1`).
    pub merge_output: bool,
    /// The user the request names (`ExecRequest::user`), as given.
    pub user: Option<String>,
    /// That user as the sandbox's account files resolve it (the kit fills it in before the
    /// backend sees the plan: [`crate::accounts::resolve`]).
    pub exec_user: Option<crate::accounts::ExecUser>,
}

impl ExecPlan {
    /// The plan of `req` in a sandbox whose workspace is at `workdir` (inside), whose execs get
    /// `base_env`, and whose shell lines run with `shell` (the image's shell and its flag;
    /// `None`: `/bin/sh -c`).
    pub fn new(
        req: &ExecRequest,
        policy: &Policy,
        base_env: &[(String, String)],
        workdir: &str,
        shell: Option<&[String]>,
    ) -> Result<ExecPlan, ApiError> {
        let mut argv = req.resolved_argv()?;
        if let (Some(line), Some(shell)) = (&req.shell, shell) {
            argv = shell.iter().cloned().chain([line.clone()]).collect();
        }
        let timeout = req.time_limit(policy.limits.timeout)?;
        let cwd = match &req.cwd {
            None => workdir.to_owned(),
            Some(c) if c.starts_with('/') => c.clone(),
            Some(c) => Path::new(workdir).join(c).display().to_string(),
        };
        exec_limits::check_cwd(&cwd)?;
        let env = req.layered_env(base_env)?;
        Ok(ExecPlan {
            argv,
            env,
            cwd,
            timeout,
            output_limit: req.output_cap(policy.limits.output_bytes),
            shell: req.shell.is_some(),
            background: req.background,
            stdin: req.stdin_bytes()?,
            merge_output: req.merge_output,
            user: req.user.clone(),
            exec_user: None,
        })
    }

    /// Refuses what execve would not run in an argument space of `space` bytes (see
    /// [`exec_limits::argument_space`]), counting `extra`, the words a backend puts before the
    /// command (a wrapper's own arguments).
    pub fn check(&self, space: u64, extra: &[&str]) -> Result<(), ApiError> {
        exec_limits::Command {
            argv: &self.argv,
            env: &self.env,
            shell: self.shell,
            extra,
        }
        .check(space)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_resolves_and_validates_once() {
        let policy = Policy::default();
        let req = ExecRequest {
            shell: Some("echo hi".into()),
            cwd: Some("sub".into()),
            env: [("A".to_string(), "1".to_string())].into(),
            ..ExecRequest::default()
        };
        let base = [("A".to_string(), "0".to_string()), ("B".into(), "2".into())];
        let p = ExecPlan::new(&req, &policy, &base, "/workspace", None).unwrap();
        assert_eq!(p.argv, ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(p.cwd, "/workspace/sub");
        assert_eq!(p.env, [("B".into(), "2".into()), ("A".into(), "1".into())]);
        let ash = ["/bin/ash".to_string(), "-c".to_string()];
        let p = ExecPlan::new(&req, &policy, &base, "/workspace", Some(&ash)).unwrap();
        assert_eq!(p.argv, ["/bin/ash", "-c", "echo hi"]);
        let bad = ExecRequest {
            argv: Some(vec!["x".into()]),
            cwd: Some("a\0b".into()),
            ..ExecRequest::default()
        };
        assert!(ExecPlan::new(&bad, &policy, &[], "/w", None).is_err());
        let zero = ExecRequest {
            argv: Some(vec!["x".into()]),
            timeout_ms: Some(0),
            ..ExecRequest::default()
        };
        assert!(ExecPlan::new(&zero, &policy, &[], "/w", None).is_err());
    }
}
