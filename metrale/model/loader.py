"""Load Hugging Face safetensors weights (one file or sharded) into LlamaForCausalLM,
fusing q/k/v and gate/up and dequantizing (metrale.model.quantization) as they stream in."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from metrale.config import ConfigError, ModelConfig
from metrale.model.layers import RotaryEmbedding
from metrale.model.llama import LlamaForCausalLM
from metrale.model.quantization import (
    FP8_DTYPES,
    QuantScheme,
    is_linear_weight,
    round_to_fp8,
    scheme_of,
)

# HF name suffix -> (our parameter suffix, shard index within the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ConfigError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json; "
        "metrale loads safetensors checkpoints only (pickled .bin files can run code)"
    )


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int,
               quantization: str | None = None) -> LlamaForCausalLM:
    """quantization "fp8": a dense checkpoint's linear weights rounded to FP8 per output
    channel as they load (a quantized checkpoint keeps its own scheme)."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to_empty(device=device)
    _build_rotary(model)  # computed buffers, not weights
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    scheme = scheme_of(model_dir)
    aux = _aux_tensors(model_dir, scheme) if scheme is not None else {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if scheme is not None and scheme.is_aux(name):
                    continue
                tensor = f.get_tensor(name)
                if scheme is not None and scheme.quantizes(name, tensor):
                    name = name.rsplit(".", 1)[0] + ".weight"
                    tensor = scheme.dequantize(name.removesuffix("weight"), tensor, aux)
                elif tensor.dtype in FP8_DTYPES:
                    raise ConfigError(f"{name} is float8 but config.json has no "
                                      "quantization_config")
                target, shard = param_name(name)
                if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if target not in params:
                    raise ConfigError(f"{path}: unexpected weight {name} for a {cfg.model_type} model")
                if quantization == "fp8" and scheme is None and is_linear_weight(target):
                    tensor = round_to_fp8(tensor)
                copy_weight(params[target], tensor, target, shard, cfg)
                loaded.add(f"{target}#{shard}")
    _check_complete(params, loaded, cfg)
    if cfg.gemma_norms:  # Gemma's norms scale by (1 + w): fold the 1 in once, here
        with torch.no_grad():
            for name, param in params.items():
                if name.endswith("norm.weight"):
                    param.add_(1.0)
    model.to(dtype).eval()
    _build_rotary(model)  # rotary tables stay float32 whatever the weights are
    return model


def _build_rotary(model: LlamaForCausalLM) -> None:
    for module in model.modules():  # Gemma 3 has a second table for its sliding layers
        if isinstance(module, RotaryEmbedding):
            module.build()


def _aux_tensors(model_dir: Path, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """Every tensor dequantization reads, by name: a shard may hold a weight, another its scales."""
    found = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            found.update({n: f.get_tensor(n) for n in f.keys() if scheme.is_aux(n)})
    return found


def param_name(hf: str) -> tuple[str | None, int | None]:
    """(our parameter, shard within it) for an HF weight name; (None, None) for buffers we compute."""
    if hf.endswith("rotary_emb.inv_freq"):
        return None, None
    name = hf.removeprefix("model.")
    for suffix, (fused, shard) in _FUSED.items():
        if f".{suffix}." in f".{name}":
            return name.replace(suffix, fused), shard
    return name, None


def copy_weight(param: torch.Tensor, tensor: torch.Tensor, target: str, shard: int | None,
                cfg: ModelConfig) -> None:
    if shard is not None:
        sizes = ([cfg.q_size, cfg.kv_size, cfg.kv_size] if "qkv_proj" in target
                 else [cfg.intermediate_size] * 2)
        param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
    if param.shape != tensor.shape:
        raise ConfigError(
            f"weight {target} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}: "
            "the checkpoint does not match its config.json"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _check_complete(params, loaded, cfg: ModelConfig) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else None
        keys = [f"{name}#{i}" for i in range(shards)] if shards else [f"{name}#None"]
        if not all(k in loaded for k in keys) and f"{name}#None" not in loaded:  # or fused (Phi-3)
            missing.append(name)
    if missing:
        raise ConfigError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
