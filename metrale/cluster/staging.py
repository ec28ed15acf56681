"""Replica-to-replica staging: land an adapter from a neighbour's slot before disk
(docs/DESIGN.md, "Staging from a neighbour"); any failure leaves it to the engine's own
disk promotion. Every outcome is recorded with its source. Runs on any event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from metrale.engine.registry import AdapterSource, PeerRef
from metrale.engine.residency import Residence
from metrale.errors import MetraleError
from metrale.server.async_engine import AsyncEngine

log = logging.getLogger("metrale.cluster")


@dataclass(frozen=True)
class StagingRecord:
    adapter: str
    source: str  # "peer" | "resident" | "none" (the disk promotion is left to the engine)
    peer: str | None  # the neighbour's export address
    seconds: float
    error: str | None = None


class PeerStager:
    def __init__(self, engine: AsyncEngine, holders: Callable[[str], list[str]]) -> None:
        """holders(name): export addresses of live replicas holding this replica's
        current version of `name` READY (from the registry, via RegistrySync)."""
        self.engine, self.holders = engine, holders
        self.records: list[StagingRecord] = []

    async def ensure(self, name: str) -> StagingRecord:
        """Make `name` resident from a neighbour if one holds it; otherwise leave it to
        the engine's disk promotion (the request waits for it as usual)."""
        start = time.perf_counter()
        rows = [r for r in await self.engine.rows() if r.registered and r.name == name]
        if not rows:
            return self._record(name, "none", None, start, "unknown adapter")
        if rows[0].state is Residence.READY:
            return self._record(name, "resident", None, start)
        holders = self.holders(name)
        if not holders:
            return self._record(name, "none", None, start)
        try:  # the engine reads one holder after another; one landing at a time
            via = await self.engine.promote_via(
                name, [AdapterSource(peer=PeerRef(addr, name)) for addr in holders])
        except MetraleError as e:  # POOL_FULL, reloaded meanwhile, no holder read: disk path
            return self._record(name, "none", None, start, f"{type(e).__name__}: {e}")
        if via is None:  # landed meanwhile (another request's staging, a promotion)
            return self._record(name, "resident", None, start)
        return self._record(name, "peer", via.peer.addr, start)

    def _record(self, name: str, source: str, peer: str | None, start: float,
                error: str | None = None) -> StagingRecord:
        record = StagingRecord(name, source, peer, time.perf_counter() - start, error)
        if source == "peer":
            log.info("staged %r from neighbour %s in %.1f ms", name, peer, record.seconds * 1e3)
        self.records.append(record)
        del self.records[:-1000]
        return record
