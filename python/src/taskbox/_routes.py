"""The routes the SDK calls, by the OpenAPI document's `operationId`.

`python/tests/test_schema.py` checks this table against `/openapi.json` both ways: a route the
API gains or loses fails the test.
"""

from __future__ import annotations

from urllib.parse import quote

#: operationId -> (method, path template)
ROUTES: dict[str, tuple[str, str]] = {
    "healthz": ("GET", "/healthz"),
    "metrics": ("GET", "/metrics"),
    "openapi": ("GET", "/openapi.json"),
    "create_sandbox": ("POST", "/v1/sandboxes"),
    "list_sandboxes": ("GET", "/v1/sandboxes"),
    "get_sandbox": ("GET", "/v1/sandboxes/{id}"),
    "destroy_sandbox": ("DELETE", "/v1/sandboxes/{id}"),
    "renew_lease": ("POST", "/v1/sandboxes/{id}/renew"),
    "exec": ("POST", "/v1/sandboxes/{id}/exec"),
    "get_process": ("GET", "/v1/sandboxes/{id}/processes/{exec_id}"),
    "wait_process": ("POST", "/v1/sandboxes/{id}/processes/{exec_id}/wait"),
    "kill_process": ("POST", "/v1/sandboxes/{id}/processes/{exec_id}/kill"),
    "write_stdin": ("POST", "/v1/sandboxes/{id}/processes/{exec_id}/stdin"),
    "list_all_approvals": ("GET", "/v1/approvals"),
    "list_approvals": ("GET", "/v1/sandboxes/{id}/approvals"),
    "approve": ("POST", "/v1/sandboxes/{id}/approvals/{approval}/approve"),
    "deny": ("POST", "/v1/sandboxes/{id}/approvals/{approval}/deny"),
    "set_network": ("PUT", "/v1/sandboxes/{id}/network"),
    "rotate_secret": ("PUT", "/v1/sandboxes/{id}/secrets/{name}"),
    "revoke_secret": ("DELETE", "/v1/sandboxes/{id}/secrets/{name}"),
    "read": ("POST", "/v1/sandboxes/{id}/read"),
    "write": ("POST", "/v1/sandboxes/{id}/write"),
    "edit": ("POST", "/v1/sandboxes/{id}/edit"),
    "patch": ("POST", "/v1/sandboxes/{id}/patch"),
    "list": ("POST", "/v1/sandboxes/{id}/list"),
    "search": ("POST", "/v1/sandboxes/{id}/search"),
    "stat": ("POST", "/v1/sandboxes/{id}/stat"),
    "remove": ("POST", "/v1/sandboxes/{id}/remove"),
    "move": ("POST", "/v1/sandboxes/{id}/move"),
    "diff": ("POST", "/v1/sandboxes/{id}/diff"),
    "create_checkpoint": ("POST", "/v1/sandboxes/{id}/checkpoints"),
    "restore": ("POST", "/v1/sandboxes/{id}/restore"),
    "fork": ("POST", "/v1/sandboxes/{id}/fork"),
    "export": ("POST", "/v1/sandboxes/{id}/export"),
    "upload": ("PUT", "/v1/sandboxes/{id}/files"),
    "download": ("GET", "/v1/sandboxes/{id}/files"),
    "upload_workspace": ("POST", "/v1/workspaces"),
    "list_workspaces": ("GET", "/v1/workspaces"),
    "delete_workspace": ("DELETE", "/v1/workspaces/{workspace_id}"),
}


#: The operations that take an `Idempotency-Key` (export: with `apply`).
IDEMPOTENT: frozenset[str] = frozenset({"create_sandbox", "export"})


def route(operation: str, **params: object) -> tuple[str, str]:
    """The method and path of `operation`, its `{name}`s filled in (each quoted as one segment)."""
    method, template = ROUTES[operation]
    path = template.format(**{k: quote(str(v), safe="") for k, v in params.items()})
    return method, path
