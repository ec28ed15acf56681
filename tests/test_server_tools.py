"""Tool calls through the official `openai` client against a real `metrale serve`, on
tiny models with Llama 3's and Qwen 2.5's chat templates: tool_choice required and named
(enforced by the grammar: the answer is calls, in the family's syntax, whose arguments
validate against the tool's schema), auto (the answer is parsed: here the text is steered
to a call with a regex, to make a random model write one) and none, streamed or not, the
stream's tool_call deltas adding up to the non-streamed answer; a conversation holding
earlier calls and their results renders through the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.chat_models import make_chat_world
from tests.helpers.server import ServerProcess

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# a call in each family's syntax, as a regex: auto's parser must find it
CALL_TEXT = {
    "qwen": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", '
            r'"unit": "celsius"\}\}\n</tool_call>',
    "llama3": r'\{"name": "get_weather", "parameters": \{"city": "Paris", "unit": "celsius"\}\}',
}


@pytest.fixture(scope="module", params=["llama3", "qwen"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def client(family, tmp_path_factory):
    world = make_chat_world(tmp_path_factory.mktemp(family), family, adapters=("a",))
    server = ServerProcess(["--model", str(world["model"]), "--adapter",
                            f"a={world['adapters'] / 'a'}", "--max-loras", "1",
                            "--max-lora-rank", "4", "--max-model-len", "4096"],
                           tmp_path_factory.mktemp(f"{family}-log") / "server.log")
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                            timeout=120)
    finally:
        server.stop()


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(stream):
    """The stream's content, tool calls (deltas merged by index, as the SDK's helpers
    do) and finish reason."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("model", ["model", "a"])
def test_required_answers_calls_of_the_offered_tools(client, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=120, temperature=0)
    choice = reply.choices[0]
    _check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
    assert not choice.message.content

    content, calls, reason = _streamed(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True))
    assert reason == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["id"] for c in calls)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_choice_calls_that_function(client, name):
    choice = {"type": "function", "function": {"name": name}}
    reply = client.chat.completions.create(model="a", messages=MESSAGES, tools=TOOLS,
                                           tool_choice=choice, max_tokens=120, temperature=0)
    calls = reply.choices[0].message.tool_calls
    _check_calls(calls, {name})
    assert all(c.function.name == name for c in calls)
    _, streamed, reason = _streamed(client.chat.completions.create(
        model="a", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120,
        temperature=0, stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert reason == reply.choices[0].finish_reason


def test_auto_reads_a_call_out_of_the_answer_and_none_leaves_it_as_text(client, family):
    steer = {"structured_outputs": {"regex": CALL_TEXT[family]}}
    reply = client.chat.completions.create(model="model", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=80, temperature=0, extra_body=steer)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] \
        == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    content, calls, reason = _streamed(client.chat.completions.create(
        model="model", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=80,
        temperature=0, stream=True, extra_body=steer))
    assert reason == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]

    none = client.chat.completions.create(model="model", messages=MESSAGES, tools=TOOLS,
                                          tool_choice="none", max_tokens=80, temperature=0,
                                          extra_body=steer)
    assert none.choices[0].message.tool_calls is None
    assert '"get_weather"' in none.choices[0].message.content
    assert none.choices[0].finish_reason == "stop"


def test_auto_without_a_call_is_content(client):
    steer = {"structured_outputs": {"choice": ["It is sunny."]}}
    for stream in (False, True):
        if stream:
            content, calls, reason = _streamed(client.chat.completions.create(
                model="model", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0,
                stream=True, extra_body=steer))
        else:
            choice = client.chat.completions.create(model="model", messages=MESSAGES, tools=TOOLS,
                                                    max_tokens=20, temperature=0,
                                                    extra_body=steer).choices[0]
            content, calls, reason = choice.message.content, choice.message.tool_calls or [], \
                choice.finish_reason
        assert (content, calls, reason) == ("It is sunny.", [], "stop")


def test_a_conversation_with_earlier_calls_renders(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model="a", messages=messages, tools=TOOLS, max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, kw, param):
    body = dict(model="model", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**body, **kw})
    assert info.value.body["param"] == param


@pytest.mark.parametrize("constraint, pattern", [
    ({"guided_regex": "(yes|no), [0-9]{2}"}, r"(yes|no), [0-9]{2}"),
    ({"structured_outputs": {"choice": ["Paris", "London"]}}, r"Paris|London"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"]}}}}, r'\{\s*"n": [0-9]\s*\}'),
])
def test_completions_follow_a_constraint_streamed_or_not(client, constraint, pattern):
    import re

    whole = client.completions.create(model="a", prompt="The answer is", max_tokens=30,
                                      temperature=0, extra_body=constraint)
    assert re.fullmatch(pattern, whole.choices[0].text), whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="a", prompt="The answer is", max_tokens=30,
                                         temperature=0, extra_body=constraint, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
