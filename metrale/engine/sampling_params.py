"""SamplingParams: validated once, at construction, so the sampler never sees a value it
cannot turn into a token. Limits follow the OpenAI API and vLLM; a bool where a number is
expected is refused rather than read as 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from metrale.engine.param_errors import InvalidSamplingParamsError
from metrale.engine.structured import StructuredOutput

GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them overflows to inf
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
MAX_TOKENS = 1 << 20  # far beyond any context this engine serves; catches absurd values early
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # a stream holds back len(stop) - 1 characters
# torch.Generator.manual_seed takes exactly this range (negative seeds wrap modulo 2**64)
MIN_SEED, SEED_END = -(1 << 63), 1 << 64


# OpenAI's and vLLM's ranges
MAX_PENALTY = 2.0  # presence_penalty, frequency_penalty in [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # vLLM accepts (0, inf); past 2 every seen token is all but banned
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 64

__all__ = ["InvalidSamplingParamsError", "SamplingParams", "StructuredOutput"]


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
    # completions per prompt; the siblings share the prompt's KV through the prefix cache,
    # and a seeded request's sibling i draws with seed + i (as vLLM)
    n: int = 1
    # OpenAI's penalties on the generated tokens (presence: once a token appeared,
    # frequency: per appearance) and vLLM's repetition_penalty (HF's: a seen token's
    # logit divided by it when positive, multiplied when negative; prompt tokens count)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> added to its logit (OpenAI's logit_bias); normalised to sorted pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_p: a token stays only if its probability is >= min_p x the top one's
    min_p: float = 0.0
    # this many top logprobs for every prompt token (vLLM's prompt_logprobs); None: none
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

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
        _set(self, "n", _int("n", self.n, 1, MAX_N))
        for name in ("presence_penalty", "frequency_penalty"):
            _set(self, name, _bounded(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY))
        _set(self, "repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidSamplingParamsError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                f"{self.repetition_penalty}", "repetition_penalty")
        _set(self, "min_p", _bounded("min_p", self.min_p, 0.0, 1.0))
        _set(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.prompt_logprobs is not None:
            _set(self, "prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, 0,
                                               MAX_LOGPROBS))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidSamplingParamsError(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
                "structured")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        """Whether the sampler keeps this request's token counts (any penalty is on)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before drawing (beyond EOS
        suppression): a batch without such a row pays nothing for the features."""
        return self.penalised or bool(self.logit_bias) or self.structured is not None

    def sibling(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of n: one completion, seed + index (kept
        in [-2**63, 2**63): torch seeds a generator modulo 2**64, so this is the same draw)."""
        seed = None if self.seed is None else (self.seed + index + (1 << 63)) % SEED_END - (1 << 63)
        # the prompt's logprobs are the request's, reported once (with completion 0)
        return replace(self, n=1, seed=seed,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)


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


def _bounded(name: str, value: object, lo: float, hi: float) -> float:
    number = _float(name, value)
    if not lo <= number <= hi:
        raise InvalidSamplingParamsError(f"{name} must be in [{lo:g}, {hi:g}], got {number}", name)
    return number


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """A dict {token id: bias} (ids as ints or decimal strings, as JSON sends them) or
    pairs -> sorted (id, bias) pairs. Whether an id is in the vocabulary the engine checks."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise InvalidSamplingParamsError(
            f"logit_bias must map token ids to numbers, got {type(bias).__name__}", "logit_bias") from None
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSamplingParamsError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(items)}", "logit_bias")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidSamplingParamsError("logit_bias must map token ids to numbers", "logit_bias")
        token, value = item
        if isinstance(token, str) and token.strip().isdigit() and len(token) < 12:
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidSamplingParamsError(
                f"logit_bias keys must be token ids (non-negative integers), got {token!r:.40}",
                "logit_bias")
        out[int(token)] = _bounded("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted(out.items()))


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
