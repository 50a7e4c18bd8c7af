//! The content digest of a plain directory: what a trace records as the base of a workspace
//! that is not a git checkout, and what replay checks the directory it is given against.
//!
//! The digest is SHA-256 over one record per entry, in a fixed order (a depth-first walk with
//! each directory's names sorted as bytes): the entry's kind and path, and for a regular file
//! whether it is executable (as git keeps it), its size and the SHA-256 of its content, for a
//! symlink its target (never followed). Owners, times and the other permission bits are left
//! out: a copy (`cp -a`, a tar unpacked as another user) keeps the digest. A directory counts,
//! so an empty one does too.
//!
//! A directory larger than [`MAX_ENTRIES`] entries or [`MAX_BYTES`] of file content is not
//! digested (the walk stops there): the trace header is written when the sandbox is created,
//! and hashing a large tree would hold the create up.

use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The most entries a digested directory holds.
pub const MAX_ENTRIES: u64 = 50_000;
/// The most bytes of file content a digested directory holds.
pub const MAX_BYTES: u64 = 256 << 20;

/// A directory's digest and what it covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirDigest {
    /// Hex SHA-256.
    pub sha256: String,
    /// Entries (files, directories, symlinks, others) beneath the root.
    pub entries: u64,
    /// Bytes of file content.
    pub bytes: u64,
}

/// Why a directory has no digest.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("more than {MAX_ENTRIES} entries or {MAX_BYTES} bytes: too large to digest")]
    TooLarge,
}

/// The digest of the directory `root` (see the module doc).
pub fn dir_digest(root: &Path) -> Result<DirDigest, DigestError> {
    let mut w = Walker {
        root,
        hash: Sha256::new(),
        entries: 0,
        bytes: 0,
        buf: vec![0; 1 << 16],
    };
    w.dir(Path::new(""))?;
    Ok(DirDigest {
        sha256: hex(&w.hash.finalize()),
        entries: w.entries,
        bytes: w.bytes,
    })
}

struct Walker<'a> {
    root: &'a Path,
    hash: Sha256,
    entries: u64,
    bytes: u64,
    buf: Vec<u8>,
}

impl Walker<'_> {
    fn io(&self, rel: &Path) -> impl FnOnce(io::Error) -> DigestError + use<> {
        let path = self.root.join(rel);
        move |source| DigestError::Io { path, source }
    }

    fn dir(&mut self, rel: &Path) -> Result<(), DigestError> {
        let dir = self.root.join(rel);
        let mut names: Vec<_> = fs::read_dir(&dir)
            .map_err(self.io(rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(self.io(rel))?;
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for name in names {
            let child = rel.join(&name);
            self.entry(&child)?;
        }
        Ok(())
    }

    fn entry(&mut self, rel: &Path) -> Result<(), DigestError> {
        self.entries += 1;
        if self.entries > MAX_ENTRIES {
            return Err(DigestError::TooLarge);
        }
        let path = self.root.join(rel);
        let meta = fs::symlink_metadata(&path).map_err(self.io(rel))?;
        let ft = meta.file_type();
        let name = rel.as_os_str().as_bytes();
        if ft.is_dir() {
            self.record(b"dir", name, b"");
            return self.dir(rel);
        }
        if ft.is_symlink() {
            let target = fs::read_link(&path).map_err(self.io(rel))?;
            self.record(b"link", name, target.as_os_str().as_bytes());
        } else if ft.is_file() {
            self.bytes += meta.len();
            if self.bytes > MAX_BYTES {
                return Err(DigestError::TooLarge);
            }
            let content = self.content(rel)?;
            let exec = meta.permissions().mode() & 0o111 != 0;
            let facts = format!("{} {} {content}", u8::from(exec), meta.len());
            self.record(b"file", name, facts.as_bytes());
        } else {
            let kind: &[u8] = if ft.is_fifo() {
                b"fifo"
            } else if ft.is_socket() {
                b"socket"
            } else {
                b"device"
            };
            self.record(kind, name, b"");
        }
        Ok(())
    }

    /// Hex SHA-256 of a file's content.
    fn content(&mut self, rel: &Path) -> Result<String, DigestError> {
        let mut f = fs::File::open(self.root.join(rel)).map_err(self.io(rel))?;
        let mut h = Sha256::new();
        loop {
            let n = f.read(&mut self.buf).map_err(self.io(rel))?;
            if n == 0 {
                break;
            }
            h.update(&self.buf[..n]);
        }
        Ok(hex(&h.finalize()))
    }

    /// One entry: `kind NUL path NUL facts NL`, each part's length first so no two entries
    /// hash alike.
    fn record(&mut self, kind: &[u8], path: &[u8], facts: &[u8]) {
        for part in [kind, path, facts] {
            self.hash.update((part.len() as u64).to_le_bytes());
            self.hash.update(part);
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_digest_follows_content_names_and_the_executable_bit_only() {
        let a = tempfile::tempdir().unwrap();
        fs::write(a.path().join("f"), "x").unwrap();
        fs::create_dir(a.path().join("d")).unwrap();
        std::os::unix::fs::symlink("f", a.path().join("l")).unwrap();
        let first = dir_digest(a.path()).unwrap();
        assert_eq!((first.entries, first.bytes), (3, 1));
        // A copy elsewhere, with other times: the same digest.
        let b = tempfile::tempdir().unwrap();
        let cp = std::process::Command::new("cp")
            .arg("-r")
            .arg(a.path().join("."))
            .arg(b.path())
            .status()
            .unwrap();
        assert!(cp.success());
        std::os::unix::fs::symlink("f", b.path().join("l")).ok();
        assert_eq!(dir_digest(b.path()).unwrap(), first);
        // Content, a name, the executable bit, a new empty directory: each changes it.
        let changes: [&dyn Fn(&Path); 4] = [
            &|p| fs::write(p.join("f"), "y").unwrap(),
            &|p| fs::rename(p.join("f"), p.join("g")).unwrap(),
            &|p| fs::set_permissions(p.join("f"), fs::Permissions::from_mode(0o755)).unwrap(),
            &|p| fs::create_dir(p.join("e")).unwrap(),
        ];
        for change in changes {
            let c = tempfile::tempdir().unwrap();
            fs::write(c.path().join("f"), "x").unwrap();
            fs::create_dir(c.path().join("d")).unwrap();
            std::os::unix::fs::symlink("f", c.path().join("l")).unwrap();
            assert_eq!(dir_digest(c.path()).unwrap(), first);
            change(c.path());
            assert_ne!(dir_digest(c.path()).unwrap().sha256, first.sha256);
        }
    }
}
