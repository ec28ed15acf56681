"""The one-launch LoRA decode kernel ("fused"), kept here to time against the engine's
paths (bench/lora_kernels.py): measured slower than them at every shape on the H200
(bench/results/lora_kernels-20261201-040001.json: down at T=1 20.3 us against 6.8; one
program streaming a whole A[s] is latency-bound), so the engine does not run it.

One program per (token, run of output columns, module) recomputes its token's
h = x @ A[s, :rank].T into registers (no h in memory, no memset, no atomics, no sort), then
adds s * h @ Bt[s, :rank, run] to y. Its price is the re-reads of A: every program reads
its token's A again (rank * in * 2 bytes), so fused_config aims at about
FUSED_CFG["programs"] programs (one per SM) but caps the A re-reads at
FUSED_CFG["l2_bytes"]; as T grows the runs per token shrink. Decode batches only (no
order: one program per token), R <= FUSED_MAX_R (h is next_pow2(R) floats in registers).
"""

from __future__ import annotations

from metrale.ops import lora_launch as launch
from metrale.ops.triton_utils import jit_kernel, next_pow2, require_triton, tl

FUSED_MAX_R = 128
# programs: aim for about this many programs per launch (132 SMs on an H200);
# l2_bytes: cap on the A bytes re-read per launch (T * M * R * in * runs);
# tile_elems / k_tile_elems: elements of one [BLOCK_R, BLOCK_N] / [BLOCK_R, BLOCK_K]
# register tile (16 KiB of bf16 per K step at R=16: few, big steps);
# stages: loop iterations whose loads are in flight at once (tl.range's num_stages).
FUSED_CFG = dict(programs=132, l2_bytes=8 << 20, tile_elems=8192, k_tile_elems=8192,
                 max_block_k=1024, min_block_n=64, max_block_n=512, warps=8, stages=3)


def fused_decode_kernel(
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


def fused_config(T: int, IN: int, M: int, R: int, max_out: int, elt: int) -> dict:
    """Blocks and the output columns per program of the fused decode kernel: about
    FUSED_CFG["programs"] programs in all, but no more re-reads of A than
    FUSED_CFG["l2_bytes"] allows, and at least one column run per token."""
    c = FUSED_CFG
    block_r = next_pow2(max(R, 1))
    block_k = max(16, min(c["max_block_k"], c["k_tile_elems"] // block_r))
    a_bytes = T * M * R * IN * elt  # every (token, module) reads its A once per column run
    runs = max(1, min(c["programs"] // (T * M), c["l2_bytes"] // max(a_bytes, 1)))
    cols = launch.cdiv(max_out, runs)
    block_n = max(c["min_block_n"], min(c["max_block_n"], c["tile_elems"] // block_r,
                                        next_pow2(cols)))
    n_per_prog = launch.cdiv(cols, block_n) * block_n
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, n_per_prog=n_per_prog,
                grid_n=launch.cdiv(max_out, n_per_prog))


def apply_fused(y, x, As, Bts, out_slices, slot_ids, scales_list, ranks_list, *,
                doras_list=None, gains_list=None, bias=None) -> None:
    """lora_triton.lora_apply_fused's result in ONE launch (decode batches: no order)."""
    require_triton()
    T, IN = x.shape
    M, R = len(As), As[0].shape[1]
    if x.stride(1) != 1 or any(a.shape[1:] != (R, IN) for a in As):
        raise ValueError("x must be [T, in] with unit last stride and every A [S, R, in]")
    if any(b.shape[1] != R for b in Bts) or R > FUSED_MAX_R:
        raise ValueError(f"every Bt must be [S, R, out] with the R of A, R <= {FUSED_MAX_R}")
    cols = launch.y_cols(out_slices, Bts, y.shape[1])
    launch.check_out(y, Bts, cols)
    if T == 0:
        return
    a_pool, b_pool = launch.pool_base(As), launch.pool_base(Bts)
    bases, fields = launch.expand_tables(y, Bts, list(ranks_list), list(scales_list),
                                         None if doras_list is None else list(doras_list),
                                         None if gains_list is None else list(gains_list))
    desc = launch.descriptor(y.device, As, Bts, cols, *fields)
    max_out = max(b.shape[2] for b in Bts)
    cfg = fused_config(T, IN, M, R, max_out, a_pool.element_size())
    kernel = jit_kernel(fused_decode_kernel, y.device)
    kernel[(T, cfg["grid_n"], M)](
        x, y, a_pool, b_pool, slot_ids, desc, *bases, bias if bias is not None else y,
        IN, R, x.stride(0), y.stride(0), cfg["n_per_prog"],
        ALIGN=min(launch.pool_align(a_pool, As), launch.pool_align(b_pool, Bts),
                  launch.out_align(y, Bts, cols)),
        HAS_BIAS=bias is not None, STAGES=FUSED_CFG["stages"],
        BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
        num_warps=FUSED_CFG["warps"],
    )
