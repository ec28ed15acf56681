"""Prometheus metrics of one server (its own CollectorRegistry: two servers in
one process, e.g. in tests, never share counters) and the structured log line
of every adapter landing."""

from __future__ import annotations

import json
import logging
import re
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from metrale.peer.nixl_transport import transports_in_use
from metrale.server.vllm_metrics import VllmMetrics

log = logging.getLogger("metrale.server")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
_SAFE = re.compile(r"[A-Za-z0-9._:/-]+")


def kv(**fields: object) -> str:
    """key=value pairs for a log line; values with spaces or quotes are JSON-quoted
    so a hostile adapter name cannot forge extra fields or lines."""
    parts = []
    for key, value in fields.items():
        text = "null" if value is None else str(value)
        parts.append(f"{key}={text if _SAFE.fullmatch(text) else json.dumps(text)}")
    return " ".join(parts)


class ServerMetrics:
    def __init__(self, model_name: str = "", vllm_series: bool = True) -> None:
        """model_name labels the vLLM series; create_app binds the server's model id.
        vllm_series=False keeps vLLM's set off this exposition (a cluster's ingress shows its
        replicas' instead)."""
        self.registry = r = CollectorRegistry()
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        histogram = partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)
        self.adapter_resident = gauge(
            "metrale_adapter_resident", "1 per registered adapter, labelled by where it lives "
            "(slot 'none' and state 'DISK' when not resident)", ["adapter", "slot", "state"])
        self.swap_seconds = histogram(
            "metrale_adapter_swap_seconds", "Latency of landing an adapter into a given slot", ["source"])
        self.promote_seconds = histogram(
            "metrale_adapter_promote_seconds", "Latency of promoting an adapter into a victim slot",
            ["source"])
        self.landings = counter("metrale_adapter_landings", "Adapter swaps and promotions by outcome",
                                ["op", "source", "result"])
        self.refusals = counter("metrale_refusals", "Refused requests by reason (the error class)",
                                ["reason"])
        self.pool_full_waits = counter(
            "metrale_pool_full_waits", "Requests that had to wait for a free adapter slot")
        self.pool_full_waiting = gauge(
            "metrale_pool_full_waiting", "Requests waiting for a free adapter slot now")
        self.peer_transports = gauge(
            "metrale_peer_transport", "Peers this process READs adapters from over NIXL, by "
            "the UCX transport carrying them (e.g. cuda_ipc/cuda)", ["transport"])
        self.waiting = gauge("metrale_requests_waiting", "Requests queued (not running)")
        self.running = gauge("metrale_requests_running", "Sequences running")
        self.generated_tokens = counter(
            "metrale_generation_tokens", "Generated tokens ('' = base model)", ["adapter"])
        self.finished = counter(
            "metrale_requests_finished", "Finished requests by finish reason", ["finish_reason"])
        self.ttft = histogram("metrale_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = histogram(
            "metrale_inter_token_latency_seconds", "Time between two tokens of one request")
        self.adapter_wait = histogram(
            "metrale_request_adapter_wait_seconds",
            "Arrival until the request's adapter was resident (0 when it already was)")
        self.queue_wait = histogram(
            "metrale_request_queue_wait_seconds",
            "Adapter resident until the request was first scheduled")
        self.adapter_requests = counter(
            "metrale_adapter_requests", "Adapter requests by whether the adapter was resident "
            "on arrival ('ready') or had to land first ('waited')", ["residency"])
        self.slot_drains = counter(
            "metrale_slot_drains", "Busy slots drained so that a waiting adapter could land")
        self.adapter_queue = gauge(
            "metrale_adapter_queue_depth", "Requests waiting (not yet running) per adapter",
            ["adapter"])
        # vLLM's metric set under vLLM's names (vllm_metrics.py): what reads vLLM reads us
        self.vllm = VllmMetrics(r if vllm_series else CollectorRegistry(), model_name)

    def exposition(self) -> bytes:
        self.peer_transports.clear()
        for transport, peers in transports_in_use().items():
            self.peer_transports.labels(transport).set(peers)
        return generate_latest(self.registry)

    def on_landing(self, event) -> None:
        """A LoraSlots listener: times and logs every swap and promotion, the engine's own
        on-demand promotions and peer landings included."""
        ms = f"{event.seconds * 1e3:.2f}"
        if event.error is not None:
            self.landings.labels(event.kind, event.source, "error").inc()
            log.warning("%s", kv(event=event.kind, adapter=event.name, source=event.source,
                                 result="error", error=type(event.error).__name__, duration_ms=ms))
            return
        histogram = self.swap_seconds if event.kind == "swap" else self.promote_seconds
        histogram.labels(event.source).observe(event.seconds)
        self.landings.labels(event.kind, event.source, "ok").inc()
        log.info("%s", kv(event=event.kind, adapter=event.name, slot=event.slot,
                          evicted=event.evicted, source=event.source, result="ok", duration_ms=ms))
