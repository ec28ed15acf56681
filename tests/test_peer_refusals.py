"""A peer cannot make the engine write a wrong byte: malicious or broken
manifests and streams from a fake peer are refused with the pool bytes and
every slot identity untouched, and peers off the allow-list are never contacted."""

from __future__ import annotations

import base64
import copy
import json
import socket
import time

import pytest
import torch

from metrale import errors
from metrale.peer import wire
from metrale.peer.allow import resolve_peer
from metrale.peer.client import DATA_SPAN, PeerClient, wait_for_releases
from metrale.peer.deadline import Deadline
from metrale.peer.errors import (
    ManifestVersionError,
    PeerManifestError,
    PeerNotAllowedError,
    PeerTimeoutError,
    PeerTransferError,
)
from metrale.peer.nixl_shim import nixl_available
from metrale.peer.plans import plan_cache_for
from metrale.peer.wire import encode_doc
from tests.helpers.peers import LEASE, FakePeer, adapter_dir, new_slots
from tests.helpers.pool import land_disk, land_peer, snapshot


@pytest.fixture
def engine():
    """Slots 0 and 1 hold "b" and "c"; slot 2 never filled."""
    slots = new_slots()
    land_disk(slots, adapter_dir("b"), 0)
    land_disk(slots, adapter_dir("c"), 1)
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
    m["transports"]["nixl"]["descs"][0][0] = 0  # the table holds addresses; sizes are nbytes


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
    "rank-over-max": (_tensors(_over_rank), errors.AdapterMismatchError),
    "wrong-dim": (_tensors(lambda ts: ts[0].update(shape=[4, 32], nbytes=512)),
                  errors.AdapterMismatchError),
    # -4 wraps to 2**32 - 4 in the table's u32: a rank no pool has
    "negative-shape": (_tensors(lambda ts: ts[0].update(shape=[-4, -64])), errors.AdapterMismatchError),
    "zero-shape": (_tensors(lambda ts: ts[0].update(shape=[0, 64], nbytes=0)), PeerManifestError),
    "nbytes-overflow": (_tensors(lambda ts: ts[0].update(nbytes=2**64 - 1)), PeerManifestError),
    "unknown-kind": (_tensors(lambda ts: ts[0].update(kind="C")), PeerManifestError),
    "int-dtype": (_set("dtype", "I32"), errors.AdapterMismatchError),
    "unknown-dtype": (_set("dtype", "Q4_K"), errors.AdapterMismatchError),
    "dtype-vs-sizes": (_set("dtype", "F16"), PeerManifestError),
    "bad-version": (_set("version", 99), ManifestVersionError),
    "another-adapter": (_set("adapter_id", "b"), PeerManifestError),
    # DoRA is served, but a DoRA config needs every module's magnitude tensor
    "peft-dora-no-magnitudes": (lambda m: m["peft"].update(use_dora=True), errors.AdapterFileError),
    "peft-rank-disagrees": (lambda m: m["peft"].update(  # the exporter lists every path's rank
        rank_pattern={k: 2 for k in m["peft"]["rank_pattern"]}), errors.AdapterMismatchError),
    "peft-missing": (_set("peft", None), PeerManifestError),
    "data-url-elsewhere": (lambda m: m["transports"]["http"].update(
        data_path="http://10.9.9.9/peer/v1/leases/fakelease0001/data"), PeerManifestError),
    "no-transport": (_set("transports", {}), errors.PeerUnavailableError),
    "http-ranges-not-bool": (lambda m: m["transports"]["http"].update(ranges="yes"),
                             PeerManifestError),
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
    """swap: into slot 0 (it holds b's bytes); promote: into the pool's victim."""
    if op == "swap":
        land_peer(slots, peer.url, "a", 0, name="b", transport=transport, timeout_s=timeout_s)
    else:
        land_peer(slots, peer.url, "a", name="z", transport=transport, timeout_s=timeout_s)


@pytest.mark.parametrize("case", sorted(MANIFESTS))
@pytest.mark.parametrize("op", ["swap", "promote"])
def test_malicious_manifest_refused_untouched(case, op, genuine, engine):
    edit, error, *transport = MANIFESTS[case]
    reply = copy.deepcopy(genuine[0])
    m = reply["manifest"]
    edit(m)
    if not transport:  # an HTTP case: keep the rest consistent so the edit itself is what fails
        m["transports"].pop("nixl", None)
        if case not in ("data-bytes-lie", "nbytes-overflow"):
            m["data_bytes"] = sum(t["nbytes"] for t in m["tensors"] if "nbytes" in t)
    peer = FakePeer(reply, genuine[1])
    before = snapshot(engine)
    try:
        with pytest.raises(error) as info:
            _run(op, engine, peer, *transport)
        assert str(info.value)
        assert snapshot(engine) == before
        assert ("GET", f"/peer/v1/leases/{LEASE}/data") not in peer.requests  # no data was read
        wait_for_releases()  # releases go out on a background thread
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
        wait_for_releases()  # releases go out on a background thread, to this peer
        peer.close()
    assert time.monotonic() - start < 4.5
    assert snapshot(engine) == before
    assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests  # the lease was released


@pytest.mark.parametrize("mode", ["full", "half-close"])
def test_large_streams_land_in_spans_and_truncation_is_caught(mode):
    """Bodies of several read spans arrive whole, each piece told in order on one
    stream; one cut off mid-span is a transfer error that says how far it got."""
    data = torch.randint(0, 256, (2 * DATA_SPAN + 12345,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    peer = FakePeer(None, data, mode)
    out, seen = bytearray(len(data)), []
    client = PeerClient(resolve_peer(peer.url, None), Deadline(10))
    try:
        if mode == "full":
            client.read_exact(f"/peer/v1/leases/{LEASE}/data", memoryview(out),
                              lambda a, b: seen.append(b))
        else:
            with pytest.raises(PeerTransferError, match=f"ended after {len(data) // 2} of"):
                client.read_exact(f"/peer/v1/leases/{LEASE}/data", memoryview(out),
                                  lambda a, b: seen.append(b))
    finally:
        peer.close()
    assert seen == sorted(set(seen)) and all(b - a <= DATA_SPAN for a, b in zip([0, *seen], seen))
    if mode == "full":
        assert bytes(out) == data and seen[-1] == len(data)
    else:
        assert seen[-1] == len(data) // 2 and out[:seen[-1]] == data[:seen[-1]]


def test_the_fake_peer_serves_a_good_adapter(genuine, engine):
    """The control case: the genuine reply lands and matches the disk adapter."""
    from tests.helpers.peers import assert_matches_disk

    peer = FakePeer(genuine[0], genuine[1])
    try:
        slot, version = land_peer(engine, peer.url, "a", transport="http", timeout_s=5)
    finally:
        peer.close()
    assert slot == 2 and engine.table.holds(2, version)
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
        land_peer(engine, addr, "a", 0, name="b", peer_allow=allow, timeout_s=2)
    with pytest.raises(PeerNotAllowedError):
        land_peer(engine, addr, "a", name="z", peer_allow=allow, timeout_s=2)
    assert snapshot(engine) == before


def test_allow_list_admits_by_name_and_network(genuine, engine):
    peer = FakePeer(genuine[0], genuine[1])
    try:
        port = peer.url.rsplit(":", 1)[1]
        land_peer(engine, f"localhost:{port}", "a", 2, peer_allow=["localhost"])
        land_peer(engine, f"http://127.0.0.1:{port}", "a", 2, peer_allow=["127.0.0.0/30"])
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


# --- lies only the binary reply can tell ---------------------------------------------------


def _body(reply) -> bytes:
    return encode_doc(reply)


def _prefix(raw: bytes, **fields) -> bytes:
    magic, version, flags, head, peft, n = wire.PREFIX.unpack_from(raw)
    values = {**dict(magic=magic, version=version, flags=flags, head=head, peft=peft, n=n), **fields}
    return wire.PREFIX.pack(*values.values()) + raw[wire.PREFIX.size:]


def _table(edit):
    """Re-encode the reply with one record edited (header and PEFT kept byte for byte)."""
    def apply(raw: bytes) -> bytes:
        w = wire.decode(raw, "test")
        table = w.table.copy()
        edit(table)
        return wire.encode(w.header, w.peft, table)
    return apply


def _with_nixl(addr: int):
    def apply(raw: bytes) -> bytes:
        w = wire.decode(raw, "test")
        header = json.loads(w.header)
        header["transports"]["nixl"] = {"agent_metadata": "bWQ=", "mem_type": "DRAM", "device": 0}
        table = w.table.copy()
        table["addr"] = 1 << 20
        table["addr"][0] = addr
        return wire.encode(header, w.peft, table)
    return apply


def _field(name, value, row=0):
    def edit(table):
        table[name][row] = value
    return edit


# name -> (edit of the encoded body, expected error, whether the lease could be read)
BODIES = {
    "truncated": (lambda raw: raw[:-7], PeerManifestError, False),
    "padded": (lambda raw: raw + bytes(32), PeerManifestError, False),
    "count-too-high": (lambda raw: _prefix(raw, n=wire.PREFIX.unpack_from(raw)[5] + 1),
                       PeerManifestError, False),
    "header-len-over-cap": (lambda raw: _prefix(raw, head=wire.MAX_HEADER_BYTES + 1),
                            PeerManifestError, False),
    "bad-magic": (lambda raw: b"NOTMTRL!" + raw[8:], PeerManifestError, False),
    "version-2-prefix": (lambda raw: _prefix(raw, version=2), ManifestVersionError, False),
    "version-4-prefix": (lambda raw: _prefix(raw, version=4), ManifestVersionError, False),
    "flags": (lambda raw: _prefix(raw, flags=1), PeerManifestError, False),
    "v2-json-reply": (lambda raw: json.dumps({"lease": {"id": LEASE, "expires_in_s": 30},
                                              "manifest": {"version": 2}}).encode(),
                      ManifestVersionError, False),
    "pad-not-zero": (_table(_field("pad", 1)), PeerManifestError, True),
    "module-index": (_table(_field("module", 200)), errors.AdapterMismatchError, True),
    "kind-index": (_table(_field("kind", 9)), PeerManifestError, True),
    "rows-max": (_table(_field("rows", 2**32 - 1)), errors.AdapterMismatchError, True),
    "cols-lie": (_table(_field("cols", 65)), errors.AdapterMismatchError, True),
    "nbytes-off-by-one": (_table(_field("nbytes", 4 * 64 * 4 + 1)), PeerManifestError, True),
    "layer-out-of-range": (_table(_field("layer", 65535)), PeerManifestError, True),
    "duplicate-record": (_table(lambda t: t.__setitem__(1, t[0])), PeerManifestError, True),
    "nixl-address-zero": (_with_nixl(0), PeerManifestError, True),
    "nixl-address-wraps": (_with_nixl(2**64 - 8), PeerManifestError, True),
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_lying_reply_bodies_refused_untouched(case, genuine, engine):
    """Each class of lie in the packed reply (sizes, counts, indices, versions, a body
    cut short or padded) is a typed refusal before any data moves; every slot keeps its
    bytes and identity, and the lease is released whenever its id could be read."""
    edit, error, lease_readable = BODIES[case]
    reply = copy.deepcopy(genuine[0])
    reply["manifest"]["transports"].pop("nixl", None)
    peer = FakePeer(edit(_body(reply)), genuine[1])
    before = snapshot(engine)
    try:
        with pytest.raises(error) as info:
            _run("promote", engine, peer)
        assert str(info.value) and len(str(info.value)) < 1000
        assert snapshot(engine) == before
        assert ("GET", f"/peer/v1/leases/{LEASE}/data") not in peer.requests
        if lease_readable:
            wait_for_releases()  # releases go out on a background thread
            assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests
    finally:
        peer.close()
    engine.table.check_integrity()


def test_a_lie_after_a_cached_plan_is_still_refused(genuine, engine):
    """The plan cache reuses a plan only for a table byte-equal to one already checked:
    a peer that answered honestly once and lies the next time is checked in full."""
    good = FakePeer(genuine[0], genuine[1])
    try:
        port = good.url
        land_peer(engine, good.url, "a", name="z", transport="http", timeout_s=5)
        land_peer(engine, good.url, "a", name="z2", transport="http", timeout_s=5)
        assert plan_cache_for(engine.pool).hits >= 1
        lie = copy.deepcopy(genuine[0])
        lie["manifest"]["tensors"][0]["nbytes"] += 4
        lie["manifest"]["data_bytes"] += 4
        good.lease_reply = lie  # the same peer, same adapter id
        before = snapshot(engine)
        with pytest.raises(PeerManifestError):
            land_peer(engine, port, "a", 2, name="z", transport="http", timeout_s=5)
        assert snapshot(engine) == before
    finally:
        good.close()


def test_an_overflowing_peer_adapter_is_refused_before_any_slot_over_http():
    """A peer whose bytes pass its own checks but overflow the LoRA in this pool's dtype
    (3e38 in a lora_A, finite in float32) is refused by the gain bound, found in the
    scratch pool: slot 0, which it was to replace, keeps adapter b, and every other byte
    and identity stays (tests.test_peer_gpu: the CUDA pool's recipe path)."""
    from metrale.adapters.weights_check import WeightsOverflowError
    from metrale.peer.http_server import PeerHTTPServer
    from tests.helpers.peers import disk_exporter

    exporter = disk_exporter("a")
    exporter.slots.pool.lora_a(1, "q_proj")[0, 0, 0] = 3e38
    server = PeerHTTPServer(exporter).start()
    try:
        slots = new_slots()
        land_disk(slots, adapter_dir("b"), 0)
        before = snapshot(slots)
        with pytest.raises(WeightsOverflowError, match="q_proj"):
            land_peer(slots, server.url.removeprefix("http://"), "a", 0, transport="http")
        assert snapshot(slots) == before
    finally:
        server.close()
        exporter.close()
