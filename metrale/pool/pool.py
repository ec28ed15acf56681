"""AdapterPool: the one contiguous device tensor holding every slot, its
per-slot rank and scale tables, and the strided per-(layer, module) views the
kernels read. It owns tensors and copies; the SlotTable owns policy.

Addresses never change after construction: a swap rewrites contents only, so
CUDA graphs captured over these views stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.adapters.plan import AdapterPlan
from metrale.errors import NonFiniteWeightsError
from metrale.ops.landing_triton import base_of, land_views
from metrale.pool.layout import SlotLayout


@dataclass(frozen=True)
class ByteRange:
    """A device address range inside one slot, for transports that write raw bytes."""

    addr: int
    nbytes: int


class AdapterPool:
    def __init__(self, layout: SlotLayout, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        S, L, M = layout.max_loras, layout.model.num_layers, len(layout.pool.target_modules)
        # pool: [S * slot_elems]; slot s occupies [s * slot_elems, (s+1) * slot_elems)
        self.buffer = torch.zeros(S * layout.slot_elems, dtype=layout.dtype, device=self.device)
        self.ranks = torch.zeros(S, L, M, dtype=torch.int32, device=self.device)
        self.scales = torch.zeros(S, L, M, dtype=torch.float32, device=self.device)
        self._views = {key: self._view(r) for key, r in layout.regions.items()}
        self._fused: dict = {}

    def _view(self, region) -> torch.Tensor:
        S = self.layout.max_loras
        # [S, max_rank, cols]: one row block per slot, slot stride = slot_elems
        return self.buffer.as_strided(
            (S, region.rows, region.cols), (self.layout.slot_elems, region.cols, 1), region.offset
        )

    def lora_a(self, layer: int, module: str) -> torch.Tensor:
        """A: [S, max_rank, in]"""
        return self._views[(layer, module, "A")]

    def lora_bt(self, layer: int, module: str) -> torch.Tensor:
        """Bt: [S, max_rank, out]"""
        return self._views[(layer, module, "B")]

    def fused_views(self, layer: int, modules: tuple[str, ...], out_slices: tuple[slice, ...]):
        """(As, Bts, out_slices, scales, ranks) of the served modules among a fused
        projection's, or None if the pool serves none; built once per projection."""
        key = (layer, modules)
        if key not in self._fused:
            picked = [(m, s) for m, s in zip(modules, out_slices)
                      if m in self.layout.pool.target_modules]
            idx = [self.layout.module_index(m) for m, _ in picked]
            self._fused[key] = (
                [self.lora_a(layer, m) for m, _ in picked],  # each [S, R, in]
                [self.lora_bt(layer, m) for m, _ in picked],  # each [S, R, out_m]
                [s for _, s in picked],
                [self.scales[:, layer, i] for i in idx],  # each [S]
                [self.ranks[:, layer, i] for i in idx],  # each [S]
            ) if picked else None
        return self._fused[key]

    def slot_region(self, slot: int) -> torch.Tensor:
        n = self.layout.slot_elems
        return self.buffer[slot * n:(slot + 1) * n]

    def slot_byte_ranges(self, slot: int, plan: AdapterPlan) -> list[ByteRange]:
        """One range per planned tensor (plan order): its rank-r rows of its region."""
        layout, itemsize = self.layout, self.layout.itemsize
        base = self.slot_region(slot).data_ptr()
        ranges = []
        for landing in plan.landings:
            t = landing.target
            region = layout.region(t.layer, t.module, landing.kind)
            if not 0 < t.rank <= region.rows:
                raise AssertionError(f"planned rank {t.rank} outside the region of {region.rows} rows")
            ranges.append(ByteRange(base + region.offset * itemsize, t.rank * region.cols * itemsize))
        return ranges

    def slot_is_finite(self, slot: int) -> bool:
        return bool(self.slot_region(slot).isfinite().all())

    # --- landing ----------------------------------------------------------------

    def stage_views(self, plan: AdapterPlan, data: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each planned tensor inside the staged data bytes.

        data: [data_bytes] uint8 on the pool's device. Raises NonFiniteWeightsError
        before anything is written, so a NaN adapter never reaches a slot."""
        views = []
        for landing in plan.landings:
            e = landing.entry
            raw = data[e.begin:e.end]
            if (data.storage_offset() + e.begin) % e.torch_dtype.itemsize:
                raw = raw.clone()  # a hostile file may misalign a tensor; keep the view legal
            views.append(raw.view(e.torch_dtype).view(e.shape))
        if not views or self._all_finite(data, views):
            return views
        bad = next(landing.entry.name for landing, v in zip(plan.landings, views)
                   if not bool(v.isfinite().all()))
        raise NonFiniteWeightsError(f"{plan.source}: tensor {bad!r} holds NaN or Inf")

    @staticmethod
    def _all_finite(data: torch.Tensor, views: list[torch.Tensor]) -> bool:
        """One check (one device sync) for the whole adapter. When the views are all of
        one dtype and tile the data bytes (a validated file: no gaps, no other tensors),
        a single pass over the bytes does it; else one reduction per tensor, stacked."""
        dtype = views[0].dtype
        size = views[0].element_size()
        whole = (all(v.dtype == dtype for v in views)
                 and sum(v.numel() for v in views) * size == data.numel()
                 and data.data_ptr() % size == 0)
        if whole:
            return bool(data.view(dtype).isfinite().all())
        return bool(torch.stack([v.isfinite().all() for v in views]).all())

    def zero_slot(self, slot: int) -> None:
        self.slot_region(slot).zero_()
        self.ranks[slot].zero_()
        self.scales[slot].zero_()

    def land(self, slot: int, plan: AdapterPlan, views: list[torch.Tensor],
             tables: bool = True) -> None:
        """Write staged tensors into a zeroed slot: dtype conversion and the B
        transpose happen on the device, no host round trip. On CUDA one kernel lands
        every tensor (metrale.ops.landing_triton); elsewhere one copy per tensor.
        tables=False leaves the rank/scale rows to a later set_tables (their copy from
        pageable host memory would wait for the stream on the host)."""
        src_base = None
        if self.buffer.is_cuda:
            src_base = base_of(views)
        if src_base is not None:
            base, items = slot * self.layout.slot_elems, []
            for landing, src in zip(plan.landings, views):
                t = landing.target
                region = self.layout.region(t.layer, t.module, landing.kind)
                items.append((src, base + region.offset, t.rank, region.cols, landing.kind == "B"))
            land_views(self.buffer, src_base, items)
        else:
            for landing, src in zip(plan.landings, views):
                t = landing.target
                if landing.kind == "A":
                    self.lora_a(t.layer, t.module)[slot, :t.rank].copy_(src)  # [r, in]
                else:
                    self.lora_bt(t.layer, t.module)[slot, :t.rank].copy_(src.t())  # [r, out]
        if tables:
            self.set_tables(slot, plan)

    def set_tables(self, slot: int, plan: AdapterPlan) -> None:
        ranks = torch.zeros(self.ranks[slot].shape, dtype=torch.int32)  # [L, M]
        scales = torch.zeros(self.scales[slot].shape, dtype=torch.float32)
        if plan.targets:  # one indexed write each, not one per module (448 on an 8B)
            rows = [(t.layer, self.layout.module_index(t.module), t.rank, t.scale)
                    for t in plan.targets]
            layer, module, rank, scale = (list(c) for c in zip(*rows))
            ranks[layer, module] = torch.tensor(rank, dtype=torch.int32)
            scales[layer, module] = torch.tensor(scale, dtype=torch.float32)
        self.ranks[slot].copy_(ranks)
        self.scales[slot].copy_(scales)

    # --- read-back (tests, peers) --------------------------------------------------

    def delta(self, slot: int, layer: int, module: str) -> torch.Tensor:
        """scale * B @ A as the kernels see it: [out, in] float32."""
        m = self.layout.module_index(module)
        a = self.lora_a(layer, module)[slot].float()  # [R, in]
        bt = self.lora_bt(layer, module)[slot].float()  # [R, out]
        return self.scales[slot, layer, m].float() * (bt.t() @ a)
