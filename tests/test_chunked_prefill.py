"""Chunked prefill mixed with decodes: prompts are prefilled over several steps while
other sequences decode in the same steps, with mixed adapters and prefix-cache hits,
and every request still gets exactly what transformers + PEFT give it alone."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.config import SchedulerConfig
from metrale.engine.scheduler import MIN_ATTENTION_CHUNK, MIN_PROMPT_TOKENS_BESIDE_DECODES
from tests.helpers.engine import step_until
from tests.helpers.reference import check, hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = make_model(arch, seed=3)
    save_model(base, root / "model")
    peft = {
        "a": make_adapter(base, root / "a", seed=10, r=8, lora_alpha=16, target_modules="all-linear"),
        "b": make_adapter(base, root / "b", seed=11, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "down_proj"]),
    }
    return root, base, peft


def _llm(root, chunk: int) -> LLM:
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=256, max_num_seqs=6, max_num_batched_tokens=64,
              scheduler=SchedulerConfig(max_prefill_chunk=chunk))
    for slot, name in enumerate("ab"):  # resident from the start: no landing timing in play
        llm.register_adapter(name, root / name)
        llm.engine.swap_lora_slot_from_disk(root / name, name, slot)
    return llm


def _record_steps(llm: LLM) -> list[tuple[list[int], list[bool]]]:
    """(tokens per sequence, sampled per sequence) of every step the runner runs."""
    steps, run = [], llm.engine.runner.run

    def recording(batch, *args):
        steps.append((list(batch.num_new), list(batch.samples)))
        return run(batch, *args)

    llm.engine.runner.run = recording
    return steps


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_peft(setup, chunk):
    root, base, peft = setup
    llm = _llm(root, chunk)
    ps = prompts(21, 5, shared_prefix=13)
    warm = llm.generate(ps[:1], GREEDY, ["a"])[0]  # puts a's prefix blocks in the cache
    check(warm, *hf_greedy(peft["a"], ps[0]))
    steps = _record_steps(llm)
    long_prompt = prompts(22, 1)[0] * 3  # several chunks at every chunk size but 64
    batch = [ps[1], ps[2], long_prompt, ps[3], ps[4]]
    names = ["a", None, "b", "b", "a"]
    outs = llm.generate(batch, GREEDY, names)
    for p, out, name in zip(batch, outs, names):
        check(out, *hf_greedy(base if name is None else peft[name], p))
    # the shared prefix's 12 tokens (3 whole blocks) came from the cache, under a only
    assert outs[0].num_cached_tokens == 12 and outs[4].num_cached_tokens == 12
    assert outs[1].num_cached_tokens == outs[2].num_cached_tokens == 0
    # what makes this chunked: prompts split over steps, and steps mixing a prompt's
    # chunk with other sequences' decodes
    assert all(max(n) <= chunk for n, _ in steps)
    mixed = [s for s in steps if any(n == 1 and smp for n, smp in zip(*s))
             and any(not smp for smp in s[1])]
    if chunk < 64:
        assert mixed, steps


def test_a_long_prompt_never_stalls_running_decodes(setup):
    """While a prompt of many chunks prefills, every step still decodes the others."""
    root, base, peft = setup
    llm = _llm(root, 4)
    short = prompts(23, 2)
    ids = [llm.engine.add_request(p, GREEDY, a) for p, a in zip(short, ["a", None])]
    seqs = [llm.engine.requests[i] for i in ids]
    step_until(llm.engine, lambda: all(s.output_ids for s in seqs))
    left = [GREEDY.max_tokens - len(s.output_ids) for s in seqs]
    steps = _record_steps(llm)
    rng = random.Random(24)
    long_prompt = [rng.randrange(1, 250) for _ in range(48)]  # 12 chunks of 4
    out = llm.generate([long_prompt], GREEDY, ["a"])[0]  # resident: no promotion to wait for
    check(out, *hf_greedy(peft["a"], long_prompt))
    # each of the long prompt's chunks ran beside the decodes of the short ones still
    # going, not before them
    assert max(left) < 12
    for i, (num_new, samples) in enumerate(steps[:11]):
        decodes = sum(1 for k in left if i < k)
        assert sorted(zip(num_new, samples)) == [(1, True)] * decodes + [(4, False)]


@pytest.mark.parametrize("cap", [40, 4])
def test_steps_with_decodes_take_prompt_tokens_up_to_the_cap(setup, cap):
    """max_tokens_beside_decodes: a step that decodes takes prompt tokens up to the cap in
    all (never under MIN_PROMPT_TOKENS_BESIDE_DECODES); a step without decodes takes the
    whole budget; the tokens are still those of transformers + PEFT."""
    root, base, peft = setup
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=256, max_num_seqs=6, max_num_batched_tokens=128,
              scheduler=SchedulerConfig(max_tokens_beside_decodes=cap))
    llm.register_adapter("a", root / "a")
    llm.engine.swap_lora_slot_from_disk(root / "a", "a", 0)
    long_steps = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short = prompts(26, 2)
    ids = [llm.engine.add_request(p, long_steps, a) for p, a in zip(short, ["a", None])]
    seqs = [llm.engine.requests[i] for i in ids]
    step_until(llm.engine, lambda: all(s.output_ids for s in seqs))
    steps = _record_steps(llm)
    rng = random.Random(27)
    long_prompt = [rng.randrange(1, 250) for _ in range(110)]
    out = llm.generate([long_prompt], GREEDY, ["a"])[0]
    check(out, *hf_greedy(peft["a"], long_prompt))
    prompt_steps = [(sum(n for n, smp in zip(*st) if smp and n == 1),
                     sum(n for n, smp in zip(*st) if not (smp and n == 1))) for st in steps]
    prompt_steps = [(d, p) for d, p in prompt_steps if p]
    assert sum(p for _, p in prompt_steps) >= len(long_prompt) - 1
    for decodes, prompt_tokens in prompt_steps:
        if decodes:
            assert prompt_tokens <= max(cap - decodes, MIN_PROMPT_TOKENS_BESIDE_DECODES)
    assert any(d for d, _ in prompt_steps)  # the cap was in play
    alone = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
                num_kv_blocks=256, max_num_seqs=6, max_num_batched_tokens=64,
                scheduler=SchedulerConfig(max_tokens_beside_decodes=cap))
    steps = _record_steps(alone)
    alone.generate([long_prompt], GREEDY, [None])
    assert steps[0][0] == [64]  # no decodes: the whole budget


def test_a_sequence_hands_out_any_span_of_its_tokens():
    """Sequence.tokens(start, end) is token_ids[start:end] across the prompt/output seam."""
    from metrale.engine.sequence import Sequence

    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(), None)
    seq.output_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert seq.tokens(start, end) == seq.token_ids[start:end], (start, end)


def test_attention_capped_chunks_shrink_with_context_and_match_peft(setup):
    """max_prefill_attention: a long prompt's chunks get smaller as its context grows
    (n * (context + n) within the cap, never under MIN_ATTENTION_CHUNK), and the tokens are
    still those of transformers + PEFT."""
    root, base, peft = setup
    cap = 24 * 40
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=256, max_num_seqs=6, max_num_batched_tokens=64,
              scheduler=SchedulerConfig(max_prefill_attention=cap))
    llm.register_adapter("a", root / "a")
    llm.engine.swap_lora_slot_from_disk(root / "a", "a", 0)
    steps = _record_steps(llm)
    rng = random.Random(25)
    long_prompt = [rng.randrange(1, 250) for _ in range(100)]
    out = llm.generate([long_prompt], GREEDY, ["a"])[0]
    check(out, *hf_greedy(peft["a"], long_prompt))
    chunks, context = [], 0
    for num_new, _ in steps:
        if context >= len(long_prompt):
            break
        n = num_new[0]
        left = len(long_prompt) - context
        assert n * (context + n) <= cap or n == min(MIN_ATTENTION_CHUNK, left), (context, n)
        chunks.append(n)
        context += n
    assert sum(chunks) == len(long_prompt) and chunks == sorted(chunks, reverse=True)
    assert chunks[0] > MIN_ATTENTION_CHUNK and chunks[-2] == MIN_ATTENTION_CHUNK, chunks
