"""Refusals as OpenAI error JSON with honest status codes.

Status codes come from the exception's class, never from its message: the
engine's typed errors (metrale.errors) plus the few the HTTP layer adds here.
"""

from __future__ import annotations

import re

from metrale.engine.sampling_params import InvalidSamplingParamsError
from metrale.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterOutsideRootError,
    AllSlotsPinnedError,
    InvalidNameError,
    LandingError,
    MetraleError,
    NoAdapterPoolError,
    PeerUnavailableError,
    PoolFullError,
    RuntimeSwapsDisabledError,
    SamplingError,
    SlotBusyError,
    SlotOutOfRangeError,
    SlotPinnedError,
    SourceBusyError,
    UnknownAdapterError,
)
from metrale.peer.errors import PeerNotAllowedError


class ServerError(MetraleError):
    """A refusal decided by the HTTP layer; `param` names the offending field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequestError(ServerError):
    status = 400


class AuthenticationError(ServerError):
    status = 401


class PermissionDeniedError(ServerError):
    status = 403


class AdapterPathError(ServerError):
    """An adapter path outside the configured roots, or not an adapter directory."""

    status = 403


class PayloadTooLargeError(ServerError):
    status = 413


class EngineUnavailableError(ServerError):
    """The engine thread stopped (shutdown) or died; nothing can be served."""

    status = 503


# (class, status, OpenAI error type, code). First match wins, so subclasses go first
# (and a class with two bases here gets the row of the first one listed).
_TABLE: list[tuple[type[BaseException], int, str, str | None]] = [
    (InvalidSamplingParamsError, 400, "invalid_request_error", "invalid_parameter"),
    (InvalidNameError, 400, "invalid_request_error", "invalid_adapter_name"),
    (SlotOutOfRangeError, 400, "invalid_request_error", "slot_out_of_range"),
    (NoAdapterPoolError, 400, "invalid_request_error", "no_adapter_pool"),
    (RuntimeSwapsDisabledError, 403, "permission_error", "runtime_swaps_disabled"),
    (UnknownAdapterError, 404, "not_found_error", "model_not_found"),
    (SlotPinnedError, 409, "conflict_error", "slot_pinned"),
    (SlotBusyError, 409, "conflict_error", "slot_busy"),
    (AdapterExistsError, 409, "conflict_error", "adapter_exists"),
    (AdapterOutsideRootError, 403, "permission_error", "adapter_outside_root"),
    (AdapterError, 422, "invalid_request_error", "invalid_adapter"),
    (AllSlotsPinnedError, 503, "service_unavailable_error", "all_slots_pinned"),
    (PoolFullError, 503, "service_unavailable_error", "pool_full"),
    (SourceBusyError, 503, "service_unavailable_error", "source_busy"),
    (PeerNotAllowedError, 403, "permission_error", "peer_not_allowed"),
    # before LandingError: a peer lost mid-landing (PeerLandingError is both) is the peer's fault
    (PeerUnavailableError, 502, "bad_gateway_error", "peer_unavailable"),
    (LandingError, 500, "internal_error", "landing_failed"),
    (SamplingError, 500, "internal_error", "sampling_failed"),
]

_SERVER_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    409: "conflict_error", 413: "invalid_request_error", 503: "service_unavailable_error",
}


def classify(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, OpenAI error type, code) for an exception."""
    if isinstance(exc, ServerError):
        return exc.status, _SERVER_TYPES.get(exc.status, "invalid_request_error"), None
    for cls, status, kind, code in _TABLE:
        if isinstance(exc, cls):
            return status, kind, code
    if isinstance(exc, MetraleError):  # e.g. "this model has no tokenizer": the request's fault
        return 400, "invalid_request_error", None
    return 500, "internal_error", None


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": public_text(message), "type": kind,
                      "param": None if param is None else public_text(param), "code": code}}


# A message names what was sent, bounded: an echo (a name, a path, a value) keeps its
# first MAX_ECHO characters, a whole message MAX_MESSAGE; a 100k-character model name
# must not come back as a 100 KB refusal.
MAX_ECHO = 100
MAX_MESSAGE = 1000
_LONG_RUN = re.compile(rf"\S{{{MAX_ECHO + 1},}}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# An absolute filesystem path: "/" at the start of a word (not inside a URL, a relative
# path or a number), up to a space, quote, bracket or separator. Our own URL routes
# (/v1/..., /peer/v1/...) are not the server's filesystem.
_ABS_PATH = re.compile(r"(?<![\w.:/~\\-])/(?!v1/|peer/v1/)[^\s'\"()\[\]{},;:]+")


def public_text(text: str) -> str:
    """`text` as a refusal may show it to a client: control characters escaped, absolute
    paths cut to their last component (the engine formats the resolved adapter path, the
    store, the cache; the client named only the last part, or sent a path it knows), each
    long run of non-space shortened, the whole bounded, and encodable as UTF-8."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    text = _ABS_PATH.sub(_last_component, text)
    text = _LONG_RUN.sub(lambda m: _cut(m[0], MAX_ECHO), text)
    return _utf8(_cut(text, MAX_MESSAGE))


def _last_component(m: re.Match) -> str:
    last = m[0].rstrip("/").rsplit("/", 1)[-1]
    return f".../{last}" if last else m[0]


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


def _utf8(text: str) -> str:
    # A message may quote the client (a JSON "\ud800" decodes to a lone surrogate);
    # UTF-8 cannot encode that, and the refusal itself would fail with a 500.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def exception_body(exc: BaseException) -> tuple[int, dict]:
    status, kind, code = classify(exc)
    message = str(exc) if status < 500 or isinstance(exc, MetraleError) else "internal server error"
    return status, error_body(message, kind, getattr(exc, "param", None), code)
