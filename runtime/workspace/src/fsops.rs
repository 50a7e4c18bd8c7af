//! The fs half of the narrow API, run by the trusted supervisor on an untrusted workspace.
//!
//! [`WorkspaceFs`] holds an `O_PATH` directory fd of the workspace root (for a live sandbox,
//! opened through `/proc/PID/root/WORKSPACE`) and resolves every request path beneath it with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`. What the sandbox may
//! have planted cannot make the supervisor read, write or block outside the workspace:
//!
//! - absolute symlinks and `..` resolve inside the root (a link to `/etc/shadow` names
//!   `ROOT/etc/shadow`); request paths that climb above the root lexically are refused;
//! - writes, removes and renames act on the parent directory's fd and the final name with `*at`
//!   calls, so a final symlink is never followed (writing through one is refused);
//! - reads open with `O_NONBLOCK` and refuse anything but regular files, so a fifo or a device
//!   cannot block or feed the supervisor;
//! - writes are atomic (a temporary file in the same directory, fsync, rename): a hard link to a
//!   file outside is replaced by the rename, never written through;
//! - list, search and recursive remove walk directory fds themselves and never follow symlinks.
//!
//! Request paths are relative to the workspace root; `..` is folded lexically (refused when it
//! would climb above the root). Absolute paths are accepted only under the mount path given with
//! [`WorkspaceFs::with_mount_path`] (the workspace as the sandbox sees it).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use globset::{GlobBuilder, GlobMatcher};
use grep_regex::RegexMatcherBuilder;
use grep_searcher::{BinaryDetection, Searcher, SearcherBuilder, Sink, SinkMatch};
use ignore::Match as IgnoreMatch;
use ignore::gitignore::Gitignore;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, RenameFlags};
use nix::sys::stat::{FileStat, Mode};
use nix::unistd::UnlinkatFlags;

use crate::api::{
    ApiError, ByteSink, DownloadRequest, EditRequest, EditResult, Entry, EntryKind, ListRequest,
    ListResult, Match, MoveRequest, PatchRequest, PatchResult, PathRequest, ReadRequest,
    ReadResult, RemoveRequest, SearchRequest, SearchResult, StatResult, UploadRequest,
    WriteRequest, WriteResult,
};
use crate::ignores::IgnoreBudget;
use crate::result::{Change, ChangeKind};
use crate::sys;

/// Default cap on the bytes a read returns.
const DEFAULT_MAX_BYTES: u64 = 256 * 1024;
/// Hard cap on the bytes a read returns, whatever the request asks.
const MAX_READ_BYTES: u64 = 64 * 1024 * 1024;
/// Files larger than this are not loaded whole (edit, patch).
const MAX_LOAD_BYTES: u64 = 64 * 1024 * 1024;
/// Bytes sniffed for a NUL to call a file binary.
const BINARY_SNIFF: usize = 8000;
const MAX_PATCH_BYTES: usize = 16 * 1024 * 1024;
const DEFAULT_LIST_LIMIT: u64 = 1000;
const DEFAULT_MAX_MATCHES: u64 = 200;
const MAX_LINE_CHARS: usize = 500;
/// A walk stops (truncated) after looking at this many entries.
const MAX_WALK_ENTRIES: u64 = 1_000_000;
/// Recursive remove holds one fd per level; deeper trees are refused.
const MAX_REMOVE_DEPTH: usize = 256;
/// The searcher's line buffer may not grow past this (a huge file of one line).
const SEARCH_HEAP_LIMIT: usize = 16 * 1024 * 1024;

/// Resolution of a request path from the root: symlinks and `..` stay inside it.
/// Mount points inside the workspace are crossed: only the trusted plan makes them (read-only
/// protected paths, masks); the sandbox cannot mount.
const RESOLVE_ROOT: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
/// As [`RESOLVE_ROOT`], following no symlink at all (the walks).
const RESOLVE_ROOT_NOFOLLOW: u64 = RESOLVE_ROOT | libc::RESOLVE_NO_SYMLINKS;
/// One name beneath a directory fd, following nothing.
const RESOLVE_CHILD: u64 = sys::BENEATH_NOFOLLOW;

/// An `O_PATH` descriptor of `rel` beneath the directory `root`, resolved without following any
/// symlink (the last component included: a symlink there is opened as itself) or leaving
/// `root`: for the supervisor's mounts on paths inside a tree a sandbox can change.
pub fn open_path_beneath(root: &Path, rel: &Path) -> std::io::Result<OwnedFd> {
    use std::io;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
    };
    let dir = sys::openat2(
        &sys::Cwd,
        &c(root)?,
        libc::O_PATH | libc::O_DIRECTORY,
        0,
        libc::RESOLVE_NO_MAGICLINKS,
    )
    .map_err(io::Error::from)?;
    sys::openat2(
        &dir,
        &c(rel)?,
        libc::O_PATH | libc::O_NOFOLLOW,
        0,
        RESOLVE_CHILD,
    )
    .map_err(io::Error::from)
}

/// A path relative to the root of a [`WorkspaceFs`], already checked: no `.`, no `..`, no
/// empty parts. `abs`: the root is the sandbox's, and the path is shown as the sandbox sees it
/// (`/tmp/x`), not relative to the workspace (`src/x`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct RelPath {
    parts: Vec<OsString>,
    abs: bool,
}

impl RelPath {
    fn root(abs: bool) -> RelPath {
        RelPath {
            parts: Vec::new(),
            abs,
        }
    }

    fn is_root(&self) -> bool {
        self.parts.is_empty()
    }

    fn join(&self, name: &OsStr) -> RelPath {
        let mut parts = self.parts.clone();
        parts.push(name.to_os_string());
        RelPath {
            parts,
            abs: self.abs,
        }
    }

    /// The parent and the final name (None for the root).
    fn split_last(&self) -> Option<(RelPath, &OsStr)> {
        let (last, rest) = self.parts.split_last()?;
        Some((
            RelPath {
                parts: rest.to_vec(),
                abs: self.abs,
            },
            last.as_os_str(),
        ))
    }

    fn to_path(&self) -> PathBuf {
        if self.is_root() {
            PathBuf::from(".")
        } else {
            self.parts.iter().collect()
        }
    }

    fn c_path(&self) -> CString {
        // Parts come from a `str` without NUL (checked) or from a directory entry name.
        CString::new(self.to_path().into_os_string().into_encoded_bytes()).unwrap_or_default()
    }

    /// The path beneath `base`, for glob matching.
    fn strip(&self, base: &RelPath) -> PathBuf {
        self.parts[base.parts.len().min(self.parts.len())..]
            .iter()
            .collect()
    }

    /// The path as `/a/b`, for the gitignore matchers (rooted at a virtual `/`).
    fn virtual_abs(&self) -> PathBuf {
        let mut p = PathBuf::from("/");
        p.extend(self.parts.iter());
        p
    }

    fn starts_with(&self, other: &RelPath) -> bool {
        self.parts.starts_with(&other.parts)
    }
}

impl std::fmt::Display for RelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_root() {
            return f.write_str(if self.abs { "/" } else { "." });
        }
        for (i, p) in self.parts.iter().enumerate() {
            if i > 0 || self.abs {
                f.write_str("/")?;
            }
            f.write_str(&p.to_string_lossy())?;
        }
        Ok(())
    }
}

fn c_name(name: &OsStr) -> CString {
    CString::new(name.as_bytes()).unwrap_or_default()
}

/// What [`WorkspaceFs::open_at_root`] answers for a path that lands in the sandbox's `/proc`
/// (an errno no open of this module gets otherwise).
///
/// The sandbox's own processes are reached there, and the kernel decides who may read them by
/// ptrace rules that ask for capabilities in the process's user namespace: there the
/// supervisor (its owner, when it made the namespace without root) would have them all, where
/// the sandbox's commands have none. File operations stay out of `/proc` altogether; a command
/// reads it with the command's own rights.
const PROCFS: Errno = Errno::EREMOTE;

/// Whether `fd` is on a proc file system.
fn in_procfs(fd: &OwnedFd) -> bool {
    nix::sys::statfs::fstatfs(fd)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::PROC_SUPER_MAGIC)
}

/// Maps an errno of operation `op` on `path` to the API's error.
fn sys_err(op: &str, path: &RelPath, e: Errno) -> ApiError {
    match e {
        PROCFS => ApiError::PathRefused(format!(
            "{op}: {path} is in the sandbox's /proc, which file operations do not reach; read \
             it with a command"
        )),
        Errno::ENOENT => ApiError::NotFound(format!("{op}: path {path} does not exist")),
        Errno::ELOOP if path.abs => ApiError::PathRefused(format!(
            "{op}: path {path} leads through a link that file operations do not follow (a /proc \
             link such as /proc/PID/root or /proc/self/fd/N, or a loop of symlinks)"
        )),
        Errno::ELOOP | Errno::EXDEV => ApiError::PathRefused(format!(
            "{op}: path {path} leads outside the workspace (through a symlink or a mount)"
        )),
        Errno::ENOTDIR => ApiError::NotADirectory(format!(
            "{op}: path {path}: a component of it is not a directory"
        )),
        Errno::EISDIR => ApiError::IsADirectory(format!("{op}: {path} is a directory")),
        Errno::ENAMETOOLONG => ApiError::InvalidArgument(format!("{op}: path {path} is too long")),
        Errno::ENOSPC | Errno::EDQUOT => {
            ApiError::LimitExceeded(format!("{op}: {path}: no space left on the sandbox's disk"))
        }
        Errno::EFBIG => ApiError::TooLarge(format!(
            "{op}: {path}: the file would be larger than the file system allows"
        )),
        Errno::EROFS => ApiError::PermissionDenied(format!(
            "{op}: {path}: permission denied: it is on a read-only file system of the sandbox"
        )),
        Errno::EACCES | Errno::EPERM => ApiError::PermissionDenied(format!(
            "{op}: {path}: permission denied: the sandbox's user may not do this ({})",
            e.desc().to_lowercase()
        )),
        Errno::ETXTBSY => {
            ApiError::Conflict(format!("{op}: {path} is a program that is running now"))
        }
        e => ApiError::Internal(format!("{op}: {path}: {e}")),
    }
}

fn io_err(op: &str, path: &RelPath, e: std::io::Error) -> ApiError {
    match e.raw_os_error() {
        Some(n) => sys_err(op, path, Errno::from_raw(n)),
        None => ApiError::Internal(format!("{op}: {path}: {e}")),
    }
}

fn kind_of(st: &FileStat) -> EntryKind {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Dir,
        libc::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

/// What a file is, in words.
fn kind_name(st: &FileStat) -> &'static str {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => "regular file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "fifo",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        libc::S_IFSOCK => "socket",
        _ => "special file",
    }
}

/// Refuses everything but a regular file.
fn require_regular(op: &str, path: &RelPath, st: &FileStat) -> Result<(), ApiError> {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Ok(()),
        libc::S_IFDIR => Err(ApiError::IsADirectory(format!(
            "{op}: {path} is a directory, not a regular file"
        ))),
        _ => Err(ApiError::PathRefused(format!(
            "{op}: {path} is a {}, not a regular file",
            kind_name(st)
        ))),
    }
}

fn lstat_at(dir: &OwnedFd, name: &OsStr) -> Result<Option<FileStat>, Errno> {
    match nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The names in a directory (read from a duplicate of `dir`, which must be open for reading).
fn read_names(dir: &OwnedFd) -> Result<Vec<OsString>, Errno> {
    let dup = dir
        .try_clone()
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)))?;
    let mut d = nix::dir::Dir::from_fd(dup.into_raw_fd())?;
    let mut names = Vec::new();
    for entry in d.iter() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(name).to_os_string());
        }
    }
    names.sort();
    Ok(names)
}

fn modified_ms(st: &FileStat) -> u64 {
    let secs = u64::try_from(st.st_mtime).unwrap_or(0);
    let nanos = u64::try_from(st.st_mtime_nsec).unwrap_or(0);
    secs.saturating_mul(1000).saturating_add(nanos / 1_000_000)
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn tmp_name() -> OsString {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    OsString::from(format!(
        ".taskbox-tmp-{:x}-{n:x}-{t:08x}",
        std::process::id()
    ))
}

/// A temporary file written and synced beside its destination, not yet renamed into place.
struct Prepared {
    parent: OwnedFd,
    tmp: OsString,
    name: OsString,
    rel: RelPath,
    created: bool,
    /// The parent directories this write created, outermost first: an aborted write removes
    /// them again.
    made_dirs: Vec<RelPath>,
}

/// The workspace root and the operations on it. See the module doc for the rules.
pub struct WorkspaceFs {
    root: OwnedFd,
    mount_path: Option<PathBuf>,
    /// The root is the sandbox's own (see [`WorkspaceFs::sandbox_root`]): paths are absolute.
    absolute: bool,
    /// Paths no operation may change, create, remove or move (the policy's protected paths):
    /// the read-only mounts that guard them inside the sandbox do not bind a writer outside it.
    protected: Vec<RelPath>,
    /// Serialises read-modify-write operations (edit, patch) made through this handle, so
    /// concurrent edits of one file by API callers do not lose each other's changes.
    update: Mutex<()>,
}

impl std::fmt::Debug for WorkspaceFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkspaceFs")
            .field("root", &self.root)
            .field("mount_path", &self.mount_path)
            .finish()
    }
}

impl WorkspaceFs {
    /// Opens `root` (e.g. `/proc/PID/root/WORKSPACE`) as the workspace root. The path itself is
    /// resolved by the caller's view of the filesystem: it must be trusted.
    pub fn open(root: &Path) -> Result<WorkspaceFs, ApiError> {
        let c = CString::new(root.as_os_str().as_bytes()).map_err(|_| {
            ApiError::invalid(format!(
                "workspace root {} contains a NUL byte",
                root.display()
            ))
        })?;
        let fd = sys::openat2(&sys::Cwd, &c, libc::O_PATH | libc::O_DIRECTORY, 0, 0).map_err(
            |e| match e {
                Errno::ENOENT => {
                    ApiError::not_found(format!("workspace root {} does not exist", root.display()))
                }
                e => ApiError::internal(format!(
                    "cannot open workspace root {}: {e}",
                    root.display()
                )),
            },
        )?;
        Ok(WorkspaceFs::from_fd(fd))
    }

    /// Opens the workspace of a live sandbox: `inside`, its absolute path as the sandbox sees
    /// it, beneath `root`, the sandbox's root as the supervisor reaches it (`/proc/PID/root`,
    /// a trusted path). Nothing on the way may be a symlink and `..` stays beneath `root`, so
    /// whatever the sandbox did to the directories above its workspace (move one away, put a
    /// symlink to a host path in its place) cannot lead the supervisor anywhere else. Returns
    /// the handle and the id of the mount whose root the directory is (the caller compares it
    /// with the workspace mount's, since the sandbox could also put a directory of its own
    /// there); a directory that is no mount's root is refused.
    pub fn open_mounted(root: &Path, inside: &Path) -> Result<(WorkspaceFs, u64), ApiError> {
        let cstr = |p: &Path| {
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| ApiError::invalid(format!("path {} contains a NUL byte", p.display())))
        };
        let root_fd = sys::openat2(
            &sys::Cwd,
            &cstr(root)?,
            libc::O_PATH | libc::O_DIRECTORY,
            0,
            0,
        )
        .map_err(|e| ApiError::internal(format!("cannot open {}: {e}", root.display())))?;
        let rel = inside.strip_prefix("/").unwrap_or(inside);
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let moved = |why: String| {
            ApiError::Conflict(format!(
                "the workspace is no longer at {} inside the sandbox ({why}): something in the \
                 sandbox moved or replaced a directory on its path; destroy the sandbox",
                inside.display()
            ))
        };
        let fd = sys::openat2(
            &root_fd,
            &cstr(rel)?,
            libc::O_PATH | libc::O_DIRECTORY,
            0,
            libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
        )
        .map_err(|e| moved(e.desc().to_lowercase()))?;
        let (mount_id, is_mount_root) =
            sys::mount_of(&fd).map_err(|e| ApiError::internal(format!("statx: {e}")))?;
        if !is_mount_root {
            return Err(moved("it is not the workspace mount".into()));
        }
        Ok((WorkspaceFs::from_fd(fd), mount_id))
    }

    /// Uses `root`, a directory fd (`O_PATH` is enough), as the workspace root.
    pub fn from_fd(root: OwnedFd) -> WorkspaceFs {
        WorkspaceFs {
            root,
            mount_path: None,
            absolute: false,
            protected: Vec::new(),
            update: Mutex::new(()),
        }
    }

    /// Uses `root`, a descriptor of the sandbox's root directory as its commands see it
    /// (`/proc/PID/root`), as the root: request paths are absolute paths of the sandbox, and
    /// are shown so in answers and errors.
    pub fn sandbox_root(root: OwnedFd) -> WorkspaceFs {
        WorkspaceFs {
            absolute: true,
            ..WorkspaceFs::from_fd(root)
        }
    }

    /// Protects these paths (and everything beneath them) from changes: relative to the
    /// workspace root, or, for a [`WorkspaceFs::sandbox_root`], absolute.
    pub fn with_protected(mut self, paths: &[String]) -> WorkspaceFs {
        self.protected = paths
            .iter()
            .filter_map(|p| self.rel("protect", p).ok())
            .collect();
        self
    }

    /// Refuses a change at `rel` when it is, lies beneath, or contains a protected path.
    fn guard(&self, op: &str, rel: &RelPath) -> Result<(), ApiError> {
        match self
            .protected
            .iter()
            .find(|p| rel.starts_with(p) || p.starts_with(rel))
        {
            Some(p) => Err(ApiError::PathRefused(format!(
                "{op}: {rel} is protected by the policy ({p} is read-only)"
            ))),
            None => Ok(()),
        }
    }

    /// The workspace's absolute path as the sandbox sees it (e.g. `/home/u/repo`): absolute
    /// request paths under it are taken relative to the root; other absolute paths are refused.
    pub fn with_mount_path(mut self, mount_path: PathBuf) -> WorkspaceFs {
        self.mount_path = Some(mount_path);
        self
    }

    // ---- paths ---------------------------------------------------------------------------

    /// Checks and normalises a request path.
    fn rel(&self, op: &str, raw: &str) -> Result<RelPath, ApiError> {
        if raw.contains('\0') {
            return Err(ApiError::invalid(format!(
                "{op}: path {raw:?} contains a NUL byte"
            )));
        }
        if raw.is_empty() {
            return Err(ApiError::invalid(format!(
                "{op}: the path is empty; paths are relative to the workspace root (\".\" is the root)"
            )));
        }
        let mut p = Path::new(raw);
        let escapes = || {
            ApiError::PathRefused(if self.absolute {
                format!("{op}: path {raw} climbs above the sandbox's root")
            } else {
                format!("{op}: path {raw} escapes the workspace")
            })
        };
        if self.absolute {
            p = match p.strip_prefix("/") {
                Ok(rest) => rest,
                Err(_) => {
                    return Err(ApiError::invalid(format!(
                        "{op}: path {raw} is relative; the sandbox's paths are absolute"
                    )));
                }
            };
        } else if p.is_absolute() {
            match self.mount_path.as_deref().map(|m| p.strip_prefix(m)) {
                Some(Ok(rest)) => p = rest,
                Some(Err(_)) => {
                    return Err(ApiError::PathRefused(format!(
                        "{op}: absolute path {raw} is outside the workspace {}",
                        self.mount_path
                            .as_deref()
                            .map(|m| m.display().to_string())
                            .unwrap_or_default()
                    )));
                }
                None => {
                    return Err(ApiError::PathRefused(format!(
                        "{op}: absolute path {raw} is outside the workspace; give a path relative to the workspace root"
                    )));
                }
            }
        }
        let mut parts: Vec<OsString> = Vec::new();
        for c in p.components() {
            match c {
                Component::Normal(n) => parts.push(n.to_os_string()),
                Component::CurDir => {}
                Component::ParentDir => {
                    if parts.pop().is_none() {
                        return Err(escapes());
                    }
                }
                Component::RootDir | Component::Prefix(_) => return Err(escapes()),
            }
        }
        Ok(RelPath {
            parts,
            abs: self.absolute,
        })
    }

    /// As [`Self::rel`], refusing the workspace root itself.
    fn rel_entry(&self, op: &str, raw: &str) -> Result<RelPath, ApiError> {
        let rel = self.rel(op, raw)?;
        if rel.is_root() {
            let what = if self.absolute {
                "the sandbox's root"
            } else {
                "the workspace root"
            };
            return Err(ApiError::PathRefused(format!(
                "{op}: {raw} is {what} itself; name a file or directory beneath it"
            )));
        }
        Ok(rel)
    }

    fn open_at_root(&self, rel: &RelPath, flags: i32, resolve: u64) -> Result<OwnedFd, Errno> {
        let path = rel.c_path();
        match sys::openat2(&self.root, &path, flags, 0, resolve) {
            Ok(fd) if self.absolute && in_procfs(&fd) => Err(PROCFS),
            Ok(fd) => Ok(fd),
            // An open that fails in /proc, or on the way through it, is refused for being
            // there, whatever else it lacks.
            Err(_) if self.absolute && self.reaches_procfs(rel) => Err(PROCFS),
            Err(e) => Err(e),
        }
    }

    /// Whether the longest part of `rel` that resolves lies in a proc file system.
    fn reaches_procfs(&self, rel: &RelPath) -> bool {
        (1..=rel.parts.len())
            .rev()
            .find_map(|n| {
                let prefix = RelPath {
                    parts: rel.parts[..n].to_vec(),
                    abs: rel.abs,
                };
                sys::openat2(&self.root, &prefix.c_path(), libc::O_PATH, 0, RESOLVE_ROOT).ok()
            })
            .is_some_and(|fd| in_procfs(&fd))
    }

    /// An `O_PATH` fd of the directory `rel` (symlinks resolved inside the root).
    fn open_dir(&self, op: &str, rel: &RelPath) -> Result<OwnedFd, ApiError> {
        self.open_at_root(rel, libc::O_PATH | libc::O_DIRECTORY, RESOLVE_ROOT)
            .map_err(|e| sys_err(op, rel, e))
    }

    /// The parent directory's fd and the final name of `rel` (not the root).
    fn parent_of<'r>(&self, op: &str, rel: &'r RelPath) -> Result<(OwnedFd, &'r OsStr), ApiError> {
        let Some((parent, name)) = rel.split_last() else {
            return Err(ApiError::PathRefused(format!(
                "{op}: refusing to touch the workspace root itself"
            )));
        };
        Ok((self.open_dir(op, &parent)?, name))
    }

    /// Opens the directory `rel`, creating missing directories one level at a time; those it
    /// created are added to `made`, also when it fails further down.
    fn make_dirs(
        &self,
        op: &str,
        rel: &RelPath,
        made: &mut Vec<RelPath>,
    ) -> Result<OwnedFd, ApiError> {
        let mut fd = self.open_dir(op, &RelPath::root(self.absolute))?;
        let mut prefix = RelPath::root(self.absolute);
        for part in &rel.parts {
            prefix = prefix.join(part);
            match self.open_at_root(&prefix, libc::O_PATH | libc::O_DIRECTORY, RESOLVE_ROOT) {
                Ok(next) => fd = next,
                Err(Errno::ENOENT) => {
                    match nix::sys::stat::mkdirat(
                        Some(fd.as_raw_fd()),
                        part.as_os_str(),
                        Mode::from_bits_truncate(0o755),
                    ) {
                        Ok(()) => {
                            adopt_owner_at(&fd, part);
                            made.push(prefix.clone());
                        }
                        Err(Errno::EEXIST) => {}
                        Err(e) => return Err(sys_err(op, &prefix, e)),
                    }
                    fd = self.open_dir(op, &prefix)?;
                }
                Err(e) => return Err(sys_err(op, &prefix, e)),
            }
        }
        Ok(fd)
    }

    /// Removes directories a failed write created (innermost first); one that is no longer
    /// empty stays.
    fn remove_made_dirs(&self, op: &str, made: &[RelPath]) {
        for rel in made.iter().rev() {
            if let Ok((parent, name)) = self.parent_of(op, rel) {
                let _ =
                    nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::RemoveDir);
            }
        }
    }

    /// Removes a prepared write's temporary file and the directories it created.
    fn abort_write(&self, op: &str, p: &Prepared) {
        let _ = nix::unistd::unlinkat(
            Some(p.parent.as_raw_fd()),
            p.tmp.as_os_str(),
            UnlinkatFlags::NoRemoveDir,
        );
        self.remove_made_dirs(op, &p.made_dirs);
    }

    /// Opens a regular file for reading, following symlinks inside the root; never blocks on a
    /// fifo or device and refuses anything but a regular file.
    fn open_regular(&self, op: &str, rel: &RelPath) -> Result<(File, FileStat), ApiError> {
        let fd = self
            .open_at_root(
                rel,
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY,
                RESOLVE_ROOT,
            )
            .map_err(|e| {
                // A socket cannot be opened (ENXIO): say what it is rather than the errno.
                let kind = self
                    .open_at_root(rel, libc::O_PATH, RESOLVE_ROOT)
                    .ok()
                    .and_then(|fd| nix::sys::stat::fstat(fd.as_raw_fd()).ok());
                match kind.map(|st| require_regular(op, rel, &st)) {
                    Some(Err(refused)) => refused,
                    _ => sys_err(op, rel, e),
                }
            })?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| sys_err(op, rel, e))?;
        require_regular(op, rel, &st)?;
        Ok((File::from(fd), st))
    }

    /// Loads a whole regular file that is about to be rewritten: a final symlink is refused
    /// (the rewrite would replace the link, not its target).
    fn load_for_update(&self, op: &str, rel: &RelPath) -> Result<Option<Vec<u8>>, ApiError> {
        let Some((parent_rel, name)) = rel.split_last() else {
            return Err(ApiError::PathRefused(format!(
                "{op}: refusing to touch the workspace root itself"
            )));
        };
        let parent =
            match self.open_at_root(&parent_rel, libc::O_PATH | libc::O_DIRECTORY, RESOLVE_ROOT) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => return Ok(None),
                Err(e) => return Err(sys_err(op, &parent_rel, e)),
            };
        let Some(st) = lstat_at(&parent, name).map_err(|e| sys_err(op, rel, e))? else {
            return Ok(None);
        };
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(symlink_refused(op, rel));
        }
        require_regular(op, rel, &st)?;
        let fd = sys::openat2(
            &parent,
            &c_name(name),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW,
            0,
            RESOLVE_CHILD,
        )
        .map_err(|e| sys_err(op, rel, e))?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| sys_err(op, rel, e))?;
        require_regular(op, rel, &st)?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size > MAX_LOAD_BYTES {
            return Err(ApiError::TooLarge(format!(
                "{op}: {rel} is {size} bytes, more than the {MAX_LOAD_BYTES} this operation loads; use write or upload"
            )));
        }
        let mut buf = Vec::with_capacity(size as usize);
        File::from(fd)
            .take(MAX_LOAD_BYTES + 1)
            .read_to_end(&mut buf)
            .map_err(|e| io_err(op, rel, e))?;
        if buf.len() as u64 > MAX_LOAD_BYTES {
            return Err(ApiError::TooLarge(format!(
                "{op}: {rel} grew past {MAX_LOAD_BYTES} bytes while being read"
            )));
        }
        Ok(Some(buf))
    }

    // ---- atomic writes -------------------------------------------------------------------

    /// Writes `data` to a temporary file beside `rel` and syncs it. An existing file keeps its
    /// mode and owner; a new one gets `new_mode` and its directory's owner.
    fn prepare_write(
        &self,
        op: &str,
        rel: &RelPath,
        data: &mut dyn Read,
        new_mode: u32,
        force_mode: bool,
        create_parents: bool,
    ) -> Result<Prepared, ApiError> {
        let mut made_dirs = Vec::new();
        match self.prepare_write_in(
            op,
            rel,
            data,
            new_mode,
            force_mode,
            create_parents,
            &mut made_dirs,
        ) {
            Ok(mut p) => {
                p.made_dirs = made_dirs;
                Ok(p)
            }
            Err(e) => {
                self.remove_made_dirs(op, &made_dirs);
                Err(e)
            }
        }
    }

    /// [`Self::prepare_write`], adding the directories it creates to `made_dirs`.
    #[allow(clippy::too_many_arguments)]
    fn prepare_write_in(
        &self,
        op: &str,
        rel: &RelPath,
        data: &mut dyn Read,
        new_mode: u32,
        force_mode: bool,
        create_parents: bool,
        made_dirs: &mut Vec<RelPath>,
    ) -> Result<Prepared, ApiError> {
        self.guard(op, rel)?;
        let Some((parent_rel, name)) = rel.split_last() else {
            return Err(ApiError::PathRefused(format!(
                "{op}: refusing to write the workspace root itself"
            )));
        };
        let parent = if create_parents {
            self.make_dirs(op, &parent_rel, made_dirs)?
        } else {
            self.open_dir(op, &parent_rel)?
        };
        let existing = lstat_at(&parent, name).map_err(|e| sys_err(op, rel, e))?;
        let (mode, owner) = match &existing {
            None => {
                let dir = nix::sys::stat::fstat(parent.as_raw_fd())
                    .map_err(|e| sys_err(op, &parent_rel, e))?;
                (new_mode, (dir.st_uid, dir.st_gid))
            }
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFLNK => {
                return Err(symlink_refused(op, rel));
            }
            Some(st) => {
                require_regular(op, rel, st)?;
                // The rename below needs only the directory's permission; what the file's own
                // says (a 0444 file, one of another user) is asked of the kernel by opening it
                // for writing, as a command's `>` would (it is not truncated).
                match sys::openat2(
                    &parent,
                    &c_name(name),
                    libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
                    0,
                    RESOLVE_CHILD,
                ) {
                    // A program running now may not be opened for writing, but the permission
                    // check came first and passed: the rename replaces it, as an install would.
                    Ok(_) | Err(Errno::ETXTBSY) => {}
                    Err(e) => return Err(sys_err(op, rel, e)),
                }
                let mode = if force_mode {
                    new_mode
                } else {
                    st.st_mode & 0o7777
                };
                (mode, (st.st_uid, st.st_gid))
            }
        };
        let mut attempt = 0;
        let (tmp, fd) = loop {
            let tmp = tmp_name();
            match sys::openat2(
                &parent,
                &c_name(&tmp),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                0o600,
                RESOLVE_CHILD,
            ) {
                Ok(fd) => break (tmp, fd),
                Err(Errno::EEXIST) if attempt < 8 => attempt += 1,
                Err(e) => return Err(sys_err(op, rel, e)),
            }
        };
        let prepared = Prepared {
            parent,
            tmp,
            name: name.to_os_string(),
            rel: rel.clone(),
            created: existing.is_none(),
            made_dirs: Vec::new(),
        };
        let mut file = File::from(fd);
        let written = (|| -> Result<(), ApiError> {
            copy_into(data, &mut file).map_err(|e| io_err(op, rel, e))?;
            if nix::unistd::geteuid().is_root() {
                // Best effort: files the supervisor writes stay the sandbox user's.
                let _ = nix::unistd::fchown(
                    file.as_raw_fd(),
                    Some(nix::unistd::Uid::from_raw(owner.0)),
                    Some(nix::unistd::Gid::from_raw(owner.1)),
                );
            }
            nix::sys::stat::fchmod(file.as_raw_fd(), Mode::from_bits_truncate(mode))
                .map_err(|e| sys_err(op, rel, e))?;
            file.sync_all().map_err(|e| io_err(op, rel, e))
        })();
        match written {
            Ok(()) => Ok(prepared),
            Err(e) => {
                self.abort_write(op, &prepared);
                Err(e)
            }
        }
    }

    /// Renames a prepared temporary file into place.
    fn commit_write(&self, op: &str, p: Prepared) -> Result<bool, ApiError> {
        let raw = p.parent.as_raw_fd();
        match nix::fcntl::renameat(Some(raw), p.tmp.as_os_str(), Some(raw), p.name.as_os_str()) {
            Ok(()) => Ok(p.created),
            Err(e) => {
                self.abort_write(op, &p);
                Err(match e {
                    Errno::EISDIR | Errno::ENOTEMPTY | Errno::EEXIST => {
                        ApiError::IsADirectory(format!("{op}: {} is a directory", p.rel))
                    }
                    e => sys_err(op, &p.rel, e),
                })
            }
        }
    }

    // ---- operations ----------------------------------------------------------------------

    /// Reads a regular file, or a byte or line range of it.
    pub fn read(&self, req: &ReadRequest) -> Result<ReadResult, ApiError> {
        let op = "read";
        let rel = self.rel(op, &req.path)?;
        let lines = req.line_start.is_some() || req.line_end.is_some();
        let bytes = req.offset.is_some() || req.length.is_some();
        if lines && bytes {
            return Err(ApiError::invalid(format!(
                "read {rel}: give a line range or a byte range, not both"
            )));
        }
        let max = req
            .max_bytes
            .unwrap_or(DEFAULT_MAX_BYTES)
            .min(MAX_READ_BYTES);
        if max == 0 {
            return Err(ApiError::invalid(format!(
                "read {rel}: max_bytes must be at least 1"
            )));
        }
        let (file, st) = self.open_regular(op, &rel)?;
        let total = u64::try_from(st.st_size).unwrap_or(0);

        let mut head = vec![0u8; BINARY_SNIFF];
        let n = read_full_at(&file, &mut head, 0).map_err(|e| io_err(op, &rel, e))?;
        head.truncate(n);
        let has_nul = head.contains(&0);

        let offset = req.offset.unwrap_or(0);
        let (mut content, mut truncated, counted_lines) = if lines {
            let start = req.line_start.unwrap_or(1);
            let end = req.line_end.unwrap_or(u64::MAX);
            if start == 0 || end < start {
                return Err(ApiError::invalid(format!(
                    "read {rel}: the line range {start}-{end} is invalid; lines are 1-based and inclusive"
                )));
            }
            let (c, t, l) = read_lines(&file, start, end, max).map_err(|e| io_err(op, &rel, e))?;
            (c, t, Some(l))
        } else {
            let available = total.saturating_sub(offset);
            let asked = req.length.unwrap_or(available).min(available);
            let take = asked.min(max);
            let mut buf = vec![0u8; take as usize];
            let n = read_full_at(&file, &mut buf, offset).map_err(|e| io_err(op, &rel, e))?;
            buf.truncate(n);
            (buf, asked > max, None)
        };

        let mut binary = has_nul;
        if let (false, Err(e)) = (binary, std::str::from_utf8(&content)) {
            // More of the file follows what was returned.
            let more = if lines {
                truncated
            } else {
                offset.saturating_add(content.len() as u64) < total
            };
            if e.error_len().is_none() && more {
                // A character cut by the range or by max_bytes: end before it.
                content.truncate(e.valid_up_to());
                truncated = true;
            } else {
                binary = true;
            }
        }
        let total_lines = if binary {
            None
        } else {
            match counted_lines {
                Some(l) => Some(l),
                None => Some(count_lines(&file).map_err(|e| io_err(op, &rel, e))?),
            }
        };
        let (content, encoding) = if binary {
            (
                base64::engine::general_purpose::STANDARD.encode(&content),
                "base64",
            )
        } else {
            (String::from_utf8_lossy(&content).into_owned(), "utf-8")
        };
        Ok(ReadResult {
            path: rel.to_string(),
            content,
            encoding: encoding.to_string(),
            total_bytes: total,
            total_lines,
            truncated,
            binary,
        })
    }

    /// Writes a file atomically (temporary file, fsync, rename).
    pub fn write(&self, req: &WriteRequest) -> Result<WriteResult, ApiError> {
        let op = "write";
        let rel = self.rel_entry(op, &req.path)?;
        let data = match req.encoding.as_deref().unwrap_or("utf-8") {
            "utf-8" | "utf8" => req.content.as_bytes().to_vec(),
            "base64" => base64::engine::general_purpose::STANDARD
                .decode(req.content.as_bytes())
                .map_err(|e| {
                    ApiError::invalid(format!("write {rel}: the content is not valid base64: {e}"))
                })?,
            other => {
                return Err(ApiError::invalid(format!(
                    "write {rel}: unknown encoding {other:?}; use \"utf-8\" or \"base64\""
                )));
            }
        };
        let mode = req.mode.unwrap_or(0o644);
        if mode > 0o7777 {
            return Err(ApiError::invalid(format!(
                "write {rel}: mode {mode:o} is not a permission mode (at most 7777 octal)"
            )));
        }
        let prepared =
            self.prepare_write(op, &rel, &mut &data[..], mode, false, req.create_parents)?;
        let created = self.commit_write(op, prepared)?;
        Ok(WriteResult {
            path: rel.to_string(),
            bytes_written: data.len() as u64,
            created,
            sha256: None,
        })
    }

    /// Writes a file from `body` atomically, as [`Self::write`] does, without holding it: the
    /// content goes to the temporary file piece by piece. A body that fails to read leaves
    /// nothing behind (the caller tells its failure from the file system's).
    pub fn upload(
        &self,
        req: &UploadRequest,
        body: &mut dyn Read,
    ) -> Result<WriteResult, ApiError> {
        let op = "upload";
        let rel = self.rel_entry(op, &req.path)?;
        let mode = req.mode.unwrap_or(0o644);
        if mode > 0o7777 {
            return Err(ApiError::invalid(format!(
                "upload {rel}: mode {mode:o} is not a permission mode (at most 7777 octal)"
            )));
        }
        let mut counted = Counted { inner: body, n: 0 };
        let prepared =
            self.prepare_write(op, &rel, &mut counted, mode, false, req.create_parents)?;
        let created = self.commit_write(op, prepared)?;
        Ok(WriteResult {
            path: rel.to_string(),
            bytes_written: counted.n,
            created,
            sha256: None,
        })
    }

    /// Sends a whole regular file to `sink` in pieces: `start` with its size, then exactly that
    /// many bytes (a file that shrinks meanwhile is an error, not a shorter answer; what it
    /// grows by is not sent). Returns the file's path as shown and the bytes sent.
    pub fn download(
        &self,
        req: &DownloadRequest,
        sink: &mut dyn ByteSink,
    ) -> Result<(String, u64), ApiError> {
        let op = "download";
        let rel = self.rel(op, &req.path)?;
        let (mut file, st) = self.open_regular(op, &rel)?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let gone = |e: std::io::Error| {
            ApiError::Conflict(format!(
                "download {rel}: the receiver stopped taking the file: {e}"
            ))
        };
        sink.start(size).map_err(gone)?;
        let mut buf = vec![0u8; STREAM_CHUNK];
        let mut sent = 0u64;
        while sent < size {
            let want = (size - sent).min(STREAM_CHUNK as u64) as usize;
            let n = match file.read(&mut buf[..want]) {
                Ok(0) => {
                    return Err(ApiError::Conflict(format!(
                        "download {rel}: the file shrank to {sent} bytes while being sent \
                         ({size} announced)"
                    )));
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(op, &rel, e)),
            };
            sink.write(&buf[..n]).map_err(gone)?;
            sent += n as u64;
        }
        Ok((rel.to_string(), sent))
    }

    /// The whole of `path` when it is a regular file of at most `max` bytes reached through no
    /// symlink at all (a report a command wrote, read by the supervisor: a link, even one that
    /// stays inside, is not followed). `None` for anything else, or a file that cannot be read.
    pub fn read_plain(&self, path: &str, max: u64) -> Option<Vec<u8>> {
        let rel = self.rel("read", path).ok()?;
        let fd = self
            .open_at_root(
                &rel,
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW,
                RESOLVE_ROOT_NOFOLLOW,
            )
            .ok()?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).ok()?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || u64::try_from(st.st_size).ok()? > max {
            return None;
        }
        let mut data = Vec::new();
        File::from(fd).take(max + 1).read_to_end(&mut data).ok()?;
        (data.len() as u64 <= max).then_some(data)
    }

    /// Replaces exact text in a UTF-8 file; returns the edit's unified diff.
    pub fn edit(&self, req: &EditRequest) -> Result<EditResult, ApiError> {
        let op = "edit";
        let rel = self.rel_entry(op, &req.path)?;
        if req.old.is_empty() {
            return Err(ApiError::invalid(format!(
                "edit {rel}: the old text is empty; give the exact text to replace (use write to create a file)"
            )));
        }
        let expected = req.expected_count.unwrap_or(1);
        if expected == 0 {
            return Err(ApiError::invalid(format!(
                "edit {rel}: expected_count must be at least 1"
            )));
        }
        let _guard = self.update.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bytes) = self.load_for_update(op, &rel)? else {
            return Err(ApiError::not_found(format!(
                "edit: path {rel} does not exist"
            )));
        };
        let text = String::from_utf8(bytes).map_err(|_| {
            ApiError::invalid(format!(
                "edit {rel}: the file is not UTF-8 text; use write or patch instead"
            ))
        })?;
        let positions: Vec<usize> = text.match_indices(&req.old).map(|(i, _)| i).collect();
        let found = positions.len() as u64;
        if found != expected {
            return Err(edit_mismatch(&rel, &text, &req.old, &positions, expected));
        }
        let new_text = text.replace(&req.old, &req.new);
        let prepared =
            self.prepare_write(op, &rel, &mut new_text.as_bytes(), 0o644, false, false)?;
        self.commit_write(op, prepared)?;
        let a = format!("a/{rel}");
        let b = format!("b/{rel}");
        let diff = similar::TextDiff::from_lines(&text, &new_text)
            .unified_diff()
            .context_radius(3)
            .header(&a, &b)
            .to_string();
        Ok(EditResult {
            path: rel.to_string(),
            replacements: found,
            diff,
        })
    }

    /// Applies a unified diff, all or nothing.
    pub fn patch(&self, req: &PatchRequest) -> Result<PatchResult, ApiError> {
        let op = "patch";
        if req.patch.len() > MAX_PATCH_BYTES {
            return Err(ApiError::TooLarge(format!(
                "patch: the patch is {} bytes, more than the limit of {MAX_PATCH_BYTES}",
                req.patch.len()
            )));
        }
        let files = parse_patch(&req.patch)?;
        if files.is_empty() {
            return Err(ApiError::invalid(
                "patch: no file changes found; give a unified diff (---/+++ headers and @@ hunks)",
            ));
        }
        let _guard = self.update.lock().unwrap_or_else(|e| e.into_inner());

        // Phase 1: resolve every path and compute every new content in memory.
        let mut states = PatchStates::default();
        for fp in &files {
            let old = fp
                .old_path
                .as_deref()
                .map(|p| self.rel_entry(op, p))
                .transpose()?;
            let new = fp
                .new_path
                .as_deref()
                .map(|p| self.rel_entry(op, p))
                .transpose()?;
            // Checked before anything is written: the patch stays all or nothing.
            for rel in old.iter().chain(new.iter()) {
                self.guard(op, rel)?;
            }
            let base: Vec<u8> = match (&old, &new) {
                (None, None) => {
                    return Err(ApiError::invalid("patch: a file section names no file"));
                }
                (None, Some(n)) => {
                    if states.load(self, n)?.is_some() {
                        return Err(ApiError::PatchFailed(format!(
                            "patch: {n}: the patch adds this file but it already exists"
                        )));
                    }
                    Vec::new()
                }
                (Some(o), _) => match states.load(self, o)? {
                    Some(c) => c.clone(),
                    None => {
                        return Err(ApiError::PatchFailed(format!(
                            "patch: {o}: the patch changes this file but it does not exist"
                        )));
                    }
                },
            };
            let label = new.as_ref().or(old.as_ref()).map(|r| r.to_string());
            let result = apply_hunks(&label.unwrap_or_default(), &base, &fp.hunks)?;
            match (&old, &new) {
                (Some(o), None) => {
                    if !result.is_empty() {
                        return Err(ApiError::PatchFailed(format!(
                            "patch: {o}: the patch deletes this file but the file has content the patch does not remove"
                        )));
                    }
                    states.set(o, None, None);
                }
                (o, Some(n)) => {
                    if let Some(o) = o.as_ref().filter(|o| *o != n) {
                        if states.load(self, n)?.is_some() {
                            return Err(ApiError::PatchFailed(format!(
                                "patch: {n}: the patch renames {o} to this path but it already exists"
                            )));
                        }
                        states.set(o, None, None);
                    }
                    states.set(n, Some(result), fp.mode);
                }
                (None, None) => {}
            }
        }

        // A path the patch leaves as a file cannot also be a directory of another one: the
        // renames would fail with part of the patch in place.
        let files_after: BTreeSet<&RelPath> = states
            .order
            .iter()
            .filter(|r| states.map.get(*r).is_some_and(|s| s.content.is_some()))
            .collect();
        for rel in &files_after {
            let mut prefix = RelPath::root(self.absolute);
            for part in &rel.parts[..rel.parts.len().saturating_sub(1)] {
                prefix = prefix.join(part);
                if files_after.contains(&prefix) {
                    return Err(ApiError::PatchFailed(format!(
                        "patch: {prefix} would be a file and also the directory of {rel}"
                    )));
                }
            }
        }

        // Phase 2: write every new content to a temporary file; on any failure remove them all,
        // and the directories made for them.
        let mut prepared: Vec<Prepared> = Vec::new();
        let mut changes: Vec<Change> = Vec::new();
        let mut deletes: Vec<RelPath> = Vec::new();
        for rel in &states.order {
            let Some(s) = states.map.get(rel) else {
                continue;
            };
            let kind = match (s.original, &s.content) {
                (false, None) => continue,
                (false, Some(_)) => ChangeKind::Added,
                (true, Some(_)) => ChangeKind::Modified,
                (true, None) => ChangeKind::Deleted,
            };
            match &s.content {
                Some(c) => {
                    let mode = s.mode.unwrap_or(0o644);
                    match self.prepare_write(op, rel, &mut &c[..], mode, s.mode.is_some(), true) {
                        Ok(p) => prepared.push(p),
                        Err(e) => {
                            // Newest first: an earlier write's directories may hold a later
                            // one's temporary file.
                            for p in prepared.iter().rev() {
                                self.abort_write(op, p);
                            }
                            return Err(e);
                        }
                    }
                }
                None => deletes.push(rel.clone()),
            }
            changes.push(Change {
                path: rel.to_string(),
                kind,
            });
        }

        // Phase 3: rename into place, then delete.
        let mut first_err = None;
        for p in prepared {
            if let Err(e) = self.commit_write(op, p) {
                first_err.get_or_insert(e);
            }
        }
        for rel in &deletes {
            let r = self.parent_of(op, rel).and_then(|(parent, name)| {
                nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| sys_err(op, rel, e))
            });
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(PatchResult { files: changes }),
        }
    }

    /// Lists a directory (gitignore-aware, optionally filtered by a glob).
    pub fn list(&self, req: &ListRequest) -> Result<ListResult, ApiError> {
        let op = "list";
        let start = self.rel(op, req.path.as_deref().unwrap_or("."))?;
        let glob = compile_glob(op, req.glob.as_deref())?;
        let max_depth = match req.max_depth {
            Some(0) => {
                return Err(ApiError::invalid("list: max_depth must be at least 1"));
            }
            Some(d) => Some(d),
            None if glob.is_some() => None,
            None => Some(1),
        };
        let limit = req.limit.unwrap_or(DEFAULT_LIST_LIMIT);
        let opts = WalkOptions {
            include_hidden: req.include_hidden,
            include_ignored: req.include_ignored,
            max_depth,
        };
        let mut entries = Vec::new();
        let mut truncated = false;
        let cut = self.walk(op, &start, &opts, &mut |e| {
            if glob
                .as_ref()
                .is_some_and(|g| !g.is_match(e.rel.strip(&start)))
            {
                return true;
            }
            if entries.len() as u64 >= limit {
                truncated = true;
                return false;
            }
            entries.push(Entry {
                path: e.rel.to_string(),
                kind: e.kind,
                size: e.size,
            });
            true
        })?;
        Ok(ListResult {
            entries,
            truncated: truncated || cut,
        })
    }

    /// Searches file contents with a regular expression.
    pub fn search(&self, req: &SearchRequest) -> Result<SearchResult, ApiError> {
        let op = "search";
        let start = self.rel(op, req.path.as_deref().unwrap_or("."))?;
        let glob = compile_glob(op, req.glob.as_deref())?;
        let matcher = RegexMatcherBuilder::new()
            .case_insensitive(req.case_insensitive)
            .line_terminator(Some(b'\n'))
            .build(&req.pattern)
            .map_err(|e| ApiError::invalid(format!("search: invalid regular expression: {e}")))?;
        let max = req.max_matches.unwrap_or(DEFAULT_MAX_MATCHES);
        let mut searcher = SearcherBuilder::new()
            .line_number(true)
            .binary_detection(BinaryDetection::quit(0))
            .heap_limit(Some(SEARCH_HEAP_LIMIT))
            .build();
        let mut matches: Vec<Match> = Vec::new();
        let mut files_searched = 0u64;
        let mut truncated = false;
        let mut search_one = |file: File, rel: &RelPath| -> bool {
            files_searched += 1;
            let remaining = (max as usize).saturating_sub(matches.len());
            let mut sink = Collect {
                path: rel.to_string(),
                found: Vec::new(),
                binary: false,
                limit: remaining.saturating_add(1),
            };
            if searcher.search_file(&matcher, &file, &mut sink).is_err() || sink.binary {
                return true;
            }
            matches.extend(sink.found);
            if matches.len() as u64 > max {
                matches.truncate(max as usize);
                truncated = true;
                return false;
            }
            true
        };

        // A single file named directly.
        let probe = self
            .open_at_root(&start, libc::O_PATH, RESOLVE_ROOT)
            .map_err(|e| sys_err(op, &start, e))?;
        let st = nix::sys::stat::fstat(probe.as_raw_fd()).map_err(|e| sys_err(op, &start, e))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            let (file, _) = self.open_regular(op, &start)?;
            search_one(file, &start);
            return Ok(SearchResult {
                matches,
                truncated,
                files_searched,
            });
        }

        let opts = WalkOptions {
            include_hidden: req.include_hidden,
            include_ignored: req.include_ignored,
            max_depth: None,
        };
        let cut = self.walk(op, &start, &opts, &mut |e| {
            if e.kind != EntryKind::File {
                return true;
            }
            if glob
                .as_ref()
                .is_some_and(|g| !g.is_match(e.rel.strip(&start)))
            {
                return true;
            }
            let Ok(fd) = self.open_at_root(
                &e.rel,
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW,
                RESOLVE_ROOT_NOFOLLOW,
            ) else {
                return true;
            };
            match nix::sys::stat::fstat(fd.as_raw_fd()) {
                Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => {
                    search_one(File::from(fd), &e.rel)
                }
                _ => true,
            }
        })?;
        Ok(SearchResult {
            matches,
            truncated: truncated || cut,
            files_searched,
        })
    }

    /// Describes a path without following a final symlink.
    pub fn stat(&self, req: &PathRequest) -> Result<StatResult, ApiError> {
        let op = "stat";
        let rel = self.rel(op, &req.path)?;
        let (st, target) = match rel.split_last() {
            None => {
                let st = nix::sys::stat::fstat(self.root.as_raw_fd())
                    .map_err(|e| sys_err(op, &rel, e))?;
                (st, None)
            }
            Some((parent_rel, name)) => {
                let parent = self.open_dir(op, &parent_rel)?;
                let st = lstat_at(&parent, name)
                    .map_err(|e| sys_err(op, &rel, e))?
                    .ok_or_else(|| sys_err(op, &rel, Errno::ENOENT))?;
                let target = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                    let t = nix::fcntl::readlinkat(Some(parent.as_raw_fd()), name)
                        .map_err(|e| sys_err(op, &rel, e))?;
                    Some(t.to_string_lossy().into_owned())
                } else {
                    None
                };
                (st, target)
            }
        };
        Ok(StatResult {
            path: rel.to_string(),
            kind: kind_of(&st),
            size: u64::try_from(st.st_size).unwrap_or(0),
            mode: st.st_mode & 0o7777,
            modified_ms: modified_ms(&st),
            symlink_target: target,
        })
    }

    /// Removes a file, a symlink (not its target) or, with `recursive`, a directory tree.
    pub fn remove(&self, req: &RemoveRequest) -> Result<(), ApiError> {
        let op = "remove";
        let rel = self.rel_entry(op, &req.path)?;
        self.guard(op, &rel)?;
        let (parent, name) = self.parent_of(op, &rel)?;
        let st = lstat_at(&parent, name)
            .map_err(|e| sys_err(op, &rel, e))?
            .ok_or_else(|| sys_err(op, &rel, Errno::ENOENT))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            if !req.recursive {
                return Err(ApiError::IsADirectory(format!(
                    "remove: {rel} is a directory; set recursive to remove it and everything beneath it"
                )));
            }
            let dir = open_child_dir(&parent, name).map_err(|e| sys_err(op, &rel, e))?;
            remove_tree(op, &rel, &dir, 1)?;
            nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::RemoveDir)
                .map_err(|e| sys_err(op, &rel, e))
        } else {
            nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| sys_err(op, &rel, e))
        }
    }

    /// Renames a file, symlink or directory; refuses to replace an existing `to` unless
    /// `overwrite`. Symlinks are moved, never followed.
    pub fn rename(&self, req: &MoveRequest) -> Result<(), ApiError> {
        let op = "rename";
        let from = self.rel_entry(op, &req.from)?;
        let to = self.rel_entry(op, &req.to)?;
        self.guard(op, &from)?;
        self.guard(op, &to)?;
        if to.starts_with(&from) && to != from {
            return Err(ApiError::invalid(format!(
                "rename: cannot move {from} into itself ({to})"
            )));
        }
        let (fparent, fname) = self.parent_of(op, &from)?;
        let (tparent, tname) = self.parent_of(op, &to)?;
        if lstat_at(&fparent, fname)
            .map_err(|e| sys_err(op, &from, e))?
            .is_none()
        {
            return Err(sys_err(op, &from, Errno::ENOENT));
        }
        let flags = if req.overwrite {
            RenameFlags::empty()
        } else {
            RenameFlags::RENAME_NOREPLACE
        };
        let renamed = nix::fcntl::renameat2(
            Some(fparent.as_raw_fd()),
            fname,
            Some(tparent.as_raw_fd()),
            tname,
            flags,
        );
        // Overlayfs moves a directory that comes from its lower layer (the host workspace) only
        // by copying it, as mv(1) does: it answers EXDEV.
        let renamed = match renamed {
            Err(Errno::EXDEV) => {
                return self.move_by_copy(
                    op,
                    (&fparent, fname, &from),
                    (&tparent, tname, &to),
                    req,
                );
            }
            other => other,
        };
        renamed.map_err(|e| match e {
            Errno::EEXIST => ApiError::Conflict(format!(
                "rename: {to} already exists; set overwrite to replace it"
            )),
            Errno::ENOTEMPTY => {
                ApiError::Conflict(format!("rename: {to} is a directory that is not empty"))
            }
            Errno::EISDIR | Errno::ENOTDIR => ApiError::invalid(format!(
                "rename: cannot replace {to} with {from}: one is a directory and the other is not"
            )),
            Errno::EINVAL => ApiError::invalid(format!("rename: cannot move {from} to {to}: {e}")),
            e => sys_err(op, &from, e),
        })
    }

    /// A rename overlayfs refused with EXDEV (a directory of the lower layer): the tree is
    /// copied to `to` beneath the workspace's descriptors, never following a symlink, then
    /// removed at `from`. A copy that fails is removed again; `from` is untouched then.
    fn move_by_copy(
        &self,
        op: &str,
        (fparent, fname, from): (&OwnedFd, &OsStr, &RelPath),
        (tparent, tname, to): (&OwnedFd, &OsStr, &RelPath),
        req: &MoveRequest,
    ) -> Result<(), ApiError> {
        let st = lstat_at(fparent, fname)
            .map_err(|e| sys_err(op, from, e))?
            .ok_or_else(|| sys_err(op, from, Errno::ENOENT))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            if self.absolute {
                return Err(ApiError::InvalidArgument(format!(
                    "{op}: {from} and {to} are on different file systems of the sandbox, and only \
                     a directory is moved across them (by copying); copy the file and remove it"
                )));
            }
            return Err(sys_err(op, from, Errno::EXDEV));
        }
        if let Some(existing) = lstat_at(tparent, tname).map_err(|e| sys_err(op, to, e))? {
            if !req.overwrite {
                return Err(ApiError::Conflict(format!(
                    "rename: {to} already exists; set overwrite to replace it"
                )));
            }
            if existing.st_mode & libc::S_IFMT != libc::S_IFDIR {
                return Err(ApiError::invalid(format!(
                    "rename: cannot replace {to} with {from}: one is a directory and the other is not"
                )));
            }
            // As rename(2): an empty directory is replaced, a full one is not.
            nix::unistd::unlinkat(Some(tparent.as_raw_fd()), tname, UnlinkatFlags::RemoveDir)
                .map_err(|e| match e {
                    Errno::ENOTEMPTY | Errno::EEXIST => {
                        ApiError::Conflict(format!("rename: {to} is a directory that is not empty"))
                    }
                    e => sys_err(op, to, e),
                })?;
        }
        let open_dir = |parent: &OwnedFd, name: &OsStr, rel: &RelPath| {
            open_child_dir(parent, name).map_err(|e| sys_err(op, rel, e))
        };
        let src = open_dir(fparent, fname, from)?;
        nix::sys::stat::mkdirat(
            Some(tparent.as_raw_fd()),
            tname,
            Mode::from_bits_truncate(0o700),
        )
        .map_err(|e| sys_err(op, to, e))?;
        let copied = open_dir(tparent, tname, to).and_then(|dst| {
            copy_tree(op, from, &src, &dst, 1)?;
            nix::sys::stat::fchmod(
                dst.as_raw_fd(),
                Mode::from_bits_truncate(st.st_mode & 0o7777),
            )
            .map_err(|e| sys_err(op, to, e))
        });
        if let Err(e) = copied {
            if let Ok(dst) = open_dir(tparent, tname, to) {
                let _ = remove_tree(op, to, &dst, 1);
            }
            let _ =
                nix::unistd::unlinkat(Some(tparent.as_raw_fd()), tname, UnlinkatFlags::RemoveDir);
            return Err(e);
        }
        remove_tree(op, from, &src, 1)?;
        nix::unistd::unlinkat(Some(fparent.as_raw_fd()), fname, UnlinkatFlags::RemoveDir)
            .map_err(|e| sys_err(op, from, e))
    }

    // ---- walking -------------------------------------------------------------------------

    /// The gitignore chain for the entries of `dir`: `.git/info/exclude`, then the
    /// `.gitignore` of the root and of every directory down to `dir`.
    fn ignore_chain(&self, dir: &RelPath, budget: &mut IgnoreBudget) -> Option<Rc<IgnoreChain>> {
        let mut chain = None;
        let exclude = RelPath::root(self.absolute)
            .join(OsStr::new(".git"))
            .join(OsStr::new("info"))
            .join(OsStr::new("exclude"));
        if let Some(gi) = self.load_gitignore(&RelPath::root(self.absolute), &exclude, budget) {
            chain = Some(Rc::new(IgnoreChain { gi, parent: chain }));
        }
        let mut prefix = RelPath::root(self.absolute);
        for i in 0..=dir.parts.len() {
            if i > 0 {
                prefix = prefix.join(&dir.parts[i - 1]);
            }
            let file = prefix.join(OsStr::new(".gitignore"));
            if let Some(gi) = self.load_gitignore(&prefix, &file, budget) {
                chain = Some(Rc::new(IgnoreChain { gi, parent: chain }));
            }
        }
        chain
    }

    /// Reads an ignore file (a regular file, reached without symlinks) into a matcher rooted at
    /// `dir`, within the walk's `budget`.
    fn load_gitignore(
        &self,
        dir: &RelPath,
        file: &RelPath,
        budget: &mut IgnoreBudget,
    ) -> Option<Gitignore> {
        let fd = self
            .open_at_root(
                file,
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW,
                RESOLVE_ROOT_NOFOLLOW,
            )
            .ok()?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).ok()?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return None;
        }
        budget.read_rules(File::from(fd), &dir.virtual_abs(), file)
    }

    /// Walks the tree under `start` depth-first in path order, calling `visit` for every entry
    /// that is not hidden or ignored (as the options say); `visit` returns false to stop.
    /// Directories are opened from the root without following any symlink, read whole and
    /// closed, so a deep tree holds no fds; symlinks are reported, never followed; `.git` is
    /// never entered. Returns whether the walk was cut short by [`MAX_WALK_ENTRIES`].
    fn walk(
        &self,
        op: &str,
        start: &RelPath,
        opts: &WalkOptions,
        visit: &mut dyn FnMut(&WalkEntry) -> bool,
    ) -> Result<bool, ApiError> {
        enum Work {
            Visit(WalkEntry),
            Expand {
                dir: RelPath,
                depth: u32,
                chain: Option<Rc<IgnoreChain>>,
            },
        }
        let mut budget = IgnoreBudget::new(0);
        let chain = if opts.include_ignored {
            None
        } else {
            self.ignore_chain(start, &mut budget)
        };
        let mut stack = vec![Work::Expand {
            dir: start.clone(),
            depth: 0,
            chain,
        }];
        let mut seen = 0u64;
        while let Some(work) = stack.pop() {
            match work {
                Work::Visit(e) => {
                    if !visit(&e) {
                        return Ok(false);
                    }
                }
                Work::Expand { dir, depth, chain } => {
                    // The start may be reached through symlinks (inside the root); what is
                    // beneath it is opened without following any.
                    let (flags, resolve) = if dir == *start {
                        (libc::O_RDONLY | libc::O_DIRECTORY, RESOLVE_ROOT)
                    } else {
                        (
                            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                            RESOLVE_ROOT_NOFOLLOW,
                        )
                    };
                    let fd = match self.open_at_root(&dir, flags, resolve) {
                        Ok(fd) => fd,
                        Err(Errno::ENOTDIR) if dir == *start => {
                            return Err(ApiError::NotADirectory(format!(
                                "{op}: {dir} is not a directory"
                            )));
                        }
                        Err(e) if dir == *start => return Err(sys_err(op, &dir, e)),
                        Err(_) => continue,
                    };
                    let chain = match (&dir == start || opts.include_ignored, chain) {
                        (true, chain) => chain,
                        (false, chain) => {
                            let file = dir.join(OsStr::new(".gitignore"));
                            match self.load_gitignore(&dir, &file, &mut budget) {
                                Some(gi) => Some(Rc::new(IgnoreChain { gi, parent: chain })),
                                None => chain,
                            }
                        }
                    };
                    let Ok(names) = read_names(&fd) else {
                        if dir == *start {
                            return Err(ApiError::internal(format!(
                                "{op}: cannot read directory {dir}"
                            )));
                        }
                        continue;
                    };
                    let mut children = Vec::new();
                    for name in names {
                        seen += 1;
                        if seen > MAX_WALK_ENTRIES {
                            return Ok(true);
                        }
                        budget.add_path();
                        let hidden = name.as_bytes().first() == Some(&b'.');
                        if hidden && !opts.include_hidden {
                            continue;
                        }
                        let Ok(Some(st)) = lstat_at(&fd, &name) else {
                            continue;
                        };
                        let kind = kind_of(&st);
                        let rel = dir.join(&name);
                        let is_dir = kind == EntryKind::Dir;
                        if !opts.include_ignored
                            && is_ignored(&chain, &rel.virtual_abs(), is_dir, &mut budget)
                        {
                            continue;
                        }
                        let descend = is_dir
                            && name.as_bytes() != b".git"
                            && opts.max_depth.is_none_or(|m| depth + 1 < m);
                        children.push((
                            WalkEntry {
                                rel,
                                kind,
                                size: u64::try_from(st.st_size).unwrap_or(0),
                            },
                            descend,
                        ));
                    }
                    for (entry, descend) in children.into_iter().rev() {
                        if descend {
                            stack.push(Work::Expand {
                                dir: entry.rel.clone(),
                                depth: depth + 1,
                                chain: chain.clone(),
                            });
                        }
                        stack.push(Work::Visit(entry));
                    }
                }
            }
        }
        Ok(false)
    }
}

fn symlink_refused(op: &str, rel: &RelPath) -> ApiError {
    ApiError::PathRefused(format!(
        "{op}: {rel} is a symlink; refusing to write through it (name the target's path instead)"
    ))
}

/// Best effort, as root: a directory the supervisor creates belongs to its parent's owner.
fn adopt_owner_at(parent: &OwnedFd, name: &OsStr) {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    if let Ok(st) = nix::sys::stat::fstat(parent.as_raw_fd()) {
        let _ = nix::unistd::fchownat(
            Some(parent.as_raw_fd()),
            name,
            Some(nix::unistd::Uid::from_raw(st.st_uid)),
            Some(nix::unistd::Gid::from_raw(st.st_gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        );
    }
}

/// Removes everything in the directory `dir` (open for reading), never following symlinks.
/// The directory `name` beneath `dir`, opened without following a symlink on the way.
fn open_child_dir(dir: &OwnedFd, name: &OsStr) -> Result<OwnedFd, Errno> {
    sys::openat2(
        dir,
        &c_name(name),
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
        RESOLVE_CHILD,
    )
}

fn remove_tree(op: &str, rel: &RelPath, dir: &OwnedFd, depth: usize) -> Result<(), ApiError> {
    if depth > MAX_REMOVE_DEPTH {
        return Err(ApiError::LimitExceeded(format!(
            "remove: {rel} is nested more than {MAX_REMOVE_DEPTH} directories deep; remove it in parts"
        )));
    }
    let names = read_names(dir).map_err(|e| sys_err(op, rel, e))?;
    for name in names {
        let child = rel.join(&name);
        let Some(st) = lstat_at(dir, &name).map_err(|e| sys_err(op, &child, e))? else {
            continue;
        };
        let r = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            let sub = open_child_dir(dir, &name).map_err(|e| sys_err(op, &child, e))?;
            remove_tree(op, &child, &sub, depth + 1)?;
            nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                name.as_os_str(),
                UnlinkatFlags::RemoveDir,
            )
        } else {
            nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                name.as_os_str(),
                UnlinkatFlags::NoRemoveDir,
            )
        };
        match r {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => return Err(sys_err(op, &child, e)),
        }
    }
    Ok(())
}

/// Copies the entries of `src` into the empty directory `dst` (both beneath the workspace's
/// descriptors): directories, regular files with their permission bits, and symlinks as links.
/// Special files are refused.
fn copy_tree(
    op: &str,
    rel: &RelPath,
    src: &OwnedFd,
    dst: &OwnedFd,
    depth: usize,
) -> Result<(), ApiError> {
    if depth > MAX_REMOVE_DEPTH {
        return Err(ApiError::LimitExceeded(format!(
            "{op}: {rel} is nested more than {MAX_REMOVE_DEPTH} directories deep"
        )));
    }
    for name in read_names(src).map_err(|e| sys_err(op, rel, e))? {
        let child = rel.join(&name);
        let Some(st) = lstat_at(src, &name).map_err(|e| sys_err(op, &child, e))? else {
            continue;
        };
        let mode = Mode::from_bits_truncate(st.st_mode & 0o7777);
        let cname = c_name(&name);
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                nix::sys::stat::mkdirat(
                    Some(dst.as_raw_fd()),
                    name.as_os_str(),
                    Mode::from_bits_truncate(0o700),
                )
                .map_err(|e| sys_err(op, &child, e))?;
                let from = open_child_dir(src, &name).map_err(|e| sys_err(op, &child, e))?;
                let to = open_child_dir(dst, &name).map_err(|e| sys_err(op, &child, e))?;
                copy_tree(op, &child, &from, &to, depth + 1)?;
                nix::sys::stat::fchmod(to.as_raw_fd(), mode).map_err(|e| sys_err(op, &child, e))?;
            }
            libc::S_IFREG => {
                let from = sys::openat2(
                    src,
                    &cname,
                    libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
                    0,
                    RESOLVE_CHILD,
                )
                .map_err(|e| sys_err(op, &child, e))?;
                let to = sys::openat2(
                    dst,
                    &cname,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                    (st.st_mode & 0o777) as libc::mode_t,
                    RESOLVE_CHILD,
                )
                .map_err(|e| sys_err(op, &child, e))?;
                let (mut from, mut to) = (File::from(from), File::from(to));
                std::io::copy(&mut from, &mut to).map_err(|e| io_err(op, &child, e))?;
                nix::sys::stat::fchmod(to.as_raw_fd(), mode).map_err(|e| sys_err(op, &child, e))?;
            }
            libc::S_IFLNK => {
                let target = nix::fcntl::readlinkat(Some(src.as_raw_fd()), name.as_os_str())
                    .map_err(|e| sys_err(op, &child, e))?;
                nix::unistd::symlinkat(target.as_os_str(), Some(dst.as_raw_fd()), name.as_os_str())
                    .map_err(|e| sys_err(op, &child, e))?;
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "{op}: {child} is a special file ({}); a directory of the host workspace \
                     holding one cannot be moved",
                    kind_name(&st)
                )));
            }
        }
    }
    Ok(())
}

// ---- read helpers ----------------------------------------------------------------------------

/// The size of the pieces a stream is copied in.
const STREAM_CHUNK: usize = 256 * 1024;

/// A reader that counts what it gave.
struct Counted<'a> {
    inner: &'a mut dyn Read,
    n: u64,
}

impl Read for Counted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// Copies `from` into `to` in [`STREAM_CHUNK`] pieces (fewer system calls than `io::copy`'s
/// 8 KiB for a large upload; a small content is written in one).
fn copy_into(from: &mut dyn Read, to: &mut File) -> std::io::Result<u64> {
    let mut buf = vec![0u8; STREAM_CHUNK];
    let mut total = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        total += n as u64;
    }
}

/// Reads up to `buf.len()` bytes at `offset`, stopping only at end of file.
fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Lines in a file: newlines, plus one for a last line without a newline. Streams.
fn count_lines(file: &File) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut offset = 0u64;
    let mut lines = 0u64;
    let mut last = b'\n';
    loop {
        let n = read_full_at(file, &mut buf, offset)?;
        if n == 0 {
            break;
        }
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
        last = buf[n - 1];
        offset += n as u64;
    }
    if last != b'\n' {
        lines += 1;
    }
    Ok(lines)
}

/// Lines `start..=end` (1-based), at most `max` bytes; streams the whole file to count its
/// lines. Returns the content, whether it was cut, and the file's line count.
fn read_lines(
    file: &File,
    start: u64,
    end: u64,
    max: u64,
) -> std::io::Result<(Vec<u8>, bool, u64)> {
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut out = Vec::new();
    let mut truncated = false;
    let mut line_no = 0u64;
    let mut line = Vec::new();
    loop {
        line.clear();
        // Cap each line read so one enormous line does not fill memory.
        let n = (&mut reader)
            .take(1024 * 1024)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        let ends_line = line.last() == Some(&b'\n');
        let in_range = line_no + 1 >= start && line_no < end;
        if in_range && !truncated {
            let room = (max as usize).saturating_sub(out.len());
            if line.len() > room {
                out.extend_from_slice(&line[..room]);
                truncated = true;
            } else {
                out.extend_from_slice(&line);
            }
        }
        if ends_line {
            line_no += 1;
        } else {
            // A piece of a long line, or the last line without a newline.
            if reader.fill_buf()?.is_empty() {
                line_no += 1;
            }
        }
    }
    Ok((out, truncated, line_no))
}

// ---- edit helpers ----------------------------------------------------------------------------

fn line_at(text: &str, byte: usize) -> usize {
    text.as_bytes()[..byte]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

fn line_list(lines: &[usize]) -> String {
    let mut s: Vec<String> = lines.iter().take(10).map(|l| l.to_string()).collect();
    if lines.len() > 10 {
        s.push(format!("... ({} more)", lines.len() - 10));
    }
    s.join(", ")
}

/// Where `old` matches `text` when runs of whitespace are compared as one space.
fn whitespace_insensitive_line(text: &str, old: &str) -> Option<usize> {
    if text.len() > 4 * 1024 * 1024 {
        return None;
    }
    let want: Vec<&str> = old.split_whitespace().collect();
    if want.is_empty() {
        return None;
    }
    let mut words: Vec<(&str, usize)> = Vec::new();
    for (i, line) in text.split('\n').enumerate() {
        for w in line.split_whitespace() {
            words.push((w, i + 1));
        }
    }
    let n = want.len();
    if words.len() < n {
        return None;
    }
    (0..=words.len() - n).find_map(|i| {
        let first_ok = if n == 1 {
            words[i].0.contains(want[0])
        } else {
            words[i].0.ends_with(want[0])
                && words[i + n - 1].0.starts_with(want[n - 1])
                && (1..n - 1).all(|k| words[i + k].0 == want[k])
        };
        first_ok.then_some(words[i].1)
    })
}

fn edit_mismatch(
    rel: &RelPath,
    text: &str,
    old: &str,
    positions: &[usize],
    expected: u64,
) -> ApiError {
    let lines: Vec<usize> = positions.iter().map(|&p| line_at(text, p)).collect();
    let found = positions.len() as u64;
    if found == 0 {
        let mut msg = format!(
            "edit {rel}: the old text was not found (0 matches); read the file again and copy the exact text, including whitespace"
        );
        if let Some(l) = whitespace_insensitive_line(text, old) {
            msg.push_str(&format!(
                "; a match that differs only in whitespace starts at line {l}"
            ));
        }
        return ApiError::EditNotFound(msg);
    }
    if found > expected {
        ApiError::EditAmbiguous(format!(
            "edit {rel}: the old text is ambiguous: {found} matches at lines {}; include more surrounding lines or set expected_count to {found}",
            line_list(&lines)
        ))
    } else {
        ApiError::EditNotFound(format!(
            "edit {rel}: expected {expected} matches of the old text but found {found} at lines {}; set expected_count to {found} or read the file again",
            line_list(&lines)
        ))
    }
}

// ---- walk helpers ----------------------------------------------------------------------------

struct WalkOptions {
    include_hidden: bool,
    include_ignored: bool,
    max_depth: Option<u32>,
}

struct WalkEntry {
    rel: RelPath,
    kind: EntryKind,
    size: u64,
}

/// Gitignore matchers from the outermost (`.git/info/exclude`) to the innermost directory.
struct IgnoreChain {
    gi: Gitignore,
    parent: Option<Rc<IgnoreChain>>,
}

/// The innermost matcher that says anything decides, as in git; past the walk's `budget`,
/// nothing is ignored.
fn is_ignored(
    chain: &Option<Rc<IgnoreChain>>,
    path: &Path,
    is_dir: bool,
    budget: &mut IgnoreBudget,
) -> bool {
    let mut link = chain.as_ref();
    while let Some(node) = link {
        if !budget.take_match(path.as_os_str().len()) {
            return false;
        }
        match node.gi.matched(path, is_dir) {
            IgnoreMatch::Ignore(_) => return true,
            IgnoreMatch::Whitelist(_) => return false,
            IgnoreMatch::None => {}
        }
        link = node.parent.as_ref();
    }
    false
}

/// Globs match the path relative to the listed or searched directory; `*` also matches `/`
/// (as in ripgrep's `-g`), so `*.rs` finds Rust files at any depth.
fn compile_glob(op: &str, glob: Option<&str>) -> Result<Option<GlobMatcher>, ApiError> {
    glob.map(|g| {
        GlobBuilder::new(g)
            .build()
            .map(|g| g.compile_matcher())
            .map_err(|e| ApiError::invalid(format!("{op}: invalid glob {g:?}: {e}")))
    })
    .transpose()
}

/// Collects one file's matches; gives up on binary files.
struct Collect {
    path: String,
    found: Vec<Match>,
    binary: bool,
    limit: usize,
}

impl Sink for Collect {
    type Error = std::io::Error;

    fn matched(&mut self, _: &Searcher, mat: &SinkMatch<'_>) -> Result<bool, std::io::Error> {
        let mut bytes = mat.bytes();
        while let Some((&last, rest)) = bytes.split_last() {
            if last == b'\n' || last == b'\r' {
                bytes = rest;
            } else {
                break;
            }
        }
        let line: String = String::from_utf8_lossy(bytes)
            .chars()
            .take(MAX_LINE_CHARS)
            .collect();
        self.found.push(Match {
            path: self.path.clone(),
            line_number: mat.line_number().unwrap_or(0),
            line,
        });
        Ok(self.found.len() < self.limit)
    }

    fn binary_data(&mut self, _: &Searcher, _: u64) -> Result<bool, std::io::Error> {
        self.binary = true;
        Ok(false)
    }
}

// ---- patch -----------------------------------------------------------------------------------

/// One hunk: the lines it expects and the lines it puts in their place.
#[derive(Debug)]
struct Hunk {
    header: String,
    old_start: usize,
    old: Vec<Vec<u8>>,
    new: Vec<Vec<u8>>,
    old_no_newline: bool,
    new_no_newline: bool,
    /// How many of the lines are context (in both `old` and `new`).
    context: usize,
}

/// One file's part of a patch, its paths still as written (prefixes stripped).
#[derive(Debug)]
struct FilePatch {
    old_path: Option<String>,
    new_path: Option<String>,
    mode: Option<u32>,
    hunks: Vec<Hunk>,
}

#[derive(Debug, Default)]
struct Section {
    git: bool,
    git_paths: Option<(String, String)>,
    minus: Option<Option<String>>,
    plus: Option<Option<String>>,
    new_file: bool,
    deleted: bool,
    rename_from: Option<String>,
    rename_to: Option<String>,
    mode: Option<u32>,
    hunks: Vec<Hunk>,
}

impl Section {
    fn is_started(&self) -> bool {
        self.git || self.minus.is_some()
    }

    fn finish(self) -> Result<Option<FilePatch>, ApiError> {
        if !self.is_started() {
            return Ok(None);
        }
        let strip =
            |p: &str, prefix: &str| -> String { p.strip_prefix(prefix).unwrap_or(p).to_string() };
        let minus = self.minus.clone();
        let plus = self.plus.clone();
        let prefixed = self.git
            || (minus
                .as_ref()
                .is_none_or(|m| m.as_ref().is_none_or(|p| p.starts_with("a/")))
                && plus
                    .as_ref()
                    .is_none_or(|m| m.as_ref().is_none_or(|p| p.starts_with("b/")))
                && (minus.as_ref().is_some_and(|m| m.is_some())
                    || plus.as_ref().is_some_and(|m| m.is_some())));
        let fix = |p: Option<String>, prefix: &str| -> Option<String> {
            p.map(|p| if prefixed { strip(&p, prefix) } else { p })
        };
        let mut old = match minus {
            Some(m) => fix(m, "a/"),
            None => self.git_paths.as_ref().map(|(a, _)| a.clone()),
        };
        let mut new = match plus {
            Some(p) => fix(p, "b/"),
            None => self.git_paths.as_ref().map(|(_, b)| b.clone()),
        };
        if let Some(f) = self.rename_from {
            old = Some(f);
        }
        if let Some(t) = self.rename_to {
            new = Some(t);
        }
        if self.new_file {
            old = None;
        }
        if self.deleted {
            new = None;
        }
        Ok(Some(FilePatch {
            old_path: old,
            new_path: new,
            mode: self.mode,
            hunks: self.hunks,
        }))
    }
}

/// Unquotes a git C-style quoted path (`"a/x\tb"`); other paths are returned as they are.
fn unquote(s: &str) -> String {
    let Some(inner) = s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) else {
        return s.to_string();
    };
    let mut out: Vec<u8> = Vec::new();
    let b = inner.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 1 < b.len() {
            i += 1;
            match b[i] {
                b'n' => out.push(b'\n'),
                b't' => out.push(b'\t'),
                b'r' => out.push(b'\r'),
                b'a' => out.push(7),
                b'b' => out.push(8),
                b'f' => out.push(12),
                b'v' => out.push(11),
                d @ b'0'..=b'7' => {
                    let mut v = u32::from(d - b'0');
                    let mut k = 0;
                    while k < 2 && i + 1 < b.len() && (b'0'..=b'7').contains(&b[i + 1]) {
                        i += 1;
                        v = v * 8 + u32::from(b[i] - b'0');
                        k += 1;
                    }
                    out.push((v & 0xff) as u8);
                }
                c => out.push(c),
            }
        } else {
            out.push(b[i]);
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The path of a `---`/`+++` line: timestamps after a tab dropped, `/dev/null` as None.
fn header_path(rest: &str) -> Option<String> {
    let rest = rest.trim_end_matches('\r');
    let p = if rest.starts_with('"') {
        rest.to_string()
    } else {
        rest.split('\t').next().unwrap_or("").trim_end().to_string()
    };
    let p = unquote(&p);
    if p == "/dev/null" { None } else { Some(p) }
}

/// The two paths of `diff --git a/X b/Y` (prefixes stripped).
fn git_header_paths(rest: &str) -> Option<(String, String)> {
    let rest = rest.trim_end_matches('\r');
    if rest.starts_with('"') {
        let end = rest.strip_prefix('"')?.find('"')? + 2;
        let a = unquote(&rest[..end]);
        let b = unquote(rest[end..].trim_start());
        return Some((
            a.strip_prefix("a/").unwrap_or(&a).to_string(),
            b.strip_prefix("b/").unwrap_or(&b).to_string(),
        ));
    }
    let body = rest.strip_prefix("a/")?;
    // Prefer the split where both names are equal (the common, non-rename case).
    let candidates: Vec<usize> = body.match_indices(" b/").map(|(i, _)| i).collect();
    let pick = candidates
        .iter()
        .copied()
        .find(|&i| body[..i] == body[i + 3..])
        .or_else(|| candidates.first().copied())?;
    Some((body[..pick].to_string(), body[pick + 3..].to_string()))
}

fn parse_mode(op_line: &str, s: &str) -> Result<u32, ApiError> {
    let m = u32::from_str_radix(s.trim(), 8)
        .map_err(|_| ApiError::invalid(format!("patch: bad mode in {op_line:?}")))?;
    match m & 0o170000 {
        0o100000 | 0 => Ok(m & 0o7777),
        0o120000 => Err(ApiError::invalid(
            "patch: symlinks in patches are not supported; create them with exec",
        )),
        _ => Err(ApiError::invalid(format!(
            "patch: mode {s} is not a regular file (submodules are not supported)"
        ))),
    }
}

/// `@@ -a[,b] +c[,d] @@` → (a, b, c, d).
fn parse_hunk_header(line: &str) -> Option<(usize, usize, usize, usize)> {
    let rest = line.strip_prefix("@@ -")?;
    let end = rest.find(" @@")?;
    let mut it = rest[..end].split(" +");
    let range = |s: &str| -> Option<(usize, usize)> {
        match s.split_once(',') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => Some((s.parse().ok()?, 1)),
        }
    };
    let (a, b) = range(it.next()?)?;
    let (c, d) = range(it.next()?)?;
    Some((a, b, c, d))
}

/// Files a patch touches: their original existence and their content as the patch goes on.
#[derive(Default)]
struct PatchStates {
    map: BTreeMap<RelPath, PatchState>,
    order: Vec<RelPath>,
}

struct PatchState {
    original: bool,
    content: Option<Vec<u8>>,
    mode: Option<u32>,
}

impl PatchStates {
    /// The current content of `rel`, loaded from the workspace the first time.
    fn load(&mut self, fs: &WorkspaceFs, rel: &RelPath) -> Result<Option<&Vec<u8>>, ApiError> {
        if !self.map.contains_key(rel) {
            let content = fs.load_for_update("patch", rel)?;
            self.map.insert(
                rel.clone(),
                PatchState {
                    original: content.is_some(),
                    content,
                    mode: None,
                },
            );
            self.order.push(rel.clone());
        }
        Ok(self.map.get(rel).and_then(|s| s.content.as_ref()))
    }

    fn set(&mut self, rel: &RelPath, content: Option<Vec<u8>>, mode: Option<u32>) {
        if let Some(s) = self.map.get_mut(rel) {
            s.content = content;
            if mode.is_some() {
                s.mode = mode;
            }
        }
    }
}

fn parse_patch(text: &str) -> Result<Vec<FilePatch>, ApiError> {
    let lines: Vec<&str> = text.split('\n').collect();
    let mut files = Vec::new();
    let mut cur = Section::default();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_end_matches('\r');
        if let Some(rest) = line.strip_prefix("diff --git ") {
            if let Some(f) = std::mem::take(&mut cur).finish()? {
                files.push(f);
            }
            cur.git = true;
            cur.git_paths = git_header_paths(rest);
        } else if trimmed.starts_with("GIT binary patch") || trimmed.starts_with("Binary files ") {
            return Err(ApiError::invalid(
                "patch: binary patches are not supported; use write with base64 content",
            ));
        } else if let Some(m) = trimmed.strip_prefix("new file mode ") {
            cur.new_file = true;
            cur.mode = Some(parse_mode(trimmed, m)?);
        } else if let Some(m) = trimmed.strip_prefix("deleted file mode ") {
            cur.deleted = true;
            parse_mode(trimmed, m)?;
        } else if let Some(m) = trimmed.strip_prefix("new mode ") {
            cur.mode = Some(parse_mode(trimmed, m)?);
        } else if let Some(m) = trimmed.strip_prefix("old mode ") {
            parse_mode(trimmed, m)?;
        } else if let Some(p) = trimmed.strip_prefix("rename from ") {
            cur.rename_from = Some(unquote(p));
        } else if let Some(p) = trimmed.strip_prefix("rename to ") {
            cur.rename_to = Some(unquote(p));
        } else if trimmed.starts_with("copy from ") || trimmed.starts_with("copy to ") {
            return Err(ApiError::invalid(
                "patch: copies are not supported; add the new file instead",
            ));
        } else if let (Some(m), Some(p)) = (
            line.strip_prefix("--- "),
            lines.get(i + 1).and_then(|l| l.strip_prefix("+++ ")),
        ) {
            // A plain diff starts a new section at each ---/+++ pair; a git section takes
            // the pair as its own unless it already has one.
            if !cur.git || cur.minus.is_some() {
                files.extend(std::mem::take(&mut cur).finish()?);
            }
            cur.minus = Some(header_path(m));
            cur.plus = Some(header_path(p));
            i += 1;
        } else if line.starts_with("@@ -") {
            if !cur.is_started() {
                return Err(ApiError::invalid(format!(
                    "patch: line {}: a hunk before any file header (---/+++ or diff --git)",
                    i + 1
                )));
            }
            let header = trimmed.to_string();
            let Some((old_start, old_len, _new_start, new_len)) = parse_hunk_header(trimmed) else {
                return Err(ApiError::invalid(format!(
                    "patch: line {}: malformed hunk header {header:?}",
                    i + 1
                )));
            };
            let mut hunk = Hunk {
                header: header.clone(),
                old_start,
                old: Vec::new(),
                new: Vec::new(),
                old_no_newline: false,
                new_no_newline: false,
                context: 0,
            };
            let mut last = b' ';
            i += 1;
            while i < lines.len() {
                let l = lines[i];
                let done = hunk.old.len() >= old_len && hunk.new.len() >= new_len;
                if let Some(marker) = l.strip_prefix('\\') {
                    let _ = marker;
                    match last {
                        b'-' => hunk.old_no_newline = true,
                        b'+' => hunk.new_no_newline = true,
                        _ => {
                            hunk.old_no_newline = true;
                            hunk.new_no_newline = true;
                        }
                    }
                    i += 1;
                    continue;
                }
                if done {
                    break;
                }
                let (tag, body) = match l.as_bytes().first() {
                    Some(&t @ (b' ' | b'-' | b'+')) => (t, &l.as_bytes()[1..]),
                    // Some tools strip the space of an empty context line.
                    None => (b' ', &b""[..]),
                    Some(_) if l == "\r" => (b' ', &b""[..]),
                    Some(_) => break,
                };
                match tag {
                    b' ' => {
                        hunk.old.push(body.to_vec());
                        hunk.new.push(body.to_vec());
                        hunk.context += 1;
                    }
                    b'-' => hunk.old.push(body.to_vec()),
                    _ => hunk.new.push(body.to_vec()),
                }
                last = tag;
                i += 1;
            }
            if hunk.old.len() != old_len || hunk.new.len() != new_len {
                return Err(ApiError::invalid(format!(
                    "patch: hunk {header} is malformed: its header announces {old_len} old and {new_len} new lines but it has {} and {}",
                    hunk.old.len(),
                    hunk.new.len()
                )));
            }
            cur.hunks.push(hunk);
            continue;
        }
        i += 1;
    }
    if let Some(f) = cur.finish()? {
        files.push(f);
    }
    Ok(files)
}

/// Splits content into lines without their newlines; says whether it ends with one.
fn split_lines(content: &[u8]) -> (Vec<&[u8]>, bool) {
    if content.is_empty() {
        return (Vec::new(), true);
    }
    let ends = content.last() == Some(&b'\n');
    let body = if ends {
        &content[..content.len() - 1]
    } else {
        content
    };
    (body.split(|&b| b == b'\n').collect(), ends)
}

fn show(line: &[u8]) -> String {
    let s = String::from_utf8_lossy(line);
    let s: String = s.chars().take(200).collect();
    format!("{s:?}")
}

/// Applies hunks in order; each must match exactly, at its position or the nearest offset.
fn apply_hunks(path: &str, content: &[u8], hunks: &[Hunk]) -> Result<Vec<u8>, ApiError> {
    let (lines, ends_nl) = split_lines(content);
    let mut out: Vec<&[u8]> = Vec::new();
    let mut pos = 0usize;
    let mut final_nl = ends_nl;
    let fits = |at: usize, h: &Hunk| -> bool {
        let end = at + h.old.len();
        if end > lines.len() || !h.old.iter().zip(&lines[at..end]).all(|(a, b)| a == b) {
            return false;
        }
        // With a "no newline" marker the hunk must end the file, which must lack one; a hunk
        // ending at EOF without the marker needs a file that ends with a newline.
        if h.old_no_newline {
            end == lines.len() && !ends_nl
        } else {
            end < lines.len() || ends_nl || h.old.is_empty()
        }
    };
    for (n, h) in hunks.iter().enumerate() {
        let nominal = if h.old.is_empty() {
            h.old_start
        } else {
            h.old_start.saturating_sub(1)
        };
        // Candidates lie in pos..=hi; try the nominal position, then ever larger offsets.
        let mut found = None;
        let want = nominal.max(pos);
        if let Some(hi) = lines.len().checked_sub(h.old.len()).filter(|&hi| hi >= pos) {
            let want = want.min(hi);
            for d in 0..=(hi - pos) {
                if want + d <= hi && fits(want + d, h) {
                    found = Some(want + d);
                    break;
                }
                if d > 0 && want >= pos + d && fits(want - d, h) {
                    found = Some(want - d);
                    break;
                }
                if want + d > hi && want < pos + d {
                    break;
                }
            }
        }
        let Some(at) = found else {
            return Err(hunk_failure(path, n + 1, h, &lines, want, ends_nl));
        };
        out.extend_from_slice(&lines[pos..at]);
        out.extend(h.new.iter().map(Vec::as_slice));
        pos = at + h.old.len();
        if pos == lines.len() {
            final_nl = h.new.is_empty() || !h.new_no_newline;
        }
    }
    out.extend_from_slice(&lines[pos..]);
    let mut result = out.join(&b'\n');
    if final_nl && !out.is_empty() {
        result.push(b'\n');
    }
    Ok(result)
}

fn hunk_failure(
    path: &str,
    n: usize,
    h: &Hunk,
    lines: &[&[u8]],
    want: usize,
    ends_nl: bool,
) -> ApiError {
    let head = format!("patch: {path}: hunk {n} ({}) does not apply", h.header);
    for (k, expected) in h.old.iter().enumerate() {
        match lines.get(want + k) {
            Some(found) if found == expected => {}
            Some(found) => {
                return ApiError::PatchFailed(format!(
                    "{head}: expected line {} {}, found {}",
                    want + k + 1,
                    show(expected),
                    show(found)
                ));
            }
            None => {
                return ApiError::PatchFailed(format!(
                    "{head}: expected line {} {}, found the end of the file ({} lines)",
                    want + k + 1,
                    show(expected),
                    lines.len()
                ));
            }
        }
    }
    let why = if h.old_no_newline && ends_nl {
        "the hunk expects no newline at the end of the file, but the file has one"
    } else if !h.old_no_newline && !ends_nl {
        "the hunk expects a newline at the end of the file, but the file has none"
    } else {
        "its lines were not found in order after the previous hunk"
    };
    ApiError::PatchFailed(format!("{head}: {why}"))
}

/// The patch parser alone, for the comparison harness in `bench/parsers` (ours against the
/// diff-parsing libraries): not an API, its shape follows the parser's.
#[doc(hidden)]
pub mod patch_parser {
    use super::ApiError;

    /// One file's section as the parser read it.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct ParsedFile {
        /// `None` for an added file (`/dev/null`, `new file mode`).
        pub old_path: Option<String>,
        /// `None` for a deleted file.
        pub new_path: Option<String>,
        pub mode: Option<u32>,
        pub hunks: usize,
        /// Lines the hunks add and remove.
        pub added: usize,
        pub removed: usize,
        /// A hunk says "\ No newline at end of file" of the old or the new side.
        pub old_no_newline: bool,
        pub new_no_newline: bool,
    }

    /// Parses a patch as [`super::WorkspaceFs::patch`] does, without touching any file.
    pub fn parse(text: &str) -> Result<Vec<ParsedFile>, ApiError> {
        Ok(super::parse_patch(text)?
            .into_iter()
            .map(|f| {
                let added = f.hunks.iter().map(|h| h.new.len()).sum::<usize>();
                let removed = f.hunks.iter().map(|h| h.old.len()).sum::<usize>();
                let context = f.hunks.iter().map(|h| h.context).sum::<usize>();
                ParsedFile {
                    old_path: f.old_path,
                    new_path: f.new_path,
                    mode: f.mode,
                    hunks: f.hunks.len(),
                    added: added - context,
                    removed: removed - context,
                    old_no_newline: f.hunks.iter().any(|h| h.old_no_newline),
                    new_no_newline: f.hunks.iter().any(|h| h.new_no_newline),
                }
            })
            .collect())
    }

    /// Parses a one-file patch and applies it to `content` in memory, as `patch` would.
    pub fn apply(text: &str, content: &[u8]) -> Result<Vec<u8>, ApiError> {
        let files = super::parse_patch(text)?;
        let [file] = files.as_slice() else {
            return Err(ApiError::invalid(format!(
                "patch: {} file sections, one expected",
                files.len()
            )));
        };
        let label = file.new_path.as_deref().or(file.old_path.as_deref());
        super::apply_hunks(label.unwrap_or_default(), content, &file.hunks)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    const SECRET: &str = "TOP-SECRET-outside-the-workspace\n";

    /// A workspace root beside a directory `outside` holding a secret.
    struct Ws {
        _base: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
        fs: WorkspaceFs,
    }

    fn ws() -> Ws {
        let base = tempfile::tempdir().unwrap();
        let root = base.path().join("ws");
        let outside = base.path().join("outside");
        std::fs::create_dir_all(root.join("src")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret.txt"), SECRET).unwrap();
        std::fs::write(
            root.join("src/lib.rs"),
            "fn one() {}\nfn two() {}\nfn three() {}\n",
        )
        .unwrap();
        std::fs::write(root.join("README.md"), "hello\nworld\n").unwrap();
        let fs = WorkspaceFs::open(&root).unwrap();
        Ws {
            _base: base,
            root,
            outside,
            fs,
        }
    }

    /// Plants symlinks out of the workspace, a fifo and a socket; with `hard`, a hard link to
    /// the outside secret.
    fn plant(w: &Ws, hard: bool) {
        let secret = w.outside.join("secret.txt");
        symlink(&secret, w.root.join("abs_link")).unwrap();
        symlink("../outside/secret.txt", w.root.join("rel_link")).unwrap();
        symlink(&w.outside, w.root.join("dir_link")).unwrap();
        symlink("../outside", w.root.join("rel_dir_link")).unwrap();
        symlink("/etc/passwd", w.root.join("passwd")).unwrap();
        symlink("/", w.root.join("slash")).unwrap();
        nix::unistd::mkfifo(&w.root.join("fifo"), Mode::from_bits_truncate(0o644)).unwrap();
        let sock = std::os::unix::net::UnixListener::bind(w.root.join("sock")).unwrap();
        std::mem::forget(sock);
        if hard {
            std::fs::hard_link(&secret, w.root.join("hard")).unwrap();
        }
    }

    /// Paths that must not reach the secret.
    fn hostile(w: &Ws) -> Vec<String> {
        vec![
            "abs_link".into(),
            "rel_link".into(),
            "dir_link/secret.txt".into(),
            "rel_dir_link/secret.txt".into(),
            "slash/etc/passwd".into(),
            "passwd".into(),
            "../outside/secret.txt".into(),
            "src/../../outside/secret.txt".into(),
            format!("{}", w.outside.join("secret.txt").display()),
            "/etc/passwd".into(),
        ]
    }

    fn assert_outside_untouched(w: &Ws) {
        let names: Vec<_> = std::fs::read_dir(&w.outside)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret.txt"], "nothing may appear outside");
        assert_eq!(
            std::fs::read_to_string(w.outside.join("secret.txt")).unwrap(),
            SECRET
        );
    }

    fn assert_no_secret(what: &impl std::fmt::Debug) {
        let s = format!("{what:?}");
        assert!(!s.contains("TOP-SECRET"), "secret leaked: {s}");
        assert!(!s.contains("root:x:0"), "host file leaked: {s}");
    }

    /// Runs `f` on a fresh handle of `root` in a thread and fails if it blocks.
    fn within<T: Send + 'static>(
        root: &Path,
        f: impl FnOnce(WorkspaceFs) -> T + Send + 'static,
    ) -> T {
        let fs = WorkspaceFs::open(root).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f(fs));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the operation blocked")
    }

    /// Makes /dev/null- and /dev/zero-like nodes in the root, if allowed.
    fn make_devices(root: &Path) -> bool {
        let ok = [("null", 3), ("zero", 5)].iter().all(|(name, minor)| {
            nix::sys::stat::mknod(
                &root.join(name),
                nix::sys::stat::SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, *minor),
            )
            .is_ok()
        });
        if !ok {
            assert!(
                std::env::var("TASKBOX_REQUIRE_ALL").as_deref() != Ok("1"),
                "device node tests need CAP_MKNOD"
            );
            eprintln!("skipping device node cases: mknod is not permitted here");
        }
        ok
    }

    fn read(w: &Ws, path: &str) -> Result<ReadResult, ApiError> {
        w.fs.read(&ReadRequest {
            path: path.into(),
            ..Default::default()
        })
    }

    fn write(w: &Ws, path: &str, content: &str) -> Result<WriteResult, ApiError> {
        w.fs.write(&WriteRequest {
            path: path.into(),
            content: content.into(),
            ..Default::default()
        })
    }

    fn edit(w: &Ws, path: &str, old: &str, new: &str) -> Result<EditResult, ApiError> {
        w.fs.edit(&EditRequest {
            path: path.into(),
            old: old.into(),
            new: new.into(),
            expected_count: None,
        })
    }

    fn patch(w: &Ws, p: &str) -> Result<PatchResult, ApiError> {
        w.fs.patch(&PatchRequest { patch: p.into() })
    }

    fn list(w: &Ws, req: ListRequest) -> Vec<String> {
        w.fs.list(&req)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.path)
            .collect()
    }

    fn content(w: &Ws, path: &str) -> String {
        std::fs::read_to_string(w.root.join(path)).unwrap()
    }

    fn no_temp_files(w: &Ws) {
        for e in walk_host(&w.root) {
            assert!(!e.contains(".taskbox-tmp-"), "temporary file left: {e}");
        }
    }

    fn walk_host(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            out.push(e.path().display().to_string());
            if e.file_type().unwrap().is_dir() {
                out.extend(walk_host(&e.path()));
            }
        }
        out
    }

    // ---- paths ---------------------------------------------------------------------------

    #[test]
    fn a_write_asks_the_kernel_about_the_file_it_replaces() {
        use std::os::unix::fs::PermissionsExt;
        let w = ws();
        std::fs::write(w.root.join("ro.txt"), "keep\n").unwrap();
        std::fs::set_permissions(
            w.root.join("ro.txt"),
            std::fs::Permissions::from_mode(0o444),
        )
        .unwrap();
        let r = write(&w, "ro.txt", "over\n");
        if nix::unistd::geteuid().is_root() {
            // Root's capabilities override the mode: the kit runs this as the sandbox's user.
            assert!(r.is_ok(), "{r:?}");
        } else {
            assert!(matches!(r, Err(ApiError::PermissionDenied(_))), "{r:?}");
            assert_eq!(
                std::fs::read_to_string(w.root.join("ro.txt")).unwrap(),
                "keep\n"
            );
        }
        // A program running now may not be opened for writing, but may be replaced, as an
        // install replaces it.
        std::fs::copy("/bin/sleep", w.root.join("sleep")).unwrap();
        let mut child = std::process::Command::new(w.root.join("sleep"))
            .arg("5")
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let r = write(&w, "sleep", "#!/bin/sh\n");
        let _ = child.kill();
        let _ = child.wait();
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(
            std::fs::read_to_string(w.root.join("sleep")).unwrap(),
            "#!/bin/sh\n"
        );
        no_temp_files(&w);
    }

    #[test]
    fn fsops_paths_are_normalised_and_checked() {
        let w = ws();
        assert_eq!(read(&w, "./src/./lib.rs").unwrap().path, "src/lib.rs");
        assert_eq!(read(&w, "src/../README.md").unwrap().path, "README.md");
        assert!(matches!(read(&w, ""), Err(ApiError::InvalidArgument(_))));
        assert!(matches!(
            read(&w, "a\0b"),
            Err(ApiError::InvalidArgument(_))
        ));
        let e = read(&w, "../x").unwrap_err();
        assert!(matches!(&e, ApiError::PathRefused(m) if m.contains("escapes the workspace")));
        let e = read(&w, "/src/lib.rs").unwrap_err();
        assert!(matches!(&e, ApiError::PathRefused(m) if m.contains("/src/lib.rs")));
        let e = read(&w, "missing.txt").unwrap_err();
        assert!(matches!(&e, ApiError::NotFound(m) if m.contains("missing.txt does not exist")));
    }

    #[test]
    fn fsops_absolute_paths_under_the_mount_path() {
        let w = ws();
        let fs = WorkspaceFs::open(&w.root)
            .unwrap()
            .with_mount_path(PathBuf::from("/home/u/repo"));
        let r = fs
            .read(&ReadRequest {
                path: "/home/u/repo/src/lib.rs".into(),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.path, "src/lib.rs");
        for bad in [
            "/home/u/repo2/src/lib.rs",
            "/etc/passwd",
            "/home/u/repo/../x",
        ] {
            let e = fs
                .read(&ReadRequest {
                    path: bad.into(),
                    ..Default::default()
                })
                .unwrap_err();
            assert!(matches!(e, ApiError::PathRefused(_)), "{bad}: {e}");
        }
    }

    // ---- read ----------------------------------------------------------------------------

    #[test]
    fn fsops_read_text_ranges_and_binary() {
        let w = ws();
        let r = read(&w, "src/lib.rs").unwrap();
        assert_eq!(r.content, "fn one() {}\nfn two() {}\nfn three() {}\n");
        assert_eq!(
            (r.encoding.as_str(), r.binary, r.truncated),
            ("utf-8", false, false)
        );
        assert_eq!((r.total_bytes, r.total_lines), (38, Some(3)));

        let lines = |s, e| {
            w.fs.read(&ReadRequest {
                path: "src/lib.rs".into(),
                line_start: s,
                line_end: e,
                ..Default::default()
            })
        };
        assert_eq!(lines(Some(2), Some(2)).unwrap().content, "fn two() {}\n");
        assert_eq!(
            lines(Some(2), None).unwrap().content,
            "fn two() {}\nfn three() {}\n"
        );
        assert_eq!(lines(None, Some(1)).unwrap().content, "fn one() {}\n");
        assert_eq!(lines(Some(9), None).unwrap().content, "");
        assert!(matches!(
            lines(Some(0), None),
            Err(ApiError::InvalidArgument(_))
        ));
        assert!(matches!(
            lines(Some(3), Some(2)),
            Err(ApiError::InvalidArgument(_))
        ));

        let r =
            w.fs.read(&ReadRequest {
                path: "src/lib.rs".into(),
                offset: Some(3),
                length: Some(3),
                ..Default::default()
            })
            .unwrap();
        assert_eq!((r.content.as_str(), r.total_lines), ("one", Some(3)));
        let both = w.fs.read(&ReadRequest {
            path: "src/lib.rs".into(),
            offset: Some(1),
            line_start: Some(1),
            ..Default::default()
        });
        assert!(matches!(both, Err(ApiError::InvalidArgument(_))));

        // max_bytes cuts, never inside a UTF-8 character.
        std::fs::write(w.root.join("u.txt"), "aé€x").unwrap();
        let r =
            w.fs.read(&ReadRequest {
                path: "u.txt".into(),
                max_bytes: Some(4),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(
            (r.content.as_str(), r.truncated, r.binary),
            ("aé", true, false)
        );

        std::fs::write(w.root.join("bin"), b"\x7fELF\0\x01\x02").unwrap();
        let r = read(&w, "bin").unwrap();
        assert!(r.binary);
        assert_eq!((r.encoding.as_str(), r.total_lines), ("base64", None));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&r.content)
            .unwrap();
        assert_eq!(raw, b"\x7fELF\0\x01\x02");
        std::fs::write(w.root.join("latin1"), b"caf\xe9\n").unwrap();
        assert!(read(&w, "latin1").unwrap().binary);

        // A large file streams: counted lines, capped content.
        let big = "0123456789\n".repeat(100_000);
        std::fs::write(w.root.join("big.txt"), &big).unwrap();
        let r = read(&w, "big.txt").unwrap();
        assert_eq!((r.total_lines, r.truncated), (Some(100_000), true));
        assert_eq!(r.content.len() as u64, DEFAULT_MAX_BYTES);
        let r =
            w.fs.read(&ReadRequest {
                path: "big.txt".into(),
                line_start: Some(99_999),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.content, "0123456789\n0123456789\n");
    }

    #[test]
    fn fsops_read_hostile() {
        let w = ws();
        plant(&w, false);
        for p in hostile(&w) {
            let r = read(&w, &p);
            assert!(r.is_err(), "{p}: {r:?}");
            assert_no_secret(&r);
        }
        let e = within(&w.root, |fs| {
            fs.read(&ReadRequest {
                path: "fifo".into(),
                ..Default::default()
            })
        })
        .unwrap_err();
        assert!(
            matches!(&e, ApiError::PathRefused(m) if m.contains("fifo")),
            "{e}"
        );
        let e = read(&w, "sock").unwrap_err();
        assert!(e.to_string().contains("socket"), "{e}");
        let e = read(&w, "src").unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        if make_devices(&w.root) {
            for dev in ["null", "zero"] {
                let e = within(&w.root, move |fs| {
                    fs.read(&ReadRequest {
                        path: dev.into(),
                        ..Default::default()
                    })
                })
                .unwrap_err();
                assert!(e.to_string().contains("character device"), "{e}");
            }
        }
        assert_outside_untouched(&w);
    }

    // ---- write ---------------------------------------------------------------------------

    #[test]
    fn fsops_write_creates_replaces_and_keeps_mode() {
        let w = ws();
        let r = write(&w, "new.txt", "hi\n").unwrap();
        assert!(r.created);
        assert_eq!(r.bytes_written, 3);
        let mode = std::fs::metadata(w.root.join("new.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o644);

        std::fs::set_permissions(w.root.join("new.txt"), PermissionsExt::from_mode(0o755)).unwrap();
        let r = write(&w, "new.txt", "again\n").unwrap();
        assert!(!r.created);
        assert_eq!(content(&w, "new.txt"), "again\n");
        let mode = std::fs::metadata(w.root.join("new.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "an existing file keeps its mode");

        let e = write(&w, "a/b/c.txt", "x").unwrap_err();
        assert!(matches!(e, ApiError::NotFound(_)), "{e}");
        w.fs.write(&WriteRequest {
            path: "a/b/c.txt".into(),
            content: base64::engine::general_purpose::STANDARD.encode(b"\0\x01"),
            encoding: Some("base64".into()),
            create_parents: true,
            mode: Some(0o600),
        })
        .unwrap();
        assert_eq!(std::fs::read(w.root.join("a/b/c.txt")).unwrap(), b"\0\x01");
        let mode = std::fs::metadata(w.root.join("a/b/c.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o600);

        let e =
            w.fs.write(&WriteRequest {
                path: "x".into(),
                content: "!!".into(),
                encoding: Some("base64".into()),
                ..Default::default()
            })
            .unwrap_err();
        assert!(matches!(e, ApiError::InvalidArgument(_)));
        let e = write(&w, "src", "x").unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        assert!(matches!(write(&w, ".", "x"), Err(ApiError::PathRefused(_))));
        no_temp_files(&w);
    }

    #[test]
    fn fsops_write_hostile() {
        let w = ws();
        plant(&w, true);
        // `slash` -> `/` resolves to the root itself, so this lands inside the workspace.
        let inside = |p: &String| !p.starts_with("slash/");
        for p in hostile(&w).into_iter().filter(inside) {
            for create_parents in [false, true] {
                let r = w.fs.write(&WriteRequest {
                    path: p.clone(),
                    content: "pwned\n".into(),
                    create_parents,
                    ..Default::default()
                });
                assert!(r.is_err(), "{p}: {r:?}");
            }
        }
        w.fs.write(&WriteRequest {
            path: "slash/etc/passwd".into(),
            content: "pwned\n".into(),
            create_parents: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(content(&w, "etc/passwd"), "pwned\n");
        write(&w, "slash/src/via_slash.txt", "in\n").unwrap();
        assert_eq!(content(&w, "src/via_slash.txt"), "in\n");
        assert!(
            !std::fs::read_to_string("/etc/passwd")
                .unwrap_or_default()
                .contains("pwned")
        );
        let e = write(&w, "abs_link", "x").unwrap_err();
        assert!(
            matches!(&e, ApiError::PathRefused(m) if m.contains("symlink")),
            "{e}"
        );
        for p in ["dir_link/new.txt", "rel_dir_link/new.txt"] {
            let r = w.fs.write(&WriteRequest {
                path: p.into(),
                content: "x".into(),
                create_parents: true,
                ..Default::default()
            });
            assert!(r.is_err(), "{p}: {r:?}");
        }
        let e = within(&w.root, |fs| {
            fs.write(&WriteRequest {
                path: "fifo".into(),
                content: "x".into(),
                ..Default::default()
            })
        })
        .unwrap_err();
        assert!(e.to_string().contains("fifo"), "{e}");
        assert!(write(&w, "sock", "x").is_err());
        if make_devices(&w.root) {
            assert!(write(&w, "null", "x").is_err());
        }
        // The hard link is replaced by the rename; the outside inode keeps its content.
        write(&w, "hard", "replaced\n").unwrap();
        assert_eq!(content(&w, "hard"), "replaced\n");
        assert_outside_untouched(&w);
        no_temp_files(&w);
    }

    // ---- edit ----------------------------------------------------------------------------

    #[test]
    fn fsops_edit_replaces_and_explains_failures() {
        let w = ws();
        let r = edit(&w, "src/lib.rs", "fn two() {}", "fn two() { 2 }").unwrap();
        assert_eq!(r.replacements, 1);
        assert!(
            r.diff.starts_with("--- a/src/lib.rs\n+++ b/src/lib.rs\n"),
            "{}",
            r.diff
        );
        assert!(
            r.diff.contains("-fn two() {}\n+fn two() { 2 }\n"),
            "{}",
            r.diff
        );
        assert_eq!(
            content(&w, "src/lib.rs"),
            "fn one() {}\nfn two() { 2 }\nfn three() {}\n"
        );

        let e = edit(&w, "src/lib.rs", "fn four()", "x").unwrap_err();
        let ApiError::EditNotFound(m) = &e else {
            panic!("{e:?}")
        };
        assert!(
            m.starts_with("edit src/lib.rs: the old text was not found (0 matches)"),
            "{m}"
        );
        assert!(m.contains("including whitespace"), "{m}");

        let e = edit(&w, "src/lib.rs", "fn  three()   {}", "x").unwrap_err();
        assert!(
            e.to_string()
                .contains("differs only in whitespace starts at line 3"),
            "{e}"
        );

        std::fs::write(w.root.join("m.txt"), "x\nfoo\nx\nx\nfoo\nfoo\n").unwrap();
        let e = edit(&w, "m.txt", "foo", "bar").unwrap_err();
        let ApiError::EditAmbiguous(m) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(
            m,
            "edit m.txt: the old text is ambiguous: 3 matches at lines 2, 5, 6; include more surrounding lines or set expected_count to 3"
        );
        let e =
            w.fs.edit(&EditRequest {
                path: "m.txt".into(),
                old: "foo".into(),
                new: "bar".into(),
                expected_count: Some(4),
            })
            .unwrap_err();
        assert!(matches!(&e, ApiError::EditNotFound(m) if m.contains("found 3 at lines 2, 5, 6")));
        let r =
            w.fs.edit(&EditRequest {
                path: "m.txt".into(),
                old: "foo".into(),
                new: "bar".into(),
                expected_count: Some(3),
            })
            .unwrap();
        assert_eq!(r.replacements, 3);
        assert_eq!(content(&w, "m.txt"), "x\nbar\nx\nx\nbar\nbar\n");

        assert!(matches!(
            edit(&w, "m.txt", "", "x"),
            Err(ApiError::InvalidArgument(_))
        ));
        std::fs::write(w.root.join("bin"), b"\xff\xfe").unwrap();
        assert!(matches!(
            edit(&w, "bin", "a", "b"),
            Err(ApiError::InvalidArgument(_))
        ));
        assert!(matches!(
            edit(&w, "nope", "a", "b"),
            Err(ApiError::NotFound(_))
        ));
        no_temp_files(&w);
    }

    #[test]
    fn fsops_edit_hostile() {
        let w = ws();
        plant(&w, true);
        for p in hostile(&w) {
            let r = edit(&w, &p, "TOP-SECRET", "pwned");
            assert!(r.is_err(), "{p}: {r:?}");
            assert_no_secret(&r);
        }
        let e = within(&w.root, |fs| {
            fs.edit(&EditRequest {
                path: "fifo".into(),
                old: "a".into(),
                new: "b".into(),
                expected_count: None,
            })
        })
        .unwrap_err();
        assert!(e.to_string().contains("fifo"), "{e}");
        if make_devices(&w.root) {
            assert!(edit(&w, "zero", "a", "b").is_err());
        }
        // Inside by inode: the edit replaces the link, the outside file stays as it was.
        edit(&w, "hard", "TOP-SECRET", "edited").unwrap();
        assert!(content(&w, "hard").starts_with("edited"));
        assert_outside_untouched(&w);
    }

    #[test]
    fn fsops_concurrent_edits_never_tear_a_file() {
        let w = ws();
        std::fs::write(w.root.join("c.txt"), "a=0\nb=0\n").unwrap();
        let fs = Arc::new(WorkspaceFs::open(&w.root).unwrap());
        let rounds = 150;
        let editors: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|key| {
                let fs = Arc::clone(&fs);
                std::thread::spawn(move || {
                    for i in 0..rounds {
                        fs.edit(&EditRequest {
                            path: "c.txt".into(),
                            old: format!("{key}={i}\n"),
                            new: format!("{key}={}\n", i + 1),
                            expected_count: None,
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        let path = w.root.join("c.txt");
        let valid = |s: &str| {
            let lines: Vec<&str> = s.split_terminator('\n').collect();
            s.ends_with('\n')
                && lines.len() == 2
                && lines[0]
                    .strip_prefix("a=")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
                && lines[1]
                    .strip_prefix("b=")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
        };
        while editors.iter().any(|t| !t.is_finished()) {
            let s = std::fs::read_to_string(&path).unwrap();
            assert!(valid(&s), "torn file: {s:?}");
        }
        for t in editors {
            t.join().unwrap();
        }
        assert_eq!(content(&w, "c.txt"), format!("a={rounds}\nb={rounds}\n"));
        no_temp_files(&w);
    }

    // ---- patch ---------------------------------------------------------------------------

    #[test]
    fn fsops_patch_modifies_adds_deletes_and_renames() {
        let w = ws();
        std::fs::write(w.root.join("gone.txt"), "bye\n").unwrap();
        std::fs::write(w.root.join("old_name.txt"), "keep\nme\n").unwrap();
        let p = "\
diff --git a/src/lib.rs b/src/lib.rs
index 1111111..2222222 100644
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -2,2 +2,3 @@
 fn two() {}
+fn two_and_a_half() {}
 fn three() {}
diff --git a/new/file.sh b/new/file.sh
new file mode 100755
--- /dev/null
+++ b/new/file.sh
@@ -0,0 +1,2 @@
+#!/bin/sh
+echo hi
\\ No newline at end of file
diff --git a/gone.txt b/gone.txt
deleted file mode 100644
--- a/gone.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
diff --git a/old_name.txt b/new_name.txt
similarity index 60%
rename from old_name.txt
rename to new_name.txt
--- a/old_name.txt
+++ b/new_name.txt
@@ -1,2 +1,2 @@
 keep
-me
+you
";
        let r = patch(&w, p).unwrap();
        let got: Vec<(String, ChangeKind)> =
            r.files.into_iter().map(|c| (c.path, c.kind)).collect();
        assert_eq!(
            got,
            [
                ("src/lib.rs".to_string(), ChangeKind::Modified),
                ("new/file.sh".to_string(), ChangeKind::Added),
                ("gone.txt".to_string(), ChangeKind::Deleted),
                ("old_name.txt".to_string(), ChangeKind::Deleted),
                ("new_name.txt".to_string(), ChangeKind::Added),
            ]
        );
        assert_eq!(
            content(&w, "src/lib.rs"),
            "fn one() {}\nfn two() {}\nfn two_and_a_half() {}\nfn three() {}\n"
        );
        assert_eq!(content(&w, "new/file.sh"), "#!/bin/sh\necho hi");
        let mode = std::fs::metadata(w.root.join("new/file.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
        assert!(!w.root.join("gone.txt").exists());
        assert!(!w.root.join("old_name.txt").exists());
        assert_eq!(content(&w, "new_name.txt"), "keep\nyou\n");
        no_temp_files(&w);
    }

    #[test]
    fn fsops_patch_parser_hook_reads_as_patch_does() {
        let p = "--- a/x\n+++ b/x\n@@ -1,3 +1,4 @@\n one\n-two\n+2\n+2b\n three\n";
        let files = patch_parser::parse(p).unwrap();
        assert_eq!(files.len(), 1);
        let f = &files[0];
        assert_eq!((f.hunks, f.added, f.removed), (1, 2, 1));
        assert_eq!(
            (f.old_path.as_deref(), f.new_path.as_deref()),
            (Some("x"), Some("x"))
        );
        assert_eq!(
            patch_parser::apply(p, b"one\ntwo\nthree\n").unwrap(),
            b"one\n2\n2b\nthree\n"
        );
        assert!(patch_parser::apply(p, b"one\nTWO\nthree\n").is_err());
    }

    #[test]
    fn fsops_patch_offsets_and_newline_markers() {
        let w = ws();
        let body: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        std::fs::write(w.root.join("f.txt"), format!("{body}last")).unwrap();
        // Both hunks claim positions 5 lines too early; the end has no newline.
        let p = "\
--- f.txt
+++ f.txt
@@ -3,3 +3,3 @@
 line 8
-line 9
+line nine
 line 10
@@ -16,2 +16,2 @@
 line 20
-last
\\ No newline at end of file
+last
";
        patch(&w, p).unwrap();
        let want = body.replace("line 9\n", "line nine\n") + "last\n";
        assert_eq!(content(&w, "f.txt"), want);

        // A hunk expecting no newline does not apply to a file that has one.
        let p = "\
--- a/f.txt
+++ b/f.txt
@@ -21 +21 @@
-last
\\ No newline at end of file
+end
";
        let e = patch(&w, p).unwrap_err();
        assert!(matches!(e, ApiError::PatchFailed(_)), "{e}");
    }

    #[test]
    fn fsops_patch_is_all_or_nothing() {
        let w = ws();
        std::fs::write(w.root.join("b.txt"), "alpha\nbeta\ngamma\n").unwrap();
        let p = "\
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -1,1 +1,1 @@
-fn one() {}
+fn uno() {}
--- /dev/null
+++ b/added.txt
@@ -0,0 +1 @@
+new
--- a/b.txt
+++ b/b.txt
@@ -1,1 +1,1 @@
-alpha
+ALPHA
@@ -2,2 +2,2 @@
 beta
-delta
+DELTA
";
        let e = patch(&w, p).unwrap_err();
        let ApiError::PatchFailed(m) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(
            m,
            "patch: b.txt: hunk 2 (@@ -2,2 +2,2 @@) does not apply: expected line 3 \"delta\", found \"gamma\""
        );
        assert_eq!(
            content(&w, "src/lib.rs"),
            "fn one() {}\nfn two() {}\nfn three() {}\n"
        );
        assert_eq!(content(&w, "b.txt"), "alpha\nbeta\ngamma\n");
        assert!(!w.root.join("added.txt").exists());

        let e = patch(&w, "--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+x\n").unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        let e = patch(&w, "--- a/nope\n+++ b/nope\n@@ -1 +1 @@\n-a\n+b\n").unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let bin = "diff --git a/x.png b/x.png\nGIT binary patch\nliteral 5\n";
        assert!(patch(&w, bin).unwrap_err().to_string().contains("binary"));
        let big = "x".repeat(MAX_PATCH_BYTES + 1);
        assert!(matches!(patch(&w, &big), Err(ApiError::TooLarge(_))));
        assert!(matches!(
            patch(&w, "just words\n"),
            Err(ApiError::InvalidArgument(_))
        ));
        let short = "--- a/b.txt\n+++ b/b.txt\n@@ -1,3 +1,3 @@\n alpha\n";
        assert!(matches!(
            patch(&w, short),
            Err(ApiError::InvalidArgument(_))
        ));
        no_temp_files(&w);
    }

    #[test]
    fn fsops_a_refused_patch_leaves_no_directory_behind() {
        let w = ws();
        // The same path as a file and as the directory of another file.
        let p = "\
--- /dev/null
+++ b/new/deep/file.txt
@@ -0,0 +1 @@
+x
--- /dev/null
+++ b/new/deep
@@ -0,0 +1 @@
+y
";
        let e = patch(&w, p).unwrap_err();
        assert!(
            e.to_string()
                .contains("new/deep would be a file and also the directory of new/deep/file.txt"),
            "{e}"
        );
        assert!(!w.root.join("new").exists());
        // A write into a new directory that fails after making it (a name too long for the
        // file system), by patch and by write: the directory goes again.
        let long = "n".repeat(300);
        let p = format!(
            "--- /dev/null\n+++ b/made/ok.txt\n@@ -0,0 +1 @@\n+x\n--- /dev/null\n+++ b/also/{long}/f\n@@ -0,0 +1 @@\n+x\n"
        );
        let e = patch(&w, &p).unwrap_err();
        assert!(!w.root.join("made").exists(), "{e}");
        assert!(!w.root.join("also").exists(), "{e}");
        let e =
            w.fs.write(&WriteRequest {
                path: format!("fresh/{long}/f"),
                content: "x".into(),
                create_parents: true,
                ..Default::default()
            })
            .unwrap_err();
        assert!(!w.root.join("fresh").exists(), "{e}");
        no_temp_files(&w);
    }

    #[test]
    fn fsops_patch_hostile() {
        let w = ws();
        plant(&w, true);
        let good = "--- a/src/lib.rs\n+++ b/src/lib.rs\n@@ -1 +1 @@\n-fn one() {}\n+fn uno() {}\n";
        // `slash/etc/passwd` lands inside the root (tested with write).
        let mut targets: Vec<String> = hostile(&w)
            .into_iter()
            .filter(|p| !p.starts_with("slash/"))
            .collect();
        targets.push("fifo".into());
        targets.push("sock".into());
        for t in targets {
            for p in [
                format!("--- /dev/null\n+++ {t}\n@@ -0,0 +1 @@\n+pwned\n"),
                format!(
                    "--- {t}\n+++ {t}\n@@ -1 +1 @@\n-TOP-SECRET-outside-the-workspace\n+pwned\n"
                ),
                format!(
                    "diff --git a/{t} b/{t}\ndeleted file mode 100644\n--- a/{t}\n+++ /dev/null\n@@ -1 +0,0 @@\n-TOP-SECRET-outside-the-workspace\n"
                ),
            ] {
                let all = format!("{good}{p}");
                let r = within(&w.root, move |fs| fs.patch(&PatchRequest { patch: all }));
                assert!(r.is_err(), "{t}: {r:?}");
                assert_no_secret(&r);
            }
        }
        let e = patch(
            &w,
            &format!("{good}--- /dev/null\n+++ b/../escape\n@@ -0,0 +1 @@\n+x\n"),
        )
        .unwrap_err();
        assert!(matches!(e, ApiError::PathRefused(_)), "{e}");
        let sym = "diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc/shadow\n\\ No newline at end of file\n";
        assert!(patch(&w, sym).is_err());
        assert!(!w.root.join("l").exists());
        assert!(!w.base_parent().join("escape").exists());
        assert_eq!(
            content(&w, "src/lib.rs"),
            "fn one() {}\nfn two() {}\nfn three() {}\n"
        );
        // Through the hard link: the link is replaced, not written through.
        patch(
            &w,
            "--- a/hard\n+++ b/hard\n@@ -1 +1 @@\n-TOP-SECRET-outside-the-workspace\n+mine\n",
        )
        .unwrap();
        assert_eq!(content(&w, "hard"), "mine\n");
        assert_outside_untouched(&w);
        no_temp_files(&w);
    }

    impl Ws {
        fn base_parent(&self) -> PathBuf {
            self.root.parent().unwrap().to_path_buf()
        }
    }

    // ---- list ----------------------------------------------------------------------------

    #[test]
    fn fsops_list_reads_ignore_files_within_a_bound() {
        // One large ignore file hard-linked into 300 directories (no space used) was read and
        // built into a matcher in each: seconds of the supervisor's time per listing.
        let w = ws();
        let dirs: Vec<String> = (0..300).map(|n| format!("d{n:03}")).collect();
        crate::testutil::linked_ignore_files(&w.root, &dirs);
        for dir in &dirs {
            std::fs::write(w.root.join(dir).join("a.tmp"), "").unwrap();
        }
        let t = std::time::Instant::now();
        let listed = list(
            &w,
            ListRequest {
                glob: Some("**/*.tmp".into()),
                max_depth: Some(3),
                ..Default::default()
            },
        );
        let took = t.elapsed();
        // The first file is read whole, the second up to the bound (its first line still in);
        // the rest have no rules, so what they would hide is listed.
        assert_eq!(listed.len(), 298, "{listed:?}");
        assert!(!listed.contains(&"d000/a.tmp".to_owned()));
        assert!(!listed.contains(&"d001/a.tmp".to_owned()));
        assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
    }

    #[test]
    fn fsops_list_respects_gitignore_hidden_glob_and_depth() {
        let w = ws();
        std::fs::write(w.root.join(".gitignore"), "target/\n*.log\n!keep.log\n").unwrap();
        std::fs::create_dir_all(w.root.join("target/debug")).unwrap();
        std::fs::write(w.root.join("target/debug/x"), "").unwrap();
        std::fs::write(w.root.join("a.log"), "").unwrap();
        std::fs::write(w.root.join("keep.log"), "").unwrap();
        std::fs::create_dir_all(w.root.join("src/sub")).unwrap();
        std::fs::write(w.root.join("src/sub/.gitignore"), "gen.rs\n").unwrap();
        std::fs::write(w.root.join("src/sub/gen.rs"), "").unwrap();
        std::fs::write(w.root.join("src/sub/mod.rs"), "").unwrap();
        std::fs::create_dir_all(w.root.join(".git/info")).unwrap();
        std::fs::write(w.root.join(".git/info/exclude"), "secret.env\n").unwrap();
        std::fs::write(w.root.join(".git/HEAD"), "ref").unwrap();
        std::fs::write(w.root.join("secret.env"), "").unwrap();

        let top = list(&w, ListRequest::default());
        assert_eq!(top, ["README.md", "keep.log", "src"]);
        let all = list(
            &w,
            ListRequest {
                max_depth: Some(10),
                ..Default::default()
            },
        );
        assert_eq!(
            all,
            [
                "README.md",
                "keep.log",
                "src",
                "src/lib.rs",
                "src/sub",
                "src/sub/mod.rs"
            ]
        );
        let rs = list(
            &w,
            ListRequest {
                glob: Some("**/*.rs".into()),
                ..Default::default()
            },
        );
        assert_eq!(rs, ["src/lib.rs", "src/sub/mod.rs"]);
        let sub = list(
            &w,
            ListRequest {
                path: Some("src/sub".into()),
                include_hidden: true,
                ..Default::default()
            },
        );
        assert_eq!(sub, ["src/sub/.gitignore", "src/sub/mod.rs"]);
        let everything = list(
            &w,
            ListRequest {
                include_hidden: true,
                include_ignored: true,
                max_depth: Some(10),
                ..Default::default()
            },
        );
        assert!(everything.contains(&".git".to_string()));
        assert!(
            !everything.iter().any(|p| p.starts_with(".git/")),
            "{everything:?}"
        );
        for p in [
            "a.log",
            "secret.env",
            "target/debug/x",
            "src/sub/gen.rs",
            ".gitignore",
        ] {
            assert!(everything.contains(&p.to_string()), "{p}");
        }
        let r =
            w.fs.list(&ListRequest {
                max_depth: Some(10),
                limit: Some(2),
                ..Default::default()
            })
            .unwrap();
        assert!(r.truncated);
        assert_eq!(r.entries.len(), 2);
        let r = w.fs.list(&ListRequest::default()).unwrap();
        assert!(!r.truncated);
        let readme = r.entries.iter().find(|e| e.path == "README.md").unwrap();
        assert_eq!((readme.kind, readme.size), (EntryKind::File, 12));
        assert!(matches!(
            w.fs.list(&ListRequest {
                path: Some("src/lib.rs".into()),
                ..Default::default()
            }),
            Err(ApiError::NotADirectory(_))
        ));
    }

    #[test]
    fn fsops_list_hostile() {
        let w = ws();
        plant(&w, false);
        let r = within(&w.root, |fs| {
            fs.list(&ListRequest {
                glob: Some("**".into()),
                ..Default::default()
            })
        })
        .unwrap();
        assert_no_secret(&r);
        let kind = |p: &str| r.entries.iter().find(|e| e.path == p).map(|e| e.kind);
        assert_eq!(kind("dir_link"), Some(EntryKind::Symlink));
        assert_eq!(kind("abs_link"), Some(EntryKind::Symlink));
        assert_eq!(kind("fifo"), Some(EntryKind::Other));
        assert!(!r.entries.iter().any(|e| e.path.starts_with("dir_link/")));
        assert!(!r.entries.iter().any(|e| e.path.contains("secret")));
        symlink("src", w.root.join("src_link")).unwrap();
        let via = list(
            &w,
            ListRequest {
                path: Some("src_link".into()),
                ..Default::default()
            },
        );
        assert_eq!(via, ["src_link/lib.rs"]);
        for p in [
            "dir_link",
            "rel_dir_link",
            "../outside",
            "slash/etc",
            "/etc",
        ] {
            let r = w.fs.list(&ListRequest {
                path: Some(p.into()),
                ..Default::default()
            });
            assert!(r.is_err(), "{p}: {r:?}");
        }
        // A .gitignore that is a symlink out or a fifo is not read (and does not block).
        std::fs::create_dir(w.root.join("d")).unwrap();
        symlink(w.outside.join("secret.txt"), w.root.join("d/.gitignore")).unwrap();
        nix::unistd::mkfifo(&w.root.join(".gitignore"), Mode::from_bits_truncate(0o644)).unwrap();
        let r = within(&w.root, |fs| {
            fs.list(&ListRequest {
                max_depth: Some(5),
                ..Default::default()
            })
        });
        assert!(r.is_ok(), "{r:?}");
        assert_outside_untouched(&w);
    }

    // ---- search --------------------------------------------------------------------------

    fn search(w: &Ws, req: SearchRequest) -> SearchResult {
        w.fs.search(&req).unwrap()
    }

    #[test]
    fn fsops_search_finds_lines_and_skips_binary_and_ignored() {
        let w = ws();
        std::fs::write(w.root.join(".gitignore"), "ignored.rs\n").unwrap();
        std::fs::write(w.root.join("ignored.rs"), "fn one() {}\n").unwrap();
        std::fs::write(w.root.join("bin.dat"), b"fn one\0binary").unwrap();
        std::fs::write(w.root.join(".hidden.rs"), "fn one() {}\n").unwrap();
        std::fs::write(w.root.join("long.txt"), format!("{}\n", "fn ".repeat(400))).unwrap();

        let r = search(
            &w,
            SearchRequest {
                pattern: r"fn \w+\(\)".into(),
                ..Default::default()
            },
        );
        let got: Vec<_> = r
            .matches
            .iter()
            .map(|m| (m.path.as_str(), m.line_number))
            .collect();
        assert_eq!(
            got,
            [("src/lib.rs", 1), ("src/lib.rs", 2), ("src/lib.rs", 3)]
        );
        assert_eq!(r.matches[1].line, "fn two() {}");
        assert!(!r.truncated);

        let r = search(
            &w,
            SearchRequest {
                pattern: "FN ONE".into(),
                case_insensitive: true,
                include_ignored: true,
                include_hidden: true,
                ..Default::default()
            },
        );
        let paths: Vec<_> = r.matches.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(paths, [".hidden.rs", "ignored.rs", "src/lib.rs"]);

        let r = search(
            &w,
            SearchRequest {
                pattern: "fn".into(),
                glob: Some("*.txt".into()),
                ..Default::default()
            },
        );
        assert_eq!(r.matches.len(), 1);
        assert_eq!(r.matches[0].line.chars().count(), MAX_LINE_CHARS);

        let r = search(
            &w,
            SearchRequest {
                pattern: "fn".into(),
                max_matches: Some(2),
                ..Default::default()
            },
        );
        assert_eq!((r.matches.len(), r.truncated), (2, true));

        let r = search(
            &w,
            SearchRequest {
                pattern: "three".into(),
                path: Some("src/lib.rs".into()),
                ..Default::default()
            },
        );
        assert_eq!((r.files_searched, r.matches[0].line_number), (1, 3));
        let e =
            w.fs.search(&SearchRequest {
                pattern: "(".into(),
                ..Default::default()
            })
            .unwrap_err();
        assert!(matches!(e, ApiError::InvalidArgument(_)));
    }

    #[test]
    fn fsops_search_hostile() {
        let w = ws();
        plant(&w, false);
        let devices = make_devices(&w.root);
        let r = within(&w.root, |fs| {
            fs.search(&SearchRequest {
                pattern: "TOP-SECRET|root:".into(),
                include_hidden: true,
                include_ignored: true,
                ..Default::default()
            })
        })
        .unwrap();
        assert!(r.matches.is_empty(), "{r:?}");
        assert_no_secret(&r);
        let mut paths = hostile(&w);
        paths.extend(["dir_link".into(), "rel_dir_link".into(), "slash".into()]);
        paths.push("fifo".into());
        if devices {
            paths.push("zero".into());
        }
        for p in paths {
            let q = p.clone();
            let r = within(&w.root, move |fs| {
                fs.search(&SearchRequest {
                    pattern: "TOP-SECRET|root:".into(),
                    path: Some(q),
                    ..Default::default()
                })
            });
            assert!(
                r.as_ref().is_err() || r.as_ref().is_ok_and(|r| r.matches.is_empty()),
                "{p}: {r:?}"
            );
            assert_no_secret(&r);
        }
        assert_outside_untouched(&w);
    }

    // ---- stat, remove, rename ------------------------------------------------------------

    #[test]
    fn fsops_stat_does_not_follow() {
        let w = ws();
        plant(&w, false);
        let s =
            w.fs.stat(&PathRequest {
                path: "abs_link".into(),
            })
            .unwrap();
        assert_eq!(s.kind, EntryKind::Symlink);
        assert_eq!(
            s.symlink_target.as_deref(),
            Some(w.outside.join("secret.txt").to_str().unwrap())
        );
        let s =
            w.fs.stat(&PathRequest {
                path: "src/lib.rs".into(),
            })
            .unwrap();
        assert_eq!((s.kind, s.size, s.mode), (EntryKind::File, 38, 0o644));
        assert!(s.modified_ms > 0);
        let s = w.fs.stat(&PathRequest { path: ".".into() }).unwrap();
        assert_eq!(s.kind, EntryKind::Dir);
        assert_eq!(
            w.fs.stat(&PathRequest {
                path: "fifo".into()
            })
            .unwrap()
            .kind,
            EntryKind::Other
        );
        assert!(matches!(
            w.fs.stat(&PathRequest {
                path: "dir_link/secret.txt".into()
            }),
            Err(ApiError::NotFound(_))
        ));
        assert!(
            w.fs.stat(&PathRequest {
                path: "../outside".into()
            })
            .is_err()
        );
    }

    #[test]
    fn fsops_remove() {
        let w = ws();
        plant(&w, true);
        let rm = |p: &str, recursive| {
            w.fs.remove(&RemoveRequest {
                path: p.into(),
                recursive,
            })
        };
        let e = rm("src", false).unwrap_err();
        assert!(e.to_string().contains("set recursive"), "{e}");
        // A tree holding links out: the links go, their targets stay.
        std::fs::create_dir_all(w.root.join("t/a/b")).unwrap();
        symlink(&w.outside, w.root.join("t/a/out")).unwrap();
        std::fs::hard_link(w.outside.join("secret.txt"), w.root.join("t/a/b/h")).unwrap();
        nix::unistd::mkfifo(&w.root.join("t/a/b/f"), Mode::from_bits_truncate(0o644)).unwrap();
        within(&w.root, |fs| {
            fs.remove(&RemoveRequest {
                path: "t".into(),
                recursive: true,
            })
        })
        .unwrap();
        assert!(!w.root.join("t").exists());
        for p in [
            "abs_link",
            "rel_link",
            "dir_link",
            "rel_dir_link",
            "slash",
            "hard",
            "fifo",
        ] {
            rm(p, true).unwrap();
            assert!(w.root.join(p).symlink_metadata().is_err(), "{p}");
        }
        for p in ["../outside/secret.txt", "../outside", ".", "/etc/passwd"] {
            assert!(matches!(rm(p, true), Err(ApiError::PathRefused(_))), "{p}");
        }
        assert!(matches!(rm("missing", false), Err(ApiError::NotFound(_))));
        rm("src/lib.rs", false).unwrap();
        rm("src", true).unwrap();
        assert!(!w.root.join("src").exists());
        assert_outside_untouched(&w);
    }

    #[test]
    fn fsops_remove_deep_tree() {
        let w = ws();
        let mut p = w.root.join("deep");
        for _ in 0..100 {
            p = p.join("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), "x").unwrap();
        w.fs.remove(&RemoveRequest {
            path: "deep".into(),
            recursive: true,
        })
        .unwrap();
        assert!(!w.root.join("deep").exists());
    }

    #[test]
    fn fsops_rename() {
        let w = ws();
        plant(&w, false);
        let mv = |from: &str, to: &str, overwrite| {
            w.fs.rename(&MoveRequest {
                from: from.into(),
                to: to.into(),
                overwrite,
            })
        };
        mv("README.md", "docs.md", false).unwrap();
        assert_eq!(content(&w, "docs.md"), "hello\nworld\n");
        let e = mv("docs.md", "src/lib.rs", false).unwrap_err();
        assert!(
            matches!(&e, ApiError::Conflict(m) if m.contains("set overwrite")),
            "{e}"
        );
        mv("docs.md", "src/lib.rs", true).unwrap();
        assert_eq!(content(&w, "src/lib.rs"), "hello\nworld\n");
        assert!(matches!(mv("nope", "x", false), Err(ApiError::NotFound(_))));
        assert!(matches!(
            mv("src", "src/inner", false),
            Err(ApiError::InvalidArgument(_))
        ));

        // Links are moved, not followed; the secret stays where it is.
        mv("abs_link", "moved_link", false).unwrap();
        assert!(
            w.root
                .join("moved_link")
                .symlink_metadata()
                .unwrap()
                .is_symlink()
        );
        mv("src/lib.rs", "rel_link", true).unwrap();
        assert!(
            !w.root
                .join("rel_link")
                .symlink_metadata()
                .unwrap()
                .is_symlink()
        );
        for (from, to) in [
            ("passwd", "../stolen"),
            ("../outside/secret.txt", "x"),
            ("dir_link/secret.txt", "x"),
            ("moved_link", "dir_link/planted"),
            ("moved_link", "rel_dir_link/planted"),
            ("moved_link", "/tmp/planted"),
            (".", "x"),
        ] {
            assert!(mv(from, to, true).is_err(), "{from} -> {to}");
        }
        assert!(!w.base_parent().join("stolen").exists());
        assert_outside_untouched(&w);
    }
}
