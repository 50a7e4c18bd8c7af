//! The sandbox verbs (`create`, `exec`, `read`, ... `rm`, `ps`, and `approvals`, `approve`,
//! `deny` for execs the command policy holds for a person): thin clients of the supervisor.
//! Each turns its flags into one API request and prints the answer for a person, or as JSON with
//! `--json`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use taskbox_server::idempotency::IdempotencyKey;

use crate::client::{Client, default_socket};

/// Where the supervisor is.
#[derive(Args, Clone)]
pub struct Conn {
    /// The supervisor's Unix socket (default: STATE/taskbox.sock; a supervisor is started there
    /// when none answers).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// State directory (default: $TASKBOX_STATE_DIR, /var/lib/taskbox for root, else
    /// ~/.local/state/taskbox).
    #[arg(long, global = true, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

impl Conn {
    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(taskbox_core::native::default_state_dir)
    }

    pub fn socket(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| default_socket(&self.state_dir()))
    }

    fn client(&self) -> Result<Client> {
        Client::connect_or_start(&self.socket(), &self.state_dir())
    }
}

#[derive(Subcommand)]
pub enum Verb {
    /// Create a long-lived sandbox and print its id.
    Create(CreateArgs),
    /// Run a command in a sandbox (output streams; exit status as for `run`).
    Exec(ExecArgs),
    /// Print a file of a sandbox: a path relative to its workspace, or absolute, anywhere in
    /// it (read as its user reads it).
    Read(ReadArgs),
    /// Write a file in a sandbox, relative to its workspace or absolute (content from --from
    /// FILE or stdin, sent as it is, of any size up to the supervisor's --max-upload-bytes).
    Write(WriteArgs),
    /// Replace exact text in a file; prints the edit's diff.
    Edit(EditArgs),
    /// Apply a unified diff (from FILE or stdin), all or nothing.
    Patch(PatchArgs),
    /// List a directory of the workspace, or by an absolute path any of the sandbox's
    /// (gitignore-aware).
    Ls(LsArgs),
    /// Search files with a regular expression (the workspace's, or under an absolute path).
    Search(SearchArgs),
    /// Show what changed since the baseline or a checkpoint.
    Diff(DiffArgs),
    /// Checkpoint the workspace under a name.
    Checkpoint(NameArgs),
    /// Roll the workspace back to a checkpoint (stops background processes).
    Restore(NameArgs),
    /// Fork a sandbox: N new sandboxes with its image, policy, environment, workspace and /tmp
    /// as they are now (or its workspace at a checkpoint), each with a lease of its own;
    /// processes are not copied. Prints the new ids, one a line.
    Fork(ForkArgs),
    /// Print the change as a patch, or write it as a tar; --apply writes it to the host workspace.
    Export(ExportArgs),
    /// Destroy sandboxes: nothing of them remains.
    Rm(RmArgs),
    /// List live sandboxes.
    #[command(alias = "list")]
    Ps(PsArgs),
    /// List execs waiting for a person's approval (the policy's [commands] ask), of all your
    /// sandboxes or of one.
    Approvals(ApprovalsArgs),
    /// Approve an exec waiting for approval: it runs.
    Approve(ApproveArgs),
    /// Deny an exec waiting for approval: it returns a violation with your reason, which the
    /// agent sees.
    Deny(DenyArgs),
    /// Replace the egress allow/deny rules of a live sandbox whose policy has network mode
    /// "proxy"; new connections are decided by them, open ones keep running.
    Network(NetworkArgs),
}

#[derive(Args)]
pub struct ApprovalsArgs {
    /// Only this sandbox's.
    sandbox: Option<String>,
    /// When none is pending, wait up to this long for one (needs SANDBOX).
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration, requires = "sandbox")]
    wait: Option<Duration>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ApproveArgs {
    /// The approval id (from `taskbox approvals`).
    approval: String,
    /// The sandbox it belongs to (default: found among your sandboxes).
    #[arg(long, value_name = "ID")]
    sandbox: Option<String>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DenyArgs {
    /// The approval id (from `taskbox approvals`).
    approval: String,
    /// Why: the agent sees it, so say what to do instead.
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
    /// The sandbox it belongs to (default: found among your sandboxes).
    #[arg(long, value_name = "ID")]
    sandbox: Option<String>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct CreateArgs {
    /// The workspace directory (default: the current directory).
    #[arg(long, value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Policy name or file.
    #[arg(long, value_name = "NAME|FILE")]
    policy: Option<String>,
    /// Lease: the sandbox is destroyed when it runs out (e.g. 30m).
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration)]
    ttl: Option<Duration>,
    /// Variables set in every exec.
    #[arg(long = "env", value_name = "K=V", value_parser = crate::parse_env)]
    env: Vec<(String, String)>,
    /// Labels kept with the sandbox.
    #[arg(long = "label", value_name = "K=V", value_parser = crate::parse_label)]
    labels: Vec<(String, String)>,
    /// The backend: native (default) or docker (the supervisor must serve it: serve --docker).
    #[arg(long, value_name = "native|docker")]
    backend: Option<String>,
    /// The image (name or digest) of the sandbox; required by the docker backend.
    #[arg(long, value_name = "NAME|DIGEST")]
    image: Option<String>,
    /// Make a retry safe: the supervisor makes one sandbox per key (of your tenant, for a day)
    /// and answers a retry with the same key and options with that sandbox. 1 to 255
    /// printable ASCII characters, e.g. a UUID.
    #[arg(long, value_name = "KEY", value_parser = parse_idempotency_key)]
    idempotency_key: Option<IdempotencyKey>,
    /// Print the sandbox's info as JSON instead of its id.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ExecArgs {
    id: String,
    /// Print the observation (ExecResult) as JSON.
    #[arg(long)]
    json: bool,
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    timeout: Option<Duration>,
    /// Working directory, relative to the workspace root or absolute.
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    #[arg(long = "env", value_name = "K=V", value_parser = crate::parse_env)]
    env: Vec<(String, String)>,
    /// Start in the background and print the process handle.
    #[arg(long)]
    background: bool,
    /// Send the command's stderr to its stdout, in the order written (as `2>&1`).
    #[arg(long)]
    merge_output: bool,
    /// Run as this user of the sandbox (a name in its /etc/passwd, or a uid) instead of its
    /// own. Other users need a supervisor run as root (a rootless sandbox has one id).
    #[arg(long, value_name = "NAME|UID")]
    user: Option<String>,
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args)]
pub struct ReadArgs {
    id: String,
    path: String,
    /// Line range, 1-based and inclusive: `10:20`, `10:` or `:20`.
    #[arg(long, value_name = "A:B")]
    lines: Option<String>,
    #[arg(long, value_name = "BYTES")]
    max_bytes: Option<u64>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct WriteArgs {
    id: String,
    path: String,
    /// Read the content from this host file instead of stdin.
    #[arg(long, value_name = "FILE")]
    from: Option<PathBuf>,
    /// Create missing parent directories.
    #[arg(long, short = 'p')]
    parents: bool,
}

#[derive(Args)]
pub struct EditArgs {
    id: String,
    path: String,
    #[arg(long)]
    old: String,
    #[arg(long)]
    new: String,
    /// How many occurrences must exist (all are replaced).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

#[derive(Args)]
pub struct PatchArgs {
    id: String,
    /// The patch file (default: stdin).
    file: Option<PathBuf>,
}

#[derive(Args)]
pub struct LsArgs {
    id: String,
    path: Option<String>,
    #[arg(long)]
    glob: Option<String>,
    #[arg(long, value_name = "N")]
    depth: Option<u32>,
    /// Include hidden and ignored entries.
    #[arg(long, short = 'a')]
    all: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct SearchArgs {
    id: String,
    pattern: String,
    path: Option<String>,
    #[arg(long)]
    glob: Option<String>,
    #[arg(long, short = 'i')]
    ignore_case: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DiffArgs {
    id: String,
    /// A checkpoint name (default: the baseline, the host copy).
    #[arg(long, value_name = "NAME")]
    since: Option<String>,
    /// Also list and diff what is left out by default: paths the workspace's git ignores and
    /// does not track, and git's own files under .git/ (the diff counts them either way).
    #[arg(long)]
    include_ignored: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ForkArgs {
    id: String,
    /// Start from this checkpoint of the sandbox (its workspace then, an empty /tmp) instead
    /// of the sandbox as it is now.
    #[arg(long, value_name = "CHECKPOINT")]
    from: Option<String>,
    /// How many sandboxes (1-64).
    #[arg(short = 'n', long = "count", value_name = "N", default_value_t = 1)]
    count: u32,
    /// Lease of each fork (default: the supervisor's).
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration)]
    ttl: Option<Duration>,
    /// Labels set on each fork, over the parent's.
    #[arg(long = "label", value_name = "K=V", value_parser = crate::parse_label)]
    labels: Vec<(String, String)>,
    /// Print the forks' info as JSON instead of their ids.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct NameArgs {
    id: String,
    name: String,
}

#[derive(Args)]
pub struct ExportArgs {
    id: String,
    #[arg(long, value_parser = ["patch", "tar"], default_value = "patch")]
    format: String,
    /// Apply the change to the host workspace.
    #[arg(long)]
    apply: bool,
    /// Export what the default diff leaves out too (ignored by git, or under .git/); without
    /// it the export carries exactly the files the default diff shows.
    #[arg(long)]
    include_ignored: bool,
    /// With --apply: also write files that tools run on their own when the repository is
    /// opened, entered, committed or pushed (.envrc, .vscode/tasks.json, git hooks, CI
    /// definitions, ...: the diff's "flagged"). Without it such an apply is refused, naming
    /// each file and what runs it, before anything is written.
    #[arg(long, requires = "apply")]
    allow_autorun: bool,
    /// With --apply: make a retry safe. The supervisor applies once per key (of your tenant,
    /// for a day) and answers a retry with the same key and options as the first time,
    /// writing nothing again. 1 to 255 printable ASCII characters, e.g. a UUID.
    #[arg(long, value_name = "KEY", requires = "apply", value_parser = parse_idempotency_key)]
    idempotency_key: Option<IdempotencyKey>,
    #[arg(long)]
    json: bool,
}

/// An `--idempotency-key`, checked as the supervisor checks it.
fn parse_idempotency_key(s: &str) -> Result<IdempotencyKey, String> {
    IdempotencyKey::parse(s.as_bytes()).map_err(|e| e.to_string())
}

#[derive(Args)]
pub struct RmArgs {
    #[arg(required = true)]
    ids: Vec<String>,
}

#[derive(Args)]
pub struct NetworkArgs {
    id: String,
    /// A host pattern to let through (repeatable): example.com, *.example.com (subdomains
    /// only), 10.0.0.0/8:443, each with an optional :PORT.
    #[arg(long = "allow", value_name = "PATTERN")]
    allow: Vec<String>,
    /// A host pattern to refuse even when allowed (repeatable).
    #[arg(long = "deny", value_name = "PATTERN")]
    deny: Vec<String>,
    /// For tests: resolve NAME to IP without DNS (repeatable).
    #[arg(long = "host", value_name = "NAME=IP", value_parser = crate::parse_label)]
    hosts: Vec<(String, String)>,
    /// Remove every rule: nothing is let through.
    #[arg(long, conflicts_with_all = ["allow", "deny", "hosts"])]
    clear: bool,
    /// Print the rules now in force as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct PsArgs {
    #[arg(long)]
    json: bool,
}

fn sandbox_path(id: &str, rest: &str) -> Result<String> {
    taskbox_core::api::SandboxId::parse(id)?;
    Ok(format!("/v1/sandboxes/{id}{rest}"))
}

/// `s` as a query value: everything but unreserved characters percent-encoded.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

fn print_json(v: &Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn kv_map(pairs: &[(String, String)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
}

/// Runs one verb; returns the process exit status.
pub fn run(verb: Verb, conn: &Conn) -> Result<u8> {
    let client = conn.client()?;
    match verb {
        v @ (Verb::Approvals(_) | Verb::Approve(_) | Verb::Deny(_)) => approvals(&client, v),
        Verb::Create(a) => {
            let workspace = match a.workspace {
                Some(w) => w,
                None => {
                    std::env::current_dir().context("cannot determine the current directory")?
                }
            };
            let workspace = std::fs::canonicalize(&workspace)
                .with_context(|| format!("workspace {} does not exist", workspace.display()))?;
            let mut body = json!({
                "workspace": workspace.display().to_string(),
                "env": kv_map(&a.env),
                "labels": kv_map(&a.labels),
            });
            if let Some(p) = a.policy {
                // The supervisor takes profile names or a policy's text, never a path: a file
                // is read here, with the caller's own rights, and sent as text.
                if taskbox_core::policy::is_path(&p) {
                    let text = taskbox_core::policy::read_policy_file(Path::new(&p))?;
                    body["policy_toml"] = json!(text);
                }
                body["policy"] = json!(p);
            }
            if let Some(t) = a.ttl {
                body["ttl_secs"] = json!(t.as_secs().max(1));
            }
            if let Some(b) = a.backend {
                body["backend"] = json!(b);
            }
            if let Some(i) = a.image {
                body["image"] = json!(i);
            }
            let r = client.request_keyed(
                "POST",
                "/v1/sandboxes",
                Some(&body),
                a.idempotency_key.as_ref(),
            )?;
            let replayed = r.replayed;
            let info = r.ok()?;
            if replayed {
                eprintln!(
                    "taskbox: the idempotency key already names sandbox {}; no new sandbox was made",
                    info["id"].as_str().unwrap_or_default()
                );
            }
            if a.json {
                print_json(&info)?;
            } else {
                println!("{}", info["id"].as_str().unwrap_or_default());
            }
            Ok(0)
        }
        Verb::Exec(a) => exec(&client, a),
        Verb::Read(a) => {
            let mut body = json!({ "path": a.path });
            if let Some(range) = &a.lines {
                let (s, e) = range
                    .split_once(':')
                    .ok_or_else(|| anyhow::anyhow!("--lines expects A:B, got {range:?}"))?;
                if !s.is_empty() {
                    body["line_start"] = json!(s.parse::<u64>().context("--lines start")?);
                }
                if !e.is_empty() {
                    body["line_end"] = json!(e.parse::<u64>().context("--lines end")?);
                }
            }
            if let Some(m) = a.max_bytes {
                body["max_bytes"] = json!(m);
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/read")?, Some(&body))?
                .ok()?;
            if a.json {
                print_json(&r)?;
            } else if r["encoding"] == "base64" {
                bail!(
                    "{} is binary ({} bytes); use --json to get it base64-encoded",
                    a.path,
                    r["total_bytes"]
                );
            } else {
                print!("{}", r["content"].as_str().unwrap_or_default());
                if r["truncated"] == true {
                    eprintln!(
                        "taskbox: output cut at {} of {} bytes (use --max-bytes or --lines)",
                        r["content"].as_str().map(str::len).unwrap_or(0),
                        r["total_bytes"]
                    );
                }
            }
            Ok(0)
        }
        Verb::Write(a) => {
            let mut content = Vec::new();
            match &a.from {
                Some(f) => {
                    content =
                        std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?
                }
                None => {
                    std::io::stdin().read_to_end(&mut content)?;
                }
            }
            // The raw bytes, as the body of the file route: no encoding, and no JSON body
            // limit (uploads have their own).
            let mut query = format!("/files?path={}", query_escape(&a.path));
            if a.parents {
                query.push_str("&create_parents=true");
            }
            let r = client
                .request_raw("PUT", &sandbox_path(&a.id, &query)?, Some(&content))?
                .ok()?;
            eprintln!(
                "taskbox: wrote {} bytes to {}{}",
                r["bytes_written"],
                a.path,
                if r["created"] == true {
                    " (new file)"
                } else {
                    ""
                }
            );
            Ok(0)
        }
        Verb::Edit(a) => {
            let mut body = json!({"path": a.path, "old": a.old, "new": a.new});
            if let Some(c) = a.count {
                body["expected_count"] = json!(c);
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/edit")?, Some(&body))?
                .ok()?;
            print!("{}", r["diff"].as_str().unwrap_or_default());
            Ok(0)
        }
        Verb::Patch(a) => {
            let patch = match &a.file {
                Some(f) => std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read {}", f.display()))?,
                None => {
                    let mut s = String::new();
                    std::io::stdin().read_to_string(&mut s)?;
                    s
                }
            };
            let r = client
                .request(
                    "POST",
                    &sandbox_path(&a.id, "/patch")?,
                    Some(&json!({"patch": patch})),
                )?
                .ok()?;
            for f in r["files"].as_array().into_iter().flatten() {
                println!(
                    "{} {}",
                    f["kind"].as_str().unwrap_or("?"),
                    f["path"].as_str().unwrap_or("?")
                );
            }
            Ok(0)
        }
        Verb::Ls(a) => {
            let mut body = json!({"include_hidden": a.all, "include_ignored": a.all});
            if let Some(p) = a.path {
                body["path"] = json!(p);
            }
            if let Some(g) = a.glob {
                body["glob"] = json!(g);
            }
            if let Some(d) = a.depth {
                body["max_depth"] = json!(d);
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/list")?, Some(&body))?
                .ok()?;
            if a.json {
                return print_json(&r).map(|_| 0);
            }
            for e in r["entries"].as_array().into_iter().flatten() {
                let kind = e["kind"].as_str().unwrap_or("?");
                let suffix = match kind {
                    "dir" => "/",
                    "symlink" => "@",
                    _ => "",
                };
                println!("{}{suffix}", e["path"].as_str().unwrap_or("?"));
            }
            if r["truncated"] == true {
                eprintln!("taskbox: listing cut at the entry limit");
            }
            Ok(0)
        }
        Verb::Search(a) => {
            let mut body = json!({"pattern": a.pattern, "case_insensitive": a.ignore_case});
            if let Some(p) = a.path {
                body["path"] = json!(p);
            }
            if let Some(g) = a.glob {
                body["glob"] = json!(g);
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/search")?, Some(&body))?
                .ok()?;
            if a.json {
                return print_json(&r).map(|_| 0);
            }
            let matches = r["matches"].as_array().cloned().unwrap_or_default();
            for m in &matches {
                println!(
                    "{}:{}:{}",
                    m["path"].as_str().unwrap_or("?"),
                    m["line_number"],
                    m["line"].as_str().unwrap_or("")
                );
            }
            // Like grep: 1 when nothing matched.
            Ok(if matches.is_empty() { 1 } else { 0 })
        }
        Verb::Diff(a) => {
            let mut body = json!({"include_ignored": a.include_ignored});
            if let Some(s) = a.since {
                body["since"] = json!(s);
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/diff")?, Some(&body))?
                .ok()?;
            if a.json {
                print_json(&r)?;
            } else {
                print!("{}", r["diff"].as_str().unwrap_or_default());
                review_notes(&r, a.include_ignored);
            }
            Ok(0)
        }
        Verb::Checkpoint(a) => {
            let r = client
                .request(
                    "POST",
                    &sandbox_path(&a.id, "/checkpoints")?,
                    Some(&json!({"name": a.name})),
                )?
                .ok()?;
            eprintln!(
                "taskbox: checkpoint {} of {} changed paths",
                a.name, r["files"]
            );
            Ok(0)
        }
        Verb::Restore(a) => {
            client
                .request(
                    "POST",
                    &sandbox_path(&a.id, "/restore")?,
                    Some(&json!({"name": a.name})),
                )?
                .ok()?;
            eprintln!("taskbox: restored checkpoint {}", a.name);
            Ok(0)
        }
        Verb::Fork(a) => {
            let mut body = json!({"count": a.count, "labels": kv_map(&a.labels)});
            if let Some(c) = a.from {
                body["checkpoint"] = json!(c);
            }
            if let Some(t) = a.ttl {
                body["ttl_secs"] = json!(t.as_secs().max(1));
            }
            let r = client
                .request("POST", &sandbox_path(&a.id, "/fork")?, Some(&body))?
                .ok()?;
            if a.json {
                return print_json(&r).map(|_| 0);
            }
            for info in r["sandboxes"].as_array().into_iter().flatten() {
                println!("{}", info["id"].as_str().unwrap_or("?"));
            }
            Ok(0)
        }
        Verb::Export(a) => {
            let r = client.request_keyed(
                "POST",
                &sandbox_path(&a.id, "/export")?,
                Some(&json!({
                    "format": a.format,
                    "apply": a.apply,
                    "include_ignored": a.include_ignored,
                    "allow_autorun": a.allow_autorun,
                })),
                a.idempotency_key.as_ref(),
            )?;
            let replayed = r.replayed;
            let r = r.ok()?;
            if a.json {
                print_json(&r)?;
            } else {
                if let Some(p) = r["patch"].as_str() {
                    print!("{p}");
                } else if let Some(t) = r["tar_path"].as_str() {
                    println!("{t}");
                }
                review_notes(&r, a.include_ignored);
            }
            let changes = r["changes"].as_array().map(Vec::len).unwrap_or(0);
            if replayed {
                eprintln!(
                    "taskbox: the idempotency key already applied these {changes} changes; \
                     nothing was written again"
                );
            } else if r["applied"] == true {
                eprintln!("taskbox: applied {changes} changes to the host workspace");
            }
            Ok(0)
        }
        Verb::Rm(a) => {
            let mut failed = false;
            for id in &a.ids {
                match client.request("DELETE", &sandbox_path(id, "")?, None)?.ok() {
                    Ok(_) => println!("{id}"),
                    Err(e) => {
                        eprintln!("taskbox: {id}: {e:#}");
                        failed = true;
                    }
                }
            }
            Ok(if failed { 125 } else { 0 })
        }
        Verb::Network(a) => {
            if !a.clear && a.allow.is_empty() && a.deny.is_empty() && a.hosts.is_empty() {
                bail!(
                    "give the new rules with --allow, --deny and --host, or --clear to allow nothing"
                );
            }
            let mut hosts = serde_json::Map::new();
            for (name, ip) in &a.hosts {
                let entry = hosts.entry(name.clone()).or_insert_with(|| json!([]));
                if let Some(list) = entry.as_array_mut() {
                    list.push(json!(ip));
                }
            }
            let body = json!({"allow": a.allow, "deny": a.deny, "hosts": hosts});
            let r = client
                .request("PUT", &sandbox_path(&a.id, "/network")?, Some(&body))?
                .ok()?;
            if a.json {
                return print_json(&r).map(|_| 0);
            }
            for key in ["allow", "deny"] {
                let list: Vec<&str> = r[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                println!(
                    "{key}: {}",
                    if list.is_empty() {
                        "(none)".to_owned()
                    } else {
                        list.join(" ")
                    }
                );
            }
            if let Some(hosts) = r["hosts"].as_object().filter(|h| !h.is_empty()) {
                for (name, ips) in hosts {
                    println!("host: {name} -> {ips}");
                }
            }
            Ok(0)
        }
        Verb::Ps(a) => {
            let r = client.request("GET", "/v1/sandboxes", None)?.ok()?;
            if a.json {
                return print_json(&r).map(|_| 0);
            }
            let list = r
                .as_array()
                .cloned()
                .or_else(|| r["sandboxes"].as_array().cloned())
                .unwrap_or_default();
            println!(
                "{:<20} {:<8} {:<12} {:<8} WORKSPACE",
                "ID", "STATE", "POLICY", "LEASE"
            );
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            for s in list {
                let lease = match s["expires_at_ms"].as_u64() {
                    Some(t) => format!("{}s", t.saturating_sub(now) / 1000),
                    None => "-".into(),
                };
                println!(
                    "{:<20} {:<8} {:<12} {:<8} {}",
                    s["id"].as_str().unwrap_or("?"),
                    s["state"].as_str().unwrap_or("?"),
                    s["policy"].as_str().unwrap_or("?"),
                    lease,
                    s["workspace"].as_str().unwrap_or("?")
                );
            }
            Ok(0)
        }
    }
}

/// The sandbox a pending approval belongs to.
fn approval_sandbox(client: &Client, approval: &str, sandbox: Option<String>) -> Result<String> {
    taskbox_core::api::ApprovalId::parse(approval)?;
    if let Some(s) = sandbox {
        return Ok(s);
    }
    let all = client.request("GET", "/v1/approvals", None)?.ok()?;
    all.as_array()
        .into_iter()
        .flatten()
        .find(|a| a["id"] == approval)
        .and_then(|a| a["sandbox"].as_str().map(str::to_owned))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "approval {approval} is not pending in any of your sandboxes: it was answered, \
                 timed out, or never existed (see `taskbox approvals`)"
            )
        })
}

fn print_approvals(list: &Value) {
    let now = taskbox_core::support::now_ms();
    let items = list.as_array().cloned().unwrap_or_default();
    if items.is_empty() {
        eprintln!("taskbox: no exec is waiting for approval");
        return;
    }
    println!(
        "{:<20} {:<20} {:<6} COMMAND (WHY)",
        "APPROVAL", "SANDBOX", "LEFT"
    );
    for a in items {
        let left = a["expires_at_ms"].as_u64().unwrap_or(0).saturating_sub(now) / 1000;
        println!(
            "{:<20} {:<20} {:<6} {}  ({})",
            a["id"].as_str().unwrap_or("?"),
            a["sandbox"].as_str().unwrap_or("?"),
            format!("{left}s"),
            a["command"].as_str().unwrap_or("?"),
            a["rule"]
                .as_str()
                .unwrap_or_else(|| a["reason"].as_str().unwrap_or("")),
        );
    }
}

fn approvals(client: &Client, verb: Verb) -> Result<u8> {
    match verb {
        Verb::Approvals(a) => {
            let r = match &a.sandbox {
                Some(id) => {
                    let mut path = sandbox_path(id, "/approvals")?;
                    if let Some(w) = a.wait {
                        path.push_str(&format!("?wait_ms={}", w.as_millis()));
                    }
                    client.request("GET", &path, None)?.ok()?
                }
                None => client.request("GET", "/v1/approvals", None)?.ok()?,
            };
            if a.json {
                print_json(&r)?;
            } else {
                print_approvals(&r);
            }
            Ok(0)
        }
        Verb::Approve(a) => {
            let sandbox = approval_sandbox(client, &a.approval, a.sandbox)?;
            let path = sandbox_path(&sandbox, &format!("/approvals/{}/approve", a.approval))?;
            let r = client.request("POST", &path, None)?.ok()?;
            if a.json {
                print_json(&r)?;
            } else {
                eprintln!(
                    "taskbox: approved {}: `{}` runs",
                    a.approval,
                    r["command"].as_str().unwrap_or("?")
                );
            }
            Ok(0)
        }
        Verb::Deny(a) => {
            let sandbox = approval_sandbox(client, &a.approval, a.sandbox)?;
            let path = sandbox_path(&sandbox, &format!("/approvals/{}/deny", a.approval))?;
            let body = json!({ "reason": a.reason });
            let r = client.request("POST", &path, Some(&body))?.ok()?;
            if a.json {
                print_json(&r)?;
            } else {
                eprintln!(
                    "taskbox: denied {}: `{}` (reason: {})",
                    a.approval,
                    r["command"].as_str().unwrap_or("?"),
                    r["denial_reason"].as_str().unwrap_or("")
                );
            }
            Ok(0)
        }
        _ => bail!("not an approvals verb"),
    }
}

fn exec(client: &Client, a: ExecArgs) -> Result<u8> {
    let mut body = json!({"argv": a.command, "env": kv_map(&a.env), "background": a.background});
    if a.merge_output {
        body["merge_output"] = json!(true);
    }
    if let Some(u) = &a.user {
        body["user"] = json!(u);
    }
    if let Some(t) = a.timeout {
        body["timeout_ms"] = json!(t.as_millis() as u64);
    }
    if let Some(c) = a.cwd {
        body["cwd"] = json!(c);
    }
    let path = sandbox_path(&a.id, "/exec")?;
    if a.json || a.background {
        let r = client.request("POST", &path, Some(&body))?.ok()?;
        print_json(&r)?;
        return Ok(exit_status(&r));
    }
    let mut result = None;
    let failed = client.stream(&path, &body, |event, data| {
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        match event {
            "stdout" => {
                let mut out = std::io::stdout();
                out.write_all(v["data"].as_str().unwrap_or_default().as_bytes())?;
                out.flush()?;
            }
            "stderr" => {
                std::io::stderr().write_all(v["data"].as_str().unwrap_or_default().as_bytes())?;
            }
            "ended" => result = Some(v["result"].clone()),
            "approval" => {
                let a = &v["approval"];
                let id = a["id"].as_str().unwrap_or("?");
                eprintln!(
                    "taskbox: waiting for a person's approval ({id}): {}\ntaskbox: answer with \
                     `taskbox approve {id}` or `taskbox deny {id} --reason TEXT`",
                    a["reason"].as_str().unwrap_or("")
                );
            }
            "answered" => {
                let a = &v["approval"];
                let id = a["id"].as_str().unwrap_or("?");
                match a["denial_reason"].as_str() {
                    Some(reason) => eprintln!("taskbox: approval {id} denied: {reason}"),
                    None => eprintln!(
                        "taskbox: approval {id} {}",
                        a["state"].as_str().unwrap_or("answered")
                    ),
                }
            }
            "error" => bail!(
                "{}",
                v["error"]["message"].as_str().unwrap_or("the exec failed")
            ),
            _ => {}
        }
        Ok(())
    })?;
    if let Some(resp) = failed {
        resp.ok()?;
    }
    let Some(r) = result else {
        bail!("the supervisor closed the stream before the command ended");
    };
    for v in r["violations"].as_array().into_iter().flatten() {
        eprintln!(
            "taskbox: {}: {}",
            v["kind"].as_str().unwrap_or("?"),
            v["detail"].as_str().unwrap_or("")
        );
    }
    Ok(exit_status(&r))
}

/// The CLI exit status of an ExecResult: the command's own, 128+N for a signal, 124 on timeout,
/// 126 when the command policy refused it.
fn exit_status(r: &Value) -> u8 {
    let refused = r["violations"]
        .as_array()
        .is_some_and(|vs| vs.iter().any(|v| v["kind"] == "command"));
    if r["timed_out"] == true {
        124
    } else if let Some(s) = r["signal"].as_u64() {
        (128 + s).min(255) as u8
    } else if let Some(c) = r["exit_code"].as_i64() {
        c.clamp(0, 255) as u8
    } else if refused {
        126
    } else {
        0
    }
}

/// What a diff or an export says beyond its patch, on stderr: how many changes it left out,
/// and the files that tools run on their own.
fn review_notes(r: &serde_json::Value, listed: bool) {
    let ignored = r["ignored"].as_u64().unwrap_or(0);
    if ignored > 0 && !listed {
        let changes = if ignored == 1 { "change" } else { "changes" };
        eprintln!(
            "taskbox: {ignored} {changes} left out (ignored by git, or under .git/); \
             --include-ignored lists them"
        );
    }
    for f in r["flagged"].as_array().into_iter().flatten() {
        let left_out = if f["ignored"] == true && !listed {
            " (left out)"
        } else {
            ""
        };
        eprintln!(
            "taskbox: flagged {}{left_out}: {}",
            f["path"].as_str().unwrap_or("?"),
            f["reason"].as_str().unwrap_or("")
        );
    }
}
