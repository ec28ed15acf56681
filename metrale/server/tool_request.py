"""A chat request's `tools` and `tool_choice`, checked and turned into a plan: which
family's syntax, whether the answer is parsed for calls, and the grammar that enforces
`required` and named choices. A template that renders no tools gets Hermes' tool
description as a system message, so any chat model can be offered tools."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from metrale.engine.structured import StructuredOutput
from metrale.server import tool_formats
from metrale.server.errors import BadRequestError

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    family: str
    tools: tuple[dict, ...]  # the request's tools, as sent ({type, function})
    choice: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls (tool_choice none: its text is content)."""
        return self.choice != "none"

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        """The grammar of required / named: the answer is calls in the family's syntax."""
        if self.choice == "required":
            functions = self.functions
        elif self.choice == "named":
            functions = [f for f in self.functions if f["name"] == self.named]
        else:
            return None
        return StructuredOutput("structural_tag",
                                tool_formats.structural_tag(self.family, functions, self.parallel),
                                "tool_choice")

    def system_text(self) -> str:
        """Hermes' description of the tools, for templates that render none."""
        return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools))


def plan_tools(tools: Any, tool_choice: Any, parallel: Any, chat_template: str | None,
               family: str | None = None) -> ToolPlan | None:
    """None when the request offers no tools (a tool_choice other than none/auto is then
    refused: it names what is not there). family: the server's --tool-call-parser."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequestError("tool_choice needs tools", "tool_choice")
        return None
    checked = tuple(_tool(t, i) for i, t in enumerate(_list(tools)))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise BadRequestError("tools: function names must be unique", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice, named = _choice(tool_choice, names)
    family = family or tool_formats.detect_family(chat_template)
    return ToolPlan(family, checked, choice, named, parallel is not False)


def _list(tools: Any) -> list:
    if not isinstance(tools, list):
        raise BadRequestError("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise BadRequestError(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    return tools


def _tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BadRequestError(f"tools[{i}]: only tools of type 'function' are supported", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
        raise BadRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' "
                              f"or '.'", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
    if "description" in fn and not isinstance(fn["description"], str):
        raise BadRequestError(f"tools[{i}].function.description must be a string", "tools")
    return {"type": "function", "function": fn}


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise BadRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or a named "
                                  f"function, got {tool_choice!r:.40}", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise BadRequestError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise BadRequestError(f"tool_choice names {name!r:.70}, which is not among the tools",
                              "tool_choice")
    return "named", name


def template_messages(messages: list[dict], plan: ToolPlan | None,
                      chat_template: str | None) -> list[dict]:
    """The messages for a template that does not render tools itself: Hermes' tool
    description first in the system message."""
    if plan is None or tool_formats.template_shows_tools(chat_template):
        return messages
    text = plan.system_text()
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{text}".strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
