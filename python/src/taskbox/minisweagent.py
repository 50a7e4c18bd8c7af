"""taskbox as a mini-swe-agent environment: `environment_class:
taskbox.minisweagent.TaskboxEnvironment` in its configuration, or directly:

```python
from minisweagent.agents.default import DefaultAgent
from taskbox.minisweagent import TaskboxEnvironment

env = TaskboxEnvironment(workspace="path/to/repo", timeout=120)
DefaultAgent(model, env, **agent_config).run("fix the failing test")
print(env.sandbox.diff().diff)   # the agent's change; the repository itself is untouched
env.cleanup()
```

Each `execute` is one exec in the sandbox, its output the command's stdout and stderr merged in
the order written (the API's `merge_output`), as mini-swe-agent's own environments give them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from .client import Client, Sandbox

__all__ = ["TaskboxEnvironmentConfig", "TaskboxEnvironment"]


class TaskboxEnvironmentConfig(BaseModel):
    #: The repository the agent works on (an overlay: it is never changed); default: the
    #: current directory.
    workspace: str = ""
    #: Where commands run: relative to the workspace root, or absolute (default: the root).
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30
    #: The shell a command line runs under.
    interpreter: list[str] = ["/bin/sh", "-c"]
    url: str | None = None
    token: str | None = None
    socket: str | None = None
    policy: str | None = None
    policy_toml: str | None = None
    image: str | None = None
    backend: str | None = None
    #: Lease of the sandbox in seconds (default: the supervisor's).
    ttl: float | None = None


class TaskboxEnvironment:
    """A taskbox sandbox around a repository, for mini-swe-agent's agents."""

    def __init__(self, *, config_class: type = TaskboxEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        c = self.config
        self.client = Client(c.url, socket=c.socket, token=c.token)
        self.sandbox: Sandbox | None = None
        self.sandbox = self.client.create(
            c.workspace or os.getcwd(),
            policy=c.policy,
            policy_toml=c.policy_toml,
            image=c.image,
            backend=c.backend,
            env=c.env or None,
            labels={"harness": "mini-swe-agent"},
            ttl=c.ttl,
        )

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Runs `action["command"]` in the sandbox; the answer mini-swe-agent's environments give."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        assert self.sandbox is not None, "the sandbox was cleaned up"
        try:
            r = self.sandbox.exec(
                [*self.config.interpreter, command],
                cwd=cwd or self.config.cwd or None,
                timeout=limit,
                merge_output=True,
            )
            if r.timed_out:
                raise subprocess.TimeoutExpired(command, limit, output=r.stdout.text)
            output: dict[str, Any] = {"output": r.stdout.text, "returncode": r.exit_status, "exception_info": ""}
        except Exception as e:
            raw = getattr(e, "output", None)
            output = {
                "output": raw if isinstance(raw, str) else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raises `Submitted` when the command printed mini-swe-agent's end marker first."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        info = self.sandbox.info.model_dump() if self.sandbox else {}
        # The native backend runs the host's kernel: its uname is the sandbox's.
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), {"sandbox": info}, kwargs)

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                    "sandbox": self.sandbox.id if self.sandbox else None,
                }
            }
        }

    def cleanup(self) -> None:
        """Destroys the sandbox (its diff is gone with it: export it first if it is wanted)."""
        sb, self.sandbox = getattr(self, "sandbox", None), None
        if sb is not None:
            try:
                sb.destroy(missing_ok=True)
            finally:
                self.client.close()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:
            pass
