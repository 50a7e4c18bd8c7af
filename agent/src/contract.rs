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
        Ok(())
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
}
