"""A request's output constraint, from whichever field carries it: OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` ({json, regex,
choice, grammar, json_object, structural_tag}) or its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one may constrain a request;
a malformed one is refused naming its field (the engine refuses one its grammar library
cannot compile, naming the same field)."""

from __future__ import annotations

import json
from typing import Any

from metrale.engine.structured import StructuredOutput
from metrale.server.errors import BadRequestError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# structured_outputs keys that tune vLLM's backends and change nothing here
STRUCTURED_TUNING = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                     "whitespace_pattern", "backend")


def constraint_of(body: Any) -> StructuredOutput | None:
    """The one StructuredOutput of a request body (a GenerationRequest), or None."""
    found: list[StructuredOutput] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = from_response_format(response_format)
        if spec is not None:
            found.append(spec)
    if body.structured_outputs is not None:
        found.append(from_structured_outputs(body.structured_outputs))
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append(_of_kind(kind, value, field))
    if len(found) > 1:
        names = ", ".join(sorted({s.param for s in found}))
        raise BadRequestError(f"a request may constrain its output in one way only; got {names}",
                              found[1].param)
    return found[0] if found else None


def from_response_format(fmt: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise BadRequestError("response_format must be an object", param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise BadRequestError("response_format.json_schema must be an object holding the "
                                  "schema (json_schema.schema)", param)
        schema = inner.get("schema", inner.get("json_schema"))
        if schema is None:
            raise BadRequestError("response_format.json_schema.schema is missing", param)
        return StructuredOutput.json_schema(schema, param)
    if kind == "structural_tag":
        return StructuredOutput("structural_tag", json.dumps(fmt), param)
    raise BadRequestError(f"response_format type must be one of text, json_object, json_schema; "
                          f"got {kind!r:.40}", param)


def from_structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise BadRequestError("structured_outputs must be an object", param)
    unknown = set(value) - set(STRUCTURED_KEYS) - set(STRUCTURED_TUNING)
    if unknown:
        raise BadRequestError(f"structured_outputs: unknown key(s) {', '.join(sorted(unknown))} "
                              f"(one of {', '.join(STRUCTURED_KEYS)})", param)
    kinds = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise BadRequestError(f"structured_outputs must set exactly one of "
                              f"{', '.join(STRUCTURED_KEYS)}; got {len(kinds)}", param)
    kind = kinds[0]
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    return _of_kind(kind, value[kind], param)


def _of_kind(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        if not isinstance(value, (dict, str, bool)):
            raise BadRequestError(f"{param}: a JSON schema must be an object", param)
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    if kind == "structural_tag":
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("structural_tag", text, param)
    if not isinstance(value, str):
        raise BadRequestError(f"{param}: the {kind} must be a string", param)
    return StructuredOutput(kind, value, param)
