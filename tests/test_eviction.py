"""metrale.pool.eviction against hand-worked traces and a brute-force reference, and the
host tier driven by each policy: "lru" is the tier's old LRU exactly; "cost" keeps a
frequently used adapter through a scan of one-off ones, lets it go once it stops being
asked for, and remembers (boundedly) the adapters it dropped."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from metrale.adapters.identity import adapter_identity
from metrale.config import ConfigError, ModelConfig, PoolConfig
from metrale.pool import eviction
from metrale.pool.eviction import EvictionConfig, EvictionPolicy, Offer
from metrale.pool.swap import LoraSlots
from tests.helpers.pool import land_disk
from tests.helpers.tiny_models import hf_config, make_adapter, make_model

COST = EvictionConfig("cost")
LRU = EvictionConfig("lru")


def used(policy: EvictionPolicy, key, times: int = 1) -> Offer:
    """One offer (a miss) then hits: `times` uses of key."""
    offer = policy.offer(key)
    for _ in range(times - 1):
        policy.hit(key)
    return offer


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(policy="lfu"), dict(half_life=0), dict(half_life=-1),
                                dict(half_life=float("nan")), dict(half_life=float("inf")),
                                dict(ghosts=-1), dict(ghosts=float("nan"))])
def test_config_refuses_bad_values(kw):
    with pytest.raises(ConfigError):
        EvictionConfig(**kw)


def test_capacity_and_pool_config_are_checked():
    for capacity in (0, -1, 2.5):
        with pytest.raises(ConfigError):
            EvictionPolicy(capacity)
    with pytest.raises(ConfigError, match="cost, lru"):
        PoolConfig(eviction="fifo")
    assert PoolConfig().eviction == "cost"
    with pytest.raises(ValueError):
        EvictionPolicy(2).offer("a", cost=0)
    policy = EvictionPolicy(2)
    with pytest.raises(KeyError):
        policy.hit("nobody")
    with pytest.raises(KeyError):
        policy.discard("nobody")


# --- lru: the old behaviour, exactly -----------------------------------------------------------


def test_lru_reproduces_lru_order_exactly():
    """Random offers, hits and discards against an OrderedDict LRU (the host tier's code
    before the policy): the same victims, the same order, every step."""
    rng = random.Random(0)
    for capacity in (1, 2, 5):
        policy, ref = EvictionPolicy(capacity, LRU), OrderedDict()
        for _ in range(3000):
            key = rng.randrange(12)
            op = rng.random()
            if key in ref and op < 0.4:
                policy.hit(key)
                ref.move_to_end(key)
            elif key in ref and op < 0.5:
                policy.discard(key)
                del ref[key]
            else:
                want = None
                if key in ref:
                    ref.move_to_end(key)
                else:
                    if len(ref) >= capacity:
                        want = ref.popitem(last=False)[0]
                    ref[key] = True
                offer = policy.offer(key)
                assert offer == Offer(True, want)
            assert policy.keys() == list(ref) and policy.victim() == next(iter(ref), None)


def test_lru_is_flushed_by_a_scan():
    policy = EvictionPolicy(4, LRU)
    used(policy, "hot", 50)
    for i in range(4):
        policy.offer(f"scan{i}")
    assert "hot" not in policy


# --- cost: frequency, aging, ghosts -------------------------------------------------------------


def test_a_scan_of_one_off_keys_does_not_flush_a_frequent_key():
    """Capacity 4: "hot" used 8 times, then 20 one-off keys (five times the capacity). Each
    one-off key's single use is newer, but 8 uses are worth more until about
    log2(8) x half_life x capacity = 60 misses later: "hot" stays, the one-off keys churn."""
    policy = EvictionPolicy(4, COST)
    used(policy, "hot", 8)
    evicted = [policy.offer(f"scan{i}").evicted for i in range(20)]
    assert "hot" in policy
    assert "hot" not in evicted and evicted[:3] == [None] * 3
    assert evicted[3:] == [f"scan{i}" for i in range(17)]  # the oldest one-off goes first


def test_one_use_each_is_lru():
    """Keys used once each are ordered by recency alone: cost degrades to LRU on a scan."""
    policy = EvictionPolicy(3, COST)
    for key in "abcdef":
        policy.offer(key)
    assert policy.keys() == ["d", "e", "f"] and policy.victim() == "d"


def test_aging_lets_a_formerly_hot_key_go():
    """"hot" was used 1,000 times, then only a new working set of 4 keys is asked for
    (capacity 4: hot holds one of their places). Recent uses weigh more: hot goes about
    log2(1000 / 15) ~ 6 half-lives (of 40 uses) after its last use, where without aging
    (an enormous half-life) the newcomers need a thousand uses each to beat it."""
    for half_life, gone in ((10.0, True), (1e12, False)):
        policy = EvictionPolicy(4, EvictionConfig("cost", half_life=half_life))
        used(policy, "hot", 1000)
        uses = 0
        while "hot" in policy and uses < 2000:
            key = f"new{uses % 4}"
            if key in policy:
                policy.hit(key)
            else:
                policy.offer(key)
            uses += 1
        assert ("hot" not in policy) == gone, uses
        if gone:
            assert uses < 300, uses


def test_a_returning_key_is_recognised_and_the_ghost_map_is_bounded():
    policy = EvictionPolicy(2, EvictionConfig("cost", ghosts=3))
    used(policy, "hot", 10)
    policy.discard("hot")  # the cache dropped it (its files changed, say)
    assert "hot" not in policy and policy.value("hot") > 0
    used(policy, "x", 1)
    used(policy, "y", 1)  # capacity 2: x, y held
    policy.offer("hot")  # back: its 10 remembered uses beat x's one
    assert "hot" in policy and "x" not in policy
    assert policy.value("hot") > policy.value("y")
    for i in range(1000):
        policy.offer(f"k{i}")
    assert len(policy) == 2 and policy.num_remembered <= 6
    assert policy.value("k0") == 0.0  # forgotten long ago


def test_admission_refuses_a_newcomer_worth_less_than_the_victim():
    policy = EvictionPolicy(2, EvictionConfig("cost", admission=True))
    used(policy, "a", 5)
    used(policy, "b", 5)
    assert policy.offer("c") == Offer(False)
    assert policy.keys() == ["a", "b"] and policy.value("c") > 0  # remembered
    for _ in range(6):  # asked for again and again: it gets in
        offer = policy.offer("c")
    assert offer.admitted and "c" in policy


def test_cost_weighs_uses():
    """A key dearer to read again (cost 4) outlives an equally used cheap one."""
    policy = EvictionPolicy(2, COST)
    policy.offer("dear", cost=4.0)
    policy.offer("cheap", cost=1.0)
    assert policy.offer("new").evicted == "cheap"


def reference_victims(trace, capacity: int, half_life: float, ghosts: float) -> list:
    """The cost policy by brute force: each key's value recomputed from its remembered uses
    (a use weighs 2 ** (misses so far / (half_life x capacity)); a ghost forgets the oldest
    first), the least valuable (then the least recently updated) goes."""
    h = half_life * capacity
    values, stamps, held, remembered, out, misses = {}, {}, [], OrderedDict(), [], 0
    for t, (_, key) in enumerate(trace, start=1):
        if key in held:  # a hit, or an offer of a held key (one too)
            values[key] += 2.0 ** (misses / h)
            out.append(None)
        else:
            misses += 1
            values[key] = remembered.pop(key, 0.0) + 2.0 ** (misses / h)
            victim = None
            if len(held) >= capacity:
                victim = min(held, key=lambda k: (values[k], stamps[k]))
                held.remove(victim)
                remembered[victim] = values[victim]
                while len(remembered) > int(ghosts * capacity):
                    remembered.popitem(last=False)
            held.append(key)
            out.append(victim)
        stamps[key] = t
    return out


def random_run(policy: EvictionPolicy, rng: random.Random, n: int = 600) -> tuple[list, list]:
    """A skewed random trace of hits and offers: (the trace, the victims each step)."""
    trace, got = [], []
    for _ in range(n):
        key = min(rng.randrange(20), rng.randrange(20))
        if key in policy and rng.random() < 0.7:
            trace.append(("hit", key))
            policy.hit(key)
            got.append(None)
        else:
            trace.append(("offer", key))
            got.append(policy.offer(key).evicted)
        assert len(policy) <= policy.capacity
    return trace, got


# capacity, half-life, ghosts; half-lives of no round number of misses: no exact ties of sums
CASES = ((1, 10.0, 0), (3, 1.37, 1), (4, 2.3, 8), (6, 9.1, 2))


def test_cost_matches_a_brute_force_reference():
    rng = random.Random(1)
    for capacity, half_life, ghosts in CASES:  # exponents stay far below a rescale here
        policy = EvictionPolicy(capacity, EvictionConfig("cost", half_life, ghosts))
        trace, got = random_run(policy, rng)
        assert got == reference_victims(trace, capacity, half_life, ghosts)
        assert sum(v is not None for v in got) > 50  # evictions were compared


def test_rescaling_keeps_the_choices(monkeypatch):
    """Values are rescaled to the newest weight every few misses here (instead of every
    256 half-lives): the same victims as the reference that never rescales; and a tiny
    half-life (2 ** 50 a miss) stays finite over thousands of uses."""
    monkeypatch.setattr(eviction, "_RESCALE_EXPONENT", 1.5)
    rng = random.Random(4)
    for capacity, half_life, ghosts in CASES:
        policy = EvictionPolicy(capacity, EvictionConfig("cost", half_life, ghosts))
        trace, got = random_run(policy, rng)
        assert got == reference_victims(trace, capacity, half_life, ghosts)
    monkeypatch.undo()
    fast = EvictionPolicy(3, EvictionConfig("cost", half_life=0.02))
    random_run(fast, rng, 3000)
    assert all(0 <= fast.value(k) < float("inf") for k in fast.keys())  # the unused may reach 0


# --- the host tier under each policy -------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("eviction")
    base = make_model("llama")
    for i, name in enumerate(("a", "b", "c")):
        make_adapter(base, root / name, seed=i, r=4, lora_alpha=8, target_modules=["q_proj"])
    return root


def _slots(eviction: str, images: float = 2.5) -> LoraSlots:
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    probe = LoraSlots(cfg, PoolConfig(1, 4), "cpu", torch.float32)
    tier = int(images * probe.pool.layout.slot_bytes)
    return LoraSlots(cfg, PoolConfig(3, 4, host_tier_bytes=tier, eviction=eviction), "cpu",
                     torch.float32)


@pytest.mark.parametrize("eviction", ["cost", "lru"])
def test_host_tier_follows_its_policy(adapters, eviction):
    """Room for two images. "a" lands three times (a miss, then two tier hits), "b" once,
    then "c" needs room: LRU drops "a" (used before "b"), cost drops "b" (one use against
    three). A tier that ignored its policy would do the same under both."""
    slots = _slots(eviction)
    tier = slots.host_tier
    assert tier.policy.config.policy == eviction and tier.max_entries == 2
    for name, slot in (("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 1)):
        land_disk(slots, adapters / name, slot)
    held = {k.path for k in tier.keys()}
    assert held == set(tier.policy.keys()) and len(tier) == 2
    gone = "a" if eviction == "lru" else "b"
    assert held == {str((adapters / n).absolute()) for n in "abc" if n != gone}
    assert tier.has(adapter_identity(adapters / "a")) == (eviction == "cost")
    land_disk(slots, adapters / "a", 2)
    assert tier.hits == (3 if eviction == "cost" else 2)
    assert {k.path for k in tier.keys()} == set(tier.policy.keys())


def test_host_tier_admission_refuses_without_storing(adapters):
    """With admission, a newcomer worth less than the victim is not kept: no image, no
    arena row taken, the tier unchanged."""
    slots = _slots("cost", images=1.5)
    tier = slots.host_tier
    tier.policy = EvictionPolicy(1, EvictionConfig("cost", admission=True))
    for slot in range(3):
        land_disk(slots, adapters / "a", slot)  # one miss, two hits
    before = tier.keys()
    land_disk(slots, adapters / "b", 0)
    assert tier.keys() == before and tier.refused == 1
    assert not tier.has(adapter_identity(adapters / "b"))


def test_slot_victims_whose_image_the_tier_holds_go_first():
    """SlotTable: placeholders and unrouted slots first as before, then idle slots named
    `cheap` (least recently used first), then the others; busy and pinned never."""
    from metrale.pool.slots import SlotTable

    t = SlotTable(4)
    for slot in range(4):
        t.begin_load(slot)
        t.finish_load(slot, 10 + slot)  # used in order 0, 1, 2, 3
    routed = {0, 1, 2, 3}
    assert t.select_victim(routed=routed) == 0  # plain LRU
    assert t.select_victim(routed=routed, cheap={2, 3}) == 2
    assert t.select_victim(routed={0, 1, 3}, cheap={2, 3}) == 2  # unrouted first anyway
    assert t.select_victim(routed=routed, cheap={1, 2}, pinned={1}) == 2
    t.acquire(2)
    assert t.select_victim(routed=routed, cheap={2, 3}) == 3  # busy: never
    t.acquire(3)
    assert t.select_victim(routed=routed, cheap={2, 3}) == 0  # no cheap one idle: LRU


@pytest.mark.parametrize("eviction", ["cost", "lru"])
def test_engine_evicts_the_slot_that_comes_back_cheaply(adapters, tiny_model_dir, eviction):
    """Two slots, a tier of one image. "a" lands (tier: a), then "b" (tier: b; a's image
    goes). A third adapter needs a slot: under lru the least recently used, a's; under cost
    b's, whose image the tier holds (a host copy to bring back, where a would need a read)."""
    from tests.helpers.engine import tiny_engine

    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    slot_bytes = LoraSlots(cfg, PoolConfig(1, 8), "cpu", torch.float32).pool.layout.slot_bytes
    engine = tiny_engine(tiny_model_dir, max_loras=2, max_lora_rank=8,
                         host_tier_bytes=int(1.5 * slot_bytes), adapter_eviction=eviction)
    assert engine.lora.host_tier.max_entries == 1
    engine.promote_lora_slot_from_disk(adapters / "a", "a")
    engine.promote_lora_slot_from_disk(adapters / "b", "b")
    tier = engine.lora.host_tier
    assert [k.path for k in tier.keys()] == [str((adapters / "b").absolute())]
    slot, evicted = engine.promote_lora_slot_from_disk(adapters / "c", "c")
    assert evicted == ("b" if eviction == "cost" else "a")
    engine.check_integrity()


def test_serve_flags_reach_the_pool_config():
    from metrale.cli import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices
               and "serve" in a.choices).choices["serve"]
    args = sub.parse_args(["--host-tier-bytes", "1000", "--adapter-eviction", "lru"])
    assert (args.host_tier_bytes, args.adapter_eviction) == (1000, "lru")
    assert sub.parse_args([]).adapter_eviction == "cost"
    with pytest.raises(SystemExit):
        sub.parse_args(["--adapter-eviction", "fifo"])
