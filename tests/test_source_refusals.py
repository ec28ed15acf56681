"""A copy from a bucket refused for its content does not stay refused once the store is
fixed: it is dropped from the disk cache (the cache survives restarts, so a kept copy
would be served until evicted); for a short while the refusal answers at once without
asking the store, then the next request fetches the object again. A refusal at the
landing (weights only a landing reads) drops the copy too. Against moto's S3 server; the
refusal memory's clock is the test's."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from metrale import LLM
from metrale.adapters.sources import AdapterSources
from metrale.server.app import create_app
from metrale.server.async_engine import AsyncEngine
from metrale.server.settings import ServerSettings
from metrale.server.source_registration import SourceRegistrar
from tests.helpers.moto_s3 import FILES, MotoS3
from tests.helpers.peers import adapter_dir, peer_root
from tests.helpers.pool import snapshot


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log") as s3:
        s3.client.create_bucket(Bucket="bucket")
        yield s3


@pytest.fixture
def served(moto, tmp_path, monkeypatch):
    """(client, the clock of the sources' memories, the sources, the engine's slots)."""
    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)
    now = [0.0]
    llm = LLM(peer_root()[0] / "model", max_loras=2, max_lora_rank=8, max_model_len=64,
              block_size=4, num_kv_blocks=64)
    settings = ServerSettings(model_id="model")
    settings.sources = AdapterSources([f"s3://bucket/{tmp_path.name}"], clock=lambda: now[0],
                                      cache_dir=tmp_path / "cache")
    settings.registrar = SourceRegistrar(settings.sources)
    with TestClient(create_app(AsyncEngine(llm.engine), settings)) as client:
        yield client, now, settings.sources, llm.engine.lora, tmp_path.name


def complete(client, model):
    return client.post("/v1/completions", json={"model": model, "prompt": [3, 14, 15, 92],
                                                "max_tokens": 3, "temperature": 0})


def gets_of(sources: AdapterSources) -> list[str]:
    sent: list[str] = []
    sources.sources[0].client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: sent.append(params["url_path"]))
    return sent


def test_a_copy_refused_at_registration_is_dropped_and_fetched_again_once_fixed(moto, served):
    client, now, sources, slots, prefix = served
    moto.put_adapter("bucket", f"{prefix}/x", adapter_dir("a"))
    moto.client.put_object(Bucket="bucket", Key=f"{prefix}/x/{FILES[0]}",
                           Body=json.dumps({"peft_type": "LORA", "r": "four"}).encode())
    copy = sources.sources[0].cache.path("x")
    gets = gets_of(sources)
    before = snapshot(slots)
    refused = complete(client, "x")
    assert refused.status_code == 422, refused.text
    assert not copy.exists()  # dropped: a restart would not serve it
    fetched = len(gets)
    assert complete(client, "x").status_code == 422  # remembered: the store is not asked
    assert len(gets) == fetched
    moto.put_adapter("bucket", f"{prefix}/x", adapter_dir("a"))  # the store is fixed
    assert complete(client, "x").status_code == 422  # still within the memory
    now[0] += 60
    served_now = complete(client, "x")
    assert served_now.status_code == 200, served_now.text
    assert len(gets) > fetched and copy.exists()
    assert snapshot(slots) != before  # it landed


def test_a_copy_refused_at_its_landing_is_dropped_and_fetched_again_once_fixed(moto, served):
    """Weights that only a landing checks (NaN): the registration passes, the landing
    refuses (422), the copy is dropped; after an unload the fixed object is fetched and
    served."""
    from safetensors.torch import load_file, save_file

    client, _, sources, slots, prefix = served
    weights = load_file(adapter_dir("a") / FILES[1])
    first = sorted(weights)[0]
    weights[first] = weights[first].clone()
    weights[first][0, 0] = float("nan")
    bad = sources.sources[0].cache.root.parent / "bad.safetensors"
    save_file(weights, str(bad))
    moto.put_adapter("bucket", f"{prefix}/y", adapter_dir("a"))
    moto.client.put_object(Bucket="bucket", Key=f"{prefix}/y/{FILES[1]}", Body=bad.read_bytes())
    before = snapshot(slots)
    refused = complete(client, "y")
    assert refused.status_code == 422, refused.text
    assert snapshot(slots) == before  # refused before a slot was touched
    assert not sources.sources[0].cache.path("y").exists()
    moto.put_adapter("bucket", f"{prefix}/y", adapter_dir("a"))  # fixed
    assert client.delete("/v1/adapters/y").status_code == 200
    reply = complete(client, "y")
    assert reply.status_code == 200, reply.text
