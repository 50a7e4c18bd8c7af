"""Typed models of the HTTP API's requests and answers.

Each class is one schema of the supervisor's OpenAPI document (`GET /openapi.json`), under the
same name and with the same JSON field names; `python/tests/test_schema.py` checks every class
against the document of a real supervisor, both ways, so they cannot drift. Answers ignore
fields they do not know (a newer supervisor still talks to an older SDK); requests refuse them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, field_serializer

__all__ = [
    "Answer",
    "Request",
    "Output",
    "Change",
    "ChangeKind",
    "Violation",
    "Resources",
    "Enforcement",
    "NetworkConnection",
    "NetworkActivity",
    "Location",
    "FindingKind",
    "Finding",
    "TestCounts",
    "ExecResult",
    "ProcessInfo",
    "SandboxInfo",
    "Approval",
    "ApprovalState",
    "ApprovalEvent",
    "AnsweredEvent",
    "StartedEvent",
    "StdoutEvent",
    "StderrEvent",
    "EndedEvent",
    "ExecEvent",
    "AnyEvent",
    "ReadResult",
    "WriteResult",
    "EditResult",
    "PatchResult",
    "EntryKind",
    "Entry",
    "ListResult",
    "Match",
    "SearchResult",
    "StatResult",
    "FileDiff",
    "AutorunFile",
    "DiffStats",
    "DiffResult",
    "CheckpointInfo",
    "ExportFormat",
    "ExportResult",
    "NetworkRules",
    "GitSource",
    "WorkspaceUpload",
    "Health",
    "ErrorDetail",
    "ErrorBody",
    "CreateRequest",
    "ExecRequest",
    "ReadRequest",
    "WriteRequest",
    "EditRequest",
    "PatchRequest",
    "ListRequest",
    "SearchRequest",
    "PathRequest",
    "RemoveRequest",
    "MoveRequest",
    "DiffRequest",
    "CheckpointRequest",
    "ExportRequest",
    "RenewRequest",
    "KillRequest",
    "StdinRequest",
    "DenyRequest",
    "parse_event",
]


class Answer(BaseModel):
    """Base of the models the supervisor answers with (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    #: The schema's name in the OpenAPI document, when it is not the class's own.
    schema_name: ClassVar[str | None] = None


class Request(BaseModel):
    """Base of the request bodies (unknown fields are refused, as the supervisor does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    schema_name: ClassVar[str | None] = None

    def body(self) -> dict[str, Any]:
        """The JSON body: fields left unset are left out, so the supervisor's defaults apply."""
        return self.model_dump(by_alias=True, exclude_none=True)


# ---- observations -------------------------------------------------------------------------

ChangeKind = Literal["added", "modified", "deleted"]
FindingKind = Literal["test_failed", "test_error", "compile_error", "lint"]
EntryKind = Literal["file", "dir", "symlink", "other"]
ExportFormat = Literal["patch", "tar"]
ApprovalState = Literal["pending", "approved", "denied", "expired"]


class Output(Answer):
    """One captured output stream: head and tail within the output limit."""

    text: str
    #: Total bytes the command wrote to the stream.
    bytes: int
    #: `text` does not hold the whole stream.
    truncated: bool
    #: The file inside the sandbox that holds the whole stream, when `truncated`.
    spill_path: str | None = None


class Change(Answer):
    """One changed path of the workspace, relative to its root."""

    path: str
    kind: ChangeKind


class Violation(Answer):
    """Something the policy refused, in words a model can act on."""

    #: "network", "filesystem", "limit", "command", "timeout", ...
    kind: str
    detail: str


class Resources(Answer):
    cpu_ms: int
    max_rss_bytes: int
    oom_killed: bool


class Enforcement(Answer):
    """Which confinement mechanisms were in force."""

    landlock: str
    seccomp: bool
    network: str
    limits: str
    disk: str = ""


class NetworkConnection(Answer):
    """One connection the sandbox asked the egress proxy for."""

    host: str
    port: int
    protocol: str
    outcome: str
    ip: str | None = None
    rule: str | None = None
    reason: str | None = None
    hint: str | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    duration_ms: int | None = None
    error: str | None = None
    #: Its HTTP was inspected (the host has secrets or request rules).
    inspected: bool | None = None
    #: For a request refused by the request rules: its method and path ("POST /upload").
    request: str | None = None


class SecretUse(Answer):
    """How many requests to one host carried one secret (never its value)."""

    secret: str
    host: str
    port: int
    requests: int


class NetworkActivity(Answer):
    """The egress proxy's decisions during one exec (network mode "proxy" only)."""

    allowed: int
    denied: int
    failed: int
    bytes_up: int
    bytes_down: int
    open: int
    connections: list[NetworkConnection]
    omitted: int
    #: Requests refused by the request rules of inspected hosts.
    requests_denied: int | None = None
    #: The secrets the proxy presented, per secret and host.
    secrets: list[SecretUse] | None = None


class Location(Answer):
    """A place in a file: relative to the workspace when inside it."""

    file: str
    line: int | None = None
    column: int | None = None


class Finding(Answer):
    """What a tool of the command reported as failing: a failed test, a compiler error, a lint."""

    #: "test_failed", "test_error", "compile_error" or "lint".
    kind: FindingKind
    #: The tool that reported it: "pytest", "cargo-test", "rustc", "tsc", "ruff", ...
    tool: str
    #: The test's id, or the diagnostic's code (``E0308``, ``TS2322``, ``F401``).
    name: str | None = None
    location: Location | None = None
    #: One line: the assertion, the error's message.
    message: str
    #: A few lines of context, bounded in size.
    excerpt: str | None = None


class TestCounts(Answer):
    """Test counts as the command's runners reported them."""

    __test__ = False  # not a test class for pytest

    passed: int
    failed: int
    errored: int
    skipped: int


class ExecResult(Answer):
    """The observation of one command."""

    #: The command's exit code; None when a signal killed it (or nothing ran).
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool
    duration_ms: int
    stdout: Output
    stderr: Output
    #: What the command changed in the workspace.
    changes: list[Change]
    violations: list[Violation]
    resources: Resources
    enforcement: Enforcement
    network: NetworkActivity | None = None
    #: How many changes ``changes`` leaves out (ignored by git, or under ``.git/``).
    ignored_changes: int = 0
    #: What the command's tools reported as failing, read from its whole output (and the JUnit
    #: XML files it wrote), most telling first.
    findings: list[Finding] = []
    #: Findings left out of ``findings`` beyond its bound.
    findings_omitted: int = 0
    #: The test runners' counts, when any reported them.
    tests: TestCounts | None = None

    @property
    def ok(self) -> bool:
        """The command ran and exited 0."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def exit_status(self) -> int:
        """The status a shell reports: the code, 128+N for signal N, 124 on timeout, 126 when the
        command policy refused it, as `taskbox exec` exits."""
        if self.timed_out:
            return 124
        if self.signal is not None:
            return 128 + self.signal
        if self.exit_code is not None:
            return self.exit_code
        if any(v.kind == "command" for v in self.violations):
            return 126
        return 125


class ProcessInfo(Answer):
    """A background process: its state, its output so far, and its result once it ended."""

    exec_id: int
    argv: list[str]
    running: bool
    stdout: Output
    stderr: Output
    result: ExecResult | None = None


class ForkOrigin(Answer):
    """Where a fork came from: its parent, and the parent's checkpoint it started from (None:
    the parent as it was when forked)."""

    parent: str
    checkpoint: str | None = None
    forked_at_ms: int


class SandboxInfo(Answer):
    id: str
    backend: str
    workspace: str
    policy: str
    policy_hash: str
    #: "host" for the host view, else the image digest.
    image: str
    enforcement: Enforcement
    labels: dict[str, str]
    created_at_ms: int
    expires_at_ms: int | None = None
    #: "running" or "lost".
    state: str
    checkpoints: list[str]
    #: Why a lost sandbox is lost (an infrastructure failure, never the command's).
    lost_cause: str | None = None
    #: For a fork: its parent and the point it was forked from.
    forked_from: ForkOrigin | None = None


class Approval(Answer):
    """An exec that waits for a person's approval (the command policy's `ask`)."""

    id: str
    sandbox: str
    argv: list[str]
    command: str
    rule: str | None = None
    reason: str
    created_at_ms: int
    expires_at_ms: int
    state: ApprovalState
    denial_reason: str | None = None


# ---- streamed exec events (SSE) -----------------------------------------------------------


class ApprovalEvent(Answer):
    """The command policy asks a person first; the exec waits."""

    schema_name = "ExecEvent"
    type: Literal["approval"] = "approval"
    approval: Approval


class AnsweredEvent(Answer):
    """The approval was answered; the exec starts, or ends refused."""

    schema_name = "ExecEvent"
    type: Literal["answered"] = "answered"
    approval: Approval


class StartedEvent(Answer):
    schema_name = "ExecEvent"
    type: Literal["started"] = "started"
    exec_id: int


class StdoutEvent(Answer):
    schema_name = "ExecEvent"
    type: Literal["stdout"] = "stdout"
    data: str


class StderrEvent(Answer):
    schema_name = "ExecEvent"
    type: Literal["stderr"] = "stderr"
    data: str


class EndedEvent(Answer):
    """The last event of a streamed exec: its result."""

    schema_name = "ExecEvent"
    type: Literal["ended"] = "ended"
    result: ExecResult


#: One event of a streamed exec.
AnyEvent = Union[ApprovalEvent, AnsweredEvent, StartedEvent, StdoutEvent, StderrEvent, EndedEvent]
#: [`AnyEvent`] as pydantic reads it: by its `type`.
ExecEvent = Annotated[AnyEvent, Field(discriminator="type")]
#: The streamed events, by their SSE `event:` name (the `type` field).
EVENT_TYPES: dict[str, type[Answer]] = {
    "approval": ApprovalEvent,
    "answered": AnsweredEvent,
    "started": StartedEvent,
    "stdout": StdoutEvent,
    "stderr": StderrEvent,
    "ended": EndedEvent,
}
_EVENT: TypeAdapter[AnyEvent] = TypeAdapter(ExecEvent)


def parse_event(data: str) -> AnyEvent:
    """One SSE event's `data:` JSON as its model."""
    return _EVENT.validate_json(data)


# ---- file operations and the rest -------------------------------------------------------------


class ReadResult(Answer):
    path: str
    #: UTF-8 text, or base64 when `encoding` is "base64".
    content: str
    encoding: str
    total_bytes: int
    total_lines: int | None = None
    truncated: bool
    binary: bool


class WriteResult(Answer):
    path: str
    bytes_written: int
    created: bool
    #: The SHA-256 of what was written, in hex (uploads).
    sha256: str | None = None


class EditResult(Answer):
    path: str
    replacements: int
    #: The edit's unified diff.
    diff: str


class PatchResult(Answer):
    files: list[Change]


class Entry(Answer):
    path: str
    kind: EntryKind
    size: int


class ListResult(Answer):
    entries: list[Entry]
    truncated: bool


class Match(Answer):
    path: str
    line_number: int
    line: str


class SearchResult(Answer):
    matches: list[Match]
    truncated: bool
    files_searched: int


class StatResult(Answer):
    path: str
    kind: EntryKind
    size: int
    mode: int
    modified_ms: int
    symlink_target: str | None = None


class FileDiff(Answer):
    path: str
    status: ChangeKind
    binary: bool
    #: The permission change of a modified file, as "100644 -> 100755".
    mode_change: str | None = None
    #: A change left out by default, listed because the request had ``include_ignored``.
    ignored: bool = False


class AutorunFile(Answer):
    """A changed file that tools run on their own (a hook, an ``.envrc``, a CI definition)."""

    path: str
    #: What runs it, and when.
    reason: str
    #: Also left out of the files shown (ignored by git, or under ``.git/``).
    ignored: bool = False


class DiffStats(Answer):
    files: int
    insertions: int
    deletions: int


class DiffResult(Answer):
    files: list[FileDiff]
    #: The unified diff, git style.
    diff: str
    stats: DiffStats
    #: How many changes are left out by default (ignored by git, or under ``.git/``).
    ignored: int = 0
    #: Changed files that tools run on their own.
    flagged: list[AutorunFile] = Field(default_factory=list)


class ForkResult(Answer):
    """The sandboxes a fork made, in order."""

    sandboxes: list[SandboxInfo]


class CheckpointInfo(Answer):
    name: str
    created_at_ms: int
    files: int


class ExportResult(Answer):
    format: ExportFormat
    patch: str | None = None
    tar_path: str | None = None
    changes: list[Change]
    applied: bool
    #: How many changes the export leaves out (0 with ``include_ignored``).
    ignored: int = 0
    #: The exported changes that tools run on their own.
    flagged: list[AutorunFile] = Field(default_factory=list)


class NetworkRules(Request):
    """The egress rules of a live sandbox with network mode "proxy" (sent and answered)."""

    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    hosts: dict[str, list[str]] = Field(default_factory=dict)


class SecretRotation(Request):
    """A secret's new value (`Sandbox.rotate_secret`); shown masked, sent in clear to the
    supervisor only."""

    value: SecretStr

    @field_serializer("value")
    def _reveal(self, v: SecretStr) -> str:
        return v.get_secret_value()


class SecretStatus(Answer):
    """One of a sandbox's secrets: never its value."""

    name: str
    hosts: list[str]
    placeholder_env: str
    #: "active" or "revoked".
    state: str
    rotations: int


class GitSource(Answer):
    url: str
    commit: str


class WorkspaceUpload(Answer):
    """A workspace sent to the supervisor as a tar, or cloned by it."""

    id: str
    sha256: str | None = None
    git: GitSource | None = None
    bytes: int
    entries: int
    created_at_ms: int
    expires_at_ms: int


class Health(Answer):
    status: str
    version: str
    sandboxes: int


class ErrorDetail(Answer):
    code: str
    message: str


class ErrorBody(Answer):
    error: ErrorDetail


# ---- requests ---------------------------------------------------------------------------------


class CreateRequest(Request):
    workspace: str | None = None
    workspace_id: str | None = None
    policy: str | None = None
    policy_toml: str | None = None
    backend: str | None = None
    image: str | None = None
    env: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    ttl_secs: int | None = None
    #: Values of the policy's secrets that come `from_api`, by name (masked in reprs).
    secrets: dict[str, SecretStr] | None = None

    @field_serializer("secrets")
    def _reveal(self, v: dict[str, SecretStr] | None) -> dict[str, str] | None:
        return None if v is None else {k: s.get_secret_value() for k, s in v.items()}


class ExecRequest(Request):
    argv: list[str] | None = None
    shell: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    stdin_encoding: str | None = None
    merge_output: bool | None = None
    timeout_ms: int | None = None
    output_limit: int | None = None
    background: bool | None = None
    user: str | None = None


class ReadRequest(Request):
    path: str
    line_start: int | None = None
    line_end: int | None = None
    offset: int | None = None
    length: int | None = None
    max_bytes: int | None = None


class WriteRequest(Request):
    path: str
    content: str
    encoding: str | None = None
    create_parents: bool | None = None
    mode: int | None = None


class EditRequest(Request):
    path: str
    old: str
    new: str
    expected_count: int | None = None


class PatchRequest(Request):
    patch: str


class ListRequest(Request):
    path: str | None = None
    glob: str | None = None
    max_depth: int | None = None
    include_ignored: bool | None = None
    include_hidden: bool | None = None
    limit: int | None = None


class SearchRequest(Request):
    pattern: str
    path: str | None = None
    glob: str | None = None
    case_insensitive: bool | None = None
    include_ignored: bool | None = None
    include_hidden: bool | None = None
    max_matches: int | None = None


class PathRequest(Request):
    path: str


class RemoveRequest(Request):
    path: str
    recursive: bool | None = None


class MoveRequest(Request):
    from_: str = Field(alias="from")
    to: str
    overwrite: bool | None = None


class DiffRequest(Request):
    since: str | None = None
    include_ignored: bool | None = None


class CheckpointRequest(Request):
    name: str


class ForkRequest(Request):
    count: int | None = None
    checkpoint: str | None = None
    ttl_secs: int | None = None
    labels: dict[str, str] | None = None


class ExportRequest(Request):
    format: ExportFormat | None = None
    apply: bool | None = None
    include_ignored: bool | None = None
    allow_autorun: bool | None = None


class RenewRequest(Request):
    ttl_secs: int


class KillRequest(Request):
    signal: int | None = None


class StdinRequest(Request):
    data: str | None = None
    encoding: str | None = None
    close: bool | None = None


class DenyRequest(Request):
    reason: str | None = None
