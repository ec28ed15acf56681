"""Nothing a client sends can stop the server, in-process (no server process):

- every field of a completion or chat body, given any JSON value (NaN, huge
  integers, bools, lone surrogates, nested junk), is answered below 500 and the
  engine stays alive (hypothesis);
- a bad field is a 400 that names it;
- a request whose logits turn NaN fails alone (500, sampling_failed) while the
  others complete as they would have."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrale.engine.runner as runner_module
from metrale import LLM
from metrale.server.app import create_app
from metrale.server.async_engine import AsyncEngine
from metrale.server.settings import ServerSettings
from tests.helpers.server import save_tokenizer
from tests.helpers.tiny_models import saved_tiny_model

USER, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {USER}"}
MAX_TOKENS_LIMIT = 4  # keeps every accepted request a few decode steps long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("requests")
    saved_tiny_model(root / "model", seed=21, tokenizer=save_tokenizer)
    return root / "model"


@pytest.fixture(scope="module")
def served(model_dir):
    """(client, async engine) over a live engine thread, with an API key."""
    llm = LLM(model_dir, max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=128)
    engine = AsyncEngine(llm.engine)
    app = create_app(engine, ServerSettings(model_id="model", api_key=USER, admin_key=ADMIN,
                                            max_tokens_limit=MAX_TOKENS_LIMIT))
    with TestClient(app) as client:  # the lifespan starts (and ends) the engine thread
        yield client, engine


def post(client, path: str, body: object, headers=AUTH):
    # json.dumps, not httpx's encoder: it must be able to send NaN, Infinity and "\ud800"
    return client.post(path, content=json.dumps(body), headers={
        **headers, "Content-Type": "application/json"})


def assert_alive(client, engine):
    assert engine.alive, engine.error
    assert client.get("/health").status_code == 200
    r = post(client, "/v1/completions", {"prompt": "hello world", "max_tokens": 2,
                                         "temperature": 0})
    assert r.status_code == 200, r.text


# --- any JSON value in any field ------------------------------------------------------------

# any code point, lone surrogates too (which hypothesis draws rarely: some are added)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12) \
    | st.sampled_from(["\ud800", "a\udfffb"])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
           | st.floats() | st.sampled_from([5e-324, 1e-45, -0.0, 2**64, -2**63 - 1, 1e308])
           | ANY_TEXT)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=8)
NUMBERS = st.sampled_from([0, 1e-45, 5e-324, 1e-5, 0.5, 1, 2, 2.0000001, -1, math.nan, math.inf,
                           -math.inf, 2**64, 2**64 - 1, -2**63, -2**63 - 1, True, "1"])
SMALL_INTS = st.integers(-3, 30) | st.sampled_from([2**64, -2**63 - 1, 2**1000])
WORDS = st.sampled_from(["hello", "world", "the", "moon", "\ud800", "", "sun sea"])
TEXT = WORDS | ANY_TEXT


def field(targeted: st.SearchStrategy) -> st.SearchStrategy:
    """A value meant for the field most of the time, any JSON value otherwise."""
    return targeted | ANY_JSON


COMMON = {
    "model": field(st.sampled_from(["model", "base:model", "nope", "", "model:x"])),
    "adapter": field(st.sampled_from([None, "model", "a"])),
    "temperature": field(NUMBERS), "top_p": field(NUMBERS), "top_k": field(SMALL_INTS),
    "seed": field(NUMBERS | st.integers()), "max_tokens": field(SMALL_INTS),
    "n": field(SMALL_INTS), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": field(TEXT | st.lists(TEXT, max_size=20)),
    "ignore_eos": field(st.booleans()),
    "presence_penalty": field(NUMBERS), "frequency_penalty": field(NUMBERS),
    "logit_bias": field(st.dictionaries(WORDS, NUMBERS, max_size=2)),
    "user": ANY_JSON,
}
PROMPTS = TEXT | st.lists(st.integers(-2, 300), max_size=8) | st.lists(TEXT, max_size=2) \
    | st.lists(st.lists(st.integers(-1, 260), max_size=4), max_size=2)
COMPLETION = st.fixed_dictionaries({"prompt": field(PROMPTS)}, optional={
    **COMMON, "logprobs": field(SMALL_INTS), "echo": field(st.booleans()),
    "best_of": field(SMALL_INTS), "suffix": field(TEXT)})
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]))},
    optional={"content": field(TEXT | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": field(TEXT)}), max_size=2))})
CHAT = st.fixed_dictionaries({"messages": field(st.lists(MESSAGE, max_size=3))}, optional={
    **COMMON, "max_completion_tokens": field(SMALL_INTS), "logprobs": field(st.booleans()),
    "top_logprobs": field(SMALL_INTS), "tools": ANY_JSON, "response_format": ANY_JSON})

# Bodies the engine accepts, with every field at or near its limits: these reach the
# sampler (tiny temperatures and top_p, extreme seeds) instead of stopping at a 400.
TEMPERATURES = st.floats(0, 2) | st.sampled_from([0, 5e-324, 1e-45, 1e-5, 2])
SERVED = {
    "temperature": TEMPERATURES, "top_p": st.floats(5e-324, 1) | st.just(5e-324),
    "top_k": st.integers(-1, 300), "seed": st.integers(-2**63, 2**64 - 1),
    "stop": st.lists(st.sampled_from(["the", "moon", "w9", "hello world"]), max_size=16),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
    "max_tokens": st.integers(1, MAX_TOKENS_LIMIT),
}
SERVED_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.sampled_from(["hello world", "the moon", [5, 9, 200]])},
    optional={**SERVED, "logprobs": st.integers(0, 20)})
SERVED_CHAT = st.fixed_dictionaries(
    {"messages": st.just([{"role": "user", "content": "tell me about the sun"}])},
    optional={**SERVED, "logprobs": st.just(True), "top_logprobs": st.integers(0, 20)})

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_refused_or_served(r):
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_any_completion_body_is_answered_below_500(served):
    client, engine = served

    @FUZZ
    @given(body=SERVED_COMPLETION | COMPLETION | ANY_JSON)
    def check(body):
        assert_refused_or_served(post(client, "/v1/completions", body))
        assert engine.alive, engine.error

    check()
    assert_alive(client, engine)


def test_any_chat_body_is_answered_below_500(served):
    client, engine = served

    @FUZZ
    @given(body=SERVED_CHAT | CHAT)
    def check(body):
        assert_refused_or_served(post(client, "/v1/chat/completions", body))
        assert engine.alive, engine.error

    check()
    assert_alive(client, engine)


@pytest.mark.parametrize("field_name, value", [
    ("temperature", 1e-45), ("temperature", 5e-324), ("top_p", 5e-324), ("seed", 2**64 - 1),
    ("seed", -2**63), ("top_k", -1)])
def test_edge_values_the_engine_once_died_on_are_served(served, field_name, value):
    client, engine = served
    body = {"prompt": "hello world", "max_tokens": 3, "temperature": 0.7, field_name: value}
    assert post(client, "/v1/completions", body).status_code == 200
    assert_alive(client, engine)


@pytest.mark.parametrize("field_name, value", [
    ("seed", 2**64), ("seed", -2**63 - 1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", math.nan), ("temperature", True), ("max_tokens", True), ("seed", False),
    ("top_k", 1.5), ("temperature", 2.5), ("stop", [""]), ("stop", ["x"] * 17),
    ("logprobs", 21), ("model", "\ud800"), ("prompt", "hi \udc00")])
def test_bad_fields_are_400_naming_the_field(served, field_name, value):
    client, engine = served
    body = {"prompt": "hello world", "max_tokens": 3, field_name: value}
    r = post(client, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field_name
    assert_alive(client, engine)


def test_chat_refusals_name_the_chat_fields(served):
    client, _ = served
    base = {"messages": [{"role": "user", "content": "hello"}]}
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"max_completion_tokens": 0}, "max_completion_tokens"),
                         ({"max_completion_tokens": 99}, "max_completion_tokens"),
                         ({"max_tokens": 0}, "max_tokens"),
                         ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages")):
        r = post(client, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


# --- a request whose logits turn NaN --------------------------------------------------------

POISONED_PROMPT = [7, 7, 7, 7]


def test_nan_logits_fail_one_request_while_the_others_complete(served, monkeypatch):
    client, engine = served
    good = [{"prompt": p, "max_tokens": 4, "temperature": t, "seed": 5, "ignore_eos": True}
            for p in ("hello world", "the moon", "tell me") for t in (0, 0.9)]
    alone = [post(client, "/v1/completions", body).json()["choices"][0]["text"] for body in good]

    real = runner_module.draw

    def poisoned(logits, seqs):
        for i, seq in enumerate(seqs):
            if seq.prompt_ids == POISONED_PROMPT:
                logits[i] = float("nan")
        return real(logits, seqs)

    monkeypatch.setattr(runner_module, "draw", poisoned)
    bad = {"prompt": POISONED_PROMPT, "max_tokens": 4, "temperature": 0.5}
    with ThreadPoolExecutor(len(good) + 2) as pool:
        bads = [pool.submit(post, client, "/v1/completions", bad),
                pool.submit(post, client, "/v1/completions", {**bad, "stream": True})]
        goods = [pool.submit(post, client, "/v1/completions", body) for body in good]
        responses = [f.result() for f in goods]
        failed, streamed = bads[0].result(), bads[1].result()

    assert [r.json()["choices"][0]["text"] for r in responses] == alone
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "sampling_failed"
    # a stream fails before its first token, so it still gets the status code
    assert streamed.status_code == 500
    monkeypatch.undo()
    assert_alive(client, engine)
