"""Whole-piece socket calls for the HTTP data plane. A socket with a Python timeout is
non-blocking underneath: each send or recv moves what the kernel's buffer takes or holds
at that moment (on loopback ~64 KB to a few MB) and the thread takes the GIL back between
calls, so eight streams in one process spent their time queueing for it. A blocking
socket with the kernel's own timeouts (SO_SNDTIMEO / SO_RCVTIMEO) moves a whole piece
per call and stays bounded by the caller's deadline.
"""

from __future__ import annotations

import socket
import struct
import time

_TIMEVAL = struct.Struct("@ll")  # struct timeval (Linux)


def _set_timeo(sock: socket.socket, option: int, seconds: float) -> None:
    whole, frac = divmod(max(seconds, 1e-6), 1.0)
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(int(whole), max(1, int(frac * 1e6))))


def send_all(sock: socket.socket, data: memoryview, timeout_s: float) -> None:
    """All of data within timeout_s in all, as a timed sendall would (else TimeoutError).
    The socket is left blocking: for the rest of a reply on it."""
    end = time.monotonic() + timeout_s
    sock.settimeout(None)
    while data:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client did not take the bytes in time")
        _set_timeo(sock, socket.SO_SNDTIMEO, left)
        try:
            sent = sock.send(data)
        except BlockingIOError:  # SO_SNDTIMEO ran out with nothing taken
            raise TimeoutError("the client did not take the bytes in time") from None
        data = data[sent:]


def recv_piece(sock: socket.socket, out: memoryview, left_s: float) -> int:
    """Up to len(out) bytes, waiting for all of them (MSG_WAITALL) at most left_s seconds;
    fewer only at the end of the stream, on shutdown or when the time runs out; 0 at EOF.
    Raises TimeoutError when the time ran out with nothing in."""
    sock.settimeout(None)  # blocking: a timed socket ignores MSG_WAITALL
    _set_timeo(sock, socket.SO_RCVTIMEO, left_s)
    try:
        return socket.socket.recv_into(sock, out, 0, socket.MSG_WAITALL)
    except BlockingIOError:
        raise TimeoutError from None
