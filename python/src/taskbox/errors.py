"""One exception class per error code of the API.

Every error answer of the supervisor is `{"error": {"code": "...", "message": "..."}}`; the
client raises the class of its code ([`ERRORS`][taskbox.errors.ERRORS]), all of them
[`TaskboxError`][taskbox.errors.TaskboxError]s. A code this SDK does not know yet is a plain
`TaskboxError` whose `code` says it. `python/tests/test_errors.py` checks the table against the
codes in the Rust source (`ApiError::code()` and the server's `HttpError::code()`).
"""

from __future__ import annotations

__all__ = [
    "TaskboxError",
    "TaskboxConnectionError",
    "NotFoundError",
    "SandboxNotFoundError",
    "InvalidArgumentError",
    "EditNotFoundError",
    "EditAmbiguousError",
    "PatchFailedError",
    "PathRefusedError",
    "IsDirectoryError",
    "NotDirectoryError",
    "PermissionDeniedError",
    "TooLargeError",
    "UserNotFoundError",
    "ConflictError",
    "LimitExceededError",
    "InfrastructureError",
    "InternalError",
    "UnavailableError",
    "UnauthorizedError",
    "MethodNotAllowedError",
    "RequestTimeoutError",
    "IdempotencyKeyReusedError",
    "PayloadTooLargeError",
    "ERRORS",
    "error_for",
]


class TaskboxError(Exception):
    """An error of taskbox: `code` is the API's machine-readable code, `message` says what
    failed in words a model can act on, `status` is the HTTP status (None when no answer came)."""

    #: The code of this class (None for the base class and for errors without an answer).
    CODE: str | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.CODE
        self.status = status
        #: Seconds after which the request may succeed (the answer's `Retry-After`: every 429
        #: has one), or None.
        self.retry_after: float | None = None

    @property
    def is_infrastructure(self) -> bool:
        """The sandbox or its backend failed (codes `infrastructure`, `internal` and
        `unavailable`, or no answer at all), not the request nor the command: a training loop
        drops such an episode instead of scoring it. The same as `isinstance(e,
        InfrastructureError)`."""
        return isinstance(self, InfrastructureError)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.code else self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status!r}, message={self.message!r})"


class InfrastructureError(TaskboxError):
    """The sandbox itself failed, not the request nor the command (500, code `infrastructure`):
    its init died, its supervisor restarted, its container or daemon went away, the host ran out
    of memory; `message` says which. Nothing more runs in that sandbox. A training loop catches
    this class (which `InternalError`, `UnavailableError` and `TaskboxConnectionError` are too)
    to drop the episode instead of scoring it."""

    CODE = "infrastructure"


class TaskboxConnectionError(InfrastructureError):
    """No answer: the supervisor cannot be reached, or the connection broke (it died
    mid-request, for one)."""

    CODE = None


class NotFoundError(TaskboxError):
    """The sandbox, checkpoint, process or path does not exist (404)."""

    CODE = "not_found"


class SandboxNotFoundError(NotFoundError):
    """The sandbox does not exist, or belongs to another tenant (404). A `NotFoundError` too."""

    CODE = "sandbox_not_found"


class InvalidArgumentError(TaskboxError):
    """The request is malformed or names something invalid (400)."""

    CODE = "invalid_argument"


class EditNotFoundError(TaskboxError):
    """edit: the old text does not occur (422)."""

    CODE = "edit_not_found"


class EditAmbiguousError(TaskboxError):
    """edit: the old text occurs more often than expected (422)."""

    CODE = "edit_ambiguous"


class PatchFailedError(TaskboxError):
    """patch: a hunk does not apply (422)."""

    CODE = "patch_failed"


class PathRefusedError(TaskboxError):
    """The path leaves the sandbox or names something that may not be touched (403)."""

    CODE = "path_refused"


class IsDirectoryError(TaskboxError):
    """The path is a directory where a file was expected (400)."""

    CODE = "is_a_directory"


class NotDirectoryError(TaskboxError):
    """A component of the path is not a directory (400)."""

    CODE = "not_a_directory"


class PermissionDeniedError(TaskboxError):
    """The sandbox's own user may not do this: the kernel refused it with the user's own
    credentials (403)."""

    CODE = "permission_denied"


class TooLargeError(TaskboxError):
    """The request body, or the file, is larger than its limit (413): a JSON body over the
    supervisor's `--max-body-bytes` (write large files with `upload`, which streams), an upload
    over `--max-upload-bytes`, a file too large to edit or patch whole."""

    CODE = "too_large"


class UserNotFoundError(TaskboxError):
    """exec: the sandbox has no user of that name (its own `/etc/passwd` lists none) (400)."""

    CODE = "user_not_found"


class ConflictError(TaskboxError):
    """The operation conflicts with the sandbox's state, e.g. it is lost or a name is taken (409)."""

    CODE = "conflict"


class LimitExceededError(TaskboxError):
    """A quota or limit was reached (429)."""

    CODE = "limit_exceeded"


class InternalError(InfrastructureError):
    """The backend failed (500): an infrastructure error."""

    CODE = "internal"


class UnavailableError(InfrastructureError):
    """The backend cannot be reached now (503): an infrastructure error."""

    CODE = "unavailable"


class UnauthorizedError(TaskboxError):
    """Missing or unknown bearer token (401)."""

    CODE = "unauthorized"


class MethodNotAllowedError(TaskboxError):
    """The route exists, but not with this method (405)."""

    CODE = "method_not_allowed"


class RequestTimeoutError(TaskboxError):
    """The request did not arrive whole in time (408)."""

    CODE = "request_timeout"


class IdempotencyKeyReusedError(TaskboxError):
    """The idempotency key was sent before with another request: another operation, sandbox or
    body (422). A key names one request; send a new key for a new request."""

    CODE = "idempotency_key_reused"


#: The class of each error code.
ERRORS: dict[str, type[TaskboxError]] = {
    cls.CODE: cls
    for cls in (
        NotFoundError,
        SandboxNotFoundError,
        InvalidArgumentError,
        EditNotFoundError,
        EditAmbiguousError,
        PatchFailedError,
        PathRefusedError,
        IsDirectoryError,
        NotDirectoryError,
        PermissionDeniedError,
        TooLargeError,
        UserNotFoundError,
        ConflictError,
        LimitExceededError,
        InfrastructureError,
        InternalError,
        UnavailableError,
        UnauthorizedError,
        MethodNotAllowedError,
        RequestTimeoutError,
        IdempotencyKeyReusedError,
    )
    if cls.CODE is not None
}


#: The name the 413 of the body limit had while its code was `payload_too_large`.
PayloadTooLargeError = TooLargeError


def error_for(code: str, message: str, status: int | None = None) -> TaskboxError:
    """The exception for an error answer: its code's class, or a `TaskboxError` carrying an
    unknown code."""
    cls = ERRORS.get(code, TaskboxError)
    return cls(message, code=code, status=status)
