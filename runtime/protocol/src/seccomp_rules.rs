//! The seccomp rules as data: the deny list every sandbox's command gets, and the rules of
//! `--write-through` that refuse setuid and setgid modes. The native helper compiles them into a
//! BPF filter (taskbox-init's `seccomp`), the Docker backend renders the same tables as a Docker
//! seccomp profile, so both backends refuse the same calls. Syscall numbers are the native
//! architecture's (x86_64 or aarch64).

/// Namespace flags refused in `clone`'s flags.
pub const CLONE_NAMESPACE_FLAGS: [libc::c_int; 8] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWCGROUP,
    // In clone(2) this bit lies in the exit-signal byte; no valid signal (at most 64) sets it,
    // so refusing it costs nothing and stays right if the kernel ever accepts it there.
    libc::CLONE_NEWTIME,
];

/// Socket families refused: vsock reaches the hypervisor host, AF_ALG is the kernel crypto API
/// (a repeated source of kernel bugs), AF_PACKET is raw link-layer access.
pub const DENIED_SOCKET_FAMILIES: [libc::c_int; 3] =
    [libc::AF_VSOCK, libc::AF_ALG, libc::AF_PACKET];

/// Terminal ioctls that inject input into or control the terminal of someone else.
pub const DENIED_IOCTLS: [u64; 2] = [libc::TIOCSTI, libc::TIOCLINUX];

/// `personality` values that are allowed: the default, 32-bit uname, the uname-2.6 hack, and the
/// query value (0xffffffff) glibc uses to read the current one. Anything else (e.g. turning off
/// address-space randomisation, READ_IMPLIES_EXEC) is refused.
pub const ALLOWED_PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// The syscall answered `ENOSYS` instead of `EPERM`: its flags live in memory a filter cannot
/// read, and `ENOSYS` makes libc fall back to `clone`, whose flags are checked.
pub const CLONE3: (&str, libc::c_long) = ("clone3", libc::SYS_clone3);

/// The mode bits a write-through command may not set: on the host, a setuid or setgid file
/// runs with its owner's ids.
pub const SETID_MODE_BITS: [u64; 2] = [libc::S_ISUID as u64, libc::S_ISGID as u64];

/// `fchmodat2` (Linux 6.6), the same number on every architecture (the libc crate does not name
/// it on all of them).
pub const SYS_FCHMODAT2: libc::c_long = 452;

/// Calls that give a file a mode, with the index of their mode argument: under
/// [`Rules::refuse_setid_modes`] they fail with `EPERM` when the mode has a bit of
/// [`SETID_MODE_BITS`] (`mkdir` does not keep those bits, but `mkdir -m` is refused alike).
pub const SETID_MODE_CALLS: &[(&str, libc::c_long, u8)] = &[
    ("fchmod", libc::SYS_fchmod, 1),
    ("fchmodat", libc::SYS_fchmodat, 2),
    ("fchmodat2", SYS_FCHMODAT2, 2),
    ("mkdirat", libc::SYS_mkdirat, 2),
    ("mknodat", libc::SYS_mknodat, 2),
    #[cfg(target_arch = "x86_64")]
    ("chmod", libc::SYS_chmod, 1),
    #[cfg(target_arch = "x86_64")]
    ("creat", libc::SYS_creat, 1),
    #[cfg(target_arch = "x86_64")]
    ("mkdir", libc::SYS_mkdir, 1),
    #[cfg(target_arch = "x86_64")]
    ("mknod", libc::SYS_mknod, 1),
];

/// Calls that create a file with a mode when their flags say so: (name, number, index of the
/// flags, index of the mode). Refused like [`SETID_MODE_CALLS`] when the flags have one of
/// [`CREATING_OPEN_FLAGS`] (without them the kernel ignores the mode, which may be garbage).
pub const SETID_OPEN_CALLS: &[(&str, libc::c_long, u8, u8)] = &[
    ("openat", libc::SYS_openat, 2, 3),
    #[cfg(target_arch = "x86_64")]
    ("open", libc::SYS_open, 1, 2),
];

/// The open flags under which the mode is used: `O_CREAT`, and `O_TMPFILE`'s own bit (it also
/// carries `O_DIRECTORY`, which alone creates nothing).
pub const CREATING_OPEN_FLAGS: [u64; 2] = [
    libc::O_CREAT as u64,
    (libc::O_TMPFILE & !libc::O_DIRECTORY) as u64,
];

/// Under [`Rules::refuse_setid_modes`], answered `ENOSYS`: its mode lies in a struct a filter
/// cannot read, and `ENOSYS` makes callers fall back to `openat`, whose mode is checked.
pub const OPENAT2: (&str, libc::c_long) = ("openat2", libc::SYS_openat2);

/// Syscalls refused whatever their arguments, by name (as libseccomp and Docker's seccomp
/// profiles spell them) and native number.
pub const DENIED_SYSCALLS: &[(&str, libc::c_long)] = &[
    // Tracing and reading other processes.
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("process_madvise", libc::SYS_process_madvise),
    // io_uring bypasses syscall filtering for the operations it performs.
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    // Kernel keyrings are not namespaced.
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    // eBPF, perf and userfaultfd: large kernel attack surface, used in exploits.
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    // Namespaces.
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    // Mounts, old and new API, and changing the root.
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    // Kernel code.
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    // File handles open any file of a filesystem, bypassing path checks.
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    // Host administration: accounting, swap, power, clocks, quotas, terminals, kernel log.
    ("acct", libc::SYS_acct),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("adjtimex", libc::SYS_adjtimex),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("vhangup", libc::SYS_vhangup),
    ("syslog", libc::SYS_syslog),
    ("nfsservctl", libc::SYS_nfsservctl),
    ("fanotify_init", libc::SYS_fanotify_init),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
    #[cfg(target_arch = "x86_64")]
    ("uselib", libc::SYS_uselib),
];
