//! A sandbox's disk quota (`limits.disk`): one size-limited file system that holds everything
//! the sandbox can write, so the kernel answers `ENOSPC` when it is full and the host loses at
//! most its size.
//!
//! It holds the workspace overlay's upper and work directories, the directories bound on
//! `/tmp`, `/var/tmp`, `/dev/shm`, `/run` and the private home, and (long-lived sandboxes) the
//! spill files of execs and a writable root's upper layer (`filesystem.root`) ([`SUBDIRS`]).
//! Two kinds:
//!
//! - **`loop-ext4`** (taskbox runs as root and the kernel has loop devices): a sparse image file
//!   of exactly the quota's size, copied from a template made once per size with `mkfs.ext4`
//!   (a copy of its few allocated blocks takes well under a millisecond, `mkfs` tens), attached
//!   to an auto-clearing loop device and deleted at once, so only the device holds it.
//! - **`tmpfs`** (rootless, or when the loop path fails): a tmpfs with `size=`, which an
//!   unprivileged user namespace may mount. It lives in memory (and swap), and its pages count
//!   against the sandbox's memory cgroup when there is one.
//!
//! Either way the native backend's helper mounts it in the sandbox's own mount namespace, never
//! on the host, and hands back a descriptor of its root: the supervisor reaches the layers as
//! `/proc/self/fd/N/...` through it. When the sandbox's namespace is gone and the descriptor is
//! closed (destroy, a failed create, the supervisor's death), the kernel frees the file system,
//! the loop device detaches itself and the deleted image's blocks return to the host: nothing is
//! left to sweep. The Docker backend mounts the same `loop-ext4` on the host instead
//! ([`Disk::mount_on_host`]), because its overlays are mounted there.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use taskbox_protocol::config::DiskPlan;

use crate::loopdev::{self, LoopDevice};

/// The directories of a disk (name, mode): what each holds is in the module doc.
pub const SUBDIRS: &[(&str, u32)] = &[
    ("upper", 0o755),
    ("work", 0o755),
    ("tmp", 0o1777),
    ("var-tmp", 0o1777),
    ("shm", 0o1777),
    ("run", 0o755),
    ("home", 0o755),
    ("out", 0o755),
    ("root-upper", 0o755),
    ("root-work", 0o755),
];

/// Mount points every sandbox makes in its disk's `tmp` (the spill files' mount,
/// [`crate::SPILL_MOUNT`]), made in the ext4 template with its [`SUBDIRS`]: a directory made
/// at start on a fresh disk allocates a block and reads its group's bitmaps through the loop
/// device, in every create.
const TEMPLATE_MOUNT_POINTS: &[(&str, u32)] =
    &[("tmp/.taskbox", 0o755), ("tmp/.taskbox/out", 0o755)];

/// The directories of an ext4 template: [`SUBDIRS`], then [`TEMPLATE_MOUNT_POINTS`].
fn template_dirs() -> impl Iterator<Item = &'static (&'static str, u32)> {
    SUBDIRS.iter().chain(TEMPLATE_MOUNT_POINTS)
}

/// A disk that could not be made.
#[derive(Debug, thiserror::Error)]
#[error("disk quota in {path}: {why}")]
pub struct DiskError {
    path: String,
    why: String,
}

fn derr(path: &Path, why: impl std::fmt::Display) -> DiskError {
    DiskError {
        path: path.display().to_string(),
        why: why.to_string(),
    }
}

/// Which file system bounds the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskKind {
    LoopExt4,
    Tmpfs,
}

impl DiskKind {
    /// The name `enforcement.disk` reports.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskKind::LoopExt4 => "loop-ext4",
            DiskKind::Tmpfs => "tmpfs",
        }
    }
}

/// One sandbox's disk.
#[derive(Debug)]
pub struct Disk {
    kind: DiskKind,
    size: u64,
    /// Where the helper mounts it (a host path, seen only in the sandbox's mount namespace), or
    /// (Docker) where it is mounted on the host.
    planned: PathBuf,
    /// How this process reaches its root: `/proc/self/fd/N` of `root`, or `planned` on the host.
    reach: PathBuf,
    /// The root, received from the helper.
    root: Option<OwnedFd>,
    /// Held until the helper has mounted the device (auto-clear would detach it otherwise).
    device: Option<LoopDevice>,
    /// The loop device being made on a thread of its own ([`Disk::prepare`]): attaching one
    /// waits for the block layer (about a millisecond), which the rest of the sandbox's set-up
    /// need not wait for. Taken by [`Disk::plan`].
    attaching: Option<std::thread::JoinHandle<Result<LoopDevice, DiskError>>>,
    mounted_on_host: bool,
}

impl Disk {
    /// A disk of `size` bytes for the sandbox whose directory is `dir`, to be mounted by the
    /// helper at `planned` ([`Disk::plan`], then [`Disk::receive`]): `loop-ext4` as root
    /// when it can be made, else `tmpfs`. `templates` is where ext4 templates are kept. The
    /// mount point is only a name in the sandbox's own mount namespace, so sandboxes may share
    /// one (it is made when missing).
    pub fn prepare(
        dir: &Path,
        planned: PathBuf,
        size: u64,
        templates: &Path,
    ) -> Result<Disk, DiskError> {
        fs::create_dir_all(&planned).map_err(|e| derr(&planned, e))?;
        let mut disk = Disk {
            kind: DiskKind::Tmpfs,
            size,
            reach: planned.clone(),
            planned,
            root: None,
            device: None,
            attaching: None,
            mounted_on_host: false,
        };
        // `TASKBOX_DISK=tmpfs` asks for the in-memory kind as root too (faster to set up, but
        // the quota's files then take memory).
        let tmpfs_asked = std::env::var_os("TASKBOX_DISK").is_some_and(|v| v == "tmpfs");
        if nix::unistd::geteuid().is_root() && !tmpfs_asked {
            let (dir, templates) = (dir.to_path_buf(), templates.to_path_buf());
            let spawned = std::thread::Builder::new()
                .name("taskbox-disk".into())
                .spawn(move || loop_image(&dir, size, &templates));
            match spawned {
                Ok(handle) => disk.attaching = Some(handle),
                Err(e) => tracing::debug!(error = %e, "no thread for the disk; using a tmpfs"),
            }
        }
        Ok(disk)
    }

    /// Waits for the loop device being attached, if any: the disk is `loop-ext4` when it came,
    /// a tmpfs when it failed.
    fn settle(&mut self) {
        let Some(handle) = self.attaching.take() else {
            return;
        };
        match handle.join() {
            Ok(Ok(device)) => {
                self.kind = DiskKind::LoopExt4;
                self.device = Some(device);
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "no loop-backed disk; using a tmpfs"),
            Err(_) => tracing::debug!("the disk's thread panicked; using a tmpfs"),
        }
    }

    /// The Docker backend's disk: a `loop-ext4` mounted on the host at `dir/disk`, with its
    /// directories made; unmounted on drop.
    pub fn mount_on_host(dir: &Path, size: u64, templates: &Path) -> Result<Disk, DiskError> {
        let planned = dir.join("disk");
        fs::create_dir_all(&planned).map_err(|e| derr(&planned, e))?;
        let device = loop_image(dir, size, templates)?;
        mount_ext4(&device.path, &planned).map_err(|e| derr(&planned, e))?;
        let disk = Disk {
            kind: DiskKind::LoopExt4,
            size,
            reach: planned.clone(),
            planned,
            root: None,
            device: None,
            attaching: None,
            mounted_on_host: true,
        };
        drop(device);
        // The template holds them; each is checked, and made if missing.
        make_dirs(&disk.planned, SUBDIRS)?;
        Ok(disk)
    }

    /// What the helper must do to mount it (once the loop device, if any, is attached).
    pub fn plan(&mut self) -> DiskPlan {
        self.settle();
        DiskPlan {
            dir: self.planned.clone(),
            size_bytes: self.size,
            subdirs: SUBDIRS
                .iter()
                .map(|(name, mode)| (name.to_string(), *mode))
                .collect(),
            device: self.device.as_ref().map(|d| d.path.clone()),
            owners: Vec::new(),
            hold: false,
        }
    }

    /// Takes the descriptor of the disk's root that the helper sends on `sock` once it has
    /// mounted it, waiting at most `timeout`. Fails when the helper ended without sending it
    /// (its status pipe then says why).
    pub fn receive(&mut self, sock: &OwnedFd, timeout: Duration) -> Result<(), String> {
        use taskbox_protocol::control::{Received, recv_within};
        let mut buf = Vec::new();
        let mut fds = match recv_within::<u64>(sock.as_fd(), &mut buf, timeout)
            .map_err(|e| format!("cannot receive the disk: {e}"))?
        {
            Received::Message(_, fds) => fds,
            Received::Nothing => return Err("the sandbox did not mount its disk in time".into()),
            Received::Closed => return Err("the sandbox ended before it mounted its disk".into()),
        };
        let Some(root) = fds.pop() else {
            return Err("the sandbox sent no descriptor of its disk".into());
        };
        self.reach = PathBuf::from(format!("/proc/self/fd/{}", root.as_raw_fd()));
        self.root = Some(root);
        // The mount holds the device now.
        self.device = None;
        Ok(())
    }

    /// Tells a helper that holds (`DiskPlan::hold`) that the disk is filled (`ok`), or that it
    /// could not be and the sandbox is not to be built.
    pub fn release(sock: &OwnedFd, ok: bool) -> Result<(), String> {
        taskbox_protocol::control::send(sock.as_fd(), &taskbox_protocol::config::DiskGo { ok }, &[])
            .map_err(|e| format!("cannot tell the sandbox its disk is ready: {e}"))
    }

    pub fn kind(&self) -> DiskKind {
        self.kind
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The disk's root as this process reaches it.
    pub fn path(&self) -> &Path {
        &self.reach
    }

    /// The disk's root as the helper sees it (a host path in the sandbox's mount namespace).
    pub fn planned(&self) -> &Path {
        &self.planned
    }

    /// Bytes still free for the sandbox, when the file system answers.
    pub fn available(&self) -> Option<u64> {
        // On the descriptor when there is one: a path through /proc/self/fd is a look-up of
        // three names on every exec's way (is_full).
        let st = match &self.root {
            Some(fd) => nix::sys::statvfs::fstatvfs(fd),
            None => nix::sys::statvfs::statvfs(&self.reach),
        }
        .ok()?;
        Some(st.blocks_available().saturating_mul(st.fragment_size()))
    }

    /// The disk is full: writes fail with `ENOSPC`. "Full" leaves some slack (1/32 of the size,
    /// at least 2 MiB, at most 16 MiB): ext4 refuses a write some way before its free count
    /// reaches zero (2/3 MiB of a 64 MiB disk stayed "available" after `ENOSPC`, measured).
    pub fn is_full(&self) -> bool {
        self.available()
            .is_some_and(|free| free <= full_slack(self.size))
    }

    /// Leaves a host mount ([`Disk::mount_on_host`]) in place past this value: its owner
    /// unmounts it with the rest of the sandbox's mounts.
    pub fn keep_mounted(mut self) {
        self.mounted_on_host = false;
    }
}

/// [`Disk::is_full`] for the disk of `size` bytes mounted at `path`.
pub fn is_full_at(path: &Path, size: u64) -> bool {
    nix::sys::statvfs::statvfs(path)
        .ok()
        .map(|st| st.blocks_available().saturating_mul(st.fragment_size()))
        .is_some_and(|free| free <= full_slack(size))
}

/// The free bytes under which a disk of `size` counts as full (see [`Disk::is_full`]).
fn full_slack(size: u64) -> u64 {
    (size / 32).clamp(2 << 20, 16 << 20)
}

impl Drop for Disk {
    fn drop(&mut self) {
        // A device still being attached is waited for (and then let go), so nothing of it
        // is written in a directory that is being removed.
        if let Some(handle) = self.attaching.take() {
            let _ = handle.join();
        }
        if self.mounted_on_host {
            // Detached: a process that still has a file open there cannot keep the mount.
            let _ = nix::mount::umount2(&self.planned, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Makes the sandbox's image `dir/disk.img` (a copy of the template for `size`), attaches it to
/// a loop device and deletes it: from then on only the device holds its blocks.
fn loop_image(dir: &Path, size: u64, templates: &Path) -> Result<LoopDevice, DiskError> {
    let template = template(size, templates)?;
    let image = dir.join("disk.img");
    let made = (|| -> io::Result<LoopDevice> {
        let out = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_CLOEXEC)
            .mode(0o600)
            .open(&image)?;
        copy_sparse(&template, &out, size)?;
        loopdev::attach(&out)
    })();
    let _ = fs::remove_file(&image);
    made.map_err(|e| derr(&image, e))
}

/// The ext4 template for `size` (made once with `mkfs.ext4` and kept in `templates`), with the
/// [`SUBDIRS`] already in it: made at run time, each top-level directory would land in a block
/// group of its own (ext4 spreads them) and cost reads of that group's bitmaps through the loop
/// device, about a millisecond in all. The name carries the layout, so a template of another
/// layout is never taken.
fn template(size: u64, templates: &Path) -> Result<File, DiskError> {
    let path = templates.join(format!("ext4-{size}-{}.img", layout_tag()));
    if let Ok(f) = File::open(&path)
        && f.metadata().is_ok_and(|m| m.len() == size)
    {
        return Ok(f);
    }
    crate::hostdirs::private_dir(templates).map_err(|e| derr(templates, e))?;
    // A name of this call's own: threads of one process may make the same template at once
    // (each gets a whole file system; the last rename wins, and every copy is a valid one).
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = templates.join(format!(".ext4-{size}.{}.{n}.tmp", std::process::id()));
    let tree = tmp.with_extension("d");
    let made = (|| -> Result<(), String> {
        let f = File::create(&tmp).map_err(|e| e.to_string())?;
        f.set_len(size).map_err(|e| e.to_string())?;
        drop(f);
        fs::create_dir(&tree).map_err(|e| e.to_string())?;
        make_dirs(&tree, template_dirs()).map_err(|e| e.to_string())?;
        let mkfs = find_mkfs().ok_or("mkfs.ext4 is not installed")?;
        // No journal (a sandbox's scratch never outlives a crash), no room to grow, no reserve
        // for root, inode tables left to initialise lazily (and `noinit_itable` at mount: never),
        // no discard of the (sparse) image.
        let out = Command::new(mkfs)
            .args([
                "-q",
                "-F",
                "-m",
                "0",
                "-O",
                "^has_journal,^resize_inode",
                "-E",
                "lazy_itable_init=1,nodiscard,root_owner=0:0",
                "-d",
            ])
            .arg(&tree)
            .arg(&tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("cannot run mkfs.ext4: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mkfs.ext4 failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        fs::rename(&tmp, &path).map_err(|e| e.to_string())
    })();
    let _ = fs::remove_dir_all(&tree);
    if let Err(why) = made {
        let _ = fs::remove_file(&tmp);
        return Err(derr(&path, why));
    }
    File::open(&path).map_err(|e| derr(&path, e))
}

/// Makes each of `dirs` (name, mode; parents first) under `root`, keeping one that is there.
fn make_dirs<'a>(
    root: &Path,
    dirs: impl IntoIterator<Item = &'a (&'a str, u32)>,
) -> Result<(), DiskError> {
    for (name, mode) in dirs {
        let d = root.join(name);
        match fs::create_dir(&d) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            other => other.map_err(|e| derr(&d, e))?,
        }
        fs::set_permissions(&d, fs::Permissions::from_mode(*mode)).map_err(|e| derr(&d, e))?;
    }
    Ok(())
}

/// A short digest of the template's directories, names and modes (computed once).
fn layout_tag() -> &'static str {
    static TAG: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for (name, mode) in template_dirs() {
            h.update(format!("{name}:{mode:o};"));
        }
        h.finalize()[..4]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    });
    &TAG
}

fn find_mkfs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

/// Copies the allocated parts of `from` into `to` (which gets length `len`): holes stay holes.
fn copy_sparse(from: &File, to: &File, len: u64) -> io::Result<()> {
    to.set_len(len)?;
    let (fd_in, fd_out) = (from.as_raw_fd(), to.as_raw_fd());
    let mut pos: i64 = 0;
    let end = len as i64;
    while pos < end {
        // SAFETY: lseek on a descriptor this function borrows; no memory is involved.
        let data = unsafe { libc::lseek(fd_in, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd_in, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            // SAFETY: both offsets are valid for writes and outlive the call; the descriptors
            // are open.
            let n = unsafe {
                libc::copy_file_range(
                    fd_in,
                    &mut off_in,
                    fd_out,
                    &mut off_out,
                    (hole - off_in) as usize,
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                break;
            }
        }
        pos = hole;
    }
    Ok(())
}

/// Mounts the ext4 on `device` at `target`, without set-uid, devices or atime updates, and with
/// [`taskbox_protocol::config::EXT4_MOUNT_OPTIONS`].
pub(crate) fn mount_ext4(device: &Path, target: &Path) -> io::Result<()> {
    use nix::mount::{MsFlags, mount};
    mount(
        Some(device),
        target,
        Some("ext4"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        Some(taskbox_protocol::config::EXT4_MOUNT_OPTIONS),
    )
    .map_err(io::Error::from)
}

/// Loop devices whose (deleted) image was under `dir`: what a crash left attached. Each is
/// detached when it is mounted nowhere.
pub fn detach_leftover_loops(dir: &Path) {
    let prefix = dir.display().to_string();
    for (dev, backing) in loopdev::attached() {
        if backing.starts_with(&prefix) && loopdev::detach(&dev).is_ok() {
            tracing::info!(device = %dev.display(), "detached a leftover loop device");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let f = File::create(&a).unwrap();
        f.set_len(8 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(b"tail", (8 << 20) - 4).unwrap();
        let from = File::open(&a).unwrap();
        let to = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&b)
            .unwrap();
        copy_sparse(&from, &to, 8 << 20).unwrap();
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        use std::os::unix::fs::MetadataExt;
        assert!(fs::metadata(&b).unwrap().blocks() * 512 < 1 << 20);
    }
}
