//! A scripted backend: every operation answers the same way each time, so a trace of a session
//! on it is the same each run but for its times.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use taskbox_contract::api::*;
use taskbox_contract::result::{
    Change, ChangeKind, DiffStats, Enforcement, ExecResult, Output, Resources,
};

/// TEST-ONLY backend with fixed answers (see the module doc). Its sandbox ids count from 1.
#[derive(Default)]
pub struct Scripted {
    sandboxes: Mutex<BTreeMap<SandboxId, SandboxInfo>>,
    created: Mutex<u64>,
}

fn output(text: &str) -> Output {
    Output {
        text: text.into(),
        bytes: text.len() as u64,
        truncated: false,
        spill_path: None,
    }
}

fn enforcement() -> Enforcement {
    Enforcement {
        landlock: "full".into(),
        seccomp: true,
        network: "none".into(),
        limits: "rlimit".into(),
        disk: "none".into(),
    }
}

fn change(path: &str, kind: ChangeKind) -> Change {
    Change {
        path: path.into(),
        kind,
    }
}

fn result(stdout: &str) -> ExecResult {
    ExecResult {
        exit_code: Some(0),
        signal: None,
        timed_out: false,
        duration_ms: 3,
        stdout: output(stdout),
        stderr: output("warn\n"),
        changes: vec![change("out.txt", ChangeKind::Added)],
        violations: Vec::new(),
        resources: Resources::default(),
        enforcement: enforcement(),
        network: None,
        findings: Vec::new(),
        findings_omitted: 0,
        tests: None,
        ignored_changes: 0,
    }
}

fn process(exec_id: u64, running: bool) -> ProcessInfo {
    ProcessInfo {
        exec_id,
        argv: vec!["/bin/sh".into(), "-c".into(), "cat".into()],
        running,
        stdout: output("so far\n"),
        stderr: Output::default(),
        result: (!running).then(|| result("done\n")),
    }
}

impl Scripted {
    fn known(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        self.sandboxes
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::sandbox_not_found(id))
    }
}

impl SandboxApi for Scripted {
    fn create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        let resolved = req.for_backend()?;
        let n = {
            let mut c = self.created.lock().unwrap();
            *c += 1;
            *c
        };
        let info = SandboxInfo {
            id: SandboxId::parse(&format!("sb-{n:016x}"))?,
            backend: "scripted".into(),
            workspace: req.workspace,
            policy: resolved.name.clone(),
            policy_hash: resolved.hash.clone(),
            image: "host".into(),
            enforcement: enforcement(),
            labels: req.labels,
            created_at_ms: 1_700_000_000_000,
            expires_at_ms: None,
            state: "running".into(),
            checkpoints: Vec::new(),
            lost_cause: None,
            forked_from: None,
        };
        self.sandboxes
            .lock()
            .unwrap()
            .insert(info.id.clone(), info.clone());
        Ok(info)
    }

    fn list(&self) -> Vec<SandboxInfo> {
        self.sandboxes.lock().unwrap().values().cloned().collect()
    }

    fn info(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        self.known(id)
    }

    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        ev: ExecEvents,
    ) -> Result<ExecOutcome, ApiError> {
        self.known(id)?;
        let argv = req.resolved_argv()?;
        if req.background {
            return Ok(ExecOutcome::Background(process(7, true)));
        }
        let r = result(&format!("{}\n", argv.join(" ")));
        if let Some(events) = ev {
            events(ExecEvent::Started { exec_id: 1 });
            events(ExecEvent::Ended {
                result: Box::new(r.clone()),
            });
        }
        Ok(ExecOutcome::Finished(r))
    }

    fn process(&self, id: &SandboxId, exec_id: u64) -> Result<ProcessInfo, ApiError> {
        self.known(id)?;
        if exec_id != 7 {
            return Err(ApiError::not_found(format!("no process {exec_id}")));
        }
        Ok(process(exec_id, true))
    }

    fn wait(&self, id: &SandboxId, exec_id: u64, _: Duration) -> Result<ProcessInfo, ApiError> {
        self.known(id)?;
        Ok(process(exec_id, false))
    }

    fn kill(&self, id: &SandboxId, exec_id: u64, _: i32) -> Result<ProcessInfo, ApiError> {
        self.known(id)?;
        Ok(process(exec_id, false))
    }

    fn write_stdin(&self, id: &SandboxId, _: u64, _: &[u8], _: bool) -> Result<(), ApiError> {
        self.known(id).map(|_| ())
    }

    fn read(&self, id: &SandboxId, req: ReadRequest) -> Result<ReadResult, ApiError> {
        self.known(id)?;
        let content = match req.path.as_str() {
            "small.txt" => "small\n".to_string(),
            "large.txt" => "l".repeat(70_000),
            p => return Err(ApiError::not_found(format!("{p} does not exist"))),
        };
        Ok(ReadResult {
            path: req.path,
            total_bytes: content.len() as u64,
            total_lines: Some(1),
            content,
            encoding: "utf-8".into(),
            truncated: false,
            binary: false,
        })
    }

    fn write(&self, id: &SandboxId, req: WriteRequest) -> Result<WriteResult, ApiError> {
        self.known(id)?;
        Ok(WriteResult {
            bytes_written: req.content.len() as u64,
            path: req.path,
            created: true,
            sha256: None,
        })
    }

    fn edit(&self, id: &SandboxId, req: EditRequest) -> Result<EditResult, ApiError> {
        self.known(id)?;
        if req.old != "alpha" {
            return Err(ApiError::EditNotFound(format!(
                "{:?} does not occur in {} (DB_PASSWORD=hunter2)",
                req.old, req.path
            )));
        }
        Ok(EditResult {
            path: req.path,
            replacements: 1,
            diff: "-alpha\n+beta\n".into(),
        })
    }

    fn patch(&self, id: &SandboxId, _: PatchRequest) -> Result<PatchResult, ApiError> {
        self.known(id)?;
        let files = vec![change("a.txt", ChangeKind::Modified)];
        Ok(PatchResult { files })
    }

    fn list_dir(&self, id: &SandboxId, _: ListRequest) -> Result<ListResult, ApiError> {
        self.known(id)?;
        Ok(ListResult {
            entries: vec![Entry {
                path: "a.txt".into(),
                kind: EntryKind::File,
                size: 6,
            }],
            truncated: false,
        })
    }

    fn search(&self, id: &SandboxId, _: SearchRequest) -> Result<SearchResult, ApiError> {
        self.known(id)?;
        Ok(SearchResult {
            matches: vec![Match {
                path: "a.txt".into(),
                line_number: 1,
                line: "delta".into(),
            }],
            truncated: false,
            files_searched: 2,
        })
    }

    fn stat(&self, id: &SandboxId, req: PathRequest) -> Result<StatResult, ApiError> {
        self.known(id)?;
        Ok(StatResult {
            path: req.path,
            kind: EntryKind::File,
            size: 6,
            mode: 0o644,
            modified_ms: 1_700_000_000_000,
            symlink_target: None,
        })
    }

    fn remove(&self, id: &SandboxId, _: RemoveRequest) -> Result<(), ApiError> {
        self.known(id).map(|_| ())
    }

    fn rename(&self, id: &SandboxId, _: MoveRequest) -> Result<(), ApiError> {
        self.known(id).map(|_| ())
    }

    fn diff(&self, id: &SandboxId, _: DiffRequest) -> Result<DiffResult, ApiError> {
        self.known(id)?;
        Ok(DiffResult {
            files: Vec::new(),
            diff: String::new(),
            stats: DiffStats::default(),
            ignored: 0,
            flagged: Vec::new(),
        })
    }

    fn checkpoint(
        &self,
        id: &SandboxId,
        req: CheckpointRequest,
    ) -> Result<CheckpointInfo, ApiError> {
        self.known(id)?;
        Ok(CheckpointInfo {
            name: req.name,
            created_at_ms: 1_700_000_000_000,
            files: 1,
        })
    }

    fn restore(&self, id: &SandboxId, _: CheckpointRequest) -> Result<(), ApiError> {
        self.known(id).map(|_| ())
    }

    fn export(&self, id: &SandboxId, req: ExportRequest) -> Result<ExportResult, ApiError> {
        self.known(id)?;
        Ok(ExportResult {
            format: req.format,
            patch: Some("--- a/b.txt\n+++ b/b.txt\n".into()),
            tar_path: None,
            changes: Vec::new(),
            applied: req.apply,
            ignored: 0,
            flagged: Vec::new(),
        })
    }

    fn set_network(&self, id: &SandboxId, rules: NetworkRules) -> Result<NetworkRules, ApiError> {
        self.known(id)?;
        Ok(rules)
    }

    fn destroy(&self, id: &SandboxId) -> Result<(), ApiError> {
        self.sandboxes
            .lock()
            .unwrap()
            .remove(id)
            .map(|_| ())
            .ok_or_else(|| ApiError::sandbox_not_found(id))
    }
}

/// One call of every operation, with the shapes the trace treats apart: background execs and
/// their process calls, text, binary and large stdin, large file contents both ways, errors,
/// secrets, export with and without apply, calls that are not recorded.
pub fn session(api: &dyn SandboxApi) -> SandboxId {
    let info = api
        .create(CreateRequest {
            workspace: "/nonexistent-workspace".into(),
            env: [("GITHUB_TOKEN".to_string(), "plain".to_string())].into(),
            ..CreateRequest::default()
        })
        .unwrap();
    let id = info.id;
    let shell = |s: &str, background: bool| ExecRequest {
        shell: Some(s.into()),
        background,
        ..ExecRequest::default()
    };
    api.exec(&id, shell("echo hi", false), None).unwrap();
    let mut events = Vec::new();
    let mut on = |e: ExecEvent| events.push(e);
    api.exec(&id, shell("echo streamed", false), Some(&mut on))
        .unwrap();
    assert_eq!(
        events.len(),
        2,
        "the events reach the caller through the trace"
    );
    api.exec(
        &id,
        ExecRequest {
            argv: Some(vec!["env".into()]),
            env: [("API_KEY".to_string(), "k".to_string())].into(),
            stdin: Some("token ghp_0123456789abcdef0123456789\n".into()),
            timeout_ms: Some(5000),
            ..ExecRequest::default()
        },
        None,
    )
    .unwrap();
    api.exec(&id, shell("cat", true), None).unwrap();
    api.process(&id, 7).unwrap();
    api.wait(&id, 7, Duration::from_millis(1500)).unwrap();
    api.kill(&id, 7, 15).unwrap();
    api.write_stdin(&id, 7, b"hello\n", false).unwrap();
    api.write_stdin(&id, 7, &[0xff, 0, 1], false).unwrap();
    api.write_stdin(&id, 7, "y".repeat(70_000).as_bytes(), true)
        .unwrap();
    api.process(&id, 99).unwrap_err();
    let read = |path: &str| ReadRequest {
        path: path.into(),
        ..ReadRequest::default()
    };
    api.read(&id, read("small.txt")).unwrap();
    api.read(&id, read("large.txt")).unwrap();
    api.read(&id, read("missing.txt")).unwrap_err();
    let write = |path: &str, content: String| WriteRequest {
        path: path.into(),
        content,
        create_parents: true,
        ..WriteRequest::default()
    };
    api.write(&id, write("a.txt", "alpha\n".into())).unwrap();
    api.write(&id, write("big.txt", "z".repeat(70_000)))
        .unwrap();
    api.edit(
        &id,
        EditRequest {
            path: "a.txt".into(),
            old: "beta".into(),
            new: "gamma".into(),
            expected_count: None,
        },
    )
    .unwrap_err();
    api.edit(
        &id,
        EditRequest {
            path: "a.txt".into(),
            old: "alpha".into(),
            new: "beta".into(),
            expected_count: Some(1),
        },
    )
    .unwrap();
    api.patch(
        &id,
        PatchRequest {
            patch: "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-beta\n+delta\n".into(),
        },
    )
    .unwrap();
    api.list_dir(
        &id,
        ListRequest {
            glob: Some("**/*.txt".into()),
            ..ListRequest::default()
        },
    )
    .unwrap();
    api.search(
        &id,
        SearchRequest {
            pattern: "delta".into(),
            ..SearchRequest::default()
        },
    )
    .unwrap();
    api.stat(
        &id,
        PathRequest {
            path: "a.txt".into(),
        },
    )
    .unwrap();
    api.remove(
        &id,
        RemoveRequest {
            path: "big.txt".into(),
            recursive: false,
        },
    )
    .unwrap();
    api.rename(
        &id,
        MoveRequest {
            from: "a.txt".into(),
            to: "b.txt".into(),
            overwrite: false,
        },
    )
    .unwrap();
    api.diff(&id, DiffRequest::default()).unwrap();
    let cp = CheckpointRequest { name: "one".into() };
    api.checkpoint(&id, cp.clone()).unwrap();
    api.restore(&id, cp).unwrap();
    api.export(&id, ExportRequest::default()).unwrap();
    api.export(
        &id,
        ExportRequest {
            format: ExportFormat::Patch,
            apply: true,
            ..Default::default()
        },
    )
    .unwrap();
    api.set_network(
        &id,
        NetworkRules {
            allow: vec!["example.org".into()],
            ..NetworkRules::default()
        },
    )
    .unwrap();
    // Not recorded: reports on the sandbox itself.
    api.info(&id).unwrap();
    api.list_approvals(&id, None).unwrap();
    let ap = ApprovalId::parse("ap-0123").unwrap();
    api.approve(&id, &ap).unwrap_err();
    api.deny(&id, &ap, "not now").unwrap_err();
    // Not recorded: the sandbox does not exist, so there is no trace to go to.
    let ghost = SandboxId::parse("sb-ghost").unwrap();
    api.stat(
        &ghost,
        PathRequest {
            path: "a.txt".into(),
        },
    )
    .unwrap_err();
    api.destroy(&id).unwrap();
    id
}
