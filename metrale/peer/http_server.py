"""The peer protocol over the standard library's threading HTTP server.

  GET    /peer/v1/adapters               list what can be leased
  POST   /peer/v1/adapters/{id}/lease    {"ttl_s": s, "manifest_version": 3} -> the lease and
                                         the manifest in one binary body (metrale.peer.wire)
  GET    /peer/v1/leases/{lease}/data    the leased tensors, concatenated in manifest order;
                                         ?offset=A&length=N (either optional): those bytes only
  DELETE /peer/v1/leases/{lease}         release early
  GET    /peer/v1/health

Clients outside `client_allow` (default: loopback) get 403 before anything is
read. Every socket has a timeout, so a stalled client cannot hold a lease (or a
thread) forever.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, unquote

from metrale.errors import AdapterError, MetraleError, SlotBusyError, UnknownAdapterError
from metrale.peer.allow import AllowList, as_allow_list
from metrale.peer.blocking_io import send_all
from metrale.peer.errors import DataRangeError, LeaseNotFoundError, TooManyLeasesError
from metrale.peer.exporter import AdapterExporter, DataStream
from metrale.peer.wire import CONTENT_TYPE

log = logging.getLogger("metrale.peer")

SOCKET_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 64 * 1024
_LEASE_RE = re.compile(r"/peer/v1/adapters/([^/]{1,200})/lease")
_DATA_RE = re.compile(r"/peer/v1/leases/([A-Za-z0-9_-]{1,64})/data")
_RELEASE_RE = re.compile(r"/peer/v1/leases/([A-Za-z0-9_-]{1,64})")
_RANGE_INT = re.compile(r"[0-9]{1,19}")  # plain ASCII digits: int() also takes "+1", "1_0", "١"
_STATUS = [(LeaseNotFoundError, 404), (UnknownAdapterError, 404), (SlotBusyError, 409),
           (TooManyLeasesError, 503), (AdapterError, 422), (MetraleError, 400)]


class _Handler(BaseHTTPRequestHandler):
    server: PeerHTTPServer
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        log.debug("peer http %s: " + format, self.client_address[0], *args)

    def _dispatch(self) -> None:
        method = self.command
        if not self.server.client_allow.allows_ip(self.client_address[0]):
            self._send_json(403, _error(f"client {self.client_address[0]} is not in this peer's "
                                        "client allow-list", "forbidden"))
            return
        exporter = self.server.exporter
        path, _, query = self.path.partition("?")
        try:
            if method == "GET" and path == "/peer/v1/adapters":
                self._send_json(200, exporter.list_adapters())
            elif method == "GET" and path == "/peer/v1/health":
                self._send_json(200, {"status": "ok", "open_leases": exporter.open_leases})
            elif method == "POST" and (m := _LEASE_RE.fullmatch(path)):
                body = self._body()
                reply = exporter.lease(unquote(m[1]), body.get("ttl_s"), body.get("manifest_version"))
                self._send_bytes(200, reply.body, CONTENT_TYPE)
            elif method == "GET" and (m := _DATA_RE.fullmatch(path)):
                self._send_data(*exporter.open_data(m[1], *_data_range(query)))
            elif method == "DELETE" and (m := _RELEASE_RE.fullmatch(path)):
                exporter.release(m[1])
                self._send_json(200, {"released": True})
            else:
                self._send_json(404, _error(f"no route {method} {path}", "not_found"))
        except MetraleError as e:
            status = next(code for cls, code in _STATUS if isinstance(e, cls))
            self._send_json(status, _error(str(e), type(e).__name__))
        except (ConnectionError, TimeoutError) as e:
            log.info("peer http: client %s went away: %s", self.client_address[0], e)
            self.close_connection = True
        except Exception as e:
            log.exception("peer http: %s %s failed", method, path)
            self._send_json(500, _error(f"internal error: {type(e).__name__}", "internal"))

    do_GET = do_POST = do_DELETE = _dispatch  # the routes check the method (self.command)

    def _body(self) -> dict:
        raw_length = self.headers.get("Content-Length") or "0"
        length = int(raw_length) if raw_length.isdigit() else -1
        if not 0 <= length <= MAX_BODY_BYTES:
            raise MetraleError(f"request body length {raw_length[:20]!r} is invalid or too large")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MetraleError("request body is not JSON") from None
        if not isinstance(body, dict):  # ttl_s itself: AdapterExporter.lease checks it
            raise MetraleError("request body must be a JSON object")
        return body

    def _send_json(self, status: int, doc: dict) -> None:
        self._send_bytes(status, json.dumps(doc).encode(), "application/json")

    def _send_bytes(self, status: int, raw: bytes, content_type: str) -> None:
        self._send(status, content_type, len(raw), (raw,))

    def _send_data(self, nbytes: int, chunks: DataStream) -> None:
        try:
            self._send(200, "application/octet-stream", nbytes, chunks)
        finally:
            chunks.close()  # ends the stream's hold on the lease, even on a broken pipe

    def _send(self, status: int, content_type: str, nbytes: int, chunks: Iterable) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(nbytes))
        self.end_headers()
        try:
            for chunk in chunks:  # each within SOCKET_TIMEOUT_S, as a timed sendall was
                send_all(self.connection, memoryview(chunk), SOCKET_TIMEOUT_S)
        finally:
            self.connection.settimeout(self.timeout)  # the next request's reads are timed


def _data_range(query: str) -> tuple[int, int | None]:
    """(offset, length) of a data request's query: each optional, each given once, plain
    decimal digits; nothing else may be in it. Whether the range fits is the exporter's
    to say (it knows the lease's size). Raises DataRangeError (a 400)."""
    if not query:
        return 0, None
    refusal = DataRangeError(f"data query {query[:80]!r}: expected offset=<bytes>&length=<bytes>")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True, max_num_fields=2)
    except ValueError:  # malformed, or more than two fields
        raise refusal from None
    values = dict(pairs)
    if len(values) != len(pairs) or not set(values) <= {"offset", "length"} \
            or not all(_RANGE_INT.fullmatch(v) for v in values.values()):
        raise refusal
    length = values.get("length")
    return int(values.get("offset", "0")), None if length is None else int(length)


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "code": code}}


class PeerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, exporter: AdapterExporter, host: str = "127.0.0.1", port: int = 0,
                 client_allow: AllowList | Iterable[str] | None = None) -> None:
        self.exporter = exporter
        self.client_allow = as_allow_list(client_allow)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (an engine releasing a lease closes without reading the
        answer) is routine here, not a traceback on stderr."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("peer http: %s hung up", client_address)
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> PeerHTTPServer:
        """Serve on a background thread (engines and tests); the CLI uses serve_forever."""
        self._thread = threading.Thread(target=self.serve_forever, args=(0.1,),
                                        name="metrale-peer-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()
