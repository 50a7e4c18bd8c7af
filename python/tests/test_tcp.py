"""Over TCP with a bearer token: `taskbox serve --listen 127.0.0.1:PORT --tokens FILE`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Supervisor, free_port, make_workspace

import taskbox

TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-0123456789"


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Supervisor, Path]]:
    d = tmp_path_factory.mktemp("tcp")
    tokens = d / "tokens.toml"
    tokens.write_text(f'[[token]]\ntoken = "{TOKEN_A}"\ntenant = "a"\n\n[[token]]\ntoken = "{TOKEN_B}"\ntenant = "b"\n')
    tokens.chmod(0o600)
    root = make_workspace(d / "roots" / "repo").parent
    last: Exception | None = None
    for _ in range(3):  # the free port may be taken before the supervisor binds it
        try:
            sup = Supervisor(d, "--tokens", str(tokens), "--workspace-root", str(root), listen=f"127.0.0.1:{free_port()}")
            break
        except RuntimeError as e:
            last = e
    else:
        raise AssertionError(f"cannot start a supervisor on a loopback port: {last}")
    yield sup, root / "repo"
    sup.stop()


def test_tcp_with_a_token(tcp: tuple[Supervisor, Path]) -> None:
    sup, repo = tcp
    assert sup.url and sup.url.startswith("http://127.0.0.1:")
    with taskbox.Client(sup.url, token=TOKEN_A) as a:
        assert a.target.socket is None
        with a.sandbox(workspace=str(repo)) as sb:
            assert sb.info.labels["taskbox.tenant"] == "a"
            r = sb.exec(["python3", "-c", "print(6 * 7)"])
            assert r.stdout.text == "42\n"
            sb.write("new.txt", "over tcp\n")
            assert sb.read_text("new.txt") == "over tcp\n"
            assert [f.path for f in sb.diff().files] == ["new.txt"]
            streamed = [e.data for e in sb.exec_stream("echo streamed") if isinstance(e, taskbox.StdoutEvent)]
            assert streamed == ["streamed\n"]
            # Another tenant does not see it: the same 404 as a missing sandbox.
            with taskbox.Client(sup.url, token=TOKEN_B) as b:
                assert b.sandboxes() == []
                with pytest.raises(taskbox.NotFoundError):
                    b.get(sb.id)
    with taskbox.Client(sup.url, token="not-a-token-0123456789") as bad, pytest.raises(taskbox.UnauthorizedError):
        bad.sandboxes()


def test_tcp_from_the_environment_and_async(tcp: tuple[Supervisor, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    sup, repo = tcp
    assert sup.url
    monkeypatch.setenv("TASKBOX_URL", sup.url)
    monkeypatch.setenv("TASKBOX_TOKEN", TOKEN_B)

    async def main() -> None:
        async with taskbox.AsyncClient() as tb, tb.sandbox(workspace=str(repo)) as sb:
            assert tb.target.base_url == sup.url and sb.info.labels["taskbox.tenant"] == "b"
            assert (await sb.exec("echo async tcp")).stdout.text == "async tcp\n"

    asyncio.run(main())


def test_a_local_directory_travels_as_an_upload(tcp: tuple[Supervisor, Path], tmp_path: Path) -> None:
    sup, _ = tcp
    local = make_workspace(tmp_path / "mine")
    (local / "only-here.txt").write_text("sent\n")
    with taskbox.Client(sup.url, token=TOKEN_A) as tb:
        # A directory outside the supervisor's workspace roots is refused over TCP...
        with pytest.raises(taskbox.TaskboxError):
            tb.create(str(local))
        # ...and sent as a tar instead.
        up = tb.upload_workspace(local)
        with tb.sandbox(workspace_id=up.id) as sb:
            assert sb.read_text("only-here.txt") == "sent\n"

    async def main() -> None:
        async with taskbox.AsyncClient(sup.url, token=TOKEN_A) as tb:
            up = await tb.upload_workspace(local)
            async with tb.sandbox(workspace_id=up.id) as sb:
                assert await sb.read_text("only-here.txt") == "sent\n"

    asyncio.run(main())
