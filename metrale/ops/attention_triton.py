"""Triton paged attention over the block KV cache (paged_attention_ref's semantics).

- decode: a program serves one (sequence, KV head, split) and all the query heads of that
  KV head (GQA: K/V read once per group). Split-K (flash-decoding): each split writes its
  running max, sum and unnormalised output, a second kernel merges them. Splits depend on
  shapes only and lengths and tables are read from device memory: graph-capturable.
- varlen (prefill chunks, mixed steps): the grid is a tile list (BLOCK_M queries of one
  sequence) x KV heads x key splits, merged as in decode (a 96-query chunk over 8k keys is
  2 tiles per head without splits). A fixed-length tile list (prefill_tiles; tiles past the
  step's exit at once) makes a mixed step capturable.

Block table entries past a sequence's context are never read.
"""

from __future__ import annotations

import functools

import torch

from metrale.ops.triton_utils import (
    device_function,
    is_interpreted,
    jit_kernel,
    next_pow2,
    require_triton,
    tl,
)

DECODE_BLOCK_N = 64  # keys per tile
PREFILL_BLOCK_M, PREFILL_BLOCK_N = 64, 64
MIN_SPLIT_TOKENS = 256  # never split a context into slices shorter than this
# Table capacity per decode split at most: one program walking a whole long context made a
# decode step with one 8k sequence among 33 take 5.4 ms against 2 ms (its keys run serially).
DECODE_SPLIT_CAPACITY = 1024
DECODE_WAVES = 2  # programs for this many waves of the SMs, split if need be
MIN_SPLIT_PREFILL = 512  # varlen: keys per split, at least
MAX_PREFILL_SPLITS = 16


@device_function
def _attend_tile(
    q, k_ptr, v_ptr, tab_row, t, t_ok, visible, head_off, c_sb, c_st, d, d_ok, scale,
    softcap, m_i, l_i, acc, BLOCK_SIZE: tl.constexpr, F32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Keys t ([BN], t_ok those in the split) of block table row tab_row into the online
    softmax of the query rows q ([rows, D_PAD]); visible: [rows, BN] or [1, BN]. SOFTCAP:
    scores become softcap * tanh(scores / softcap) (Gemma 2), tanh from exp."""
    blk = tl.load(tab_row + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
    row = blk * c_sb + (t % BLOCK_SIZE).to(tl.int64) * c_st + head_off  # [BN]
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BN, D_PAD]
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if F32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [rows, BN] fp32 accumulate
    s = s * scale
    if SOFTCAP:
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
    s = tl.where(visible, s, float("-inf"))
    # a row may see no key of this tile (or of this whole split, past its position):
    # keep its max finite so the weights below stay 0, not NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, ctx_ptr, o_ptr, ml_ptr, acc_ptr,
    scale, softcap, window, num_splits, q_st, q_sh, c_sb, c_st, c_sh, tab_st, o_st, o_sh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    # this split's slice of the context, in whole tiles: [start, end)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, ctx)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    heads = kvh * G + g  # [G_PAD] query heads of this KV head
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * q_st + heads[:, None] * q_sh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D_PAD]
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if WINDOW:  # the query (at ctx - 1) sees keys from ctx - window on
        start = tl.maximum(start, tl.maximum(ctx - window, 0) // BLOCK_N * BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_n  # [BN] key positions
        t_ok = t < end
        visible = t_ok
        if WINDOW:
            visible = t_ok & (t >= ctx - window)
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, tab_ptr + b64 * tab_st, t, t_ok, visible[None, :], kvh * c_sh,
            c_sb, c_st, d, d_ok, scale, softcap, m_i, l_i, acc, BLOCK_SIZE, F32_DOT, SOFTCAP)
    if SPLIT:  # partials for the merge kernel: ml [B, H, S, 2], acc [B, H, S, D_PAD]
        S = num_splits
        base = (b64 * (S * G * tl.num_programs(1)) + heads.to(tl.int64) * S + sp)  # [G_PAD]
        tl.store(ml_ptr + base * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=g_ok)
        tl.store(acc_ptr + base[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # ctx 0 (never in practice) -> zeros
        tl.store(o_ptr + b64 * o_st + heads[:, None] * o_sh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


# a mixed step's prompt rows pass positions[d:] (one jitted kernel serves both callers)
MERGE_UNALIGNED = ("pos_ptr",)


def _merge_kernel(
    ml_ptr, acc_ptr, o_ptr, pos_ptr, num_splits, o_st, o_sh,
    D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Row (b, h) of the output from its splits' partials. VARLEN (rows are tokens): only
    the splits a query at its position saw; the programs of later ones exited unwritten."""
    b, h = tl.program_id(0), tl.program_id(1)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    if VARLEN:
        s_ok = s_ok & (s < tl.cdiv(tl.load(pos_ptr + b).to(tl.int32) + 1, SPLIT_KEYS))
    m = tl.load(ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))  # [S_PAD]
    l = tl.load(ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    d = tl.arange(0, D_PAD)
    acc = tl.load(acc_ptr + (base + s)[:, None] * D_PAD + d[None, :], mask=s_ok[:, None],
                  other=0.0)  # [S_PAD, D_PAD]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # empty splits weigh nothing
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
    tl.store(o_ptr + b.to(tl.int64) * o_st + h * o_sh + d, out.to(o_ptr.dtype.element_ty),
             mask=d < D)


def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, ctx_ptr, cu_ptr, tile_ptr, o_ptr, ml_ptr, acc_ptr,
    scale, softcap, window, num_splits, q_st, q_sh, c_sb, c_st, c_sh, tab_st, o_st, o_sh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    # a program: BLOCK_M queries x the G query heads of one KV head (GQA: each K/V tile is
    # read once for the group), over one split of the keys
    tile, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = tl.load(tile_ptr + tile * 2)  # the tile's sequence, -1 past the step's tiles
    if b < 0:
        return
    mb = tl.load(tile_ptr + tile * 2 + 1)  # which BLOCK_M run of its queries
    q0 = tl.load(cu_ptr + b).to(tl.int32)
    n = tl.load(cu_ptr + b + 1).to(tl.int32) - q0  # new tokens of this sequence
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    hi = tl.minimum(ctx, ctx - n + (mb + 1) * BLOCK_M)  # keys the tile's last query sees
    lo = sp * SPLIT_KEYS  # this split's slice of the keys: [lo, lo + SPLIT_KEYS)
    if lo >= hi:
        return  # past the tile's keys: the merge reads no partials from here
    end = tl.minimum(lo + SPLIT_KEYS, hi)
    r = tl.arange(0, BLOCK_M * G_PAD)  # [R] rows: query r // G_PAD, head r % G_PAD
    qi = mb * BLOCK_M + r // G_PAD  # [R] query index within the sequence's new tokens
    g = r % G_PAD
    r_ok = (qi < n) & (g < G)
    h = kvh * G + g  # [R] query head
    q_pos = ctx - n + qi  # [R] position of each query; it sees keys 0..q_pos
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    tok = (q0 + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_st + h[:, None] * q_sh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [R, D_PAD]
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M * G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_M * G_PAD, D_PAD), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)
    start = lo
    if WINDOW:  # tiles before the tile's first query's window: skipped
        first = ctx - n + mb * BLOCK_M - window + 1
        start = tl.maximum(lo, tl.maximum(first, 0) // BLOCK_N * BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_n  # [BN]
        t_ok = t < end
        visible = t_ok[None, :] & (t[None, :] <= q_pos[:, None])  # [R, BN]
        if WINDOW:
            visible &= t[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, tab_ptr + b64 * tab_st, t, t_ok, visible, kvh * c_sh, c_sb, c_st,
            d, d_ok, scale, softcap, m_i, l_i, acc, BLOCK_SIZE, F32_DOT, SOFTCAP)
    if SPLIT:  # partials for the merge kernel: ml [T, H, S, 2], acc [T, H, S, D_PAD]
        H = tl.num_programs(1) * G
        base = (tok * H + h) * num_splits + sp  # [R]
        tl.store(ml_ptr + base * 2, m_i, mask=r_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=r_ok)
        tl.store(acc_ptr + base[:, None] * D_PAD + d[None, :], acc, mask=r_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + tok[:, None] * o_st + h[:, None] * o_sh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def _f32_dot(kernel, dtype: torch.dtype) -> bool:
    """fp32 caches use exact fp32 dots; the interpreter's bf16/fp16 tl.dot is unreliable."""
    return dtype == torch.float32 or is_interpreted(kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): programs for DECODE_WAVES waves, none walking more than
    DECODE_SPLIT_CAPACITY of the table, no slice under MIN_SPLIT_TOKENS. Shapes only."""
    want = -(-DECODE_WAVES * _num_sms(device) // max(batch * kv_heads, 1))
    want = max(want, -(-max_context // DECODE_SPLIT_CAPACITY))
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, 64))


def _cache_strides(k_cache: torch.Tensor):
    if k_cache.stride(3) != 1:
        raise ValueError("caches must be [num_blocks, block_size, KV, D] with unit last stride")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """q: [B, H, D] (one query per sequence, at position context_lens - 1) -> [B, H, D];
    caches: [num_blocks, block_size, KV, D]; block_tables: [B, W]; context_lens: [B] >= 1.
    softcap: scores capped by softcap * tanh(. / softcap); window: a query at p sees keys
    p - window < k <= p (Gemma's sliding layers)."""
    require_triton()
    B, H, D = q.shape
    _, bs, KV, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("k/v caches must share strides; q and block_tables need unit last stride")
    G = H // KV
    out = torch.empty_like(q)
    if B == 0:
        return out
    S = num_splits or decode_splits(B, KV, block_tables.shape[1] * bs, q.device)
    D_PAD, G_PAD = next_pow2(max(D, 16)), max(16, next_pow2(G))  # tl.dot needs >= 16
    kernel = jit_kernel(_decode_kernel, q.device)
    if S > 1:
        ml = torch.empty(B, H, S, 2, dtype=torch.float32, device=q.device)
        acc = torch.empty(B, H, S, D_PAD, dtype=torch.float32, device=q.device)
    else:
        ml = acc = out  # unused
    kernel[(B, KV, S)](
        q, k_cache, v_cache, block_tables, context_lens, out, ml, acc,
        scale, softcap or 0.0, window or 0, S, q.stride(0), q.stride(1),
        *_cache_strides(k_cache), block_tables.stride(0), out.stride(0), out.stride(1),
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BLOCK_SIZE=bs, BLOCK_N=DECODE_BLOCK_N,
        SPLIT=S > 1, F32_DOT=_f32_dot(kernel, k_cache.dtype), SOFTCAP=softcap is not None,
        WINDOW=window is not None, num_warps=4,
    )
    if S > 1:
        merge = jit_kernel(_merge_kernel, q.device, unaligned=MERGE_UNALIGNED)
        merge[(B, H)](ml, acc, out, ml, S, out.stride(0), out.stride(1),  # no positions
                      D=D, D_PAD=D_PAD, S_PAD=max(2, next_pow2(S)), SPLIT_KEYS=1,
                      VARLEN=False, num_warps=2)
    return out


def prefill_block_m(max_tokens: int, group: int) -> int:
    """Queries per tile, each with its `group` query heads: 64 rows for steps of few tokens
    (decode rows, short chunks), 128 for big prefills (fewer passes over the keys)."""
    rows = 64 if max_tokens <= 256 else 128
    return max(1, rows // next_pow2(group))


def prefill_tiles(cu_query: list[int], num_tiles: int | None = None,
                  block_m: int = PREFILL_BLOCK_M) -> list[tuple[int, int]]:
    """(sequence, query tile) of every block_m run of queries, padded with (-1, 0) to
    num_tiles (a CUDA graph's fixed grid)."""
    tiles = [(i, m) for i, (a, b) in enumerate(zip(cu_query, cu_query[1:]))
             for m in range(-(-(b - a) // block_m))]
    if num_tiles is not None:
        if len(tiles) > num_tiles:
            raise ValueError(f"{len(tiles)} query tiles do not fit the {num_tiles} given")
        tiles += [(-1, 0)] * (num_tiles - len(tiles))
    return tiles


def max_prefill_tiles(num_tokens: int, num_seqs: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """The most query tiles num_tokens queries over num_seqs sequences can make."""
    return -(-num_tokens // block_m) + num_seqs


def prefill_split_keys(max_context: int) -> int:
    """Keys per varlen split: MIN_SPLIT_PREFILL, or more so that the table's capacity makes
    at most MAX_PREFILL_SPLITS. Shapes only."""
    per = -(-max_context // MAX_PREFILL_SPLITS)
    return max(MIN_SPLIT_PREFILL, -(-per // PREFILL_BLOCK_N) * PREFILL_BLOCK_N)


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, cu_query: torch.Tensor, max_query_len: int, scale: float,
    tiles: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    split_keys: int | None = None, block_m: int | None = None,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D], sequence i's queries rows cu_query[i]:cu_query[i+1], the last at
    position context_lens[i] - 1; causal over its cached context (softcap and window as
    paged_decode's) -> [T, H, D].
    tiles (prefill_tiles with block_m) and positions ([T], read by the split merge): None
    derives them on the host (a sync: not under graph capture)."""
    require_triton()
    T, H, D = q.shape
    _, bs, KV, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("k/v caches must share strides; q and block_tables need unit last stride")
    out = torch.empty_like(q)
    if T == 0:
        return out
    G = H // KV
    block_m = block_m or prefill_block_m(max_query_len, G)
    if tiles is None:
        tiles = torch.tensor(prefill_tiles(cu_query.tolist(), block_m=block_m), dtype=torch.int32,
                             device=q.device).reshape(-1, 2)
    max_ctx = block_tables.shape[1] * bs
    split_keys = split_keys or prefill_split_keys(max_ctx)
    S = -(-max_ctx // split_keys)
    D_PAD = next_pow2(max(D, 16))
    if S > 1:
        ml = torch.empty(T, H, S, 2, dtype=torch.float32, device=q.device)
        acc = torch.empty(T, H, S, D_PAD, dtype=torch.float32, device=q.device)
    else:
        ml = acc = out  # unused
    # a mixed step passes its prompt rows' block_tables[d:] and context_lens[d:]
    kernel = jit_kernel(_prefill_kernel, q.device, unaligned=("tab_ptr", "ctx_ptr"))
    kernel[(tiles.shape[0], KV, S)](
        q, k_cache, v_cache, block_tables, context_lens, cu_query, tiles, out, ml, acc,
        scale, softcap or 0.0, window or 0, S, q.stride(0), q.stride(1),
        *_cache_strides(k_cache), block_tables.stride(0), out.stride(0), out.stride(1),
        G=G, G_PAD=next_pow2(G), D=D, D_PAD=D_PAD, BLOCK_SIZE=bs, BLOCK_M=block_m,
        BLOCK_N=PREFILL_BLOCK_N, SPLIT_KEYS=split_keys, SPLIT=S > 1,
        F32_DOT=_f32_dot(kernel, k_cache.dtype), SOFTCAP=softcap is not None,
        WINDOW=window is not None, num_warps=4,
    )
    if S > 1:
        if positions is None:
            cu, ctx = cu_query.tolist(), context_lens.tolist()
            positions = torch.tensor([c - (b - a) + j for a, b, c in zip(cu, cu[1:], ctx)
                                      for j in range(b - a)] + [0] * (T - cu[-1]),
                                     dtype=torch.int64, device=q.device)
        merge = jit_kernel(_merge_kernel, q.device, unaligned=MERGE_UNALIGNED)
        merge[(T, H)](ml, acc, out, positions, S, out.stride(0), out.stride(1),
                      D=D, D_PAD=D_PAD, S_PAD=max(2, next_pow2(S)), SPLIT_KEYS=split_keys,
                      VARLEN=True, num_warps=2)
    return out
