"""Each family's tool-call syntax read back out of answers, whole and streamed: the
calls and the content around them, JSON that is not a call left as content, the stream
holding back what may begin a call marker and sending each call once complete."""

from __future__ import annotations

import json

import pytest

from metrale.server import tool_formats
from metrale.server.tool_stream import ToolStream

ARGS = {"city": "Paris", "unit": "celsius"}
A = json.dumps(ARGS)
ANSWERS = {
    "hermes": (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {A}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look."),
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {A}}}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "mistral": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {A}}}, '
                '{"name": "get_time", "arguments": {}}]', None),
}


@pytest.mark.parametrize("family", tool_formats.FAMILIES)
def test_whole_answers_parse_into_calls(family):
    text, content = ANSWERS[family]
    got_content, calls = tool_formats.parse(family, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS), ("get_time", {})]


@pytest.mark.parametrize("family", tool_formats.FAMILIES)
def test_text_without_a_call_is_content(family):
    for text in ("It is sunny in Paris.", '{"city": "Paris"}', "<tool_call>\n{\"name\": \"f\", \"argu"):
        content, calls = tool_formats.parse(family, text)
        assert (content, calls) == (text, [])


@pytest.mark.parametrize("family", tool_formats.FAMILIES)
def test_a_stream_fed_character_by_character_sends_what_the_whole_answer_holds(family):
    text, content = ANSWERS[family]
    stream, sent, deltas = ToolStream(family), "", []
    for end in range(1, len(text) + 1):
        piece, calls = stream.feed(text[:end], final=end == len(text))
        sent += piece
        deltas += calls
        # nothing of a call marker ever goes out as content
        assert "<tool" not in sent and "[TOOL" not in sent and "python_tag" not in sent
    assert sent.strip() == (content or "")
    named = [d for d in deltas if "id" in d]
    assert [d["function"]["name"] for d in named] == ["get_weather", "get_time"]
    args = [d["function"]["arguments"] for d in deltas if "id" not in d]
    assert [json.loads(a) for a in args] == [ARGS, {}]
    assert [d["index"] for d in named] == [0, 1] and all(d["id"].startswith("call_") for d in named)


def test_plain_text_streams_as_it_comes_holding_back_only_a_possible_marker():
    stream = ToolStream("hermes")
    assert stream.feed("Hello <to", final=False) == ("Hello ", [])
    assert stream.feed("Hello <tomato", final=False) == ("<tomato", [])
    assert stream.feed("Hello <tomato soup", final=True) == (" soup", [])


def test_required_grammar_spells_each_familys_syntax():
    functions = [{"name": "get_weather", "parameters": {"type": "object"}}]
    for family in tool_formats.FAMILIES:
        tag = json.loads(tool_formats.structural_tag(family, functions, parallel=False))
        text = json.dumps(tag)
        assert "get_weather" in text and tag["type"] == "structural_tag"
    assert tool_formats.detect_family("{{ '<tool_call>' }}") == "hermes"
    assert tool_formats.detect_family("<|start_header_id|>{% if tools %}") == "llama3_json"
    assert tool_formats.detect_family("[TOOL_CALLS]") == "mistral"
