"""Reusable staging memory for landings: pinned host bytes for file reads and
a device byte buffer they are copied into in one transfer.

Both grow to the largest adapter seen and are then reused, so a steady stream
of promotions allocates nothing.
"""

from __future__ import annotations

import torch


def _grow(n: int) -> int:
    return max(1 << 20, 1 << (n - 1).bit_length())


class StagingBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Pinned host memory only helps (and only exists) with a CUDA device.
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._dev = torch.empty(0, dtype=torch.uint8, device=device)

    def host(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of at least nbytes (pinned when a GPU is used)."""
        if self._host.numel() < nbytes:
            self._host = torch.empty(_grow(nbytes), dtype=torch.uint8, pin_memory=self._pin)
        return self._host[:nbytes]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Move staged bytes to the device in one copy (the same tensor on a CPU engine)."""
        if self.device.type == "cpu":
            return host
        n = host.numel()
        if self._dev.numel() < n:
            self._dev = torch.empty(_grow(n), dtype=torch.uint8, device=self.device)
        dev = self._dev[:n]
        dev.copy_(host, non_blocking=self._pin)
        return dev
