"""Adapter-slot bytes per rank under tensor parallelism, read from the pools' tensors.

Builds rank 0's LoraSlots as the engine does (a sliced serving pool beside a landing area of
whole slots) and a worker's, on the meta device (shapes and bytes, no memory), next to a
TP=1 pool of the same config, and prints each tensor's bytes.

    python bench/tp_slot_bytes.py [--model llama3-8b] [--tp 2] [--slots 32] [--rank 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS  # noqa: E402
from metrale.config import ModelConfig, PoolConfig  # noqa: E402
from metrale.model.parallel import Shard, shard_config  # noqa: E402
from metrale.pool.landing_area import SlicedServing  # noqa: E402
from metrale.pool.swap import LoraSlots  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b", choices=sorted(CONFIGS))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--landing-slots", type=int, default=2)
    args = p.parse_args()
    model = ModelConfig.from_hf_dict(CONFIGS[args.model])
    pool = PoolConfig(max_loras=args.slots, max_lora_rank=args.rank, target_modules=TARGETS)
    dtype, shard = torch.bfloat16, shard_config(model, args.tp)
    one = LoraSlots(model, pool, "meta", dtype).pool
    rank0 = LoraSlots(model, pool, "meta", dtype,
                      sliced=SlicedServing(shard, Shard(0, args.tp), args.landing_slots))
    worker = LoraSlots(shard, pool, "meta", dtype).pool
    mib = 1 << 20
    print(f"{args.model}, r{args.rank} on {len(TARGETS)} modules, {args.slots} slots, bf16")
    print(f"TP=1                 : {nbytes(one.buffer) / mib:9.1f} MiB of slots")
    print(f"TP={args.tp} rank 0 before   : {nbytes(one.buffer) / mib:9.1f} MiB (whole adapters)")
    print(f"TP={args.tp} rank 0 now      : {nbytes(rank0.pool.buffer) / mib:9.1f} MiB of slots "
          f"+ {rank0.area.nbytes / mib:.1f} MiB landing area ({args.landing_slots} whole slots)")
    print(f"TP={args.tp} each worker     : {nbytes(worker.buffer) / mib:9.1f} MiB of slots")


if __name__ == "__main__":
    main()
