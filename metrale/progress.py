"""Progress of the first run's long phases (converting the default model, training the
demo adapters): a tqdm bar where a terminal can draw one, plain lines elsewhere.

A terminal that reports 0 columns, a pipe or a log file gets whole lines, one at the
start, then one every `every_s` seconds and one at the end: a carriage-return bar there
is drawn as nothing, or as one line only when it ends."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any


def progress_bar(desc: str, total: int, unit: str, iterable: Iterable | None = None,
                 file: IO[str] | None = None, every_s: float = 5.0, **tqdm_kwargs: Any):
    """tqdm(iterable, total, desc, unit) on a terminal with columns, else Lines with the
    same update / set_postfix / set_postfix_str / close / iteration."""
    file = sys.stderr if file is None else file
    if has_columns(file):
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True,
                    **tqdm_kwargs)
    return Lines(desc, total, unit, iterable, file, every_s)


def has_columns(file: IO[str]) -> bool:
    try:
        return file.isatty() and os.get_terminal_size(file.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no fileno (a StringIO), or closed
        return False


class Lines:
    def __init__(self, desc: str, total: int, unit: str, iterable: Iterable | None,
                 file: IO[str], every_s: float, clock=time.monotonic) -> None:
        self.desc, self.total, self.unit, self.file = desc, total, unit, file
        self.iterable, self.every_s, self.clock = iterable, every_s, clock
        self.n, self.postfix, self.shown = 0, "", -1
        self.start = self.last = clock()
        self.closed = False
        self._print()

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every_s:
            self._print()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def set_postfix(self, refresh: bool = True, **values: object) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.shown != self.n:  # the last line already says where it ended
                self._print()

    def _print(self) -> None:
        now = self.clock()
        self.last, self.shown = now, self.n
        elapsed = now - self.start
        line = f"{self.desc}: {self.n}/{self.total} {self.unit}s"
        if self.total:
            line += f" ({100 * self.n // self.total}%)"
        line += f", {elapsed:.0f} s"
        if 0 < self.n < self.total:
            line += f", about {elapsed / self.n * (self.total - self.n):.0f} s left"
        if self.postfix:
            line += f" [{self.postfix}]"
        print(line, file=self.file, flush=True)
