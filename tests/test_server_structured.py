"""Structured outputs of a real `metrale serve` of the default model and its demo
adapters, through the official `openai` client: 22 JSON schemas (nested objects, arrays,
enums, required and optional fields, string patterns, bounded numbers) sent at once
across the base model and both adapters, every answer parsing and validating against
its schema; the SDK's parse() with a pydantic model; a streamed answer equal to the
whole one; the answers equal greedy decoding of transformers + PEFT logits under
xgrammar's own mask; n, echo and prompt logprobs; bad values refused naming the field.

Slow (the real 135M model): skipped until the default model and the demo adapters are
in the tests' recipe-keyed cache (tests/test_default_model.py builds them)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
import xgrammar
from pydantic import BaseModel, Field

from metrale.config import ModelConfig
from metrale.demo_adapters import DEMO_ADAPTERS
from metrale.engine.grammar import JSON_OPTIONS
from metrale.model.default_model import MODEL_NAME
from tests.helpers.default_model import is_cached
from tests.helpers.schemas import PROMPTS, SCHEMAS
from tests.helpers.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_model_cache")]
MODELS = (MODEL_NAME, *DEMO_ADAPTERS)


@pytest.fixture(scope="module")
def server(default_model_cache, tmp_path_factory):
    if not is_cached(default_model_cache):
        pytest.skip("default model or demo adapters not in the tests' cache yet "
                    "(tests/test_default_model.py builds them)")
    srv = ServerProcess(["--max-num-seqs", "32"], tmp_path_factory.mktemp("structured") / "server.log",
                        startup_timeout_s=180)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _schema_format(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def _ask(client, i: int, **kw):
    return client.chat.completions.create(
        model=MODELS[i % len(MODELS)], messages=[{"role": "user", "content": PROMPTS[i]}],
        response_format=_schema_format(i), max_tokens=200, temperature=0, **kw)


def test_every_schema_answer_validates_with_the_base_and_adapters_in_one_batch(client):
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # at once: they share the server's steps
        replies = list(pool.map(lambda i: _ask(client, i), range(len(SCHEMAS))))
    for i, reply in enumerate(replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
        assert reply.model == MODELS[i % len(MODELS)]


class Moon(BaseModel):
    name: str
    planet: str = Field(pattern="^(Earth|Mars|Jupiter)$")
    radius_km: int = Field(ge=1, le=5000)


@pytest.mark.parametrize("model", MODELS)
def test_the_sdks_parse_returns_the_object(client, model):
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Tell me about the moon."}],
        response_format=Moon, max_tokens=200, temperature=0)
    moon = reply.choices[0].message.parsed
    assert isinstance(moon, Moon) and 1 <= moon.radius_km <= 5000


def test_a_streamed_answer_is_the_whole_answer(client):
    for i in (0, 7, 8):
        whole = _ask(client, i).choices[0].message.content
        text = "".join(c.choices[0].delta.content or "" for c in _ask(client, i, stream=True)
                       if c.choices)
        assert text == whole
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def _reference(model, tokenizer, prompt: list[int], compiled, stops: set[int], n: int) -> str:
    """Greedy decoding of model's logits under xgrammar's own mask."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()[None]
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits[0].argmax())
            assert matcher.accept_token(token)
            if token in stops:
                break
            ids.append(token)
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True)


def test_answers_equal_xgrammar_masked_peft_greedy(client):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metrale.demo_adapters import demo_adapter_dir, load_with_adapter
    from metrale.model.default_model import default_model_dir

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = {tokenizer.eos_token_id, *ModelConfig.from_dir(model_dir).eos_token_ids}
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=sorted(stops))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # 2 shared cores: no thread pool
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs: the same kernels, the same rounding
    try:
        for i, model_name in ((0, MODEL_NAME), (13, "shout"), (16, "pirate")):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval() \
                if model_name == MODEL_NAME else load_with_adapter(model_dir, demo_adapter_dir(model_name))
            prompt = tokenizer.encode(tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[i]}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)
            compiled = compiler.compile_json_schema(json.dumps(SCHEMAS[i]), **JSON_OPTIONS)
            want = _reference(model, tokenizer, prompt, compiled, stops, 200)
            got = client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": PROMPTS[i]}],
                response_format=_schema_format(i), max_tokens=200, temperature=0)
            assert got.choices[0].message.content == want, model_name
    finally:
        torch.set_num_threads(threads)


def test_n_echo_and_prompt_logprobs(client):
    reply = client.completions.create(model="shout", prompt="The moon is", max_tokens=5, temperature=0,
                                      n=3, echo=True, logprobs=2,
                                      extra_body={"prompt_logprobs": 1})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = {c.text for c in reply.choices}
    assert len(texts) == 1 and texts.pop().startswith("The moon is")  # greedy: all the same
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert reply.usage.completion_tokens == 15
    prompt = reply.choices[0].model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(lp.token_logprobs) - 5
    # echo's prompt entries are the prompt logprobs; every choice carries them
    for entry, logprob in zip(prompt[1:], lp.token_logprobs[1:]):
        assert logprob in [v["logprob"] for v in entry.values()]
    assert all(c.model_extra["prompt_logprobs"] == prompt for c in reply.choices)
    chat = client.chat.completions.create(model="pirate", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])  # the prompt's own token


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -9}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"n": 0}, "n"), ({"n": 1000}, "n"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_bad_values_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
