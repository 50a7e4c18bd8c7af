//! Resident memory of a process and of its descendants, from /proc.

use std::collections::{BTreeMap, HashMap};
use std::fs;

use serde_json::{Value, json};

/// A `kB` field of /proc/PID/status (e.g. `VmRSS`), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    kib_field(
        &fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        field,
    )
}

/// The proportional set size (shared pages divided among their users), in KiB.
pub fn pss_kib(pid: u32) -> Option<u64> {
    kib_field(
        &fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?,
        "Pss",
    )
}

fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// (comm, parent pid) of every process.
fn processes() -> HashMap<u32, (String, u32)> {
    let mut out = HashMap::new();
    let Ok(dir) = fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "PID (COMM) STATE PPID ..."; COMM may contain spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_string();
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        out.insert(pid, (comm, ppid));
    }
    out
}

/// The descendants of `root` (not `root` itself), grouped by command name: how many, and the sum
/// of their VmRSS and of their PSS in KiB.
pub fn descendants(root: u32) -> BTreeMap<String, (u64, u64, u64)> {
    let procs = processes();
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (pid, (_, ppid)) in &procs {
        children.entry(*ppid).or_default().push(*pid);
    }
    let mut groups: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    let mut stack = children.get(&root).cloned().unwrap_or_default();
    while let Some(pid) = stack.pop() {
        if let Some(kids) = children.get(&pid) {
            stack.extend(kids);
        }
        let Some((comm, _)) = procs.get(&pid) else {
            continue;
        };
        let g = groups.entry(comm.clone()).or_default();
        g.0 += 1;
        g.1 += status_kib(pid, "VmRSS").unwrap_or(0);
        g.2 += pss_kib(pid).unwrap_or(0);
    }
    groups
}

/// A snapshot of `pid`'s memory and its descendants', as JSON (MiB).
pub fn snapshot(pid: u32) -> Value {
    let mib = |k: Option<u64>| k.map(|k| k as f64 / 1024.0);
    let kids: Vec<Value> = descendants(pid)
        .into_iter()
        .map(|(comm, (n, rss, pss))| {
            json!({
                "comm": comm,
                "count": n,
                "rss_mib": rss as f64 / 1024.0,
                "pss_mib": pss as f64 / 1024.0,
            })
        })
        .collect();
    json!({
        "rss_mib": mib(status_kib(pid, "VmRSS")),
        "hwm_mib": mib(status_kib(pid, "VmHWM")),
        "pss_mib": mib(pss_kib(pid)),
        "threads": status_kib(pid, "Threads"),
        "descendants": kids,
    })
}
