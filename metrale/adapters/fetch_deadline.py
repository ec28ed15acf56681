"""How long fetching one adapter from a remote store may take: a total deadline for
connecting, headers and bodies together, with a minimum transfer rate. Socket timeouts
alone bound only silence: a store that sends a byte now and then (headers or body) held a
request for as long as it liked (75 s seen). Here every socket operation of a fetch waits
at most until the fetch's deadline (fetch_transport.py reads it), so no phase can outlast
it, however the bytes trickle.

The deadline starts at timeout_s; once a store has announced how many bytes it will send,
they are granted bytes / min_rate more: a large file may take long, but never slower than
min_rate on average. The deadline of the fetch in progress is per thread (fetches run on
their source's own threads), so SDK calls need no parameter for it.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from metrale.config import ConfigError
from metrale.errors import ObjectStoreError, SourceBusyError


class FetchDeadlineError(ObjectStoreError):
    """A fetch ran past its deadline (a stalled or too slow store): cut off, 502."""


@dataclass(frozen=True)
class FetchLimits:
    """timeout_s: connect + headers of a fetch, and the floor of its whole time; min_rate:
    bytes/s below which a body is cut off; workers: downloads in flight per source (more
    wait for one within their deadline, then SourceBusyError; look-ups that find nothing
    to download do not wait)."""

    timeout_s: float = 30.0
    min_rate: float = float(1 << 20)
    workers: int = 4

    def __post_init__(self) -> None:
        for name in ("timeout_s", "min_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"adapter fetch {name} must be a positive number, got {value!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"adapter fetch workers must be an integer >= 1, got {self.workers!r}")


DEFAULT_LIMITS = FetchLimits()


class Deadline:
    """One fetch's deadline (clock: time.monotonic unless a test injects another)."""

    def __init__(self, limits: FetchLimits, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.what, self._clock = limits, what, clock
        self.start = clock()
        self.until = self.start + limits.timeout_s

    def grant(self, nbytes: int) -> None:
        """`nbytes` announced: they may take nbytes / min_rate more."""
        self.until += nbytes / self.limits.min_rate

    def remaining(self) -> float:
        """Seconds left; FetchDeadlineError once none are."""
        left = self.until - self._clock()
        if left <= 0:
            raise self.error()
        return left

    def bound(self, timeout: float | None) -> float:
        """A socket operation's timeout, cut to the time left."""
        left = self.remaining()
        return left if timeout is None else min(timeout, left)

    def expired(self) -> bool:
        return self._clock() >= self.until

    def error(self) -> FetchDeadlineError:
        return FetchDeadlineError(
            f"{self.what}: cut off after {self._clock() - self.start:.1f} s, past its deadline "
            f"({self.limits.timeout_s:g} s, plus 1 s per {self.limits.min_rate:.0f} bytes "
            "announced): the store is stalled or slower than the minimum rate")

    @contextlib.contextmanager
    def slot(self, slots: threading.BoundedSemaphore) -> Iterator[None]:
        """One of a source's download slots (FetchLimits.workers), waited for at most until
        this deadline: SourceBusyError when every slot stayed taken."""
        if not slots.acquire(timeout=self.remaining()):
            raise SourceBusyError(
                f"{self.what}: every one of its store's {self.limits.workers} download slots "
                f"stayed taken for {self._clock() - self.start:.1f} s (slow downloads of other "
                "names); retry later")
        try:
            yield
        finally:
            slots.release()

    @contextlib.contextmanager
    def active(self) -> Iterator[Deadline]:
        """Every socket operation of this thread's fetch transports is bounded by it."""
        outer = getattr(_local, "deadline", None)
        _local.deadline = self
        try:
            yield self
        finally:
            _local.deadline = outer


_local = threading.local()


def current() -> Deadline | None:
    """The deadline of the fetch running on this thread, if any."""
    return getattr(_local, "deadline", None)
