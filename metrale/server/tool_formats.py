"""How each model family writes tool calls, both ways: the structural tag that makes the
grammar emit exactly that syntax (tool_choice required or named), and the parser that
reads calls back out of the text (every choice but none).

- hermes (Qwen2.5, Qwen3, Hermes; and models whose template has no tool format, whose
  system prompt then gets Hermes' tool description):
  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one per call
- llama3_json (Llama 3.1-3.3): {"name": "f", "parameters": {...}}, calls separated by
  "; ", optionally after <|python_tag|>
- mistral: [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

FAMILIES = ("hermes", "llama3_json", "mistral")
# a tool's arguments stay on one line: small models given free whitespace may spend their
# whole budget on it
MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it
    id: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_family(chat_template: str | None) -> str:
    """The family whose tool-call syntax a chat template shows the model."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3_json"
    return "hermes"


def template_shows_tools(chat_template: str | None) -> bool:
    """Whether the template renders `tools` itself (else the server describes them)."""
    return "tools" in (chat_template or "")


@dataclass(frozen=True)
class Syntax:
    """One family's call syntax: each call is begin(name) + arguments JSON + end, calls
    joined by separator, the whole between prefix and suffix."""

    call_begin: str  # with {name} in it
    call_end: str
    separator: str
    prefix: str = ""
    suffix: str = ""


SYNTAX = {
    "hermes": Syntax('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": Syntax('{{"name": "{name}", "parameters": ', "}", "; "),
    "mistral": Syntax('{{"name": "{name}", "arguments": ', "}", ", ", prefix="[TOOL_CALLS][", suffix="]"),
}


def structural_tag(family: str, functions: list[dict], parallel: bool) -> str:
    """The structural tag (xgrammar's JSON format) for one or more calls of `functions`
    ({name, parameters}), nothing else: tool_choice required (all tools) or named (one)."""
    syntax = SYNTAX[family]
    tags = [{"type": "tag", "begin": syntax.call_begin.format(name=f["name"]),
             "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"},
                         "max_whitespace_cnt": MAX_WHITESPACE},
             "end": syntax.call_end} for f in functions]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": syntax.separator,
             "at_least_one": True, "stop_after_first": not parallel}
    if syntax.prefix or syntax.suffix:
        calls = {"type": "sequence", "elements": [
            {"type": "const_string", "value": syntax.prefix}, calls,
            {"type": "const_string", "value": syntax.suffix}]}
    return json.dumps({"type": "structural_tag", "format": calls})


def parse(family: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the content left, the complete calls) of a finished answer."""
    if family == "hermes":
        return _parse_hermes(text)
    if family == "llama3_json":
        return _parse_llama3(text)
    return _parse_mistral(text)


def tool_start(family: str, text: str) -> int | None:
    """Where the calls begin in text (streaming holds text from there), or None."""
    if family == "hermes":
        at = text.find("<tool_call>")
        return None if at < 0 else at
    if family == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at >= 0:
            return at
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith('[{"name"') else None
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
        return len(text) - len(stripped)
    return None


def may_start(family: str, text: str) -> int:
    """How many trailing characters of text may begin the calls' marker (held back)."""
    markers = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
               "llama3_json": ("<|python_tag|>",)}[family]
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return k
    return 0


# strict=False: a grammar's string of bounded length (xgrammar's minLength/maxLength rule)
# admits raw control characters, which strict JSON refuses; the arguments are written out
# again as valid JSON
_decoder = json.JSONDecoder(strict=False)


def _call(obj: object, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls, at = [], start
    while True:
        at = text.find("<tool_call>", at)
        if at < 0:
            break
        body = text[at + len("<tool_call>"):].lstrip()
        try:
            obj, _ = _decoder.raw_decode(body)
        except ValueError:
            break  # an unfinished call (the budget ran out): not a call
        call = _call(obj, ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
        at += len("<tool_call>")
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    calls = []
    while body:
        try:
            obj, end = _decoder.raw_decode(body)
        except ValueError:
            break
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
        body = body[end:].lstrip().removeprefix(";").lstrip()
    return (None, calls) if calls else (text, [])


def _parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    at = text.find("[TOOL_CALLS]")
    start = at if at >= 0 else tool_start("mistral", text)
    if start is None:
        return text, []
    body = text[start:].removeprefix("[TOOL_CALLS]").lstrip()
    try:
        objs, _ = _decoder.raw_decode(body)
    except ValueError:
        return text, []
    objs = objs if isinstance(objs, list) else [objs]
    calls = [c for c in (_call(o, ("arguments", "parameters")) for o in objs) if c is not None]
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls
