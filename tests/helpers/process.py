"""Waiting for a process a test started (a server, a peer store) to be ready.

The wait ends on the process's own signal (a line it prints, /health answering), at
once when the process exits (reported with its exit code and the tail of its log), or
at a bound only a hung process reaches. The bound grows with the load seen while
waiting: on a shared 2-core box running other jobs, a start-up that takes 4 s idle
can take minutes, and that is not a hang.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

# A tiny-model server is ready in ~4 s on an idle 2-core box: 180 s idle is a bound for
# a hung process, not a timing assumption.
BOUND_S = 180.0
# A load of 4x the cores stretches the bound 4x; past MAX_STRETCH the box is too busy
# for the tests to mean anything, and a hang must still end.
MAX_STRETCH = 8.0
POLL_S = 0.1  # how often readiness is probed (each wait returns early if the process exits)
TAIL_LINES = 60


class ProcessStartError(RuntimeError):
    """A process a test started died, or was not ready within its bound."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode  # None: it was still running at the bound (then stopped)


def load_per_core() -> float:
    """The 1-minute load average per core (0 where the platform has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def load_stretch() -> float:
    """How much longer than on an idle machine a wait may take now: the load per core,
    at least 1, at most MAX_STRETCH."""
    return min(max(1.0, load_per_core()), MAX_STRETCH)


class Bound:
    """A wait's bound: base_s on an idle machine, stretched by the highest load seen
    while waiting (so it only ever grows)."""

    def __init__(self, base_s: float = BOUND_S) -> None:
        self.base_s, self.stretch = base_s, 1.0
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        self.stretch = max(self.stretch, load_stretch())
        return self.elapsed() > self.base_s * self.stretch

    def describe(self) -> str:
        return (f"{self.elapsed():.1f} s (the bound: {self.base_s:.0f} s on an idle machine, "
                f"stretched x{self.stretch:.1f} by the highest load per core seen; the load "
                f"per core is {load_per_core():.1f} now on {os.cpu_count()} cores)")


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Terminate (then kill) proc and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=30)


def exited(name: str, proc: subprocess.Popen, waited_for: str, bound: Bound,
           log: str) -> ProcessStartError:
    return ProcessStartError(
        f"{name} exited with exit code {proc.returncode} after {bound.elapsed():.1f} s, while "
        f"waiting for {waited_for}; the last lines of its output:\n{tail(log)}", proc.returncode)


def timed_out(name: str, proc: subprocess.Popen, waited_for: str, bound: Bound,
              log: str) -> ProcessStartError:
    """Stops proc: a process nobody waits for any more must not outlive the test."""
    stop(proc)
    return ProcessStartError(
        f"{name} (still running, now stopped) was not ready: waited {bound.describe()} for "
        f"{waited_for}; the last lines of its output:\n{tail(log)}", None)


def wait_ready(proc: subprocess.Popen, name: str, waited_for: str, ready: Callable[[], bool],
               log: Callable[[], str], base_s: float = BOUND_S) -> None:
    """Until ready() holds; ProcessStartError at once if proc exits, or at the bound
    (proc then stopped). log() gives the process's output so far, for the error."""
    bound = Bound(base_s)
    while not ready():
        if proc.poll() is not None:
            raise exited(name, proc, waited_for, bound, log())
        if bound.expired():
            raise timed_out(name, proc, waited_for, bound, log())
        try:  # the pause between probes ends the moment the process exits
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
