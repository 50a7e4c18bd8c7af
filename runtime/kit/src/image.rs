//! The contract between the image store (`taskbox-image`) and the backends.
//!
//! The store builds and unpacks images; the backends only see an [`ImageRoot`]: a digest, a
//! read-only root filesystem shared between sandboxes, and the image's config. Core cannot
//! depend on the store (the store runs its build steps in native sandboxes), so the store is
//! handed to the backends as an [`ImageResolver`].

use std::io::Write;
use std::path::PathBuf;

use crate::api::ApiError;

/// Where the workspace appears inside a sandbox that has an image as its root, unless the image
/// sets its own working directory. (With the host view the workspace keeps its host path.)
pub const DEFAULT_WORKDIR: &str = "/workspace";

/// An image ready to be a sandbox's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRoot {
    /// The manifest digest, `sha256:<64 hex>`: the image's name everywhere in taskbox.
    pub digest: String,
    /// The config blob's digest, `sha256:<64 hex>` (Docker's image ID once loaded).
    pub config_digest: String,
    /// The unpacked root filesystem. Never written to: backends mount it read-only.
    pub rootfs: PathBuf,
    pub config: ImageConfig,
}

/// The parts of an image's config that a sandbox uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageConfig {
    /// Variables set in every exec, before the policy's own.
    pub env: Vec<(String, String)>,
    /// Absolute path where the workspace is mounted and where commands start.
    pub workdir: String,
    /// `UID[:GID]` commands run as (numeric); `None`: the backend's default non-root user.
    pub user: Option<String>,
    /// The shell used for `shell` execs, e.g. `["/bin/sh", "-c"]`.
    pub shell: Vec<String>,
}

impl Default for ImageConfig {
    fn default() -> ImageConfig {
        ImageConfig {
            env: vec![(
                "PATH".into(),
                "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin".into(),
            )],
            workdir: DEFAULT_WORKDIR.into(),
            user: None,
            shell: vec!["/bin/sh".into(), "-c".into()],
        }
    }
}

/// Resolves image names and digests for the backends.
pub trait ImageResolver: Send + Sync {
    /// `name_or_digest`: an image name built here (`busybox`), or a digest (`sha256:...`, or an
    /// unambiguous prefix of its hex of at least 12 characters). Unpacks the rootfs on first use.
    /// A missing image is `ApiError::NotFound` whose message says how to build it.
    fn resolve(&self, name_or_digest: &str) -> Result<ImageRoot, ApiError>;

    /// Writes the image as a `docker load` archive (manifest.json + OCI layout, uncompressed
    /// layers), so Docker's image ID equals `config_digest`.
    fn docker_archive(&self, digest: &str, out: &mut dyn Write) -> Result<(), ApiError>;
}
