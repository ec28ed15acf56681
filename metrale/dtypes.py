"""torch dtypes from the dtype names metrale.config validates (config stays torch-free)."""

from __future__ import annotations

import torch

from metrale.config import dtype_name


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name or alias (float32/fp32, bfloat16/bf16, float16/fp16/half);
    raises ConfigError for anything else."""
    return getattr(torch, dtype_name(value))
