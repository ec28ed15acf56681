"""Pending input tokens (async scheduling): a step launched before the host has seen the
tokens of the step still running reads them on the device, behind it on the same stream."""

from __future__ import annotations

import torch

from metrale.engine.sequence import Sequence


def pending_inputs(seqs: list[Sequence], cu: list[int]) -> tuple[list[int], list[int]]:
    """(token rows, rows of the in-flight step's tokens) of the inputs still on the device:
    a pending token is always its sequence's last input (cu: the token rows' prefix sums)."""
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
