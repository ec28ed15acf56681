"""DoRA and embed_tokens / lm_head variants of bench adapters, for the mixed-kind decode
benchmark (bench/decode.py --mixed): throughput only, so their weights need only be
plausible, not trained.

A DoRA variant is a plain adapter plus, per module, a magnitude near the row norms of
W + sBA (gains near 1, as after training); an embedding variant adds random
lora_embedding_A/B and an lm_head LoRA at the adapter's rank."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from metrale.config import LINEAR_MODULES, ModelConfig

_B_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_B\.weight$")


def _config(src: Path) -> dict:
    return json.loads((src / "adapter_config.json").read_text())


def _save(dst: Path, cfg: dict, tensors: dict) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "adapter_model.safetensors")
    return dst


def dora_variant(src: Path, dst: Path, base_weights, seed: int = 0) -> Path:
    """src's adapter with use_dora and m = ||W|| * (1 + 0.05 N(0, 1)) per output row.
    base_weights: LlamaForCausalLM.lora_base_weights() (W per (layer, module))."""
    cfg, tensors = _config(src), load_file(src / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if _B_KEY.match(k)]:
        layer, module = _B_KEY.match(key).groups()
        norm = base_weights[(int(layer), module)].float().norm(dim=1).cpu()  # [out]
        m = norm * (1 + 0.05 * torch.randn(norm.shape, generator=g))
        tensors[key.replace("lora_B.weight", "lora_magnitude_vector")] = m.to(tensors[key].dtype)
    return _save(dst, {**cfg, "use_dora": True}, tensors)


def embedding_variant(src: Path, dst: Path, model: ModelConfig, seed: int = 0) -> Path:
    """src's adapter plus LoRA on embed_tokens and lm_head at its rank."""
    cfg, tensors = _config(src), load_file(src / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    dtype = next(iter(tensors.values())).dtype
    r, v, h = int(cfg["r"]), model.vocab_size, model.hidden_size
    emb, head = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
    tensors[f"{emb}.lora_embedding_A"] = (torch.randn(r, v, generator=g) * 0.01).to(dtype)
    tensors[f"{emb}.lora_embedding_B"] = (torch.randn(h, r, generator=g) * 0.01).to(dtype)
    tensors[f"{head}.lora_A.weight"] = (torch.randn(r, h, generator=g) / h**0.5).to(dtype)
    tensors[f"{head}.lora_B.weight"] = (torch.randn(v, r, generator=g) * 0.01).to(dtype)
    targets = list(LINEAR_MODULES) + ["embed_tokens", "lm_head"]
    return _save(dst, {**cfg, "target_modules": targets}, tensors)
