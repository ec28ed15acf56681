"""vLLM's prompt_logprobs: for every prompt token after the first, its logprob given the
tokens before it, its rank, and the top-k. They need the logits of every prompt position,
which a step computes only for the last one: a prefill chunk of such a sequence runs
eagerly and its hidden states go through the head here. Its prompt never reads KV from
the prefix cache (block_manager: those positions would never be computed); a preempted
sequence computes the same entries again, stored by position."""

from __future__ import annotations

import torch

from metrale.engine.sequence import Sequence


def wants_prompt_logprobs(seq: Sequence, num_new: int) -> bool:
    """Whether this step's tokens of seq include prompt positions whose successor's
    logprob is still to be recorded."""
    return seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids) - 1 \
        and num_new > 0


def record(model, hidden: torch.Tensor, seqs: list[Sequence], num_new: list[int],
           cu: list[int]) -> None:
    """hidden: [T, H] of the step's tokens (cu: each sequence's first row). Entries go to
    seq.prompt_logprobs[p] for the prompt positions p this step predicts (a host sync:
    only steps holding such a sequence pay it)."""
    for i, (seq, n) in enumerate(zip(seqs, num_new)):
        if not wants_prompt_logprobs(seq, n):
            continue
        start = seq.num_computed  # the chunk's first position: it predicts position start + 1
        last = min(start + n, len(seq.prompt_ids) - 1)  # predictions of prompt tokens only
        rows = torch.arange(cu[i], cu[i] + last - start, device=hidden.device)  # [R]
        lp = torch.log_softmax(model.compute_logits(hidden[rows], rows), dim=-1)  # [R, V]
        lp = lp.clamp(min=torch.finfo(lp.dtype).min)  # -inf (a masked token) must serialise
        targets = torch.tensor(seq.prompt_ids[start + 1:last + 1], device=hidden.device)  # [R]
        chosen = lp.gather(1, targets[:, None])  # [R, 1]
        ranks = (lp > chosen).sum(-1) + 1  # [R]
        k = seq.params.prompt_logprobs
        top = torch.topk(lp, k, dim=-1) if k else None
        chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
        top_ids = top.indices.tolist() if top is not None else [[] for _ in chosen]
        top_lps = top.values.tolist() if top is not None else [[] for _ in chosen]
        for r, p in enumerate(range(start + 1, last + 1)):
            seq.prompt_logprobs[p] = {"token": seq.prompt_ids[p], "logprob": chosen[r],
                                      "rank": ranks[r], "top": list(zip(top_ids[r], top_lps[r]))}
