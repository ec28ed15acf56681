"""The ground truth for the engine's tokens: transformers (+ PEFT) greedy decoding of
tiny_models' models, and the check that an engine output equals it."""

from __future__ import annotations

import random

import torch


def hf_greedy(model, prompt: list[int], n: int = 10) -> tuple[list[int], torch.Tensor]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)  # [n, V]
    return out.sequences[0, len(prompt):].tolist(), logprobs


def check(out, ref_tokens, ref_logprobs):
    """`out` (a finished engine output with logprobs) has hf_greedy's tokens and logprobs."""
    assert out.token_ids == ref_tokens
    got = torch.tensor([lp["logprob"] for lp in out.logprobs])
    want = ref_logprobs[torch.arange(len(ref_tokens)), torch.tensor(ref_tokens)]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def prompts(seed: int, n: int, shared_prefix: int = 0) -> list[list[int]]:
    """n random token-id prompts (3-19 tokens after `shared_prefix` common ones) for the tiny vocab."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, 250) for _ in range(rng.randrange(3, 20))] for _ in range(n)]
