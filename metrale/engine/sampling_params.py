from __future__ import annotations

from dataclasses import dataclass

from metrale.errors import MetraleError


class InvalidSamplingParamsError(MetraleError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. seed makes a sampled request reproducible
    whatever else shares its batch."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top logprobs per token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in 0..20, got {self.logprobs}"),
            (all(self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingParamsError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
