//! Builds the sandbox's mount tree on the new root and pivots into it.

use std::fs;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, symlink};
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::config::{MountOp, RootPlan};
use crate::{idmap, sys};

/// A mount step that failed, with the path it failed on.
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {source}")]
pub struct MountError {
    what: &'static str,
    path: String,
    source: io::Error,
}

fn err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> MountError {
    let path = path.display().to_string();
    move |source| MountError { what, path, source }
}

fn nix_err(what: &'static str, path: &Path) -> impl FnOnce(nix::Error) -> MountError {
    let path = path.display().to_string();
    move |e| MountError {
        what,
        path,
        source: io::Error::from(e),
    }
}

/// Joins a sandbox path onto the new root.
fn inside(new_root: &Path, dst: &Path) -> PathBuf {
    let rel = dst.strip_prefix("/").unwrap_or(dst);
    new_root.join(rel)
}

/// Mounts made by the helper before it entered any namespace: for the [`MountOp::BindOwned`]
/// ops and the overlays with a `lower_map`, by their index in the plan; and, with an id range,
/// the root's lower layers idmapped with the commands' namespace, by path.
#[derive(Default)]
pub struct Prepared {
    ops: Vec<(usize, OwnedFd)>,
    lowers: Vec<(PathBuf, OwnedFd)>,
}

/// Makes what the plan needs made in the host's namespaces (see [`MountOp::BindOwned`] and
/// [`MountOp::Overlay`]); `range_ns`, the commands' user namespace of a root-run sandbox, maps
/// the layers of an image root (so its root-owned files are the sandbox root's).
pub fn prepare(
    root: &RootPlan,
    ops: &[MountOp],
    range_ns: Option<BorrowedFd<'_>>,
) -> Result<Prepared, MountError> {
    let mut made = Prepared::default();
    for (i, op) in ops.iter().enumerate() {
        match op {
            MountOp::BindOwned { src, uid, gid, .. } => {
                let tree = idmap::owned_bind(src, *uid, *gid)
                    .map_err(err("cannot make an idmapped mount of", src))?;
                made.ops.push((i, tree));
            }
            MountOp::Overlay {
                lower,
                lower_map: Some(map),
                ..
            } => {
                let tree = idmap::owner_bind(lower, map)
                    .map_err(err("cannot make an idmapped mount of", lower))?;
                made.ops.push((i, tree));
            }
            _ => {}
        }
    }
    if let (RootPlan::Layers { lower, .. }, Some(ns)) = (root, range_ns) {
        for l in lower {
            let tree =
                idmap::mapped_tree(l, ns).map_err(err("cannot make an idmapped mount of", l))?;
            made.lowers.push((l.clone(), tree));
        }
    }
    Ok(made)
}

/// Builds the whole tree: the root (the host's view read-only, or an image's layers), then each
/// op in order, then pivot_root.
pub fn build(
    new_root: &Path,
    root: &RootPlan,
    ops: &[MountOp],
    mut prepared: Prepared,
) -> Result<(), MountError> {
    // Nothing we do here may propagate back to the host's mount namespace.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(nix_err("cannot make mounts private on", Path::new("/")))?;
    // The idmapped layers go on top of their own paths, in this namespace only: the root's
    // layers and the workspace's lower layer (a restore's remount names the same paths).
    for (path, tree) in prepared.lowers.drain(..) {
        idmap::attach(&tree, &path).map_err(err("cannot attach a mount on", &path))?;
    }
    for (i, op) in ops.iter().enumerate() {
        if let MountOp::Overlay {
            lower,
            lower_map: Some(_),
            ..
        } = op
            && let Some(at) = prepared.ops.iter().position(|(j, _)| *j == i)
        {
            let (_, tree) = prepared.ops.swap_remove(at);
            idmap::attach(&tree, lower).map_err(err("cannot attach a mount on", lower))?;
        }
    }
    match root {
        RootPlan::Host => {
            mount(
                Some("/"),
                new_root,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(nix_err("cannot bind the host root on", new_root))?;
            sys::make_tree_readonly(new_root, false)
                .map_err(err("cannot make read-only", new_root))?;
        }
        RootPlan::Layers { lower, upper, work } => mount_layers(new_root, lower, upper, work)?,
    }

    for (i, op) in ops.iter().enumerate() {
        match op {
            MountOp::BindOwned { dst, .. } => {
                let target = inside(new_root, dst);
                let at = prepared.ops.iter().position(|(j, _)| *j == i);
                let Some((_, tree)) = at.map(|at| prepared.ops.swap_remove(at)) else {
                    return Err(MountError {
                        what: "no prepared mount for",
                        path: target.display().to_string(),
                        source: io::Error::from(io::ErrorKind::NotFound),
                    });
                };
                idmap::attach(&tree, &target).map_err(err("cannot attach a mount on", &target))?;
            }
            op => apply(new_root, op)?,
        }
    }

    pivot(new_root)
}

/// Mounts an image's layers on `new_root`: a read-only overlay of `lower`, or with `upper` and
/// `work` a writable one whose changes land in `upper`.
fn mount_layers(
    new_root: &Path,
    lower: &[PathBuf],
    upper: &Option<PathBuf>,
    work: &Option<PathBuf>,
) -> Result<(), MountError> {
    let invalid = |why: &str| MountError {
        what: "invalid root layers for",
        path: new_root.display().to_string(),
        source: io::Error::new(io::ErrorKind::InvalidInput, why.to_string()),
    };
    let lowers: Vec<String> = lower.iter().map(|l| l.display().to_string()).collect();
    if lowers.is_empty() {
        return Err(invalid("no lower layer"));
    }
    // userxattr: the overlay's own attributes (opaque directories, redirects) are `user.overlay.*`
    // in every mode, as for the workspace overlay, so a layer means the same as root and rootless.
    let mut data = format!("lowerdir={},userxattr", lowers.join(":"));
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    match (upper, work) {
        (Some(upper), Some(work)) => {
            // volatile: the upper layer of a build step is read right after the step or thrown
            // away; a crash mid-step leaves no layer anybody uses.
            data.push_str(&format!(
                ",upperdir={},workdir={},volatile",
                upper.display(),
                work.display()
            ));
        }
        (None, None) => flags |= MsFlags::MS_RDONLY,
        _ => {
            return Err(invalid(
                "an upper layer needs a work directory and vice versa",
            ));
        }
    }
    mount(
        Some("overlay"),
        new_root,
        Some("overlay"),
        flags,
        Some(data.as_str()),
    )
    .map_err(nix_err("cannot mount the image root on", new_root))
}

fn bind(src: &Path, dst: &Path, readonly: bool) -> Result<(), MountError> {
    mount(
        Some(src),
        dst,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(nix_err("cannot bind-mount onto", dst))?;
    if readonly {
        sys::make_tree_readonly(dst, false).map_err(err("cannot make read-only", dst))?;
    }
    Ok(())
}

/// Carries out one op with `new_root` as the sandbox's root ("/" once pivoted).
pub fn apply(new_root: &Path, op: &MountOp) -> Result<(), MountError> {
    match op {
        MountOp::Tmpfs {
            dst,
            mode,
            size_bytes,
        } => {
            let target = inside(new_root, dst);
            let mut data = format!("mode={mode:o}");
            if let Some(size) = size_bytes {
                data.push_str(&format!(",size={size}"));
            }
            mount(
                Some("tmpfs"),
                &target,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(data.as_str()),
            )
            .map_err(nix_err("cannot mount tmpfs on", &target))
        }
        MountOp::Bind { src, dst, readonly } => bind(src, &inside(new_root, dst), *readonly),
        // Only `build` has the helper's prepared mounts.
        MountOp::BindOwned { dst, .. } => Err(MountError {
            what: "an idmapped mount is only made at set-up, not on",
            path: dst.display().to_string(),
            source: io::Error::from(io::ErrorKind::Unsupported),
        }),
        MountOp::ProtectReadOnly { dst } => {
            let target = inside(new_root, dst);
            if fs::symlink_metadata(&target).is_err() {
                return Ok(());
            }
            bind(&target, &target, true)
        }
        MountOp::Mask { dst, empty } => {
            let target = inside(new_root, dst);
            let Ok(md) = fs::symlink_metadata(&target) else {
                return Ok(());
            };
            if md.is_dir() {
                mount(
                    Some("tmpfs"),
                    &target,
                    Some("tmpfs"),
                    MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                    Some("mode=000,size=4k"),
                )
                .map_err(nix_err("cannot mask", &target))?;
                sys::make_tree_readonly(&target, true)
                    .map_err(err("cannot make read-only", &target))
            } else if md.file_type().is_symlink() {
                // The runtime canonicalises what it masks; a symlink here was planted after
                // planning and is left alone rather than followed.
                Ok(())
            } else {
                bind(empty, &target, true)
            }
        }
        MountOp::Overlay {
            lower,
            upper,
            work,
            dst,
            lower_map: _,
        } => {
            let target = inside(new_root, dst);
            let data = format!(
                // volatile: the upper layer belongs to one sandbox and never outlives a crash
                // of it, so overlayfs need not sync it (no fsync per copy-up, no syncfs at
                // unmount); a work directory is never reused after a volatile mount.
                "lowerdir={},upperdir={},workdir={},userxattr,volatile",
                lower.display(),
                upper.display(),
                work.display()
            );
            mount(
                Some("overlay"),
                &target,
                Some("overlay"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(data.as_str()),
            )
            .map_err(nix_err("cannot mount the workspace overlay on", &target))
        }
        MountOp::Proc { dst } => {
            let target = inside(new_root, dst);
            mount(
                Some("proc"),
                &target,
                Some("proc"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                None::<&str>,
            )
            .map_err(nix_err("cannot mount proc on", &target))
        }
        MountOp::Devpts { dst } => {
            let target = inside(new_root, dst);
            mount(
                Some("devpts"),
                &target,
                Some("devpts"),
                MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
                Some("newinstance,ptmxmode=0666,mode=0620"),
            )
            .map_err(nix_err("cannot mount devpts on", &target))
        }
        MountOp::Dir { dst, mode } => {
            let target = inside(new_root, dst);
            fs::DirBuilder::new()
                .recursive(true)
                .mode(*mode)
                .create(&target)
                .map_err(err("cannot create directory", &target))
        }
        MountOp::File { dst } => {
            let target = inside(new_root, dst);
            if let Some(parent) = target.parent() {
                fs::create_dir_all(parent).map_err(err("cannot create directory", parent))?;
            }
            fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&target)
                .map(drop)
                .map_err(err("cannot create file", &target))
        }
        MountOp::Symlink { target, dst } => {
            let link = inside(new_root, dst);
            symlink(target, &link).map_err(err("cannot create symlink", &link))
        }
        MountOp::RemountReadOnly { dst } => {
            let target = inside(new_root, dst);
            sys::make_mount_readonly(&target).map_err(err("cannot make read-only", &target))
        }
    }
}

fn pivot(new_root: &Path) -> Result<(), MountError> {
    std::env::set_current_dir(new_root).map_err(err("cannot enter", new_root))?;
    // pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves only
    // the new tree (the trick of pivot_root(8)'s manual, used by runc and bubblewrap).
    sys::pivot_root(Path::new("."), Path::new("."))
        .map_err(err("cannot pivot_root to", new_root))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(nix_err("cannot detach the old root", new_root))?;
    std::env::set_current_dir("/").map_err(err("cannot enter", Path::new("/")))?;
    Ok(())
}
