"""The step policy (engine/scheduler.py, engine/step_cost.py) against a simulated device:
every step "runs" in the time a known linear cost gives it, the scheduler learns that
cost from those times alone, and each step it composes is checked against the rule
computed here from the known cost (not from the scheduler's own model)."""

from __future__ import annotations

import math
import random

import pytest

from metrale.config import EngineConfig, PoolConfig, SchedulerConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.scheduler import MIN_PROMPT_TOKENS_BESIDE_DECODES, Scheduler
from metrale.engine.sequence import Sequence
from metrale.engine.step_cost import FIRST_PROMPT_TOKENS, MIN_STEPS, StepCost, StepShape, chunk_pairs

# seconds: per step, per token, per decode key, per prompt (query, key) pair
TRUE = (2e-3, 20e-6, 40e-9, 3e-9)


def true_seconds(shape: StepShape) -> float:
    a, b, c, d = TRUE
    return a + b * shape.tokens + c * shape.decode_keys + d * shape.prompt_pairs


def test_the_fit_recovers_a_linear_cost_from_noisy_steps():
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(300):
        shape = StepShape(tokens=rng.randint(1, 4096), decode_keys=rng.randint(0, 300_000),
                          prompt_pairs=rng.uniform(0, 2e6))
        cost.observe(shape, true_seconds(shape) * rng.uniform(0.97, 1.03))
    got = cost.coefficients
    for name, want in zip(("token", "decode_key", "prompt_pair"), TRUE[1:]):
        assert got[name] == pytest.approx(want, rel=0.1), name
    for _ in range(50):  # the step constant is a small part: judge it by the predictions
        shape = StepShape(tokens=rng.randint(1, 64), decode_keys=rng.randint(0, 30_000))
        assert cost.seconds(shape) == pytest.approx(true_seconds(shape), rel=0.05)


def test_a_feature_the_window_never_varies_costs_nothing_not_a_negative_time():
    cost = StepCost()
    for b in range(1, 40):  # decode-only steps: no prompt pairs at all
        shape = StepShape(tokens=b, decode_keys=100 * b, decodes=b)
        cost.observe(shape, true_seconds(shape))
    assert all(v >= 0 for v in cost.coefficients.values())
    assert cost.seconds(StepShape(tokens=8, decode_keys=800)) == pytest.approx(
        true_seconds(StepShape(tokens=8, decode_keys=800)), rel=0.02)


def test_times_that_are_not_times_are_ignored():
    cost = StepCost()
    for bad in (0.0, -1.0, math.nan, math.inf):
        cost.observe(StepShape(tokens=1), bad)
    assert cost.num_observed == 0 and not cost.ready


def _scheduler(max_num_seqs=64, budget=2048, **sched) -> Scheduler:
    cfg = EngineConfig(pool=PoolConfig(max_loras=0), max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=8192,
                       scheduler=SchedulerConfig(**sched))
    sched = Scheduler(cfg, BlockManager(20_000, 16, prefix_caching=False))
    sched.clock = SimulatedClock()
    return sched


def _request(i: int, prompt: int, out: int = 10_000) -> Sequence:
    seq = Sequence(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=out), None,
                   max_len=prompt + out)
    seq.bound = True
    return seq


class SimulatedClock:
    """The scheduler's clock: the simulated device's time, advanced by each step's."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _add(sched: Scheduler, seq: Sequence) -> None:
    seq.arrival = sched.clock()  # it arrives now, on the simulated clock
    sched.add(seq)


def _run(sched: Scheduler, steps: int, check=None) -> None:
    """Steps on the simulated device: each batch runs, samples, and reports its time."""
    for _ in range(steps):
        batch = sched.schedule()
        if not batch:
            return
        if check is not None:
            check(batch)
        sched.launched(batch)
        for seq, sampled in zip(batch.seqs, batch.samples):
            if sampled:  # the token arrives (greedy, always token 7)
                seq.num_pending -= 1
                seq.output_ids.append(7)
        sched.completed(batch)
        sched.observe(batch.shape, true_seconds(batch.shape))
        sched.clock.now += true_seconds(batch.shape)


def _decode_only(batch) -> StepShape:
    d = batch.num_decodes
    return StepShape(d, sum(s.num_computed + 1 for s in batch.seqs[:d]), 0, 0, d)


def test_a_long_prompt_beside_decodes_keeps_each_step_within_the_ratio():
    """32 decoders, then an 8k prompt: every step that carries its chunks beside the
    decodes is predicted (and, on this device, runs) within step_time_ratio of the same
    decodes alone, except the first ones, which take at most FIRST_PROMPT_TOKENS while the
    model has not measured a prompt beside decodes, then grow at most 2x a step, and the
    few while it learns to tell the cost of tokens from that of attention."""
    ratio = 1.75
    sched = _scheduler(step_time_ratio=ratio, prompt_drain_s=math.inf)
    for i in range(32):
        _add(sched, _request(i, 64))
    _run(sched, 40)
    assert all(len(s) > 64 for s in sched.running)  # all decoding
    _add(sched, _request(99, 8192, out=1))
    carried = []

    def check(batch):
        prompt = batch.shape.prompt_tokens
        if not prompt or not batch.num_decodes:
            return
        alone = true_seconds(_decode_only(batch))
        carried.append(prompt)
        if len(carried) == 1:
            assert prompt <= FIRST_PROMPT_TOKENS
        else:
            assert prompt <= 2 * max(carried[:-1])
            # while the model has few steps with prompt tokens to tell the token cost from
            # the pair cost it may miss by a little; after that the fit is exact on this
            # device (within rounding of the chunk's last token)
            learning = len(carried) <= 4
            used = true_seconds(batch.shape) / alone
            assert used <= ratio * (1.05 if learning else 1.01) or \
                prompt == MIN_PROMPT_TOKENS_BESIDE_DECODES
            seq, n = batch.seqs[-1], batch.num_new[-1]
            if not learning and seq.num_computed + n < len(seq):  # not its last chunk
                assert used >= 0.97 * ratio  # the target, not less, sets the chunk

    _run(sched, 2000, check)
    assert sum(carried) >= 8192 - 1  # the prompt went through beside the decodes
    # a long context costs more per token: its chunks shrink
    assert carried[-2] < 0.8 * max(carried)


def test_a_deep_queue_takes_the_whole_budget_beside_decodes():
    """prompt_drain_s: when the runnable prompts would take longer than it to prefill at
    the ratio's pace, steps with decodes take the token budget (a saturated server)."""
    sched = _scheduler(max_num_seqs=256, budget=2048, step_time_ratio=1.5, prompt_drain_s=0.05)
    for i in range(MIN_STEPS + 4):
        _add(sched, _request(i, 100))
    _run(sched, MIN_STEPS + 6)
    _add(sched, _request(99, 300))  # the model measures prompt tokens beside decodes
    _run(sched, 6)
    for i in range(200):  # ~100k prompt tokens: ~2 s of prefill on this device
        _add(sched, _request(1000 + i, 500))
    big = []
    _run(sched, 3, lambda b: big.append(b.num_tokens))
    assert big and all(t == 2048 for t in big)


def test_a_short_queue_is_drained_at_the_ratio_pace():
    """With a small queue the drain rule asks for nothing more than the ratio gives."""
    sched = _scheduler(step_time_ratio=1.5, prompt_drain_s=10.0)
    for i in range(16):
        _add(sched, _request(i, 100))
    _run(sched, 30)
    _add(sched, _request(99, 600, out=1))
    seen = []

    def check(batch):
        if batch.shape.prompt_tokens and batch.num_decodes:
            seen.append(true_seconds(batch.shape) / true_seconds(_decode_only(batch)))

    _run(sched, 200, check)
    # the first is the cold start's FIRST_PROMPT_TOKENS, taken before any is measured
    assert len(seen) > 3 and max(seen[1:]) <= 1.5 * 1.01


def test_a_prompt_that_waited_past_the_drain_time_takes_the_whole_budget():
    """The drain rule's deadline counts from each prompt's arrival: a prompt the ratio
    would spread over several steps is prefilled at once when it has already waited
    prompt_drain_s (an offline batch's last prompts; the same prompt fresh is spread)."""
    sizes = {}
    for waited in (0.0, 0.2):
        sched = _scheduler(budget=2048, step_time_ratio=1.5, prompt_drain_s=0.1)
        for i in range(16):
            _add(sched, _request(i, 100))
        _run(sched, 30)
        _add(sched, _request(98, 300, out=1))  # the model measures prompt tokens beside decodes
        _run(sched, 10)
        _add(sched, _request(99, 1500, out=1))
        sched.clock.now += waited  # the step in flight, a pause: nothing else changes
        carried = sizes[waited] = []

        def record(batch, carried=carried):
            if batch.shape.prompt_tokens:
                carried.append(batch.shape.prompt_tokens)

        _run(sched, 200, record)
    assert sum(sizes[0.0]) == sum(sizes[0.2]) == 1500
    assert len(sizes[0.0]) > 3  # fresh: spread at the ratio's pace
    assert sizes[0.2] == [1500]  # overdue: the whole prompt in the next step


def test_no_ratio_is_the_token_budget_alone():
    sched = _scheduler(budget=512, step_time_ratio=None)
    for i in range(4):
        _add(sched, _request(i, 20))
    _run(sched, 3)
    _add(sched, _request(99, 4000, out=1))
    sizes = []
    _run(sched, 2, lambda b: sizes.append(b.num_tokens))
    assert sizes == [512, 512]


@pytest.mark.parametrize("bad", [1.0, 0.5, math.nan])
def test_a_ratio_that_cannot_be_a_target_is_refused(bad):
    from metrale.config import ConfigError

    with pytest.raises(ConfigError, match="step_time_ratio"):
        SchedulerConfig(step_time_ratio=bad)
    with pytest.raises(ConfigError, match="prompt_drain_s"):
        SchedulerConfig(prompt_drain_s=-1.0)


def test_chunk_pairs_counts_causal_pairs():
    # n new tokens after c cached: token j (0-based) sees c + j + 1 keys
    for c in (0, 5, 100):
        for n in (1, 2, 17):
            assert chunk_pairs(n, c) == sum(c + j + 1 for j in range(n))
