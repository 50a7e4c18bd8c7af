//! The diagnostics' readers on real output of the tools (see `diagnostics/capture.sh`), read
//! with every reader: each sample gives exactly its planted diagnostics, clean runs nothing,
//! and hostile input (colour, CRLF, a huge line, invalid UTF-8, a cut log, near misses)
//! neither panics nor invents findings.

use taskbox_findings::{Finding, Findings, Paths, Scanner, read_bytes};

fn sample(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/diagnostics/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// The scratch project each sample was captured in, as the samples name it.
fn root(name: &str) -> &'static str {
    match name.split('-').next() {
        Some("rustc" | "clippy") => "/workspace/demo",
        Some("gcc" | "clang") => "/workspace/c",
        Some("mypy" | "ruff") => "/workspace/py",
        Some("tsc") => "/workspace/ts",
        Some("eslint") => "/workspace/js",
        _ => panic!("no project for {name}"),
    }
}

/// `kind tool name file:line:col | message`, `-` for what is absent.
fn show(f: &Finding) -> String {
    let at = match &f.location {
        Some(l) => {
            let mut s = l.file.clone();
            if let Some(n) = l.line {
                s.push_str(&format!(":{n}"));
            }
            if let Some(c) = l.column {
                s.push_str(&format!(":{c}"));
            }
            s
        }
        None => "-".into(),
    };
    format!(
        "{:?} {} {} {} | {}",
        f.kind,
        f.tool,
        f.name.as_deref().unwrap_or("-"),
        at,
        f.message
    )
}

fn read_as(data: &[u8], name: &str) -> Findings {
    let r = root(name);
    read_bytes(data, &Paths::new(r, r))
}

fn shown(f: &Findings) -> Vec<String> {
    f.findings.iter().map(show).collect()
}

#[track_caller]
fn check(name: &str, want: &[&str]) -> Findings {
    let f = read_as(&sample(name), name);
    assert_eq!(shown(&f), want, "{name}");
    assert_eq!(f.omitted, 0);
    f
}

const RUSTC_ERRORS: &[&str] = &[
    "CompileError rustc - src/util.rs:6:26 | expected `;`, found `s`",
    "CompileError rustc E0425 src/util.rs:2:5 | cannot find function `undefined_fn` in this scope",
    "CompileError rustc E0308 src/util.rs:7:5 | mismatched types",
    "CompileError rustc E0308 src/main.rs:4:18 | mismatched types",
];

#[test]
fn rustc_errors() {
    let f = check("rustc-build-errors.txt", RUSTC_ERRORS);
    check("rustc-build-errors-color.txt", RUSTC_ERRORS);
    let ex = f.findings[3].excerpt.as_deref().unwrap_or("");
    assert_eq!(
        ex,
        "error[E0308]: mismatched types\n --> src/main.rs:4:18\n  |\n4 |     let x: i32 = \"a\";\n  |            ---   ^^^ expected `i32`, found `&str`\n  |            |\n  |            expected due to this"
    );
    check(
        "rustc-build-short.txt",
        &[
            "CompileError rustc - src/util.rs:6:26 | expected `;`, found `s`: help: add `;` here",
            "CompileError rustc E0425 src/util.rs:2:5 | cannot find function `undefined_fn` in this scope: not found in this scope",
            "CompileError rustc E0308 src/util.rs:7:5 | mismatched types: expected `u32`, found `usize`",
            "CompileError rustc E0308 src/main.rs:4:18 | mismatched types: expected `i32`, found `&str`",
        ],
    );
}

const RUSTC_UNUSED: &[&str] = &[
    "Lint rustc unused_variables src/main.rs:4:9 | unused variable: `unused`",
    // rustc names the lint on its first report only.
    "Lint rustc unused_variables src/main.rs:5:9 | unused variable: `other`",
];

#[test]
fn rustc_warnings_and_a_test_target_that_does_not_compile() {
    check("rustc-warnings.txt", RUSTC_UNUSED);
    let mut want = vec![
        "CompileError rustc overflowing_literals src/main.rs:15:21 | literal out of range for `u8`",
    ];
    want.extend(RUSTC_UNUSED);
    check("rustc-test-compile-error.txt", &want);
}

#[test]
fn clippy() {
    let clippy = [
        "Lint clippy clippy::len_zero src/util.rs:3:8 | length comparison to zero",
        "Lint clippy clippy::useless_vec src/util.rs:2:13 | useless use of `vec!`",
    ];
    let mut want: Vec<&str> = RUSTC_UNUSED.to_vec();
    want.extend(clippy);
    check("clippy-warnings.txt", &want);
    // Denied by -D warnings: rustc's lints stop the build, clippy's stay lint.
    let mut want = vec![
        "CompileError rustc unused_variables src/main.rs:4:9 | unused variable: `unused`",
        "CompileError rustc unused_variables src/main.rs:5:9 | unused variable: `other`",
    ];
    want.extend(clippy);
    check("clippy-deny.txt", &want);
}

#[test]
fn gcc() {
    let errors = [
        "CompileError gcc - src/a.c:6:13 | ‘x’ undeclared (first use in this function)",
        "Lint gcc -Wunused-variable src/a.c:5:9 | unused variable ‘unused’",
    ];
    let f = check("gcc-errors.txt", &errors);
    check("gcc-color.txt", &errors);
    assert_eq!(
        f.findings[0].excerpt.as_deref().unwrap_or(""),
        "src/a.c: In function ‘main’:\nsrc/a.c:6:13: error: ‘x’ undeclared (first use in this function)\n    6 |     int y = x + 1;\n      |             ^\nsrc/a.c:6:13: note: each undeclared identifier is reported only once for each function it appears in"
    );
    check(
        "gcc-werror.txt",
        &[
            errors[0],
            "CompileError gcc -Wunused-variable src/a.c:5:9 | unused variable ‘unused’",
        ],
    );
    check(
        "gcc-warnings.txt",
        &["Lint gcc -Wunused-variable src/w.c:3:9 | unused variable ‘unused’"],
    );
    check(
        "gcc-fatal.txt",
        &["CompileError gcc - src/b.c:1:10 | missing.h: No such file or directory"],
    );
    check(
        "gcc-cpp.txt",
        &[
            "CompileError gcc - src/t.cpp:3:21 | conversion from ‘int’ to non-scalar type ‘std::string’ {aka ‘std::__cxx11::basic_string<char>’} requested",
        ],
    );
    // ld names the source file without its directory.
    check(
        "gcc-link.txt",
        &["CompileError gcc - link.c | undefined reference to `foo'"],
    );
}

#[test]
fn clang() {
    let errors = ["CompileError clang - src/a.c:6:13 | use of undeclared identifier 'x'"];
    let f = check("clang-errors.txt", &errors);
    check("clang-color.txt", &errors);
    assert_eq!(
        f.findings[0].excerpt.as_deref().unwrap_or(""),
        "src/a.c:6:13: error: use of undeclared identifier 'x'\n    int y = x + 1;\n            ^"
    );
    check(
        "clang-warnings.txt",
        &["Lint clang -Wunused-variable src/w.c:3:9 | unused variable 'unused'"],
    );
    check(
        "clang-fatal.txt",
        &["CompileError clang - src/b.c:1:10 | 'missing.h' file not found"],
    );
    check(
        "clang-link.txt",
        &["CompileError clang - link.c | undefined reference to `foo'"],
    );
}

#[test]
fn tsc() {
    let want = [
        "CompileError tsc TS2322 src/a.ts:3:7 | Type 'string' is not assignable to type 'number'.",
        "CompileError tsc TS2554 src/a.ts:4:21 | Expected 1 arguments, but got 2.",
        "CompileError tsc TS2741 src/a.ts:6:7 | Property 'age' is missing in type '{ name: string; }' but required in type 'P'.",
        "CompileError tsc TS2322 src/a.ts:7:40 | Type 'string' is not assignable to type 'number'.",
    ];
    check("tsc-errors.txt", &want);
    let f = check("tsc-pretty.txt", &want);
    assert_eq!(
        f.findings[2].excerpt.as_deref().unwrap_or(""),
        "src/a.ts:6:7 - error TS2741: Property 'age' is missing in type '{ name: string; }' but required in type 'P'.\n6 const p: P = { name: \"n\" };\n        ~\n  src/a.ts:5:29 - 'age' is declared here.\n    5 interface P { name: string; age: number }\n                                  ~~~"
    );
}

#[test]
fn mypy() {
    let want = |col: bool| {
        let c = |s: &str, n: &str| {
            if col {
                format!("{s}:{n}")
            } else {
                s.to_string()
            }
        };
        vec![
            format!(
                "CompileError mypy import-not-found {} | Cannot find implementation or library stub for module named \"missing_mod\"",
                c("pkg/c.py:1", "1")
            ),
            format!(
                "CompileError mypy attr-defined {} | \"str\" has no attribute \"nope\"",
                c("pkg/c.py:5", "5")
            ),
            format!(
                "CompileError mypy assignment {} | Incompatible types in assignment (expression has type \"str\", variable has type \"int\")",
                c("pkg/a.py:7", "14")
            ),
        ]
    };
    let f = check("mypy-errors.txt", &to_refs(&want(false)));
    assert_eq!(
        f.findings[0].excerpt.as_deref().unwrap_or(""),
        "pkg/c.py:1: error: Cannot find implementation or library stub for module named \"missing_mod\"  [import-not-found]\npkg/c.py:1: note: See https://mypy.readthedocs.io/en/stable/running_mypy.html#missing-imports"
    );
    check("mypy-columns.txt", &to_refs(&want(true)));
    check("mypy-color.txt", &to_refs(&want(false)));
    // --pretty wraps the message: its code is on the next line.
    let f = check("mypy-pretty.txt", &to_refs(&want(false)[2..]));
    assert!(
        f.findings[0]
            .excerpt
            .as_deref()
            .unwrap_or("")
            .contains("^~~")
    );
    check(
        "mypy-syntax.txt",
        &[
            "CompileError mypy syntax pkg/b.py:1 | Expected a parameter or the end of the parameter list",
            "CompileError mypy syntax pkg/b.py:1 | Expected `)`, found newline",
        ],
    );
}

fn to_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn ruff() {
    let want = [
        "Lint ruff F401 pkg/a.py:1:8 | `os` imported but unused",
        "Lint ruff F401 pkg/c.py:1:8 | `missing_mod` imported but unused",
    ];
    let f = check("ruff-full.txt", &want);
    assert!(f.findings[0].excerpt.as_deref().unwrap_or("").starts_with(
        "F401 [*] `os` imported but unused\n --> pkg/a.py:1:8\n  |\n1 | import os\n  |        ^^"
    ));
    check("ruff-concise.txt", &want);
    check("ruff-color.txt", &want);
    // After one report, the next header is read whatever its code.
    check(
        "ruff-select.txt",
        &[
            want[0],
            "Lint ruff E741 pkg/a.py:6:5 | Ambiguous variable name: `l`",
        ],
    );
    let syntax = [
        "CompileError ruff invalid-syntax pkg/b.py:1:7 | Expected a parameter or the end of the parameter list",
        "CompileError ruff invalid-syntax pkg/b.py:1:8 | Expected `)`, found newline",
    ];
    check("ruff-syntax.txt", &syntax);
    check("ruff-syntax-concise.txt", &syntax);
    // A first header of a rule outside the anchored codes is not seen: the report still is.
    check(
        "ruff-unfixable-first.txt",
        &["Lint ruff - pkg/n.py:1:5 | ruff reported a diagnostic here"],
    );
}

#[test]
fn eslint() {
    let a = [
        "Lint eslint no-unused-vars src/a.js:1:7 | 'x' is assigned a value but never used",
        "Lint eslint no-unused-vars src/a.js:2:5 | 'unused' is assigned a value but never used",
        "Lint eslint no-undef src/a.js:3:1 | 'console' is not defined",
        "Lint eslint no-console src/a.js:3:1 | Unexpected console statement",
        "Lint eslint no-undef src/a.js:3:13 | 'undefinedVar' is not defined",
        "Lint eslint semi src/a.js:3:26 | Missing semicolon",
    ];
    let rest = [
        "Lint eslint semi src/b.js:2:11 | Missing semicolon",
        "Lint eslint - src/c.js:1:10 | Parsing error: Unexpected token (",
    ];
    let mut want = a.to_vec();
    want.extend(rest);
    let f = check("eslint-color.txt", &want);
    assert_eq!(
        f.findings[3].excerpt.as_deref(),
        Some("3:1 warning Unexpected console statement (no-console)")
    );
    // Without colour the first file's line holds no anchor: it is read as the line before
    // its first problem.
    check("eslint-stylish.txt", &want);
    // In another chunk of the stream too (hostile_framing_changes_nothing: in chunks of 1).
}

#[test]
fn clean_runs_give_nothing() {
    for name in [
        "rustc-clean.txt",
        "clippy-clean.txt",
        "gcc-clean.txt",
        "mypy-clean.txt",
        "ruff-clean.txt",
        "tsc-clean.txt",
        "eslint-clean.txt",
    ] {
        check(name, &[]);
    }
}

fn samples() -> Vec<String> {
    let dir = format!("{}/tests/diagnostics", env!("CARGO_MANIFEST_DIR"));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {dir}: {e}"))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".txt"))
        .collect();
    names.sort();
    names
}

/// The tool a sample's findings must all have.
fn tools(name: &str) -> &'static [&'static str] {
    match name.split('-').next() {
        Some("rustc" | "clippy") => &["rustc", "clippy"],
        Some("gcc") => &["gcc"],
        Some("clang") => &["clang"],
        Some("mypy") => &["mypy"],
        Some("ruff") => &["ruff"],
        Some("tsc") => &["tsc"],
        Some("eslint") => &["eslint"],
        _ => &[],
    }
}

#[test]
fn each_sample_gives_only_its_tools_findings() {
    for name in samples() {
        let f = read_as(&sample(&name), &name);
        for x in &f.findings {
            assert!(
                tools(&name).contains(&x.tool.as_str()),
                "{name}: {}",
                show(x)
            );
        }
    }
}

/// Same findings whatever the chunks the stream arrives in, with CRLF line ends, and after
/// a 1 MB line and invalid UTF-8 before it.
#[test]
fn hostile_framing_changes_nothing() {
    for name in samples() {
        let data = sample(&name);
        let want = shown(&read_as(&data, &name));
        let r = root(&name);
        for size in [1, 7, 4096] {
            let mut s = Scanner::new(Paths::new(r, r));
            for c in data.chunks(size) {
                s.feed(c);
            }
            assert_eq!(shown(&s.finish()), want, "{name} in chunks of {size}");
        }
        let crlf: Vec<u8> = data
            .split(|&b| b == b'\n')
            .flat_map(|l| l.iter().copied().chain(*b"\r\n"))
            .collect();
        assert_eq!(shown(&read_as(&crlf, &name)), want, "{name} with CRLF");
        let mut big = vec![b'x'; 1 << 20];
        big.extend_from_slice(b" error: warning: --> F401 \xff\xfe\n\xc3\x28 invalid\n");
        big.extend_from_slice(&data);
        assert_eq!(
            shown(&read_as(&big, &name)),
            want,
            "{name} after a huge line"
        );
    }
}

fn file(f: &Finding) -> Option<&str> {
    Some(f.location.as_ref()?.file.as_str())
}

#[test]
fn a_log_cut_anywhere_neither_panics_nor_invents() {
    for name in samples() {
        let data = sample(&name);
        let all = read_as(&data, &name).findings;
        let text = String::from_utf8_lossy(&data);
        // Every line's end and the byte after it, and every 11th byte between: each kind of
        // cut (before a line ends, at its end, inside a location or a snippet) many times over,
        // at a tenth of the cost of every byte.
        let ends = data
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .flat_map(|(i, _)| [i, i + 1]);
        let mut cuts: Vec<usize> = (0..data.len()).step_by(11).chain(ends).collect();
        cuts.sort_unstable();
        cuts.dedup();
        for cut in cuts {
            let f = read_as(&data[..cut.min(data.len())], &name);
            for x in &f.findings {
                // A line cut short loses its end (a message's rest, a warning's flag), a
                // report cut before its lint's note is taken for rustc's error, and clang's
                // output cut before its `N errors generated.` for gcc's; but the finding is
                // one planted (in its file: the cut may fall inside its line and column; with no
                // location, its message is in the sample).
                assert!(
                    all.iter()
                        .any(|a| x.location.is_some() && file(a) == file(x))
                        || (x.location.is_none() && text.contains(&x.message)),
                    "{name} cut at {cut}: {}",
                    show(x)
                );
            }
        }
    }
    // Cut inside the last snippet: what was read of it is reported.
    let data = sample("rustc-build-errors.txt");
    let text = String::from_utf8_lossy(&data);
    let cut = text.find("  |            |").unwrap_or(0);
    let f = read_as(&data[..cut], "rustc-build-errors.txt");
    assert_eq!(shown(&f), RUSTC_ERRORS);
    assert!(
        f.findings[3]
            .excerpt
            .as_deref()
            .unwrap_or("")
            .ends_with("expected `i32`, found `&str`")
    );
}

#[test]
fn near_misses_give_nothing() {
    let log = "\
2024-01-01 12:00:00: error: connection refused
2024-01-01 12:00:01: warning: retrying
Error: something failed
error: could not find `Cargo.toml` in `/workspace` or any parent directory
warning: unused manifest key: package.foo
error[internal]: not a rustc header after all
error: expected a location next
 --> not a location
server.c is fine: error: nope
config.yaml:3:5: error: bad indent
notes.txt:3: error: not python
a.py:10: note: a note without its error
a.py: warning: no such thing in mypy
src/a.rs is: error: x
F401 is the code for unused imports
E741 Ambiguous variable name is a rule
 --> src/main.rs
invalid-syntax: but no arrow follows
error TS is a prefix
see error TS2322: in the docs
x.ts(3,7): warning TS1: no
Found 3 errors in 2 files (checked 4 source files)
Success: no issues found in 1 source file
Found 1 error.
All checks passed!
1 error generated.
2 warnings generated.
collect2: error: ld returned 1 exit status
cc1: all warnings being treated as errors
compilation terminated.
✖ 2 problems (2 errors, 0 warnings)
  3:7  error  an eslint-like line with no rule
  12:30  error  backup failed
/var/log/app.js
  nothing here
GET /index.html 200 1:7 error
";
    let f = read_bytes(log.as_bytes(), &Paths::new("/workspace", "/workspace"));
    assert_eq!(shown(&f), Vec::<String>::new());
}

#[test]
fn files_are_made_relative_to_the_workspace() {
    // cargo ran in a member of a workspace whose root is one level up.
    let f = read_bytes(
        &sample("rustc-warnings.txt"),
        &Paths::new("/workspace", "/workspace/demo"),
    );
    let files: Vec<_> = f
        .findings
        .iter()
        .filter_map(|x| Some(x.location.as_ref()?.file.as_str()))
        .collect();
    assert_eq!(files, ["demo/src/main.rs", "demo/src/main.rs"]);
}

/// A log of 8 MB of ordinary lines, many holding an anchor (`error:`, `warning:`, `.py:`),
/// with one build's diagnostics in its middle: those are found, and nothing else is.
#[test]
fn diagnostics_in_the_middle_of_a_long_log_of_near_misses() {
    let lines = [
        "2024-01-01T12:00:00Z INFO request handled path=/api/v1/items status=200 ms=12\n",
        "2024-01-01T12:00:01Z WARN slow query table=items ms=830\n",
        "2024-01-01T12:00:02Z ERROR upstream error: connection reset by peer\n",
        "test tests::it_works ... ok\n",
        "   Compiling serde v1.0.200\n",
        "warning: use of deprecated config key, see the docs\n",
        "src/app.py:120 DEBUG cache hit key=user:42\n",
    ];
    let mut log = Vec::with_capacity(9 << 20);
    let mut i = 0;
    while log.len() < 8 << 20 {
        if i == 50_000 {
            log.extend_from_slice(&sample("rustc-build-errors.txt"));
        }
        log.extend_from_slice(lines[i % lines.len()].as_bytes());
        i += 1;
    }
    let f = read_bytes(&log, &Paths::new("/workspace/demo", "/workspace/demo"));
    assert_eq!(shown(&f), RUSTC_ERRORS);
}
