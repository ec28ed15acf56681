"""head_logits: the output head's product on the CPU's small-batch path equals F.linear
(another summation order: equal within float tolerance) at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.ops.head import CPU_SMALL_ROWS, head_logits


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, CPU_SMALL_ROWS, CPU_SMALL_ROWS + 1, 40])
def test_head_logits_equal_linear(rows, dtype, tol):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 64, generator=g).to(dtype)  # [V, H]
    hidden = torch.randn(rows, 64, generator=g).to(dtype)  # [N, H]
    got = head_logits(hidden, weight)
    assert got.shape == (rows, 1000) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), F.linear(hidden, weight).float(), rtol=tol, atol=tol)


def test_head_logits_of_a_non_contiguous_hidden():
    weight = torch.randn(300, 32)
    hidden = torch.randn(32, 5).t()  # [5, 32], strided
    torch.testing.assert_close(head_logits(hidden, weight), F.linear(hidden, weight))
