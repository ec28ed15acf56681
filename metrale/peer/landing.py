"""Land a peer's adapter into a slot: the engine side of peer staging.

Validate everything first, mutate second. Before the slot is touched: the
peer address is checked against peer_allow (nothing is contacted otherwise),
the adapter is leased, its manifest read under a byte cap and checked against
the local SlotLayout, and a full AdapterPlan is built from the local model and
pool. Then, by transport:

- http: the bytes stream into host staging (exactly data_bytes, under the
  deadline) and are checked for NaN/Inf; only then is the slot zeroed and
  written with AdapterPool.land. A peer that dies mid-stream leaves the slot as
  it was.
- nixl: the slot is zeroed and NIXL READs each tensor from the peer's memory
  straight into it. Local descriptors come only from the local SlotLayout; the
  peer's lengths were checked against them before zeroing. A peer that dies or
  stalls mid-transfer leaves the slot EMPTY with a fresh identity (Landing.fail).

The lease is released when the operation ends, whatever happened.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable

import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import AdapterPlan
from metrale.errors import AdapterMismatchError, InvalidNameError, MetraleError
from metrale.peer.allow import AllowList, resolve_peer
from metrale.peer.client import PeerClient
from metrale.peer.deadline import Deadline
from metrale.peer.errors import NixlUnavailableError, PeerManifestError, PeerUnavailableError
from metrale.peer.manifest import DTYPE_NAMES, Manifest, canonical_views, manifest_plan, parse_manifest
from metrale.pool.landing import Landing
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LoraSlots, Prepared

log = logging.getLogger("metrale.peer")

DEFAULT_TIMEOUT_S = 30.0
LEASE_SLACK_S = 5.0  # ask for a lease that outlives our own deadline
TRANSPORT_CHOICES = ("auto", "http", "nixl")
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_LEASE_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")

PeftLike = PeftAdapterConfig | dict | None


def swap_from_peer(
    lora_slots: LoraSlots, peer_addr: str, adapter_id: str, adapter_name: str, slot: int,
    peft: PeftLike = None, *, transport: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
    peer_allow: AllowList | Iterable[str] | None = None,
) -> None:
    """Land the peer's adapter `adapter_id` into `slot` as `adapter_name`.

    `peft`, when given, is the config to serve the adapter with (the seed's
    argument); otherwise the manifest's. peer_allow defaults to loopback only."""
    fetch = _PeerFetch(lora_slots, peer_addr, adapter_id, adapter_name, peft, transport,
                       timeout_s, peer_allow)
    lora_slots.swap_from("swap_lora_slot_from_peer", adapter_name, slot, fetch.source,
                         fetch.prepare)


def promote_from_peer(
    lora_slots: LoraSlots, peer_addr: str, adapter_id: str, adapter_name: str,
    peft: PeftLike = None, *, transport: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
    peer_allow: AllowList | Iterable[str] | None = None,
) -> tuple[int, str | None]:
    """Pick a victim cache slot and land the peer's adapter there: (slot, evicted name)."""
    fetch = _PeerFetch(lora_slots, peer_addr, adapter_id, adapter_name, peft, transport,
                       timeout_s, peer_allow)
    return lora_slots.promote_from("promote_lora_slot_from_peer", adapter_name, fetch.source,
                                   fetch.prepare)


def prepare_from_peer(
    lora_slots: LoraSlots, peer_addr: str, adapter_id: str, adapter_name: str,
    peft: PeftLike = None, *, staging: StagingBuffers | None = None, transport: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S, peer_allow: AllowList | Iterable[str] | None = None,
) -> Prepared:
    """Lease, validate and (over HTTP) fetch the peer's adapter without touching a slot;
    safe on a worker thread with its own `staging`. The lease is released by
    Prepared.close, after the landing."""
    fetch = _PeerFetch(lora_slots, peer_addr, adapter_id, adapter_name, peft, transport,
                       timeout_s, peer_allow, staging)
    return fetch.prepare()


class _PeerFetch:
    def __init__(self, lora_slots: LoraSlots, peer_addr: str, adapter_id: str, name: str,
                 peft: PeftLike, transport: str, timeout_s: float, peer_allow,
                 staging: StagingBuffers | None = None) -> None:
        if transport not in TRANSPORT_CHOICES:
            raise MetraleError(f"transport {transport!r}: choose from {', '.join(TRANSPORT_CHOICES)}")
        self.slots, self.peer_addr, self.adapter_id, self.name = lora_slots, peer_addr, adapter_id, name
        self.peft, self.transport, self.timeout_s, self.peer_allow = peft, transport, timeout_s, peer_allow
        self.staging = staging
        self.source = f"peer {peer_addr} adapter {adapter_id!r}"
        self._client: PeerClient | None = None
        self._lease_id: str | None = None

    def close(self) -> None:
        if self._client is not None and self._lease_id is not None:
            self._client.release(self._lease_id)
            self._lease_id = None

    def prepare(self) -> Prepared:
        """Everything up to the point of touching a slot; returns the write. On any
        refusal the lease is released here; else by Prepared.close."""
        try:
            return Prepared(self._prepare(), close=self.close)
        except BaseException:
            self.close()
            raise

    def _prepare(self) -> Callable[[Landing], None]:
        if not isinstance(self.adapter_id, str) or not _ID_RE.fullmatch(self.adapter_id):
            raise InvalidNameError(f"peer adapter id {self.adapter_id!r} is invalid")
        addr = resolve_peer(self.peer_addr, self.peer_allow)  # before any connection
        start, deadline = time.perf_counter(), Deadline(self.timeout_s)
        self._client = client = PeerClient(addr, deadline)
        reply = client.lease(self.adapter_id, self.timeout_s + LEASE_SLACK_S)
        self._take_lease(reply.get("lease"), deadline)
        pool = self.slots.pool
        manifest = parse_manifest(reply.get("manifest"), pool.layout, self.source)
        if manifest.adapter_id != self.adapter_id:
            raise PeerManifestError(
                f"{self.source}: the peer answered with adapter {manifest.adapter_id!r}"
            )
        plan = manifest_plan(manifest, self.name, self._peft(manifest), self.slots.model_config,
                             self.slots.pool_config, self.source)
        mode = self._choose(manifest)
        if mode == "nixl":
            write = self._nixl_writer(manifest, plan, deadline)
        else:
            write = self._http_writer(client, manifest, plan)
        log.info("%s: %d tensors, %d bytes, via %s, ready in %.1f ms", self.source,
                 len(plan.landings), plan.data_bytes, mode, (time.perf_counter() - start) * 1e3)
        return write

    # --- steps ---------------------------------------------------------------------------

    def _take_lease(self, lease: object, deadline: Deadline) -> None:
        lease_id = lease.get("id") if isinstance(lease, dict) else None
        ttl = lease.get("expires_in_s") if isinstance(lease, dict) else None
        if not isinstance(lease_id, str) or not _LEASE_RE.fullmatch(lease_id):
            raise PeerManifestError(f"{self.source}: the peer granted no valid lease id")
        self._lease_id = lease_id
        if type(ttl) not in (int, float) or not ttl > 0:
            raise PeerManifestError(f"{self.source}: lease expires_in_s {ttl!r} is not positive")
        # A transfer that outlives its lease could read bytes the peer is free to change.
        deadline.shorten_to(float(ttl) * 0.9)

    def _peft(self, manifest: Manifest) -> PeftAdapterConfig:
        if isinstance(self.peft, PeftAdapterConfig):
            return self.peft
        return PeftAdapterConfig.from_dict(self.peft if self.peft is not None else manifest.peft)

    def _choose(self, manifest: Manifest) -> str:
        """nixl when asked (or on auto when both sides can), else http; refusals here
        still come before any slot is touched."""
        pool_dtype = DTYPE_NAMES[self.slots.pool.layout.dtype]
        fallback = self.transport == "auto" and manifest.http_path is not None
        use_nixl = self.transport != "http" and manifest.nixl is not None
        if use_nixl and manifest.dtype != pool_dtype:
            if not fallback:
                raise AdapterMismatchError(
                    f"{self.source}: the peer holds {manifest.dtype}, this pool {pool_dtype}; NIXL "
                    "lands bytes unconverted, so use transport='http' (it converts)"
                )
            use_nixl = False
        if use_nixl:
            try:
                self._endpoint()  # NIXL installed and able to start here?
                return "nixl"
            except NixlUnavailableError as e:
                if not fallback:
                    raise
                log.info("%s: NIXL unavailable (%s); using HTTP", self.source, e)
        if self.transport == "nixl":
            raise NixlUnavailableError(f"{self.source}: the peer offers no NIXL transport")
        if manifest.http_path is None:
            raise PeerUnavailableError(f"{self.source}: the peer offers no HTTP data transport")
        return "http"

    def _endpoint(self):
        from metrale.peer.nixl_transport import endpoint_for

        return endpoint_for(self.slots.pool, self.slots.pool.buffer)

    def _http_writer(self, client: PeerClient, manifest: Manifest,
                     plan: AdapterPlan) -> Callable[[Landing], None]:
        def fill(host: torch.Tensor) -> None:
            client.read_exact(manifest.http_path, memoryview(host.numpy()))

        views = canonical_views(plan, self.slots.stage(plan, fill, self.staging))
        return lambda landing: landing.write_views(plan, views)

    def _nixl_writer(self, manifest: Manifest, plan: AdapterPlan,
                     deadline: Deadline) -> Callable[[Landing], None]:
        layout = self.slots.pool.layout
        endpoint = self._endpoint()
        remote_by_key = {(t.layer, t.module, t.kind): d
                         for t, d in zip(manifest.tensors, manifest.nixl.descs)}
        remotes = []  # one remote descriptor per planned tensor, in plan order
        for landing in plan.landings:
            t = landing.target
            region = layout.region(t.layer, t.module, landing.kind)
            remote = remote_by_key[(t.layer, t.module, landing.kind)]
            nbytes = landing.rows * region.cols * layout.itemsize  # rank rows; 1 for M
            if remote[1] != nbytes:  # checked before any slot is zeroed
                raise PeerManifestError(
                    f"{self.source}: NIXL descriptor of {remote[1]} bytes for layer {t.layer} "
                    f"{t.module} {landing.kind}; the local slot expects {nbytes}"
                )
            remotes.append(remote)
        agent = endpoint.add_remote(manifest.nixl.agent_metadata)

        def write(landing: Landing) -> None:
            local = [(r.addr, r.nbytes, endpoint.device_id) for r in landing.byte_ranges(plan)]
            try:
                endpoint.read(agent, local, remotes, manifest.nixl.mem_type, deadline)
            except PeerUnavailableError:
                endpoint.forget_remote(agent)  # reconnect from fresh metadata next time
                raise
            landing.check_written(plan)

        return write
