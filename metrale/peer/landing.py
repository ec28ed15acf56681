"""Land a peer's adapter into a slot: the engine side of peer staging.

Everything is checked before a slot is touched (docs/DESIGN.md, "Peers"). A peer that
dies mid-stream over HTTP leaves the slot as it was; over NIXL the zeroed slot is read
into, so one that dies mid-transfer leaves it EMPTY with a fresh identity (Landing.fail).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.weights_check import GainBound
from metrale.errors import AdapterMismatchError, InvalidNameError, MetraleError
from metrale.names import is_valid_name
from metrale.peer.allow import AllowList, resolve_peer
from metrale.peer.client import PeerClient
from metrale.peer.deadline import Deadline
from metrale.peer.errors import NixlUnavailableError, PeerManifestError, PeerUnavailableError
from metrale.peer.manifest import (
    DTYPE_NAMES,
    Manifest,
    canonical_views,
    manifest_plan,
    parse_manifest,
    read_reply,
)
from metrale.peer.nixl_transport import Runs, coalesce, endpoint_for
from metrale.peer.plans import PeerPlan, plan_cache_for
from metrale.pool.landing import Landing, slot_norms
from metrale.pool.recipe import table_rows
from metrale.pool.staged import stage, stage_views
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LoraSlots, Prepared

log = logging.getLogger("metrale.peer")

DEFAULT_TIMEOUT_S = 30.0
LEASE_SLACK_S = 5.0  # ask for a lease that outlives our own deadline
TRANSPORT_CHOICES = ("auto", "http", "nixl")
_LEASE_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")

PeftLike = PeftAdapterConfig | dict | None


def prepare_from_peer(
    lora_slots: LoraSlots, peer_addr: str, adapter_id: str, adapter_name: str,
    peft: PeftLike = None, *, staging: StagingBuffers | None = None, transport: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S, peer_allow: AllowList | Iterable[str] | None = None,
    stats: dict | None = None,
) -> Prepared:
    """Lease, validate and (over HTTP) fetch the peer's `adapter_id`, to serve as
    `adapter_name`, without touching a slot; safe on a worker thread with its own
    `staging`. Prepared.close releases the lease. `peft` overrides the manifest's config;
    `stats` receives the phases' timings in ms (benchmarks)."""
    fetch = _PeerFetch(lora_slots, peer_addr, adapter_id, adapter_name, peft, transport,
                       timeout_s, peer_allow, staging, stats)
    try:
        return Prepared(fetch.prepare(), close=fetch.close)
    except BaseException:  # a refusal releases the lease here, else Prepared.close does
        fetch.close()
        raise


def warm_up_nixl(lora_slots: LoraSlots) -> bool:
    """Before the first peer landing: start the pool's NIXL endpoint (agent and memory
    registration, ~1.3 s on the H200) and load the in-slot checks' kernels. False when
    NIXL cannot start here (HTTP still serves)."""
    pool = lora_slots.landing_pool  # where landings write: NIXL's registration
    try:
        endpoint_for(pool, pool.buffer)
    except NixlUnavailableError as e:
        log.info("NIXL not warmed up: %s", e)
        return False
    slot_norms(pool.slot_tensors[0])  # a landing's verify; reads only
    scratch = torch.zeros(2, dtype=pool.buffer.dtype, device=pool.device)
    scratch.index_fill_(0, torch.ones(1, dtype=torch.int64, device=pool.device), 0)  # gaps' op
    return True


def warm_up_peer(lora_slots: LoraSlots, peer_addr: str, adapter_id: str, *,
                 transport: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 peer_allow: AllowList | Iterable[str] | None = None,
                 stats: dict | None = None) -> str:
    """Before the first landing from a peer: lease `adapter_id` once and do what that
    landing would do before writing (plan the manifest into the plan cache; over NIXL
    load the peer's agent, coalesce its runs, build the gap index and READ a few bytes, so
    UCX connects and opens the peer's memory), then release. No slot is touched; later
    landings of the same layout from this peer start warm. Returns the transport; raises
    what a landing would (callers that only warm may log and go on)."""
    fetch = _PeerFetch(lora_slots, peer_addr, adapter_id, adapter_id, None, transport,
                       timeout_s, peer_allow, None, stats)
    try:
        return fetch.warm()
    finally:
        fetch.close()


class _PeerFetch:
    def __init__(self, lora_slots: LoraSlots, peer_addr: str, adapter_id: str, name: str,
                 peft: PeftLike, transport: str, timeout_s: float, peer_allow,
                 staging: StagingBuffers | None, stats: dict | None) -> None:
        if transport not in TRANSPORT_CHOICES:
            raise MetraleError(f"transport {transport!r}: choose from {', '.join(TRANSPORT_CHOICES)}")
        self.slots, self.peer_addr, self.adapter_id, self.name = lora_slots, peer_addr, adapter_id, name
        self.peft, self.transport, self.timeout_s, self.peer_allow = peft, transport, timeout_s, peer_allow
        self.staging = staging
        self.source = f"peer {peer_addr} adapter {adapter_id!r}"
        self._client: PeerClient | None = None
        self._lease_id: str | None = None
        self.stats: dict = {} if stats is None else stats  # phase timings, for benchmarks

    def close(self) -> None:
        if self._client is not None and self._lease_id is not None:
            self._client.release(self._lease_id)
            self._lease_id = None

    def prepare(self) -> Callable[[Landing], None]:
        start = time.perf_counter()
        manifest, entry, mode, deadline, peer = self._lease_and_plan()
        t_plan = time.perf_counter()
        if mode == "nixl":
            write = self._nixl_writer(manifest, entry, deadline, peer)
        else:
            write = self._http_writer(self._client, manifest, entry)
        end = time.perf_counter()
        self.stats["prepare_ms"] = (end - t_plan) * 1e3
        log.info("%s: %d tensors, %d bytes, via %s, plan %s, ready in %.2f ms", self.source,
                 len(manifest.table), manifest.data_bytes, mode,
                 "cached" if self.stats["plan_cached"] else "built", (end - start) * 1e3)
        return write

    def warm(self) -> str:
        """What a first landing from this peer would do before it writes (lease, plan and,
        over NIXL, the peer's agent, the runs, a READ of a few bytes into the endpoint's
        scratch); no slot is touched. Returns the transport."""
        manifest, entry, mode, deadline, peer = self._lease_and_plan()
        if mode == "nixl":
            endpoint = endpoint_for(self.slots.landing_pool, self.slots.landing_pool.buffer)
            runs = self._runs(entry, manifest)
            if runs.gaps:
                runs.gap_elements(self.slots.landing_pool.layout.itemsize, self.slots.landing_pool.device)
            agent = endpoint.add_remote(manifest.nixl.agent_metadata)
            if runs.remote:
                addr, nbytes = runs.remote[0]
                endpoint.warm_read(agent, (addr, nbytes, manifest.nixl.device),
                                   manifest.nixl.mem_type, deadline)
        return mode

    def _lease_and_plan(self) -> tuple[Manifest, PeerPlan, str, Deadline, str]:
        """Lease (one round trip), validate or match the cached plan, choose the transport."""
        if not is_valid_name(self.adapter_id):
            raise InvalidNameError(f"peer adapter id {self.adapter_id!r} is invalid")
        addr = resolve_peer(self.peer_addr, self.peer_allow)  # before any connection
        start, deadline = time.perf_counter(), Deadline(self.timeout_s)
        self._client = client = PeerClient(addr, deadline)
        raw = client.lease(self.adapter_id, self.timeout_s + LEASE_SLACK_S)  # one round trip
        t_lease = time.perf_counter()
        pool = self.slots.landing_pool
        reply = read_reply(raw, self.source)
        self._take_lease(reply.header.get("lease"), deadline)
        peer = f"{addr.ip}:{addr.port}"
        cache = plan_cache_for(pool)
        cached = cache.get(peer, self.adapter_id) if self.peft is None else None
        manifest = parse_manifest(reply, pool.layout, self.source,
                                  cached.shape_bytes if cached is not None else None)
        if manifest.adapter_id != self.adapter_id:
            raise PeerManifestError(
                f"{self.source}: the peer answered with adapter {manifest.adapter_id!r}"
            )
        hit = cached is not None and cached.matches(manifest.shape_bytes, manifest.peft_raw,
                                                    manifest.dtype)
        if hit:
            entry = cached.named(self.name)
            cache.hits += 1
        else:
            entry = self._plan(manifest)
            cache.misses += 1
            if self.peft is None:
                cache.put(peer, self.adapter_id, entry)  # replaces an entry of another layout
        t_plan = time.perf_counter()
        mode = self._choose(manifest)
        self.stats.update(
            transport=mode, plan_cached=hit, tensors=len(manifest.table),
            manifest_bytes=len(raw), control_ms=(t_lease - start) * 1e3,
            validate_ms=(t_plan - t_lease) * 1e3)
        return manifest, entry, mode, deadline, peer

    def _plan(self, manifest: Manifest) -> PeerPlan:
        """Validate and plan a table this engine has not planned (from this peer) yet."""
        slots, layout = self.slots, self.slots.landing_pool.layout
        peft = self._peft(manifest)
        plan = manifest_plan(manifest, self.name, peft, slots.model_config, slots.pool_config,
                             self.source)
        if len(plan.landings) != len(manifest.table):  # every tensor lands, in table order
            raise PeerManifestError(f"{self.source}: the plan does not cover the manifest")
        offsets = np.array([layout.region(t.target.layer, t.target.module, t.kind).offset
                            for t in plan.landings], dtype=np.int64) * layout.itemsize
        nbytes = manifest.table["nbytes"].astype(np.int64)
        return PeerPlan(manifest.shape_bytes, manifest.peft_raw, manifest.dtype, plan, offsets,
                        nbytes, table_rows(plan, layout),
                        GainBound.of(plan, slots.landing_pool.norm_keys))

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
        if self.peft is not None:
            return PeftAdapterConfig.from_dict(self.peft)
        return manifest.peft_config(self.slots.landing_pool.layout, self.source)

    def _choose(self, manifest: Manifest) -> str:
        """nixl when asked (or on auto when both sides can), else http; refusals here
        still come before any slot is touched."""
        pool_dtype = DTYPE_NAMES[self.slots.landing_pool.layout.dtype]
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
                endpoint_for(self.slots.landing_pool, self.slots.landing_pool.buffer)  # can NIXL start here?
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

    def _http_writer(self, client: PeerClient, manifest: Manifest,
                     entry: PeerPlan) -> Callable[[Landing], None]:
        """Stream the bytes into pinned staging, each piece uploaded as it is in, and run
        the disk path's NaN/Inf check and the gain bound (no registration did) before any
        slot is touched. On CUDA the plan's recipe (B sent as Bt) lands it in one kernel;
        else typed views."""
        plan = entry.plan
        staging = self.staging or self.slots.staging
        start = time.perf_counter()
        data = staging.stream(plan.data_bytes, lambda out, on_range: client.read_exact(
            manifest.http_path, out, on_range, ranged=manifest.http_ranges))
        recipe = self.slots.recipes.get(plan, staged_bt=True)
        if recipe is not None:
            staged = stage(plan, data, recipe)  # raises, naming a tensor, on NaN/Inf
            self.stats["transfer_ms"] = (time.perf_counter() - start) * 1e3
            self.slots.bound_in_scratch(plan, staged, entry.bound)
            return functools.partial(Landing.write_staged, staged=staged)
        views = canonical_views(plan, stage_views(plan, data))
        self.stats["transfer_ms"] = (time.perf_counter() - start) * 1e3
        self.slots.bound_in_scratch(plan, views, entry.bound)
        return functools.partial(Landing.write_views, plan=plan, views=views)

    @staticmethod
    def _runs(entry: PeerPlan, manifest: Manifest) -> Runs:
        """The plan's tensors coalesced for the peer's placement, kept with the plan."""
        key = manifest.nixl.addrs.tobytes()
        runs = entry.runs.get(key)
        if runs is None:
            runs = coalesce(entry.local_offsets, manifest.nixl.addrs, entry.nbytes)
            while len(entry.runs) >= 4:  # a peer engine may export from another slot
                entry.runs.pop(next(iter(entry.runs)))
            entry.runs[key] = runs
        return runs

    def _nixl_writer(self, manifest: Manifest, entry: PeerPlan, deadline: Deadline,
                     peer: str) -> Callable[[Landing], None]:
        """Local ranges come only from the local layout (the cached plan's offsets); the
        peer's sizes equal them (the table was checked, or is byte-equal to one that
        was). Runs and both descriptor lists are reused across landings."""
        endpoint = endpoint_for(self.slots.landing_pool, self.slots.landing_pool.buffer)
        nixl = manifest.nixl
        runs = self._runs(entry, manifest)
        agent = endpoint.add_remote(nixl.agent_metadata)
        plan, itemsize, stats = entry.plan, self.slots.landing_pool.layout.itemsize, self.stats

        def write(landing: Landing) -> None:
            start = time.perf_counter()
            slot = landing.slot_range(plan, entry.tables, entry.bound)
            local = [(slot.addr + off, n, endpoint.device_id) for off, n in runs.local]
            remote = [(addr, n, nixl.device) for addr, n in runs.remote]
            try:
                endpoint.read(agent, local, remote, nixl.mem_type, deadline,
                              within=(slot.addr, slot.nbytes))
            except PeerUnavailableError:
                endpoint.forget_remote(agent)  # reconnect from fresh metadata next time
                raise
            mid = time.perf_counter()
            transport = endpoint.transport_of(agent)
            stats["ucx_transport"] = transport.name if transport is not None else None
            if runs.gaps:  # then every byte outside the plan's tensors is zero again, and
                landing.zero_elements(runs.gap_elements(itemsize, self.slots.landing_pool.device))
            # the commit's verify sees NaN/Inf in the tensors through their norms
            stats.update(transfer_ms=(mid - start) * 1e3, check_ms=(time.perf_counter() - mid) * 1e3,
                         runs=len(runs.local))

        return write
