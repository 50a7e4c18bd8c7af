//! The raw system calls of the image store, in one place: extended attributes (to read overlay
//! whiteouts and opaque directories in an upper layer) and advisory locks on the store.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What the overlay xattrs of one upper-layer entry say.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OverlayAttrs {
    /// A directory that hides the lower directory of the same name (`overlay.opaque` = `y`).
    pub(crate) opaque: bool,
    /// An xattr whiteout (an empty file with `overlay.whiteout`), as unprivileged overlays make.
    pub(crate) whiteout: bool,
    /// `overlay.redirect` or `overlay.metacopy`: features a layer cannot be tarred with.
    pub(crate) unsupported: Option<&'static str>,
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// The overlay attributes of `path` (`user.overlay.*` and, when readable, `trusted.overlay.*`),
/// never following a symlink. A filesystem without xattrs has none.
pub(crate) fn overlay_attrs(path: &Path) -> io::Result<OverlayAttrs> {
    let c = cpath(path)?;
    let names = list_xattrs(&c)?;
    let mut attrs = OverlayAttrs::default();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let key = name
            .strip_prefix(b"user.overlay.")
            .or_else(|| name.strip_prefix(b"trusted.overlay."));
        match key {
            // "y" is opaque; "x" (newer kernels) only flags a directory holding xattr whiteouts.
            Some(b"opaque") => attrs.opaque |= get_xattr(&c, name)?.as_deref() == Some(b"y"),
            Some(b"whiteout") => attrs.whiteout = true,
            Some(b"redirect") => attrs.unsupported = Some("overlay.redirect"),
            Some(b"metacopy") => attrs.unsupported = Some("overlay.metacopy"),
            _ => {}
        }
    }
    Ok(attrs)
}

fn list_xattrs(c: &CString) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: `c` is a NUL-terminated string that outlives the call; `buf` is a live, writable
        // allocation of `buf.len()` bytes and the kernel writes at most that many. llistxattr does
        // not follow symlinks and keeps no pointer after returning.
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if let Ok(len) = usize::try_from(n) {
            buf.truncate(len);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ERANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(err),
        }
    }
}

fn get_xattr(c: &CString, name: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let name = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "xattr name with a NUL byte"))?;
    let mut buf = vec![0u8; 256];
    // SAFETY: `c` and `name` are NUL-terminated strings that outlive the call; `buf` is a live,
    // writable allocation of `buf.len()` bytes and the kernel writes at most that many.
    // lgetxattr does not follow symlinks.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    match usize::try_from(n) {
        Ok(len) => {
            buf.truncate(len);
            Ok(Some(buf))
        }
        Err(_) => {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                // Gone, or a trusted.* attribute this process may list but not read.
                Some(libc::ENODATA | libc::EPERM | libc::EACCES | libc::ERANGE) => Ok(None),
                _ => Err(err),
            }
        }
    }
}

/// How a store lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockMode {
    /// Many holders: builds and unpacks, which only add to the store.
    Shared,
    /// One holder: removals, which may delete what others would use.
    Exclusive,
}

/// An advisory lock (flock) on a file, released on drop.
#[derive(Debug)]
pub(crate) struct FileLock {
    _file: File,
}

impl FileLock {
    /// Opens (creating) `path` and waits for the lock.
    pub(crate) fn acquire(path: &Path, mode: LockMode) -> io::Result<FileLock> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        let op = match mode {
            LockMode::Shared => libc::LOCK_SH,
            LockMode::Exclusive => libc::LOCK_EX,
        };
        loop {
            // SAFETY: the descriptor belongs to `file`, which is open for the duration of the
            // call; flock touches no memory.
            let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
            if rc == 0 {
                return Ok(FileLock { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                return Err(err);
            }
        }
    }
}
