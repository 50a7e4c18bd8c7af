//! The plan the runtime hands to the helper: everything the helper needs, decided in advance.
//!
//! The runtime (which knows the policy, the workspace and the host) computes a complete, ordered
//! plan; the helper only carries it out. Keeping the decisions out of the helper keeps the code that
//! runs between `unshare` and `exec` small and free of policy logic.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The whole plan for one sandboxed command.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitConfig {
    /// The command and its arguments; `argv[0]` is looked up in `PATH` of `env`.
    pub argv: Vec<String>,
    /// Working directory inside the sandbox (an absolute path).
    pub cwd: PathBuf,
    /// The complete environment of the command (nothing else is inherited).
    pub env: Vec<(String, String)>,
    /// Create a user namespace (needed when not root). Only the caller's uid and gid are mapped:
    /// to themselves, or to `inner_uid` and `inner_gid`.
    pub user_namespace: bool,
    /// Host uid and gid of the caller (for the user namespace maps).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// The uid the caller's uid appears as inside the user namespace (an image's user); `None`:
    /// the caller's own.
    #[serde(default)]
    pub inner_uid: Option<u32>,
    /// As `inner_uid`, for the gid.
    #[serde(default)]
    pub inner_gid: Option<u32>,
    /// Give the sandbox its own network namespace with only loopback.
    pub isolate_network: bool,
    /// Host name inside the sandbox's UTS namespace.
    pub hostname: String,
    /// An empty directory owned by the run, used as the mount point of the new root.
    pub new_root: PathBuf,
    /// What is mounted on `new_root` before the ops: the host's tree or an image's layers.
    #[serde(default)]
    pub root: RootPlan,
    /// Mount operations on the new root, in order. Destinations are paths inside the sandbox.
    pub mounts: Vec<MountOp>,
    /// Landlock rules for the command.
    pub landlock: LandlockPlan,
    /// Install the seccomp filter.
    pub seccomp: bool,
    /// Refuse setuid and setgid modes (seccomp, also when `seccomp` is off): the workspace is
    /// the host's own directory (`--write-through`), where such a file would keep its bits.
    #[serde(default)]
    pub refuse_setid_modes: bool,
    /// Resource limits applied with setrlimit just before exec.
    pub rlimits: Vec<Rlimit>,
    /// `cgroup.procs` files the helper joins before it creates any namespace.
    pub cgroup_procs: Vec<PathBuf>,
    /// Long-lived: instead of running `argv`, the sandbox's pid 1 serves requests on the control
    /// socket ([`crate::control::CONTROL_FD`]) until it closes.
    #[serde(default)]
    pub control: bool,
    /// Network mode "proxy": the egress proxy's listener, made by pid 1 in the sandbox's network
    /// namespace and handed to the runtime on [`EGRESS_FD`] before any command runs.
    #[serde(default)]
    pub egress: Option<EgressPlan>,
    /// The sandbox's disk quota: the helper mounts it in the sandbox's mount namespace before
    /// anything else and hands the runtime a descriptor of its root on [`DISK_FD`].
    #[serde(default)]
    pub disk: Option<DiskPlan>,
    /// Run by root: the commands' own user namespace, which maps the sandbox's ids onto an
    /// unprivileged range of the host's (see [`IdRange`]); `user_namespace` is then false (pid 1
    /// and the mount tree stay the host root's), and `inner_uid`/`inner_gid` are the commands'
    /// default ids inside it (0 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_range: Option<IdRange>,
    /// Capabilities (numbers) a command running as uid 0 of the sandbox keeps, as ambient
    /// capabilities, within a user namespace of the sandbox's own (never given otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub root_capabilities: Vec<u32>,
}

/// The ids of a sandbox of a root-run taskbox: ids `0..size` inside are host ids
/// `base..base + size`, which no host account has. The commands enter a user namespace with
/// this map (every command of the sandbox is an unprivileged host id, root inside included),
/// and the layers they see are idmapped mounts with the same map (an image's root-owned files
/// are root's inside) or with a map of the workspace owner onto the sandbox's user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdRange {
    pub base: u32,
    pub size: u32,
}

impl IdRange {
    /// The host id of `inside` (an id of the sandbox), if the range maps it.
    pub fn host(&self, inside: u32) -> Option<u32> {
        (inside < self.size).then(|| self.base + inside)
    }
}

/// An id mapping of one mount: files of host `uid`/`gid` appear as host ids `as_uid`/`as_gid`
/// (and what those create is stored as `uid`/`gid`); other owners appear as the overflow id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerMap {
    pub uid: u32,
    pub gid: u32,
    pub as_uid: u32,
    pub as_gid: u32,
}

/// The options a disk's ext4 is mounted with (with `nosuid`, `nodev`, `noatime`): no zeroing of
/// inode tables and no reading of block bitmaps ahead in the background (a fresh sandbox's inode
/// tables are never read, and its allocator reads the bitmaps it needs; the background work
/// would only compete with the sandbox's start), and no cache flushes (`nobarrier`). A flush
/// makes written blocks survive a power loss; the disk's image is unlinked from the start and
/// the disk ends with its sandbox, so nothing on it can outlive a crash of the host whatever is
/// flushed. Without it, every `fsync` in the sandbox, and the unmount at every destroy, became an
/// `fsync` of the image file on the host: a flush of the host's disk.
pub const EXT4_MOUNT_OPTIONS: &str = "noinit_itable,no_prefetch_block_bitmaps,nobarrier";

/// The size-limited file system that holds everything the sandbox may write (its workspace's
/// upper layer, its scratch directories): a tmpfs, or an ext4 on a loop device; mounted by the
/// helper on `dir` (a host path, seen in the sandbox's mount namespace only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskPlan {
    pub dir: PathBuf,
    pub size_bytes: u64,
    /// Directories made on it (name, mode), before anything is mounted from them.
    pub subdirs: Vec<(String, u32)>,
    /// Owners (host uid, gid) given to some of them once made (by name): with an [`IdRange`],
    /// the workspace's upper layer belongs to the sandbox's user, so that it owns the
    /// workspace's root inside as it owns its lower layer's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owners: Vec<(String, u32, u32)>,
    /// A loop device holding an ext4 of `size_bytes` (made by the runtime, as root), mounted
    /// instead of a tmpfs. The helper mounts it before it enters a user namespace, in a mount
    /// namespace of its own.
    #[serde(default)]
    pub device: Option<PathBuf>,
    /// Once the disk's root is sent, wait for the runtime's word ([`DiskGo`]) on `DISK_FD`
    /// before anything is mounted from it: the runtime puts a fork's layers on it meanwhile
    /// (the parent's upper layer and `/tmp`), so the overlay is mounted on them, never changed
    /// under a mounted overlay.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hold: bool,
}

/// The runtime's word to a helper whose [`DiskPlan::hold`] is set: the disk is ready (`ok`), or
/// it could not be filled and the sandbox is not to be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskGo {
    pub ok: bool,
}

/// The egress proxy's way into the sandbox: a TCP listener on `127.0.0.1:port` inside the
/// sandbox's network namespace, bound by pid 1 before any command runs (a command may not bind:
/// Landlock refuses it) and sent to the runtime as `SCM_RIGHTS` on [`EGRESS_FD`] with this plan
/// as the message. The runtime's proxy accepts on it; pid 1 keeps no copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressPlan {
    pub port: u16,
}

/// The sandbox's root filesystem, mounted on the new root before the [`MountOp`]s run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RootPlan {
    /// The host's `/`, bound recursively and made read-only.
    #[default]
    Host,
    /// An overlay of host directories (`lower`, topmost first; e.g. the mount-point scaffold
    /// above an image's rootfs). Read-only without `upper`; with `upper` and `work` (on one
    /// filesystem) writes land in `upper`, a normal overlay upper layer.
    Layers {
        lower: Vec<PathBuf>,
        upper: Option<PathBuf>,
        work: Option<PathBuf>,
    },
}

/// One mount operation. `dst` is always a path inside the sandbox (absolute).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum MountOp {
    /// A fresh tmpfs.
    Tmpfs {
        dst: PathBuf,
        mode: u32,
        size_bytes: Option<u64>,
    },
    /// A recursive bind mount of a host path (`src` is a host path).
    Bind {
        src: PathBuf,
        dst: PathBuf,
        readonly: bool,
    },
    /// A recursive bind of host directory `src` whose owner is shifted (an idmapped mount):
    /// files of host `uid` and `gid` appear as owned by 0:0, and what 0:0 creates in it is
    /// stored as `uid`:`gid`; `nosuid` and `nodev`. For `--write-through` when the caller is
    /// root and `src` belongs to someone else. The helper makes it before any user namespace
    /// (only the host's root may map a mount); pid 1 attaches it.
    BindOwned {
        src: PathBuf,
        dst: PathBuf,
        uid: u32,
        gid: u32,
        /// The host ids `uid`:`gid` appear as (0:0 unless set: a root-run sandbox's commands
        /// are ids of a range of their own, see [`IdRange`]).
        #[serde(default)]
        as_uid: u32,
        #[serde(default)]
        as_gid: u32,
    },
    /// A bind of a path that is already in the sandbox's tree onto itself, made read-only.
    /// Skipped when the path does not exist.
    ProtectReadOnly { dst: PathBuf },
    /// Hide a path: a directory gets an empty read-only tmpfs, anything else the (empty,
    /// read-only) host file `empty`. Skipped when the path does not exist in the sandbox.
    Mask { dst: PathBuf, empty: PathBuf },
    /// An overlay of `lower` (a host path) with the run's `upper` and `work` directories.
    /// With `lower_map`, the lower layer is an idmapped mount of `lower` (made by the helper
    /// before any namespace, as [`MountOp::BindOwned`]; pid 1 stacks it on `lower` in its own
    /// mount namespace, so every later use of the path, a restore's remount too, sees it).
    Overlay {
        lower: PathBuf,
        upper: PathBuf,
        work: PathBuf,
        dst: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lower_map: Option<OwnerMap>,
    },
    /// A fresh procfs of the sandbox's pid namespace.
    Proc { dst: PathBuf },
    /// A private devpts instance.
    Devpts { dst: PathBuf },
    /// Create a directory (on a tmpfs made by an earlier op).
    Dir { dst: PathBuf, mode: u32 },
    /// Create an empty regular file (a mount point for a file bind).
    File { dst: PathBuf },
    /// Create a symbolic link `dst -> target`.
    Symlink { target: PathBuf, dst: PathBuf },
    /// Make an existing mount read-only (after it was populated); mounts beneath it keep their
    /// own flags.
    RemountReadOnly { dst: PathBuf },
}

/// What the command may touch, enforced by Landlock.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LandlockPlan {
    /// Apply Landlock at all.
    pub enabled: bool,
    /// Fail (before running the command) unless every requested right is enforced.
    pub required: bool,
    /// Paths readable (and executable) beneath.
    pub read: Vec<PathBuf>,
    /// Paths fully writable beneath.
    pub write: Vec<PathBuf>,
    /// Refuse TCP bind and connect (ABI 4 and later).
    pub deny_tcp: bool,
    /// With `deny_tcp`: TCP ports the command may still connect to (the egress proxy's). Landlock
    /// rules are per port, on every address; only pid 1's listener serves the port.
    #[serde(default)]
    pub connect_tcp: Vec<u16>,
}

/// One setrlimit call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rlimit {
    pub resource: RlimitResource,
    pub limit: u64,
}

/// The resources taskbox limits with rlimits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RlimitResource {
    /// Address space (RLIMIT_AS): the memory fallback when no cgroup can be used.
    AddressSpace,
    /// Processes of the user (RLIMIT_NPROC): the pids fallback.
    Processes,
    /// CPU seconds (RLIMIT_CPU).
    CpuSeconds,
    /// Largest file the command may write (RLIMIT_FSIZE).
    FileSize,
    /// Open files (RLIMIT_NOFILE).
    OpenFiles,
    /// Core dump size (RLIMIT_CORE).
    CoreSize,
}

/// A message from the helper to the runtime, one JSON object per line on the status pipe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Status {
    /// The sandbox's pid 1 started; `pid` is its pid in the caller's pid namespace.
    Started { pid: i32 },
    /// Landlock outcome: "full", "partial" or "none".
    Landlock { status: String },
    /// The seccomp filter is installed.
    Seccomp { installed: bool },
    /// The command could not be executed (`errno` from execve).
    ExecFailed { errno: i32, program: String },
    /// Setting up the sandbox failed; nothing was run.
    SetupFailed { stage: String, message: String },
    /// The command ended.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
        /// CPU time of the command and the descendants it waited for, in milliseconds.
        #[serde(default)]
        cpu_ms: u64,
        /// Peak resident memory of the largest of them, in bytes.
        #[serde(default)]
        max_rss_bytes: u64,
        /// A process of the command was killed for writing past the file size limit
        /// (SIGXFSZ), or the command reported that a child was (exit status 128 + SIGXFSZ).
        #[serde(default)]
        file_size_exceeded: bool,
        /// Calls that would have given a file a setuid or setgid mode, refused
        /// (`--write-through`), and the names of those calls.
        #[serde(default)]
        setid_refused: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        setid_calls: Vec<String>,
    },
}

/// The file descriptor on which the helper writes [`Status`] lines.
pub const STATUS_FD: i32 = 3;

/// The descriptor of the socket (a `SOCK_SEQPACKET` pair with the runtime) on which pid 1 sends
/// the egress listener ([`EgressPlan`]); only given with `egress` set.
pub const EGRESS_FD: i32 = 5;

/// The descriptor of the socket (a `SOCK_SEQPACKET` pair with the runtime) on which the helper
/// sends a descriptor of its tmpfs disk's root ([`DiskPlan`]); only given with `disk` set.
pub const DISK_FD: i32 = 6;

/// The descriptor from which the helper reads its plan (an [`InitConfig`] in JSON) when it is
/// started as `taskbox-init -`: a memfd the runtime wrote, so no plan file is made and removed
/// per sandbox. The helper closes it once read.
pub const PLAN_FD: i32 = 8;

/// The descriptor of the commands' user namespace ([`IdRange`]): made by the helper, kept by
/// pid 1 for the exec starters, which enter it; no command holds it.
pub const USERNS_FD: i32 = 7;

/// The argument that starts `taskbox-init` as the fork server of a supervisor's helpers (see
/// the helper's `zygote` module): `taskbox-init --zygote NAME`, its requests on [`ZYGOTE_FD`].
/// `NAME` (the backend's state directory, padded with spaces) is a label for `ps` and room: a
/// helper it forks writes its own label (`- ID`) over it, so that `ps` tells the sandboxes'
/// processes apart as it does for an exec'd helper.
pub const ZYGOTE_ARG: &str = "--zygote";

/// The descriptor of the zygote's socket (a `SOCK_SEQPACKET` pair with the supervisor).
pub const ZYGOTE_FD: i32 = 3;

/// A request to the zygote: fork a helper that reads its plan from [`PLAN_FD`]. The request's
/// descriptors go on `targets`, in order (one number each; 0 to 2 not named stay the zygote's,
/// whose stdin and stdout are `/dev/null`); the helper keeps no other descriptor. `label` is its
/// `NAME` for `ps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZygoteRequest {
    pub label: String,
    pub targets: Vec<i32>,
}

/// The zygote's answer to a [`ZygoteRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum ZygoteReply {
    /// The zygote's first message: it is ready for requests (a helper binary that cannot be a
    /// zygote never says so).
    Ready,
    /// The helper runs; the supervisor is its parent.
    Forked { pid: i32 },
    /// Nothing was started.
    Failed { error: String },
}
