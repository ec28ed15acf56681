"""LandingRecipe: an adapter plan's landing worked out once for one pool layout. Landing
tensor by tensor costs Python per tensor: ~9 ms against 1.6 ms for the bytes of a
Llama-3-8B adapter's 448 tensors. With a recipe a landing is one NaN/Inf pass, one kernel
and three table copies. Only for tensors of one dtype, aligned, tiling the staged bytes
(so the one pass checks exactly them); anything else lands through typed views.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from metrale.adapters.plan import AdapterPlan
from metrale.ops.landing_triton import landing_row, max_tiles
from metrale.pool.layout import SlotLayout


@dataclass(frozen=True)
class LandingRecipe:
    dtype: torch.dtype  # of every staged tensor
    desc: torch.Tensor  # [N, 7] int64 on the pool's device: landing rows, offsets from the slot base
    tiles: int  # landing programs per tensor
    ranks: torch.Tensor  # [L, M] int32, host (pinned with CUDA)
    scales: torch.Tensor  # [L, M] float32, host
    doras: torch.Tensor  # [L, M] int32, host

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ranks, self.scales, self.doras


def table_rows(plan: AdapterPlan, layout: SlotLayout,
               pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ranks, scales, doras) host rows [L, M] of a slot holding the plan's adapter."""
    shape = (layout.model.num_layers, len(layout.table_modules))
    ranks = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
    scales = torch.zeros(shape, dtype=torch.float32, pin_memory=pin)
    doras = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
    if plan.targets:  # one indexed write each, not one per module (448 on an 8B)
        rows = [(t.layer, layout.module_index(t.module), t.rank, t.scale) for t in plan.targets]
        layer, module, rank, scale = (list(c) for c in zip(*rows))
        ranks[layer, module] = torch.tensor(rank, dtype=torch.int32)
        scales[layer, module] = torch.tensor(scale, dtype=torch.float32)
        doras[layer, module] = int(plan.dora)
    return ranks, scales, doras


def build_recipe(plan: AdapterPlan, layout: SlotLayout, device: torch.device,
                 staged_bt: bool = False) -> LandingRecipe | None:
    """The plan's recipe, or None when its tensors are not one aligned dtype tiling the
    staged bytes (then the caller lands typed views). staged_bt: the staged B tensors
    hold [r, out] bytes, the pool's Bt layout (a peer sends them so), not PEFT's [out, r]."""
    entries = [landing.entry for landing in plan.landings]
    if not entries:
        return None
    dtype = entries[0].torch_dtype
    size = dtype.itemsize
    if any(e.torch_dtype != dtype for e in entries) or \
            sum(e.nbytes for e in entries) != plan.staged_bytes:
        return None
    rows = []
    for landing in plan.landings:
        begin = plan.staged_begin(landing.entry)
        if begin % size:
            return None
        t = landing.target
        offset, cols, row_stride = landing.placement(layout.region(t.layer, t.module, landing.kind))
        rows.append(landing_row(begin // size, offset, landing.rows, cols,
                                landing.kind == "B" and not staged_bt, row_stride))
    pin = device.type == "cuda"
    desc = torch.tensor(rows, dtype=torch.int64).to(device)
    return LandingRecipe(dtype, desc, max_tiles(rows), *table_rows(plan, layout, pin))


class RecipeCache:
    """Plans' recipes for one pool, shared by plans of the same tensors and targets (a
    recipe is ~ms of Python per 8B plan). Thread-safe: promotion workers ask it. Only on
    CUDA: the CPU lands typed views."""

    def __init__(self, layout: SlotLayout, device: torch.device, size: int = 256) -> None:
        self.layout, self.device, self.size = layout, device, size
        # (id(plan.landings), staged_bt) -> (landings, targets, recipe), oldest first
        self._recipes: dict[tuple[int, bool], tuple] = {}
        self._lock = threading.Lock()

    def get(self, plan: AdapterPlan, staged_bt: bool = False) -> LandingRecipe | None:
        if self.device.type != "cuda" or not plan.landings:
            return None
        key = (id(plan.landings), staged_bt)
        with self._lock:
            known = self._recipes.get(key)
            if known is not None and known[0] is plan.landings and known[1] is plan.targets:
                return known[2]
        recipe = build_recipe(plan, self.layout, self.device, staged_bt)
        with self._lock:
            while len(self._recipes) >= self.size:
                del self._recipes[next(iter(self._recipes))]
            self._recipes[key] = (plan.landings, plan.targets, recipe)  # refs keep ids unique
        return recipe
