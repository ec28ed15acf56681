"""The adapter-affinity ranking and the cluster registry, without Ray: affinity while
the holder is within the load bound, the bound itself, spreading a hot adapter, and
the registry's desired state and lagging replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale.cluster.config import ClusterConfig, RouterConfig
from metrale.cluster.ranking import Heat, ReplicaView, load_bound, preference, rank, tail_pool
from metrale.cluster.registry import ClusterRegistry
from metrale.engine.registry import AdapterSource
from metrale.errors import AdapterExistsError, InvalidNameError, UnknownAdapterError

CFG = RouterConfig(epsilon=0.25, spread_queue=4)


def v(rid, load, ready=(), warm=(), adapter_load=None, idle=0, slots=0):
    return ReplicaView(rid, load, frozenset(ready), frozenset(warm), adapter_load or {}, idle,
                       slots)


IDS = [f"r{i}" for i in range(8)]
ADAPTERS = [f"a{i}" for i in range(200)]


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


def test_a_cold_adapter_lands_on_its_rendezvous_home_within_the_bound():
    """Equal loads, every replica with a free slot: each adapter goes to its own home,
    not to the first replica by id or load, and the homes cover every replica."""
    homes = {}
    for a in ADAPTERS:
        views = [v(rid, 2, idle=1) for rid in IDS]
        homes[a] = rank(a, views, CFG)[0]
        assert homes[a] == preference(a, IDS)[0]
    assert set(homes.values()) == set(IDS)  # the adapters partition over the replicas
    # its home the busiest replica, but within the bound (mean (5 + 28 + 1) / 8 = 4.25,
    # bound ceil(1.25 x 4.25) = 6): still the home, not the least loaded
    a = ADAPTERS[0]
    views = [v(rid, 5 if rid == homes[a] else 4, idle=1) for rid in IDS]
    assert load_bound(views, CFG.epsilon) == 6 and rank(a, views, CFG)[0] == homes[a]


def test_the_same_adapter_has_the_same_home_across_calls_and_view_orders():
    import random
    rng = random.Random(7)
    for a in ADAPTERS[:40]:
        views = [v(rid, 1, idle=1) for rid in IDS]
        first = rank(a, views, CFG)
        for _ in range(5):
            rng.shuffle(views)
            assert rank(a, views, CFG) == first
    # not the view order itself: adapters disagree on their orders
    assert len({tuple(preference(a, IDS)) for a in ADAPTERS[:40]}) > 30


def test_a_hot_adapter_spills_to_its_next_choice_when_its_home_is_over_the_bound():
    a = ADAPTERS[3]
    home, second, third = preference(a, IDS)[:3]
    views = [v(rid, 9 if rid == home else 1, ready={a} if rid == home else (), idle=1)
             for rid in IDS]  # mean (9 + 7 + 1) / 8 = 2.1; bound ceil(1.25 x 2.1) = 3
    assert rank(a, views, CFG)[:2] == [second, third]
    # its next choice over the bound too: the one after
    views = [v(rid, 9 if rid in (home, second) else 1, idle=1) for rid in IDS]
    assert rank(a, views, CFG)[0] == third
    # the second choice holds it now (it spilled there): READY within the bound wins
    views = [v(rid, 9 if rid == home else 1, ready={a} if rid in (home, second) else (),
               idle=1) for rid in IDS]
    assert rank(a, views, CFG)[0] == second


def test_removing_a_replica_moves_only_the_adapters_whose_home_it_was():
    views = [v(rid, 0, idle=1) for rid in IDS]
    before = {a: rank(a, views, CFG)[0] for a in ADAPTERS}
    gone = "r5"
    after = {a: rank(a, [x for x in views if x.replica_id != gone], CFG)[0] for a in ADAPTERS}
    moved = {a for a in ADAPTERS if before[a] != after[a]}
    assert moved == {a for a in ADAPTERS if before[a] == gone} and moved
    # and each moved adapter goes to its second choice, not anywhere
    assert all(after[a] == preference(a, IDS)[1] for a in moved)


def test_a_cold_home_without_a_free_slot_yields_to_the_next_choice_with_one():
    a = ADAPTERS[5]
    home, second = preference(a, IDS)[:2]
    views = [v(rid, 1, idle=0 if rid == home else 1) for rid in IDS]
    assert rank(a, views, CFG)[0] == second


def test_adapters_outside_the_hot_set_land_on_the_tail_pool_first():
    """With a Heat, the tail pool (3 of 8 replicas at tail_fraction 0.375) takes the
    adapters outside the hot set; the hot set has as many adapters as the other replicas
    have slots (5 x 2 = 10), so a tail adapter's landings cannot evict a hot one there."""
    cfg = RouterConfig(epsilon=0.25, spread_queue=4, tail_fraction=0.375)
    pool = tail_pool(IDS, cfg.tail_fraction)
    assert len(pool) == 3 and tail_pool(list(reversed(IDS)), 0.375) == pool
    heat = Heat(half_life_s=5.0)
    for i, a in enumerate(ADAPTERS[:30]):  # a0 hottest, then fewer requests each
        for _ in range(30 - i):
            heat.record(a, 0.0)
    views = [v(rid, 1, idle=1, slots=2) for rid in IDS]
    hot = [a for a in ADAPTERS[:30] if rank(a, views, cfg, heat)[0] not in pool]
    assert hot == ADAPTERS[:10]
    for a in ADAPTERS[10:30] + ["never-seen"]:
        order = rank(a, views, cfg, heat)
        assert set(order[:3]) == pool and order[0] == preference(a, pool)[0]
    # without a Heat (or with too few replicas for a pool) every adapter may be anywhere
    assert rank("never-seen", views, cfg)[0] == preference("never-seen", IDS)[0]
    assert tail_pool(["r0", "r1"], 0.375) == frozenset()


def test_heat_decays_so_a_new_hot_set_takes_over():
    heat = Heat(half_life_s=1.0)
    for _ in range(20):
        heat.record("old", 0.0)
    for t in range(10):
        heat.record("new", 10.0 + t * 0.01)
        heat.record(f"cold{t}", 10.0)
    assert heat.count("old", 10.0) < heat.count("new", 10.1)
    assert heat.is_hot("new", 1) and not heat.is_hot("old", 1)
    assert heat.is_hot("anything", 100)  # fewer adapters seen than the hot set: all fit


def test_configs_are_validated():
    with pytest.raises(ValueError):
        RouterConfig(epsilon=-0.1)
    with pytest.raises(ValueError):
        RouterConfig(spread_queue=-1)
    with pytest.raises(ValueError):
        ClusterConfig(replicas=0)
    with pytest.raises(ValueError):
        RouterConfig(tail_fraction=1.0)
    with pytest.raises(ValueError):
        RouterConfig(heat_half_life_s=0)


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
    assert r.heat.count("x", now[0]) == 1  # the router's heat counts what it routed
    r.on_request_completed(a.replica_id, "q1")
    assert r.view(a).load == 0 and "x" in r.view(a).warm  # the same report: still landing
    now[0] += 2 * router_mod.SENT_TTL_S  # a report well after the send: x not READY = evicted
    assert "x" not in r.view(replica("A", {"ready": [], "load": 0})).warm
