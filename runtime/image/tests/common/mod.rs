//! Helpers shared by the image suites: the repository's image definitions, scratch stores, and
//! skipping (or, under `TASKBOX_REQUIRE_ALL=1`, failing) when a prerequisite is absent.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};

use taskbox_image::progress::Silent;
use taskbox_image::{BuildOptions, BuildReport, Store, def};
pub use taskbox_tests::require;

/// The repository's `images/` directory.
pub fn images_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../images")
}

/// Whether the static busybox the busybox image copies is installed.
pub fn have_busybox() -> bool {
    require(
        Path::new("/bin/busybox").is_file(),
        "/bin/busybox is missing (install busybox-static)",
    )
}

/// A scratch directory (removed on drop).
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("taskbox-image-test-")
        .tempdir()
        .unwrap()
}

/// A fresh store under `dir/NAME`.
pub fn store(dir: &Path, name: &str) -> Store {
    Store::open(&dir.join(name)).unwrap()
}

/// A copy of images/busybox.toml and images/files/ in `dir`, to change without touching the
/// repository; returns the definition's path.
pub fn busybox_context(dir: &Path) -> PathBuf {
    let ctx = dir.join("ctx");
    fs::create_dir_all(ctx.join("files")).unwrap();
    let images = images_dir();
    fs::copy(images.join("busybox.toml"), ctx.join("busybox.toml")).unwrap();
    for f in ["passwd", "group"] {
        fs::copy(images.join("files").join(f), ctx.join("files").join(f)).unwrap();
    }
    ctx.join("busybox.toml")
}

/// Builds a definition without writing a lock beside it.
pub fn build(store: &Store, definition: &Path) -> BuildReport {
    try_build(store, definition).unwrap()
}

pub fn try_build(
    store: &Store,
    definition: &Path,
) -> Result<BuildReport, taskbox_image::ImageError> {
    let d = def::load(definition)?;
    let opts = BuildOptions {
        write_lock: false,
        ..BuildOptions::default()
    };
    taskbox_image::build(store, &d, &opts, &Silent)
}

/// Writes a definition file `NAME.toml` in `dir` and returns its path.
pub fn definition(dir: &Path, name: &str, text: &str) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    fs::write(&p, text).unwrap();
    p
}
