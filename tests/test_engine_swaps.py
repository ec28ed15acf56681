"""Adapter operations against a live engine: busy slots refused while their
sequences run, aborts release references, POOL_FULL waiters served in
arrival order, and a same-name reload never served from stale KV."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import PoolFullError, SlotBusyError, UnknownAdapterError
from tests.helpers.engine import run_until_done, step_until_running
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

LONG = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 61, 2, 9, 13, 200]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("swaps")
    base = make_model("llama", seed=4)
    save_model(base, root / "model")
    for i, name in enumerate(("a", "b", "c", "a2")):
        make_adapter(base, root / name, seed=20 + i, r=4, lora_alpha=8, target_modules="all-linear")
    return root


def _llm(root, **kw):
    args = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128, num_kv_blocks=128)
    llm = LLM(root / "model", **{**args, **kw})
    for name in ("a", "b", "c"):
        llm.register_adapter(name, root / name)
    return llm


def test_busy_slot_refused_while_running_then_swappable(root):
    llm = _llm(root)
    engine = llm.engine
    rid = engine.add_request(PROMPT, LONG, "a")
    step_until_running(engine, rid)  # "a" is promoted and its sequence runs
    slot = engine.registry.slot_of("a")
    before = engine.lora.pool.slot_region(slot).clone()
    with pytest.raises(SlotBusyError, match="mid-decode"):
        engine.swap_lora_slot_from_disk(root / "b", "b", slot)
    assert torch.equal(engine.lora.pool.slot_region(slot), before)
    # other slots stay swappable while "a" decodes: quiescence is per slot
    engine.swap_lora_slot_from_disk(root / "b", "b", 1 - slot)
    done = run_until_done(engine)
    assert done[rid].finish_reason == "length"
    engine.swap_lora_slot_from_disk(root / "c", "c", slot)
    assert engine.registry.name_in(slot) == "c"
    engine.check_integrity()


def test_abort_releases_reference(root):
    llm = _llm(root)
    engine = llm.engine
    rid = engine.add_request(PROMPT, LONG, "a")
    step_until_running(engine, rid)
    slot = engine.registry.slot_of("a")
    assert engine.lora.table.ref_count(slot) == 1
    engine.abort(rid)
    assert engine.lora.table.ref_count(slot) == 0
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.swap_lora_slot_from_disk(root / "b", "b", slot)


def test_pool_full_waiters_served_in_arrival_order(root):
    llm = _llm(root, max_loras=1)
    engine = llm.engine
    first = engine.add_request(PROMPT, LONG, "a")
    step_until_running(engine, first)
    # the only slot is busy: b then c must wait, and be served b first
    rb = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0), "b")
    rc = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0), "c")
    done = run_until_done(engine)
    assert list(done) == [first, rb, rc]
    assert engine.adapters.num_promotions == 3


def test_pool_full_times_out_with_pool_full(root):
    llm = _llm(root, max_loras=1, promotion_timeout_s=0.0)
    engine = llm.engine
    ra = engine.add_request(PROMPT, LONG, "a")
    step_until_running(engine, ra)
    rb = engine.add_request(PROMPT, LONG, "b")
    outs = run_until_done(engine)
    assert outs[rb].finish_reason == "error" and isinstance(outs[rb].error, PoolFullError)
    assert str(outs[rb].error).startswith("POOL_FULL")
    engine.check_integrity()


def test_offline_generate_waits_for_a_slot_however_long_it_takes(root, monkeypatch):
    """LLM.generate's requests never time out waiting for a slot (a finite batch: running
    requests free their slots). The engine's clock reads 1,000 s past every arrival, as on
    a machine slow enough to outlast the server's 30 s POOL_FULL: three adapters through one
    slot all finish; with a timeout set (the server's) the waiters fail with POOL_FULL."""
    import time
    import types

    import metrale.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "time",
                        types.SimpleNamespace(monotonic=lambda: time.monotonic() + 1000.0))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = _llm(root, max_loras=1).generate([PROMPT] * 3, params, ["a", "b", "c"])
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    with pytest.raises(PoolFullError, match="POOL_FULL: waited 30s"):
        _llm(root, max_loras=1, promotion_timeout_s=30.0).generate([PROMPT] * 3, params,
                                                                   ["a", "b", "c"])


def test_one_promotion_for_many_waiters(root):
    llm = _llm(root)
    outs = llm.generate([PROMPT] * 20, SamplingParams(max_tokens=3, temperature=0), ["b"] * 20)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert llm.engine.adapters.num_promotions == 1


def test_same_name_reload_never_hits_old_kv(root):
    """Reload 'a' with new weights into the same slot: the prompt that cached KV
    under the old contents must be recomputed and match PEFT with the new ones."""
    from peft import PeftModel

    from tests.helpers.tiny_models import make_model as mk

    llm = _llm(root)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    old = llm.generate([PROMPT], greedy, ["a"])[0]
    again = llm.generate([PROMPT], greedy, ["a"])[0]
    assert again.num_cached_tokens > 0 and again.token_ids == old.token_ids
    slot = llm.engine.registry.slot_of("a")
    llm.engine.swap_lora_slot_from_disk(root / "a2", "a", slot)
    new = llm.generate([PROMPT], greedy, ["a"])[0]
    assert new.num_cached_tokens == 0
    ref_model = PeftModel.from_pretrained(mk("llama", seed=4), root / "a2")
    assert new.token_ids == hf_greedy(ref_model, PROMPT, 8)[0]
    assert new.token_ids != old.token_ids


def test_unknown_adapter_refused_at_admission(root):
    llm = _llm(root)
    with pytest.raises(UnknownAdapterError):
        llm.engine.add_request(PROMPT, LONG, "nope")
    assert not llm.engine.has_unfinished_requests()


def test_broken_adapter_fails_its_requests_only(root, tmp_path):
    import shutil

    llm = _llm(root)
    shutil.copytree(root / "b", tmp_path / "bad")
    llm.register_adapter("bad", tmp_path / "bad")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    engine = llm.engine
    ok = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0), "a")
    bad = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0), "bad")
    done = run_until_done(engine)
    assert done[bad].finish_reason == "error" and "safetensors" in str(done[bad].error)
    assert done[ok].finish_reason == "length"
    engine.check_integrity()
