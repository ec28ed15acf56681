"""What the sampler keeps beside one sequence whose request shapes its logits: its
grammar matcher, its row of token counts (penalties) and its logit bias. Sequences of
plain requests hold none (Sequence.sampling is None), so a batch of them pays nothing."""

from __future__ import annotations

from dataclasses import dataclass

from metrale.engine.grammar import GrammarMatcher
from metrale.engine.token_counts import TokenCounts


@dataclass
class SequenceSampling:
    grammar: GrammarMatcher | None = None
    counts: TokenCounts | None = None  # the table holding this sequence's row, if penalised
    counts_row: int = -1  # taken at its first draw: only running sequences hold rows
    released: bool = False  # the sequence ended: its row (if any) went back
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()

    @property
    def penalised(self) -> bool:
        """Whether the sampler penalises this row now (not once its sequence ended)."""
        return self.counts is not None and not self.released

    def row(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """Its counts row, taken now if it has none: a queued request holds no memory."""
        if self.counts_row < 0:
            self.counts_row = self.counts.acquire(prompt_ids, output_ids)
        return self.counts_row

    def release(self) -> None:
        """Give the counts row back (the sequence ended); idempotent."""
        self.released = True
        if self.counts is not None and self.counts_row >= 0:
            self.counts.release(self.counts_row)
            self.counts_row = -1
