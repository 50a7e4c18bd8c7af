//! Findings from real runs: each project of `tests/fixtures/findings/` (a few files with one or
//! two planted failures beside passing code) is copied into a native host-view sandbox of the
//! library API and checked with the real tool, and the exec's `findings` must hold exactly the
//! planted failures (kind, tool, name, file relative to the workspace, line), nothing else, the
//! runner's counts where it prints them, and the command's own exit code. The expectations are
//! written here, from the fixtures' sources, not from a run.
//!
//! The tools are those `scripts/findings-tools.sh` installs: Debian's python3-pytest, golang-go
//! and gcc; ruff and mypy in a venv and jest, vitest, typescript and eslint in an npm prefix, both
//! under `/opt/taskbox-findings-tools` (`TASKBOX_FINDINGS_TOOLS`), where a host-view sandbox sees
//! them; cargo, rustc and cargo-nextest as the host has them (rustup's `~/.cargo` and `~/.rustup`
//! are toolchain directories the default policy shows read-only). A test whose tool is missing
//! skips with the reason (a failure under `TASKBOX_REQUIRE_ALL=1`).
//!
//! Beside the fixtures: passing runs give no findings; a 200 MB log with one real failure in
//! its middle gives that failure, in bounded memory (measured in a child process of this test
//! binary that runs only that exec); and hostile output (a 1 MB test name, terminal escapes,
//! invalid UTF-8, a billion-laughs JUnit file, JUnit files that are symlinks out of the
//! workspace, a fifo) gives bounded findings or none, never a hang, and no symlink is followed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::result::{ExecResult, Finding, FindingKind, TestCounts};
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::{Env, require};

use FindingKind::{CompileError, Lint, TestError, TestFailed};

/// Where `scripts/findings-tools.sh` installs the PyPI and npm tools.
fn tools_dir() -> PathBuf {
    std::env::var_os("TASKBOX_FINDINGS_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/taskbox-findings-tools"))
}

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/findings")
        .join(name)
}

/// A program on the host's PATH.
fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// What a fixture's command needs on the host.
#[derive(Debug, Clone, Copy)]
enum Tool {
    /// `/usr/bin/python3` with pytest (Debian's python3-pytest).
    Pytest,
    /// `/usr/bin/python3`.
    Python,
    Cargo,
    Nextest,
    Go,
    Gcc,
    Node,
    /// A program of the tools' venv (`py/bin/NAME`).
    Venv(&'static str),
    /// A program of the tools' npm prefix (`node/node_modules/.bin/NAME`).
    Npm(&'static str),
}

/// Why `tool` cannot be used here, if it cannot.
fn missing(tool: Tool) -> Option<String> {
    let tools = tools_dir();
    let ok = match tool {
        Tool::Pytest => Command::new("/usr/bin/python3")
            .args(["-c", "import pytest"])
            .output()
            .is_ok_and(|o| o.status.success()),
        Tool::Python => Path::new("/usr/bin/python3").is_file(),
        Tool::Cargo => on_path("cargo").is_some(),
        Tool::Nextest => on_path("cargo-nextest").is_some(),
        Tool::Go => on_path("go").is_some(),
        Tool::Gcc => on_path("gcc").is_some(),
        Tool::Node => on_path("node").is_some(),
        Tool::Venv(name) => tools.join("py/bin").join(name).is_file(),
        Tool::Npm(name) => tools.join("node/node_modules/.bin").join(name).exists(),
    };
    (!ok).then(|| format!("{tool:?} is not installed (run scripts/findings-tools.sh)"))
}

/// Whether every tool of `needs` is there; skips (or fails) with the reason otherwise.
fn ready(needs: &[Tool]) -> bool {
    needs
        .iter()
        .filter_map(|t| missing(*t))
        .all(|reason| require(false, &reason))
}

/// The environment of a fixture's command: the tools first on PATH, `TOOLS` naming their
/// directory, a fixed backtrace setting (the policy passes the host's through).
fn exec_env() -> BTreeMap<String, String> {
    let tools = tools_dir();
    let mut path = vec![tools.join("py/bin"), tools.join("node/node_modules/.bin")];
    if let Some(cargo) = on_path("cargo") {
        path.push(cargo.parent().unwrap().to_path_buf());
    }
    path.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
    let path = std::env::join_paths(path).unwrap();
    BTreeMap::from([
        ("PATH".into(), path.to_string_lossy().into_owned()),
        ("TOOLS".into(), tools.display().to_string()),
        ("RUST_BACKTRACE".into(), "0".into()),
        // The sandbox's home is not writable: go's caches go to its /tmp.
        ("GOCACHE".into(), "/tmp/go-build".into()),
        ("GOPATH".into(), "/tmp/go".into()),
        ("NO_COLOR".into(), "1".into()),
    ])
}

/// One expected finding.
#[derive(Debug, Clone, Copy)]
struct Want {
    kind: FindingKind,
    tool: &'static str,
    name: Option<&'static str>,
    file: &'static str,
    line: u32,
}

const fn want(
    kind: FindingKind,
    tool: &'static str,
    name: &'static str,
    file: &'static str,
    line: u32,
) -> Want {
    Want {
        kind,
        tool,
        name: Some(name),
        file,
        line,
    }
}

/// What is compared of a finding.
type Key = (
    FindingKind,
    String,
    Option<String>,
    Option<String>,
    Option<u32>,
);

fn key(f: &Finding) -> Key {
    (
        f.kind,
        f.tool.clone(),
        f.name.clone(),
        f.location.as_ref().map(|l| l.file.clone()),
        f.location.as_ref().and_then(|l| l.line),
    )
}

fn want_key(w: &Want, under: &str) -> Key {
    (
        w.kind,
        w.tool.into(),
        w.name.map(String::from),
        Some(format!("{under}{}", w.file)),
        Some(w.line),
    )
}

const fn counts(passed: u64, failed: u64, errored: u64, skipped: u64) -> Option<TestCounts> {
    Some(TestCounts {
        passed,
        failed,
        errored,
        skipped,
    })
}

/// One fixture run: its project, its command (`sh -c`, in the fixture's directory), the exit
/// code the tool gives, what shows that it failed as planted (a line of its output, or of the
/// report file it wrote: `file:text`), the findings, and the counts (None: not checked, the
/// runner prints none that are unambiguous).
struct Case {
    fixture: &'static str,
    needs: &'static [Tool],
    script: &'static str,
    exit: i32,
    planted: &'static str,
    want: &'static [Want],
    counts: Option<TestCounts>,
}

/// A native host-view sandbox over the library API, with a scratch environment.
struct Sandbox {
    backend: NativeBackend,
    id: SandboxId,
    env: Env,
}

impl Sandbox {
    fn new(env: Env) -> Sandbox {
        let backend = NativeBackend::new(env.state()).unwrap();
        let id = backend
            .create(CreateRequest {
                workspace: env.ws().display().to_string(),
                ..CreateRequest::default()
            })
            .unwrap()
            .id;
        Sandbox { backend, id, env }
    }

    /// Runs `script` with `/bin/sh -c` in `cwd` (relative to the workspace) with the tools'
    /// environment; its result.
    fn sh(&self, cwd: &str, script: &str) -> ExecResult {
        let started = Instant::now();
        let r = taskbox_tests::finished(
            &self.backend,
            &self.id,
            ExecRequest {
                shell: Some(script.into()),
                cwd: (!cwd.is_empty()).then(|| cwd.into()),
                env: exec_env(),
                timeout_ms: Some(300_000),
                ..ExecRequest::default()
            },
        );
        eprintln!("ran in {:.1}s: {script}", started.elapsed().as_secs_f64());
        r
    }
}

/// Copies the directory `from` into `to` (created), recursively.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// The findings and the output of `r`, for a failure's message.
fn show(r: &ExecResult) -> String {
    let tail = |s: &str| {
        let cut = s.len().saturating_sub(6000);
        let cut = (cut..=s.len()).find(|&i| s.is_char_boundary(i)).unwrap();
        s[cut..].to_string()
    };
    format!(
        "exit {:?}\nfindings ({} omitted): {}\ntests: {:?}\n--- stdout (tail) ---\n{}\n--- stderr \
         (tail) ---\n{}",
        r.exit_code,
        r.findings_omitted,
        serde_json::to_string_pretty(&r.findings).unwrap(),
        r.tests,
        tail(&r.stdout.text),
        tail(&r.stderr.text),
    )
}

/// Asserts that the findings of `r` are exactly `want` (files under `under`, e.g. `sub/`),
/// in any order.
#[track_caller]
fn assert_findings(what: &str, r: &ExecResult, want: &[Want], under: &str) {
    let mut got: Vec<Key> = r.findings.iter().map(key).collect();
    let mut wanted: Vec<Key> = want.iter().map(|w| want_key(w, under)).collect();
    got.sort();
    wanted.sort();
    assert_eq!(
        got,
        wanted,
        "{what}: the findings differ from the planted failures (got left, planted right)\n{}",
        show(r)
    );
    assert_eq!(
        r.findings_omitted,
        0,
        "{what}: findings omitted\n{}",
        show(r)
    );
}

/// Asserts that every field of every finding of `r` is within its bound.
#[track_caller]
fn assert_bounded(what: &str, r: &ExecResult) {
    assert!(
        r.findings.len() <= 100,
        "{what}: {} findings",
        r.findings.len()
    );
    for f in &r.findings {
        let name = f.name.as_deref().unwrap_or_default();
        let file = f.location.as_ref().map_or("", |l| l.file.as_str());
        let excerpt = f.excerpt.as_deref().unwrap_or_default();
        assert!(
            name.len() <= 512
                && file.len() <= 512
                && f.message.len() <= 300
                && !f.message.contains('\n')
                && excerpt.len() <= 2048
                && excerpt.lines().count() <= 24,
            "{what}: a finding beyond its bounds: name {} B, file {} B, message {} B, excerpt {} \
             B in {} lines",
            name.len(),
            file.len(),
            f.message.len(),
            excerpt.len(),
            excerpt.lines().count()
        );
    }
}

/// Runs `case` on a copy of its fixture, at the workspace's root (`under` empty) or in a
/// subdirectory of it (`under` = `dir/`), and checks its result.
fn check(case: &Case, under: &str) {
    if !ready(case.needs) {
        return;
    }
    let sb = Sandbox::new(Env::new());
    copy_dir(&fixture_dir(case.fixture), &sb.env.ws().join(under));
    let r = sb.sh(under.trim_end_matches('/'), case.script);
    let what = format!("{} ({})", case.fixture, case.script);
    assert_eq!(
        r.exit_code,
        Some(case.exit),
        "{what}: not the tool's exit code\n{}",
        show(&r)
    );
    assert!(!r.timed_out, "{what}: timed out");
    let output = match case.planted.split_once(':') {
        Some((file, text)) if file.ends_with(".xml") => (
            sb.sh(under.trim_end_matches('/'), &format!("cat {file}"))
                .stdout
                .text,
            text,
        ),
        _ => (format!("{}{}", r.stdout.text, r.stderr.text), case.planted),
    };
    assert!(
        output.0.contains(output.1),
        "{what}: did not fail as planted: no {:?} in its output\n{}",
        output.1,
        show(&r)
    );
    assert_findings(&what, &r, case.want, under);
    if let Some(counts) = case.counts {
        assert_eq!(r.tests, Some(counts), "{what}: the counts\n{}", show(&r));
    }
    assert_bounded(&what, &r);
}

const PYTEST: Case = Case {
    fixture: "pytest",
    needs: &[Tool::Pytest],
    script: "/usr/bin/python3 -m pytest -p no:cacheprovider",
    exit: 1,
    planted: "1 failed, 2 passed, 1 error",
    want: &[
        want(
            TestFailed,
            "pytest",
            "tests/test_calc.py::test_add_negative",
            "tests/test_calc.py",
            18,
        ),
        // The fixture's `raise`: the test errors at setup.
        want(
            TestError,
            "pytest",
            "tests/test_calc.py::test_with_db",
            "tests/test_calc.py",
            10,
        ),
    ],
    counts: counts(2, 1, 1, 0),
};

const UNITTEST: Case = Case {
    fixture: "unittest",
    needs: &[Tool::Python],
    script: "/usr/bin/python3 -m unittest discover -s . -p 'test_*.py'",
    exit: 1,
    planted: "FAIL: test_title",
    want: &[want(
        TestFailed,
        "unittest",
        "tests.test_strings.StringsTest.test_title",
        "tests/test_strings.py",
        9,
    )],
    counts: counts(2, 1, 0, 0),
};

const CARGO_TEST: Case = Case {
    fixture: "cargo",
    needs: &[Tool::Cargo],
    script: "cargo test --offline",
    exit: 101,
    planted: "test result: FAILED. 2 passed; 1 failed",
    want: &[want(
        TestFailed,
        "cargo-test",
        "tests::adds_negative",
        "src/lib.rs",
        21,
    )],
    counts: counts(2, 1, 0, 0),
};

const CARGO_BUILD: Case = Case {
    fixture: "cargo",
    needs: &[Tool::Cargo],
    script: "cargo build --offline --features broken",
    exit: 101,
    planted: "error[E0308]",
    want: &[want(CompileError, "rustc", "E0308", "src/lib.rs", 7)],
    counts: None,
};

const NEXTEST: Case = Case {
    fixture: "cargo",
    needs: &[Tool::Cargo, Tool::Nextest],
    script: "cargo nextest run --offline --no-fail-fast",
    exit: 100,
    planted: "3 tests run: 2 passed, 1 failed",
    want: &[want(
        TestFailed,
        "nextest",
        "tests::adds_negative",
        "src/lib.rs",
        21,
    )],
    counts: counts(2, 1, 0, 0),
};

/// The failing subtest only: its parent fails because of it, and is no failure of its own.
const GO_WANT: &[Want] = &[want(
    TestFailed,
    "go-test",
    "TestAbs/negative",
    "calc/calc_test.go",
    13,
)];

const GO_TEST: Case = Case {
    fixture: "go",
    needs: &[Tool::Go],
    script: "go test ./...",
    exit: 1,
    planted: "--- FAIL: TestAbs/negative",
    want: GO_WANT,
    counts: None,
};

const GO_TEST_JSON: Case = Case {
    fixture: "go",
    needs: &[Tool::Go],
    script: "go test -json ./...",
    exit: 1,
    planted: "\"Action\":\"fail\",\"Package\":\"example.com/fx/calc\",\"Test\":\"TestAbs/negative\"",
    want: GO_WANT,
    counts: None,
};

const JEST: Case = Case {
    fixture: "jest",
    needs: &[Tool::Node, Tool::Npm("jest")],
    script: "jest --ci",
    exit: 1,
    planted: "Tests:       1 failed, 1 passed",
    want: &[want(TestFailed, "jest", "doubles two", "math.test.js", 8)],
    counts: counts(1, 1, 0, 0),
};

const VITEST: Case = Case {
    fixture: "vitest",
    needs: &[Tool::Node, Tool::Npm("vitest")],
    // The test file imports vitest: resolved through a node_modules link to the tools.
    script: "ln -s \"$TOOLS/node/node_modules\" node_modules && vitest run",
    exit: 1,
    planted: "1 failed | 1 passed",
    want: &[want(TestFailed, "vitest", "halves six", "math.test.js", 9)],
    counts: counts(1, 1, 0, 0),
};

/// pytest's JUnit XML alone (its terminal report thrown away): what the file says.
const JUNIT_PYTEST: Case = Case {
    fixture: "junit-pytest",
    needs: &[Tool::Pytest],
    script: "/usr/bin/python3 -m pytest -p no:cacheprovider --junitxml=reports/junit.xml \
             >/dev/null 2>&1",
    exit: 1,
    planted: "reports/junit.xml:failures=\"1\"",
    // A JUnit test case is named `classname.name`.
    want: &[want(
        TestFailed,
        "junit",
        "tests.test_parse.test_parse_padded",
        "tests/test_parse.py",
        10,
    )],
    counts: counts(1, 1, 0, 0),
};

/// pytest's terminal report and its JUnit XML together: the file repeats the report, and
/// adds nothing.
const JUNIT_PYTEST_AND_STREAM: Case = Case {
    fixture: "junit-pytest",
    needs: &[Tool::Pytest],
    script: "/usr/bin/python3 -m pytest -p no:cacheprovider --junitxml=reports/junit.xml",
    exit: 1,
    planted: "1 failed, 1 passed",
    want: &[want(
        TestFailed,
        "pytest",
        "tests/test_parse.py::test_parse_padded",
        "tests/test_parse.py",
        10,
    )],
    counts: counts(1, 1, 0, 0),
};

/// node's own test runner with its JUnit reporter to a file (nothing on stdout): the place is
/// the failure's stack frame in the workspace.
const JUNIT_NODE: Case = Case {
    fixture: "junit-node",
    needs: &[Tool::Node],
    script: "mkdir -p reports && node --test --test-reporter=junit \
             --test-reporter-destination=reports/junit.xml",
    exit: 1,
    planted: "reports/junit.xml:<!-- fail 1 -->",
    want: &[want(
        TestFailed,
        "junit",
        "test.parses hex",
        "test/parse.test.js",
        9,
    )],
    counts: counts(1, 1, 0, 0),
};

const GCC: Case = Case {
    fixture: "gcc",
    needs: &[Tool::Gcc],
    script: "gcc -Wall -c main.c util.c",
    exit: 1,
    planted: "undeclared",
    want: &[Want {
        kind: CompileError,
        tool: "gcc",
        name: None,
        file: "main.c",
        line: 7,
    }],
    counts: None,
};

const TSC: Case = Case {
    fixture: "tsc",
    needs: &[Tool::Node, Tool::Npm("tsc")],
    script: "tsc -p .",
    exit: 2,
    planted: "error TS2322",
    want: &[want(CompileError, "tsc", "TS2322", "src/count.ts", 5)],
    counts: None,
};

const MYPY: Case = Case {
    fixture: "mypy",
    needs: &[Tool::Venv("mypy")],
    script: "mypy .",
    exit: 1,
    planted: "Found 1 error in 1 file",
    want: &[want(CompileError, "mypy", "assignment", "app.py", 5)],
    counts: None,
};

const RUFF: Case = Case {
    fixture: "ruff",
    needs: &[Tool::Venv("ruff")],
    script: "ruff check .",
    exit: 1,
    planted: "F401",
    want: &[want(Lint, "ruff", "F401", "app.py", 2)],
    counts: None,
};

const ESLINT: Case = Case {
    fixture: "eslint",
    needs: &[Tool::Node, Tool::Npm("eslint")],
    script: "eslint .",
    exit: 1,
    planted: "no-unused-vars",
    want: &[want(Lint, "eslint", "no-unused-vars", "app.js", 2)],
    counts: None,
};

mod fixtures {
    use super::*;

    #[test]
    fn pytest() {
        check(&PYTEST, "");
    }

    /// The same run from a subdirectory of the workspace: files are the workspace's.
    #[test]
    fn pytest_in_a_subdirectory() {
        check(&PYTEST, "py/app/");
    }

    #[test]
    fn unittest() {
        check(&UNITTEST, "");
    }

    #[test]
    fn cargo_test() {
        check(&CARGO_TEST, "");
    }

    #[test]
    fn cargo_test_in_a_subdirectory() {
        check(&CARGO_TEST, "crates/fx/");
    }

    #[test]
    fn cargo_build_error() {
        check(&CARGO_BUILD, "");
    }

    #[test]
    fn nextest() {
        check(&NEXTEST, "");
    }

    #[test]
    fn go_test() {
        check(&GO_TEST, "");
    }

    #[test]
    fn go_test_json() {
        check(&GO_TEST_JSON, "");
    }

    #[test]
    fn jest() {
        check(&JEST, "");
    }

    #[test]
    fn vitest() {
        check(&VITEST, "");
    }

    #[test]
    fn junit_from_pytest() {
        check(&JUNIT_PYTEST, "");
    }

    #[test]
    fn junit_from_pytest_beside_its_report() {
        check(&JUNIT_PYTEST_AND_STREAM, "");
    }

    #[test]
    fn junit_from_node_test() {
        if !require(
            node_has_junit_reporter(),
            "node's test runner has no junit reporter (node 20.13 or later has it)",
        ) {
            return;
        }
        check(&JUNIT_NODE, "");
    }

    #[test]
    fn gcc() {
        check(&GCC, "");
    }

    #[test]
    fn tsc() {
        check(&TSC, "");
    }

    #[test]
    fn mypy() {
        check(&MYPY, "");
    }

    #[test]
    fn ruff() {
        check(&RUFF, "");
    }

    #[test]
    fn eslint() {
        check(&ESLINT, "");
    }
}

fn node_has_junit_reporter() -> bool {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.test.js"),
        "require('node:test')('t', () => {});\n",
    )
    .unwrap();
    Command::new("node")
        .args(["--test", "--test-reporter=junit", "a.test.js"])
        .current_dir(dir.path())
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("<testcase")
        })
}

/// The fixtures' passing parts, each tool on them: no findings, exit 0.
#[test]
fn passing_runs_give_no_findings() {
    let runs: &[(&str, &[Tool], &str)] = &[
        (
            "pytest",
            &[Tool::Pytest],
            "/usr/bin/python3 -m pytest -p no:cacheprovider tests/test_pass.py",
        ),
        (
            "unittest",
            &[Tool::Python],
            "/usr/bin/python3 -m unittest tests.test_strings.StringsTest.test_upper",
        ),
        ("cargo", &[Tool::Cargo], "cargo test --offline -- adds_zero"),
        (
            "cargo",
            &[Tool::Cargo, Tool::Nextest],
            "cargo nextest run --offline -E 'test(adds_zero)'",
        ),
        (
            "go",
            &[Tool::Go],
            "go test -run TestZero ./... && go test -json -run TestZero ./... && go vet ./...",
        ),
        (
            "jest",
            &[Tool::Node, Tool::Npm("jest")],
            "jest --ci -t 'doubles zero'",
        ),
        (
            "vitest",
            &[Tool::Node, Tool::Npm("vitest")],
            "ln -s \"$TOOLS/node/node_modules\" node_modules && vitest run -t 'halves zero'",
        ),
        (
            "junit-pytest",
            &[Tool::Pytest],
            "/usr/bin/python3 -m pytest -p no:cacheprovider --junitxml=reports/junit.xml -k plain",
        ),
        ("gcc", &[Tool::Gcc], "gcc -Wall -c util.c"),
        (
            "tsc",
            &[Tool::Node, Tool::Npm("tsc")],
            "tsc --strict --noEmit src/ok.ts",
        ),
        ("mypy", &[Tool::Venv("mypy")], "mypy ok.py"),
        ("ruff", &[Tool::Venv("ruff")], "ruff check ok.py"),
        ("eslint", &[Tool::Node, Tool::Npm("eslint")], "eslint ok.js"),
    ];
    let sb = Sandbox::new(Env::new());
    for (fixture, _, _) in runs {
        let to = sb.env.ws().join(fixture);
        if !to.exists() {
            copy_dir(&fixture_dir(fixture), &to);
        }
    }
    let mut failures = Vec::new();
    for (fixture, needs, script) in runs {
        if !ready(needs) {
            continue;
        }
        let r = sb.sh(fixture, script);
        if r.exit_code != Some(0) || !r.findings.is_empty() || r.findings_omitted != 0 {
            failures.push(format!("{fixture} ({script}):\n{}", show(&r)));
        }
    }
    assert!(
        failures.is_empty(),
        "passing runs with findings or a failure:\n{}",
        failures.join("\n\n")
    );
}

/// A test that fails in the middle of a log: the program that writes the log's halves, and
/// the test file, with the failure planted at line 5.
const MIDDLE_TEST: &str = "def ok():\n    return 1\n\n\ndef test_middle():\n    assert ok() == 2\n";
const MIDDLE_WANT: Want = want(
    TestFailed,
    "pytest",
    "tests/test_middle.py::test_middle",
    "tests/test_middle.py",
    6,
);

/// Writes `MB` megabytes of pytest-like passing lines, a real pytest run that fails, then as
/// many again.
const BIG_LOG: &str = r#"
import subprocess, sys
half = int(sys.argv[1]) * 1024 * 1024 // 2
def passing(start):
    out, n, i = sys.stdout, 0, start
    while n < half:
        block = "".join(
            "tests/test_bulk.py::test_case_%07d PASSED%s[ 50%%]\n" % (j, " " * 30)
            for j in range(i, i + 10000))
        out.write(block)
        n += len(block)
        i += 10000
    out.flush()
    return i
i = passing(0)
subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_middle.py"])
sys.stdout.flush()
passing(i)
sys.exit(1)
"#;

/// A JUnit XML file whose entities expand to about 3 GB (the billion laughs).
const BOMB: &str = r#"<?xml version="1.0"?>
<!DOCTYPE testsuites [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<testsuites><testsuite name="&lol9;" tests="1" failures="1">
<testcase classname="bomb.&lol9;" name="&lol9;" file="&lol9;"><failure message="&lol9;">&lol9;</failure></testcase>
</testsuite></testsuites>
"#;

/// The environment variable that makes [`memory_probe_child`] run a scenario.
const PROBE_VAR: &str = "TASKBOX_FINDINGS_PROBE";

/// A value of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Runs this test binary's [`memory_probe_child`] alone, on `scenario`, and returns the exec's
/// result, the growth of the child's peak RSS over the exec (KiB), and how many times the
/// planted failure is in the log (big-log only).
fn probe(scenario: &str) -> (ExecResult, u64, u64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "memory_probe_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PROBE_VAR, scenario)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| Some(l.split_once("PROBE ")?.1))
        .unwrap_or_else(|| {
            panic!(
                "the probe of {scenario} printed no result (exit {:?}):\n{stdout}\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let result = serde_json::from_value(v["result"].clone()).unwrap();
    (
        result,
        v["growth_kib"].as_u64().unwrap(),
        v["planted"].as_u64().unwrap(),
    )
}

/// The child side of [`probe`]: nothing unless [`PROBE_VAR`] names a scenario; then one
/// sandbox, one exec, and a line `PROBE {"result": .., "growth_kib": ..}` on stdout.
#[test]
fn memory_probe_child() {
    let Ok(scenario) = std::env::var(PROBE_VAR) else {
        return;
    };
    let env = Env::new();
    let script = match scenario.as_str() {
        "big-log" => {
            env.write("tests/test_middle.py", MIDDLE_TEST);
            env.write("gen.py", BIG_LOG);
            "/usr/bin/python3 gen.py 200".to_string()
        }
        "bomb" => {
            env.write("bomb.xml", BOMB);
            "mkdir -p reports && cp bomb.xml reports/junit.xml && exit 1".to_string()
        }
        other => panic!("no probe scenario {other}"),
    };
    let sb = Sandbox::new(env);
    // Warm up: the first exec maps what every exec uses.
    let _ = sb.sh("", "true");
    let before = status_kib("VmRSS");
    let r = sb.sh("", &script);
    let peak = status_kib("VmHWM");
    let growth = peak.saturating_sub(before);
    // The parent needs the findings and the sizes, not the kept output.
    let mut r = r;
    for out in [&mut r.stdout, &mut r.stderr] {
        out.text.truncate(out.text.floor_char_boundary(2000));
    }
    // That the real pytest failed in the middle of the log, as planted (read in the spill).
    let planted = match (scenario.as_str(), &r.stdout.spill_path) {
        ("big-log", Some(spill)) => sb
            .sh(
                "",
                &format!("grep -a -c 'tests/test_middle.py:6: AssertionError' {spill}"),
            )
            .stdout
            .text
            .trim()
            .parse::<u64>()
            .unwrap_or(0),
        _ => 0,
    };
    let line = serde_json::json!({"result": r, "growth_kib": growth, "planted": planted});
    println!("PROBE {line}");
}

/// The most the supervisor's (here: this process's) peak RSS may grow over one exec.
const MEMORY_BOUND_KIB: u64 = 64 * 1024;

#[test]
fn a_failure_in_the_middle_of_a_200_mb_log_is_found_in_bounded_memory() {
    if !ready(&[Tool::Pytest]) {
        return;
    }
    let started = Instant::now();
    let (r, growth, planted) = probe("big-log");
    eprintln!(
        "200 MB log: {:.1}s, peak RSS grew {} KiB, {} bytes of stdout",
        started.elapsed().as_secs_f64(),
        growth,
        r.stdout.bytes
    );
    assert!(r.stdout.bytes >= 200 * 1024 * 1024, "{}", r.stdout.bytes);
    assert!(r.stdout.truncated, "the log was not cut");
    assert_eq!(
        planted, 1,
        "the real pytest did not fail in the log's middle"
    );
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert_findings("200 MB log", &r, &[MIDDLE_WANT], "");
    assert!(
        growth < MEMORY_BOUND_KIB,
        "reading a 200 MB log grew the peak RSS by {growth} KiB (bound {MEMORY_BOUND_KIB} KiB)"
    );
}

#[test]
fn a_billion_laughs_junit_file_is_not_expanded() {
    let started = Instant::now();
    let (r, growth, _) = probe("bomb");
    let took = started.elapsed();
    eprintln!("bomb: {took:?}, peak RSS grew {growth} KiB");
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert!(took < Duration::from_secs(60), "the bomb took {took:?}");
    assert_bounded("bomb", &r);
    assert!(
        r.findings.len() <= 1,
        "the bomb gave findings: {}",
        show(&r)
    );
    assert!(
        growth < MEMORY_BOUND_KIB,
        "the bomb grew the peak RSS by {growth} KiB (bound {MEMORY_BOUND_KIB} KiB)"
    );
}

/// A real pytest run of a test whose id is 1 MB long, and a line of 1 MB that looks like a
/// summary line: bounded findings, and the real one found at its file and line.
#[test]
fn a_test_name_of_one_megabyte_gives_bounded_findings() {
    if !ready(&[Tool::Pytest]) {
        return;
    }
    let sb = Sandbox::new(Env::new());
    sb.env.write(
        "tests/test_long.py",
        "import pytest\n\n\n@pytest.mark.parametrize(\"x\", [1], ids=[\"n\" * 1_000_000])\ndef \
         test_long(x):\n    assert x == 2\n",
    );
    let started = Instant::now();
    let r = sb.sh(
        "",
        "/usr/bin/python3 -m pytest -p no:cacheprovider tests/test_long.py; status=$?; \
         printf 'FAILED tests/test_fake.py::'; head -c 1048576 /dev/zero | tr '\\0' x; \
         printf ' - assert 1 == 2\\n'; exit $status",
    );
    assert!(started.elapsed() < Duration::from_secs(120));
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert_bounded("1 MB name", &r);
    let real: Vec<&Finding> = r
        .findings
        .iter()
        .filter(|f| {
            f.location
                .as_ref()
                .is_some_and(|l| l.file == "tests/test_long.py" && l.line == Some(6))
        })
        .collect();
    assert_eq!(
        real.len(),
        1,
        "the real failure at tests/test_long.py:6, once\n{}",
        show(&r)
    );
    assert!(r.findings.len() <= 2, "{}", show(&r));
}

/// Colour forced on (pytest, gcc, cargo) and escapes of every sort around a report: the same
/// findings as without.
#[test]
fn terminal_escapes_change_nothing() {
    if !ready(&[Tool::Pytest, Tool::Gcc]) {
        return;
    }
    let sb = Sandbox::new(Env::new());
    copy_dir(&fixture_dir("pytest"), &sb.env.ws().join("pytest"));
    copy_dir(&fixture_dir("gcc"), &sb.env.ws().join("gcc"));
    let r = sb.sh(
        "pytest",
        "printf '\\033]0;title\\007\\033[2J\\033[H\\033[?25l'; /usr/bin/python3 -m pytest -p \
         no:cacheprovider --color=yes; s=$?; printf '\\033[0m\\033[?25h\\r\\033[K'; exit $s",
    );
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert!(r.stdout.text.contains("\u{1b}["), "no colour was forced");
    assert_findings("pytest --color=yes", &r, PYTEST.want, "pytest/");
    assert_eq!(r.tests, PYTEST.counts, "{}", show(&r));
    let r = sb.sh(
        "gcc",
        "gcc -fdiagnostics-color=always -Wall -c main.c util.c",
    );
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert!(r.stderr.text.contains("\u{1b}["), "no colour was forced");
    assert_findings("gcc colour", &r, GCC.want, "gcc/");
    if ready(&[Tool::Cargo]) {
        copy_dir(&fixture_dir("cargo"), &sb.env.ws().join("cargo"));
        let r = sb.sh("cargo", "cargo test --offline --color=always");
        assert_eq!(r.exit_code, Some(101), "{}", show(&r));
        assert_findings("cargo test colour", &r, CARGO_TEST.want, "cargo/");
    }
}

/// Invalid UTF-8 around and inside a real report: the report found, nothing else.
#[test]
fn invalid_utf8_changes_nothing() {
    if !ready(&[Tool::Pytest]) {
        return;
    }
    let sb = Sandbox::new(Env::new());
    copy_dir(&fixture_dir("pytest"), &sb.env.ws());
    let r = sb.sh(
        "",
        "printf '\\377\\376\\000garbage \\300\\200 FAILED \\355\\240\\200\\n'; /usr/bin/python3 \
         -m pytest -p no:cacheprovider; s=$?; printf '\\377 error[\\377: \\nFAILED \\377\\n' \
         >&2; exit $s",
    );
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    assert_bounded("invalid UTF-8", &r);
    assert_findings("invalid UTF-8", &r, PYTEST.want, "");
}

/// JUnit files that are symlinks (to a host file outside the workspace, to `/etc/passwd`, a
/// directory of reports on the host), and a fifo, beside a real report: the real one is read,
/// no link is followed, nothing hangs.
#[test]
fn junit_symlinks_out_of_the_workspace_are_not_followed() {
    if !ready(&[Tool::Pytest]) {
        return;
    }
    let env = Env::new();
    let host_dir = env.dir.path().join("host-reports");
    std::fs::create_dir(&host_dir).unwrap();
    let secret = "<?xml version=\"1.0\"?><testsuite name=\"s\" tests=\"1\" failures=\"1\">\
                  <testcase classname=\"secret\" name=\"HOST_SECRET_CASE\" file=\"secret.py\" \
                  line=\"3\"><failure message=\"HOST_SECRET\">HOST_SECRET</failure></testcase>\
                  </testsuite>";
    std::fs::write(host_dir.join("junit.xml"), secret).unwrap();
    copy_dir(&fixture_dir("junit-pytest"), &env.ws());
    let host_file = host_dir.join("junit.xml");
    let sb = Sandbox::new(env);
    let script = format!(
        "mkdir -p reports out && ln -s {file} reports/host.xml && ln -s /etc/passwd \
         reports/passwd.xml && ln -s {dir} out/dir && ln -s {dir} reports.xml && mkfifo \
         reports/fifo.xml && /usr/bin/python3 -m pytest -p no:cacheprovider \
         --junitxml=reports/real.xml >/dev/null 2>&1",
        file = host_file.display(),
        dir = host_dir.display(),
    );
    let started = Instant::now();
    let r = sb.sh("", &script);
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(r.exit_code, Some(1), "{}", show(&r));
    let text = serde_json::to_string(&r.findings).unwrap();
    assert!(
        !text.contains("HOST_SECRET") && !text.contains("root:"),
        "a symlink's target was read: {}",
        show(&r)
    );
    assert_findings("symlinked reports", &r, JUNIT_PYTEST.want, "");
}
