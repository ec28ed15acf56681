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

Three ways to run a group (lora_apply_fused's `path`; APPLY_PATH/choose_path pick):
- "fused": ONE launch, program (token, run of output columns, module). It recomputes its
  token's h = x @ A[s, :rank].T into registers, then adds s * h @ Bt[s, :rank, run] to y.
  No h in memory, no memset, no atomics, no sort. Decode batches of <= FUSED_MAX_T tokens.
- "split": two launches. Split-K shrink programs each write their partial sums into a
  [splits, T, M*R] workspace (only rows r < rank of adapter tokens: expand reads nothing
  else, so nothing is zero-filled); expand sums the partials in a fixed order while
  loading h. Deterministic. Everything that is not "fused".
- "atomic": the old three launches (memset of h, shrink with atomic split-K adds, expand),
  kept so bench/lora_kernels.py can time it beside the others.

Why (Llama-3-8B at r=16, bf16, H200 ~4.8 TB/s; issue #15 measured ~8 us per call for the
three launches, i.e. ~2.5-3 us per dependent kernel in a graph, against byte floors of
0.05-0.25 us per group at one token):
- per slot and group the weights are: A 128 KiB per module (down: 448 KiB, in=14336), Bt
  128 KiB for q/o/down, 32 KiB for k/v, 448 KiB for gate/up each. At T=1 a group moves
  256 KiB-1.1 MiB, 0.05-0.25 us of HBM: the launches ARE the cost, so one launch wins
  outright, and recomputing h per program costs only re-reads of A from L2.
- the fused kernel's price is those re-reads: every (token, column run, module) reads the
  token's A (rank*in*2 bytes) again. With P programs that is P*128 KiB of L2 traffic
  (down: P*448 KiB). Few programs, though, means a long serial read per program (one SM
  streams ~0.1-0.2 TB/s). So _fused_config aims at ~FUSED_CFG["programs"] (one per SM)
  programs but caps the A re-reads at FUSED_CFG["l2_bytes"] (8 MiB, ~1-2 us of L2): at
  T=1 that is 28 runs of 512 columns for gate/up, 16 for down, 21 per module for q/k/v;
  as T grows the runs per token shrink (T*runs stays ~constant), down to one run per
  (token, module) at T >= 32 for gate/up, where A is read once per token as in the old
  shrink and the Bt bytes per program are those of the old per-token expand.
- the risk in that shape: one program streams a whole A[s] (128 KiB; 448 KiB for down)
  through a serial K loop, and with one program per SM nothing hides a load's latency
  but the program's own later loads. Hence big K steps (16 KiB per step at R=16, 8 warps)
  and tl.range stages. If the bench shows down's fused time far above ~3 us at T=1, this
  is why, and FUSED_MAX_T per group (or split-K of A across a cluster) is the next step.
- past a few tokens (T=32 "spread": 32 slots, ~37 MB for gate/up, ~8 us of HBM) the
  launches matter less and parallelism matters more: the split path's many small shrink
  programs (split-K) and T*out/128 expand programs pull bandwidth from every SM, while the
  fused path's T*runs*M programs (64 at T=32 for gate/up) leave half the SMs idle with
  whole Bt rows to stream. Removing the memset there saves one launch of three and makes
  h deterministic; the workspace is splits*T*M*R*4 bytes (T=32 gate/up: 64 KiB), read from
  L2 by each expand program (splits*R*4 bytes per token and module, 1-3.5 KiB).
- FUSED_MAX_T (8) sits where, by this arithmetic, the fused path's A re-reads plus its
  thinner parallelism (~8 MiB of L2 and ~250 KiB per program) cost about the launch it
  saves (~2.5 us); it is a guess to be set from bench/lora_kernels.py, which times both.
- tokens are not grouped by slot in either decode path: a decode batch's tokens are
  mostly of distinct sequences, and without a host sync the kernel cannot know whether a
  block of sorted tokens shares a slot; a program per token needs no order at all. Batches
  over DECODE_MAX_T get an order from the runner, once per step (sort_tokens_by_slot).
- rank-aware everywhere: every A/Bt load is masked to rows r < ranks[s] (masked-off rows
  are not fetched), so a rank-4 adapter moves a quarter of a rank-16 one's bytes. The fused
  kernel holds next_pow2(R) rows of h in registers (FUSED_MAX_R), so its compute is R-wide.
- CUDA graphs: the fused path allocates nothing; the split path allocates its workspace
  per call like the old h (stable inside a captured graph's memory pool); no host sync.

Two token mappings for the split and atomic paths, chosen per call:
- decode (order is None, T <= DECODE_MAX_T): one program per token, fp32 multiply-reduce,
  no sort needed; many programs (split-K on shrink) keep the GPU busy at T=1.
- prefill: BLOCK_T rows of `order` (token indices, normally `sort_tokens_by_slot`) per
  program, tensor-core dots; a program loops over the distinct slots among its rows, which
  sorting keeps to one or two. Any order is correct; sorting only saves work.
Tokens with slot -1 are never read or written (shrink leaves their h rows zero).
lora_shrink (and the atomic path) zero-fills h first: split-K programs add into it
atomically (so h is not bit-for-bit deterministic across runs) and padded ranks read back
as zero. The split path's partials have neither property, and need neither.

DoRA is an epilogue of expand: for a slot whose per-module `doras` flag is set, the program
loads the gain row g (float32) and stores g * (y - bias + s * acc) + bias instead of
y + s * acc. The flag is one scalar load per (program, slot); plain-LoRA slots take the old
branch, so they pay no extra memory traffic. Embedding LoRA reuses expand after a torch
gather of A's columns (`lora_embed`).
"""

import os

import torch
import torch.nn.functional as F

from metrale.ops.triton_utils import is_interpreted, jit_kernel, next_pow2, require_triton, tl

# Launch knobs: first guesses for an H200, to be tuned with bench/lora_kernels.py.
DECODE_MAX_T = 64  # above this many tokens (and no order given) use the prefill kernels
# split_k: shrink programs to aim for (split-K fills the GPU at small T); BLOCK_T (prefill)
# is an upper bound, see _config.
DECODE_CFG = dict(BLOCK_K=256, BLOCK_N=128, shrink_warps=4, expand_warps=2, split_k=1024)
PREFILL_CFG = dict(BLOCK_T=32, BLOCK_K=128, BLOCK_N=256, shrink_warps=4, expand_warps=4,
                   split_k=256)
# Which lora_apply_fused path runs (see the module docstring): "auto" (fused for decode
# batches of at most FUSED_MAX_T tokens and R <= FUSED_MAX_R, split otherwise), or one
# of PATHS for every call ("atomic" is the old memset + atomic split-K shrink + expand).
PATHS = ("fused", "split", "atomic")
# Measured on the H200 (bench/lora_kernels.py, 2026-12-01,
# bench/results/lora_kernels-20261201-040001.json, graph-replayed, Llama-3-8B groups):
# fused is slower than atomic at every shape (o T=1 8.1 vs 6.8 us, down T=1 20.3 vs 6.8:
# one program streaming a whole A is latency-bound); split beats atomic on q/k/v and o
# at T >= 32 (8.1 vs 8.7 us) but loses on down at T <= 8 (8.6 vs 6.8) and on gate/up at
# T = 32..64 (19.1 vs 17.4). So the default stays "atomic" until a per-group choice.
APPLY_PATH = "atomic"
FUSED_MAX_T = 8  # a guess from the byte/launch arithmetic above; tune with the bench
FUSED_MAX_R = 128  # the fused kernel holds all of h (next_pow2(R) floats) in registers
# programs: aim for about this many programs per launch (132 SMs on an H200);
# l2_bytes: cap on the A bytes re-read per launch (T * M * R * in * runs);
# tile_elems / k_tile_elems: elements of one [BLOCK_R, BLOCK_N] / [BLOCK_R, BLOCK_K]
# register tile (16 KiB of bf16 per K step at R=16: few, big steps, see the docstring);
# stages: loop iterations whose loads are in flight at once (tl.range's num_stages).
FUSED_CFG = dict(programs=132, l2_bytes=8 << 20, tile_elems=8192, k_tile_elems=8192,
                 max_block_k=1024, min_block_n=64, max_block_n=512, warps=8, stages=3)
# The per-module descriptor row (int64, 12 columns, numbered in the kernels):
# 0 a_off  1 a_slot_stride  2 a_row_stride  3 b_off  4 b_slot_stride  5 b_row_stride
# 6 out_dim  7 y_col  8 rank_off  9 rank_stride  10 scale_off  11 scale_stride
# 12 dora_off  13 dora_stride  14 gain_off  15 gain_slot_stride
_DESC_COLS = 16


def _shrink_kernel(
    x_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr,
    T, IN, R, x_stride, h_stride, split_stride, k_per_split,
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
            # split_stride 0: one h for all splits (atomics); else this split's partial rows
            h_ptrs = (h_ptr + pid_k * split_stride + tok[:, None] * h_stride + m * R
                      + r[None, :])  # [BT, BR]
            h_mask = sel[:, None] & r_ok[None, :]
            if ATOMIC:  # split-K: several programs add into the zero-filled h
                tl.atomic_add(h_ptrs, acc, mask=h_mask)
            else:
                tl.store(h_ptrs, acc, mask=h_mask)
        s = tl.min(tl.where(slot > s, slot, big))


def _expand_kernel(
    y_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr, scale_ptr,
    dora_ptr, gain_ptr, bias_ptr,
    T, R, y_stride, h_stride, n_split, split_stride,
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
                h_ptrs = h_ptr + tok[:, None] * h_stride + m * R + r[None, :]  # [BT, BR]
                h_mask = sel[:, None] & r_ok[None, :]
                ht = tl.load(h_ptrs, mask=h_mask, other=0.0)  # [BT, BR] fp32
                for sp in range(1, n_split):  # split-K partials, summed in a fixed order
                    ht += tl.load(h_ptrs + sp * split_stride, mask=h_mask, other=0.0)
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


def _fused_decode_kernel(
    x_ptr, y_ptr, a_pool_ptr, b_pool_ptr, slot_ptr, desc_ptr, rank_ptr, scale_ptr,
    dora_ptr, gain_ptr, bias_ptr,
    IN, R, x_stride, y_stride, n_per_prog,
    ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Shrink and expand of one token, one module, one run of n_per_prog output columns:
    h = x[t] @ A[s, :rank].T stays in registers (BLOCK_R >= R: every rank in one tile),
    then y[t, cols] gets s * h @ Bt[s, :rank, cols] (or the DoRA epilogue) chunk by chunk."""
    tok, pid_n, m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    d = desc_ptr + m * 16
    out_dim = tl.multiple_of(tl.load(d + 6), ALIGN)
    n_lo = pid_n * n_per_prog
    if n_lo >= out_dim:
        return  # the grid is sized for the widest module of the group
    s = tl.load(slot_ptr + tok).to(tl.int32)
    if s < 0:
        return  # base-model token: y untouched
    rank = tl.minimum(tl.load(rank_ptr + tl.load(d + 8) + s * tl.load(d + 9)), R)
    if rank <= 0:
        return  # module not targeted by this adapter (the DoRA epilogue is skipped too)
    a_slot = (a_pool_ptr + tl.multiple_of(tl.load(d + 0), ALIGN)
              + s.to(tl.int64) * tl.multiple_of(tl.load(d + 1), ALIGN))
    a_row_stride = tl.multiple_of(tl.load(d + 2), ALIGN)
    b_slot = (b_pool_ptr + tl.multiple_of(tl.load(d + 3), ALIGN)
              + s.to(tl.int64) * tl.multiple_of(tl.load(d + 4), ALIGN))
    b_row_stride = tl.multiple_of(tl.load(d + 5), ALIGN)
    y_col = tl.multiple_of(tl.load(d + 7), ALIGN)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank  # rows past the slot's rank are never loaded: bytes scale with rank
    offs_k, offs_n = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_N)
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    # one program streams all of A[s] alone: its loop is latency-bound unless the loads of
    # later iterations are in flight (STAGES) and each moves a big tile (BLOCK_K)
    for k0 in tl.range(0, IN, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        k_ok = k < IN
        xk = tl.load(x_ptr + tok * x_stride + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        a = tl.load(a_slot + r[:, None] * a_row_stride + k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BR, BK]
        h += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    scale = tl.load(scale_ptr + tl.load(d + 10) + s * tl.load(d + 11))
    is_dora = tl.load(dora_ptr + tl.load(d + 12) + s * tl.load(d + 13)) != 0
    gain_row = gain_ptr + tl.load(d + 14) + s.to(tl.int64) * tl.load(d + 15)
    y_row = y_ptr + tok * y_stride + y_col
    n_hi = tl.minimum(n_lo + n_per_prog, out_dim)  # n_per_prog is a multiple of BLOCK_N
    for n0 in tl.range(n_lo, n_hi, BLOCK_N, num_stages=STAGES):
        n = n0 + offs_n  # [BN]
        n_ok = n < out_dim
        bt = tl.load(b_slot + r[:, None] * b_row_stride + n[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BR, BN]
        acc = tl.sum(h[:, None] * bt.to(tl.float32), axis=0)  # [BN]
        y_old = tl.load(y_row + n, mask=n_ok, other=0.0).to(tl.float32)
        if is_dora:  # g * (x W^T + s * delta) + bias; y_old holds x W^T + bias
            g = tl.load(gain_row + n, mask=n_ok, other=1.0)  # [BN] float32
            if HAS_BIAS:
                b = tl.load(bias_ptr + y_col + n, mask=n_ok, other=0.0).to(tl.float32)
                y_new = g * (y_old - b + scale * acc) + b
            else:
                y_new = g * (y_old + scale * acc)
        else:
            y_new = y_old + scale * acc
        tl.store(y_row + n, y_new.to(y_ptr.dtype.element_ty), mask=n_ok)


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


def _split_k(T: int, IN: int, M: int, cfg: dict) -> tuple[int, int]:
    """(splits, k per split) of the shrink: enough programs to fill the GPU at small T."""
    n_kblk, t_blk = _cdiv(IN, cfg["BLOCK_K"]), _cdiv(T, cfg["BLOCK_T"])
    split = min(n_kblk, next_pow2(_cdiv(cfg["split_k"], t_blk * M)))
    k_per_split = _cdiv(n_kblk, split) * cfg["BLOCK_K"]
    return _cdiv(IN, k_per_split), k_per_split


def _workspace(x: torch.Tensor, As, order, *, partials: bool) -> torch.Tensor:
    """The shrink's output h for _shrink: [T, M*R] fp32, or with partials the split-K
    workspace [splits, T, M*R] (see _shrink)."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if not partials:
        return torch.empty(T, M * R, dtype=torch.float32, device=x.device)
    split, _ = _split_k(T, IN, M, _config(T, order is not None, R))
    return torch.empty(split, T, M * R, dtype=torch.float32, device=x.device)


def _shrink(x, As, slot_ids, ranks_list, order, h) -> torch.Tensor:
    """h[:, m*R:(m+1)*R] = x @ As[m][slot].T for every module m.

    h [T, M*R] fp32 (lora_shrink's contract): zero-filled here, split-K programs adding into
    it atomically (zeros for slot -1 and past the rank).
    h [splits, T, M*R] (`_workspace(partials=True)`): split k's sum over its share of `in`
    in h[k]; only rows r < rank of adapter tokens are written (expand reads nothing else),
    so there is no memset and no atomic: two launches, deterministic."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if x.stride(1) != 1 or any(a.shape[1:] != (R, IN) for a in As):
        raise ValueError("x must be [T, in] with unit last stride and every A [S, R, in]")
    cfg = _config(T, order is not None, R)
    split, k_per_split = _split_k(T, IN, M, cfg)
    if h.dim() == 3:
        if h.shape[0] != split:
            raise ValueError(f"partials need {split} splits, got {h.shape[0]}")
        split_stride, h_stride, atomic = h.stride(0), h.stride(1), False
    else:
        h.zero_()
        split_stride, h_stride, atomic = 0, h.stride(0), split > 1
    pool = _pool_base(As)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    desc = _descriptor(x.device, As, [None] * M, [0] * M, rank_fields, [(0, 0)] * M)
    kernel = jit_kernel(_shrink_kernel, x.device)
    kernel[(_cdiv(T, cfg["BLOCK_T"]), split, M)](
        x, pool, h, slot_ids, order if order is not None else slot_ids, desc, rank_base,
        T, IN, R, x.stride(0), h_stride, split_stride, k_per_split,
        ATOMIC=atomic, SORTED=order is not None, F32_DOT=_f32_dot(kernel, pool.dtype),
        ALIGN=_align(pool, [v for a in As for v in (a.storage_offset(), *a.stride()[:2])]),
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


def _check_out(y, Bts, y_cols) -> None:
    if y.stride(1) != 1:
        raise ValueError("y needs unit last stride")
    for b, col in zip(Bts, y_cols, strict=True):
        if col + b.shape[2] > y.shape[1]:
            raise ValueError(f"Bt {tuple(b.shape)} at column {col} does not fit y {tuple(y.shape)}")


def _expand_tables(y, Bts, ranks_list, scales_list, doras_list, gains_list):
    """(rank, scale, dora, gain) bases and their per-module descriptor fields."""
    M = len(Bts)
    rank_base, rank_fields = _tables(ranks_list, torch.int32)
    scale_base, scale_fields = _tables(scales_list, torch.float32)
    if doras_list is None:  # no DoRA anywhere: every flag reads a zero, no gain is read
        doras_list, gains_list = _no_dora(Bts[0].shape[0], y.device, M)
    for b, g in zip(Bts, gains_list, strict=True):
        if g.shape[0] != b.shape[0] or g.shape[1] < 1:
            raise ValueError(f"gains {tuple(g.shape)} do not match Bt {tuple(b.shape)}")
    dora_base, dora_fields = _tables(doras_list, torch.int32)
    gain_base, gain_fields = _gain_tables(gains_list, Bts[0].shape[0], y.device)
    return ((rank_base, scale_base, dora_base, gain_base),
            (rank_fields, scale_fields, dora_fields, gain_fields))


def _expand(y, h, Bts, y_cols, slot_ids, ranks_list, scales_list, order,
            doras_list=None, gains_list=None, bias=None) -> None:
    """y[:, y_cols[m]:+out_m] += scale * h[:, m*R:(m+1)*R] @ Bts[m][slot] for every module m
    (DoRA slots, flagged in doras_list: the gain epilogue, bias the one y already holds).
    h: [T, M*R], or [splits, T, M*R] split-K partials (`_workspace(partials=True)`), summed here."""
    T, M, R = y.shape[0], len(Bts), Bts[0].shape[1]
    if h.shape[-2:] != (T, M * R) or h.stride(-1) != 1 or h.dim() not in (2, 3):
        raise ValueError(f"h must be [(splits,) {T}, {M * R}] (got {tuple(h.shape)})")
    if any(b.shape[1] != R for b in Bts):
        raise ValueError("every Bt must be [S, R, out] with one R")
    _check_out(y, Bts, y_cols)
    n_split, split_stride = (h.shape[0], h.stride(0)) if h.dim() == 3 else (1, 0)
    pool = _pool_base(Bts)
    bases, fields = _expand_tables(y, Bts, ranks_list, scales_list, doras_list, gains_list)
    desc = _descriptor(y.device, [None] * M, Bts, y_cols, *fields)
    cfg = _config(T, order is not None, R)
    max_out = max(b.shape[2] for b in Bts)
    grid = (_cdiv(T, cfg["BLOCK_T"]), _cdiv(max_out, cfg["BLOCK_N"]), M)
    kernel = jit_kernel(_expand_kernel, y.device)
    kernel[grid](
        y, pool, h, slot_ids, order if order is not None else slot_ids, desc, *bases,
        bias if bias is not None else y,
        T, R, y.stride(0), h.stride(-2), n_split, split_stride,
        SORTED=order is not None, F32_DOT=_f32_dot(kernel, pool.dtype), HAS_BIAS=bias is not None,
        ALIGN=min(_align(pool, [v for b in Bts for v in (b.storage_offset(), *b.stride()[:2])]),
                  _align(y, [y.stride(0), *y_cols, *(b.shape[2] for b in Bts)])),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["expand_warps"],
    )


def _fused_config(T: int, IN: int, M: int, R: int, max_out: int, elt: int) -> dict:
    """Blocks and the output columns per program of the fused decode kernel (see the
    module docstring): about FUSED_CFG["programs"] programs in all, but no more re-reads
    of A than FUSED_CFG["l2_bytes"] allows, and at least one column run per token."""
    c = FUSED_CFG
    block_r = next_pow2(max(R, 1))
    block_k = max(16, min(c["max_block_k"], c["k_tile_elems"] // block_r))
    a_bytes = T * M * R * IN * elt  # every (token, module) reads its A once per column run
    runs = max(1, min(c["programs"] // (T * M), c["l2_bytes"] // max(a_bytes, 1)))
    cols = _cdiv(max_out, runs)
    block_n = max(c["min_block_n"], min(c["max_block_n"], c["tile_elems"] // block_r,
                                        next_pow2(cols)))
    n_per_prog = _cdiv(cols, block_n) * block_n
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, n_per_prog=n_per_prog,
                grid_n=_cdiv(max_out, n_per_prog))


def _fused(y, x, As, Bts, y_cols, slot_ids, ranks_list, scales_list, doras_list=None,
           gains_list=None, bias=None) -> None:
    """lora_apply_fused in ONE launch, one program per (token, column run, module): the
    program recomputes its token's h from A, no h in memory, no sort, no memset."""
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if x.stride(1) != 1 or any(a.shape[1:] != (R, IN) for a in As):
        raise ValueError("x must be [T, in] with unit last stride and every A [S, R, in]")
    if any(b.shape[1] != R for b in Bts):
        raise ValueError("every Bt must be [S, R, out] with the R of A")
    _check_out(y, Bts, y_cols)
    a_pool, b_pool = _pool_base(As), _pool_base(Bts)
    bases, fields = _expand_tables(y, Bts, ranks_list, scales_list, doras_list, gains_list)
    desc = _descriptor(y.device, As, Bts, y_cols, *fields)
    max_out = max(b.shape[2] for b in Bts)
    cfg = _fused_config(T, IN, M, R, max_out, a_pool.element_size())
    kernel = jit_kernel(_fused_decode_kernel, y.device)
    kernel[(T, cfg["grid_n"], M)](
        x, y, a_pool, b_pool, slot_ids, desc, *bases, bias if bias is not None else y,
        IN, R, x.stride(0), y.stride(0), cfg["n_per_prog"],
        ALIGN=min(_align(a_pool, [v for a in As for v in (a.storage_offset(), *a.stride()[:2])]),
                  _align(b_pool, [v for b in Bts for v in (b.storage_offset(), *b.stride()[:2])]),
                  _align(y, [y.stride(0), *y_cols, *(b.shape[2] for b in Bts)])),
        HAS_BIAS=bias is not None, STAGES=FUSED_CFG["stages"],
        BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=FUSED_CFG["warps"],
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


def choose_path(T: int, R: int, order: torch.Tensor | None) -> str:
    """APPLY_PATH, with "auto" resolved: fused for small decode batches (no order given:
    the caller did not sort, so this is not a prefill), split otherwise."""
    if APPLY_PATH != "auto":
        return APPLY_PATH
    if order is None and T <= FUSED_MAX_T and R <= FUSED_MAX_R:
        return "fused"
    return "split"


def _y_cols(out_slices, Bts, width: int) -> list[int]:
    """The first column of each module's slice of y, checked against its Bt's width."""
    cols = []
    for sl, b in zip(out_slices, Bts, strict=True):
        start, stop, step = sl.indices(width)
        if step != 1 or stop - start != b.shape[2]:
            raise ValueError(f"out slice {sl} does not match Bt width {b.shape[2]}")
        cols.append(start)
    return cols


def lora_apply_fused(
    y: torch.Tensor, x: torch.Tensor, As, Bts, out_slices, slot_ids: torch.Tensor,
    scales_list, ranks_list, *, order: torch.Tensor | None = None,
    doras_list=None, gains_list=None, bias: torch.Tensor | None = None,
    path: str | None = None,
) -> None:
    """lora_apply_fused_ref's semantics: modules sharing x (q/k/v, gate/up) add into slices of y.

    One launch for the whole group ("fused"), or two ("split"; "atomic": the old three,
    memset included, kept to compare); path None picks by `choose_path`. No host sync: a
    batch with no adapter token still launches, and every program exits after reading its
    slot ids. order (from `sort_tokens_by_slot`, once per batch) is unused by "fused".
    """
    require_triton()
    T, M = x.shape[0], len(As)
    if not (len(Bts) == len(out_slices) == len(scales_list) == len(ranks_list) == M):
        raise ValueError("As, Bts, out_slices, scales_list and ranks_list need one entry per module")
    y_cols = _y_cols(out_slices, Bts, y.shape[1])
    if T == 0:
        return
    R = As[0].shape[1]
    path = path or choose_path(T, R, order)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    doras_list = None if doras_list is None else list(doras_list)
    gains_list = None if gains_list is None else list(gains_list)
    if path == "fused":
        _fused(y, x, list(As), list(Bts), y_cols, slot_ids, list(ranks_list),
               list(scales_list), doras_list, gains_list, bias)
        return
    order = _order_for(slot_ids, order)
    h = _workspace(x, As, order, partials=path == "split")
    _shrink(x, list(As), slot_ids, list(ranks_list), order, h)
    _expand(y, h, list(Bts), y_cols, slot_ids, list(ranks_list), list(scales_list), order,
            doras_list, gains_list, bias)


# The shrink reads only x, so on CUDA it can run beside the base GEMM (which reads x too)
# on a second stream; only the expand must wait for the GEMM's y. At decode batch sizes a
# group's LoRA is launch-bound (issue #15: ~2.5 us per dependent kernel in a graph, memset
# and shrink two of the three), so overlapping hides the shrink's launches behind the GEMM.
# CUDA graphs capture the fork and join. METRALE_LORA_OVERLAP=0 keeps one stream (to compare).
OVERLAP = os.environ.get("METRALE_LORA_OVERLAP", "1") != "0"
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    key = str(device)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[key]


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, As, Bts, out_slices,
    slot_ids: torch.Tensor, scales_list, ranks_list, *, order: torch.Tensor | None = None,
    doras_list=None, gains_list=None, path: str | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) followed by lora_apply_fused(y, x, ...): the same result.
    On CUDA with OVERLAP, the split/atomic paths run their shrink on a side stream while
    the GEMM runs on the current stream, and the expand after both."""
    T, R = x.shape[0], As[0].shape[1]
    path = path or choose_path(T, R, order)
    if path == "fused" or T == 0 or not (OVERLAP and x.is_cuda):
        y = F.linear(x, weight, bias)  # [T, out]
        lora_apply_fused(y, x, As, Bts, out_slices, slot_ids, scales_list, ranks_list,
                         order=order, doras_list=doras_list, gains_list=gains_list, bias=bias,
                         path=path)
        return y
    require_triton()
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    y_cols = _y_cols(out_slices, Bts, weight.shape[0])
    order = _order_for(slot_ids, order)
    # allocated on the current stream and freed there after the expand, which runs after
    # the join: no other work can be handed this memory while the side stream writes it
    h = _workspace(x, As, order, partials=path == "split")
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)  # x, slot_ids and order are written on the current stream
    with torch.cuda.stream(side):
        _shrink(x, list(As), slot_ids, list(ranks_list), order, h)
    y = F.linear(x, weight, bias)  # [T, out]
    main.wait_stream(side)
    _expand(y, h, list(Bts), y_cols, slot_ids, list(ranks_list), list(scales_list), order,
            None if doras_list is None else list(doras_list),
            None if gains_list is None else list(gains_list), bias)
    return y
