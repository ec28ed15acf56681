"""Shared benchmark helpers: random-weight models built on the device (no checkpoint),
the matching transformers model from the same state dict, PEFT adapters, device
ceilings and the results file.

    build_pair("llama3-8b", "cuda")  -> Pair(model_dir, ours, hf)

The HF model is initialised randomly (transformers' own init, std 0.02) on the device,
and our model is filled from its state dict through the same fusing the checkpoint
loader does, so the two compute the same function.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.config import ModelConfig
from metrale.model.llama import LlamaForCausalLM
from metrale.model.loader import copy_weight, param_name

CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    # CPU smoke runs of the benchmark code itself
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 tie_word_embeddings=False),
}
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")


@dataclass
class Pair:
    name: str
    model_dir: Path
    config: ModelConfig
    ours: LlamaForCausalLM
    hf: object  # transformers LlamaForCausalLM


def build_pair(name: str, device: str, workdir: Path, dtype=None,
               max_positions: int = 16384) -> Pair:
    import transformers

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    hf_cfg = transformers.LlamaConfig(**CONFIGS[name])
    model_dir = workdir / name
    hf_cfg.save_pretrained(model_dir)  # config.json: what the engine reads
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        ours = LlamaForCausalLM(cfg, max_positions)
    ours = ours.to_empty(device=device)
    params = dict(ours.named_parameters())
    for key, tensor in hf.state_dict().items():
        target, shard = param_name(key)
        if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        copy_weight(params[target], tensor, target, shard, cfg)
    ours.to(dtype).eval()
    ours.rotary.build()  # float32 tables
    return Pair(name, model_dir, cfg, ours, hf)


def make_peft(pair: Pair, n: int, out_dir: Path, dtype=None):
    """Wrap pair.hf with n random r=16 all-linear adapters a0..a{n-1} (in pool dtype, so
    PEFT's baseline does its LoRA math in bf16 too) and save them: out_dir/a{i}/.
    Also saves a0 as PEFT writes it by default (fp32) to out_dir/fp32/a0."""
    from peft import LoraConfig, get_peft_model

    dtype = dtype or next(pair.ours.parameters()).dtype
    cfg = LoraConfig(init_lora_weights=False, **LORA)
    torch.manual_seed(1)
    peft = get_peft_model(pair.hf, cfg, adapter_name="a0")
    for i in range(1, n):
        peft.add_adapter(f"a{i}", cfg)
    peft.save_pretrained(out_dir / "fp32", selected_adapters=["a0"])
    with torch.no_grad():
        for pname, p in peft.named_parameters():
            if "lora_" in pname:
                p.data = p.data.to(dtype)
    peft.save_pretrained(out_dir, selected_adapters=[f"a{i}" for i in range(n)])
    peft.eval()
    return peft


def adapter_dir(out_dir: Path, i: int) -> Path:
    """Where PEFT saved adapter a{i} (its non-default adapters go into subfolders)."""
    return out_dir / f"a{i}"


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int = 5, warmup: int = 1) -> list[float]:
    """Wall-clock ms of fn() with the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def pct(xs, p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return float(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))])


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    ms = median(timed(lambda: b.copy_(a), device, reps=10, warmup=2))
    return nbytes / (ms / 1e3)


def h2d_ms(nbytes: int, device: str) -> float:
    """Pinned host -> device copy of nbytes (median ms)."""
    if not device.startswith("cuda"):
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return median(timed(lambda: dev.copy_(host, non_blocking=True), device, reps=10, warmup=2))


def gpu_tag(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "_").lower()


def results_path(device: str, root: Path | None = None) -> Path:
    root = root or Path(__file__).resolve().parent / "results"
    return root / f"{datetime.date.today():%Y%m%d}-{gpu_tag(device)}.json"


def merge_results(path: Path, section: str, key: str, value: dict) -> None:
    """results[section][key] = value, merged into the file's other keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(section, {})[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
