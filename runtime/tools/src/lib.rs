//! taskbox's model-facing tools: the one definition of each tool a model may call, used by the
//! MCP server (`taskbox-mcp`) and the agent (`taskbox-agent`) alike.
//!
//! A [`Tool`] has a name, a description and an input schema ([`Tool::input_schema`]). The
//! schema is derived with schemars from the request type of [`taskbox_contract::api`] the tool
//! fills, so the schema a model reads and the parser that checks its arguments cannot disagree.
//! What a tool adds to its request type is written once, in this file's table (`Tool::def`): its
//! description, the model-facing default and maximum of a field that bounds how much comes back,
//! a field's description where the API's speaks to API clients, the fields not offered (exec's
//! `background`), and an older field name still accepted (exec's `command`). [`Tool::parse`]
//! turns a call's arguments into a [`Call`] that holds the API request, or an [`ArgsError`] that
//! names the tool and the field; [`render`] turns each operation's result into the text a model
//! reads.
//!
//! Two groups: [`SANDBOX_TOOLS`], the narrow API's operations, which both surfaces offer; and
//! [`HARNESS_TOOLS`] (`plan`, `finish`), which only a harness with a work contract and a
//! verification gate can answer: the agent offers them, the MCP server does not. The surfaces
//! keep only their transport: MCP's annotations and tool results, the agent's tool specs and the
//! loop that runs a [`Call`].

use std::sync::LazyLock;

use serde_json::{Map, Value};

mod call;
pub mod render;
mod schema;

pub use call::{ArgsError, Call, SubtaskArgs, parse_call};

/// A JSON object: a tool's input schema or its arguments.
pub type JsonObject = Map<String, Value>;

/// Bytes of each output stream an exec keeps (head and tail) unless the model asks otherwise.
pub const EXEC_OUTPUT_LIMIT: u64 = 8 * 1024;
/// The most an exec call may ask to keep of each stream; the whole stream is spilled anyway.
pub const EXEC_OUTPUT_MAX: u64 = 64 * 1024;
/// Bytes a read returns unless the model asks otherwise.
pub const READ_LIMIT: u64 = 32 * 1024;
/// The most a read call may ask for.
pub const READ_MAX: u64 = 256 * 1024;
/// Entries a list returns unless the model asks otherwise.
pub const LIST_LIMIT: u64 = 300;
/// The most a list call may ask for.
pub const LIST_MAX: u64 = 1000;
/// Matches a search returns unless the model asks otherwise.
pub const SEARCH_LIMIT: u64 = 100;
/// The most a search call may ask for.
pub const SEARCH_MAX: u64 = 1000;
/// The most sandboxes one fork call may ask for.
pub const FORK_MAX: u64 = 8;

/// A model-facing tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tool {
    Exec,
    ReadFile,
    WriteFile,
    EditFile,
    ApplyPatch,
    List,
    Search,
    Diff,
    Fork,
    Plan,
    Finish,
    Subtask,
}

/// The narrow API's operations on one sandbox, in the order they are listed.
pub const SANDBOX_TOOLS: [Tool; 8] = [
    Tool::Exec,
    Tool::ReadFile,
    Tool::WriteFile,
    Tool::EditFile,
    Tool::ApplyPatch,
    Tool::List,
    Tool::Search,
    Tool::Diff,
];

/// The tools over a session's set of sandboxes: `fork` makes more, which the sandbox tools then
/// name. The MCP server offers them (its tools take a `sandbox` argument); the agent forks
/// through its own attempts and sub-tasks instead.
pub const SESSION_TOOLS: [Tool; 1] = [Tool::Fork];

/// The tools only a harness answers: a plan for the contract, and the claim of being done that
/// runs the verification gate.
pub const HARNESS_TOOLS: [Tool; 2] = [Tool::Plan, Tool::Finish];

/// The tools of a harness that can run sub-agents: `subtask` hands a sub-goal to one, in a fork.
/// The agent offers it when it can build models for sub-agents.
pub const DELEGATION_TOOLS: [Tool; 1] = [Tool::Subtask];

/// What calling a tool does (MCP clients show it as annotations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Reads the sandbox, changes nothing.
    ReadOnly,
    /// Changes the sandbox; `idempotent` when the same call twice leaves what one leaves.
    Writes { idempotent: bool },
    /// Speaks to the harness, not to the sandbox.
    Harness,
}

/// The names of `tools`, in their order (for constants such as MCP's tool names).
pub const fn names<const N: usize>(tools: [Tool; N]) -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = tools[i].name();
        i += 1;
    }
    out
}

/// A value a tool takes for a field the model left out (or sent as null).
#[derive(Debug, Clone, Copy)]
enum Preset {
    Bool(bool),
    Int(u64),
}

impl Preset {
    fn value(self) -> Value {
        match self {
            Preset::Bool(b) => Value::Bool(b),
            Preset::Int(n) => Value::from(n),
        }
    }
}

/// What a tool changes of one field of its request type.
#[derive(Debug, Clone, Copy)]
struct Field {
    name: &'static str,
    /// Replaces the API's description (which speaks to API clients, or is missing).
    doc: Option<&'static str>,
    default: Option<Preset>,
    /// The largest value accepted (a larger one is refused, naming the field).
    max: Option<u64>,
}

const fn doc(name: &'static str, doc: &'static str) -> Field {
    Field {
        name,
        doc: Some(doc),
        default: None,
        max: None,
    }
}

const fn bounded(name: &'static str, doc: &'static str, default: u64, max: u64) -> Field {
    Field {
        name,
        doc: Some(doc),
        default: Some(Preset::Int(default)),
        max: Some(max),
    }
}

/// A field of the request type that the tool does not offer, and what to do instead.
#[derive(Debug, Clone, Copy)]
struct Hidden {
    name: &'static str,
    why: &'static str,
}

/// An older name of a field, still accepted (never listed in the schema).
#[derive(Debug, Clone, Copy)]
struct Alias {
    old: &'static str,
    new: &'static str,
}

/// One tool's definition beyond its request type.
#[derive(Debug, Clone, Copy)]
struct Def {
    description: &'static str,
    effect: Effect,
    fields: &'static [Field],
    hidden: &'static [Hidden],
    aliases: &'static [Alias],
}

const PATH_DOC: &str =
    "Relative to the workspace root (an absolute path inside the sandbox works too).";

impl Tool {
    /// Every tool: the sandbox tools, the session tools, the harness tools, then the
    /// delegation tools.
    pub const ALL: [Tool; 12] = {
        let mut all = [Tool::Exec; 12];
        let (s, f, h) = (
            SANDBOX_TOOLS.len(),
            SESSION_TOOLS.len(),
            HARNESS_TOOLS.len(),
        );
        let mut i = 0;
        while i < all.len() {
            all[i] = if i < s {
                SANDBOX_TOOLS[i]
            } else if i < s + f {
                SESSION_TOOLS[i - s]
            } else if i < s + f + h {
                HARNESS_TOOLS[i - s - f]
            } else {
                DELEGATION_TOOLS[i - s - f - h]
            };
            i += 1;
        }
        all
    };

    /// The name a model calls it by (the names are the contract).
    pub const fn name(self) -> &'static str {
        match self {
            Tool::Exec => "exec",
            Tool::ReadFile => "read_file",
            Tool::WriteFile => "write_file",
            Tool::EditFile => "edit_file",
            Tool::ApplyPatch => "apply_patch",
            Tool::List => "list",
            Tool::Search => "search",
            Tool::Diff => "diff",
            Tool::Fork => "fork",
            Tool::Plan => "plan",
            Tool::Finish => "finish",
            Tool::Subtask => "subtask",
        }
    }

    /// The tool of that name, if there is one.
    pub fn named(name: &str) -> Option<Tool> {
        Tool::ALL.into_iter().find(|t| t.name() == name)
    }

    /// What the model reads about the tool.
    pub fn description(self) -> &'static str {
        self.def().description
    }

    pub fn effect(self) -> Effect {
        self.def().effect
    }

    /// The tool's input schema: a JSON schema of an object, without unknown fields.
    pub fn input_schema(self) -> &'static JsonObject {
        static SCHEMAS: LazyLock<Vec<JsonObject>> =
            LazyLock::new(|| Tool::ALL.into_iter().map(schema::build).collect());
        &SCHEMAS[self as usize]
    }

    /// Parses a call's arguments (a JSON object) into the operation they ask for.
    pub fn parse(self, args: Value) -> Result<Call, ArgsError> {
        call::parse(self, args)
    }

    fn def(self) -> Def {
        match self {
            Tool::Exec => Def {
                description: "Run a command in the sandbox and wait for it to finish. Give either \
                    `shell` (a /bin/sh -c command line) or `argv` (program and arguments). It runs \
                    in the workspace root unless `cwd` is given. Returns the exit status, the head \
                    and tail of stdout and stderr (when cut, the path of the whole stream, readable \
                    with read_file), the workspace files it changed, and anything the policy \
                    refused. Files in the workspace and /tmp persist across calls; processes do \
                    not outlive the call. A command the policy's command rules forbid is not run \
                    (a `command` violation says why); one they ask about waits for approval, and a \
                    denial comes back with its reason.",
                effect: Effect::Writes { idempotent: false },
                fields: const {
                    &[
                        doc(
                            "shell",
                            "A shell command line, run with /bin/sh -c. Give this or argv.",
                        ),
                        doc(
                            "argv",
                            "The program and its arguments, run without a shell. Give this or shell.",
                        ),
                        doc(
                            "env",
                            "Environment variables for this command, over the sandbox's own.",
                        ),
                        doc(
                            "stdin",
                            "Text given on standard input (then closed); without it stdin is empty.",
                        ),
                        doc(
                            "timeout_ms",
                            "Wall-clock limit in milliseconds; when it passes the whole process tree \
                         is killed (default: the session's limit).",
                        ),
                        bounded(
                            "output_limit",
                            "Bytes of each output stream shown, as head and tail (default 8 KiB, at \
                         most 64 KiB); a stream cut to fit is whole in the file the result names.",
                            EXEC_OUTPUT_LIMIT,
                            EXEC_OUTPUT_MAX,
                        ),
                    ]
                },
                // Background processes would need tools of their own (wait, write stdin, kill)
                // to be of use to a model.
                hidden: &[Hidden {
                    name: "background",
                    why: "exec always waits for the command (use timeout_ms to bound it)",
                }],
                // The agent's exec called the command line `command`; recorded trajectories
                // replay their calls, and `taskbox agent replay` must still parse them.
                aliases: &[Alias {
                    old: "command",
                    new: "shell",
                }],
            },
            Tool::ReadFile => Def {
                description: "Read a file; `path` is relative to the workspace root. Optionally \
                    a 1-based inclusive line range (`line_start`, `line_end`) or a byte range \
                    (`offset`, `length`); at most `max_bytes` (default 32 KiB) come back, binary \
                    content base64-encoded. A cut read says how to read on.",
                effect: Effect::ReadOnly,
                fields: const {
                    &[
                        doc("path", PATH_DOC),
                        doc(
                            "line_start",
                            "First line, 1-based (with line_end: an inclusive line range).",
                        ),
                        doc("line_end", "Last line, inclusive."),
                        doc(
                            "offset",
                            "First byte of a byte range (instead of a line range).",
                        ),
                        doc("length", "Bytes of the byte range."),
                        bounded(
                            "max_bytes",
                            "Cap on the bytes returned (default 32 KiB, at most 256 KiB).",
                            READ_LIMIT,
                            READ_MAX,
                        ),
                    ]
                },
                hidden: &[],
                aliases: &[],
            },
            Tool::WriteFile => Def {
                description: "Create or replace a file with `content` (written atomically); \
                    `path` is relative to the workspace root. Missing parent directories are \
                    created unless `create_parents` is false.",
                effect: Effect::Writes { idempotent: true },
                fields: const {
                    &[
                        doc("path", PATH_DOC),
                        doc("content", "The whole new content."),
                        Field {
                            name: "create_parents",
                            doc: Some("Create missing parent directories (default true)."),
                            default: Some(Preset::Bool(true)),
                            max: None,
                        },
                    ]
                },
                hidden: &[],
                aliases: &[],
            },
            Tool::EditFile => Def {
                description: "Replace exact text in a file: `old` must occur exactly once (or \
                    exactly `expected_count` times, all replaced) and becomes `new`; `path` is \
                    relative to the workspace root. Returns the edit's unified diff. When `old` \
                    is missing or occurs more often, nothing changes and the error says where it \
                    occurs: add surrounding lines to `old` to make it unique.",
                effect: Effect::Writes { idempotent: false },
                fields: const {
                    &[
                        doc("path", PATH_DOC),
                        doc("old", "The exact text to replace."),
                        doc("new", "The text that replaces it."),
                    ]
                },
                hidden: &[],
                aliases: &[],
            },
            Tool::ApplyPatch => Def {
                description: "Apply a unified diff (as `git diff` or `diff -u` write it) to the \
                    workspace, all or nothing. Paths in the patch are relative to the workspace \
                    root (git's a/ and b/ prefixes are understood).",
                effect: Effect::Writes { idempotent: false },
                fields: const { &[doc("patch", "The unified diff.")] },
                hidden: &[],
                aliases: &[],
            },
            Tool::List => Def {
                description: "List a directory of the workspace (`path` relative to the \
                    workspace root, default the root), skipping files ignored by .gitignore and \
                    dot files unless asked. A `glob` such as \"**/*.rs\" filters entries and \
                    searches recursively. Directories end with '/'.",
                effect: Effect::ReadOnly,
                fields: const {
                    &[bounded(
                        "limit",
                        "Cap on entries (default 300, at most 1000).",
                        LIST_LIMIT,
                        LIST_MAX,
                    )]
                },
                hidden: &[],
                aliases: &[],
            },
            Tool::Search => Def {
                description: "Search file contents for a regular expression (Rust regex syntax) \
                    under `path` (relative to the workspace root, default the root), skipping \
                    files ignored by .gitignore; `glob` restricts which files are searched. \
                    Returns matching lines as path:line: text.",
                effect: Effect::ReadOnly,
                fields: const {
                    &[
                        doc("case_insensitive", "Ignore case."),
                        doc("include_ignored", "Search files ignored by .gitignore too."),
                        doc("include_hidden", "Search dot files too."),
                        bounded(
                            "max_matches",
                            "Cap on matches (default 100, at most 1000).",
                            SEARCH_LIMIT,
                            SEARCH_MAX,
                        ),
                    ]
                },
                hidden: &[],
                aliases: &[],
            },
            Tool::Diff => Def {
                description: "Show what changed in the workspace since the sandbox was created \
                    (or since the checkpoint named in `since`): each file's status, line stats \
                    and a unified diff. The host copy of the workspace is untouched until the \
                    change is exported.",
                effect: Effect::ReadOnly,
                fields: const { &[] },
                hidden: &[],
                aliases: &[],
            },
            Tool::Fork => Def {
                description: "Fork the sandbox: `count` new sandboxes, each starting from its \
                    workspace and /tmp as they are now (no process is copied), to try \
                    alternatives side by side. Returns their ids: give one as `sandbox` to the \
                    other tools to work in it. What you do in one fork is seen in no other \
                    sandbox. Forks end with the session.",
                effect: Effect::Writes { idempotent: false },
                fields: const {
                    &[Field {
                        name: "count",
                        doc: Some("How many sandboxes (default 1, at most 8 per call)."),
                        default: Some(Preset::Int(1)),
                        max: Some(FORK_MAX),
                    }]
                },
                hidden: &[
                    Hidden {
                        name: "checkpoint",
                        why: "a fork starts from the sandbox as it is now",
                    },
                    Hidden {
                        name: "ttl_secs",
                        why: "a fork lives as long as the session",
                    },
                    Hidden {
                        name: "labels",
                        why: "forks are told apart by their ids",
                    },
                ],
                aliases: &[],
            },
            Tool::Plan => Def {
                description: "Submit your plan: the steps and the files you expect to change. \
                    Required before the first edit when the contract asks for a plan.",
                effect: Effect::Harness,
                fields: const { &[] },
                hidden: &[],
                aliases: &[],
            },
            Tool::Subtask => Def {
                description: "Hand a sub-goal to a sub-agent. It works in a fork of the sandbox \
                    taken at the start of this turn, within its own `scope` (paths it may change, \
                    inside yours) and budget (`max_turns`), and must pass the verification \
                    commands (`verify`, default the contract's) before its change counts. Its \
                    verified change is then merged into your workspace, at the end of this turn: \
                    three-way against your own changes made meanwhile; when both change the same \
                    lines, nothing of it is applied and the conflicting files and hunks come \
                    back. Several subtask calls in one answer run side by side.",
                effect: Effect::Harness,
                fields: const { &[] },
                hidden: &[],
                aliases: &[],
            },
            Tool::Finish => Def {
                description: "Say you are done. The harness then runs the contract's \
                    verification commands; the task completes only if they pass, otherwise you \
                    get their output and continue.",
                effect: Effect::Harness,
                fields: const { &[] },
                hidden: &[],
                aliases: &[],
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_groups_make_up_every_tool_and_names_are_unique() {
        let joined: Vec<Tool> = SANDBOX_TOOLS
            .into_iter()
            .chain(SESSION_TOOLS)
            .chain(HARNESS_TOOLS)
            .chain(DELEGATION_TOOLS)
            .collect();
        assert_eq!(joined, Tool::ALL);
        for (i, t) in Tool::ALL.into_iter().enumerate() {
            assert_eq!(t as usize, i, "ALL is in declaration order");
            assert_eq!(Tool::named(t.name()), Some(t));
        }
        assert_eq!(Tool::named("rm"), None);
        assert_eq!(
            names(SANDBOX_TOOLS),
            [
                "exec",
                "read_file",
                "write_file",
                "edit_file",
                "apply_patch",
                "list",
                "search",
                "diff"
            ]
        );
    }

    #[test]
    fn only_the_harness_tools_speak_to_the_harness() {
        for t in Tool::ALL {
            assert_eq!(
                t.effect() == Effect::Harness,
                HARNESS_TOOLS.contains(&t) || DELEGATION_TOOLS.contains(&t),
                "{t:?}"
            );
        }
    }

    #[test]
    fn every_rule_names_a_field_of_its_request_type() {
        for t in Tool::ALL {
            let def = t.def();
            let props = t.input_schema()["properties"].as_object().unwrap();
            let derived = schema::derived(t);
            for f in def.fields {
                assert!(props.contains_key(f.name), "{t:?}: no field {}", f.name);
            }
            for h in def.hidden {
                assert!(
                    derived["properties"].get(h.name).is_some(),
                    "{t:?}: the API has no field {}",
                    h.name
                );
                assert!(!props.contains_key(h.name), "{t:?}: {} is listed", h.name);
            }
            for a in def.aliases {
                assert!(props.contains_key(a.new), "{t:?}: no field {}", a.new);
                assert!(!props.contains_key(a.old), "{t:?}: {} is listed", a.old);
            }
        }
    }
}
