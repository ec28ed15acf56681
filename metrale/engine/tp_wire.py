"""The wire between the ranks of a tensor-parallel group (tp_group: rank 0, tp_worker: the
others). Rank 0's commands travel over one pipe per worker: a worker waits for the next one
as long as the engine idles (a collective would time out) and ends when rank 0's process
does (its pipe closes). What a command moves (inputs' tensors, slices, answers) goes over
the process group, whose collectives time out when a rank died."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from metrale.model.parallel import backend_for, disable_multicast

# how long a collective waits for a rank before it fails (a worker that died mid-step);
# a landing or a first step on a loaded host stays far under it
TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(device: torch.device, rank: int, size: int, port: int) -> None:
    """Join the group's one process group (torch.distributed's default: one per process);
    NVLink multicast off before it starts."""
    disable_multicast()
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=TIMEOUT)
