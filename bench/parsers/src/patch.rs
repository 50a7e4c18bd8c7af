//! The unified-diff parser: ours (`taskbox_workspace::fsops`) against diffy, gitpatch and
//! unidiff, with `git apply` as the reference, on the patches of our tests, the `patch` fuzz
//! corpus, tricky and hostile cases.
//!
//! Two questions per case. What does the patch say (each file's operation, paths, lines added and
//! removed), which every library answers and `git apply --numstat --summary` answers for git?
//! And what does the workspace look like after it, which ours (`WorkspaceFs::patch`) and diffy
//! (the only library here that applies) answer and `git apply` answers for git?

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use taskbox_workspace::fsops::{WorkspaceFs, patch_parser};

use crate::probe;
use crate::timing::{self, Timing};

pub const IMPLS: &[&str] = &["ours", "diffy", "gitpatch", "unidiff"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scene {
    /// The `patch` fuzz target's workspace.
    Fuzz,
    /// The files the unit tests of `fsops` and `changes` patch.
    Unit,
}

pub struct Case {
    pub name: String,
    pub scene: Scene,
    pub text: String,
    pub hostile: bool,
}

/// One file's part of a patch, as every parser can tell it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FileSum {
    /// add, delete, modify, rename, binary
    pub op: String,
    /// The path after (before, for a delete); a rename also names where from.
    pub path: String,
    pub from: Option<String>,
    pub added: usize,
    pub removed: usize,
}

impl FileSum {
    fn show(&self) -> String {
        let from = self
            .from
            .as_ref()
            .map_or(String::new(), |f| format!("{f} => "));
        format!(
            "{} {from}{} +{} -{}",
            self.op, self.path, self.added, self.removed
        )
    }
}

pub type Parsed = Result<Vec<FileSum>, String>;
/// The workspace after: path -> `file MODE CONTENT` or `link TARGET`.
pub type Tree = BTreeMap<String, String>;
pub type Applied = Result<Tree, String>;

// ---- the scenes -------------------------------------------------------------------------------

fn write(path: &Path, text: &str, mode: u32) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(path, text);
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
}

/// Lays out `scene` under `dir`: `dir/ws` (the workspace) beside `dir/outside` (a secret).
fn build(scene: Scene, dir: &Path) -> PathBuf {
    let ws = dir.join("ws");
    let outside = dir.join("outside");
    let _ = std::fs::create_dir_all(&ws);
    write(&outside.join("secret"), "host secret\n", 0o644);
    let _ = symlink("../outside", ws.join("up"));
    let _ = symlink(&outside, ws.join("abs"));
    match scene {
        Scene::Fuzz => {
            write(&ws.join("a.txt"), "one\ntwo\nthree\n", 0o644);
            write(&ws.join("src/lib.rs"), "fn main() {}\n", 0o644);
            write(&ws.join("no-newline"), "last", 0o644);
        }
        Scene::Unit => {
            let twenty: String = (1..=20).map(|i| format!("line {i}\n")).collect();
            for (path, text) in [
                ("src/lib.rs", "fn one() {}\nfn two() {}\nfn three() {}\n"),
                ("README.md", "hello\nworld\n"),
                ("gone.txt", "bye\n"),
                ("old_name.txt", "keep\nme\n"),
                ("b.txt", "alpha\nbeta\ngamma\n"),
                ("f.txt", &format!("{twenty}last")),
                ("old.txt", "bye\n"),
                ("mod.txt", "a\nb\n"),
                ("mode.sh", "echo\n"),
                ("notes.txt", &twenty),
                ("gap.txt", "a\n\nc\n"),
                ("sql.txt", "-- a\n-- b\nselect 1;\n"),
                ("last.txt", "last"),
            ] {
                write(&ws.join(path), text, 0o644);
            }
        }
    }
    ws
}

/// Every regular file and symlink under `root` (directories are implied by their files).
fn snapshot(root: &Path) -> Tree {
    let base = root
        .parent()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out = Tree::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p
                .strip_prefix(root)
                .map(|r| r.to_string_lossy().into_owned())
                .unwrap_or_default();
            let Ok(meta) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap_or_default();
                let target = target.to_string_lossy().replace(&base, "<scratch>");
                out.insert(rel, format!("link {target}"));
            } else if meta.is_dir() {
                stack.push(p);
            } else {
                let exec = meta.permissions().mode() & 0o111 != 0;
                let content = std::fs::read(&p).unwrap_or_default();
                out.insert(
                    rel,
                    file_entry(
                        if exec { "x" } else { "-" },
                        &String::from_utf8_lossy(&content),
                    ),
                );
            }
        }
    }
    out
}

/// A file in a [`Tree`]: its mode (`x` executable, `-` not) and its text as a JSON string.
fn file_entry(mode: &str, text: &str) -> String {
    format!("file {mode} {}", serde_json::Value::String(text.to_owned()))
}

fn scratch() -> Result<tempfile::TempDir, String> {
    tempfile::Builder::new()
        .prefix("taskbox-parsers.")
        .tempdir()
        .map_err(|e| format!("scratch directory: {e}"))
}

// ---- git, the reference --------------------------------------------------------------------

fn git(dir: &Path, args: &[&str], patch: &str) -> Result<String, String> {
    let file = dir.join("the.patch");
    std::fs::write(&file, patch).map_err(|e| format!("write: {e}"))?;
    let out = Command::new("git")
        .current_dir(dir.join("ws"))
        .args(["apply", "--whitespace=nowarn"])
        .args(args)
        .arg(&file)
        // No configuration of this machine's user reaches the reference.
        .env("HOME", dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CEILING_DIRECTORIES", dir)
        .output()
        .map_err(|e| format!("git: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(err.lines().next().unwrap_or("git apply failed").to_owned())
    }
}

/// `a{b => c}d` as (`abd`, `acd`): git's compact rename notation.
fn expand_rename(s: &str) -> Option<(String, String)> {
    if let (Some(open), Some(close)) = (s.find('{'), s.rfind('}')) {
        let (pre, post) = (&s[..open], &s[close + 1..]);
        let (a, b) = s[open + 1..close].split_once(" => ")?;
        let join = |m: &str| format!("{pre}{m}{post}").replace("//", "/");
        return Some((join(a), join(b)));
    }
    let (a, b) = s.split_once(" => ")?;
    Some((a.to_owned(), b.to_owned()))
}

fn git_parse(case: &Case) -> Parsed {
    let dir = scratch()?;
    build(case.scene, dir.path());
    let numstat = git(dir.path(), &["--numstat", "-z"], &case.text)?;
    let summary = git(dir.path(), &["--summary"], &case.text)?;
    let mut renames: Vec<(String, String)> = Vec::new();
    for line in summary.lines() {
        if let Some(r) = line
            .strip_prefix(" rename ")
            .or_else(|| line.strip_prefix(" copy "))
        {
            let r = r.rsplit_once(" (").map_or(r, |(a, _)| a);
            if let Some(pair) = expand_rename(r) {
                renames.push(pair);
            }
        }
    }
    let mut files = Vec::new();
    for rec in numstat.split('\0').filter(|r| !r.is_empty()) {
        let mut it = rec.splitn(3, '\t');
        let (Some(a), Some(d), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let binary = a == "-";
        let has = |what: &str| {
            summary.contains(&format!(" {what} mode 100644 {path}\n"))
                || summary.contains(&format!(" {what} mode 100755 {path}\n"))
                || summary.contains(&format!(" {what} mode 120000 {path}\n"))
        };
        let rename = renames.iter().find(|(_, to)| to == path);
        let copy = summary.contains(" copy ") && rename.is_some();
        let op = if binary {
            "binary"
        } else if copy {
            "copy"
        } else if has("create") {
            "add"
        } else if has("delete") {
            "delete"
        } else if rename.is_some() {
            "rename"
        } else {
            "modify"
        };
        files.push(FileSum {
            op: op.to_owned(),
            path: path.to_owned(),
            from: rename.map(|(f, _)| f.clone()).filter(|_| op == "rename"),
            added: a.parse().unwrap_or(0),
            removed: d.parse().unwrap_or(0),
        });
    }
    Ok(files)
}

fn git_apply(case: &Case) -> Applied {
    let dir = scratch()?;
    let ws = build(case.scene, dir.path());
    git(dir.path(), &[], &case.text)?;
    Ok(snapshot(&ws))
}

// ---- the parsers ---------------------------------------------------------------------------

/// `a/x` and `b/x` lose their prefix when both sides have one (or the other is /dev/null): the
/// rule ours applies, and the one a caller of a library would write.
fn strip_pair(old: Option<&str>, new: Option<&str>) -> (Option<String>, Option<String>) {
    let prefixed =
        old.is_none_or(|o| o.starts_with("a/")) && new.is_none_or(|n| n.starts_with("b/"));
    let fix = |p: Option<&str>, pre: &str| {
        p.map(|p| {
            if prefixed {
                p.strip_prefix(pre).unwrap_or(p).to_owned()
            } else {
                p.to_owned()
            }
        })
    };
    (fix(old, "a/"), fix(new, "b/"))
}

fn sum(old: Option<String>, new: Option<String>, added: usize, removed: usize) -> FileSum {
    let (op, path, from) = match (old, new) {
        (None, Some(n)) => ("add", n, None),
        (Some(o), None) => ("delete", o, None),
        (Some(o), Some(n)) if o != n => ("rename", n, Some(o)),
        (Some(_), Some(n)) => ("modify", n, None),
        (None, None) => ("modify", String::new(), None),
    };
    FileSum {
        op: op.to_owned(),
        path,
        from,
        added,
        removed,
    }
}

pub fn parse_with(which: &str, text: &str) -> Parsed {
    // Every caller refuses a patch with no file in it, as ours does.
    match parse_any(which, text) {
        Ok(files) if files.is_empty() => Err("no file sections".to_owned()),
        other => other,
    }
}

fn parse_any(which: &str, text: &str) -> Parsed {
    match which {
        "ours" => patch_parser::parse(text)
            .map_err(|e| e.to_string())
            .map(|files| {
                files
                    .into_iter()
                    .map(|f| sum(f.old_path, f.new_path, f.added, f.removed))
                    .collect()
            }),
        "diffy" => parse_diffy(text).map(|files| files.into_iter().map(|(s, _, _)| s).collect()),
        "gitpatch" => gitpatch::Patch::from_multiple(text)
            .map_err(|e| e.to_string())
            .map(|patches| {
                patches
                    .into_iter()
                    .map(|p| {
                        let null = |s: &str| (s != "/dev/null").then(|| s.to_owned());
                        let (o, n) = (null(&p.old.path), null(&p.new.path));
                        let (o, n) = strip_pair(o.as_deref(), n.as_deref());
                        let count = |f: fn(&gitpatch::Line) -> bool| {
                            p.hunks
                                .iter()
                                .flat_map(|h| &h.lines)
                                .filter(|l| f(l))
                                .count()
                        };
                        sum(
                            o,
                            n,
                            count(|l| matches!(l, gitpatch::Line::Add(_))),
                            count(|l| matches!(l, gitpatch::Line::Remove(_))),
                        )
                    })
                    .collect()
            }),
        _ => {
            let mut set = unidiff::PatchSet::new();
            set.parse(text).map_err(|e| e.to_string())?;
            Ok(set
                .files()
                .iter()
                .map(|f| {
                    let null = |s: &str| (s != "/dev/null").then(|| s.to_owned());
                    let (o, n) = (null(&f.source_file), null(&f.target_file));
                    let (o, n) = strip_pair(o.as_deref(), n.as_deref());
                    sum(o, n, f.added(), f.removed())
                })
                .collect())
        }
    }
}

/// diffy's git-diff reading: each file's summary and, for a text patch, the patch itself.
type DiffyFile<'a> = (
    FileSum,
    Option<diffy::Patch<'a, str>>,
    Option<diffy::patch_set::FileMode>,
);

fn parse_diffy(text: &str) -> Result<Vec<DiffyFile<'_>>, String> {
    use diffy::patch_set::{FileOperation, ParseOptions, PatchKind, PatchSet};
    // Git's format when the patch has git headers, the plain one when not: diffy reads each
    // only in its own mode, so a caller picks.
    let git = text.starts_with("diff --git ") || text.contains("\ndiff --git ");
    let opts = if git {
        ParseOptions::gitdiff()
    } else {
        ParseOptions::unidiff()
    };
    let mut out = Vec::new();
    for fp in PatchSet::parse(text, opts) {
        let fp = fp.map_err(|e| e.to_string())?;
        let mode = fp.new_mode().copied();
        let (old, new, copy) = match fp.operation() {
            FileOperation::Create(p) => (None, Some(p.to_string()), false),
            FileOperation::Delete(p) => (Some(p.to_string()), None, false),
            FileOperation::Modify { original, modified } => (
                Some(original.to_string()),
                Some(modified.to_string()),
                false,
            ),
            FileOperation::Rename { from, to } => {
                (Some(from.to_string()), Some(to.to_string()), false)
            }
            FileOperation::Copy { from, to } => {
                (Some(from.to_string()), Some(to.to_string()), true)
            }
        };
        let (old, new) = strip_pair(old.as_deref(), new.as_deref());
        let (mut s, patch) = match fp.into_patch() {
            PatchKind::Text(p) => {
                let count = |f: fn(&diffy::Line<'_, str>) -> bool| {
                    p.hunks()
                        .iter()
                        .flat_map(|h| h.lines())
                        .filter(|l| f(l))
                        .count()
                };
                let (a, d) = (
                    count(|l| matches!(l, diffy::Line::Insert(_))),
                    count(|l| matches!(l, diffy::Line::Delete(_))),
                );
                (sum(old, new, a, d), Some(p))
            }
            PatchKind::Binary(_) => {
                let mut s = sum(old, new, 0, 0);
                s.op = "binary".to_owned();
                (s, None)
            }
        };
        if copy {
            s.op = "copy".to_owned();
            s.from = None;
        }
        out.push((s, patch, mode));
    }
    Ok(out)
}

// ---- applying ------------------------------------------------------------------------------

fn ours_apply(case: &Case) -> Applied {
    let dir = scratch()?;
    let ws = build(case.scene, dir.path());
    let fs = WorkspaceFs::open(&ws).map_err(|e| e.to_string())?;
    fs.patch(&taskbox_contract::api::PatchRequest {
        patch: case.text.clone(),
    })
    .map_err(|e| e.to_string())?;
    Ok(snapshot(&ws))
}

/// diffy's parse and apply, committed to an in-memory copy of the workspace, with the path
/// checks that stay ours whichever parser reads (no absolute path, no `..`, nothing through or
/// onto a symlink) and all-or-nothing like ours.
fn diffy_apply(case: &Case) -> Applied {
    let dir = scratch()?;
    let ws = build(case.scene, dir.path());
    let mut tree = snapshot(&ws);
    let files = parse_diffy(&case.text)?;
    if files.is_empty() {
        return Err("no file changes found".to_owned());
    }
    let check = |tree: &Tree, p: &str| -> Result<(), String> {
        if p.starts_with('/') || p.split('/').any(|c| c == ".." || c.is_empty()) {
            return Err(format!("{p}: path refused"));
        }
        let mut at = String::new();
        for c in p.split('/') {
            if !at.is_empty() {
                at.push('/');
            }
            at.push_str(c);
            if tree.get(&at).is_some_and(|v| v.starts_with("link ")) {
                return Err(format!("{p}: through a symlink"));
            }
        }
        Ok(())
    };
    let content = |tree: &Tree, p: &str| -> Option<(String, String)> {
        let v = tree.get(p)?;
        let rest = v.strip_prefix("file ")?;
        let (mode, quoted) = rest.split_once(' ')?;
        let text: String = serde_json::from_str(quoted).ok()?;
        Some((mode.to_owned(), text))
    };
    for (s, patch, new_mode) in files {
        use diffy::patch_set::FileMode;
        if matches!(new_mode, Some(FileMode::Symlink | FileMode::Gitlink)) {
            return Err(format!(
                "{}: symlinks and submodules are not applied",
                s.path
            ));
        }
        let Some(patch) = patch else {
            return Err(format!("{}: binary patches are not applied", s.path));
        };
        if s.op == "copy" {
            return Err(format!("{}: copies are not applied", s.path));
        }
        check(&tree, &s.path)?;
        let source = s.from.clone().unwrap_or_else(|| s.path.clone());
        check(&tree, &source)?;
        let (mode, base) = match s.op.as_str() {
            "add" => {
                if tree.contains_key(&s.path) {
                    return Err(format!("{}: already exists", s.path));
                }
                ("-".to_owned(), String::new())
            }
            _ => content(&tree, &source).ok_or_else(|| format!("{source}: does not exist"))?,
        };
        let result = diffy::apply(&base, &patch).map_err(|e| format!("{}: {e}", s.path))?;
        match s.op.as_str() {
            "delete" => {
                if !result.is_empty() {
                    return Err(format!("{}: the deletion leaves content", s.path));
                }
                tree.remove(&s.path);
            }
            _ => {
                if s.from.is_some() {
                    tree.remove(&source);
                }
                let mode = match new_mode {
                    Some(FileMode::Executable) => "x",
                    Some(_) => "-",
                    None => mode.as_str(),
                };
                tree.insert(s.path.clone(), file_entry(mode, &result));
            }
        }
    }
    // A path may not be a file and the directory of another (the file system would refuse).
    let dir_of_another = |k: &String| {
        tree.keys().any(|o| {
            o.len() > k.len() && o.starts_with(k.as_str()) && o.as_bytes()[k.len()] == b'/'
        })
    };
    if let Some(k) = tree.keys().find(|k| dir_of_another(k)) {
        return Err(format!("{k} would be a file and a directory"));
    }
    Ok(tree)
}

// ---- the corpus ----------------------------------------------------------------------------

fn load(here: &Path) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    for (dir, scene, prefix) in [
        (
            here.join("../../tests/fuzz/corpus/patch"),
            Scene::Fuzz,
            "fuzz/",
        ),
        (here.join("patch_corpus/unit"), Scene::Unit, ""),
    ] {
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .flatten()
            .map(|e| e.path())
            .collect();
        names.sort();
        for p in names {
            let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            // Our API takes text: a patch that is not UTF-8 never reaches the parser.
            let Ok(text) = String::from_utf8(bytes) else {
                continue;
            };
            let name = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            cases.push(Case {
                name: format!("{prefix}{name}"),
                scene,
                text,
                hostile: false,
            });
        }
    }
    for name in HOSTILE {
        cases.push(Case {
            name: (*name).to_owned(),
            scene: Scene::Unit,
            text: String::new(),
            hostile: true,
        });
    }
    Ok(cases)
}

const HOSTILE: &[&str] = &[
    "add-128k-lines",
    "files-10k",
    "path-1mb",
    "git-headers-100k",
    "hunk-headers-100k",
    "no-newline-markers-100k",
    "minus-lines-1mb",
    "random-20k",
];

fn generate(name: &str) -> Option<String> {
    let rep = |s: &str, n: usize| s.repeat(n);
    Some(match name {
        "add-128k-lines" => format!(
            "--- /dev/null\n+++ b/big.txt\n@@ -0,0 +1,{} @@\n{}",
            128 << 10,
            rep("+line\n", 128 << 10)
        ),
        "files-10k" => (0..10_000)
            .map(|i| format!("--- /dev/null\n+++ b/f{i}.txt\n@@ -0,0 +1 @@\n+x\n"))
            .collect(),
        "path-1mb" => format!(
            "--- /dev/null\n+++ b/{}\n@@ -0,0 +1 @@\n+x\n",
            rep("a", 1 << 20)
        ),
        "git-headers-100k" => rep("diff --git a/x b/x\n", 100_000),
        "hunk-headers-100k" => format!(
            "--- a/README.md\n+++ b/README.md\n{}",
            rep("@@ -1 +1 @@\n", 100_000)
        ),
        "no-newline-markers-100k" => format!(
            "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-hello\n{}+hi\n",
            rep("\\ No newline at end of file\n", 100_000)
        ),
        "minus-lines-1mb" => rep("--- a\n", 1 << 20 >> 3),
        _ => return None,
    })
}

/// Random patches over the pieces that matter to a parser (a cheap fuzz run, the same for every
/// parser): how many each refuses, and whether any panics.
fn random_patches(n: usize) -> Vec<String> {
    const PIECES: &[&str] = &[
        "--- ",
        "+++ ",
        "a/x",
        "b/x",
        "/dev/null",
        "@@ -",
        "@@ ",
        " +",
        ",",
        "0",
        "1",
        "2",
        "99999999999999999999",
        "\n",
        " ",
        "-",
        "+",
        "\\ No newline at end of file",
        "diff --git ",
        "new file mode 100644",
        "deleted file mode 100644",
        "rename from x",
        "rename to y",
        "GIT binary patch",
        "\t",
        "\"",
        "\\",
        "é",
        "old mode 100644",
        "new mode 100755",
        "copy from ",
        "index 1..2",
        "@@ -1 +1 @@\n",
        "--- a/x\n+++ b/x\n",
    ];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    (0..n)
        .map(|_| {
            let len = next() % 40;
            (0..len).map(|_| PIECES[next() % PIECES.len()]).collect()
        })
        .collect()
}

/// In the child process: one parser on one generated case.
pub fn probe_main(which: &str, case: &str) -> Value {
    if case == "random-20k" {
        let (mut ok, mut err, mut n_panics, mut panics) = (0, 0, 0, Vec::new());
        let inputs = random_patches(20_000);
        let start = std::time::Instant::now();
        for text in &inputs {
            match probe::catch(|| parse_with(which, text)) {
                Ok(Ok(_)) => ok += 1,
                Ok(Err(_)) => err += 1,
                Err(p) => {
                    n_panics += 1;
                    if panics.len() < 3 {
                        panics.push(format!("{} on {text:?}", first_line(&p, 100)));
                    }
                }
            }
        }
        let ns = start.elapsed().as_nanos() as f64;
        return json!({"outcome": format!("{ok} parsed, {err} refused, {n_panics} panicked"),
                      "panics": panics, "failed": n_panics > 0, "median_ns": ns});
    }
    let Some(text) = generate(case) else {
        return json!({"outcome": format!("no case {case}"), "failed": true});
    };
    let outcome = match probe::catch(|| parse_with(which, &text)) {
        Ok(Ok(files)) => (format!("{} files", files.len()), false),
        Ok(Err(e)) => (format!("refused: {}", first_line(&e, 80)), false),
        Err(p) => (first_line(&p, 100), true),
    };
    let t = timing::measure(3, 1, &mut || {
        let _ = probe::catch(|| std::hint::black_box(parse_with(which, &text)));
    });
    json!({"outcome": outcome.0, "failed": outcome.1, "median_ns": t.median_ns})
}

// ---- the comparison ------------------------------------------------------------------------

/// How one parser's answer compares with git's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Agrees,
    /// Refused what git reads, but of a kind taskbox refuses on purpose (binary, copy, symlink).
    RefusesByDesign,
    /// Refused what git reads.
    RefusesValid,
    /// Read what git refuses.
    AcceptsInvalid,
    /// Both read it, differently.
    Differs,
    Panicked,
}

impl Verdict {
    fn show(self) -> &'static str {
        match self {
            Verdict::Agrees => "agrees",
            Verdict::RefusesByDesign => "refuses (by design)",
            Verdict::RefusesValid => "refuses what git reads",
            Verdict::AcceptsInvalid => "reads what git refuses",
            Verdict::Differs => "differs",
            Verdict::Panicked => "PANICS",
        }
    }
}

fn by_design(text: &str) -> bool {
    let absolute = text
        .lines()
        .any(|l| (l.starts_with("+++ /") || l.starts_with("--- /")) && !l.contains("/dev/null"));
    absolute
        || text.contains(".git/")
        || text.contains("GIT binary patch")
        || text.contains("Binary files ")
        || text.contains("\ncopy from ")
        || text.contains(" mode 120000")
}

/// Same file summaries; where git's `--summary` says nothing of a plain diff's creation or
/// deletion (it reports them only with git's mode headers), its "modify" stands for any.
fn same_files(git: &[FileSum], other: &[FileSum]) -> bool {
    git.len() == other.len()
        && git.iter().zip(other).all(|(g, o)| {
            g.path == o.path
                && g.from == o.from
                && g.added == o.added
                && g.removed == o.removed
                && (g.op == o.op || (g.op == "modify" && (o.op == "add" || o.op == "delete")))
        })
}

trait Same {
    fn same(&self, other: &Self) -> bool;
}

impl Same for Vec<FileSum> {
    fn same(&self, other: &Self) -> bool {
        same_files(self, other)
    }
}

impl Same for Tree {
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}

fn judge<T: Same>(
    reference: &Result<T, String>,
    got: &Result<Result<T, String>, String>,
    text: &str,
) -> Verdict {
    match (reference, got) {
        (_, Err(_)) => Verdict::Panicked,
        (Ok(a), Ok(Ok(b))) if a.same(b) => Verdict::Agrees,
        (Ok(_), Ok(Ok(_))) => Verdict::Differs,
        (Ok(_), Ok(Err(_))) if by_design(text) => Verdict::RefusesByDesign,
        (Ok(_), Ok(Err(_))) => Verdict::RefusesValid,
        (Err(_), Ok(Ok(_))) => Verdict::AcceptsInvalid,
        (Err(_), Ok(Err(_))) => Verdict::Agrees,
    }
}

pub struct Row {
    pub case: String,
    pub git_parse: Parsed,
    pub parsed: Vec<(String, Result<Parsed, String>, Verdict)>,
    pub git_apply: Applied,
    pub applied: Vec<(String, Result<Applied, String>, Verdict)>,
}

pub struct Hostile {
    pub case: String,
    pub size: usize,
    /// Per parser: outcome, failed (panic or crash), time.
    pub results: Vec<(String, String, bool, Option<f64>)>,
}

pub struct Report {
    pub rows: Vec<Row>,
    pub hostile: Vec<Hostile>,
    /// Parse-only speed per parser: the corpus in one pass, and a large git diff.
    pub speed_corpus: Vec<(String, Timing)>,
    pub speed_large: Vec<(String, Timing)>,
    pub large_size: usize,
    /// Parse and apply of one file with 100 hunks, in memory: ours and diffy.
    pub speed_apply: Vec<(String, Timing)>,
}

/// A git diff of 200 files with 5 hunks each, as `git diff` writes it.
fn large_patch() -> String {
    let mut s = String::new();
    for f in 0..200 {
        let _ = write!(
            s,
            "diff --git a/src/file{f}.rs b/src/file{f}.rs\nindex 1111111..2222222 100644\n--- a/src/file{f}.rs\n+++ b/src/file{f}.rs\n"
        );
        for h in 0..5 {
            let at = 1 + h * 40;
            let _ = writeln!(s, "@@ -{at},7 +{at},7 @@ fn f{h}() {{");
            for k in 0..3 {
                let _ = writeln!(s, "     let x{k} = {k};");
            }
            let _ = writeln!(s, "-    old_call({h});\n+    new_call({h});");
            for k in 0..3 {
                let _ = writeln!(s, "     let y{k} = {k};");
            }
        }
    }
    s
}

/// One file of 4,000 lines and a patch that changes every 40th line (100 hunks).
fn apply_fixture() -> (String, String) {
    let base: String = (0..4000).map(|i| format!("line {i}\n")).collect();
    let mut p = String::from("--- a/big.txt\n+++ b/big.txt\n");
    for h in 0..100 {
        let at = h * 40 + 10;
        let _ = writeln!(p, "@@ -{},7 +{},7 @@", at + 1, at + 1);
        for i in at..at + 3 {
            let _ = writeln!(p, " line {i}");
        }
        let _ = writeln!(p, "-line {}\n+LINE {}", at + 3, at + 3);
        for i in at + 4..at + 7 {
            let _ = writeln!(p, " line {i}");
        }
    }
    (base, p)
}

pub fn run(here: &Path, quick: bool) -> Result<Report, String> {
    let cases = load(here)?;
    let mut rows = Vec::new();
    let mut hostile = Vec::new();
    for case in &cases {
        if case.hostile {
            let size = generate(&case.name).map_or(0, |t| t.len());
            let results = IMPLS
                .iter()
                .map(|which| match probe::run(&["patch", which, &case.name]) {
                    Ok(v) => (
                        (*which).to_owned(),
                        {
                            let mut o = v["outcome"].as_str().unwrap_or("?").to_owned();
                            if let Some(p) = v["panics"].as_array().filter(|p| !p.is_empty()) {
                                let first = first_line(p[0].as_str().unwrap_or(""), 160);
                                o.push_str(&format!(" (first: {first})"));
                            }
                            o
                        },
                        v["failed"].as_bool().unwrap_or(true),
                        v["median_ns"].as_f64(),
                    ),
                    Err(e) => ((*which).to_owned(), e, true, None),
                })
                .collect();
            hostile.push(Hostile {
                case: case.name.clone(),
                size,
                results,
            });
            continue;
        }
        let git_parse = git_parse(case);
        let parsed = IMPLS
            .iter()
            .map(|which| {
                let got = probe::catch(|| parse_with(which, &case.text));
                let v = judge(&git_parse, &got, &case.text);
                ((*which).to_owned(), got, v)
            })
            .collect();
        let git_apply = git_apply(case);
        let applied = [
            ("ours", ours_apply as fn(&Case) -> Applied),
            ("diffy", diffy_apply),
        ]
        .into_iter()
        .map(|(which, f)| {
            let got = probe::catch(|| f(case));
            let v = judge(&git_apply, &got, &case.text);
            (which.to_owned(), got, v)
        })
        .collect();
        rows.push(Row {
            case: case.name.clone(),
            git_parse,
            parsed,
            git_apply,
            applied,
        });
    }

    let (rounds, per_round) = if quick { (11, 20) } else { (31, 200) };
    let texts: Vec<&str> = cases
        .iter()
        .filter(|c| !c.hostile)
        .map(|c| c.text.as_str())
        .collect();
    let large = large_patch();
    let mut speed_corpus = Vec::new();
    let mut speed_large = Vec::new();
    for which in IMPLS {
        let t = timing::measure(rounds, per_round, &mut || {
            for text in &texts {
                let _ = probe::catch(|| std::hint::black_box(parse_with(which, text)));
            }
        });
        speed_corpus.push(((*which).to_owned(), t));
        let t = timing::measure(rounds, per_round / 10 + 1, &mut || {
            let _ = std::hint::black_box(parse_with(which, &large));
        });
        speed_large.push(((*which).to_owned(), t));
    }
    let (base, p) = apply_fixture();
    let mut speed_apply = Vec::new();
    let t = timing::measure(rounds, per_round / 10 + 1, &mut || {
        let r = patch_parser::apply(&p, base.as_bytes());
        assert!(r.is_ok(), "ours does not apply the fixture: {r:?}");
    });
    speed_apply.push(("ours".to_owned(), t));
    let t = timing::measure(rounds, per_round / 10 + 1, &mut || {
        let r = diffy::Patch::from_str(&p)
            .map_err(|e| e.to_string())
            .and_then(|patch| diffy::apply(&base, &patch).map_err(|e| e.to_string()));
        assert!(r.is_ok(), "diffy does not apply the fixture: {r:?}");
    });
    speed_apply.push(("diffy".to_owned(), t));
    Ok(Report {
        rows,
        hostile,
        speed_corpus,
        speed_large,
        large_size: large.len(),
        speed_apply,
    })
}

/// The first line of a message, at most `n` characters (gitpatch quotes the input it stops at).
fn first_line(s: &str, n: usize) -> String {
    let line = s.lines().next().unwrap_or("");
    let mut out: String = line.chars().take(n).collect();
    if out.len() < s.len() {
        out.push_str("...");
    }
    out
}

fn brief_parsed(p: &Result<Parsed, String>) -> String {
    match p {
        Err(e) => format!("PANIC {e}"),
        Ok(Err(e)) => format!("error: {}", first_line(e, 120)),
        Ok(Ok(files)) => {
            let s: Vec<String> = files.iter().map(FileSum::show).collect();
            let s = s.join("; ");
            if s.len() > 240 {
                format!("{}...", &s[..s.floor_char_boundary(240)])
            } else {
                s
            }
        }
    }
}

fn brief_applied(a: &Result<Applied, String>, reference: &Applied) -> String {
    match a {
        Err(e) => format!("PANIC {e}"),
        Ok(Err(e)) => format!("error: {}", first_line(e, 120)),
        Ok(Ok(tree)) => match reference {
            Ok(r) => {
                let diff: Vec<String> = tree
                    .iter()
                    .filter(|(k, v)| r.get(*k) != Some(v))
                    .map(|(k, v)| format!("{k}: {v}"))
                    .chain(
                        r.keys()
                            .filter(|k| !tree.contains_key(*k))
                            .map(|k| format!("{k}: missing")),
                    )
                    .collect();
                format!("applied; differs from git in {}", diff.join(", "))
            }
            Err(_) => "applied".to_owned(),
        },
    }
}

pub fn print(r: &Report, out: &mut String) {
    let _ = writeln!(
        out,
        "## Unified-diff parser: ours against diffy, gitpatch and unidiff\n"
    );
    let _ = writeln!(
        out,
        "{} patches (the `patch` fuzz corpus and `bench/parsers/patch_corpus/unit`: our tests' \
         patches, our own diff's output, tricky cases), judged against `git apply` \
         (`--numstat --summary` for what a patch says, the workspace after it for applying).\n",
        r.rows.len()
    );
    let _ = writeln!(
        out,
        "| parser | reads as git does | refuses by design | refuses what git reads | reads what git refuses | reads differently | panics |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for which in IMPLS {
        let n = |v: Verdict| {
            r.rows
                .iter()
                .filter(|row| row.parsed.iter().any(|(w, _, x)| w == which && *x == v))
                .count()
        };
        let _ = writeln!(
            out,
            "| {which} | {} | {} | {} | {} | {} | {} |",
            n(Verdict::Agrees),
            n(Verdict::RefusesByDesign),
            n(Verdict::RefusesValid),
            n(Verdict::AcceptsInvalid),
            n(Verdict::Differs),
            n(Verdict::Panicked)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Applying (the workspace after the patch, against `git apply`'s):\n\n| applier | same as git | refuses by design | refuses what git applies | applies what git refuses | different result | panics |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for which in ["ours", "diffy"] {
        let n = |v: Verdict| {
            r.rows
                .iter()
                .filter(|row| row.applied.iter().any(|(w, _, x)| w == which && *x == v))
                .count()
        };
        let _ = writeln!(
            out,
            "| {which} | {} | {} | {} | {} | {} | {} |",
            n(Verdict::Agrees),
            n(Verdict::RefusesByDesign),
            n(Verdict::RefusesValid),
            n(Verdict::AcceptsInvalid),
            n(Verdict::Differs),
            n(Verdict::Panicked)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Speed, parse only (median):\n\n| parser | the corpus, one pass | a git diff of 200 files, 1,000 hunks ({}) |\n|---|---:|---:|",
        timing::bytes(r.large_size)
    );
    for ((which, c), (_, l)) in r.speed_corpus.iter().zip(&r.speed_large) {
        let _ = writeln!(
            out,
            "| {which} | {} | {} |",
            timing::show(c.median_ns),
            timing::show(l.median_ns)
        );
    }
    let _ = writeln!(out);
    let apply: Vec<String> = r
        .speed_apply
        .iter()
        .map(|(w, t)| format!("{w} {}", timing::show(t.median_ns)))
        .collect();
    let _ = writeln!(
        out,
        "Parse and apply in memory, one 4,000-line file, 100 hunks: {}.\n",
        apply.join(", ")
    );
    let _ = writeln!(out, "Hostile input (each parser in a child process):\n");
    let _ = writeln!(out, "| case | size | {} |", IMPLS.join(" | "));
    let _ = writeln!(out, "|---|---:|{}", "---|".repeat(IMPLS.len()));
    for h in &r.hostile {
        let cells: Vec<String> = h
            .results
            .iter()
            .map(|(_, o, failed, t)| {
                let t = t.map_or(String::new(), |t| format!(", {}", timing::show(t)));
                if *failed {
                    format!("**{o}**{t}")
                } else {
                    format!("{o}{t}")
                }
            })
            .collect();
        let size = if h.case == "random-20k" {
            "20k inputs".to_owned()
        } else {
            timing::bytes(h.size)
        };
        let _ = writeln!(out, "| {} | {size} | {} |", h.case, cells.join(" | "));
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "### Where a parser and git part\n");
    for row in &r.rows {
        let parts: Vec<String> = row
            .parsed
            .iter()
            .filter(|(_, _, v)| *v != Verdict::Agrees)
            .map(|(w, p, v)| format!("  - {w} ({}): {}", v.show(), brief_parsed(p)))
            .chain(
                row.applied
                    .iter()
                    .filter(|(_, _, v)| *v != Verdict::Agrees)
                    .map(|(w, a, v)| {
                        format!(
                            "  - {w} applying ({}): {}",
                            v.show(),
                            brief_applied(a, &row.git_apply)
                        )
                    }),
            )
            .collect();
        if parts.is_empty() {
            continue;
        }
        let git = match &row.git_parse {
            Ok(f) => f.iter().map(FileSum::show).collect::<Vec<_>>().join("; "),
            Err(e) => format!("error: {e}"),
        };
        let git_apply = match &row.git_apply {
            Ok(_) => "applies".to_owned(),
            Err(e) => format!("refuses: {e}"),
        };
        let _ = writeln!(
            out,
            "- {}: git reads `{git}`, {git_apply}\n{}",
            row.case,
            parts.join("\n")
        );
    }
    let _ = writeln!(out);
}
