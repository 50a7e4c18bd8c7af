//! A directory tree read through descriptors: never through a symlink, never out of the tree.
//!
//! The supervisor reads trees that a sandbox may be changing while they are read: the upper
//! layer of a live sandbox (its background processes keep running through diff, export,
//! checkpoint and every exec's change scan), and the checkpoints and host workspace compared
//! with it. A path string resolved again at every call follows whatever symlink was swapped in
//! for a directory between two calls, out of the tree. A [`Tree`] opens its root once; every
//! look-up resolves a relative path beneath that descriptor with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, so a symlink anywhere on the way (a swapped-in
//! one included) ends the look-up instead of being followed, and nothing resolves above the
//! root. What a look-up finds is a [`Node`]: an `O_PATH` descriptor of the entry and its
//! `fstat`. A node's content, link target and xattrs are read from that descriptor, so they
//! are the inode's that was looked at, whatever is renamed meanwhile; the metadata that goes
//! with a content (mode, size, mtime) is the `fstat` of the descriptor that is read.
//!
//! A rename that races a walk can make an entry listed a moment ago absent (a look-up answers
//! `None`: a symlink or a non-directory on the way counts as absent, as it would for a lookup
//! that follows nothing), or a directory seen a moment ago read as something else: the walks
//! built on this then miss the racing entry or fail with an error; they never read anything
//! outside the tree. Every look-up starts at the root, so a walk holds one descriptor at a time
//! and a tree deeper than a path can name fails as it would with path strings.
//!
//! Errors name an entry by its path relative to the tree, and the tree by a label ("upper
//! layer", "workspace", ...): never by a host path.

use std::ffi::{CStr, CString, OsString};
use std::fmt;
use std::fs::{File, Metadata};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use crate::sys;

/// A filesystem operation on an entry of a tree failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {}: {source}", Place { layer, path })]
pub struct TreeError {
    pub op: &'static str,
    /// The tree's label ("upper layer", "workspace", ...).
    pub layer: &'static str,
    /// The entry, relative to the tree's root (empty: the root).
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl TreeError {
    pub fn new(op: &'static str, layer: &'static str, path: &Path, source: io::Error) -> Self {
        TreeError {
            op,
            layer,
            path: path.to_path_buf(),
            source,
        }
    }

    /// The path is longer than a tree can name ([`MAX_PATH_BYTES`]).
    pub fn name_too_long(&self) -> bool {
        self.source.raw_os_error() == Some(libc::ENAMETOOLONG)
    }
}

/// The longest path beneath a tree's root that it can name: the kernel's `PATH_MAX` less the
/// NUL. A sandbox can nest directories deeper (each `mkdir` relative to the last), but what is
/// beneath that is out of reach of every look-up by path.
pub const MAX_PATH_BYTES: usize = libc::PATH_MAX as usize - 1;

/// Whether a tree can name `rel` (see [`MAX_PATH_BYTES`]).
pub fn nameable(rel: &Path) -> bool {
    rel.as_os_str().len() <= MAX_PATH_BYTES
}

/// Notes that the directory `dir` holds an entry too long to name, keeping in `first` the
/// first such directory in path order.
pub(crate) fn note_unnamed(first: &mut Option<PathBuf>, dir: &Path) {
    if first.as_deref().is_none_or(|f| dir < f) {
        *first = Some(dir.to_path_buf());
    }
}

/// A path as errors show it: whole up to 160 bytes, past that as the contract's
/// [`excerpt`](crate::api::excerpt) (its start and its length: a path thousands of bytes long
/// says nothing more).
struct Shown<'a>(&'a Path);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0.to_string_lossy();
        if text.len() <= 160 {
            f.write_str(&text)
        } else {
            f.write_str(&crate::api::excerpt(&text))
        }
    }
}

/// `PATH in the LAYER`, or `the LAYER` for its root.
struct Place<'a> {
    layer: &'a str,
    path: &'a Path,
}

impl fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.as_os_str().is_empty() {
            write!(f, "the {}", self.layer)
        } else {
            write!(f, "{} in the {}", Shown(self.path), self.layer)
        }
    }
}

/// An errno as an I/O error whose message says what it means here.
fn errno_error(e: Errno) -> io::Error {
    match e {
        Errno::ELOOP => io::Error::new(
            io::ErrorKind::InvalidInput,
            "a symlink is on the way, and symlinks are not followed",
        ),
        e => io::Error::from(e),
    }
}

fn c_rel(rel: &Path) -> io::Result<CString> {
    let bytes = if rel.as_os_str().is_empty() {
        b".".as_slice()
    } else {
        rel.as_os_str().as_bytes()
    };
    CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "the path holds a NUL byte"))
}

/// "Not there as a path of real directories": absent, below a non-directory, or through a
/// symlink.
fn not_there(e: Errno) -> bool {
    matches!(e, Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP)
}

/// A directory tree opened once at its root (see the module doc).
#[derive(Debug)]
pub struct Tree {
    root: OwnedFd,
    layer: &'static str,
}

impl Tree {
    /// Opens the tree at `path`, a directory the caller trusts (the supervisor's own state
    /// directory, the workspace it was given); `layer` names it in errors.
    pub fn open(path: &Path, layer: &'static str) -> Result<Tree, TreeError> {
        static RAISED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        RAISED.get_or_init(|| {
            if let Err(e) = raise_open_files() {
                tracing::warn!(error = %e, "cannot raise the open-file limit");
            }
        });
        let err = |e| TreeError::new("open", layer, Path::new(""), e);
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| err(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let root = sys::openat2(&sys::Cwd, &c, libc::O_PATH | libc::O_DIRECTORY, 0, 0)
            .map_err(|e| err(errno_error(e)))?;
        Ok(Tree { root, layer })
    }

    /// The label the tree's errors carry.
    pub fn layer(&self) -> &'static str {
        self.layer
    }

    /// An error of `op` on `rel` in this tree.
    pub fn error(&self, op: &'static str, rel: &Path, source: io::Error) -> TreeError {
        TreeError::new(op, self.layer, rel, source)
    }

    fn open_beneath(&self, rel: &Path, flags: i32) -> Result<Result<OwnedFd, Errno>, io::Error> {
        let c = c_rel(rel)?;
        Ok(sys::openat2(
            &self.root,
            &c,
            flags | libc::O_NOFOLLOW,
            0,
            sys::BENEATH_NOFOLLOW,
        ))
    }

    /// The entry at `rel` (`""`: the root), like `lstat`; `None` when there is none, or the way
    /// to it leads through a symlink or a non-directory.
    pub fn node(&self, rel: &Path) -> Result<Option<Node>, TreeError> {
        let fd = match self.open_beneath(rel, libc::O_PATH) {
            Err(e) => return Err(self.error("stat", rel, e)),
            Ok(Err(e)) if not_there(e) => return Ok(None),
            Ok(Err(e)) => return Err(self.error("stat", rel, errno_error(e))),
            Ok(Ok(fd)) => fd,
        };
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| self.error("stat", rel, e))?;
        Ok(Some(Node {
            file,
            meta,
            rel: rel.to_path_buf(),
            layer: self.layer,
        }))
    }

    /// The root itself.
    pub fn root_node(&self) -> Result<Node, TreeError> {
        self.node(Path::new(""))?.ok_or_else(|| {
            self.error(
                "stat",
                Path::new(""),
                io::Error::from(io::ErrorKind::NotFound),
            )
        })
    }

    /// The names in the directory at `rel` (`""`: the root), unsorted; `None` when there is no
    /// directory there (any more), reached without a symlink.
    pub fn names(&self, rel: &Path) -> Result<Option<Vec<OsString>>, TreeError> {
        let fd = match self.open_beneath(rel, libc::O_RDONLY | libc::O_DIRECTORY) {
            Err(e) => return Err(self.error("read directory", rel, e)),
            Ok(Err(e)) if not_there(e) => return Ok(None),
            Ok(Err(e)) => return Err(self.error("read directory", rel, errno_error(e))),
            Ok(Ok(fd)) => fd,
        };
        read_names(fd)
            .map(Some)
            .map_err(|e| self.error("read directory", rel, e))
    }
}

/// The names of the directory open as `fd`, by `getdents64` straight (rustix's `RawDir`): no
/// `fdopendir` (two `fcntl`s) and no rewind, three system calls fewer on every directory of
/// every walk, the upper layer's fingerprint around each exec among them.
fn read_names(fd: OwnedFd) -> io::Result<Vec<OsString>> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
    let mut dir = rustix::fs::RawDir::new(&fd, &mut buf);
    let mut names = Vec::new();
    while let Some(entry) = dir.next() {
        let entry = entry.map_err(io::Error::from)?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    Ok(names)
}

/// One entry of a [`Tree`]: an `O_PATH` descriptor of it and its metadata (as `lstat` gives it).
#[derive(Debug)]
pub struct Node {
    /// An `O_PATH` descriptor: it reads nothing itself.
    file: File,
    meta: Metadata,
    rel: PathBuf,
    layer: &'static str,
}

impl Node {
    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    /// The entry's path relative to its tree.
    pub fn rel(&self) -> &Path {
        &self.rel
    }

    /// The label of the entry's tree.
    pub fn layer(&self) -> &'static str {
        self.layer
    }

    /// Whether `other` is this same inode.
    pub fn same_inode(&self, other: &Node) -> bool {
        (self.meta.dev(), self.meta.ino()) == (other.meta.dev(), other.meta.ino())
    }

    /// An error of `op` on this entry.
    pub fn error(&self, op: &'static str, source: io::Error) -> TreeError {
        TreeError::new(op, self.layer, &self.rel, source)
    }

    fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn wrong_type(&self, op: &'static str, want: &str) -> TreeError {
        self.error(
            op,
            io::Error::new(io::ErrorKind::InvalidInput, format!("not {want}")),
        )
    }

    /// The target of this symlink.
    pub fn read_link(&self) -> Result<PathBuf, TreeError> {
        if !self.meta.file_type().is_symlink() {
            return Err(self.wrong_type("read link", "a symlink"));
        }
        // An empty path: the link the descriptor holds itself.
        nix::fcntl::readlinkat(Some(self.raw_fd()), "")
            .map(PathBuf::from)
            .map_err(|e| self.error("read link", errno_error(e)))
    }

    /// Opens this regular file for reading (never blocking), and its metadata now: the mode,
    /// size and times that go with the content read from it.
    pub fn open_file(&self) -> Result<(File, Metadata), TreeError> {
        if !self.meta.is_file() {
            return Err(self.wrong_type("open", "a regular file"));
        }
        let fd = sys::reopen(
            &self.file,
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY,
        )
        .map_err(|e| self.error("open", e))?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| self.error("stat", e))?;
        if !meta.is_file() || (meta.dev(), meta.ino()) != (self.meta.dev(), self.meta.ino()) {
            return Err(self.error(
                "open",
                io::Error::other("the file changed while it was read"),
            ));
        }
        Ok((file, meta))
    }

    /// The names in this directory, as it is now (it may have been moved since the look-up).
    pub fn names(&self) -> Result<Vec<OsString>, TreeError> {
        if !self.meta.is_dir() {
            return Err(self.wrong_type("read directory", "a directory"));
        }
        let fd = sys::reopen(&self.file, libc::O_RDONLY | libc::O_DIRECTORY)
            .map_err(|e| self.error("read directory", e))?;
        read_names(fd).map_err(|e| self.error("read directory", e))
    }

    fn has_xattrs(&self) -> bool {
        self.meta.is_file() || self.meta.is_dir()
    }

    /// The NUL-separated xattr names of this directory or regular file (none for other types,
    /// or where the filesystem has none).
    pub fn xattr_names(&self) -> Result<Vec<u8>, TreeError> {
        if !self.has_xattrs() {
            return Ok(Vec::new());
        }
        sys::xattr_names(&self.file).map_err(|e| self.error("list xattrs of", e))
    }

    /// The value of xattr `name` of this directory or regular file, if it has one.
    pub fn xattr(&self, name: &CStr) -> Result<Option<Vec<u8>>, TreeError> {
        if !self.has_xattrs() {
            return Ok(None);
        }
        sys::xattr(&self.file, name).map_err(|e| self.error("read xattr of", e))
    }
}

/// Raises the soft limit on open files to the hard one and returns it, as a Go program's runtime
/// does at its start: the usual soft limit (1024) is below what this process may need. A walk
/// of a tree holds a descriptor for each level it is in (it never follows a path): about 2,000
/// for a tree as deep as a path can name. A supervisor also holds one for each connection and
/// several for each sandbox. [`Tree::open`] calls it once per process; what a sandbox's command
/// may open is its policy's `RLIMIT_NOFILE`, set in the sandbox.
pub fn raise_open_files() -> std::io::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Read;
    use std::os::unix::fs::{PermissionsExt, symlink};

    /// A tree `root` with `d/key`, a symlink `s` to a directory outside it holding a `key` of
    /// its own, and a file `f`.
    fn scene() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        fs::create_dir_all(root.join("d")).unwrap();
        fs::create_dir(&outside).unwrap();
        fs::write(root.join("d/key"), "inside\n").unwrap();
        fs::write(outside.join("key"), "outside\n").unwrap();
        fs::write(root.join("f"), "f\n").unwrap();
        symlink(&outside, root.join("s")).unwrap();
        (tmp, root)
    }

    #[test]
    fn a_symlink_on_the_way_is_never_followed() {
        let (_tmp, root) = scene();
        let tree = Tree::open(&root, "upper layer").unwrap();
        // Through a symlink, nothing is there; the symlink itself is.
        assert!(tree.node(Path::new("s/key")).unwrap().is_none());
        assert!(tree.names(Path::new("s")).unwrap().is_none());
        let s = tree.node(Path::new("s")).unwrap().unwrap();
        assert!(s.meta().file_type().is_symlink());
        assert_eq!(
            s.read_link().unwrap(),
            root.parent().unwrap().join("outside")
        );
        assert!(s.open_file().is_err());
        assert!(s.names().is_err());
        assert!(s.xattr_names().unwrap().is_empty());
        // Below a file: nothing either.
        assert!(tree.node(Path::new("f/x")).unwrap().is_none());
        let mut names = tree.names(Path::new("")).unwrap().unwrap();
        names.sort();
        assert_eq!(names, ["d", "f", "s"]);
        let key = tree.node(Path::new("d/key")).unwrap().unwrap();
        let mut text = String::new();
        key.open_file()
            .unwrap()
            .0
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "inside\n");
    }

    #[test]
    fn a_swap_after_the_look_up_leaves_what_is_read_the_entry_looked_up() {
        let (_tmp, root) = scene();
        let tree = Tree::open(&root, "upper layer").unwrap();
        let dir = tree.node(Path::new("d")).unwrap().unwrap();
        let key = tree.node(Path::new("d/key")).unwrap().unwrap();
        // The directory is swapped for the symlink to outside, as a racing sandbox would.
        fs::rename(root.join("d"), root.join("moved")).unwrap();
        fs::rename(root.join("s"), root.join("d")).unwrap();
        fs::set_permissions(root.join("moved/key"), fs::Permissions::from_mode(0o640)).unwrap();
        let (mut file, meta) = key.open_file().unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "inside\n");
        // The mode that goes with the content is the descriptor's now, not the look-up's.
        assert_eq!(meta.permissions().mode() & 0o777, 0o640);
        assert_eq!(dir.names().unwrap(), ["key"]);
        // A look-up from the root now meets the symlink and finds nothing.
        assert!(tree.node(Path::new("d/key")).unwrap().is_none());
        assert!(tree.names(Path::new("d")).unwrap().is_none());
    }

    #[test]
    fn errors_name_the_entry_in_its_tree_not_a_host_path() {
        let (tmp, root) = scene();
        let err = Tree::open(&tmp.path().join("missing"), "checkpoint").unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot open the checkpoint: No such file or directory (os error 2)"
        );
        let tree = Tree::open(&root, "upper layer").unwrap();
        let f = tree.node(Path::new("f")).unwrap().unwrap();
        let err = f.read_link().unwrap_err().to_string();
        assert_eq!(err, "cannot read link f in the upper layer: not a symlink");
        let err = tree
            .error("copy", Path::new("d/key"), io::Error::other("boom"))
            .to_string();
        assert_eq!(err, "cannot copy d/key in the upper layer: boom");
        assert!(!err.contains(&root.display().to_string()));
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_one() {
        let soft = raise_open_files().unwrap();
        let (cur, max) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(cur, soft);
        assert_eq!(cur, max);
    }
}
