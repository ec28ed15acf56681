"""Tensor-parallel test hooks, run inside the spawned workers (picklable: module level)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def poison_rank1_on_flag(flag: str, rank: int) -> None:
    """tp_worker_init: on rank 1, a landing that starts while `flag` exists gets a NaN in
    its slice (the flag is consumed): a bad slice on one rank only, for the landing's own
    finite check to refuse."""
    torch.set_num_threads(1)
    if rank != 1:
        return
    from metrale.pool.landing import Landing

    original = Landing.write_slice

    def write_slice(self, data, tables):
        if os.path.exists(flag):
            Path(flag).unlink()
            data = data.clone()
            data[0] = float("nan")
        return original(self, data, tables)

    Landing.write_slice = write_slice
