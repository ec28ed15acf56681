"""A saturated offline run at the default scheduler settings: more requests than
max_num_seqs, mixed prompt and output lengths, several adapters and the base mixed,
prompts chunked beside decodes; every request's greedy tokens equal transformers + PEFT's
for its adapter."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.config import SchedulerConfig
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_adapter, saved_tiny_model

ADAPTERS = ("a", "b", "c")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("saturation")
    base = saved_tiny_model(root / "model", seed=5)
    peft = {name: make_adapter(base, root / name, seed=20 + i, r=8, lora_alpha=16,
                               target_modules="all-linear")
            for i, name in enumerate(ADAPTERS)}
    return root, base, peft


def _workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(1, 250) for _ in range(rng.randint(3, 60))], rng.randint(2, 12),
             rng.choice((None, *ADAPTERS))) for _ in range(n)]


def test_a_saturated_run_matches_peft_for_every_request(setup):
    root, base, peft = setup
    # the defaults' policy, with the steps small enough that prompts are chunked beside
    # decodes and the queue outlives max_num_seqs many times over
    assert SchedulerConfig().step_time_ratio is not None
    llm = LLM(root / "model", max_loras=3, max_lora_rank=8, block_size=4, max_model_len=96,
              num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=24)
    for name in ADAPTERS:
        llm.register_adapter(name, root / name)
    work = _workload(30)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append((batch.num_decodes, batch.num_tokens - batch.num_decodes))
        return batch

    llm.engine.scheduler.schedule = recording
    outs = llm.generate([p for p, _, _ in work],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n, _ in work],
                        [a for _, _, a in work])
    assert any(d and p for d, p in steps)  # prompt chunks rode beside decodes
    assert max(len(p) for p, _, _ in work) > 24  # and some prompt took several steps
    for (prompt, n, adapter), out in zip(work, outs):
        want, _ = hf_greedy(peft[adapter] if adapter else base, prompt, n)
        assert list(out.token_ids) == want, (prompt, adapter)
