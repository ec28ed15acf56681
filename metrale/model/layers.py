"""RMSNorm, rotary embeddings and LoRA projections of a Llama-family decoder."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ConfigError, ModelConfig
from metrale.forward_context import get_context
from metrale.ops import fp8_linear as fp8
from metrale.ops import fused_triton as fused
from metrale.ops import int4_linear as int4
from metrale.ops import lora as lora_ops
from metrale.ops.attention import store_kv
from metrale.ops.lora import lora_linear
from metrale.ops.split_k import tile_counters


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., N] -> normalized x; with residual: (normalized s, s), s = x + residual."""
        if residual is not None:
            if fused.rows_usable(x, residual) and self.weight.dtype == x.dtype:
                return fused.add_rmsnorm(x, residual, self.weight, self.eps)  # one launch, not 2
            return fused.add_rmsnorm_ref(x, residual, self.weight, self.eps)
        if x.dim() == 2 and fused.usable(x):  # one launch instead of ~7 (same arithmetic)
            return fused.rmsnorm(x, self.weight, self.eps)
        return fused.rmsnorm_ref(x, self.weight, self.eps)


def _inv_freq(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies; long: LongRoPE's long-context factors."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind in ("longrope", "su"):
        factors = scaling["long_factor" if long else "short_factor"]
        if len(factors) != dim // 2:
            raise ConfigError(f"rope_scaling {'long' if long else 'short'}_factor has "
                              f"{len(factors)} values, expected {dim // 2}")
        return inv / torch.tensor([float(f) for f in factors], dtype=torch.float32)
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, "
                      "longrope)")


def _longrope(cfg: ModelConfig) -> tuple[int, float] | None:
    """LongRoPE's (original_max_position_embeddings, cos/sin scale), None for other kinds.
    The scale is transformers': sqrt(1 + ln(factor) / ln(original)) with factor =
    max_position_embeddings / original unless the config gives either."""
    scaling = dict(cfg.rope_scaling or ())
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return None
    original = int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = float(scaling.get("factor") or cfg.max_position_embeddings / original)
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return original, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables over the first rotary_dim dims of each head (all of them unless the
    model rotates a part: Phi-4-mini). LongRoPE: positions below the original context use
    the short factors, the rest the long ones (what transformers computes for a prompt
    within the original context and every token decoded after it; a longer prompt it turns
    with the long factors from position 0)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.partial = cfg.rotary_dim != cfg.head_dim
        self.register_buffer("cos", torch.empty(max_positions, cfg.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, cfg.rotary_dim), persistent=False)
        self.build()

    def build(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after meta init too)."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, _inv_freq(self.cfg).to(device))  # [P, R/2]
        longrope = _longrope(self.cfg)
        if longrope is not None:
            original, scale = longrope
            long = torch.outer(t, _inv_freq(self.cfg, long=True).to(device))
            freqs = torch.where((t >= original)[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        self.cos, self.sin = emb.cos(), emb.sin()
        if longrope is not None:
            self.cos, self.sin = self.cos * scale, self.sin * scale

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, H, D], k: [T, KV, D], positions: [T]
        if (not self.partial and fused.rotary_usable(q, self.cos) and q.stride(2) == 1
                and k.stride(2) == 1):
            return fused.rotary(positions, q, k, self.cos, self.sin)  # one launch, not ~18
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, R]
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:  # the dims past rotary_dim pass through
            r = self.cfg.rotary_dim
            return (torch.cat((_rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                    torch.cat((_rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
        """forward, then k and v into the caches (store_kv): rotated q. On CUDA one launch
        (two index_copy passes were 3.5% of an 8B decode step)."""
        if not self.partial and fused.rotary_store_usable(q, k, v, self.cos, k_cache, v_cache):
            return fused.rotary_store_kv(positions, q, k, v, self.cos, self.sin, k_cache, v_cache,
                                         slot_mapping)
        q, k = self.forward(positions, q, k)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class LoraProjection(nn.Module):
    """A (possibly fused) linear projection plus the per-token LoRA delta of the modules it
    fuses (metrale.ops.lora; the DoRA ops take the bias back out of y, so the base matmul
    stays one fused addmm). Its weight is dense, FP8 after use_fp8 (metrale.ops.fp8_linear)
    or 4-bit after use_int4 (metrale.ops.int4_linear): the Triton GEMMs on CUDA, the
    dequantizing references elsewhere."""

    def __init__(self, layer: int, modules: tuple[str, ...], in_features: int,
                 out_features: tuple[int, ...], bias: bool = False) -> None:
        super().__init__()
        self.layer, self.modules_ = layer, modules
        self.in_features = in_features
        total = sum(out_features)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.zeros(total)) if bias else None
        bounds = [0, *itertools.accumulate(out_features)]
        self.out_slices = tuple(slice(a, b) for a, b in zip(bounds, bounds[1:]))
        self.quant: str | None = None  # "fp8" | "int4"
        self.register_buffer("weight_scale", None)  # FP8: float32 [ceil(N/so), ceil(K/si)]; 4-bit: [N, G]
        self.register_buffer("weight_zero", None)  # 4-bit: uint8 [N, G]
        self.register_buffer("codebook", None)  # 4-bit NF4 / FP4: float32 [16]
        self.register_buffer("input_perm", None)  # 4-bit act-order: int64 [K]
        self.register_buffer("tile_counters", None, persistent=False)
        self.scale_block = (1, in_features)  # FP8: (so, si), the rows and columns a scale covers
        self.fp8_dynamic = False  # FP8: x rounded to e4m3 for the base GEMM (fp8_linear)
        self.int4_layout: int4.Int4Layout | None = None

    def use_fp8(self, block: tuple[int, int], activations: str = fp8.DEFAULT_ACTIVATIONS) -> None:
        """Hold the weight as float8_e4m3fn [N, K] with a float32 scale per (so, si) block,
        both uninitialised (the loader fills them; on the meta device too, then build());
        activations: one of fp8.ACTIVATIONS."""
        if activations not in fp8.ACTIVATIONS:
            raise ValueError(f"FP8 activations {activations!r}: choose from {fp8.ACTIVATIONS}")
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=fp8.FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.scale_block = block
        self.weight_scale = torch.empty(-(-n // block[0]), -(-k // block[1]),
                                        dtype=torch.float32, device=device)
        self.tile_counters = tile_counters(n, device)
        self.fp8_dynamic = fp8.runs_dynamic(activations, block, k)
        self.quant = "fp8"

    def use_int4(self, layout: int4.Int4Layout) -> None:
        """Hold the weight as 4-bit codes in int4_linear's packed layout with its per-group
        scales (and zero points, or a codebook), all uninitialised, as use_fp8."""
        n, k = self.weight.shape[0], self.in_features
        int4.check_group(layout.group, k)
        device = self.weight.device
        groups = -(-k // layout.group)
        self.weight = nn.Parameter(torch.empty(n, int4.padded_k(k) // 8, dtype=torch.int32,
                                               device=device), requires_grad=False)
        self.weight_scale = torch.empty(n, groups, dtype=layout.scale_dtype, device=device)
        if layout.zero:
            self.weight_zero = torch.empty(n, groups, dtype=torch.uint8, device=device)
        if layout.codebook:
            self.codebook = torch.empty(16, dtype=torch.float32, device=device)
        if layout.act_order:
            self.input_perm = torch.empty(k, dtype=torch.int64, device=device)
        self.tile_counters = tile_counters(n, device)
        self.int4_layout, self.quant = layout, "int4"

    def build(self) -> None:
        """Zero the split-K tile counters (after to_empty: computed state, not a weight)."""
        if self.tile_counters is not None and not self.tile_counters.is_meta:
            self.tile_counters.zero_()

    @property
    def is_fp8(self) -> bool:
        return self.quant == "fp8"

    def _int4_args(self) -> tuple:
        return (self.weight, self.weight_scale, self.weight_zero, self.codebook,
                self.int4_layout.group)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight W [N, K] the base computes with, in dtype (DoRA's norms read it)."""
        if self.quant == "fp8":
            return fp8.dequantize(self.weight, self.weight_scale, self.scale_block).to(dtype)
        if self.quant == "int4":
            w = int4.dequantize(*self._int4_args(), self.in_features)  # columns sorted by group
            if self.input_perm is not None:
                w = w[:, torch.argsort(self.input_perm)]
            return w.to(dtype)
        return self.weight

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> the base linear's y [T, N], bias included."""
        triton_ok = x.is_cuda or lora_ops.TRITON_ON_CPU
        if self.quant == "fp8":
            if triton_ok and fp8.fits(x, self.scale_block):
                return fp8.fp8_linear(x.contiguous(), self.weight, self.weight_scale,
                                      self.scale_block, self.bias, self.tile_counters,
                                      dynamic=self.fp8_dynamic)
            return fp8.fp8_linear_ref(x, self.weight, self.weight_scale, self.scale_block,
                                      self.bias, self.fp8_dynamic)
        if self.quant == "int4":
            if self.input_perm is not None:
                x = x.index_select(1, self.input_perm)  # [T, K] in the weight's column order
            if triton_ok and x.dim() == 2:
                return int4.int4_linear(x.contiguous(), *self._int4_args(), self.bias,
                                        self.tile_counters)
            return int4.int4_linear_ref(x, *self._int4_args(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = get_context().lora
        if lora is None:
            return self.base(x)  # [T, out]
        return lora_linear(x, self.base, self.bias, lora, self.layer, self.modules_,
                           self.out_slices)
