"""Time `sample()` on a batch of sampled rows (host-side cost of a decode step's draw).

    python bench/sampler.py [--rows 8 32] [--vocab 49152] [--device cpu]

Median ms per call over 12 calls (3 warm-ups dropped), rows all unseeded or all seeded
(seeded rows draw one by one from their own generator), at temperature 0.8 alone and at
temperature 0.7 with top-k 50 and top-p 0.9.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metrale.engine.sampler import sample
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.sequence import Sequence

SETTINGS = {"temperature": dict(temperature=0.8),
            "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9)}


def time_ms(logits: torch.Tensor, seqs: list[Sequence], device: str, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        sample(logits, seqs)  # returns after its host sync
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=args.device) * 3  # [B, V]
        for name, kw in SETTINGS.items():
            for seeded in (False, True):
                seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(
                    seed=i if seeded else None, **kw), None) for i in range(rows)]
                print(f"rows {rows:3} {name:12} {'seeded' if seeded else 'unseeded':9} "
                      f"{time_ms(logits, seqs, args.device):7.2f} ms")


if __name__ == "__main__":
    main()
