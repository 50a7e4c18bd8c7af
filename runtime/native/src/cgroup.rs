//! Resource limits by cgroup: v2 where the host has a unified hierarchy with the controllers we
//! need, v1 controllers where that is what the host has; `None` when neither can be used (an
//! unprivileged caller without a delegated cgroup), and the caller falls back to rlimits.
//!
//! Each run gets its own cgroup, nested beneath the caller's own, so limits compose with whatever
//! confines the caller.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ROOT: &str = "/sys/fs/cgroup";

/// The limits to apply.
#[derive(Debug, Clone, Copy)]
pub struct CgroupLimits {
    pub memory_bytes: u64,
    pub pids: u64,
    pub cpu_cores: f64,
}

/// A run's cgroup, in whichever hierarchy the host offers.
#[derive(Debug)]
pub enum Cgroup {
    /// One directory in the unified hierarchy.
    V2 { dir: PathBuf },
    /// One directory per v1 controller (memory, pids, cpu, cpuacct).
    V1 {
        memory: PathBuf,
        others: Vec<PathBuf>,
    },
}

/// Why a cgroup could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// writing a cgroup file failed
    #[error("cannot write {path}: {source}")]
    Write { path: String, source: io::Error },
    /// creating a cgroup directory failed
    #[error("cannot create cgroup {path}: {source}")]
    Create { path: String, source: io::Error },
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.display().to_string(),
        source,
    })
}

fn mkdir(path: &Path) -> Result<(), CgroupError> {
    fs::create_dir(path).map_err(|source| CgroupError::Create {
        path: path.display().to_string(),
        source,
    })
}

/// The caller's own cgroup path for `controller` ("" for the unified hierarchy).
fn own_path(controller: &str) -> Option<String> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controller.is_empty() && controllers.is_empty() {
            return Some(path.to_string());
        }
        if !controller.is_empty() && controllers.split(',').any(|c| c == controller) {
            return Some(path.to_string());
        }
    }
    None
}

fn writable(dir: &Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_ok()
}

impl Cgroup {
    /// Creates the cgroup for run `name` with `limits`, or returns `Ok(None)` when this host
    /// offers no cgroup the caller may use.
    pub fn create(name: &str, limits: CgroupLimits) -> Result<Option<Cgroup>, CgroupError> {
        if let Some(cg) = Self::create_v2(name, limits)? {
            return Ok(Some(cg));
        }
        Self::create_v1(name, limits)
    }

    fn create_v2(name: &str, limits: CgroupLimits) -> Result<Option<Cgroup>, CgroupError> {
        let root = Path::new(ROOT);
        if !root.join("cgroup.controllers").exists() {
            return Ok(None);
        }
        let Some(own) = own_path("") else {
            return Ok(None);
        };
        let parent = root.join(own.trim_start_matches('/'));
        let enabled = fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
        let has = |c: &str| enabled.split_whitespace().any(|x| x == c);
        if !(has("memory") && has("pids")) {
            // Enabling controllers for children of a cgroup that holds processes is refused by
            // the kernel; a caller that wants cgroup limits runs in a delegated leaf-free cgroup.
            let _ = fs::write(parent.join("cgroup.subtree_control"), "+memory +pids +cpu");
            let enabled =
                fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
            let ok = ["memory", "pids"]
                .iter()
                .all(|c| enabled.split_whitespace().any(|x| x == *c));
            if !ok {
                return Ok(None);
            }
        }
        if !writable(&parent) {
            return Ok(None);
        }
        let dir = parent.join(format!("taskbox-{name}"));
        mkdir(&dir)?;
        let cg = Cgroup::V2 { dir: dir.clone() };
        let applied = (|| {
            write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
            if dir.join("memory.swap.max").exists() {
                write(&dir.join("memory.swap.max"), "0")?;
            }
            write(&dir.join("pids.max"), &limits.pids.to_string())?;
            if dir.join("cpu.max").exists() {
                let period = 100_000u64;
                let quota = ((limits.cpu_cores * period as f64) as u64).max(1000);
                write(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
            }
            Ok(())
        })();
        if let Err(e) = applied {
            cg.remove();
            return Err(e);
        }
        Ok(Some(cg))
    }

    fn create_v1(name: &str, limits: CgroupLimits) -> Result<Option<Cgroup>, CgroupError> {
        let dir_for = |controller: &str| -> Option<PathBuf> {
            let mount = Path::new(ROOT).join(controller);
            if !mount.join("cgroup.procs").exists() {
                return None;
            }
            let own = own_path(controller)?;
            let parent = mount.join(own.trim_start_matches('/'));
            writable(&parent).then(|| parent.join(format!("taskbox-{name}")))
        };
        let (Some(memory), Some(pids)) = (dir_for("memory"), dir_for("pids")) else {
            return Ok(None);
        };
        let mut made = Vec::new();
        let result = (|| {
            mkdir(&memory)?;
            made.push(memory.clone());
            write(
                &memory.join("memory.limit_in_bytes"),
                &limits.memory_bytes.to_string(),
            )?;
            let memsw = memory.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                write(&memsw, &limits.memory_bytes.to_string())?;
            }
            mkdir(&pids)?;
            made.push(pids.clone());
            write(&pids.join("pids.max"), &limits.pids.to_string())?;
            // Each v1 controller joined costs the caller a cgroup migration (an RCU grace
            // period): CPU bandwidth is only set up when it limits anything.
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            if limits.cpu_cores < cpus
                && let Some(cpu) = dir_for("cpu")
            {
                mkdir(&cpu)?;
                made.push(cpu.clone());
                let period = 100_000u64;
                let quota = ((limits.cpu_cores * period as f64) as u64).max(1000);
                write(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
                write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
            Ok(())
        })();
        let cg = Cgroup::V1 {
            memory: memory.clone(),
            others: made.iter().filter(|d| **d != memory).cloned().collect(),
        };
        if let Err(e) = result {
            cg.remove();
            return Err(e);
        }
        Ok(Some(cg))
    }

    /// The cgroup an earlier process created for run `name`, if it is still there.
    pub fn existing(name: &str) -> Option<Cgroup> {
        let leaf = format!("taskbox-{name}");
        if Path::new(ROOT).join("cgroup.controllers").exists() {
            let own = own_path("")?;
            let dir = Path::new(ROOT)
                .join(own.trim_start_matches('/'))
                .join(&leaf);
            return dir.is_dir().then_some(Cgroup::V2 { dir });
        }
        let dir_for = |controller: &str| -> Option<PathBuf> {
            let own = own_path(controller)?;
            let d = Path::new(ROOT)
                .join(controller)
                .join(own.trim_start_matches('/'))
                .join(&leaf);
            d.is_dir().then_some(d)
        };
        let memory = dir_for("memory")?;
        let others = ["pids", "cpu", "cpuacct"]
            .iter()
            .filter_map(|c| dir_for(c))
            .filter(|d| *d != memory)
            .collect();
        Some(Cgroup::V1 { memory, others })
    }

    /// "cgroup-v2" or "cgroup-v1", as reported in `enforcement.limits`.
    pub fn kind(&self) -> &'static str {
        match self {
            Cgroup::V2 { .. } => "cgroup-v2",
            Cgroup::V1 { .. } => "cgroup-v1",
        }
    }

    fn dirs(&self) -> Vec<&Path> {
        match self {
            Cgroup::V2 { dir } => vec![dir.as_path()],
            Cgroup::V1 { memory, others } => std::iter::once(memory.as_path())
                .chain(others.iter().map(PathBuf::as_path))
                .collect(),
        }
    }

    /// The `cgroup.procs` files a process writes its pid to in order to join.
    /// The files a process writes `0` to in order to move itself into this cgroup: v1's per-thread
    /// `tasks` (the helper that joins is single-threaded, so its one thread is the whole process;
    /// moving a single thread spares the kernel's global threadgroup lock, whose first writer
    /// waits a whole RCU grace period), v2's `cgroup.procs`.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let name = match self {
            Cgroup::V2 { .. } => "cgroup.procs",
            Cgroup::V1 { .. } => "tasks",
        };
        self.dirs().into_iter().map(|d| d.join(name)).collect()
    }

    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// The kernel's OOM killer killed a process of this cgroup.
    pub fn oom_killed(&self) -> bool {
        self.oom_kills() > 0
    }

    /// The file that counts the cgroup's OOM kills.
    fn oom_file(&self) -> PathBuf {
        match self {
            Cgroup::V2 { dir } => dir.join("memory.events"),
            Cgroup::V1 { memory, .. } => memory.join("memory.oom_control"),
        }
    }

    /// How many processes of this cgroup the kernel's OOM killer has killed.
    pub fn oom_kills(&self) -> u64 {
        fs::read_to_string(self.oom_file())
            .ok()
            .map_or(0, |t| oom_kills_in(&t))
    }

    /// The OOM-kill counter kept open, for a reading before and after every exec: a read by
    /// position instead of a path walk, an open and a close each time. None when the file
    /// cannot be opened (then [`oom_kills`](Self::oom_kills) reads 0 too).
    pub fn oom_counter(&self) -> Option<OomCounter> {
        fs::File::open(self.oom_file()).ok().map(OomCounter)
    }

    /// Peak memory use of the cgroup, when the kernel reports it.
    pub fn peak_memory(&self) -> Option<u64> {
        let file = match self {
            Cgroup::V2 { dir } => dir.join("memory.peak"),
            Cgroup::V1 { memory, .. } => memory.join("memory.max_usage_in_bytes"),
        };
        fs::read_to_string(file).ok()?.trim().parse().ok()
    }

    fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for f in self.procs_files() {
            if let Ok(text) = fs::read_to_string(f) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Kills every process in the cgroup and waits (up to `wait`) until it is empty.
    pub fn kill_all(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            if let Cgroup::V2 { dir } = self {
                let _ = fs::write(dir.join("cgroup.kill"), "1");
            }
            let pids = self.pids();
            if pids.is_empty() || Instant::now() >= deadline {
                return;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Removes the cgroup directories (after `kill_all`). Best effort: a failure leaves an empty
    /// cgroup that the next start-up sweep removes.
    pub fn remove(&self) {
        for dir in self.dirs() {
            for _ in 0..50 {
                match fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        }
    }
}

/// An open OOM-kill counter of a cgroup (see [`Cgroup::oom_counter`]).
#[derive(Debug)]
pub struct OomCounter(fs::File);

impl OomCounter {
    /// The kills counted now (0 when the file cannot be read, as [`Cgroup::oom_kills`]).
    pub fn kills(&self) -> u64 {
        use std::os::unix::fs::FileExt;
        // Both files are a few short lines; the kernel makes them anew for a read at 0.
        let mut buf = [0u8; 1024];
        let mut len = 0;
        while len < buf.len() {
            match self.0.read_at(&mut buf[len..], len as u64) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return 0,
            }
        }
        std::str::from_utf8(&buf[..len]).map_or(0, oom_kills_in)
    }
}

/// The `oom_kill N` line of `memory.events` (v2) or `memory.oom_control` (v1).
fn oom_kills_in(text: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some("oom_kill")).then(|| it.next()?.parse::<u64>().ok())?
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn the_oom_counter_reads_the_file_anew_each_time() {
        assert_eq!(
            oom_kills_in("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(oom_kills_in("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\n"), 1);
        assert_eq!(oom_kills_in("garbage"), 0);
        let dir = std::env::temp_dir().join(format!("taskbox-oom-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("memory.events");
        fs::write(&file, "oom 0\noom_kill 0\n").unwrap();
        let counter = OomCounter(fs::File::open(&file).unwrap());
        assert_eq!(counter.kills(), 0);
        // The same open file, rewritten in place (as the kernel regenerates it): read again.
        fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .write_all_at(b"oom 1\noom_kill 1\n", 0)
            .unwrap();
        assert_eq!(counter.kills(), 1);
        assert_eq!(counter.kills(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
