"""An adapter's slice on one rank of a tensor-parallel group (docs/DESIGN.md, "Tensor
parallelism"), chosen so that LoRA adds no communication of its own:

- column-parallel modules (q, k, v, gate, up): A replicated, B (and DoRA's M) split along
  the output like the base weight, so x @ A.T @ B.T lands in the rank's own output columns;
- row-parallel modules (o, down): A split along the input like the base weight, B
  replicated: each rank's B @ (A_k @ x_k) is a partial sum that joins the base's partial
  sum in the layer's one all-reduce (the expand folded into it: 0 extra bytes).

Every rank's serving pool is laid out for its parallel.shard_config (SlotLayout then sizes
every region as its slice); rank 0 lands and verifies each adapter whole in its landing area
(pool/landing_area.py) and slices it from there, for itself and for the workers.
"""

from __future__ import annotations

import torch

from metrale.model.parallel import Shard
from metrale.pool.layout import SlotLayout

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def split_kind(module: str) -> str | None:
    """Which of a module's factors is split across ranks: "B" (and M) for a column-parallel
    module, "A" for a row-parallel one."""
    if module in COLUMN_PARALLEL:
        return "B"
    if module in ROW_PARALLEL:
        return "A"
    raise ValueError(f"{module}: no tensor-parallel split for this LoRA target")


def rank_slice(view: torch.Tensor, module: str, kind: str, shard: Shard) -> torch.Tensor:
    """view [..., cols] of one (module, kind) of the whole adapter -> this rank's columns
    [..., cols / size] (a view), or view itself where the factor is replicated."""
    split = split_kind(module)
    if kind == split or (kind == "M" and split == "B"):
        return view.chunk(shard.size, dim=-1)[shard.rank]
    return view


def slice_slot(full: SlotLayout, data: torch.Tensor, shard_layout: SlotLayout,
               shard: Shard, out: torch.Tensor | None = None) -> torch.Tensor:
    """data [full.slot_elems]: one slot of the whole adapter -> [shard_layout.slot_elems],
    rank `shard`'s slice in its own layout (padding zero), into `out` when given."""
    if out is None:
        out = torch.zeros(shard_layout.slot_elems, dtype=data.dtype, device=data.device)
    else:
        out.zero_()
    for key, r in shard_layout.regions.items():
        f = full.regions[key]
        src = data[f.offset:f.offset + f.numel].view(f.rows, f.cols)  # [rows, cols]
        out[r.offset:r.offset + r.numel].view(r.rows, r.cols).copy_(
            rank_slice(src, key[1], key[2], shard))
    return out
