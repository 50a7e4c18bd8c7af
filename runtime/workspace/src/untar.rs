//! Unpacking a workspace handed in as a tar by someone the host does not trust (an API
//! client's upload, a task's workspace in the queue's object store).

use std::fs;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path};

/// Why a tar was refused: the entry and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UntarError(pub String);

/// Unpacks `tar` into `tree` (created): regular files, directories, symbolic links and hard
/// links within the tree, with permission bits only (no setuid, setgid or sticky bit, no owner
/// of the sender's); anything else (devices, FIFOs, a path leaving the tree, a write through a
/// link an earlier entry made) refuses the whole tar, naming the entry. Returns the number of
/// entries.
pub fn unpack_untrusted<R: Read>(tar: R, tree: &Path) -> Result<u64, UntarError> {
    let bad = |what: String| UntarError(what);
    fs::DirBuilder::new()
        .mode(0o755)
        .create(tree)
        .map_err(|e| bad(format!("cannot create {}: {e}", tree.display())))?;
    let mut archive = tar::Archive::new(tar);
    archive.set_preserve_permissions(false);
    archive.set_preserve_ownerships(false);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    let mut n = 0u64;
    let entries = archive
        .entries()
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("cannot read an entry: {e}")))?;
        let name = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "(unreadable name)".into());
        let shown: String = name.chars().take(200).collect();
        use tar::EntryType as T;
        match entry.header().entry_type() {
            T::Regular | T::Directory | T::Symlink | T::Link | T::Continuous => {}
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => continue,
            other => {
                return Err(bad(format!(
                    "entry {shown:?} is a {other:?}; only files, directories and links are taken"
                )));
            }
        }
        // Nothing is written through a symbolic link an earlier entry made: not into the
        // directory it names, not onto the file (the tar reader would follow it for a
        // directory's mode).
        let rel = entry
            .path()
            .map_err(|e| bad(format!("entry {shown:?}: {e}")))?
            .into_owned();
        if through_symlink(tree, &rel) {
            return Err(bad(format!(
                "entry {shown:?} would be written through a symbolic link of the tar"
            )));
        }
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        let unpacked = entry
            .unpack_in(tree)
            .map_err(|e| bad(format!("entry {shown:?}: {e}")))?;
        if !unpacked {
            return Err(bad(format!("entry {shown:?} leads out of the workspace")));
        }
        let p = tree.join(&rel);
        if fs::symlink_metadata(&p).is_ok_and(|m| !m.file_type().is_symlink()) {
            let _ = fs::set_permissions(&p, fs::Permissions::from_mode(mode | 0o200));
        }
        n += 1;
    }
    Ok(n)
}

/// Whether `rel`, or a directory on the way to it, is a symbolic link in `tree`.
fn through_symlink(tree: &Path, rel: &Path) -> bool {
    let mut p = tree.to_path_buf();
    for c in rel.components() {
        match c {
            Component::Normal(n) => p.push(n),
            Component::CurDir => continue,
            // `..`, `/`: the tar reader refuses these itself.
            _ => return false,
        }
        if fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            return true;
        }
    }
    false
}
