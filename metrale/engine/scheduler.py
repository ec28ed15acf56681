"""Continuous batching with a token budget per step: decodes first, then the next chunks
of prompts being prefilled, then newly admitted prompts, so no decode waits behind a long
prefill (docs/DESIGN.md, "Scheduling"). A step that decodes takes prompt tokens until its
time, as the step cost model predicts it, reaches step_time_ratio times its decodes' own,
unless the queued prompts would then not all be prefilled within prompt_drain_s of their
arrival. Only
requests whose adapter is bound run; adapters take turns so one hot adapter cannot fill
every step. When KV blocks run out the newest sequence is preempted (recomputed later) so
the rest always make progress.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from metrale.config import EngineConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.sequence import SeqStatus, Sequence
from metrale.engine.step_cost import (
    EXTRAPOLATION,
    FIRST_PROMPT_TOKENS,
    StepCost,
    StepShape,
    chunk_pairs,
)

# A prompt chunk capped by SchedulerConfig.max_prefill_attention still takes this many
# tokens a step, so a long prompt keeps advancing however long its context.
MIN_ATTENTION_CHUNK = 16
# Prompt tokens a step with decodes always takes, however many decodes it runs and
# whatever the step time target says, so prompts keep advancing.
MIN_PROMPT_TOKENS_BESIDE_DECODES = 32


class Allowance:
    """What prompt chunks may still take this step: tokens, and predicted seconds (inf:
    the tokens alone bound them); the first `floor` tokens are never refused for time."""

    def __init__(self, tokens: int, seconds: float = math.inf, cost: StepCost | None = None,
                 floor: int = 0) -> None:
        self.tokens, self.seconds, self.cost, self.floor = tokens, seconds, cost, floor

    def fit(self, n: int, context: int) -> int:
        """The most of n tokens after `context` cached ones this allowance takes."""
        n = min(n, self.tokens)
        if self.seconds < math.inf:
            n = min(n, max(self.cost.max_chunk(self.seconds, context), self.floor))
        return max(n, 0)

    def take(self, n: int, context: int) -> None:
        self.tokens -= n
        self.floor = max(self.floor - n, 0)
        if self.seconds < math.inf:
            self.seconds -= self.cost.prompt_seconds(n, context)


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes its next num_new[i] tokens; one whose tokens are
    then all computed samples its next token."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # fixed when scheduled
    num_decodes: int = 0  # rows [0, num_decodes) decode; the rest are prompt chunks
    shape: StepShape = field(default_factory=StepShape)  # its cost features, once composed

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
        self.cost = StepCost()
        self.clock = time.monotonic  # the clock of Sequence.arrival (tests simulate it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        self._schedule_running(batch, Allowance(budget), decodes=True)
        batch.num_decodes = len(batch)
        allowance = self._prompt_allowance(batch, budget - len(batch))
        self._schedule_running(batch, allowance, decodes=False)
        self._admit(batch, allowance)
        batch.shape = self._shape(batch)
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

    def _schedule_running(self, batch: ScheduledBatch, allowance: Allowance, decodes: bool) -> None:
        """The running decodes (one token each, always within the budget: it is >=
        max_num_seqs) or partial prefills, in admission order."""
        for seq in list(self.running):
            if (len(seq) - seq.num_computed > 1) == decodes:
                continue
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below, for an older sequence's decode
            if seq.num_pending and len(seq) >= seq.max_len:
                continue  # its token in flight ends it (length): no step past it
            n = self._chunk(seq, allowance)
            if n == 0:
                continue
            if not self._make_room(seq):
                continue
            self._add(batch, seq, n, allowance)

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int, allowance: Allowance) -> None:
        allowance.take(n, seq.num_computed)
        batch.add(seq, n)

    def _prompt_allowance(self, batch: ScheduledBatch, budget: int) -> Allowance:
        """What the prompt chunks of a step with batch's decodes may take."""
        if not batch.num_decodes:
            return Allowance(budget)
        floor = MIN_PROMPT_TOKENS_BESIDE_DECODES
        cap = self.sched.max_tokens_beside_decodes
        if cap is not None:
            budget = min(budget, max(cap - batch.num_decodes, floor))
        ratio, cost = self.sched.step_time_ratio, self.cost
        if ratio is None:
            return Allowance(budget)
        if not cost.ready or not cost.max_prompt_beside_decodes:
            return Allowance(min(budget, FIRST_PROMPT_TOKENS))  # measure before predicting
        decode_s = cost.seconds(self._shape(batch))
        seconds = max((ratio - 1) * decode_s, self._drain_seconds(decode_s))
        if seconds < math.inf:
            budget = min(budget, int(EXTRAPOLATION * cost.max_prompt_beside_decodes))
        return Allowance(max(budget, 0), seconds, cost, floor=min(floor, budget))

    def _drain_seconds(self, decode_s: float) -> float:
        """The prompt time per step (beside decode_s of decodes) that prefills every runnable
        queued prompt within prompt_drain_s of its arrival; inf when none does (the step
        then takes the token budget), as for a prompt that has waited that long already.
        Prompts are taken in queue order (each deque is in arrival order): the share of
        the device the prompt work needs is its most demanding prefix's work over the time
        to that prefix's last deadline."""
        limit, cost, now = self.sched.prompt_drain_s, self.cost, self.clock()
        queued = share = 0.0
        for seq in itertools.chain(self.running, self.waiting):
            left = len(seq) - seq.num_computed
            if left > 1 and seq.bound:
                queued += cost.prompt_seconds(left, seq.num_computed)
                time_left = seq.arrival + limit - now
                if queued >= time_left:
                    return math.inf
                share = max(share, queued / time_left)
        return share * decode_s / (1 - share)

    @staticmethod
    def _shape(batch: ScheduledBatch) -> StepShape:
        """batch's cost features (before launched() advances num_computed)."""
        d = batch.num_decodes
        keys = sum(s.num_computed + 1 for s in batch.seqs[:d])
        pairs = sum(chunk_pairs(n, s.num_computed) for s, n in zip(batch.seqs[d:], batch.num_new[d:]))
        tokens = batch.num_tokens
        return StepShape(tokens, keys, pairs, tokens - d, d)

    def _chunk(self, seq: Sequence, allowance: Allowance) -> int:
        """seq's tokens this step: what is left, within the allowance and the chunk caps."""
        n = min(len(seq) - seq.num_computed, self.max_chunk)
        n = allowance.fit(n, seq.num_computed)
        cap = self.sched.max_prefill_attention
        if cap is None or n <= MIN_ATTENTION_CHUNK:
            return n
        c = seq.num_computed  # keys already cached: n queries attend to <= c + n each
        fit = int((math.sqrt(c * c + 4 * cap) - c) / 2)  # the largest n with n * (c + n) <= cap
        return min(n, max(fit, MIN_ATTENTION_CHUNK))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A launched step's measured time (the cost model learns from it)."""
        self.cost.observe(shape, seconds)

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

    def _admit(self, batch: ScheduledBatch, allowance: Allowance) -> None:
        for seq in self._admission_order(self.clock()):
            if len(self.running) >= self.cfg.max_num_seqs:
                return
            if not self.blocks.can_allocate(seq):
                return  # no later request takes the blocks this one waits for
            # its first chunk, were it admitted (a cached prefix would only shorten it)
            if allowance.fit(len(seq), 0) == 0:
                return
            self._start(seq)
            n = self._chunk(seq, allowance)
            if n == 0:  # its prefix is cached up to where the allowance ends
                return
            self._add(batch, seq, n, allowance)

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
            seq.scheduled_at = self.clock()
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
