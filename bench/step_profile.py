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
        eng = _engine(pair, dev, "mixed", 1, 8192 + 256, budget=128)
        vocab = pair.config.vocab_size
        rng = random.Random(0)
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for _ in range(32):
            eng.add_request([rng.randrange(10, vocab - 10) for _ in range(64)], params)
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        print("decode step ms", _median_step_ms(eng, 20))
        eng.add_request([rng.randrange(10, vocab - 10) for _ in range(8192)],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        print("mixed step ms", _median_step_ms(eng, 30), "replays", dict(eng.runner.graphs.replays))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
