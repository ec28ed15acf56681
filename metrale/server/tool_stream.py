"""One streamed answer read for tool calls: text before the calls streams as content
(holding back what may begin a call marker, as stop strings are held back); from the
marker on the text is held and each call goes out once complete, as OpenAI streams it:
a delta naming the call (index, id, type, function name, empty arguments), then one
with its arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.server import tool_formats
from metrale.server.tool_formats import ToolCall


@dataclass
class ToolStream:
    family: str
    content_sent: int = 0  # characters of the text streamed as content
    start: int | None = None  # where the calls begin in the text
    calls: list[ToolCall] = field(default_factory=list)  # sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """text: the answer so far -> (content to stream now, tool_call deltas to send)."""
        if self.start is None:
            self.start = tool_formats.tool_start(self.family, text)
        if self.start is None:
            hold = 0 if final else tool_formats.may_start(self.family, text)
            content = text[self.content_sent:len(text) - hold]
            self.content_sent += len(content)
            return content, []
        content = text[self.content_sent:self.start]
        self.content_sent = max(self.content_sent, self.start)
        if not final and self.family != "hermes":
            return content, []  # one JSON list / chain of objects: read when complete
        _, calls = tool_formats.parse(self.family, text)
        if not final and self.family == "hermes":
            calls = calls[:text.count("</tool_call>")]  # only the closed ones
        deltas = []
        for i in range(len(self.calls), len(calls)):
            call = ToolCall(calls[i].name, calls[i].arguments, tool_formats.new_call_id())
            self.calls.append(call)
            deltas.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        if final and not calls and self.content_sent < len(text):
            content += text[self.content_sent:]  # no call after all: it was content
            self.content_sent = len(text)
        return content, deltas
