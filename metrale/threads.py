"""How many CPU threads torch uses, chosen on purpose rather than left to its default.

torch's default is one intra-op thread per core. On a machine whose cores are busy with
other work those threads wait on each other at every parallel region, and a step gets
many times slower (a shared 2-core box: 10-20x). So metrale takes the cores that are free
now: the cores this process may run on minus those busy in a short sample of /proc/stat
(the load average where there is none: it lags a minute), at least one.

Overrides, first match wins:
- METRALE_NUM_THREADS=N  exactly N threads;
- OMP_NUM_THREADS=N      torch already honours it; metrale leaves it alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from metrale.errors import MetraleError

THREADS_ENV = "METRALE_NUM_THREADS"


class BadThreadCountError(MetraleError):
    """METRALE_NUM_THREADS is not a positive integer."""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None  # None: leave torch's own setting (OMP_NUM_THREADS is set)
    reason: str


def choose_threads(env: dict[str, str] | None = None, cores: int | None = None,
                   busy: float | None = None) -> ThreadChoice:
    """The thread count for this process; arguments default to the real environment."""
    env = dict(os.environ) if env is None else env
    raw = env.get(THREADS_ENV)
    if raw is not None and raw.strip():
        try:
            n = int(raw)
        except ValueError:
            raise BadThreadCountError(f"{THREADS_ENV}={raw!r} is not an integer") from None
        if n < 1:
            raise BadThreadCountError(f"{THREADS_ENV}={raw!r} must be >= 1")
        return ThreadChoice(n, f"{THREADS_ENV}={n}")
    if env.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    cores = _usable_cores() if cores is None else cores
    busy = _busy_cores(cores) if busy is None else busy
    free = max(1, min(cores, round(cores - busy)))
    return ThreadChoice(free, f"{free} of {cores} cores free ({busy:.1f} busy); {THREADS_ENV} overrides")


def apply_threads(choice: ThreadChoice | None = None) -> ThreadChoice:
    """Set torch's intra-op thread count per `choice` (default: choose_threads())."""
    import torch

    choice = choose_threads() if choice is None else choice
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    return choice


def _busy_cores(cores: int, window_s: float = 0.3) -> float:
    """Cores' worth of CPU time others used during `window_s` (Linux /proc/stat)."""
    import time

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    first = sample()
    if first is None:
        return os.getloadavg()[0]
    time.sleep(window_s)
    second = sample()
    total, idle = second[0] - first[0], second[1] - first[1]
    if total <= 0:
        return 0.0
    # /proc/stat counts every core of the machine; scale to the ones we may use.
    machine = os.cpu_count() or cores
    return min(cores, (1 - idle / total) * machine)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
