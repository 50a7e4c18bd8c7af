//! Merging an upper layer into the mounted workspace: how a warm fork takes its parent's
//! changes without a remount.
//!
//! A sandbox of the warm pool has run nothing: its workspace is the overlay of the lower layer
//! and an empty upper one. Writing a fork point's upper layer through that mount, entry by
//! entry (files, directories, symlinks, whiteouts as removals, opaque directories as a
//! directory made anew), gives the same view as mounting the layer itself, and it leaves the
//! mount, and so the exec starters whose Landlock rules name it, in place: no starter is ended
//! and forked again, no overlay unmounted and mounted. pid 1 does it, with its own rights in
//! the sandbox, so owners are the sandbox's own ids on both the root and the rootless path.
//!
//! Anything this does not carry over exactly (an overlay redirect or metacopy, a device node,
//! an owner the sandbox cannot map, more than [`MAX_REMOVED`] entries to remove) is an error,
//! and the runtime then mounts the layer instead, which replaces whatever this wrote.
//!
//! Nothing here follows a symlink: each directory is opened beneath its parent's descriptor
//! with `O_NOFOLLOW`, and every entry is made or changed with `*at` calls on its name.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Stat, Timestamps, Uid};
use rustix::io::Errno;

/// The deepest directory a merge goes into (a layer's copy is as deep as PATH_MAX lets a path
/// be, about 2,000 levels): the walk recurses, on pid 1's own stack.
pub const MAX_DEPTH: usize = 4096;

/// The most entries a merge removes from the lower layer's view (beneath whiteouts and opaque
/// directories that hide a directory) before it gives up: past it, the remount is cheaper.
pub const MAX_REMOVED: u64 = 10_000;

/// Why a merge stopped (the workspace may hold part of the layer then).
#[derive(Debug, thiserror::Error)]
#[error("cannot merge {path:?} into the workspace: {what}")]
pub struct MergeError {
    /// The entry's path in the layer (`""`: its root).
    pub path: PathBuf,
    pub what: String,
}

/// Writes the upper layer open as `layer` (a directory, its descriptor not read from yet)
/// through the overlay mounted at `workspace`, so that the workspace shows what a mount of the
/// layer over the same lower layer would show.
pub fn merge_layer(layer: OwnedFd, workspace: &Path) -> Result<(), MergeError> {
    let root = Path::new("");
    let dst = rustix::fs::openat2(
        rustix::fs::CWD,
        workspace,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        rustix::fs::ResolveFlags::NO_SYMLINKS | rustix::fs::ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(fail(root, "open the workspace"))?;
    let mut m = Merger {
        dst_root: &dst,
        links: HashMap::new(),
        removed: 0,
    };
    m.merge_dir(layer.as_fd(), dst.as_fd(), root, 0)?;
    let st = rustix::fs::fstat(&layer).map_err(fail(root, "stat"))?;
    finish(dst.as_fd(), &st, root)
}

struct Merger<'a> {
    dst_root: &'a OwnedFd,
    /// (dev, ino) of the layer's multiply linked files -> the path of their first copy.
    links: HashMap<(u64, u64), PathBuf>,
    removed: u64,
}

/// What an entry's overlay attributes ask for.
enum Overlay {
    Plain,
    /// A directory that hides what the lower layer has beneath it.
    Opaque,
}

impl Merger<'_> {
    /// Merges the directory `src` of the layer (at `rel`, `depth` levels down) into `dst`.
    fn merge_dir(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        rel: &Path,
        depth: usize,
    ) -> Result<(), MergeError> {
        if depth > MAX_DEPTH {
            return Err(MergeError {
                path: rel.to_path_buf(),
                what: format!("more than {MAX_DEPTH} directories deep"),
            });
        }
        for name in read_names(src).map_err(fail(rel, "read the directory"))? {
            self.merge_entry(src, dst, &name, &rel.join(&name), depth)?;
        }
        Ok(())
    }

    fn merge_entry(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        name: &OsString,
        rel: &Path,
        depth: usize,
    ) -> Result<(), MergeError> {
        let st =
            rustix::fs::statat(src, name, AtFlags::SYMLINK_NOFOLLOW).map_err(fail(rel, "stat"))?;
        let existing = match rustix::fs::statat(dst, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(s) => Some(FileType::from_raw_mode(s.st_mode)),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(fail(rel, "stat in the workspace")(e)),
        };
        let nofollow = OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let from = open_dir(src, name).map_err(fail(rel, "open"))?;
                let keep = match (overlay_attrs(from.as_fd(), rel)?, existing) {
                    (_, None) => false,
                    (Overlay::Plain, Some(FileType::Directory)) => true,
                    (_, Some(ft)) => {
                        self.remove(dst, name, ft, rel)?;
                        false
                    }
                };
                if !keep {
                    rustix::fs::mkdirat(dst, name, Mode::from_raw_mode(0o700))
                        .map_err(fail(rel, "make the directory"))?;
                }
                let to = open_dir(dst, name).map_err(fail(rel, "open in the workspace"))?;
                self.merge_dir(from.as_fd(), to.as_fd(), rel, depth + 1)?;
                finish(to.as_fd(), &st, rel)
            }
            FileType::RegularFile => {
                let from = rustix::fs::openat(src, name, OFlags::RDONLY | nofollow, Mode::empty())
                    .map_err(fail(rel, "open"))?;
                // An opaque mark means nothing on a file; a refused attribute stops the merge.
                overlay_attrs(from.as_fd(), rel)?;
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1 {
                    if let Some(first) = self.links.get(&key).cloned() {
                        if let Some(ft) = existing {
                            self.remove(dst, name, ft, rel)?;
                        }
                        return rustix::fs::linkat(
                            self.dst_root,
                            first.as_path(),
                            dst,
                            name,
                            AtFlags::empty(),
                        )
                        .map_err(fail(rel, "link"));
                    }
                    self.links.insert(key, rel.to_path_buf());
                }
                // A file the workspace has is truncated in place: overlayfs copies it up
                // without its data, where a removal and a new file would be a whiteout made
                // and replaced again. One this cannot open for writing is replaced.
                let truncated = match existing {
                    Some(FileType::RegularFile) => match rustix::fs::openat(
                        dst,
                        name,
                        OFlags::WRONLY | OFlags::TRUNC | nofollow,
                        Mode::empty(),
                    ) {
                        Ok(fd) => Some(fd),
                        Err(Errno::ACCESS | Errno::PERM) => {
                            self.remove(dst, name, FileType::RegularFile, rel)?;
                            None
                        }
                        Err(e) => return Err(fail(rel, "open in the workspace")(e)),
                    },
                    Some(ft) => {
                        self.remove(dst, name, ft, rel)?;
                        None
                    }
                    None => None,
                };
                let to = match truncated {
                    Some(fd) => fd,
                    None => rustix::fs::openat(
                        dst,
                        name,
                        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | nofollow,
                        Mode::from_raw_mode(0o600),
                    )
                    .map_err(fail(rel, "create"))?,
                };
                // The layer and the workspace are two filesystems: copy_file_range would
                // refuse (EXDEV) before sendfile does it.
                while rustix::fs::sendfile(&to, &from, None, 1 << 30).map_err(fail(rel, "copy"))?
                    > 0
                {}
                finish(to.as_fd(), &st, rel)
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(src, name, Vec::new())
                    .map_err(fail(rel, "read the link"))?;
                if let Some(ft) = existing {
                    self.remove(dst, name, ft, rel)?;
                }
                rustix::fs::symlinkat(target.as_c_str(), dst, name)
                    .map_err(fail(rel, "make the symlink"))?;
                finish_at(dst, name, &st, rel, false)
            }
            // A whiteout: the entry is gone.
            FileType::CharacterDevice if st.st_rdev == 0 => match existing {
                Some(ft) => self.remove(dst, name, ft, rel),
                None => Ok(()),
            },
            ft @ (FileType::Fifo | FileType::Socket) => {
                if let Some(existing) = existing {
                    self.remove(dst, name, existing, rel)?;
                }
                rustix::fs::mknodat(dst, name, ft, Mode::from_raw_mode(0o600), 0)
                    .map_err(fail(rel, "make the node"))?;
                finish_at(dst, name, &st, rel, true)
            }
            _ => Err(MergeError {
                path: rel.to_path_buf(),
                what: "a device node other than a whiteout".into(),
            }),
        }
    }

    /// Removes the workspace's entry `name` (of type `ft`) in `dir`, a directory with all it
    /// holds.
    fn remove(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &OsString,
        ft: FileType,
        rel: &Path,
    ) -> Result<(), MergeError> {
        self.removed += 1;
        if self.removed > MAX_REMOVED {
            return Err(MergeError {
                path: rel.to_path_buf(),
                what: format!("more than {MAX_REMOVED} entries of the workspace to remove"),
            });
        }
        if ft != FileType::Directory {
            return rustix::fs::unlinkat(dir, name, AtFlags::empty())
                .map_err(fail(rel, "remove from the workspace"));
        }
        let sub = open_dir(dir, name).map_err(fail(rel, "open in the workspace"))?;
        for child in read_names(sub.as_fd()).map_err(fail(rel, "read in the workspace"))? {
            let st = rustix::fs::statat(&sub, &child, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(fail(rel, "stat in the workspace"))?;
            let ft = FileType::from_raw_mode(st.st_mode);
            self.remove(sub.as_fd(), &child, ft, &rel.join(&child))?;
        }
        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
            .map_err(fail(rel, "remove from the workspace"))
    }
}

/// Gives the open entry `fd` the owner, mode and mtime of the layer's entry `st`.
fn finish(fd: BorrowedFd<'_>, st: &Stat, rel: &Path) -> Result<(), MergeError> {
    let now = rustix::fs::fstat(fd).map_err(fail(rel, "stat in the workspace"))?;
    let chown = (now.st_uid, now.st_gid) != (st.st_uid, st.st_gid);
    if chown {
        rustix::fs::fchown(fd, Some(uid(st)), Some(gid(st)))
            .map_err(fail(rel, "change the owner of"))?;
    }
    // After a chown, which clears set-id bits; else only when the mode differs (each change
    // through the overlay is a write of the upper inode).
    if chown || now.st_mode & 0o7777 != st.st_mode & 0o7777 {
        rustix::fs::fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o7777))
            .map_err(fail(rel, "change the mode of"))?;
    }
    rustix::fs::futimens(fd, &mtime_of(st)).map_err(fail(rel, "set the mtime of"))
}

/// As [`finish`], for the entry `name` of `dir` that cannot be opened (a symlink, a fifo or a
/// socket this merge made); its mode is set unless it is a symlink.
fn finish_at(
    dir: BorrowedFd<'_>,
    name: &OsString,
    st: &Stat,
    rel: &Path,
    mode: bool,
) -> Result<(), MergeError> {
    rustix::fs::chownat(
        dir,
        name,
        Some(uid(st)),
        Some(gid(st)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(fail(rel, "change the owner of"))?;
    if mode {
        // A node this merge made a moment ago in a directory no one else writes to.
        rustix::fs::chmodat(
            dir,
            name,
            Mode::from_raw_mode(st.st_mode & 0o7777),
            AtFlags::empty(),
        )
        .map_err(fail(rel, "change the mode of"))?;
    }
    rustix::fs::utimensat(dir, name, &mtime_of(st), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(fail(rel, "set the mtime of"))
}

fn uid(st: &Stat) -> Uid {
    Uid::from_raw(st.st_uid)
}

fn gid(st: &Stat) -> Gid {
    Gid::from_raw(st.st_gid)
}

/// The mtime of `st`, the atime left as it is.
fn mtime_of(st: &Stat) -> Timestamps {
    Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: st.st_mtime,
            tv_nsec: st.st_mtime_nsec as _,
        },
    }
}

/// The overlay attributes of a layer's directory or file (`user.overlay.*`, or
/// `trusted.overlay.*` for a layer an overlay mounted without `userxattr` wrote): an opaque
/// directory is merged as one made anew; a redirect, a metacopy or an xattr whiteout is
/// refused (the remount carries it); the attributes that only keep inode numbers stable
/// (`origin`, `impure`, ...) do not change what the layer shows and are left out, as a
/// checkpoint's copy of a layer leaves out every other attribute.
fn overlay_attrs(fd: BorrowedFd<'_>, rel: &Path) -> Result<Overlay, MergeError> {
    let mut names = Vec::new();
    let mut size = 256;
    loop {
        names.resize(size, 0u8);
        match rustix::fs::flistxattr(fd, &mut names[..]) {
            Ok(n) => {
                names.truncate(n);
                break;
            }
            Err(Errno::RANGE) if size < 1 << 16 => size *= 4,
            Err(Errno::NOTSUP) => return Ok(Overlay::Plain),
            Err(e) => return Err(fail(rel, "list the attributes of")(e)),
        }
    }
    let mut found = Overlay::Plain;
    for full in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Some(attr) = [&b"user.overlay."[..], b"trusted.overlay."]
            .iter()
            .find_map(|p| full.strip_prefix(*p))
        else {
            continue;
        };
        match attr {
            b"opaque" => {
                let mut v = [0u8; 4];
                let n = rustix::fs::fgetxattr(fd, full, &mut v[..])
                    .map_err(fail(rel, "read the attributes of"))?;
                // "y": opaque; "x": a directory that only holds xattr whiteouts, which this
                // does not merge.
                match &v[..n] {
                    b"y" => found = Overlay::Opaque,
                    _ => return Err(refused(rel, full)),
                }
            }
            b"redirect" | b"metacopy" | b"whiteout" => return Err(refused(rel, full)),
            _ => {}
        }
    }
    Ok(found)
}

fn refused(rel: &Path, attr: &[u8]) -> MergeError {
    MergeError {
        path: rel.to_path_buf(),
        what: format!(
            "the layer's attribute {} is carried by a mount only",
            std::ffi::OsStr::from_bytes(attr).to_string_lossy()
        ),
    }
}

/// The error of `what` failing on `rel`, made only when it fails.
fn fail<'a>(rel: &'a Path, what: &'a str) -> impl FnOnce(Errno) -> MergeError + 'a {
    move |e| MergeError {
        path: rel.to_path_buf(),
        what: format!("{what}: {}", std::io::Error::from(e)),
    }
}

/// Opens the directory `name` of `dir`, not through a symlink.
fn open_dir(dir: BorrowedFd<'_>, name: &OsString) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The names in the directory open as `fd` (its own offset is used: each directory is read
/// once, from a descriptor opened for it).
fn read_names(fd: BorrowedFd<'_>) -> Result<Vec<OsString>, Errno> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
    let mut dir = rustix::fs::RawDir::new(fd, &mut buf);
    let mut names = Vec::new();
    while let Some(entry) = dir.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    Ok(names)
}
