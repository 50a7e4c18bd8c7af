"""Each operation once, as data: which route, which body, how the answer is read. The sync and
async clients only send these ([`Call`]) and differ in nothing else.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, SecretStr, TypeAdapter

from . import models as m
from ._routes import IDEMPOTENT, route
from ._transport import Response, TransportError
from .errors import TaskboxConnectionError, TaskboxError, error_for

T = TypeVar("T")

#: The longest a single wait request asks the supervisor for (its own cap is 300 s).
WAIT_SLICE = 300.0
#: Stdin larger than this (bytes, or characters of text) is streamed rather than put in the
#: exec request, whose body the supervisor limits (16 MiB by default; base64 adds a third).
STREAM_STDIN_OVER = 4 << 20


@dataclass
class Call(Generic[T]):
    """One request and how its answer becomes a value."""

    method: str
    path: str
    parse: Callable[[Response], T]
    json: Any = None
    params: dict[str, Any] | None = None
    content: Any = None
    headers: dict[str, str] = field(default_factory=dict)


_ADAPTERS: dict[Any, Any] = {}


def _model(model: type[T]) -> Callable[[Response], T]:
    """The parser of answers of `model`: its TypeAdapter is built once per model (building one
    costs twice what validating an ExecResult does)."""
    parse = _ADAPTERS.get(model)
    if parse is None:
        adapter: TypeAdapter[T] = TypeAdapter(model)
        parse = _ADAPTERS[model] = lambda r: adapter.validate_json(r.content)
    return parse


def _none(_: Response) -> None:
    return None


def _text(r: Response) -> str:
    return r.text


def call(op: str, parse: Callable[[Response], T], *, body: BaseModel | None = None,
         params: dict[str, Any] | None = None, **path: object) -> Call[T]:
    method, p = route(op, **path)
    json_body = body.body() if isinstance(body, m.Request) else None
    return Call(method, p, parse, json=json_body, params=params)


def check(r: Response) -> Response:
    """`r`, or the exception of its error answer."""
    if r.status_code < 400:
        return r
    e = error_of(r.status_code, r.content)
    after = r.headers.get("retry-after")
    if after is not None and after.strip().isdigit():
        e.retry_after = float(after)
    raise e


def error_of(status: int | None, content: bytes) -> TaskboxError:
    try:
        body = json.loads(content)
        detail = body["error"]
        return error_for(str(detail["code"]), str(detail["message"]), status)
    except (ValueError, KeyError, TypeError):
        text = content.decode("utf-8", "replace").strip()[:500]
        return TaskboxError(
            f"the supervisor answered HTTP {status}" + (f": {text}" if text else ""),
            status=status,
        )


def connection_error(e: TransportError, where: str) -> TaskboxConnectionError:
    return TaskboxConnectionError(f"cannot reach the supervisor at {where}: {e}")


# ---- the operations ---------------------------------------------------------------------------


def health() -> Call[m.Health]:
    return call("healthz", _model(m.Health))


def metrics() -> Call[str]:
    return call("metrics", _text)


def openapi() -> Call[dict[str, Any]]:
    return call("openapi", lambda r: r.json())


#: The longest idempotency key the supervisor takes.
MAX_KEY_LEN = 255


def idempotency_header(key: str) -> str:
    """`key` as the `Idempotency-Key` header carries it: the draft's quoted string (`"` and `\\`
    escaped). A key is 1 to 255 printable ASCII characters, as the supervisor checks."""
    if not isinstance(key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_LEN or not all(" " <= c <= "~" for c in key):
        raise ValueError(
            f"invalid idempotency key {key[:40]!r}: a key is 1 to {MAX_KEY_LEN} printable ASCII "
            "characters (e.g. a UUID)"
        )
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def keyed(c: Call[T], operation: str, key: str | None) -> Call[T]:
    """`c` with an idempotency key, when one is given: the supervisor does it once per key and
    answers a retry as the first time."""
    assert operation in IDEMPOTENT, operation
    if key is not None:
        c.headers["Idempotency-Key"] = idempotency_header(key)
    return c


def create(req: m.CreateRequest, idempotency_key: str | None = None) -> Call[m.SandboxInfo]:
    c = call("create_sandbox", _model(m.SandboxInfo), body=req)
    return keyed(c, "create_sandbox", idempotency_key)


def list_sandboxes() -> Call[list[m.SandboxInfo]]:
    return call("list_sandboxes", _model(list[m.SandboxInfo]))


def info(id: str) -> Call[m.SandboxInfo]:
    return call("get_sandbox", _model(m.SandboxInfo), id=id)


def destroy(id: str) -> Call[None]:
    return call("destroy_sandbox", _none, id=id)


def renew(id: str, ttl_secs: int) -> Call[m.SandboxInfo]:
    return call("renew_lease", _model(m.SandboxInfo), body=m.RenewRequest(ttl_secs=ttl_secs), id=id)


def exec_request(command: str | Sequence[str], **fields: Any) -> m.ExecRequest:
    """The exec request of `command`: a string is a shell command line (`/bin/sh -c`), a
    sequence an argv. Text stdin goes as it is, bytes as base64. `user`: a user of the
    sandbox by name, or a numeric uid (default: the sandbox's user). The keywords are
    [`_exec_fields`]'s."""
    return m.ExecRequest(**_exec_fields(command, **fields))


def exec_body(command: str | Sequence[str], **fields: Any) -> dict[str, Any]:
    """`exec_request(...).body()`, without the model when every argument already has the type
    the model takes (every call of a harness): the model's validation and dump were a third of
    what the SDK itself spent on an `exec true`. Anything else goes through the model, and gets
    its errors."""
    body = _exec_fields(command, **fields)
    cwd, user, limit, env = (fields.get(k) for k in ("cwd", "user", "output_limit", "env"))
    plain = (
        (cwd is None or type(cwd) is str)
        and (user is None or type(user) is str)
        and (limit is None or type(limit) is int)
        and type(fields["merge_output"]) is bool
        and type(fields["background"]) is bool
        and (env is None or (isinstance(env, Mapping)
                             and all(type(k) is str and type(v) is str for k, v in env.items())))
    )
    return body if plain else m.ExecRequest(**body).body()


def _exec_fields(
    command: str | Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: str | bytes | None,
    timeout: float | None,
    output_limit: int | None,
    merge_output: bool,
    background: bool,
    user: str | None = None,
) -> dict[str, Any]:
    """The fields of an exec request that are set, as the model's dump names them."""
    if isinstance(command, str):
        argv, shell = None, command
    elif isinstance(command, (bytes, bytearray)):
        raise TypeError("command must be a str (a shell command line) or a sequence of str (an argv)")
    else:
        argv, shell = [os.fsdecode(a) for a in command], None
    text, encoding = _encoded(stdin)
    fields = {
        "argv": argv,
        "shell": shell,
        "cwd": cwd,
        "env": dict(env) if env else None,
        "stdin": text,
        "stdin_encoding": encoding,
        "merge_output": merge_output or None,
        "timeout_ms": None if timeout is None else max(1, int(timeout * 1000)),
        "output_limit": output_limit,
        "background": background or None,
        "user": user,
    }
    return {k: v for k, v in fields.items() if v is not None}


@functools.lru_cache(maxsize=256)
def _exec_path(id: str) -> str:
    return route("exec", id=id)[1]


def exec_call(id: str, body: dict[str, Any]) -> Call[m.ExecResult]:
    """The exec of a body from [`exec_body`]."""
    return Call("POST", _exec_path(id), _model(m.ExecResult), json=body)


def _encoded(data: str | bytes | None) -> tuple[str | None, str | None]:
    """Text as it is; bytes as base64 (with the encoding to name)."""
    if data is None or isinstance(data, str):
        return data, None
    return base64.b64encode(bytes(data)).decode("ascii"), "base64"


def streams_stdin(stdin: str | bytes | None) -> bool:
    """Whether `stdin` is too large for a JSON request body: it is then streamed to a
    background exec instead (the API's stdin of any size)."""
    return stdin is not None and len(stdin) > STREAM_STDIN_OVER


def exec_(id: str, req: m.ExecRequest) -> Call[m.ExecResult]:
    return call("exec", _model(m.ExecResult), body=req, id=id)


def start(id: str, req: m.ExecRequest) -> Call[m.ProcessInfo]:
    return call("exec", _model(m.ProcessInfo), body=req, id=id)


def process(id: str, exec_id: int) -> Call[m.ProcessInfo]:
    return call("get_process", _model(m.ProcessInfo), id=id, exec_id=exec_id)


def wait(id: str, exec_id: int, timeout: float) -> Call[m.ProcessInfo]:
    ms = max(0, int(min(timeout, WAIT_SLICE) * 1000))
    return call("wait_process", _model(m.ProcessInfo), params={"timeout_ms": ms}, id=id, exec_id=exec_id)


def kill(id: str, exec_id: int, signal: int) -> Call[m.ProcessInfo]:
    return call("kill_process", _model(m.ProcessInfo), body=m.KillRequest(signal=signal), id=id, exec_id=exec_id)


def write_stdin(id: str, exec_id: int, data: str | bytes, close: bool) -> Call[None]:
    """Text as JSON; bytes as a raw body, streamed (any size)."""
    if isinstance(data, str):
        req = m.StdinRequest(data=data or None, close=close or None)
        return call("write_stdin", _none, body=req, id=id, exec_id=exec_id)
    c = call("write_stdin", _none, params={"close": "true"} if close else None, id=id, exec_id=exec_id)
    c.content = bytes(data)
    c.headers["Content-Type"] = "application/octet-stream"
    return c


def read(id: str, req: m.ReadRequest) -> Call[m.ReadResult]:
    return call("read", _model(m.ReadResult), body=req, id=id)


def content_bytes(r: m.ReadResult) -> bytes:
    """The bytes a read answered with, whatever its encoding."""
    if r.encoding == "base64":
        return base64.b64decode(r.content)
    return r.content.encode("utf-8")


#: Content larger than this (bytes, or characters of text) is written through the streamed
#: upload route rather than in a JSON body, which the supervisor limits (16 MiB by default;
#: base64 adds a third).
STREAM_FILE_OVER = 4 << 20


def upload(id: str, path: str, content: bytes, create_parents: bool, mode: int | None) -> Call[m.WriteResult]:
    """A write of `content` as the raw body of the streamed route (no encoding, no JSON limit)."""
    params: dict[str, Any] = {"path": path}
    if create_parents:
        params["create_parents"] = "true"
    if mode is not None:
        params["mode"] = str(mode)
    c = call("upload", _model(m.WriteResult), params=params, id=id)
    c.content = content
    c.headers["Content-Type"] = "application/octet-stream"
    return c


def download(id: str, path: str) -> Call[bytes]:
    """A whole file, as the raw body of the streamed route."""
    return call("download", lambda r: r.content, params={"path": path}, id=id)


def write(id: str, path: str, content: str | bytes, create_parents: bool, mode: int | None) -> Call[m.WriteResult]:
    if len(content) > STREAM_FILE_OVER:
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        return upload(id, path, data, create_parents, mode)
    if isinstance(content, str):
        text, encoding = content, None
    else:
        text, encoding = base64.b64encode(bytes(content)).decode("ascii"), "base64"
    req = m.WriteRequest(
        path=path, content=text, encoding=encoding, create_parents=create_parents or None, mode=mode
    )
    return call("write", _model(m.WriteResult), body=req, id=id)


def edit(id: str, req: m.EditRequest) -> Call[m.EditResult]:
    return call("edit", _model(m.EditResult), body=req, id=id)


def patch(id: str, text: str) -> Call[m.PatchResult]:
    return call("patch", _model(m.PatchResult), body=m.PatchRequest(patch=text), id=id)


def list_dir(id: str, req: m.ListRequest) -> Call[m.ListResult]:
    return call("list", _model(m.ListResult), body=req, id=id)


def search(id: str, req: m.SearchRequest) -> Call[m.SearchResult]:
    return call("search", _model(m.SearchResult), body=req, id=id)


def stat(id: str, path: str) -> Call[m.StatResult]:
    return call("stat", _model(m.StatResult), body=m.PathRequest(path=path), id=id)


def remove(id: str, path: str, recursive: bool) -> Call[None]:
    return call("remove", _none, body=m.RemoveRequest(path=path, recursive=recursive or None), id=id)


def move(id: str, src: str, dst: str, overwrite: bool) -> Call[None]:
    req = m.MoveRequest.model_validate({"from": src, "to": dst, "overwrite": overwrite or None})
    return call("move", _none, body=req, id=id)


def diff(id: str, since: str | None, include_ignored: bool = False) -> Call[m.DiffResult]:
    req = m.DiffRequest(since=since, include_ignored=include_ignored or None)
    return call("diff", _model(m.DiffResult), body=req, id=id)


def checkpoint(id: str, name: str) -> Call[m.CheckpointInfo]:
    return call("create_checkpoint", _model(m.CheckpointInfo), body=m.CheckpointRequest(name=name), id=id)


def restore(id: str, name: str) -> Call[None]:
    return call("restore", _none, body=m.CheckpointRequest(name=name), id=id)


def fork(id: str, count: int, checkpoint: str | None, ttl_secs: int | None,
         labels: Mapping[str, str] | None) -> Call[m.ForkResult]:
    req = m.ForkRequest(count=count, checkpoint=checkpoint, ttl_secs=ttl_secs,
                        labels=dict(labels) if labels else None)
    return call("fork", _model(m.ForkResult), body=req, id=id)


def export(id: str, format: m.ExportFormat, apply: bool, include_ignored: bool = False,
           allow_autorun: bool = False, idempotency_key: str | None = None) -> Call[m.ExportResult]:
    if idempotency_key is not None and not apply:
        raise ValueError("idempotency_key makes an apply safe to retry: pass apply=True with it")
    req = m.ExportRequest(format=format, apply=apply or None,
                          include_ignored=include_ignored or None,
                          allow_autorun=allow_autorun or None)
    return keyed(call("export", _model(m.ExportResult), body=req, id=id), "export", idempotency_key)


def set_network(id: str, rules: m.NetworkRules) -> Call[m.NetworkRules]:
    return call("set_network", _model(m.NetworkRules), body=rules, id=id)


def rotate_secret(id: str, name: str, value: str) -> Call[m.SecretStatus]:
    body = m.SecretRotation(value=SecretStr(value))
    return call("rotate_secret", _model(m.SecretStatus), body=body, id=id, name=name)


def revoke_secret(id: str, name: str) -> Call[m.SecretStatus]:
    return call("revoke_secret", _model(m.SecretStatus), id=id, name=name)


def approvals(id: str | None, wait: float | None) -> Call[list[m.Approval]]:
    if id is None:
        return call("list_all_approvals", _model(list[m.Approval]))
    params = None if wait is None else {"wait_ms": int(wait * 1000)}
    return call("list_approvals", _model(list[m.Approval]), params=params, id=id)


def approve(id: str, approval: str) -> Call[m.Approval]:
    return call("approve", _model(m.Approval), id=id, approval=approval)


def deny(id: str, approval: str, reason: str | None) -> Call[m.Approval]:
    return call("deny", _model(m.Approval), body=m.DenyRequest(reason=reason), id=id, approval=approval)


def upload_workspace(tar: Any, ttl_secs: int | None) -> Call[m.WorkspaceUpload]:
    c = call("upload_workspace", _model(m.WorkspaceUpload),
             params=None if ttl_secs is None else {"ttl_secs": ttl_secs})
    c.content = tar
    c.headers["Content-Type"] = "application/x-tar"
    return c


def clone_workspace(url: str, commit: str, ttl_secs: int | None) -> Call[m.WorkspaceUpload]:
    c = call("upload_workspace", _model(m.WorkspaceUpload),
             params=None if ttl_secs is None else {"ttl_secs": ttl_secs})
    c.json = {"git": {"url": url, "commit": commit}}
    return c


def list_workspaces() -> Call[list[m.WorkspaceUpload]]:
    return call("list_workspaces", _model(list[m.WorkspaceUpload]))


def delete_workspace(workspace_id: str) -> Call[None]:
    return call("delete_workspace", _none, workspace_id=workspace_id)
