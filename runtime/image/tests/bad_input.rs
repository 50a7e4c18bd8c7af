//! Bad input: definitions with unknown keys or missing files, a failing build step, and hostile
//! tar entries given to the unpacker. Each is refused with a message naming the problem, and
//! leaves nothing half-made behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::path::Path;

use common::*;
use taskbox_core::image::ImageResolver;
use taskbox_image::def;
use taskbox_image::unpack::{LayerFile, unpack_layers};

#[test]
fn unknown_keys_and_missing_files_are_named() {
    let t = tempdir();
    let dir = t.path();
    fs::create_dir_all(dir.join("files")).unwrap();
    fs::write(dir.join("files/a"), "a").unwrap();
    let cases = [
        (
            "[base.scratch]\n[[step]]\ncopy = [{ src = \"files/a\", dst = \"/a\", mdoe = 0o644 }]\n",
            "step[0].copy[0].mdoe: unknown key",
        ),
        (
            "[base.scratch]\n[confg]\nuser = \"1:1\"\n",
            "confg: unknown key",
        ),
        (
            "[base.scratch]\n[[step]]\ncopy = [{ src = \"files/missing\", dst = \"/m\" }]\n",
            "step[0].copy[0].src: files/missing: no such file or directory",
        ),
        (
            "[base.scratch]\nfiles = [{ host = \"/no/such/tool\", path = \"/bin/tool\" }]\n",
            "base.scratch.files[0].host: /no/such/tool: no such file on this host",
        ),
        (
            "[base.debian]\nsuite = \"bookworm\"\npackages = [\"git\"]\nmirror = \"x\"\n",
            "base.debian.mirror: unknown key",
        ),
    ];
    for (text, want) in cases {
        let path = definition(dir, "bad", text);
        let err = def::load(&path).unwrap_err().to_string();
        assert!(
            err.starts_with(&fs::canonicalize(&path).unwrap().display().to_string()),
            "{err}"
        );
        assert!(err.contains(want), "want {want:?} in {err}");
    }
    // A definition file that does not exist.
    let err = def::load(&dir.join("nope.toml")).unwrap_err().to_string();
    assert!(
        err.contains("nope.toml") && err.contains("No such file"),
        "{err}"
    );
}

/// A scratch image with busybox as /bin/sh, then `step`.
fn with_run_step(dir: &Path, step: &str) -> std::path::PathBuf {
    definition(
        dir,
        "runner",
        &format!(
            "[base.scratch]\nfiles = [{{ host = \"/bin/busybox\", path = \"/bin/busybox\" }}]\n\
             [[step]]\nsymlinks = [{{ target = \"busybox\", paths = [\"/bin/sh\", \"/bin/echo\", \
             \"/bin/rm\", \"/bin/mkdir\", \"/bin/ls\"] }}]\n\
             [[step]]\n{step}\n"
        ),
    )
}

#[test]
fn a_failing_run_step_shows_its_output_and_caches_nothing() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let s = store(t.path(), "state");
    let def_path = with_run_step(
        &t.path().join("ctx"),
        "run = \"echo about to fail; echo oops >&2; exit 3\"",
    );
    let err = try_build(&s, &def_path).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("step[1]"), "{msg}");
    assert!(msg.contains("exited with status 3"), "{msg}");
    assert!(
        msg.contains("about to fail") && msg.contains("oops"),
        "{msg}"
    );
    // The two layers before it are cached; nothing of the failed step, and no image.
    assert_eq!(fs::read_dir(s.dir().join("cache")).unwrap().count(), 2);
    assert!(s.list().unwrap().is_empty());
    assert!(s.resolve("runner").is_err());
    assert_eq!(fs::read_dir(s.dir().join("tmp")).unwrap().count(), 0);
}

#[test]
fn a_run_step_layer_holds_its_writes_and_deletions() {
    if !have_busybox() {
        return;
    }
    let t = tempdir();
    let s = store(t.path(), "state");
    let def_path = with_run_step(
        &t.path().join("ctx"),
        "run = \"echo built > /etc/motd && rm /bin/ls && mkdir -p /opt/tool\"",
    );
    let built = try_build(&s, &def_path).unwrap_or_else(|e| panic!("{e}"));
    let root = s.resolve("runner").unwrap();
    let r = &root.rootfs;
    assert_eq!(fs::read_to_string(r.join("etc/motd")).unwrap(), "built\n");
    assert!(
        fs::symlink_metadata(r.join("bin/ls")).is_err(),
        "the deletion was lost"
    );
    assert!(r.join("opt/tool").is_dir());
    assert!(r.join("bin/sh").exists());
    // Rebuilt unchanged: a cache hit, the same digest.
    let again = try_build(&s, &def_path).unwrap();
    assert_eq!(again.digest, built.digest);
    assert!(again.layers.iter().all(|l| l.cached));
}

/// A tar member written raw: name, type, link target.
type Member<'a> = (&'a str, tar::EntryType, &'a str);

/// A tar holding these raw members (names the tar crate would refuse to write).
fn raw_tar(members: &[Member<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, kind, link) in members {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(0);
        if matches!(kind, tar::EntryType::Char | tar::EntryType::Block) {
            h.set_device_major(8).unwrap();
            h.set_device_minor(0).unwrap();
        }
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

#[test]
fn hostile_tar_entries_are_refused_by_the_unpacker() {
    use tar::EntryType::{Block, Char, Link, Regular, Symlink};
    let cases: &[(&[Member<'_>], &str)] = &[
        (&[("../../escaped", Regular, "")], "`..` component"),
        (&[("/etc/cron.d/evil", Regular, "")], "absolute path"),
        (
            &[
                ("etc", Symlink, "../../../../../../etc"),
                ("etc/evil", Regular, ""),
            ],
            "a symlink on its path leads out of the root",
        ),
        (&[("dev/sda", Block, "")], "device node 8:0"),
        (&[("dev/mem", Char, "")], "device node 8:0"),
        (
            &[("passwd", Link, "../../../../etc/passwd")],
            "`..` component",
        ),
    ];
    for (members, want) in cases {
        let t = tempdir();
        let layer = t.path().join("layer.tar");
        fs::write(&layer, raw_tar(members)).unwrap();
        let dest = t.path().join("rootfs/abc");
        let err = unpack_layers(&[LayerFile::new(&layer, "1 of 1 (test)")], &dest)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("refused") && err.contains(want),
            "want {want:?} in {err}"
        );
        assert!(err.contains("layer 1 of 1 (test)"), "{err}");
        // Nothing was made: not the tree, not its temporary, not anything outside.
        assert!(!dest.exists());
        assert_eq!(fs::read_dir(t.path().join("rootfs")).unwrap().count(), 0);
        let names: Vec<_> = fs::read_dir(t.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
