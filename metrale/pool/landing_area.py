"""Rank 0's landing area under tensor parallelism (docs/DESIGN.md, "Tensor parallelism").

Rank 0's serving pool holds only its slice of each adapter, like every worker's, but a
landing is read, written and verified whole (the finite check and the gain bound need the
whole adapter, and the workers get their slices from it). So a landing writes into one of a
few whole-layout slots here; at commit rank 0's slice and table rows are copied from it
into the serving slot, the workers are sent theirs, and the area slot goes back.

Slots: one per landing that can be open at once, a promotion written off the engine thread
and a landing run inline beside it. An area slot keeps its bytes after it goes back: the
host tier copies its image from there right after the commit, and the next landing into it
waits for that copy (HostTier.before_write, keyed by area slot).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from metrale.config import ConfigError, ModelConfig
from metrale.model.parallel import Shard
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import AdapterPool, SlotTensors
from metrale.pool.shard import slice_slot


@dataclass(frozen=True)
class SlicedServing:
    """What rank 0 of a tensor-parallel group serves: its shard's layer shapes
    (parallel.shard_config), and how many whole-adapter slots its landings need."""

    model: ModelConfig  # the shard's
    shard: Shard
    landing_slots: int  # landings open at once: 2 with promotions off the engine thread

    def __post_init__(self) -> None:
        if self.shard.rank != 0 or self.shard.size < 2:
            raise ConfigError(f"sliced serving is rank 0's of a group of 2 or more, not {self.shard}")
        if not isinstance(self.landing_slots, int) or self.landing_slots < 1:
            raise ConfigError(f"landing_slots must be an integer >= 1, got {self.landing_slots!r}")


class LandingArea:
    """Whole-layout slots landings write and verify before any rank commits; `take` and
    `give_back` run on the engine thread (every Landing.begin does)."""

    def __init__(self, whole: SlotLayout, sliced: SlotLayout, shard: Shard, count: int,
                 device: torch.device) -> None:
        self.pool = AdapterPool(SlotLayout(whole.model, replace(whole.pool, max_loras=count),
                                           whole.dtype), device)
        self.sliced, self.shard = sliced, shard
        self._free = list(range(count))
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.pool.buffer.numel() * self.pool.buffer.element_size()

    def take(self) -> int:
        """A free area slot's index. Raises if none is: more landings open at once than the
        area was sized for, a bug (refused before the slot table is touched)."""
        with self._lock:
            if not self._free:
                raise AssertionError(f"all {self.pool.layout.pool.max_loras} landing-area slots "
                                   "are in use: more landings open at once than planned")
            return self._free.pop()

    def give_back(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    def slice_into(self, whole: SlotTensors, served: SlotTensors) -> None:
        """Rank 0's slice of the landed whole slot into its serving slot: every byte (the
        padding zero) and the table rows. DoRA's gains stay 1: the ranks' agreement refuses
        DoRA under tensor parallelism, so no committed slot has any."""
        slice_slot(self.pool.layout, whole.data, self.sliced, self.shard, out=served.data)
        served.ranks.copy_(whole.ranks)
        served.scales.copy_(whole.scales)
        served.doras.copy_(whole.doras)
