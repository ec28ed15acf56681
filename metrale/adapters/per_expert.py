"""Adapters in transformers 4's per-expert layout: PEFT wrapped each expert's own Linears
(`mlp.experts.7.gate_proj`, Mixtral's `block_sparse_moe.experts.7.w1`), told apart from
the stacked layout by such tensor names. Each Linear lands in its block of the layer's
stacked expert target, gate and up side by side."""

from __future__ import annotations

import re
from dataclasses import dataclass

from metrale.adapters.patterns import MatchBudget
from metrale.adapters.safetensors_file import TensorEntry
from metrale.adapters.targets import ModuleTarget, TensorLanding, check_pool_serves, check_rank
from metrale.config import ModelConfig, PoolConfig
from metrale.errors import AdapterMismatchError, UnsupportedAdapterError

# PEFT on transformers 4's MoE layers wraps each expert's own Linears (mlp.experts.7.gate_proj;
# Mixtral's block_sparse_moe.experts.7.w1 / w3 / w2): name -> (our stacked module, part)
_EXPERT_LINEARS = {"gate_proj": ("experts_gate_up", 0), "up_proj": ("experts_gate_up", 1),
                   "down_proj": ("experts_down", 0)}
_MIXTRAL_EXPERT_LINEARS = {"w1": ("experts_gate_up", 0), "w3": ("experts_gate_up", 1),
                           "w2": ("experts_down", 0)}
PER_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class ExpertPart:
    """One expert's own Linear in a per-expert adapter, and its block of the layer's
    stacked target: gate and up sit side by side (A rows [gate r | up r] per expert, Bt
    columns [gate | up]), so the stacked rank is their sum."""

    target: ModuleTarget
    expert: int
    rank: int
    rank_offset: int  # first of its rank rows within the expert's block
    col0: int  # first output column (up's: the expert size)
    out: int  # output columns


def moe_block(model: ModelConfig) -> str:
    """A transformers 4 MoE layer's MLP module name."""
    return "block_sparse_moe" if model.model_type == "mixtral" else "mlp"


def expert_linears(model: ModelConfig) -> dict[str, tuple[int, str, int, int]]:
    """path -> (layer, stacked module, part, expert) of every expert Linear of a
    transformers 4 MoE model."""
    if model.moe is None:
        return {}
    names = _MIXTRAL_EXPERT_LINEARS if model.model_type == "mixtral" else _EXPERT_LINEARS
    block = moe_block(model)
    return {f"model.layers.{layer}.{block}.experts.{e}.{name}": (layer, module, part, e)
            for layer in model.moe.layers for e in range(model.moe.num_experts)
            for name, (module, part) in names.items()}


def stack_expert_linears(peft, model: ModelConfig, pool: PoolConfig, linears: dict,
                          budget: MatchBudget):
    """The stacked targets the wrapped expert Linears land in, and each Linear's ExpertPart:
    per (layer, module) a rank of the parts' largest ranks side by side, one scale."""
    wrapped: dict[tuple[int, str], list] = {}
    for path, (layer, module, part, expert) in linears.items():
        if peft.targets(path, budget):
            check_pool_serves(path, module, pool)
            wrapped.setdefault((layer, module), []).append(
                (path, part, expert, peft.rank_for(path, budget), peft.scaling_for(path, budget)))
    targets, parts = [], {}
    for (layer, module), found in wrapped.items():
        scales = {scale for *_, scale in found}
        if len(scales) > 1:
            raise UnsupportedAdapterError(
                f"experts of layer {layer} have LoRA scales {sorted(scales)} (rank or alpha "
                "patterns that differ between an expert's gate, up or down, or between "
                "experts); the stacked expert LoRA holds one scale per layer")
        part_rank = {}
        for _, part, _, rank, _ in found:
            part_rank[part] = max(part_rank.get(part, 0), rank)
        offsets = {part: sum(r for p, r in part_rank.items() if p < part) for part in part_rank}
        total = sum(part_rank.values())
        check_rank(f"model.layers.{layer} experts ({module}: their gate and up LoRA side by "
                    "side)", total, pool, total)
        target = ModuleTarget(layer, module, total, scales.pop(), model.module_rows(module))
        targets.append(target)
        size = model.linear_shape(module)[1] // (2 if module == "experts_gate_up" else 1)
        for path, part, expert, rank, _ in found:
            parts[path] = ExpertPart(target, expert, rank, offsets[part], part * size, size)
    return targets, parts


def expert_landing(source: str, entry: TensorEntry, kind: str, part: ExpertPart,
                    model: ModelConfig) -> TensorLanding:
    """One expert Linear's A [r, in] or B [out, r] into its block of the stacked region:
    A rows e * R + offset (the expert's block of R rows), Bt rows (offset + i) * E + e
    (the stacked layout is rank-major: PEFT's ParamWrapper's) from column col0."""
    t = part.target
    d_in = model.linear_shape(t.module)[0]
    expected = (part.rank, d_in) if kind == "A" else (part.out, part.rank)
    if kind not in ("A", "B") or entry.shape != expected:
        raise AdapterMismatchError(
            f"{source}: {entry.name} has shape {list(entry.shape)}, expected "
            f"{list(expected)} for this base model at rank {part.rank}")
    if kind == "A":
        return TensorLanding(t, "A", entry, part=entry.name.rsplit(".lora_", 1)[0],
                             n_rows=part.rank, row0=part.expert * t.rank + part.rank_offset)
    return TensorLanding(t, "B", entry, part=entry.name.rsplit(".lora_", 1)[0], n_rows=part.rank,
                         row0=part.rank_offset * t.experts + part.expert, row_step=t.experts,
                         col0=part.col0, cols=part.out)
