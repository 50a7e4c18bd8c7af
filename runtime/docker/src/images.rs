//! Getting an image into the daemon (by digest, without a registry), and a resolver for images
//! that are already there.

use std::time::Duration;

use bollard::query_parameters::ImportImageOptions;
use futures_util::StreamExt;
use taskbox_core::api::ApiError;
use taskbox_core::image::{ImageConfig, ImageResolver, ImageRoot};

use crate::daemon::{Daemon, DaemonError};

/// Makes sure the daemon has `image` under its ID `config_digest`: when it does not, the
/// resolver writes the image as a `docker load` archive, which is loaded through the Engine API.
pub fn ensure_image(
    daemon: &Daemon,
    resolver: &dyn ImageResolver,
    image: &ImageRoot,
    load_timeout: Duration,
) -> Result<(), ApiError> {
    let present = daemon.block_on(daemon.call(
        "inspect an image",
        daemon.timeout,
        daemon.docker.inspect_image(&image.config_digest),
    ));
    match present {
        Ok(_) => return Ok(()),
        Err(DaemonError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let mut archive = Vec::new();
    resolver.docker_archive(&image.digest, &mut archive)?;
    tracing::info!(image = %image.digest, bytes = archive.len(), "loading the image into docker");
    let loaded: Result<(), DaemonError> = daemon.block_on(async {
        let body = bollard::body_full(archive.into());
        let mut stream = daemon.docker.import_image(
            ImportImageOptions {
                quiet: true,
                ..Default::default()
            },
            body,
            None,
        );
        let drain = async {
            while let Some(item) = stream.next().await {
                let info = item.map_err(|e| daemon.classify("load an image", e))?;
                if let Some(err) = info.error_detail.and_then(|d| d.message) {
                    return Err(DaemonError::Refused {
                        what: "load the image".into(),
                        message: err,
                    });
                }
            }
            Ok(())
        };
        match tokio::time::timeout(load_timeout, drain).await {
            Ok(r) => r,
            Err(_) => Err(daemon.unavailable(format!(
                "loading the image took longer than {}s",
                load_timeout.as_secs()
            ))),
        }
    });
    loaded?;
    let check = daemon.block_on(daemon.call(
        "inspect an image",
        daemon.timeout,
        daemon.docker.inspect_image(&image.config_digest),
    ));
    match check {
        Ok(_) => Ok(()),
        Err(DaemonError::NotFound(_)) => Err(ApiError::internal(format!(
            "the image {} was loaded into docker but no image has the ID {}: the archive's \
             config is not the image's",
            image.digest, image.config_digest
        ))),
        Err(e) => Err(e.into()),
    }
}

/// Resolves images the daemon already has, by ID (`sha256:...`) or by tag. A stopgap for
/// callers without an image store: such images cannot be loaded again, and their digest is the
/// daemon's image ID.
pub struct DaemonImages {
    daemon: Daemon,
}

impl std::fmt::Debug for DaemonImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonImages").finish()
    }
}

impl DaemonImages {
    pub fn new(socket: &str) -> Result<DaemonImages, ApiError> {
        Ok(DaemonImages {
            daemon: Daemon::new(socket, Duration::from_secs(15))?,
        })
    }
}

/// Splits `K=V` entries of an image config.
fn split_env(env: &[String]) -> Vec<(String, String)> {
    env.iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl ImageResolver for DaemonImages {
    fn resolve(&self, name_or_digest: &str) -> Result<ImageRoot, ApiError> {
        let d = &self.daemon;
        let inspect = d.block_on(d.call(
            "inspect an image",
            d.timeout,
            d.docker.inspect_image(name_or_digest),
        ));
        let img = match inspect {
            Ok(i) => i,
            Err(DaemonError::NotFound(_)) => {
                return Err(ApiError::not_found(format!(
                    "image {name_or_digest} is not in the Docker daemon; load it first (no image \
                     store is configured)"
                )));
            }
            Err(e) => return Err(e.into()),
        };
        let id = img
            .id
            .ok_or_else(|| ApiError::internal("the daemon reported an image without an ID"))?;
        let mut config = ImageConfig::default();
        if let Some(c) = img.config {
            if let Some(env) = c.env {
                config.env = split_env(&env);
            }
            if let Some(w) = c.working_dir.filter(|w| w.starts_with('/')) {
                config.workdir = w;
            }
            config.user = c
                .user
                .filter(|u| !u.is_empty() && u.split(':').all(|p| p.parse::<u32>().is_ok()));
        }
        Ok(ImageRoot {
            digest: id.clone(),
            config_digest: id,
            rootfs: std::path::PathBuf::new(),
            config,
        })
    }

    fn docker_archive(&self, digest: &str, _out: &mut dyn std::io::Write) -> Result<(), ApiError> {
        Err(ApiError::not_found(format!(
            "image {digest} is no longer in the Docker daemon and there is no image store to \
             load it from"
        )))
    }
}
