"""Where a decode step's GPU time goes: the kernels of one replayed CUDA graph, grouped
by name (µs per step), and each projection's GEMM alone against its byte floor (the HBM
copy bandwidth measured in the same run). --lora1 also profiles the step of a batch that
uses one adapter (random r=16 all-linear): what a single adapter's fixed cost is made of.
Kernel times are summed per name, so where the LoRA side stream overlaps the base GEMM they
add up past the replay's wall time (and a kernel slowed by the overlap shows its slow time).

    PYTHONPATH=. python bench/graph_profile.py --model llama3-8b --batch 32 64 [--lora1]

JSON `graph_profile[<model>][batch<B>]`: kernel_us_per_step, kernels, gemms (base graph);
with --lora1 also lora1_kernel_us_per_step, lora1_kernels, lora1_graph (its key).
"""
from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.common import (
    build_pair,
    copy_bandwidth,
    merge_results,
    results_path,
    table,
    write_random_adapters,
)
from bench.decode import decode_run, make_engine

REPS = 20


def _gemm_us(m: int, n: int, k: int, reps: int = 200) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        F.linear(x, w)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def gemm_table(cfg, batch: int, bw: float) -> list[dict]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
              "lm_head": (cfg.vocab_size, h)}
    rows = []
    for name, (n, k) in shapes.items():
        us = _gemm_us(batch, n, k)
        floor = (n * k + batch * (n + k)) * 2 / bw * 1e6
        rows.append({"gemm": name, "batch": batch, "n": n, "k": k, "us": us,
                     "floor_us": floor, "over_floor": us / floor})
    return rows


def graph_kernels(engine) -> list[dict]:
    """Kernels of the latest decode step's graph, µs per replay, largest first (its static
    inputs hold that step's batch)."""
    graph, _ = engine.runner.graphs.graphs[engine.runner.graphs.last_key]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name][0] += evt.device_time
            per[evt.name][1] += 1
    rows = [{"kernel": name[:80], "us_per_step": t / REPS, "calls_per_step": n / REPS}
            for name, (t, n) in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--lora1", action="store_true", help="also the graph of a one-adapter batch")
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair(args.model, "cuda", Path(tmp))
        engine = make_engine(pair, "cuda", 1 if args.lora1 else 0, max(args.batch))
        if args.lora1:
            write_random_adapters(pair, 1, Path(tmp) / "adapters")
            engine.swap_lora_slot_from_disk(Path(tmp) / "adapters" / "a0", "a0", 0)
        bw = copy_bandwidth("cuda")
        out["copy_bw_GBs"] = bw / 1e9
        for b in args.batch:
            row: dict = {}
            modes = [("", None)] + ([("lora1_", "a0")] if args.lora1 else [])
            for key, name in modes:
                decode_run(engine, [name] * b, "cuda", gen=8)  # fills the graph's static inputs
                kernels = graph_kernels(engine)
                total = sum(r["us_per_step"] for r in kernels)
                print(f"\n{args.model} batch {b} {key or 'base_'}graph "
                      f"{engine.runner.graphs.last_key}: {total:.0f} us of kernels per step")
                print(table(kernels[:25], ["kernel", "us_per_step", "calls_per_step"]))
                row.update({f"{key}kernel_us_per_step": total, f"{key}kernels": kernels})
                if key:
                    row[f"{key}graph"] = str(engine.runner.graphs.last_key)
            row["gemms"] = gemm_table(pair.config, b, bw)
            print(table(row["gemms"], ["gemm", "batch", "n", "k", "us", "floor_us", "over_floor"]))
            out[f"batch{b}"] = row
    merge_results(results_path("cuda"), "graph_profile", args.model, out)


if __name__ == "__main__":
    main()
