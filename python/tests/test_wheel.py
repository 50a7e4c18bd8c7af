"""The wheel (scripts/wheel.sh) in a fresh venv: `pip install` of the file, then a sandbox from
`python -c` with no other setup: the wheel's own `taskbox` and `taskbox-init` do the work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import bin_dir, make_workspace, require, serve_pid, stop_pid, target_dir

SCRIPT = r"""
import importlib.metadata, json, taskbox
with taskbox.Client() as tb, tb.sandbox(workspace=".") as sb:
    r = sb.exec("echo made > made.txt; python3 -c 'print(6 * 7)'")
    read = sb.read("made.txt").content
    diff = sb.diff()
    sid = sb.id
with taskbox.Client() as tb:
    left = [s.id for s in tb.sandboxes()]
print(json.dumps({
    "exit_code": r.exit_code, "stdout": r.stdout.text, "read": read,
    "files": [f.path for f in diff.files], "diff": diff.diff, "sid": sid, "left": left,
    "taskbox": str(taskbox.find_binary()), "init": str(taskbox.find_binary("taskbox-init")),
    "inspect": [ep.value for ep in importlib.metadata.entry_points(group="inspect_ai") if ep.name == "taskbox"],
}))
"""


def wheel() -> Path:
    if w := os.environ.get("TASKBOX_WHEEL"):
        return Path(w)
    d = Path(os.environ.get("TASKBOX_WHEEL_DIR") or target_dir() / "wheels")
    found = sorted(d.glob("taskbox-*.whl"), key=lambda p: p.stat().st_mtime)
    require(bool(found), f"no taskbox wheel in {d} (build one with scripts/wheel.sh)")
    return found[-1]


def test_a_fresh_venv_installs_the_wheel_and_runs_a_sandbox(tmp_path: Path) -> None:
    whl = wheel()
    built = bin_dir() / "taskbox"
    require(not built.exists() or whl.stat().st_mtime >= built.stat().st_mtime - 1,
            f"the wheel {whl} is older than {built}: build it again with scripts/wheel.sh")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(whl)],
        capture_output=True, text=True, timeout=600,
    )
    assert pip.returncode == 0, pip.stderr
    for name in ("taskbox", "taskbox-init"):
        assert os.access(venv / "bin" / name, os.X_OK), f"the wheel did not put {name} on the venv's PATH"

    # Another `taskbox` earlier on PATH must not be the one used: the wheel's own comes first.
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "taskbox").write_text("#!/bin/sh\necho 'the decoy taskbox ran' >&2\nexit 99\n")
    (decoy / "taskbox").chmod(0o755)
    ws = make_workspace(tmp_path / "ws")
    state = tmp_path / "state"
    home = tmp_path / "home"
    home.mkdir()
    # Only the state directory is set, to keep the test's supervisor off the machine's default.
    env = {"PATH": f"{decoy}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "TASKBOX_STATE_DIR": str(state)}
    try:
        run = subprocess.run([str(venv / "bin/python"), "-c", SCRIPT], cwd=ws, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert (out["exit_code"], out["stdout"], out["read"]) == (0, "42\n", "made\n")
        assert out["files"] == ["made.txt"] and "+made" in out["diff"]
        assert out["left"] == [], "the sandbox was destroyed"
        assert Path(out["taskbox"]) == (venv / "bin/taskbox").resolve()
        assert Path(out["init"]) == (venv / "bin/taskbox-init").resolve()
        assert out["inspect"] == ["taskbox.inspect"], "sandbox=\"taskbox\" is registered for inspect-ai"
        assert "started one in the background" in run.stderr and "decoy" not in run.stderr
        pid = serve_pid(state / "taskbox.sock")
        assert Path(os.readlink(f"/proc/{pid}/exe")) == (venv / "bin/taskbox").resolve()
        assert not (ws / "made.txt").exists(), "the host workspace is untouched"
    finally:
        sock = state / "taskbox.sock"
        if sock.exists():
            stop_pid(serve_pid(sock))
