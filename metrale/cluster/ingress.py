"""The cluster's HTTP ingress: the single-engine server's app (create_app) over
ClusterEngine, the cluster's EngineAPI (docs/DESIGN.md, "The ingress reuses the server").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote

import httpx
import ray
import torch
from fastapi import Depends
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from metrale.adapters.confined import ConfinedDir
from metrale.cluster.config import ClusterConfig, ReplicaSpec
from metrale.cluster.ingress_metrics import RequestSeries
from metrale.cluster.replica_metrics import merge_replica_series
from metrale.engine.llm import load_tokenizer
from metrale.engine.outputs import RequestOutput
from metrale.engine.registry import AdapterSource, AdapterVersion
from metrale.engine.sampling_params import GREEDY_EPS, SamplingParams
from metrale.errors import UnknownAdapterError
from metrale.server.app import create_app
from metrale.server.auth import require_user
from metrale.server.engine_api import AdapterListing, EngineLimits
from metrale.server.errors import EngineUnavailableError, ServerError
from metrale.server.metrics import ServerMetrics
from metrale.server.settings import ServerSettings

log = logging.getLogger("metrale.cluster")
_REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
_STATES = ("READY", "LOADING", "EMPTY", "DISK")  # best first, for the cluster-wide summary


@dataclass(frozen=True)
class ClusterAdapterView:
    """One adapter across the cluster: the registry's view plus each replica's."""

    name: str
    path: str | None
    pinned: bool
    version: int | None
    replicas: dict[str, dict] = field(default_factory=dict)  # replica id -> its AdapterView
    slot: int | None = None  # these three per replica only; kept for the shared views' shape
    uid: int | None = None
    last_used: int | None = None
    errors: dict[str, str] = field(default_factory=dict)  # replica id -> why it did not apply

    @classmethod
    def of(cls, name: str, version: AdapterVersion | None, replicas: dict[str, dict],
           errors: dict[str, str] | None = None) -> ClusterAdapterView:
        """version: the registry's (None once unloaded, while replicas still drain it)."""
        return cls(name, str(version.source) if version else None, bool(version and version.pinned),
                   version.version if version else None, replicas, errors=errors or {})

    @property
    def state(self) -> str:
        states = [r["state"] for r in self.replicas.values()] or ["DISK"]
        return min(states, key=lambda s: _STATES.index(s) if s in _STATES else len(_STATES))

    @property
    def ref_count(self) -> int:
        return sum(r["ref_count"] for r in self.replicas.values())

    @property
    def unloading(self) -> bool:
        return any(r["unloading"] for r in self.replicas.values())

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "pinned": self.pinned,
                "version": self.version, "state": self.state, "ref_count": self.ref_count,
                "unloading": self.unloading, "replicas": self.replicas, "errors": self.errors}


class ClusterEngine:
    def __init__(self, handle: DeploymentHandle, registry, spec: ReplicaSpec,
                 cluster: ClusterConfig) -> None:
        self.handle, self.registry, self.spec, self.cluster = handle, registry, spec, cluster
        self.metrics = ServerMetrics(vllm_series=False)  # the replicas' come with `replica`
        self.alive, self.error = True, None
        self.served: dict[str, Counter] = defaultdict(Counter)  # adapter -> replica -> n
        self.retried = 0
        self._started = False
        self.tokenizer = None  # the base model's, set by setup()
        self.limits: EngineLimits | None = None  # the replicas', once one is up
        self._limits_task: asyncio.Task | None = None
        self._http = httpx.AsyncClient(timeout=cluster.sync_timeout_s, headers={
            "Authorization": f"Bearer {spec.internal_key}"})

    async def setup(self) -> None:
        """The ingress's own state only: waiting here for a replica would keep the whole
        ingress (its /health too) from answering while the replicas load the model."""
        self.tokenizer = load_tokenizer(Path(self.spec.model))
        self._limits_task = asyncio.ensure_future(self._fetch_limits())

    async def _fetch_limits(self) -> None:
        while self.limits is None and self.alive:
            try:
                self.limits = await self.handle.engine_limits.remote()
            except Exception as e:  # a replica that failed to start: Serve replaces it
                log.warning("no replica answered its limits yet (%s); asking again", e)
                await asyncio.sleep(1.0)  # the pause between two asks, not a wait for an event

    # --- EngineAPI ----------------------------------------------------------------------

    def start(self) -> None:
        pass  # replicas run their own engines

    async def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        self.alive = False
        if self._limits_task is not None:
            self._limits_task.cancel()
        await self._http.aclose()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """A replica that dies takes its requests with it; each is resent to another
        replica (up to `retries` times). Greedy or seeded requests are replayed even
        mid-stream: the outputs already delivered are skipped by token count, the new
        replica produces the same tokens. A sampled request that already streamed
        tokens cannot be replayed faithfully and fails with 503."""
        series = RequestSeries(self.metrics, adapter)
        try:
            async for out in self._generate(prompt, params, adapter):
                series.output(out)
                yield out
        finally:
            series.end()

    async def _generate(self, prompt: str | list[int], params: SamplingParams,
                        adapter: str | None) -> AsyncIterator[RequestOutput]:
        delivered: dict[int, int] = {}  # per completion index: tokens the client has
        deterministic = params.temperature < GREEDY_EPS or params.seed is not None
        for attempt in range(self.cluster.retries + 1):
            options = {"stream": True}
            if adapter is not None and self.cluster.routing == "ray_default":
                options["multiplexed_model_id"] = adapter  # what Ray's own router reads
            stream = self.handle.options(**options).generate.remote(prompt, params,
                                                                    adapter=adapter)
            try:
                async for replica_id, out in stream:
                    if isinstance(out, BaseException):
                        raise out
                    if out.error is not None:
                        raise out.error
                    if len(out.token_ids) <= delivered.get(out.index, 0) and not out.finished:
                        continue  # a replay of what the client already has
                    if not delivered and out.token_ids:
                        self.served[adapter or ""][replica_id] += 1
                    delivered[out.index] = len(out.token_ids)
                    yield out
                return
            except _REPLICA_GONE as e:
                if any(delivered.values()) and not deterministic:
                    raise EngineUnavailableError(
                        "the replica serving this request died after streaming part of a "
                        "sampled answer; retry the request") from e
                self.retried += 1
                log.warning("replica lost mid-request (%s); resending (attempt %d)",
                            type(e).__name__, attempt + 1)
            finally:
                stream.cancel()
        raise EngineUnavailableError("no replica could serve this request; retry later")

    async def register(self, name: str, path: str | Path | ConfinedDir | AdapterSource,
                       pinned: bool = False,
                       reload: bool = False, verify_on_landing: bool = False) -> ClusterAdapterView:
        """Validated once, by one replica, for all; verify_on_landing (a name from
        --adapter-source): its config and header only, each replica bounds the weights at
        their first landing there."""
        unwrap(await self.registry.check_new.remote(name, reload))  # before any I/O
        # a root crosses as is
        spec = AdapterSource.of(path) if isinstance(path, ConfinedDir | AdapterSource) else str(path)
        source = unwrap(await self.handle.validate.remote(name, spec, verify_on_landing))
        version = unwrap(await self.registry.register.remote(name, source, pinned, reload))
        return await self.view(name, await self._applied(version, name))

    async def pin(self, name: str, pinned: bool = True) -> ClusterAdapterView:
        version = unwrap(await self.registry.set_pinned.remote(name, pinned))
        return await self.view(name, await self._applied(version, name))

    async def unload(self, name: str) -> str:
        version = unwrap(await self.registry.unload.remote(name))
        await self._applied(version, name)
        views = (await self.residency()).adapters
        return "draining" if any(v.name == name for v in views) else "unloaded"

    async def promote(self, name: str) -> tuple[ClusterAdapterView, None]:
        """Resident on every replica: the holders first, then the others, one by one, so
        each can stage it from a neighbour instead of its disk."""
        if await self.registry.get.remote(name) is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        members = await self.registry.members.remote()
        members.sort(key=lambda m: name not in m.resident)
        for m in members:
            await self._post(m.url, f"/internal/stage/{quote(name, safe='')}")
        return await self.view(name), None

    async def swap(self, name: str, slot: int,
                   path: str | Path | ConfinedDir | AdapterSource | None = None,
                   reload: bool = False) -> ClusterAdapterView:
        """Into `slot` on every replica (registering `path` cluster-wide first)."""
        if path is not None:
            await self.register(name, path, reload=reload)
        for m in await self.registry.members.remote():
            await self._post(m.url, f"/v1/adapters/{quote(name, safe='')}/swap", {"slot": slot})
        return await self.view(name)

    async def is_known(self, name: str) -> bool:
        return await self.registry.get.remote(name) is not None

    async def exposition(self) -> bytes:
        """The ingress's own series, then every live replica's vLLM series with a
        `replica` label (a replica that does not answer is left out of this scrape)."""
        texts = {}
        for m in await self.registry.members.remote():
            try:
                r = await self._http.get(m.url + "/metrics")
                r.raise_for_status()
                texts[m.replica_id] = r.text
            except httpx.HTTPError as e:
                log.warning("metrics of replica %s not read: %s", m.replica_id, e)
        return self.metrics.exposition() + merge_replica_series(texts).encode()

    async def starting(self) -> str | None:
        if not self._started:  # once true it stays true: ask the registry until then
            self._started = await self.registry.started.remote()
        if not self._started:
            return "registering the start-up adapters"
        return None if self.limits is not None else "waiting for a replica to start"

    async def reset_prefix_cache(self) -> int:
        total = 0
        for m in await self.registry.members.remote():
            total += (await self._post(m.url, "/reset_prefix_cache"))["dropped_blocks"]
        return total

    async def residency(self) -> AdapterListing:
        """Every replica's adapters and slots, live from each replica."""
        members = await self.registry.members.remote()
        answers = await asyncio.gather(*(self._get(m.url, "/v1/adapters") for m in members),
                                       return_exceptions=True)
        per_name: dict[str, dict[str, dict]] = defaultdict(dict)
        slots = {}
        for m, doc in zip(members, answers):
            if isinstance(doc, BaseException):
                continue  # a replica going away: the others still answer
            slots[m.replica_id] = doc["slots"]
            for a in doc["adapters"]:
                per_name[a["name"]][m.replica_id] = a
        views = [ClusterAdapterView.of(name, await self.registry.get.remote(name), per_name[name])
                 for name in sorted(per_name)]
        return AdapterListing(views, slots)

    async def view(self, name: str, errors: dict[str, str] | None = None) -> ClusterAdapterView:
        """errors: replicas that could not apply the change (e.g. every slot pinned there):
        the change stands in the registry, and those replicas retry it on the next change."""
        for v in (await self.residency()).adapters:
            if v.name == name:
                return replace(v, errors=errors or {})
        return ClusterAdapterView.of(name, await self.registry.get.remote(name), {}, errors)

    async def stats(self) -> dict:
        """The ingress's own record, for operators and tests: who served what, retries,
        each replica's residency as the registry has it, and its staging record."""
        members = await self.registry.members.remote()
        staging = await asyncio.gather(*(self._get(m.url, "/internal/staging") for m in members),
                                       return_exceptions=True)
        replicas = {}
        for m, s in zip(members, staging):
            s = {} if isinstance(s, BaseException) else s  # a replica going away
            replicas[m.replica_id] = {
                "url": m.url, "peer": m.peer_addr, "applied": m.applied, "resident": m.resident,
                "errors": m.errors, "staging": s.get("records", []),
                "adapter_requests": s.get("adapter_requests"), "adapter_hits": s.get("adapter_hits")}
        return {"served": {a: dict(c) for a, c in self.served.items()}, "retried": self.retried,
                "replicas": replicas}

    # --- helpers ----------------------------------------------------------------------

    async def _applied(self, version: int, name: str) -> dict[str, str]:
        """Wait for every live replica to apply `version`; {replica: error} of those that
        could not (or did not within sync_timeout_s)."""
        lagging = await self.registry.wait_applied.remote(version, self.cluster.sync_timeout_s)
        errors = {rid: f"not applied within {self.cluster.sync_timeout_s:.0f}s" for rid in lagging}
        for m in await self.registry.members.remote():
            if name in m.errors:
                errors[m.replica_id] = m.errors[name]
        for rid, error in errors.items():
            log.warning("replica %s: change %d of %r: %s", rid, version, name, error)
        return errors

    async def _get(self, url: str, path: str) -> dict:
        r = await self._http.get(url + path)
        r.raise_for_status()
        return r.json()

    async def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        r = await self._http.post(url + path, json=body)
        if r.status_code >= 400:  # a replica's refusal: the same typed error JSON
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise ReplicaRefusal(r.status_code, message)
        return r.json()


class ReplicaRefusal(ServerError):
    """A replica refused a fanned-out admin call; its status code passes through."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (ReplicaRefusal, (self.status, str(self)))


def unwrap(result):
    ok, value = result
    if not ok:
        raise value
    return value


class ClusterIngress:
    """The ingress deployment: `serve.ingress()` calls __serve_build_asgi_app__ after
    __init__, so the app is built with the live ClusterEngine (its setup reads the replicas)."""

    def __init__(self, replicas: DeploymentHandle, spec: ReplicaSpec, cluster: ClusterConfig,
                 settings_kwargs: dict) -> None:
        torch.set_num_threads(1)  # the ingress only tokenizes: keep torch off the replicas' cores
        self.registry = ray.get_actor(spec.registry_name, namespace=spec.registry_namespace)
        self.cluster_engine = ClusterEngine(replicas, self.registry, spec, cluster)
        self.settings_kwargs = settings_kwargs

    async def __serve_build_asgi_app__(self):
        await self.cluster_engine.setup()
        settings = ServerSettings(started=time.time(), **self.settings_kwargs)
        app = create_app(self.cluster_engine, settings)
        app.add_api_route("/v1/cluster", self.cluster_engine.stats,
                          dependencies=[Depends(require_user)])
        return app
