"""The asynchronous client against a real supervisor."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import Supervisor

import taskbox
from taskbox import models as m


def test_async_create_exec_read_write_diff_destroy(supervisor: Supervisor, workspace: Path) -> None:
    async def main() -> None:
        async with supervisor.async_client() as tb:
            assert (await tb.health()).status == "ok"
            async with tb.sandbox(workspace=workspace) as sb:
                assert isinstance(sb, taskbox.AsyncSandbox)
                r = await sb.exec("echo hi; exit 4")
                assert (r.exit_code, r.stdout.text) == (4, "hi\n")
                await sb.write("src/calc.py", "def add(a, b):\n    return a + b\n")
                assert (await sb.read_text("src/calc.py")).endswith("a + b\n")
                await sb.write("b.bin", b"\x00\xff" * 10)
                assert await sb.read_bytes("b.bin") == b"\x00\xff" * 10
                await sb.edit("README.md", "demo", "async demo")
                d = await sb.diff()
                assert {f.path for f in d.files} == {"src/calc.py", "b.bin", "README.md"}
                assert (await sb.stat("README.md")).kind == "file" and await sb.exists("src")
                assert [e.path for e in (await sb.list(glob="*.md")).entries] == ["README.md"]
                assert (await sb.search("async")).matches[0].line == "# async demo"
                await sb.checkpoint("c1")
                await sb.write("later.txt", "x")
                await sb.restore("c1")
                assert not await sb.exists("later.txt")
                assert "async demo" in ((await sb.export()).patch or "")
                forks = await sb.fork(2)
                assert [type(f) for f in forks] == [taskbox.AsyncSandbox] * 2
                assert [f.info.forked_from.parent for f in forks if f.info.forked_from] == [sb.id] * 2
                assert all([(await f.read_text("README.md")).startswith("# async demo") for f in forks])
                for f in forks:
                    await f.destroy()
                sid = sb.id
            with pytest.raises(taskbox.NotFoundError):
                await tb.get(sid)

    asyncio.run(main())


def test_async_streaming_and_background(supervisor: Supervisor, workspace: Path) -> None:
    async def main() -> None:
        async with supervisor.async_client() as tb, tb.sandbox(workspace=workspace) as sb:
            events: list[m.AnyEvent] = []
            stamps: list[float] = []
            t0 = time.monotonic()
            async for ev in sb.exec_stream("echo one; sleep 1; echo two"):
                events.append(ev)
                stamps.append(time.monotonic() - t0)
            out = [e.data for e in events if isinstance(e, m.StdoutEvent)]
            assert out == ["one\n", "two\n"] and isinstance(events[-1], m.EndedEvent)
            first = next(i for i, e in enumerate(events) if isinstance(e, m.StdoutEvent))
            assert stamps[first] < stamps[-1] - 0.8, "output arrives while the command runs"

            p = await sb.start("read x; echo [$x]")
            assert isinstance(p, taskbox.AsyncProcess) and p.info.running
            await p.write("in\n", close=True)
            info = await p.wait(timeout=30)
            assert info.result is not None and info.result.stdout.text == "[in]\n"
            s = await sb.start(["sleep", "300"])
            await s.kill()
            assert (await s.wait(timeout=30)).result.signal == 9  # type: ignore[union-attr]

            with pytest.raises(taskbox.InvalidArgumentError):
                async for _ in sb.exec_stream([]):
                    pass
            with pytest.raises(taskbox.EditNotFoundError):
                await sb.edit("README.md", "absent", "x")

    asyncio.run(main())


def test_many_execs_run_concurrently(supervisor: Supervisor, workspace: Path) -> None:
    async def main() -> float:
        async with supervisor.async_client() as tb, tb.sandbox(workspace=workspace) as sb:
            t0 = time.monotonic()
            results = await asyncio.gather(*(sb.exec(f"sleep 1; echo {i}") for i in range(4)))
            assert sorted(r.stdout.text for r in results) == [f"{i}\n" for i in range(4)]
            return time.monotonic() - t0

    assert asyncio.run(main()) < 3.5, "four 1 s execs in parallel, not one after another"
