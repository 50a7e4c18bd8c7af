//! How the native backend gives a sandbox an image as its root (the contract with the image
//! store is [`crate::image`]).
//!
//! - **Root.** An overlay of two read-only layers: on top a small *scaffold* the run owns, holding
//!   every directory the sandbox mounts something on (`/proc`, `/dev`, `/tmp`, `/run`, the
//!   workdir, ...), and below it the image's rootfs. The rootfs is never written and so can be
//!   shared by every sandbox of the image; the scaffold supplies mount points the image may lack,
//!   and because a directory in a higher layer hides whatever a lower one has at that name, no
//!   mount point of the plan can lead through a symlink of the image. In build mode (the image
//!   builder's `run` steps) the overlay gets an upper layer, which collects the step's changes.
//! - **Workspace** at the image's workdir (default `/workspace`); commands start there.
//! - **Identity.** The image's `UID[:GID]` is what commands see; on the host they keep the
//!   caller's identity: a user namespace maps the image's uid and gid onto the caller's (the
//!   only ids it maps), so files the caller owns (the workspace, its upper layer) belong to the
//!   image's user inside. Root without an image user stays uid 0 without capabilities.
//! - **Environment.** The image's variables (and `HOME` from the image's `/etc/passwd`) replace
//!   host variables that name host paths.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use taskbox_protocol::config::{IdRange, RootPlan};

use crate::accounts::{PasswdEntry, parse_passwd};
use crate::api::ReadRequest;
use crate::fsops::WorkspaceFs;
use crate::image::ImageRoot;

/// Why an image cannot be a sandbox's root.
#[derive(Debug, thiserror::Error)]
pub enum ImageViewError {
    /// the image's config or paths are unusable
    #[error("image {digest}: {why}")]
    Invalid { digest: String, why: String },
    /// the scaffold of mount points cannot be prepared
    #[error("cannot prepare the root of image {digest} in {path}: {source}")]
    Scaffold {
        digest: String,
        path: String,
        source: io::Error,
    },
}

/// Who the commands are: whether they get a user namespace, and which ids the caller's uid and
/// gid appear as inside it (`None`: themselves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) user_namespace: bool,
    pub(crate) inner_uid: Option<u32>,
    pub(crate) inner_gid: Option<u32>,
    /// A root-run long-lived sandbox's ids ([`Identity::in_range`]): the commands are
    /// `inner_uid`:`inner_gid` (0 when unset) of a user namespace of their own that maps the
    /// sandbox's ids onto this range of unprivileged host ids.
    pub(crate) id_range: Option<IdRange>,
}

/// The host ids a root-run taskbox gives its sandboxes' ids (0..65536 inside): within the
/// range systemd sets aside for containers' ids (524288..1879048192), so no host account has
/// them. Every sandbox has the same range: their layers keep the same owners whichever sandbox
/// wrote them (a checkpoint restores into another sandbox as it was), and sandboxes cannot meet
/// otherwise (each has its own mount, pid, IPC and network namespaces).
pub(crate) const ID_RANGE: IdRange = IdRange {
    base: 0x6000_0000,
    size: 65536,
};

impl Identity {
    /// The host view's identity: a user namespace mapping the caller to itself unless root.
    pub(crate) fn host_view(is_root: bool) -> Identity {
        Identity {
            user_namespace: !is_root,
            inner_uid: None,
            inner_gid: None,
            id_range: None,
        }
    }

    /// Run by root: the same ids inside, in a namespace of the sandbox's own over
    /// [`ID_RANGE`], so that no command is a host id that owns anything (root inside
    /// included).
    pub(crate) fn in_range(self) -> Identity {
        Identity {
            user_namespace: false,
            inner_uid: Some(self.inner_uid.unwrap_or(0)),
            inner_gid: Some(self.inner_gid.unwrap_or(0)),
            id_range: Some(ID_RANGE),
        }
    }

    /// The capabilities (numbers) of `policy` that a command running as uid 0 keeps: only where
    /// uid 0 is not the host's root (a user namespace, or an id range of the sandbox's own).
    pub(crate) fn root_capabilities(&self, policy: &crate::policy::Policy) -> Vec<u32> {
        if !self.user_namespace && self.id_range.is_none() {
            return Vec::new();
        }
        let caps = &policy.security.root_capabilities;
        caps.iter().map(|c| c.number()).collect()
    }

    /// The host ids of the commands' default user when they have a range of their own.
    pub(crate) fn ranged_user(&self) -> Option<(u32, u32)> {
        let range = self.id_range?;
        Some((
            range.host(self.inner_uid.unwrap_or(0))?,
            range.host(self.inner_gid.unwrap_or(0))?,
        ))
    }

    /// Who the commands are on the host, whatever ids they see: the one place their kernel
    /// credentials come from, for the helper's user namespace maps (its `uid` and `gid`) and
    /// for the file operations the supervisor makes as the sandbox's user. Today the caller's
    /// own ids and groups (a user namespace maps the sandbox's user onto them; as root,
    /// without one, uid 0 with no capability).
    pub(crate) fn host_user(&self) -> taskbox_kit::SandboxUser {
        match self.ranged_user() {
            Some((uid, gid)) => taskbox_kit::SandboxUser {
                uid,
                gid,
                groups: Vec::new(),
            },
            None => taskbox_kit::SandboxUser::of_this_process(),
        }
    }

    /// With an image that names `user` (uid, gid): those ids mapped onto the caller's. Root asked
    /// to be root needs no namespace.
    fn for_image(is_root: bool, user: Option<(u32, u32)>) -> Identity {
        match user {
            None => Identity::host_view(is_root),
            Some((0, 0)) if is_root => Identity::host_view(true),
            Some((uid, gid)) => Identity {
                user_namespace: true,
                inner_uid: Some(uid),
                inner_gid: Some(gid),
                id_range: None,
            },
        }
    }
}

/// An image prepared to be a sandbox's root.
#[derive(Debug, Clone)]
pub(crate) struct ImageView {
    pub(crate) image: ImageRoot,
    /// Where the workspace is mounted inside, and where commands start.
    pub(crate) workdir: PathBuf,
    pub(crate) identity: Identity,
    /// `HOME` when the image's env does not set it: the user's home in the image's
    /// `/etc/passwd`, else `/`.
    home: String,
}

impl ImageView {
    /// Checks `image` and works out the identity and home of its commands; `is_root`: whether
    /// the caller is root.
    pub(crate) fn new(image: &ImageRoot, is_root: bool) -> Result<ImageView, ImageViewError> {
        let invalid = |why: String| ImageViewError::Invalid {
            digest: image.digest.clone(),
            why,
        };
        let workdir = check_workdir(&image.config.workdir).map_err(invalid)?;
        check_option_path("rootfs", &image.rootfs).map_err(invalid)?;
        if !image.rootfs.is_absolute() || !image.rootfs.is_dir() {
            return Err(invalid(format!(
                "rootfs {} is not a directory",
                image.rootfs.display()
            )));
        }
        if image.config.shell.is_empty() {
            return Err(invalid("the image config names no shell".into()));
        }
        let passwd = read_passwd(&image.rootfs);
        let user = match &image.config.user {
            None => None,
            Some(u) => {
                let (uid, gid) = parse_user(u).map_err(invalid)?;
                let gid = gid
                    .or_else(|| passwd.iter().find(|e| e.uid == uid).map(|e| e.gid))
                    .unwrap_or(0);
                Some((uid, gid))
            }
        };
        let identity = Identity::for_image(is_root, user);
        // The uid commands have inside: the image's, else the caller's own (0 for root).
        let uid = identity
            .inner_uid
            .unwrap_or_else(|| nix::unistd::geteuid().as_raw());
        let home = passwd
            .iter()
            .find(|e| e.uid == uid)
            .map(|e| e.home.clone())
            .filter(|h| h.starts_with('/'))
            .unwrap_or_else(|| "/".into());
        Ok(ImageView {
            image: image.clone(),
            workdir,
            identity,
            home,
        })
    }

    /// Whether the image has `/var/tmp` as a real directory (it then gets a private tmpfs, as
    /// with the host view).
    pub(crate) fn has_var_tmp(&self) -> bool {
        let real_dir = |rel: &str| {
            fs::symlink_metadata(self.image.rootfs.join(rel)).is_ok_and(|m| m.file_type().is_dir())
        };
        real_dir("var") && real_dir("var/tmp")
    }

    /// Every path the plan mounts something on directly in the root.
    fn mount_points(&self) -> Vec<PathBuf> {
        let mut points: Vec<PathBuf> = ["/proc", "/dev", "/tmp", "/run"]
            .iter()
            .map(PathBuf::from)
            .collect();
        if self.has_var_tmp() {
            points.push("/var/tmp".into());
        }
        points.push(self.workdir.clone());
        points
    }

    /// Creates the scaffold layer in `dir`: every mount point and its parents as directories.
    /// Directories the image has too take the image's mode (and owner, where the caller may
    /// set it), since the scaffold's copy is the one the sandbox sees.
    pub(crate) fn prepare_scaffold(&self, dir: &Path) -> Result<(), ImageViewError> {
        let fail = |path: &Path| {
            let digest = self.image.digest.clone();
            let path = path.display().to_string();
            move |source| ImageViewError::Scaffold {
                digest,
                path,
                source,
            }
        };
        fs::create_dir_all(dir).map_err(fail(dir))?;
        copy_dir_attrs(&self.image.rootfs, dir).map_err(fail(dir))?;
        for point in self.mount_points() {
            let mut rel = PathBuf::new();
            // Whether the image's path so far consists of real directories.
            let mut in_image = true;
            for c in point.components() {
                let Component::Normal(name) = c else { continue };
                rel.push(name);
                let src = self.image.rootfs.join(&rel);
                // Looked at only while every parent is a real directory: `src` then names
                // no symlink but maybe its last component, which lstat does not follow.
                in_image =
                    in_image && fs::symlink_metadata(&src).is_ok_and(|m| m.file_type().is_dir());
                let dst = dir.join(&rel);
                if !dst.is_dir() {
                    fs::create_dir(&dst).map_err(fail(&dst))?;
                    if in_image {
                        copy_dir_attrs(&src, &dst).map_err(fail(&dst))?;
                    } else {
                        fs::set_permissions(&dst, fs::Permissions::from_mode(0o755))
                            .map_err(fail(&dst))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The root overlay: the scaffold above the rootfs, read-only; or with `build` = (upper,
    /// work) writable into `upper`.
    pub(crate) fn root_plan(&self, scaffold: &Path, build: Option<(&Path, &Path)>) -> RootPlan {
        RootPlan::Layers {
            lower: vec![scaffold.to_path_buf(), self.image.rootfs.clone()],
            upper: build.map(|(u, _)| u.to_path_buf()),
            work: build.map(|(_, w)| w.to_path_buf()),
        }
    }

    /// The image's variables, with `HOME` added when the image does not set it. Host variables
    /// do not override them (see `native::compose_env`).
    pub(crate) fn base_env(&self) -> Vec<(String, String)> {
        let mut env = self.image.config.env.clone();
        if !env.iter().any(|(k, _)| k == "HOME") {
            env.push(("HOME".into(), self.home.clone()));
        }
        env
    }

    /// The shell for `shell` execs.
    pub(crate) fn shell(&self) -> &[String] {
        &self.image.config.shell
    }
}

/// Copies a directory's permission bits, and its owner where allowed (root), onto `dst`.
fn copy_dir_attrs(src: &Path, dst: &Path) -> io::Result<()> {
    let m = fs::symlink_metadata(src)?;
    fs::set_permissions(dst, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::lchown(dst, Some(m.uid()), Some(m.gid()))?;
    }
    Ok(())
}

/// Refuses paths overlay mount options cannot carry.
pub(crate) fn check_option_path(what: &str, path: &Path) -> Result<(), String> {
    let s = path.to_string_lossy();
    if s.contains([',', ':', '\\', '\n']) {
        return Err(format!(
            "{what} {s}: the path contains ',', ':' or '\\', which overlay mount options cannot \
             carry"
        ));
    }
    Ok(())
}

/// An image's workdir, normalised: absolute, without `..`, not `/`, and on the image's own
/// (read-only) root rather than on one of the sandbox's file systems.
fn check_workdir(workdir: &str) -> Result<PathBuf, String> {
    let p = Path::new(workdir);
    let bad = |why: &str| Err(format!("workdir {workdir:?} {why}"));
    if !p.is_absolute() {
        return bad("is not an absolute path");
    }
    if workdir.contains('\0') {
        return bad("contains a NUL byte");
    }
    let mut clean = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => clean.push(n),
            _ => return bad("contains '..'"),
        }
    }
    if clean == Path::new("/") {
        return bad("is the root; the workspace needs a directory of its own");
    }
    // Beneath the read-only root, nothing in the sandbox can move the workdir's parents (and
    // so redirect the supervisor's file operations or a restore's remount).
    if ["/proc", "/dev", "/tmp", "/var/tmp", "/run"]
        .iter()
        .any(|p| clean.starts_with(p))
    {
        return bad("lies in /proc, /dev, /tmp, /var/tmp or /run, which the sandbox owns");
    }
    check_option_path("workdir", &clean)?;
    Ok(clean)
}

/// `UID[:GID]`, numeric.
fn parse_user(user: &str) -> Result<(u32, Option<u32>), String> {
    let num = |s: &str| {
        s.parse::<u32>().map_err(|_| {
            format!(
                "user {user:?} is not UID[:GID] in numbers (names are resolved when the image \
                 is built)"
            )
        })
    };
    match user.split_once(':') {
        Some((u, g)) => Ok((num(u)?, Some(num(g)?))),
        None => Ok((num(user)?, None)),
    }
}

/// The image's `/etc/passwd`, resolved inside the rootfs (a symlink there cannot make taskbox
/// read a host file); empty when there is none.
fn read_passwd(rootfs: &Path) -> Vec<PasswdEntry> {
    let Ok(root) = WorkspaceFs::open(rootfs) else {
        return Vec::new();
    };
    match root.read(&ReadRequest {
        path: "etc/passwd".into(),
        max_bytes: Some(1 << 20),
        ..ReadRequest::default()
    }) {
        Ok(r) if !r.binary => parse_passwd(&r.content),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::ImageConfig;

    fn image(rootfs: &Path, config: ImageConfig) -> ImageRoot {
        ImageRoot {
            digest: format!("sha256:{}", "a".repeat(64)),
            config_digest: format!("sha256:{}", "b".repeat(64)),
            rootfs: rootfs.to_path_buf(),
            config,
        }
    }

    #[test]
    fn workdirs_must_be_plain_absolute_directories() {
        assert_eq!(
            check_workdir("/workspace").unwrap(),
            Path::new("/workspace")
        );
        assert_eq!(check_workdir("/src//app/").unwrap(), Path::new("/src/app"));
        assert_eq!(check_workdir("/./src/.").unwrap(), Path::new("/src"));
        for bad in [
            "workspace",
            "/",
            "/a/..",
            "/a/../b",
            "/proc/x",
            "/dev",
            "/tmp/work",
            "/run/x",
            "/var/tmp/x",
            "/a,b",
            "/a:b",
        ] {
            assert!(check_workdir(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn users_are_numeric() {
        assert_eq!(parse_user("1000").unwrap(), (1000, None));
        assert_eq!(parse_user("1000:100").unwrap(), (1000, Some(100)));
        for bad in ["root", "1000:users", "", ":1", "-1"] {
            assert!(parse_user(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_image_user_is_mapped_onto_the_caller() {
        assert_eq!(Identity::for_image(true, None), Identity::host_view(true));
        assert_eq!(Identity::for_image(false, None), Identity::host_view(false));
        assert_eq!(
            Identity::for_image(true, Some((0, 0))),
            Identity::host_view(true)
        );
        let mapped = Identity {
            user_namespace: true,
            inner_uid: Some(1000),
            inner_gid: Some(0),
            id_range: None,
        };
        assert_eq!(Identity::for_image(true, Some((1000, 0))), mapped);
        assert_eq!(Identity::for_image(false, Some((1000, 0))), mapped);
        let root_inside = Identity {
            user_namespace: true,
            inner_uid: Some(0),
            inner_gid: Some(0),
            id_range: None,
        };
        assert_eq!(Identity::for_image(false, Some((0, 0))), root_inside);
    }

    #[test]
    fn passwd_gives_the_group_and_home_of_a_numeric_user() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        fs::write(
            dir.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nbad line\ndev:x:1000:100::/home/dev:/bin/sh\n",
        )
        .unwrap();
        let view = |user: &str| {
            ImageView::new(
                &image(
                    dir.path(),
                    ImageConfig {
                        user: Some(user.into()),
                        ..ImageConfig::default()
                    },
                ),
                true,
            )
            .unwrap()
        };
        let v = view("1000");
        assert_eq!(
            (v.identity.inner_uid, v.identity.inner_gid),
            (Some(1000), Some(100))
        );
        assert!(v.base_env().contains(&("HOME".into(), "/home/dev".into())));
        let v = view("1000:7");
        assert_eq!(v.identity.inner_gid, Some(7));
        // Unknown to passwd: group 0 and home "/", as Docker does.
        let v = view("4242");
        assert_eq!(v.identity.inner_gid, Some(0));
        assert!(v.base_env().contains(&("HOME".into(), "/".into())));
    }

    #[test]
    fn a_passwd_symlink_to_a_host_file_is_resolved_inside_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        fs::write(
            host.path().join("passwd"),
            "x:x:4242:4242::/host-secret:/bin/sh\n",
        )
        .unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        std::os::unix::fs::symlink(host.path().join("passwd"), dir.path().join("etc/passwd"))
            .unwrap();
        let v = ImageView::new(
            &image(
                dir.path(),
                ImageConfig {
                    user: Some("4242".into()),
                    ..ImageConfig::default()
                },
            ),
            false,
        )
        .unwrap();
        assert!(v.base_env().contains(&("HOME".into(), "/".into())));
    }

    #[test]
    fn the_scaffold_holds_every_mount_point_without_following_image_symlinks() {
        let rootfs = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let r = rootfs.path();
        fs::create_dir_all(r.join("var/tmp")).unwrap();
        fs::create_dir(r.join("tmp")).unwrap();
        fs::set_permissions(r.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
        fs::create_dir(r.join("srv")).unwrap();
        fs::set_permissions(r.join("srv"), fs::Permissions::from_mode(0o711)).unwrap();
        // A symlink where the workdir's parent would be: hidden by the scaffold's directory.
        std::os::unix::fs::symlink(out.path(), r.join("home")).unwrap();
        let v = ImageView::new(
            &image(
                r,
                ImageConfig {
                    workdir: "/home/dev/work".into(),
                    ..ImageConfig::default()
                },
            ),
            false,
        )
        .unwrap();
        let s = out.path().join("scaffold");
        v.prepare_scaffold(&s).unwrap();
        for d in ["proc", "dev", "tmp", "run", "var/tmp", "home/dev/work"] {
            let m = fs::symlink_metadata(s.join(d)).unwrap();
            assert!(m.file_type().is_dir(), "{d}");
        }
        let mode = |p: &str| fs::metadata(s.join(p)).unwrap().mode() & 0o7777;
        assert_eq!(mode("tmp"), 0o1777);
        assert_eq!(mode("proc"), 0o755);
        // Nothing was created through the image's symlink.
        assert_eq!(fs::read_dir(out.path()).unwrap().count(), 1);

        let v = ImageView::new(
            &image(
                r,
                ImageConfig {
                    workdir: "/srv/app".into(),
                    ..ImageConfig::default()
                },
            ),
            false,
        )
        .unwrap();
        let s2 = out.path().join("scaffold2");
        v.prepare_scaffold(&s2).unwrap();
        assert_eq!(fs::metadata(s2.join("srv")).unwrap().mode() & 0o7777, 0o711);
    }
}
