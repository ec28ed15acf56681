"""Where a server looks up an adapter a request names before anyone registered it
(`--adapter-source`): a directory tree (`org/adapter` is DIR/org/adapter; after the
adapter-name rule, the directory and each of its files must resolve inside the tree:
metrale.adapters.confined) or an S3 bucket (metrale.adapters.object_store). A found adapter
carries its root, and every later read of its files (its registration, each landing) is
confined to it again. A name found nowhere is remembered as missing for NEGATIVE_TTL_S, so
a stream of requests for it costs one look-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from metrale.adapters.confined import resolve_inside, stat_inside
from metrale.adapters.object_store import ADAPTER_FILES, ObjectStoreError, S3Source
from metrale.config import ConfigError
from metrale.errors import AdapterFileError
from metrale.names import validate_adapter_name

log = logging.getLogger("metrale.adapters")

NEGATIVE_TTL_S = 30.0
MAX_REMEMBERED_MISSES = 10_000


@dataclass(frozen=True)
class FoundAdapter:
    path: Path  # the adapter's directory, resolved
    root: Path  # its source's tree (or cache): every file read must resolve inside it


class DirectorySource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ConfigError(f"adapter source {root} is not a directory")

    def find(self, name: str) -> FoundAdapter | None:
        """None when the tree holds no adapter of that name; a directory or file that leads
        out of the tree (AdapterOutsideRootError), a symlink loop or a dangling link
        (AdapterFileError) is refused, naming it. Opens nothing."""
        path = resolve_inside(self.root / name, self.root, AdapterFileError)
        if path is None or not path.is_dir():
            return None
        if any(stat_inside(path / f, self.root, AdapterFileError) is None for f in ADAPTER_FILES):
            return None
        return FoundAdapter(path, self.root)

    def __str__(self) -> str:
        return str(self.root)


class AdapterSources:
    """The sources (directories or s3:// URLs, cached in cache_dir) in order, with the
    names found in none remembered for a while."""

    def __init__(self, roots: Iterable[str | Path], negative_ttl_s: float = NEGATIVE_TTL_S,
                 clock: Callable[[], float] = time.monotonic, cache_dir: str | Path | None = None,
                 cache_bytes: int = 20 << 30) -> None:
        self.sources = tuple(self._source(str(r), cache_dir, cache_bytes) for r in roots)
        self.negative_ttl_s, self._clock = negative_ttl_s, clock
        self._missing: OrderedDict[str, float] = OrderedDict()  # name -> remembered until
        self._cached: dict[str, S3Source] = {}  # names found in a bucket: their copy may go
        self._lock = threading.Lock()  # _missing and _cached: requests look up from threads

    @staticmethod
    def _source(root: str, cache_dir: str | Path | None, cache_bytes: int):
        if not root.startswith("s3://"):
            return DirectorySource(root)
        if cache_dir is None:
            raise ConfigError(f"adapter source {root} needs a cache directory (--adapter-cache-dir)")
        return S3Source(root, cache_dir, cache_bytes)

    def find(self, name: str) -> FoundAdapter | None:
        """Raises InvalidNameError for a name the rule refuses, AdapterError for a tree that
        leads out of its source; None when no source holds it. Look-ups run outside the
        lock: a slow bucket delays only the names it is asked for."""
        validate_adapter_name(name)
        with self._lock:
            until = self._missing.get(name)
            if until is not None and self._clock() < until:
                return None
        for source in self.sources:
            found = source.find(name)
            if isinstance(found, Path):  # a bucket's copy, confined to its cache
                found = FoundAdapter(found, source.cache_root)
            if found is not None:
                with self._lock:
                    self._missing.pop(name, None)
                    if isinstance(source, S3Source):
                        self._cached[name] = source
                return found
        with self._lock:
            self._missing[name] = self._clock() + self.negative_ttl_s
            self._missing.move_to_end(name)
            while len(self._missing) > MAX_REMEMBERED_MISSES:
                self._missing.popitem(last=False)
        return None

    def from_bucket(self, name: str) -> bool:
        """Whether `name` was found in a bucket: only then is there a cached copy to refresh."""
        return name in self._cached

    def refresh(self, name: str) -> None:
        """Before a request for a registered name found in a bucket: its disk-cache copy
        (the path the engine registered) is fetched again if the cache evicted it, and
        becomes the most recently used, so the landing that follows finds it. Best effort:
        a resident adapter needs no copy, and a landing without one fails on its own."""
        source = self._cached.get(name)
        if source is not None:
            try:
                source.find(name)
            except ObjectStoreError as e:
                log.warning("adapter %r: its cached copy could not be fetched again: %s", name, e)
