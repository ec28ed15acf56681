"""The FP8 weight-only GEMM (metrale.ops.fp8_linear) at Llama-3-8B, 70B and 3.2-1B
projection shapes against its byte floor and bf16 cuBLAS, and a sweep of tile configs per
shape: what choose_config should pick.

    PYTHONPATH=. python bench/fp8_gemm.py [--m 1 8 32 64 128] [--sweep]

JSON `fp8_gemm[<model> <proj> m<M>]`: bf16_us (F.linear on the bf16 weight), at decode
sizes (M <= SPLIT_MAX_M) bf16_split_us (the same Triton kernel on the bf16 weight with unit
scales: a split-K bf16 GEMM, chosen config; with --sweep bf16_split_best_us / _config),
bf16_split_over_bf16; bf16_floor_us (the bf16 GEMM's bytes at the copy bandwidth), fp8_us
(the weight-only GEMM, chosen config), fp8x_us (dynamic FP8 activations: the per-token
rounding launch and the FP8 x FP8 GEMM, chosen config), floor_us (FP8 weight + scales +
activations at the copy bandwidth of the same run), fp8_over_floor, bf16_over_fp8, config;
with --sweep best_us / best_config over SWEEP (decode sizes) or SWEEP_PREFILL (the Triton
tiles; fp8_us from DENSE_MIN_M on is the dequantize-then-cuBLAS path). Times:
common.graph_us, a CUDA graph of 20 calls replayed under triton's do_bench (median), per
call. (The session-16 figures in bench/results/20261202-h200.json took the median of 7
event-timed replays instead.)"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, graph_us, merge_results, results_path, sweep_configs, table
from metrale.ops import fp8_linear as f
from metrale.ops.split_k import tile_counters

SHAPES = {  # (N, K) of the fused projections the model runs
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                  "down": (4096, 14336)},
    "llama3-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
                   "down": (8192, 28672)},
    "llama3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                    "down": (2048, 8192)},
}
SWEEP = [dict(swap=sw, block_n=bn, block_k=bk, split_k=s, num_warps=4,
              num_stages=3 if bk == 256 else 4)  # decode sizes (M <= 64)
         for sw, bn, bk, s in itertools.product((False, True), (64, 128), (128, 256),
                                                (1, 2, 4, 8))]
SWEEP_PREFILL = [dict(swap=sw, block_n=128, block_k=bk, split_k=1, num_warps=8, num_stages=st)
                 for sw, bk, st in itertools.product((False, True), (64, 128), (3, 4))]


def run(ms: list[int], sweep: bool) -> dict:
    bw = copy_bandwidth("cuda")
    out = {}
    for model, shapes in SHAPES.items():
        for proj, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q, scale = f.quantize_rows(w)
            counters = tile_counters(n, w.device)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                io = m * k * 2 + m * n * 2  # bf16 activations in and out
                floor = (n * k + n * 4 + io) / bw * 1e6
                decode = m <= f.SPLIT_MAX_M
                cfg = f.chosen_config(m, q, scale, (1, k), counters)
                fp8 = functools.partial(f.fp8_linear, x, q, scale, (1, k), None, counters)
                fp8x = functools.partial(fp8, dynamic=True)
                # the same kernel on the bf16 weight itself (unit per-row scales: its code
                # conversion a no-op): a split-K bf16 GEMM, the candidate for skinny-M bf16
                # projections where cuBLAS leaves SMs idle (the 1B's decode steps)
                ones = torch.ones(n, 1, device="cuda")
                dense = functools.partial(f.fp8_linear, x, w, ones, (1, k), None, counters)
                row = {
                    "bf16_us": graph_us(functools.partial(F.linear, x, w)),
                    "fp8_us": graph_us(fp8), "fp8x_us": graph_us(fp8x), "floor_us": floor,
                    "bf16_floor_us": (2 * n * k + io) / bw * 1e6,
                    "config": str(dataclasses.astuple(cfg)),
                    "fp8x_config": str(dataclasses.astuple(
                        f.chosen_config(m, q, scale, (1, k), counters, dynamic=True))),
                }
                if decode:  # past SPLIT_MAX_M the same call runs prefill tiles or cuBLAS
                    row["bf16_split_us"] = graph_us(dense)
                    row["bf16_split_over_bf16"] = row["bf16_split_us"] / row["bf16_us"]
                if sweep:
                    bm = max(16, 1 << (m - 1).bit_length()) if decode else min(m, 128)
                    configs = [f.GemmConfig(block_m=bm, **c)
                               for c in (SWEEP if decode else SWEEP_PREFILL)]
                    configs = [c for c in configs
                               if -(-m // c.block_m) * -(-n // c.block_n) <= counters.numel()]
                    row.update(sweep_configs(fp8, configs))
                    row["best_over_floor"] = row["best_us"] / floor
                    if decode:
                        best = sweep_configs(dense, configs)
                        row["bf16_split_best_us"] = best["best_us"]
                        row["bf16_split_best_config"] = best["best_config"]
                row["fp8_over_floor"] = row["fp8_us"] / floor
                row["fp8x_over_floor"] = row["fp8x_us"] / floor
                row["bf16_over_fp8"] = row["bf16_us"] / row["fp8_us"]
                out[f"{model} {proj} m{m}"] = row
                print(model, proj, m, {k: (round(v, 2) if isinstance(v, float) else v)
                                       for k, v in row.items()}, flush=True)
    out["copy_bw_GBs"] = bw / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 64, 128, 512])
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's configs per shape")
    args = ap.parse_args()
    res = run(args.m, args.sweep)
    for key, row in res.items():
        if isinstance(row, dict):
            merge_results(results_path("cuda"), "fp8_gemm", key, row)
    rows = [{"shape": k, **v} for k, v in res.items() if isinstance(v, dict)]
    print(table(rows, ["shape", "bf16_us", "fp8_us", "fp8x_us", "floor_us", "fp8_over_floor",
                       "fp8x_over_floor",
                       "bf16_over_fp8", "best_us", "best_over_floor", "config", "best_config"]))
    print(table(rows, ["shape", "bf16_us", "bf16_split_us", "bf16_split_best_us", "bf16_floor_us",
                       "bf16_split_over_bf16", "bf16_split_best_config"]))


if __name__ == "__main__":
    main()
