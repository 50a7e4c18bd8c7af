#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use super::*;
use crate::testutil::{change, write};

use ChangeKind::{Added, Deleted, Modified};

/// An upper and a lower directory (plain directories: an upper layer without whiteouts).
struct Layers {
    _tmp: tempfile::TempDir,
    upper: PathBuf,
    lower: PathBuf,
}

fn layers() -> Layers {
    let tmp = tempfile::tempdir().unwrap();
    let (upper, lower) = (tmp.path().join("upper"), tmp.path().join("lower"));
    fs::create_dir(&upper).unwrap();
    fs::create_dir(&lower).unwrap();
    Layers {
        _tmp: tmp,
        upper,
        lower,
    }
}

fn paths(list: &[Change]) -> Vec<&str> {
    list.iter().map(|c| c.path.as_str()).collect()
}

fn run(l: &Layers, changes: Vec<Change>) -> Review {
    review(&l.upper, &l.lower, changes, &TrackedFiles::default()).unwrap()
}

#[test]
fn git_internals_are_left_out() {
    let l = layers();
    let r = run(
        &l,
        vec![
            change(".git/index", Modified),
            change("src/lib.rs", Modified),
            change("vendor/sub/.git/HEAD", Modified),
        ],
    );
    assert_eq!(paths(&r.shown), ["src/lib.rs"]);
    assert_eq!(paths(&r.ignored), [".git/index", "vendor/sub/.git/HEAD"]);
}

#[test]
fn nested_ignore_files_with_git_precedence() {
    let l = layers();
    write(&l.lower, ".gitignore", "*.log\n/build/\n");
    write(&l.lower, "a/.gitignore", "!keep.log\n*.tmp\n");
    write(&l.lower, "a/b/.gitignore", "keep.log\n");
    let r = run(
        &l,
        vec![
            change("x.log", Added),
            change("a/keep.log", Added),
            change("a/b/keep.log", Added),
            change("a/c.tmp", Added),
            change("c.tmp", Added),
            change("build/out.o", Added),
            change("src/build/out.o", Added),
        ],
    );
    // `/build/` is anchored at the root; the deepest file with a matching line decides.
    assert_eq!(
        paths(&r.ignored),
        ["x.log", "a/b/keep.log", "a/c.tmp", "build/out.o"]
    );
    assert_eq!(paths(&r.shown), ["a/keep.log", "c.tmp", "src/build/out.o"]);
}

#[test]
fn nothing_beneath_an_ignored_directory_is_re_included() {
    let l = layers();
    write(&l.lower, ".gitignore", "out/\n");
    write(&l.lower, "out/.gitignore", "!x\n");
    let r = run(&l, vec![change("out/x", Added)]);
    assert_eq!(paths(&r.ignored), ["out/x"]);
}

#[test]
fn the_upper_layers_ignore_file_wins_and_info_exclude_counts() {
    let l = layers();
    write(&l.lower, ".gitignore", "*.pyc\n");
    // The sandbox replaced it: *.pyc no longer ignored, *.out is.
    write(&l.upper, ".gitignore", "*.out\n");
    write(&l.lower, ".git/info/exclude", "secret.txt\n");
    let r = run(
        &l,
        vec![
            change("a.pyc", Added),
            change("b.out", Added),
            change("secret.txt", Added),
        ],
    );
    assert_eq!(paths(&r.shown), ["a.pyc"]);
    assert_eq!(paths(&r.ignored), ["b.out", "secret.txt"]);
}

#[test]
fn without_an_index_a_file_the_base_had_is_never_left_out() {
    let l = layers();
    write(&l.lower, ".gitignore", "*.dat\n");
    let r = run(
        &l,
        vec![
            change("old.dat", Modified),
            change("gone.dat", Deleted),
            change("new.dat", Added),
        ],
    );
    assert_eq!(paths(&r.shown), ["gone.dat", "old.dat"]);
    assert_eq!(paths(&r.ignored), ["new.dat"]);
}

#[test]
fn a_file_the_git_index_tracks_is_never_left_out() {
    if Command::new("git").arg("--version").output().is_err() {
        crate::testutil::skip("git is not available");
        return;
    }
    let l = layers();
    let git = |args: &[&str]| {
        let s = Command::new("git")
            .arg("-C")
            .arg(&l.lower)
            .args(args)
            .output()
            .unwrap();
        assert!(s.status.success(), "git {args:?}: {s:?}");
    };
    git(&["init", "-q"]);
    write(&l.lower, ".gitignore", "*.dat\nbuild/\n");
    write(&l.lower, "tracked.dat", "x");
    write(&l.lower, "build/stale.o", "x");
    git(&["add", "-f", ".gitignore", "tracked.dat"]);
    let r = run(
        &l,
        vec![
            change("build/stale.o", Modified),
            change("tracked.dat", Modified),
            change("untracked.dat", Added),
        ],
    );
    assert_eq!(paths(&r.shown), ["tracked.dat"]);
    assert_eq!(paths(&r.ignored), ["build/stale.o", "untracked.dat"]);
}

#[test]
fn files_that_run_on_their_own_are_flagged_shown_or_not() {
    let l = layers();
    write(&l.lower, ".gitignore", ".vscode/\n");
    let r = run(
        &l,
        vec![
            change(".envrc", Added),
            change("sub/dir/.envrc", Modified),
            change(".vscode/tasks.json", Added),
            change(".git/hooks/pre-commit", Added),
            change(".github/workflows/ci.yml", Modified),
            change("docs/.github/workflows/x.yml", Added),
            change(".gitlab-ci.yml", Deleted),
            change("src/main.rs", Modified),
        ],
    );
    let flagged: Vec<(&str, bool)> = r
        .flagged
        .iter()
        .map(|f| (f.path.as_str(), f.ignored))
        .collect();
    assert_eq!(
        flagged,
        [
            (".envrc", false),
            (".git/hooks/pre-commit", true),
            (".github/workflows/ci.yml", false),
            (".vscode/tasks.json", true),
            ("sub/dir/.envrc", false),
        ]
    );
    assert!(r.flagged[0].reason.contains("direnv"), "{:?}", r.flagged[0]);
}

#[test]
fn every_autorun_glob_builds() {
    assert!(AUTORUN_SET.is_some());
    assert_eq!(AUTORUN_SET.as_ref().unwrap().len(), AUTORUN.len());
}

#[test]
fn an_unreadable_ignore_file_never_fails_the_review() {
    let l = layers();
    write(&l.upper, ".gitignore", "*.log\n");
    crate::testutil::chmod(&l.upper.join(".gitignore"), 0o000);
    write(&l.upper, "sub/.gitignore", "*.log\n");
    crate::testutil::chmod(&l.upper.join("sub"), 0o000);
    let r = review(
        &l.upper,
        &l.lower,
        vec![change("a.log", Added), change("sub/b.log", Added)],
        &TrackedFiles::default(),
    );
    crate::testutil::chmod(&l.upper.join("sub"), 0o755);
    // Read as root (the rules apply) or not at all (nothing hidden): never an error.
    let r = r.unwrap();
    assert_eq!(r.shown.len() + r.ignored.len(), 2);
}

#[test]
fn a_line_cut_by_the_size_bound_is_no_pattern() {
    let l = layers();
    // "*.log" straddles the bound: cut after its "*", it would hide every file.
    let pad = crate::ignores::MAX_IGNORE_FILE as usize - 1;
    let text = format!("#{}\n*.log\nnever\n", "p".repeat(pad - 2));
    write(&l.upper, ".gitignore", &text);
    let r = run(&l, vec![change("a.txt", Added), change("b.log", Added)]);
    assert_eq!(paths(&r.shown), ["a.txt", "b.log"]);
}

#[test]
fn ignore_files_past_the_review_bound_hide_nothing() {
    // One large ignore file in 300 directories, hard links costing no space: each was read
    // and built into a matcher (seconds of the supervisor's time per review).
    let l = layers();
    let dirs: Vec<String> = (0..300).map(|n| format!("d{n}")).collect();
    crate::testutil::linked_ignore_files(&l.upper, &dirs);
    let changes: Vec<Change> = (0..300)
        .map(|n| change(&format!("d{n}/a.tmp"), Added))
        .collect();
    let t = std::time::Instant::now();
    let r = run(&l, changes);
    let took = t.elapsed();
    // The first file is read whole; the second up to the bound (its first line still in);
    // the rest have no rules, so what they would hide is shown.
    assert_eq!(paths(&r.ignored), ["d0/a.tmp", "d1/a.tmp"]);
    assert_eq!(r.shown.len(), 298);
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
}
