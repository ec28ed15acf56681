"""Linear layers over float8_e4m3fn weights: y = x @ (q * s)^T + bias, weight-only. The
activations stay in the model's dtype, so LoRA (and anything else reading x) sees what an
adapter trained on the dequantized base saw.

Scales are a float32 grid `scale[ceil(N / so), ceil(K / si)]`: one per output row is
(so, si) = (1, K) (per-tensor and per-channel checkpoints, --quantization fp8), block-wise
checkpoints keep their blocks. fp8_linear_ref is the oracle (and the CPU path). The Triton
GEMM (as x @ W^T, or as its transpose W @ x^T: choose_config's pick) converts e4m3 to the
activation dtype in registers (exact: e4m3's values are all bf16/fp16 values), scales per
row in the epilogue or per (row block, K block) per tile, and splits K at decode sizes, the
last split of a tile summing the others' partials (a tile counter that resets itself), so
that a skinny GEMM puts every SM on the weight stream. From DENSE_MIN_M tokens on (prefill
chunks) the weight is dequantized to a scratch copy for cuBLAS, faster there than our tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.ops.split_k import GemmConfig, finish_split, num_sms
from metrale.ops.triton_utils import jit_kernel, next_pow2, require_triton, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SPLIT_MAX_M = 64  # past this many rows a GEMM has tiles enough without splitting K
DENSE_MIN_M = 256  # from here on: the weight dequantized (3 bytes an element), then cuBLAS


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] = q * s, each scale spread over its (so, si) block."""
    so, si = block
    n, k = q.shape
    s = scale.repeat_interleave(so, 0)[:n].repeat_interleave(si, 1)[:, :k]  # [N, K]
    return q.to(torch.float32) * s


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N]: the weight dequantized, rounded to x's dtype, then F.linear (what
    a checkpoint dequantized at load computes)."""
    return F.linear(x, dequantize(q, scale, block).to(x.dtype), bias)


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


def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, x_st, y_st,
                     s_st, SO, SI, PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """acc = x [BM, K] @ W^T [K, BN], or with SWAP its transpose W @ x^T (the weight the
    MMA's wide operand, a decode step's few tokens its narrow one). EVEN_K: no mask along
    K, the contiguous dimension, so loads stay 16 bytes wide."""
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
        if SWAP:
            part = tl.dot(w.to(dt), x, input_precision="ieee" if IEEE else "tf32")
        else:
            part = tl.dot(x, w.to(dt), input_precision="ieee" if IEEE else "tf32")
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
        tl.store(y_ptr + m_row.to(tl.int64) * y_st + n_row, acc.to(dt), mask=tile_ok)


def fits(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether fp8_linear takes x: [T, K] of a float dtype, and scale blocks whose K tiles the
    GEMM can align to (one K block, or si a multiple of 16)."""
    k = x.shape[-1]
    return (x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (block[1] >= k or (block[1] & -block[1]) >= 16))


def chosen_config(t: int, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  counters: torch.Tensor) -> GemmConfig:
    """choose_config for t tokens through this weight: K tiles up to 256 columns with
    per-row scales, else within one scale block."""
    block_k_max = 256 if scale.shape[1] == 1 else block[1] & -block[1]
    return choose_config(t, q.shape[0], q.shape[1], block_k_max, num_sms(q.device),
                         counters.numel())


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None, counters: torch.Tensor,
               config: GemmConfig | None = None) -> torch.Tensor:
    """fp8_linear_ref's result through the Triton GEMM. x: [T, K] (unit last stride); q:
    [N, K] contiguous; counters: split_k.tile_counters(N); config: None for chosen_config's."""
    require_triton()
    (t, k), n = x.shape, q.shape[0]
    if not fits(x, block):
        raise ValueError(f"fp8_linear takes 2-D float x and K blocks of 16n columns, got "
                         f"{tuple(x.shape)} {x.dtype}, blocks {block}")
    if config is None and t >= DENSE_MIN_M:  # cuBLAS on a bf16 copy beats our wide tiles
        return F.linear(x, dequantize_to(q, scale, block, x.dtype), bias)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cfg = config or chosen_config(t, q, scale, block, counters)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m), cfg.split_k)
    ws = (torch.empty(cfg.split_k, t, n, dtype=torch.float32, device=x.device)
          if cfg.split_k > 1 else y)
    kernel = jit_kernel(_fp8_gemm_kernel, x.device)
    kernel[grid](x, q, scale, bias if bias is not None else y, y, ws, counters, t, n, k,
                 x.stride(0), y.stride(0), scale.stride(0), *block, PER_ROW=scale.shape[1] == 1,
                 HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
                 EVEN_K=k % (cfg.block_k * cfg.split_k) == 0, SWAP=cfg.swap,
                 IEEE=x.dtype == torch.float32,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
