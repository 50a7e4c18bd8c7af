//! Shared parts of the Docker backend's suites: a hand-made busybox image (a test-only
//! [`ImageResolver`]: rootfs tar with /bin/busybox and its applets, /etc/passwd with a uid 1000
//! user, an OCI config, and a `docker load` archive whose image ID is the config's digest), a
//! backend per test on a scratch state directory, and the skip rules.
//!
//! Tests hold a shared lock on a file while they run; the test that restarts dockerd holds it
//! exclusively, so no other Docker test runs meanwhile, whatever the runner's parallelism.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use taskbox_core::api::*;
use taskbox_core::image::{ImageConfig, ImageResolver, ImageRoot};
use taskbox_docker::{Docker, DockerBackend, DockerConfig};

pub const BUSYBOX: &str = "/bin/busybox";

/// Prints why a test is skipped; fails instead when `TASKBOX_REQUIRE_ALL=1`.
pub fn skip(reason: &str) {
    if std::env::var("TASKBOX_REQUIRE_ALL").as_deref() == Ok("1") {
        panic!("required test skipped: {reason}");
    }
    eprintln!("SKIP: {reason}");
}

/// Whether the Docker backend can be tested here: root, a static busybox, a daemon answering.
pub fn docker_ready() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("the docker backend needs root");
        return false;
    }
    if !Path::new(BUSYBOX).is_file() {
        skip("no static busybox at /bin/busybox to build the test image from");
        return false;
    }
    let ok = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        skip("no Docker daemon answers (start dockerd)");
        return false;
    }
    true
}

const LOCK_FILE: &str = "/tmp/taskbox-docker-tests.lock";

/// A lock held for the duration of a test (shared; exclusive for the dockerd restart test).
pub struct TestLock(std::fs::File);

pub fn test_lock(exclusive: bool) -> TestLock {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .unwrap();
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), op) }, 0);
    TestLock(f)
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The test image, built once per process.
pub struct TestImage {
    pub digest: String,
    pub config_digest: String,
    pub archive: Vec<u8>,
    pub rootfs: PathBuf,
    pub user: String,
    pub loads: AtomicUsize,
}

fn append(
    b: &mut tar::Builder<Vec<u8>>,
    path: &str,
    kind: tar::EntryType,
    mode: u32,
    data: &[u8],
    link: Option<&str>,
) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(data.len() as u64);
    if let Some(l) = link {
        h.set_link_name(l).unwrap();
    }
    h.set_path(path).unwrap();
    h.set_cksum();
    b.append(&h, data).unwrap();
}

impl TestImage {
    /// busybox with its applets, a user `u` (1000:1000) and `user` as the image's user.
    pub fn build(user: &str) -> TestImage {
        let busybox = std::fs::read(BUSYBOX).unwrap();
        let list = Command::new(BUSYBOX).arg("--list").output().unwrap();
        let applets: Vec<String> = String::from_utf8_lossy(&list.stdout)
            .lines()
            .filter(|a| !a.is_empty() && *a != "busybox")
            .map(str::to_string)
            .collect();
        let mut b = tar::Builder::new(Vec::new());
        for d in ["bin/", "etc/", "tmp/", "workspace/", "home/", "home/u/"] {
            let mode = if d == "tmp/" { 0o1777 } else { 0o755 };
            append(&mut b, d, tar::EntryType::Directory, mode, b"", None);
        }
        append(
            &mut b,
            "bin/busybox",
            tar::EntryType::Regular,
            0o755,
            &busybox,
            None,
        );
        for a in &applets {
            append(
                &mut b,
                &format!("bin/{a}"),
                tar::EntryType::Symlink,
                0o777,
                b"",
                Some("busybox"),
            );
        }
        let passwd = b"root:x:0:0:root:/root:/bin/sh\nu:x:1000:1000:u:/home/u:/bin/sh\n";
        let group = b"root:x:0:\nu:x:1000:\n";
        append(
            &mut b,
            "etc/passwd",
            tar::EntryType::Regular,
            0o644,
            passwd,
            None,
        );
        append(
            &mut b,
            "etc/group",
            tar::EntryType::Regular,
            0o644,
            group,
            None,
        );
        let layer = b.into_inner().unwrap();
        let layer_hex = sha256_hex(&layer);
        let config = json!({
            "architecture": if cfg!(target_arch = "aarch64") { "arm64" } else { "amd64" },
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "IMAGE_VAR=from-image"],
                "WorkingDir": "/workspace",
                "User": user,
            },
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_hex}")]},
            "history": [{"created_by": "taskbox docker tests"}],
        });
        let config_bytes = serde_json::to_vec(&config).unwrap();
        let config_hex = sha256_hex(&config_bytes);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": format!("sha256:{config_hex}"), "size": config_bytes.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": format!("sha256:{layer_hex}"), "size": layer.len()}],
        });
        let manifest_hex = sha256_hex(&serde_json::to_vec(&manifest).unwrap());
        let load_manifest = json!([{
            "Config": format!("{config_hex}.json"),
            "RepoTags": [format!("taskbox-test/busybox:{}", &config_hex[..12])],
            "Layers": [format!("{layer_hex}/layer.tar")],
        }]);
        let mut a = tar::Builder::new(Vec::new());
        append(
            &mut a,
            &format!("{config_hex}.json"),
            tar::EntryType::Regular,
            0o644,
            &config_bytes,
            None,
        );
        append(
            &mut a,
            &format!("{layer_hex}/"),
            tar::EntryType::Directory,
            0o755,
            b"",
            None,
        );
        append(
            &mut a,
            &format!("{layer_hex}/layer.tar"),
            tar::EntryType::Regular,
            0o644,
            &layer,
            None,
        );
        append(
            &mut a,
            "manifest.json",
            tar::EntryType::Regular,
            0o644,
            &serde_json::to_vec(&load_manifest).unwrap(),
            None,
        );
        TestImage {
            digest: format!("sha256:{manifest_hex}"),
            config_digest: format!("sha256:{config_hex}"),
            archive: a.into_inner().unwrap(),
            rootfs: PathBuf::new(),
            user: user.to_string(),
            loads: AtomicUsize::new(0),
        }
    }
}

/// A test-only [`ImageResolver`] over a few hand-made images: `busybox` (user 1000:1000),
/// `busybox-1001` (user 1001:1001) and `busybox-load` (user 1002:1002).
pub struct TestImages {
    pub images: BTreeMap<String, TestImage>,
}

impl TestImages {
    pub fn new() -> TestImages {
        let mut images = BTreeMap::new();
        images.insert("busybox".to_string(), TestImage::build("1000:1000"));
        images.insert("busybox-1001".to_string(), TestImage::build("1001:1001"));
        // Only for the test of loading (it removes this image from the daemon first).
        images.insert("busybox-load".to_string(), TestImage::build("1002:1002"));
        TestImages { images }
    }

    pub fn get(&self, name: &str) -> &TestImage {
        &self.images[name]
    }
}

impl ImageResolver for TestImages {
    fn resolve(&self, name_or_digest: &str) -> Result<ImageRoot, ApiError> {
        let img = self
            .images
            .iter()
            .find(|(n, i)| *n == name_or_digest || i.digest == name_or_digest)
            .map(|(_, i)| i)
            .ok_or_else(|| {
                ApiError::not_found(format!("image {name_or_digest} is not built; build it"))
            })?;
        Ok(ImageRoot {
            digest: img.digest.clone(),
            config_digest: img.config_digest.clone(),
            rootfs: img.rootfs.clone(),
            config: ImageConfig {
                env: vec![
                    (
                        "PATH".into(),
                        "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin".into(),
                    ),
                    ("IMAGE_VAR".into(), "from-image".into()),
                ],
                workdir: "/workspace".into(),
                user: Some(img.user.clone()),
                shell: vec!["/bin/sh".into(), "-c".into()],
            },
        })
    }

    fn docker_archive(&self, digest: &str, out: &mut dyn Write) -> Result<(), ApiError> {
        let img = self
            .images
            .values()
            .find(|i| i.digest == digest)
            .ok_or_else(|| ApiError::not_found(format!("image {digest} is not built")))?;
        img.loads.fetch_add(1, Ordering::SeqCst);
        out.write_all(&img.archive)
            .map_err(|e| ApiError::internal(e.to_string()))
    }
}

pub fn images() -> Arc<TestImages> {
    static IMAGES: OnceLock<Arc<TestImages>> = OnceLock::new();
    IMAGES.get_or_init(|| Arc::new(TestImages::new())).clone()
}

/// One test's backend, state directory and workspace.
pub struct Harness {
    pub backend: DockerBackend,
    pub dir: tempfile::TempDir,
    pub images: Arc<TestImages>,
    _lock: TestLock,
}

impl Harness {
    pub fn new() -> Option<Harness> {
        Self::with_config(DockerConfig::default())
    }

    pub fn with_config(config: DockerConfig) -> Option<Harness> {
        if !docker_ready() {
            return None;
        }
        Some(Self::build(config, test_lock(false)))
    }

    /// A harness holding `lock` (the caller checked that Docker is ready).
    pub fn with_lock(lock: TestLock) -> Option<Harness> {
        Some(Self::build(DockerConfig::default(), lock))
    }

    fn build(config: DockerConfig, lock: TestLock) -> Harness {
        let dir = tempfile::Builder::new()
            .prefix("taskbox-docker-test-")
            .tempdir()
            .unwrap();
        for d in ["ws", "state"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let images = images();
        let backend = Docker::open(&dir.path().join("state"), images.clone(), config).unwrap();
        Harness {
            backend,
            dir,
            images,
            _lock: lock,
        }
    }

    pub fn ws(&self) -> PathBuf {
        self.dir.path().join("ws")
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn write(&self, rel: &str, content: &str) {
        let p = self.ws().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    pub fn create_req(&self) -> CreateRequest {
        CreateRequest {
            workspace: self.ws().display().to_string(),
            backend: Some("docker".into()),
            image: Some("busybox".into()),
            ..Default::default()
        }
    }

    pub fn create(&self) -> SandboxId {
        self.backend.create(self.create_req()).unwrap().id
    }

    pub fn sh(&self, id: &SandboxId, script: &str) -> taskbox_core::result::ExecResult {
        self.exec(
            id,
            ExecRequest {
                shell: Some(script.into()),
                ..Default::default()
            },
        )
    }

    pub fn exec(&self, id: &SandboxId, req: ExecRequest) -> taskbox_core::result::ExecResult {
        match self.backend.exec(id, req, None).unwrap() {
            ExecOutcome::Finished(r) => r,
            other => panic!("expected a finished exec, got {other:?}"),
        }
    }

    /// The error an exec that must fail gives.
    pub fn exec_err(&self, id: &SandboxId, req: ExecRequest) -> ApiError {
        self.backend.exec(id, req, None).unwrap_err()
    }

    /// Starts `req` as a background exec.
    pub fn start(&self, id: &SandboxId, req: ExecRequest) -> ProcessInfo {
        let req = ExecRequest {
            background: true,
            ..req
        };
        match self.backend.exec(id, req, None).unwrap() {
            ExecOutcome::Background(p) => p,
            other => panic!("expected a background exec, got {other:?}"),
        }
    }
}

/// `docker inspect NAME`, parsed.
pub fn inspect(name: &str) -> Value {
    let out = Command::new("docker")
        .args(["inspect", name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "docker inspect {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0].clone()
}

/// Names of the containers carrying label `k=v`.
pub fn containers_with_label(k: &str, v: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-a",
            "--filter",
            &format!("label={k}={v}"),
            "--format",
            "{{.Names}}",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// Mount points at or beneath `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.display().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&d))
        .map(str::to_string)
        .collect()
}

pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}
