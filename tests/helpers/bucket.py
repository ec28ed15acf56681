"""A small S3 look-alike on loopback, kept only for faults no real S3 server produces: a
body cut off mid-way, a lying header (an ETag that does not match, a Content-Length
larger than what is sent or absurd, none at all), a reply that is no HTTP, a 500 or a
redirect out, a store that holds a reply until a test releases it, and one that
trickles its headers or body a byte at a time or falls silent. Everything a real
server does (the S3 protocol, signing, credentials, ETags, the scale trace) is tested
against moto's server (tests/helpers/moto_s3.py)."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.peers import adapter_dir

FILES = ("adapter_config.json", "adapter_model.safetensors")
TRICKLE_GAP_S = 0.05  # between two bytes of a trickling reply (the store's pace, not a test wait)
MODES = ("bad-etag", "short", "long-length", "trickle-headers", "trickle-body", "silent",
         "error-500", "garbage", "no-length", "redirect", "huge-length")


# whole replies (status line, headers, body) of stores that misbehave
ODD_REPLIES = {
    "error-500": lambda body: b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\noops!",
    "garbage": lambda body: b"\x00\xffNOT HTTP AT ALL\r\n\r\n",
    "no-length": lambda body: b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body,
    "redirect": lambda body: b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:9/x\r\n"
                             b"Content-Length: 0\r\n\r\n",
    "huge-length": lambda body: b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\n" + body,
}


def trickle(handler: BaseHTTPRequestHandler, data: bytes, closed: threading.Event) -> None:
    """A reply a byte per TRICKLE_GAP_S, until sent, closed, or cut off by the client."""
    handler.close_connection = True
    for i in range(len(data)):
        if closed.wait(TRICKLE_GAP_S):
            return
        try:
            handler.wfile.write(data[i:i + 1])
            handler.wfile.flush()
        except OSError:  # the client cut it off
            return


class Bucket:
    """Objects by path-style key (/bucket/key); modes per key (MODES); a held key (hold)
    answers its headers, then waits for release before its body."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.modes: dict[str, str] = {}
        self.gets: list[str] = []
        self.held: dict[str, tuple[threading.Event, threading.Event]] = {}  # arrived, released
        self.closed = threading.Event()  # ends every trickle and hold
        self._holding = threading.Condition()  # notified as each held reply arrives
        bucket = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:
                key = self.path.split("?", 1)[0]
                bucket.gets.append(key if not head else f"HEAD {key}")
                if not self.headers.get("Authorization", "").startswith("AWS4-HMAC-SHA256 Credential="):
                    self.reply_empty(403)
                    return
                body = bucket.objects.get(key)
                if body is None:
                    self.reply_empty(404)
                    return
                mode = bucket.modes.get(key)
                if mode in ODD_REPLIES:
                    self.close_connection = True
                    self.wfile.write(ODD_REPLIES[mode](body))
                    return
                if mode == "silent":
                    bucket.closed.wait(120)
                    return
                etag = "0" * 32 if mode == "bad-etag" else hashlib.md5(body).hexdigest()
                length = len(body) + 10 if mode == "long-length" else len(body)
                head_bytes = (f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n"
                              f'ETag: "{etag}"\r\nConnection: close\r\n\r\n').encode()
                if mode == "trickle-headers":
                    trickle(self, head_bytes + body, bucket.closed)
                    return
                self.wfile.write(head_bytes)
                self.wfile.flush()
                self.close_connection = True
                if head:
                    return
                if key in bucket.held:
                    arrived, released = bucket.held[key]
                    with bucket._holding:
                        arrived.set()
                        bucket._holding.notify_all()
                    while not released.wait(0.1) and not bucket.closed.is_set():
                        pass
                if mode == "trickle-body":
                    trickle(self, body, bucket.closed)
                    return
                self.wfile.write(body[:len(body) // 2] if mode == "short" else body)

            def reply_empty(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "AKTEST",
                    "AWS_SECRET_ACCESS_KEY": "secret", "AWS_REGION": "us-east-1"}

    def hold(self, key: str) -> tuple[threading.Event, threading.Event]:
        """(arrived, release): arrived is set once a GET of key has its headers; setting
        release sends the body."""
        self.held[key] = (threading.Event(), threading.Event())
        return self.held[key]

    def wait_held(self, n: int, timeout: float) -> bool:
        """Until n held replies have arrived (False at the timeout: a hang)."""
        with self._holding:
            return self._holding.wait_for(
                lambda: sum(a.is_set() for a, _ in self.held.values()) >= n, timeout)

    def put_adapter(self, key_prefix: str, src: str = "a", bucket: str = "bucket") -> None:
        for f in FILES:
            self.objects[f"/{bucket}/{key_prefix}/{f}"] = (adapter_dir(src) / f).read_bytes()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
