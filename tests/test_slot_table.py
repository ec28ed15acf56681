"""Victim order, identities, references, and a seeded random walk of slot
operations checked against a small independent model of the rules."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import errors
from metrale.pool.slots import SlotState, SlotTable
from tests.helpers.engine import tiny_engine
from tests.helpers.pool import land_disk
from tests.helpers.pool import tiny_llama_slots as _slots


def fill(table: SlotTable, slot: int, version: int) -> int:
    table.begin_load(slot)
    return table.finish_load(slot, version)


def test_victims_placeholders_first_then_lru():
    t = SlotTable(4)
    fill(t, 1, 11)
    assert t.select_victim(routed={1}) == 0  # never-filled placeholder before a filled one
    fill(t, 0, 10)
    fill(t, 3, 13)
    assert t.select_victim(routed={0, 1, 3}) == 2
    fill(t, 2, 12)
    routed = {0, 1, 2, 3}
    # all filled: least recently used idle first; use order 11(1), 10(0), 13(3), 12(2)
    assert t.select_victim(routed=routed) == 1
    assert t.acquire(1) == t.info(1).uid  # touches slot 1, and makes it busy
    assert t.select_victim(routed=routed) == 0
    t.touch(0)
    assert t.select_victim(routed=routed) == 3
    assert t.select_victim(pinned={3}, routed=routed) == 2  # the registry's pins are never victims
    t.acquire(2)
    assert t.select_victim(pinned={3}, routed=routed) == 0
    t.acquire(0)
    with pytest.raises(errors.PoolFullError, match=r"POOL_FULL: all 3 cache slot\(s\) are busy"):
        t.select_victim(pinned={3}, routed=routed)
    with pytest.raises(errors.AllSlotsPinnedError, match="all 4 slot"):
        t.select_victim(pinned=routed, routed=routed)
    t.release(0)
    assert t.select_victim(pinned={3}, routed=routed) == 0
    t.check_integrity()


def test_failed_or_unrouted_slot_is_preferred_over_lru():
    t = SlotTable(3)
    for i in range(3):
        fill(t, i, 10 + i)
    t.unload(2)  # most recently used, but empty now: no name routes to it
    assert t.info(2).state is SlotState.EMPTY and t.info(2).version is None
    assert t.select_victim(routed={0, 1}) == 2
    t.begin_load(2)
    loading = t.info(2).uid  # the failed landing's own
    t.fail_load(2)
    assert t.info(2).state is SlotState.EMPTY and t.info(2).version is None
    assert t.info(2).uid not in (loading, 0)  # a fresh identity: nothing keys on half bytes
    assert t.select_victim(routed={0, 1}) == 2
    # a READY slot no name routes to (its name reloaded elsewhere) also goes before LRU
    fill(t, 2, 12)
    t.touch(1)
    assert t.select_victim(routed={0, 2}) == 1
    t.check_integrity()


def test_holds_only_a_ready_slots_version():
    t = SlotTable(2)
    assert not t.holds(0, 7)
    assert t.begin_load(0) == t.info(0).generation == 1  # the landing's, for its log line
    assert not t.holds(0, 7) and t.info(0).version is None  # LOADING serves nothing
    t.finish_load(0, 7)
    assert t.holds(0, 7) and not t.holds(0, 8) and not t.holds(1, 7)
    t.unload(0)
    assert not t.holds(0, 7)


def test_identity_changes_on_every_swap_and_uids_never_repeat(adapters):
    slots = _slots()
    seen = set()
    for i in range(6):
        slot = i % 2
        version = land_disk(slots, adapters / "a", slot)  # same contents every time
        info = slots.table.info(slot)
        assert info.version == version and info.uid not in seen
        seen.add(info.uid)
        slots.table.check_integrity()
    # a second pool in the same process never reuses a uid either
    other = _slots()
    land_disk(other, adapters / "a", 0)
    assert other.table.info(0).uid not in seen


def test_same_name_elsewhere_unroutes_old_slot(adapters, tiny_model_dir):
    """A new version of a name landed in another slot takes the name's route; the old
    slot keeps serving its in-flight requests under its own identity, routes nothing,
    and is the first victim once idle (after never-filled slots)."""
    engine = tiny_engine(tiny_model_dir)
    table = engine.lora.table
    engine.swap_lora_slot_from_disk(adapters / "a", "a", 0)
    old = engine.registry.current("a")
    uid0 = table.acquire(0)  # a sequence still decodes on slot 0
    engine.swap_lora_slot_from_disk(adapters / "b", "a", 1)  # new contents under the same name
    assert engine.registry.slot_of("a") == 1 and engine.registry.name_in(0) is None
    assert table.holds(1, engine.registry.current("a").version)
    info = table.info(0)
    assert info.version == old.version and info.state is SlotState.READY and info.uid == uid0
    engine.check_integrity()
    table.release(0)
    assert engine.promote_lora_slot_from_disk(adapters / "c", "c") == (2, None)  # never filled
    # the unrouted slot before the least recently used routed one ("a" in slot 1)
    assert engine.promote_lora_slot_from_disk(adapters / "a", "x") == (0, None)
    engine.check_integrity()


def test_promote_marks_most_recent_and_returns_evicted(adapters, tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    promote = engine.promote_lora_slot_from_disk
    assert promote(adapters / "a", "a") == (0, None)
    assert promote(adapters / "b", "b") == (1, None)
    assert promote(adapters / "c", "c") == (2, None)
    # back-to-back promotes evict the oldest first, never the one just promoted
    assert promote(adapters / "a", "x") == (0, "a")
    assert promote(adapters / "b", "y") == (1, "b")
    assert engine.registry.slot_of("a") is None and engine.registry.slot_of("b") is None
    engine.lora.table.acquire(engine.registry.slot_of("c"))
    assert promote(adapters / "a", "z") == (0, "x")
    assert engine.registry.routes() == {"c": 2, "y": 1, "z": 0}
    engine.check_integrity()


class ModelOfRules:
    """An independent, deliberately naive statement of the slot rules. The walk plays
    the registry: it says which slots are routed and pinned."""

    def __init__(self, n):
        self.version = [None] * n
        self.refs = [0] * n
        self.filled = [False] * n
        self.used = [0] * n
        self.clock = 0

    def tick(self):
        self.clock += 1
        return self.clock

    def victim(self, pinned, routed):
        idle = [i for i in range(len(self.version)) if i not in pinned and not self.refs[i]]
        if not idle:
            return None
        never = [i for i in idle if not self.filled[i]]
        if never:
            return never[0]
        unrouted = [i for i in idle if i not in routed]
        return min(unrouted or idle, key=lambda i: (self.used[i], i))

    def free_for_landing(self, pinned, routed):
        return sum(1 for i, v in enumerate(self.version)
                   if v is None or (i not in pinned and (not self.refs[i] or i not in routed)))

    def drain_candidate(self, work, candidates):
        busy = [(work.get(i, 0), self.refs[i], self.used[i], i) for i in candidates
                if self.refs[i] and self.version[i] is not None]
        return min(busy)[3] if busy else None


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_follow_the_rules(seed):
    rng = random.Random(seed)
    n = 4
    table, model = SlotTable(n), ModelOfRules(n)
    routes: dict[str, int] = {}  # the walk's registry: name -> slot
    pinned_names: set[str] = set()
    held: list[int] = []
    uids = set()
    versions = iter(range(1, 10_000))
    for _ in range(400):
        op = rng.choice(["promote", "swap", "acquire", "release", "pin", "unload"])
        name = rng.choice("abcdefg")
        routed = set(routes.values())
        pinned = {routes[p] for p in pinned_names if p in routes}
        if op == "promote":
            want = model.victim(pinned, routed)
            if name in routes:  # the engine would not promote a routed name
                continue
            if want is None:
                error = errors.AllSlotsPinnedError if len(pinned) == n else errors.PoolFullError
                with pytest.raises(error):
                    table.select_victim(pinned, routed)
                continue
            assert table.select_victim(pinned, routed) == want
            op, slot = "swap", want
        else:
            slot = rng.randrange(n)
        if op == "swap":
            if model.refs[slot]:
                with pytest.raises(errors.SlotBusyError):
                    table.begin_load(slot)
                continue
            table.begin_load(slot)
            routes = {k: s for k, s in routes.items() if s != slot}  # the evicted name
            if rng.random() < 0.1:
                table.fail_load(slot)
                model.version[slot] = None
            else:
                version = next(versions)
                uid = table.finish_load(slot, version)
                assert uid not in uids
                uids.add(uid)
                routes[name] = slot  # a name's old slot (if any) routes nothing now
                model.version[slot] = version
                model.used[slot] = model.tick()
            model.filled[slot] = True
        elif op == "acquire":
            if name not in routes:
                continue  # the registry refuses it; the table never sees it
            got = routes[name]
            assert table.acquire(got) == table.info(got).uid
            model.refs[got] += 1
            model.used[got] = model.tick()
            held.append(got)
        elif op == "release" and held:
            s = held.pop(rng.randrange(len(held)))
            table.release(s)
            model.refs[s] -= 1
        elif op == "pin":
            (pinned_names.add if rng.random() < 0.3 else pinned_names.discard)(name)
        elif op == "unload":
            if model.refs[slot]:
                with pytest.raises(errors.SlotBusyError):
                    table.unload(slot)
                continue
            table.unload(slot)
            routes = {k: s for k, s in routes.items() if s != slot}
            model.version[slot] = None
        table.check_integrity()
        for i, info in enumerate(table.infos()):
            assert info.version == model.version[i] and info.ref_count == model.refs[i]
            assert (info.state is SlotState.READY) == (model.version[i] is not None)
            assert table.holds(i, info.version) == (info.version is not None)
        routed = set(routes.values())
        pinned = {routes[p] for p in pinned_names if p in routes}
        assert table.num_free_for_landing(pinned, routed) == model.free_for_landing(pinned, routed)
        work = {i: rng.randrange(3) for i in range(n)}
        assert table.drain_candidate(work, routed - pinned) == \
            model.drain_candidate(work, routed - pinned)


def test_release_without_acquire_is_a_bug():
    t = SlotTable(1)
    with pytest.raises(AssertionError):
        t.release(0)


def test_views_share_one_buffer(adapters):
    slots = _slots()
    pool = slots.pool
    a = pool.lora_a(1, "down_proj")
    assert a.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
    assert a.shape == (3, 8, 96) and a.stride(0) == pool.layout.slot_elems
    land_disk(slots, adapters / "a", 1)
    assert torch.equal(a[1, :4], pool.lora_a(1, "down_proj")[1, :4]) and a[1, :4].any()
    assert not a[1, 4:].any()  # rank padding reads zero
