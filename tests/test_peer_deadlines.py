"""A peer cannot stretch an operation past its timeout: a raw-socket peer that
trickles, floods, stalls or lies about lengths costs at most timeout_s (plus a
small slack) and ends in a typed refusal, with every slot untouched.

The elapsed-time asserts are bound checks on our deadline, not waits: each
failing case should end as soon as the deadline passes (or at once).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from metrale import errors
from metrale.peer.client import RELEASE_TIMEOUT_S, wait_for_releases
from metrale.peer.errors import PeerManifestError, PeerTimeoutError
from metrale.peer.wire import encode_doc
from tests.helpers.peers import LEASE, assert_matches_disk, new_slots
from tests.helpers.pool import land_peer, snapshot

TIMEOUT_S = 1.0
SLACK_S = 1.0
PIECE_S = 0.2
HEAD_OK = b"HTTP/1.1 200 OK\r\n"


class RawPeer:
    """A peer on 127.0.0.1 built on bare sockets, so it can misbehave in ways an
    HTTP server library would not: every request is read, then answer(conn,
    method, path) writes whatever it likes. close() stops every trickle."""

    def __init__(self, answer) -> None:
        self.answer, self.stop = answer, threading.Event()
        self.requests: list[tuple[str, str]] = []
        self.connections = 0  # accepted
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def close(self) -> None:
        self.stop.set()
        for t in list(self.threads):
            t.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            while not self.stop.is_set():
                request = self._read_request(conn)
                if request is None:
                    return
                self.requests.append(request)
                try:
                    if not self.answer(self, conn, *request):
                        return
                except OSError:
                    return

    def _read_request(self, conn: socket.socket) -> tuple[str, str] | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            if self.stop.is_set():
                return None
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split()[:2]
        length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                       if k.lower() == "content-length"), 0)
        while len(body) < length and not self.stop.is_set():
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return None
            body += chunk
        return method, path

    def trickle(self, conn: socket.socket, piece: bytes) -> bool:
        """Send `piece` every PIECE_S until the test ends or the client hangs up."""
        while not self.stop.wait(PIECE_S):
            conn.sendall(piece)
        return False

    def flood(self, conn: socket.socket, piece: bytes) -> bool:
        block = piece * max(1, 65536 // len(piece))
        while not self.stop.is_set():
            conn.sendall(block)
        return False


def _json_reply(doc) -> bytes:
    raw = json.dumps(doc).encode()
    return HEAD_OK + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw


def _lease_reply(doc) -> bytes:
    raw = encode_doc(doc)
    return HEAD_OK + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw


def _good(reply: dict, data: bytes):
    """An honest peer's answers, for the requests a scenario leaves alone."""
    def answer(peer: RawPeer, conn, method: str, path: str) -> bool:
        if method == "POST":
            conn.sendall(_lease_reply(reply))
        elif method == "GET":
            conn.sendall(HEAD_OK + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        else:
            conn.sendall(_json_reply({"released": True}))
        return True
    return answer


def _on(method: str, bad, fallback):
    """`bad` answers requests of `method`; the rest get `fallback`."""
    def answer(peer: RawPeer, conn, m: str, path: str) -> bool:
        return (bad if m == method else fallback)(peer, conn, m, path)
    return answer


# --- what a misbehaving peer sends ------------------------------------------------------

def _silent(peer, conn, method, path):
    peer.stop.wait(60)  # accepts, reads the request, never answers
    return False


def _trickle_headers(peer, conn, method, path):
    conn.sendall(HEAD_OK)
    return peer.trickle(conn, b"X-P: 012345678\r\n")  # 16 bytes, a fresh header each time


def _trickle_one_header_line(peer, conn, method, path):
    conn.sendall(HEAD_OK + b"X-Pad: ")
    return peer.trickle(conn, b"a" * 16)


def _trickle_body(length: int = 1_000_000):
    def answer(peer, conn, method, path):
        conn.sendall(HEAD_OK + f"Content-Length: {length}\r\n\r\n".encode())
        return peer.trickle(conn, b" " * 16)
    return answer


def _trickle_chunked(peer, conn, method, path):
    conn.sendall(HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n")
    return peer.trickle(conn, b"b\r\n           \r\n")  # 16 bytes: one 11-byte chunk


def _flood_headers(peer, conn, method, path):
    conn.sendall(HEAD_OK)
    return peer.flood(conn, b"X-P: 012345678\r\n")


def _flood_chunked(peer, conn, method, path):
    conn.sendall(HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n")
    return peer.flood(conn, b"b\r\n           \r\n")


def _flood_trailers(peer, conn, method, path):
    conn.sendall(HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
    return peer.flood(conn, b"X-P: 012345678\r\n")


def _huge_length(digits: int):
    def answer(peer, conn, method, path):
        conn.sendall(HEAD_OK + b"Content-Length: " + b"9" * digits + b"\r\n\r\n{}")
        return peer.trickle(conn, b" " * 16)
    return answer


def _close_mid_body(length: int = 1000):
    def answer(peer, conn, method, path):
        # Valid JSON for the lease, but far short of the announced length.
        conn.sendall(HEAD_OK + f"Content-Length: {length}\r\n\r\n{{}}".encode())
        return False
    return answer


def _no_status(peer, conn, method, path):
    return peer.trickle(conn, b"HTTP/1.1 200 OK ")  # a status line that never ends


# name -> (the bad answer to the lease POST, the refusal expected)
LEASE_FAULTS = {
    "silent": (_silent, PeerTimeoutError),
    "trickle-headers": (_trickle_headers, PeerTimeoutError),
    "trickle-one-header-line": (_trickle_one_header_line, errors.PeerUnavailableError),
    "trickle-status-line": (_no_status, errors.PeerUnavailableError),
    "trickle-body": (_trickle_body(), PeerTimeoutError),
    "trickle-chunked": (_trickle_chunked, PeerTimeoutError),
    "flood-headers": (_flood_headers, errors.PeerUnavailableError),
    "flood-chunked": (_flood_chunked, (PeerManifestError, errors.PeerUnavailableError)),
    "flood-trailers": (_flood_trailers, errors.PeerUnavailableError),
    "huge-content-length": (_huge_length(30), PeerManifestError),
    "content-length-of-5000-digits": (_huge_length(5000), PeerManifestError),
    "close-mid-body": (_close_mid_body(), errors.PeerUnavailableError),
}

# name -> the bad answer to the data GET (after an honest lease), given the stream's length;
# each announces the right length, so only the misbehaviour itself can fail it
DATA_FAULTS = {
    "silent": lambda n: _silent,
    "trickle-headers": lambda n: _trickle_headers,
    "trickle-body": _trickle_body,
    "trickle-chunked": lambda n: _trickle_chunked,
    "flood-headers": lambda n: _flood_headers,
    "flood-chunked": lambda n: _flood_chunked,
    "huge-content-length": lambda n: _huge_length(30),
    "close-mid-body": _close_mid_body,
}


@pytest.fixture
def engine():
    return new_slots()


def _bounded_refusal(engine, peer: RawPeer, error) -> float:
    before = snapshot(engine)
    start = time.monotonic()
    try:
        with pytest.raises(error) as info:
            land_peer(engine, peer.url, "a", 0, transport="http", timeout_s=TIMEOUT_S)
        elapsed = time.monotonic() - start
    finally:
        wait_for_releases()  # releases go out on a background thread, to this peer
        peer.close()
    assert isinstance(info.value, errors.MetraleError) and str(info.value)
    assert snapshot(engine) == before
    engine.table.check_integrity()
    return elapsed


@pytest.mark.parametrize("case", sorted(LEASE_FAULTS))
def test_lease_call_is_bounded_by_the_deadline(case, engine):
    bad, error = LEASE_FAULTS[case]
    elapsed = _bounded_refusal(engine, RawPeer(bad), error)
    assert elapsed < TIMEOUT_S + SLACK_S, f"{case}: {elapsed:.2f}s for a {TIMEOUT_S}s timeout"


@pytest.mark.parametrize("case", sorted(DATA_FAULTS))
def test_data_stream_is_bounded_by_the_deadline(case, genuine, engine):  # noqa: F811
    reply, data, _ = genuine
    peer = RawPeer(_on("GET", DATA_FAULTS[case](len(data)), _good(reply, data)))
    elapsed = _bounded_refusal(engine, peer, errors.PeerUnavailableError)
    # The lease is released afterwards, with its own short deadline (answered at once here).
    assert elapsed < TIMEOUT_S + SLACK_S, f"{case}: {elapsed:.2f}s for a {TIMEOUT_S}s timeout"
    assert ("DELETE", f"/peer/v1/leases/{LEASE}") in peer.requests


@pytest.mark.parametrize("case", ["silent", "trickle-headers", "trickle-body"])
def test_a_stalling_release_costs_its_own_short_deadline(case, genuine, engine):  # noqa: F811
    """The adapter lands; releasing the lease is best effort and cannot hang the engine."""
    reply, data, _ = genuine
    bad = {"silent": _silent, "trickle-headers": _trickle_headers, "trickle-body": _trickle_body()}
    peer = RawPeer(_on("DELETE", bad[case], _good(reply, data)))
    start = time.monotonic()
    try:
        land_peer(engine, peer.url, "a", 0, transport="http", timeout_s=30)
        elapsed = time.monotonic() - start
    finally:
        peer.close()
    assert elapsed < RELEASE_TIMEOUT_S + SLACK_S
    assert_matches_disk(engine, 0, "a")


def _land_three_times(engine, peer: RawPeer) -> RawPeer:
    """Land adapter "a" into slot 1 three times from `peer` (each lease released before
    the next), then close it."""
    try:
        for _ in range(3):
            land_peer(engine, peer.url, "a", 1, transport="http", timeout_s=TIMEOUT_S * 5)
            wait_for_releases()
    finally:
        peer.close()
    return peer


def test_a_kept_connection_the_peer_closed_is_replaced(genuine, engine):  # noqa: F811
    """A peer that hangs up after every answer (as a store does once a kept connection
    sat idle past its socket timeout): each control call finds its kept connection
    closed, goes again over a new one, and the landings go on."""
    reply, data, _ = genuine
    good = _good(reply, data)

    def answer_then_hang_up(peer, conn, method, path):
        good(peer, conn, method, path)
        return False  # the raw peer closes this connection

    peer = _land_three_times(engine, RawPeer(answer_then_hang_up))
    assert peer.requests.count(("POST", "/peer/v1/adapters/a/lease")) == 3
    assert peer.requests.count(("DELETE", f"/peer/v1/leases/{LEASE}")) == 3
    assert_matches_disk(engine, 1, "a")


def test_the_raw_peer_serves_a_good_adapter(genuine, engine):  # noqa: F811
    """The control case: the same raw peer, honest, lands the adapter, three times; the
    control calls (lease, release) after the first go over the connection kept open."""
    reply, data, _ = genuine
    peer = _land_three_times(engine, RawPeer(_good(reply, data)))
    assert peer.requests.count(("POST", "/peer/v1/adapters/a/lease")) == 3
    assert peer.connections == 1 + 3  # one kept for control, one per data stream
    assert_matches_disk(engine, 1, "a")
