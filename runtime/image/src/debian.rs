//! Debian bases: mmdebstrap, a shared .deb cache, pinning from the lock, and normalisation.
//!
//! mmdebstrap runs with `SOURCE_DATE_EPOCH` set to the image's epoch. Package sources are
//! `$TASKBOX_DEBIAN_MIRROR` (a sources file, a one-line `deb ...` entry or a mirror URI) or
//! else the host's own apt sources that name the suite; no mirror is built in.
//!
//! Downloaded .debs are kept in the store's `debs/` directory (mmdebstrap's `sync-in` and
//! `sync-out` hooks, with `--skip=download/empty`), so a second clean build downloads nothing.
//!
//! Pinning: with a lock, every locked package gets an apt preference (`Pin: version V`, priority
//! 1001) for the duration of the build, and afterwards the installed set must equal the locked
//! one exactly; a difference is an error naming the packages.
//!
//! Normalisation removes what differs between two builds or two machines and has no use in a
//! sandbox: device nodes (the sandbox gets its own /dev), the host's resolv.conf and hostname
//! (copied in by mmdebstrap), apt sources (they name a mirror), the pin file and the build's own
//! apt and dpkg options, apt's lists and downloaded archives, machine-id, and apt's
//! auto-installed marks (which differ between a pinned and an unpinned resolution). It also
//! creates the default workdir.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::def::{DEFAULT_VARIANT, Debian};
use crate::sys::{FileLock, LockMode};
use crate::{ImageError, io_err};

/// Lines of mmdebstrap's output kept for an error message.
const KEEP_LINES: usize = 60;

/// Paths (relative to the root) removed after mmdebstrap; a trailing `/*` empties a directory.
const REMOVE: &[&str] = &[
    "dev/*",
    "etc/resolv.conf",
    "etc/hostname",
    "etc/machine-id",
    "var/lib/dbus/machine-id",
    "etc/apt/sources.list",
    "etc/apt/sources.list.d/*",
    "etc/apt/preferences.d/taskbox-lock",
    // The build's own apt and dpkg options (retries, unsafe io), not the image's.
    "etc/apt/apt.conf.d/99mmdebstrap",
    "etc/dpkg/dpkg.cfg.d/99mmdebstrap",
    "var/lib/apt/extended_states",
    "var/lib/apt/lists/*",
    "var/cache/apt/archives/*",
    "var/cache/apt/pkgcache.bin",
    "var/cache/apt/srcpkgcache.bin",
    "var/cache/ldconfig/aux-cache",
    "var/log/dpkg.log",
    "var/log/alternatives.log",
    "var/log/bootstrap.log",
    "var/log/apt/*",
];

/// What a Debian bootstrap needs.
#[derive(Debug)]
pub struct Bootstrap<'a> {
    pub spec: &'a Debian,
    /// Locked package versions to install exactly.
    pub pins: Option<&'a BTreeMap<String, String>>,
    pub epoch: u64,
    /// The shared .deb cache.
    pub debs: &'a Path,
    /// Scratch directory for the pin file.
    pub scratch: &'a Path,
    /// Where the root filesystem is made (must not exist).
    pub target: &'a Path,
}

/// The mirror arguments for mmdebstrap: `$TASKBOX_DEBIAN_MIRROR`, else the host's apt source
/// files that name `suite`.
pub fn mirrors(suite: &str) -> Result<Vec<String>, ImageError> {
    if let Ok(m) = std::env::var("TASKBOX_DEBIAN_MIRROR")
        && !m.trim().is_empty()
    {
        return Ok(vec![m]);
    }
    let mut files: Vec<PathBuf> = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(rd) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
            .collect();
        more.sort();
        files.extend(more);
    }
    let mut out = Vec::new();
    for f in files {
        let Ok(text) = fs::read_to_string(&f) else {
            continue;
        };
        let names_suite = text.lines().any(|l| {
            let l = l.trim();
            !l.starts_with('#') && l.split_whitespace().any(|w| w == suite)
        });
        if names_suite {
            out.push(f.display().to_string());
        }
    }
    if out.is_empty() {
        return Err(ImageError::Invalid(format!(
            "no apt source on this host names the suite {suite:?}: set TASKBOX_DEBIAN_MIRROR to a \
             sources file, a `deb ...` line or a mirror URI"
        )));
    }
    Ok(out)
}

fn quote(path: &Path) -> Result<String, ImageError> {
    let s = path.display().to_string();
    if s.contains(['\'', '\n']) {
        return Err(ImageError::Invalid(format!(
            "{s}: the state directory's path cannot contain quotes or newlines (mmdebstrap hooks \
             are shell commands)"
        )));
    }
    Ok(format!("'{s}'"))
}

/// Runs mmdebstrap into `b.target`, normalises the tree, and returns the installed packages.
/// `output` receives mmdebstrap's progress lines.
pub fn bootstrap(
    b: &Bootstrap<'_>,
    output: &dyn Fn(String),
) -> Result<BTreeMap<String, String>, ImageError> {
    let variant = b.spec.variant.as_deref().unwrap_or(DEFAULT_VARIANT);
    let mirrors = mirrors(&b.spec.suite)?;
    fs::create_dir_all(b.debs).map_err(io_err(format!("cannot create {}", b.debs.display())))?;
    fs::create_dir_all(b.scratch)
        .map_err(io_err(format!("cannot create {}", b.scratch.display())))?;
    let debs = quote(b.debs)?;
    let mut cmd = Command::new("mmdebstrap");
    cmd.env("SOURCE_DATE_EPOCH", b.epoch.to_string())
        .env("LC_ALL", "C.UTF-8")
        .arg(format!(
            "--mode={}",
            if nix::unistd::geteuid().is_root() {
                "root"
            } else {
                "unshare"
            }
        ))
        .arg(format!("--variant={variant}"))
        .arg("--skip=download/empty")
        .arg("--skip=essential/unlink")
        .arg("--aptopt=Acquire::Retries \"3\"")
        // No fsync per unpacked file: a build that dies is thrown away anyway.
        .arg("--dpkgopt=force-unsafe-io");
    if !b.spec.packages.is_empty() {
        cmd.arg(format!("--include={}", b.spec.packages.join(",")));
    }
    if let Some(pins) = b.pins {
        let mut prefs = String::new();
        for (name, version) in pins {
            let pkg = name.split(':').next().unwrap_or(name);
            prefs.push_str(&format!(
                "Package: {pkg}\nPin: version {version}\nPin-Priority: 1001\n\n"
            ));
        }
        let file = b.scratch.join("taskbox-lock");
        fs::write(&file, prefs).map_err(io_err(format!("cannot write {}", file.display())))?;
        cmd.arg(format!(
            "--setup-hook=mkdir -p \"$1\"/etc/apt/preferences.d && cp {} \"$1\"/etc/apt/preferences.d/taskbox-lock",
            quote(&file)?
        ));
    }
    cmd.arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
        .arg(format!(
            "--setup-hook=sync-in {debs} /var/cache/apt/archives/"
        ))
        .arg(format!(
            "--customize-hook=sync-out /var/cache/apt/archives {debs}"
        ))
        .arg(&b.spec.suite)
        .arg(b.target)
        .args(&mirrors)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());

    // One build at a time fills the shared cache.
    let _debs_lock = FileLock::acquire(&b.debs.join(".lock"), LockMode::Exclusive)
        .map_err(io_err(format!("cannot lock {}", b.debs.display())))?;
    tracing::info!(suite = %b.spec.suite, variant, "running mmdebstrap");
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImageError::Invalid(
                "mmdebstrap is not installed (Debian bases need it: apt-get install mmdebstrap)"
                    .into(),
            )
        } else {
            io_err("cannot start mmdebstrap")(e)
        }
    })?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        }));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        }));
    }
    drop(tx);
    let mut tail: VecDeque<String> = VecDeque::new();
    for line in rx {
        if line.starts_with("I: ") || line.starts_with("E: ") || line.starts_with("W: ") {
            output(line.clone());
        }
        if tail.len() == KEEP_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(io_err("cannot wait for mmdebstrap"))?;
    if !status.success() {
        let lines: Vec<String> = tail.into_iter().collect();
        let mut message = format!("mmdebstrap exited with {status}:\n{}", lines.join("\n"));
        if b.pins.is_some()
            && lines
                .iter()
                .any(|l| l.contains("ersion") || l.contains("held"))
        {
            message.push_str(
                "\n(the lock pins package versions; if the mirror no longer offers them, \
                 rebuild with --update-lock)",
            );
        }
        return Err(ImageError::StepFailed {
            step: "base".into(),
            message,
        });
    }
    normalise(b.target)?;
    let installed = installed_packages(b.target)?;
    if let Some(pins) = b.pins {
        check_pins(pins, &installed)?;
    }
    Ok(installed)
}

/// Removes the non-reproducible and machine-specific files listed in [`REMOVE`], and creates the
/// default workdir.
pub fn normalise(root: &Path) -> Result<(), ImageError> {
    for rel in REMOVE {
        if let Some(dir) = rel.strip_suffix("/*") {
            let d = root.join(dir);
            let Ok(rd) = fs::read_dir(&d) else { continue };
            for e in rd.flatten() {
                let p = e.path();
                // apt expects these to exist.
                if e.file_name() == "partial" {
                    continue;
                }
                remove_any(&p)?;
            }
        } else {
            remove_any(&root.join(rel))?;
        }
    }
    let workdir = root.join(taskbox_core::image::DEFAULT_WORKDIR.trim_start_matches('/'));
    if !workdir.exists() {
        fs::create_dir(&workdir).map_err(io_err(format!("cannot create {}", workdir.display())))?;
    }
    Ok(())
}

fn remove_any(p: &Path) -> Result<(), ImageError> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            fs::remove_dir_all(p).map_err(io_err(format!("cannot remove {}", p.display())))
        }
        Ok(_) => fs::remove_file(p).map_err(io_err(format!("cannot remove {}", p.display()))),
        Err(_) => Ok(()),
    }
}

/// The installed packages of a root (from dpkg's status file): name (with `:arch` when it is
/// not the native or `all` architecture) -> version.
pub fn installed_packages(root: &Path) -> Result<BTreeMap<String, String>, ImageError> {
    let p = root.join("var/lib/dpkg/status");
    let text = fs::read_to_string(&p).map_err(io_err(format!("cannot read {}", p.display())))?;
    Ok(parse_status(&text, crate::oci::architecture()))
}

fn parse_status(text: &str, native: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for para in text.split("\n\n") {
        let (mut name, mut version, mut arch, mut status) = (None, None, None, None);
        for line in para.lines() {
            if let Some(v) = line.strip_prefix("Package: ") {
                name = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Version: ") {
                version = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Architecture: ") {
                arch = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Status: ") {
                status = Some(v.trim());
            }
        }
        if let (Some(n), Some(v), Some("install ok installed")) = (name, version, status) {
            let key = match arch {
                Some(a) if a != native && a != "all" => format!("{n}:{a}"),
                _ => n.to_owned(),
            };
            out.insert(key, v.to_owned());
        }
    }
    out
}

fn check_pins(
    pins: &BTreeMap<String, String>,
    installed: &BTreeMap<String, String>,
) -> Result<(), ImageError> {
    let mut problems = Vec::new();
    for (name, want) in pins {
        match installed.get(name) {
            Some(got) if got == want => {}
            Some(got) => problems.push(format!("{name} {got} (locked {want})")),
            None => problems.push(format!("{name} missing (locked {want})")),
        }
    }
    let extra: BTreeSet<&String> = installed
        .keys()
        .filter(|k| !pins.contains_key(*k))
        .collect();
    for name in extra {
        problems.push(format!("{name} {} (not in the lock)", installed[name]));
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(ImageError::StepFailed {
        step: "base".into(),
        message: format!(
            "the installed packages differ from the lock: {}; the mirror no longer offers the \
             locked versions: rebuild with --update-lock to take the current ones",
            problems.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_parsing_keeps_installed_packages_only() {
        let text = "Package: bash\nStatus: install ok installed\nArchitecture: amd64\nVersion: 5.2\n\n\
                    Package: gone\nStatus: deinstall ok config-files\nArchitecture: amd64\nVersion: 1\n\n\
                    Package: tzdata\nStatus: install ok installed\nArchitecture: all\nVersion: 2024a\n\n\
                    Package: libc6\nStatus: install ok installed\nArchitecture: i386\nVersion: 2.36\n";
        let p = parse_status(text, "amd64");
        assert_eq!(p.len(), 3);
        assert_eq!(p["bash"], "5.2");
        assert_eq!(p["tzdata"], "2024a");
        assert_eq!(p["libc6:i386"], "2.36");
    }

    #[test]
    fn pins_must_match_exactly() {
        let pins = BTreeMap::from([("a".to_string(), "1".to_string()), ("b".into(), "2".into())]);
        let ok = pins.clone();
        assert!(check_pins(&pins, &ok).is_ok());
        let moved = BTreeMap::from([
            ("a".to_string(), "1".to_string()),
            ("b".into(), "3".into()),
            ("c".into(), "1".into()),
        ]);
        let err = check_pins(&pins, &moved).unwrap_err().to_string();
        assert!(
            err.contains("b 3 (locked 2)") && err.contains("c 1 (not in the lock)"),
            "{err}"
        );
        assert!(err.contains("--update-lock"), "{err}");
    }

    #[test]
    fn normalise_removes_machine_specific_files() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        for d in [
            "etc/apt/sources.list.d",
            "var/lib/apt/lists/partial",
            "dev",
            "var/log/apt",
        ] {
            fs::create_dir_all(r.join(d)).unwrap();
        }
        for f in [
            "etc/resolv.conf",
            "etc/hostname",
            "etc/apt/sources.list.d/0000x.sources",
            "var/lib/apt/lists/lock",
            "var/log/apt/history.log",
            "etc/passwd",
        ] {
            fs::write(r.join(f), "x").unwrap();
        }
        std::os::unix::fs::symlink("/proc/self/fd", r.join("dev/fd")).unwrap();
        normalise(r).unwrap();
        assert!(!r.join("etc/resolv.conf").exists());
        assert!(!r.join("etc/hostname").exists());
        assert_eq!(
            fs::read_dir(r.join("etc/apt/sources.list.d"))
                .unwrap()
                .count(),
            0
        );
        assert_eq!(fs::read_dir(r.join("dev")).unwrap().count(), 0);
        assert!(r.join("var/lib/apt/lists/partial").is_dir());
        assert!(!r.join("var/lib/apt/lists/lock").exists());
        assert!(r.join("etc/passwd").exists());
        assert!(r.join("workspace").is_dir());
    }
}
