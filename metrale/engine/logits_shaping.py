"""A step's logits as its requests shape them before a token is drawn, on the device, one
batched pass for all rows: the grammar's mask, EOS suppression below min_tokens, the
logit bias, then the repetition, frequency and presence penalties (vLLM's order). Rows of
plain requests are left as they are; a batch with none to shape is returned unchanged,
uncopied (a CUDA graph's output buffer must stay as it is anyway).
"""

from __future__ import annotations

import torch

from metrale.engine.grammar import GrammarMatcher, allowed_tokens, new_bitmask
from metrale.engine.sequence import Sequence
from metrale.engine.uploads import upload

NEG_INF = float("-inf")


class GrammarStateError(RuntimeError):
    """A matcher is behind its sequence's tokens: the mask would be for another position."""


def shaped_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose logits are shaped this step: the one scan a plain batch pays."""
    return [i for i, s in enumerate(seqs) if s.sampling is not None
            or (s.suppress_ids and s.num_generated < s.params.min_tokens)]


def shape_logits(logits: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> torch.Tensor:
    """logits [B, V] float32 -> logits, or a shaped copy (shaped: shaped_rows(seqs)). Each
    grammar row's matcher must have accepted every token of its sequence (the caller
    defers the draw until then)."""
    if not shaped:
        return logits
    x = logits.clone()
    _mask_grammar(x, seqs, shaped)
    _suppress(x, seqs, shaped)
    _bias(x, seqs, shaped)
    _penalise(x, seqs, shaped)
    return x


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return upload(rows, torch.int64, x.device)


def _mask_grammar(x: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> None:
    rows = [i for i in shaped if seqs[i].sampling is not None
            and seqs[i].sampling.grammar is not None and not seqs[i].is_finished]
    if not rows:
        return
    vocab = x.shape[1]
    host = new_bitmask(len(rows), vocab, pin=x.is_cuda)  # [R, words], all allowed
    matchers, filled = [], []
    for r, i in enumerate(rows):
        seq = seqs[i]
        matcher = seq.sampling.grammar
        if matcher.num_accepted != len(seq.output_ids):
            raise GrammarStateError(
                f"request {seq.request_id}: its grammar has seen {matcher.num_accepted} of "
                f"{len(seq.output_ids)} tokens")
        if not matcher.is_terminated:  # terminated: the sequence ends with this step
            matchers.append(matcher)
            filled.append(r)
    if matchers:
        GrammarMatcher.fill_rows(matchers, host, filled)
    allowed = allowed_tokens(host.to(x.device, non_blocking=True), vocab)  # [R, V]
    idx = _rows(x, rows)
    x[idx] = x[idx].masked_fill(~allowed, NEG_INF)


def _suppress(x: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> None:
    """-inf on each sequence's suppress_ids (EOS) while it is below min_tokens, so that
    neither greedy nor sampled decoding can end it early."""
    rows, cols = [], []
    for i in shaped:
        seq = seqs[i]
        if seq.suppress_ids and seq.num_generated < seq.params.min_tokens:
            rows += [i] * len(seq.suppress_ids)
            cols += seq.suppress_ids
    if rows:
        x[_rows(x, rows), _rows(x, cols)] = NEG_INF


def _bias(x: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> None:
    rows, cols, values = [], [], []
    for i in shaped:
        state = seqs[i].sampling
        if state is not None and state.bias_ids:
            rows += [i] * len(state.bias_ids)
            cols += state.bias_ids
            values += state.bias_values
    if rows:
        x.index_put_((_rows(x, rows), _rows(x, cols)),
                     upload(values, x.dtype, x.device), accumulate=True)


def _penalise(x: torch.Tensor, seqs: list[Sequence], shaped: list[int]) -> None:
    # a row released meanwhile (its request ended while a deferred draw waited) is skipped
    rows = [i for i in shaped if seqs[i].sampling is not None and seqs[i].sampling.penalised]
    if not rows:
        return
    table = seqs[rows[0]].sampling.counts  # one table per engine
    counts_rows = [seqs[i].sampling.row(seqs[i].prompt_ids, seqs[i].output_ids) for i in rows]
    generated, in_prompt = table.gather(_rows(x, counts_rows))
    params = [seqs[i].params for i in rows]
    dev, dt = x.device, x.dtype
    rep = upload([p.repetition_penalty for p in params], dt, dev)[:, None]
    freq = upload([p.frequency_penalty for p in params], dt, dev)[:, None]
    pres = upload([p.presence_penalty for p in params], dt, dev)[:, None]
    idx = _rows(x, rows)
    y = x[idx]  # [P, V]
    appeared = generated > 0
    # HF's and vLLM's repetition penalty: over prompt and generated tokens, dividing a
    # positive logit and multiplying a negative one (both move it away from being drawn)
    seen = appeared | in_prompt
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    # OpenAI's: over generated tokens only
    y = y - freq * generated.to(dt) - pres * appeared.to(dt)
    x[idx] = y
