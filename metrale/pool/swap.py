"""The seed's slot operations: swap an adapter into a given slot, or promote it
into a victim slot, from disk (peers come in metrale.peer).

Validate everything first, mutate second: the adapter is read, checked and
staged before the slot is touched, so every refusal leaves the slot's bytes and
identity as they were. A failure after zeroing leaves the slot EMPTY with a new
identity (never the old name over half-new bytes).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.adapters.plan import AdapterPlan, plan_adapter
from metrale.config import ModelConfig, PoolConfig
from metrale.errors import (
    AdapterFileError,
    InvalidNameError,
    LandingError,
    MetraleError,
    NoAdapterPoolError,
    PoolFullError,
    RuntimeSwapsDisabledError,
    UnknownAdapterError,
)
from metrale.pool.host_tier import HostTier, adapter_key
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import AdapterPool
from metrale.pool.slots import SlotInfo, SlotTable
from metrale.pool.staging import ShortReadError, StagingBuffers

log = logging.getLogger("metrale.pool")
_PLAN_CACHE = 256
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"adapter name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def read_adapter_data(plan: AdapterPlan, staging: StagingBuffers) -> torch.Tensor:
    """The file's data section, read in parallel chunks into `staging` (on its device:
    [data_bytes] uint8); a file that changed or shrank since it was planned is refused."""
    try:
        return staging.read_file(plan.source, plan.data_offset, plan.data_bytes)
    except OSError as e:
        raise _read_error(plan, e) from None


def _read_error(plan: AdapterPlan, e: OSError) -> AdapterFileError:
    if isinstance(e, ShortReadError):
        return AdapterFileError(
            f"{plan.source}: read fewer than its {plan.data_bytes} data bytes ({e}); the "
            "file changed or was truncated while loading"
        )
    return AdapterFileError(f"cannot read {plan.source}: {e}")


@dataclass(frozen=True)
class LandingEvent:
    """One swap or promotion, landed or refused, for metrics and logs."""

    op: str  # e.g. "promote_lora_slot_from_peer"
    name: str
    slot: int | None  # None when refused before a slot was chosen or touched
    evicted: str | None
    seconds: float
    error: MetraleError | None

    @property
    def kind(self) -> str:
        return "promote" if self.op.startswith("promote") else "swap"

    @property
    def source(self) -> str:
        return "peer" if self.op.endswith("_peer") else "disk"


def _on_device(device: torch.device):
    """Make the pool's GPU current: Triton and side streams launch on the current
    device, which need not be the pool's (an engine on cuda:1)."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class LoraSlots:
    """The slot table, the device pool and staging memory, with the operations
    that move adapters into slots. Not thread-safe: the engine calls it from
    its own loop, between steps."""

    def __init__(
        self, model: ModelConfig, pool: PoolConfig, device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.model_config, self.pool_config = model, pool
        self.table = SlotTable(pool.max_loras)
        self.listeners: list[Callable[[LandingEvent], None]] = []
        self.pool: AdapterPool | None = None
        self.host_tier: HostTier | None = None
        if pool.max_loras:
            self.pool = AdapterPool(SlotLayout(model, pool, dtype), device)
            if pool.host_tier_bytes:
                self.host_tier = HostTier(self.pool, pool.host_tier_bytes)
        self.staging = StagingBuffers(torch.device(device))
        self._plans: dict = {}  # (adapter_key, name) -> AdapterPlan, oldest first

    # --- refusals that need no I/O ------------------------------------------------

    def _require_swappable(self, op: str) -> AdapterPool:
        if self.pool is None:
            raise NoAdapterPoolError(
                f"{op}: no adapter pool (the engine was started with max_loras=0); "
                "restart with max_loras >= 1"
            )
        if not self.pool_config.allow_runtime_swaps:
            raise RuntimeSwapsDisabledError(
                f"{op}: runtime swaps are disabled by configuration; restart without "
                "--no-runtime-swaps (allow_runtime_swaps=True) to change adapters at run time"
            )
        return self.pool

    # --- the operations -------------------------------------------------------------
    # `prepare` reads and validates an adapter from some source without touching
    # any slot, and returns the write that lands it into a (zeroed) slot.

    def swap_from(self, op: str, name: str, slot: int, source: str,
                  prepare: Callable[[], Callable[[int], None]]) -> None:
        def run() -> tuple[int, None]:
            self._require_swappable(op)
            validate_adapter_name(name)
            self.table.require_idle(slot)  # refuse a busy slot before any I/O
            write = prepare()
            self._land(slot, name, source, lambda: write(slot))
            return slot, None

        self._observed(op, name, run)

    def promote_from(self, op: str, name: str, source: str,
                     prepare: Callable[[], Callable[[int], None]]) -> tuple[int, str | None]:
        def run() -> tuple[int, str | None]:
            self._require_swappable(op)
            validate_adapter_name(name)
            self.table.select_victim()  # POOL_FULL before reading anything
            write = prepare()
            slot = self.table.select_victim()
            evicted = self.table.info(slot).name
            self._land(slot, name, source, lambda: write(slot))
            log.info("promote: %r hot in slot %d from %s (evicted=%r)", name, slot, source, evicted)
            return slot, evicted

        return self._observed(op, name, run)

    def _observed(self, op: str, name: str,
                  run: Callable[[], tuple[int, str | None]]) -> tuple[int, str | None]:
        """Run an operation and tell every listener how it went (metrics, logs).
        POOL_FULL is a wait, not an outcome: on-demand promotions retry every step."""
        start = time.perf_counter()
        try:
            with _on_device(self.staging.device):
                slot, evicted = run()
        except PoolFullError:
            raise
        except MetraleError as e:
            self._notify(LandingEvent(op, name, None, None, time.perf_counter() - start, e))
            raise
        self._notify(LandingEvent(op, name, slot, evicted, time.perf_counter() - start, None))
        return slot, evicted

    def _notify(self, event: LandingEvent) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # an observer must never fail a landing
                log.exception("landing listener failed")

    def swap_lora_slot_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        self.swap_from("swap_lora_slot_from_disk", name, slot, "disk",
                       lambda: self._disk_writer(adapter_dir, name))

    def promote_lora_slot_from_disk(
        self, adapter_dir: str | Path, name: str
    ) -> tuple[int, str | None]:
        return self.promote_from("promote_lora_slot_from_disk", name, "disk",
                                 lambda: self._disk_writer(adapter_dir, name))

    def stage(self, plan: AdapterPlan, fill: Callable[[torch.Tensor], None]) -> list[torch.Tensor]:
        """fill() writes the plan's data bytes into pinned host staging; they go to
        the device in one copy and come back as checked, typed tensor views."""
        host = self.staging.host(plan.data_bytes)
        fill(host)
        return self.pool.stage_views(plan, self.staging.to_device(host))

    def unload(self, name: str) -> int:
        """Free the slot serving `name` (it must be idle); returns the slot."""
        slot = self.resident_slot(name)
        self.table.unload(slot)
        if self.pool is not None:
            self._before_write(slot)
            self.pool.zero_slot(slot)
        return slot

    def resident_slot(self, name: str) -> int:
        slot = self.table.slot_of(name)
        if slot is None:
            raise UnknownAdapterError(f"adapter {name!r} is not resident in the pool")
        return slot

    def slot_info(self) -> list[SlotInfo]:
        return self.table.infos()

    # --- internals ------------------------------------------------------------------

    def _disk_writer(self, adapter_dir: str | Path, name: str) -> Callable[[int], None]:
        """Host-tier hit: one H2D copy of a slot image landed earlier from these exact
        files. Else: validate, read the data section in parallel chunks into pinned
        staging while the chunks go to the device, check, and land in one kernel."""
        tier = self.host_tier
        key = adapter_key(adapter_dir)
        use_tier = key is not None and tier is not None and tier.enabled
        entry = tier.get(key) if use_tier else None
        if entry is not None:
            return lambda slot: tier.land(entry, slot)
        plan = self.plan_from_disk(adapter_dir, name, key)
        data = read_adapter_data(plan, self.staging)
        views = self.pool.stage_views(plan, data)

        def write(slot: int) -> None:
            self.pool.land(slot, plan, views)
            if use_tier:
                tier.put(key, slot)

        return write

    def plan_from_disk(self, adapter_dir: str | Path, name: str, key=None) -> AdapterPlan:
        """plan_adapter, remembered per file identity (host_tier.adapter_key: path, mtime,
        size of weights and config): validation is a pure function of those files and this
        engine's config, and costs ~4 ms of Python on an 8B adapter. The bytes are still
        read and checked (NaN/Inf) on every landing."""
        key = key if key is not None else adapter_key(adapter_dir)
        if key is None:
            return plan_adapter(adapter_dir, name, self.model_config, self.pool_config)
        plan = self._plans.get((key, name))
        if plan is None:
            plan = plan_adapter(adapter_dir, name, self.model_config, self.pool_config)
            while len(self._plans) >= _PLAN_CACHE:
                self._plans.pop(next(iter(self._plans)))
            self._plans[(key, name)] = plan
        return plan

    def _before_write(self, slot: int) -> None:
        if self.host_tier is not None:
            self.host_tier.before_write(slot)

    def _land(self, slot: int, name: str, source: str, write: Callable[[], None]) -> int:
        """LOADING -> write -> READY, or EMPTY with a fresh identity on any failure."""
        start = time.perf_counter()
        self.begin_landing(slot, name, source, write)
        return self.finish_landing(slot, name, source, start)

    def begin_landing(self, slot: int, name: str, source: str, write: Callable[[], None]) -> None:
        """EMPTY|READY -> LOADING, zero, write (on CUDA: queued on the current stream).
        On failure the slot is EMPTY with a fresh identity and LandingError is raised."""
        self.table.begin_load(slot)  # re-checks idleness; from here the slot serves nothing
        try:
            self._before_write(slot)
            self.pool.zero_slot(slot)
            write()
        except BaseException as e:
            raise self.fail_landing(slot, name, source, e) from e

    def fail_landing(self, slot: int, name: str, source: str,
                     e: BaseException | str) -> LandingError:
        """A LOADING slot whose write failed: zeroed, EMPTY with a fresh identity."""
        self.pool.zero_slot(slot)
        self.table.fail_load(slot)
        log.warning("landing %r into slot %d from %s failed: %s", name, slot, source, e)
        return LandingError(f"landing {name!r} into slot {slot} failed ({e}); the slot is now EMPTY")

    def finish_landing(self, slot: int, name: str, source: str, start: float) -> int:
        """LOADING -> READY under `name` (the bytes must have landed); returns the uid."""
        uid = self.table.finish_load(slot, name)
        log.info(
            "swap: %r landed in slot %d from %s (uid=%d, generation=%d) in %.2f ms",
            name, slot, source, uid, self.table.info(slot).generation,
            (time.perf_counter() - start) * 1e3,
        )
        return uid
