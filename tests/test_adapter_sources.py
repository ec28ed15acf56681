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
from metrale.errors import InvalidNameError
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
    assert sources.find("org/a") == (src / "org" / "a").resolve()
    for name in ("escape", "org/c", "file", "org", "missing", "org/a/adapter_config.json"):
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
    assert sources.find("later") == (tmp_path / "later").resolve()


def test_later_sources_are_searched_in_order(tmp_path):
    first, second = tmp_path / "1", tmp_path / "2"
    put(second, "x")
    put(first, "y")
    sources = AdapterSources([first, second])
    assert sources.find("x") == (second / "x").resolve()
    assert sources.find("y") == (first / "y").resolve()


def test_a_request_registers_and_is_served_as_an_explicit_registration(tmp_path):
    from fastapi.testclient import TestClient

    from metrale import LLM
    from metrale.server.app import create_app
    from metrale.server.async_engine import AsyncEngine
    from metrale.server.settings import ServerSettings
    from tests.helpers.server import save_tokenizer
    from tests.helpers.tiny_models import make_adapter, make_model, save_model

    base = make_model("llama", seed=5)
    save_model(base, tmp_path / "model")
    save_tokenizer(tmp_path / "model", base.config.vocab_size)
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
        assert complete("org/missing").status_code == 404
        assert complete("../etc").status_code in (400, 404)
        names = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert "org/a" in names and "org/missing" not in names
    llm.engine.check_integrity()
