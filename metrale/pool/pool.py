"""AdapterPool: one contiguous device tensor holding every slot, the per-slot rank, scale
and DoRA tables, and the strided views the kernels read. Addresses never change after
construction, so CUDA graphs captured over these views stay valid. DoRA's gain
g = m / ||W + s B A|| depends only on the slot's bytes and W: computed once per landing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from metrale.adapters.plan import AdapterPlan
from metrale.adapters.weights_check import all_finite
from metrale.errors import NonFiniteWeightsError
from metrale.ops.landing_triton import base_of, land_rows, land_views
from metrale.ops.moe_triton import ExpertLora
from metrale.ops.norms_triton import KIND_A, KIND_B, KIND_MAX, region_descriptors, region_norms
from metrale.pool.layout import SlotLayout
from metrale.pool.recipe import LandingRecipe, build_recipe


@dataclass(frozen=True)
class ByteRange:
    """A device address range inside one slot, for transports that write raw bytes."""

    addr: int
    nbytes: int


GAIN_CHUNK_ELEMS = 1 << 22  # elements of W + s B A that compute_gains builds at a time
_RECIPES = 256  # landing recipes kept (one per adapter layout landing repeatedly)


@dataclass(frozen=True)
class StagedAdapter:
    """An adapter's bytes on the pool's device, checked finite, ready for any slot."""

    plan: AdapterPlan
    data: torch.Tensor  # [plan.staged_bytes] uint8
    recipe: LandingRecipe | None
    views: list[torch.Tensor]  # only without a recipe

    @property
    def dtype(self) -> torch.dtype:
        return self.recipe.dtype if self.recipe is not None else self.views[0].dtype


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
        self._norm_groups: dict[int, list] = {}  # slot -> gain_norms' views of it
        self._norm_keys: dict | None = None
        self._norm_desc: dict[int, torch.Tensor] = {}  # slot -> norm_descriptors
        # id(plan.landings) -> (landings, targets, recipe), oldest first
        self._recipes: dict[int, tuple] = {}
        self._recipes_lock = threading.Lock()

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
        n = self.layout.slot_elems
        return self.buffer[slot * n:(slot + 1) * n]

    def gain_norms(self, slot: int) -> dict[tuple[int, str, str], float]:
        """check_gain's norm of every A and B region of `slot`, by (layer, module, kind)."""
        values, _ = self.gain_norm_values(slot)
        return dict(zip(self.gain_norm_keys(), values.tolist()))

    def gain_norm_keys(self) -> dict[tuple[int, str, str], int]:
        """(layer, module, kind) -> its position in gain_norm_values (the same for every slot)."""
        if self._norm_keys is None:
            self._norm_keys = {key: i for i, key in enumerate(
                key for group_keys, _, _, _ in self._norm_groups_of(0) for key in group_keys)}
        return self._norm_keys

    def gain_norm_values(self, slot: int) -> tuple[np.ndarray, bool]:
        """(norms, finite), one host sync. norms: float64 in gain_norm_keys order plus a
        trailing 0 (for targets the layout lacks): A's largest row 2-norm (an embedding's:
        its largest |value|), B's largest row 1-norm (a column of Bt), M's largest |value|.
        A slot is zeroed before it lands, so rows past a module's rank add nothing and each
        (module, kind) reduces over all its layers at once: per tensor, the ~450 slicing
        calls of an 8B slot cost ~5 ms on the H200. finite: no NaN/Inf in any region (NaN
        and Inf reach every norm; padding between regions stays zero), so a landing that
        zeroes the bytes it carried between tensors needs no pass of its own."""
        groups = self._norm_groups_of(slot)
        if self.buffer.is_cuda:  # one launch (the torch ops below are its reference)
            values = region_norms(self.buffer, self.norm_descriptors(slot))
        else:
            parts = [_norms(x, kind, one_hot, torch.float32) for _, x, kind, one_hot in groups]
            values = torch.cat(parts + [torch.zeros(1, dtype=torch.float32)])  # trailing 0
        values = values.cpu().numpy().astype(np.float64)
        if not np.isfinite(values).all():  # float32 overflows past ~1e19: float64 decides
            start = 0
            for group_keys, x, kind, one_hot in groups:
                end = start + len(group_keys)
                if not np.isfinite(values[start:end]).all():
                    values[start:end] = _norms(x, kind, one_hot, torch.float64).cpu().numpy()
                start = end
        return values, bool(np.isfinite(values).all())  # finite values: finite float64 norms

    def norm_descriptors(self, slot: int) -> torch.Tensor:
        """norms_triton's [regions, 4] descriptors of `slot`, in gain_norm_keys order."""
        desc = self._norm_desc.get(slot)
        if desc is None:
            base, rows = slot * self.layout.slot_elems, []
            for keys, _, kind, one_hot in self._norm_groups_of(slot):
                code = KIND_B if kind == "B" else KIND_A if kind == "A" and not one_hot else KIND_MAX
                for key in keys:
                    region = self.layout.region(*key)
                    rows.append((base + region.offset, region.rows, region.cols, code))
            desc = self._norm_desc[slot] = region_descriptors(rows, self.device)
        return desc

    def _norm_groups_of(self, slot: int) -> list:
        groups = self._norm_groups.get(slot)
        if groups is None:
            groups = self._norm_groups[slot] = self._group_regions(slot)
        return groups

    def _group_regions(self, slot: int) -> list:
        """(keys, [layers, rows, cols] view, kind, one_hot) per evenly spaced run of a
        (module, kind)'s regions: one run per module unless layers differ (MoE models).
        Together they cover every region of the slot: all bytes but the zeroed padding."""
        base, out = slot * self.layout.slot_elems, []
        for module in dict.fromkeys(m for _, m in self.layout.module_keys):
            layers = [layer for layer, m in self.layout.module_keys if m == module]
            for kind in ("A", "B", "M"):
                regions = [self.layout.region(layer, module, kind) for layer in layers]
                for run in _even_runs(regions):
                    first = run[0]
                    step = run[1].offset - first.offset if len(run) > 1 else 0
                    view = self.buffer.as_strided((len(run), first.rows, first.cols),
                                                  (step, first.cols, 1), base + first.offset)
                    keys = [(r.layer, module, kind) for r in run]
                    out.append((keys, view, kind, module == "embed_tokens"))
        return out

    # --- landing ----------------------------------------------------------------

    def recipe(self, plan: AdapterPlan, staged_bt: bool = False) -> LandingRecipe | None:
        """The plan's landing recipe, shared by plans of the same tensors and targets (CUDA)."""
        if not self.buffer.is_cuda or not plan.landings:
            return None
        key = (id(plan.landings), staged_bt)
        with self._recipes_lock:
            known = self._recipes.get(key)
            if known is not None and known[0] is plan.landings and known[1] is plan.targets:
                return known[2]
        recipe = build_recipe(plan, self.layout, self.device, staged_bt)
        with self._recipes_lock:
            while len(self._recipes) >= _RECIPES:
                del self._recipes[next(iter(self._recipes))]
            self._recipes[key] = (plan.landings, plan.targets, recipe)  # refs keep ids unique
        return recipe

    def stage(self, plan: AdapterPlan, data: torch.Tensor,
              recipe: LandingRecipe | None = None) -> StagedAdapter:
        """Check staged bytes: with a recipe one NaN/Inf pass over them all, else stage_views."""
        if recipe is not None and bool(data[:plan.staged_bytes].view(recipe.dtype).isfinite().all()):
            return StagedAdapter(plan, data, recipe, [])
        return StagedAdapter(plan, data, None, self.stage_views(plan, data))

    def land_staged(self, slot: int, staged: StagedAdapter) -> None:
        """Into a zeroed slot (its table rows are the caller's)."""
        recipe = staged.recipe
        if recipe is None:
            self.land(slot, staged.plan, staged.views)
            return
        n = self.layout.slot_elems
        land_rows(self.buffer[slot * n:], staged.data.view(recipe.dtype), recipe.desc,
                  recipe.tiles)

    def stage_views(self, plan: AdapterPlan, data: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each planned tensor inside data ([plan.staged_bytes] uint8 on the
        device). Raises NonFiniteWeightsError, naming a tensor, before anything is written."""
        views = []
        for landing in plan.landings:
            e = landing.entry
            begin = plan.staged_begin(e)  # e.begin unless the plan stages only its spans
            raw = data[begin:begin + e.nbytes]
            if (data.storage_offset() + begin) % e.torch_dtype.itemsize:
                raw = raw.clone()  # a hostile file may misalign a tensor; keep the view legal
            views.append(raw.view(e.torch_dtype).view(e.shape))
        if not views or self._all_finite(data, views):
            return views
        bad = next(landing.entry.name for landing, v in zip(plan.landings, views)
                   if not all_finite(v))
        raise NonFiniteWeightsError(f"{plan.source}: tensor {bad!r} holds NaN or Inf")

    @staticmethod
    def _all_finite(data: torch.Tensor, views: list[torch.Tensor]) -> bool:
        """One check (one device sync) for the whole adapter: one pass over the bytes
        when the views are one dtype tiling them, else one reduction per tensor, stacked."""
        dtype = views[0].dtype
        size = views[0].element_size()
        whole = (all(v.dtype == dtype for v in views)
                 and sum(v.numel() for v in views) * size == data.numel()
                 and data.data_ptr() % size == 0)
        if whole:
            return all_finite(data.view(dtype))
        if not data.is_cuda:
            return all(all_finite(v) for v in views)
        return bool(torch.stack([v.isfinite().all() for v in views]).all())

    def zero_slot(self, slot: int) -> None:
        self.slot_region(slot).zero_()
        self.ranks[slot].zero_()
        self.scales[slot].zero_()
        self.doras[slot].zero_()
        self.gains[slot].fill_(1.0)

    def land(self, slot: int, plan: AdapterPlan, views: list[torch.Tensor]) -> None:
        """Write staged tensors into a zeroed slot, converting and transposing on the
        device (on CUDA in one kernel). The rank/scale rows are the caller's (write_tables
        at commit: their copy from pageable memory would wait for the stream on the host)."""
        src_base = base_of(views) if self.buffer.is_cuda else None
        if src_base is not None:
            base, items = slot * self.layout.slot_elems, []
            for landing, src in zip(plan.landings, views):
                t = landing.target
                offset, cols, row_stride = landing.placement(
                    self.layout.region(t.layer, t.module, landing.kind))
                items.append((src, base + offset, landing.rows, cols, landing.kind == "B",
                              row_stride))
            land_views(self.buffer, src_base, items)
        else:
            for landing, src in zip(plan.landings, views):
                t = landing.target
                if landing.kind == "M":
                    self.magnitude(t.layer, t.module)[slot, 0].copy_(src)  # [out]
                    continue
                region = (self.lora_a if landing.kind == "A" else self.lora_bt)(t.layer, t.module)
                cols = landing.cols or region.shape[-1]
                last = landing.row0 + (landing.rows - 1) * landing.row_step + 1
                dst = region[slot, landing.row0:last:landing.row_step,
                             landing.col0:landing.col0 + cols]  # [rows, cols]
                dst.copy_(src if landing.kind == "A" else src.t())  # B [out, r] -> Bt [r, out]

    def write_tables(self, slot: int, ranks: torch.Tensor, scales: torch.Tensor,
                     doras: torch.Tensor) -> None:
        """Host rows [L, M] into the slot's tables; DoRA cells get their gains computed
        from the slot's bytes (so call it after the bytes landed)."""
        pinned = ranks.is_pinned()  # then no host sync: the rows are never rewritten
        self.ranks[slot].copy_(ranks, non_blocking=pinned)
        self.scales[slot].copy_(scales, non_blocking=pinned)
        self.doras[slot].copy_(doras, non_blocking=pinned)
        self.gains[slot].fill_(1.0)
        cells = doras.nonzero().tolist()  # host tensor: no device sync
        if cells and self.base_weights is not None:
            self.compute_gains(slot, [(layer, self.layout.table_modules[m], float(scales[layer, m]),
                                       int(ranks[layer, m])) for layer, m in cells])

    @torch.no_grad()  # the base weights may be Parameters: no autograd graph may hang off g
    def compute_gains(self, slot: int, cells: list[tuple[int, str, float, int]]) -> None:
        """DoRA's g = m / ||W + s B A|| per output row in float32 (PEFT's DoraLinearLayer)."""
        bad = []
        for layer, module, scale, rank in cells:
            W = self.base_weights[(layer, module)]  # [out, in]
            a = self.lora_a(layer, module)[slot, :rank].float()  # [r, in]
            bt = self.lora_bt(layer, module)[slot, :rank].float()  # [r, out]
            m = self.magnitude(layer, module)[slot, 0].float()  # [out]
            g = self.gain(layer, module)[slot]  # [out] float32, a view: written in place
            out, d_in = W.shape
            step = max(1, GAIN_CHUNK_ELEMS // max(d_in, 1))
            for lo in range(0, out, step):
                hi = min(out, lo + step)
                rows = W[lo:hi].float() + scale * (bt[:, lo:hi].T @ a)  # [c, in]
                g[lo:hi] = m[lo:hi] / torch.linalg.vector_norm(rows, dim=1)  # [c]
            bad.append(g.isfinite().all())
        if bad and not bool(torch.stack(bad).all()):
            raise NonFiniteWeightsError(
                "a DoRA gain m / ||W + s B A|| is not finite (a row of W + s B A has norm 0, "
                "or the magnitudes overflow)")

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


def _norms(x: torch.Tensor, kind: str, one_hot: bool, dtype: torch.dtype) -> torch.Tensor:
    """gain_norms of x [layers, rows, cols] (A, B as Bt, or M), accumulated in dtype."""
    if kind == "B":
        return torch.linalg.vector_norm(x, 1, dim=1, dtype=dtype).amax(1)
    if one_hot or kind == "M":
        return torch.linalg.vector_norm(x, math.inf, dim=(1, 2), dtype=dtype)
    return torch.linalg.vector_norm(x, 2, dim=2, dtype=dtype).amax(1)


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
