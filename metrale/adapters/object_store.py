"""An S3-compatible bucket as an adapter source (`--adapter-source s3://bucket/prefix`), on
boto3: the name `org/adapter` is the objects prefix/org/adapter/{adapter_config.json,
adapter_model.safetensors}, fetched once into a bounded disk cache that survives restarts
(download_cache.py). boto3 brings the credential chain (environment, AWS_PROFILE and the
config files, SSO, a web-identity token file, ECS and EC2 roles), region and endpoint
resolution (AWS_REGION, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL: MinIO and other stores)
and retries; our code keeps the checks and the cache policy.

A fetch is bounded by its deadline in every phase (fetch_deadline.py; s3_sender.py sends
boto3's requests through the deadline transport). Both GETs' headers come first: each
object's announced length is capped (1 MiB of config, 16 GiB of weights) and granted time
at the minimum rate; the adapter's bytes are reserved in the cache bound; then the bodies
land, checked (exactly the announced length; a single-part upload's MD5 ETag; the
object's CRC/SHA checksum where the store keeps one, which botocore verifies) into a
private directory published by one rename. A cached copy is re-validated (two HEADs) when
the name is looked up for a registration: changed ETags fetch it again.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from metrale.adapters.confined import ConfinedDir
from metrale.adapters.download_cache import ADAPTER_FILES, DownloadCache
from metrale.adapters.fetch_deadline import DEFAULT_LIMITS, Deadline, FetchLimits
from metrale.config import ConfigError
from metrale.errors import ObjectStoreError

try:  # the `sources` extra; without it an s3:// source is refused at start-up
    import boto3
    import botocore.session
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError

    from metrale.adapters.s3_sender import S3Sender
except ImportError:  # pragma: no cover - the CI installs the extra
    boto3 = None

MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 16 << 30
_CHUNK = 4 << 20
_MISSING = {"404", "NoSuchKey", "NotFound"}
SDK_ATTEMPTS = 3  # botocore's standard retry mode: throttling, 5xx, dropped connections


def require_sdk(url: str) -> None:
    if boto3 is None:
        raise ConfigError(f"adapter source {url} needs boto3: install metrale's `sources` extra "
                          "(pip install 'metrale[sources]')")


class S3Source:
    def __init__(self, url: str, cache_dir: str | Path, cache_bytes: int = 20 << 30,
                 limits: FetchLimits = DEFAULT_LIMITS, session=None) -> None:
        """session: a botocore Session (tests); by default one from the environment."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"adapter source {url!r} is not s3://bucket[/prefix]")
        require_sdk(url)
        self.url, self.bucket, self.prefix = url, parts.netloc, parts.path.strip("/")
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.workers)  # downloads in flight
        self.cache = DownloadCache(Path(cache_dir) / "s3" / self.bucket / self.prefix,
                                   cache_bytes, url)
        core = botocore.session.get_session() if session is None else session
        self.client = boto3.session.Session(botocore_session=core).client("s3", config=BotoConfig(
            connect_timeout=limits.timeout_s, read_timeout=limits.timeout_s,
            retries={"mode": "standard", "max_attempts": SDK_ATTEMPTS}))
        ca_bundle = core.get_config_variable("ca_bundle")  # AWS_CA_BUNDLE, or the profile's
        self._sender = S3Sender(ca_bundle or True)
        self.client.meta.events.register("before-send.s3", self._sender)

    def __str__(self) -> str:
        return self.url

    def find(self, name: str, revalidate: bool = True,
             clock: Callable[[], float] | None = None) -> ConfinedDir | None:
        """The adapter's cached directory, fetched first if needed (again after an eviction
        or, with revalidate, when the store's ETags changed: the path stays the same); None
        when the store has no such adapter. `name` passed the adapter-name rule. Raises
        ObjectStoreError (FetchDeadlineError past the deadline). Safe from many threads."""
        what = f"{self.url}: adapter {name!r}"
        deadline = Deadline(self.limits, what) if clock is None else Deadline(self.limits, what, clock)
        with self.cache.name_lock(name), deadline.active():
            etags = self.cache.record(name)
            if etags is None or revalidate:
                # probes (HEADs) take no download slot: a name the store lacks, or a copy
                # unchanged, is answered however many slow downloads hold the slots
                now = self._heads(name)
                if now is None:  # not in the store (any more): nor is a copy kept
                    if etags is not None:
                        self.cache.discard(name)
                    return None
                if now != etags:
                    with deadline.slot(self._slots):
                        if not self._fetch(name, deadline):
                            return None
            return ConfinedDir(self.cache.path(name), self.cache.root)

    def discard(self, name: str, found: ConfinedDir) -> None:
        """Its copy was refused for its content: the next look-up fetches it again."""
        self.cache.discard(name)

    def close(self) -> None:
        self._sender.close()

    def _key(self, name: str, file: str) -> str:
        return "/".join(p for p in (self.prefix, name, file) if p)

    def _heads(self, name: str) -> dict[str, str] | None:
        etags = {}
        for file in ADAPTER_FILES:
            reply = self._call(self.client.head_object, self._key(name, file))
            if reply is None:
                return None
            etags[file] = reply.get("ETag", "")
        return etags

    def _fetch(self, name: str, deadline: Deadline) -> bool:
        """The adapter fetched into the cache; False when the store has no such adapter."""
        replies = []
        try:
            for file, cap in zip(ADAPTER_FILES, (MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES)):
                key = self._key(name, file)
                reply = self._call(self.client.get_object, key, ChecksumMode="ENABLED")
                if reply is None:
                    return False
                replies.append((key, file, reply))
                length = reply.get("ContentLength")
                if not isinstance(length, int) or not 0 <= length <= cap:
                    raise ObjectStoreError(f"{self.url}: {key} announces {length!r} bytes "
                                           f"(at most {cap})")
                deadline.grant(length)
            total = sum(r[2]["ContentLength"] for r in replies)
            with self.cache.download(name, total, deadline.remaining) as tmp:
                for key, file, reply in replies:
                    self._receive(key, reply, tmp / file)
                self.cache.write_record(tmp, {file: r.get("ETag", "") for _, file, r in replies})
        finally:
            for _, _, reply in replies:
                reply["Body"].close()
        return True

    def _call(self, op, key: str, **kw) -> dict | None:
        """op(Bucket, Key) through boto3; None when the store has no such object."""
        try:
            return op(Bucket=self.bucket, Key=key, **kw)
        except ClientError as e:
            error = e.response.get("Error", {})
            if str(error.get("Code")) in _MISSING:
                return None
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise ObjectStoreError(f"{self.url}: {key}: HTTP {status} {error.get('Code')}: "
                                   f"{str(error.get('Message', ''))[:200]}") from None
        except BotoCoreError as e:
            raise ObjectStoreError(f"{self.url}: {key} failed: {type(e).__name__}: {e}") from None

    def _receive(self, key: str, reply: dict, dest: Path) -> None:
        """reply's body into dest, checked: exactly its announced length, a single-part
        ETag's MD5 (botocore checks a stored CRC/SHA checksum at the end)."""
        length, body = reply["ContentLength"], reply["Body"]
        md5, got = hashlib.md5(usedforsecurity=False), 0
        try:
            with open(dest, "wb") as f:
                while chunk := body.read(min(_CHUNK, length - got + 1)):
                    got += len(chunk)
                    if got > length:
                        break
                    md5.update(chunk)
                    f.write(chunk)
        except (BotoCoreError, OSError) as e:
            raise ObjectStoreError(f"{self.url}: GET {key} failed: {type(e).__name__}: {e}") from None
        if got != length:
            raise ObjectStoreError(f"{self.url}: {key}: {got} bytes of the {length} announced")
        etag = str(reply.get("ETag", "")).strip('"')
        if len(etag) == 32 and "-" not in etag and etag != md5.hexdigest():  # single-part
            raise ObjectStoreError(f"{self.url}: {key}: the bytes do not match ETag {etag}")
