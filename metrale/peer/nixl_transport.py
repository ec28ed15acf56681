"""One NIXL agent per adapter pool: the pool buffer is registered once and used both
to READ peers' adapters into slots and to export READY slots.

Remote addresses cross the wire as plain integers, never through NIXL's
get_serialized_descs / deserialize_descs: those are pickle, and unpickling a peer's bytes
would let it run code here. What the caches keep is in docs/DESIGN.md, "Peers".
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from metrale.peer.deadline import Deadline
from metrale.peer.errors import NixlUnavailableError, PeerTimeoutError, PeerTransferError
from metrale.peer.nixl_shim import load_nixl
from metrale.peer.ucx import Transport, configure_ucx

log = logging.getLogger("metrale.peer")

Desc = tuple[int, int, int]  # (address, length in bytes, device id)

# How long a failed transfer may take to acknowledge its cancellation before we
# give up on it (the handle then stays in NIXL's leak list).
_CANCEL_GRACE_S = 2.0
_SPIN_POLLS = 64  # polls without sleeping: each costs a few microseconds
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3  # then sleeps doubling from the first to the second
_MAX_PREPPED = 64  # prepared descriptor lists kept (local per slot, remote per peer placement)
_LOCAL = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for the local side
# Most bytes between two tensors that a run carries rather than split there (the DoRA
# magnitude region between one module's B and the next one's A: 28 KiB on an 8B model).
MAX_BRIDGE_BYTES = 1 << 20
WARM_BYTES = 4096  # what warm_read reads: enough to connect, open and time nothing

_endpoints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_endpoints_lock = threading.Lock()


def endpoint_for(owner: object, buffer: torch.Tensor) -> NixlEndpoint:
    """The endpoint registered over `buffer`, created on first use and cached per
    owner (an AdapterPool), so the pool is registered with NIXL exactly once."""
    with _endpoints_lock:
        ep = _endpoints.get(owner)
        if ep is None:
            ep = NixlEndpoint(buffer)
            _endpoints[owner] = ep
        return ep


def transports_in_use() -> dict[str, int]:
    """How many connected peers each UCX transport carries, over this process's
    endpoints ("unreported" when UCX did not say): for /metrics."""
    counts: dict[str, int] = {}
    with _endpoints_lock:
        endpoints = list(_endpoints.values())
    for endpoint in endpoints:
        for transport in endpoint.transports():
            name = transport.config if transport is not None else "unreported"
            counts[name] = counts.get(name, 0) + 1
    return counts


class NixlEndpoint:
    def __init__(self, buffer: torch.Tensor) -> None:
        nixl = load_nixl()
        if not buffer.is_contiguous():
            raise ValueError("NIXL registration needs a contiguous buffer")
        self.buffer = buffer
        cuda = buffer.device.type == "cuda"
        self.mem_type, self.device_id = ("VRAM", buffer.device.index or 0) if cuda else ("DRAM", 0)
        self.base, self.nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        self.name = f"metrale-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()  # the agent runs without NIXL's own locking
        self._remotes: dict[bytes, str] = {}  # agent metadata -> loaded remote agent name
        self._prepped: dict = {}  # (agent name, mem type, descs) -> prepped dlist; LRU order
        self._transports: dict[str, Transport | None] = {}  # remote agent -> what UCX chose
        self._scratch: torch.Tensor | None = None  # warm_read's destination, registered once
        try:
            # The progress thread lets peers READ from us over transports (UCX TCP)
            # that need the target side to make progress.
            self._agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(backends=["UCX"]))
            if "UCX" not in self._agent.backends:
                raise RuntimeError("the UCX backend could not be created")
            self._reg = self._agent.register_memory(buffer)
            self.metadata = self._agent.get_agent_metadata()
        except Exception as e:
            raise NixlUnavailableError(f"NIXL could not start here: {type(e).__name__}: {e}") from e
        log.info("nixl: agent %s registered %d bytes of %s", self.name, self.nbytes, self.mem_type)

    # --- export side ----------------------------------------------------------------

    def desc_of(self, t: torch.Tensor) -> Desc:
        """The descriptor of a contiguous view of the registered buffer."""
        nbytes = t.numel() * t.element_size()
        addr = t.data_ptr()
        if not t.is_contiguous() or not self._inside(addr, nbytes):
            raise ValueError("exported tensor is not a contiguous view of the registered buffer")
        return addr, nbytes, self.device_id

    def _inside(self, addr: int, nbytes: int) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.nbytes

    # --- import side ----------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata once: later landings from the same peer (the same
        metadata bytes) reuse the loaded agent and its prepared descriptor lists."""
        with self._lock:
            name = self._remotes.get(metadata)
            if name is not None:
                return name
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as e:
                raise PeerTransferError(
                    f"the peer's NIXL agent metadata was refused ({type(e).__name__}: {e})"
                ) from e
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._remotes[metadata] = name
            return name

    def forget_remote(self, name: str) -> None:
        """Drop a peer after a failure, so the next attempt reconnects from fresh metadata
        (and prepares its descriptor lists again)."""
        with self._lock:
            for md in [md for md, n in self._remotes.items() if n == name]:
                del self._remotes[md]
            for key in [k for k in self._prepped if k[0] == name]:
                self._release_dlist(self._prepped.pop(key))
            self._transports.pop(name, None)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # already gone: nothing to drop
                log.debug("nixl: remove_remote_agent(%s): %s", name, e)

    def read(self, remote_agent: str, local: list[Desc], remote: list[Desc], remote_mem: str,
             deadline: Deadline, within: tuple[int, int]) -> None:
        """READ remote[i] into local[i] for all i, or raise within the deadline. Both
        descriptor lists are prepared once per distinct list and reused; `within`:
        (address, nbytes) every local descriptor must fall inside (the target slot)."""
        if len(local) != len(remote) or any(l[1] != r[1] for l, r in zip(local, remote)):
            raise PeerTransferError("local and remote descriptors disagree on lengths")
        lo, hi = within
        for addr, nbytes, _ in local:  # defense in depth: only our slot, ever
            if not (self._inside(addr, nbytes) and lo <= addr and addr + nbytes <= lo + hi):
                raise PeerTransferError("a local descriptor falls outside the target slot")
        with self._lock:
            self._transfer(remote_agent, tuple(local), tuple(remote), remote_mem, deadline)

    def warm_read(self, remote_agent: str, remote: Desc, remote_mem: str,
                  deadline: Deadline) -> None:
        """READ up to WARM_BYTES of `remote` into the endpoint's own scratch memory (never
        a slot): UCX connects to the peer and opens its memory (a CUDA IPC handle, ~10 ms
        on the H200) here rather than in a first landing; the transport gets recorded."""
        nbytes = min(remote[1], WARM_BYTES)
        with self._lock:
            if self._scratch is None:
                scratch = torch.empty(WARM_BYTES, dtype=torch.uint8, device=self.buffer.device)
                try:
                    self._scratch_reg = self._agent.register_memory(scratch)
                except Exception as e:
                    raise PeerTransferError(f"NIXL could not register scratch memory ({e})") from e
                self._scratch = scratch
            self._transfer(remote_agent, ((self._scratch.data_ptr(), nbytes, self.device_id),),
                           ((remote[0], nbytes, remote[2]),), remote_mem, deadline)

    def _transfer(self, remote_agent: str, local: tuple[Desc, ...], remote: tuple[Desc, ...],
                  remote_mem: str, deadline: Deadline) -> None:
        """One READ over prepared descriptor lists, under the lock; the peer's transport is
        recorded after its first."""
        try:
            local_h = self._prepped_dlist(_LOCAL, local, self.mem_type)
            remote_h = self._prepped_dlist(remote_agent, remote, remote_mem)
            idx = list(range(len(local)))
            handle = self._agent.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
        except Exception as e:
            raise PeerTransferError(
                f"NIXL refused the transfer ({type(e).__name__}: {e}); the peer's "
                "descriptors do not match memory it registered, or it is gone"
            ) from e
        try:
            self._run(handle, deadline)
        finally:
            self._release(handle)
        if remote_agent not in self._transports:
            self._transports[remote_agent] = self._report_transport(remote_agent)

    def transports(self) -> list[Transport | None]:
        # no lock: read() holds it for a whole transfer; copying a dict is atomic in CPython
        return list(self._transports.values())

    def transport_of(self, remote_agent: str) -> Transport | None:
        """What UCX chose to carry READs from `remote_agent` (None: not reported)."""
        return self._transports.get(remote_agent)

    def _report_transport(self, remote_agent: str) -> Transport | None:
        transport = configure_ucx().read_transport(self.name)
        if transport is None:
            log.info("nixl: UCX did not report the transport for %s (UCX_PROTO_INFO or "
                     "UCX_LOG_FILE set by the user)", remote_agent)
        elif transport.slow:
            log.warning("nixl: %s", transport.advice())
        else:
            log.info("nixl: READs from %s go over %s (%s)", remote_agent, transport.config,
                     transport.description)
        return transport

    def _prepped_dlist(self, agent_name: str, descs: tuple[Desc, ...], mem: str):
        key = (agent_name, mem, descs)
        handle = self._prepped.get(key)
        if handle is None:
            handle = self._agent.prep_xfer_dlist(agent_name, list(descs), mem)
            self._prepped[key] = handle
            while len(self._prepped) > _MAX_PREPPED:
                self._release_dlist(self._prepped.pop(next(iter(self._prepped))))
        else:
            self._prepped[key] = self._prepped.pop(key)  # most recently used last
        return handle

    def _release_dlist(self, handle) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception as e:
            log.debug("nixl: release_dlist_handle: %s", e)

    def _run(self, handle, deadline: Deadline) -> None:
        """Post and wait: the first polls spin (an NVLink slot lands in well under a
        millisecond), then the wait between polls doubles up to _POLL_MAX_S."""
        agent = self._agent
        try:
            state = agent.transfer(handle)
            polls, wait = 0, _POLL_MIN_S
            while state == "PROC":
                if deadline.expired():
                    raise PeerTimeoutError(
                        f"NIXL transfer did not finish within {deadline.total_s:.1f}s; "
                        "the peer stalled or the link is down"
                    )
                polls += 1
                if polls > _SPIN_POLLS:
                    time.sleep(min(wait, max(deadline.remaining(), 0.0)))
                    wait = min(wait * 2, _POLL_MAX_S)
                state = agent.check_xfer_state(handle)
        except PeerTimeoutError:
            raise
        except Exception as e:
            raise PeerTransferError(
                f"NIXL transfer failed ({type(e).__name__}: {e}); the peer died or "
                "disconnected mid-transfer"
            ) from e
        if state != "DONE":
            raise PeerTransferError(f"NIXL transfer ended in state {state}")

    def _release(self, handle) -> None:
        """Release (cancelling an unfinished transfer). If NIXL cannot cancel yet,
        wait briefly for it to settle: a transfer still running could otherwise
        write into a slot after it was zeroed and marked EMPTY."""
        end = time.monotonic() + _CANCEL_GRACE_S
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as e:
                if time.monotonic() >= end:
                    log.error("nixl: transfer handle could not be released (%s); left to NIXL", e)
                    return
                time.sleep(0.01)


@dataclass
class Runs:
    """A landing's tensors coalesced into contiguous runs, for one local layout and one
    remote placement. local: (offset from the slot base, nbytes); remote: (address,
    nbytes); gaps: (offset, nbytes) of local bytes between two merged tensors, which the
    run carries over from the peer and the landing zeroes afterwards."""

    local: tuple[tuple[int, int], ...]
    remote: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[int, int], ...]
    gap_index: object = None  # element indices of the gaps, a device tensor once built

    def gap_elements(self, itemsize: int, device) -> torch.Tensor:
        if self.gap_index is None:  # one arange for all gaps: an 8B slot has ~220 of them
            gaps = np.array(self.gaps, dtype=np.int64).reshape(-1, 2) // itemsize
            starts, lengths = gaps[:, 0], gaps[:, 1]
            before = np.cumsum(lengths) - lengths  # elements of earlier gaps
            idx = np.arange(lengths.sum()) + np.repeat(starts - before, lengths)
            self.gap_index = torch.from_numpy(idx).to(device)
        return self.gap_index


def coalesce(local_offsets: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray,
             max_gap: int = MAX_BRIDGE_BYTES) -> Runs:
    """Merge tensors that sit the same distance apart on both sides, at most max_gap,
    into one run (the bytes between are inside the local slot, zeroed after the
    transfer): matching layouts become one run. One numpy pass, in local order."""
    order = np.argsort(local_offsets, kind="stable")
    lo = local_offsets[order].astype(np.int64)
    ra = remote_addrs[order].astype(np.uint64)
    nb = nbytes[order].astype(np.int64)
    if len(lo) == 0:
        return Runs((), (), ())
    local_gap = lo[1:] - (lo[:-1] + nb[:-1])  # >= 0: local tensors never overlap
    remote_end = ra[:-1] + nb[:-1].astype(np.uint64)  # checked: never wraps
    ahead = ra[1:] >= remote_end
    remote_gap = np.where(ahead, ra[1:] - np.where(ahead, remote_end, 0), 0).astype(np.int64)
    merge = ahead & (local_gap >= 0) & (local_gap <= max_gap) & (remote_gap == local_gap)
    starts = np.concatenate(([0], np.flatnonzero(~merge) + 1))
    ends = np.concatenate((starts[1:], [len(lo)])) - 1  # index of each run's last tensor
    length = lo[ends] + nb[ends] - lo[starts]
    gap_at = np.flatnonzero(merge & (local_gap > 0))
    return Runs(
        local=tuple(zip(lo[starts].tolist(), length.tolist())),
        remote=tuple(zip(ra[starts].tolist(), length.tolist())),
        gaps=tuple(zip((lo[gap_at] + nb[gap_at]).tolist(), local_gap[gap_at].tolist())),
    )
