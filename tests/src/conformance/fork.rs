//! The checks of `fork`, on every backend: a fork sees exactly its parent's files (workspace and
//! `/tmp`) at the fork point and nothing of what the parent, or another fork, writes afterwards;
//! a restore in a fork leaves the parent as it was; a fork from a checkpoint starts from that
//! checkpoint; processes are not copied; each fork has its own lease; bad requests are refused
//! and make nothing.

use std::time::Duration;

use taskbox_core::api::*;
use taskbox_core::result::ChangeKind;

use super::{checkpoint, diff_files, read, shell, text, write};
use crate::suite::{Subject, expect_code};

fn fork(s: &Subject, id: &SandboxId, req: ForkRequest) -> Vec<SandboxInfo> {
    s.api
        .fork(id, req)
        .unwrap_or_else(|e| panic!("fork of {id}: {} ({e})", e.code()))
        .sandboxes
}

pub(super) fn forks(s: &Subject, id: &SandboxId, count: u32) -> Vec<SandboxInfo> {
    fork(
        s,
        id,
        ForkRequest {
            count: Some(count),
            ..ForkRequest::default()
        },
    )
}

/// What a sandbox's files are, as a test sees them: the workspace diff (files, statuses and the
/// unified diff) and the `/tmp` files this check writes.
fn state(s: &Subject, id: &SandboxId) -> (Vec<(String, ChangeKind)>, String, String) {
    let d = s.api.diff(id, DiffRequest::default()).unwrap();
    let r = s.sh(id, "cat /tmp/fork-note 2>&1; ls /tmp/fork-dir 2>&1");
    (diff_files(&d), d.diff, r.stdout.text)
}

pub fn a_fork_sees_its_parent_and_nothing_flows_between_forks(s: &Subject) {
    std::fs::write(s.env.ws().join("kept.txt"), "kept\n").unwrap();
    std::fs::write(s.env.ws().join("changed.txt"), "old\n").unwrap();
    std::fs::write(s.env.ws().join("gone.txt"), "gone\n").unwrap();
    let parent = s.create();
    let r = s.sh(
        &parent,
        "echo new > changed.txt && rm gone.txt && mkdir -p sub && echo added > sub/added.txt \
         && echo note > /tmp/fork-note && mkdir /tmp/fork-dir && touch /tmp/fork-dir/f",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    write(s, &parent, "api.txt", "by the api\n").unwrap();
    // A background process of the parent: not copied.
    let bg = s.background(&parent, shell("sleep 60"));
    let before = state(s, &parent);
    assert_eq!(
        before.0,
        [
            ("api.txt".to_string(), ChangeKind::Added),
            ("changed.txt".to_string(), ChangeKind::Modified),
            ("gone.txt".to_string(), ChangeKind::Deleted),
            ("sub/added.txt".to_string(), ChangeKind::Added),
        ]
    );

    let t0 = std::time::Instant::now();
    let made = fork(
        s,
        &parent,
        ForkRequest {
            count: Some(3),
            ttl_secs: Some(900),
            labels: [("fork".to_string(), "yes".to_string())].into(),
            ..ForkRequest::default()
        },
    );
    eprintln!("{}: fork 1 -> 3 took {:?}", s.expect.backend, t0.elapsed());
    assert_eq!(made.len(), 3);
    let pinfo = s.api.info(&parent).unwrap();
    let ids: Vec<SandboxId> = made.iter().map(|i| i.id.clone()).collect();
    for info in &made {
        // Same image, policy, workspace, labels and enforcement; its own id and lease; where
        // it came from.
        assert_ne!(info.id, parent);
        assert_eq!(info.state, "running");
        assert_eq!(
            (&info.backend, &info.image, &info.policy, &info.policy_hash),
            (
                &pinfo.backend,
                &pinfo.image,
                &pinfo.policy,
                &pinfo.policy_hash
            )
        );
        assert_eq!(info.workspace, pinfo.workspace);
        assert_eq!(info.enforcement, pinfo.enforcement);
        assert_eq!(info.labels.get("fork").map(String::as_str), Some("yes"));
        assert_eq!(
            info.labels.get("suite").map(String::as_str),
            Some("api-conformance")
        );
        let from = info.forked_from.as_ref().expect("forked_from");
        assert_eq!((&from.parent, &from.checkpoint), (&parent, &None));
        let expires = info.expires_at_ms.expect("a fork's own lease");
        assert!(
            (info.created_at_ms + 898_000..=info.created_at_ms + 902_000).contains(&expires),
            "{info:?}"
        );
        assert!(info.checkpoints.is_empty(), "{info:?}");
        // Exactly the parent's files at the fork point, /tmp included.
        assert_eq!(state(s, &info.id), before, "fork {}", info.id);
        assert_eq!(text(s, &info.id, "kept.txt"), "kept\n");
        // The create's environment.
        let r = s.sh(&info.id, "echo $CONF_CREATE");
        assert_eq!(r.stdout.text, "from-create\n", "{r:?}");
        // No process of the parent's.
        expect_code(
            "the parent's background exec in a fork",
            s.api.process(&info.id, bg.exec_id),
            "not_found",
        );
        let r = s.sh(
            &info.id,
            "ps -e -o comm= 2>/dev/null | grep -c '^sleep' || true",
        );
        assert_eq!(r.stdout.text.trim(), "0", "{r:?}");
    }
    let listed: Vec<SandboxId> = s.api.list().into_iter().map(|i| i.id).collect();
    for id in &ids {
        assert!(listed.contains(id), "{id} listed");
    }

    // Writes in one fork reach neither the parent nor the other forks; the parent's writes
    // reach no fork.
    let (a, b, c) = (&ids[0], &ids[1], &ids[2]);
    write(s, a, "only-a.txt", "a\n").unwrap();
    assert_eq!(
        s.sh(a, "echo a > changed.txt; echo a > /tmp/fork-note")
            .exit_code,
        Some(0)
    );
    write(s, &parent, "only-parent.txt", "p\n").unwrap();
    s.sh(&parent, "echo p > /tmp/fork-note");
    for other in [b, c] {
        expect_code("a's file in b", read(s, other, "only-a.txt"), "not_found");
        expect_code(
            "the parent's new file in a fork",
            read(s, other, "only-parent.txt"),
            "not_found",
        );
        assert_eq!(state(s, other), before, "fork {other}");
    }
    expect_code(
        "a's file in the parent",
        read(s, &parent, "only-a.txt"),
        "not_found",
    );
    assert_eq!(text(s, &parent, "changed.txt"), "new\n");
    assert_eq!(
        s.sh(&parent, "cat /tmp/fork-note").stdout.text,
        "p\n",
        "the parent's /tmp"
    );
    expect_code(
        "the parent's file in a",
        read(s, a, "only-parent.txt"),
        "not_found",
    );

    // A checkpoint and restore in a fork leave the parent and the other forks as they are.
    s.api.checkpoint(b, checkpoint("in-b")).unwrap();
    s.sh(b, "echo b > changed.txt; rm kept.txt");
    let parent_now = state(s, &parent);
    s.api.restore(b, checkpoint("in-b")).unwrap();
    assert_eq!(state(s, b), before, "b restored");
    assert_eq!(
        state(s, &parent),
        parent_now,
        "the parent after b's restore"
    );
    assert_eq!(text(s, &parent, "kept.txt"), "kept\n");
    assert_eq!(state(s, c), before, "c after b's restore");
    expect_code(
        "b's checkpoint in the parent",
        s.api.restore(&parent, checkpoint("in-b")),
        "not_found",
    );

    // A fork outlives its parent, and is destroyed on its own.
    s.api.kill(&parent, bg.exec_id, 9).unwrap();
    s.api.destroy(&parent).unwrap();
    assert_eq!(text(s, c, "sub/added.txt"), "added\n");
    assert_eq!(s.sh(c, "true").exit_code, Some(0));
    for id in &ids {
        s.api.destroy(id).unwrap();
        expect_code("a destroyed fork", s.api.info(id), "sandbox_not_found");
    }
    // The host workspace was never touched.
    assert_eq!(
        std::fs::read_to_string(s.env.ws().join("changed.txt")).unwrap(),
        "old\n"
    );
    assert!(s.env.ws().join("gone.txt").exists());
}

pub fn a_fork_from_a_checkpoint_starts_there(s: &Subject) {
    let parent = s.create();
    s.sh(&parent, "echo one > f.txt && echo tmp > /tmp/fork-note");
    s.api.checkpoint(&parent, checkpoint("one")).unwrap();
    let at_one = s.api.diff(&parent, DiffRequest::default()).unwrap();
    s.sh(&parent, "echo two > f.txt && echo more > g.txt");
    s.api.checkpoint(&parent, checkpoint("two")).unwrap();
    s.sh(&parent, "echo three > f.txt");

    let made = fork(
        s,
        &parent,
        ForkRequest {
            count: Some(2),
            checkpoint: Some("one".into()),
            ..ForkRequest::default()
        },
    );
    assert_eq!(made.len(), 2);
    for info in &made {
        let from = info.forked_from.as_ref().unwrap();
        assert_eq!(from.checkpoint.as_deref(), Some("one"));
        let d = s.api.diff(&info.id, DiffRequest::default()).unwrap();
        assert_eq!(
            (diff_files(&d), &d.diff),
            (diff_files(&at_one), &at_one.diff)
        );
        assert_eq!(text(s, &info.id, "f.txt"), "one\n");
        expect_code(
            "g.txt of a later checkpoint",
            read(s, &info.id, "g.txt"),
            "not_found",
        );
        // A checkpoint holds the workspace only: /tmp starts empty.
        let r = s.sh(
            &info.id,
            "test -e /tmp/fork-note && echo there || echo absent",
        );
        assert_eq!(r.stdout.text, "absent\n", "{r:?}");
    }
    // The parent is as it was, its checkpoints too.
    assert_eq!(text(s, &parent, "f.txt"), "three\n");
    s.api.restore(&parent, checkpoint("two")).unwrap();
    assert_eq!(text(s, &parent, "f.txt"), "two\n");
    for info in &made {
        assert_eq!(text(s, &info.id, "f.txt"), "one\n");
        s.api.destroy(&info.id).unwrap();
    }
    s.api.destroy(&parent).unwrap();
}

pub fn bad_forks_are_refused_and_make_nothing(s: &Subject) {
    let parent = s.create();
    let before = s.api.list().len();
    for (what, req, code) in [
        (
            "count 0",
            ForkRequest {
                count: Some(0),
                ..ForkRequest::default()
            },
            "invalid_argument",
        ),
        (
            "count 65",
            ForkRequest {
                count: Some(MAX_FORKS + 1),
                ..ForkRequest::default()
            },
            "invalid_argument",
        ),
        (
            "an unknown checkpoint",
            ForkRequest {
                checkpoint: Some("nope".into()),
                ..ForkRequest::default()
            },
            "not_found",
        ),
        (
            "an invalid checkpoint name",
            ForkRequest {
                checkpoint: Some("../x".into()),
                ..ForkRequest::default()
            },
            "invalid_argument",
        ),
    ] {
        expect_code(what, s.api.fork(&parent, req), code);
    }
    let ghost = SandboxId::parse("sb-00000000deadbeef").unwrap();
    expect_code(
        "fork of an unknown sandbox",
        s.api.fork(&ghost, ForkRequest::default()),
        "sandbox_not_found",
    );
    assert_eq!(s.api.list().len(), before, "nothing was made");
    // One fork by default; it works at once.
    let one = forks(s, &parent, 1);
    assert_eq!(one.len(), 1);
    let r = s.api.exec(&one[0].id, shell("echo ok"), None).unwrap();
    match r {
        ExecOutcome::Finished(r) => assert_eq!(r.stdout.text, "ok\n"),
        other => panic!("{other:?}"),
    }
    s.api.destroy(&one[0].id).unwrap();
    s.api.destroy(&parent).unwrap();
    // A fork of a fork sees both generations' changes.
    let root = s.create();
    s.sh(&root, "echo 1 > gen.txt");
    let child = forks(s, &root, 1).remove(0);
    s.sh(&child.id, "echo 2 >> gen.txt");
    let grandchild = forks(s, &child.id, 1).remove(0);
    assert_eq!(text(s, &grandchild.id, "gen.txt"), "1\n2\n");
    assert_eq!(
        grandchild.forked_from.as_ref().map(|f| &f.parent),
        Some(&child.id)
    );
    for id in [&grandchild.id, &child.id, &root] {
        s.api.destroy(id).unwrap();
    }
    std::thread::sleep(Duration::from_millis(10));
}
