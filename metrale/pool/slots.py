"""SlotTable: the pool's bookkeeping. Pure Python: states, names, identities,
references, recency and victim choice. It never touches a tensor.

Identity: every landing gets a uid from one process-wide counter, so no two
landings (in any slot, in any pool of this process) ever share one; requests,
the prefix cache and metrics key on it. `generation` counts landings per slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from metrale.errors import (
    AllSlotsPinnedError,
    PoolFullError,
    SlotBusyError,
    SlotOutOfRangeError,
    SlotPinnedError,
    UnknownAdapterError,
)

_uids = itertools.count(1)


def next_uid() -> int:
    return next(_uids)


class SlotState(Enum):
    EMPTY = "EMPTY"
    LOADING = "LOADING"
    READY = "READY"


@dataclass
class _Slot:
    state: SlotState = SlotState.EMPTY
    name: str | None = None  # None when EMPTY, or READY but detached (name moved on)
    uid: int = 0
    generation: int = 0
    ref_count: int = 0
    last_used: int = 0
    pinned: bool = False
    ever_filled: bool = False


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    name: str | None
    uid: int
    generation: int
    state: SlotState
    ref_count: int
    pinned: bool
    last_used: int


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self._slots = [_Slot() for _ in range(max_loras)]
        self._by_name: dict[str, int] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._slots)

    # --- reads ----------------------------------------------------------------

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._slots):
            raise SlotOutOfRangeError(
                f"slot {slot} out of range: the pool has max_loras={len(self._slots)} "
                f"(slots 0..{len(self._slots) - 1})"
            )

    def info(self, slot: int) -> SlotInfo:
        self.check_slot(slot)
        s = self._slots[slot]
        return SlotInfo(slot, s.name, s.uid, s.generation, s.state, s.ref_count, s.pinned,
                        s.last_used)

    def infos(self) -> list[SlotInfo]:
        return [self.info(i) for i in range(len(self._slots))]

    def slot_of(self, name: str) -> int | None:
        """The READY slot serving `name`, or None if it is not resident."""
        return self._by_name.get(name)

    def ref_count(self, slot: int) -> int:
        self.check_slot(slot)
        return self._slots[slot].ref_count

    def require_replaceable(self, slot: int) -> None:
        """A swap into `slot` needs it idle and unpinned: a pin never moves to another
        adapter, and a pinned adapter is only replaced once its pin is lifted."""
        self.require_idle(slot)
        if self._slots[slot].pinned:
            raise SlotPinnedError(
                f"slot {slot} holds pinned adapter {self._slots[slot].name!r}; unpin it first")

    def require_idle(self, slot: int) -> None:
        self.check_slot(slot)
        s = self._slots[slot]
        if s.ref_count > 0:
            raise SlotBusyError(
                f"slot {slot} ({s.name or 'unnamed'}) has {s.ref_count} in-flight sequence(s) "
                "(ref_count>0); cannot replace an adapter mid-decode; retry when they finish"
            )
        if s.state is SlotState.LOADING:
            raise SlotBusyError(f"slot {slot} is already loading an adapter; retry")

    def select_victim(self) -> int:
        """Never-filled slots first, then unnamed ones (emptied, failed or
        detached), then the least recently used idle; pinned and busy never."""
        candidates = [
            (i, s) for i, s in enumerate(self._slots)
            if not s.pinned and s.ref_count == 0 and s.state is not SlotState.LOADING
        ]
        if not candidates:
            pinned = sum(s.pinned for s in self._slots)
            if pinned == len(self._slots):
                raise AllSlotsPinnedError(
                    f"POOL_FULL: all {pinned} slot(s) are pinned, so no other adapter can ever "
                    "land; unpin one or raise --max-loras")
            raise PoolFullError(
                f"POOL_FULL: all {len(self._slots) - pinned} cache slot(s) are busy (in-flight "
                f"requests or a landing) and {pinned} are pinned; retry")

        def preference(item: tuple[int, _Slot]) -> tuple[int, int, int]:
            i, s = item
            return (0 if not s.ever_filled else 1 if s.name is None else 2, s.last_used, i)

        return min(candidates, key=preference)[0]

    def num_free_for_landing(self) -> int:
        """Slots a landing could take now (select_victim's candidates), plus detached
        slots still draining their in-flight requests (they will be)."""
        return sum(1 for s in self._slots if not s.pinned and s.state is SlotState.READY
                   and (s.ref_count == 0 or s.name is None)) + sum(
            1 for s in self._slots if s.state is SlotState.EMPTY)

    def drain_candidate(self, remaining_work: Mapping[int, int]) -> str | None:
        """The adapter whose busy slot should be drained for a landing: the least work
        left on it (remaining_work[slot], tokens), then fewest in-flight requests, then least
        recently requested; pinned never. None if no slot qualifies."""
        busy = [(remaining_work.get(i, 0), s.ref_count, s.last_used, s.name)
                for i, s in enumerate(self._slots)
                if s.name is not None and not s.pinned and s.ref_count > 0
                and s.state is SlotState.READY]
        return min(busy)[3] if busy else None

    def reattach(self, name: str, slot: int, uid: int) -> bool:
        """Undo a drain: `name` routes to `slot` again if the slot still holds the landing
        `uid` (READY, unnamed) and `name` is nowhere else. False when it moved on."""
        s = self._slots[slot]
        if name in self._by_name or s.name is not None or s.uid != uid \
                or s.state is not SlotState.READY:
            return False
        s.name = name
        self._by_name[name] = slot
        return True

    # --- references -------------------------------------------------------------

    def acquire(self, name: str) -> tuple[int, int]:
        """Take one reference on the slot serving `name`; returns (slot, uid)."""
        slot = self._by_name.get(name)
        if slot is None:
            raise UnknownAdapterError(f"adapter {name!r} is not resident in the pool")
        s = self._slots[slot]
        s.ref_count += 1
        s.last_used = next(self._clock)
        return slot, s.uid

    def release(self, slot: int) -> None:
        self.check_slot(slot)
        s = self._slots[slot]
        if s.ref_count <= 0:
            raise AssertionError(f"release of slot {slot} without a matching acquire")
        s.ref_count -= 1

    def touch(self, slot: int) -> None:
        self.check_slot(slot)
        self._slots[slot].last_used = next(self._clock)

    def set_pinned(self, slot: int, pinned: bool) -> None:
        self.check_slot(slot)
        self._slots[slot].pinned = pinned

    # --- the landing state machine: EMPTY|READY -> LOADING -> READY | EMPTY ------

    def begin_load(self, slot: int) -> None:
        """The slot stops serving its old adapter: its name no longer routes here."""
        self.require_idle(slot)
        s = self._slots[slot]
        if s.name is not None:
            del self._by_name[s.name]
        s.state, s.name, s.uid = SlotState.LOADING, None, next_uid()
        s.generation += 1
        s.ever_filled = True

    def finish_load(self, slot: int, name: str) -> int:
        """LOADING -> READY under `name`; returns the landing's uid. A slot that
        served `name` before keeps running its sequences but is detached."""
        s = self._slots[slot]
        if s.state is not SlotState.LOADING:
            raise AssertionError(f"finish_load on slot {slot} in state {s.state}")
        self.detach(name)
        s.state, s.name = SlotState.READY, name
        self._by_name[name] = slot
        s.last_used = next(self._clock)
        return s.uid

    def detach(self, name: str) -> int | None:
        """`name` stops routing to its slot (a reload or an unload): the slot keeps serving
        the sequences it holds under its old uid, takes no new ones, loses its pin (no name
        can unpin it any more) and is the preferred victim once idle. Returns the slot."""
        slot = self._by_name.pop(name, None)
        if slot is not None:
            self._slots[slot].name = None
            self._slots[slot].pinned = False
        return slot

    def fail_load(self, slot: int) -> None:
        """LOADING -> EMPTY with a fresh identity: nothing may key on half-landed bytes."""
        s = self._slots[slot]
        s.state, s.name, s.uid = SlotState.EMPTY, None, next_uid()

    def unload(self, slot: int) -> None:
        """READY -> EMPTY (slot idle); an emptied slot is cache space again, unpinned."""
        self.require_idle(slot)
        s = self._slots[slot]
        if s.name is not None:
            del self._by_name[s.name]
        s.state, s.name, s.uid, s.pinned = SlotState.EMPTY, None, next_uid(), False
        s.generation += 1

    # --- invariants ---------------------------------------------------------------

    def check_integrity(self) -> None:
        uids = [s.uid for s in self._slots if s.uid]
        assert len(uids) == len(set(uids)), f"duplicate uids {uids}"
        for i, s in enumerate(self._slots):
            assert s.ref_count >= 0, f"slot {i} ref_count {s.ref_count}"
            if s.ref_count:
                assert s.state is SlotState.READY, f"slot {i} busy in state {s.state}"
            if s.state is not SlotState.READY:
                assert s.name is None, f"slot {i} {s.state} keeps name {s.name}"
            if s.name is not None:
                assert self._by_name.get(s.name) == i, f"slot {i} name {s.name} not routed"
        for name, i in self._by_name.items():
            s = self._slots[i]
            assert s.state is SlotState.READY and s.name == name, f"{name} routes to {i}"
