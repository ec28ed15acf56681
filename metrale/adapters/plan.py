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
from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.errors import (
    AdapterConfigError,
    AdapterFileError,
    AdapterMismatchError,
    UnsupportedAdapterError,
)

# Modules PEFT can target in a Llama-family model that metrale does not serve yet.
UNSERVED_MODULES = ("model.embed_tokens", "lm_head")
_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


@dataclass(frozen=True)
class ModuleTarget:
    layer: int
    module: str
    rank: int
    scale: float


@dataclass(frozen=True)
class TensorLanding:
    """One file tensor and where it goes: A -> A[slot, :rank, :], B -> Bt[slot, :rank, :]."""

    target: ModuleTarget
    kind: str  # "A" | "B"
    entry: TensorEntry


@dataclass(frozen=True)
class AdapterPlan:
    """A validated adapter: its tensors are byte ranges of one data section of
    data_bytes (a safetensors file's, starting at data_offset, or a peer's stream)."""

    name: str
    config: PeftAdapterConfig
    source: str  # file path or peer address, for messages and logs
    data_bytes: int
    targets: tuple[ModuleTarget, ...]
    landings: tuple[TensorLanding, ...]
    data_offset: int = 0


def module_universe(model: ModelConfig) -> list[tuple[str, int | None, str | None]]:
    """(path, layer, module) of everything PEFT could target; layer None = unserved."""
    paths = [(model.module_path(i, m), i, m) for i in range(model.num_layers) for m in LINEAR_MODULES]
    return paths + [(p, None, None) for p in UNSERVED_MODULES]


def resolve_targets(
    peft: PeftAdapterConfig, model: ModelConfig, pool: PoolConfig
) -> tuple[ModuleTarget, ...]:
    """The (layer, module) pairs PEFT would wrap, with PEFT's rank and scale for each.
    All regex matching shares one MatchBudget, so a pathological pattern costs at
    most patterns.MATCH_BUDGET_S before an AdapterConfigError."""
    universe = module_universe(model)
    budget = MatchBudget()
    if isinstance(peft.target_modules, str) and peft.target_modules.lower() == ALL_LINEAR:
        # PEFT expands "all-linear" to every Linear but the output head, by full path.
        linear = tuple(p for p, layer, _ in universe if layer is not None)
        peft = replace(peft, target_modules=linear)
    elif not isinstance(peft.target_modules, str):
        _refuse_unknown_names(peft.target_modules, universe, model)
    targets = []
    for path, layer, module in universe:
        if not peft.targets(path, budget):
            continue
        if layer is None:
            raise UnsupportedAdapterError(
                f"the adapter targets {path}; embedding / lm_head LoRA is not served yet"
            )
        if module not in pool.target_modules:
            raise AdapterMismatchError(
                f"the adapter targets {module} but the pool serves only "
                f"{', '.join(pool.target_modules)}; start the engine with {module} in its "
                "LoRA target modules"
            )
        rank = peft.rank_for(path, budget)
        if rank > pool.max_lora_rank:
            raise AdapterMismatchError(
                f"{path} has rank {rank} > max_lora_rank {pool.max_lora_rank}; "
                f"start the engine with max_lora_rank >= {peft.max_rank()}"
            )
        targets.append(ModuleTarget(layer, module, rank, peft.scaling_for(path, budget)))
    if not targets:
        raise AdapterMismatchError(
            f"target_modules {brief(peft.target_modules)} matches no module of this "
            f"{model.model_type} model"
        )
    return tuple(targets)


def _refuse_unknown_names(names, universe, model: ModelConfig) -> None:
    # every path and every `.`-suffix of one: PEFT's list rule, as set lookups
    known = {p[i + 1:] for p, _, _ in universe for i, c in enumerate(p) if c == "."}
    known.update(p for p, _, _ in universe)
    for name in names:
        if name not in known:
            raise AdapterMismatchError(
                f"target module {brief(name)} does not exist in a {model.model_type} model "
                f"(known: {', '.join(LINEAR_MODULES)})"
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
    targets = resolve_targets(peft, model, pool)
    landings = _match_tensors(source, entries, targets, model)
    return AdapterPlan(name, peft, source, data_bytes, targets, landings, data_offset)


def _match_tensors(
    source: str, entries: Iterable[TensorEntry], targets: tuple[ModuleTarget, ...],
    model: ModelConfig,
) -> tuple[TensorLanding, ...]:
    by_path = {model.module_path(t.layer, t.module): t for t in targets}
    landings: dict[tuple[str, str], TensorLanding] = {}
    for entry in entries:
        m = _KEY_RE.match(entry.name)
        if m is None:
            raise UnsupportedAdapterError(
                f"{source}: tensor {brief(entry.name)} is not a LoRA A/B weight metrale "
                "serves (DoRA magnitudes, embedding LoRA, biases and overlays are refused)"
            )
        target = by_path.get(m["module"])
        if target is None:
            raise AdapterMismatchError(
                f"{source}: tensor {brief(entry.name)} is for a module the adapter config "
                "does not target in this model (or a module this model does not have)"
            )
        kind = "A" if m["kind"] == "lora_A" else "B"
        d_in, d_out = model.linear_shape(target.module)
        expected = (target.rank, d_in) if kind == "A" else (d_out, target.rank)
        if entry.shape != expected:
            raise AdapterMismatchError(
                f"{source}: {entry.name} has shape {list(entry.shape)}, expected "
                f"{list(expected)} for this base model at rank {target.rank}; the adapter "
                "was trained for another model or its rank_pattern disagrees"
            )
        if (m["module"], kind) in landings:
            raise AdapterFileError(f"{source}: two tensors for {m['module']} {m['kind']}")
        landings[(m["module"], kind)] = TensorLanding(target, kind, entry)
    missing = [
        f"{path}.{k}" for path in by_path for k in ("lora_A", "lora_B")
        if (path, k[-1]) not in landings
    ]
    if missing:
        raise AdapterFileError(
            f"{source}: targeted modules have no weights: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        )
    return tuple(landings.values())
