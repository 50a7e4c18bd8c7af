//! Landlock rules for the command: what it may read, what it may write, and what it may reach.
//!
//! The command may read and execute beneath the plan's read paths, do anything beneath its write
//! paths, and nothing else on the filesystem. With `deny_tcp` it may neither bind nor connect TCP
//! ports, except connect to the plan's `connect_tcp` ports (the egress proxy's listener). Scopes (when the kernel has them) keep it from signalling processes outside its Landlock
//! domain and from connecting to abstract Unix sockets created outside it.
//!
//! The rights requested are those of [`TARGET_ABI`], applied best-effort: on an older kernel the
//! rights it lacks are dropped and the outcome says so ([`LandlockOutcome::Partial`]); a plan that
//! requires Landlock then fails with an error naming what is missing. Enforcement is reported,
//! never assumed.

use std::io;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, LandlockStatus, NetPort, PathBeneath, PathFd,
    RestrictionStatus, Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus,
    Scope,
};

use crate::config::LandlockPlan;

/// The Landlock ABI whose rights are requested: the newest one this module was written and tested
/// against (Linux 6.15; ABI 7 adds no access rights to 6, only audit-log flags).
///
/// Raising it is a deliberate change, not a version bump: ABI 9 adds `ResolveUnix`, which makes
/// connecting to a named Unix socket a write-class right, so the plan would first have to say which
/// sockets the command may reach (the egress proxy's socket among them). And requesting rights the
/// running kernel lacks turns [`LandlockOutcome::Full`] into `Partial`, which a plan that requires
/// Landlock treats as failure.
pub const TARGET_ABI: ABI = ABI::V7;

/// How much of the requested confinement the kernel enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LandlockOutcome {
    /// Every requested restriction is enforced.
    Full,
    /// Some are enforced; the kernel lacks the rest.
    Partial,
    /// None is (Landlock disabled in the plan, or unsupported by the kernel).
    None,
}

impl LandlockOutcome {
    /// The name reported in the status stream and in `ExecResult.enforcement.landlock`.
    pub fn as_str(self) -> &'static str {
        match self {
            LandlockOutcome::Full => "full",
            LandlockOutcome::Partial => "partial",
            LandlockOutcome::None => "none",
        }
    }
}

/// Why Landlock could not be applied as planned.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    /// A path of the plan exists but cannot be inspected or opened.
    #[error("cannot open landlock rule path {path}: {source}")]
    Path { path: PathBuf, source: io::Error },
    /// Building the ruleset or restricting the process failed.
    #[error("cannot apply landlock ruleset: {0}")]
    Ruleset(#[from] landlock::RulesetError),
    /// The plan requires Landlock, and the kernel does not enforce all of it.
    #[error(
        "landlock is required but {outcome} on this kernel ({kernel}): not enforced: {missing}"
    )]
    NotEnforced {
        outcome: &'static str,
        kernel: String,
        missing: String,
    },
}

/// Applies the plan to the calling thread (and so to what it execs).
///
/// Paths of the plan that do not exist are skipped. With `plan.required`, anything short of
/// [`LandlockOutcome::Full`] is an error (the process may already be partly restricted; the caller
/// fails closed and does not exec). Without it the outcome is returned for reporting.
pub fn apply(plan: &LandlockPlan) -> Result<LandlockOutcome, LandlockError> {
    prepare(plan)?.restrict()
}

/// A plan's ruleset, built (its paths opened and its rules added) but not yet applied: a
/// long-lived sandbox builds it once, and each command restricts itself with it
/// ([`Prepared::restrict`], one call), in a domain of its own.
pub struct Prepared {
    created: Option<RulesetCreated>,
    required: bool,
    deny_tcp: bool,
}

/// Builds the plan's ruleset without applying it. The rules hold the paths as they are now: a
/// path mounted over later (a restored workspace) needs a new one.
pub fn prepare(plan: &LandlockPlan) -> Result<Prepared, LandlockError> {
    let created = if plan.enabled {
        let mut ruleset = Ruleset::default().handle_access(AccessFs::from_all(TARGET_ABI))?;
        if plan.deny_tcp {
            // Handled with no rule: every port is refused for bind and connect.
            ruleset = ruleset.handle_access(tcp())?;
        }
        let mut created = ruleset.scope(Scope::from_all(TARGET_ABI))?.create()?;
        created = add_path_rules(created, &plan.read, AccessFs::from_read(TARGET_ABI))?;
        created = add_path_rules(created, &plan.write, AccessFs::from_all(TARGET_ABI))?;
        if plan.deny_tcp {
            // Connecting to these ports (on any address) stays allowed; binding stays refused.
            for port in &plan.connect_tcp {
                created = created.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
            }
        }
        Some(created)
    } else {
        None
    };
    Ok(Prepared {
        created,
        required: plan.required,
        deny_tcp: plan.deny_tcp,
    })
}

impl Prepared {
    /// Another handle on the same ruleset (its descriptor duplicated): a reaper keeps its own
    /// and gives each of its commands a copy to apply.
    pub fn try_clone(&self) -> std::io::Result<Prepared> {
        Ok(Prepared {
            created: self.created.as_ref().map(|c| c.try_clone()).transpose()?,
            required: self.required,
            deny_tcp: self.deny_tcp,
        })
    }

    /// Applies the ruleset to the calling thread (and so to what it execs). Needs
    /// `no_new_privs` (or `CAP_SYS_ADMIN`). With a required plan, anything short of
    /// [`LandlockOutcome::Full`] is an error (the process may already be partly restricted; the
    /// caller fails closed and does not exec).
    pub fn restrict(self) -> Result<LandlockOutcome, LandlockError> {
        let Some(created) = self.created else {
            return Ok(LandlockOutcome::None);
        };
        let status = created.restrict_self()?;
        let outcome = outcome_of(&status);
        if self.required && outcome != LandlockOutcome::Full {
            return Err(LandlockError::NotEnforced {
                outcome: outcome.as_str(),
                kernel: describe_kernel(status.landlock),
                missing: missing_rights(ABI::from(status.landlock), self.deny_tcp).join(", "),
            });
        }
        Ok(outcome)
    }
}

/// The TCP rights `deny_tcp` handles. Named, not `from_all`: newer ABIs add UDP rights to the
/// network class, which the plan does not ask to refuse.
fn tcp() -> BitFlags<AccessNet> {
    AccessNet::BindTcp | AccessNet::ConnectTcp
}

fn outcome_of(status: &RestrictionStatus) -> LandlockOutcome {
    match status.ruleset {
        RulesetStatus::FullyEnforced => LandlockOutcome::Full,
        RulesetStatus::PartiallyEnforced => LandlockOutcome::Partial,
        RulesetStatus::NotEnforced => LandlockOutcome::None,
    }
}

/// Grants `access` beneath each existing path (only the file rights for a path that is a file).
fn add_path_rules(
    mut ruleset: RulesetCreated,
    paths: &[PathBuf],
    access: BitFlags<AccessFs>,
) -> Result<RulesetCreated, LandlockError> {
    for path in paths {
        let path_error = |source| LandlockError::Path {
            path: path.clone(),
            source,
        };
        let is_dir = match std::fs::metadata(path) {
            Ok(meta) => meta.is_dir(),
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(path_error(err)),
        };
        let fd = open_path(path).map_err(path_error)?;
        let access = if is_dir {
            access
        } else {
            access & AccessFs::from_file(TARGET_ABI)
        };
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?;
    }
    Ok(ruleset)
}

fn open_path(path: &Path) -> Result<PathFd, io::Error> {
    PathFd::new(path).map_err(|err| match err {
        landlock::PathFdError::OpenCall { source, .. } => source,
        other => io::Error::other(other.to_string()),
    })
}

fn describe_kernel(status: LandlockStatus) -> String {
    match status {
        LandlockStatus::NotEnabled => "landlock not enabled at boot".to_owned(),
        LandlockStatus::NotImplemented => "landlock not built in".to_owned(),
        LandlockStatus::Available { effective_abi, .. } => format!("landlock abi {effective_abi}"),
    }
}

/// The requested rights a kernel with `kernel` ABI cannot enforce, by name.
fn missing_rights(kernel: ABI, deny_tcp: bool) -> Vec<String> {
    if kernel == ABI::Unsupported {
        return vec!["every right".to_owned()];
    }
    let fs = AccessFs::from_all(TARGET_ABI) & !AccessFs::from_all(kernel);
    let net = if deny_tcp {
        tcp() & !AccessNet::from_all(kernel)
    } else {
        BitFlags::EMPTY
    };
    let scopes = Scope::from_all(TARGET_ABI) & !Scope::from_all(kernel);
    let mut missing: Vec<String> = fs.iter().map(|right| format!("fs {right:?}")).collect();
    missing.extend(net.iter().map(|right| format!("net {right:?}")));
    missing.extend(scopes.iter().map(|scope| format!("scope {scope:?}")));
    if missing.is_empty() {
        // The crate reported partial enforcement for a reason the ABI does not explain.
        missing.push("unknown (partial enforcement reported)".to_owned());
    }
    missing
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};

    use super::*;
    use crate::seccomp::tests::{Ended, confine_basics, errno, in_child};

    /// Runs `checks` in a child after applying `plan`; the child exits 0 when every check passed,
    /// otherwise with the number of the first failed one (see the callers).
    fn landlocked(plan: &LandlockPlan, checks: impl FnOnce(LandlockOutcome) -> i32) -> Ended {
        in_child(|| {
            if !confine_basics() {
                return 100;
            }
            match apply(plan) {
                Ok(outcome) => checks(outcome),
                Err(_) => 101,
            }
        })
    }

    fn io_errno(result: io::Result<impl Sized>) -> i32 {
        match result {
            Ok(_) => 0,
            Err(err) => err.raw_os_error().unwrap_or(-1),
        }
    }

    #[test]
    fn read_everywhere_write_only_beneath_write_paths_no_tcp() {
        let allowed = tempfile::tempdir().expect("tempdir");
        let other = tempfile::tempdir().expect("tempdir");
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("listen");
        let port = listener.local_addr().expect("local addr").port();
        let plan = LandlockPlan {
            enabled: true,
            required: true,
            read: vec!["/".into()],
            write: vec![allowed.path().into(), "/nonexistent/taskbox-test".into()],
            deny_tcp: true,
            connect_tcp: Vec::new(),
        };
        let allowed_file = allowed.path().join("out.txt");
        let other_file = other.path().join("out.txt");

        let ended = landlocked(&plan, |outcome| {
            if outcome != LandlockOutcome::Full {
                return 1;
            }
            // Writing, truncating, renaming and removing beneath the write path.
            let written = std::fs::File::create(&allowed_file).and_then(|mut f| f.write_all(b"ok"));
            if written.is_err() {
                return 2;
            }
            let renamed = allowed.path().join("renamed.txt");
            if std::fs::write(&allowed_file, b"again").is_err()
                || std::fs::rename(&allowed_file, &renamed).is_err()
                || std::fs::create_dir(allowed.path().join("sub")).is_err()
                || std::fs::remove_file(&renamed).is_err()
            {
                return 3;
            }
            // Anywhere else: EACCES.
            if io_errno(std::fs::File::create(&other_file)) != libc::EACCES {
                return 4;
            }
            if io_errno(std::fs::create_dir(other.path().join("sub"))) != libc::EACCES {
                return 5;
            }
            // Reading works.
            if std::path::Path::new("/etc/hostname").exists()
                && std::fs::read("/etc/hostname").is_err()
            {
                return 6;
            }
            if std::fs::read("/proc/self/status").is_err() {
                return 7;
            }
            // TCP: connect and bind are refused.
            let to = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            if io_errno(TcpStream::connect(to)) != libc::EACCES {
                return 8;
            }
            if io_errno(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))) != libc::EACCES {
                return 9;
            }
            0
        });
        assert_eq!(ended, Ended::Exited(0));
        drop(listener);
    }

    #[test]
    fn only_the_listed_port_may_be_connected_to() {
        let proxy = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("listen");
        let other = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("listen");
        let proxy_port = proxy.local_addr().expect("local addr").port();
        let other_port = other.local_addr().expect("local addr").port();
        let plan = LandlockPlan {
            enabled: true,
            required: true,
            read: vec!["/".into()],
            write: Vec::new(),
            deny_tcp: true,
            connect_tcp: vec![proxy_port],
        };
        let ended = landlocked(&plan, |outcome| {
            if outcome != LandlockOutcome::Full {
                return 1;
            }
            if io_errno(TcpStream::connect((Ipv4Addr::LOCALHOST, proxy_port))) != 0 {
                return 2;
            }
            if io_errno(TcpStream::connect((Ipv4Addr::LOCALHOST, other_port))) != libc::EACCES {
                return 3;
            }
            // The listed port does not make binding it (or any port) possible.
            if io_errno(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))) != libc::EACCES {
                return 4;
            }
            if io_errno(TcpListener::bind((Ipv4Addr::LOCALHOST, proxy_port))) != libc::EACCES {
                return 5;
            }
            0
        });
        assert_eq!(ended, Ended::Exited(0));
        drop((proxy, other));
    }

    #[test]
    fn signals_outside_the_domain_are_refused() {
        let plan = LandlockPlan {
            enabled: true,
            required: true,
            read: vec!["/".into()],
            ..LandlockPlan::default()
        };
        let ended = landlocked(&plan, |_| {
            // SAFETY: signal 0 only checks permission; the parent is the test process.
            let rc = unsafe { libc::kill(libc::getppid(), 0) };
            if rc == -1 { errno() } else { 0 }
        });
        assert_eq!(ended, Ended::Exited(libc::EPERM));
    }

    #[test]
    fn tcp_stays_open_without_deny_tcp() {
        let plan = LandlockPlan {
            enabled: true,
            required: true,
            read: vec!["/".into()],
            ..LandlockPlan::default()
        };
        let ended = landlocked(&plan, |_| {
            io_errno(TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        });
        assert_eq!(ended, Ended::Exited(0));
    }

    #[test]
    fn disabled_plan_restricts_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("free.txt");
        let ended = landlocked(&LandlockPlan::default(), |outcome| {
            if outcome != LandlockOutcome::None {
                return 1;
            }
            io_errno(std::fs::write(&file, b"free"))
        });
        assert_eq!(ended, Ended::Exited(0));
    }

    #[test]
    fn outcome_names() {
        assert_eq!(LandlockOutcome::Full.as_str(), "full");
        assert_eq!(LandlockOutcome::Partial.as_str(), "partial");
        assert_eq!(LandlockOutcome::None.as_str(), "none");
    }

    #[test]
    fn missing_rights_name_what_an_older_kernel_lacks() {
        assert_eq!(
            missing_rights(ABI::V3, true),
            [
                "fs IoctlDev",
                "net BindTcp",
                "net ConnectTcp",
                "scope AbstractUnixSocket",
                "scope Signal"
            ]
        );
        assert_eq!(
            missing_rights(ABI::V4, false),
            ["fs IoctlDev", "scope AbstractUnixSocket", "scope Signal"]
        );
        assert_eq!(missing_rights(ABI::Unsupported, true), ["every right"]);
    }
}
