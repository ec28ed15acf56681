"""Host tier: an LRU of recently landed adapters, kept as slot images (bytes and table
rows) in pinned memory: a re-promotion is one H2D copy, no read, parse or check (the
image is the output of a landing that passed them). Keys are AdapterIdentity, so a
rewritten file never gets a stale image.

A fill copies a landed slot to the host on a side stream; the next write into that slot
waits for it on the device (`before_write`). Images live in one pinned arena allocated at
the first fill: pinning costs ~ms per MB-scale call, which per landing would stall the
engine loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from metrale.adapters.identity import AdapterIdentity
from metrale.pool.pool import AdapterPool


@dataclass
class TierEntry:
    index: int  # image row in the arena
    image: torch.Tensor  # [slot_elems] pool dtype, host (pinned with CUDA)
    ranks: torch.Tensor  # [layers, modules] int32, host
    scales: torch.Tensor  # [layers, modules] float32, host
    doras: torch.Tensor  # [layers, modules] int32, host: 1 where DoRA's gain applies
    ready: torch.cuda.Event | None  # the D2H copy that fills image; None: already done


class HostTier:
    def __init__(self, pool: AdapterPool, capacity_bytes: int) -> None:
        self.pool, self.capacity = pool, capacity_bytes
        self.entry_bytes = pool.layout.slot_bytes
        self._entries: OrderedDict[AdapterIdentity, TierEntry] = OrderedDict()  # oldest first
        self._lock = threading.Lock()  # has() is asked from a promotion worker
        self._cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> fill copy reading it
        self._arena: torch.Tensor | None = None  # [entries, slot_elems]
        self._free: list[int] = []
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.capacity >= self.entry_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: AdapterIdentity | None) -> TierEntry | None:
        entry = self._entries.get(key)  # None is never a key
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def has(self, key: AdapterIdentity | None) -> bool:
        """Whether get(key) would hit now (counts nothing, moves nothing)."""
        with self._lock:
            return key in self._entries

    def put(self, key: AdapterIdentity, slot: int) -> None:
        """Store `slot`'s contents under key, right after landing it (the tier is enabled)."""
        pool = self.pool
        if self._arena is None:
            n = self.capacity // self.entry_bytes
            self._arena = torch.empty(n, pool.layout.slot_elems, dtype=pool.layout.dtype,
                                      pin_memory=self._cuda)
            self._free = list(range(n))
        with self._lock:
            for old in [k for k in self._entries if k.path == key.path]:
                self._free.append(self._entries.pop(old).index)  # an older version of the files
            if not self._free:
                self._free.append(self._entries.popitem(last=False)[1].index)  # LRU
        index = self._free.pop()
        sources = (pool.slot_region(slot), pool.ranks[slot], pool.scales[slot], pool.doras[slot])
        copies = [self._arena[index]] + [torch.empty(t.shape, dtype=t.dtype, pin_memory=self._cuda)
                                         for t in sources[1:]]
        ready, side = None, contextlib.nullcontext()
        if self._cuda:
            # after the landing, and after any H2D still reading a reused (evicted) image
            self._stream.wait_stream(torch.cuda.current_stream(pool.device))
            side = torch.cuda.stream(self._stream)
        with side:
            for dst, src in zip(copies, sources):
                dst.copy_(src, non_blocking=self._cuda)
        if self._cuda:
            ready = self._pending[slot] = torch.cuda.Event()
            ready.record(self._stream)
        with self._lock:
            self._entries[key] = TierEntry(index, *copies, ready)

    def before_write(self, slot: int) -> None:
        """Order the next write into slot after a fill copy still reading it (device-side)."""
        ready = self._pending.pop(slot, None)
        if ready is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ready)

    def land(self, entry: TierEntry, slot: int) -> None:
        """One H2D copy of the image into the slot, then its table rows."""
        if entry.ready is not None:
            entry.ready.synchronize()  # long done in practice: filled at an earlier landing
            entry.ready = None
        pool = self.pool
        pool.slot_region(slot).copy_(entry.image, non_blocking=self._cuda)
        pool.write_tables(slot, entry.ranks, entry.scales, entry.doras)
