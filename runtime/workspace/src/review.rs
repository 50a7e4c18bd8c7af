//! What a person reviewing a sandbox's change sees of it: the changes git itself would not show
//! left out (and counted), and the files that tools run on their own flagged.
//!
//! [`review`] splits a list of changes (from [`crate::changes::scan`], an exec's change list, or
//! a diff since a checkpoint) three ways:
//! - *left out* ([`Review::ignored`]): git's own files (a path with a `.git` component: the
//!   index `git diff` refreshes, objects, refs) and paths the workspace's git ignores that it
//!   does not track. The ignore rules are the ones in effect in the sandbox: every `.gitignore`
//!   on the way to the path and `.git/info/exclude`, each read from the overlay as the sandbox
//!   sees it, so an ignore file the sandbox added or changed counts and the upper layer's wins
//!   over the host's. The patterns are matched by the `ignore` crate's gitignore matcher, with
//!   git's precedence: a deeper `.gitignore` over a shallower one, any `.gitignore` over
//!   `info/exclude`, the last matching line of a file over earlier ones, and nothing beneath an
//!   ignored directory re-included. A tracked file is never left out, whatever the rules say:
//!   tracked means in the host repository's index (`git ls-files`), or, when the workspace is
//!   not a git checkout or its index cannot be read, a file the diff's base already had (any
//!   change other than an addition). Per-user excludes (`core.excludesFile`) are the host
//!   user's taste, not the workspace's, and are not read.
//! - *shown* ([`Review::shown`]): everything else.
//! - *flagged* ([`Review::flagged`]), across both: added or modified files that a tool runs, or
//!   reads to decide what to run, on its own when a person opens the repository, enters its
//!   directory, commits or pushes ([`autorun_reason`]; the list and its reasons are in
//!   docs/security.md).
//!
//! Exports carry the shown changes (and the left-out ones only on request), so what is applied
//! to the host is what the default diff showed.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use ignore::Match;
use ignore::gitignore::Gitignore;

use crate::changes::{ChangesError, Resolved, UPPER, UpperDir, View, WORKSPACE, keep_shared};
use crate::ignores::IgnoreBudget;
use crate::result::{AutorunFile, Change, ChangeKind};
use crate::tree::Tree;

/// How long `git ls-files` may take.
const GIT_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest index listing read; a larger one counts as unreadable (nothing is left out
/// that the base had).
const MAX_LISTING: u64 = 256 << 20;

/// A change list split for a reviewer (see the module doc).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Review {
    /// What a reviewer sees, in the order given.
    pub shown: Vec<Change>,
    /// What is left out by default, in the order given.
    pub ignored: Vec<Change>,
    /// Files that tools run on their own, shown or left out, sorted by path.
    pub flagged: Vec<AutorunFile>,
}

/// Splits `changes` of the workspace whose overlay is `upper` over the host directory `lower`
/// (see the module doc). `tracked` answers which paths the host repository tracks.
pub fn review(
    upper: &Path,
    lower: &Path,
    changes: Vec<Change>,
    tracked: &TrackedFiles,
) -> Result<Review, ChangesError> {
    let upper_tree = Tree::open(upper, UPPER)?;
    let lower_tree = Tree::open(lower, WORKSPACE)?;
    let u = UpperDir(&upper_tree);
    let view = View::new(Some(&u), Some(&lower_tree));
    let budget = IgnoreBudget::new(changes.len() as u64);
    let mut rules = Rules::new(&view, budget)?;
    let git_checkout = lower_tree.node(Path::new(".git"))?.is_some();
    let mut out = Review::default();
    let mut candidates = Vec::new();
    for change in changes {
        if let Some(reason) = autorun_reason(&change) {
            out.flagged.push(AutorunFile {
                path: change.path.clone(),
                reason: reason.to_owned(),
                ignored: false,
            });
        }
        let (rel, dir) = match change.path.strip_suffix('/') {
            Some(p) => (Path::new(p), true),
            None => (Path::new(change.path.as_str()), false),
        };
        if git_internal(rel) {
            out.ignored.push(change);
        } else if rules.ignored(rel, dir)? {
            candidates.push(change);
        } else {
            out.shown.push(change);
        }
    }
    if !candidates.is_empty() {
        let index = if git_checkout {
            tracked.get(lower)
        } else {
            None
        };
        for change in candidates {
            let is_tracked = match &index {
                Some(index) => index.contains(change.path.as_str()),
                None => change.kind != ChangeKind::Added,
            };
            if is_tracked {
                out.shown.push(change);
            } else {
                out.ignored.push(change);
            }
        }
        // Keep the order given (sorted, for a scan).
        out.shown.sort();
    }
    let left_out: HashSet<&str> = out.ignored.iter().map(|c| c.path.as_str()).collect();
    for f in &mut out.flagged {
        f.ignored = left_out.contains(f.path.as_str());
    }
    out.flagged.sort();
    Ok(out)
}

/// A path with a `.git` component: the repository's own files (or a submodule's), which a
/// reviewer never reviews and an apply never writes.
pub fn git_internal(rel: &Path) -> bool {
    rel.components().any(|c| c.as_os_str() == ".git")
}

// ---------------------------------------------------------------------------------------------
// ignore rules

/// The ignore rules of one view, read lazily along the paths asked about.
///
/// The rules keep the directories on the way to the path asked about last, with each one's
/// `.gitignore` and whether it is ignored, and keep those the next path shares: over a sorted
/// change list each directory's ignore file is read once, and a path costs its depth, not the
/// depth squared of a walk from the root at every level (a tree as deep as a path can hold took
/// seconds so). A list out of order is answered the same, reading again what it left.
struct Rules<'v, 'a> {
    view: &'v View<'a, UpperDir<'a>>,
    /// The root's `.gitignore`.
    root: Option<Gitignore>,
    /// The directories on the way to the path asked about last, by name, from the top; it
    /// stops below an ignored one, since git never looks beneath it.
    dirs: Vec<(OsString, DirRules)>,
    /// `.git/info/exclude`, matched from the workspace root.
    exclude: Option<Gitignore>,
    budget: IgnoreBudget,
}

struct DirRules {
    /// The directory's own `.gitignore`.
    rules: Option<Gitignore>,
    /// Whether git ignores the directory (and so everything beneath it).
    ignored: bool,
}

impl<'v, 'a> Rules<'v, 'a> {
    fn new(
        view: &'v View<'a, UpperDir<'a>>,
        budget: IgnoreBudget,
    ) -> Result<Rules<'v, 'a>, ChangesError> {
        let mut rules = Rules {
            view,
            root: None,
            dirs: Vec::new(),
            exclude: None,
            budget,
        };
        rules.exclude = rules.read(Path::new(".git/info/exclude"))?;
        rules.root = rules.read(Path::new(".gitignore"))?;
        Ok(rules)
    }

    /// The ignore file at `rel`, within the budget.
    fn read(&mut self, rel: &Path) -> Result<Option<Gitignore>, ChangesError> {
        read_ignore_file(self.view, rel, &mut self.budget)
    }

    /// Whether git ignores `rel` (a directory when `dir`): an ignored directory on the way
    /// ignores it, since git never looks beneath one.
    fn ignored(&mut self, rel: &Path, dir: bool) -> Result<bool, ChangesError> {
        let names: Vec<&OsStr> = rel.components().map(|c| c.as_os_str()).collect();
        let known = keep_shared(&mut self.dirs, &names);
        for i in known..names.len().saturating_sub(1) {
            if self.dirs.last().is_some_and(|(_, d)| d.ignored) {
                return Ok(true);
            }
            let ignored = self.matched(&names[..=i], true);
            let path: PathBuf = names[..=i].iter().collect();
            let rules = self.read(&path.join(".gitignore"))?;
            self.dirs
                .push((names[i].to_os_string(), DirRules { rules, ignored }));
        }
        if self.dirs.last().is_some_and(|(_, d)| d.ignored) {
            return Ok(true);
        }
        Ok(self.matched(&names, dir))
    }

    /// Whether the patterns alone ignore the path of `names`, whose parent directories are the
    /// first of `self.dirs`: the deepest `.gitignore` with a matching line decides, then
    /// `info/exclude`.
    fn matched(&mut self, names: &[&OsStr], dir: bool) -> bool {
        // Deepest first; the `.gitignore` of the directory `depth` levels down (the root's
        // at 0) sees the path from there.
        for depth in (0..names.len()).rev() {
            let rules = match depth {
                0 => &self.root,
                _ => &self.dirs[depth - 1].1.rules,
            };
            let Some(gi) = rules else { continue };
            let local: PathBuf = names[depth..].iter().collect();
            if !self.budget.take_match(local.as_os_str().len()) {
                return false;
            }
            match gi.matched(&local, dir) {
                Match::Ignore(_) => return true,
                Match::Whitelist(_) => return false,
                Match::None => {}
            }
        }
        let Some(gi) = &self.exclude else {
            return false;
        };
        let rel: PathBuf = names.iter().collect();
        self.budget.take_match(rel.as_os_str().len())
            && matches!(gi.matched(&rel, dir), Match::Ignore(_))
    }
}

/// The matcher of the ignore file at `rel` as the view shows it, read within `budget` (see
/// [`IgnoreBudget::read_rules`]): a regular file (a symlink is not followed, as git no longer
/// follows one). One that cannot be read (the sandbox made it unreadable, say) has no rules: it
/// hides nothing, and never fails the observation it is part of.
fn read_ignore_file(
    view: &View<'_, UpperDir<'_>>,
    rel: &Path,
    budget: &mut IgnoreBudget,
) -> Result<Option<Gitignore>, ChangesError> {
    let node = match view.resolve(rel) {
        Ok(Resolved::Upper(n) | Resolved::Lower(n)) => n,
        Ok(_) => return Ok(None),
        // The scan of the same layers reports what is unsupported in them.
        Err(e @ ChangesError::Unsupported { .. }) => return Err(e),
        Err(e) => {
            tracing::debug!(path = %rel.display(), error = %e, "ignore file not read");
            return Ok(None);
        }
    };
    if !node.meta().file_type().is_file() {
        return Ok(None);
    }
    match node.open_file() {
        // Root ".": paths are given relative to the file's directory, nothing is stripped.
        Ok((file, _)) => Ok(budget.read_rules(file, Path::new("."), &rel.display())),
        Err(e) => {
            tracing::debug!(path = %rel.display(), error = %e, "ignore file not read");
            Ok(None)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// tracked files

/// The paths the host repository's index tracks, read with `git ls-files` and kept until the
/// index file changes.
#[derive(Debug, Default)]
pub struct TrackedFiles {
    cached: Mutex<Option<(IndexStamp, Arc<HashSet<String>>)>>,
}

/// What identifies one version of an index file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IndexStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl TrackedFiles {
    /// The tracked paths of the git checkout `host` (its `.git` at the top); `None` when git
    /// cannot say (no git, a timeout, an index too large).
    pub fn get(&self, host: &Path) -> Option<Arc<HashSet<String>>> {
        let stamp = fs::metadata(host.join(".git/index"))
            .ok()
            .map(|m| IndexStamp {
                dev: m.dev(),
                ino: m.ino(),
                size: m.size(),
                mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            });
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(stamp), Some((s, set))) = (stamp, cached.as_ref())
            && *s == stamp
        {
            return Some(set.clone());
        }
        let set = Arc::new(ls_files(host)?);
        // A `.git` file (a linked work tree) has its index elsewhere: asked every time.
        *cached = stamp.map(|s| (s, set.clone()));
        Some(set)
    }
}

/// `git ls-files --cached` of `host`, kept from running anything the repository's config names
/// and from taking locks, within [`GIT_TIMEOUT`].
fn ls_files(host: &Path) -> Option<HashSet<String>> {
    let out = taskbox_contract::support::output_within(
        taskbox_contract::support::git_command(host).args([
            "--no-optional-locks",
            // The supervisor may run as another user than the repository's owner; ls-files
            // reads the index and runs nothing.
            "-c",
            "safe.directory=*",
            "ls-files",
            "-z",
            "--cached",
        ]),
        MAX_LISTING + 1,
        GIT_TIMEOUT,
    )?;
    if out.len() as u64 > MAX_LISTING {
        return None;
    }
    Some(
        out.split(|b| *b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect(),
    )
}

// ---------------------------------------------------------------------------------------------
// files that run on their own

/// Where a path is matched: in any directory, or at the workspace root only.
enum At {
    Any,
    Root,
}

/// The files that tools run, or read to decide what to run, without being asked: a glob (from
/// the directory given by [`At`]) and what runs it. docs/security.md lists them for people.
const AUTORUN: &[(At, &str, &str)] = &[
    // Entering a directory.
    (
        At::Any,
        ".envrc",
        "direnv runs it (a shell script) when a shell enters its directory",
    ),
    (
        At::Any,
        ".env",
        "autoenv runs it when a shell enters its directory, and dotenv loaders put it in the environment of programs started there",
    ),
    (
        At::Any,
        ".autoenv.zsh",
        "zsh-autoenv runs it when a shell enters its directory",
    ),
    (
        At::Any,
        ".autoenv_leave.zsh",
        "zsh-autoenv runs it when a shell leaves its directory",
    ),
    (
        At::Any,
        "mise.toml",
        "mise runs its hooks and evaluates its env templates when a shell enters its directory",
    ),
    (
        At::Any,
        ".mise.toml",
        "mise runs its hooks and evaluates its env templates when a shell enters its directory",
    ),
    (
        At::Any,
        "mise.local.toml",
        "mise runs its hooks and evaluates its env templates when a shell enters its directory",
    ),
    (
        At::Any,
        ".mise/config.toml",
        "mise runs its hooks and evaluates its env templates when a shell enters its directory",
    ),
    // Opening the folder in an editor.
    (
        At::Any,
        ".vscode/tasks.json",
        "VS Code runs its tasks marked runOn folderOpen when the folder opens",
    ),
    (
        At::Any,
        ".vscode/settings.json",
        "VS Code settings name programs the editor and its extensions run (terminal profiles and env, interpreter and tool paths)",
    ),
    (
        At::Any,
        "*.code-workspace",
        "a VS Code workspace file: settings and tasks that run as .vscode's do",
    ),
    (
        At::Any,
        ".devcontainer.json",
        "dev container lifecycle commands (postCreateCommand, ...) run when the folder opens in a container",
    ),
    (
        At::Any,
        ".devcontainer/**",
        "dev container lifecycle commands (postCreateCommand, ...) run when the folder opens in a container",
    ),
    (
        At::Any,
        ".idea/workspace.xml",
        "JetBrains IDEs run its startup tasks when the project opens",
    ),
    (
        At::Any,
        ".exrc",
        "vim and neovim run it at start in its directory when 'exrc' is set",
    ),
    (
        At::Any,
        ".nvimrc",
        "neovim runs it at start in its directory when 'exrc' is set",
    ),
    (
        At::Any,
        ".nvim.lua",
        "neovim runs it at start in its directory when 'exrc' is set",
    ),
    (
        At::Any,
        ".dir-locals.el",
        "Emacs applies its variables (an eval: runs code) when a file beneath it opens",
    ),
    (
        At::Any,
        ".dir-locals-2.el",
        "Emacs applies its variables (an eval: runs code) when a file beneath it opens",
    ),
    // Build tools an editor runs when the project opens.
    (
        At::Any,
        ".cargo/config.toml",
        "cargo, and rust-analyzer when an editor opens the project, run the programs it names (rustc-wrapper, runners, aliases)",
    ),
    (
        At::Any,
        ".cargo/config",
        "cargo, and rust-analyzer when an editor opens the project, run the programs it names (rustc-wrapper, runners, aliases)",
    ),
    (
        At::Any,
        "rust-toolchain.toml",
        "rustup runs the toolchain it names (a path: any program) for every cargo call, rust-analyzer's on open included",
    ),
    (
        At::Any,
        "rust-toolchain",
        "rustup runs the toolchain it names (a path: any program) for every cargo call, rust-analyzer's on open included",
    ),
    (
        At::Any,
        ".yarnrc.yml",
        "yarn runs the program at its yarnPath in place of itself",
    ),
    (
        At::Any,
        ".yarnrc",
        "yarn runs the program at its yarn-path in place of itself",
    ),
    (
        At::Any,
        ".npmrc",
        "npm runs its script-shell and passes its node-options with every npm command",
    ),
    // git.
    (
        At::Any,
        ".git/hooks/**",
        "git runs hooks on commit, checkout, merge, rebase and push",
    ),
    (
        At::Any,
        ".git/config",
        "git config names programs git runs (core.hooksPath, core.fsmonitor, core.pager, aliases, filter drivers)",
    ),
    (
        At::Root,
        ".githooks/**",
        "a committed hooks directory: git runs it on commit and push once core.hooksPath points at it",
    ),
    (
        At::Root,
        ".husky/**",
        "husky points core.hooksPath here on install: git runs these scripts as hooks",
    ),
    (
        At::Root,
        ".pre-commit-config.yaml",
        "pre-commit runs the hooks it names on every commit once installed",
    ),
    (
        At::Root,
        "lefthook.yml",
        "lefthook runs the commands it names as git hooks",
    ),
    (
        At::Root,
        ".lefthook.yml",
        "lefthook runs the commands it names as git hooks",
    ),
    (
        At::Root,
        "lefthook-local.yml",
        "lefthook runs the commands it names as git hooks",
    ),
    (
        At::Any,
        ".gitattributes",
        "selects the filter and diff drivers git runs on checkout, add and diff",
    ),
    (
        At::Root,
        ".gitmodules",
        "names the repositories git clones into the work tree on submodule update",
    ),
    (
        At::Root,
        ".gitconfig",
        "a committed git config, live once .git/config includes it (include.path): it can name programs git runs",
    ),
    (
        At::Root,
        ".lfsconfig",
        "git-lfs reads its settings (remote endpoints, transfer agents) on checkout and push",
    ),
    // CI: runs on push.
    (
        At::Root,
        ".github/workflows/**",
        "GitHub Actions runs its workflows on push and pull requests",
    ),
    (
        At::Root,
        ".github/actions/**",
        "GitHub Actions runs these actions from the workflows",
    ),
    (
        At::Root,
        ".gitea/workflows/**",
        "Gitea Actions runs its workflows on push",
    ),
    (
        At::Root,
        ".forgejo/workflows/**",
        "Forgejo Actions runs its workflows on push",
    ),
    (
        At::Root,
        ".gitlab-ci.yml",
        "GitLab CI runs its jobs on push",
    ),
    (
        At::Root,
        ".gitlab/ci/**",
        "GitLab CI includes these job definitions",
    ),
    (At::Root, ".circleci/**", "CircleCI runs its jobs on push"),
    (At::Root, ".travis.yml", "Travis CI runs its jobs on push"),
    (
        At::Root,
        "azure-pipelines.yml",
        "Azure Pipelines runs its jobs on push",
    ),
    (
        At::Root,
        ".azure-pipelines/**",
        "Azure Pipelines runs its jobs on push",
    ),
    (At::Root, "Jenkinsfile", "Jenkins runs its pipeline on push"),
    (
        At::Root,
        ".buildkite/**",
        "Buildkite runs its pipeline on push",
    ),
    (
        At::Root,
        "bitbucket-pipelines.yml",
        "Bitbucket Pipelines runs its jobs on push",
    ),
    (At::Root, ".drone.yml", "Drone CI runs its pipeline on push"),
    (
        At::Root,
        ".woodpecker.yml",
        "Woodpecker CI runs its pipeline on push",
    ),
    (
        At::Root,
        ".woodpecker/**",
        "Woodpecker CI runs its pipelines on push",
    ),
    (At::Root, "appveyor.yml", "AppVeyor runs its jobs on push"),
    (At::Root, ".appveyor.yml", "AppVeyor runs its jobs on push"),
    (At::Root, ".cirrus.yml", "Cirrus CI runs its tasks on push"),
];

static AUTORUN_SET: LazyLock<Option<GlobSet>> = LazyLock::new(|| {
    let mut b = GlobSetBuilder::new();
    for (at, glob, _) in AUTORUN {
        let pattern = match at {
            At::Any => format!("{{{glob},**/{glob}}}"),
            At::Root => (*glob).to_owned(),
        };
        b.add(
            GlobBuilder::new(&pattern)
                .literal_separator(true)
                .build()
                .ok()?,
        );
    }
    b.build().ok()
});

/// What runs the file of `change` on its own, when something does: only a file that is there
/// after the change (added or modified) can run.
pub fn autorun_reason(change: &Change) -> Option<&'static str> {
    if change.kind == ChangeKind::Deleted || change.path.ends_with('/') {
        return None;
    }
    let set = AUTORUN_SET.as_ref()?;
    let i = set.matches(&change.path).into_iter().next()?;
    AUTORUN.get(i).map(|(_, _, why)| *why)
}

#[cfg(test)]
#[path = "review_tests.rs"]
mod tests;
