"""The routed experts of one MoE layer (metrale.ops.moe_triton) at the Qwen3-30B-A3B shape
against their byte floor: random top-k routing of T tokens, the grouped GEMM of each
projection alone (a config sweep with --sweep), and the whole routed MLP as the model runs
it (routing into blocks, gate_up GEMM, SiLU-mul, down GEMM, the weighted sum); and the
expert LoRA (r=16) of each projection with 1 adapter or one per token.

    PYTHONPATH=. python bench/moe_gemm.py [--tokens 1 32 256] [--sweep] [--sweep-lora]

JSON `moe_gemm[qwen3-30b-a3b <proj|mlp> t<T>]`: us (CUDA graph of the op, median per call),
floor_us (the weights of the experts the routing hits, plus activations, at the copy
bandwidth of the same run), over_floor = floor_us / us (the share of the copy speed
reached), experts_hit, config; with --sweep best_us / best_config. `moe_gemm[qwen3-30b-a3b
lora_<proj> t<T> a<adapters>]`: what the expert LoRA adds to its projection (us: the shrink
launch plus the GEMM with the LoRA epilogue, with_gemm_us, less the GEMM alone, gemm_us),
its floor the A and B slices of the (adapter, expert) pairs routed plus the activations
the shrink reads and writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch

from bench.common import CONFIGS, copy_bandwidth, graph_us, merge_results, results_path, sweep_configs, table
from metrale.ops import fused_triton as fused
from metrale.ops import moe_triton as mt

SWEEP = [mt.MoeGemmConfig(bn, bk, w, st) for bn, bk, w, st in
         itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))]
LORA_SWEEP = [mt.ExpertLoraConfig(sk, 0, sw) for sk, sw in itertools.product((1, 2, 4, 8), (4, 8))]
RANK, SLOTS = 16, 33


def routed_mlp(x, weights, experts, gate_up_w, down_w, counts):
    """MoeMLP._routed_fused without adapters."""
    T, k = experts.shape
    blocks = mt.route_blocks(experts, gate_up_w.shape[0], counts)
    h = fused.silu_mul(mt.grouped_gemm(x, gate_up_w, blocks, rows_div=k))
    y = mt.grouped_gemm(h, down_w, blocks, rows_div=1)
    return (y.view(T, k, -1) * weights.unsqueeze(-1)).sum(1)


def _expert_lora(E: int, n_in: int, n_out: int) -> mt.ExpertLora:
    """SLOTS slots of rank-RANK expert factors in the pool's stacked layout."""
    a = torch.randn(SLOTS, RANK * E, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
    bt = torch.randn(SLOTS, RANK * E, n_out, device="cuda", dtype=torch.bfloat16) * 0.02
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
    scales = torch.full((SLOTS,), 2.0, device="cuda")
    return mt.ExpertLora(a, bt, ranks, scales, E, RANK)


def run(tokens: list[int], sweep: bool, sweep_lora: bool, model: str = "qwen3-30b-a3b") -> dict:
    c = CONFIGS[model]
    E, k, H, I = c["num_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]
    bw = copy_bandwidth("cuda")
    gate_up_w = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    down_w = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    out = {}
    for T in tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        experts = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
        hit = int(torch.unique(experts).numel())
        blocks = mt.route_blocks(experts, E)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(T * k, I, device="cuda", dtype=torch.bfloat16)
        for proj, w, inp, rows_div in (("gate_up", gate_up_w, x, k), ("down", down_w, h, 1)):
            n, kk = w.shape[1], w.shape[2]
            floor = (hit * n * kk * 2 + inp.numel() * 2 + T * k * n * 2) / bw * 1e6
            gemm = functools.partial(mt.grouped_gemm, inp, w, blocks, rows_div)
            row = {"us": graph_us(gemm), "floor_us": floor, "experts_hit": hit,
                   "config": str(dataclasses.astuple(mt.MoeGemmConfig()))}
            if sweep:
                row.update(sweep_configs(gemm, SWEEP))
            row["over_floor"] = floor / row["us"]
            out[f"{model} {proj} t{T}"] = row
        floor = (hit * 3 * H * I * 2 + T * H * 4) / bw * 1e6
        us = graph_us(functools.partial(routed_mlp, x, weights, experts, gate_up_w, down_w, counts))
        out[f"{model} mlp t{T}"] = {"us": us, "floor_us": floor, "experts_hit": hit,
                                    "over_floor": floor / us}
        for key in (f"{model} gate_up t{T}", f"{model} down t{T}", f"{model} mlp t{T}"):
            print(key, {a: (round(b, 3) if isinstance(b, float) else b)
                        for a, b in out[key].items()}, flush=True)
        for n_adapters in sorted({1, min(T, 32)}):
            slot_ids = torch.arange(T, device="cuda") % n_adapters
            slices = len({(int(s), int(e)) for s, row in zip(slot_ids.tolist(), experts.tolist())
                          for e in row})
            for proj, inp, n, rows_div in (("gate_up", x, 2 * I, k), ("down", h, H, 1)):
                lora = _expert_lora(E, inp.shape[1], n)
                w = gate_up_w if proj == "gate_up" else down_w
                # the A and B slices routed, x read by the shrink, its fp32 partials
                floor = (slices * RANK * (inp.shape[1] + n) * 2 + inp.numel() * 2
                         + T * k * RANK * 4) / bw * 1e6

                def with_lora(config=None, inp=inp, w=w, lora=lora, rows_div=rows_div,
                              slot_ids=slot_ids, blocks=blocks):
                    delta = mt.expert_shrink(inp, slot_ids, blocks.experts, lora, rows_div, config)
                    return mt.grouped_gemm(inp, w, blocks, rows_div, lora=delta)

                gemm_us = out[f"{model} {proj} t{T}"]["us"]
                row = {"with_gemm_us": graph_us(with_lora), "gemm_us": gemm_us, "floor_us": floor,
                       "slices": slices, "config": str(dataclasses.astuple(mt.ExpertLoraConfig()))}
                row["us"] = row["with_gemm_us"] - gemm_us  # what the LoRA adds to its GEMM
                if sweep_lora:
                    row.update(sweep_configs(with_lora, LORA_SWEEP))
                    row["best_us"] -= gemm_us
                row["over_floor"] = floor / row["us"]
                key = f"{model} lora_{proj} t{T} a{n_adapters}"
                out[key] = row
                print(key, {a: (round(b, 3) if isinstance(b, float) else b)
                            for a, b in row.items()}, flush=True)
    out["copy_bw_GBs"] = bw / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's configs per shape")
    ap.add_argument("--sweep-lora", action="store_true", help="also time LORA_SWEEP's configs")
    args = ap.parse_args()
    res = run(args.tokens, args.sweep, args.sweep_lora)
    for key, row in res.items():
        if isinstance(row, dict):
            merge_results(results_path("cuda"), "moe_gemm", key, row)
    rows = [{"shape": k, **v} for k, v in res.items() if isinstance(v, dict)]
    print(table(rows, ["shape", "us", "floor_us", "over_floor", "experts_hit", "slices",
                       "config", "best_us", "best_config"]))


if __name__ == "__main__":
    main()
