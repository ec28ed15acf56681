"""Load Hugging Face safetensors weights (one file or sharded) into LlamaForCausalLM,
fusing q/k/v and gate/up and dequantizing (metrale.model.quantization) as they stream in."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from metrale.config import ConfigError, ModelConfig
from metrale.model.layers import LoraProjection, RotaryEmbedding
from metrale.model.llama import LlamaForCausalLM
from metrale.model.parallel import Shard
from metrale.model.quantization import FP8_DTYPES, Int4Codes, QuantScheme, bnb_state, scheme_of
from metrale.ops import int4_linear as int4
from metrale.ops.fp8_linear import DEFAULT_ACTIVATIONS, quantize_rows

log = logging.getLogger("metrale.loader")

# MoE layers: the stacked experts' parts (Qwen/OLMoE names, Mixtral's w1/w3/w2) or the
# stacks themselves, and the router and shared expert by their name within the layer
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PARTS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}
_LAYER = re.compile(r"^(layers\.\d+)\.(.+)$")
_MOE_NAMES = {
    "mlp.gate.weight": ("mlp.router", None), "block_sparse_moe.gate.weight": ("mlp.router", None),
    # transformers 5's in-memory layout, already stacked ([E, 2I, H] gate then up; [E, H, I])
    "mlp.experts.gate_up_proj": ("mlp.experts_gate_up", None),
    "mlp.experts.down_proj": ("mlp.experts_down", None),
    "mlp.shared_expert.gate_proj.weight": ("mlp.shared_gate_up", 0),
    "mlp.shared_expert.up_proj.weight": ("mlp.shared_gate_up", 1),
    "mlp.shared_expert.down_proj.weight": ("mlp.shared_down", None),
    "mlp.shared_expert_gate.weight": ("mlp.shared_expert_gate", None),
}
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
               quantization: str | None = None,
               fp8_activations: str = DEFAULT_ACTIVATIONS,
               tp_shard: Shard | None = None) -> LlamaForCausalLM:
    """quantization "fp8": a dense checkpoint's linear weights rounded to FP8 per output
    channel as they load (a quantized checkpoint keeps its own scheme). FP8 linears stay FP8
    in memory (metrale.ops.fp8_linear, activations in the mode fp8_activations names).
    tp_shard: load this tensor-parallel rank's part (cfg is then its shard_config); dense
    checkpoints only."""
    model_dir = Path(model_dir)
    scheme = scheme_of(model_dir)
    if tp_shard is not None and (scheme is not None or quantization is not None):
        raise ConfigError("tensor parallelism loads dense checkpoints only (no quantization yet)")
    aux = _aux_tensors(model_dir, scheme) if scheme is not None else {}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp_shard)
    projections = {f"{name}.weight": m for name, m in model.named_modules()
                   if isinstance(m, LoraProjection)}
    shapes = {target: proj.weight.shape for target, proj in projections.items()}
    for target, block in _fp8_projections(shapes, cfg, scheme, aux, quantization).items():
        projections[target].use_fp8(block, fp8_activations)  # before memory: a 70B base never exists in bf16
    for target, layout in _int4_projections(shapes, cfg, scheme, aux).items():
        projections[target].use_int4(layout)
    model = model.to_empty(device=device)
    build_computed(model)  # buffers computed, not loaded (the dtype cast below skips them)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if scheme is not None and scheme.is_aux(name):
                    continue
                tensor = f.get_tensor(name)
                if scheme is not None and scheme.quantizes(name, tensor):
                    name = name.rsplit(".", 1)[0] + ".weight"
                    prefix = name.removesuffix("weight")
                    target, shard = param_name(name)
                    if target in projections and projections[target].is_fp8:
                        copy_fp8(projections[target], *scheme.fp8_parts(prefix, tensor, aux),
                                 target, shard, cfg)
                        loaded.add(f"{target}#{shard}")
                        continue
                    if target in projections and projections[target].quant == "int4":
                        copy_int4(projections[target], scheme.int4_codes(prefix, tensor, aux),
                                  target, shard, cfg)
                        loaded.add(f"{target}#{shard}")
                        continue
                    tensor = scheme.dequantize(prefix, tensor, aux)
                elif tensor.dtype in FP8_DTYPES:
                    raise ConfigError(f"{name} is float8 but config.json has no "
                                      "quantization_config")
                target, shard = param_name(name)
                if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if target not in params:
                    raise ConfigError(f"{path}: unexpected weight {name} for a {cfg.model_type} model")
                if tp_shard is not None:  # this rank's part only ("shard" is a fused part's index)
                    tensor = tp_shard.slice_weight(target, tensor, cfg.vocab_size)
                if target in projections and projections[target].is_fp8:  # --quantization fp8
                    q, scale = quantize_rows(tensor)
                    copy_fp8(projections[target], q, scale, (1, tensor.shape[1]), target, shard, cfg)
                else:
                    copy_weight(params[target], tensor, target, shard, cfg)
                loaded.add(f"{target}#{shard}")
    _check_complete(params, loaded, cfg)
    if cfg.gemma_norms:  # Gemma's norms scale by (1 + w): fold the 1 in once, here
        with torch.no_grad():
            for name, param in params.items():
                if name.endswith("norm.weight"):
                    param.add_(1.0)
    with torch.no_grad():
        for param in model.parameters():  # nn.Module.to(dtype) would cast FP8 / 4-bit too
            if param.dtype.is_floating_point and param.dtype not in FP8_DTYPES:
                param.data = param.data.to(dtype)
    return model.eval()


def _fp8_projections(shapes: dict[str, torch.Size], cfg: ModelConfig,
                     scheme: QuantScheme | None, aux: dict[str, torch.Tensor],
                     quantization: str | None) -> dict:
    """Of our projection weights (shapes: name -> [N, K]) those that stay FP8 -> their scale
    blocks (so, si): all under --quantization fp8; in an FP8 checkpoint those whose parts
    all have scales (a fused one whose parts do not share the row blocks gets a scale per
    row and K block)."""
    if scheme is None:
        if quantization != "fp8":
            return {}
        return {name: (1, shape[1]) for name, shape in shapes.items()}
    if scheme.method not in ("fp8", "compressed-tensors"):
        return {}
    parts: dict[str, list[int | None]] = {}
    for name in aux:
        last = name.rsplit(".", 1)[-1]
        if last in ("weight_scale", "weight_scale_inv"):
            target, shard = param_name(name.removesuffix(last) + "weight")
            parts.setdefault(target, []).append(shard)
    blocks = {}
    for target, shape in shapes.items():
        sizes = _shard_sizes(target, cfg)
        shards = parts.get(target, [])
        if None not in shards and len(shards) < len(sizes):
            continue  # not every part quantized: dequantized at load instead
        if scheme.block is None:
            blocks[target] = (1, shape[1])
            continue
        bo, bi = scheme.block
        aligned = None in shards or all(size % bo == 0 for size in sizes)
        blocks[target] = (bo if aligned else 1, bi)
    return blocks


def _int4_projections(shapes: dict[str, torch.Size], cfg: ModelConfig,
                      scheme: QuantScheme | None, aux: dict[str, torch.Tensor]) -> dict:
    """Of our projection weights those that stay 4-bit -> their Int4Layout: every part
    quantized alike (group size, scale dtype, codebook, GPTQ act order) into groups the
    kernel takes. The rest dequantize at load (logged)."""
    if scheme is None or scheme.method not in ("awq", "gptq", "bitsandbytes"):
        return {}
    parts: dict[str, dict] = {}  # target -> {shard: (layout fields, g_idx or codebook)}
    for name in aux:
        if scheme.method == "bitsandbytes" and name.endswith(".weight.absmax"):
            weight = name.removesuffix(".absmax")
            _, shape, blocksize = bnb_state(weight, aux)
            key = (blocksize if shape[1] % blocksize == 0 else 0, torch.float32, False, True)
            extra = aux.get(f"{weight}.quant_map")
        elif scheme.method != "bitsandbytes" and name.endswith(".scales"):
            weight = name.removesuffix("scales") + "weight"
            extra = aux.get(name.removesuffix("scales") + "g_idx")
            key = (scheme.group_size, aux[name].dtype, True, False)
        else:
            continue
        target, shard = param_name(weight)
        parts.setdefault(target, {})[shard] = (key, extra)
    layouts = {}
    for target, shape in shapes.items():
        found = parts.get(target)
        if not found:
            continue
        k = shape[1]
        keys = {key for key, _ in found.values()}
        extras = [extra for _, extra in found.values()]
        complete = None in found or len(found) == len(_shard_sizes(target, cfg))
        same = len(keys) == 1 and (all(e is None for e in extras) or (
            all(e is not None for e in extras) and all(torch.equal(extras[0], e) for e in extras)))
        group, scale_dtype, zero, codebook = next(iter(keys))
        group = k if group in (-1, None) or group >= k else group
        act_order = (scheme.method == "gptq" and extras[0] is not None
                     and not torch.equal(extras[0].long(), torch.arange(k) // group))
        ok = complete and same and group > 0 and (group == k or group % 32 == 0)
        if ok and act_order:  # stored columns sorted by group: each group whole, in order
            sorted_groups = extras[0].long()[torch.argsort(extras[0].long(), stable=True)]
            ok = torch.equal(sorted_groups, torch.arange(k) // group)
        if not ok:
            log.info("%s: 4-bit parts the kernel cannot take together; dequantized at load",
                     target)
            continue
        layouts[target] = int4.Int4Layout(group, scale_dtype, zero, codebook, act_order)
    return layouts


def copy_int4(proj: LoraProjection, codes: Int4Codes | None, target: str, shard: int | None,
              cfg: ModelConfig) -> None:
    """One checkpoint part's 4-bit codes into a 4-bit projection (its columns sorted by
    group under GPTQ act order)."""
    start, rows = _part_rows(proj, target, shard, cfg)
    if codes is None or codes.q.shape != (rows, proj.in_features) or \
            codes.scale.shape[1] != proj.weight_scale.shape[1]:
        got = None if codes is None else tuple(codes.q.shape)
        raise ConfigError(f"weight {target} has shape {got}, expected {(rows, proj.in_features)} "
                          f"in {proj.weight_scale.shape[1]} groups: the checkpoint does not "
                          "match its config.json")
    q = codes.q
    if proj.input_perm is not None:
        perm = torch.argsort(codes.group_of, stable=True)
        q = q[:, perm]
        proj.input_perm.copy_(perm)
    with torch.no_grad():
        proj.weight.narrow(0, start, rows).copy_(int4.pack(q))
        proj.weight_scale.narrow(0, start, rows).copy_(codes.scale)
        if proj.weight_zero is not None:
            proj.weight_zero.narrow(0, start, rows).copy_(codes.zero)
        if proj.codebook is not None:
            proj.codebook.copy_(codes.codebook)


def _part_rows(proj: LoraProjection, target: str, shard: int | None,
               cfg: ModelConfig) -> tuple[int, int]:
    """(first row, rows) of proj's output rows that checkpoint part `shard` fills."""
    if shard is None:
        return 0, proj.weight.shape[0]
    sizes = _shard_sizes(target, cfg)
    return sum(sizes[:shard]), sizes[shard]


def _shard_sizes(target: str, cfg: ModelConfig) -> list[int]:
    if "qkv_proj" in target:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    if "gate_up_proj" in target:
        return [cfg.intermediate_size] * 2
    if target.endswith("shared_gate_up"):
        return [cfg.moe.shared_expert_size] * 2
    return [0]


def _num_shards(target: str, cfg: ModelConfig) -> int | None:
    """How many checkpoint parts make the parameter (None: one, unsplit)."""
    if target.endswith("experts_gate_up"):
        return 2 * cfg.moe.num_experts
    if target.endswith("experts_down"):
        return cfg.moe.num_experts
    sizes = _shard_sizes(target, cfg)
    return len(sizes) if len(sizes) > 1 else None


def copy_fp8(proj: LoraProjection, q: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int], target: str, shard: int | None, cfg: ModelConfig) -> None:
    """One checkpoint part (q [rows, K] float8, its scale grid over (so, si) blocks) into an
    FP8 projection, re-spreading the scales when the projection uses per-row blocks."""
    start, rows = _part_rows(proj, target, shard, cfg)
    if q.shape != (rows, proj.weight.shape[1]):
        raise ConfigError(f"weight {target} has shape {tuple(q.shape)}, expected "
                          f"{(rows, proj.weight.shape[1])}: the checkpoint does not match its config.json")
    so, si = proj.scale_block
    if block[1] != si:
        raise ConfigError(f"{target}: its parts' scale blocks differ ({block[1]} vs {si} columns)")
    if block[0] != so:  # the fused projection's row blocks are single rows
        scale = scale.repeat_interleave(block[0], 0)[:rows]
    with torch.no_grad():
        proj.weight.narrow(0, start, rows).copy_(q)
        proj.weight_scale.narrow(0, start // so, scale.shape[0]).copy_(scale)


def build_computed(model: LlamaForCausalLM) -> None:
    """(Re)build the buffers computed rather than loaded: rotary tables (Gemma 3 has a second
    for its sliding layers) and FP8 projections' tile counters."""
    for module in model.modules():
        if isinstance(module, (RotaryEmbedding, LoraProjection)):
            module.build()


def _aux_tensors(model_dir: Path, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """Every tensor dequantization reads, by name: a shard may hold a weight, another its scales."""
    found = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            found.update({n: f.get_tensor(n) for n in f.keys() if scheme.is_aux(n)})
    return found


def param_name(hf: str) -> tuple[str | None, int | None]:
    """(our parameter, shard within it) for an HF weight name; (None, None) for buffers we
    compute. An expert's gate and up are shards 2e and 2e + 1 of the layer's stacked
    experts_gate_up, its down shard e of experts_down."""
    if hf.endswith("rotary_emb.inv_freq"):
        return None, None
    name = hf.removeprefix("model.")
    if (m := _EXPERT.match(name)) and m[3] in _EXPERT_PARTS:
        part = _EXPERT_PARTS[m[3]]
        if part is None:
            return f"{m[1]}.mlp.experts_down", int(m[2])
        return f"{m[1]}.mlp.experts_gate_up", 2 * int(m[2]) + part
    if (m := _LAYER.match(name)) and m[2] in _MOE_NAMES:
        target, shard = _MOE_NAMES[m[2]]
        return f"{m[1]}.{target}", shard
    for suffix, (fused, shard) in _FUSED.items():
        if f".{suffix}." in f".{name}":
            return name.replace(suffix, fused), shard
    return name, None


def copy_weight(param: torch.Tensor, tensor: torch.Tensor, target: str, shard: int | None,
                cfg: ModelConfig) -> None:
    if shard is not None:
        param = _part(param, target, shard, cfg)
    if param.shape != tensor.shape:
        raise ConfigError(
            f"weight {target} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}: "
            "the checkpoint does not match its config.json"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _part(param: torch.Tensor, target: str, shard: int, cfg: ModelConfig) -> torch.Tensor:
    """The view of param that checkpoint part `shard` fills."""
    if not 0 <= shard < (_num_shards(target, cfg) or 0):
        raise ConfigError(f"weight {target} has no part {shard}: the checkpoint has more "
                          "experts than its config.json")
    if target.endswith("experts_gate_up"):  # [E, 2I, H] as 2E parts of [I, H]
        return param.unflatten(1, (2, -1)).flatten(0, 1)[shard]
    if target.endswith("experts_down"):
        return param[shard]
    sizes = _shard_sizes(target, cfg)
    return param.narrow(0, sum(sizes[:shard]), sizes[shard])


def _check_complete(params, loaded, cfg: ModelConfig) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        shards = _num_shards(name, cfg)
        keys = [f"{name}#{i}" for i in range(shards)] if shards else [f"{name}#None"]
        if not all(k in loaded for k in keys) and f"{name}#None" not in loaded:  # or fused (Phi-3)
            missing.append(name)
    if missing:
        raise ConfigError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
