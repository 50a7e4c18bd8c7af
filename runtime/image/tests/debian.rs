//! The debian-dev image: two clean builds (empty stores) give the same digest, the locked one.
//!
//! Slow (two mmdebstrap runs). The .deb cache is shared between the two builds and kept across
//! runs in `$TASKBOX_DEB_CACHE` (default: taskbox-test-debs in the system's temporary
//! directory), so only the first run ever downloads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use taskbox_core::image::ImageResolver;
use taskbox_image::progress::Silent;
use taskbox_image::{BuildOptions, def, lock};

fn debs(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".deb"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_clean_builds_give_the_same_digest() {
    let have_mmdebstrap = Command::new("mmdebstrap")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !require(
        have_mmdebstrap,
        "mmdebstrap is not installed (apt-get install mmdebstrap)",
    ) || !require(
        taskbox_tests::is_root(),
        "mmdebstrap needs root here (its unshare mode needs subuid ranges)",
    ) {
        return;
    }
    let cache = std::env::var_os("TASKBOX_DEB_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("taskbox-test-debs"));
    fs::create_dir_all(&cache).unwrap();
    let t = tempdir();
    let d = def::load(&images_dir().join("debian-dev.toml")).unwrap();
    let opts = BuildOptions {
        write_lock: false,
        debs_dir: Some(cache.clone()),
        ..BuildOptions::default()
    };
    let a_store = store(t.path(), "a");
    let a = taskbox_image::build(&a_store, &d, &opts, &Silent).unwrap();
    let after_first = debs(&cache);
    assert!(!after_first.is_empty(), "the .deb cache was not filled");
    let b = taskbox_image::build(&store(t.path(), "b"), &d, &opts, &Silent).unwrap();
    assert_eq!(a.digest, b.digest, "two clean builds differ");
    assert_eq!(
        debs(&cache),
        after_first,
        "the second build downloaded packages"
    );
    // The committed lock pins these packages and records this digest.
    let locked = lock::read(&images_dir().join("debian-dev.lock"))
        .unwrap()
        .expect("images/debian-dev.lock");
    assert_eq!(locked.digest, a.digest, "images/debian-dev.lock is stale");

    // What the image holds, as the native backend would see it.
    let root = a_store.resolve("debian-dev").unwrap();
    let r = &root.rootfs;
    for tool in [
        "usr/bin/git",
        "usr/bin/python3",
        "usr/bin/gcc",
        "usr/bin/make",
        "usr/bin/pytest-3",
    ] {
        assert!(r.join(tool).exists(), "{tool} missing");
    }
    assert!(r.join("etc/ssl/certs/ca-certificates.crt").is_file());
    let passwd = fs::read_to_string(r.join("etc/passwd")).unwrap();
    assert!(
        passwd.contains("dev:x:1000:1000::/home/dev:/bin/bash"),
        "{passwd}"
    );
    assert!(
        fs::read_to_string(r.join("etc/group"))
            .unwrap()
            .contains("dev:x:1000:")
    );
    assert!(
        fs::read_to_string(r.join("etc/shadow"))
            .unwrap()
            .contains("dev:!:")
    );
    assert!(r.join("home/dev").is_dir() && r.join("workspace").is_dir());
    // Nothing of the build machine: no resolv.conf, hostname, apt sources or lists.
    for gone in [
        "etc/resolv.conf",
        "etc/hostname",
        "etc/apt/preferences.d/taskbox-lock",
    ] {
        assert!(!r.join(gone).exists(), "{gone} left in the image");
    }
    assert_eq!(
        fs::read_dir(r.join("etc/apt/sources.list.d"))
            .unwrap()
            .count(),
        0
    );
    assert_eq!(fs::read_dir(r.join("dev")).unwrap().count(), 0);
    assert_eq!(root.config.user.as_deref(), Some("1000:1000"));
}
