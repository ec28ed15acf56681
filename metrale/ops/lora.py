"""Multi-LoRA dispatch: the layers call this; it picks the pool views of the
fused modules and runs the Triton kernels on CUDA or the torch reference."""

from __future__ import annotations

import torch

from metrale.model.context import LoraBatch
from metrale.ops.lora_ref import lora_apply_fused_ref


def lora_apply(
    y: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int,
    modules: tuple[str, ...], out_slices: tuple[slice, ...],
) -> None:
    """y[:, out_slices[i]] += LoRA_{modules[i]}(x) per token slot, in place.

    y: [T, sum(out)], x: [T, in]; modules the pool does not serve are skipped."""
    pool = lora.pool
    served = pool.layout.pool.target_modules
    picked = [(m, s) for m, s in zip(modules, out_slices) if m in served]
    if not picked:
        return
    idx = [pool.layout.module_index(m) for m, _ in picked]
    As = [pool.lora_a(layer, m) for m, _ in picked]  # each [S, R, in]
    Bts = [pool.lora_bt(layer, m) for m, _ in picked]  # each [S, R, out_m]
    scales = [pool.scales[:, layer, i] for i in idx]  # each [S]
    ranks = [pool.ranks[:, layer, i] for i in idx]  # each [S]
    lora_apply_fused_ref(y, x, As, Bts, [s for _, s in picked], lora.slot_ids, scales, ranks)
