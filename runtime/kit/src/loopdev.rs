//! Loop devices: the raw ioctls that attach a file to a free loop device (root only).
//!
//! A device is configured with `LO_FLAGS_AUTOCLEAR`: the kernel detaches it when its last user
//! goes (the file system mounted on it, and the descriptor held while mounting), so no device
//! outlives its sandbox, even when taskbox itself is killed; and with `LO_FLAGS_DIRECT_IO` when
//! the backing file system allows it (see [`attach`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>` (`LOOP_CONFIGURE`, Linux 5.8).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device, open. Dropping it closes the descriptor; the device stays attached
/// while a file system is mounted on it.
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
    _dev: File,
}

/// Attaches `backing` to a free loop device, auto-clearing (see the module doc).
pub fn attach(backing: &File) -> io::Result<LoopDevice> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")?;
    // Another process may take the free device between the two calls: try again a few times.
    let mut last = io::Error::other("no free loop device");
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number or -1.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(d) => d,
            Err(e) => {
                last = e;
                continue;
            }
        };
        // Direct I/O first: the device then writes to the image without a second page cache
        // of it (the file system's own is the only one) and without a copy in the loop's
        // worker; a backing file system that cannot (no O_DIRECT, an odd alignment) is
        // attached buffered.
        for flags in [LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, LO_FLAGS_AUTOCLEAR] {
            // SAFETY: LoopConfig is plain old data; all-zero is its documented "no options"
            // value.
            let mut config: LoopConfig = unsafe { std::mem::zeroed() };
            config.fd = backing.as_raw_fd() as u32;
            config.info.lo_flags = flags;
            // SAFETY: `config` is a valid loop_config that lives across the call; the kernel
            // only reads it. `backing` stays open for the duration of the call.
            let rc = unsafe {
                libc::ioctl(
                    dev.as_raw_fd(),
                    LOOP_CONFIGURE,
                    &config as *const LoopConfig,
                )
            };
            if rc == 0 {
                return Ok(LoopDevice { path, _dev: dev });
            }
            last = io::Error::last_os_error();
            if last.raw_os_error() != Some(libc::EINVAL) {
                break;
            }
        }
        if last.raw_os_error() != Some(libc::EBUSY) {
            return Err(last);
        }
    }
    Err(last)
}

/// Detaches the loop device at `path` (for leftovers that are no longer mounted anywhere).
pub fn detach(path: &std::path::Path) -> io::Result<()> {
    let dev = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    // SAFETY: LOOP_CLR_FD takes no argument.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The loop devices attached now, with their backing files as the kernel names them (a
/// deleted file ends in " (deleted)").
pub fn attached() -> Vec<(PathBuf, String)> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            out.push((
                PathBuf::from(format!("/dev/{name}")),
                backing.trim_end().to_string(),
            ));
        }
    }
    out
}
