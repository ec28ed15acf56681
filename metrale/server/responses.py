"""RequestOutputs as OpenAI response bodies and stream chunks (completions and chat).

A Formatter is made per request; it keeps, per choice (a request's n completions), how
many logprob entries it has already sent (RequestOutput.logprobs is cumulative), its
latest output (for the usage), and for chat with tools the stream's tool-call state.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable

from metrale.engine.outputs import RequestOutput
from metrale.server import tool_formats
from metrale.server.tool_request import ToolPlan
from metrale.server.tool_stream import ToolStream


def token_text(tokenizer) -> Callable[[int], str]:
    """Token id -> its text as shown in logprobs; `token_id:N` without a tokenizer
    (vLLM's convention for models served on token ids)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def usage(outs: RequestOutput | list[RequestOutput], completion_tokens: int | None = None) -> dict:
    """The request's usage: its prompt once, the tokens of all its completions."""
    outs = outs if isinstance(outs, list) else [outs]
    prompt = len(outs[0].prompt_token_ids)
    completion = sum(len(o.token_ids) for o in outs) if completion_tokens is None \
        else completion_tokens
    # the prompt tokens any completion found in the prefix cache (siblings share them)
    cached = max(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Formatter:
    object_name = ""  # the whole response
    chunk_object = ""  # one stream chunk
    id_prefix = ""

    def __init__(self, model: str, token_text: Callable[[int], str], logprobs: bool) -> None:
        self.model, self.token_text, self.logprobs = model, token_text, logprobs
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_logprobs: dict[int, int] = {}
        self.latest: dict[int, RequestOutput] = {}

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _new_logprobs(self, out: RequestOutput) -> list[dict]:
        entries = out.logprobs[self.sent_logprobs.get(out.index, 0):]
        self.sent_logprobs[out.index] = len(out.logprobs)
        return entries

    def usage_so_far(self) -> dict:
        return usage([self.latest[i] for i in sorted(self.latest)])

    def usage_chunk(self) -> dict:
        return self._envelope(self.chunk_object, [], usage=self.usage_so_far())

    def chunk(self, out: RequestOutput) -> dict:
        self.latest[out.index] = out
        choice = {"index": out.index, **self._streamed(out),
                  "logprobs": self._logprobs(self._new_logprobs(out), out.index),
                  "finish_reason": self._finish_reason(out) if out.finished else None}
        return self._envelope(self.chunk_object, [choice])

    def final(self, outs: list[RequestOutput]) -> dict:
        """outs: each completion's last output, by index."""
        choices = [{"index": out.index, **self._whole(out),
                    "logprobs": self._logprobs(list(out.logprobs), out.index, whole=True),
                    "finish_reason": self._finish_reason(out)} for out in outs]
        return self._envelope(self.object_name, choices, usage=usage(outs))

    def _finish_reason(self, out: RequestOutput) -> str | None:
        return out.finish_reason


def _vllm_prompt_logprobs(out: RequestOutput, token_text: Callable[[int], str]) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the top ones (ranked by position) and the prompt's token."""
    if out.prompt_logprobs is None:
        return None
    entries: list[dict | None] = [None]
    for e in out.prompt_logprobs[1:]:
        d = {str(i): {"logprob": lp, "rank": rank, "decoded_token": token_text(i)}
             for rank, (i, lp) in enumerate(e["top"], 1)}
        d[str(e["token"])] = {"logprob": e["logprob"], "rank": e["rank"],
                              "decoded_token": token_text(e["token"])}
        entries.append(d)
    return entries


class CompletionFormatter(_Formatter):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, token_text: Callable[[int], str], logprobs: bool,
                 echo: str | None = None) -> None:
        """echo: the prompt's text, sent before each completion's (echo=true)."""
        super().__init__(model, token_text, logprobs)
        self.echo = echo
        self.text_offset: dict[int, int] = {}
        self.started: set[int] = set()  # choices whose first chunk went out

    def _logprobs(self, entries: list[dict], index: int, whole: bool = False) -> dict | None:
        if not self.logprobs:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        at = 0 if whole else self.text_offset.get(index, 0)

        def add(text: str, logprob: float | None, tops: dict | None) -> None:
            nonlocal at
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append(tops)
            offsets.append(at)
            at += len(text)

        latest = self.latest.get(index)
        if self.echo is not None and (whole or index not in self.started) and latest is not None \
                and latest.prompt_logprobs is not None:
            # echo with logprobs: the prompt's tokens first, the first one without a logprob
            for i, (token, e) in enumerate(zip(latest.prompt_token_ids, latest.prompt_logprobs)):
                if i == 0 or e is None:
                    add(self.token_text(token), None, None)
                else:
                    add(self.token_text(token), e["logprob"],
                        {self.token_text(t): lp for t, lp in e["top"]})
        for e in entries:
            add(self.token_text(e["token"]), e["logprob"],
                {self.token_text(i): lp for i, lp in e["top"]})
        if not whole:
            self.text_offset[index] = at
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def chunk(self, out: RequestOutput) -> dict:
        chunk = super().chunk(out)
        self.started.add(out.index)
        return chunk

    def final(self, outs: list[RequestOutput]) -> dict:
        # the prompt's logprobs are the request's (completion 0 computes them): every
        # choice shows them, as vLLM's do
        prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        outs = [o if o.prompt_logprobs is not None or prompt is None
                else dataclasses.replace(o, prompt_logprobs=prompt) for o in outs]
        for out in outs:
            self.latest[out.index] = out
        return super().final(outs)

    def _streamed(self, out: RequestOutput) -> dict:
        prefix = self.echo if self.echo is not None and out.index not in self.started else ""
        return {"text": prefix + out.delta_text, **self._prompt_logprobs(out)}

    def _whole(self, out: RequestOutput) -> dict:
        return {"text": (self.echo or "") + out.text, **self._prompt_logprobs(out)}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """vLLM's field, once per completion (a stream's first chunk of it)."""
        if out.prompt_logprobs is None or out.index in self.started:
            return {}
        return {"prompt_logprobs": _vllm_prompt_logprobs(out, self.token_text)}


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, token_text: Callable[[int], str], logprobs: bool,
                 tools: ToolPlan | None = None) -> None:
        super().__init__(model, token_text, logprobs)
        self.tools = tools if tools is not None and tools.parses else None
        self.streams: dict[int, ToolStream] = {}
        self.called: set[int] = set()  # choices that answered with tool calls

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: list[dict], index: int, whole: bool = False) -> dict | None:
        if not self.logprobs:
            return None
        content = [{**self._entry(e["token"], e["logprob"]),
                    "top_logprobs": [self._entry(i, lp) for i, lp in e["top"]]} for e in entries]
        return {"content": content, "refusal": None}

    def role_chunks(self, n: int) -> dict:
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(n)]
        return self._envelope(self.chunk_object, choices)

    def _streamed(self, out: RequestOutput) -> dict:
        if self.tools is None:
            return {"delta": {"content": out.delta_text} if out.delta_text else {}}
        stream = self.streams.setdefault(out.index, ToolStream(self.tools.family))
        content, calls = stream.feed(out.text, out.finished)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
            self.called.add(out.index)
        return {"delta": delta}

    def _whole(self, out: RequestOutput) -> dict:
        message: dict = {"role": "assistant", "content": out.text}
        if self.tools is not None:
            content, calls = tool_formats.parse(self.tools.family, out.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [
                    tool_formats.ToolCall(c.name, c.arguments, tool_formats.new_call_id()).as_dict()
                    for c in calls]}
                self.called.add(out.index)
        return {"message": message}

    def final(self, outs: list[RequestOutput]) -> dict:
        body = super().final(outs)
        prompt = next((o for o in outs if o.prompt_logprobs is not None), None)
        if prompt is not None:  # vLLM's chat answers carry them beside the choices
            body["prompt_logprobs"] = _vllm_prompt_logprobs(prompt, self.token_text)
        return body

    def _finish_reason(self, out: RequestOutput) -> str | None:
        # a stopped answer that held calls: the client is to run them (OpenAI's reason)
        if out.finish_reason == "stop" and out.index in self.called:
            return "tool_calls"
        return out.finish_reason
