"""Multi-LoRA dispatch: the layers call this; it picks the pool views of the
fused modules and runs the Triton kernels on CUDA or the torch reference."""

from __future__ import annotations

import torch

from metrale.forward_context import LoraBatch
from metrale.ops.lora_ref import lora_apply_fused_ref
from metrale.ops.lora_triton import lora_apply_fused


def lora_apply(
    y: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int,
    modules: tuple[str, ...], out_slices: tuple[slice, ...],
) -> None:
    """y[:, out_slices[i]] += LoRA_{modules[i]}(x) per token slot, in place.

    y: [T, sum(out)], x: [T, in]; modules the pool does not serve are skipped."""
    views = lora.pool.fused_views(layer, modules, out_slices)
    if views is None:
        return
    As, Bts, slices, scales, ranks = views
    if y.is_cuda:
        lora_apply_fused(y, x, As, Bts, slices, lora.slot_ids, scales, ranks, order=lora.order)
    else:
        lora_apply_fused_ref(y, x, As, Bts, slices, lora.slot_ids, scales, ranks,
                             groups=lora.groups)
