"""Linear layers over 4-bit weights (AWQ, GPTQ, bitsandbytes NF4/FP4, after the loader
repacks them): y = x @ W^T + bias with W[n, k] = (v(q[n, k]) - zero[n, g]) * scale[n, g],
g = k // group, v the 4-bit code itself (AWQ, GPTQ) or a 16-entry codebook's value (NF4).
Weight-only: activations stay in the model's dtype, so LoRA reads what an adapter trained on
the dequantized base saw.

One packed layout for every format: int32 [N, Kp / 8], Kp = K rounded up to CHUNK. A row's
chunk c is 32 words; word 16 h + p holds, at bits 4 s and 4 s + 16, the column pair
(2 p, 2 p + 1) of the 32-column slice 4 h + s (columns c * CHUNK + 32 (4 h + s) + 2 p + e).
So one 3-input logic op on a word shifted right by 4 s, (w & 0x000F000F) | 0x43004300,
gives the two bf16 integers 128 + q of a column pair in one register, the pair an MMA
operand's register holds (0x64006400: fp16 1024 + q). A slice lies in one group (group
sizes are multiples of 32). Columns past K are zero codes whose activation is masked to 0.

int4_linear_ref (dequantize, round to x's dtype, F.linear) is the oracle and the CPU path.
The Triton GEMM computes W x^T (the weight the MMA's wide operand) and splits K at decode
sizes (metrale.ops.split_k). Zero-point codes (AWQ, GPTQ: zeros 0..16) enter the MMA as the
exact integers q - zero (bias-128 integers from the pair op above, less 128 + zero), and each
group's float32 partial sum is scaled once, its zero and scale loaded once per group: no
float multiply or conversion per weight, and not rounded to x's dtype, so the result differs
from the reference by that rounding only. fp32 x, and Triton's interpreter (no inline PTX),
make the same integers by plain conversions. This layout and the pair op, with the group's
zero and scale loaded once and no masks where N and K tile evenly, took the loop from 801 to
381 instructions a 256-column chunk (SASS, Triton 3.6, sm_90, 64 x 16 tiles) and the GEMM
from 3.1-5.4x to 1.8-4.6x its byte floor at the 8B shapes and 1-32 tokens (H200, session 26:
gate/up at 1 token 45.6 -> 27.5 us); the previous layout (nibble j of word i: column
32 j + i) spent ~3 instructions a weight unpacking and pairing. Codebook codes (NF4) in bf16
or fp16 become their values rounded to x's dtype, a column pair per 16 integer ops from byte
tables of the codebook (_codebook_pairs), the block's absmax applied to the MMA's sum: a
rounding of the same size as the reference's (which rounds value x absmax), not the same
one; 1,206 instructions a chunk against 2,224 for the float32 form (H200: 4.7-7.5x the byte
floor, was 9.6-13x). In fp32 (and the interpreter) they are dequantized in float32 as the
reference does, their values picked by a tree of selects on the code's bits (_lookup16).
Tried on the H200 and not kept, each slower or no better: a GEMV form without MMA (1.2-2.9x
the time at 1 and 8 tokens); one MMA per 256-column chunk, its 8 slices joined (1.5x) or
unpacked by broadcasting to [BN, 8, 32] (1.6x); the zero folded out after the MMA through
per-group sums of x (1.1-1.6x); the next chunk's words, x slices, zeros and scales loaded into
registers before this chunk's MMAs (1.05-1.4x, session 25, branch int4-prefetch); the words
stored tile by tile, a program's chunk contiguous (-3.5% to +10%, session 26). The group
size is a compile-time constant (10-15% at these shapes, session 24). From DENSE_MIN_M
tokens on the weight is dequantized to a scratch copy for cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.ops.split_k import GemmConfig, finish_split
from metrale.ops.triton_utils import (
    device_function,
    is_interpreted,
    jit_kernel,
    next_pow2,
    require_triton,
    tl,
    triton,
)

CHUNK = 256  # columns per packed chunk: 32 int32 words of 8 nibbles
WORDS = CHUNK // 8
SPLIT_MAX_M = 64
DENSE_MIN_M = 256
CODEBOOK_PTX = tl.constexpr("{ .reg .b32 xq, sel, ll, lh, hl, hh, x, y, u, v, t, z; "
                            "and.b32 xq, $1, 0x00070007; "
                            "shr.u32 t, xq, 8; "
                            "or.b32 sel, xq, t; "
                            "prmt.b32 ll, $3, $5, sel; "
                            "prmt.b32 lh, $7, $9, sel; "
                            "prmt.b32 hl, $11, $13, sel; "
                            "prmt.b32 hh, $15, $17, sel; "
                            "prmt.b32 x, ll, hl, 0x6240; "
                            "prmt.b32 y, lh, hh, 0x6240; "
                            "shr.u32 u, $1, 1; "
                            "and.b32 u, u, 0x00040004; "
                            "mul.lo.u32 v, u, 17; "
                            "shr.u32 t, v, 8; "
                            "or.b32 z, v, t; "
                            "or.b32 z, z, 0x3210; "
                            "prmt.b32 $0, x, y, z; "
                            "}")
CODEBOOK_CONSTRAINTS = tl.constexpr("=r" + ",r" * 18)  # the pair, 8 tables; 2 operands each
_PAIR_BIAS = {torch.bfloat16: 128, torch.float16: 1024}  # _biased_integers' bias per dtype
_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)  # [s, e]: 4 s + 16 e


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
    q = F.pad(q.to(torch.int32), (0, padded_k(k) - k)).view(n, -1, 2, 4, 16, 2)  # [N, C, h, s, p, e]
    words = torch.zeros(n, q.shape[1], 2, 16, dtype=torch.int32, device=q.device)
    for s in range(4):
        for e in range(2):  # bit 28 wraps into the sign bit: fine for int32
            words |= q[:, :, :, s, :, e] << _SHIFTS[2 * s + e]
    return words.view(n, -1)


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack's inverse: uint8 codes [N, k]."""
    n = packed.shape[0]
    words = packed.view(n, -1, 2, 1, 16, 1)  # [N, C, h, 1, p, 1]
    q = (words >> _SHIFTS.to(packed.device).view(1, 1, 1, 4, 1, 2)) & 0xF  # [N, C, h, s, p, e]
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
    """Measured on the H200 (.nixl/int4y.py, session 26: 8B shapes at 1, 8 and 32 tokens,
    block_n 64/128, 4/8 warps, split 1-16, 2-4 stages; the rule picks the best, or one within
    2% of it, at each but down at 8 tokens, 4.6%): up to 16 tokens K splits until about 512 programs
    run, each keeping at least 2 chunks; at 17-64 tokens about 384, each at least 4 chunks, and
    a wide weight (384+ tiles of 64 rows) runs unsplit in 128-row tiles of two warpgroups
    (gate/up at 32 tokens: 39.5 us, 46.9 in 64-row tiles split 2). 2 stages. Past
    SPLIT_MAX_M tiles of 64 x 64, unsplit."""
    if m > SPLIT_MAX_M:
        return GemmConfig(64, 64, CHUNK, 1, 4, 3, swap=True)
    bm = max(16, next_pow2(m))
    tiles = -(-n // 64) * -(-m // bm)
    if bm > 16 and tiles >= 384:
        return GemmConfig(bm, 128, CHUNK, 1, 8, 2, swap=True)
    programs, min_chunks = (512, 2) if bm == 16 else (384, 4)
    split = 1
    while (split < 16 and tiles * split < programs and chunks >= 2 * split * min_chunks
           and tiles * split * 2 <= max_tiles):
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
def _slice_codes(words, s: tl.constexpr):
    """int32 codes [BN, 32] of slice s of a half chunk from its words [BN, 16]: column 2 p + e
    is the nibble at bit 4 s + 16 e of word p."""
    sh = words >> (4 * s)
    return tl.join(sh & 0xF, (sh >> 16) & 0xF).reshape(sh.shape[0], 2 * sh.shape[1])


@device_function
def _word_pairs(words, s: tl.constexpr):
    """int32 [BN, 32]: words [BN, 16] shifted right by 4 s, each twice, so that a pair op
    (inline PTX, pack=2) gets a word as both elements of the column pair it makes; it reads
    the first."""
    sh = words >> (4 * s)
    return tl.join(sh, sh).reshape(sh.shape[0], 2 * sh.shape[1])


@device_function
def _biased_integers(words, s: tl.constexpr, dt: tl.constexpr):
    """[BN, 32] in dt, bias + q for slice s (bias 128 in bf16, 1024 in fp16): one lop3 per
    column pair, (w & 0x000F000F) | magic, the pair landing in the register the MMA reads."""
    pair = _word_pairs(words, s)
    if dt == tl.bfloat16:
        w = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 0xea;", "=r,r,r",
                                      [pair], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1677747200, 0xea;", "=r,r,r",
                                      [pair], dtype=tl.float16, is_pure=True, pack=2)
    return w


@device_function
def _codebook_bytes(c_ptr, dt: tl.constexpr):
    """The codebook's 16 values in dt as byte tables for prmt: (L0..L3, H0..H3), Lt holding
    the low bytes of entries 4t..4t+3 (byte i: entry 4t + i), Ht their high bytes."""
    e = tl.arange(0, 16)
    bits = tl.load(c_ptr + e).to(dt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    shift = 8 * (e % 4)
    lo, hi = (bits & 0xFF) << shift, (bits >> 8) << shift  # disjoint bytes: a sum is an OR
    return (tl.sum(tl.where(e // 4 == 0, lo, 0)), tl.sum(tl.where(e // 4 == 1, lo, 0)),
            tl.sum(tl.where(e // 4 == 2, lo, 0)), tl.sum(tl.where(e // 4 == 3, lo, 0)),
            tl.sum(tl.where(e // 4 == 0, hi, 0)), tl.sum(tl.where(e // 4 == 1, hi, 0)),
            tl.sum(tl.where(e // 4 == 2, hi, 0)), tl.sum(tl.where(e // 4 == 3, hi, 0)))


@device_function
def _codebook_pairs(words, s: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7, dt: tl.constexpr):
    """[BN, 32] in dt: the codebook's value (rounded to dt) of each code of slice s, from the
    byte tables t0..t7 of _codebook_bytes. Per column pair (q0 at bit 0, q1 at bit 16 of the
    shifted word) 16 integer ops, against ~17 a weight for the float32 select tree: the
    selector q & 7 for both codes, one prmt per byte table (entries 0-7 and 8-15, low and high
    bytes), low and high bytes interleaved, then each code's half chosen by its bit 3."""
    args = [_word_pairs(words, s), t0, t1, t2, t3, t4, t5, t6, t7]
    if dt == tl.bfloat16:
        w = tl.inline_asm_elementwise(CODEBOOK_PTX, CODEBOOK_CONSTRAINTS, args,
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        w = tl.inline_asm_elementwise(CODEBOOK_PTX, CODEBOOK_CONSTRAINTS, args,
                                      dtype=tl.float16, is_pure=True, pack=2)
    return w


@device_function
def _dequant_codes(q, k0, n, n_ok, s_ptr, z_ptr, c_ptr, G, GROUP,
                   HAS_ZERO: tl.constexpr, HAS_CODES: tl.constexpr):
    """W[n, k0 : k0 + 32] in float32 from the slice's codes q [BN, 32], as dequantize_codes:
    a codebook's value, or the code itself (OR-ed into the mantissa of 2^23, then 2^23
    subtracted: exact, no int-to-float conversion)."""
    g = tl.minimum(k0 // GROUP, G - 1)  # padding columns: the last group's
    if HAS_CODES:
        v = _lookup16(q, c_ptr)
    else:
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    if HAS_ZERO:
        v -= tl.load(z_ptr + n * G + g, mask=n_ok, other=0).to(tl.float32)[:, None]
    return v * tl.load(s_ptr + n * G + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]


def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, c_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                      M, N, K, KW, G, x_st, y_st, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                      HAS_CODES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                      FLUSH: tl.constexpr, EVEN: tl.constexpr, PAIR_BIAS: tl.constexpr,
                      IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc^T [BN, BM] = W [BN, K] @ x^T [K, BM], a chunk of 256 columns at a time, half a chunk
    of words [BN, 16] per load, each of its 4 slices (32 columns, inside one group) one MMA.
    PAIR_BIAS > 0 (bf16 or fp16 x on the GPU; the zero points' bias) runs the PTX pair ops:
    zero-point codes go in as the exact integers q - zero (biased by _biased_integers, the
    bias taken off with the zero), codebook codes as their values rounded to x's dtype
    (_codebook_pairs); the MMAs are summed over FLUSH slices (one group, or a chunk of it)
    whose scale (and zero) is loaded once, and the sum scaled once. Otherwise zero-point
    codes go in as integers by plain conversions and codebook codes are dequantized in
    float32 first, as the reference does. EVEN: N a multiple of BLOCK_N and K of the chunk,
    so no row or column masks."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, 32)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if IEEE else "tf32"
    n_ok = tl.full((BLOCK_N,), 1, tl.int1) if EVEN else n < N
    chunks = KW // 32
    c_per = tl.cdiv(chunks, SPLIT_K)
    c_lo = pid_k * c_per
    c_hi = tl.minimum(c_lo + c_per, chunks)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # one group's unscaled sum
    w_rows = w_ptr + n[:, None].to(tl.int64) * KW + tl.arange(0, 16)[None, :]  # [BN, 16]
    x_cols = x_ptr + m[None, :].to(tl.int64) * x_st + i[:, None]  # [32, BM]
    if HAS_CODES and PAIR_BIAS > 0:
        t0, t1, t2, t3, t4, t5, t6, t7 = _codebook_bytes(c_ptr, dt)
    for c in range(c_lo, c_hi):
        for h in tl.static_range(2):
            words = tl.load(w_rows + c * 32 + 16 * h, mask=n_ok[:, None], other=0)  # [BN, 16]
            for s in tl.static_range(4):
                k0 = c * 256 + 32 * (4 * h + s)  # slice 4 h + s
                k_ok = (i < 32) if EVEN else (k0 + i < K)
                x = tl.load(x_cols + k0, mask=(m < M)[None, :] & k_ok[:, None], other=0.0)
                if HAS_ZERO or PAIR_BIAS > 0:  # one scale (and zero) per group, after the MMA
                    if (4 * h + s) % FLUSH == 0:  # a static condition: keep it inline
                        g = k0 // GROUP if EVEN else tl.minimum(k0 // GROUP, G - 1)
                        sc = tl.load(s_ptr + n * G + g, mask=n_ok, other=0.0).to(tl.float32)
                        if HAS_ZERO:
                            z = tl.load(z_ptr + n * G + g, mask=n_ok, other=0).to(tl.float32)
                            zb = (z + PAIR_BIAS).to(dt)
                    if HAS_CODES:
                        w = _codebook_pairs(words, s, t0, t1, t2, t3, t4, t5, t6, t7, dt)
                    elif PAIR_BIAS > 0:
                        w = _biased_integers(words, s, dt) - zb[:, None]  # [BN, 32] exact
                    else:
                        w = _slice_codes(words, s).to(tl.float32).to(dt) - zb[:, None]
                    part += tl.dot(w, x, input_precision=prec)
                    if (4 * h + s + 1) % FLUSH == 0:
                        acc += part * sc[:, None]
                        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                else:  # codebook values in float32, as the reference (fp32 x, the interpreter)
                    w = _dequant_codes(_slice_codes(words, s), k0, n, n_ok, s_ptr, z_ptr,
                                       c_ptr, G, GROUP, HAS_ZERO, HAS_CODES)  # [BN, 32] f32
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
    for h in tl.static_range(2):
        words = tl.load(w_ptr + n[:, None].to(tl.int64) * KW + c * 32 + 16 * h
                        + tl.arange(0, 16)[None, :], mask=n_ok[:, None], other=0)  # [BN, 16]
        for s in tl.static_range(4):
            k0 = c * 256 + 32 * (4 * h + s)
            w = _dequant_codes(_slice_codes(words, s), k0, n, n_ok, s_ptr, z_ptr, c_ptr, G,
                               GROUP, HAS_ZERO, HAS_CODES)
            tl.store(out_ptr + n[:, None].to(tl.int64) * K + k0 + i[None, :],
                     w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (k0 + i < K)[None, :])


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
    kernel = jit_kernel(_int4_gemm_kernel, x.device)
    pair_bias = 0 if is_interpreted(kernel) else _PAIR_BIAS.get(x.dtype, 0)  # PTX: GPU only
    kernel[grid](
        x, packed, scale, scale if zero is None else zero, scale if codebook is None else codebook,
        bias if bias is not None else y, y, ws, counters, t, n, k, packed.shape[1],
        scale.shape[1], x.stride(0), y.stride(0), group,
        HAS_ZERO=zero is not None, HAS_CODES=codebook is not None, HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k, FLUSH=flush_slices(group, k),
        EVEN=n % cfg.block_n == 0 and k % CHUNK == 0, PAIR_BIAS=pair_bias,
        IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
