"""The engine's greedy tokens and logprobs equal transformers (+ PEFT) on tiny
random Llama, Qwen2 and Qwen3 models: single, batched, mixed adapters, with
prefix-cache hits and misses and under KV pressure (preemption)."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from tests.helpers.reference import check, hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = make_model(arch, seed=3)
    save_model(base, root / "model")
    peft = {}
    for i, (name, kw) in enumerate({
        "a": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        "c": dict(r=6, lora_alpha=3, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
        "d": dict(r=2, lora_alpha=8, target_modules=["gate_proj"], rank_pattern={"gate_proj": 5}),
    }.items()):
        peft[name] = make_adapter(base, root / name, seed=10 + i, **kw)
    return arch, root, base, peft


def _llm(root, **kw):
    args = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
                num_kv_blocks=256, max_num_seqs=8)
    llm = LLM(root / "model", **{**args, **kw})
    for name in "abcd":
        llm.register_adapter(name, root / name)
    return llm


def test_base_single_and_batched(setup):
    arch, root, base, _ = setup
    llm = _llm(root)
    ps = prompts(0, 5)
    outs = llm.generate(ps, GREEDY)
    for p, out in zip(ps, outs):
        check(out, *hf_greedy(base, p))


def test_mixed_adapters_more_than_slots_shuffled(setup):
    """4 adapters, 2 slots: promotions and evictions mid-run; every request gets
    exactly what PEFT gives it alone."""
    arch, root, base, peft = setup
    llm = _llm(root)
    ps = prompts(1, 12)
    names = ["a", "b", "c", "d", None, "a", "c", "b", "d", None, "d", "a"]
    order = list(range(12))
    random.Random(5).shuffle(order)
    outs = llm.generate([ps[i] for i in order], GREEDY, [names[i] for i in order])
    for i, out in zip(order, outs):
        model = base if names[i] is None else peft[names[i]]
        if names[i] is not None:
            model.set_adapter("default")
        check(out, *hf_greedy(model, ps[i]))
    assert llm.engine.adapters.num_promotions >= 4  # evictions really happened
    llm.engine.check_integrity()
    assert all(info.ref_count == 0 for info in llm.engine.slot_info())


def test_prefix_cache_hits_and_misses(setup):
    arch, root, base, peft = setup
    llm = _llm(root)
    ps = prompts(2, 4, shared_prefix=13)
    first = llm.generate(ps[:1], GREEDY, ["a"])[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate(ps, GREEDY, ["a", "a", None, "b"])
    # a repeated prompt hits all its full blocks but the last token's; the same adapter
    # shares the 12 cached prefix tokens; base and b must not hit a's blocks
    assert outs[0].num_cached_tokens == (len(ps[0]) - 1) // 4 * 4
    assert outs[1].num_cached_tokens == 12
    assert outs[2].num_cached_tokens == 0 and outs[3].num_cached_tokens == 0
    for p, out, name in zip(ps, outs, ["a", "a", None, "b"]):
        check(out, *hf_greedy(base if name is None else peft[name], p))
    assert llm.engine.blocks.hits > 0


def test_preemption_under_kv_pressure_loses_nothing(setup):
    arch, root, base, peft = setup
    # promotions inline: which sequences share the KV then depends on nothing but the inputs
    llm = _llm(root, num_kv_blocks=14, max_num_seqs=6, async_promotions=False)  # 56 tokens of KV
    ps = prompts(3, 6)
    names = ["a", None, "b", "a", None, "c"]
    outs = llm.generate(ps, GREEDY, names)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out, name in zip(ps, outs, names):
        check(out, *hf_greedy(base if name is None else peft[name], p))
