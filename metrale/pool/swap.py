"""LoraSlots: the slot table, the device pool and staging memory, and the two halves of
every landing: reading an adapter into a `Prepared` (disk here; peers in metrale.peer),
and writing one into a slot as a version. Names live in the engine's registry. On rank 0
of a tensor-parallel group the pool holds its slices and a landing area the whole
adapters being landed (`landing_pool`: where every read, plan and check path writes).

Validate first, mutate second: a refusal leaves the slot as it was; a failure after
zeroing leaves it EMPTY with a new identity. Bytes no registration bounded (a file
registered verify_on_landing, a peer's over HTTP) are bounded in a one-slot scratch pool
of the same layout before any slot is chosen (bound_in_scratch), so their refusal, too,
evicts nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from metrale.adapters.identity import AdapterIdentity, adapter_identity
from metrale.adapters.plan import AdapterPlan, plan_adapter
from metrale.adapters.weights_check import GainBound
from metrale.config import ModelConfig, PoolConfig
from metrale.errors import (
    AdapterFileError,
    MetraleError,
    NoAdapterPoolError,
    RuntimeSwapsDisabledError,
)
from metrale.pool.host_tier import HostTier
from metrale.pool.landing import (
    Landing,
    LandingPeers,
    check_slot,
    land_inline,
    land_staged,
    land_tensors,
    zero_slot,
)
from metrale.pool.landing_area import LandingArea, SlicedServing
from metrale.pool.layout import SlotLayout
from metrale.pool.mapped_files import MappedFiles
from metrale.pool.pool import AdapterPool
from metrale.pool.recipe import RecipeCache
from metrale.pool.slots import SlotTable
from metrale.pool.staged import StagedAdapter, stage
from metrale.pool.staging import ShortReadError, StagingBuffers, read_chunks

log = logging.getLogger("metrale.pool")
_PLAN_CACHE = 256
_LANDED_FILES = 4096


def read_adapter_data(plan: AdapterPlan, staging: StagingBuffers,
                      mapped: MappedFiles | None = None,
                      identity: AdapterIdentity | None = None) -> torch.Tensor:
    """The file's data section on staging's device ([staged_bytes] uint8): one copy from
    its registered mapping (`mapped`, for the version `identity` names) when there is one,
    else parallel chunked reads into pinned staging. A file that shrank is refused."""
    if mapped is not None and not plan.spans:  # spans: GBs of frozen copies, never pinned
        with mapped.borrow(identity, plan.source, plan.root) as host:
            if host is not None and host.numel() >= plan.data_offset + plan.data_bytes:
                return staging.to_device(host[plan.data_offset:plan.data_offset + plan.data_bytes])
    try:
        if plan.spans:  # only the landed tensors' bytes: skip PEFT's frozen-weight copies
            host, pos = staging.host(plan.staged_bytes), 0
            for a, b in plan.spans:
                read_chunks(plan.source, plan.data_offset + a, host[pos:pos + b - a], None,
                            plan.root)
                pos += b - a
            return staging.to_device(host)
        return staging.read_file(plan.source, plan.data_offset, plan.data_bytes, plan.root)
    except ShortReadError as e:
        raise AdapterFileError(
            f"{plan.source}: read fewer than its {plan.data_bytes} data bytes ({e}); the "
            "file changed or was truncated while loading") from None
    except OSError as e:
        raise AdapterFileError(f"cannot read {plan.source}: {e}") from None


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


@dataclass(frozen=True)
class Prepared:
    """An adapter read and checked, ready for any slot through a Landing (no slot touched)."""

    write: Callable[[Landing], None]
    identity: AdapterIdentity | None = None  # set: fill the host tier after the commit
    close: Callable[[], None] = field(default=lambda: None)  # e.g. release a peer's lease
    # write() sets every byte and table row of the slot (a host-tier image): no zeroing first
    fills_slot: bool = False


def on_device(device: torch.device):
    """Make the pool's GPU current: Triton and side streams launch on the current device."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class LoraSlots:
    """Engine thread only, except the methods marked thread-safe (promotion workers)."""

    def __init__(
        self, model: ModelConfig, pool: PoolConfig, device: torch.device | str,
        dtype: torch.dtype, base_weights=None, sliced: SlicedServing | None = None,
    ) -> None:
        """base_weights: as AdapterPool's; None: DoRA adapters fail to land. sliced: rank
        0 of a tensor-parallel group, whose pool serves its slice of each adapter (landed
        whole in a LandingArea first)."""
        self.model_config, self.pool_config = model, pool
        self.table = SlotTable(pool.max_loras)
        self.listeners: list[Callable[[LandingEvent], None]] = []
        self.pool: AdapterPool | None = None  # the slots the forward reads, by table slot
        self.area: LandingArea | None = None
        self.host_tier: HostTier | None = None
        self.recipes: RecipeCache | None = None  # landing recipes of plans (CUDA)
        if pool.max_loras:
            whole = SlotLayout(model, pool, dtype)
            if sliced is None:
                self.pool = AdapterPool(whole, device, base_weights)
            else:
                self.pool = AdapterPool(SlotLayout(sliced.model, pool, dtype), device)
                self.area = LandingArea(whole, self.pool.layout, sliced.shard,
                                        sliced.landing_slots, self.pool.device)
            self.recipes = RecipeCache(whole, self.pool.device)
            if pool.host_tier_bytes:  # images of whole adapters, copied where they land
                self.host_tier = HostTier(self.landing_pool, pool.host_tier_bytes, pool.eviction)
        self.staging = StagingBuffers(torch.device(device))
        self.mapped_files = MappedFiles(pool.mapped_file_bytes, torch.device(device))
        self._plans: dict[tuple[AdapterIdentity, str], AdapterPlan] = {}  # oldest first
        self._layouts: dict[tuple[str, int], AdapterPlan] = {}  # (plan_digest, size) -> a plan
        # files whose bytes landed (committed) in this pool: bounded once, not at each landing
        self._landed_files: OrderedDict[AdapterIdentity, None] = OrderedDict()
        self._plans_lock = threading.Lock()
        self._scratch: AdapterPool | None = None  # bound_in_scratch's, made at first use
        self._scratch_lock = threading.Lock()
        # the other ranks of a tensor-parallel group, asked at each landing's commit
        self.peers: LandingPeers | None = None

    @property
    def landing_pool(self) -> AdapterPool | None:
        """The whole-layout pool landings write and check, whose layout every read, plan and
        peer path uses: the pool itself, or rank 0's landing area under tensor parallelism."""
        return self.pool if self.area is None else self.area.pool

    def disable_runtime_swaps(self) -> None:
        """Freeze the pool as it is now (after the start-up adapters landed)."""
        self.pool_config = replace(self.pool_config, allow_runtime_swaps=False)

    # --- refusals that need no I/O ------------------------------------------------

    def require_swappable(self, op: str) -> None:
        if self.pool is None:
            raise NoAdapterPoolError(
                f"{op}: no adapter pool (the engine was started with --max-loras 0); "
                "restart it with --max-loras 1 or more"
            )
        if not self.pool_config.allow_runtime_swaps:
            raise RuntimeSwapsDisabledError(
                f"{op}: runtime swaps are disabled by configuration; restart without "
                "--no-runtime-swaps to change adapters at run time"
            )

    # --- the two-phase landing ------------------------------------------------------

    def begin(self, slot: int, zero: bool = True) -> Landing:
        """A landing into `slot`, begun (metrale.pool.landing: the protocol), for a caller
        that drives its steps (a promotion). zero=False: the write fills the whole slot."""
        return Landing.begin(self.table, self.pool, self.host_tier, slot, zero, self.peers,
                             self.area)

    def land(self, slot: int, version: int, prepared: Prepared) -> None:
        """`prepared` into `slot` as `version` (a registry's, or a store's own number), the
        whole landing here. A failure after begin raises LandingError."""
        landing = land_inline(self.table, self.pool, self.host_tier, slot, version,
                              prepared.write, prepared.fills_slot, self.peers, self.area)
        self.committed(prepared, landing.landed_at)

    def committed(self, prepared: Prepared, landed_at: int) -> None:
        """After `prepared` landed (Landing.landed_at: the landing pool's slot its whole
        bytes are in, before anything else lands): the image into the host tier, and its
        file known good (a later landing of these exact bytes is not bounded again)."""
        identity = prepared.identity
        if identity is None:
            return
        with self._plans_lock:
            self._landed_files[identity] = None
            self._landed_files.move_to_end(identity)
            while len(self._landed_files) > _LANDED_FILES:
                self._landed_files.popitem(last=False)
        tier = self.host_tier
        if tier is not None and tier.enabled:
            tier.put(identity, landed_at)

    def notify(self, event: LandingEvent) -> None:
        """Tell every listener how a landing went (metrics, logs)."""
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # an observer must never fail a landing
                log.exception("landing listener failed")

    def unload_slot(self, slot: int) -> None:
        """An idle slot -> EMPTY, zeroed (a pool with slots exists: table.unload checked it)."""
        self.table.unload(slot)
        if self.host_tier is not None and self.area is None:  # else fills read the area only
            self.host_tier.before_write(slot)
        zero_slot(self.pool.slot_tensors[slot])
        if self.peers is not None:
            self.peers.empty(slot)

    # --- reading adapters (thread-safe: a promotion worker runs these) ---------------

    def cheap_slots(self, dirs: Mapping[int, str | Path]) -> set[int]:
        """Of `dirs` (slot -> the directory its adapter was read from), the slots whose
        adapter would come back as one host copy, not a read: its image is in the host tier.
        Under "cost" eviction the slots give these up first (SlotTable.select_victim's
        `cheap`); under "lru" none, as before."""
        tier = self.host_tier
        if tier is None or not tier.enabled or self.pool_config.eviction != "cost":
            return set()
        return {slot for slot, d in dirs.items() if tier.holds_dir(d)}

    def tier_has(self, identity: AdapterIdentity | None) -> bool:
        tier = self.host_tier
        return tier is not None and tier.enabled and tier.has(identity)

    def prepare_disk(self, adapter_dir: str | Path, name: str,
                     staging: StagingBuffers | None = None, use_tier: bool = True,
                     identity: AdapterIdentity | None = None, verify: bool = False,
                     root: Path | None = None) -> Prepared:
        """A host-tier image of these exact bytes, else the file planned, read on to the
        device and checked there. A worker passes its own `staging` and use_tier=False
        (only the engine thread reuses image memory). `identity`: the caller's. verify: no
        registration read the weights (AdapterSource.verify_on_landing): they are bounded
        here, in the scratch pool, unless these exact bytes landed before (a host-tier
        image was bounded already). root: every file read resolves inside it
        (adapters.confined: the tree of an --adapter-source or an --adapter-root)."""
        identity = identity or adapter_identity(adapter_dir, root)
        tier = self.host_tier
        entry = tier.get(identity) if use_tier and tier is not None and tier.enabled else None
        if entry is not None:
            return Prepared(functools.partial(Landing.write_image, entry=entry), fills_slot=True)
        plan = self.plan_from_disk(adapter_dir, name, identity, root)
        data = read_adapter_data(plan, staging or self.staging, self.mapped_files, identity)
        staged = stage(plan, data, self.recipes.get(plan))
        if verify and identity is not None:
            with self._plans_lock:
                verify = identity not in self._landed_files
        if verify:
            self.bound_in_scratch(plan, staged)
        return Prepared(functools.partial(Landing.write_staged, staged=staged), identity)

    def bound_in_scratch(self, plan: AdapterPlan, staged: StagedAdapter | list[torch.Tensor],
                         bound: GainBound | None = None) -> None:
        """Check bytes no registration bounded before any slot is touched: `staged` (or a
        peer's typed views of the plan's tensors) lands in slot 0 of a one-slot pool of this
        layout (made at first use, one slot's memory), where the landing's own checks (one
        set of norms, one host sync) find NaN/Inf (also from the conversion to the pool's
        dtype) and check the gain bound. Raises NonFiniteWeightsError (or the bound's
        subclass of it). Thread-safe: the norms' sync ends this stream's use of the scratch
        before the next caller's begins."""
        with self._scratch_lock:
            if self._scratch is None:
                layout = self.landing_pool.layout
                self._scratch = AdapterPool(
                    SlotLayout(self.model_config, replace(self.pool_config, max_loras=1),
                               layout.dtype), self.pool.device)
            scratch = self._scratch
            t = scratch.slot_tensors[0]
            zero_slot(t)
            if isinstance(staged, StagedAdapter):
                land_staged(t, scratch.layout, staged)
            else:
                land_tensors(t, scratch.layout, plan, staged)
            check_slot(t, plan, bound or GainBound.of(plan, scratch.norm_keys),
                       scratch.layout.dtype)

    def clear_plan_cache(self) -> None:
        """For benchmarks that time a first landing: plans, files landed."""
        with self._plans_lock:
            self._plans.clear()
            self._layouts.clear()
            self._landed_files.clear()

    def plan_from_disk(self, adapter_dir: str | Path, name: str,
                       identity: AdapterIdentity | None = None,
                       root: Path | None = None) -> AdapterPlan:
        """plan_adapter, remembered per content identity. A plan (several ms of Python on
        an 8B adapter) depends only on the config and header bytes, the file size and this
        engine's config, so files sharing those share one, under their own name and path.
        root: as plan_adapter's (the plan's reads stay inside it)."""
        identity = identity or adapter_identity(adapter_dir, root)
        if identity is None:
            return plan_adapter(adapter_dir, name, self.model_config, self.pool_config, root)
        layout = (identity.plan_digest, identity.data_stat[2])  # config + header, file size
        with self._plans_lock:
            plan = self._plans.get((identity, name, root))
            shared = self._layouts.get(layout)
        if plan is not None:
            return plan
        if shared is not None:
            plan = replace(shared, name=name, root=root,
                           source=str(Path(adapter_dir) / "adapter_model.safetensors"))
        else:
            plan = plan_adapter(adapter_dir, name, self.model_config, self.pool_config, root)
        if adapter_identity(adapter_dir, root) == identity:  # not rewritten meanwhile
            with self._plans_lock:
                for cache, key in ((self._plans, (identity, name, root)), (self._layouts, layout)):
                    while len(cache) >= _PLAN_CACHE:
                        cache.pop(next(iter(cache)))
                    cache.setdefault(key, plan)
        return plan
