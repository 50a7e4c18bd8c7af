//! Raw system calls the helper needs that nix does not wrap. Each one is a thin, checked wrapper.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const AT_RECURSIVE: libc::c_uint = 0x8000;

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Makes the mount at `path` and every mount beneath it read-only and nosuid (one atomic call,
/// where remounting each submount one by one would race with nothing but cost a walk).
pub fn make_tree_readonly(path: &Path, nodev: bool) -> io::Result<()> {
    set_readonly(path, nodev, true)
}

/// Makes only the mount at `path` read-only and nosuid; mounts beneath keep their flags.
pub fn make_mount_readonly(path: &Path) -> io::Result<()> {
    set_readonly(path, false, false)
}

fn set_readonly(path: &Path, nodev: bool, recursive: bool) -> io::Result<()> {
    let c = cpath(path)?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | if nodev { MOUNT_ATTR_NODEV } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; `attr` is a properly
    // initialised `struct mount_attr` and its exact size is passed, as the kernel requires.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c.as_ptr(),
            if recursive { AT_RECURSIVE } else { 0 },
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// pivot_root(2): `new_root` becomes `/`, the old root is stacked on `put_old`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let n = cpath(new_root)?;
    let o = cpath(put_old)?;
    // SAFETY: both pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, n.as_ptr(), o.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Closes every file descriptor from `first` upwards.
pub fn close_fds_from(first: u32) {
    close_fds_between(first, u32::MAX)
}

/// Closes every file descriptor from `first` to `last`.
pub fn close_fds_between(first: u32, last: u32) {
    // SAFETY: close_range only closes descriptors; the caller owns every descriptor in the range
    // (the helper is single-threaded at this point and holds nothing it still needs there).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0) };
    if rc != 0 {
        // Old kernels: fall back to closing one by one up to the soft limit.
        for fd in first..=last.min(4095) {
            // SAFETY: as above; closing an unused number is harmless (EBADF).
            unsafe { libc::close(fd as i32) };
        }
    }
}

/// Marks `fd` close-on-exec.
pub fn set_cloexec(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl with F_SETFD on an integer descriptor touches no memory.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Brings the loopback interface up (a fresh network namespace has it down).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket creation; the descriptor is closed below on every path.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq naming "lo"; SIOCGIFFLAGS writes only into it.
    let mut rc = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) };
    if rc == 0 {
        // SAFETY: the union member ifru_flags is the one SIOCGIFFLAGS filled in.
        unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        // SAFETY: as above; SIOCSIFFLAGS reads the flags from `req`.
        rc = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) };
    }
    let err = io::Error::last_os_error();
    // SAFETY: `fd` is ours and not used after this.
    unsafe { libc::close(fd) };
    if rc == 0 { Ok(()) } else { Err(err) }
}

/// Drops every capability: the bounding set (so an exec of a setuid or root-owned binary cannot
/// bring any back), the ambient set, and the effective, permitted and inheritable sets. Also locks
/// the securebits so uid 0 gets no capabilities back through exec.
pub fn drop_all_capabilities() -> io::Result<()> {
    limit_capabilities(&[], || Ok(()))
}

/// As [`drop_all_capabilities`], except for `keep` (capability numbers), which stay in every
/// set, the ambient one included, so that they survive the command's exec (and only those: the
/// securebits keep uid 0 from getting the rest back). `between` runs once the bounding set is
/// cut and before the other sets are (an identity switch, which needs CAP_SETUID and CAP_SETGID
/// and, away from uid 0, clears the capabilities by itself).
pub fn limit_capabilities(
    keep: &[u32],
    between: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(63);
    for cap in 0..=last_cap {
        if keep.iter().any(|k| u64::from(*k) == cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) {
                return Err(err);
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    // SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_KEEP_CAPS_LOCKED, and with nothing to keep
    // also SECBIT_NO_SETUID_FIXUP | ..._LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE | ..._LOCKED.
    // (Kept capabilities go when an identity switch leaves uid 0: the fixup stays on.) Needs
    // CAP_SETPCAP, which we still hold here.
    let bits: libc::c_ulong = if keep.is_empty() {
        0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
    } else {
        0x01 | 0x02 | 0x20
    };
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) };
    between()?;
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = CapHeader {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    for k in keep.iter().filter(|k| u64::from(**k) <= last_cap) {
        let (word, bit) = ((*k / 32) as usize, 1u32 << (*k % 32));
        data[word].effective |= bit;
        data[word].permitted |= bit;
        data[word].inheritable |= bit;
    }
    // SAFETY: header and data are the v3 layout the kernel expects (two CapData for 64 caps);
    // both outlive the call and the kernel only reads `data`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    for k in keep {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE,
                libc::c_ulong::from(*k),
                0,
                0,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Enters the user namespace open on `fd` (with every capability in it) and closes `fd`.
pub fn enter_user_namespace(fd: i32) -> io::Result<()> {
    // SAFETY: setns with a descriptor number and a flag; a bad descriptor is an error.
    let rc = unsafe { libc::setns(fd, libc::CLONE_NEWUSER) };
    let err = io::Error::last_os_error();
    // SAFETY: closing a descriptor number this process owns and no longer uses.
    unsafe { libc::close(fd) };
    if rc == 0 { Ok(()) } else { Err(err) }
}

/// Becomes `uid`:`gid` with supplementary `groups` (ids of the current user namespace).
pub fn switch_ids(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    // SAFETY: `groups` is a valid slice of gid_t for its length during the call.
    let rc = unsafe { libc::setgroups(groups.len(), groups.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::setresgid(gid, gid, gid) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: integer arguments only.
    if unsafe { libc::setresuid(uid, uid, uid) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the parent-death signal of the calling process.
pub fn set_parent_death_signal(signal: i32) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets no_new_privs: from here on no exec can grant privileges (setuid bits, file caps).
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Checks that `path` (absolute) names a directory that is the root of a mount, reached
/// without following any symlink.
pub fn is_mount_root_nofollow(path: &Path) -> io::Result<bool> {
    let c = cpath(path)?;
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let fd = rustix::fs::openat2(
        rustix::fs::CWD,
        c.as_c_str(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(io::Error::from)?;
    // SAFETY: statx is plain old data; all-zero is valid.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the empty path is NUL-terminated and `stx` writable, both live for the call; with
    // AT_EMPTY_PATH the kernel describes `fd` itself.
    let rc = unsafe {
        libc::statx(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            0,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stx.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0)
}
