//! The conformance suite of the library API: the contract a backend passes to be done.
//!
//! Every check is written once, in `taskbox_tests::conformance`, against a [`Subject`] (a backend
//! behind `dyn SandboxApi`, the create request its sandboxes are made from, and what its
//! sandboxes rightly say of themselves), and `api_conformance!` declares them as tests: here on
//! `native::` (the host view), `native_image::` (the suite image from the shared test store as
//! the root) and `docker::` (the same image in a container). A new backend invokes the macro in
//! its own crate's tests with its own subject, and is done when every check passes on it
//! (`docs/backends.md`).
//!
//! What it covers, per operation of [`SandboxApi`], with the error code of each bad input:
//! - create / list / info / destroy: the info's fields, labels, lease, env of the create, a
//!   destroyed sandbox gone from everything; bad creates (missing workspace, unknown policy or
//!   image, malformed policy, an upload id) refused and leaving no sandbox behind; every
//!   operation on an unknown sandbox id is `sandbox_not_found`.
//! - exec: argv (not split), shell, cwd (relative, absolute, missing), env (the create's, the
//!   exec's over it, invalid names), stdin, exit codes, signals, a missing command (127),
//!   malformed requests, the changes it made, timeout (partial output kept), output limit
//!   (head and tail kept, the whole stream readable through `read`), and the streamed events
//!   (started, then output, then ended with the same result; see the known divergences).
//! - background exec: process, wait (with and without the process ending), kill (bad signals
//!   refused), write_stdin (and after close/end), unknown exec ids `not_found`.
//! - read (line and byte ranges, max_bytes, binary as base64), write (create_parents, mode,
//!   base64, bad encodings), edit (not found, ambiguous, expected counts), patch (all or
//!   nothing: a failing hunk changes nothing), list_dir (depth, glob, hidden, ignored, limit),
//!   search (regex, glob, case, hidden, ignored, limit), stat, remove (recursive), rename
//!   (overwrite), diff (baseline, since a checkpoint), checkpoint / restore (unknown and taken
//!   names, invalid names), export (patch and tar; apply changes the host workspace, nothing
//!   before it does), list_approvals / approve / deny (a backend without a command policy has
//!   none), set_network (refused for a sandbox without an egress proxy).
//! - what a reviewer sees: a pytest run's `__pycache__` and `.pytest_cache`, the `.git/index`
//!   that `git status`/`git diff` rewrite, and files an agent's own `.gitignore` hides are left
//!   out of an exec's changes, the diff and the export, counted, and listed (as many as counted)
//!   with `include_ignored`; the export carries exactly the default diff; `.envrc`,
//!   `.vscode/tasks.json` and a CI workflow are flagged with their reasons, and `export --apply`
//!   refuses them (`path_refused`, the host untouched) until `allow_autorun`; a fix of the same
//!   size in the same second as the failing test run passes its test, five rounds running.
//! - absolute paths, the sandbox's own: every operation in `/tmp` and the workspace, the image's
//!   files read as `cat` reads them, writes allowed exactly where a command's are (a probe of the
//!   usual directories), a `chmod -r` file not read and a 0444 file not overwritten (by every
//!   operation, streamed ones included), each new error code on a real error, and a 100 MiB
//!   upload and download checked by digest.
//! - hostile input on every path-taking operation: `..` climbing out of the workspace or above
//!   the root, NUL bytes, empty paths (`path_refused` / `invalid_argument`, never a panic);
//!   `/proc/1/root`, `/proc/self/fd`, links planted in `/tmp` to `/etc`, to host paths and into
//!   `/proc` (inside the sandbox, or a 4xx); and
//!   the escapes that do not depend on the backend: symlinks (planted by the sandbox, or brought
//!   by the repository) to `/etc/shadow`, to a host file or directory outside the workspace, or
//!   up through `..`, cannot be read, written, edited, patched, renamed or removed through; a
//!   patch naming `../` or absolute paths is refused whole; a fifo cannot block the caller; no
//!   set-id bit reaches the host on export. The host's files beside the workspace, and the host
//!   workspace until an export applies, are checked unchanged entry by entry.
//!
//! The native variant runs rootless too (scripts/test.sh); the image-rooted ones need root (the
//! shared image store) and docker a daemon: they skip with the reason, or fail under
//! `TASKBOX_REQUIRE_ALL=1`. Sandboxes are reused within a check to keep the suite quick.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::collections::BTreeMap;
use std::sync::Arc;

use taskbox_core::api::*;
use taskbox_core::image::ImageResolver;
use taskbox_core::sandbox::NativeBackend;
use taskbox_docker::{Docker, DockerConfig};
use taskbox_tests::suite::{Expect, Subject, docker_lock};
use taskbox_tests::{Backend, Env, SUITE_IMAGE, test_image_dir};

/// The image store the image-rooted variants resolve the suite image in.
fn store(env: &Env) -> Arc<taskbox_image::Store> {
    Arc::new(taskbox_image::Store::open_in(&env.state(), test_image_dir()).unwrap())
}

/// The backend `backend` as a subject, or None (the reason printed) when it cannot run here.
fn subject(backend: Backend) -> Option<Subject> {
    let env = Env::for_backend(backend)?;
    let template = CreateRequest {
        env: BTreeMap::from([("CONF_CREATE".into(), "from-create".into())]),
        labels: BTreeMap::from([("suite".into(), "api-conformance".into())]),
        ..CreateRequest::default()
    };
    let native = || NativeBackend::new(env.state()).unwrap();
    let digest = || store(&env).resolve(SUITE_IMAGE).unwrap().digest;
    let expect = match backend {
        Backend::Native => Expect {
            backend: "native",
            image: "host".into(),
            landlock: "full",
        },
        Backend::NativeImage => Expect {
            backend: "native",
            image: digest(),
            landlock: "full",
        },
        // The container is the boundary: no Landlock inside it.
        Backend::Docker => Expect {
            backend: "docker",
            image: digest(),
            landlock: "none",
        },
    };
    let (api, template, lock): (Box<dyn SandboxApi>, _, _) = match backend {
        Backend::Native => (Box::new(native()), template, None),
        Backend::NativeImage => (
            Box::new(native().with_images(store(&env))),
            CreateRequest {
                image: Some(SUITE_IMAGE.into()),
                ..template
            },
            None,
        ),
        Backend::Docker => {
            let lock = docker_lock();
            let docker = Docker::open(&env.state(), store(&env), DockerConfig::default())
                .unwrap_or_else(|e| panic!("the docker backend: {e}"));
            (
                Box::new(docker) as Box<dyn SandboxApi>,
                CreateRequest {
                    backend: Some("docker".into()),
                    image: Some(SUITE_IMAGE.into()),
                    ..template
                },
                Some(lock),
            )
        }
    };
    Some(Subject::new(expect, env, api, template, lock))
}

mod native {
    taskbox_tests::api_conformance!(super::subject(taskbox_tests::Backend::Native));
}

mod native_image {
    taskbox_tests::api_conformance!(super::subject(taskbox_tests::Backend::NativeImage));
}

mod docker {
    taskbox_tests::api_conformance!(super::subject(taskbox_tests::Backend::Docker));
}
