"""Host tier: recently landed adapters kept as slot images (bytes and table rows) in pinned
memory: a re-promotion is one H2D copy, no read, parse or check (the image is the output of
a landing that passed them). Keys are AdapterIdentity, so a rewritten file never gets a
stale image. Which images stay when it is full is an EvictionPolicy's choice (PoolConfig
.eviction: "cost" by default, "lru" as before), over the adapters' directories: one image
per directory at most, and a directory's uses outlive its images (and a rewrite of its
files) in the policy's memory.

A fill copies a landed slot to the host on a side stream; the next write into that slot
waits for it on the device (`before_write`). Images live in one pinned arena allocated at
the first fill: pinning costs ~ms per MB-scale call, which per landing would stall the
engine loop.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.adapters.identity import AdapterIdentity
from metrale.pool.eviction import EvictionConfig, EvictionPolicy
from metrale.pool.pool import AdapterPool

# What a miss on an image costs, relative to a read from local disk. Every image is put
# right after a landing read from a file (peer landings carry no identity and are not
# kept), so this one constant weighs them all today; a source that is dearer to read again
# (an object store whose copy the disk cache may have dropped) would pass more to put().
DISK_READ_COST = 1.0


@dataclass
class TierEntry:
    index: int  # image row in the arena
    image: torch.Tensor  # [slot_elems] pool dtype, host (pinned with CUDA)
    ranks: torch.Tensor  # [layers, modules] int32, host
    scales: torch.Tensor  # [layers, modules] float32, host
    doras: torch.Tensor  # [layers, modules] int32, host: 1 where DoRA's gain applies
    ready: torch.cuda.Event | None  # the D2H copy that fills image; None: already done
    cost: float = DISK_READ_COST  # what reading it again would cost (put's `cost`)


class HostTier:
    def __init__(self, pool: AdapterPool, capacity_bytes: int,
                 eviction: EvictionConfig | str = "cost") -> None:
        self.pool, self.capacity = pool, capacity_bytes
        self.entry_bytes = pool.layout.slot_bytes
        self.max_entries = capacity_bytes // self.entry_bytes
        config = eviction if isinstance(eviction, EvictionConfig) else EvictionConfig(eviction)
        # over adapter directories (AdapterIdentity.path); None when the tier is off
        self.policy: EvictionPolicy[str] | None = \
            EvictionPolicy(self.max_entries, config) if self.max_entries else None
        self._entries: dict[AdapterIdentity, TierEntry] = {}
        self._by_path: dict[str, AdapterIdentity] = {}  # one image per directory
        self._lock = threading.Lock()  # has() is asked from a promotion worker
        self._cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> fill copy reading it
        self._arena: torch.Tensor | None = None  # [entries, slot_elems]
        self._free: list[int] = []
        self.hits = self.misses = 0
        self.refused = 0  # puts the policy's admission turned away

    @property
    def enabled(self) -> bool:
        return self.max_entries >= 1

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[AdapterIdentity]:
        """The versions held, one image each."""
        with self._lock:
            return list(self._entries)

    def get(self, key: AdapterIdentity | None) -> TierEntry | None:
        entry = self._entries.get(key)  # None is never a key
        if entry is None:
            self.misses += 1
            return None
        self.policy.hit(key.path, entry.cost)
        self.hits += 1
        return entry

    def holds_dir(self, adapter_dir: str | Path) -> bool:
        """Whether an image of some version of the files in adapter_dir is held (engine
        thread: the slots' victim choice asks it)."""
        return str(Path(adapter_dir).absolute()) in self._by_path

    def has(self, key: AdapterIdentity | None) -> bool:
        """Whether get(key) would hit now (counts nothing, moves nothing)."""
        with self._lock:
            return key in self._entries

    def put(self, key: AdapterIdentity, slot: int, cost: float = DISK_READ_COST) -> bool:
        """Store `slot`'s contents under key, right after landing it from a source that costs
        `cost` to read again (the tier is enabled). The policy may evict another image for
        it, or keep none (False: the tier is unchanged but for an older image of the same
        files, which goes either way)."""
        pool = self.pool
        if self._arena is None:
            n = self.max_entries
            self._arena = torch.empty(n, pool.layout.slot_elems, dtype=pool.layout.dtype,
                                      pin_memory=self._cuda)
            self._free = list(range(n))
        with self._lock:
            old = self._by_path.pop(key.path, None)
            if old is not None:  # an older version of the files (or these again)
                self._free.append(self._entries.pop(old).index)
                self.policy.discard(key.path)
            offer = self.policy.offer(key.path, cost)
            if not offer.admitted:
                self.refused += 1
                return False
            if offer.evicted is not None:
                self._free.append(self._entries.pop(self._by_path.pop(offer.evicted)).index)
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
            self._entries[key] = TierEntry(index, *copies, ready, cost)
            self._by_path[key.path] = key
        return True

    def before_write(self, slot: int) -> None:
        """Order the next write into slot after a fill copy still reading it (device-side)."""
        ready = self._pending.pop(slot, None)
        if ready is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ready)

    def copy_image(self, entry: TierEntry, dst: torch.Tensor) -> None:
        """One H2D copy of the image's bytes into dst (a slot's region); its table rows are
        the landing's."""
        if entry.ready is not None:
            entry.ready.synchronize()  # long done in practice: filled at an earlier landing
            entry.ready = None
        dst.copy_(entry.image, non_blocking=self._cuda)
