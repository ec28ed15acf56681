"""Where every (layer, module, A|B) lives inside one slot region.

Rank-major storage: A as [max_rank, in] and B transposed as [max_rank, out], so a
rank-r tensor of any module lands as one contiguous run of r * dim elements at
the start of its region (one copy per tensor from disk, one descriptor per
tensor from a peer).
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
    kind: str  # "A" | "B"
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

    def __post_init__(self) -> None:
        align = max(1, _ALIGN_BYTES // self.itemsize)
        regions, cursor = {}, 0
        for layer in range(self.model.num_layers):
            for module in self.pool.target_modules:
                d_in, d_out = self.model.linear_shape(module)
                for kind, cols in (("A", d_in), ("B", d_out)):
                    region = TensorRegion(layer, module, kind, cursor, self.pool.max_lora_rank, cols)
                    regions[(layer, module, kind)] = region
                    cursor += -(-region.numel // align) * align
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "slot_elems", cursor)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_bytes(self) -> int:
        return self.slot_elems * self.itemsize

    @property
    def max_loras(self) -> int:
        return self.pool.max_loras

    @property
    def max_rank(self) -> int:
        return self.pool.max_lora_rank

    def region(self, layer: int, module: str, kind: str) -> TensorRegion:
        return self.regions[(layer, module, kind)]

    def module_index(self, module: str) -> int:
        """Column of `module` in the per-slot [layers, modules] rank/scale tables."""
        return self.pool.target_modules.index(module)
