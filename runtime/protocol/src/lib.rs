//! The wire between the runtime and its sandbox helper, `taskbox-init`, and nothing else:
//!
//! - [`config`]: the helper's plan (`InitConfig` and its parts: mounts, root, disk, egress,
//!   Landlock paths, limits), the status lines it writes on [`config::STATUS_FD`], and the
//!   descriptor numbers both sides agree on;
//! - [`control`]: the control protocol of a long-lived sandbox's pid 1 (requests, events, and
//!   descriptor passing over a `SOCK_SEQPACKET` socket, with a sealed memfd for large messages);
//! - [`seccomp_rules`]: the seccomp rules as data, which the helper compiles and the Docker
//!   backend renders as a profile.
//!
//! It links no Landlock or seccomp library: the runtime and the backends depend on this crate,
//! only the helper on those.

pub mod config;
pub mod control;
pub mod seccomp_rules;
