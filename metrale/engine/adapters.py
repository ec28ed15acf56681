"""AdapterManager: binds requests to adapter slots and decides what to promote (names
belong to the AdapterRegistry, slot policy to the SlotTable, landings to the Promoter).
A request takes a reference on its adapter's slot, or waits for a promotion; waiters take
theirs the moment it lands, so it cannot be evicted before they run.

Slots go by age (docs/DESIGN.md, "Slots at saturation"): waiting names are promoted oldest
waiter first; when no slot is free, busy slots drain for them: no new request binds there,
and their queued requests younger than the oldest waiter give their reference back and wait
too, so a slot frees once its running requests (and older queued ones) finish. No request
for a resident adapter overtakes an older one waiting for a slot, so a request waits for its
slot at most as long as the requests ahead of it take to start, plus one request's run on a
draining slot, plus its landing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

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
        self.pending: OrderedDict[str, list[Sequence]] = OrderedDict()  # waiters by arrival
        self.job: Promotion | None = None
        self.num_promotions = 0
        self.num_drains = 0  # busy slots unrouted so that a landing can take them
        self.num_reattached = 0  # drains undone: a request for that adapter came first
        self.num_unbound = 0  # queued requests that gave a draining slot back to wait
        self._bound: dict[int, dict[str, Sequence]] = {}  # slot -> the requests bound to it
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
        # a drained slot comes back for a new request only when nobody older waits
        slot = self._route(version, reattach=not self.pending)
        if slot is not None:
            self._take(seq, slot, seq.arrival)
            self.num_ready_on_arrival += 1
            return
        self.num_waited_for_adapter += 1
        seq.slot_wait_from = seq.arrival
        self.pending.setdefault(seq.adapter, []).append(seq)

    def _take(self, seq: Sequence, slot: int, now: float) -> None:
        seq.slot, seq.adapter_uid = slot, self.slots.table.acquire(slot)
        seq.bound, seq.bound_at = True, now
        self._bound.setdefault(slot, {})[seq.request_id] = seq

    def _route(self, version: AdapterVersion, reattach: bool = True) -> int | None:
        """The slot serving `version`; with reattach, a slot still holding it but drained
        is routed again."""
        slot = self.registry.slot_of(version.name)
        if slot is not None or not reattach:
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
            self._bound.get(seq.slot, {}).pop(seq.request_id, None)
        seq.bound = False
        waiters = self.pending.get(seq.adapter or "")
        if waiters and seq in waiters:
            waiters.remove(seq)
            if not waiters:
                del self.pending[seq.adapter]

    def _bind_waiters(self, name: str, slot: int) -> None:
        now = time.monotonic()
        for seq in self.pending.pop(name, []):
            self._take(seq, slot, now)

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
        # oldest waiter first; a name that needs a landing starts one and ends the turn,
        # so no younger name reattaches the slot drained for it
        for name in self._by_age() + held:
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

    def _by_age(self) -> list[str]:
        """Waiting names, the one with the oldest waiter first."""
        return sorted(self.pending, key=lambda n: min(s.arrival for s in self.pending[n]))

    def _drain_for_waiting(self) -> None:
        """Names waiting while every slot is busy: drain busy slots for them (up to one per
        waiting name), those whose drain sends fewest queued requests back first, then those
        that free soonest; at most max_in_flight of the drains that send requests back at
        once. A drained slot is unrouted, and its queued requests younger than the oldest
        waiter go back to waiting (they never ran: no KV), so it frees once its running and
        older queued requests finish."""
        job = self.job
        writing = job.name if job is not None and job.phase is Phase.WRITING else None
        waiting = [n for n in self.pending if n != writing]
        if not waiting:
            return
        table, registry = self.slots.table, self.registry
        pinned, routed = registry.pinned_slots(), registry.routed_slots()
        need = len(waiting) - table.num_free_for_landing(pinned, routed)
        if need <= 0:
            return
        oldest = min(s.arrival for n in waiting for s in self.pending[n])
        # the cost of draining each slot: the queued requests it would send back to wait
        # (a popular adapter's many: they would need it landed again), then the work that
        # keeps it busy once they leave (its running and older queued requests)
        cost = {}
        for slot in routed - pinned:
            bound = self._bound.get(slot, {}).values()
            leaving = sum(1 for s in bound if not _started(s) and s.arrival > oldest)
            staying = max((_work_left(s) for s in bound if _started(s) or s.arrival <= oldest),
                          default=0)
            cost[slot] = (leaving, staying)
        # a drain that sends requests back makes their adapter wait too: at most
        # max_in_flight such slots drain at once, or each drain would feed the next
        draining = sum(1 for i in table.infos() if i.ref_count and i.slot not in pinned
                       and i.state is SlotState.READY and i.slot not in routed)
        for _ in range(need):
            slot = table.drain_candidate(cost, set(cost))
            if slot is None or (cost[slot][0] and draining >= self.max_in_flight):
                return
            name = registry.name_in(slot)
            registry.unroute(name)
            del cost[slot]
            self.num_drains += 1
            draining += 1
            self._unbind_younger(slot, name, oldest)

    def _unbind_younger(self, slot: int, name: str, oldest: float) -> None:
        """`slot`'s queued requests that arrived after `oldest` give it back and wait."""
        bound, now = self._bound.get(slot, {}), time.monotonic()
        leaving = [s for s in bound.values() if not _started(s) and s.arrival > oldest]
        for seq in leaving:
            self.slots.table.release(slot)
            del bound[seq.request_id]
            seq.bound, seq.slot, seq.adapter_uid, seq.bound_at = False, -1, 0, None
            seq.slot_wait_from = now
        if leaving:
            waiters = self.pending.setdefault(name, [])
            waiters += leaving
            waiters.sort(key=lambda s: s.arrival)
            self.num_unbound += len(leaving)

    def _expire(self, now: float) -> list[Sequence]:
        """Waiters past the promotion timeout fail with POOL_FULL (a promotion in flight
        is bounded by its own I/O deadlines)."""
        failed = []
        promoting = self.promoting()
        for name, waiters in list(self.pending.items()):
            if name == promoting:
                continue
            late = [s for s in waiters if now - s.slot_wait_from > self.timeout_s]
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


def _started(seq: Sequence) -> bool:
    """Whether seq was ever admitted (a preempted one too: its tokens so far came from this
    version): only a request that never ran can give its slot back."""
    return seq.scheduled_at is not None


def _work_left(seq: Sequence) -> int:
    """The most tokens seq may still compute (its prompt's rest, then max_tokens)."""
    prompt = len(seq.prompt_ids)
    return prompt - min(seq.num_computed, prompt) + seq.params.max_tokens - len(seq.output_ids)
