"""Trainer push: a trainer process publishes a new version of its LoRA from its GPU memory
(AdapterPublisher) and the serving side lands it, N times in a row.

    PYTHONPATH=. python3 bench/push.py                      # Llama-3-8B r16 shape, cuda
    PYTHONPATH=. python3 bench/push.py --model tiny --device cpu

Two processes on one device: the trainer (a subprocess holding the weights and the
publisher) and the engine side (this process: an adapter pool, its NIXL endpoint warmed
as an engine does at start). One push starts in the trainer once its optimizer step is
done (the clock is CLOCK_MONOTONIC, one clock for both processes) and ends when the
engine's slot holds that version: the trainer's publish (its tensors into its own slot,
checked) + the message to the engine side (a pipe here) + the engine's landing from the
trainer (lease, manifest, plan reused, READ, checks, tables). Not included: the HTTP
admin call a server gets (`/v1/load_lora_adapter`) and the next step that schedules a
request on the slot. Recorded in swap -> <model>-peer-1gpu (one GPU) as push_ms.
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

from bench.common import gpu_tag, median, merge_results, results_path, table
from bench.peer_nvlink import promote_from_peer, write_model_and_adapter
from metrale.config import ModelConfig, PoolConfig
from metrale.peer.landing import warm_up_nixl
from metrale.pool.swap import LoraSlots

TRAINER = r"""
import json, sys, time, torch
from safetensors.torch import load_file
from metrale.peer.publisher import AdapterPublisher
adapter, model_dir, device = sys.argv[1:4]
tensors = {k: v.to(device) for k, v in load_file(f"{adapter}/adapter_model.safetensors").items()}
config = json.load(open(f"{adapter}/adapter_config.json"))
dtype = next(iter(tensors.values())).dtype
pub = AdapterPublisher(model_dir, config, device=device, dtype=dtype)
print("ready", pub.address, flush=True)
for line in sys.stdin:
    for t in tensors.values():  # an optimizer step, as far as serving can tell
        t.add_(1e-3)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.clock_gettime(time.CLOCK_MONOTONIC)  # the push starts: the step is done
    source = pub.publish(tensors)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    end = time.clock_gettime(time.CLOCK_MONOTONIC)
    print(source, (end - start) * 1e3, start, flush=True)
pub.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pushes", type=int, default=30)
    ap.add_argument("--transport", default="auto", choices=["auto", "nixl", "http"])
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    gpu = args.device == "cuda"
    root = Path(tempfile.mkdtemp(prefix="metrale-push-"))
    model_dir, adapter = write_model_and_adapter(root, args.model)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(adapter), str(model_dir),
                                "cuda:0" if gpu else "cpu"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = trainer.stdout.readline().split()
        if first[:1] != ["ready"]:
            raise RuntimeError(f"the trainer did not start: {first}")
        addr = first[1]
        slots = LoraSlots(ModelConfig.from_dir(model_dir), PoolConfig(4, 16), "cuda:0" if gpu else "cpu",
                          torch.bfloat16 if gpu else torch.float32)
        if gpu:
            warm_up_nixl(slots)
        totals, publishes, stats_seen = [], [], []
        for _ in range(args.pushes):
            trainer.stdin.write("push\n")
            trainer.stdin.flush()
            source, publish_ms, start = trainer.stdout.readline().split()
            stats: dict = {}
            promote_from_peer(slots, addr, source.rsplit("/", 1)[1], "policy",
                              transport=args.transport, stats=stats)
            if gpu:
                torch.cuda.synchronize()
            # CLOCK_MONOTONIC is one clock for both processes
            totals.append((time.clock_gettime(time.CLOCK_MONOTONIC) - float(start)) * 1e3)
            publishes.append(float(publish_ms))
            stats_seen.append(stats)
    finally:
        trainer.kill()
    warm = slice(2, None)
    result = {"push_ms": median(totals[warm]), "push_first_ms": totals[0],
              "push_publish_ms": median(publishes[warm]), "push_pushes": args.pushes,
              "push_transport": stats_seen[-1].get("transport"),
              "push_ucx_transport": stats_seen[-1].get("ucx_transport"),
              "push_plan_cached": all(s.get("plan_cached") for s in stats_seen[1:]),
              "push_command": f"PYTHONPATH=. python3 bench/push.py --model {args.model} "
                              f"--device {args.device}", "push_date": time.strftime("%Y-%m-%d")}
    print(table([{"figure": k, "value": v} for k, v in result.items()], ["figure", "value"]))
    print(json.dumps({"totals_ms": [round(t, 3) for t in totals]}))
    gpus = torch.cuda.device_count() if gpu else 0
    key = f"{args.model}-peer" if gpus != 1 else f"{args.model}-peer-1gpu"
    path = results_path(args.device)
    merged = json.loads(path.read_text()).get("swap", {}).get(key, {}) if path.exists() else {}
    merge_results(path, "swap", key, {**merged, **result})
    print("gpu:", gpu_tag(args.device) if gpu else "cpu")


if __name__ == "__main__":
    main()
