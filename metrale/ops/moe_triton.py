"""Routed experts without a host sync, so a MoE step fits in a CUDA graph: the (token,
top-k) pairs sorted by expert into blocks of BLOCK_M rows (one single-program launch), one
grouped GEMM launch per projection reading each routed expert's weights once per block, and
expert LoRA as a per-pair shrink launch whose expand the grouped GEMM adds in its epilogue
(one tl.dot where a block's pairs share an adapter, a gather of each pair's B rows where
they don't).

A pair p is token p // top_k's k-th pick (p = token * top_k + k), so per-pair outputs
[P, N] view as [T, top_k, N]. The *_ref functions beside each kernel are their oracles.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from metrale.ops.triton_utils import device_function, is_interpreted, jit_kernel, next_pow2, tl, triton


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs of one routing sorted into single-expert blocks of block_m rows."""

    pairs: torch.Tensor  # [n_blocks * block_m] int32: pair ids, n_pairs where padding
    block_expert: torch.Tensor  # [n_blocks] int32: each block's expert
    used_rows: torch.Tensor  # [1] int32: rows of `pairs` in blocks that hold pairs
    experts: torch.Tensor  # [P] int32: each pair's expert
    n_pairs: int
    block_m: int


@dataclass(frozen=True)
class MoeGemmConfig:
    # bench/moe_gemm.py --sweep (H200, Qwen3-30B-A3B shapes): in the top five at 32 and
    # 256 tokens for both projections, the best at 1 token for gate_up
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("block_n", "block_k"), least=16)


def _check_powers_of_two(config, names: tuple[str, ...], least: int) -> None:
    """Each named field of config a power of two >= least; least 0 also allows 0 (auto)."""
    for name in names:
        v = getattr(config, name)
        if not (least == 0 and v == 0) and (v < max(least, 1) or v & (v - 1)):
            rule = "0 or a power of two" if least == 0 else f"a power of two >= {least}"
            raise ValueError(f"{name} must be {rule}, got {v}")


def block_m_for(n_pairs: int) -> int:
    """Rows per block: 16 (tl.dot's least) while few pairs share an expert, 64 past that."""
    return 16 if n_pairs <= 1024 else 64


def route_blocks_ref(experts: torch.Tensor, num_experts: int,
                     counts: torch.Tensor | None = None) -> ExpertBlocks:
    """experts: [T, top_k] each token's picks -> their pairs in expert order (pair order
    within an expert), padded per expert to whole blocks. Every size is fixed by T, top_k
    and num_experts: at most cdiv(P, block_m) + min(E, P) blocks hold pairs, the rest are
    skipped by the kernels. counts: an [E] int32 buffer to count each expert's pairs into
    (else a new one). Torch ops on the device, ~15 launches: route_blocks's oracle."""
    flat = experts.reshape(-1)  # [P]
    P, E = flat.numel(), num_experts
    bm = block_m_for(P)
    counts = _counts_buffer(counts, E, flat.device)
    counts.zero_().scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    padded = (counts + bm - 1) // bm * bm  # [E]
    ends = torch.cumsum(padded, 0, dtype=torch.int32)  # [E] block-row end of each expert
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert, in pair order within one
    by_expert = flat[order]
    first = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # [E] expert's first sorted index
    rank = torch.arange(P, device=flat.device, dtype=torch.int32) - first[by_expert]
    dest = (ends - padded)[by_expert] + rank  # [P] row of each sorted pair
    n_blocks = _n_blocks(P, E, bm)
    pairs = torch.full((n_blocks * bm,), P, dtype=torch.int32, device=flat.device)
    pairs[dest] = order.to(torch.int32)
    starts = torch.arange(n_blocks, device=flat.device, dtype=torch.int32) * bm
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=E - 1).to(torch.int32)
    return ExpertBlocks(pairs, block_expert, ends[-1:], flat.to(torch.int32), P, bm)


def _n_blocks(n_pairs: int, num_experts: int, block_m: int) -> int:
    return -(-n_pairs // block_m) + min(num_experts, n_pairs)


def _counts_buffer(counts: torch.Tensor | None, num_experts: int, device) -> torch.Tensor:
    if counts is None:
        return torch.zeros(num_experts, dtype=torch.int32, device=device)
    if counts.shape != (num_experts,) or counts.dtype != torch.int32:
        raise ValueError(f"counts must be [{num_experts}] int32, got {tuple(counts.shape)} {counts.dtype}")
    return counts


def _route_kernel(experts_ptr, experts32_ptr, counts_ptr, pairs_ptr, block_expert_ptr, used_ptr,
                  P, E, n_rows, n_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """One program: count the pairs per expert, place each pair at its expert's block rows
    plus the pairs of that expert before it (a running one-hot prefix sum over chunks)."""
    lanes = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ex = tl.load(experts_ptr + p, mask=p < P, other=-1).to(tl.int32)
        tl.store(experts32_ptr + p, ex, mask=p < P)
        counts += tl.sum((ex[:, None] == lanes[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BE]
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(counts_ptr + lanes, counts, mask=lanes < E)
    tl.store(used_ptr, tl.sum(padded, axis=0))
    for r0 in range(0, n_rows, BLOCK_P):
        r = r0 + tl.arange(0, BLOCK_P)
        tl.store(pairs_ptr + r, P, mask=r < n_rows)  # padding, overwritten below where a pair lands
    tl.debug_barrier()  # the padding stores land before the pairs'
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ex = tl.load(experts_ptr + p, mask=p < P, other=-1).to(tl.int32)
        hot = (ex[:, None] == lanes[None, :]).to(tl.int32)  # [BP, BE]
        before = tl.cumsum(hot, axis=0) - hot + seen[None, :]  # same-expert pairs before p
        dest = tl.sum(hot * (before + starts[None, :]), axis=1)  # [BP]
        tl.store(pairs_ptr + dest, p, mask=p < P)
        seen += tl.sum(hot, axis=0)
    for b0 in range(0, n_blocks, BLOCK_P):
        b = b0 + tl.arange(0, BLOCK_P)
        past = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (lanes < E)[None, :]  # [BP, BE]
        expert = tl.minimum(tl.sum(past.to(tl.int32), axis=1), E - 1)
        tl.store(block_expert_ptr + b, expert, mask=b < n_blocks)


def route_blocks(experts: torch.Tensor, num_experts: int,
                 counts: torch.Tensor | None = None) -> ExpertBlocks:
    """route_blocks_ref's blocks in one launch (a single program: P is a batch's pairs)."""
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    P, E = flat.numel(), num_experts
    bm = block_m_for(P)
    n_blocks = _n_blocks(P, E, bm)
    counts = _counts_buffer(counts, E, flat.device)
    experts32 = torch.empty(P, dtype=torch.int32, device=flat.device)
    pairs = torch.empty(n_blocks * bm, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=flat.device)
    used = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e = max(16, next_pow2(E))
    kernel = jit_kernel(_route_kernel, flat.device)
    kernel[(1,)](flat, experts32, counts, pairs, block_expert, used, P, E, n_blocks * bm,
                 n_blocks, BLOCK_M=bm, BLOCK_E=block_e, BLOCK_P=max(16, min(256, 8192 // block_e)),
                 num_warps=8)
    return ExpertBlocks(pairs, block_expert, used, experts32, P, bm)


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                     rows_div: int) -> torch.Tensor:
    """out[p] = x[p // rows_div] @ w[experts[p]]^T in fp32, rounded to x's dtype.
    x: [R, K], w: [E, N, K], experts: [P] -> [P, N]."""
    out = torch.empty(experts.numel(), w.shape[1], dtype=x.dtype, device=x.device)
    rows = torch.arange(experts.numel(), device=x.device) // rows_div
    for e in torch.unique(experts).tolist():
        hit = experts == e
        out[hit] = (x[rows[hit]].float() @ w[e].float().T).to(x.dtype)
    return out


def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, used_ptr,
                         h_ptr, bt_ptr, slot_ptr, rank_ptr, scale_ptr,
                         N, K, n_pairs, E, x_st, w_st_e, w_st_n, out_st,
                         h_st_k, h_st, b_st_s, b_st_r, rank_st, scale_st,
                         ROWS_DIV: tl.constexpr, TOP_K: tl.constexpr, F32_DOT: tl.constexpr,
                         LORA: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return  # a block past the routed pairs
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < n_pairs
    rows = (pairs // ROWS_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LORA:  # the LoRA's loads go out before the weight stream and are used after it
        h, bt, scales, ranks, safe, h_rows, lo, hi = _lora_prefetch(
            h_ptr, bt_ptr, slot_ptr, rank_ptr, scale_ptr, pairs, valid, e, n, N, E, h_st_k,
            h_st, b_st_s, b_st_r, rank_st, scale_st, TOP_K, R, SPLIT, BLOCK_M)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * x_st + k[None, :],
                    mask=valid[:, None] & (k < K)[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_ptr + e * w_st_e + n[None, :].to(tl.int64) * w_st_n + k[:, None],
                    mask=(n < N)[None, :] & (k < K)[:, None], other=0.0)  # [BK, BN]
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if LORA:
        acc += _lora_delta(h, bt, scales, ranks, safe, h_rows, lo, hi, bt_ptr, e, n, N, E,
                           h_st_k, b_st_s, b_st_r, F32_DOT, SPLIT, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * out_st + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


@device_function
def _lora_prefetch(h_ptr, bt_ptr, slot_ptr, rank_ptr, scale_ptr, pairs, valid, e, n, N, E,
                   h_st_k, h_st, b_st_s, b_st_r, rank_st, scale_st, TOP_K: tl.constexpr,
                   R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The block's pairs' slots, ranks and scales, and where the block's pairs share one
    adapter (lo == hi) its shrink partials summed, h [BM, R], and B_{s,e}^T [R, BN] (else
    masked to zeros). Per-pair values are [BM, 1] columns: as [BM] vectors triton 3.6
    gives them clashing layouts."""
    rows = pairs[:, None]  # [BM, 1]
    live = valid[:, None]
    slots = tl.load(slot_ptr + rows // TOP_K, mask=live, other=-1).to(tl.int32)  # [BM, 1]
    on = live & (slots >= 0)
    safe = tl.maximum(slots, 0)
    ranks = tl.load(rank_ptr + safe * rank_st, mask=on, other=0)
    ranks = tl.where(on, ranks, 0)  # [BM, 1]: 0 where nothing is added
    scales = tl.load(scale_ptr + safe * scale_st, mask=on, other=0.0)  # [BM, 1]
    lo = tl.min(tl.where(live, slots, 1 << 30))
    hi = tl.max(tl.where(live, slots, -1))
    shared = tl.where(lo == hi, tl.max(ranks), 0)  # the one adapter's rank, else 0
    j = tl.arange(0, R)
    h_rows = h_ptr + rows.to(tl.int64) * h_st  # [BM, 1]
    h = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for ks in tl.static_range(SPLIT):
        h += tl.load(h_rows + ks * h_st_k + j[None, :],  # padding rows (rank 0) unread
                     mask=j[None, :] < tl.minimum(ranks, shared), other=0.0)
    bt = tl.load(bt_ptr + tl.maximum(lo, 0).to(tl.int64) * b_st_s
                 + (j * E + e).to(tl.int64)[:, None] * b_st_r + n[None, :],
                 mask=(j < shared)[:, None] & (n < N)[None, :], other=0.0)  # [R, BN]
    return h, bt, scales, ranks, safe, h_rows, lo, hi


@device_function
def _lora_delta(h, bt, scales, ranks, safe, h_rows, lo, hi, bt_ptr, e, n, N, E, h_st_k,
                b_st_s, b_st_r, F32_DOT: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, BN] fp32: scale_s * h_p B_{s,e} for the block's pairs p (expert e), from
    _lora_prefetch's; 0 for pairs without an adapter (slot -1 or rank 0)."""
    RANKS_AT_ONCE: tl.constexpr = 4  # the gather's loads in flight: [BM, 4, BN] a step
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if lo == hi:  # one adapter (or none) for the whole block: one dot over its B_{s,e}
        if tl.max(ranks) > 0:
            if F32_DOT:
                out = tl.dot(h, bt.to(tl.float32), input_precision="ieee") * scales
            else:
                out = tl.dot(h, bt.to(tl.float32), input_precision="tf32") * scales
    else:  # adapters differ by row: RANKS_AT_ONCE ranks a step, each row's B_{s,e} gathered
        c = tl.arange(0, RANKS_AT_ONCE)[None, :, None]  # [1, RC, 1]
        ranks3, h3 = ranks[:, :, None], h_rows[:, :, None]  # [BM, 1, 1]
        b_rows = (bt_ptr + safe.to(tl.int64)[:, :, None] * b_st_s
                  + n[None, None, :])  # [BM, 1, BN]
        for j0 in range(0, tl.max(ranks), RANKS_AT_ONCE):
            hot = j0 + c < ranks3  # [BM, RC, 1]
            hc = tl.zeros((BLOCK_M, RANKS_AT_ONCE, 1), dtype=tl.float32)
            for ks in tl.static_range(SPLIT):
                hc += tl.load(h3 + ks * h_st_k + j0 + c, mask=hot, other=0.0)
            btc = tl.load(b_rows + ((j0 + c) * E + e) * b_st_r,
                          mask=hot & (n < N)[None, None, :], other=0.0)  # [BM, RC, BN]
            out += tl.sum(hc * btc.to(tl.float32), axis=1)
        out = out * scales
    return out


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, blocks: ExpertBlocks, rows_div: int,
                 config: MoeGemmConfig | None = None,
                 lora: ExpertLoraDelta | None = None) -> torch.Tensor:
    """grouped_gemm_ref's out through one launch: x [R, K] (row p // rows_div per pair),
    w [E, N, K] -> [P, N]; each block of pairs reads its expert's weights once. With lora
    (expert_shrink's), each pair's LoRA delta is added before the one rounding to x's dtype."""
    E, N, K = w.shape
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_gemm needs unit-stride rows in x and w")
    out = torch.empty(blocks.n_pairs, N, dtype=x.dtype, device=x.device)
    kernel = jit_kernel(_grouped_gemm_kernel, x.device)
    f32_dot = x.dtype == torch.float32 or is_interpreted(kernel)
    c = config or (MoeGemmConfig(64, 32, 4, 3) if f32_dot else MoeGemmConfig())
    grid = (blocks.block_expert.numel(), triton.cdiv(N, c.block_n))
    if lora is not None:
        m = lora.lora
        if m.bt.shape[2] != N or m.num_experts != E or m.bt.stride(2) != 1:
            raise ValueError(f"LoRA B^T {tuple(m.bt.shape)} does not fit {E} experts of {N} outputs")
        tabs = (lora.h, m.bt, lora.slot_ids, m.ranks, m.scales)
        strides = (lora.h.stride(0), lora.h.stride(1), m.bt.stride(0), m.bt.stride(1),
                   m.ranks.stride(0), m.scales.stride(0))
        shape = dict(TOP_K=max(1, blocks.n_pairs // max(1, lora.slot_ids.numel())), R=lora.h.shape[2],
                     SPLIT=lora.h.shape[0])
    else:  # unread: LORA is off
        tabs, strides, shape = (out,) * 5, (0,) * 6, dict(TOP_K=1, R=16, SPLIT=1)
    kernel[grid](x, w, out, blocks.pairs, blocks.block_expert, blocks.used_rows, *tabs, N, K,
                 blocks.n_pairs, E, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                 *strides, ROWS_DIV=rows_div, F32_DOT=f32_dot, LORA=lora is not None, **shape,
                 BLOCK_M=blocks.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                 num_warps=c.num_warps, num_stages=c.num_stages)
    return out


@dataclass(frozen=True)
class ExpertLora:
    """One expert module's LoRA for a layer, as the pool holds it: slot s's rank r_s factors
    stacked per expert (PEFT's ParamWrapper layout), A [S, R * E, in] with expert e's rows
    at e * r_s, B^T [S, R * E, out] with rank row j of expert e at j * E + e."""

    a: torch.Tensor  # [S, R * E, in]
    bt: torch.Tensor  # [S, R * E, out]
    ranks: torch.Tensor  # [S] int32 (0: no LoRA on this module)
    scales: torch.Tensor  # [S] float32
    num_experts: int
    max_rank: int


def expert_lora_ref(y: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor,
                    experts: torch.Tensor, lora: ExpertLora, rows_div: int) -> None:
    """y[p] += scale_s * (x[p // rows_div] A_{s,e}^T) B_{s,e} in fp32 for each pair p of
    y [P, out], with s = slot_ids[p // top_k] (slot_ids [T], -1: none), e = experts[p]."""
    E, top_k = lora.num_experts, experts.numel() // slot_ids.numel()
    for p in range(y.shape[0]):
        s, e = int(slot_ids[p // top_k]), int(experts[p])
        r = int(lora.ranks[s]) if s >= 0 else 0
        if r == 0:
            continue
        a = lora.a[s, e * r:(e + 1) * r].float()  # [r, in]
        bt = lora.bt[s, torch.arange(r, device=y.device) * E + e].float()  # [r, out]
        d = (x[p // rows_div].float() @ a.T) @ bt * float(lora.scales[s])
        y[p] = (y[p].float() + d).to(y.dtype)


def _expert_shrink_kernel(x_ptr, a_ptr, h_ptr, slot_ptr, expert_ptr, rank_ptr, K, K_PER, x_st,
                          a_st_s, a_st_r, h_st_k, h_st, rank_st, TOP_K: tl.constexpr,
                          ROWS_DIV: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[ks, p] = x[p // ROWS_DIV] A_{s,e}^T over split ks's K_PER columns."""
    p, ks = tl.program_id(0), tl.program_id(1)
    s = tl.load(slot_ptr + p // TOP_K).to(tl.int32)
    r = tl.load(rank_ptr + tl.maximum(s, 0) * rank_st)
    if (s < 0) | (r == 0):
        return  # the GEMM's epilogue skips this pair too
    e = tl.load(expert_ptr + p)
    j = tl.arange(0, R)
    a_rows = a_ptr + s.to(tl.int64) * a_st_s + (e * r + j).to(tl.int64)[:, None] * a_st_r
    x_row = x_ptr + (p // ROWS_DIV).to(tl.int64) * x_st
    acc = tl.zeros((R,), dtype=tl.float32)
    for k0 in range(ks * K_PER, tl.minimum(K, (ks + 1) * K_PER), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)  # [BK]
        a = tl.load(a_rows + k[None, :], mask=(j < r)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)  # [R, BK]
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + ks * h_st_k + p.to(tl.int64) * h_st + j, acc)  # 0 past the rank


@dataclass(frozen=True)
class ExpertLoraConfig:
    split_k: int = 0  # K splits of the shrink (a power of two); 0: enough for ~512 programs
    shrink_block_k: int = 0  # 0: a split's columns in one load, up to 32K elements of A
    shrink_warps: int = 8

    def __post_init__(self) -> None:
        _check_powers_of_two(self, ("split_k", "shrink_block_k"), least=0)


@dataclass(frozen=True)
class ExpertLoraDelta:
    """An expert module's LoRA for grouped_gemm to add: the shrink's partial sums and the
    factors it expands them through."""

    h: torch.Tensor  # [splits, P, R] float32: x A_{s,e}^T by K split (R >= 16: tl.dot's least)
    lora: ExpertLora
    slot_ids: torch.Tensor  # [T]


def expert_shrink(x: torch.Tensor, slot_ids: torch.Tensor, experts: torch.Tensor,
                  lora: ExpertLora, rows_div: int, config: ExpertLoraConfig | None = None,
                  stream: torch.cuda.Stream | None = None) -> ExpertLoraDelta:
    """The first half of expert_lora_ref, a program per pair and K split (partial sums per
    split, no atomics): x [rows, in], slot_ids [T] (-1: none), experts [P] (int32 or int64)
    -> the delta grouped_gemm(..., lora=) adds to y [P, out]. stream: launch there, after
    the current stream's work so far (its output allocated on the current stream, which
    must wait for `stream` before reading it)."""
    P, K = experts.numel(), x.shape[1]
    top_k = P // max(1, slot_ids.numel())
    for t, name in ((x, "x"), (lora.a, "A")):
        if t.stride(-1) != 1:
            raise ValueError(f"expert_shrink needs unit-stride rows in {name}")
    c = config or ExpertLoraConfig()
    R = max(16, next_pow2(lora.max_rank))
    split = c.split_k or min(next_pow2(-(-512 // max(P, 1))), max(1, next_pow2(K) // 256))
    per_split = -(-K // split)
    block_k = c.shrink_block_k or min(next_pow2(per_split), max(64, 32768 // R))
    k_per = -(-per_split // block_k) * block_k  # whole BLOCK_K tiles per split
    h = torch.empty(split, P, R, dtype=torch.float32, device=x.device)
    if not P:
        return ExpertLoraDelta(h, lora, slot_ids)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        shrink = jit_kernel(_expert_shrink_kernel, x.device)
        shrink[(P, split)](x, lora.a, h, slot_ids, experts, lora.ranks, K, k_per, x.stride(0),
                           lora.a.stride(0), lora.a.stride(1), h.stride(0), h.stride(1),
                           lora.ranks.stride(0), TOP_K=top_k, ROWS_DIV=rows_div, R=R,
                           BLOCK_K=block_k, num_warps=c.shrink_warps)
    return ExpertLoraDelta(h, lora, slot_ids)
