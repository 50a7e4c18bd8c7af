//! Unpacking layers into a root filesystem, refusing what could reach outside it.
//!
//! Layers come from the store, whose blobs are checked against their digests, but the unpacker
//! does not rely on that: every entry is checked as if it came from anywhere.
//! - Entry names must be relative and free of `..` (`./` prefixes are fine).
//! - Parent directories are resolved component by component without the kernel following any
//!   symlink: a symlink met on the way is resolved inside the root (an absolute target starts
//!   again at the root, as in the image), and one that would lead above the root is refused. The
//!   last component is never followed: an entry replaces whatever is there.
//! - Hard links must name an existing non-directory inside the root, resolved the same way.
//! - Device nodes are refused, except a 0:0 character device, which is an overlay-style
//!   whiteout. OCI whiteouts (`.wh.NAME`) remove `NAME`; `.wh..wh..opq` empties its directory of
//!   what lower layers put there.
//! - Owners are applied when running as root; permission bits always (setuid included: the
//!   store keeps unpacked trees under a directory only its owner may enter, and sandboxes run
//!   with `no_new_privs`). xattrs are not applied.

use std::collections::{HashSet, VecDeque};
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;

use crate::layer::{OPAQUE_MARKER, WHITEOUT_PREFIX};

/// Symlinks followed while resolving one name before giving up (as the kernel's limit).
const MAX_SYMLINK_HOPS: usize = 40;

/// Why a layer could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The entry is hostile or malformed: refused.
    #[error("layer {layer}: entry {entry:?} refused: {why}")]
    Refused {
        layer: String,
        entry: String,
        why: String,
    },
    /// A filesystem operation failed.
    #[error("layer {layer}: entry {entry:?}: cannot {op}: {source}")]
    Io {
        layer: String,
        entry: String,
        op: &'static str,
        source: io::Error,
    },
    /// The layer is not a readable tar.
    #[error("layer {layer}: not a valid tar archive: {source}")]
    Tar { layer: String, source: io::Error },
}

/// The normal components of a tar member name, or why the name is refused.
pub(crate) fn member_components(raw: &[u8]) -> Result<Vec<&[u8]>, String> {
    if raw.first() == Some(&b'/') {
        return Err("absolute path".into());
    }
    if raw.contains(&0) {
        return Err("NUL byte in the name".into());
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("`..` component".into()),
            c => out.push(c),
        }
    }
    Ok(out)
}

struct Layer<'a> {
    root: &'a Path,
    label: &'a str,
    is_root: bool,
    /// Paths created by this layer (an opaque marker keeps them).
    created: HashSet<PathBuf>,
    /// Directories whose mode, owner and mtime are set once the layer is done (a read-only
    /// directory must still take its children first).
    dirs: Vec<(PathBuf, u32, u32, u32, i64)>,
}

impl Layer<'_> {
    fn refused(&self, entry: &[u8], why: impl Into<String>) -> UnpackError {
        UnpackError::Refused {
            layer: self.label.to_owned(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            why: why.into(),
        }
    }

    fn io(&self, entry: &[u8], op: &'static str) -> impl FnOnce(io::Error) -> UnpackError {
        let layer = self.label.to_owned();
        let entry = String::from_utf8_lossy(entry).into_owned();
        move |source| UnpackError::Io {
            layer,
            entry,
            op,
            source,
        }
    }

    /// Resolves the directory named by `comps` inside the root, following symlinks inside it
    /// and creating missing directories (0755) when `create`.
    fn resolve_dir(
        &self,
        entry: &[u8],
        comps: &[&[u8]],
        create: bool,
    ) -> Result<PathBuf, UnpackError> {
        let mut cur: Vec<Vec<u8>> = Vec::new();
        let mut todo: VecDeque<Vec<u8>> = comps.iter().map(|c| c.to_vec()).collect();
        let mut hops = 0;
        while let Some(c) = todo.pop_front() {
            match c.as_slice() {
                b"" | b"." => continue,
                b".." => {
                    if cur.pop().is_none() {
                        return Err(
                            self.refused(entry, "a symlink on its path leads out of the root")
                        );
                    }
                    continue;
                }
                _ => {}
            }
            let mut path = self.root.to_path_buf();
            for p in &cur {
                path.push(OsStr::from_bytes(p));
            }
            path.push(OsStr::from_bytes(&c));
            match fs::symlink_metadata(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
                    fs::DirBuilder::new()
                        .mode(0o755)
                        .create(&path)
                        .map_err(self.io(entry, "create a parent directory"))?;
                    cur.push(c);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(self.refused(
                        entry,
                        format!("{} does not exist", String::from_utf8_lossy(&c)),
                    ));
                }
                Err(e) => return Err(self.io(entry, "look up a parent directory")(e)),
                Ok(m) if m.is_dir() => cur.push(c),
                Ok(m) if m.file_type().is_symlink() => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(self.refused(entry, "too many levels of symlinks on its path"));
                    }
                    let target = fs::read_link(&path).map_err(self.io(entry, "read a symlink"))?;
                    let target = target.as_os_str().as_bytes();
                    if target.first() == Some(&b'/') {
                        cur.clear();
                    }
                    for t in target.split(|b| *b == b'/').rev() {
                        todo.push_front(t.to_vec());
                    }
                }
                Ok(_) => {
                    return Err(self.refused(
                        entry,
                        format!(
                            "{} on its path is not a directory",
                            String::from_utf8_lossy(&c)
                        ),
                    ));
                }
            }
        }
        let mut path = self.root.to_path_buf();
        for p in &cur {
            path.push(OsStr::from_bytes(p));
        }
        Ok(path)
    }

    /// Removes whatever is at `path` (a directory with all it holds), if anything.
    fn remove(&self, entry: &[u8], path: &Path) -> Result<(), UnpackError> {
        match fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io(entry, "look up")(e)),
            Ok(m) if m.is_dir() => {
                fs::remove_dir_all(path).map_err(self.io(entry, "remove a directory"))
            }
            Ok(_) => fs::remove_file(path).map_err(self.io(entry, "remove")),
        }
    }

    fn chown(&self, entry: &[u8], path: &Path, uid: u32, gid: u32) -> Result<(), UnpackError> {
        if self.is_root {
            std::os::unix::fs::lchown(path, Some(uid), Some(gid))
                .map_err(self.io(entry, "set the owner"))?;
        }
        Ok(())
    }

    fn set_mtime(&self, entry: &[u8], path: &Path, mtime: i64) -> Result<(), UnpackError> {
        let t = TimeSpec::new(mtime, 0);
        utimensat(None, path, &t, &t, UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.io(entry, "set the mtime")(io::Error::from(e)))
    }

    fn apply<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let raw = entry.path_bytes().into_owned();
        let header = entry.header();
        let kind = header.entry_type();
        if kind == tar::EntryType::XGlobalHeader {
            return Ok(());
        }
        let comps = member_components(&raw).map_err(|why| self.refused(&raw, why))?;
        let Some((name, parents)) = comps.split_last() else {
            // The root itself ("./"): keep the root as created.
            return Ok(());
        };
        let field = |r: io::Result<u64>, what: &str| -> Result<u32, UnpackError> {
            r.ok()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| self.refused(&raw, format!("invalid {what} in the header")))
        };
        let mode = field(header.mode().map(u64::from), "mode")? & 0o7777;
        let uid = field(header.uid(), "uid")?;
        let gid = field(header.gid(), "gid")?;
        let mtime = i64::try_from(header.mtime().unwrap_or(0)).unwrap_or(0);
        let parent = self.resolve_dir(&raw, parents, true)?;

        if *name == OPAQUE_MARKER.as_bytes() {
            let children = fs::read_dir(&parent).map_err(self.io(&raw, "list the directory"))?;
            for child in children {
                let child = child.map_err(self.io(&raw, "list the directory"))?.path();
                if !self.created.contains(&child) {
                    self.remove(&raw, &child)?;
                }
            }
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(self.refused(&raw, "malformed whiteout"));
            }
            return self.remove(&raw, &parent.join(OsStr::from_bytes(hidden)));
        }
        let dst = parent.join(OsStr::from_bytes(name));
        match kind {
            tar::EntryType::Directory => {
                let existing = fs::symlink_metadata(&dst).ok();
                if !existing.as_ref().is_some_and(fs::Metadata::is_dir) {
                    self.remove(&raw, &dst)?;
                    fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&dst)
                        .map_err(self.io(&raw, "create the directory"))?;
                }
                self.dirs.push((dst.clone(), mode, uid, gid, mtime));
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                self.remove(&raw, &dst)?;
                let mut file = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&dst)
                    .map_err(self.io(&raw, "create the file"))?;
                io::copy(&mut entry, &mut file).map_err(self.io(&raw, "write the file"))?;
                drop(file);
                self.chown(&raw, &dst, uid, gid)?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(mode))
                    .map_err(self.io(&raw, "set the mode"))?;
                self.set_mtime(&raw, &dst, mtime)?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.refused(&raw, "symlink without a target"))?
                    .into_owned();
                if target.is_empty() || target.contains(&0) {
                    return Err(self.refused(&raw, "invalid symlink target"));
                }
                self.remove(&raw, &dst)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &dst)
                    .map_err(self.io(&raw, "create the symlink"))?;
                self.chown(&raw, &dst, uid, gid)?;
                self.set_mtime(&raw, &dst, mtime)?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.refused(&raw, "hard link without a target"))?
                    .into_owned();
                let tcomps = member_components(&target)
                    .map_err(|why| self.refused(&raw, format!("hard link target: {why}")))?;
                let Some((tname, tparents)) = tcomps.split_last() else {
                    return Err(self.refused(&raw, "hard link to the root"));
                };
                let tparent = self.resolve_dir(&raw, tparents, false)?;
                let tpath = tparent.join(OsStr::from_bytes(tname));
                match fs::symlink_metadata(&tpath) {
                    Ok(m) if !m.is_dir() => {}
                    Ok(_) => return Err(self.refused(&raw, "hard link to a directory")),
                    Err(_) => return Err(self.refused(&raw, "hard link to a missing file")),
                }
                if tpath == dst {
                    return Ok(());
                }
                self.remove(&raw, &dst)?;
                fs::hard_link(&tpath, &dst).map_err(self.io(&raw, "create the hard link"))?;
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                let major = header.device_major().ok().flatten().unwrap_or(1);
                let minor = header.device_minor().ok().flatten().unwrap_or(1);
                if kind == tar::EntryType::Char && major == 0 && minor == 0 {
                    // An overlay-style whiteout.
                    return self.remove(&raw, &dst);
                }
                return Err(self.refused(
                    &raw,
                    format!("device node {major}:{minor} (images may not carry devices)"),
                ));
            }
            tar::EntryType::Fifo => {
                self.remove(&raw, &dst)?;
                nix::unistd::mkfifo(&dst, Mode::from_bits_truncate(0o600))
                    .map_err(|e| self.io(&raw, "create the fifo")(io::Error::from(e)))?;
                self.chown(&raw, &dst, uid, gid)?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(mode))
                    .map_err(self.io(&raw, "set the mode"))?;
                self.set_mtime(&raw, &dst, mtime)?;
            }
            other => {
                return Err(self.refused(&raw, format!("unsupported entry type {other:?}")));
            }
        }
        self.created.insert(dst);
        Ok(())
    }

    fn finish(&mut self) -> Result<(), UnpackError> {
        // Deepest first, so a directory's mtime is set after its children changed it.
        for (path, mode, uid, gid, mtime) in std::mem::take(&mut self.dirs).into_iter().rev() {
            let raw = path.as_os_str().as_bytes().to_vec();
            self.chown(&raw, &path, uid, gid)?;
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(self.io(&raw, "set the mode"))?;
            self.set_mtime(&raw, &path, mtime)?;
        }
        Ok(())
    }
}

/// Applies one layer (an uncompressed tar) on top of the tree at `root`. `label` names the layer
/// in errors.
pub fn apply_layer<R: Read>(root: &Path, layer: R, label: &str) -> Result<(), UnpackError> {
    let mut state = Layer {
        root,
        label,
        is_root: nix::unistd::geteuid().is_root(),
        created: HashSet::new(),
        dirs: Vec::new(),
    };
    let mut archive = tar::Archive::new(layer);
    let entries = archive.entries().map_err(|source| UnpackError::Tar {
        layer: label.to_owned(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| UnpackError::Tar {
            layer: label.to_owned(),
            source,
        })?;
        state.apply(entry)?;
    }
    state.finish()
}

/// A layer on disk, as the unpacker takes it.
#[derive(Debug, Clone)]
pub struct LayerFile {
    pub path: PathBuf,
    /// Names the layer in errors.
    pub label: String,
    /// When set, the file must hash to this (`sha256:<hex>`), checked while it is read.
    pub digest: Option<String>,
}

impl LayerFile {
    pub fn new(path: impl Into<PathBuf>, label: impl Into<String>) -> LayerFile {
        LayerFile {
            path: path.into(),
            label: label.into(),
            digest: None,
        }
    }
}

/// A reader that hashes what passes through it.
struct HashingReader<R> {
    inner: R,
    hasher: sha2::Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use sha2::Digest;
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpacks `layers` (tar files, bottom first) into `dest`, which must not exist: first into a
/// sibling temporary directory, renamed into place when complete, so a reader never sees half a
/// tree. Returns false when another process finished the same tree first (its copy is kept).
pub fn unpack_layers(layers: &[LayerFile], dest: &Path) -> Result<bool, UnpackError> {
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let io_fail = |op: &'static str| {
        move |source: io::Error| UnpackError::Io {
            layer: "-".into(),
            entry: name_of(dest),
            op,
            source,
        }
    };
    fs::create_dir_all(parent).map_err(io_fail("create the parent directory"))?;
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        taskbox_core::native::remove_tree(&tmp);
    }
    fs::DirBuilder::new()
        .mode(0o755)
        .create(&tmp)
        .map_err(io_fail("create the temporary directory"))?;
    let result = (|| {
        for layer in layers {
            let io_fail = |op: &'static str| {
                let label = layer.label.clone();
                move |source| UnpackError::Io {
                    layer: label,
                    entry: "-".into(),
                    op,
                    source,
                }
            };
            let file = File::open(&layer.path).map_err(io_fail("open the layer"))?;
            let mut reader = HashingReader {
                inner: io::BufReader::with_capacity(1 << 20, file),
                hasher: <sha2::Sha256 as sha2::Digest>::new(),
            };
            apply_layer(&tmp, &mut reader, &layer.label)?;
            if let Some(want) = &layer.digest {
                // The rest of the file (the end-of-archive blocks) counts too.
                io::copy(&mut reader, &mut io::sink()).map_err(io_fail("read the layer"))?;
                let got = format!(
                    "sha256:{}",
                    crate::hex(&sha2::Digest::finalize(reader.hasher))
                );
                if &got != want {
                    return Err(UnpackError::Refused {
                        layer: layer.label.clone(),
                        entry: "-".into(),
                        why: format!(
                            "the layer file hashes to {got}, not {want}: it was modified or \
                             corrupted"
                        ),
                    });
                }
            }
        }
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
            .map_err(io_fail("set the root's mode"))
    })();
    if let Err(e) = result {
        taskbox_core::native::remove_tree(&tmp);
        return Err(e);
    }
    match fs::rename(&tmp, dest) {
        Ok(()) => Ok(true),
        Err(e) if dest.is_dir() => {
            tracing::debug!(error = %e, dest = %dest.display(), "another unpack won the race");
            taskbox_core::native::remove_tree(&tmp);
            Ok(false)
        }
        Err(e) => {
            taskbox_core::native::remove_tree(&tmp);
            Err(io_fail("move the tree into place")(e))
        }
    }
}

fn name_of(p: &Path) -> String {
    p.display().to_string()
}

/// A regular file read from a stack of layers, with its header's metadata.
#[derive(Debug, Clone)]
pub struct FoundFile {
    pub data: Vec<u8>,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
}

/// Reads the regular file at `path` (relative, `/`-separated) as the stack of `layers` (bottom
/// first) shows it: the topmost layer that names it wins; a whiteout of it or of a parent, or an
/// opaque parent, in a higher layer hides lower ones. Symlinked parents are not followed.
pub fn read_from_layers(
    layers: &[LayerFile],
    path: &str,
) -> Result<Option<FoundFile>, UnpackError> {
    let want: Vec<&[u8]> =
        member_components(path.as_bytes()).map_err(|why| UnpackError::Refused {
            layer: "-".into(),
            entry: path.to_owned(),
            why,
        })?;
    for lf in layers.iter().rev() {
        let label = &lf.label;
        let tar_err = |source| UnpackError::Tar {
            layer: label.clone(),
            source,
        };
        let file = File::open(&lf.path).map_err(tar_err)?;
        let mut archive = tar::Archive::new(io::BufReader::new(file));
        let mut found: Option<FoundFile> = None;
        let mut hidden = false;
        let mut link_to: Option<Vec<Vec<u8>>> = None;
        for entry in archive.entries_with_seek().map_err(tar_err)? {
            let mut entry = entry.map_err(tar_err)?;
            let raw = entry.path_bytes().into_owned();
            let Ok(comps) = member_components(&raw) else {
                continue;
            };
            let Some((name, parents)) = comps.split_last() else {
                continue;
            };
            let is_prefix_of_want = want.len() > parents.len() && want[..parents.len()] == *parents;
            if is_prefix_of_want {
                let next = want[parents.len()];
                if *name == OPAQUE_MARKER.as_bytes() {
                    hidden = true;
                } else if name.strip_prefix(WHITEOUT_PREFIX.as_bytes()) == Some(next) {
                    hidden = true;
                    found = None;
                }
            }
            if comps != want {
                continue;
            }
            let h = entry.header();
            let meta = (
                h.mode().unwrap_or(0o644) & 0o7777,
                h.uid().unwrap_or(0),
                h.gid().unwrap_or(0),
            );
            match h.entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let mut data = Vec::new();
                    entry.read_to_end(&mut data).map_err(tar_err)?;
                    found = Some(FoundFile {
                        data,
                        mode: meta.0,
                        uid: meta.1,
                        gid: meta.2,
                    });
                }
                tar::EntryType::Link => {
                    let target = entry.link_name_bytes().unwrap_or_default().into_owned();
                    let t = member_components(&target).unwrap_or_default();
                    link_to = Some(t.iter().map(|c| c.to_vec()).collect());
                }
                _ => {
                    return Err(UnpackError::Refused {
                        layer: label.clone(),
                        entry: path.to_owned(),
                        why: "not a regular file".into(),
                    });
                }
            }
        }
        if let Some(target) = link_to {
            let target: Vec<u8> = target.join(&b'/');
            let target = String::from_utf8_lossy(&target).into_owned();
            return read_from_layers(std::slice::from_ref(lf), &target);
        }
        if found.is_some() {
            return Ok(found);
        }
        if hidden {
            return Ok(None);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::{Content, Entry, EntryKind, write_tar};
    use std::os::unix::fs::MetadataExt;

    fn entry(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.as_bytes().to_vec(),
            kind,
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: 1,
        }
    }

    fn file(path: &str, data: &str) -> Entry {
        let mut e = entry(
            path,
            EntryKind::File(Content::Bytes(data.as_bytes().to_vec())),
        );
        e.mode = 0o644;
        e
    }

    /// A tar whose single member has exactly this (possibly hostile) name, written by hand
    /// because the tar crate refuses to write such names.
    fn raw_tar(members: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, kind, link) in members {
            let mut h = tar::Header::new_gnu();
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_size(0);
            if *kind == tar::EntryType::Char {
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
            }
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
        }
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn apply(root: &Path, data: &[u8]) -> Result<(), UnpackError> {
        apply_layer(root, data, "test")
    }

    #[test]
    fn layers_stack_with_whiteouts_and_opaque_dirs() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("r");
        fs::create_dir(&root).unwrap();
        let l1 = write_tar(
            &[
                entry("etc", EntryKind::Dir),
                file("etc/a", "a"),
                file("etc/b", "b"),
                entry("opt", EntryKind::Dir),
                file("opt/old", "old"),
                entry("usr", EntryKind::Dir),
                entry("usr/bin", EntryKind::Dir),
                entry("bin", EntryKind::Symlink(b"usr/bin".to_vec())),
            ],
            Vec::new(),
        )
        .unwrap();
        apply(&root, &l1).unwrap();
        let l2 = write_tar(
            &[
                file("etc/.wh.a", ""),
                entry("opt", EntryKind::Dir),
                file("opt/.wh..wh..opq", ""),
                file("opt/new", "new"),
                file("bin/tool", "tool"),
                entry("etc/hl", EntryKind::Hardlink(b"etc/b".to_vec())),
            ],
            Vec::new(),
        )
        .unwrap();
        apply(&root, &l2).unwrap();
        assert!(!root.join("etc/a").exists());
        assert_eq!(fs::read_to_string(root.join("etc/b")).unwrap(), "b");
        assert!(!root.join("opt/old").exists());
        assert_eq!(fs::read_to_string(root.join("opt/new")).unwrap(), "new");
        // Through the in-image symlink bin -> usr/bin.
        assert_eq!(
            fs::read_to_string(root.join("usr/bin/tool")).unwrap(),
            "tool"
        );
        let (a, b) = (
            fs::metadata(root.join("etc/hl")).unwrap(),
            fs::metadata(root.join("etc/b")).unwrap(),
        );
        assert_eq!(a.ino(), b.ino());
        assert_eq!(
            fs::metadata(root.join("etc/b"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o644
        );
    }

    #[test]
    fn hostile_entries_are_refused_with_the_reason() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (raw_tar(&[("../evil", tar::EntryType::Regular, "")]), "`..`"),
            (
                raw_tar(&[("a/../../evil", tar::EntryType::Regular, "")]),
                "`..`",
            ),
            (
                raw_tar(&[("/etc/evil", tar::EntryType::Regular, "")]),
                "absolute",
            ),
            (
                raw_tar(&[
                    ("esc", tar::EntryType::Symlink, "../../.."),
                    ("esc/evil", tar::EntryType::Regular, ""),
                ]),
                "leads out of the root",
            ),
            (
                raw_tar(&[
                    ("up", tar::EntryType::Symlink, "/.."),
                    ("up/evil", tar::EntryType::Regular, ""),
                ]),
                "leads out of the root",
            ),
            (
                raw_tar(&[("dev/sda", tar::EntryType::Char, "")]),
                "device node 1:3",
            ),
            (
                raw_tar(&[("disk", tar::EntryType::Block, "")]),
                "device node",
            ),
            (
                raw_tar(&[("hl", tar::EntryType::Link, "../outside")]),
                "`..`",
            ),
            (
                raw_tar(&[("hl", tar::EntryType::Link, "/etc/shadow")]),
                "absolute",
            ),
        ];
        for (data, want) in cases {
            let t = tempfile::tempdir().unwrap();
            let root = t.path().join("r");
            fs::create_dir(&root).unwrap();
            let err = apply(&root, &data).unwrap_err().to_string();
            assert!(
                err.contains("refused") && err.contains(want),
                "{want}: {err}"
            );
            // Nothing was written outside the root.
            let outside: Vec<_> = fs::read_dir(t.path()).unwrap().collect();
            assert_eq!(outside.len(), 1, "{want}: {outside:?}");
        }
    }

    #[test]
    fn a_symlink_inside_the_root_is_followed_only_inside_it() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("r");
        fs::create_dir(&root).unwrap();
        // An absolute target means the image's root, not the host's.
        let data = raw_tar(&[
            ("etc", tar::EntryType::Directory, ""),
            ("conf", tar::EntryType::Symlink, "/etc"),
            ("conf/x", tar::EntryType::Regular, ""),
        ]);
        apply(&root, &data).unwrap();
        assert!(root.join("etc/x").is_file());
    }

    #[test]
    fn unpack_is_atomic_and_leaves_nothing_on_failure() {
        let t = tempfile::tempdir().unwrap();
        let good = t.path().join("good.tar");
        fs::write(&good, write_tar(&[file("f", "x")], Vec::new()).unwrap()).unwrap();
        let bad = t.path().join("bad.tar");
        fs::write(&bad, raw_tar(&[("../x", tar::EntryType::Regular, "")])).unwrap();
        let dest = t.path().join("store/rootfs/abc");
        let layers = vec![LayerFile::new(&good, "1"), LayerFile::new(bad, "2")];
        assert!(unpack_layers(&layers, &dest).is_err());
        assert!(!dest.exists());
        assert_eq!(
            fs::read_dir(t.path().join("store/rootfs")).unwrap().count(),
            0
        );
        // A layer that does not hash to its digest is refused.
        let mut wrong = LayerFile::new(&good, "1");
        wrong.digest = Some(format!("sha256:{}", "0".repeat(64)));
        let err = unpack_layers(&[wrong], &dest).unwrap_err().to_string();
        assert!(err.contains("modified or corrupted"), "{err}");
        assert!(!dest.exists());
        let mut right = LayerFile::new(&good, "1");
        right.digest = Some(crate::sha256_digest(&fs::read(&good).unwrap()));
        assert!(unpack_layers(&[right], &dest).unwrap());
        assert!(dest.join("f").is_file());
    }

    #[test]
    fn read_from_layers_respects_whiteouts() {
        let t = tempfile::tempdir().unwrap();
        let l1 = t.path().join("1.tar");
        let l2 = t.path().join("2.tar");
        let l3 = t.path().join("3.tar");
        fs::write(
            &l1,
            write_tar(
                &[entry("etc", EntryKind::Dir), file("etc/passwd", "root\n")],
                Vec::new(),
            )
            .unwrap(),
        )
        .unwrap();
        fs::write(
            &l2,
            write_tar(&[file("etc/other", "x")], Vec::new()).unwrap(),
        )
        .unwrap();
        fs::write(
            &l3,
            write_tar(&[file("etc/.wh.passwd", "")], Vec::new()).unwrap(),
        )
        .unwrap();
        let two = vec![LayerFile::new(&l1, "1"), LayerFile::new(&l2, "2")];
        let f = read_from_layers(&two, "etc/passwd").unwrap().unwrap();
        assert_eq!(f.data, b"root\n");
        let three = vec![
            LayerFile::new(l1, "1"),
            LayerFile::new(l2, "2"),
            LayerFile::new(l3, "3"),
        ];
        assert!(read_from_layers(&three, "etc/passwd").unwrap().is_none());
    }
}
