"""A total deadline for one peer operation: every socket read and every NIXL
poll takes its timeout from what is left, so a peer that trickles bytes cannot
stretch an operation past its budget."""

from __future__ import annotations

import time

from metrale.peer.errors import PeerTimeoutError


class Deadline:
    def __init__(self, total_s: float) -> None:
        if not total_s > 0:
            raise ValueError(f"timeout must be positive, got {total_s}")
        self.total_s = float(total_s)
        self._end = time.monotonic() + self.total_s

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def timeout(self, what: str, cap_s: float | None = None) -> float:
        """Seconds a single blocking call may take now; raises once the budget is spent."""
        left = self.remaining()
        if left <= 0:
            raise PeerTimeoutError(f"{what}: no reply within the {self.total_s:.1f}s peer timeout")
        return min(left, cap_s) if cap_s is not None else left

    def shorten_to(self, seconds: float) -> None:
        """Never run past `seconds` from now (e.g. the peer granted a shorter lease)."""
        self._end = min(self._end, time.monotonic() + seconds)
