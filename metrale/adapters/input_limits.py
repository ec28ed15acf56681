"""Untrusted files and JSON in: regular files only (a FIFO would block the open), a size
cap, no deep nesting (refused before the parser recurses), no duplicate keys. Every failure
is the caller's AdapterError subclass, never a ValueError, RecursionError, ..."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from metrale.adapters.confined import open_inside, stat_inside
from metrale.errors import AdapterError

# PEFT configs nest 3 deep and safetensors headers 3 deep; json's C scanner recurses
# once per level and dies near sys.getrecursionlimit(), far above this.
MAX_JSON_DEPTH = 64
_DEPTH_CHUNK = 1 << 20  # bytes per vectorised pass: bounds the scan's temporary memory
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def probe(path: Path, error: type[AdapterError], root: Path | None = None) -> os.stat_result | None:
    """stat(path), None when it does not exist, else the caller's error (permissions, a NUL
    byte, a symlink loop). With a root: what it resolves to must lie inside (confined.py)."""
    if root is not None:
        return stat_inside(path, root, error)
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, TypeError) as e:
        raise error(f"cannot access {path}: {e}") from None


def open_regular(path: Path, error: type[AdapterError], root: Path | None = None) -> BinaryIO:
    """path opened for reading, if a regular file (O_NONBLOCK: a planted FIFO must not block
    the open). With a root: opened so that it cannot resolve outside it (confined.py)."""
    if root is not None:
        return open_inside(path, root, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path} not found") from None
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL in the path
        raise error(f"cannot open {path}: {e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped_path(path: Path, limit: int, error: type[AdapterError],
                     root: Path | None = None) -> bytes:
    """At most `limit` bytes of path (reading one more proves a file too big)."""
    with open_regular(path, error, root) as f:
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise error(f"cannot read {path}: {e}") from None
    if len(raw) > limit:
        raise error(f"{path} is larger than the {limit}-byte limit; it cannot be a real "
                    "adapter file (or is not one)")
    return raw


def json_depth(raw: bytes) -> int:
    """The deepest [ / { nesting outside strings (or the bracket count, when that is small
    enough). Vectorised: a Python loop over a 100 MiB header takes seconds. A quote toggles
    a string unless an odd backslash run precedes it; outside strings a backslash is a
    syntax error, so this scan and json agree on every byte json reads before failing."""
    data = np.frombuffer(raw, dtype=np.uint8)
    counts = np.bincount(data, minlength=256)
    openers = int(counts[ord("[")] + counts[ord("{")])
    if openers <= MAX_JSON_DEPTH:
        return openers  # an upper bound that is already small enough
    depth = best = 0
    in_string = False
    run = 0  # backslashes ending the previous chunk
    for start in range(0, len(data), _DEPTH_CHUNK):
        chunk = data[start:start + _DEPTH_CHUNK]
        quotes, run = _real_quotes(chunk, run)
        step = _OPEN[chunk]
        if quotes.any():
            inside = (np.cumsum(quotes, dtype=np.int32) + in_string) & 1
            step = np.where(inside.astype(bool), 0, step)
            in_string = bool(inside[-1])
        elif in_string:
            continue  # the whole chunk is string content
        path = np.cumsum(step, dtype=np.int64)
        best = max(best, depth + int(path.max()))
        depth += int(path[-1])
    return best


def _real_quotes(chunk: np.ndarray, run: int) -> tuple[np.ndarray, int]:
    """Unescaped quotes, and the backslash run ending the chunk (`run`: the previous one's)."""
    quotes = chunk == _QUOTE
    backslash = chunk == _BACKSLASH
    if not backslash.any():  # the common case: only the carried run can escape
        if run % 2:
            quotes[0] = False
        return quotes, 0
    idx = np.arange(len(chunk), dtype=np.int64)
    # the last non-backslash at or before each index; -1 - run stands for the carried run
    last = np.maximum.accumulate(np.where(backslash, -1 - run, idx))
    at = np.flatnonzero(quotes)
    before = np.where(at > 0, at - 1 - last[np.maximum(at - 1, 0)], run)  # backslashes before
    quotes[at[before % 2 == 1]] = False
    return quotes, int(idx[-1] - last[-1])


def _no_duplicates(error: type[AdapterError], source: object):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise error(f"{source}: key {brief(dup)} appears twice in one JSON object; "
                        "keep one (parsers disagree on which one wins)")
        return out

    return hook


def parse_json(raw: bytes, source: object, error: type[AdapterError]) -> Any:
    """Strict UTF-8 JSON (no BOM, no duplicate keys, depth <= MAX_JSON_DEPTH)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{source} is not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{source} nests JSON {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(error, source))
    except json.JSONDecodeError as e:
        raise error(f"{source} is not valid JSON: {e}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        # ValueError: an integer literal longer than Python's int digit limit
        raise error(f"{source} holds JSON this parser refuses: {type(e).__name__}: {str(e)[:200]}") from None


def brief(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"
