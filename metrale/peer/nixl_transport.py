"""One NIXL agent per adapter pool: the pool buffer is registered once and used
both to READ peers' adapters into slots and to export READY slots.

Descriptors cross the wire as plain JSON triples (address, length, device id),
never through nixl_agent.get_serialized_descs / deserialize_descs: those are
pickle, and unpickling a peer's bytes would let the peer run code here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref

import torch

from metrale.peer.deadline import Deadline
from metrale.peer.errors import NixlUnavailableError, PeerTimeoutError, PeerTransferError
from metrale.peer.nixl_shim import load_nixl

log = logging.getLogger("metrale.peer")

Desc = tuple[int, int, int]  # (address, length in bytes, device id)

# How long a failed transfer may take to acknowledge its cancellation before we
# give up on it (the handle then stays in NIXL's leak list).
_CANCEL_GRACE_S = 2.0
_POLL_S = 0.0005

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


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


def device_id(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0


class NixlEndpoint:
    def __init__(self, buffer: torch.Tensor) -> None:
        nixl = load_nixl()
        if not buffer.is_contiguous():
            raise ValueError("NIXL registration needs a contiguous buffer")
        self.buffer = buffer
        self.mem_type, self.device_id = mem_type(buffer), device_id(buffer)
        self.base, self.nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        self.name = f"metrale-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()  # the agent runs without NIXL's own locking
        try:
            # The progress thread lets peers READ from us over transports (UCX TCP)
            # that need the target side to make progress.
            self._agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(backends=["UCX"]))
            if "UCX" not in self._agent.backends:
                raise RuntimeError("the UCX backend could not be created")
            self._reg = self._agent.register_memory(buffer)
            self.metadata = self._agent.get_agent_metadata()
        except NixlUnavailableError:
            raise
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
        """Load a peer's agent metadata (idempotent for the same peer)."""
        with self._lock:
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as e:
                raise PeerTransferError(
                    f"the peer's NIXL agent metadata was refused ({type(e).__name__}: {e})"
                ) from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget_remote(self, name: str) -> None:
        """Drop a peer after a failure, so the next attempt reconnects from fresh metadata."""
        with self._lock:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # already gone: nothing to drop
                log.debug("nixl: remove_remote_agent(%s): %s", name, e)

    def read(self, remote_agent: str, local: list[Desc], remote: list[Desc], remote_mem: str,
             deadline: Deadline) -> None:
        """READ remote[i] into local[i] for all i, or raise within the deadline."""
        if len(local) != len(remote) or any(l[1] != r[1] for l, r in zip(local, remote)):
            raise PeerTransferError("local and remote descriptors disagree on lengths")
        for addr, nbytes, _ in local:
            if not self._inside(addr, nbytes):  # defense in depth: only our pool, ever
                raise PeerTransferError("a local descriptor falls outside the registered pool")
        with self._lock:
            agent = self._agent
            try:
                local_d = agent.get_xfer_descs(local, self.mem_type)
                remote_d = agent.get_xfer_descs(remote, remote_mem)
                handle = agent.initialize_xfer("READ", local_d, remote_d, remote_agent)
            except Exception as e:
                raise PeerTransferError(
                    f"NIXL refused the transfer ({type(e).__name__}: {e}); the peer's "
                    "descriptors do not match memory it registered, or it is gone"
                ) from e
            try:
                self._run(handle, deadline)
            finally:
                self._release(handle)

    def _run(self, handle, deadline: Deadline) -> None:
        agent = self._agent
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                if deadline.expired():
                    raise PeerTimeoutError(
                        f"NIXL transfer did not finish within {deadline.total_s:.1f}s; "
                        "the peer stalled or the link is down"
                    )
                time.sleep(_POLL_S)
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
