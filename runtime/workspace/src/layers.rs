//! Layer operations on a sandbox's overlay upper directory: checkpoints, comparisons between two
//! upper layers, per-exec changes, export as a tar, and applying the change to the host.
//!
//! The workspace is an overlay of the sandbox's upper directory on the host workspace (the lower
//! tree, never modified while the sandbox runs). Everything here costs O(size of the upper
//! layers), never O(repository): the lower tree is looked at only at paths an upper layer names
//! and beneath directories an upper layer deletes, replaces or makes opaque. Paths and change
//! kinds follow [`changes::scan`](crate::changes::scan): relative, `/`-joined, sorted; a
//! directory is a change only as `path/` when it is empty and appeared or disappeared; a change is
//! `Modified` only when type, permission bits, content, symlink target or device number differ.
//!
//! Every tree is read through a [`Tree`] (see [`crate::tree`]): from a descriptor of its root,
//! beneath it, following no symlink, with contents, link targets and xattrs taken from the
//! descriptor of the entry looked at, and the mode, size and mtime of a file from the descriptor
//! its content is read from. A sandbox's processes may keep running meanwhile (a background exec
//! during a checkpoint, an export or another exec's change scan): a rename racing a walk can make
//! it miss the racing entry or fail, and never read, copy or write anything outside the trees.
//! Errors name entries by their paths relative to their tree.
//!
//! - [`copy_layer`] copies an upper tree exactly: a checkpoint is such a copy (upper -> checkpoint)
//!   and a restore is the reverse (checkpoint -> fresh upper, remounted by the supervisor).
//! - [`scan_between`] / [`diff_between`]: the change from the view "lower + base" (a checkpoint)
//!   to the view "lower + upper" (now).
//! - [`fingerprint`] / [`exec_changes`]: what one exec changed. A [`Fingerprint`] records each
//!   upper entry's type, size, mtime, ctime, inode and mode (plus opaque flag, and a content digest
//!   for files changed in the last [`RACY_WINDOW_NS`], which a same-size rewrite within the same
//!   timestamp tick would not otherwise reveal). `exec_changes` compares the view "lower + upper as
//!   fingerprinted before" with "lower + upper now" at the paths whose entry appeared, changed or
//!   disappeared:
//!   - entered upper over a lower file: `Modified`, unless type, mode and content equal the lower
//!     file's (a copy-up by `touch` or `chmod` to the same mode is no change);
//!   - entered upper where lower has nothing: `Added`;
//!   - a whiteout appeared (or the upper entry vanished, as overlayfs removes files that exist
//!     only in upper without leaving a whiteout): `Deleted`, for a directory every entry beneath;
//!   - in upper before and after with a different fingerprint: `Modified` (the content before the
//!     exec is not kept, so a rewrite with the same bytes still counts);
//!   - directory type changes, opaque directories and empty directories as in `scan`.
//! - [`export_tar`] writes the added and modified files as the sandbox sees them, plus a
//!   [`DELETED_MEMBER`] listing deleted paths.
//! - [`apply_to_host`] writes the change into the host workspace without following a symlink the
//!   sandbox or anyone else planted there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{CString, OsStr, OsString};
use std::fmt;
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, renameat};
use nix::sys::stat::{FchmodatFlags, Mode, SFlag, mkdirat};
use nix::unistd::{UnlinkatFlags, symlinkat, unlinkat};
use sha2::{Digest, Sha256};

use crate::changes::{
    self, ChangesError, CompareBufs, Diff, Resolved, UPPER, UpperDir, UpperEntry, UpperLayer, View,
    WORKSPACE, leaves_differ, overlay_attrs,
};
use crate::result::{Change, ChangeKind};
use crate::sys;
use crate::tree::{self, Node, Tree, TreeError};

/// A file whose ctime is this close to (or after) the moment its fingerprint was taken also gets
/// a content digest: a rewrite of the same size within the same coarse timestamp tick would
/// leave size, mtime and ctime unchanged.
pub const RACY_WINDOW_NS: i128 = 100_000_000;
/// Racy files larger than this are not hashed; an unchanged-looking one counts as modified.
const RACY_DIGEST_LIMIT: u64 = 64 * 1024 * 1024;
/// Name of the tar member that lists deleted paths, one per line, each ending in `\n`; `path/`
/// is an empty directory. Always present (empty when nothing was deleted), and first.
pub const DELETED_MEMBER: &str = ".taskbox-deleted";

/// The mode bits a change carries out of the sandbox (to the host by `apply_to_host`, into an
/// exported tar): the permissions alone. A sandbox owns what it creates and may set setuid or
/// setgid on it; outside, that bit would run the file as the owner it lands with.
pub const HOST_MODE_BITS: u32 = 0o777;
/// Overlay xattrs copied with a layer (both namespaces; `trusted.` ones only when readable).
const OVERLAY_XATTR_PREFIXES: [&[u8]; 2] = [b"user.overlay.", b"trusted.overlay."];

/// How errors name the trees here (beside the upper layer and the workspace).
const CHECKPOINT: &str = "checkpoint";
const LAYER: &str = "layer";
const COPY: &str = "copy of the layer";
const HOST: &str = "host workspace";

/// Why a layer operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LayersError {
    /// Reading the layers failed (see [`ChangesError`]).
    #[error(transparent)]
    Changes(#[from] ChangesError),
    /// A filesystem operation failed on an entry of a tree.
    #[error(transparent)]
    Io(#[from] TreeError),
    /// A layer holds an entry of a kind that cannot be copied or exported.
    #[error("cannot {op} {} in the {layer}: {kind} is not supported", path.display())]
    Unsupported {
        op: &'static str,
        layer: &'static str,
        /// Relative to the layer.
        path: PathBuf,
        kind: &'static str,
    },
    /// A change cannot be exported as given.
    #[error("cannot export {path:?}: {detail}")]
    Export { path: String, detail: &'static str },
    /// Writing an exported tar failed.
    #[error("cannot write the exported tar: {0}")]
    Tar(#[source] io::Error),
    /// Applying to the host was refused before anything was written.
    #[error("cannot apply to the host workspace: refused {}", Refusals(problems))]
    Refused { problems: Vec<Refusal> },
}

impl LayersError {
    /// The layers hold a path longer than a path can be ([`tree::MAX_PATH_BYTES`]).
    pub fn name_too_long(&self) -> bool {
        match self {
            LayersError::Io(e) => e.name_too_long(),
            LayersError::Changes(e) => e.name_too_long(),
            _ => false,
        }
    }
}

/// One change that [`apply_to_host`] refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub path: String,
    pub reason: &'static str,
}

struct Refusals<'a>(&'a [Refusal]);

impl fmt::Display for Refusals<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{:?} ({})", r.path, r.reason)?;
        }
        Ok(())
    }
}

/// An error of `op` on `rel` in the tree named `layer`.
fn lio<'a>(
    op: &'static str,
    layer: &'static str,
    rel: &'a Path,
) -> impl FnOnce(io::Error) -> LayersError + 'a {
    move |source| TreeError::new(op, layer, rel, source).into()
}

fn nio<'a>(
    op: &'static str,
    layer: &'static str,
    rel: &'a Path,
) -> impl FnOnce(Errno) -> LayersError + 'a {
    move |errno| TreeError::new(op, layer, rel, io::Error::from(errno)).into()
}

// ---------------------------------------------------------------------------------------------
// copy_layer

/// Copies the upper tree `src` to `dst` (which must not exist) exactly: regular files (content,
/// mode, mtime; hard links within the tree stay linked), directories (mode, mtime), symlinks
/// (target), whiteouts (character devices 0:0, which the kernel lets anyone create since 5.8),
/// fifos and sockets, with owners and the `user.overlay.*` / `trusted.overlay.*` xattrs (opaque
/// directories, xattr whiteouts). `src` is read as a [`Tree`]: symlinks are never followed, a
/// file's mode, owner and mtime are those of the descriptor its content is read from, and an
/// entry a racing rename removed is left out. Any other device node is refused. `dst` is the
/// caller's own new directory. Returns the number of entries copied, `src` itself not counted.
/// On error `dst` is left partially written for the caller to remove.
pub fn copy_layer(src: &Path, dst: &Path) -> Result<u64, LayersError> {
    fs::DirBuilder::new().mode(0o700).create(dst).map_err(lio(
        "create directory",
        COPY,
        Path::new(""),
    ))?;
    copy_layer_to(src, dst, false)
}

/// As [`copy_layer`], into `dst`, a directory that exists: the layer's entries are copied
/// beneath it (a directory there already, such as a mount point, is copied into) and it takes
/// the layer root's owner, mode and attributes. For a directory something is mounted from
/// already (a sandbox's `/tmp`), which must stay the same inode.
pub fn copy_layer_into(src: &Path, dst: &Path) -> Result<u64, LayersError> {
    copy_layer_to(src, dst, true)
}

fn copy_layer_to(src: &Path, dst: &Path, merge: bool) -> Result<u64, LayersError> {
    let tree = Tree::open(src, LAYER)?;
    let root = tree.root_node()?;
    let root_rel = Path::new("");
    let xattrs = overlay_xattrs(&root)?;
    let dst = File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dst)
        .map_err(lio("open", COPY, root_rel))?;
    let mut copier = Copier {
        src: &tree,
        dst: OwnedFd::from(dst),
        count: 0,
        links: HashMap::new(),
        // SAFETY: geteuid/getegid cannot fail and touch no memory.
        ids: unsafe { (libc::geteuid(), libc::getegid()) },
        merge,
    };
    copier.copy_dir_contents(root_rel)?;
    copier.finish_dir(root_rel, root.meta(), &xattrs)?;
    Ok(copier.count)
}

/// A copy of a layer. Its entries are made relative to a descriptor of the destination, by
/// their path in the layer: a layer a path can reach is copied whatever the length of the
/// destination's own path (a sandbox's tree fills a path beneath the workspace, and the host
/// path of a checkpoint adds its own).
struct Copier<'a> {
    src: &'a Tree,
    /// The destination's root, which only the supervisor writes.
    dst: OwnedFd,
    count: u64,
    /// (dev, ino) of multiply linked files already copied -> their copy.
    links: HashMap<(u64, u64), PathBuf>,
    /// Our effective uid and gid: entries owned by others need a chown.
    ids: (u32, u32),
    /// A directory that exists at the destination (and is no link) is copied into.
    merge: bool,
}

/// What is left of a copy: entries to copy, and directories to finish once all they hold is
/// copied (their owner, attributes, mode and mtime).
enum CopyStep {
    Entry(PathBuf),
    FinishDir(PathBuf, Metadata, Vec<(CString, Vec<u8>)>),
}

/// `rel` as a path relative to the root's descriptor (`.` for the root itself).
fn at(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

impl Copier<'_> {
    /// Copies what the directory `rel` holds, depth first, on a stack of its own: a layer as
    /// deep as a sandbox can make one (thousands of nested directories) needs no more of the
    /// thread's stack than a flat one.
    fn copy_dir_contents(&mut self, rel: &Path) -> Result<(), LayersError> {
        let mut steps = Vec::new();
        self.push_children(rel, &mut steps)?;
        while let Some(step) = steps.pop() {
            match step {
                CopyStep::Entry(rel) => self.copy_entry(&rel, &mut steps)?,
                CopyStep::FinishDir(rel, meta, xattrs) => {
                    self.finish_dir(&rel, &meta, &xattrs)?;
                    self.count += 1;
                }
            }
        }
        Ok(())
    }

    /// Puts the entries of the directory `rel` on `steps`, to be copied in name order.
    fn push_children(&self, rel: &Path, steps: &mut Vec<CopyStep>) -> Result<(), LayersError> {
        // A directory swapped away since it was copied is left empty.
        let names = self.src.names(rel)?.unwrap_or_default();
        steps.extend(names.iter().rev().map(|n| CopyStep::Entry(rel.join(n))));
        Ok(())
    }

    fn fd(&self) -> Option<RawFd> {
        Some(self.dst.as_raw_fd())
    }

    /// Opens `rel` of the destination (`""`: its root), not through a final symlink; `op`
    /// names the opening in its error.
    fn open(
        &self,
        op: &'static str,
        rel: &Path,
        flags: OFlag,
        mode: Mode,
    ) -> Result<OwnedFd, LayersError> {
        let fd = nix::fcntl::openat(self.fd(), at(rel), flags | OFlag::O_NOFOLLOW, mode)
            .map_err(nio(op, COPY, rel))?;
        // SAFETY: openat returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn copy_entry(&mut self, rel: &Path, steps: &mut Vec<CopyStep>) -> Result<(), LayersError> {
        let Some(node) = self.src.node(rel)? else {
            return Ok(());
        };
        let meta = node.meta().clone();
        let ft = meta.file_type();
        let perm = Mode::from_bits_truncate(meta.mode() & 0o7777);
        if ft.is_dir() {
            let xattrs = overlay_xattrs(&node)?;
            // No descriptor is held while the copy goes deeper.
            drop(node);
            match mkdirat(self.fd(), rel, Mode::from_bits_truncate(0o700)) {
                Err(Errno::EEXIST)
                    if self.merge
                        && nix::sys::stat::fstatat(
                            self.fd(),
                            rel,
                            AtFlags::AT_SYMLINK_NOFOLLOW,
                        )
                        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR) => {}
                r => r.map_err(nio("create directory", COPY, rel))?,
            }
            // Finished (and counted) once everything beneath it is copied.
            steps.push(CopyStep::FinishDir(rel.to_path_buf(), meta, xattrs));
            return self.push_children(rel, steps);
        } else if ft.is_file() {
            self.copy_file(&node)?;
        } else if ft.is_symlink() {
            let target = node.read_link()?;
            symlinkat(&target, self.fd(), rel).map_err(nio("create symlink", COPY, rel))?;
            self.chown(rel, &meta)?;
            self.set_mtime(rel, &meta)?;
        } else {
            let kind = if ft.is_char_device() && meta.rdev() == 0 {
                SFlag::S_IFCHR
            } else if ft.is_fifo() {
                SFlag::S_IFIFO
            } else if ft.is_socket() {
                SFlag::S_IFSOCK
            } else {
                return Err(LayersError::Unsupported {
                    op: "copy",
                    layer: LAYER,
                    path: rel.to_path_buf(),
                    kind: "a device node other than a whiteout",
                });
            };
            nix::sys::stat::mknodat(self.fd(), rel, kind, Mode::empty(), 0).map_err(nio(
                "create node",
                COPY,
                rel,
            ))?;
            self.chown(rel, &meta)?;
            // A fresh node we created: chmod on its path cannot reach through a symlink.
            nix::sys::stat::fchmodat(self.fd(), rel, perm, FchmodatFlags::FollowSymlink)
                .map_err(nio("set mode of", COPY, rel))?;
            self.set_mtime(rel, &meta)?;
        }
        self.count += 1;
        Ok(())
    }

    fn copy_file(&mut self, node: &Node) -> Result<(), LayersError> {
        let rel = node.rel();
        let key = (node.meta().dev(), node.meta().ino());
        if node.meta().nlink() > 1 {
            if let Some(first) = self.links.get(&key) {
                return nix::unistd::linkat(
                    self.fd(),
                    first.as_path(),
                    self.fd(),
                    rel,
                    AtFlags::empty(),
                )
                .map_err(nio("link", COPY, rel));
            }
            self.links.insert(key, rel.to_path_buf());
        }
        // Mode, owner and mtime of the file whose content is copied.
        let (mut from, meta) = node.open_file()?;
        let mut to = File::from(self.open(
            "create",
            rel,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )?);
        // std uses copy_file_range between two files (reflinks where the filesystem has them).
        io::copy(&mut from, &mut to).map_err(lio("copy", LAYER, rel))?;
        if (meta.uid(), meta.gid()) != self.ids {
            std::os::unix::fs::fchown(&to, Some(meta.uid()), Some(meta.gid())).map_err(lio(
                "change owner of",
                COPY,
                rel,
            ))?;
        }
        // After the chown, which clears set-id bits.
        to.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(lio("set mode of", COPY, rel))?;
        set_xattrs(rel, &to, &overlay_xattrs(node)?)?;
        let mtime = meta.modified().map_err(lio("read mtime of", LAYER, rel))?;
        to.set_times(fs::FileTimes::new().set_modified(mtime))
            .map_err(lio("set mtime of", COPY, rel))?;
        Ok(())
    }

    fn finish_dir(
        &self,
        rel: &Path,
        meta: &Metadata,
        xattrs: &[(CString, Vec<u8>)],
    ) -> Result<(), LayersError> {
        self.chown(rel, meta)?;
        if !xattrs.is_empty() {
            let dir = self.open(
                "open",
                rel,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            set_xattrs(rel, &dir, xattrs)?;
        }
        nix::sys::stat::fchmodat(
            self.fd(),
            at(rel),
            Mode::from_bits_truncate(meta.mode() & 0o7777),
            FchmodatFlags::FollowSymlink,
        )
        .map_err(nio("set mode of", COPY, rel))?;
        self.set_mtime(rel, meta)
    }

    fn chown(&self, rel: &Path, meta: &Metadata) -> Result<(), LayersError> {
        if (meta.uid(), meta.gid()) == self.ids {
            return Ok(());
        }
        nix::unistd::fchownat(
            self.fd(),
            at(rel),
            Some(nix::unistd::Uid::from_raw(meta.uid())),
            Some(nix::unistd::Gid::from_raw(meta.gid())),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(nio("change owner of", COPY, rel))
    }

    /// Sets the mtime of `rel` (not following a symlink) to that of `meta`; atime is left
    /// alone.
    fn set_mtime(&self, rel: &Path, meta: &Metadata) -> Result<(), LayersError> {
        use nix::sys::stat::{UtimensatFlags, utimensat};
        use nix::sys::time::TimeSpec;
        let mtime = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
        utimensat(
            self.fd(),
            at(rel),
            &TimeSpec::UTIME_OMIT,
            &mtime,
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(nio("set mtime of", COPY, rel))
    }
}

/// The overlay xattrs of a directory or regular file, read from its descriptor.
fn overlay_xattrs(node: &Node) -> Result<Vec<(CString, Vec<u8>)>, LayersError> {
    let names = node.xattr_names()?;
    let mut out = Vec::new();
    let overlay_names = names
        .split(|b| *b == 0)
        .filter(|n| OVERLAY_XATTR_PREFIXES.iter().any(|p| n.starts_with(p)));
    for name in overlay_names {
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        if let Some(value) = node.xattr(&cname)? {
            out.push((cname, value));
        }
    }
    Ok(out)
}

/// Sets `xattrs` on the copy of `rel` open as `fd`.
fn set_xattrs(
    rel: &Path,
    fd: &impl AsRawFd,
    xattrs: &[(CString, Vec<u8>)],
) -> Result<(), LayersError> {
    for (name, value) in xattrs {
        sys::fset_xattr(fd, name, value).map_err(lio("set xattr of", COPY, rel))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// comparing two views

/// Collects the classified changes between two views at candidate paths.
struct Classifier {
    out: Vec<Change>,
}

impl Classifier {
    fn push(&mut self, rel: &Path, kind: ChangeKind, dir: bool) {
        let mut path = rel.to_string_lossy().into_owned();
        if dir {
            path.push('/');
        }
        self.out.push(Change { path, kind });
    }

    /// Classifies `rel` from the `old` to the `new` view. `leaf_differs` compares two
    /// non-directories (called only when both views show one).
    fn classify<U: UpperLayer, V: UpperLayer>(
        &mut self,
        rel: &Path,
        old: &View<'_, U>,
        new: &View<'_, V>,
        leaf_differs: &mut impl FnMut(
            &Resolved<U::Leaf>,
            &Resolved<V::Leaf>,
        ) -> Result<bool, LayersError>,
    ) -> Result<(), LayersError> {
        use ChangeKind::{Added, Deleted, Modified};
        let o = old.resolve(rel)?;
        let n = new.resolve(rel)?;
        match (&o, &n) {
            (Resolved::Absent, Resolved::Absent) | (Resolved::Dir { .. }, Resolved::Dir { .. }) => {
            }
            (Resolved::Absent, Resolved::Dir { upper, lower }) => {
                if new.dir_is_empty(rel, *upper, *lower)? {
                    self.push(rel, Added, true);
                }
            }
            (Resolved::Dir { upper, lower }, Resolved::Absent) => {
                if old.dir_is_empty(rel, *upper, *lower)? {
                    self.push(rel, Deleted, true);
                }
            }
            (Resolved::Absent, _) => self.push(rel, Added, false),
            (_, Resolved::Absent) => self.push(rel, Deleted, false),
            (Resolved::Dir { upper, lower }, _) => {
                if old.dir_is_empty(rel, *upper, *lower)? {
                    self.push(rel, Deleted, true);
                }
                self.push(rel, Added, false);
            }
            (_, Resolved::Dir { upper, lower }) => {
                self.push(rel, Deleted, false);
                if new.dir_is_empty(rel, *upper, *lower)? {
                    self.push(rel, Added, true);
                }
            }
            _ => {
                if leaf_differs(&o, &n)? {
                    self.push(rel, Modified, false);
                }
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Vec<Change> {
        self.out.sort();
        self.out.dedup();
        self.out
    }
}

/// Adds every lower entry beneath `rel` (not `rel` itself) to `out`, when the lower tree has a
/// real directory at `rel` (reached without following a symlink).
fn add_lower_beneath(
    lower: &Tree,
    rel: &Path,
    out: &mut BTreeSet<PathBuf>,
) -> Result<(), LayersError> {
    let lower_only = View::<UpperDir<'_>>::new(None, Some(lower));
    if !matches!(lower_only.resolve(rel)?, Resolved::Dir { .. }) {
        return Ok(());
    }
    let mut stack = vec![rel.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for name in lower.names(&dir)?.unwrap_or_default() {
            let child = dir.join(&name);
            if !tree::nameable(&child) {
                continue;
            }
            if lower.node(&child)?.is_some_and(|n| n.meta().is_dir()) {
                stack.push(child.clone());
            }
            out.insert(child);
        }
    }
    Ok(())
}

/// Adds every path the upper tree `upper` names to `out`, and every lower path beneath an entry
/// of it that hides the lower tree (a whiteout, a non-directory, an opaque directory).
fn add_upper_paths(
    upper: &Tree,
    lower: &Tree,
    out: &mut BTreeSet<PathBuf>,
) -> Result<(), LayersError> {
    if overlay_attrs(&upper.root_node()?)?.opaque {
        add_lower_beneath(lower, Path::new(""), out)?;
    }
    let mut stack = vec![PathBuf::new()];
    while let Some(dir) = stack.pop() {
        for name in upper.names(&dir)?.unwrap_or_default() {
            let rel = dir.join(&name);
            match upper.node(&rel)? {
                Some(node) if node.meta().is_dir() => {
                    if overlay_attrs(&node)?.opaque {
                        add_lower_beneath(lower, &rel, out)?;
                    }
                    stack.push(rel.clone());
                }
                Some(_) => add_lower_beneath(lower, &rel, out)?,
                // Gone since it was listed: both views are looked at there anyway.
                None => {}
            }
            out.insert(rel);
        }
    }
    Ok(())
}

/// Whether two leaves the views show at the same path differ; two of the lower tree are the
/// same file.
fn disk_leaves_differ(
    o: &Resolved<Node>,
    n: &Resolved<Node>,
    bufs: &mut CompareBufs,
) -> Result<bool, LayersError> {
    match (o, n) {
        (Resolved::Lower(_), Resolved::Lower(_)) => Ok(false),
        (Resolved::Upper(a) | Resolved::Lower(a), Resolved::Upper(b) | Resolved::Lower(b)) => {
            Ok(leaves_differ(a, b, bufs)?)
        }
        _ => Ok(false),
    }
}

/// What changed from the view `lower` + `base` (say, a checkpoint) to the view `lower` + `upper`
/// (now), with the semantics of [`changes::scan`]. Looks at every path either upper layer names,
/// and at the lower entries beneath what either of them hides.
pub fn scan_between(lower: &Path, base: &Path, upper: &Path) -> Result<Vec<Change>, LayersError> {
    let lower = Tree::open(lower, WORKSPACE)?;
    let base = Tree::open(base, CHECKPOINT)?;
    let upper = Tree::open(upper, UPPER)?;
    let mut candidates = BTreeSet::new();
    add_upper_paths(&base, &lower, &mut candidates)?;
    add_upper_paths(&upper, &lower, &mut candidates)?;
    let (b, u) = (UpperDir(&base), UpperDir(&upper));
    let old = View::new(Some(&b), Some(&lower));
    let new = View::new(Some(&u), Some(&lower));
    let mut bufs = CompareBufs::new();
    let mut differs = |o: &Resolved<Node>, n: &Resolved<Node>| disk_leaves_differ(o, n, &mut bufs);
    let mut classifier = Classifier { out: Vec::new() };
    for rel in &candidates {
        classifier.classify(rel, &old, &new, &mut differs)?;
    }
    Ok(classifier.finish())
}

/// Renders `changes` (as returned by [`scan_between`]) as a git-style diff from the view
/// `lower` + `base` to the view `lower` + `upper`, in the format of [`changes::diff`].
pub fn diff_between(
    lower: &Path,
    base: &Path,
    upper: &Path,
    changes: &[Change],
) -> Result<Diff, LayersError> {
    let lower = Tree::open(lower, WORKSPACE)?;
    let base = Tree::open(base, CHECKPOINT)?;
    let upper = Tree::open(upper, UPPER)?;
    let (b, u) = (UpperDir(&base), UpperDir(&upper));
    let old = View::new(Some(&b), Some(&lower));
    let new = View::new(Some(&u), Some(&lower));
    Ok(changes::render_between(
        &old,
        &new,
        changes,
        ("base tree", "current tree"),
    )?)
}

// ---------------------------------------------------------------------------------------------
// fingerprints

/// The type of an upper entry, as a fingerprint records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// A character device 0:0, or an empty file with the `overlay.whiteout` xattr.
    Whiteout,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

/// The fingerprint of one upper entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryPrint {
    pub kind: EntryKind,
    pub size: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
    pub ino: u64,
    /// `st_mode`, type and permission bits.
    pub mode: u32,
    /// A directory with `overlay.opaque` = `y`.
    pub opaque: bool,
    /// Changed within [`RACY_WINDOW_NS`] of the fingerprint: the metadata alone cannot prove a
    /// later same-size rewrite; `digest` holds the content's sha256 when it was small enough.
    pub racy: bool,
    pub digest: Option<[u8; 32]>,
}

impl EntryPrint {
    /// Whether the metadata (everything but the racy digest) is the same.
    fn same_metadata(&self, other: &EntryPrint) -> bool {
        (
            self.kind,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
            self.ino,
            self.mode,
            self.opaque,
        ) == (
            other.kind,
            other.size,
            other.mtime_ns,
            other.ctime_ns,
            other.ino,
            other.mode,
            other.opaque,
        )
    }

    /// Whether `now` (the entry at the same path, fingerprinted later) may differ from this one;
    /// `digest_now` hashes the entry's content now, when that is needed to tell.
    fn changed(
        &self,
        now: &EntryPrint,
        digest_now: impl FnOnce() -> Result<Option<[u8; 32]>, LayersError>,
    ) -> Result<bool, LayersError> {
        if !self.same_metadata(now) {
            return Ok(true);
        }
        if !self.racy {
            return Ok(false);
        }
        match self.digest {
            Some(before) => Ok(digest_now()? != Some(before)),
            None => Ok(true),
        }
    }
}

/// A cheap record of an upper tree: relative path (`""` is the root) -> [`EntryPrint`]. Taken
/// before and after an exec, it tells which upper entries the exec touched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fingerprint {
    entries: BTreeMap<PathBuf, EntryPrint>,
    /// The first directory (in path order) holding an entry whose path is too long to name
    /// ([`tree::MAX_PATH_BYTES`]): what is beneath is not recorded.
    unnamed: Option<PathBuf>,
}

impl Fingerprint {
    pub fn entries(&self) -> &BTreeMap<PathBuf, EntryPrint> {
        &self.entries
    }

    /// The first directory (in path order) holding an entry whose path is longer than a path
    /// can be ([`tree::MAX_PATH_BYTES`]), which the record leaves out with all beneath it.
    pub fn unnamed(&self) -> Option<&Path> {
        self.unnamed.as_deref()
    }

    /// The names of the children of `rel` in the record. Each child's own entries follow it in
    /// path order and are stepped over (a seek past `child\0`, the first name after the
    /// child's), so a directory costs its children, not everything beneath it: a tree N deep
    /// cost N^2 look-ups per pass otherwise.
    fn child_names(&self, rel: &Path) -> Vec<OsString> {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let mut names = Vec::new();
        let mut from = Excluded(rel.to_path_buf());
        while let Some((k, _)) = self.entries.range::<PathBuf, _>((from, Unbounded)).next() {
            // The first entry past `rel`'s children is outside it.
            let Some(child) = k.strip_prefix(rel).ok().and_then(|c| c.iter().next()) else {
                break;
            };
            names.push(child.to_os_string());
            let mut past = rel.join(child).into_os_string();
            past.push("\0");
            from = Included(PathBuf::from(past));
        }
        names
    }
}

impl UpperLayer for Fingerprint {
    type Leaf = EntryPrint;

    fn lookup(&self, rel: &Path) -> Result<Option<UpperEntry<EntryPrint>>, ChangesError> {
        Ok(self.entries.get(rel).map(|e| match e.kind {
            EntryKind::Whiteout => UpperEntry::Whiteout,
            EntryKind::Dir => UpperEntry::Dir { opaque: e.opaque },
            _ => UpperEntry::Leaf(e.clone()),
        }))
    }

    fn names(&self, rel: &Path) -> Result<Vec<OsString>, ChangesError> {
        Ok(self.child_names(rel))
    }
}

fn time_ns(secs: i64, nsec: i64) -> i128 {
    i128::from(secs) * 1_000_000_000 + i128::from(nsec)
}

fn now_ns() -> i128 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i128::try_from(now.as_nanos()).unwrap_or(i128::MAX)
}

/// The sha256 of a regular file's content, read from its descriptor.
fn digest_node(node: &Node) -> Result<[u8; 32], LayersError> {
    let (mut file, _) = node.open_file()?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(|e| node.error("read", e))?;
    Ok(hasher.finalize().into())
}

/// The digest of the regular file at `rel` in `upper` now (`None`: no regular file there).
fn digest_at(upper: &Tree, rel: &Path) -> Result<Option<[u8; 32]>, LayersError> {
    match upper.node(rel)? {
        Some(node) if node.meta().is_file() => digest_node(&node).map(Some),
        _ => Ok(None),
    }
}

/// The fingerprint of one entry; `taken_ns` is when the fingerprint started (`None`: no racy
/// digest needed, for a comparison).
fn entry_print(node: &Node, taken_ns: Option<i128>) -> Result<EntryPrint, LayersError> {
    let meta = node.meta();
    let ft = meta.file_type();
    let mut opaque = false;
    let kind = if ft.is_dir() {
        opaque = overlay_attrs(node)?.opaque;
        EntryKind::Dir
    } else if ft.is_file() {
        if meta.len() == 0 && overlay_attrs(node)?.whiteout {
            EntryKind::Whiteout
        } else {
            EntryKind::File
        }
    } else if ft.is_symlink() {
        EntryKind::Symlink
    } else if ft.is_char_device() {
        if meta.rdev() == 0 {
            EntryKind::Whiteout
        } else {
            EntryKind::CharDevice
        }
    } else if ft.is_block_device() {
        EntryKind::BlockDevice
    } else if ft.is_fifo() {
        EntryKind::Fifo
    } else {
        EntryKind::Socket
    };
    let ctime_ns = time_ns(meta.ctime(), meta.ctime_nsec());
    let racy =
        kind == EntryKind::File && taken_ns.is_some_and(|taken| ctime_ns >= taken - RACY_WINDOW_NS);
    let digest = if racy && meta.len() <= RACY_DIGEST_LIMIT {
        match digest_node(node) {
            Ok(d) => Some(d),
            // A file the sandbox made unreadable (chmod a-r) is unreadable to a supervisor
            // without capabilities too: no digest, so it counts as changed (the safe side).
            Err(LayersError::Io(e)) if e.source.kind() == io::ErrorKind::PermissionDenied => None,
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    Ok(EntryPrint {
        kind,
        size: meta.len(),
        mtime_ns: time_ns(meta.mtime(), meta.mtime_nsec()),
        ctime_ns,
        ino: meta.ino(),
        mode: meta.mode(),
        opaque,
        racy,
        digest,
    })
}

/// Records every entry of the upper tree (see [`Fingerprint`]). Cost: one look-up per entry, an
/// xattr listing per directory and per empty file, and a hash of the files changed just before.
/// An entry a racing rename removed after it was listed is left out.
pub fn fingerprint(upper: &Path) -> Result<Fingerprint, LayersError> {
    let taken = now_ns();
    let tree = Tree::open(upper, UPPER)?;
    let mut entries = BTreeMap::new();
    entries.insert(
        PathBuf::new(),
        entry_print(&tree.root_node()?, Some(taken))?,
    );
    let mut unnamed: Option<PathBuf> = None;
    let mut stack = vec![PathBuf::new()];
    while let Some(dir) = stack.pop() {
        for name in tree.names(&dir)?.unwrap_or_default() {
            let rel = dir.join(&name);
            if !tree::nameable(&rel) {
                // Out of reach by path: left out, and said.
                tree::note_unnamed(&mut unnamed, &dir);
                continue;
            }
            let Some(node) = tree.node(&rel)? else {
                continue;
            };
            if node.meta().is_dir() {
                stack.push(rel.clone());
            }
            entries.insert(rel, entry_print(&node, Some(taken))?);
        }
    }
    Ok(Fingerprint { entries, unnamed })
}

/// Whether an entry hides the lower tree beneath it.
fn hides_lower(e: Option<&EntryPrint>) -> bool {
    e.is_some_and(|e| e.kind != EntryKind::Dir || e.opaque)
}

/// What one exec changed: `before` and `after` are fingerprints of `upper` taken around it (the
/// module doc gives the semantics). Looks at the entries whose fingerprint differs, and at the
/// lower entries beneath those that started or stopped hiding the lower tree.
pub fn exec_changes(
    before: &Fingerprint,
    after: &Fingerprint,
    upper: &Path,
    lower: &Path,
) -> Result<Vec<Change>, LayersError> {
    // The usual exec changes nothing: the same entries, with the same metadata, none of them
    // racy, need neither tree opened (two look-ups on every exec's way).
    let untouched = before.entries.len() == after.entries.len()
        && before
            .entries
            .iter()
            .zip(&after.entries)
            .all(|((rb, b), (ra, a))| rb == ra && !b.racy && b.same_metadata(a));
    if untouched {
        return Ok(Vec::new());
    }
    let upper = Tree::open(upper, UPPER)?;
    let lower = Tree::open(lower, WORKSPACE)?;
    let mut candidates = BTreeSet::new();
    let mut consider = |rel: &Path, b: Option<&EntryPrint>, a: Option<&EntryPrint>| {
        if rel.as_os_str().is_empty() {
            // The root itself is never a change; only its opaque flag matters.
            if hides_lower(b) != hides_lower(a) {
                add_lower_beneath(&lower, rel, &mut candidates)?;
            }
            return Ok::<(), LayersError>(());
        }
        if hides_lower(b) != hides_lower(a) {
            add_lower_beneath(&lower, rel, &mut candidates)?;
        }
        candidates.insert(rel.to_path_buf());
        Ok(())
    };
    for (rel, b) in &before.entries {
        match after.entries.get(rel) {
            Some(a) if !b.changed(a, || digest_at(&upper, rel))? => {}
            a => consider(rel, Some(b), a)?,
        }
    }
    for (rel, a) in &after.entries {
        if !before.entries.contains_key(rel) {
            consider(rel, None, Some(a))?;
        }
    }
    let u = UpperDir(&upper);
    let old = View::new(Some(before), Some(&lower));
    let new = View::new(Some(&u), Some(&lower));
    let mut bufs = CompareBufs::new();
    let mut differs = |o: &Resolved<EntryPrint>, n: &Resolved<Node>| match (o, n) {
        (Resolved::Upper(was), Resolved::Upper(now)) => {
            was.changed(&entry_print(now, None)?, || match now.meta().is_file() {
                true => digest_node(now).map(Some),
                false => Ok(None),
            })
        }
        (Resolved::Lower(a), Resolved::Upper(b)) => Ok(leaves_differ(a, b, &mut bufs)?),
        (Resolved::Lower(_), Resolved::Lower(_)) => Ok(false),
        // Upper before, lower now: the upper entry vanished without a whiteout; what it held
        // is unknown.
        _ => Ok(true),
    };
    let mut classifier = Classifier { out: Vec::new() };
    for rel in &candidates {
        classifier.classify(rel, &old, &new, &mut differs)?;
    }
    Ok(classifier.finish())
}

// ---------------------------------------------------------------------------------------------
// export

/// A change path as a relative path of plain components: no `.`, `..`, empty component, NUL or
/// leading `/`; `path/` (a directory entry) is allowed and returned without the slash.
fn plain_rel(path: &str) -> Option<(&Path, bool)> {
    let (body, dir) = match path.strip_suffix('/') {
        Some(body) => (body, true),
        None => (path, false),
    };
    let ok = !body.is_empty()
        && !body.contains('\0')
        && body
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    let rel = Path::new(body);
    (ok && rel.components().all(|c| matches!(c, Component::Normal(_)))).then_some((rel, dir))
}

/// Writes a tar of the change to `out`: first [`DELETED_MEMBER`] (the `Deleted` paths, sorted,
/// one per line), then each `Added` or `Modified` path, sorted, as the sandbox sees it: regular
/// files with their content, symlinks with their target, fifos, and empty directories (`path/`).
/// The archive is deterministic: GNU headers, owner 0:0 without names, the permission bits and
/// mtime (seconds) of the file (of the descriptor its content is read from), no atime, ctime or
/// xattrs; the deleted list has mode 0644 and mtime 0. Parent directories are not members. A
/// change at [`DELETED_MEMBER`] itself, a path that is not plain, or a deleted path holding a
/// newline is refused.
pub fn export_tar(
    upper: &Path,
    lower: &Path,
    changes: &[Change],
    out: &mut impl Write,
) -> Result<(), LayersError> {
    let mut sorted: Vec<&Change> = changes.iter().collect();
    sorted.sort();
    sorted.dedup();
    let export_err = |path: &str, detail| LayersError::Export {
        path: path.to_owned(),
        detail,
    };
    let mut deleted = String::new();
    for c in &sorted {
        if plain_rel(&c.path).is_none() {
            return Err(export_err(
                &c.path,
                "not a relative path inside the workspace",
            ));
        }
        if c.path.trim_end_matches('/') == DELETED_MEMBER {
            return Err(export_err(
                &c.path,
                "the name is reserved for the deleted list",
            ));
        }
        if c.kind == ChangeKind::Deleted {
            if c.path.contains('\n') {
                return Err(export_err(&c.path, "a deleted path holds a newline"));
            }
            deleted.push_str(&c.path);
            deleted.push('\n');
        }
    }
    let upper = Tree::open(upper, UPPER)?;
    let lower = Tree::open(lower, WORKSPACE)?;
    let mut builder = tar::Builder::new(out);
    let header = |kind: tar::EntryType, mode: u32, mtime: u64, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode & HOST_MODE_BITS);
        h.set_mtime(mtime);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(size);
        h
    };
    let mut h = header(tar::EntryType::Regular, 0o644, 0, deleted.len() as u64);
    builder
        .append_data(&mut h, DELETED_MEMBER, deleted.as_bytes())
        .map_err(LayersError::Tar)?;

    let u = UpperDir(&upper);
    let view = View::new(Some(&u), Some(&lower));
    for c in sorted.iter().filter(|c| c.kind != ChangeKind::Deleted) {
        let Some((rel, dir)) = plain_rel(&c.path) else {
            continue;
        };
        let mtime = |m: &Metadata| u64::try_from(m.mtime()).unwrap_or(0);
        match view.resolve(rel)? {
            Resolved::Dir { .. } if dir => {
                let (mode, time) = match upper.node(rel)? {
                    Some(n) => (n.meta().mode(), mtime(n.meta())),
                    None => (0o755, 0),
                };
                let mut h = header(tar::EntryType::Directory, mode, time, 0);
                builder
                    .append_data(&mut h, rel, io::empty())
                    .map_err(LayersError::Tar)?;
            }
            Resolved::Upper(leaf) | Resolved::Lower(leaf) if !dir => {
                let ft = leaf.meta().file_type();
                if ft.is_file() {
                    // The header says what the descriptor read here holds.
                    let (file, meta) = leaf.open_file()?;
                    let mut h = header(
                        tar::EntryType::Regular,
                        meta.mode(),
                        mtime(&meta),
                        meta.len(),
                    );
                    let mut counting = CountingReader {
                        inner: file.take(meta.len()),
                        n: 0,
                    };
                    builder
                        .append_data(&mut h, rel, &mut counting)
                        .map_err(LayersError::Tar)?;
                    if counting.n != meta.len() {
                        return Err(export_err(&c.path, "the file changed while it was read"));
                    }
                } else if ft.is_symlink() {
                    let target = leaf.read_link()?;
                    let mut h = header(tar::EntryType::Symlink, 0o777, mtime(leaf.meta()), 0);
                    builder
                        .append_link(&mut h, rel, &target)
                        .map_err(LayersError::Tar)?;
                } else if ft.is_fifo() {
                    let meta = leaf.meta();
                    let mut h = header(tar::EntryType::Fifo, meta.mode(), mtime(meta), 0);
                    builder
                        .append_data(&mut h, rel, io::empty())
                        .map_err(LayersError::Tar)?;
                } else {
                    return Err(LayersError::Unsupported {
                        op: "export",
                        layer: leaf.layer(),
                        path: leaf.rel().to_path_buf(),
                        kind: "a socket or device node",
                    });
                }
            }
            _ => return Err(export_err(&c.path, "not in the sandbox's tree as listed")),
        }
    }
    builder.finish().map_err(LayersError::Tar)?;
    Ok(())
}

struct CountingReader<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------------
// apply to the host

/// Directory-relative calls for [`apply_to_host`]; every path given here is one plain component
/// or a path of plain components checked by `plain_rel`.
mod hostfs {
    use super::*;

    /// Opens the directory `rel` beneath `dir` for use as a dirfd: never through a symlink
    /// (`RESOLVE_NO_SYMLINKS`), never out of `dir` (`RESOLVE_BENEATH`), no magic links.
    pub(super) fn open_dir_beneath(dir: RawFd, rel: &Path) -> io::Result<OwnedFd> {
        let c = CString::new(rel.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the callers pass a descriptor they hold open for the whole call.
        let dir = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
        sys::openat2(
            &dir,
            &c,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
            sys::BENEATH_NOFOLLOW,
        )
        .map_err(io::Error::from)
    }

    /// `lstat` of `name` in `dir`; `None` when absent.
    pub(super) fn stat_at(dir: RawFd, name: &OsStr) -> io::Result<Option<libc::stat>> {
        use nix::fcntl::AtFlags;
        match nix::sys::stat::fstatat(Some(dir), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Creates `name` in `dir` exclusively for writing, never through a symlink.
    pub(super) fn create_at(dir: RawFd, name: &OsStr) -> io::Result<File> {
        let fd = nix::fcntl::openat(
            Some(dir),
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )?;
        // SAFETY: `fd` was just returned by openat and is owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }
}

/// What to write for one change.
enum Source {
    Delete,
    Dir {
        mode: u32,
    },
    /// A regular file of the upper layer, read (content and mode) when it is written.
    File,
    Symlink {
        target: PathBuf,
    },
}

struct Planned<'a> {
    change: &'a Change,
    rel: &'a Path,
    dir: bool,
    source: Source,
}

/// Paths under a `.git` component (the repository's own metadata, or a submodule's).
fn protected(rel: &Path) -> bool {
    rel.components().any(|c| c.as_os_str() == ".git")
}

/// Writes the sandbox's change into the host workspace directory `host` and returns the changes
/// applied (sorted; a deletion whose path was already gone, or a directory left non-empty, is not
/// listed).
///
/// - `Added`/`Modified` regular files are copied from `upper` into a temporary file beside the
///   target and renamed over it (with the permission bits of the file whose content was read);
///   symlinks are created the same way; `path/` creates the directory. Missing parents are
///   created one level at a time.
/// - `Deleted` files are removed; a directory is removed only when it is empty once its listed
///   entries are gone and the sandbox no longer shows a directory there.
/// - Safety: `upper` and the host workspace are read as [`Tree`]s; every host directory is
///   opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` and
///   the last component is handled with `*at` calls that never follow it: a symlink at a target
///   path is replaced, not written through.
/// - Refused, before anything is written, with every offending path listed: a path that is not
///   plain (absolute, `..`, `.`, empty component, NUL), a path with a `.git` component, a fifo,
///   socket or device in upper, a change `upper` does not hold, a host parent that is a symlink
///   or not a directory (unless the change deletes it), a file to delete that is a directory on
///   the host. Failures of the host filesystem after that point, or an upper file that a racing
///   rename replaced, can leave the change half applied.
/// - When run as root, written files take the owner of the file they replace or else of their
///   directory, so the workspace stays its owner's.
///
/// Modes keep their permission bits only ([`HOST_MODE_BITS`]): a setuid, setgid or sticky bit the
/// sandbox set stays behind, as in an exported tar (the diff still shows the sandbox's mode).
pub fn apply_to_host(
    upper: &Path,
    host: &Path,
    changes: &[Change],
) -> Result<Vec<Change>, LayersError> {
    let mut sorted: Vec<&Change> = changes.iter().collect();
    sorted.sort();
    sorted.dedup();
    let upper = Tree::open(upper, UPPER)?;
    let u = UpperDir(&upper);
    let upper_only = View::new(Some(&u), None);
    let mut problems = Vec::new();
    let mut refuse = |path: &str, reason| {
        problems.push(Refusal {
            path: path.to_owned(),
            reason,
        })
    };
    let mut plan = Vec::new();
    for c in &sorted {
        let Some((rel, dir)) = plain_rel(&c.path) else {
            refuse(&c.path, "not a relative path inside the workspace");
            continue;
        };
        if protected(rel) {
            refuse(&c.path, "protected path under .git");
            continue;
        }
        let source = match (c.kind, upper_only.resolve(rel)?) {
            (ChangeKind::Deleted, _) => Source::Delete,
            (_, Resolved::Dir { .. }) if dir => {
                let mode = upper
                    .node(rel)?
                    .map_or(0o755, |n| n.meta().mode() & HOST_MODE_BITS);
                Source::Dir { mode }
            }
            (_, Resolved::Upper(leaf)) if !dir => {
                let ft = leaf.meta().file_type();
                if ft.is_file() {
                    Source::File
                } else if ft.is_symlink() {
                    Source::Symlink {
                        target: leaf.read_link()?,
                    }
                } else {
                    refuse(&c.path, "special file (fifo, socket or device)");
                    continue;
                }
            }
            _ => {
                refuse(&c.path, "not in the upper layer (stale change list)");
                continue;
            }
        };
        plan.push(Planned {
            change: c,
            rel,
            dir,
            source,
        });
    }

    let root_rel = Path::new("");
    let root = File::open(host).map_err(lio("open", HOST, root_rel))?;
    let root_fd = root.as_raw_fd();
    let deleted: BTreeSet<&Path> = plan
        .iter()
        .filter(|p| matches!(p.source, Source::Delete))
        .map(|p| p.rel)
        .collect();
    for p in &plan {
        let parent = p.rel.parent().unwrap_or(Path::new(""));
        let parent_fd = if parent.as_os_str().is_empty() {
            None
        } else {
            match hostfs::open_dir_beneath(root_fd, parent) {
                Ok(fd) => Some(fd),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(_) => {
                    if !p.rel.ancestors().skip(1).any(|a| deleted.contains(a)) {
                        refuse(
                            &p.change.path,
                            "a parent on the host is a symlink or not a directory",
                        );
                    }
                    continue;
                }
            }
        };
        let dirfd = parent_fd.as_ref().map_or(root_fd, AsRawFd::as_raw_fd);
        if matches!(p.source, Source::Delete) && !p.dir {
            let name = p.rel.file_name().unwrap_or_default();
            let st = hostfs::stat_at(dirfd, name).map_err(lio("stat", HOST, p.rel))?;
            if st.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR) {
                refuse(&p.change.path, "a directory on the host");
            }
        }
    }
    if !problems.is_empty() {
        return Err(LayersError::Refused { problems });
    }

    let host_tree = Tree::open(host, HOST)?;
    let mut applier = Applier {
        upper: &upper,
        root_fd,
        // SAFETY: geteuid cannot fail and touches no memory.
        root_user: unsafe { libc::geteuid() } == 0,
        applied: Vec::new(),
        tmp_counter: 0,
    };
    // Deletions first (deepest first), so a type change frees the name before it is reused.
    for p in plan.iter().rev() {
        if matches!(p.source, Source::Delete) {
            applier.delete(p)?;
        }
    }
    let merged = View::new(Some(&u), Some(&host_tree));
    let mut emptied: BTreeSet<&Path> = BTreeSet::new();
    for rel in &deleted {
        emptied.extend(
            rel.ancestors()
                .skip(1)
                .filter(|a| !a.as_os_str().is_empty()),
        );
    }
    for dir in emptied.iter().rev() {
        if protected(dir) || matches!(merged.resolve(dir)?, Resolved::Dir { .. }) {
            continue;
        }
        applier.remove_empty_dir(dir)?;
    }
    for p in &plan {
        match &p.source {
            Source::Delete => {}
            Source::Dir { mode } => applier.make_dir(p, *mode)?,
            Source::File => applier.write_file(p)?,
            Source::Symlink { target } => applier.write_symlink(p, target)?,
        }
    }
    let mut applied = applier.applied;
    applied.sort();
    Ok(applied)
}

struct Applier<'a> {
    upper: &'a Tree,
    root_fd: RawFd,
    root_user: bool,
    applied: Vec<Change>,
    tmp_counter: u64,
}

impl Applier<'_> {
    /// Opens the host directory `rel` (`""`: the root); `None` when it does not exist.
    fn open_dir(&self, rel: &Path) -> Result<Option<OwnedFd>, LayersError> {
        if rel.as_os_str().is_empty() {
            return hostfs::open_dir_beneath(self.root_fd, Path::new("."))
                .map(Some)
                .map_err(lio("open", HOST, rel));
        }
        match hostfs::open_dir_beneath(self.root_fd, rel) {
            Ok(fd) => Ok(Some(fd)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(lio("open directory", HOST, rel)(e)),
        }
    }

    /// Opens the host directory `rel`, creating what is missing one level at a time.
    fn ensure_dir(&self, rel: &Path) -> Result<OwnedFd, LayersError> {
        if let Some(fd) = self.open_dir(rel)? {
            return Ok(fd);
        }
        let mut cur = self.open_dir(Path::new(""))?.ok_or_else(|| {
            lio("open", HOST, Path::new(""))(io::Error::from(io::ErrorKind::NotFound))
        })?;
        let mut prefix = PathBuf::new();
        for component in rel.components() {
            let name = component.as_os_str();
            prefix.push(name);
            let next = match hostfs::open_dir_beneath(cur.as_raw_fd(), Path::new(name)) {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    match mkdirat(Some(cur.as_raw_fd()), name, Mode::from_bits_truncate(0o755)) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(nio("create directory", HOST, &prefix)(e)),
                    }
                    self.own_like_parent(cur.as_raw_fd(), name, &prefix)?;
                    hostfs::open_dir_beneath(cur.as_raw_fd(), Path::new(name)).map_err(lio(
                        "open directory",
                        HOST,
                        &prefix,
                    ))?
                }
                Err(e) => return Err(lio("open directory", HOST, &prefix)(e)),
            };
            cur = next;
        }
        Ok(cur)
    }

    /// As root, gives `name` in `dir` the owner of `dir` (not following a symlink).
    fn own_like_parent(&self, dir: RawFd, name: &OsStr, rel: &Path) -> Result<(), LayersError> {
        if !self.root_user {
            return Ok(());
        }
        let st = nix::sys::stat::fstat(dir).map_err(nio("stat", HOST, rel))?;
        self.chown_at(dir, name, st.st_uid, st.st_gid, rel)
    }

    fn chown_at(
        &self,
        dir: RawFd,
        name: &OsStr,
        uid: u32,
        gid: u32,
        rel: &Path,
    ) -> Result<(), LayersError> {
        nix::unistd::fchownat(
            Some(dir),
            name,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(nio("change owner of", HOST, rel))
    }

    fn split<'p>(&self, rel: &'p Path) -> (&'p Path, &'p OsStr) {
        (
            rel.parent().unwrap_or(Path::new("")),
            rel.file_name().unwrap_or_default(),
        )
    }

    fn delete(&mut self, p: &Planned<'_>) -> Result<(), LayersError> {
        let (parent, name) = self.split(p.rel);
        let Some(dir) = self.open_dir(parent)? else {
            return Ok(());
        };
        let flag = if p.dir {
            UnlinkatFlags::RemoveDir
        } else {
            UnlinkatFlags::NoRemoveDir
        };
        match unlinkat(Some(dir.as_raw_fd()), name, flag) {
            Ok(()) => self.applied.push(p.change.clone()),
            Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST) if p.dir => {}
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(nio("remove", HOST, p.rel)(e)),
        }
        Ok(())
    }

    fn remove_empty_dir(&mut self, rel: &Path) -> Result<(), LayersError> {
        let (parent, name) = self.split(rel);
        let Some(dir) = self.open_dir(parent)? else {
            return Ok(());
        };
        match unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST | Errno::ENOTDIR) => {
                Ok(())
            }
            Err(e) => Err(nio("remove directory", HOST, rel)(e)),
        }
    }

    fn make_dir(&mut self, p: &Planned<'_>, mode: u32) -> Result<(), LayersError> {
        let (parent, name) = self.split(p.rel);
        let dir = self.ensure_dir(parent)?;
        match mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(mode)) {
            Ok(()) => {
                self.own_like_parent(dir.as_raw_fd(), name, p.rel)?;
                self.applied.push(p.change.clone());
                Ok(())
            }
            Err(Errno::EEXIST) => {
                let st =
                    hostfs::stat_at(dir.as_raw_fd(), name).map_err(lio("stat", HOST, p.rel))?;
                if st.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR) {
                    Ok(())
                } else {
                    Err(nio("create directory", HOST, p.rel)(Errno::EEXIST))
                }
            }
            Err(e) => Err(nio("create directory", HOST, p.rel)(e)),
        }
    }

    /// A fresh temporary name in the target's directory.
    fn tmp_name(&mut self) -> OsString {
        self.tmp_counter += 1;
        OsString::from(format!(
            ".taskbox-apply.{}.{}",
            std::process::id(),
            self.tmp_counter
        ))
    }

    /// Renames `tmp` over `name` in `dir` (replacing a symlink there, never following it), after
    /// giving it, as root, the owner of what it replaces or of the directory.
    fn install(
        &mut self,
        dir: RawFd,
        tmp: &OsStr,
        name: &OsStr,
        rel: &Path,
    ) -> Result<(), LayersError> {
        let result = (|| {
            if self.root_user {
                let owner = match hostfs::stat_at(dir, name).map_err(lio("stat", HOST, rel))? {
                    Some(st) => (st.st_uid, st.st_gid),
                    None => {
                        let st = nix::sys::stat::fstat(dir).map_err(nio("stat", HOST, rel))?;
                        (st.st_uid, st.st_gid)
                    }
                };
                self.chown_at(dir, tmp, owner.0, owner.1, rel)?;
            }
            renameat(Some(dir), tmp, Some(dir), name).map_err(nio("rename into", HOST, rel))
        })();
        if result.is_err() {
            let _ = unlinkat(Some(dir), tmp, UnlinkatFlags::NoRemoveDir);
        }
        result
    }

    /// Writes the upper layer's regular file at the planned path, with the permission bits of
    /// the descriptor its content is read from.
    fn write_file(&mut self, p: &Planned<'_>) -> Result<(), LayersError> {
        let node = match self.upper.node(p.rel)? {
            Some(node) if node.meta().is_file() => node,
            _ => {
                return Err(LayersError::Export {
                    path: p.change.path.clone(),
                    detail: "no longer a regular file of the upper layer (it changed while the \
                             change was applied)",
                });
            }
        };
        let (mut from, meta) = node.open_file()?;
        let mode = meta.mode() & HOST_MODE_BITS;
        let (parent, name) = self.split(p.rel);
        let dir = self.ensure_dir(parent)?;
        let tmp = self.tmp_name();
        let mut to =
            hostfs::create_at(dir.as_raw_fd(), &tmp).map_err(lio("create", HOST, p.rel))?;
        let written = io::copy(&mut from, &mut to)
            .map_err(lio("write", HOST, p.rel))
            .and_then(|_| {
                to.set_permissions(fs::Permissions::from_mode(mode))
                    .map_err(lio("set mode of", HOST, p.rel))
            });
        drop(to);
        if let Err(e) = written {
            let _ = unlinkat(
                Some(dir.as_raw_fd()),
                tmp.as_os_str(),
                UnlinkatFlags::NoRemoveDir,
            );
            return Err(e);
        }
        self.install(dir.as_raw_fd(), &tmp, name, p.rel)?;
        self.applied.push(p.change.clone());
        Ok(())
    }

    fn write_symlink(&mut self, p: &Planned<'_>, target: &Path) -> Result<(), LayersError> {
        let (parent, name) = self.split(p.rel);
        let dir = self.ensure_dir(parent)?;
        let tmp = self.tmp_name();
        symlinkat(target, Some(dir.as_raw_fd()), tmp.as_os_str()).map_err(nio(
            "create symlink",
            HOST,
            p.rel,
        ))?;
        self.install(dir.as_raw_fd(), &tmp, name, p.rel)?;
        self.applied.push(p.change.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::scan;
    use crate::testutil::{
        OverlayDirs, attrs, change, chmod, node, run_overlay, set_xattr, skip, write,
    };
    use ChangeKind::{Added, Deleted, Modified};
    use nix::sys::stat::mknod;
    use std::os::unix::fs::symlink;

    const ENTRY: &str = "layers::tests::overlay_child";

    fn populate_lower(lower: &Path) {
        write(lower, "keep.txt", "keep\n");
        write(lower, "m.txt", "m1\n");
        write(lower, "r.txt", "r\n");
        write(lower, "t.txt", "t\n");
        write(lower, "gone.txt", "gone\n");
        write(lower, "twice.txt", "t\n");
        write(lower, "dir/x.txt", "x\n");
        write(lower, "dir/y.txt", "y\n");
        write(lower, "opaque/o1.txt", "o1\n");
        write(lower, "opaque/o2.txt", "o2\n");
        chmod(&lower.join("keep.txt"), 0o644);
    }

    fn append(path: &Path, text: &str) -> io::Result<()> {
        let mut f = fs::OpenOptions::new().append(true).open(path)?;
        f.write_all(text.as_bytes())
    }

    /// The operations of the overlay sessions, performed through the merged directory `m`.
    fn operate(op: &str, m: &Path) -> io::Result<()> {
        match op {
            // Before a checkpoint, and the copy round trip.
            "s1" => {
                fs::write(m.join("new.txt"), "new\n")?;
                fs::write(m.join("m.txt"), "m2\n")?;
                fs::remove_file(m.join("gone.txt"))?;
                fs::write(m.join("r.txt"), "r-changed\n")?;
                fs::write(m.join("twice.txt"), "t2\n")?;
                fs::remove_dir_all(m.join("opaque"))?;
                fs::create_dir(m.join("opaque"))?;
                fs::write(m.join("opaque/o1.txt"), "uno\n")?;
                symlink("keep.txt", m.join("link"))?;
                nix::unistd::mkfifo(&m.join("pipe"), Mode::S_IRWXU)?;
                fs::hard_link(m.join("new.txt"), m.join("hard.txt"))?;
                fs::create_dir_all(m.join("empty/inner"))?;
                fs::set_permissions(m.join("r.txt"), fs::Permissions::from_mode(0o600))?;
            }
            // After the checkpoint.
            "s2" => {
                fs::write(m.join("new2.txt"), "n2\n")?;
                fs::write(m.join("new.txt"), "new!\n")?;
                fs::write(m.join("keep.txt"), "keep2\n")?;
                fs::remove_file(m.join("m.txt"))?;
                fs::write(m.join("twice.txt"), "tmp\n")?;
                fs::write(m.join("twice.txt"), "t2\n")?;
                fs::write(m.join("gone.txt"), "back\n")?;
                fs::remove_dir_all(m.join("dir"))?;
                fs::write(m.join("r.txt"), "r\n")?;
            }
            // Two successive execs.
            "e1" => {
                fs::write(m.join("new.txt"), "new\n")?;
                fs::write(m.join("m.txt"), "m2\n")?;
                let f = fs::OpenOptions::new().append(true).open(m.join("t.txt"))?;
                f.set_modified(SystemTime::now())?;
                drop(f);
                fs::remove_file(m.join("gone.txt"))?;
                fs::create_dir(m.join("emptydir"))?;
            }
            "e2" => {
                append(&m.join("m.txt"), "more\n")?;
                fs::remove_file(m.join("new.txt"))?;
                fs::remove_dir_all(m.join("dir"))?;
                fs::write(m.join("scratch.txt"), "tmp\n")?;
                fs::remove_file(m.join("scratch.txt"))?;
            }
            _ => {
                let out = op
                    .strip_prefix("dump:")
                    .ok_or(io::ErrorKind::InvalidInput)?;
                fs::write(out, dump(m)?)?;
            }
        }
        Ok(())
    }

    /// A listing of the tree at `root`: path, type and mode, content or target; sorted.
    fn dump(root: &Path) -> io::Result<String> {
        let mut lines = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(root.join(&dir))? {
                let rel = dir.join(entry?.file_name());
                let path = root.join(&rel);
                let meta = fs::symlink_metadata(&path)?;
                let what = if meta.is_dir() {
                    stack.push(rel.clone());
                    String::new()
                } else if meta.is_file() {
                    String::from_utf8_lossy(&fs::read(&path)?).into_owned()
                } else if meta.file_type().is_symlink() {
                    fs::read_link(&path)?.display().to_string()
                } else {
                    format!("rdev {}", meta.rdev())
                };
                lines.push(format!("{} {:o} {what:?}", rel.display(), meta.mode()));
            }
        }
        lines.sort();
        Ok(lines.join("\n"))
    }

    /// Runs in the re-executed test binary, already in its own user and mount namespaces.
    #[test]
    fn overlay_child() {
        crate::testutil::overlay_child(operate);
    }

    /// A lower tree and an overlay over it; `None` (test skipped) when overlays cannot be
    /// mounted here.
    fn session(dirs: &OverlayDirs, op: &str) -> bool {
        match run_overlay(ENTRY, dirs, op) {
            Ok(()) => true,
            Err(reason) => {
                skip(&reason);
                false
            }
        }
    }

    fn overlay() -> (tempfile::TempDir, OverlayDirs) {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = OverlayDirs::create(tmp.path());
        populate_lower(&dirs.lower);
        (tmp, dirs)
    }

    #[test]
    fn copy_layer_round_trip_keeps_whiteouts_opaque_dirs_and_the_merged_view() {
        let (tmp, dirs) = overlay();
        if !session(&dirs, "s1") {
            return;
        }
        let ckpt = tmp.path().join("ckpt");
        let n = copy_layer(&dirs.upper, &ckpt).unwrap();
        assert!(n >= 10, "{n}");
        let wo = fs::symlink_metadata(ckpt.join("gone.txt")).unwrap();
        assert!(wo.file_type().is_char_device() && wo.rdev() == 0);
        assert!(attrs(&ckpt.join("opaque")).opaque);
        assert!(
            fs::symlink_metadata(ckpt.join("pipe"))
                .unwrap()
                .file_type()
                .is_fifo()
        );
        assert_eq!(
            fs::read_link(ckpt.join("link")).unwrap(),
            Path::new("keep.txt")
        );
        let (a, b) = (
            fs::metadata(ckpt.join("new.txt")).unwrap(),
            fs::metadata(ckpt.join("hard.txt")).unwrap(),
        );
        assert_eq!(a.ino(), b.ino(), "hard links stay linked");
        let src = fs::metadata(dirs.upper.join("r.txt")).unwrap();
        let dst = fs::metadata(ckpt.join("r.txt")).unwrap();
        assert_eq!(src.mode(), dst.mode());
        assert_eq!(src.modified().unwrap(), dst.modified().unwrap());
        assert_eq!(
            scan(&ckpt, &dirs.lower).unwrap(),
            scan(&dirs.upper, &dirs.lower).unwrap()
        );
        // The destination must be new.
        assert!(copy_layer(&dirs.upper, &ckpt).is_err());

        // Mounted on the same lower tree, the copy shows the same merged view.
        let original = tmp.path().join("original.dump");
        let copied = tmp.path().join("copied.dump");
        assert!(session(&dirs, &format!("dump:{}", original.display())));
        let scratch = tmp.path().join("scratch");
        let copy_dirs = dirs.with_upper(&ckpt, &scratch);
        assert!(session(&copy_dirs, &format!("dump:{}", copied.display())));
        let original = fs::read_to_string(original).unwrap();
        assert!(original.contains("opaque/o1.txt"), "{original}");
        assert!(!original.contains("gone.txt"));
        assert_eq!(original, fs::read_to_string(copied).unwrap());
    }

    /// A sandbox can nest directories until a path no longer fits PATH_MAX (about 2,000
    /// levels of `d/`); freezing that for a fork or a checkpoint overflowed the supervisor's
    /// 2 MiB worker stack while the copy recursed, and took every sandbox with it.
    #[test]
    fn a_layer_two_thousand_directories_deep_is_copied_on_a_small_stack() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let leaf = deep_tree(&src, &["f"], false);
        let depth = leaf.strip_prefix(&src).unwrap().components().count();
        let dst = tmp.path().join("dst");
        let (from, to) = (src.clone(), dst.clone());
        // A quarter of a worker's stack: recursion over the depth would need several times it.
        let copied = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(move || copy_layer(&from, &to))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(copied, depth as u64 + 1);
        let copy = dst.join(leaf.strip_prefix(&src).unwrap()).join("f");
        assert_eq!(fs::read_to_string(copy).unwrap(), "deep\n");
    }

    /// A tree as deep as PATH_MAX allows under `root`, with the files `leaves` at the bottom
    /// and, when `ignores`, a `.gitignore` in every directory; returns the bottom directory.
    fn deep_tree(root: &Path, leaves: &[&str], ignores: bool) -> PathBuf {
        let depth = (4000 - root.as_os_str().len()) / 2;
        let mut bottom = root.to_path_buf();
        for _ in 0..depth {
            bottom.push("d");
        }
        fs::create_dir_all(&bottom).unwrap();
        for leaf in leaves {
            fs::write(bottom.join(leaf), "deep\n").unwrap();
        }
        if ignores {
            for dir in bottom.ancestors().take(depth) {
                fs::write(dir.join(".gitignore"), "*.tmp\n!keep.tmp\n/build/\n").unwrap();
            }
        }
        bottom
    }

    /// Each directory of a path was looked up again from the root for each of its prefixes,
    /// and its ignore rules matched again at each: a sandbox's `while mkdir d && cd d` cost the
    /// supervisor five minutes per exec (400 levels: 3.9 s; with the look-ups remembered along
    /// the walk, 27 ms).
    #[test]
    fn a_tree_as_deep_as_a_path_allows_is_classified_and_reviewed_in_bounded_time() {
        for ignores in [false, true] {
            let tmp = tempfile::tempdir().unwrap();
            let (upper, lower) = (tmp.path().join("u"), tmp.path().join("l"));
            fs::create_dir_all(&upper).unwrap();
            fs::create_dir_all(&lower).unwrap();
            fs::write(lower.join(".gitignore"), "*.log\n").unwrap();
            let before = fingerprint(&upper).unwrap();
            let bottom = deep_tree(&upper, &["f", "x.log"], ignores);
            let rel = |p: &Path| p.strip_prefix(&upper).unwrap().to_str().unwrap().to_owned();
            let t = std::time::Instant::now();
            let after = fingerprint(&upper).unwrap();
            let changes = exec_changes(&before, &after, &upper, &lower).unwrap();
            let r = crate::review::review(&upper, &lower, changes.clone(), &Default::default())
                .unwrap();
            let took = t.elapsed();
            let mut want: Vec<Change> = ["f", "x.log"]
                .iter()
                .map(|leaf| Change {
                    path: rel(&bottom.join(leaf)),
                    kind: Added,
                })
                .collect();
            if ignores {
                let depth = bottom.ancestors().count() - upper.ancestors().count();
                want.extend(bottom.ancestors().take(depth).map(|d| Change {
                    path: rel(&d.join(".gitignore")),
                    kind: Added,
                }));
                want.sort();
            }
            assert_eq!(changes, want, "ignore files in every directory: {ignores}");
            assert_eq!(r.shown.len() + r.ignored.len(), want.len());
            if !ignores {
                // The root's rule reaches the bottom.
                assert_eq!(r.ignored, [want[1].clone()], "{:?}", r.shown);
            }
            // Minutes before (hours on a debug build); about 2 s on a debug build now.
            assert!(took < Duration::from_secs(60), "took {took:?}");

            // The tree removed: the record of before lists each directory's children without
            // a pass over all beneath it (two and a half minutes on a debug build before).
            // rm walks by descriptor; std's remove_dir_all holds one per level, past an
            // unprivileged user's 1,024.
            let rm = std::process::Command::new("rm")
                .arg("-rf")
                .arg(upper.join("d"))
                .status()
                .unwrap();
            assert!(rm.success());
            let t = std::time::Instant::now();
            let gone = fingerprint(&upper).unwrap();
            let changes = exec_changes(&after, &gone, &upper, &lower).unwrap();
            let took = t.elapsed();
            for c in &mut want {
                c.kind = Deleted;
            }
            assert_eq!(changes, want);
            assert!(took < Duration::from_secs(60), "took {took:?}");
        }
    }

    #[test]
    fn a_tree_as_deep_as_a_path_allows_is_scanned_and_diffed_on_a_small_stack() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, lower) = (tmp.path().join("u"), tmp.path().join("l"));
        fs::create_dir_all(&lower).unwrap();
        let bottom = deep_tree(&upper, &["f"], false);
        let (u, l) = (upper.clone(), lower.clone());
        // A quarter of a worker's stack: recursion over the depth would need more.
        let (changes, diff) = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(move || {
                let changes = scan(&u, &l).unwrap();
                let diff = crate::changes::diff(&u, &l, &changes).unwrap();
                (changes, diff)
            })
            .unwrap()
            .join()
            .unwrap();
        let path = bottom
            .join("f")
            .strip_prefix(&upper)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(changes, [Change { path, kind: Added }]);
        assert_eq!(diff.stats.files, 1);
    }

    #[test]
    fn copy_layer_refuses_device_nodes() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        fs::create_dir(&src).unwrap();
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            // Only root can make a device node; the root run covers this test.
            eprintln!("not run: making a device node needs root");
            return;
        }
        // /dev/null's device number.
        let dev = libc::makedev(1, 3);
        if let Err(e) = mknod(&src.join("null"), SFlag::S_IFCHR, Mode::empty(), dev) {
            return skip(&format!("cannot mknod a device node as root: {e}"));
        }
        let err = copy_layer(&src, &tmp.path().join("dst")).unwrap_err();
        assert!(matches!(err, LayersError::Unsupported { .. }), "{err}");
        assert!(err.to_string().starts_with("cannot copy "), "{err}");
    }

    #[test]
    fn scan_between_checkpoint_and_now() {
        let (tmp, dirs) = overlay();
        if !session(&dirs, "s1") {
            return;
        }
        let ckpt = tmp.path().join("ckpt");
        copy_layer(&dirs.upper, &ckpt).unwrap();
        assert!(session(&dirs, "s2"));
        let changes = scan_between(&dirs.lower, &ckpt, &dirs.upper).unwrap();
        assert_eq!(
            changes,
            [
                change("dir/x.txt", Deleted),
                change("dir/y.txt", Deleted),
                // Deleted before the checkpoint, created again after it.
                change("gone.txt", Added),
                // A hard link of new.txt, so changed with it.
                change("hard.txt", Modified),
                change("keep.txt", Modified),
                change("m.txt", Deleted),
                change("new.txt", Modified),
                change("new2.txt", Added),
                // Back to the lower content, which differs from the checkpoint's.
                change("r.txt", Modified),
                // twice.txt: changed, then back to the checkpoint's content: no change.
            ]
        );

        // An empty base is the lower tree itself: the same result as scan.
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        assert_eq!(
            scan_between(&dirs.lower, &empty, &dirs.upper).unwrap(),
            scan(&dirs.upper, &dirs.lower).unwrap()
        );
        assert_eq!(
            scan_between(&dirs.lower, &empty, &ckpt).unwrap(),
            scan(&ckpt, &dirs.lower).unwrap()
        );
        assert!(
            scan_between(&dirs.lower, &dirs.upper, &dirs.upper)
                .unwrap()
                .is_empty()
        );
        // And backwards: restoring the checkpoint undoes exactly these.
        let back = scan_between(&dirs.lower, &dirs.upper, &ckpt).unwrap();
        let paths: Vec<&str> = back.iter().map(|c| c.path.as_str()).collect();
        let fwd: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, fwd);

        let d = diff_between(&dirs.lower, &ckpt, &dirs.upper, &changes).unwrap();
        assert!(
            d.text.contains(
                "diff --git a/new.txt b/new.txt\n--- a/new.txt\n+++ b/new.txt\n\
                 @@ -1 +1 @@\n-new\n+new!\n"
            ),
            "{}",
            d.text
        );
        assert!(
            d.text.contains(
                "diff --git a/r.txt b/r.txt\n--- a/r.txt\n+++ b/r.txt\n\
                 @@ -1 +1 @@\n-r-changed\n+r\n"
            ),
            "{}",
            d.text
        );
        assert!(
            d.text.contains(
                "diff --git a/m.txt b/m.txt\ndeleted file mode 100644\n--- a/m.txt\n\
                 +++ /dev/null\n@@ -1 +0,0 @@\n-m2\n"
            ),
            "{}",
            d.text
        );
        assert!(d.text.contains("+++ b/gone.txt\n@@ -0,0 +1 @@\n+back\n"));
        assert_eq!(d.stats.files, changes.len());
        let err =
            diff_between(&dirs.lower, &ckpt, &dirs.upper, &[change("nope", Added)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot diff nope: not a file in the current tree"
        );
    }

    #[test]
    fn exec_changes_across_two_execs() {
        let (_tmp, dirs) = overlay();
        let fp0 = fingerprint(&dirs.upper).unwrap();
        if !session(&dirs, "e1") {
            return;
        }
        let fp1 = fingerprint(&dirs.upper).unwrap();
        assert!(dirs.upper.join("t.txt").is_file(), "t.txt was copied up");
        assert_eq!(
            exec_changes(&fp0, &fp1, &dirs.upper, &dirs.lower).unwrap(),
            [
                change("emptydir/", Added),
                change("gone.txt", Deleted),
                change("m.txt", Modified),
                change("new.txt", Added),
            ]
        );
        assert!(
            exec_changes(&fp1, &fp1, &dirs.upper, &dirs.lower)
                .unwrap()
                .is_empty()
        );
        assert!(session(&dirs, "e2"));
        let fp2 = fingerprint(&dirs.upper).unwrap();
        assert_eq!(
            exec_changes(&fp1, &fp2, &dirs.upper, &dirs.lower).unwrap(),
            [
                change("dir/x.txt", Deleted),
                change("dir/y.txt", Deleted),
                change("m.txt", Modified),
                // Added by the first exec and removed without a whiteout.
                change("new.txt", Deleted),
            ]
        );
        let whole = scan(&dirs.upper, &dirs.lower).unwrap();
        assert_eq!(
            whole,
            [
                change("dir/x.txt", Deleted),
                change("dir/y.txt", Deleted),
                change("emptydir/", Added),
                change("gone.txt", Deleted),
                change("m.txt", Modified),
            ]
        );
        assert_eq!(
            exec_changes(&fp0, &fp2, &dirs.upper, &dirs.lower).unwrap(),
            whole
        );
    }

    #[test]
    fn racy_same_size_rewrite_is_seen() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, lower) = (tmp.path().join("upper"), tmp.path().join("lower"));
        fs::create_dir(&lower).unwrap();
        write(&upper, "a.txt", "aaaa\n");
        let before = fingerprint(&upper).unwrap();
        let entry = &before.entries()[Path::new("a.txt")];
        assert!(entry.racy && entry.digest.is_some());
        // Same size, and the old timestamps put back: only the digest tells.
        let meta = fs::metadata(upper.join("a.txt")).unwrap();
        fs::write(upper.join("a.txt"), "bbbb\n").unwrap();
        File::options()
            .write(true)
            .open(upper.join("a.txt"))
            .unwrap()
            .set_modified(meta.modified().unwrap())
            .unwrap();
        let mut after = fingerprint(&upper).unwrap();
        // Pretend the ctime did not move either (a coarse clock).
        after.entries.insert(PathBuf::from("a.txt"), entry.clone());
        assert_eq!(
            exec_changes(&before, &after, &upper, &lower).unwrap(),
            [change("a.txt", Modified)]
        );
        write(&upper, "a.txt", "aaaa\n");
        assert!(
            !before.entries()[Path::new("a.txt")]
                .changed(entry, || digest_node(&node(&upper.join("a.txt"))).map(Some))
                .unwrap()
        );
    }

    /// A hand-made upper layer over `lower`: new, modified, deleted, symlink, empty dir.
    fn simple_layers() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let (lower, upper) = (tmp.path().join("lower"), tmp.path().join("upper"));
        write(&lower, "m.txt", "old\n");
        write(&lower, "gone.txt", "bye\n");
        write(&lower, "olddir/a.txt", "a\n");
        write(&lower, "olddir/sub/b.txt", "b\n");
        write(&lower, "keep.txt", "keep\n");
        write(&upper, "m.txt", "new\n");
        write(&upper, "sub/new.sh", "#!/bin/sh\n");
        chmod(&upper.join("sub/new.sh"), 0o755);
        symlink("keep.txt", upper.join("link")).unwrap();
        fs::create_dir(upper.join("emptydir")).unwrap();
        for w in ["gone.txt", "olddir"] {
            // A whiteout as the kernel makes it; allowed without CAP_MKNOD since Linux 5.8.
            mknod(&upper.join(w), SFlag::S_IFCHR, Mode::empty(), 0).unwrap();
        }
        (tmp, lower, upper)
    }

    #[test]
    fn export_tar_is_deterministic_and_complete() {
        let (_tmp, lower, upper) = simple_layers();
        let changes = scan(&upper, &lower).unwrap();
        let mut a = Vec::new();
        export_tar(&upper, &lower, &changes, &mut a).unwrap();
        let mut b = Vec::new();
        let mut reversed = changes.clone();
        reversed.reverse();
        export_tar(&upper, &lower, &reversed, &mut b).unwrap();
        assert_eq!(a, b);

        let mut archive = tar::Archive::new(a.as_slice());
        let mut members = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let h = entry.header().clone();
            assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
            let path = entry.path().unwrap().display().to_string();
            let mut content = String::new();
            entry.read_to_string(&mut content).unwrap();
            let link = entry.link_name().unwrap().map(|l| l.display().to_string());
            members.push((path, h.entry_type(), h.mode().unwrap(), content, link));
        }
        use tar::EntryType as E;
        let expected_deleted = "gone.txt\nolddir/a.txt\nolddir/sub/b.txt\n";
        assert_eq!(
            members,
            [
                (
                    DELETED_MEMBER.into(),
                    E::Regular,
                    0o644,
                    expected_deleted.into(),
                    None
                ),
                ("emptydir".into(), E::Directory, 0o755, String::new(), None),
                (
                    "link".into(),
                    E::Symlink,
                    0o777,
                    String::new(),
                    Some("keep.txt".into())
                ),
                ("m.txt".into(), E::Regular, 0o644, "new\n".into(), None),
                (
                    "sub/new.sh".into(),
                    E::Regular,
                    0o755,
                    "#!/bin/sh\n".into(),
                    None
                ),
            ]
        );
        let mtime = fs::metadata(upper.join("m.txt")).unwrap().mtime();
        let mut archive = tar::Archive::new(a.as_slice());
        let m = archive
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.path().unwrap() == Path::new("m.txt"))
            .unwrap();
        assert_eq!(m.header().mtime().unwrap(), mtime as u64);

        let err =
            export_tar(&upper, &lower, &[change("../x", Added)], &mut Vec::new()).unwrap_err();
        assert!(matches!(err, LayersError::Export { .. }), "{err}");
    }

    fn host_copy(lower: &Path, at: &Path) -> PathBuf {
        let host = at.join("host");
        for rel in [
            "m.txt",
            "gone.txt",
            "olddir/a.txt",
            "olddir/sub/b.txt",
            "keep.txt",
        ] {
            write(&host, rel, fs::read(lower.join(rel)).unwrap());
        }
        host
    }

    #[test]
    fn apply_to_host_writes_the_change() {
        let (tmp, lower, upper) = simple_layers();
        let host = host_copy(&lower, tmp.path());
        let changes = scan(&upper, &lower).unwrap();
        let applied = apply_to_host(&upper, &host, &changes).unwrap();
        assert_eq!(applied, changes);
        assert_eq!(fs::read_to_string(host.join("m.txt")).unwrap(), "new\n");
        let sh = fs::metadata(host.join("sub/new.sh")).unwrap();
        assert_eq!(sh.mode() & 0o7777, 0o755);
        assert_eq!(
            fs::read_to_string(host.join("sub/new.sh")).unwrap(),
            "#!/bin/sh\n"
        );
        assert_eq!(
            fs::read_link(host.join("link")).unwrap(),
            Path::new("keep.txt")
        );
        assert!(host.join("emptydir").is_dir());
        assert!(!host.join("gone.txt").exists());
        assert!(!host.join("olddir").exists(), "emptied directories go too");
        assert_eq!(fs::read_to_string(host.join("keep.txt")).unwrap(), "keep\n");
        // Nothing left behind.
        let names: Vec<_> = fs::read_dir(&host)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !names.iter().any(|n| n.starts_with(".taskbox")),
            "{names:?}"
        );
        // The host now matches the sandbox's view.
        assert!(scan(&upper, &host).unwrap().is_empty());
    }

    #[test]
    fn apply_to_host_and_export_leave_setuid_setgid_and_sticky_bits_behind() {
        let (tmp, lower, upper) = simple_layers();
        let host = host_copy(&lower, tmp.path());
        fs::write(upper.join("suid"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(upper.join("suid"), fs::Permissions::from_mode(0o6755)).unwrap();
        fs::create_dir(upper.join("sticky")).unwrap();
        fs::set_permissions(upper.join("sticky"), fs::Permissions::from_mode(0o3777)).unwrap();
        let changes = scan(&upper, &lower).unwrap();
        apply_to_host(&upper, &host, &changes).unwrap();
        assert_eq!(
            fs::metadata(host.join("suid")).unwrap().mode() & 0o7777,
            0o755
        );
        // (A new directory's permissions are the umask's.)
        assert_eq!(
            fs::metadata(host.join("sticky")).unwrap().mode() & 0o7000,
            0
        );
        let mut tar = Vec::new();
        export_tar(&upper, &lower, &changes, &mut tar).unwrap();
        let mut archive = tar::Archive::new(tar.as_slice());
        let modes: BTreeMap<String, u32> = archive
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let path = e
                    .path()
                    .unwrap()
                    .to_string_lossy()
                    .trim_end_matches('/')
                    .to_owned();
                (path, e.header().mode().unwrap())
            })
            .collect();
        assert_eq!(modes["suid"], 0o755, "{modes:?}");
        assert_eq!(modes["sticky"], 0o777, "{modes:?}");
    }

    #[test]
    fn apply_to_host_does_not_follow_a_planted_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, host) = (tmp.path().join("upper"), tmp.path().join("host"));
        let outside = tmp.path().join("outside");
        write(&outside, "sentinel", "precious\n");
        write(&outside, "dir/keep", "k\n");
        fs::create_dir(&host).unwrap();
        symlink(outside.join("sentinel"), host.join("evil.txt")).unwrap();
        symlink(outside.join("dir"), host.join("linkdir")).unwrap();
        write(&upper, "evil.txt", "overwritten?\n");
        write(&upper, "linkdir/f.txt", "through?\n");

        // A symlink at the target: replaced, not written through.
        let applied = apply_to_host(&upper, &host, &[change("evil.txt", Modified)]).unwrap();
        assert_eq!(applied, [change("evil.txt", Modified)]);
        assert_eq!(
            fs::read_to_string(outside.join("sentinel")).unwrap(),
            "precious\n"
        );
        let meta = fs::symlink_metadata(host.join("evil.txt")).unwrap();
        assert!(meta.is_file());
        assert_eq!(
            fs::read_to_string(host.join("evil.txt")).unwrap(),
            "overwritten?\n"
        );

        // A symlink as a parent: refused.
        let err = apply_to_host(&upper, &host, &[change("linkdir/f.txt", Added)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("a parent on the host is a symlink"),
            "{err}"
        );
        assert!(!outside.join("dir/f.txt").exists());
        // Unless the change replaces the symlink by a directory.
        apply_to_host(
            &upper,
            &host,
            &[change("linkdir", Deleted), change("linkdir/f.txt", Added)],
        )
        .unwrap();
        assert!(!outside.join("dir/f.txt").exists());
        assert!(fs::symlink_metadata(host.join("linkdir")).unwrap().is_dir());
        assert_eq!(fs::read_to_string(outside.join("dir/keep")).unwrap(), "k\n");
    }

    #[test]
    fn apply_to_host_refuses_bad_paths_protected_paths_and_special_files_all_or_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, host) = (tmp.path().join("upper"), tmp.path().join("host"));
        fs::create_dir(&host).unwrap();
        write(&upper, "ok.txt", "ok\n");
        write(&upper, ".git/hooks/x", "#!/bin/sh\nevil\n");
        write(&upper, "sub/.git/config", "evil\n");
        nix::unistd::mkfifo(&upper.join("pipe"), Mode::S_IRWXU).unwrap();
        let cases: [(&[Change], &[&str]); 4] = [
            (
                &[change("ok.txt", Added), change("../x", Added)],
                &["\"../x\" (not a relative path inside the workspace)"],
            ),
            (
                &[change("ok.txt", Added), change(".git/hooks/x", Added)],
                &["\".git/hooks/x\" (protected path under .git)"],
            ),
            (
                &[
                    change("ok.txt", Added),
                    change("sub/.git/config", Modified),
                    change("pipe", Added),
                    change("/etc/passwd", Deleted),
                    change("a/./b", Added),
                ],
                &[
                    "\"sub/.git/config\" (protected path under .git)",
                    "\"pipe\" (special file (fifo, socket or device))",
                    "\"/etc/passwd\" (not a relative path",
                    "\"a/./b\" (not a relative path",
                ],
            ),
            (
                &[change("ok.txt", Added), change("missing.txt", Added)],
                &["\"missing.txt\" (not in the upper layer"],
            ),
        ];
        for (changes, expected) in cases {
            let err = apply_to_host(&upper, &host, changes).unwrap_err();
            assert!(matches!(err, LayersError::Refused { .. }), "{err}");
            let msg = err.to_string();
            assert!(
                msg.starts_with("cannot apply to the host workspace: refused "),
                "{msg}"
            );
            for e in expected {
                assert!(msg.contains(e), "{msg} lacks {e}");
            }
            assert!(!host.join("ok.txt").exists(), "nothing applied: {msg}");
            assert_eq!(fs::read_dir(&host).unwrap().count(), 0);
        }
    }

    #[test]
    fn xattr_whiteouts_and_opaque_dirs_are_copied() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        write(&src, "dir/a.txt", "a\n");
        write(&src, "wo", "");
        if let Err(e) = set_xattr(&src.join("dir"), "user.overlay.opaque", b"y") {
            return skip(&format!("user xattrs unsupported here: {e}"));
        }
        set_xattr(&src.join("wo"), "user.overlay.whiteout", b"y").unwrap();
        let dst = tmp.path().join("dst");
        assert_eq!(copy_layer(&src, &dst).unwrap(), 3);
        assert!(attrs(&dst.join("dir")).opaque);
        assert!(attrs(&dst.join("wo")).whiteout);
    }
}
