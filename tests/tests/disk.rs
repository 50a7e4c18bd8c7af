//! The disk quota (`limits.disk`) and the per-file limit (`limits.file_size`) on the native
//! backend, one-shot and long-lived, as root (a loop-backed ext4 per sandbox) and rootless (a
//! tmpfs): a sandbox that writes past the quota gets `ENOSPC` and a `limit` violation, the host
//! loses no more than the quota, and nothing made for the quota outlives the sandbox.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::sandbox::NativeBackend;
use taskbox_tests::{Env, Run, is_root, taskbox};

const MIB: u64 = 1 << 20;
const QUOTA: u64 = 64 * MIB;
/// What the file system's own metadata, the trace, the plan and the test's bookkeeping may take
/// beyond the quota.
const SLACK: u64 = 32 * MIB;

/// 200 MiB in four files, each `dd` reporting how it ended.
const WRITE_200_MIB: &str = "for i in 1 2 3 4; do \
     dd if=/dev/zero of=f$i bs=1M count=50 2>&1; done; \
     dd if=/dev/zero of=/tmp/scratch bs=1M count=8 2>&1; sleep 1";

fn free_bytes(path: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(path).unwrap();
    st.blocks_available() * st.fragment_size()
}

/// A tmpfs of our own under `dir` for the state directory (as root), so that only this test's
/// writes move its free space; unmounted on drop. Rootless, the directory itself (the quota is a
/// tmpfs in memory then: the state directory's file system must not move at all).
struct StateFs {
    path: PathBuf,
    mounted: bool,
}

impl StateFs {
    fn new(dir: &Path) -> StateFs {
        let path = dir.join("statefs");
        std::fs::create_dir_all(&path).unwrap();
        let mounted = is_root()
            && nix::mount::mount(
                Some("tmpfs"),
                &path,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=1g,mode=700"),
            )
            .is_ok();
        StateFs { path, mounted }
    }
}

impl Drop for StateFs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// The lowest free space of `path`'s file system while `busy` holds.
fn watch_free(path: PathBuf, busy: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut low = free_bytes(&path);
        while busy.load(Ordering::SeqCst) {
            low = low.min(free_bytes(&path));
            std::thread::sleep(Duration::from_millis(10));
        }
        low.min(free_bytes(&path))
    })
}

fn expected_kind() -> &'static str {
    if is_root() { "loop-ext4" } else { "tmpfs" }
}

/// Loop devices attached to an image under `dir`, and mounts at or beneath it.
fn leftovers(dir: &Path) -> (Vec<String>, Vec<String>) {
    let d = dir.display().to_string();
    let loops = taskbox_core::loopdev::attached()
        .into_iter()
        .filter(|(_, backing)| backing.starts_with(&d))
        .map(|(dev, backing)| format!("{} -> {backing}", dev.display()))
        .collect();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|p| p.starts_with(&d))
        .collect();
    (loops, mounts)
}

/// Waits (a little: the kernel frees a loop device once the last reference to its file system
/// goes, which a sandbox's exiting processes may still hold) until nothing is left under `dir`.
fn assert_nothing_left(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (loops, mounts) = leftovers(dir);
        if loops.is_empty() && mounts.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: loop devices {loops:?}, mounts {mounts:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let images: Vec<_> = walk(dir)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "disk.img"))
        .collect();
    assert!(images.is_empty(), "image files left behind: {images:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(walk(&p));
            }
            out.push(p);
        }
    }
    out
}

fn has_disk_violation(violations: &serde_json::Value) -> bool {
    violations.as_array().unwrap().iter().any(|v| {
        v["kind"] == "limit"
            && v["detail"]
                .as_str()
                .unwrap()
                .starts_with("disk limit of 64 MiB reached")
    })
}

#[test]
fn a_run_that_writes_past_the_disk_limit_gets_enospc_and_a_violation() {
    let env = Env::new();
    let statefs = StateFs::new(env.dir.path());
    let state = statefs.path.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let policy = env.policy("disk", "[limits]\ndisk = \"64MiB\"\n");
    let before = free_bytes(&statefs.path);
    let busy = Arc::new(AtomicBool::new(true));
    let watcher = watch_free(statefs.path.clone(), busy.clone());
    let out = Command::new(taskbox())
        .env("TASKBOX_STATE_DIR", &state)
        .env("HOME", env.home())
        .current_dir(env.ws())
        .stdin(Stdio::null())
        .args(["run", "--json", "--policy"])
        .arg(&policy)
        .args(["--", "/bin/sh", "-c", WRITE_200_MIB])
        .output()
        .unwrap();
    busy.store(false, Ordering::SeqCst);
    let low = watcher.join().unwrap();
    let run = Run::from_output(out);
    let text = format!("{}{}", run.stdout(), run.json["stderr"]["text"]);
    assert!(text.contains("No space left on device"), "{:#}", run.json);
    assert!(
        has_disk_violation(&run.json["violations"]),
        "{:#}",
        run.json
    );
    assert_eq!(
        run.json["enforcement"]["disk"],
        expected_kind(),
        "{:#}",
        run.json
    );
    let lost = before.saturating_sub(low);
    assert!(
        lost <= QUOTA + SLACK,
        "the host lost {} MiB during the run (quota 64 MiB)",
        lost / MIB
    );
    // Nothing of what the sandbox wrote stays in the state directory (blocks allocated: the
    // kept ext4 template is a sparse file of the quota's length).
    use std::os::unix::fs::MetadataExt;
    let kept: u64 = walk(&state)
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(p).ok())
        .map(|m| m.blocks() * 512)
        .sum();
    assert!(kept < 8 * MIB, "{} MiB left in the state dir", kept / MIB);
    assert_nothing_left(&state);
}

#[test]
fn a_write_past_the_file_size_limit_is_a_violation() {
    let env = Env::new();
    let policy = env.policy("fsize", "[limits]\nfile_size = \"1MiB\"\n");
    let policy = policy.display().to_string();
    // The command itself killed by SIGXFSZ, and a shell reporting that its child was.
    for argv in [
        vec!["dd", "if=/dev/zero", "of=big", "bs=64k", "count=100"],
        vec![
            "/bin/sh",
            "-c",
            "dd if=/dev/zero of=big2 bs=64k count=100; exit $?",
        ],
    ] {
        let run = env.run_json(&["--policy", &policy], &argv);
        let found = run.json["violations"].as_array().unwrap().iter().any(|v| {
            v["kind"] == "limit"
                && v["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("file size limit of 1 MiB reached")
        });
        assert!(found, "{argv:?}: {:#}", run.json);
    }
    // A process that ignores SIGXFSZ sees EFBIG; the file it left at the limit tells.
    let run = env.run_json(
        &["--policy", &policy],
        &[
            "/bin/sh",
            "-c",
            "trap '' XFSZ; dd if=/dev/zero of=big3 bs=64k count=100; true",
        ],
    );
    assert!(
        run.json["violations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["detail"]
                .as_str()
                .unwrap()
                .starts_with("file size limit of 1 MiB reached")),
        "{:#}",
        run.json
    );
    assert!(
        run.stdout().is_empty()
            && run.json["stderr"]["text"]
                .as_str()
                .unwrap()
                .contains("File too large"),
        "{:#}",
        run.json
    );
    // A write within the limit is not one.
    let run = env.run_json(
        &["--policy", &policy],
        &["dd", "if=/dev/zero", "of=small", "bs=64k", "count=4"],
    );
    assert_eq!(
        run.json["violations"],
        serde_json::json!([]),
        "{:#}",
        run.json
    );
}

/// A long-lived sandbox on `env`'s workspace with a disk of 64 MiB.
fn create_with_64_mib(backend: &NativeBackend, env: &Env) -> SandboxInfo {
    let policy = env.policy("disk", "[limits]\ndisk = \"64MiB\"\n");
    backend
        .create(CreateRequest {
            workspace: env.ws().display().to_string(),
            policy: Some(policy.display().to_string()),
            ..CreateRequest::default()
        })
        .unwrap()
}

#[test]
fn a_long_lived_sandbox_is_held_to_its_disk_limit_and_leaves_nothing_behind() {
    let env = Env::new();
    let statefs = StateFs::new(env.dir.path());
    let state = statefs.path.join("state");
    let backend = NativeBackend::new(state.clone()).unwrap();
    let info = create_with_64_mib(&backend, &env);
    assert_eq!(info.enforcement.disk, expected_kind(), "{info:?}");
    let before = free_bytes(&statefs.path);
    let r = taskbox_tests::shell(&backend, &info.id, WRITE_200_MIB);
    let low = free_bytes(&statefs.path);
    let text = format!("{}{}", r.stdout.text, r.stderr.text);
    assert!(text.contains("No space left on device"), "{r:?}");
    assert!(
        r.violations
            .iter()
            .any(|v| v.kind == "limit" && v.detail.starts_with("disk limit of 64 MiB reached")),
        "{r:?}"
    );
    assert!(
        before.saturating_sub(low) <= QUOTA + SLACK,
        "the host lost {} MiB (quota 64 MiB)",
        before.saturating_sub(low) / MIB
    );
    // Removing files frees the quota again: the next exec can write, and reports no violation.
    let r = taskbox_tests::shell(
        &backend,
        &info.id,
        "rm -f f1 f2 f3 f4 /tmp/scratch && dd if=/dev/zero of=again bs=1M count=8 2>&1 | tail -n 1",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert!(!r.violations.iter().any(|v| v.kind == "limit"), "{r:?}");
    if is_root() {
        // Never flushed (nothing on the disk can outlive a crash of the host): an fsync in the
        // sandbox is no flush of the host's disk.
        let r = taskbox_tests::shell(
            &backend,
            &info.id,
            "grep ' - ext4 /dev/loop' /proc/self/mountinfo",
        );
        let lines: Vec<&str> = r.stdout.text.lines().collect();
        assert!(!lines.is_empty(), "{r:?}");
        assert!(lines.iter().all(|l| l.contains("nobarrier")), "{lines:?}");
    }
    backend.destroy(&info.id).unwrap();
    assert_nothing_left(&state);
    drop(backend);
}

/// A fork's frozen copy of its parent's layers is made on the parent's disk and gone once the
/// forks have theirs (the parent's free space is what it was); a parent that has filled more
/// than half its disk still forks (the copy then goes on the state directory), and the fork
/// has the parent's files.
#[test]
fn a_fork_leaves_its_parents_disk_as_it_was_and_a_nearly_full_parent_still_forks() {
    let env = Env::new();
    let backend = NativeBackend::new(env.state()).unwrap();
    let parent = create_with_64_mib(&backend, &env).id;
    let free = |id: &SandboxId| -> u64 {
        let r = taskbox_tests::shell(&backend, id, "sync; stat -f -c %a /tmp");
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        r.stdout.text.trim().parse().unwrap()
    };
    let fork = |count: u32| {
        backend
            .fork(
                &parent,
                ForkRequest {
                    count: Some(count),
                    ..ForkRequest::default()
                },
            )
            .unwrap()
            .sandboxes
    };
    let r = taskbox_tests::shell(&backend, &parent, "echo small > small.txt");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let before = free(&parent);
    let forks = fork(2);
    assert_eq!(
        free(&parent),
        before,
        "the fork left something on its parent's disk"
    );
    for f in &forks {
        backend.destroy(&f.id).unwrap();
    }
    // 40 of the 64 MiB: no room for a second copy on the parent's disk.
    let r = taskbox_tests::shell(
        &backend,
        &parent,
        "dd if=/dev/urandom of=big.bin bs=1M count=40 2>/dev/null && md5sum big.bin",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let sum = r.stdout.text.clone();
    let forks = fork(1);
    let r = taskbox_tests::shell(&backend, &forks[0].id, "md5sum big.bin; cat small.txt");
    assert_eq!(r.stdout.text, format!("{sum}small\n"), "{r:?}");
    for f in &forks {
        backend.destroy(&f.id).unwrap();
    }
    backend.destroy(&parent).unwrap();
}
