//! Operations as data (`taskbox_contract::op`), over the scripted backend of the format test:
//! the names, `call` against the typed methods, a decorator written as one `handle`, and the
//! trace such a decorator leaves unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Value, json};
use taskbox_contract::api::*;
use taskbox_trace::trace::Traced;

use common::{Scripted, session};

/// The names traces have always recorded, in [`OpName::ALL`]'s order (`info` and `approvals`
/// are never recorded; they are named for logs).
const NAMES: [&str; 29] = [
    "create",
    "info",
    "exec",
    "process",
    "wait",
    "kill",
    "stdin",
    "read",
    "write",
    "edit",
    "patch",
    "list",
    "search",
    "stat",
    "remove",
    "move",
    "upload",
    "download",
    "diff",
    "checkpoint",
    "restore",
    "export",
    "destroy",
    "approvals",
    "approve",
    "deny",
    "network",
    "secret",
    "fork",
];

#[test]
fn every_name_round_trips_and_is_the_recorded_one() {
    let names: Vec<&str> = OpName::ALL.iter().map(|n| n.as_str()).collect();
    assert_eq!(names, NAMES);
    for n in OpName::ALL {
        assert_eq!(OpName::from_str(n.as_str()), Ok(n));
        assert_eq!(n.to_string(), n.as_str());
    }
    let e = OpName::from_str("list_dir").unwrap_err();
    assert_eq!(e.to_string(), "unknown operation \"list_dir\"");
    assert!(OpName::from_str("").is_err());
    assert!(OpName::from_str("Exec").is_err(), "names are exact");
}

/// One operation of every kind but create, on `id` of a scripted sandbox (process calls on its
/// background exec 7).
fn every_op() -> Vec<Op<'static>> {
    let cp = CheckpointRequest { name: "one".into() };
    let approval = ApprovalId::parse("ap-1").unwrap();
    vec![
        Op::Info,
        Op::Exec {
            req: ExecRequest {
                shell: Some("echo hi".into()),
                ..ExecRequest::default()
            },
            events: None,
        },
        Op::Process { exec_id: 7 },
        Op::Wait {
            exec_id: 7,
            timeout: Duration::from_millis(250),
        },
        Op::Kill {
            exec_id: 7,
            signal: 9,
        },
        Op::WriteStdin {
            exec_id: 7,
            data: Cow::Owned(vec![0xff, b'a']),
            close: true,
        },
        Op::Read(ReadRequest {
            path: "small.txt".into(),
            ..ReadRequest::default()
        }),
        Op::Write(WriteRequest {
            path: "a.txt".into(),
            content: "x".into(),
            ..WriteRequest::default()
        }),
        Op::Edit(EditRequest {
            path: "a.txt".into(),
            old: "alpha".into(),
            new: "beta".into(),
            expected_count: None,
        }),
        Op::Patch(PatchRequest {
            patch: String::new(),
        }),
        Op::ListDir(ListRequest::default()),
        Op::Search(SearchRequest {
            pattern: "x".into(),
            ..SearchRequest::default()
        }),
        Op::Stat(PathRequest {
            path: "a.txt".into(),
        }),
        Op::Remove(RemoveRequest {
            path: "a.txt".into(),
            recursive: true,
        }),
        Op::Rename(MoveRequest {
            from: "a".into(),
            to: "b".into(),
            overwrite: false,
        }),
        // Streamed: a body and a sink of their own (leaked: the samples live for the test).
        Op::Upload {
            req: UploadRequest {
                path: "up.bin".into(),
                ..UploadRequest::default()
            },
            body: Box::leak(Box::new(&b"bytes"[..])),
        },
        Op::Download {
            req: DownloadRequest {
                path: "a.txt".into(),
            },
            sink: Box::leak(Box::new(WriteSink(Vec::new()))),
        },
        Op::Diff(DiffRequest::default()),
        Op::Checkpoint(cp.clone()),
        Op::Restore(cp),
        Op::Export(ExportRequest::default()),
        Op::ListApprovals {
            wait: Some(Duration::from_millis(5)),
        },
        Op::Approve {
            approval: Cow::Owned(approval.clone()),
        },
        Op::Deny {
            approval: Cow::Owned(approval),
            reason: Cow::Borrowed("no"),
        },
        Op::SetNetwork(NetworkRules::default()),
        // A revocation: a rotation carries a value, which no record holds (below).
        Op::SetSecret(SecretUpdate {
            name: "gh".into(),
            value: None,
        }),
        Op::Fork(ForkRequest {
            count: Some(2),
            checkpoint: Some("one".into()),
            ..ForkRequest::default()
        }),
        Op::Destroy,
    ]
}

/// An observation as comparable JSON: the answer, or the error's code and message.
fn seen<T: serde::Serialize>(r: Result<T, ApiError>) -> Value {
    match r {
        Ok(v) => serde_json::to_value(v).unwrap(),
        Err(e) => json!({"error": e.code(), "message": e.to_string()}),
    }
}

/// `op` made with the typed method it names.
fn typed(api: &dyn SandboxApi, id: &SandboxId, op: Op<'_>) -> Value {
    match op {
        Op::Info => seen(api.info(id)),
        Op::Exec { req, events } => seen(api.exec(id, req, events)),
        Op::Process { exec_id } => seen(api.process(id, exec_id)),
        Op::Wait { exec_id, timeout } => seen(api.wait(id, exec_id, timeout)),
        Op::Kill { exec_id, signal } => seen(api.kill(id, exec_id, signal)),
        Op::WriteStdin {
            exec_id,
            data,
            close,
        } => seen(api.write_stdin(id, exec_id, &data, close)),
        Op::Read(r) => seen(api.read(id, r)),
        Op::Write(r) => seen(api.write(id, r)),
        Op::Edit(r) => seen(api.edit(id, r)),
        Op::Patch(r) => seen(api.patch(id, r)),
        Op::ListDir(r) => seen(api.list_dir(id, r)),
        Op::Search(r) => seen(api.search(id, r)),
        Op::Stat(r) => seen(api.stat(id, r)),
        Op::Remove(r) => seen(api.remove(id, r)),
        Op::Rename(r) => seen(api.rename(id, r)),
        Op::Upload { req, body } => seen(api.upload(id, req, body)),
        Op::Download { req, sink } => seen(api.download(id, req, sink)),
        Op::Diff(r) => seen(api.diff(id, r)),
        Op::Checkpoint(r) => seen(api.checkpoint(id, r)),
        Op::Restore(r) => seen(api.restore(id, r)),
        Op::Export(r) => seen(api.export(id, r)),
        Op::Destroy => seen(api.destroy(id)),
        Op::ListApprovals { wait } => seen(api.list_approvals(id, wait)),
        Op::Approve { approval } => seen(api.approve(id, &approval)),
        Op::Deny { approval, reason } => seen(api.deny(id, &approval, &reason)),
        Op::SetNetwork(r) => seen(api.set_network(id, r)),
        Op::SetSecret(u) => seen(api.set_secret(id, u)),
        Op::Fork(r) => seen(api.fork(id, r)),
    }
}

fn sandbox(api: &dyn SandboxApi) -> SandboxId {
    api.create(CreateRequest {
        workspace: "/nonexistent-workspace".into(),
        ..CreateRequest::default()
    })
    .unwrap()
    .id
}

#[test]
fn every_op_is_listed_once_and_its_request_reads_back() {
    let names: Vec<OpName> = every_op().iter().map(Op::name).collect();
    let unique: BTreeSet<OpName> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    let missing: Vec<OpName> = OpName::ALL
        .into_iter()
        .filter(|n| *n != OpName::Create && !unique.contains(n))
        .collect();
    assert!(missing.is_empty(), "no sample of {missing:?}");
    for op in every_op() {
        let rq = op.request();
        if matches!(op.name(), OpName::Upload | OpName::Download) {
            // No record holds what they stream: they are not re-made from one.
            let e = Op::from_request(op.name(), &rq).unwrap_err();
            assert!(e.to_string().contains("streams its content"), "{e}");
            continue;
        }
        let back = Op::from_request(op.name(), &rq).unwrap();
        assert_eq!(back.name(), op.name());
        assert_eq!(back.request(), rq, "{op:?}");
    }
    // A rotation is recorded without its value, and so is not made again from its record.
    let rotation = Op::SetSecret(SecretUpdate {
        name: "gh".into(),
        value: Some(SecretValue::new("hunter2-value")),
    });
    let rq = rotation.request();
    assert_eq!(rq, json!({"name": "gh", "action": "rotate"}));
    assert!(!format!("{rotation:?}").contains("hunter2"));
    let e = Op::from_request(OpName::SetSecret, &rq).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");
    let e = Op::from_request(OpName::Create, &json!({})).unwrap_err();
    assert_eq!(e.to_string(), "create is not an operation on a sandbox");
    let e = Op::from_request(OpName::Kill, &json!({"exec_id": 1})).unwrap_err();
    assert!(e.to_string().contains("signal"), "{e}");
    let e = Op::from_request(
        OpName::WriteStdin,
        &json!({"exec_id": 1, "data": "!!", "encoding": "base64"}),
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("its base64 data does not decode"),
        "{e}"
    );
}

#[test]
fn what_changes_a_sandbox_is_what_the_trace_writes_ahead() {
    let changing: Vec<&str> = every_op()
        .iter()
        .filter(|op| op.changes_sandbox())
        .map(|op| op.name().as_str())
        .collect();
    assert_eq!(
        changing,
        [
            "exec",
            "kill",
            "stdin",
            "write",
            "edit",
            "patch",
            "remove",
            "move",
            "upload",
            "checkpoint",
            "restore",
            "approve",
            "network",
            "secret",
            "fork",
            "destroy"
        ]
    );
    let apply = Op::Export(ExportRequest {
        apply: true,
        ..ExportRequest::default()
    });
    assert!(
        apply.changes_sandbox(),
        "an export that applies writes the host copy"
    );
    let payloads: Vec<(OpName, &str)> = OpName::ALL
        .into_iter()
        .filter_map(|n| Some((n, n.payload_field()?)))
        .collect();
    assert_eq!(
        payloads,
        [(OpName::WriteStdin, "data"), (OpName::Write, "content")]
    );
}

#[test]
fn call_on_a_backend_answers_as_the_typed_method() {
    let (a, b) = (Scripted::default(), Scripted::default());
    let (ida, idb) = (sandbox(&a), sandbox(&b));
    assert_eq!(ida, idb, "the two scripted backends number alike");
    let ghost = SandboxId::parse("sb-ghost").unwrap();
    for (op, again) in every_op().into_iter().zip(every_op()) {
        let name = op.name();
        assert_eq!(
            seen(a.call(&ida, op)),
            typed(&b, &idb, again),
            "{name}: call differs from the typed method"
        );
    }
    for (op, again) in every_op().into_iter().zip(every_op()) {
        let name = op.name();
        let via_call = seen(a.call(&ghost, op));
        assert_eq!(via_call, typed(&b, &ghost, again), "{name} on a ghost");
        assert!(via_call.get("error").is_some(), "{name}: {via_call}");
    }
}

/// A decorator written as one `handle`: counts what it sees and hands everything on.
struct Counting<B> {
    inner: B,
    seen: Mutex<Vec<OpName>>,
}

impl<B: SandboxApi> OpHandler for Counting<B> {
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        self.seen.lock().unwrap().push(OpName::Create);
        self.inner.create(req)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        self.inner.list()
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        self.seen.lock().unwrap().push(op.name());
        self.inner.call(id, op)
    }
}

/// An upload and a download (which the scripted backend refuses, as a backend without
/// streaming does), and a secret's revocation (which it refuses too, having no proxy): the
/// pinned session leaves them out.
fn streamed(api: &dyn SandboxApi, id: &SandboxId) {
    let revoke = SecretUpdate {
        name: "gh".into(),
        value: None,
    };
    let e = api.set_secret(id, revoke).unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    let up = UploadRequest {
        path: "up.bin".into(),
        ..UploadRequest::default()
    };
    let e = api.upload(id, up, &mut &b"bytes"[..]).unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    let down = DownloadRequest {
        path: "a.txt".into(),
    };
    let e = api
        .download(id, down, &mut WriteSink(Vec::new()))
        .unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
}

#[test]
fn a_decorator_on_the_handler_trait_sees_every_operation_and_changes_no_trace() {
    let counting = Counting {
        inner: Scripted::default(),
        seen: Mutex::new(Vec::new()),
    };
    let dir = tempfile::tempdir().unwrap();
    // Traced over the decorator: the trace must be the one Traced writes over the backend.
    let api = Traced::new(counting, dir.path().join("traces"));
    let id = session(&api);
    streamed(&api, &sandbox(&api));
    // The scripted backend cannot fork (the default of the trait): the pinned session leaves
    // it out too.
    let e = api
        .fork(&sandbox(&api), ForkRequest::default())
        .unwrap_err();
    assert_eq!(e.code(), "invalid_argument", "{e}");
    let seen: BTreeSet<OpName> = api.inner().seen.lock().unwrap().iter().copied().collect();
    let all: BTreeSet<OpName> = OpName::ALL.into_iter().collect();
    assert_eq!(
        seen, all,
        "the typed methods reach handle as their operations"
    );

    let direct = Traced::new(Scripted::default(), dir.path().join("direct"));
    let id2 = session(&direct);
    streamed(&direct, &sandbox(&direct));
    let mask = |p| {
        let t = std::fs::read_to_string(p).unwrap();
        let re = regex::Regex::new(r#""(started_at_ms|duration_ms)":\d+"#).unwrap();
        re.replace_all(&t, "\"$1\":0").into_owned()
    };
    assert_eq!(id, id2);
    assert_eq!(mask(api.trace_path(&id)), mask(direct.trace_path(&id2)));
}

/// A handler whose every answer is "done".
struct Careless;

impl OpHandler for Careless {
    fn handle_create(&self, _: CreateRequest) -> Result<SandboxInfo, ApiError> {
        Err(ApiError::invalid("no"))
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        Vec::new()
    }

    fn handle(&self, _: &SandboxId, _: Op<'_>) -> Result<Answer, ApiError> {
        Ok(Answer::Done)
    }
}

#[test]
fn a_wrong_answer_is_an_internal_error_naming_both() {
    let id = SandboxId::parse("sb-1").unwrap();
    let e = Careless.diff(&id, DiffRequest::default()).unwrap_err();
    assert_eq!(e.code(), "internal");
    assert_eq!(
        e.to_string(),
        "internal error: operation diff was answered with nothing"
    );
    // The operations that answer nothing take "done".
    Careless.destroy(&id).unwrap();
    assert!(Careless.info(&id).is_err());
}

#[test]
fn a_trace_that_cannot_be_written_keeps_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let api = Traced::new(Scripted::default(), file.join("traces"));
    let e = api
        .create(CreateRequest {
            workspace: "/nonexistent-workspace".into(),
            ..CreateRequest::default()
        })
        .unwrap_err();
    assert_eq!(e.code(), "internal");
    let text = e.to_string();
    assert!(
        text.starts_with(
            "sandbox not created: its trace could not be recorded: cannot write trace"
        ),
        "{text}"
    );
    let cause = std::error::Error::source(&e).expect("the trace error is kept");
    let trace_error = cause
        .downcast_ref::<taskbox_trace::trace::TraceError>()
        .unwrap();
    assert!(matches!(
        trace_error,
        taskbox_trace::trace::TraceError::Write { .. }
    ));
    let io = std::error::Error::source(trace_error).unwrap();
    assert_eq!(
        io.downcast_ref::<std::io::Error>().unwrap().kind(),
        std::io::ErrorKind::NotADirectory
    );
    assert!(
        api.inner().list().is_empty(),
        "the sandbox was destroyed again"
    );
}
