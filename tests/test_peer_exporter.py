"""AdapterExporter: a leased slot cannot be swapped, unloaded or evicted until
the lease is released or expires (an open stream defers the expiry); table
access goes through the engine's `call`; clients off the allow-list are
refused; and one engine's READY slots land in another engine, in another
process, byte for byte (this file doubles as that exporting engine's script).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from metrale import errors
from metrale.peer import AdapterExporter, PeerHTTPServer, promote_from_peer, swap_from_peer
from metrale.peer.errors import LeaseNotFoundError, PeerConnectionError
from metrale.peer.nixl_shim import nixl_available
from metrale.pool.slots import SlotState
from tests.helpers.peers import (
    REPO,
    adapter_dir,
    assert_matches_disk,
    new_slots,
    peer_root,
    stop,
    wait_for_line,
)
from tests.helpers.pool import snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def leased():
    """Slot 0 holds "a" (leased), slot 1 "b"; max_loras=2."""
    slots = new_slots(max_loras=2)
    slots.swap_lora_slot_from_disk(adapter_dir("a"), "a", 0)
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 1)
    clock = Clock()
    exporter = AdapterExporter(slots, clock=clock)
    reply = exporter.lease("a", ttl_s=10)
    return slots, exporter, clock, reply.lease_id


def _refusals(slots):
    with pytest.raises(errors.SlotBusyError):
        slots.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)
    with pytest.raises(errors.SlotBusyError):
        slots.unload("a")


def test_leased_slot_is_never_swapped_or_evicted(leased):
    slots, exporter, _, lease_id = leased
    before = snapshot(slots)
    _refusals(slots)
    assert snapshot(slots)[0] == before[0]
    slot, evicted = slots.promote_lora_slot_from_disk(adapter_dir("c"), "c")
    assert (slot, evicted) == (1, "b")  # the leased slot is no victim
    exporter.lease("c")
    with pytest.raises(errors.PoolFullError):
        slots.promote_lora_slot_from_disk(adapter_dir("b"), "b")
    exporter.release(lease_id)
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 0)
    with pytest.raises(LeaseNotFoundError):
        exporter.release(lease_id)
    slots.table.check_integrity()


def test_lease_expires(leased):
    slots, exporter, clock, lease_id = leased
    clock.now += 9
    exporter.expire()
    _refusals(slots)
    clock.now += 2
    with pytest.raises(LeaseNotFoundError):
        exporter.open_data(lease_id)  # expired even before the sweep
    exporter.expire()
    assert exporter.open_leases == 0
    slots.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -5.0, 1e9])
def test_lease_ttl_is_bounded(leased, ttl):
    slots, exporter, clock, lease_id = leased
    exporter.release(lease_id)
    assert 1.0 <= exporter.lease("a", ttl_s=ttl).expires_in_s <= exporter.max_ttl_s
    clock.now += exporter.max_ttl_s + 1
    exporter.expire()
    assert slots.table.ref_count(0) == 0


def test_open_stream_defers_expiry_and_release(leased):
    slots, exporter, clock, lease_id = leased
    n, chunks = exporter.open_data(lease_id)
    next(chunks)
    clock.now += 60
    exporter.expire()
    _refusals(slots)  # mid-stream: the bytes must not change
    chunks.close()
    exporter.expire()
    assert slots.table.ref_count(0) == 0
    lease2 = exporter.lease("a").lease_id
    n, chunks = exporter.open_data(lease2)
    exporter.release(lease2)  # released mid-stream: the reference goes when the stream ends
    assert slots.table.ref_count(0) == 1
    assert sum(len(c) for c in chunks) == n
    assert slots.table.ref_count(0) == 0


def test_a_stream_closed_before_its_first_slice_still_lets_the_slot_go(leased):
    """The server closes a stream whose headers failed to send (a client gone at once)."""
    slots, exporter, _, lease_id = leased
    _, chunks = exporter.open_data(lease_id)
    chunks.close()
    exporter.release(lease_id)
    assert slots.table.ref_count(0) == 0


def _stream(exporter, name):
    lease_id = exporter.lease(name).lease_id
    n, chunks = exporter.open_data(lease_id)
    data = b"".join(bytes(c) for c in chunks)
    exporter.release(lease_id)
    assert len(data) == n
    return data


def test_host_copies_follow_the_landing_never_the_slot():
    """A device pool's streams send a host copy kept per landing (uid): a slot that takes
    another adapter streams the new bytes, and the old copy goes; copies beyond the
    budget go, least recently streamed first. (copy_to_host forces the device pool's
    path on this CPU pool; the bytes without it come straight from the pool.)"""
    slots = new_slots(max_loras=2)
    slots.swap_lora_slot_from_disk(adapter_dir("a"), "a", 0)
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 1)
    direct = AdapterExporter(slots)
    want = {name: _stream(direct, name) for name in ("a", "b")}
    exporter = AdapterExporter(slots, copy_to_host=True,
                               host_copy_bytes=len(want["a"]) + len(want["b"]))
    uid = {name: slots.table.info(slots.table.slot_of(name)).uid for name in ("a", "b")}
    assert _stream(exporter, "a") == want["a"] and exporter.host_copies == [uid["a"]]
    assert _stream(exporter, "a") == want["a"]  # from the kept copy
    # two open leases of different landings, streamed interleaved
    leases = {name: exporter.lease(name).lease_id for name in ("a", "b")}
    streams = {name: exporter.open_data(lease)[1] for name, lease in leases.items()}
    got = {name: bytearray() for name in streams}
    while streams:
        for name in list(streams):
            piece = next(streams[name], None)
            if piece is None:
                del streams[name]
            else:
                got[name] += piece
    for lease in leases.values():
        exporter.release(lease)
    assert got == want and exporter.host_copies == [uid["a"], uid["b"]]

    slots.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)  # slot 0: a new landing
    want["c"] = _stream(direct, "c")
    assert _stream(exporter, "b") == want["b"]  # the next lease sees slot 0 changed
    assert uid["a"] not in exporter.host_copies
    assert _stream(exporter, "c") == want["c"]
    uid["c"] = slots.table.info(0).uid
    assert exporter.host_copies == [uid["b"], uid["c"]]  # b's and c's copies fit the budget

    assert len(want["c"]) < len(want["b"])
    small = AdapterExporter(slots, copy_to_host=True, host_copy_bytes=len(want["b"]))
    assert _stream(small, "b") == want["b"] and small.host_copies == [uid["b"]]
    assert _stream(small, "c") == want["c"] and small.host_copies == [uid["c"]]
    tiny = AdapterExporter(slots, copy_to_host=True, host_copy_bytes=len(want["c"]))
    assert _stream(tiny, "b") == want["b"] and tiny.host_copies == []  # served, not kept
    assert slots.table.ref_count(0) == slots.table.ref_count(1) == 0


def test_a_host_copy_lands_through_the_server_byte_for_byte():
    """The device pool's path end to end (forced on this CPU pool), twice: the second
    landing streams the kept copy."""
    slots = new_slots(max_loras=1)
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 0)
    exporter = AdapterExporter(slots, copy_to_host=True)
    server = PeerHTTPServer(exporter).start()
    try:
        engine = new_slots()
        for slot in (0, 1):
            swap_from_peer(engine, server.url, "b", f"b{slot}", slot, transport="http", timeout_s=10)
            assert_matches_disk(engine, slot, "b")
    finally:
        server.close()
    assert exporter.host_copies == [slots.table.info(0).uid] and slots.table.ref_count(0) == 0


def test_sweeper_expires_in_real_time():
    slots = new_slots(max_loras=1)
    slots.swap_lora_slot_from_disk(adapter_dir("a"), "a", 0)
    exporter = AdapterExporter(slots).start(sweep_s=0.05)
    try:
        exporter.lease("a", ttl_s=1.0)
        assert slots.table.ref_count(0) == 1
        end = time.monotonic() + 5
        while slots.table.ref_count(0) and time.monotonic() < end:
            time.sleep(0.05)
        assert slots.table.ref_count(0) == 0
    finally:
        exporter.close()


def test_exporter_touches_the_table_only_through_call():
    """A running engine passes call = run-on-the-engine-loop; the HTTP threads never
    touch its SlotTable themselves."""
    slots = new_slots(max_loras=1)
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 0)
    loop = ThreadPoolExecutor(1, thread_name_prefix="engine-loop")
    seen = set()
    for method in ("acquire", "release", "infos", "info", "slot_of"):
        real = getattr(slots.table, method)

        def spy(*args, _real=real, **kwargs):
            seen.add(threading.current_thread().name.split("_")[0])
            return _real(*args, **kwargs)

        setattr(slots.table, method, spy)
    exporter = AdapterExporter(slots, call=lambda fn: loop.submit(fn).result(timeout=5))
    server = PeerHTTPServer(exporter).start()
    try:
        engine = new_slots()
        swap_from_peer(engine, server.url, "b", "b", 2, transport="http", timeout_s=10)
        assert_matches_disk(engine, 2, "b")
    finally:
        server.close()
        loop.shutdown()
    assert seen == {"engine-loop"}
    assert slots.table.ref_count(0) == 0


def test_client_outside_allow_list_refused():
    slots = new_slots(max_loras=1)
    slots.swap_lora_slot_from_disk(adapter_dir("a"), "a", 0)
    exporter = AdapterExporter(slots)
    server = PeerHTTPServer(exporter, client_allow=["10.0.0.0/8"]).start()
    engine = new_slots()
    before = snapshot(engine)
    try:
        with pytest.raises(PeerConnectionError, match="allow-list"):
            promote_from_peer(engine, server.url, "a", "a", timeout_s=5)
    finally:
        server.close()
    assert snapshot(engine) == before and exporter.open_leases == 0


# --- engine to engine, across processes --------------------------------------------------

TRANSPORTS = ["http", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install nixl-cu12)"))]


@pytest.fixture(scope="module")
def exporting_engine():
    root, _ = peer_root()
    cmd = [sys.executable, "-m", "tests.test_peer_exporter", str(root)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = wait_for_line(proc, "metrale peer: serving", 60).rsplit(" on ", 1)[1].split()[0]
    yield url
    stop(proc)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_to_engine(exporting_engine, transport):
    engine = new_slots()
    for name in ("b", "c"):
        slot, _ = promote_from_peer(engine, exporting_engine, name, f"{name}-copy",
                                    transport=transport, timeout_s=20)
        assert engine.table.info(slot).state is SlotState.READY
        assert_matches_disk(engine, slot, name)  # rank/scale tables rebuilt from the slot alone
    engine.table.check_integrity()


def _serve_engine(root: str) -> None:
    """The exporting engine: its pool filled from disk, its READY slots exported with
    PEFT configs rebuilt from the rank/scale tables (no adapter dir needed)."""
    from pathlib import Path

    from metrale.config import ModelConfig, PoolConfig
    from metrale.pool.swap import LoraSlots

    root_path = Path(root)
    slots = LoraSlots(ModelConfig.from_dir(root_path / "model"), PoolConfig(3, 8), "cpu",
                      torch.float32)
    for slot, name in enumerate(("c", "b")):
        slots.swap_lora_slot_from_disk(root_path / "adapters" / name, name, slot)
    transports = ("http", "nixl") if nixl_available() else ("http",)
    exporter = AdapterExporter(slots, transports=transports).start()
    server = PeerHTTPServer(exporter)
    print(f"metrale peer: serving engine slots on {server.url}", flush=True)
    server.serve_forever(0.1)


if __name__ == "__main__":
    _serve_engine(sys.argv[1])
