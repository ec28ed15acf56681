"""An S3-compatible bucket as an adapter source (`--adapter-source s3://bucket/prefix`):
the name `org/adapter` is the objects prefix/org/adapter/{adapter_config.json,
adapter_model.safetensors}, fetched once into a bounded (LRU) disk cache that survives
restarts. Settings come from the usual AWS variables (AWS_ENDPOINT_URL[_S3]: MinIO and
other stores, path-style); requests are signed with AWS Signature Version 4.

A download is checked (Content-Length bytes; a single-part ETag's MD5) in a private temp
dir and published by one rename: a crash or a refused download leaves nothing served.
Fetches of different names run at once (a slow object delays only its own requests); one
name is fetched once however many ask, and the bytes every fetch announced are reserved
in the bound before they land, so the cache never holds more than it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path
from urllib.parse import quote, urlsplit

from metrale.adapters.identity import CONFIG_FILE, WEIGHTS_FILE
from metrale.config import ConfigError
from metrale.errors import PeerUnavailableError

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 16 << 30
TIMEOUT_S = 30.0
_CHUNK = 4 << 20
_NAME_LOCKS = 64  # fetches of names that share a stripe wait for each other
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def holds_adapter(path: Path) -> bool:
    return all((path / f).is_file() for f in ADAPTER_FILES)


class ObjectStoreError(PeerUnavailableError):
    """The object store (an upstream, as a peer is: 502) refused a request, broke off a
    download or sent bytes that fail their checks; nothing was published to the cache."""


def sign_v4(method: str, host: str, path: str, headers: dict[str, str], access_key: str,
            secret_key: str, region: str, now: datetime.datetime) -> str:
    """The Authorization header of a bodiless S3 request (GET), signing host, x-amz-date,
    x-amz-content-sha256 and `headers`."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    signed = {"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": _EMPTY_SHA256,
              **{k.lower(): v.strip() for k, v in headers.items()}}
    names = ";".join(sorted(signed))
    canonical = "\n".join([method, quote(path, safe="/-_.~"), "",
                           *(f"{k}:{signed[k]}" for k in sorted(signed)), "", names,
                           _EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"AWS4-HMAC-SHA256 Credential={access_key}/{scope},SignedHeaders={names},Signature={signature}"


class S3Source:
    def __init__(self, url: str, cache_dir: str | Path, cache_bytes: int = 20 << 30,
                 environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"adapter source {url!r} is not s3://bucket[/prefix]")
        self.url, self.bucket, self.prefix = url, parts.netloc, parts.path.strip("/")
        self.region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:  # path-style: endpoint/bucket/key
            ep = urlsplit(endpoint)
            self.https, self.host, self.base = ep.scheme == "https", ep.netloc, f"/{self.bucket}"
        else:  # virtual-hosted: bucket.s3.region.amazonaws.com/key
            self.https, self.base = True, ""
            self.host = f"{self.bucket}.s3.{self.region}.amazonaws.com"
        self.access_key = env.get("AWS_ACCESS_KEY_ID")
        self.secret_key = env.get("AWS_SECRET_ACCESS_KEY")
        self.session_token = env.get("AWS_SESSION_TOKEN")
        self.cache = Path(cache_dir) / "s3" / self.bucket / self.prefix
        self.cache.mkdir(parents=True, exist_ok=True)
        self.cache = self.cache.resolve()  # the confinement root of every copy's reads
        self.cache_root = self.cache
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()  # the cache's directories and _reserved
        self._room = threading.Condition(self._lock)  # signalled when a reservation ends
        self._reserved = 0  # bytes announced by fetches in flight
        self._name_locks = [threading.Lock() for _ in range(_NAME_LOCKS)]
        for stale in self.cache.parent.glob(".download-*"):  # a crash mid-download
            shutil.rmtree(stale, ignore_errors=True)

    def __str__(self) -> str:
        return self.url

    def find(self, name: str) -> Path | None:
        """The adapter's cached directory, fetched first if needed (again after an eviction:
        the path stays the same); None when the store has no such adapter. `name` passed the
        adapter-name rule. Safe from many threads."""
        final = self.cache / name
        with self._name_locks[zlib.crc32(name.encode()) % _NAME_LOCKS]:
            with self._lock:
                if holds_adapter(final):
                    os.utime(final)  # recency, for eviction
                    return final
            conns, reserved, tmp = [], 0, None
            try:
                replies = []
                for file, cap in zip(ADAPTER_FILES, (MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES)):
                    key = "/".join(p for p in (self.prefix, name, file) if p)
                    conn, reply, length = self._get(key, cap)
                    conns.append(conn)
                    if reply is None:
                        return None
                    replies.append((key, file, reply, length))
                # room for the whole adapter before its bytes land: never past the bound
                reserved = self._reserve(sum(r[3] for r in replies), name)
                tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=self.cache.parent))
                for key, file, reply, length in replies:
                    self._receive(key, reply, length, tmp / file)
                with self._lock:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(final, ignore_errors=True)  # a partial copy left by hand
                    tmp.rename(final)  # the one step that publishes
            finally:
                for conn in conns:
                    conn.close()
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                if reserved:
                    with self._room:
                        self._reserved -= reserved
                        self._room.notify_all()
            return final

    def _get(self, key: str, cap: int):
        """(connection, reply, announced bytes) of a GET, its body unread; reply None on 404."""
        path = f"{self.base}/{key}"
        headers = {"x-amz-security-token": self.session_token} if self.session_token else {}
        conn_cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = conn_cls(self.host, timeout=TIMEOUT_S)
        try:
            send = {"x-amz-content-sha256": _EMPTY_SHA256, **headers}
            if self.access_key and self.secret_key:
                now = datetime.datetime.now(datetime.UTC)
                send["x-amz-date"] = now.strftime("%Y%m%dT%H%M%SZ")
                send["Authorization"] = sign_v4("GET", self.host, path, headers, self.access_key,
                                                self.secret_key, self.region, now)
            conn.request("GET", quote(path, safe="/-_.~"), headers=send)
            reply = conn.getresponse()
            if reply.status == 404:
                return conn, None, 0
            if reply.status != 200:
                raise ObjectStoreError(f"{self.url}: GET {key}: HTTP {reply.status} "
                                       f"{reply.read(512)!r}")
            announced = reply.getheader("Content-Length")
            if announced is None or not announced.isdigit() or int(announced) > cap:
                raise ObjectStoreError(f"{self.url}: {key} announces {announced!r} bytes "
                                       f"(at most {cap})")
            return conn, reply, int(announced)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise ObjectStoreError(f"{self.url}: GET {key} failed: {type(e).__name__}: {e}") from None
        except ObjectStoreError:
            conn.close()
            raise

    def _receive(self, key: str, reply, length: int, dest: Path) -> None:
        """reply's body into dest, checked: exactly `length` bytes, a single-part ETag's MD5."""
        md5, got = hashlib.md5(usedforsecurity=False), 0
        try:
            with open(dest, "wb") as f:
                while chunk := reply.read(min(_CHUNK, length - got + 1)):
                    got += len(chunk)
                    if got > length:
                        break
                    md5.update(chunk)
                    f.write(chunk)
        except (OSError, http.client.HTTPException) as e:
            raise ObjectStoreError(f"{self.url}: GET {key} failed: {type(e).__name__}: {e}") from None
        if got != length:
            raise ObjectStoreError(f"{self.url}: {key}: {got} bytes of the {length} announced")
        etag = (reply.getheader("ETag") or "").strip('"')
        if len(etag) == 32 and "-" not in etag and etag != md5.hexdigest():  # single-part
            raise ObjectStoreError(f"{self.url}: {key}: the bytes do not match ETag {etag}")

    def _reserve(self, incoming: int, name: str) -> int:
        """Least recently used adapters out until `incoming` more bytes fit the bound beside
        the cached ones and the other fetches' reservations (waiting for those to end when
        they are what is in the way); then reserve them. Returns incoming."""
        if incoming > self.cache_bytes:
            raise ObjectStoreError(f"{self.url}: adapter {name!r} needs {incoming} bytes, more "
                                   f"than the whole disk cache ({self.cache_bytes}, "
                                   "--adapter-cache-bytes)")
        with self._room:  # a waiter holds no reservation: whoever it waits for can finish
            while True:
                dirs = [p.parent for p in self.cache.rglob(ADAPTER_FILES[1])]
                sizes = {d: _bytes_in(d) for d in dirs}
                total = sum(sizes.values()) + self._reserved + incoming
                for d in sorted(dirs, key=lambda d: d.stat().st_mtime):
                    if total <= self.cache_bytes:
                        break
                    shutil.rmtree(d, ignore_errors=True)
                    total -= sizes[d]
                if total <= self.cache_bytes:
                    self._reserved += incoming
                    return incoming
                self._room.wait()


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())
