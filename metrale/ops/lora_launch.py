"""Launch plumbing of the multi-LoRA kernels (metrale.ops.lora_kernels): path and block sizes
per shape, cached descriptors, alignment hints, the shrink and expand launches. Callers use
metrale.ops.lora_triton; docs/DESIGN.md ("The multi-LoRA kernels") explains the choices."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from metrale.ops.lora_kernels import DESC_COLS, expand_kernel, shrink_kernel
from metrale.ops.triton_utils import is_interpreted, jit_kernel, next_pow2, shares_storage, storage_base

# Block sizes (H200, bench/lora_kernels.py) of the two token mappings: decode (one program
# per token) and prefill (up to BLOCK_T rows of the slot order per program: see config).
# split_k: shrink programs to aim for (split-K fills the GPU at small T).
DECODE_CFG = dict(BLOCK_K=256, BLOCK_N=128, shrink_warps=4, expand_warps=2, split_k=1024)
PREFILL_CFG = dict(BLOCK_T=32, BLOCK_K=128, BLOCK_N=256, shrink_warps=4, expand_warps=4,
                   split_k=256)

# "split": split-K partials in a workspace the expand sums; "atomic": added into a zeroed h
PATHS = ("split", "atomic")


@dataclass(frozen=True)
class PathRule:
    """Groups of min_t..max_t tokens run `path`."""

    path: str
    min_t: int = 1
    max_t: int | None = None

    def matches(self, T: int) -> bool:
        return self.min_t <= T and (self.max_t is None or T <= self.max_t)


# The first matching row, as measured on an H200 (docs/DESIGN.md: the numbers, and what
# would move a row): split past 64 tokens, atomic at decode sizes.
PATH_TABLE = (
    PathRule("split", min_t=65),
    PathRule("atomic"),
)


def choose_path(T: int) -> str:
    for rule in PATH_TABLE:
        if rule.matches(T):
            return rule.path
    raise ValueError(f"no PATH_TABLE row matches T={T}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def f32_dot(kernel, dtype: torch.dtype) -> bool:
    """Dot in fp32 (exact "ieee", not tf32) for fp32 pools, and in the interpreter for bf16,
    whose tl.dot on bf16 operands returns garbage (triton 3.9); GPUs keep bf16 tensor cores."""
    return dtype == torch.float32 or (is_interpreted(kernel) and dtype == torch.bfloat16)


def pool_base(views) -> torch.Tensor:
    """The one storage behind the [S, R, dim] pool views of a group (None entries skipped)."""
    views = [v for v in views if v is not None]
    for v in views:
        if v.dim() != 3 or v.stride(2) != 1:
            raise ValueError(f"pool views must be [S, R, dim] with unit last stride, got {v.shape}")
    if not shares_storage(views, views[0].dtype):
        raise ValueError("fused LoRA modules must be views of one pool storage with one dtype")
    return storage_base(views[0])


def _tables(tabs, dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(base, per-module (element offset, slot stride)) of [S] or [S, out_m] per-slot tables:
    views of one storage cost nothing, separate tensors are copied into one on every call."""
    if shares_storage(tabs, dtype) and all(t.dim() == 1 or t.stride(1) == 1 for t in tabs):
        return storage_base(tabs[0]), [(t.storage_offset(), t.stride(0)) for t in tabs]
    fields, off = [], 0
    for t in tabs:
        fields.append((off, math.prod(t.shape[1:])))
        off += t.numel()
    return torch.cat([t.to(dtype).reshape(-1) for t in tabs]), fields


_DESCS: dict = {}


def descriptor(device, As, Bts, y_cols, rank_fields, scale_fields, dora_fields=None,
               gain_fields=None) -> torch.Tensor:
    """[M, DESC_COLS] int64 on device, cached per layout (never per slot contents)."""
    rows = []
    M = len(As)
    dora_fields = dora_fields or [(0, 0)] * M
    gain_fields = gain_fields or [(0, 0)] * M
    for a, b, col, rf, sf, df, gf in zip(As, Bts, y_cols, rank_fields, scale_fields,
                                         dora_fields, gain_fields, strict=True):
        a_f = (a.storage_offset(), a.stride(0), a.stride(1)) if a is not None else (0, 0, 0)
        b_f = (b.storage_offset(), b.stride(0), b.stride(1), b.shape[2]) if b is not None \
            else (0, 0, 0, 0)
        rows.append((*a_f, *b_f, col, *rf, *sf, *df, *gf))
    key = (str(device), tuple(rows))
    desc = _DESCS.get(key)
    if desc is None:  # a host->device copy: must not happen inside CUDA graph capture
        desc = _DESCS[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        assert desc.shape[1] == DESC_COLS
    return desc


def align(t: torch.Tensor, values) -> int:
    """Largest power of two (elements, up to 16 bytes) dividing t's address and every value:
    the tl.multiple_of hint without which loads and stores are not vectorized."""
    a = 16 // t.element_size()
    while a > 1 and (t.data_ptr() % (a * t.element_size()) or any(v % a for v in values)):
        a //= 2
    return max(a, 1)


def pool_align(pool: torch.Tensor, views) -> int:
    return align(pool, [v for t in views for v in (t.storage_offset(), *t.stride()[:2])])


def out_align(y: torch.Tensor, Bts, y_cols) -> int:
    return align(y, [y.stride(0), *y_cols, *(b.shape[2] for b in Bts)])


def sorted_block_t(T: int) -> int:
    """Rows per program of the slot-order mapping for a batch of T tokens: fewer below ~2k
    tokens, where more programs fill the GPU (tl.dot needs >= 16)."""
    return min(PREFILL_CFG["BLOCK_T"], max(16, next_pow2(cdiv(T, 64))))


def config(T: int, sorted_: bool, R: int) -> dict:
    """Block sizes for T tokens: the decode mapping, or with a slot order the prefill one."""
    block_r = min(64, max(16, next_pow2(R)))  # tl.dot needs >= 16; > R only when R < 16
    if not sorted_:
        return dict(DECODE_CFG, BLOCK_T=1, BLOCK_R=block_r)
    return dict(PREFILL_CFG, BLOCK_R=block_r, BLOCK_T=sorted_block_t(T))


# 1: slot orders are segment-aligned (segment_order); 0: a plain stable sort, whose
# programs loop over every slot among their rows (bench/decode.py --override A/B)
SEGMENTS = 1


def segment_order_rows(T: int, num_slots: int) -> int:
    """The longest segment_order of T tokens over num_slots slots (a graph's fixed grid):
    each slot's run pads to a multiple of the block, at most block - 1 rows per run."""
    bt = sorted_block_t(T)
    return cdiv(T + min(T, num_slots) * (bt - 1), bt) * bt


def segment_order(slot_ids: np.ndarray, length: int | None = None) -> np.ndarray:
    """[L] int64 token indices grouped by slot, each slot's run padded with -1 to a
    multiple of sorted_block_t(T), so that every program of the slot-order mapping serves
    one adapter (as SGMV's segments do) instead of looping over the slots its rows hold;
    base tokens (slot < 0) left out. length: pad with -1 to this (a graph's buffer)."""
    T = len(slot_ids)
    order = np.argsort(slot_ids, kind="stable")
    if not SEGMENTS:
        return order if length is None else np.concatenate(
            [order, np.full(length - T, -1, dtype=np.int64)])
    bt = sorted_block_t(T)
    slots = slot_ids[order]
    order = order[slots >= 0]
    slots = slots[slots >= 0]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]]) if len(slots) else \
        np.zeros(0, dtype=np.int64)
    runs = np.diff(np.r_[starts, len(slots)])  # tokens of each slot
    padded = -(-runs // bt) * bt
    total = int(padded.sum())
    out = np.full(total if length is None else length, -1, dtype=np.int64)
    if total > len(out):
        raise ValueError(f"a segment order of {total} rows does not fit {len(out)}")
    # run i's rows move from starts[i] to its padded start
    shift = np.cumsum(padded) - padded - starts
    out[np.repeat(shift, runs) + np.arange(len(slots))] = order
    return out


def split_k(T: int, IN: int, M: int, cfg: dict) -> tuple[int, int]:
    """(splits, k per split) of the shrink: enough programs to fill the GPU at small T."""
    n_kblk, t_blk = cdiv(IN, cfg["BLOCK_K"]), cdiv(T, cfg["BLOCK_T"])
    split = min(n_kblk, next_pow2(cdiv(cfg["split_k"], t_blk * M)))
    k_per_split = cdiv(n_kblk, split) * cfg["BLOCK_K"]
    return cdiv(IN, k_per_split), k_per_split


def workspace(x: torch.Tensor, As, order, *, partials: bool) -> torch.Tensor:
    """shrink's fp32 output: h [T, M*R] (atomic), or with partials [splits, T, M*R] (split)."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if not partials:
        return torch.empty(T, M * R, dtype=torch.float32, device=x.device)
    split, _ = split_k(T, IN, M, config(T, order is not None, R))
    return torch.empty(split, T, M * R, dtype=torch.float32, device=x.device)


def shrink(x, As, slot_ids, ranks_list, order, h) -> torch.Tensor:
    """h[:, m*R:(m+1)*R] = x @ As[m][slot].T for every module m, into a workspace(): a 2-D h
    is zeroed here and split-K adds into it atomically; a 3-D one gets split k's partial sum
    in h[k], only rows r < rank of adapter tokens (all the expand reads)."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if x.stride(1) != 1 or any(a.shape[1:] != (R, IN) for a in As):
        raise ValueError("x must be [T, in] with unit last stride and every A [S, R, in]")
    cfg = config(T, order is not None, R)
    split, k_per_split = split_k(T, IN, M, cfg)
    if h.dim() == 3:
        if h.shape[0] != split:
            raise ValueError(f"partials need {split} splits, got {h.shape[0]}")
        split_stride, h_stride, atomic = h.stride(0), h.stride(1), False
    else:
        h.zero_()
        split_stride, h_stride, atomic = 0, h.stride(0), split > 1
    pool = pool_base(As)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    desc = descriptor(x.device, As, [None] * M, [0] * M, rank_fields, [(0, 0)] * M)
    kernel = jit_kernel(shrink_kernel, x.device)
    rows = T if order is None else order.shape[0]  # a segment order has padding rows
    kernel[(cdiv(rows, cfg["BLOCK_T"]), split, M)](
        x, pool, h, slot_ids, order if order is not None else slot_ids, desc, rank_base,
        rows, IN, R, x.stride(0), h_stride, split_stride, k_per_split,
        ATOMIC=atomic, SORTED=order is not None, F32_DOT=f32_dot(kernel, pool.dtype),
        ALIGN=pool_align(pool, As),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["shrink_warps"],
    )
    return h


_NO_DORA: dict = {}


def _no_dora(S: int, device, M: int):
    """Zero DoRA flags and unit gains for S slots (cached: no allocation per call)."""
    key = (str(device), S)
    if key not in _NO_DORA:
        _NO_DORA[key] = (torch.zeros(S, dtype=torch.int32, device=device),
                         torch.ones(S, 1, dtype=torch.float32, device=device))
    flags, gains = _NO_DORA[key]
    return [flags] * M, [gains] * M


def check_out(y, Bts, y_cols) -> None:
    if y.stride(1) != 1:
        raise ValueError("y needs unit last stride")
    for b, col in zip(Bts, y_cols, strict=True):
        if col + b.shape[2] > y.shape[1]:
            raise ValueError(f"Bt {tuple(b.shape)} at column {col} does not fit y {tuple(y.shape)}")


def y_cols(out_slices, Bts, width: int) -> list[int]:
    """The first column of each module's slice of y, checked against its Bt's width."""
    cols = []
    for sl, b in zip(out_slices, Bts, strict=True):
        start, stop, step = sl.indices(width)
        if step != 1 or stop - start != b.shape[2]:
            raise ValueError(f"out slice {sl} does not match Bt width {b.shape[2]}")
        cols.append(start)
    return cols


def expand_tables(y, Bts, ranks_list, scales_list, doras_list, gains_list):
    """((rank, scale, dora, gain) bases, their per-module descriptor fields)."""
    M = len(Bts)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    scale_base, scale_fields = _tables(scales_list, torch.float32)
    if doras_list is None:  # no DoRA anywhere: every flag reads a zero, no gain is read
        doras_list, gains_list = _no_dora(Bts[0].shape[0], y.device, M)
    for b, g in zip(Bts, gains_list, strict=True):
        if g.shape[0] != b.shape[0] or g.shape[1] < 1:
            raise ValueError(f"gains {tuple(g.shape)} do not match Bt {tuple(b.shape)}")
    dora_base, dora_fields = _tables(doras_list, torch.int32)
    gain_base, gain_fields = _tables(gains_list, torch.float32)
    return ((rank_base, scale_base, dora_base, gain_base),
            (rank_fields, scale_fields, dora_fields, gain_fields))


def expand(y, h, Bts, cols, slot_ids, ranks_list, scales_list, order,
           doras_list=None, gains_list=None, bias=None) -> None:
    """y[:, cols[m]:+out_m] += scale * h[:, m*R:(m+1)*R] @ Bts[m][slot] for every module m
    (DoRA slots: the gain epilogue, bias the one y holds); a 3-D h's partials are summed."""
    T, M, R = y.shape[0], len(Bts), Bts[0].shape[1]
    if h.shape[-2:] != (T, M * R) or h.stride(-1) != 1 or h.dim() not in (2, 3):
        raise ValueError(f"h must be [(splits,) {T}, {M * R}] (got {tuple(h.shape)})")
    if any(b.shape[1] != R for b in Bts):
        raise ValueError("every Bt must be [S, R, out] with one R")
    check_out(y, Bts, cols)
    n_split, split_stride = (h.shape[0], h.stride(0)) if h.dim() == 3 else (1, 0)
    pool = pool_base(Bts)
    bases, fields = expand_tables(y, Bts, ranks_list, scales_list, doras_list, gains_list)
    desc = descriptor(y.device, [None] * M, Bts, cols, *fields)
    cfg = config(T, order is not None, R)
    max_out = max(b.shape[2] for b in Bts)
    rows = T if order is None else order.shape[0]  # a segment order has padding rows
    grid = (cdiv(rows, cfg["BLOCK_T"]), cdiv(max_out, cfg["BLOCK_N"]), M)
    kernel = jit_kernel(expand_kernel, y.device)
    kernel[grid](
        y, pool, h, slot_ids, order if order is not None else slot_ids, desc, *bases,
        bias if bias is not None else y,
        rows, R, y.stride(0), h.stride(-2), n_split, split_stride,
        SORTED=order is not None, F32_DOT=f32_dot(kernel, pool.dtype), HAS_BIAS=bias is not None,
        ALIGN=min(pool_align(pool, Bts), out_align(y, Bts, cols)),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["expand_warps"],
    )
