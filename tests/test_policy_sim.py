"""bench/policy_sim.py: its simulated device against the H100 step traces it was
calibrated on (bench/serving.py --trace-dir, 2026-12-07), and a run that serves every
request of a small workload whole under each policy."""

from __future__ import annotations

import pytest

from bench import policy_sim as sim
from metrale.config import SchedulerConfig
from metrale.engine.step_cost import StepShape, chunk_pairs


def test_the_simulated_steps_take_the_times_the_h100_traces_measured():
    # decode-only, batch 256 at ~600 keys each: 13.5-16.6 ms measured (median over the run)
    decode = StepShape(tokens=256, decode_keys=256 * 600, decodes=256)
    assert 12e-3 < sim.step_seconds(decode) < 17e-3
    # ~700 prompt tokens (2 chunks) beside 250 decodes: 39 ms median measured
    pairs = 2 * chunk_pairs(350, 0)
    mixed = StepShape(tokens=950, decode_keys=250 * 600, prompt_pairs=pairs, prompt_tokens=700,
                      decodes=250)
    assert 30e-3 < sim.step_seconds(mixed) < 45e-3
    # a prefill-only step of 8,192 tokens: 195 ms measured
    prefill = StepShape(tokens=8192, prompt_pairs=16 * chunk_pairs(512, 0), prompt_tokens=8192)
    assert sim.step_seconds(prefill) == pytest.approx(0.195, rel=0.1)


@pytest.mark.parametrize("policy", [SchedulerConfig(), SchedulerConfig(step_time_ratio=None)],
                         ids=["default", "budget_only"])
def test_every_request_is_served_whole(policy):
    lengths = sim.workload(40, seed=3)
    arrivals = [0.05 * i for i in range(len(lengths))]
    wall, run = sim.simulate(policy, arrivals, lengths, max_num_seqs=8, budget=1024, kv_blocks=2000)
    assert [len(run.times[f"r{i}"]) for i in range(len(lengths))] == [n for _, n in lengths]
    assert all(run.times[f"r{i}"][0] > arrivals[i] for i in range(len(lengths)))
    assert wall >= max(ts[-1] for ts in run.times.values())
