//! The busybox image: reproducible, content-addressed, cached, verifiable, and unpacked as a
//! root filesystem the way the native backend uses it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Instant;

use common::*;
use taskbox_core::image::ImageResolver;
use taskbox_image::progress::Silent;
use taskbox_image::{lock, verify};

#[test]
fn two_clean_builds_give_the_same_digest() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let def = images_dir().join("busybox.toml");
    let a = build(&store(t.path(), "a"), &def);
    let b = build(&store(t.path(), "b"), &def);
    assert_eq!(a.digest, b.digest);
    assert_eq!(a.config_digest, b.config_digest);
    assert!(a.layers.iter().all(|l| !l.cached) && b.layers.iter().all(|l| !l.cached));
    // The committed lock records the same digest when the host's busybox is the one it saw.
    let lock = lock::read(&images_dir().join("busybox.lock"))
        .unwrap()
        .unwrap();
    let base = &lock.layer[0];
    if base.input == a.layers[0].input {
        assert_eq!(lock.digest, a.digest, "images/busybox.lock is stale");
    } else {
        eprintln!("note: this host's busybox differs from the one images/busybox.lock records");
    }
}

#[test]
fn changing_one_input_file_changes_the_digest_from_its_layer_on() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let def = busybox_context(t.path());
    let s = store(t.path(), "state");
    let before = build(&s, &def);
    let passwd = def.parent().unwrap().join("files/passwd");
    let mut text = fs::read_to_string(&passwd).unwrap();
    text.push_str("extra:x:1001:1001::/home/extra:/bin/sh\n");
    fs::write(&passwd, text).unwrap();
    let after = build(&s, &def);
    assert_ne!(before.digest, after.digest);
    // The base and the symlinks come from the cache; the copy layer and those above are new.
    let cached: Vec<bool> = after.layers.iter().map(|l| l.cached).collect();
    assert_eq!(cached, [true, true, false, false]);
    assert_eq!(before.layers[0].digest, after.layers[0].digest);
    assert_ne!(before.layers[2].digest, after.layers[2].digest);
    assert_ne!(before.layers[2].input, after.layers[2].input);
    // A mode is an input too.
    let text = fs::read_to_string(&def).unwrap().replace(
        "dst = \"/etc/group\", mode = 0o644",
        "dst = \"/etc/group\", mode = 0o600",
    );
    fs::write(&def, text).unwrap();
    let moded = build(&s, &def);
    assert_ne!(moded.layers[2].digest, after.layers[2].digest);
}

#[test]
fn an_unchanged_rebuild_is_all_cache_hits_in_under_a_second() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let def = images_dir().join("busybox.toml");
    let s = store(t.path(), "state");
    let first = build(&s, &def);
    let started = Instant::now();
    let again = build(&s, &def);
    let took = started.elapsed();
    assert_eq!(first.digest, again.digest);
    assert!(again.layers.iter().all(|l| l.cached), "{:?}", again.layers);
    assert!(took.as_millis() < 1000, "cache-hit rebuild took {took:?}");
    // --no-cache rebuilds every layer, to the same digest.
    let d = taskbox_image::def::load(&def).unwrap();
    let opts = taskbox_image::BuildOptions {
        no_cache: true,
        write_lock: false,
        ..Default::default()
    };
    let fresh = taskbox_image::build(&s, &d, &opts, &Silent).unwrap();
    assert!(fresh.layers.iter().all(|l| !l.cached));
    assert_eq!(fresh.digest, first.digest);
}

#[test]
fn verify_catches_a_tampered_layer_and_names_it() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let def = busybox_context(t.path());
    let s = store(t.path(), "state");
    let built = build(&s, &def);
    let ok = verify::verify(&s, "busybox", true, &Silent).unwrap();
    assert!(ok.ok(), "{:?}", ok.problems);
    assert_eq!(ok.rebuilt.as_deref(), Some(built.digest.as_str()));

    // Change one byte of the copy layer (the passwd file's content) in the store.
    let layer = &built.layers[2];
    let blob = s.blob_path(&layer.digest).unwrap();
    let mut data = Vec::new();
    fs::File::open(&blob)
        .unwrap()
        .read_to_end(&mut data)
        .unwrap();
    let at = data
        .windows(4)
        .position(|w| w == b"root")
        .expect("passwd content in the layer");
    let mut f = fs::OpenOptions::new().write(true).open(&blob).unwrap();
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.write_all(b"r00t").unwrap();
    drop(f);

    let bad = verify::verify(&s, "busybox", false, &Silent).unwrap();
    assert!(!bad.ok());
    let msg = bad.problems.join("\n");
    assert!(msg.contains("layer 3 of 4"), "{msg}");
    assert!(msg.contains("copy files/passwd"), "{msg}");
    assert!(msg.contains("modified or corrupted"), "{msg}");
    // Resolving the image for a sandbox refuses the tampered layer rather than unpack it.
    let err = s.resolve("busybox").unwrap_err().to_string();
    assert!(
        err.contains("hashes to") || err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn the_image_unpacks_as_a_root_filesystem() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let s = store(t.path(), "state");
    let built = build(&s, &images_dir().join("busybox.toml"));
    let root = s.resolve("busybox").unwrap();
    assert_eq!(root.digest, built.digest);
    assert_eq!(root.config_digest, built.config_digest);
    assert_eq!(root.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(root.config.workdir, "/workspace");
    assert_eq!(root.config.shell, ["/bin/sh", "-c"]);
    assert!(
        root.config
            .env
            .iter()
            .any(|(k, v)| k == "HOME" && v == "/home/user")
    );
    let r = &root.rootfs;
    assert!(r.starts_with(s.dir().join("rootfs")));
    assert_eq!(
        fs::read_link(r.join("bin/sh")).unwrap().to_str(),
        Some("busybox")
    );
    assert!(
        fs::read_to_string(r.join("etc/passwd"))
            .unwrap()
            .contains("user:x:1000:1000")
    );
    let mode = |p: &str| {
        fs::symlink_metadata(r.join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("tmp"), 0o1777);
    assert_eq!(mode("bin/busybox"), 0o755);
    assert_eq!(mode("root"), 0o700);
    assert!(r.join("workspace").is_dir() && r.join("proc").is_dir() && r.join("dev").is_dir());
    if taskbox_tests::is_root() {
        assert_eq!(fs::metadata(r.join("home/user")).unwrap().uid(), 1000);
    }
    // Only the store's owner may reach unpacked trees.
    assert_eq!(
        fs::metadata(s.dir().join("rootfs"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    // Unpacked once: a second resolve (by digest prefix) gives the same tree.
    let again = s.resolve(&built.digest["sha256:".len()..][..16]).unwrap();
    assert_eq!(again.rootfs, root.rootfs);
    // The config digest (Docker's image ID) names the image too.
    let by_id = s.resolve(&built.config_digest).unwrap();
    assert_eq!(by_id.digest, built.digest);
    // A missing name says how to build it.
    let err = s.resolve("nonesuch").unwrap_err().to_string();
    assert!(err.contains("taskbox image build nonesuch"), "{err}");
}

#[test]
fn rm_removes_the_image_and_what_only_it_used() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let s = store(t.path(), "state");
    let built = build(&s, &images_dir().join("busybox.toml"));
    s.resolve("busybox").unwrap();
    let removed = s.remove(&["busybox".to_string()]).unwrap();
    assert_eq!(removed.names, ["busybox"]);
    assert_eq!(removed.images, std::slice::from_ref(&built.digest));
    assert!(s.list().unwrap().is_empty());
    assert_eq!(
        fs::read_dir(s.dir().join("blobs/sha256")).unwrap().count(),
        0
    );
    assert_eq!(fs::read_dir(s.dir().join("rootfs")).unwrap().count(), 0);
    assert_eq!(fs::read_dir(s.dir().join("cache")).unwrap().count(), 0);
    // Rebuilding after rm starts from nothing and gives the same digest.
    let again = build(&s, &images_dir().join("busybox.toml"));
    assert_eq!(again.digest, built.digest);
    assert!(again.layers.iter().all(|l| !l.cached));
}
