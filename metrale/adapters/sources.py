"""Where a server looks up an adapter a request names before anyone registered it
(`--adapter-source`, searched in order): a directory tree (`org/adapter` is DIR/org/adapter;
after the adapter-name rule, the directory and each of its files must resolve inside the
tree: metrale.adapters.confined), an S3 bucket (object_store.py) or a Hugging Face Hub
organisation (hub_source.py). A found adapter carries its root, and every later read of
its files (its registration, each landing) is confined to it again.

Look-ups never run on the caller's threads: each remote source has its own pool of
look-up threads (LOOKUP_THREADS), the directories share one, and a store's downloads take
one of its FetchLimits.workers download slots (the bound on its downloads in flight),
while probing for a name (HEAD) takes none. So slow downloads from one store delay only
the names that must download from it, never another source (a name another source holds
is probed in the slow store first, and answered at once), a registered adapter or an
admin call. A look-up that waits a whole fetch timeout for a look-up thread is refused
(SourceBusyError, 503) without being started, and so is a download that waits its whole
deadline for a slot. Requests for one name share one look-up. A name found nowhere is
remembered as missing for NEGATIVE_TTL_S; a copy refused for its content is dropped from
its store's cache and the refusal remembered for REFUSED_TTL_S, after which the next
request fetches it again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from metrale.adapters.confined import ConfinedDir, resolve_inside, stat_inside
from metrale.adapters.download_cache import ADAPTER_FILES
from metrale.adapters.fetch_deadline import DEFAULT_LIMITS, FetchLimits
from metrale.adapters.hub_source import HubSource
from metrale.adapters.object_store import S3Source
from metrale.config import ConfigError
from metrale.errors import AdapterFileError, MetraleError, ObjectStoreError, SourceBusyError
from metrale.names import validate_adapter_name

log = logging.getLogger("metrale.adapters")

NEGATIVE_TTL_S = 30.0
REFUSED_TTL_S = 5.0  # a copy refused for its content: its error, before the store is asked again
MAX_REMEMBERED_MISSES = 10_000
LOCAL_WORKERS = 2  # directory look-ups (stat calls): every directory source shares them
LOOKUP_THREADS = 16  # per remote source, at least 4x its download slots: probes never queue


class DirectorySource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ConfigError(f"adapter source {root} is not a directory")

    def find(self, name: str, revalidate: bool = True) -> ConfinedDir | None:
        """None when the tree holds no adapter of that name; a directory or file that leads
        out of the tree (AdapterOutsideRootError), a symlink loop or a dangling link
        (AdapterFileError) is refused, naming it. Opens nothing."""
        path = resolve_inside(self.root / name, self.root, AdapterFileError)
        if path is None or not path.is_dir():
            return None
        if any(stat_inside(path / f, self.root, AdapterFileError) is None for f in ADAPTER_FILES):
            return None
        return ConfinedDir(path, self.root)

    def __str__(self) -> str:
        return str(self.root)


Source = DirectorySource | S3Source | HubSource


class AdapterSources:
    """The sources in order, each on its own threads, with the names found in none and the
    copies refused for their content remembered for a while."""

    def __init__(self, roots: Iterable[str | Path], negative_ttl_s: float = NEGATIVE_TTL_S,
                 clock: Callable[[], float] = time.monotonic, cache_dir: str | Path | None = None,
                 cache_bytes: int = 20 << 30, limits: FetchLimits = DEFAULT_LIMITS,
                 refused_ttl_s: float = REFUSED_TTL_S) -> None:
        self.limits = limits
        self.sources: tuple[Source, ...] = tuple(
            self._source(str(r), cache_dir, cache_bytes, limits) for r in roots)
        self.negative_ttl_s, self.refused_ttl_s, self._clock = negative_ttl_s, refused_ttl_s, clock
        self._missing: OrderedDict[str, float] = OrderedDict()  # name -> remembered until
        self._refused: dict[str, tuple[float, MetraleError]] = {}  # name -> (until, its error)
        self._found: dict[str, tuple[Source, ConfinedDir]] = {}  # names from a remote source
        self._inflight: dict[str, Future] = {}  # one look-up per name
        self._lock = threading.Lock()  # the dicts above: requests look up from threads
        local = ThreadPoolExecutor(LOCAL_WORKERS, thread_name_prefix="metrale-lookup")
        self._pools = {id(s): local if isinstance(s, DirectorySource) else
                       ThreadPoolExecutor(max(LOOKUP_THREADS, 4 * limits.workers),
                                          thread_name_prefix=f"metrale-fetch-{i}")
                       for i, s in enumerate(self.sources)}
        self._queued = _QueueDeadlines(limits.timeout_s)

    @staticmethod
    def _source(root: str, cache_dir: str | Path | None, cache_bytes: int,
                limits: FetchLimits) -> Source:
        if root.startswith("hf://"):
            return HubSource(root, limits)
        if not root.startswith("s3://"):
            return DirectorySource(root)
        if cache_dir is None:
            raise ConfigError(f"adapter source {root} needs a cache directory (--adapter-cache-dir)")
        return S3Source(root, cache_dir, cache_bytes, limits)

    # --- look-ups ----------------------------------------------------------------------

    def lookup(self, name: str) -> Future:
        """A future of the adapter `name` names (a ConfinedDir) or None when no source holds
        it. Raises InvalidNameError now for a name the rule refuses; the future fails with
        an AdapterError for a tree that leads out of its source or a copy refused a moment
        ago, ObjectStoreError for a store that failed, SourceBusyError."""
        validate_adapter_name(name)
        with self._lock:
            now = self._clock()
            until = self._missing.get(name)
            refused = self._refused.get(name)
            if until is not None and now < until:
                return _done(None)
            if refused is not None and now < refused[0]:
                return _failed(refused[1])
            future = self._inflight.get(name)
            if future is None:
                future = self._inflight[name] = Future()
                future.add_done_callback(lambda f: self._settled(name, f))
                start = True
            else:
                start = False
        if start:
            self._step(name, 0, future)
        return future

    def find(self, name: str) -> ConfinedDir | None:
        """lookup(name), waited for (tests, tools; the server awaits the future)."""
        return self.lookup(name).result()

    def _step(self, name: str, i: int, outer: Future) -> None:
        """Ask source i (on its own threads), then the next, until one holds `name`."""
        if i == len(self.sources):
            outer.set_result(None)
            return
        source = self.sources[i]
        inner = self._pools[id(source)].submit(source.find, name)
        self._queued.watch(inner, f"adapter source {source}")

        def done(f: Future) -> None:
            error = _error_of(f, source)
            if error is not None:
                outer.set_exception(error)
            elif f.result() is not None:
                if not isinstance(source, DirectorySource):
                    with self._lock:
                        self._found[name] = (source, f.result())
                outer.set_result(f.result())
            else:
                self._step(name, i + 1, outer)

        inner.add_done_callback(done)

    def _settled(self, name: str, future: Future) -> None:
        with self._lock:
            if self._inflight.get(name) is future:
                del self._inflight[name]
            if future.exception() is None and future.result() is None:
                self._missing[name] = self._clock() + self.negative_ttl_s
                self._missing.move_to_end(name)
                while len(self._missing) > MAX_REMEMBERED_MISSES:
                    self._missing.popitem(last=False)
            elif future.exception() is None:
                self._missing.pop(name, None)

    # --- copies of remote adapters ---------------------------------------------------------

    def from_remote(self, name: str) -> bool:
        """Whether `name` was found in a bucket or the Hub: only then is there a copy to
        refresh or drop."""
        return name in self._found

    def refresh(self, name: str) -> Future | None:
        """Before a request for a registered name found in a remote source: its copy (the
        directory the engine registered) is checked, and fetched again on the source's own
        threads if the cache dropped it; None when there is nothing to fetch. Best effort:
        a resident adapter needs no copy, and a landing without one fails on its own."""
        entry = self._found.get(name)
        if entry is None:
            return None
        source, found = entry
        if all((found.path / f).is_file() for f in ADAPTER_FILES):
            if isinstance(source, S3Source):
                source.cache.record(name)  # the most recently used
            return None
        future = self._pools[id(source)].submit(_best_effort, source, name)
        self._queued.watch(future, f"adapter source {source}")
        return future

    def refused(self, name: str) -> None:
        """`name`'s copy failed a content check (its registration or a landing refused it):
        dropped from its store's cache, so the next look-up fetches it again."""
        entry = self._found.get(name)
        if entry is not None:
            entry[0].discard(name, entry[1])

    def remember_refusal(self, name: str, error: MetraleError) -> None:
        """A registration refused `name`'s files: for REFUSED_TTL_S its look-ups fail with
        `error` at once (a stream of requests does not fetch it again and again)."""
        self.refused(name)
        with self._lock:
            self._refused[name] = (self._clock() + self.refused_ttl_s, error)
            for stale in [n for n, (until, _) in self._refused.items() if until <= self._clock()]:
                del self._refused[stale]


def _best_effort(source: Source, name: str) -> None:
    try:
        source.find(name, revalidate=False)
    except MetraleError as e:
        log.warning("adapter %r: its copy could not be fetched again: %s", name, e)


def _error_of(f: Future, source: Source) -> BaseException | None:
    if f.cancelled():  # waited a whole deadline for one of the source's threads
        return SourceBusyError(f"adapter source {source} is busy: every one of its fetch "
                               "threads stayed taken for a whole fetch timeout; retry later")
    error = f.exception()
    if error is None or isinstance(error, MetraleError):
        return error
    log.error("adapter source %s failed unexpectedly", source, exc_info=error)
    # nobody foresaw it: the store's fault (502) for a remote one, the tree's (422) for a
    # directory; either way this request's, never the server's (500)
    what = f"adapter source {source} failed: {type(error).__name__}: {str(error)[:200]}"
    return AdapterFileError(what) if isinstance(source, DirectorySource) else ObjectStoreError(what)


def _done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


def _failed(error: BaseException) -> Future:
    f = Future()
    f.set_exception(error)
    return f


class _QueueDeadlines:
    """Cancels a look-up still queued for its source's threads after timeout_s (one thread
    for all sources, asleep while nothing is queued)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._heap: list[tuple[float, int, Future]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, future: Future, what: str) -> None:
        if future.running() or future.done():
            return
        with self._wake:
            heapq.heappush(self._heap, (time.monotonic() + self.timeout_s, next(self._order), future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metrale-fetch-queue",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._heap and (self._heap[0][2].running() or self._heap[0][2].done()):
                    heapq.heappop(self._heap)  # started (or over): its deadline is its own
                if not self._heap:
                    self._wake.wait()
                    continue
                until = self._heap[0][0]
                left = until - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                heapq.heappop(self._heap)[2].cancel()  # still queued: never started
