//! The conformance suite of the library API, written once over [`SandboxApi`]: the contract a
//! backend passes to be done. [`api_conformance!`](crate::api_conformance) declares every check
//! as a test on one [`Subject`]; `tests/tests/api_conformance.rs` runs it on the native backend
//! (host view and image root) and on Docker, and a new backend runs it from its own crate's tests
//! (see `docs/backends.md`). What it covers is listed in that file's header.

#![allow(clippy::unwrap_used, clippy::expect_used)] // checks fail the test by panicking

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use taskbox_core::api::*;
use taskbox_core::result::ChangeKind;

use crate::image::tree_state;
use crate::suite::{Subject, code_of, expect_code};

mod fork;
mod review;
pub use fork::*;
pub use review::*;

/// Declares every check of the suite as a `#[test]` on the subject `$subject` (an expression
/// giving an `Option<Subject>`: `None` when the backend cannot run here, its reason printed).
#[macro_export]
macro_rules! api_conformance {
    ($subject:expr) => {
        $crate::api_conformance!(@checks $subject; lifecycle_and_info, every_operation_on_an_unknown_sandbox_is_sandbox_not_found, exec_argv_shell_cwd_env_stdin_and_exits, exec_timeout_and_output_limit, exec_events_stream_in_order, background_process_wait_kill_and_stdin, read_and_write, edit_and_patch, list_search_and_stat, remove_and_rename, diff_checkpoint_restore_and_export, approvals_and_network_defaults, hostile_paths_are_refused_on_every_operation, planted_symlinks_lead_nowhere_outside_the_workspace, a_command_that_kills_all_it_can_leaves_the_sandbox_serving, binary_stdin_and_merged_output, exec_as_another_user_of_the_sandbox, a_writable_root_lets_root_add_a_user);
        $crate::api_conformance!(@checks $subject; a_fork_sees_its_parent_and_nothing_flows_between_forks, a_fork_from_a_checkpoint_starts_there, bad_forks_are_refused_and_make_nothing);
        $crate::api_conformance!(@checks $subject; changes_and_diffs_leave_out_what_git_ignores, files_that_run_on_their_own_are_flagged_and_applied_only_when_allowed, a_same_second_edit_after_a_test_run_is_never_stale, a_tree_as_deep_as_a_path_allows_is_reviewed_forked_and_removed, a_tree_deeper_than_a_path_can_name_is_refused_clearly_and_removed);
        $crate::api_conformance!(@checks $subject; absolute_paths_reach_the_sandbox_as_its_user, the_file_api_may_write_where_commands_may, permissions_bind_the_file_api_as_they_bind_commands, hostile_absolute_paths_stay_inside, error_codes_on_real_errors, large_files_stream_both_ways, spill_files_of_old_execs_make_room_and_a_running_execs_stay);
    };
    (@checks $subject:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                if let Some(s) = $subject {
                    $crate::conformance::$name(&s);
                }
            }
        )*
    };
}

// ---- helpers -----------------------------------------------------------------------------------

fn ghost() -> SandboxId {
    SandboxId::parse("sb-00000000deadbeef").unwrap()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn shell(script: &str) -> ExecRequest {
    ExecRequest {
        shell: Some(script.into()),
        ..ExecRequest::default()
    }
}

fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: Some(args.iter().map(|a| a.to_string()).collect()),
        ..ExecRequest::default()
    }
}

fn read(s: &Subject, id: &SandboxId, path: &str) -> Result<ReadResult, ApiError> {
    s.api.read(
        id,
        ReadRequest {
            path: path.into(),
            ..ReadRequest::default()
        },
    )
}

fn text(s: &Subject, id: &SandboxId, path: &str) -> String {
    read(s, id, path)
        .unwrap_or_else(|e| panic!("read {path}: {e}"))
        .content
}

fn write(s: &Subject, id: &SandboxId, path: &str, content: &str) -> Result<WriteResult, ApiError> {
    s.api.write(
        id,
        WriteRequest {
            path: path.into(),
            content: content.into(),
            ..WriteRequest::default()
        },
    )
}

fn edit(path: &str, old: &str, new: &str) -> EditRequest {
    EditRequest {
        path: path.into(),
        old: old.into(),
        new: new.into(),
        expected_count: None,
    }
}

fn patch(s: &Subject, id: &SandboxId, text: &str) -> Result<PatchResult, ApiError> {
    s.api.patch(id, PatchRequest { patch: text.into() })
}

fn stat(s: &Subject, id: &SandboxId, path: &str) -> Result<StatResult, ApiError> {
    s.api.stat(id, PathRequest { path: path.into() })
}

fn list(s: &Subject, id: &SandboxId, req: ListRequest) -> Vec<String> {
    let r = s.api.list_dir(id, req.clone()).unwrap();
    assert!(!r.truncated || req.limit.is_some(), "{r:?}");
    r.entries.into_iter().map(|e| e.path).collect()
}

fn search(s: &Subject, id: &SandboxId, req: SearchRequest) -> Vec<(String, u64)> {
    let r = s.api.search(id, req).unwrap();
    let mut found: Vec<_> = r
        .matches
        .into_iter()
        .map(|m| (m.path, m.line_number))
        .collect();
    found.sort();
    found
}

fn remove(s: &Subject, id: &SandboxId, path: &str, recursive: bool) -> Result<(), ApiError> {
    let path = path.into();
    s.api.remove(id, RemoveRequest { path, recursive })
}

fn rename(
    s: &Subject,
    id: &SandboxId,
    from: &str,
    to: &str,
    overwrite: bool,
) -> Result<(), ApiError> {
    let (from, to) = (from.into(), to.into());
    s.api.rename(
        id,
        MoveRequest {
            from,
            to,
            overwrite,
        },
    )
}

fn list_at(path: &str) -> ListRequest {
    ListRequest {
        path: Some(path.into()),
        ..ListRequest::default()
    }
}

fn pattern(p: &str) -> SearchRequest {
    SearchRequest {
        pattern: p.into(),
        ..SearchRequest::default()
    }
}

/// What every path-taking operation answers for `path` in sandbox `id`: its error code, or "ok".
fn path_ops(s: &Subject, id: &SandboxId, path: &str) -> Vec<(&'static str, &'static str)> {
    fn code<T>(r: Result<T, ApiError>) -> &'static str {
        r.map_or_else(|e| e.code(), |_| "ok")
    }
    let with_parents = WriteRequest {
        path: path.into(),
        content: "pwned\n".into(),
        create_parents: true,
        ..WriteRequest::default()
    };
    let patched = format!("--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-SECRET\n+pwned\n");
    vec![
        ("read", code(read(s, id, path))),
        ("write", code(write(s, id, path, "pwned\n"))),
        ("write with parents", code(s.api.write(id, with_parents))),
        ("edit", code(s.api.edit(id, edit(path, "SECRET", "x")))),
        ("patch", code(patch(s, id, &patched))),
        ("stat", code(stat(s, id, path))),
        ("remove", code(remove(s, id, path, true))),
        ("rename from", code(rename(s, id, path, "stolen.txt", true))),
        ("rename to", code(rename(s, id, "in.txt", path, true))),
        ("list_dir", code(s.api.list_dir(id, list_at(path)))),
        (
            "search",
            code(s.api.search(
                id,
                SearchRequest {
                    path: Some(path.into()),
                    ..pattern("SECRET")
                },
            )),
        ),
    ]
}

/// What a command of the sandbox reads at `path` (`None`: it cannot).
fn command_reads(s: &Subject, id: &SandboxId, path: &str) -> Option<String> {
    let r = s.run(id, argv(&["cat", path]));
    (r.exit_code == Some(0)).then_some(r.stdout.text)
}

/// Whether a command of the sandbox may create or overwrite `path` (it is removed again when
/// it did not exist).
fn command_writes(s: &Subject, id: &SandboxId, path: &str) -> bool {
    let script = "if [ -e \"$1\" ]; then : >> \"$1\"; else : > \"$1\" && rm -f \"$1\"; fi";
    let r = s.run(id, argv(&["/bin/sh", "-c", script, "sh", path]));
    r.exit_code == Some(0)
}

/// The file API reads `path` exactly when a command can, and the same bytes; what it is
/// refused is refused with a code that says why.
#[track_caller]
fn assert_reads_as_commands_do(s: &Subject, id: &SandboxId, path: &str) {
    let by_api = read(s, id, path);
    match (command_reads(s, id, path), by_api) {
        (Some(text), Ok(r)) => assert_eq!(r.content, text, "read {path}"),
        (None, Err(e)) => assert!(
            matches!(
                e.code(),
                "not_found" | "permission_denied" | "is_a_directory" | "not_a_directory"
            ) || (path.starts_with("/proc/") && e.code() == "path_refused"),
            "read {path}: {} ({e})",
            e.code()
        ),
        (by_command, by_api) => panic!(
            "{}: read {path}: a command reads {by_command:?}, the file API answers {by_api:?}",
            s.expect.backend
        ),
    }
}

fn changes(list: &[taskbox_core::result::Change]) -> Vec<(String, ChangeKind)> {
    let mut v: Vec<_> = list.iter().map(|c| (c.path.clone(), c.kind)).collect();
    v.sort();
    v
}

fn diff_files(d: &DiffResult) -> Vec<(String, ChangeKind)> {
    let mut v: Vec<_> = d.files.iter().map(|f| (f.path.clone(), f.status)).collect();
    v.sort();
    v
}

fn checkpoint(name: &str) -> CheckpointRequest {
    CheckpointRequest { name: name.into() }
}

/// Polls `f` until it holds or `limit` passes.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// Every entry of a host tree with its mode, size and mtime (see [`tree_state`]).
type TreeState = BTreeMap<std::path::PathBuf, (u32, u64, i64, i64)>;

/// Asserts the host copy of the workspace is as `before`: nothing reaches it before an export
/// applies.
fn assert_host_untouched(s: &Subject, before: &TreeState) {
    assert_eq!(
        &tree_state(&s.ws()),
        before,
        "{}: the host workspace changed before an export applied",
        s.expect.backend
    );
}

// ---- create, list, info, destroy ---------------------------------------------------------------

pub fn lifecycle_and_info(s: &Subject) {
    let t0 = now_ms();
    let info = s
        .api
        .create(CreateRequest {
            ttl_secs: Some(600),
            ..s.request()
        })
        .unwrap();
    let id = info.id.clone();
    assert_eq!(info.state, "running", "{info:?}");
    assert_eq!(info.policy, "default");
    assert!(!info.policy_hash.is_empty());
    assert_eq!(
        info.labels.get("suite").map(String::as_str),
        Some("api-conformance")
    );
    assert!(info.checkpoints.is_empty());
    assert!(
        info.created_at_ms + 1000 >= t0 && info.created_at_ms <= now_ms() + 1000,
        "{info:?}"
    );
    let expires = info.expires_at_ms.expect("a lease was asked for");
    assert!(
        (info.created_at_ms + 598_000..=info.created_at_ms + 602_000).contains(&expires),
        "{info:?}"
    );
    // What differs by backend is what it is: its name, and the root it runs on (the host view,
    // or the suite image by the digest the image store gives it, the same on both backends).
    assert_eq!(
        (info.backend.as_str(), info.image.as_str()),
        (s.expect.backend, s.expect.image.as_str())
    );
    // Enforcement is reported, never assumed; its values are the backend's own mechanisms:
    // native confines each exec with Landlock, Docker with its container (no Landlock inside).
    let e = &info.enforcement;
    assert!(e.seccomp, "{e:?}");
    assert_eq!(
        e.network, "none",
        "the default policy has no network: {e:?}"
    );
    assert_eq!(e.landlock, s.expect.landlock, "{e:?}");
    // An exec reports the same enforcement the info does.
    let r = s.sh(&id, "true");
    assert_eq!(&r.enforcement, e);

    let again = s.api.info(&id).unwrap();
    assert_eq!(
        (&again.id, &again.image, &again.policy_hash),
        (&id, &info.image, &info.policy_hash)
    );
    assert_eq!(again.expires_at_ms, info.expires_at_ms);

    // The create's env reaches every exec; an exec's own env goes over it.
    let r = s.run(
        &id,
        ExecRequest {
            env: BTreeMap::from([("CONF_EXEC".into(), "from-exec".into())]),
            ..shell("echo $CONF_CREATE $CONF_EXEC")
        },
    );
    assert_eq!(r.stdout.text, "from-create from-exec\n", "{r:?}");
    let r = s.run(
        &id,
        ExecRequest {
            env: BTreeMap::from([("CONF_CREATE".into(), "over".into())]),
            ..shell("echo $CONF_CREATE")
        },
    );
    assert_eq!(r.stdout.text, "over\n", "{r:?}");

    let other = s.create();
    let ids = |s: &Subject| -> Vec<SandboxId> { s.api.list().into_iter().map(|i| i.id).collect() };
    let listed = ids(s);
    assert!(
        listed.contains(&id) && listed.contains(&other),
        "{listed:?}"
    );
    s.api.destroy(&other).unwrap();
    assert!(!ids(s).contains(&other));
    expect_code(
        "info of a destroyed sandbox",
        s.api.info(&other),
        "sandbox_not_found",
    );
    expect_code("destroy twice", s.api.destroy(&other), "sandbox_not_found");
    expect_code(
        "exec in a destroyed sandbox",
        s.api.exec(&other, shell("true"), None),
        "sandbox_not_found",
    );
    assert_eq!(s.sh(&id, "echo alive").stdout.text, "alive\n");

    // Bad creates are refused with the reason, and leave nothing behind.
    let bad = |what: &str, req: CreateRequest, code: &str| {
        expect_code(what, s.api.create(req), code);
    };
    bad(
        "a missing workspace",
        CreateRequest {
            workspace: s.ws().join("missing").display().to_string(),
            ..s.request()
        },
        "invalid_argument",
    );
    bad(
        "an unknown policy",
        CreateRequest {
            policy: Some("no-such-policy-zz".into()),
            ..s.request()
        },
        "invalid_argument",
    );
    bad(
        "a malformed inline policy",
        CreateRequest {
            policy_toml: Some("[[[".into()),
            ..s.request()
        },
        "invalid_argument",
    );
    bad(
        "an upload id, which is the supervisor's",
        CreateRequest {
            workspace_id: Some("ws-0123".into()),
            ..s.request()
        },
        "invalid_argument",
    );
    if s.expect.image != "host" {
        bad(
            "an image not in the store",
            CreateRequest {
                image: Some("no-such-image-zz".into()),
                ..s.request()
            },
            "not_found",
        );
    }
    assert_eq!(ids(s), vec![id.clone()], "a refused create left a sandbox");
    s.api.destroy(&id).unwrap();
    assert!(s.api.list().is_empty());
}

pub fn every_operation_on_an_unknown_sandbox_is_sandbox_not_found(s: &Subject) {
    fn code<T>(r: Result<T, ApiError>) -> &'static str {
        r.map_or_else(|e| e.code(), |_| "ok")
    }
    let g = ghost();
    let ap = ApprovalId::parse("ap-0000000000000000").unwrap();
    let mut ops = vec![
        ("info", code(s.api.info(&g))),
        ("exec", code(s.api.exec(&g, shell("true"), None))),
        ("process", code(s.api.process(&g, 1))),
        ("wait", code(s.api.wait(&g, 1, Duration::from_millis(10)))),
        ("kill", code(s.api.kill(&g, 1, 9))),
        ("write_stdin", code(s.api.write_stdin(&g, 1, b"x", true))),
        ("diff", code(s.api.diff(&g, DiffRequest::default()))),
        ("checkpoint", code(s.api.checkpoint(&g, checkpoint("c")))),
        ("restore", code(s.api.restore(&g, checkpoint("c")))),
        ("export", code(s.api.export(&g, ExportRequest::default()))),
        ("list_approvals", code(s.api.list_approvals(&g, None))),
        ("approve", code(s.api.approve(&g, &ap))),
        ("deny", code(s.api.deny(&g, &ap, "no"))),
        (
            "set_network",
            code(s.api.set_network(&g, NetworkRules::default())),
        ),
        ("fork", code(s.api.fork(&g, ForkRequest::default()))),
        ("destroy", code(s.api.destroy(&g))),
    ];
    ops.extend(path_ops(s, &g, "a"));
    ops.extend(path_ops(s, &g, "/tmp/a"));
    let mut body: &[u8] = b"x";
    let up = UploadRequest {
        path: "/tmp/a".into(),
        ..UploadRequest::default()
    };
    ops.push(("upload", code(s.api.upload(&g, up, &mut body))));
    let down = DownloadRequest { path: "a".into() };
    let mut sink = WriteSink(Vec::new());
    ops.push(("download", code(s.api.download(&g, down, &mut sink))));
    // The sandbox is missing, not a file in it: a program can tell the two apart.
    for (op, code) in ops {
        assert_eq!(code, "sandbox_not_found", "{op} on an unknown sandbox");
    }
    // Nothing was made on the way.
    assert!(s.api.list().is_empty());
}

// ---- exec --------------------------------------------------------------------------------------

pub fn exec_argv_shell_cwd_env_stdin_and_exits(s: &Subject) {
    let id = s.create();
    // argv is given as is, never split by a shell.
    let r = s.run(&id, argv(&["/bin/echo", "a  b", "$HOME", "c"]));
    assert_eq!(r.stdout.text, "a  b $HOME c\n", "{r:?}");
    assert_eq!((r.exit_code, r.signal, r.timed_out), (Some(0), None, false));

    let r = s.sh(&id, "echo $((6 * 7)); echo oops >&2; exit 3");
    assert_eq!(
        (r.stdout.text.as_str(), r.stderr.text.as_str()),
        ("42\n", "oops\n")
    );
    assert_eq!((r.exit_code, r.signal), (Some(3), None));
    assert_eq!((r.stdout.bytes, r.stdout.truncated), (3, false));

    // Killed by a signal: the signal, no exit code.
    let r = s.sh(&id, "kill -TERM $$");
    assert_eq!((r.exit_code, r.signal), (None, Some(15)), "{r:?}");

    let r = s.run(&id, argv(&["no-such-command-zz"]));
    assert_eq!(r.exit_code, Some(127), "{r:?}");
    assert!(!r.stderr.text.is_empty(), "{r:?}");

    // Working directory: the workspace root by default, relative to it, or absolute inside.
    assert_eq!(s.sh(&id, "pwd").stdout.text, format!("{}\n", s.inside_ws()));
    s.sh(&id, "mkdir -p sub/dir");
    let at = |cwd: String| {
        s.run(
            &id,
            ExecRequest {
                cwd: Some(cwd),
                ..shell("pwd")
            },
        )
    };
    assert_eq!(
        at("sub".into()).stdout.text,
        format!("{}/sub\n", s.inside_ws())
    );
    let abs = format!("{}/sub/dir", s.inside_ws());
    assert_eq!(at(abs.clone()).stdout.text, format!("{abs}\n"));
    let cwd = |cwd: &str| {
        s.api.exec(
            &id,
            ExecRequest {
                cwd: Some(cwd.into()),
                ..shell("true")
            },
            None,
        )
    };
    expect_code("a missing cwd", cwd("no/such/dir"), "not_found");
    s.sh(&id, "echo f > a-file");
    expect_code("a cwd that is a file", cwd("a-file"), "not_a_directory");

    // Environment.
    let r = s.run(
        &id,
        ExecRequest {
            env: BTreeMap::from([("CONF_VAR".into(), "x  y".into())]),
            ..shell("printf '%s\\n' \"$CONF_VAR\"")
        },
    );
    assert_eq!(r.stdout.text, "x  y\n");
    for bad in ["", "A=B", "NUL\0"] {
        expect_code(
            &format!("env name {bad:?}"),
            s.api.exec(
                &id,
                ExecRequest {
                    env: BTreeMap::from([(bad.to_string(), "v".into())]),
                    ..shell("true")
                },
                None,
            ),
            "invalid_argument",
        );
    }

    // Stdin: the text given, then end of file; without it, empty.
    let r = s.run(
        &id,
        ExecRequest {
            stdin: Some("one\ntwo\n".into()),
            ..argv(&["/bin/cat"])
        },
    );
    assert_eq!(r.stdout.text, "one\ntwo\n");
    let r = s.run(&id, argv(&["/bin/cat"]));
    assert_eq!((r.exit_code, r.stdout.text.as_str()), (Some(0), ""));

    // Malformed requests.
    for (what, req) in [
        ("neither argv nor shell", ExecRequest::default()),
        (
            "both argv and shell",
            ExecRequest {
                shell: Some("true".into()),
                ..argv(&["true"])
            },
        ),
        ("an empty argv", argv(&[])),
        ("a NUL byte in argv", argv(&["/bin/echo", "a\0b"])),
        (
            "a zero timeout",
            ExecRequest {
                timeout_ms: Some(0),
                ..shell("true")
            },
        ),
    ] {
        expect_code(what, s.api.exec(&id, req, None), "invalid_argument");
    }

    // An exec reports what it changed in the workspace, and only that.
    let r = s.sh(&id, "echo x > made.txt; echo y > sub/dir/deep.txt");
    assert_eq!(
        changes(&r.changes),
        [
            ("made.txt".into(), ChangeKind::Added),
            ("sub/dir/deep.txt".into(), ChangeKind::Added)
        ]
    );
    let r = s.sh(&id, "rm made.txt");
    assert_eq!(
        changes(&r.changes),
        [("made.txt".into(), ChangeKind::Deleted)]
    );
    assert!(!s.ws().join("sub").exists(), "the host workspace changed");
}

pub fn exec_timeout_and_output_limit(s: &Subject) {
    let id = s.create();
    let start = Instant::now();
    let r = s.run(
        &id,
        ExecRequest {
            timeout_ms: Some(700),
            ..shell("echo partial; sleep 30.123 & sleep 30.123")
        },
    );
    assert!(r.timed_out, "{r:?}");
    assert_eq!(r.stdout.text, "partial\n", "partial output is kept");
    assert!(r.exit_code.is_none(), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    // The whole tree went with it: nothing of it is left in the sandbox.
    let r = s.sh(
        &id,
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | \
         grep -c 'slee[p] 30.123'",
    );
    assert_eq!(r.stdout.text.trim(), "0", "{r:?}");

    // Output beyond the limit: head and tail kept, the whole stream readable through `read`.
    let total = (1..=20000u32)
        .map(|n| n.to_string().len() as u64 + 1)
        .sum::<u64>();
    let r = s.run(
        &id,
        ExecRequest {
            output_limit: Some(1000),
            ..shell("seq 1 20000")
        },
    );
    assert_eq!(r.exit_code, Some(0));
    assert!(r.stdout.truncated, "{:?}", r.stdout);
    assert_eq!(r.stdout.bytes, total);
    assert!(
        r.stdout.text.len() <= 1200,
        "{} bytes kept",
        r.stdout.text.len()
    );
    assert!(
        r.stdout.text.starts_with("1\n2\n3\n"),
        "head: {:?}",
        r.stdout.text
    );
    assert!(
        r.stdout.text.ends_with("19999\n20000\n"),
        "tail: {:?}",
        r.stdout.text
    );
    let spill = r.stdout.spill_path.clone().expect("a spill file");
    let full = s
        .api
        .read(
            &id,
            ReadRequest {
                path: spill.clone(),
                max_bytes: Some(1 << 20),
                ..ReadRequest::default()
            },
        )
        .unwrap_or_else(|e| panic!("read the spill file {spill}: {e}"));
    assert_eq!(full.total_bytes, total);
    assert!(full.content.starts_with("1\n2\n") && full.content.ends_with("20000\n"));
    // Under the limit nothing is cut or spilled.
    let r = s.sh(&id, "seq 1 10");
    assert_eq!(
        (r.stdout.truncated, r.stdout.spill_path.as_deref()),
        (false, None)
    );
}

/// A long-lived sandbox keeps the spill files of its latest execs only (they live on its disk
/// quota): an older one's path gets an error that says so, and a background exec's file is
/// never removed while it writes.
pub fn spill_files_of_old_execs_make_room_and_a_running_execs_stay(s: &Subject) {
    use taskbox_core::kit::slots::SPILL_KEEP_EXECS;
    let id = s.create();
    let spilled = |s: &Subject, n: usize| -> String {
        let r = s.run(
            &id,
            ExecRequest {
                output_limit: Some(100),
                ..shell(&format!("seq 1 {}", 1000 + n))
            },
        );
        r.stdout.spill_path.clone().expect("a spill file")
    };
    // A background exec that spills, still running past every later exec.
    let bg = s.background(
        &id,
        ExecRequest {
            output_limit: Some(100),
            ..shell("seq 1 5000; while :; do sleep 0.05; done")
        },
    );
    let exec_id = bg.exec_id;
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.api.process(&id, exec_id).unwrap().stdout.bytes < 23893 {
        assert!(
            Instant::now() < deadline,
            "the background exec wrote nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let paths: Vec<String> = (0..SPILL_KEEP_EXECS + 4).map(|n| spilled(s, n)).collect();
    let listing = s.sh(&id, "ls /tmp/.taskbox/out | sort -n").stdout.text;
    let files: Vec<&str> = listing.lines().collect();
    // The latest SPILL_KEEP_EXECS ended execs, and the running one.
    assert_eq!(files.len(), SPILL_KEEP_EXECS + 1, "{listing}");
    let bg_file = format!("{exec_id}.stdout");
    assert!(files.contains(&bg_file.as_str()), "{listing}");
    for (n, p) in paths.iter().enumerate() {
        let r = s.api.read(
            &id,
            ReadRequest {
                path: p.clone(),
                ..ReadRequest::default()
            },
        );
        if n < 4 {
            let e = r.expect_err("an old exec's spill file is gone");
            assert!(
                matches!(e, ApiError::NotFound(_)) && e.to_string().contains("latest"),
                "{e}"
            );
        } else {
            let r = r.unwrap_or_else(|e| panic!("{p}: {e}"));
            assert_eq!(
                r.total_bytes,
                (1..=1000 + n)
                    .map(|i| i.to_string().len() as u64 + 1)
                    .sum::<u64>()
            );
        }
    }
    s.api.kill(&id, exec_id, 9).unwrap();
}

pub fn exec_events_stream_in_order(s: &Subject) {
    let id = s.create();
    let mut events = Vec::new();
    let out = {
        let mut sink = |e: ExecEvent| events.push(e);
        s.api
            .exec(
                &id,
                shell("echo a; echo b >&2; echo c; exit 4"),
                Some(&mut sink),
            )
            .unwrap()
    };
    let ExecOutcome::Finished(result) = out else {
        panic!("{out:?}")
    };
    assert_eq!(result.exit_code, Some(4));
    let (first, rest) = events.split_first().expect("events");
    assert!(matches!(first, ExecEvent::Started { .. }), "{events:?}");
    let (ended, middle) = match rest.split_last() {
        Some((ExecEvent::Ended { result: ended }, middle)) => {
            assert_eq!(**ended, result, "the ended event carries the result");
            (true, middle)
        }
        _ => (false, rest),
    };
    // The stream ends with the result on every backend (the kit sends it).
    assert!(ended, "no ended event: {events:?}");
    let (mut out, mut err) = (String::new(), String::new());
    for e in middle {
        match e {
            ExecEvent::Stdout { data } => out.push_str(data),
            ExecEvent::Stderr { data } => err.push_str(data),
            other => panic!("between started and ended: {other:?}"),
        }
    }
    assert_eq!((out.as_str(), err.as_str()), ("a\nc\n", "b\n"));
    assert_eq!(
        (result.stdout.text.as_str(), result.stderr.text.as_str()),
        ("a\nc\n", "b\n")
    );
    // A refused exec ends before it starts: an error, and no event.
    let mut events = Vec::new();
    let r = {
        let mut sink = |e: ExecEvent| events.push(e);
        s.api.exec(&id, ExecRequest::default(), Some(&mut sink))
    };
    expect_code("an empty exec, streamed", r, "invalid_argument");
    assert!(events.is_empty(), "{events:?}");
}

pub fn background_process_wait_kill_and_stdin(s: &Subject) {
    let id = s.create();
    let cat = s.background(&id, argv(&["/bin/cat"]));
    assert!(cat.running && cat.result.is_none(), "{cat:?}");
    assert_eq!(cat.argv, ["/bin/cat"]);
    s.api
        .write_stdin(&id, cat.exec_id, b"hello\n", false)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || {
            s.api.process(&id, cat.exec_id).unwrap().stdout.text == "hello\n"
        }),
        "{:?}",
        s.api.process(&id, cat.exec_id)
    );
    // A foreground exec runs meanwhile.
    assert_eq!(s.sh(&id, "echo between").stdout.text, "between\n");
    s.api.write_stdin(&id, cat.exec_id, b"bye\n", true).unwrap();
    let done = s
        .api
        .wait(&id, cat.exec_id, Duration::from_secs(10))
        .unwrap();
    assert!(!done.running, "{done:?}");
    let r = done.result.clone().expect("a result once ended");
    assert_eq!(
        (r.exit_code, r.stdout.text.as_str()),
        (Some(0), "hello\nbye\n")
    );
    assert_eq!(s.api.process(&id, cat.exec_id).unwrap().result, Some(r));
    expect_code(
        "write_stdin to an ended process",
        s.api.write_stdin(&id, cat.exec_id, b"late\n", false),
        "conflict",
    );

    // Stdin given up front is all it gets.
    let given = s.background(
        &id,
        ExecRequest {
            stdin: Some("given\n".into()),
            ..argv(&["/bin/cat"])
        },
    );
    let p = s
        .api
        .wait(&id, given.exec_id, Duration::from_secs(10))
        .unwrap();
    assert_eq!(p.result.map(|r| r.stdout.text), Some("given\n".into()));

    // Waiting less than it runs returns it still running; kill ends it by the signal.
    let sleeper = s.background(&id, shell("echo ready; exec sleep 300"));
    assert_eq!(
        sleeper.argv,
        ["/bin/sh", "-c", "echo ready; exec sleep 300"]
    );
    let t = Instant::now();
    let p = s
        .api
        .wait(&id, sleeper.exec_id, Duration::from_millis(300))
        .unwrap();
    assert!(p.running && p.result.is_none(), "{p:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert!(eventually(Duration::from_secs(10), || {
        s.api.process(&id, sleeper.exec_id).unwrap().stdout.text == "ready\n"
    }));
    for bad in [0, -1, 65] {
        expect_code(
            &format!("signal {bad}"),
            s.api.kill(&id, sleeper.exec_id, bad),
            "invalid_argument",
        );
    }
    s.api.kill(&id, sleeper.exec_id, 15).unwrap();
    let p = s
        .api
        .wait(&id, sleeper.exec_id, Duration::from_secs(10))
        .unwrap();
    let r = p.result.expect("ended by the signal");
    assert_eq!((r.exit_code, r.signal), (None, Some(15)), "{r:?}");

    // A signal sent at once, before the backend has seen the process start, still reaches it
    // (it once was lost: native before pid 1 reported the pid, Docker before its wrapper ran).
    for signal in [15, 9, 15] {
        let p = s.background(&id, argv(&["sleep", "300"]));
        s.api.kill(&id, p.exec_id, signal).unwrap();
        let p = s.api.wait(&id, p.exec_id, Duration::from_secs(10)).unwrap();
        let r = p.result.expect("ended by the signal sent at once");
        assert_eq!(r.signal, Some(signal), "{r:?}");
    }
    let tree = s.background(&id, shell("echo ready; sleep 300 & sleep 300"));
    assert!(eventually(Duration::from_secs(10), || {
        s.api.process(&id, tree.exec_id).unwrap().stdout.text == "ready\n"
    }));
    s.api.kill(&id, tree.exec_id, 9).unwrap();
    let p = s
        .api
        .wait(&id, tree.exec_id, Duration::from_secs(10))
        .unwrap();
    assert_eq!(p.result.map(|r| r.signal), Some(Some(9)));
    // Killing what has ended changes nothing.
    let again = s.api.kill(&id, tree.exec_id, 9).unwrap();
    assert!(!again.running);

    // Ids no exec has.
    let none = 424_242;
    for (what, r) in [
        ("process", s.api.process(&id, none)),
        ("wait", s.api.wait(&id, none, Duration::from_millis(10))),
        ("kill", s.api.kill(&id, none, 9)),
    ] {
        expect_code(&format!("{what} of an unknown exec id"), r, "not_found");
    }
    expect_code(
        "write_stdin of an unknown exec id",
        s.api.write_stdin(&id, none, b"x", true),
        "not_found",
    );
}

// ---- files -------------------------------------------------------------------------------------

pub fn read_and_write(s: &Subject) {
    s.env.write("lines.txt", "l1\nl2\nl3\nl4\n");
    let before = tree_state(&s.ws());
    let id = s.create();

    // Reads: whole, line ranges, byte ranges, capped.
    let r = read(s, &id, "lines.txt").unwrap();
    assert_eq!(r.content, "l1\nl2\nl3\nl4\n");
    assert_eq!(
        (r.encoding.as_str(), r.total_bytes, r.total_lines),
        ("utf-8", 12, Some(4))
    );
    assert!(!r.truncated && !r.binary);
    let ranged = |req: ReadRequest| {
        s.api
            .read(
                &id,
                ReadRequest {
                    path: "lines.txt".into(),
                    ..req
                },
            )
            .map(|r| (r.content, r.truncated))
    };
    let lines = |a, b| ReadRequest {
        line_start: Some(a),
        line_end: Some(b),
        ..ReadRequest::default()
    };
    assert_eq!(ranged(lines(2, 3)).unwrap().0, "l2\nl3\n");
    assert_eq!(
        ranged(ReadRequest {
            line_start: Some(3),
            ..ReadRequest::default()
        })
        .unwrap()
        .0,
        "l3\nl4\n"
    );
    assert_eq!(
        ranged(ReadRequest {
            offset: Some(3),
            length: Some(4),
            ..ReadRequest::default()
        })
        .unwrap()
        .0,
        "l2\nl"
    );
    assert_eq!(
        ranged(ReadRequest {
            max_bytes: Some(5),
            ..ReadRequest::default()
        })
        .unwrap(),
        ("l1\nl2".into(), true)
    );
    expect_code(
        "a line and a byte range at once",
        ranged(ReadRequest {
            line_start: Some(1),
            offset: Some(0),
            ..ReadRequest::default()
        }),
        "invalid_argument",
    );
    expect_code(
        "line 0 (lines are 1-based)",
        ranged(lines(0, 1)),
        "invalid_argument",
    );
    expect_code("a missing file", read(s, &id, "missing.txt"), "not_found");
    s.sh(&id, "mkdir adir");
    expect_code("a directory", read(s, &id, "adir"), "is_a_directory");
    // Absolute paths inside the workspace are the workspace's.
    assert_eq!(
        text(s, &id, &format!("{}/lines.txt", s.inside_ws())),
        "l1\nl2\nl3\nl4\n"
    );

    // Writes: new, over, with parents, a mode, base64; each visible to the next exec.
    let w = write(s, &id, "new.txt", "new\n").unwrap();
    assert_eq!((w.bytes_written, w.created), (4, true));
    let w = write(s, &id, "new.txt", "newer\n").unwrap();
    assert_eq!((w.bytes_written, w.created), (6, false));
    assert_eq!(s.sh(&id, "cat new.txt").stdout.text, "newer\n");
    expect_code(
        "a missing parent without create_parents",
        write(s, &id, "a/b/c.txt", "x"),
        "not_found",
    );
    s.api
        .write(
            &id,
            WriteRequest {
                path: "a/b/run.sh".into(),
                content: "#!/bin/sh\necho ran\n".into(),
                create_parents: true,
                mode: Some(0o755),
                ..WriteRequest::default()
            },
        )
        .unwrap();
    assert_eq!(s.sh(&id, "./a/b/run.sh").stdout.text, "ran\n");
    assert_eq!(stat(s, &id, "a/b/run.sh").unwrap().mode & 0o7777, 0o755);
    assert_eq!(stat(s, &id, "new.txt").unwrap().mode & 0o7777, 0o644);
    let b64 = |content: &str, encoding: &str| {
        s.api.write(
            &id,
            WriteRequest {
                path: "blob.bin".into(),
                content: content.into(),
                encoding: Some(encoding.into()),
                ..WriteRequest::default()
            },
        )
    };
    assert_eq!(b64("AAEC/w==", "base64").unwrap().bytes_written, 4);
    assert_eq!(
        s.sh(&id, "od -An -tx1 blob.bin").stdout.text.trim(),
        "00 01 02 ff"
    );
    let r = read(s, &id, "blob.bin").unwrap();
    assert_eq!(
        (r.encoding.as_str(), r.content.as_str(), r.binary),
        ("base64", "AAEC/w==", true)
    );
    expect_code(
        "bad base64",
        b64("not base64!", "base64"),
        "invalid_argument",
    );
    expect_code(
        "an unknown encoding",
        b64("x", "latin1"),
        "invalid_argument",
    );
    expect_code(
        "writing over a directory",
        write(s, &id, "adir", "x"),
        "is_a_directory",
    );
    // What an exec writes, read sees.
    s.sh(&id, "printf 'from exec' > by-exec.txt");
    assert_eq!(text(s, &id, "by-exec.txt"), "from exec");
    assert_host_untouched(s, &before);
}

pub fn edit_and_patch(s: &Subject) {
    s.env.write("e.txt", "one two one\n");
    s.env.write("p1.txt", "a\nb\nc\n");
    s.env.write("p2.txt", "x\ny\nz\n");
    let before = tree_state(&s.ws());
    let id = s.create();

    let e = s.api.edit(&id, edit("e.txt", "two", "2")).unwrap();
    assert_eq!(e.replacements, 1);
    assert!(
        e.diff.contains("-one two one") && e.diff.contains("+one 2 one"),
        "{}",
        e.diff
    );
    expect_code(
        "old text that does not occur",
        s.api.edit(&id, edit("e.txt", "three", "3")),
        "edit_not_found",
    );
    expect_code(
        "old text that occurs twice",
        s.api.edit(&id, edit("e.txt", "one", "1")),
        "edit_ambiguous",
    );
    assert_eq!(
        text(s, &id, "e.txt"),
        "one 2 one\n",
        "a refused edit changed the file"
    );
    let e = s
        .api
        .edit(
            &id,
            EditRequest {
                expected_count: Some(2),
                ..edit("e.txt", "one", "1")
            },
        )
        .unwrap();
    assert_eq!(e.replacements, 2);
    assert_eq!(s.sh(&id, "cat e.txt").stdout.text, "1 2 1\n");
    for (what, req, code) in [
        (
            "fewer occurrences than expected",
            EditRequest {
                expected_count: Some(5),
                ..edit("e.txt", "1", "one")
            },
            "edit_not_found",
        ),
        (
            "an expected count of zero",
            EditRequest {
                expected_count: Some(0),
                ..edit("e.txt", "1", "one")
            },
            "invalid_argument",
        ),
        ("empty old text", edit("e.txt", "", "x"), "invalid_argument"),
    ] {
        expect_code(what, s.api.edit(&id, req), code);
    }
    expect_code(
        "edit of a missing file",
        s.api.edit(&id, edit("missing.txt", "a", "b")),
        "not_found",
    );

    // A patch over several files applies whole.
    let good = "--- a/p1.txt\n+++ b/p1.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n\
                --- /dev/null\n+++ b/new/p3.txt\n@@ -0,0 +1 @@\n+three\n";
    let p = patch(s, &id, good).unwrap();
    assert_eq!(
        changes(&p.files),
        [
            ("new/p3.txt".into(), ChangeKind::Added),
            ("p1.txt".into(), ChangeKind::Modified)
        ]
    );
    assert_eq!(
        s.sh(&id, "cat p1.txt new/p3.txt").stdout.text,
        "a\nB\nc\nthree\n"
    );

    // ... or not at all: the second file's hunk does not apply, so the first is not changed and
    // the new file not made.
    let failing = "--- a/p1.txt\n+++ b/p1.txt\n@@ -1,3 +1,3 @@\n a\n-B\n+BB\n c\n\
                   --- /dev/null\n+++ b/p4.txt\n@@ -0,0 +1 @@\n+four\n\
                   --- a/p2.txt\n+++ b/p2.txt\n@@ -1,3 +1,3 @@\n x\n-nope\n+y2\n z\n";
    expect_code(
        "a patch with a failing hunk",
        patch(s, &id, failing),
        "patch_failed",
    );
    assert_eq!(text(s, &id, "p1.txt"), "a\nB\nc\n");
    assert_eq!(text(s, &id, "p2.txt"), "x\ny\nz\n");
    expect_code(
        "the failed patch's new file",
        stat(s, &id, "p4.txt"),
        "not_found",
    );
    expect_code(
        "a patch of a missing file",
        patch(
            s,
            &id,
            "--- a/gone.txt\n+++ b/gone.txt\n@@ -1 +1 @@\n-a\n+b\n",
        ),
        "patch_failed",
    );
    expect_code(
        "text that is no patch",
        patch(s, &id, "hello\n"),
        "invalid_argument",
    );
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert_eq!(
        diff_files(&d),
        [
            ("e.txt".into(), ChangeKind::Modified),
            ("new/p3.txt".into(), ChangeKind::Added),
            ("p1.txt".into(), ChangeKind::Modified)
        ]
    );
    assert_host_untouched(s, &before);
}

pub fn list_search_and_stat(s: &Subject) {
    for (path, content) in [
        ("README.md", "read me\n"),
        ("src/lib.rs", "fn alpha() {}\nfn Beta() {}\n"),
        ("src/deep/x/y.rs", "// y\nfn gamma() {}\n"),
        (".hidden", "fn hidden() {}\n"),
        (".gitignore", "target/\n*.log\n"),
        ("target/out.rs", "fn ignored() {}\n"),
        ("notes.log", "fn logged() {}\n"),
    ] {
        s.env.write(path, content);
    }
    let id = s.create();
    let ls = |req: ListRequest| list(s, &id, req);
    assert_eq!(ls(ListRequest::default()), ["README.md", "src"]);
    assert_eq!(
        ls(ListRequest {
            max_depth: Some(2),
            ..ListRequest::default()
        }),
        ["README.md", "src", "src/deep", "src/lib.rs"]
    );
    assert_eq!(
        ls(ListRequest {
            glob: Some("**/*.rs".into()),
            ..ListRequest::default()
        }),
        ["src/deep/x/y.rs", "src/lib.rs"]
    );
    assert_eq!(
        ls(ListRequest {
            glob: Some("**/*.rs".into()),
            include_ignored: true,
            ..ListRequest::default()
        }),
        ["src/deep/x/y.rs", "src/lib.rs", "target/out.rs"]
    );
    assert_eq!(
        ls(ListRequest {
            include_hidden: true,
            ..ListRequest::default()
        }),
        [".gitignore", ".hidden", "README.md", "src"]
    );
    assert_eq!(ls(list_at("src")), ["src/deep", "src/lib.rs"]);
    let capped = s
        .api
        .list_dir(
            &id,
            ListRequest {
                max_depth: Some(5),
                limit: Some(2),
                ..ListRequest::default()
            },
        )
        .unwrap();
    assert_eq!((capped.entries.len(), capped.truncated), (2, true));
    let entries = s.api.list_dir(&id, ListRequest::default()).unwrap().entries;
    assert_eq!(
        entries.iter().map(|e| (e.kind, e.size)).next(),
        Some((EntryKind::File, 8))
    );
    assert_eq!(entries[1].kind, EntryKind::Dir);
    let bad_list = |path: &str| s.api.list_dir(&id, list_at(path));
    expect_code("list of a missing directory", bad_list("nope"), "not_found");
    expect_code("list of a file", bad_list("README.md"), "not_a_directory");
    expect_code(
        "an invalid glob",
        s.api.list_dir(
            &id,
            ListRequest {
                glob: Some("a[".into()),
                ..ListRequest::default()
            },
        ),
        "invalid_argument",
    );

    let find = |req: SearchRequest| search(s, &id, req);
    let pat = pattern;
    assert_eq!(
        find(pat("fn [a-z]+")),
        [("src/deep/x/y.rs".into(), 2), ("src/lib.rs".into(), 1)]
    );
    assert_eq!(
        find(SearchRequest {
            case_insensitive: true,
            ..pat("fn [a-z]+")
        }),
        [
            ("src/deep/x/y.rs".into(), 2),
            ("src/lib.rs".into(), 1),
            ("src/lib.rs".into(), 2)
        ]
    );
    assert_eq!(
        find(SearchRequest {
            glob: Some("**/y.rs".into()),
            ..pat("fn")
        }),
        [("src/deep/x/y.rs".into(), 2)]
    );
    assert_eq!(
        find(SearchRequest {
            path: Some("src/deep".into()),
            ..pat("fn")
        }),
        [("src/deep/x/y.rs".into(), 2)]
    );
    assert_eq!(
        find(SearchRequest {
            include_hidden: true,
            include_ignored: true,
            ..pat("fn (hidden|ignored|logged)")
        }),
        [
            (".hidden".into(), 1),
            ("notes.log".into(), 1),
            ("target/out.rs".into(), 1)
        ]
    );
    let m = s.api.search(&id, pat("alpha")).unwrap();
    assert_eq!(m.matches.len(), 1);
    assert_eq!(m.matches[0].line, "fn alpha() {}");
    let capped = s
        .api
        .search(
            &id,
            SearchRequest {
                max_matches: Some(1),
                ..pat("fn")
            },
        )
        .unwrap();
    assert_eq!((capped.matches.len(), capped.truncated), (1, true));
    expect_code(
        "an invalid regex",
        s.api.search(&id, pat("(")),
        "invalid_argument",
    );

    let st = stat(s, &id, "README.md").unwrap();
    assert_eq!(
        (st.kind, st.size, st.mode & 0o777),
        (EntryKind::File, 8, 0o644)
    );
    assert!(st.modified_ms > 0 && st.symlink_target.is_none());
    assert_eq!(stat(s, &id, "src").unwrap().kind, EntryKind::Dir);
    s.sh(&id, "ln -s README.md link");
    let st = stat(s, &id, "link").unwrap();
    assert_eq!(
        (st.kind, st.symlink_target.as_deref()),
        (EntryKind::Symlink, Some("README.md"))
    );
    expect_code("stat of a missing path", stat(s, &id, "nope"), "not_found");
}

pub fn remove_and_rename(s: &Subject) {
    s.env.write("r/a.txt", "a\n");
    s.env.write("r/sub/b.txt", "b\n");
    s.env.write("one.txt", "1\n");
    s.env.write("two.txt", "2\n");
    let before = tree_state(&s.ws());
    let id = s.create();
    let mv = |from: &str, to: &str, overwrite: bool| rename(s, &id, from, to, overwrite);
    let rm = |path: &str, recursive: bool| remove(s, &id, path, recursive);
    mv("one.txt", "moved.txt", false).unwrap();
    assert_eq!(text(s, &id, "moved.txt"), "1\n");
    expect_code("the old name", read(s, &id, "one.txt"), "not_found");
    expect_code(
        "rename onto a file without overwrite",
        mv("moved.txt", "two.txt", false),
        "conflict",
    );
    assert_eq!(text(s, &id, "two.txt"), "2\n");
    mv("moved.txt", "two.txt", true).unwrap();
    assert_eq!(
        s.sh(&id, "cat two.txt; ls moved.txt 2>&1 >/dev/null | wc -l")
            .stdout
            .text,
        "1\n1\n"
    );
    expect_code(
        "rename of a missing path",
        mv("nope", "x", false),
        "not_found",
    );
    expect_code(
        "rename into a missing directory",
        mv("two.txt", "no/dir/x", false),
        "not_found",
    );
    // A directory made in the sandbox moves like a file.
    s.sh(&id, "mkdir -p made/inner && echo m > made/inner/m.txt");
    mv("made", "made-moved", false).unwrap();
    assert_eq!(text(s, &id, "made-moved/inner/m.txt"), "m\n");
    rm("made-moved", true).unwrap();
    // A directory of the host workspace (in the overlay's lower layer, which overlayfs moves
    // only by copying: EXDEV) moves too, with what it holds, its modes and its links; onto an
    // existing name only with overwrite.
    s.sh(&id, "chmod 750 r/sub && ln -s b.txt r/sub/link");
    expect_code(
        "rename of a host directory onto a taken name",
        mv("r/sub", "r/a.txt", false),
        "conflict",
    );
    mv("r/sub", "sub-moved", false).unwrap();
    let r = s.sh(
        &id,
        "cat sub-moved/b.txt && readlink sub-moved/link && stat -c %a sub-moved && ! test -e r/sub",
    );
    assert_eq!(
        (r.exit_code, r.stdout.text.as_str()),
        (Some(0), "b\nb.txt\n750\n"),
        "{r:?}"
    );
    mv("sub-moved", "r/sub", false).unwrap();
    assert_eq!(text(s, &id, "r/sub/b.txt"), "b\n");

    expect_code(
        "remove of a non-empty directory, not recursive",
        rm("r", false),
        "is_a_directory",
    );
    assert_eq!(text(s, &id, "r/a.txt"), "a\n");
    rm("r", true).unwrap();
    expect_code("a removed tree", stat(s, &id, "r"), "not_found");
    assert_eq!(s.sh(&id, "test -e r || echo gone").stdout.text, "gone\n");
    rm("two.txt", false).unwrap();
    expect_code("remove twice", rm("two.txt", false), "not_found");
    expect_code("remove of the root", rm(".", true), "path_refused");
    // A directory, even an empty one, goes only with recursive.
    s.sh(&id, "mkdir empty");
    expect_code(
        "remove of an empty directory",
        rm("empty", false),
        "is_a_directory",
    );
    rm("empty", true).unwrap();
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert_eq!(
        diff_files(&d),
        [
            ("one.txt".into(), ChangeKind::Deleted),
            ("r/a.txt".into(), ChangeKind::Deleted),
            ("r/sub/b.txt".into(), ChangeKind::Deleted),
            ("two.txt".into(), ChangeKind::Deleted)
        ]
    );
    assert_host_untouched(s, &before);
}

// ---- diff, checkpoints, export -----------------------------------------------------------------

pub fn diff_checkpoint_restore_and_export(s: &Subject) {
    s.env.write("a.txt", "a\n");
    s.env.write("keep.txt", "k\n");
    let before = tree_state(&s.ws());
    let id = s.create();
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert!(d.files.is_empty() && d.diff.is_empty(), "{d:?}");
    assert_eq!(d.stats.files, 0);

    write(s, &id, "a.txt", "a2\n").unwrap();
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert_eq!(diff_files(&d), [("a.txt".into(), ChangeKind::Modified)]);
    assert!(d.diff.contains("-a\n+a2\n"), "{}", d.diff);
    assert_eq!(
        (d.stats.files, d.stats.insertions, d.stats.deletions),
        (1, 1, 1)
    );

    let c = s.api.checkpoint(&id, checkpoint("one")).unwrap();
    assert_eq!((c.name.as_str(), c.files), ("one", 1));
    assert_eq!(s.api.info(&id).unwrap().checkpoints, ["one"]);
    expect_code(
        "a taken name",
        s.api.checkpoint(&id, checkpoint("one")),
        "conflict",
    );
    for bad in ["../x", "a/b", "", "sp ace"] {
        expect_code(
            &format!("checkpoint name {bad:?}"),
            s.api.checkpoint(&id, checkpoint(bad)),
            "invalid_argument",
        );
    }

    s.sh(&id, "echo b > b.txt; rm keep.txt");
    let since = |name: &str| {
        s.api.diff(
            &id,
            DiffRequest {
                since: Some(name.into()),
                ..Default::default()
            },
        )
    };
    assert_eq!(
        diff_files(&since("one").unwrap()),
        [
            ("b.txt".into(), ChangeKind::Added),
            ("keep.txt".into(), ChangeKind::Deleted)
        ]
    );
    expect_code(
        "diff since an unknown checkpoint",
        since("nope"),
        "not_found",
    );
    expect_code(
        "restore of an unknown checkpoint",
        s.api.restore(&id, checkpoint("nope")),
        "not_found",
    );
    s.api.restore(&id, checkpoint("one")).unwrap();
    assert_eq!(text(s, &id, "a.txt"), "a2\n");
    assert_eq!(text(s, &id, "keep.txt"), "k\n");
    expect_code(
        "a file made after the checkpoint",
        read(s, &id, "b.txt"),
        "not_found",
    );
    assert_eq!(
        s.sh(&id, "cat a.txt keep.txt; test -e b.txt || echo no-b")
            .stdout
            .text,
        "a2\nk\nno-b\n"
    );
    assert!(since("one").unwrap().files.is_empty());
    // Commands after a restore may write the restored workspace (a sandbox whose confinement
    // names the workspace's mount must name the new one).
    let w = s.sh(&id, "echo w > w.txt && cat w.txt && rm w.txt");
    assert_eq!(
        (w.exit_code, w.stdout.text.as_str()),
        (Some(0), "w\n"),
        "{w:?}"
    );
    // A checkpoint is reusable.
    write(s, &id, "c.txt", "c\n").unwrap();
    s.api.restore(&id, checkpoint("one")).unwrap();
    expect_code("restored away", read(s, &id, "c.txt"), "not_found");
    assert_host_untouched(s, &before);

    // Export: the change as a patch or a tar; the host copy changes only when it applies.
    let e = s.api.export(&id, ExportRequest::default()).unwrap();
    assert_eq!((e.format, e.applied), (ExportFormat::Patch, false));
    assert!(
        e.patch.as_deref().unwrap_or_default().contains("+a2"),
        "{e:?}"
    );
    assert_eq!(
        changes(&e.changes),
        [("a.txt".into(), ChangeKind::Modified)]
    );
    let e = s
        .api
        .export(
            &id,
            ExportRequest {
                format: ExportFormat::Tar,
                apply: false,
                ..Default::default()
            },
        )
        .unwrap();
    let tar = e.tar_path.expect("a tar path");
    assert!(Path::new(&tar).is_file(), "{tar}");
    assert_host_untouched(s, &before);
    // No set-id bit reaches the host: not one the API wrote, nor one the sandbox set.
    s.api
        .write(
            &id,
            WriteRequest {
                path: "suid".into(),
                content: "x".into(),
                mode: Some(0o4755),
                ..WriteRequest::default()
            },
        )
        .unwrap();
    s.sh(&id, "echo y > sgid && chmod 2755 sgid");
    let e = s
        .api
        .export(
            &id,
            ExportRequest {
                format: ExportFormat::Patch,
                apply: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(e.applied);
    for p in ["suid", "sgid"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(s.ws().join(p))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "{p} on the host: {mode:o}");
    }
    assert_eq!(
        std::fs::read_to_string(s.ws().join("a.txt")).unwrap(),
        "a2\n"
    );
    assert_eq!(
        std::fs::read_to_string(s.ws().join("keep.txt")).unwrap(),
        "k\n"
    );
    assert!(!s.ws().join("b.txt").exists() && !s.ws().join("c.txt").exists());
}

// ---- approvals, network ------------------------------------------------------------------------

pub fn approvals_and_network_defaults(s: &Subject) {
    let id = s.create();
    // No command policy decorates a bare backend: nothing is ever pending.
    assert!(s.api.list_approvals(&id, None).unwrap().is_empty());
    let t = Instant::now();
    assert!(
        s.api
            .list_approvals(&id, Some(Duration::from_millis(200)))
            .unwrap()
            .is_empty()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let ap = ApprovalId::parse("ap-0123456789abcdef").unwrap();
    expect_code(
        "approve of no approval",
        s.api.approve(&id, &ap),
        "not_found",
    );
    expect_code(
        "deny of no approval",
        s.api.deny(&id, &ap, "no"),
        "not_found",
    );
    // The default policy has no network: rules apply only to mode "proxy", fixed at create.
    let rules = NetworkRules {
        allow: vec!["example.com".into()],
        ..NetworkRules::default()
    };
    expect_code(
        "set_network without an egress proxy",
        s.api.set_network(&id, rules),
        "conflict",
    );
    assert_eq!(s.api.info(&id).unwrap().enforcement.network, "none");
}

// ---- the sandbox's own paths, as its user -------------------------------------------------------

pub fn absolute_paths_reach_the_sandbox_as_its_user(s: &Subject) {
    s.env.write("in-ws.txt", "ws\n");
    let before = tree_state(&s.ws());
    let id = s.create();
    let ws = s.inside_ws();
    // /tmp, by absolute path: every operation, each seen by the next command.
    expect_code(
        "a write without its parent",
        write(s, &id, "/tmp/t/a.txt", "x"),
        "not_found",
    );
    let w = s
        .api
        .write(
            &id,
            WriteRequest {
                path: "/tmp/t/a.txt".into(),
                content: "from the api\n".into(),
                create_parents: true,
                ..WriteRequest::default()
            },
        )
        .unwrap();
    assert_eq!((w.path.as_str(), w.created), ("/tmp/t/a.txt", true));
    assert_eq!(s.sh(&id, "cat /tmp/t/a.txt").stdout.text, "from the api\n");
    // Owned by the sandbox's user, as a command's own file is.
    let ids = s.sh(&id, "echo $(id -u):$(id -g)").stdout.text;
    let owner = s.sh(&id, "stat -c %u:%g /tmp/t/a.txt /tmp/t").stdout.text;
    assert_eq!(owner, format!("{ids}{ids}"), "{}", s.expect.backend);
    s.sh(&id, "echo by-exec > /tmp/t/b.txt");
    assert_eq!(text(s, &id, "/tmp/t/b.txt"), "by-exec\n");
    assert_eq!(
        list(s, &id, list_at("/tmp/t")),
        ["/tmp/t/a.txt", "/tmp/t/b.txt"]
    );
    let st = stat(s, &id, "/tmp/t/a.txt").unwrap();
    assert_eq!(
        (st.path.as_str(), st.kind, st.size),
        ("/tmp/t/a.txt", EntryKind::File, 13)
    );
    let found = search(
        s,
        &id,
        SearchRequest {
            path: Some("/tmp/t".into()),
            ..pattern("api")
        },
    );
    assert_eq!(found, [("/tmp/t/a.txt".to_string(), 1)]);
    s.api
        .edit(&id, edit("/tmp/t/a.txt", "the api", "an edit"))
        .unwrap();
    assert_eq!(s.sh(&id, "cat /tmp/t/a.txt").stdout.text, "from an edit\n");
    rename(s, &id, "/tmp/t/a.txt", "/tmp/t/c.txt", false).unwrap();
    remove(s, &id, "/tmp/t/b.txt", false).unwrap();
    assert_eq!(s.sh(&id, "ls /tmp/t").stdout.text, "c.txt\n");
    // A relative path with an absolute one: both the sandbox's, the relative one in the
    // workspace.
    rename(s, &id, "/tmp/t/c.txt", "moved-in.txt", false).unwrap_or_else(|e| {
        // Across file systems a file is not moved (a directory is, by copying).
        assert_eq!(e.code(), "invalid_argument", "{e}");
        write(s, &id, "moved-in.txt", "from an edit\n").unwrap();
    });
    remove(s, &id, "/tmp/t", true).unwrap();
    assert_eq!(
        s.sh(&id, "test -e /tmp/t || echo gone").stdout.text,
        "gone\n"
    );

    // The workspace by absolute path: the same files, and what changes there is the
    // workspace's change (and only that: /tmp is not in the diff).
    assert_eq!(text(s, &id, &format!("{ws}/in-ws.txt")), "ws\n");
    write(s, &id, &format!("{ws}/abs.txt"), "abs\n").unwrap();
    assert_eq!(s.sh(&id, "cat abs.txt").stdout.text, "abs\n");
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert_eq!(
        diff_files(&d),
        [
            ("abs.txt".to_string(), ChangeKind::Added),
            ("moved-in.txt".to_string(), ChangeKind::Added)
        ]
    );

    // The image's (or host view's) files read as a command reads them.
    assert_reads_as_commands_do(s, &id, "/etc/passwd");
    assert_reads_as_commands_do(s, &id, "/etc/hostname");
    let etc = list(s, &id, list_at("/etc"));
    assert!(etc.contains(&"/etc/passwd".to_string()), "{etc:?}");
    let passwd = text(s, &id, "/etc/passwd");
    // Writing there is refused, as to a command.
    for p in ["/etc/passwd", "/etc/taskbox-new"] {
        assert!(!command_writes(s, &id, p), "a command may write {p}");
        expect_code(
            &format!("write {p}"),
            write(s, &id, p, "x"),
            "permission_denied",
        );
    }
    expect_code(
        "remove of /etc/passwd",
        remove(s, &id, "/etc/passwd", false),
        "permission_denied",
    );
    expect_code(
        "rename of /etc/passwd",
        rename(s, &id, "/etc/passwd", "/etc/passwd.old", false),
        "permission_denied",
    );
    assert_eq!(text(s, &id, "/etc/passwd"), passwd);
    assert_host_untouched(s, &before);
}

/// What a command may write, the file API may; what it may not, neither may the file API
/// (permission_denied): the sandbox user's permissions, the read-only mounts and, on backends
/// with it, the policy's Landlock rules.
pub fn the_file_api_may_write_where_commands_may(s: &Subject) {
    let id = s.create();
    let ws = s.inside_ws();
    let home = s.sh(&id, "printf %s \"$HOME\"").stdout.text;
    let mut paths: Vec<String> = [
        "/tmp", "/var/tmp", "/dev/shm", "/dev", "/run", "/etc", "/usr", "/", "/root", "/home",
    ]
    .iter()
    .map(|d| format!("{}/taskbox-probe", d.trim_end_matches('/')))
    .collect();
    paths.push(format!("{ws}/taskbox-probe"));
    if home.starts_with('/') && home != "/" {
        paths.push(format!("{home}/taskbox-probe"));
    }
    let mut allowed = Vec::new();
    for p in &paths {
        let by_command = command_writes(s, &id, p);
        let by_api = write(s, &id, p, "probe\n");
        match (&by_api, by_command) {
            (Ok(_), true) => {
                assert_eq!(s.run(&id, argv(&["cat", p])).stdout.text, "probe\n");
                remove(s, &id, p, false).unwrap();
                allowed.push(p.clone());
            }
            (Err(e), false) => assert!(
                matches!(e.code(), "permission_denied" | "not_found"),
                "{}: write {p}: {} ({e})",
                s.expect.backend,
                e.code()
            ),
            (by_api, by_command) => panic!(
                "{}: write {p}: a command may write it: {by_command}, the file API answers \
                 {by_api:?}",
                s.expect.backend
            ),
        }
    }
    // The two every backend has.
    assert!(
        allowed.contains(&"/tmp/taskbox-probe".to_string()),
        "{allowed:?}"
    );
    assert!(
        allowed.contains(&format!("{ws}/taskbox-probe")),
        "{allowed:?}"
    );
}

pub fn permissions_bind_the_file_api_as_they_bind_commands(s: &Subject) {
    let id = s.create();
    let r = s.sh(
        &id,
        "echo secret > /tmp/noread && chmod a-r /tmp/noread && \
         echo keep > /tmp/ro && chmod 444 /tmp/ro && \
         echo secret > noread.txt && chmod a-r noread.txt && \
         echo keep > ro.txt && chmod 444 ro.txt && \
         mkdir /tmp/closed && echo x > /tmp/closed/f && chmod 000 /tmp/closed",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    // The sandbox's user itself cannot: what the API is held to.
    assert_eq!(command_reads(s, &id, "/tmp/noread"), None);
    assert!(!command_writes(s, &id, "/tmp/ro"));
    for p in ["/tmp/noread", "noread.txt"] {
        expect_code(&format!("read {p}"), read(s, &id, p), "permission_denied");
        let mut sink = WriteSink(Vec::new());
        let down = DownloadRequest { path: p.into() };
        expect_code(
            &format!("download {p}"),
            s.api.download(&id, down, &mut sink),
            "permission_denied",
        );
        assert!(
            sink.0.is_empty(),
            "download {p} sent {} bytes",
            sink.0.len()
        );
    }
    // A search skips what it may not read.
    let found = search(
        s,
        &id,
        SearchRequest {
            path: Some("/tmp".into()),
            ..pattern("secret")
        },
    );
    assert!(found.is_empty(), "{found:?}");
    for p in ["/tmp/ro", "ro.txt"] {
        expect_code(
            &format!("write {p}"),
            write(s, &id, p, "over\n"),
            "permission_denied",
        );
        expect_code(
            &format!("edit {p}"),
            s.api.edit(&id, edit(p, "keep", "over")),
            "permission_denied",
        );
        let mut body: &[u8] = b"over\n";
        let up = UploadRequest {
            path: p.into(),
            ..UploadRequest::default()
        };
        expect_code(
            &format!("upload {p}"),
            s.api.upload(&id, up, &mut body),
            "permission_denied",
        );
        assert_eq!(s.run(&id, argv(&["cat", p])).stdout.text, "keep\n");
    }
    expect_code(
        "patch of a 0444 file",
        patch(
            s,
            &id,
            "--- a/ro.txt\n+++ b/ro.txt\n@@ -1 +1 @@\n-keep\n+over\n",
        ),
        "permission_denied",
    );
    expect_code(
        "stat in a closed directory",
        stat(s, &id, "/tmp/closed/f"),
        "permission_denied",
    );
    expect_code(
        "list of a closed directory",
        s.api.list_dir(&id, list_at("/tmp/closed")),
        "permission_denied",
    );
    // The sandbox may chmod its own files back, and then the API may too.
    s.sh(&id, "chmod 644 /tmp/ro /tmp/noread");
    write(s, &id, "/tmp/ro", "over\n").unwrap();
    assert_eq!(text(s, &id, "/tmp/noread"), "secret\n");
    s.sh(&id, "chmod 755 /tmp/closed");
}

pub fn hostile_absolute_paths_stay_inside(s: &Subject) {
    let out = Outside::plant(s);
    let host_before = out.state();
    let before = tree_state(&s.ws());
    let id = s.create();
    let passwd = command_reads(s, &id, "/etc/passwd").unwrap();
    // pid 1's root and fds, this process's own: /proc is not reached by file operations.
    for p in [
        "/proc/1/root/etc/passwd",
        "/proc/1/root/tmp/pwned",
        "/proc/1/cwd/x",
        "/proc/1/environ",
        "/proc/1/fd/0",
        "/proc/self/root/etc/passwd",
        "/proc/self/fd/0",
        "/proc/thread-self/root/etc/passwd",
    ] {
        for (op, code) in path_ops(s, &id, p) {
            let want: &[&str] = match op {
                // Its paths are the workspace's: an absolute one is refused whole.
                "patch" => &["path_refused", "patch_failed"],
                // /proc/self names no process of the sandbox's to the supervisor.
                _ if p.contains("self") => &["path_refused", "not_found"],
                _ => &["path_refused"],
            };
            assert!(
                want.contains(&code),
                "{op} of {p} on {}: {code}",
                s.expect.backend
            );
        }
    }
    // Links the sandbox plants in /tmp resolve inside it, never on the host.
    let r = s.sh(
        &id,
        &format!(
            "ln -s /etc/passwd /tmp/lp && ln -s ../../../../../../../etc /tmp/le && \
             ln -s {secret} /tmp/ls && ln -s {dir} /tmp/ld && ln -s /proc/1/root /tmp/lr && \
             ln -s /proc /tmp/lproc",
            secret = out.secret.display(),
            dir = out.dir.display()
        ),
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(text(s, &id, "/tmp/lp"), passwd);
    assert_eq!(text(s, &id, "/tmp/le/passwd"), passwd);
    assert_reads_as_commands_do(s, &id, "/tmp/ls");
    assert_reads_as_commands_do(s, &id, "/tmp/ld/o.txt");
    // Through a link into /proc: refused for leading there, or, where the kernel stops the
    // sandbox's user on the way (pid 1's root is not its to follow), for that.
    for p in [
        "/tmp/lr/etc/passwd",
        "/tmp/lproc/1/environ",
        "/tmp/lproc/cpuinfo",
    ] {
        let code = code_of(p, read(s, &id, p));
        assert!(
            matches!(code, "path_refused" | "permission_denied"),
            "read {p} on {}: {code}",
            s.expect.backend
        );
    }
    expect_code(
        "write through a link to a file",
        write(s, &id, "/tmp/lp", "pwned\n"),
        "path_refused",
    );
    expect_code(
        "write through a link to /etc",
        write(s, &id, "/tmp/le/pwned", "pwned\n"),
        "permission_denied",
    );
    let through_proc = WriteRequest {
        path: "/tmp/lr/tmp/pwned".into(),
        content: "pwned\n".into(),
        create_parents: true,
        ..WriteRequest::default()
    };
    let code = code_of("write through /tmp/lr", s.api.write(&id, through_proc));
    assert!(
        matches!(code, "path_refused" | "permission_denied"),
        "write through a link to /proc/1/root on {}: {code}",
        s.expect.backend
    );
    assert_eq!(
        s.sh(&id, "test -e /tmp/pwned || echo none").stdout.text,
        "none\n"
    );
    // `..` climbs no higher than the path allows, and never above the root.
    assert_eq!(text(s, &id, "/tmp/../etc/passwd"), passwd);
    expect_code(
        "above the root",
        read(s, &id, "/../../etc/passwd"),
        "path_refused",
    );
    // The sandbox answers as before.
    assert_eq!(s.sh(&id, "echo alive").stdout.text, "alive\n");
    assert_eq!(command_reads(s, &id, "/etc/passwd").unwrap(), passwd);
    assert_eq!(
        out.state(),
        host_before,
        "a file beside the workspace changed"
    );
    assert_host_untouched(s, &before);
}

pub fn error_codes_on_real_errors(s: &Subject) {
    let id = s.create();
    s.sh(&id, "echo f > /tmp/file && mkdir -p /tmp/dir");
    let cases: Vec<(&str, Result<(), ApiError>, &str)> = vec![
        (
            "read of a missing file",
            read(s, &id, "/tmp/nope").map(drop),
            "not_found",
        ),
        (
            "read of a directory",
            read(s, &id, "/tmp/dir").map(drop),
            "is_a_directory",
        ),
        (
            "write over a directory",
            write(s, &id, "/tmp/dir", "x").map(drop),
            "is_a_directory",
        ),
        (
            "remove of a directory",
            remove(s, &id, "/tmp/dir", false),
            "is_a_directory",
        ),
        (
            "list of a file",
            s.api.list_dir(&id, list_at("/tmp/file")).map(drop),
            "not_a_directory",
        ),
        (
            "read beneath a file",
            read(s, &id, "/tmp/file/x").map(drop),
            "not_a_directory",
        ),
        (
            "write beneath a file",
            s.api
                .write(
                    &id,
                    WriteRequest {
                        path: "/tmp/file/x/y".into(),
                        content: "x".into(),
                        create_parents: true,
                        ..WriteRequest::default()
                    },
                )
                .map(drop),
            "not_a_directory",
        ),
        (
            "write in /etc",
            write(s, &id, "/etc/x", "x").map(drop),
            "permission_denied",
        ),
    ];
    for (what, r, want) in cases {
        expect_code(what, r, want);
    }
    let mut sink = WriteSink(Vec::new());
    let down = DownloadRequest {
        path: "/tmp/dir".into(),
    };
    expect_code(
        "download of a directory",
        s.api.download(&id, down, &mut sink),
        "is_a_directory",
    );
    // Too large to load whole (a sparse file: no disk used).
    let r = s.sh(
        &id,
        "dd if=/dev/zero of=/tmp/big bs=1024 count=0 seek=66560 2>/dev/null",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let e = s.api.edit(&id, edit("/tmp/big", "a", "b")).unwrap_err();
    assert_eq!(e.code(), "too_large", "{e}");
    assert!(e.to_string().contains("upload"), "{e}");
    let huge = format!(
        "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+{}\n",
        "b".repeat(17 << 20)
    );
    expect_code("a patch over its limit", patch(s, &id, &huge), "too_large");
}

/// Deterministic bytes that do not repeat in a way a file system could compress away.
struct Noise {
    state: u64,
    left: u64,
}

impl std::io::Read for Noise {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.left as usize);
        for b in &mut buf[..n] {
            // xorshift64
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            *b = self.state as u8;
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A sink that keeps only the digest and the size of what it gets.
#[derive(Default)]
struct Digesting {
    announced: Option<u64>,
    got: u64,
    hasher: sha2::Sha256,
}

impl ByteSink for Digesting {
    fn start(&mut self, size: u64) -> std::io::Result<()> {
        self.announced = Some(size);
        Ok(())
    }
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use sha2::Digest as _;
        self.got += bytes.len() as u64;
        self.hasher.update(bytes);
        Ok(())
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn large_files_stream_both_ways(s: &Subject) {
    use sha2::Digest as _;
    const SIZE: u64 = 100 << 20;
    let id = s.create();
    let mut expected = sha2::Sha256::new();
    std::io::copy(
        &mut Noise {
            state: 0x2545_f491_4f6c_dd1d,
            left: SIZE,
        },
        &mut DigestWriter(&mut expected),
    )
    .unwrap();
    let expected = hex(&expected.finalize());
    for path in ["/tmp/big.bin", "big.bin"] {
        let mut body = Noise {
            state: 0x2545_f491_4f6c_dd1d,
            left: SIZE,
        };
        let up = UploadRequest {
            path: path.into(),
            ..UploadRequest::default()
        };
        let w = s.api.upload(&id, up, &mut body).unwrap();
        assert_eq!((w.bytes_written, w.created), (SIZE, true), "{path}");
        assert_eq!(w.sha256.as_deref(), Some(expected.as_str()), "{path}");
        // The command sees the same bytes.
        let r = s.run(&id, argv(&["sha256sum", path]));
        assert_eq!(
            r.stdout.text.split_whitespace().next(),
            Some(expected.as_str())
        );
        let mut sink = Digesting::default();
        let down = DownloadRequest { path: path.into() };
        let d = s.api.download(&id, down, &mut sink).unwrap();
        assert_eq!(
            (sink.announced, sink.got, d.bytes),
            (Some(SIZE), SIZE, SIZE)
        );
        assert_eq!(hex(&sink.hasher.finalize()), expected, "{path}");
        assert_eq!(d.sha256, expected);
    }
    // A body that stops halfway leaves nothing behind, and says whose side failed.
    struct Broken(u64);
    impl std::io::Read for Broken {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::other("the client went away"));
            }
            let n = buf.len().min(self.0 as usize);
            buf[..n].fill(b'x');
            self.0 -= n as u64;
            Ok(n)
        }
    }
    let up = UploadRequest {
        path: "/tmp/half.bin".into(),
        ..UploadRequest::default()
    };
    let e = s.api.upload(&id, up, &mut Broken(1 << 20)).unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    assert!(e.to_string().contains("the client went away"), "{e}");
    assert_eq!(
        s.sh(
            &id,
            "ls -A /tmp | grep -c half; ls -A /tmp | grep -c taskbox-tmp"
        )
        .stdout
        .text,
        "0\n0\n"
    );
}

struct DigestWriter<'a>(&'a mut sha2::Sha256);

impl std::io::Write for DigestWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use sha2::Digest as _;
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// ---- hostile input and escapes -----------------------------------------------------------------

/// A file and a directory of the host beside the workspace, which no operation may reach.
struct Outside {
    secret: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl Outside {
    fn plant(s: &Subject) -> Outside {
        let secret = s.env.dir.path().join("secret.txt");
        std::fs::write(&secret, "SECRET\n").unwrap();
        let dir = s.env.dir.path().join("outside");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("o.txt"), "outside\n").unwrap();
        Outside { secret, dir }
    }

    fn state(&self) -> (String, TreeState) {
        (
            std::fs::read_to_string(&self.secret).unwrap(),
            tree_state(&self.dir),
        )
    }
}

pub fn hostile_paths_are_refused_on_every_operation(s: &Subject) {
    s.env.write("in.txt", "in\n");
    let out = Outside::plant(s);
    let host_before = out.state();
    let before = tree_state(&s.ws());
    let id = s.create();
    let secret = out.secret.display().to_string();
    let cases = [
        ("../secret.txt", "path_refused"),
        ("sub/../../secret.txt", "path_refused"),
        ("/../etc/passwd", "path_refused"),
        ("/tmp/../../secret.txt", "path_refused"),
        ("in\0.txt", "invalid_argument"),
        ("/tmp/in\0.txt", "invalid_argument"),
        ("", "invalid_argument"),
    ];
    for (p, want) in cases {
        let ops = path_ops(s, &id, p);
        for (op, code) in ops {
            assert_eq!(code, want, "{op} of {p:?} on {}", s.expect.backend);
        }
    }
    // An absolute path is the sandbox's: a host file by its host path is what the sandbox's
    // commands see there (nothing, unless the host view shows it); what a write makes there
    // stays in the sandbox (the host file is checked unchanged below).
    assert_reads_as_commands_do(s, &id, &secret);
    // A patch naming paths that climb out, or absolute ones, is refused whole.
    for target in [
        "b/../escape.txt",
        "b/sub/../../escape.txt",
        "/tmp/escape.txt",
    ] {
        let text = format!(
            "--- /dev/null\n+++ b/in-ok.txt\n@@ -0,0 +1 @@\n+ok\n\
             --- /dev/null\n+++ {target}\n@@ -0,0 +1 @@\n+pwned\n"
        );
        expect_code(
            &format!("a patch of {target}"),
            patch(s, &id, &text),
            "path_refused",
        );
        expect_code(
            "the refused patch's other file",
            stat(s, &id, "in-ok.txt"),
            "not_found",
        );
    }
    expect_code(
        "a patch of a file with a NUL in its name",
        patch(s, &id, "--- /dev/null\n+++ b/a\0b\n@@ -0,0 +1 @@\n+x\n"),
        "invalid_argument",
    );
    // Checkpoint names are names, not paths.
    expect_code(
        "diff since a path",
        s.api.diff(
            &id,
            DiffRequest {
                since: Some("../../etc".into()),
                ..Default::default()
            },
        ),
        "invalid_argument",
    );
    expect_code(
        "restore of a path",
        s.api.restore(&id, checkpoint("/etc/passwd")),
        "invalid_argument",
    );
    assert_eq!(text(s, &id, "in.txt"), "in\n");
    assert!(!s.env.dir.path().join("escape.txt").exists());
    assert!(!Path::new("/tmp/escape.txt").exists());
    assert_eq!(
        out.state(),
        host_before,
        "a file beside the workspace changed"
    );
    assert_host_untouched(s, &before);
}

pub fn planted_symlinks_lead_nowhere_outside_the_workspace(s: &Subject) {
    s.env.write("in.txt", "in\n");
    let out = Outside::plant(s);
    // A hostile repository brings its own, in the host copy.
    std::os::unix::fs::symlink("/etc/shadow", s.ws().join("repo-shadow")).unwrap();
    std::os::unix::fs::symlink(&out.dir, s.ws().join("repo-dir")).unwrap();
    let host_before = out.state();
    let before = tree_state(&s.ws());
    let id = s.create();
    // The sandbox plants them: an absolute link to /etc/shadow, to a host file and a host
    // directory beside the workspace, and relative ones that climb out.
    let r = s.sh(
        &id,
        &format!(
            "ln -s /etc/shadow shadow && ln -s {secret} hostfile && ln -s {dir} hostdir && \
             ln -s ../secret.txt upfile && ln -s .. up && ln -s ../outside updir",
            secret = out.secret.display(),
            dir = out.dir.display()
        ),
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    // Links resolve inside the workspace, so through a link to a directory outside (or up and
    // out of the root) there is nothing, whatever the operation; a patch finds no file to patch.
    for p in ["hostdir/o.txt", "updir/o.txt", "repo-dir/o.txt"] {
        for (op, code) in path_ops(s, &id, p) {
            let want = if op == "patch" {
                "patch_failed"
            } else {
                "not_found"
            };
            assert_eq!(code, want, "{op} through {p} on {}", s.expect.backend);
        }
    }
    // A final link is the workspace's own entry (stat, rename and remove act on the link);
    // reading through it finds nothing, and what writes refuses to write through it.
    for p in ["shadow", "hostfile", "upfile", "repo-shadow"] {
        expect_code(&format!("read through {p}"), read(s, &id, p), "not_found");
        let patched = format!("--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-SECRET\n+pwned\n");
        for (what, r) in [
            ("write", write(s, &id, p, "pwned\n").map(|_| ())),
            ("edit", s.api.edit(&id, edit(p, "SECRET", "x")).map(|_| ())),
            ("patch", patch(s, &id, &patched).map(|_| ())),
        ] {
            expect_code(&format!("{what} through {p}"), r, "path_refused");
        }
    }
    // `..` from the root is the root: a write through a link to it lands in the workspace.
    write(s, &id, "up/new.txt", "inside\n").unwrap();
    assert_eq!(text(s, &id, "new.txt"), "inside\n");
    assert!(!s.env.dir.path().join("new.txt").exists());
    // A fifo the sandbox makes cannot block the caller: it is not a regular file.
    s.sh(&id, "mkfifo fifo");
    let t = Instant::now();
    expect_code("read of a fifo", read(s, &id, "fifo"), "path_refused");
    expect_code(
        "edit of a fifo",
        s.api.edit(&id, edit("fifo", "a", "b")),
        "path_refused",
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Listing and searching never follow a link out.
    for p in ["hostdir", "updir", "repo-dir"] {
        let r = s.api.list_dir(&id, list_at(p));
        assert_eq!(code_of(p, r), "not_found", "list of {p}");
    }
    let all = s
        .api
        .list_dir(
            &id,
            ListRequest {
                max_depth: Some(10),
                include_hidden: true,
                ..ListRequest::default()
            },
        )
        .unwrap();
    assert!(
        !all.entries.iter().any(|e| e.path.ends_with("o.txt")),
        "{all:?}"
    );
    let found = s
        .api
        .search(
            &id,
            SearchRequest {
                pattern: "SECRET|outside".into(),
                include_hidden: true,
                include_ignored: true,
                ..SearchRequest::default()
            },
        )
        .unwrap();
    assert!(found.matches.is_empty(), "{found:?}");
    // Stat sees the links as links.
    let st = stat(s, &id, "hostfile").unwrap();
    assert_eq!(st.kind, EntryKind::Symlink);
    assert_eq!(
        st.symlink_target.as_deref(),
        Some(out.secret.to_str().unwrap())
    );
    expect_code(
        "stat through a link",
        stat(s, &id, "hostdir/o.txt"),
        "not_found",
    );
    // Removing a link removes the link, not what it names.
    for p in ["hostfile", "hostdir", "updir", "repo-dir"] {
        s.api
            .remove(
                &id,
                RemoveRequest {
                    path: p.into(),
                    recursive: true,
                },
            )
            .unwrap_or_else(|e| panic!("remove the link {p}: {e}"));
    }
    expect_code("a removed link", stat(s, &id, "hostdir"), "not_found");
    // The sandbox's view agrees: nothing outside was written through the links.
    assert_eq!(s.sh(&id, "cat in.txt").stdout.text, "in\n");
    assert_eq!(
        out.state(),
        host_before,
        "a file beside the workspace changed"
    );
    assert_host_untouched(s, &before);
}

/// `kill -9 -1` signals every process the command may signal: whatever runs the sandbox's
/// execs (a starter, a reaper, a wrapper) must not be among them, or must come back, so the
/// next exec runs as before.
pub fn a_command_that_kills_all_it_can_leaves_the_sandbox_serving(s: &Subject) {
    let id = s.create();
    let killer = shell("kill -9 -1; echo after");
    if s.expect.backend == "native" {
        // The command's own shell survives (kill -1 spares the caller) and reports normally.
        // (In a container the exec's wrapper is the command's to kill: that exec then fails,
        // saying so; only the sandbox must go on.)
        let r = s.run(&id, killer);
        assert_eq!(
            (r.exit_code, r.stdout.text.as_str()),
            (Some(0), "after\n"),
            "{r:?}"
        );
    } else {
        let _ = s.api.exec(&id, killer, None);
    }
    for i in 0..3 {
        let r = s.sh(&id, &format!("echo ok{i}"));
        assert_eq!(
            (r.exit_code, r.stdout.text.clone()),
            (Some(0), format!("ok{i}\n")),
            "exec {i} after kill -9 -1: {r:?}"
        );
    }
    s.api.destroy(&id).unwrap();
}

/// Stdin of any bytes (base64 in the request) reaches the command unchanged, 3 MiB of it; with
/// `merge_output` stderr goes to stdout in the order of the writes; bad encodings are refused.
pub fn binary_stdin_and_merged_output(s: &Subject) {
    use base64::Engine as _;
    use sha2::Digest as _;
    let id = s.create();
    // Every byte value, NUL and invalid UTF-8 included, in a 3 MiB stream.
    let data: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let want: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let r = s.run(
        &id,
        ExecRequest {
            stdin: Some(base64::engine::general_purpose::STANDARD.encode(&data)),
            stdin_encoding: Some("base64".into()),
            ..shell("sha256sum")
        },
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert!(
        r.stdout.text.starts_with(&want),
        "the command saw other bytes: {} against {want}",
        r.stdout.text
    );

    let r = s.run(
        &id,
        ExecRequest {
            merge_output: true,
            ..shell("echo a; echo b >&2; echo c; echo d >&2; exit 3")
        },
    );
    assert_eq!(
        (
            r.exit_code,
            r.stdout.text.as_str(),
            r.stderr.text.as_str(),
            r.stderr.bytes
        ),
        (Some(3), "a\nb\nc\nd\n", "", 0),
        "{r:?}"
    );

    for (req, what) in [
        (
            ExecRequest {
                stdin: Some("not base64 !".into()),
                stdin_encoding: Some("base64".into()),
                ..shell("cat")
            },
            "stdin that is not base64",
        ),
        (
            ExecRequest {
                stdin: Some("x".into()),
                stdin_encoding: Some("rot13".into()),
                ..shell("cat")
            },
            "an unknown stdin encoding",
        ),
        (
            ExecRequest {
                stdin_encoding: Some("base64".into()),
                ..shell("cat")
            },
            "an encoding without stdin",
        ),
    ] {
        expect_code(what, s.api.exec(&id, req, None), "invalid_argument");
    }
    // The sandbox answers as before.
    assert_eq!(s.sh(&id, "echo ok").stdout.text, "ok\n");
    s.api.destroy(&id).unwrap();
}

/// An exec as `user` running `script`.
fn as_user(user: &str, script: &str) -> ExecRequest {
    ExecRequest {
        user: Some(user.into()),
        ..shell(script)
    }
}

/// Whether this subject's sandboxes can have other users than their own: every backend but the
/// native one run without root (an unprivileged user namespace maps one id).
fn has_other_users(s: &Subject) -> bool {
    s.expect.backend != "native" || crate::is_root()
}

/// An exec may name a user of the sandbox (by name in its /etc/passwd, or a uid): the command is
/// that user, with its groups and home, bound by its permissions and with no capability (root
/// included, under the default policy); a name the sandbox does not know is `user_not_found`.
/// Where the sandbox has one id (native, rootless) another user is `invalid_argument`, saying
/// why, and its own user by name still runs.
pub fn exec_as_another_user_of_the_sandbox(s: &Subject) {
    let id = s.create();
    let own = s.sh(&id, "id -u; id -un 2>/dev/null || echo ?");
    assert_eq!(own.exit_code, Some(0), "{own:?}");
    let own_uid = own
        .stdout
        .text
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    let r = s.api.exec(&id, as_user("nonexistent", "true"), None);
    let e = r.expect_err("an unknown user runs nothing");
    assert_eq!(e.code(), "user_not_found", "{e}");
    assert!(e.to_string().contains("nonexistent"), "{e}");
    // The sandbox's own user, by uid, is always there.
    let r = s.run(&id, as_user(&own_uid, "id -u"));
    assert_eq!(r.stdout.text.trim(), own_uid, "{r:?}");
    if !has_other_users(s) {
        let e = s
            .api
            .exec(&id, as_user("nobody", "id -u"), None)
            .expect_err("a rootless sandbox has one user");
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(
            e.to_string().contains("root"),
            "says what would allow it: {e}"
        );
        s.api.destroy(&id).unwrap();
        return;
    }
    // A file of the sandbox's user: another user reads it (0644) and cannot change it.
    write(s, &id, "mine.txt", "mine\n").unwrap();
    let r = s.run(
        &id,
        as_user(
            "nobody",
            "id -u; id -g; echo $HOME; cat mine.txt; echo x >> mine.txt || echo refused; \
             echo t > /tmp/nobody.txt && stat -c %u /tmp/nobody.txt; \
             grep CapEff /proc/self/status",
        ),
    );
    let lines: Vec<&str> = r.stdout.text.lines().collect();
    assert_eq!(
        &lines[..6],
        ["65534", "65534", "/nonexistent", "mine", "refused", "65534"],
        "{r:?}"
    );
    assert_eq!(
        lines[6].split_whitespace().last(),
        Some("0000000000000000"),
        "{r:?}"
    );
    assert_eq!(text(s, &id, "mine.txt"), "mine\n");
    // Root of the sandbox, by name: uid 0 and, by default, no capability at all.
    let r = s.run(&id, as_user("root", "id -u; grep CapEff /proc/self/status"));
    let lines: Vec<&str> = r.stdout.text.lines().collect();
    assert_eq!(lines.first(), Some(&"0"), "{r:?}");
    assert_eq!(
        lines[1].split_whitespace().last(),
        Some("0000000000000000"),
        "{r:?}"
    );
    // A background exec as another user is waited for and killed like any other.
    let bg = match s
        .api
        .exec(
            &id,
            ExecRequest {
                background: true,
                ..as_user("nobody", "sleep 300")
            },
            None,
        )
        .unwrap()
    {
        ExecOutcome::Background(p) => p,
        other => panic!("expected a process, got {other:?}"),
    };
    s.api.kill(&id, bg.exec_id, libc::SIGKILL).unwrap();
    let done = s
        .api
        .wait(&id, bg.exec_id, Duration::from_secs(10))
        .unwrap();
    assert!(done.result.is_some(), "{done:?}");
    // The default user is still the default.
    let r = s.sh(&id, "id -u");
    assert_eq!(r.stdout.text.trim(), own_uid, "{r:?}");
    s.api.destroy(&id).unwrap();
}

/// The policy of a container-like sandbox: a writable root, and the capabilities `adduser`
/// needs kept by root.
const CONTAINER_POLICY: &str = r#"
[filesystem]
root = "writable"
[security]
root_capabilities = ["chown", "dac_override", "fowner", "fsetid", "setuid", "setgid", "kill"]
"#;

/// With `filesystem.root = "writable"` and root's capabilities, root adds a user the way a
/// container's does (`adduser`: /etc written, a home chowned to the new uid), the new user runs
/// commands as itself the exec after, and none of it is in the workspace's diff; without them
/// the same `adduser` fails. The host view's root cannot be made writable: refused, naming the
/// key.
pub fn a_writable_root_lets_root_add_a_user(s: &Subject) {
    let req = CreateRequest {
        policy: Some("container".into()),
        policy_toml: Some(CONTAINER_POLICY.into()),
        ..s.request()
    };
    if s.expect.image == "host" {
        let e = s
            .api
            .create(req)
            .expect_err("the host view's root is never writable");
        assert_eq!(e.code(), "invalid_argument", "{e}");
        assert!(e.to_string().contains("filesystem.root"), "{e}");
        return;
    }
    if !has_other_users(s) {
        return;
    }
    // The default policy: root of the sandbox can neither write /etc nor chown.
    let plain = s.create();
    let r = s.run(
        &plain,
        as_user("root", "touch /etc/taskbox-probe || echo refused"),
    );
    assert_eq!(r.stdout.text, "refused\n", "{r:?}");
    s.api.destroy(&plain).unwrap();

    let id = s.api.create(req).unwrap().id;
    let r = s.run(
        &id,
        as_user(
            "root",
            "adduser --comment probe --disabled-password probe-user",
        ),
    );
    assert_eq!(r.exit_code, Some(0), "adduser: {r:?}");
    let r = s.run(
        &id,
        as_user(
            "probe-user",
            "whoami; id -u; stat -c %U $HOME; echo x > $HOME/f && echo wrote",
        ),
    );
    let lines: Vec<&str> = r.stdout.text.lines().collect();
    assert_eq!(lines.first(), Some(&"probe-user"), "{r:?}");
    assert_eq!(lines.get(2), Some(&"probe-user"), "{r:?}");
    assert_eq!(lines.get(3), Some(&"wrote"), "{r:?}");
    let r = s.run(&id, as_user("root", "whoami"));
    assert_eq!(r.stdout.text, "root\n", "{r:?}");
    // The root's layer is not the workspace's.
    let d = s.api.diff(&id, DiffRequest::default()).unwrap();
    assert!(d.files.is_empty(), "{:?}", diff_files(&d));
    let r = s.run(
        &id,
        as_user("root", "userdel -r probe-user; id probe-user || echo gone"),
    );
    assert!(r.stdout.text.ends_with("gone\n"), "{r:?}");
    s.api.destroy(&id).unwrap();
}
