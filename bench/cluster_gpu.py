"""Replica-to-replica staging on 2 GPUs: promote time from the neighbour vs from disk.

    PYTHONPATH=. python3 bench/cluster_gpu.py                       # 2 GPUs, llama3.2-1b shapes
    PYTHONPATH=. python3 bench/cluster_gpu.py --model llama3-8b     # 8B shapes (writes 16 GB)
    PYTHONPATH=. python3 bench/cluster_gpu.py --device cpu --model tiny --adapters 3   # smoke

A local Ray with 2 engine replicas (one GPU each, Ray sets CUDA_VISIBLE_DEVICES) of a
random-weight checkpoint, r=16 all-linear bf16 adapters. For each adapter: replica A
lands it from disk (its stage call finds no neighbour holding it), then replica B
lands it from A's READY slot (NIXL VRAM -> VRAM when both ends have NIXL and UCX can
reach the other GPU, else the HTTP stream). Timed at the client around each replica's
/internal/stage call (the same HTTP overhead on both sides); B's staging record must
name A's exporter as its source, or the row says what happened instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def write_checkpoint(name: str, device: str, root: Path, n: int) -> tuple[Path, Path]:
    import torch

    from bench.common import build_pair, make_peft

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pair = build_pair(name, device, root, dtype=dtype)
    pair.hf.save_pretrained(pair.model_dir)  # safetensors: what each replica loads
    adapters = root / "adapters"
    make_peft(pair, n, adapters, dtype=dtype)
    del pair
    return root / name, adapters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "http"])
    p.add_argument("--port", type=int, default=18432)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import httpx
    import ray
    from ray import serve

    from metrale.cluster.config import ClusterConfig, ReplicaSpec
    from metrale.cluster.launch import deploy, register_startup, shutdown

    root = Path(tempfile.mkdtemp(prefix="metrale-cluster-gpu-"))
    model_dir, adapters = write_checkpoint(args.model, args.device, root, args.adapters)
    names = [f"a{i}" for i in range(args.adapters)]
    gpu = args.device == "cuda"
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=8 if gpu else 2, num_gpus=2 if gpu else 0, include_dashboard=False,
             namespace="metrale-bench", _temp_dir=ray_dir)
    rows, errors = [], []
    spec = ReplicaSpec(model=str(model_dir), registry_name="bench-gpu-registry",
                       registry_namespace="metrale-bench", internal_key="bench",
                       device=args.device, max_loras=args.adapters + 1, max_lora_rank=16,
                       max_model_len=1024, num_kv_blocks=256, peer_transport=args.transport)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        deploy(spec, ClusterConfig(replicas=2, stats_period_s=0.5), {"model_id": model_dir.name},
               {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 1})
        register_startup(spec, {n: (str(adapters / n), False) for n in names})
        url = f"http://127.0.0.1:{args.port}"
        auth = {"Authorization": "Bearer bench"}
        http = httpx.Client(timeout=600, headers=auth)

        def replicas() -> dict:
            return http.get(f"{url}/v1/cluster").json()["replicas"]

        (a_id, a), (b_id, b) = sorted(replicas().items())
        for name in names:
            start = time.perf_counter()
            first = http.post(f"{a['url']}/internal/stage/{name}").json()
            disk_ms = (time.perf_counter() - start) * 1e3
            deadline = time.monotonic() + 60
            while name not in replicas()[a_id]["resident"]:  # the registry must see it first
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} never showed as resident on {a_id}")
                time.sleep(0.05)
            start = time.perf_counter()
            second = http.post(f"{b['url']}/internal/stage/{name}").json()
            neighbour_ms = (time.perf_counter() - start) * 1e3
            record = [x for x in replicas()[b_id]["staging"] if x["adapter"] == name][-1]
            row = {"adapter": name, "disk_ms": disk_ms, "neighbour_ms": neighbour_ms,
                   "first_source": first["source"], "second_source": second["source"],
                   "record_ms": record["seconds"] * 1e3, "record_error": record["error"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
        metrics_b = http.get(f"{b['url']}/metrics").text
        peer_lines = [x for x in metrics_b.splitlines()
                      if x.startswith("metrale_adapter_landings_total")]
    except Exception as e:  # keep what was measured
        errors.append(f"{type(e).__name__}: {e}")
        peer_lines = []
        print("FAILED:", errors[-1], flush=True)
    finally:
        try:
            shutdown(spec)
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(ray_dir, ignore_errors=True)
    warm = rows[1:] or rows  # the first pair pays one-time costs (NIXL registration, plans)
    summary = {
        "disk_ms_median": statistics.median(r["disk_ms"] for r in warm) if warm else None,
        "neighbour_ms_median": statistics.median(r["neighbour_ms"] for r in warm) if warm else None,
        "all_from_neighbour": bool(rows) and all(r["second_source"] == "peer" for r in rows),
    }
    print(json.dumps(summary))
    out = args.out or RESULTS / f"{datetime.date.today():%Y%m%d}-cluster-{args.device}.json"
    out.write_text(json.dumps({
        "date": f"{datetime.date.today()}", "command": "python " + " ".join(sys.argv),
        "model": args.model, "transport": args.transport, "summary": summary, "rows": rows,
        "landings_on_b": peer_lines, "errors": errors}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
