//! An exec's findings, read once its result is made, the same for every backend: its whole
//! stdout and stderr (the text when it fit, the spill file when it did not) and the JUnit XML
//! files it wrote in the workspace go through the readers of `taskbox-findings`.
//!
//! Nothing here changes the exec's outcome: a stream or a report that cannot be read gives no
//! findings. A JUnit file is read through no symlink (one pointing out of the workspace, or
//! anywhere, is not followed), as the sandbox's user, at most [`MAX_REPORT`] bytes, at most
//! [`MAX_REPORTS`] of them.

use std::path::{Path, PathBuf};

use taskbox_findings::{Findings, Paths};

use crate::fsops::WorkspaceFs;
use crate::layers::SPILL_MOUNT;
use crate::result::{Change, ChangeKind, ExecResult, Output};
use crate::{Handle, fsuser};

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

/// Reads the findings of `result`, an exec that ran in `cwd` (absolute, inside the sandbox)
/// and whose changes were `result.changes` and `ignored` (those left out of the result), and
/// puts them in it.
pub fn add<H: Handle>(sb: &H, result: &mut ExecResult, cwd: &str, ignored: &[Change]) {
    if !enabled() {
        return;
    }
    let common = sb.common();
    let mut paths = Paths::new(&common.exec_base.workdir, cwd);
    let host = common.layers.host.display().to_string();
    if !paths.roots.contains(&host) {
        paths.roots.push(host);
    }
    let spill = &common.layers.spill;
    let mut found = read_streams(
        &result.stdout,
        &result.stderr,
        &|shown| in_spill(spill, shown),
        &paths,
    );
    let reports = reports(result, ignored);
    if !reports.is_empty() {
        let _ = sb.with_fs(|fs| {
            fsuser::as_user(&common.user, None, || {
                read_reports(fs, &reports, &paths, &mut found);
                Ok(())
            })
        });
    }
    put(result, found);
}

/// Reads the findings of a one-shot run's `result` (its spill files named as they are on the
/// host), its reports read from the run's upper layer `upper` when it had one.
pub fn add_to_run(
    result: &mut ExecResult,
    paths: &Paths,
    upper: Option<&Path>,
    ignored: &[Change],
) {
    if !enabled() {
        return;
    }
    let mut found = read_streams(
        &result.stdout,
        &result.stderr,
        &|shown| Some(PathBuf::from(shown)),
        paths,
    );
    let reports = reports(result, ignored);
    if let Some(upper) = upper
        && !reports.is_empty()
        && let Ok(fs) = WorkspaceFs::open(upper)
    {
        read_reports(&fs, &reports, paths, &mut found);
    }
    put(result, found);
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

/// The host's path of a spill file shown at `shown` (under [`SPILL_MOUNT`]) in a sandbox whose
/// spill files are in `dir`.
fn in_spill(dir: &Path, shown: &str) -> Option<PathBuf> {
    let name = Path::new(shown).strip_prefix(SPILL_MOUNT).ok()?.to_str()?;
    (!name.is_empty() && !name.contains('/')).then(|| dir.join(name))
}

type SpillPath<'a> = &'a dyn Fn(&str) -> Option<PathBuf>;

/// The findings of one exec's two streams: each read whole, from its text when it fit and
/// from its spill file when it did not (`spill` gives the host's path of a spill file from the
/// path the result shows).
pub fn read_streams(
    stdout: &Output,
    stderr: &Output,
    spill: SpillPath<'_>,
    paths: &Paths,
) -> Findings {
    let mut found = read_output(stdout, spill, paths);
    found.merge(read_output(stderr, spill, paths), false);
    found
}

fn read_output(o: &Output, spill: SpillPath<'_>, paths: &Paths) -> Findings {
    if o.bytes == 0 {
        return Findings::default();
    }
    if o.truncated
        && let Some(host) = o.spill_path.as_deref().and_then(spill)
        && let Ok(f) = std::fs::File::open(host)
    {
        return taskbox_findings::read_stream(f, paths);
    }
    // Whole, or all that is left of it (a spill file that could not be kept).
    taskbox_findings::read_bytes(o.text.as_bytes(), paths)
}

/// Puts `found` in `result`.
pub fn put(result: &mut ExecResult, found: Findings) {
    result.findings = found.findings;
    result.findings_omitted = found.omitted;
    result.tests = found.tests;
}
