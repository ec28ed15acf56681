"""Check a planned adapter's weights once, on the CPU, off the engine thread: the landing's
NaN/Inf check cannot see a weight finite in the file but Inf in the pool dtype (1e30 from
an F32 file into a bf16 pool), nor one finite but overflowing the first token through it
(3e38 in a lora_A). So registration refuses both, naming the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from metrale.adapters.input_limits import brief, open_regular
from metrale.adapters.plan import AdapterPlan
from metrale.adapters.targets import TensorLanding
from metrale.errors import AdapterFileError, NonFiniteWeightsError

CHUNK_BYTES = 4 << 20  # bytes read and checked at a time: memory stays flat


class WeightsOverflowError(NonFiniteWeightsError):
    """Finite weights that become Inf in the pool dtype, or whose LoRA output would."""


def check_weights(plan: AdapterPlan, pool_dtype: torch.dtype) -> None:
    """Read a disk plan's tensors in CHUNK_BYTES pieces (~1 s per GB): NonFiniteWeightsError
    on NaN/Inf, WeightsOverflowError past the pool dtype (check_tensor, check_gain),
    AdapterFileError if the file shrank since it was planned."""
    path = Path(plan.source)
    norms = [0.0] * len(plan.landings)
    with open_regular(path, AdapterFileError, plan.root) as f:
        buf = bytearray(CHUNK_BYTES)
        for i in sorted(range(len(plan.landings)), key=lambda i: plan.landings[i].entry.begin):
            landing = plan.landings[i]
            e = landing.entry
            rows = _RowNorms(landing)
            for values in _chunks(f, plan.data_offset + e.begin, e.nbytes, e.torch_dtype, buf, path):
                check_tensor(plan.source, e.name, values, pool_dtype)
                rows.add(values)
            norms[i] = rows.result()
    check_gains(plan, norms, pool_dtype)


# --- what a LoRA can add to its layer's output -------------------------------------------
#
# A module adds dy = s * B (A x). With A_k, B_i the rows of A and B (Cauchy-Schwarz, then
# the triangle inequality):
#     |h_k|  <= ||A_k||_2 * ||x||_2    <= a * ||x||_2,  a = max_k ||A_k||_2
#     |dy_i| <= s * sum_k |B_ik| |h_k| <= s * b * a * ||x||_2,  b = max_i ||B_i||_1
# so nothing overflows while max(1, s) * b * a * ||x||_2 and a * ||x||_2 fit the pool dtype,
# for inputs of RMS up to INPUT_RMS (an RMSNorm output has RMS 1 before its weight; the margin
# covers norm weights and o_proj / down_proj inputs). An embedding's input is one-hot: a =
# max |A|, ||x||_2 = 1. PEFT's random init at rank 64 with rsLoRA's scale 16 passes in fp16.
INPUT_RMS = 16.0


def check_gain(source: str, a: TensorLanding, b: TensorLanding, a_norm: float, b_norm: float,
               pool_dtype: torch.dtype) -> None:
    """Refuse one module whose LoRA could overflow `pool_dtype`: a_norm, b_norm are a, b above."""
    limit = torch.finfo(pool_dtype).max
    target = a.target
    h = a_norm * _reach(a)
    dy = max(1.0, target.scale) * b_norm * h
    if h <= limit and dy <= limit:  # False for NaN too; the messages cost more than the check
        return
    where = f"layer {target.layer} {target.module}"
    if not h <= limit:
        raise WeightsOverflowError(
            f"{source}: tensor {brief(a.entry.name)} can make {where}'s LoRA input projection "
            f"reach {h:.3g} on an input of RMS {INPUT_RMS:g}, beyond the pool's {pool_dtype} "
            f"(max {limit:.4g}): its rows are too large (the largest row norm is {a_norm:.3g})")
    raise WeightsOverflowError(
        f"{source}: tensors {brief(b.entry.name)} and {brief(a.entry.name)} can add up to "
        f"{dy:.3g} to {where}'s output on an input of RMS {INPUT_RMS:g} (scale "
        f"{target.scale:g} x |B| {b_norm:.3g} x |A| {a_norm:.3g}), beyond the pool's "
        f"{pool_dtype} (max {limit:.4g}); rescale the adapter or serve it from a float32 pool")


def check_gains(plan: AdapterPlan, norms: list[float], pool_dtype: torch.dtype) -> None:
    """check_gain for each module; norms[i] is plan.landings[i]'s."""
    for a, b in _module_pairs(plan):
        check_gain(plan.source, plan.landings[a], plan.landings[b], norms[a], norms[b],
                   pool_dtype)


@dataclass(frozen=True)
class GainBound:
    """check_gains for one plan as array arithmetic over the pool's gain norms (in
    AdapterPool.gain_norm_keys order, trailing 0 last): for landings that repeat a plan,
    a peer's cached one (~1 ms of Python per 8B landing otherwise). at: each landing's
    position in the norms; a_at / b_at: each module's A and B; reach: max ||x||_2 of its
    input; amplify: max(1, scale)."""

    at: np.ndarray
    a_at: np.ndarray
    b_at: np.ndarray
    reach: np.ndarray
    amplify: np.ndarray

    @classmethod
    def of(cls, plan: AdapterPlan, keys: dict[tuple[int, str, str], int]) -> GainBound:
        at = np.array([keys.get((t.target.layer, t.target.module, t.kind), len(keys))
                       for t in plan.landings], dtype=np.int64)
        pairs = _module_pairs(plan)
        a_at = np.array([at[a] for a, _ in pairs], dtype=np.int64)
        b_at = np.array([at[b] for _, b in pairs], dtype=np.int64)
        reach = np.array([_reach(plan.landings[a]) for a, _ in pairs], dtype=np.float64)
        amplify = np.array([max(1.0, plan.landings[a].target.scale) for a, _ in pairs],
                           dtype=np.float64)
        return cls(at, a_at, b_at, reach, amplify)

    def check(self, plan: AdapterPlan, norms: np.ndarray, pool_dtype: torch.dtype) -> None:
        """check_gains(plan, ...) on the norms; its typed error, naming the module, if not."""
        limit = torch.finfo(pool_dtype).max
        h = norms[self.a_at] * self.reach
        dy = self.amplify * norms[self.b_at] * h
        if np.all(h <= limit) and np.all(dy <= limit):  # False for NaN too
            return
        check_gains(plan, norms[self.at].tolist(), pool_dtype)


def _module_pairs(plan: AdapterPlan) -> list[tuple[int, int]]:
    """(A's, B's) landing index per module that has both (plan_adapter gives every one)."""
    by_target: dict[tuple[int, str, str], dict[str, int]] = {}
    for i, landing in enumerate(plan.landings):
        by_target.setdefault((landing.target.layer, landing.target.module, landing.part),
                             {})[landing.kind] = i
    return [(kinds["A"], kinds["B"]) for kinds in by_target.values()
            if "A" in kinds and "B" in kinds]


def _reach(a: TensorLanding) -> float:
    """max ||x||_2 of the module's input (see INPUT_RMS)."""
    return 1.0 if _one_hot(a) else INPUT_RMS * math.sqrt(a.entry.shape[-1])


def _one_hot(landing: TensorLanding) -> bool:
    return landing.target.module == "embed_tokens"


class _RowNorms:
    """check_gain's norm of one tensor read in flat pieces (rows may straddle them), per-row
    sums in float64 (squares of 3e38 still fit)."""

    def __init__(self, landing: TensorLanding) -> None:
        shape = landing.entry.shape
        self.kind = landing.kind if landing.kind in ("A", "B") else None
        self.square = self.kind == "A" and not _one_hot(landing)
        self.max_only = self.kind == "A" and _one_hot(landing)
        self.cols = shape[-1] if len(shape) == 2 and shape[-1] else 1
        self.sums = torch.zeros(shape[0] if len(shape) == 2 else 1, dtype=torch.float64)
        self.peak = 0.0
        self.seen = 0  # elements consumed so far

    def add(self, values: torch.Tensor) -> None:
        if self.kind is None or values.numel() == 0:
            return
        start = self.seen
        self.seen += values.numel()
        if self.max_only:
            self.peak = max(self.peak, float(values.abs().max()))
            return
        # float32 first (bf16 -> float64 is ~8x slower on the CPU); a piece whose sums
        # overflow float32 (weights past ~1e19) again in float64, where 3e38 squared fits
        sums = self._row_sums(values.float(), start)
        if not math.isfinite(float(sums.max())):
            sums = self._row_sums(values.double(), start)
        first = start // self.cols
        self.sums[first:first + len(sums)] += sums

    def _row_sums(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Sums of |x| (or x^2) over each row's part in the piece x starting at element `start`."""
        x = x.square() if self.square else x.abs()
        cols, n = self.cols, x.numel()
        if start % cols == 0 and n % cols == 0:  # whole rows: the usual case
            return x.view(-1, cols).sum(1)
        head = min(n, -start % cols)  # the rest of a row begun in the last piece
        full = (n - head) // cols
        sums = [x[:head].sum().view(1)] if head else []
        if full:
            sums.append(x[head:head + full * cols].view(full, cols).sum(1))
        if n > head + full * cols:
            sums.append(x[head + full * cols:].sum().view(1))
        return torch.cat(sums)

    def result(self) -> float:
        if self.kind is None:
            return 0.0
        if self.max_only:
            return self.peak
        top = float(self.sums.max()) if self.sums.numel() else 0.0
        return math.sqrt(top) if self.square else top


def all_finite(values: torch.Tensor) -> bool:
    """No NaN, no +-Inf (one host sync). On the CPU through aminmax, which NaN and Inf reach:
    isfinite().all() on bf16 ran ~50x slower there (170 vs 3.6 ms for 86 MB on one core)."""
    if values.numel() == 0 or not values.is_floating_point():
        return True
    if values.is_cuda:
        return bool(values.isfinite().all())
    lo, hi = torch.aminmax(values.reshape(-1))
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_tensor(source: str, name: str, values: torch.Tensor, pool_dtype: torch.dtype) -> None:
    """One tensor (or a piece of it), any device: finite, and finite in pool_dtype."""
    if not all_finite(values):
        raise NonFiniteWeightsError(f"{source}: tensor {brief(name)} holds NaN or Inf")
    if values.dtype == pool_dtype or values.numel() == 0:
        return
    if all_finite(values.to(pool_dtype)):
        return
    peak = float(values.abs().max())
    raise WeightsOverflowError(
        f"{source}: tensor {brief(name)} holds |w| up to {peak:.4g}, beyond what the pool's "
        f"{pool_dtype} can hold (max {torch.finfo(pool_dtype).max:.4g}): it would land as Inf. "
        "Rescale the adapter (move a factor from lora_B into lora_alpha) or serve it from a "
        "float32 pool"
    )


def _chunks(f, offset: int, nbytes: int, dtype: torch.dtype, buf: bytearray, path: Path):
    """Typed views of [offset, offset + nbytes) of f aliasing buf: each is consumed before the
    next read."""
    step = len(buf) - len(buf) % dtype.itemsize
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        view = memoryview(buf)[:n]
        try:
            f.seek(offset + done)
            got = f.readinto(view)
        except OSError as e:
            raise AdapterFileError(f"cannot read {path}: {e}") from None
        if got != n:
            raise AdapterFileError(
                f"{path}: file ended inside its data section (read {got} of {n} bytes at "
                f"{offset + done}); it changed since it was planned"
            )
        yield torch.frombuffer(view, dtype=dtype) if n else torch.empty(0, dtype=dtype)
        done += n
