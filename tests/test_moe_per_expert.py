"""Expert LoRA in transformers 4's per-expert layout (PEFT wrapping each expert's own Linears:
mlp.experts.3.gate_proj.lora_A, Mixtral's block_sparse_moe.experts.3.w1) and its router
Linear (mlp.gate) on the four MoE families, some experts and parts left out: greedy tokens
equal transformers + PEFT.

PEFT on transformers 5 has no per-expert Linears, so the reference is the same LoRA written
in PEFT's other layout (target_parameters on the stacked experts, ParamWrapper): each
expert's gate and up factors side by side in a rank-4 block (A rows [gate | up], B
block-diagonal), down's in the first half of its block, the rest zero; PEFT computes the
forward pass. The block layout is built here from PEFT's parameter shapes, not taken from
metrale."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from metrale import LLM, SamplingParams
from metrale.errors import AdapterMismatchError, UnsupportedAdapterError
from metrale.ops.landing_triton import land_rows
from metrale.pool.recipe import build_recipe
from tests.helpers.kernels import KERNELS
from tests.helpers.reference import (
    assert_mixed_batch_matches,
    assert_slot_swaps_match,
    hf_greedy,
    prompts,
)
from tests.helpers.tiny_models import make_adapter, make_model, save_model

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
R, R_PART = 4, 2  # the reference's rank; each per-expert Linear's
GEN = 6


def _names(arch: str):
    if arch == "mixtral":
        return "block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}
    return "mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _left_out(layer: int, expert: int, part: str) -> bool:
    """Some experts and parts the adapter does not target: all of expert 2 in the first
    expert layer, expert 1's up in the others."""
    return (layer == 0 and expert == 2) or (layer != 0 and expert == 1 and part == "up")


def per_expert_adapter(arch: str, base, path, seed: int):
    """(PEFT reference model, directory of the per-expert adapter) with the same LoRA."""
    ref = make_adapter(base, path.with_name(path.name + "_ref"), seed=seed, r=R, lora_alpha=8,
                       target_modules=["q_proj"], target_parameters=[*EXPERTS, "mlp.gate.weight"])
    cfg = base.config
    n_exp = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
    g = torch.Generator().manual_seed(seed)
    block, names = _names(arch)
    tensors, targets = {}, []
    with torch.no_grad():
        for name, module in ref.named_modules():
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            layer = name.split(".layers.")[1].split(".")[0]
            prefix = f"base_model.model.model.layers.{layer}."
            # q_proj and the router (transformers 4: a Linear): rank 2 of the reference's 4
            own = {"q_proj": "self_attn.q_proj", "gate": f"{block}.gate"}.get(name.rsplit(".")[-1])
            if own is not None:
                a[R_PART:], b[:, R_PART:] = 0, 0
                tensors[prefix + own + ".lora_A.weight"] = a[:R_PART].clone()
                tensors[prefix + own + ".lora_B.weight"] = b[:, :R_PART].clone()
                targets.append(f"layers.{layer}.{own}")
                continue
            a.zero_()
            b.zero_()
            gate_up = module.parameter_name == "gate_up_proj"
            size = b.shape[0] // 2 if gate_up else b.shape[0]  # [out, R * E]
            for e in range(n_exp):
                for hf, part in names.items():
                    if (part == "down") == gate_up or _left_out(int(layer), e, part):
                        continue
                    pa = torch.randn(R_PART, a.shape[1], generator=g) / a.shape[1] ** 0.5
                    pb = torch.randn(size, R_PART, generator=g)
                    off = R_PART if part == "up" else 0  # rank rows of the expert's block
                    a[e * R + off:e * R + off + R_PART] = pa
                    rows = slice(size, 2 * size) if part == "up" else slice(0, size)
                    for i in range(R_PART):  # column (rank, expert): i * E + e, rank-major
                        b[rows, (off + i) * n_exp + e] = pb[:, i]
                    key = f"{prefix}{block}.experts.{e}.{hf}"
                    tensors[key + ".lora_A.weight"] = pa
                    tensors[key + ".lora_B.weight"] = pb
                    targets.append(f"layers.{layer}.{block}.experts.{e}.{hf}")
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R_PART, "lora_alpha": 4,
        "target_modules": targets}))  # scale 4 / 2 = the reference's 8 / 4
    return ref, path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_model(request.param, seed=7)
    save_model(base, root / "model")
    adapters = {"pe": per_expert_adapter(request.param, base, root / "pe", seed=50),
                "stacked": (make_adapter(base, root / "stacked", seed=51, r=R, lora_alpha=8,
                                         target_modules=["k_proj"], target_parameters=EXPERTS),
                            root / "stacked"),
                "x": (make_adapter(base, root / "x", seed=52, r=R, lora_alpha=8,
                                   target_modules=["q_proj", "v_proj"]), root / "x")}
    return request.param, root, base, adapters


def test_per_expert_adapter_equals_transformers_peft(family):
    """Per-expert, stacked and attention adapters, three through two slots in one batch."""
    _, root, base, adapters = family
    ps = prompts(61, 3)
    moved = [p for p in ps if hf_greedy(adapters["pe"][0], p, GEN)[0] != hf_greedy(base, p, GEN)[0]]
    assert moved, "the per-expert adapter must change some answer, or the test shows nothing"
    assert_mixed_batch_matches(root / "model", base, adapters, ps, GEN, max_loras=2,
                               max_lora_rank=R, lora_experts=True)


def test_swaps_between_per_expert_stacked_and_attention_adapters(family):
    """One slot: per-expert -> stacked -> attention -> per-expert, each equal to PEFT (a
    zeroed slot leaves no expert rows or columns behind)."""
    _, root, _, adapters = family
    llm = LLM(root / "model", max_loras=1, max_lora_rank=R, max_model_len=64, block_size=4,
              num_kv_blocks=64, lora_experts=True)
    assert_slot_swaps_match(llm, adapters, ["pe", "stacked", "x", "pe"], 70, GEN)


def test_a_peer_store_serves_per_expert_adapters(family, tmp_path):
    """A peer store sizes expert memory for a per-expert file (known only from its tensor
    names) and exports it as the stacked layout it landed in; engines serve it as PEFT."""
    from tests.helpers.peers import assert_store_serves

    _, root, _, adapters = family
    assert_store_serves(root / "model", adapters, ["pe", "x"], tmp_path / "store",
                        prompts(62, 2), GEN, max_lora_rank=R)


@pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
def test_the_landing_kernel_places_expert_blocks_as_the_torch_path(family):
    """The one-launch landing (rows E apart, columns from an offset) writes the slot the
    per-tensor path writes."""
    _, root, _, adapters = family
    llm = LLM(root / "model", max_loras=1, max_lora_rank=R, max_model_len=64, block_size=4,
              num_kv_blocks=64, lora_experts=True)
    llm.engine.swap_lora_slot_from_disk(adapters["pe"][1], "pe", 0)
    pool = llm.engine.runner.pool
    from metrale.adapters.plan import plan_adapter
    plan = plan_adapter(adapters["pe"][1], "pe", llm.engine.model_config, pool.layout.pool)
    assert any(landing.row_step > 1 for landing in plan.landings)
    raw = (adapters["pe"][1] / "adapter_model.safetensors").read_bytes()[plan.data_offset:]
    recipe = build_recipe(plan, pool.layout, torch.device("cpu"))
    got = torch.zeros(pool.layout.slot_elems, dtype=pool.buffer.dtype)
    land_rows(got, torch.frombuffer(bytearray(raw), dtype=recipe.dtype), recipe.desc, recipe.tiles)
    torch.testing.assert_close(got, pool.slot_region(0), rtol=2 ** -7, atol=0)


def test_per_expert_refusals_leave_the_engine_serving(tmp_path):
    """A rank the pool cannot hold once gate and up sit side by side names the rank to
    start with; scales that differ between an expert's parts are refused as such; a
    per-expert adapter without --lora-experts names the flag; a shared-expert LoRA tensor on
    a model without a shared expert is a mismatch. Each by registration
    and by a swap into a slot already serving an adapter: the pool's bytes, tables and slot
    identities do not change, and the engine serves that adapter after."""
    from safetensors.torch import load_file

    from tests.helpers.pool import assert_refused_untouched

    base = make_model("qwen3_moe", seed=7)
    save_model(base, tmp_path / "model")
    ref, pe = per_expert_adapter("qwen3_moe", base, tmp_path / "pe", seed=50)
    tensors = load_file(pe / "adapter_model.safetensors")
    shared = tmp_path / "shared"  # transformers 4's all-linear wraps shared experts too
    shared.mkdir()
    (shared / "adapter_config.json").write_text((pe / "adapter_config.json").read_text())
    key = "base_model.model.model.layers.0.mlp.shared_expert.gate_proj"
    save_file({**tensors, f"{key}.lora_A.weight": torch.randn(2, 64),
               f"{key}.lora_B.weight": torch.randn(80, 2)}, shared / "adapter_model.safetensors")
    scales = tmp_path / "scales"  # one expert's up scaled apart from the rest
    shutil.copytree(pe, scales)
    cfg = json.loads((pe / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"layers.0.mlp.experts.0.up_proj": 8}
    (scales / "adapter_config.json").write_text(json.dumps(cfg))

    kw = dict(max_loras=1, max_model_len=64, block_size=4, num_kv_blocks=64)
    small = LLM(tmp_path / "model", max_lora_rank=3, lora_experts=True, **kw)
    no_experts = LLM(tmp_path / "model", max_lora_rank=R, **kw)
    llm = LLM(tmp_path / "model", max_lora_rank=R, lora_experts=True, **kw)
    llm.engine.swap_lora_slot_from_disk(pe, "pe", 0)  # a slot serving: it must stay so
    refusals = [(small, pe, AdapterMismatchError, "--max-lora-rank 4"),
                (no_experts, pe, AdapterMismatchError, "--lora-experts"),
                (llm, shared, AdapterMismatchError, "does not target"),  # none here
                (llm, scales, UnsupportedAdapterError, "one scale per layer")]
    for engine_llm, bad, error, message in refusals:
        assert_refused_untouched(engine_llm, bad, error, message)
    assert llm.engine.registry.names() == ["pe"]
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    for p in prompts(95, 2):
        assert list(llm.generate([p], params, "pe")[0].token_ids) == hf_greedy(ref, p, GEN)[0]


def test_promotions_through_the_host_tier_keep_expert_slots_right(family):
    """One slot and a host tier: per-expert, stacked and attention adapters take turns, each
    turn a promotion (the second round from the tier's staged bytes), each served equal to
    PEFT. (On CUDA the tier lands through the recipe: the landing-kernel test above.)"""
    _, root, _, adapters = family
    llm = LLM(root / "model", max_loras=1, max_lora_rank=R, max_model_len=64, block_size=4,
              num_kv_blocks=64, lora_experts=True, host_tier_bytes=1 << 24)
    for name, (_, path) in adapters.items():
        llm.register_adapter(name, path)
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    for turn, name in enumerate(["pe", "stacked", "x", "pe", "stacked", "x"]):
        p = prompts(80 + turn, 1)[0]
        out = llm.generate([p], params, name)[0]
        assert list(out.token_ids) == hf_greedy(adapters[name][0], p, GEN)[0], (turn, name)
    assert llm.engine.lora.host_tier.hits >= 3


def test_a_per_expert_adapter_travels_between_peers_as_its_slot_holds_it(family):
    """Exported from a slot, a per-expert adapter goes as the stacked layout it landed in
    (target_parameters at its side-by-side rank, alpha giving back its scale); the engine
    that registers it by peer:// serves it equal to PEFT."""
    from tests.helpers.peers import serve_engine_slots

    _, root, _, adapters = family
    kw = dict(max_lora_rank=R, max_model_len=64, block_size=4, num_kv_blocks=64,
              lora_experts=True)
    source = LLM(root / "model", max_loras=1, **kw)
    source.engine.swap_lora_slot_from_disk(adapters["pe"][1], "pe", 0)
    with serve_engine_slots(source.engine) as url:
        llm = LLM(root / "model", max_loras=1, **kw)
        llm.register_adapter("ppe", f"peer://{url}/pe")
        params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
        for p in prompts(90, 2):
            out = llm.generate([p], params, "ppe")[0]
            assert list(out.token_ids) == hf_greedy(adapters["pe"][0], p, GEN)[0]
    assert torch.equal(llm.engine.lora.pool.slot_region(0), source.engine.lora.pool.slot_region(0))
