"""Which replica gets a request for an adapter: affinity with bounded loads.

Pure: the router (router.py) and the simulation (bench/cluster_sim.py) both call
`rank`, tests call it without Ray. Tiers, best first:
  1. the adapter is READY there and the replica is within the load bound;
  2. the adapter is landing there (or in its host tier), within the bound;
  3. within the bound, a replica that can land it now (a free or idle slot: no wait
     for a busy slot to drain), least loaded first;
  4. a holder over the bound, when no replica within it has a slot free now
     (RouterConfig.stall_over_bound); then everything else, least loaded first.
The bound: no replica takes more than ceil((1 + epsilon) x mean load) requests for
affinity's sake (the mean counts the request being placed), so a hot adapter cannot
pile onto the one replica that holds it ("prefer loaded" hotspots). Spreading: once
every holder within the bound has `spread_queue` of the adapter's requests in
flight, tier 3's best replica goes first, and the adapter gains a replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


def load_bound(views: Sequence[ReplicaView], epsilon: float) -> int:
    """The most requests a replica may hold after taking this one, for affinity."""
    total = sum(v.load for v in views) + 1
    return max(1, math.ceil((1.0 + epsilon) * total / len(views)))


def rank(adapter: str | None, views: Sequence[ReplicaView], cfg: RouterConfig) -> list[str]:
    """Replica ids, most preferred first (every view appears exactly once)."""
    if not views:
        return []
    by_load = sorted(views, key=lambda v: (v.load, -v.idle_slots, v.replica_id))
    if adapter is None:
        return [v.replica_id for v in by_load]
    bound = load_bound(views, cfg.epsilon)
    within = [v for v in by_load if v.load + 1 <= bound]
    ready = [v for v in within if adapter in v.ready]
    warm = [v for v in within if adapter not in v.ready and adapter in v.warm]
    # among holders, the one with fewest of this adapter's requests, then least loaded
    ready.sort(key=lambda v: (v.adapter_load.get(adapter, 0), v.load, v.replica_id))
    taken = {v.replica_id for v in ready + warm}
    cold = [v for v in within if v.replica_id not in taken]
    cold.sort(key=lambda v: (v.idle_slots == 0, v.load, v.replica_id))
    free = [v for v in cold if v.idle_slots]
    taken |= {v.replica_id for v in free}
    # No replica within the bound can land it without waiting for a busy slot to drain
    # (a whole request's time): then a holder, even over the bound, runs it at once in
    # its batch, which costs one more row in a step.
    over = [v for v in by_load if v.replica_id not in taken and adapter in v.ready]
    if not cfg.stall_over_bound:
        over = []
    taken |= {v.replica_id for v in over}
    rest = free + over + [v for v in by_load if v.replica_id not in taken]
    holders = ready + warm
    if holders and cfg.spread_queue and rest and rest[0].load + 1 <= bound and all(
            v.adapter_load.get(adapter, 0) >= cfg.spread_queue for v in holders):
        return [rest[0].replica_id] + [v.replica_id for v in holders] + \
               [v.replica_id for v in rest[1:]]
    return [v.replica_id for v in holders + rest]
