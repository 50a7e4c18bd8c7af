//! taskbox-docker: the Docker backend. Each sandbox is one hardened container started from the
//! image by digest (loaded through the Engine API when the daemon does not have it; no
//! registry), with the same observations as the native backend.
//!
//! What it owns (see docs/docker.md for the design):
//! - [`DockerBackend`], which implements [`taskbox_core::api::SandboxApi`]: containers with
//!   every capability dropped, no-new-privileges, taskbox's own seccomp profile
//!   ([`seccomp::profile`], rendered from the native filter's rules), a read-only root file
//!   system with a private /tmp, a non-root user, taskbox's init as pid 1, the policy's
//!   pids/memory/cpu limits and no network; labels that let a restarted supervisor reap what a
//!   crashed one left; a warm pool of pre-started containers per (image, policy).
//! - the workspace: the same overlay as native, mounted on the host (idmapped when the
//!   workspace's owner is not the container user) on a shared mount point that the container
//!   holds as a slave, so restore and the pool can (re)mount it under a running container.
//!   File operations, diffs, checkpoints and exports work on the host side.
//! - execs through the Engine API, each under taskbox's wrapper (src/wrap.rs, embedded as a
//!   static binary), which kills the exec's whole process tree when it ends, times out or is
//!   killed, and reports its exact end in a status file.
//!
//! Every daemon call has a timeout; an unreachable or restarting daemon is
//! [`ApiError::Unavailable`](taskbox_core::api::ApiError::Unavailable), and a sandbox whose
//! container is gone is reported "lost".

mod backend;
pub mod daemon;
pub mod hostmount;
mod images;
mod procfs;
mod sandbox;
pub mod seccomp;

pub use backend::{
    DEFAULT_USER, Docker, DockerBackend, DockerConfig, LABEL_IMAGE, LABEL_LEASE, LABEL_OWNER,
    LABEL_POLICY, LABEL_SANDBOX, owner_id,
};
pub use images::{DaemonImages, ensure_image};
pub use sandbox::{INIT_PATH, RUN_MOUNT};

/// The in-container init and exec wrapper (src/wrap.rs), a static executable.
pub static WRAPPER: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/taskbox-wrap"));

/// A static test probe (src/probe.rs) that makes one system call the seccomp profile must
/// refuse; for the escape tests.
#[doc(hidden)]
pub static PROBE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/taskbox-probe"));
