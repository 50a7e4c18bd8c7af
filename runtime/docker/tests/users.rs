//! Execs as a named user in Docker sandboxes, a writable root and the root's capabilities,
//! against the real daemon: a user resolves in the container's own account files at the time of
//! the exec, only a command running as uid 0 has the policy's capabilities, the default policy
//! keeps a read-only root and none, and kill and timeouts still end what such a command made.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use taskbox_core::api::*;
use taskbox_core::result::ExecResult;

/// A writable root whose root may manage users (busybox's adduser), as an evaluation harness's
/// image setup needs.
const ADMIN_POLICY: &str = r#"
[filesystem]
root = "writable"

[security]
root_capabilities = ["chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid"]
"#;

/// The effective capability mask of CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID.
const ADMIN_CAPS: u64 = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7);

fn create_with(h: &Harness, policy: &str) -> SandboxId {
    let req = CreateRequest {
        policy: Some("admin".into()),
        policy_toml: Some(policy.into()),
        ..h.create_req()
    };
    h.backend.create(req).unwrap().id
}

fn as_user(h: &Harness, id: &SandboxId, user: &str, script: &str) -> ExecResult {
    h.exec(
        id,
        ExecRequest {
            shell: Some(script.into()),
            user: Some(user.into()),
            ..Default::default()
        },
    )
}

/// The effective capabilities of the shell of `script`'s exec, from its /proc/self/status.
fn cap_eff(r: &ExecResult) -> u64 {
    let line = r
        .stdout
        .text
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap_or_else(|| panic!("no CapEff in {r:?}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

#[test]
fn execs_run_as_the_user_they_name_resolved_when_they_run() {
    let Some(h) = Harness::new() else { return };
    let id = create_with(&h, ADMIN_POLICY);

    // No user: the image's, without capabilities.
    let r = h.sh(&id, "id -u; id -g; grep CapEff /proc/self/status");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert!(r.stdout.text.starts_with("1000\n1000\n"), "{r:?}");
    assert_eq!(cap_eff(&r), 0, "the image's user has no capability");

    // root, by name and by number: uid 0 with the policy's capabilities, and no others.
    for root in ["root", "0"] {
        let r = as_user(&h, &id, root, "id -u; id -g; grep CapEff /proc/self/status");
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        assert!(r.stdout.text.starts_with("0\n0\n"), "{root}: {r:?}");
        assert_eq!(cap_eff(&r), ADMIN_CAPS, "{root}: {r:?}");
    }

    // A user added by an earlier exec counts, with its groups, its home, and no capability.
    let r = as_user(
        &h,
        &id,
        "root",
        "echo 'newu:x:2001:2001::/home/newu:/bin/sh' >> /etc/passwd && \
         echo 'newu:x:2001:' >> /etc/group && echo 'extra:x:3000:u,newu' >> /etc/group && \
         mkdir /home/newu && chown 2001:2001 /home/newu",
    );
    assert_eq!(r.exit_code, Some(0), "adding a user as root: {r:?}");
    let r = as_user(
        &h,
        &id,
        "newu",
        "id -un; id -u; id -g; id -G; echo $HOME; grep CapEff /proc/self/status",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let lines: Vec<&str> = r.stdout.text.lines().collect();
    assert_eq!(&lines[..3], ["newu", "2001", "2001"], "{r:?}");
    let groups: Vec<&str> = lines[3].split_whitespace().collect();
    assert!(groups.contains(&"3000"), "its supplementary group: {r:?}");
    assert_eq!(lines[4], "/home/newu", "{r:?}");
    assert_eq!(cap_eff(&r), 0, "only uid 0 has the capabilities: {r:?}");
    // A HOME the request sets is kept.
    let r = h.exec(
        &id,
        ExecRequest {
            shell: Some("echo $HOME".into()),
            user: Some("newu".into()),
            env: [("HOME".to_string(), "/tmp".to_string())].into(),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout.text, "/tmp\n", "{r:?}");

    // A uid no line names runs as itself (gid = uid, as the contract says).
    let r = as_user(&h, &id, "4321", "id -u; id -g");
    assert_eq!(r.stdout.text, "4321\n4321\n", "{r:?}");

    // An unknown name is user_not_found, naming it; a malformed one invalid_argument.
    for (user, code) in [
        ("nonexistent", "user_not_found"),
        ("a:b", "invalid_argument"),
    ] {
        let e = h.exec_err(
            &id,
            ExecRequest {
                argv: Some(vec!["true".into()]),
                user: Some(user.into()),
                ..Default::default()
            },
        );
        assert_eq!(e.code(), code, "{user}: {e}");
        assert!(e.to_string().contains(user), "{e}");
    }
    // Removed again, the user is unknown again.
    let r = as_user(&h, &id, "root", "sed -i '/^newu:/d' /etc/passwd");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let e = h.exec_err(
        &id,
        ExecRequest {
            argv: Some(vec!["true".into()]),
            user: Some("newu".into()),
            ..Default::default()
        },
    );
    assert_eq!(e.code(), "user_not_found", "{e}");
    h.backend.destroy(&id).unwrap();
}

#[test]
fn the_default_policy_keeps_a_read_only_root_and_no_capabilities() {
    let Some(h) = Harness::new() else { return };
    let id = h.create();
    let name = h.backend.container_name(&id).unwrap();
    let c = inspect(&name);
    assert_eq!(c["HostConfig"]["ReadonlyRootfs"], true);
    assert_eq!(c["HostConfig"]["CapDrop"], serde_json::json!(["ALL"]));
    assert!(
        c["HostConfig"]["CapAdd"].is_null(),
        "{}",
        c["HostConfig"]["CapAdd"]
    );
    assert_eq!(c["Config"]["User"], "1000:1000");

    // uid 0 may be named, and is powerless: no capability, a read-only root.
    let r = as_user(
        &h,
        &id,
        "root",
        "id -u; grep -E 'CapEff|CapBnd' /proc/self/status; touch /etc/x || echo refused; \
         chown 1000 /tmp/.. 2>/dev/null || echo nochown",
    );
    let lines: Vec<&str> = r.stdout.text.lines().collect();
    assert_eq!(lines[0], "0", "{r:?}");
    assert!(lines[1].ends_with("0000000000000000"), "{r:?}");
    assert!(lines[2].ends_with("0000000000000000"), "{r:?}");
    assert!(r.stdout.text.contains("refused\n"), "{r:?}");
    assert!(r.stdout.text.contains("nochown\n"), "{r:?}");
    h.backend.destroy(&id).unwrap();
}

#[test]
fn a_writable_root_is_the_sandboxs_own_and_goes_with_it() {
    let Some(h) = Harness::new() else { return };
    let a = create_with(&h, ADMIN_POLICY);
    let name = h.backend.container_name(&a).unwrap();
    let c = inspect(&name);
    assert_eq!(c["HostConfig"]["ReadonlyRootfs"], false);
    assert_eq!(c["HostConfig"]["CapDrop"], serde_json::json!(["ALL"]));
    let mut added: Vec<String> = serde_json::from_value(c["HostConfig"]["CapAdd"].clone()).unwrap();
    added.sort();
    assert_eq!(
        added,
        [
            "CHOWN",
            "DAC_OVERRIDE",
            "FOWNER",
            "FSETID",
            "KILL",
            "SETGID",
            "SETUID"
        ],
        "{}",
        c["HostConfig"]["CapAdd"]
    );
    let r = as_user(&h, &a, "root", "echo mark > /etc/marker && cat /etc/marker");
    assert_eq!(r.stdout.text, "mark\n", "{r:?}");
    // The image's user may write where the root lets it, not in /etc.
    let r = as_user(&h, &a, "root", "mkdir /opt && chown u /opt");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = h.sh(
        &a,
        "touch /opt/mine && echo ok; touch /etc/other 2>/dev/null || echo no",
    );
    assert_eq!(r.stdout.text, "ok\nno\n", "{r:?}");
    // Root-level changes are not workspace changes.
    assert!(r.changes.is_empty(), "{r:?}");

    // Another sandbox of the same image and policy starts from the image as it is.
    let b = create_with(&h, ADMIN_POLICY);
    let r = h.sh(&b, "cat /etc/marker 2>/dev/null || echo absent");
    assert_eq!(r.stdout.text, "absent\n", "{r:?}");
    h.backend.destroy(&a).unwrap();
    assert!(
        containers_with_label(taskbox_docker::LABEL_SANDBOX, a.as_str()).is_empty(),
        "the container and its layer are gone"
    );
    h.backend.destroy(&b).unwrap();
}

/// A root that may change its uid but not signal others (`setuid` without `kill`): what a
/// command turned into another user is still killed on timeout and at the end of its exec.
const SETUID_ONLY: &str = r#"
[security]
root_capabilities = ["setuid", "setgid"]
"#;

#[test]
fn kill_and_timeouts_end_processes_of_other_users() {
    let Some(h) = Harness::new() else { return };
    let id = create_with(&h, SETUID_ONLY);
    let sleepers = |h: &Harness| {
        h.sh(&id, "ps -o user,args | grep '[s]leep 1000' || true")
            .stdout
            .text
    };

    // The exec's main process becomes uid 1000 under a root wrapper that cannot signal it.
    let start = Instant::now();
    let r = h.exec(
        &id,
        ExecRequest {
            shell: Some("exec su -s /bin/sh u -c 'exec sleep 1000'".into()),
            user: Some("root".into()),
            timeout_ms: Some(1500),
            ..Default::default()
        },
    );
    assert!(r.timed_out, "{r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(sleepers(&h), "", "the timed-out process is gone");

    // A process of another user left behind when the command ends is ended too.
    let r = as_user(
        &h,
        &id,
        "root",
        "su -s /bin/sh u -c 'sleep 1000 >/dev/null 2>&1 &'; echo started",
    );
    assert_eq!(r.stdout.text, "started\n", "{r:?}");
    assert!(
        wait_until(Duration::from_secs(5), || sleepers(&h).is_empty()),
        "left behind: {}",
        sleepers(&h)
    );

    // A background exec as a named user: its pid, a signal, then kill.
    let info = h.start(
        &id,
        ExecRequest {
            shell: Some("trap 'echo got-term; exit 7' TERM; while :; do sleep 0.1; done".into()),
            user: Some("u".into()),
            ..Default::default()
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    h.backend.kill(&id, info.exec_id, libc::SIGTERM).unwrap();
    let done = h
        .backend
        .wait(&id, info.exec_id, Duration::from_secs(10))
        .unwrap();
    let r = done.result.expect("it ended");
    assert_eq!(r.exit_code, Some(7), "{r:?}");
    assert_eq!(r.stdout.text, "got-term\n", "{r:?}");

    let info = h.start(
        &id,
        ExecRequest {
            shell: Some("sleep 1000".into()),
            user: Some("u".into()),
            ..Default::default()
        },
    );
    h.backend.kill(&id, info.exec_id, libc::SIGKILL).unwrap();
    let done = h
        .backend
        .wait(&id, info.exec_id, Duration::from_secs(10))
        .unwrap();
    assert_eq!(done.result.expect("it ended").signal, Some(libc::SIGKILL));
    assert_eq!(sleepers(&h), "");
    h.backend.destroy(&id).unwrap();
}
