"""A peer's ids can be found without reading its directory: `metrale peer serve` prints
them, `metrale peer list --url` lists them, and every unknown-id error (the peer's HTTP
404 on a lease, the engine's refusal at registration) names the ids the peer does serve,
at most 20 of them and only ones that are valid names."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from metrale import LLM
from metrale.peer.errors import UnknownPeerAdapterError
from metrale.peer.ids import describe_ids
from tests.helpers.peers import REPO, peer_root, start_store, stop


@pytest.fixture(scope="module")
def store():
    proc, url = start_store()
    yield url
    stop(proc)


# --- the bounded list ---------------------------------------------------------------------


def test_a_long_list_shows_twenty_then_counts_the_rest():
    ids = [f"adapter{i:03d}" for i in range(27)]
    text = describe_ids(reversed(ids))
    assert text == ", ".join(ids[:20]) + " and 7 more"


def test_ids_that_are_not_valid_names_are_counted_never_shown():
    text = describe_ids(["ok", "\x1b[31mred", "../etc", "x" * 500, 7, None])
    assert text == "ok and 5 more"
    assert "\x1b" not in text and "etc" not in text and "xxx" not in text
    assert describe_ids([]) == "none"
    assert describe_ids(["../a"]) == "1 id(s) that are not valid names"


# --- a real `metrale peer serve` ------------------------------------------------------------


def _read_lines(proc: subprocess.Popen, until: str, timeout_s: float = 180.0) -> list[str]:
    """Lines of the process's output up to the first line holding `until`. Raw reads of
    the fd: a buffered readline would take several lines at once and leave select() with
    nothing to report."""
    end, data, fd = time.monotonic() + timeout_s, b"", proc.stdout.fileno()
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        data += chunk
        lines = data.decode(errors="replace").splitlines()
        if any(until in line for line in lines[:-1]) or (data.endswith(b"\n") and until in lines[-1]):
            return lines
    raise AssertionError(f"no {until!r} in:\n" + data.decode(errors="replace"))


def test_peer_serve_prints_each_id_with_its_source():
    root = peer_root()[0]
    cmd = [sys.executable, "-m", "metrale", "peer", "serve", "--adapters", str(root / "adapters"),
           "--model", str(root / "model"), "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = _read_lines(proc, "/c")  # the ids come sorted: c is the last
    finally:
        stop(proc)
    serving = next(line for line in lines if "metrale peer: serving" in line)
    hostport = serving.rsplit(" on ", 1)[1].split()[0].removeprefix("http://")
    ids = [line.split() for line in lines[lines.index(serving) + 1:] if "peer://" in line]
    assert ids == [[n, f"peer://{hostport}/{n}"] for n in "abc"]


def test_peer_list_prints_the_ids(store):
    out = subprocess.run([sys.executable, "-m", "metrale", "peer", "list", "--url", store],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hostport = store.removeprefix("http://")
    assert out.stdout.splitlines() == [f"{n}\tpeer://{hostport}/{n}" for n in "abc"]


def test_peer_list_of_nothing_listening_fails_with_a_message():
    out = subprocess.run([sys.executable, "-m", "metrale", "peer", "list", "--url",
                          "http://127.0.0.1:9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot list adapters" in out.stderr


def test_lease_of_an_unknown_id_answers_404_listing_the_ids(store):
    req = urllib.request.Request(f"{store}/peer/v1/adapters/nope/lease", method="POST",
                                 data=json.dumps({"manifest_version": 3}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    assert caught.value.code == 404
    message = json.loads(caught.value.read())["error"]["message"]
    assert "'nope'" in message and message.endswith("serves: a, b, c")


def test_a_lease_without_the_manifest_version_is_a_version_error(store):
    """What an engine of the JSON protocol (version 2) sends: refused with a message
    naming both versions, before any slot is pinned."""
    req = urllib.request.Request(f"{store}/peer/v1/adapters/a/lease", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    error = json.loads(caught.value.read())["error"]
    assert error["code"] == "ManifestVersionError"
    assert "version 3" in error["message"] and "version 2 or older" in error["message"]


def test_registering_an_id_the_peer_does_not_hold_is_refused_listing_the_ids(store):
    llm = LLM(peer_root()[0] / "model", max_loras=2, max_lora_rank=8, block_size=4,
              max_model_len=64, num_kv_blocks=64, peer_transport="http")
    hostport = store.removeprefix("http://")
    with pytest.raises(UnknownPeerAdapterError, match=r"holds no adapter 'nope'; it serves: a, b, c"):
        llm.register_adapter("x", f"peer://{hostport}/nope")
    assert llm.engine.registry.names() == []
    llm.register_adapter("x", f"peer://{hostport}/b")  # a held id still registers
    assert llm.engine.registry.names() == ["x"]
