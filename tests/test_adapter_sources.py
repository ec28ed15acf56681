"""--adapter-source: a request naming an adapter nobody registered finds it in an allowed
directory tree (names with '/' too), is served exactly as an explicit registration is,
and never escapes the tree (no traversal, no symlink out, no file for a directory);
a name found nowhere is a 404 after one look-up, remembered as missing for a while."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale.adapters.sources import AdapterSources, DirectorySource
from metrale.config import ConfigError
from metrale.errors import AdapterOutsideRootError, InvalidNameError
from tests.helpers.peers import adapter_dir


def put(root, name, src="a"):
    (root / name).mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapter_dir(src) / f, root / name / f)
    return root / name


def test_names_resolve_inside_the_source_only(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    put(src, "org/a")
    put(outside, "b")
    (src / "escape").symlink_to(outside / "b")  # a symlink out of the source
    (src / "org" / "c").mkdir()  # a directory without adapter files
    (src / "org" / "c" / "adapter_config.json").write_text("{}")
    (src / "file").write_text("not a directory")
    sources = AdapterSources([src])
    assert sources.find("org/a").path == (src / "org" / "a").resolve()
    with pytest.raises(AdapterOutsideRootError):
        sources.find("escape")
    for name in ("org/c", "file", "org", "missing", "org/a/adapter_config.json"):
        assert sources.find(name) is None, name
    for name in ("../outside/b", "/etc", "org/../../outside/b", "org//a", "", ".", "a\x00"):
        with pytest.raises(InvalidNameError):
            sources.find(name)
    with pytest.raises(ConfigError):
        DirectorySource(tmp_path / "nope")


def test_misses_are_remembered_until_their_time_passes(tmp_path):
    now = [0.0]
    sources = AdapterSources([tmp_path], negative_ttl_s=30.0, clock=lambda: now[0])
    assert sources.find("later") is None
    put(tmp_path, "later")
    assert sources.find("later") is None  # remembered as missing: no second look-up
    now[0] = 30.0
    assert sources.find("later").path == (tmp_path / "later").resolve()


def test_later_sources_are_searched_in_order(tmp_path):
    first, second = tmp_path / "1", tmp_path / "2"
    put(second, "x")
    put(first, "y")
    sources = AdapterSources([first, second])
    assert sources.find("x").path == (second / "x").resolve()
    assert sources.find("y").path == (first / "y").resolve()


def test_a_request_registers_and_is_served_as_an_explicit_registration(tmp_path):
    from fastapi.testclient import TestClient

    from metrale import LLM
    from metrale.server.app import create_app
    from metrale.server.async_engine import AsyncEngine
    from metrale.server.settings import ServerSettings
    from tests.helpers.server import save_tokenizer
    from tests.helpers.tiny_models import make_adapter, saved_tiny_model

    base = saved_tiny_model(tmp_path / "model", seed=5, tokenizer=save_tokenizer)
    make_adapter(base, tmp_path / "src" / "org" / "a", seed=6, r=8, lora_alpha=32,
                 target_modules="all-linear")
    llm = LLM(tmp_path / "model", max_loras=2, max_lora_rank=8, max_model_len=64,
              block_size=4, num_kv_blocks=64)
    llm.register_adapter("explicit", tmp_path / "src" / "org" / "a")
    settings = ServerSettings(model_id="model", adapter_sources=(tmp_path / "src",))
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    with TestClient(create_app(AsyncEngine(llm.engine), settings)) as client:
        def complete(model):
            return client.post("/v1/completions", content=json.dumps({**body, "model": model}),
                               headers={"Content-Type": "application/json"})

        served, explicit, plain = complete("org/a"), complete("explicit"), complete("model")
        assert served.status_code == 200, served.text
        tokens = [r.json()["choices"][0]["logprobs"]["tokens"] for r in (served, explicit, plain)]
        assert tokens[0] == tokens[1] != tokens[2]  # the adapter's answer, not the base's
        assert served.json()["model"] == "org/a"
        assert complete("org/a").status_code == 200  # registered now: no second registration
        missing = complete("org/missing")
        assert missing.status_code == 404
        message = missing.json()["error"]["message"]  # says where it looked, not what to do first
        assert "no adapter source holds it" in message and "src" in message, message
        assert "register it first" not in message, message
        assert complete("../etc").status_code in (400, 404)
        names = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert "org/a" in names and "org/missing" not in names
    llm.engine.check_integrity()


class _Counting:
    """An EngineAPI's is_known and register, counted; `all_asked` is set once `waiting`
    callers have been told the name is unknown (each then joins the one registration in the
    same loop step, before the look-up's result can come back)."""

    def __init__(self, engine, waiting: int) -> None:
        import threading

        self.engine, self.waiting, self.told, self.registered = engine, waiting, 0, 0
        self.all_asked = threading.Event()

    async def is_known(self, name):
        known = await self.engine.is_known(name)
        self.told += 1
        if self.told >= self.waiting:
            self.all_asked.set()
        return known

    async def register(self, name, path, **kw):
        self.registered += 1
        return await self.engine.register(name, path, **kw)


class _HeldSources(AdapterSources):
    """Look-ups wait until every racing request has asked."""

    def __init__(self, roots, gate) -> None:
        super().__init__(roots)
        self.gate, self.finds = gate, 0

    def lookup(self, name):
        import threading
        from concurrent.futures import Future

        self.finds += 1
        out = Future()

        def run():
            try:
                assert self.gate.wait(timeout=60), "the racing requests never all asked"
                out.set_result(AdapterSources.lookup(self, name).result())
            except BaseException as e:
                out.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return out


@pytest.mark.parametrize("broken", [False, True])
def test_requests_racing_for_a_new_name_share_one_registration(tmp_path, broken):
    """Eight requests for one unregistered name: one look-up, one check of its files, one
    registration, then all served; a broken file refuses all eight with its AdapterError,
    registers nothing, and the engine serves the next request."""
    import asyncio

    from metrale import LLM
    from metrale.engine.sampling_params import SamplingParams
    from metrale.errors import AdapterError, UnknownAdapterError
    from metrale.server.async_engine import AsyncEngine
    from metrale.server.source_registration import SourceRegistrar
    from tests.helpers.tiny_models import make_adapter, saved_tiny_model

    base = saved_tiny_model(tmp_path / "model", seed=5)
    make_adapter(base, tmp_path / "src" / "org" / "a", seed=6, r=8, target_modules="all-linear")
    if broken:
        (tmp_path / "src" / "org" / "a" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    llm = LLM(tmp_path / "model", max_loras=2, max_lora_rank=8, max_model_len=64,
              block_size=4, num_kv_blocks=64)
    checks = []
    check = llm.engine.check_adapter
    llm.engine.check_adapter = lambda *a, **k: checks.append(a[0]) or check(*a, **k)
    engine = AsyncEngine(llm.engine)
    counting = _Counting(engine, waiting=8)
    registrar = SourceRegistrar(_HeldSources([tmp_path / "src"], counting.all_asked))
    params = SamplingParams(max_tokens=3, temperature=0)

    async def one(name):
        await registrar.ensure(counting, name)
        outs = [o async for o in engine.generate([1, 2, 3], params, adapter=name)]
        return list(outs[-1].token_ids)

    async def main():
        engine.start()
        try:
            results = await asyncio.gather(*(one("org/a") for _ in range(8)),
                                           return_exceptions=True)
            after = await one("org/a") if not broken else None
            base_out = list([o async for o in engine.generate([1, 2, 3], params)][-1].token_ids)
            return results, after, base_out
        finally:
            await engine.shutdown()

    results, after, base_out = asyncio.run(main())
    assert registrar.sources.finds == 1 and checks == ["org/a"] and counting.registered == 1
    assert registrar.in_flight() == 0
    if broken:
        assert all(isinstance(r, AdapterError) and not isinstance(r, UnknownAdapterError)
                   for r in results), results
        assert llm.engine.registry.get("org/a") is None
    else:
        assert all(r == results[0] for r in results) and after == results[0], results
    assert len(base_out) == 3  # the engine serves on
    llm.engine.check_integrity()


def test_a_name_being_unloaded_is_not_found_not_busy(tmp_path):
    """A completion for a name found in a source whose unload is still draining: the
    registrar's attempt to register it again meets the registry's busy refusal, which it
    leaves to admission, so the request gets the 404 every draining name gets (as
    docs/DESIGN.md says), not 409 slot_busy."""
    import asyncio

    from metrale.errors import DrainingAdapterError, SlotBusyError
    from metrale.server.errors import classify
    from metrale.server.source_registration import SourceRegistrar

    put(tmp_path, "org/a")

    class Draining:
        registered = 0

        async def is_known(self, name):
            return False  # a draining name is not known

        async def register(self, name, path, **kw):
            self.registered += 1
            raise SlotBusyError(f"adapter {name!r} is being unloaded and still serves in-flight "
                                "requests in slot 0; retry when they finish")

    engine = Draining()
    asyncio.run(SourceRegistrar(AdapterSources([tmp_path])).ensure(engine, "org/a"))
    assert engine.registered == 1
    assert classify(DrainingAdapterError("adapter 'org/a' is being unloaded"))[0] == 404
