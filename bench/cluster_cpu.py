"""A real run of the cluster on this host's CPU: 2 replicas of the default model
(SmolLM2-135M-Instruct) on a local Ray, a small mixed load of a few adapters
(Zipf 1.1, more adapters than the cluster has slots), once with metrale's
AdapterAffinityRouter and once with Ray Serve's own multiplexed routing.

    python bench/cluster_cpu.py                    # about 3-5 minutes on 2 cores

Hit rate = adapter requests whose adapter was READY on the replica they reached
(each replica counts at arrival); TTFT = request sent to first streamed token, at
the client. Random-weight rank-8 LoRA adapters (PEFT files, made once, cached):
this measures routing and landings, not answers.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def make_adapters(model_dir: Path, n: int, root: Path) -> list[str]:
    names = [f"z{i}" for i in range(n)]
    if all((root / name / "adapter_config.json").exists() for name in names):
        return names
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, name in enumerate(names):
        torch.manual_seed(100 + i)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"]))
        model.save_pretrained(root / name)
        base = model.unload()
    return names


def one_run(routing: str, model_dir: Path, adapters_root: Path, names: list[str], args) -> dict:
    import httpx
    import ray
    from ray import serve

    from metrale.cluster.config import ClusterConfig, ReplicaSpec
    from metrale.cluster.launch import deploy, shutdown

    port = args.port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(model=str(model_dir), registry_name=f"bench-registry-{routing}",
                       registry_namespace="metrale-bench", internal_key="bench",
                       max_loras=args.slots, max_lora_rank=8, max_model_len=512,
                       peer_transport="http", stage_from_peers=routing == "metrale")
    deploy(spec, ClusterConfig(replicas=2, routing=routing, stats_period_s=0.5),
           {"model_id": model_dir.name, "adapter_roots": (adapters_root,)})
    url = f"http://127.0.0.1:{port}"
    for name in names:
        r = httpx.post(f"{url}/v1/adapters", json={"name": name, "path": name}, timeout=600)
        assert r.status_code == 201, r.text
    rng = random.Random(args.seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(names))]
    cdf = [sum(weights[:k + 1]) / sum(weights) for k in range(len(names))]
    jobs = [names[bisect.bisect_left(cdf, rng.random())] for _ in range(args.requests)]
    ttfts: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def worker(mine: list[str]) -> None:
        for adapter in mine:
            start = time.perf_counter()
            with httpx.stream("POST", f"{url}/v1/completions", timeout=600, json={
                    "model": adapter, "prompt": "Tell me about the moon.", "stream": True,
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}) as r:
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: ") and '"text"' in line:
                        first = time.perf_counter() - start
                with lock:
                    if r.status_code != 200 or first is None:
                        failures.append(f"{r.status_code}: {r.read()[:300]!r}")
                    else:
                        ttfts.append(first)

    threads = [threading.Thread(target=worker, args=(jobs[i::args.clients],))
               for i in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stats = httpx.get(f"{url}/v1/cluster", timeout=60).json()
    reps = stats["replicas"].values()
    asked = sum(r["adapter_requests"] or 0 for r in reps)
    hits = sum(r["adapter_hits"] or 0 for r in reps)
    peer = sum(1 for r in reps for x in r["staging"] if x["source"] == "peer")
    shutdown(spec)
    serve.shutdown()
    ttfts.sort()
    return {"routing": routing, "requests": len(jobs), "hit_rate": hits / max(1, asked),
            "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3,
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
            "peer_landings": peer, "served": stats["served"], "wall_s": wall,
            "failures": len(failures), "first_failure": failures[0] if failures else None,
            "req_s": len(jobs) / wall, "ray": ray.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=6)
    p.add_argument("--slots", type=int, default=2, help="adapter slots per replica")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import ray

    from metrale.model.default_model import cache_root, default_model_dir

    model_dir = default_model_dir()
    adapters_root = cache_root() / "bench-cluster-adapters"
    names = make_adapters(model_dir, args.adapters, adapters_root)
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, namespace="metrale-bench", _temp_dir=ray_dir,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, log_to_driver=False)
    rows = []
    try:
        for routing in ("ray_default", "metrale"):
            rows.append(one_run(routing, model_dir, adapters_root, names, args))
            r = rows[-1]
            print(f"{routing:12s} hit {r['hit_rate']:.3f}  ttft p50 {r['ttft_p50_ms']:.0f} ms  "
                  f"p99 {r['ttft_p99_ms']:.0f} ms  peer landings {r['peer_landings']}  "
                  f"{r['req_s']:.2f} req/s  failures {r['failures']} {r['first_failure'] or ''}",
                  flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    out = args.out or RESULTS / f"{datetime.date.today():%Y%m%d}-cpu-cluster.json"
    out.write_text(json.dumps({
        "date": f"{datetime.date.today()}", "machine": f"{platform.machine()}, 2 cores (shared)",
        "command": "python " + " ".join(sys.argv), "model": model_dir.name,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
