"""Adapter management as the server sees it. Every method here runs on the
engine thread, between steps (AsyncEngine.call), so it sees and changes the
engine's registry and slot table without locks.

Unload never waits for a busy slot: the name leaves the registry at once (and
admission refuses it), and the slot is freed after the step that finishes its
last in-flight request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from metrale.engine.adapters import AdapterSource
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampling_params import SamplingParams
from metrale.errors import RuntimeSwapsDisabledError, SlotBusyError, UnknownAdapterError
from metrale.pool.slots import SlotInfo
from metrale.pool.swap import validate_adapter_name
from metrale.server.errors import AdapterExistsError
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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class AdapterOps:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.table = engine.lora.table
        self.registry: dict[str, AdapterSource] = engine.adapters.registry
        self.draining: dict[str, int] = {}  # name -> slot still serving its in-flight requests
        self._waiting_ids: set[str] = set()

    # --- requests -------------------------------------------------------------------

    def admit(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
              request_id: str) -> str:
        if adapter is not None and adapter in self.draining:
            # resident but leaving: the engine would still bind to it
            raise UnknownAdapterError(f"adapter {adapter!r} is being unloaded")
        return self.engine.add_request(prompt, params, adapter, request_id)

    # --- management -----------------------------------------------------------------

    def register(self, name: str, path: str | Path, pinned: bool = False,
                 reload: bool = False) -> AdapterView:
        """Validate and register `name`. An existing name is refused unless reload:
        then a resident adapter is re-landed from the new files (new uid; its old
        slot finishes its in-flight requests on the old weights)."""
        validate_adapter_name(name)
        self._refuse_draining(name)
        if not self.engine.lora.pool_config.allow_runtime_swaps:
            # it could never become resident: say so now, not at its first request
            raise RuntimeSwapsDisabledError(
                "runtime swaps are disabled (--no-runtime-swaps): adapters can only be "
                "loaded at start-up (--adapter NAME=DIR)")
        old_slot = self.table.slot_of(name)
        if not reload and (name in self.registry or old_slot is not None):
            raise AdapterExistsError(
                f"adapter {name!r} is already registered; unload it first or reload it in place", "name")
        previous = self.registry.get(name)
        self.engine.register_adapter(name, path, pinned=False)  # validates the files
        if old_slot is not None:
            was_pinned = self.table.info(old_slot).pinned
            try:
                self.engine.promote_registered(name)
            except Exception:
                if previous is not None:  # the old files still serve the name
                    self.registry[name] = previous
                raise
            self.table.set_pinned(old_slot, False)  # detached now: cache space once drained
            pinned = pinned or was_pinned
        if pinned:
            return self.set_pinned(name, True)
        return self.view(name)

    def promote(self, name: str) -> tuple[AdapterView, str | None]:
        """Make `name` resident; a resident adapter only gets its recency refreshed."""
        self._source(name)
        slot = self.table.slot_of(name)
        if slot is not None:
            self.table.touch(slot)
            return self.view(name), None
        _, evicted = self.engine.promote_registered(name)
        return self.view(name), evicted

    def swap(self, name: str, slot: int, path: str | Path | None = None) -> AdapterView:
        """Land `name` into `slot` (from `path`, else from its registered source)."""
        validate_adapter_name(name)
        self._refuse_draining(name)
        if path is None:
            self._source(name)
            self.engine.swap_registered(name, slot)
        else:
            self.engine.swap_lora_slot_from_disk(path, name, slot)
        return self.view(name)

    def set_pinned(self, name: str, pinned: bool) -> AdapterView:
        source = self._source(name)
        slot = self.table.slot_of(name)
        if slot is None and pinned:
            slot, _ = self.engine.promote_registered(name)
        if slot is not None:
            self.table.set_pinned(slot, pinned)
        self.registry[name] = replace(source, pinned=pinned)
        return self.view(name)

    def unload(self, name: str) -> str:
        """'unloaded' when the slot (if any) is free now, 'draining' when it is freed later."""
        validate_adapter_name(name)
        self._refuse_draining(name)
        slot = self.table.slot_of(name)
        if name not in self.registry and slot is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        self.registry.pop(name, None)  # no new request is admitted from here on
        if slot is None:
            log.info("%s", kv(event="unload", adapter=name, slot=None, result="unloaded"))
            return "unloaded"
        self.draining[name] = slot
        self._finish_unloads()
        if name in self.draining:
            log.info("%s", kv(event="unload", adapter=name, slot=slot, result="draining",
                              in_flight=self.table.ref_count(slot)))
            return "draining"
        return "unloaded"

    def _finish_unloads(self) -> None:
        for name, slot in list(self.draining.items()):
            info = self.table.info(slot)
            if info.name != name:  # should not happen (swaps of draining names are refused)
                del self.draining[name]
            elif info.ref_count == 0:
                self.engine.lora.unload(name)
                del self.draining[name]
                log.info("%s", kv(event="unload", adapter=name, slot=slot, result="unloaded"))

    def _source(self, name: str) -> AdapterSource:
        validate_adapter_name(name)
        self._refuse_draining(name)
        source = self.registry.get(name)
        if source is None:
            raise UnknownAdapterError(
                f"adapter {name!r} is not registered (known: "
                f"{', '.join(sorted(self.registry)) or 'none'})")
        return source

    def _refuse_draining(self, name: str) -> None:
        if name in self.draining:
            raise SlotBusyError(
                f"adapter {name!r} is being unloaded and still serves in-flight requests in "
                f"slot {self.draining[name]}; retry when they finish")

    # --- after every step -------------------------------------------------------------

    def after_step(self) -> None:
        self._finish_unloads()
        scheduler = self.engine.scheduler
        self.metrics.waiting.set(len(scheduler.waiting))
        self.metrics.running.set(len(scheduler.running))
        # After step() every request still pending a promotion, except those of the
        # promotion in flight, is waiting for a slot to drain (POOL_FULL).
        adapters = self.engine.adapters
        ids = {s.request_id for name, waiters in adapters.pending.items()
               if name != adapters.promoting for s in waiters}
        self.metrics.pool_full_waits.inc(len(ids - self._waiting_ids))
        self.metrics.pool_full_waiting.set(len(ids))
        self._waiting_ids = ids

    # --- views ------------------------------------------------------------------------

    def view(self, name: str, infos: list[SlotInfo] | None = None) -> AdapterView:
        infos = infos if infos is not None else self.table.infos()
        source = self.registry.get(name)
        slot = self.table.slot_of(name)
        info = infos[slot] if slot is not None else None
        return AdapterView(
            name=name, path=str(source.peer or source.path) if source else None,
            pinned=bool(info.pinned if info else source and source.pinned),
            slot=slot, uid=info.uid if info else None,
            state=info.state.value if info else "DISK",
            ref_count=info.ref_count if info else 0,
            last_used=info.last_used if info else None,
            unloading=name in self.draining,
        )

    def snapshot(self) -> dict:
        """Every adapter (registered or still resident) and every slot, consistently."""
        infos = self.table.infos()
        names = sorted(set(self.registry) | {i.name for i in infos if i.name})
        return {
            "adapters": [self.view(n, infos) for n in names],
            "slots": [
                {"slot": i.slot, "name": i.name, "uid": i.uid, "generation": i.generation,
                 "state": i.state.value, "ref_count": i.ref_count, "pinned": i.pinned,
                 "last_used": i.last_used}
                for i in infos
            ],
        }
