//! Idmapped bind mounts: a host directory whose owner appears, inside the sandbox, as the
//! sandbox's root, and whose new files are stored as owned by that owner.
//!
//! For `--write-through` when taskbox runs as root on a directory another user owns: the command
//! (uid 0 without capabilities) would otherwise leave root-owned files in that user's directory.
//! The mount's id mapping (a user namespace with `uid_map` "OWNER 0 1") shows the owner's files as
//! uid 0, so the command keeps the owner's rights on them, and stores what uid 0 creates as the
//! owner's; files of anyone else show as the overflow id and keep only their "other" rights.
//!
//! Only the host's root may give a mount an id mapping, so the helper makes the mount (detached,
//! as a descriptor) before it enters any user namespace; pid 1 attaches it in its own tree.

use std::ffi::CString;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::config::{IdRange, OwnerMap};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::sched::{CloneFlags, unshare};
use nix::unistd::{ForkResult, fork};

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A detached copy of the mount tree at `src` (recursive), where host `uid`:`gid` are the
/// tree's 0:0, `nosuid` and `nodev`. Attach it with [`attach`].
pub fn owned_bind(src: &Path, uid: u32, gid: u32) -> io::Result<OwnedFd> {
    let userns = mapping_namespace(&format!("{uid} 0 1\n"), &format!("{gid} 0 1\n"), true)?;
    mapped_tree(src, userns.as_fd())
}

/// A detached copy of the mount tree at `src` whose files of host `map.uid`:`map.gid` appear
/// as host `map.as_uid`:`map.as_gid` (a workspace's owner as the sandbox's user).
pub fn owner_bind(src: &Path, map: &OwnerMap) -> io::Result<OwnedFd> {
    let userns = mapping_namespace(
        &format!("{} {} 1\n", map.uid, map.as_uid),
        &format!("{} {} 1\n", map.gid, map.as_gid),
        true,
    )?;
    mapped_tree(src, userns.as_fd())
}

/// The user namespace of a sandbox's commands: its ids `0..size` are the host's
/// `base..base+size` (set-groups allowed: an exec as a user takes that user's groups).
pub fn range_namespace(range: &IdRange) -> io::Result<OwnedFd> {
    let map = format!("0 {} {}\n", range.base, range.size);
    mapping_namespace(&map, &map, false)
}

/// A detached copy of the mount tree at `src` (recursive), idmapped with the maps of `userns`
/// (a file of host id `k` appears as the id `k` maps to), `nosuid` and `nodev`.
pub fn mapped_tree(src: &Path, userns: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let c = cpath(src)?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; the flags are plain
    // integers. The returned descriptor is new and ours.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | AT_RECURSIVE,
        )
    })?;
    // SAFETY: open_tree just returned this descriptor; nothing else owns it.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `tree` is an open mount descriptor, the empty path with AT_EMPTY_PATH names it;
    // `attr` is an initialised `struct mount_attr` whose exact size is passed.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })
    .map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::EINVAL) => {
                "its file system does not support idmapped mounts (run taskbox as \
                                   the directory's owner instead)"
                    .to_string()
            }
            _ => e.to_string(),
        };
        io::Error::new(e.kind(), format!("cannot give it an id mapping: {why}"))
    })?;
    Ok(tree)
}

/// Attaches a tree made by [`owned_bind`] at `target`.
pub fn attach(tree: &OwnedFd, target: &Path) -> io::Result<()> {
    let c = cpath(target)?;
    // SAFETY: `tree` is an open mount descriptor named by the empty path; `c` is a valid
    // NUL-terminated path that outlives the call.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })
    .map(drop)
}

/// A user namespace with these maps (`uid_map` and `gid_map` text), as a descriptor: a child
/// enters a new one and waits while this process (root of the parent namespace, the only one
/// allowed to map other ids than its own) writes its maps and opens it. `deny_setgroups` for
/// a namespace only mounts use.
fn mapping_namespace(uid_map: &str, gid_map: &str, deny_setgroups: bool) -> io::Result<OwnedFd> {
    let (ready_read, ready_write) = nix::unistd::pipe()?;
    let (done_read, done_write) = nix::unistd::pipe()?;
    // SAFETY: the helper is single-threaded, so the child may run any code after fork; it only
    // unshares, writes a byte and waits.
    match unsafe { fork() }? {
        ForkResult::Child => {
            drop((ready_read, done_write));
            let entered = unshare(CloneFlags::CLONE_NEWUSER).is_ok();
            let mut ready = std::fs::File::from(ready_write);
            if entered {
                let _ = ready.write_all(b"1");
            }
            drop(ready);
            // Wait until the parent has opened the namespace (it closes its end then).
            let _ = std::fs::File::from(done_read).read(&mut [0u8; 1]);
            // SAFETY: _exit ends the child without running the parent's destructors.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => {
            drop((ready_write, done_read));
            let mut byte = [0u8; 1];
            let entered = std::fs::File::from(ready_read).read(&mut byte);
            let result = match entered {
                Ok(1) => {
                    let proc = format!("/proc/{child}");
                    std::fs::write(format!("{proc}/uid_map"), uid_map)
                        .and_then(|()| {
                            if deny_setgroups {
                                std::fs::write(format!("{proc}/setgroups"), "deny\n")?;
                            }
                            std::fs::write(format!("{proc}/gid_map"), gid_map)
                        })
                        .and_then(|()| std::fs::File::open(format!("{proc}/ns/user")))
                        .map(OwnedFd::from)
                }
                _ => Err(io::Error::other(
                    "cannot create a user namespace for the mapping",
                )),
            };
            drop(done_write);
            let _ = nix::sys::wait::waitpid(child, None);
            result
        }
    }
}
