"""The OpenAI-compatible inference endpoints: /v1/completions,
/v1/chat/completions (plain and SSE streaming), /v1/models, and vLLM's
/tokenize and /detokenize.

Which adapter answers: an `adapter` field, when present, wins; else `model`
names it (also as `base:adapter`). The base model's id, or no model at all,
means "no adapter named": the server's default adapter (POST /v1/lora/active)
if one is set, else the base model. `adapter: null` or the base id in
`adapter` always means the base model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import metrale
from metrale.engine.outputs import RequestOutput
from metrale.engine.sampling_params import SamplingParams
from metrale.errors import AdapterError, DrainingAdapterError, UnknownAdapterError
from metrale.names import is_valid_name
from metrale.server.auth import require_user
from metrale.server.engine_api import EngineAPI, app_context, known_limits
from metrale.server.errors import BadRequestError, exception_body
from metrale.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
)
from metrale.server.responses import ChatFormatter, CompletionFormatter, sse, token_text, usage
from metrale.server.settings import ServerSettings, unknown_model
from metrale.server.tool_request import ToolPlan, plan_tools, template_messages

router = APIRouter(dependencies=[Depends(require_user)])
T = TypeVar("T")

_DISCONNECT_POLL_S = 0.25
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientDisconnected(Exception):
    """The client went away; its request was aborted and nobody reads the answer."""


def resolve_adapter(body: GenerationRequest, settings: ServerSettings) -> str | None:
    explicit = "adapter" in body.model_fields_set
    name = body.adapter if explicit else body.model
    base_ids = (settings.model_id, "base")
    if name and name != settings.model_id:
        prefix, sep, rest = name.rpartition(":")
        if sep and prefix in base_ids:  # "base:adapter" / "<model id>:adapter"
            name = rest
    if not name or name == settings.model_id:
        return None if explicit else settings.default_adapter
    return name


async def register_from_sources(engine: EngineAPI, settings: ServerSettings, name: str) -> None:
    """A name no one registered yet, found in an --adapter-source, is registered now
    (source_registration.SourceRegistrar: once, however many requests name it)."""
    if settings.registrar is not None:
        await settings.registrar.ensure(engine, name)


def _max_tokens(requested: int | None, default: int, settings: ServerSettings,
                param: str = "max_tokens") -> int:
    """The request's token budget; out of range is refused naming the field as sent and
    this server's limit (not the engine's far larger sanity bound)."""
    if requested is None:
        return min(default, settings.max_tokens_limit)
    limit = settings.max_tokens_limit
    if not 1 <= requested <= limit:
        raise BadRequestError(
            f"{param} must be in [1, {limit}] on this server (its --max-tokens-limit), got "
            f"{requested if requested.bit_length() <= 64 else 'a larger integer'}", param)
    return requested


async def _watch(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts the request) if the client disconnects:
    Starlette cancels nothing by itself for a response not yet started."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _last(gen: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Each completion's last output, by index."""
    last: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(gen):
        async for out in gen:
            last[out.index] = out
    return [last[i] for i in sorted(last)]


async def _respond(request: Request, body: GenerationRequest, prompt: str | list[int],
                   params: SamplingParams, new_formatter) -> Response:
    """new_formatter(model id, token text): the request's CompletionFormatter or ChatFormatter."""
    engine, settings = app_context(request)
    adapter = resolve_adapter(body, settings)
    if adapter is not None:
        await register_from_sources(engine, settings, adapter)
    # `model` names what served the request: the adapter (also a server default one), or
    # the base model; never the alias the client sent
    fmt = new_formatter(adapter or settings.model_id, token_text(engine.tokenizer))
    gen = _generate(engine, settings, prompt, params, adapter)
    continuous_usage = body.continuous_usage
    if not body.stream:
        try:
            outs = await _watch(request, _last(gen))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(fmt.final(outs))
    # Wait for the first output before answering, so that refusals that come late
    # (POOL_FULL after the promotion wait, a broken adapter) still get their status code.
    try:
        first = await _watch(request, anext(gen))
    except ClientDisconnected:
        await gen.aclose()
        return Response(status_code=499)

    async def events() -> AsyncIterator[str]:
        async with contextlib.aclosing(gen):  # closing aborts the request (client gone)
            if isinstance(fmt, ChatFormatter):
                role = fmt.role_chunks(params.n)
                if continuous_usage:  # the prompt is counted; nothing generated yet
                    role["usage"] = usage(first, completion_tokens=0)
                yield sse(role)
            try:
                yield sse(_chunk(fmt, first, continuous_usage))
                async for out in gen:
                    yield sse(_chunk(fmt, out, continuous_usage))
            except Exception as e:  # the status line is sent: report in-band, then end
                engine.metrics.refusals.labels(type(e).__name__).inc()
                yield sse(exception_body(e)[1])
            else:
                if body.include_usage:
                    yield sse(fmt.usage_chunk())
            yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _generate(engine: EngineAPI, settings: ServerSettings, prompt: str | list[int],
                    params, adapter: str | None) -> AsyncIterator[RequestOutput]:
    """engine.generate, its unknown-adapter refusal naming the base model too; closing
    this closes (aborts) the engine's request."""
    gen = engine.generate(prompt, params, adapter)
    async with contextlib.aclosing(gen):
        try:
            async for out in gen:
                yield out
        except UnknownAdapterError as e:
            raise UnknownAdapterError(f"{_searched(e, adapter, settings)}; the base model is "
                                      f"{settings.model_id!r}") from None
        except AdapterError:
            if adapter is not None and settings.registrar is not None:  # a store's bad copy
                await asyncio.to_thread(settings.registrar.landing_refused, adapter)
            raise


def _searched(error: UnknownAdapterError, name: str | None, settings: ServerSettings) -> str:
    """The engine's 404; for a name never registered on a server with --adapter-source, where
    it was looked for (naming it cannot register a name no source holds)."""
    if settings.sources is None or name is None or isinstance(error, DrainingAdapterError):
        return str(error)
    searched = ", ".join(str(s) for s in settings.sources.sources)
    return (f"adapter {name!r} is not registered and no adapter source holds it (searched, in "
            f"order: {searched}); put it in one of them, or register it with POST /v1/adapters")


def _chunk(fmt, out: RequestOutput, continuous_usage: bool) -> dict:
    chunk = fmt.chunk(out)
    if continuous_usage:
        chunk["usage"] = fmt.usage_so_far()  # outputs are cumulative: the usage so far
    return chunk


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine, settings = app_context(request)
    body.refuse_unsupported()
    prompt = body.single_prompt()
    max_tokens = _max_tokens(body.max_tokens, _COMPLETIONS_DEFAULT_MAX_TOKENS, settings)
    params = body.sampling_params(max_tokens, body.logprobs, body.constraint(),
                                  body.engine_prompt_logprobs)
    echo = _prompt_text(engine, prompt) if body.echo else None
    return await _respond(request, body, prompt, params, lambda model, text: CompletionFormatter(
        model, text, body.logprobs is not None, echo))


def _prompt_text(engine: EngineAPI, prompt: str | list[int]) -> str:
    """What echo shows: the prompt as sent, or the text of its token ids."""
    if isinstance(prompt, str):
        return prompt
    if engine.tokenizer is None:
        return ""
    return engine.tokenizer.decode(prompt, skip_special_tokens=False)


def _chat_prompt(engine: EngineAPI, body: ChatCompletionRequest | TokenizeRequest,
                 tools: ToolPlan | None = None) -> str:
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequestError("this model has no chat template; use /v1/completions", "messages")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    messages = template_messages([m.as_template_dict() for m in body.messages], tools, template)
    extra = {"tools": list(tools.tools)} if tools is not None else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **extra)
    except Exception as e:  # jinja raises on roles/orders the template does not accept
        raise BadRequestError(f"the chat template refused these messages: {e}", "messages") from e


def _tool_plan(engine: EngineAPI, body: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan | None:
    template = getattr(engine.tokenizer, "chat_template", None)
    return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                      template if isinstance(template, str) else None, settings.tool_call_parser)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine, settings = app_context(request)
    body.refuse_unsupported()
    tools = _tool_plan(engine, body, settings)
    constraint = body.constraint()
    tool_constraint = tools.constraint() if tools is not None else None
    if tool_constraint is not None:
        if constraint is not None:
            raise BadRequestError(f"tool_choice {tools.choice} constrains the answer to tool "
                                  f"calls; it cannot be combined with {constraint.param}",
                                  "tool_choice")
        constraint = tool_constraint
    prompt = _chat_prompt(engine, body, tools)
    # Default: as long as the context allows (OpenAI's behaviour), capped by the server limit.
    room = known_limits(engine).max_seq_tokens - len(engine.tokenizer.encode(prompt))
    if room < 1:
        raise BadRequestError(f"the messages fill the model's context of "
                              f"{known_limits(engine).max_seq_tokens} tokens", "messages")
    max_tokens = _max_tokens(body.requested_max_tokens, room, settings,
                             body.api_param("max_tokens"))
    params = body.sampling_params(max_tokens, body.engine_logprobs, constraint)
    return await _respond(request, body, prompt, params, lambda model, text: ChatFormatter(
        model, text, bool(body.logprobs), tools))


def _tokenizer(engine: EngineAPI):
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise BadRequestError("this model has no tokenizer", "model")
    return tokenizer


async def _check_model(body: TokenizeRequest | DetokenizeRequest, engine: EngineAPI,
                       settings: ServerSettings) -> None:
    """An adapter named as `model` must exist (404 otherwise, as for generation); every
    adapter shares the base model's tokenizer."""
    name = body.model
    if name and name not in (settings.model_id, "base"):
        adapter = name.rpartition(":")[2]
        if adapter not in (settings.model_id, "base"):
            await register_from_sources(engine, settings, adapter)
            if not await engine.is_known(adapter):
                raise unknown_model(name, settings)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    engine, settings = app_context(request)
    body.refuse_unsupported()
    await _check_model(body, engine, settings)
    # the very ids generation would get: chat messages through the template, then
    # encoded as the engine encodes a text prompt
    text = body.prompt if body.messages is None else _chat_prompt(engine, body)
    tokens = _tokenizer(engine).encode(text, add_special_tokens=body.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": known_limits(engine).max_seq_tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    engine, settings = app_context(request)
    await _check_model(body, engine, settings)
    vocab = known_limits(engine).vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise BadRequestError(f"token ids must be in [0, {vocab})", "tokens")
    return {"prompt": _tokenizer(engine).decode(body.tokens)}


@router.get("/version")
async def version() -> dict:
    return {"version": metrale.__version__}


def _base_entry(engine: EngineAPI, settings: ServerSettings) -> dict:
    return {"id": settings.model_id, "object": "model", "created": int(settings.started),
            "owned_by": "metrale", "root": settings.model_id, "parent": None,
            "max_model_len": known_limits(engine).max_seq_tokens,
            "default_adapter": settings.default_adapter}


def _adapter_entry(a, settings: ServerSettings) -> dict:
    return {"id": a.name, "object": "model", "created": int(settings.started),
            "owned_by": "metrale", "root": a.name, "parent": settings.model_id,
            "residency": {"slot": a.slot, "uid": a.uid, "state": a.state, "pinned": a.pinned,
                          "last_used": a.last_used, "ref_count": a.ref_count,
                          "unloading": a.unloading}}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    engine, settings = app_context(request)
    listing = await engine.residency()
    data = [_base_entry(engine, settings)]
    data += [_adapter_entry(a, settings) for a in listing.adapters]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """One entry of /v1/models (an adapter id may hold '/'); 404 for anything else."""
    engine, settings = app_context(request)
    if model_id == settings.model_id:
        return _base_entry(engine, settings)
    if is_valid_name(model_id):
        listing = await engine.residency()
        for a in listing.adapters:
            if a.name == model_id:
                return _adapter_entry(a, settings)
    raise unknown_model(model_id, settings)
