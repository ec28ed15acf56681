"""Land a Llama-3-8B-shaped adapter (r=16, all-linear, bf16, 86.6 MB) from disk into a
CPU pool, and time it with the pool's finiteness check as it is (weights_check.all_finite:
aminmax on the CPU) and as isfinite().all() (what it was), in one run.

    python bench/cpu_landing.py [--model llama3-8b] [--reps 4] [--threads 1]

Median ms of a disk landing into a bare pool (`LoraSlots.prepare_disk` + `land`, what an
engine's swap runs) after one warm-up (page cache warm).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import metrale.pool.pool as pool_module
from bench.peer_nvlink import RANK, land_from_disk, write_model_and_adapter
from metrale.config import ModelConfig, PoolConfig
from metrale.pool.swap import LoraSlots


def landing_ms(slots: LoraSlots, adapter: Path, reps: int, tag: str) -> float:
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        land_from_disk(slots, adapter, i % 2, f"{tag}{i}")
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter = write_model_and_adapter(Path(tmp), args.model)
        slots = LoraSlots(ModelConfig.from_dir(model_dir), PoolConfig(2, RANK), "cpu",
                          torch.bfloat16)
        now = landing_ms(slots, adapter, args.reps, "now")
        kept = pool_module.all_finite
        pool_module.all_finite = lambda t: bool(t.isfinite().all())
        try:
            before = landing_ms(slots, adapter, args.reps, "isfinite")
        finally:
            pool_module.all_finite = kept
    print(f"{args.model} adapter, CPU pool bf16, {args.threads} thread(s): landing "
          f"{now:.1f} ms with all_finite, {before:.1f} ms with isfinite().all()")


if __name__ == "__main__":
    main()
