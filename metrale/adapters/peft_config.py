"""adapter_config.json -> a frozen PeftAdapterConfig, with PEFT's own targeting, rank and
scaling rules (check_target_module_exists, get_pattern_key, LoraLayer.update_layer).

The config is untrusted (an upload or a peer's manifest): every field metrale reads is
type-checked and refused by an AdapterError naming it; other fields are left alone, as PEFT
leaves them. Every alpha / rank pair must give 0 < |scale| <= MAX_SCALE in float32 (or 0
for alpha 0); negative alphas are accepted, as PEFT accepts them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from metrale.adapters.input_limits import brief, parse_json, probe, read_capped_path
from metrale.adapters.patterns import (
    MatchBudget,
    PeftPattern,
    fullmatch_pattern,
    layers_pattern,
    suffix_pattern,
)
from metrale.errors import AdapterConfigError, UnsupportedAdapterError

ALL_LINEAR = "all-linear"
MAX_CONFIG_BYTES = 1 << 20  # real configs are ~1 KB; an exporter's full-path list ~100 KB
MAX_RANK = 1 << 16
MAX_SCALE = 1e4
MAX_LIST_ITEMS = 16384  # target/exclude names, layer indices, rank/alpha pattern entries
MAX_NAME_CHARS = 1024
MAX_LAYER_INDEX = (1 << 31) - 1
# PEFT's default layer-index rule when layers_pattern is empty; ours, so `re` is safe here.
_DEFAULT_LAYER_RE = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")
_LIST_TYPES = (list, tuple)
_NAME_SET_TYPES = (list, tuple, set, frozenset)

Names = str | tuple[str, ...]


@dataclass(frozen=True)
class PeftAdapterConfig:
    r: int
    lora_alpha: float
    # str: a regex matched with re.fullmatch, or "all-linear"; tuple: names / paths
    target_modules: Names
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    layers_to_transform: int | tuple[int, ...] | None = None
    layers_pattern: Names | None = None
    exclude_modules: Names | None = None
    use_dora: bool = False
    fan_in_fan_out: bool = False
    # MoE experts' stacked parameters (mlp.experts.gate_up_proj / down_proj); PEFT keeps
    # them as a set, so their order says nothing (adapters/plan.py matches tensors by shape)
    target_parameters: tuple[str, ...] = ()
    peft_type: str = "LORA"
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    _match: _Matchers = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.use_dora and self.target_parameters:
            raise UnsupportedAdapterError("DoRA on experts' parameters (use_dora with "
                                          "target_parameters) is not served")
        _check_scales(self)
        _check_layer_fields(self)
        object.__setattr__(self, "_match", _Matchers.build(self))

    # --- PEFT's rules -------------------------------------------------------

    def targets(self, key: str, budget: MatchBudget | None = None) -> bool:
        """Whether PEFT puts a LoRA on module `key` (model.layers.0.self_attn.q_proj, ...); one
        budget shared over calls bounds their total regex time."""
        budget = budget or MatchBudget()
        m = self._match
        if m.exclude is not None and m.exclude(key, budget):
            return False
        if isinstance(m.target, PeftPattern):
            return m.target.fullmatch(key, budget)
        if key in m.target.names:
            # PEFT skips layers_to_transform for an exact full-path match.
            return True
        if not m.target.suffix_of(key):
            return False
        return self._layer_selected(key, budget)

    def _layer_selected(self, key: str, budget: MatchBudget) -> bool:
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, tuple) and not idx):
            return True
        layer = None
        if not self._match.layers:
            m = _DEFAULT_LAYER_RE.match(key)
            layer = None if m is None else int(m.group("idx"))
        else:
            for pattern in self._match.layers:  # the first pattern that matches decides
                matched, layer = pattern.layer_match(key, budget)
                if matched:
                    break
        if layer is None:
            return False
        return layer == idx if isinstance(idx, int) else layer in idx

    def rank_for(self, key: str, budget: MatchBudget | None = None) -> int:
        return self._match.rank.value_for(key, self.r, budget or MatchBudget())

    def alpha_for(self, key: str, budget: MatchBudget | None = None) -> float:
        return self._match.alpha.value_for(key, self.lora_alpha, budget or MatchBudget())

    def scaling_for(self, key: str, budget: MatchBudget | None = None) -> float:
        budget = budget or MatchBudget()
        return _scale(self.alpha_for(key, budget), self.rank_for(key, budget), self.use_rslora)

    def max_rank(self) -> int:
        return max([self.r, *(r for _, r in self.rank_pattern)])

    # --- parsing ------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeftAdapterConfig:
        """A config from adapter_config.json's object or a peer manifest's "peft"."""
        if not isinstance(d, dict):
            raise AdapterConfigError(
                f"adapter_config.json must hold a JSON object, got {type(d).__name__}"
            )
        _refuse_unserved(d)
        return cls(
            r=_rank("r", d.get("r", 8)),
            lora_alpha=_alpha("lora_alpha", d.get("lora_alpha", 8)),
            target_modules=_targets(d.get("target_modules")),
            use_rslora=_flag(d, "use_rslora"),
            rank_pattern=_pattern_dict("rank_pattern", d.get("rank_pattern"), _rank),
            alpha_pattern=_pattern_dict("alpha_pattern", d.get("alpha_pattern"), _alpha),
            layers_to_transform=_layer_indices(d.get("layers_to_transform")),
            layers_pattern=_names_or_regex("layers_pattern", d.get("layers_pattern")),
            exclude_modules=_names_or_regex("exclude_modules", d.get("exclude_modules")),
            use_dora=_flag(d, "use_dora"),
            fan_in_fan_out=_flag(d, "fan_in_fan_out"),
            target_parameters=_target_parameters(d.get("target_parameters")),
            peft_type=_peft_type(d.get("peft_type")),
            raw=dict(d),
        )

    @classmethod
    def from_dir(cls, adapter_dir: str | Path, root: Path | None = None) -> PeftAdapterConfig:
        """root: the file must resolve inside it (adapters.confined)."""
        path = Path(adapter_dir) / "adapter_config.json"
        if probe(path, AdapterConfigError, root) is None:
            raise AdapterConfigError(
                f"{path} not found: an adapter dir needs PEFT's adapter_config.json"
            )
        raw = read_capped_path(path, MAX_CONFIG_BYTES, AdapterConfigError, root)
        return cls.from_dict(parse_json(raw, path, AdapterConfigError))

    def to_dict(self) -> dict[str, Any]:
        """The PEFT fields metrale uses, JSON-ready (peers send this in manifests)."""
        return {
            "peft_type": self.peft_type, "r": self.r, "lora_alpha": self.lora_alpha,
            "target_modules": _jsonable(self.target_modules),
            "use_rslora": self.use_rslora, "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "layers_to_transform": _jsonable(self.layers_to_transform),
            "layers_pattern": _jsonable(self.layers_pattern),
            "exclude_modules": _jsonable(self.exclude_modules),
            # from_dict refuses any other bias and a non-empty modules_to_save
            "modules_to_save": None,
            "use_dora": self.use_dora, "bias": "none", "fan_in_fan_out": self.fan_in_fan_out,
            "target_parameters": list(self.target_parameters),
        }


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# --- compiled matchers ----------------------------------------------------------


@dataclass(frozen=True)
class NameSet:
    """A PEFT name list: exact names / full paths, or `.`-suffixes of a path."""

    names: frozenset[str]

    def suffix_of(self, key: str) -> bool:
        """any(key.endswith(f".{n}") for n in names), in O(dots in key) set lookups."""
        i = key.find(".")
        while i >= 0:
            if key[i + 1:] in self.names:
                return True
            i = key.find(".", i + 1)
        return False

    def matches(self, key: str, budget: MatchBudget) -> bool:
        return key in self.names or self.suffix_of(key)


class PatternTable:
    """rank_pattern / alpha_pattern: the value of the first key (file order) that PEFT's
    get_pattern_key accepts; plain keys (an exporter's re.escape'd paths) are looked up by
    the module's dot-suffixes, not tried one by one."""

    def __init__(self, field_name: str, entries: tuple[tuple[str, Any], ...]) -> None:
        self.entries = tuple((suffix_pattern(f"{field_name} key", k), v) for k, v in entries)
        self.first_plain: dict[str, int] = {}
        for i, (pattern, _) in enumerate(self.entries):
            if pattern.literal is not None:
                self.first_plain.setdefault(pattern.literal, i)
        self.regexes = tuple((i, p, v) for i, (p, v) in enumerate(self.entries) if p.literal is None)

    def value_for(self, key: str, default: Any, budget: MatchBudget) -> Any:
        if not self.entries:  # the common case: no pattern at all
            return default
        if "\n" in key:  # `$` before a final newline: leave that corner to the patterns
            return next((v for p, v in self.entries if p.suffix_match(key, budget)), default)
        suffixes = [key, *(key[i + 1:] for i, c in enumerate(key) if c == ".")]
        first = min((self.first_plain[s] for s in suffixes if s in self.first_plain),
                    default=len(self.entries))
        for i, pattern, value in self.regexes:
            if i > first:
                break
            if pattern.suffix_match(key, budget):
                return value
        return self.entries[first][1] if first < len(self.entries) else default


@dataclass(frozen=True)
class _Matchers:
    target: PeftPattern | NameSet
    exclude: Callable[[str, MatchBudget], bool] | None  # PeftPattern.fullmatch or NameSet.matches
    layers: tuple[PeftPattern, ...]
    rank: PatternTable
    alpha: PatternTable

    @classmethod
    def build(cls, c: PeftAdapterConfig) -> _Matchers:
        t = c.target_modules
        target = (fullmatch_pattern("target_modules", t) if isinstance(t, str)
                  else NameSet(frozenset(t)))
        e = c.exclude_modules
        exclude = (None if not e else fullmatch_pattern("exclude_modules", e).fullmatch
                   if isinstance(e, str) else NameSet(frozenset(e)).matches)
        lp = c.layers_pattern  # PEFT: None, "" or [] all mean its default layer rule
        lp = () if not lp else (lp,) if isinstance(lp, str) else lp
        layers = tuple(layers_pattern("layers_pattern", p) for p in lp)
        return cls(
            target, exclude, layers,
            PatternTable("rank_pattern", c.rank_pattern),
            PatternTable("alpha_pattern", c.alpha_pattern),
        )


# --- invariants across fields (each field was read and checked by from_dict) -------------


def _check_scales(c: PeftAdapterConfig) -> None:
    """Every alpha against every rank, through the extremes."""
    ranks = [("r", c.r), *((f"rank_pattern[{brief(k)}]", r) for k, r in c.rank_pattern)]
    alphas = [("lora_alpha", c.lora_alpha),
              *((f"alpha_pattern[{brief(k)}]", a) for k, a in c.alpha_pattern)]
    kind = "lora_alpha / sqrt(r) (rsLoRA)" if c.use_rslora else "lora_alpha / r"
    (a_name, big), (r_name, low) = max(alphas, key=_magnitude), min(ranks, key=itemgetter(1))
    worst = _scale(big, low, c.use_rslora)
    if not abs(worst) <= MAX_SCALE:
        raise AdapterConfigError(
            f"{a_name}={big!r} with {r_name}={low} gives a LoRA scale ({kind}) of {worst:.4g}; "
            f"|scale| must be <= {MAX_SCALE:g}: lower the alpha or raise the rank"
        )
    nonzero = [(n, a) for n, a in alphas if a != 0]
    if nonzero:
        (a_name, small), (r_name, high) = min(nonzero, key=_magnitude), max(ranks, key=itemgetter(1))
        least = _scale(small, high, c.use_rslora)
        if np.float32(least) == 0:
            raise AdapterConfigError(
                f"{a_name}={small!r} with {r_name}={high} gives a LoRA scale ({kind}) of "
                f"{least:.4g}, which is 0 in float32; use alpha 0 to switch a module off, "
                "or a larger alpha"
            )


def _magnitude(named: tuple[str, float]) -> float:
    return abs(named[1])


def _check_layer_fields(c: PeftAdapterConfig) -> None:
    """The combinations PEFT's LoraConfig.__post_init__ refuses."""
    for name in ("layers_to_transform", "layers_pattern"):
        if isinstance(c.target_modules, str) and getattr(c, name) is not None:
            raise AdapterConfigError(
                f"{name} cannot be used when target_modules is a str (a regex); "
                f"PEFT refuses this config: list target_modules or drop {name}"
            )
    if c.layers_pattern and c.layers_to_transform is None:
        raise AdapterConfigError(
            "layers_pattern needs layers_to_transform (PEFT refuses it alone); set "
            "layers_to_transform or drop layers_pattern"
        )


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


# --- field readers: a wrong JSON type is an AdapterConfigError naming the field ---------


def _rank(name: str, value: Any) -> int:
    # PEFT builds nn.Linear(in, r): a float r (even 8.0) fails there, so it fails here.
    if not isinstance(value, int) or isinstance(value, bool):
        raise AdapterConfigError(
            f"{name} must be a positive integer (a LoRA rank such as 8), got {brief(value)}"
        )
    if not 0 < value <= MAX_RANK:
        raise AdapterConfigError(f"{name} must be between 1 and {MAX_RANK}, got {brief(value)}")
    return value


def _alpha(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AdapterConfigError(f"{name} must be a number (LoRA alpha, e.g. 16), got {brief(value)}")
    try:
        alpha = float(value)
    except OverflowError:  # an integer beyond float range
        alpha = math.inf
    if not math.isfinite(alpha):
        raise AdapterConfigError(f"{name} must be a finite number, got {brief(value)}")
    return alpha


def _flag(d: dict, name: str) -> bool:
    value = d.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise AdapterConfigError(f"{name} must be true or false, got {brief(value)}")
    return value


def _peft_type(value: Any) -> str:
    if value is None:
        return "LORA"
    if not isinstance(value, str):
        raise AdapterConfigError(f"peft_type must be a string such as \"LORA\", got {brief(value)}")
    if value.upper() != "LORA":
        raise UnsupportedAdapterError(
            f"peft_type {brief(value)} is not served; metrale serves LoRA adapters only"
        )
    return value


def _name(field_name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise AdapterConfigError(f"{field_name} entries must be strings, got {brief(value)}")
    if len(value) > MAX_NAME_CHARS:
        raise AdapterConfigError(
            f"{field_name} entry {brief(value)} is longer than {MAX_NAME_CHARS} characters"
        )
    return value


def _name_list(field_name: str, value: Any) -> tuple[str, ...]:
    if len(value) > MAX_LIST_ITEMS:
        raise AdapterConfigError(
            f"{field_name} lists {len(value)} entries; the limit is {MAX_LIST_ITEMS}"
        )
    names = [_name(field_name, v) for v in value]
    return tuple(sorted(names)) if isinstance(value, (set, frozenset)) else tuple(names)


def _target_parameters(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, _LIST_TYPES):
        raise AdapterConfigError(f"target_parameters must be a list or null, got {brief(value)}")
    return tuple(dict.fromkeys(_name_list("target_parameters", value)))  # duplicates once


def _targets(value: Any) -> Names:
    if value is None:
        raise AdapterConfigError(
            "adapter_config.json has no target_modules; metrale cannot guess "
            "PEFT's per-architecture defaults: list the modules explicitly"
        )
    if isinstance(value, str):
        return _name("target_modules", value)
    if not isinstance(value, _NAME_SET_TYPES):
        raise AdapterConfigError(
            f"target_modules must be a list of module names or a regex string, got {brief(value)}"
        )
    # PEFT keeps a set; sorted keeps equal configs equal
    return tuple(sorted(set(_name_list("target_modules", value))))


def _names_or_regex(field_name: str, value: Any) -> Names | None:
    if value is None or isinstance(value, str):
        return value if value is None else _name(field_name, value)
    if not isinstance(value, _NAME_SET_TYPES):
        raise AdapterConfigError(
            f"{field_name} must be a string, a list of strings or null, got {brief(value)}"
        )
    return _name_list(field_name, value)


def _layer_indices(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    items = value if isinstance(value, _LIST_TYPES) else None
    if items is None and not (isinstance(value, int) and not isinstance(value, bool)):
        raise AdapterConfigError(
            f"layers_to_transform must be a layer index, a list of them or null, got {brief(value)}"
        )
    if items is not None and len(items) > MAX_LIST_ITEMS:
        raise AdapterConfigError(f"layers_to_transform lists {len(items)} indices; the limit is "
                                 f"{MAX_LIST_ITEMS}")
    for i in (value,) if items is None else items:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= MAX_LAYER_INDEX:
            raise AdapterConfigError(
                f"layers_to_transform entries must be layer indices >= 0, got {brief(i)}"
            )
    return value if items is None else tuple(items)


def _pattern_dict(field_name: str, value: Any, read: Callable[[str, Any], Any]) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise AdapterConfigError(
            f"{field_name} must be an object mapping module patterns to values, got {brief(value)}"
        )
    if len(value) > MAX_LIST_ITEMS:
        raise AdapterConfigError(f"{field_name} has {len(value)} entries; the limit is {MAX_LIST_ITEMS}")
    return tuple((_name(f"{field_name} key", k), read(f"{field_name}[{brief(k)}]", v))
                 for k, v in value.items())


# --- PEFT features metrale does not serve ------------------------------------------

# LoRA variants whose forward differs from scaling * B @ A (PEFT's lora_variants):
# their weights may look like plain LoRA, so serving them silently would be wrong.
_VARIANT_CONFIGS = ("alora_invocation_tokens", "arrow_config", "use_bdlora", "velora_config",
                    "monteclora_config", "kasa_config")
_BIASES = ("none", "all", "lora_only")


def _refuse_unserved(d: dict[str, Any]) -> None:
    """PEFT features whose tensors metrale would silently drop: refuse them by name."""
    bias = d.get("bias")
    if bias is not None and bias not in _BIASES:
        raise AdapterConfigError(f"bias must be one of {', '.join(_BIASES)}, got {brief(bias)}")
    if bias not in (None, "none"):
        raise UnsupportedAdapterError(f"bias={bias!r} is not served; retrain with bias='none'")
    if _flag(d, "lora_bias"):
        raise UnsupportedAdapterError("lora_bias=true is not served; retrain without it")
    if _flag(d, "use_qalora"):
        raise UnsupportedAdapterError("QALoRA (use_qalora=true) is not served")
    _refuse_nonempty(d, "modules_to_save", _NAME_SET_TYPES,
                     "modules_to_save={} (full-weight overlays: a full-size copy of each "
                     "module per slot) is not served; retrain without modules_to_save")
    _refuse_nonempty(d, "trainable_token_indices", (list, tuple, dict),
                     "trainable_token_indices={} (new tokens: full embedding rows per slot) "
                     "is not served")
    _refuse_nonempty(d, "layer_replication", _LIST_TYPES, "layer_replication={} is not served")
    for name in _VARIANT_CONFIGS:
        if d.get(name) is not None:  # PEFT turns even {} into an active variant
            raise UnsupportedAdapterError(
                f"{name}={brief(d[name])} selects a LoRA variant metrale does not serve; "
                f"retrain without {name}"
            )


def _refuse_nonempty(d: dict, name: str, types: tuple[type, ...], message: str) -> None:
    value = d.get(name)
    if value is None:
        return
    if not isinstance(value, types):
        raise AdapterConfigError(f"{name} must be a list or null, got {brief(value)}")
    if value:
        raise UnsupportedAdapterError(message.format(brief(value)))
