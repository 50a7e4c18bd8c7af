//! The Python SDK's suite (`python/tests`, pytest) against the real binaries: one test here per
//! test file there, so nextest reports and runs them apart.
//!
//! Each runs `python3 -m pytest FILE` from PATH (the interpreter scripts/ci.sh provisions with
//! pytest, httpx, httpx-sse, pydantic, maturin, inspect-ai and mini-swe-agent) with `TASKBOX_BIN_DIR` naming the built binaries and
//! `TASKBOX_WHEEL_DIR` where scripts/wheel.sh left the wheel (scripts/test.sh builds it before the
//! suites run). Without python3 or those packages the tests skip with the reason, a failure
//! under `TASKBOX_REQUIRE_ALL=1`, which the Python tests pass on: a skip there fails too.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use taskbox_tests::{bin_dir, require, require_all};

/// The tree the suite runs from: the repository, or `TASKBOX_REPO_DIR` (scripts/test.sh's
/// rootless pass points it at a copy the unprivileged user can read).
fn repo() -> PathBuf {
    if let Some(dir) = std::env::var_os("TASKBOX_REPO_DIR") {
        return PathBuf::from(dir);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// Whether `python3` on PATH has what the suite needs, or why not.
fn python_ready() -> Result<(), String> {
    match Command::new("python3")
        .args(["-c", "import pytest, httpx, httpx_sse, pydantic"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "python3 on PATH lacks a package of the Python SDK's suite (python3 -m pip install \
             pytest httpx httpx-sse pydantic): {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("python3 is not on PATH: {e}")),
    }
}

fn pytest(file: &str) {
    if let Err(reason) = python_ready() {
        require(false, &reason);
        return;
    }
    let bins = bin_dir();
    // target/debug -> target/wheels, where scripts/wheel.sh writes the wheel.
    let wheels = std::env::var_os("TASKBOX_WHEEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| bins.parent().unwrap_or(&bins).join("wheels"));
    // A pytest `-k` expression: scripts/test.sh's rootless pass leaves out the tests that need
    // root or Docker with it.
    let extra: Vec<String> = match std::env::var("TASKBOX_PYTEST_K") {
        Ok(k) if !k.is_empty() => vec!["-k".into(), k],
        _ => Vec::new(),
    };
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .args(&extra)
        .arg(repo().join("python/tests").join(file))
        .current_dir(repo().join("python"))
        .env("TASKBOX_BIN_DIR", &bins)
        .env("TASKBOX_WHEEL_DIR", &wheels)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("TASKBOX_URL")
        .env_remove("TASKBOX_TOKEN")
        .env_remove("TASKBOX_STATE_DIR")
        .stdin(Stdio::null())
        .output()
        .expect("run python3 -m pytest");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success(),
        "pytest {file} failed (exit {:?}); its output is above",
        out.status.code()
    );
    // A skip in there is a failure here when every skip must be.
    assert!(
        !(require_all() && stdout.contains(" skipped")),
        "pytest {file} skipped tests under TASKBOX_REQUIRE_ALL=1: {stdout}"
    );
    // Exit 0 with nothing run would hide a broken collection.
    assert!(
        stdout.contains(" passed"),
        "pytest {file} ran no test: {stdout}"
    );
}

macro_rules! python_tests {
    ($($name:ident => $file:literal),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                pytest($file);
            }
        )*

        #[test]
        fn every_python_test_file_is_run_by_a_test_here() {
            let mut on_disk: Vec<String> = std::fs::read_dir(repo().join("python/tests"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("test_") && n.ends_with(".py"))
                .collect();
            on_disk.sort();
            let mut here: Vec<String> = [$($file),*].iter().map(|s| s.to_string()).collect();
            here.sort();
            assert_eq!(on_disk, here, "python/tests and the tests of tests/tests/python.rs differ");
        }
    };
}

python_tests! {
    python_client => "test_client.py",
    python_async => "test_async.py",
    python_errors => "test_errors.py",
    python_idempotency => "test_idempotency.py",
    python_schema => "test_schema.py",
    python_tcp => "test_tcp.py",
    python_transport => "test_transport.py",
    python_autostart => "test_autostart.py",
    python_wheel => "test_wheel.py",
    python_inspect => "test_inspect.py",
    python_minisweagent => "test_minisweagent.py",
}
