"""One Triton launch that lands every tensor of an adapter into its slot (a copy per tensor
cost several ms of host time for a Llama-3-8B r=16 adapter's 448, against ~2 ms for the
bytes). A descriptor row per tensor says where it is in the staged bytes and where it goes:

    dst[dst_off + i * d_row + j] = src[src_off + i * s_row + j * s_col]   i < rows, j < cols

A is [r, in] -> A[slot, :r] (s_row = in, s_col = 1); B is [out, r] -> Bt[slot, :r] = B^T
(s_row = 1, s_col = r), strided reads that L2 absorbs; the dtype conversion is in registers.
d_row is cols for a tensor that fills whole region rows, wider for one expert's part of a
stacked expert region (metrale.adapters.plan: rows every E, columns from an offset).
"""

from __future__ import annotations

import torch

from metrale.ops.triton_utils import jit_kernel, require_triton, shares_storage, storage_base, tl

BLOCK = 2048  # destination elements per program


def _land_kernel(src_ptr, dst_ptr, desc_ptr, BLOCK: tl.constexpr):
    i, tile = tl.program_id(0), tl.program_id(1)
    d = desc_ptr + i * 7
    rows, cols = tl.load(d + 1), tl.load(d + 2)
    n = rows * cols
    if tile * BLOCK >= n:
        return  # the grid is sized for the largest tensor
    e = tile * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] destination elements
    ok = e < n
    r, c = e // cols, e % cols
    src = src_ptr + tl.load(d + 0) + r * tl.load(d + 3) + c * tl.load(d + 4)
    x = tl.load(src, mask=ok, other=0.0)
    # downcasts round to nearest even as torch's copy_ does (compiled; the interpreter truncates)
    dst = dst_ptr + tl.load(d + 5) + r * tl.load(d + 6) + c
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=ok)


def base_of(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D storage all the views live in, or None (then land them one by one)."""
    if not views or not shares_storage(views, views[0].dtype) or not all(
            v.is_contiguous() for v in views):
        return None
    return storage_base(views[0])


def land_views(dst: torch.Tensor, src_base: torch.Tensor,
               items: list[tuple[torch.Tensor, int, int, int, bool, int]]) -> None:
    """dst: the 1-D pool buffer; src_base: base_of(the views); items: (view, dst element
    offset, rows, cols, transpose, dst row stride), as landing_row's."""
    size = src_base.element_size()
    rows = [landing_row((view.data_ptr() - src_base.data_ptr()) // size, dst_off, r, c, t, d)
            for view, dst_off, r, c, t, d in items]
    if rows:
        land_rows(dst, src_base, torch.tensor(rows, dtype=torch.int64).to(dst.device, non_blocking=True),
                  max_tiles(rows))


def landing_row(src_off: int, dst_off: int, rows: int, cols: int, transpose: bool,
                dst_row: int | None = None) -> tuple[int, int, int, int, int, int, int]:
    """The descriptor row of one tensor (elements): at src_off, [rows, cols], or
    [cols, rows] when transpose (B -> Bt), landing at dst_off as [rows, cols] whose rows
    are dst_row apart (None: cols, packed)."""
    return (src_off, rows, cols, 1 if transpose else cols, rows if transpose else 1, dst_off,
            cols if dst_row is None else dst_row)


def max_tiles(rows: list[tuple[int, ...]]) -> int:
    return -(-max(r[1] * r[2] for r in rows) // BLOCK)


def land_rows(dst: torch.Tensor, src: torch.Tensor, desc: torch.Tensor, tiles: int) -> None:
    """One launch for every row of desc ([N, 7] int64 on dst's device), 1-D src to 1-D dst."""
    require_triton()
    kernel = jit_kernel(_land_kernel, dst.device)
    kernel[(desc.shape[0], tiles)](src, dst, desc, BLOCK=BLOCK, num_warps=4)
