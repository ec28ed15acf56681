"""AdapterPool: one contiguous device tensor holding every slot, the per-slot rank, scale
and DoRA tables, and the strided views the kernels read. Addresses never change after
construction, so CUDA graphs captured over these views stay valid. Tensors and their
layout only: what goes into a slot, and the checks on it, are the landing's
(metrale.pool.landing), which writes through one slot's `SlotTensors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from metrale.ops.moe_triton import ExpertLora
from metrale.ops.norms_triton import KIND_A, KIND_B, KIND_MAX, region_descriptors
from metrale.pool.layout import SlotLayout


@dataclass(frozen=True)
class NormGroup:
    """An evenly spaced run of one (module, kind)'s regions in one slot, as one
    [layers, rows, cols] view: a slot's norms reduce over all its layers at once."""

    keys: tuple[tuple[int, str, str], ...]  # (layer, module, kind) of each view row
    view: torch.Tensor  # [layers, rows, cols]
    kind: str  # "A" | "B" | "M"
    one_hot: bool  # an embedding's A (its norm is the largest |value|)


@dataclass(frozen=True)
class SlotTensors:
    """One slot's part of every pool tensor: all a landing writes, zeroes and checks."""

    index: int
    data: torch.Tensor  # [slot_elems] the slot's region of the pool buffer
    ranks: torch.Tensor  # [L, M] int32
    scales: torch.Tensor  # [L, M] float32
    doras: torch.Tensor  # [L, M] int32, 1: apply DoRA's gain
    gains: torch.Tensor  # [gain_elems] float32
    norm_groups: tuple[NormGroup, ...]  # cover every region of the slot
    # norms_triton's [regions, 4] descriptors, offsets from `data` (every slot's are the
    # same), in norm_keys order: the CUDA path's (the CPU's reads norm_groups)
    norm_desc: torch.Tensor

    def region(self, layout: SlotLayout, layer: int, module: str, kind: str) -> torch.Tensor:
        """[rows, cols] view of one (layer, module, kind) region of this slot."""
        r = layout.region(layer, module, kind)
        return self.data[r.offset:r.offset + r.numel].view(r.rows, r.cols)


class AdapterPool:
    def __init__(self, layout: SlotLayout, device: torch.device | str,
                 base_weights: Mapping[tuple[int, str], torch.Tensor] | None = None) -> None:
        """base_weights: (layer, module) -> base W [out, in], read for DoRA's norms; None
        for a pool that runs no model (the peer store): gains then stay 1."""
        self.layout = layout
        self.device = torch.device(device)
        self.base_weights = base_weights
        S, L, M = layout.pool.max_loras, layout.model.num_layers, len(layout.table_modules)
        # pool: [S * slot_elems]; slot s occupies [s * slot_elems, (s+1) * slot_elems)
        self.buffer = torch.zeros(S * layout.slot_elems, dtype=layout.dtype, device=self.device)
        self.ranks = torch.zeros(S, L, M, dtype=torch.int32, device=self.device)
        self.scales = torch.zeros(S, L, M, dtype=torch.float32, device=self.device)
        self.doras = torch.zeros(S, L, M, dtype=torch.int32, device=self.device)  # 1: apply g
        # gains: [S, gain_elems] float32, DoRA's g per output row; 1 where no DoRA landed
        self.gains = torch.ones(S, layout.gain_elems, dtype=torch.float32, device=self.device)
        # per region [S, max_rank, cols]: one row block per slot, slot stride = slot_elems
        self._views = {key: self.buffer.as_strided((S, r.rows, r.cols), (layout.slot_elems, r.cols, 1),
                                                   r.offset)
                       for key, r in layout.regions.items()}
        self._fused: dict = {}
        # (layer, module, kind) -> its position in a slot's norms (landing.slot_norms)
        groups0 = self._norm_groups(0) if S else ()
        self.norm_keys: dict[tuple[int, str, str], int] = {
            key: i for i, key in enumerate(key for g in groups0 for key in g.keys)}
        desc = self._norm_descriptors(groups0) if S else None
        n = layout.slot_elems
        self.slot_tensors: tuple[SlotTensors, ...] = tuple(
            SlotTensors(s, self.buffer[s * n:(s + 1) * n], self.ranks[s], self.scales[s],
                        self.doras[s], self.gains[s],
                        groups0 if s == 0 else self._norm_groups(s), desc)
            for s in range(S))

    def lora_a(self, layer: int, module: str) -> torch.Tensor:
        """A: [S, max_rank, in]"""
        return self._views[(layer, module, "A")]

    def lora_bt(self, layer: int, module: str) -> torch.Tensor:
        """Bt: [S, max_rank, out]"""
        return self._views[(layer, module, "B")]

    def magnitude(self, layer: int, module: str) -> torch.Tensor:
        """DoRA's m: [S, 1, out] (in the pool dtype, as the slot's other bytes)."""
        return self._views[(layer, module, "M")]

    def gain(self, layer: int, module: str) -> torch.Tensor:
        """DoRA's g = m / ||W + s B A||: [S, out] float32, 1 where the cell is not DoRA."""
        off, out = self.layout.gain_offsets[(layer, module)]
        return self.gains[:, off:off + out]

    def fused_views(self, layer: int, modules: tuple[str, ...], out_slices: tuple[slice, ...]):
        """(As, Bts, out_slices, scales, ranks, doras, gains) of the served modules among a
        fused projection's, or None if the pool serves none; built once per projection."""
        key = (layer, modules)
        if key not in self._fused:
            picked = [(m, s) for m, s in zip(modules, out_slices)
                      if (layer, m) in self.layout.gain_offsets]
            idx = [self.layout.module_index(m) for m, _ in picked]
            self._fused[key] = (
                [self.lora_a(layer, m) for m, _ in picked],  # each [S, R, in]
                [self.lora_bt(layer, m) for m, _ in picked],  # each [S, R, out_m]
                [s for _, s in picked],
                [self.scales[:, layer, i] for i in idx],  # each [S]
                [self.ranks[:, layer, i] for i in idx],  # each [S]
                [self.doras[:, layer, i] for i in idx],  # each [S]
                [self.gain(layer, m) for m, _ in picked],  # each [S, out_m]
            ) if picked else None
        return self._fused[key]

    def expert_views(self, layer: int, module: str) -> ExpertLora | None:
        """A stacked expert module's factors, ranks and scales in every slot, or None if it
        has no pool memory."""
        if (layer, module) not in self.layout.gain_offsets:
            return None
        m = self.layout.module_index(module)
        return ExpertLora(self.lora_a(layer, module), self.lora_bt(layer, module),
                          self.ranks[:, layer, m], self.scales[:, layer, m],
                          self.layout.model.moe.num_experts, self.layout.max_rank)

    def slot_region(self, slot: int) -> torch.Tensor:
        """[slot_elems] the slot's bytes."""
        return self.slot_tensors[slot].data

    def _norm_groups(self, slot: int) -> tuple[NormGroup, ...]:
        """`slot`'s regions as NormGroups, one per evenly spaced run of a (module, kind)'s
        regions: one run per module unless layers differ (MoE models). Together they cover
        every region of the slot: all bytes but the zeroed padding."""
        layout, base, out = self.layout, slot * self.layout.slot_elems, []
        for module in dict.fromkeys(m for _, m in layout.module_keys):
            layers = [layer for layer, m in layout.module_keys if m == module]
            for kind in ("A", "B", "M"):
                regions = [layout.region(layer, module, kind) for layer in layers]
                for run in _even_runs(regions):
                    first = run[0]
                    step = run[1].offset - first.offset if len(run) > 1 else 0
                    view = self.buffer.as_strided((len(run), first.rows, first.cols),
                                                  (step, first.cols, 1), base + first.offset)
                    out.append(NormGroup(tuple((r.layer, module, kind) for r in run), view,
                                         kind, module == "embed_tokens"))
        return tuple(out)

    def _norm_descriptors(self, groups: tuple[NormGroup, ...]) -> torch.Tensor:
        """norms_triton's descriptors of slot 0's groups: offsets from a slot's base."""
        rows = []
        for group in groups:
            code = KIND_B if group.kind == "B" else \
                KIND_A if group.kind == "A" and not group.one_hot else KIND_MAX
            for key in group.keys:
                region = self.layout.region(*key)
                rows.append((region.offset, region.rows, region.cols, code))
        return region_descriptors(rows, self.device)

    # --- read-back (tests, peers) --------------------------------------------------

    def host_tables(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ranks, scales, doras) rows [L, M] of slot, on the host."""
        return self.ranks[slot].cpu(), self.scales[slot].cpu(), self.doras[slot].cpu()

    def delta(self, slot: int, layer: int, module: str) -> torch.Tensor:
        """scale * B @ A as the kernels see it: [out, in] float32."""
        m = self.layout.module_index(module)
        a = self.lora_a(layer, module)[slot].float()  # [R, in]
        bt = self.lora_bt(layer, module)[slot].float()  # [R, out]
        return self.scales[slot, layer, m].float() * (bt.t() @ a)


def _even_runs(regions: list) -> list[list]:
    """regions split into maximal runs of equal offset steps."""
    runs = [[regions[0]]]
    for r in regions[1:]:
        run = runs[-1]
        if len(run) == 1 or r.offset - run[-1].offset == run[1].offset - run[0].offset:
            run.append(r)
        else:
            runs.append([r])
    return runs
