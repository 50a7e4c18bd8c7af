"""inspect-ai's own conformance checks for sandbox providers (`inspect_ai.util._sandbox.
self_check`, 44 checks) against `sandbox="taskbox"`, and one small real evaluation, on each
backend: the native backend with the host view (the default), the native backend with the
`debian-dev` image, and the Docker backend with that image. The image-rooted runs use the policy
`inspect-policy.toml` beside this file (a writable root and the capabilities adduser needs as
root), as a harness that sets up users in its image would.

Each check is a test here. The ones a backend cannot pass yet are strict xfails whose reason is
the API capability it lacks: the adapter fakes none of them, so such a check starts passing (and
this test fails, asking for its line in GAPS to go) only when the backend gains what it needs.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
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

#: The image of the image-rooted runs (it has adduser and userdel), and their policy.
IMAGE = "debian-dev"
POLICY = Path(__file__).with_name("inspect-policy.toml")


@dataclass(frozen=True)
class Variant:
    """Where the sandboxes of one run live."""

    name: str
    backend: str | None = None
    image: str | None = None
    #: Arguments of `taskbox serve` (`--docker`).
    serve: tuple[str, ...] = ()
    #: The checks this backend fails today, and why (the gap each one shows).
    gaps: dict[str, str] = field(default_factory=dict)


VARIANTS: list[Variant] = [
    Variant(
        "native",
        gaps={
            "test_exec_as_user": "the host view's root is the host's, read-only: no adduser as root",
        },
    ),
    Variant(
        "native-image",
        backend="native",
        image=IMAGE,
    ),
    Variant("docker", backend="docker", image=IMAGE, serve=("--docker",)),
]
CHECKS: list[str] = list(self_check.__all__) if self_check else []


def test_inspect_ai_is_there() -> None:
    require(self_check is not None, f"inspect-ai is not installed (pip install inspect-ai): {IMPORT_ERROR}")
    assert len(CHECKS) >= 44, CHECKS
    for v in VARIANTS:
        assert set(v.gaps) <= set(CHECKS), f"{v.name}: GAPS names checks inspect no longer has: {sorted(set(v.gaps) - set(CHECKS))}"


def test_the_entry_point_registers_sandbox_taskbox() -> None:
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    project = tomllib.loads((REPO / "python/pyproject.toml").read_text())["project"]
    module = project["entry-points"]["inspect_ai"]["taskbox"]
    importlib.import_module(module)
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    from taskbox.inspect import TaskboxSandboxEnvironment

    assert registry_find_sandboxenv("taskbox") is TaskboxSandboxEnvironment


def image_dir() -> Path:
    return Path(os.environ.get("TASKBOX_TEST_IMAGE_DIR", "/var/tmp/taskbox-test-images"))


def require_variant(v: Variant) -> None:
    """Skips (or, under TASKBOX_REQUIRE_ALL=1, fails) a run whose backend cannot be had here."""
    if v.image is None:
        return
    require(os.geteuid() == 0, f"{v.name}: the image store and the image-rooted backends need root")
    require((image_dir() / "index.json").is_file(),
            f"{v.name}: no image store at {image_dir()} (scripts/test.sh builds {IMAGE} into it)")
    if v.backend == "docker":
        ok = shutil.which("docker") is not None and subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True
        ).returncode == 0
        require(ok, "docker: no Docker daemon answers (start dockerd)")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def variant(request: pytest.FixtureRequest) -> Variant:
    return request.param


@pytest.fixture(scope="module")
def variant_supervisor(variant: Variant, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    require_variant(variant)
    env = {"TASKBOX_IMAGE_DIR": str(image_dir())} if variant.image else None
    sup = Supervisor(tmp_path_factory.mktemp(f"sup-{variant.name}"), *variant.serve, env=env)
    yield sup
    sup.stop()


def config(variant: Variant, sup: Supervisor, **kw: Any) -> Any:
    from taskbox.inspect import TaskboxSandboxConfig

    if variant.image is None:
        return TaskboxSandboxConfig(socket=str(sup.socket), **kw)
    return TaskboxSandboxConfig(
        socket=str(sup.socket),
        backend=variant.backend,
        image=variant.image,
        policy=POLICY.stem,
        policy_toml=POLICY.read_text(),
        **kw,
    )


@pytest.fixture(scope="module")
def sandbox_env(variant: Variant, variant_supervisor: Supervisor, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    from taskbox.inspect import TaskboxSandboxEnvironment

    cfg = config(variant, variant_supervisor)
    loop.run_until_complete(TaskboxSandboxEnvironment.task_init("self-check", cfg))
    envs = loop.run_until_complete(TaskboxSandboxEnvironment.sample_init("self-check", cfg, {}))
    yield envs["default"]
    loop.run_until_complete(TaskboxSandboxEnvironment.sample_cleanup("self-check", cfg, envs, False))
    # The sandbox is gone, and so is the sample's scratch workspace.
    env = envs["default"]
    assert env._scratch is None or not Path(env._scratch).exists()


def _check_params() -> list[Any]:
    params = []
    for v in VARIANTS:
        for c in CHECKS:
            marks = [pytest.mark.xfail(strict=True, reason=v.gaps[c])] if c in v.gaps else []
            params.append(pytest.param(v, c, marks=marks, id=f"{v.name}-{c}"))
    return params


@pytest.mark.parametrize(("variant", "check"), _check_params(), indirect=["variant"])
def test_self_check(variant: Variant, check: str, sandbox_env: Any, loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(getattr(self_check, check)(sandbox_env))


BY_NAME = [pytest.param(v, id=v.name) for v in VARIANTS]


@pytest.mark.parametrize("variant", BY_NAME, indirect=True)
def test_the_config_is_hashable_and_reaches_the_sandbox(
    variant: Variant, variant_supervisor: Supervisor, loop: asyncio.AbstractEventLoop
) -> None:
    """inspect keys its sandbox cache by the config (a dict field would make it unhashable)."""
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    from taskbox.inspect import TaskboxSandboxEnvironment

    cfg = config(variant, variant_supervisor, env={"GREETING": "hello"})
    assert hash(cfg) == hash(config(variant, variant_supervisor, env={"GREETING": "hello"}))
    assert TaskboxSandboxEnvironment.config_deserialize(cfg.model_dump()) == cfg

    async def run() -> str:
        envs = await TaskboxSandboxEnvironment.sample_init("cfg", cfg, {})
        try:
            return (await envs["default"].exec(["sh", "-c", "echo $GREETING"])).stdout
        finally:
            await TaskboxSandboxEnvironment.sample_cleanup("cfg", cfg, envs, False)

    assert loop.run_until_complete(run()) == "hello\n"


@pytest.mark.parametrize("variant", BY_NAME, indirect=True)
def test_a_real_eval_runs_its_tool_and_its_scorer_in_the_sandbox(
    variant: Variant, variant_supervisor: Supervisor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inspect evaluation end to end on `sandbox="taskbox"`: inspect's mockllm model, scripted
    to call inspect's `bash` tool once and then answer; a scorer that reads what the tool wrote,
    through the sandbox. The tool's command prints a variable only the sandbox's environment has,
    so its output shows that it ran there."""
    require(self_check is not None, f"inspect-ai is not installed: {IMPORT_ERROR}")
    import tiktoken
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ChatMessageTool, ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
    from inspect_ai.solver import TaskState, generate, use_tools
    from inspect_ai.tool import bash
    from inspect_ai.util import sandbox

    # mockllm counts tokens with tiktoken unless an output says its usage, and tiktoken would
    # download its encoding: every output below says it, and a call that still reached tiktoken
    # fails here instead of reaching the network.
    def no_download(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the eval asked tiktoken for an encoding (it would download it)")

    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    monkeypatch.setattr(tiktoken, "encoding_for_model", no_download)
    usage = ModelUsage(input_tokens=10, output_tokens=5, total_tokens=15)
    outputs = [
        ModelOutput.for_tool_call(
            model="mockllm/model",
            tool_name="bash",
            tool_arguments={"command": "echo 42 > answer.txt && echo \"ran in $WHERE\""},
        ),
        ModelOutput.from_content(model="mockllm/model", content="The answer is in answer.txt."),
    ]
    for o in outputs:
        o.usage = usage
    assert "WHERE" not in os.environ

    @scorer(metrics=[accuracy()])
    def answer_file() -> Any:
        async def score(state: TaskState, target: Target) -> Score:
            r = await sandbox().exec(["cat", "answer.txt"])
            got = r.stdout.strip()
            return Score(value=CORRECT if r.success and got == target.text else INCORRECT, answer=got)

        return score

    task = Task(
        dataset=[Sample(input="Write the answer, 42, to answer.txt.", target="42")],
        solver=[use_tools(bash(timeout=60)), generate()],
        scorer=answer_file(),
        sandbox=("taskbox", config(variant, variant_supervisor, env={"WHERE": "the-taskbox-sandbox"})),
    )
    [log] = eval(
        task,
        model=get_model("mockllm/model", custom_outputs=outputs),
        log_dir=str(tmp_path / "logs"),
        display="none",
    )
    assert log.status == "success", log.error
    assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 1.0
    [s] = log.samples or []
    assert s.scores is not None and next(iter(s.scores.values())).value == CORRECT, s.scores
    tool_out = [m.text for m in s.messages if isinstance(m, ChatMessageTool)]
    assert tool_out == ["ran in the-taskbox-sandbox\n"], s.messages
    # The sample's sandbox is gone with it.
    with variant_supervisor.client() as c:
        assert [sb.id for sb in c.sandboxes() if sb.labels.get("inspect-task")] == []


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(v, id=v.name)
        for v in VARIANTS
        if v.image
    ],
    indirect=True,
)
def test_the_sdk_runs_commands_as_a_named_user(
    variant: Variant, variant_supervisor: Supervisor, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    """`user=` of exec, exec_stream and start, sync and async, on the image with the policy
    above: a user root adds counts at once, an unknown one is `UserNotFoundError` naming it."""
    import taskbox

    tmp_path.chmod(0o755)  # a workspace every user of the sandbox may enter
    with variant_supervisor.client() as c, c.sandbox(
        workspace=tmp_path, backend=variant.backend, image=variant.image,
        policy=POLICY.stem, policy_toml=POLICY.read_text(),
    ) as sb:
        assert sb.exec("id -u", user="root").stdout.text == "0\n"
        r = sb.exec(["useradd", "--create-home", "--uid", "2345", "tester"], user="root")
        assert r.exit_code == 0, r
        assert sb.exec("id -un; echo $HOME", user="tester").stdout.text == "tester\n/home/tester\n"
        events = list(sb.exec_stream("id -u", user="2345"))
        ended = events[-1]
        assert isinstance(ended, taskbox.EndedEvent) and ended.result.stdout.text == "2345\n", events
        p = sb.start("id -un; sleep 30", user="tester")
        # Killed once it has said who it is (a kill at once could come before that line).
        deadline = time.monotonic() + 10
        while p.poll().stdout.text != "tester\n" and time.monotonic() < deadline:
            time.sleep(0.02)
        p.kill()
        info = p.wait(timeout=10)
        assert info.result is not None and info.result.signal == 9, info
        assert info.result.stdout.text == "tester\n", info
        with pytest.raises(taskbox.UserNotFoundError, match="nobody-such"):
            sb.exec("true", user="nobody-such")

        async def run() -> str:
            async with variant_supervisor.async_client() as ac:
                asb = await ac.get(sb.id)
                with pytest.raises(taskbox.UserNotFoundError):
                    await asb.exec("true", user="nobody-such")
                ap = await asb.start("whoami", user="tester")
                done = await ap.wait(timeout=10)
                assert done.result is not None
                return (await asb.exec("whoami", user="root")).stdout.text + done.result.stdout.text

        assert loop.run_until_complete(run()) == "root\ntester\n"
