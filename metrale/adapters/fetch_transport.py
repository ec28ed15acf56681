"""The HTTP transport of adapter fetches: an httpx2 transport (httpx2 is what
huggingface_hub speaks; the S3 source sends boto3's signed requests through it too,
s3_sender.py) whose every socket operation, connect, TLS, each write and each read, waits
at most until the deadline of the fetch running on its thread (fetch_deadline.Deadline).
Socket timeouts bound one silent wait; this bounds them all together, so a store that
trickles its headers or its body is cut off at the deadline, in whatever phase it is, and
the thread is free again. Without a deadline on the thread it is a plain transport.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpcore2
import httpx2

from metrale.adapters.fetch_deadline import current

T = TypeVar("T")
MAX_CONNECTIONS = 64  # per transport (one per source): fetches in flight are fewer

# httpcore2's errors as httpx2's (callers such as huggingface_hub catch these), most
# specific first
_ERRORS: tuple[tuple[type[Exception], type[httpx2.HTTPError]], ...] = (
    (httpcore2.ConnectTimeout, httpx2.ConnectTimeout),
    (httpcore2.ReadTimeout, httpx2.ReadTimeout),
    (httpcore2.WriteTimeout, httpx2.WriteTimeout),
    (httpcore2.PoolTimeout, httpx2.PoolTimeout),
    (httpcore2.TimeoutException, httpx2.TimeoutException),
    (httpcore2.ConnectError, httpx2.ConnectError),
    (httpcore2.ReadError, httpx2.ReadError),
    (httpcore2.WriteError, httpx2.WriteError),
    (httpcore2.NetworkError, httpx2.NetworkError),
    (httpcore2.ProxyError, httpx2.ProxyError),
    (httpcore2.UnsupportedProtocol, httpx2.UnsupportedProtocol),
    (httpcore2.RemoteProtocolError, httpx2.RemoteProtocolError),
    (httpcore2.LocalProtocolError, httpx2.LocalProtocolError),
    (httpcore2.ProtocolError, httpx2.ProtocolError),
)


def bounded(op: Callable[[float | None], T], timeout: float | None) -> T:
    """op(timeout), the timeout cut to what is left of this thread's fetch deadline; a
    timeout that the deadline caused is the deadline's FetchDeadlineError."""
    deadline = current()
    if deadline is None:
        return op(timeout)
    try:
        return op(deadline.bound(timeout))
    except httpcore2.TimeoutException:
        if deadline.expired():
            raise deadline.error() from None
        raise


class _Stream(httpcore2.NetworkStream):
    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return bounded(lambda t: self._inner.read(max_bytes, t), timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        bounded(lambda t: self._inner.write(buffer, t), timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore2.NetworkStream:
        return _Stream(bounded(lambda t: self._inner.start_tls(ssl_context, server_hostname, t),
                               timeout))

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _Backend(httpcore2.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore2.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options=None) -> httpcore2.NetworkStream:
        return _Stream(bounded(lambda t: self._inner.connect_tcp(
            host, port, t, local_address, socket_options), timeout))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options=None) -> httpcore2.NetworkStream:
        return _Stream(bounded(lambda t: self._inner.connect_unix_socket(path, t, socket_options),
                               timeout))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


_CORE_ERRORS = (httpcore2.TimeoutException, httpcore2.NetworkError, httpcore2.ProtocolError,
                httpcore2.ProxyError, httpcore2.UnsupportedProtocol)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except _CORE_ERRORS as e:
        deadline = current()
        if isinstance(e, httpcore2.TimeoutException) and deadline is not None \
                and deadline.expired():
            raise deadline.error() from None
        raise _mapped(e) from e


def _mapped(e: Exception) -> httpx2.HTTPError:
    cls = next(to for frm, to in _ERRORS if isinstance(e, frm))
    return cls(str(e))


class _ResponseStream(httpx2.SyncByteStream):
    def __init__(self, stream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._stream

    def close(self) -> None:
        self._stream.close()


class DeadlineTransport(httpx2.BaseTransport):
    """verify: as httpx2's (True, a CA bundle path, or False)."""

    def __init__(self, verify: bool | str = True) -> None:
        context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) \
            else httpx2.create_ssl_context(verify=verify)
        self._pool = httpcore2.ConnectionPool(ssl_context=context,
                                              max_connections=MAX_CONNECTIONS,
                                              network_backend=_Backend())

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        core = httpcore2.Request(
            method=request.method,
            url=httpcore2.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                              target=url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with _httpx_errors():
            reply = self._pool.handle_request(core)
        return httpx2.Response(status_code=reply.status, headers=reply.headers,
                               stream=_ResponseStream(reply.stream), extensions=reply.extensions)

    def close(self) -> None:
        self._pool.close()
