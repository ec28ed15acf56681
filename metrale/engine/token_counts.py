"""Per-sequence token counts on the device, for the penalties: how often each sequence
generated each token, and which tokens its prompt holds. One row per penalised sequence
in one table, so that a step gathers its rows and counts its drawn tokens with one
kernel each, however many sequences it holds; allocated on the first penalised request,
grown by doubling. A row is updated on the device right after its token is drawn, so
the next step (queued behind it) sees it without the host knowing the token yet. Every
operation runs in inference mode: the table is made during a step (the first penalised
row's first draw), and inference tensors may be updated only in inference mode."""

from __future__ import annotations

import torch

from metrale.engine.uploads import upload

FIRST_ROWS = 8


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.generated: torch.Tensor | None = None  # [rows, V] int32
        self.in_prompt: torch.Tensor | None = None  # [rows, V] bool
        self._free: list[int] = []
        self.rows_in_use = 0

    @torch.inference_mode()
    def acquire(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A row counting output_ids, with prompt_ids marked (queued on the device)."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.rows_in_use += 1
        self.generated[row].zero_()
        self.in_prompt[row].zero_()
        dev = self.device
        self.in_prompt[row, upload(prompt_ids, torch.int64, dev)] = True
        if output_ids:
            ids = upload(output_ids, torch.int64, dev)
            self.generated[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row

    def release(self, row: int) -> None:
        self._free.append(row)
        self.rows_in_use -= 1

    @torch.inference_mode()
    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [N] int64 -> (generated counts [N, V] int32, in the prompt [N, V] bool)."""
        return self.generated.index_select(0, rows), self.in_prompt.index_select(0, rows)

    @torch.inference_mode()
    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """generated[rows[i], tokens[i]] += 1 (rows, tokens: [N] int64 on the device)."""
        self.generated.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32),
                                  accumulate=True)

    def _grow(self) -> None:
        old = 0 if self.generated is None else self.generated.shape[0]
        rows = max(FIRST_ROWS, 2 * old)
        generated = torch.zeros((rows, self.vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        if old:
            generated[:old] = self.generated
            in_prompt[:old] = self.in_prompt
        self.generated, self.in_prompt = generated, in_prompt
        self._free.extend(range(rows - 1, old - 1, -1))
