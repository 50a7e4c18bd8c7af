"""The local supervisor: where it listens by default, which `taskbox` binary serves it, and how
one is started when none answers (as the CLI verbs do).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import TaskboxConnectionError, TaskboxError

#: How long a started supervisor has to answer `/healthz`, as for the CLI.
START_TIMEOUT = 10.0

# Supervisors this process started: kept so that Python does not warn about (or reap) a child
# that is meant to outlive the client.
_started: list[subprocess.Popen[bytes]] = []


def default_state_dir() -> Path:
    """taskbox's state directory, as the CLI finds it: `$TASKBOX_STATE_DIR`, `/var/lib/taskbox`
    for root, else `$XDG_STATE_HOME/taskbox` or `~/.local/state/taskbox`."""
    if d := os.environ.get("TASKBOX_STATE_DIR"):
        return Path(d)
    if os.geteuid() == 0:
        return Path("/var/lib/taskbox")
    if d := os.environ.get("XDG_STATE_HOME"):
        return Path(d) / "taskbox"
    return Path(os.environ.get("HOME") or "/tmp") / ".local/state/taskbox"


def default_socket(state_dir: Path | None = None) -> Path:
    """The supervisor's default Unix socket: `STATE/taskbox.sock`."""
    return (state_dir or default_state_dir()) / "taskbox.sock"


def _wheel_binary(name: str) -> Path | None:
    """`name` as installed by this package's own wheel (its `.data/scripts`), if this module was
    imported from that installation."""
    try:
        from importlib import metadata

        dist = metadata.distribution("taskbox")
    except Exception:
        return None
    here = Path(__file__).resolve().parent
    try:
        if Path(str(dist.locate_file("taskbox/__init__.py"))).resolve().parent != here:
            return None  # another installation than the one imported
    except OSError:
        return None
    for f in dist.files or ():
        if f.name == name and f.parent.name == "bin":
            path = Path(str(dist.locate_file(f))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def find_binary(name: str = "taskbox") -> Path:
    """The `taskbox` (or `taskbox-init`) binary: the one of this package's wheel first, then
    `$TASKBOX_BIN_DIR/NAME`, then `NAME` on PATH."""
    if p := _wheel_binary(name):
        return p
    if d := os.environ.get("TASKBOX_BIN_DIR"):
        p = Path(d) / name
        if p.is_file():
            return p
    if found := shutil.which(name):
        return Path(found)
    raise TaskboxError(
        f"cannot find the {name} binary: install the taskbox wheel (pip install taskbox), put "
        f"{name} on PATH, or set TASKBOX_BIN_DIR to the directory that holds it"
    )


def spawn_supervisor(socket: Path, state_dir: Path, binary: Path | None = None) -> Path:
    """Starts `taskbox serve --socket SOCKET --state-dir STATE` in its own session (it outlives
    this process), its log in `STATE/serve.log`, and says so on stderr. Returns the log's path."""
    exe = binary or find_binary("taskbox")
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir / "serve.log"
    with open(log_path, "ab") as log:
        try:
            child = subprocess.Popen(
                [str(exe), "serve", "--socket", str(socket), "--state-dir", str(state_dir)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise TaskboxConnectionError(f"cannot start a supervisor ({exe}): {e}") from e
    _started.append(child)
    print(
        f"taskbox: no supervisor was running; started one in the background "
        f"(socket {socket}, log {log_path})",
        file=sys.stderr,
    )
    return log_path


def not_up(log_path: Path) -> TaskboxConnectionError:
    tail = ""
    try:
        tail = log_path.read_text(errors="replace")[-2000:].strip()
    except OSError:
        pass
    why = f": {tail}" if tail else ""
    return TaskboxConnectionError(
        f"the supervisor did not come up within {START_TIMEOUT:.0f}s; see {log_path}{why}"
    )
