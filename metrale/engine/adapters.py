"""AdapterManager: binds requests to adapter slots and decides what to promote (names
belong to the AdapterRegistry, slot policy to the SlotTable, landings to the Promoter).
A request takes a reference on its adapter's slot, or waits for a promotion (FIFO by first
request, one per name); waiters take theirs the moment it lands, so it cannot be evicted
before they run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from metrale.config import EngineConfig
from metrale.engine.promotion import Phase, Promoter, Promotion
from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion
from metrale.engine.sequence import Sequence
from metrale.errors import (
    AdapterError,
    MetraleError,
    PoolFullError,
    StaleVersionError,
    UnknownAdapterError,
)
from metrale.pool.slots import SlotState
from metrale.pool.swap import LoraSlots, Prepared

log = logging.getLogger("metrale.engine")
REFUSAL_S = 30.0  # a source file refused at a landing is not read again before this


class AdapterManager:
    def __init__(self, slots: LoraSlots, registry: AdapterRegistry, cfg: EngineConfig) -> None:
        self.slots, self.registry, self.timeout_s = slots, registry, cfg.promotion_timeout_s
        self.max_in_flight = cfg.scheduler.max_promotions_in_flight
        self.promoter = Promoter(slots, registry, cfg)
        self.pending: OrderedDict[str, list[Sequence]] = OrderedDict()
        self.job: Promotion | None = None
        self.num_promotions = 0
        self.num_drains = 0  # busy slots unrouted so that a landing can take them
        self.num_reattached = 0  # drains undone: a request for that adapter came first
        # slot -> work left on it (tokens its requests may still compute); the engine sets it
        self.remaining_work: Callable[[], dict[int, int]] = dict
        # requests whose adapter was resident on arrival vs those that waited for a landing
        self.num_ready_on_arrival = self.num_waited_for_adapter = 0

    # --- binding requests -----------------------------------------------------------------

    def bind(self, seq: Sequence) -> None:
        if seq.adapter is None:  # the base model: slot -1, uid 0 (Sequence's defaults)
            seq.bound, seq.bound_at = True, seq.arrival
            return
        version = self.registry.current(seq.adapter)
        refused = self.registry.refusal(version, time.monotonic())
        if refused is not None:  # one error for many requests: its traceback must not grow
            raise refused.with_traceback(None)
        slot = self._route(version)
        if slot is not None:
            seq.slot, seq.adapter_uid = slot, self.slots.table.acquire(slot)
            seq.bound, seq.bound_at = True, seq.arrival
            self.num_ready_on_arrival += 1
            return
        self.num_waited_for_adapter += 1
        self.pending.setdefault(seq.adapter, []).append(seq)

    def _route(self, version: AdapterVersion) -> int | None:
        """The slot serving `version`; a slot still holding it but drained is routed again."""
        slot = self.registry.slot_of(version.name)
        if slot is not None:
            return slot
        table = self.slots.table
        for info in table.infos():
            if table.holds(info.slot, version.version) and self.registry.route(version, info.slot):
                self.num_reattached += 1
                return info.slot
        return None

    def release(self, seq: Sequence) -> None:
        if seq.bound and seq.slot >= 0:
            self.slots.table.release(seq.slot)
        seq.bound = False
        waiters = self.pending.get(seq.adapter or "")
        if waiters and seq in waiters:
            waiters.remove(seq)
            if not waiters:
                del self.pending[seq.adapter]

    def _bind_waiters(self, name: str, slot: int) -> None:
        now = time.monotonic()
        for seq in self.pending.pop(name, []):
            seq.slot, seq.adapter_uid = slot, self.slots.table.acquire(slot)
            seq.bound, seq.bound_at = True, now

    # --- explicit promotions (run inline) --------------------------------------------------

    def promote(self, version: AdapterVersion, slot: int | None = None,
                prepared: Prepared | None = None, origin: AdapterSource | None = None,
                installs: bool = False) -> tuple[int, str | None]:
        """Land `version` into `slot` (None: the promoter chooses). installs: a new version,
        current from its commit on. `prepared`: bytes already read, closed here; `origin`:
        where they came from when not the version's source (a neighbour's slot)."""
        p = self.promoter.run_inline(version, target=slot, installs=installs, prepared=prepared,
                                     origin=origin)
        self._bind_waiters(p.name, p.slot)
        return p.slot, p.evicted

    # --- names leaving ----------------------------------------------------------------------

    def unload(self, name: str) -> str:
        """'unloaded', or 'draining' until the slot's last in-flight request ends."""
        slot = self.registry.slot_of(name)
        busy = slot is not None and self.slots.table.ref_count(slot) > 0
        self.registry.unload(name, slot if busy else None)
        if busy:
            return "draining"
        if slot is not None:
            self.slots.unload_slot(slot)
        return "unloaded"

    def finish_unloads(self) -> None:
        table, routed = self.slots.table, self.registry.routed_slots()
        for name, slot in self.registry.draining().items():
            info = table.info(slot)
            if info.ref_count:
                continue
            if info.state is SlotState.READY and slot not in routed:  # not taken meanwhile
                self.slots.unload_slot(slot)
            self.registry.drained(name)

    # --- on-demand promotions (the engine calls these between steps) ---------------------

    def promoting(self) -> str | None:
        """The name whose promotion is moving off the engine thread (worth waiting for)."""
        job = self.job
        return job.name if job is not None and job.progressing else None

    def advance(self, now: float) -> list[Sequence]:
        """Move promotions on; returns the sequences that failed."""
        failed = self._advance_job()
        for _ in range(self.max_in_flight):
            # a host-tier landing completes inline, so the next name can start at once;
            # one that reads from disk or a peer stays in flight
            if self.job is not None:
                break
            started = self._start_next()
            failed += started
            if self.job is None and not started:
                break  # nothing could start
            failed += self._advance_job()
        self._drain_for_waiting()
        return failed + self._expire(now)

    def _start_next(self) -> list[Sequence]:
        failed = []
        # names to promote, oldest wait first; then pinned names whose reloaded version
        # waits for their own slot with no request yet
        held = [n for n in self.registry.names()
                if self.registry.held_slot(n) is not None and n not in self.pending]
        for name in list(self.pending) + held:
            version = self.registry.get(name)
            if version is None:
                failed += self._fail(name, UnknownAdapterError(f"adapter {name!r} was unloaded"))
                continue
            slot = self._route(version)
            if slot is not None:  # landed meanwhile by an explicit operation
                self._bind_waiters(name, slot)
                continue
            held = self.registry.held_slot(name)
            if held is not None and self.slots.table.ref_count(held):
                continue  # a pinned name's new version waits for its own slot to drain
            try:
                self.slots.require_swappable("promote")
            except MetraleError as e:
                failed += self._fail(name, e)
                continue
            self.job = self.promoter.start(version)
            return failed
        return failed

    def _advance_job(self) -> list[Sequence]:
        job = self.job
        if job is None:
            return []
        if job.phase is Phase.READING and not job.read.done():
            return []
        if job.phase is not Phase.WRITING and job.name not in self.pending \
                and self.registry.held_slot(job.name) is None:
            self.job = None  # abandoned (its requests left) before touching a slot
            self.promoter.abandon(job)
            return []
        self.promoter.advance(job)
        if not job.done:
            return []
        self.job = None
        if job.phase is Phase.COMMITTED:
            self.num_promotions += 1
            self._bind_waiters(job.name, job.slot)
            return []
        if isinstance(job.error, StaleVersionError):
            return []  # superseded: its waiters wait for the version now current
        if job.origin.verify_on_landing and isinstance(job.error, AdapterError):
            # its file's fault: reading and checking it again soon would be refused again
            self.registry.refuse(job.version, job.error, time.monotonic() + REFUSAL_S)
        return self._fail(job.name, job.error)

    def _drain_for_waiting(self) -> None:
        """Names waiting while every slot is busy: unroute the busy slot with the least work
        left, so it drains instead of being fed by new arrivals forever (up to max_in_flight
        slots free or draining). A request for its adapter that comes first reroutes it."""
        job = self.job
        writing = job is not None and job.phase is Phase.WRITING
        waiting = len(self.pending) - (1 if writing and job.name in self.pending else 0)
        if waiting <= 0:
            return
        table, registry = self.slots.table, self.registry
        pinned = registry.pinned_slots()
        need = min(waiting, self.max_in_flight) - table.num_free_for_landing(
            pinned, registry.routed_slots())
        work = self.remaining_work() if need > 0 else {}
        for _ in range(need):
            slot = table.drain_candidate(work, registry.routed_slots() - pinned)
            if slot is None:
                return
            registry.unroute(registry.name_in(slot))
            self.num_drains += 1

    def _expire(self, now: float) -> list[Sequence]:
        """Waiters past the promotion timeout fail with POOL_FULL (a promotion in flight
        is bounded by its own I/O deadlines)."""
        failed = []
        promoting = self.promoting()
        for name, waiters in list(self.pending.items()):
            if name == promoting:
                continue
            late = [s for s in waiters if now - s.arrival > self.timeout_s]
            for seq in late:
                waiters.remove(seq)
                seq.error = PoolFullError(
                    f"POOL_FULL: waited {self.timeout_s:.0f}s for an adapter slot for {name!r}: "
                    "every cache slot stayed busy or pinned; retry later")
            failed += late
            if not waiters:
                del self.pending[name]
        return failed

    def _fail(self, name: str, error: BaseException) -> list[Sequence]:
        waiters = self.pending.pop(name, [])
        for seq in waiters:
            seq.error = error
        log.warning("promotion of %r failed for %d request(s): %s", name, len(waiters), error)
        return waiters
