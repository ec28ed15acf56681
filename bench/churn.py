"""Serving under adapter churn: more adapters than slots, Zipf popularity, Poisson
arrivals; TTFT and inter-token latency with continuous promotions vs all resident, plus a
long prompt arriving among decodes.

    PYTHONPATH=. python bench/churn.py [--model llama3.2-1b] [--seconds 8]

Every run replays the same arrival trace (times, prompts, adapters) against one engine
loop on this thread. "promote": max_loras < adapters, the host tier holds every adapter
after its first landing (so most promotions are one H2D copy). "resident": one slot per
adapter, all landed before the run: keys `promote` / `resident`. `long_prompt[<run>]`:
the decoders' ITL while an 8k-token prompt is prefilled beside them: `mixed` at the
default scheduler settings (a step that decodes takes prompt tokens until its predicted
time reaches step_time_ratio times its decodes' own), `mixed_cap128` the default before it
(128 tokens in all beside decodes), the others by the token budget alone at several step
budgets.
JSON `churn[<model>]`. The "legacy" scheduler policy (a step is a prefill or a decode,
FIFO, no slot draining), this benchmark's baseline until chunked prefill had been measured
against it, left the engine: its figures stay in BENCHMARKS.md and bench/results (legacy_*
keys, long_prompt.legacy).
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import adapter_dir, build_pair, make_peft, merge_results, pct, results_path, table
from metrale.config import PoolConfig, SchedulerConfig
from metrale.engine.sampling_params import SamplingParams
from metrale.pool.layout import SlotLayout


def trace(n_adapters: int, seconds: float, rate: float, vocab: int, seed: int = 0,
          zipf_s: float = 1.1, prompt_len: int = 64):
    """[(arrival s, prompt, adapter name)]: Poisson arrivals, Zipf adapter popularity."""
    rng = random.Random(seed)
    ranks = list(range(n_adapters))
    rng.shuffle(ranks)  # popularity independent of adapter index
    weights = [1.0 / (r + 1) ** zipf_s for r in ranks]
    t, out = 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        name = f"a{rng.choices(range(n_adapters), weights)[0]}"
        out.append((t, [rng.randrange(10, vocab - 10) for _ in range(prompt_len)], name))
    return out


def serve(engine, arrivals, gen: int, device: str, drain_s: float = 30.0) -> dict:
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    start, i = time.perf_counter(), 0
    arrived: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft, itl = [], []
    steps: list[tuple[float, str]] = []  # (ms, kind) per engine step
    promotions0 = engine.adapters.num_promotions
    gc0 = gc.get_stats()[2]["collections"]
    deadline = arrivals[-1][0] + drain_s
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        if now > deadline:
            break
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, prompt, name = arrivals[i]
            rid = engine.add_request(prompt, params, adapter=name, request_id=f"r{i}")
            arrived[rid] = start + arrivals[i][0]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[i][0] - now, 0.01)) if i < len(arrivals) else 0)
            continue
        promos = engine.adapters.num_promotions
        t_step = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        if not outs:  # nothing ran: every request waits for a promotion in flight
            engine.wait_for_work(0.002)
            continue
        first = any(o.request_id not in last for o in outs if o.error is None)
        kind = "promote" if engine.adapters.num_promotions > promos else (
            "prefill" if first else "decode")
        steps.append(((t - t_step) * 1e3, kind))
        for o in outs:
            if o.error is not None:
                continue
            if o.request_id in last:
                itl.append((t - last[o.request_id]) * 1e3)
            else:
                ttft.append((t - arrived[o.request_id]) * 1e3)
            last[o.request_id] = t
    by_kind = {k: [ms for ms, kk in steps if kk == k] for k in ("decode", "prefill", "promote")}
    return {
        "steps": {k: {"n": len(v), "p50_ms": pct(v, 50), "p99_ms": pct(v, 99),
                      "max_ms": max(v, default=float("nan"))} for k, v in by_kind.items()},
        "slow_steps_over_50ms": sorted(((round(ms, 1), k) for ms, k in steps if ms > 50),
                                       reverse=True)[:10],
        "gc_gen2": gc.get_stats()[2]["collections"] - gc0,
        "requests": len(arrivals), "completed": len(ttft),
        "output_tok_s": (len(ttft) + len(itl)) / (time.perf_counter() - start),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "promotions": engine.adapters.num_promotions - promotions0,
        "tier_hits": getattr(engine.lora.host_tier, "hits", 0),
    }


LONG_PROMPT_ATTENTION = 128 * 2048  # max_prefill_attention of one long-prompt run
MIXED_BUDGET = 512  # tokens per step: the largest CUDA-graph bucket


BUDGET_ONLY = SchedulerConfig(step_time_ratio=None)
# the long-prompt runs: name -> (step budget, scheduler settings)
LONG_PROMPT_RUNS = {
    "mixed": (MIXED_BUDGET, SchedulerConfig()),
    "mixed_cap128": (MIXED_BUDGET, SchedulerConfig(step_time_ratio=None, max_tokens_beside_decodes=128)),
    "mixed_uncapped": (MIXED_BUDGET, BUDGET_ONLY),
    "mixed_budget256": (256, BUDGET_ONLY),
    "mixed_budget128": (128, BUDGET_ONLY),
    # and the chunk's attention: at 8k context, ~31 tokens a step instead of 96
    "mixed_budget128_attn256k": (128, SchedulerConfig(step_time_ratio=None,
                                                      max_prefill_attention=LONG_PROMPT_ATTENTION)),
}


def _engine(pair, device: str, slots: int, max_model_len: int, tier: int = 0,
            max_num_seqs: int = 64, budget: int = MIXED_BUDGET,
            sched: SchedulerConfig | None = None):
    from bench.decode import make_engine

    return make_engine(pair, device, slots, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       host_tier_bytes=tier, scheduler=sched or SchedulerConfig(),
                       max_num_batched_tokens=budget)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run(pair, adapters_root: Path, device: str, n_adapters: int = 32, slots: int = 8,
        seconds: float = 8.0, rate: float = 150.0, gen: int = 32, host_tier: bool = True) -> dict:
    arrivals = trace(n_adapters, seconds, rate, pair.config.vocab_size)
    out = {"adapters": n_adapters, "slots": slots, "seconds": seconds, "rate_per_s": rate,
           "gen": gen, "host_tier": host_tier, "mixed_budget_tokens": MIXED_BUDGET}
    dtype = next(pair.ours.parameters()).dtype
    slot_bytes = SlotLayout(pair.config, PoolConfig(1, 16), dtype).slot_bytes
    for mode in ("promote", "resident"):
        n_slots = slots if mode == "promote" else n_adapters
        tier = n_adapters * slot_bytes if mode == "promote" and host_tier else 0
        engine = _engine(pair, device, n_slots, 256, tier)
        for a in range(n_adapters):
            engine.register_adapter(f"a{a}", adapter_dir(adapters_root, a))
            if mode == "resident":
                engine.swap_lora_slot_from_disk(adapter_dir(adapters_root, a), f"a{a}", a)
        serve(engine, trace(n_adapters, 1.0, rate, pair.config.vocab_size, seed=1), gen, device)
        res = serve(engine, arrivals, gen, device)
        res["slot_drains"] = engine.adapters.num_drains
        res["itl_p99_over_p50"] = res["itl_p99_ms"] / res["itl_p50_ms"]
        out[mode] = res
        del engine
        _free(device)
    p, r = out["promote"], out["resident"]
    out["itl_p99_ratio"] = p["itl_p99_ms"] / r["itl_p99_ms"]
    out["ttft_p99_promote_over_resident"] = p["ttft_p99_ms"] / r["ttft_p99_ms"]
    out["long_prompt"] = {name: long_prompt(pair, device, budget=budget, sched=sched)
                          for name, (budget, sched) in LONG_PROMPT_RUNS.items()}
    return out


def long_prompt(pair, device: str, decoders: int = 32, prompt_len: int = 8192,
                budget: int = MIXED_BUDGET, sched: SchedulerConfig | None = None) -> dict:
    """32 sequences decode; an 8k-token prompt arrives. The decoders' inter-token times
    from its arrival until each has a token after its first one (so the gaps spanning
    its prefill count), against before it arrived. The prompt's token ids are drawn
    before the loop (drawing 8k random ids in Python took ~3 ms, which landed in one
    gap of every decoder); its add_request is timed (add_request_ms) and counts."""
    sched = sched or SchedulerConfig()
    engine = _engine(pair, device, 1, prompt_len + 256, budget=budget, sched=sched)
    vocab = pair.config.vocab_size
    rng = random.Random(7)
    # the decoders must outlive the prefill: at worst 16 tokens a step (an attention cap
    # at long context), plus the 40 steps before it arrives
    params = SamplingParams(max_tokens=prompt_len // 16 + 64, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(10, vocab - 10) for _ in range(64)], params)
           for _ in range(decoders)]
    last: dict[str, float] = {}
    before, during = [], []
    long_id, steps_before, first_at, add_ms = None, 0, None, float("nan")
    long_prompt_ids = [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]
    after_first: set[str] = set()  # decoders with a token after the long prompt's first
    steps: list[tuple[float, str]] = []  # (ms, graph used) of each step since it arrived
    while len(after_first) < decoders:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the decoders finished before the long prompt's first token")
        replays = dict(engine.runner.graphs.replays) if engine.runner.graphs else {}
        t0 = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        if long_id is not None:
            now = dict(engine.runner.graphs.replays) if engine.runner.graphs else {}
            used = [k for k in now if now[k] != replays.get(k)]
            steps.append(((t - t0) * 1e3, str(used[0]) if used else "eager"))
        for o in outs:
            if o.request_id == long_id:
                first_at = first_at or t
                continue
            if o.request_id in last:
                (during if long_id is not None else before).append((t - last[o.request_id]) * 1e3)
            last[o.request_id] = t
            if first_at is not None and t > first_at:
                after_first.add(o.request_id)
        if long_id is None and len(last) == decoders:
            steps_before += 1
            if steps_before == 40:
                long_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
                t_add = time.perf_counter()
                long_id = engine.add_request(long_prompt_ids, long_params)
                add_ms = (time.perf_counter() - t_add) * 1e3
    for rid in [*ids, long_id]:
        engine.abort(rid)
    res = {"prompt_tokens": prompt_len, "decoders": decoders, "budget_tokens": budget,
           "max_tokens_beside_decodes": sched.max_tokens_beside_decodes,
           "step_time_ratio": sched.step_time_ratio,
           "max_prefill_attention": sched.max_prefill_attention,
           "itl_before_p50_ms": pct(before, 50), "itl_during_p50_ms": pct(during, 50),
           "itl_during_p99_ms": pct(during, 99), "steps_during": len(during) // decoders,
           "add_request_ms": add_ms, "itl_during_max_ms": max(during),
           "slowest_steps": sorted(steps, reverse=True)[:4]}
    res["during_p99_over_before_p50"] = res["itl_during_p99_ms"] / res["itl_before_p50_ms"]
    res["during_p99_over_during_p50"] = res["itl_during_p99_ms"] / res["itl_during_p50_ms"]
    del engine
    _free(device)
    return res


def report(name: str, res: dict) -> str:
    modes = ("promote", "resident")
    rows = [{"model": name, "mode": m, **res[m]} for m in modes if m in res]
    cols = ["model", "mode", "requests", "completed", "output_tok_s", "promotions", "slot_drains",
            "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50"]
    lines = [table(rows, cols)]
    if "itl_p99_ratio" in res:
        lines.append(f"itl p99 promote/resident {res['itl_p99_ratio']:.3g}, ttft p99 "
                     f"promote/resident {res['ttft_p99_promote_over_resident']:.3g}")
    for m in modes:
        if m in res:
            lines.append(f"{m} steps: {res[m]['steps']} slow: {res[m]['slow_steps_over_50ms']} "
                         f"gc2: {res[m]['gc_gen2']}")
    for run_name, r in res.get("long_prompt", {}).items():
        lines.append(f"long prompt ({run_name}): {r}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--no-tier", action="store_true",
                    help="promote from disk every time (exercises the async disk promotion path)")
    ap.add_argument("--long-prompt-only", action="store_true",
                    help="only the long-prompt runs (printed, not written to the JSON)")
    ap.add_argument("--long-prompt-run", choices=list(LONG_PROMPT_RUNS), action="append",
                    help="with --long-prompt-only: just these runs (default: all)")
    args = ap.parse_args()
    if args.long_prompt_only:
        with tempfile.TemporaryDirectory() as tmp:
            pair = build_pair(args.model, args.device, Path(tmp))
            for name in args.long_prompt_run or LONG_PROMPT_RUNS:
                budget, sched = LONG_PROMPT_RUNS[name]
                print(name, long_prompt(pair, args.device, budget=budget, sched=sched), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair(args.model, args.device, Path(tmp))
        make_peft(pair, 32, Path(tmp) / "adapters")
        res = run(pair, Path(tmp) / "adapters", args.device, seconds=args.seconds, rate=args.rate,
                  host_tier=not args.no_tier)
    key = args.model + ("-disk" if args.no_tier else "")
    merge_results(results_path(args.device), "churn", key, res)
    print(report(args.model, res))


if __name__ == "__main__":
    main()
