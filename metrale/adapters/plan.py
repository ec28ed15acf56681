"""Validate a PEFT adapter directory against the base model and the pool, and
produce an AdapterPlan: which bytes of the file land where, at what rank and
scale. Nothing here touches a device or a slot."""

from __future__ import annotations

import functools
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from metrale.adapters.input_limits import brief, probe
from metrale.adapters.patterns import MatchBudget
from metrale.adapters.peft_config import ALL_LINEAR, PeftAdapterConfig
from metrale.adapters.per_expert import (
    PER_EXPERT_TENSOR,
    ExpertPart,
    expert_landing,
    expert_linears,
    moe_block,
    stack_expert_linears,
)
from metrale.adapters.safetensors_file import TensorEntry, read_header
from metrale.adapters.targets import (
    ModuleTarget,
    TensorLanding,
    check_pool_serves,
    check_rank,
    expected_shape,
)
from metrale.config import (
    EXPERT_MODULES,
    EXTRA_TARGETS,
    LINEAR_MODULES,
    MOE_MODULES,
    MOE_PARAMS,
    ROUTER_MODULE,
    ModelConfig,
    PoolConfig,
)
from metrale.errors import (
    AdapterConfigError,
    AdapterFileError,
    AdapterMismatchError,
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
    # a file source's confinement: every read of `source` resolves inside it (None: a
    # directory the operator named, or a peer)
    root: Path | None = None

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
    return _resolve(peft, model, pool, per_expert=False)[0]


def _resolve(peft: PeftAdapterConfig, model: ModelConfig, pool: PoolConfig,
             per_expert: bool) -> tuple[tuple[ModuleTarget, ...], dict[str, ExpertPart]]:
    """resolve_targets, and with per_expert (the file holds transformers 4's per-expert
    tensors) each expert Linear PEFT wrapped, by path."""
    # (path, layer, module) of everything PEFT could target, model-level ones at layer 0;
    # target_parameters name the experts' stacked parameters (module path + parameter)
    universe = [(model.peft_path(i, m), i, m) for i in range(model.num_layers)
                for m in model.layer_modules(i) if m not in MOE_MODULES]
    universe += [(model.module_path(0, m), 0, m) for m in EXTRA_TARGETS]
    experts = [(f"{model.module_path(i, m)}.{MOE_PARAMS[m]}", i, m)
               for i in range(model.num_layers) for m in model.layer_modules(i)
               if m in MOE_MODULES]
    linears = expert_linears(model) if per_expert else {}
    # transformers 4's routers are Linears too (all-linear wraps them): plain LoRA on logits
    routers = {f"model.layers.{i}.{moe_block(model)}.gate": i
               for i in model.moe.layers} if linears else {}
    universe += [(path, i, ROUTER_MODULE) for path, i in routers.items()]
    _refuse_unknown_parameters(peft.target_parameters, experts, model)
    budget = MatchBudget()
    if isinstance(peft.target_modules, str) and peft.target_modules.lower() == ALL_LINEAR:
        # PEFT expands "all-linear" to every Linear but the output head, by full path.
        linear = tuple(p for p, _, m in universe if m not in EXTRA_TARGETS) + tuple(linears)
        peft = replace(peft, target_modules=linear)
    elif not isinstance(peft.target_modules, str):
        _refuse_unknown_names(peft.target_modules,
                              universe + [(p, i, m) for p, (i, m, _, _) in linears.items()], model)
    targets, needed = [], peft.max_rank()
    named = [(path, layer, module, True) for path, layer, module in universe]
    for path, layer, module, by_module in named + [(*e, False) for e in experts]:
        if by_module and not peft.targets(path, budget):
            continue
        if not by_module and not any(path == t or path.endswith("." + t)
                                     for t in peft.target_parameters):
            continue
        check_pool_serves(path, module, pool)
        rank = peft.rank_for(path, budget)
        check_rank(path, rank, pool, needed)
        targets.append(ModuleTarget(layer, module, rank, peft.scaling_for(path, budget),
                                    model.module_rows(module)))
    stacked, parts = stack_expert_linears(peft, model, pool, linears, budget)
    targets += stacked
    if len({(t.layer, t.module) for t in targets}) < len(targets):
        raise AdapterMismatchError("the adapter holds per-expert tensors and target_parameters "
                                   "on the same experts or router; it does not match its config")
    if not targets:
        raise AdapterMismatchError(
            f"target_modules {brief(peft.target_modules)} matches no module of this "
            f"{model.model_type} model"
        )
    return tuple(targets), parts


def _refuse_unknown_parameters(names, experts, model: ModelConfig) -> None:
    """target_parameters may name the experts' stacked gate_up_proj / down_proj and the
    routers' weight only."""
    for name in names:
        if not any(p == name or p.endswith("." + name) for p, _, _ in experts):
            raise AdapterMismatchError(
                f"target_parameters entry {brief(name)} names no parameter metrale serves LoRA "
                f"on in a {model.model_type} model (mlp.experts.gate_up_proj, "
                "mlp.experts.down_proj and mlp.gate.weight of its expert layers)")


def _refuse_unknown_names(names, universe, model: ModelConfig) -> None:
    known = _names_of(tuple(p for p, _, _ in universe))
    for name in names:
        if name not in known:
            raise AdapterMismatchError(
                f"target module {brief(name)} does not exist in a {model.model_type} model "
                f"(known: {', '.join(LINEAR_MODULES + EXTRA_TARGETS)})"
            )


@functools.lru_cache(maxsize=16)
def _names_of(paths: tuple[str, ...]) -> frozenset[str]:
    """Every path and every `.`-suffix of one: PEFT's list rule, as set lookups; built once
    per model (a new layout's plan asked for it each time: ~0.4 ms for an 8B model)."""
    return frozenset(p[i + 1:] for p in paths for i, c in enumerate(p) if c == ".") | set(paths)


def plan_adapter(
    adapter_dir: str | Path, name: str, model: ModelConfig, pool: PoolConfig,
    root: Path | None = None,
) -> AdapterPlan:
    """Read and check the whole adapter (config, header, every tensor's shape). root: every
    file must resolve inside it (adapters.confined), and so must the plan's later reads."""
    try:
        adapter_dir = Path(adapter_dir)
    except TypeError:
        raise AdapterConfigError(f"adapter path {brief(adapter_dir)} is not a path") from None
    found = probe(adapter_dir, AdapterConfigError, root)
    if found is None or not stat.S_ISDIR(found.st_mode):
        raise AdapterConfigError(f"{adapter_dir} is not a directory")
    peft = PeftAdapterConfig.from_dir(adapter_dir, root)
    weights = adapter_dir / "adapter_model.safetensors"
    if probe(weights, AdapterFileError, root) is None:
        if probe(adapter_dir / "adapter_model.bin", AdapterFileError, root) is not None:
            raise AdapterFileError(
                f"{adapter_dir} holds a pickled adapter_model.bin, which can run code on "
                "load; convert it to adapter_model.safetensors (PEFT: "
                "save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterFileError(f"{weights} not found")
    header = read_header(weights, root)
    plan = plan_from_tensors(name, peft, str(weights), header.tensors.values(), header.data_bytes,
                             model, pool, data_offset=header.data_start)
    return replace(plan, root=root) if root is not None else plan


def plan_from_tensors(
    name: str, peft: PeftAdapterConfig, source: str, entries: Iterable[TensorEntry],
    data_bytes: int, model: ModelConfig, pool: PoolConfig, data_offset: int = 0,
) -> AdapterPlan:
    """Match already size-checked tensors to PEFT's targets (disk and peers alike)."""
    entries = list(entries)
    per_expert = any(PER_EXPERT_TENSOR.search(e.name) for e in entries)
    if per_expert and peft.use_dora:
        raise UnsupportedAdapterError(f"{source}: DoRA on experts (use_dora with per-expert "
                                      "LoRA) is not served")
    targets, parts = _resolve(peft, model, pool, per_expert)
    landings = _match_tensors(source, entries, targets, model, peft.use_dora, parts)
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
    model: ModelConfig, dora: bool = False, expert_parts: dict[str, ExpertPart] | None = None,
) -> tuple[TensorLanding, ...]:
    expert_parts = expert_parts or {}
    t4_block = moe_block(model) if expert_parts else "mlp"  # where a per-expert file's router is
    by_path: dict[str, list[ModuleTarget]] = {}  # a fused Linear (Phi-3) has several parts
    for t in targets:
        if t.module == ROUTER_MODULE:
            by_path[f"model.layers.{t.layer}.{t4_block}.gate"] = [t]
        elif t.module not in EXPERT_MODULES:
            by_path.setdefault(model.peft_path(t.layer, t.module), []).append(t)
    stacked = {(p.target.layer, p.target.module) for p in expert_parts.values()}
    by_path.update(_expert_paths([t for t in targets if (t.layer, t.module) not in stacked], model))
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
        kind = _KINDS[m["kind"]]
        if m["module"] in expert_parts:
            new = [expert_landing(source, entry, kind, expert_parts[m["module"]], model)]
        else:
            new = _module_landings(source, entry, m, kind, by_path, chosen, model, dora)
        if (m["module"], kind) in seen:
            raise AdapterFileError(f"{source}: two tensors for {m['module']} {m['kind']}")
        seen.add((m["module"], kind))
        landings += new
    if len(set(chosen.values())) < len(chosen):
        raise AdapterMismatchError(f"{source}: two nested expert wrappers hold tensors of the "
                                   "same parameter; the file does not match its config")
    names = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}
    kinds = ("A", "B", "M") if dora else ("A", "B")
    missing = [f"{path}.{names[k]}" for path in [*by_path, *expert_parts] for k in kinds
               if (path, k) not in seen]
    if missing:
        raise AdapterFileError(
            f"{source}: targeted modules have no weights: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            + (" (a DoRA adapter needs every module's lora_magnitude_vector)" if dora else "")
        )
    return tuple(landings)


def _module_landings(source: str, entry: TensorEntry, m: re.Match, kind: str, by_path: dict,
                     chosen: dict, model: ModelConfig, dora: bool) -> list[TensorLanding]:
    """The landings of a tensor of a module PEFT wrapped as a whole (a fused Linear's B and
    M split across its parts), after checking it is one the config targets, of its kind and
    shape."""
    parts = by_path.get(m["module"])
    if parts is None:
        raise AdapterMismatchError(
            f"{source}: tensor {brief(entry.name)} is for a module the adapter config "
            "does not target in this model (or a module this model does not have)"
        )
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
    expected = expected_shape(target, kind, model)
    if entry.shape != expected:
        raise AdapterMismatchError(
            f"{source}: {entry.name} has shape {list(entry.shape)}, expected "
            f"{list(expected)} for this base model at rank {target.rank}; the adapter "
            "was trained for another model or its rank_pattern disagrees"
        )
    if target.module in EXPERT_MODULES:  # the candidates are alternatives, not parts
        parts = [target]
    # A is shared; B's and M's rows are split across the parts
    return [TensorLanding(part, kind, entry if kind == "A" else
                          _rows(entry, *model.fused_rows(part.module)[:2])) for part in parts]


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
    fits = [t for t in parts if entry.shape == expected_shape(t, kind, model)]
    if len(fits) > 1:  # both fit: PEFT wraps gate_up first, so it is the inner one
        inner = path.endswith(".base_layer")
        fits = [t for t in fits if (t.module == "experts_gate_up") == inner]
    chosen[path] = fits[0] if fits else parts[0]  # none fits: the shape check says so
    return chosen[path]


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
