"""What a step costs, learned from the steps this engine ran. The scheduler composes each
step against it (docs/DESIGN.md, "Scheduling"): a step that decodes takes prompt tokens
until its predicted time reaches SchedulerConfig.step_time_ratio times its decodes' own.

The model is linear in four features of a step (StepShape): a constant (launches, the
weights a small batch reads), its tokens (GEMMs, norms), the keys its decoding rows read
(decode attention), and the (query, key) pairs of its prompt chunks (prefill attention).
It is fitted after every step by least squares over the last WINDOW measured steps (their
normal equations kept up to date: a fit is a 4x4 solve), every coefficient >= 0,
minimising relative errors, and until MIN_STEPS are measured it knows nothing
(StepCost.ready is False).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

WINDOW = 512  # steps the fit remembers: a few seconds of serving
MIN_STEPS = 8  # measured steps before the model is used
# Prompt tokens beside decodes before the model has measured any step that carried prompt
# tokens beside decodes; after that, at most this factor past the most it measured (the
# model extrapolates no further than it has seen: a first long-context chunk is cheap to
# measure, costly to guess).
FIRST_PROMPT_TOKENS = 64
EXTRAPOLATION = 2.0


@dataclass(frozen=True)
class StepShape:
    """A scheduled step's cost features."""

    tokens: int = 0  # new tokens, decodes and prompt chunks
    decode_keys: int = 0  # keys the decoding rows attend to (their context lengths)
    prompt_pairs: float = 0.0  # (query, key) pairs of the prompt chunks' attention
    prompt_tokens: int = 0  # of `tokens`, those of prompt chunks
    decodes: int = 0  # of `tokens`, those of decoding rows

    def vector(self) -> tuple[float, float, float, float]:
        # scaled so that each feature is O(1) on a large GPU step
        return 1.0, self.tokens / 1e3, self.decode_keys / 1e5, self.prompt_pairs / 1e6


def chunk_pairs(n: int, context: int) -> float:
    """(query, key) pairs of n new tokens after `context` cached ones (causal)."""
    return n * (context + (n + 1) / 2)


class StepCost:
    """Least-squares step time in seconds from StepShape; see the module docstring."""

    def __init__(self, window: int = WINDOW) -> None:
        self._rows: deque[np.ndarray] = deque()  # each step's features over its time [4]
        self.window = window
        # the normal equations of the window's rows (sum of x x^T, sum of x; y is 1)
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self._theta = np.zeros(4)
        self._per_unit = (0.0, 0.0, 0.0, 0.0)  # seconds per step, token, decode key, pair
        self.num_observed = 0
        # the most prompt tokens a measured step that also decoded carried
        self.max_prompt_beside_decodes = 0

    @property
    def ready(self) -> bool:
        return self.num_observed >= MIN_STEPS

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        # relative errors: a decode step's 10 ms matter as much as a prefill's 200 (the
        # policy divides one by the other), so each row is scaled by its own time
        x = np.array(shape.vector()) / seconds
        self._add(x, 1.0)
        self._rows.append(x)
        if len(self._rows) > self.window:
            self._add(self._rows.popleft(), -1.0)
        self.num_observed += 1
        if shape.decodes:
            self.max_prompt_beside_decodes = max(self.max_prompt_beside_decodes, shape.prompt_tokens)
        if self.ready:
            self._fit()

    def _add(self, x: np.ndarray, sign: float) -> None:
        self._xtx += sign * np.outer(x, x)
        self._xty += sign * x

    def _fit(self) -> None:
        active = [0, 1, 2, 3]
        theta = np.zeros(4)
        # nonnegative least squares by elimination: a feature whose fitted cost is
        # negative (none in the window, or collinear with another) costs nothing
        while active:
            a = self._xtx[np.ix_(active, active)]
            sol = np.linalg.lstsq(a, self._xty[active], rcond=None)[0]
            if (sol >= 0).all():
                theta[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        self._theta = theta
        self._per_unit = (float(theta[0]), float(theta[1]) / 1e3, float(theta[2]) / 1e5,
                          float(theta[3]) / 1e6)

    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature (for logs and tests)."""
        return dict(zip(("step", "token", "decode_key", "prompt_pair"), self._per_unit))

    def seconds(self, shape: StepShape) -> float:
        return float(np.dot(self._theta, shape.vector()))

    def prompt_seconds(self, n: int, context: int) -> float:
        """What n prompt tokens after `context` cached ones add to a step."""
        _, token, _, pair = self._per_unit  # called per queued request: no dict
        return token * n + pair * chunk_pairs(n, context)

    def max_chunk(self, seconds: float, context: int) -> int:
        """The most prompt tokens after `context` cached ones that add <= `seconds`."""
        _, token, _, pair = self._per_unit
        a, b = pair / 2, token + pair * (context + 0.5)
        if seconds <= 0:
            return 0
        if a <= 0:
            return math.inf if b <= 0 else int(seconds / b)
        return int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a))


class StepTimer:
    """Each launched step's time: on CUDA, events around its launches, read once its end
    has passed (never a sync); elsewhere the launch's wall time (the step is done when
    it returns)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: deque[tuple[object, object, StepShape]] = deque()

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark, shape: StepShape) -> None:
        if not self.cuda:
            self._open.append((mark, time.perf_counter(), shape))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((mark, end, shape))

    def finished(self) -> list[tuple[StepShape, float]]:
        """(shape, seconds) of the timed steps that have finished, oldest first."""
        out = []
        while self._open:
            start, end, shape = self._open[0]
            if not self.cuda:
                out.append((shape, end - start))
            elif end.query():
                out.append((shape, start.elapsed_time(end) / 1e3))
            else:
                break
            self._open.popleft()
        return out
