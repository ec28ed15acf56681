"""AdapterExporter: a leased slot cannot be swapped, freed or evicted until
the lease is released or expires (an open stream defers the expiry; an unload
drains); table and registry access goes through the engine's `call`; clients off
the allow-list are refused; and one engine's READY slots land in another engine,
in another process, byte for byte (this file doubles as that exporting engine's
script).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from metrale import errors
from metrale.peer.errors import LeaseNotFoundError, PeerConnectionError
from metrale.peer.exporter import AdapterExporter
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.nixl_shim import nixl_available
from metrale.pool.slots import SlotState
from tests.helpers.peers import (
    REPO,
    adapter_dir,
    assert_matches_disk,
    new_slots,
    peer_engine,
    peer_root,
    stop,
    wait_for_line,
)
from tests.helpers.pool import land_peer, snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def leased():
    """An engine (max_loras=2) whose slot 0 holds "a" (leased), slot 1 "b"."""
    engine = peer_engine("a", "b", max_loras=2)
    clock = Clock()
    exporter = AdapterExporter(engine.lora, engine.registry, clock=clock)
    reply = exporter.lease("a", ttl_s=10)
    return engine, exporter, clock, reply.lease_id


def _refusals(engine):
    """The leased slot 0 can be neither swapped nor freed; its bytes stay."""
    before = snapshot(engine.lora)
    with pytest.raises(errors.SlotBusyError):
        engine.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)
    with pytest.raises(errors.SlotBusyError):
        engine.lora.unload_slot(0)  # what an unload does once the slot is idle
    assert snapshot(engine.lora) == before and engine.registry.slot_of("a") == 0


def test_leased_slot_is_never_swapped_or_evicted(leased):
    engine, exporter, _, lease_id = leased
    _refusals(engine)
    slot, evicted = engine.promote_lora_slot_from_disk(adapter_dir("c"), "c")
    assert (slot, evicted) == (1, "b")  # the leased slot is no victim
    exporter.lease("c")
    with pytest.raises(errors.PoolFullError):
        engine.promote_lora_slot_from_disk(adapter_dir("b"), "b")
    exporter.release(lease_id)
    engine.swap_lora_slot_from_disk(adapter_dir("b"), "b", 0)
    with pytest.raises(LeaseNotFoundError):
        exporter.release(lease_id)
    engine.check_integrity()


def test_unloading_a_leased_adapter_drains_its_slot(leased):
    """The name goes at once (nothing new may lease it); its bytes stay until the lease ends."""
    engine, exporter, _, lease_id = leased
    before = snapshot(engine.lora)
    assert engine.unload_adapter("a") == "draining"
    with pytest.raises(errors.UnknownAdapterError, match="not resident"):
        exporter.lease("a")
    engine.step()  # a boundary: the slot still serves the lease
    assert snapshot(engine.lora) == before
    exporter.release(lease_id)
    engine.step()
    info = engine.lora.table.info(0)
    assert info.state is SlotState.EMPTY and not engine.lora.pool.slot_region(0).any()
    assert engine.registry.draining() == {}
    engine.check_integrity()


def test_lease_expires(leased):
    engine, exporter, clock, lease_id = leased
    clock.now += 9
    exporter.expire()
    _refusals(engine)
    clock.now += 2
    with pytest.raises(LeaseNotFoundError):
        exporter.open_data(lease_id)  # expired even before the sweep
    exporter.expire()
    assert exporter.open_leases == 0
    engine.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)


def test_lease_ttl_is_bounded(leased):
    engine, exporter, clock, lease_id = leased
    exporter.release(lease_id)
    for ttl, granted in ((1e9, exporter.max_ttl_s), (0.25, 1.0), (None, exporter.default_ttl_s)):
        lease = exporter.lease("a", ttl_s=ttl)
        assert lease.expires_in_s == granted
        exporter.release(lease.lease_id)
    assert engine.lora.table.ref_count(0) == 0


BAD_TTLS = [float("nan"), float("inf"), -float("inf"), -1, -5.0, 0, True, "30", [30], 10 ** 400]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_a_ttl_that_is_no_lifetime_is_refused_and_leases_nothing(leased, ttl):
    """NaN would never expire (a slot pinned for good), a negative or infinite one is no
    lifetime: refused (LeaseTTLError), no lease opened, no slot reference taken."""
    from metrale.peer.errors import LeaseTTLError

    engine, exporter, clock, lease_id = leased
    exporter.release(lease_id)
    with pytest.raises(LeaseTTLError, match="ttl_s"):
        exporter.lease("a", ttl_s=ttl)
    assert exporter.open_leases == 0 and engine.lora.table.ref_count(0) == 0


def test_the_export_port_refuses_such_ttls_with_a_400(leased):
    engine, exporter, clock, lease_id = leased
    exporter.release(lease_id)
    server = PeerHTTPServer(exporter).start()
    try:
        for raw in ("NaN", "Infinity", "-Infinity", "-1", "0", "true", '"30"', "1e400", "1" + "0" * 400):
            request = urllib.request.Request(
                f"{server.url}/peer/v1/adapters/a/lease", method="POST",
                data=f'{{"ttl_s": {raw}, "manifest_version": 3}}'.encode(),
                headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=10)
            assert info.value.code == 400, raw
            assert json.load(info.value)["error"]["code"] == "LeaseTTLError", raw
    finally:
        server.close()
    assert exporter.open_leases == 0 and engine.lora.table.ref_count(0) == 0


def test_open_stream_defers_expiry_and_release(leased):
    engine, exporter, clock, lease_id = leased
    slots = engine.lora
    n, chunks = exporter.open_data(lease_id)
    next(chunks)
    clock.now += 60
    exporter.expire()
    _refusals(engine)  # mid-stream: the bytes must not change
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
    engine, exporter, _, lease_id = leased
    _, chunks = exporter.open_data(lease_id)
    chunks.close()
    exporter.release(lease_id)
    assert engine.lora.table.ref_count(0) == 0


def _read(stream) -> bytes:
    return b"".join(bytes(c) for c in stream)


def test_ranged_streams_are_parts_and_each_holds_the_lease(leased):
    """Byte ranges of a lease are pieces of its whole stream, and each open one holds the
    slot as a whole stream does: the expiry waits for the last of them."""
    engine, exporter, clock, lease_id = leased
    n, whole = exporter.open_data(lease_id)
    want = _read(whole)
    cuts = [0, 1, n // 3, n - 1]
    parts = [exporter.open_data(lease_id, a, b - a) for a, b in zip(cuts, cuts[1:])]
    parts.append(exporter.open_data(lease_id, n - 1))  # no length: to the end
    assert [m for m, _ in parts] == [1, n // 3 - 1, n - 1 - n // 3, 1]
    clock.now += 60
    got = b""
    for _, stream in parts:
        exporter.expire()
        _refusals(engine)  # a part still open: the bytes must not change
        got += _read(stream)
    assert got == want
    exporter.expire()
    assert exporter.open_leases == 0 and engine.lora.table.ref_count(0) == 0


def _hostile_queries(n: int) -> list[str]:
    """Data queries that are not a non-empty range of n bytes, in every way we know."""
    return ["offset=-1", "offset=%2B1", "offset=1_0", "offset=%D9%A1", "offset=1e3", "offset=0x1",
            "offset=%201", "offset=", "offset", "length=0", "offset=1&offset=2", "bogus=1",
            "offset=1&length=1&length=1", "offset=1;length=1", "%zz", "&", "offset=1&&length=1",
            "offset=" + "9" * 40, f"offset={n}", f"length={n + 1}", f"offset={n - 1}&length=2",
            "offset=18446744073709551615&length=18446744073709551615", f"offset=1&length={n}"]


def test_hostile_ranges_are_a_typed_400_and_hold_nothing(leased):
    engine, exporter, clock, lease_id = leased
    n, stream = exporter.open_data(lease_id)
    stream.close()
    server = PeerHTTPServer(exporter).start()
    try:
        for query in _hostile_queries(n):
            url = f"{server.url}/peer/v1/leases/{lease_id}/data?{query}"
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(url, timeout=10)
            assert info.value.code == 400, query
            assert json.load(info.value)["error"]["code"] == "DataRangeError", query
        with urllib.request.urlopen(f"{server.url}/peer/v1/leases/{lease_id}/data?offset=1",
                                    timeout=10) as reply:
            assert len(reply.read()) == n - 1  # the lease still serves
    finally:
        server.close()
    clock.now += 60
    exporter.expire()  # no refused range kept a hold on the lease
    assert exporter.open_leases == 0 and engine.lora.table.ref_count(0) == 0


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
    engine = peer_engine("a", "b", max_loras=2)
    slots, registry = engine.lora, engine.registry
    direct = AdapterExporter(slots, registry)
    want = {name: _stream(direct, name) for name in ("a", "b")}
    exporter = AdapterExporter(slots, registry, copy_to_host=True,
                               host_copy_bytes=len(want["a"]) + len(want["b"]))
    uid = {name: slots.table.info(registry.slot_of(name)).uid for name in ("a", "b")}
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

    engine.swap_lora_slot_from_disk(adapter_dir("c"), "c", 0)  # slot 0: a new landing
    want["c"] = _stream(direct, "c")
    assert _stream(exporter, "b") == want["b"]  # the next lease sees slot 0 changed
    assert uid["a"] not in exporter.host_copies
    assert _stream(exporter, "c") == want["c"]
    uid["c"] = slots.table.info(0).uid
    assert exporter.host_copies == [uid["b"], uid["c"]]  # b's and c's copies fit the budget

    assert len(want["c"]) < len(want["b"])
    small = AdapterExporter(slots, registry, copy_to_host=True, host_copy_bytes=len(want["b"]))
    assert _stream(small, "b") == want["b"] and small.host_copies == [uid["b"]]
    assert _stream(small, "c") == want["c"] and small.host_copies == [uid["c"]]
    tiny = AdapterExporter(slots, registry, copy_to_host=True, host_copy_bytes=len(want["c"]))
    assert _stream(tiny, "b") == want["b"] and tiny.host_copies == []  # served, not kept
    assert slots.table.ref_count(0) == slots.table.ref_count(1) == 0


def test_a_host_copy_lands_through_the_server_byte_for_byte():
    """The device pool's path end to end (forced on this CPU pool), twice: the second
    landing streams the kept copy."""
    source = peer_engine("b", max_loras=1)
    slots = source.lora
    exporter = AdapterExporter(slots, source.registry, copy_to_host=True)
    server = PeerHTTPServer(exporter).start()
    try:
        engine = new_slots()
        for slot in (0, 1):
            land_peer(engine, server.url, "b", slot, name=f"b{slot}", transport="http", timeout_s=10)
            assert_matches_disk(engine, slot, "b")
    finally:
        server.close()
    assert exporter.host_copies == [slots.table.info(0).uid] and slots.table.ref_count(0) == 0


def test_sweeper_expires_in_real_time():
    source = peer_engine("a", max_loras=1)
    slots = source.lora
    exporter = AdapterExporter(slots, source.registry).start(sweep_s=0.05)
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
    touch its SlotTable or its registry themselves."""
    source = peer_engine("b", max_loras=1)
    slots = source.lora
    loop = ThreadPoolExecutor(1, thread_name_prefix="engine-loop")
    seen = {}
    spied = [(slots.table, m) for m in ("acquire", "release", "infos", "info")] + \
        [(source.registry, m) for m in ("slot_of", "routes")]
    for owner, method in spied:
        real = getattr(owner, method)

        def spy(*args, _real=real, _method=method, **kwargs):
            seen.setdefault(_method, set()).add(threading.current_thread().name.split("_")[0])
            return _real(*args, **kwargs)

        setattr(owner, method, spy)
    exporter = AdapterExporter(slots, source.registry,
                               call=lambda fn: loop.submit(fn).result(timeout=5))
    server = PeerHTTPServer(exporter).start()
    try:
        engine = new_slots()
        land_peer(engine, server.url, "b", 2, transport="http", timeout_s=10)
        assert_matches_disk(engine, 2, "b")
        with pytest.raises(errors.UnknownAdapterError):  # routes() names what it serves
            exporter.lease("nope")
        assert [a["id"] for a in exporter.list_adapters()["adapters"]] == ["b"]
    finally:
        server.close()
        loop.shutdown()
    assert seen == {m: {"engine-loop"} for _, m in spied}
    assert slots.table.ref_count(0) == 0


def test_client_outside_allow_list_refused():
    source = peer_engine("a", max_loras=1)
    exporter = AdapterExporter(source.lora, source.registry)
    server = PeerHTTPServer(exporter, client_allow=["10.0.0.0/8"]).start()
    engine = new_slots()
    before = snapshot(engine)
    try:
        with pytest.raises(PeerConnectionError, match="allow-list"):
            land_peer(engine, server.url, "a", timeout_s=5)
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
        slot, version = land_peer(engine, exporting_engine, name, name=f"{name}-copy",
                                  transport=transport, timeout_s=20)
        assert engine.table.holds(slot, version)
        assert_matches_disk(engine, slot, name)  # rank/scale tables rebuilt from the slot alone
    engine.table.check_integrity()


def _serve_engine(root: str) -> None:
    """The exporting engine: its pool filled from disk, its READY slots exported with
    PEFT configs rebuilt from the rank/scale tables (no adapter dir needed)."""
    from pathlib import Path

    from tests.helpers.engine import tiny_engine

    root_path = Path(root)
    engine = tiny_engine(root_path / "model")
    for slot, name in enumerate(("c", "b")):
        engine.swap_lora_slot_from_disk(root_path / "adapters" / name, name, slot)
    transports = ("http", "nixl") if nixl_available() else ("http",)
    exporter = AdapterExporter(engine.lora, engine.registry, transports=transports).start()
    server = PeerHTTPServer(exporter)
    print(f"metrale peer: serving engine slots on {server.url}", flush=True)
    server.serve_forever(0.1)


if __name__ == "__main__":
    _serve_engine(sys.argv[1])
