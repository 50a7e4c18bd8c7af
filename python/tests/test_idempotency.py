"""`idempotency_key=` on create and on an applying export, through the sync and async clients,
against a real supervisor: a retry is done once and answered as the first time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import Supervisor

import taskbox
from taskbox import _calls as calls
from taskbox import models as m


def ids(client: taskbox.Client) -> list[str]:
    return [s.id for s in client.sandboxes()]


def test_a_retried_create_with_a_key_is_one_sandbox(client: taskbox.Client, workspace: Path) -> None:
    before = ids(client)
    a = client.create(workspace, labels={"job": "7"}, idempotency_key="py-create-1")
    try:
        b = client.create(workspace, labels={"job": "7"}, idempotency_key="py-create-1")
        assert b.id == a.id and b.info == a.info, "the first answer, as it was"
        assert sorted(ids(client)) == sorted([*before, a.id]), "one sandbox more, not two"
        with pytest.raises(taskbox.TaskboxError) as e:
            client.create(workspace, labels={"job": "8"}, idempotency_key="py-create-1")
        assert type(e.value) is taskbox.IdempotencyKeyReusedError
        assert (e.value.status, e.value.code) == (422, "idempotency_key_reused")
        # A key with the characters the header quotes is the same key each time.
        odd = 'job "7" \\ retry'
        c = client.create(workspace, idempotency_key=odd)
        try:
            assert client.create(workspace, idempotency_key=odd).id == c.id != a.id
        finally:
            c.destroy(missing_ok=True)
    finally:
        a.destroy(missing_ok=True)


def test_bad_keys_are_refused_before_and_by_the_supervisor(client: taskbox.Client, workspace: Path) -> None:
    before = ids(client)
    for bad in ["", "k" * 256, "caf\u00e9", "tab\there"]:
        with pytest.raises(ValueError, match="idempotency key"):
            client.create(workspace, idempotency_key=bad)
    # Sent anyway, the supervisor refuses it, naming the header.
    c = calls.create(m.CreateRequest(workspace=str(workspace)))
    c.headers["Idempotency-Key"] = "k" * 256
    with pytest.raises(taskbox.InvalidArgumentError) as e:
        client.send(c)
    assert e.value.status == 400 and "Idempotency-Key" in e.value.message
    assert ids(client) == before


def test_a_retried_apply_with_a_key_writes_the_host_once(client: taskbox.Client, workspace: Path) -> None:
    calc = workspace / "src" / "calc.py"
    fixed = "def add(a, b):\n    return a + b\n"
    with client.sandbox(workspace=workspace) as sb:
        sb.write("src/calc.py", fixed)
        first = sb.export(apply=True, idempotency_key="py-apply-1")
        assert first.applied and calc.read_text() == fixed
        # Edited on the host after the apply: the retry must leave that alone.
        calc.write_text("edited on the host\n")
        again = sb.export(apply=True, idempotency_key="py-apply-1")
        assert again == first
        assert calc.read_text() == "edited on the host\n"
        with pytest.raises(ValueError, match="apply=True"):
            sb.export(idempotency_key="py-apply-2")
        # Without a key the apply runs again, which is what the key prevents.
        assert sb.export(apply=True).applied and calc.read_text() == fixed


def test_async_concurrent_creates_with_one_key_make_one_sandbox(supervisor: Supervisor, workspace: Path) -> None:
    async def main() -> None:
        async with supervisor.async_client() as tb:
            before = {s.id for s in await tb.sandboxes()}
            made = await asyncio.gather(*(tb.create(workspace, idempotency_key="py-async-1") for _ in range(8)))
            try:
                assert len({sb.id for sb in made}) == 1, [sb.id for sb in made]
                assert {s.id for s in await tb.sandboxes()} - before == {made[0].id}
                sb = made[0]
                await sb.write("src/calc.py", "def add(a, b):\n    return a + b\n")
                first = await sb.export(apply=True, idempotency_key="py-async-apply")
                (workspace / "src" / "calc.py").write_text("edited on the host\n")
                assert await sb.export(apply=True, idempotency_key="py-async-apply") == first
                assert (workspace / "src" / "calc.py").read_text() == "edited on the host\n"
                with pytest.raises(taskbox.IdempotencyKeyReusedError):
                    await sb.export(apply=True, include_ignored=True, idempotency_key="py-async-apply")
            finally:
                await made[0].destroy(missing_ok=True)

    asyncio.run(main())
