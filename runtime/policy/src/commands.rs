//! Command rules: the `[commands]` section of a policy, and the check of one exec's command
//! against it.
//!
//! A rule is a *prefix*: a list of words, written as a string split like the shell splits it
//! (`"git push"`, `"git commit -m 'wip'"`) or as an array of exact words (`["git", "push"]`).
//! The first word is a program name and matches the basename of the command's first word, so
//! `git push` also matches `/usr/bin/git push`. The rest match differently by list:
//!
//! - `forbid` and `ask` match generously: the rule's other words must appear in the command in
//!   order, with anything between them, so `git push` matches `git -C repo push --force` (and
//!   also `git log push`: a false alarm is the safe side of a guardrail).
//! - `allow` matches exactly: the command must start with the rule's words, so `git status`
//!   does not allow `git push origin status`.
//!
//! The strictest match wins (forbid > ask > allow); a command no rule matches gets `default`.
//! A command line is analysed into simple commands ([`crate::shell`]): through `sh -c`/`bash -c`
//! and the other shells, through wrappers that run their arguments as a command (`env`,
//! `command`, `exec`, `nice`, `nohup`, `timeout`, `time`, `stdbuf`, `setsid`, `xargs`, `sudo`,
//! `doas`, `busybox`), into `eval`, `trap` and `find -exec`. Every part must pass. A part whose
//! words are only known at run time (`$(echo git) push`, `$CMD push`) needs approval when a
//! forbid or ask rule could match it, and so does anything the analysis cannot read.
//! `docs/commands.md` has the whole story, limits included: this is a guardrail for an agent's
//! intent, not a security boundary.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::error::ValidationError;
use crate::shell::{self, Word};

/// How long an `ask` waits for an answer when the policy does not say.
pub const DEFAULT_ASK_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// How deep shells, wrappers and `eval` may nest before the analysis gives up (and asks).
const MAX_DEPTH: usize = 16;

/// What happens to a command.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// It runs.
    #[default]
    Allow,
    /// It waits for a person's approval.
    Ask,
    /// It is refused without running.
    Forbid,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Ask => "ask",
            Verdict::Forbid => "forbid",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One rule: the words a command starts with (see the module docs for how each list matches).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CommandPrefix {
    words: Vec<String>,
}

impl CommandPrefix {
    /// A prefix from its string form, split like the shell splits words.
    pub fn parse(text: &str) -> Result<CommandPrefix, String> {
        let words = shell::split_words(text)?;
        CommandPrefix::from_words(words)
    }

    /// A prefix from its words, taken exactly.
    pub fn from_words(words: Vec<String>) -> Result<CommandPrefix, String> {
        let Some(first) = words.first() else {
            return Err("it has no words".to_owned());
        };
        if let Some(i) = words.iter().position(String::is_empty) {
            return Err(format!("word {} is empty", i + 1));
        }
        if first.contains('/') {
            let base = first.rsplit('/').next().unwrap_or_default();
            return Err(format!(
                "the program is matched by its name, whatever directory it runs from: write \
                 {base:?}, not {first:?}"
            ));
        }
        Ok(CommandPrefix { words })
    }

    pub fn words(&self) -> &[String] {
        &self.words
    }
}

impl fmt::Display for CommandPrefix {
    /// The words joined with spaces, quoted where the shell would need it; parses back to the
    /// same prefix.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quoted: Vec<String> = self.words.iter().map(|w| quote(w)).collect();
        f.write_str(&quoted.join(" "))
    }
}

impl Serialize for CommandPrefix {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for CommandPrefix {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PrefixVisitor;
        impl<'de> Visitor<'de> for PrefixVisitor {
            type Value = CommandPrefix;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a command prefix: a string like \"git push\" or an array of words")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<CommandPrefix, E> {
                CommandPrefix::parse(text).map_err(|reason| {
                    E::custom(format!("invalid command prefix {text:?}: {reason}"))
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<CommandPrefix, A::Error> {
                let mut words = Vec::new();
                while let Some(word) = seq.next_element::<String>()? {
                    words.push(word);
                }
                CommandPrefix::from_words(words.clone()).map_err(|reason| {
                    de::Error::custom(format!("invalid command prefix {words:?}: {reason}"))
                })
            }
        }
        deserializer.deserialize_any(PrefixVisitor)
    }
}

/// The `[commands]` section of a policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Commands {
    /// What happens to a command that no rule matches.
    pub default: Verdict,
    /// Refused without running.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forbid: Vec<CommandPrefix>,
    /// Run only once a person approves.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ask: Vec<CommandPrefix>,
    /// Run (unless a forbid or ask rule also matches).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<CommandPrefix>,
    /// How long an `ask` waits for an answer; then it is denied.
    #[serde(
        deserialize_with = "crate::units::de_duration",
        serialize_with = "crate::units::ser_duration"
    )]
    pub ask_timeout: Duration,
}

impl Default for Commands {
    fn default() -> Self {
        Commands {
            default: Verdict::Allow,
            forbid: Vec::new(),
            ask: Vec::new(),
            allow: Vec::new(),
            ask_timeout: DEFAULT_ASK_TIMEOUT,
        }
    }
}

/// The outcome of checking one exec's command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub verdict: Verdict,
    /// The part of the command that decided, as the shell would write it (words known only at
    /// run time shown as `<?>`).
    pub command: String,
    /// The rule that decided, as `forbid "git push"`; `None` for the default and for what could
    /// not be analysed.
    pub rule: Option<String>,
    /// Why, in words a model and a person can act on.
    pub reason: String,
}

impl Commands {
    /// The section as the built-in default: no rules, everything allowed.
    pub fn is_default(&self) -> bool {
        *self == Commands::default()
    }

    /// Whether commands are checked at all: there is a rule, or the default is not `allow`.
    pub fn is_active(&self) -> bool {
        self.default != Verdict::Allow
            || !self.forbid.is_empty()
            || !self.ask.is_empty()
            || !self.allow.is_empty()
    }

    pub(crate) fn validate(&self) -> Result<(), ValidationError> {
        if self.ask_timeout.is_zero() {
            return Err(ValidationError::new(
                "commands.ask_timeout",
                "must be greater than zero",
            ));
        }
        Ok(())
    }

    /// Checks an exec's argv (a shell string arrives as `["/bin/sh", "-c", STRING]`).
    pub fn check(&self, argv: &[String]) -> Check {
        let whole = display_argv(argv);
        if !self.is_active() {
            return Check {
                verdict: Verdict::Allow,
                command: whole,
                rule: None,
                reason: "the policy has no command rules".to_owned(),
            };
        }
        let mut analysis = Analysis::default();
        analysis.command(argv.iter().map(|a| Word::Lit(a.clone())).collect(), 0);

        let mut best: Option<Check> = None;
        for inv in &analysis.invocations {
            if let Some(c) = self.check_one(inv)
                && best.as_ref().is_none_or(|b| c.verdict > b.verdict)
            {
                best = Some(c);
            }
        }
        // Only transparent wrappers (or nothing at all, as in `sh -c 'X=1'`): no command of its
        // own runs.
        let best = best.unwrap_or_else(|| Check {
            verdict: Verdict::Allow,
            command: whole.clone(),
            rule: None,
            reason: "it runs no command of its own".to_owned(),
        });
        if best.verdict < Verdict::Ask && !analysis.unsure.is_empty() {
            return Check {
                verdict: Verdict::Ask,
                command: whole,
                rule: None,
                reason: format!(
                    "taskbox cannot analyse the whole command ({}), so it cannot tell which \
                     rules apply to it",
                    analysis.unsure.join("; ")
                ),
            };
        }
        best
    }

    fn default_check(&self, command: String) -> Check {
        let reason = format!(
            "it matches no rule, and the policy's default for other commands is {}",
            self.default
        );
        Check {
            verdict: self.default,
            command,
            rule: None,
            reason,
        }
    }

    /// The verdict of one simple command; `None` for a transparent wrapper no rule names (its
    /// inner command decides).
    fn check_one(&self, inv: &Invocation) -> Option<Check> {
        let command = display_words(&inv.words);
        fn first<'a>(
            list: &'a [CommandPrefix],
            words: &[Word],
            loose: bool,
            want: Hit,
        ) -> Option<&'a CommandPrefix> {
            list.iter()
                .find(|p| matches(p.words(), words, loose) == want)
        }
        let words = &inv.words;
        let found = |verdict: Verdict, list: Verdict, p: &CommandPrefix, reason: String| Check {
            verdict,
            command: command.clone(),
            rule: Some(format!("{list} {:?}", p.to_string())),
            reason,
        };
        if let Some(p) = first(&self.forbid, words, true, Hit::Yes) {
            return Some(found(
                Verdict::Forbid,
                Verdict::Forbid,
                p,
                format!("it matches the rule forbid {:?}", p.to_string()),
            ));
        }
        let maybe = |list: Verdict, p: &CommandPrefix| {
            found(
                Verdict::Ask,
                list,
                p,
                format!(
                    "it might match the rule {list} {:?}: part of it is only known when it runs \
                     (a variable, a command substitution or a pattern)",
                    p.to_string()
                ),
            )
        };
        if let Some(p) = first(&self.forbid, words, true, Hit::Maybe) {
            return Some(maybe(Verdict::Forbid, p));
        }
        if let Some(p) = first(&self.ask, words, true, Hit::Maybe) {
            return Some(maybe(Verdict::Ask, p));
        }
        if let Some(p) = first(&self.ask, words, true, Hit::Yes) {
            return Some(found(
                Verdict::Ask,
                Verdict::Ask,
                p,
                format!("it matches the rule ask {:?}", p.to_string()),
            ));
        }
        if let Some(p) = first(&self.allow, words, false, Hit::Yes) {
            return Some(found(
                Verdict::Allow,
                Verdict::Allow,
                p,
                format!("it matches the rule allow {:?}", p.to_string()),
            ));
        }
        if inv.transparent {
            return None;
        }
        if self.default != Verdict::Allow
            && let Some(p) = first(&self.allow, words, false, Hit::Maybe)
        {
            return Some(maybe(Verdict::Allow, p));
        }
        Some(self.default_check(command))
    }

    /// The `[commands]` part of [`crate::policy::Policy::explain`].
    pub(crate) fn explain(&self, line: &mut impl FnMut(String)) {
        if !self.is_active() {
            line(
                "  - No command rules: any command may run (confined by the sandbox as above)."
                    .to_owned(),
            );
            return;
        }
        let list = |rules: &[CommandPrefix]| {
            rules
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !self.forbid.is_empty() {
            line(format!(
                "  - Refused without running: commands starting with {} (other words may come \
                 between the rule's words).",
                list(&self.forbid)
            ));
        }
        if !self.ask.is_empty() {
            line(format!(
                "  - Run only after a person approves: commands starting with {} (other words \
                 may come between the rule's words).",
                list(&self.ask)
            ));
        }
        if !self.allow.is_empty() {
            line(format!(
                "  - Allowed: commands starting with exactly {}.",
                list(&self.allow)
            ));
        }
        line(format!(
            "  - Any other command: {}.",
            match self.default {
                Verdict::Allow => "allowed",
                Verdict::Ask => "runs only after a person approves",
                Verdict::Forbid => "refused",
            }
        ));
        line(format!(
            "  - Programs match by name from any directory. Shell command lines (sh -c and the \
             like), wrappers such as env, timeout and xargs, eval and find -exec are split into \
             their commands and every one must pass; what taskbox cannot analyse needs \
             approval. An unanswered approval is denied after {}.",
            humantime::format_duration(self.ask_timeout)
        ));
        line(
            "  - A guardrail for the agent's intent, not a security boundary: a program can \
             still run other programs (scripts, Makefiles, interpreters). The sandbox is the \
             boundary."
                .to_owned(),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Analysis: from an argv to every simple command it runs
// ---------------------------------------------------------------------------------------------

/// One simple command found in the exec.
#[derive(Debug)]
struct Invocation {
    words: Vec<Word>,
    /// A shell or wrapper whose inner command was found and is checked on its own: the wrapper
    /// only answers to rules that name it, not to the default.
    transparent: bool,
}

#[derive(Debug, Default)]
struct Analysis {
    invocations: Vec<Invocation>,
    unsure: Vec<String>,
}

/// A program that runs its arguments as a command, and how to find where that command starts.
struct Wrapper {
    name: &'static str,
    /// Short options that take a value (attached, or the next word).
    short_arg: &'static str,
    /// Short options that take a value only when attached (`xargs -i{}`).
    short_optional: &'static str,
    short_flag: &'static str,
    /// Long options taking a value as the next word (`--name=value` is always understood).
    long_arg: &'static [&'static str],
    long_flag: &'static [&'static str],
    /// Options whose value is itself a command line taskbox does not split (`env -S`).
    opaque_short: &'static str,
    opaque_long: &'static [&'static str],
    /// Options that make it run no command (`command -v`).
    no_command: &'static str,
    /// Operands before the command (`timeout`'s duration).
    operands: usize,
    /// `NAME=VALUE` words may come before the command (`env`).
    assignments: bool,
    /// `-N` is an option (`nice -10`).
    numeric: bool,
    /// More arguments are appended when it runs (`xargs`).
    appends: bool,
}

const NONE: &[&str] = &[];

const fn wrapper(name: &'static str) -> Wrapper {
    Wrapper {
        name,
        short_arg: "",
        short_optional: "",
        short_flag: "",
        long_arg: NONE,
        long_flag: NONE,
        opaque_short: "",
        opaque_long: NONE,
        no_command: "",
        operands: 0,
        assignments: false,
        numeric: false,
        appends: false,
    }
}

const WRAPPERS: &[Wrapper] = &[
    Wrapper {
        short_arg: "uC",
        short_flag: "i0v",
        long_arg: &["--unset", "--chdir"],
        long_flag: &[
            "--ignore-environment",
            "--null",
            "--debug",
            "--default-signal",
            "--ignore-signal",
            "--block-signal",
            "--list-signal-handling",
        ],
        opaque_short: "S",
        opaque_long: &["--split-string"],
        assignments: true,
        ..wrapper("env")
    },
    Wrapper {
        short_flag: "p",
        no_command: "vV",
        ..wrapper("command")
    },
    wrapper("builtin"),
    Wrapper {
        short_arg: "a",
        short_flag: "cl",
        ..wrapper("exec")
    },
    Wrapper {
        short_arg: "n",
        long_arg: &["--adjustment"],
        numeric: true,
        ..wrapper("nice")
    },
    wrapper("nohup"),
    Wrapper {
        short_arg: "sk",
        short_flag: "v",
        long_arg: &["--signal", "--kill-after"],
        long_flag: &["--preserve-status", "--foreground", "--verbose"],
        operands: 1,
        ..wrapper("timeout")
    },
    Wrapper {
        short_arg: "fo",
        short_flag: "apqv",
        long_arg: &["--format", "--output"],
        long_flag: &["--append", "--portability", "--quiet", "--verbose"],
        ..wrapper("time")
    },
    Wrapper {
        short_arg: "ioe",
        long_arg: &["--input", "--output", "--error"],
        ..wrapper("stdbuf")
    },
    Wrapper {
        short_flag: "cfw",
        long_flag: &["--ctty", "--fork", "--wait"],
        ..wrapper("setsid")
    },
    Wrapper {
        short_arg: "adEILnPs",
        short_optional: "eil",
        short_flag: "0prtxo",
        long_arg: &[
            "--arg-file",
            "--delimiter",
            "--max-args",
            "--max-procs",
            "--max-chars",
            "--process-slot-var",
        ],
        long_flag: &[
            "--null",
            "--no-run-if-empty",
            "--verbose",
            "--interactive",
            "--exit",
            "--open-tty",
            "--show-limits",
            "--max-lines",
            "--replace",
            "--eof",
        ],
        appends: true,
        ..wrapper("xargs")
    },
    Wrapper {
        short_arg: "ugCDhprtTU",
        short_flag: "AbEeHiKklnPSsVv",
        long_arg: &[
            "--user",
            "--group",
            "--chdir",
            "--prompt",
            "--close-from",
            "--role",
            "--type",
            "--command-timeout",
            "--other-user",
            "--host",
        ],
        long_flag: &[
            "--preserve-env",
            "--login",
            "--shell",
            "--non-interactive",
            "--stdin",
            "--background",
            "--askpass",
            "--set-home",
            "--reset-timestamp",
            "--remove-timestamp",
        ],
        ..wrapper("sudo")
    },
    Wrapper {
        short_arg: "uC",
        short_flag: "Lns",
        ..wrapper("doas")
    },
];

/// Shells whose `-c` script is analysed.
const SHELLS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash", "posh", "rbash",
];

impl Analysis {
    fn unsure(&mut self, why: String) {
        if !self.unsure.contains(&why) {
            self.unsure.push(why);
        }
    }

    fn script(&mut self, src: &str, depth: usize) {
        let script = shell::parse(src);
        for why in script.unsure {
            self.unsure(why);
        }
        for words in script.commands {
            self.command(words, depth + 1);
        }
    }

    /// Records one simple command, and whatever it runs in turn.
    fn command(&mut self, words: Vec<Word>, depth: usize) {
        if words.is_empty() {
            return;
        }
        if depth > MAX_DEPTH {
            self.unsure("shells and wrappers are nested too deeply to analyse".to_owned());
            return;
        }
        let at = self.invocations.len();
        let name = head_name(&words[0]).map(str::to_owned);
        self.invocations.push(Invocation {
            words: words.clone(),
            transparent: false,
        });
        let Some(name) = name else {
            return;
        };
        let transparent = if SHELLS.contains(&name.as_str()) {
            self.shell(&name, &words, depth)
        } else if let Some(w) = WRAPPERS.iter().find(|w| w.name == name) {
            match self.unwrap(w, &words) {
                Some(inner) => {
                    self.command(inner, depth + 1);
                    true
                }
                None => false,
            }
        } else {
            match name.as_str() {
                "busybox" => match words.get(1) {
                    Some(Word::Lit(applet)) if !applet.starts_with('-') => {
                        self.command(words[1..].to_vec(), depth + 1);
                        true
                    }
                    Some(Word::Lit(_)) | None => false,
                    Some(_) => {
                        self.unsure(
                            "the program busybox runs is only known at run time".to_owned(),
                        );
                        false
                    }
                },
                "eval" => {
                    let texts: Option<Vec<&str>> = words[1..].iter().map(Word::lit).collect();
                    match texts {
                        Some(texts) => {
                            self.script(&texts.join(" "), depth);
                            true
                        }
                        None => {
                            self.unsure("eval runs text that is only known at run time".to_owned());
                            false
                        }
                    }
                }
                "trap" => {
                    self.trap(&words, depth);
                    false
                }
                "find" => {
                    self.find(&words, depth);
                    false
                }
                "source" | "." => {
                    if let Some(file) = words.get(1) {
                        self.script_file(&name, file);
                    }
                    false
                }
                "alias" if words.len() > 1 => {
                    self.unsure("alias changes what later command names run".to_owned());
                    false
                }
                _ => false,
            }
        };
        self.invocations[at].transparent = transparent;
    }

    /// A shell: its `-c` script is analysed. Returns whether the script was found.
    fn shell(&mut self, name: &str, words: &[Word], depth: usize) -> bool {
        let mut i = 1;
        let mut c = false;
        let mut stdin = false;
        while i < words.len() {
            let Some(w) = words[i].lit() else {
                self.unsure(format!("the options of {name} are only known at run time"));
                return false;
            };
            if w == "--" || w == "-" {
                i += 1;
                break;
            }
            if w.starts_with("--") {
                i += if matches!(w, "--rcfile" | "--init-file") {
                    2
                } else {
                    1
                };
                continue;
            }
            if (w.starts_with('-') || w.starts_with('+')) && w.len() > 1 {
                let mut step = 1;
                for ch in w[1..].chars() {
                    match ch {
                        'c' => c = true,
                        's' => stdin = true,
                        'o' | 'O' => step = 2,
                        _ => {}
                    }
                }
                i += step;
                continue;
            }
            break;
        }
        if c {
            match words.get(i) {
                Some(Word::Lit(script)) => {
                    self.script(script, depth);
                    true
                }
                Some(_) => {
                    self.unsure(format!(
                        "the script given to {name} -c is only known at run time"
                    ));
                    false
                }
                None => {
                    self.unsure(format!("{name} -c is given no script"));
                    false
                }
            }
        } else if stdin || i >= words.len() {
            self.unsure(format!(
                "{name} reads its commands from standard input, which taskbox cannot see"
            ));
            false
        } else {
            // A script file: opaque, like any program that runs others; but one whose name is
            // only known at run time (`bash <(curl ..)`, `sh "$f"`) is asked about.
            self.script_file(name, &words[i]);
            false
        }
    }

    /// Where a wrapper's command starts; `None` when it runs none (or cannot be told, which is
    /// recorded as unsure).
    fn unwrap(&mut self, spec: &Wrapper, words: &[Word]) -> Option<Vec<Word>> {
        let name = spec.name;
        let mut i = 1;
        let mut operands = spec.operands;
        while i < words.len() {
            let Some(w) = words[i].lit() else {
                self.unsure(format!(
                    "cannot tell which command {name} runs: its arguments are only known at run \
                     time"
                ));
                return None;
            };
            if w == "--" {
                i += 1;
                break;
            }
            if let Some(long) = w.strip_prefix("--") {
                let option = format!("--{}", long.split('=').next().unwrap_or_default());
                if spec.opaque_long.contains(&option.as_str()) {
                    self.unsure(format!(
                        "{name} {option} runs a command line that is not analysed"
                    ));
                    return None;
                }
                if long.contains('=') || spec.long_flag.contains(&option.as_str()) {
                    i += 1;
                } else if spec.long_arg.contains(&option.as_str()) {
                    i += 2;
                } else {
                    self.unsure(format!(
                        "{name} has an option taskbox does not know ({option}), so it cannot \
                         tell which command it runs"
                    ));
                    return None;
                }
                continue;
            }
            if w == "-" && name == "env" {
                i += 1;
                continue;
            }
            if w.len() > 1 && w.starts_with('-') {
                let chars: Vec<char> = w[1..].chars().collect();
                let mut step = 1;
                for (k, ch) in chars.iter().enumerate() {
                    if spec.opaque_short.contains(*ch) {
                        self.unsure(format!(
                            "{name} -{ch} runs a command line that is not analysed"
                        ));
                        return None;
                    }
                    if spec.no_command.contains(*ch) {
                        return None;
                    }
                    if spec.short_arg.contains(*ch) {
                        if k + 1 == chars.len() {
                            step = 2;
                        }
                        break;
                    }
                    if spec.short_optional.contains(*ch) {
                        break;
                    }
                    if spec.short_flag.contains(*ch) || (spec.numeric && ch.is_ascii_digit()) {
                        continue;
                    }
                    self.unsure(format!(
                        "{name} has an option taskbox does not know (-{ch}), so it cannot tell \
                         which command it runs"
                    ));
                    return None;
                }
                i += step;
                continue;
            }
            if spec.assignments && w.contains('=') {
                i += 1;
                continue;
            }
            if operands > 0 {
                operands -= 1;
                i += 1;
                continue;
            }
            break;
        }
        if i >= words.len() {
            return None;
        }
        let mut inner = words[i..].to_vec();
        if spec.appends {
            inner.push(Word::Many);
        }
        Some(inner)
    }

    /// A script run from a file is opaque, but one whose file is only known at run time (a
    /// process substitution, a variable) could be anything, and is asked about.
    fn script_file(&mut self, runner: &str, file: &Word) {
        if file.lit().is_none() {
            self.unsure(format!(
                "{runner} runs a script whose file is only known at run time"
            ));
        }
    }

    /// `trap ACTION SIGNAL...`: the action is a script.
    fn trap(&mut self, words: &[Word], depth: usize) {
        let mut args = &words[1..];
        while let Some(Word::Lit(w)) = args.first() {
            if w == "--" {
                args = &args[1..];
                break;
            }
            if w.starts_with('-') && w.len() > 1 {
                args = &args[1..];
                continue;
            }
            break;
        }
        if args.len() < 2 {
            return;
        }
        match &args[0] {
            Word::Lit(action) if action == "-" => {}
            Word::Lit(action) => self.script(action, depth),
            _ => self.unsure("trap runs an action that is only known at run time".to_owned()),
        }
    }

    /// `find ... -exec CMD ... ;` (and `-execdir`, `-ok`, `-okdir`; `+` also ends).
    fn find(&mut self, words: &[Word], depth: usize) {
        let mut i = 1;
        while i < words.len() {
            if matches!(
                words[i].lit(),
                Some("-exec" | "-execdir" | "-ok" | "-okdir")
            ) {
                let start = i + 1;
                let mut end = start;
                while end < words.len() && !matches!(words[end].lit(), Some(";" | "+")) {
                    end += 1;
                }
                let inner: Vec<Word> = words[start..end]
                    .iter()
                    .map(|w| match w.lit() {
                        Some("{}") => Word::One { base: None },
                        _ => w.clone(),
                    })
                    .collect();
                self.command(inner, depth + 1);
                i = end + 1;
            } else {
                i += 1;
            }
        }
    }
}

/// The program name of a command's first word, when it can be known.
fn head_name(word: &Word) -> Option<&str> {
    match word {
        Word::Lit(s) => Some(basename(s)),
        Word::One { base: Some(b) } => Some(b),
        _ => None,
    }
}

fn basename(s: &str) -> &str {
    s.rsplit('/').next().unwrap_or(s)
}

/// How a rule matches a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hit {
    No,
    /// It matches for some run-time values of the unknown words.
    Maybe,
    Yes,
}

/// Whether `prefix` matches `words`: the program by name; the other words in order with gaps
/// (`loose`), or as the exact next words.
fn matches(prefix: &[String], words: &[Word], loose: bool) -> Hit {
    let (Some(program), Some(first)) = (prefix.first(), words.first()) else {
        return Hit::No;
    };
    let mut maybe = false;
    match first {
        Word::Lit(s) if basename(s) != program => return Hit::No,
        Word::Lit(_) => {}
        Word::One { base: Some(b) } if b != program => return Hit::No,
        Word::One { base: Some(_) } => {}
        Word::One { base: None } => maybe = true,
        // The words themselves may shift: `$X git push` is `git push` when X is empty.
        Word::Many => return Hit::Maybe,
    }
    let rest = if loose {
        in_order(&prefix[1..], &words[1..])
    } else {
        starts_with(&prefix[1..], &words[1..])
    };
    match (rest, maybe) {
        (Hit::Yes, true) => Hit::Maybe,
        (hit, _) => hit,
    }
}

/// `rule` appears in `words` in order, other words between them allowed.
fn in_order(rule: &[String], words: &[Word]) -> Hit {
    let mut j = 0;
    for w in words {
        if j < rule.len() && w.lit() == Some(rule[j].as_str()) {
            j += 1;
        }
    }
    if j == rule.len() {
        return Hit::Yes;
    }
    let mut j = 0;
    for w in words {
        if j == rule.len() {
            break;
        }
        match w {
            Word::Lit(s) if *s == rule[j] => j += 1,
            Word::Lit(_) => {}
            Word::One { .. } => j += 1,
            Word::Many => j = rule.len(),
        }
    }
    if j == rule.len() { Hit::Maybe } else { Hit::No }
}

/// `words` starts with exactly `rule`.
fn starts_with(rule: &[String], words: &[Word]) -> Hit {
    let mut maybe = false;
    for (k, r) in rule.iter().enumerate() {
        match words.get(k) {
            None => return Hit::No,
            Some(Word::Lit(s)) if s != r => return Hit::No,
            Some(Word::Lit(_)) => {}
            Some(Word::One { .. }) => maybe = true,
            Some(Word::Many) => return Hit::Maybe,
        }
    }
    if maybe { Hit::Maybe } else { Hit::Yes }
}

/// A word as the shell would need it written: bare when safe, else in single quotes.
pub fn quote(word: &str) -> String {
    let safe = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c));
    if safe {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn display_words(words: &[Word]) -> String {
    words
        .iter()
        .map(|w| match w {
            Word::Lit(s) => quote(s),
            Word::One { base: Some(b) } => format!("<?>/{b}"),
            Word::One { base: None } | Word::Many => "<?>".to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// An exec's command for people: a shell string as written, else the quoted argv.
pub fn display_argv(argv: &[String]) -> String {
    match argv {
        [sh, c, script] if sh == "/bin/sh" && c == "-c" => script.clone(),
        _ => argv.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixes(list: &[&str]) -> Vec<CommandPrefix> {
        list.iter()
            .map(|p| CommandPrefix::parse(p).unwrap())
            .collect()
    }

    fn rules(forbid: &[&str], ask: &[&str], allow: &[&str], default: Verdict) -> Commands {
        Commands {
            default,
            forbid: prefixes(forbid),
            ask: prefixes(ask),
            allow: prefixes(allow),
            ask_timeout: DEFAULT_ASK_TIMEOUT,
        }
    }

    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    /// The usual guardrail: no pushes, ask before commits.
    fn guard() -> Commands {
        rules(
            &["git push", "rm -rf /"],
            &["git commit"],
            &[],
            Verdict::Allow,
        )
    }

    fn verdict(c: &Commands, script: &str) -> Verdict {
        c.check(&sh(script)).verdict
    }

    #[test]
    fn prefix_syntax() {
        let p = CommandPrefix::parse("git commit -m 'a b'").unwrap();
        assert_eq!(p.words(), ["git", "commit", "-m", "a b"]);
        assert_eq!(p.to_string(), "git commit -m 'a b'");
        assert_eq!(CommandPrefix::parse(&p.to_string()).unwrap(), p);
        let odd = CommandPrefix::from_words(argv(&["x", "it's", "$HOME", "~", "#"])).unwrap();
        assert_eq!(
            CommandPrefix::parse(&odd.to_string()).unwrap(),
            odd,
            "{odd}"
        );
        for (bad, why) in [
            ("", "no words"),
            ("/usr/bin/git push", "write \"git\""),
            ("git $X", "expansion"),
            ("a; b", "operator"),
            ("'x", "not closed"),
        ] {
            let e = CommandPrefix::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!(CommandPrefix::from_words(argv(&["git", ""])).is_err());
    }

    #[test]
    fn strictest_match_wins() {
        let c = rules(&["git push"], &["git"], &["git push"], Verdict::Allow);
        let r = c.check(&argv(&["git", "push"]));
        assert_eq!(r.verdict, Verdict::Forbid);
        assert_eq!(r.rule.as_deref(), Some("forbid \"git push\""));
        assert_eq!(c.check(&argv(&["git", "status"])).verdict, Verdict::Ask);
        assert_eq!(c.check(&argv(&["ls"])).verdict, Verdict::Allow);
        let c = rules(&[], &[], &["cargo test", "ls"], Verdict::Forbid);
        assert_eq!(
            c.check(&argv(&["cargo", "test", "-q"])).verdict,
            Verdict::Allow
        );
        let r = c.check(&argv(&["cargo", "publish"]));
        assert_eq!(r.verdict, Verdict::Forbid);
        assert_eq!(r.rule, None);
        assert!(r.reason.contains("default"), "{}", r.reason);
    }

    #[test]
    fn no_rules_means_no_analysis() {
        let c = Commands::default();
        assert!(!c.is_active());
        assert_eq!(verdict(&c, "echo $(date) 'unclosed"), Verdict::Allow);
    }

    #[test]
    fn the_program_matches_by_basename() {
        let c = guard();
        for cmd in [
            "git push",
            "/usr/bin/git push",
            "./git push origin main",
            "\"$HOME\"/bin/git push",
        ] {
            assert_eq!(verdict(&c, cmd), Verdict::Forbid, "{cmd}");
        }
        assert_eq!(verdict(&c, "gitk push"), Verdict::Allow);
        assert_eq!(verdict(&c, "git pushy"), Verdict::Allow);
    }

    #[test]
    fn words_may_come_between_for_forbid_and_ask_but_not_for_allow() {
        let c = guard();
        assert_eq!(verdict(&c, "git -C repo push --force"), Verdict::Forbid);
        assert_eq!(verdict(&c, "git -c user.name=x commit -m y"), Verdict::Ask);
        assert_eq!(verdict(&c, "rm -rf /"), Verdict::Forbid);
        assert_eq!(verdict(&c, "rm -rf /tmp/x"), Verdict::Allow);
        let c = rules(&[], &[], &["git status"], Verdict::Forbid);
        assert_eq!(verdict(&c, "git status --short"), Verdict::Allow);
        assert_eq!(verdict(&c, "git push origin status"), Verdict::Forbid);
        assert_eq!(verdict(&c, "git -C x status"), Verdict::Forbid);
    }

    #[test]
    fn quoting_tricks_land_on_the_safe_side() {
        let c = guard();
        for cmd in [
            r#"g""it push"#,
            "'git' push",
            r"\git push",
            "g\\\nit push",
            "git 'push'",
            "\"git\" \"push\"",
        ] {
            assert_eq!(verdict(&c, cmd), Verdict::Forbid, "{cmd}");
        }
        // Run-time words: approval, never allow.
        for cmd in [
            "$(echo git) push",
            "`echo git` push",
            "$GIT push",
            "\"$GIT\" push",
            "git $(echo push)",
            "git $SUB",
            "g?t push",
            "g{i,}t push",
            "/usr/bin/g[i]t push",
            "$X git push",
            "git \"$@\"",
        ] {
            let r = c.check(&sh(cmd));
            assert_eq!(r.verdict, Verdict::Ask, "{cmd}: {r:?}");
            assert!(r.reason.contains("only known when it runs"), "{cmd}: {r:?}");
        }
        // A run-time word that cannot make a rule match changes nothing.
        assert_eq!(verdict(&c, "echo $(date) $HOME *"), Verdict::Allow);
        assert_eq!(
            verdict(&c, "git log $REV"),
            Verdict::Ask,
            "git log $REV may be git log push"
        );
        assert_eq!(verdict(&c, "cargo test $ARGS"), Verdict::Allow);
    }

    #[test]
    fn compound_commands_check_every_part() {
        let c = guard();
        for cmd in [
            "true && git push",
            "ls; git push",
            "false || git push",
            "echo x | git push",
            "sleep 1 & git push",
            "true\ngit push",
            "(git push)",
            "{ git push; }",
            "if true; then git push; fi",
            "while false; do git push; done",
            "for b in a; do git push; done",
            "case x in x) git push;; esac",
            "f() { git push; }",
            "echo $(git push)",
            "echo `git push`",
            "cat <(git push)",
            "git commit -m x && git push",
        ] {
            let r = c.check(&sh(cmd));
            assert_eq!(r.verdict, Verdict::Forbid, "{cmd}: {r:?}");
            assert!(r.command.starts_with("git push"), "{cmd}: {r:?}");
        }
        assert_eq!(verdict(&c, "git status && git commit -m x"), Verdict::Ask);
        assert_eq!(verdict(&c, "cargo build && cargo test"), Verdict::Allow);
    }

    #[test]
    fn wrappers_and_shells_are_looked_through() {
        let c = guard();
        for cmd in [
            argv(&["env", "git", "push"]),
            argv(&["env", "-i", "A=1", "-u", "B", "git", "push"]),
            argv(&["command", "git", "push"]),
            argv(&["exec", "-a", "x", "git", "push"]),
            argv(&["nice", "-n", "5", "git", "push"]),
            argv(&["nice", "-10", "git", "push"]),
            argv(&["nohup", "git", "push"]),
            argv(&["timeout", "-k", "5", "10s", "git", "push"]),
            argv(&["timeout", "--signal=KILL", "10", "git", "push"]),
            argv(&["time", "-p", "git", "push"]),
            argv(&["stdbuf", "-oL", "git", "push"]),
            argv(&["setsid", "-w", "git", "push"]),
            argv(&["sudo", "-u", "root", "git", "push"]),
            argv(&["busybox", "sh", "-c", "git push"]),
            argv(&["bash", "-c", "git push"]),
            argv(&["bash", "-lc", "git push"]),
            argv(&["bash", "-o", "pipefail", "-ec", "true; git push"]),
            argv(&["/usr/bin/dash", "-c", "git push", "name"]),
            argv(&["env", "sh", "-c", "nice git push"]),
            argv(&["sh", "-c", "sh -c 'sh -c \"git push\"'"]),
            argv(&["eval", "git", "push"]),
            argv(&["sh", "-c", "eval 'git push'"]),
            argv(&["sh", "-c", "trap 'git push' EXIT; true"]),
            argv(&["find", ".", "-name", "x", "-exec", "git", "push", ";"]),
            argv(&["xargs", "-0", "git", "push"]),
        ] {
            let r = c.check(&cmd);
            assert_eq!(r.verdict, Verdict::Forbid, "{cmd:?}: {r:?}");
        }
        // xargs appends arguments: `git` may become `git push`.
        assert_eq!(c.check(&argv(&["xargs", "git"])).verdict, Verdict::Ask);
        assert_eq!(
            c.check(&argv(&["find", ".", "-exec", "git", "{}", "+"]))
                .verdict,
            Verdict::Ask
        );
        // `command -v git` only looks git up.
        let strict = rules(&["git"], &[], &[], Verdict::Allow);
        assert_eq!(
            strict.check(&argv(&["command", "-v", "git"])).verdict,
            Verdict::Allow
        );
        // What cannot be unwrapped is asked about.
        for cmd in [
            argv(&["env", "-S", "git push"]),
            argv(&["timeout", "--frobnicate", "git", "push"]),
            argv(&["sh", "-c", "$SCRIPT"]),
            argv(&["sh"]),
            argv(&["bash", "-s"]),
            argv(&["eval", "$X"]),
            argv(&["sh", "-c", "alias g=git; g push"]),
        ] {
            let r = c.check(&cmd);
            assert_eq!(r.verdict, Verdict::Ask, "{cmd:?}: {r:?}");
        }
        assert_eq!(c.check(&sh("echo 'git push' | sh")).verdict, Verdict::Ask);
        assert_eq!(
            c.check(&argv(&["bash", "script.sh"])).verdict,
            Verdict::Allow
        );
        assert_eq!(c.check(&sh(". ./env.sh && ls")).verdict, Verdict::Allow);
        for cmd in [
            "bash <(echo git push)",
            "source <(echo git push)",
            ". \"$F\"",
            "sh -e $SCRIPT",
        ] {
            assert_eq!(c.check(&sh(cmd)).verdict, Verdict::Ask, "{cmd}");
        }
    }

    #[test]
    fn transparent_wrappers_do_not_take_the_default() {
        let c = rules(&[], &[], &["cargo", "ls"], Verdict::Forbid);
        assert_eq!(c.check(&sh("cargo build && ls")).verdict, Verdict::Allow);
        assert_eq!(
            c.check(&argv(&["env", "A=1", "timeout", "5", "cargo", "test"]))
                .verdict,
            Verdict::Allow
        );
        assert_eq!(c.check(&sh("cargo build; make")).verdict, Verdict::Forbid);
        // Rules that name a wrapper still apply to it.
        let c = rules(&["sudo"], &["xargs"], &[], Verdict::Allow);
        assert_eq!(c.check(&argv(&["sudo", "ls"])).verdict, Verdict::Forbid);
        assert_eq!(c.check(&sh("ls | xargs echo")).verdict, Verdict::Ask);
    }

    #[test]
    fn unparseable_is_ask_but_a_sure_forbid_still_forbids() {
        let c = guard();
        for cmd in [
            "echo 'unclosed",
            "echo $(",
            "cat <<EOF\n$(date)\nEOF",
            "for ((i=0;i<2;i++)); do :; done",
            "echo ${x:-$(id)}",
        ] {
            let r = c.check(&sh(cmd));
            assert_eq!(r.verdict, Verdict::Ask, "{cmd:?}: {r:?}");
            assert!(r.reason.contains("cannot analyse"), "{r:?}");
            assert_eq!(r.rule, None);
        }
        assert_eq!(verdict(&c, "git push; echo 'unclosed"), Verdict::Forbid);
        // With default = forbid, what cannot be analysed still asks.
        let c = rules(&[], &[], &["echo"], Verdict::Forbid);
        assert_eq!(verdict(&c, "echo 'unclosed"), Verdict::Ask);
        assert_eq!(verdict(&c, "make; echo 'unclosed"), Verdict::Forbid);
        assert_eq!(verdict(&c, "X=1"), Verdict::Allow, "runs nothing");
    }

    #[test]
    fn messages_name_the_command_and_rule() {
        let c = guard();
        let r = c.check(&sh("cd repo && git push origin main"));
        assert_eq!(r.command, "git push origin main");
        assert_eq!(r.rule.as_deref(), Some("forbid \"git push\""));
        assert_eq!(r.reason, "it matches the rule forbid \"git push\"");
        let r = c.check(&sh("$(echo git) push"));
        assert_eq!(r.command, "<?> push");
        assert_eq!(display_argv(&argv(&["a b", "c"])), "'a b' c");
        assert_eq!(display_argv(&sh("x && y")), "x && y");
    }

    #[test]
    fn explain_lists_the_rules() {
        let mut text = String::new();
        guard().explain(&mut |l| {
            text.push_str(&l);
            text.push('\n');
        });
        assert!(
            text.contains("Refused without running: commands starting with git push, rm -rf /"),
            "{text}"
        );
        assert!(
            text.contains("after a person approves: commands starting with git commit"),
            "{text}"
        );
        assert!(text.contains("Any other command: allowed."), "{text}");
        assert!(text.contains("not a security boundary"), "{text}");
        assert!(text.contains("5m"), "{text}");
    }
}
