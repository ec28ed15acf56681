"""A slow store delays only its own names: with eight fetches from one bucket held at the
store (four in its download slots, four waiting for one), a registered adapter from
that same bucket, an admin registration of a directory and a name from another bucket are
all answered while the eight are provably still in flight; then the eight are released
and served. Nothing here is timed: the store holds each body until the test says so."""

from __future__ import annotations

import shutil
import threading

import pytest
from fastapi.testclient import TestClient

from metrale.cli import build_parser
from metrale.config import ModelConfig
from metrale.server.serve import build_app
from tests.helpers.bucket import FILES, Bucket
from tests.helpers.peers import adapter_dir, peer_root
from tests.helpers.server import save_tokenizer

SLOW = [f"s{i}" for i in range(8)]


@pytest.fixture
def world(tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(peer_root()[0] / "model", model)
    save_tokenizer(model, ModelConfig.from_dir(model).vocab_size)
    shutil.copytree(adapter_dir("c"), tmp_path / "root" / "disk")
    bucket = Bucket()
    for key, value in bucket.env.items():
        monkeypatch.setenv(key, value)
    bucket.put_adapter("p/ready", "a", bucket="slow")
    for name in SLOW:
        bucket.put_adapter(f"p/{name}", "b", bucket="slow")
    bucket.put_adapter("p/org/fast", "c", bucket="fast")
    holds = [bucket.hold(f"/slow/p/{name}/{FILES[1]}") for name in SLOW]
    yield model, tmp_path, bucket, holds
    bucket.close()


def complete(client: TestClient, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": [3, 14, 15, 92],
                                                "max_tokens": 2, "temperature": 0})


def test_eight_slow_fetches_delay_no_registered_adapter_admin_call_or_other_bucket(world):
    model, tmp, bucket, holds = world
    args = build_parser().parse_args([
        "serve", "--model", str(model), "--max-loras", "2", "--max-lora-rank", "8",
        "--max-model-len", "64", "--num-kv-blocks", "64",
        "--adapter-source", "s3://slow/p", "--adapter-source", "s3://fast/p",
        "--adapter-cache-dir", str(tmp / "cache"), "--adapter-root", str(tmp / "root"),
        "--adapter-fetch-workers", "4", "--adapter-fetch-timeout", "300"])
    with TestClient(build_app(args)[0]) as client:
        assert complete(client, "ready").status_code == 200  # registered from the slow bucket
        replies: dict[str, object] = {}
        slow = [threading.Thread(target=lambda n=n: replies.__setitem__(n, complete(client, n)))
                for n in SLOW]
        for t in slow:
            t.start()
        try:
            # four in the source's download slots now, held at the store; the others wait
            assert bucket.wait_held(4, 120), "the four download slots never all held"
            assert sum(a.is_set() for a, _ in holds) == 4
            others = {  # the other bucket is searched after the slow one: probed there first
                "registered adapter, same bucket": complete(client, "ready"),
                "admin registration": client.post("/v1/adapters", json={"name": "disk", "path": "disk"}),
                "another bucket's name": complete(client, "org/fast"),
            }
            assert {k: r.status_code for k, r in others.items()} == {
                "registered adapter, same bucket": 200, "admin registration": 201,
                "another bucket's name": 200}, {k: r.text for k, r in others.items()}
            assert not replies and all(t.is_alive() for t in slow)  # the eight: still in flight
        finally:
            for _, release in holds:
                release.set()
        for t in slow:
            t.join(120)
    assert {n: r.status_code for n, r in replies.items()} == dict.fromkeys(SLOW, 200)
