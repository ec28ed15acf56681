"""bench/cluster_sim.py's references: the clairvoyant bound (Belady's MIN over the cluster's
slots as one cache) against brute force, every eviction choice tried on small random traces;
and the static oracle's pinned slots."""

from __future__ import annotations

import random
from collections import Counter

from bench.cluster_sim import Cluster, Request, ServiceTimes, arrivals, clairvoyant_hit_rate
from metrale.cluster.config import RouterConfig


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


def test_the_static_oracle_pins_the_most_frequent_adapters_and_never_evicts_them():
    """Two replicas of four slots, two pinned each: the pinned slots hold the trace's most
    frequent adapters (the top one in two copies: a quarter of the traffic over a 0.2 share)
    from start to end, while the tail's landings go to the other slots."""
    load = arrivals(60, 1.1, 40.0, 10.0, None, seed=1)
    cluster = Cluster("oracle_static", 2, 4, 8, 32, ServiceTimes(0.004, 1e-4, 0.02, 0.03, "test"),
                      RouterConfig(), seed=0)
    cluster.pin_frequent(load, 2, 0.2)
    pinned = [[s.adapter for s in r.slots[:2]] for r in cluster.replicas]
    counts = Counter(r.adapter for r in load).most_common()
    assert counts[0][1] / len(load) > 0.2
    assert sorted(a for row in pinned for a in row) == sorted(
        [counts[0][0]] * 2 + [counts[1][0], counts[2][0]])
    cluster.run(load)
    assert [[s.adapter for s in r.slots[:2]] for r in cluster.replicas] == pinned
    assert sum(r.promotions for r in cluster.replicas) > 10  # the tail churned the rest
    top = [r for r in cluster.done if r.adapter == counts[0][0]]
    assert top and all(r.hit for r in top)


def test_requests_hold_their_slot_from_arrival_so_no_landing_is_wasted():
    """The engine binds a request to its slot when the adapter is READY (at arrival or at its
    landing's commit), so a landing never evicts an adapter whose requests still wait to run:
    every landing serves a request that missed. Under a load that keeps the batch full, the
    promotions never outnumber the misses (a model that took the reference only when the batch
    admitted the request landed ~3x more often than it missed)."""
    load = arrivals(200, 1.1, 400.0, 5.0, None, seed=2)
    for policy in ("metrale", "ray_multiplex", "round_robin"):
        cluster = Cluster(policy, 2, 4, 8, 64, ServiceTimes(0.004, 1e-4, 0.02, 0.03, "test"),
                          RouterConfig(), seed=0)
        cluster.run([Request(r.id, r.adapter, r.arrival, r.tokens, r.prompt) for r in load])
        misses = sum(not r.hit for r in cluster.done)
        promotions = sum(r.promotions for r in cluster.replicas)
        assert len(cluster.done) == len(load)
        assert 0 < promotions <= misses, (policy, promotions, misses)
