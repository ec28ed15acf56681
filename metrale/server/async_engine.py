"""AsyncEngine: the LLMEngine on one background thread, for an asyncio server; it
implements EngineAPI (engine_api.py), and the cluster's replica code uses the few
methods beyond it.

The engine is single-threaded by design: every mutation (admission, abort, adapter
operations) goes through `engine.call_soon` and runs on the engine thread between two
steps. The thread steps while there is work and sleeps on an Event when there is none;
each RequestOutput reaches its request's asyncio queue through `call_soon_threadsafe`,
so the coroutines may be awaited from any event loop (a cluster replica runs several).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from metrale.adapters.confined import ConfinedDir
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.outputs import RequestOutput
from metrale.engine.registry import AdapterSource
from metrale.engine.residency import ResidencyRow
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.siblings import sibling_id
from metrale.errors import MetraleError, PeerUnavailableError, SamplingError
from metrale.peer.allow import LOOPBACK
from metrale.peer.exporter import AdapterExporter
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.store import resolve_transports
from metrale.pool.swap import Prepared
from metrale.server.adapter_ops import AdapterOps, AdapterView
from metrale.server.engine_api import AdapterListing, EngineLimits
from metrale.server.errors import EngineUnavailableError
from metrale.server.metrics import ServerMetrics
from metrale.server.vllm_metrics import FinishedRequest

log = logging.getLogger("metrale.server")
T = TypeVar("T")

# While requests wait for a slot (POOL_FULL) no step makes progress; poll at this
# period so promotion timeouts still fire, instead of spinning on empty steps.
_WAIT_POLL_S = 0.02


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    max_tokens: int
    queued: float | None = None  # handed to the engine (its Sequence's arrival), engine thread
    scheduled: float | None = None  # first scheduled to run, known with its first output
    first_token: float | None = None
    last_token: float | None = None

    def finished(self, reason: str, now: float, out: RequestOutput | None = None) -> FinishedRequest:
        """The request's life for vLLM's histograms; no `out`: the consumer left, and the
        request counts as never run."""
        if out is None:
            return FinishedRequest(reason, self.arrival, now, self.max_tokens)
        return FinishedRequest(
            reason, self.arrival, now, self.max_tokens, scheduled=self.scheduled,
            first_token=self.first_token, last_token=self.last_token,
            prompt_tokens=len(out.prompt_token_ids), generated_tokens=len(out.token_ids),
            cached_prompt_tokens=out.num_cached_tokens)


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """on_fatal: called on the engine thread if the loop itself fails (not one request:
        those fail alone); the server exits the process rather than answer 503 forever."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.limits = EngineLimits(engine.max_seq_tokens, engine.model_config.vocab_size)
        self._on_fatal = on_fatal
        self.metrics = ServerMetrics()
        engine.lora.listeners.append(self.metrics.on_landing)
        self.ops = AdapterOps(engine, self.metrics)
        self._streams: dict[str, _Stream] = {}  # touched by both threads; dict ops are atomic
        self._futures: set[concurrent.futures.Future] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._accepting = True

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self._fail_leftovers(EngineUnavailableError("the server is shutting down"))

    # --- calls onto the engine thread ---------------------------------------------------

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        if not self.alive:
            raise EngineUnavailableError(
                f"the engine is not running{f' (it failed: {self.error})' if self.error else ''}")
        future = self.engine.call_soon(fn)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        self._wake.set()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between two steps; its exception is raised here."""
        return await asyncio.wrap_future(self.submit(fn))

    # --- generation ---------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Every completion's outputs (params.n of them, told apart by their index) until
        all finished; leaving early aborts those still running."""
        if not self._accepting:
            raise EngineUnavailableError("the server is shutting down")
        if params.structured is not None:
            # compiled here, off the engine thread (cached: admission finds it); a refusal
            # is the request's 400 before anything is queued
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)
        request_id = f"req-{uuid.uuid4().hex}"
        loop, queue, arrival = asyncio.get_running_loop(), asyncio.Queue(), time.monotonic()
        ids = [sibling_id(request_id, i) for i in range(params.n)]
        streams = {i: _Stream(loop, queue, arrival, params.max_tokens) for i in ids}
        self._streams.update(streams)  # before admission: no output can be missed

        def admit() -> str:
            now = time.monotonic()
            for stream in streams.values():
                stream.queued = now
            return self.engine.add_request(prompt, params, adapter, request_id)

        running, admitted, failed = set(ids), False, False
        try:
            await self.call(admit)
            admitted = True
            while running:
                out = await queue.get()
                if isinstance(out, BaseException):  # engine died or shut down
                    failed = True
                    raise out
                if out.error is not None:
                    failed = True
                    running.discard(out.request_id)
                    raise out.error
                if out.finished:
                    running.discard(out.request_id)
                yield out
        finally:
            for i in ids:
                self._streams.pop(i, None)
            left = [] if failed and not admitted else sorted(running)
            if admitted and left and not failed:  # the consumer left: vLLM counts it as aborted
                for i in left:
                    self.metrics.vllm.finished(streams[i].finished("abort", time.monotonic()))
            if left and self.alive:
                # the consumer left early (or admission was cancelled mid-flight);
                # abort of an unknown id is a no-op, so this is safe either way
                with contextlib.suppress(EngineUnavailableError):  # stopped: shutdown aborts it
                    self.submit(lambda: [self.engine.abort(i) for i in left])

    # --- adapter management: bytes read here, off the engine thread; changes on it ----------

    async def check_adapter(self, name: str, path: str | Path | AdapterSource) -> AdapterSource:
        """Validate the adapter's files (or ask its peer) on a thread; raises AdapterError,
        PeerNotAllowedError, PeerUnavailableError."""
        return await asyncio.to_thread(self.engine.check_adapter, name, path)

    async def register(self, name: str, path: str | Path | ConfinedDir | AdapterSource,
                       pinned: bool = False,
                       reload: bool = False, verify_on_landing: bool = False) -> AdapterView:
        source = await self._checked(name, AdapterSource.of(path, verify_on_landing), reload)
        return await self._with_bytes(name, source if pinned else None,  # pinned: lands now
                                      lambda p: self.ops.register(name, source, pinned, reload, p))

    async def promote(self, name: str) -> tuple[AdapterView, str | None]:
        version = await self.call(lambda: self.ops.cold_version(name))
        return await self._with_bytes(name, version and version.source,
                                      lambda p: self.ops.promote(name, p))

    async def promote_via(self, name: str, sources: Sequence[AdapterSource]) -> AdapterSource | None:
        """Make `name`'s current version resident from the first of `sources` that reads
        (neighbours holding that same version), not from its registered source: the source
        it landed from, or None when it was resident already. Raises UnknownAdapterError,
        the last read's refusal when none read (PeerUnavailableError, AdapterError ...),
        the landing's (PoolFullError; StaleVersionError: reloaded meanwhile)."""
        version = await self.call(lambda: self.ops.cold_version(name))
        if version is None:
            return None
        error: MetraleError = PeerUnavailableError(f"no source to read {name!r} from")
        for source in sources:
            try:
                prepared = await self._read(name, source)
            except MetraleError as e:
                log.info("reading %r from %s failed (%s); next", name, source, e)
                error = e
                continue
            await self._land(prepared, functools.partial(self.engine.promote, version, None, origin=source))
            return source
        raise error

    async def swap(self, name: str, slot: int,
                   path: str | Path | ConfinedDir | AdapterSource | None = None,
                   reload: bool = False) -> AdapterView:
        if path is None:
            source = await self.call(lambda: self.engine.registry.changeable(name).source)
            return await self._with_bytes(name, source, lambda p: self.ops.swap(name, slot, None, False, p))
        source = await self._checked(name, path, reload)
        return await self._with_bytes(name, source, lambda p: self.ops.swap(name, slot, source, reload, p))

    async def pin(self, name: str, pinned: bool = True) -> AdapterView:
        version = await self.call(lambda: self.ops.cold_version(name)) if pinned else None
        return await self._with_bytes(name, version and version.source,
                                      lambda p: self.ops.set_pinned(name, pinned, p))

    async def unload(self, name: str) -> str:
        return await self.call(lambda: self.ops.unload(name))

    async def residency(self) -> AdapterListing:
        return await self.call(self.ops.listing)

    async def rows(self) -> list[ResidencyRow]:
        """The engine's residency rows (engine/residency.py), for the cluster's readers."""
        return await self.call(self.engine.residency)

    async def is_known(self, name: str) -> bool:
        return await self.call(lambda: self.engine.registry.get(name) is not None)

    async def exposition(self) -> bytes:
        return self.metrics.exposition()

    async def starting(self) -> str | None:
        return None  # serve() registers the start-up adapters before the app exists

    def export(self, host: str, port: int, peer_allow: tuple[str, ...],
               transport: str) -> PeerHTTPServer:
        """Serve this engine's READY slots to peers on (host, port); a lease holds a slot
        reference, so a leased adapter is never swapped mid-transfer. Slot-table access
        runs on the engine thread, like every other mutation."""
        exporter = AdapterExporter(self.engine.lora, self.engine.registry,
                                   call=lambda fn: self.submit(fn).result(timeout=30),
                                   transports=resolve_transports(transport)).start()
        return PeerHTTPServer(exporter, host=host, port=port,
                              client_allow=peer_allow or LOOPBACK).start()

    async def reset_prefix_cache(self) -> int:
        # on the engine thread, between two steps: the block tables are not shared
        return await self.call(self.engine.reset_prefix_cache)

    async def _checked(self, name: str, path: str | Path | AdapterSource,
                       reload: bool) -> AdapterSource:
        """The refusals that need no I/O first, then the files (or the peer), validated."""
        await self.call(lambda: self.ops.check_register(name, reload))
        return await self.check_adapter(name, path)

    async def _with_bytes(self, name: str, source: AdapterSource | None,
                          land: Callable[[Prepared | None], T]) -> T:
        """Read and check the adapter on the engine's reader thread (a slow disk or peer
        stalls nobody), then land it on the engine thread; no source: nothing to read."""
        prepared = None if source is None else await self._read(name, source)
        return await self._land(prepared, land)

    async def _land(self, prepared: Prepared | None, land: Callable[[Prepared | None], T]) -> T:
        try:
            return await self.call(lambda: land(prepared))
        finally:
            if prepared is not None:  # a refused landing may not have closed it
                prepared.close()

    async def _read(self, name: str, source: AdapterSource) -> Prepared | None:
        """The engine's one reader (LLMEngine.read_adapter); None: a host-tier hit, landed
        from the tier on the engine thread. Awaitable from any event loop."""
        return await asyncio.wrap_future(self.engine.read_adapter(name, source))

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before step: a call arriving during the step re-sets it
                outputs = engine.step()
                self.ops.after_step()
                self._dispatch(outputs)
                if not outputs and not engine.wait_for_work(_WAIT_POLL_S):
                    self._wake.wait(_WAIT_POLL_S if engine.has_unfinished_requests() else None)
            for request_id in list(engine.requests):
                engine.abort(request_id)
        except BaseException as e:  # a bug or a device error: fail loudly, never hang clients
            log.exception("engine thread failed; the server can no longer generate")
            self.error = e
            self._stop.set()
            self._fail_leftovers(EngineUnavailableError(f"the engine failed: {e!r}"))
            if self._on_fatal is not None:
                self._on_fatal(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m, v = self.metrics, self.metrics.vllm
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.delta_token_ids:
                m.generated_tokens.labels(out.adapter or "").inc(len(out.delta_token_ids))
                v.generation_tokens.inc(len(out.delta_token_ids))
                if stream is not None:
                    self._timed_tokens(stream, out, now)
            if out.finished:
                m.finished.labels(out.finish_reason or "unknown").inc()
                if isinstance(out.error, SamplingError):  # non-finite logits
                    v.corrupted.inc()
                if stream is not None:
                    v.finished(stream.finished(out.finish_reason or "error", now, out))
            if stream is not None:
                self._put(stream, out)

    def _timed_tokens(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        m, v = self.metrics, self.metrics.vllm
        if stream.first_token is None:
            stream.first_token = now
            m.ttft.observe(now - stream.arrival)
            v.first_token(stream.arrival, now, len(out.prompt_token_ids), out.num_cached_tokens)
            if out.adapter_wait_s is not None:
                m.adapter_wait.observe(out.adapter_wait_s)
            if out.queue_wait_s is not None:
                m.queue_wait.observe(out.queue_wait_s)
                # the engine's clock: its Sequence arrived when the stream was queued
                stream.scheduled = stream.queued + out.adapter_wait_s + out.queue_wait_s
        else:
            m.itl.observe(now - stream.last_token)
            v.next_tokens(now - stream.last_token)
        stream.last_token = now

    @staticmethod
    def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody listens
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_leftovers(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._put(stream, error)
        if self._thread is not None and self._thread.is_alive() and \
                self._thread is not threading.current_thread():
            return  # still running commands (join timed out): never race it for a future
        for future in list(self._futures):
            with contextlib.suppress(RuntimeError):  # already running or done
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)

