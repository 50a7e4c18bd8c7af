//! Host paths no sandbox may see: taskbox's own state (the supervisor's sockets, every
//! sandbox's layers, traces, spill files and task states, the image store, the policy directory)
//! wherever it lives, and the host's bound Unix sockets.
//!
//! A sandbox with the host view sees the host's tree read-only. Read-only is not enough for a
//! Unix socket: `connect` on a pathname socket needs no write access to the file system, only to
//! the socket file, and Landlock (ABI 7) does not cover it. So the native backend masks these
//! paths in every host-view sandbox, whichever directory the sandbox's workspace is, and
//! refuses them as workspaces ([`check_workspace`]). The supervisor's own socket has a second
//! guard that does not depend on any mask: it refuses connections from inside a sandbox.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A path to hide, and what it is (for error messages).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Hidden {
    pub path: PathBuf,
    pub what: &'static str,
}

/// Directories where a root or user taskbox keeps state by default, plus what the environment
/// names (`TASKBOX_STATE_DIR`, `TASKBOX_IMAGE_DIR`, `TASKBOX_POLICY_DIR`).
fn well_known() -> Vec<(PathBuf, &'static str)> {
    let mut dirs = vec![(
        PathBuf::from("/var/lib/taskbox"),
        "taskbox's state directory",
    )];
    for (var, what) in [
        ("TASKBOX_STATE_DIR", "taskbox's state directory"),
        ("TASKBOX_IMAGE_DIR", "taskbox's image store"),
        ("TASKBOX_POLICY_DIR", "taskbox's policy directory"),
    ] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            dirs.push((PathBuf::from(v), what));
        }
    }
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        dirs.push((
            Path::new(&home).join(".local/state/taskbox"),
            "taskbox's state directory",
        ));
    }
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|h| !h.is_empty()) {
        dirs.push((Path::new(&x).join("taskbox"), "taskbox's state directory"));
    }
    dirs
}

/// taskbox's own directories and files, canonical, for a backend whose state directory is
/// `state_dir`; `extra` adds paths the caller knows of (the supervisor's socket and tokens
/// file).
pub fn taskbox_paths(state_dir: &Path, extra: &[PathBuf]) -> Vec<Hidden> {
    let mut out = BTreeSet::new();
    let named = std::iter::once((state_dir.to_path_buf(), "taskbox's state directory"))
        .chain(well_known())
        .chain(
            extra
                .iter()
                .map(|p| (p.clone(), "a file of the taskbox supervisor")),
        );
    for (path, what) in named {
        // One that does not exist yet is kept as named (absolute): it may be made later.
        match fs::canonicalize(&path) {
            Ok(path) => {
                out.insert(Hidden { path, what });
            }
            Err(_) if path.is_absolute() => {
                out.insert(Hidden { path, what });
            }
            Err(_) => {}
        }
    }
    // A path inside another is hidden with it.
    let all: Vec<Hidden> = out.into_iter().collect();
    all.iter()
        .filter(|h| {
            !all.iter()
                .any(|o| o.path != h.path && h.path.starts_with(&o.path))
        })
        .cloned()
        .collect()
}

/// Why `ws` (canonical) cannot be a workspace: it is one of `hidden`, lies inside one, or holds
/// one. `None` when it can.
pub fn check_workspace(ws: &Path, hidden: &[Hidden]) -> Option<String> {
    for h in hidden {
        if ws == h.path {
            return Some(format!("{} is {}", ws.display(), h.what));
        }
        if ws.starts_with(&h.path) {
            return Some(format!("{} is inside {}", ws.display(), h.what));
        }
        if h.path.starts_with(ws) {
            return Some(format!(
                "{} holds {} ({})",
                ws.display(),
                h.what,
                h.path.display()
            ));
        }
    }
    None
}

/// Where, beneath a state directory or image store, taskbox makes workspaces itself: a
/// replay's, an upload's, an image build step's.
const MADE_HERE: [&str; 4] = ["replays", "workspaces", "images/tmp", "tmp"];

/// The host paths to hide from a sandbox whose workspace is `ws` (canonical), for a backend
/// whose state directory is `state_dir` (plus `extra`): taskbox's own state and every bound
/// Unix socket of the host, canonical and sorted. Refuses (with the reason) a workspace that
/// is, lies inside or holds taskbox's own state, unless the backend made it itself beneath a
/// state directory or image store ([`MADE_HERE`]).
pub fn for_workspace(
    ws: &Path,
    state_dir: &Path,
    extra: &[PathBuf],
) -> Result<Vec<PathBuf>, String> {
    Ok(SocketScan(None).add_to(own_for_workspace(ws, state_dir, extra)?))
}

/// [`for_workspace`] without the host's sockets: taskbox's own state alone, after the same
/// refusals. The sockets come from a [`SocketScan`].
pub fn own_for_workspace(
    ws: &Path,
    state_dir: &Path,
    extra: &[PathBuf],
) -> Result<Vec<PathBuf>, String> {
    let own = taskbox_paths(state_dir, extra);
    for h in &own {
        let made_here = ws
            .strip_prefix(&h.path)
            .is_ok_and(|rel| MADE_HERE.iter().any(|d| rel.starts_with(d)));
        if !made_here && let Some(why) = check_workspace(ws, std::slice::from_ref(h)) {
            return Err(format!("{why}; choose a directory apart from it"));
        }
    }
    Ok(own.into_iter().map(|h| h.path).collect())
}

/// [`bound_unix_sockets`] on a thread of its own, started when a sandbox's set-up begins and
/// taken when its mount plan is made. The scan reads two links of every host process (about 300
/// `readlink`s with a hundred processes, 0.66 ms of a one-shot run's 12 on a 2-core VM), which
/// would otherwise hold up the run directory, the disk and the cgroup that need none of it.
/// The host is scanned a few milliseconds earlier than the mounts are made; a socket bound in
/// between is not masked, as one bound after the mounts never was. Dropped unfinished (a set-up
/// that failed), it waits for its thread: a one-shot run forks later, which is only safe in a
/// single-threaded process.
#[derive(Debug)]
pub struct SocketScan(Option<(Arc<Scan>, Option<std::thread::JoinHandle<()>>)>);

/// One scan of the host's sockets, shared by the set-ups that start within [`SCAN_SHARED`] of
/// it (the forks of one request start together).
#[derive(Debug, Default)]
struct Scan {
    found: Mutex<Option<Vec<PathBuf>>>,
    done: Condvar,
}

/// How long after its start a scan serves other set-ups too: a few milliseconds, the window
/// a set-up's own scan already leaves between the scan and its mounts.
const SCAN_SHARED: Duration = Duration::from_millis(20);

/// The latest scan and when it started.
static LATEST: Mutex<Option<(Instant, Arc<Scan>)>> = Mutex::new(None);

impl Scan {
    fn wait(&self) -> Vec<PathBuf> {
        let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(f) = found.as_ref() {
                return f.clone();
            }
            found = self.done.wait(found).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finish(&self, found: Vec<PathBuf>) {
        *self.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
        self.done.notify_all();
    }
}

impl SocketScan {
    /// Starts the scan (on the calling thread, later, when no thread can be made), or joins
    /// one that started within [`SCAN_SHARED`].
    pub fn start() -> SocketScan {
        let now = Instant::now();
        let mut latest = LATEST.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, scan)) = latest.as_ref()
            && now.saturating_duration_since(*at) <= SCAN_SHARED
        {
            return SocketScan(Some((scan.clone(), None)));
        }
        let scan = Arc::new(Scan::default());
        let theirs = scan.clone();
        let spawned = std::thread::Builder::new()
            .name("taskbox-sockets".into())
            .spawn(move || {
                // Whatever happens, the waiters get an answer (a second try after a panic).
                let found = std::panic::catch_unwind(bound_unix_sockets)
                    .unwrap_or_else(|_| bound_unix_sockets());
                theirs.finish(found)
            });
        let Ok(thread) = spawned else {
            return SocketScan(None);
        };
        *latest = Some((now, scan.clone()));
        SocketScan(Some((scan, Some(thread))))
    }

    /// `hidden` with the sockets found, sorted and without repeats; a scan that could not run
    /// on its own thread runs here.
    pub fn add_to(mut self, mut hidden: Vec<PathBuf>) -> Vec<PathBuf> {
        hidden.extend(match self.0.take() {
            Some((scan, thread)) => {
                // The scan's own thread is joined by the set-up that started it.
                if let Some(t) = thread {
                    let _ = t.join();
                }
                scan.wait()
            }
            None => bound_unix_sockets(),
        });
        hidden.sort();
        hidden.dedup();
        hidden
    }
}

impl Drop for SocketScan {
    fn drop(&mut self) {
        // A set-up that failed waits for its scan: a one-shot run forks later, which is only
        // safe in a single-threaded process.
        if let Some((scan, thread)) = self.0.take() {
            match thread {
                Some(t) => drop(t.join()),
                None => drop(scan.wait()),
            }
        }
    }
}

/// Of `hidden` and `denied` (the policy's deny list, as host paths), those strictly inside the
/// workspace `ws`, relative to it: what must be masked inside the workspace, where the
/// host-wide masks do not reach.
pub fn inside_workspace(
    ws: &Path,
    hidden: &[PathBuf],
    denied: impl IntoIterator<Item = PathBuf>,
) -> Vec<PathBuf> {
    let denied = denied.into_iter().filter_map(|p| fs::canonicalize(p).ok());
    let mut rel: Vec<PathBuf> = hidden
        .iter()
        .cloned()
        .chain(denied)
        .filter_map(|p| {
            p.strip_prefix(ws)
                .ok()
                .filter(|r| !r.as_os_str().is_empty())
                .map(Path::to_path_buf)
        })
        .collect();
    rel.sort();
    rel.dedup();
    rel
}

/// Creates `dir` (with its parents) and makes it its owner's alone (mode 0700). Every directory
/// that holds sandbox layers is one: a sandbox owns the files it creates and may make them setuid,
/// so no other host user may reach its layers (nor its outputs) through the host's paths.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

/// Absolute paths of the Unix sockets bound on this host: those of this process's network
/// namespace (`/proc/net/unix`), and those of any other network namespace a process in this
/// mount namespace is in (a service with a private network still binds host paths).
/// Canonical, existing, sorted. Sockets of processes in other mount namespaces (containers)
/// are named by paths of those namespaces, which say nothing of where they are on the host; a
/// container's state is on the deny list, and the host view never shows the inside of other
/// mount namespaces, so those are skipped, and only one table is read per namespace.
pub fn bound_unix_sockets() -> Vec<PathBuf> {
    let mut tables = vec![PathBuf::from("/proc/net/unix")];
    let own_net = fs::read_link("/proc/self/ns/net").ok();
    let own_mnt = fs::read_link("/proc/self/ns/mnt").ok();
    if let (Some(own_net), Some(own_mnt)) = (own_net, own_mnt)
        && let Ok(entries) = fs::read_dir("/proc")
    {
        let mut seen = BTreeSet::from([own_net]);
        for e in entries.flatten() {
            let name = e.file_name();
            if !name
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            {
                continue;
            }
            let dir = e.path();
            // The mount namespace first: most processes of a busy host are sandboxes', in
            // mount namespaces of their own, and one look skips each.
            if fs::read_link(dir.join("ns/mnt")).ok().as_ref() != Some(&own_mnt) {
                continue;
            }
            let Ok(net) = fs::read_link(dir.join("ns/net")) else {
                continue;
            };
            if seen.contains(&net) {
                continue;
            }
            seen.insert(net);
            tables.push(dir.join("net/unix"));
        }
    }
    // A socket with several connections is listed once per connection: each path is resolved
    // once.
    let named: BTreeSet<PathBuf> = tables
        .iter()
        .filter_map(|t| fs::read_to_string(t).ok())
        .flat_map(|text| parse_unix_table(&text))
        .collect();
    let mut out = BTreeSet::new();
    for path in named {
        if let Ok(c) = fs::canonicalize(&path)
            && fs::symlink_metadata(&c).is_ok_and(|m| {
                use std::os::unix::fs::FileTypeExt;
                m.file_type().is_socket()
            })
        {
            out.insert(c);
        }
    }
    out.into_iter().collect()
}

/// The absolute paths in a `/proc/net/unix` table (abstract and unnamed sockets have none).
fn parse_unix_table(text: &str) -> Vec<PathBuf> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode Path: the path is the rest of the line.
            let mut rest = line.trim_start();
            for _ in 0..7 {
                let (_, tail) = rest.split_once(char::is_whitespace)?;
                rest = tail.trim_start();
            }
            rest.starts_with('/').then(|| PathBuf::from(rest))
        })
        .collect()
}

/// Removes a directory tree, making directories writable where the overlay left them without
/// permissions (its work directory is mode 000). Best effort: what cannot be removed stays.
///
/// std's `remove_dir_all` goes first (the usual tree goes at its speed). Where it fails (a
/// directory without permissions, or a tree deeper than its descriptor per level allows: a
/// sandbox can nest directories deeper than a path can name), a walk that keeps one
/// descriptor, of the directory it is in, goes down by name and back up by `..`, and remembers
/// on the heap only the names still to visit, making each directory writable on its way.
/// Nothing else writes to the tree meanwhile (its sandbox is gone), so `..` is the directory
/// it came from.
pub fn remove_tree(dir: &Path) {
    if fs::remove_dir_all(dir).is_ok() {
        return;
    }
    remove_tree_by_descriptor(dir);
}

/// The walk of [`remove_tree`] (see there).
fn remove_tree_by_descriptor(dir: &Path) {
    use nix::dir::{Dir, Type};
    use nix::fcntl::{AtFlags, OFlag};
    use nix::sys::stat::{FchmodatFlags, Mode, fchmodat};
    use nix::unistd::{UnlinkatFlags, unlinkat};

    /// Removes the files of the directory `here` and returns its subdirectories.
    fn clear(here: &mut Dir) -> Vec<OsString> {
        let fd = here.as_raw_fd();
        let mut subdirs = Vec::new();
        for entry in here.iter().flatten() {
            let name = OsStr::from_bytes(entry.file_name().to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            let is_dir = match entry.file_type() {
                Some(t) => t == Type::Directory,
                None => nix::sys::stat::fstatat(Some(fd), name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR),
            };
            if is_dir {
                subdirs.push(name.to_os_string());
            } else {
                let _ = unlinkat(Some(fd), name, UnlinkatFlags::NoRemoveDir);
            }
        }
        subdirs
    }

    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let writable = |at: Option<i32>, name: &OsStr| {
        let _ = fchmodat(at, name, Mode::S_IRWXU, FchmodatFlags::NoFollowSymlink);
    };
    writable(None, dir.as_os_str());
    let Ok(mut here) = Dir::open(dir, flags, Mode::empty()) else {
        // Not a directory (or gone): removed as a file, if it is one.
        let _ = fs::remove_file(dir);
        return;
    };
    // The directories entered, each with the subdirectories its parent still holds to visit.
    let mut path: Vec<(OsString, Vec<OsString>)> = Vec::new();
    let mut pending = clear(&mut here);
    loop {
        let fd = here.as_raw_fd();
        if let Some(name) = pending.pop() {
            writable(Some(fd), &name);
            // One that cannot be opened is left as it is; its parent's removal fails in turn.
            if let Ok(down) = Dir::openat(Some(fd), name.as_os_str(), flags, Mode::empty()) {
                path.push((name, std::mem::take(&mut pending)));
                here = down;
                pending = clear(&mut here);
            }
            continue;
        }
        // Everything here is gone: up, and remove it there.
        let Some((name, rest)) = path.pop() else {
            break;
        };
        let Ok(up) = Dir::openat(Some(fd), "..", flags, Mode::empty()) else {
            return;
        };
        here = up;
        let _ = unlinkat(
            Some(here.as_raw_fd()),
            name.as_os_str(),
            UnlinkatFlags::RemoveDir,
        );
        pending = rest;
    }
    drop(here);
    let _ = fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_deeper_than_a_path_and_a_stack_is_removed_without_following_links() {
        use nix::sys::stat::{Mode, mkdirat};
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), "keep").unwrap();
        let root = tmp.path().join("tree");
        fs::create_dir(&root).unwrap();
        // 30,000 levels, each made relative to the last: deeper than a path can name, and than
        // std's remove_dir_all can go on a small stack or with one descriptor per level.
        let mut here = fs::File::open(&root).unwrap();
        for level in 0..30_000 {
            let fd = here.as_raw_fd();
            mkdirat(Some(fd), "d", Mode::S_IRWXU).unwrap();
            if level % 5000 == 0 {
                let f = nix::fcntl::openat(
                    Some(fd),
                    "f",
                    nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_WRONLY,
                    Mode::S_IRUSR,
                )
                .unwrap();
                nix::unistd::close(f).unwrap();
                nix::unistd::symlinkat(&outside, Some(fd), "link").unwrap();
            }
            let down = nix::fcntl::openat(
                Some(fd),
                "d",
                nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
                Mode::empty(),
            )
            .unwrap();
            // SAFETY: openat returned a new descriptor that nothing else owns.
            here = unsafe { std::os::fd::FromRawFd::from_raw_fd(down) };
        }
        // A directory without permissions, as the overlay's work directory is, holding a file:
        // std's remove_dir_all cannot open it without root.
        mkdirat(Some(here.as_raw_fd()), "shut", Mode::S_IRWXU).unwrap();
        let shut = nix::fcntl::openat(
            Some(here.as_raw_fd()),
            "shut",
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        nix::sys::stat::mkdirat(Some(shut), "inner", Mode::S_IRWXU).unwrap();
        nix::sys::stat::fchmod(shut, Mode::empty()).unwrap();
        nix::unistd::close(shut).unwrap();
        drop(here);
        let target = root.clone();
        // The walk remove_tree falls back on (std's remove_dir_all runs out of an unprivileged
        // user's descriptors at this depth), on a quarter of a worker's stack.
        std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(move || remove_tree_by_descriptor(&target))
            .unwrap()
            .join()
            .unwrap();
        assert!(!root.exists());
        assert_eq!(fs::read_to_string(outside.join("keep")).unwrap(), "keep");
    }

    #[test]
    fn unix_tables_give_named_sockets_only() {
        let t = "Num       RefCount Protocol Flags    Type St Inode Path\n\
                 0000000000000000: 00000002 00000000 00010000 0001 01 23093 /run/a b.sock\n\
                 0000000000000000: 00000002 00000000 00010000 0001 01 23094 @abstract\n\
                 0000000000000000: 00000003 00000000 00000000 0001 03 23095\n";
        assert_eq!(parse_unix_table(t), vec![PathBuf::from("/run/a b.sock")]);
    }

    #[test]
    fn a_listening_socket_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let found = bound_unix_sockets();
        assert!(
            found.contains(&fs::canonicalize(&path).unwrap()),
            "{found:?}"
        );
    }

    /// The tests that start scans, one at a time (under `cargo test` they share a process, and
    /// one counts the scans' threads).
    static SCANS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_scan_on_its_own_thread_finds_a_listening_socket() {
        let _one = SCANS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let found = SocketScan::start().add_to(Vec::new());
        assert!(
            found.contains(&fs::canonicalize(&path).unwrap()),
            "{found:?}"
        );
    }

    #[test]
    fn a_scan_dropped_unfinished_leaves_no_thread_behind() {
        let _one = SCANS.lock().unwrap_or_else(|e| e.into_inner());
        // The scan's threads of this process, by name.
        fn scans() -> usize {
            fs::read_dir("/proc/self/task")
                .unwrap()
                .flatten()
                .filter(|t| {
                    fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim() == "taskbox-sockets")
                })
                .count()
        }
        // Dropped while its thread runs: seen by name first (the thread names itself when it
        // starts; a scan can take a millisecond or so).
        let scan = SocketScan::start();
        let since = std::time::Instant::now();
        while scans() == 0 && since.elapsed() < std::time::Duration::from_secs(1) {}
        drop(scan);
        assert_eq!(scans(), 0, "a scan's thread outlived its SocketScan");
    }

    #[test]
    fn a_socket_bound_in_another_network_namespace_of_this_mount_namespace_is_found() {
        // A service with a private network (here: `unshare -rn`, which keeps the mount
        // namespace) binds a host path that a sandbox could otherwise connect to.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("private-net.sock");
        let script = format!(
            "import socket,sys,time\ns=socket.socket(socket.AF_UNIX)\ns.bind({:?})\n\
             s.listen()\nprint('up',flush=True)\ntime.sleep(30)",
            path.to_str().unwrap()
        );
        let child = std::process::Command::new("unshare")
            .args(["-rn", "python3", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            taskbox_workspace::testutil::skip("unshare or python3 is missing");
            return;
        };
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        );
        if line.trim() != "up" {
            let _ = child.kill();
            let _ = child.wait();
            taskbox_workspace::testutil::skip(
                "no network namespace could be made here (unshare -rn failed)",
            );
            return;
        }
        let found = bound_unix_sockets();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found.contains(&fs::canonicalize(&path).unwrap()),
            "{found:?}"
        );
    }

    #[test]
    fn workspaces_never_touch_hidden_paths() {
        let hidden = vec![Hidden {
            path: PathBuf::from("/srv/state"),
            what: "taskbox's state directory",
        }];
        assert!(check_workspace(Path::new("/srv/state"), &hidden).is_some());
        assert!(check_workspace(Path::new("/srv/state/sandboxes/x"), &hidden).is_some());
        let why = check_workspace(Path::new("/srv"), &hidden).unwrap();
        assert!(why.contains("holds taskbox's state directory"), "{why}");
        assert!(check_workspace(Path::new("/srv/other"), &hidden).is_none());
        assert!(check_workspace(Path::new("/srv/stateful"), &hidden).is_none());
    }

    #[test]
    fn nested_paths_collapse_into_the_outer_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        fs::create_dir_all(state.join("images")).unwrap();
        let found = taskbox_paths(&state, &[state.join("images")]);
        let canon = fs::canonicalize(&state).unwrap();
        assert!(found.iter().any(|h| h.path == canon), "{found:?}");
        assert!(
            !found.iter().any(|h| h.path == canon.join("images")),
            "{found:?}"
        );
    }
}
