from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


class Prefix(Sequence):
    """The first n items of an append-only list, fixed when made: each RequestOutput's
    cumulative token ids and logprobs without copying the list at every token (a step's
    output processing grew with output length: 200 us for 32 rows at 64 tokens, 2.5 ms at
    16k). Reads, compares and pickles like a list of those n items."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None) -> None:
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._items[slice(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[i]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, Prefix)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like a list

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return Prefix, (self._items[:self._n],)


@dataclass
class RequestOutput:
    """What one step produced for one request: cumulative text, ids and logprobs, and deltas."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: Sequence[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: Sequence[dict] = field(default_factory=list)
    adapter: str | None = None
    num_cached_tokens: int = 0
    error: Exception | None = None
    # seconds from arrival until its adapter was resident, and from then until it ran
    adapter_wait_s: float | None = None
    queue_wait_s: float | None = None
    # which of its request's n completions this is (request_id is this completion's own)
    index: int = 0
    # prompt_logprobs: None for the first prompt token, then one entry per prompt token
    # ({"token", "logprob", "top": [(id, logprob)...]}); None when not asked for
    prompt_logprobs: list[dict | None] | None = None
