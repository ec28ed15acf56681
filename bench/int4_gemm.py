"""The 4-bit weight-only GEMM (metrale.ops.int4_linear) at Llama-3-8B and 70B projection
shapes against its byte floor, bf16 cuBLAS and torch's built-in W4A16 GEMM (tinygemm,
torch._weight_int4pack_mm, group 128), and a sweep of tile configs per shape: what
choose_config should pick.

    PYTHONPATH=. python bench/int4_gemm.py [--m 1 8 32 64] [--formats awq nf4] [--sweep]

JSON `int4_gemm[<format> <model> <proj> m<M>]`: bf16_us (F.linear on a bf16 weight),
int4_us (the chosen config), tinygemm_us (AWQ rows, where torch has the op), floor_us
(packed codes + scales + zero points + activations at the copy bandwidth of the same run),
int4_over_floor, bf16_over_int4, config; with --sweep best_us / best_config over SWEEP.
Times: common.graph_us (a CUDA graph of 20 calls under triton's do_bench, median), per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F

from bench.common import INT4, copy_bandwidth, graph_us, merge_results, results_path, sweep_configs, table
from bench.fp8_gemm import SHAPES
from metrale.ops import int4_linear as f
from metrale.ops.split_k import tile_counters

SWEEP = [dict(block_n=bn, split_k=s, num_warps=w, num_stages=st)
         for bn, s, w, st in itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (4,), (2, 3))]


def _weights(fmt: str, n: int, k: int):
    layout = INT4[fmt]
    groups = -(-k // layout.group)
    packed = torch.randint(-2**31, 2**31 - 1, (n, f.padded_k(k) // 8), dtype=torch.int32,
                           device="cuda")
    scale = torch.full((n, groups), 0.005, dtype=layout.scale_dtype, device="cuda")
    zero = torch.full((n, groups), 8, dtype=torch.uint8, device="cuda") if layout.zero else None
    book = torch.linspace(-1, 1, 16, device="cuda") if layout.codebook else None
    return packed, scale, zero, book, layout.group


def _tinygemm(w: torch.Tensor):
    """torch's int4 GEMM on w's rounding, or None where this torch has no such op."""
    try:
        scale = (w.float().abs().reshape(w.shape[0], -1, 128).amax(-1) / 7).clamp(min=1e-6)
        q = (w.float().reshape(w.shape[0], -1, 128) / scale[..., None] + 8).round().clamp(0, 15)
        q = q.reshape(w.shape).to(torch.int32)
        try:  # torch >= 2.5 takes two codes a byte
            packed = torch.ops.aten._convert_weight_to_int4pack(
                ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        except RuntimeError:
            packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
        sz = torch.stack((scale, torch.zeros_like(scale)), -1).transpose(0, 1).contiguous()
        sz = sz.to(torch.bfloat16)
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, 128, sz)
    except (RuntimeError, AttributeError) as e:
        print("tinygemm not available:", str(e).splitlines()[0])
        return None


def run(ms: list[int], formats: list[str], sweep: bool, models: list[str]) -> dict:
    bw = copy_bandwidth("cuda")
    out = {}
    for model in models:
        for proj, (n, k) in SHAPES[model].items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            tiny = _tinygemm(w) if "awq" in formats else None
            for fmt in formats:
                packed, scale, zero, book, group = _weights(fmt, n, k)
                counters = tile_counters(n, w.device)
                meta = scale.numel() * scale.element_size() + (zero.numel() if zero is not None else 0)
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    floor = (packed.numel() * 4 + meta + m * k * 2 + m * n * 2) / bw * 1e6
                    cfg = f.chosen_config(m, packed, counters)
                    gemm = functools.partial(f.int4_linear, x, packed, scale, zero, book, group,
                                             None, counters)
                    row = {"bf16_us": graph_us(functools.partial(F.linear, x, w)),
                           "int4_us": graph_us(gemm), "floor_us": floor,
                           "config": str(dataclasses.astuple(cfg))}
                    if tiny is not None and fmt == "awq":
                        row["tinygemm_us"] = graph_us(functools.partial(tiny, x))
                    if sweep and m <= f.SPLIT_MAX_M:
                        configs = [f.GemmConfig(block_m=max(16, f.next_pow2(m)), block_k=f.CHUNK,
                                                swap=True, **c) for c in SWEEP]
                        row.update(sweep_configs(gemm, [
                            c for c in configs if c.split_k <= packed.shape[1] // f.WORDS
                            and -(-m // c.block_m) * -(-n // c.block_n) <= counters.numel()]))
                        row["best_over_floor"] = row["best_us"] / floor
                    row["int4_over_floor"] = row["int4_us"] / floor
                    row["bf16_over_int4"] = row["bf16_us"] / row["int4_us"]
                    out[f"{fmt} {model} {proj} m{m}"] = row
                    print(fmt, model, proj, m, {k: (round(v, 2) if isinstance(v, float) else v)
                                                for k, v in row.items()}, flush=True)
    out["copy_bw_GBs"] = bw / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--formats", nargs="+", default=["awq", "nf4"], choices=list(INT4))
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's configs per shape")
    args = ap.parse_args()
    res = run(args.m, args.formats, args.sweep, args.models)
    for key, row in res.items():
        if isinstance(row, dict):
            merge_results(results_path("cuda"), "int4_gemm", key, row)
    rows = [{"shape": k, **v} for k, v in res.items() if isinstance(v, dict)]
    print(table(rows, ["shape", "bf16_us", "int4_us", "tinygemm_us", "floor_us",
                       "int4_over_floor", "bf16_over_int4", "best_us", "best_over_floor",
                       "config", "best_config"]))


if __name__ == "__main__":
    main()
