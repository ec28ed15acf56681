"""The churn run of bench/churn.py in virtual time: the engine's real scheduler, adapter
manager, slot table and landings (a tiny model on the CPU), with the forward pass
replaced by a step-time model fitted to the H200's measured steps. It answers "what does
this admission/promotion policy do to TTFT at this load" in seconds on a laptop; the
H200 run of bench/churn.py is the measurement. The "legacy_promote" row (the scheduler
policy before chunked prefill) left with that policy; BENCHMARKS.md keeps its figures.

    PYTHONPATH=. python bench/churn_sim.py [--rate 150] [--seconds 8] [--slots 8]

Step-time model (ms, Llama-3.2-1B shape on one H200, bench/results/20261201-h200.json):
decode-only steps 2.2 + 0.004 per sequence, other steps 2.2 + 0.009 per token, +0.25
with LoRA tokens. Landings from the host tier cost their real (CPU) time, scaled to the
measured 0.74 ms.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.churn import trace
from bench.common import adapter_dir, build_pair, make_peft, pct, table
from metrale.config import EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampler import SampledTokens
from metrale.engine.sampling_params import SamplingParams
from metrale.pool.layout import SlotLayout

LANDING_MS = 0.74


class VirtualClock:
    """Stands in for time.monotonic / perf_counter while the simulation runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step_ms(batch) -> float:
    lora = any(s.slot >= 0 for s in batch.seqs)
    if batch.is_decode:
        ms = 2.2 + 0.004 * len(batch)
    else:
        ms = 2.2 + 0.009 * batch.num_tokens
    return ms + (0.25 if lora else 0.0)


def simulate(pair, root: Path, sched: SchedulerConfig, n_adapters: int, slots: int,
             seconds: float, rate: float, gen: int) -> dict:
    slot_bytes = SlotLayout(pair.config, PoolConfig(1, 16), torch.float32).slot_bytes
    cfg = EngineConfig(
        pool=PoolConfig(slots, 16, host_tier_bytes=n_adapters * slot_bytes), device="cpu",
        max_model_len=256, block_size=16, num_kv_blocks=64 * 256 // 16, max_num_seqs=64,
        max_num_batched_tokens=512, enable_prefix_caching=False, async_promotions=False,
        scheduler=sched)
    clock = VirtualClock()
    real_monotonic, real_perf = time.monotonic, time.perf_counter
    time.monotonic = time.perf_counter = clock
    try:
        engine = LLMEngine(pair.model_dir, cfg, model=pair.ours)
        for a in range(n_adapters):
            engine.register_adapter(f"a{a}", adapter_dir(root, a))
            if slots >= n_adapters:  # all resident
                engine.swap_lora_slot_from_disk(adapter_dir(root, a), f"a{a}", a)

        def fake_run(batch, in_flight=None):
            clock.now += step_ms(batch) / 1e3
            n = len(batch.sampling_seqs)  # token 1 for every sampling row, all finite
            return SampledTokens(batch.sampling_seqs, torch.ones(n, dtype=torch.int64),
                                 torch.zeros(n), torch.ones(n, dtype=torch.bool))

        engine.runner.run = fake_run
        params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
        vocab = pair.config.vocab_size
        _replay(engine, clock, trace(n_adapters, 1.0, rate, vocab, seed=1), params)  # warm-up
        landings, drains = engine.adapters.num_promotions, engine.adapters.num_drains
        arrivals = trace(n_adapters, seconds, rate, vocab)
        start, arrived, first, waits = _replay(engine, clock, arrivals, params)
        ttft = [(first[r] - arrived[r]) * 1e3 for r in first]
        adapter_wait = [a * 1e3 for a, _ in waits]
        return {"requests": len(arrivals), "completed": len(ttft),
                "promotions": engine.adapters.num_promotions - landings,
                "slot_drains": engine.adapters.num_drains - drains,
                "ttft_max_ms": max(ttft),
                "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
                "adapter_wait_p99_ms": pct(adapter_wait, 99),
                "queue_wait_p99_ms": pct([q * 1e3 for _, q in waits], 99),
                "waited_for_adapter": sum(a > 0 for a in adapter_wait)}
    finally:
        time.monotonic, time.perf_counter = real_monotonic, real_perf


def _replay(engine, clock, arrivals, params):
    start, i = clock.now, 0
    arrived, first, waits = {}, {}, []
    while i < len(arrivals) or engine.has_unfinished_requests():
        while i < len(arrivals) and start + arrivals[i][0] <= clock.now:
            _, prompt, name = arrivals[i]
            rid = f"r{i}-{start}"
            engine.add_request(prompt, params, adapter=name, request_id=rid)
            seq = engine.requests[rid]
            seq.arrival = arrived[rid] = start + arrivals[i][0]
            if seq.bound:
                seq.bound_at = seq.arrival
            i += 1
        if not engine.has_unfinished_requests():
            clock.now = start + arrivals[i][0]
            continue
        promotions = engine.adapters.num_promotions
        seqs = dict(engine.requests)
        for out in engine.step():
            if out.request_id not in first and out.error is None:
                first[out.request_id] = clock.now
                seq = seqs[out.request_id]
                waits.append((seq.bound_at - seq.arrival, seq.scheduled_at - seq.bound_at))
        clock.now += (engine.adapters.num_promotions - promotions) * LANDING_MS / 1e3
    return start, arrived, first, waits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair("tiny", "cpu", Path(tmp))
        make_peft(pair, 32, Path(tmp) / "adapters")
        rows = []
        for name, slots in (("promote", args.slots), ("resident", 32)):
            res = simulate(pair, Path(tmp) / "adapters", SchedulerConfig(), 32, slots,
                           args.seconds, args.rate, 32)
            rows.append({"mode": name, **res})
        print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
