"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one
of a list of strings, a grammar (EBNF, as vLLM's xgrammar backend reads it) or a
structural tag (tool calls). A frozen value, checked for shape when made; whether the
grammar library can compile it is engine/grammar.py's question (a 400 naming the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metrale.engine.param_errors import InvalidSamplingParamsError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar of a megabyte is an attack, not a request
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutput:
    """kind: one of KINDS. spec: the JSON schema (compact JSON text), the regex, the
    grammar, the structural tag (JSON text), or for "choice" the choices as a JSON list;
    empty for json_object. param: the request field it came from, named in refusals."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSamplingParamsError(
                f"{self.param}: unknown kind {self.kind!r} (one of {', '.join(KINDS)})", self.param)
        if not isinstance(self.spec, str):
            raise InvalidSamplingParamsError(f"{self.param} must be text", self.param)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidSamplingParamsError(
                f"{self.param} may have at most {MAX_SPEC_CHARS} characters", self.param)
        if self.kind != "json_object" and not self.spec:
            raise InvalidSamplingParamsError(f"{self.param}: the {self.kind} is empty", self.param)

    @classmethod
    def json_schema(cls, schema: dict | bool | str, param: str = "response_format") -> StructuredOutput:
        """A JSON schema given as a dict (or a JSON text of one)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidSamplingParamsError(f"{param}: the schema is no JSON: {e}", param) from None
        if isinstance(schema, bool):  # JSON Schema's true / false
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise InvalidSamplingParamsError(
                f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
        return cls("json", json.dumps(schema, separators=(",", ":"), sort_keys=False), param)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...],
               param: str = "structured_outputs") -> StructuredOutput:
        if not isinstance(choices, (list, tuple)) or not choices:
            raise InvalidSamplingParamsError(f"{param}: choice must be a non-empty list of strings",
                                             param)
        if len(choices) > MAX_CHOICES:
            raise InvalidSamplingParamsError(f"{param}: at most {MAX_CHOICES} choices", param)
        if not all(isinstance(c, str) and c for c in choices):
            raise InvalidSamplingParamsError(f"{param}: every choice must be a non-empty string",
                                             param)
        return cls("choice", json.dumps(list(choices)), param)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []
