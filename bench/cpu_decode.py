"""Decode throughput of the embedded default model on the CPU, batch 1 and 8, base and
with one demo adapter, for metrale and, side by side in the same run, for transformers
`generate` (base) and transformers + PEFT (adapter). Prints a table and writes JSON.

    .venv/bin/python bench/cpu_decode.py [--tokens 64] [--reps 3] [--no-hf]

The load of a shared box moves every number: each configuration runs metrale and HF
back to back, `reps` times, and reports the median of each, so the ratio compares
measurements taken under the same load. Keys: `cpu_decode` (metrale rows, as before),
`hf_decode` (the same rows for transformers/PEFT) and `side_by_side`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from metrale import LLM, SamplingParams
from metrale.demo_adapters import demo_adapter_dir, load_with_adapter
from metrale.model.default_model import default_model_dir

PROMPT = "Tell me about the moon."
ADAPTER = "shout"
# The two-adapter batch: half the sequences on each. metrale runs it as one batch; PEFT
# serves one adapter per forward, so it runs each half after the other.
MIXED = ("shout", "pirate")


def time_metrale(llm: LLM, batch: int, tokens: int, adapter: str | None | tuple[str, ...],
                 ) -> tuple[int, float, float]:
    prompt = llm.chat_prompt(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    adapters = [adapter[i % len(adapter)] for i in range(batch)] if isinstance(adapter, tuple) \
        else [adapter] * batch  # mixed: interleaved, the worst case for grouping by slot
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([prompt] * batch, [params] * batch, adapters)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(o.token_ids) for o in outs), elapsed, cpu


def time_hf(model, tokenizer, batch: int, tokens: int) -> tuple[int, float, float]:
    """Greedy `generate` of `tokens` new tokens for `batch` copies of the prompt (equal
    lengths: no padding); min_new_tokens keeps EOS from ending it early, as ignore_eos."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)
    inputs = {k: v.repeat(batch, 1) for k, v in inputs.items()}  # [batch, prompt]
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (out.shape[1] - inputs["input_ids"].shape[1]) * batch, elapsed, cpu


def time_peft_mixed(models: list, tokenizer, batch: int, tokens: int) -> tuple[int, float, float]:
    """PEFT serves one adapter per forward: each adapter's share of the batch, one after the other."""
    runs = [time_hf(m, tokenizer, batch // len(models), tokens) for m in models]
    return tuple(sum(r[i] for r in runs) for i in range(3))


def row(batch: int, adapter: str | None | tuple[str, ...], runs: list[tuple[int, float, float]],
        ) -> dict:
    """Wall-clock medians, plus CPU-time ones: on a box shared with other work, tokens per
    CPU second (process time, all threads) move much less with the load than tok/s."""
    tokens = runs[0][0]
    seconds = statistics.median(s for _, s, _ in runs)
    cpu = statistics.median(c for _, _, c in runs)
    if isinstance(adapter, tuple):
        adapter = "+".join(adapter)
    return {"batch": batch, "adapter": adapter, "tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds, "tok_s_runs": [n / s for n, s, _ in runs],
            "cpu_seconds": cpu, "tok_per_cpu_s": tokens / cpu}


def _hf_name(adapter: str | None) -> str:
    if adapter and "+" in adapter:
        return "peft, one adapter after the other"
    return "peft" if adapter else "transformers"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument("--no-hf", action="store_true", help="metrale only")
    ap.add_argument("--out", type=Path, help="JSON path (default: results/<date>-cpu-decode.json)")
    args = ap.parse_args()
    load_start = os.getloadavg()  # a shared box: the load is part of the figure
    llm = LLM(None, max_loras=2, max_lora_rank=16, max_model_len=512,
              enable_prefix_caching=False)
    dirs = {name: demo_adapter_dir(name) for name in dict.fromkeys((ADAPTER, *MIXED))}
    for name, path in dirs.items():
        llm.register_adapter(name, path)
    hf = {}
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = default_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf[None] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for name, path in dirs.items():
            hf[name] = load_with_adapter(model_dir, path)  # PEFT on its own base
        hf[MIXED] = [hf[name] for name in MIXED]

    ours, theirs = [], []
    for adapter, batches in ((None, (1, 8)), (ADAPTER, (1, 8)), (MIXED, (8,))):
        def theirs_run(batch: int, tokens: int, adapter=adapter):
            if isinstance(adapter, tuple):
                return time_peft_mixed(hf[adapter], tokenizer, batch, tokens)
            return time_hf(hf[adapter], tokenizer, batch, tokens)

        time_metrale(llm, len(MIXED), 8, adapter)  # warm-up
        if hf:
            theirs_run(len(MIXED), 8)
        for batch in batches:
            m_runs, h_runs = [], []
            for _ in range(args.reps):  # interleaved: both see the same load
                m_runs.append(time_metrale(llm, batch, args.tokens, adapter))
                if hf:
                    h_runs.append(theirs_run(batch, args.tokens))
            ours.append(row(batch, adapter, m_runs))
            if hf:
                theirs.append(row(batch, adapter, h_runs))

    side = []
    print(f"{'batch':>5} {'adapter':>8} {'tokens':>7} {'metrale tok/s':>14} "
          f"{'HF/PEFT tok/s':>14} {'ratio':>6} {'tok/cpu-s ratio':>16}")
    nan = float("nan")
    for i, r in enumerate(ours):
        h = theirs[i] if theirs else None
        ratio = r["tok_s"] / h["tok_s"] if h else None
        cpu_ratio = r["tok_per_cpu_s"] / h["tok_per_cpu_s"] if h else None
        side.append({"batch": r["batch"], "adapter": r["adapter"], "metrale_tok_s": r["tok_s"],
                     "hf_tok_s": h and h["tok_s"], "hf": _hf_name(r["adapter"]),
                     "ratio": ratio, "metrale_tok_per_cpu_s": r["tok_per_cpu_s"],
                     "hf_tok_per_cpu_s": h and h["tok_per_cpu_s"], "cpu_ratio": cpu_ratio})
        print(f"{r['batch']:>5} {r['adapter'] or 'base':>8} {r['tokens']:>7} "
              f"{r['tok_s']:>14.1f} {h['tok_s'] if h else nan:>14.1f} {ratio or nan:>6.2f} "
              f"{cpu_ratio or nan:>16.2f}")
    day = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"{day.replace('-', '')}-cpu-decode.json"
    if out.exists() and not args.out:  # an earlier run of the day is a baseline: keep it
        out = out.with_name(f"{out.stem}-{datetime.datetime.now():%H%M%S}.json")
    result = {
        "date": day, "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__, "model": "SmolLM2-135M-Instruct fp32", "cpu_decode": ours,
        "tokens": args.tokens, "reps": args.reps, "adapter_name": ADAPTER,
        "command": "bench/cpu_decode.py " + " ".join(sys.argv[1:]),
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "hf_decode": theirs, "side_by_side": side,
    }
    if not args.no_hf:
        import peft
        import transformers

        result["transformers"], result["peft"] = transformers.__version__, peft.__version__
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
