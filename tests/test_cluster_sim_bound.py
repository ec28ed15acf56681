"""bench/cluster_sim.py's clairvoyant bound (Belady's MIN over the cluster's slots as one
cache) against brute force: every eviction choice tried on small random traces."""

from __future__ import annotations

import random

from bench.cluster_sim import Request, clairvoyant_hit_rate


def best_hit_rate(trace: list[int], capacity: int) -> float:
    """The most hits any demand-filled cache of `capacity` gets on `trace`, by search."""
    def hits(i: int, held: frozenset) -> int:
        if i == len(trace):
            return 0
        a = trace[i]
        if a in held:
            return 1 + hits(i + 1, held)
        if len(held) < capacity:
            return hits(i + 1, held | {a})
        return max(hits(i + 1, (held - {v}) | {a}) for v in held)

    return hits(0, frozenset()) / len(trace)


def test_min_equals_the_best_of_every_eviction_choice():
    rng = random.Random(3)
    for _ in range(300):
        adapters, capacity = rng.randint(1, 5), rng.randint(1, 3)
        trace = [rng.randrange(adapters) for _ in range(rng.randint(1, 11))]
        load = [Request(i, a, float(i), 1, 1) for i, a in enumerate(trace)]
        assert clairvoyant_hit_rate(load, capacity) == best_hit_rate(trace, capacity), \
            (trace, capacity)
