//! Raw system calls for reading and writing trees through directory descriptors, which nix does
//! not wrap: `openat2`, `statx` mount ids, and the xattrs and reopening of `O_PATH` descriptors.
//!
//! `fgetxattr` and `flistxattr` refuse `O_PATH` descriptors (EBADF), and an `O_PATH` descriptor
//! cannot be opened again with `openat`. Both go through `/proc/self/fd/N` instead: that magic
//! link names exactly the inode the descriptor holds, whatever has been renamed since, so no path
//! of the tree is resolved again. It needs `/proc` mounted, as the supervisor has on the host.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// Largest xattr name list the kernel returns (XATTR_LIST_MAX).
const XATTR_LIST_MAX: usize = 64 * 1024;
/// Largest xattr value the kernel stores (XATTR_SIZE_MAX).
const XATTR_SIZE_MAX: usize = 64 * 1024;

/// `openat2` resolution beneath the directory given, following no symlink and no magic link.
pub(crate) const BENEATH_NOFOLLOW: u64 =
    libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;

/// `AT_FDCWD`, for paths relative to the current directory (or absolute).
pub(crate) struct Cwd;

impl AsRawFd for Cwd {
    fn as_raw_fd(&self) -> RawFd {
        libc::AT_FDCWD
    }
}

impl AsFd for Cwd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        rustix::fs::CWD
    }
}

/// The id of the mount `fd` lies on (the never-reused one where the kernel has it), and
/// whether `fd` is that mount's root.
pub(crate) fn mount_of(fd: &OwnedFd) -> Result<(u64, bool), Errno> {
    // SAFETY: statx is plain old data; all-zero is valid.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: `empty` is a NUL-terminated string and `stx` a writable statx, both live for
    // the call; with AT_EMPTY_PATH the kernel describes `fd` itself.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_MNT_ID | libc::STATX_MNT_ID_UNIQUE,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    if stx.stx_mask & (libc::STATX_MNT_ID | libc::STATX_MNT_ID_UNIQUE) == 0
        || stx.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 == 0
    {
        return Err(Errno::ENOSYS);
    }
    Ok((
        stx.stx_mnt_id,
        stx.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0,
    ))
}

/// `openat2(dirfd, path, how)`, close-on-exec, retried on EINTR and (a few times) on the
/// EAGAIN that `RESOLVE_IN_ROOT` returns when a rename raced the lookup. `flags`, `mode` and
/// `resolve` are the kernel's bits (`libc::O_*`, mode bits, `libc::RESOLVE_*`).
pub(crate) fn openat2(
    dirfd: &impl AsFd,
    path: &CStr,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> Result<OwnedFd, Errno> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let oflags = OFlags::from_bits_retain((flags | libc::O_CLOEXEC) as u32);
    let mode = Mode::from_raw_mode(mode);
    let resolve = ResolveFlags::from_bits_retain(resolve);
    let mut again = 0;
    loop {
        match rustix::fs::openat2(dirfd, path, oflags, mode, resolve) {
            Ok(fd) => return Ok(fd),
            Err(e) => match Errno::from_raw(e.raw_os_error()) {
                Errno::EINTR => continue,
                Errno::EAGAIN if again < 8 => again += 1,
                e => return Err(e),
            },
        }
    }
}

/// `/proc/self/fd/N`: the inode `fd` holds, for the calls that take no `O_PATH` descriptor.
fn proc_fd(fd: &impl AsRawFd) -> CString {
    // Digits only: never holds a NUL.
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_default()
}

/// Opens the inode that `fd` (an `O_PATH` descriptor, say) holds once more, with `flags`
/// (close-on-exec added). The caller checks the type first: only regular files and directories
/// are reopened (a device's descriptor would open the device).
pub(crate) fn reopen(fd: &impl AsRawFd, flags: i32) -> io::Result<OwnedFd> {
    let path = proc_fd(fd);
    loop {
        // SAFETY: `path` is a NUL-terminated string that outlives the call; the result is a
        // new descriptor that nothing else owns, or -1.
        let ret = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
        if ret >= 0 {
            // SAFETY: as above: a fresh descriptor owned by nothing else.
            return Ok(unsafe { OwnedFd::from_raw_fd(ret) });
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// The NUL-separated xattr names of the inode `fd` holds (none where the filesystem has no
/// xattrs). Only for directories and regular files: the magic link is followed.
pub(crate) fn xattr_names(fd: &impl AsRawFd) -> io::Result<Vec<u8>> {
    let path = proc_fd(fd);
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: `path` is a NUL-terminated string that outlives the call; `buf` is a live,
        // writable allocation of `buf.len()` bytes and the kernel writes at most that many.
        // listxattr keeps no pointer after returning.
        let n = unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if let Ok(len) = usize::try_from(n) {
            buf.truncate(len);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ERANGE) if buf.len() < XATTR_LIST_MAX => buf.resize(buf.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(err),
        }
    }
}

/// The value of xattr `name` of the inode `fd` holds; `None` when it has none of that name.
/// As [`xattr_names`]: directories and regular files only.
pub(crate) fn xattr(fd: &impl AsRawFd, name: &CStr) -> io::Result<Option<Vec<u8>>> {
    let path = proc_fd(fd);
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: `path` and `name` are NUL-terminated strings that outlive the call; `buf` is
        // a live, writable allocation of `buf.len()` bytes and the kernel writes at most that
        // many. getxattr keeps no pointer after returning.
        let n = unsafe {
            libc::getxattr(
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if let Ok(len) = usize::try_from(n) {
            buf.truncate(len);
            return Ok(Some(buf));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ERANGE) if buf.len() < XATTR_SIZE_MAX => buf.resize(buf.len() * 4, 0),
            Some(libc::ENODATA | libc::ENOTSUP) => return Ok(None),
            _ => return Err(err),
        }
    }
}

/// Sets xattr `name` of the file open as `fd` (the supervisor's own copy of a layer's entry).
pub(crate) fn fset_xattr(fd: &impl AsRawFd, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is a NUL-terminated string that outlives the call; `value` is a live slice
    // of `value.len()` bytes that the kernel only reads; the kernel keeps no pointer after
    // returning.
    let rc = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
