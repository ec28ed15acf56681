"""An S3-compatible bucket as an adapter source, on boto3, against moto's S3 server: objects
fetched into the disk cache once and served from it after (also after a restart),
re-validated by ETag when a name is looked up for a registration, checked (length, a
single-part upload's MD5 ETag) and published by one rename, so a refused or broken
download leaves nothing that is ever served; the cache stays within its bound. The faults
no real server produces (a body cut off, a lying header, a store that holds, trickles or
falls silent) come from the look-alike in tests/helpers/bucket.py; each trickling or
silent store is cut off by the fetch deadline."""

from __future__ import annotations

import itertools
import shutil
import threading

import pytest

from metrale.adapters.fetch_deadline import FetchDeadlineError, FetchLimits
from metrale.adapters.object_store import S3Source
from metrale.adapters.sources import AdapterSources
from metrale.errors import ObjectStoreError
from tests.helpers.bucket import FILES, Bucket
from tests.helpers.moto_s3 import MotoS3
from tests.helpers.peers import adapter_dir

_buckets = itertools.count()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log") as s3:
        yield s3


@pytest.fixture
def s3(moto, monkeypatch):
    """moto's server as the environment's S3, and a fresh bucket's name."""
    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)
    name = f"bucket{next(_buckets)}"
    moto.client.create_bucket(Bucket=name)
    return moto, name


@pytest.fixture
def lookalike(monkeypatch):
    b = Bucket()
    for key, value in b.env.items():
        monkeypatch.setenv(key, value)
    yield b
    b.close()


def requests_of(source: S3Source, op: str) -> list[str]:
    """The keys `source` sends `op` (GetObject, HeadObject) for, recorded from now on."""
    sent: list[str] = []
    source.client.meta.events.register(
        f"before-call.s3.{op}", lambda params, **_: sent.append(params["url_path"]))
    return sent


def same_files(found, src: str) -> bool:
    return all((found.path / f).read_bytes() == (adapter_dir(src) / f).read_bytes() for f in FILES)


def test_fetched_once_then_served_from_the_cache_and_revalidated_by_etag(s3, tmp_path):
    moto, bucket = s3
    moto.put_adapter(bucket, "team/org/a", adapter_dir("a"))
    source = S3Source(f"s3://{bucket}/team", tmp_path)
    found = source.find("org/a")
    assert found.path == (tmp_path / "s3" / bucket / "team" / "org" / "a").resolve()
    assert found.root == (tmp_path / "s3" / bucket / "team").resolve()
    assert same_files(found, "a")
    restarted = S3Source(f"s3://{bucket}/team", tmp_path)  # the cache survives a restart
    gets, heads = requests_of(restarted, "GetObject"), requests_of(restarted, "HeadObject")
    assert restarted.find("org/a", revalidate=False) == found and not gets and not heads
    assert restarted.find("org/a") == found and not gets and len(heads) == 2  # ETags unchanged
    moto.put_adapter(bucket, "team/org/a", adapter_dir("b"))  # a new upload: new ETags
    assert restarted.find("org/a", revalidate=False) == found and not gets  # a request's refresh
    assert restarted.find("org/a") == found and len(gets) == 2  # a registration's look-up
    assert same_files(found, "b")
    assert source.find("org/none") is None  # 404
    moto.client.delete_object(Bucket=bucket, Key="team/org/a/adapter_model.safetensors")
    assert source.find("org/a") is None and not found.path.exists()  # gone from the store


@pytest.mark.parametrize("mode", ["bad-etag", "short", "long-length", "error-500", "garbage",
                                  "no-length", "redirect", "huge-length"])
@pytest.mark.parametrize("file", FILES)
def test_a_download_that_fails_its_checks_publishes_nothing(lookalike, tmp_path, mode, file):
    """Each a store's fault (ObjectStoreError: 502), within the deadline, nothing kept."""
    lookalike.put_adapter("team/x")
    lookalike.modes[f"/bucket/team/x/{file}"] = mode
    source = S3Source("s3://bucket/team", tmp_path, limits=FetchLimits(timeout_s=30))
    with pytest.raises(ObjectStoreError):
        source.find("x")
    assert not (tmp_path / "s3" / "bucket" / "team" / "x").exists()
    assert not list((tmp_path / "s3" / "bucket").glob(".download-*"))


@pytest.mark.parametrize("mode", ["trickle-headers", "trickle-body", "silent"])
@pytest.mark.parametrize("file", FILES)
def test_a_trickling_or_silent_store_is_cut_off_by_the_deadline(lookalike, tmp_path, mode, file):
    """The store would take minutes (a byte per TRICKLE_GAP_S, or nothing); the fetch is
    cut at its deadline in whichever phase it is, publishes nothing, and its thread is free:
    the same source fetches a healthy adapter right after."""
    lookalike.put_adapter("team/slow")
    lookalike.put_adapter("team/ok", "b")
    lookalike.modes[f"/bucket/team/slow/{file}"] = mode
    limits = FetchLimits(timeout_s=1.0, min_rate=1e9)
    source = S3Source("s3://bucket/team", tmp_path, limits=limits)
    with pytest.raises(FetchDeadlineError, match="deadline"):
        source.find("slow")
    assert not (source.cache.root / "slow").exists()
    assert same_files(source.find("ok"), "b")


def test_the_minimum_rate_grants_a_large_body_time_and_cuts_a_slower_one(lookalike, tmp_path):
    """A body announced at N bytes gets N / min_rate seconds beyond the timeout: a trickle
    far below that rate is cut; the same bytes arriving at full speed pass."""
    lookalike.put_adapter("team/x")
    lookalike.modes[f"/bucket/team/x/{FILES[1]}"] = "trickle-body"
    source = S3Source("s3://bucket/team", tmp_path,
                      limits=FetchLimits(timeout_s=1.0, min_rate=65536.0))
    with pytest.raises(FetchDeadlineError):
        source.find("x")
    del lookalike.modes[f"/bucket/team/x/{FILES[1]}"]
    assert same_files(source.find("x"), "a")


def test_wrong_credentials_are_refused_by_the_store(tmp_path, monkeypatch):
    with MotoS3(tmp_path / "moto.log", auth_after=2) as moto:
        iam = moto.client_with("iam", **{"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
        iam.create_user(UserName="u")
        keys = iam.create_access_key(UserName="u")["AccessKey"]
        for key, value in {**moto.env, "AWS_ACCESS_KEY_ID": keys["AccessKeyId"],
                           "AWS_SECRET_ACCESS_KEY": "wrong"}.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ObjectStoreError, match="403"):
            S3Source("s3://bucket/team", tmp_path).find("a")


def test_a_crash_mid_download_leaves_nothing_served_after_a_restart(s3, tmp_path):
    _, bucket = s3
    partial = tmp_path / "s3" / bucket / ".download-crashed"
    partial.mkdir(parents=True)
    (partial / FILES[0]).write_text("{}")
    S3Source(f"s3://{bucket}/team", tmp_path)
    assert not partial.exists()


def adapter_bytes(src: str) -> int:
    return sum((adapter_dir(src) / f).stat().st_size for f in FILES)


def cached_bytes(root) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_the_cache_keeps_to_its_bound_least_recently_used_first(s3, tmp_path):
    moto, bucket = s3
    for name in ("a", "b"):
        moto.put_adapter(bucket, f"team/{name}", adapter_dir(name))
    bound = max(adapter_bytes("a"), adapter_bytes("b")) + min(adapter_bytes("a"), adapter_bytes("b")) // 2
    source = S3Source(f"s3://{bucket}/team", tmp_path, cache_bytes=bound)
    first = source.find("a")
    second = source.find("b")
    assert second.path.exists() and not first.path.exists()
    assert source.find("a") == first  # fetched again, into the same path, b out
    assert not second.path.exists()
    assert cached_bytes(tmp_path) <= bound


def test_an_adapter_larger_than_the_whole_cache_is_refused(s3, tmp_path):
    moto, bucket = s3
    moto.put_adapter(bucket, "team/a", adapter_dir("a"))
    source = S3Source(f"s3://{bucket}/team", tmp_path, cache_bytes=adapter_bytes("a") - 1)
    with pytest.raises(ObjectStoreError, match="more than the whole disk cache"):
        source.find("a")
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_sources_mix_directories_and_buckets(s3, tmp_path):
    moto, bucket = s3
    moto.put_adapter(bucket, "team/org/s3only", adapter_dir("b"))
    local = tmp_path / "local"
    shutil.copytree(adapter_dir("a"), local / "org" / "a")
    sources = AdapterSources([local, f"s3://{bucket}/team"], cache_dir=tmp_path / "cache")
    assert sources.find("org/a").path == (local / "org" / "a").resolve()
    assert same_files(sources.find("org/s3only"), "b")
    assert sources.find("org/nowhere") is None
    assert sources.from_remote("org/s3only") and not sources.from_remote("org/a")


def test_refresh_fetches_an_evicted_copy_back_and_never_raises(lookalike, tmp_path):
    lookalike.put_adapter("team/a", "a")
    sources = AdapterSources(["s3://bucket/team"], cache_dir=tmp_path / "cache")
    found = sources.find("a")
    assert sources.refresh("a") is None  # the copy is there: nothing to fetch
    shutil.rmtree(found.path)  # the cache dropped it
    sources.refresh("a").result()
    assert same_files(found, "a")
    shutil.rmtree(found.path)
    lookalike.modes[f"/bucket/team/a/{FILES[1]}"] = "short"  # the store fails now
    sources.refresh("a").result()  # logged, not raised: a resident adapter needs no copy
    assert not found.path.exists()
    assert sources.refresh("never-found") is None  # a name no bucket gave: nothing to do


def test_a_slow_object_delays_only_its_own_name_and_is_fetched_once(lookalike, tmp_path):
    """While one adapter's body is held at the store, another is fetched and served; two
    look-ups of the held one share its single download."""
    lookalike.put_adapter("team/slow", "a")
    lookalike.put_adapter("team/fast", "b")
    held = f"/bucket/team/slow/{FILES[1]}"
    arrived, release = lookalike.hold(held)
    sources = AdapterSources(["s3://bucket/team"], cache_dir=tmp_path,
                             limits=FetchLimits(timeout_s=120))
    slow = [sources.lookup("slow"), sources.lookup("slow")]
    assert slow[0] is slow[1]  # one look-up per name
    assert arrived.wait(60)
    try:  # a fetch serialised behind the held one would still be waiting: the body never comes
        assert same_files(sources.lookup("fast").result(timeout=60), "b")
        assert not slow[0].done()
    finally:
        release.set()
    assert same_files(slow[0].result(timeout=60), "a")
    assert lookalike.gets.count(held) == 1


def test_a_fetch_waits_for_room_held_by_one_in_flight(lookalike, tmp_path):
    """The bound counts downloads in flight: with room for one adapter, a fetch that starts
    while another streams waits for it and then evicts it, so the two are never cached
    together (a fetch that ignored the other's reservation would find the cache empty,
    evict nothing, and leave both)."""
    for name in ("a", "b"):
        lookalike.put_adapter(f"team/{name}", name)
    bound = max(adapter_bytes("a"), adapter_bytes("b")) + min(adapter_bytes("a"), adapter_bytes("b")) // 2
    arrived_a, release_a = lookalike.hold(f"/bucket/team/a/{FILES[1]}")
    arrived_b, release_b = lookalike.hold(f"/bucket/team/b/{FILES[1]}")
    source = S3Source("s3://bucket/team", tmp_path, cache_bytes=bound,
                      limits=FetchLimits(timeout_s=120))
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
    assert got["a"].path == source.cache.root / "a" and got["b"].path == source.cache.root / "b"
    assert (source.cache.root / "b").exists() and not (source.cache.root / "a").exists()
    assert cached_bytes(tmp_path) <= bound


def test_a_download_waiting_its_whole_deadline_for_a_slot_is_refused_busy(lookalike, tmp_path):
    """One download slot, held: a second name is probed (it exists), waits for the slot
    until its deadline, then gets SourceBusyError without a byte downloaded; the held one
    finishes when released."""
    from metrale.errors import SourceBusyError

    lookalike.put_adapter("team/held", "a")
    lookalike.put_adapter("team/next", "b")
    arrived, release = lookalike.hold(f"/bucket/team/held/{FILES[1]}")
    sources = AdapterSources(["s3://bucket/team"], cache_dir=tmp_path,
                             limits=FetchLimits(timeout_s=1.0, min_rate=1.0, workers=1))
    held = sources.lookup("held")
    assert arrived.wait(60)
    try:
        with pytest.raises(SourceBusyError, match="download slots"):
            sources.lookup("next").result(timeout=60)
        assert not held.done()
    finally:
        release.set()
    assert same_files(held.result(timeout=60), "a")
    assert f"/bucket/team/next/{FILES[0]}" not in lookalike.gets


def test_limits_are_validated():
    from metrale.config import ConfigError

    for bad in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"min_rate": -1},
                {"min_rate": float("inf")}, {"workers": 0}, {"workers": 1.5}, {"timeout_s": True}):
        with pytest.raises(ConfigError):
            FetchLimits(**bad)
