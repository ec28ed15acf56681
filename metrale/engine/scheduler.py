"""Continuous batching with a token budget per step: decodes first, then the next chunks
of prompts being prefilled, then newly admitted prompts, so no decode waits behind a long
prefill (docs/DESIGN.md, "Scheduling"). Only requests whose adapter is bound run; adapters
take turns so one hot adapter cannot fill every step. When KV blocks run out the newest
sequence is preempted (recomputed later) so the rest always make progress.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from metrale.config import EngineConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.sequence import SeqStatus, Sequence

# A prompt chunk capped by SchedulerConfig.max_prefill_attention still takes this many
# tokens a step, so a long prompt keeps advancing however long its context.
MIN_ATTENTION_CHUNK = 16
# Prompt tokens a step with decodes always takes, however many decodes it runs
# (SchedulerConfig.max_tokens_beside_decodes), so prompts keep advancing.
MIN_PROMPT_TOKENS_BESIDE_DECODES = 32


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes its next num_new[i] tokens; one whose tokens are
    then all computed samples its next token."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # fixed when scheduled

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)
        self.samples.append(seq.num_computed + n == len(seq))

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampling: a CUDA-graph decode step."""
        return all(n == 1 for n in self.num_new) and all(self.samples)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [s for s, sampled in zip(self.seqs, self.samples) if sampled]


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager) -> None:
        self.cfg, self.blocks = cfg, blocks
        self.sched = cfg.scheduler
        self.max_chunk = cfg.scheduler.max_prefill_chunk or cfg.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # KV dropped by preemptions, computed again later
        self.num_launched_tokens = 0  # tokens of every step launched so far (metrics)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.cfg.max_num_batched_tokens, decodes=True)
        budget = self._beside_decodes(batch.num_tokens, budget)
        budget = self._schedule_running(batch, budget, decodes=False)
        self._admit(batch, budget)
        return batch

    def launched(self, batch: ScheduledBatch) -> None:
        """The step is queued on the device: plan the next one as if it had run (they
        share a stream), each sampling sequence one token longer, that token pending."""
        self.num_launched_tokens += batch.num_tokens
        row = 0
        for seq, n, sampled in zip(batch.seqs, batch.num_new, batch.samples):
            seq.num_computed += n
            if sampled:
                seq.num_pending += 1
                seq.pending_row, row = row, row + 1

    def completed(self, batch: ScheduledBatch) -> None:
        """The step's tokens are on the host: the blocks it completed may be published
        (their keys hash those tokens)."""
        for seq in batch.seqs:
            self.blocks.publish(seq)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, decodes: bool) -> int:
        """The running decodes (one token each, always within the budget: it is >=
        max_num_seqs) or partial prefills, in admission order."""
        for seq in list(self.running):
            if (len(seq) - seq.num_computed > 1) == decodes:
                continue
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below, for an older sequence's decode
            if seq.num_pending and len(seq) >= seq.max_len:
                continue  # its token in flight ends it (length): no step past it
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._make_room(seq):
                continue
            batch.add(seq, n)
            budget -= n
        return budget

    def _beside_decodes(self, decodes: int, budget: int) -> int:
        """The prompt tokens a step with `decodes` decodes may take."""
        cap = self.sched.max_tokens_beside_decodes
        if not decodes or cap is None:
            return budget
        return min(budget, max(cap - decodes, MIN_PROMPT_TOKENS_BESIDE_DECODES))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """seq's tokens this step: what is left, within the budget and the chunk caps."""
        n = min(len(seq) - seq.num_computed, budget, self.max_chunk)
        cap = self.sched.max_prefill_attention
        if cap is None or n <= MIN_ATTENTION_CHUNK:
            return n
        c = seq.num_computed  # keys already cached: n queries attend to <= c + n each
        fit = int((math.sqrt(c * c + 4 * cap) - c) / 2)  # the largest n with n * (c + n) <= cap
        return min(n, max(fit, MIN_ATTENTION_CHUNK))

    def _make_room(self, seq: Sequence) -> bool:
        """KV room for seq's newest token, preempting the newest sequences if needed;
        False when seq itself had to go. A victim is never in this step's batch: decodes
        go in admission order, and prefill chunks need no block (admission allocated them)."""
        while not self.blocks.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.append(seq)
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        for seq in self._admission_order(time.monotonic()):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                return
            if not self.blocks.can_allocate(seq):
                return  # no later request takes the blocks this one waits for
            self._start(seq)
            n = self._chunk(seq, budget)
            batch.add(seq, n)
            budget -= n

    def _admission_order(self, now: float) -> Iterator[Sequence]:
        """Runnable waiting requests: the overdue in arrival order, then the others
        round-robin across adapters, each adapter's in arrival order."""
        bound_limit = self.sched.max_admission_wait_s
        # a preempted sequence with a token in flight waits for it: its blocks' keys hash it
        runnable = [s for s in self.waiting if s.bound and not s.num_pending]
        yield from (s for s in runnable if now - s.arrival > bound_limit)
        queues: OrderedDict[str | None, deque[Sequence]] = OrderedDict()
        for s in runnable:
            if now - s.arrival <= bound_limit:
                queues.setdefault(s.adapter, deque()).append(s)
        while queues:
            for adapter in list(queues):
                q = queues[adapter]
                yield q.popleft()
                if not q:
                    del queues[adapter]

    def _start(self, seq: Sequence) -> None:
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        self.blocks.allocate(seq)
        seq.num_computed = seq.num_cached_tokens
        seq.status = SeqStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)

    # --- leaving ----------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.num_recomputed_tokens += seq.num_computed
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop seq wherever it is and free its KV (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free_seq(seq)
        seq.status = SeqStatus.FINISHED
