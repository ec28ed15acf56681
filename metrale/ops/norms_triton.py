"""One Triton launch for the landing check's norms of every region of a slot (torch took two
launches per (module, kind) group, ~42 on an 8B slot: ~0.4 ms of a 2.5 ms peer landing on
the H200). A descriptor row per region, [offset, rows, cols, kind] in elements:

    kind 0 (A):        max_i sqrt(sum_j x[i, j]^2)    the largest row 2-norm
    kind 1 (B as Bt):  max_j sum_i |x[i, j]|          the largest column 1-norm
    kind 2 (M, embedding A): max |x|

accumulated in float32. A region holding NaN or Inf gets NaN, so the caller redoes its
group in float64 (as for a float32 overflow) and the torch reference decides. The torch
reference is `AdapterPool`'s `_norms`; tests/test_norms_triton.py checks one against the
other in the interpreter.
"""

from __future__ import annotations

import torch

from metrale.ops.triton_utils import device_function, jit_kernel, require_triton, tl

KIND_A, KIND_B, KIND_MAX = 0, 1, 2
BLOCK_R, BLOCK_C = 16, 256  # rows x columns a program reads at a time


@device_function
def _tile(buf_ptr, offset, rs, cs, rows, cols):
    """x[rs, cs] of the row-major [rows, cols] region at offset, float32, 0 outside it."""
    ok = (rs[:, None] < rows) & (cs[None, :] < cols)
    return tl.load(buf_ptr + offset + rs[:, None] * cols + cs[None, :], mask=ok,
                   other=0.0).to(tl.float32)


@device_function
def _non_finite(x):
    return ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)


def _region_norms_kernel(buf_ptr, desc_ptr, out_ptr, n_regions,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    g = tl.program_id(0)
    if g == 0:
        tl.store(out_ptr + n_regions, 0.0)  # the trailing 0 of gain_norm_values
    d = desc_ptr + g * 4
    offset, rows, cols, kind = tl.load(d), tl.load(d + 1), tl.load(d + 2), tl.load(d + 3)
    r_idx = tl.arange(0, BLOCK_R).to(tl.int64)
    c_idx = tl.arange(0, BLOCK_C).to(tl.int64)
    bad = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    best = tl.zeros([BLOCK_C], dtype=tl.float32)  # a running max, folded at the end
    if kind == 1:  # columns outer: each column's 1-norm sums over every row
        for c0 in range(0, cols, BLOCK_C):
            cs = c0 + c_idx
            col_sum = tl.zeros([BLOCK_C], dtype=tl.float32)
            for r0 in range(0, rows, BLOCK_R):
                x = _tile(buf_ptr, offset, r0 + r_idx, cs, rows, cols)  # [BLOCK_R, BLOCK_C]
                bad += _non_finite(x)
                col_sum += tl.sum(tl.abs(x), axis=0)
            best = tl.maximum(best, col_sum)
        result = tl.max(best, axis=0)
    else:  # rows outer: a row's 2-norm (or largest |x|) over every column
        row_best = tl.zeros([BLOCK_R], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            rs = r0 + r_idx
            squares = tl.zeros([BLOCK_R], dtype=tl.float32)
            peak = tl.zeros([BLOCK_R], dtype=tl.float32)
            for c0 in range(0, cols, BLOCK_C):
                x = _tile(buf_ptr, offset, rs, c0 + c_idx, rows, cols)  # [BLOCK_R, BLOCK_C]
                bad += _non_finite(x)
                squares += tl.sum(x * x, axis=1)
                peak = tl.maximum(peak, tl.max(tl.abs(x), axis=1))
            row_best = tl.maximum(row_best, tl.where(kind == 0, squares, peak))
        result = tl.max(row_best, axis=0)
        result = tl.where(kind == 0, tl.sqrt(result), result)
    result = tl.where(tl.sum(bad) > 0, float("nan"), result)
    tl.store(out_ptr + g, result)


def region_descriptors(regions: list[tuple[int, int, int, int]], device) -> torch.Tensor:
    """[N, 4] int64 on `device`: (offset in elements, rows, cols, kind) per region."""
    return torch.tensor(regions, dtype=torch.int64).reshape(-1, 4).to(device)


def region_norms(buffer: torch.Tensor, desc: torch.Tensor) -> torch.Tensor:
    """float32 [N + 1]: each region's norm (NaN where it holds NaN or Inf), then a 0.
    buffer: the 1-D pool buffer the offsets count from."""
    require_triton()
    n = desc.shape[0]
    out = torch.empty(n + 1, dtype=torch.float32, device=buffer.device)
    if n == 0:
        out.zero_()
        return out
    kernel = jit_kernel(_region_norms_kernel, buffer.device)
    kernel[(n,)](buffer, desc, out, n, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out
