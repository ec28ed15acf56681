"""Adapter management as the server sees it. Every method here runs on the engine
thread, between steps (AsyncEngine.call): it asks the engine's registry and slot table
and turns their answers into views. Reading adapter bytes happens before, off the engine
thread (AsyncEngine), and arrives here as a `Prepared`.

Unload never waits for a busy slot: the name leaves the registry at once (and admission
refuses it), and the slot is freed after the step that finishes its last in-flight request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from metrale.engine.llm_engine import LLMEngine
from metrale.engine.registry import AdapterSource
from metrale.engine.sampling_params import SamplingParams
from metrale.errors import RuntimeSwapsDisabledError
from metrale.pool.slots import SlotInfo
from metrale.pool.swap import Prepared
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
    state: str  # READY | LOADING | EMPTY (slot states) or DISK
    ref_count: int
    last_used: int | None
    unloading: bool
    version: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class AdapterOps:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.table = engine.lora.table
        self.registry = engine.registry
        self._waiting_ids: set[str] = set()
        self._counted: dict[str, int] = {}

    # --- requests -------------------------------------------------------------------

    def admit(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
              request_id: str) -> str:
        return self.engine.add_request(prompt, params, adapter, request_id)

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
        """`source` was validated off the engine thread. An existing name is refused unless
        reload: then requests in flight finish on the old version, later ones get the new."""
        self.check_register(name, reload)
        self.engine.register_adapter(name, source, pinned=pinned, reload=reload, checked=True,
                                     prepared=prepared)
        return self.view(name)

    def is_resident(self, name: str) -> bool:
        self.registry.changeable(name)
        return self.registry.slot_of(name) is not None

    def promote(self, name: str, prepared: Prepared | None) -> tuple[AdapterView, str | None]:
        """Make `name` resident; a resident adapter only gets its recency refreshed."""
        version = self.registry.changeable(name)
        slot = self.registry.slot_of(name)
        if slot is not None:
            self.table.touch(slot)
            return self.view(name), None
        _, evicted = self.engine.land(version, None, prepared)
        return self.view(name), evicted

    def swap(self, name: str, slot: int, source: AdapterSource | None, reload: bool,
             prepared: Prepared | None) -> AdapterView:
        """Land `name` into `slot`: its registered version, or `source` as a new
        registration (an existing name only when reload)."""
        if source is None:
            self.engine.land(self.registry.changeable(name), slot, prepared)
        else:
            self.registry.check_new(name, reload)
            self.engine.swap_lora_slot_from_disk(source.path, name, slot, prepared)
        return self.view(name)

    def set_pinned(self, name: str, pinned: bool, prepared: Prepared | None) -> AdapterView:
        self.registry.refuse_draining(name)
        self.engine.pin_adapter(name, pinned, prepared)
        return self.view(name)

    def unload(self, name: str) -> str:
        """'unloaded' when the slot (if any) is free now, 'draining' when it is freed later."""
        self.registry.refuse_draining(name)
        result = self.engine.unload_adapter(name)
        log.info("%s", kv(event="unload", adapter=name, result=result))
        return result

    def source_of(self, name: str) -> AdapterSource:
        return self.registry.changeable(name).source

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
        self.metrics.slot_drains.inc(adapters.num_drains - self._counted.get("drains", 0))
        self._counted["drains"] = adapters.num_drains
        depth: dict[str, int] = {}  # the queue holds those waiting for a landing too
        for seq in scheduler.waiting:
            if seq.adapter is not None:
                depth[seq.adapter] = depth.get(seq.adapter, 0) + 1
        self.metrics.adapter_queue.clear()
        for name, n in depth.items():
            self.metrics.adapter_queue.labels(name).set(n)
        self._vllm_gauges(scheduler, adapters)

    def _count(self, residency: str, total: int) -> None:
        """Counters the engine keeps as totals, moved by their increase since last time."""
        self.metrics.adapter_requests.labels(residency).inc(total - self._counted.get(residency, 0))
        self._counted[residency] = total

    def _vllm_gauges(self, scheduler, adapters) -> None:
        """Running = adapters of scheduled sequences; waiting = adapters of queued ones, those
        waiting for a promotion included (both sets kept apart, as vLLM reports them)."""
        running = [s.adapter for s in scheduler.running if s.adapter]
        waiting = [s.adapter for s in scheduler.waiting if s.adapter]  # pending ones too
        blocks = self.engine.blocks
        used = 1.0 - blocks.num_free / blocks.num_blocks if blocks.num_blocks else 0.0
        self.metrics.set_vllm(running, waiting, self.engine.lora.pool_config.max_loras,
                              len(scheduler.running), len(scheduler.waiting), used)

    # --- views ------------------------------------------------------------------------

    def view(self, name: str, infos: list[SlotInfo] | None = None) -> AdapterView:
        infos = infos if infos is not None else self.table.infos()
        version = self.registry.get(name)
        draining = self.registry.draining()
        slot = self.registry.slot_of(name)
        if slot is None and name in draining:
            slot = draining[name]
        info = infos[slot] if slot is not None else None
        return AdapterView(
            name=name, path=str(version.source) if version else None,
            pinned=bool(version and version.pinned),
            slot=slot, uid=info.uid if info else None,
            state=info.state.value if info else "DISK",
            ref_count=info.ref_count if info else 0,
            last_used=info.last_used if info else None,
            unloading=name in draining,
            version=version.version if version else None,
        )

    def snapshot(self) -> dict:
        """Every adapter (registered or still draining) and every slot, consistently."""
        infos = self.table.infos()
        names = sorted(set(self.registry.names()) | set(self.registry.draining()))
        pinned = self.registry.pinned_slots()
        return {
            "adapters": [self.view(n, infos) for n in names],
            "slots": [
                {"slot": i.slot, "name": self.registry.name_in(i.slot), "uid": i.uid,
                 "generation": i.generation, "version": i.version,
                 "state": i.state.value, "ref_count": i.ref_count, "pinned": i.slot in pinned,
                 "last_used": i.last_used}
                for i in infos
            ],
        }
