"""What the weight-only GEMMs (fp8_linear, int4_linear) share: their tile config, the SM
count, and split K. A decode-sized GEMM (a few tokens) has too few output tiles to put every
SM on the weight stream, so K is split over SPLIT_K programs per tile; each stores its
float32 partial, and the last to finish (a per-tile counter, reset by that same program so
that the next launch and a CUDA graph replay find it at 0) sums them. One launch, no
memset, graph-safe. Each call site owns its counters (tile_counters), so GEMMs on two
streams never share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.ops.triton_utils import device_function, tl

_SMS: dict[torch.device, int] = {}


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # compute y^T = W x^T


def tile_counters(n: int, device: torch.device) -> torch.Tensor:
    """The int32 zeros a GEMM of N = n output columns needs for its split-K tiles."""
    return torch.zeros(4 * -(-n // 16), dtype=torch.int32, device=device)


def num_sms(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
    return _SMS[device]


@device_function
def finish_split(acc, ws_ptr, cnt_ptr, mn, tile_ok, tile, pid_k, M, N, SPLIT_K: tl.constexpr):
    """(acc, last): this program's partial stored at ws[pid_k] (mn: the tile's offsets in
    [M, N]); the last program of the tile gets the sum of all SPLIT_K partials."""
    tl.store(ws_ptr + pid_k * M * N + mn, acc, mask=tile_ok)
    tl.debug_barrier()  # every thread's partial is written before the count says so
    last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = tl.zeros(acc.shape, dtype=tl.float32)
        for p in range(SPLIT_K):  # ".cg": the other SMs' partials, not a stale L1 line
            acc += tl.load(ws_ptr + p * M * N + mn, mask=tile_ok, other=0.0,
                           cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (and graph replay)
    return acc, last
