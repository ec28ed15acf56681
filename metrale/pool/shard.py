"""An adapter's slice on one rank of a tensor-parallel group (docs/DESIGN.md, "Tensor
parallelism"), chosen so that LoRA adds no communication of its own:

- column-parallel modules (q, k, v, gate, up): A replicated, B (and DoRA's M) split along
  the output like the base weight, so x @ A.T @ B.T lands in the rank's own output columns;
- row-parallel modules (o, down): A split along the input like the base weight, B
  replicated: each rank's B @ (A_k @ x_k) is a partial sum that joins the base's partial
  sum in the layer's one all-reduce (the expand folded into it: 0 extra bytes).

A rank's pool is laid out for its parallel.shard_config (SlotLayout then sizes every region
as its slice); rank 0 keeps the whole adapter in its pool (every read, check and host-tier
path works on whole files) and reads its slice through `PoolShard`.
"""

from __future__ import annotations

import torch

from metrale.config import ModelConfig
from metrale.model.parallel import Shard
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import AdapterPool

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
               shard: Shard) -> torch.Tensor:
    """data [full.slot_elems]: one slot of the whole adapter -> [shard_layout.slot_elems],
    rank `shard`'s slice in its own layout (padding zero)."""
    out = torch.zeros(shard_layout.slot_elems, dtype=data.dtype, device=data.device)
    for key, r in shard_layout.regions.items():
        f = full.regions[key]
        src = data[f.offset:f.offset + f.numel].view(f.rows, f.cols)  # [rows, cols]
        out[r.offset:r.offset + r.numel].view(r.rows, r.cols).copy_(
            rank_slice(src, key[1], key[2], shard))
    return out


def shard_layout(full: SlotLayout, shard_cfg: ModelConfig) -> SlotLayout:
    return SlotLayout(shard_cfg, full.pool, full.dtype)


class PoolShard:
    """Rank 0's view of its whole-adapter pool as its slice (metrale.forward_context's
    LoraViews): the views the LoRA ops read are column slices of the pool's, no copies."""

    def __init__(self, pool: AdapterPool, shard: Shard) -> None:
        self.pool, self.shard = pool, shard
        self._fused: dict = {}

    def fused_views(self, layer: int, modules: tuple[str, ...], out_slices: tuple[slice, ...]):
        key = (layer, modules)
        if key not in self._fused:
            views = self.pool.fused_views(layer, modules, out_slices)
            if views is None:
                self._fused[key] = None
            else:
                As, Bts, slices, scales, ranks, doras, gains = views
                served = [m for m in modules if (layer, m) in self.pool.layout.gain_offsets]
                cut = lambda vs, kind: [rank_slice(v, m, kind, self.shard)  # noqa: E731
                                        for v, m in zip(vs, served)]
                self._fused[key] = (cut(As, "A"), cut(Bts, "B"), slices, scales, ranks, doras,
                                    cut(gains, "M"))  # gains: per output row, as M
        return self._fused[key]

    def expert_views(self, layer: int, module: str):
        return None  # parallel.check_tensor_parallel refuses MoE bases
