"""Fused elementwise kernels for the decoder on CUDA: RMSNorm and rotary embedding.

In torch, RMSNorm is ~7 launches and rotary ~18 per layer (casts, slices, cat, neg,
muls); at decode batch sizes each is a few microseconds of mostly launch gap, ~1300
launches per step on a 32-layer model, comparable to the time spent reading the
weights. One launch each here, with the same arithmetic as the torch code in
metrale.model.layers (fp32 math, the same roundings to the activation dtype), so bf16
results agree to within an ulp of fp32 summation order.

ENABLED = False (or METRALE_FUSED_OPS=0) keeps the torch path on CUDA too.
"""

from __future__ import annotations

import os

import torch

from metrale.ops.triton_utils import jit_kernel, next_pow2, tl, triton

ENABLED = os.environ.get("METRALE_FUSED_OPS", "1") != "0" and triton is not None


def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N, x_st, y_st, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    ok = n < N
    x = tl.load(x_ptr + row * x_st + n, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(y_ptr.dtype.element_ty)  # torch: (x * rsqrt).to(dtype), then * weight
    w = tl.load(w_ptr + n, mask=ok, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(y_ptr + row * y_st + n, out.to(y_ptr.dtype.element_ty), mask=ok)


def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
                   q_st, q_sh, k_st, k_sh, qo_st, ko_st, H, KV, tab_st,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + pos * tab_st + d)  # [HALF] fp32: first and second halves
    c2 = tl.load(cos_ptr + pos * tab_st + HALF + d)
    s1 = tl.load(sin_ptr + pos * tab_st + d)
    s2 = tl.load(sin_ptr + pos * tab_st + HALF + d)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] over q heads then k heads
    is_q = h < H
    is_k = (h >= H) & (h < H + KV)
    hk = tl.where(is_k, h - H, 0)
    src = tl.where(is_q[:, None], q_ptr + t * q_st + h[:, None] * q_sh,
                   k_ptr + t * k_st + hk[:, None] * k_sh)  # [BH, 1]
    dst = tl.where(is_q[:, None], qo_ptr + t * qo_st + h[:, None] * (2 * HALF),
                   ko_ptr + t * ko_st + hk[:, None] * (2 * HALF))
    m = (is_q | is_k)[:, None]
    x1 = tl.load(src + d[None, :], mask=m, other=0.0)  # [BH, HALF]
    x2 = tl.load(src + HALF + d[None, :], mask=m, other=0.0)
    # out = x * cos + cat(-x2, x1) * sin, in fp32 (as _rotate), rounded once
    o1 = x1.to(tl.float32) * c1[None, :] - x2.to(tl.float32) * s1[None, :]
    o2 = x2.to(tl.float32) * c2[None, :] + x1.to(tl.float32) * s2[None, :]
    tl.store(dst + d[None, :], o1.to(qo_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + d[None, :], o2.to(qo_ptr.dtype.element_ty), mask=m)


def usable(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def rotary_usable(q: torch.Tensor, cos: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (usable(q) and q.shape[-1] % 2 == 0 and half & (half - 1) == 0
            and cos.dtype == torch.float32 and cos.stride(1) == 1)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] (unit last stride) -> weight * normalized x, in x.dtype."""
    T, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        block = next_pow2(N)
        jit_kernel(_rmsnorm_kernel, x.device)[(T,)](
            x, weight, y, N, x.stride(0), y.stride(0), eps, BLOCK=block,
            num_warps=8 if block >= 4096 else 4)
    return y


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KV, D] (any row/head strides, unit last) -> rotated copies;
    cos, sin: [P, D] float32 tables indexed by positions [T]."""
    T, H, D = q.shape
    KV = k.shape[1]
    qo = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, KV, D), dtype=k.dtype, device=k.device)
    if T:
        block_h = min(16, next_pow2(H + KV))
        jit_kernel(_rotary_kernel, q.device)[(T, triton.cdiv(H + KV, block_h))](
            q, k, qo, ko, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), ko.stride(0), H, KV, cos.stride(0), HALF=D // 2, BLOCK_H=block_h,
            num_warps=4)
    return qo, ko
