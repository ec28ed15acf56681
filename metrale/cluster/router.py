"""AdapterAffinityRouter: Ray Serve's public RequestRouter API over ranking.rank.

Between two stats reports the router counts what it sent where itself, so a burst is
balanced before the next report and a just-sent adapter counts as landing; every request
passes here, so the adapters' request rates (ranking.Heat) need no report.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from metrale.cluster.config import RouterConfig
from metrale.cluster.ranking import Heat, ReplicaView, rank


def request_adapter(pending: PendingRequest | None) -> str | None:
    """The adapter the request names: the `adapter` keyword of EngineReplica.generate."""
    if pending is None:
        return None
    return pending.kwargs.get("adapter") or None


# What we sent is "landing there" until a report newer than this many seconds arrives;
# a report covers what was sent well before it (landed: READY; evicted since: gone).
SENT_TTL_S = 1.0


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, clock=time.monotonic, **config) -> None:
        """config: RouterConfig's fields (launch.py passes them as the router's kwargs)."""
        self.config = RouterConfig(**config)
        self._clock = clock
        self.heat = Heat(self.config.heat_half_life_s)
        self._inflight: dict[str, Counter] = defaultdict(Counter)  # replica -> adapter -> n
        self._requests: dict[str, tuple[str, str]] = {}  # internal id -> (replica, adapter)
        # replica -> adapter -> when last sent there: "landing" until stats catch up
        self._sent: dict[str, dict[str, float]] = defaultdict(dict)
        self._stats_seen: dict[str, dict] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        adapter = request_adapter(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self.view(r) for r in candidate_replicas]
        return [[by_id[rid]] for rid in rank(adapter, views, self.config, self.heat)]

    def view(self, replica: RunningReplica) -> ReplicaView:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        mine = self._inflight.get(rid, Counter())
        adapter_load = Counter(stats.get("adapter_load", {}))
        for name, n in mine.items():
            adapter_load[name] = max(adapter_load[name], n)
        ready = frozenset(stats.get("ready", ()))
        now = self._clock()
        sent = self._sent[rid]
        if stats is not self._stats_seen.get(rid):  # a fresh report: it knows what we sent
            self._stats_seen[rid] = stats         # before it, landed or not (then: evicted)
            for adapter in [a for a, t in sent.items() if now - t > SENT_TTL_S]:
                del sent[adapter]
        return ReplicaView(
            replica_id=rid, load=max(int(stats.get("load", 0)), sum(mine.values())),
            ready=ready, warm=frozenset(stats.get("warm", ())) | (set(sent) - ready),
            adapter_load=dict(adapter_load), idle_slots=int(stats.get("idle_slots", 0)),
            slots=int(stats.get("slots", 0)))

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        adapter = request_adapter(pending_request) or ""
        rid = replica_id.unique_id
        self._inflight[rid][adapter] += 1
        self._requests[pending_request.metadata.internal_request_id] = (rid, adapter)
        if adapter:
            self._sent[rid][adapter] = self._clock()
            self.heat.record(adapter, self._clock())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        rid, adapter = self._requests.pop(internal_request_id, (None, None))
        if rid is not None:
            self._inflight[rid][adapter] -= 1
            if self._inflight[rid][adapter] <= 0:
                del self._inflight[rid][adapter]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self._inflight.pop(rid, None)
        self._sent.pop(rid, None)
        self._stats_seen.pop(rid, None)
        self._requests = {k: v for k, v in self._requests.items() if v[0] != rid}
