//! Lock files: `images/NAME.lock`, beside the definition.
//!
//! A lock records what a build resolved and produced: the Debian packages installed in the base
//! (name and version) and, for every layer, the hash of its inputs, the layer digest and size,
//! and the resulting image and config digests. Only the package versions are *pins*: when a
//! lock exists, the next build installs exactly those versions or fails saying which one the
//! mirror no longer offers. Everything else is a record, rewritten by each successful build (so
//! a change to an input shows up as a change to the lock in review).
//!
//! `--update-lock` drops the pins and resolves the packages afresh; it is also needed after the
//! definition's package list changes (a build refuses a lock whose requested packages differ).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ImageError;

/// The lock format's version.
pub const VERSION: u32 = 1;

const HEADER: &str = "# Written by `taskbox image build`; commit it with the definition.\n\
# [debian].packages pin the base's package versions (`--update-lock` resolves them again);\n\
# the rest records each layer's input hash and digest, and the image digest they produced.\n";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockFile {
    pub version: u32,
    /// The image (manifest) digest the build produced.
    pub digest: String,
    pub config_digest: String,
    pub architecture: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debian: Option<DebianLock>,
    #[serde(default)]
    pub layer: Vec<LayerLock>,
}

/// The resolved Debian base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebianLock {
    pub suite: String,
    pub variant: String,
    /// The packages the definition asked for, sorted.
    pub requested: Vec<String>,
    /// Every installed package (name, with `:arch` for foreign ones) and its version.
    pub packages: BTreeMap<String, String>,
}

/// One layer's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerLock {
    /// `base` or `step[N]`.
    pub step: String,
    pub created_by: String,
    /// The cache key: the hash of everything the layer was built from.
    pub input: String,
    pub digest: String,
    pub size: u64,
    /// The hashes of the files and policies among those inputs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub inputs: BTreeMap<String, String>,
}

/// The lock file of a definition: `NAME.lock` beside `NAME.toml`.
pub fn path_for(definition: &Path) -> PathBuf {
    definition.with_extension("lock")
}

/// Reads a lock file; None when there is none.
pub fn read(path: &Path) -> Result<Option<LockFile>, ImageError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(ImageError::Lock {
                path: path.to_path_buf(),
                reason: format!("cannot read: {e}"),
            });
        }
    };
    let lock: LockFile = toml::from_str(&text).map_err(|e| ImageError::Lock {
        path: path.to_path_buf(),
        reason: format!(
            "invalid lock file ({}); fix it or delete it and build again",
            e.message().trim()
        ),
    })?;
    if lock.version != VERSION {
        return Err(ImageError::Lock {
            path: path.to_path_buf(),
            reason: format!(
                "lock format version {} is not {VERSION}; rebuild with --update-lock",
                lock.version
            ),
        });
    }
    Ok(Some(lock))
}

/// Renders a lock file.
pub fn render(lock: &LockFile) -> Result<String, ImageError> {
    let body = toml::to_string(lock)
        .map_err(|e| ImageError::Invalid(format!("cannot encode the lock: {e}")))?;
    Ok(format!("{HEADER}{body}"))
}

/// Writes the lock when its content changed; returns whether it did.
pub fn write(path: &Path, lock: &LockFile) -> Result<bool, ImageError> {
    let text = render(lock)?;
    if fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    fs::write(&tmp, text.as_bytes())
        .and_then(|()| fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            ImageError::Lock {
                path: path.to_path_buf(),
                reason: format!("cannot write: {e}"),
            }
        })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut packages = BTreeMap::new();
        packages.insert("bash".to_string(), "5.2.15-2+b7".to_string());
        let lock = LockFile {
            version: VERSION,
            digest: format!("sha256:{}", "a".repeat(64)),
            config_digest: format!("sha256:{}", "b".repeat(64)),
            architecture: "amd64".into(),
            debian: Some(DebianLock {
                suite: "bookworm".into(),
                variant: "apt".into(),
                requested: vec!["bash".into()],
                packages,
            }),
            layer: vec![LayerLock {
                step: "base".into(),
                created_by: "base debian".into(),
                input: format!("sha256:{}", "c".repeat(64)),
                digest: format!("sha256:{}", "d".repeat(64)),
                size: 10,
                inputs: BTreeMap::from([("host:/bin/busybox".into(), "sha256:x".into())]),
            }],
        };
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("x.lock");
        assert!(write(&p, &lock).unwrap());
        assert!(
            !write(&p, &lock).unwrap(),
            "an unchanged lock is not rewritten"
        );
        assert_eq!(read(&p).unwrap().unwrap(), lock);
        fs::write(&p, "version = 1\nbogus = 2\n").unwrap();
        let err = read(&p).unwrap_err().to_string();
        assert!(
            err.contains("x.lock") && err.contains("invalid lock file"),
            "{err}"
        );
    }
}
