"""inspect-ai's own conformance checks for sandbox providers (`inspect_ai.util._sandbox.
self_check`, 44 checks) against `sandbox="taskbox"` on the native backend.

Each check is a test here. The ones taskbox cannot pass yet are strict xfails whose reason is
the API capability it lacks: the adapter fakes none of them, so such a check starts passing
(and this test fails, asking for its line in GAPS to go) only when the API gains what it needs.
"""

from __future__ import annotations

import asyncio
import importlib
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Supervisor, require

try:
    from inspect_ai.util._sandbox import self_check
except ImportError as exc:  # the suite names it; require() decides skip or fail
    self_check = None
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = ""

#: The checks taskbox fails today, and why (the API gap each one shows).
GAPS: dict[str, str] = {
    "test_exec_as_user": "no exec as another user: the API runs every command as the sandbox's one user",
}
CHECKS: list[str] = list(self_check.__all__) if self_check else []


def test_inspect_ai_is_there() -> None:
    require(self_check is not None, f"inspect-ai is not installed (pip install inspect-ai): {IMPORT_ERROR}")
    assert len(CHECKS) >= 44, CHECKS
    assert set(GAPS) <= set(CHECKS), f"GAPS names checks inspect no longer has: {sorted(set(GAPS) - set(CHECKS))}"


def test_the_entry_point_registers_sandbox_taskbox() -> None:
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    project = tomllib.loads((REPO / "python/pyproject.toml").read_text())["project"]
    module = project["entry-points"]["inspect_ai"]["taskbox"]
    importlib.import_module(module)
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    from taskbox.inspect import TaskboxSandboxEnvironment

    assert registry_find_sandboxenv("taskbox") is TaskboxSandboxEnvironment


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def sandbox_env(supervisor: Supervisor, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    from taskbox.inspect import TaskboxSandboxConfig, TaskboxSandboxEnvironment

    cfg = TaskboxSandboxConfig(socket=str(supervisor.socket))
    loop.run_until_complete(TaskboxSandboxEnvironment.task_init("self-check", cfg))
    envs = loop.run_until_complete(TaskboxSandboxEnvironment.sample_init("self-check", cfg, {}))
    yield envs["default"]
    loop.run_until_complete(TaskboxSandboxEnvironment.sample_cleanup("self-check", cfg, envs, False))
    # The sandbox is gone, and so is the sample's scratch workspace.
    env = envs["default"]
    assert env._scratch is None or not Path(env._scratch).exists()


@pytest.mark.parametrize(
    "check",
    [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=GAPS[c])) if c in GAPS else c for c in CHECKS],
)
def test_self_check(check: str, sandbox_env: Any, loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(getattr(self_check, check)(sandbox_env))


def test_the_config_is_hashable_and_reaches_the_sandbox(supervisor: Supervisor, loop: asyncio.AbstractEventLoop) -> None:
    """inspect keys its sandbox cache by the config (a dict field would make it unhashable)."""
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    from taskbox.inspect import TaskboxSandboxConfig, TaskboxSandboxEnvironment

    cfg = TaskboxSandboxConfig(socket=str(supervisor.socket), env={"GREETING": "hello"})
    assert hash(cfg) == hash(TaskboxSandboxConfig(socket=str(supervisor.socket), env={"GREETING": "hello"}))
    assert TaskboxSandboxEnvironment.config_deserialize(cfg.model_dump()) == cfg

    async def run() -> str:
        envs = await TaskboxSandboxEnvironment.sample_init("cfg", cfg, {})
        try:
            return (await envs["default"].exec(["sh", "-c", "echo $GREETING"])).stdout
        finally:
            await TaskboxSandboxEnvironment.sample_cleanup("cfg", cfg, envs, False)

    assert loop.run_until_complete(run()) == "hello\n"
