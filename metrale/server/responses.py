"""RequestOutputs as OpenAI response bodies and stream chunks (completions and chat).

A Formatter is made per request; it remembers how many logprob entries it has
already sent, since RequestOutput.logprobs is cumulative.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from metrale.engine.outputs import RequestOutput


def token_text(tokenizer) -> Callable[[int], str]:
    """Token id -> its text as shown in logprobs; `token_id:N` without a tokenizer
    (vLLM's convention for models served on token ids)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def usage(out: RequestOutput, completion_tokens: int | None = None) -> dict:
    prompt = len(out.prompt_token_ids)
    completion = len(out.token_ids) if completion_tokens is None else completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


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
        self.sent_logprobs = 0
        self.text_offset = 0

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _new_logprobs(self, out: RequestOutput) -> list[dict]:
        entries = out.logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(out.logprobs)
        return entries

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(out))

    def chunk(self, out: RequestOutput) -> dict:
        choice = {"index": 0, **self._content(out.delta_text, streamed=True),
                  "logprobs": self._logprobs(self._new_logprobs(out)),
                  "finish_reason": out.finish_reason if out.finished else None}
        return self._envelope(self.chunk_object, [choice])

    def final(self, out: RequestOutput) -> dict:
        choice = {"index": 0, **self._content(out.text, streamed=False),
                  "logprobs": self._logprobs(out.logprobs), "finish_reason": out.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(out))


class CompletionFormatter(_Formatter):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if not self.logprobs:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e["token"])
            tokens.append(text)
            token_logprobs.append(e["logprob"])
            top.append({self.token_text(i): lp for i, lp in e["top"]})
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def _content(self, text: str, streamed: bool) -> dict:
        return {"text": text}


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if not self.logprobs:
            return None
        content = [{**self._entry(e["token"], e["logprob"]),
                    "top_logprobs": [self._entry(i, lp) for i, lp in e["top"]]} for e in entries]
        return {"content": content, "refusal": None}

    def role_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def _content(self, text: str, streamed: bool) -> dict:
        if streamed:
            return {"delta": {"content": text} if text else {}}
        return {"message": {"role": "assistant", "content": text}}
