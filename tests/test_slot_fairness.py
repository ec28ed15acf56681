"""Many adapters at saturation: more adapters than slots, more requests than max_num_seqs,
popularity Zipf(1.1), everything queued at once. Every request's greedy tokens equal
transformers + PEFT's for its adapter, and no request waits for its adapter's slot past the
bound docs/DESIGN.md states ("Slots at saturation"): the requests ahead of it start, then
at most one request's run on a draining slot, then its landing. Measured in engine steps
(landings inline: no wall clock in play)."""

from __future__ import annotations

import math
import random

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.scheduler import MIN_PROMPT_TOKENS_BESIDE_DECODES
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

N_ADAPTERS, SLOTS, REQUESTS = 10, 3, 70
MAX_PROMPT, MAX_TOKENS = 40, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fairness")
    base = make_model("llama", seed=6)
    save_model(base, root / "model")
    peft = {f"a{i}": make_adapter(base, root / f"a{i}", seed=40 + i, r=4, lora_alpha=8,
                                  target_modules="all-linear")
            for i in range(N_ADAPTERS + 1)}  # a{N_ADAPTERS}: asked for once
    return root, base, peft


def _workload(seed: int = 3):
    rng = random.Random(seed)
    weights = [1 / (r + 1) ** 1.1 for r in range(N_ADAPTERS)]
    work = []
    for i in range(REQUESTS):
        adapter = f"a{rng.choices(range(N_ADAPTERS), weights)[0]}" if rng.random() < 0.8 else None
        if i == REQUESTS // 2:
            adapter = f"a{N_ADAPTERS}"  # never popular: one request, mid-queue
        work.append(([rng.randrange(1, 250) for _ in range(rng.randint(3, MAX_PROMPT))],
                     rng.randint(2, MAX_TOKENS), adapter))
    return work


def test_every_request_gets_its_adapter_within_the_bound(setup):
    root, base, peft = setup
    llm = LLM(root / "model", max_loras=SLOTS, max_lora_rank=4, block_size=4, max_model_len=96,
              num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=32,
              async_promotions=False)
    engine = llm.engine
    for name in peft:
        engine.register_adapter(name, root / name)
    work = _workload()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), a)
           for p, n, a in work]
    seqs = [engine.requests[i] for i in ids]
    bound_at, started_at, finished, step = {}, {}, {}, 0
    was_bound = [s.bound for s in seqs]
    while engine.has_unfinished_requests():
        outs = engine.step()
        step += 1
        for i, seq in enumerate(seqs):
            if seq.bound and not was_bound[i]:
                bound_at[i] = step  # its last binding: the one it ran on
            was_bound[i] = seq.bound
            if seq.scheduled_at is not None:
                started_at.setdefault(i, step)
        for out in outs:
            if out.finished:
                finished[out.request_id] = out
        assert step < 20 * REQUESTS * MAX_TOKENS, "the engine stopped making progress"
    assert engine.adapters.num_drains > 0 and engine.adapters.num_unbound > 0  # contention

    # one request's run: its prompt in chunks of at least the floor beside decodes, then
    # its tokens; plus a step to be admitted and one for the token in flight
    run = math.ceil(MAX_PROMPT / MIN_PROMPT_TOKENS_BESIDE_DECODES) + MAX_TOKENS + 2
    landing = 1  # inline: the step boundary after its slot frees
    for i, (_, _, adapter) in enumerate(work):
        if adapter is None or i not in bound_at:
            continue  # bound at arrival, never given back
        ahead = max((started_at[j] for j in range(i)), default=0)
        assert bound_at[i] <= ahead + run + landing, (i, adapter, bound_at[i], ahead)

    for (prompt, n, adapter), rid in zip(work, ids):
        want, _ = hf_greedy(peft[adapter] if adapter else base, prompt, n)
        assert list(finished[rid].token_ids) == want, (rid, adapter)
    rare = ids[REQUESTS // 2]
    assert finished[rare].finish_reason == "length"
