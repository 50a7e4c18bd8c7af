//! The test runners' readers on the real output of each runner (captured from tiny projects
//! with planted failures, seen at /workspace, under tests/runners/): the findings and counts
//! each gives, nothing from a passing run, nothing from another runner's reader, and the same
//! on hostile variants of the output (colour, CRLF, invalid UTF-8, a cut log, a huge name).

use std::path::PathBuf;

use taskbox_findings::{
    FindingKind, Findings, MAX_NAME, Paths, Scanner, TestCounts, read_bytes, runners,
};

use FindingKind::{CompileError, TestError, TestFailed};

fn data(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/runners")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

fn paths() -> Paths {
    Paths::new("/workspace", "/workspace")
}

/// Only the runners' readers (the diagnostics' readers are tested on their own).
fn scan(bytes: &[u8]) -> Findings {
    let mut s = Scanner::with_readers(paths(), runners::readers());
    s.feed(bytes);
    s.finish()
}

type Row<'a> = (
    FindingKind,
    &'a str,
    Option<&'a str>,
    &'a str,
    Option<u32>,
    &'a str,
);

fn rows(f: &Findings) -> Vec<Row<'_>> {
    f.findings
        .iter()
        .map(|x| {
            let (file, line) = x
                .location
                .as_ref()
                .map_or(("", None), |l| (l.file.as_str(), l.line));
            (
                x.kind,
                x.tool.as_str(),
                x.name.as_deref(),
                file,
                line,
                x.message.as_str(),
            )
        })
        .collect()
}

fn counts(passed: u64, failed: u64, errored: u64, skipped: u64) -> Option<TestCounts> {
    Some(TestCounts {
        passed,
        failed,
        errored,
        skipped,
    })
}

struct Case {
    file: &'static str,
    rows: Vec<Row<'static>>,
    tests: Option<TestCounts>,
}

const PY: &str = "tests/test_calc.py";

fn pytest_rows(summary_only: bool, setup_line: bool) -> Vec<Row<'static>> {
    let l = |n| if summary_only { None } else { Some(n) };
    vec![
        (
            TestFailed,
            "pytest",
            Some("tests/test_calc.py::test_add_wrong"),
            PY,
            l(17),
            "assert 3 == 4",
        ),
        (
            TestFailed,
            "pytest",
            Some("tests/test_calc.py::test_helper"),
            PY,
            l(9),
            if summary_only {
                "AssertionError: helper saw a wrong v..."
            } else {
                "AssertionError: helper saw a wrong value"
            },
        ),
        (
            TestFailed,
            "pytest",
            Some("tests/test_calc.py::TestGroup::test_in_class"),
            PY,
            l(41),
            if summary_only {
                "AssertionError: assert ..."
            } else {
                "AssertionError: assert {'a': 1} == {'a': 2}"
            },
        ),
        (
            TestError,
            "pytest",
            Some("tests/test_calc.py::test_uses_broken"),
            PY,
            if setup_line { l(26) } else { None },
            "RuntimeError: fixture exploded",
        ),
    ]
}

fn cargo_rows(tool: &'static str, doctest: bool) -> Vec<Row<'static>> {
    let mut v = vec![
        (
            TestFailed,
            tool,
            Some("tests::adds_wrong"),
            "src/lib.rs",
            Some(27),
            "assertion `left == right` failed: sum of 1 and 2",
        ),
        (
            TestFailed,
            tool,
            Some("tests::checks"),
            "src/lib.rs",
            Some(12),
            "value too big: 5",
        ),
        (
            TestFailed,
            tool,
            Some("integration_bad"),
            "tests/it.rs",
            Some(9),
            "called `Result::unwrap()` on an `Err` value: \"boom\"",
        ),
    ];
    if doctest {
        v.push((
            TestFailed,
            tool,
            Some("src/lib.rs - add (line 3)"),
            "src/lib.rs",
            Some(3),
            "assertion `left == right` failed",
        ));
    }
    v
}

fn go_rows() -> Vec<Row<'static>> {
    vec![
        (
            TestFailed,
            "go-test",
            Some("TestAddWrong"),
            "calc/calc_test.go",
            Some(14),
            "Add(1, 2) = 3, want 4",
        ),
        (
            TestFailed,
            "go-test",
            Some("TestTable/big"),
            "calc/calc_test.go",
            Some(26),
            "got 4",
        ),
        (
            TestError,
            "go-test",
            Some("TestPanics"),
            "calc/calc.go",
            Some(5),
            "panic: runtime error: integer divide by zero",
        ),
    ]
}

fn jest_rows() -> Vec<Row<'static>> {
    vec![
        (
            TestFailed,
            "jest",
            Some("add › adds wrong"),
            "src/calc.test.js",
            Some(9),
            "expect(received).toBe(expected) // Object.is equality",
        ),
        (
            TestFailed,
            "jest",
            Some("parses"),
            "src/calc.js",
            Some(5),
            "not a number: x",
        ),
        (
            TestFailed,
            "jest",
            Some("objects"),
            "src/calc.test.js",
            Some(20),
            "expect(received).toEqual(expected) // deep equality",
        ),
    ]
}

fn vitest_rows() -> Vec<Row<'static>> {
    vec![
        (
            TestFailed,
            "vitest",
            Some("add > adds wrong"),
            "src/calc.test.ts",
            Some(10),
            "AssertionError: expected 3 to be 4 // Object.is equality",
        ),
        (
            TestFailed,
            "vitest",
            Some("parses"),
            "src/calc.ts",
            Some(6),
            "Error: not a number: x",
        ),
        (
            TestFailed,
            "vitest",
            Some("objects"),
            "src/calc.test.ts",
            Some(21),
            "AssertionError: expected { a: 1, b: [ 1, 2 ] } to deeply equal { a: 1, b: [ 1, 3 ] }",
        ),
    ]
}

fn unittest_rows() -> Vec<Row<'static>> {
    vec![
        (
            TestFailed,
            "unittest",
            Some("pkg.test_mod.TestCalc.test_equal"),
            "pkg/test_mod.py",
            Some(11),
            "AssertionError: 3 != 4",
        ),
        (
            TestFailed,
            "unittest",
            Some("pkg.test_mod.TestCalc.test_sub (i=1)"),
            "pkg/test_mod.py",
            Some(23),
            "AssertionError: False is not true : odd one out",
        ),
        (
            TestError,
            "unittest",
            Some("pkg.test_mod.TestCalc.test_raises"),
            "pkg/util.py",
            Some(2),
            "ValueError: invalid literal for int() with base 10: 'x'",
        ),
    ]
}

fn cases() -> Vec<Case> {
    let py = counts(1, 3, 1, 1);
    let mut v = Vec::new();
    for f in [
        "pytest_default.txt",
        "pytest_q.txt",
        "pytest_v.txt",
        "pytest_rA.txt",
        "pytest_tb_short.txt",
        "pytest_color.txt",
    ] {
        v.push(Case {
            file: f,
            rows: pytest_rows(false, true),
            tests: py,
        });
    }
    v.push(Case {
        file: "pytest_tb_line.txt",
        rows: pytest_rows(false, false),
        tests: py,
    });
    v.push(Case {
        file: "pytest_tb_no.txt",
        rows: pytest_rows(true, false),
        tests: py,
    });
    v.push(Case {
        file: "pytest_collect_error.txt",
        rows: vec![(
            TestError,
            "pytest",
            Some("tests/test_collect.py"),
            "tests/test_collect.py",
            Some(1),
            "ModuleNotFoundError: No module named 'nonexistent_module_xyz'",
        )],
        tests: counts(0, 0, 1, 0),
    });
    v.push(Case {
        file: "pytest_syntax_error.txt",
        rows: vec![(
            TestError,
            "pytest",
            Some("tests/test_syntax.py"),
            "tests/test_syntax.py",
            Some(1),
            "SyntaxError: invalid syntax",
        )],
        tests: counts(0, 0, 1, 0),
    });
    for f in ["pytest_pass.txt", "pytest_pass_v.txt"] {
        v.push(Case {
            file: f,
            rows: vec![],
            tests: counts(2, 0, 0, 1),
        });
    }
    for f in ["unittest_default.txt", "unittest_v.txt"] {
        v.push(Case {
            file: f,
            rows: unittest_rows(),
            // Expected failures count as skipped.
            tests: counts(1, 2, 1, 2),
        });
    }
    v.push(Case {
        file: "unittest_import_error.txt",
        rows: vec![(
            TestError,
            "unittest",
            Some("pkg.test_broken"),
            "pkg/test_broken.py",
            Some(1),
            "ModuleNotFoundError: No module named 'missing_mod_abc'",
        )],
        tests: counts(0, 0, 1, 0),
    });
    for f in ["unittest_pass.txt", "unittest_pass_v.txt"] {
        v.push(Case {
            file: f,
            rows: vec![],
            tests: counts(1, 0, 0, 1),
        });
    }
    for f in ["cargo_test.txt", "cargo_test_q.txt", "cargo_test_color.txt"] {
        v.push(Case {
            file: f,
            rows: cargo_rows("cargo-test", true),
            tests: counts(3, 4, 0, 1),
        });
    }
    let mut bt = cargo_rows("cargo-test", false);
    bt.truncate(2);
    v.push(Case {
        file: "cargo_test_backtrace.txt",
        rows: bt,
        tests: counts(2, 2, 0, 1),
    });
    v.push(Case {
        file: "cargo_test_pass.txt",
        rows: vec![],
        tests: counts(7, 0, 0, 1),
    });
    v.push(Case {
        file: "nextest.txt",
        rows: cargo_rows("nextest", false),
        tests: counts(3, 3, 0, 1),
    });
    let mut color = cargo_rows("nextest", false);
    color.rotate_left(1);
    v.push(Case {
        file: "nextest_color.txt",
        rows: color,
        tests: counts(3, 3, 0, 1),
    });
    let mut ff = cargo_rows("nextest", false);
    ff.truncate(2);
    v.push(Case {
        file: "nextest_failfast.txt",
        rows: ff,
        tests: counts(1, 2, 0, 1),
    });
    v.push(Case {
        file: "nextest_pass.txt",
        rows: vec![],
        tests: counts(6, 0, 0, 1),
    });
    // Without -v, go test says nothing of what passed: no counts.
    v.push(Case {
        file: "go_test.txt",
        rows: go_rows(),
        tests: None,
    });
    for f in ["go_test_v.txt", "go_test_json.txt"] {
        v.push(Case {
            file: f,
            rows: go_rows(),
            // Parents and subtests each count.
            tests: counts(3, 4, 0, 1),
        });
    }
    for f in ["go_test_pass_v.txt", "go_test_pass_json.txt"] {
        v.push(Case {
            file: f,
            rows: vec![],
            tests: counts(1, 0, 0, 0),
        });
    }
    for f in ["go_test_build.txt", "go_test_build_json.txt"] {
        v.push(Case {
            file: f,
            rows: vec![(
                CompileError,
                "go",
                None,
                "b/b.go",
                Some(4),
                "undefined: foo",
            )],
            tests: None,
        });
    }
    for f in ["jest.txt", "jest_color.txt"] {
        v.push(Case {
            file: f,
            rows: jest_rows(),
            tests: counts(2, 3, 0, 1),
        });
    }
    v.push(Case {
        file: "jest_verbose.txt",
        rows: jest_rows(),
        tests: counts(1, 3, 0, 1),
    });
    v.push(Case {
        file: "jest_suite_error.txt",
        rows: vec![(
            TestError,
            "jest",
            None,
            "src/broken.test.js",
            Some(1),
            "Cannot find module './missing' from 'src/broken.test.js'",
        )],
        tests: counts(1, 0, 1, 0),
    });
    v.push(Case {
        file: "jest_pass.txt",
        rows: vec![],
        tests: counts(1, 0, 0, 0),
    });
    for f in ["vitest.txt", "vitest_color.txt"] {
        v.push(Case {
            file: f,
            rows: vitest_rows(),
            tests: counts(2, 3, 0, 1),
        });
    }
    v.push(Case {
        file: "vitest_suite_error.txt",
        rows: vec![(
            TestError,
            "vitest",
            None,
            "src/broken.test.ts",
            Some(2),
            "Error: Cannot find module './missing' imported from /workspace/src/broken.test.ts",
        )],
        tests: counts(1, 0, 1, 0),
    });
    v.push(Case {
        file: "vitest_pass.txt",
        rows: vec![],
        tests: counts(1, 0, 0, 0),
    });
    v
}

/// Every sample through every runner's reader: exactly its own findings and counts.
#[test]
fn each_runner_gives_its_findings_and_nothing_else() {
    for c in cases() {
        let f = scan(&data(c.file));
        assert_eq!(rows(&f), c.rows, "{}", c.file);
        assert_eq!(f.tests, c.tests, "{}", c.file);
        assert_eq!(f.omitted, 0, "{}", c.file);
    }
}

/// With every reader (the diagnostics' too), the runners' findings stay the same.
#[test]
fn all_readers_keep_the_runners_findings() {
    let tools = [
        "pytest",
        "unittest",
        "cargo-test",
        "nextest",
        "go-test",
        "go",
        "jest",
        "vitest",
    ];
    for c in cases() {
        let f = read_bytes(&data(c.file), &paths());
        let mine: Vec<_> = rows(&f)
            .into_iter()
            .filter(|r| tools.contains(&r.1))
            .collect();
        assert_eq!(mine, c.rows, "{}", c.file);
    }
}

#[test]
fn excerpts_hold_the_assertion_and_the_frames() {
    let excerpt = |file: &str, name: &str| -> String {
        let f = scan(&data(file));
        f.findings
            .iter()
            .find(|x| x.name.as_deref() == Some(name))
            .and_then(|x| x.excerpt.clone())
            .unwrap_or_default()
    };
    let e = excerpt("pytest_default.txt", "tests/test_calc.py::test_helper");
    assert!(e.contains(">       helper_check(add(2, 2))"), "{e}");
    assert!(e.contains("E       assert 4 == 3"), "{e}");
    let e = excerpt("pytest_syntax_error.txt", "tests/test_syntax.py");
    assert!(!e.contains("site-packages"), "{e}");
    let e = excerpt("cargo_test.txt", "tests::adds_wrong");
    assert!(e.contains("  left: 3") && e.contains(" right: 4"), "{e}");
    let e = excerpt("cargo_test_backtrace.txt", "tests::checks");
    assert!(e.contains("calc::check at ./src/lib.rs:12:9"), "{e}");
    assert!(!e.contains("/rustc/"), "{e}");
    let e = excerpt("unittest_default.txt", "pkg.test_mod.TestCalc.test_raises");
    assert!(e.contains("File \"/workspace/pkg/util.py\", line 2"), "{e}");
    let e = excerpt("go_test.txt", "TestTable/big");
    assert!(e.contains("want 5"), "{e}");
    let e = excerpt("go_test_json.txt", "TestPanics");
    assert!(e.contains("calc/calc.go:5"), "{e}");
    let e = excerpt("jest.txt", "add › adds wrong");
    assert!(
        e.contains("Expected: 4") && e.contains("Received: 3"),
        "{e}"
    );
    assert!(e.contains(">  9 |"), "{e}");
    let e = excerpt("vitest.txt", "add > adds wrong");
    assert!(e.contains("- 4") && e.contains("+ 3"), "{e}");
}

#[test]
fn crlf_line_ends_give_the_same() {
    for c in cases() {
        let lf = data(c.file);
        let mut crlf = Vec::with_capacity(lf.len() * 2);
        for &b in &lf {
            if b == b'\n' {
                crlf.push(b'\r');
            }
            crlf.push(b);
        }
        let f = scan(&crlf);
        assert_eq!(rows(&f), c.rows, "{}", c.file);
        assert_eq!(f.tests, c.tests, "{}", c.file);
    }
}

/// A log cut anywhere (mid-block too) and one with a line of invalid UTF-8 in its middle: no
/// panic, and only findings the whole log has (by test and tool).
#[test]
fn cut_and_corrupted_logs_give_only_what_they_hold() {
    for c in cases() {
        let whole = data(c.file);
        let names: Vec<_> = c.rows.iter().map(|r| (r.1, r.2)).collect();
        let mut variants = Vec::new();
        for cut in [whole.len() / 3, whole.len() / 2, whole.len() * 2 / 3] {
            variants.push(whole[..cut].to_vec());
        }
        let mid = whole.len() / 2;
        let mid = whole[mid..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(whole.len(), |i| mid + i + 1);
        let mut bad = whole[..mid].to_vec();
        bad.extend_from_slice(b"\xff\xfe\xc3(\x80 garbage \xf0\x28\x8c\x28\n");
        bad.extend_from_slice(&whole[mid..]);
        variants.push(bad);
        for v in variants {
            let f = scan(&v);
            for r in rows(&f) {
                // A log cut in a line may cut a test's name (a prefix of one then), or cut
                // a failure's block before its file (the name without it) or its id.
                let known = names.iter().any(|(tool, name)| {
                    *tool == r.1
                        && match (name, r.2) {
                            (Some(n), Some(m)) => n.starts_with(m) || n.ends_with(m),
                            (_, None) => true,
                            (None, Some(_)) => false,
                        }
                });
                assert!(known, "{}: {r:?} not in {names:?}", c.file);
            }
        }
    }
}

#[test]
fn invalid_utf8_in_a_message_is_replaced() {
    let log = b"---- tests::x stdout ----\nthread 'tests::x' panicked at src/lib.rs:3:5:\nbad \xff\xfe value\n\nfailures:\n    tests::x\n\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
    let f = scan(log);
    assert_eq!(
        rows(&f),
        [(
            TestFailed,
            "cargo-test",
            Some("tests::x"),
            "src/lib.rs",
            Some(3),
            "bad \u{fffd}\u{fffd} value"
        )]
    );
}

/// A test's name of 1 MB, in every runner's shape: bounded names, no panic.
#[test]
fn a_huge_test_name_is_bounded() {
    let big = "n".repeat(1 << 20);
    let logs = [
        format!(
            "=== FAILURES ===\n___ {big} ___\nE   assert 1 == 2\ntests/a.py:3: AssertionError\n=== short test summary info ===\nFAILED tests/a.py::{big} - assert 1 == 2\n=== 1 failed in 0.1s ===\n"
        ),
        format!(
            "{}\nFAIL: {big} (m.C.{big})\n{}\nTraceback (most recent call last):\n  File \"/workspace/m.py\", line 3, in t\nAssertionError: x\n\n{}\nRan 1 test in 0.1s\n\nFAILED (failures=1)\n",
            "=".repeat(70),
            "-".repeat(70),
            "-".repeat(70)
        ),
        format!(
            "test {big} ... FAILED\n---- {big} stdout ----\nthread '{big}' panicked at src/lib.rs:1:1:\nboom\n\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n"
        ),
        format!("        FAIL [   0.003s] (1/1) calc {big}\n"),
        format!("--- FAIL: {big} (0.00s)\n    x_test.go:3: bad\nFAIL\tm\t0.1s\n"),
        format!(
            "{{\"Action\":\"fail\",\"Package\":\"m\",\"Test\":\"{big}\"}}\n{{\"Action\":\"output\",\"Package\":\"m\",\"Test\":\"T\",\"Output\":\"    x_test.go:3: {big}\\n\"}}\n{{\"Action\":\"fail\",\"Package\":\"m\",\"Test\":\"T\"}}\n"
        ),
        format!(
            "FAIL src/a.test.js\n  ● {big}\n\n    boom\n\n      at Object.<anonymous> (src/a.test.js:3:1)\n"
        ),
        format!(
            "⎯⎯ Failed Tests 1 ⎯⎯\n FAIL  src/a.test.ts > {big}\nError: boom\n ❯ src/a.test.ts:3:1\n"
        ),
    ];
    for log in logs {
        let f = scan(log.as_bytes());
        for x in &f.findings {
            assert!(x.name.as_ref().is_none_or(|n| n.len() <= MAX_NAME));
            assert!(x.message.len() <= taskbox_findings::MAX_MESSAGE);
        }
    }
}

/// Ordinary logs that hold the runners' words give nothing.
#[test]
fn ordinary_logs_give_nothing() {
    let log = "\
INFO starting server
ERROR connection refused: retrying in 5s
FAILED to open config, using defaults
FAIL: the cache is cold
test result: unknown
--- FAIL: nothing here
panic: not go at all
# Heading of a readme
b.go:3:4: a line that looks like go but no build failed follows
3 passed in the night, 1 failed in the morning
   Tests  ran fine
Tests: many
  ● bullet point
==================== a banner ====================
";
    let f = scan(log.as_bytes());
    assert_eq!(rows(&f), [], "{:?}", f.findings);
    assert_eq!(f.tests, None);
}

/// Many failures: the sink keeps its bound, the rest counted as omitted.
#[test]
fn many_failures_stay_bounded() {
    let mut log = String::new();
    for i in 0..500 {
        log.push_str(&format!(
            "---- t{i} stdout ----\nthread 't{i}' panicked at src/lib.rs:{i}:1:\nboom {i}\n\n"
        ));
    }
    log.push_str("test result: FAILED. 0 passed; 500 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n");
    let f = scan(log.as_bytes());
    assert_eq!(f.findings.len(), taskbox_findings::MAX_FINDINGS);
    assert_eq!(f.omitted, 400);
    assert_eq!(f.tests, counts(0, 500, 0, 0));
}

/// A block that never ends (a failure's section followed by endless output) is left after a
/// bounded number of lines: what follows, unanchored, reaches no reader.
#[test]
fn endless_blocks_are_left() {
    let mut log = String::from("=== FAILURES ===\n___ test_a ___\nE   assert 1 == 2\n");
    for _ in 0..100_000 {
        log.push_str("tests/x.py:1: looks like a place\n");
    }
    log.push_str("=== 1 failed in 0.1s ===\n");
    let f = scan(log.as_bytes());
    assert_eq!(f.findings.len(), 1);
    assert_eq!(f.findings[0].message, "assert 1 == 2");
}

/// A 100 MB log of passing tests with one failure in its middle, through every reader: run
/// with `cargo test --release -p taskbox-findings --test runners -- --ignored --nocapture`.
#[test]
#[ignore = "a timing check: prints MB/s"]
fn a_100_mb_log_is_read_fast() {
    for (kind, line) in [
        ("cargo test", "test foo::bar::baz_works ... ok\n"),
        (
            "pytest -v",
            "tests/test_mod.py::test_something_works PASSED                        [ 42%]\n",
        ),
        (
            "go test -v",
            "=== RUN   TestSomething\n--- PASS: TestSomething (0.00s)\n",
        ),
        ("jest", "  ✓ does the thing (3 ms)\n"),
    ] {
        let n = (100 << 20) / line.len();
        let mut log = String::with_capacity(100 << 20);
        for _ in 0..n / 2 {
            log.push_str(line);
        }
        log.push_str("test foo::broken ... FAILED\n\nfailures:\n\n---- foo::broken stdout ----\nthread 'foo::broken' panicked at src/lib.rs:7:5:\nboom\n\n");
        for _ in 0..n / 2 {
            log.push_str(line);
        }
        log.push_str("test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n");
        let start = std::time::Instant::now();
        let f = read_bytes(log.as_bytes(), &paths());
        let secs = start.elapsed().as_secs_f64();
        let mb = log.len() as f64 / (1 << 20) as f64;
        println!("{kind}: {mb:.0} MB in {secs:.3} s: {:.0} MB/s", mb / secs);
        assert!(
            f.findings
                .iter()
                .any(|x| x.name.as_deref() == Some("foo::broken"))
        );
    }
}
