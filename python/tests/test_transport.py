"""The SDK's own HTTP/1.1 transport (`taskbox._transport`) against a real supervisor: one kept
connection, one write per request, a kept connection the supervisor closed, concurrent
requests of one client, and what a request costs the client."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import Supervisor, make_workspace

import taskbox
from taskbox import _transport


class Recorder:
    """A Unix socket in front of the supervisor's that relays both ways and records the size
    of each write the client makes and how many connections it opens."""

    def __init__(self, upstream: Path, path: Path) -> None:
        self.upstream, self.path = upstream, path
        self.writes: list[int] = []
        self.connections = 0
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(path))
        self.srv.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            up = socket.socket(socket.AF_UNIX)
            up.connect(str(self.upstream))
            threading.Thread(target=self._pump, args=(c, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if record:
                    self.writes.append(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.srv.close()


def test_one_kept_connection_and_one_write_per_request(supervisor: Supervisor, tmp_path: Path) -> None:
    assert supervisor.socket is not None
    rec = Recorder(supervisor.socket, tmp_path / "relay.sock")
    try:
        with taskbox.Client(socket=rec.path, start_supervisor=False) as c:
            with c.sandbox(workspace=make_workspace(tmp_path / "ws")) as sb:
                for _ in range(3):
                    time.sleep(0.05)  # let the relay's reads see each request whole
                    rec.writes.clear()
                    assert sb.exec(["true"]).ok
                    time.sleep(0.05)
                    # httpx sent the head and the JSON body in two writes, so the supervisor
                    # read twice per request.
                    assert len(rec.writes) == 1, rec.writes
                # Every request of the client so far went over one connection.
                assert rec.connections == 1
    finally:
        rec.close()


def test_a_restarted_supervisor_is_reached_again(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    sup = Supervisor(tmp_path / "a")
    try:
        c = sup.client()
        assert c.health().status == "ok"
        sup.stop()
        sup = Supervisor(tmp_path / "a")  # the same socket path, a new process
        # The kept connection was closed by the old supervisor: the next call opens another.
        assert c.health().status == "ok"
        c.close()

        async def go() -> None:
            async with sup.async_client() as ac:
                assert (await ac.health()).status == "ok"
        asyncio.run(go())
    finally:
        sup.stop()


def test_concurrent_requests_of_one_client(sandbox: taskbox.Sandbox) -> None:
    errors: list[BaseException] = []
    outs: list[str] = []

    def run(i: int) -> None:
        try:
            outs.append(sandbox.exec(["sh", "-c", f"sleep 0.2; echo {i}"]).stdout.text)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(outs) == [f"{i}\n" for i in range(4)]
    # They ran at once, each on a connection of its own (one after another would take 0.8 s).
    assert time.monotonic() - t0 < 0.75


def test_a_request_costs_the_client_little_cpu(supervisor: Supervisor) -> None:
    """The client's CPU per request: httpx took about 0.5 ms per `GET /healthz` on the
    benchmark machine (docs/decisions.md), this transport about 0.03 ms."""
    with supervisor.client() as c:
        for _ in range(50):
            c.health()
        n = 500
        t0 = time.process_time()
        for _ in range(n):
            c.health()
        per_request = (time.process_time() - t0) / n
    assert per_request < 250e-6, f"{per_request * 1e6:.0f} µs of client CPU per request"


def test_timeouts_and_bodies() -> None:
    assert _transport.timeout_of(None) == _transport.Timeout(None, None)
    assert _transport.timeout_of(2) == _transport.Timeout(2.0, 2.0)
    assert _transport.timeout_of(taskbox.Timeout(connect=1.0, read=None)) == _transport.Timeout(1.0, None)
    with pytest.raises(TypeError, match="timeout"):
        _transport.timeout_of("soon")
    with pytest.raises(TypeError, match="request body"):
        _transport.encode_body(None, 12)
    # A head names its body's length; pieces of unknown length go chunked.
    head = _transport.encode_head("POST", "/x", {"a": "b c"}, {"Host": "h"}, 3)
    assert head == b"POST /x?a=b+c HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\n"
    body, _, length = _transport.encode_body(None, iter([b"ab", b"c"]))
    assert length == _transport.CHUNKED and isinstance(body, _transport.Chunked)


def test_server_sent_events_framing() -> None:
    p = _transport.SseParser()
    got = p.feed(b": keep-alive\n\nevent: stdout\ndata: a\ndata: b\r\n\r\nevent: ended\nda")
    assert got == [("stdout", "a\nb")]
    assert p.feed(b"ta: {}\n\n") == [("ended", "{}")]


def test_the_exec_body_built_straight_is_the_models_own() -> None:
    """`exec_body` (the SDK's exec path) sends what the ExecRequest model would, for every
    shape of arguments, and leaves what the model must check to the model."""
    from taskbox import _calls as calls

    cases = [
        (["true"], {}),
        ("echo hi", {}),
        (["a", b"b"], {"cwd": "/tmp", "env": {"A": "1"}, "timeout": 1.5}),
        (["cat"], {"stdin": "text", "merge_output": True}),
        (["cat"], {"stdin": b"\x00\xff", "output_limit": 10, "user": "1000"}),
        (["x"], {"env": {}, "timeout": 0.0001}),
        (["x"], {"background": True}),
    ]
    for command, kw in cases:
        args = {"cwd": None, "env": None, "stdin": None, "timeout": None, "output_limit": None,
                "merge_output": False, "background": False, **kw}
        assert calls.exec_body(command, **args) == calls.exec_request(command, **args).body(), (command, kw)
    # What the model refuses is still refused (a cwd that is not text), by the model.
    bad = {"cwd": 42, "env": None, "stdin": None, "timeout": None, "output_limit": None,
           "merge_output": False, "background": False}
    with pytest.raises(ValueError):
        calls.exec_body(["true"], **bad)
    with pytest.raises(TypeError):
        calls.exec_body(b"true", **{**bad, "cwd": None})
