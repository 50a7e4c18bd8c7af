//! taskbox-image: reproducible images.
//!
//! It owns image definitions (`images/NAME.toml`, [`def`]), the builder that turns them into
//! deterministic layers ([`build`], [`layer`], Debian bases through mmdebstrap in [`debian`]),
//! lock files ([`lock`]), and the image store (`STATE/images`, [`store`]): an OCI image layout
//! plus a build cache, the unpacked root filesystems the native backend mounts ([`unpack`]), and
//! the archives `docker load` takes. The backends see only `taskbox_core::image`'s contract,
//! which [`store::Store`] implements.
//!
//! Design notes: docs/images.md.

pub mod build;
pub mod debian;
pub mod def;
pub mod layer;
pub mod lock;
pub mod oci;
pub mod progress;
pub mod store;
mod sys;
pub mod unpack;
pub mod verify;

use std::io;
use std::path::PathBuf;

pub use build::{BuildOptions, BuildReport, build};
pub use store::Store;

/// Why an image operation failed. Messages say what failed and on what.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The definition is unreadable or invalid.
    #[error(transparent)]
    Def(#[from] def::DefError),
    /// A layer could not be listed or written.
    #[error(transparent)]
    Layer(#[from] layer::LayerError),
    /// A layer could not be unpacked.
    #[error(transparent)]
    Unpack(#[from] unpack::UnpackError),
    /// A run step's policy could not be loaded.
    #[error(transparent)]
    Policy(#[from] taskbox_core::policy::PolicyError),
    /// A filesystem operation failed.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// No such image (the message says how to build it).
    #[error("{0}")]
    NotFound(String),
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A stored blob does not match its digest, or a document is malformed.
    #[error("{0}")]
    Corrupt(String),
    /// A build step failed; nothing of it was cached.
    #[error("{step} failed: {message}")]
    StepFailed { step: String, message: String },
    /// The lock file is unreadable or disagrees with the definition.
    #[error("{}: {reason}", path.display())]
    Lock { path: PathBuf, reason: String },
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex(&sha2::Sha256::digest(data)))
}

/// The hex part of a `sha256:<64 hex>` digest, or None when it is not one.
pub fn digest_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(hex)
}

/// The OCI chain ID of a stack of layers (bottom first): what a root filesystem unpacked from
/// exactly these layers is named by.
pub fn chain_id(diff_ids: &[String]) -> String {
    let mut chain = String::new();
    for d in diff_ids {
        chain = if chain.is_empty() {
            d.clone()
        } else {
            sha256_digest(format!("{chain} {d}").as_bytes())
        };
    }
    chain
}
