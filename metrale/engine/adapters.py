"""Adapter registry and on-demand promotion for the engine.

A request for a registered adapter that is not resident waits here until a
promotion lands it. Promotions are single-flight per name (every waiter of a
name shares one) and run FIFO by first request; a full pool makes them wait
for a slot to drain, up to a timeout. Waiters take their slot reference the
moment the adapter lands, so it cannot be evicted before they run.

Disk promotions run off the engine thread (metrale.engine.async_promotion), one at
a time, so decoding of other requests goes on while the adapter is read and lands;
peer promotions and host-tier hits (one H2D copy) run inline.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metrale.adapters.plan import plan_adapter
from metrale.engine.async_promotion import AsyncPromoter
from metrale.engine.sequence import Sequence
from metrale.errors import AdapterConfigError, MetraleError, PoolFullError, UnknownAdapterError
from metrale.pool.swap import LoraSlots, validate_adapter_name

log = logging.getLogger("metrale.engine")


PEER_SCHEME = "peer://"


@dataclass(frozen=True)
class PeerRef:
    addr: str  # host:port of a peer store or engine
    adapter_id: str

    def __str__(self) -> str:
        return f"{PEER_SCHEME}{self.addr}/{self.adapter_id}"


def parse_peer_uri(uri: str) -> PeerRef:
    """peer://host:port/ADAPTER_ID -> PeerRef."""
    rest = uri[len(PEER_SCHEME):]
    addr, sep, adapter_id = rest.partition("/")
    if not uri.startswith(PEER_SCHEME) or not sep or not addr or not adapter_id:
        raise AdapterConfigError(f"peer source {uri!r} must look like peer://host:port/ADAPTER_ID")
    return PeerRef(addr, adapter_id)


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter's bytes come from when it must be (re)promoted."""

    name: str
    path: Path | None = None
    peer: PeerRef | None = None
    pinned: bool = False

    @classmethod
    def of(cls, name: str, spec: str | Path, pinned: bool = False) -> AdapterSource:
        if isinstance(spec, str) and spec.startswith(PEER_SCHEME):
            return cls(name, peer=parse_peer_uri(spec), pinned=pinned)
        return cls(name, path=Path(spec), pinned=pinned)


class AdapterManager:
    def __init__(self, slots: LoraSlots, timeout_s: float,
                 promote_from_peer: Callable[[PeerRef, str], tuple[int, str | None]],
                 async_promotions: bool = True) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self.promoter = AsyncPromoter(slots) if async_promotions and slots.pool else None
        self._promote_from_peer = promote_from_peer
        self.registry: dict[str, AdapterSource] = {}
        self.pending: OrderedDict[str, list[Sequence]] = OrderedDict()
        self.num_promotions = 0

    def register(self, name: str, spec: str | Path, pinned: bool = False) -> AdapterSource:
        """Validate a disk adapter now (clear errors at registration, not at first
        use); a peer's manifest is validated when it lands."""
        validate_adapter_name(name)
        source = AdapterSource.of(name, spec, pinned)
        if source.path is not None:
            plan_adapter(source.path, name, self.slots.model_config, self.slots.pool_config)
        self.registry[name] = source
        return source

    def promote(self, source: AdapterSource) -> tuple[int, str | None]:
        if source.peer is not None:
            return self._promote_from_peer(source.peer, source.name)
        return self.slots.promote_lora_slot_from_disk(source.path, source.name)

    def check_known(self, name: str | None) -> None:
        # the registry, not residency, decides: an unregistered (unloading) name admits nothing
        if name is not None and name not in self.registry:
            raise UnknownAdapterError(
                f"adapter {name!r} is not registered; register it first "
                f"(known: {', '.join(sorted(self.registry)) or 'none'})"
            )

    # --- binding sequences to slots ------------------------------------------------

    def bind(self, seq: Sequence) -> bool:
        """Bind seq to its adapter's slot if resident; else queue it for promotion."""
        if seq.adapter is None:
            seq.slot, seq.adapter_uid, seq.bound = -1, 0, True
            return True
        self.check_known(seq.adapter)
        if self.slots.table.slot_of(seq.adapter) is not None:
            seq.slot, seq.adapter_uid = self.slots.table.acquire(seq.adapter)
            seq.bound = True
            return True
        self.pending.setdefault(seq.adapter, []).append(seq)
        return False

    def release(self, seq: Sequence) -> None:
        if seq.bound and seq.slot >= 0:
            self.slots.table.release(seq.slot)
        seq.bound = False
        waiters = self.pending.get(seq.adapter or "")
        if waiters and seq in waiters:
            waiters.remove(seq)
            if not waiters:
                del self.pending[seq.adapter]

    def bind_waiters(self, name: str) -> None:
        for seq in self.pending.pop(name, []):
            seq.slot, seq.adapter_uid = self.slots.table.acquire(name)
            seq.bound = True

    # --- promotions (called by the engine between steps) -----------------------------

    @property
    def promoting(self) -> str | None:
        """The name whose disk promotion is in flight (its waiters wait for bytes, not
        for a slot), if any."""
        if not self.promotion_busy():  # a staged promotion waiting for a victim is POOL_FULL
            return None
        name = self.promoter.job.name
        return name if name in self.pending else None

    def promotion_busy(self) -> bool:
        """A promotion is progressing off the engine thread (worth waiting for when
        there is nothing else to run)."""
        return self.promoter is not None and self.promoter.busy

    def wait_promotion(self, timeout: float) -> None:
        if self.promoter is not None:
            self.promoter.wait(timeout)

    def run_promotions(self) -> list[Sequence]:
        """Promote waited-for adapters in FIFO order; returns sequences that failed."""
        failed = self._advance_async() if self.promoter is not None else []
        for name in list(self.pending):
            source = self.registry.get(name)
            if source is None:  # unregistered while requests waited
                failed += self._fail(name, UnknownAdapterError(f"adapter {name!r} was unloaded"))
                continue
            if self.slots.table.slot_of(name) is not None:  # landed meanwhile by an explicit op
                self.bind_waiters(name)
                continue
            if self._inline(source):
                try:
                    start = time.perf_counter()
                    slot, evicted = self.promote(source)
                except PoolFullError:
                    break  # wait for a slot to drain; later names must not jump the queue
                except MetraleError as e:
                    failed += self._fail(name, e)
                    continue
                self._landed(name, slot, evicted, start)
                continue
            if self.promoter.job is None:
                try:
                    self.promoter.start(name, source.path)
                except MetraleError as e:
                    failed += self._fail(name, e)
                    continue
            break  # one disk promotion at a time; later names keep their place
        return failed

    def _inline(self, source: AdapterSource) -> bool:
        p = self.promoter
        return (source.peer is not None or p is None
                or (p.job is None and p.tier_hit(source.path)))

    def _landed(self, name: str, slot: int, evicted: str | None, start: float) -> None:
        self.num_promotions += 1
        log.info("promoted %r into slot %d (evicted %r) in %.1f ms for %d waiting request(s)",
                 name, slot, evicted, (time.perf_counter() - start) * 1e3,
                 len(self.pending.get(name, [])))
        self.bind_waiters(name)

    def _advance_async(self) -> list[Sequence]:
        """Move the in-flight disk promotion on by what has happened since the last
        step boundary; returns the sequences its refusal failed."""
        p = self.promoter
        job = p.job
        if job is None:
            return []
        source = self.registry.get(job.name)
        superseded = (source is None or source.path != job.path
                      or self.slots.table.slot_of(job.name) is not None)
        wanted = job.name in self.pending and not superseded
        if job.slot is None:  # nothing touched yet
            if not job.staged:
                return []
            if not wanted:  # never lands behind the back of callers that gave up
                p.clear()
                return []
            try:
                p.launch()
            except PoolFullError:
                return []  # keep the staged bytes; wait for a slot to drain
            except MetraleError as e:
                p.notify(job, None, None, e)
                p.clear()
                return self._fail(job.name, e)
        if not p.landed():
            return []
        try:
            # every waiter gone but nothing superseded: the slot just becomes READY and idle
            landed = p.finish(keep=not superseded)
        except MetraleError as e:
            return self._fail(job.name, e)
        if landed is not None:
            self._landed(job.name, *landed, job.start)
        return []

    def expire(self, now: float) -> list[Sequence]:
        """Waiters past the promotion timeout fail with POOL_FULL."""
        failed = []
        for name, waiters in list(self.pending.items()):
            late = [s for s in waiters if now - s.arrival > self.timeout_s]
            for seq in late:
                waiters.remove(seq)
                seq.error = PoolFullError(
                    f"POOL_FULL: waited {self.timeout_s:.0f}s for a free adapter slot for "
                    f"{name!r}; every cache slot stayed busy; retry later"
                )
            failed += late
            if not waiters:
                del self.pending[name]
        return failed

    def _fail(self, name: str, error: Exception) -> list[Sequence]:
        waiters = self.pending.pop(name, [])
        for seq in waiters:
            seq.error = error
        log.warning("promotion of %r failed for %d request(s): %s", name, len(waiters), error)
        return waiters
