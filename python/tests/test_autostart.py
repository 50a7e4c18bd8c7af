"""A client with no supervisor to talk to starts one, as the CLI verbs do: `taskbox serve
--socket STATE/taskbox.sock --state-dir STATE` in its own session, its log in STATE/serve.log."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from conftest import bin_dir, make_workspace, serve_pid, stop_pid, taskbox_bin

import taskbox


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    taskbox_bin()
    st = tmp_path / "st"
    monkeypatch.setenv("TASKBOX_STATE_DIR", str(st))
    monkeypatch.setenv("TASKBOX_BIN_DIR", str(bin_dir()))
    monkeypatch.delenv("TASKBOX_URL", raising=False)
    monkeypatch.delenv("TASKBOX_TOKEN", raising=False)
    yield st
    sock = st / "taskbox.sock"
    if sock.exists():
        try:
            stop_pid(serve_pid(sock))
        except OSError:
            pass


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_a_client_starts_the_local_supervisor_when_none_answers(state: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    sock = state / "taskbox.sock"
    assert taskbox.default_socket() == sock and not sock.exists()
    ws = make_workspace(tmp_path / "ws")
    with taskbox.Client() as tb, tb.sandbox(workspace=ws) as sb:
        assert tb.target.socket == sock
        assert sb.exec("echo up").stdout.text == "up\n"
    err = capfd.readouterr().err
    assert "no supervisor was running; started one in the background" in err and str(sock) in err
    pid = serve_pid(sock)
    args = cmdline(pid)
    assert Path(args[0]).resolve() == taskbox_bin().resolve()
    assert args[1:] == ["serve", "--socket", str(sock), "--state-dir", str(state)]
    assert os.getsid(pid) == pid, "the supervisor has a session of its own (it outlives the client)"
    assert (state / "serve.log").is_file()

    # The next client finds it: no second start.
    with taskbox.Client() as again:
        assert again.health().status == "ok"

    async def main() -> None:
        async with taskbox.AsyncClient() as tb:
            await tb.health()

    asyncio.run(main())
    assert "started" not in capfd.readouterr().err
    assert serve_pid(sock) == pid


def test_the_async_client_starts_one_too(state: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ws = make_workspace(tmp_path / "ws")

    async def main() -> str:
        async with taskbox.AsyncClient() as tb, tb.sandbox(workspace=ws) as sb:
            return (await sb.exec("echo async up")).stdout.text

    assert asyncio.run(main()) == "async up\n"
    assert "started one in the background" in capfd.readouterr().err
    assert serve_pid(state / "taskbox.sock") > 0


def test_a_client_that_may_not_start_one_says_so(state: Path, tmp_path: Path) -> None:
    with taskbox.Client(start_supervisor=False) as tb, pytest.raises(taskbox.TaskboxConnectionError, match="taskbox.sock"):
        tb.health()
    with taskbox.Client(taskbox_bin=tmp_path / "no-such-taskbox") as tb:
        with pytest.raises(taskbox.TaskboxConnectionError, match="cannot start a supervisor .*no-such-taskbox"):
            tb.health()
    assert not (state / "taskbox.sock").exists()
