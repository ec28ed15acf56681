"""FP8 checkpoints, read from their own config.json `quantization_config` and dequantized
as they load (the reference path: every backend, the CPU included; the base then runs
in the engine's dtype, and LoRA reads the same activations an adapter trained on the
dequantized base saw).

Formats:
- `quant_method: "fp8"` with `weight_block_size` [bo, bi] (DeepSeek-V3, Qwen3-*-FP8): a
  float8_e4m3fn `weight` [out, in] and a float32 `weight_scale_inv` [ceil(out/bo),
  ceil(in/bi)]; W = weight * weight_scale_inv of its block. Without a block size, one
  `weight_scale_inv` per tensor.
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (RedHatAI's FP8): a
  float8_e4m3fn `weight` and `weight_scale`, per tensor [1] or per output channel
  [out, 1]; W = weight * weight_scale. Activation scales (`input_scale`) only matter to
  an FP8 GEMM and are skipped here.
Anything else is refused at start with a message naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.config import ConfigError

FP8_DTYPES = (torch.float8_e4m3fn,)
# per-tensor scale names each format stores beside a quantized `weight`
_WEIGHT_SCALES = {"fp8": "weight_scale_inv", "compressed-tensors": "weight_scale"}
_SKIPPED = ("input_scale", "k_scale", "v_scale")  # activation / KV-cache scales: FP8 GEMMs only


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # "fp8" | "compressed-tensors"
    block: tuple[int, int] | None  # fp8's weight_block_size; None: per tensor or per channel

    @property
    def scale_suffix(self) -> str:
        return _WEIGHT_SCALES[self.method]

    def is_scale(self, name: str) -> bool:
        return name.endswith("." + self.scale_suffix)

    def is_skipped(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in _SKIPPED

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """weight [out, in] (float8) times its scale, in float32."""
        if scale is None:
            raise ConfigError(f"{name} is float8 but the checkpoint has no {self.scale_suffix} "
                              "for it")
        w, s = weight.to(torch.float32), scale.to(torch.float32)
        if self.block is not None:  # s: [ceil(out/bo), ceil(in/bi)]
            bo, bi = self.block
            want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
            if tuple(s.shape) != want:
                raise ConfigError(f"{name}: {self.scale_suffix} has shape {tuple(s.shape)}, "
                                  f"expected {want} for blocks of {list(self.block)}")
            s = s.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
        elif s.numel() == w.shape[0] and s.numel() != 1:  # per output channel
            s = s.reshape(-1, 1)
        elif s.numel() != 1:
            raise ConfigError(f"{name}: {self.scale_suffix} has {s.numel()} values; expected 1 "
                              f"or one per output row ({w.shape[0]})")
        return w * s


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_LINEAR_PARAMS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def is_linear_weight(param: str) -> bool:
    """A decoder layer's linear weight (what FP8 checkpoints quantize; not the embedding,
    the head or the norms)."""
    return param.endswith(_LINEAR_PARAMS)


def round_to_fp8(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] rounded to float8_e4m3fn with one scale per output row (vLLM's
    --quantization fp8 on a dense checkpoint), back in float32."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def scheme_of(model_dir: str | Path) -> Fp8Scheme | None:
    """The checkpoint's quantization scheme, None for a dense one; refuses any other."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("config.json quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return Fp8Scheme("fp8", _block(qc.get("weight_block_size")))
    if method == "compressed-tensors":
        _check_compressed_fp8(qc)
        return Fp8Scheme("compressed-tensors", None)
    raise ConfigError(
        f"quantization_config.quant_method {method!r} is not served; metrale loads FP8 "
        "checkpoints ('fp8' with or without weight_block_size, 'compressed-tensors' "
        "float-quantized)")


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int and v > 0 for v in value)):
        raise ConfigError(f"quantization_config.weight_block_size {value!r} is not two "
                          "positive integers")
    return value[0], value[1]


def _check_compressed_fp8(qc: dict) -> None:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ConfigError(f"quantization_config.format {fmt!r} is not served (only "
                          "'float-quantized': FP8 weights)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config.config_groups is missing")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ConfigError(f"quantization_config.config_groups.{name}.weights is missing")
        for key, allowed in (("num_bits", (8,)), ("type", ("float",)),
                             ("strategy", ("tensor", "channel"))):
            if weights.get(key) not in allowed:
                raise ConfigError(
                    f"quantization_config.config_groups.{name}.weights.{key} "
                    f"{weights.get(key)!r} is not served (FP8 weights: num_bits 8, type "
                    "float, strategy tensor or channel)")
