//! `taskbox image build|ls|inspect|verify|rm`: the image store from the command line.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Subcommand;
use serde_json::{Value, json};
use taskbox_image::progress::{Event, Progress};
use taskbox_image::store::short;
use taskbox_image::{BuildOptions, Store, def, lock};

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Build an image from its definition (images/NAME.toml, or a path) into the store.
    ///
    /// Layers whose inputs did not change come from the cache. The lock file beside the
    /// definition (NAME.lock) pins Debian package versions and records every input hash and the
    /// resulting digest.
    Build {
        /// An image name (found as images/NAME.toml in the current directory or above, or in
        /// $TASKBOX_IMAGE_DIR) or a definition file.
        image: String,
        /// Build every layer again instead of taking it from the cache.
        #[arg(long)]
        no_cache: bool,
        /// Resolve Debian packages afresh instead of installing the locked versions.
        #[arg(long)]
        update_lock: bool,
        /// Print the build report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the images in the store.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Print an image's digests, layers, config and lock as JSON.
    Inspect {
        /// A name, a digest, or at least 12 hex characters of one.
        image: String,
    },
    /// Check an image: re-hash every stored blob, then rebuild it from its definition in an
    /// empty store and compare digests. Exit status 1 when anything differs.
    Verify {
        /// A name, a digest, or a definition file.
        image: String,
        /// Only re-hash the stored blobs; do not rebuild.
        #[arg(long)]
        blobs_only: bool,
        #[arg(long)]
        json: bool,
    },
    /// Remove images (a name removes the name; a digest the image and its names), and whatever
    /// no remaining image uses.
    Rm {
        #[arg(required = true)]
        images: Vec<String>,
    },
}

/// Finds a definition: a path (contains `/` or ends in .toml), else NAME.toml in
/// $TASKBOX_IMAGE_DIR, else images/NAME.toml in the current directory or one above it.
fn find_definition(image: &str) -> Result<PathBuf> {
    if image.contains('/') || image.ends_with(".toml") {
        return Ok(PathBuf::from(image));
    }
    if !def::is_valid_name(image) {
        bail!(
            "invalid image name {image:?}: use a-z, 0-9, '.', '_' and '-', or give a path to a .toml file"
        );
    }
    let file = format!("{image}.toml");
    if let Some(dir) = std::env::var_os("TASKBOX_IMAGE_DIR") {
        let p = Path::new(&dir).join(&file);
        if p.is_file() {
            return Ok(p);
        }
    }
    let cwd = std::env::current_dir().context("cannot determine the current directory")?;
    for dir in cwd.ancestors() {
        let p = dir.join("images").join(&file);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "no definition for image {image}: looked for images/{file} in {} and above{}",
        cwd.display(),
        if std::env::var_os("TASKBOX_IMAGE_DIR").is_some() {
            " and in $TASKBOX_IMAGE_DIR"
        } else {
            ""
        }
    )
}

pub fn run(cmd: ImageCommand, state_dir: PathBuf) -> Result<u8> {
    let store = Store::open_default(&state_dir).map_err(|e| anyhow!(e))?;
    match cmd {
        ImageCommand::Build {
            image,
            no_cache,
            update_lock,
            json,
        } => {
            let path = find_definition(&image)?;
            let d = def::load(&path).map_err(|e| anyhow!(e))?;
            let opts = BuildOptions {
                no_cache,
                update_lock,
                // A .deb cache shared between state directories (CI, several checkouts).
                debs_dir: std::env::var_os("TASKBOX_DEB_CACHE").map(PathBuf::from),
                ..BuildOptions::default()
            };
            let progress = Renderer::new();
            let report = taskbox_image::build(&store, &d, &opts, &progress);
            progress.stop();
            let report = report.map_err(|e| anyhow!(e))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                let cached = report.layers.iter().filter(|l| l.cached).count();
                println!(
                    "{} {} ({} layers, {} cached, {})",
                    report.name,
                    report.digest,
                    report.layers.len(),
                    cached,
                    seconds(report.millis)
                );
                if report.lock_written {
                    eprintln!("wrote {}", report.lock_path.display());
                }
            }
            Ok(0)
        }
        ImageCommand::Ls { json } => {
            let list = store.list().map_err(|e| anyhow!(e))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(0);
            }
            println!(
                "{:<20} {:<14} {:>10} {:>6}  CREATED",
                "NAME", "DIGEST", "SIZE", "LAYERS"
            );
            for i in list {
                let names = if i.names.is_empty() {
                    "<none>".to_owned()
                } else {
                    i.names.join(",")
                };
                println!(
                    "{:<20} {:<14} {:>10} {:>6}  {}",
                    names,
                    short(&i.digest),
                    size(i.size),
                    i.layers,
                    i.created
                );
            }
            Ok(0)
        }
        ImageCommand::Inspect { image } => {
            let digest = store.lookup(&image).map_err(|e| anyhow!(e))?;
            let img = store.image(&digest).map_err(|e| anyhow!(e))?;
            let labels = img.layer_labels();
            let layers: Vec<Value> = img
                .manifest
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    json!({"digest": l.digest, "size": l.size, "created_by": labels.get(i)})
                })
                .collect();
            let lock = match &img.definition {
                Some(d) => lock::read(&lock::path_for(d))
                    .ok()
                    .flatten()
                    .map(|l| serde_json::to_value(l).unwrap_or(Value::Null)),
                None => None,
            };
            let c = img.image_config();
            let out = json!({
                "digest": img.digest,
                "config_digest": img.config_digest(),
                "names": img.names,
                "definition": img.definition,
                "created": img.config.created,
                "architecture": img.config.architecture,
                "os": img.config.os,
                "size": img.manifest.layers.iter().map(|l| l.size).sum::<u64>(),
                "layers": layers,
                "config": {
                    "env": c.env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
                    "workdir": c.workdir,
                    "user": c.user,
                    "shell": c.shell,
                },
                "lock": lock,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(0)
        }
        ImageCommand::Verify {
            image,
            blobs_only,
            json,
        } => {
            let progress = Renderer::new();
            let report = taskbox_image::verify::verify(&store, &image, !blobs_only, &progress);
            progress.stop();
            let report = report.map_err(|e| anyhow!(e))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else if report.ok() {
                println!(
                    "{}: ok ({})",
                    report.digest,
                    if blobs_only {
                        "every blob matches its digest"
                    } else {
                        "every blob matches its digest, and a clean rebuild gives the same digest"
                    }
                );
            } else {
                for p in &report.problems {
                    eprintln!("taskbox: verify {image}: {p}");
                }
            }
            Ok(if report.ok() { 0 } else { 1 })
        }
        ImageCommand::Rm { images } => {
            let removed = store.remove(&images).map_err(|e| anyhow!(e))?;
            for n in &removed.names {
                println!("untagged {n}");
            }
            for d in &removed.images {
                println!("removed {d}");
            }
            if removed.blobs > 0 {
                println!("freed {} in {} blobs", size(removed.bytes), removed.blobs);
            }
            Ok(0)
        }
    }
}

fn seconds(millis: u128) -> String {
    format!("{:.2}s", millis as f64 / 1000.0)
}

fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.1} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// Renders build events on stderr: one live line on a terminal (redrawn every half second with
/// the elapsed time), plain lines otherwise.
struct Renderer {
    tty: bool,
    state: Arc<Mutex<Line>>,
    stop: Arc<AtomicBool>,
    ticker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct Line {
    /// `[i/n] what`
    head: String,
    detail: String,
    started: Option<Instant>,
}

impl Line {
    fn draw(&self) {
        let Some(t) = self.started else { return };
        let mut text = format!("{} {:>4}s", self.head, t.elapsed().as_secs());
        if !self.detail.is_empty() {
            text.push_str("  ");
            text.push_str(&self.detail);
        }
        let width = terminal_width().saturating_sub(1);
        let text: String = text.chars().take(width).collect();
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{text}");
        let _ = err.flush();
    }
}

fn terminal_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(100)
}

impl Renderer {
    fn new() -> Renderer {
        let tty = std::io::stderr().is_terminal();
        let state = Arc::new(Mutex::new(Line::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = tty.then(|| {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(500));
                    if let Ok(line) = state.lock() {
                        line.draw();
                    }
                }
            })
        });
        Renderer {
            tty,
            state,
            stop,
            ticker: Mutex::new(ticker),
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(mut t) = self.ticker.lock()
            && let Some(t) = t.take()
        {
            let _ = t.join();
        }
        if self.tty
            && let Ok(line) = self.state.lock()
            && line.started.is_some()
        {
            eprint!("\r\x1b[K");
        }
    }
}

impl Progress for Renderer {
    fn event(&self, event: Event) {
        let Ok(mut line) = self.state.lock() else {
            return;
        };
        match event {
            Event::StepStarted { index, total, what } => {
                line.head = format!("[{index}/{total}] {what}");
                line.detail.clear();
                line.started = Some(Instant::now());
                if self.tty {
                    line.draw();
                } else {
                    eprintln!("{}", line.head);
                }
            }
            Event::Output { line: text, .. } => {
                if self.tty {
                    line.detail = text;
                    line.draw();
                } else {
                    eprintln!("    {text}");
                }
            }
            Event::StepDone {
                cached,
                layer,
                size: bytes,
                millis,
                ..
            } => {
                let done = format!(
                    "{}: {} {} {} in {}",
                    line.head,
                    if cached { "cached" } else { "built" },
                    short(&layer),
                    size(bytes),
                    seconds(millis)
                );
                if self.tty {
                    eprintln!("\r\x1b[K{done}");
                } else {
                    eprintln!("{done}");
                }
                line.started = None;
            }
        }
    }
}
