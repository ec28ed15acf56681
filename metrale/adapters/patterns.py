"""PEFT's regex fields, matched as PEFT's `re` matches them but in bounded time: `re`
cannot be interrupted, so "(a+)+$" could hold a thread (and the GIL) for hours. Each pattern
is validated by `re` (exactly PEFT's accepted set), rewritten where the `regex` package reads
the text differently (a literal `{`, a `[` in a set; verbose mode is refused), bounded before
compiling (`regex` unrolls counted repeats), then matched by `regex` with a timeout from one
MatchBudget per resolution. Patterns without regex syntax are compared as strings.
"""

from __future__ import annotations

import re
import string
import time
from dataclasses import dataclass

import regex

from metrale.adapters.input_limits import brief
from metrale.errors import AdapterConfigError

MAX_PATTERN_CHARS = 1024
# What `regex` may unroll at compile time (the product of nested repeat counts): 50,000
# compiles in ~30 ms, and module names are < 200 characters.
MAX_PATTERN_EXPANSION = 50_000
# Wall time one adapter's matching may spend in regex calls (a real one needs a few ms);
# regex checks its timeout coarsely (~2.5x overshoots seen).
MATCH_BUDGET_S = 1.0

_META = set(".^$*+?{}[]\\|()")
_LITERAL_ESCAPES = set(string.punctuation) | {" "}
_REPEAT = re.compile(r"\{([0-9]*)(?:,([0-9]*))?\}")
_SCOPED_FLAGS = re.compile(r"\(\?([aiLmsux]*)(?:-[imsx]*)?[:)]")


class MatchBudget:
    """Seconds of regex matching left to one resolution."""

    def __init__(self, seconds: float | None = None) -> None:
        self.left = MATCH_BUDGET_S if seconds is None else seconds

    def run(self, pattern: PeftPattern, call, key: str):
        if self.left <= 0:
            raise _too_slow(pattern)
        start = time.perf_counter()
        try:
            return call(key, timeout=self.left, concurrent=True)
        except TimeoutError:
            raise _too_slow(pattern) from None
        except (MemoryError, RecursionError):
            raise AdapterConfigError(
                f"{pattern.field} {brief(pattern.source)} exhausts memory when matched; "
                "simplify the pattern"
            ) from None
        finally:
            self.left -= time.perf_counter() - start


def _too_slow(pattern: PeftPattern) -> AdapterConfigError:
    return AdapterConfigError(
        f"{pattern.field} {brief(pattern.source)} takes too long to match module names "
        "(catastrophic backtracking, e.g. nested quantifiers like (a+)+); simplify it or "
        "list the module names instead"
    )


@dataclass(frozen=True, eq=False)
class PeftPattern:
    field: str  # the config field, for messages: "target_modules", "rank_pattern key", ...
    source: str  # the user's text
    literal: str | None  # the one string it matches, when it has no regex syntax
    compiled: regex.Pattern | None

    def fullmatch(self, key: str, budget: MatchBudget) -> bool:
        """re.fullmatch(source, key)."""
        if self.literal is not None:
            return key == self.literal
        return budget.run(self, self.compiled.fullmatch, key) is not None

    def suffix_match(self, key: str, budget: MatchBudget) -> bool:
        """re.match(rf"(.*\\.)?({source})$", key): PEFT's rank/alpha pattern rule."""
        if self.literal is not None:
            return _suffix_literal(self.literal, key)
        return budget.run(self, self.compiled.match, key) is not None

    def layer_match(self, key: str, budget: MatchBudget) -> tuple[bool, int | None]:
        r"""re.match(rf"(?:^|.*?\.){source}\.(?P<idx>\d+)\.", key): whether it matched
        and its idx group (None when a top-level | let it match without the group)."""
        m = budget.run(self, self.compiled.match, key)
        if m is None:
            return False, None
        idx = m.groupdict().get("idx")  # as PEFT reads it: a comment can swallow the group
        return True, None if idx is None else int(idx)


def _suffix_literal(literal: str, key: str) -> bool:
    r"""(.*\.)?(literal)$ without a regex: `$` also matches before a final newline,
    and `.*` crosses none."""
    ends = [key, key[:-1]] if key.endswith("\n") else [key]
    for k in ends:
        if k == literal:
            return True
        head = k[:len(k) - len(literal)]
        if k.endswith(literal) and head.endswith(".") and "\n" not in head:
            return True
    return False


def fullmatch_pattern(field: str, source: str) -> PeftPattern:
    return _compile(field, source, "{}")


def suffix_pattern(field: str, source: str) -> PeftPattern:
    return _compile(field, source, r"(.*\.)?({})$")


def layers_pattern(field: str, source: str) -> PeftPattern:
    return _compile(field, source, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.", literal_ok=False)


def _compile(field: str, source: str, template: str, literal_ok: bool = True) -> PeftPattern:
    if not isinstance(source, str):
        raise AdapterConfigError(f"{field} must be a string, got {brief(source)}")
    if len(source) > MAX_PATTERN_CHARS:
        raise AdapterConfigError(
            f"{field} {brief(source)} is {len(source)} characters; the limit is {MAX_PATTERN_CHARS}"
        )
    literal = _literal(source) if literal_ok else None
    if literal is not None:
        return PeftPattern(field, source, literal, None)
    text = template.replace("{}", source)
    try:
        re.compile(text)  # PEFT's own engine decides what is a valid pattern
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise AdapterConfigError(
            f"{field} {brief(source)} is not a valid regular expression as PEFT uses it "
            f"({_reason(e)}); escape regex metacharacters such as ( [ . with a backslash"
        ) from None
    rewritten, expansion, verbose = scan(text)
    if verbose:
        raise AdapterConfigError(
            f"{field} {brief(source)} uses verbose mode (?x), which metrale does not accept; "
            "write the pattern without (?x) and without whitespace or # comments"
        )
    if expansion > MAX_PATTERN_EXPANSION:
        raise AdapterConfigError(
            f"{field} {brief(source)} repeats too much (counted repeats expand to "
            f"~{expansion} steps, limit {MAX_PATTERN_EXPANSION}); use smaller {{m,n}} counts"
        )
    try:
        compiled = regex.compile(rewritten, flags=regex.VERSION0)
    except (regex.error, RecursionError, OverflowError, ValueError, MemoryError) as e:
        raise AdapterConfigError(
            f"{field} {brief(source)} cannot be compiled for bounded matching ({_reason(e)}); "
            "simplify the pattern"
        ) from None
    return PeftPattern(field, source, None, compiled)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:120]}"


def _literal(source: str) -> str | None:
    """The one string `source` matches if it has no regex syntax but escaped punctuation."""
    out, i = [], 0
    while i < len(source):
        c = source[i]
        if c == "\\":
            if i + 1 >= len(source) or source[i + 1] not in _LITERAL_ESCAPES:
                return None
            out.append(source[i + 1])
            i += 2
            continue
        if c in _META:
            return None
        out.append(c)
        i += 1
    return "".join(out)


@dataclass
class _Group:
    total: int = 0  # unrolled size of the group's content so far
    last: int = 0  # unrolled size of the last atom (what a repeat multiplies)


def scan(text: str) -> tuple[str, int, bool]:
    """(text rewritten for `regex`, a bound of its compile-time unrolling, whether it turns on
    verbose mode) for a text `re` compiles, following `re`'s tokenizer (an escape is a
    backslash and one character, a set ends at a `]` not its first item, a comment at `)`)."""
    out: list[str] = []
    stack = [_Group()]
    verbose = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            j = _escape_end(text, i)
            out.append(text[i:j])
            _atom(stack)
            i = j
        elif c == "[":
            j, rewritten = _set(text, i)
            out.append(rewritten)
            _atom(stack)
            i = j
        elif c == "{":
            m = _REPEAT.match(text, i)
            if m is None or m.group(0) == "{}":
                out.append("\\{")  # literal for re; regex may read fuzzy matching here
                _atom(stack)
                i += 1
            else:
                out.append(m.group(0))
                _repeat(stack[-1], m)
                i = m.end()
        elif c == "(" and text.startswith("(?#", i):
            j = _comment_end(text, i)
            out.append(text[i:j])
            i = j
        elif c == "(":
            flags = _SCOPED_FLAGS.match(text, i)
            verbose |= bool(flags and "x" in flags.group(1))
            if flags and flags.group(0).endswith(")"):  # (?i) alone opens no group
                out.append(flags.group(0))
                i = flags.end()
            else:
                out.append(c)
                stack.append(_Group())
                i += 1
        elif c == ")":
            out.append(c)
            if len(stack) > 1:
                inner = stack.pop()
                stack[-1].total += inner.total
                stack[-1].last = inner.total
            i += 1
        else:
            out.append(c)
            if c not in "*+?|":
                _atom(stack)
            i += 1
    while len(stack) > 1:  # unreachable for a pattern re compiled; stay total
        inner = stack.pop()
        stack[-1].total += inner.total
    return "".join(out), stack[0].total, verbose


def _atom(stack: list[_Group]) -> None:
    stack[-1].total += 1
    stack[-1].last = 1


def _repeat(group: _Group, m: re.Match) -> None:
    k = max([1] + [int(x) for x in m.groups() if x])  # digits only: re already parsed them
    group.total += group.last * (k - 1)
    group.last *= k


def _escape_end(text: str, i: int) -> int:
    """End of the escape at text[i] ("\\N{NAME}" runs to its brace)."""
    if text.startswith("\\N{", i):
        close = text.find("}", i)
        return len(text) if close < 0 else close + 1
    return min(i + 2, len(text))


def _set(text: str, i: int) -> tuple[int, str]:
    r"""The end of the [...] set at text[i] and its text for `regex`: inner `[` (to regex a
    POSIX class or nested set), `^` and a leading `]` escaped, [^X] spelled
    (?:(?![X])(?s:.)) (regex gets [^\d\D] wrong)."""
    out = []
    j = i + 1
    negated = j < len(text) and text[j] == "^"
    j += negated
    first = True
    while j < len(text):
        c = text[j]
        if c == "\\":
            k = _escape_end(text, j)
            out.append(text[j:k])
            j = k
        elif c == "]" and not first:
            body = "[" + "".join(out) + "]"
            return j + 1, f"(?:(?!{body})(?s:.))" if negated else body
        else:
            # escaped: [ (see above), ^ and a leading ] (their meaning depends on position,
            # which moves when [^X] becomes [X])
            out.append("\\" + c if c in "[^]" else c)
            j += 1
        first = False
    return j, "[" + "^" * negated + "".join(out)  # unterminated: re refused it already


def _comment_end(text: str, i: int) -> int:
    j = i + 3
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == ")":
            return j + 1
        else:
            j += 1
    return len(text)
