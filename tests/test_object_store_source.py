"""An S3-compatible bucket as an adapter source: requests signed as AWS Signature Version 4
specifies (AWS's own published example), objects fetched into the disk cache once and
served from it after, checked (length, a single-part upload's MD5 ETag) and published by
one rename, so a refused or broken download leaves nothing that is ever served; the cache
stays within its bound. The bucket here is a small S3 look-alike on loopback."""

from __future__ import annotations

import datetime
import shutil
import threading

import pytest

from metrale.adapters.object_store import ObjectStoreError, S3Source, sign_v4
from metrale.adapters.sources import AdapterSources
from tests.helpers.bucket import FILES, Bucket
from tests.helpers.peers import adapter_dir


def test_signature_v4_matches_aws_published_example():
    """AWS's S3 SigV4 example: GET /test.txt on examplebucket with Range bytes=0-9."""
    header = sign_v4("GET", "examplebucket.s3.amazonaws.com", "/test.txt", {"Range": "bytes=0-9"},
                     "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                     "us-east-1", datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC))
    assert header == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


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
    a, b = (sum(len(bucket.objects[f"/bucket/team/{n}/{f}"]) for f in FILES) for n in "ab")
    bound = max(a, b) + min(a, b) // 2  # either fits, both do not
    source = S3Source("s3://bucket/team", tmp_path, cache_bytes=bound, environ=bucket.env)
    first = source.find("a")
    second = source.find("b")
    assert second.exists() and not first.exists()
    assert source.find("a") == first  # fetched again, into the same path, b out
    assert not second.exists()


def test_an_adapter_larger_than_the_whole_cache_is_refused(bucket, tmp_path):
    bucket.put_adapter("team/a", "a")
    one = sum(len(bucket.objects[f"/bucket/team/a/{f}"]) for f in FILES)
    source = S3Source("s3://bucket/team", tmp_path, cache_bytes=one - 1, environ=bucket.env)
    with pytest.raises(ObjectStoreError, match="more than the whole disk cache"):
        source.find("a")
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_sources_mix_directories_and_buckets(bucket, tmp_path, monkeypatch):
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    bucket.put_adapter("team/org/s3only", "b")
    local = tmp_path / "local"
    shutil.copytree(adapter_dir("a"), local / "org" / "a")
    sources = AdapterSources([local, "s3://bucket/team"], cache_dir=tmp_path / "cache")
    assert sources.find("org/a").path == (local / "org" / "a").resolve()
    found = sources.find("org/s3only").path
    assert found is not None and (found / FILES[1]).read_bytes() == \
        (adapter_dir("b") / FILES[1]).read_bytes()
    assert sources.find("org/nowhere") is None


def test_refresh_fetches_an_evicted_copy_back_and_never_raises(bucket, tmp_path, monkeypatch):
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    bucket.put_adapter("team/a", "a")
    sources = AdapterSources(["s3://bucket/team"], cache_dir=tmp_path / "cache")
    path = sources.find("a").path
    assert sources.from_bucket("a") and not sources.from_bucket("never-found")
    shutil.rmtree(path)  # the cache dropped it
    sources.refresh("a")
    assert (path / FILES[1]).read_bytes() == (adapter_dir("a") / FILES[1]).read_bytes()
    shutil.rmtree(path)
    bucket.modes[f"/bucket/team/a/{FILES[1]}"] = "short"  # the store fails now
    sources.refresh("a")  # logged, not raised: a resident adapter needs no copy
    assert not path.exists()
    sources.refresh("never-found")  # a name no bucket gave: nothing to do


def test_a_slow_object_delays_only_its_own_name_and_is_fetched_once(bucket, tmp_path):
    """While one adapter's body is held at the store, another is fetched and served; two
    requests for the held one share its single download."""
    bucket.put_adapter("team/slow", "a")
    bucket.put_adapter("team/fast", "b")
    held = f"/bucket/team/slow/{FILES[1]}"
    arrived, release = bucket.hold(held)
    source = S3Source("s3://bucket/team", tmp_path, environ=bucket.env)
    got = {}
    askers = [threading.Thread(target=lambda i=i: got.__setitem__(i, source.find("slow")))
              for i in range(2)]
    for t in askers:
        t.start()
    assert arrived.wait(60)
    fast = threading.Thread(target=lambda: got.__setitem__("fast", source.find("fast")))
    fast.start()
    try:  # a fetch serialised behind the held one would still be waiting: the body never comes
        fast.join(60)
        assert got.get("fast") == source.cache / "fast"
    finally:
        release.set()
    for t in askers:
        t.join(60)
    assert got[0] == got[1] == source.cache / "slow"
    assert bucket.gets.count(held) == 1


def test_a_fetch_waits_for_room_held_by_one_in_flight(bucket, tmp_path):
    """The bound counts downloads in flight: with room for one adapter, a fetch that starts
    while another streams waits for it and then evicts it, so the two are never cached
    together (a fetch that ignored the other's reservation would find the cache empty,
    evict nothing, and leave both)."""
    for name in ("a", "b"):
        bucket.put_adapter(f"team/{name}", name)
    a, b = (sum(len(bucket.objects[f"/bucket/team/{n}/{f}"]) for f in FILES) for n in "ab")
    bound = max(a, b) + min(a, b) // 2  # either fits, both do not
    arrived_a, release_a = bucket.hold(f"/bucket/team/a/{FILES[1]}")
    arrived_b, release_b = bucket.hold(f"/bucket/team/b/{FILES[1]}")
    source = S3Source("s3://bucket/team", tmp_path, cache_bytes=bound, environ=bucket.env)
    got = {}
    first = threading.Thread(target=lambda: got.__setitem__("a", source.find("a")))
    second = threading.Thread(target=lambda: got.__setitem__("b", source.find("b")))
    try:
        first.start()
        assert arrived_a.wait(60)  # a's bytes reserved, its body held
        second.start()
        assert arrived_b.wait(60)  # b has both headers: it reserves next
    finally:
        release_a.set()
        first.join(60)
        release_b.set()
        second.join(60)
    assert got["a"] == source.cache / "a" and got["b"] == source.cache / "b"
    assert (source.cache / "b").exists() and not (source.cache / "a").exists()
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= bound
