"""Peers through the server: an adapter registered as peer://... is promoted
from a `metrale peer serve` store on first request; a second server promotes
an adapter exported by the first one's READY slot; a peer outside
--peer-allow is refused with 403 and the server keeps serving. The two servers
are shared by the module's tests."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.peers import start_store, stop
from tests.helpers.server import Reference, ServerProcess, free_port, make_world

PROMPT = "tell me about the moon"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("peer-world"))


@pytest.fixture(scope="module")
def store(world):
    """A peer store over the world's adapters (the rank-32 'bad' one is left out)."""
    import shutil

    adapters = world["adapters"].parent / "store"
    for name in ("a", "b"):
        shutil.copytree(world["adapters"] / name, adapters / name)
    proc, url = start_store("--max-lora-rank", "8", adapters=adapters, model=world["model"])
    yield url.removeprefix("http://")
    stop(proc)


def _complete(url, model):
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    return r


@pytest.fixture(scope="module")
def export_port():
    return free_port()


@pytest.fixture(scope="module")
def first(world, store, export_port, tmp_path_factory):
    """Pins a from the store at start-up and exports its READY slots on export_port."""
    with ServerProcess(["--model", str(world["model"]), "--max-loras", "2", "--max-lora-rank", "8",
                        "--adapter", f"a=peer://{store}/a", "--peer-transport", "http",
                        "--peer-export-port", str(export_port)],
                       tmp_path_factory.mktemp("peer-first") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def second(world, first, export_port, tmp_path_factory):
    """Pins x from the first server's export at start-up; peers other than 127.0.0.1
    (even other loopback addresses) are outside its allow-list."""
    with ServerProcess(["--model", str(world["model"]), "--max-loras", "2", "--max-lora-rank", "8",
                        "--peer-transport", "http", "--peer-allow", "127.0.0.1/32",
                        "--adapter", f"x=peer://127.0.0.1:{export_port}/a"],
                       tmp_path_factory.mktemp("peer-second") / "server.log") as srv:
        yield srv


def test_peer_adapters_through_the_server(world, store, first, second):
    ref = Reference(world)
    ref.register("a")
    ref.register("b")
    want_a = ref.complete(PROMPT, "a", max_tokens=8).text
    r = _complete(first.url, "a")  # pinned at start-up from the store
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want_a
    # register a peer adapter at run time; the first request promotes it
    r = httpx.post(f"{first.url}/v1/adapters", json={"name": "pb", "path": f"peer://{store}/b"},
                   timeout=30)
    assert r.status_code == 201, r.text
    r = _complete(first.url, "pb")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.complete(
        PROMPT, "b", max_tokens=8).text
    # peer landings are timed by source (the on-demand promotion of pb; the start-up
    # pin lands before the server exists)
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{first.url}/metrics", timeout=10).text)}
    counts = {s.labels["source"]: s.value for s in families["metrale_adapter_promote_seconds"].samples
              if s.name.endswith("_count")}
    assert counts.get("peer", 0) == 1
    # the second server took "a" from the first server's exported READY slot
    r = _complete(second.url, "x")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want_a


def test_peer_outside_allow_list_is_403_and_serving_goes_on(store, second):
    outside = f"127.0.0.2:{store.rsplit(':', 1)[1]}"  # the store's port, a host not allowed
    r = httpx.post(f"{second.url}/v1/adapters", json={"name": "pb", "path": f"peer://{outside}/b"},
                   timeout=30)
    # refused at registration (it could never land), before the peer is contacted
    assert r.status_code == 403 and r.json()["error"]["code"] == "peer_not_allowed"
    r = _complete(second.url, "pb")
    assert r.status_code == 404  # never registered
    assert _complete(second.url, server_model(second)).status_code == 200


def server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
