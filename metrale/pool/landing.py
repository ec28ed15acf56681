"""Landing: one adapter version going into one slot, from `LoraSlots.begin` to `commit` or
`fail`. While it is open the slot is LOADING (no version, no requests, never a victim), so
a worker or a side stream may write it while the engine steps. Every source writes through
it, never into the pool: a peer gets byte ranges inside this slot, not the pool's base.
"""

from __future__ import annotations

import logging
import time

import torch

from metrale.adapters.plan import AdapterPlan
from metrale.adapters.weights_check import GainBound, all_finite
from metrale.errors import LandingError, NonFiniteWeightsError
from metrale.pool.host_tier import HostTier, TierEntry
from metrale.pool.pool import AdapterPool, ByteRange, StagedAdapter
from metrale.pool.recipe import table_rows
from metrale.pool.slots import SlotTable

log = logging.getLogger("metrale.pool")


class Landing:
    def __init__(self, table: SlotTable, pool: AdapterPool, slot: int,
                 host_tier: HostTier | None) -> None:
        self._table, self._pool, self.slot = table, pool, slot
        self._host_tier = host_tier
        # host (ranks, scales, doras) rows still to write at commit
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.is_open = True
        # bytes to bound at commit (check_gains): a peer's written straight into the slot
        # (NIXL, slot_range); others were bounded before any slot was touched
        self._plan: AdapterPlan | None = None
        self._bound: GainBound | None = None  # the plan's bound as arrays, when kept
        self._verified = False
        self.start = time.perf_counter()

    # --- bytes in ----------------------------------------------------------------------

    def write_views(self, plan: AdapterPlan, views: list[torch.Tensor]) -> None:
        """A peer's staged, checked (and bounded: LoraSlots.bound_in_scratch) tensors, on
        the pool's device, into the slot."""
        self._pool.land(self.slot, plan, views)
        self._tables = table_rows(plan, self._pool.layout)
        if any(v.dtype != self._pool.layout.dtype for v in views):
            self.check_written(plan)  # finite in the file's dtype, maybe not in the pool's

    def write_staged(self, staged: StagedAdapter) -> None:
        """A staged, checked adapter into the slot (bytes no registration bounded were
        bounded before: LoraSlots.bound_in_scratch)."""
        self._pool.land_staged(self.slot, staged)
        self._tables = staged.recipe.tables if staged.recipe is not None \
            else table_rows(staged.plan, self._pool.layout)
        if staged.dtype != self._pool.layout.dtype:
            self.check_written(staged.plan)  # finite in the file's dtype, maybe not in the pool's

    def write_image(self, entry: TierEntry) -> None:
        """A host-tier slot image (bytes and table rows) in one copy."""
        self._host_tier.land(entry, self.slot)
        self._tables = None

    def slot_range(self, plan: AdapterPlan, tables: tuple | None = None,
                   bound: GainBound | None = None) -> ByteRange:
        """The whole slot as one address range, for a transport that writes coalesced
        runs of the plan's tensors (NIXL); zero_elements the bytes between tensors that a
        run carried (verify's norms then see any NaN/Inf). tables, bound: the plan's
        table_rows and GainBound, when the caller keeps them (~0.7 and ~1 ms of Python per
        8B plan)."""
        self._tables = tables if tables is not None else table_rows(plan, self._pool.layout)
        self._plan, self._bound = plan, bound
        region = self._pool.slot_region(self.slot)
        return ByteRange(region.data_ptr(), self._pool.layout.slot_bytes)

    def zero_elements(self, index: torch.Tensor) -> None:
        """index: offsets from the slot base."""
        self._pool.slot_region(self.slot).index_fill_(0, index, 0)

    def check_written(self, plan: AdapterPlan) -> None:
        """NaN/Inf check in place of bytes that skipped staging's (one pass: zeroed at begin)."""
        if not all_finite(self._pool.slot_region(self.slot)):
            raise self._non_finite(plan)

    def _non_finite(self, plan: AdapterPlan) -> NonFiniteWeightsError:
        return NonFiniteWeightsError(
            f"{plan.source}: the landed weights hold NaN or Inf in the pool's dtype "
            f"({self._pool.layout.dtype})")

    # --- the end -----------------------------------------------------------------------

    def verify(self) -> None:
        """The checks that read the landed bytes of a plan not bounded at registration (a
        peer's): NaN/Inf in any region and the gain bound, from one set of norms and one
        host sync. A failure zeroes the slot (EMPTY, fresh identity) and raises
        LandingError; commit runs this if nobody did."""
        if self._verified or self._plan is None:
            self._verified = True
            return
        try:
            plan, pool = self._plan, self._pool
            norms, finite = pool.gain_norm_values(self.slot)
            if not finite:
                raise self._non_finite(plan)
            bound = self._bound or GainBound.of(plan, pool.gain_norm_keys())
            bound.check(plan, norms, pool.layout.dtype)
        except BaseException as e:
            raise self.fail(e) from e
        self._verified = True

    def commit(self, version: int) -> None:
        """LOADING -> READY holding `version` (the bytes must have landed)."""
        self.verify()
        self._close()
        try:
            if self._tables is not None:
                self._pool.write_tables(self.slot, *self._tables)
        except BaseException as e:
            raise self._failed(e) from e
        uid = self._table.finish_load(self.slot, version)
        log.info("version %d landed in slot %d (uid=%d, generation=%d) in %.2f ms", version,
                 self.slot, uid, self._table.info(self.slot).generation,
                 (time.perf_counter() - self.start) * 1e3)

    def fail(self, reason: BaseException | str) -> LandingError:
        """Zero the slot; EMPTY with a fresh identity. Returns the error to raise."""
        self._close()
        return self._failed(reason)

    def _failed(self, reason: BaseException | str) -> LandingError:
        self._pool.zero_slot(self.slot)
        self._table.fail_load(self.slot)
        log.warning("landing into slot %d failed: %s", self.slot, reason)
        error = LandingError.caused_by(
            reason, f"landing into slot {self.slot} failed ({reason}); the slot is now EMPTY")
        if isinstance(reason, BaseException):
            error.__cause__ = reason  # also when returned, not raised
        return error

    def _close(self) -> None:
        if not self.is_open:
            raise AssertionError(f"landing into slot {self.slot} already ended")
        self.is_open = False
