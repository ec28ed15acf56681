"""Tensor-parallel test hooks, run inside the spawned workers (picklable: module level)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from metrale.model.parallel import MULTICAST_OFF
from metrale.pool.landing import Landing


def worker_hooks(flag: str, env_file: str, rank: int) -> None:
    """tp_worker_init: rank 1 writes the NVLink multicast settings it runs with to
    env_file, and a landing that starts while `flag` exists gets a NaN in its slice (the
    flag is consumed): a bad slice on one rank only, for the landing's own finite check to
    refuse."""
    torch.set_num_threads(1)
    if rank != 1:
        return
    Path(env_file).write_text(json.dumps({k: os.environ.get(k) for k in MULTICAST_OFF}))
    original = Landing.write_slice

    def write_slice(self, data, tables):
        if os.path.exists(flag):
            Path(flag).unlink()
            data = data.clone()
            data[0] = float("nan")
        return original(self, data, tables)

    Landing.write_slice = write_slice
