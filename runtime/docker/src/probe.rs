//! A test-only probe, built beside the wrapper: `probe NAME` makes one system call that
//! taskbox's seccomp profile must refuse and prints `ok` (it went through) or `errno N`. Calls
//! through another ABI print nothing: the process is killed. Used by the escape tests, which copy
//! it into a sandbox (busybox has no ptrace, keyctl or io_uring tool).

#![allow(unsafe_code)]

use std::ffi::{c_int, c_long};

unsafe extern "C" {
    fn syscall(nr: c_long, ...) -> c_long;
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(target_arch = "x86_64")]
mod nr {
    pub const PTRACE: i64 = 101;
    pub const MOUNT: i64 = 165;
    pub const UNSHARE: i64 = 272;
    pub const SETNS: i64 = 308;
    pub const KEYCTL: i64 = 250;
    pub const ADD_KEY: i64 = 248;
    pub const BPF: i64 = 321;
    pub const PERF_EVENT_OPEN: i64 = 298;
    pub const USERFAULTFD: i64 = 323;
    pub const IO_URING_SETUP: i64 = 425;
    pub const CLONE: i64 = 56;
    pub const CLONE3: i64 = 435;
    pub const SOCKET: i64 = 41;
    pub const IOCTL: i64 = 16;
    pub const PERSONALITY: i64 = 135;
    pub const PIVOT_ROOT: i64 = 155;
    pub const OPEN_BY_HANDLE_AT: i64 = 304;
    pub const FSOPEN: i64 = 430;
    pub const GETPID: i64 = 39;
}

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let none: c_long = -1;
    // SAFETY: every call passes only integers the kernel validates (invalid descriptors, null
    // pointers it checks); none writes to memory of this process except through the kernel's
    // own checks.
    let rc: c_long = unsafe {
        match name.as_str() {
            "ptrace" => syscall(nr::PTRACE, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long),
            "mount" => syscall(nr::MOUNT, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long),
            "unshare" => syscall(nr::UNSHARE, 0x1000_0000 as c_long),
            "unshare-mount" => syscall(nr::UNSHARE, 0x0002_0000 as c_long),
            "setns" => syscall(nr::SETNS, none, 0 as c_long),
            "keyctl" => syscall(nr::KEYCTL, 0 as c_long, none, 0 as c_long, 0 as c_long, 0 as c_long),
            "add_key" => syscall(nr::ADD_KEY, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long),
            "bpf" => syscall(nr::BPF, none, 0 as c_long, 0 as c_long),
            "perf_event_open" => syscall(nr::PERF_EVENT_OPEN, 0 as c_long, 0 as c_long, none, none, 0 as c_long),
            "userfaultfd" => syscall(nr::USERFAULTFD, 0 as c_long),
            "io_uring_setup" => syscall(nr::IO_URING_SETUP, 1 as c_long, 0 as c_long),
            "clone-newuser" => {
                let rc = syscall(nr::CLONE, (0x1000_0000 | 17) as c_long, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long);
                if rc == 0 {
                    std::process::exit(0);
                }
                rc
            }
            "clone3" => syscall(nr::CLONE3, 0 as c_long, 0 as c_long),
            "socket-vsock" => syscall(nr::SOCKET, 40 as c_long, 1 as c_long, 0 as c_long),
            "socket-alg" => syscall(nr::SOCKET, 38 as c_long, 5 as c_long, 0 as c_long),
            "socket-packet" => syscall(nr::SOCKET, 17 as c_long, 3 as c_long, 0 as c_long),
            "socket-vsock-high-bits" => syscall(nr::SOCKET, 0x1_0000_0028_i64 as c_long, 1 as c_long, 0 as c_long),
            "tiocsti" => syscall(nr::IOCTL, 0 as c_long, 0x5412 as c_long, c"x".as_ptr()),
            "tiocsti-high-bits" => syscall(nr::IOCTL, 0 as c_long, 0xdead_0000_0000_5412_u64 as c_long, c"x".as_ptr()),
            "personality-norandom" => syscall(nr::PERSONALITY, 0x0040000 as c_long),
            "personality-high-bit" => syscall(nr::PERSONALITY, 0x8004_0000_u32 as c_long),
            "personality-query" => syscall(nr::PERSONALITY, 0xffff_ffff_u32 as c_long),
            "personality-linux32" => syscall(nr::PERSONALITY, 8 as c_long),
            "pivot_root" => syscall(nr::PIVOT_ROOT, 0 as c_long, 0 as c_long),
            "open_by_handle_at" => syscall(nr::OPEN_BY_HANDLE_AT, none, 0 as c_long, 0 as c_long),
            "fsopen" => syscall(nr::FSOPEN, 0 as c_long, 0 as c_long),
            "x32" => syscall(nr::GETPID | 0x4000_0000, 0 as c_long),
            "i386" => i386_getpid(),
            "getpid" => syscall(nr::GETPID, 0 as c_long),
            _ => {
                eprintln!("probe: unknown call {name:?}");
                std::process::exit(2);
            }
        }
    };
    if rc == -1 {
        println!("errno {}", errno());
    } else {
        println!("ok");
    }
}

/// getpid through the i386 `int 0x80` entry.
fn i386_getpid() -> c_long {
    let ret: c_int;
    // SAFETY: eax=20 is i386 getpid, which touches no memory; the 64-bit kernel saves and
    // restores the other registers.
    unsafe {
        std::arch::asm!("int 0x80", inlateout("eax") 20 => ret, options(nostack));
    }
    if ret < 0 { -1 } else { c_long::from(ret) }
}
