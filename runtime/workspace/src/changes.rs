//! Workspace changes: what a sandbox changed, read from the overlay's upper layer alone.
//!
//! The workspace is mounted as an overlay: the host copy is the lower layer, the sandbox's writes
//! land in an upper directory owned by the run. [`scan`] walks that upper directory and looks at
//! the lower tree only at paths the upper layer names (and beneath directories the sandbox deleted
//! or made opaque), so its cost follows the size of the change, not of the repository.
//! [`diff`] and [`unified_diff`] render a list of changes as a git-style patch.
//!
//! Semantics of [`scan`]:
//! - Paths are relative to the workspace root, joined by `/`; names that are not UTF-8 are converted
//!   lossily. The result is sorted and free of duplicates.
//! - A regular file, symlink or special file in upper that lower lacks is `Added`. One that lower
//!   has is `Modified` only when the file type, the permission bits (`mode & 0o7777`), the symlink
//!   target, the device number or the content differ: a copy-up caused by `touch`, a same-mode
//!   `chmod` or a rewrite with identical bytes is not a change. Contents are compared size first,
//!   then in fixed-size chunks.
//! - A whiteout (a character device 0:0, or a zero-size regular file carrying the `overlay.whiteout`
//!   xattr) deletes the lower path: a file is `Deleted`; for a directory every entry beneath it is.
//! - An opaque directory (`overlay.opaque` = `y`, in the `user.` or `trusted.` namespace) hides its
//!   lower entries: those absent from upper are `Deleted`; upper entries are compared as usual.
//! - A type change between directory and non-directory is `Deleted` for what was there (every
//!   entry beneath, for a directory) plus `Added` for what is there now. A change between two
//!   non-directory types (file to symlink, say) is `Modified`.
//! - Directories are not changes themselves (like git), with one exception so that `mkdir` and
//!   `rmdir` stay visible: a new directory with nothing in it is `Added` as `path/` (trailing
//!   slash), and an empty lower directory that was deleted is `Deleted` as `path/`. Changes of a
//!   directory's own permissions are not reported.
//! - Special files (fifos, sockets, devices) are reported but never opened.
//! - Symlinks are never followed, in either tree: both are read through [`Tree`]s (descriptors
//!   and `openat2` beneath each root, see [`crate::tree`]), and contents, link targets and
//!   xattrs come from the descriptor of the entry that was looked at.
//!
//! The overlay work directory is a sibling of upper and is never read. The scan expects the
//! layout an overlay mounted with `userxattr` produces (no `redirect_dir`, no `metacopy`); an upper
//! entry that carries a redirect or metacopy xattr is refused with [`ChangesError::Unsupported`]
//! rather than misreported. A sandbox's processes may keep writing to the upper layer while it
//! is scanned: a rename racing the walk can make the result miss the racing entry, or make the
//! scan or diff fail, and never makes either read anything outside the two trees.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{CString, OsStr, OsString};
use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use similar::{Algorithm, ChangeTag, TextDiff};

use crate::result::{Change, ChangeKind};
use crate::tree::{Node, Tree, TreeError};

/// Files larger than this (on either side) are not diffed line by line.
pub const DIFF_LIMIT_BYTES: u64 = 8 * 1024 * 1024;

/// Chunk size for streaming content comparison.
const COMPARE_CHUNK: usize = 64 * 1024;
/// How much of a file is searched for a NUL byte to call it binary (git's heuristic).
const BINARY_PROBE: usize = 8000;
/// Upper bound on the time spent diffing one file; past it `similar` returns a coarser diff.
const DIFF_TIMEOUT: Duration = Duration::from_secs(5);

/// How errors name a sandbox's upper layer.
pub(crate) const UPPER: &str = "upper layer";
/// How errors name the host workspace (the overlay's lower tree).
pub(crate) const WORKSPACE: &str = "workspace";

/// Why scanning or diffing the workspace layers failed.
#[derive(Debug, thiserror::Error)]
pub enum ChangesError {
    /// A filesystem operation failed on an entry of the upper layer or the workspace.
    #[error(transparent)]
    Io(#[from] TreeError),
    /// The upper layer uses an overlay feature that cannot be interpreted from upper alone.
    #[error("cannot scan {} in the {layer}: overlay {feature} is not supported (mount the overlay with userxattr)", path.display())]
    Unsupported {
        layer: &'static str,
        /// Relative to the layer.
        path: PathBuf,
        feature: &'static str,
    },
    /// A change names something other than a plain relative path inside the workspace.
    #[error("cannot diff {path:?}: not a relative path inside the workspace")]
    InvalidPath { path: String },
    /// A change does not match what the layers hold (stale change list).
    #[error("cannot diff {path}: {detail}")]
    Mismatch { path: String, detail: String },
}

impl ChangesError {
    /// The layers hold a path longer than a path can be ([`crate::tree::MAX_PATH_BYTES`]).
    pub fn name_too_long(&self) -> bool {
        matches!(self, ChangesError::Io(e) if e.name_too_long())
    }
}

pub use crate::result::DiffStats;

/// A rendered diff and its stats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// Git-style unified diff text.
    pub text: String,
    pub stats: DiffStats,
}

/// Lists what the sandbox changed, reading the overlay's `upper` directory and looking at `lower`
/// only at paths that `upper` names (see the module doc for the exact semantics).
///
/// Refuses (`ENAMETOOLONG`, see [`ChangesError::name_too_long`]) an upper layer holding a path
/// too long to name ([`crate::tree::MAX_PATH_BYTES`]), whose changes it cannot list.
pub fn scan(upper: &Path, lower: &Path) -> Result<Vec<Change>, ChangesError> {
    let (changes, unnamed) = scan_named(upper, lower)?;
    match unnamed {
        None => Ok(changes),
        Some(dir) => Err(TreeError::new(
            "list beneath",
            UPPER,
            &dir,
            io::Error::from_raw_os_error(libc::ENAMETOOLONG),
        )
        .into()),
    }
}

/// [`scan`], leaving out what lies beneath paths too long to name: the changes it can list,
/// and the first directory (in path order) holding an entry too long to name, if any.
pub fn scan_named(
    upper: &Path,
    lower: &Path,
) -> Result<(Vec<Change>, Option<PathBuf>), ChangesError> {
    scan_trees(&Tree::open(upper, UPPER)?, &Tree::open(lower, WORKSPACE)?)
}

/// [`scan_named`] of two open trees.
pub(crate) fn scan_trees(
    upper: &Tree,
    lower: &Tree,
) -> Result<(Vec<Change>, Option<PathBuf>), ChangesError> {
    let mut scanner = Scanner {
        upper,
        lower,
        out: Vec::new(),
        bufs: CompareBufs::new(),
        unnamed: None,
    };
    let root = Path::new("");
    let attrs = overlay_attrs(&upper.root_node()?)?;
    // The walk keeps its own stack: a sandbox's tree can be as deep as a path can hold.
    let mut dirs = vec![UpperWalk {
        rel: root.to_path_buf(),
        lower_is_dir: true,
        opaque: attrs.opaque,
    }];
    while let Some(dir) = dirs.pop() {
        scanner.walk_upper_dir(dir, &mut dirs)?;
    }
    let mut out = scanner.out;
    out.sort();
    out.dedup();
    Ok((out, scanner.unnamed))
}

/// Renders `changes` (as returned by [`scan`]) as a git-style unified diff; see [`diff`].
pub fn unified_diff(
    upper: &Path,
    lower: &Path,
    changes: &[Change],
) -> Result<String, ChangesError> {
    diff(upper, lower, changes).map(|d| d.text)
}

/// Renders `changes` as a git-style unified diff and counts files, insertions and deletions.
///
/// `Added` content is read from `upper`, `Deleted` content from `lower`, `Modified` from both.
/// Modes are shown as the real `st_mode` (file type and permission bits, e.g. `100600`), not
/// git's normalised `100644`/`100755`; symlinks are `120000` with their target as content. Files
/// over [`DIFF_LIMIT_BYTES`] get a one-line note instead of hunks; binary files (a NUL in the first
/// 8000 bytes, or not UTF-8) get git's `Binary files ... differ` line; special files get a header
/// and mode line only. Directory entries (`path/`) are skipped. Names are quoted as git quotes
/// them; there is no `index` line (no blob hashes), which `git apply` does not need for text.
/// A type change (file to symlink, say) is one file in the stats.
pub fn diff(upper: &Path, lower: &Path, changes: &[Change]) -> Result<Diff, ChangesError> {
    diff_trees(
        &Tree::open(upper, UPPER)?,
        &Tree::open(lower, WORKSPACE)?,
        changes,
    )
}

/// [`diff`] of two open trees.
pub(crate) fn diff_trees(
    upper: &Tree,
    lower: &Tree,
    changes: &[Change],
) -> Result<Diff, ChangesError> {
    let upper = UpperDir(upper);
    let old = View::<UpperDir<'_>>::new(None, Some(lower));
    let new = View::new(Some(&upper), Some(lower));
    render_between(&old, &new, changes, ("lower layer", "upper layer"))
}

/// Renders `changes` as the diff from the `old` view to the `new` view (see [`diff`] for the
/// format). `Added` content is read from `new`, `Deleted` from `old`, `Modified` from both;
/// `names` (old, new) name the two sides in the error for a change that does not match them.
pub(crate) fn render_between(
    old_view: &View<'_, UpperDir<'_>>,
    new_view: &View<'_, UpperDir<'_>>,
    changes: &[Change],
    names: (&'static str, &'static str),
) -> Result<Diff, ChangesError> {
    let mut out = Diff::default();
    for change in changes {
        if change.path.ends_with('/') {
            continue;
        }
        let rel = checked_rel(&change.path)?;
        let (old, new) = match change.kind {
            ChangeKind::Added => (Side::Absent, load_side(new_view, rel)?),
            ChangeKind::Deleted => (load_side(old_view, rel)?, Side::Absent),
            ChangeKind::Modified => (load_side(old_view, rel)?, load_side(new_view, rel)?),
        };
        let missing = (change.kind != ChangeKind::Deleted && new.is_absent())
            || (change.kind != ChangeKind::Added && old.is_absent());
        if missing && change.path.contains(char::REPLACEMENT_CHARACTER) {
            // The name was not UTF-8 and cannot be found again from its lossy form.
            out.stats.files += 1;
            out.text.push_str(&format!(
                "diff --git {} {}\nFile name is not valid UTF-8: content not shown\n",
                git_name("a/", &change.path),
                git_name("b/", &change.path)
            ));
            continue;
        }
        let mismatch = |side: &str| ChangesError::Mismatch {
            path: change.path.clone(),
            detail: format!("not a file in the {side}"),
        };
        if change.kind != ChangeKind::Deleted && matches!(new, Side::Absent) {
            return Err(mismatch(names.1));
        }
        if change.kind != ChangeKind::Added && matches!(old, Side::Absent) {
            return Err(mismatch(names.0));
        }
        out.stats.files += 1;
        if !old.is_absent() && !new.is_absent() && old.type_bits() != new.type_bits() {
            // Like git: a type change is a deletion followed by an addition.
            render_file(&mut out, &change.path, &old, &Side::Absent);
            render_file(&mut out, &change.path, &Side::Absent, &new);
        } else {
            render_file(&mut out, &change.path, &old, &new);
        }
    }
    Ok(out)
}

/// A change path as a relative path with only normal components.
pub(crate) fn checked_rel(path: &str) -> Result<&Path, ChangesError> {
    let rel = Path::new(path);
    let plain = !path.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(rel)
    } else {
        Err(ChangesError::InvalidPath {
            path: path.to_owned(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// scan

/// An upper directory still to walk (see [`Scanner::walk_upper_dir`]).
struct UpperWalk {
    rel: PathBuf,
    lower_is_dir: bool,
    opaque: bool,
}

struct Scanner<'a> {
    upper: &'a Tree,
    lower: &'a Tree,
    out: Vec<Change>,
    bufs: CompareBufs,
    /// The first directory (in path order) holding an upper entry too long to name.
    unnamed: Option<PathBuf>,
}

impl Scanner<'_> {
    fn push(&mut self, rel: &Path, kind: ChangeKind, dir: bool) {
        let mut path = rel.to_string_lossy().into_owned();
        if dir {
            path.push('/');
        }
        self.out.push(Change { path, kind });
    }

    /// Walks the upper directory at `rel`, adding those beneath it to `dirs`. `lower_is_dir`:
    /// lower has a directory there, so upper entries are compared with lower ones; otherwise
    /// everything beneath is new. `opaque`: the upper directory is the whole content (it, or a
    /// directory above it, is opaque), so lower entries it lacks were deleted. A directory that
    /// is no longer one (a racing rename) is left out.
    fn walk_upper_dir(
        &mut self,
        dir: UpperWalk,
        dirs: &mut Vec<UpperWalk>,
    ) -> Result<(), ChangesError> {
        let UpperWalk {
            rel,
            lower_is_dir,
            opaque,
        } = dir;
        let rel = rel.as_path();
        let Some(names) = self.upper.names(rel)? else {
            return Ok(());
        };
        if names.is_empty() && !lower_is_dir && !rel.as_os_str().is_empty() {
            self.push(rel, ChangeKind::Added, true);
            return Ok(());
        }
        for name in &names {
            let child = rel.join(name);
            if !crate::tree::nameable(&child) {
                crate::tree::note_unnamed(&mut self.unnamed, rel);
                continue;
            }
            self.visit_upper(child, lower_is_dir, opaque, dirs)?;
        }
        if lower_is_dir && opaque {
            let in_upper: HashSet<&OsStr> = names.iter().map(OsString::as_os_str).collect();
            for name in self.lower.names(rel)?.unwrap_or_default() {
                if !in_upper.contains(name.as_os_str()) {
                    self.delete_lower(&rel.join(&name))?;
                }
            }
        }
        Ok(())
    }

    /// Visits one upper entry; a directory is added to `dirs`, to walk. `lower_visible`: the
    /// parent exists in lower as a directory, so lower may have an entry of the same name.
    /// `in_opaque`: the parent is opaque. An entry listed but gone by now (a racing rename) is
    /// left out.
    fn visit_upper(
        &mut self,
        path: PathBuf,
        lower_visible: bool,
        in_opaque: bool,
        dirs: &mut Vec<UpperWalk>,
    ) -> Result<(), ChangesError> {
        let rel = path.as_path();
        let Some(unode) = self.upper.node(rel)? else {
            return Ok(());
        };
        let attrs = overlay_attrs(&unode)?;
        if is_whiteout(unode.meta(), &attrs) {
            if lower_visible {
                self.delete_lower(rel)?;
            }
            return Ok(());
        }
        check_supported(&unode, &attrs)?;
        let lnode = if lower_visible {
            self.lower.node(rel)?
        } else {
            None
        };
        let lower_dir = lnode.as_ref().map(|l| l.meta().is_dir());
        if unode.meta().is_dir() {
            let (lower_is_dir, opaque) = match lower_dir {
                Some(true) => (true, in_opaque || attrs.opaque),
                Some(false) => {
                    self.push(rel, ChangeKind::Deleted, false);
                    (false, false)
                }
                None => (false, false),
            };
            dirs.push(UpperWalk {
                rel: path,
                lower_is_dir,
                opaque,
            });
            return Ok(());
        }
        match lnode {
            Some(l) if l.meta().is_dir() => {
                drop(l);
                self.delete_lower(rel)?;
                self.push(rel, ChangeKind::Added, false);
            }
            Some(l) => {
                if leaves_differ(&unode, &l, &mut self.bufs)? {
                    self.push(rel, ChangeKind::Modified, false);
                }
            }
            None => self.push(rel, ChangeKind::Added, false),
        }
        Ok(())
    }

    /// Reports the lower entry at `rel` and everything beneath it as deleted.
    fn delete_lower(&mut self, rel: &Path) -> Result<(), ChangesError> {
        let mut paths = vec![rel.to_path_buf()];
        while let Some(rel) = paths.pop() {
            let Some(node) = self.lower.node(&rel)? else {
                continue;
            };
            if !node.meta().is_dir() {
                self.push(&rel, ChangeKind::Deleted, false);
                continue;
            }
            let names = node.names()?;
            drop(node);
            if names.is_empty() {
                self.push(&rel, ChangeKind::Deleted, true);
            }
            paths.extend(names.into_iter().map(|name| rel.join(name)));
        }
        Ok(())
    }
}

/// Refuses an upper entry whose overlay xattrs say it cannot be read from upper alone.
pub(crate) fn check_supported(node: &Node, attrs: &OverlayAttrs) -> Result<(), ChangesError> {
    let feature = if attrs.redirect {
        "redirect_dir"
    } else if attrs.metacopy {
        "metacopy"
    } else {
        return Ok(());
    };
    Err(ChangesError::Unsupported {
        layer: node.layer(),
        path: node.rel().to_path_buf(),
        feature,
    })
}

/// Two buffers for streaming content comparison, allocated once per scan.
pub(crate) struct CompareBufs {
    a: Vec<u8>,
    b: Vec<u8>,
}

impl CompareBufs {
    pub(crate) fn new() -> Self {
        CompareBufs {
            a: vec![0; COMPARE_CHUNK],
            b: vec![0; COMPARE_CHUNK],
        }
    }
}

/// Whether two non-directory entries differ: file type, permission bits, then content (regular
/// files, size first), target (symlinks) or device number. Fifos and sockets of the same mode
/// carry nothing else to compare.
pub(crate) fn leaves_differ(
    a: &Node,
    b: &Node,
    bufs: &mut CompareBufs,
) -> Result<bool, ChangesError> {
    let (ameta, bmeta) = (a.meta(), b.meta());
    if ameta.mode() & libc::S_IFMT != bmeta.mode() & libc::S_IFMT
        || ameta.mode() & 0o7777 != bmeta.mode() & 0o7777
    {
        return Ok(true);
    }
    let ft = ameta.file_type();
    if ft.is_file() {
        if ameta.len() != bmeta.len() {
            return Ok(true);
        }
        let same = contents_equal(a, b, &mut bufs.a, &mut bufs.b)?;
        Ok(!same)
    } else if ft.is_symlink() {
        Ok(a.read_link()? != b.read_link()?)
    } else if ft.is_block_device() || ft.is_char_device() {
        Ok(ameta.rdev() != bmeta.rdev())
    } else {
        Ok(false)
    }
}

pub(crate) fn is_whiteout(meta: &Metadata, attrs: &OverlayAttrs) -> bool {
    let ft = meta.file_type();
    (ft.is_char_device() && meta.rdev() == 0) || (ft.is_file() && meta.len() == 0 && attrs.whiteout)
}

/// Reads until `buf` is full or the file ends; returns the byte count.
fn read_full(file: &mut File, buf: &mut [u8], node: &Node) -> Result<usize, ChangesError> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(node.error("read", e).into()),
        }
    }
    Ok(filled)
}

/// Compares two regular files chunk by chunk; memory use is two buffers whatever the file size.
pub(crate) fn contents_equal(
    a: &Node,
    b: &Node,
    buf_a: &mut [u8],
    buf_b: &mut [u8],
) -> Result<bool, ChangesError> {
    let (mut fa, _) = a.open_file()?;
    let (mut fb, _) = b.open_file()?;
    loop {
        let na = read_full(&mut fa, buf_a, a)?;
        let nb = read_full(&mut fb, buf_b, b)?;
        if na != nb || buf_a[..na] != buf_b[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// overlay xattrs

/// The overlay xattrs of an upper entry, from either the `user.` or the `trusted.` namespace
/// (also what the image builder reads to tar an upper layer).
#[derive(Debug, Default)]
pub struct OverlayAttrs {
    /// A directory that hides the lower directory of the same name (`overlay.opaque` = `y`).
    pub opaque: bool,
    /// An xattr whiteout (an empty file with `overlay.whiteout`), as unprivileged overlays make.
    pub whiteout: bool,
    pub redirect: bool,
    pub metacopy: bool,
}

/// The overlay attributes of an entry (a directory or regular file; other types have none), read
/// from its descriptor; a filesystem without xattrs has none.
pub fn overlay_attrs(node: &Node) -> Result<OverlayAttrs, ChangesError> {
    let names = node.xattr_names()?;
    let mut attrs = OverlayAttrs::default();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let key = name
            .strip_prefix(b"user.overlay.")
            .or_else(|| name.strip_prefix(b"trusted.overlay."));
        match key {
            // "y" is opaque; "x" (newer kernels) only flags a directory holding xattr whiteouts.
            Some(b"opaque") => {
                if let Ok(c) = CString::new(name) {
                    attrs.opaque |= node.xattr(&c)?.as_deref() == Some(b"y".as_slice());
                }
            }
            Some(b"whiteout") => attrs.whiteout = true,
            Some(b"redirect") => attrs.redirect = true,
            Some(b"metacopy") => attrs.metacopy = true,
            _ => {}
        }
    }
    Ok(attrs)
}

// ---------------------------------------------------------------------------------------------
// views

/// What an upper layer holds at one path, taken alone (without the entries above it).
#[derive(Debug)]
pub(crate) enum UpperEntry<L> {
    /// A whiteout: the path is deleted.
    Whiteout,
    /// A directory; an opaque one hides the lower directory of the same name.
    Dir { opaque: bool },
    /// Anything else: a file, symlink or special file.
    Leaf(L),
}

/// An overlay upper layer: a real directory ([`UpperDir`]), or a record of one.
pub(crate) trait UpperLayer {
    type Leaf;
    /// The entry at `rel` (`""` is the root).
    fn lookup(&self, rel: &Path) -> Result<Option<UpperEntry<Self::Leaf>>, ChangesError>;
    /// The names in the directory at `rel`, which `lookup` reported as a directory.
    fn names(&self, rel: &Path) -> Result<Vec<OsString>, ChangesError>;
}

/// A real upper directory, read the way an overlay mounted with `userxattr` reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpperDir<'a>(pub(crate) &'a Tree);

impl UpperLayer for UpperDir<'_> {
    type Leaf = Node;

    fn lookup(&self, rel: &Path) -> Result<Option<UpperEntry<Node>>, ChangesError> {
        let Some(node) = self.0.node(rel)? else {
            return Ok(None);
        };
        let attrs = overlay_attrs(&node)?;
        if is_whiteout(node.meta(), &attrs) {
            return Ok(Some(UpperEntry::Whiteout));
        }
        check_supported(&node, &attrs)?;
        if node.meta().is_dir() {
            Ok(Some(UpperEntry::Dir {
                opaque: attrs.opaque,
            }))
        } else {
            Ok(Some(UpperEntry::Leaf(node)))
        }
    }

    fn names(&self, rel: &Path) -> Result<Vec<OsString>, ChangesError> {
        Ok(self.0.names(rel)?.unwrap_or_default())
    }
}

/// What a view shows at a path (a short-lived value: never stored, so its size does not matter).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Resolved<L> {
    Absent,
    /// A directory; `upper` and `lower` say which layers contribute entries to it.
    Dir {
        upper: bool,
        lower: bool,
    },
    /// A non-directory of the upper layer.
    Upper(L),
    /// A non-directory of the lower tree.
    Lower(Node),
}

impl<L> Resolved<L> {
    pub(crate) fn is_absent(&self) -> bool {
        matches!(self, Resolved::Absent)
    }
}

/// The merged tree an overlay of `upper` on `lower` shows (either may be missing: a lone lower
/// tree is the host copy, a lone upper layer is what the sandbox wrote). Look-ups never follow a
/// symlink: a path is resolved one component at a time and only through real directories.
///
/// A view remembers the directories on the way to the path it resolved last, and starts the
/// next look-up below those it shares: a pass over sorted paths (a change list) looks each
/// directory up once, where looking up every prefix of every path again made a tree N
/// directories deep cost N³ (minutes for one a path can hold). So a view is for one pass over
/// layers that nothing of taskbox changes meanwhile; a sandbox writing to its upper layer
/// races the pass as it raced the look-ups before (see the module doc), and every entry read
/// is still opened beneath its tree's root.
#[derive(Debug)]
pub(crate) struct View<'a, U> {
    upper: Option<&'a U>,
    lower: Option<&'a Tree>,
    /// The directories resolved last: the root's layers, then one entry per component.
    walked: RefCell<Walked>,
}

/// Keeps of `walked` (the directories on the way to the path looked at last, by name, from the
/// top) those that the path `names` shares as its own parents, and says how many: a pass over
/// sorted paths then starts each below what it shares with the last. The path itself is
/// never kept, only the directories above it.
pub(crate) fn keep_shared<T>(walked: &mut Vec<(OsString, T)>, names: &[&OsStr]) -> usize {
    let parents = &names[..names.len().saturating_sub(1)];
    let known = walked
        .iter()
        .zip(parents)
        .take_while(|((walked, _), name)| walked == *name)
        .count();
    walked.truncate(known);
    known
}

/// Which layers contribute entries to a directory of a view (see [`Resolved::Dir`]).
#[derive(Debug, Clone, Copy)]
struct DirLayers {
    upper: bool,
    lower: bool,
}

#[derive(Debug, Default)]
struct Walked {
    root: Option<DirLayers>,
    dirs: Vec<(OsString, DirLayers)>,
}

impl<'a, U: UpperLayer> View<'a, U> {
    pub(crate) fn new(upper: Option<&'a U>, lower: Option<&'a Tree>) -> Self {
        View {
            upper,
            lower,
            walked: RefCell::default(),
        }
    }

    /// The layers of the view's root directory.
    fn root(&self) -> Result<DirLayers, ChangesError> {
        let mut at = DirLayers {
            upper: false,
            lower: self.lower.is_some(),
        };
        match self
            .upper
            .map(|u| u.lookup(Path::new("")))
            .transpose()?
            .flatten()
        {
            Some(UpperEntry::Dir { opaque }) => {
                at.upper = true;
                at.lower &= !opaque;
            }
            None => {}
            Some(_) => at.lower = false,
        }
        Ok(at)
    }

    /// Resolves `rel` (normal components only) as overlayfs does: the upper entry wins; a
    /// whiteout deletes; directories merge unless the upper one is opaque or the lower entry is
    /// not a directory.
    pub(crate) fn resolve(&self, rel: &Path) -> Result<Resolved<U::Leaf>, ChangesError> {
        let mut names = Vec::new();
        for component in rel.components() {
            let Component::Normal(name) = component else {
                return Err(ChangesError::InvalidPath {
                    path: rel.to_string_lossy().into_owned(),
                });
            };
            names.push(name);
        }
        let mut walked = self.walked.borrow_mut();
        let mut at = match walked.root {
            Some(at) => at,
            None => *walked.root.insert(self.root()?),
        };
        let known = keep_shared(&mut walked.dirs, &names);
        if let Some((_, dir)) = walked.dirs.last() {
            at = *dir;
        }
        let mut prefix: PathBuf = names[..known].iter().collect();
        for (i, name) in names.iter().enumerate().skip(known) {
            prefix.push(name);
            let last = i + 1 == names.len();
            let mut dir_upper = false;
            let mut lower_allowed = at.lower;
            if let (true, Some(upper)) = (at.upper, self.upper) {
                match upper.lookup(&prefix)? {
                    None => {}
                    Some(UpperEntry::Whiteout) => return Ok(Resolved::Absent),
                    Some(UpperEntry::Leaf(leaf)) if last => return Ok(Resolved::Upper(leaf)),
                    Some(UpperEntry::Leaf(_)) => return Ok(Resolved::Absent),
                    Some(UpperEntry::Dir { opaque }) => {
                        dir_upper = true;
                        lower_allowed &= !opaque;
                    }
                }
            }
            let mut dir_lower = false;
            if let (true, Some(lower)) = (lower_allowed, self.lower) {
                match lower.node(&prefix)? {
                    None => {}
                    Some(node) if node.meta().is_dir() => dir_lower = true,
                    // A lower non-directory under an upper directory is hidden.
                    Some(_) if dir_upper => {}
                    Some(node) if last => return Ok(Resolved::Lower(node)),
                    Some(_) => return Ok(Resolved::Absent),
                }
            }
            if !dir_upper && !dir_lower {
                return Ok(Resolved::Absent);
            }
            at = DirLayers {
                upper: dir_upper,
                lower: dir_lower,
            };
            walked.dirs.push((name.to_os_string(), at));
        }
        Ok(Resolved::Dir {
            upper: at.upper,
            lower: at.lower,
        })
    }

    /// Whether the directory at `rel` (resolved as `Dir { upper, lower }`) shows no entry.
    pub(crate) fn dir_is_empty(
        &self,
        rel: &Path,
        upper: bool,
        lower: bool,
    ) -> Result<bool, ChangesError> {
        let mut names = Vec::new();
        if let (true, Some(u)) = (upper, self.upper) {
            names.extend(u.names(rel)?);
        }
        if let (true, Some(l)) = (lower, self.lower) {
            names.extend(l.names(rel)?.unwrap_or_default());
        }
        for name in names {
            let child = rel.join(&name);
            // An entry too deep to name is still an entry.
            if !crate::tree::nameable(&child) || !self.resolve(&child)?.is_absent() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

// ---------------------------------------------------------------------------------------------
// diff

/// One side of a file diff.
enum Side {
    Absent,
    File { mode: u32, content: Content },
    Symlink { target: Vec<u8> },
    Special { mode: u32 },
}

enum Content {
    Bytes(Vec<u8>),
    TooLarge(u64),
}

impl Side {
    fn is_absent(&self) -> bool {
        matches!(self, Side::Absent)
    }

    fn type_bits(&self) -> u32 {
        match self {
            Side::Absent => 0,
            Side::File { .. } => libc::S_IFREG,
            Side::Symlink { .. } => libc::S_IFLNK,
            Side::Special { mode } => mode & libc::S_IFMT,
        }
    }

    /// The mode as git prints it (six octal digits).
    fn git_mode(&self) -> String {
        match self {
            Side::Absent => String::new(),
            Side::Symlink { .. } => "120000".to_owned(),
            Side::File { mode, .. } | Side::Special { mode } => format!("{mode:06o}"),
        }
    }

    /// The content to diff: `None` for absent and special files, or a file too large to diff.
    fn bytes(&self) -> Option<&[u8]> {
        match self {
            Side::File {
                content: Content::Bytes(b),
                ..
            } => Some(b),
            Side::Symlink { target } => Some(target),
            _ => None,
        }
    }

    fn too_large(&self) -> Option<u64> {
        match self {
            Side::File {
                content: Content::TooLarge(n),
                ..
            } => Some(*n),
            _ => None,
        }
    }
}

/// Loads what `view` shows at `rel` for diffing; directories count as absent.
fn load_side(view: &View<'_, UpperDir<'_>>, rel: &Path) -> Result<Side, ChangesError> {
    match view.resolve(rel)? {
        Resolved::Absent | Resolved::Dir { .. } => Ok(Side::Absent),
        Resolved::Upper(leaf) | Resolved::Lower(leaf) => load_leaf(&leaf),
    }
}

/// A file's side is what was read: its mode and content from the same open descriptor.
fn load_leaf(leaf: &Node) -> Result<Side, ChangesError> {
    let meta = leaf.meta();
    let ft = meta.file_type();
    if ft.is_symlink() {
        Ok(Side::Symlink {
            target: leaf.read_link()?.into_os_string().into_vec(),
        })
    } else if ft.is_file() {
        if meta.len() > DIFF_LIMIT_BYTES {
            return Ok(Side::File {
                mode: meta.mode(),
                content: Content::TooLarge(meta.len()),
            });
        }
        let (file, meta) = leaf.open_file()?;
        let mut bytes = Vec::new();
        file.take(DIFF_LIMIT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| leaf.error("read", e))?;
        let content = if bytes.len() as u64 > DIFF_LIMIT_BYTES {
            Content::TooLarge(bytes.len() as u64)
        } else {
            Content::Bytes(bytes)
        };
        Ok(Side::File {
            mode: meta.mode(),
            content,
        })
    } else {
        Ok(Side::Special { mode: meta.mode() })
    }
}

/// A NUL byte near the start marks a file binary (git's heuristic; not-UTF-8 is checked apart).
fn has_nul(bytes: &[u8]) -> bool {
    bytes[..bytes.len().min(BINARY_PROBE)].contains(&0)
}

/// `prefix` + `path` as git writes a name in a patch: verbatim when it holds only printable ASCII
/// other than `"` and `\`, else in double quotes with C escapes and octal bytes. Quoting keeps a
/// name holding a newline from forging patch lines.
fn git_name(prefix: &str, path: &str) -> String {
    let name = format!("{prefix}{path}");
    if name
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
        return name;
    }
    let mut quoted = String::from("\"");
    for b in name.bytes() {
        match b {
            b'"' => quoted.push_str("\\\""),
            b'\\' => quoted.push_str("\\\\"),
            b'\t' => quoted.push_str("\\t"),
            b'\n' => quoted.push_str("\\n"),
            b'\r' => quoted.push_str("\\r"),
            0x07 => quoted.push_str("\\a"),
            0x08 => quoted.push_str("\\b"),
            0x0b => quoted.push_str("\\v"),
            0x0c => quoted.push_str("\\f"),
            0x20..0x7f => quoted.push(char::from(b)),
            _ => quoted.push_str(&format!("\\{b:03o}")),
        }
    }
    quoted.push('"');
    quoted
}

/// Renders one file's diff; `old` and `new` are of the same type or one of them is absent.
fn render_file(out: &mut Diff, path: &str, old: &Side, new: &Side) {
    let text = &mut out.text;
    let a = if old.is_absent() {
        "/dev/null".to_owned()
    } else {
        git_name("a/", path)
    };
    let b = if new.is_absent() {
        "/dev/null".to_owned()
    } else {
        git_name("b/", path)
    };
    text.push_str(&format!(
        "diff --git {} {}\n",
        git_name("a/", path),
        git_name("b/", path)
    ));
    match (old.is_absent(), new.is_absent()) {
        (true, false) => text.push_str(&format!("new file mode {}\n", new.git_mode())),
        (false, true) => text.push_str(&format!("deleted file mode {}\n", old.git_mode())),
        _ => {
            if old.git_mode() != new.git_mode() {
                text.push_str(&format!(
                    "old mode {}\nnew mode {}\n",
                    old.git_mode(),
                    new.git_mode()
                ));
            }
        }
    }
    if let Some(size) = old.too_large().or(new.too_large()) {
        text.push_str(&format!(
            "File too large to diff: {} ({size} bytes, limit {DIFF_LIMIT_BYTES})\n",
            git_name("", path)
        ));
        return;
    }
    if matches!(old, Side::Special { .. }) || matches!(new, Side::Special { .. }) {
        return;
    }
    let old_bytes = old.bytes().unwrap_or_default();
    let new_bytes = new.bytes().unwrap_or_default();
    if old_bytes == new_bytes {
        // Mode change only, or an empty file added or deleted: git prints no body either.
        return;
    }
    let (Ok(old_text), Ok(new_text)) = (
        std::str::from_utf8(old_bytes),
        std::str::from_utf8(new_bytes),
    ) else {
        text.push_str(&format!("Binary files {a} and {b} differ\n"));
        return;
    };
    if has_nul(old_bytes) || has_nul(new_bytes) {
        text.push_str(&format!("Binary files {a} and {b} differ\n"));
        return;
    }
    // Like git: a tab ends a name that holds a space, so patch(1) does not cut it there.
    let tab = |name: &str| if name.contains(' ') { "\t" } else { "" };
    text.push_str(&format!("--- {a}{}\n+++ {b}{}\n", tab(&a), tab(&b)));
    let diff = TextDiff::configure()
        .algorithm(Algorithm::Myers)
        .timeout(DIFF_TIMEOUT)
        .diff_lines(old_text, new_text);
    for hunk in diff.unified_diff().context_radius(3).iter_hunks() {
        text.push_str(&format!("{}\n", hunk.header()));
        for change in hunk.iter_changes() {
            let tag = match change.tag() {
                ChangeTag::Delete => {
                    out.stats.deletions += 1;
                    '-'
                }
                ChangeTag::Insert => {
                    out.stats.insertions += 1;
                    '+'
                }
                ChangeTag::Equal => ' ',
            };
            text.push(tag);
            let line = change.value();
            text.push_str(line);
            if !line.ends_with('\n') {
                text.push_str("\n\\ No newline at end of file\n");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{
        self, OverlayDirs, attrs, change, chmod, node, run_overlay, set_xattr, skip, write,
    };
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{PermissionsExt, symlink};

    /// Makes a whiteout the way an unprivileged overlay can read it: a zero-size file with the
    /// whiteout xattr. Returns false (test skipped) when the filesystem has no user xattrs.
    fn xattr_whiteout(path: &Path) -> bool {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
        match set_xattr(path, "user.overlay.whiteout", b"y") {
            Ok(()) => true,
            Err(e) => {
                skip(&format!("user xattrs unsupported here: {e}"));
                false
            }
        }
    }

    /// A character-device whiteout, as the kernel makes it; needs CAP_MKNOD.
    fn chardev_whiteout(path: &Path) -> bool {
        use nix::sys::stat::{Mode, SFlag, mknod};
        match mknod(path, SFlag::S_IFCHR, Mode::empty(), 0) {
            Ok(()) => true,
            Err(e) => {
                skip(&format!("cannot mknod a whiteout: {e}"));
                false
            }
        }
    }

    struct Layers {
        _tmp: tempfile::TempDir,
        lower: PathBuf,
        upper: PathBuf,
    }

    fn layers() -> Layers {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        let upper = tmp.path().join("upper");
        fs::create_dir(&lower).unwrap();
        fs::create_dir(&upper).unwrap();
        Layers {
            _tmp: tmp,
            lower,
            upper,
        }
    }

    #[test]
    fn added_modified_identical_chmod_deleted() {
        let l = layers();
        write(&l.lower, "src/keep.rs", "keep\n");
        write(&l.lower, "src/mod.rs", "old\n");
        write(&l.lower, "src/touched.rs", "same\n");
        write(&l.lower, "run.sh", "echo\n");
        write(&l.lower, "gone.txt", "bye\n");
        chmod(&l.lower.join("run.sh"), 0o644);

        write(&l.upper, "src/new.rs", "new\n");
        write(&l.upper, "src/mod.rs", "new\n");
        // A copy-up with the same bytes and mode (touch, chmod to the same mode).
        write(&l.upper, "src/touched.rs", "same\n");
        write(&l.upper, "run.sh", "echo\n");
        chmod(&l.upper.join("run.sh"), 0o755);
        if !xattr_whiteout(&l.upper.join("gone.txt")) {
            return;
        }

        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [
                change("gone.txt", ChangeKind::Deleted),
                change("run.sh", ChangeKind::Modified),
                change("src/mod.rs", ChangeKind::Modified),
                change("src/new.rs", ChangeKind::Added),
            ]
        );
    }

    #[test]
    fn chardev_whiteout_deletes_a_directory_and_everything_beneath() {
        let l = layers();
        write(&l.lower, "dir/a.txt", "a\n");
        write(&l.lower, "dir/sub/b.txt", "b\n");
        fs::create_dir_all(l.lower.join("dir/empty")).unwrap();
        write(&l.lower, "other/c.txt", "c\n");
        fs::create_dir(l.upper.join("other")).unwrap();
        if !chardev_whiteout(&l.upper.join("dir")) || !xattr_whiteout(&l.upper.join("other/c.txt"))
        {
            return;
        }
        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [
                change("dir/a.txt", ChangeKind::Deleted),
                change("dir/empty/", ChangeKind::Deleted),
                change("dir/sub/b.txt", ChangeKind::Deleted),
                change("other/c.txt", ChangeKind::Deleted),
            ]
        );
    }

    #[test]
    fn opaque_directory_hides_lower_entries() {
        // rm -rf dir && mkdir dir && echo ... > dir/a.txt && echo same > dir/same.txt
        let l = layers();
        write(&l.lower, "dir/a.txt", "a\n");
        write(&l.lower, "dir/same.txt", "same\n");
        write(&l.lower, "dir/b.txt", "b\n");
        write(&l.lower, "dir/sub/c.txt", "c\n");
        write(&l.lower, "dir/sub/d.txt", "d\n");
        write(&l.upper, "dir/a.txt", "A\n");
        write(&l.upper, "dir/same.txt", "same\n");
        // Beneath an opaque directory, subdirectories hide their lower entries too.
        write(&l.upper, "dir/sub/d.txt", "d\n");
        if let Err(e) = set_xattr(&l.upper.join("dir"), "user.overlay.opaque", b"y") {
            return skip(&format!("user xattrs unsupported here: {e}"));
        }
        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [
                change("dir/a.txt", ChangeKind::Modified),
                change("dir/b.txt", ChangeKind::Deleted),
                change("dir/sub/c.txt", ChangeKind::Deleted),
            ]
        );
        // Without the xattr the same upper tree is a plain merge: nothing else deleted.
        let l2 = layers();
        write(&l2.lower, "dir/b.txt", "b\n");
        write(&l2.upper, "dir/a.txt", "A\n");
        if set_xattr(&l2.upper.join("dir"), "user.overlay.opaque", b"x").is_ok() {
            assert_eq!(
                scan(&l2.upper, &l2.lower).unwrap(),
                [change("dir/a.txt", ChangeKind::Added)]
            );
        }
    }

    #[test]
    fn type_changes_symlinks_special_files_and_new_dirs() {
        let l = layers();
        write(&l.lower, "dir2file/x.txt", "x\n");
        write(&l.lower, "file2dir", "f\n");
        write(&l.lower, "file2link", "t\n");
        symlink("a", l.lower.join("relink")).unwrap();
        symlink("same", l.lower.join("samelink")).unwrap();

        write(&l.upper, "dir2file", "now a file\n");
        write(&l.upper, "file2dir/y.txt", "y\n");
        symlink("target", l.upper.join("file2link")).unwrap();
        symlink("b", l.upper.join("relink")).unwrap();
        symlink("same", l.upper.join("samelink")).unwrap();
        symlink("/etc/passwd", l.upper.join("newlink")).unwrap();
        fs::create_dir_all(l.upper.join("newdir/inner")).unwrap();
        fs::create_dir_all(l.upper.join("emptydir")).unwrap();
        nix::unistd::mkfifo(&l.upper.join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();

        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [
                change("dir2file", ChangeKind::Added),
                change("dir2file/x.txt", ChangeKind::Deleted),
                change("emptydir/", ChangeKind::Added),
                change("file2dir", ChangeKind::Deleted),
                change("file2dir/y.txt", ChangeKind::Added),
                change("file2link", ChangeKind::Modified),
                change("newdir/inner/", ChangeKind::Added),
                change("newlink", ChangeKind::Added),
                change("pipe", ChangeKind::Added),
                change("relink", ChangeKind::Modified),
            ]
        );
        // The fifo is never opened: diffing it prints a header only (and does not hang).
        let d = diff(&l.upper, &l.lower, &[change("pipe", ChangeKind::Added)]).unwrap();
        assert_eq!(d.text, "diff --git a/pipe b/pipe\nnew file mode 010700\n");
        let d = diff(&l.upper, &l.lower, &[change("newlink", ChangeKind::Added)]).unwrap();
        assert_eq!(
            d.text,
            "diff --git a/newlink b/newlink\nnew file mode 120000\n--- /dev/null\n+++ b/newlink\n\
             @@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n"
        );
        // File to symlink renders like git's type change: a deletion, then an addition.
        let d = diff(
            &l.upper,
            &l.lower,
            &[change("file2link", ChangeKind::Modified)],
        )
        .unwrap();
        assert_eq!(
            d.text,
            "diff --git a/file2link b/file2link\ndeleted file mode 100644\n--- a/file2link\n\
             +++ /dev/null\n@@ -1 +0,0 @@\n-t\n\
             diff --git a/file2link b/file2link\nnew file mode 120000\n--- /dev/null\n\
             +++ b/file2link\n@@ -0,0 +1 @@\n+target\n\\ No newline at end of file\n"
        );
    }

    #[test]
    fn non_utf8_names_are_lossy() {
        let l = layers();
        let name = OsStr::from_bytes(b"bad\xffname");
        fs::write(l.upper.join(name), "x\n").unwrap();
        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [change("bad\u{fffd}name", ChangeKind::Added)]
        );
        let d = diff(
            &l.upper,
            &l.lower,
            &[change("bad\u{fffd}name", ChangeKind::Added)],
        )
        .unwrap();
        assert_eq!(
            d.text,
            "diff --git \"a/bad\\357\\277\\275name\" \"b/bad\\357\\277\\275name\"\n\
             File name is not valid UTF-8: content not shown\n"
        );
    }

    #[test]
    fn diff_does_not_follow_a_symlinked_parent() {
        let l = layers();
        let outside = tempfile::tempdir().unwrap();
        write(outside.path(), "secret.txt", "secret\n");
        symlink(outside.path(), l.upper.join("link")).unwrap();
        let err = diff(
            &l.upper,
            &l.lower,
            &[change("link/secret.txt", ChangeKind::Added)],
        )
        .unwrap_err();
        assert!(matches!(err, ChangesError::Mismatch { .. }), "{err}");
    }

    #[test]
    fn unusual_names_are_quoted_like_git() {
        let l = layers();
        write(&l.upper, "new\nline.txt", "x\n");
        write(&l.upper, "caf\u{e9}.txt", "");
        write(&l.upper, "plain name.txt", "p\n");
        let changes = scan(&l.upper, &l.lower).unwrap();
        let d = diff(&l.upper, &l.lower, &changes).unwrap();
        assert_eq!(
            d.text,
            "diff --git \"a/caf\\303\\251.txt\" \"b/caf\\303\\251.txt\"\nnew file mode 100644\n\
             diff --git \"a/new\\nline.txt\" \"b/new\\nline.txt\"\nnew file mode 100644\n\
             --- /dev/null\n+++ \"b/new\\nline.txt\"\n@@ -0,0 +1 @@\n+x\n\
             diff --git a/plain name.txt b/plain name.txt\nnew file mode 100644\n\
             --- /dev/null\n+++ b/plain name.txt\t\n@@ -0,0 +1 @@\n+p\n"
        );
    }

    #[test]
    fn scan_does_not_read_lower_outside_upper_paths() {
        let l = layers();
        write(&l.lower, "a.txt", "a\n");
        // An unreadable lower directory the upper layer never names must not be touched.
        write(&l.lower, "private/secret", "s\n");
        chmod(&l.lower.join("private"), 0o000);
        write(&l.upper, "b.txt", "b\n");
        let got = scan(&l.upper, &l.lower);
        chmod(&l.lower.join("private"), 0o755);
        assert_eq!(got.unwrap(), [change("b.txt", ChangeKind::Added)]);
    }

    #[test]
    fn large_files_are_compared_in_chunks() {
        let l = layers();
        let size = 3 * COMPARE_CHUNK + 17;
        let mut data = vec![b'x'; size];
        write(&l.lower, "same.bin", &data);
        write(&l.upper, "same.bin", &data);
        write(&l.lower, "last.bin", &data);
        data[size - 1] = b'y';
        write(&l.upper, "last.bin", &data);
        assert_eq!(
            scan(&l.upper, &l.lower).unwrap(),
            [change("last.bin", ChangeKind::Modified)]
        );
        // The comparison works with buffers far smaller than the files.
        let (mut a, mut b) = ([0u8; 7], [0u8; 7]);
        let (up, low) = (
            node(&l.upper.join("same.bin")),
            node(&l.lower.join("same.bin")),
        );
        assert!(contents_equal(&up, &low, &mut a, &mut b).unwrap());
        let (up, low) = (
            node(&l.upper.join("last.bin")),
            node(&l.lower.join("last.bin")),
        );
        assert!(!contents_equal(&up, &low, &mut a, &mut b).unwrap());
    }

    #[test]
    fn files_over_the_limit_are_not_diffed() {
        let l = layers();
        let big = File::create(l.upper.join("big.log")).unwrap();
        big.set_len(DIFF_LIMIT_BYTES + 1).unwrap();
        let d = diff(&l.upper, &l.lower, &[change("big.log", ChangeKind::Added)]).unwrap();
        assert_eq!(
            d.text,
            "diff --git a/big.log b/big.log\nnew file mode 100644\n\
             File too large to diff: big.log (8388609 bytes, limit 8388608)\n"
        );
        assert_eq!(d.stats.files, 1);
    }

    #[test]
    fn binary_files() {
        let l = layers();
        write(&l.lower, "img.png", b"\x89PNG\r\n\x1a\n\0\0old");
        write(&l.upper, "img.png", b"\x89PNG\r\n\x1a\n\0\0new");
        write(&l.upper, "latin1.txt", b"caf\xe9\n");
        let changes = scan(&l.upper, &l.lower).unwrap();
        let d = diff(&l.upper, &l.lower, &changes).unwrap();
        assert_eq!(
            d.text,
            "diff --git a/img.png b/img.png\nBinary files a/img.png and b/img.png differ\n\
             diff --git a/latin1.txt b/latin1.txt\nnew file mode 100644\n\
             Binary files /dev/null and b/latin1.txt differ\n"
        );
        assert_eq!(
            d.stats,
            DiffStats {
                files: 2,
                insertions: 0,
                deletions: 0
            }
        );
    }

    #[test]
    fn modified_text_file_hunk() {
        let l = layers();
        let old: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        let new = old.replace("line 10\n", "line ten\n");
        write(&l.lower, "notes.txt", &old);
        write(&l.upper, "notes.txt", &new);
        let changes = scan(&l.upper, &l.lower).unwrap();
        let (text, stats) = {
            let d = diff(&l.upper, &l.lower, &changes).unwrap();
            (d.text, d.stats)
        };
        assert_eq!(
            text,
            "diff --git a/notes.txt b/notes.txt\n--- a/notes.txt\n+++ b/notes.txt\n\
             @@ -7,7 +7,7 @@\n line 7\n line 8\n line 9\n-line 10\n+line ten\n line 11\n line 12\n line 13\n"
        );
        assert_eq!((stats.files, stats.insertions, stats.deletions), (1, 1, 1));
        assert_eq!(unified_diff(&l.upper, &l.lower, &changes).unwrap(), text);
    }

    #[test]
    fn add_delete_modify_look_like_git() {
        let l = layers();
        write(&l.lower, "old.txt", "bye\n");
        write(&l.lower, "mod.txt", "a\nb\n");
        write(&l.lower, "mode.sh", "echo\n");
        chmod(&l.lower.join("mode.sh"), 0o644);
        write(&l.upper, "mode.sh", "echo\n");
        chmod(&l.upper.join("mode.sh"), 0o755);
        write(&l.upper, "new.txt", "hello\nworld\n");
        write(&l.upper, "mod.txt", "a\nB");
        write(&l.upper, "empty.txt", "");
        chmod(&l.upper.join("new.txt"), 0o644);
        chmod(&l.upper.join("empty.txt"), 0o644);
        if !xattr_whiteout(&l.upper.join("old.txt")) {
            return;
        }
        let changes = scan(&l.upper, &l.lower).unwrap();
        let d = diff(&l.upper, &l.lower, &changes).unwrap();
        let expected = "\
diff --git a/empty.txt b/empty.txt
new file mode 100644
diff --git a/mod.txt b/mod.txt
--- a/mod.txt
+++ b/mod.txt
@@ -1,2 +1,2 @@
 a
-b
+B
\\ No newline at end of file
diff --git a/mode.sh b/mode.sh
old mode 100644
new mode 100755
diff --git a/new.txt b/new.txt
new file mode 100644
--- /dev/null
+++ b/new.txt
@@ -0,0 +1,2 @@
+hello
+world
diff --git a/old.txt b/old.txt
deleted file mode 100644
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
";
        assert_eq!(d.text, expected);
        assert_eq!(
            d.stats,
            DiffStats {
                files: 5,
                insertions: 3,
                deletions: 2
            }
        );
    }

    #[test]
    fn diff_rejects_paths_outside_the_workspace_and_stale_changes() {
        let l = layers();
        for bad in ["../etc/passwd", "/etc/passwd", "a/../../b", ""] {
            let err = diff(&l.upper, &l.lower, &[change(bad, ChangeKind::Added)]).unwrap_err();
            assert!(
                matches!(err, ChangesError::InvalidPath { .. }),
                "{bad}: {err}"
            );
        }
        let err = diff(&l.upper, &l.lower, &[change("nope", ChangeKind::Modified)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot diff nope: not a file in the upper layer"
        );
        // Errors name the layer, never a host path.
        let err = scan(&l.upper.join("missing"), &l.lower).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot open the upper layer: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn redirect_xattr_is_refused() {
        let l = layers();
        fs::create_dir(l.upper.join("moved")).unwrap();
        if let Err(e) = set_xattr(&l.upper.join("moved"), "user.overlay.redirect", b"/orig") {
            return skip(&format!("user xattrs unsupported here: {e}"));
        }
        let err = scan(&l.upper, &l.lower).unwrap_err();
        assert!(matches!(err, ChangesError::Unsupported { .. }), "{err}");
    }

    // -----------------------------------------------------------------------------------------
    // A real overlay, mounted with userxattr inside an unprivileged user namespace.

    /// Lower tree of the real-overlay test.
    fn populate_lower(lower: &Path) {
        write(lower, "keep.txt", "keep\n");
        write(lower, "modify.txt", "one\ntwo\nthree\n");
        write(lower, "touched.txt", "same\n");
        write(lower, "chmod_same.txt", "same\n");
        write(lower, "rewritten.txt", "same\n");
        write(lower, "chmod.txt", "x\n");
        write(lower, "remove.txt", "bye\n");
        write(lower, "gone/a.txt", "a\n");
        write(lower, "gone/sub/b.txt", "b\n");
        fs::create_dir_all(lower.join("gone/empty")).unwrap();
        write(lower, "from.txt", "moved\n");
        write(lower, "dir2file/x.txt", "x\n");
        write(lower, "file2dir", "f\n");
        write(lower, "tolink.txt", "t\n");
        write(lower, "opaque/o1.txt", "one\n");
        write(lower, "opaque/o2.txt", "two\n");
        write(lower, "opaque/same.txt", "same\n");
        write(lower, "opaque/deep/d.txt", "d\n");
        write(lower, "src/lib/mod.rs", "fn a() {}\n");
        write(lower, "src/other.rs", "fn b() {}\n");
        for f in ["chmod_same.txt", "chmod.txt"] {
            chmod(&lower.join(f), 0o644);
        }
    }

    /// The operations, performed through the mounted overlay at `m`.
    fn operate(m: &Path) -> io::Result<()> {
        fs::write(m.join("modify.txt"), "one\n2\nthree\n")?;
        let f = fs::OpenOptions::new()
            .append(true)
            .open(m.join("touched.txt"))?;
        f.set_modified(std::time::SystemTime::now())?;
        drop(f);
        fs::set_permissions(m.join("chmod_same.txt"), fs::Permissions::from_mode(0o644))?;
        fs::write(m.join("rewritten.txt"), "same\n")?;
        fs::set_permissions(m.join("chmod.txt"), fs::Permissions::from_mode(0o755))?;
        fs::remove_file(m.join("remove.txt"))?;
        fs::remove_dir_all(m.join("gone"))?;
        fs::rename(m.join("from.txt"), m.join("to.txt"))?;
        fs::remove_dir_all(m.join("dir2file"))?;
        fs::write(m.join("dir2file"), "now a file\n")?;
        fs::remove_file(m.join("file2dir"))?;
        fs::create_dir(m.join("file2dir"))?;
        fs::write(m.join("file2dir/y.txt"), "y\n")?;
        fs::remove_file(m.join("tolink.txt"))?;
        symlink("keep.txt", m.join("tolink.txt"))?;
        fs::remove_dir_all(m.join("opaque"))?;
        fs::create_dir(m.join("opaque"))?;
        fs::write(m.join("opaque/o1.txt"), "uno\n")?;
        fs::write(m.join("opaque/same.txt"), "same\n")?;
        fs::write(m.join("opaque/o3.txt"), "three\n")?;
        fs::create_dir_all(m.join("newdir/inner"))?;
        fs::write(m.join("newdir/inner/n.txt"), "n\n")?;
        fs::create_dir(m.join("emptydir"))?;
        symlink("keep.txt", m.join("link"))?;
        nix::unistd::mkfifo(&m.join("pipe"), nix::sys::stat::Mode::S_IRWXU)?;
        fs::write(m.join("src/lib/mod.rs"), "fn a() { 1 }\n")?;
        fs::write(m.join("scratch.txt"), "tmp\n")?;
        fs::remove_file(m.join("scratch.txt"))?;
        Ok(())
    }

    /// Runs in the re-executed test binary, already in its own user and mount namespaces.
    #[test]
    fn overlay_child() {
        testutil::overlay_child(|_, merged| operate(merged));
    }

    #[test]
    fn real_overlay_in_a_user_namespace() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = OverlayDirs::create(tmp.path());
        let (lower, upper) = (dirs.lower.clone(), dirs.upper.clone());
        populate_lower(&lower);
        if let Err(reason) = run_overlay("changes::tests::overlay_child", &dirs, "operate") {
            return skip(&reason);
        }

        // What the kernel left in upper is what the scan expects.
        let meta = fs::symlink_metadata(upper.join("remove.txt")).unwrap();
        assert!(meta.file_type().is_char_device() && meta.rdev() == 0);
        assert!(attrs(&upper.join("opaque")).opaque);
        assert!(!upper.join("keep.txt").exists());
        // Copied up without a real change: these must not be reported below.
        for f in ["touched.txt", "chmod_same.txt", "rewritten.txt"] {
            assert!(upper.join(f).is_file(), "{f} was not copied up");
        }
        assert!(!upper.join("src/other.rs").exists());

        use ChangeKind::{Added, Deleted, Modified};
        let mut expected = vec![
            change("modify.txt", Modified),
            change("chmod.txt", Modified),
            change("remove.txt", Deleted),
            change("gone/a.txt", Deleted),
            change("gone/sub/b.txt", Deleted),
            change("gone/empty/", Deleted),
            change("from.txt", Deleted),
            change("to.txt", Added),
            change("dir2file/x.txt", Deleted),
            change("dir2file", Added),
            change("file2dir", Deleted),
            change("file2dir/y.txt", Added),
            change("tolink.txt", Modified),
            change("opaque/o1.txt", Modified),
            change("opaque/o2.txt", Deleted),
            change("opaque/deep/d.txt", Deleted),
            change("opaque/o3.txt", Added),
            change("newdir/inner/n.txt", Added),
            change("emptydir/", Added),
            change("link", Added),
            change("pipe", Added),
            change("src/lib/mod.rs", Modified),
        ];
        expected.sort();
        let changes = scan(&upper, &lower).unwrap();
        assert_eq!(changes, expected);

        let d = diff(&upper, &lower, &changes).unwrap();
        assert!(
            d.text.contains(
                "diff --git a/modify.txt b/modify.txt\n--- a/modify.txt\n+++ b/modify.txt\n\
                 @@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n"
            ),
            "{}",
            d.text
        );
        assert!(
            d.text
                .contains("diff --git a/chmod.txt b/chmod.txt\nold mode 100644\nnew mode 100755\n")
        );
        assert!(
            d.text
                .contains("diff --git a/remove.txt b/remove.txt\ndeleted file mode 100644\n")
        );
        assert_eq!(d.stats.files, expected.len() - 2);
    }
}
