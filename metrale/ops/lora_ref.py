"""Plain-torch multi-LoRA: the CPU engine's path and the tests' oracle for the Triton kernels.

Layout (see metrale.pool): for one (layer, module) the pool exposes
  A:  [S, R, in]   rank-major; a rank-r adapter fills rows 0..r-1, rows r..R-1 are zero,
  Bt: [S, R, out]  B transposed, same convention,
and per-slot `scales: [S]` float32. Each token t carries `slot_ids[t]` (-1 = base model only):
  y[t] += scales[s] * (x[t] @ A[s].T) @ Bt[s]     for s = slot_ids[t] >= 0.
Zero padding makes the full-R product exact, so the shrink/expand references need no ranks;
`lora_apply_ref` takes optional `ranks` only to skip work on the CPU path.

Tokens are grouped by slot (one sort per call) so each distinct slot costs one dense matmul,
instead of gathering a [T, R, in] copy of the weights per token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def slot_groups(slot_ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (slot, token indices) for each slot used in the batch; slot -1 is skipped."""
    sorted_slots, order = torch.sort(slot_ids, stable=True)  # both: [T]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)  # [G], [G]
    for slot, idx in zip(slots.tolist(), order.split(counts.tolist()), strict=True):
        if slot >= 0:
            yield slot, idx  # idx: [n] token indices of this slot


def lora_shrink_ref(x: torch.Tensor, A: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """h[t] = x[t] @ A[slot_ids[t]].T in float32; zeros for tokens with slot -1."""
    h = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)  # h: [T, R]
    for slot, idx in slot_groups(slot_ids):
        h[idx] = x[idx].float() @ A[slot].float().T  # [n, in] @ [in, R] -> [n, R]
    return h


def lora_expand_ref(
    y: torch.Tensor, h: torch.Tensor, Bt: torch.Tensor, slot_ids: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """y[t] += scales[s] * h[t] @ Bt[s] in place (float32 math, stored in y's dtype)."""
    for slot, idx in slot_groups(slot_ids):
        delta = (h[idx].float() @ Bt[slot].float()) * scales[slot].float()  # [n, out]
        y[idx] = (y[idx].float() + delta).to(y.dtype)  # y[idx]: [n, out]


def _has_adapter_tokens(slot_ids: torch.Tensor) -> bool:
    return slot_ids.numel() > 0 and bool((slot_ids >= 0).any())


def _apply_group(
    y: torch.Tensor, x_g: torch.Tensor, idx: torch.Tensor, A_s: torch.Tensor,
    Bt_s: torch.Tensor, scale: torch.Tensor, rank: int | None,
) -> None:
    """One slot's tokens: y[idx] += scale * (x_g @ A_s[:rank].T) @ Bt_s[:rank]."""
    if rank is not None:
        if rank == 0:
            return  # module not targeted by this adapter
        A_s, Bt_s = A_s[:rank], Bt_s[:rank]  # A_s: [r, in], Bt_s: [r, out]
    h = x_g @ A_s.float().T  # h: [n, r]
    delta = (h @ Bt_s.float()) * scale.float()  # delta: [n, out]
    y[idx] = (y[idx].float() + delta).to(y.dtype)  # y[idx]: [n, out]


def lora_apply_ref(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
    slot_ids: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor | None = None,
) -> None:
    """y += LoRA(x) in place, token by token's slot; no work when no token uses an adapter.

    ranks ([S] int, optional): slices the rank padding away and skips untargeted slots (rank 0).
    """
    if not _has_adapter_tokens(slot_ids):
        return
    rank_of = ranks.tolist() if ranks is not None else None
    for slot, idx in slot_groups(slot_ids):
        x_g = x[idx].float()  # x_g: [n, in]
        rank = rank_of[slot] if rank_of is not None else None
        _apply_group(y, x_g, idx, A[slot], Bt[slot], scales[slot], rank)


def lora_apply_fused_ref(
    y: torch.Tensor, x: torch.Tensor, As: Sequence[torch.Tensor], Bts: Sequence[torch.Tensor],
    out_slices: Sequence[slice], slot_ids: torch.Tensor, scales_list: Sequence[torch.Tensor],
    ranks_list: Sequence[torch.Tensor] | None = None,
) -> None:
    """Several modules reading the same x (q/k/v, gate/up) adding into slices of one fused y.

    y: [T, sum(out_i)]; module i adds into y[:, out_slices[i]] (width Bts[i].shape[2]).
    """
    if not _has_adapter_tokens(slot_ids):
        return
    n = len(As)
    if not (len(Bts) == len(out_slices) == len(scales_list) == n):
        raise ValueError("As, Bts, out_slices and scales_list must have one entry per module")
    rank_of = [r.tolist() for r in ranks_list] if ranks_list is not None else None
    for slot, idx in slot_groups(slot_ids):
        x_g = x[idx].float()  # x_g: [n, in], gathered once for all modules
        for i in range(n):
            y_i = y[:, out_slices[i]]  # y_i: [T, out_i], a view: writes land in y
            rank = rank_of[i][slot] if rank_of is not None else None
            _apply_group(y_i, x_g, idx, As[i][slot], Bts[i][slot], scales_list[i][slot], rank)
