"""The NIXL landing path on CPU, against a fake NIXL agent that moves bytes with
memmove between two pools of this process: coalescing into runs, the reuse of a
peer's loaded metadata and of prepared descriptor lists, the zeroing of bytes a run
carried between tensors, the plan cache (and its invalidation when the peer's layout
changes), and a peer that dies or stalls mid-transfer (slot EMPTY, fresh uid, the
engine lands again afterwards). The real NIXL is covered by test_peer_store's NIXL
cases where it is installed."""

from __future__ import annotations

import ctypes
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from metrale import errors
from metrale.adapters.weights_check import WeightsOverflowError
from metrale.peer import nixl_transport
from metrale.peer.client import wait_for_releases
from metrale.peer.errors import PeerTimeoutError, PeerTransferError
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.nixl_transport import coalesce
from metrale.peer.plans import plan_cache_for
from tests.helpers.peers import adapter_dir, assert_matches_disk, disk_exporter, new_slots
from tests.helpers.pool import land_disk, land_peer


class FakeAgent:
    """The subset of nixl_agent metrale calls. READs copy with memmove; `mode`
    (class-wide) makes transfers fail or stall: ok | die | stall."""

    mode = "ok"
    calls: Counter = Counter()
    _ids = itertools.count(1)

    def __init__(self, name, config) -> None:
        self.name, self.backends = name, {"UCX": 1}
        self.dlists: dict[int, list] = {}
        self.xfers: dict[int, list] = {}

    def register_memory(self, tensor):
        return ("registered", tensor.data_ptr())

    def get_agent_metadata(self) -> bytes:
        return b"fake-agent:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        FakeAgent.calls["add_remote_agent"] += 1
        return metadata.split(b":", 1)[1]

    def remove_remote_agent(self, name) -> None:
        FakeAgent.calls["remove_remote_agent"] += 1

    def prep_xfer_dlist(self, agent_name, descs, mem_type):
        FakeAgent.calls["prep_xfer_dlist"] += 1
        handle = next(self._ids)
        self.dlists[handle] = list(descs)
        return handle

    def make_prepped_xfer(self, op, local_h, local_idx, remote_h, remote_idx):
        FakeAgent.calls["make_prepped_xfer"] += 1
        assert op == "READ"
        handle = next(self._ids)
        self.xfers[handle] = [(self.dlists[local_h][i], self.dlists[remote_h][j])
                              for i, j in zip(local_idx, remote_idx)]
        return handle

    def transfer(self, handle) -> str:
        FakeAgent.calls["descriptors"] += len(self.xfers[handle])
        pairs = self.xfers[handle]
        if FakeAgent.mode == "die":  # half the bytes, then the peer is gone
            (dst, n, _), (src, _, _) = pairs[0]
            ctypes.memmove(dst, src, n // 2)
            return "PROC"
        if FakeAgent.mode == "stall":
            return "PROC"
        for (dst, n, _), (src, m, _) in pairs:
            assert n == m
            ctypes.memmove(dst, src, n)
        return "DONE"

    def check_xfer_state(self, handle) -> str:
        FakeAgent.calls["polls"] += 1
        return {"die": "ERR", "stall": "PROC"}.get(FakeAgent.mode, "DONE")

    def release_xfer_handle(self, handle) -> None:
        self.xfers.pop(handle)

    def release_dlist_handle(self, handle) -> None:
        self.dlists.pop(handle)


class FakeNixl:
    nixl_agent = FakeAgent

    @staticmethod
    def nixl_agent_config(backends):
        return None


@pytest.fixture
def fake_nixl(monkeypatch):
    monkeypatch.setattr(nixl_transport, "load_nixl", lambda: FakeNixl)
    FakeAgent.mode, FakeAgent.calls = "ok", Counter()
    yield FakeAgent
    FakeAgent.mode = "ok"


def _peer(rank: int = 8, adapters=("a",)):
    """A peer serving `adapters`, slot i holding adapters[i] under its name."""
    exporter = disk_exporter(*adapters, rank=rank, transports=("http", "nixl"))
    server = PeerHTTPServer(exporter).start()
    return exporter.slots, exporter, server


def _close(exporter, server) -> None:
    server.close()
    exporter.close()


def test_matching_layouts_land_in_one_run_with_everything_reused(fake_nixl):
    source, exporter, server = _peer()
    # junk in the rows past the adapter's rank: a run carries them, the landing zeroes them
    source.pool.lora_a(0, "q_proj")[0, 4:] = 7.0
    slots = new_slots()
    try:
        addr = server.url.removeprefix("http://")
        stats = {}
        land_peer(slots, addr, "a", 1, transport="nixl", stats=stats)
        assert stats["runs"] == 1 and not stats["plan_cached"]
        assert_matches_disk(slots, 1, "a")
        first = Counter(fake_nixl.calls)
        assert first["add_remote_agent"] == 1 and first["prep_xfer_dlist"] == 2
        land_peer(slots, addr, "a", 1, transport="nixl", stats=stats)
        assert stats["plan_cached"] and stats["runs"] == 1
        assert_matches_disk(slots, 1, "a")
        again = fake_nixl.calls
        assert again["add_remote_agent"] == 1  # metadata loaded once per peer
        assert again["prep_xfer_dlist"] == 2  # both lists prepared once, reused
        assert again["make_prepped_xfer"] == 2 and again["descriptors"] == 2
        land_peer(slots, addr, "a", 2, transport="nixl")  # another local slot
        assert fake_nixl.calls["prep_xfer_dlist"] == 3  # only its local list is new
        assert_matches_disk(slots, 2, "a")
    finally:
        _close(exporter, server)


def test_other_peer_layout_still_lands_exactly(fake_nixl):
    """A peer whose pool has another max rank: regions are spaced differently, so runs
    split where the spacing differs, and the bytes are still exactly the disk's."""
    source, exporter, server = _peer(rank=16, adapters=("a", "b"))
    slots = new_slots()
    try:
        addr = server.url.removeprefix("http://")
        for name in ("a", "b"):
            stats = {}
            slot, _ = land_peer(slots, addr, name, transport="nixl", stats=stats)
            assert 1 < stats["runs"] <= stats["tensors"]
            assert_matches_disk(slots, slot, name)
    finally:
        _close(exporter, server)


@pytest.mark.parametrize("mode,cause", [("die", PeerTransferError), ("stall", PeerTimeoutError)])
def test_peer_dead_or_stalled_mid_transfer_leaves_the_slot_empty(fake_nixl, mode, cause):
    source, exporter, server = _peer()
    slots = new_slots()
    land_disk(slots, adapter_dir("c"), 0)
    old = slots.table.info(0)
    try:
        addr = server.url.removeprefix("http://")
        fake_nixl.mode = mode
        with pytest.raises(errors.LandingError, match="now EMPTY") as info:
            land_peer(slots, addr, "a", 0, transport="nixl", timeout_s=1.0)
        assert isinstance(info.value.__cause__, cause)
        now = slots.table.info(0)
        assert now.version is None and now.state.value == "EMPTY" and now.uid != old.uid
        assert not slots.pool.slot_region(0).any()
        assert fake_nixl.calls["remove_remote_agent"] == 1  # reconnect next time
        wait_for_releases()  # releases go out on a background thread
        assert exporter.open_leases == 0
        fake_nixl.mode = "ok"  # the engine goes on: the next landing reloads the peer
        land_peer(slots, addr, "a", 0, transport="nixl")
        assert fake_nixl.calls["add_remote_agent"] == 2
        assert_matches_disk(slots, 0, "a")
        slots.table.check_integrity()
    finally:
        _close(exporter, server)


@pytest.mark.parametrize("transport", ["http", "nixl"])
def test_cached_plan_is_replaced_when_the_peer_layout_changes(fake_nixl, transport):
    """Same peer, same adapter id, other content (ranks, targets): the cached plan no
    longer matches the table, so the landing is validated and planned afresh."""
    source, exporter, server = _peer()
    slots = new_slots()
    cache = plan_cache_for(slots.pool)
    try:
        addr = server.url.removeprefix("http://")
        land_peer(slots, addr, "a", 0, name="x", transport=transport)
        land_peer(slots, addr, "a", 0, name="x", transport=transport)
        assert (cache.hits, cache.misses) == (1, 1)
        old = cache.get(f"127.0.0.1:{server.server_address[1]}", "a").shape_bytes
        wait_for_releases()  # the lease on the peer slot ends on a background thread
        source.unload_slot(0)  # the peer now serves b's weights under the id "a"
        land_disk(source, adapter_dir("b"), 0)
        stats = {}
        land_peer(slots, addr, "a", 0, name="x", transport=transport, stats=stats)
        assert not stats["plan_cached"] and cache.misses == 2
        assert cache.get(f"127.0.0.1:{server.server_address[1]}", "a").shape_bytes != old
        assert len(cache) == 1
        assert_matches_disk(slots, 0, "b")
    finally:
        _close(exporter, server)


# --- coalescing, as a pure function ------------------------------------------------------


def _arr(*values):
    return np.array(values, dtype=np.int64)


def test_coalesce_merges_equal_spacing_and_reports_gaps():
    runs = coalesce(_arr(0, 100, 300), np.array([1000, 1100, 1300], dtype=np.uint64),
                    _arr(100, 150, 50))
    assert runs.local == ((0, 350),) and runs.remote == ((1000, 350),)
    assert runs.gaps == ((250, 50),)


def test_coalesce_splits_where_spacing_differs_or_order_reverses():
    runs = coalesce(_arr(0, 100, 200), np.array([5000, 5100, 100], dtype=np.uint64),
                    _arr(100, 100, 100))
    assert runs.local == ((0, 200), (200, 100))
    assert runs.remote == ((5000, 200), (100, 100)) and runs.gaps == ()
    runs = coalesce(_arr(0, 100), np.array([0 + 7, 120], dtype=np.uint64), _arr(100, 100))
    assert len(runs.local) == 2  # remote gap 13, local gap 0


def test_coalesce_sorts_by_local_offset_and_caps_bridges():
    runs = coalesce(_arr(200, 0), np.array([700, 500], dtype=np.uint64), _arr(100, 100))
    assert runs.local == ((0, 300),) and runs.remote == ((500, 300),)
    assert runs.gaps == ((100, 100),)
    far = coalesce(_arr(0, 10 << 20), np.array([0, 10 << 20], dtype=np.uint64), _arr(64, 64),
                   max_gap=1 << 20)
    assert len(far.local) == 2  # a gap of megabytes is not worth carrying


def test_coalesce_never_wraps_on_addresses_near_the_top():
    top = np.uint64((1 << 64) - 256)
    runs = coalesce(_arr(0, 128), np.array([top, 64], dtype=np.uint64), _arr(64, 64))
    assert len(runs.local) == 2
    assert sum(n for _, n in runs.local) == 128
    assert torch.equal(runs.gap_elements(4, "cpu"), torch.empty(0, dtype=torch.int64))


def test_warm_up_prepares_the_first_landing_and_touches_no_slot(fake_nixl):
    """warm_up_peer leases, plans, loads the peer's agent and READs a few bytes into the
    endpoint's scratch, then lets the lease go; the slots are as they were, and the first
    landing after it reuses the plan, the agent and the runs."""
    from metrale.peer.landing import warm_up_peer

    source, exporter, server = _peer()
    slots = new_slots()
    land_disk(slots, adapter_dir("b"), 1)  # a slot serving something: never touched
    before = (slots.pool.buffer.clone(), slots.table.infos())
    cache = plan_cache_for(slots.pool)
    try:
        addr = server.url.removeprefix("http://")
        peer = f"127.0.0.1:{server.server_address[1]}"
        assert not cache.knows(peer)
        assert warm_up_peer(slots, addr, "a", transport="nixl") == "nixl"
        assert torch.equal(slots.pool.buffer, before[0]) and slots.table.infos() == before[1]
        assert cache.knows(peer) and (cache.hits, cache.misses) == (0, 1)
        assert fake_nixl.calls["add_remote_agent"] == 1 and fake_nixl.calls["descriptors"] == 1
        wait_for_releases()
        assert exporter.open_leases == 0
        stats = {}
        land_peer(slots, addr, "a", 0, name="x", transport="nixl", stats=stats)
        assert stats["plan_cached"] and (cache.hits, cache.misses) == (1, 1)
        assert fake_nixl.calls["add_remote_agent"] == 1
        assert_matches_disk(slots, 0, "a")
    finally:
        _close(exporter, server)


@pytest.mark.parametrize("where,value", [("A", float("nan")), ("B", float("inf")),
                                         ("A", float("-inf"))])
def test_non_finite_bytes_read_over_nixl_fail_the_landing(fake_nixl, where, value):
    """A peer whose slot was written after its own checks: the bytes READ into the slot
    skip staging, and the commit's verify (the norms of every region) refuses them as
    NaN/Inf (not as an overflow: the gain bound, which NaN also fails, comes second); the
    slot is EMPTY with a new uid and the next landing serves."""
    source, exporter, server = _peer()
    slots = new_slots()
    land_disk(slots, adapter_dir("c"), 0)
    old = slots.table.info(0)
    pool = source.pool
    region = pool.lora_a(1, "v_proj") if where == "A" else pool.lora_bt(1, "v_proj")
    region[0, 1, 2] = value
    try:
        addr = server.url.removeprefix("http://")
        with pytest.raises(errors.LandingError, match="now EMPTY") as info:
            land_peer(slots, addr, "a", 0, transport="nixl")
        cause = info.value.__cause__
        assert isinstance(cause, errors.NonFiniteWeightsError), cause
        assert not isinstance(cause, WeightsOverflowError) and "NaN or Inf" in str(cause)
        now = slots.table.info(0)
        assert now.state.value == "EMPTY" and now.uid != old.uid
        assert not slots.pool.slot_region(0).any()
        region[0, 1, 2] = 0.5
        land_peer(slots, addr, "a", 0, transport="nixl")
        slots.table.check_integrity()
    finally:
        _close(exporter, server)


def test_poison_between_a_peers_tensors_is_zeroed_not_served(fake_nixl):
    """A run READs the peer's bytes between two tensors (a DoRA magnitude region the
    adapter does not use, rows past its rank) along with them; those are zeroed after the
    READ, so NaN or Inf there neither lands nor fails the landing."""
    source, exporter, server = _peer()
    slots = new_slots()
    source.pool.magnitude(1, "q_proj")[0].fill_(float("nan"))
    source.pool.lora_a(1, "q_proj")[0, 4:].fill_(float("inf"))  # rows past a's rank 4
    try:
        addr = server.url.removeprefix("http://")
        stats = {}
        land_peer(slots, addr, "a", 0, transport="nixl", stats=stats)
        assert stats["runs"] == 1  # the poisoned region was inside the run
        assert_matches_disk(slots, 0, "a")
        assert not slots.pool.magnitude(1, "q_proj")[0].any()
    finally:
        _close(exporter, server)
