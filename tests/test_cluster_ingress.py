"""The cluster ingress's app without Ray Serve: its replicas and registry stand-ins that
answer when the test says so. /health answers (503 starting) while no replica is up,
instead of the ingress waiting for one before it serves anything; its own metrale_*
request series move as requests stream through it; each replica's /metrics is public
exactly when the ingress's is."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray")

from metrale.cluster.config import ClusterConfig, ReplicaSpec  # noqa: E402
from metrale.cluster.ingress import ClusterEngine  # noqa: E402
from metrale.cluster.launch import metrics_public  # noqa: E402
from metrale.engine.outputs import RequestOutput  # noqa: E402
from metrale.server.app import create_app  # noqa: E402
from metrale.server.engine_api import EngineLimits  # noqa: E402
from metrale.server.settings import ServerSettings  # noqa: E402


class Remote:
    """A Ray remote method's stand-in: .remote() answers `value` at once, or, with
    pending=True, an awaitable the test resolves (a replica still loading the model)."""

    def __init__(self, value=None, pending: bool = False) -> None:
        self.future: asyncio.Future | None = None
        self.value, self.pending = value, pending

    def remote(self, *args, **kw):
        if self.pending:
            if self.future is None:
                self.future = asyncio.get_running_loop().create_future()
            return self.future
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.value)
        return fut


class Stream:
    """The replicas' stream of one request: yields what the test puts in its queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return "replica-0", item

    def cancel(self) -> None:
        pass


class Handle:
    def __init__(self) -> None:
        self.engine_limits = Remote(pending=True)
        self.streams: list[Stream] = []
        self.generate = self

    def options(self, **kw):
        return self

    def remote(self, prompt, params, adapter=None):
        stream = Stream()
        self.streams.append(stream)
        return stream


class Registry:
    def __init__(self) -> None:
        self.started = Remote(False)
        self.members = Remote([])


async def _until(done) -> None:
    while not done():
        await asyncio.sleep(0)  # lets the ingress's own task run; no time passes


def _out(n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1, 2], "x" * n, list(range(n)), finished,
                         "length" if finished else None, adapter_wait_s=0.0, queue_wait_s=0.0)


def _engine(tmp_path):
    handle, registry = Handle(), Registry()
    spec = ReplicaSpec(model=str(tmp_path), registry_name="r", registry_namespace="n",
                       internal_key="k")
    return ClusterEngine(handle, registry, spec, ClusterConfig(replicas=1)), handle, registry


def test_health_answers_while_no_replica_is_up(tmp_path):
    async def main():
        engine, handle, registry = _engine(tmp_path)
        await asyncio.wait_for(engine.setup(), 5)  # returns without any replica answering
        app = create_app(engine, ServerSettings(model_id="m"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ingress") as client:
            r = await asyncio.wait_for(client.get("/health"), 5)
            assert r.status_code == 503 and r.json()["status"] == "starting"
            registry.started.value = True
            r = await asyncio.wait_for(client.get("/health"), 5)
            assert r.status_code == 503 and "replica" in r.json()["reason"]
            r = await asyncio.wait_for(client.get("/v1/models"), 5)  # needs the limits: 503
            assert r.status_code == 503
            handle.engine_limits.future.set_result(EngineLimits(1024, 100))
            await asyncio.wait_for(_until(lambda: engine.limits is not None), 5)
            r = await asyncio.wait_for(client.get("/health"), 5)
            assert r.status_code == 200, r.text
            assert (await client.get("/v1/models")).json()["data"][0]["max_model_len"] == 1024
        await engine.shutdown()

    asyncio.run(main())


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_ingress_request_series_move_as_requests_stream(tmp_path):
    from metrale.engine.sampling_params import SamplingParams

    async def main():
        engine, handle, registry = _engine(tmp_path)
        await engine.setup()

        def metric(name, labels=()):
            return _samples(engine.metrics.exposition().decode()).get((name, tuple(labels)), 0.0)

        async def consume(gen, sink):
            async for out in gen:
                sink.append(out)

        sinks = [[], []]
        tasks = [asyncio.ensure_future(consume(engine.generate([1, 2], SamplingParams(), "a"), s))
                 for s in sinks]
        while len(handle.streams) < 2:
            await asyncio.sleep(0)  # the tasks start their streams (no time passes here)
        assert metric("metrale_requests_waiting") == 2 and metric("metrale_requests_running") == 0
        for stream in handle.streams:
            stream.queue.put_nowait(_out(1))
        while any(not s for s in sinks):
            await asyncio.sleep(0)
        assert metric("metrale_requests_running") == 2 and metric("metrale_requests_waiting") == 0
        assert metric("metrale_time_to_first_token_seconds_count") == 2
        for stream in handle.streams:
            stream.queue.put_nowait(_out(3, finished=True))
            stream.queue.put_nowait(None)
        await asyncio.gather(*tasks)
        assert metric("metrale_requests_running") == 0
        assert metric("metrale_generation_tokens_total", [("adapter", "a")]) == 6
        assert metric("metrale_inter_token_latency_seconds_count") == 2
        assert metric("metrale_requests_finished_total", [("finish_reason", "length")]) == 2
        await engine.shutdown()

    asyncio.run(main())


def test_replica_metrics_are_public_exactly_when_the_ingress_metrics_are():
    assert metrics_public({"api_key": None, "public_metrics": False})
    assert metrics_public({"api_key": "k", "public_metrics": True})
    assert not metrics_public({"api_key": "k", "public_metrics": False})
