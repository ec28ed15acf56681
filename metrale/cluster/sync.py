"""A replica following the cluster registry, level-triggered like a Kubernetes controller:
each poll brings the whole desired state and the engine is made to match it, so a restarted
replica needs no replay log. The ingress validated the files once: registrations are `checked`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from metrale.cluster.registry import POLL_S
from metrale.engine.registry import AdapterVersion
from metrale.engine.residency import Residence
from metrale.errors import MetraleError, UnknownAdapterError
from metrale.server.async_engine import AsyncEngine

log = logging.getLogger("metrale.cluster")


class RegistrySync:
    def __init__(self, engine: AsyncEngine, poll: Callable, beat: Callable) -> None:
        """poll(applied, resident, errors) -> awaitable of (state_version, desired, others):
        the registry actor's poll, bound to this replica; beat() -> awaitable: its
        heartbeat, sent while a long reconcile keeps the next poll from happening (the
        registry would count the replica dead and stop waiting for it)."""
        self.engine, self._poll, self._beat = engine, poll, beat
        self.applied_version = -1
        self.applied: dict[str, AdapterVersion] = {}
        self.errors: dict[str, str] = {}
        self.others: dict[str, tuple[str | None, dict[str, int]]] = {}
        self.resident: dict[str, int] = {}  # as last reported
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    async def _beat_loop(self) -> None:
        while not self._stop:
            with contextlib.suppress(Exception):  # the registry restarting: the next poll reports
                await self._beat()
            await asyncio.sleep(POLL_S)

    async def run(self) -> None:
        beats = asyncio.create_task(self._beat_loop())  # noqa: F841 - lives as long as run()
        while not self._stop:
            try:
                self.resident = await self._resident()
                version, desired, others = await self._poll(
                    self.applied_version, self.resident, dict(self.errors))
                self.others = others
                if version != self.applied_version:
                    await self.reconcile(desired)
                    self.applied_version = version
            except Exception:  # the registry restarting, a dying engine: try again
                log.exception("cluster sync failed; retrying")
                await asyncio.sleep(1.0)

    async def _resident(self) -> dict[str, int]:
        """READY adapters of this engine -> the cluster version each one is."""
        return {r.name: self.applied[r.name].version for r in await self.engine.rows()
                if r.registered and r.state is Residence.READY and r.name in self.applied}

    async def reconcile(self, desired: dict[str, AdapterVersion]) -> None:
        for name in sorted(set(self.applied) - set(desired)):
            await self._apply(name, self._unload(name))
        for name, want in sorted(desired.items()):
            have = self.applied.get(name)
            if have is None or have.version != want.version:
                await self._apply(name, self._register(want, reload=have is not None))
            elif have.pinned != want.pinned:
                await self._apply(name, self._pin(want))

    async def _apply(self, name: str, change) -> None:
        try:
            await change
            self.errors.pop(name, None)
        except MetraleError as e:  # reported to the registry; the next change retries
            log.warning("cluster sync: %s on %r: %s", type(e).__name__, name, e)
            self.errors[name] = f"{type(e).__name__}: {e}"

    async def _unload(self, name: str) -> None:
        self.applied.pop(name, None)
        with contextlib.suppress(UnknownAdapterError):
            await self.engine.unload(name)

    async def _register(self, want: AdapterVersion, reload: bool) -> None:
        ops = self.engine.ops
        reload = reload or await self.engine.is_known(want.name)
        await self.engine.call(lambda: ops.register(want.name, want.source, False, reload, None))
        self.applied[want.name] = want
        if want.pinned:
            await self.engine.pin(want.name, True)  # reads the bytes off the engine thread

    async def _pin(self, want: AdapterVersion) -> None:
        await self.engine.pin(want.name, want.pinned)
        self.applied[want.name] = want
