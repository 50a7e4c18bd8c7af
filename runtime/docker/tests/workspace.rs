//! The workspace of Docker sandboxes: the host-side overlay (idmapped when the owner differs),
//! file operations, diff, checkpoint/restore and export, with the host copy untouched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::MetadataExt;

use common::*;
use taskbox_core::api::*;
use taskbox_core::result::ChangeKind;

fn check_workspace_round_trip(h: &Harness, owner: Option<(u32, u32)>) {
    h.write("src/lib.rs", "fn a() {}\n");
    h.write("README", "hello\n");
    h.write(".git/config", "[core]\n");
    if let Some((uid, gid)) = owner {
        let status = std::process::Command::new("chown")
            .args(["-R", &format!("{uid}:{gid}")])
            .arg(h.ws())
            .status()
            .unwrap();
        assert!(status.success());
    }
    let id = h.create();

    // The container user owns the workspace it sees, whoever owns it on the host.
    let r = h.sh(
        &id,
        "stat -c '%u %g' . src/lib.rs; echo more >> README && touch new.txt && mkdir d && \
         echo x > d/y && rm src/lib.rs && stat -c %u new.txt",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout.text, "1000 1000\n1000 1000\n1000\n");
    let mut changes: Vec<(String, ChangeKind)> =
        r.changes.iter().map(|c| (c.path.clone(), c.kind)).collect();
    changes.sort();
    assert_eq!(
        changes,
        vec![
            ("README".into(), ChangeKind::Modified),
            ("d/y".into(), ChangeKind::Added),
            ("new.txt".into(), ChangeKind::Added),
            ("src/lib.rs".into(), ChangeKind::Deleted),
        ]
    );
    // Protected paths stay read-only inside.
    let r = h.sh(&id, "echo evil >> .git/config");
    assert_ne!(r.exit_code, Some(0));

    // File operations of the API, as the container user.
    h.backend
        .write(
            &id,
            WriteRequest {
                path: "api/new.rs".into(),
                content: "// api\n".into(),
                create_parents: true,
                ..Default::default()
            },
        )
        .unwrap();
    let r = h.sh(
        &id,
        "stat -c %u api/new.rs api; echo appended >> api/new.rs",
    );
    assert_eq!(r.stdout.text, "1000\n1000\n", "{r:?}");
    assert_eq!(r.exit_code, Some(0));
    let e = h
        .backend
        .edit(
            &id,
            EditRequest {
                path: "README".into(),
                old: "more".into(),
                new: "MORE".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(e.diff.contains("+MORE"));
    let read = h
        .backend
        .read(
            &id,
            ReadRequest {
                path: "/workspace/README".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(read.content, "hello\nMORE\n");
    let list = h
        .backend
        .list_dir(
            &id,
            ListRequest {
                glob: Some("**/*.rs".into()),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(list.entries.len(), 1, "{list:?}");
    let found = h
        .backend
        .search(
            &id,
            SearchRequest {
                pattern: "appended".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(found.matches.len(), 1);
    let refused = h
        .backend
        .write(
            &id,
            WriteRequest {
                path: ".git/config".into(),
                content: "x".into(),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(refused.code(), "path_refused", "{refused}");
    let outside = h
        .backend
        .read(
            &id,
            ReadRequest {
                path: "../../etc/passwd".into(),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(outside.code(), "path_refused" | "not_found"),
        "{outside}"
    );

    // Diff against the baseline, checkpoint, change, restore.
    let d = h.backend.diff(&id, DiffRequest::default()).unwrap();
    assert!(d.diff.contains("+MORE"), "{}", d.diff);
    assert!(
        d.files
            .iter()
            .any(|f| f.path == "src/lib.rs" && f.status == ChangeKind::Deleted)
    );
    h.backend
        .checkpoint(&id, CheckpointRequest { name: "c1".into() })
        .unwrap();
    let r = h.sh(&id, "echo later > later.txt; rm README");
    assert_eq!(r.exit_code, Some(0));
    let since = h
        .backend
        .diff(
            &id,
            DiffRequest {
                since: Some("c1".into()),
                ..Default::default()
            },
        )
        .unwrap();
    let mut paths: Vec<&str> = since.files.iter().map(|f| f.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, ["README", "later.txt"]);
    h.backend
        .restore(&id, CheckpointRequest { name: "c1".into() })
        .unwrap();
    // The restored workspace is what the container sees, and it can keep working in it.
    let r = h.sh(
        &id,
        "ls later.txt 2>&1; cat README; echo again > again.txt && stat -c %u again.txt",
    );
    assert!(r.stdout.text.contains("No such file"), "{}", r.stdout.text);
    assert!(r.stdout.text.contains("hello\nMORE\n"), "{}", r.stdout.text);
    assert!(r.stdout.text.ends_with("1000\n"), "{}", r.stdout.text);
    let e = h
        .backend
        .restore(
            &id,
            CheckpointRequest {
                name: "nope".into(),
            },
        )
        .unwrap_err();
    assert_eq!(e.code(), "not_found");

    // Export as a patch and as a tar; the host copy is untouched until --apply.
    let ex = h.backend.export(&id, ExportRequest::default()).unwrap();
    let patch = ex.patch.unwrap();
    assert!(patch.contains("again.txt"), "{patch}");
    assert_eq!(
        std::fs::read_to_string(h.ws().join("README")).unwrap(),
        "hello\n"
    );
    assert!(h.ws().join("src/lib.rs").exists());
    assert!(!h.ws().join("again.txt").exists());
    let tar = h
        .backend
        .export(
            &id,
            ExportRequest {
                format: ExportFormat::Tar,
                apply: false,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(std::path::Path::new(&tar.tar_path.unwrap()).is_file());
    let owner = std::fs::metadata(h.ws()).unwrap().uid();
    let applied = h
        .backend
        .export(
            &id,
            ExportRequest {
                format: ExportFormat::Patch,
                apply: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(applied.applied);
    assert_eq!(
        std::fs::read_to_string(h.ws().join("again.txt")).unwrap(),
        "again\n"
    );
    assert_eq!(
        std::fs::metadata(h.ws().join("again.txt")).unwrap().uid(),
        owner,
        "applied files belong to the workspace's owner"
    );
    assert!(!h.ws().join("src/lib.rs").exists());
    h.backend.destroy(&id).unwrap();
    assert!(
        mounts_under(&h.state().join("docker/sandboxes")).is_empty(),
        "{:?}",
        mounts_under(&h.state().join("docker/sandboxes"))
    );
}

#[test]
fn a_root_owned_workspace_is_idmapped_to_the_container_user() {
    let Some(h) = Harness::new() else { return };
    // The scratch workspace belongs to root, which is not the container user.
    assert_eq!(std::fs::metadata(h.ws()).unwrap().uid(), 0);
    check_workspace_round_trip(&h, None);
}

#[test]
fn a_workspace_owned_by_the_container_user_is_mounted_as_is() {
    let Some(h) = Harness::new() else { return };
    check_workspace_round_trip(&h, Some((1000, 1000)));
}

#[test]
fn another_image_user_gets_the_workspace_too() {
    let Some(h) = Harness::new() else { return };
    h.write("f", "x\n");
    let id = h
        .backend
        .create(CreateRequest {
            image: Some("busybox-1001".into()),
            ..h.create_req()
        })
        .unwrap()
        .id;
    let r = h.sh(&id, "id -u; stat -c %u f; echo y >> f && cat f");
    assert_eq!(r.stdout.text, "1001\n1001\nx\ny\n", "{r:?}");
    assert_eq!(std::fs::read_to_string(h.ws().join("f")).unwrap(), "x\n");
}

#[test]
fn bad_create_requests_are_refused_clearly() {
    let Some(h) = Harness::new() else { return };
    let cases = [
        (
            CreateRequest {
                image: None,
                ..h.create_req()
            },
            "needs an image",
        ),
        (
            CreateRequest {
                image: Some("nope".into()),
                ..h.create_req()
            },
            "not built",
        ),
        (
            CreateRequest {
                workspace: "/no/such/dir".into(),
                ..h.create_req()
            },
            "workspace",
        ),
        (
            CreateRequest {
                policy: Some("no-such-policy".into()),
                ..h.create_req()
            },
            "policy",
        ),
        (
            CreateRequest {
                backend: Some("native".into()),
                ..h.create_req()
            },
            "backend",
        ),
    ];
    for (req, want) in cases {
        let e = h.backend.create(req).unwrap_err();
        assert!(matches!(e.code(), "invalid_argument" | "not_found"), "{e}");
        assert!(e.to_string().contains(want), "{e} (wanted {want:?})");
    }
    assert!(h.backend.list().is_empty());
    let e = h
        .backend
        .info(&SandboxId::parse("sb-nope").unwrap())
        .unwrap_err();
    assert_eq!(e.code(), "sandbox_not_found");
}

#[test]
fn a_missing_image_is_loaded_by_digest_once() {
    let Some(h) = Harness::new() else { return };
    let img = h.images.get("busybox-load");
    let _ = std::process::Command::new("docker")
        .args(["rmi", "-f", &img.config_digest])
        .output();
    let before = img.loads.load(std::sync::atomic::Ordering::SeqCst);
    let req = CreateRequest {
        image: Some(img.digest.clone()),
        ..h.create_req()
    };
    let a = h.backend.create(req.clone()).unwrap();
    assert_eq!(a.image, img.digest);
    assert_eq!(
        img.loads.load(std::sync::atomic::Ordering::SeqCst),
        before + 1
    );
    // Docker's image ID is the config digest.
    let c = inspect(&h.backend.container_name(&a.id).unwrap());
    assert_eq!(c["Image"], img.config_digest);
    let b = h.backend.create(req).unwrap();
    assert_eq!(
        img.loads.load(std::sync::atomic::Ordering::SeqCst),
        before + 1,
        "loaded once"
    );
    assert_eq!(h.sh(&b.id, "id -u").stdout.text, "1002\n");
}
