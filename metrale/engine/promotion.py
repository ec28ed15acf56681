"""Promotions: one adapter version on its way into a slot, and the one driver that moves it,
one method per transition: READING (on the worker; no slot touched, so a refusal changes
nothing) -> WAITING for a slot -> WRITING (the slot LOADING) -> COMMITTED or FAILED
(docs/DESIGN.md, "One promotion"). An explicit landing is the same promotion run inline,
raising its failure. Victims are chosen and landings committed on the engine thread only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from enum import Enum

import torch

from metrale.adapters.identity import AdapterIdentity, adapter_identity
from metrale.config import EngineConfig
from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion
from metrale.errors import (
    AdapterFileError,
    AllSlotsPinnedError,
    LandingError,
    MetraleError,
    PoolFullError,
    SlotBusyError,
    SlotPinnedError,
    StaleVersionError,
)
from metrale.peer.landing import prepare_from_peer
from metrale.pool.landing import Landing
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LandingEvent, LoraSlots, Prepared, on_device

log = logging.getLogger("metrale.engine")


class Phase(Enum):
    READING = "reading"
    WAITING = "waiting for a slot"
    WRITING = "writing"
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass
class Promotion:
    version: AdapterVersion
    origin: AdapterSource  # where the bytes come from (a replica may read a neighbour's copy)
    target: int | None  # the slot asked for (a seed swap), or None: the promoter chooses
    installs: bool  # the version becomes its name's current one at commit (seed landings)
    read: Future  # -> Prepared, or None: a host-tier hit, read on the engine thread
    start: float
    phase: Phase = Phase.READING
    prepared: Prepared | None = None
    landing: Landing | None = None
    written: Future | None = None  # -> the CUDA event that completes the write, or None
    evicted: str | None = None
    slot: int | None = None
    error: MetraleError | None = None
    closed: bool = False  # what the read holds (a peer's lease) was released

    @property
    def name(self) -> str:
        return self.version.name

    @property
    def done(self) -> bool:
        return self.phase in (Phase.COMMITTED, Phase.FAILED)

    @property
    def progressing(self) -> bool:
        """Moving without the engine's help (reading, or bytes being written)."""
        if self.phase is Phase.READING:
            return not self.read.done()
        if self.phase is not Phase.WRITING or not self.written.done():
            return self.phase is Phase.WRITING
        event = self.written.result() if self.written.exception() is None else None
        return event is not None and not event.query()

    def wait(self, timeout: float) -> None:
        future = self.read if self.phase is Phase.READING else self.written
        if future is None:
            return
        deadline = time.monotonic() + timeout
        try:
            future.exception(timeout)
        except TimeoutError:
            return
        while self.progressing and time.monotonic() < deadline:  # a CUDA event: no blocking wait
            time.sleep(50e-6)


class Promoter:
    """Drives promotions: reads on one worker (the engine's only reader of adapter bytes),
    slot choice and commit on the engine thread."""

    def __init__(self, slots: LoraSlots, registry: AdapterRegistry, cfg: EngineConfig) -> None:
        self.slots, self.registry, self.cfg = slots, registry, cfg
        self.device = slots.staging.device
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="metrale-read") \
            if cfg.async_promotions and slots.pool is not None else None
        # staging memory for reads off the engine thread, one set per Prepared not yet closed
        self._free_staging: list[StagingBuffers] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # --- starting -----------------------------------------------------------------------

    def start(self, version: AdapterVersion) -> Promotion:
        """An on-demand promotion, READING on the worker (here when there is none)."""
        name, source = version.name, version.source
        read = self.read(name, source) if self._worker is not None \
            else self._submit(True, self._read_inline, name, source)
        return Promotion(version, source, None, False, read, time.perf_counter())

    def run_inline(self, version: AdapterVersion, *, target: int | None = None,
                   installs: bool = False, prepared: Prepared | None = None,
                   origin: AdapterSource | None = None) -> Promotion:
        """Every phase here, now; a failure is raised. `prepared` is closed here."""
        try:
            if not installs and not self.registry.is_current(version):
                raise StaleVersionError(
                    f"adapter {version.name!r} was reloaded or unloaded meanwhile; retry")
            self.slots.require_swappable(self._op(version, origin, target))
            self._slot_for(version, target)  # POOL_FULL, busy or pinned before reading anything
        except MetraleError:
            if prepared is not None:
                prepared.close()
            raise
        origin = origin or version.source
        read = self._submit(True, lambda: prepared if prepared is not None
                            else self._read_inline(version.name, origin))
        promotion = Promotion(version, origin, target, installs, read, time.perf_counter())
        self.advance(promotion, inline=True)
        if promotion.error is not None:
            raise promotion.error
        return promotion

    # --- the transitions ------------------------------------------------------------------

    def advance(self, p: Promotion, inline: bool = False) -> None:
        """Move `p` through every transition that is ready now."""
        try:
            if p.phase is Phase.READING and p.read.done():
                self._read_done(p)
            if p.phase is Phase.WAITING:
                self._take_slot(p, inline)
            if p.phase is Phase.WRITING and not p.progressing:
                self._written(p)
        except Exception as e:  # nobody foresaw it: fail this promotion, never the loop
            if p.done:
                raise
            log.exception("promotion of %r failed unexpectedly", p.name)
            self._fail(p, e)

    def _read_done(self, p: Promotion) -> None:
        """READING -> WAITING, or FAILED. Superseded wins over a read error: a file
        rewritten in place for the new version may fail the old version's read, and the
        waiters then get the current version, not that error."""
        if not self._still_wanted(p):
            self._fail(p, StaleVersionError(
                f"adapter {p.name!r} was reloaded or unloaded meanwhile; retry"), quiet=True)
            return
        try:
            p.prepared = p.read.result()
        except BaseException as e:
            self._fail(p, _typed(e, AdapterFileError, f"reading {p.origin} failed"))
            return
        p.phase = Phase.WAITING

    def _take_slot(self, p: Promotion, inline: bool) -> None:
        """WAITING -> WRITING once a slot is free; stays WAITING while none is (POOL_FULL
        is a wait, not an outcome; AllSlotsPinned is an outcome: nothing will drain)."""
        try:
            slot = self._slot_for(p.version, p.target)
        except (PoolFullError, SlotBusyError) as e:
            never = isinstance(e, (AllSlotsPinnedError, SlotPinnedError))
            if never or inline:  # inline, nothing frees a slot while it waits
                self._fail(p, e)
            return
        if p.prepared is None:  # a host-tier hit: its image is read here (engine thread)
            p.prepared = self._read_inline(p.name, p.origin)
        evicted = self.registry.name_in(slot)
        # inline: the copies queue on the current stream, ordered before the next step's
        # kernels with no host sync; else on the side stream, behind what is queued now
        # (the last step may have read the victim)
        side = None if inline else self._stream
        with on_device(self.device):
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(self.device))
            with self._on(side):
                p.landing = self.slots.begin(slot, zero=not p.prepared.fills_slot)
        if evicted is not None:
            self.registry.unroute(evicted)
        p.slot, p.phase = slot, Phase.WRITING
        p.evicted = evicted if evicted != p.name else None  # a pinned name's own slot
        p.written = self._submit(inline, self._write, p.landing, p.prepared, side)

    def _written(self, p: Promotion) -> None:
        """WRITING -> COMMITTED, or FAILED (a write error, or superseded meanwhile)."""
        try:
            event = p.written.result()
            if event is not None:
                event.synchronize()  # complete already; raises a device error if any
            p.landing.verify()  # a failed check failed the slot already
        except BaseException as e:
            self._fail(p, e)
            return
        if not self._still_wanted(p):  # by a reload, an unload or an explicit landing
            self._fail(p, StaleVersionError(
                f"adapter {p.name!r} was reloaded or unloaded while landing; retry"), quiet=True)
            return
        if p.installs:
            self.registry.install(p.version)
        p.landing.commit(p.version.version)  # a LandingError here failed the slot already
        self.registry.route(p.version, p.slot)
        self.slots.committed(p.prepared, p.landing.landed_at)
        self._closed(p)
        p.phase = Phase.COMMITTED
        log.info("%r landed in slot %d from %s (evicted %r) in %.1f ms", p.name, p.slot,
                 p.origin, p.evicted, (time.perf_counter() - p.start) * 1e3)
        self._notify(p)

    def _fail(self, p: Promotion, error: BaseException, quiet: bool = False) -> None:
        """The one failure path: an open landing leaves its slot EMPTY with a new uid (its
        LandingError is caused by `error`); other failures keep their typed error."""
        if p.landing is not None and p.landing.is_open:
            landing_error = p.landing.fail(error)
            if not isinstance(error, StaleVersionError):
                error = landing_error
        error = _typed(error, LandingError, f"landing adapter {p.name!r} failed")
        self._closed(p)
        p.error, p.phase = error, Phase.FAILED
        if not quiet:
            log.warning("promotion of %r failed: %s", p.name, error)
            self._notify(p)

    def abandon(self, p: Promotion) -> None:
        """Nobody waits for `p` any more and it touched no slot: let its read go."""
        self._closed(p)
        p.error, p.phase = StaleVersionError(f"promotion of {p.name!r} abandoned"), Phase.FAILED

    # --- helpers --------------------------------------------------------------------------

    def _still_wanted(self, p: Promotion) -> bool:
        if p.installs:
            return True  # a seed landing makes its version current at commit
        # a landing into a slot asked for moves a resident version there
        return self.registry.is_current(p.version) and (
            p.target is not None or self.registry.slot_of(p.name) is None)

    def _slot_for(self, version: AdapterVersion, target: int | None) -> int:
        """The slot asked for (idle, and not pinned by another name: a pin never moves to
        another adapter), a pinned name's own held slot once idle, or a victim."""
        registry, table = self.registry, self.slots.table
        if target is not None:
            table.require_idle(target)
            owner = registry.name_in(target)
            if target in registry.pinned_slots() and version.name != owner \
                    and registry.held_slot(version.name) != target:
                raise SlotPinnedError(f"slot {target} holds pinned adapter {owner!r}; unpin it first")
            return target
        held = registry.held_slot(version.name)
        if held is not None:
            table.require_idle(held)
            return held
        routes = registry.routes()
        dirs = {slot: source.path for name, slot in routes.items()  # where each came from
                if (source := registry.current(name).source).path is not None}
        return table.select_victim(registry.pinned_slots(), set(routes.values()),
                                   self.slots.cheap_slots(dirs))

    def read(self, name: str, source: AdapterSource) -> Future:
        """Read and check `source` as `name` on the worker (thread-safe): the engine's one
        reader of adapter bytes. The future gives a Prepared, with staging memory of its own
        until closed, or None for a host-tier hit (read on the engine thread, which alone
        reuses image memory)."""
        return self._submit(False, self._read_background, name, source)

    def _read_inline(self, name: str, source: AdapterSource) -> Prepared:
        return self._read(name, source, self.slots.staging, use_tier=True)

    def _read_background(self, name: str, source: AdapterSource) -> Prepared | None:
        # a file's identity is read once: for the tier and the plan
        identity = adapter_identity(source.path, source.root) if source.path is not None else None
        if self.slots.tier_has(identity):
            return None
        staging = self._free_staging.pop() if self._free_staging else StagingBuffers(self.device)
        try:
            with on_device(self.device), self._on(self._stream):
                prepared = self._read(name, source, staging, False, identity)
        except BaseException:
            self._free_staging.append(staging)
            raise
        returned = threading.Event()

        def close() -> None:
            prepared.close()
            if not returned.is_set():
                returned.set()
                self._free_staging.append(staging)

        return replace(prepared, close=close)

    def _read(self, name: str, source: AdapterSource, staging: StagingBuffers,
              use_tier: bool, identity: AdapterIdentity | None = None) -> Prepared:
        if source.peer is not None:
            cfg = self.cfg
            return prepare_from_peer(self.slots, source.peer.addr, source.peer.adapter_id, name,
                                     source.peft, staging=staging, transport=cfg.peer_transport,
                                     timeout_s=cfg.peer_timeout_s, peer_allow=cfg.peer_allow or None)
        return self.slots.prepare_disk(source.path, name, staging, use_tier, identity,
                                       verify=source.verify_on_landing, root=source.root)

    def _write(self, landing: Landing, prepared: Prepared,
               side: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """The bytes into the LOADING slot; on `side`, with the event that completes them."""
        with on_device(self.device), self._on(side):
            prepared.write(landing)
            if side is None:
                return None
            event = torch.cuda.Event()
            event.record(side)
            return event

    @staticmethod
    def _on(stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _submit(self, inline: bool, fn, *args) -> Future:
        """fn(*args) on the worker, or on this thread when inline or there is no worker."""
        if not inline and self._worker is not None:
            return self._worker.submit(fn, *args)
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future

    def _closed(self, p: Promotion) -> None:
        """Release what the read holds (a peer's lease), once."""
        if p.closed:
            return
        p.closed = True
        if p.prepared is None and p.read.done() and p.read.exception() is None:
            p.prepared = p.read.result()
        if p.prepared is not None:
            p.prepared.close()

    def _op(self, version: AdapterVersion, origin: AdapterSource | None, target: int | None) -> str:
        kind = "peer" if (origin or version.source).peer is not None else "disk"
        return f"{'swap' if target is not None else 'promote'}_lora_slot_from_{kind}"

    def _notify(self, p: Promotion) -> None:
        self.slots.notify(LandingEvent(self._op(p.version, p.origin, p.target), p.name,
                                       p.slot if p.phase is Phase.COMMITTED else None,
                                       p.evicted if p.phase is Phase.COMMITTED else None,
                                       time.perf_counter() - p.start, p.error))


def _typed(error: BaseException, cls: type[MetraleError], what: str) -> MetraleError:
    """A typed error for one nobody foresaw, caused by it."""
    if isinstance(error, MetraleError):
        return error
    typed = cls(f"{what}: {error!r}")
    typed.__cause__ = error
    return typed
