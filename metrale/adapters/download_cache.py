"""The disk cache of adapters fetched from one object store (`--adapter-cache-dir`, at most
`--adapter-cache-bytes`), which survives restarts: ROOT/<name>/{adapter_config.json,
adapter_model.safetensors, source.json}. source.json records the objects' ETags, so a
copy can be re-validated against the store and fetched again when they changed.

A download lands in a private `.download-*` directory beside ROOT and is published by one
rename: a crash or a refused download leaves nothing that is ever served (a `.download-*`
left by a crash is removed at start). The bytes a download announced are reserved in the
bound before they land (least recently used copies out until they fit beside the cached
ones and every other download's reservation; while only reservations are in the way the
download waits for one to end, holding none itself, so waits cannot cycle), so the files
never pass the bound. A copy refused for its content is discarded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from metrale.adapters.identity import CONFIG_FILE, WEIGHTS_FILE
from metrale.errors import ObjectStoreError

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
RECORD_FILE = "source.json"  # the objects' ETags, beside the adapter's files
RECORD_MAX = 1024  # its bytes, reserved with the files' (ETags are short)


class DownloadCache:
    def __init__(self, root: Path, bound: int, what: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()  # the confinement root of every read of a copy
        self.bound, self.what = bound, what
        self._lock = threading.Lock()  # the directories and _reserved
        self._room = threading.Condition(self._lock)  # signalled when a reservation ends
        self._reserved = 0  # bytes announced by downloads in flight
        self._names: dict[str, list] = {}  # name -> [its lock, holders]: one download per name
        self._names_lock = threading.Lock()
        for stale in self.root.parent.glob(".download-*"):  # a crash mid-download
            shutil.rmtree(stale, ignore_errors=True)

    def path(self, name: str) -> Path:
        return self.root / name

    @contextlib.contextmanager
    def name_lock(self, name: str) -> Iterator[None]:
        """One download of `name` at a time; other names never wait for it (one lock per
        name in flight, not shared stripes)."""
        with self._names_lock:
            entry = self._names.setdefault(name, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._names_lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._names[name]

    def record(self, name: str) -> dict[str, str] | None:
        """The ETags the copy of `name` was fetched with (each file's), or None when there is
        no complete copy. Marks it the most recently used."""
        final = self.path(name)
        with self._lock:
            if not all((final / f).is_file() for f in ADAPTER_FILES):
                return None
            try:
                etags = json.loads((final / RECORD_FILE).read_text())["etags"]
            except (OSError, ValueError, KeyError, TypeError):
                etags = {}  # a copy from before records were kept: re-validated as changed
            os.utime(final)  # recency, for eviction
            return etags if isinstance(etags, dict) else {}

    def discard(self, name: str) -> None:
        """Drop the copy of `name` (refused for its content: the next look-up fetches it again)."""
        with self._lock:
            shutil.rmtree(self.path(name), ignore_errors=True)

    @contextlib.contextmanager
    def download(self, name: str, nbytes: int, wait: Callable[[], float]) -> Iterator[Path]:
        """A private directory for `name`'s files, with room for `nbytes` reserved (wait():
        how long one may still wait for room, raising when no time is left). Leaving the
        block normally publishes the directory as `name` (with `etags` written by the
        caller); an exception leaves nothing."""
        reserved = self._reserve(nbytes + RECORD_MAX, name, wait)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=self.root.parent))
        try:
            yield tmp
            final = self.path(name)
            with self._lock:
                final.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(final, ignore_errors=True)  # an older copy, or one left by hand
                tmp.rename(final)  # the one step that publishes
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._room:
                self._reserved -= reserved
                self._room.notify_all()

    @staticmethod
    def write_record(folder: Path, etags: dict[str, str]) -> None:
        raw = json.dumps({"etags": etags}).encode()
        if len(raw) > RECORD_MAX:  # a store's ETag of absurd length: not worth keeping
            raw = b'{"etags": {}}'
        (folder / RECORD_FILE).write_bytes(raw)

    def _reserve(self, incoming: int, name: str, wait: Callable[[], float]) -> int:
        """Least recently used copies out until `incoming` more bytes fit the bound beside
        the cached ones and the other downloads' reservations (waiting for those to end when
        they are what is in the way); then reserve them. Returns incoming."""
        if incoming > self.bound:
            raise ObjectStoreError(f"{self.what}: adapter {name!r} needs {incoming} bytes, more "
                                   f"than the whole disk cache ({self.bound}, "
                                   "--adapter-cache-bytes)")
        with self._room:  # a waiter holds no reservation: whoever it waits for can finish
            while True:
                dirs = [p.parent for p in self.root.rglob(ADAPTER_FILES[1])]
                sizes = {d: _bytes_in(d) for d in dirs}
                total = sum(sizes.values()) + self._reserved + incoming
                for d in sorted(dirs, key=_mtime):
                    if total <= self.bound:
                        break
                    shutil.rmtree(d, ignore_errors=True)
                    total -= sizes[d]
                if total <= self.bound:
                    self._reserved += incoming
                    return incoming
                self._room.wait(wait())


def _bytes_in(folder: Path) -> int:
    total = 0
    for f in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size
    return total


def _mtime(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except FileNotFoundError:
        return 0.0
