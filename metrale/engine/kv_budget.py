"""How many KV-cache blocks an engine allocates when --num-kv-blocks is not given: room for
max_num_seqs sequences of max_model_len tokens, capped on CUDA at 80% of the free device
memory, on the CPU at half the available memory and half the weights' bytes (at least
64 MiB), never under one max_model_len sequence (docs/DESIGN.md). A CPU step is bound by
memory traffic: with live KV at most half the weights, attention stays under a third of
a step's traffic, while a worst-case cache (2.9 GB for the 135M default) went unused.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("metrale.engine")

GPU_FREE_FRACTION = 0.8
CPU_AVAILABLE_FRACTION = 0.5
CPU_KV_PER_WEIGHT_BYTE = 0.5
CPU_KV_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    reason: str  # which bound decided, for the start-up log


def auto_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int,
                   weight_bytes: int, free_bytes: int, cuda: bool) -> KVBudget:
    """free_bytes: free device (CUDA) or available host memory, after weights and pool."""
    per_seq = -(-max_model_len // block_size)
    wanted = max_num_seqs * per_seq
    caps = ({"80% of free device memory": GPU_FREE_FRACTION * free_bytes} if cuda else
            {"half the available memory": CPU_AVAILABLE_FRACTION * free_bytes,
             "half the weights' bytes": max(CPU_KV_PER_WEIGHT_BYTE * weight_bytes,
                                            CPU_KV_MIN_BYTES)})
    bound, cap = min(caps.items(), key=lambda item: item[1])
    by_memory = int(cap) // block_bytes
    if wanted <= by_memory:
        return KVBudget(wanted, f"{max_num_seqs} sequences x {max_model_len} tokens")
    if by_memory < per_seq:
        return KVBudget(per_seq, f"one {max_model_len}-token sequence ({bound} is less)")
    return KVBudget(by_memory, f"capped at {bound}")


def host_available_bytes() -> int:
    """Memory this process can still take: MemAvailable, or less under a cgroup limit."""
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """cgroup v2's memory.max minus memory.current, when a limit is set."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((root / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None
