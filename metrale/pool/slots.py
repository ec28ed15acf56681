"""SlotTable: the pool's bookkeeping in pure Python: per slot its state, the adapter
version it holds, its identity, references and recency, and victim choice. Names and pins
belong to the registry, which passes the slots it routes and protects into the choices.

Every landing gets a uid from one process-wide counter, so no two landings in this
process share one (requests, the prefix cache and metrics key on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from metrale.errors import (
    AllSlotsPinnedError,
    PoolFullError,
    SlotBusyError,
    SlotOutOfRangeError,
)

_uids = itertools.count(1)


class SlotState(Enum):
    EMPTY = "EMPTY"
    LOADING = "LOADING"
    READY = "READY"


@dataclass
class _Slot:
    state: SlotState = SlotState.EMPTY
    version: int | None = None  # the adapter version whose bytes it holds (READY only)
    uid: int = 0
    generation: int = 0  # landings and unloads of this slot
    ref_count: int = 0
    last_used: int = 0
    ever_filled: bool = False


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    version: int | None
    uid: int
    generation: int
    state: SlotState
    ref_count: int
    last_used: int


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self._slots = [_Slot() for _ in range(max_loras)]
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._slots)

    # --- reads ----------------------------------------------------------------

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._slots):
            raise SlotOutOfRangeError(
                f"slot {slot} out of range: the pool has {len(self._slots)} slots "
                f"(0..{len(self._slots) - 1}; --max-loras)"
            )

    def info(self, slot: int) -> SlotInfo:
        self.check_slot(slot)
        s = self._slots[slot]
        return SlotInfo(slot, s.version, s.uid, s.generation, s.state, s.ref_count, s.last_used)

    def infos(self) -> list[SlotInfo]:
        return [self.info(i) for i in range(len(self._slots))]

    def holds(self, slot: int, version: int) -> bool:
        """The slot serves `version`'s bytes now (READY)."""
        s = self._slots[slot]
        return s.state is SlotState.READY and s.version == version

    def ref_count(self, slot: int) -> int:
        self.check_slot(slot)
        return self._slots[slot].ref_count

    def require_idle(self, slot: int) -> None:
        self.check_slot(slot)
        s = self._slots[slot]
        if s.ref_count > 0:
            raise SlotBusyError(
                f"slot {slot} has {s.ref_count} in-flight sequence(s) (ref_count>0); cannot "
                "replace an adapter mid-decode; retry when they finish"
            )
        if s.state is SlotState.LOADING:
            raise SlotBusyError(f"slot {slot} is already loading an adapter; retry")

    def select_victim(self, pinned: Collection[int] = (), routed: Collection[int] = (),
                      cheap: Collection[int] = ()) -> int:
        """Never-filled slots first, then slots no name routes to (emptied, failed or
        detached), then idle slots whose adapter would come back cheaply (`cheap`: its image
        is in the host tier, one copy instead of a read), then the other idle ones, least
        recently used first in each group; pinned and busy never."""
        candidates = [
            (i, s) for i, s in enumerate(self._slots)
            if i not in pinned and s.ref_count == 0 and s.state is not SlotState.LOADING
        ]
        if not candidates:
            if len(pinned) >= len(self._slots):
                raise AllSlotsPinnedError(
                    f"POOL_FULL: all {len(pinned)} slot(s) are pinned, so no other adapter can "
                    "ever land; unpin one or raise --max-loras")
            raise PoolFullError(
                f"POOL_FULL: all {len(self._slots) - len(pinned)} cache slot(s) are busy "
                f"(in-flight requests or a landing) and {len(pinned)} are pinned; retry")

        def preference(item: tuple[int, _Slot]) -> tuple[int, int, int]:
            i, s = item
            group = 0 if not s.ever_filled else 1 if i not in routed else 2 if i in cheap else 3
            return (group, s.last_used, i)

        return min(candidates, key=preference)[0]

    def num_free_for_landing(self, pinned: Collection[int], routed: Collection[int]) -> int:
        """Slots a landing could take now (select_victim's candidates), plus slots no name
        routes to that still drain their in-flight requests (they will be)."""
        return sum(1 for i, s in enumerate(self._slots)
                   if s.state is SlotState.EMPTY
                   or (i not in pinned and s.state is SlotState.READY
                       and (s.ref_count == 0 or i not in routed)))

    def drain_candidate(self, cost: Mapping[int, Any], candidates: Collection[int]) -> int | None:
        """The busy slot (among `candidates`: routed, unpinned) to drain for a landing: the
        least cost of draining it (cost[slot], comparable: e.g. the work left on it), then
        fewest in-flight requests, then least recently requested. None if no slot qualifies."""
        busy = [(cost.get(i, 0), s.ref_count, s.last_used, i)
                for i, s in enumerate(self._slots)
                if i in candidates and s.ref_count > 0 and s.state is SlotState.READY]
        return min(busy)[3] if busy else None

    # --- references -------------------------------------------------------------

    def acquire(self, slot: int) -> int:
        """Take one reference on a READY slot; returns its landing's uid."""
        self.check_slot(slot)
        s = self._slots[slot]
        if s.state is not SlotState.READY:
            raise AssertionError(f"acquire of slot {slot} in state {s.state}")
        s.ref_count += 1
        s.last_used = next(self._clock)
        return s.uid

    def release(self, slot: int) -> None:
        self.check_slot(slot)
        s = self._slots[slot]
        if s.ref_count <= 0:
            raise AssertionError(f"release of slot {slot} without a matching acquire")
        s.ref_count -= 1

    def touch(self, slot: int) -> None:
        self.check_slot(slot)
        self._slots[slot].last_used = next(self._clock)

    # --- the landing state machine: EMPTY|READY -> LOADING -> READY | EMPTY ------

    def begin_load(self, slot: int) -> int:
        """The slot stops serving its old version: from here it holds nothing. Returns the
        landing's generation (for its log line)."""
        self.require_idle(slot)
        s = self._slots[slot]
        s.state, s.version, s.uid = SlotState.LOADING, None, next(_uids)
        s.generation += 1
        s.ever_filled = True
        return s.generation

    def finish_load(self, slot: int, version: int) -> int:
        """LOADING -> READY holding `version`; returns the landing's uid."""
        s = self._slots[slot]
        if s.state is not SlotState.LOADING:
            raise AssertionError(f"finish_load on slot {slot} in state {s.state}")
        s.state, s.version = SlotState.READY, version
        s.last_used = next(self._clock)
        return s.uid

    def fail_load(self, slot: int) -> None:
        """LOADING -> EMPTY with a fresh identity: nothing may key on half-landed bytes."""
        s = self._slots[slot]
        s.state, s.version, s.uid = SlotState.EMPTY, None, next(_uids)

    def unload(self, slot: int) -> None:
        """READY -> EMPTY (slot idle); an emptied slot is cache space again."""
        self.require_idle(slot)
        s = self._slots[slot]
        s.state, s.version, s.uid = SlotState.EMPTY, None, next(_uids)
        s.generation += 1

    # --- invariants ---------------------------------------------------------------

    def check_integrity(self) -> None:
        uids = [s.uid for s in self._slots if s.uid]
        assert len(uids) == len(set(uids)), f"duplicate uids {uids}"
        for i, s in enumerate(self._slots):
            assert s.ref_count >= 0, f"slot {i} ref_count {s.ref_count}"
            if s.ref_count:
                assert s.state is SlotState.READY, f"slot {i} busy in state {s.state}"
            assert (s.version is not None) == (s.state is SlotState.READY), \
                f"slot {i} {s.state} holds version {s.version}"
