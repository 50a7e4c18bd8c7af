//! `taskbox image build|ls|inspect|verify|rm`, end to end through the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;
use serde_json::Value;

fn taskbox(state: &Path, cwd: &Path, args: &[&str]) -> Output {
    Command::new(taskbox_tests::taskbox())
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .current_dir(cwd)
        .env_remove("TASKBOX_IMAGE_DIR")
        .stdin(Stdio::null())
        .output()
        .expect("run taskbox")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn build_ls_inspect_verify_rm() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let def = busybox_context(t.path());
    let ctx = def.parent().unwrap().to_path_buf();
    let state = t.path().join("state");

    // build, by name (images/NAME.toml above the current directory is not there: by path).
    let o = taskbox(&state, &ctx, &["image", "build", "busybox.toml", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let digest = report["digest"].as_str().unwrap().to_owned();
    let config_digest = report["config_digest"].as_str().unwrap().to_owned();
    assert!(
        ctx.join("busybox.lock").is_file(),
        "the lock was not written"
    );
    // Progress on stderr, as plain lines when stderr is not a terminal.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("[1/4] base scratch") && err.contains("built"),
        "{err}"
    );

    // By name from a directory holding images/.
    let repo = t.path().join("repo");
    fs::create_dir_all(repo.join("sub")).unwrap();
    fs::rename(&ctx, repo.join("images")).unwrap();
    let o = taskbox(&state, &repo.join("sub"), &["image", "build", "busybox"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&digest) && out.contains("4 cached"), "{out}");

    // ls
    let o = taskbox(&state, t.path(), &["image", "ls"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("busybox") && out.contains(&digest["sha256:".len()..][..12]),
        "{out}"
    );
    let o = taskbox(&state, t.path(), &["image", "ls", "--json"]);
    let list: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list[0]["names"][0], "busybox");

    // inspect: digests, layers with sizes, config, lock.
    let o = taskbox(&state, t.path(), &["image", "inspect", "busybox"]);
    assert!(o.status.success(), "{}", text(&o));
    let info: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(info["digest"], digest.as_str());
    assert_eq!(info["config_digest"], config_digest.as_str());
    assert_eq!(info["layers"].as_array().unwrap().len(), 4);
    assert!(info["layers"][0]["size"].as_u64().unwrap() > 1_000_000);
    assert_eq!(info["config"]["user"], "1000:1000");
    assert_eq!(info["config"]["workdir"], "/workspace");
    assert_eq!(info["lock"]["digest"], digest.as_str());

    // verify: intact, and a clean rebuild matches.
    let o = taskbox(&state, t.path(), &["image", "verify", "busybox"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}",
        text(&o)
    );

    // Tamper with the copy layer: verify exits 1 naming it.
    let layer = info["layers"][2]["digest"].as_str().unwrap();
    let blob = state
        .join("images/blobs/sha256")
        .join(&layer["sha256:".len()..]);
    let mut data = fs::read(&blob).unwrap();
    let at = data.windows(4).position(|w| w == b"root").unwrap();
    data[at] = b'R';
    fs::write(&blob, data).unwrap();
    let o = taskbox(&state, t.path(), &["image", "verify", "busybox"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("layer 3 of 4") && err.contains("copy files/passwd"),
        "{err}"
    );
    assert!(err.contains("modified or corrupted"), "{err}");

    // rm: the image and its blobs go.
    let o = taskbox(&state, t.path(), &["image", "rm", "busybox"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&digest),
        "{}",
        text(&o)
    );
    let o = taskbox(&state, t.path(), &["image", "ls", "--json"]);
    assert_eq!(
        serde_json::from_slice::<Value>(&o.stdout).unwrap(),
        Value::Array(vec![])
    );
    assert_eq!(
        fs::read_dir(state.join("images/blobs/sha256"))
            .unwrap()
            .count(),
        0
    );

    // Unknown images and bad definitions: exit 125 with one clear line.
    let o = taskbox(&state, t.path(), &["image", "inspect", "busybox"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("taskbox image build busybox"));
    let bad = definition(t.path(), "bad", "[base.scratch]\nfiles = []\nextra = 1\n");
    let o = taskbox(&state, t.path(), &["image", "build", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("bad.toml: base.scratch.extra: unknown key"),
        "{err}"
    );
    let o = taskbox(&state, t.path(), &["image", "build", "nonesuch"]);
    assert_eq!(o.status.code(), Some(125), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no definition for image nonesuch"));
}
