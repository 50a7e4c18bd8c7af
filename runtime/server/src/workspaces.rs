//! Which host directories a client may name as a workspace, and workspaces a client sends.
//!
//! A create's `workspace` is a path on the supervisor's host, which the sandbox then sees (an
//! overlay over it). The supervisor may read far more than any client should, so a named path
//! is accepted only when the operator allows it:
//! - beneath a root named at `serve` (`--workspace-root DIR`, repeatable), for every caller;
//! - for a caller on the Unix socket, also a directory that the caller's own user (the
//!   socket's peer credentials) may read and enter;
//! - never taskbox's own state (the state directory, the image store, the policy directory,
//!   the tokens file and socket) or a directory inside or above it ([`hostdirs`]).
//!
//! Over TCP a path outside the roots is refused before the file system is looked at, so the
//! answer does not tell whether it exists. Otherwise the workspace is content the client sends:
//! a tar upload (`POST /v1/workspaces`), unpacked by the supervisor into a directory of its
//! own and named in the create by `workspace_id`, or a git repository and commit the
//! supervisor clones ([`crate::gitsource`]).

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use taskbox_core::api::ApiError;
use taskbox_core::hostdirs::{self, Hidden};

use crate::caller::Caller;
use crate::clock::now_ms;
use crate::error::ServerError;

/// The label that names the upload a sandbox's workspace came from.
pub const UPLOAD_LABEL: &str = "taskbox.workspace-id";
/// The label that records the digest of that upload's tar (the trace's workspace base).
pub const UPLOAD_DIGEST_LABEL: &str = "taskbox.workspace-sha256";

/// What a workspace may be.
#[derive(Debug)]
pub struct WorkspaceRules {
    roots: Vec<PathBuf>,
    hidden: Vec<Hidden>,
    /// Hosts a clone may reach although they resolve to internal addresses.
    git_hosts: Vec<String>,
}

impl WorkspaceRules {
    /// Roots must be existing directories apart from taskbox's own state; `extra` are more
    /// paths never to serve (the tokens file, the socket).
    pub fn new(
        roots: &[PathBuf],
        state_dir: &Path,
        extra: &[PathBuf],
    ) -> Result<WorkspaceRules, ServerError> {
        let hidden = hostdirs::taskbox_paths(state_dir, extra);
        let mut canonical = Vec::new();
        for r in roots {
            let c = fs::canonicalize(r)
                .map_err(|e| ServerError::Config(format!("workspace root {}: {e}", r.display())))?;
            if !c.is_dir() {
                return Err(ServerError::Config(format!(
                    "workspace root {} is not a directory",
                    r.display()
                )));
            }
            // A root above the state directory is fine (its workspaces are checked one by
            // one); a root that is or lies inside it is not.
            if let Some(h) = hidden.iter().find(|h| c.starts_with(&h.path)) {
                return Err(ServerError::Config(format!(
                    "workspace root {} is inside {} ({}); choose a directory apart from it",
                    r.display(),
                    h.what,
                    h.path.display()
                )));
            }
            canonical.push(c);
        }
        Ok(WorkspaceRules {
            roots: canonical,
            hidden,
            git_hosts: Vec::new(),
        })
    }

    /// Lets clones reach these hosts (`host` or `host:port`) although they resolve to loopback,
    /// private or other internal addresses (`serve --git-allow-host`).
    pub fn with_git_hosts(mut self, hosts: Vec<String>) -> WorkspaceRules {
        self.git_hosts = hosts;
        self
    }

    /// The hosts of [`WorkspaceRules::with_git_hosts`].
    pub fn git_hosts(&self) -> &[String] {
        &self.git_hosts
    }

    /// The roots, canonical.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    fn refused(&self, asked: &str, why: &str) -> ApiError {
        let roots = if self.roots.is_empty() {
            "this supervisor has no workspace roots".to_owned()
        } else {
            format!(
                "the workspace roots are {}",
                self.roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        ApiError::PathRefused(format!(
            "workspace {asked:?} refused: {why}; {roots} (serve --workspace-root DIR), or send \
             the workspace as a tar (POST /v1/workspaces) and create with its workspace_id"
        ))
    }

    /// The canonical directory `asked` names, if `caller` may have it as a workspace.
    pub fn check(&self, asked: &str, caller: &Caller) -> Result<PathBuf, ApiError> {
        let shown: String = asked.chars().take(256).collect();
        if asked.is_empty() {
            return Err(ApiError::invalid(
                "give workspace (a directory on the supervisor's host) or workspace_id (an upload)",
            ));
        }
        let path = Path::new(asked);
        if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
            return Err(ApiError::invalid(format!(
                "workspace {shown:?} must be an absolute path without `..`"
            )));
        }
        let local = matches!(caller, Caller::Unix { .. });
        let under_root = |p: &Path| self.roots.iter().any(|r| p.starts_with(r));
        // A remote caller learns nothing of paths outside the roots, not even whether they
        // exist: refused before the file system is asked.
        if !local && !under_root(path) {
            return Err(self.refused(&shown, "it is not under a workspace root"));
        }
        let canonical = match fs::canonicalize(path) {
            Ok(c) => c,
            Err(_) if !local => {
                return Err(self.refused(&shown, "it is not a directory under a workspace root"));
            }
            Err(e) => {
                return Err(ApiError::not_found(format!(
                    "workspace {shown:?}: {}",
                    io_reason(&e)
                )));
            }
        };
        if !canonical.is_dir() {
            return Err(if local {
                ApiError::invalid(format!("workspace {shown:?} is not a directory"))
            } else {
                self.refused(&shown, "it is not a directory under a workspace root")
            });
        }
        if let Some(why) = hostdirs::check_workspace(&canonical, &self.hidden) {
            return Err(ApiError::PathRefused(format!(
                "workspace {shown:?} refused: {why}; taskbox's own state is never a workspace"
            )));
        }
        if under_root(&canonical) {
            return Ok(canonical);
        }
        match caller {
            Caller::Unix { uid, gid, pid } if access::can_enter(&canonical, *uid, *gid, *pid) => {
                Ok(canonical)
            }
            Caller::Unix { uid, .. } => Err(self.refused(
                &shown,
                &format!("it is not under a workspace root, and user {uid} may not read it"),
            )),
            _ => Err(self.refused(&shown, "it leads out of the workspace roots")),
        }
    }
}

fn io_reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "no such directory".into(),
        io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

/// Whether a user may read and enter a directory, checked by the kernel with that user's ids.
mod access {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    /// The supplementary groups of a process, from `/proc/PID/status`.
    fn groups_of(pid: Option<i32>) -> Vec<libc::gid_t> {
        let Some(pid) = pid else {
            return Vec::new();
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                    g.split_whitespace()
                        .filter_map(|n| n.parse().ok())
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    fn faccess(c: &CString) -> bool {
        // SAFETY: `c` is a valid NUL-terminated path; faccessat reads it and nothing else.
        unsafe {
            libc::faccessat(
                libc::AT_FDCWD,
                c.as_ptr(),
                libc::R_OK | libc::X_OK,
                libc::AT_EACCESS,
            ) == 0
        }
    }

    pub(super) fn can_enter(dir: &Path, uid: u32, gid: u32, pid: Option<i32>) -> bool {
        let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if uid == me {
            return faccess(&c);
        }
        if me != 0 {
            // Only root can take another user's ids; any other peer is refused.
            return false;
        }
        let groups = groups_of(pid);
        // A thread of its own takes the caller's file-system ids (per thread in Linux: the raw
        // setgroups/setfsgid/setfsuid calls change only the calling thread), so the kernel
        // checks the path as that user would see it, and the ids end with the thread.
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: raw system calls on this thread's credentials; `groups` outlives the
                // call. Any failure leaves the thread with fewer rights or none changed, and
                // is then refused below.
                unsafe {
                    if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
                        return false;
                    }
                    libc::setfsgid(gid);
                    libc::setfsuid(uid);
                    if libc::setfsuid(u32::MAX) as u32 != uid {
                        return false;
                    }
                }
                faccess(&c)
            })
            .join()
            .unwrap_or(false)
        })
    }
}

/// A workspace a client sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct WorkspaceUpload {
    /// `ws-` and 16 hex digits; name it in a create as `workspace_id`.
    pub id: String,
    /// SHA-256 of the tar as sent (the trace records it as the workspace's base); none for a
    /// clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The repository and commit a clone was made from (the trace records the commit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<crate::gitsource::GitSource>,
    /// Bytes of the tar (0 for a clone).
    pub bytes: u64,
    /// Entries unpacked (0 for a clone).
    pub entries: u64,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// When it is removed unless a sandbox still uses it (ms since the epoch).
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct UploadMeta {
    tenant: String,
    upload: WorkspaceUpload,
}

/// The uploads, in `STATE/workspaces/ID/` (`tree/` and `meta.json`).
#[derive(Debug)]
pub struct Uploads {
    dir: PathBuf,
    max_bytes: u64,
    all: Mutex<HashMap<String, UploadMeta>>,
}

fn internal(what: &str, path: &Path) -> impl FnOnce(io::Error) -> ApiError {
    let msg = format!("cannot {what} {}", path.display());
    move |e| ApiError::internal(format!("{msg}: {e}"))
}

impl Uploads {
    /// Opens the uploads of `state_dir`, keeping those a previous server left whose meta file
    /// reads back, and removing the rest (a crashed upload's partial tree).
    pub fn open(state_dir: &Path, max_bytes: u64) -> Result<Uploads, ServerError> {
        let dir = state_dir.join("workspaces");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .and_then(|()| fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)))
            .map_err(|e| ServerError::Config(format!("cannot create {}: {e}", dir.display())))?;
        let mut all = HashMap::new();
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                let meta = fs::read(e.path().join("meta.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<UploadMeta>(&b).ok());
                match meta {
                    Some(m) if e.file_name().to_str() == Some(m.upload.id.as_str()) => {
                        all.insert(m.upload.id.clone(), m);
                    }
                    _ => taskbox_core::native::remove_tree(&e.path()),
                }
            }
        }
        Ok(Uploads {
            dir,
            max_bytes,
            all: Mutex::new(all),
        })
    }

    /// The largest tar accepted.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, UploadMeta>> {
        self.all
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A scratch file for an upload in progress.
    pub fn incoming(&self) -> Result<(PathBuf, fs::File), ApiError> {
        let path = self.dir.join(format!(".incoming-{}", random_hex()));
        let f = fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(internal("create", &path))?;
        Ok((path, f))
    }

    /// Unpacks a received tar (`tar_path`, `bytes` long, digest `sha256`) as a new upload of
    /// `tenant`, removing the tar. Blocks.
    pub fn add(
        &self,
        tenant: &str,
        tar_path: &Path,
        bytes: u64,
        sha256: String,
        lease_ms: u64,
    ) -> Result<WorkspaceUpload, ApiError> {
        let id = format!("ws-{}", random_hex());
        let root = self.dir.join(&id);
        let tree = root.join("tree");
        let unpacked = fs::create_dir(&root)
            .map_err(internal("create", &root))
            .and_then(|()| unpack(tar_path, &tree));
        let _ = fs::remove_file(tar_path);
        let entries = match unpacked {
            Ok(n) => n,
            Err(e) => {
                taskbox_core::native::remove_tree(&root);
                return Err(e);
            }
        };
        let now = now_ms();
        let upload = WorkspaceUpload {
            id: id.clone(),
            sha256: Some(sha256),
            git: None,
            bytes,
            entries,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(lease_ms),
        };
        self.keep(tenant, &root, upload)
    }

    /// Clones `src` (checked against `allowed`, see [`crate::gitsource`]) as a new workspace of
    /// `tenant`. Blocks for as long as the clone takes (bounded).
    pub fn add_git(
        &self,
        tenant: &str,
        src: &crate::gitsource::GitSource,
        allowed: &[String],
        lease_ms: u64,
    ) -> Result<WorkspaceUpload, ApiError> {
        crate::gitsource::check(src, allowed)?;
        let id = format!("ws-{}", random_hex());
        let root = self.dir.join(&id);
        let home = root.join("home");
        let cloned = fs::create_dir(&root)
            .and_then(|()| fs::create_dir(&home))
            .map_err(internal("create", &root))
            .and_then(|()| crate::gitsource::clone_into(src, allowed, &root.join("tree"), &home));
        taskbox_core::native::remove_tree(&home);
        if let Err(e) = cloned {
            taskbox_core::native::remove_tree(&root);
            return Err(e);
        }
        let now = now_ms();
        let upload = WorkspaceUpload {
            id,
            sha256: None,
            git: Some(src.clone()),
            bytes: 0,
            entries: 0,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(lease_ms),
        };
        self.keep(tenant, &root, upload)
    }

    /// Records a new upload in `root` (removed if that fails).
    fn keep(
        &self,
        tenant: &str,
        root: &Path,
        upload: WorkspaceUpload,
    ) -> Result<WorkspaceUpload, ApiError> {
        let meta = UploadMeta {
            tenant: tenant.to_owned(),
            upload: upload.clone(),
        };
        let written = serde_json::to_vec(&meta)
            .map_err(ApiError::internal)
            .and_then(|b| {
                let p = root.join("meta.json");
                fs::write(&p, b).map_err(internal("write", &p))
            });
        if let Err(e) = written {
            taskbox_core::native::remove_tree(root);
            return Err(e);
        }
        self.lock().insert(upload.id.clone(), meta);
        Ok(upload)
    }

    /// The tenant's uploads.
    pub fn list(&self, tenant: &str) -> Vec<WorkspaceUpload> {
        let mut v: Vec<_> = self
            .lock()
            .values()
            .filter(|m| m.tenant == tenant)
            .map(|m| m.upload.clone())
            .collect();
        v.sort_by_key(|u| u.created_at_ms);
        v
    }

    /// The tree of the tenant's upload `id` (another tenant's answers as a missing one).
    pub fn tree(&self, tenant: &str, id: &str) -> Result<(PathBuf, WorkspaceUpload), ApiError> {
        match self.lock().get(id) {
            Some(m) if m.tenant == tenant => Ok((self.dir.join(id).join("tree"), m.upload.clone())),
            _ => Err(ApiError::not_found(format!(
                "workspace upload {:?} does not exist",
                id.chars().take(64).collect::<String>()
            ))),
        }
    }

    /// Removes the tenant's upload `id`; `in_use` says whether a live sandbox has it.
    pub fn remove(&self, tenant: &str, id: &str, in_use: bool) -> Result<(), ApiError> {
        self.tree(tenant, id)?;
        if in_use {
            return Err(ApiError::Conflict(format!(
                "workspace upload {id} is the workspace of a live sandbox; destroy it first"
            )));
        }
        self.lock().remove(id);
        taskbox_core::native::remove_tree(&self.dir.join(id));
        Ok(())
    }

    /// Removes expired uploads that no live sandbox uses (`in_use` holds the ids in use).
    pub fn reap(&self, in_use: &std::collections::HashSet<String>) -> Vec<String> {
        let now = now_ms();
        let gone: Vec<String> = self
            .lock()
            .values()
            .filter(|m| m.upload.expires_at_ms <= now && !in_use.contains(&m.upload.id))
            .map(|m| m.upload.id.clone())
            .collect();
        for id in &gone {
            self.lock().remove(id);
            taskbox_core::native::remove_tree(&self.dir.join(id));
        }
        gone
    }
}

fn random_hex() -> String {
    let mut b = [0u8; 8];
    if let Ok(mut f) = fs::File::open("/dev/urandom") {
        let _ = io::Read::read_exact(&mut f, &mut b);
    }
    let n = now_ms().to_le_bytes();
    Sha256::digest([b, n].concat())
        .iter()
        .take(8)
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// A running SHA-256 and byte count of what is written through it.
pub struct Digesting<W> {
    pub inner: W,
    pub hash: Sha256,
    pub bytes: u64,
}

impl<W: Write> Write for Digesting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Unpacks an uploaded tar into `tree` (created), as
/// [`taskbox_core::untar::unpack_untrusted`] does. Returns the number of entries.
fn unpack(tar_path: &Path, tree: &Path) -> Result<u64, ApiError> {
    let f = fs::File::open(tar_path).map_err(internal("open", tar_path))?;
    taskbox_core::untar::unpack_untrusted(f, tree)
        .map_err(|e| ApiError::invalid(format!("the workspace tar is refused: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(root: &Path, state: &Path) -> WorkspaceRules {
        WorkspaceRules::new(&[root.to_path_buf()], state, &[]).unwrap()
    }

    #[test]
    fn remote_callers_get_paths_under_the_roots_only() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let state = d.path().join("state");
        fs::create_dir_all(root.join("a")).unwrap();
        fs::create_dir_all(&state).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        let r = rules(&root, &state);
        let tcp = Caller::Tcp("127.0.0.1:1".parse().unwrap());
        assert!(r.check(root.join("a").to_str().unwrap(), &tcp).is_ok());
        for asked in ["/etc", "/nonexistent", state.to_str().unwrap()] {
            let e = r.check(asked, &tcp).unwrap_err().to_string();
            assert!(e.contains("not under a workspace root"), "{e}");
            assert!(
                e.contains(root.file_name().unwrap().to_str().unwrap()),
                "{e}"
            );
        }
        // A symlink under a root that leads out is refused like any path outside.
        let e = r
            .check(root.join("out").to_str().unwrap(), &tcp)
            .unwrap_err()
            .to_string();
        assert!(e.contains("leads out"), "{e}");
        let e = r
            .check(&format!("{}/a/../..", root.display()), &tcp)
            .unwrap_err()
            .to_string();
        assert!(e.contains("without `..`"), "{e}");
    }

    #[test]
    fn local_callers_get_what_their_user_may_read_but_never_the_state() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        let state = d.path().join("state");
        let mine = d.path().join("mine");
        fs::create_dir_all(&root).unwrap();
        fs::create_dir_all(state.join("traces")).unwrap();
        fs::create_dir_all(&mine).unwrap();
        let r = rules(&root, &state);
        // SAFETY: no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let me = Caller::Unix {
            uid,
            gid,
            pid: Some(std::process::id() as i32),
        };
        assert!(r.check(mine.to_str().unwrap(), &me).is_ok());
        for (asked, why) in [
            (state.clone(), "taskbox's state directory"),
            (state.join("traces"), "inside taskbox's state directory"),
            (d.path().to_path_buf(), "holds taskbox's state directory"),
        ] {
            let e = r
                .check(asked.to_str().unwrap(), &me)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        if uid == 0 {
            // Another user may not have root's private directory.
            fs::set_permissions(&mine, fs::Permissions::from_mode(0o700)).unwrap();
            let nobody = Caller::Unix {
                uid: 65534,
                gid: 65534,
                pid: None,
            };
            let e = r
                .check(mine.to_str().unwrap(), &nobody)
                .unwrap_err()
                .to_string();
            assert!(e.contains("user 65534 may not read it"), "{e}");
            fs::set_permissions(&mine, fs::Permissions::from_mode(0o755)).unwrap();
            fs::set_permissions(d.path(), fs::Permissions::from_mode(0o755)).unwrap();
            assert!(r.check(mine.to_str().unwrap(), &nobody).is_ok());
        }
    }

    #[test]
    fn a_root_inside_the_state_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        fs::create_dir_all(state.join("x")).unwrap();
        let e = WorkspaceRules::new(&[state.join("x")], &state, &[]).unwrap_err();
        assert!(
            e.to_string().contains("inside taskbox's state directory"),
            "{e}"
        );
    }

    fn tar_of(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn header(kind: tar::EntryType, path: &str, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_path(path).unwrap();
        h.set_mode(mode);
        h.set_size(size);
        h.set_cksum();
        h
    }

    #[test]
    fn uploads_keep_files_and_drop_what_a_host_must_not_get() {
        let d = tempfile::tempdir().unwrap();
        let ups = Uploads::open(d.path(), 1 << 20).unwrap();
        let tar = tar_of(|b| {
            b.append(&header(tar::EntryType::Directory, "src", 0o755, 0), &[][..])
                .unwrap();
            b.append(
                &header(tar::EntryType::Regular, "src/a.rs", 0o4755, 3),
                &b"abc"[..],
            )
            .unwrap();
        });
        let (p, mut f) = ups.incoming().unwrap();
        f.write_all(&tar).unwrap();
        let u = ups
            .add("alice", &p, tar.len() as u64, "d".into(), 60_000)
            .unwrap();
        assert_eq!(u.entries, 2);
        assert!(!p.exists(), "the received tar is removed");
        let (tree, _) = ups.tree("alice", &u.id).unwrap();
        assert_eq!(fs::read(tree.join("src/a.rs")).unwrap(), b"abc");
        let mode = fs::metadata(tree.join("src/a.rs"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "no setuid bit from a client");
        // Another tenant's answers as missing.
        assert!(ups.tree("bob", &u.id).is_err());
        assert_eq!(ups.list("bob"), Vec::new());

        // Hostile entries refuse the whole upload and leave nothing.
        for (kind, path) in [
            (tar::EntryType::Char, "dev"),
            (tar::EntryType::Fifo, "fifo"),
            (tar::EntryType::Regular, "../escape"),
        ] {
            let tar = tar_of(|b| {
                let mut h = header(tar::EntryType::Regular, "ok", 0o644, 0);
                h.set_cksum();
                b.append(&h, &[][..]).unwrap();
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(kind);
                // Raw name bytes: the builder refuses `..` in set_path.
                let name = h.as_old_mut().name.as_mut();
                name[..path.len()].copy_from_slice(path.as_bytes());
                h.set_mode(0o644);
                h.set_size(0);
                h.set_cksum();
                b.append(&h, &[][..]).unwrap();
            });
            let (p, mut f) = ups.incoming().unwrap();
            f.write_all(&tar).unwrap();
            let e = ups
                .add("alice", &p, tar.len() as u64, "d".into(), 60_000)
                .unwrap_err()
                .to_string();
            assert!(e.contains("refused") && e.contains(path), "{e}");
            assert!(!d.path().join("escape").exists());
        }
        // A symlink out, then entries through it or onto it: refused, the outside untouched.
        let outside = d.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o700)).unwrap();
        for second in [
            header(tar::EntryType::Regular, "l/planted", 0o644, 0),
            header(tar::EntryType::Directory, "l", 0o777, 0),
            header(tar::EntryType::Regular, "l", 0o644, 0),
        ] {
            let tar = tar_of(|b| {
                let mut h = header(tar::EntryType::Symlink, "l", 0o777, 0);
                h.set_link_name(&outside).unwrap();
                h.set_cksum();
                b.append(&h, &[][..]).unwrap();
                b.append(&second, &[][..]).unwrap();
            });
            let (p, mut f) = ups.incoming().unwrap();
            f.write_all(&tar).unwrap();
            let e = ups
                .add("alice", &p, tar.len() as u64, "d".into(), 60_000)
                .unwrap_err()
                .to_string();
            assert!(e.contains("symbolic link"), "{e}");
            assert!(!outside.join("planted").exists());
            let mode = fs::metadata(&outside).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        assert_eq!(ups.list("alice").len(), 1);
        // Expired and unused: reaped; in use: kept.
        let in_use: std::collections::HashSet<String> = [u.id.clone()].into();
        let mut all = ups.lock();
        all.get_mut(&u.id).unwrap().upload.expires_at_ms = 0;
        drop(all);
        assert!(ups.reap(&in_use).is_empty());
        assert_eq!(ups.reap(&Default::default()), vec![u.id.clone()]);
        assert!(!tree.exists());
    }
}
