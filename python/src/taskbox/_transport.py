"""The SDK's HTTP/1.1 client: persistent connections to the supervisor over its Unix socket or
TCP (TLS for `https://`), one for each request in flight, reused while they last.

Why not httpx (docs/decisions.md): on the machines measured, httpx spent about 0.5 ms of CPU
per request (URL and header models, its connection pool, h11's state machine), a third of an
`exec true` round trip, and it sends a request's head and body in two writes. The API needs
little of HTTP: requests with a length or no body, answers framed by `Content-Length` or chunks,
and Server-Sent Events for streamed execs. Here each request is one write and its answer a few
buffered reads, about 30 µs of Python.

The encoding and parsing are shared; [`Pool`] is the blocking side, [`AsyncPool`] the asyncio
one.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlencode, urlsplit

__all__ = ["Timeout", "TransportError", "Response", "Pool", "AsyncPool", "timeout_of"]

#: Bodies up to this size go in the same write as the request's head.
_JOIN_BODY = 64 << 10
#: Chunk size when a file-like body is sent.
_CHUNK = 1 << 20
#: Idle connections kept per client.
_KEEP_IDLE = 8
#: How long an idle Unix-socket connection is reused without first checking that the server
#: kept it (far below the supervisor's idle timeout, 60 s by default).
_FRESH = 1.0
#: `asyncio.timeout` where there is one (3.11).
_ASYNC_TIMEOUT = getattr(asyncio, "timeout", None)
#: Longest head line and most header lines an answer may have.
_MAX_LINE = 64 << 10
_MAX_HEADERS = 100


class TransportError(Exception):
    """The supervisor could not be reached, or its answer was not HTTP this client reads."""


@dataclass(frozen=True)
class Timeout:
    """Seconds to connect and to wait for each read of an answer (None: no limit)."""

    connect: float | None = 10.0
    read: float | None = None


def timeout_of(t: Any) -> Timeout:
    """A client's `timeout` argument as a [`Timeout`]: a number bounds both, None neither, and an
    object with `connect` and `read` attributes (a `Timeout`, an `httpx.Timeout`) gives each."""
    if t is None:
        return Timeout(None, None)
    if isinstance(t, (int, float)):
        return Timeout(float(t), float(t))
    if hasattr(t, "connect") and hasattr(t, "read"):
        return Timeout(t.connect, t.read)
    raise TypeError(f"timeout must be a number, None or a Timeout, not {type(t).__name__}")


class Response:
    """An answer: status, headers (names in lower case) and the whole body."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes = b"") -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: a Unix socket path, or a host and port (with TLS for https)."""

    unix: str | None
    host: str
    port: int
    tls: bool
    #: The Host header.
    authority: str

    @staticmethod
    def of(base_url: str, unix: str | None) -> Endpoint:
        if unix is not None:
            return Endpoint(unix, "taskbox", 0, False, "taskbox")
        u = urlsplit(base_url)
        tls = u.scheme == "https"
        host = u.hostname or "localhost"
        port = u.port or (443 if tls else 80)
        return Endpoint(None, host, port, tls, u.netloc or host)

    def describe(self) -> str:
        return f"unix socket {self.unix}" if self.unix else f"{self.host}:{self.port}"


def encode_head(
    method: str,
    path: str,
    params: dict[str, Any] | None,
    headers: dict[str, str],
    length: int | None,
) -> bytes:
    """A request's head; `length` None: no body."""
    target = path + ("?" + urlencode({k: str(v) for k, v in params.items()}) if params else "")
    lines = [f"{method} {target} HTTP/1.1"]
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    if length == CHUNKED:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")


#: The length of a body sent in chunks.
CHUNKED = -1


class Chunked:
    """A body of pieces (an iterable, or an async iterable for the asyncio side)."""

    def __init__(self, pieces: Any) -> None:
        self.pieces = pieces


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


#: The request bodies' encoder, made once (`json.dumps` with options makes one per call).
_JSON = jsonlib.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_body(json: Any, content: Any) -> tuple[Any, str | None, int | None]:
    """A request's body, its content type and its length (None: no body)."""
    if json is not None:
        data = _JSON.encode(json).encode()
        return data, "application/json", len(data)
    if content is None:
        return None, None, None
    if isinstance(content, (bytes, bytearray, memoryview)):
        data = bytes(content)
        return data, None, len(data)
    if isinstance(content, str):
        data = content.encode("utf-8")
        return data, None, len(data)
    # A file-like object: its length from where it stands to its end.
    try:
        here = content.tell()
        end = content.seek(0, os.SEEK_END)
        content.seek(here)
        return content, None, end - here
    except (AttributeError, OSError, ValueError):
        if hasattr(content, "read"):
            data = content.read()
            return data, None, len(data)
        if hasattr(content, "__iter__") or hasattr(content, "__aiter__"):
            # Pieces of unknown total length: sent chunked.
            return Chunked(content), None, CHUNKED
        raise TypeError(
            f"a request body must be bytes, str, a binary file or an iterable of bytes, not {type(content).__name__}"
        ) from None


class Head:
    """An answer's status line and headers, and how its body is framed."""

    __slots__ = ("status", "headers", "length", "chunked", "close")

    def __init__(self, status: int, headers: dict[str, str], method: str) -> None:
        self.status = status
        self.headers = headers
        self.close = headers.get("connection", "").lower() == "close"
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.length: int | None
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            self.length = 0
        elif self.chunked:
            self.length = None
        elif "content-length" in headers:
            try:
                self.length = int(headers["content-length"])
            except ValueError:
                raise TransportError(f"bad Content-Length {headers['content-length']!r}") from None
        else:
            # Until the connection closes.
            self.length = None
            self.close = True


def parse_status(line: bytes) -> int:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise TransportError(f"not an HTTP/1 answer: {line[:80]!r}")
    try:
        return int(parts[1])
    except ValueError:
        raise TransportError(f"bad status line {line[:80]!r}") from None


def parse_header(line: bytes, headers: dict[str, str]) -> None:
    name, sep, value = line.partition(b":")
    if not sep:
        raise TransportError(f"bad header line {line[:80]!r}")
    key = name.strip().decode("latin-1").lower()
    v = value.strip().decode("latin-1")
    headers[key] = f"{headers[key]}, {v}" if key in headers else v


def chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise TransportError(f"bad chunk size line {line[:80]!r}") from None


class SseParser:
    """Server-Sent Events from lines of a stream: (event, data) once each event is complete."""

    def __init__(self) -> None:
        self.buf = b""
        self.event = ""
        self.data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        self.buf += chunk
        out = []
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                break
            line = self.buf[:i].rstrip(b"\r").decode("utf-8", "replace")
            self.buf = self.buf[i + 1:]
            if not line:
                if self.data or self.event:
                    out.append((self.event or "message", "\n".join(self.data)))
                self.event, self.data = "", []
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                self.event = value
            elif field == "data":
                self.data.append(value)
        return out


def _header_dict(base: dict[str, str], extra: dict[str, str] | None, ctype: str | None) -> dict[str, str]:
    h = dict(base)
    if ctype is not None and not (extra and any(k.lower() == "content-type" for k in extra)):
        h["Content-Type"] = ctype
    if extra:
        h.update(extra)
    return h


# ---- blocking --------------------------------------------------------------------------------


class _Conn:
    """One connection and its buffered reader."""

    def __init__(self, ep: Endpoint, timeout: Timeout) -> None:
        try:
            if ep.unix is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(timeout.connect)
                    sock.connect(ep.unix)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((ep.host, ep.port), timeout=timeout.connect)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if ep.tls:
                    ctx = ssl.create_default_context()
                    sock = ctx.wrap_socket(sock, server_hostname=ep.host)
            sock.settimeout(timeout.read)
        except OSError as e:
            raise TransportError(str(e) or type(e).__name__) from e
        self.sock = sock
        self.rfile = sock.makefile("rb", buffering=65536)
        self.used = False
        self.unix = ep.unix is not None
        #: When it was last handed back idle (`time.monotonic()`).
        self.idle_since = 0.0

    def stale(self) -> bool:
        """A reused connection the server has closed (or sent something unasked on)."""
        if self.unix and time.monotonic() - self.idle_since < _FRESH:
            # Idle far less than any server's idle timeout, and a send on a Unix socket whose
            # peer closed fails at once (and is retried): no select on the way of every call.
            return False
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(r)

    def close(self) -> None:
        try:
            self.rfile.close()
        finally:
            self.sock.close()

    def send(self, head: bytes, body: Any) -> None:
        if body is None:
            self.sock.sendall(head)
        elif isinstance(body, bytes):
            if len(body) <= _JOIN_BODY:
                self.sock.sendall(head + body)
            else:
                self.sock.sendall(head)
                self.sock.sendall(body)
        elif isinstance(body, Chunked):
            self.sock.sendall(head)
            for piece in body.pieces:
                if piece:
                    self.sock.sendall(chunk(bytes(piece)))
            self.sock.sendall(b"0\r\n\r\n")
        else:
            self.sock.sendall(head)
            while data := body.read(_CHUNK):
                self.sock.sendall(data)

    def line(self) -> bytes:
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line:
            raise EOFError
        if len(line) > _MAX_LINE:
            raise TransportError("an answer's line is too long")
        return line.rstrip(b"\r\n")

    def head(self, method: str) -> Head:
        while True:
            status = parse_status(self.line())
            headers: dict[str, str] = {}
            while line := self.line():
                if len(headers) >= _MAX_HEADERS:
                    raise TransportError("an answer has too many headers")
                parse_header(line, headers)
            if 100 <= status < 200 and status != 101:
                continue
            return Head(status, headers, method)

    def early_answer(self, method: str) -> Head | None:
        """An answer already sent when sending the request failed, if one is there."""
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
            if not r:
                return None
            head = self.head(method)
        except (OSError, EOFError, TransportError, ValueError):
            return None
        head.close = True
        return head

    def exactly(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) < n:
            raise TransportError(f"the supervisor closed the connection {n - len(data)} bytes before the answer's end")
        return data

    def chunks(self, head: Head) -> Iterator[bytes]:
        """The body as it arrives."""
        if head.chunked:
            while True:
                n = chunk_size(self.line())
                if n == 0:
                    while self.line():
                        pass
                    return
                data = self.exactly(n)
                self.line()
                yield data
        elif head.length is not None:
            left = head.length
            while left > 0:
                data = self.rfile.read1(min(left, _CHUNK))
                if not data:
                    raise TransportError("the supervisor closed the connection before the answer's end")
                left -= len(data)
                yield data
        else:
            while data := self.rfile.read1(_CHUNK):
                yield data

    def body(self, head: Head) -> bytes:
        if head.length is not None and not head.chunked:
            return self.exactly(head.length) if head.length else b""
        return b"".join(self.chunks(head))


class Pool:
    """Blocking requests to one endpoint, each on an idle connection or a new one."""

    def __init__(self, base_url: str, unix: str | None, headers: dict[str, str], timeout: Any) -> None:
        self.endpoint = Endpoint.of(base_url, unix)
        self.base_headers = {"Host": self.endpoint.authority, **headers}
        self.timeout = timeout_of(timeout)
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()

    def _take(self) -> _Conn:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return _Conn(self.endpoint, self.timeout)
            if not conn.stale():
                return conn
            conn.close()

    def _give(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if len(self._idle) < _KEEP_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _start(self, method: str, path: str, params: dict[str, Any] | None, json: Any,
               content: Any, headers: dict[str, str] | None) -> tuple[_Conn, Head]:
        body, ctype, length = encode_body(json, content)
        if length is None and method in ("POST", "PUT", "PATCH"):
            length = 0
        head = encode_head(method, path, params, _header_dict(self.base_headers, headers, ctype), length)
        replayable = body is None or isinstance(body, bytes)
        for attempt in (0, 1):
            conn = self._take()
            reused, sent = conn.used, False
            conn.used = True
            try:
                try:
                    conn.send(head, body)
                except OSError:
                    # The server may have answered before it read the whole body (a 413) and
                    # closed its end: that answer is the request's.
                    early = conn.early_answer(method)
                    if early is None:
                        raise
                    return conn, early
                sent = True
                return conn, conn.head(method)
            except (OSError, EOFError, TransportError) as e:
                conn.close()
                # A kept connection the server closed meanwhile: nothing of this request was
                # taken (the send failed, or an idempotent request got no byte back). Once more
                # on a new connection.
                retry = (
                    attempt == 0 and reused and replayable
                    and isinstance(e, (OSError, EOFError)) and not isinstance(e, TimeoutError)
                    and (not sent or (isinstance(e, EOFError) and method in ("GET", "HEAD", "DELETE")))
                )
                if retry:
                    continue
                raise _transport_error(e) from e
        raise TransportError("unreachable")

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
                content: Any = None, headers: dict[str, str] | None = None) -> Response:
        conn, head = self._start(method, path, params, json, content, headers)
        try:
            data = conn.body(head)
        except (OSError, EOFError, TransportError) as e:
            conn.close()
            raise _transport_error(e) from e
        if head.close:
            conn.close()
        else:
            self._give(conn)
        return Response(head.status, head.headers, data)

    def stream(self, method: str, path: str, *, json: Any = None,
               headers: dict[str, str] | None = None) -> Stream:
        """A request whose answer is read as it comes; close the [`Stream`] when done."""
        conn, head = self._start(method, path, None, json, None, headers)
        return Stream(self, conn, head)


class Stream:
    """An answer being read: `response` (status and headers), then its body chunk by chunk. Its
    connection is kept for reuse only when the body was read to its end."""

    def __init__(self, pool: Pool, conn: _Conn, head: Head) -> None:
        self.pool, self.conn, self.head = pool, conn, head
        self.response = Response(head.status, head.headers)
        self._done = False
        self._closed = False

    def read(self) -> bytes:
        self.response.content = b"".join(self.iter_bytes())
        return self.response.content

    def iter_bytes(self) -> Iterator[bytes]:
        try:
            yield from self.conn.chunks(self.head)
            self._done = True
        except (OSError, EOFError, TransportError) as e:
            raise _transport_error(e) from e

    def iter_sse(self) -> Iterator[tuple[str, str]]:
        p = SseParser()
        for chunk in self.iter_bytes():
            yield from p.feed(chunk)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and not self.head.close:
            self.pool._give(self.conn)
        else:
            self.conn.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transport_error(e: BaseException) -> TransportError:
    if isinstance(e, TransportError):
        return e
    if isinstance(e, EOFError):
        return TransportError("the supervisor closed the connection without an answer")
    if isinstance(e, TimeoutError):
        return TransportError("timed out waiting for the supervisor")
    return TransportError(str(e) or type(e).__name__)


# ---- asyncio ---------------------------------------------------------------------------------


class _AConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: Timeout) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.used = False

    @staticmethod
    async def open(ep: Endpoint, timeout: Timeout) -> _AConn:
        try:
            if ep.unix is not None:
                fut = asyncio.open_unix_connection(ep.unix, limit=_MAX_LINE + 2)
            else:
                ctx = ssl.create_default_context() if ep.tls else None
                fut = asyncio.open_connection(ep.host, ep.port, ssl=ctx, limit=_MAX_LINE + 2)
            reader, writer = await asyncio.wait_for(fut, timeout.connect)
        except (OSError, asyncio.TimeoutError) as e:
            raise _transport_error(e) from e
        if ep.unix is None:
            s = writer.get_extra_info("socket")
            if s is not None:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _AConn(reader, writer, timeout)

    def stale(self) -> bool:
        return self.reader.at_eof() or self.writer.is_closing() or len(self.reader._buffer) > 0  # type: ignore[attr-defined]

    def close(self) -> None:
        self.writer.close()

    async def _timed(self, aw: Any) -> Any:
        if self.timeout.read is None:
            return await aw
        if _ASYNC_TIMEOUT is not None:
            # No task per read, as wait_for makes (Python 3.11 and later).
            async with _ASYNC_TIMEOUT(self.timeout.read):
                return await aw
        return await asyncio.wait_for(aw, self.timeout.read)

    async def send(self, head: bytes, body: Any) -> None:
        w = self.writer
        if body is None:
            w.write(head)
        elif isinstance(body, bytes):
            w.write(head + body if len(body) <= _JOIN_BODY else head)
            if len(body) > _JOIN_BODY:
                w.write(body)
        elif isinstance(body, Chunked):
            w.write(head)
            if hasattr(body.pieces, "__aiter__"):
                async for piece in body.pieces:
                    if piece:
                        w.write(chunk(bytes(piece)))
                        await w.drain()
            else:
                for piece in body.pieces:
                    if piece:
                        w.write(chunk(bytes(piece)))
                        await w.drain()
            w.write(b"0\r\n\r\n")
        else:
            w.write(head)
            while data := body.read(_CHUNK):
                w.write(data)
                await w.drain()
        await w.drain()

    async def line(self) -> bytes:
        try:
            line = await self._timed(self.reader.readuntil(b"\n"))
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise EOFError from None
            raise TransportError("the supervisor closed the connection mid-line") from None
        except asyncio.LimitOverrunError:
            raise TransportError("an answer's line is too long") from None
        return line.rstrip(b"\r\n")

    async def head(self, method: str) -> Head:
        while True:
            status = parse_status(await self.line())
            headers: dict[str, str] = {}
            while line := await self.line():
                if len(headers) >= _MAX_HEADERS:
                    raise TransportError("an answer has too many headers")
                parse_header(line, headers)
            if 100 <= status < 200 and status != 101:
                continue
            return Head(status, headers, method)

    async def early_answer(self, method: str) -> Head | None:
        """An answer already sent when sending the request failed, if one is there."""
        try:
            head = await asyncio.wait_for(self.head(method), 1.0)
        except (OSError, EOFError, TransportError, asyncio.TimeoutError):
            return None
        head.close = True
        return head

    async def exactly(self, n: int) -> bytes:
        try:
            return await self._timed(self.reader.readexactly(n))
        except asyncio.IncompleteReadError as e:
            raise TransportError(
                f"the supervisor closed the connection {n - len(e.partial)} bytes before the answer's end"
            ) from None

    async def chunks(self, head: Head) -> AsyncIterator[bytes]:
        if head.chunked:
            while True:
                n = chunk_size(await self.line())
                if n == 0:
                    while await self.line():
                        pass
                    return
                data = await self.exactly(n)
                await self.line()
                yield data
        elif head.length is not None:
            left = head.length
            while left > 0:
                data = await self._timed(self.reader.read(min(left, _CHUNK)))
                if not data:
                    raise TransportError("the supervisor closed the connection before the answer's end")
                left -= len(data)
                yield data
        else:
            while data := await self._timed(self.reader.read(_CHUNK)):
                yield data

    async def body(self, head: Head) -> bytes:
        if head.length is not None and not head.chunked:
            return await self.exactly(head.length) if head.length else b""
        return b"".join([c async for c in self.chunks(head)])


class AsyncPool:
    """The same as [`Pool`], for asyncio (one event loop)."""

    def __init__(self, base_url: str, unix: str | None, headers: dict[str, str], timeout: Any) -> None:
        self.endpoint = Endpoint.of(base_url, unix)
        self.base_headers = {"Host": self.endpoint.authority, **headers}
        self.timeout = timeout_of(timeout)
        self._idle: list[_AConn] = []

    async def _take(self) -> _AConn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn
            conn.close()
        return await _AConn.open(self.endpoint, self.timeout)

    def _give(self, conn: _AConn) -> None:
        if len(self._idle) < _KEEP_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
            try:
                await c.writer.wait_closed()
            except OSError:
                pass

    async def _start(self, method: str, path: str, params: dict[str, Any] | None, json: Any,
                     content: Any, headers: dict[str, str] | None) -> tuple[_AConn, Head]:
        body, ctype, length = encode_body(json, content)
        if length is None and method in ("POST", "PUT", "PATCH"):
            length = 0
        head = encode_head(method, path, params, _header_dict(self.base_headers, headers, ctype), length)
        replayable = body is None or isinstance(body, bytes)
        for attempt in (0, 1):
            conn = await self._take()
            reused, sent = conn.used, False
            conn.used = True
            try:
                try:
                    await conn.send(head, body)
                except OSError:
                    early = await conn.early_answer(method)
                    if early is None:
                        raise
                    return conn, early
                sent = True
                return conn, await conn.head(method)
            except (OSError, EOFError, TransportError, asyncio.TimeoutError) as e:
                conn.close()
                retry = (
                    attempt == 0 and reused and replayable
                    and isinstance(e, (OSError, EOFError)) and not isinstance(e, TimeoutError)
                    and (not sent or (isinstance(e, EOFError) and method in ("GET", "HEAD", "DELETE")))
                )
                if retry:
                    continue
                raise _transport_error(e) from e
            except BaseException:
                # Cancelled mid-request: the connection's state is unknown.
                conn.close()
                raise
        raise TransportError("unreachable")

    async def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                      json: Any = None, content: Any = None,
                      headers: dict[str, str] | None = None) -> Response:
        conn, head = await self._start(method, path, params, json, content, headers)
        try:
            data = await conn.body(head)
        except (OSError, EOFError, TransportError, asyncio.TimeoutError) as e:
            conn.close()
            raise _transport_error(e) from e
        except BaseException:
            conn.close()
            raise
        if head.close:
            conn.close()
        else:
            self._give(conn)
        return Response(head.status, head.headers, data)

    async def stream(self, method: str, path: str, *, json: Any = None,
                     headers: dict[str, str] | None = None) -> AsyncStream:
        conn, head = await self._start(method, path, None, json, None, headers)
        return AsyncStream(self, conn, head)


class AsyncStream:
    """[`Stream`] for asyncio."""

    def __init__(self, pool: AsyncPool, conn: _AConn, head: Head) -> None:
        self.pool, self.conn, self.head = pool, conn, head
        self.response = Response(head.status, head.headers)
        self._done = False
        self._closed = False

    async def read(self) -> bytes:
        self.response.content = b"".join([c async for c in self.iter_bytes()])
        return self.response.content

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for c in self.conn.chunks(self.head):
                yield c
            self._done = True
        except (OSError, EOFError, TransportError, asyncio.TimeoutError) as e:
            raise _transport_error(e) from e

    async def iter_sse(self) -> AsyncIterator[tuple[str, str]]:
        p = SseParser()
        async for chunk in self.iter_bytes():
            for ev in p.feed(chunk):
                yield ev

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and not self.head.close:
            self.pool._give(self.conn)
        else:
            self.conn.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
