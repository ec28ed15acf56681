"""adapter_config.json -> a frozen PeftAdapterConfig, with PEFT's own targeting,
rank and scaling rules (peft.tuners.tuners_utils.check_target_module_exists,
peft.utils.other.get_pattern_key, LoraLayer.update_layer)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale.errors import AdapterConfigError, UnsupportedAdapterError

ALL_LINEAR = "all-linear"


def _tuple_or_none(value: Any) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple, set)):
        return tuple(sorted(value)) if isinstance(value, set) else tuple(value)
    return value


@dataclass(frozen=True)
class PeftAdapterConfig:
    r: int
    lora_alpha: float
    # str: a regex matched with re.fullmatch, or "all-linear"; tuple: names / paths
    target_modules: str | tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    layers_to_transform: int | tuple[int, ...] | None = None
    layers_pattern: str | tuple[str, ...] | None = None
    exclude_modules: str | tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] | None = None
    use_dora: bool = False
    bias: str = "none"
    fan_in_fan_out: bool = False
    peft_type: str = "LORA"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.peft_type.upper() != "LORA":
            raise UnsupportedAdapterError(
                f"peft_type {self.peft_type!r} is not served; metrale serves LoRA adapters only"
            )
        if self.r <= 0:
            raise AdapterConfigError(f"r must be positive, got {self.r}")
        if any(r <= 0 for _, r in self.rank_pattern):
            raise AdapterConfigError(f"rank_pattern ranks must be positive: {self.rank_pattern}")

    # --- PEFT's rules -------------------------------------------------------

    def targets(self, key: str) -> bool:
        """Whether PEFT puts a LoRA on the module named `key` (e.g. model.layers.0.self_attn.q_proj)."""
        excl = self.exclude_modules
        if excl:
            if isinstance(excl, str):
                if re.fullmatch(excl, key):
                    return False
            elif key in excl or any(key.endswith(f".{e}") for e in excl):
                return False
        if self.modules_to_save and any(
            re.match(rf"(^|.*\.){m}($|\..*)", key) for m in self.modules_to_save
        ):
            return False
        targets = self.target_modules
        if isinstance(targets, str):
            return re.fullmatch(targets, key) is not None
        if key in targets:
            # PEFT skips layers_to_transform for an exact full-path match.
            return True
        if not any(key.endswith(f".{t}") for t in targets):
            return False
        return self._layer_selected(key)

    def _layer_selected(self, key: str) -> bool:
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, tuple) and not idx):
            return True
        pattern = self.layers_pattern
        match = None
        if not pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for p in (pattern,) if isinstance(pattern, str) else pattern:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if match:
                    break
        if match is None:
            return False
        layer = int(match.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx

    @staticmethod
    def _pattern_value(pattern: tuple[tuple[str, Any], ...], key: str, default: Any) -> Any:
        for pat, value in pattern:  # first match in file order wins, as in PEFT
            if re.match(rf"(.*\.)?({pat})$", key):
                return value
        return default

    def rank_for(self, key: str) -> int:
        return int(self._pattern_value(self.rank_pattern, key, self.r))

    def alpha_for(self, key: str) -> float:
        return float(self._pattern_value(self.alpha_pattern, key, self.lora_alpha))

    def scaling_for(self, key: str) -> float:
        r, alpha = self.rank_for(key), self.alpha_for(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def max_rank(self) -> int:
        return max([self.r, *(r for _, r in self.rank_pattern)])

    # --- parsing ------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeftAdapterConfig:
        if not isinstance(d, dict):
            raise AdapterConfigError("adapter_config.json must hold a JSON object")
        _refuse_unserved(d)
        try:
            targets = d.get("target_modules")
            if targets is None:
                raise AdapterConfigError(
                    "adapter_config.json has no target_modules; metrale cannot guess "
                    "PEFT's per-architecture defaults: list the modules explicitly"
                )
            targets = targets if isinstance(targets, str) else tuple(sorted(targets))
            layers = d.get("layers_to_transform")
            return cls(
                r=int(d.get("r", 8)),
                lora_alpha=float(d.get("lora_alpha", 8)),
                target_modules=targets,
                use_rslora=bool(d.get("use_rslora") or False),
                rank_pattern=tuple((str(k), int(v)) for k, v in (d.get("rank_pattern") or {}).items()),
                alpha_pattern=tuple(
                    (str(k), float(v)) for k, v in (d.get("alpha_pattern") or {}).items()
                ),
                layers_to_transform=layers if isinstance(layers, int) else _tuple_or_none(layers),
                layers_pattern=_tuple_or_none(d.get("layers_pattern")),
                exclude_modules=_tuple_or_none(d.get("exclude_modules")),
                modules_to_save=_tuple_or_none(d.get("modules_to_save")),
                use_dora=bool(d.get("use_dora") or False),
                bias=str(d.get("bias") or "none"),
                fan_in_fan_out=bool(d.get("fan_in_fan_out") or False),
                peft_type=str(d.get("peft_type") or "LORA"),
                raw=dict(d),
            )
        except (TypeError, ValueError) as e:
            raise AdapterConfigError(f"adapter_config.json has a malformed field: {e}") from None

    @classmethod
    def from_dir(cls, adapter_dir: str | Path) -> PeftAdapterConfig:
        path = Path(adapter_dir) / "adapter_config.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise AdapterConfigError(
                f"{path} not found: an adapter dir needs PEFT's adapter_config.json"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise AdapterConfigError(f"cannot read {path}: {e}") from None
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise AdapterConfigError(f"{path} is not valid JSON: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The PEFT fields metrale uses, JSON-ready (peers send this in manifests)."""
        return {
            "peft_type": self.peft_type, "r": self.r, "lora_alpha": self.lora_alpha,
            "target_modules": self.target_modules if isinstance(self.target_modules, str)
            else list(self.target_modules),
            "use_rslora": self.use_rslora, "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "layers_to_transform": list(self.layers_to_transform)
            if isinstance(self.layers_to_transform, tuple) else self.layers_to_transform,
            "layers_pattern": list(self.layers_pattern)
            if isinstance(self.layers_pattern, tuple) else self.layers_pattern,
            "exclude_modules": list(self.exclude_modules)
            if isinstance(self.exclude_modules, tuple) else self.exclude_modules,
            "modules_to_save": list(self.modules_to_save) if self.modules_to_save else None,
            "use_dora": self.use_dora, "bias": self.bias, "fan_in_fan_out": self.fan_in_fan_out,
        }


def _refuse_unserved(d: dict[str, Any]) -> None:
    """PEFT features whose tensors metrale would silently drop: refuse them by name."""
    if d.get("use_dora"):
        raise UnsupportedAdapterError("DoRA adapters (use_dora=true) are not served yet")
    if (d.get("bias") or "none") != "none":
        raise UnsupportedAdapterError(
            f"bias={d.get('bias')!r} is not served; retrain with bias='none'"
        )
    if d.get("lora_bias"):
        raise UnsupportedAdapterError("lora_bias=true is not served; retrain without it")
    if d.get("modules_to_save"):
        raise UnsupportedAdapterError(
            f"modules_to_save={d['modules_to_save']} (full-weight overlays) is not served; "
            "retrain without modules_to_save"
        )
    if d.get("trainable_token_indices"):
        raise UnsupportedAdapterError("trainable_token_indices (new tokens) is not served")
    if d.get("target_parameters"):
        raise UnsupportedAdapterError(
            "target_parameters (MoE expert/router deltas) is not served"
        )
    if d.get("layer_replication"):
        raise UnsupportedAdapterError("layer_replication is not served")
