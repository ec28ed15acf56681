"""The peer manifest: what an exporter says about one adapter, and the strict
reading of it on the engine side.

Tensors are in the canonical pool layout: A as [r, in], B transposed as
[r, out], each contiguous, in the pool dtype. The HTTP stream carries them
concatenated in manifest order; NIXL gets one remote descriptor per tensor.

Nothing in a manifest is trusted: counts and byte totals are capped by the
local slot before anything is iterated, every length is checked against
shape x dtype, and the plan is rebuilt from the local model and pool.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import AdapterPlan, plan_from_tensors
from metrale.adapters.safetensors_file import FLOAT_DTYPES, check_entries
from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.errors import AdapterMismatchError
from metrale.peer.errors import PeerManifestError
from metrale.pool.layout import SlotLayout

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20  # far above any real model's tensor list
MAX_METADATA_BYTES = 1 << 20
DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}  # torch.float32 -> "F32"
DATA_PATH_RE = re.compile(r"/peer/v1/leases/[A-Za-z0-9_-]{8,64}/data")
Desc = tuple[int, int, int]


@dataclass(frozen=True)
class TensorSpec:
    layer: int
    module: str
    kind: str  # "A": [r, in]; "B": Bt, [r, out]
    rows: int  # the rank
    cols: int
    nbytes: int

    def to_dict(self) -> dict:
        return {"layer": self.layer, "module": self.module, "kind": self.kind,
                "shape": [self.rows, self.cols], "nbytes": self.nbytes}


@dataclass(frozen=True)
class NixlInfo:
    agent_metadata: bytes
    mem_type: str  # "DRAM" | "VRAM"
    descs: tuple[Desc, ...]  # one per tensor, manifest order


@dataclass(frozen=True)
class Manifest:
    adapter_id: str
    name: str
    uid: int
    generation: int
    peft: dict
    dtype: str  # safetensors name: F32, BF16, F16, F64
    tensors: tuple[TensorSpec, ...]
    data_bytes: int
    http_path: str | None
    nixl: NixlInfo | None

    @property
    def torch_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.dtype]


# --- reading a peer's manifest ----------------------------------------------------------


def _int(doc: dict, key: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = doc.get(key) if isinstance(doc, dict) else None
    if type(value) is not int or not lo <= value <= hi:  # bool is an int: refuse it too
        raise PeerManifestError(f"{what}: field {key!r} must be an integer in [{lo}, {hi}]")
    return value


def _str(doc: dict, key: str, what: str, limit: int = 256) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise PeerManifestError(f"{what}: field {key!r} must be a non-empty string")
    return value


def parse_manifest(doc: object, layout: SlotLayout, source: str) -> Manifest:
    """Check a decoded manifest against the local slot layout, before any I/O on data."""
    if not isinstance(doc, dict):
        raise PeerManifestError(f"{source}: manifest is not a JSON object")
    if doc.get("version") != MANIFEST_VERSION:
        raise PeerManifestError(
            f"{source}: manifest version {doc.get('version')!r} is not {MANIFEST_VERSION}; "
            "upgrade the older side"
        )
    dtype = _str(doc, "dtype", source, 16)
    if dtype not in FLOAT_DTYPES:
        raise AdapterMismatchError(
            f"{source}: peer tensors are {dtype}; only F32, F16, BF16 or F64 can be "
            f"converted into this pool's {layout.dtype}"
        )
    itemsize = FLOAT_DTYPES[dtype].itemsize
    tensors = _tensors(doc.get("tensors"), layout, itemsize, source)
    data_bytes = sum(t.nbytes for t in tensors)
    if _int(doc, "data_bytes", source) != data_bytes:
        raise PeerManifestError(
            f"{source}: data_bytes {doc['data_bytes']} != the {data_bytes} bytes its tensors add up to"
        )
    if data_bytes // itemsize > layout.slot_elems:
        raise PeerManifestError(
            f"{source}: {data_bytes // itemsize} elements do not fit a {layout.slot_elems}-element slot"
        )
    peft = doc.get("peft")
    if not isinstance(peft, dict):
        raise PeerManifestError(f"{source}: manifest has no PEFT config object")
    transports = doc.get("transports")
    if not isinstance(transports, dict):
        raise PeerManifestError(f"{source}: manifest has no transports object")
    return Manifest(
        adapter_id=_str(doc, "adapter_id", source), name=_str(doc, "name", source),
        uid=_int(doc, "uid", source), generation=_int(doc, "generation", source),
        peft=peft, dtype=dtype, tensors=tensors, data_bytes=data_bytes,
        http_path=_http_path(transports.get("http"), source),
        nixl=_nixl(transports.get("nixl"), tensors, source),
    )


def _tensors(items: object, layout: SlotLayout, itemsize: int, source: str) -> tuple[TensorSpec, ...]:
    model = layout.model
    limit = 2 * model.num_layers * len(layout.pool.target_modules)  # regions in one local slot
    if not isinstance(items, list) or not items:
        raise PeerManifestError(f"{source}: manifest tensors must be a non-empty list")
    if len(items) > limit:
        raise PeerManifestError(
            f"{source}: {len(items)} tensors; a slot of this pool holds at most {limit}"
        )
    specs, seen = [], set()
    for i, item in enumerate(items):
        what = f"{source}: tensor #{i}"
        if not isinstance(item, dict):
            raise PeerManifestError(f"{what} is not an object")
        layer = _int(item, "layer", what, 0, model.num_layers - 1)
        module, kind = item.get("module"), item.get("kind")
        if module not in LINEAR_MODULES:
            raise AdapterMismatchError(
                f"{what}: module {module!r} is not a projection of this model "
                f"(known: {', '.join(LINEAR_MODULES)})"
            )
        if kind not in ("A", "B"):
            raise PeerManifestError(f"{what}: kind {kind!r} is not 'A' or 'B'")
        shape = item.get("shape")
        if (not isinstance(shape, list) or len(shape) != 2
                or any(type(d) is not int or d <= 0 for d in shape)):
            raise PeerManifestError(f"{what}: shape {shape!r} is not [rank, dim]")
        rows, cols = shape
        if rows > layout.max_rank:
            raise AdapterMismatchError(
                f"{what}: {module} has rank {rows} > max_lora_rank {layout.max_rank}; start "
                f"the engine with max_lora_rank >= {rows}"
            )
        d_in, d_out = model.linear_shape(module)
        if cols != (d_in if kind == "A" else d_out):
            raise AdapterMismatchError(
                f"{what}: {module} {kind} is [{rows}, {cols}], expected [{rows}, "
                f"{d_in if kind == 'A' else d_out}] for this base model"
            )
        nbytes = _int(item, "nbytes", what)
        if nbytes != rows * cols * itemsize:
            raise PeerManifestError(
                f"{what}: nbytes {nbytes} != {rows}x{cols}x{itemsize}; the manifest lies about sizes"
            )
        if (layer, module, kind) in seen:
            raise PeerManifestError(f"{what}: a second tensor for layer {layer} {module} {kind}")
        seen.add((layer, module, kind))
        specs.append(TensorSpec(layer, module, kind, rows, cols, nbytes))
    return tuple(specs)


def _http_path(doc: object, source: str) -> str | None:
    if doc is None:
        return None
    path = doc.get("data_path") if isinstance(doc, dict) else None
    # A path on the same peer only: a URL could point the engine at any host.
    if not isinstance(path, str) or not DATA_PATH_RE.fullmatch(path):
        raise PeerManifestError(f"{source}: http data_path {path!r} is not /peer/v1/leases/<id>/data")
    return path


def _nixl(doc: object, tensors: tuple[TensorSpec, ...], source: str) -> NixlInfo | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise PeerManifestError(f"{source}: nixl transport info is not an object")
    raw = doc.get("agent_metadata")
    if not isinstance(raw, str) or len(raw) > MAX_METADATA_BYTES * 4 // 3 + 4:
        raise PeerManifestError(f"{source}: nixl agent_metadata missing or oversized")
    try:
        metadata = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise PeerManifestError(f"{source}: nixl agent_metadata is not base64") from None
    mem = doc.get("mem_type")
    if mem not in ("DRAM", "VRAM"):
        raise PeerManifestError(f"{source}: nixl mem_type {mem!r} is not DRAM or VRAM")
    descs = doc.get("descs")
    if not isinstance(descs, list) or len(descs) != len(tensors):
        raise PeerManifestError(f"{source}: nixl needs exactly one descriptor per tensor")
    out = []
    for t, d in zip(tensors, descs):
        if (not isinstance(d, list) or len(d) != 3 or any(type(x) is not int for x in d)
                or not 0 < d[0] < 1 << 64 or d[1] != t.nbytes or not 0 <= d[2] < 1024):
            raise PeerManifestError(
                f"{source}: nixl descriptor {d!r} for layer {t.layer} {t.module} {t.kind} must be "
                f"[address, {t.nbytes}, device]"
            )
        out.append((d[0], d[1], d[2]))
    return NixlInfo(metadata, mem, tuple(out))


def tensor_name(model: ModelConfig, t: TensorSpec) -> str:
    return f"base_model.model.{model.module_path(t.layer, t.module)}.lora_{t.kind}.weight"


def manifest_plan(manifest: Manifest, name: str, peft: PeftAdapterConfig, model: ModelConfig,
                  pool: PoolConfig, source: str) -> AdapterPlan:
    """Validate the tensors exactly like a safetensors header (sizes tile the stream)
    and against PEFT's targets, ranks and shapes; B is listed in PEFT's [out, r]
    shape here even though its bytes arrive transposed (see canonical_views)."""
    specs, cursor = {}, 0
    for t in manifest.tensors:
        shape = [t.rows, t.cols] if t.kind == "A" else [t.cols, t.rows]
        specs[tensor_name(model, t)] = {"dtype": manifest.dtype, "shape": shape,
                                        "data_offsets": [cursor, cursor + t.nbytes]}
        cursor += t.nbytes
    entries = check_entries(source, specs, manifest.data_bytes)
    return plan_from_tensors(name, peft, source, entries.values(), manifest.data_bytes, model, pool)


def canonical_views(plan: AdapterPlan, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views AdapterPool.land can take: a B view holds [r, out] bytes, so present it
    as the transpose of that; land's own transpose then copies it straight."""
    out = []
    for landing, v in zip(plan.landings, views):
        if landing.kind == "B":
            out_dim, r = landing.entry.shape
            v = v.reshape(r, out_dim).t()  # [out, r] view over [r, out] bytes
        out.append(v)
    return out
