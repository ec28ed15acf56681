"""create_app: the FastAPI application over one engine (engine_api.EngineAPI: the
single engine's AsyncEngine, or the cluster's ingress).

Every refusal leaves as OpenAI error JSON with an honest status code and is
counted in metrale_refusals_total by class name; nothing a client sends can
stop the server from answering the next request.
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.errors import MetraleError
from metrale.server import admin_api, openai_api
from metrale.server.auth import PING_PATH, AuthGate, refusal
from metrale.server.engine_api import EngineAPI
from metrale.server.errors import PayloadTooLargeError, error_body
from metrale.server.metrics import ServerMetrics
from metrale.server.settings import ServerSettings

log = logging.getLogger("metrale.server")


class BodyLimit:
    """413 for request bodies over max_bytes, declared (Content-Length) or streamed
    (chunked: buffered up to the limit, then replayed to the app)."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnect: let the app see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send) -> None:
        error = PayloadTooLargeError(f"request body exceeds {self.max_bytes} bytes")
        await refusal(error, self.metrics)({"type": "http"}, _no_receive, send)


class HeadAsGet:
    """HEAD is answered on every GET route (as Starlette's own routes do, FastAPI's not):
    run the GET, keep its status and headers (Content-Length included), drop the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(engine: EngineAPI, settings: ServerSettings) -> FastAPI:
    """The app; its lifespan starts the engine thread and shuts it down gracefully."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.started = settings.started or time.time()
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="metrale", lifespan=lifespan)
    app.state.engine, app.state.settings = engine, settings
    metrics = engine.metrics
    metrics.vllm.bind(settings.model_id)  # vLLM's series carry the served model's name

    @app.exception_handler(MetraleError)
    async def _metrale(request: Request, exc: MetraleError) -> JSONResponse:
        return refusal(exc, metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.refusals.labels("RequestValidationError").inc()
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            reason = (errors[0].get("ctx") or {}).get("error", "")
            message, param = f"the request body is not valid JSON: {reason}", None
        else:
            locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
            message = "; ".join(f"{'.'.join(loc) or 'body'}: {e.get('msg')}"
                                for loc, e in zip(locs, errors)) or "invalid request"
            # the request's field; deeper parts of loc name pydantic's union members, not fields
            param = locs[0][0] if locs and locs[0] else None
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.refusals.labels("HTTPException").inc()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # a bug: 500
        log.error("internal error", exc_info=exc)
        return refusal(exc, metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.alive:
            waiting = await engine.starting()
            if waiting is not None:
                return JSONResponse({"status": "starting", "reason": waiting}, status_code=503)
            return JSONResponse({"status": "ok", "model": settings.model_id})
        reason = f"engine failed: {engine.error!r}" if engine.error else "engine stopped"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    # vLLM's (and SageMaker's) liveness probe, GET or POST: /health by another name
    app.add_api_route(PING_PATH, health, methods=["GET", "POST"])

    @app.get("/metrics")
    async def prometheus() -> Response:
        if engine.alive:
            metrics.adapter_resident.clear()
            for a in (await engine.residency()).adapters:
                slot = "none" if a.slot is None else str(a.slot)
                metrics.adapter_resident.labels(a.name, slot, a.state).set(1)
        text = await engine.exposition() if engine.alive else metrics.exposition()
        return Response(text, media_type="text/plain; version=0.0.4")

    app.include_router(openai_api.router)
    app.include_router(admin_api.reads)
    app.include_router(admin_api.admin)
    app.add_middleware(HeadAsGet)  # innermost: AuthGate still sees, and judges, the HEAD
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics)
    # added last, so outermost: the key is checked before the body is even measured
    app.add_middleware(AuthGate, settings=settings, metrics=metrics, is_admin=_is_admin,
                       docs_paths=_docs_paths(app))
    return app


def _is_admin(scope: Scope) -> bool:
    """A request for a mutation route (method included: GET /v1/lora/active is a read)."""
    return any(route.matches(scope)[0] is Match.FULL for route in admin_api.admin.routes)


def _docs_paths(app: FastAPI) -> frozenset[str]:
    return frozenset(p for p in (app.docs_url, app.redoc_url, app.openapi_url,
                                 app.swagger_ui_oauth2_redirect_url) if p)
