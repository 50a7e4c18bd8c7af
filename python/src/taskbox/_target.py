"""Where a client connects: the supervisor's Unix socket (the default, started when none
answers) or a TCP URL with a bearer token."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from . import _local
from ._transport import Timeout

#: A base URL for requests over a Unix socket (the host part is not used).
SOCKET_BASE = "http://taskbox"
#: Connect quickly or fail; reads wait as long as the command runs (its own timeout bounds it).
DEFAULT_TIMEOUT = Timeout(connect=10.0, read=None)


@dataclass(frozen=True)
class Target:
    base_url: str
    socket: Path | None
    token: str | None
    state_dir: Path
    #: Start a supervisor on `socket` when none answers.
    start: bool

    @property
    def where(self) -> str:
        return f"unix socket {self.socket}" if self.socket else self.base_url

    def headers(self) -> dict[str, str]:
        h = {"User-Agent": "taskbox-python"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h


def resolve(
    url: str | None,
    socket: str | os.PathLike[str] | None,
    token: str | None,
    state_dir: str | os.PathLike[str] | None,
    start: bool | None,
) -> Target:
    """The target of a client's arguments; unset ones come from `TASKBOX_URL`, `TASKBOX_TOKEN`,
    then the default socket."""
    if url is None and socket is None:
        url = os.environ.get("TASKBOX_URL") or None
    if token is None:
        token = os.environ.get("TASKBOX_TOKEN") or None
    state = Path(state_dir) if state_dir is not None else _local.default_state_dir()
    if url is not None and socket is not None:
        raise ValueError("give url or socket, not both")
    if url is not None:
        if url.startswith("unix://"):
            socket = url[len("unix://"):]
        elif url.startswith(("http://", "https://")):
            return Target(url.rstrip("/"), None, token, state, False)
        else:
            raise ValueError(f"unsupported url {url!r}: expected http://HOST:PORT, https://... or unix:///PATH")
    path = Path(socket) if socket is not None else _local.default_socket(state)
    return Target(SOCKET_BASE, path, token, state, True if start is None else start)


def workspace_path(target: Target, workspace: str | os.PathLike[str] | None) -> str | None:
    """A workspace as the supervisor takes it: on the Unix socket (the same host) a local
    directory, made absolute and resolved; over TCP a directory of the supervisor's host, as
    given."""
    if workspace is None:
        return None
    if target.socket is not None:
        return os.path.realpath(os.fspath(workspace))
    return os.fspath(workspace)


def tar_of(source: str | os.PathLike[str] | bytes | IO[bytes]) -> IO[bytes]:
    """A directory packed as a tar (its contents at the tar's root), a tar file opened, or
    bytes wrapped: the body of a workspace upload."""
    if isinstance(source, (bytes, bytearray)):
        return io.BytesIO(bytes(source))
    if not isinstance(source, (str, os.PathLike)):
        return source
    path = Path(source)
    if path.is_file():
        return open(path, "rb")
    if not path.is_dir():
        raise FileNotFoundError(f"workspace {path} is neither a directory nor a tar file")
    out = tempfile.TemporaryFile()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    out.seek(0)
    return out
