"""A small S3 look-alike on loopback: path-style GETs, SigV4 scope checked, per-key faults."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.peers import adapter_dir

FILES = ("adapter_config.json", "adapter_model.safetensors")


class Bucket:
    """Objects by path-style key (/bucket/key); modes per key: 'bad-etag', 'short'; a held
    key (hold) answers its headers, then waits for release before its body."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.modes: dict[str, str] = {}
        self.gets: list[str] = []
        self.held: dict[str, tuple[threading.Event, threading.Event]] = {}  # arrived, released
        bucket = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                bucket.gets.append(self.path)
                auth = self.headers.get("Authorization", "")
                if not auth.startswith("AWS4-HMAC-SHA256 Credential=AKTEST/") or \
                        "/us-test-1/s3/aws4_request" not in auth or not self.headers.get("x-amz-date"):
                    self.send_response(403)
                    self.end_headers()
                    return
                body = bucket.objects.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                mode = bucket.modes.get(self.path)
                etag = "0" * 32 if mode == "bad-etag" else hashlib.md5(body).hexdigest()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", f'"{etag}"')
                self.end_headers()
                if self.path in bucket.held:
                    arrived, released = bucket.held[self.path]
                    self.wfile.flush()
                    arrived.set()
                    released.wait(60)
                self.wfile.write(body[:len(body) // 2] if mode == "short" else body)
                if mode == "short":
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{self.server.server_address[1]}",
                    "AWS_ACCESS_KEY_ID": "AKTEST", "AWS_SECRET_ACCESS_KEY": "secret",
                    "AWS_REGION": "us-test-1"}

    def hold(self, key: str) -> tuple[threading.Event, threading.Event]:
        """(arrived, release): arrived is set once a GET of key has its headers; setting
        release sends the body."""
        self.held[key] = (threading.Event(), threading.Event())
        return self.held[key]

    def put_adapter(self, key_prefix: str, src: str = "a") -> None:
        for f in FILES:
            self.objects[f"/bucket/{key_prefix}/{f}"] = (adapter_dir(src) / f).read_bytes()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
