"""Validate a PEFT adapter directory against the base model and the pool, and
produce an AdapterPlan: which bytes of the file land where, at what rank and
scale. Nothing here touches a device or a slot."""

from __future__ import annotations

import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from metrale.adapters.input_limits import brief, probe
from metrale.adapters.patterns import MatchBudget
from metrale.adapters.peft_config import ALL_LINEAR, PeftAdapterConfig
from metrale.adapters.safetensors_file import TensorEntry, read_header
from metrale.config import (
    EXPERT_MODULES,
    EXPERT_PARAMS,
    EXTRA_TARGETS,
    EXTRA_TARGETS_FLAG,
    LINEAR_MODULES,
    ModelConfig,
    PoolConfig,
)
from metrale.errors import (
    AdapterConfigError,
    AdapterFileError,
    AdapterMismatchError,
    ExtraTargetsRequiredError,
    UnsupportedAdapterError,
)

# PEFT's tensor names: lora_A/B of a Linear, lora_embedding_A/B of an Embedding (no
# ".weight": they are Parameters), and DoRA's lora_magnitude_vector (saved without
# ".weight" by current PEFT, with it by some older versions). An optional adapter-name infix.
_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_PARAM_RE = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector)(?:\.[A-Za-z0-9_-]+)?(?:\.weight)?$"
)
# PEFT's save_pretrained writes the frozen base weight of a targeted embed_tokens / lm_head
# (save_embedding_layers="auto"); at the base model's shape it is the base, and is skipped.
_BASE_RE = re.compile(r"^base_model\.model\.(?P<module>model\.embed_tokens|lm_head)"
                      r"\.base_layer\.weight$")
_KINDS = {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B",
          "lora_magnitude_vector": "M"}


@dataclass(frozen=True)
class ModuleTarget:
    layer: int
    module: str
    rank: int
    scale: float
    experts: int = 1  # an expert module's A and B stack a rank-r factor per expert


@dataclass(frozen=True)
class TensorLanding:
    """One file tensor and where it goes: A -> A[slot, :rank, :], B -> Bt[slot, :rank, :],
    M (DoRA magnitude, [out]) -> the module's M region."""

    target: ModuleTarget
    kind: str  # "A" | "B" | "M"
    entry: TensorEntry

    @property
    def rows(self) -> int:  # of its region it fills
        return 1 if self.kind == "M" else self.target.rank * self.target.experts


@dataclass(frozen=True)
class AdapterPlan:
    """A validated adapter: its tensors are byte ranges of one data section (a safetensors
    file's, at data_offset, or a peer's stream)."""

    name: str
    config: PeftAdapterConfig
    source: str  # file path or peer address, for messages and logs
    data_bytes: int
    targets: tuple[ModuleTarget, ...]
    landings: tuple[TensorLanding, ...]
    data_offset: int = 0
    # the (begin, end) byte ranges the landings use, in file order, when the file also holds
    # bytes nothing lands (PEFT's frozen embedding / head copies: GBs on an 8B model); ()
    # stages the whole data section
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def dora(self) -> bool:
        return self.config.use_dora

    @property
    def staged_bytes(self) -> int:
        return sum(b - a for a, b in self.spans) if self.spans else self.data_bytes

    def staged_begin(self, entry: TensorEntry) -> int:
        """Where entry's bytes start in the staged buffer (the spans laid end to end)."""
        if not self.spans:
            return entry.begin
        pos = 0
        for a, b in self.spans:
            if a <= entry.begin < b:
                return pos + entry.begin - a
            pos += b - a
        raise AssertionError(f"{entry.name} lies outside the plan's spans")


def resolve_targets(
    peft: PeftAdapterConfig, model: ModelConfig, pool: PoolConfig
) -> tuple[ModuleTarget, ...]:
    """The (layer, module) pairs PEFT would wrap, with its rank and scale for each; one
    MatchBudget bounds all the regex matching."""
    # (path, layer, module) of everything PEFT could target, model-level ones at layer 0;
    # target_parameters name the experts' stacked parameters (module path + parameter)
    universe = [(model.peft_path(i, m), i, m) for i in range(model.num_layers)
                for m in model.layer_modules(i) if m not in EXPERT_MODULES]
    universe += [(model.module_path(0, m), 0, m) for m in EXTRA_TARGETS]
    experts = [(f"{model.module_path(i, m)}.{EXPERT_PARAMS[m]}", i, m)
               for i in range(model.num_layers) for m in model.layer_modules(i)
               if m in EXPERT_MODULES]
    _refuse_unknown_parameters(peft.target_parameters, experts, model)
    budget = MatchBudget()
    if isinstance(peft.target_modules, str) and peft.target_modules.lower() == ALL_LINEAR:
        # PEFT expands "all-linear" to every Linear but the output head, by full path.
        linear = tuple(p for p, _, m in universe if m not in EXTRA_TARGETS)
        peft = replace(peft, target_modules=linear)
    elif not isinstance(peft.target_modules, str):
        _refuse_unknown_names(peft.target_modules, universe, model)
    targets = []
    for path, layer, module in universe + experts:
        if module in EXPERT_MODULES:
            if not any(path == t or path.endswith("." + t) for t in peft.target_parameters):
                continue
        elif not peft.targets(path, budget):
            continue
        if module in EXTRA_TARGETS and module not in pool.extra_targets:
            raise ExtraTargetsRequiredError(
                f"the adapter has LoRA on {path}, and this engine has no pool memory for "
                f"{module}: start it with {EXTRA_TARGETS_FLAG} {module}"
            )
        if module not in pool.target_modules and module not in EXTRA_TARGETS:
            hint = ("--lora-experts (pool memory for expert LoRA)" if module in EXPERT_MODULES
                    else f"{module} in its LoRA target modules")
            raise AdapterMismatchError(
                f"the adapter targets {path} but the pool serves only "
                f"{', '.join(pool.target_modules)}; start the engine with {hint}"
            )
        rank = peft.rank_for(path, budget)
        if rank > pool.max_lora_rank:
            raise AdapterMismatchError(
                f"{path} has rank {rank} > --max-lora-rank {pool.max_lora_rank}; "
                f"start the engine with --max-lora-rank {peft.max_rank()} or more"
            )
        targets.append(ModuleTarget(layer, module, rank, peft.scaling_for(path, budget),
                                    model.module_rows(module)))
    if not targets:
        raise AdapterMismatchError(
            f"target_modules {brief(peft.target_modules)} matches no module of this "
            f"{model.model_type} model"
        )
    return tuple(targets)


def _refuse_unknown_parameters(names, experts, model: ModelConfig) -> None:
    """target_parameters may name the experts' stacked gate_up_proj / down_proj only."""
    for name in names:
        if not any(p == name or p.endswith("." + name) for p, _, _ in experts):
            what = "router" if name.endswith("gate.weight") else "parameter"
            raise AdapterMismatchError(
                f"target_parameters entry {brief(name)} names no {what} metrale serves LoRA on "
                f"in a {model.model_type} model (mlp.experts.gate_up_proj and "
                "mlp.experts.down_proj of its expert layers)")


def _refuse_unknown_names(names, universe, model: ModelConfig) -> None:
    # every path and every `.`-suffix of one: PEFT's list rule, as set lookups
    known = {p[i + 1:] for p, _, _ in universe for i, c in enumerate(p) if c == "."}
    known.update(p for p, _, _ in universe)
    for name in names:
        if name not in known:
            raise AdapterMismatchError(
                f"target module {brief(name)} does not exist in a {model.model_type} model "
                f"(known: {', '.join(LINEAR_MODULES + EXTRA_TARGETS)})"
            )


def plan_adapter(
    adapter_dir: str | Path, name: str, model: ModelConfig, pool: PoolConfig
) -> AdapterPlan:
    """Read and check the whole adapter (config, header, every tensor's shape)."""
    try:
        adapter_dir = Path(adapter_dir)
    except TypeError:
        raise AdapterConfigError(f"adapter path {brief(adapter_dir)} is not a path") from None
    found = probe(adapter_dir, AdapterConfigError)
    if found is None or not stat.S_ISDIR(found.st_mode):
        raise AdapterConfigError(f"{adapter_dir} is not a directory")
    peft = PeftAdapterConfig.from_dir(adapter_dir)
    weights = adapter_dir / "adapter_model.safetensors"
    if probe(weights, AdapterFileError) is None:
        if probe(adapter_dir / "adapter_model.bin", AdapterFileError) is not None:
            raise AdapterFileError(
                f"{adapter_dir} holds a pickled adapter_model.bin, which can run code on "
                "load; convert it to adapter_model.safetensors (PEFT: "
                "save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterFileError(f"{weights} not found")
    header = read_header(weights)
    return plan_from_tensors(name, peft, str(weights), header.tensors.values(), header.data_bytes,
                             model, pool, data_offset=header.data_start)


def plan_from_tensors(
    name: str, peft: PeftAdapterConfig, source: str, entries: Iterable[TensorEntry],
    data_bytes: int, model: ModelConfig, pool: PoolConfig, data_offset: int = 0,
) -> AdapterPlan:
    """Match already size-checked tensors to PEFT's targets (disk and peers alike)."""
    entries = list(entries)
    targets = resolve_targets(peft, model, pool)
    landings = _match_tensors(source, entries, targets, model, peft.use_dora)
    spans = _spans(landings) if len(landings) < len(entries) else ()
    return AdapterPlan(name, peft, source, data_bytes, targets, landings, data_offset, spans)


def _spans(landings: tuple[TensorLanding, ...]) -> tuple[tuple[int, int], ...]:
    spans: list[list[int]] = []
    for e in sorted((t.entry for t in landings), key=lambda e: e.begin):
        if spans and spans[-1][1] == e.begin:
            spans[-1][1] = e.end
        else:
            spans.append([e.begin, e.end])
    return tuple((a, b) for a, b in spans)


def _match_tensors(
    source: str, entries: Iterable[TensorEntry], targets: tuple[ModuleTarget, ...],
    model: ModelConfig, dora: bool = False,
) -> tuple[TensorLanding, ...]:
    by_path: dict[str, list[ModuleTarget]] = {}  # a fused Linear (Phi-3) has several parts
    for t in targets:
        if t.module not in EXPERT_MODULES:
            by_path.setdefault(model.peft_path(t.layer, t.module), []).append(t)
    by_path.update(_expert_paths(targets, model))
    chosen: dict[str, ModuleTarget] = {}  # an expert path's target, once a tensor told it
    landings: list[TensorLanding] = []
    seen: set[tuple[str, str]] = set()
    for entry in entries:
        if _frozen_base_copy(source, entry, model):
            continue
        m = _KEY_RE.match(entry.name) or _PARAM_RE.match(entry.name)
        if m is None:
            raise UnsupportedAdapterError(
                f"{source}: tensor {brief(entry.name)} is not a LoRA A/B, embedding or DoRA "
                "magnitude weight metrale serves (biases and full-weight overlays are refused)"
            )
        parts = by_path.get(m["module"])
        if parts is None:
            raise AdapterMismatchError(
                f"{source}: tensor {brief(entry.name)} is for a module the adapter config "
                "does not target in this model (or a module this model does not have)"
            )
        kind = _KINDS[m["kind"]]
        target = parts[0] if parts[0].module not in EXPERT_MODULES else \
            _expert_target(m["module"], kind, entry, parts, chosen, model)
        if (target.module == "embed_tokens") != m["kind"].startswith("lora_embedding") \
                and kind != "M":
            raise AdapterMismatchError(
                f"{source}: tensor {brief(entry.name)}: PEFT stores an embedding's LoRA as "
                "lora_embedding_A/B and a linear's as lora_A/B.weight; this one is neither"
            )
        if kind == "M" and not dora:
            raise AdapterMismatchError(
                f"{source}: tensor {brief(entry.name)} is a DoRA magnitude, but the adapter "
                "config does not set use_dora=true"
            )
        expected = _expected(target, kind, model)
        if entry.shape != expected:
            raise AdapterMismatchError(
                f"{source}: {entry.name} has shape {list(entry.shape)}, expected "
                f"{list(expected)} for this base model at rank {target.rank}; the adapter "
                "was trained for another model or its rank_pattern disagrees"
            )
        if (m["module"], kind) in seen:
            raise AdapterFileError(f"{source}: two tensors for {m['module']} {m['kind']}")
        seen.add((m["module"], kind))
        if target.module in EXPERT_MODULES:  # the candidates are alternatives, not parts
            parts = [target]
        for part in parts:  # A is shared; B's and M's rows are split across the parts
            part_entry = entry if kind == "A" else _rows(entry, *model.fused_rows(part.module)[:2])
            landings.append(TensorLanding(part, kind, part_entry))
    if len(set(chosen.values())) < len(chosen):
        raise AdapterMismatchError(f"{source}: two nested expert wrappers hold tensors of the "
                                   "same parameter; the file does not match its config")
    names = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}
    kinds = ("A", "B", "M") if dora else ("A", "B")
    missing = [f"{path}.{names[k]}" for path in by_path for k in kinds if (path, k) not in seen]
    if missing:
        raise AdapterFileError(
            f"{source}: targeted modules have no weights: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            + (" (a DoRA adapter needs every module's lora_magnitude_vector)" if dora else "")
        )
    return tuple(landings)


def _expert_paths(targets, model: ModelConfig) -> dict:
    """The tensor paths of a layer's expert targets, each with all of them as candidates.
    PEFT nests a module's wrapped parameters, so of N targeted the tensors sit at mlp.experts
    and mlp.experts.base_layer (and deeper); which is which depends on PEFT's wrapping
    order, not on the config's list (a set), so _match_tensors tells them apart by shape."""
    layers: dict[int, list[ModuleTarget]] = {}
    for t in targets:
        if t.module in EXPERT_MODULES:
            layers.setdefault(t.layer, []).append(t)
    return {model.module_path(layer, ts[0].module) + ".base_layer" * k: ts
            for layer, ts in layers.items() for k in range(len(ts))}


def _expert_target(path: str, kind: str, entry: TensorEntry, parts, chosen: dict,
                   model: ModelConfig) -> ModuleTarget:
    """Which of a layer's expert targets the tensor at `path` is: the one its shape fits
    (gate_up A is [r*E, hidden], down's [r*E, expert size]; B out 2 x expert size vs
    hidden), the same for a path's A and B; with both fitting, the order PEFT wraps them
    in (gate_up inner)."""
    if path in chosen:
        return chosen[path]
    fits = [t for t in parts if entry.shape == _expected(t, kind, model)]
    if len(fits) > 1:  # both fit: PEFT wraps gate_up first, so it is the inner one
        inner = path.endswith(".base_layer")
        fits = [t for t in fits if (t.module == "experts_gate_up") == inner]
    chosen[path] = fits[0] if fits else parts[0]  # none fits: the shape check says so
    return chosen[path]


def _expected(target: ModuleTarget, kind: str, model: ModelConfig) -> tuple[int, ...]:
    d_in, d_out = model.linear_shape(target.module)[0], model.fused_rows(target.module)[2]
    rows = target.rank * target.experts
    return {"A": (rows, d_in), "B": (d_out, rows), "M": (d_out,)}[kind]


def _rows(entry: TensorEntry, first: int, rows: int) -> TensorEntry:
    """Rows [first, first + rows) of a row-major tensor entry."""
    if first == 0 and rows == entry.shape[0]:
        return entry
    row_bytes = entry.nbytes // entry.shape[0]
    begin = entry.begin + first * row_bytes
    return replace(entry, shape=(rows, *entry.shape[1:]), begin=begin, end=begin + rows * row_bytes)


def _frozen_base_copy(source: str, entry: TensorEntry, model: ModelConfig) -> bool:
    """Whether entry is PEFT's copy of a frozen embed_tokens / lm_head weight (skipped: the
    engine serves its own); at another shape, a resized vocabulary, it is refused."""
    m = _BASE_RE.match(entry.name)
    if m is None:
        return False
    if entry.shape != (model.vocab_size, model.hidden_size):
        raise UnsupportedAdapterError(
            f"{source}: tensor {brief(entry.name)} has shape {list(entry.shape)}, not the base "
            f"model's [{model.vocab_size}, {model.hidden_size}]: the adapter adds new tokens "
            "(a resized vocabulary), which would need a full embedding copy per slot and is "
            "not served; retrain without resizing the vocabulary"
        )
    return True
