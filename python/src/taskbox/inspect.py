"""taskbox as an inspect-ai sandbox: `sandbox="taskbox"` in a task or on the command line.

Registered through inspect's entry point (`[project.entry-points.inspect_ai]` of the package),
so installing the wheel is all it takes. Each sample gets a sandbox around a fresh, empty
workspace (or around `workspace` from the configuration), destroyed at the sample's cleanup:

```python
Task(..., sandbox=("taskbox", TaskboxSandboxConfig(policy="default")))
```

The adapter translates, it does not emulate: what the sandbox cannot do fails as it fails.
`user=` runs the command as that user of the sandbox (a name of its own `/etc/passwd`, or a
numeric uid); a name the sandbox does not know is a failed result whose stderr names it, as
inspect expects. Becoming root and managing users (inspect's `adduser` check) needs an image and
a policy that allow it: `filesystem.root = "writable"` and the `security.root_capabilities`
adduser uses. The errors of file operations map to the builtins inspect expects by their API code (a missing file is `FileNotFoundError`, a refused path or a
permission the sandbox's own check denies is `PermissionError`, a directory is
`IsADirectoryError`), never by looking at mode bits or messages.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel, field_validator

from . import errors as e
from ._calls import content_bytes
from .aio import AsyncClient, AsyncSandbox
from .models import ExecResult as TaskboxExecResult

__all__ = ["TaskboxSandboxConfig", "TaskboxSandboxEnvironment"]

#: Bytes asked for per read.
_CHUNK = 16 << 20


class TaskboxSandboxConfig(BaseModel, frozen=True):
    """How the sandboxes of a task are made. Unset fields take the client's and the
    supervisor's defaults (the local supervisor, the default policy, the host view)."""

    #: `http://HOST:PORT` of a supervisor (with `token`); default: the local one's socket.
    url: str | None = None
    token: str | None = None
    socket: str | None = None
    #: A directory the workspace starts from (an overlay: it is never changed). Default: a
    #: fresh empty directory per sample.
    workspace: str | None = None
    policy: str | None = None
    #: A policy's TOML text (instead of a profile name).
    policy_toml: str | None = None
    image: str | None = None
    backend: str | None = None
    #: Variables of every exec (a mapping; kept as pairs, since inspect hashes the config).
    env: tuple[tuple[str, str], ...] = ()
    #: Lease of each sandbox, in seconds (default: the supervisor's).
    ttl: float | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _pairs(cls, v: Any) -> Any:
        return tuple(sorted(v.items())) if isinstance(v, Mapping) else v


def _config(config: SandboxEnvironmentConfigType | None) -> TaskboxSandboxConfig:
    if config is None:
        return TaskboxSandboxConfig()
    if isinstance(config, TaskboxSandboxConfig):
        return config
    if isinstance(config, str):
        # A file: a policy for the sandboxes.
        return TaskboxSandboxConfig(policy=Path(config).stem, policy_toml=Path(config).read_text())
    if isinstance(config, BaseModel):
        return TaskboxSandboxConfig(**config.model_dump())
    raise TypeError(f"unsupported taskbox sandbox config {config!r}")


def _client(cfg: TaskboxSandboxConfig) -> AsyncClient:
    return AsyncClient(cfg.url, socket=cfg.socket, token=cfg.token)


def _file_error(err: e.TaskboxError, file: str) -> BaseException:
    """The builtin exception inspect expects for an API error on `file`, by its code."""
    if isinstance(err, e.NotFoundError) and not isinstance(err, e.SandboxNotFoundError):
        return FileNotFoundError(errno.ENOENT, err.message, file)
    if isinstance(err, e.IsDirectoryError):
        return IsADirectoryError(errno.EISDIR, err.message, file)
    if isinstance(err, e.NotDirectoryError):
        return NotADirectoryError(errno.ENOTDIR, err.message, file)
    if isinstance(err, (e.PermissionDeniedError, e.PathRefusedError)):
        return PermissionError(errno.EACCES, err.message, file)
    return err


@sandboxenv(name="taskbox")
class TaskboxSandboxEnvironment(SandboxEnvironment):
    """One taskbox sandbox as an inspect `SandboxEnvironment`."""

    def __init__(self, client: AsyncClient, sandbox: AsyncSandbox, scratch: str | None) -> None:
        super().__init__()
        self.client = client
        self.sandbox = sandbox
        self._scratch = scratch

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return TaskboxSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        # Fail at the start of the task, not at its first sample, when no supervisor can be had.
        async with _client(_config(config)) as c:
            await c.connect()

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        cfg = _config(config)
        client = _client(cfg)
        scratch = None
        workspace: str | None = cfg.workspace
        workspace_id = None
        try:
            if workspace is None:
                scratch = tempfile.mkdtemp(prefix="taskbox-inspect-")
                # Every user of the sandbox may enter the workspace (inspect runs commands as
                # other users in it), as a container's working directory lets them.
                os.chmod(scratch, 0o755)
                if client.target.socket is not None:
                    workspace = scratch
                else:
                    workspace_id = (await client.upload_workspace(scratch)).id
            sb = await client.create(
                workspace,
                workspace_id=workspace_id,
                policy=cfg.policy,
                policy_toml=cfg.policy_toml,
                image=cfg.image,
                backend=cfg.backend,
                env=dict(cfg.env) or None,
                labels={"inspect-task": task_name[:200]},
                ttl=cfg.ttl,
            )
        except BaseException:
            await client.close()
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        return {"default": cls(client, sb, scratch)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for env in environments.values():
            tb = env.as_type(TaskboxSandboxEnvironment)
            try:
                await tb.sandbox.destroy(missing_ok=True)
            finally:
                await tb.client.close()
                if tb._scratch:
                    shutil.rmtree(tb._scratch, ignore_errors=True)

    def default_polling_interval(self) -> float:
        return 0.2

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            r = await self.sandbox.exec(
                cmd, cwd=cwd, env=env, stdin=input, timeout=timeout, output_limit=limit, user=user
            )
        except e.UserNotFoundError as err:
            # The command never ran (126, as `docker exec -u` answers): a failed result that
            # says why, naming the user.
            return ExecResult(success=False, returncode=126, stdout="", stderr=f"{err.message}\n")
        if r.timed_out:
            err = TimeoutError(f"Command timed out after {timeout} seconds")
            partial = r.stdout.text + r.stderr.text
            if partial:
                setattr(err, "truncated_output", partial)
            raise err
        if _exec_refused(r, cmd, "Permission denied"):
            raise PermissionError(errno.EACCES, r.stderr.text.strip(), cmd[0])
        for stream in (r.stdout, r.stderr):
            if stream.truncated:
                raise OutputLimitExceededError(
                    limit_str=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                    truncated_output=stream.text,
                )
        code = r.exit_status
        return ExecResult(success=code == 0, returncode=code, stdout=r.stdout.text, stderr=r.stderr.text)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        try:
            await self.sandbox.write(file, contents, create_parents=True)
        except e.TaskboxError as err:
            raise _file_error(err, file) from err

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        out = bytearray()
        try:
            while True:
                r = await self.sandbox.read(file, offset=len(out), max_bytes=_CHUNK)
                if r.total_bytes > limit:
                    raise OutputLimitExceededError(
                        limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
                    )
                chunk = content_bytes(r)
                out += chunk
                if not chunk or len(out) >= r.total_bytes:
                    break
        except e.TaskboxError as err:
            raise _file_error(err, file) from err
        return out.decode("utf-8") if text else bytes(out)


def _exec_refused(r: TaskboxExecResult, cmd: list[str], why: str) -> bool:
    """Whether the command did not start because execve refused it with `why`: taskbox's own
    report of the kernel's answer (exit 126 and its one line), not a guess from the file."""
    return (
        r.exit_code == 126
        and bool(cmd)
        and r.stderr.text.startswith(f"taskbox: cannot run `{cmd[0]}`: {why}")
    )

