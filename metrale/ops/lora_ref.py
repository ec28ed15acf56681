"""Plain-torch multi-LoRA: the CPU engine's path and the tests' oracle for the Triton kernels.

The pool's A: [S, R, in] and Bt: [S, R, out] have rows past a slot's rank zero, so the full-R
product is exact (`ranks` only skip work); per-slot scales: [S] float32. For each token t of
slot s = slot_ids[t] >= 0 (-1: base model only):
  y[t] += scales[s] * (x[t] @ A[s].T) @ Bt[s]
and for a slot flagged in `doras`, with gains[s] = m / ||W + sBA|| ([out] float32; y holds
x W^T + bias on entry):
  y[t] = gains[s] * (y[t] - bias + scales[s] * (x[t] @ A[s].T) @ Bt[s]) + bias

One dense matmul per distinct slot, not a [T, R, in] gather of weights; the engine groups
once per batch (`token_groups`), a contiguous group being a slice read and added through views.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def slot_groups(slot_ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(slot, token indices) per slot used, -1 skipped; a batch without adapter tokens
    costs no sort."""
    if slot_ids.numel() == 0 or not bool((slot_ids >= 0).any()):
        return
    sorted_slots, order = torch.sort(slot_ids, stable=True)  # both: [T]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)  # [G], [G]
    for slot, idx in zip(slots.tolist(), order.split(counts.tolist()), strict=True):
        if slot >= 0:
            yield slot, idx  # idx: [n] token indices of this slot


TokenIndex = torch.Tensor | slice
SlotGroups = list[tuple[int, TokenIndex]]


def token_groups(slot_ids: Sequence[int], device: torch.device | str = "cpu") -> SlotGroups:
    """slot_groups from the host list of token slots, a contiguous group as a slice."""
    where: dict[int, list[int]] = {}
    for t, slot in enumerate(slot_ids):
        if slot >= 0:
            where.setdefault(slot, []).append(t)
    groups: SlotGroups = []
    for slot, idx in sorted(where.items()):
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((slot, slice(idx[0], idx[-1] + 1)))
        else:
            groups.append((slot, torch.tensor(idx, dtype=torch.int64, device=device)))
    return groups


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
        _add_group(y, idx, h[idx].float(), Bt[slot], scales[slot])


def _add_group(
    y: torch.Tensor, idx: TokenIndex, h: torch.Tensor, Bt_s: torch.Tensor, scale: torch.Tensor,
    gain: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> None:
    """y[idx] += scale * h @ Bt_s for one slot's tokens, h: [n, r] float32, Bt_s: [r, out]
    (DoRA, gain given: y[idx] = gain * (y[idx] - bias + that delta) + bias)."""
    delta = (h @ Bt_s.float()) * scale.float()  # delta: [n, out]
    if gain is None:  # float32 sum, stored in y's dtype
        y[idx] = (y[idx].float() + delta).to(y.dtype)  # y[idx]: [n, out]
        return
    b = 0.0 if bias is None else bias.float()  # [out]; y[idx] holds x W^T + bias
    y[idx] = (gain.float() * (y[idx].float() - b + delta) + b).to(y.dtype)


def lora_apply_ref(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
    slot_ids: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor | None = None,
) -> None:
    """lora_apply_fused_ref for one module."""
    lora_apply_fused_ref(y, x, [A], [Bt], [slice(None)], slot_ids, [scales],
                         None if ranks is None else [ranks])


def lora_apply_fused_ref(
    y: torch.Tensor, x: torch.Tensor, As: Sequence[torch.Tensor], Bts: Sequence[torch.Tensor],
    out_slices: Sequence[slice], slot_ids: torch.Tensor, scales_list: Sequence[torch.Tensor],
    ranks_list: Sequence[torch.Tensor] | None = None, groups: SlotGroups | None = None,
    doras_list: Sequence[torch.Tensor] | None = None,
    gains_list: Sequence[torch.Tensor] | None = None, bias: torch.Tensor | None = None,
) -> None:
    """Modules reading the same x (q/k/v, gate/up) add into slices of one y in place: module
    i into y[:, out_slices[i]]. ranks_list ([S] int each) skip rank padding and rank-0
    (untargeted) slots; groups: token_groups(slot_ids) when the caller has it;
    doras_list / gains_list ([S], [S, out_i] per module) and bias (the one y holds): DoRA."""
    n = len(As)
    if not (len(Bts) == len(out_slices) == len(scales_list) == n):
        raise ValueError("As, Bts, out_slices and scales_list must have one entry per module")
    if groups is None:
        groups = list(slot_groups(slot_ids))
    if not groups:
        return
    # host copies, once per call: an element read per group and module costs a CPU step dearly
    rank_rows = [r.tolist() for r in ranks_list] if ranks_list is not None else None
    scale_rows = [s.tolist() for s in scales_list]
    y_views = [y[:, sl] for sl in out_slices]  # y_i: [T, out_i], views: writes land in y
    for slot, idx in groups:
        x_g = x[idx].float()  # x_g: [n, in], gathered once for all modules (a view for a slice)
        for i in range(n):
            rank = rank_rows[i][slot] if rank_rows is not None else None
            if rank == 0:
                continue  # module not targeted by this adapter
            A_s, Bt_s = As[i][slot], Bts[i][slot]
            if rank is not None:
                A_s, Bt_s = A_s[:rank], Bt_s[:rank]  # A_s: [r, in], Bt_s: [r, out]
            gain = b = None
            if doras_list is not None and int(doras_list[i][slot]):
                gain, b = gains_list[i][slot], None if bias is None else bias[out_slices[i]]
            if gain is None and y.dtype == torch.float32:
                _add_delta(y_views[i], x_g, idx, A_s, Bt_s, scale_rows[i][slot])
            else:
                h = x_g @ A_s.float().T  # h: [n, r]
                _add_group(y_views[i], idx, h, Bt_s, scales_list[i][slot], gain, b)


def _add_delta(y: torch.Tensor, x_g: torch.Tensor, idx: TokenIndex, A_s: torch.Tensor,
               Bt_s: torch.Tensor, scale: float) -> None:
    """y[idx] += scale * (x_g @ A_s.T) @ Bt_s for a float32 y, the scale riding on the add,
    scattered tokens through index_add_ (no gather of y[idx] and scatter back)."""
    delta = (x_g @ A_s.float().T) @ Bt_s.float()  # [n, r] @ [r, out] -> [n, out], unscaled
    # The same y + scale * delta in both branches, so slices and index tensors agree bit
    # for bit (the tests hold the engine's batch groups to the per-call grouping).
    if isinstance(idx, slice):
        y[idx].add_(delta, alpha=scale)  # y[idx]: [n, out], a view
    else:
        y.index_add_(0, idx, delta, alpha=scale)


def lora_embed_ref(
    y: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
    slot_ids: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor | None = None,
    doras: torch.Tensor | None = None, gains: torch.Tensor | None = None,
    groups: SlotGroups | None = None,
) -> None:
    """PEFT's lora_embedding_A/B in place: y[t] += scales[s] * A[s][:, ids[t]] @ Bt[s] (DoRA
    slots: y[t] = gains[s] * (y[t] + that)); y: [T, hidden], A: [S, R, vocab]."""
    for slot, idx in slot_groups(slot_ids) if groups is None else groups:
        rank = int(ranks[slot]) if ranks is not None else None
        if rank == 0:
            continue
        A_s, Bt_s = (A[slot], Bt[slot]) if rank is None else (A[slot, :rank], Bt[slot, :rank])
        h = A_s[:, ids[idx]].T.float()  # [n, r]: one column of A per token
        gain = gains[slot] if doras is not None and int(doras[slot]) else None
        _add_group(y, idx, h, Bt_s, scales[slot], gain)
