"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from metrale.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
    """logits: [B, V] float32 -> one token per sequence (+ logprobs where asked)."""
    greedy = logits.argmax(dim=-1)  # [B]
    tokens = greedy.tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature  # [V]
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            probs = probs.scatter(0, order[drop], 0.0)
        gen = seq.generator
        if gen is None and p.seed is not None:
            gen = seq.generator = torch.Generator(device=logits.device).manual_seed(p.seed)
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
    logprobs: list[dict | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(logits[wanted], dim=-1)  # [W, V]
        for row, i in enumerate(wanted):
            k = seqs[i].params.logprobs
            top = torch.topk(lp[row], k) if k else None
            logprobs[i] = {
                "token": tokens[i], "logprob": float(lp[row, tokens[i]]),
                "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
            }
    return tokens, logprobs
