"""StagedAdapter: an adapter's bytes on the pool's device, checked finite, before any slot
is touched (validate first, mutate second). With a landing recipe the check is one NaN/Inf
pass over all the bytes; else typed views of each tensor, checked together, and a bad one
is named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.adapters.plan import AdapterPlan
from metrale.adapters.weights_check import all_finite
from metrale.errors import NonFiniteWeightsError
from metrale.pool.recipe import LandingRecipe


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


def stage(plan: AdapterPlan, data: torch.Tensor,
          recipe: LandingRecipe | None = None) -> StagedAdapter:
    """Check staged bytes: with a recipe one NaN/Inf pass over them all, else stage_views."""
    if recipe is not None and bool(data[:plan.staged_bytes].view(recipe.dtype).isfinite().all()):
        return StagedAdapter(plan, data, recipe, [])
    return StagedAdapter(plan, data, None, stage_views(plan, data))


def stage_views(plan: AdapterPlan, data: torch.Tensor) -> list[torch.Tensor]:
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
    if not views or _all_finite(data, views):
        return views
    bad = next(landing.entry.name for landing, v in zip(plan.landings, views)
               if not all_finite(v))
    raise NonFiniteWeightsError(f"{plan.source}: tensor {bad!r} holds NaN or Inf")


def _all_finite(data: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """One check (one device sync) for the whole adapter: one pass over the bytes when the
    views are one dtype tiling them, else one reduction per tensor, stacked."""
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
