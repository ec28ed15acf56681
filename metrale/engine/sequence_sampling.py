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
    counts_row: int = -1
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()

    def release(self) -> None:
        """Give the counts row back (the sequence ended); idempotent."""
        if self.counts is not None and self.counts_row >= 0:
            self.counts.release(self.counts_row)
            self.counts_row = -1
