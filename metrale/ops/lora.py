"""Multi-LoRA dispatch for the layers: the pool views of the fused modules, through the
Triton kernels on CUDA or the torch reference; one entry point per place a LoRA applies
(decoder projections, embed_tokens, lm_head)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from metrale.forward_context import LoraBatch
from metrale.ops import lora_ref, lora_triton

# Run the Triton kernels on CPU tensors too (Triton's interpreter): tests set it to check
# the engine end to end through the kernels; the CPU engine otherwise uses the reference.
TRITON_ON_CPU = False


def _triton(t: torch.Tensor) -> bool:
    return t.is_cuda or TRITON_ON_CPU


def lora_apply(
    y: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int,
    modules: tuple[str, ...], out_slices: tuple[slice, ...], bias: torch.Tensor | None = None,
) -> None:
    """y[:, out_slices[i]] += LoRA_{modules[i]}(x) in place (lora_ref's semantics, DoRA
    included); modules the pool does not serve are skipped."""
    views = lora.pool.fused_views(layer, modules, out_slices)
    if views is None:
        return
    As, Bts, slices, scales, ranks, doras, gains = views
    if _triton(y):
        lora_triton.lora_apply_fused(y, x, As, Bts, slices, lora.slot_ids, scales, ranks,
                                     order=lora.order, doras_list=doras, gains_list=gains,
                                     bias=bias)
    else:
        lora_ref.lora_apply_fused_ref(y, x, As, Bts, slices, lora.slot_ids, scales, ranks,
                                      groups=lora.groups, doras_list=doras, gains_list=gains,
                                      bias=bias)


def lora_linear(
    x: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None,
    lora: LoraBatch, layer: int, modules: tuple[str, ...], out_slices: tuple[slice, ...],
) -> torch.Tensor:
    """base(x) (the base linear, bias included) plus lora_apply's delta (on CUDA the shrink
    overlaps the GEMM)."""
    views = lora.pool.fused_views(layer, modules, out_slices)
    if views is None or not _triton(x):
        y = base(x)
        if views is not None:
            lora_apply(y, x, lora, layer, modules, out_slices, bias)
        return y
    As, Bts, slices, scales, ranks, doras, gains = views
    return lora_triton.lora_linear(x, base, bias, As, Bts, slices, lora.slot_ids, scales,
                                   ranks, order=lora.order, doras_list=doras, gains_list=gains)


def lora_embed(y: torch.Tensor, ids: torch.Tensor, lora: LoraBatch) -> None:
    """y: [T, hidden] base embeddings of ids [T]; adds each token's embed_tokens LoRA."""
    views = lora.pool.fused_views(0, ("embed_tokens",), (slice(0, y.shape[1]),))
    if views is None:
        return
    (A,), (Bt,), _, (scales,), (ranks,), (doras,), (gains,) = views
    if _triton(y):
        lora_triton.lora_embed(y, ids, A, Bt, lora.slot_ids, scales, ranks, doras, gains,
                               order=lora.order)
    else:
        lora_ref.lora_embed_ref(y, ids, A, Bt, lora.slot_ids, scales, ranks, doras, gains,
                                groups=lora.groups)


def lora_logits(y: torch.Tensor, hidden: torch.Tensor, lora: LoraBatch,
                rows: torch.Tensor | None) -> None:
    """y: [N, vocab] base logits of hidden [N, h]; adds lm_head's LoRA. rows: [N] indices
    of these rows among the batch's tokens (None: row i is token i)."""
    if lora.pool.fused_views(0, ("lm_head",), (slice(0, y.shape[1]),)) is None:
        return
    if rows is not None:
        slot_ids = lora.slot_ids[rows]  # [N]
        groups = (lora_ref.token_groups(slot_ids.tolist(), y.device)
                  if lora.groups is not None else None)
        lora = LoraBatch(lora.pool, slot_ids, None, groups)
    lora_apply(y, hidden, lora, 0, ("lm_head",), (slice(0, y.shape[1]),))
