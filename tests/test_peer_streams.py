"""One HTTP read over several streams (metrale.peer.streams), against a fake peer: a
peer that serves ranges is read in DATA_STREAMS parts and lands what a disk landing
gives; one broken part fails the read with the single stream's typed error, ends the
other parts at once and leaves the slot untouched; a peer older than ranges is read
on one stream; one that claims ranges but ignores them is refused."""

from __future__ import annotations

import copy
import threading
import time

import pytest

from metrale.peer import client
from metrale.peer.allow import resolve_peer
from metrale.peer.client import wait_for_releases
from metrale.peer.deadline import Deadline
from metrale.peer.errors import PeerTimeoutError, PeerTransferError
from metrale.peer.streams import split
from tests.helpers.peers import LEASE, FakePeer, adapter_dir, assert_matches_disk, new_slots
from tests.helpers.pool import land_disk, land_peer, snapshot

STREAMS = 3  # not a divisor of the tiny adapters' sizes: the last part is shorter
DATA = f"/peer/v1/leases/{LEASE}/data"


@pytest.fixture
def engine():
    """Slot 0 holds "b"; slots 1 and 2 never filled."""
    slots = new_slots()
    land_disk(slots, adapter_dir("b"), 0)
    return slots


@pytest.fixture
def several_streams(monkeypatch):
    """Split even a tiny adapter's bytes into STREAMS parts."""
    monkeypatch.setattr(client, "DATA_STREAMS", STREAMS)
    monkeypatch.setattr(client, "SPLIT_BYTES", 1)


def _reply(genuine, ranges: bool):
    reply = copy.deepcopy(genuine[0])
    http = reply["manifest"]["transports"]["http"]
    if ranges:
        http["ranges"] = True
    else:
        http.pop("ranges", None)  # what a peer older than ranges sends
    return reply


def _data_gets(peer) -> list[str]:
    return sorted(path for method, path in peer.requests if path.startswith(DATA))


def _offsets(n: int) -> list[int]:
    return [a for a, _ in split(n, STREAMS, 1)]


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("metrale-peer-stream")]


def test_a_ranged_peer_is_read_in_parts(genuine, engine, several_streams):
    peer = FakePeer(_reply(genuine, True), genuine[1], ranges=True)
    try:
        slot, version = land_peer(engine, peer.url, "a", 2, transport="http", timeout_s=10)
    finally:
        peer.close()
    assert engine.table.holds(slot, version)
    assert_matches_disk(engine, 2, "a")
    spans = split(len(genuine[1]), STREAMS, 1)
    assert len(spans) == STREAMS
    assert _data_gets(peer) == sorted(f"{DATA}?offset={a}&length={b - a}" for a, b in spans)
    assert not _stream_threads()


def test_a_peer_older_than_ranges_is_read_on_one_stream(genuine, engine, several_streams):
    peer = FakePeer(_reply(genuine, False), genuine[1])  # ignores any query, as old peers do
    try:
        land_peer(engine, peer.url, "a", 2, transport="http", timeout_s=10)
    finally:
        peer.close()
    assert_matches_disk(engine, 2, "a")
    assert _data_gets(peer) == [DATA]


def test_a_peer_that_claims_ranges_but_ignores_them_is_refused(genuine, engine, several_streams):
    peer = FakePeer(_reply(genuine, True), genuine[1])  # sends the whole stream to each part
    before = snapshot(engine)
    try:
        with pytest.raises(PeerTransferError, match="not the .* asked for"):
            land_peer(engine, peer.url, "a", 0, name="b", transport="http", timeout_s=10)
    finally:
        wait_for_releases()  # releases go out on a background thread, to this peer
        peer.close()
    assert snapshot(engine) == before
    assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests


@pytest.mark.parametrize("mode,error", [
    ("half-close", PeerTransferError), ("half-stall", PeerTimeoutError),
    ("long", PeerTransferError), ("long-unannounced", PeerTransferError),
])
@pytest.mark.parametrize("part", [0, STREAMS - 1])
def test_one_broken_part_fails_the_read_untouched(genuine, engine, several_streams, mode, error,
                                                   part):
    """Every part but one is served whole; the broken one gives the single stream's error."""
    peer = FakePeer(_reply(genuine, True), genuine[1], {_offsets(len(genuine[1]))[part]: mode},
                    ranges=True)
    before = snapshot(engine)
    start = time.monotonic()
    try:
        with pytest.raises(error):
            land_peer(engine, peer.url, "a", 0, name="b", transport="http", timeout_s=1.5)
    finally:
        wait_for_releases()  # releases go out on a background thread, to this peer
        peer.close()
    assert time.monotonic() - start < 4.5
    assert snapshot(engine) == before and not _stream_threads()
    assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests


def test_the_first_error_ends_the_stalled_parts_at_once(genuine, engine, several_streams):
    """A part that stalls would hold the read until its deadline; another part's error
    shuts its socket down, so the read fails with that error long before."""
    offsets = _offsets(len(genuine[1]))
    modes = {a: "half-stall" for a in offsets[:-1]} | {offsets[-1]: "half-close"}
    peer = FakePeer(_reply(genuine, True), genuine[1], modes, ranges=True)
    before = snapshot(engine)
    timeout_s = 30.0
    start = time.monotonic()
    try:
        with pytest.raises(PeerTransferError, match="ended after"):
            land_peer(engine, peer.url, "a", 0, name="b", transport="http", timeout_s=timeout_s)
        elapsed = time.monotonic() - start
    finally:
        peer.close()
    assert elapsed < timeout_s / 3
    assert snapshot(engine) == before and not _stream_threads()


def test_each_piece_is_told_once_on_the_calling_thread_when_it_is_in(genuine, several_streams):
    """Each on_range(a, b) comes on the calling thread with out[a:b] already in place;
    the pieces told cover the read exactly once."""
    data = genuine[1]
    peer = FakePeer(_reply(genuine, True), data, ranges=True)
    out, seen = bytearray(len(data)), []
    caller = threading.current_thread()

    def on_range(a: int, b: int) -> None:
        assert threading.current_thread() is caller
        assert a < b and out[a:b] == data[a:b]
        seen.append((a, b))

    reader = client.PeerClient(resolve_peer(peer.url, None), Deadline(10))
    try:
        reader.read_exact(DATA, memoryview(out), on_range, ranged=True)
    finally:
        peer.close()
    assert bytes(out) == data
    covered = sorted(seen)
    assert covered[0][0] == 0 and covered[-1][1] == len(data)
    assert all(b == c for (_, b), (c, _) in zip(covered, covered[1:]))  # no gap, no overlap
