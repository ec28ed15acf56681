"""An S3-compatible bucket as an adapter source: requests signed as AWS Signature Version 4
specifies (AWS's own published example), objects fetched into the disk cache once and
served from it after, checked (length, a single-part upload's MD5 ETag) and published by
one rename, so a refused or broken download leaves nothing that is ever served; the cache
stays within its bound. The bucket here is a small S3 look-alike on loopback."""

from __future__ import annotations

import datetime
import hashlib
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from metrale.adapters.object_store import ObjectStoreError, S3Source, sign_v4
from metrale.adapters.sources import AdapterSources
from tests.helpers.peers import adapter_dir

FILES = ("adapter_config.json", "adapter_model.safetensors")


def test_signature_v4_matches_aws_published_example():
    """AWS's S3 SigV4 example: GET /test.txt on examplebucket with Range bytes=0-9."""
    header = sign_v4("GET", "examplebucket.s3.amazonaws.com", "/test.txt", {"Range": "bytes=0-9"},
                     "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                     "us-east-1", datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC))
    assert header == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


class Bucket:
    """Objects by path-style key (/bucket/key); modes per key: 'bad-etag', 'short'."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.modes: dict[str, str] = {}
        self.gets: list[str] = []
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
                self.wfile.write(body[:len(body) // 2] if mode == "short" else body)
                if mode == "short":
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{self.server.server_address[1]}",
                    "AWS_ACCESS_KEY_ID": "AKTEST", "AWS_SECRET_ACCESS_KEY": "secret",
                    "AWS_REGION": "us-test-1"}

    def put_adapter(self, key_prefix: str, src: str = "a") -> None:
        for f in FILES:
            self.objects[f"/bucket/{key_prefix}/{f}"] = (adapter_dir(src) / f).read_bytes()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def bucket():
    b = Bucket()
    yield b
    b.close()


def test_fetched_once_then_served_from_the_cache(bucket, tmp_path):
    bucket.put_adapter("team/org/a")
    source = S3Source("s3://bucket/team", tmp_path, environ=bucket.env)
    path = source.find("org/a")
    assert path == tmp_path / "s3" / "bucket" / "team" / "org" / "a"
    for f in FILES:
        assert (path / f).read_bytes() == (adapter_dir("a") / f).read_bytes()
    gets = len(bucket.gets)
    assert S3Source("s3://bucket/team", tmp_path, environ=bucket.env).find("org/a") == path
    assert len(bucket.gets) == gets  # a restart finds the cache: no request
    assert source.find("org/none") is None  # 404


@pytest.mark.parametrize("mode", ["bad-etag", "short"])
def test_a_download_that_fails_its_checks_publishes_nothing(bucket, tmp_path, mode):
    bucket.put_adapter("team/x")
    bucket.modes["/bucket/team/x/adapter_model.safetensors"] = mode
    source = S3Source("s3://bucket/team", tmp_path, environ=bucket.env)
    with pytest.raises(ObjectStoreError):
        source.find("x")
    assert not (tmp_path / "s3" / "bucket" / "team" / "x").exists()
    assert not list((tmp_path / "s3" / "bucket").glob(".download-*"))


def test_unsigned_or_wrongly_scoped_requests_are_refused_by_the_store(bucket, tmp_path):
    bucket.put_adapter("team/a")
    env = {**bucket.env, "AWS_REGION": "elsewhere-1"}
    with pytest.raises(ObjectStoreError, match="403"):
        S3Source("s3://bucket/team", tmp_path, environ=env).find("a")


def test_a_crash_mid_download_leaves_nothing_served_after_a_restart(bucket, tmp_path):
    partial = tmp_path / "s3" / "bucket" / ".download-crashed"
    partial.mkdir(parents=True)
    (partial / FILES[0]).write_text("{}")
    S3Source("s3://bucket/team", tmp_path, environ=bucket.env)
    assert not partial.exists()


def test_the_cache_keeps_to_its_bound_least_recently_used_first(bucket, tmp_path):
    for name in ("a", "b"):
        bucket.put_adapter(f"team/{name}", name)
    one = sum(len(bucket.objects[f"/bucket/team/a/{f}"]) for f in FILES)
    source = S3Source("s3://bucket/team", tmp_path, cache_bytes=one + one // 2, environ=bucket.env)
    first = source.find("a")
    second = source.find("b")
    assert second.exists() and not first.exists()


def test_sources_mix_directories_and_buckets(bucket, tmp_path, monkeypatch):
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    bucket.put_adapter("team/org/s3only", "b")
    local = tmp_path / "local"
    shutil.copytree(adapter_dir("a"), local / "org" / "a")
    sources = AdapterSources([local, "s3://bucket/team"], cache_dir=tmp_path / "cache")
    assert sources.find("org/a") == (local / "org" / "a").resolve()
    found = sources.find("org/s3only")
    assert found is not None and (found / FILES[1]).read_bytes() == \
        (adapter_dir("b") / FILES[1]).read_bytes()
    assert sources.find("org/nowhere") is None
