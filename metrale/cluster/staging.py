"""Replica-to-replica staging: land an adapter from a neighbour's slot before disk.

When a replica must make an adapter resident and another live replica reports the
same cluster version READY (the registry's residency, sync.py), the bytes come from
that replica's exporter (peer/: a lease on its slot, the manifest checked against our
layout, then NIXL or HTTP), and land through the engine's ordinary checked Landing.
Any failure (the neighbour evicted it, the lease was refused, no free slot) falls
back to the engine's own on-demand promotion from disk. Every outcome is recorded,
with the source, so tests and metrics see where bytes came from.

Blocking code, run on a worker thread: it never holds the engine thread for I/O
(the peer read happens before engine.call), and works from any event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from metrale.engine.registry import AdapterSource, PeerRef
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
    def __init__(self, engine: AsyncEngine, holders: Callable[[str], list[str]],
                 timeout_s: float = 30.0) -> None:
        """holders(name): export addresses of live replicas holding this replica's
        current version of `name` READY (from the registry, via RegistrySync)."""
        self.engine, self.holders, self.timeout_s = engine, holders, timeout_s
        self._lock = threading.Lock()
        self.records: list[StagingRecord] = []

    def _call(self, fn):
        return self.engine.submit(fn).result(timeout=self.timeout_s)

    def ensure(self, name: str) -> StagingRecord:
        """Make `name` resident from a neighbour if one holds it; otherwise leave it to
        the engine's disk promotion (the request waits for it as usual)."""
        start = time.perf_counter()
        with self._lock:  # single-flight: a second caller finds it resident
            engine = self.engine.engine
            try:
                version = self._call(lambda: engine.registry.current(name))
            except MetraleError:
                return self._record(name, "none", None, start, "unknown adapter")
            if self._call(lambda: engine.registry.slot_of(name)) is not None:
                return self._record(name, "resident", None, start)
            for addr in self.holders(name):
                source = AdapterSource(peer=PeerRef(addr, name))
                try:
                    prepared = engine.read_adapter(name, source).result()
                except MetraleError as e:
                    log.info("staging %r from %s failed (%s); next", name, addr, e)
                    continue
                try:
                    self._call(lambda p=prepared, s=source: engine.land(version, None, p, origin=s))
                    return self._record(name, "peer", addr, start)
                except MetraleError as e:  # POOL_FULL, reloaded meanwhile: disk path
                    return self._record(name, "none", addr, start, f"{type(e).__name__}: {e}")
                finally:
                    if prepared is not None:  # a refused landing may not have closed it
                        prepared.close()
            return self._record(name, "none", None, start)

    def _record(self, name: str, source: str, peer: str | None, start: float,
                error: str | None = None) -> StagingRecord:
        record = StagingRecord(name, source, peer, time.perf_counter() - start, error)
        if source == "peer":
            log.info("staged %r from neighbour %s in %.1f ms", name, peer, record.seconds * 1e3)
        self.records.append(record)
        del self.records[:-1000]
        return record
