"""Plans of peer landings, remembered per (peer, adapter id); one cache per adapter pool.

Validating and planning a manifest costs milliseconds of Python on an 8B adapter. An
entry is reused only when the table's shape bytes, the PEFT config's bytes and the dtype
are byte-for-byte equal, which is the same as passing every check again.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from metrale.adapters.plan import AdapterPlan
from metrale.adapters.weights_check import GainBound

MAX_ENTRIES = 256


@dataclass
class PeerPlan:
    shape_bytes: bytes
    peft_raw: bytes
    dtype: str
    plan: AdapterPlan
    local_offsets: np.ndarray  # int64 bytes from the slot base of each tensor, table order
    nbytes: np.ndarray  # int64, table order
    tables: tuple  # the plan's table_rows (~0.7 ms of Python per 8B plan), for NIXL landings
    bound: GainBound  # the plan's gain bound as arrays (~1 ms of Python per 8B landing)
    runs: dict = field(default_factory=dict)  # remote address bytes -> coalesced Runs (NIXL)

    def matches(self, shape_bytes: bytes, peft_raw: bytes, dtype: str) -> bool:
        return self.shape_bytes == shape_bytes and self.peft_raw == peft_raw and self.dtype == dtype

    def named(self, name: str) -> PeerPlan:
        """This entry with its plan under another local adapter name (the plan's only
        name-dependent field)."""
        if self.plan.name == name:
            return self
        return replace(self, plan=replace(self.plan, name=name))


class PlanCache:
    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, str], PeerPlan] = OrderedDict()
        self._newest: dict[str, PeerPlan] = {}  # peer -> its latest entry
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, peer: str, adapter_id: str) -> PeerPlan | None:
        """This adapter's entry, else the peer's newest (a publisher's next version under
        a new id): either is reused only if the reply's bytes equal it."""
        with self._lock:
            entry = self._entries.get((peer, adapter_id))
            if entry is not None:
                self._entries.move_to_end((peer, adapter_id))
                return entry
            return self._newest.get(peer)

    def put(self, peer: str, adapter_id: str, entry: PeerPlan) -> None:
        """Remember (or replace: the peer's layout changed) the entry of this adapter."""
        with self._lock:
            self._entries[(peer, adapter_id)] = entry
            self._entries.move_to_end((peer, adapter_id))
            self._newest[peer] = entry
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)

    def knows(self, peer: str) -> bool:
        """Whether a landing from this peer ("ip:port") was planned here: its path is warm."""
        with self._lock:
            return peer in self._newest

    def __len__(self) -> int:
        return len(self._entries)


_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def plan_cache_for(pool: object) -> PlanCache:
    """The plan cache of one adapter pool (its layout is what entries were checked against)."""
    with _caches_lock:
        cache = _caches.get(pool)
        if cache is None:
            cache = _caches[pool] = PlanCache()
        return cache
