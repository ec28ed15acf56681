"""The peer manifest: what an exporter says about one adapter, and the strict reading of
it on the engine side (docs/DESIGN.md, "Peers", lists the checks).

Tensors are in the canonical pool layout (A [r, in], B transposed [r, out], DoRA's M
[1, out], model-level modules at layer 0). Nothing in a manifest is trusted: the plan is
rebuilt from the local model and pool, and whatever a peer sends, reading it ends in a
MetraleError (refusing_malformed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import AdapterPlan, plan_from_tensors
from metrale.adapters.safetensors_file import FLOAT_DTYPES, check_entries
from metrale.config import (
    EXTRA_TARGETS,
    EXTRA_TARGETS_FLAG,
    LINEAR_MODULES,
    MOE_MODULES,
    ModelConfig,
    PoolConfig,
)
from metrale.errors import AdapterMismatchError, ExtraTargetsRequiredError, MetraleError
from metrale.peer.client import strict_json
from metrale.peer.errors import ManifestVersionError, PeerManifestError
from metrale.peer.wire import (
    KINDS,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PEFT_BYTES,
    MODULES,
    WIRE_VERSION,
    WireReply,
    decode,
    unb64,
)
from metrale.pool.layout import SlotLayout

MAX_METADATA_BYTES = 1 << 20
MAX_JSON_DEPTH = 16  # a manifest nests 5 deep; the bound keeps every walk off the stack limit
# A peer's PEFT regexes run against every module path, so none may backtrack for minutes
# (`(.*)*x` does on a 30-character path): no repeated group that repeats or alternates,
# and few repeats (448 patterns of 3 repeats took 8 s on an 8B model's paths).
MAX_PATTERN_CHARS = 512
MAX_PATTERN_REPEATS = 3
MAX_PEFT_REPEATS = 16  # over all patterns of one config
DTYPE_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}  # torch.float32 -> "F32"
DATA_PATH_RE = re.compile(r"/peer/v1/leases/[A-Za-z0-9_-]{8,64}/data")


@dataclass(frozen=True)
class NixlInfo:
    agent_metadata: bytes
    mem_type: str  # "DRAM" | "VRAM"
    device: int  # the peer's device id of every tensor
    addrs: np.ndarray  # uint64, one per tensor, manifest order (the table's addr column)


@dataclass(frozen=True)
class Manifest:
    adapter_id: str
    name: str
    uid: int
    generation: int
    dtype: str  # safetensors name: F32, BF16, F16, F64
    table: np.ndarray = field(repr=False)  # wire.RECORD[n], manifest order
    data_bytes: int
    http_path: str | None
    http_ranges: bool  # the data route serves byte ranges (so several streams can share it)
    nixl: NixlInfo | None
    peft_raw: bytes = field(repr=False)  # the PEFT config's JSON, parsed only when planning
    shape_bytes: bytes = field(repr=False)  # the table without addresses (the plan's input)

    def peft_config(self, layout: SlotLayout, source: str) -> PeftAdapterConfig:
        with refusing_malformed(source, "PEFT config"):
            doc = json_object(self.peft_raw, source, "PEFT config", MAX_PEFT_BYTES)
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
            return PeftAdapterConfig.from_dict(doc)


# --- reading a peer's manifest ----------------------------------------------------------


def _int(doc: dict, key: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = doc.get(key)
    if type(value) is not int or not lo <= value <= hi:  # bool is an int: refuse it too
        raise PeerManifestError(f"{what}: field {key!r} must be an integer in [{lo}, {hi}]")
    return value


def _str(doc: dict, key: str, what: str, limit: int = 256) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise PeerManifestError(f"{what}: field {key!r} must be a non-empty string of at most "
                                f"{limit} characters")
    return value


def _short(value: object, limit: int = 80) -> str:
    """A peer's value for a message: never megabytes of it."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class Reply:
    header: dict  # its "lease" object is as sent: the landing checks it (and releases it)
    wire: WireReply


def read_reply(raw: bytes, source: str) -> Reply:
    """Split and decode a lease reply body: sections, then the header's JSON (strict,
    bounded). Raises only MetraleError subclasses, whatever `raw` holds."""
    with refusing_malformed(source, "manifest"):
        wire = decode(raw, source)
        header = json_object(wire.header, source, "manifest header", MAX_HEADER_BYTES)
        return Reply(header, wire)


def json_object(raw: bytes, source: str, what: str, limit: int) -> dict:
    """A reply section as a strict, bounded JSON object, or PeerManifestError naming it."""
    try:
        doc = strict_json(raw)
    except ValueError as e:
        raise PeerManifestError(f"{source}: the {what} is not JSON ({_short(str(e))})") from None
    check_json_bounds(doc, source, limit)
    if not isinstance(doc, dict):
        raise PeerManifestError(f"{source}: the {what} is not a JSON object")
    return doc


def parse_manifest(reply: Reply, layout: SlotLayout, source: str,
                   known_shapes: bytes | None = None) -> Manifest:
    """Check a decoded reply against the local slot layout, before any I/O on data.
    `known_shapes`: a table's shape bytes already checked against this layout (the plan
    cache's); an equal table skips the column checks. Raises only MetraleError subclasses."""
    doc, wire = reply.header, reply.wire
    with refusing_malformed(source, "manifest"):
        version = doc.get("version")
        if type(version) is not int or version != WIRE_VERSION:  # True == 1 in Python
            raise ManifestVersionError(
                f"{source}: manifest version {_short(version)} is not {WIRE_VERSION}; "
                "upgrade the older side"
            )
        dtype = _str(doc, "dtype", source, 16)
        if dtype not in FLOAT_DTYPES:
            raise AdapterMismatchError(
                f"{source}: peer tensors are {dtype!r}; only F32, F16, BF16 or F64 can be "
                f"converted into this pool's {layout.dtype}"
            )
        itemsize = FLOAT_DTYPES[dtype].itemsize
        table, shapes = wire.table, wire.shape_bytes()
        if shapes != known_shapes:
            check_table(table, layout, itemsize, source)
        data_bytes = int(table["nbytes"].sum(dtype=np.uint64))  # checked rows: no overflow
        if _int(doc, "data_bytes", source) != data_bytes:
            raise PeerManifestError(
                f"{source}: data_bytes {doc['data_bytes']} != the {data_bytes} bytes its tensors add up to"
            )
        if data_bytes // itemsize > layout.slot_elems:
            raise PeerManifestError(
                f"{source}: {data_bytes // itemsize} elements do not fit a {layout.slot_elems}-element slot"
            )
        transports = doc.get("transports")
        if not isinstance(transports, dict):
            raise PeerManifestError(f"{source}: manifest has no transports object")
        http_path, http_ranges = _http(transports.get("http"), source)
        return Manifest(
            adapter_id=_str(doc, "adapter_id", source), name=_str(doc, "name", source),
            uid=_int(doc, "uid", source), generation=_int(doc, "generation", source),
            dtype=dtype, table=table, data_bytes=data_bytes,
            http_path=http_path, http_ranges=http_ranges,
            nixl=_nixl(transports.get("nixl"), table, source), peft_raw=wire.peft,
            shape_bytes=shapes,
        )


def check_table(table: np.ndarray, layout: SlotLayout, itemsize: int, source: str) -> None:
    """Every record against the local layout, a column at a time: count, indices,
    ranges, shapes, byte sizes, duplicates. The first bad record is named."""
    model, n = layout.model, len(table)
    limit = len(layout.regions)  # regions in one local slot
    if n == 0:
        raise PeerManifestError(f"{source}: manifest tensors must be a non-empty list")
    if n > limit:
        raise PeerManifestError(f"{source}: {n} tensors; a slot of this pool holds at most {limit}")
    layer, module, kind = (table[k].astype(np.int64) for k in ("layer", "module", "kind"))
    rows, cols = table["rows"].astype(np.int64), table["cols"].astype(np.int64)

    def refuse(bad: np.ndarray, error: type, message) -> None:
        idx = np.flatnonzero(bad)
        if idx.size:
            i = int(idx[0])
            t = table[i]
            what = (f"{source}: tensor #{i} (layer {int(t['layer'])} "
                    f"{MODULES[t['module']] if t['module'] < len(MODULES) else t['module']} "
                    f"{KINDS[t['kind']] if t['kind'] < len(KINDS) else t['kind']})")
            raise error(f"{what}: {message(i)}")

    refuse(table["pad"] != 0, PeerManifestError, lambda i: "reserved field is not 0")
    refuse(module >= len(MODULES), AdapterMismatchError, lambda i: (
        f"module index {int(module[i])} is not a projection of this model (known: "
        f"{', '.join(MODULES)})"))
    extra = np.isin(module, [MODULES.index(m) for m in EXTRA_TARGETS])
    served = np.array([m in layout.pool.extra_targets for m in MODULES], dtype=bool)
    refuse(extra & ~served[module], ExtraTargetsRequiredError, lambda i: (
        f"the adapter has LoRA on {MODULES[module[i]]}, and this engine has no pool memory "
        f"for it: start it with {EXTRA_TARGETS_FLAG} {MODULES[module[i]]}"))
    refuse(layer >= model.num_layers, PeerManifestError,
           lambda i: f"layer {int(layer[i])} is not in [0, {model.num_layers - 1}]")
    refuse(extra & (layer != 0), PeerManifestError, lambda i: "a model-level module's layer must be 0")
    offered = np.array([[m in model.layer_modules(i) or m in EXTRA_TARGETS for m in MODULES]
                        for i in range(model.num_layers)])  # [layers, modules]
    refuse(~offered[layer, module], AdapterMismatchError, lambda i: (
        f"layer {int(layer[i])} of this {model.model_type} model has no "
        f"{MODULES[module[i]]} (its MLP is a mixture of experts)"))
    pooled = np.array([m in layout.pool.target_modules or m in EXTRA_TARGETS for m in MODULES])
    refuse(~pooled[module], AdapterMismatchError, lambda i: (
        f"the adapter has LoRA on {MODULES[module[i]]} but the pool serves only "
        f"{', '.join(layout.pool.target_modules)}; start the engine with "
        + ("--lora-experts (pool memory for expert and router LoRA)"
           if MODULES[module[i]] in MOE_MODULES else f"{MODULES[module[i]]} in its targets")))
    refuse(kind >= len(KINDS), PeerManifestError, lambda i: f"kind {int(kind[i])} is not A, B or M")
    refuse((rows == 0) | (cols == 0), PeerManifestError,
           lambda i: f"shape [{int(rows[i])}, {int(cols[i])}] is not [rank, dim]")
    refuse((kind == 2) & (rows != 1), PeerManifestError,
           lambda i: f"a DoRA magnitude is [1, out], not [{int(rows[i])}, {int(cols[i])}]")
    per_rank = np.array([model.module_rows(m) if model.moe is not None else 1
                         for m in MODULES])[module]  # an expert module: a rank's rows per expert
    refuse((kind < 2) & (rows > layout.max_rank * per_rank), AdapterMismatchError, lambda i: (
        f"rank {-(-int(rows[i]) // int(per_rank[i]))} > --max-lora-rank {layout.max_rank}; "
        f"start the engine with --max-lora-rank {-(-int(rows[i]) // int(per_rank[i]))} or more"))
    expected = np.array([_linear_shape(model, m) for m in MODULES], dtype=np.int64)  # [module, A | B,M]
    want = expected[module, np.minimum(kind, 1)]
    refuse(cols != want, AdapterMismatchError, lambda i: (
        f"is [{int(rows[i])}, {int(cols[i])}], expected [{int(rows[i])}, {int(want[i])}] for "
        "this base model"))
    sizes = rows * cols * itemsize  # rows <= max_rank, cols a model dimension: no overflow
    refuse(table["nbytes"] != sizes.astype(np.uint64), PeerManifestError, lambda i: (
        f"nbytes {int(table['nbytes'][i])} != {int(rows[i])}x{int(cols[i])}x{itemsize}; the "
        "manifest lies about sizes"))
    keys = (layer * len(MODULES) + module) * len(KINDS) + kind
    order = np.argsort(keys, kind="stable")
    dup = np.zeros(n, dtype=bool)
    dup[order[1:]] = keys[order[1:]] == keys[order[:-1]]
    refuse(dup, PeerManifestError, lambda i: "a second tensor for the same layer, module and kind")


@contextmanager
def refusing_malformed(source: str, what: str) -> Iterator[None]:
    """Around code that reads a peer's document: a MetraleError keeps its class (its
    message now names the peer); anything else (a TypeError in a config parser, a
    RecursionError) becomes a PeerManifestError, so a peer can never raise an untyped error."""
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
    """`doc`, as strict_json parsed it (str keys, finite floats), holds no integer beyond
    64 bits, nests at most MAX_JSON_DEPTH deep and would encode to about max_bytes at most.
    Iterative, so no nesting can exhaust the stack here."""
    budget, stack = max_bytes, [(doc, 0)]
    while stack and budget >= 0:
        value, depth = stack.pop()
        kind = type(value)
        if kind is dict or kind is list:
            if depth >= MAX_JSON_DEPTH:
                raise PeerManifestError(f"{source}: manifest nests deeper than {MAX_JSON_DEPTH}")
            budget -= 2 + 2 * len(value)
            if kind is dict:
                budget -= sum(len(key) + 3 for key in value)
            items = value.values() if kind is dict else value
            stack.extend((item, depth + 1) for item in items)
        elif kind is str:
            budget -= len(value) + 2
        elif kind is int:
            if not -(1 << 63) <= value < 1 << 64:
                raise PeerManifestError(f"{source}: manifest has an integer beyond 64 bits")
            budget -= 20
        else:  # a float, true, false or null
            budget -= 24 if kind is float else 5
    if budget < 0:
        raise PeerManifestError(f"{source}: manifest is larger than {max_bytes} bytes")


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


def _http(doc: object, source: str) -> tuple[str | None, bool]:
    """(data path, serves ranges); a peer older than ranges says nothing of them."""
    if doc is None:
        return None, False
    path = doc.get("data_path") if isinstance(doc, dict) else None
    # A path on the same peer only: a URL could point the engine at any host.
    if not isinstance(path, str) or not DATA_PATH_RE.fullmatch(path):
        raise PeerManifestError(f"{source}: http data_path {_short(path)} is not /peer/v1/leases/<id>/data")
    ranges = doc.get("ranges", False)
    if not isinstance(ranges, bool):
        raise PeerManifestError(f"{source}: http ranges {_short(ranges)} is not true or false")
    return path, ranges


def _nixl(doc: object, table: np.ndarray, source: str) -> NixlInfo | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise PeerManifestError(f"{source}: nixl transport info is not an object")
    raw = doc.get("agent_metadata")
    if not isinstance(raw, str) or len(raw) > MAX_METADATA_BYTES * 4 // 3 + 4:
        raise PeerManifestError(f"{source}: nixl agent_metadata missing or oversized")
    metadata = unb64(raw, source, "nixl agent_metadata")
    mem = doc.get("mem_type")
    if mem not in ("DRAM", "VRAM"):
        raise PeerManifestError(f"{source}: nixl mem_type {_short(mem)} is not DRAM or VRAM")
    device = _int(doc, "device", f"{source}: nixl", 0, 1023)
    addrs = table["addr"]
    # nbytes are checked (small), so addr + nbytes wraps only for addresses near 2**64
    bad = (addrs == 0) | (addrs > np.uint64((1 << 64) - 1) - table["nbytes"])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PeerManifestError(
            f"{source}: nixl address {int(addrs[i]):#x} of tensor #{i} is not a remote "
            f"range of {int(table['nbytes'][i])} bytes")
    return NixlInfo(metadata, mem, device, addrs)


def _linear_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a module, (0, 0) for one this model lacks (its records were refused)."""
    try:
        return model.linear_shape(module)
    except KeyError:
        return 0, 0


def tensor_name(model: ModelConfig, layer: int, module: str, kind: str,
                inner: bool = False) -> str:
    """The PEFT name of a manifest tensor (what plan_from_tensors matches). inner: a layer's
    stacked gate_up when its down is targeted too (PEFT nests the second wrapper over the
    first, gate_up's, at mlp.experts.base_layer)."""
    path = f"base_model.model.{model.module_path(layer, module)}" + (".base_layer" if inner else "")
    if kind == "M":
        return f"{path}.lora_magnitude_vector"
    if module == "embed_tokens":
        return f"{path}.lora_embedding_{kind}"
    return f"{path}.lora_{kind}.weight"


def manifest_plan(manifest: Manifest, name: str, peft: PeftAdapterConfig, model: ModelConfig,
                  pool: PoolConfig, source: str) -> AdapterPlan:
    """Validate the tensors exactly like a safetensors header (sizes tile the stream)
    and against PEFT's targets, ranks and shapes; B is listed in PEFT's [out, r]
    shape here even though its bytes arrive transposed (see canonical_views)."""
    with refusing_malformed(source, "manifest or PEFT config"):
        specs, cursor = {}, 0
        records = manifest.table.tolist()
        downs = {layer for layer, m, *_ in records if MODULES[m] == "experts_down"}
        for layer, m, k, rows, cols, _, nbytes, _ in records:
            kind, module = KINDS[k], MODULES[m]
            shape = {"A": [rows, cols], "B": [cols, rows], "M": [cols]}[kind]
            inner = module == "experts_gate_up" and layer in downs
            specs[tensor_name(model, layer, module, kind, inner)] = {
                "dtype": manifest.dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
            cursor += nbytes
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
