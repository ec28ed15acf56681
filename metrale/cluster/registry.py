"""The cluster-wide adapter registry: the desired state every replica follows (sync.py;
docs/DESIGN.md, "The cluster"). Names and versions are kept by the engine's own
AdapterRegistry, so the cluster refuses exactly what one engine refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import torch

from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion
from metrale.errors import MetraleError

LIVE_S = 5.0  # a replica that has not polled for this long no longer holds changes back
POLL_S = 1.0  # a poll returns at least this often, carrying fresh residency


@dataclass
class Member:
    replica_id: str
    peer_addr: str | None = None  # host:port of its adapter exporter
    url: str | None = None  # its own HTTP server (admin, /metrics)
    applied: int = -1  # the state_version it applied last
    resident: dict[str, int] = field(default_factory=dict)  # READY adapter -> cluster version
    errors: dict[str, str] = field(default_factory=dict)  # adapter -> why it was not applied
    last_seen: float = 0.0


class ClusterRegistry:
    """Pure state; RegistryActor runs it in a Ray actor."""

    def __init__(self, reserved_names: tuple[str, ...] = (), clock=time.monotonic) -> None:
        self.names = AdapterRegistry(reserved_names)
        self.state_version = 0
        self.members: dict[str, Member] = {}
        self.started = False  # the start-up adapters are registered and applied
        self._clock = clock

    # --- changes (the ingress) ----------------------------------------------------------

    def check_new(self, name: str, reload: bool) -> None:
        self.names.check_new(name, reload)

    def register(self, name: str, source: AdapterSource, pinned: bool, reload: bool) -> int:
        self.names.register(name, source, pinned=pinned, reload=reload)
        return self._bump()

    def set_pinned(self, name: str, pinned: bool) -> int:
        self.names.set_pinned(name, pinned)
        return self._bump()

    def unload(self, name: str) -> int:
        self.names.unload(name, None)  # replicas drain their own slots
        return self._bump()

    def _bump(self) -> int:
        self.state_version += 1
        return self.state_version

    # --- reads ------------------------------------------------------------------------

    def get(self, name: str) -> AdapterVersion | None:
        return self.names.get(name)

    def desired(self) -> dict[str, AdapterVersion]:
        """Every adapter as every replica should have it."""
        return {name: self.names.get(name) for name in self.names.names()}

    def live(self) -> list[Member]:
        now = self._clock()
        return [m for m in self.members.values() if now - m.last_seen <= LIVE_S]

    def lagging(self, version: int) -> list[str]:
        """Live replicas that have not applied `version` yet."""
        return [m.replica_id for m in self.live() if m.applied < version]

    # --- replicas -----------------------------------------------------------------------

    def report(self, replica_id: str, applied: int, peer_addr: str | None, url: str | None,
               resident: dict[str, int], errors: dict[str, str]) -> None:
        m = self.members.setdefault(replica_id, Member(replica_id))
        m.applied, m.peer_addr, m.url = applied, peer_addr, url
        m.resident, m.errors, m.last_seen = dict(resident), dict(errors), self._clock()

    def beat(self, replica_id: str) -> None:
        """Alive, though busy applying a change (a pinned landing can take a while)."""
        m = self.members.get(replica_id)
        if m is not None:
            m.last_seen = self._clock()


def _result(fn, *args):
    """(True, value) or (False, typed error): a refusal crosses Ray as a value, so the
    caller re-raises the original class with its own message, no remote traceback."""
    try:
        return True, fn(*args)
    except MetraleError as e:
        return False, e


class RegistryActor:
    """The ClusterRegistry as an async Ray actor (one per cluster, named, detached)."""

    def __init__(self, reserved_names: tuple[str, ...] = ()) -> None:
        torch.set_num_threads(1)  # it only keeps state: keep torch off the replicas' cores
        self.registry = ClusterRegistry(reserved_names)
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def check_new(self, name: str, reload: bool):
        return _result(self.registry.check_new, name, reload)

    async def register(self, name: str, source: AdapterSource, pinned: bool, reload: bool):
        return self._change(self.registry.register, name, source, pinned, reload)

    async def set_pinned(self, name: str, pinned: bool):
        return self._change(self.registry.set_pinned, name, pinned)

    async def unload(self, name: str):
        return self._change(self.registry.unload, name)

    def _change(self, fn, *args):
        out = _result(fn, *args)
        self._notify()
        return out

    async def mark_started(self) -> None:
        self.registry.started = True

    async def started(self) -> bool:
        return self.registry.started

    async def get(self, name: str) -> AdapterVersion | None:
        return self.registry.get(name)

    async def poll(self, replica_id: str, applied: int, peer_addr: str | None, url: str | None,
                   resident: dict[str, int], errors: dict[str, str]):
        """Report, then wait (at most POLL_S) for a state newer than `applied`:
        (state_version, desired state, {replica_id: (peer_addr, resident)} of the others)."""
        self.registry.report(replica_id, applied, peer_addr, url, resident, errors)
        self._notify()  # waiters in wait_applied look again
        if self.registry.state_version <= applied:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), POLL_S)
        others = {m.replica_id: (m.peer_addr, dict(m.resident)) for m in self.registry.live()
                  if m.replica_id != replica_id}
        return self.registry.state_version, self.registry.desired(), others

    async def wait_applied(self, version: int, timeout_s: float) -> list[str]:
        """Wait until every live replica applied `version`; the ones still lagging."""
        deadline = time.monotonic() + timeout_s
        while (lagging := self.registry.lagging(version)) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(POLL_S, deadline - time.monotonic()))
        return lagging

    async def beat(self, replica_id: str) -> None:
        self.registry.beat(replica_id)

    async def members(self) -> list[Member]:
        return self.registry.live()
