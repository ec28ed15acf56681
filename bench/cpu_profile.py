"""Where a CPU decode step's time goes: batch 8 on the default model, base / one adapter /
two adapters timed, then one adapter under cProfile and torch.profiler (tables to stdout).

    PYTHONPATH=. python bench/cpu_profile.py [--threads 1] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from metrale import LLM, SamplingParams
from metrale.demo_adapters import demo_adapter_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(None, max_loras=2, max_lora_rank=16, max_model_len=512, enable_prefix_caching=False)
    for name in ("shout", "pirate"):
        llm.register_adapter(name, demo_adapter_dir(name))
    prompt = llm.chat_prompt("Tell me about the moon.")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def run(adapters: list[str | None]) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt] * 8, [params] * 8, adapters)
        return time.perf_counter() - wall, time.process_time() - cpu

    run(["shout"] * 8)  # warm-up
    for label, adapters in (("base", [None] * 8), ("shout", ["shout"] * 8),
                            ("shout+pirate", ["shout", "pirate"] * 4)):
        wall, cpu = run(adapters)
        print(f"{label:13} wall {wall:.2f} s  cpu {cpu:.2f} s  {8 * args.tokens / wall:.1f} tok/s")
    prof = cProfile.Profile()
    prof.enable()
    run(["shout"] * 8)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        run(["shout"] * 8)
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
