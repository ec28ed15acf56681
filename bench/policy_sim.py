"""The step policy on a simulated device: the engine's own Scheduler (its cost model learning
from the simulated step times, its admission, its KV blocks) driven by the saturation
issue's workloads, each step taking the time a roofline model of one GPU gives it. For
choosing between policies where device time is short; a simulation, not a measurement:
BENCHMARKS.md says which figures came from here.

    PYTHONPATH=. python bench/policy_sim.py [--rate 19] [--seconds 120]

The device (Llama-3-8B bf16 on an H100, calibrated against the step traces of the H100
run of 2026-12-07, `bench/serving.py --trace-dir`): a step costs its decodes' bytes (the
weights once and every decode row's K/V at the measured copy bandwidth), then its prompt
chunks' work (the traces' 22 us a token and the attention pairs at the measured matmul
peak), plus a launch overhead, and eager (mixed) steps EAGER_S more than a graph replay. Scenarios, as in
bench/serving.py: offline (600 requests at t=0), the same with the token budget alone,
and online (Poisson arrivals at --rate for --seconds) under each policy.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from bench.common import pct
from metrale.config import EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Sequence
from metrale.engine.step_cost import StepShape

WEIGHTS_B = 16.06e9  # Llama-3-8B bf16
KV_B_PER_KEY = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16
PROMPT_S_PER_TOKEN = 22e-6  # a prompt token's linear layers (traces' fit; 18 us at the peak)
FLOPS_PER_PAIR = 4 * 32 * 128 * 32  # QK and PV of one (query, key) pair, every layer
BANDWIDTH = 2.95e12  # copy bandwidth measured on the H100, bytes/s
PEAK = 760e12  # bf16 matmul measured on the H100, FLOP/s
LAUNCH_S = 1.5e-3  # a graph replay's fixed cost beyond its bytes
EAGER_S = 3.0e-3  # an eager mixed step's extra (traces: 19.6 ms intercept vs 16.6 graph)


def step_seconds(shape: StepShape) -> float:
    """The decodes' bytes, then the prompt chunks' FLOPs: on the H100 traces a mixed step
    cost its decodes' time plus ~22 us a prompt token (additive, not overlapped)."""
    memory = (WEIGHTS_B + KV_B_PER_KEY * shape.decode_keys) / BANDWIDTH
    if not shape.prompt_tokens:
        return memory + LAUNCH_S
    prompt = (PROMPT_S_PER_TOKEN * shape.prompt_tokens + FLOPS_PER_PAIR * shape.prompt_pairs / PEAK)
    return (memory if shape.decodes else 0.0) + prompt + LAUNCH_S + EAGER_S


@dataclass
class Run:
    arrival: dict[str, float] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0


def simulate(policy: SchedulerConfig, arrivals: list[float], lengths: list[tuple[int, int]],
             max_num_seqs: int = 256, budget: int = 8192, kv_blocks: int = 20000) -> tuple[float, Run]:
    cfg = EngineConfig(pool=PoolConfig(max_loras=0), max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=2048, scheduler=policy)
    sched = Scheduler(cfg, BlockManager(kv_blocks, 16, prefix_caching=False))
    clock = [0.0]
    sched.clock = lambda: clock[0]
    run, i, seqs = Run(), 0, {}
    while i < len(arrivals) or seqs:
        while i < len(arrivals) and arrivals[i] <= clock[0]:
            p, n = lengths[i]
            seq = Sequence(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=n), None,
                           max_len=p + n)
            seq.arrival, seq.bound = arrivals[i], True
            seqs[seq.request_id] = seq
            run.arrival[seq.request_id] = arrivals[i]
            sched.add(seq)
            i += 1
        batch = sched.schedule()
        if not batch:
            clock[0] = arrivals[i]
            continue
        sched.launched(batch)
        seconds = step_seconds(batch.shape)
        clock[0] += seconds
        run.steps += 1
        for seq, sampled in zip(batch.seqs, batch.samples):
            if sampled:
                seq.num_pending -= 1
                seq.output_ids.append(7)
                run.times.setdefault(seq.request_id, []).append(clock[0])
                if len(seq.output_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
                    del seqs[seq.request_id]
        sched.completed(batch)
        sched.observe(batch.shape, seconds)
    return clock[0], run


def summary(wall: float, run: Run, lengths) -> dict:
    ttft = [ts[0] - run.arrival[r] for r, ts in run.times.items()]
    itl = [b - a for ts in run.times.values() for a, b in zip(ts, ts[1:])]
    out = sum(n for _, n in lengths)
    return {"wall_s": round(wall, 2), "out_tok_s": round(out / wall), "steps": run.steps,
            "ttft_p50_s": round(pct(ttft, 50), 2), "ttft_p99_s": round(pct(ttft, 99), 2),
            "itl_p50_ms": round(1e3 * pct(itl, 50), 1), "itl_p99_ms": round(1e3 * pct(itl, 99), 1),
            "itl_p99_over_p50": round(pct(itl, 99) / pct(itl, 50), 2)}


def workload(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(128, 1024), rng.randint(64, 512)) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=None, help="online req/s (default: 80%% of "
                    "the default policy's offline rate)")
    ap.add_argument("--seconds", type=float, default=120.0)
    args = ap.parse_args()
    policies = {"default": SchedulerConfig(), "budget_only": SchedulerConfig(step_time_ratio=None)}
    offline = workload(600, 0)
    rows = {}
    for name, policy in policies.items():
        wall, run = simulate(policy, [0.0] * len(offline), offline)
        rows[f"offline_{name}"] = summary(wall, run, offline)
    rate = args.rate or 0.8 * len(offline) / rows["offline_default"]["wall_s"]
    rng = random.Random(1)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < args.seconds:
        arrivals.append(t)
    online = workload(len(arrivals), 2)
    for name, policy in policies.items():
        wall, run = simulate(policy, arrivals, online)
        rows[f"online_{name}_rate{rate:.0f}"] = summary(wall, run, online)
    cols = ["scenario", *next(iter(rows.values()))]
    print("  ".join(cols))
    for k, v in rows.items():
        print("  ".join([k, *(str(x) for x in v.values())]))


if __name__ == "__main__":
    main()
