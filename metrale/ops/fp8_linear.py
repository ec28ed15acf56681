"""Linear layers over float8_e4m3fn weights: y = x @ (q * s)^T + bias.

Two activation modes (ACTIVATIONS). "dynamic" (the default): x is rounded to e4m3 in blocks
of X_BLOCK columns of each token, each block with its own float32 scale (its max |x| ->
FP8_MAX; DeepSeek-V3's 1 x 128 activation blocks, coarser), and the GEMM multiplies FP8 by
FP8 on the tensor cores; only the base linear sees the rounded x, LoRA reads x as it
is. "weight-only": x stays in the model's dtype, the weight's codes are converted to it in
registers (exact: e4m3's values are all bf16/fp16 values), so the result equals F.linear on
the dequantized weight. Measured on the H200 at Llama-3-8B/70B decode shapes (session 22,
BENCHMARKS.md): converting the codes is what held the weight-only GEMM at 1.5-3.6x its byte
floor; the FP8 x FP8 GEMM runs at 1.0-1.4x.

Scales are a float32 grid `scale[ceil(N / so), ceil(K / si)]`: one per output row is
(so, si) = (1, K) (per-tensor and per-channel checkpoints, --quantization fp8), block-wise
checkpoints keep their blocks. fp8_linear_ref is the oracle (and the CPU path) of both
modes. The Triton GEMM (as x @ W^T, or as its transpose W @ x^T: choose_config's pick)
scales per row in the epilogue or per (row block, K block) per tile, and splits K at decode
sizes, the last split of a tile summing the others' partials (a tile counter that resets
itself), so that a skinny GEMM puts every SM on the weight stream. From DENSE_MIN_M tokens
on (prefill chunks) the weight is dequantized to a scratch copy for cuBLAS, faster there
than our tiles, in either mode with x unrounded (at least as accurate as the dynamic mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.config import FP8_ACTIVATIONS
from metrale.ops.split_k import GemmConfig, finish_split, num_sms
from metrale.ops.triton_utils import device_function, jit_kernel, next_pow2, require_triton, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SPLIT_MAX_M = 64  # past this many rows a GEMM has tiles enough without splitting K
DENSE_MIN_M = 256  # from here on: the weight dequantized (3 bytes an element), then cuBLAS
ACTIVATIONS = FP8_ACTIVATIONS
X_BLOCK = 512  # columns of a token per activation scale: every K tile lies within one block
DEFAULT_ACTIVATIONS = ACTIVATIONS[0]
_TINY = torch.finfo(torch.float32).tiny


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] = q * s, each scale spread over its (so, si) block."""
    so, si = block
    n, k = q.shape
    s = scale.repeat_interleave(so, 0)[:n].repeat_interleave(si, 1)[:, :k]  # [N, K]
    return q.to(torch.float32) * s


def quantize_tokens_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [T, K] float8_e4m3fn, scale [T, ceil(K / X_BLOCK)] float32): each block of
    X_BLOCK columns of a row divided by its own scale, max |x| / FP8_MAX, then rounded to
    nearest (the dynamic mode's activations)."""
    t, k = x.shape
    blocks = -(-k // X_BLOCK)
    xf = F.pad(x.to(torch.float32), (0, blocks * X_BLOCK - k)).view(t, blocks, X_BLOCK)
    s = (xf.abs().amax(2, keepdim=True) / FP8_MAX).clamp(min=_TINY)  # [T, B, 1]
    xq = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq.view(t, -1)[:, :k], s.view(t, blocks)


def dequantize_tokens(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x [T, K] of quantize_tokens_ref's output."""
    return xq.to(torch.float32) * scale.repeat_interleave(X_BLOCK, 1)[:, :xq.shape[1]]


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None,
                   dynamic: bool = False) -> torch.Tensor:
    """x [T, K] -> [T, N]. Weight-only: the weight dequantized, rounded to x's dtype, then
    F.linear (what a checkpoint dequantized at load computes). dynamic: x rounded in blocks
    (quantize_tokens_ref), the products summed in float32, then rounded once;
    from DENSE_MIN_M tokens on as weight-only (what fp8_linear does there)."""
    if not dynamic or x.shape[0] >= DENSE_MIN_M:
        return F.linear(x, dequantize(q, scale, block).to(x.dtype), bias)
    y = F.linear(dequantize_tokens(*quantize_tokens_ref(x)), dequantize(q, scale, block))
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, scale [N, 1] float32): weight rounded per output row (vLLM's
    --quantization fp8)."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).to(FP8_DTYPE), scale


def choose_config(m: int, n: int, k: int, block_k_max: int, num_sms: int,
                  max_tiles: int) -> GemmConfig:
    """Measured on the H200 (bench/fp8_gemm.py --sweep at Llama-3-8B and 70B shapes): at
    decode sizes K splits until about 128 / BM CTAs per SM stream the weight (8 for tiles
    of 16 tokens, 2 for 64), and a GEMM left unsplit runs as W x^T; past SPLIT_MAX_M, wide
    W x^T tiles."""
    if m > SPLIT_MAX_M:
        return GemmConfig(128, 128, min(64, block_k_max), 1, 8, 4, swap=True)
    bm = max(16, next_pow2(m))
    bk = min(256 if bm == 16 else 128, block_k_max)
    tiles = -(-m // bm) * -(-n // 64)
    split = 1
    while (split < 8 and tiles * split * 2 * bm <= 128 * num_sms
           and tiles * split * 2 <= max_tiles and k % (bk * split * 2) == 0):
        split *= 2
    return GemmConfig(bm, 64, bk, split, 4, 3 if bk == 256 else 4, swap=split == 1)


def choose_config_fp8x(m: int, n: int, k: int, block_k_max: int, num_sms: int,
                       max_tiles: int) -> GemmConfig:
    """The dynamic mode's GEMM (x in e4m3), measured on the H200 (session 22, a sweep of
    64/128-wide tiles, K tiles of 256/512, split 1-16, 4/8 warps at Llama-3-8B and 70B
    shapes): W x^T tiles 64 rows wide; K tiles of 512 while the tiles fit one wave, 256
    past it; K split only until the tiles fill the SMs once (o and down of the 8B: 2)."""
    bm = max(16, next_pow2(min(m, 64)))
    tiles = -(-m // bm) * -(-n // 64)
    bk = min(512 if tiles <= num_sms else 256, block_k_max)
    split = 1
    while (split < 8 and tiles * split * 2 <= num_sms and tiles * split * 2 <= max_tiles
           and k % (bk * split * 2) == 0):
        split *= 2
    return GemmConfig(bm, 64, bk, split, 4, 3, swap=True)


@device_function
def _round_e4m3(v):
    """v (float32, |v| <= FP8_MAX) rounded to nearest-even on e4m3's grid, by the FPU: adding
    1.5 * 2^(23 + e) puts the ulp of the sum at 2^e, e4m3's ulp at v (3 mantissa bits,
    subnormal below 2^-6). Then the conversion to e4m3 is exact (Triton's interpreter rounds
    some ties and carries wrongly itself)."""
    bits = v.to(tl.int32, bitcast=True)
    ulp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    magic = ((ulp + 150) << 23 | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic  # the magnitude: its sign (and -0's) put back
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, x_st, s_st, FP8_MAX: tl.constexpr,
                            TINY: tl.constexpr, X_BLOCK: tl.constexpr):
    """quantize_tokens_ref for one block of one row: its max |x|, then x / scale rounded."""
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k = blk * X_BLOCK + tl.arange(0, X_BLOCK)
    x = tl.load(x_ptr + row * x_st + k, mask=k < K, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, TINY)
    tl.store(s_ptr + row * s_st + blk, s)
    v = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX))
    tl.store(q_ptr + row * K + k, v.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_tokens_ref(x) in one launch, a program per block (x [T, K], unit last
    stride)."""
    require_triton()
    t, k = x.shape
    blocks = -(-k // X_BLOCK)
    xq = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty(t, blocks, dtype=torch.float32, device=x.device)
    if t:
        jit_kernel(_quantize_tokens_kernel, x.device)[(t, blocks)](
            x, xq, xs, k, x.stride(0), xs.stride(0), FP8_MAX=FP8_MAX, TINY=_TINY,
            X_BLOCK=X_BLOCK, num_warps=4)
    return xq, xs


def _dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, s_st, SO, SI, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    q = tl.load(q_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=ok, other=0.0)
    s = tl.load(s_ptr + (n // SO)[:, None] * s_st + (k // SI)[None, :], mask=ok, other=0.0)
    tl.store(w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
             (q.to(tl.float32) * s).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize_to(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
    """dequantize(q, scale, block).to(dtype) in one pass (3 bytes an element)."""
    require_triton()
    n, k = q.shape
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 128))
    jit_kernel(_dequant_kernel, q.device)[grid](q, scale, w, n, k, scale.stride(0), *block,
                                                BLOCK_N=32, BLOCK_K=128)
    return w


def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, x_st,
                     y_st, s_st, xs_st, SO, SI, FP8_X: tl.constexpr, X_BLOCK: tl.constexpr,
                     PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """acc = x [BM, K] @ W^T [K, BN], or with SWAP its transpose W @ x^T (the weight the
    MMA's wide operand, a decode step's few tokens its narrow one). EVEN_K: no mask along
    K, the contiguous dimension, so loads stay 16 bytes wide. FP8_X: x holds e4m3 codes
    (quantize_tokens) multiplied as they are, each K tile's product scaled by its tokens'
    block scales (xs_ptr [M, K / X_BLOCK]); else the weight's codes are converted to x's
    dtype."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dt = x_ptr.dtype.element_ty
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # a split's K range, whole tiles
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    if SWAP:
        m_row, n_row = m[None, :], n[:, None]  # acc [BN, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        m_row, n_row = m[:, None], n[None, :]  # acc [BM, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tile_ok = (m_row < M) & (n_row < N)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if SWAP:
            kw, kx = k[None, :], k[:, None]  # W tile [BN, BK], x tile [BK, BM]
        else:
            kw, kx = k[:, None], k[None, :]  # W tile [BK, BN], x tile [BM, BK]
        w_mask, x_mask = n_row < N, m_row < M
        if not EVEN_K:
            w_mask &= kw < k_hi
            x_mask &= kx < k_hi
        w = tl.load(w_ptr + n_row.to(tl.int64) * K + kw, mask=w_mask, other=0.0)  # e4m3
        x = tl.load(x_ptr + m_row.to(tl.int64) * x_st + kx, mask=x_mask, other=0.0)
        if not FP8_X:
            w = w.to(dt)
        if SWAP:
            part = tl.dot(w, x, input_precision="ieee" if IEEE else "tf32")
        else:
            part = tl.dot(x, w, input_precision="ieee" if IEEE else "tf32")
        if FP8_X:
            part *= tl.load(xs_ptr + m_row * xs_st + k0 // X_BLOCK, mask=m_row < M, other=0.0)
        if PER_ROW:
            acc += part
        else:  # one scale per (row block, K block): a tile never straddles K blocks
            acc += part * tl.load(s_ptr + (n_row // SO) * s_st + k0 // SI, mask=n_row < N,
                                  other=0.0)
    last = True
    if SPLIT_K > 1:
        acc, last = finish_split(acc, ws_ptr, cnt_ptr, m_row.to(tl.int64) * N + n_row, tile_ok,
                                 pid_m * tl.num_programs(0) + pid_n, pid_k, M, N, SPLIT_K)
    if last:
        if PER_ROW:
            acc *= tl.load(s_ptr + (n_row // SO) * s_st, mask=n_row < N, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_row, mask=n_row < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + m_row.to(tl.int64) * y_st + n_row, acc.to(y_ptr.dtype.element_ty),
                 mask=tile_ok)


def runs_dynamic(activations: str, block: tuple[int, int], k: int) -> bool:
    """Whether a weight of K = k columns in scale blocks `block` takes dynamic activations:
    per-row (and per-tensor) scales only. Block-scaled weights run weight-only in either
    mode: with them the dynamic GEMM failed its engine test on the H200 (tokens of a tiny
    fp32 checkpoint with 16 x 32 blocks differ from the fake-quantized reference; passing
    in Triton's interpreter), not yet understood."""
    return activations == "dynamic" and block[1] >= k


def fits(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether fp8_linear takes x: [T, K] of a float dtype, and scale blocks whose K tiles the
    GEMM can align to (one K block, or si a multiple of 16)."""
    k = x.shape[-1]
    return (x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (block[1] >= k or (block[1] & -block[1]) >= 16))


def chosen_config(t: int, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  counters: torch.Tensor, dynamic: bool = False) -> GemmConfig:
    """choose_config (choose_config_fp8x when dynamic) for t tokens through this weight: K
    tiles up to 256 (512 dynamic) columns with per-row scales, else within one scale block."""
    if scale.shape[1] != 1:
        block_k_max = block[1] & -block[1]
    else:
        block_k_max = 512 if dynamic else 256
    choose = choose_config_fp8x if dynamic else choose_config
    return choose(t, q.shape[0], q.shape[1], block_k_max, num_sms(q.device), counters.numel())


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None, counters: torch.Tensor,
               config: GemmConfig | None = None, dynamic: bool = False) -> torch.Tensor:
    """fp8_linear_ref's result through the Triton GEMM. x: [T, K] (unit last stride); q:
    [N, K] contiguous; counters: split_k.tile_counters(N); config: None for chosen_config's;
    dynamic: x rounded to e4m3 in blocks (quantize_tokens; below DENSE_MIN_M tokens)."""
    require_triton()
    (t, k), n = x.shape, q.shape[0]
    if not fits(x, block):
        raise ValueError(f"fp8_linear takes 2-D float x and K blocks of 16n columns, got "
                         f"{tuple(x.shape)} {x.dtype}, blocks {block}")
    dynamic = dynamic and t < DENSE_MIN_M  # as fp8_linear_ref, whichever tiles run
    if config is None and t >= DENSE_MIN_M:  # cuBLAS on a bf16 copy beats our wide tiles
        return F.linear(x, dequantize_to(q, scale, block, x.dtype), bias)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cfg = config or chosen_config(t, q, scale, block, counters, dynamic)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m), cfg.split_k)
    ws = (torch.empty(cfg.split_k, t, n, dtype=torch.float32, device=x.device)
          if cfg.split_k > 1 else y)
    xs = scale  # unread unless dynamic
    if dynamic:
        if X_BLOCK % cfg.block_k:
            raise ValueError(f"K tiles of {cfg.block_k} straddle activation blocks of {X_BLOCK}")
        x, xs = quantize_tokens(x)
    kernel = jit_kernel(_fp8_gemm_kernel, x.device)
    kernel[grid](x, q, scale, xs, bias if bias is not None else y, y, ws, counters, t, n, k,
                 x.stride(0), y.stride(0), scale.stride(0), xs.stride(0), *block,
                 FP8_X=dynamic, X_BLOCK=X_BLOCK,
                 PER_ROW=scale.shape[1] == 1,
                 HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
                 EVEN_K=k % (cfg.block_k * cfg.split_k) == 0, SWAP=cfg.swap,
                 IEEE=x.dtype == torch.float32,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
