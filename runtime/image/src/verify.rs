//! `image verify`: is the stored image intact, and does its definition still build to it?
//!
//! 1. Every blob of the image (manifest, config, each layer) is hashed again and compared with
//!    its digest: a tampered or corrupted layer is named.
//! 2. The image is rebuilt from its definition in an empty temporary store (no cache; the
//!    lock's package pins apply; the .deb download cache is shared, as apt checks every package
//!    against the signed index), and the digests are compared layer by layer.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::build::{BuildOptions, build};
use crate::progress::Progress;
use crate::store::{Store, short, tempfile_in};
use crate::{ImageError, def, lock};

/// What `verify` found.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub digest: String,
    pub definition: Option<PathBuf>,
    /// The digest of the rebuild (None when it was not attempted).
    pub rebuilt: Option<String>,
    /// The lock's digest, when there is a lock.
    pub locked: Option<String>,
    /// Everything that does not match, one sentence each; empty when the image verifies.
    pub problems: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Verifies the image `name_or_digest`, or the image named by the definition file at a path
/// ending in `.toml`. `rebuild: false` checks the stored blobs only.
pub fn verify(
    store: &Store,
    name_or_digest: &str,
    rebuild: bool,
    progress: &dyn Progress,
) -> Result<VerifyReport, ImageError> {
    let (digest, definition) = if name_or_digest.ends_with(".toml") {
        let d = def::load(Path::new(name_or_digest))?;
        (store.lookup(&d.name)?, Some(d.path))
    } else {
        (store.lookup(name_or_digest)?, None)
    };
    let mut report = VerifyReport {
        digest: digest.clone(),
        definition: definition.clone(),
        rebuilt: None,
        locked: None,
        problems: Vec::new(),
    };
    // The manifest and the config are read (and so checked) first: they list the layers.
    let img = match store.image(&digest) {
        Ok(img) => img,
        Err(ImageError::Corrupt(m)) => {
            report.problems.push(m);
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    let labels = img.layer_labels();
    for (i, l) in img.manifest.layers.iter().enumerate() {
        let label = labels.get(i).map(String::as_str).unwrap_or("?");
        match store.rehash(&l.digest) {
            Ok(None) => {}
            Ok(Some(got)) => report.problems.push(format!(
                "layer {} of {} ({}: {label}) was modified or corrupted: the stored blob {} \
                 hashes to {got}",
                i + 1,
                img.manifest.layers.len(),
                short(&l.digest),
                l.digest
            )),
            Err(ImageError::Corrupt(m)) => report.problems.push(format!(
                "layer {} of {} ({label}): {m}",
                i + 1,
                img.manifest.layers.len()
            )),
            Err(e) => return Err(e),
        }
    }
    if !rebuild {
        return Ok(report);
    }
    let Some(def_path) = definition.or_else(|| img.definition.clone()) else {
        report.problems.push(format!(
            "image {} does not record the definition it was built from; verify it by path \
             (taskbox image verify images/NAME.toml)",
            short(&digest)
        ));
        return Ok(report);
    };
    report.definition = Some(def_path.clone());
    let d = def::load(&def_path)?;
    report.locked = lock::read(&lock::path_for(&d.path))?.map(|l| l.digest);

    let scratch = tempfile_in(&store.tmp_dir(), "verify")?;
    let result = (|| {
        let fresh = Store::open(&scratch)?;
        let opts = BuildOptions {
            no_cache: true,
            update_lock: false,
            write_lock: false,
            tag: false,
            debs_dir: Some(store.debs_dir()),
        };
        build(&fresh, &d, &opts, progress)
    })();
    taskbox_core::native::remove_tree(&scratch);
    let rebuilt = result?;
    report.rebuilt = Some(rebuilt.digest.clone());
    if rebuilt.digest != digest {
        let stored = img.diff_ids();
        let first = rebuilt
            .layers
            .iter()
            .enumerate()
            .find(|(i, l)| stored.get(*i) != Some(&l.digest));
        let detail = match first {
            Some((i, l)) => format!(
                "layer {} ({}) differs: stored {}, rebuilt {}",
                i + 1,
                l.created_by,
                stored
                    .get(i)
                    .map(|s| short(s))
                    .unwrap_or_else(|| "none".into()),
                short(&l.digest)
            ),
            None if stored.len() != rebuilt.layers.len() => format!(
                "the stored image has {} layers, the rebuild {}",
                stored.len(),
                rebuilt.layers.len()
            ),
            None => "the layers match; the config differs (env, workdir, user or shell)".into(),
        };
        report.problems.push(format!(
            "rebuilding {} gives {}, not the stored {}: {detail}",
            def_path.display(),
            rebuilt.digest,
            digest
        ));
    }
    if let Some(locked) = &report.locked
        && *locked != rebuilt.digest
    {
        report.problems.push(format!(
            "the lock records {locked}, the rebuild gives {}",
            rebuilt.digest
        ));
    }
    Ok(report)
}
