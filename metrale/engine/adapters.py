"""Adapter registry and on-demand promotion for the engine.

A request for a registered adapter that is not resident waits here until a
promotion lands it. Promotions are single-flight per name (every waiter of a
name shares one) and run FIFO by first request; a full pool makes them wait
for a slot to drain, up to a timeout. Waiters take their slot reference the
moment the adapter lands, so it cannot be evicted before they run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from metrale.adapters.plan import plan_adapter
from metrale.engine.sequence import Sequence
from metrale.errors import MetraleError, PoolFullError, UnknownAdapterError
from metrale.pool.swap import LoraSlots, validate_adapter_name

log = logging.getLogger("metrale.engine")


@dataclass(frozen=True)
class AdapterSource:
    name: str
    path: Path
    pinned: bool = False


class AdapterManager:
    def __init__(self, slots: LoraSlots, timeout_s: float) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self.registry: dict[str, AdapterSource] = {}
        self.pending: OrderedDict[str, list[Sequence]] = OrderedDict()
        self.num_promotions = 0

    def register(self, name: str, path: str | Path, pinned: bool = False) -> AdapterSource:
        """Validate the adapter now (clear errors at registration, not at first use)."""
        validate_adapter_name(name)
        plan_adapter(path, name, self.slots.model_config, self.slots.pool_config)
        source = AdapterSource(name, Path(path), pinned)
        self.registry[name] = source
        return source

    def check_known(self, name: str | None) -> None:
        if name is not None and name not in self.registry and self.slots.table.slot_of(name) is None:
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
        if self.slots.table.slot_of(seq.adapter) is not None:
            seq.slot, seq.adapter_uid = self.slots.table.acquire(seq.adapter)
            seq.bound = True
            return True
        self.check_known(seq.adapter)
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

    def run_promotions(self) -> list[Sequence]:
        """Promote waited-for adapters in FIFO order; returns sequences that failed."""
        failed = []
        for name in list(self.pending):
            source = self.registry.get(name)
            if source is None:  # unregistered while requests waited
                failed += self._fail(name, UnknownAdapterError(f"adapter {name!r} was unloaded"))
                continue
            try:
                start = time.perf_counter()
                slot, evicted = self.slots.promote_lora_slot_from_disk(source.path, name)
            except PoolFullError:
                break  # wait for a slot to drain; later names must not jump the queue
            except MetraleError as e:
                failed += self._fail(name, e)
                continue
            self.num_promotions += 1
            log.info("promoted %r into slot %d (evicted %r) in %.1f ms for %d waiting request(s)",
                     name, slot, evicted, (time.perf_counter() - start) * 1e3,
                     len(self.pending[name]))
            self.bind_waiters(name)
        return failed

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
