"""The grammar library (xgrammar), called from here only: compile a request's
StructuredOutput once (cached), keep one matcher per constrained sequence, and fill the
token bitmask rows the sampler turns into a mask on the device.

Why xgrammar (over llguidance, both on PyPI with CPU builds that run the very matcher a
GPU host runs): on the default model's 49k vocabulary a JSON schema's mask took 4 us a
token on average (83 us at worst) against llguidance's 55 us (1.3 ms at worst); it is
vLLM's default backend, so the EBNF grammars vLLM users send mean the same here.
Compilation costs milliseconds and is cached by the spec's text; the per-token work
is the matchers', done while the device runs the step (sampler.DeferredDraw).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict

import torch
import xgrammar

from metrale.engine.param_errors import InvalidSamplingParamsError
from metrale.engine.structured import StructuredOutput

# How a JSON schema's answer is laid out: two-space indents and ", " / ": ", the way chat
# models write JSON unprompted. On the default model and its demo adapters (22 schemas,
# greedy, 150 tokens) this left 1 answer unfinished; compact one-line JSON left 3 (strings
# ran on), free whitespace 2 (one of them newlines to the end of the budget).
JSON_OPTIONS = dict(any_whitespace=False, indent=2, strict_mode=True)
CACHE_ENTRIES = 512  # compiled grammars kept (a compiled JSON schema is tens of kB)
BITS = 32  # a bitmask word holds this many tokens (xgrammar's layout: int32, bit i of word w = token 32w + i)
# Threads that fill a step's mask rows: one row at a time, 16 rows of a JSON schema over a
# 128k vocabulary took ~10 ms a step on this project's 2-core VM (and the H100 host's
# structured steps took 34.9 ms), longer than the GPU step (~8 ms, Llama-3-8B, batch 32)
# the host's work must hide behind: a row per thread where the cores allow.
FILL_THREADS = min(16, os.cpu_count() or 1)
_batch_filler: xgrammar.BatchGrammarMatcher | None = None


class GrammarBackend:
    """One per engine: the tokenizer's table (built on first use: ~0.1-1 s by vocabulary)
    and the compiled grammars. Thread-safe: the server compiles off the engine thread so
    that a refused schema is a 400 before admission and the engine finds it cached."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self.hits = self.misses = 0

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidSamplingParamsError(
                    "structured outputs need the model's tokenizer; this model has none", "structured")
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_ids))
            # one thread: the server's compile runs beside the engine on a small machine
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of spec; InvalidSamplingParamsError (naming spec.param and
        the library's reason) when it cannot compile."""
        key = (spec.kind, spec.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
            compiler = self._get_compiler()
        # outside the lock: a large schema compiling must not hold up cached lookups
        compiled = _compile(compiler, spec)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(xgrammar.GrammarMatcher(self.compile(spec)))


def _compile(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
    try:
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.spec, **JSON_OPTIONS)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', **JSON_OPTIONS)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            alternatives = " | ".join(_ebnf_string(c) for c in spec.choices)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if spec.kind == "grammar":
            return _compile_grammar(compiler, spec.spec)
        return compiler.compile_structural_tag(spec.spec)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's refusals of the spec
        raise InvalidSamplingParamsError(
            f"{spec.param}: the {_WHAT[spec.kind]} cannot be compiled: {_reason(e)}",
            spec.param) from None


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}
# xgrammar prefixes its messages with a time and its source line: "[15:34:00] .../x.cc:12: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _reason(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return _LOG_PREFIX.sub("", lines[0])[:500]


def _compile_grammar(compiler: xgrammar.GrammarCompiler, text: str) -> xgrammar.CompiledGrammar:
    """EBNF (xgrammar's GBNF dialect, what vLLM's default backend reads); a grammar that
    is no EBNF but has Lark's `start` rule is read as Lark. The EBNF error is the one
    reported: that is the dialect documented."""
    try:
        return compiler.compile_grammar(text)
    except RuntimeError:
        if "start" not in text:
            raise
        try:
            return compiler.compile_lark(text)
        except RuntimeError:
            pass
        raise


def _ebnf_string(text: str) -> str:
    """A string literal of xgrammar's EBNF: JSON's escapes (\\" \\\\ \\n \\uXXXX) read
    the same there."""
    return json.dumps(text, ensure_ascii=True)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher
        self.num_accepted = 0  # tokens accepted so far: the sampler checks it saw them all

    def accept(self, token: int) -> bool:
        """False: the grammar refuses the token (a mask was not applied: a bug)."""
        ok = self._matcher.accept_token(token)
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    @staticmethod
    def fill_rows(matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """bitmask[rows[i]] = the tokens matchers[i] allows next (bitmask: int32 [N, words],
        CPU), the rows filled in parallel on FILL_THREADS threads."""
        global _batch_filler
        if _batch_filler is None:
            _batch_filler = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
        _batch_filler.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, rows)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def new_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """[rows, words] int32 on the host, every token allowed (pinned: copied to a GPU
    without a sync)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [N, words] int32 on the device -> bool [N, vocab_size], True = allowed:
    one shift and one and on the device, no host loop over the vocabulary."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
