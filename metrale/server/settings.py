"""What the HTTP layer needs to know that the engine does not: keys, limits,
where adapters may be loaded from, and the server-wide default adapter."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from metrale.adapters.fetch_deadline import FetchLimits
from metrale.adapters.sources import AdapterSources
from metrale.errors import UnknownAdapterError
from metrale.names import shown
from metrale.server.source_registration import SourceRegistrar


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot be reached from another machine.
    Anything else (0.0.0.0, ::, a hostname other than localhost) counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServerSettings:
    model_id: str  # the base model's name in /v1/models and in requests
    host: str = "127.0.0.1"
    api_key: str | None = None  # inference endpoints
    admin_key: str | None = None  # every mutation endpoint
    adapter_roots: tuple[Path, ...] = ()  # path-based loading only inside these; none = refused
    # names a request sends before anyone registered them are looked up here (none: off):
    # directories or s3://bucket/prefix URLs, the latter fetched into adapter_cache_dir
    adapter_sources: tuple[str, ...] = ()
    adapter_cache_dir: str | None = None
    adapter_cache_bytes: int = 20 << 30
    adapter_fetch: FetchLimits = field(default_factory=FetchLimits)  # deadlines, threads per source
    max_tokens_limit: int = 2048
    max_body_bytes: int = 1 << 20
    # With an API key set, /metrics and the API docs need it too unless opened here:
    # metrics name every adapter, the docs map every endpoint.
    public_metrics: bool = False  # /metrics without a key (a Prometheus scraper)
    public_docs: bool = False  # /docs, /redoc and /openapi.json without a key
    # Used by requests that name no adapter. Changed only by POST /v1/lora/active,
    # never by promotions or swaps: which adapter answers must not depend on cache state.
    default_adapter: str | None = None
    # the tool-call syntax (server/tool_formats.py's families); None: read from the template
    tool_call_parser: str | None = None
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        # Resolve once: a root that is itself a symlink is trusted as configured,
        # and containment checks compare resolved paths on both sides.
        self.adapter_roots = tuple(Path(r).resolve(strict=True) for r in self.adapter_roots)
        self.adapter_sources = tuple(str(r) for r in self.adapter_sources)  # s3:// stays a URL
        self.sources = AdapterSources(self.adapter_sources, cache_dir=self.adapter_cache_dir,
                                      cache_bytes=self.adapter_cache_bytes,
                                      limits=self.adapter_fetch) \
            if self.adapter_sources else None
        self.registrar = SourceRegistrar(self.sources) if self.sources is not None else None
        if self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")

    @property
    def admin_open_to_network(self) -> bool:
        """Mutations are disabled when reachable from other machines without an admin key."""
        return self.admin_key is None and not is_loopback(self.host)


def unknown_model(name: str, settings: ServerSettings) -> UnknownAdapterError:
    """The 404 of a `model` that is neither the base model nor a registered adapter."""
    searched = "" if settings.sources is None else (
        ", and no adapter source holds it (searched, in order: "
        f"{', '.join(str(s) for s in settings.sources.sources)})")
    return UnknownAdapterError(
        f"model {shown(name)} does not exist here: it is neither the base model "
        f"{settings.model_id!r} nor a registered adapter (see GET /v1/models){searched}")
