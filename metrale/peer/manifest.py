"""The peer manifest: what an exporter says about one adapter, and the strict
reading of it on the engine side.

Tensors are in the canonical pool layout: A as [r, in], B transposed as
[r, out], DoRA's magnitude M as [1, out], each contiguous, in the pool dtype. Modules
are the decoder projections and, when the local pool serves them, embed_tokens and
lm_head (at layer 0). Version 2 added M and the model-level modules; a version-1 peer
is refused either way (it would misread a v2 manifest). The HTTP stream carries them
concatenated in manifest order; NIXL gets one remote descriptor per tensor.

Nothing in a manifest is trusted: its size and nesting are bounded before any
field is read, every field is type-checked (ints are ints, not bools, and
bounded; no NaN/Infinity), counts and byte totals are capped by the local slot
before anything is iterated, every length is checked against shape x dtype,
the PEFT patterns are refused when they could make the regex engine backtrack
for minutes, and the plan is rebuilt from the local model and pool. Whatever a
peer sends, reading it ends in a MetraleError: anything else raised while
parsing or planning is turned into a PeerManifestError naming the peer.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import AdapterPlan, plan_from_tensors
from metrale.adapters.safetensors_file import FLOAT_DTYPES, check_entries
from metrale.config import EXTRA_TARGETS, EXTRA_TARGETS_FLAG, LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.errors import AdapterMismatchError, ExtraTargetsRequiredError, MetraleError
from metrale.peer.errors import PeerManifestError
from metrale.pool.layout import SlotLayout

MANIFEST_VERSION = 2
MAX_MANIFEST_BYTES = 8 << 20  # far above any real model's tensor list
MAX_METADATA_BYTES = 1 << 20
MAX_JSON_DEPTH = 16  # a manifest nests 5 deep; the bound keeps every walk off the stack limit
# PEFT regexes run against every module path of the model, so a peer's pattern
# must not be able to backtrack for minutes (`(.*)*x` does on a 30-character path):
# no repeated group that itself repeats or alternates, and few repeats, since each
# one multiplies the work (448 patterns of 3 repeats took 8 s on an 8B model's paths).
# Real configs use plain names or one or two `.*`; the exporter escapes its paths.
MAX_PATTERN_CHARS = 512
MAX_PATTERN_REPEATS = 3
MAX_PEFT_REPEATS = 16  # over all patterns of one config
DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}  # torch.float32 -> "F32"
DATA_PATH_RE = re.compile(r"/peer/v1/leases/[A-Za-z0-9_-]{8,64}/data")
Desc = tuple[int, int, int]


@dataclass(frozen=True)
class TensorSpec:
    layer: int
    module: str
    kind: str  # "A": [r, in]; "B": Bt, [r, out]; "M": DoRA magnitude, [1, out]
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
    peft_config: PeftAdapterConfig = field(compare=False, repr=False)  # `peft`, parsed

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
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, str) or not value or len(value) > limit:
        raise PeerManifestError(f"{what}: field {key!r} must be a non-empty string of at most "
                                f"{limit} characters")
    return value


def _short(value: object, limit: int = 80) -> str:
    """A peer's value for a message: never megabytes of it."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_manifest(doc: object, layout: SlotLayout, source: str) -> Manifest:
    """Check a decoded manifest against the local slot layout, before any I/O on data.
    Raises only MetraleError subclasses, whatever `doc` holds."""
    with refusing_malformed(source, "manifest"):
        return _parse(doc, layout, source)


def _parse(doc: object, layout: SlotLayout, source: str) -> Manifest:
    check_json_bounds(doc, source)
    if not isinstance(doc, dict):
        raise PeerManifestError(f"{source}: manifest is not a JSON object")
    version = doc.get("version")
    if type(version) is not int or version != MANIFEST_VERSION:  # True == 1 in Python
        raise PeerManifestError(
            f"{source}: manifest version {_short(version)} is not {MANIFEST_VERSION}; "
            "upgrade the older side"
        )
    dtype = _str(doc, "dtype", source, 16)
    if dtype not in FLOAT_DTYPES:
        raise AdapterMismatchError(
            f"{source}: peer tensors are {dtype!r}; only F32, F16, BF16 or F64 can be "
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
    peft_config = _peft_config(peft, layout, source)
    transports = doc.get("transports")
    if not isinstance(transports, dict):
        raise PeerManifestError(f"{source}: manifest has no transports object")
    return Manifest(
        adapter_id=_str(doc, "adapter_id", source), name=_str(doc, "name", source),
        uid=_int(doc, "uid", source), generation=_int(doc, "generation", source),
        peft=peft, dtype=dtype, tensors=tensors, data_bytes=data_bytes,
        http_path=_http_path(transports.get("http"), source),
        nixl=_nixl(transports.get("nixl"), tensors, source), peft_config=peft_config,
    )


@contextmanager
def refusing_malformed(source: str, what: str) -> Iterator[None]:
    """The last line of defence around code that reads a peer's document: a
    MetraleError keeps its class (its message now names the peer); any other
    exception (a TypeError deep in a config parser, a re.error, a RecursionError)
    becomes a PeerManifestError, so a peer can make a landing fail but never
    crash the caller with an untyped error."""
    try:
        yield
    except MetraleError as e:
        if source in str(e):
            raise
        # The config parser and planner speak of adapter_config.json; say whose it is.
        raise type(e)(f"{source}: {e}") from e
    except Exception as e:
        raise PeerManifestError(
            f"{source}: malformed {what} ({type(e).__name__}: {_short(str(e))})"
        ) from e


def check_json_bounds(doc: object, source: str, max_bytes: int = MAX_MANIFEST_BYTES) -> None:
    """`doc` holds only JSON values (str keys; ints within 64 bits; finite floats),
    nests at most MAX_JSON_DEPTH deep and would encode to about max_bytes at most.
    Iterative, so no nesting can exhaust the stack here."""
    budget, stack = max_bytes, [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        kind = type(value)
        if kind is dict or kind is list:
            if depth >= MAX_JSON_DEPTH:
                raise PeerManifestError(f"{source}: manifest nests deeper than {MAX_JSON_DEPTH}")
            budget -= 2 + 2 * len(value)
            if budget < 0:
                break
            if kind is dict:
                for key, item in value.items():
                    if type(key) is not str:
                        raise PeerManifestError(f"{source}: manifest has a non-string key")
                    budget -= len(key) + 3
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)
        elif kind is str:
            budget -= len(value) + 2
        elif kind is int:
            if not -(1 << 63) <= value < 1 << 64:
                raise PeerManifestError(f"{source}: manifest has an integer beyond 64 bits")
            budget -= 20
        elif kind is float:
            if not math.isfinite(value):
                raise PeerManifestError(f"{source}: manifest has a NaN or infinite number")
            budget -= 24
        elif value is None or kind is bool:
            budget -= 5
        else:
            raise PeerManifestError(f"{source}: manifest holds a {kind.__name__}, not a JSON value")
        if budget < 0:
            break
    if budget < 0:
        raise PeerManifestError(f"{source}: manifest is larger than {max_bytes} bytes")


def _tensors(items: object, layout: SlotLayout, itemsize: int, source: str) -> tuple[TensorSpec, ...]:
    model = layout.model
    limit = len(layout.regions)  # regions in one local slot
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
        if module not in LINEAR_MODULES and module not in EXTRA_TARGETS:
            raise AdapterMismatchError(
                f"{what}: module {_short(module)} is not a projection of this model "
                f"(known: {', '.join(LINEAR_MODULES + EXTRA_TARGETS)})"
            )
        if module in EXTRA_TARGETS and module not in layout.pool.extra_targets:
            raise ExtraTargetsRequiredError(
                f"{what}: the adapter has LoRA on {module}, and this engine has no pool memory "
                f"for it: start it with {EXTRA_TARGETS_FLAG} {module}")
        if module in EXTRA_TARGETS and layer != 0:
            raise PeerManifestError(f"{what}: {module} is model-level; its layer must be 0")
        if kind not in ("A", "B", "M"):
            raise PeerManifestError(f"{what}: kind {_short(kind)} is not 'A', 'B' or 'M'")
        shape = item.get("shape")
        if (not isinstance(shape, list) or len(shape) != 2
                or any(type(d) is not int or d <= 0 for d in shape)):
            raise PeerManifestError(f"{what}: shape {_short(shape)} is not [rank, dim]")
        rows, cols = shape
        if kind == "M" and rows != 1:
            raise PeerManifestError(f"{what}: a DoRA magnitude is [1, out], not {_short(shape)}")
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


def _peft_config(doc: dict, layout: SlotLayout, source: str) -> PeftAdapterConfig:
    # One entry per module path is what a full per-module config needs (the
    # exporter's own rank_pattern); anything longer only costs matching time.
    limit = 2 * layout.model.num_layers * len(LINEAR_MODULES) + 2 * len(EXTRA_TARGETS)
    for key, value in doc.items():
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise PeerManifestError(
                f"{source}: PEFT field {_short(key)} has {len(value)} entries; at most {limit}"
            )
    repeats = sum(_check_pattern(pattern, f"{source}: PEFT {key} pattern {_short(pattern)}")
                  for key, pattern in _peft_patterns(doc))
    if repeats > MAX_PEFT_REPEATS:
        raise PeerManifestError(
            f"{source}: the PEFT patterns hold {repeats} repeats in all (at most "
            f"{MAX_PEFT_REPEATS}); list module names instead of patterns"
        )
    with refusing_malformed(source, "PEFT config"):
        return PeftAdapterConfig.from_dict(doc)


def _peft_patterns(doc: dict) -> Iterator[tuple[str, str]]:
    """Every string of a PEFT config that PeftAdapterConfig uses as a regex (lists
    of target or excluded modules are matched by name, not as regexes)."""
    for key in ("target_modules", "exclude_modules"):
        if isinstance(doc.get(key), str):
            yield key, doc[key]
    layers = doc.get("layers_pattern")
    layers = [layers] if isinstance(layers, str) else layers if isinstance(layers, list) else []
    yield from (("layers_pattern", p) for p in layers if isinstance(p, str))
    for key in ("rank_pattern", "alpha_pattern"):
        if isinstance(doc.get(key), dict):
            for pattern in doc[key]:
                yield key, pattern


def _check_pattern(pattern: str, what: str) -> int:
    """The pattern's repeat count, once it is known to be safe to run."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PeerManifestError(f"{what} is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise PeerManifestError(f"{what} is not a regular expression: {e}") from None
    repeats, nested = _repeat_structure(pattern)
    if nested:
        raise PeerManifestError(
            f"{what} repeats a group that itself repeats or alternates, which can backtrack "
            "for minutes; list the module names instead"
        )
    if repeats > MAX_PATTERN_REPEATS:
        raise PeerManifestError(
            f"{what} has {repeats} repeats (at most {MAX_PATTERN_REPEATS}); list the module names instead"
        )
    return repeats


_QUANTIFIER_RE = re.compile(r"[*+]|\{\d*,?\d*\}")


def _repeat_structure(pattern: str) -> tuple[int, bool]:
    """(repeat operators, whether a repeated group holds a repeat or an alternation)
    of a pattern that compiles: the shapes whose backtracking grows exponentially
    (`(a+)+`, `(a|a)*`) or as the length to the number of repeats."""
    repeats, groups, i = 0, [False], 0  # per open group: holds a repeat or '|'
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "(":
            groups.append(False)
        elif c == "|":
            groups[-1] = True
        elif _QUANTIFIER_RE.match(pattern, i):
            repeats += 1
            groups[-1] = True
        elif c == ")" and len(groups) > 1:
            risky = groups.pop()
            if risky and _QUANTIFIER_RE.match(pattern, i + 1):
                return repeats, True
            groups[-1] = groups[-1] or risky
        i += 1
    return repeats, False


def _class_end(pattern: str, i: int) -> int:
    """Index just past the character class opening at pattern[i]."""
    i += 1
    if pattern[i:i + 1] == "^":
        i += 1
    if pattern[i:i + 1] == "]":  # a leading ']' is a literal
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _http_path(doc: object, source: str) -> str | None:
    if doc is None:
        return None
    path = doc.get("data_path") if isinstance(doc, dict) else None
    # A path on the same peer only: a URL could point the engine at any host.
    if not isinstance(path, str) or not DATA_PATH_RE.fullmatch(path):
        raise PeerManifestError(f"{source}: http data_path {_short(path)} is not /peer/v1/leases/<id>/data")
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
        raise PeerManifestError(f"{source}: nixl mem_type {_short(mem)} is not DRAM or VRAM")
    descs = doc.get("descs")
    if not isinstance(descs, list) or len(descs) != len(tensors):
        raise PeerManifestError(f"{source}: nixl needs exactly one descriptor per tensor")
    out = []
    for t, d in zip(tensors, descs):
        if (not isinstance(d, list) or len(d) != 3 or any(type(x) is not int for x in d)
                or not 0 < d[0] < 1 << 64 or d[1] != t.nbytes or not 0 <= d[2] < 1024):
            raise PeerManifestError(
                f"{source}: nixl descriptor {_short(d)} for layer {t.layer} {t.module} {t.kind} must be "
                f"[address, {t.nbytes}, device]"
            )
        out.append((d[0], d[1], d[2]))
    return NixlInfo(metadata, mem, tuple(out))


def tensor_name(model: ModelConfig, t: TensorSpec) -> str:
    """The PEFT name of a manifest tensor (what plan_from_tensors matches)."""
    path = f"base_model.model.{model.module_path(t.layer, t.module)}"
    if t.kind == "M":
        return f"{path}.lora_magnitude_vector"
    if t.module == "embed_tokens":
        return f"{path}.lora_embedding_{t.kind}"
    return f"{path}.lora_{t.kind}.weight"


def manifest_plan(manifest: Manifest, name: str, peft: PeftAdapterConfig, model: ModelConfig,
                  pool: PoolConfig, source: str) -> AdapterPlan:
    """Validate the tensors exactly like a safetensors header (sizes tile the stream)
    and against PEFT's targets, ranks and shapes; B is listed in PEFT's [out, r]
    shape here even though its bytes arrive transposed (see canonical_views)."""
    with refusing_malformed(source, "manifest or PEFT config"):
        specs, cursor = {}, 0
        for t in manifest.tensors:
            shape = {"A": [t.rows, t.cols], "B": [t.cols, t.rows], "M": [t.cols]}[t.kind]
            specs[tensor_name(model, t)] = {"dtype": manifest.dtype, "shape": shape,
                                            "data_offsets": [cursor, cursor + t.nbytes]}
            cursor += t.nbytes
        entries = check_entries(source, specs, manifest.data_bytes)
        return plan_from_tensors(name, peft, source, entries.values(), manifest.data_bytes, model,
                                 pool)


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
