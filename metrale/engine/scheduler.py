"""Continuous batching: each step is either a prefill of newly admitted
sequences or a decode of every running one. When KV blocks run out, the most
recently admitted sequence is preempted (its KV freed, recomputed later) so
the rest always make progress."""

from __future__ import annotations

from collections import deque

from metrale.config import EngineConfig
from metrale.engine.block_manager import BlockManager
from metrale.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager) -> None:
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        batch, tokens = [], 0
        for seq in list(self.waiting):
            if not seq.bound:
                continue  # its adapter is still being promoted; others go ahead
            if len(self.running) + len(batch) >= self.cfg.max_num_seqs:
                break
            if tokens + len(seq) > self.cfg.max_num_batched_tokens and batch:
                break
            if not self.blocks.can_allocate(seq):
                break  # FIFO: a later, smaller request must not starve this one
            self.blocks.allocate(seq)
            seq.num_computed = seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.waiting.remove(seq)
            batch.append(seq)
            tokens += len(seq) - seq.num_cached_tokens
        if batch:
            self.running.extend(batch)
            return batch, True

        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
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
