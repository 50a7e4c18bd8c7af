"""taskbox: sandboxed execution for AI coding agents, from Python.

```python
import taskbox

with taskbox.Client() as tb:                      # the local supervisor (started if needed)
    with tb.sandbox(workspace=".") as sb:         # destroyed when the block ends
        r = sb.exec("pytest -q")                  # an ExecResult: exit code, output, changes
        print(r.exit_code, r.stdout.text)
        sb.write("notes.txt", "hello\\n")
        print(sb.diff().diff)                     # what changed, as a unified diff
```

[`Client`] and [`AsyncClient`] talk to `taskbox serve` over its Unix socket or over TCP with a
bearer token; [`Sandbox`] holds the operations of one sandbox. Answers are typed models
(`taskbox.models`); errors are one exception class per API error code (`taskbox.errors`).
"""

from __future__ import annotations

from . import errors, models
from ._local import default_socket, default_state_dir, find_binary
from ._transport import Timeout
from .aio import AsyncClient, AsyncProcess, AsyncSandbox
from .client import Client, Process, Sandbox
from .errors import *  # noqa: F403
from .models import (
    AnsweredEvent,
    AnyEvent,
    Approval,
    ApprovalEvent,
    Change,
    CheckpointInfo,
    DiffResult,
    EndedEvent,
    ExecEvent,
    ExecResult,
    ExportResult,
    Finding,
    Location,
    Output,
    ProcessInfo,
    ReadResult,
    SandboxInfo,
    StartedEvent,
    StderrEvent,
    StdoutEvent,
    TestCounts,
    Violation,
)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("taskbox")
    except Exception:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "Client",
    "Sandbox",
    "Process",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncProcess",
    "default_socket",
    "default_state_dir",
    "find_binary",
    "Timeout",
    "errors",
    "models",
    "AnsweredEvent",
    "AnyEvent",
    "Approval",
    "ApprovalEvent",
    "Change",
    "CheckpointInfo",
    "DiffResult",
    "EndedEvent",
    "ExecEvent",
    "ExecResult",
    "ExportResult",
    "Finding",
    "Location",
    "Output",
    "ProcessInfo",
    "ReadResult",
    "SandboxInfo",
    "StartedEvent",
    "StderrEvent",
    "StdoutEvent",
    "TestCounts",
    "Violation",
    *errors.__all__,
]
