"""Triton multi-LoRA over the adapter pool: lora_ref's semantics, plus per-slot `ranks` so
rank padding costs nothing (docs/DESIGN.md, "The multi-LoRA kernels"). No call syncs with
the host or reads slot contents there: CUDA graphs stay valid across adapter swaps."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from metrale.ops import lora_launch as launch
from metrale.ops.lora_launch import PATHS, choose_path
from metrale.ops.triton_utils import require_triton

# Past this many tokens a batch without a slot order gets one (sort_tokens_by_slot) and
# the prefill mapping; the runner and the CUDA graphs read it to build one slot order per
# step (launch.segment_order).
DECODE_MAX_T = 64
# lora_linear's shrink beside the base GEMM on a side stream: faster at every batch size
# measured (BENCHMARKS.md, decode_overlap_ab); off only in `bench/decode.py --override`.
OVERLAP = True


def sort_tokens_by_slot(slot_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64 token indices grouped by slot: built once per batch, for every layer."""
    return torch.argsort(slot_ids, stable=True)


def slot_order(slot_ids: torch.Tensor) -> torch.Tensor:
    """The engine's slot order (launch.segment_order) of a device tensor of slot ids: built
    on the host, as the runner and the CUDA graphs build it (a sync: tests and benches)."""
    order = launch.segment_order(slot_ids.cpu().numpy().astype("int64"))
    return torch.from_numpy(order).to(slot_ids.device)


def _order_for(slot_ids: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor | None:
    if order is None and slot_ids.shape[0] > DECODE_MAX_T:
        return sort_tokens_by_slot(slot_ids)
    return order


def _path_for(x: torch.Tensor, path: str | None) -> str:
    path = path or choose_path(x.shape[0])
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return path


def lora_shrink(
    x: torch.Tensor, A: torch.Tensor, slot_ids: torch.Tensor, ranks: torch.Tensor, *,
    order: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """h: [T, R] float32 = x @ A[slot].T per token (zeros for slot -1 and past ranks[slot])."""
    require_triton()
    h = out if out is not None else torch.empty(x.shape[0], A.shape[1], dtype=torch.float32,
                                                device=x.device)
    if h.dtype != torch.float32 or h.shape != (x.shape[0], A.shape[1]) or h.stride(1) != 1:
        raise ValueError(f"out must be float32 [T, R] with unit last stride, got {h.shape}")
    if x.shape[0]:
        launch.shrink(x, [A], slot_ids, [ranks], _order_for(slot_ids, order), h)
    return h


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, Bt: torch.Tensor, slot_ids: torch.Tensor,
    scales: torch.Tensor, ranks: torch.Tensor, *, order: torch.Tensor | None = None,
) -> None:
    """y += scales[slot] * h @ Bt[slot] in place, for tokens with slot >= 0."""
    require_triton()
    if y.shape[0]:
        launch.expand(y, h, [Bt], [0], slot_ids, [ranks], [scales], _order_for(slot_ids, order))


def lora_embed(
    y: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
    slot_ids: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor,
    doras: torch.Tensor | None = None, gains: torch.Tensor | None = None, *,
    order: torch.Tensor | None = None,
) -> None:
    """lora_embed_ref's semantics: a gather of A's columns on the device, then the expand."""
    require_triton()
    if y.shape[0] == 0:
        return
    h = A[slot_ids.clamp(min=0), :, ids].float().contiguous()  # [T, R]; rows of slot -1 unread
    launch.expand(y, h, [Bt], [0], slot_ids, [ranks], [scales], _order_for(slot_ids, order),
                  None if doras is None else [doras], None if gains is None else [gains])


def lora_apply_fused(
    y: torch.Tensor, x: torch.Tensor, As, Bts, out_slices, slot_ids: torch.Tensor,
    scales_list, ranks_list, *, order: torch.Tensor | None = None,
    doras_list=None, gains_list=None, bias: torch.Tensor | None = None,
    path: str | None = None,
) -> None:
    """lora_apply_fused_ref's semantics, one shrink and one expand launch for the group.
    path: one of PATHS, None (the engine's) for launch.PATH_TABLE's; order: from
    sort_tokens_by_slot."""
    require_triton()
    T, M = x.shape[0], len(As)
    if not (len(Bts) == len(out_slices) == len(scales_list) == len(ranks_list) == M):
        raise ValueError("As, Bts, out_slices, scales_list and ranks_list need one entry per module")
    cols = launch.y_cols(out_slices, Bts, y.shape[1])
    if T == 0:
        return
    path = _path_for(x, path)
    order = _order_for(slot_ids, order)
    h = launch.workspace(x, As, order, partials=path == "split")
    launch.shrink(x, As, slot_ids, ranks_list, order, h)
    launch.expand(y, h, Bts, cols, slot_ids, ranks_list, scales_list, order, doras_list,
                  gains_list, bias)


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream LoRA shrinks overlap the base work on (one per device)."""
    return torch.cuda.Stream(device)


def lora_linear(
    x: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None,
    As, Bts, out_slices, slot_ids: torch.Tensor, scales_list, ranks_list, *,
    order: torch.Tensor | None = None, doras_list=None, gains_list=None, path: str | None = None,
) -> torch.Tensor:
    """base(x) (the base linear, bias included: a dense or FP8 GEMM), then lora_apply_fused;
    on CUDA the shrink (it reads only x) runs on a side stream during the GEMM, the expand
    after both (graphs capture the fork)."""
    T = x.shape[0]
    if T == 0 or not (OVERLAP and x.is_cuda):
        y = base(x)  # [T, out]
        lora_apply_fused(y, x, As, Bts, out_slices, slot_ids, scales_list, ranks_list,
                         order=order, doras_list=doras_list, gains_list=gains_list, bias=bias,
                         path=path)
        return y
    require_triton()
    path = _path_for(x, path)
    order = _order_for(slot_ids, order)
    # allocated on the current stream and freed there after the expand, which runs after
    # the join: no other work can be handed this memory while the side stream writes it
    h = launch.workspace(x, As, order, partials=path == "split")
    main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
    side.wait_stream(main)  # x, slot_ids and order are written on the current stream
    with torch.cuda.stream(side):
        launch.shrink(x, As, slot_ids, ranks_list, order, h)
    y = base(x)  # [T, out]
    main.wait_stream(side)
    cols = launch.y_cols(out_slices, Bts, y.shape[1])
    launch.expand(y, h, Bts, cols, slot_ids, ranks_list, scales_list, order, doras_list,
                  gains_list, bias)
    return y
