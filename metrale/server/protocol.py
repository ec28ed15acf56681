"""OpenAI request bodies and how they map onto SamplingParams.

Unknown fields are accepted and ignored (clients send `user`, `metadata`...),
but a field that would change the output and that the engine cannot honour
(a completion's suffix, best_of > 1, a batch of prompts) is refused with 400 rather
than silently ignored.

Types are strict (a bool or a numeric string is no number, a float no integer):
pydantic refuses the shape with the field's name, SamplingParams the range.
No string may hold a lone surrogate: UTF-8 cannot encode it, so the tokenizer
or the JSON answer would fail on it later.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, field_validator

from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from metrale.engine.structured import StructuredOutput
from metrale.server.errors import BadRequestError
from metrale.server.structured_request import constraint_of

Number = StrictFloat | StrictInt  # never a bool, never a string


def _valid_unicode(value: Any) -> Any:
    """`value`, refused if any string in it (nested lists and dicts, keys too) is one UTF-8
    cannot encode. Iterative: a deeply nested body must not overflow the stack here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("invalid Unicode: the string holds a lone surrogate") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    _unicode = field_validator("*", mode="before")(_valid_unicode)


class GenerationRequest(_Body):
    # fields that would change the output, refused when set (never silently ignored)
    unsupported: ClassVar[tuple[str, ...]] = ()

    model: str | None = None
    adapter: str | None = None  # metrale extension; when present it wins over `model`
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension (vLLM)
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    max_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None  # extension (vLLM)
    min_tokens: StrictInt | None = None  # extension (vLLM): no EOS or stop before this many
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # extension (vLLM)
    logit_bias: dict[str, Number] | None = None
    min_p: Number | None = None  # extension (vLLM)
    prompt_logprobs: StrictInt | None = None  # extension (vLLM)
    # output constraints: OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* fields (structured_request.py reads them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: every streamed chunk carries the usage
        so far. As in vLLM it takes effect together with include_usage."""
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))

    def refuse_unsupported(self) -> None:
        for name in self.unsupported:
            if getattr(self, name):
                raise BadRequestError(f"{name} is not supported by this server", name)

    def constraint(self) -> StructuredOutput | None:
        return constraint_of(self)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutput | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises InvalidSamplingParamsError (400) on out-of-range values, naming the
        request's field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, seed=self.seed, stop=tuple(stop),
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                min_tokens=self.min_tokens or 0,
                n=1 if self.n is None else self.n,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.logit_bias or (), min_p=self.min_p or 0.0,
                prompt_logprobs=prompt_logprobs, structured=structured,
            )
        except InvalidSamplingParamsError as e:
            # the engine names its own field ("logprobs must be ..."): say the request's
            field = e.param and self.api_param(e.param)
            message = str(e)
            if field and field != e.param and message.startswith(e.param):
                message = field + message[len(e.param):]
            raise InvalidSamplingParamsError(message, field) from None

    def api_param(self, engine_name: str) -> str:
        """The request field a SamplingParams field comes from."""
        return engine_name


class CompletionRequest(GenerationRequest):
    unsupported = GenerationRequest.unsupported + ("suffix",)

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise BadRequestError("only best_of=1 is supported", "best_of")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs shows the prompt's tokens with theirs."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; batches of prompts are refused (use n for
        several completions of one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(t, int) for t in p):
            return list(p)
        if len(p) == 1:
            return p[0]
        raise BadRequestError("send exactly one prompt per request (a string or a list of "
                              "token ids)", "prompt")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: only text can be served
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequestError("only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: arguments as an object (templates
    write them with tojson; a JSON string would be encoded twice)."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: the template gets the text
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": args}}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise BadRequestError("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs requires logprobs=true", "top_logprobs")

    def api_param(self, engine_name: str) -> str:
        if engine_name == "logprobs":
            return "top_logprobs"
        if engine_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return engine_name

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):  # vLLM's /tokenize: a prompt or chat messages
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # as vLLM: false leaves out the tokenizer's BOS/EOS; true (default) gives the very ids
    # this server's generation gets, which encodes every prompt with them
    add_special_tokens: StrictBool = True

    def refuse_unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequestError("send exactly one of prompt and messages", "prompt")


class DetokenizeRequest(BaseModel):  # vLLM's /detokenize
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]


class LoadLoraRequest(BaseModel):  # vLLM's /v1/load_lora_adapter
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):  # vLLM's /v1/unload_lora_adapter
    lora_name: str
    lora_int_id: int | None = None


class SlotLoadRequest(BaseModel):  # the original engine's /v1/lora/load
    name: str
    path: str
    slot: int
    reload: bool = False  # an existing name is refused unless this declares a reload


class ActiveAdapterRequest(BaseModel):  # the original engine's /v1/lora/active
    adapter: str | None


class RegisterRequest(BaseModel):
    name: str
    path: str
    pinned: bool = False


class SwapRequest(BaseModel):
    slot: int
