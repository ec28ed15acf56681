"""Pending input tokens (async scheduling): a step may be launched before the host has
seen the tokens the step still running samples. Such a token is its sequence's last
input; the step reads it on the device, from the in-flight step's sampled tokens, in
order behind that step on the same stream."""

from __future__ import annotations

import torch

from metrale.engine.sequence import Sequence


def pending_inputs(seqs: list[Sequence], cu: list[int]) -> tuple[list[int], list[int]]:
    """(token rows, rows of the in-flight step's tokens) of the step's input tokens still
    on the device: a pending token is always its sequence's last input (cu: the token
    rows' prefix sums, one entry more than seqs)."""
    rows, src = [], []
    for i, seq in enumerate(seqs):
        if seq.num_pending:
            rows.append(cu[i + 1] - 1)
            src.append(seq.pending_row)
    return rows, src


def resolve_pending(ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor,
                    in_flight: torch.Tensor | None) -> None:
    """ids[rows] = in_flight[src], queued on the device (ids: [T], rows/src: [P])."""
    if in_flight is None:
        raise RuntimeError("a step has pending input tokens but no step is in flight")
    ids.index_copy_(0, rows, in_flight.index_select(0, src))
