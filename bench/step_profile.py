"""Where a mixed step's time goes: 32 decoders + a chunk of an 8k prompt (1B shape).

    PYTHONPATH=. python bench/step_profile.py
"""
from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.churn import _engine
from bench.common import build_pair
from metrale.engine.sampling_params import SamplingParams


def _median_step_ms(engine, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[n // 2]


def main() -> None:
    dev = "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair("llama3.2-1b", dev, Path(tmp))
        eng = _engine(pair, dev, 1, 8192 + 256, budget=128)
        vocab = pair.config.vocab_size
        rng = random.Random(0)
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for _ in range(32):
            eng.add_request([rng.randrange(10, vocab - 10) for _ in range(64)], params)
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        print("decode step ms", _median_step_ms(eng, 20))
        rid = eng.add_request([rng.randrange(10, vocab - 10) for _ in range(8192)],
                              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        seq = eng.requests[rid]
        late: list[tuple[int, float]] = []  # (context before the step, step ms)
        while seq.num_computed < 8192 - 1024:
            before = seq.num_computed
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            late.append((before, (time.perf_counter() - t) * 1e3))
        for lo in range(0, 8192 - 1024, 1024):
            ts = sorted(ms for ctx, ms in late if lo <= ctx < lo + 1024)
            if ts:
                print(f"context {lo:5d}-{lo + 1023:5d}: {len(ts)} steps, median {ts[len(ts) // 2]:.2f} ms,"
                      f" max {ts[-1]:.2f} ms")
        print("replays", dict(eng.runner.graphs.replays))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):  # chunks at context ~7k
                eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
