//! `taskbox replay TRACE`: the CLI edge of [`taskbox_core::replay`]. It picks the backend,
//! checks that the image is at hand, prepares the workspace in a scratch directory
//! (STATE/replays/N, removed afterwards), runs the engine and prints its report.
//!
//! Exit status: 0 when every replayed operation matches, 1 when one diverges, 125 when the
//! replay cannot run (a missing image, commit or policy, a bad trace).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};
use clap::Args;
use taskbox_core::api::ApiError;
use taskbox_core::replay::{self, BaseSource, Normalization, ReplayOptions, ReplaySetup};
use taskbox_core::runtime::RuntimeBuilder;
use taskbox_docker::DockerConfig;

#[derive(Args)]
pub struct ReplayArgs {
    /// A trace file, or a sandbox id (looked up in STATE/traces).
    pub trace: String,
    /// The backend to replay on (default: the recorded one).
    #[arg(long, value_name = "native|docker")]
    pub backend: Option<String>,
    /// The image to replay on (default: the recorded digest; "host" for the host view).
    #[arg(long, value_name = "NAME|DIGEST")]
    pub image: Option<String>,
    /// A git repository holding the recorded commit (default: the recorded workspace path).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["workspace_tar", "workspace_dir"])]
    pub repo: Option<PathBuf>,
    /// A tar of the workspace; checked against the digest the trace records, if any.
    #[arg(long, value_name = "FILE", conflicts_with = "workspace_dir")]
    pub workspace_tar: Option<PathBuf>,
    /// A directory copied as the workspace (not checked: for traces without a base).
    #[arg(long, value_name = "DIR")]
    pub workspace_dir: Option<PathBuf>,
    /// A policy name or file instead of the policy text recorded in the trace.
    #[arg(long, value_name = "NAME|FILE")]
    pub policy: Option<String>,
    /// Mask volatile text before comparing output: timestamps, durations, temp-paths, pids, or
    /// all (comma-separated). The trace itself is never changed.
    #[arg(long, value_name = "NAME,...")]
    pub normalize: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ReplayArgs, trace_path: &Path, state_dir: &Path) -> Result<u8> {
    let normalize = match &args.normalize {
        Some(list) => Normalization::parse_list(list).map_err(|e| anyhow!(e))?,
        None => Vec::new(),
    };
    let trace = taskbox_core::trace::read_trace(trace_path)?;
    let header = &trace.header;
    let backend = args
        .backend
        .clone()
        .unwrap_or_else(|| header.backend.clone());
    let image = args.image.clone().unwrap_or_else(|| header.image.clone());
    if backend != "native" && backend != "docker" {
        bail!("unknown backend {backend:?}: use native or docker");
    }
    if backend == "docker" && image == "host" {
        bail!(
            "the trace was recorded on the host view, which the docker backend cannot provide: \
             replay it with --backend native, or pass --image"
        );
    }

    let scratch = scratch_dir(state_dir)?;
    // A fork is rebuilt from its parent's trace (and its parent's, ...), beside its own.
    let ancestors = replay::ancestors_of(&trace, trace_path)?;
    let opts = ReplayOptions {
        normalize,
        ancestors,
    };
    let result = replay_in(&args, &trace, &backend, &image, state_dir, &scratch, &opts);
    taskbox_core::native::remove_tree(&scratch);
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", replay::render_report(&report));
    }
    Ok(if report.ok() { 0 } else { 1 })
}

fn replay_in(
    args: &ReplayArgs,
    trace: &taskbox_core::trace::Trace,
    backend: &str,
    image: &str,
    state_dir: &Path,
    scratch: &Path,
    opts: &ReplayOptions,
) -> Result<replay::ReplayReport> {
    let header = &trace.header;
    let images = crate::docker::image_resolver(state_dir);
    // A sandbox recorded with network mode "proxy" replays behind the egress proxy too.
    let egress = crate::egress_service(1)?;
    let state = scratch.join("state");
    // No command policy: the replay answers each ask as the recording did. No trace of its own:
    // the report is the replay's record.
    let mut runtime = RuntimeBuilder::new()
        .native(state.clone())
        .images(images.clone())
        .egress(egress.clone());
    if backend == "docker" {
        let config = DockerConfig {
            egress: Some(egress),
            ..DockerConfig::default()
        };
        let docker_images =
            crate::docker::docker_image_resolver(state_dir, &config).map_err(|e| anyhow!(e))?;
        check_image(&*docker_images, image)?;
        runtime = runtime.backend("docker", move || {
            crate::docker::docker_backend(&state, docker_images, config)
        });
    } else if image != "host" {
        check_image(&*images, image)?;
    }
    let api = runtime.build().map_err(|e| anyhow!(e))?;

    let source = match (&args.repo, &args.workspace_tar, &args.workspace_dir) {
        (Some(r), _, _) => BaseSource::Repo(r.clone()),
        (_, Some(t), _) => BaseSource::Tar(t.clone()),
        (_, _, Some(d)) => BaseSource::Dir(d.clone()),
        _ => BaseSource::Recorded,
    };
    let ws = replay::prepare_workspace(header, &source, scratch)?;
    let setup = ReplaySetup {
        backend: Some(backend.to_string()),
        image: Some(image.to_string()),
        policy: args.policy.clone(),
    };
    let resolved = setup.policy(header)?;
    let policy = resolved.policy.clone();
    let create = setup.create_request(header, &ws.dir, resolved);
    let mut report = replay::replay(trace, &*api, create, &policy, opts)?;
    report.notes.splice(0..0, ws.notes);
    Ok(report)
}

/// Fails with what is missing and how to supply it when `image` cannot be resolved.
fn check_image(images: &dyn taskbox_core::image::ImageResolver, image: &str) -> Result<()> {
    match images.resolve(image) {
        Ok(_) => Ok(()),
        Err(ApiError::NotFound(why)) => bail!(
            "image {image} of the trace is not available ({why}): build it with `taskbox image \
             build NAME` from the same definition and lock (the same inputs give the same \
             digest), or pass --image NAME|DIGEST to replay on another image"
        ),
        Err(e) => Err(anyhow!(e)),
    }
}

fn scratch_dir(state_dir: &Path) -> Result<PathBuf> {
    let base = state_dir.join("replays");
    taskbox_core::native::private_dir(&base)
        .map_err(|e| anyhow!("cannot create {}: {e}", base.display()))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    let dir = base.join(format!("{}-{nanos:09}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}
