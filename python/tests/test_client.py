"""The synchronous client against a real supervisor: the whole life of a sandbox."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import SecretStr

import taskbox
from taskbox import models as m


def test_create_exec_read_write_diff_destroy(client: taskbox.Client, workspace: Path) -> None:
    sb = client.create(workspace, labels={"purpose": "sdk-test"})
    assert sb.info.state == "running" and sb.info.labels["purpose"] == "sdk-test"
    assert sb.info.workspace == str(workspace.resolve())
    assert any(s.id == sb.id for s in client.sandboxes())

    r = sb.exec("echo out; echo err >&2; echo new > made.txt; exit 3")
    assert isinstance(r, m.ExecResult)
    assert (r.exit_code, r.stdout.text, r.stderr.text) == (3, "out\n", "err\n")
    assert r.exit_status == 3 and not r.ok
    assert [(c.path, c.kind) for c in r.changes] == [("made.txt", "added")]

    argv = sb.exec(["printf", "%s|", "a b", "c"], cwd="src", env={"X": "1"})
    assert argv.ok and argv.stdout.text == "a b|c|"
    assert sb.exec(["sh", "-c", 'echo "$X:$(pwd)"'], cwd="src", env={"X": "yes"}).stdout.text == f"yes:{workspace.resolve()}/src\n"
    assert sb.exec("cat", stdin="piped\n").stdout.text == "piped\n"

    fixed = "def add(a, b):\n    return a + b\n"
    w = sb.write("src/calc.py", fixed)
    assert w.bytes_written == len(fixed) and not w.created
    assert sb.read("src/calc.py").content.endswith("a + b\n")
    assert sb.read_text("src/calc.py") == "def add(a, b):\n    return a + b\n"
    blob = bytes(range(256)) * 3
    sb.write("data/blob.bin", blob, create_parents=True)
    got = sb.read("data/blob.bin")
    assert got.binary and got.encoding == "base64" and got.total_bytes == len(blob)
    assert sb.read_bytes("data/blob.bin") == blob
    assert sb.exec("od -An -tx1 -N4 data/blob.bin").stdout.text.split() == ["00", "01", "02", "03"]

    d = sb.diff()
    assert {f.path: f.status for f in d.files} == {"data/blob.bin": "added", "made.txt": "added", "src/calc.py": "modified"}
    assert "-    return a - b\n+    return a + b\n" in d.diff and d.stats.files == 3
    # The host workspace is untouched.
    assert (workspace / "src/calc.py").read_text().endswith("a - b\n") and not (workspace / "made.txt").exists()

    sb.destroy()
    assert all(s.id != sb.id for s in client.sandboxes())
    with pytest.raises(taskbox.NotFoundError):
        sb.refresh()
    sb.destroy(missing_ok=True)


def test_the_context_manager_destroys_the_sandbox_even_on_an_error(client: taskbox.Client, workspace: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with client.sandbox(workspace=workspace) as sb:
            sid = sb.id
            assert client.get(sid).id == sid
            raise RuntimeError("boom")
    with pytest.raises(taskbox.NotFoundError):
        client.get(sid)
    # A created sandbox is a context manager too.
    with client.create(workspace) as sb2:
        sid2 = sb2.id
    with pytest.raises(taskbox.NotFoundError):
        client.get(sid2)


def test_streaming_exec_yields_output_as_it_comes(sandbox: taskbox.Sandbox) -> None:
    script = "echo first; sleep 1; echo second >&2; sleep 1; echo third"
    seen: list[tuple[str, str, float]] = []
    start = time.monotonic()
    events: list[m.AnyEvent] = []
    for ev in sandbox.exec_stream(script):
        events.append(ev)
        if isinstance(ev, (m.StdoutEvent, m.StderrEvent)):
            seen.append((ev.type, ev.data, time.monotonic() - start))
    assert isinstance(events[0], m.StartedEvent)
    ended = events[-1]
    assert isinstance(ended, m.EndedEvent) and ended.result.exit_code == 0
    assert [(k, d) for k, d, _ in seen] == [("stdout", "first\n"), ("stderr", "second\n"), ("stdout", "third\n")]
    # "first" came before the command ended: the stream is live, not a replay at the end.
    assert seen[0][2] < seen[-1][2] - 1.0
    assert ended.result.stdout.text == "first\nthird\n"


def test_leaving_a_stream_early_closes_it_and_the_sandbox_stays_usable(sandbox: taskbox.Sandbox) -> None:
    for ev in sandbox.exec_stream("echo go; sleep 1; echo late > late.txt"):
        if isinstance(ev, m.StdoutEvent):
            break
    assert sandbox.exec("echo still here").stdout.text == "still here\n"


def test_a_stream_that_cannot_start_raises_the_api_error(sandbox: taskbox.Sandbox) -> None:
    with pytest.raises(taskbox.InvalidArgumentError, match="argv is empty"):
        list(sandbox.exec_stream([]))


def test_background_processes_start_wait_stdin_kill(sandbox: taskbox.Sandbox) -> None:
    p = sandbox.start("read line; echo got:$line; sleep 0.2; exit 7")
    assert isinstance(p, taskbox.Process) and p.info.running and p.exec_id >= 1
    assert p.wait(timeout=0.3).running, "it waits for its stdin"
    p.write("hello\n")
    info = p.wait(timeout=30)
    assert not info.running and info.result is not None
    assert (info.result.exit_code, info.result.stdout.text) == (7, "got:hello\n")
    assert sandbox.process(p.exec_id).result == info.result

    sleeper = sandbox.start(["sleep", "300"])
    assert sleeper.poll().running
    killed = sleeper.kill()
    final = sleeper.wait(timeout=30)
    assert not final.running and final.result is not None and final.result.signal == 9, killed

    cat = sandbox.start("cat > copied.txt")
    cat.write("one\n")
    cat.write(b"two\n", close=True)
    assert cat.wait(timeout=30).result.exit_code == 0  # type: ignore[union-attr]
    assert sandbox.read_text("copied.txt") == "one\ntwo\n"
    closer = sandbox.start("wc -c")
    closer.close_stdin()
    assert closer.wait(timeout=30).result.stdout.text.strip() == "0"  # type: ignore[union-attr]


def test_every_file_operation(sandbox: taskbox.Sandbox) -> None:
    e = sandbox.edit("src/calc.py", "a - b", "a + b")
    assert e.replacements == 1 and "+    return a + b" in e.diff
    p = sandbox.patch(
        "--- a/README.md\n+++ b/README.md\n@@ -1 +1,2 @@\n # demo\n+patched\n"
    )
    assert [(c.path, c.kind) for c in p.files] == [("README.md", "modified")]
    assert sandbox.read_text("README.md") == "# demo\npatched\n"

    listed = sandbox.list()
    assert {(x.path, x.kind) for x in listed.entries} >= {("README.md", "file"), ("src", "dir"), ("tests", "dir")}
    deep = sandbox.list(glob="**/*.py")
    assert sorted(x.path for x in deep.entries) == ["src/calc.py", "tests/test_calc.py"]

    found = sandbox.search("def \\w+", glob="**/*.py")
    assert {(x.path, x.line_number) for x in found.matches} == {("src/calc.py", 1), ("tests/test_calc.py", 4)}
    assert sandbox.search("DEMO", case_insensitive=True).matches[0].path == "README.md"

    st = sandbox.stat("src/calc.py")
    assert st.kind == "file" and st.size == len(sandbox.read_bytes("src/calc.py")) and st.mode & 0o777 == 0o644
    assert sandbox.exists("src") and not sandbox.exists("nope")

    sandbox.write("tool.sh", "#!/bin/sh\necho tool\n", mode=0o755)
    assert sandbox.exec("./tool.sh").stdout.text == "tool\n"

    assert sandbox.exec("mkdir bin").ok
    sandbox.move("tool.sh", "bin/tool.sh")
    assert sandbox.exists("bin/tool.sh") and not sandbox.exists("tool.sh")
    sandbox.write("other.txt", "x")
    with pytest.raises(taskbox.TaskboxError):
        sandbox.move("other.txt", "README.md")
    sandbox.move("other.txt", "README.md", overwrite=True)
    assert sandbox.read_text("README.md") == "x"
    sandbox.remove("README.md")
    sandbox.remove("bin", recursive=True)
    assert not sandbox.exists("README.md") and not sandbox.exists("bin")

    part = sandbox.read("tests/test_calc.py", line_start=4, line_end=5)
    assert part.content == "def test_add():\n    assert add(2, 3) == 5\n" and part.total_lines == 5
    assert sandbox.read("tests/test_calc.py", offset=5, length=4).content == "calc"
    cut = sandbox.read("tests/test_calc.py", max_bytes=4)
    assert cut.truncated and cut.content == "from"


def test_checkpoint_restore_export(sandbox: taskbox.Sandbox, workspace: Path) -> None:
    sandbox.edit("src/calc.py", "a - b", "a + b")
    cp = sandbox.checkpoint("fixed")
    assert cp.name == "fixed" and cp.files == 1 and "fixed" in sandbox.refresh().checkpoints
    sandbox.write("junk.txt", "junk")
    assert {f.path for f in sandbox.diff(since="fixed").files} == {"junk.txt"}
    sandbox.restore("fixed")
    assert not sandbox.exists("junk.txt") and sandbox.diff(since="fixed").files == []

    ex = sandbox.export()
    assert ex.format == "patch" and not ex.applied and ex.patch and "+    return a + b" in ex.patch
    assert [(c.path, c.kind) for c in ex.changes] == [("src/calc.py", "modified")]
    tar = sandbox.export("tar")
    assert tar.format == "tar" and tar.tar_path
    applied = sandbox.export(apply=True)
    assert applied.applied and (workspace / "src/calc.py").read_text().endswith("a + b\n")


def test_fork_now_and_from_a_checkpoint(sandbox: taskbox.Sandbox) -> None:
    sandbox.edit("src/calc.py", "a - b", "a + b")
    sandbox.checkpoint("fixed")
    sandbox.exec("echo later > later.txt; echo scratch > /tmp/scratch")
    forks = sandbox.fork(2, ttl_secs=600, labels={"attempt": "x"})
    try:
        assert len(forks) == 2 and all(isinstance(f, taskbox.Sandbox) for f in forks)
        for f in forks:
            assert f.info.forked_from is not None and f.info.forked_from.parent == sandbox.id
            assert f.info.forked_from.checkpoint is None and f.info.labels["attempt"] == "x"
            assert f.read_text("later.txt") == "later\n" and f.exec("cat /tmp/scratch").stdout.text == "scratch\n"
        forks[0].write("only-here.txt", "x")
        assert not forks[1].exists("only-here.txt") and not sandbox.exists("only-here.txt")
        (old,) = sandbox.fork(checkpoint="fixed")
        forks.append(old)
        assert old.info.forked_from is not None and old.info.forked_from.checkpoint == "fixed"
        assert not old.exists("later.txt") and old.read_text("src/calc.py").endswith("a + b\n")
        with pytest.raises(taskbox.InvalidArgumentError):
            sandbox.fork(0)
        with pytest.raises(taskbox.NotFoundError):
            sandbox.fork(checkpoint="no-such")
    finally:
        for f in forks:
            f.destroy(missing_ok=True)


def test_renew_and_limits(sandbox: taskbox.Sandbox) -> None:
    before = sandbox.info.expires_at_ms
    info = sandbox.renew(7200)
    assert info.expires_at_ms is not None and before is not None and info.expires_at_ms > before
    r = sandbox.exec("sleep 5", timeout=0.5)
    assert r.timed_out and r.exit_status == 124 and any(v.kind == "timeout" for v in r.violations)
    big = sandbox.exec("yes | head -c 100000", output_limit=1000)
    assert big.stdout.truncated and big.stdout.bytes == 100000 and big.stdout.spill_path
    assert sandbox.approvals() == [] and sandbox.client.approvals() == []


def test_uploaded_workspace(client: taskbox.Client, workspace: Path) -> None:
    up = client.upload_workspace(workspace)
    assert up.sha256 and up.entries >= 5
    assert any(w.id == up.id for w in client.workspaces())
    with client.sandbox(workspace_id=up.id) as sb:
        assert sb.read_text("src/calc.py").startswith("def add")
        assert sb.exec("cat README.md").stdout.text == "# demo\n"
    client.delete_workspace(up.id)
    assert all(w.id != up.id for w in client.workspaces())


def test_health_metrics_openapi(client: taskbox.Client) -> None:
    h = client.health()
    assert h.status == "ok" and h.version
    assert "taskbox_" in client.metrics()
    assert client.openapi()["openapi"].startswith("3.")


def test_binary_and_large_stdin_and_merged_output(sandbox: taskbox.Sandbox) -> None:
    raw = b"\xc3\x28\x00\xff\x01bytes"
    assert sandbox.exec("cat > got.bin", stdin=raw).ok
    assert sandbox.read_bytes("got.bin") == raw
    # Larger than a request body may be: streamed to the command (bytes and text alike).
    big = bytes(range(256)) * (24 << 12)  # 24 MiB
    r = sandbox.exec(["sh", "-c", "wc -c; echo done >&2"], stdin=big)
    assert (r.exit_code, r.stdout.text.strip(), r.stderr.text) == (0, str(len(big)), "done\n")
    assert sandbox.exec(["wc", "-c"], stdin="a" * (5 << 20)).stdout.text.strip() == str(5 << 20)
    # A command that reads none of it still answers.
    assert sandbox.exec("exit 3", stdin=big).exit_code == 3
    m_ = sandbox.exec("echo 1; echo 2 >&2; echo 3", merge_output=True)
    assert (m_.stdout.text, m_.stderr.text) == ("1\n2\n3\n", "")
    streamed = [e.data for e in sandbox.exec_stream("echo a; echo b >&2", merge_output=True) if isinstance(e, m.StdoutEvent)]
    assert "".join(streamed) == "a\nb\n"
    # A background process reads bytes of any size from its stdin, streamed.
    p = sandbox.start("sha256sum | cut -c1-64")
    p.write(big[: 7 << 20])
    p.write(big[7 << 20 :], close=True)
    import hashlib

    assert p.wait(timeout=60).result.stdout.text.strip() == hashlib.sha256(big).hexdigest()  # type: ignore[union-attr]


def test_a_failing_test_run_has_its_findings(sandbox: taskbox.Sandbox) -> None:
    # The workspace's src/calc.py subtracts: its one test fails. pytest under the system
    # interpreter (the one a host-view sandbox sees), without its cache (no stray changes).
    r = sandbox.exec("PYTHONPATH=src /usr/bin/python3 -m pytest -q -p no:cacheprovider tests", timeout=120)
    assert r.exit_code == 1, r.stdout.text + r.stderr.text
    assert r.tests == m.TestCounts(passed=0, failed=1, errored=0, skipped=0)
    assert len(r.findings) == 1, r.findings
    f = r.findings[0]
    assert isinstance(f, m.Finding)
    assert (f.kind, f.tool, f.name) == ("test_failed", "pytest", "tests/test_calc.py::test_add")
    assert f.location == m.Location(file="tests/test_calc.py", line=5)
    assert "assert -1 == 5" in f.message
    # A passing run has none.
    sandbox.write("src/calc.py", "def add(a, b):\n    return a + b\n")
    ok = sandbox.exec("PYTHONPATH=src /usr/bin/python3 -m pytest -q -p no:cacheprovider tests", timeout=120)
    assert ok.ok and ok.findings == [] and ok.tests == m.TestCounts(passed=1, failed=0, errored=0, skipped=0)


SECRET_POLICY = """
[network]
mode = "proxy"
allow = ["api.test"]

[secrets.gh]
from_api = true
hosts = ["api.test"]
header = "Authorization"
placeholder_env = "GH_TOKEN"
"""


def test_secrets_are_given_at_create_and_rotated_and_revoked_by_name(client: taskbox.Client, workspace: Path) -> None:
    value = "sdk-hunter2-value"
    req = m.CreateRequest(workspace="/w", secrets={"gh": SecretStr(value)})
    assert value not in repr(req)
    with client.sandbox(workspace, policy_toml=SECRET_POLICY, secrets={"gh": value}) as sb:
        # The sandbox has a placeholder, never the value.
        env = sb.exec('printf %s "$GH_TOKEN"').stdout.text
        assert env.startswith("taskbox-placeholder-gh-") and value not in env
        st = sb.rotate_secret("gh", "sdk-rotated-value")
        assert (st.name, st.state, st.rotations, st.placeholder_env) == ("gh", "active", 1, "GH_TOKEN")
        assert "sdk-rotated-value" not in st.model_dump_json()
        assert sb.revoke_secret("gh").state == "revoked"
        with pytest.raises(taskbox.NotFoundError):
            sb.revoke_secret("nope")
    with pytest.raises(taskbox.InvalidArgumentError, match="secrets.gh: comes from the API"):
        client.create(workspace, policy_toml=SECRET_POLICY)
