"""Decode throughput of the embedded default model on the CPU, batch 1 and 8,
base and with one demo adapter. Prints a table and writes JSON.

    .venv/bin/python bench/cpu_decode.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from metrale import LLM, SamplingParams
from metrale.demo_adapters import demo_adapter_dir

PROMPT = "Tell me about the moon."


def run(llm: LLM, batch: int, tokens: int, adapter: str | None) -> dict:
    prompt = llm.chat_prompt(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, adapter)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, [params] * batch, [adapter] * batch)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"batch": batch, "adapter": adapter, "tokens": generated, "seconds": elapsed,
            "tok_s": generated / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(None, max_loras=2, max_lora_rank=16, max_model_len=512,
              enable_prefix_caching=False)
    llm.register_adapter("shout", demo_adapter_dir("shout"))
    rows = [run(llm, b, args.tokens, a) for a in (None, "shout") for b in (1, 8)]
    print(f"{'batch':>5} {'adapter':>8} {'tokens':>7} {'s':>7} {'tok/s':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['adapter'] or 'base':>8} {r['tokens']:>7} "
              f"{r['seconds']:>7.2f} {r['tok_s']:>8.1f}")
    day = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"{day.replace('-', '')}-cpu-decode.json"
    out.write_text(json.dumps({
        "date": day, "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__, "model": "SmolLM2-135M-Instruct fp32", "cpu_decode": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
