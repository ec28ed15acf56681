"""The adapter-affinity ranking and the cluster registry, without Ray: affinity while
the holder is within the load bound, the bound itself, spreading a hot adapter, and
the registry's desired state and lagging replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale.cluster.config import ClusterConfig, RouterConfig
from metrale.cluster.ranking import ReplicaView, load_bound, rank
from metrale.cluster.registry import ClusterRegistry
from metrale.engine.registry import AdapterSource
from metrale.errors import AdapterExistsError, InvalidNameError, UnknownAdapterError

CFG = RouterConfig(epsilon=0.25, spread_queue=4)


def v(rid, load, ready=(), warm=(), adapter_load=None, idle=0):
    return ReplicaView(rid, load, frozenset(ready), frozenset(warm), adapter_load or {}, idle)


def test_ready_holder_first_when_within_bound():
    views = [v("r0", 2), v("r1", 3, ready={"x"}, adapter_load={"x": 1}), v("r2", 2)]
    assert rank("x", views, CFG)[0] == "r1"


def test_landing_beats_cold_and_ready_beats_landing():
    views = [v("r0", 0), v("r1", 1, warm={"x"}), v("r2", 1, ready={"x"})]
    assert rank("x", views, CFG) == ["r2", "r1", "r0"]


def test_holder_over_the_bound_is_passed_over():
    # mean with this request = (9 + 0 + 0 + 1) / 3 = 3.33; bound ceil(1.25 * 3.33) = 5
    views = [v("hot", 9, ready={"x"}), v("r1", 0, idle=1), v("r2", 0, idle=1)]
    assert load_bound(views, CFG.epsilon) == 5
    order = rank("x", views, CFG)
    assert order[0] in ("r1", "r2") and order[-1] == "hot"


def test_over_the_bound_holder_beats_waiting_for_a_busy_slot():
    """Every replica within the bound would have to wait for a busy slot to drain (a whole
    request's time); the holder runs it now, one more row in its batch."""
    views = [v("hot", 9, ready={"x"}), v("r1", 0), v("r2", 0)]
    assert rank("x", views, CFG)[0] == "hot"
    assert rank("x", views, RouterConfig(epsilon=0.25, spread_queue=4,
                                         stall_over_bound=False))[0] in ("r1", "r2")


def test_epsilon_sets_how_far_affinity_may_load():
    views = [v("hot", 4, ready={"x"}), v("r1", 1, idle=1)]
    assert rank("x", views, RouterConfig(epsilon=1.0, spread_queue=0))[0] == "hot"  # bound 6
    assert rank("x", views, RouterConfig(epsilon=0.0, spread_queue=0))[0] == "r1"  # bound 3


def test_hot_adapter_spreads_when_every_holder_has_its_queue():
    views = [v("r0", 4, ready={"x"}, adapter_load={"x": 4}), v("r1", 3, idle=1), v("r2", 5)]
    assert rank("x", views, CFG)[0] == "r1"
    calm = [v("r0", 3, ready={"x"}, adapter_load={"x": 3}), v("r1", 3, idle=1), v("r2", 5)]
    assert rank("x", calm, CFG)[0] == "r0"
    assert rank("x", views, RouterConfig(spread_queue=0))[0] == "r0"  # never spread


def test_among_holders_the_one_with_fewer_of_its_requests():
    views = [v("r0", 2, ready={"x"}, adapter_load={"x": 2}), v("r1", 2, ready={"x"})]
    assert rank("x", views, CFG)[0] == "r1"


def test_base_requests_and_cold_adapters_go_to_the_least_loaded():
    views = [v("r0", 3), v("r1", 1), v("r2", 1, idle=2)]
    assert rank(None, views, CFG) == ["r2", "r1", "r0"]
    assert rank("cold", views, CFG)[0] == "r2"  # an idle slot: nothing evicted


def test_every_replica_ranked_once():
    views = [v(f"r{i}", i % 3, ready={"x"} if i % 2 else ()) for i in range(7)]
    assert sorted(rank("x", views, CFG)) == sorted(x.replica_id for x in views)
    assert rank("x", [], CFG) == []


def test_configs_are_validated():
    with pytest.raises(ValueError):
        RouterConfig(epsilon=-0.1)
    with pytest.raises(ValueError):
        RouterConfig(spread_queue=-1)
    with pytest.raises(ValueError):
        ClusterConfig(replicas=0)


def test_registry_desired_state_and_lagging_replicas():
    now = [100.0]
    reg = ClusterRegistry(reserved_names=("base",), clock=lambda: now[0])
    src = AdapterSource(path=Path("/adapters/a"))
    v1 = reg.register("a", src, pinned=False, reload=False)
    with pytest.raises(AdapterExistsError):
        reg.register("a", src, pinned=False, reload=False)
    with pytest.raises(InvalidNameError):
        reg.check_new("base", False)
    reg.report("r0", v1, "127.0.0.1:1", "http://r0", {"a": reg.get("a").version}, {})
    reg.report("r1", v1 - 1, "127.0.0.1:2", "http://r1", {}, {})
    assert reg.lagging(v1) == ["r1"]
    v2 = reg.register("a", src, pinned=True, reload=True)
    assert reg.desired()["a"].pinned and reg.desired()["a"].version > 0
    assert sorted(reg.lagging(v2)) == ["r0", "r1"]
    now[0] += 4
    reg.beat("r1")  # busy applying a change: no poll, but alive
    now[0] += 4
    assert reg.lagging(v2) == ["r1"]  # r0 quiet for 8 s counts as dead, r1 beat 4 s ago
    now[0] += 60  # r1 stopped polling (died): it no longer holds changes back
    reg.report("r0", v2, "127.0.0.1:1", "http://r0", {}, {})
    assert reg.lagging(v2) == []
    reg.unload("a")
    assert "a" not in reg.desired()
    with pytest.raises(UnknownAdapterError):
        reg.set_pinned("a", True)


def test_router_counts_what_it_sent_until_a_fresh_report():
    """The Ray router's own bookkeeping, without a cluster: in-flight counts between
    reports, and an adapter it just sent somewhere counts as landing there until a
    report newer than that arrives."""
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from metrale.cluster import router as router_mod

    now = [100.0]
    r = object.__new__(router_mod.AdapterAffinityRouter)  # its state only: no Ray router
    r.initialize_state(epsilon=0.5, spread_queue=8, clock=lambda: now[0])

    def replica(rid, stats):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)

    def pending(adapter, rid_):
        return SimpleNamespace(kwargs={"adapter": adapter},
                               metadata=SimpleNamespace(internal_request_id=rid_))

    a = replica("A", {"ready": [], "load": 0, "idle_slots": 1})
    r.on_request_routed(pending("x", "q1"), a.replica_id, None)
    view = r.view(a)
    assert view.load == 1 and "x" in view.warm and view.adapter_load["x"] == 1
    r.on_request_completed(a.replica_id, "q1")
    assert r.view(a).load == 0 and "x" in r.view(a).warm  # the same report: still landing
    now[0] += 2 * router_mod.SENT_TTL_S  # a report well after the send: x not READY = evicted
    assert "x" not in r.view(replica("A", {"ready": [], "load": 0})).warm
