"""The output head's product, logits = hidden @ W.T, with a faster CPU path for a few rows.

On the CPU, F.linear of a few rows against a tall head ([vocab, hidden]) goes through
MKL's gemv / small-M GEMM path, which here neither streams the weight at full speed nor
uses the second core; the same product computed as W @ hidden.T (the head as the GEMM's
left operand) was, on the 2-core dev box with the default model's 49152 x 576 head,
2 threads: 1 row 6.6 -> 2.3 ms (a 2-row GEMM beats the gemv), 2 rows 13.0 -> 2.4 ms,
8 rows 11.3 -> 6.0 ms, 16 rows 13.2 -> 11.0 ms, and no faster from ~32 rows (16.5 vs 15.3).
The head is 16-20% of a CPU decode step of that model, so this is its largest single
cost after the decoder's matmuls. The products are the same, summed in another order.
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
