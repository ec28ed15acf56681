"""n > 1: a request's completions 1..n-1 wait until completion 0 has computed the prompt
and published its KV blocks to the prefix cache, then run on those blocks: the prompt is
computed once (less its last, partial block, which every sequence computes for itself).
Admitted together, each would have computed it: a block is findable only once computed."""

from __future__ import annotations

from metrale.engine.sequence import Sequence

SEPARATOR = "#"


def sibling_id(request_id: str, index: int) -> str:
    """The engine's id of completion `index` (index 0 keeps the request's own id)."""
    return request_id if index == 0 else f"{request_id}{SEPARATOR}{index}"


class SiblingGate:
    def __init__(self) -> None:
        self._held: list[tuple[Sequence, list[Sequence]]] = []

    def hold(self, leader: Sequence, siblings: list[Sequence]) -> None:
        self._held.append((leader, siblings))

    def released(self) -> list[Sequence]:
        """Held sequences whose leader drew its first token (its prompt's full blocks are
        published) or ended; ended siblings (aborted while held) are dropped."""
        if not self._held:
            return []
        out, keep = [], []
        for leader, siblings in self._held:
            if leader.output_ids or leader.is_finished:
                out += [s for s in siblings if not s.is_finished]
            else:
                keep.append((leader, siblings))
        self._held = keep
        return out

    def __len__(self) -> int:
        return sum(len(s) for _, s in self._held)
