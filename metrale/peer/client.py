"""The engine's side of the peer control plane, and the HTTP data plane.

Every blocking socket call takes its timeout from the operation's Deadline: a per-recv
timeout alone would never trip for a peer that sends a byte just before each expires.
Every reply is also read under a byte cap, so a peer that floods costs bounded memory.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import queue
import socket
import threading
from collections.abc import Callable
from urllib.parse import quote

from metrale.errors import MetraleError
from metrale.peer.allow import PeerAddress
from metrale.peer.blocking_io import recv_piece
from metrale.peer.deadline import Deadline
from metrale.peer.errors import (
    ManifestVersionError,
    PeerConnectionError,
    PeerManifestError,
    PeerTimeoutError,
    PeerTransferError,
    UnknownPeerAdapterError,
)
from metrale.peer.streams import RangeSink, SocketGroup, as_progress, read_spans, split
from metrale.peer.wire import CONTENT_TYPE, MAX_MANIFEST_BYTES, WIRE_VERSION

log = logging.getLogger("metrale.peer")

IO_TIMEOUT_S = 10.0  # one blocking socket call, never more than the deadline's rest
# Releasing is best effort (the lease expires anyway), so it gets a short budget of
# its own: the operation's deadline may be spent already when it runs.
RELEASE_TIMEOUT_S = 1.0
RELEASE_REPLY_BYTES = 4096  # a release's answer is a status and a small JSON object
# Status line, headers and chunk framing on top of a reply's body; http.client's own
# limits (100 headers of 64 KiB) would allow 6.5 MiB, and chunked trailers no limit.
FRAMING_BYTES = 256 << 10
MAX_REPLY_INT_DIGITS = 20  # JSON integers: 2**63 has 19 digits
_CHUNK = 1 << 20
# Bytes per receive call of a data stream, straight into the caller's pinned buffer; each
# piece goes on to the device as soon as it is in. 8B slot over 8 streams on the H200 host:
# 13.8-15.8 ms with 8 MiB pieces, 15.4-20.2 with 2 MiB (more calls, more GIL hand-offs).
DATA_SPAN = 8 << 20
# Streams of one data read from a peer that serves ranges: one stream through Python
# moved ~2.9 GB/s on the H200 host, so an 8B slot (86.6 MB) took ~30 ms on one. Landings
# of it there: 15.1 ms over 4 streams, 13.2 over 8, 15.6 over 12, 18.6 over 16 (16 cores;
# 2026-12-02 on another host, 4 MiB pieces: 15.4 / 13.1 / 16.0 / 20.2 over 4 / 6 / 12 / 16).
DATA_STREAMS = 8
SPLIT_BYTES = 8 << 20  # smaller reads use one stream: more connections would cost more
MAX_IDLE_PER_PEER = 4  # kept control-plane connections per peer


class PeerClient:
    def __init__(self, addr: PeerAddress, deadline: Deadline) -> None:
        self.addr, self.deadline = addr, deadline

    # --- control plane --------------------------------------------------------------

    def list_ids(self) -> list[object]:
        """The ids of the peer's adapter list, as sent: untrusted, maybe not even strings."""
        what = "cannot list adapters"
        raw = self._reply("GET", "/peer/v1/adapters", None, what)
        try:
            doc = strict_json(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise PeerManifestError(f"peer {self.addr}: {what}: the reply is not JSON ({e})") from None
        adapters = doc.get("adapters") if isinstance(doc, dict) else None
        if not isinstance(adapters, list):
            raise PeerManifestError(f"peer {self.addr}: {what}: the reply is not {{'adapters': [...]}}")
        return [a.get("id") if isinstance(a, dict) else None for a in adapters]

    def lease(self, adapter_id: str, ttl_s: float) -> bytes:
        """One round trip: the lease and the adapter's manifest, as the reply body
        (metrale.peer.wire), read under the manifest byte cap."""
        path = f"/peer/v1/adapters/{quote(adapter_id, safe='')}/lease"
        what = f"lease {adapter_id!r}"
        return self._reply("POST", path, {"ttl_s": ttl_s, "manifest_version": WIRE_VERSION}, what,
                           accept=CONTENT_TYPE)

    def release(self, lease_id: str) -> None:
        """Queue the release for the background releaser and return at once: a landing
        ends at its commit, not a round trip later (~0.8 ms of a warm 8B landing)."""
        _RELEASER.submit(self, lease_id)

    def release_now(self, lease_id: str) -> None:
        """Best effort, under its own short deadline; never raises."""
        what = f"release lease {lease_id[:16]!r}"
        path = f"/peer/v1/leases/{quote(lease_id, safe='')}"
        try:
            self._reply("DELETE", path, None, what, deadline=Deadline(RELEASE_TIMEOUT_S),
                        cap=RELEASE_REPLY_BYTES)
        except MetraleError as e:
            log.info("peer %s: releasing lease %s failed (%s); it will expire", self.addr,
                     lease_id[:16], e)

    def _reply(self, method: str, path: str, body: dict | None, what: str,
               accept: str = "application/json", deadline: Deadline | None = None,
               cap: int = MAX_MANIFEST_BYTES) -> bytes:
        """The body of one control-plane call, read under `cap` bytes, over a kept
        connection when one is idle; a status other than 200 raises its typed error."""
        conn, resp = self._request(method, path, body, what, deadline or self.deadline,
                                   cap, accept, reuse=True)
        try:
            raw = self._read_capped(resp, cap, what)
        except BaseException:
            conn.close()
            raise
        _IDLE.give(self.addr, conn, resp)
        if resp.status != 200:
            self._refusal(resp.status, raw, what)
        return raw

    def _refusal(self, status: int, raw: bytes, what: str):
        """Raise the typed error for a non-200 reply."""
        try:
            doc = strict_json(raw)
        except ValueError:
            raise PeerConnectionError(f"peer {self.addr}: {what}: HTTP {status}") from None
        error = doc.get("error") if isinstance(doc, dict) else None
        error = error if isinstance(error, dict) else {}
        message = error.get("message")
        message = message[:500] if isinstance(message, str) else "no error message"
        if status == 404:
            raise UnknownPeerAdapterError(f"peer {self.addr}: {what}: {message}")
        if error.get("code") == "ManifestVersionError":
            raise ManifestVersionError(f"peer {self.addr}: {what}: {message}")
        raise PeerConnectionError(f"peer {self.addr}: {what}: HTTP {status}: {message}")

    # --- data plane ---------------------------------------------------------------------

    def read_exact(self, path: str, out: memoryview, on_range: RangeSink | None = None,
                   ranged: bool = False) -> None:
        """Stream exactly len(out) bytes from `path` into `out`, over up to DATA_STREAMS
        streams when the peer serves byte ranges (`ranged`); on_range(a, b) is told, on
        this thread, as each piece out[a:b] is in."""
        spans = split(len(out), DATA_STREAMS if ranged else 1, SPLIT_BYTES)
        if len(spans) == 1:
            self._read_stream(path, out, as_progress(on_range))
            return
        read_spans(spans, lambda a, b, on_progress, group: self._read_stream(
            f"{path}?offset={a}&length={b - a}", out[a:b], on_progress, group), on_range)

    def _read_stream(self, path: str, out: memoryview, progress: Callable[[int], None] | None,
                     group: SocketGroup | None = None) -> None:
        """Exactly len(out) bytes into `out`: a short or long stream is an error. The
        socket joins `group`, when given, so that another stream's error can end it."""
        n = len(out)
        what = "data stream"
        # Chunked framing of a real peer costs well under 1/64 of the body.
        cap = n + n // 64
        conn, resp = self._request("GET", path, None, what, self.deadline, cap, group=group)
        try:
            if resp.status != 200:
                raise PeerTransferError(f"peer {self.addr}: {what}: HTTP {resp.status}")
            length = resp.getheader("Content-Length")
            if length is not None and length.strip() != str(n):
                raise PeerTransferError(
                    f"peer {self.addr}: {what} announces {length[:40]!r} bytes, not the {n} asked for"
                )
            plain = not (resp.chunked or resp.length != n or conn.data_sock is None or not n)
            if plain:  # a body of the announced length: past http.client, whole pieces
                got = resp.readinto(out[:min(n, len(resp.fp.peek()))])  # read with the headers
                read = conn.data_sock.read_piece
            else:  # chunked, or a length http.client was not told
                got = 0

                def read(view: memoryview) -> int:
                    self._check_deadline(what)
                    return resp.readinto(view)
            _fill(out, got, read, f"peer {self.addr}: {what}", progress)
            if not plain and resp.read1(1):
                raise PeerTransferError(f"peer {self.addr}: {what} is longer than the {n} bytes announced")
        except TimeoutError:
            raise self._timeout(what) from None
        except (OSError, http.client.HTTPException) as e:
            raise PeerTransferError(f"peer {self.addr}: {what} failed: {type(e).__name__}: {e}") from None
        finally:
            resp.close()  # a peer that asked to close leaves the socket to the response
            conn.close()

    # --- plumbing -------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None, what: str,
                 deadline: Deadline, body_cap: int, accept: str = "application/json",
                 group: SocketGroup | None = None, reuse: bool = False):
        """Send the request and read the status line and headers, all under `deadline`.
        reuse: over an idle kept connection if there is one (a peer may have closed it
        meanwhile: then once more over a new one)."""
        label = f"peer {self.addr}: {what}"
        conn = _IDLE.take(self.addr, deadline, label, body_cap + FRAMING_BYTES) if reuse else None
        if conn is None:
            conn = _PeerConnection(self.addr, deadline, label, body_cap + FRAMING_BYTES, group)
            reuse = False
        host = f"[{self.addr.host}]" if ":" in self.addr.host else self.addr.host
        headers = {"Host": f"{host}:{self.addr.port}", "Accept": accept}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            return conn, conn.getresponse()
        except TimeoutError:
            conn.close()
            raise self._timeout(what) from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            if reuse and isinstance(e, _STALE):  # the peer closed the idle connection
                return self._request(method, path, body, what, deadline, body_cap, accept, group)
            raise PeerConnectionError(
                f"peer {self.addr}: {what}: unreachable ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        except BaseException:  # a deadline or byte-cap refusal from the socket
            conn.close()
            raise

    def _read_capped(self, resp: http.client.HTTPResponse, cap: int, what: str) -> bytes:
        length = resp.getheader("Content-Length")
        if length is not None and _over(length, cap):
            raise PeerManifestError(f"peer {self.addr}: {what}: reply of {length[:40]} bytes > {cap} cap")
        parts, total = [], 0
        try:
            while True:
                self._check_deadline(what)
                chunk = resp.read1(min(_CHUNK, cap + 1 - total))
                if not chunk:
                    break
                parts.append(chunk)
                total += len(chunk)
                if total > cap:
                    raise PeerManifestError(f"peer {self.addr}: {what}: reply larger than {cap} bytes")
        except TimeoutError:
            raise self._timeout(what) from None
        except (OSError, http.client.HTTPException) as e:
            raise PeerConnectionError(f"peer {self.addr}: {what}: {type(e).__name__}: {e}") from None
        # http.client ends a fixed-length body quietly at EOF; a truncated reply that
        # happens to parse must not pass for the whole one.
        if resp.length:
            raise PeerConnectionError(
                f"peer {self.addr}: {what}: the peer closed the connection {resp.length} bytes "
                "before the end of its reply"
            )
        return b"".join(parts)

    def _check_deadline(self, what: str) -> None:
        self.deadline.timeout(f"peer {self.addr}: {what}")

    def _timeout(self, what: str) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"peer {self.addr}: {what}: stalled; no complete reply within the "
            f"{self.deadline.total_s:.1f}s peer timeout"
        )


class _DeadlineSocket(socket.socket):
    """A TCP socket whose every blocking call gets only what is left of one
    Deadline, and that refuses to receive more than `max_bytes` in all. http.client
    only calls recv_into (through makefile) and sendall on it."""

    deadline: Deadline
    label: str
    max_bytes: int
    received: int = 0

    def _arm(self) -> None:
        self.settimeout(self.deadline.timeout(self.label, IO_TIMEOUT_S))

    def _count(self, n: int) -> int:
        self.received += n
        if self.received > self.max_bytes:
            raise PeerTransferError(
                f"{self.label}: the peer sent more than {self.max_bytes} bytes for one reply"
            )
        return n

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return self._count(super().recv_into(buffer, nbytes, flags))

    def sendall(self, data, flags: int = 0) -> None:
        self._arm()  # sendall's timeout bounds the whole call, not each piece
        super().sendall(data, flags)

    def read_piece(self, out: memoryview) -> int:
        """Up to len(out) bytes straight from the kernel in one call (blocking_io.recv_piece),
        bounded by the deadline's rest; 0 at EOF."""
        return self._count(recv_piece(self, out, self.deadline.timeout(self.label, IO_TIMEOUT_S)))


def _fill(out: memoryview, got: int, read: Callable[[memoryview], int], label: str,
          progress: Callable[[int], None] | None) -> None:
    """out[got:] by read(view) -> bytes read, DATA_SPAN at most a call; progress(got) as
    they come. A read of nothing before the end is an error."""
    n = len(out)
    if got and progress is not None:
        progress(got)
    while got < n:
        k = read(out[got:got + DATA_SPAN])
        if not k:
            raise PeerTransferError(f"{label} ended after {got} of {n} bytes; the peer died or "
                                    "closed mid-transfer")
        got += k
        if progress is not None:
            progress(got)


class _PeerConnection(http.client.HTTPConnection):
    def __init__(self, addr: PeerAddress, deadline: Deadline, label: str, max_bytes: int,
                 group: SocketGroup | None = None) -> None:
        super().__init__(addr.ip, addr.port, timeout=IO_TIMEOUT_S)  # connect() uses the deadline
        self.deadline, self.label, self.max_bytes, self.group = deadline, label, max_bytes, group
        # the socket a data reply is read from: http.client drops self.sock when the
        # reply will close the connection, and the reply's reader keeps it open
        self.data_sock: _DeadlineSocket | None = None

    def connect(self) -> None:
        raw = socket.create_connection((self.host, self.port),
                                       self.deadline.timeout(self.label, IO_TIMEOUT_S))
        sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        sock.deadline, sock.label, sock.max_bytes = self.deadline, self.label, self.max_bytes
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self.data_sock = sock
        if self.group is not None:
            self.group.add(sock)  # raises when the read was cancelled meanwhile

    def rearm(self, deadline: Deadline, label: str, max_bytes: int) -> None:
        """A kept connection, for its next call: that call's deadline and byte cap."""
        self.deadline, self.label, self.max_bytes = deadline, label, max_bytes
        sock = self.sock
        sock.deadline, sock.label, sock.max_bytes, sock.received = deadline, label, max_bytes, 0


# What a kept connection that the peer closed while it sat idle fails with
# (http.client.RemoteDisconnected is a ConnectionError).
_STALE = (ConnectionError, http.client.BadStatusLine)


class _IdleConnections:
    """Control-plane connections kept open between calls, per peer: a lease over one skips
    the TCP handshake and the peer's start of a thread for a new connection. Only a
    connection whose reply was read to its end and that the peer keeps open comes back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[_PeerConnection]] = {}

    def take(self, addr: PeerAddress, deadline: Deadline, label: str,
             max_bytes: int) -> _PeerConnection | None:
        with self._lock:
            kept = self._idle.get((addr.ip, addr.port))
            conn = kept.pop() if kept else None
        if conn is not None:
            conn.rearm(deadline, label, max_bytes)
        return conn

    def give(self, addr: PeerAddress, conn: _PeerConnection,
             resp: http.client.HTTPResponse) -> None:
        if conn.sock is None or resp.will_close or resp.length != 0:  # not read to its end
            conn.close()
            return
        resp.close()  # its file object only: the connection keeps the socket
        with self._lock:
            kept = self._idle.setdefault((addr.ip, addr.port), [])
            if len(kept) < MAX_IDLE_PER_PEER:
                kept.append(conn)
                return
        conn.close()


class _Releaser:
    """Sends lease releases on one background thread, in order. Best effort, as before:
    a release that fails is logged and the lease expires on the peer."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, client: PeerClient, lease_id: str) -> None:
        with self._idle:
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="metrale-peer-release",
                                                daemon=True)
                self._thread.start()
        self._queue.put((client, lease_id))

    def wait(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            client, lease_id = self._queue.get()
            try:
                client.release_now(lease_id)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


_IDLE = _IdleConnections()
_RELEASER = _Releaser()


def wait_for_releases(timeout_s: float = 5.0) -> bool:
    """Until every queued lease release was sent (tests, shutdown); False on timeout."""
    return _RELEASER.wait(timeout_s)


def strict_json(raw: bytes | str) -> object:
    """json.loads without Python's extensions: no NaN/Infinity, no float that
    overflows to inf, no integer longer than MAX_REPLY_INT_DIGITS digits; nesting
    too deep for the decoder is a ValueError too. Raises ValueError."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_REPLY_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


def _over(length: str, cap: int) -> bool:
    """Content-Length above `cap`, without int() on a peer's 5000-digit string."""
    text = length.strip().lstrip("0") or "0"
    return text.isascii() and text.isdigit() and (len(text) > len(str(cap)) or int(text) > cap)
