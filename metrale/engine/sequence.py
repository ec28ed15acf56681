"""A request as the scheduler sees it: tokens, KV blocks, adapter binding."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from metrale.engine.detokenizer import DetokenizerState
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.sequence_sampling import SequenceSampling


class SeqStatus(Enum):
    WAITING = auto()  # needs (re)prefill
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # tokens sampled by a launched step the host has not seen yet (async scheduling): they
    # count in len(seq); the next step reads the newest from row `pending_row` of its draws
    num_pending: int = 0
    pending_row: int = -1
    max_len: int = 1 << 62  # prompt + max_tokens, within the engine's limit: it stops here
    # adapter binding: held from the moment the adapter is resident until finish/abort
    slot: int = -1  # -1 = base model
    adapter_uid: int = 0  # 0 = base model; part of every prefix-cache key
    bound: bool = False
    bound_at: float | None = None  # when its adapter was resident and bound (monotonic)
    # since when it waits for its adapter's slot: its arrival, or when a draining slot's
    # queue gave it back (the promotion timeout counts from here)
    slot_wait_from: float | None = None
    scheduled_at: float | None = None  # when it was first admitted to run (monotonic)
    # KV
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes | None] = field(default_factory=list)  # prefix-cache key per block
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last prefill
    num_computed: int = 0  # tokens whose KV is in the cache (the scheduler advances it)
    num_published: int = 0  # leading full blocks findable in the prefix cache
    # output
    text: str = ""  # what was streamed: detok.text less what a stop string may still cut
    detok: DetokenizerState = field(default_factory=DetokenizerState)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    generator: torch.Generator | None = None
    # token ids the sampler masks while fewer than params.min_tokens were generated (EOS)
    suppress_ids: tuple[int, ...] = ()
    # stop strings are looked for from this text offset on: none may end before min_tokens
    stop_from: int = 0
    # the sampler's state for a request that shapes its logits (grammar, penalties,
    # logit bias); None for a plain request
    sampling: SequenceSampling | None = None
    # completion `index` of its request's n (its siblings share the prompt's KV)
    index: int = 0
    # per prompt position p >= 1: the logprob entry of prompt token p (prompt_logprobs)
    prompt_logprobs: dict[int, dict] = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        """The tokens on the host (not the pending ones)."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list: a step reads a few new
        tokens of what may be a long sequence. A pending token reads as 0: the step that
        takes it as input resolves it on the device."""
        p, known = len(self.prompt_ids), self.known_len
        pad = [0] * (end - known) if end > known else []
        end = min(end, known)
        if end <= p:
            return self.prompt_ids[start:end] + pad
        if start >= p:
            return self.output_ids[start - p:end - p] + pad
        return self.prompt_ids[start:] + self.output_ids[:end - p] + pad

    def __len__(self) -> int:
        """Every token, the pending ones included (what the scheduler plans with)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def known_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
