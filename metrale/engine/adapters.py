"""AdapterManager: binds requests to adapter slots and lands adapters into the pool.

Names and versions belong to the AdapterRegistry; slot policy to the SlotTable; bytes
to the pool. This module asks each of them and orchestrates landings:

- explicit landings (`land`, `land_new`): synchronous, on the calling thread;
- on-demand promotions for waiting requests: single-flight per name, one at a time,
  FIFO by first request. Reading and checking the adapter (disk or peer) and writing
  its bytes into the LOADING slot run on a worker thread (on CUDA on a side stream), so
  the engine keeps decoding; the victim is chosen and the landing committed at step
  boundaries, on the engine thread.

Every landing commits only if the version it read is still its name's current one;
otherwise the slot ends EMPTY with a fresh uid and the current version is promoted.
Waiters take their slot reference the moment their adapter lands, so it cannot be
evicted before they run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from metrale.adapters.identity import adapter_identity
from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion
from metrale.engine.sequence import Sequence
from metrale.errors import (
    AdapterFileError,
    AllSlotsPinnedError,
    LandingError,
    MetraleError,
    PoolFullError,
    StaleVersionError,
    UnknownAdapterError,
)
from metrale.peer.landing import prepare_from_peer
from metrale.pool.landing import Landing
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LandingEvent, LoraSlots, Prepared, on_device

log = logging.getLogger("metrale.engine")


@dataclass(frozen=True)
class PeerOptions:
    transport: str = "auto"
    timeout_s: float = 30.0
    peer_allow: tuple[str, ...] | None = None


@dataclass
class _Job:
    """One on-demand promotion: staged (worker) -> launched (slot LOADING, bytes being
    written by the worker) -> committed or failed at a step boundary."""

    version: AdapterVersion
    staged: Future  # -> Prepared, or None: a host-tier hit, landed on the engine thread
    start: float
    landing: Landing | None = None
    prepared: Prepared | None = None
    written: Future | None = None  # -> the CUDA event that completes the write, or None
    evicted: str | None = None

    @property
    def progressing(self) -> bool:
        """Moving without the engine's help (staging, or bytes being written)."""
        if self.landing is None:
            return not self.staged.done()
        if not self.written.done():
            return True
        event = self.written.result() if self.written.exception() is None else None
        return event is not None and not event.query()


class AdapterManager:
    def __init__(self, slots: LoraSlots, registry: AdapterRegistry, timeout_s: float,
                 peer: PeerOptions, async_promotions: bool = True,
                 max_in_flight: int = 2, drain_busy_slots: bool = True) -> None:
        self.slots, self.registry, self.timeout_s, self.peer = slots, registry, timeout_s, peer
        self.max_in_flight, self.drain_busy_slots = max_in_flight, drain_busy_slots
        self.pending: OrderedDict[str, list[Sequence]] = OrderedDict()
        self.num_promotions = 0
        self.num_drains = 0  # busy slots detached so that a landing can take them
        self.num_reattached = 0  # drains undone: a request for that adapter came first
        # name -> (slot, landing uid, version) of a slot being drained, for reattach
        self._drained: dict[str, tuple[int, int, AdapterVersion | None]] = {}
        # slot -> work left on it (tokens its requests may still compute); the engine sets it
        self.remaining_work: Callable[[], dict[int, int]] = dict
        # requests whose adapter was resident on arrival vs those that waited for a landing
        self.num_ready_on_arrival = self.num_waited_for_adapter = 0
        self.device = slots.staging.device
        self._async = async_promotions and slots.pool is not None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="metrale-land") if self._async else None
        self._staging = StagingBuffers(self.device)  # the worker's, never the engine thread's
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.job: _Job | None = None

    # --- reading adapters ---------------------------------------------------------------

    def prepare(self, name: str, source: AdapterSource, staging: StagingBuffers | None = None,
                use_tier: bool = True) -> Prepared:
        """Read and check `source` as `name`, touching no slot (see LoraSlots.prepare_disk)."""
        if source.peer is not None:
            p = self.peer
            return prepare_from_peer(self.slots, source.peer.addr, source.peer.adapter_id, name,
                                     source.peft, staging=staging, transport=p.transport,
                                     timeout_s=p.timeout_s, peer_allow=p.peer_allow)
        return self.slots.prepare_disk(source.path, name, staging, use_tier)

    # --- binding requests -----------------------------------------------------------------

    def bind(self, seq: Sequence) -> None:
        """Bind seq to its adapter's slot if the current version is resident; else queue
        it for a promotion."""
        if seq.adapter is None:
            seq.slot, seq.adapter_uid, seq.bound = -1, 0, True
            seq.bound_at = seq.arrival
            return
        self.registry.current(seq.adapter)
        drained = self._drained.pop(seq.adapter, None)
        # only the version still current may come back (a reload or a swap since made a new one)
        if drained is not None and drained[2] is not None and self.registry.is_current(drained[2]) \
                and self.slots.table.reattach(seq.adapter, drained[0], drained[1]):
            self.num_reattached += 1
        if self.slots.table.slot_of(seq.adapter) is not None:
            seq.slot, seq.adapter_uid = self.slots.table.acquire(seq.adapter)
            seq.bound, seq.bound_at = True, seq.arrival
            self.num_ready_on_arrival += 1
            return
        self.num_waited_for_adapter += 1
        self.pending.setdefault(seq.adapter, []).append(seq)

    def release(self, seq: Sequence) -> None:
        if seq.bound and seq.slot >= 0:
            self.slots.table.release(seq.slot)
        seq.bound = False
        waiters = self.pending.get(seq.adapter or "")
        if waiters and seq in waiters:
            waiters.remove(seq)
            if not waiters:
                del self.pending[seq.adapter]

    def _bind_waiters(self, name: str) -> None:
        now = time.monotonic()
        for seq in self.pending.pop(name, []):
            seq.slot, seq.adapter_uid = self.slots.table.acquire(name)
            seq.bound, seq.bound_at = True, now

    # --- explicit landings (synchronous) ------------------------------------------------

    def land(self, version: AdapterVersion, slot: int | None = None,
             prepared: Prepared | None = None,
             origin: AdapterSource | None = None) -> tuple[int, str | None]:
        """Land a registered version into `slot` (None: a victim). `prepared`: bytes
        already read off the engine thread; they are closed here. `origin`: where those
        bytes came from when not the version's own source (a cluster replica staging the
        version from a neighbour's slot), so metrics and logs name the real source."""
        if not self.registry.is_current(version):
            if prepared is not None:
                prepared.close()
            raise StaleVersionError(
                f"adapter {version.name!r} was reloaded or unloaded meanwhile; retry")
        source, name = version.source, version.name

        def prepare() -> Prepared:
            return prepared if prepared is not None else self.prepare(name, source)

        slot, evicted = self._land_with(name, origin or source, slot, prepare)
        self._landed(version, slot)
        return slot, evicted

    def land_new(self, name: str, source: AdapterSource, slot: int | None = None,
                 prepared: Prepared | None = None) -> tuple[int, str | None]:
        """Land `source` as `name` and make it the name's current version (a reload of an
        existing name). A refusal changes nothing, the registry included."""
        try:
            self.registry.check_new(name, reload=True)
        except MetraleError:
            if prepared is not None:
                prepared.close()
            raise

        def prepare() -> Prepared:
            return prepared if prepared is not None else self.prepare(name, source)

        slot, evicted = self._land_with(name, source, slot, prepare)
        self._landed(self.registry.register(name, source, reload=True), slot)
        return slot, evicted

    def _land_with(self, name: str, source: AdapterSource, slot: int | None,
                   prepare) -> tuple[int, str | None]:
        kind = "peer" if source.peer is not None else "disk"
        if slot is None:
            return self.slots.promote_from(f"promote_lora_slot_from_{kind}", name, str(source),
                                           prepare)
        self.slots.swap_from(f"swap_lora_slot_from_{kind}", name, slot, str(source), prepare)
        return slot, None

    def _landed(self, version: AdapterVersion, slot: int) -> None:
        if version.pinned:
            self.slots.table.set_pinned(slot, True)
        self._bind_waiters(version.name)

    # --- names leaving ----------------------------------------------------------------------

    def detach(self, name: str) -> None:
        """A reload: the old version's slot finishes its in-flight requests, takes no new."""
        self._drained.pop(name, None)  # never reattach the old version
        self.slots.table.detach(name)

    def unload(self, name: str) -> str:
        """'unloaded' when the slot (if any) is free now, 'draining' when it is freed after
        its last in-flight request."""
        table = self.slots.table
        slot = table.slot_of(name)
        busy = slot is not None and table.ref_count(slot) > 0
        self.registry.unload(name, slot if busy else None)
        self._drained.pop(name, None)
        if slot is None:
            return "unloaded"
        if not busy:
            self.slots.unload_slot(slot)
            return "unloaded"
        table.detach(name)
        return "draining"

    def finish_unloads(self) -> None:
        table = self.slots.table
        for name, slot in self.registry.draining().items():
            info = table.info(slot)
            if info.ref_count:
                continue
            if info.name is None and info.state.value == "READY":
                self.slots.unload_slot(slot)
            self.registry.drained(name)

    # --- on-demand promotions (the engine calls these between steps) ---------------------

    def busy(self) -> bool:
        """A promotion is moving off the engine thread: worth waiting for when idle."""
        return self.job is not None and self.job.progressing

    def promoting(self) -> str | None:
        """The name whose promotion is in flight (its waiters wait for bytes, not a slot)."""
        job = self.job
        return job.version.name if job is not None and job.progressing else None

    def wait(self, timeout: float) -> None:
        """Block up to timeout for the in-flight promotion's current phase."""
        job = self.job
        if job is None:
            return
        future = job.staged if job.landing is None else job.written
        deadline = time.monotonic() + timeout
        wait_futures([future], timeout)
        while job.progressing and time.monotonic() < deadline:  # a CUDA event: no blocking wait
            time.sleep(50e-6)

    def advance(self, now: float) -> list[Sequence]:
        """Move promotions on by what happened since the last boundary; returns the
        sequences that failed (their adapter was refused, unloaded, or never got a slot)."""
        failed = self._guarded(self._advance_job)
        for _ in range(self.max_in_flight):
            # a host-tier landing completes inline, so the next name can start at once;
            # one that reads from disk or a peer stays in flight
            if self.job is not None or not self.pending:
                break
            before = len(self.pending)
            failed += self._guarded(self._start_next)
            if self.job is None and len(self.pending) == before:
                break  # nothing could start
        if self.drain_busy_slots:
            self._drain_for_waiting()
        return failed + self._expire(now)

    def _drain_for_waiting(self) -> None:
        """Names waiting for a slot while every slot is busy: stop giving new requests to
        the busy slot with the least work left (detach its adapter), so it drains instead
        of being fed by new arrivals forever; at most max_in_flight slots are kept free or
        draining for the waiting names. A request for the drained adapter that comes
        before the slot is taken undoes the drain (bind reattaches it)."""
        job = self.job
        waiting = len(self.pending) - (1 if job is not None and job.landing is not None else 0)
        table = self.slots.table
        need = min(waiting, self.max_in_flight) - table.num_free_for_landing()
        work = self.remaining_work() if need > 0 else {}
        for _ in range(need):
            name = table.drain_candidate(work)
            if name is None:
                return
            version = self.registry.get(name)  # what a slot named `name` holds
            slot = table.detach(name)
            self._drained[name] = (slot, table.info(slot).uid, version)
            self.num_drains += 1

    def _guarded(self, advance) -> list[Sequence]:
        """A failure nobody foresaw in one promotion fails that promotion's requests with a
        typed error and frees its slot; it never reaches the engine loop."""
        try:
            return advance()
        except Exception as e:
            job, self.job = self.job, None
            if job is None:
                raise  # not a promotion's failure: a bug in the loop itself
            log.exception("promotion of %r failed unexpectedly", job.version.name)
            error = LandingError(f"landing adapter {job.version.name!r} failed: {e!r}")
            if job.landing is not None and job.landing.is_open:
                job.landing.fail(e)
            if job.prepared is not None:
                job.prepared.close()
            self._notify(job, None, error)
            return self._fail(job.version.name, error)

    def _start_next(self) -> list[Sequence]:
        failed = []
        for name in list(self.pending):
            version = self.registry.get(name)
            if version is None:
                failed += self._fail(name, UnknownAdapterError(f"adapter {name!r} was unloaded"))
                continue
            if self.slots.table.slot_of(name) is not None:  # landed meanwhile by an explicit op
                self._bind_waiters(name)
                continue
            try:
                self.slots.require_swappable("promote")
                self.slots.table.select_victim()
            except AllSlotsPinnedError as e:  # waiting cannot help: say so now
                failed += self._fail(name, e)
                continue
            except PoolFullError:
                pass  # stage now; a slot may drain by the time the bytes are ready
            except MetraleError as e:
                failed += self._fail(name, e)
                continue
            self.job = _Job(version, self._submit(self._stage, version), time.perf_counter())
            failed += self._advance_job()  # inline (not async): it may be done already
            break  # one promotion at a time; later names keep their place
        return failed

    def _stage(self, version: AdapterVersion) -> Prepared | None:
        """Worker: everything that may refuse the adapter, nothing that touches a slot."""
        source = version.source
        with on_device(self.device), self._on_stream():
            if source.peer is not None:
                return self.prepare(version.name, source, self._staging)
            identity = adapter_identity(source.path)  # read once: for the tier and the plan
            if self.slots.tier_has(identity):
                return None  # a tier image is landed on the engine thread (it owns image memory)
            return self.slots.prepare_disk(source.path, version.name, self._staging,
                                           use_tier=False, identity=identity)

    def _write(self, landing: Landing, prepared: Prepared) -> torch.cuda.Event | None:
        """Worker: the bytes into the LOADING slot; on CUDA, queued on the side stream."""
        with on_device(self.device), self._on_stream():
            prepared.write(landing)
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
            return event

    def _advance_job(self) -> list[Sequence]:
        job = self.job
        if job is None or job.progressing:
            return []
        name = job.version.name
        if job.landing is None:
            return self._launch(job)
        self.job = None
        job.prepared.close()
        try:
            event = job.written.result()
            if event is not None:
                event.synchronize()  # complete already; raises a device error if any
        except BaseException as e:
            error = job.landing.fail(e)
            self._notify(job, None, error)
            return self._fail(name, error)
        if not self.registry.is_current(job.version) or self.slots.table.slot_of(name) is not None:
            job.landing.fail("superseded while landing")  # by a reload, an unload or an explicit land
            return []
        try:
            job.landing.commit(name)
        except MetraleError as e:
            self._notify(job, None, e)
            return self._fail(name, e)
        self.slots.fill_tier(job.prepared, job.landing.slot)
        self._promoted(job, job.landing.slot)
        return []

    def _launch(self, job: _Job) -> list[Sequence]:
        """Staged: pick a victim, open the landing and hand the write to the worker."""
        name = job.version.name
        if not self.registry.is_current(job.version) or name not in self.pending:
            self.job = None  # superseded or abandoned before touching a slot
            self._close_staged(job)
            return []
        try:
            prepared = job.staged.result()
        except BaseException as e:
            self.job = None
            error = e if isinstance(e, MetraleError) else AdapterFileError(
                f"reading {job.version.source} failed: {e!r}")
            self._notify(job, None, error)
            return self._fail(name, error)
        try:
            slot = self.slots.table.select_victim()
        except AllSlotsPinnedError as e:  # pinned meanwhile: no slot will ever drain
            self.job = None
            self._close_staged(job)
            return self._fail(name, e)
        except PoolFullError:
            return []  # keep the staged bytes; wait for a slot to drain
        job.evicted = self.slots.table.info(slot).name
        if prepared is None:  # host-tier hit: one H2D copy, here
            try:
                self.slots.land(slot, name, self.prepare(name, job.version.source))
            except MetraleError as e:
                self.job = None
                self._notify(job, None, e)
                return self._fail(name, e)
            self.job = None
            self._promoted(job, slot)
            return []
        job.prepared = prepared
        with on_device(self.device):
            if self._stream is not None:
                # after every kernel already queued: the last step may have read the victim
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with self._on_stream():
                    job.landing = self.slots.begin(slot)
            except MetraleError as e:
                self.job = None
                prepared.close()
                self._notify(job, None, e)
                return self._fail(name, e)
        job.written = self._submit(self._write, job.landing, prepared)
        return [] if self._async else self._advance_job()

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _submit(self, fn, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        future: Future = Future()  # not async: run it here
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future

    def _close_staged(self, job: _Job) -> None:
        if job.staged.done() and job.staged.exception() is None and job.staged.result() is not None:
            job.staged.result().close()

    def _promoted(self, job: _Job, slot: int) -> None:
        self.num_promotions += 1
        log.info("promoted %r into slot %d (evicted %r) in %.1f ms for %d waiting request(s)",
                 job.version.name, slot, job.evicted, (time.perf_counter() - job.start) * 1e3,
                 len(self.pending.get(job.version.name, [])))
        self._notify(job, slot, None)
        self._landed(job.version, slot)

    def _notify(self, job: _Job, slot: int | None, error: MetraleError | None) -> None:
        kind = "peer" if job.version.source.peer is not None else "disk"
        self.slots.notify(LandingEvent(f"promote_lora_slot_from_{kind}", job.version.name, slot,
                                       job.evicted if slot is not None else None,
                                       time.perf_counter() - job.start, error))

    def _expire(self, now: float) -> list[Sequence]:
        """Waiters past the promotion timeout fail with POOL_FULL. The timeout bounds the
        wait for a free slot; a promotion in flight is bounded by its own I/O deadlines."""
        failed = []
        promoting = self.promoting()
        for name, waiters in list(self.pending.items()):
            if name == promoting:
                continue
            late = [s for s in waiters if now - s.arrival > self.timeout_s]
            for seq in late:
                waiters.remove(seq)
                seq.error = PoolFullError(
                    f"POOL_FULL: waited {self.timeout_s:.0f}s for an adapter slot for {name!r}: "
                    "every cache slot stayed busy or pinned; retry later")
            failed += late
            if not waiters:
                del self.pending[name]
        return failed

    def _fail(self, name: str, error: BaseException) -> list[Sequence]:
        waiters = self.pending.pop(name, [])
        for seq in waiters:
            seq.error = error
        log.warning("promotion of %r failed for %d request(s): %s", name, len(waiters), error)
        return waiters

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
