"""A landing: one adapter version going into one slot. The whole protocol is in this file,
in the order it runs:

    begin    the slot table refuses a busy slot before anything is touched, else the slot
             is LOADING (serves nothing, never a victim, a fresh uid); a host-tier copy
             still reading it is waited for; the slot is zeroed (rank padding and modules
             the adapter does not target must read 0)
    write    the bytes, only through this landing: staged and checked (disk, trainer push),
             typed views (an HTTP peer), a host-tier image, or a raw address range that a
             transport writes (NIXL). Under tensor parallelism rank 0 writes (and checks)
             the whole adapter in a slot of its landing area (pool/landing_area.py); its
             serving slot gets only its slice, at commit
    verify   bytes no check has seen (a raw range): NaN/Inf and the gain bound, from one
             set of norms and one host sync
    tables   the rank, scale and DoRA rows the kernels read; DoRA's gains from the bytes
    agree    under tensor parallelism, rank 0's slice is copied from the whole landing
             into its serving slot, every other rank lands its slice (LandingPeers) and
             the ranks agree: all of them commit or none does
    commit   the slot READY holding the version
    fail     from any step after begin: the slot zeroed, EMPTY with a fresh uid, and a
             LandingError caused by what went wrong

The slot table (pool/slots.py) is called twice, begin_load and then finish_load or
fail_load; the pool (pool/pool.py) only lends the slot's tensors (SlotTensors). While the
landing is open the slot is LOADING, so a worker or a side stream may write it while the
engine steps: `land_inline` runs the steps in one go, a promotion (engine/promotion.py) drives them
from the engine thread and a worker. The functions at the end are the steps' tensor work,
also run on the one-slot scratch pool that bounds bytes before any slot is chosen.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from metrale.adapters.plan import AdapterPlan
from metrale.adapters.weights_check import GainBound, all_finite
from metrale.errors import LandingError, NonFiniteWeightsError, ShardLandingError
from metrale.ops.landing_triton import base_of, land_rows, land_views
from metrale.ops.norms_triton import region_norms
from metrale.pool.host_tier import HostTier, TierEntry
from metrale.pool.landing_area import LandingArea
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import AdapterPool, NormGroup, SlotTensors
from metrale.pool.recipe import table_rows
from metrale.pool.slots import SlotTable
from metrale.pool.staged import StagedAdapter

log = logging.getLogger("metrale.pool")

GAIN_CHUNK_ELEMS = 1 << 22  # elements of W + s B A that compute_gains builds at a time

Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # host (ranks, scales, doras) [L, M]


@dataclass(frozen=True)
class ByteRange:
    """A device address range inside one slot, for transports that write raw bytes."""

    addr: int
    nbytes: int


class LandingPeers(Protocol):
    """The other ranks of a tensor-parallel group (metrale.engine.tp_group), asked at commit,
    on the engine thread, once this rank's slot holds the whole landing and its tables."""

    def land(self, slot: int, tensors: SlotTensors, version: int) -> list[str | None]:
        """Every other rank lands its slice of `tensors` into its `slot`, and the ranks agree:
        per rank None (landed) or why it could not; a rank commits only if all landed, else
        its slot is EMPTY."""
        ...

    def empty(self, slot: int) -> None:
        """`slot` EMPTY and zeroed on every other rank (a landing failed before they were
        asked, or the slot was unloaded)."""
        ...


def land_inline(table: SlotTable, pool: AdapterPool, tier: HostTier | None, slot: int, version: int,
         write: Callable[[Landing], None], fills_slot: bool = False,
         peers: LandingPeers | None = None, area: LandingArea | None = None) -> Landing:
    """The protocol inline: begin, write(landing), verify, tables, commit; a failure after
    begin fails the landing and raises its LandingError. fills_slot: write sets every byte
    and table row (a host-tier image), so begin does not zero. Returns the committed landing."""
    landing = Landing.begin(table, pool, tier, slot, zero=not fills_slot, peers=peers, area=area)
    try:
        write(landing)
    except BaseException as e:
        raise landing.fail(e) from e
    landing.commit(version)
    return landing


class Landing:
    def __init__(self, table: SlotTable, pool: AdapterPool, tier: HostTier | None,
                 slot: int, generation: int, peers: LandingPeers | None = None,
                 area: LandingArea | None = None, landed_at: int | None = None) -> None:
        """Made by begin: the slot is LOADING. area, landed_at: rank 0's landing area under
        tensor parallelism and the area slot taken for this landing."""
        self._table, self._tier, self._peers, self._area = table, tier, peers, area
        self.slot, self.generation = slot, generation
        self.served: SlotTensors = pool.slot_tensors[slot]  # what the forward reads
        # where the whole adapter lands and is checked: the served slot itself, or an area
        # slot (then `served` gets this rank's slice at commit)
        landing_pool = pool if area is None else area.pool
        self.landed_at = slot if area is None else landed_at  # the slot of landing_pool
        self.layout: SlotLayout = landing_pool.layout
        self.base_weights = pool.base_weights
        self.tensors: SlotTensors = landing_pool.slot_tensors[self.landed_at]
        self.norm_keys = landing_pool.norm_keys
        self.is_open = True
        self._tables: Tables | None = None  # rows still to write at commit
        # bytes to verify at commit: a transport's, written straight into the slot (slot_range);
        # others were checked (and bounded) before any slot was touched
        self._plan: AdapterPlan | None = None
        self._bound: GainBound | None = None  # the plan's bound as arrays, when kept
        self._verified = False
        self._peers_asked = False  # the peers failed their own landings if this one fails
        self.start = time.perf_counter()

    # --- begin ----------------------------------------------------------------------------

    @classmethod
    def begin(cls, table: SlotTable, pool: AdapterPool, tier: HostTier | None, slot: int,
              zero: bool = True, peers: LandingPeers | None = None,
              area: LandingArea | None = None) -> Landing:
        """EMPTY|READY -> LOADING, zeroed on the current stream (zero=False: the write fills
        the whole slot). Refuses a busy slot before touching it. peers: the other ranks of a
        tensor-parallel group, asked at commit; area: rank 0's landing area there."""
        landed_at = area.take() if area is not None else None
        try:
            generation = table.begin_load(slot)  # re-checks idleness; from here it serves nothing
        except BaseException:
            if area is not None:
                area.give_back(landed_at)
            raise
        landing = cls(table, pool, tier, slot, generation, peers, area, landed_at)
        try:
            if tier is not None:  # a fill copy may still be reading the old bytes
                tier.before_write(landing.landed_at)
            if zero:
                zero_slot(landing.tensors)
        except BaseException as e:
            raise landing.fail(e) from e
        return landing

    # --- write: the bytes in ----------------------------------------------------------------

    def write_staged(self, staged: StagedAdapter) -> None:
        """A staged, checked adapter (bytes no registration bounded were bounded before:
        LoraSlots.bound_in_scratch)."""
        land_staged(self.tensors, self.layout, staged)
        self._tables = staged.recipe.tables if staged.recipe is not None \
            else table_rows(staged.plan, self.layout)
        if staged.dtype != self.layout.dtype:
            self.check_written(staged.plan)  # finite in the file's dtype, maybe not in the pool's

    def write_views(self, plan: AdapterPlan, views: list[torch.Tensor]) -> None:
        """A peer's staged, checked (and bounded) tensors, on the pool's device."""
        land_tensors(self.tensors, self.layout, plan, views)
        self._tables = table_rows(plan, self.layout)
        if any(v.dtype != self.layout.dtype for v in views):
            self.check_written(plan)  # finite in the file's dtype, maybe not in the pool's

    def write_image(self, entry: TierEntry) -> None:
        """A host-tier slot image (the output of a landing that passed every check): one copy
        of the bytes; its table rows are written at commit."""
        self._tier.copy_image(entry, self.tensors.data)
        self._tables = (entry.ranks, entry.scales, entry.doras)

    def slot_range(self, plan: AdapterPlan, tables: Tables | None = None,
                   bound: GainBound | None = None) -> ByteRange:
        """The whole slot as one address range, for a transport that writes coalesced runs
        of the plan's tensors (NIXL); zero_elements the bytes between tensors that a run
        carried (verify's norms then see any NaN/Inf). tables, bound: the plan's table_rows
        and GainBound, when the caller keeps them (~0.7 and ~1 ms of Python per 8B plan)."""
        self._tables = tables if tables is not None else table_rows(plan, self.layout)
        self._plan, self._bound = plan, bound
        return ByteRange(self.tensors.data.data_ptr(), self.layout.slot_bytes)

    def write_slice(self, data: torch.Tensor, tables: Tables) -> None:
        """This rank's slice of a slot that rank 0 landed and checked whole (tensor
        parallelism): the bytes as they are, then the finite check of bytes that skipped
        staging's (a transfer may have broken them)."""
        self.tensors.data.copy_(data)
        self._tables = tables
        if not all_finite(self.tensors.data):
            raise NonFiniteWeightsError(
                f"slot {self.slot}: this rank's slice holds NaN or Inf in the pool's dtype "
                f"({self.layout.dtype})")

    def zero_elements(self, index: torch.Tensor) -> None:
        """index: offsets from the slot base."""
        self.tensors.data.index_fill_(0, index, 0)

    def check_written(self, plan: AdapterPlan) -> None:
        """NaN/Inf check in place of bytes that skipped staging's (one pass: zeroed at begin)."""
        if not all_finite(self.tensors.data):
            raise NonFiniteWeightsError(
                f"{plan.source}: the landed weights hold NaN or Inf in the pool's dtype "
                f"({self.layout.dtype})")

    # --- verify ---------------------------------------------------------------------------

    def verify(self) -> None:
        """The checks that read the landed bytes of a plan no check has seen (a transport's):
        NaN/Inf and the gain bound, from one set of norms and one host sync. A failure fails
        the landing and raises its LandingError; commit runs this if nobody did."""
        if self._verified or self._plan is None:
            self._verified = True
            return
        try:
            check_slot(self.tensors, self._plan, self._bound or GainBound.of(
                self._plan, self.norm_keys), self.layout.dtype, "the landed weights")
        except BaseException as e:
            raise self.fail(e) from e
        self._verified = True

    # --- tables and commit ------------------------------------------------------------------

    def commit(self, version: int) -> None:
        """LOADING -> READY holding `version` (the bytes must have landed): verify, write the
        table rows (and DoRA's gains), agree with the peers, then the slot table."""
        self.verify()
        self._close()
        try:
            if self._tables is not None:
                write_tables(self.tensors, self.layout, self.base_weights, *self._tables)
            if self._area is not None:  # verified whole: rank 0 serves its slice
                self._area.slice_into(self.tensors, self.served)
            if self._peers is not None:  # the last step that can fail: then no rank commits
                self._peers_asked = True
                refused = [(rank, why) for rank, why in
                           enumerate(self._peers.land(self.slot, self.tensors, version)) if why]
                if refused:
                    raise ShardLandingError("; ".join(f"rank {r}: {why}" for r, why in refused))
        except BaseException as e:
            raise self._failed(e) from e
        uid = self._table.finish_load(self.slot, version)
        self._give_back_area()
        log.info("version %d landed in slot %d (uid=%d, generation=%d) in %.2f ms", version,
                 self.slot, uid, self.generation, (time.perf_counter() - self.start) * 1e3)

    # --- fail -------------------------------------------------------------------------------

    def fail(self, reason: BaseException | str) -> LandingError:
        """Zero the slot; EMPTY with a fresh identity. Returns the error to raise."""
        self._close()
        return self._failed(reason)

    def _failed(self, reason: BaseException | str) -> LandingError:
        zero_slot(self.tensors)  # nothing may serve, or key on, half-landed bytes
        if self._area is not None:
            zero_slot(self.served)  # it may hold its slice already
        self._table.fail_load(self.slot)
        self._give_back_area()
        if self._peers is not None and not self._peers_asked:
            self._peers.empty(self.slot)  # what they held there is EMPTY on every rank too
        log.warning("landing into slot %d failed: %s", self.slot, reason)
        error = LandingError.caused_by(
            reason, f"landing into slot {self.slot} failed ({reason}); the slot is now EMPTY")
        if isinstance(reason, BaseException):
            error.__cause__ = reason  # also when returned, not raised
        return error

    def _give_back_area(self) -> None:
        """The area slot free for the next landing; its bytes stay for the host tier's
        fill (LoraSlots.committed), which the next landing there waits for."""
        if self._area is not None:
            self._area.give_back(self.landed_at)

    def _close(self) -> None:
        if not self.is_open:
            raise AssertionError(f"landing into slot {self.slot} already ended")
        self.is_open = False


# --- the steps' tensor work, on one slot's tensors -----------------------------------------


def zero_slot(t: SlotTensors) -> None:
    """The slot as never landed: zero bytes and rows, DoRA gains 1."""
    t.data.zero_()
    t.ranks.zero_()
    t.scales.zero_()
    t.doras.zero_()
    t.gains.fill_(1.0)


def land_staged(t: SlotTensors, layout: SlotLayout, staged: StagedAdapter) -> None:
    """Staged bytes into a zeroed slot: with a recipe one kernel (CUDA), else typed views."""
    recipe = staged.recipe
    if recipe is None:
        land_tensors(t, layout, staged.plan, staged.views)
    else:
        land_rows(t.data, staged.data.view(recipe.dtype), recipe.desc, recipe.tiles)


def land_tensors(t: SlotTensors, layout: SlotLayout, plan: AdapterPlan,
                 views: list[torch.Tensor]) -> None:
    """Staged tensors into a zeroed slot, converted and transposed on the device (on CUDA in
    one kernel). Each lands at its placement: A [r, in] as is, B [out, r] as Bt [r, out], M
    [out] as its [1, out] region; an expert's part fills rows of its stacked region."""
    placed = []
    for landing, src in zip(plan.landings, views):
        target = landing.target
        offset, cols, row_stride = landing.placement(
            layout.region(target.layer, target.module, landing.kind))
        placed.append((src, offset, landing.rows, cols, landing.kind == "B", row_stride))
    src_base = base_of(views) if t.data.is_cuda else None
    if src_base is not None:
        land_views(t.data, src_base, placed)
        return
    base = t.data.storage_offset()
    for src, offset, rows, cols, transpose, row_stride in placed:
        dst = t.data.as_strided((rows, cols), (row_stride, 1), base + offset)
        dst.copy_(src.t() if transpose else src.reshape(1, -1) if src.dim() == 1 else src)


def slot_norms(t: SlotTensors) -> tuple[np.ndarray, bool]:
    """(norms, finite), one host sync. norms: float64 in the pool's norm_keys order plus a
    trailing 0 (for targets the layout lacks): A's largest row 2-norm (an embedding's: its
    largest |value|), B's largest row 1-norm (a column of Bt), M's largest |value|. A slot
    is zeroed before it lands, so rows past a module's rank add nothing and each (module,
    kind) reduces over all its layers at once: per tensor, the ~450 slicing calls of an 8B
    slot cost ~5 ms on the H200. finite: no NaN/Inf in any region (NaN and Inf reach every
    norm; padding between regions stays zero), so a landing that zeroes the bytes it carried
    between tensors needs no pass of its own."""
    if t.data.is_cuda:  # one launch (the torch ops below are its reference)
        values = region_norms(t.data, t.norm_desc)
    else:
        parts = [_norms(g, torch.float32) for g in t.norm_groups]
        values = torch.cat(parts + [torch.zeros(1, dtype=torch.float32)])  # trailing 0
    values = values.cpu().numpy().astype(np.float64)
    if not np.isfinite(values).all():  # float32 overflows past ~1e19: float64 decides
        start = 0
        for g in t.norm_groups:
            end = start + len(g.keys)
            if not np.isfinite(values[start:end]).all():
                values[start:end] = _norms(g, torch.float64).cpu().numpy()
            start = end
    return values, bool(np.isfinite(values).all())  # finite values: finite float64 norms


def _norms(g: NormGroup, dtype: torch.dtype) -> torch.Tensor:
    """slot_norms of one group's view [layers, rows, cols], accumulated in dtype."""
    if g.kind == "B":
        return torch.linalg.vector_norm(g.view, 1, dim=1, dtype=dtype).amax(1)
    if g.one_hot or g.kind == "M":
        return torch.linalg.vector_norm(g.view, math.inf, dim=(1, 2), dtype=dtype)
    return torch.linalg.vector_norm(g.view, 2, dim=2, dtype=dtype).amax(1)


def check_slot(t: SlotTensors, plan: AdapterPlan, bound: GainBound, dtype: torch.dtype,
               what: str = "the weights") -> None:
    """verify's checks of landed bytes: NaN/Inf anywhere (NonFiniteWeightsError), then the
    gain bound (its subclass of it), from one set of norms."""
    norms, finite = slot_norms(t)
    if not finite:
        raise NonFiniteWeightsError(
            f"{plan.source}: {what} hold NaN or Inf in the pool's dtype ({dtype})")
    bound.check(plan, norms, dtype)


def write_tables(t: SlotTensors, layout: SlotLayout, base_weights, ranks: torch.Tensor,
                 scales: torch.Tensor, doras: torch.Tensor) -> None:
    """Host rows [L, M] into the slot's tables; DoRA cells get their gains computed from the
    slot's bytes (so after the bytes landed). Copied at commit, not at write: a copy from
    pageable memory would wait for the stream on the host."""
    pinned = ranks.is_pinned()  # then no host sync: the rows are never rewritten
    t.ranks.copy_(ranks, non_blocking=pinned)
    t.scales.copy_(scales, non_blocking=pinned)
    t.doras.copy_(doras, non_blocking=pinned)
    t.gains.fill_(1.0)
    cells = doras.nonzero().tolist()  # host tensor: no device sync
    if cells and base_weights is not None:
        compute_gains(t, layout, base_weights,
                      [(layer, layout.table_modules[m], float(scales[layer, m]),
                        int(ranks[layer, m])) for layer, m in cells])


@torch.no_grad()  # the base weights may be Parameters: no autograd graph may hang off g
def compute_gains(t: SlotTensors, layout: SlotLayout, base_weights,
                  cells: list[tuple[int, str, float, int]]) -> None:
    """DoRA's g = m / ||W + s B A|| per output row in float32 (PEFT's DoraLinearLayer)."""
    bad = []
    for layer, module, scale, rank in cells:
        W = base_weights[(layer, module)]  # [out, in]
        a = t.region(layout, layer, module, "A")[:rank].float()  # [r, in]
        bt = t.region(layout, layer, module, "B")[:rank].float()  # [r, out]
        m = t.region(layout, layer, module, "M")[0].float()  # [out]
        off, n_out = layout.gain_offsets[(layer, module)]
        g = t.gains[off:off + n_out]  # [out] float32, a view: written in place
        out, d_in = W.shape
        step = max(1, GAIN_CHUNK_ELEMS // max(d_in, 1))
        for lo in range(0, out, step):
            hi = min(out, lo + step)
            rows = W[lo:hi].float() + scale * (bt[:, lo:hi].T @ a)  # [c, in]
            g[lo:hi] = m[lo:hi] / torch.linalg.vector_norm(rows, dim=1)  # [c]
        bad.append(g.isfinite().all())
    if bad and not bool(torch.stack(bad).all()):
        raise NonFiniteWeightsError(
            "a DoRA gain m / ||W + s B A|| is not finite (a row of W + s B A has norm 0, "
            "or the magnitudes overflow)")
