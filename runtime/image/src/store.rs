//! The image store, `STATE/images/`:
//!
//! ```text
//! oci-layout, index.json   an OCI image layout: index.json lists every image, the current one of
//!                          each name annotated with org.opencontainers.image.ref.name
//! blobs/sha256/HEX         manifests, configs and layers (uncompressed tars)
//! cache/KEY.json           build cache: step input key -> the layer it produced
//! rootfs/CHAIN/            unpacked root filesystems, named by the layers' chain ID (mode 0700
//!                          above them: setuid files of an image are nobody's business on the host)
//! debs/                    downloaded .deb files shared by Debian builds
//! tmp/                     build scratch (same filesystem, so results are renamed into place)
//! .gc.lock                 shared by builds and unpacks, exclusive for removals
//! .index.lock              serializes index.json updates
//! ```
//!
//! Blobs are written to a temporary file and renamed to their digest, index.json is replaced
//! atomically, and root filesystems are unpacked beside their final name and renamed: a reader
//! never sees half of anything.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::Digest;
use taskbox_core::api::ApiError;
use taskbox_core::image::{ImageConfig, ImageResolver, ImageRoot};

use crate::layer::{Entry, HashingWriter, write_tar};
use crate::oci::{
    self, ANNOTATION_DEFINITION, ANNOTATION_REF_NAME, Descriptor, DockerManifest, ImageConfigBlob,
    Index, MEDIA_MANIFEST, Manifest,
};
use crate::sys::{FileLock, LockMode};
use crate::unpack::LayerFile;
use crate::{ImageError, chain_id, digest_hex, io_err, sha256_digest};

/// The shortest digest prefix (hex characters) accepted as a name.
pub const MIN_PREFIX: usize = 12;

/// An image store under a state directory.
#[derive(Debug, Clone)]
pub struct Store {
    state_dir: PathBuf,
    dir: PathBuf,
}

/// A cached build result: the layer a step produced from its inputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub layer: String,
    pub size: u64,
    pub created_by: String,
    /// For a Debian base: the installed packages (name -> version).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub packages: BTreeMap<String, String>,
    /// The hashes of the inputs (files, policies) the key was computed from.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub inputs: BTreeMap<String, String>,
}

/// An image in the store, with its documents read and parsed.
#[derive(Debug, Clone)]
pub struct StoredImage {
    pub digest: String,
    pub manifest: Manifest,
    pub config: ImageConfigBlob,
    /// Names pointing at this image.
    pub names: Vec<String>,
    /// The definition it was built from, when known.
    pub definition: Option<PathBuf>,
}

impl StoredImage {
    pub fn config_digest(&self) -> &str {
        &self.manifest.config.digest
    }

    pub fn diff_ids(&self) -> Vec<String> {
        self.manifest
            .layers
            .iter()
            .map(|l| l.digest.clone())
            .collect()
    }

    /// The parts of the config a sandbox uses.
    pub fn image_config(&self) -> ImageConfig {
        let c = &self.config.config;
        let defaults = ImageConfig::default();
        ImageConfig {
            env: c
                .env
                .iter()
                .map(|kv| match kv.split_once('=') {
                    Some((k, v)) => (k.to_owned(), v.to_owned()),
                    None => (kv.clone(), String::new()),
                })
                .collect(),
            workdir: if c.working_dir.is_empty() {
                defaults.workdir
            } else {
                c.working_dir.clone()
            },
            user: c.user.clone().filter(|u| !u.is_empty()),
            shell: if c.shell.is_empty() {
                defaults.shell
            } else {
                c.shell.clone()
            },
        }
    }

    /// Each layer's description from the history (`created_by`), by position.
    pub fn layer_labels(&self) -> Vec<String> {
        (0..self.manifest.layers.len())
            .map(|i| {
                self.config
                    .history
                    .get(i)
                    .map(|h| h.created_by.clone())
                    .unwrap_or_else(|| format!("layer {}", i + 1))
            })
            .collect()
    }
}

/// One line of `image ls`.
#[derive(Debug, Clone, Serialize)]
pub struct ImageSummary {
    pub names: Vec<String>,
    pub digest: String,
    pub config_digest: String,
    pub layers: usize,
    pub size: u64,
    pub created: String,
}

/// What `remove` removed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Removed {
    pub names: Vec<String>,
    pub images: Vec<String>,
    pub blobs: usize,
    pub bytes: u64,
}

impl Store {
    /// Opens (creating) the store of `state_dir`: `STATE/images`.
    pub fn open(state_dir: &Path) -> Result<Store, ImageError> {
        Store::open_in(state_dir, state_dir.join("images"))
    }

    /// Opens (creating) the store the command line uses: `$TASKBOX_IMAGE_DIR` when set (one
    /// store shared by several state directories, e.g. a test suite's), else `STATE/images`.
    pub fn open_default(state_dir: &Path) -> Result<Store, ImageError> {
        match std::env::var_os("TASKBOX_IMAGE_DIR") {
            Some(dir) if !dir.is_empty() => Store::open_in(state_dir, PathBuf::from(dir)),
            _ => Store::open(state_dir),
        }
    }

    /// Opens (creating) a store in `dir`; `state_dir` holds what its build steps need.
    pub fn open_in(state_dir: &Path, dir: PathBuf) -> Result<Store, ImageError> {
        for d in ["blobs/sha256", "cache", "tmp", "debs"] {
            let p = dir.join(d);
            fs::create_dir_all(&p).map_err(io_err(format!("cannot create {}", p.display())))?;
        }
        let rootfs = dir.join("rootfs");
        if !rootfs.is_dir() {
            fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(&rootfs)
                .map_err(io_err(format!("cannot create {}", rootfs.display())))?;
        }
        let layout = dir.join("oci-layout");
        if !layout.exists() {
            write_atomic(&layout, oci::OCI_LAYOUT.as_bytes())?;
        }
        if !dir.join("index.json").exists() {
            write_atomic(&dir.join("index.json"), &oci::to_json(&Index::default()))?;
        }
        Ok(Store {
            state_dir: state_dir.to_path_buf(),
            dir,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.dir.join("tmp")
    }

    pub fn debs_dir(&self) -> PathBuf {
        self.dir.join("debs")
    }

    pub(crate) fn gc_lock(&self, mode: LockMode) -> Result<FileLock, ImageError> {
        let p = self.dir.join(".gc.lock");
        FileLock::acquire(&p, mode).map_err(io_err(format!("cannot lock {}", p.display())))
    }

    /// The path of a blob, checking the digest's form.
    pub fn blob_path(&self, digest: &str) -> Result<PathBuf, ImageError> {
        let hex = digest_hex(digest)
            .ok_or_else(|| ImageError::Invalid(format!("{digest:?} is not a sha256 digest")))?;
        Ok(self.dir.join("blobs/sha256").join(hex))
    }

    pub fn has_blob(&self, digest: &str) -> bool {
        self.blob_path(digest).is_ok_and(|p| p.is_file())
    }

    /// Reads a blob and checks it against its digest.
    pub fn read_blob(&self, digest: &str) -> Result<Vec<u8>, ImageError> {
        let p = self.blob_path(digest)?;
        let data = fs::read(&p).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                ImageError::Corrupt(format!("blob {digest} is missing from {}", p.display()))
            } else {
                ImageError::Io {
                    what: format!("cannot read {}", p.display()),
                    source: e,
                }
            }
        })?;
        let got = sha256_digest(&data);
        if got != digest {
            return Err(ImageError::Corrupt(format!(
                "blob {digest} hashes to {got}: it was modified or corrupted"
            )));
        }
        Ok(data)
    }

    /// Re-hashes a stored blob; Ok(None) when it matches, Ok(Some(actual)) when not.
    pub fn rehash(&self, digest: &str) -> Result<Option<String>, ImageError> {
        let p = self.blob_path(digest)?;
        let mut f = File::open(&p).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                ImageError::Corrupt(format!("blob {digest} is missing from {}", p.display()))
            } else {
                ImageError::Io {
                    what: format!("cannot open {}", p.display()),
                    source: e,
                }
            }
        })?;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f
                .read(&mut buf)
                .map_err(io_err(format!("cannot read {}", p.display())))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let got = format!("sha256:{}", crate::hex(&h.finalize()));
        Ok((got != digest).then_some(got))
    }

    /// Stores `data` as a blob; returns its digest.
    pub fn put_blob(&self, data: &[u8]) -> Result<String, ImageError> {
        let digest = sha256_digest(data);
        let path = self.blob_path(&digest)?;
        if !path.is_file() {
            write_atomic(&path, data)?;
        }
        Ok(digest)
    }

    /// Writes `entries` as a layer blob; returns (digest, size).
    pub fn put_layer(&self, entries: &[Entry]) -> Result<(String, u64), ImageError> {
        let tmp = tempfile_in(&self.tmp_dir(), "layer")?;
        let file =
            File::create(&tmp).map_err(io_err(format!("cannot create {}", tmp.display())))?;
        let result = (|| {
            let w = write_tar(
                entries,
                HashingWriter::new(BufWriter::with_capacity(1 << 20, file)),
            )?;
            let (buf, digest, size) = w.finish();
            let file = buf
                .into_inner()
                .map_err(|e| io_err("cannot write a layer")(e.into_error()))?;
            file.sync_all().map_err(io_err("cannot sync a layer"))?;
            let path = self.blob_path(&digest)?;
            fs::rename(&tmp, &path).map_err(io_err(format!(
                "cannot move the layer to {}",
                path.display()
            )))?;
            Ok((digest, size))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    pub fn index(&self) -> Result<Index, ImageError> {
        let p = self.dir.join("index.json");
        let data = fs::read(&p).map_err(io_err(format!("cannot read {}", p.display())))?;
        serde_json::from_slice(&data)
            .map_err(|e| ImageError::Corrupt(format!("{}: {e}", p.display())))
    }

    /// Points `name` at the manifest `digest` (the image stays listed by digest when the name
    /// moves on).
    pub fn tag(
        &self,
        name: &str,
        digest: &str,
        size: u64,
        definition: &Path,
    ) -> Result<(), ImageError> {
        let p = self.dir.join(".index.lock");
        let _lock = FileLock::acquire(&p, LockMode::Exclusive)
            .map_err(io_err(format!("cannot lock {}", p.display())))?;
        let mut index = self.index()?;
        for m in &mut index.manifests {
            if m.annotations.get(ANNOTATION_REF_NAME).map(String::as_str) == Some(name) {
                m.annotations.remove(ANNOTATION_REF_NAME);
            }
        }
        let mut annotations = BTreeMap::new();
        annotations.insert(ANNOTATION_REF_NAME.to_owned(), name.to_owned());
        annotations.insert(
            ANNOTATION_DEFINITION.to_owned(),
            definition.display().to_string(),
        );
        index.manifests.push(Descriptor {
            media_type: MEDIA_MANIFEST.into(),
            digest: digest.to_owned(),
            size,
            annotations,
        });
        // One line per (image, name); an unnamed line only for an image without a name (an
        // earlier build whose name moved on), once.
        let named: BTreeSet<String> = index
            .manifests
            .iter()
            .filter(|m| m.annotations.contains_key(ANNOTATION_REF_NAME))
            .map(|m| m.digest.clone())
            .collect();
        let mut unnamed = BTreeSet::new();
        index.manifests.retain(|m| {
            m.annotations.contains_key(ANNOTATION_REF_NAME)
                || (!named.contains(&m.digest) && unnamed.insert(m.digest.clone()))
        });
        write_atomic(
            &self.dir.join("index.json"),
            &serde_json::to_vec_pretty(&index).unwrap_or_default(),
        )
    }

    /// The manifest digest of an image name, `sha256:` digest, or unambiguous hex prefix (at
    /// least [`MIN_PREFIX`] characters, of a manifest or a config digest).
    pub fn lookup(&self, name_or_digest: &str) -> Result<String, ImageError> {
        let index = self.index()?;
        let by_name = index.manifests.iter().find(|m| {
            m.annotations.get(ANNOTATION_REF_NAME).map(String::as_str) == Some(name_or_digest)
        });
        if let Some(m) = by_name {
            return Ok(m.digest.clone());
        }
        let hex = name_or_digest
            .strip_prefix("sha256:")
            .unwrap_or(name_or_digest);
        let is_hex = hex.len() >= MIN_PREFIX
            && hex.len() <= 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if is_hex {
            let mut found = BTreeSet::new();
            for m in &index.manifests {
                let mhex = digest_hex(&m.digest).unwrap_or("");
                if mhex.starts_with(hex) {
                    found.insert(m.digest.clone());
                    continue;
                }
                // A config digest (Docker's image ID) names its image too.
                if let Ok(img) = self.image(&m.digest)
                    && digest_hex(img.config_digest())
                        .unwrap_or("")
                        .starts_with(hex)
                {
                    found.insert(m.digest.clone());
                }
            }
            match found.len() {
                1 => return Ok(found.into_iter().next().unwrap_or_default()),
                0 => {}
                _ => {
                    return Err(ImageError::Invalid(format!(
                        "{name_or_digest} is ambiguous: it starts {} image digests; give more of it",
                        found.len()
                    )));
                }
            }
        }
        let hint = if crate::def::is_valid_name(name_or_digest) {
            format!(
                "no image named {name_or_digest} in {}: build it with `taskbox image build \
                 {name_or_digest}`",
                self.dir.display()
            )
        } else {
            format!(
                "no image {name_or_digest} in {} (give a name, a sha256: digest, or at least \
                 {MIN_PREFIX} hex characters of one)",
                self.dir.display()
            )
        };
        Err(ImageError::NotFound(hint))
    }

    /// Reads an image's manifest and config (both checked against their digests).
    pub fn image(&self, digest: &str) -> Result<StoredImage, ImageError> {
        let manifest: Manifest = serde_json::from_slice(&self.read_blob(digest)?)
            .map_err(|e| ImageError::Corrupt(format!("manifest {digest}: {e}")))?;
        let config: ImageConfigBlob =
            serde_json::from_slice(&self.read_blob(&manifest.config.digest)?).map_err(|e| {
                ImageError::Corrupt(format!("config {}: {e}", manifest.config.digest))
            })?;
        if config.rootfs.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::Corrupt(format!(
                "image {digest}: the config lists {} layers, the manifest {}",
                config.rootfs.diff_ids.len(),
                manifest.layers.len()
            )));
        }
        let index = self.index()?;
        let mut names = Vec::new();
        let mut definition = None;
        for m in index.manifests.iter().filter(|m| m.digest == digest) {
            if let Some(n) = m.annotations.get(ANNOTATION_REF_NAME) {
                names.push(n.clone());
            }
            if let Some(d) = m.annotations.get(ANNOTATION_DEFINITION) {
                definition = Some(PathBuf::from(d));
            }
        }
        Ok(StoredImage {
            digest: digest.to_owned(),
            manifest,
            config,
            names,
            definition,
        })
    }

    /// Every image in the store, named ones first.
    pub fn list(&self) -> Result<Vec<ImageSummary>, ImageError> {
        let index = self.index()?;
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for m in &index.manifests {
            if !seen.insert(m.digest.clone()) {
                continue;
            }
            let img = self.image(&m.digest)?;
            out.push(ImageSummary {
                names: img.names.clone(),
                digest: img.digest.clone(),
                config_digest: img.config_digest().to_owned(),
                layers: img.manifest.layers.len(),
                size: img.manifest.layers.iter().map(|l| l.size).sum(),
                created: img.config.created.clone(),
            });
        }
        out.sort_by(|a, b| {
            (a.names.is_empty(), a.names.first()).cmp(&(b.names.is_empty(), b.names.first()))
        });
        Ok(out)
    }

    /// An image's layer blobs, each with a label for errors and its digest to check.
    pub fn layer_files(
        &self,
        diff_ids: &[String],
        labels: &[String],
    ) -> Result<Vec<LayerFile>, ImageError> {
        diff_ids
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let label = format!(
                    "{} of {} ({}, {})",
                    i + 1,
                    diff_ids.len(),
                    short(d),
                    labels.get(i).map(String::as_str).unwrap_or("?")
                );
                Ok(LayerFile {
                    path: self.blob_path(d)?,
                    label,
                    digest: Some(d.clone()),
                })
            })
            .collect()
    }

    /// The root filesystem of the layers `diff_ids` (bottom first), unpacked on first use.
    pub fn rootfs_of(&self, diff_ids: &[String], labels: &[String]) -> Result<PathBuf, ImageError> {
        let chain = chain_id(diff_ids);
        let hex = digest_hex(&chain)
            .ok_or_else(|| ImageError::Invalid("an image without layers has no root".into()))?;
        let dest = self.dir.join("rootfs").join(hex);
        if dest.is_dir() {
            return Ok(dest);
        }
        let _gc = self.gc_lock(LockMode::Shared)?;
        let span = tracing::info_span!("unpack", chain = %short(&chain));
        let _enter = span.enter();
        let layers = self.layer_files(diff_ids, labels)?;
        crate::unpack::unpack_layers(&layers, &dest)?;
        Ok(dest)
    }

    /// The root filesystem of an image, unpacked on first use.
    pub fn rootfs(&self, img: &StoredImage) -> Result<PathBuf, ImageError> {
        self.rootfs_of(&img.diff_ids(), &img.layer_labels())
    }

    /// Removes build scratch and half-unpacked trees older than `age` (left by a build or an
    /// unpack that was killed).
    pub fn prune_scratch(&self, age: std::time::Duration) {
        let now = std::time::SystemTime::now();
        let old = |p: &Path| {
            fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| now.duration_since(t).is_ok_and(|d| d > age))
        };
        if let Ok(rd) = fs::read_dir(self.tmp_dir()) {
            for e in rd.flatten() {
                if old(&e.path()) {
                    taskbox_core::native::remove_tree(&e.path());
                }
            }
        }
        if let Ok(rd) = fs::read_dir(self.dir.join("rootfs")) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(".tmp-") && old(&e.path()) {
                    taskbox_core::native::remove_tree(&e.path());
                }
            }
        }
    }

    /// A cached build result, if its layer is still stored.
    pub fn cached(&self, key: &str) -> Option<CacheEntry> {
        let hex = digest_hex(key)?;
        let data = fs::read(self.dir.join("cache").join(format!("{hex}.json"))).ok()?;
        let entry: CacheEntry = serde_json::from_slice(&data).ok()?;
        self.has_blob(&entry.layer).then_some(entry)
    }

    pub fn put_cached(&self, key: &str, entry: &CacheEntry) -> Result<(), ImageError> {
        let hex = digest_hex(key)
            .ok_or_else(|| ImageError::Invalid(format!("invalid cache key {key}")))?;
        write_atomic(
            &self.dir.join("cache").join(format!("{hex}.json")),
            &serde_json::to_vec_pretty(entry).unwrap_or_default(),
        )
    }

    /// Removes images: a name removes the name (and its image, unless another name still points
    /// at it); a digest removes the image and all its names. Then removes whatever no remaining
    /// image uses (blobs, cache entries, unpacked trees).
    pub fn remove(&self, names_or_digests: &[String]) -> Result<Removed, ImageError> {
        let _gc = self.gc_lock(LockMode::Exclusive)?;
        let lock = self.dir.join(".index.lock");
        let _index_lock = FileLock::acquire(&lock, LockMode::Exclusive)
            .map_err(io_err(format!("cannot lock {}", lock.display())))?;
        let mut index = self.index()?;
        let mut removed = Removed::default();
        for arg in names_or_digests {
            let digest = self.lookup(arg)?;
            let by_name = index.manifests.iter().any(|m| {
                m.annotations.get(ANNOTATION_REF_NAME).map(String::as_str) == Some(arg.as_str())
            });
            let before: Vec<String> = index
                .manifests
                .iter()
                .filter_map(|m| m.annotations.get(ANNOTATION_REF_NAME).cloned())
                .collect();
            if by_name {
                index.manifests.retain(|m| {
                    m.annotations.get(ANNOTATION_REF_NAME).map(String::as_str) != Some(arg.as_str())
                });
            } else {
                index.manifests.retain(|m| m.digest != digest);
            }
            let after: BTreeSet<String> = index
                .manifests
                .iter()
                .filter_map(|m| m.annotations.get(ANNOTATION_REF_NAME).cloned())
                .collect();
            removed
                .names
                .extend(before.into_iter().filter(|n| !after.contains(n)));
            if !index.manifests.iter().any(|m| m.digest == digest) {
                removed.images.push(digest);
            }
        }
        write_atomic(
            &self.dir.join("index.json"),
            &serde_json::to_vec_pretty(&index).unwrap_or_default(),
        )?;
        self.collect_garbage(&index, &mut removed)?;
        Ok(removed)
    }

    fn collect_garbage(&self, index: &Index, removed: &mut Removed) -> Result<(), ImageError> {
        let mut keep = BTreeSet::new();
        let mut chains = BTreeSet::new();
        for m in &index.manifests {
            keep.insert(m.digest.clone());
            if let Ok(img) = self.image(&m.digest) {
                keep.insert(img.config_digest().to_owned());
                let ids = img.diff_ids();
                for i in 1..=ids.len() {
                    chains.insert(chain_id(&ids[..i]));
                }
                keep.extend(ids);
            }
        }
        let blobs = self.dir.join("blobs/sha256");
        for e in fs::read_dir(&blobs).map_err(io_err(format!("cannot list {}", blobs.display())))? {
            let e = e.map_err(io_err(format!("cannot list {}", blobs.display())))?;
            let digest = format!("sha256:{}", e.file_name().to_string_lossy());
            if !keep.contains(&digest) {
                removed.bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                removed.blobs += 1;
                let _ = fs::remove_file(e.path());
            }
        }
        let cache = self.dir.join("cache");
        for e in fs::read_dir(&cache).map_err(io_err(format!("cannot list {}", cache.display())))? {
            let e = e.map_err(io_err(format!("cannot list {}", cache.display())))?;
            let stale = fs::read(e.path())
                .ok()
                .and_then(|d| serde_json::from_slice::<CacheEntry>(&d).ok())
                .is_none_or(|c| !keep.contains(&c.layer));
            if stale {
                let _ = fs::remove_file(e.path());
            }
        }
        let rootfs = self.dir.join("rootfs");
        for e in
            fs::read_dir(&rootfs).map_err(io_err(format!("cannot list {}", rootfs.display())))?
        {
            let e = e.map_err(io_err(format!("cannot list {}", rootfs.display())))?;
            let chain = format!("sha256:{}", e.file_name().to_string_lossy());
            if !chains.contains(&chain) {
                taskbox_core::native::remove_tree(&e.path());
            }
        }
        Ok(())
    }

    /// Writes the image as an archive `docker load` accepts: `manifest.json` (Docker's format),
    /// plus `oci-layout`, `index.json` and the blobs of an OCI layout. Docker's image ID is then
    /// the config digest.
    pub fn write_docker_archive(
        &self,
        digest: &str,
        out: &mut dyn Write,
    ) -> Result<(), ImageError> {
        let img = self.image(digest)?;
        let hex = |d: &str| digest_hex(d).unwrap_or("").to_owned();
        let name = img.names.first().cloned().unwrap_or_else(|| "image".into());
        let tag = format!("taskbox/{name}:{}", &hex(digest)[..MIN_PREFIX]);
        let docker = vec![DockerManifest {
            config: format!("blobs/sha256/{}", hex(img.config_digest())),
            repo_tags: vec![tag.clone()],
            layers: img
                .manifest
                .layers
                .iter()
                .map(|l| format!("blobs/sha256/{}", hex(&l.digest)))
                .collect(),
        }];
        let mut annotations = BTreeMap::new();
        annotations.insert(ANNOTATION_REF_NAME.to_owned(), tag);
        let index = Index {
            manifests: vec![Descriptor {
                media_type: MEDIA_MANIFEST.into(),
                digest: digest.to_owned(),
                size: self
                    .blob_path(digest)?
                    .metadata()
                    .map(|m| m.len())
                    .unwrap_or(0),
                annotations,
            }],
            ..Index::default()
        };
        let write_err = |what: &str| {
            let what = format!("cannot write the archive ({what})");
            move |e: io::Error| ImageError::Io { what, source: e }
        };
        let mut ar = tar::Builder::new(out);
        let add_bytes = |ar: &mut tar::Builder<&mut dyn Write>, path: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            ar.append_data(&mut h, path, data).map_err(write_err(path))
        };
        add_bytes(&mut ar, "oci-layout", oci::OCI_LAYOUT.as_bytes())?;
        add_bytes(&mut ar, "index.json", &oci::to_json(&index))?;
        add_bytes(&mut ar, "manifest.json", &oci::to_json(&docker))?;
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o755);
        h.set_mtime(0);
        h.set_size(0);
        h.set_entry_type(tar::EntryType::Directory);
        for dir in ["blobs/", "blobs/sha256/"] {
            ar.append_data(&mut h.clone(), dir, io::empty())
                .map_err(write_err(dir))?;
        }
        let mut blobs = vec![digest.to_owned(), img.config_digest().to_owned()];
        for l in &img.manifest.layers {
            if !blobs.contains(&l.digest) {
                blobs.push(l.digest.clone());
            }
        }
        for d in blobs {
            let p = self.blob_path(&d)?;
            let f = File::open(&p).map_err(io_err(format!("cannot open {}", p.display())))?;
            let len = f
                .metadata()
                .map_err(io_err(format!("cannot stat {}", p.display())))?
                .len();
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_size(len);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            let name = format!("blobs/sha256/{}", hex(&d));
            ar.append_data(&mut h, &name, f.take(len))
                .map_err(write_err(&name))?;
        }
        ar.finish().map_err(write_err("end of archive"))?;
        Ok(())
    }
}

fn api_error(e: ImageError) -> ApiError {
    match e {
        ImageError::NotFound(m) => ApiError::NotFound(m),
        ImageError::Invalid(m) => ApiError::InvalidArgument(m),
        other => ApiError::Internal(other.to_string()),
    }
}

impl ImageResolver for Store {
    fn resolve(&self, name_or_digest: &str) -> Result<ImageRoot, ApiError> {
        let digest = self.lookup(name_or_digest).map_err(api_error)?;
        let img = self.image(&digest).map_err(api_error)?;
        let rootfs = self.rootfs(&img).map_err(api_error)?;
        Ok(ImageRoot {
            digest: img.digest.clone(),
            config_digest: img.config_digest().to_owned(),
            rootfs,
            config: img.image_config(),
        })
    }

    fn docker_archive(&self, digest: &str, out: &mut dyn Write) -> Result<(), ApiError> {
        let digest = self.lookup(digest).map_err(api_error)?;
        self.write_docker_archive(&digest, out).map_err(api_error)
    }
}

/// The first 12 hex characters of a digest, for messages.
pub fn short(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    hex.chars().take(MIN_PREFIX).collect()
}

/// A fresh path in `dir` for a temporary file or directory (not created).
pub(crate) fn tempfile_in(dir: &Path, prefix: &str) -> Result<PathBuf, ImageError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    fs::create_dir_all(dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Ok(dir.join(format!(
        ".{prefix}-{}-{nanos:x}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )))
}

/// Writes `data` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<(), ImageError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = tempfile_in(dir, "write")?;
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(ImageError::Io {
            what: format!("cannot write {}", path.display()),
            source: e,
        });
    }
    Ok(())
}
