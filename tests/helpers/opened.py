"""Seeing every open of a file in a directory tree, by anyone: Linux inotify (IN_OPEN and
IN_ACCESS on each directory of the tree), read through ctypes. The kernel queues the event
when the open happens, whatever opened it (Python, a Rust reader, an mmap), so after a
request has been answered the queue holds every open it made; nothing is timed."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from pathlib import Path

IN_ACCESS, IN_OPEN, IN_ISDIR = 0x1, 0x20, 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class OpenWatch:
    """with OpenWatch(tree) as watch: ...; watch.opened() -> the files opened (or read)
    under tree since the last call (a directory listed does not count)."""

    def __init__(self, tree: Path) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, Path] = {}
        for folder, _, _ in os.walk(tree):
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
            self._dirs[wd] = Path(folder)

    def opened(self) -> list[Path]:
        found = []
        while True:
            try:
                raw = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return found
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return found
                raise
            pos = 0
            while pos < len(raw):
                wd, mask, _, n = _EVENT.unpack_from(raw, pos)
                name = raw[pos + _EVENT.size:pos + _EVENT.size + n].rstrip(b"\0").decode()
                pos += _EVENT.size + n
                if not mask & IN_ISDIR:
                    found.append(self._dirs.get(wd, Path("?")) / name)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> OpenWatch:
        self.opened()  # what happened before the block does not count
        return self

    def __exit__(self, *exc) -> None:
        self.close()
