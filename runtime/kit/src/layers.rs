//! A sandbox's workspace as overlay layers on the host, and the operations on them every backend
//! shares: diff, checkpoint, the staging of a restore, export, the change an exec made, and the
//! spill files of its output.
//!
//! The backends differ only in where the layers are mounted and how a restore remounts them
//! ([`crate::Handle::remount`]); the layers themselves are directories this process reaches.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::api::*;
use crate::changes;
use crate::fsops::WorkspaceFs;
use crate::hostdirs::remove_tree;
use crate::result::{AutorunFile, Change, ChangeKind};
use taskbox_workspace::layers::{self, Fingerprint};
use taskbox_workspace::review::{self, Review, TrackedFiles};

/// Where spill files of execs appear inside the sandbox (read-only).
pub const SPILL_MOUNT: &str = "/tmp/.taskbox/out";

/// The layers of one sandbox's workspace, as this process reaches them.
#[derive(Debug)]
pub struct Layers {
    /// The workspace on the host: the overlay's lower layer.
    pub host: PathBuf,
    /// The directory that holds `upper` and `work` (the sandbox's disk, when it has one): a
    /// restore stages its layers here, since a rename cannot cross file systems.
    pub disk: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub checkpoints: PathBuf,
    /// The spill files of the execs' output ([`SPILL_MOUNT`] inside).
    pub spill: PathBuf,
    /// Where `export` writes tars.
    pub exports: PathBuf,
    /// The workspace is an overlay (not the host directory itself): execs report changes.
    pub overlay: bool,
    /// The sandbox's scratch directories a fork takes with it, by the name of the disk's
    /// directory they are (`tmp`: the sandbox's `/tmp`), as this process reaches them.
    pub scratch: Vec<(String, PathBuf)>,
    /// Execs and file operations hold it shared; checkpoint and restore exclusively.
    lock: RwLock<()>,
    /// The paths the host repository tracks (which ignore rules never hide).
    tracked: TrackedFiles,
    /// The upper layer as the last exec left it, while nothing can have changed it since.
    last_end: Mutex<LastEnd>,
}

/// The fingerprint an exec ended with, kept as the next exec's baseline (see
/// [`Layers::exec_start`]): one scan of the upper layer per exec instead of two.
#[derive(Debug, Default)]
struct LastEnd {
    /// Bumped by every exec's start and at the end of every other operation on the layers: an
    /// exec keeps its end's fingerprint only when nothing of either happened since it started.
    epoch: u64,
    /// Execs started and not yet ended (background ones too).
    running: u64,
    print: Option<Fingerprint>,
}

/// What an exec's changes are measured against (from [`Layers::exec_start`], for
/// [`Layers::exec_end`]).
#[derive(Debug)]
pub struct ExecStart {
    before: Option<Fingerprint>,
    epoch: u64,
}

/// A hold on the layers, by a lock guard `G`; when it ends, the fingerprint of the last exec's
/// end no longer stands for the upper layer.
pub struct LayersGuard<'a, G> {
    _lock: G,
    layers: &'a Layers,
}

impl<G> Drop for LayersGuard<'_, G> {
    fn drop(&mut self) {
        self.layers.forget_last_end();
    }
}

/// A file operation's (or a diff's) hold on the layers: shared with execs and other
/// operations.
pub type SharedGuard<'a> = LayersGuard<'a, RwLockReadGuard<'a, ()>>;

/// Checkpoint's and restore's hold on the layers: exclusive.
pub type ExclusiveGuard<'a> = LayersGuard<'a, RwLockWriteGuard<'a, ()>>;

/// What an exec changed in the workspace, split for a reviewer ([`review`]).
#[derive(Debug, Default)]
pub struct ExecChanges {
    /// The changes its result lists.
    pub shown: Vec<Change>,
    /// The changes left out of it (ignored by git, or under `.git/`): counted in the result.
    pub ignored: Vec<Change>,
    /// The workspace holds paths too long to name beneath this directory, left out of the
    /// changes (see [`layers::Fingerprint::unnamed`]).
    pub unnamed: Option<String>,
}

impl Layers {
    pub fn new(host: PathBuf, disk: PathBuf, checkpoints: PathBuf, spill: PathBuf) -> Layers {
        Layers {
            upper: disk.join("upper"),
            work: disk.join("work"),
            host,
            disk,
            checkpoints,
            spill,
            exports: PathBuf::new(),
            overlay: true,
            scratch: Vec::new(),
            lock: RwLock::new(()),
            tracked: TrackedFiles::default(),
            last_end: Mutex::new(LastEnd::default()),
        }
    }

    /// Where `export` writes tars.
    pub fn with_exports(mut self, dir: PathBuf) -> Layers {
        self.exports = dir;
        self
    }

    /// A scratch directory a fork takes with it (see [`Layers::scratch`]).
    pub fn with_scratch(mut self, name: &str, dir: PathBuf) -> Layers {
        self.scratch.push((name.to_owned(), dir));
        self
    }

    /// Whether the workspace is an overlay whose changes execs report.
    pub fn with_overlay(mut self, overlay: bool) -> Layers {
        self.overlay = overlay;
        self
    }

    /// Shared: a file operation (or anything else but an exec, which takes
    /// [`exec_shared`](Self::exec_shared)).
    pub fn shared(&self) -> Result<SharedGuard<'_>, ApiError> {
        let lock = self.exec_shared()?;
        // From its start (an exec starting meanwhile must not take the last end's fingerprint)
        // to its end.
        self.forget_last_end();
        Ok(LayersGuard {
            _lock: lock,
            layers: self,
        })
    }

    /// Shared, for an exec: its changes are measured by [`exec_start`](Self::exec_start) and
    /// [`exec_end`](Self::exec_end).
    pub fn exec_shared(&self) -> Result<RwLockReadGuard<'_, ()>, ApiError> {
        self.lock
            .read()
            .map_err(|_| ApiError::internal("the sandbox's layer lock is poisoned"))
    }

    /// Exclusive: no exec or file operation of the API changes the upper layer meanwhile.
    pub fn exclusive(&self) -> Result<ExclusiveGuard<'_>, ApiError> {
        let lock = self
            .lock
            .write()
            .map_err(|_| ApiError::internal("the sandbox's layer lock is poisoned"))?;
        self.forget_last_end();
        Ok(LayersGuard {
            _lock: lock,
            layers: self,
        })
    }

    fn forget_last_end(&self) {
        let mut last = crate::lock(&self.last_end);
        last.epoch += 1;
        last.print = None;
    }

    /// Before an exec: the upper layer's fingerprint ([`fingerprint`](Self::fingerprint)), or
    /// the one the last exec ended with when nothing can have changed the layer since: no exec
    /// ran or started after it, and no file operation, checkpoint or restore ended. Processes
    /// of the sandbox change the layer only within an exec (each ends with its exec's main
    /// process, background ones are execs too), so that fingerprint is the layer as it is now.
    /// Every `exec_start` must be followed by [`exec_end`](Self::exec_end) or
    /// [`exec_abandoned`](Self::exec_abandoned).
    pub fn exec_start(&self) -> Result<ExecStart, ApiError> {
        if !self.overlay {
            return Ok(ExecStart {
                before: None,
                epoch: 0,
            });
        }
        let (epoch, kept) = {
            let mut last = crate::lock(&self.last_end);
            last.epoch += 1;
            last.running += 1;
            (last.epoch, last.print.take())
        };
        let before = match kept {
            Some(print) => print,
            None => match layers::fingerprint(&self.upper) {
                Ok(print) => print,
                Err(e) => {
                    crate::lock(&self.last_end).running -= 1;
                    return Err(layers_err(e));
                }
            },
        };
        Ok(ExecStart {
            before: Some(before),
            epoch,
        })
    }

    /// An exec started with `start` never ran (it could not be started).
    pub fn exec_abandoned(&self, start: ExecStart) {
        if start.before.is_some() {
            crate::lock(&self.last_end).running -= 1;
        }
    }

    /// After an exec, once every process of it is gone: what it changed since `start`, split
    /// for a reviewer. Its fingerprint of the layer is kept for the next exec when no other
    /// exec ran meanwhile and nothing else ended.
    pub fn exec_end(&self, start: ExecStart) -> Result<ExecChanges, ApiError> {
        let Some(before) = start.before else {
            return Ok(ExecChanges::default());
        };
        let after = layers::fingerprint(&self.upper).map_err(layers_err);
        let mut last = crate::lock(&self.last_end);
        last.running -= 1;
        let after = after?;
        let keep = last.epoch == start.epoch && last.running == 0;
        drop(last);
        let list =
            layers::exec_changes(&before, &after, &self.upper, &self.host).map_err(layers_err)?;
        let unnamed = unnamed_of(&after);
        if keep {
            let mut last = crate::lock(&self.last_end);
            // Checked again: an operation that ended while the changes were classified.
            if last.epoch == start.epoch && last.running == 0 {
                last.print = Some(after);
            }
        }
        self.exec_changes(list, unnamed)
    }

    /// The changes `list` of an exec, split for a reviewer.
    fn exec_changes(
        &self,
        list: Vec<Change>,
        unnamed: Option<String>,
    ) -> Result<ExecChanges, ApiError> {
        if list.is_empty() {
            return Ok(ExecChanges {
                unnamed,
                ..ExecChanges::default()
            });
        }
        let r = self.review(list)?;
        Ok(ExecChanges {
            shown: r.shown,
            ignored: r.ignored,
            unnamed,
        })
    }

    /// A fingerprint of the upper layer taken before an exec (cost: the size of the change so
    /// far, not of the workspace); `None` when the workspace is not an overlay.
    pub fn fingerprint(&self) -> Result<Option<Fingerprint>, ApiError> {
        if !self.overlay {
            return Ok(None);
        }
        layers::fingerprint(&self.upper)
            .map(Some)
            .map_err(layers_err)
    }

    /// What changed in the workspace since `before` was taken (nothing without one), split
    /// for a reviewer.
    pub fn changes_since(&self, before: Option<&Fingerprint>) -> Result<ExecChanges, ApiError> {
        let Some(before) = before else {
            return Ok(ExecChanges::default());
        };
        let after = layers::fingerprint(&self.upper).map_err(layers_err)?;
        let list =
            layers::exec_changes(before, &after, &self.upper, &self.host).map_err(layers_err)?;
        self.exec_changes(list, unnamed_of(&after))
    }

    /// A file the exec added or changed (shown or not) has the size of the per-file limit: a
    /// write past it failed (see [`reached_file_size`]).
    pub fn reached_file_size(&self, changes: &ExecChanges, limit: u64) -> bool {
        reached_file_size(&self.upper, &changes.shown, limit)
            || reached_file_size(&self.upper, &changes.ignored, limit)
    }

    /// `changes` of the upper layer split for a reviewer.
    fn review(&self, changes: Vec<Change>) -> Result<Review, ApiError> {
        review::review(&self.upper, &self.host, changes, &self.tracked).map_err(changes_err)
    }

    fn checkpoint_dir(&self, name: &str) -> Result<PathBuf, ApiError> {
        Ok(self.checkpoints.join(checkpoint_name(name)?))
    }

    /// The layer of an existing checkpoint.
    fn existing_checkpoint(&self, name: &str) -> Result<PathBuf, ApiError> {
        let dir = self.checkpoint_dir(name)?;
        if !dir.is_dir() {
            return Err(ApiError::not_found(format!(
                "checkpoint {name} does not exist"
            )));
        }
        Ok(dir)
    }

    /// Reads an exec's spill file when `req` names one under [`SPILL_MOUNT`]; None for any
    /// other path.
    pub fn read_spill(&self, req: &ReadRequest) -> Option<Result<ReadResult, ApiError>> {
        read_spill(&self.spill, req)
    }

    pub fn diff(&self, req: &DiffRequest) -> Result<DiffResult, ApiError> {
        let _g = self.shared()?;
        let since = match &req.since {
            None => None,
            Some(name) => Some(self.existing_checkpoint(name)?),
        };
        let scanned = match since.as_deref() {
            None => changes::scan(&self.upper, &self.host).map_err(changes_err)?,
            Some(base) => {
                layers::scan_between(&self.host, base, &self.upper).map_err(layers_err)?
            }
        };
        let review = self.review(scanned)?;
        let ignored: BTreeSet<String> = review.ignored.iter().map(|c| c.path.clone()).collect();
        let (list, flagged) = listing(review, req.include_ignored);
        let mut result = layer_diff(&self.host, &self.upper, since.as_deref(), &list)?;
        for f in &mut result.files {
            f.ignored = ignored.contains(&f.path);
        }
        result.ignored = ignored.len() as u64;
        result.flagged = flagged;
        Ok(result)
    }

    /// Copies the upper layer to a new checkpoint and lists it in `info`.
    pub fn checkpoint(
        &self,
        req: CheckpointRequest,
        info: &Mutex<SandboxInfo>,
    ) -> Result<CheckpointInfo, ApiError> {
        let dir = self.checkpoint_dir(&req.name)?;
        let _g = self.exclusive()?;
        let files = take_checkpoint(&self.host, &self.upper, &dir, &req.name)?;
        crate::lock(info).checkpoints.push(req.name.clone());
        Ok(CheckpointInfo {
            name: req.name,
            created_at_ms: crate::now_ms(),
            files,
        })
    }

    /// What forks start from: a copy of the upper layer and the scratch directories as they are
    /// now, made in `dir` (which must not exist) while the layers are held exclusively (no exec
    /// or file operation of the API runs meanwhile; a background process may still write), or,
    /// with `checkpoint`, that checkpoint's layer as it is (and no scratch: a checkpoint holds
    /// the workspace only). O(changes) either way.
    pub fn freeze(&self, dir: &Path, checkpoint: Option<&str>) -> Result<Seed, ApiError> {
        if let Some(name) = checkpoint {
            let upper = self.existing_checkpoint(name)?;
            return Ok(Seed {
                upper,
                scratch: Vec::new(),
                enforcement: None,
                staged: None,
            });
        }
        if !self.overlay {
            return Err(ApiError::invalid(
                "the sandbox's workspace is not an overlay (its policy's filesystem.workspace \
                 is not \"overlay\"): it has no layer of its own to fork",
            ));
        }
        if let Some(parent) = dir.parent() {
            fs::create_dir_all(parent).map_err(|e| {
                ApiError::internal(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        fs::create_dir(dir)
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", dir.display())))?;
        // From here on the directory goes with the seed, whatever happens.
        let mut seed = Seed {
            upper: dir.join("upper"),
            scratch: Vec::new(),
            enforcement: None,
            staged: Some(dir.to_path_buf()),
        };
        let _g = self.exclusive()?;
        layers::copy_layer(&self.upper, &seed.upper).map_err(layers_err)?;
        for (name, src) in &self.scratch {
            let copy = dir.join(format!("scratch-{name}"));
            layers::copy_layer(src, &copy).map_err(layers_err)?;
            seed.scratch.push((name.clone(), copy));
        }
        Ok(seed)
    }

    /// Rolls the workspace back to checkpoint `name`, holding the layers exclusively: `stop`
    /// ends every process of the sandbox, `remount` mounts the staged copy of the checkpoint
    /// where the workspace was; then the staged layers take the place of the old ones.
    pub fn restore(
        &self,
        name: &str,
        stop: impl FnOnce() -> Result<(), ApiError>,
        remount: impl FnOnce(&StagedLayers) -> Result<(), ApiError>,
    ) -> Result<(), ApiError> {
        let ckpt = self.existing_checkpoint(name)?;
        let _g = self.exclusive()?;
        // Processes with files open in the old view would keep writing to it.
        stop()?;
        let staged = StagedLayers::stage(&self.disk, &ckpt)?;
        remount(&staged)?;
        // The new mount holds the new directories; the old ones are no longer used.
        staged.swap_in(&self.disk, &self.upper, &self.work)
    }

    /// The change as a patch or a tar (written under [`Layers::exports`]), applied to the host
    /// workspace too when asked.
    pub fn export(&self, req: &ExportRequest, id: &SandboxId) -> Result<ExportResult, ApiError> {
        let _g = self.shared()?;
        let (upper, ws) = (&self.upper, &self.host);
        let review = self.review(changes::scan(upper, ws).map_err(changes_err)?)?;
        let ignored = if req.include_ignored {
            0
        } else {
            review.ignored.len() as u64
        };
        let (list, flagged) = listing(review, req.include_ignored);
        // Only what the export carries counts; checked before anything is written.
        let flagged: Vec<AutorunFile> = flagged
            .into_iter()
            .filter(|f| req.include_ignored || !f.ignored)
            .collect();
        if req.apply && !req.allow_autorun && !flagged.is_empty() {
            return Err(ApiError::PathRefused(autorun_refusal(&flagged)));
        }
        let mut patch = None;
        let mut tar_path = None;
        match req.format {
            ExportFormat::Patch => {
                patch = Some(changes::unified_diff(upper, ws, &list).map_err(changes_err)?);
            }
            ExportFormat::Tar => {
                let dir = &self.exports;
                fs::create_dir_all(dir).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", dir.display()))
                })?;
                let path = dir.join(format!("{id}-{}.tar", crate::now_ms()));
                let mut f = std::io::BufWriter::new(fs::File::create(&path).map_err(|e| {
                    ApiError::internal(format!("cannot create {}: {e}", path.display()))
                })?);
                layers::export_tar(upper, ws, &list, &mut f).map_err(layers_err)?;
                f.flush().map_err(|e| {
                    ApiError::internal(format!("cannot write {}: {e}", path.display()))
                })?;
                tar_path = Some(path.display().to_string());
            }
        }
        let mut applied = false;
        if req.apply {
            layers::apply_to_host(upper, ws, &list).map_err(layers_err)?;
            applied = true;
        }
        Ok(ExportResult {
            format: req.format,
            patch,
            tar_path,
            changes: list,
            applied,
            ignored,
            flagged,
        })
    }
}

/// The changes a diff or an export lists (the shown ones, and the left-out ones too when
/// `include_ignored`; sorted) and the flagged files.
fn listing(review: Review, include_ignored: bool) -> (Vec<Change>, Vec<AutorunFile>) {
    let mut list = review.shown;
    if include_ignored {
        list.extend(review.ignored);
        list.sort();
    }
    (list, review.flagged)
}

/// Why an apply is refused: the files that would run on their own, each with what runs it.
fn autorun_refusal(flagged: &[AutorunFile]) -> String {
    let files: Vec<String> = flagged
        .iter()
        .map(|f| format!("{} ({})", f.path, f.reason))
        .collect();
    format!(
        "export --apply refused: the change writes {} file(s) that tools run on their own when \
         the repository is opened, entered, committed or pushed: {}; review them, then apply \
         with --allow-autorun (allow_autorun in the API)",
        flagged.len(),
        files.join("; ")
    )
}

/// What a git-style diff says about one file beyond its status.
#[derive(Default)]
struct Section {
    binary: bool,
    mode_change: Option<String>,
}

/// Reads the per-file facts of a git-style diff: binary or not, and mode changes. Sections start
/// at `diff --git a/P b/P` lines (paths are written as the renderer writes them, unquoted).
fn diff_sections(text: &str) -> BTreeMap<&str, Section> {
    let mut out: BTreeMap<&str, Section> = BTreeMap::new();
    let mut current: Option<&str> = None;
    let mut old_mode: Option<&str> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("diff --git a/") {
            current = rest.split(" b/").next();
            old_mode = None;
            if let Some(p) = current {
                out.entry(p).or_default();
            }
            continue;
        }
        let Some(p) = current else { continue };
        if let Some(m) = line.strip_prefix("old mode ") {
            old_mode = Some(m);
        } else if let (Some(m), Some(old)) = (line.strip_prefix("new mode "), old_mode) {
            out.entry(p).or_default().mode_change = Some(format!("{old} -> {m}"));
        } else if line.starts_with("Binary files ") {
            out.entry(p).or_default().binary = true;
        }
    }
    out
}

/// Reads an exec's spill file when `req` names one under [`SPILL_MOUNT`] (`N.stdout` or
/// `N.stderr`, kept in `dir`); None for any other path.
pub fn read_spill(dir: &Path, req: &ReadRequest) -> Option<Result<ReadResult, ApiError>> {
    let name = req.path.strip_prefix(SPILL_MOUNT)?.strip_prefix('/')?;
    let valid = name.split_once('.').is_some_and(|(n, ext)| {
        !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
            && (ext == "stdout" || ext == "stderr")
    });
    if !valid {
        return Some(Err(ApiError::not_found(format!(
            "{} does not exist",
            req.path
        ))));
    }
    if !dir.join(name).exists() {
        return Some(Err(ApiError::not_found(format!(
            "{} does not exist: a sandbox keeps the spill files of its latest {} ended execs \
             (at most {} MiB of them)",
            req.path,
            crate::slots::SPILL_KEEP_EXECS,
            crate::slots::SPILL_KEEP_BYTES >> 20
        ))));
    }
    Some(WorkspaceFs::open(dir).and_then(|fs| {
        let mut r = fs.read(&ReadRequest {
            path: name.to_string(),
            ..req.clone()
        })?;
        r.path = req.path.clone();
        Ok(r)
    }))
}

/// The diff of `list` (changes of the upper layer `upper` over the workspace `host`, or, with
/// `since` (a checkpoint's layer), since that checkpoint); `ignored` and `flagged` left empty.
pub fn layer_diff(
    host: &Path,
    upper: &Path,
    since: Option<&Path>,
    list: &[Change],
) -> Result<DiffResult, ApiError> {
    let d = match since {
        None => changes::diff(upper, host, list).map_err(changes_err)?,
        Some(base) => layers::diff_between(host, base, upper, list).map_err(layers_err)?,
    };
    let sections = diff_sections(&d.text);
    let files = list
        .iter()
        .map(|c| {
            let section = sections.get(c.path.as_str());
            FileDiff {
                binary: section.is_some_and(|s| s.binary),
                mode_change: section.and_then(|s| s.mode_change.clone()),
                path: c.path.clone(),
                status: c.kind,
                ignored: false,
            }
        })
        .collect();
    Ok(DiffResult {
        files,
        diff: d.text,
        stats: d.stats,
        ignored: 0,
        flagged: Vec::new(),
    })
}

/// Copies the upper layer `upper` to a new checkpoint layer `dir` (named `name`; it must not
/// exist); the number of changed files it holds.
pub fn take_checkpoint(host: &Path, upper: &Path, dir: &Path, name: &str) -> Result<u64, ApiError> {
    if dir.exists() {
        return Err(ApiError::Conflict(format!(
            "checkpoint {name} exists already; choose another name"
        )));
    }
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent)
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", parent.display())))?;
    }
    if let Err(e) = layers::copy_layer(upper, dir) {
        remove_tree(dir);
        return Err(layers_err(e));
    }
    Ok(changes::scan(upper, host).map_err(changes_err)?.len() as u64)
}

/// What a fork starts from ([`Layers::freeze`]): a frozen upper layer and scratch directories,
/// which [`Seed::plant`] copies onto each fork's disk. A copy made for the fork is removed when
/// the seed is dropped; a checkpoint's layer stays.
#[derive(Debug)]
pub struct Seed {
    /// The upper layer each fork's starts as.
    pub upper: PathBuf,
    /// Scratch directories (by the name of the disk's directory) each fork's start as.
    pub scratch: Vec<(String, PathBuf)>,
    /// What the parent's execs found in force (the same policy on the same host): a fork whose
    /// parent has run a command need not run one to learn it.
    pub enforcement: Option<crate::result::Enforcement>,
    /// The directory made for this seed, if it was made.
    staged: Option<PathBuf>,
}

impl Seed {
    /// Copies the seed onto a new sandbox's disk `disk` (the directory that holds its `upper`
    /// and scratch directories, each there already and empty), before its overlay is mounted:
    /// into the same directories (a scratch directory may be mounted in the sandbox already), which
    /// take the parent's owners and modes.
    pub fn plant(&self, disk: &Path) -> Result<(), ApiError> {
        let upper = std::iter::once(("upper", self.upper.as_path()));
        let scratch = self.scratch.iter().map(|(n, p)| (n.as_str(), p.as_path()));
        for (name, src) in upper.chain(scratch) {
            layers::copy_layer_into(src, &disk.join(name)).map_err(layers_err)?;
        }
        Ok(())
    }

    /// Copies the seed's scratch directories into a live sandbox's (`scratch`, by name, as
    /// [`Layers::scratch`] lists them), in place: a warm fork's `/tmp` is mounted already. The
    /// upper layer goes in through a remount instead ([`StagedLayers::stage`]).
    pub fn plant_scratch(&self, scratch: &[(String, PathBuf)]) -> Result<(), ApiError> {
        for (name, src) in &self.scratch {
            let Some((_, dst)) = scratch.iter().find(|(n, _)| n == name) else {
                return Err(ApiError::internal(format!(
                    "the sandbox has no scratch directory {name} to plant the fork's into"
                )));
            };
            layers::copy_layer_into(src, dst).map_err(layers_err)?;
        }
        Ok(())
    }
}

impl Drop for Seed {
    fn drop(&mut self) {
        if let Some(dir) = self.staged.take() {
            remove_tree(&dir);
        }
    }
}

/// The layers a restore mounts, made in a sandbox's directory `dir` before the swap:
/// `upper.next` (a copy of the checkpoint layer `ckpt`) and an empty `work.next`.
pub struct StagedLayers {
    pub upper: PathBuf,
    pub work: PathBuf,
}

/// The directories a stage and its swap use on a disk, beside `upper` and `work`.
const STAGE_DIRS: [&str; 3] = ["upper.next", "work.next", "trash"];

/// Whether `path` is an empty directory (and no symlink).
pub(crate) fn is_empty_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
        && fs::read_dir(path).is_ok_and(|mut d| d.next().is_none())
}

/// Makes `path` an empty directory: kept when it is one already (made ahead by
/// [`StagedLayers::make_ready`]), else removed and made anew.
fn empty_dir(path: &Path) -> Result<(), ApiError> {
    if is_empty_dir(path) {
        return Ok(());
    }
    remove_tree(path);
    fs::create_dir(path)
        .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", path.display())))
}

impl StagedLayers {
    /// Makes the stage's directories on the disk `dir` ahead of a stage (a warm sandbox does
    /// it while it waits in the pool). On a fresh ext4 the first allocation in a block group
    /// reads that group's bitmaps through the loop device, and each new directory at the
    /// disk's root lands in a group of its own: about a millisecond per stage, paid here instead
    /// of in a fork's request. The entries a stage then makes go in the groups of these.
    ///
    /// A fork written through the mount ([`crate::Handle::merge`]) allocates in the group of
    /// the disk's own directories instead: one block allocated and freed again at the disk's
    /// root reads that group's bitmaps here too.
    pub fn make_ready(dir: &Path) -> Result<(), ApiError> {
        for name in STAGE_DIRS {
            empty_dir(&dir.join(name))?;
        }
        let warm = dir.join(".warm");
        let f = fs::File::create(&warm)
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", warm.display())))?;
        let _ = nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            nix::fcntl::FallocateFlags::empty(),
            0,
            4096,
        );
        drop(f);
        let _ = fs::remove_file(&warm);
        Ok(())
    }

    pub fn stage(dir: &Path, ckpt: &Path) -> Result<StagedLayers, ApiError> {
        let staged = StagedLayers {
            upper: dir.join("upper.next"),
            work: dir.join("work.next"),
        };
        empty_dir(&staged.upper)?;
        layers::copy_layer_into(ckpt, &staged.upper).map_err(layers_err)?;
        empty_dir(&staged.work)?;
        Ok(staged)
    }

    /// Once the new overlay is mounted on them: puts them in place of `upper` and `work`, and
    /// removes the old ones (through `dir/trash`).
    pub fn swap_in(self, dir: &Path, upper: &Path, work: &Path) -> Result<(), ApiError> {
        let trash = dir.join("trash");
        empty_dir(&trash)?;
        let moves = [
            (upper.to_path_buf(), trash.join("upper")),
            (work.to_path_buf(), trash.join("work")),
            (self.upper, upper.to_path_buf()),
            (self.work, work.to_path_buf()),
        ];
        for (from, to) in moves {
            fs::rename(&from, &to).map_err(|e| {
                ApiError::internal(format!(
                    "cannot move {} to {}: {e}",
                    from.display(),
                    to.display()
                ))
            })?;
        }
        remove_tree(&trash);
        Ok(())
    }
}

/// A layer operation's error as the API reports it.
pub fn layers_err(e: layers::LayersError) -> ApiError {
    match e {
        layers::LayersError::Refused { .. } => ApiError::PathRefused(e.to_string()),
        e if e.name_too_long() => too_long(&e),
        other => ApiError::internal(other),
    }
}

/// A change scan's error as the API reports it.
pub fn changes_err(e: changes::ChangesError) -> ApiError {
    if e.name_too_long() {
        return too_long(&e);
    }
    ApiError::internal(e)
}

/// An operation that reads every path of the workspace met one too long to name.
fn too_long(e: &dyn std::fmt::Display) -> ApiError {
    ApiError::LimitExceeded(format!(
        "{e}: the workspace nests directories past the 4,095 bytes a path can hold; remove \
         that tree (rm -rf in the sandbox) and ask again"
    ))
}

/// The directory beneath which `print` left out paths too long to name, as a result says it.
fn unnamed_of(print: &layers::Fingerprint) -> Option<String> {
    print.unnamed().map(|p| p.to_string_lossy().into_owned())
}

/// The canonical path of a workspace a create request names: an existing directory other than
/// `/`, whose path overlay mount options can carry.
pub fn overlay_workspace(given: &str) -> Result<PathBuf, ApiError> {
    let workspace = fs::canonicalize(given)
        .map_err(|e| ApiError::invalid(format!("workspace {given}: {e}")))?;
    if !workspace.is_dir() || workspace == Path::new("/") {
        return Err(ApiError::invalid(format!(
            "workspace {} must be a directory other than /",
            workspace.display()
        )));
    }
    if workspace.to_string_lossy().contains([',', ':', '\\', '\n']) {
        return Err(ApiError::invalid(format!(
            "workspace {}: the path contains ',', ':' or '\\', which overlay options cannot carry",
            workspace.display()
        )));
    }
    Ok(workspace)
}

/// Checkpoint names: `[A-Za-z0-9._-]{1,64}`, not `.` or `..`.
pub fn checkpoint_name(name: &str) -> Result<&str, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(name)
    } else {
        Err(ApiError::invalid(format!(
            "invalid checkpoint name {name:?}: use 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'"
        )))
    }
}

/// A file the exec added or changed in the workspace has the size of the per-file limit: a
/// write past it failed. This catches the processes that ignore `SIGXFSZ` and only see `EFBIG`
/// (Python, for one), which no exit status reveals. `upper` is the overlay's upper layer.
pub fn reached_file_size(upper: &Path, changes: &[Change], limit: u64) -> bool {
    changes.iter().any(|c| {
        c.kind != ChangeKind::Deleted
            && fs::symlink_metadata(upper.join(&c.path))
                .is_ok_and(|m| m.file_type().is_file() && m.len() >= limit)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A workspace (the lower layer) and an empty upper layer, as plain directories: an exec
    /// is simulated by writing to the upper layer between its start and its end.
    fn layers(dir: &Path) -> Layers {
        let host = dir.join("host");
        fs::create_dir_all(&host).unwrap();
        fs::write(host.join("README"), "hello\n").unwrap();
        let disk = dir.join("disk");
        fs::create_dir_all(disk.join("upper")).unwrap();
        Layers::new(host, disk, dir.join("checkpoints"), dir.join("out"))
    }

    fn paths(c: &ExecChanges) -> Vec<&str> {
        c.shown.iter().map(|c| c.path.as_str()).collect()
    }

    /// A stage fills the directories made ahead (the same inodes), replaces what an earlier
    /// stage left, and its swap puts the new layer in place of the old.
    #[test]
    fn a_stage_uses_the_directories_made_ahead_and_replaces_leftovers() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let (disk, frozen) = (tmp.path().join("disk"), tmp.path().join("frozen"));
        for d in ["disk/upper/old", "disk/work", "frozen/d0"] {
            fs::create_dir_all(tmp.path().join(d)).unwrap();
        }
        fs::write(frozen.join("d0/f1.txt"), "fork\n").unwrap();
        StagedLayers::make_ready(&disk).unwrap();
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        let made = ino(&disk.join("upper.next"));
        let staged = StagedLayers::stage(&disk, &frozen).unwrap();
        assert_eq!(
            ino(&disk.join("upper.next")),
            made,
            "the directory made ahead was replaced"
        );
        staged
            .swap_in(&disk, &disk.join("upper"), &disk.join("work"))
            .unwrap();
        assert_eq!(
            fs::read_to_string(disk.join("upper/d0/f1.txt")).unwrap(),
            "fork\n"
        );
        assert!(!disk.join("upper/old").exists() && !disk.join("trash").exists());
        // What a stage that failed half-way left is not taken for a directory made ahead.
        fs::create_dir(disk.join("upper.next")).unwrap();
        fs::write(disk.join("upper.next/stale"), "x").unwrap();
        fs::create_dir(disk.join("work.next")).unwrap();
        fs::write(disk.join("work.next/stale"), "x").unwrap();
        let staged = StagedLayers::stage(&disk, &frozen).unwrap();
        assert!(!staged.upper.join("stale").exists() && staged.upper.join("d0/f1.txt").exists());
        assert_eq!(fs::read_dir(&staged.work).unwrap().count(), 0);
    }

    #[test]
    fn an_exec_keeps_its_end_for_the_next_only_while_nothing_else_ran() {
        let tmp = tempfile::tempdir().unwrap();
        let l = layers(tmp.path());
        let upper = l.upper.clone();

        // An exec that writes b.txt reports it; the next exec starts from its end (kept) and
        // reports only its own c.txt.
        let s = l.exec_start().unwrap();
        fs::write(upper.join("b.txt"), "b").unwrap();
        assert_eq!(paths(&l.exec_end(s).unwrap()), ["b.txt"]);
        assert!(crate::lock(&l.last_end).print.is_some());
        let s = l.exec_start().unwrap();
        fs::write(upper.join("c.txt"), "c").unwrap();
        assert_eq!(paths(&l.exec_end(s).unwrap()), ["c.txt"]);

        // A file operation between two execs: the next exec does not report its file.
        {
            let _g = l.shared().unwrap();
            fs::write(upper.join("by-the-api.txt"), "x").unwrap();
        }
        let s = l.exec_start().unwrap();
        assert_eq!(paths(&l.exec_end(s).unwrap()), Vec::<&str>::new());

        // Two execs at once (a background one and another): neither keeps its end, so what
        // changes the layer after them is measured afresh by the next.
        let bg = l.exec_start().unwrap();
        let fg = l.exec_start().unwrap();
        fs::write(upper.join("d.txt"), "d").unwrap();
        assert_eq!(paths(&l.exec_end(fg).unwrap()), ["d.txt"]);
        assert_eq!(paths(&l.exec_end(bg).unwrap()), ["d.txt"]);
        assert!(crate::lock(&l.last_end).print.is_none());
        fs::write(upper.join("e.txt"), "e").unwrap();
        let s = l.exec_start().unwrap();
        assert_eq!(paths(&l.exec_end(s).unwrap()), Vec::<&str>::new());

        // An exec that could not start is over: the next one keeps its end again.
        let s = l.exec_start().unwrap();
        l.exec_abandoned(s);
        let s = l.exec_start().unwrap();
        l.exec_end(s).unwrap();
        assert!(crate::lock(&l.last_end).print.is_some());
        let s = l.exec_start().unwrap();
        fs::remove_file(upper.join("b.txt")).unwrap();
        assert_eq!(paths(&l.exec_end(s).unwrap()), ["b.txt"]);
    }
}
