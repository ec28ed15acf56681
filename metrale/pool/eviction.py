"""Which keys a bounded cache keeps (the host tier's adapter images): a pure policy over
hashable keys, no torch, no I/O. The cache asks it what to drop and whether to keep a new key;
it holds the bytes itself.

"lru" keeps the most recently used keys: exactly the host tier before issue 28 (a use or
an insertion makes a key the newest; the oldest goes).

"cost" keeps the keys whose past uses are worth the most: each use adds the cost of the miss
it stood for (a disk or object-store read against a host copy) times a weight that doubles
every `half_life x capacity` misses (offers: uses of keys not held), so a use's value halves,
relative to a new one, after that many misses (an exponentially decayed frequency, LRFU's
family: a long half-life is LFU, a short one LRU; keys used once each are kept in LRU order).
The key of least value goes. The clock counts misses, not uses, as GDSF's moves only at
evictions: a cache that serves its uses ages slowly, one that misses (its load moved on)
ages fast. Keys no longer held keep their value in a bounded ghost map, so an adapter that
comes back after an eviction is recognised as the frequent one it was instead of starting at
one use (without the ghost map: 0.893 / 0.697 / 0.762 below). With `admission` a new key is
kept only if its value beats the victim's (TinyLFU's rule); it measured within 0.002 of
none, so it is off.

Measured with bench/many_adapters.py --simulate (the engine in virtual time: 1,000 adapters,
32 slots, 92 tier images, 40 requests/s, 20,000 requests; hit rate over the clairvoyant bound
for Zipf 1.1 / Zipf 0.8 / Zipf 1.1 whose hot set is redrawn every 20 s; under "cost" the slots
also give up first the idle adapters whose image the tier holds, SlotTable.select_victim):
lru 0.786 / 0.535 / 0.804; cost 0.907 / 0.753 / 0.787 (0.901 / 0.745 / 0.781 with the slots'
victims by recency alone). In the tier instead, with the same slot order: GDSF's inflating
clock (priority = clock + uses x cost, the clock raised to each victim's priority) 0.874 /
0.690 / 0.813 (as we read it, the clock rises with every one-off key evicted and adapters
just behind the slots fall out between their uses); no aging (LFU with ghosts) 0.912 / 0.775
/ 0.728: yesterday's counts keep yesterday's adapters. A clock of all uses, hits too (half-life
10, slots by recency): 0.901 / 0.751 / 0.766. The half-life trades a standing load against a
moving one: 3 gives 0.900 / 0.731 / 0.808, 10 gives 0.910 / 0.767 / 0.764; at 5 cost gains
0.12 and 0.22 on the standing loads and gives up 0.017 when the hot set jumps.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from metrale.config import EVICTION_POLICIES, ConfigError

K = TypeVar("K", bound=Hashable)

# Weights are 2 ** (age / half-life) relative to a base; past this exponent every value is
# divided by the newest weight (rare: every 256 half-lives), far from float overflow (~1024).
_RESCALE_EXPONENT = 256.0


@dataclass(frozen=True)
class EvictionConfig:
    """How the cache chooses. policy: "cost" or "lru" (EVICTION_POLICIES).

    half_life: in capacities of misses (offers); the value of a use halves against a new
    one after half_life x capacity misses. ghosts: keys remembered beyond those
    held, in capacities (their values only, no bytes). admission: keep a new key only when
    its value beats the victim's. The last three apply to "cost" only.
    """

    policy: str = "cost"
    half_life: float = 5.0
    ghosts: float = 8.0
    admission: bool = False

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction policy {self.policy!r} unknown; choose from "
                              f"{', '.join(EVICTION_POLICIES)}")
        if not (self.half_life > 0 and math.isfinite(self.half_life)):
            raise ConfigError(f"half_life must be a positive number, got {self.half_life}")
        if not (self.ghosts >= 0 and math.isfinite(self.ghosts)):
            raise ConfigError(f"ghosts must be >= 0, got {self.ghosts}")


@dataclass(frozen=True)
class Offer:
    """What offer() decided: whether the key is held now, and the key it displaced."""

    admitted: bool
    evicted: Hashable | None = None


class EvictionPolicy(Generic[K]):
    """At most `capacity` keys held. Not thread-safe: its cache serialises the calls.

    hit(key): a held key served a use. offer(key, cost): a use of a key that was not held
    (its bytes were just read the expensive way); the cache may keep it. discard(key): the
    cache dropped a held key for a reason of its own (its files changed); its value stays.
    """

    def __init__(self, capacity: int, config: EvictionConfig | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity, self.config = capacity, config or EvictionConfig()
        self._lru = self.config.policy == "lru"
        self._held: OrderedDict[K, float] = OrderedDict()  # key -> value; oldest use first
        self._ghosts: OrderedDict[K, float] = OrderedDict()  # not held: key -> value, oldest first
        self._max_ghosts = int(self.config.ghosts * capacity)
        self._half_life = self.config.half_life * capacity  # in misses
        self._misses = 0  # offers since the weights' base: the clock of the decay
        self._heap: list[tuple[float, int, K]] = []  # (value, stamp, key); stale rows skipped
        self._stamp: dict[K, int] = {}  # held key -> the stamp of its live heap row
        self._stamps = itertools.count()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    @property
    def num_remembered(self) -> int:
        """Keys remembered but not held (the ghost map; at most ghosts x capacity)."""
        return len(self._ghosts)

    def value(self, key: K) -> float:
        """A key's value now (held or remembered; 0 if unknown), in the current base's units:
        comparable between keys, not across a rescale."""
        return self._held.get(key, self._ghosts.get(key, 0.0))

    def keys(self) -> list[K]:
        """The held keys, least recently used first."""
        return list(self._held)

    def victim(self) -> K | None:
        """The held key that would go next (None while empty)."""
        if not self._held:
            return None
        if self._lru:
            return next(iter(self._held))
        while True:
            value, stamp, key = self._heap[0]
            if self._stamp.get(key) == stamp:
                return key
            heapq.heappop(self._heap)  # a row of an older value or of a key gone

    # --- uses -------------------------------------------------------------------------------

    def hit(self, key: K, cost: float = 1.0) -> None:
        """A held key served a use (KeyError if it is not held: the cache lost track)."""
        if key not in self._held:
            raise KeyError(f"hit of a key not held: {key!r}")
        self._held.move_to_end(key)
        if not self._lru:
            weight = self._weight(cost, miss=False)  # first: it may rescale every value
            self._set(key, self._held[key] + weight)

    def offer(self, key: K, cost: float = 1.0) -> Offer:
        """A use of `key`, whose bytes were read at `cost` (relative: a disk read 1.0); keep
        it? When full, the victim goes to make room (Offer.evicted), unless admission refuses
        the newcomer. A key already held counts as a hit and stays."""
        if key in self._held:
            self.hit(key, cost)
            return Offer(True)
        if self._lru:
            evicted = self._held.popitem(last=False)[0] if len(self._held) >= self.capacity \
                else None
            self._held[key] = 0.0
            return Offer(True, evicted)
        weight = self._weight(cost, miss=True)  # first: it may rescale every value
        value = self._ghosts.pop(key, 0.0) + weight
        evicted = None
        if len(self._held) >= self.capacity:
            evicted = self.victim()
            if self.config.admission and value <= self._held[evicted]:
                self._remember(key, value)
                return Offer(False)
            self._drop(evicted)
        self._held[key] = value
        self._set(key, value)
        return Offer(True, evicted)

    def discard(self, key: K) -> None:
        """The cache dropped a held key on its own; its value is remembered (a ghost)."""
        if key not in self._held:
            raise KeyError(f"discard of a key not held: {key!r}")
        if self._lru:
            del self._held[key]
        else:
            self._drop(key)

    # --- internals --------------------------------------------------------------------------

    def _weight(self, cost: float, miss: bool) -> float:
        """cost x 2 ** (misses / half-life), a miss (an offer) counted first."""
        if not cost > 0:
            raise ValueError(f"a use's cost must be positive, got {cost}")
        self._misses += miss
        exponent = self._misses / self._half_life
        if exponent > _RESCALE_EXPONENT:
            self._rescale(2.0 ** -exponent)
            exponent = 0.0
        return cost * 2.0 ** exponent

    def _rescale(self, factor: float) -> None:
        """Every value times `factor`, the weights' base moved to now (order unchanged)."""
        for values in (self._held, self._ghosts):
            for key in values:
                values[key] *= factor
        self._misses = 0
        self._heap, self._stamp = [], {}
        for key, value in self._held.items():
            self._set(key, value)

    def _set(self, key: K, value: float) -> None:
        self._held[key] = value
        stamp = self._stamp[key] = next(self._stamps)
        heapq.heappush(self._heap, (value, stamp, key))
        if len(self._heap) > 4 * len(self._held) + 64:  # compact the stale rows
            self._heap = [(v, self._stamp[k], k) for k, v in self._held.items()]
            heapq.heapify(self._heap)

    def _drop(self, key: K) -> None:
        value = self._held.pop(key)
        del self._stamp[key]
        self._remember(key, value)

    def _remember(self, key: K, value: float) -> None:
        self._ghosts[key] = value
        self._ghosts.move_to_end(key)
        while len(self._ghosts) > self._max_ghosts:
            self._ghosts.popitem(last=False)
