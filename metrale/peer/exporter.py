"""AdapterExporter: serve the READY slots of a LoraSlots to peers.

A lease holds one reference on its slot (SlotTable.acquire), as an in-flight sequence
does, so the bytes a peer reads cannot change under it; an expiry during an HTTP stream
waits for the stream to end. The slot table is touched only through `call`, which a
running engine points at its loop; the default runs it under a lock (the peer store).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.config import MOE_MODULES, MOE_PARAMS, ConfigError
from metrale.errors import UnknownAdapterError
from metrale.names import is_valid_name
from metrale.peer import wire
from metrale.peer.errors import (
    DataRangeError,
    LeaseNotFoundError,
    LeaseTTLError,
    ManifestVersionError,
    TooManyLeasesError,
)
from metrale.peer.ids import describe_ids
from metrale.peer.manifest import DTYPE_NAMES
from metrale.peer.nixl_transport import endpoint_for
from metrale.pool.slots import SlotState
from metrale.pool.swap import LoraSlots

log = logging.getLogger("metrale.peer")

Call = Callable[[Callable[[], object]], object]


class SlotNames(Protocol):
    """Who names the slots an exporter serves: the engine's registry, or a store's own."""

    def slot_of(self, name: str) -> int | None: ...

    def routes(self) -> dict[str, int]: ...
TRANSPORTS = ("http", "nixl")
# Bytes per socket write: few enough calls that Python's share is noise, and sendall
# releases the GIL for each.
SEND_SLICE = 8 << 20
HOST_COPY_BYTES = 2 << 30  # default bound on the host copies kept for later streams


@dataclass(frozen=True)
class LeaseReply:
    lease_id: str
    expires_in_s: float
    body: bytes  # the wire reply: lease, manifest header, PEFT config, tensor table


@dataclass(frozen=True)
class _Export:
    uid: int
    header: dict  # the reply header's lease-independent fields
    peft_raw: bytes
    table: np.ndarray  # wire.RECORD[n]
    views: list[torch.Tensor]  # contiguous canonical views into the pool, table order
    data_bytes: int
    tables: tuple[torch.Tensor, ...]  # the slot's (ranks, scales, doras) the table was built from


@dataclass
class _Lease:
    slot: int
    expires: float
    export: _Export  # the landing it was granted: its streams send that landing's bytes
    streams: int = 0
    ended: bool = False  # released or expired; the reference goes when streams == 0
    ref_held: bool = True


class AdapterExporter:
    def __init__(
        self, lora_slots: LoraSlots, names: SlotNames, *, call: Call | None = None,
        peft_for: Callable[[str], PeftAdapterConfig | None] | None = None,
        transports: tuple[str, ...] = ("http",), default_ttl_s: float = 30.0,
        max_ttl_s: float = 300.0, max_leases: int = 256, clock: Callable[[], float] = time.monotonic,
        host_copy_bytes: int = HOST_COPY_BYTES, copy_to_host: bool | None = None,
    ) -> None:
        if lora_slots.pool is None:
            raise UnknownAdapterError("this engine has no adapter pool: there is nothing to export")
        if lora_slots.area is not None:  # its slots hold rank 0's slices, not whole adapters
            raise ConfigError("a tensor-parallel engine's slots hold slices: it does not "
                              "export adapters to peers yet")
        if not transports or not set(transports) <= set(TRANSPORTS):
            raise ValueError(f"transports {transports!r}: choose from {TRANSPORTS}")
        self.slots, self.pool, self.names = lora_slots, lora_slots.pool, names
        self.transports = tuple(transports)
        self._table_lock = threading.Lock()
        self._call = call or self._locked
        self._peft_for = peft_for or (lambda name: None)
        self.default_ttl_s, self.max_ttl_s, self.max_leases = default_ttl_s, max_ttl_s, max_leases
        self._clock = clock
        self._lock = threading.Lock()  # guards _leases and _exports; never held across _call
        self._leases: dict[str, _Lease] = {}
        self._exports: dict[int, _Export] = {}  # slot -> what its current landing exports
        self._built: dict[int, _Export] = {}  # slot -> the last export built there (reused by shape)
        # None: copy when the pool is off the host (a host pool is sent from where it is)
        copy = self.pool.device.type != "cpu" if copy_to_host is None else copy_to_host
        self._host = _HostCopies(self.pool.device, host_copy_bytes, copy)
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        # the pool's one NIXL registration, shared with its landings
        self.nixl = endpoint_for(self.pool, self.pool.buffer) if "nixl" in self.transports else None

    def _locked(self, fn: Callable[[], object]) -> object:
        with self._table_lock:
            return fn()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, sweep_s: float = 0.25) -> AdapterExporter:
        """Expire leases in the background (their slots become swappable again)."""
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, args=(sweep_s,),
                                             name="metrale-peer-leases", daemon=True)
            self._sweeper.start()
        return self

    def _sweep(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.expire()
            except Exception:  # a dead engine loop must not kill the sweeper silently
                log.exception("peer exporter: expiring leases failed")

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids = list(self._leases)
        for lease_id in ids:
            try:
                self.release(lease_id)
            except LeaseNotFoundError:
                pass  # released meanwhile

    # --- the protocol --------------------------------------------------------------------

    def list_adapters(self) -> dict:
        def ready():
            table = self.slots.table
            return [(name, table.info(slot)) for name, slot in sorted(self.names.routes().items())]
        dtype = DTYPE_NAMES[self.pool.layout.dtype]
        return {"adapters": [
            {"id": name, "name": name, "uid": i.uid, "generation": i.generation,
             "dtype": dtype, "transports": list(self.transports)}
            for name, i in self._call(ready)]}

    def _ttl(self, ttl_s: object) -> float:
        """The lease's lifetime: default_ttl_s when none is asked for; a positive finite
        number of seconds, raised to 1 s and cut to max_ttl_s; anything else refused (NaN
        would never expire, every comparison with it being false: a slot pinned for good)."""
        if ttl_s is None:
            return self.default_ttl_s
        try:
            ttl = float(ttl_s) if type(ttl_s) in (int, float) else math.nan
        except OverflowError:  # an integer past float's range
            ttl = math.inf
        if not math.isfinite(ttl) or ttl <= 0:
            raise LeaseTTLError(f"ttl_s must be a positive, finite number of seconds (at most "
                                f"{self.max_ttl_s:g} are granted), got {str(ttl_s)[:30]}")
        return min(max(ttl, 1.0), self.max_ttl_s)

    def lease(self, adapter_id: str, ttl_s: float | None = None,
              manifest_version: object = wire.WIRE_VERSION) -> LeaseReply:
        """Pin the adapter's slot and describe it in one reply (metrale.peer.wire)."""
        if manifest_version != wire.WIRE_VERSION or type(manifest_version) is not int:
            raise ManifestVersionError(
                f"this peer speaks manifest version {wire.WIRE_VERSION}; the engine asked for "
                f"{'version 2 or older' if manifest_version is None else str(manifest_version)[:20]}"
                ": upgrade the older side")
        if not is_valid_name(adapter_id):
            raise UnknownAdapterError(f"adapter id {adapter_id!r} is not valid")
        ttl = self._ttl(ttl_s)
        with self._lock:
            if len(self._leases) >= self.max_leases:
                raise TooManyLeasesError(
                    f"{len(self._leases)} leases are open (max {self.max_leases}); retry later"
                )
        slot, info, tables, gone = self._call(lambda: self._take(adapter_id))
        try:
            for uid in gone:  # off the engine loop: a drop may wait for another stream's copy
                self._host.drop(uid)
            lease_id = secrets.token_urlsafe(18)
            export = self._export(slot, adapter_id, info, tables)
            header = {"version": wire.WIRE_VERSION, "lease": {"id": lease_id, "expires_in_s": ttl},
                      "adapter_id": adapter_id, **export.header}
            if "http" in self.transports:
                # "ranges" (?offset=&length=) came within wire version 3: older engines ignore it
                http = {"data_path": f"/peer/v1/leases/{lease_id}/data", "ranges": True}
                header["transports"] = {**header["transports"], "http": http}
            body = wire.encode(header, export.peft_raw, export.table)
        except BaseException:
            self._call(lambda: self.slots.table.release(slot))
            raise
        lease = _Lease(slot, self._clock() + ttl, export)
        with self._lock:
            self._leases[lease_id] = lease
        log.debug("peer exporter: lease %s on %r (slot %d, %d bytes, %.0fs)", lease_id[:8],
                  adapter_id, slot, export.data_bytes, ttl)
        return LeaseReply(lease_id, ttl, body)

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise LeaseNotFoundError(f"lease {lease_id[:16]!r} is unknown, released or expired")
            lease.ended = True
        self._drop_if_done(lease)

    def expire(self) -> None:
        now = self._clock()
        with self._lock:
            ids = [k for k, v in self._leases.items() if v.expires <= now and v.streams == 0]
        for lease_id in ids:
            try:
                self.release(lease_id)
                log.info("peer exporter: lease %s expired", lease_id[:8])
            except LeaseNotFoundError:
                pass  # released meanwhile

    def open_data(self, lease_id: str, offset: int = 0,
                  length: int | None = None) -> tuple[int, DataStream]:
        """(nbytes, stream) of the leased bytes [offset, offset + length) (length None: to
        the end), tensors concatenated in manifest order. Until the caller closes (or
        exhausts) the stream, it holds the lease's slot."""
        if "http" not in self.transports:
            raise LeaseNotFoundError("this exporter does not serve the HTTP data plane")
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires <= self._clock():
                raise LeaseNotFoundError(f"lease {lease_id[:16]!r} is unknown, released or expired")
            start, stop = _byte_range(offset, length, lease.export.data_bytes)  # before the hold
            lease.streams += 1  # an expiry now waits for this stream to end
        try:
            pieces = self._host.pieces(lease.export)  # the slot is held: its bytes are the lease's
        except BaseException:
            self._end_stream(lease)
            raise
        return stop - start, DataStream(_window(pieces, start, stop),
                                        lambda: self._end_stream(lease))

    @property
    def open_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def host_copies(self) -> list[int]:
        """The landing uids whose host copy is kept for later streams, oldest first."""
        return self._host.uids

    # --- internals -------------------------------------------------------------------------

    def _take(self, adapter_id: str):
        table = self.slots.table
        slot = self.names.slot_of(adapter_id)
        if slot is None:
            raise UnknownAdapterError(f"adapter {adapter_id!r} is not resident here; this peer "
                                      f"serves: {describe_ids(self.names.routes())}")
        table.acquire(slot)
        info = table.info(slot)
        uids = {i.slot: i.uid for i in table.infos() if i.state is SlotState.READY}
        with self._lock:
            # exports of landings gone from their slot go now, their host copies after
            stale = [s for s, e in self._exports.items() if uids.get(s) != e.uid]
            gone = [self._exports.pop(s).uid for s in stale]
            cached = self._exports.get(slot)
        fresh = cached is not None and cached.uid == info.uid
        return slot, info, None if fresh else self.pool.host_tables(slot), gone

    def _export(self, slot: int, name: str, info, tables) -> _Export:
        """What a lease on this slot says, built once per landing in the slot (its uid):
        a READY slot's bytes, tables and addresses cannot change under the same uid."""
        with self._lock:
            cached = self._exports.get(slot)
            last = self._built.get(slot)
        if cached is not None and cached.uid == info.uid:
            return cached
        peft = self._peft_for(name)
        moe = any(int(tables[0][layer, self.pool.layout.module_index(m)])
                  for layer, m in self.pool.layout.module_keys if m in MOE_MODULES)
        # an adapter with expert or router LoRA goes as the slot holds it (target_parameters
        # on the stacked experts, whatever layout its file had)
        peft_raw = json.dumps(peft.to_dict() if peft is not None and not moe else
                              peft_from_tables(self.pool.layout, *tables)).encode()
        if last is not None and all(map(torch.equal, last.tables, tables)):
            # a new landing of the same shapes in this slot (a publisher's next version):
            # the same views, addresses and table (~450 rows of Python on an 8B)
            export = replace(last, uid=info.uid, peft_raw=peft_raw, header={
                **last.header, "name": name, "uid": info.uid, "generation": info.generation})
        else:
            export = self._build(slot, name, info, tables, peft_raw)
        # _take dropped any other landing's export of this slot, and the slot is held since
        with self._lock:
            self._exports[slot] = self._built[slot] = export
        return export

    def _build(self, slot: int, name: str, info, tables, peft_raw: bytes) -> _Export:
        ranks, _, doras = tables
        views, rows = [], []
        layout, itemsize = self.pool.layout, self.pool.layout.itemsize
        for layer, module in layout.module_keys:
            m = layout.module_index(module)
            r = int(ranks[layer, m]) * layout.model.module_rows(module)  # experts: r per expert
            if r == 0:
                continue
            parts = [(0, self.pool.lora_a(layer, module)[slot, :r]),  # [r, in], contiguous
                     (1, self.pool.lora_bt(layer, module)[slot, :r])]  # [r, out]
            if int(doras[layer, m]):
                parts.append((2, self.pool.magnitude(layer, module)[slot]))  # [1, out]
            for kind, view in parts:
                addr = self.nixl.desc_of(view)[0] if self.nixl is not None else 0
                rows.append((layer, wire.MODULES.index(module), kind, view.shape[0], view.shape[1],
                             0, view.numel() * itemsize, addr))
                views.append(view)
        table = np.array(rows, dtype=wire.RECORD)
        transports: dict = {}
        if self.nixl is not None:
            transports["nixl"] = {"agent_metadata": base64.b64encode(self.nixl.metadata).decode(),
                                  "mem_type": self.nixl.mem_type, "device": self.nixl.device_id}
        data_bytes = int(table["nbytes"].sum())
        header = {"name": name, "uid": info.uid, "generation": info.generation,
                  "dtype": DTYPE_NAMES[layout.dtype], "data_bytes": data_bytes,
                  "transports": transports}
        # a copy: on a host pool the rows given are views of the live tables
        return _Export(info.uid, header, peft_raw, table, views, data_bytes,
                       tuple(t.clone() for t in tables))

    def _end_stream(self, lease: _Lease) -> None:
        with self._lock:
            lease.streams -= 1
        self._drop_if_done(lease)

    def _drop_if_done(self, lease: _Lease) -> None:
        """Release the slot's reference once: when the lease ended and no stream reads it."""
        with self._lock:
            drop = lease.ended and lease.streams == 0 and lease.ref_held
            if drop:
                lease.ref_held = False
        if drop:
            self._call(lambda: self.slots.table.release(lease.slot))


def _byte_range(offset: int, length: int | None, size: int) -> tuple[int, int]:
    """[start, stop) of a stream of `size` leased bytes (length None: to the end); a
    range that is not a non-empty part of them is refused."""
    if offset == 0 and length is None:
        return 0, size  # the whole stream, also of an adapter of no bytes
    stop = size if length is None else offset + length
    if not 0 <= offset < stop <= size:
        raise DataRangeError(f"byte range offset={offset} length={length} is not a non-empty "
                             f"part of the lease's {size} bytes")
    return offset, stop


def _window(pieces: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """The bytes [start, stop) of the pieces' concatenation, as views (no copy)."""
    out, pos = [], 0
    for piece in pieces:
        a, b = max(start - pos, 0), min(stop - pos, len(piece))
        if a < b:
            out.append(piece[a:b])
        pos += len(piece)
    return out


class DataStream:
    """One HTTP stream of a lease: its bytes as memoryviews of at most SEND_SLICE. It
    ends its hold on the lease once, when exhausted or closed, whichever comes first
    (a generator's finally would never run for a stream closed before its first
    slice, pinning the slot for good)."""

    def __init__(self, pieces: list[memoryview], on_end: Callable[[], None]) -> None:
        self._slices = [p[a:a + SEND_SLICE] for p in pieces for a in range(0, len(p), SEND_SLICE)]
        self._next = 0
        self._on_end: Callable[[], None] | None = on_end

    def __iter__(self) -> Iterator[memoryview]:
        return self

    def __next__(self) -> memoryview:
        if self._on_end is None or self._next == len(self._slices):
            self.close()
            raise StopIteration
        self._next += 1
        return self._slices[self._next - 1]

    def close(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()


class _HostCopies:
    """What HTTP streams send: a device pool's bytes from one host copy per landing (uid),
    least recently used dropped beyond `budget` bytes. A stream keeps the buffer it got,
    so dropping one never pulls bytes from under a running send."""

    def __init__(self, device: torch.device, budget: int, copy: bool) -> None:
        self.device, self.budget, self.copy = device, budget, copy
        self._pin = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()  # held across a build: concurrent first streams build once
        self._copies: OrderedDict[int, torch.Tensor] = OrderedDict()

    def pieces(self, export: _Export) -> list[memoryview]:
        if not self.copy:
            return [_bytes_of(view) for view in export.views]
        return [_bytes_of(self._copy(export))]

    def drop(self, uid: int) -> None:
        with self._lock:
            self._copies.pop(uid, None)

    @property
    def uids(self) -> list[int]:
        with self._lock:
            return list(self._copies)

    def _copy(self, export: _Export) -> torch.Tensor:
        with self._lock:
            host = self._copies.get(export.uid)
            if host is not None:
                self._copies.move_to_end(export.uid)
                return host
            host = self._build(export)
            if export.data_bytes <= self.budget:
                self._copies[export.uid] = host
                while sum(h.numel() for h in self._copies.values()) > self.budget:
                    self._copies.popitem(last=False)
            return host

    def _build(self, export: _Export) -> torch.Tensor:
        host = torch.empty(export.data_bytes, dtype=torch.uint8, pin_memory=self._pin)
        if not self._pin:
            _fill(host, export.views, non_blocking=False)
            return host
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # the landing that filled the slot may still be queued on the current stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            _fill(host, export.views, non_blocking=True)
        self._stream.synchronize()  # the only sync: the bytes are sent from `host` next
        return host


def _fill(host: torch.Tensor, views: list[torch.Tensor], non_blocking: bool) -> None:
    """host[:] = the views' bytes, concatenated: one copy per view."""
    pos = 0
    for view in views:
        raw = view.reshape(-1).view(torch.uint8)
        host[pos:pos + raw.numel()].copy_(raw, non_blocking=non_blocking)
        pos += raw.numel()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def peft_from_tables(layout, ranks: torch.Tensor, scales: torch.Tensor,
                     doras: torch.Tensor | None = None) -> dict:
    """A PEFT config that reproduces a landed slot exactly: every targeted module by
    full path, with its rank and an alpha that gives back the table's scale (and
    use_dora when the slot's modules carry DoRA: PEFT's use_dora is all or nothing)."""
    targets, parameters, rank_pattern, alpha_pattern, dora = [], [], {}, {}, False
    for layer, module in layout.module_keys:
        m = layout.module_index(module)
        r = int(ranks[layer, m])
        if r:
            path = layout.model.module_path(layer, module)
            if module in MOE_MODULES:  # a stacked parameter: by its full name
                path = f"{path}.{MOE_PARAMS[module]}"
                parameters.append(path)
            else:
                targets.append(path)
            rank_pattern[re.escape(path)] = r
            # scale is float32; scale * r is exact in float64, so alpha / r gives it back
            alpha_pattern[re.escape(path)] = float(scales[layer, m]) * r
            dora = dora or (doras is not None and bool(doras[layer, m]))
    top = max(rank_pattern.values(), default=1)
    return {"peft_type": "LORA", "r": top, "lora_alpha": float(top), "target_modules": targets,
            "target_parameters": parameters, "use_rslora": False, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern, "bias": "none", "use_dora": dora}
