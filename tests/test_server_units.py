"""Server pieces in-process, no server process: the adapter-path jail, the
loopback rule for admin endpoints, log quoting, and the AsyncEngine's thread
(no busy-spinning when idle, aborts on a dropped iterator, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from metrale import LLM, SamplingParams
from metrale.cli import build_parser
from metrale.errors import UnknownAdapterError
from metrale.server.app import create_app
from metrale.server.async_engine import AsyncEngine
from metrale.server.errors import AdapterPathError, BadRequestError, EngineUnavailableError
from metrale.server.metrics import ServerMetrics, kv
from metrale.server.paths import resolve_adapter_path
from metrale.server.serve import build_app, curl_example
from metrale.server.settings import ServerSettings, is_loopback
from tests.helpers.process import Bound
from tests.helpers.tiny_models import make_adapter, saved_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("units")
    base = saved_tiny_model(root / "model", seed=5)
    make_adapter(base, root / "jail" / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    make_adapter(base, root / "outside", seed=2, r=4, lora_alpha=8, target_modules="all-linear")
    return root


# --- the adapter-path jail ----------------------------------------------------------------


def test_paths_inside_the_root_only(tiny, tmp_path):
    jail = (tiny / "jail").resolve()
    roots = (jail,)
    assert resolve_adapter_path("a", roots).path == jail / "a"
    assert resolve_adapter_path(str(jail / "a"), roots).path == jail / "a"
    assert resolve_adapter_path("a", roots).root == jail  # every landing stays inside it
    link = tmp_path / "link"
    link.symlink_to(tiny / "outside", target_is_directory=True)
    refusals = [
        ("../outside", BadRequestError, "'..'"),
        ("a/../a", BadRequestError, "'..'"),
        (str(tiny / "outside"), AdapterPathError, "outside"),
        (str(link), AdapterPathError, "outside"),
        ("/dev/null", AdapterPathError, "outside"),
        ("missing", BadRequestError, "does not exist"),
        ("a/adapter_config.json", BadRequestError, "not a directory"),
        ("a\x00b", BadRequestError, "non-empty"),
        (None, BadRequestError, "non-empty"),
    ]
    for raw, error, words in refusals:
        with pytest.raises(error, match=words):
            resolve_adapter_path(raw, roots)
    with pytest.raises(AdapterPathError, match="--adapter-root"):
        resolve_adapter_path("a", ())


def test_symlinked_weights_must_stay_inside(tiny, tmp_path):
    root = tmp_path / "root"
    (root / "x").mkdir(parents=True)
    (root / "x" / "adapter_config.json").write_text("{}")
    (root / "x" / "adapter_model.safetensors").symlink_to(tiny / "outside" / "adapter_model.safetensors")
    with pytest.raises(AdapterPathError, match="outside"):
        resolve_adapter_path("x", (root.resolve(),))
    os.mkfifo(root / "fifo_file")
    (root / "y").mkdir()
    (root / "y" / "adapter_model.safetensors").symlink_to(root / "fifo_file")
    with pytest.raises(BadRequestError, match="regular file"):
        resolve_adapter_path("y", (root.resolve(),))


def test_loopback_rule():
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback(host), host


def test_exposed_server_without_admin_key_disables_mutations():
    async def ready() -> None:
        return None

    stub = SimpleNamespace(metrics=ServerMetrics(), alive=True, starting=ready)
    app = create_app(stub, ServerSettings(model_id="m", host="0.0.0.0", api_key="k"))
    client = TestClient(app)  # no `with`: the lifespan (engine thread) is not started
    for key in ("k", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = client.post("/v1/adapters/a/promote", headers=headers)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert client.get("/v1/lora/active").status_code == 401  # reads still need the API key


def test_log_values_cannot_forge_fields():
    assert kv(event="swap", adapter="a.b-c", slot=1, evicted=None) == \
        "event=swap adapter=a.b-c slot=1 evicted=null"
    assert kv(adapter="x result=ok\nevent=fake") == 'adapter="x result=ok\\nevent=fake"'


def test_curl_example_is_pasteable():
    cmd = curl_example("http://127.0.0.1:8000", "shout", "k", key_from_env=True)
    assert cmd.startswith("curl http://127.0.0.1:8000/v1/chat/completions")
    assert '"model": "shout"' in cmd and "Bearer $METRALE_API_KEY" in cmd


def test_no_runtime_swaps_lands_startup_adapters_then_freezes(tiny):
    args = build_parser().parse_args([
        "serve", "--model", str(tiny / "model"), "--adapter", f"a={tiny / 'jail' / 'a'}",
        "--adapter-root", str(tiny / "jail"), "--no-runtime-swaps", "--max-loras", "2",
        "--max-lora-rank", "8", "--max-model-len", "256", "--num-kv-blocks", "64"])
    app, settings, names = build_app(args)
    assert names == ["a"] and settings.model_id == "model"
    with TestClient(app) as client:  # runs the lifespan: engine thread up, then shut down
        r = client.post("/v1/completions", json={"model": "a", "prompt": [1, 2, 3],
                                                 "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert client.get("/v1/adapters").json()["adapters"][0]["pinned"] is True
        for path, body in (("/v1/adapters", {"name": "b", "path": "a"}),
                           ("/v1/adapters/a/swap", {"slot": 1}),
                           ("/v1/lora/load", {"name": "b", "path": "a", "slot": 1})):
            r = client.post(path, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "runtime_swaps_disabled"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


# --- AsyncEngine --------------------------------------------------------------------------


@pytest.fixture
def async_engine(tiny):
    llm = LLM(tiny / "model", max_loras=1, max_lora_rank=8, max_model_len=256, block_size=4,
              num_kv_blocks=256)
    llm.register_adapter("a", tiny / "jail" / "a")
    engine = AsyncEngine(llm.engine)
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    engine.steps = steps
    engine.start()
    yield engine
    if engine.alive:
        asyncio.run(engine.shutdown(drain_timeout_s=0))


LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def test_idle_engine_thread_sleeps(async_engine):
    time.sleep(0.3)
    before = len(async_engine.steps)
    time.sleep(0.5)
    assert len(async_engine.steps) - before <= 1  # woken only by calls, never spinning


def test_outputs_errors_and_abort_on_dropped_iterator(async_engine):
    table = async_engine.engine.lora.table

    async def scenario():
        outs = [o async for o in async_engine.generate([5, 6, 7], SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True), "a")]
        assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4] and outs[-1].finished
        with pytest.raises(UnknownAdapterError):
            async for _ in async_engine.generate([5, 6], LONG, "nope"):
                pass
        gen = async_engine.generate([5, 6, 7], LONG, "a")
        await anext(gen)
        assert table.ref_count(async_engine.engine.registry.slot_of("a")) == 1
        await gen.aclose()  # the client went away
        bound = Bound(10.0)  # only a hung engine thread reaches it, the load stretches it
        while async_engine.engine.has_unfinished_requests() and not bound.expired():
            await asyncio.sleep(0.01)
        assert table.ref_count(async_engine.engine.registry.slot_of("a")) == 0

    asyncio.run(scenario())


def test_shutdown_fails_running_streams_and_refuses_new_work(async_engine):
    async def scenario():
        gen = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=250, temperature=0,
                                                              ignore_eos=True))
        await anext(gen)
        await async_engine.shutdown(drain_timeout_s=0)
        with pytest.raises(EngineUnavailableError):
            async for _ in gen:
                pass
        assert not async_engine.alive and not async_engine.engine.has_unfinished_requests()
        with pytest.raises(EngineUnavailableError):
            await async_engine.residency()
        with pytest.raises(EngineUnavailableError), contextlib.suppress(StopAsyncIteration):
            await anext(async_engine.generate([1], LONG))

    asyncio.run(scenario())


# --- vLLM's extra routes: /version, /tokenize, /detokenize, HEAD, /reset_prefix_cache ------

USER_KEY, ADMIN_KEY = "user-key", "admin-key"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def vllm_client(tiny, tmp_path_factory):
    from tests.helpers.server import save_tokenizer

    model = tmp_path_factory.mktemp("vllm") / "model"
    saved_tiny_model(model, seed=5, tokenizer=save_tokenizer)
    args = build_parser().parse_args([
        "serve", "--model", str(model), "--adapter", f"a={tiny / 'jail' / 'a'}",
        "--max-loras", "1", "--max-lora-rank", "8", "--max-model-len", "256",
        "--num-kv-blocks", "64", "--api-key", USER_KEY, "--admin-key", ADMIN_KEY])
    app, _, _ = build_app(args)
    with TestClient(app) as client:
        yield client


def _complete(client, **body) -> dict:
    r = client.post("/v1/completions", headers=USER,
                    json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_response_model_names_the_adapter_that_served(vllm_client):
    assert _complete(vllm_client)["model"] == "model"
    assert _complete(vllm_client, model="base:a")["model"] == "a"
    r = vllm_client.post("/v1/lora/active", headers=ADMIN, json={"adapter": "a"})
    assert r.status_code == 200
    try:
        assert _complete(vllm_client)["model"] == "a"
        assert _complete(vllm_client, model="model")["model"] == "a"  # the default adapter
        assert _complete(vllm_client, adapter=None)["model"] == "model"
        r = vllm_client.post("/v1/chat/completions", headers=USER, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert r.json()["model"] == "a"
    finally:
        vllm_client.post("/v1/lora/active", headers=ADMIN, json={"adapter": None})


def test_version(vllm_client):
    import metrale

    r = vllm_client.get("/version", headers=USER)
    assert r.status_code == 200 and r.json() == {"version": metrale.__version__}


def test_tokenize_and_detokenize(vllm_client):
    r = vllm_client.post("/tokenize", headers=USER, json={"model": "a", "prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == 2 and body["max_model_len"] == 256
    r = vllm_client.post("/detokenize", headers=USER, json={"model": "a", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
    messages = [{"role": "user", "content": "hello"}]
    r = vllm_client.post("/tokenize", headers=USER, json={"model": "model", "messages": messages})
    chat = vllm_client.post("/v1/chat/completions", headers=USER,
                            json={"messages": messages, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]  # what chat bills
    for path, body, status in (("/tokenize", {"model": "nope", "prompt": "x"}, 404),
                               ("/tokenize", {"prompt": "x", "messages": messages}, 400),
                               ("/tokenize", {}, 400),
                               ("/detokenize", {"tokens": [-1]}, 400)):
        assert vllm_client.post(path, headers=USER, json=body).status_code == status


def test_new_routes_need_the_api_key(vllm_client):
    for method, path in (("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("HEAD", "/v1/models"), ("HEAD", "/metrics")):
        assert vllm_client.request(method, path, json={}).status_code == 401, path
    assert vllm_client.head("/health").status_code == 200
    r = vllm_client.post("/reset_prefix_cache", headers=USER)
    assert r.status_code == 403  # a mutation: the admin key only


def test_head_answers_every_get_route(vllm_client):
    for path in ("/health", "/metrics", "/v1/models", "/version", "/v1/adapters"):
        r = vllm_client.head(path, headers=USER)
        assert r.status_code == 200 and r.content == b"", path
        assert int(r.headers["content-length"]) == len(vllm_client.get(path, headers=USER).content) \
            or path == "/metrics"  # metrics move between the two calls


def test_reset_prefix_cache_route(vllm_client):
    prompt = list(range(10, 60))  # three full blocks of 16
    first = _complete(vllm_client, prompt=prompt)
    second = _complete(vllm_client, prompt=prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = vllm_client.post("/reset_prefix_cache", headers=ADMIN)
    assert r.status_code == 200 and r.json()["dropped_blocks"] > 0
    third = _complete(vllm_client, prompt=prompt)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    texts = {c["choices"][0]["text"] for c in (first, second, third)}
    tokens = {c["usage"]["completion_tokens"] for c in (first, second, third)}
    assert len(texts) == 1 and tokens == {2}


def test_min_tokens_in_request_bodies(vllm_client):
    out = _complete(vllm_client, max_tokens=4, min_tokens=4)
    assert out["usage"]["completion_tokens"] == 4
    r = vllm_client.post("/v1/completions", headers=USER,
                         json={"prompt": [1, 2], "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = vllm_client.post("/v1/chat/completions", headers=USER, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "min_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_default_run_gets_an_adapter_root_created_in_the_cache(tmp_path, monkeypatch):
    from metrale.server.serve import default_adapter_root

    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    root = default_adapter_root()
    assert root == tmp_path / "cache" / "adapter-root" and root.is_dir()
