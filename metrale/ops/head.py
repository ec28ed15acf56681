"""logits = hidden @ W.T. On the CPU, F.linear of a few rows against a tall head takes MKL's
gemv path (neither full-speed nor on the second core); W @ hidden.T was 2-3x faster for 1-8
rows on the 2-core dev box with the default model's 49152 x 576 head (1 row 6.6 -> 2.3 ms),
no faster from ~32 rows: the head is 16-20% of that model's CPU decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_SMALL_ROWS = 16  # measured: W @ hidden.T wins up to here, F.linear from ~32 rows


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden: [N, H], weight: [V, H] -> [N, V] in hidden's dtype (contiguous)."""
    n = hidden.shape[0]
    if hidden.device.type != "cpu" or not 0 < n <= CPU_SMALL_ROWS:
        return F.linear(hidden, weight)
    rows = hidden if n > 1 else torch.cat([hidden, hidden])  # [max(n, 2), H]
    return torch.mm(weight, rows.t())[:, :n].t().contiguous()  # [V, n] -> [n, V]
