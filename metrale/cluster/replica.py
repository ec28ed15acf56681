"""EngineReplica: one engine in the cluster, as a Ray Serve deployment class: a whole
single-engine server (AsyncEngine and create_app's app) on its own port behind the
cluster's internal key, plus generate(), routing stats, an exporter and RegistrySync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import AsyncIterator

import ray
import torch
import uvicorn
from fastapi import APIRouter, Depends
from ray import serve

from metrale.cluster.config import ReplicaSpec
from metrale.cluster.staging import PeerStager
from metrale.cluster.stats import routing_stats
from metrale.cluster.sync import RegistrySync
from metrale.engine.llm import LLM
from metrale.engine.registry import AdapterSource
from metrale.engine.sampling_params import SamplingParams
from metrale.errors import MetraleError
from metrale.server.app import create_app
from metrale.server.async_engine import AsyncEngine
from metrale.server.auth import require_admin
from metrale.server.engine_api import EngineLimits
from metrale.server.settings import ServerSettings

log = logging.getLogger("metrale.cluster")


class EngineReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        torch.set_num_threads(spec.torch_threads)  # replicas share the host's cores
        self.spec = spec
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # built outside Serve (tests of this class alone)
            self.replica_id = f"local-{id(self):x}"
        llm = LLM(spec.model, max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
                  host_tier_bytes=spec.host_tier_bytes, adapter_eviction=spec.adapter_eviction,
                  device=spec.device, dtype=spec.dtype, max_model_len=spec.max_model_len,
                  quantization=spec.quantization, fp8_activations=spec.fp8_activations,
                  promotion_timeout_s=spec.promotion_timeout_s, peer_allow=spec.peer_allow,
                  peer_transport=spec.peer_transport, peer_timeout_s=spec.peer_timeout_s,
                  **({"num_kv_blocks": spec.num_kv_blocks} if spec.num_kv_blocks else {}))
        self.model_id = llm.model_dir.name
        self.engine = AsyncEngine(llm.engine, on_fatal=self._engine_failed)
        self.engine.start()
        self.peer_server = self.engine.export(spec.host, 0, spec.peer_allow, spec.peer_transport)
        self.peer_addr = self.peer_server.url.removeprefix("http://")
        self.stager = PeerStager(self.engine, self._holders)
        self.arrivals = self.hits = 0  # adapter requests, and those whose adapter was READY
        self.url = self._start_http()
        registry = ray.get_actor(spec.registry_name, namespace=spec.registry_namespace)
        self.sync = RegistrySync(
            self.engine,
            lambda applied, resident, errors: registry.poll.remote(
                self.replica_id, applied, self.peer_addr, self.url, resident, errors),
            lambda: registry.beat.remote(self.replica_id))
        threading.Thread(target=asyncio.run, args=(self.sync.run(),), name="metrale-cluster-sync",
                         daemon=True).start()
        log.info("replica %s: engine up, peers at %s, http at %s", self.replica_id,
                 self.peer_addr, self.url)

    @staticmethod
    def _engine_failed(error: BaseException) -> None:
        # Serve's health check (check_health) reports it; the controller replaces us
        log.error("replica engine failed: %r", error)

    # --- Serve hooks ------------------------------------------------------------------

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"engine stopped: {self.engine.error!r}")

    async def record_routing_stats(self) -> dict:
        return await self.engine.call(lambda: routing_stats(self.engine.engine))

    # --- requests ---------------------------------------------------------------------

    async def engine_limits(self) -> EngineLimits:
        return self.engine.limits

    async def validate(self, name: str, path: str | AdapterSource, verify_on_landing: bool = False):
        """Check an adapter's files against this engine (the cluster validates once, here):
        (True, AdapterSource) or (False, the typed refusal)."""
        try:
            return True, await self.engine.check_adapter(
                name, AdapterSource.of(path, verify_on_landing))
        except MetraleError as e:
            return False, e

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       adapter: str | None = None) -> AsyncIterator[tuple[str, object]]:
        """(replica id, RequestOutput) per step; a refusal arrives as (replica id, error)
        and ends the stream, so its class and message cross Ray untouched."""
        try:
            staged = False
            if adapter is not None:
                self.arrivals += 1
                # residency as last reported to the registry: only a hint, ensure() re-checks
                if adapter not in self.sync.resident and self.spec.stage_from_peers \
                        and self._holders(adapter):
                    staged = (await self.stager.ensure(adapter)).source == "peer"
            first = adapter is not None
            async for out in self.engine.generate(prompt, params, adapter):
                if first:  # READY on arrival: bound with no wait, and not staged for it
                    self.hits += out.adapter_wait_s == 0 and not staged
                    first = False
                yield self.replica_id, out
        except MetraleError as e:
            yield self.replica_id, e

    # --- the neighbours ---------------------------------------------------------------

    def _holders(self, name: str) -> list[str]:
        want = self.sync.applied.get(name)
        if want is None:
            return []
        return [addr for addr, resident in self.sync.others.values()
                if addr and resident.get(name) == want.version]

    # --- this replica's own HTTP server -------------------------------------------------

    def _start_http(self) -> str:
        settings = ServerSettings(model_id=self.model_id, host=self.spec.host,
                                  api_key=self.spec.internal_key, admin_key=self.spec.internal_key,
                                  public_metrics=self.spec.public_metrics)
        app = create_app(self.engine, settings)
        internal = APIRouter(dependencies=[Depends(require_admin)])

        @internal.post("/internal/stage/{name:path}")  # a name may hold '/'
        async def stage(name: str) -> dict:
            """Make `name` resident here: from a neighbour if one holds it, else from disk."""
            record = await self.stager.ensure(name)
            if record.source != "peer":
                await self.engine.promote(name)
            return {"replica": self.replica_id, "source": record.source, "peer": record.peer}

        @internal.get("/internal/staging")
        async def staging() -> dict:
            return {"replica": self.replica_id, "adapter_requests": self.arrivals,
                    "adapter_hits": self.hits,
                    "records": [r.__dict__ for r in self.stager.records]}

        app.include_router(internal)
        sock = socket.socket(socket.AF_INET6 if ":" in self.spec.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.spec.host, 0))
        host, port = sock.getsockname()[:2]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),),
                         name="metrale-replica-http", daemon=True).start()
        shown = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
        return f"http://{shown}:{port}"

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.sync.stop()
            self.peer_server.close()


def multiplexed_replica(max_models: int) -> type:
    """EngineReplica as Ray Serve's multiplexing sees a model server: each adapter is a
    multiplexed model id, in a per-replica LRU of max_models (the baseline routing)."""

    class MultiplexedEngineReplica(EngineReplica):
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def load_adapter(self, model_id: str) -> str:
            return model_id  # the engine lands it on demand; Ray only tracks the id

        async def generate(self, prompt, params, adapter=None):
            if adapter is not None:
                await self.load_adapter(adapter)
            async for item in super().generate(prompt, params, adapter):
                yield item

    return MultiplexedEngineReplica
