//! The work contract: what the agent is to do, where it may change things, what it may not run,
//! how the result is verified, and when to stop. A TOML file (or the same fields from flags).
//!
//! ```toml
//! goal = "make the failing test in tests/math.sh pass"
//! scope = ["src/", "tests/*.sh"]          # paths the agent may change (prefixes or globs)
//! forbidden = ["git push", "curl"]        # commands the harness refuses (command prefixes)
//! verify = ["sh tests/math.sh"]           # the verification gate: all must exit 0
//! deliverables = ["a fix in src/"]
//! plan_first = true                       # a plan before the first edit
//!
//! [budget]
//! max_turns = 30
//! time = "10m"
//! max_cost_usd = 1.0
//! max_tokens = 500000                     # input + output over the whole task
//! context_tokens = 60000                  # per request; older turns are compacted beyond it
//! max_verify_attempts = 3                 # finish calls whose gate fails before giving up
//!
//! [[actions]]                             # side effects once the gate passed (taskbox worker:
//! kind = "git_push"                       # at most once per task, guarded in the queue)
//! branch = "taskbox/fix-math"             # the change as one commit on this branch
//! # remote = "https://git.example/repo.git"  (default: the task's git workspace)
//!
//! [[actions]]
//! kind = "webhook"                        # POST the task's outcome as JSON
//! url = "https://hooks.example/taskbox"   # with an Idempotency-Key header
//!
//! [model]                                 # optional; else flags or the environment
//! provider = "openai"
//! base_url = "http://127.0.0.1:8000/v1"
//! model = "qwen2.5-coder"
//! # ca_file = "private-ca.pem"            # an https server signed by a private CA
//! ```

use std::path::Path;
use std::time::Duration;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};
use taskbox_core::commands::{CommandPrefix, Commands, Verdict};

use crate::model::ModelConfig;

/// Errors reading a contract.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// the file cannot be read
    #[error("cannot read contract {path}: {why}")]
    Read { path: String, why: String },
    /// the TOML is invalid or has unknown keys
    #[error("invalid contract {path}: {why}")]
    Parse { path: String, why: String },
    /// a field has a value that cannot work
    #[error("invalid contract {path}: {key}: {why}")]
    Field {
        path: String,
        key: String,
        why: String,
    },
}

/// Stop conditions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Budget {
    pub max_turns: u32,
    /// Wall time of the whole task (humantime: `90s`, `10m`).
    #[serde(with = "duration_text")]
    pub time: Duration,
    pub max_cost_usd: Option<f64>,
    /// Input plus output tokens over the whole task.
    pub max_tokens: Option<u64>,
    /// Estimated tokens per request; beyond it older turns are compacted.
    pub context_tokens: u64,
    /// How many times `finish` may fail the verification gate before the task ends.
    pub max_verify_attempts: u32,
    /// Timeout of one tool exec in milliseconds when the model gives none.
    pub exec_timeout_ms: u64,
    /// Timeout of one verification command in milliseconds.
    pub verify_timeout_ms: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_turns: 40,
            time: Duration::from_secs(30 * 60),
            max_cost_usd: None,
            max_tokens: None,
            context_tokens: 100_000,
            max_verify_attempts: 3,
            exec_timeout_ms: 120_000,
            verify_timeout_ms: 600_000,
        }
    }
}

mod duration_text {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {text:?}: {e} (examples: 90s, 10m, 1h)"
            ))
        })
    }
}

/// The work contract.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contract {
    /// One sentence.
    pub goal: String,
    /// Paths the agent may change, relative to the workspace root: a directory prefix
    /// (`src/`), a file, or a glob (`tests/*.sh`). Empty: everywhere.
    #[serde(default)]
    pub scope: Vec<String>,
    /// Commands the harness refuses (prefixes, as in the policy's `forbid`).
    #[serde(default)]
    pub forbidden: Vec<String>,
    /// Verification commands (shell); the task is done only when all exit 0.
    #[serde(default)]
    pub verify: Vec<String>,
    #[serde(default)]
    pub deliverables: Vec<String>,
    /// The agent must submit a plan before its first edit.
    #[serde(default)]
    pub plan_first: bool,
    #[serde(default)]
    pub budget: Budget,
    #[serde(default)]
    pub model: Option<ModelConfig>,
    /// Side effects to run once the verification gate has passed: by `taskbox worker`, at most
    /// once per task whatever the redeliveries (`docs/worker.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<ActionSpec>,
}

/// A side effect of a completed task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ActionSpec {
    /// Push the task's change as one commit (on the workspace's commit) to a branch.
    GitPush {
        /// Unique among the contract's actions (default: the kind, then `-2`, `-3`, ...).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Where to push (`https://`, `ssh://`, `git@host:path`, `file://` or an absolute
        /// path); default: the task's git workspace URL.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        remote: Option<String>,
        /// The branch (a plain name, such as `taskbox/fix-math`); never forced.
        branch: String,
        /// The commit message (default: the goal).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// POST the task's outcome (id, termination, summary, files changed, diff) as JSON.
    Webhook {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// `http://` or `https://`.
        url: String,
    },
}

impl ActionSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            ActionSpec::GitPush { .. } => "git_push",
            ActionSpec::Webhook { .. } => "webhook",
        }
    }

    fn given_name(&self) -> Option<&str> {
        match self {
            ActionSpec::GitPush { name, .. } | ActionSpec::Webhook { name, .. } => name.as_deref(),
        }
    }

    /// Why this action cannot work, if it cannot.
    fn check(&self) -> Result<(), String> {
        if let Some(n) = self.given_name()
            && (n.is_empty()
                || n.len() > 64
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
        {
            return Err(format!(
                "name {n:?}: use 1 to 64 letters, digits, `-` or `_`"
            ));
        }
        match self {
            ActionSpec::GitPush { remote, branch, .. } => {
                check_branch(branch)?;
                if let Some(r) = remote {
                    check_git_url(r).map_err(|e| format!("remote: {e}"))?;
                }
            }
            ActionSpec::Webhook { url, .. } => {
                let u = url::Url::parse(url).map_err(|e| format!("url {url:?}: {e}"))?;
                if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
                    return Err(format!("url {url:?}: give an http:// or https:// URL"));
                }
            }
        }
        Ok(())
    }
}

/// Checks a branch name against git's rules for a ref (`git check-ref-format`), kept to what a
/// push of `HEAD:refs/heads/BRANCH` needs.
pub fn check_branch(b: &str) -> Result<(), String> {
    let bad = b.is_empty()
        || b.len() > 200
        || b.starts_with(['-', '/', '.'])
        || b.ends_with(['/', '.'])
        || b.ends_with(".lock")
        || b.contains("..")
        || b.contains("//")
        || b.contains("@{")
        || b.split('/')
            .any(|c| c.starts_with('.') || c.ends_with(".lock"))
        || b.bytes().any(|c| {
            c.is_ascii_control() || b" ~^:?*[\\".contains(&c) || c == 0x7f || !c.is_ascii()
        });
    if bad {
        return Err(format!(
            "branch {b:?} is not a valid branch name (see git check-ref-format)"
        ));
    }
    Ok(())
}

/// Checks a git URL a worker may fetch from or push to: the transports `https`, `http`,
/// `ssh`, `git`, `file`, scp-like `user@host:path`, or an absolute path. Never an option
/// (`-...`) or a helper transport (`ext::`, `fd::`), which would run commands on the worker.
pub fn check_git_url(u: &str) -> Result<(), String> {
    if u.is_empty() || u.starts_with('-') || u.bytes().any(|c| c.is_ascii_control()) {
        return Err(format!("{u:?} is not a git URL"));
    }
    if u.contains("::") {
        return Err(format!(
            "{u:?}: helper transports (`ext::`, `fd::`, ...) are refused: they run commands"
        ));
    }
    if let Some((scheme, _)) = u.split_once("://") {
        return match scheme {
            "https" | "http" | "ssh" | "git" | "file" => Ok(()),
            other => Err(format!(
                "{u:?}: transport {other:?} is refused (use https, http, ssh, git or file)"
            )),
        };
    }
    if u.starts_with('/') {
        return Ok(());
    }
    // scp-like: [user@]host:path, with a host before the first colon and no slash before it.
    match u.split_once(':') {
        Some((host, path)) if !host.is_empty() && !host.contains('/') && !path.is_empty() => Ok(()),
        _ => Err(format!(
            "{u:?}: give a URL (https://, ssh://, file://), user@host:path or an absolute path"
        )),
    }
}

impl Contract {
    /// A contract with only a goal (everything else default).
    pub fn with_goal(goal: impl Into<String>) -> Contract {
        Contract {
            goal: goal.into(),
            scope: Vec::new(),
            forbidden: Vec::new(),
            verify: Vec::new(),
            deliverables: Vec::new(),
            plan_first: false,
            budget: Budget::default(),
            model: None,
            actions: Vec::new(),
        }
    }

    /// Reads and checks a contract file.
    pub fn load(path: &Path) -> Result<Contract, ContractError> {
        let text = std::fs::read_to_string(path).map_err(|e| ContractError::Read {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        Contract::parse(&text, &path.display().to_string())
    }

    /// Parses and checks contract text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Contract, ContractError> {
        let c: Contract = toml::from_str(text).map_err(|e| ContractError::Parse {
            path: origin.to_owned(),
            why: e.message().to_owned()
                + &e.span()
                    .map(|s| format!(" (at byte {})", s.start))
                    .unwrap_or_default(),
        })?;
        c.check(origin)?;
        Ok(c)
    }

    /// Checks the fields that TOML types cannot.
    pub fn check(&self, origin: &str) -> Result<(), ContractError> {
        let field = |key: &str, why: String| ContractError::Field {
            path: origin.to_owned(),
            key: key.to_owned(),
            why,
        };
        if self.goal.trim().is_empty() {
            return Err(field("goal", "must say what to do".into()));
        }
        self.scope_matcher().map_err(|e| field("scope", e))?;
        self.forbidden_rules().map_err(|e| field("forbidden", e))?;
        if self.budget.max_turns == 0 {
            return Err(field("budget.max_turns", "must be at least 1".into()));
        }
        if self.budget.time.is_zero() {
            return Err(field("budget.time", "must be greater than zero".into()));
        }
        if self.budget.context_tokens < 1000 {
            return Err(field(
                "budget.context_tokens",
                "must be at least 1000".into(),
            ));
        }
        if self
            .budget
            .max_cost_usd
            .is_some_and(|c| !c.is_finite() || c < 0.0)
        {
            return Err(field(
                "budget.max_cost_usd",
                "must be a non-negative number".into(),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, a) in self.actions.iter().enumerate() {
            let key = format!("actions[{i}]");
            a.check().map_err(|e| field(&key, e))?;
            if !names.insert(self.action_name(i)) {
                return Err(field(
                    &key,
                    format!(
                        "name {:?} is used twice; give each action its own `name`",
                        self.action_name(i)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The name of action `i`: its own, or its kind with `-2`, `-3`, ... for the second and
    /// later of the same kind.
    pub fn action_name(&self, i: usize) -> String {
        let Some(a) = self.actions.get(i) else {
            return String::new();
        };
        if let Some(n) = a.given_name() {
            return n.to_owned();
        }
        let same = self.actions[..i]
            .iter()
            .filter(|b| b.kind() == a.kind() && b.given_name().is_none())
            .count();
        match same {
            0 => a.kind().to_owned(),
            n => format!("{}-{}", a.kind(), n + 1),
        }
    }

    /// The scope as a matcher.
    pub fn scope_matcher(&self) -> Result<Scope, String> {
        Scope::new(&self.scope)
    }

    /// The forbidden commands as command rules.
    pub fn forbidden_rules(&self) -> Result<Commands, String> {
        let mut forbid = Vec::new();
        for f in &self.forbidden {
            forbid.push(CommandPrefix::parse(f).map_err(|e| format!("{f:?}: {e}"))?);
        }
        Ok(Commands {
            default: Verdict::Allow,
            forbid,
            ..Commands::default()
        })
    }
}

/// Which workspace paths the agent may change.
#[derive(Debug, Clone)]
pub struct Scope {
    prefixes: Vec<String>,
    globs: GlobSet,
    everywhere: bool,
}

impl Scope {
    pub fn new(entries: &[String]) -> Result<Scope, String> {
        let mut prefixes = Vec::new();
        let mut b = GlobSetBuilder::new();
        for e in entries {
            let e = e.trim_start_matches("./");
            if e.is_empty() || e.starts_with('/') || e.split('/').any(|c| c == "..") {
                return Err(format!(
                    "{e:?}: give a path relative to the workspace root, without `..`"
                ));
            }
            if e.contains(['*', '?', '[', '{']) {
                b.add(Glob::new(e).map_err(|err| format!("{e:?}: {err}"))?);
            } else {
                prefixes.push(e.trim_end_matches('/').to_owned());
            }
        }
        Ok(Scope {
            prefixes,
            globs: b.build().map_err(|e| e.to_string())?,
            everywhere: entries.is_empty(),
        })
    }

    /// Whether the agent may change `path` (relative to the workspace root).
    pub fn allows(&self, path: &str) -> bool {
        if self.everywhere {
            return true;
        }
        let p = normalise(path);
        let Some(p) = p else { return false };
        self.prefixes
            .iter()
            .any(|pre| p == *pre || p.starts_with(&format!("{pre}/")))
            || self.globs.is_match(&p)
    }
}

/// A relative path without `.` and `..` components, or `None` when it climbs out.
pub fn normalise(path: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.trim_start_matches('/').split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    Some(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contract_parses_with_defaults_and_refuses_bad_fields() {
        let c = Contract::parse(
            "goal = \"fix it\"\nscope = [\"src/\", \"tests/*.sh\"]\nforbidden = [\"git push\"]\n\
             verify = [\"sh t.sh\"]\n[budget]\nmax_turns = 5\ntime = \"2m\"\n",
            "c.toml",
        )
        .unwrap();
        assert_eq!(c.budget.max_turns, 5);
        assert_eq!(c.budget.time, Duration::from_secs(120));
        let s = c.scope_matcher().unwrap();
        assert!(s.allows("src/lib.rs"));
        assert!(s.allows("./src/a/b.rs"));
        assert!(s.allows("tests/x.sh"));
        assert!(!s.allows("tests/x.py"));
        assert!(!s.allows("srcx/lib.rs"));
        assert!(!s.allows("src/../Makefile"));
        assert!(!s.allows("../etc/passwd"));
        let check = c
            .forbidden_rules()
            .unwrap()
            .check(&["git".into(), "push".into()]);
        assert_eq!(check.verdict, Verdict::Forbid);

        let e = Contract::parse("goal = \"x\"\nbogus = 1\n", "c.toml").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = Contract::parse("goal = \"x\"\n[budget]\ntime = \"soon\"\n", "c.toml").unwrap_err();
        assert!(e.to_string().contains("invalid duration"), "{e}");
        let e = Contract::parse("goal = \"x\"\nscope = [\"../up\"]\n", "c.toml").unwrap_err();
        assert!(e.to_string().contains("scope"), "{e}");
        let e = Contract::parse("goal = \" \"\n", "c.toml").unwrap_err();
        assert!(e.to_string().contains("goal"), "{e}");
        assert!(Scope::new(&[]).unwrap().allows("anything/at/all"));
    }

    #[test]
    fn actions_parse_get_names_and_refuse_what_cannot_work() {
        let c = Contract::parse(
            "goal = \"x\"\n[[actions]]\nkind = \"git_push\"\nbranch = \"taskbox/fix\"\n\
             [[actions]]\nkind = \"webhook\"\nurl = \"https://hooks.example/t\"\n\
             [[actions]]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/x\"\n",
            "c.toml",
        )
        .unwrap();
        assert_eq!(c.actions.len(), 3);
        let names: Vec<String> = (0..3).map(|i| c.action_name(i)).collect();
        assert_eq!(names, ["git_push", "webhook", "webhook-2"]);
        // It round-trips through the task state's JSON.
        let back: Contract = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);

        for (text, says) in [
            ("kind = \"git_push\"\nbranch = \"a..b\"", "branch"),
            ("kind = \"git_push\"\nbranch = \"-f\"", "branch"),
            (
                "kind = \"git_push\"\nbranch = \"ok\"\nremote = \"ext::sh -c x\"",
                "helper transports",
            ),
            (
                "kind = \"git_push\"\nbranch = \"ok\"\nremote = \"--upload-pack=x\"",
                "not a git URL",
            ),
            (
                "kind = \"webhook\"\nurl = \"file:///etc/passwd\"",
                "http://",
            ),
            (
                "kind = \"webhook\"\nurl = \"https://h/x\"\nname = \"a b\"",
                "name",
            ),
            (
                "kind = \"webhook\"\nurl = \"https://h/x\"\nmethod = \"PUT\"",
                "method",
            ),
            ("kind = \"email\"\nto = \"x\"", "email"),
        ] {
            let e = Contract::parse(&format!("goal = \"x\"\n[[actions]]\n{text}\n"), "c.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
        let e = Contract::parse(
            "goal = \"x\"\n[[actions]]\nkind = \"webhook\"\nurl = \"https://h/x\"\nname = \"n\"\n\
             [[actions]]\nkind = \"webhook\"\nurl = \"https://h/y\"\nname = \"n\"\n",
            "c.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("actions[1]") && e.contains("twice"), "{e}");
        assert!(check_git_url("git@host.example:org/repo.git").is_ok());
        assert!(check_git_url("/srv/repo.git").is_ok());
        assert!(check_git_url("file:///srv/repo.git").is_ok());
        assert!(check_git_url("relative/path").is_err());
    }
}
