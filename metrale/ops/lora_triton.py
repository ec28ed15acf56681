"""Triton multi-LoRA kernels over the adapter pool: shrink (h = x @ A.T) and expand (y += s*h @ Bt).

Same semantics as metrale.ops.lora_ref, plus per-slot `ranks` so rank padding costs nothing:
every A/Bt load is masked to rows r < ranks[s] and the rank-tile loop stops at ranks[s].

How a launch finds its data (all through device memory, so CUDA graphs stay valid when an
adapter is swapped into a slot):
- pool: ONE base pointer (the storage behind every A/Bt view) plus a per-module int64
  descriptor row of element offsets, strides and dims. Views of one storage share the base,
  which is what lets a single launch serve q/k/v (or gate/up) at once.
- ranks/scales: a base pointer plus per-module (offset, stride), likewise: tables that are
  views of one storage (e.g. columns of [S, layers, modules]) cost nothing; separate ones are
  stacked on every call, a tiny copy that a graph replays too.
- slot_ids (and `order`): read per token; nothing about slot contents is a launch parameter.
The descriptor is built once per distinct layout and cached, so warm up before graph capture.
Offsets read from memory tell the compiler nothing about alignment, so the wrappers check it
on the host and pass ALIGN for tl.multiple_of hints: without them loads and stores are not
vectorized (measured: prefill expand ran at a third of its bandwidth).

Two token mappings, chosen per call:
- decode (order is None, T <= DECODE_MAX_T): one program per token, fp32 multiply-reduce,
  no sort needed; many programs (split-K on shrink) keep the GPU busy at T=1.
- prefill: BLOCK_T rows of `order` (token indices, normally `sort_tokens_by_slot`) per
  program, tensor-core dots; a program loops over the distinct slots among its rows, which
  sorting keeps to one or two. Any order is correct; sorting only saves work.
Tokens with slot -1 are never read or written (shrink leaves their h rows zero).
Shrink zero-fills h first: split-K programs add into it atomically (so h is not bit-for-bit
deterministic across runs) and padded ranks read back as zero.

DoRA is an epilogue of expand: for a slot whose per-module `doras` flag is set, the program
loads the gain row g (float32) and stores g * (y - bias + s * acc) + bias instead of
y + s * acc. The flag is one scalar load per (program, slot); plain-LoRA slots take the old
branch, so they pay no extra memory traffic. Embedding LoRA reuses expand after a torch
gather of A's columns (`lora_embed`).
"""

import torch

from metrale.ops.triton_utils import is_interpreted, jit_kernel, next_pow2, require_triton, tl

# Launch knobs: first guesses for an H200, to be tuned with bench/lora_kernels.py.
DECODE_MAX_T = 64  # above this many tokens (and no order given) use the prefill kernels
# split_k: shrink programs to aim for (split-K fills the GPU at small T); BLOCK_T (prefill)
# is an upper bound, see _config.
DECODE_CFG = dict(BLOCK_K=256, BLOCK_N=128, shrink_warps=4, expand_warps=2, split_k=1024)
PREFILL_CFG = dict(BLOCK_T=32, BLOCK_K=128, BLOCK_N=256, shrink_warps=4, expand_warps=4,
                   split_k=256)
# The per-module descriptor row (int64, 12 columns, numbered in the kernels):
# 0 a_off  1 a_slot_stride  2 a_row_stride  3 b_off  4 b_slot_stride  5 b_row_stride
# 6 out_dim  7 y_col  8 rank_off  9 rank_stride  10 scale_off  11 scale_stride
# 12 dora_off  13 dora_stride  14 gain_off  15 gain_slot_stride
_DESC_COLS = 16


def _shrink_kernel(
    x_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr,
    T, IN, R, x_stride, h_stride, k_per_split,
    ATOMIC: tl.constexpr, SORTED: tl.constexpr, F32_DOT: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_t, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < T
    if SORTED:
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [BT]
    else:
        tok = rows.to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1).to(tl.int32)  # [BT]
    d = desc_ptr + m * 16
    # offsets read from memory carry no alignment facts: without these hints, no vector loads
    a_base = pool_ptr + tl.multiple_of(tl.load(d + 0), ALIGN)
    a_slot_stride = tl.multiple_of(tl.load(d + 1), ALIGN)
    a_row_stride = tl.multiple_of(tl.load(d + 2), ALIGN)
    rank_tab, rank_stride = rank_ptr + tl.load(d + 8), tl.load(d + 9)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, IN)
    offs_k, offs_r = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_R)
    big = 2147483647  # "no slot left" sentinel for the min-reduction below
    s = tl.min(tl.where(slot >= 0, slot, big))
    while s < big:  # once per distinct slot among this program's rows
        rank = tl.minimum(tl.load(rank_tab + s * rank_stride), R)
        sel = slot == s  # [BT] rows served in this iteration
        a_slot = a_base + s.to(tl.int64) * a_slot_stride
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r  # [BR]
            r_ok = r < rank
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + offs_k  # [BK]
                k_ok = k < k_hi
                xt = tl.load(x_ptr + tok[:, None] * x_stride + k[None, :],
                             mask=sel[:, None] & k_ok[None, :], other=0.0)  # [BT, BK]
                at = tl.load(a_slot + r[None, :] * a_row_stride + k[:, None],
                             mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BK, BR]
                if BLOCK_T == 1:
                    prod = xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :]
                    acc += tl.sum(prod, axis=1)  # [1, BK, BR] -> [1, BR]
                elif F32_DOT:
                    acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xt.to(at.dtype), at, acc)
            h_ptrs = h_ptr + tok[:, None] * h_stride + m * R + r[None, :]  # [BT, BR]
            h_mask = sel[:, None] & r_ok[None, :]
            if ATOMIC:  # split-K: several programs add into the zero-filled h
                tl.atomic_add(h_ptrs, acc, mask=h_mask)
            else:
                tl.store(h_ptrs, acc, mask=h_mask)
        s = tl.min(tl.where(slot > s, slot, big))


def _expand_kernel(
    y_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr, scale_ptr,
    dora_ptr, gain_ptr, bias_ptr,
    T, R, y_stride, h_stride,
    SORTED: tl.constexpr, F32_DOT: tl.constexpr, ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_t, pid_n, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = desc_ptr + m * 16
    # offsets and dims read from memory carry no alignment facts; without these hints (for
    # the masks too) the compiler issues 2-byte loads and stores
    out_dim = tl.multiple_of(tl.load(d + 6), ALIGN)
    if pid_n * BLOCK_N >= out_dim:
        return  # the grid is sized for the widest module of the group
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < out_dim
    b_base = pool_ptr + tl.multiple_of(tl.load(d + 3), ALIGN)
    b_slot_stride = tl.multiple_of(tl.load(d + 4), ALIGN)
    b_row_stride = tl.multiple_of(tl.load(d + 5), ALIGN)
    y_col = tl.multiple_of(tl.load(d + 7), ALIGN)
    rank_tab, rank_stride = rank_ptr + tl.load(d + 8), tl.load(d + 9)
    scale_tab, scale_stride = scale_ptr + tl.load(d + 10), tl.load(d + 11)
    dora_tab, dora_stride = dora_ptr + tl.load(d + 12), tl.load(d + 13)
    gain_base, gain_stride = gain_ptr + tl.load(d + 14), tl.load(d + 15)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < T
    if SORTED:
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [BT]
    else:
        tok = rows.to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1).to(tl.int32)  # [BT]
    offs_r = tl.arange(0, BLOCK_R)
    big = 2147483647
    s = tl.min(tl.where(slot >= 0, slot, big))
    while s < big:
        rank = tl.minimum(tl.load(rank_tab + s * rank_stride), R)
        sel = slot == s  # [BT]
        if rank > 0:
            b_slot = b_base + s.to(tl.int64) * b_slot_stride
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r  # [BR]
                r_ok = r < rank
                ht = tl.load(h_ptr + tok[:, None] * h_stride + m * R + r[None, :],
                             mask=sel[:, None] & r_ok[None, :], other=0.0)  # [BT, BR] fp32
                bt = tl.load(b_slot + r[:, None] * b_row_stride + n[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BR, BN]
                if BLOCK_T == 1:
                    acc += tl.sum(ht[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
                elif F32_DOT:
                    acc = tl.dot(ht.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(ht.to(bt.dtype), bt, acc)
            scale = tl.load(scale_tab + s * scale_stride)
            y_ptrs = y_ptr + tok[:, None] * y_stride + y_col + n[None, :]  # [BT, BN]
            y_mask = sel[:, None] & n_ok[None, :]
            y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            if tl.load(dora_tab + s * dora_stride) != 0:
                # DoRA: g * (x W^T + s * delta) + bias; y_old holds x W^T + bias
                g = tl.load(gain_base + s.to(tl.int64) * gain_stride + n, mask=n_ok,
                            other=1.0)  # [BN] float32
                if HAS_BIAS:
                    b = tl.load(bias_ptr + y_col + n, mask=n_ok, other=0.0).to(tl.float32)
                    y_new = g[None, :] * (y_old - b[None, :] + scale * acc) + b[None, :]
                else:
                    y_new = g[None, :] * (y_old + scale * acc)
            else:
                y_new = y_old + scale * acc
            tl.store(y_ptrs, y_new.to(y_ptr.dtype.element_ty), mask=y_mask)
        s = tl.min(tl.where(slot > s, slot, big))


def _f32_dot(kernel, dtype: torch.dtype) -> bool:
    """Dot in fp32 (exact "ieee", not tf32) for fp32 pools, and in the interpreter for bf16,
    whose tl.dot on bf16 operands returns garbage (triton 3.9); GPUs keep bf16 tensor cores."""
    return dtype == torch.float32 or (is_interpreted(kernel) and dtype == torch.bfloat16)


def sort_tokens_by_slot(slot_ids: torch.Tensor) -> torch.Tensor:
    """order: [T] int64 token indices grouped by slot. Build once per batch, reuse in every layer."""
    return torch.argsort(slot_ids, stable=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _storage_base(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over t's whole storage: the pointer every descriptor offset is relative to."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def _shares_storage(ts, dtype: torch.dtype) -> bool:
    ptr = ts[0].untyped_storage().data_ptr()
    return all(t.dtype == dtype and t.untyped_storage().data_ptr() == ptr for t in ts)


def _pool_base(views) -> torch.Tensor:
    views = [v for v in views if v is not None]
    for v in views:
        if v.dim() != 3 or v.stride(2) != 1:
            raise ValueError(f"pool views must be [S, R, dim] with unit last stride, got {v.shape}")
    if not _shares_storage(views, views[0].dtype):
        raise ValueError("fused LoRA modules must be views of one pool storage with one dtype")
    return _storage_base(views[0])


def _tables(tabs, dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(base, per-module (element offset, stride)) for the ranks or scales tables."""
    if _shares_storage(tabs, dtype) and all(t.dim() == 1 for t in tabs):
        return _storage_base(tabs[0]), [(t.storage_offset(), t.stride(0)) for t in tabs]
    stacked = torch.stack([t.to(dtype) for t in tabs])  # [M, S]; copied on every call
    return stacked.reshape(-1), [(i * stacked.shape[1], 1) for i in range(len(tabs))]


_DESCS: dict = {}


def _descriptor(device, As, Bts, y_cols, rank_fields, scale_fields, dora_fields=None,
                gain_fields=None) -> torch.Tensor:
    """[M, 16] int64 on device, cached per layout (the values never depend on slot contents)."""
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
    return desc


def _align(t: torch.Tensor, values) -> int:
    """Largest power of two (elements, up to 16 bytes) dividing t's address and every value."""
    a = 16 // t.element_size()
    while a > 1 and (t.data_ptr() % (a * t.element_size()) or any(v % a for v in values)):
        a //= 2
    return max(a, 1)


def _config(T: int, sorted_: bool, R: int) -> dict:
    block_r = min(64, max(16, next_pow2(R)))  # tl.dot needs >= 16; > R only when R < 16
    if not sorted_:
        return dict(DECODE_CFG, BLOCK_T=1, BLOCK_R=block_r)
    cfg = dict(PREFILL_CFG, BLOCK_R=block_r)
    # fewer rows per program below ~2k tokens: rows of many slots share a program less often
    cfg["BLOCK_T"] = min(cfg["BLOCK_T"], max(16, next_pow2(_cdiv(T, 64))))
    return cfg


def _shrink(x, As, slot_ids, ranks_list, order, h) -> None:
    """h[:, m*R:(m+1)*R] = x @ As[m][slot].T for every module m; h [T, M*R] fp32, zero-filled here."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if x.stride(1) != 1 or any(a.shape[1:] != (R, IN) for a in As):
        raise ValueError("x must be [T, in] with unit last stride and every A [S, R, in]")
    h.zero_()
    pool = _pool_base(As)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    desc = _descriptor(x.device, As, [None] * M, [0] * M, rank_fields, [(0, 0)] * M)
    cfg = _config(T, order is not None, R)
    n_kblk, t_blk = _cdiv(IN, cfg["BLOCK_K"]), _cdiv(T, cfg["BLOCK_T"])
    split = min(n_kblk, next_pow2(_cdiv(cfg["split_k"], t_blk * M)))
    k_per_split = _cdiv(n_kblk, split) * cfg["BLOCK_K"]
    split = _cdiv(IN, k_per_split)
    kernel = jit_kernel(_shrink_kernel, x.device)
    kernel[(t_blk, split, M)](
        x, pool, h, slot_ids, order if order is not None else slot_ids, desc, rank_base,
        T, IN, R, x.stride(0), h.stride(0), k_per_split,
        ATOMIC=split > 1, SORTED=order is not None, F32_DOT=_f32_dot(kernel, pool.dtype),
        ALIGN=_align(pool, [v for a in As for v in (a.storage_offset(), *a.stride()[:2])]),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["shrink_warps"],
    )


_NO_DORA: dict = {}


def _no_dora(S: int, device, M: int):
    """Zero DoRA flags and unit gains for S slots (cached: no allocation per call)."""
    key = (str(device), S)
    if key not in _NO_DORA:
        _NO_DORA[key] = (torch.zeros(S, dtype=torch.int32, device=device),
                         torch.ones(S, 1, dtype=torch.float32, device=device))
    flags, gains = _NO_DORA[key]
    return [flags] * M, [gains] * M


def _gain_tables(gains_list, S: int, device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(base, per-module (element offset, slot stride)) of the [S, out_m] float32 gain rows."""
    if _shares_storage(gains_list, torch.float32) and all(
            g.dim() == 2 and g.stride(1) == 1 for g in gains_list):
        return _storage_base(gains_list[0]), [(g.storage_offset(), g.stride(0)) for g in gains_list]
    flat = torch.cat([g.float().reshape(-1) for g in gains_list])  # copied on every call
    fields, off = [], 0
    for g in gains_list:
        fields.append((off, g.shape[1]))
        off += g.numel()
    return flat, fields


def _expand(y, h, Bts, y_cols, slot_ids, ranks_list, scales_list, order,
            doras_list=None, gains_list=None, bias=None) -> None:
    """y[:, y_cols[m]:+out_m] += scale * h[:, m*R:(m+1)*R] @ Bts[m][slot] for every module m
    (DoRA slots, flagged in doras_list: the gain epilogue, bias the one y already holds)."""
    T, M, R = y.shape[0], len(Bts), Bts[0].shape[1]
    if y.stride(1) != 1 or h.stride(1) != 1 or h.shape != (T, M * R):
        raise ValueError(f"y needs unit last stride and h must be [T, {M * R}] (got {h.shape})")
    for b, col in zip(Bts, y_cols, strict=True):
        if b.shape[1] != R or col + b.shape[2] > y.shape[1]:
            raise ValueError(f"Bt {tuple(b.shape)} at column {col} does not fit y {tuple(y.shape)}")
    pool = _pool_base(Bts)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    scale_base, scale_fields = _tables(scales_list, torch.float32)
    if doras_list is None:  # no DoRA anywhere: every flag reads a zero, no gain is read
        doras_list, gains_list = _no_dora(Bts[0].shape[0], y.device, M)
    for b, g in zip(Bts, gains_list, strict=True):
        if g.shape[0] != b.shape[0] or g.shape[1] < 1:
            raise ValueError(f"gains {tuple(g.shape)} do not match Bt {tuple(b.shape)}")
    dora_base, dora_fields = _tables(doras_list, torch.int32)
    gain_base, gain_fields = _gain_tables(gains_list, Bts[0].shape[0], y.device)
    desc = _descriptor(y.device, [None] * M, Bts, y_cols, rank_fields, scale_fields,
                       dora_fields, gain_fields)
    cfg = _config(T, order is not None, R)
    max_out = max(b.shape[2] for b in Bts)
    grid = (_cdiv(T, cfg["BLOCK_T"]), _cdiv(max_out, cfg["BLOCK_N"]), M)
    kernel = jit_kernel(_expand_kernel, y.device)
    kernel[grid](
        y, pool, h, slot_ids, order if order is not None else slot_ids, desc, rank_base,
        scale_base, dora_base, gain_base, bias if bias is not None else y,
        T, R, y.stride(0), h.stride(0),
        SORTED=order is not None, F32_DOT=_f32_dot(kernel, pool.dtype), HAS_BIAS=bias is not None,
        ALIGN=min(_align(pool, [v for b in Bts for v in (b.storage_offset(), *b.stride()[:2])]),
                  _align(y, [y.stride(0), *y_cols, *(b.shape[2] for b in Bts)])),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["expand_warps"],
    )


def _order_for(slot_ids: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor | None:
    if order is None and slot_ids.shape[0] > DECODE_MAX_T:
        return sort_tokens_by_slot(slot_ids)
    return order


def lora_shrink(
    x: torch.Tensor, A: torch.Tensor, slot_ids: torch.Tensor, ranks: torch.Tensor, *,
    order: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """h: [T, R] float32 = x @ A[slot].T per token (zeros for slot -1 and past ranks[slot])."""
    require_triton()
    h = out if out is not None else torch.empty(x.shape[0], A.shape[1], dtype=torch.float32,
                                                device=x.device)
    if h.dtype != torch.float32 or h.shape != (x.shape[0], A.shape[1]) or h.stride(1) != 1:
        raise ValueError(f"out must be float32 [T, R] with unit last stride, got {h.shape}")
    if x.shape[0]:
        _shrink(x, [A], slot_ids, [ranks], _order_for(slot_ids, order), h)
    return h


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, Bt: torch.Tensor, slot_ids: torch.Tensor,
    scales: torch.Tensor, ranks: torch.Tensor, *, order: torch.Tensor | None = None,
) -> None:
    """y += scales[slot] * h @ Bt[slot] in place, for tokens with slot >= 0."""
    require_triton()
    if y.shape[0]:
        _expand(y, h, [Bt], [0], slot_ids, [ranks], [scales], _order_for(slot_ids, order))


def lora_apply(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, slot_ids: torch.Tensor,
    scales: torch.Tensor, ranks: torch.Tensor, *, order: torch.Tensor | None = None,
) -> None:
    """y += LoRA(x): lora_apply_ref's semantics, one shrink and one expand launch."""
    lora_apply_fused(y, x, [A], [Bt], [slice(0, y.shape[1])], slot_ids, [scales], [ranks],
                     order=order)


def lora_embed(
    y: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
    slot_ids: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor,
    doras: torch.Tensor | None = None, gains: torch.Tensor | None = None, *,
    order: torch.Tensor | None = None,
) -> None:
    """lora_embed_ref's semantics: the shrink is a gather of A's columns (torch, on the
    device, no sync), the expand this file's kernel with its DoRA epilogue."""
    require_triton()
    if y.shape[0] == 0:
        return
    h = A[slot_ids.clamp(min=0), :, ids].float().contiguous()  # [T, R]; rows of slot -1 unread
    _expand(y, h, [Bt], [0], slot_ids, [ranks], [scales], _order_for(slot_ids, order),
            None if doras is None else [doras], None if gains is None else [gains])


def lora_apply_fused(
    y: torch.Tensor, x: torch.Tensor, As, Bts, out_slices, slot_ids: torch.Tensor,
    scales_list, ranks_list, *, order: torch.Tensor | None = None,
    doras_list=None, gains_list=None, bias: torch.Tensor | None = None,
) -> None:
    """lora_apply_fused_ref's semantics: modules sharing x (q/k/v, gate/up) add into slices of y.

    Two launches for the whole group, whatever the number of modules. No host sync: a batch with
    no adapter token still launches, and every program exits after reading its slot ids.
    """
    require_triton()
    T, M = x.shape[0], len(As)
    if not (len(Bts) == len(out_slices) == len(scales_list) == len(ranks_list) == M):
        raise ValueError("As, Bts, out_slices, scales_list and ranks_list need one entry per module")
    y_cols = []
    for sl, b in zip(out_slices, Bts, strict=True):
        start, stop, step = sl.indices(y.shape[1])
        if step != 1 or stop - start != b.shape[2]:
            raise ValueError(f"out slice {sl} does not match Bt width {b.shape[2]}")
        y_cols.append(start)
    if T == 0:
        return
    order = _order_for(slot_ids, order)
    h = torch.empty(T, M * As[0].shape[1], dtype=torch.float32, device=x.device)  # [T, M*R]
    _shrink(x, list(As), slot_ids, list(ranks_list), order, h)
    _expand(y, h, list(Bts), y_cols, slot_ids, list(ranks_list), list(scales_list), order,
            None if doras_list is None else list(doras_list),
            None if gains_list is None else list(gains_list), bias)
