"""A safetensors header reader that trusts nothing in the file: every claimed size is
checked against shape x dtype and the file's length before a data byte is read, every field
typed as the format's Rust reader types it. Refusals are AdapterFileErrors (an
AdapterMismatchError for a valid non-float dtype).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.adapters.input_limits import brief, open_regular, parse_json
from metrale.errors import AdapterFileError, AdapterMismatchError

# Dtypes a LoRA may arrive in; anything else (ints, fp8, bool) is refused.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}
# Every dtype the safetensors format defines: a known non-float one is a mismatch
# (wrong adapter), an unknown name a broken file.
KNOWN_DTYPES = frozenset({
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16",
    "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
})
# safetensors' own cap (its Rust reader refuses larger headers); a LoRA's is ~100 KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIMS = 8  # LoRA tensors are 2-D; more dims can only be another kind of file
_MAX_U64 = (1 << 64) - 1
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    data_start: int  # absolute file offset of the data section
    data_bytes: int
    tensors: dict[str, TensorEntry]


def read_header(path: Path, root: Path | None = None) -> SafetensorsHeader:
    """The checked header (never more than 8 + MAX_HEADER_BYTES bytes read); root: the file
    must resolve inside it (adapters.confined)."""
    path = Path(path)
    with open_regular(path, AdapterFileError, root) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            header_len = _header_length(path, f, size)
            raw = f.read(header_len)  # header_len <= MAX_HEADER_BYTES: checked above
        except OSError as e:
            raise AdapterFileError(f"cannot read {path}: {e}") from None
    if len(raw) != header_len:
        raise AdapterFileError(f"{path}: the file shrank while its header was read")
    header = parse_json(raw, f"{path} (safetensors header)", AdapterFileError)
    if not isinstance(header, dict):
        raise AdapterFileError(
            f"{path}: header is a JSON {type(header).__name__}, not an object; not a safetensors file"
        )
    _check_metadata(path, header.pop("__metadata__", None))
    data_start = 8 + header_len
    data_bytes = size - data_start
    return SafetensorsHeader(data_start, data_bytes, check_entries(path, header, data_bytes))


def _header_length(path: Path, f, size: int) -> int:
    if size < 8:
        raise AdapterFileError(f"{path} is truncated ({size} bytes): not a safetensors file")
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise AdapterFileError(
            f"{path}: header length {header_len} does not fit the {size}-byte file "
            f"(or exceeds {MAX_HEADER_BYTES} bytes); the file is truncated or not safetensors"
        )
    return header_len


def _check_metadata(path: Path, meta: Any) -> None:
    if meta is None:
        return
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise AdapterFileError(
            f"{path}: __metadata__ must map strings to strings, got {brief(meta)}; "
            "the file is not valid safetensors"
        )


def check_entries(source: object, specs: dict, data_bytes: int) -> dict[str, TensorEntry]:
    """Validate {name: {dtype, shape, data_offsets}} (a safetensors header, or a peer's
    manifest in its form) against a data section of data_bytes."""
    if not isinstance(specs, dict):
        raise AdapterFileError(f"{source}: tensor table is not a JSON object")
    if not isinstance(data_bytes, int) or isinstance(data_bytes, bool) or data_bytes < 0:
        raise AdapterFileError(f"{source}: data section size {brief(data_bytes)} is not a byte count")
    tensors = {name: _entry(source, name, spec, data_bytes) for name, spec in specs.items()}
    _check_coverage(source, tensors, data_bytes)
    return tensors


def _uints(values: Any, n_max: int, limit: int) -> bool:
    """values is a list or tuple of at most n_max ints (bools are not) in [0, limit]."""
    if type(values) not in (list, tuple) or len(values) > n_max:
        return False
    for v in values:  # a loop, not all(genexpr): planning checks ~1,000 of these per adapter
        if type(v) is not int or not 0 <= v <= limit:
            return False
    return True


def _malformed(path: object, name: object, what: str) -> AdapterFileError:
    return AdapterFileError(f"{path}: header entry for {brief(name)} {what}; the file is not "
                            "valid safetensors")


def _entry(path: object, name: str, spec: object, data_bytes: int) -> TensorEntry:
    if not isinstance(name, str):
        raise _malformed(path, name, "has a non-string name")
    if not isinstance(spec, dict) or not spec.keys() >= _ENTRY_KEYS:
        raise _malformed(path, name, "is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in KNOWN_DTYPES:
        raise AdapterFileError(f"{path}: tensor {brief(name)} has unknown dtype {brief(dtype)}")
    if not _uints(shape, MAX_DIMS, _MAX_DIM):
        raise _malformed(path, name, f"has shape {brief(shape)}; a shape is a list of at most "
                                     f"{MAX_DIMS} non-negative integers")
    if not _uints(offsets, 2, _MAX_U64) or len(offsets) != 2:
        raise _malformed(path, name, f"has data_offsets {brief(offsets)}; they must be "
                                     "[begin, end], two non-negative integers")
    if dtype not in FLOAT_DTYPES:
        raise AdapterMismatchError(
            f"{path}: tensor {brief(name)} is {dtype}; LoRA weights must be F32, F16, BF16 or F64"
        )
    begin, end = offsets
    shape = tuple(shape)
    if not begin <= end <= data_bytes:
        raise AdapterFileError(
            f"{path}: tensor {brief(name)} claims bytes [{begin}, {end}) of a {data_bytes}-byte "
            "data section; the file is truncated or its header lies"
        )
    expected = math.prod(shape) * FLOAT_DTYPES[dtype].itemsize
    if end - begin != expected:
        raise AdapterFileError(
            f"{path}: tensor {brief(name)} is {dtype}{list(shape)} = {expected} bytes but the "
            f"header gives it {end - begin}; the header lies about sizes"
        )
    return TensorEntry(name, dtype, shape, begin, end)


def _check_coverage(path: object, tensors: dict[str, TensorEntry], data_bytes: int) -> None:
    """Tensors must tile the data section: no overlap, no hidden bytes."""
    cursor = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != cursor:
            raise AdapterFileError(
                f"{path}: tensor {brief(t.name)} starts at byte {t.begin}, expected {cursor}; "
                "tensors overlap or leave gaps"
            )
        cursor = t.end
    if cursor != data_bytes:
        raise AdapterFileError(
            f"{path}: tensors cover {cursor} of {data_bytes} data bytes; the file is "
            "truncated or has trailing bytes"
        )
