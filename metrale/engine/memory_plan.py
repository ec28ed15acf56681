"""One memory rule at start-up for the adapter slots and the KV cache (docs/DESIGN.md,
"Memory"). Their budget: on CUDA 80% of the device memory free after the weights; on the
CPU half the available memory, and at most half the weights' bytes (at least 64 MiB). A
CPU step is bound by memory traffic: with live KV at most half the weights, attention stays
under a third of a step's traffic, while a worst-case cache (2.9 GB for the 135M default)
went unused.

- Under tensor parallelism a slot is the rank's slice of one, and rank 0's landing area (a
  whole slot per landing open at once, pool/landing_area.py) is set aside first.
- Slots (unless --max-loras): SLOT_SHARE of the budget in whole slots, at least
  MIN_AUTO_SLOTS and at most max_num_seqs (a step serves no more adapters than rows; the
  host tier, not the device, is the cache past that) unless that is fewer.
- KV blocks (unless --num-kv-blocks): room for max_num_seqs sequences of max_model_len
  tokens within what the slots leave, never under one max_model_len sequence.
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
# Slots' share of the budget: an 8B model's r16 all-linear slot is 84 MB, so an H100 (62 GB
# free after the weights) holds ~59 of them beside a 45 GB KV cache, an H200 ~116.
SLOT_SHARE = 0.1
MIN_AUTO_SLOTS = 4


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    reason: str  # which bound decided, for the start-up log


def auto_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int,
                   budget_bytes: int, bound: str) -> KVBudget:
    """budget_bytes: what the KV cache may take (`bound` names what set it)."""
    per_seq = -(-max_model_len // block_size)
    wanted = max_num_seqs * per_seq
    by_memory = budget_bytes // block_bytes
    if wanted <= by_memory:
        return KVBudget(wanted, f"{max_num_seqs} sequences x {max_model_len} tokens")
    if by_memory < per_seq:
        return KVBudget(per_seq, f"one {max_model_len}-token sequence ({bound} is less)")
    return KVBudget(by_memory, f"capped by the rest of the budget ({bound})")


@dataclass(frozen=True)
class MemoryPlan:
    num_slots: int
    slot_bytes: int  # one slot's (this rank's slice of one under tensor parallelism)
    kv_blocks: int
    block_bytes: int  # one KV block's (K and V, every layer)
    budget_bytes: int
    reason: str  # which bounds decided, for the start-up line
    area_bytes: int = 0  # rank 0's landing area under tensor parallelism

    def describe(self) -> str:
        gib = 1 << 30
        area = f" + a {self.area_bytes / gib:.2f} GiB landing area" if self.area_bytes else ""
        slots, kv = self.num_slots * self.slot_bytes / gib, self.kv_blocks * self.block_bytes / gib
        return (f"memory: {self.num_slots} adapter slots ({slots:.2f} GiB{area}), KV cache "
                f"{self.kv_blocks} blocks ({kv:.2f} GiB), of a {self.budget_bytes / gib:.2f} GiB "
                f"budget: {self.reason}")


def memory_budget(free_bytes: int, weight_bytes: int, cuda: bool) -> tuple[int, str]:
    """(bytes the slots and the KV cache may take, which bound decided)."""
    caps = ({"80% of free device memory": GPU_FREE_FRACTION * free_bytes} if cuda else
            {"half the available memory": CPU_AVAILABLE_FRACTION * free_bytes,
             "half the weights' bytes": max(CPU_KV_PER_WEIGHT_BYTE * weight_bytes,
                                            CPU_KV_MIN_BYTES)})
    bound, cap = min(caps.items(), key=lambda item: item[1])
    return int(cap), bound


def plan_memory(max_loras: int | None, slot_bytes: int, num_kv_blocks: int | None,
                max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int,
                weight_bytes: int, free_bytes: int, cuda: bool, area_bytes: int = 0) -> MemoryPlan:
    """free_bytes: free device (CUDA) or available host memory, after the weights;
    area_bytes: set aside before the slots and the KV cache (a TP rank 0's landing area)."""
    budget, bound = memory_budget(free_bytes, weight_bytes, cuda)
    room = max(budget - area_bytes, 0)  # for the slots and the KV cache
    reasons = []
    slots = max_loras
    if slots is None:
        by_share = int(SLOT_SHARE * room) // max(slot_bytes, 1)
        most = max(max_num_seqs, MIN_AUTO_SLOTS)
        slots = min(max(by_share, MIN_AUTO_SLOTS), most)
        reasons.append(f"slots {SLOT_SHARE:.0%} of it, at least {MIN_AUTO_SLOTS} and at most {most}")
    kv = num_kv_blocks
    if kv is None:
        left = max(room - slots * slot_bytes, 0)
        kv_budget = auto_kv_blocks(max_num_seqs, max_model_len, block_size, block_bytes, left,
                                   bound)
        kv = kv_budget.num_blocks
        reasons.append(f"KV {kv_budget.reason}")
    return MemoryPlan(slots, slot_bytes, kv, block_bytes, budget,
                      f"{bound}; " + "; ".join(reasons) if reasons else bound, area_bytes)


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
