"""SamplingParams: validated once, at construction, so the sampler never sees a value it
cannot turn into a token. Limits follow the OpenAI API and vLLM; a bool where a number is
expected is refused rather than read as 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metrale.errors import MetraleError

GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them overflows to inf
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
MAX_TOKENS = 1 << 20  # far beyond any context this engine serves; catches absurd values early
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # a stream holds back len(stop) - 1 characters
# torch.Generator.manual_seed takes exactly this range (negative seeds wrap modulo 2**64)
MIN_SEED, SEED_END = -(1 << 63), 1 << 64


class InvalidSamplingParamsError(MetraleError):
    """A sampling parameter is out of range; `param` names it (None: the request as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; seed makes a sampled request reproducible in any batch."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1 is accepted as off too, and stored as 0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top logprobs per token
    # vLLM's min_tokens: until this many tokens were generated, EOS is never sampled
    # and stop strings are not looked for
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _set = object.__setattr__  # frozen: normalise in place, once
        _set(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, MAX_TOKENS))
        _set(self, "temperature", _float("temperature", self.temperature))
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidSamplingParamsError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
                "temperature")
        _set(self, "top_p", _float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        top_k = _int("top_k", self.top_k, -1, None)
        _set(self, "top_k", 0 if top_k == -1 else top_k)
        if self.seed is not None:
            _set(self, "seed", _int("seed", self.seed, MIN_SEED, SEED_END - 1))
        if self.logprobs is not None:
            _set(self, "logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        _set(self, "min_tokens", _int("min_tokens", self.min_tokens, 0, self.max_tokens))
        _set(self, "stop", _stop_strings(self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParamsError(
                f"ignore_eos must be a boolean, got {type(self.ignore_eos).__name__}", "ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _int(name: str, value: object, lo: int, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParamsError(
            f"{name} must be an integer, got {type(value).__name__}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidSamplingParamsError(f"{name} must be {bound}, got {_show(value)}", name)
    return int(value)  # an int subclass (numpy, IntEnum) becomes a plain int


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParamsError(
            f"{name} must be a number, got {type(value).__name__}", name)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise InvalidSamplingParamsError(
            f"{name} must be a finite number, got {_show(value)}", name)
    return number


def _show(value: object) -> str:
    # str() of an int over 4300 digits raises ValueError: never let the message fail
    if isinstance(value, int) and value.bit_length() > 256:
        return f"a {value.bit_length()}-bit integer"
    return repr(value)


def _stop_strings(stop: object) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else stop
    try:
        strings = tuple(strings)
    except TypeError:
        raise InvalidSamplingParamsError(
            f"stop must be a string or a list of strings, got {type(stop).__name__}",
            "stop") from None
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidSamplingParamsError(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}", "stop")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise InvalidSamplingParamsError("stop strings must be non-empty strings", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidSamplingParamsError(
                f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(s)}",
                "stop")
    return strings
