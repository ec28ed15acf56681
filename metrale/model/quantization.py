"""Quantized checkpoints, read from their config.json `quantization_config`: each format's
tensors parsed into what the loader keeps (FP8 codes and scales for metrale.ops.fp8_linear,
4-bit codes by output row, Int4Codes, for metrale.ops.int4_linear) or dequantized to float32
(the reference path, for weights the kernels do not take). LoRA reads the activations an
adapter trained on the dequantized base saw either way. docs/DESIGN.md ("Quantized
checkpoints") gives each format's tensors; anything else is refused at start naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.config import ConfigError
from metrale.ops.fp8_linear import dequantize
from metrale.ops.int4_linear import dequantize_codes

FP8_DTYPES = (torch.float8_e4m3fn,)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SKIPPED = ("input_scale", "k_scale", "v_scale")  # activation / KV-cache scales: FP8 GEMMs only
# per method: the suffix of a quantized weight, and of the tensors its dequantization reads
_WEIGHT = {"fp8": "weight", "compressed-tensors": "weight", "awq": "qweight", "gptq": "qweight",
           "bitsandbytes": "weight"}
_AUX = {"fp8": ("weight_scale_inv",), "compressed-tensors": ("weight_scale",),
        "awq": ("qzeros", "scales"), "gptq": ("qzeros", "scales", "g_idx"),
        "bitsandbytes": ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
                         "bitsandbytes__nf4", "bitsandbytes__fp4")}
MAX_QUANT_STATE_BYTES = 4096  # a bitsandbytes quant_state JSON holds a few fields
_AWQ_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)  # column c's nibble
_SEQ_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "fp8" | "compressed-tensors" | "awq" | "gptq" | "bitsandbytes"
    block: tuple[int, int] | None = None  # fp8's weight_block_size; None: per tensor / channel
    group_size: int = 128  # awq, gptq; -1: one group per column
    zero_offset: int = 0  # gptq's v1 checkpoint format stores each zero minus one

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        suffix = "." + _WEIGHT[self.method]
        if self.method == "bitsandbytes":
            return name.endswith(suffix) and tensor.dtype == torch.uint8
        return name.endswith(suffix) and (suffix == ".qweight" or tensor.dtype in FP8_DTYPES)

    def is_aux(self, name: str) -> bool:
        """A tensor dequantization reads (scales, zeros, group indices) or never needs."""
        last = name.rsplit(".", 1)[-1]
        return last in _AUX[self.method] or last in _SKIPPED

    def dequantize(self, prefix: str, tensor: torch.Tensor,
                   aux: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight [out, in]; aux: by full name; prefix: "model.layers.0.[...].q_proj."."""
        if self.method == "bitsandbytes":
            return _bnb_4bit(prefix + "weight", tensor, aux).dequantize()
        if self.method in ("fp8", "compressed-tensors"):
            return dequantize(*self.fp8_parts(prefix, tensor, aux))
        return self.int4_codes(prefix, tensor, aux).dequantize()

    def fp8_parts(self, prefix: str, weight: torch.Tensor, aux: dict[str, torch.Tensor]):
        """(q [out, in] float8, scale grid float32, (so, si)) in metrale.ops.fp8_linear's
        layout: a block-wise checkpoint's own blocks; one scale per row otherwise."""
        part = _AUX[self.method][0]
        if prefix + part not in aux:
            raise ConfigError(f"{prefix}weight is quantized but the checkpoint has no "
                              f"{prefix}{part}")
        s = aux[prefix + part].to(torch.float32)
        out, d_in = weight.shape
        if self.block is not None:  # s: [ceil(out/bo), ceil(in/bi)]
            want = (-(-out // self.block[0]), -(-d_in // self.block[1]))
            if tuple(s.shape) != want:
                raise ConfigError(f"{prefix}weight_scale_inv has shape {tuple(s.shape)}, "
                                  f"expected {want} for blocks of {list(self.block)}")
            return weight, s, self.block
        if s.numel() not in (1, out):
            raise ConfigError(f"{prefix}: {s.numel()} weight scales; expected 1 or one per "
                              f"output row ({out})")
        return weight, s.reshape(-1, 1).expand(out, 1).contiguous(), (1, d_in)

    def int4_codes(self, prefix: str, tensor: torch.Tensor,
                   aux: dict[str, torch.Tensor]) -> Int4Codes | None:
        """The weight's 4-bit codes by output row; None for a bitsandbytes weight whose
        blocks straddle rows (it only dequantizes)."""
        if self.method == "bitsandbytes":
            return _bnb_4bit(prefix + "weight", tensor, aux).by_rows()
        parts = {}
        for part in _AUX[self.method]:
            if prefix + part not in aux and not (part == "g_idx" and self.method == "gptq"):
                raise ConfigError(f"{prefix}{_WEIGHT[self.method]} is quantized but the "
                                  f"checkpoint has no {prefix}{part}")
            parts[part] = aux.get(prefix + part)
        return self._int4(prefix, tensor, parts)

    def _int4(self, prefix: str, qweight: torch.Tensor, parts: dict) -> Int4Codes:
        if qweight.dtype != torch.int32 or parts["qzeros"].dtype != torch.int32 or \
                parts["scales"].dtype not in FLOAT_DTYPES or qweight.dim() != 2:
            raise ConfigError(f"{prefix}: qweight and qzeros must be 2-D int32 and scales "
                              f"floating point, got {qweight.dtype}, {parts['qzeros'].dtype}, "
                              f"{parts['scales'].dtype}")
        scales = parts["scales"]  # [groups, out]
        zeros = _unpack_columns(parts["qzeros"], self.method == "awq") + self.zero_offset
        if self.method == "awq":  # qweight [in, out/8], nibbles along out
            q = _unpack_columns(qweight, awq=True)  # [in, out]
        else:  # gptq: qweight [in/8, out], nibbles along in
            q = ((qweight.unsqueeze(1) >> _SEQ_SHIFTS.view(1, -1, 1)) & 0xF).reshape(-1, qweight.shape[1])
        if parts.get("g_idx") is not None:
            group = parts["g_idx"].to(torch.int64)
        else:  # groups by config.json: as many scales as groups, or the config lies
            size = q.shape[0] if self.group_size == -1 else self.group_size
            group = torch.arange(q.shape[0]) // size
            if scales.shape[0] != -(-q.shape[0] // size):
                raise ConfigError(f"{prefix}scales has {scales.shape[0]} groups; group_size "
                                  f"{self.group_size} over {q.shape[0]} inputs makes "
                                  f"{-(-q.shape[0] // size)}")
        if zeros.shape != scales.shape or q.shape[1] != scales.shape[1] or \
                group.numel() != q.shape[0] or int(group.max()) >= scales.shape[0] or \
                int(group.min()) < 0:
            raise ConfigError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros, scales "
                              f"{tuple(scales.shape)} and the groups do not fit together")
        return Int4Codes(q.t().to(torch.uint8), scales.t().contiguous(),  # zeros: 0..16 (v1)
                         zeros.t().to(torch.uint8).contiguous(), None, group)


@dataclass
class Int4Codes:
    """A 4-bit weight by output row: W[o, i] = (v(q[o, i]) - zero[o, g]) * scale[o, g], g =
    group_of[i], v the code or codebook[code]."""
    q: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # [out, groups], the checkpoint's float dtype
    zero: torch.Tensor | None  # uint8 [out, groups]
    codebook: torch.Tensor | None  # float32 [16]
    group_of: torch.Tensor  # int64 [in]

    def dequantize(self) -> torch.Tensor:
        return dequantize_codes(self.q, self.scale, self.zero, self.codebook, self.group_of)


@dataclass
class _Bnb4bit:
    codes: torch.Tensor  # int64 [out * in], row-major
    absmax: torch.Tensor  # float32, one per block of the flattened weight
    codebook: torch.Tensor  # float32 [16]
    shape: tuple[int, int]
    blocksize: int

    def dequantize(self) -> torch.Tensor:
        n = self.codes.numel()
        values = self.codebook[self.codes] * self.absmax[torch.arange(n) // self.blocksize]
        return values.reshape(self.shape)

    def by_rows(self) -> Int4Codes | None:
        out, d_in = self.shape
        if d_in % self.blocksize:
            return None
        return Int4Codes(self.codes.reshape(out, d_in).to(torch.uint8),
                         self.absmax.reshape(out, d_in // self.blocksize), None, self.codebook,
                         torch.arange(d_in) // self.blocksize)


def _aux_part(aux: dict[str, torch.Tensor], name: str, key: str) -> torch.Tensor:
    if f"{name}.{key}" not in aux:
        raise ConfigError(f"{name} is 4-bit but the checkpoint has no {name}.{key}")
    return aux[f"{name}.{key}"]


def bnb_state(name: str, aux: dict[str, torch.Tensor]) -> tuple[dict, tuple[int, int], int]:
    """(quant state, weight shape, blocksize) of bitsandbytes weight `name`."""
    state_key = next((k for k in ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
                      if f"{name}.{k}" in aux), "quant_state.bitsandbytes__nf4")
    raw = _aux_part(aux, name, state_key)
    if raw.dtype != torch.uint8 or raw.numel() > MAX_QUANT_STATE_BYTES:
        raise ConfigError(f"{name}.{state_key} is not a small JSON byte string")
    try:
        state = json.loads(bytes(raw.tolist()))
        shape, blocksize = [int(d) for d in state["shape"]], int(state["blocksize"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{name}.{state_key} is not bitsandbytes' quant state ({e})") from None
    if len(shape) != 2 or min(shape) <= 0 or blocksize <= 0:
        raise ConfigError(f"{name}: shape {shape} and blocksize {blocksize} are not a 2-D "
                          "weight in positive blocks")
    return state, (shape[0], shape[1]), blocksize


def _bnb_4bit(name: str, packed: torch.Tensor, aux: dict[str, torch.Tensor]) -> _Bnb4bit:
    state, shape, blocksize = bnb_state(name, aux)
    n = shape[0] * shape[1]
    if packed.numel() * 2 < n:
        raise ConfigError(f"{name}: shape {list(shape)} does not fit {packed.numel()} bytes")
    absmax = _aux_part(aux, name, "absmax")
    if absmax.dtype not in (torch.uint8, *FLOAT_DTYPES) or absmax.dim() != 1:
        raise ConfigError(f"{name}.absmax must be a 1-D float (or uint8, double-quantized) "
                          f"tensor, got {absmax.dtype} {tuple(absmax.shape)}")
    if "nested_absmax" in state or f"{name}.nested_absmax" in aux:  # double quantization
        nested = _aux_part(aux, name, "nested_absmax").to(torch.float32)
        codes = _aux_part(aux, name, "nested_quant_map")
        block = int(state.get("nested_blocksize", 256))
        index = torch.arange(absmax.numel()) // block
        if int(index.max()) >= nested.numel():
            raise ConfigError(f"{name}: nested_absmax has too few blocks")
        absmax = codes.to(torch.float32)[absmax.to(torch.int64)] * nested[index] + float(
            state.get("nested_offset", 0.0))
    absmax = absmax.to(torch.float32)
    if absmax.numel() != -(-n // blocksize):
        raise ConfigError(f"{name}: {absmax.numel()} absmax values for {n} codes in blocks "
                          f"of {blocksize}")
    codebook = _aux_part(aux, name, "quant_map").to(torch.float32)
    if codebook.shape != (16,):
        raise ConfigError(f"{name}.quant_map has shape {tuple(codebook.shape)}, expected (16,)")
    flat = packed.reshape(-1).to(torch.int64)
    codes4 = torch.stack((flat >> 4, flat & 0xF), 1).reshape(-1)[:n]  # high nibble first
    return _Bnb4bit(codes4, absmax, codebook, shape, blocksize)


def _unpack_columns(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [rows, cols/8] -> the 4-bit values [rows, cols], 8 per int32 along the columns
    (AWQ's interleaved order, or in order)."""
    shifts = _AWQ_SHIFTS if awq else _SEQ_SHIFTS
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def scheme_of(model_dir: str | Path) -> QuantScheme | None:
    """The checkpoint's quantization scheme, None for a dense one."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("config.json quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return QuantScheme("fp8", block=_block(qc.get("weight_block_size")))
    if method == "compressed-tensors":
        _check_compressed_fp8(qc)
        return QuantScheme("compressed-tensors")
    if method in ("awq", "gptq"):
        return _int4_scheme(method, qc)
    if method == "bitsandbytes":
        if not qc.get("load_in_4bit") or qc.get("load_in_8bit"):
            raise ConfigError("quantization_config.load_in_8bit is not served (bitsandbytes: "
                              "load_in_4bit, NF4 or FP4)")
        storage = qc.get("bnb_4bit_quant_storage", "uint8")
        if storage != "uint8":
            raise ConfigError(f"quantization_config.bnb_4bit_quant_storage {storage!r} is not "
                              "served (uint8)")
        return QuantScheme("bitsandbytes")
    raise ConfigError(
        f"quantization_config.quant_method {method!r} is not served; metrale loads 'fp8' "
        "(with or without weight_block_size), 'compressed-tensors' (float-quantized), "
        "'awq' (gemm, 4 bits), 'gptq' (4 bits) and 'bitsandbytes' (4 bits)")


def _int4_scheme(method: str, qc: dict) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"quantization_config.bits {bits!r} is not served ({method}: 4 bits)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if type(group) is not int or not (group == -1 or group > 0):
        raise ConfigError(f"quantization_config.group_size {group!r} is not a positive "
                          "integer or -1")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"quantization_config.version {version!r} is not served (awq: gemm)")
        if qc.get("zero_point", True) is not True:
            raise ConfigError("quantization_config.zero_point false is not served (awq: "
                              "with zero points)")
        return QuantScheme("awq", group_size=group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"quantization_config.checkpoint_format {fmt!r} is not served "
                          "(gptq: gptq or gptq_v2)")
    return QuantScheme("gptq", group_size=group, zero_offset=1 if fmt == "gptq" else 0)


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
