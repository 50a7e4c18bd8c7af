//! Image definitions: `images/NAME.toml`.
//!
//! ```toml
//! description = "a static busybox"      # optional, shown by `image ls`
//! epoch = 1704067200                    # optional: SOURCE_DATE_EPOCH of every layer
//!
//! [base.scratch]                        # or [base.debian]: suite, packages, variant
//! files = [{ host = "/bin/busybox", path = "/bin/busybox" }]
//!
//! [[step]]                              # one layer per step; each step has one action:
//! copy = [{ src = "files/passwd", dst = "/etc/passwd", mode = 0o644 }]
//! # symlinks = [{ target = "busybox", paths = ["/bin/sh", "/bin/ls"] }]
//! # mkdir = [{ path = "/home/dev", owner = "1000:1000", mode = 0o755 }]
//! # user = { name = "dev", uid = 1000, gid = 1000, home = "/home/dev", shell = "/bin/bash" }
//! # run = "make install" (through the config's shell; or an argv array), policy = "default", env = {}
//!
//! [config]
//! env = { LANG = "C.UTF-8" }
//! workdir = "/workspace"
//! user = "1000:1000"
//! shell = ["/bin/sh", "-c"]
//! ```
//!
//! Unknown keys are errors; every error names the file, the key and why. Paths inside the image
//! are absolute and plain (no `.`, `..` or empty components, nothing named `.wh.*`); copy sources
//! are relative to the definition's directory and may not leave it.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use taskbox_core::policy;

/// The default `SOURCE_DATE_EPOCH` of an image: 2024-01-01T00:00:00Z.
pub const DEFAULT_EPOCH: u64 = 1_704_067_200;
/// The default PATH of an image's commands.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The default mmdebstrap variant of a Debian base.
pub const DEFAULT_VARIANT: &str = "apt";

/// Why a definition could not be loaded. Each message is one line naming the file and, where
/// there is one, the key.
#[derive(Debug, thiserror::Error)]
pub enum DefError {
    /// The file could not be read.
    #[error("cannot read image definition {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    /// The file is not valid TOML.
    #[error("{origin}:{line}:{column}: invalid toml: {message}")]
    Syntax {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// A key is unknown, has the wrong type, or a value the builder cannot accept.
    #[error("{origin}: {key}: {reason}")]
    Invalid {
        origin: String,
        key: String,
        reason: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDef {
    description: Option<String>,
    epoch: Option<u64>,
    base: RawBase,
    #[serde(default)]
    step: Vec<RawStep>,
    #[serde(default)]
    config: RawConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBase {
    scratch: Option<Scratch>,
    debian: Option<Debian>,
}

/// An empty base plus files from the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scratch {
    #[serde(default)]
    pub files: Vec<HostFile>,
}

/// A host file placed in a scratch base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFile {
    /// Absolute path on the host (symlinks are followed: the file's content is copied).
    pub host: String,
    /// Absolute path in the image.
    pub path: String,
    /// Permission bits; default 0755 when the host file is executable by its owner, else 0644.
    pub mode: Option<u32>,
}

/// A Debian base built by mmdebstrap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Debian {
    pub suite: String,
    #[serde(default)]
    pub packages: Vec<String>,
    /// mmdebstrap's `--variant` (default `apt`: the essential packages plus apt).
    pub variant: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    copy: Option<Vec<CopyItem>>,
    symlinks: Option<Vec<SymlinkItem>>,
    mkdir: Option<Vec<MkdirItem>>,
    user: Option<UserItem>,
    run: Option<RunCmd>,
    policy: Option<String>,
    env: Option<BTreeMap<String, String>>,
}

/// A file or directory copied from the definition's directory into the image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyItem {
    /// Relative to the definition's directory; a directory is copied with all it holds.
    pub src: String,
    /// Absolute path in the image.
    pub dst: String,
    /// Permission bits of files; default 0755 for files executable by their owner, else 0644
    /// (the only distinction git keeps). Directories are 0755.
    pub mode: Option<u32>,
    /// `UID:GID` of what is copied; default `0:0`.
    pub owner: Option<String>,
}

/// Symlinks to one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SymlinkItem {
    pub target: String,
    pub paths: Vec<String>,
}

/// A directory to create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirItem {
    pub path: String,
    /// Default 0755.
    pub mode: Option<u32>,
    /// `UID:GID`, default `0:0`.
    pub owner: Option<String>,
}

/// A user (and its group) added to /etc/passwd and /etc/group, with a home directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserItem {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Default `/home/NAME`.
    pub home: Option<String>,
    /// Default `/bin/sh`.
    pub shell: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum RunCmd {
    Shell(String),
    Argv(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    env: Option<BTreeMap<String, String>>,
    workdir: Option<String>,
    user: Option<String>,
    shell: Option<Vec<String>>,
}

/// A parsed and checked image definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDef {
    /// The file's stem: the name the image is stored under.
    pub name: String,
    /// The definition file.
    pub path: PathBuf,
    /// The directory copy sources are relative to (the definition's directory).
    pub context: PathBuf,
    pub description: Option<String>,
    pub epoch: u64,
    pub base: Base,
    pub steps: Vec<Step>,
    pub config: Config,
}

/// Where an image starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Base {
    Scratch(Scratch),
    Debian(Debian),
}

/// One step: one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    Copy(Vec<CopyItem>),
    Symlinks(Vec<SymlinkItem>),
    Mkdir(Vec<MkdirItem>),
    User(UserItem),
    Run(RunStep),
}

/// A command run in a native sandbox whose root is the image so far, writable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunStep {
    pub argv: Vec<String>,
    /// A policy name or a path relative to the definition's directory.
    pub policy: String,
    pub env: BTreeMap<String, String>,
}

/// How the image's commands run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Sorted by name; PATH defaults to [`DEFAULT_PATH`].
    pub env: Vec<(String, String)>,
    pub workdir: String,
    /// Numeric `UID:GID`.
    pub user: Option<String>,
    pub shell: Vec<String>,
}

impl Step {
    /// A one-line description (the image history's `created_by`).
    pub fn describe(&self) -> String {
        match self {
            Step::Copy(items) => {
                let parts: Vec<String> = items
                    .iter()
                    .map(|c| format!("{} -> {}", c.src, c.dst))
                    .collect();
                format!("copy {}", parts.join(", "))
            }
            Step::Symlinks(items) => {
                let n: usize = items.iter().map(|s| s.paths.len()).sum();
                let targets: Vec<&str> = items.iter().map(|s| s.target.as_str()).collect();
                format!("symlinks: {n} links to {}", targets.join(", "))
            }
            Step::Mkdir(items) => {
                let parts: Vec<&str> = items.iter().map(|m| m.path.as_str()).collect();
                format!("mkdir {}", parts.join(" "))
            }
            Step::User(u) => format!("user {} ({}:{})", u.name, u.uid, u.gid),
            Step::Run(r) => format!("run {} (policy {})", shell_words(&r.argv), r.policy),
        }
    }
}

impl Base {
    pub fn describe(&self) -> String {
        match self {
            Base::Scratch(s) => {
                let files: Vec<&str> = s.files.iter().map(|f| f.path.as_str()).collect();
                if files.is_empty() {
                    "base scratch".into()
                } else {
                    format!("base scratch with {}", files.join(" "))
                }
            }
            Base::Debian(d) => format!(
                "base debian {} ({} variant{}{})",
                d.suite,
                d.variant.as_deref().unwrap_or(DEFAULT_VARIANT),
                if d.packages.is_empty() { "" } else { " + " },
                d.packages.join(" ")
            ),
        }
    }
}

fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether `name` can name an image: `[a-z0-9][a-z0-9._-]*`, at most 64 characters.
pub fn is_valid_name(name: &str) -> bool {
    name.len() <= 64
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

/// Loads and checks the definition at `path`.
pub fn load(path: &Path) -> Result<ImageDef, DefError> {
    let text = fs::read_to_string(path).map_err(|source| DefError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let path = fs::canonicalize(path).map_err(|source| DefError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, &path)
}

/// Parses and checks a definition whose file is `path` (named in errors; its directory is the
/// copy context and its stem the image name).
pub fn parse(text: &str, path: &Path) -> Result<ImageDef, DefError> {
    let origin = path.display().to_string();
    let invalid = |key: &str, reason: String| DefError::Invalid {
        origin: origin.clone(),
        key: key.to_owned(),
        reason,
    };
    if let Err(err) = text.parse::<toml::Table>() {
        let (line, column) = err
            .span()
            .map(|span| policy::line_column(text, span.start))
            .unwrap_or((1, 1));
        return Err(DefError::Syntax {
            origin,
            line,
            column,
            message: policy::one_line(err.message()),
        });
    }
    let raw: RawDef =
        serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|err| {
            let key = policy::dotted_path(err.path());
            let (key, reason) = explain_de_error(key, err.inner().message());
            invalid(&key, reason)
        })?;

    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !is_valid_name(&name) {
        return Err(invalid(
            "(file name)",
            format!(
                "{name:?} cannot name an image: use a-z, 0-9, '.', '_' and '-' (starting with a \
                 letter or digit), at most 64 characters"
            ),
        ));
    }
    if path.extension().and_then(|e| e.to_str()) != Some("toml") {
        return Err(invalid(
            "(file name)",
            "a definition file ends in .toml".into(),
        ));
    }
    let context = path.parent().unwrap_or(Path::new("/")).to_path_buf();

    let base = match (raw.base.scratch, raw.base.debian) {
        (Some(s), None) => {
            for (i, f) in s.files.iter().enumerate() {
                let key = format!("base.scratch.files[{i}]");
                if !f.host.starts_with('/') {
                    return Err(invalid(
                        &format!("{key}.host"),
                        format!("{:?}: host files are named by absolute path", f.host),
                    ));
                }
                if !Path::new(&f.host).is_file() {
                    return Err(invalid(
                        &format!("{key}.host"),
                        format!("{}: no such file on this host", f.host),
                    ));
                }
                image_path(&f.path).map_err(|why| invalid(&format!("{key}.path"), why))?;
                check_mode(f.mode).map_err(|why| invalid(&format!("{key}.mode"), why))?;
            }
            Base::Scratch(s)
        }
        (None, Some(d)) => {
            if !is_debian_word(&d.suite) {
                return Err(invalid(
                    "base.debian.suite",
                    format!("{:?} is not a suite name (e.g. \"bookworm\")", d.suite),
                ));
            }
            for (i, p) in d.packages.iter().enumerate() {
                if !is_package_name(p) {
                    return Err(invalid(
                        &format!("base.debian.packages[{i}]"),
                        format!(
                            "{p:?} is not a Debian package name (versions are pinned by the lock, not here)"
                        ),
                    ));
                }
            }
            if let Some(v) = &d.variant
                && ![
                    "essential",
                    "apt",
                    "required",
                    "minbase",
                    "buildd",
                    "important",
                    "standard",
                ]
                .contains(&v.as_str())
            {
                return Err(invalid(
                    "base.debian.variant",
                    format!(
                        "invalid value {v:?} (expected one of essential, apt, required, minbase, \
                         buildd, important, standard)"
                    ),
                ));
            }
            Base::Debian(d)
        }
        (Some(_), Some(_)) => {
            return Err(invalid(
                "base",
                "give either [base.scratch] or [base.debian], not both".into(),
            ));
        }
        (None, None) => {
            return Err(invalid(
                "base",
                "missing: give [base.scratch] (with optional host files) or [base.debian]".into(),
            ));
        }
    };

    let c = raw.config;
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    for (k, v) in c.env.unwrap_or_default() {
        if !is_var_name(&k) {
            return Err(invalid(
                &format!("config.env.{k}"),
                "invalid variable name".into(),
            ));
        }
        env.insert(k, v);
    }
    let workdir = c
        .workdir
        .unwrap_or_else(|| taskbox_core::image::DEFAULT_WORKDIR.to_owned());
    image_path(&workdir).map_err(|why| invalid("config.workdir", why))?;
    if let Some(u) = &c.user {
        parse_owner(u).map_err(|why| invalid("config.user", why))?;
    }
    let shell = c
        .shell
        .unwrap_or_else(|| vec!["/bin/sh".into(), "-c".into()]);
    if shell.first().is_none_or(|s| !s.starts_with('/')) {
        return Err(invalid(
            "config.shell",
            "expected the shell's absolute path and its arguments, e.g. [\"/bin/sh\", \"-c\"]"
                .into(),
        ));
    }
    let mut steps = Vec::new();
    for (i, s) in raw.step.into_iter().enumerate() {
        steps.push(check_step(s, i, &context, &shell).map_err(|(key, why)| invalid(&key, why))?);
    }
    Ok(ImageDef {
        name,
        path: path.to_path_buf(),
        context,
        description: raw.description,
        epoch: raw.epoch.unwrap_or(DEFAULT_EPOCH),
        base,
        steps,
        config: Config {
            env: env.into_iter().collect(),
            workdir,
            user: c.user,
            shell,
        },
    })
}

fn check_step(
    s: RawStep,
    i: usize,
    context: &Path,
    shell: &[String],
) -> Result<Step, (String, String)> {
    let key = |k: &str| format!("step[{i}].{k}");
    let err = |k: &str, why: String| (key(k), why);
    let mut actions = Vec::new();
    for (name, set) in [
        ("copy", s.copy.is_some()),
        ("symlinks", s.symlinks.is_some()),
        ("mkdir", s.mkdir.is_some()),
        ("user", s.user.is_some()),
        ("run", s.run.is_some()),
    ] {
        if set {
            actions.push(name);
        }
    }
    if actions.len() != 1 {
        return Err((
            format!("step[{i}]"),
            if actions.is_empty() {
                "a step needs one action: copy, symlinks, mkdir, user or run".into()
            } else {
                format!(
                    "a step has one action, this one has {} (split it into several steps)",
                    actions.join(" and ")
                )
            },
        ));
    }
    if s.run.is_none() {
        if s.policy.is_some() {
            return Err(err("policy", "only a run step has a policy".into()));
        }
        if s.env.is_some() {
            return Err(err("env", "only a run step has env".into()));
        }
    }
    if let Some(items) = s.copy {
        if items.is_empty() {
            return Err(err("copy", "nothing to copy".into()));
        }
        for (j, c) in items.iter().enumerate() {
            let k = |f: &str| key(&format!("copy[{j}].{f}"));
            check_source(&c.src, context).map_err(|why| (k("src"), why))?;
            image_path(&c.dst).map_err(|why| (k("dst"), why))?;
            check_mode(c.mode).map_err(|why| (k("mode"), why))?;
            if let Some(o) = &c.owner {
                parse_owner(o).map_err(|why| (k("owner"), why))?;
            }
        }
        return Ok(Step::Copy(items));
    }
    if let Some(items) = s.symlinks {
        for (j, l) in items.iter().enumerate() {
            let k = |f: &str| key(&format!("symlinks[{j}].{f}"));
            if l.target.is_empty() || l.target.contains('\0') {
                return Err((k("target"), "empty or invalid symlink target".into()));
            }
            if l.paths.is_empty() {
                return Err((k("paths"), "no symlinks listed".into()));
            }
            for (n, p) in l.paths.iter().enumerate() {
                image_path(p).map_err(|why| (k(&format!("paths[{n}]")), why))?;
            }
        }
        return Ok(Step::Symlinks(items));
    }
    if let Some(items) = s.mkdir {
        for (j, m) in items.iter().enumerate() {
            let k = |f: &str| key(&format!("mkdir[{j}].{f}"));
            image_path(&m.path).map_err(|why| (k("path"), why))?;
            check_mode(m.mode).map_err(|why| (k("mode"), why))?;
            if let Some(o) = &m.owner {
                parse_owner(o).map_err(|why| (k("owner"), why))?;
            }
        }
        return Ok(Step::Mkdir(items));
    }
    if let Some(u) = s.user {
        let valid = !u.name.is_empty()
            && u.name.len() <= 32
            && u.name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-".contains(&b))
            && !u.name.starts_with('-');
        if !valid {
            return Err(err(
                "user.name",
                format!("{:?}: user names use a-z, 0-9, '_' and '-'", u.name),
            ));
        }
        if let Some(h) = &u.home {
            image_path(h).map_err(|why| err("user.home", why))?;
        }
        if let Some(sh) = &u.shell
            && (!sh.starts_with('/') || sh.contains([':', '\n']))
        {
            return Err(err(
                "user.shell",
                format!("{sh:?}: expected an absolute path"),
            ));
        }
        return Ok(Step::User(u));
    }
    let argv = match s.run {
        Some(RunCmd::Argv(argv)) => argv,
        // A string runs through the image's shell.
        Some(RunCmd::Shell(cmd)) => shell.iter().cloned().chain([cmd]).collect(),
        None => return Err((format!("step[{i}]"), "no action".into())),
    };
    if argv.is_empty() || argv[0].is_empty() {
        return Err(err("run", "empty command".into()));
    }
    let env = s.env.unwrap_or_default();
    for k in env.keys() {
        if !is_var_name(k) {
            return Err(err(&format!("env.{k}"), "invalid variable name".into()));
        }
    }
    let policy = s.policy.unwrap_or_else(|| "default".into());
    Ok(Step::Run(RunStep { argv, policy, env }))
}

/// Checks a copy source: relative, no `..`, existing, and (after symlinks) inside the context.
fn check_source(src: &str, context: &Path) -> Result<(), String> {
    let p = Path::new(src);
    if src.is_empty() || p.is_absolute() {
        return Err(format!(
            "{src:?}: copy sources are relative to the definition's directory"
        ));
    }
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(format!(
            "{src:?}: `..` is not allowed: sources stay inside the definition's directory"
        ));
    }
    let full = context.join(p);
    let real = fs::canonicalize(&full).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            format!("{src}: no such file or directory in {}", context.display())
        } else {
            format!("{src}: {e}")
        }
    })?;
    if !real.starts_with(context) {
        return Err(format!(
            "{src}: a symlink leads outside the definition's directory ({})",
            real.display()
        ));
    }
    Ok(())
}

/// Checks an absolute path inside the image and returns it relative (`etc/passwd`).
pub fn image_path(p: &str) -> Result<String, String> {
    let Some(rel) = p.strip_prefix('/') else {
        return Err(format!("{p:?}: paths in the image are absolute"));
    };
    if rel.is_empty() {
        return Err(format!(
            "{p:?}: the image's root itself cannot be named here"
        ));
    }
    if p.contains('\0') {
        return Err(format!("{p:?}: NUL byte in the path"));
    }
    let rel = rel.strip_suffix('/').unwrap_or(rel);
    for c in rel.split('/') {
        match c {
            "" => return Err(format!("{p:?}: empty path component")),
            "." | ".." => return Err(format!("{p:?}: `.` and `..` are not allowed")),
            c if c.starts_with(crate::layer::WHITEOUT_PREFIX) => {
                return Err(format!("{p:?}: names starting with .wh. are reserved"));
            }
            _ => {}
        }
    }
    Ok(rel.to_owned())
}

fn check_mode(mode: Option<u32>) -> Result<(), String> {
    match mode {
        Some(m) if m > 0o7777 => Err(format!(
            "{m:#o} is not a permission mode (write it in octal, e.g. 0o644)"
        )),
        _ => Ok(()),
    }
}

/// Parses `UID:GID` (numeric).
pub fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected numeric UID:GID, e.g. \"1000:1000\""))?;
    let parse = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("{s:?}: expected numeric UID:GID, e.g. \"1000:1000\""))
    };
    Ok((parse(u)?, parse(g)?))
}

fn is_var_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_debian_word(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
}

/// A Debian package name, optionally with `:arch`.
fn is_package_name(s: &str) -> bool {
    let (name, arch) = s.split_once(':').unwrap_or((s, "x"));
    name.len() >= 2
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b))
        && arch
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Policy's wording of serde's errors (the key and why, in one line), plus this file's one
/// ambiguous shape: a `run` command.
fn explain_de_error(key: String, message: &str) -> (String, String) {
    if message.contains("did not match any variant of untagged enum RunCmd") {
        return (
            key,
            "expected a command string (run by the config's shell) or an array of strings (argv)"
                .into(),
        );
    }
    policy::explain_de_error(key, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir(t.path().join("files")).unwrap();
        fs::write(t.path().join("files/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        t
    }

    fn parse_in(t: &tempfile::TempDir, text: &str) -> Result<ImageDef, DefError> {
        let dir = fs::canonicalize(t.path()).unwrap();
        parse(text, &dir.join("img.toml"))
    }

    #[test]
    fn a_full_definition_parses() {
        let t = ctx();
        let d = parse_in(
            &t,
            r#"
            description = "test"
            [base.scratch]
            files = [{ host = "/bin/sh", path = "/bin/sh" }]
            [[step]]
            copy = [{ src = "files/passwd", dst = "/etc/passwd", mode = 0o644 }]
            [[step]]
            symlinks = [{ target = "sh", paths = ["/bin/ash"] }]
            [[step]]
            run = "echo hi"
            policy = "default"
            [config]
            env = { LANG = "C.UTF-8" }
            user = "1000:1000"
            "#,
        )
        .unwrap();
        assert_eq!(d.name, "img");
        assert_eq!(d.epoch, DEFAULT_EPOCH);
        assert_eq!(d.steps.len(), 3);
        assert_eq!(d.config.workdir, "/workspace");
        assert_eq!(d.config.env[0].0, "LANG");
        assert_eq!(d.config.env[1], ("PATH".into(), DEFAULT_PATH.into()));
        assert!(matches!(&d.steps[2], Step::Run(r) if r.argv == ["/bin/sh", "-c", "echo hi"]));
    }

    #[test]
    fn errors_name_the_file_the_key_and_why() {
        let t = ctx();
        let cases = [
            ("[base.scratch]\nfoo = 1\n", "base.scratch.foo: unknown key"),
            ("bogus = 1\n[base.scratch]\n", "bogus: unknown key"),
            (
                "[base.scratch]\n[[step]]\ncopy = [{ src = \"files/nope\", dst = \"/x\" }]\n",
                "step[0].copy[0].src: files/nope: no such file",
            ),
            (
                "[base.scratch]\n[[step]]\ncopy = [{ src = \"../x\", dst = \"/x\" }]\n",
                "step[0].copy[0].src: \"../x\": `..` is not allowed",
            ),
            (
                "[base.scratch]\n[[step]]\ncopy = [{ src = \"files/passwd\", dst = \"etc\" }]\n",
                "step[0].copy[0].dst: \"etc\": paths in the image are absolute",
            ),
            (
                "[base.scratch]\n[[step]]\nmkdir = [{ path = \"/a/../b\" }]\n",
                "step[0].mkdir[0].path",
            ),
            (
                "[base.scratch]\n[[step]]\nrun = \"x\"\nmkdir = [{ path = \"/a\" }]\n",
                "step[0]: a step has one action",
            ),
            (
                "[base.scratch]\n[[step]]\nmkdir = [{ path = \"/a\" }]\npolicy = \"default\"\n",
                "step[0].policy: only a run step",
            ),
            (
                "[base.scratch]\n[[step]]\nrun = 5\n",
                "step[0].run: expected a command string",
            ),
            (
                "[base.scratch]\n[config]\nuser = \"dev\"\n",
                "config.user: \"dev\": expected numeric",
            ),
            (
                "[base.scratch]\nfiles = [{ host = \"/nonexistent\", path = \"/x\" }]\n",
                "base.scratch.files[0].host: /nonexistent: no such file",
            ),
            ("[base]\n", "base: missing"),
            (
                "[base.debian]\nsuite = \"bookworm\"\npackages = [\"git=1.0\"]\n",
                "base.debian.packages[0]",
            ),
            ("[base.scratch\n", "img.toml:1:"),
        ];
        for (text, want) in cases {
            let err = parse_in(&t, text).unwrap_err().to_string();
            assert!(err.contains("img.toml"), "{text}: {err}");
            assert!(err.contains(want), "{text}:\n  got  {err}\n  want {want}");
        }
    }

    #[test]
    fn symlinks_out_of_the_context_are_refused() {
        let t = ctx();
        std::os::unix::fs::symlink("/etc/hostname", t.path().join("files/out")).unwrap();
        let err = parse_in(
            &t,
            "[base.scratch]\n[[step]]\ncopy = [{ src = \"files/out\", dst = \"/x\" }]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("leads outside"), "{err}");
    }
}
