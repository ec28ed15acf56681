"""What an adapter's tensors target and where each lands: the (layer, module) targets
PEFT's config resolves to, a file tensor's landing in a slot's region, and the checks both
the whole-module and the per-expert matching apply to a target."""

from __future__ import annotations

from dataclasses import dataclass

from metrale.adapters.safetensors_file import TensorEntry
from metrale.config import EXTRA_TARGETS, EXTRA_TARGETS_FLAG, MOE_MODULES, ModelConfig, PoolConfig
from metrale.errors import AdapterMismatchError, ExtraTargetsRequiredError


@dataclass(frozen=True)
class ModuleTarget:
    layer: int
    module: str
    rank: int
    scale: float
    experts: int = 1  # an expert module's A and B stack a rank-r factor per expert


@dataclass(frozen=True)
class TensorLanding:
    """One file tensor and where it goes: A -> A[slot, :rank, :], B -> Bt[slot, :rank, :],
    M (DoRA magnitude, [out]) -> the module's M region. One expert's part in a per-expert
    adapter (metrale.adapters.per_expert) fills a block of its stacked region instead:
    `n_rows` rows from `row0`, `row_step` apart, `cols` columns from `col0`."""

    target: ModuleTarget
    kind: str  # "A" | "B" | "M"
    entry: TensorEntry
    part: str = ""  # the per-expert module it came from (its A and B pair by this)
    n_rows: int = 0  # 0: the target's rank rows (per expert for a stacked one)
    row0: int = 0
    row_step: int = 1
    col0: int = 0
    cols: int = 0  # 0: the region's

    @property
    def rows(self) -> int:  # of its region it fills
        if self.kind == "M":
            return 1
        return self.n_rows or self.target.rank * self.target.experts

    def placement(self, region) -> tuple[int, int, int]:
        """(first element offset, columns, destination row stride) within the slot, for
        a metrale.pool.layout Region of [rows, region.cols]."""
        return (region.offset + self.row0 * region.cols + self.col0, self.cols or region.cols,
                self.row_step * region.cols)


def check_pool_serves(path: str, module: str, pool: PoolConfig) -> None:
    if module in EXTRA_TARGETS and module not in pool.extra_targets:
        raise ExtraTargetsRequiredError(
            f"the adapter has LoRA on {path}, and this engine has no pool memory for "
            f"{module}: start it with {EXTRA_TARGETS_FLAG} {module}"
        )
    if module not in pool.target_modules and module not in EXTRA_TARGETS:
        hint = ("--lora-experts (pool memory for expert and router LoRA)" if module in MOE_MODULES
                else f"{module} in its LoRA target modules")
        raise AdapterMismatchError(
            f"the adapter targets {path} but the pool serves only "
            f"{', '.join(pool.target_modules)}; start the engine with {hint}"
        )


def check_rank(path: str, rank: int, pool: PoolConfig, needed: int) -> None:
    if rank > pool.max_lora_rank:
        raise AdapterMismatchError(
            f"{path} has rank {rank} > --max-lora-rank {pool.max_lora_rank}; "
            f"start the engine with --max-lora-rank {needed} or more"
        )


def expected_shape(target: ModuleTarget, kind: str, model: ModelConfig) -> tuple[int, ...]:
    d_in, d_out = model.linear_shape(target.module)[0], model.fused_rows(target.module)[2]
    rows = target.rank * target.experts
    return {"A": (rows, d_in), "B": (d_out, rows), "M": (d_out,)}[kind]
