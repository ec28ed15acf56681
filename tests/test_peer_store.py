"""An engine-side LoraSlots staging adapters from a real `metrale peer serve`
subprocess, over HTTP and (when installed) NIXL: the landed slot equals a disk
landing of the same adapter and PEFT's scaling * B @ A; failures mid-transfer
leave the slot EMPTY within the timeout; leases never leak."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from metrale import errors
from metrale.config import ModelConfig
from metrale.peer.client import wait_for_releases
from metrale.peer.errors import (
    NixlUnavailableError,
    PeerTimeoutError,
    PeerTransferError,
    UnknownPeerAdapterError,
)
from metrale.peer.nixl_shim import nixl_available
from metrale.peer.store import AdapterStore
from metrale.pool.slots import SlotState
from tests.helpers.peers import (
    adapter_dir,
    assert_matches_disk,
    model_config,
    new_slots,
    peer_root,
    start_store,
    stop,
)
from tests.helpers.pool import land_disk, land_peer, snapshot

TRANSPORTS = ["http", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install nixl-cu12)"))]


@pytest.fixture(scope="module")
def store():
    proc, url = start_store()
    yield url
    stop(proc)


def open_leases(url: str) -> int:
    with urllib.request.urlopen(f"{url}/peer/v1/health", timeout=5) as r:
        return json.load(r)["open_leases"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_promote_matches_disk_and_peft(store, transport, caplog):
    slots = new_slots()
    for i, name in enumerate(("a", "b", "c")):
        with caplog.at_level("INFO", logger="metrale.peer"):
            slot, version = land_peer(slots, store, name, transport=transport, timeout_s=20)
        assert f"via {transport}" in caplog.text
        assert slot == i and slots.table.holds(slot, version)  # the never-filled slots in turn
        assert_matches_disk(slots, slot, name)
    slots.table.check_integrity()
    wait_for_releases()  # releases go out on a background thread
    assert open_leases(store) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_swap_into_slot_evicts_and_renews_identity(store, transport):
    slots = new_slots()
    land_peer(slots, store, "a", 1, name="x", transport=transport, timeout_s=20)
    first = slots.table.info(1)
    # same name, new bytes
    _, version = land_peer(slots, store, "b", 1, name="x", transport=transport, timeout_s=20)
    second = slots.table.info(1)
    assert second.generation == first.generation + 1 and second.uid != first.uid
    assert second.version == version != first.version
    assert_matches_disk(slots, 1, "b")
    slot, version = land_peer(slots, store, "c", name="y", transport=transport, timeout_s=20)
    assert slot in (0, 2) and slots.table.holds(slot, version) and slots.table.holds(1, second.version)
    slots.table.check_integrity()


@pytest.fixture
def several_streams(monkeypatch):
    """Split even a tiny adapter's bytes (3 parts: not a divisor of their sizes), and
    record each read's spans and the pieces it told."""
    from metrale.peer import client, streams

    monkeypatch.setattr(client, "DATA_STREAMS", 3)
    monkeypatch.setattr(client, "SPLIT_BYTES", 1)
    reads = []

    def read_spans(spans, read, on_range):
        told = []
        reads.append((spans, told))
        def tell(a, b):  # a CPU engine's staging asks for no pieces: record them anyway
            told.append((a, b))
            if on_range is not None:
                on_range(a, b)

        return streams.read_spans(spans, read, tell)

    monkeypatch.setattr(client, "read_spans", read_spans)
    return reads


def test_http_over_several_streams_matches_disk(store, several_streams):
    slots = new_slots()
    for i, name in enumerate(("a", "b", "c")):
        slot, version = land_peer(slots, store, name, transport="http", timeout_s=20)
        assert slot == i and slots.table.holds(slot, version)
        assert_matches_disk(slots, slot, name)
    assert len(several_streams) == 3
    for spans, told in several_streams:
        assert len(spans) == 3
        assert sum(b - a for a, b in told) == spans[-1][1]  # every byte told once
    wait_for_releases()  # releases go out on a background thread
    assert open_leases(store) == 0


def test_http_peer_killed_between_streams_leaves_the_slot(several_streams, monkeypatch):
    """The first part lands, then the peer dies before the others connect: a typed error,
    and the slot keeps what it held (HTTP bytes are staged before the slot is touched)."""
    from metrale.peer import client

    proc, url = start_store()
    ranged = client.read_spans

    def kill_after_the_first_part(spans, read, on_range):
        first_in = threading.Event()

        def gated(a, b, on_progress, group):
            if a:
                first_in.wait()
                return read(a, b, on_progress, group)
            try:
                return read(a, b, on_progress, group)
            finally:
                stop(proc)
                first_in.set()

        return ranged(spans, gated, on_range)

    monkeypatch.setattr(client, "read_spans", kill_after_the_first_part)
    slots = new_slots()
    land_disk(slots, adapter_dir("c"), 0)
    before = snapshot(slots)
    try:
        with pytest.raises(errors.PeerUnavailableError):
            land_peer(slots, url, "b", 0, name="c", transport="http", timeout_s=10)
    finally:
        stop(proc)
    assert snapshot(slots) == before
    spans, told = several_streams[0]
    assert sum(b - a for a, b in told if b <= spans[0][1]) == spans[0][1]  # the first part was in
    slots.table.check_integrity()


def test_hostile_data_ranges_are_refused_and_leak_nothing(store):
    """A byte range that is malformed or out of the lease is a typed 400, never a 500."""
    from metrale.peer.wire import decode_doc

    request = urllib.request.Request(f"{store}/peer/v1/adapters/b/lease", method="POST",
                                     data=json.dumps({"ttl_s": 60, "manifest_version": 3}).encode())
    with urllib.request.urlopen(request, timeout=10) as r:
        reply = decode_doc(r.read())
    lease, n = reply["lease"]["id"], reply["manifest"]["data_bytes"]
    data_url = f"{store}{reply['manifest']['transports']['http']['data_path']}"
    assert reply["manifest"]["transports"]["http"]["ranges"] is True
    with urllib.request.urlopen(data_url, timeout=10) as r:
        whole = r.read()
    for query in ("offset=-1", "offset=%2B1", "offset=1_0", "offset=%D9%A1", "length=0",
                  "offset=1&offset=2", "bogus=1", "offset=" + "9" * 40, f"offset={n}",
                  f"offset={n - 1}&length=2", "offset=18446744073709551615&length=1"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{data_url}?{query}", timeout=10)
        assert info.value.code == 400, query
        assert json.load(info.value)["error"]["code"] == "DataRangeError", query
    with urllib.request.urlopen(f"{data_url}?offset=5&length=7", timeout=10) as r:
        assert r.read() == whole[5:12]
    urllib.request.urlopen(urllib.request.Request(f"{store}/peer/v1/leases/{lease}",
                                                  method="DELETE"), timeout=10).close()
    assert open_leases(store) == 0


def test_http_converts_dtype_nixl_refuses(store):
    slots = new_slots(dtype=torch.bfloat16)
    land_peer(slots, store, "b", 0, transport="http", timeout_s=20)
    assert_matches_disk(slots, 0, "b")
    if nixl_available():
        before = snapshot(slots)
        with pytest.raises(errors.AdapterMismatchError, match="transport='http'"):
            land_peer(slots, store, "a", 0, transport="nixl", timeout_s=20)
        assert snapshot(slots) == before
        slot, _ = land_peer(slots, store, "a", transport="auto", timeout_s=20)  # falls back to http
        assert_matches_disk(slots, slot, "a")


def test_without_nixl_auto_falls_back_and_nixl_refuses(store, monkeypatch):
    from metrale.peer import nixl_shim, nixl_transport

    monkeypatch.setattr(nixl_shim, "_cached", None)
    monkeypatch.setattr(nixl_shim, "MODULE_NAMES", ("no_such_nixl_module",))
    monkeypatch.setattr(nixl_transport, "load_nixl", nixl_shim.load_nixl)
    slots = new_slots()
    before = snapshot(slots)
    with pytest.raises(NixlUnavailableError, match="pip install nixl-cu12"):
        land_peer(slots, store, "a", 0, transport="nixl", timeout_s=10)
    assert snapshot(slots) == before
    slot, _ = land_peer(slots, store, "a", timeout_s=10)  # auto: HTTP
    assert_matches_disk(slots, slot, "a")


def test_unknown_adapter_and_refusals_release_leases(store):
    slots = new_slots()
    land_peer(slots, store, "a", 0, timeout_s=20)
    before = snapshot(slots)
    with pytest.raises(UnknownPeerAdapterError, match="nope"):
        land_peer(slots, store, "nope", 0, name="a", timeout_s=5)
    small = new_slots(rank=2)
    small_before = snapshot(small)
    with pytest.raises(errors.AdapterMismatchError, match="--max-lora-rank"):
        land_peer(small, store, "a", timeout_s=5)
    assert snapshot(slots) == before and snapshot(small) == small_before
    wait_for_releases()  # releases go out on a background thread
    assert open_leases(store) == 0


def test_peft_argument_overrides_the_manifest(store):
    from metrale.adapters.peft_config import PeftAdapterConfig

    slots = new_slots()
    cfg = PeftAdapterConfig.from_dir(adapter_dir("a"))
    doubled = PeftAdapterConfig.from_dict({**cfg.to_dict(), "lora_alpha": cfg.lora_alpha * 2})
    land_peer(slots, store, "a", 0, peft=doubled, timeout_s=20)
    ref = new_slots()
    land_disk(ref, adapter_dir("a"), 0)
    torch.testing.assert_close(slots.pool.scales[0], 2 * ref.pool.scales[0])


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_nixl_peer_killed_mid_transfer_leaves_slot_empty(monkeypatch):
    from metrale.peer.nixl_transport import NixlEndpoint

    proc, url = start_store("--transport", "nixl")
    real_read = NixlEndpoint.read

    def die_then_read(self, *args, **kwargs):
        stop(proc)  # the slot is zeroed and LOADING now: the peer vanishes under the READ
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(NixlEndpoint, "read", die_then_read)
    slots = new_slots()
    land_disk(slots, adapter_dir("c"), 0)
    old = slots.table.info(0)
    start = time.monotonic()
    with pytest.raises(errors.LandingError, match="now EMPTY") as info:
        land_peer(slots, url, "a", 0, transport="nixl", timeout_s=10)
    assert time.monotonic() - start < 10
    assert isinstance(info.value.__cause__, PeerTransferError)
    _assert_empty(slots, 0, old)


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_nixl_stalled_transfer_times_out_empty(store, monkeypatch):
    from metrale.peer import nixl_transport

    slots = new_slots()
    land_disk(slots, adapter_dir("c"), 2)
    old = slots.table.info(2)
    monkeypatch.setattr(nixl_transport.NixlEndpoint, "_run", _stalled_run(nixl_transport))
    start = time.monotonic()
    with pytest.raises(errors.LandingError) as info:
        land_peer(slots, store, "b", 2, transport="nixl", timeout_s=1.5)
    assert 1.0 < time.monotonic() - start < 6
    assert isinstance(info.value.__cause__, PeerTimeoutError)
    _assert_empty(slots, 2, old)
    wait_for_releases()  # releases go out on a background thread
    assert open_leases(store) == 0


def _stalled_run(nixl_transport):
    real = nixl_transport.NixlEndpoint._run

    def run(self, handle, deadline):
        agent = self._agent

        class Stalled:  # the transfer is posted but never completes
            def __getattr__(self, name):
                return getattr(agent, name)

            def transfer(self, h):
                return "PROC"

            def check_xfer_state(self, h):
                return "PROC"

        self._agent = Stalled()
        try:
            return real(self, handle, deadline)
        finally:
            self._agent = agent
    return run


def _assert_empty(slots, slot, old) -> None:
    info = slots.table.info(slot)
    assert info.state is SlotState.EMPTY and info.version is None and info.uid != old.uid
    assert not any(slots.table.holds(i, old.version) for i in range(len(slots.table)))
    assert not slots.pool.slot_region(slot).any() and not slots.pool.ranks[slot].any()
    slots.table.check_integrity()


def test_store_refuses_an_adapter_that_does_not_fit(tmp_path):
    import shutil

    root, _ = peer_root()
    shutil.copytree(root / "adapters" / "a", tmp_path / "good")
    shutil.copytree(root / "adapters" / "b", tmp_path / "big")
    with pytest.raises(errors.AdapterMismatchError, match=r"big.*--max-lora-rank"):
        AdapterStore(tmp_path, model_config(), max_lora_rank=4)
    store = AdapterStore(tmp_path, ModelConfig.from_dir(root / "model"))
    assert store.slots.pool_config.max_lora_rank == 8 and set(store.paths) == {"good", "big"}
