"""Adapter-aware admission: adapters take turns, a request past the age bound goes first,
and landings for waiting requests never take a slot that a queued request holds."""

from __future__ import annotations

import time

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig, SchedulerConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Sequence
from tests.helpers.engine import run_until_done
from tests.helpers.reference import check, hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PARAMS = SamplingParams(max_tokens=4)


def _scheduler(max_num_seqs: int, max_wait_s: float = 100.0) -> Scheduler:
    """Ages in these tests are far from the bound, so a slow box cannot flip them."""
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=4,
                       scheduler=SchedulerConfig(max_admission_wait_s=max_wait_s))
    return Scheduler(cfg, BlockManager(64, 4))


def _queue(scheduler: Scheduler, spec: list[tuple[str, str | None, float]]) -> None:
    """(request id, adapter, seconds since arrival) in queue order, all bound."""
    now = time.monotonic()
    for rid, adapter, age in spec:
        seq = Sequence(rid, [1, 2, 3], PARAMS, adapter, arrival=now - age)
        seq.bound = True
        scheduler.add(seq)


def _admitted(scheduler: Scheduler) -> list[str]:
    return [s.request_id for s in scheduler.schedule().seqs]


def test_a_hot_adapter_cannot_take_every_seat():
    s = _scheduler(max_num_seqs=3)
    _queue(s, [("a1", "a", 0.3), ("a2", "a", 0.3), ("a3", "a", 0.2), ("a4", "a", 0.2),
               ("b1", "b", 0.1), ("base1", None, 0.1)])
    assert _admitted(s) == ["a1", "b1", "base1"]
    assert [q.request_id for q in s.waiting] == ["a2", "a3", "a4"]


def test_past_the_age_bound_arrival_order_wins_over_turns():
    s = _scheduler(max_num_seqs=2)
    _queue(s, [("a1", "a", 300.0), ("a2", "a", 250.0), ("b1", "b", 1.0), ("a3", "a", 0.5)])
    # round-robin alone would give a1, b1; a2 waited past the bound, so it goes before b1
    assert _admitted(s) == ["a1", "a2"]


def test_unbound_requests_never_block_runnable_ones():
    s = _scheduler(max_num_seqs=4)
    _queue(s, [("b1", "b", 0.2)])
    s.waiting[0].bound = False  # its adapter is still landing
    _queue(s, [("a1", "a", 0.1), ("base1", None, 0.05)])
    assert _admitted(s) == ["a1", "base1"]


def test_a_landing_never_takes_a_slot_a_queued_request_holds(tmp_path):
    """Slot 0 holds `a` for a queued (admitted later) request, slot 1 holds idle `b`:
    the promotion of `c` must evict b, and the queued request is served by a exactly."""
    base = make_model("llama", seed=4)
    save_model(base, tmp_path / "model")
    peft = {n: make_adapter(base, tmp_path / n, seed=60 + i, r=4, lora_alpha=8,
                            target_modules="all-linear") for i, n in enumerate("abc")}
    llm = LLM(tmp_path / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=1, async_promotions=False)
    engine = llm.engine
    for n in "abc":
        engine.register_adapter(n, tmp_path / n)
    engine.swap_lora_slot_from_disk(tmp_path / "a", "a", 0)
    engine.swap_lora_slot_from_disk(tmp_path / "b", "b", 1)
    ps = prompts(31, 3)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    engine.add_request(ps[0], greedy)  # base model: takes the only seat
    engine.step()
    landings = []
    engine.lora.listeners.append(landings.append)
    queued = engine.add_request(ps[1], greedy, "a")  # bound to slot 0, waits for the seat
    late = engine.add_request(ps[2], greedy, "c")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [(e.name, e.slot, e.evicted) for e in landings] == [("c", 1, "b")]  # not a's slot
    check(outs[queued], *hf_greedy(peft["a"], ps[1]))
    check(outs[late], *hf_greedy(peft["c"], ps[2]))


def test_a_drained_slot_comes_back_only_for_its_own_version(tmp_path):
    """A slot drained for a waiting adapter is reattached by the next request for its
    adapter once nobody older waits for a slot (a younger request never takes the slot
    drained for an older one), but never once that name has a newer version: then the old
    bytes in the drained slot must not serve it, even with the newer version evicted
    meanwhile."""
    base = make_model("llama", seed=4)
    save_model(base, tmp_path / "model")
    peft = {n: make_adapter(base, tmp_path / n, seed=70 + i, r=4, lora_alpha=8,
                            target_modules="all-linear") for i, n in enumerate(["a", "a2", "b", "c", "d"])}
    llm = LLM(tmp_path / "model", max_loras=3, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=128, max_num_seqs=8, async_promotions=False)
    engine = llm.engine
    for n in "abcd":
        engine.register_adapter(n, tmp_path / n)
    for slot, n in enumerate("abd"):
        engine.swap_lora_slot_from_disk(tmp_path / n, n, slot)
    engine.pin_adapter("d")
    ps = prompts(41, 4)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.add_request(ps[0], greedy, "a", request_id="ra")  # least work left: drained first
    engine.add_request(ps[1], long, "b", request_id="rb")
    engine.step()
    engine.add_request(ps[2], greedy, "c", request_id="rc")  # no free slot: a's is drained
    engine.step()
    assert engine.adapters.num_drains == 1 and engine.registry.slot_of("a") is None
    engine.add_request(ps[3], greedy, "a", request_id="ra_young")  # younger than rc: waits
    assert engine.adapters.num_reattached == 0 and engine.registry.slot_of("a") is None
    assert not engine.requests["ra_young"].bound
    engine.abort("ra_young")
    engine.abort("rc")  # nobody waits any more
    engine.add_request(ps[3], greedy, "a", request_id="ra_again")  # undoes the drain
    assert engine.adapters.num_reattached == 1 and engine.registry.slot_of("a") == 0
    engine.add_request(ps[2], greedy, "c", request_id="rc")
    outs = run_until_done(engine)  # ra, ra_again finish on slot 0; c lands once a slot is free
    check(outs["ra_again"], *hf_greedy(peft["a"], ps[3]))
    check(outs["rc"], *hf_greedy(peft["c"], ps[2]))

    # again, but the name moves on to a new version before anyone asks for it
    engine.add_request(ps[0], greedy, "a", request_id="ra2")
    engine.add_request(ps[1], long, "b", request_id="rb2")
    engine.step()
    engine.add_request(ps[2], greedy, "c", request_id="rc2")
    engine.step()
    drained_slot = next(i.slot for i in engine.slot_info()
                        if engine.registry.name_in(i.slot) is None and i.ref_count)
    engine.pin_adapter("d", False)
    free = engine.registry.slot_of("d")
    engine.swap_lora_slot_from_disk(tmp_path / "a2", "a", free)  # a's new version, elsewhere
    engine.step()  # c's landing takes that idle slot: a's new version is evicted
    assert engine.registry.slot_of("a") is None
    # the old bytes are still there, routed by no name
    assert engine.slot_info()[drained_slot].state.value == "READY"
    assert engine.registry.name_in(drained_slot) is None
    engine.add_request(ps[3], greedy, "a", request_id="ra2_again")
    assert engine.registry.slot_of("a") != drained_slot
    outs = run_until_done(engine)
    check(outs["ra2_again"], *hf_greedy(peft["a2"], ps[3]))
