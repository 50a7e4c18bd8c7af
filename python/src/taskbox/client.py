"""The synchronous client: [`Client`] (a connection to a supervisor), [`Sandbox`] (one sandbox
and its operations) and [`Process`] (a background exec)."""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from pydantic import SecretStr

from . import _calls as calls
from . import _local
from . import models as m
from ._calls import Call, check, connection_error, error_of
from ._routes import route
from ._target import DEFAULT_TIMEOUT, Target, resolve, tar_of, workspace_path
from ._transport import Pool, Timeout, TransportError
from .errors import NotFoundError, TaskboxConnectionError, TaskboxError

__all__ = ["Client", "Sandbox", "Process"]

T = TypeVar("T")

#: What a streamed exec asks for.
SSE_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}


class Client:
    """A connection to a taskbox supervisor.

    With no arguments it talks to the local supervisor on its default Unix socket
    (`STATE/taskbox.sock`, `STATE` as the CLI finds it) and starts one there, as the CLI does,
    when none answers. `url="http://HOST:PORT"` with `token=` talks to `taskbox serve --listen
    ADDR --tokens FILE`; `TASKBOX_URL` and `TASKBOX_TOKEN` give them when the arguments do not.

    ```python
    with taskbox.Client() as tb, tb.sandbox(workspace=".") as sb:
        print(sb.exec("pytest -q").stdout.text)
    ```
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        start_supervisor: bool | None = None,
        taskbox_bin: str | os.PathLike[str] | None = None,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
    ) -> None:
        """`socket` names another Unix socket; `start_supervisor=False` never starts one;
        `taskbox_bin` is the binary that would (default: this package's own, then PATH);
        `timeout` bounds every request (default: 10 s to connect, no limit to read, since an
        exec waits for its command; an `httpx.Timeout` is taken too)."""
        self.target: Target = resolve(url, socket, token, state_dir, start_supervisor)
        self._bin = Path(taskbox_bin) if taskbox_bin is not None else None
        sock = str(self.target.socket) if self.target.socket else None
        self._http = Pool(self.target.base_url, sock, self.target.headers(), timeout)
        self._ready = False

    # ---- connection ---------------------------------------------------------------------

    def connect(self) -> Client:
        """Makes sure a supervisor answers (starting the local one if allowed); every request
        does this first, once."""
        if self._ready:
            return self
        t = self.target
        if t.socket is not None and t.start and not self._answers():
            log = _local.spawn_supervisor(t.socket, t.state_dir, self._bin)
            deadline = time.monotonic() + _local.START_TIMEOUT
            while not self._answers():
                if time.monotonic() > deadline:
                    raise _local.not_up(log)
                time.sleep(0.02)
        self._ready = True
        return self

    def _answers(self) -> bool:
        try:
            return self._http.request("GET", "/healthz").status_code == 200
        except TransportError:
            return False

    def send(self, c: Call[T]) -> T:
        """Sends one prepared call (see `taskbox._calls`) and reads its answer."""
        self.connect()
        try:
            r = self._http.request(
                c.method, c.path, json=c.json, params=c.params, content=c.content,
                headers=c.headers or None,
            )
        except TransportError as e:
            raise connection_error(e, self.target.where) from e
        return c.parse(check(r))

    def close(self) -> None:
        """Closes the connection (sandboxes live on until destroyed or their lease ends)."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the supervisor ------------------------------------------------------------------

    def health(self) -> m.Health:
        """`GET /healthz`: status, version and the number of live sandboxes."""
        return self.send(calls.health())

    def metrics(self) -> str:
        """Prometheus metrics (text format)."""
        return self.send(calls.metrics())

    def openapi(self) -> dict[str, Any]:
        """The API's OpenAPI document."""
        return self.send(calls.openapi())

    # ---- sandboxes -----------------------------------------------------------------------

    def create(
        self,
        workspace: str | os.PathLike[str] | None = None,
        *,
        workspace_id: str | None = None,
        policy: str | None = None,
        policy_toml: str | None = None,
        backend: str | None = None,
        image: str | None = None,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        ttl: float | None = None,
        secrets: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> Sandbox:
        """Creates a sandbox around `workspace` (a directory: on the Unix socket a local one,
        over TCP one of the supervisor's host under its `--workspace-root`) or an uploaded
        `workspace_id`. `policy` is a profile name, `policy_toml` a policy's text; `ttl` the
        lease in seconds; `secrets` the values of the policy's secrets that come `from_api` (given
        to the egress proxy only, never to the sandbox). With `idempotency_key`, a retry with the same key and options gets
        the same sandbox (the supervisor keeps the key a day, per tenant), and the same key with
        other options raises `IdempotencyKeyReusedError`. The sandbox lives until [`Sandbox.destroy`] (or its `with` block
        ends, or its lease runs out)."""
        req = m.CreateRequest(
            workspace=workspace_path(self.target, workspace),
            workspace_id=workspace_id,
            policy=policy,
            policy_toml=policy_toml,
            backend=backend,
            image=image,
            env=dict(env) if env else None,
            labels=dict(labels) if labels else None,
            ttl_secs=None if ttl is None else max(1, int(ttl)),
            secrets={k: SecretStr(v) for k, v in secrets.items()} if secrets else None,
        )
        return Sandbox(self, self.send(calls.create(req, idempotency_key)))

    @contextmanager
    def sandbox(self, workspace: str | os.PathLike[str] | None = None, **options: Any) -> Iterator[Sandbox]:
        """`with client.sandbox(workspace=...) as sb:` creates a sandbox (options as for
        [`create`]) and destroys it when the block ends, however it ends."""
        sb = self.create(workspace, **options)
        try:
            yield sb
        finally:
            sb.destroy(missing_ok=True)

    def get(self, id: str) -> Sandbox:
        """The sandbox `id` (its info fetched: a missing one raises `NotFoundError`)."""
        return Sandbox(self, self.send(calls.info(id)))

    def sandboxes(self) -> list[m.SandboxInfo]:
        """The caller's sandboxes."""
        return self.send(calls.list_sandboxes())

    def approvals(self) -> list[m.Approval]:
        """Execs of all the caller's sandboxes waiting for a person's approval."""
        return self.send(calls.approvals(None, None))

    # ---- workspaces ----------------------------------------------------------------------

    def upload_workspace(self, source: str | os.PathLike[str] | bytes | IO[bytes], *, ttl: float | None = None) -> m.WorkspaceUpload:
        """Sends a workspace as a tar: a local directory (packed here), a tar file, or its
        bytes. Create a sandbox on it with `workspace_id=upload.id`."""
        with tar_of(source) as body:
            return self.send(calls.upload_workspace(body, None if ttl is None else int(ttl)))

    def clone_workspace(self, url: str, commit: str, *, ttl: float | None = None) -> m.WorkspaceUpload:
        """Lets the supervisor clone a git repository at a full commit id as a workspace."""
        return self.send(calls.clone_workspace(url, commit, None if ttl is None else int(ttl)))

    def workspaces(self) -> list[m.WorkspaceUpload]:
        """The caller's uploaded workspaces."""
        return self.send(calls.list_workspaces())

    def delete_workspace(self, workspace_id: str) -> None:
        """Removes an uploaded workspace no sandbox uses."""
        self.send(calls.delete_workspace(workspace_id))

    # ---- streaming -----------------------------------------------------------------------

    def _stream(self, id: str, req: m.ExecRequest) -> Iterator[m.AnyEvent]:
        self.connect()
        method, path = route("exec", id=id)
        try:
            with self._http.stream(method, path, json=req.body(), headers=SSE_HEADERS) as source:
                r = source.response
                if r.status_code >= 400:
                    source.read()
                    raise error_of(r.status_code, r.content)
                for name, data in source.iter_sse():
                    if name == "error":
                        raise error_of(None, data.encode())
                    if not data:
                        continue
                    event = m.parse_event(data)
                    yield event
                    if isinstance(event, m.EndedEvent):
                        return
        except TransportError as e:
            raise connection_error(e, self.target.where) from e
        raise TaskboxConnectionError("the supervisor closed the stream before the command ended")


class Sandbox:
    """One sandbox: commands, files, diffs, checkpoints. A context manager: `with` destroys it
    at the end of the block.

    Paths are relative to the workspace root (absolute paths inside the workspace work too)."""

    def __init__(self, client: Client, info: m.SandboxInfo) -> None:
        self.client = client
        #: The sandbox's info as last fetched ([`refresh`] fetches it again).
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, backend={self.info.backend!r}, workspace={self.info.workspace!r})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.destroy(missing_ok=True)

    def _send(self, c: Call[T]) -> T:
        return self.client.send(c)

    # ---- lifecycle -----------------------------------------------------------------------

    def refresh(self) -> m.SandboxInfo:
        """Fetches the sandbox's info again."""
        self.info = self._send(calls.info(self.id))
        return self.info

    def renew(self, ttl: float) -> m.SandboxInfo:
        """Sets the lease to `ttl` seconds from now."""
        self.info = self._send(calls.renew(self.id, max(1, int(ttl))))
        return self.info

    def destroy(self, *, missing_ok: bool = False) -> None:
        """Destroys the sandbox: nothing of it remains. With `missing_ok`, one already gone is
        no error."""
        try:
            self._send(calls.destroy(self.id))
        except NotFoundError:
            if not missing_ok:
                raise

    # ---- commands ------------------------------------------------------------------------

    def exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_output: bool = False,
        user: str | None = None,
    ) -> m.ExecResult:
        """Runs a command and waits for its result: a string is a shell command line
        (`/bin/sh -c`), a sequence an argv. `timeout` in seconds (default: the policy's);
        `stdin` is given to the command, then closed. A failing command is a result with its
        exit code, not an exception. `merge_output` sends stderr to stdout in the order
        written (as `2>&1`). `user` runs it as a user of the sandbox (a name of its own
        `/etc/passwd`, or a numeric uid; an unknown name raises `UserNotFoundError`). A large
        `stdin` (over 4 MiB) is streamed to the command, which then runs as a background exec
        that this call waits for."""
        if calls.streams_stdin(stdin):
            assert stdin is not None
            p = self.start(command, cwd=cwd, env=env, timeout=timeout, output_limit=output_limit,
                                 merge_output=merge_output, user=user)
            data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
            try:
                p.write(data, close=True)
            except TaskboxError:
                # A command that ended without reading all its input still has a result.
                if (p.wait(timeout=5)).result is None:
                    raise
            info = p.wait()
            assert info.result is not None
            return info.result
        body = calls.exec_body(command, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                               output_limit=output_limit, merge_output=merge_output, background=False,
                               user=user)
        return self._send(calls.exec_call(self.id, body))

    def exec_stream(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_output: bool = False,
        user: str | None = None,
    ) -> Iterator[m.AnyEvent]:
        """Runs a command and yields its events as they come (Server-Sent Events):
        `StartedEvent`, `StdoutEvent`/`StderrEvent` chunks, and last an `EndedEvent` with the
        result (`ApprovalEvent`/`AnsweredEvent` when the command policy asks a person first).
        Leaving the loop early closes the stream; the command still runs to its end."""
        req = calls.exec_request(command, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                                 output_limit=output_limit, merge_output=merge_output, background=False,
                                 user=user)
        return self.client._stream(self.id, req)

    def start(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_output: bool = False,
        user: str | None = None,
    ) -> Process:
        """Starts a command in the background and returns its handle at once. Without `stdin`
        its standard input stays open for [`Process.write`]."""
        req = calls.exec_request(command, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                                 output_limit=output_limit, merge_output=merge_output, background=True,
                                 user=user)
        return Process(self, self._send(calls.start(self.id, req)))

    def process(self, exec_id: int) -> Process:
        """The handle of background process `exec_id`."""
        return Process(self, self._send(calls.process(self.id, exec_id)))

    # ---- files ---------------------------------------------------------------------------

    def read(
        self,
        path: str,
        *,
        line_start: int | None = None,
        line_end: int | None = None,
        offset: int | None = None,
        length: int | None = None,
        max_bytes: int | None = None,
    ) -> m.ReadResult:
        """Reads a file, or a line range (1-based, inclusive) or byte range of it, at most
        `max_bytes` (default 256 KiB; `truncated` says when more was there)."""
        req = m.ReadRequest(path=path, line_start=line_start, line_end=line_end, offset=offset,
                            length=length, max_bytes=max_bytes)
        return self._send(calls.read(self.id, req))

    def read_bytes(self, path: str) -> bytes:
        """The whole file's bytes, as they are (streamed by the supervisor, of any size)."""
        return self._send(calls.download(self.id, path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The whole file as text."""
        return self.read_bytes(path).decode(encoding)

    def write(self, path: str, content: str | bytes, *, create_parents: bool = False, mode: int | None = None) -> m.WriteResult:
        """Writes a file atomically: text as UTF-8, bytes as they are. `mode` sets the
        permission bits of a new file (default 0644)."""
        return self._send(calls.write(self.id, path, content, create_parents, mode))

    def edit(self, path: str, old: str, new: str, *, expected_count: int | None = None) -> m.EditResult:
        """Replaces exact text: `old` must occur `expected_count` times (default 1). Raises
        `EditNotFoundError` or `EditAmbiguousError` otherwise."""
        req = m.EditRequest(path=path, old=old, new=new, expected_count=expected_count)
        return self._send(calls.edit(self.id, req))

    def patch(self, patch: str) -> m.PatchResult:
        """Applies a unified diff, all or nothing (`PatchFailedError` when a hunk does not apply)."""
        return self._send(calls.patch(self.id, patch))

    def list(
        self,
        path: str | None = None,
        *,
        glob: str | None = None,
        max_depth: int | None = None,
        include_ignored: bool = False,
        include_hidden: bool = False,
        limit: int | None = None,
    ) -> m.ListResult:
        """Lists a directory (gitignore-aware; default the workspace root, one level)."""
        req = m.ListRequest(path=path, glob=glob, max_depth=max_depth, include_ignored=include_ignored or None,
                            include_hidden=include_hidden or None, limit=limit)
        return self._send(calls.list_dir(self.id, req))

    def search(
        self,
        pattern: str,
        *,
        path: str | None = None,
        glob: str | None = None,
        case_insensitive: bool = False,
        include_ignored: bool = False,
        include_hidden: bool = False,
        max_matches: int | None = None,
    ) -> m.SearchResult:
        """Searches file contents for a regular expression (Rust regex syntax)."""
        req = m.SearchRequest(pattern=pattern, path=path, glob=glob, case_insensitive=case_insensitive or None,
                              include_ignored=include_ignored or None, include_hidden=include_hidden or None,
                              max_matches=max_matches)
        return self._send(calls.search(self.id, req))

    def stat(self, path: str) -> m.StatResult:
        """A path's metadata (`NotFoundError` when it does not exist)."""
        return self._send(calls.stat(self.id, path))

    def exists(self, path: str) -> bool:
        """Whether `path` exists."""
        try:
            self.stat(path)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, or with `recursive` a directory and all beneath it."""
        self._send(calls.remove(self.id, path, recursive))

    def move(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Renames a file or directory."""
        self._send(calls.move(self.id, src, dst, overwrite))

    # ---- changes -------------------------------------------------------------------------

    def diff(self, since: str | None = None, *, include_ignored: bool = False) -> m.DiffResult:
        """What changed in the workspace since its baseline (the host copy) or checkpoint `since`.
        What git ignores and `.git/` internals are left out (counted in `ignored`) unless
        `include_ignored`; files that tools run on their own are listed in `flagged`."""
        return self._send(calls.diff(self.id, since, include_ignored))

    def checkpoint(self, name: str) -> m.CheckpointInfo:
        """Checkpoints the workspace under `name`."""
        return self._send(calls.checkpoint(self.id, name))

    def restore(self, name: str) -> None:
        """Rolls the workspace back to checkpoint `name` (background processes are stopped)."""
        self._send(calls.restore(self.id, name))

    def fork(self, count: int = 1, *, checkpoint: str | None = None, ttl_secs: int | None = None,
             labels: Mapping[str, str] | None = None) -> builtins.list[Sandbox]:
        """`count` new sandboxes (1-64) from this one: its image, policy, environment, workspace
        and `/tmp` as they are now, or with `checkpoint` its workspace at that checkpoint (and
        an empty `/tmp`). Each has its own lease (`ttl_secs`, default the supervisor's) and
        counts against the quotas as a create does; processes are not copied."""
        r = self._send(calls.fork(self.id, count, checkpoint, ttl_secs, labels))
        return [Sandbox(self.client, info) for info in r.sandboxes]

    def export(self, format: m.ExportFormat = "patch", *, apply: bool = False,
               include_ignored: bool = False, allow_autorun: bool = False,
               idempotency_key: str | None = None) -> m.ExportResult:
        """The change as a patch (or a tar in the state directory); `apply` also writes it to
        the host workspace, refusing files that tools run on their own unless `allow_autorun`.
        It carries the files of the default diff, and with `include_ignored` the rest too.
        With `apply` and `idempotency_key`, a retry with the same key gets the first answer and
        writes nothing again."""
        return self._send(calls.export(self.id, format, apply, include_ignored, allow_autorun,
                                         idempotency_key))

    # ---- policy --------------------------------------------------------------------------

    def set_network(self, allow: Sequence[str] = (), deny: Sequence[str] = (),
                    hosts: Mapping[str, Sequence[str]] | None = None) -> m.NetworkRules:
        """Replaces the egress rules of a sandbox whose policy has network mode "proxy"."""
        rules = m.NetworkRules(allow=list(allow), deny=list(deny),
                               hosts={k: list(v) for k, v in (hosts or {}).items()})
        return self._send(calls.set_network(self.id, rules))

    def rotate_secret(self, name: str, value: str) -> m.SecretStatus:
        """Gives the policy's secret `name` a new value, for every request from now on (the
        sandbox keeps its placeholder; the value is never in an answer, a log or the trace)."""
        return self._send(calls.rotate_secret(self.id, name, value))

    def revoke_secret(self, name: str) -> m.SecretStatus:
        """Revokes the policy's secret `name`: requests go out without it from now on."""
        return self._send(calls.revoke_secret(self.id, name))

    def approvals(self, *, wait: float | None = None) -> builtins.list[m.Approval]:
        """This sandbox's execs waiting for approval; `wait` seconds for one when none is."""
        return self._send(calls.approvals(self.id, wait))

    def approve(self, approval: str) -> m.Approval:
        """Approves a waiting exec: it runs."""
        return self._send(calls.approve(self.id, approval))

    def deny(self, approval: str, reason: str | None = None) -> m.Approval:
        """Denies a waiting exec: it ends with a violation that gives `reason`."""
        return self._send(calls.deny(self.id, approval, reason))


class Process:
    """A background process of a sandbox (from [`Sandbox.start`])."""

    def __init__(self, sandbox: Sandbox, info: m.ProcessInfo) -> None:
        self.sandbox = sandbox
        #: The process's state as last fetched.
        self.info = info

    @property
    def exec_id(self) -> int:
        return self.info.exec_id

    @property
    def result(self) -> m.ExecResult | None:
        """The result, once the process has ended (as last fetched)."""
        return self.info.result

    def __repr__(self) -> str:
        return f"Process(sandbox={self.sandbox.id!r}, exec_id={self.exec_id}, running={self.info.running})"

    def poll(self) -> m.ProcessInfo:
        """Fetches the state and output so far."""
        self.info = self.sandbox._send(calls.process(self.sandbox.id, self.exec_id))
        return self.info

    def wait(self, timeout: float | None = None) -> m.ProcessInfo:
        """Waits until the process ends, or `timeout` seconds pass (then `running` is still
        True). Returns its state; `result` is set once it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = calls.WAIT_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            self.info = self.sandbox._send(calls.wait(self.sandbox.id, self.exec_id, left))
            if not self.info.running or (deadline is not None and time.monotonic() >= deadline):
                return self.info

    def kill(self, signal: int = 9) -> m.ProcessInfo:
        """Sends `signal` (default SIGKILL, which kills the whole process tree)."""
        self.info = self.sandbox._send(calls.kill(self.sandbox.id, self.exec_id, signal))
        return self.info

    def write(self, data: str | bytes, *, close: bool = False) -> None:
        """Writes to the process's standard input: text as it is, bytes of any size streamed
        as they are; `close` closes it afterwards."""
        self.sandbox._send(calls.write_stdin(self.sandbox.id, self.exec_id, data, close))

    def close_stdin(self) -> None:
        """Closes the process's standard input (it reads end of file)."""
        self.sandbox._send(calls.write_stdin(self.sandbox.id, self.exec_id, "", True))
