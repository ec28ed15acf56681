"""Bearer-key checks: --api-key guards inference, --admin-key guards every mutation.

- admin key set: mutations need it; the API key gets 403, no/wrong key 401.
- no admin key, loopback host: mutations are guarded like inference (API key, if any).
- no admin key, reachable host: mutations are disabled (403) whatever the caller sends.
The admin key is also accepted wherever the API key is.

AuthGate runs these checks in front of the whole app, before anything reads the body, so
a caller without the key never learns how its body was judged (no 400 or 413). Every
path needs the API key (when set) except /health and /ping, and /metrics and the docs where
the settings open them; the routers' require_user / require_admin still run in the route.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.server.errors import (
    AuthenticationError,
    PermissionDeniedError,
    ServerError,
    exception_body,
)
from metrale.server.metrics import ServerMetrics
from metrale.server.settings import ServerSettings

HEALTH_PATH = "/health"
PING_PATH = "/ping"  # vLLM's name for it
METRICS_PATH = "/metrics"


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, key: str | None) -> bool:
    # constant-time: the comparison must not leak how much of a guess was right
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


def check_user(settings: ServerSettings, authorization: str | None) -> None:
    if settings.api_key is None:
        return
    token = _bearer(authorization)
    if not (_matches(token, settings.api_key) or _matches(token, settings.admin_key)):
        raise AuthenticationError(
            "missing or invalid API key: send the header 'Authorization: Bearer <api key>'")


def check_admin(settings: ServerSettings, authorization: str | None) -> None:
    if settings.admin_key is None:
        if settings.admin_open_to_network:
            raise PermissionDeniedError(
                f"adapter management is disabled: the server listens on {settings.host!r}, "
                "beyond loopback, without an admin key; restart it with --admin-key KEY")
        return check_user(settings, authorization)
    token = _bearer(authorization)
    if _matches(token, settings.admin_key):
        return
    if _matches(token, settings.api_key):
        raise PermissionDeniedError(
            "this endpoint changes the server and needs the admin key; the API key only "
            "allows inference")
    raise AuthenticationError(
        "missing or invalid admin key: send the header 'Authorization: Bearer <admin key>'")


def refusal(error: BaseException, metrics: ServerMetrics) -> JSONResponse:
    """A refusal's error JSON, counted in metrale_refusals by the error's class."""
    metrics.refusals.labels(type(error).__name__).inc()
    status, body = exception_body(error)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def require_user(request: Request) -> None:
    check_user(request.app.state.settings, request.headers.get("authorization"))


def require_admin(request: Request) -> None:
    check_admin(request.app.state.settings, request.headers.get("authorization"))


class AuthGate:
    """ASGI middleware: the key check of every HTTP request, before its body is read.

    is_admin(scope) says whether the request is a mutation (needs the admin key)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics,
                 is_admin: Callable[[Scope], bool], docs_paths: frozenset[str]) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics
        self.is_admin, self.docs_paths = is_admin, docs_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        check = self._check_for(scope)
        if check is not None:
            try:
                check(self.settings, Headers(scope=scope).get("authorization"))
            except ServerError as e:
                return await refusal(e, self.metrics)(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_for(self, scope: Scope) -> Callable[[ServerSettings, str | None], None] | None:
        path = scope["path"]
        if path in (HEALTH_PATH, PING_PATH):
            return None
        if path == METRICS_PATH and self.settings.public_metrics:
            return None
        if path in self.docs_paths and self.settings.public_docs:
            return None
        # deny by default: unknown paths need the key too (a 404 would map the API)
        return check_admin if self.is_admin(scope) else check_user
