"""Mixture-of-experts bases (Qwen3-MoE with a dense layer among the expert ones, Qwen2-MoE
with its gated shared expert, Mixtral, OLMoE): greedy tokens equal transformers' for the
base and transformers + PEFT for attention adapters, mixed in one batch with more adapters
than slots; expert LoRA in PEFT's target_parameters layout (tests/test_moe_per_expert.py:
the per-expert layout). A routing detail metrale got wrong would show: each one sabotaged
here fails the comparison.

Checkpoints are saved by transformers in the hub's layout (one tensor per expert part:
experts.E.gate_proj / w1, ...); the tiny configs' routers are scaled so top-k choices are
decisive (tiny_models.make_model)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.config import ConfigError
from metrale.errors import AdapterMismatchError
from metrale.model import moe
from tests.helpers.pool import assert_refused_untouched, norms_by_key, snapshot
from tests.helpers.reference import (
    assert_mixed_batch_matches,
    assert_slot_swaps_match,
    check,
    hf_greedy,
    prompts,
)
from tests.helpers.tiny_models import make_adapter, make_model, save_model

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GEN = 6
# The kernel path in Triton's interpreter runs every launch in Python (~30 s a family at
# GEN): the prefill and two decode steps through the graph buffers check the same kernels.
GEN_INTERPRETED = 3


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_model(request.param, seed=7)
    save_model(base, root / "model")
    # attention only: PEFT 0.21 on transformers 5 turns any gate/up/down_proj target (even
    # the dense layer's, by full path) into target_parameters on the fused experts
    adapters = {name: (make_adapter(base, root / name, seed=seed, r=4, lora_alpha=8,
                                    target_modules=ATTENTION), root / name)
                for name, seed in (("x", 3), ("y", 4), ("z", 5))}
    return request.param, root, base, adapters


def test_base_and_mixed_adapters_equal_transformers_peft(family):
    arch, root, base, adapters = family
    llm = assert_mixed_batch_matches(root / "model", base, adapters, prompts(11, 3), GEN,
                                     max_loras=2)  # 3 adapters through 2 slots
    assert llm.engine.model_config.moe is not None
    if arch == "qwen3_moe":  # its dense layer 1 offers the MLP, the expert layers do not
        layout = llm.engine.runner.pool.layout
        assert (1, "gate_proj") in layout.module_keys and (0, "gate_proj") not in layout.module_keys


def test_a_checkpoint_with_stacked_experts_loads_too(family, tmp_path):
    """transformers 5 keeps the experts stacked in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); a checkpoint written that way serves the same tokens."""
    _, root, base, _ = family
    stacked = tmp_path / "stacked"
    shutil.copytree(root / "model", stacked)
    save_file({k: v.contiguous() for k, v in base.state_dict().items()},
              stacked / "model.safetensors")
    with safe_open(stacked / "model.safetensors", "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    llm = LLM(stacked, max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)
    assert _matches(llm, base, prompts(14, 2))


def test_a_checkpoint_with_more_experts_than_its_config_is_refused(family, tmp_path):
    arch, root, _, _ = family
    extra = tmp_path / "extra"
    shutil.copytree(root / "model", extra)
    tensors = load_file(extra / "model.safetensors")
    part = "block_sparse_moe.experts.{}.w1" if arch == "mixtral" else "mlp.experts.{}.gate_proj"
    tensors[f"model.layers.0.{part.format(4)}.weight"] = tensors[
        f"model.layers.0.{part.format(0)}.weight"].clone()
    save_file(tensors, extra / "model.safetensors")
    with pytest.raises(ConfigError, match="more experts"):
        LLM(extra, max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)


def test_norms_over_a_layout_whose_layers_differ(family):
    """Qwen3-MoE's dense layer makes its slot regions unevenly spaced: the landing check's
    per-region norms (taken per evenly spaced run) equal each region's own."""
    arch, root, _, adapters = family
    if arch != "qwen3_moe":
        pytest.skip("the family with a dense layer among expert ones")
    llm = LLM(root / "model", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64)
    llm.engine.swap_lora_slot_from_disk(adapters["x"][1], "x", 0)
    pool = llm.engine.runner.pool
    norms = norms_by_key(pool, 0)
    assert {k[:2] for k in norms} == set(pool.layout.module_keys)
    for (layer, module, kind), got in norms.items():
        view = {"A": pool.lora_a, "B": pool.lora_bt, "M": pool.magnitude}[kind]
        x = view(layer, module)[0].float()  # [R, cols], M: [1, out]
        want = {"A": x.norm(dim=1).amax(), "B": x.abs().sum(0).amax(), "M": x.abs().amax()}[kind]
        assert got == pytest.approx(float(want), rel=1e-6), (layer, module, kind)


def _matches(llm, base, prompt_list) -> bool:
    """Greedy tokens and their logprobs equal transformers' (check's tolerance)."""
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompt_list, llm.generate(prompt_list, params)):
        try:
            check(out, *hf_greedy(base, prompt, GEN))
        except AssertionError:
            return False
    return True


SABOTAGE = {
    "no renormalisation": lambda m: setattr(m, "norm_topk", not m.norm_topk),
    "one expert fewer per token": lambda m: setattr(m, "top_k", m.top_k - 1),
    "float32 weights flipped": lambda m: setattr(m, "fp32_weights", not m.fp32_weights),
}


@pytest.mark.parametrize("what", SABOTAGE)
def test_a_routing_detail_gotten_wrong_is_caught(family, what):
    """Tokens and logprobs equal transformers'; flipping one routing detail in the served
    model breaks that (the weights' dtype is a no-op in fp32 and is skipped)."""
    arch, root, base, _ = family
    llm = LLM(root / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)
    ps = prompts(12, 4)
    assert _matches(llm, base, ps)
    if what == "float32 weights flipped":
        pytest.skip("fp32 tests: the weights' dtype is float32 either way")
    for module in llm.engine.runner.model.modules():
        if isinstance(module, moe.MoeMLP):
            SABOTAGE[what](module)
    assert not _matches(llm, base, ps)


def test_qwen2_moe_shared_expert_is_served(tmp_path):
    """Without its shared expert (or with its gate dropped) the answer changes."""
    base = make_model("qwen2_moe", seed=7)
    save_model(base, tmp_path / "m")
    llm = LLM(tmp_path / "m", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)
    ps = prompts(13, 4)
    assert _matches(llm, base, ps)
    with torch.no_grad():
        for module in llm.engine.runner.model.modules():
            if isinstance(module, moe.MoeMLP):
                module.shared_expert_gate.fill_(30.0)  # sigmoid -> 1: the gate ignored
    assert not _matches(llm, base, ps)


def test_qwen2_moe_all_linear_adapters_reach_the_shared_expert(tmp_path, monkeypatch):
    """PEFT's all-linear on Qwen2-MoE wraps the shared expert's gate/up/down and its sigmoid
    gate (a Linear to one output): such adapters, plain and DoRA, with an attention-only
    one, three through two slots in one batch, equal transformers + PEFT (the kernels' path:
    test_expert_lora_through_the_kernels_and_graph_buffers_equals_peft's all-linear
    adapter); dropping the shared expert's LoRA from the served model changes the answer."""
    base = make_model("qwen2_moe", seed=7)
    save_model(base, tmp_path / "model")
    # DoRA reaches the shared expert through its gate: PEFT (0.22, transformers 5) maps any
    # gate_proj / up_proj / down_proj target (all-linear, a name, a regex) onto the stacked
    # experts' parameters too, and that wrapper refuses DoRA
    linears = [*ATTENTION, "shared_expert_gate"]
    specs = {"all": dict(target_modules="all-linear"),
             "dora": dict(target_modules=linears, use_dora=True),
             "attn": dict(target_modules=ATTENTION)}
    adapters = {name: (make_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8, **spec),
                       tmp_path / name) for seed, (name, spec) in enumerate(specs.items(), 40)}
    with safe_open(tmp_path / "all" / "adapter_model.safetensors", "pt") as f:
        assert any(".mlp.shared_expert_gate.lora_A" in k for k in f.keys())
    ps = prompts(16, 2)
    # PEFT 0.22's all-linear takes the stacked experts too (gate_up at twice the rank)
    llm = assert_mixed_batch_matches(tmp_path / "model", base, adapters, ps, GEN, max_loras=2,
                                     lora_experts=True, max_lora_rank=8)
    monkeypatch.setattr(moe.MoeMLP, "_linear", lambda self, x, w, *lora: F.linear(x, w))
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(ps, params, ["all"] * len(ps))]
    assert got != [hf_greedy(adapters["all"][0], p, GEN)[0] for p in ps]


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def expert_adapters(family):
    """PEFT's expert LoRA (target_parameters on the stacked experts): both parameters beside
    the attention, the down projection alone; LoRA on the router's weight; all of it with
    all-linear."""
    arch, root, base, adapters = family
    specs = {"both": dict(target_modules=ATTENTION, target_parameters=EXPERTS),
             "down": dict(target_modules=["q_proj"], target_parameters=EXPERTS[1:]),
             "router": dict(target_modules=[], target_parameters=["mlp.gate.weight"]),
             # PEFT 0.21 on transformers 5: attention (Qwen2-MoE: its shared expert too) and,
             # as target_parameters it adds itself, the experts and the router, gate_up at
             # twice the rank (its rank_pattern): r=2 fits the pools' rank 4
             "all": dict(target_modules="all-linear", r=2, lora_alpha=4)}
    made = {name: (make_adapter(base, root / f"e_{name}", seed=seed,
                                **(dict(r=4, lora_alpha=8) | spec)), root / f"e_{name}")
            for seed, (name, spec) in enumerate(specs.items(), 20)}
    return {**made, "x": adapters["x"]}


def test_expert_lora_equals_transformers_peft(family, expert_adapters):
    """Expert adapters of both shapes, a router one and an attention one, four through two
    slots in one batch, equal transformers + PEFT (ParamWrapper) greedy tokens."""
    _, root, base, _ = family
    ps = prompts(15, 3)
    router = expert_adapters["router"][0]
    assert any(hf_greedy(router, p, GEN)[0] != hf_greedy(base, p, GEN)[0] for p in ps), \
        "the router adapter must move some answer, or the test shows nothing"
    llm = assert_mixed_batch_matches(root / "model", base, expert_adapters, ps, GEN,
                                     max_loras=2, lora_experts=True)
    assert "experts_gate_up" in llm.engine.runner.pool.layout.pool.target_modules


def test_swaps_between_expert_and_attention_adapters_keep_each_slot_right(family,
                                                                          expert_adapters):
    """One slot: attention -> experts -> everything (all-linear + experts + router) ->
    experts only-down; each served equal to PEFT (a zeroed slot's rows and ranks leave
    nothing behind)."""
    _, root, base, _ = family
    llm = LLM(root / "model", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64, lora_experts=True)
    assert_slot_swaps_match(llm, expert_adapters, ["x", "both", "all", "down"], 30, GEN)


def test_expert_and_router_adapters_travel_between_peers(family, expert_adapters):
    """An engine holding expert, router and attention adapters exports them (the slot's
    stacked layout as target_parameters); another engine registers them by peer:// and
    serves each equal to transformers + PEFT; an engine without --lora-experts refuses
    them naming the flag, its slot's bytes and identity untouched, and every lease lets its
    slot go."""
    from tests.helpers.peers import serve_engine_slots

    _, root, _, _ = family
    kw = dict(max_model_len=64, block_size=4, num_kv_blocks=64, max_lora_rank=4)
    names = ["both", "down", "router", "all", "x"]
    source = LLM(root / "model", max_loras=len(names), lora_experts=True, **kw)
    for slot, name in enumerate(names):
        source.engine.swap_lora_slot_from_disk(expert_adapters[name][1], name, slot)
    with serve_engine_slots(source.engine) as url:
        llm = LLM(root / "model", max_loras=2, lora_experts=True, **kw)
        for name in names:
            llm.register_adapter(f"p{name}", f"peer://{url}/{name}")
        params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
        ps = prompts(40, 2)
        outs = llm.generate([p for p in ps for _ in names], params,
                            [f"p{n}" for _ in ps for n in names])
        for i, out in enumerate(outs):
            name, p = names[i % len(names)], ps[i // len(names)]
            want = hf_greedy(expert_adapters[name][0], p, GEN, ignore_eos=True)[0]
            assert list(out.token_ids) == want, name
        without = LLM(root / "model", max_loras=1, **kw)
        without.engine.swap_lora_slot_from_disk(expert_adapters["x"][1], "x", 0)
        before = snapshot(without.engine.lora)
        with pytest.raises(AdapterMismatchError, match="--lora-experts"):
            without.engine.swap_lora_slot_from_peer(url, "both", "pboth", 0)
        assert snapshot(without.engine.lora) == before
    assert all(source.engine.lora.table.ref_count(s) == 0 for s in range(len(names)))


def test_a_peer_store_serves_expert_adapters(family, expert_adapters, tmp_path):
    """`metrale peer serve` over a directory of expert, router, all-linear and attention
    adapters sizes its pool for what they target (expert memory because they ask for it);
    an engine registers each by peer:// and serves it equal to transformers + PEFT."""
    from tests.helpers.peers import assert_store_serves

    _, root, _, _ = family
    store = assert_store_serves(root / "model", expert_adapters, ["both", "router", "all", "x"],
                                tmp_path / "store", prompts(41, 2), GEN, max_lora_rank=4)
    assert {"experts_gate_up", "experts_down", "router"} <= set(store.slots.pool_config.target_modules)


def test_expert_adapters_are_refused_naming_the_target(family, expert_adapters, tmp_path):
    """A per-expert tensor (transformers 4 PEFT: experts.E.gate_proj) of the wrong shape is
    refused naming it; target_parameters without pool memory for experts naming
    --lora-experts; on a router parameter not served naming it; nothing is registered, the
    pool's bytes and slot identities stay."""
    arch, root, _, adapters = family
    src = adapters["y"][1]
    cfg = json.loads((src / "adapter_config.json").read_text())
    per_expert = tmp_path / "per_expert"
    per_expert.mkdir()
    tensors = load_file(src / "adapter_model.safetensors")
    part = "block_sparse_moe.experts.0.w1" if arch == "mixtral" else "mlp.experts.0.gate_proj"
    expert = f"base_model.model.model.layers.0.{part}"
    tensors[f"{expert}.lora_A.weight"] = torch.randn(4, 64)
    tensors[f"{expert}.lora_B.weight"] = torch.randn(47, 4)  # the expert size is 48
    save_file(tensors, per_expert / "adapter_model.safetensors")
    name = part.rsplit(".", 1)[1]
    (per_expert / "adapter_config.json").write_text(json.dumps(
        {**cfg, "target_modules": [*ATTENTION, f"layers.0.{part}"]}))
    router = tmp_path / "router"
    shutil.copytree(src, router)
    (router / "adapter_config.json").write_text(json.dumps(
        {**cfg, "target_parameters": ["mlp.gate.bias"]}))  # the weight is served, no bias
    kw = dict(max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4, num_kv_blocks=64)
    without = LLM(root / "model", **kw)
    llm = LLM(root / "model", lora_experts=True, **kw)
    refusals = [(without, expert_adapters["both"][1], "--lora-experts"),
                (llm, per_expert, name), (llm, router, "mlp.gate.bias")]
    for engine_llm in (without, llm):  # a slot already serving an adapter: it must stay so
        engine_llm.engine.swap_lora_slot_from_disk(adapters["x"][1], "x", 0)
    for engine_llm, bad, message in refusals:
        assert_refused_untouched(engine_llm, bad, AdapterMismatchError, message)
    assert llm.engine.registry.names() == without.engine.registry.names() == ["x"]


def test_expert_lora_through_the_kernels_and_graph_buffers_equals_peft(
        family, expert_adapters, monkeypatch):
    """The CUDA path in Triton's interpreter: routing sorted into expert blocks, grouped
    GEMMs and per-pair expert LoRA (metrale.ops.moe_triton) inside the graphs' static
    buffers (no host sync), expert, router and attention adapters through two slots."""
    from metrale.ops import lora as lora_ops

    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    _, root, base, _ = family
    llm = assert_mixed_batch_matches(root / "model", base, expert_adapters, prompts(15, 1),
                                     GEN_INTERPRETED, max_loras=2, lora_experts=True,
                                     static_graphs=True)
    assert llm.engine.runner.graphs.num_replays > 0


@pytest.mark.gpu
def test_gpu_moe_through_graphs_with_expert_adapters(family, expert_adapters):
    """fp32 on CUDA: the routed experts and every adapter kind inside captured graphs."""
    _, root, base, _ = family
    llm = assert_mixed_batch_matches(root / "model", base, expert_adapters, prompts(15, 3),
                                     GEN, max_loras=2, lora_experts=True, device="cuda",
                                     dtype="float32")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0


def test_dora_on_expert_parameters_is_refused():
    from metrale.adapters.peft_config import PeftAdapterConfig
    from metrale.errors import UnsupportedAdapterError

    with pytest.raises(UnsupportedAdapterError, match="target_parameters"):
        PeftAdapterConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                     "target_parameters": EXPERTS, "use_dora": True})


def test_expert_lora_with_rslora_and_a_rank_pattern_equals_peft(tmp_path):
    """rsLoRA scaling and a rank_pattern entry on one expert parameter (rank 2 there, 4
    elsewhere) apply to expert targets as PEFT applies them."""
    base = make_model("qwen3_moe", seed=9)
    save_model(base, tmp_path / "model")
    spec = dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["o_proj"],
                target_parameters=EXPERTS,
                rank_pattern={"model.layers.0.mlp.experts.down_proj": 2})
    adapters = {"p": (make_adapter(base, tmp_path / "p", seed=40, **spec), tmp_path / "p")}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, prompts(16, 2), GEN,
                               lora_experts=True)
