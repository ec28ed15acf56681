"""Adapter management over HTTP, in three dialects that share one implementation: vLLM's
(/v1/load_lora_adapter, /v1/unload_lora_adapter, /reset_prefix_cache), the original
engine's (/v1/lora/load, /v1/lora/active) and the native /v1/adapters.

Every mutation needs the admin key (auth.require_admin); client-supplied paths must
resolve inside --adapter-root (paths.resolve_adapter_path).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from metrale.adapters.confined import ConfinedDir
from metrale.engine.registry import PEER_SCHEME
from metrale.errors import AdapterExistsError
from metrale.names import validate_adapter_name
from metrale.server.auth import require_admin, require_user
from metrale.server.engine_api import app_context
from metrale.server.errors import BadRequestError
from metrale.server.paths import resolve_adapter_path
from metrale.server.protocol import (
    ActiveAdapterRequest,
    LoadLoraRequest,
    RegisterRequest,
    SlotLoadRequest,
    SwapRequest,
    UnloadLoraRequest,
)
from metrale.server.settings import ServerSettings, unknown_model

reads = APIRouter(dependencies=[Depends(require_user)])
admin = APIRouter(dependencies=[Depends(require_admin)])


def _adapter_source(raw: object, settings: ServerSettings, param: str) -> str | ConfinedDir:
    """A peer URI (the engine checks the peer against --peer-allow when it lands),
    or a directory confined to --adapter-root."""
    if isinstance(raw, str) and raw.startswith(PEER_SCHEME):
        return raw
    return resolve_adapter_path(raw, settings.adapter_roots, param)


# --- vLLM ------------------------------------------------------------------------------


@admin.post("/v1/load_lora_adapter")
async def vllm_load(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    engine, settings = app_context(request)
    path = _adapter_source(body.lora_path, settings, "lora_path")
    try:
        await engine.register(body.lora_name, path, reload=body.load_inplace)
    except AdapterExistsError:  # vLLM answers 400 here, and so do we
        raise BadRequestError(f"The lora adapter '{body.lora_name}' has already been loaded. "
                              'Send "load_inplace": true to replace it.', "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@admin.post("/v1/unload_lora_adapter")
async def vllm_unload(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    engine, _ = app_context(request)
    await engine.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@admin.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    engine, _ = app_context(request)
    dropped = await engine.reset_prefix_cache()
    return {"status": "ok", "dropped_blocks": dropped}


# --- the original engine's endpoints ---------------------------------------------------------


@admin.post("/v1/lora/load")
async def slot_load(body: SlotLoadRequest, request: Request) -> dict:
    engine, settings = app_context(request)
    path = resolve_adapter_path(body.path, settings.adapter_roots, "path")
    try:
        view = await engine.swap(body.name, body.slot, path, reload=body.reload)
    except AdapterExistsError as e:
        raise AdapterExistsError(f'{e} (send "reload": true)') from None
    return {"adapter": view.as_dict()}


@admin.post("/v1/lora/active")
async def set_active(body: ActiveAdapterRequest, request: Request) -> dict:
    engine, settings = app_context(request)
    name = body.adapter or None
    if name is not None and name != settings.model_id:
        validate_adapter_name(name)
        if not await engine.is_known(name):
            raise unknown_model(name, settings)
    settings.default_adapter = None if name == settings.model_id else name
    return {"adapter": settings.default_adapter}


@reads.get("/v1/lora/active")
async def get_active(request: Request) -> dict:
    return {"adapter": request.app.state.settings.default_adapter}


# --- native ---------------------------------------------------------------------------------


@reads.get("/v1/adapters")
async def list_adapters(request: Request) -> dict:
    engine, settings = app_context(request)
    listing = await engine.residency()
    return {"model": settings.model_id, "default_adapter": settings.default_adapter,
            "adapters": [a.as_dict() for a in listing.adapters], "slots": listing.slots}


@admin.post("/v1/adapters", status_code=201)
async def register(body: RegisterRequest, request: Request) -> JSONResponse:
    engine, settings = app_context(request)
    path = _adapter_source(body.path, settings, "path")
    view = await engine.register(body.name, path, pinned=body.pinned)
    return JSONResponse({"adapter": view.as_dict()}, status_code=201)


# Adapter names may hold '/' (org/adapter): the routes take the rest of the path, and
# the name is checked before anything else sees it (a 400 names the rule).


@admin.post("/v1/adapters/{name:path}/promote")
async def promote(name: str, request: Request) -> dict:
    engine, _ = app_context(request)
    view, evicted = await engine.promote(validate_adapter_name(name))
    return {"adapter": view.as_dict(), "evicted": evicted}


@admin.post("/v1/adapters/{name:path}/swap")
async def swap(name: str, body: SwapRequest, request: Request) -> dict:
    engine, _ = app_context(request)
    view = await engine.swap(validate_adapter_name(name), body.slot)
    return {"adapter": view.as_dict()}


@admin.post("/v1/adapters/{name:path}/pin")
async def pin(name: str, request: Request) -> dict:
    engine, _ = app_context(request)
    return {"adapter": (await engine.pin(validate_adapter_name(name), True)).as_dict()}


@admin.post("/v1/adapters/{name:path}/unpin")
async def unpin(name: str, request: Request) -> dict:
    engine, _ = app_context(request)
    return {"adapter": (await engine.pin(validate_adapter_name(name), False)).as_dict()}


@admin.delete("/v1/adapters/{name:path}")
async def unload(name: str, request: Request) -> dict:
    engine, _ = app_context(request)
    status = await engine.unload(validate_adapter_name(name))
    return {"name": name, "status": status}
