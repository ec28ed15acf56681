"""A peer cannot make the engine write a wrong byte: malicious or broken
manifests and streams from a fake peer are refused with the pool bytes and
every slot identity untouched, and peers off the allow-list are never contacted."""

from __future__ import annotations

import base64
import copy
import socket
import time

import pytest
import torch

from metrale import errors
from metrale.peer import promote_from_peer, swap_from_peer
from metrale.peer.errors import (
    PeerManifestError,
    PeerNotAllowedError,
    PeerTimeoutError,
    PeerTransferError,
)
from metrale.peer.nixl_shim import nixl_available
from tests.helpers.peers import LEASE, FakePeer, adapter_dir, new_slots
from tests.helpers.pool import snapshot


@pytest.fixture
def engine():
    """Slots 0 and 1 hold "b" and "c"; slot 2 never filled."""
    slots = new_slots()
    slots.swap_lora_slot_from_disk(adapter_dir("b"), "b", 0)
    slots.swap_lora_slot_from_disk(adapter_dir("c"), "c", 1)
    return slots


def _tensors(fn):
    return lambda m: fn(m["tensors"])


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _extra(ts):
    ts.append({"layer": 0, "module": "up_proj", "kind": "A", "shape": [4, 64], "nbytes": 1024})


def _over_rank(ts):
    ts[0].update(shape=[16, 64], nbytes=16 * 64 * 4)


def _dup(ts):
    ts[1] = dict(ts[0])


def _nixl_len(m):
    m["transports"]["nixl"]["descs"][0][1] += 4


def _nixl_meta(m):
    m["transports"]["nixl"]["agent_metadata"] = "%%% not base64 %%%"


# name -> (edit of the manifest, expected error, transport)
MANIFESTS = {
    "wrong-nbytes": (_tensors(lambda ts: ts[0].update(nbytes=ts[0]["nbytes"] + 4)), PeerManifestError),
    "data-bytes-lie": (lambda m: m.update(data_bytes=m["data_bytes"] * 2), PeerManifestError),
    "extra-tensor": (_tensors(_extra), errors.AdapterMismatchError),
    "missing-tensor": (_tensors(lambda ts: ts.pop(1)), errors.AdapterFileError),
    "duplicate-tensor": (_tensors(_dup), PeerManifestError),
    "unknown-module": (_tensors(lambda ts: ts[0].update(module="c_attn")), errors.AdapterMismatchError),
    "huge-count": (_tensors(lambda ts: ts.extend([ts[0]] * 5000)), PeerManifestError),
    "layer-out-of-range": (_tensors(lambda ts: ts[0].update(layer=3)), PeerManifestError),
    "layer-bool": (_tensors(lambda ts: ts[0].update(layer=True)), PeerManifestError),
    "rank-over-max": (_tensors(_over_rank), errors.AdapterMismatchError),
    "wrong-dim": (_tensors(lambda ts: ts[0].update(shape=[4, 32], nbytes=512)),
                  errors.AdapterMismatchError),
    "negative-shape": (_tensors(lambda ts: ts[0].update(shape=[-4, -64])), PeerManifestError),
    "int-dtype": (_set("dtype", "I32"), errors.AdapterMismatchError),
    "unknown-dtype": (_set("dtype", "Q4_K"), errors.AdapterMismatchError),
    "dtype-vs-sizes": (_set("dtype", "F16"), PeerManifestError),
    "bad-version": (_set("version", 99), PeerManifestError),
    "another-adapter": (_set("adapter_id", "b"), PeerManifestError),
    # DoRA is served, but a DoRA config needs every module's magnitude tensor
    "peft-dora-no-magnitudes": (lambda m: m["peft"].update(use_dora=True), errors.AdapterFileError),
    "peft-rank-disagrees": (lambda m: m["peft"].update(  # the exporter lists every path's rank
        rank_pattern={k: 2 for k in m["peft"]["rank_pattern"]}), errors.AdapterMismatchError),
    "peft-missing": (_set("peft", None), PeerManifestError),
    "data-url-elsewhere": (lambda m: m["transports"]["http"].update(
        data_path="http://10.9.9.9/peer/v1/leases/fakelease0001/data"), PeerManifestError),
    "no-transport": (_set("transports", {}), errors.PeerUnavailableError),
}
if nixl_available():
    MANIFESTS["nixl-desc-length"] = (_nixl_len, PeerManifestError, "nixl")
    MANIFESTS["nixl-metadata"] = (_nixl_meta, PeerManifestError, "nixl")
    MANIFESTS["nixl-dtype"] = (lambda m: _retype(m, "F16"), errors.AdapterMismatchError, "nixl")


def _retype(m, dtype):
    """A consistent F16 manifest: fine for HTTP (converts), refused by NIXL."""
    m["dtype"] = dtype
    for t, d in zip(m["tensors"], m["transports"]["nixl"]["descs"]):
        t["nbytes"] //= 2
        d[1] //= 2
    m["data_bytes"] //= 2


def _run(op, slots, peer, transport="http", timeout_s=5.0):
    if op == "swap":
        swap_from_peer(slots, peer.url, "a", "b", 0, transport=transport, timeout_s=timeout_s)
    else:
        promote_from_peer(slots, peer.url, "a", "z", transport=transport, timeout_s=timeout_s)


@pytest.mark.parametrize("case", sorted(MANIFESTS))
@pytest.mark.parametrize("op", ["swap", "promote"])
def test_malicious_manifest_refused_untouched(case, op, genuine, engine):
    edit, error, *transport = MANIFESTS[case]
    reply = copy.deepcopy(genuine[0])
    m = reply["manifest"]
    edit(m)
    if not transport:  # an HTTP case: keep the rest consistent so the edit itself is what fails
        m["transports"].pop("nixl", None)
        if case != "data-bytes-lie":
            m["data_bytes"] = sum(t["nbytes"] for t in m["tensors"] if "nbytes" in t)
    peer = FakePeer(reply, genuine[1])
    before = snapshot(engine)
    try:
        with pytest.raises(error) as info:
            _run(op, engine, peer, *transport)
        assert str(info.value)
        assert snapshot(engine) == before
        assert ("GET", f"/peer/v1/leases/{LEASE}/data") not in peer.requests  # no data was read
        assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests  # the lease was released
    finally:
        peer.close()
    engine.table.check_integrity()


@pytest.mark.parametrize("reply,error", [
    (b"<html>not json</html>", PeerManifestError),
    (b"[1, 2, 3]", PeerManifestError),
    (b"{" + b" " * (9 << 20) + b"}", PeerManifestError),  # oversize: refused at the cap
    ({"lease": {"id": "x"}, "manifest": {}}, PeerManifestError),
    ({"lease": {"id": LEASE, "expires_in_s": 0}, "manifest": {}}, PeerManifestError),
])
def test_malformed_replies_refused_untouched(reply, error, engine):
    peer = FakePeer(reply)
    before = snapshot(engine)
    try:
        with pytest.raises(error):
            _run("swap", engine, peer)
    finally:
        peer.close()
    assert snapshot(engine) == before


def test_nan_stream_refused_untouched(genuine, engine):
    data = bytearray(genuine[1])
    data[0:4] = bytes(torch.tensor([float("nan")]).view(torch.uint8).tolist())
    peer = FakePeer(genuine[0], bytes(data))
    before = snapshot(engine)
    try:
        with pytest.raises(errors.NonFiniteWeightsError):
            _run("promote", engine, peer)
    finally:
        peer.close()
    assert snapshot(engine) == before


@pytest.mark.parametrize("mode,error", [
    ("half-close", PeerTransferError), ("half-stall", PeerTimeoutError),
    ("long", PeerTransferError), ("long-unannounced", PeerTransferError),
])
@pytest.mark.parametrize("op", ["swap", "promote"])
def test_broken_stream_refused_within_timeout(mode, error, op, genuine, engine):
    """HTTP bytes are staged before the slot is touched: a peer that dies, stalls or
    overruns mid-stream costs at most the timeout and leaves every slot as it was."""
    peer = FakePeer(genuine[0], genuine[1], mode)
    before = snapshot(engine)
    start = time.monotonic()
    try:
        with pytest.raises(error):
            _run(op, engine, peer, timeout_s=1.5)
    finally:
        peer.close()
    assert time.monotonic() - start < 4.5
    assert snapshot(engine) == before


def test_the_fake_peer_serves_a_good_adapter(genuine, engine):
    """The control case: the genuine reply lands and matches the disk adapter."""
    from tests.helpers.peers import assert_matches_disk

    peer = FakePeer(genuine[0], genuine[1])
    try:
        slot, _ = promote_from_peer(engine, peer.url, "a", "a", transport="http", timeout_s=5)
    finally:
        peer.close()
    assert slot == 2
    assert_matches_disk(engine, 2, "a")


@pytest.mark.parametrize("addr,allow", [
    ("10.1.2.3:7460", None), ("http://192.168.0.9:80", None), ("[2001:db8::1]:7460", None),
    ("127.0.0.1:7460", ["10.0.0.0/8"]), ("localhost:7460", ["10.0.0.0/8"]),
    ("https://127.0.0.1:7460", None), ("127.0.0.1:7460/evil/path", None),
    ("user:pw@127.0.0.1:7460", None), ("", None),
])
def test_peer_outside_allow_list_is_never_contacted(addr, allow, engine, monkeypatch):
    def no_connection(*args, **kwargs):
        raise AssertionError("a refused peer must not be contacted")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    before = snapshot(engine)
    with pytest.raises(PeerNotAllowedError):
        swap_from_peer(engine, addr, "a", "b", 0, peer_allow=allow, timeout_s=2)
    with pytest.raises(PeerNotAllowedError):
        promote_from_peer(engine, addr, "a", "z", peer_allow=allow, timeout_s=2)
    assert snapshot(engine) == before


def test_allow_list_admits_by_name_and_network(genuine, engine):
    peer = FakePeer(genuine[0], genuine[1])
    try:
        port = peer.url.rsplit(":", 1)[1]
        swap_from_peer(engine, f"localhost:{port}", "a", "a", 2, peer_allow=["localhost"])
        swap_from_peer(engine, f"http://127.0.0.1:{port}", "a", "a", 2, peer_allow=["127.0.0.0/30"])
    finally:
        peer.close()


def test_metadata_is_never_unpickled(genuine):
    """Descriptors travel as JSON triples; NIXL's serialized descs are pickle."""
    reply = genuine[0]
    nixl = reply["manifest"]["transports"].get("nixl")
    if nixl is None:
        pytest.skip("NIXL not installed")
    assert all(isinstance(d, list) and len(d) == 3 for d in nixl["descs"])
    base64.b64decode(nixl["agent_metadata"], validate=True)
