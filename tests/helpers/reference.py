"""The ground truth for the engine's tokens: transformers (+ PEFT) greedy decoding of
tiny_models' models, and the check that an engine output equals it."""

from __future__ import annotations

import random
import weakref

import torch

# hf_greedy's answers per model object, for the run: tests parametrized over engine options
# (sync/async scheduling, graph modes) ask the same model the same prompt again. Weak keys:
# a model's answers go with it, and a new model never sees an old one's.
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt: list[int], n: int = 10,
              ignore_eos: bool = False) -> tuple[list[int], torch.Tensor]:
    """transformers' (+ PEFT's) greedy tokens after prompt and their log-probabilities [n, V];
    computed once per (model, active adapter, prompt, n) in a run. A test that changes a
    model's weights in place makes a new model object (or a copy) for the new answers.
    ignore_eos: n tokens whatever they are (the engine's SamplingParams(ignore_eos=True));
    else generation stops at the model's EOS, as the engine's does by default."""
    key = (getattr(model, "active_adapter", None), tuple(prompt), n, ignore_eos)
    known = _GREEDY.setdefault(model, {})
    if key not in known:
        stop = {"eos_token_id": None} if ignore_eos else {}
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             **stop)
        logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)  # [n, V]
        known[key] = (out.sequences[0, len(prompt):].tolist(), logprobs)
    tokens, logprobs = known[key]
    return list(tokens), logprobs.clone()


def check(out, ref_tokens, ref_logprobs):
    """`out` (a finished engine output with logprobs) has hf_greedy's tokens and logprobs."""
    assert out.token_ids == ref_tokens
    got = torch.tensor([lp["logprob"] for lp in out.logprobs])
    want = ref_logprobs[torch.arange(len(ref_tokens)), torch.tensor(ref_tokens)]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def assert_greedy_close(tokens, logprobs, ref_tokens, ref_lp, tol, label):
    """Compare greedy decodes made under different rounding: token by token until the
    first divergence, which is only allowed at a near tie of the reference (its logprob
    of our token within tol of its own choice). Returns the number of equal tokens."""
    for i, (t, r) in enumerate(zip(tokens, ref_tokens)):
        if t != r:
            gap = (ref_lp[i, r] - ref_lp[i, t]).item()
            assert gap < tol, f"{label}: token {i} is {t}, reference {r} (logprob gap {gap:.3f})"
            return i
        assert abs(logprobs[i] - ref_lp[i, r].item()) < tol, f"{label}: logprob {i}"
    return len(tokens)


def prompts(seed: int, n: int, shared_prefix: int = 0) -> list[list[int]]:
    """n random token-id prompts (3-19 tokens after `shared_prefix` common ones) for the tiny vocab."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, 250) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def assert_mixed_batch_matches(model_dir, base, adapters: dict, prompt_list: list[list[int]],
                               n: int, tie_gap: float = 0.0, static_graphs: bool = False,
                               min_compared: float = 0.75, **llm_kw):
    """An LLM on model_dir, with `adapters` ({name: (PEFT model, its directory)})
    registered, serves every prompt with the base and with each adapter, all in one
    batch, with greedy tokens equal to transformers + PEFT's. tie_gap: a sequence is
    compared up to the first step where the reference's top two log-probabilities are
    closer than that (a tie either side may break), and min_compared of all tokens must be
    compared. static_graphs: steps through the CUDA graphs' static buffers, run eagerly
    (the graph path off the GPU). Returns the LLM."""
    from metrale import LLM, SamplingParams  # metrale: after conftest's triton switch

    kw = dict(max_loras=max(1, len(adapters)), max_lora_rank=4, max_model_len=64, block_size=4,
              num_kv_blocks=64)
    llm = LLM(model_dir, **{**kw, **llm_kw})
    if static_graphs:
        llm.engine.runner.enable_graphs(capture=False)
    for name, (_, path) in adapters.items():
        llm.register_adapter(name, path)
    requests = [(p, a) for p in prompt_list for a in (None, *adapters)]
    outs = llm.generate([p for p, _ in requests],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                        [a for _, a in requests])
    compared = 0
    for (prompt, adapter), out in zip(requests, outs):
        want, logprobs = hf_greedy(adapters[adapter][0] if adapter else base, prompt, n)
        top2 = logprobs.topk(2, dim=-1).values  # [n, 2]
        ties = ((top2[:, 0] - top2[:, 1]) < tie_gap).nonzero().flatten().tolist()
        upto = ties[0] if ties else n
        assert list(out.token_ids)[:upto] == want[:upto], (prompt, adapter)
        compared += upto
    assert compared >= min_compared * n * len(requests), f"only {compared} tokens outside ties"
    return llm


def assert_slot_swaps_match(llm, adapters: dict, order: list[str], seed: int, n: int,
                            slot: int = 0) -> None:
    """Each adapter of `order` ({name: (PEFT model, its directory)}) swapped into `slot` in
    turn, under a new name each time, then serving two prompts: greedy tokens equal its
    PEFT model's (what a slot held before leaves nothing behind)."""
    from metrale import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for i, name in enumerate(order):
        llm.engine.swap_lora_slot_from_disk(adapters[name][1], f"s{i}", slot)
        for p in prompts(seed + i, 2):
            out = llm.generate([p], params, f"s{i}")[0]
            assert list(out.token_ids) == hf_greedy(adapters[name][0], p, n)[0], name
