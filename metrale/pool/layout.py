"""Where every (layer, module, A|B|M) lives inside one slot region (docs/DESIGN.md, "Pool
memory layout"): A as [max_rank, in], B transposed as [max_rank, out], so a rank-r tensor
lands as one contiguous run; M [1, out] is DoRA's magnitude. DoRA's gains live outside the
slot, in a float32 buffer laid out by `gain_offsets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metrale.config import ModelConfig, PoolConfig

# Regions start on 128-byte boundaries so vector loads in kernels stay aligned.
_ALIGN_BYTES = 128


@dataclass(frozen=True)
class TensorRegion:
    layer: int
    module: str
    kind: str  # "A" | "B" | "M"
    offset: int  # elements from the slot base
    rows: int  # max_rank
    cols: int  # in (A) or out (B)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class SlotLayout:
    model: ModelConfig
    pool: PoolConfig
    dtype: torch.dtype
    regions: dict[tuple[int, str, str], TensorRegion] = field(init=False, repr=False)
    slot_elems: int = field(init=False)
    # (layer, module) -> (offset, out) in the float32 DoRA gain buffer's slot row
    gain_offsets: dict[tuple[int, str], tuple[int, int]] = field(init=False, repr=False)
    gain_elems: int = field(init=False)

    def __post_init__(self) -> None:
        align = max(1, _ALIGN_BYTES // self.itemsize)
        regions, cursor, gains, g_cursor = {}, 0, {}, 0
        for layer, module in self.module_keys:
            d_in, d_out = self.model.linear_shape(module)
            rank_rows = self.max_rank * self.model.module_rows(module)  # experts: one per expert
            for kind, rows, cols in (("A", rank_rows, d_in), ("B", rank_rows, d_out),
                                     ("M", 1, d_out)):
                region = TensorRegion(layer, module, kind, cursor, rows, cols)
                regions[(layer, module, kind)] = region
                cursor += -(-region.numel // align) * align
            gains[(layer, module)] = (g_cursor, d_out)
            g_cursor += -(-d_out // 4) * 4  # 16-byte aligned rows for the kernels' loads
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "slot_elems", cursor)
        object.__setattr__(self, "gain_offsets", gains)
        object.__setattr__(self, "gain_elems", g_cursor)

    @property
    def table_modules(self) -> tuple[str, ...]:
        """Columns of the per-slot [layers, modules] rank/scale/DoRA tables: the decoder
        targets, then the model-level ones (their row is layer 0)."""
        return self.pool.target_modules + self.pool.extra_targets

    @property
    def module_keys(self) -> tuple[tuple[int, str], ...]:
        """Every (layer, module) with pool memory, in slot order (an expert layer's MLP has
        none: its modules are not targets)."""
        keys = [(layer, m) for layer in range(self.model.num_layers)
                for m in self.pool.target_modules if m in self.model.layer_modules(layer)]
        return tuple(keys) + tuple((0, m) for m in self.pool.extra_targets)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        return self.slot_elems * self.itemsize

    @property
    def max_rank(self) -> int:
        return self.pool.max_lora_rank

    def region(self, layer: int, module: str, kind: str) -> TensorRegion:
        return self.regions[(layer, module, kind)]

    def module_index(self, module: str) -> int:
        """Column of `module` in the per-slot [layers, modules] rank/scale/DoRA tables."""
        return self.table_modules.index(module)
