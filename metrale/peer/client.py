"""The engine's side of the peer control plane, and the HTTP data plane.

Plain http.client: every connect and every read takes its timeout from the
operation's Deadline, and no response is read past a byte cap, so a peer that
stalls, trickles or floods costs at most the configured timeout and memory.
"""

from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import quote

from metrale.peer.allow import PeerAddress
from metrale.peer.deadline import Deadline
from metrale.peer.errors import (
    PeerConnectionError,
    PeerManifestError,
    PeerTimeoutError,
    PeerTransferError,
    UnknownPeerAdapterError,
)
from metrale.peer.manifest import MAX_MANIFEST_BYTES

log = logging.getLogger("metrale.peer")

IO_TIMEOUT_S = 10.0  # one blocking socket call, never more than the deadline's rest
RELEASE_TIMEOUT_S = 2.0
_CHUNK = 1 << 20


class PeerClient:
    def __init__(self, addr: PeerAddress, deadline: Deadline) -> None:
        self.addr, self.deadline = addr, deadline

    # --- control plane --------------------------------------------------------------

    def list_adapters(self) -> dict:
        return self._json("GET", "/peer/v1/adapters", None, "list adapters")

    def lease(self, adapter_id: str, ttl_s: float) -> dict:
        path = f"/peer/v1/adapters/{quote(adapter_id, safe='')}/lease"
        return self._json("POST", path, {"ttl_s": ttl_s}, f"lease {adapter_id!r}")

    def release(self, lease_id: str) -> None:
        """Best effort with its own short timeout: the lease expires on its own anyway."""
        path = f"/peer/v1/leases/{quote(lease_id, safe='')}"
        conn = http.client.HTTPConnection(self.addr.ip, self.addr.port, timeout=RELEASE_TIMEOUT_S)
        try:
            conn.request("DELETE", path, headers={"Host": self._host()})
            conn.getresponse().read(4096)
        except (OSError, http.client.HTTPException) as e:
            log.info("peer %s: releasing lease %s failed (%s); it will expire", self.addr, lease_id, e)
        finally:
            conn.close()

    def _json(self, method: str, path: str, body: dict | None, what: str) -> dict:
        conn, resp = self._request(method, path, body, what)
        try:
            raw = self._read_capped(conn, resp, MAX_MANIFEST_BYTES, what)
        finally:
            conn.close()
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if resp.status != 200:
                raise PeerConnectionError(f"peer {self.addr}: {what}: HTTP {resp.status}") from None
            raise PeerManifestError(f"peer {self.addr}: {what}: the reply is not JSON") from None
        if resp.status != 200:
            message = _error_message(doc)
            if resp.status == 404:
                raise UnknownPeerAdapterError(f"peer {self.addr}: {what}: {message}")
            raise PeerConnectionError(f"peer {self.addr}: {what}: HTTP {resp.status}: {message}")
        if not isinstance(doc, dict):
            raise PeerManifestError(f"peer {self.addr}: {what}: the reply is not a JSON object")
        return doc

    # --- data plane ---------------------------------------------------------------------

    def read_exact(self, path: str, out: memoryview) -> None:
        """Stream exactly len(out) bytes from `path` into `out`; a short or long
        stream, a stall or a trickle past the deadline is an error."""
        n = len(out)
        what = "data stream"
        conn, resp = self._request("GET", path, None, what)
        try:
            if resp.status != 200:
                raise PeerTransferError(f"peer {self.addr}: {what}: HTTP {resp.status}")
            length = resp.getheader("Content-Length")
            if length is not None and length.strip() != str(n):
                raise PeerTransferError(
                    f"peer {self.addr}: {what} announces {length} bytes, the manifest {n}"
                )
            got = 0
            while got < n:
                self._arm(conn, what)
                k = resp.readinto(out[got:min(n, got + _CHUNK)])
                if not k:
                    raise PeerTransferError(
                        f"peer {self.addr}: {what} ended after {got} of {n} bytes; the peer "
                        "died or closed mid-transfer"
                    )
                got += k
            self._arm(conn, what)
            if resp.read(1):
                raise PeerTransferError(f"peer {self.addr}: {what} is longer than the {n} bytes announced")
        except TimeoutError:
            raise PeerTimeoutError(
                f"peer {self.addr}: {what} stalled; no data within the {self.deadline.total_s:.1f}s "
                "peer timeout"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            raise PeerTransferError(f"peer {self.addr}: {what} failed: {type(e).__name__}: {e}") from None
        finally:
            conn.close()

    # --- plumbing -------------------------------------------------------------------------

    def _host(self) -> str:
        host = f"[{self.addr.host}]" if ":" in self.addr.host else self.addr.host
        return f"{host}:{self.addr.port}"

    def _request(self, method: str, path: str, body: dict | None, what: str):
        timeout = self.deadline.timeout(f"peer {self.addr}: {what}", IO_TIMEOUT_S)
        conn = http.client.HTTPConnection(self.addr.ip, self.addr.port, timeout=timeout)
        headers = {"Host": self._host(), "Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            self._arm(conn, what)
            return conn, conn.getresponse()
        except TimeoutError:
            conn.close()
            raise PeerTimeoutError(f"peer {self.addr}: {what}: no reply in time") from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise PeerConnectionError(
                f"peer {self.addr} cannot be reached ({what}): {type(e).__name__}: {e}"
            ) from None

    def _arm(self, conn: http.client.HTTPConnection, what: str) -> None:
        """Give the next blocking read only what is left of the deadline."""
        if conn.sock is not None:
            conn.sock.settimeout(self.deadline.timeout(f"peer {self.addr}: {what}", IO_TIMEOUT_S))

    def _read_capped(self, conn, resp, cap: int, what: str) -> bytes:
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > cap:
            raise PeerManifestError(f"peer {self.addr}: {what}: reply of {length} bytes > {cap} cap")
        parts, total = [], 0
        try:
            while True:
                self._arm(conn, what)
                chunk = resp.read1(min(_CHUNK, cap + 1 - total))
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
                total += len(chunk)
                if total > cap:
                    raise PeerManifestError(f"peer {self.addr}: {what}: reply larger than {cap} bytes")
        except TimeoutError:
            raise PeerTimeoutError(f"peer {self.addr}: {what}: reply stalled") from None
        except (OSError, http.client.HTTPException) as e:
            raise PeerConnectionError(f"peer {self.addr}: {what}: {type(e).__name__}: {e}") from None


def _error_message(doc: object) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        message = doc["error"].get("message")
        if isinstance(message, str):
            return message[:500]
    return "no error message"
