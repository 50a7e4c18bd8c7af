//! An exec's findings, the same for every backend: its stdout and stderr go through the readers
//! of `taskbox-findings` as they arrive (the captures of its slot read them: every byte, past
//! the cut of the text and the cap of the spill file too), and once its result is made the JUnit
//! XML files it wrote in the workspace are read.
//!
//! Nothing here changes the exec's outcome: a report that cannot be read gives no findings. A
//! JUnit file is read through no symlink (one pointing out of the workspace, or anywhere, is not
//! followed), as the sandbox's user, at most [`MAX_REPORT`] bytes, at most [`MAX_REPORTS`] of
//! them.

use std::path::Path;

use taskbox_findings::{Findings, Paths};

use crate::fsops::WorkspaceFs;
use crate::result::{Change, ChangeKind, ExecResult};
use crate::{Common, Handle, fsuser};

/// The largest JUnit XML file read (bytes).
pub const MAX_REPORT: u64 = 32 * 1024 * 1024;
/// Most JUnit XML files read for one exec.
pub const MAX_REPORTS: usize = 64;

/// Whether findings are read: unless `TASKBOX_FINDINGS=off` is set in the supervisor's
/// environment (a switch for measuring what reading them costs, and for an operator who would
/// rather not pay it; docs/findings.md).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("TASKBOX_FINDINGS").as_deref(),
            Ok("off" | "0" | "false" | "no")
        )
    })
}

/// Where the files of an exec's findings are located: its working directory `cwd` (absolute,
/// inside the sandbox) and the workspace, as the sandbox sees it and at its host path. `None`
/// when findings are not read ([`enabled`]).
pub fn paths<P>(common: &Common<P>, cwd: &str) -> Option<Paths> {
    if !enabled() {
        return None;
    }
    let mut paths = Paths::new(&common.exec_base.workdir, cwd);
    let host = common.layers.host.display().to_string();
    if !paths.roots.contains(&host) {
        paths.roots.push(host);
    }
    Some(paths)
}

/// Puts in `result` the findings its streams' readers gave (`streams`, `None` when they did not
/// read), with those of the JUnit XML files among its changes (`result.changes` and `ignored`,
/// those left out of the result), read as the sandbox's user.
pub fn add<H: Handle>(
    sb: &H,
    result: &mut ExecResult,
    streams: Option<Findings>,
    paths: Option<&Paths>,
    ignored: &[Change],
) {
    let (Some(mut found), Some(paths)) = (streams, paths) else {
        return;
    };
    let reports = reports(result, ignored);
    if !reports.is_empty() {
        let common = sb.common();
        let _ = sb.with_fs(|fs| {
            fsuser::as_user(&common.user, None, || {
                read_reports(fs, &reports, paths, &mut found);
                Ok(())
            })
        });
    }
    put(result, found);
}

/// As [`add`] for a one-shot run, whose reports are read from the run's upper layer `upper`
/// (when it had one).
pub fn add_to_run(
    result: &mut ExecResult,
    streams: Option<Findings>,
    paths: &Paths,
    upper: Option<&Path>,
    ignored: &[Change],
) {
    let Some(mut found) = streams else { return };
    let reports = reports(result, ignored);
    if let Some(upper) = upper
        && !reports.is_empty()
        && let Ok(fs) = WorkspaceFs::open(upper)
    {
        read_reports(&fs, &reports, paths, &mut found);
    }
    put(result, found);
}

/// The findings of two streams read apart, stdout's first.
pub fn both(stdout: Option<Findings>, stderr: Option<Findings>) -> Option<Findings> {
    match (stdout, stderr) {
        (Some(mut a), Some(b)) => {
            a.merge(b, false);
            Some(a)
        }
        (a, b) => a.or(b),
    }
}

/// The files of the exec that may be JUnit XML reports: added or modified `.xml` files, shown
/// or ignored.
fn reports(result: &ExecResult, ignored: &[Change]) -> Vec<String> {
    result
        .changes
        .iter()
        .chain(ignored)
        .filter(|c| c.kind != ChangeKind::Deleted && c.path.ends_with(".xml"))
        .map(|c| c.path.clone())
        .take(MAX_REPORTS)
        .collect()
}

fn read_reports(fs: &WorkspaceFs, reports: &[String], paths: &Paths, found: &mut Findings) {
    for path in reports {
        if let Some(xml) = fs.read_plain(path, MAX_REPORT) {
            found.merge_report(taskbox_findings::junit::read_junit(&xml, paths));
        }
    }
}

/// Puts `found` in `result`.
pub fn put(result: &mut ExecResult, found: Findings) {
    result.findings = found.findings;
    result.findings_omitted = found.omitted;
    result.tests = found.tests;
}
