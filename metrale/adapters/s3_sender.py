"""boto3's requests, sent through the fetch transport (fetch_transport.py), so that the
fetch deadline bounds each of them in every phase. botocore's own sender (urllib3) bounds
only each silent wait, and its connection is out of reach while a response trickles in.

It is a 'before-send' handler, botocore's public hook for sending a request another way
(moto's in-process mock uses the same one): botocore still resolves the credentials, the
region and the endpoint, signs, retries (a transport failure is raised as the botocore
error its own sender raises, so the same ones are retried; a deadline passed is not) and
parses the replies. Proxies and CA bundles follow the environment, as httpx2's do.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
from botocore.awsrequest import AWSResponse
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from metrale.adapters.fetch_transport import DeadlineTransport


class RawBody:
    """A streamed reply as botocore reads one (StreamingBody.read, AWSResponse.content)."""

    def __init__(self, reply: httpx2.Response, url: str) -> None:
        self._reply, self._url = reply, url
        self._chunks = self._pieces()
        self._left = b""

    def read(self, amt: int | None = None) -> bytes:
        if amt is None:
            out, self._left = self._left + b"".join(self._chunks), b""
            return out
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._left = chunk
        out, self._left = self._left[:amt], self._left[amt:]
        return out

    def stream(self, amt: int = 1024, decode_content: bool = False) -> Iterator[bytes]:
        while chunk := self.read(amt):
            yield chunk

    def close(self) -> None:
        self._reply.close()

    def _pieces(self) -> Iterator[bytes]:
        """The body as it arrives; transport failures as botocore's sender raises them."""
        try:
            yield from self._reply.iter_raw()
        except httpx2.TimeoutException as e:
            raise ReadTimeoutError(endpoint_url=self._url, error=e) from None
        except httpx2.TransportError as e:
            raise ConnectionClosedError(endpoint_url=self._url, error=e) from None


class S3Sender:
    """client.meta.events.register("before-send.s3", S3Sender()). No socket timeout of its
    own: the fetch deadline on the calling thread bounds every wait, silent ones included."""

    def __init__(self, verify: bool | str = True) -> None:
        self._client = httpx2.Client(transport=DeadlineTransport(verify), timeout=None,
                                     follow_redirects=False)

    def __call__(self, request, **_) -> AWSResponse:
        url = request.url
        body = request.body
        if hasattr(body, "read"):  # a stream (S3 uploads): not sent by this source
            body = body.read()
        try:
            reply = self._client.send(
                self._client.build_request(request.method, url, headers=list(request.headers.items()),
                                           content=body or None),
                stream=True)
        except httpx2.ConnectTimeout as e:
            raise ConnectTimeoutError(endpoint_url=url, error=e) from None
        except httpx2.ConnectError as e:
            raise EndpointConnectionError(endpoint_url=url, error=e) from None
        except httpx2.TimeoutException as e:
            raise ReadTimeoutError(endpoint_url=url, error=e) from None
        except httpx2.TransportError as e:
            raise ConnectionClosedError(endpoint_url=url, request=request, error=e) from None
        return AWSResponse(url, reply.status_code, dict(reply.headers.items()), RawBody(reply, url))

    def close(self) -> None:
        self._client.close()
