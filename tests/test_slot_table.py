"""Victim order, identities, references, and a seeded random walk of slot
operations checked against a small independent model of the rules."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import errors
from metrale.pool.slots import SlotState, SlotTable
from tests.helpers.pool import tiny_llama_slots as _slots


def fill(table: SlotTable, slot: int, name: str) -> int:
    table.begin_load(slot)
    return table.finish_load(slot, name)


def test_victims_placeholders_first_then_lru():
    t = SlotTable(4)
    fill(t, 1, "a")
    assert t.select_victim() == 0  # never-filled placeholder before a filled one
    fill(t, 0, "b")
    fill(t, 3, "c")
    assert t.select_victim() == 2
    fill(t, 2, "d")
    # all filled: least recently used idle first; use order a(1), b(0), c(3), d(2)
    assert t.select_victim() == 1
    t.acquire("a")  # touches a, and makes it busy
    assert t.select_victim() == 0
    t.touch(0)
    assert t.select_victim() == 3
    t.set_pinned(3, True)
    assert t.select_victim() == 2
    t.acquire("d")
    assert t.select_victim() == 0
    t.acquire("b")
    with pytest.raises(errors.PoolFullError, match=r"POOL_FULL: all 3 cache slot\(s\) are busy"):
        t.select_victim()
    t.release(0)
    assert t.select_victim() == 0
    t.check_integrity()


def test_failed_or_unloaded_slot_is_preferred_over_lru():
    t = SlotTable(3)
    for i, n in enumerate("abc"):
        fill(t, i, n)
    t.unload(2)  # most recently used, but empty now
    assert t.select_victim() == 2
    t.begin_load(2)
    t.fail_load(2)
    assert t.select_victim() == 2


def test_identity_changes_on_every_swap_and_uids_never_repeat(adapters):
    slots = _slots()
    seen = set()
    for i in range(6):
        slot = i % 2
        slots.swap_lora_slot_from_disk(adapters / "a", "a", slot)  # same name, same contents
        info = slots.table.info(slot)
        assert info.uid not in seen
        seen.add(info.uid)
        slots.table.check_integrity()
    # a second pool in the same process never reuses a uid either
    other = _slots()
    other.swap_lora_slot_from_disk(adapters / "a", "a", 0)
    assert other.table.info(0).uid not in seen


def test_same_name_elsewhere_detaches_old_slot(adapters):
    slots = _slots()
    slots.swap_lora_slot_from_disk(adapters / "a", "a", 0)
    slot0, uid0 = slots.table.acquire("a")  # a sequence still decodes on slot 0
    slots.swap_lora_slot_from_disk(adapters / "b", "a", 1)  # new contents under the same name
    assert slots.table.slot_of("a") == 1
    old = slots.table.info(0)
    assert old.name is None and old.state is SlotState.READY and old.uid == uid0
    slots.table.check_integrity()
    slots.table.release(slot0)
    assert slots.table.select_victim() == 2  # never-filled still first
    slots.swap_lora_slot_from_disk(adapters / "c", "c", 2)
    assert slots.table.select_victim() == 0  # detached before LRU


def test_promote_marks_most_recent_and_returns_evicted(adapters):
    slots = _slots()
    assert slots.promote_lora_slot_from_disk(adapters / "a", "a") == (0, None)
    assert slots.promote_lora_slot_from_disk(adapters / "b", "b") == (1, None)
    assert slots.promote_lora_slot_from_disk(adapters / "c", "c") == (2, None)
    # back-to-back promotes evict the oldest first, never the one just promoted
    assert slots.promote_lora_slot_from_disk(adapters / "a", "x") == (0, "a")
    assert slots.promote_lora_slot_from_disk(adapters / "b", "y") == (1, "b")
    slots.table.acquire("c")
    assert slots.promote_lora_slot_from_disk(adapters / "a", "z") == (0, "x")
    slots.table.check_integrity()


class ModelOfRules:
    """An independent, deliberately naive statement of the slot rules."""

    def __init__(self, n):
        self.name = [None] * n
        self.refs = [0] * n
        self.pinned = [False] * n
        self.filled = [False] * n
        self.used = [0] * n
        self.clock = 0

    def tick(self):
        self.clock += 1
        return self.clock

    def victim(self):
        idle = [i for i in range(len(self.name)) if not self.pinned[i] and not self.refs[i]]
        if not idle:
            return None
        never = [i for i in idle if not self.filled[i]]
        if never:
            return never[0]
        empty = [i for i in idle if self.name[i] is None]
        pool = empty or idle
        return min(pool, key=lambda i: (self.used[i], i))


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_follow_the_rules(seed):
    rng = random.Random(seed)
    n = 4
    table, model = SlotTable(n), ModelOfRules(n)
    held: list[int] = []
    uids = set()
    for _ in range(400):
        op = rng.choice(["promote", "swap", "acquire", "release", "pin", "unload"])
        name = rng.choice("abcdefg")
        if op == "promote":
            want = model.victim()
            if name in model.name:  # the engine would not promote a resident name
                continue
            if want is None:
                with pytest.raises(errors.PoolFullError):
                    table.select_victim()
                continue
            assert table.select_victim() == want
            op, slot = "swap", want
        else:
            slot = rng.randrange(n)
        if op == "swap":
            if model.refs[slot]:
                with pytest.raises(errors.SlotBusyError):
                    table.begin_load(slot)
                continue
            table.begin_load(slot)
            if rng.random() < 0.1:
                table.fail_load(slot)
                model.name[slot] = None
            else:
                uid = table.finish_load(slot, name)
                assert uid not in uids
                uids.add(uid)
                if name in model.name:  # detached: unnamed, so nobody could unpin it
                    old = model.name.index(name)
                    model.name[old], model.pinned[old] = None, False
                model.name[slot] = name
                model.used[slot] = model.tick()
            model.filled[slot] = True
        elif op == "acquire":
            if name not in model.name:
                with pytest.raises(errors.UnknownAdapterError):
                    table.acquire(name)
                continue
            got, _ = table.acquire(name)
            assert got == model.name.index(name)
            model.refs[got] += 1
            model.used[got] = model.tick()
            held.append(got)
        elif op == "release" and held:
            s = held.pop(rng.randrange(len(held)))
            table.release(s)
            model.refs[s] -= 1
        elif op == "pin":
            flag = rng.random() < 0.3
            table.set_pinned(slot, flag)
            model.pinned[slot] = flag
        elif op == "unload":
            if model.refs[slot]:
                with pytest.raises(errors.SlotBusyError):
                    table.unload(slot)
                continue
            table.unload(slot)
            model.name[slot] = None
            model.pinned[slot] = False
        table.check_integrity()
        for i, info in enumerate(table.infos()):
            assert info.name == model.name[i] and info.ref_count == model.refs[i]
            if model.name[i] is not None:
                assert info.state is SlotState.READY


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
    slots.swap_lora_slot_from_disk(adapters / "a", "a", 1)
    assert torch.equal(a[1, :4], pool.lora_a(1, "down_proj")[1, :4]) and a[1, :4].any()
    assert not a[1, 4:].any()  # rank padding reads zero
