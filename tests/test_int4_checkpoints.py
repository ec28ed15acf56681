"""4-bit AWQ (gemm) and GPTQ checkpoints (act-order or not, sym or asym, v1 and v2 zero
formats) load through the dequantizing reference path: greedy tokens equal transformers +
PEFT on the dequantized weights, base and two adapters mixed in one batch.

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

from metrale import LLM, SamplingParams
from tests.helpers.reference import hf_greedy
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


def int4_checkpoint(base, path, method: str, act_order: bool = False, sym: bool = False,
                    v2: bool = True):
    save_model(base, path)
    tensors, dequantized = {}, {}
    g = torch.Generator().manual_seed(0)
    for name, w in base.state_dict().items():
        if not any(f".{m}." in name for m in LINEAR):
            tensors[name], dequantized[name] = w.contiguous(), w
            continue
        n_in, prefix = w.shape[1], name.removesuffix("weight")
        n_groups = n_in // GROUP
        group_of = torch.arange(n_in) // GROUP
        if act_order:  # rows of a group scattered across the input dimension
            group_of = group_of[torch.randperm(n_in, generator=g)]
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
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (path / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("method, act_order, sym, v2", [
    ("awq", False, False, True),
    ("gptq", False, False, True),
    ("gptq", True, False, True),  # act-order
    ("gptq", True, True, False),  # sym, the v1 zero format (zero - 1 stored)
], ids=["awq", "gptq", "gptq-act-order", "gptq-sym-v1"])
def test_int4_checkpoint_equals_transformers_peft_on_its_dequantized_weights(
        tmp_path, method, act_order, sym, v2):
    base = make_model("llama", seed=13)
    dequantized = int4_checkpoint(base, tmp_path / "q", method, act_order, sym, v2)
    ref = copy.deepcopy(base)
    ref.load_state_dict(dequantized)
    adapters = {name: make_adapter(ref, tmp_path / name, seed=seed, r=4, lora_alpha=8,
                                   target_modules="all-linear")
                for name, seed in (("x", 3), ("y", 4))}
    llm = LLM(tmp_path / "q", max_loras=2, max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64)
    for name in adapters:
        llm.register_adapter(name, tmp_path / name)
    requests = [(p, a) for p in PROMPTS for a in (None, "x", "y")]
    outs = llm.generate([p for p, _ in requests],
                        SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True),
                        [a for _, a in requests])
    for (prompt, adapter), out in zip(requests, outs):
        want, _ = hf_greedy(adapters[adapter] if adapter else ref, prompt, GEN)
        assert list(out.token_ids) == want, (method, adapter)


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
