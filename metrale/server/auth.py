"""Bearer-key checks: --api-key guards inference, --admin-key guards every mutation.

- admin key set: mutations need it; the API key gets 403, no/wrong key 401.
- no admin key, loopback host: mutations are guarded like inference (API key, if any).
- no admin key, reachable host: mutations are disabled (403) whatever the caller sends.
The admin key is also accepted wherever the API key is.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from metrale.server.errors import AuthenticationError, PermissionDeniedError
from metrale.server.settings import ServerSettings


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, key: str | None) -> bool:
    # constant-time: the comparison must not leak how much of a guess was right
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


def require_user(request: Request) -> None:
    settings: ServerSettings = request.app.state.settings
    if settings.api_key is None:
        return
    token = _bearer(request)
    if not (_matches(token, settings.api_key) or _matches(token, settings.admin_key)):
        raise AuthenticationError(
            "missing or invalid API key: send the header 'Authorization: Bearer <api key>'")


def require_admin(request: Request) -> None:
    settings: ServerSettings = request.app.state.settings
    if settings.admin_key is None:
        if settings.admin_open_to_network:
            raise PermissionDeniedError(
                f"adapter management is disabled: the server listens on {settings.host!r}, "
                "beyond loopback, without an admin key; restart it with --admin-key KEY")
        return require_user(request)
    token = _bearer(request)
    if _matches(token, settings.admin_key):
        return
    if _matches(token, settings.api_key):
        raise PermissionDeniedError(
            "this endpoint changes the server and needs the admin key; the API key only "
            "allows inference")
    raise AuthenticationError(
        "missing or invalid admin key: send the header 'Authorization: Bearer <admin key>'")
