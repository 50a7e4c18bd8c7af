//! The harness of the library API's conformance suite (`tests/api_conformance.rs`): a
//! [`Subject`] is one backend behind `dyn SandboxApi`, the create request its sandboxes are made
//! from, and the scratch directories they use. The suite is written once against a subject;
//! building one per backend is the suite file's business, so this module names no backend crate.

use std::fmt::Debug;
use std::path::PathBuf;

use taskbox_core::api::{
    ApiError, CreateRequest, ExecOutcome, ExecRequest, ProcessInfo, SandboxApi, SandboxId,
};
use taskbox_core::result::ExecResult;

use crate::Env;

/// What a backend's sandboxes say of themselves, where backends rightly differ.
#[derive(Debug, Clone)]
pub struct Expect {
    /// `SandboxInfo.backend`.
    pub backend: &'static str,
    /// `SandboxInfo.image`: "host" for the host view, else the image's digest.
    pub image: String,
    /// `Enforcement.landlock` of the default policy ("full" where each exec is confined by
    /// Landlock, "none" where the boundary is a container or a VM).
    pub landlock: &'static str,
}

/// One backend under test, with its create-request template.
pub struct Subject {
    // Declared first so it is dropped first: the backend destroys its sandboxes before the
    // scratch directories holding their workspaces and state go.
    pub api: Box<dyn SandboxApi>,
    pub expect: Expect,
    pub env: Env,
    template: CreateRequest,
    _lock: Option<std::fs::File>,
}

impl Subject {
    /// A subject: `api` serving sandboxes made from `template` (its workspace set to `env`'s),
    /// holding `lock` (if any) while it lives.
    pub fn new(
        expect: Expect,
        env: Env,
        api: Box<dyn SandboxApi>,
        mut template: CreateRequest,
        lock: Option<std::fs::File>,
    ) -> Subject {
        template.workspace = env.ws().display().to_string();
        Subject {
            api,
            expect,
            env,
            template,
            _lock: lock,
        }
    }

    /// The create request of this backend's sandboxes (a fresh copy to adjust).
    pub fn request(&self) -> CreateRequest {
        self.template.clone()
    }

    /// A new sandbox from the template.
    pub fn create(&self) -> SandboxId {
        match self.api.create(self.request()) {
            Ok(info) => info.id,
            Err(e) => panic!("create on {}: {} ({e})", self.expect.backend, e.code()),
        }
    }

    /// The host copy of the workspace.
    pub fn ws(&self) -> PathBuf {
        self.env.ws()
    }

    /// The workspace's absolute path as commands (and absolute request paths) see it.
    pub fn inside_ws(&self) -> String {
        self.env.inside_ws().display().to_string()
    }

    /// Runs `req` in the foreground; its result (the test fails on an error).
    pub fn run(&self, id: &SandboxId, req: ExecRequest) -> ExecResult {
        match self.api.exec(id, req, None) {
            Ok(ExecOutcome::Finished(r)) => r,
            other => panic!("expected a finished exec, got {other:?}"),
        }
    }

    /// Runs `script` with `/bin/sh -c` in the foreground.
    pub fn sh(&self, id: &SandboxId, script: &str) -> ExecResult {
        self.run(
            id,
            ExecRequest {
                shell: Some(script.into()),
                ..ExecRequest::default()
            },
        )
    }

    /// Starts `req` in the background; its handle.
    pub fn background(&self, id: &SandboxId, req: ExecRequest) -> ProcessInfo {
        let req = ExecRequest {
            background: true,
            ..req
        };
        match self.api.exec(id, req, None) {
            Ok(ExecOutcome::Background(p)) => p,
            other => panic!("expected a background handle, got {other:?}"),
        }
    }
}

/// The error code of `r`, which must be an error (`what` names the call in the failure).
pub fn code_of<T: Debug>(what: &str, r: Result<T, ApiError>) -> &'static str {
    match r {
        Err(e) => {
            let m = e.to_string();
            assert!(!m.is_empty(), "{what}: an error without a message");
            assert!(m.len() < 2000, "{what}: a message of {} bytes", m.len());
            e.code()
        }
        Ok(v) => panic!("{what}: succeeded with {v:?}, expected an error"),
    }
}

/// Asserts that `r` failed with `code`.
#[track_caller]
pub fn expect_code<T: Debug>(what: &str, r: Result<T, ApiError>, code: &str) {
    let got = match r {
        Err(e) => {
            assert_eq!(e.code(), code, "{what}: {e}");
            return;
        }
        Ok(v) => format!("{v:?}"),
    };
    panic!("{what}: succeeded with {got}, expected {code}");
}

/// A shared lock on the file the Docker backend's suites lock: its dockerd restart test holds it
/// exclusively, so no Docker test of this suite runs while the daemon is down.
pub fn docker_lock() -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/taskbox-docker-tests.lock")
        .expect("open the docker test lock");
    // SAFETY: flock on a descriptor we own; released when the file is dropped.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) }, 0);
    f
}
