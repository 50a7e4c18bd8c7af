//! The bodies of taskbox's fuzz targets: each takes arbitrary bytes, hands them to one parser of
//! input that taskbox does not trust, and panics when a promise breaks, not only when the parser
//! itself panics:
//!
//! | target | input from | promise checked |
//! |---|---|---|
//! | `proxy_request` | a sandbox's client, on the egress socket | one request per head, a clean forwarded head, the verdict as the rules say |
//! | `patch` | the model (`patch`) | nothing outside the workspace changes; a refused patch changes nothing at all |
//! | `layer_tar` | an image layer | nothing outside the root is created, changed or linked to; no device node but a whiteout |
//! | `workspace_tar` | a recorded trace's workspace base | nothing outside the target directory changes |
//! | `command_policy` | the model (`exec`) | the shell parser and the command rules always answer |
//! | `policy_file` | a policy file | parsed, or refused with an error naming the problem |
//! | `image_def` | an image definition | parsed, or refused with an error naming the problem |
//! | `trace` | a trace file given to `replay` or `trace html` | read or refused; the page escapes every recorded text |
//! | `tool_call` | the model's tool calls and a model server's answers | validated or refused with a message for the model |
//!
//! `cargo fuzz run --fuzz-dir tests/fuzz TARGET` runs one under libFuzzer (`scripts/fuzz.sh`
//! runs them all); the suite's `fuzz_corpus` test runs every body over the committed seeds and
//! over the inputs that once broke a promise (`tests/fuzz/corpus/TARGET/`).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use taskbox_core::api::PatchRequest;
use taskbox_core::commands::Commands;
use taskbox_core::fsops::WorkspaceFs;
use taskbox_core::{policy, shell, trace, trace_html};

/// A target's body.
pub type Body = fn(&[u8]);

/// Every target, by name.
pub const TARGETS: &[(&str, Body)] = &[
    ("proxy_request", proxy_request),
    ("patch", patch),
    ("layer_tar", layer_tar),
    ("workspace_tar", workspace_tar),
    ("command_policy", command_policy),
    ("policy_file", policy_file),
    ("image_def", image_def),
    ("trace", trace),
    ("tool_call", tool_call),
];

/// What a sandbox's client sends the egress proxy (the checks live beside the parsers).
pub fn proxy_request(data: &[u8]) {
    taskbox_egress::fuzzing::proxy_request(data);
}

/// A unified diff from the model, applied to a small workspace that has a symlink leading out of
/// it and a neighbour directory beside it.
pub fn patch(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let sc = scene(true);
    let (ws, outside) = (&sc.inside, &sc.outside);
    fs::create_dir_all(ws.join("src")).unwrap_or_else(|e| panic!("mkdir: {e}"));
    write(&ws.join("a.txt"), "one\ntwo\nthree\n");
    write(&ws.join("src/lib.rs"), "fn main() {}\n");
    write(&ws.join("no-newline"), "last");

    let before_ws = snapshot(ws);
    let before_out = snapshot(outside);
    let wfs = WorkspaceFs::open(ws).unwrap_or_else(|e| panic!("open the workspace: {e}"));
    let result = wfs.patch(&PatchRequest {
        patch: text.to_owned(),
    });
    assert_eq!(
        snapshot(outside),
        before_out,
        "a patch reached outside the workspace"
    );
    let after_ws = snapshot(ws);
    match result {
        Ok(r) => {
            // The observation lists every file the patch changed.
            let reported: Vec<&str> = r.files.iter().map(|c| c.path.as_str()).collect();
            for path in changed_files(&before_ws, &after_ws) {
                assert!(
                    reported.contains(&path),
                    "{path} changed, but the patch's result lists only {reported:?}"
                );
            }
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "a refusal without a reason");
            assert_eq!(
                after_ws, before_ws,
                "a refused patch changed the workspace: {e}"
            );
        }
    }
}

/// The entries other than directories that differ between two snapshots.
fn changed_files<'a>(
    before: &'a BTreeMap<String, String>,
    after: &'a BTreeMap<String, String>,
) -> Vec<&'a str> {
    let is_dir = |v: Option<&String>| v.is_some_and(|v| v.starts_with("dir "));
    before
        .keys()
        .chain(after.keys())
        .map(String::as_str)
        .filter(|k| before.get(*k) != after.get(*k))
        .filter(|k| !is_dir(before.get(*k)) && !is_dir(after.get(*k)))
        .collect()
}

/// An image layer, unpacked onto a root that already has symlinks leading out of it, with a
/// neighbour directory beside it.
pub fn layer_tar(data: &[u8]) {
    let sc = scene(true);
    let (root, outside) = (&sc.inside, &sc.outside);
    fs::create_dir_all(root.join("etc")).unwrap_or_else(|e| panic!("mkdir: {e}"));
    write(&root.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n");
    link("/", &root.join("top"));

    let before = snapshot(outside);
    if let Err(e) = taskbox_image::unpack::apply_layer(root, data, "fuzz layer") {
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(
        snapshot(outside),
        before,
        "a layer reached outside the root"
    );
    // No device node but an overlay whiteout (a 0:0 character device).
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(meta) = fs::symlink_metadata(entry.path()) else {
                continue;
            };
            let ft = meta.file_type();
            if ft.is_dir() {
                stack.push(entry.path());
            }
            assert!(
                !ft.is_block_device() && (!ft.is_char_device() || meta.rdev() == 0),
                "a layer made the device node {}",
                entry.path().display()
            );
        }
    }
}

/// The tar a trace records as its workspace base, unpacked as `replay` does.
pub fn workspace_tar(data: &[u8]) {
    let sc = scene(false);
    let (target, outside) = (&sc.inside, &sc.outside);
    let tar = sc.dir.path().join("base.tar");
    fs::write(&tar, data).unwrap_or_else(|e| panic!("write: {e}"));
    let before = snapshot(outside);
    if let Err(e) = taskbox_core::replay::unpack_tar(&tar, target) {
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(
        snapshot(outside),
        before,
        "a workspace tar reached outside its directory"
    );
}

/// A shell string or argv as the model sends `exec`, checked by command rules with every verdict.
pub fn command_policy(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = shell::parse(&text);
    let words = shell::split_words(&text);
    let rules = commands();
    let sh = [
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        text.clone().into_owned(),
    ];
    let check = rules.check(&sh);
    assert!(!check.reason.is_empty(), "a verdict without a reason");
    if let Ok(words) = words {
        let check = rules.check(&words);
        assert!(!check.reason.is_empty(), "a verdict without a reason");
    }
    let argv: Vec<String> = text.split('\0').map(str::to_owned).collect();
    let _ = rules.check(&argv);
}

fn commands() -> &'static Commands {
    static COMMANDS: OnceLock<Commands> = OnceLock::new();
    COMMANDS.get_or_init(|| {
        let text = r#"
[commands]
default = "ask"
forbid = ["git push", "rm -rf /", "curl"]
ask = ["git commit", "pip install"]
allow = ["git status", "git diff", "ls", "cat", "echo", "cargo test", "python3 -m pytest"]
"#;
        match policy::parse(text, "fuzz policy") {
            Ok(p) => p.commands,
            Err(e) => panic!("the fuzz policy does not parse: {e}"),
        }
    })
}

/// A policy file: parsed (and then explained and hashed), or refused with a reason.
pub fn policy_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match policy::parse(text, "fuzz.toml") {
        Ok(p) => {
            assert!(!p.explain().is_empty());
            assert_eq!(p.hash().len(), 64);
        }
        Err(e) => assert!(!e.to_string().is_empty(), "a refusal without a reason"),
    }
}

/// An image definition: parsed, or refused with a reason.
pub fn image_def(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = taskbox_image::def::parse(text, Path::new("images/fuzz.toml")) {
        assert!(!e.to_string().is_empty(), "a refusal without a reason");
    }
}

/// Marks text the seeds plant in every recorded field: the trace page must show it escaped.
const MARK: &str = "<taskbox-fuzz";

/// A trace file: read or refused; what reads renders as text and as a page with every recorded
/// text escaped.
pub fn trace(data: &[u8]) {
    let dir = scratch();
    let path = dir.path().join("trace.jsonl");
    fs::write(&path, data).unwrap_or_else(|e| panic!("write: {e}"));
    match trace::read_trace(&path) {
        Ok(t) => {
            let _ = trace::render_text(&t);
            let html = trace_html::render_html(&t);
            assert!(
                !html.contains(MARK),
                "recorded text reached the page unescaped"
            );
        }
        Err(e) => assert!(!e.to_string().is_empty(), "a refusal without a reason"),
    }
}

/// The model's side: a tool call (first byte picks the tool, the rest is its arguments), and the
/// bytes as a model server's answer in both providers' formats.
pub fn tool_call(data: &[u8]) {
    use taskbox_agent::model::{anthropic, openai};
    use taskbox_agent::tools;
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let specs = tools::specs();
    let name = specs
        .get(usize::from(pick) % (specs.len() + 1))
        .map_or("no-such-tool", |s| s.name.as_str());
    let args = String::from_utf8_lossy(rest);
    if let Err(why) = tools::validate(name, &args) {
        assert!(!why.is_empty(), "a validation error without a message");
    }
    if let Ok(body) = serde_json::from_slice::<serde_json::Value>(rest) {
        let _ = openai::parse(&body);
        let _ = anthropic::parse(&body);
    }
}

/// A scratch tree: `inside`, where the input goes, beside `outside`, which holds a secret.
struct Scene {
    dir: tempfile::TempDir,
    inside: PathBuf,
    outside: PathBuf,
}

/// A [`Scene`]; with `links`, `inside` exists and holds `up` (-> `../outside`) and `abs` (->
/// `outside` by its absolute path).
fn scene(links: bool) -> Scene {
    let dir = scratch();
    let inside = dir.path().join("inside");
    let outside = dir.path().join("outside");
    fs::create_dir_all(&outside).unwrap_or_else(|e| panic!("mkdir: {e}"));
    write(&outside.join("secret"), "host secret\n");
    if links {
        fs::create_dir_all(&inside).unwrap_or_else(|e| panic!("mkdir: {e}"));
        link("../outside", &inside.join("up"));
        link(&outside.to_string_lossy(), &inside.join("abs"));
    }
    Scene {
        dir,
        inside,
        outside,
    }
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("taskbox-fuzz.")
        .tempdir()
        .unwrap_or_else(|e| panic!("a scratch directory: {e}"))
}

fn write(path: &Path, text: &str) {
    fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn link(target: &str, at: &Path) {
    symlink(target, at).unwrap_or_else(|e| panic!("symlink {}: {e}", at.display()));
}

/// Every entry under `dir`: its kind, mode, link count, and content or link target.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(dir)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            let what = if meta.file_type().is_symlink() {
                format!("link {:?}", fs::read_link(&path).ok())
            } else if meta.is_dir() {
                stack.push(path.clone());
                "dir".to_owned()
            } else {
                let content = fs::read(&path).unwrap_or_default();
                format!("file {:?}", String::from_utf8_lossy(&content))
            };
            out.insert(
                rel,
                format!("{what} mode {:o} links {}", meta.mode(), meta.nlink()),
            );
        }
    }
    out
}
