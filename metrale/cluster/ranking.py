"""Which replica gets a request for an adapter: rendezvous homes with bounded loads.

Pure: the router (router.py) and the simulation (bench/cluster_sim.py) both call `rank`,
tests call it without Ray. docs/DESIGN.md ("Routing") gives the tiers and their reasons:
homes make the replicas' slots partition the adapters instead of all caching the same hot
ones, and the tail pool makes the Zipf tail's landings evict each other, not hot adapters.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from metrale.cluster.config import RouterConfig


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    load: int  # requests in flight there (running + waiting)
    ready: frozenset[str] = frozenset()  # adapters READY in a slot
    warm: frozenset[str] = frozenset()  # adapters landing there or in its host tier
    adapter_load: Mapping[str, int] = field(default_factory=dict)  # in flight, per adapter
    idle_slots: int = 0  # slots a promotion could take now (EMPTY, or READY with no requests)
    slots: int = 0  # adapter slots in all (0: not reported)


def load_bound(views: Sequence[ReplicaView], epsilon: float) -> int:
    """The most requests a replica may hold after taking this one, for affinity."""
    total = sum(v.load for v in views) + 1
    return max(1, math.ceil((1.0 + epsilon) * total / len(views)))


@functools.lru_cache(maxsize=1 << 16)
def weight(key: str, replica_id: str) -> int:
    """The rendezvous weight of (key, replica): the same in every process and run
    (Python's str hash is salted per process)."""
    data = key.encode() + b"\0" + replica_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def preference(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids in the key's rendezvous order, its home first."""
    return sorted(replica_ids, key=lambda rid: (-weight(key, rid), rid))


TAIL_KEY = "\0tail-pool"


def tail_pool(replica_ids: Sequence[str], fraction: float) -> frozenset[str]:
    """The replicas that take adapters outside the hot set first (never all of them)."""
    n = min(int(fraction * len(replica_ids)), len(replica_ids) - 1)
    return frozenset(preference(TAIL_KEY, replica_ids)[:max(0, n)])


class Heat:
    """Each adapter's recent request count, decayed with `half_life_s`, and whether it
    is among the `size` hottest. Pure: the caller passes the time."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._t0 = None  # counts are stored scaled to this time
        self._raw: dict[str, float] = {}
        self._threshold: dict[int, float] = {}  # size -> the size-th largest raw count
        self._stale = 0  # records since the thresholds were computed

    def record(self, adapter: str, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
        age = (now - self._t0) / self.half_life_s
        if age > 30:  # rescale before the raw counts grow too large; forget the cold
            f = 2.0 ** -age
            self._raw = {a: c * f for a, c in self._raw.items() if c * f > 1e-3}
            self._t0, age = now, 0.0
        self._raw[adapter] = self._raw.get(adapter, 0.0) + 2.0 ** age
        self._stale += 1
        if self._stale >= 16:
            self._threshold.clear()
            self._stale = 0

    def count(self, adapter: str, now: float) -> float:
        if self._t0 is None:
            return 0.0
        return self._raw.get(adapter, 0.0) * 2.0 ** (-(now - self._t0) / self.half_life_s)

    def is_hot(self, adapter: str, size: int) -> bool:
        """Among the `size` adapters with the most recent requests (ties: hot). With no
        more than `size` adapters seen, every adapter is: they all fit."""
        if len(self._raw) <= size:
            return True
        if size not in self._threshold:
            self._threshold[size] = heapq.nlargest(size, self._raw.values())[-1] if size else math.inf
        return self._raw.get(adapter, 0.0) >= self._threshold[size]


def rank(adapter: str | None, views: Sequence[ReplicaView], cfg: RouterConfig,
         heat: Heat | None = None) -> list[str]:
    """Replica ids, most preferred first (every view appears exactly once)."""
    if not views:
        return []
    by_load = sorted(views, key=lambda v: (v.load, -v.idle_slots, v.replica_id))
    if adapter is None:
        return [v.replica_id for v in by_load]
    ids = [v.replica_id for v in views]
    order = preference(adapter, ids)
    pool = tail_pool(ids, cfg.tail_fraction) if heat is not None else frozenset()
    hot_slots = sum(v.slots for v in views if v.replica_id not in pool)
    if pool and hot_slots:
        first_tail = not heat.is_hot(adapter, hot_slots)
        order = [r for r in order if (r in pool) == first_tail] + \
                [r for r in order if (r in pool) != first_tail]
    pos = {rid: i for i, rid in enumerate(order)}
    bound = load_bound(views, cfg.epsilon)
    within = [v for v in by_load if v.load + 1 <= bound]
    ready = [v for v in within if adapter in v.ready]
    warm = [v for v in within if adapter not in v.ready and adapter in v.warm]
    ready.sort(key=lambda v: (v.adapter_load.get(adapter, 0), v.load, v.replica_id))
    taken = {v.replica_id for v in ready + warm}
    # a slot free now first (else the landing waits a whole request for one to drain),
    # then the adapter's own order: its home unless that is over the bound
    free = sorted((v for v in within if v.replica_id not in taken and v.idle_slots),
                  key=lambda v: pos[v.replica_id])
    taken |= {v.replica_id for v in free}
    # No replica within the bound can land it without waiting for a busy slot to drain
    # (a whole request's time): then a holder, even over the bound, runs it at once in
    # its batch, which costs one more row in a step.
    over = ([v for v in by_load if v.replica_id not in taken and adapter in v.ready]
            if cfg.stall_over_bound else [])
    taken |= {v.replica_id for v in over}
    rest = free + over + [v for v in by_load if v.replica_id not in taken]
    holders = ready + warm
    if holders and cfg.spread_queue and rest and rest[0].load + 1 <= bound and all(
            v.adapter_load.get(adapter, 0) >= cfg.spread_queue for v in holders):
        return [rest[0].replica_id] + [v.replica_id for v in holders] + \
               [v.replica_id for v in rest[1:]]
    return [v.replica_id for v in holders + rest]
