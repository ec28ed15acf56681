"""Time the Triton multi-LoRA kernels against the torch reference on CUDA, Llama-3-8B shapes.

    python bench/lora_kernels.py [--slots 32] [--rank 16] [--used-rank 16] [--out bench/results]
        [--groups qkv,o,gate_up,down] [--tokens 1,8,32,64,256,2048] [--hbm-gbps 4800]

One row per (module group, tokens, slot spread), median times from triton.testing.do_bench:
the group's shrink+expand (what one layer pays per group) replayed from a CUDA graph as the
engine runs it: by the path lora_launch.PATH_TABLE picks (`path`, graph_us) and by each
path side by side: atomic (three launches: memset, split-K shrink with atomics, expand),
split (two launches, split-K partials, no memset) and fused (bench/lora_fused.py: one
launch, decode sizes only; the engine does not run it); the atomic path's two kernels
alone, the engine's call eager (Python launch overhead included) and the torch reference;
the byte floor (the bytes that must move over --hbm-gbps: adapter weights of the slots
used at --used-rank, x read, y read and written) and the bandwidth the engine's path
reaches over those bytes; and in a layer's context: the base GEMM of the group alone
(gemm_us), with its LoRA as the model runs it (gemm_lora_us: lora_triton.lora_linear, the
shrink on a side stream beside the GEMM; gemm_lora_atomic_us / gemm_lora_split_us: each
path so), and on one stream (gemm_then_lora_us: the GEMM, then lora_apply_fused);
lora_in_layer_us is what the LoRA adds to the GEMM; sorted_us (2..DECODE_MAX_T tokens)
the engine's path with the tokens sorted by slot, the prefill mapping (the slot-sorted
decode graphs' mapping), against the per-token decode mapping the engine uses there;
plain_sort_us (past DECODE_MAX_T) the same call with a plain sort by slot instead of the
engine's segment-aligned order (lora_launch.segment_order).
--used-rank below --rank fills the ranks table with it (the pool stays R wide): a rank-4
adapter should cost about a quarter of a rank-16 one.
Slot spreads: "spread" puts token t on slot t % S (decode's worst case: every token its own
adapter), "single" puts every token on slot 0. The table is also written as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import torch
import triton
import triton.testing

from bench.common import graph_us
from bench.lora_fused import FUSED_CFG, apply_fused
from metrale.ops import lora_launch as launch
from metrale.ops import lora_ref as ref
from metrale.ops import lora_triton as lt

GROUPS = {  # name: (in, [out per module]) for one Llama-3-8B decoder layer
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
TOKENS = [1, 8, 32, 64, 256, 2048]


def make_group(S, R, in_dim, outs, dtype, used_rank=None):
    """Pool views for one fused group: one storage, per slot A_m [R, in] then Bt_m [R, out_m]."""
    slot_elems = sum(R * (in_dim + o) for o in outs)
    storage = torch.randn(S * slot_elems, device="cuda").to(dtype) * 0.02  # every rank filled
    As, Bts, off = [], [], 0
    for o in outs:
        As.append(storage.as_strided((S, R, in_dim), (slot_elems, in_dim, 1), off))
        Bts.append(storage.as_strided((S, R, o), (slot_elems, o, 1), off + R * in_dim))
        off += R * (in_dim + o)
    ranks = torch.full((S, len(outs)), used_rank or R, dtype=torch.int32, device="cuda")  # [S, M]
    scales = torch.full((S, len(outs)), 2.0, device="cuda")  # [S, M]
    return As, Bts, list(ranks.T), list(scales.T)


def _median_ms(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def _gemm_with_lora_us(x, weight, group_args, order, path: str | None) -> float:
    """A layer's projection as the model runs it: the base GEMM plus the group's LoRA
    (lora_triton.lora_linear: the shrink beside the GEMM), by PATH_TABLE's path or `path`."""
    As, Bts, slices, ids, scales, ranks = group_args
    base = functools.partial(torch.nn.functional.linear, weight=weight)
    return graph_us(functools.partial(lt.lora_linear, x, base, None, As, Bts, slices, ids,
                                       scales, ranks, order=order, path=path))


def _gemm_then_lora_us(x, weight, y, group_args, order) -> float:
    """The GEMM, then the group's LoRA on the same stream (no overlap)."""
    As, Bts, slices, ids, scales, ranks = group_args

    def one_stream():
        torch.mm(x, weight.T, out=y)
        lt.lora_apply_fused(y, x, As, Bts, slices, ids, scales, ranks, order=order)

    return graph_us(one_stream)


def run(S: int, R: int, dtype: torch.dtype, groups=tuple(GROUPS), tokens=tuple(TOKENS),
        used_rank: int | None = None, hbm_gbps: float = 4800.0,
        shapes: dict | None = None) -> list[dict]:
    """shapes: name -> (in, [out per module]), GROUPS (Llama-3-8B) by default."""
    shapes = shapes or GROUPS
    rows = []
    elt = torch.tensor([], dtype=dtype).element_size()
    r_used = used_rank or R
    for name in groups:
        in_dim, outs = shapes[name]
        As, Bts, ranks, scales = make_group(S, R, in_dim, outs, dtype, used_rank)
        weight = torch.randn(sum(outs), in_dim, device="cuda").to(dtype) * 0.02  # base W
        cols = [sum(outs[:i]) for i in range(len(outs))]
        slices = [slice(c, c + o) for c, o in zip(cols, outs, strict=True)]
        for T in tokens:
            for spread in ("spread", "single"):
                ids = torch.arange(T, device="cuda") % S if spread == "spread" \
                    else torch.zeros(T, dtype=torch.int64, device="cuda")
                x = torch.randn(T, in_dim, device="cuda").to(dtype)  # [T, in]
                y = torch.zeros(T, sum(outs), device="cuda", dtype=dtype)  # [T, sum(out)]
                h = torch.empty(T, len(outs) * R, device="cuda")  # [T, M*R]
                # the engine builds one slot order per batch and reuses it in every layer
                order = lt.slot_order(ids) if T > lt.DECODE_MAX_T else None
                args = (y, x, As, Bts, slices, ids, scales, ranks)
                apply = functools.partial(lt.lora_apply_fused, *args, order=order)
                shrink = functools.partial(launch.shrink, x, As, ids, ranks, order, h)
                expand = functools.partial(launch.expand, y, h, Bts, cols, ids, ranks, scales,
                                           order)
                used = min(T, S) if spread == "spread" else 1
                moved = (used * r_used * (in_dim + sum(outs)) * elt
                         + T * (in_dim + 2 * sum(outs)) * elt)
                row = dict(group=name, T=T, spread=spread,
                           path=launch.choose_path(T),
                           floor_us=moved / (hbm_gbps * 1e3), graph_us=graph_us(apply))
                for path in lt.PATHS:
                    row[f"{path}_us"] = graph_us(functools.partial(
                        lt.lora_apply_fused, *args, order=order, path=path))
                # the fused kernel is for decode batches only
                row["fused_us"] = graph_us(functools.partial(apply_fused, *args)) \
                    if T <= lt.DECODE_MAX_T else None
                gemm = functools.partial(torch.nn.functional.linear, x, weight)
                group_args = (As, Bts, slices, ids, scales, ranks)
                row.update(gemm_us=graph_us(gemm),
                           gemm_lora_us=_gemm_with_lora_us(x, weight, group_args, order, None),
                           gemm_then_lora_us=_gemm_then_lora_us(x, weight, y, group_args, order))
                for path in lt.PATHS:
                    row[f"gemm_lora_{path}_us"] = _gemm_with_lora_us(x, weight, group_args,
                                                                     order, path)
                row["lora_in_layer_us"] = row["gemm_lora_us"] - row["gemm_us"]
                # the other token mapping at decode sizes: tokens sorted by slot, a block
                # of rows per program (what batches past DECODE_MAX_T get), to set it
                row["sorted_us"] = graph_us(functools.partial(
                    lt.lora_apply_fused, *args, order=lt.slot_order(ids))) \
                    if 1 < T <= lt.DECODE_MAX_T else None
                # past DECODE_MAX_T: a plain sort (programs loop over the slots of their
                # rows) against the engine's segment-aligned order (one slot a program)
                row["plain_sort_us"] = graph_us(functools.partial(
                    lt.lora_apply_fused, *args, order=lt.sort_tokens_by_slot(ids))) \
                    if T > lt.DECODE_MAX_T else None
                row.update(shrink_us=graph_us(shrink), expand_us=graph_us(expand),
                           eager_us=_median_ms(apply) * 1e3,
                           ref_us=_median_ms(functools.partial(ref.lora_apply_fused_ref, *args))
                           * 1e3)
                row["gbps"] = moved / (row["graph_us"] * 1e-6) / 1e9
                rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
                r = dict(rows[-1], fused_us=rows[-1]["fused_us"] or float("nan"))
                print("{group:8} T={T:<5} {spread:7} floor {floor_us:7.2f} | graph[{path}] "
                      "{graph_us:8.2f} us: atomic {atomic_us:8.2f} split {split_us:8.2f} fused "
                      "{fused_us:8.2f} | atomic's shrink {shrink_us:7.2f} expand {expand_us:7.2f} | "
                      "eager {eager_us:8.2f}  ref {ref_us:9.2f} us  {gbps:7.1f} GB/s | gemm "
                      "{gemm_us:7.2f} +lora {gemm_lora_us:7.2f} (one stream {gemm_then_lora_us:7.2f})"
                      .format(**r),
                      flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--used-rank", type=int, default=None,
                    help="every adapter's rank (the ranks table), <= --rank; default --rank")
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="for the byte floor (H200)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = run(args.slots, args.rank, getattr(torch, args.dtype), args.groups.split(","),
               [int(t) for t in args.tokens.split(",")], args.used_rank, args.hbm_gbps)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"lora_kernels-{stamp}.json"
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, slots=args.slots, rank=args.rank,
                used_rank=args.used_rank or args.rank, dtype=args.dtype,
                path_table=[dataclasses.asdict(r) for r in launch.PATH_TABLE], fused_cfg=FUSED_CFG,
                timer="triton.testing.do_bench median")
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
