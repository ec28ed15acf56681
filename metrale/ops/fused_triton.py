"""Fused decoder kernels for CUDA, one launch each: RMSNorm (with the residual add before
it), rotary embedding (with the K/V cache write), SiLU- or GeLU-and-multiply. In torch,
RMSNorm is ~7 launches and rotary ~18 per layer: ~1300 per decode step of a 32-layer model,
mostly launch gap.

The arithmetic is the torch path's (the *_ref functions below, rotary's in
metrale.model.layers: the tests' oracle), bitwise equal except where fp32 math runs in
another order, and then within an ulp of the activation dtype. ENABLED = False keeps the
torch path on CUDA (bench/gpu_all.py when these kernels fail their tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.ops.triton_utils import device_function, is_interpreted, jit_kernel, next_pow2, tl, triton

ENABLED = triton is not None
_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@device_function
def _round(x, dtype: tl.constexpr, RNE_BITS: tl.constexpr):
    """fp32 x rounded to nearest even, as torch casts; with RNE_BITS on the bits, since the
    interpreter's bf16 cast truncates (the CPU tests compare bitwise)."""
    if RNE_BITS and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) >> 16 << 16  # a tie goes to the even bf16 mantissa
        x = tl.where(x == x, b.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(dtype)


def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, N, x_st, r_st, y_st, s_st, eps,
                    ADD: tl.constexpr, RNE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    ok = n < N
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_st + n, mask=ok, other=0.0)
    if ADD:  # the residual stream first: torch's x + residual (fp32, rounded to dt), stored
        r = tl.load(r_ptr + row * r_st + n, mask=ok, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), dt, RNE_BITS)
        tl.store(s_ptr + row * s_st + n, x, mask=ok)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = _round(x * rstd, dt, RNE_BITS)  # torch: (x * rsqrt).to(dtype), then * weight
    w = tl.load(w_ptr + n, mask=ok, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(y_ptr + row * y_st + n, _round(out, dt, RNE_BITS), mask=ok)


def _act_mul_kernel(g_ptr, y_ptr, I, g_st, y_st, GELU: tl.constexpr, RNE_BITS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    dt = y_ptr.dtype.element_ty
    gate = tl.load(g_ptr + row * g_st + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(g_ptr + row * g_st + I + i, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # torch: 0.5 x (1 + tanh(u)) in fp32, tanh(u) as 2 / (1 + exp(-2u)) - 1 here
        # (no tanh in the interpreter) so that 1 + tanh saturates to 0 where torch's does
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = tl.math.div_rn(2.0, 1.0 + tl.exp(-2.0 * u)) - 1.0
        act = 0.5 * gate * (1.0 + tanh)
    else:  # torch: silu as x / (1 + exp(-x)) in fp32 (an IEEE division, not Triton's
        act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))  # approximate one)
    # rounded to dt as torch's activation is; then the product of the two dt values, rounded
    act = _round(act, dt, RNE_BITS)
    tl.store(y_ptr + row * y_st + i, _round(act.to(tl.float32) * up, dt, RNE_BITS), mask=ok)


def _rotary_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                   q_st, q_sh, k_st, k_sh, v_st, v_sh, qo_st, ko_st, H, KV, tab_st,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr):
    """Heads [0, H) are q's, [H, H + KV) k's, and with STORE [H + KV, H + 2 KV) v's (copied,
    not rotated). k goes to row t of ko, or with STORE k and v to row slot_ptr[t] of the
    caches ko/vo."""
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row = t
    if STORE:
        row = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + pos * tab_st + d)  # [HALF] fp32: first and second halves
    c2 = tl.load(cos_ptr + pos * tab_st + HALF + d)
    s1 = tl.load(sin_ptr + pos * tab_st + d)
    s2 = tl.load(sin_ptr + pos * tab_st + HALF + d)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] over q heads, k heads, v heads
    is_q = h < H
    is_k = (h >= H) & (h < H + KV)
    is_v = h < 0
    if STORE:
        is_v = (h >= H + KV) & (h < H + 2 * KV)
    hk = tl.where(is_k, h - H, tl.where(is_v, h - H - KV, 0))
    src = tl.where(is_q[:, None], q_ptr + t * q_st + h[:, None] * q_sh,
                   tl.where(is_k[:, None], k_ptr + t * k_st + hk[:, None] * k_sh,
                            v_ptr + t * v_st + hk[:, None] * v_sh))  # [BH, 1]
    dst = tl.where(is_q[:, None], qo_ptr + t * qo_st + h[:, None] * (2 * HALF),
                   tl.where(is_k[:, None], ko_ptr + row * ko_st + hk[:, None] * (2 * HALF),
                            vo_ptr + row * ko_st + hk[:, None] * (2 * HALF)))
    m = (is_q | is_k | is_v)[:, None]
    x1 = tl.load(src + d[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, HALF]
    x2 = tl.load(src + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    # out = x * cos + cat(-x2, x1) * sin, in fp32 (as _rotate), rounded once; v as it is
    rot = (~is_v)[:, None]
    o1 = tl.where(rot, x1 * c1[None, :] - x2 * s1[None, :], x1)
    o2 = tl.where(rot, x2 * c2[None, :] + x1 * s2[None, :], x2)
    tl.store(dst + d[None, :], o1.to(qo_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + d[None, :], o2.to(qo_ptr.dtype.element_ty), mask=m)


def usable(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def rows_usable(*ts: torch.Tensor) -> bool:
    """Whether add_rmsnorm and silu_mul take these without a copy: CUDA [T, N] tensors of one
    shape and supported dtype, unit last stride."""
    x = ts[0]
    return usable(x) and x.dim() == 2 and x.dtype in _ROW_DTYPES and all(
        t.shape == x.shape and t.dtype == x.dtype and t.stride(1) == 1 for t in ts)


def rotary_usable(q: torch.Tensor, cos: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (usable(q) and q.shape[-1] % 2 == 0 and half & (half - 1) == 0
            and cos.dtype == torch.float32 and cos.stride(1) == 1)


def rotary_store_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (rotary_usable(q, cos) and all(x.stride(-1) == 1 for x in (q, k, v))
            and v.shape == k.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape
            and all(x.dtype == q.dtype for x in (k, v, k_cache, v_cache)))


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics as transformers does, so low-precision runs match it
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rmsnorm_ref(s, weight, eps), s


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)  # each [T, I]
    return F.silu(gate) * up


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)  # each [T, I]
    return F.gelu(gate, approximate="tanh") * up


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, N = x.shape
    x = _unit_rows(x)
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    r = x if residual is None else _unit_rows(residual)  # unread without a residual
    s = y if residual is None else torch.empty_like(y)
    if T:
        block = next_pow2(N)
        kernel = jit_kernel(_rmsnorm_kernel, x.device)
        kernel[(T,)](x, r, weight, y, s, N, x.stride(0), r.stride(0), y.stride(0), s.stride(0), eps,
                     ADD=residual is not None, RNE_BITS=is_interpreted(kernel), BLOCK=block,
                     num_warps=8 if block >= 4096 else 4)
    return y, s


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s), s) for s = x + residual, both new tensors. Out of place, unlike vLLM's
    fused_add_rms_norm: in place saves memory, not traffic, and the inputs stay as
    add_rmsnorm_ref leaves them (at layer 0 the residual is the embedding output)."""
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns, then up) -> silu(gate) * up: [T, I]."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> gelu_tanh(gate) * up: [T, I] (Gemma's GeGLU): gelu_tanh_mul_ref's
    but where the two tanh's fp32 roundings tip a bf16 one, or where 1 + tanh cancels (there
    both are within a few fp32 ulps of the gate)."""
    return _act_mul(gate_up, gelu=True)


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    T, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns: gate and up need the same width")
    I = width // 2
    gate_up = _unit_rows(gate_up)
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T and I:
        block = min(1024, next_pow2(I))
        kernel = jit_kernel(_act_mul_kernel, gate_up.device)
        kernel[(T, triton.cdiv(I, block))](gate_up, out, I, gate_up.stride(0), out.stride(0),
                                           GELU=gelu, RNE_BITS=is_interpreted(kernel),
                                           BLOCK=block, num_warps=4)
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KV, D] (unit last stride) -> rotated copies; cos, sin: [P, D]
    float32 tables indexed by positions [T]."""
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, unlike q
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_rotary(positions, q, k, k, qo, ko, ko, positions, cos, sin, store=False)
    return qo, ko


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """rotary, k and v written into the caches [blocks, bs, KV, D] at slot_mapping [T]
    (store_kv's two index_copy passes, ~3 us each a layer at decode); returns q rotated."""
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, unlike q
    _launch_rotary(positions, q, k, v, qo, k_cache, v_cache, slot_mapping, cos, sin, store=True)
    return qo


def _launch_rotary(positions, q, k, v, qo, ko, vo, rows, cos, sin, store: bool) -> None:
    """ko/vo: [T, KV, D] outputs, or with store the caches, row t at rows[t]."""
    T, H, D = q.shape
    KV = k.shape[1]
    if not T:
        return
    heads = H + (2 if store else 1) * KV
    block_h = min(16, next_pow2(heads))
    jit_kernel(_rotary_kernel, q.device)[(T, triton.cdiv(heads, block_h))](
        q, k, v, qo, ko, vo, positions, rows, cos, sin, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0), KV * D, H, KV,
        cos.stride(0), HALF=D // 2, BLOCK_H=block_h, STORE=store, num_warps=4)
