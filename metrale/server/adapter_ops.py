"""Adapter management as the server sees it, run on the engine thread between steps
(AsyncEngine.call): names and versions from the engine's registry, placement from its
residency rows, turned into views. Adapter bytes are read before, off the engine
thread, and arrive here as a `Prepared`. An unload never waits for a busy slot: the name
leaves the registry at once, and the slot is freed after its last in-flight request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from metrale.engine.llm_engine import LLMEngine
from metrale.engine.registry import AdapterSource, AdapterVersion
from metrale.engine.residency import Residence, ResidencyRow
from metrale.errors import RuntimeSwapsDisabledError, UnknownAdapterError
from metrale.pool.swap import Prepared
from metrale.server.engine_api import AdapterListing
from metrale.server.metrics import ServerMetrics, kv

log = logging.getLogger("metrale.server")


@dataclass(frozen=True)
class AdapterView:
    """One adapter and where it lives, as /v1/models and /v1/adapters show it."""

    name: str
    path: str | None
    pinned: bool
    slot: int | None  # None: on disk only
    uid: int | None
    state: str  # READY | LOADING, or DISK when in no slot
    ref_count: int
    last_used: int | None
    unloading: bool
    version: int | None = None

    @classmethod
    def of(cls, row: ResidencyRow) -> AdapterView:
        return cls(name=row.name, path=None if row.source is None else str(row.source),
                   pinned=row.pinned, slot=row.slot, uid=row.uid,
                   state="DISK" if row.state is Residence.COLD else row.state.value,
                   ref_count=row.refs, last_used=row.last_used, unloading=not row.registered,
                   version=row.version)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class AdapterOps:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.registry = engine.registry
        self._waiting_ids: set[str] = set()
        self._counted: dict[str, int] = {}
        metrics.vllm.cache_config(engine.cfg.block_size, engine.blocks.num_blocks,
                                  engine.cfg.enable_prefix_caching)

    # --- management -----------------------------------------------------------------

    def check_register(self, name: str, reload: bool) -> None:
        """The refusals of register that need no I/O, before any file is read."""
        if not self.engine.lora.pool_config.allow_runtime_swaps:
            # it could never become resident: say so now, not at its first request
            raise RuntimeSwapsDisabledError(
                "runtime swaps are disabled (--no-runtime-swaps): adapters can only be "
                "loaded at start-up (--adapter NAME=DIR)")
        self.registry.check_new(name, reload)

    def register(self, name: str, source: AdapterSource, pinned: bool, reload: bool,
                 prepared: Prepared | None) -> AdapterView:
        """`source` was validated off the engine thread, after check_register. An existing
        name is refused unless reload: then requests in flight finish on the old version,
        later ones get the new. The engine checks the name again: the registry may have
        changed since the check before the files were read."""
        self.engine.register_adapter(name, source, pinned=pinned, reload=reload, checked=True,
                                     prepared=prepared)
        return self.view(name)

    def cold_version(self, name: str) -> AdapterVersion | None:
        """The version to land for `name`, or None when it is resident (READY)."""
        version = self.registry.changeable(name)
        return None if self.row(name).state is Residence.READY else version

    def promote(self, name: str, prepared: Prepared | None) -> tuple[AdapterView, str | None]:
        """Make `name` resident; a resident adapter only gets its recency refreshed."""
        version = self.cold_version(name)
        if version is None:
            self.engine.lora.table.touch(self.row(name).slot)
            return self.view(name), None
        _, evicted = self.engine.promote(version, None, prepared)
        return self.view(name), evicted

    def swap(self, name: str, slot: int, source: AdapterSource | None, reload: bool,
             prepared: Prepared | None) -> AdapterView:
        """Land `name` into `slot`: its registered version, or `source` as a new
        registration (an existing name only when reload)."""
        if source is None:
            self.engine.promote(self.registry.changeable(name), slot, prepared)
        else:
            self.engine.swap_lora_slot_from_disk(source, name, slot, prepared, reload=reload)
        return self.view(name)

    def set_pinned(self, name: str, pinned: bool, prepared: Prepared | None) -> AdapterView:
        self.registry.refuse_draining(name)
        self.engine.pin_adapter(name, pinned, prepared)
        return self.view(name)

    def unload(self, name: str) -> str:
        """'unloaded' when the slot (if any) is free now, 'draining' when it is freed later."""
        result = self.engine.unload_adapter(name)
        log.info("%s", kv(event="unload", adapter=name, result=result))
        return result

    # --- after every step -------------------------------------------------------------

    def after_step(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.running.set(len(scheduler.running))
        # After step() every request still pending a promotion, except those of the
        # promotion in flight, is waiting for a slot to drain (POOL_FULL).
        adapters = self.engine.adapters
        promoting = adapters.promoting()
        ids = {s.request_id for name, waiters in adapters.pending.items()
               if name != promoting for s in waiters}
        self.metrics.pool_full_waits.inc(len(ids - self._waiting_ids))
        self.metrics.pool_full_waiting.set(len(ids))
        self._waiting_ids = ids
        self._count("ready", adapters.num_ready_on_arrival)
        self._count("waited", adapters.num_waited_for_adapter)
        self.metrics.slot_drains.inc(self._increase("drains", adapters.num_drains))
        vllm = self.metrics.vllm
        vllm.preemptions.inc(self._increase("preemptions", scheduler.num_preemptions))
        vllm.prompt_recomputed.inc(self._increase("recomputed", scheduler.num_recomputed_tokens))
        vllm.kv_residency(self.engine.blocks.take_residency())
        step_tokens = self._increase("launched", scheduler.num_launched_tokens)
        if step_tokens:  # one step launched at most per engine step
            vllm.iteration_tokens.observe(step_tokens)
        depth: dict[str, int] = {}  # the queue holds those waiting for a landing too
        for seq in scheduler.waiting:
            if seq.adapter is not None:
                depth[seq.adapter] = depth.get(seq.adapter, 0) + 1
        self.metrics.adapter_queue.clear()
        for name, n in depth.items():
            self.metrics.adapter_queue.labels(name).set(n)
        self._vllm_gauges(scheduler)

    def _count(self, residency: str, total: int) -> None:
        self.metrics.adapter_requests.labels(residency).inc(self._increase(residency, total))

    def _increase(self, key: str, total: int) -> int:
        """A total the engine keeps, as its increase since the last step."""
        before, self._counted[key] = self._counted.get(key, 0), total
        return total - before

    def _vllm_gauges(self, scheduler) -> None:
        """Running = adapters of scheduled sequences; waiting = adapters of queued ones, those
        waiting for a promotion included (both sets kept apart, as vLLM reports them)."""
        vllm, blocks = self.metrics.vllm, self.engine.blocks
        vllm.set_lora_info([s.adapter for s in scheduler.running if s.adapter],
                           [s.adapter for s in scheduler.waiting if s.adapter],
                           self.engine.lora.pool_config.max_loras)
        vllm.running.set(len(scheduler.running))
        vllm.waiting.set(len(scheduler.waiting))
        vllm.kv_usage.set(1.0 - blocks.num_free / blocks.num_blocks if blocks.num_blocks else 0.0)

    # --- views ------------------------------------------------------------------------

    def row(self, name: str) -> ResidencyRow:
        """The row of a registered or draining name."""
        for row in self.engine.residency():
            if row.name == name:
                return row
        raise UnknownAdapterError(f"adapter {name!r} is not registered")

    def view(self, name: str) -> AdapterView:
        return AdapterView.of(self.row(name))

    def listing(self) -> AdapterListing:
        """Every adapter (registered or still draining) and every slot, consistently."""
        rows = self.engine.residency()
        slots = sorted((r for r in rows if r.slot is not None), key=lambda r: r.slot)
        return AdapterListing(
            adapters=[AdapterView.of(r) for r in rows if r.name is not None],
            # a slot's name: the one that routes requests to it now
            slots=[{"slot": r.slot,
                    "name": r.name if r.registered and r.state is Residence.READY else None,
                    "uid": r.uid, "generation": r.generation, "state": r.state.value,
                    "ref_count": r.refs, "pinned": r.pinned, "last_used": r.last_used}
                   for r in slots],
        )
