"""One exception class per error code: the table against the codes of the Rust source, and each
class raised by a real supervisor on a real error."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import PENDING_CODES, Supervisor, make_workspace, require, rust_error_codes

import taskbox
from taskbox import errors
from taskbox._calls import Call

RUST = rust_error_codes()


def test_the_table_is_the_rust_codes() -> None:
    table = set(errors.ERRORS)
    assert RUST <= table, f"codes of the Rust source without an exception class: {sorted(RUST - table)}"
    extra = table - RUST
    assert extra <= PENDING_CODES, (
        f"exception classes for codes the Rust source does not have: {sorted(extra - PENDING_CODES)}"
    )
    for code, cls in errors.ERRORS.items():
        assert cls.CODE == code and issubclass(cls, taskbox.TaskboxError)
        assert getattr(taskbox, cls.__name__) is cls, f"taskbox.{cls.__name__} is not exported"
    assert len(set(errors.ERRORS.values())) == len(errors.ERRORS), "one class per code"


def test_an_unknown_code_is_a_base_error_that_keeps_it() -> None:
    e = errors.error_for("brand_new_code", "something new", 418)
    assert type(e) is taskbox.TaskboxError
    assert (e.code, e.message, e.status, str(e)) == ("brand_new_code", "something new", 418, "brand_new_code: something new")
    assert errors.error_for("internal", "x").is_infrastructure and errors.error_for("unavailable", "x").is_infrastructure
    assert not errors.error_for("not_found", "x").is_infrastructure
    # A missing sandbox is also a NotFoundError, so code written for either code works.
    assert issubclass(taskbox.SandboxNotFoundError, taskbox.NotFoundError)


def expected(code: str, today: type[taskbox.TaskboxError]) -> type[taskbox.TaskboxError]:
    """The class a real error raises: its code's, once the Rust source has the code; `today`'s
    (the code the supervisor answers with now) before."""
    return errors.ERRORS[code] if code in RUST else today


@pytest.fixture
def sb(client: taskbox.Client, workspace: Path) -> Iterator[taskbox.Sandbox]:
    with client.sandbox(workspace=workspace) as s:
        s.write("one.txt", "aa\n")
        assert s.exec("mkdir -p adir").ok
        yield s



def check(info: pytest.ExceptionInfo[taskbox.TaskboxError], cls: type[taskbox.TaskboxError], status: int) -> None:
    e = info.value
    assert type(e) is cls, f"{type(e).__name__} ({e.code}) raised, {cls.__name__} expected: {e}"
    assert e.status == status and e.message and e.code == (cls.CODE or e.code)


def test_api_errors_raise_their_classes(client: taskbox.Client, sb: taskbox.Sandbox) -> None:
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.read("missing.txt")
    check(e, taskbox.NotFoundError, 404)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.exec([])
    check(e, taskbox.InvalidArgumentError, 400)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.edit("one.txt", "zz", "yy")
    check(e, taskbox.EditNotFoundError, 422)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.edit("one.txt", "a", "b")
    check(e, taskbox.EditAmbiguousError, 422)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.patch("--- a/one.txt\n+++ b/one.txt\n@@ -1 +1 @@\n-nope\n+yes\n")
    check(e, taskbox.PatchFailedError, 422)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.read("../outside.txt")
    check(e, taskbox.PathRefusedError, 403)
    sb.checkpoint("taken")
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.checkpoint("taken")
    check(e, taskbox.ConflictError, 409)
    # A JSON body over the supervisor's limit; `write` itself sends such a file streamed.
    huge = "x" * (17 << 20)
    as_json = taskbox._calls.call("write", lambda r: r, body=taskbox.models.WriteRequest(path="huge.txt", content=huge), id=sb.id)
    with pytest.raises(taskbox.TaskboxError) as e:
        client.send(as_json)
    check(e, taskbox.TooLargeError, 413)
    assert "--max-body-bytes" in e.value.message
    assert taskbox.PayloadTooLargeError is taskbox.TooLargeError
    assert sb.write("huge.txt", huge).bytes_written == len(huge)
    assert sb.read_bytes("huge.txt") == huge.encode()
    with pytest.raises(taskbox.TaskboxError) as e:
        client.send(Call("PUT", "/v1/sandboxes", lambda r: r))
    check(e, taskbox.MethodNotAllowedError, 405)
    # The sandbox is still usable after all of them.
    assert sb.exec("cat one.txt").stdout.text == "aa\n"


def test_the_codes_being_added_raise_their_classes_once_the_api_has_them(client: taskbox.Client, sb: taskbox.Sandbox) -> None:
    with pytest.raises(taskbox.TaskboxError) as e:
        client.get("sb-0000000000000000")
    check(e, expected("sandbox_not_found", taskbox.NotFoundError), 404)
    with pytest.raises(taskbox.NotFoundError):
        sb.process(999)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.read("adir")
    cls = expected("is_a_directory", taskbox.InvalidArgumentError)
    check(e, cls, e.value.status or 0)
    with pytest.raises(taskbox.TaskboxError) as e:
        sb.read("one.txt/below")
    check(e, expected("not_a_directory", taskbox.InvalidArgumentError), e.value.status or 0)
    # A file the sandbox's own user may not read: with the code, the file routes refuse it as
    # exec would; before it, they read it (the gap the code closes).
    assert sb.exec("echo secret > locked.txt && chmod 000 locked.txt").ok
    if "permission_denied" in RUST:
        if sb.exec("cat locked.txt").exit_code == 0:
            require(False, "the sandbox's user reads a mode-000 file (it runs with CAP_DAC_OVERRIDE)")
        with pytest.raises(taskbox.PermissionDeniedError):
            sb.read("locked.txt")
    else:
        assert sb.read_text("locked.txt") == "secret\n"


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    """A supervisor with a quota of one sandbox and a body timeout of a second."""
    sup = Supervisor(tmp_path_factory.mktemp("tight"), "--max-sandboxes", "1", "--body-timeout", "1s")
    yield sup
    sup.stop()


def test_limit_exceeded_and_request_timeout(tight: Supervisor, tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws")
    with tight.client() as c, c.sandbox(workspace=ws) as sb:
        with pytest.raises(taskbox.TaskboxError) as e:
            c.create(ws)
        check(e, taskbox.LimitExceededError, 429)
        # Every 429 says when to try again.
        assert e.value.retry_after is not None and e.value.retry_after >= 1

        def stalls() -> Iterator[bytes]:
            yield b'{"path": "slow.txt", '
            time.sleep(3)
            yield b'"content": "x"}'

        method, path = taskbox._calls.route("write", id=sb.id)
        with pytest.raises(taskbox.TaskboxError) as e:
            c.send(Call(method, path, lambda r: r, content=stalls(), headers={"Content-Type": "application/json"}))
        check(e, taskbox.RequestTimeoutError, 408)
        assert sb.exec("true").ok


def test_unauthorized(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[token]]\ntoken = "right-token-0123456789"\ntenant = "t1"\n')
    tokens.chmod(0o600)
    sup = Supervisor(tmp_path, "--tokens", str(tokens))
    try:
        for token in (None, "wrong-token-0123456789"):
            with sup.client(token=token) as c, pytest.raises(taskbox.TaskboxError) as e:
                c.sandboxes()
            check(e, taskbox.UnauthorizedError, 401)
        with sup.client(token="right-token-0123456789") as c:
            assert c.sandboxes() == []
    finally:
        sup.stop()


def test_no_supervisor_is_a_connection_error(tmp_path: Path) -> None:
    with taskbox.Client(socket=tmp_path / "none.sock", start_supervisor=False) as c:
        with pytest.raises(taskbox.TaskboxConnectionError, match="none.sock"):
            c.health()
    with taskbox.Client("http://127.0.0.1:9", timeout=httpx.Timeout(2.0)) as c:
        with pytest.raises(taskbox.TaskboxConnectionError, match="127.0.0.1:9"):
            c.health()


def init_pid(sandbox_id: str) -> int:
    """The pid of the sandbox's init (pid 1 inside): the helper's child, both started with the
    sandbox's id on their command line."""
    label = f"taskbox-init - {sandbox_id} "
    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if label in cmdline:
            procs[int(d.name)] = ppid
    # The helper, whose parent is the supervisor; pid 1 is its child (exec starters and reapers,
    # forked from pid 1, have its command line too).
    helpers = [pid for pid, ppid in procs.items() if ppid not in procs]
    assert len(helpers) == 1, procs
    inits = [pid for pid, ppid in procs.items() if ppid == helpers[0]]
    assert len(inits) == 1, procs
    return inits[0]


def test_a_killed_init_raises_infrastructure_error(tmp_path: Path) -> None:
    import threading

    sup = Supervisor(tmp_path)
    try:
        ws = make_workspace(tmp_path / "ws")
        with sup.client() as c:
            sb = c.create(ws)
            failed = sb.exec("exit 3")
            assert failed.exit_code == 3, "a command's own failure is an observation, not an error"
            killed = sb.exec("kill -9 $$")
            assert killed.signal == 9 and killed.exit_code is None
            caught: list[BaseException] = []

            def run() -> None:
                try:
                    sb.exec("sleep 60")
                except BaseException as e:  # noqa: BLE001
                    caught.append(e)

            t = threading.Thread(target=run)
            t.start()
            time.sleep(1.0)
            os.kill(init_pid(sb.id), signal.SIGKILL)
            t.join(30)
            assert len(caught) == 1, caught
            e = caught[0]
            assert isinstance(e, taskbox.InfrastructureError) and e.code == "infrastructure", repr(e)
            assert e.is_infrastructure and "SIGKILL" in e.message, e.message
            for op in (lambda: sb.exec("true"), lambda: sb.read("README.md"), lambda: sb.diff()):
                with pytest.raises(taskbox.InfrastructureError, match="lost"):
                    op()
            info = sb.refresh()
            assert info.state == "lost" and info.lost_cause and "SIGKILL" in info.lost_cause, info
            sb.destroy()
    finally:
        sup.stop()


def test_a_supervisor_killed_mid_exec_raises_infrastructure_error(tmp_path: Path) -> None:
    import threading

    ws = make_workspace(tmp_path / "ws")
    sup = Supervisor(tmp_path)
    c = sup.client()
    sb = c.create(ws)
    caught: list[BaseException] = []

    def run() -> None:
        try:
            sb.exec("sleep 60")
        except BaseException as e:  # noqa: BLE001
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    sup.proc.kill()
    sup.proc.wait()
    t.join(30)
    assert len(caught) == 1 and isinstance(caught[0], taskbox.InfrastructureError), caught
    c.close()
    # A new supervisor on the same state: the sandbox was lost with the old one, and says so.
    sup.log.close()
    again = Supervisor(tmp_path)
    try:
        with again.client() as c2:
            lost = taskbox.Sandbox(c2, sb.info)
            with pytest.raises(taskbox.InfrastructureError, match="supervisor restarted") as e:
                lost.exec("true")
            assert e.value.code == "infrastructure" and e.value.status == 500
            with pytest.raises(taskbox.InfrastructureError):
                c2.get(sb.id)
            lost.destroy()
            with pytest.raises(taskbox.SandboxNotFoundError):
                c2.get(sb.id)
    finally:
        again.stop()
