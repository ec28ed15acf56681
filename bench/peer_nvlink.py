"""Promote an adapter from a peer store on another GPU (NIXL VRAM -> VRAM over
NVLink), and time the raw peer copy of the same bytes in the same run.

    PYTHONPATH=. python3 bench/peer_nvlink.py            # 2 GPUs: store on cuda:0, engine on cuda:1
    PYTHONPATH=. python3 bench/peer_nvlink.py --model tiny --device cpu   # smoke run

The adapter is Llama-3-8B shaped, r=16, all seven linear modules, bf16, written in
PEFT's file format (adapter_config.json + adapter_model.safetensors) with random
values: this measures bytes moved, and landings are checked against PEFT elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import CONFIGS, gpu_tag, median, merge_results, results_path, table
from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.peer.landing import promote_from_peer
from metrale.pool.swap import LoraSlots

RANK = 16


def write_model_and_adapter(root: Path, name: str) -> tuple[Path, Path]:
    import transformers

    model_dir = root / "model"
    transformers.LlamaConfig(**CONFIGS[name]).save_pretrained(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in LINEAR_MODULES:
            d_in, d_out = cfg.linear_shape(module)
            key = f"base_model.model.{cfg.module_path(layer, module)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) / 64).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) / 64).bfloat16()
    adapter = root / "adapters" / "a0"
    adapter.mkdir(parents=True)
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(LINEAR_MODULES),
        "bias": "none", "use_rslora": False}))
    return model_dir, adapter


def start_store(root: Path, model_dir: Path, device: str, transport: str):
    cmd = [sys.executable, "-m", "metrale", "peer", "serve", "--adapters", str(root / "adapters"),
           "--model", str(model_dir), "--device", device, "--dtype", "bfloat16",
           "--max-lora-rank", str(RANK), "--port", "0", "--transport", transport]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0,1")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        print("store:", line.rstrip(), flush=True)
        if "metrale peer: serving" in line:
            return proc, line.rsplit(" on ", 1)[1].split()[0].removeprefix("http://")
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("peer store did not start")


def peer_copy_ms(nbytes: int, src_dev: str, dst_dev: str, reps: int = 20) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst_dev)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    store_dev, engine_dev = ("cuda", "cuda:1") if gpu else ("cpu", "cpu")
    root = Path(tempfile.mkdtemp(prefix="metrale-nvlink-"))
    model_dir, adapter = write_model_and_adapter(root, args.model)
    proc, addr = start_store(root, model_dir, store_dev, "auto")
    try:
        slots = LoraSlots(ModelConfig.from_dir(model_dir), PoolConfig(4, RANK), engine_dev,
                          torch.bfloat16)
        nbytes = slots.pool.layout.slot_bytes
        rows = []
        slot = None
        for transport in ("nixl", "http"):
            reps = args.reps if transport == "nixl" else 3
            times = []
            try:
                for i in range(reps + 2):
                    start = time.perf_counter()
                    slot, _ = promote_from_peer(slots, addr, "a0", f"{transport}{i}",
                                                transport=transport)
                    if gpu:
                        torch.cuda.synchronize(engine_dev)
                    times.append((time.perf_counter() - start) * 1e3)
                rows.append({"transport": transport, "promote_ms": median(times[2:])})
            except Exception as e:  # record what failed; the other transport still runs
                print(f"{transport}: FAILED {type(e).__name__}: {e}", flush=True)
                rows.append({"transport": transport, "promote_ms": float("nan"), "error": str(e)})
        # the peer-landed bytes equal a disk landing of the same files
        slots.swap_lora_slot_from_disk(adapter, "disk", 3)
        cfg = slots.model_config
        same = slot is not None and all(
            torch.equal(slots.pool.lora_bt(layer, m)[3], slots.pool.lora_bt(layer, m)[slot])
            and torch.equal(slots.pool.lora_a(layer, m)[3], slots.pool.lora_a(layer, m)[slot])
            for layer in (0, cfg.num_layers - 1) for m in LINEAR_MODULES)
        floor = peer_copy_ms(nbytes, "cuda:0", engine_dev) if gpu else float("nan")
    finally:
        proc.kill()
    result = {"adapter_bytes": nbytes, "peer_nvlink_ms": rows[0]["promote_ms"],
              "peer_http_ms": rows[1]["promote_ms"], "peer_floor_ms": floor,
              "landed_bytes_equal_disk": same,
              "errors": {r["transport"]: r["error"] for r in rows if "error" in r},
              "date": time.strftime("%Y-%m-%d"),
              "command": "PYTHONPATH=. python3 bench/peer_nvlink.py"}
    print(table([{"figure": k, "value": v} for k, v in result.items()], ["figure", "value"]))
    merge_results(results_path(args.device), "swap", f"{args.model}-peer", result)
    print("gpu:", gpu_tag(args.device) if gpu else "cpu")


if __name__ == "__main__":
    main()
