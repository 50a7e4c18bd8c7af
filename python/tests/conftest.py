"""Shared fixtures of the SDK's suite: a real `taskbox serve` started from the built binaries
(`TASKBOX_BIN_DIR`, else the cargo target directory's `debug/`) on a temporary socket and state
directory, and the skip-or-fail rule of the Rust suites (`TASKBOX_REQUIRE_ALL=1` turns every
skip into a failure)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "src"))

import taskbox  # noqa: E402

#: Codes the Python table has before the Rust source does (another change adds them); the
#: table test tolerates exactly these being absent from the Rust source. None now.
PENDING_CODES: frozenset[str] = frozenset()


def require_all() -> bool:
    return os.environ.get("TASKBOX_REQUIRE_ALL") == "1"


def require(ok: bool, reason: str) -> None:
    """Skips the test with `reason` unless `ok`; under `TASKBOX_REQUIRE_ALL=1` fails it."""
    if ok:
        return
    if require_all():
        pytest.fail(f"required prerequisite missing (TASKBOX_REQUIRE_ALL=1): {reason}")
    pytest.skip(reason)


def target_dir() -> Path:
    if d := os.environ.get("CARGO_TARGET_DIR"):
        return Path(d)
    return REPO / "target"


def bin_dir() -> Path:
    if d := os.environ.get("TASKBOX_BIN_DIR"):
        return Path(d)
    return target_dir() / "debug"


def taskbox_bin() -> Path:
    p = bin_dir() / "taskbox"
    require(p.is_file() and (bin_dir() / "taskbox-init").is_file(),
            f"no taskbox and taskbox-init binaries in {bin_dir()} (cargo build --bins, or set TASKBOX_BIN_DIR)")
    return p


def rust_error_codes() -> set[str]:
    """Every error code the Rust source answers with: `ApiError::code()` of the contract and
    `HttpError::code()` of the server."""
    codes: set[str] = set()
    for rel, fn in [("runtime/contract/src/api.rs", "ApiError"), ("runtime/server/src/error.rs", "HttpError")]:
        text = (REPO / rel).read_text()
        body = re.search(r"pub fn code\(&self\) -> &'static str \{(.*?)\n    \}", text, re.S)
        assert body, f"no {fn}::code() in {rel}"
        codes |= set(re.findall(r'=> "([a-z_]+)"', body.group(1)))
    assert codes, "no error codes found in the Rust source"
    return codes


def serve_pid(sock: Path) -> int:
    """The pid of the process listening on a Unix socket (its peer credentials)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


def stop_pid(pid: int, timeout: float = 25.0) -> None:
    """SIGTERM (the supervisor destroys its sandboxes), then SIGKILL after `timeout`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A child of ours stays a zombie until reaped.
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    """A real `taskbox serve` on `DIR/taskbox.sock` (or a loopback TCP port), state in `DIR/state`,
    with `extra` arguments (`--docker`) and `env` over this process's environment."""

    def __init__(self, dir: Path, *extra: str, listen: str | None = None, env: dict[str, str] | None = None):
        self.dir = dir
        self.state = dir / "state"
        self.socket = None if listen else dir / "taskbox.sock"
        self.url = f"http://{listen}" if listen else None
        cmd = [str(taskbox_bin()), "serve", "--state-dir", str(self.state)]
        cmd += ["--listen", listen] if listen else ["--socket", str(self.socket)]
        cmd += list(extra)
        self.log = open(dir / "serve.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     env={**os.environ, **env} if env else None)
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the supervisor did not come up: {(dir / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        import httpx

        try:
            if self.socket:
                if not self.socket.exists():
                    return False
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket))) as c:
                    return c.get("http://x/healthz").status_code == 200
            with httpx.Client() as c:
                return c.get(f"{self.url}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def client(self, **kw: object) -> taskbox.Client:
        if self.socket:
            return taskbox.Client(socket=self.socket, start_supervisor=False, **kw)  # type: ignore[arg-type]
        return taskbox.Client(self.url, **kw)  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> taskbox.AsyncClient:
        if self.socket:
            return taskbox.AsyncClient(socket=self.socket, start_supervisor=False, **kw)  # type: ignore[arg-type]
        return taskbox.AsyncClient(self.url, **kw)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_pid(self.proc.pid)
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path_factory.mktemp("sup"))
    yield sup
    sup.stop()


@pytest.fixture
def client(supervisor: Supervisor) -> Iterator[taskbox.Client]:
    with supervisor.client() as c:
        yield c


def make_workspace(root: Path) -> Path:
    """A small repository-like directory: a module, its test, a README."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("# demo\n")
    (root / "src").mkdir(exist_ok=True)
    (root / "src" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


@pytest.fixture
def sandbox(client: taskbox.Client, workspace: Path) -> Iterator[taskbox.Sandbox]:
    with client.sandbox(workspace=workspace) as sb:
        yield sb

