"""The first run's long phases show progress everywhere: a tqdm bar on a terminal with
columns; whole lines (start, every few seconds, end) on a terminal of 0 columns, a pipe
or a log file, where a carriage-return bar shows nothing until it ends."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import termios

import pytest

from metrale.progress import Lines, has_columns, progress_bar


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lines_at_start_every_few_seconds_and_at_the_end():
    out, clock = io.StringIO(), Clock()
    bar = Lines("metrale: training shout", 200, "step", range(200), out, 5.0, clock)
    for i in bar:
        clock.t += 0.125  # 25 s in all: a line every 5 s
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}", refresh=False)
    bar.close()
    bar.close()  # twice: one final line
    lines = out.getvalue().splitlines()
    assert lines[0] == "metrale: training shout: 0/200 steps (0%), 0 s"
    assert len(lines) == 1 + 5  # the start, then 5, 10, 15, 20 and 25 s (the end)
    assert lines[1] == "metrale: training shout: 40/200 steps (20%), 5 s, about 20 s left [loss=0.025]"
    assert lines[-1] == "metrale: training shout: 200/200 steps (100%), 25 s [loss=0.005]"
    assert all("\r" not in line for line in lines)


def test_phases_with_a_postfix():
    out, clock = io.StringIO(), Clock()
    bar = Lines("metrale: converting", 4, "phase", None, out, 5.0, clock)
    bar.set_postfix_str("dequantizing weights")
    clock.t += 6
    bar.update()
    bar.close()
    assert out.getvalue().splitlines()[1] == \
        "metrale: converting: 1/4 phases (25%), 6 s, about 18 s left [dequantizing weights]"


def _pty(columns: int):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return os.fdopen(master, "rb", buffering=0), os.fdopen(slave, "w")


def _drain(master) -> str:
    """All the terminal has received (written before: nothing more is coming)."""
    data = b""
    while select.select([master], [], [], 0)[0]:
        data += master.read(65536)
    return data.decode()


@pytest.mark.parametrize("columns,drawn", [(0, False), (80, True)])
def test_a_terminal_without_columns_gets_lines(columns, drawn):
    master, term = _pty(columns)
    try:
        assert has_columns(term) is drawn
        bar = progress_bar("metrale: x", 3, "step", range(3), file=term)
        assert isinstance(bar, Lines) is not drawn
        list(bar)
        bar.close()
        term.flush()
        text = _drain(master)
        assert "metrale: x" in text and "3/3" in text
        if not drawn:
            assert text.splitlines()[0].strip() == "metrale: x: 0/3 steps (0%), 0 s"
    finally:
        term.close()
        master.close()


def test_pipes_and_files_get_lines():
    assert not has_columns(io.StringIO())
    r, w = os.pipe()
    with os.fdopen(w, "w") as pipe:
        assert not has_columns(pipe)
    os.close(r)
