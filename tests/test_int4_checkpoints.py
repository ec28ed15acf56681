"""4-bit AWQ (gemm), GPTQ (act-order or not, sym or asym, v1 and v2 zero formats) and
bitsandbytes NF4 checkpoints (with and without double quantization) of Llama and Qwen3 are
held in 4 bits (metrale.ops.int4_linear's layout; its dequantizing reference on CPU, the
Triton GEMM in the interpreter and on CUDA): greedy tokens equal transformers + PEFT on the
dequantized weights, base and plain and DoRA adapters mixed in one batch. A fused
projection whose parts were act-ordered differently dequantizes at load instead.

Checkpoints are made here from a tiny random Llama: each linear weight quantized to 4-bit
integers per group, packed by the layouts the formats document (written here, not taken
from metrale), the reference weights dequantized from the same integers."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from metrale import LLM
from tests.helpers.reference import assert_mixed_batch_matches
from tests.helpers.tiny_models import make_adapter, make_model, save_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of each int32 holds column AWQ_ORDER[i]
PROMPTS = [[5, 17, 99, 3, 42, 8], [61, 2, 9, 13, 200, 7, 1]]
GEN = 6


def quantize(w: torch.Tensor, group_of: torch.Tensor, n_groups: int, sym: bool):
    """w [out, in] -> q [in, out], zeros [groups, out], fp16 scales [groups, out], and the
    dequantized weight [out, in]."""
    out = w.shape[0]
    scales, zeros = torch.empty(n_groups, out), torch.empty(n_groups, out)
    for g in range(n_groups):
        cols = w[:, group_of == g]
        if sym:
            s, z = cols.abs().amax(1) / 7, torch.full((out,), 8.0)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / 15
            z = torch.round(-lo / s).clamp(1, 15)  # >= 1: the v1 format stores z - 1
        scales[g], zeros[g] = s, z
    scales = scales.half().float()  # as stored
    q = torch.round(w.t() / scales[group_of] + zeros[group_of]).clamp(0, 15)
    deq = ((q - zeros[group_of]) * scales[group_of]).t()
    return q.to(torch.int64), zeros.to(torch.int64), scales.half(), deq


def pack_along_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[rows, cols] 4-bit ints -> int32 [rows, cols/8]: nibble i holds column order[i]."""
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    packed = np.zeros(v.shape[:2], dtype=np.uint32)
    for i, col in enumerate(order):
        packed |= v[:, :, col] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32))


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit ints -> int32 [rows/8, cols]: row 8k+i in nibble i."""
    v = values.numpy().astype(np.uint32).reshape(-1, 8, values.shape[1])
    packed = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for i in range(8):
        packed |= v[:, i, :] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32))


# QLoRA's NF4 code values (Dettmers et al. 2023, appendix E)
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
NF4_BLOCK, NESTED_BLOCK = 64, 256


def nf4_tensors(prefix: str, w: torch.Tensor, double: bool) -> tuple[dict, torch.Tensor]:
    """bitsandbytes' Linear4bit state of w (NF4, blocks of 64, optionally its absmax
    quantized to 8 bits per 256) and the weight it dequantizes to."""
    flat = w.reshape(-1)
    blocks = flat.reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(1)
    codes = (blocks / absmax[:, None]).unsqueeze(-1).sub(NF4).abs().argmin(-1).reshape(-1)
    state = {"quant_type": "nf4", "blocksize": NF4_BLOCK, "dtype": "float32",
             "shape": list(w.shape)}
    out = {prefix + "weight.quant_map": NF4.clone()}
    if double:
        offset = float(absmax.mean())
        centred = absmax - offset
        nested = torch.stack([c.abs().max() for c in centred.split(NESTED_BLOCK)])
        code8 = torch.linspace(-1, 1, 256)
        index = torch.arange(absmax.numel()) // NESTED_BLOCK
        q8 = (centred / nested[index]).unsqueeze(-1).sub(code8).abs().argmin(-1)
        absmax = code8[q8] * nested[index] + offset  # what the loader must rebuild
        out.update({prefix + "weight.absmax": q8.to(torch.uint8),
                    prefix + "weight.nested_absmax": nested,
                    prefix + "weight.nested_quant_map": code8})
        state.update(nested_blocksize=NESTED_BLOCK, nested_dtype="float32", nested_offset=offset)
    else:
        out[prefix + "weight.absmax"] = absmax
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).unsqueeze(1)
    out[prefix + "weight"] = packed
    out[prefix + "weight.quant_state.bitsandbytes__nf4"] = torch.tensor(
        list(json.dumps(state).encode()), dtype=torch.uint8)
    deq = (NF4[codes].reshape(-1, NF4_BLOCK) * absmax[:, None]).reshape(w.shape)
    return out, deq


def _input_of(name: str) -> str:
    """Which activation a linear reads: q/k/v share one, gate/up another (so GPTQ's
    act order, a permutation of the input by its Hessian, is the same for them)."""
    layer = name.split(".mlp.")[0].split(".self_attn.")[0]
    for kind, modules in (("attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        if any(f".{m}." in name for m in modules):
            return f"{layer}.{kind}"
    return name


def int4_checkpoint(base, path, method: str, act_order: str | bool = False, sym: bool = False,
                    v2: bool = True):
    """act_order: "shared" (a permutation per input, as GPTQ makes it) or "per-tensor"."""
    save_model(base, path)
    tensors, dequantized = {}, {}
    g = torch.Generator().manual_seed(0)
    orders: dict[str, torch.Tensor] = {}
    for name, w in base.state_dict().items():
        if not any(f".{m}." in name for m in LINEAR):
            tensors[name], dequantized[name] = w.contiguous(), w
            continue
        n_in, prefix = w.shape[1], name.removesuffix("weight")
        if method.startswith("nf4"):
            part, dequantized[name] = nf4_tensors(prefix, w, double=method == "nf4-double")
            tensors.update(part)
            continue
        n_groups = n_in // GROUP
        group_of = torch.arange(n_in) // GROUP
        if act_order:  # rows of a group scattered across the input dimension
            key = _input_of(name) if act_order == "shared" else name
            if key not in orders:
                orders[key] = group_of[torch.randperm(n_in, generator=g)]
            group_of = orders[key]
        q, zeros, scales, deq = quantize(w, group_of, n_groups, sym)
        dequantized[name] = deq
        tensors[prefix + "scales"] = scales
        if method == "awq":
            tensors[prefix + "qweight"] = pack_along_columns(q, AWQ_ORDER)
            tensors[prefix + "qzeros"] = pack_along_columns(zeros, AWQ_ORDER)
        else:
            tensors[prefix + "qweight"] = pack_along_rows(q)
            tensors[prefix + "qzeros"] = pack_along_columns(zeros - (0 if v2 else 1),
                                                            list(range(8)))
            tensors[prefix + "g_idx"] = group_of.to(torch.int32)
    (path / "model.safetensors").unlink()
    save_file(tensors, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
         "bnb_4bit_use_double_quant": method == "nf4-double"} if method.startswith("nf4") else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (path / "config.json").write_text(json.dumps(cfg))
    return dequantized


FORMATS = {  # id: (method, act_order, sym, v2)
    "awq": ("awq", False, False, True),
    "gptq": ("gptq", False, False, True),
    "gptq-act-order": ("gptq", "shared", False, True),
    "gptq-sym-v1": ("gptq", "shared", True, False),  # the v1 zero format (zero - 1 stored)
    "nf4": ("nf4", False, False, True),
    "nf4-double-quant": ("nf4-double", False, False, True),
}


def _projections(llm):
    layer = llm.engine.runner.model.layers[0]
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]


def _with_adapters(tmp_path, arch: str, fmt: str, dora: bool = False):
    """A 4-bit checkpoint of format fmt at tmp_path/q, its dequantized reference model,
    and adapters trained on that reference (a plain one and a DoRA one, or two plain)."""
    base = make_model(arch, seed=13, intermediate_size=128)  # NF4's 64-blocks within rows
    ref = copy.deepcopy(base)
    ref.load_state_dict(int4_checkpoint(base, tmp_path / "q", *FORMATS[fmt]))
    kinds = (("x", 3, False), ("y", 4, dora))
    adapters = {name: (make_adapter(ref, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                    use_dora=use_dora, target_modules="all-linear"),
                       tmp_path / name) for name, seed, use_dora in kinds}
    return ref, adapters


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int4_checkpoint_equals_transformers_peft_on_its_dequantized_weights(tmp_path, fmt, arch):
    ref, adapters = _with_adapters(tmp_path, arch, fmt)
    llm = assert_mixed_batch_matches(tmp_path / "q", ref, adapters, PROMPTS, GEN)
    for proj in _projections(llm):  # held in 4 bits, act-ordered columns sorted by group
        assert proj.quant == "int4" and proj.weight.dtype == torch.int32
        assert (proj.input_perm is not None) == bool(FORMATS[fmt][1])


@pytest.mark.parametrize("method", ["gptq", "nf4"])
def test_weights_the_kernel_cannot_take_dequantize_at_load(tmp_path, method):
    """GPTQ: q, k and v act-ordered three ways (the fused projection has one column order);
    NF4: blocks of 64 straddling the rows of a 96-column down_proj."""
    base = make_model("llama", seed=13)  # intermediate 96
    ref = copy.deepcopy(base)
    ref.load_state_dict(int4_checkpoint(base, tmp_path / "q", method, act_order="per-tensor"))
    adapters = {"x": (make_adapter(ref, tmp_path / "x", seed=3, r=4, lora_alpha=8,
                                   target_modules="all-linear"), tmp_path / "x")}
    llm = assert_mixed_batch_matches(tmp_path / "q", ref, adapters, PROMPTS, GEN)
    qkv, o, gate_up, down = _projections(llm)
    held = [p.quant == "int4" for p in (qkv, o, gate_up, down)]
    assert held == ([False, True, False, True] if method == "gptq" else [True, True, True, False])


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "nf4-double-quant"])
def test_int4_gemm_kernel_in_the_engine_with_dora_and_plain_adapters(tmp_path, fmt, monkeypatch):
    """The same checkpoints through the Triton 4-bit GEMM (Triton's interpreter on CPU) and
    the LoRA kernels, a DoRA adapter (its norms read the dequantized weight, columns back
    in their order) beside a plain one and the base in one batch."""
    from metrale.ops import lora as lora_ops
    from tests.helpers.kernels import KERNELS
    if not KERNELS or torch.cuda.is_available():  # with CUDA: the gpu test runs them compiled
        pytest.skip("needs Triton's interpreter (a CPU-only box)")
    monkeypatch.setattr(lora_ops, "TRITON_ON_CPU", True)
    ref, adapters = _with_adapters(tmp_path, "llama", fmt, dora=True)
    assert_mixed_batch_matches(tmp_path / "q", ref, adapters, PROMPTS[:1], 4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "nf4-double-quant"])
def test_gpu_int4_checkpoint_through_graphs_equals_peft(tmp_path, fmt):
    """fp32 on CUDA (exact-fp32 dots): the compiled 4-bit GEMM under captured graphs, plain
    and DoRA adapters beside the base, against transformers + PEFT on the CPU."""
    ref, adapters = _with_adapters(tmp_path, "qwen3", fmt, dora=True)
    llm = assert_mixed_batch_matches(tmp_path / "q", ref, adapters, PROMPTS, GEN,
                                     device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
    assert all(p.quant == "int4" for p in _projections(llm))


def test_packed_tensors_of_the_wrong_kind_are_refused(tmp_path):
    from safetensors.torch import load_file

    from metrale.config import ConfigError

    base = make_model("llama", seed=13)
    int4_checkpoint(base, tmp_path / "q", "gptq")
    good = load_file(tmp_path / "q" / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.qweight"
    for bad in (good[key].float(), good[key][0], good[key].to(torch.int64)):
        save_file({**good, key: bad}, tmp_path / "q" / "model.safetensors")
        with pytest.raises(ConfigError, match="q_proj"):
            LLM(tmp_path / "q", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)


def test_a_packed_weight_without_its_scales_is_refused(tmp_path):
    from safetensors.torch import load_file

    from metrale.config import ConfigError

    base = make_model("llama", seed=13)
    int4_checkpoint(base, tmp_path / "q", "awq")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ConfigError, match="down_proj.scales"):
        LLM(tmp_path / "q", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_group_size_the_scales_do_not_have_is_refused(tmp_path, method):
    """config.json says groups of 64 where the checkpoint's scales come in groups of 32:
    refused at load naming the tensor (not served with every other scale skipped)."""
    from metrale.config import ConfigError

    base = make_model("llama", seed=13, intermediate_size=128)
    int4_checkpoint(base, tmp_path / "q", method)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 2 * GROUP
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    if method == "gptq":  # without g_idx the groups come from config.json
        from safetensors.torch import load_file
        tensors = {k: v for k, v in load_file(tmp_path / "q" / "model.safetensors").items()
                   if not k.endswith("g_idx")}
        save_file(tensors, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"scales has \d+ groups; group_size 64"):
        LLM(tmp_path / "q", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)


def test_a_4bit_base_holds_its_projections_in_an_eighth_of_the_float32_bytes(tmp_path):
    base = make_model("llama", seed=13, intermediate_size=128)
    int4_checkpoint(base, tmp_path / "q", "awq")
    llm = LLM(tmp_path / "q", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)
    for proj in _projections(llm):
        n, k = proj.weight.shape[0], proj.in_features
        held = sum(t.numel() * t.element_size() for t in (proj.weight, proj.weight_scale,
                                                           proj.weight_zero))
        # codes padded to 256 columns, fp16 scales and uint8 zeros per 32 columns
        assert held == n * (-(-k // 256) * 256) // 2 + n * (k // GROUP) * 3


def test_embedding_and_head_lora_swaps_and_prefix_hits_on_a_4bit_base(tmp_path):
    """A 4-bit base keeps the rest of the engine's reach: an adapter with LoRA on
    embed_tokens and lm_head beside the projections, a slot swapped between two adapters,
    and a second request reusing the first's cached prefix, each equal to PEFT."""
    from metrale import SamplingParams
    from tests.helpers.reference import hf_greedy

    base = make_model("llama", seed=13, intermediate_size=128)
    ref = copy.deepcopy(base)
    ref.load_state_dict(int4_checkpoint(base, tmp_path / "q", "awq"))
    emb = make_adapter(ref, tmp_path / "emb", seed=5, r=4, lora_alpha=8,
                       target_modules=["embed_tokens", "lm_head", "q_proj", "down_proj"])
    plain = make_adapter(ref, tmp_path / "plain", seed=6, r=4, lora_alpha=8,
                         target_modules="all-linear")
    llm = LLM(tmp_path / "q", max_loras=1, max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64, lora_extra_targets=("embed_tokens", "lm_head"))
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    prefix = [7, 19, 23, 5, 88, 41, 9, 3]  # two whole KV blocks
    for i, (name, model) in enumerate([("emb", emb), ("plain", plain), ("emb", emb)]):
        llm.engine.swap_lora_slot_from_disk(tmp_path / name, f"{name}{i}", 0)
        for tail in ([11, 12], [200, 3, 4]):  # the second finds the first's blocks cached
            p = prefix + tail
            out = llm.generate([p], params, f"{name}{i}")[0]
            assert list(out.token_ids) == hf_greedy(model, p, GEN)[0], (name, tail)
    assert llm.engine.runner.model.layers[0].mlp.down_proj.quant == "int4"
    assert llm.engine.blocks.hits > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "nf4-double-quant"])
def test_gpu_bf16_int4_checkpoint_matches_peft(tmp_path, fmt):
    """bf16 on CUDA, so the GEMM runs its pair ops (inline PTX: the biased-integer lop3 for
    zero points, the prmt codebook lookup for NF4) that the fp32 test above never reaches,
    under captured graphs with two adapters beside the base; against transformers + PEFT in
    fp32 on the dequantized weights, with test_cuda_graphs' bf16 tolerance."""
    from metrale import SamplingParams
    from tests.helpers.reference import assert_greedy_close, hf_greedy, prompts
    from tests.helpers.tiny_models import GPU_DIMS

    base = make_model("llama", seed=13, **GPU_DIMS)
    ref = copy.deepcopy(base)
    ref.load_state_dict(int4_checkpoint(base, tmp_path / "q", *FORMATS[fmt]))
    adapters = {name: make_adapter(ref, tmp_path / name, seed=seed, r=8, lora_alpha=16,
                                   target_modules="all-linear")
                for name, seed in (("A", 3), ("B", 4))}
    llm = LLM(tmp_path / "q", max_loras=2, max_lora_rank=8, block_size=16, max_model_len=128,
              num_kv_blocks=64, max_num_seqs=8, device="cuda", dtype="bfloat16")
    for name in adapters:
        llm.register_adapter(name, tmp_path / name)
    names = ["A", None, "B", None]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    inputs = prompts(11, len(names))
    outs = llm.generate(inputs, params, names)
    compared = 0
    for prompt, out, who in zip(inputs, outs, names):
        model = (ref if who is None else adapters[who]).to("cuda")
        want, want_lp = hf_greedy(model, prompt, len(out.token_ids))
        compared += assert_greedy_close(out.token_ids, [lp["logprob"] for lp in out.logprobs],
                                        want, want_lp.cpu(), 0.15, f"{fmt} {who}")
    assert compared >= 12, "too few tokens compared before bf16 divergence"
    assert all(p.quant == "int4" for p in _projections(llm))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
