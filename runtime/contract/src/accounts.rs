//! A sandbox's accounts: its `/etc/passwd` and `/etc/group`, read as text the sandbox wrote
//! (so bounded, and forgiving of lines that do not parse), and the user an exec names
//! (`ExecRequest::user`) resolved against them. Each backend reads the two files with its own
//! file operations (inside the sandbox's root, never following a link out of it) and resolves
//! here, so a name means the same user on every backend.

use crate::api::ApiError;

/// One line of `/etc/passwd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswdEntry {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// One line of `/etc/group`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupEntry {
    pub name: String,
    pub gid: u32,
    pub members: Vec<String>,
}

/// The lines of `text` (an `/etc/passwd`) that have the seven fields and numeric ids.
pub fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 7 || f[0].is_empty() {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect()
}

/// The lines of `text` (an `/etc/group`) that have the four fields and a numeric id.
pub fn parse_group(text: &str) -> Vec<GroupEntry> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 || f[0].is_empty() {
                return None;
            }
            Some(GroupEntry {
                name: f[0].to_string(),
                gid: f[2].parse().ok()?,
                members: f[3]
                    .split(',')
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect(),
            })
        })
        .collect()
}

/// Who an exec runs as: its uid, primary gid and supplementary groups (the groups that list
/// it by name), and its name and home when the sandbox knows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, sorted, without the primary one; at most [`MAX_GROUPS`].
    pub groups: Vec<u32>,
    pub name: Option<String>,
    pub home: Option<String>,
    /// The passwd line resolved is the first with its uid, so a lookup by uid finds this
    /// user too (Docker's runtime looks a numeric user up that way).
    pub first_of_uid: bool,
}

/// Supplementary groups kept for one user (the kernel allows 65536; a sandbox has a few).
pub const MAX_GROUPS: usize = 64;

/// Bytes of `/etc/passwd` or `/etc/group` a backend reads (a larger file is the sandbox's
/// mistake, or an attempt to make the supervisor read without end).
pub const MAX_ACCOUNTS_FILE: u64 = 4 << 20;

/// Resolves `spec` (a name, or a numeric uid) against `passwd` and `group`. A name that no line
/// has is [`ApiError::UserNotFound`], naming it; a number that no line has is that uid with
/// gid = uid's own number (as `docker exec --user 1234` does, with no name and no groups).
pub fn resolve(
    spec: &str,
    passwd: &[PasswdEntry],
    group: &[GroupEntry],
) -> Result<ExecUser, ApiError> {
    if spec.is_empty() || spec.len() > 256 || spec.contains(['\0', '\n', ':']) {
        return Err(ApiError::invalid(format!(
            "user {spec:?}: give a user name of the sandbox or a numeric uid"
        )));
    }
    let entry = match spec.parse::<u32>() {
        Ok(uid) => passwd.iter().find(|e| e.uid == uid),
        Err(_) => passwd.iter().find(|e| e.name == spec),
    };
    let Some(entry) = entry else {
        if let Ok(uid) = spec.parse::<u32>() {
            return Ok(ExecUser {
                uid,
                gid: uid,
                groups: Vec::new(),
                name: None,
                home: None,
                first_of_uid: false,
            });
        }
        return Err(ApiError::UserNotFound(format!(
            "no user {spec:?} in the sandbox (its /etc/passwd has no such name): create it \
             first (adduser, as root), or give a numeric uid"
        )));
    };
    let mut groups: Vec<u32> = group
        .iter()
        .filter(|g| g.gid != entry.gid && g.members.contains(&entry.name))
        .map(|g| g.gid)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups.truncate(MAX_GROUPS);
    Ok(ExecUser {
        uid: entry.uid,
        gid: entry.gid,
        groups,
        name: Some(entry.name.clone()),
        home: Some(entry.home.clone()).filter(|h| h.starts_with('/')),
        first_of_uid: passwd.iter().find(|e| e.uid == entry.uid) == Some(entry),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
        dev:x:1000:1000::/home/dev:/bin/bash\n\
        broken line\n\
        bad:x:notanumber:1::/:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nsudo:x:27:dev,other\ndev:x:1000:dev\nbad:x:zz:dev\n";

    #[test]
    fn names_and_numbers_resolve_with_their_groups() {
        let (p, g) = (parse_passwd(PASSWD), parse_group(GROUP));
        assert_eq!(p.len(), 2, "lines that do not parse are skipped: {p:?}");
        let dev = resolve("dev", &p, &g).unwrap();
        assert_eq!(
            (dev.uid, dev.gid, dev.groups.clone()),
            (1000, 1000, vec![27])
        );
        assert_eq!(dev.home.as_deref(), Some("/home/dev"));
        assert_eq!(resolve("1000", &p, &g).unwrap(), dev);
        let root = resolve("root", &p, &g).unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        let anon = resolve("4321", &p, &g).unwrap();
        assert_eq!((anon.uid, anon.gid, anon.name), (4321, 4321, None));
    }

    #[test]
    fn unknown_names_and_malformed_specs_are_clear_errors() {
        let (p, g) = (parse_passwd(PASSWD), parse_group(GROUP));
        let e = resolve("nonexistent", &p, &g).unwrap_err();
        assert_eq!(e.code(), "user_not_found");
        assert!(e.to_string().contains("\"nonexistent\""), "{e}");
        for bad in ["", "a:b", "x\ny", &"u".repeat(300)] {
            assert_eq!(
                resolve(bad, &p, &g).unwrap_err().code(),
                "invalid_argument",
                "{bad:?}"
            );
        }
    }
}
