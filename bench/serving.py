"""Serving at saturation, as `vllm bench throughput` / `vllm bench serve` measure it: many
mixed-length requests against one engine, with the floor the hardware allows measured in
the same run.

    PYTHONPATH=. python bench/serving.py [--model llama3-8b] [--scenarios offline_base online_base]

Workload (the saturation issue's): --requests 600, prompt ~ U[128, 1024] random token ids,
output ~ U[64, 512] (ignore_eos), max_num_seqs 256, 8,192 tokens a step, 20,000 KV blocks of
16, the engine's default scheduler settings unless a scenario says otherwise. Random
weights (bench.common.build_random_quant): speed only, no reference outputs.

Scenarios (JSON `serving` -> <model> -> <scenario>):
- offline_base: every request added at t=0, the engine stepped until all finish.
- offline_base_budget_only: the same with the step composed by the token budget alone
  (no step-time target, no cap beside decodes): vLLM's default policy, the comparison the
  saturation issue asks the default never to fall below.
- online_base_rate<R>: Poisson arrivals at R requests/s for --seconds, then drained; R is
  --rates, or `auto`: 80% of offline_base's request rate in the same run.
- offline_lora<N>: 80% of requests name one of N registered r16 all-linear adapters drawn
  Zipf(1.1), 20% the base (default slots, default host tier); online_lora<N>_rate<R>
  likewise online. Up to 64 adapters are directories of their own over one random file
  (bench.common.write_random_adapters); more (offline_lora1000) are registered as a
  directory adapter source registers them (config and header read; the weights checked at
  each landing), each directory its own config and a hard link to one of 8 random r16 files
  (bench/many_adapters.py's layout: 1,000 x 84 MB would not fit the device's disk; every
  cache keys adapters by directory, while the page cache holds the 8 files: warm reads).

All scenarios of a run share one engine, warmed up first by --warmup untimed requests of
the workload (its CUDA graphs captured once, the adapters of
the largest scenario registered up front, promotions never timing out); each sets its
scheduler policy on it. Each reports req_s, out_tok_s, total_tok_s (prompt + output
tokens over the wall time), TTFT / ITL / TPOT p50 and p99, and the floor: every token's
linear and attention FLOPs at the bf16 matmul peak measured in this run, against the
weights read once per full-batch decode step (output tokens / max_num_seqs) plus every
decode token's K/V read at the measured copy bandwidth; floor_s = max(compute_s,
memory_s) and over_floor = floor_s / wall_s (1.0 would be the floor; the issue's table
calls it "of the floor"). Online runs report the floor of the requests they served, for
reference only (arrivals bound them).
--profile N: a torch.profiler window of N steps in the middle of the first offline run,
its kernel table printed (kernel time by name, and the GPU's busy share of the window).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import (
    build_random_quant,
    copy_bandwidth,
    median,
    merge_results,
    pct,
    results_path,
    sync,
    table,
    timed,
    write_random_adapters,
)
from bench.many_adapters import write_adapters
from metrale.config import EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.registry import AdapterSource
from metrale.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    requests: int = 600
    prompt: tuple[int, int] = (128, 1024)  # inclusive range of prompt tokens
    output: tuple[int, int] = (64, 512)
    adapters: int = 0  # requests name a{0..adapters-1}, Zipf(1.1), in lora_share of them
    lora_share: float = 0.8
    zipf_s: float = 1.1
    seed: int = 0


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    adapter: str | None


def make_requests(w: Workload, vocab: int, n: int | None = None, seed: int | None = None) -> list[Request]:
    rng = random.Random(w.seed if seed is None else seed)
    ranks = list(range(w.adapters))
    rng.shuffle(ranks)  # popularity independent of the adapter's index
    weights = [1.0 / (r + 1) ** w.zipf_s for r in ranks]
    out = []
    for _ in range(w.requests if n is None else n):
        p = rng.randint(*w.prompt)
        adapter = None
        if w.adapters and rng.random() < w.lora_share:
            adapter = f"a{rng.choices(range(w.adapters), weights)[0]}"
        out.append(Request([rng.randrange(10, vocab - 10) for _ in range(p)],
                           rng.randint(*w.output), adapter))
    return out


@dataclass
class Trace:
    """Arrival and token times (perf_counter s) per request, and per step its batch."""

    arrival: dict[str, float] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    steps: list[tuple[float, int, int, int]] = field(default_factory=list)  # (s, seqs, tokens, decodes)
    slot_wait: dict[str, float] = field(default_factory=dict)  # adapter requests: s until bound
    # each timed step as the engine measured it (CUDA events): (tokens, prompt tokens, decodes, s)
    timed: list[tuple[int, int, int, float]] = field(default_factory=list)
    errors: int = 0

    def record(self, outs, now: float) -> None:
        for o in outs:
            if o.error is not None:
                self.errors += 1
                continue
            if o.adapter is not None and o.request_id not in self.times:
                self.slot_wait[o.request_id] = o.adapter_wait_s
            self.times.setdefault(o.request_id, []).extend([now] * len(o.delta_token_ids))


def observe_batches(engine: LLMEngine, trace: Trace) -> None:
    """Record each scheduled batch's composition (observation only)."""
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        decodes = sum(1 for n in batch.num_new if n == 1)
        trace.steps.append((time.perf_counter(), len(batch), batch.num_tokens, decodes))
        return batch

    engine.scheduler.schedule = recording
    observe = engine.scheduler.observe

    def timing(shape, seconds):
        trace.timed.append((shape.tokens, shape.prompt_tokens, shape.decodes, round(seconds, 6)))
        observe(shape, seconds)

    engine.scheduler.observe = timing


def drive(engine: LLMEngine, reqs: list[Request], arrivals: list[float], trace: Trace,
          profile_at: int | None = None, profile_steps: int = 0) -> tuple[float, str | None]:
    """Add each request at its arrival (s after the start) and step until all finish;
    returns (wall s, the profile's kernel table or None)."""
    sched = engine.scheduler
    originals = sched.schedule, sched.observe
    observe_batches(engine, trace)
    try:
        return _drive(engine, reqs, arrivals, trace, profile_at, profile_steps)
    finally:
        sched.schedule, sched.observe = originals


def _drive(engine, reqs, arrivals, trace, profile_at, profile_steps):
    start, i, steps, report = time.perf_counter(), 0, 0, None
    prof = None
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(reqs) and start + arrivals[i] <= now:
            r = reqs[i]
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
            rid = engine.add_request(r.prompt, params, adapter=r.adapter, request_id=f"r{i}")
            trace.arrival[rid] = start + arrivals[i]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, start + arrivals[i] - now)))
            continue
        if profile_at is not None and steps == profile_at:
            prof = _start_profile()
        outs = engine.step()
        trace.record(outs, time.perf_counter())
        steps += 1
        if prof is not None and steps == profile_at + profile_steps:
            report, prof = _stop_profile(prof), None
        if not outs:
            engine.wait_for_work(0.002)
    return time.perf_counter() - start, report


def _start_profile():
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()
    prof.wall_start = time.perf_counter()
    return prof


def _stop_profile(prof) -> str:
    sync("cuda")
    wall = time.perf_counter() - prof.wall_start
    prof.__exit__(None, None, None)
    events = prof.key_averages()
    kernel_us = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") \
        if hasattr(events[0], "device_type") else float("nan")
    busy = f"window {wall * 1e3:.1f} ms wall, kernels {kernel_us / 1e3:.1f} ms"
    return busy + "\n" + events.table(sort_by="device_time_total", row_limit=30)


def summarize(trace: Trace, reqs: list[Request], wall: float) -> dict:
    ttft, itl, tpot = [], [], []
    out_tokens = 0
    for rid, ts in trace.times.items():
        out_tokens += len(ts)
        ttft.append(ts[0] - trace.arrival[rid])
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        itl += gaps
        if gaps:
            tpot.append((ts[-1] - ts[0]) / len(gaps))
    done = len(trace.times)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    step_s = [b[0] - a[0] for a, b in zip(trace.steps, trace.steps[1:])]
    return {
        "requests": len(reqs), "completed": done, "errors": trace.errors, "wall_s": wall,
        "req_s": done / wall, "out_tok_s": out_tokens / wall,
        "total_tok_s": (prompt_tokens + out_tokens) / wall,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
        "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) * 1e3,
        "steps": len(trace.steps),
        "step_p50_ms": pct(step_s, 50) * 1e3, "step_p99_ms": pct(step_s, 99) * 1e3,
        "tokens_per_step_p50": pct([s[2] for s in trace.steps], 50),
        "seqs_per_step_p50": pct([s[1] for s in trace.steps], 50),
        "decode_only_steps": sum(1 for s in trace.steps if s[2] == s[3]),
        "slot_wait_p99_s": pct(list(trace.slot_wait.values()), 99),
    }


def matmul_peak(device: str, n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n product on random data (the compute ceiling)."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median(timed(lambda: a @ b, device, reps=10, warmup=3))
    return 2 * n ** 3 / (ms / 1e3)


def floor_s(cfg, weights_bytes: int, reqs: list[Request], max_num_seqs: int, peak: float,
            bw: float, dtype_bytes: int = 2) -> dict:
    """The floor of serving reqs whole (see the module docstring)."""
    h, layers = cfg.hidden_size, cfg.num_layers
    linear = sum(cfg.linear_shape(m)[0] * cfg.linear_shape(m)[1]
                 for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    pair_flops = 4 * cfg.num_heads * cfg.head_dim * layers  # QK and PV of one (query, key) pair
    kv_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    flops = kv_bytes = 0.0
    out_tokens = 0
    for r in reqs:
        p, n = len(r.prompt), r.max_tokens
        computed = p + n - 1  # the last token is sampled, never fed back
        flops += 2 * linear * layers * computed + 2 * h * cfg.vocab_size * n
        flops += pair_flops * (p * (p + 1) / 2 + sum(range(p + 1, p + n)))
        kv_bytes += kv_token * sum(range(p + 1, p + n))  # each decode reads its context
        out_tokens += n
    compute = flops / peak
    memory = (weights_bytes * -(-out_tokens // max_num_seqs) + kv_bytes) / bw
    return {"compute_s": compute, "memory_s": memory, "floor_s": max(compute, memory),
            "peak_tflops": peak / 1e12, "copy_bw_GBs": bw / 1e9}


def make_engine(pair, device: str, args, scheduler: SchedulerConfig | None = None,
                max_loras: int | None = None) -> LLMEngine:
    pool = PoolConfig() if max_loras is None else PoolConfig(max_loras=max_loras)
    cfg = EngineConfig(
        pool=pool, device=device, dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_model_len=args.max_model_len, block_size=16, num_kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler=scheduler or SchedulerConfig(),
        # a request waits for its slot as long as that takes (LLM's default): the
        # benchmark measures waits, it does not fail them
        promotion_timeout_s=math.inf)
    return LLMEngine(pair.model_dir, cfg, model=pair.ours)


def adapter_count(scenario: str) -> int:
    """offline_lora64 -> 64; a base scenario -> 0."""
    m = re.search(r"lora(\d+)", scenario)
    return int(m.group(1)) if m else 0


BUDGET_ONLY = SchedulerConfig(step_time_ratio=None)


def make_serving_engine(pair, device: str, args, adapters: int, adapters_root: Path | None) -> LLMEngine:
    """One engine for every scenario of a run (its CUDA graphs are captured once): each
    scenario sets its scheduler policy, its adapters a0.. registered up front."""
    engine = make_engine(pair, device, args, None, args.max_loras)
    for a in range(adapters):
        path = adapters_root / f"a{a}"
        engine.register_adapter(f"a{a}", AdapterSource.of(path, verify_on_landing=adapters > 64))
    return engine


def run_scenario(engine: LLMEngine, args, name: str, rate: float | None, adapters: int,
                 floor_of) -> dict:
    w = Workload(requests=args.requests, adapters=adapters, prompt=tuple(args.prompt),
                 output=tuple(args.output))
    vocab = engine.model_config.vocab_size
    # the scheduler reads its policy each step: this scenario's, on the shared engine
    engine.scheduler.sched = BUDGET_ONLY if name.endswith("_budget_only") else SchedulerConfig()
    # warm-up: compile the kernels of every step shape this workload meets
    warm = make_requests(w, vocab, n=min(2 * args.max_num_seqs, 64), seed=99)
    drive(engine, [Request(r.prompt, 8, r.adapter) for r in warm], [0.0] * len(warm), Trace())
    if rate is None:
        reqs = make_requests(w, vocab)
        arrivals = [0.0] * len(reqs)
    else:
        rng = random.Random(w.seed + 1)
        arrivals, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t > args.seconds:
                break
            arrivals.append(t)
        reqs = make_requests(w, vocab, n=len(arrivals), seed=w.seed + 2)
    trace = Trace()
    profile_at = args.profile_at if rate is None and args.profile and name in args.profile_scenario \
        else None
    adapters_before = (engine.adapters.num_promotions, engine.adapters.num_ready_on_arrival,
                       engine.adapters.num_waited_for_adapter, engine.scheduler.num_preemptions)
    gc.collect()
    wall, report = drive(engine, reqs, arrivals, trace, profile_at, args.profile)
    res = summarize(trace, reqs, wall)
    res.update(floor_of(reqs))
    res["over_floor"] = res["floor_s"] / wall
    res["floor_out_tok_s"] = sum(r.max_tokens for r in reqs) / res["floor_s"]
    if rate is not None:
        res["rate"] = rate
    promotions, ready, waited, preempted = (
        now - before for now, before in zip((
            engine.adapters.num_promotions, engine.adapters.num_ready_on_arrival,
            engine.adapters.num_waited_for_adapter, engine.scheduler.num_preemptions),
            adapters_before))
    if adapters:
        res["promotions"] = promotions
        res["hit_rate"] = ready / max(1, ready + waited)
    res["preemptions"] = preempted
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        t0 = trace.steps[0][0] if trace.steps else 0.0
        (Path(args.trace_dir) / f"{name}-steps.json").write_text(json.dumps(
            [(round(t - t0, 5), *rest) for t, *rest in trace.steps]))
        (Path(args.trace_dir) / f"{name}-timed.json").write_text(json.dumps(trace.timed))
    if report is not None:
        print(f"--- profile of {name}, steps {profile_at}..{profile_at + args.profile}\n{report}",
              flush=True)
    return res


def warm_up(engine: LLMEngine, args, adapters: int) -> None:
    """An untimed slice of the workload (its prompts, short answers, the adapters of the
    largest scenario) before the first scenario: Triton compiles a kernel variant the first
    time a step meets a new specialization (the decode rows of a mixed step, a split
    count), ~0.1-0.4 s each, and without this the first scenario alone would pay them."""
    w = Workload(requests=args.warmup, adapters=adapters, prompt=tuple(args.prompt), output=(8, 64))
    reqs = make_requests(w, engine.model_config.vocab_size, seed=7)
    t0 = time.perf_counter()
    drive(engine, reqs, [0.0] * len(reqs), Trace())
    print(f"warm-up: {len(reqs)} requests in {time.perf_counter() - t0:.1f} s", flush=True)


COLS = ["scenario", "req_s", "out_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms",
        "itl_p99_ms", "tpot_p50_ms", "over_floor", "floor_s", "wall_s", "steps", "preemptions"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scenarios", nargs="+",
                    default=["offline_base", "offline_base_budget_only", "online_base"])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rates", nargs="+", default=["auto"],
                    help="online request rates (req/s); auto: 80%% of offline_base's")
    ap.add_argument("--seconds", type=float, default=120.0, help="online arrival window")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-blocks", type=int, default=20000)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt", type=int, nargs=2, default=list(Workload.prompt), metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=list(Workload.output), metavar=("MIN", "MAX"))
    ap.add_argument("--max-loras", type=int, default=None, help="slots (default: the memory rule's)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N steps of --profile-scenario from step --profile-at")
    ap.add_argument("--profile-at", type=int, default=200)
    ap.add_argument("--profile-scenario", nargs="+", default=["offline_base"])
    ap.add_argument("--trace-dir", help="write each scenario's steps (s, seqs, tokens, decodes) here")
    ap.add_argument("--no-write", action="store_true", help="print only (A/B runs)")
    ap.add_argument("--warmup", type=int, default=300, metavar="N",
                    help="untimed requests of the workload before the first scenario (0: none)")
    args = ap.parse_args()
    device = args.device
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_random_quant(args.model, None, device, Path(tmp))
        adapters_root = Path(tmp) / "adapters"
        most = max(adapter_count(s) for s in args.scenarios)
        if most > 64:
            adapters_root = write_adapters(pair, Path(tmp) / "many", 8, [f"a{i}" for i in range(most)])
        elif most:
            write_random_adapters(pair, most, adapters_root)
        peak, bw = matmul_peak(device), copy_bandwidth(device)
        weights = sum(p.numel() * p.element_size() for n, p in pair.ours.named_parameters()
                      if pair.config.tie_word_embeddings or not n.startswith("embed_tokens"))
        floor_of = lambda reqs: floor_s(pair.config, weights, reqs, args.max_num_seqs,  # noqa: E731
                                        peak, bw)
        results: dict[str, dict] = {}
        engine = make_serving_engine(pair, device, args, most, adapters_root)
        print(engine.memory.describe(), flush=True)
        if args.warmup:
            warm_up(engine, args, most)
        for scenario in args.scenarios:
            adapters = adapter_count(scenario)
            if scenario.startswith("offline"):
                results[scenario] = run_scenario(engine, args, scenario, None, adapters, floor_of)
                # each row as it finishes: a run cut short still says what it measured
                print(json.dumps({scenario: results[scenario]}), flush=True)
                continue
            for r in args.rates:
                offline = results.get(scenario.replace("online", "offline"))
                if r == "auto" and offline is None:
                    raise SystemExit(f"--rates auto needs {scenario.replace('online', 'offline')} "
                                     "earlier in --scenarios")
                rate = 0.8 * offline["req_s"] if r == "auto" else float(r)
                results[f"{scenario}_rate{rate:.0f}"] = run_scenario(
                    engine, args, scenario, rate, adapters, floor_of)
            print(table([{"scenario": k, **v} for k, v in results.items()], COLS), flush=True)
    model = args.model
    if not args.no_write:
        for key, res in results.items():
            res["command"] = "bench/serving.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                             vars(args).items() if k != "no_write")
            merge_results(results_path(device), "serving", model, {key: res}, keep=True)
    print(table([{"scenario": k, **v} for k, v in results.items()], COLS))


if __name__ == "__main__":
    main()
