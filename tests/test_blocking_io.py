"""Whole-piece socket calls of the HTTP data plane (metrale.peer.blocking_io), and the
peer server that sends through them: every byte arrives, a piece ends early only at EOF,
and each call stays bounded by its timeout when the other side stalls."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from metrale.peer.blocking_io import recv_piece, send_all

STALL_S = 0.2  # how long a stalled other side is waited for


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_piece_sent_in_parts_arrives_whole(pair):
    a, b = pair
    data = os.urandom(3 << 20)
    a.sendall(data[:1000])  # in before the call starts
    out = bytearray(len(data))
    got = []
    reader = threading.Thread(target=lambda: got.append(recv_piece(b, memoryview(out), 10.0)))
    reader.start()
    for i in range(1000, len(data), 700_001):
        a.sendall(data[i:i + 700_001])
    reader.join()
    assert got == [len(data)] and bytes(out) == data


def test_a_piece_ends_early_only_at_the_end_of_the_stream(pair):
    a, b = pair
    a.sendall(b"x" * 5000)
    a.shutdown(socket.SHUT_WR)
    out = memoryview(bytearray(8000))
    assert recv_piece(b, out, 10.0) == 5000
    assert recv_piece(b, out, 10.0) == 0  # EOF


def test_nothing_in_before_the_time_runs_out_is_a_timeout(pair):
    _, b = pair
    with pytest.raises(TimeoutError):
        recv_piece(b, memoryview(bytearray(10)), STALL_S)


def test_send_all_to_a_reader_that_never_reads_times_out(pair):
    a, _ = pair
    with pytest.raises(TimeoutError):
        send_all(a, memoryview(bytes(64 << 20)), STALL_S)  # far above any socket buffer


def test_send_all_delivers_everything_to_a_slow_reader(pair):
    a, b = pair
    data = os.urandom(8 << 20)
    received = bytearray()

    def read() -> None:
        while chunk := b.recv(4096):  # small reads: many partial sends on the other side
            received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    send_all(a, memoryview(data), 30.0)
    a.shutdown(socket.SHUT_WR)
    reader.join()
    assert bytes(received) == data


def test_the_server_times_its_reads_again_after_a_data_reply(monkeypatch):
    """A kept connection idle after a data reply is closed by the server within the
    handler's timeout (the body went out on a blocking socket)."""
    from metrale.peer import http_server
    from metrale.peer.exporter import AdapterExporter
    from tests.helpers.peers import peer_engine

    monkeypatch.setattr(http_server._Handler, "timeout", STALL_S)
    source = peer_engine("b", max_loras=1)
    exporter = AdapterExporter(source.lora, source.registry)
    server = http_server.PeerHTTPServer(exporter).start()
    lease = exporter.lease("b", ttl_s=30).lease_id
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"GET /peer/v1/leases/{lease}/data HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            reply = b""
            while chunk := conn.recv(1 << 16):  # to EOF: the server ends the idle connection
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(body) == exporter_bytes(exporter, lease)
    finally:
        server.close()


def exporter_bytes(exporter, lease: str) -> int:
    nbytes, stream = exporter.open_data(lease)
    stream.close()
    return nbytes
