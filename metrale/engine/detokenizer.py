"""Incremental detokenisation: each new token costs a decode of a few tokens, not of the
whole output (which made a long generation quadratic). One character may span several
tokens and a token's text may depend on the one before (leading spaces), so each step
decodes a short window from `prefix`, with and without the tokens since `read`; the
window moves on only when the new text ends in a whole character (no U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    prefix: int = 0  # the window's first token: context for the tokens after it
    read: int = 0  # tokens whose text is already in `text`
    text: str = ""  # the output's text so far (may end before the newest tokens' text)


def detokenize_new(tokenizer, ids: list[int], state: DetokenizerState, final: bool = False) -> str:
    """Append the text of ids[state.read:] that is final to state.text (final=True: all
    of it, an incomplete last character as U+FFFD, as decoding the whole output gives);
    return it."""
    prefix_text = tokenizer.decode(ids[state.prefix:state.read], skip_special_tokens=True)
    window_text = tokenizer.decode(ids[state.prefix:], skip_special_tokens=True)
    if not final and (len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd")):
        return ""  # a character still incomplete (or a special token): wait for more
    new = window_text[len(prefix_text):]
    state.text += new
    state.prefix, state.read = state.read, len(ids)
    return new
