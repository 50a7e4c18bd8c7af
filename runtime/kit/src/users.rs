//! The user an exec names (`ExecRequest::user`), resolved against the sandbox's own
//! `/etc/passwd` and `/etc/group` as they are at the time of the exec (a user that an earlier
//! command added counts). Both files are read through the sandbox's root as its commands see it
//! ([`Handle::open_root`](crate::Handle::open_root)) with the file operations' own path
//! resolution, so a link in the sandbox can never make the supervisor read a file outside it,
//! and each read is bounded by [`MAX_ACCOUNTS_FILE`].

use std::os::fd::OwnedFd;

use taskbox_contract::accounts::{self, ExecUser, GroupEntry, MAX_ACCOUNTS_FILE, PasswdEntry};

use crate::api::{ApiError, ReadRequest};
use crate::fsops::WorkspaceFs;

/// A sandbox's accounts as they are now.
#[derive(Debug, Clone, Default)]
pub struct Accounts {
    pub passwd: Vec<PasswdEntry>,
    pub group: Vec<GroupEntry>,
}

impl Accounts {
    /// Reads `/etc/passwd` and `/etc/group` of the sandbox whose root is `root`.
    pub fn read(root: &OwnedFd) -> Result<Accounts, ApiError> {
        Ok(Accounts {
            passwd: accounts::parse_passwd(&read_accounts_file(root, "/etc/passwd")?),
            group: accounts::parse_group(&read_accounts_file(root, "/etc/group")?),
        })
    }

    /// Resolves `spec` (a name, or a numeric uid) against them.
    pub fn resolve(&self, spec: &str) -> Result<ExecUser, ApiError> {
        accounts::resolve(spec, &self.passwd, &self.group)
    }
}

/// Resolves `spec` (a name, or a numeric uid) in the sandbox whose root is `root`.
pub fn resolve_in_root(root: &OwnedFd, spec: &str) -> Result<ExecUser, ApiError> {
    Accounts::read(root)?.resolve(spec)
}

/// The text of one account file of the sandbox; empty when it has none (every name is then
/// unknown, and a numeric uid still runs).
fn read_accounts_file(root: &OwnedFd, path: &str) -> Result<String, ApiError> {
    let fd = root
        .try_clone()
        .map_err(|e| ApiError::internal(format!("cannot duplicate a descriptor: {e}")))?;
    let read = WorkspaceFs::sandbox_root(fd).read(&ReadRequest {
        path: path.into(),
        max_bytes: Some(MAX_ACCOUNTS_FILE),
        ..ReadRequest::default()
    });
    let r = match read {
        Ok(r) => r,
        Err(ApiError::NotFound(_)) => return Ok(String::new()),
        Err(e) => {
            return Err(ApiError::invalid(format!(
                "cannot read the sandbox's {path} to find the exec's user: {e}"
            )));
        }
    };
    if r.truncated || r.total_bytes > MAX_ACCOUNTS_FILE {
        return Err(ApiError::invalid(format!(
            "the sandbox's {path} is {} bytes, over the {MAX_ACCOUNTS_FILE} bytes taskbox reads \
             to find an exec's user",
            r.total_bytes
        )));
    }
    if r.binary {
        return Err(ApiError::invalid(format!(
            "the sandbox's {path} is not text: taskbox cannot find the exec's user in it"
        )));
    }
    Ok(r.content)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_of(dir: &std::path::Path) -> OwnedFd {
        std::fs::File::open(dir).unwrap().into()
    }

    #[test]
    fn users_resolve_from_the_roots_own_files_and_links_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        std::fs::write(
            etc.join("passwd"),
            "root:x:0:0:root:/root:/bin/sh\ndev:x:1000:1000::/home/dev:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(etc.join("group"), "wheel:x:10:dev\ndev:x:1000:\n").unwrap();
        let root = root_of(dir.path());
        let dev = resolve_in_root(&root, "dev").unwrap();
        assert_eq!((dev.uid, dev.gid, dev.groups), (1000, 1000, vec![10]));
        let e = resolve_in_root(&root, "nobody-here").unwrap_err();
        assert_eq!(e.code(), "user_not_found", "{e}");
        assert!(e.to_string().contains("nobody-here"), "{e}");

        // Links resolve inside the root (an absolute one, and `..` past the top): the file
        // read is the sandbox's `/real/passwd`, which the host has not.
        std::fs::create_dir(dir.path().join("real")).unwrap();
        std::fs::write(
            dir.path().join("real/passwd"),
            "inroot:x:1234:1234::/:/bin/sh\n",
        )
        .unwrap();
        for target in ["/real/passwd", "../../../../../../../../real/passwd"] {
            std::fs::remove_file(etc.join("passwd")).unwrap();
            std::os::unix::fs::symlink(target, etc.join("passwd")).unwrap();
            let u = resolve_in_root(&root, "inroot").unwrap();
            assert_eq!(u.uid, 1234, "{target}");
        }
        std::fs::remove_file(dir.path().join("real/passwd")).unwrap();
        let e = resolve_in_root(&root, "inroot").unwrap_err();
        assert_eq!(e.code(), "user_not_found", "{e}");
        // No passwd at all: numeric uids still run.
        assert_eq!(resolve_in_root(&root, "4321").unwrap().uid, 4321);

        // Too large to read is a clear error, not a silent partial read.
        std::fs::remove_file(etc.join("passwd")).unwrap();
        let f = std::fs::File::create(etc.join("passwd")).unwrap();
        f.set_len(MAX_ACCOUNTS_FILE + 1).unwrap();
        let e = resolve_in_root(&root, "dev").unwrap_err();
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("/etc/passwd"), "{e}");
    }
}
