"""Linear layers over 4-bit weights (AWQ, GPTQ, bitsandbytes NF4/FP4, after the loader
repacks them): y = x @ W^T + bias with W[n, k] = (v(q[n, k]) - zero[n, g]) * scale[n, g],
g = k // group, v the 4-bit code itself (AWQ, GPTQ) or a 16-entry codebook's value (NF4).
Weight-only: activations stay in the model's dtype, so LoRA reads what an adapter trained on
the dequantized base saw.

One packed layout for every format: int32 [N, Kp / 8], Kp = K rounded up to CHUNK. Word i of
a row's chunk c holds columns c * CHUNK + 32 j + i in nibble j, so a kernel unpacks nibble j
of a [BN, 32] word tile into 32 consecutive columns (one group: group sizes are multiples
of 32) with a shift and a mask, no shuffle. Columns past K are zero codes whose activation
is masked to 0.

int4_linear_ref (dequantize, round to x's dtype, F.linear) is the oracle and the CPU path.
The Triton GEMM computes W x^T (the weight the MMA's wide operand) and splits K at decode
sizes (metrale.ops.split_k). Zero-point codes (AWQ, GPTQ: zeros 0..16) enter the MMA as the
exact integers q - zero, made from the code's bit pattern (0x4300 | q is the bf16 128 + q),
and each group's float32 partial sum is scaled once: no float multiply or conversion per
weight, 1.2-1.35x faster than dequantizing each weight in float32 first (H200, 8B shapes,
1-32 tokens, session 23), and not rounded to x's dtype, so it differs from the reference by
that rounding only. Codebook codes (NF4) are dequantized in float32 as the reference does,
their values picked by a tree of selects on the code's bits (_lookup16: 1.3-2.7x faster than
a load per element, H200, session 24).
Tried on the H200 and not kept, each slower: a GEMV form without MMA (1.2-2.9x the time at 1
and 8 tokens); one MMA per 256-column chunk, its 8 slices joined (1.5x) or unpacked by
broadcasting to [BN, 8, 32] (1.6x); the zero folded out after the MMA through per-group
sums of x (1.1-1.6x the kept), also with the unpacking in PTX (lop3 on bf16 pairs, the
same); the next chunk's words, x slices, zeros and scales loaded into registers before
this chunk's MMAs (1.05-1.4x, session 25, branch int4-prefetch). The bytes alone (the
word tiles loaded and folded) take 1.0-2.8x the byte floor at these shapes. The group
size is a compile-time constant (10-15% at these shapes, session 24). From DENSE_MIN_M
tokens on the weight is dequantized to a scratch copy for cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.ops.split_k import GemmConfig, finish_split
from metrale.ops.triton_utils import device_function, jit_kernel, next_pow2, require_triton, tl, triton

CHUNK = 256  # columns per packed chunk: 32 int32 words of 8 nibbles
WORDS = CHUNK // 8
SPLIT_MAX_M = 64
DENSE_MIN_M = 256
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4Layout:
    """How a projection's 4-bit weight is held (metrale.model.layers.LoraProjection.use_int4)."""
    group: int  # columns per scale; K for one group per row
    scale_dtype: torch.dtype  # the checkpoint's
    zero: bool  # uint8 zero points per group (AWQ, GPTQ); none with a codebook (NF4, FP4)
    codebook: bool
    act_order: bool  # GPTQ act-order: columns stored sorted by group, x permuted to match

    def __post_init__(self) -> None:
        if self.zero == self.codebook:
            raise ValueError("a 4-bit layout has zero points or a codebook, not both or neither")


def padded_k(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (any integer dtype, values 0..15) -> int32 [N, padded_k(K) / 8]."""
    n, k = q.shape
    q = F.pad(q.to(torch.int32), (0, padded_k(k) - k)).view(n, -1, 8, WORDS)  # [N, C, j, i]
    words = torch.zeros(n, q.shape[1], WORDS, dtype=torch.int32, device=q.device)
    for j in range(8):
        words |= q[:, :, j, :] << (4 * j)  # nibble 7 wraps into the sign bit: fine for int32
    return words.view(n, -1)


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack's inverse: uint8 codes [N, k]."""
    n = packed.shape[0]
    words = packed.view(n, -1, 1, WORDS)  # [N, C, 1, i]
    q = (words >> _SHIFTS.to(packed.device).view(1, 1, 8, 1)) & 0xF  # [N, C, j, i]
    return q.reshape(n, -1)[:, :k].to(torch.uint8)


def check_group(group: int, k: int) -> None:
    """group: columns per scale (K for one group per row)."""
    if group <= 0 or (group < k and group % 32):
        raise ValueError(f"4-bit groups must cover all {k} columns or a multiple of 32, "
                         f"got {group}")


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     codebook: torch.Tensor | None, group_of: torch.Tensor) -> torch.Tensor:
    """float32 W [N, K] = (v(q) - zero[:, g]) * scale[:, g], g = group_of [K], v the code or
    codebook[code]. q [N, K] codes; scale [N, G] (float); zero [N, G] (uint8) or None;
    codebook float32 [16] or None."""
    v = codebook[q.long()] if codebook is not None else q.to(torch.float32)  # [N, K]
    if zero is not None:
        v = v - zero.to(torch.float32)[:, group_of]
    return v * scale.to(torch.float32)[:, group_of]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               codebook: torch.Tensor | None, group: int, k: int) -> torch.Tensor:
    """float32 W [N, k] of pack's layout, groups of `group` columns."""
    return dequantize_codes(unpack(packed, k), scale, zero, codebook,
                            torch.arange(k, device=packed.device) // group)


def int4_linear_ref(x: torch.Tensor, packed, scale, zero, codebook, group: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N]: the weight dequantized, rounded to x's dtype, then F.linear."""
    w = dequantize(packed, scale, zero, codebook, group, x.shape[-1])
    return F.linear(x, w.to(x.dtype), bias)


def choose_config(m: int, n: int, chunks: int, max_tiles: int) -> GemmConfig:
    """Measured on the H200 (.nixl/int4v.py, session 23: 8B shapes at 1-32 tokens, split 4-16,
    block_n 64/128, 2-3 stages): at decode sizes the fastest split gives each program about
    4 chunks (1,024 columns) of K, whatever the tile count; 2 stages. Past SPLIT_MAX_M tiles
    of 64 x 64, unsplit."""
    if m > SPLIT_MAX_M:
        return GemmConfig(64, 64, CHUNK, 1, 4, 3, swap=True)
    bm = max(16, next_pow2(m))
    tiles = -(-n // 64) * -(-m // bm)
    split = 1
    while split < 16 and chunks >= split * 8 and tiles * split * 2 <= max_tiles:
        split *= 2
    return GemmConfig(bm, 64, CHUNK, split, 4, 2, swap=True)


def chosen_config(t: int, packed: torch.Tensor, counters: torch.Tensor) -> GemmConfig:
    return choose_config(t, packed.shape[0], packed.shape[1] // WORDS, counters.numel())


@device_function
def _pick(bit, lo, hi):
    return tl.where(bit, hi, lo)


@device_function
def _lookup16(q, c_ptr):
    """c[q] for 4-bit q from 16 uniform scalar loads and a tree of 15 selects on q's bits:
    a per-element load from the codebook ran 16-27x the GEMM's byte floor (H200)."""
    b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
    p0 = _pick(b0, tl.load(c_ptr + 0), tl.load(c_ptr + 1))
    p1 = _pick(b0, tl.load(c_ptr + 2), tl.load(c_ptr + 3))
    p2 = _pick(b0, tl.load(c_ptr + 4), tl.load(c_ptr + 5))
    p3 = _pick(b0, tl.load(c_ptr + 6), tl.load(c_ptr + 7))
    p4 = _pick(b0, tl.load(c_ptr + 8), tl.load(c_ptr + 9))
    p5 = _pick(b0, tl.load(c_ptr + 10), tl.load(c_ptr + 11))
    p6 = _pick(b0, tl.load(c_ptr + 12), tl.load(c_ptr + 13))
    p7 = _pick(b0, tl.load(c_ptr + 14), tl.load(c_ptr + 15))
    r0, r1 = _pick(b1, p0, p1), _pick(b1, p2, p3)
    r2, r3 = _pick(b1, p4, p5), _pick(b1, p6, p7)
    return _pick(b3, _pick(b2, r0, r1), _pick(b2, r2, r3)).to(tl.float32)


@device_function
def _codes(words, j: tl.constexpr, c_ptr, HAS_CODES: tl.constexpr):
    """Nibble j of each word as float32: the codebook's value, or the code itself (OR-ed into
    the mantissa of 2^23, then 2^23 subtracted: exact, no int-to-float conversion)."""
    q = (words >> (4 * j)) & 0xF
    if HAS_CODES:
        v = _lookup16(q, c_ptr)
    else:
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return v


@device_function
def _dequant_slice(words, j: tl.constexpr, k0, n, n_ok, s_ptr, z_ptr, c_ptr, G, GROUP,
                   HAS_ZERO: tl.constexpr, HAS_CODES: tl.constexpr):
    """W[n, k0 : k0 + 32] in float32 from nibble j of the chunk's words [BN, 32]."""
    g = tl.minimum(k0 // GROUP, G - 1)  # padding columns: the last group's
    v = _codes(words, j, c_ptr, HAS_CODES)
    if HAS_ZERO:
        v -= tl.load(z_ptr + n * G + g, mask=n_ok, other=0).to(tl.float32)[:, None]
    return v * tl.load(s_ptr + n * G + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]


@device_function
def _code_integers(words, j: tl.constexpr):
    """Nibble j of each word as the bf16 integer 128 + q, from its bit pattern (0x4300 | q):
    no conversion instruction."""
    return ((((words >> (4 * j)) & 0xF) | 0x4300).to(tl.int16)).to(tl.bfloat16, bitcast=True)


def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, c_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, KW, G, x_st, y_st, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                      HAS_CODES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                      FLUSH: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """acc^T [BN, BM] = W [BN, K] @ x^T [K, BM], a chunk of 256 columns at a time: its
    [BN, 32] words unpacked nibble by nibble, each nibble 32 consecutive columns (inside one
    group), one MMA each. Zero-point codes go in as the exact integers q - zero (in x's
    dtype), their MMAs summed over FLUSH slices (one group, or a chunk of it) and the sum
    scaled once; codebook codes are dequantized in float32 first, as the reference does."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, 32)
    dt = x_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if IEEE else "tf32"
    n_ok = n < N
    chunks = KW // 32
    c_per = tl.cdiv(chunks, SPLIT_K)
    c_lo = pid_k * c_per
    c_hi = tl.minimum(c_lo + c_per, chunks)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # one group's unscaled sum
    w_rows = w_ptr + n[:, None].to(tl.int64) * KW + i[None, :]  # [BN, 32]
    for c in range(c_lo, c_hi):
        words = tl.load(w_rows + c * 32, mask=n_ok[:, None], other=0)  # [BN, 32] int32
        for j in tl.static_range(8):
            k0 = c * 256 + 32 * j
            k = k0 + i
            x = tl.load(x_ptr + m[None, :].to(tl.int64) * x_st + k[:, None],
                        mask=(m < M)[None, :] & (k < K)[:, None], other=0.0)  # [32, BM]
            if HAS_ZERO:
                g = tl.minimum(k0 // GROUP, G - 1)  # padding columns: the last group's
                z = tl.load(z_ptr + n * G + g, mask=n_ok, other=0).to(tl.float32) + 128.0
                w = _code_integers(words, j).to(dt) - z.to(dt)[:, None]  # [BN, 32] exact
                part += tl.dot(w, x, input_precision=prec)
                if (j + 1) % FLUSH == 0:
                    s = tl.load(s_ptr + n * G + g, mask=n_ok, other=0.0).to(tl.float32)
                    acc += part * s[:, None]
                    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                w = _dequant_slice(words, j, k0, n, n_ok, s_ptr, z_ptr, c_ptr, G, GROUP,
                                   HAS_ZERO, HAS_CODES)  # [BN, 32] float32
                acc += tl.dot(w.to(dt), x, input_precision=prec)
    tile_ok = n_ok[:, None] & (m < M)[None, :]
    last = True
    if SPLIT_K > 1:
        acc, last = finish_split(acc, ws_ptr, cnt_ptr, m[None, :].to(tl.int64) * N + n[:, None],
                                 tile_ok, pid_m * tl.num_programs(0) + pid_n, pid_k, M, N,
                                 SPLIT_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m[None, :].to(tl.int64) * y_st + n[:, None], acc.to(dt), mask=tile_ok)


def flush_slices(group: int, k: int) -> int:
    """32-column slices per scaled sum: a whole group where groups tile the 256-column chunk,
    the chunk where a group spans whole chunks (or the row), else each slice."""
    if group >= k or group % CHUNK == 0:
        return CHUNK // 32
    return group // 32 if CHUNK % group == 0 else 1


def _dequant_kernel(w_ptr, s_ptr, z_ptr, c_ptr, out_ptr, N, K, KW, G, GROUP,
                    HAS_ZERO: tl.constexpr, HAS_CODES: tl.constexpr, BLOCK_N: tl.constexpr):
    """One [BN, 256] chunk of W into out [N, K]."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    i = tl.arange(0, 32)
    n_ok = n < N
    words = tl.load(w_ptr + n[:, None].to(tl.int64) * KW + c * 32 + i[None, :],
                    mask=n_ok[:, None], other=0)
    for j in tl.static_range(8):
        k = c * 256 + 32 * j + i
        w = _dequant_slice(words, j, c * 256 + 32 * j, n, n_ok, s_ptr, z_ptr, c_ptr, G, GROUP,
                           HAS_ZERO, HAS_CODES)
        tl.store(out_ptr + n[:, None].to(tl.int64) * K + k[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (k < K)[None, :])


def dequantize_to(packed, scale, zero, codebook, group: int, k: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """dequantize(...).to(dtype) in one pass."""
    require_triton()
    n = packed.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    grid = (triton.cdiv(n, 32), packed.shape[1] // WORDS)
    jit_kernel(_dequant_kernel, packed.device)[grid](
        packed, scale, scale if zero is None else zero, scale if codebook is None else codebook,
        out, n, k, packed.shape[1], scale.shape[1], group,
        HAS_ZERO=zero is not None, HAS_CODES=codebook is not None, BLOCK_N=32)
    return out


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor | None, codebook: torch.Tensor | None, group: int,
                bias: torch.Tensor | None, counters: torch.Tensor,
                config: GemmConfig | None = None) -> torch.Tensor:
    """int4_linear_ref's result through the Triton GEMM. x: [T, K] float (unit last stride);
    packed: pack's layout; counters: split_k.tile_counters(N); config: None for chosen_config's."""
    require_triton()
    (t, k), n = x.shape, packed.shape[0]
    if x.dim() != 2 or packed.shape[1] * 8 != padded_k(k):
        raise ValueError(f"int4_linear: x {tuple(x.shape)} does not fit packed weights "
                         f"{tuple(packed.shape)}")
    check_group(group, k)
    if config is None and t >= DENSE_MIN_M:  # cuBLAS on a dequantized copy beats our tiles
        return F.linear(x, dequantize_to(packed, scale, zero, codebook, group, k, x.dtype), bias)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cfg = config or chosen_config(t, packed, counters)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m), cfg.split_k)
    ws = (torch.empty(cfg.split_k, t, n, dtype=torch.float32, device=x.device)
          if cfg.split_k > 1 else y)
    jit_kernel(_int4_gemm_kernel, x.device)[grid](
        x, packed, scale, scale if zero is None else zero, scale if codebook is None else codebook,
        bias if bias is not None else y, y, ws, counters, t, n, k, packed.shape[1],
        scale.shape[1], x.stride(0), y.stride(0), group,
        HAS_ZERO=zero is not None, HAS_CODES=codebook is not None, HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k, FLUSH=flush_slices(group, k), IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
