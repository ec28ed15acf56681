"""EngineAPI: everything the HTTP routes know of an engine, implemented by the single
engine (async_engine.AsyncEngine) and the cluster (cluster/ingress.py's ClusterEngine).
Refusals are the typed errors of metrale.errors (server/errors.py maps their classes to
status codes); every method may also raise EngineUnavailableError once the engine stopped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from metrale.adapters.confined import ConfinedDir
from metrale.engine.outputs import RequestOutput
from metrale.engine.registry import AdapterSource
from metrale.engine.sampling_params import SamplingParams
from metrale.server.errors import EngineUnavailableError
from metrale.server.metrics import ServerMetrics
from metrale.server.settings import ServerSettings


@dataclass(frozen=True)
class EngineLimits:
    max_seq_tokens: int  # prompt plus output tokens of one sequence
    vocab_size: int  # token ids are in [0, vocab_size)


class AdapterView(Protocol):
    """One adapter as /v1/adapters and /v1/models show it."""

    name: str
    path: str | None  # its registered source; None while draining
    version: int | None
    pinned: bool
    slot: int | None  # None: in no slot (a cluster: per replica only)
    uid: int | None
    state: str  # READY | LOADING | DISK (in no slot)
    ref_count: int
    last_used: int | None
    unloading: bool  # unloaded, its slot still serving in-flight requests

    def as_dict(self) -> dict: ...


@dataclass(frozen=True)
class AdapterListing:
    adapters: list[AdapterView]  # registered and still-draining adapters, by name
    slots: Any  # JSON: the slot table, or one per replica


@runtime_checkable
class EngineAPI(Protocol):
    metrics: ServerMetrics
    alive: bool  # False once stopped or failed; `error` then says why, if it failed
    error: BaseException | None
    tokenizer: Any  # the base model's (every adapter shares it); None if it has none
    limits: EngineLimits | None  # None while a cluster's replicas start (known_limits: 503)

    def start(self) -> None:
        """Start serving (the app's lifespan calls it)."""

    async def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Refuse new work now, let running requests finish for up to drain_timeout_s,
        then fail the rest with EngineUnavailableError."""

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs until it finishes; leaving early aborts it.
        Raises UnknownAdapterError, InvalidSamplingParamsError (admission), PoolFullError
        (no slot within the promotion timeout), AdapterError / LandingError /
        PeerUnavailableError (its adapter failed to land), SamplingError."""

    async def register(self, name: str, path: str | Path | ConfinedDir | AdapterSource,
                       pinned: bool = False,
                       reload: bool = False, verify_on_landing: bool = False) -> AdapterView:
        """Register `path` (a directory or peer:// URI, or an AdapterSource: a directory
        confined to its root) as `name`; pinned lands it now.
        verify_on_landing: a directory's weights are not read now but checked when it first
        lands (AdapterSource.verify_on_landing; an engine may check them now instead).
        Raises InvalidNameError, AdapterExistsError (not reload), SlotBusyError (name
        draining), RuntimeSwapsDisabledError, AdapterError (bad files), PeerNotAllowedError,
        PeerUnavailableError, PoolFullError (pinned, no slot)."""

    async def promote(self, name: str) -> tuple[AdapterView, str | None]:
        """Make `name` resident now: (its view, the adapter evicted for it or None).
        Raises UnknownAdapterError, SlotBusyError (draining), PoolFullError, AdapterError."""

    async def swap(self, name: str, slot: int,
                   path: str | Path | ConfinedDir | AdapterSource | None = None,
                   reload: bool = False) -> AdapterView:
        """Land `name` into `slot`: its registered version, or `path` as a new registration.
        Raises SlotOutOfRangeError, SlotBusyError, SlotPinnedError, UnknownAdapterError,
        AdapterExistsError, AdapterError."""

    async def pin(self, name: str, pinned: bool = True) -> AdapterView:
        """Pin (landing it now if in no slot) or unpin `name`. Raises UnknownAdapterError,
        SlotBusyError (draining), PoolFullError, AdapterError."""

    async def unload(self, name: str) -> str:
        """'unloaded', or 'draining' while its slot still serves in-flight requests.
        Raises UnknownAdapterError, SlotBusyError (already draining)."""

    async def is_known(self, name: str) -> bool:
        """`name` is registered (a draining name is not)."""

    async def residency(self) -> AdapterListing:
        """Every adapter and every slot, read at one moment."""

    async def exposition(self) -> bytes:
        """The Prometheus text for /metrics (a cluster adds its replicas' vLLM series)."""

    async def starting(self) -> str | None:
        """What serving still waits for (e.g. the start-up adapters), or None when ready:
        /health answers 503 until then."""

    async def reset_prefix_cache(self) -> int:
        """Drop cached prefix blocks no running request holds; returns how many."""


def known_limits(engine: EngineAPI) -> EngineLimits:
    """engine.limits, or EngineUnavailableError (503) while they are not known yet."""
    if engine.limits is None:
        raise EngineUnavailableError("the engine is starting: its limits are not known yet")
    return engine.limits


def app_context(request) -> tuple[EngineAPI, ServerSettings]:
    """The engine and the settings a route's app serves (create_app keeps them in app.state)."""
    return request.app.state.engine, request.app.state.settings
