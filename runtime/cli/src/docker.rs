//! The Docker backend in the CLI: `serve --docker [--docker-pool N]` (one supervisor serving
//! both backends through the runtime's router) and `run --backend docker --image NAME|DIGEST`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use taskbox_core::api::{
    ApiError, CreateRequest, DiffRequest, ExecEvent, ExecOutcome, ExecRequest, ResolvedPolicy,
    SandboxApi,
};
use taskbox_core::egress::EgressService;
use taskbox_core::image::ImageResolver;
use taskbox_core::runtime::RuntimeBuilder;
use taskbox_docker::{Docker, DockerBackend, DockerConfig};

/// `serve`'s Docker options.
#[derive(Args, Debug, Default)]
pub struct ServeDocker {
    /// Also serve the Docker backend (create requests with backend "docker"); needs root and a
    /// running Docker daemon.
    #[arg(long)]
    pub docker: bool,
    /// Pre-started Docker containers kept per (image, policy) asked for (implies --docker).
    #[arg(long, value_name = "N")]
    pub docker_pool: Option<usize>,
}

/// The images both backends use: the image store (`taskbox image build`), `$TASKBOX_IMAGE_DIR`
/// or `STATE/images`. The Docker backend loads an image into the daemon by digest on first use.
/// The store is opened on first use, so a supervisor that never sees an image never needs it.
pub fn image_resolver(state_dir: &Path) -> Arc<dyn ImageResolver> {
    Arc::new(LazyStore {
        state_dir: state_dir.to_path_buf(),
        store: std::sync::OnceLock::new(),
    })
}

/// The Docker backend's images: the image store first, then what the Docker daemon already has
/// (by ID or tag), e.g. images built or loaded outside taskbox.
pub fn docker_image_resolver(
    state_dir: &Path,
    config: &DockerConfig,
) -> Result<Arc<dyn ImageResolver>, ApiError> {
    Ok(Arc::new(StoreThenDaemon {
        store: image_resolver(state_dir),
        daemon: taskbox_docker::DaemonImages::new(&config.socket)?,
    }))
}

/// Opens the Docker backend in `state_dir` with `images` (normally [`docker_image_resolver`]):
/// it needs root and a Docker daemon that answers, and says so when either is missing.
pub fn docker_backend(
    state_dir: &Path,
    images: Arc<dyn ImageResolver>,
    config: DockerConfig,
) -> Result<Arc<dyn SandboxApi>, ApiError> {
    Ok(Arc::new(Docker::open(state_dir, images, config)?))
}

struct StoreThenDaemon {
    store: Arc<dyn ImageResolver>,
    daemon: taskbox_docker::DaemonImages,
}

impl ImageResolver for StoreThenDaemon {
    fn resolve(&self, name_or_digest: &str) -> Result<taskbox_core::image::ImageRoot, ApiError> {
        match self.store.resolve(name_or_digest) {
            Err(ApiError::NotFound(why)) => self
                .daemon
                .resolve(name_or_digest)
                .map_err(|_| ApiError::NotFound(why)),
            other => other,
        }
    }

    fn docker_archive(&self, digest: &str, out: &mut dyn Write) -> Result<(), ApiError> {
        self.store.docker_archive(digest, out)
    }
}

struct LazyStore {
    state_dir: PathBuf,
    store: std::sync::OnceLock<taskbox_image::Store>,
}

impl LazyStore {
    fn store(&self) -> Result<&taskbox_image::Store, ApiError> {
        if let Some(s) = self.store.get() {
            return Ok(s);
        }
        let s = taskbox_image::Store::open_default(&self.state_dir)
            .map_err(|e| ApiError::Internal(format!("cannot open the image store: {e}")))?;
        Ok(self.store.get_or_init(|| s))
    }
}

impl ImageResolver for LazyStore {
    fn resolve(&self, name_or_digest: &str) -> Result<taskbox_core::image::ImageRoot, ApiError> {
        self.store()?.resolve(name_or_digest)
    }

    fn docker_archive(&self, digest: &str, out: &mut dyn Write) -> Result<(), ApiError> {
        self.store()?.docker_archive(digest, out)
    }
}

/// `serve`'s runtime: as given (the native backend), or with the Docker backend too when asked
/// for, opened after the native one and sharing its egress service.
pub fn serve_docker(
    runtime: RuntimeBuilder,
    opts: &ServeDocker,
    state_dir: &Path,
    egress: Arc<dyn EgressService>,
) -> RuntimeBuilder {
    if !opts.docker && opts.docker_pool.is_none() {
        return runtime;
    }
    let config = DockerConfig {
        pool_size: opts.docker_pool.unwrap_or(0),
        egress: Some(egress),
        ..DockerConfig::default()
    };
    let state_dir = state_dir.to_path_buf();
    runtime.backend("docker", move || {
        let images = docker_image_resolver(&state_dir, &config)?;
        docker_backend(&state_dir, images, config)
    })
}

/// What `run --backend docker` needs.
#[derive(Debug)]
pub struct RunDocker {
    pub image: Option<String>,
    /// The policy `run` resolved (and checked the command against).
    pub policy: ResolvedPolicy,
    pub workspace: PathBuf,
    pub timeout: Option<Duration>,
    pub json: bool,
    pub diff: bool,
    pub env: Vec<(String, String)>,
    pub cwd: Option<PathBuf>,
    pub command: Vec<String>,
    pub state_dir: PathBuf,
}

/// Removes what one-shot Docker runs that died left (their lock is free): containers, mounts
/// and state.
fn sweep_dead_runs(runs: &Path, images: &Arc<dyn ImageResolver>) {
    let Ok(rd) = std::fs::read_dir(runs) else {
        return;
    };
    for e in rd.flatten() {
        let dir = e.path();
        if dir.join("docker/.lock").exists()
            && let Ok(b) = Docker::open(&dir, images.clone(), DockerConfig::default())
        {
            drop(b);
            if taskbox_docker::hostmount::mounts_under(&dir).is_empty() {
                taskbox_core::native::remove_tree(&dir);
            }
        }
    }
}

/// `taskbox run --backend docker`: create a sandbox, run the command, report, destroy. The
/// output and exit status follow `run`'s conventions. Standard input, when it is not a terminal,
/// is read whole (up to 64 MiB) and given to the command.
pub fn run(args: RunDocker) -> Result<u8> {
    let image = args
        .image
        .clone()
        .context("the docker backend needs an image: pass --image NAME|DIGEST")?;
    let config = DockerConfig {
        egress: Some(crate::egress_service(1)?),
        ..DockerConfig::default()
    };
    let images = docker_image_resolver(&args.state_dir, &config).map_err(|e| anyhow!(e))?;
    let runs = args.state_dir.join("docker-runs");
    sweep_dead_runs(&runs, &images);
    let own = runs.join(std::process::id().to_string());
    std::fs::create_dir_all(&own).with_context(|| format!("cannot create {}", own.display()))?;
    let outcome = (|| -> Result<u8> {
        // The concrete backend too: its spill files are kept past the sandbox.
        let docker = Arc::new(Docker::open(&own, images, config).map_err(|e| anyhow!(e))?);
        let opened: Arc<dyn SandboxApi> = docker.clone();
        // No command policy (`run` asked before) and no trace, as a native one-shot run.
        let backend = RuntimeBuilder::new()
            .backend("docker", move || Ok(opened))
            .build()
            .map_err(|e| anyhow!(e))?;
        let policy = args.policy.name.clone();
        let info = backend
            .create(CreateRequest {
                workspace: args.workspace.display().to_string(),
                policy: Some(policy),
                backend: Some("docker".into()),
                image: Some(image),
                env: args.env.iter().cloned().collect(),
                resolved_policy: Some(Arc::new(args.policy.clone())),
                ..Default::default()
            })
            .map_err(|e| anyhow!(e))?;
        let echo = !args.json;
        let mut streamed_err = 0u64;
        let mut on_event = |e: ExecEvent| match e {
            ExecEvent::Stdout { data } if echo => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(data.as_bytes());
                let _ = out.flush();
            }
            ExecEvent::Stderr { data } if echo => {
                streamed_err += data.len() as u64;
                let _ = std::io::stderr().write_all(data.as_bytes());
            }
            _ => {}
        };
        let stdin = read_stdin()?;
        let req = ExecRequest {
            stdin,
            argv: Some(args.command.clone()),
            cwd: args.cwd.as_ref().map(|c| c.display().to_string()),
            timeout_ms: args.timeout.map(|t| t.as_millis() as u64),
            ..Default::default()
        };
        let outcome = backend.exec(&info.id, req, Some(&mut on_event));
        let result = match outcome {
            Ok(ExecOutcome::Finished(r)) => r,
            Ok(ExecOutcome::Background(_)) => bail!("the exec did not run in the foreground"),
            Err(e) => {
                let _ = backend.destroy(&info.id);
                return Err(anyhow!(e));
            }
        };
        let diff = if args.diff {
            Some(
                backend
                    .diff(&info.id, DiffRequest::default())
                    .map_err(|e| anyhow!(e))?
                    .diff,
            )
        } else {
            None
        };
        // The spill files go with the sandbox: keep them where a native one-shot run keeps its
        // own, and report them there.
        let mut result = result;
        for (stream, out) in [
            ("stdout", &mut result.stdout),
            ("stderr", &mut result.stderr),
        ] {
            if let Some(shown) = out.spill_path.take() {
                out.spill_path = keep_spill(&docker, &info.id, &shown, &args.state_dir, stream);
            }
        }
        let _ = backend.destroy(&info.id);
        if args.json {
            let mut value = serde_json::to_value(&result)?;
            if let (Some(diff), Some(obj)) = (&diff, value.as_object_mut()) {
                obj.insert("diff".into(), serde_json::Value::String(diff.clone()));
            }
            println!("{}", serde_json::to_string_pretty(&value)?);
        } else {
            // What taskbox added to the stream (e.g. "command not found") was not streamed.
            if !result.stderr.truncated && result.stderr.bytes > streamed_err {
                let text = result.stderr.text.as_bytes();
                let from = (streamed_err as usize).min(text.len());
                let _ = std::io::stderr().write_all(&text[from..]);
            }
            for v in &result.violations {
                eprintln!("taskbox: {}: {}", v.kind, v.detail);
            }
            if let Some(diff) = &diff {
                print!("{diff}");
            }
        }
        Ok(u8::try_from(result.cli_exit_status()).unwrap_or(125))
    })();
    // Nothing is mounted there any more unless an unmount failed: then leave it for the sweep.
    if taskbox_docker::hostmount::mounts_under(&own).is_empty() {
        taskbox_core::native::remove_tree(&own);
    }
    outcome
}

/// Moves a one-shot run's spill file out of its sandbox into `STATE/spill` (pruned after a day,
/// like the native runs'), and returns its new path; None when it cannot be kept (said on
/// stderr).
fn keep_spill(
    backend: &DockerBackend,
    id: &taskbox_core::api::SandboxId,
    shown: &str,
    state_dir: &Path,
    stream: &str,
) -> Option<String> {
    let kept = (|| -> Result<PathBuf> {
        let from = backend.spill_file(id, shown).map_err(|e| anyhow!(e))?;
        let dir = state_dir.join("spill");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let to = dir.join(format!("docker-{id}.{stream}"));
        // The sandbox's directories are mounts of their own: rename when it can, else copy.
        if std::fs::rename(&from, &to).is_err() {
            std::fs::copy(&from, &to)
                .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
        }
        Ok(to)
    })();
    match kept {
        Ok(p) => Some(p.display().to_string()),
        Err(e) => {
            eprintln!("taskbox: the full {stream} is lost with the sandbox: {e:#}");
            None
        }
    }
}

/// Standard input for a one-shot Docker run: none from a terminal, else all of it (bounded).
fn read_stdin() -> Result<Option<String>> {
    use std::io::{IsTerminal, Read};
    const MAX: u64 = 64 << 20;
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(None);
    }
    let mut buf = Vec::new();
    stdin
        .lock()
        .take(MAX + 1)
        .read_to_end(&mut buf)
        .context("cannot read standard input")?;
    if buf.len() as u64 > MAX {
        bail!("standard input is larger than 64 MiB; the docker backend takes it whole");
    }
    let text = String::from_utf8(buf)
        .map_err(|_| anyhow!("standard input is not UTF-8; the docker backend takes text only"))?;
    Ok(Some(text))
}
