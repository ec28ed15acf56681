"""A safetensors header reader that trusts nothing in the file.

Every size the header claims is checked against shape x dtype and against the
file's real length before a single data byte is read, so a lying header can
never make us copy outside a buffer.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.errors import AdapterFileError, AdapterMismatchError

# Dtypes a LoRA may arrive in; anything else (ints, fp8, bool) is refused.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024


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
    path: Path
    data_start: int  # absolute file offset of the data section
    data_bytes: int
    tensors: dict[str, TensorEntry]


def read_header(path: Path) -> SafetensorsHeader:
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(path):
                raise AdapterFileError(f"{path} is not a regular file")
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise AdapterFileError(f"{path} is truncated ({size} bytes): not a safetensors file")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise AdapterFileError(
                    f"{path}: header length {header_len} does not fit the {size}-byte file; "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise AdapterFileError(f"cannot read {path}: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AdapterFileError(f"{path}: header is not JSON; not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_bytes = size - data_start
    return SafetensorsHeader(path, data_start, data_bytes, check_entries(path, header, data_bytes))


def check_entries(source: object, specs: dict, data_bytes: int) -> dict[str, TensorEntry]:
    """Validate {name: {dtype, shape, data_offsets}} against a data section of
    data_bytes: a safetensors header, or a peer's manifest in the same form."""
    if not isinstance(specs, dict):
        raise AdapterFileError(f"{source}: tensor table is not a JSON object")
    tensors = {name: _entry(source, name, spec, data_bytes) for name, spec in specs.items()}
    _check_coverage(source, tensors, data_bytes)
    return tensors


def _entry(path: object, name: str, spec: object, data_bytes: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise AdapterFileError(f"{path}: malformed header entry for {name!r}") from None
    if dtype not in _ITEMSIZE:
        raise AdapterFileError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise AdapterMismatchError(
            f"{path}: tensor {name!r} is {dtype}; LoRA weights must be F32, F16, BF16 or F64"
        )
    if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_bytes:
        raise AdapterFileError(
            f"{path}: tensor {name!r} claims bytes [{begin}, {end}) of a {data_bytes}-byte "
            "data section; the file is truncated or its header lies"
        )
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise AdapterFileError(
            f"{path}: tensor {name!r} is {dtype}{list(shape)} = {expected} bytes but the "
            f"header gives it {end - begin}; the header lies about sizes"
        )
    return TensorEntry(name, dtype, shape, begin, end)


def _check_coverage(path: object, tensors: dict[str, TensorEntry], data_bytes: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no hidden bytes."""
    cursor = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != cursor:
            raise AdapterFileError(
                f"{path}: tensor {t.name!r} starts at byte {t.begin}, expected {cursor}; "
                "tensors overlap or leave gaps"
            )
        cursor = t.end
    if cursor != data_bytes:
        raise AdapterFileError(
            f"{path}: tensors cover {cursor} of {data_bytes} data bytes; the file is "
            "truncated or has trailing bytes"
        )
