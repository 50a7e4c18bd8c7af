//! Test helpers shared by the workspace-layer tests: small file-tree builders and a real overlay
//! mounted with `userxattr` in a child's own user and mount namespaces, so tests see the upper
//! layer the kernel itself writes (as root and as an unprivileged user alike).
//!
//! Test code only (compiled for this crate's tests, and for other crates' tests through the
//! `testutil` feature): a failed step panics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::result::{Change, ChangeKind};

/// Set in the re-executed test binary that performs the overlay operations.
pub const CHILD_ENV: &str = "TASKBOX_OVERLAY_CHILD";
/// Exit status of the child when the kernel refuses the mount (test skipped).
pub const SKIP_STATUS: i32 = 77;

/// Prints why a test is skipped; fails instead when `TASKBOX_REQUIRE_ALL=1`.
pub fn skip(reason: &str) {
    if std::env::var("TASKBOX_REQUIRE_ALL").as_deref() == Ok("1") {
        panic!("required test skipped: {reason}");
    }
    eprintln!("skipped: {reason}");
}

pub fn change(path: &str, kind: ChangeKind) -> Change {
    Change {
        path: path.to_owned(),
        kind,
    }
}

/// Writes `root`/`rel`, creating its parents.
pub fn write(root: &Path, rel: &str, content: impl AsRef<[u8]>) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

pub fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// The entry at `path`, looked up as the layer code looks it up: beneath its parent directory.
pub fn node(path: &Path) -> crate::tree::Node {
    let tree = crate::tree::Tree::open(path.parent().unwrap(), "test tree").unwrap();
    tree.node(Path::new(path.file_name().unwrap()))
        .unwrap()
        .unwrap()
}

/// The overlay xattrs of the entry at `path`.
pub fn attrs(path: &Path) -> crate::changes::OverlayAttrs {
    crate::changes::overlay_attrs(&node(path)).unwrap()
}

/// One ignore file of about 200 KiB (`*.tmp`, then lines that match nothing) in the directory
/// `dirs[0]` of `root`, hard-linked into each of the other `dirs` (made here): what costs a
/// sandbox no space and the supervisor a matcher per directory.
pub fn linked_ignore_files(root: &Path, dirs: &[String]) {
    let mut text = String::from("*.tmp\n");
    let mut i = 0;
    while text.len() < 200 << 10 {
        text.push_str(&format!("f{i}.txt\n"));
        i += 1;
    }
    let first = root.join(&dirs[0]).join(".gitignore");
    write(root, &format!("{}/.gitignore", dirs[0]), text);
    for dir in &dirs[1..] {
        fs::create_dir_all(root.join(dir)).unwrap();
        fs::hard_link(&first, root.join(dir).join(".gitignore")).unwrap();
    }
}

pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    crate::sys::fset_xattr(&file, &CString::new(name).unwrap(), value)
}

/// The directories of one overlay mount: `lower` and `upper` are the layers, `work` the overlay's
/// scratch directory (on the same filesystem as `upper`), `merged` the mount point.
#[derive(Debug, Clone)]
pub struct OverlayDirs {
    pub lower: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub merged: PathBuf,
}

impl OverlayDirs {
    /// `root`/{lower,upper,work,merged}, created.
    pub fn create(root: &Path) -> OverlayDirs {
        let dirs = OverlayDirs {
            lower: root.join("lower"),
            upper: root.join("upper"),
            work: root.join("work"),
            merged: root.join("merged"),
        };
        for d in [&dirs.lower, &dirs.upper, &dirs.work, &dirs.merged] {
            fs::create_dir_all(d).unwrap();
        }
        dirs
    }

    /// The same lower tree with another upper layer (and its own work dir and mount point).
    pub fn with_upper(&self, upper: &Path, scratch: &Path) -> OverlayDirs {
        let dirs = OverlayDirs {
            lower: self.lower.clone(),
            upper: upper.to_path_buf(),
            work: scratch.join("work"),
            merged: scratch.join("merged"),
        };
        for d in [&dirs.work, &dirs.merged] {
            fs::create_dir_all(d).unwrap();
        }
        dirs
    }
}

/// Runs in a re-executed test binary (the test named in [`run_overlay`]): when this process is
/// the child, mounts the overlay, calls `op(name, merged)` and unmounts; otherwise does nothing.
pub fn overlay_child(op: impl FnOnce(&str, &Path) -> io::Result<()>) {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    let Some(name) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = |key: &str| PathBuf::from(std::env::var_os(format!("{CHILD_ENV}_{key}")).unwrap());
    let (lower, upper, work, merged) = (dir("LOWER"), dir("UPPER"), dir("WORK"), dir("MERGED"));
    // Keep the overlay out of the parent's namespace whatever the propagation of "/".
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .unwrap();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},userxattr",
        lower.display(),
        upper.display(),
        work.display()
    );
    if let Err(e) = mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    ) {
        eprintln!("cannot mount overlay with userxattr in a user namespace: {e}");
        std::process::exit(SKIP_STATUS);
    }
    let result = op(&name.to_string_lossy(), &merged);
    umount2(&merged, MntFlags::empty()).unwrap();
    result.unwrap();
}

/// Re-executes this test binary as the test `entry` (which calls [`overlay_child`]) in new user
/// and mount namespaces, to perform the operation `op` on the overlay `dirs`. `Err` holds the
/// reason to skip (no user namespaces, or no overlay with `userxattr` in them); a failing child
/// panics.
pub fn run_overlay(entry: &str, dirs: &OverlayDirs, op: &str) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // SAFETY: geteuid/getegid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // Prepared before fork: the pre_exec closure must not allocate.
    let files: Vec<(CString, Vec<u8>)> = [
        ("/proc/self/setgroups", "deny".to_owned()),
        ("/proc/self/uid_map", format!("0 {uid} 1")),
        ("/proc/self/gid_map", format!("0 {gid} 1")),
    ]
    .into_iter()
    .map(|(p, c)| (CString::new(p).unwrap(), c.into_bytes()))
    .collect();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", entry, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, op)
        .env(format!("{CHILD_ENV}_LOWER"), &dirs.lower)
        .env(format!("{CHILD_ENV}_UPPER"), &dirs.upper)
        .env(format!("{CHILD_ENV}_WORK"), &dirs.work)
        .env(format!("{CHILD_ENV}_MERGED"), &dirs.merged);
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls
    // (unshare, open, write, close) on memory prepared before the fork; it does not allocate
    // or take locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            for (path, content) in &files {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let n = libc::write(fd, content.as_ptr().cast(), content.len());
                libc::close(fd);
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => return Err(format!("cannot enter a user namespace: {e}")),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => Ok(()),
        Some(SKIP_STATUS) => Err(stderr.trim().to_owned()),
        _ => panic!(
            "overlay child failed ({}):\n{}\n{stderr}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        ),
    }
}
