//! File operations as the sandbox's own user.
//!
//! The supervisor runs with more rights than a sandbox's commands (often root with every
//! capability), so a file operation it made with its own rights would read a `chmod -r` file
//! or overwrite a 0444 one that no command of the sandbox could. [`as_user`] runs an operation
//! on a thread of its own that first takes the sandbox user's credentials ([`SandboxUser`]:
//! file-system uid and gid, supplementary groups) and gives up every capability, and, for an
//! operation on the sandbox's root, restricts itself with the same Landlock rules as an exec
//! ([`FsLandlock`]): the kernel then checks every open, create, rename and remove exactly as it
//! checks the sandbox's commands. The thread ends with the operation, so nothing of it has to
//! be undone, and no other work ever runs with its credentials.
//!
//! Credentials are per thread in the kernel; the C library's `setgroups` changes them on every
//! thread of the process (it signals them all), so the calls here are raw system calls, which
//! change the calling thread only.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::api::ApiError;

/// Who a sandbox's commands are, as the host kernel sees them: what its file operations run as.
/// Each backend takes it from where its execs' credentials come from (the native backend: the
/// ids its helper maps the sandbox's user onto; Docker: the container user), so the two cannot
/// drift apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

impl SandboxUser {
    /// This process's own effective ids and groups: who a command is when it keeps the
    /// caller's identity.
    pub fn of_this_process() -> SandboxUser {
        SandboxUser {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            groups: sys::groups().unwrap_or_default(),
        }
    }
}

/// The Landlock rules of a sandbox's execs, for file operations on its root: reads beneath the
/// root, every right beneath `writable` (paths as the sandbox sees them), nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsLandlock {
    pub writable: Vec<PathBuf>,
    /// The policy requires Landlock: an operation that cannot be confined fully is refused.
    pub required: bool,
}

/// Runs `op` on a thread that has `user`'s credentials and no capability; with `landlock`,
/// also restricted by its rules beneath `root` (the sandbox's root directory). What `op`
/// touches is checked by the kernel as for the sandbox's commands.
pub fn as_user<T: Send>(
    user: &SandboxUser,
    landlock: Option<(&OwnedFd, &FsLandlock)>,
    op: impl FnOnce() -> Result<T, ApiError> + Send,
) -> Result<T, ApiError> {
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name("fs-as-user".into())
            .spawn_scoped(s, move || {
                become_user(user).map_err(|e| {
                    ApiError::internal(format!(
                        "cannot take the sandbox user's credentials (uid {}, gid {}): {e}",
                        user.uid, user.gid
                    ))
                })?;
                if let Some((root, rules)) = landlock {
                    restrict(root, rules)?;
                }
                op()
            })
            .map_err(|e| ApiError::internal(format!("cannot start a thread: {e}")))?;
        worker
            .join()
            .unwrap_or_else(|_| Err(ApiError::internal("a file operation panicked")))
    })
}

/// Takes `user`'s ids and groups on this thread, then drops every capability.
fn become_user(user: &SandboxUser) -> io::Result<()> {
    // Groups first: changing them needs CAP_SETGID, which goes last. A caller without it (an
    // unprivileged supervisor) has the sandbox's groups already.
    let mut want = user.groups.clone();
    want.sort_unstable();
    want.dedup();
    let mut have = sys::groups()?;
    have.sort_unstable();
    have.dedup();
    if want != have {
        sys::set_thread_groups(&want)?;
    }
    sys::set_thread_fsgid(user.gid)?;
    sys::set_thread_fsuid(user.uid)?;
    sys::drop_thread_capabilities()
}

/// The Landlock ABI whose file-system rights are handled: the one the exec's rules ask for
/// (`taskbox-init`'s `TARGET_ABI`), so a file operation is refused what an exec is refused.
const ABI: landlock::ABI = landlock::ABI::V7;

/// Restricts this thread to reads beneath `root` and writes beneath the rules' paths.
fn restrict(root: &OwnedFd, rules: &FsLandlock) -> Result<(), ApiError> {
    use landlock::{
        Access, AccessFs, PathBeneath, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus,
    };
    let failed = |e: &dyn std::fmt::Display| {
        ApiError::internal(format!(
            "cannot apply the sandbox's landlock rules to a file operation: {e}"
        ))
    };
    let mut created = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI))
        .and_then(|r| r.create())
        .map_err(|e| failed(&e))?;
    created = created
        .add_rule(PathBeneath::new(root.as_fd(), AccessFs::from_read(ABI)))
        .map_err(|e| failed(&e))?;
    for path in &rules.writable {
        // A path the sandbox removed, or made a symlink, grants nothing (the exec's rules
        // would resolve it inside the sandbox too; here it is simply left out).
        let Some((fd, is_dir)) = sys::open_beneath(root, path) else {
            continue;
        };
        let access = if is_dir {
            AccessFs::from_all(ABI)
        } else {
            AccessFs::from_all(ABI) & AccessFs::from_file(ABI)
        };
        created = created
            .add_rule(PathBeneath::new(fd.as_fd(), access))
            .map_err(|e| failed(&e))?;
    }
    let status = created.restrict_self().map_err(|e| failed(&e))?;
    if rules.required && status.ruleset != RulesetStatus::FullyEnforced {
        return Err(ApiError::internal(
            "the policy requires landlock, and this kernel does not enforce all of it for a \
             file operation",
        ));
    }
    Ok(())
}

/// Raw system calls on the calling thread's credentials.
mod sys {
    use super::*;

    fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }

    /// This thread's supplementary groups.
    pub(super) fn groups() -> io::Result<Vec<u32>> {
        // SAFETY: with a size of 0 the kernel only returns the count and writes nothing.
        let n =
            check(unsafe { libc::syscall(libc::SYS_getgroups, 0, std::ptr::null_mut::<u32>()) })?;
        let mut buf = vec![0u32; n as usize];
        // SAFETY: `buf` has room for `n` gids, the size passed.
        let got = check(unsafe { libc::syscall(libc::SYS_getgroups, n, buf.as_mut_ptr()) })?;
        buf.truncate(got as usize);
        Ok(buf)
    }

    /// Sets this thread's supplementary groups (the raw call changes the calling thread only).
    pub(super) fn set_thread_groups(groups: &[u32]) -> io::Result<()> {
        // SAFETY: the kernel reads `groups.len()` gids from the slice's pointer.
        check(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) })?;
        Ok(())
    }

    /// setfsuid answers the previous id, never an error: asking again with an invalid id
    /// (-1) reads the current one, which tells whether the change took.
    fn set_fs_id(nr: libc::c_long, id: u32, what: &str) -> io::Result<()> {
        // SAFETY: integer arguments only; the call changes this thread's file-system id.
        unsafe { libc::syscall(nr, id) };
        // SAFETY: as above; -1 changes nothing and answers the current id.
        let now = unsafe { libc::syscall(nr, u32::MAX) } as u32;
        if now == id {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the {what} stayed {now}"),
            ))
        }
    }

    pub(super) fn set_thread_fsuid(uid: u32) -> io::Result<()> {
        set_fs_id(libc::SYS_setfsuid, uid, "file-system uid")
    }

    pub(super) fn set_thread_fsgid(gid: u32) -> io::Result<()> {
        set_fs_id(libc::SYS_setfsgid, gid, "file-system gid")
    }

    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }

    /// Empties this thread's effective, permitted and inheritable capability sets (and so its
    /// ambient one): it can never take a capability back.
    pub(super) fn drop_thread_capabilities() -> io::Result<()> {
        let mut header = CapHeader {
            version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
            pid: 0,               // the calling thread
        };
        let data = [CapData::default(); 2];
        // SAFETY: `header` and the two data words are the layout capset(2) reads for version 3.
        check(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) })?;
        Ok(())
    }

    /// An `O_PATH` descriptor of `path` (absolute, as the sandbox sees it) beneath `root`,
    /// following no symlink and no `/proc` link, and whether it is a directory.
    pub(super) fn open_beneath(root: &OwnedFd, path: &Path) -> Option<(OwnedFd, bool)> {
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        let rel = path.strip_prefix("/").unwrap_or(path);
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let fd = rustix::fs::openat2(
            root,
            rel,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )
        .ok()?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).ok()?;
        Some((fd, st.st_mode & libc::S_IFMT == libc::S_IFDIR))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_runs_with_the_users_ids_and_no_capability() {
        let me = SandboxUser::of_this_process();
        let (fsuid, caps) = as_user(&me, None, || {
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
                    .unwrap()
            };
            Ok((field("Uid:"), field("CapEff:")))
        })
        .unwrap();
        // Uid: real, effective, saved, file-system.
        assert_eq!(
            fsuid.split_whitespace().nth(3),
            Some(me.uid.to_string().as_str())
        );
        assert_eq!(caps, "0000000000000000");
        // The caller's own thread keeps what it had.
        let mine = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        if nix::unistd::geteuid().is_root() {
            assert!(!mine.contains("CapEff:\t0000000000000000"), "{mine}");
        }
    }

    #[test]
    fn as_root_another_users_ids_bind_the_kernels_checks() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root to take another user's ids");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "s").unwrap();
        std::os::unix::fs::chown(dir.path(), Some(4242), Some(4242)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let other = SandboxUser {
            uid: 4242,
            gid: 4242,
            groups: vec![],
        };
        let read = as_user(&other, None, || {
            Ok(std::fs::read(&secret).map_err(|e| e.raw_os_error()))
        })
        .unwrap();
        assert_eq!(read, Err(Some(libc::EACCES)));
        // Its groups are the user's too.
        let groups = as_user(&other, None, || Ok(sys::groups().unwrap())).unwrap();
        assert!(groups.is_empty(), "{groups:?}");
    }

    #[test]
    fn landlock_keeps_writes_to_the_writable_paths() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("rw")).unwrap();
        std::fs::create_dir(dir.path().join("ro")).unwrap();
        let root = sys::open_beneath(
            &OwnedFd::from(std::fs::File::open("/").unwrap()),
            dir.path(),
        )
        .unwrap()
        .0;
        let rules = FsLandlock {
            writable: vec![PathBuf::from("/rw")],
            required: false,
        };
        let me = SandboxUser::of_this_process();
        let d = dir.path().to_path_buf();
        let got = as_user(&me, Some((&root, &rules)), || {
            let w = |p: &str| std::fs::write(d.join(p), "x").map_err(|e| e.raw_os_error());
            Ok((w("rw/f"), w("ro/f"), std::fs::read_dir("/etc").is_ok()))
        })
        .unwrap();
        let enforced = landlock_is_enforced();
        if !enforced {
            eprintln!("skipped the landlock half: the kernel does not enforce landlock");
            return;
        }
        // Paths outside the root are not even readable: the root is the rule's.
        assert_eq!(got, (Ok(()), Err(Some(libc::EACCES)), false));
        // This thread is not restricted.
        std::fs::write(dir.path().join("ro/f"), "x").unwrap();
    }

    fn landlock_is_enforced() -> bool {
        use landlock::{Access, AccessFs, Ruleset, RulesetAttr};
        Ruleset::default()
            .handle_access(AccessFs::from_all(ABI))
            .and_then(|r| r.create())
            .is_ok_and(|_| {
                std::thread::spawn(|| {
                    Ruleset::default()
                        .handle_access(AccessFs::from_all(ABI))
                        .and_then(|r| r.create())
                        .and_then(|r| r.restrict_self())
                        .is_ok_and(|s| s.ruleset != landlock::RulesetStatus::NotEnforced)
                })
                .join()
                .unwrap_or(false)
            })
    }
}
