"""Prometheus metrics of one server (its own CollectorRegistry: two servers in
one process, e.g. in tests, never share counters) and the structured log line
of every adapter landing."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.adapter_resident = Gauge(
            "metrale_adapter_resident", "1 per registered adapter, labelled by where it lives "
            "(slot 'none' and state 'DISK' when not resident)", ["adapter", "slot", "state"],
            registry=r)
        self.swap_seconds = Histogram(
            "metrale_adapter_swap_seconds", "Latency of landing an adapter into a given slot",
            ["source"], buckets=_LATENCY_BUCKETS, registry=r)
        self.promote_seconds = Histogram(
            "metrale_adapter_promote_seconds", "Latency of promoting an adapter into a victim slot",
            ["source"], buckets=_LATENCY_BUCKETS, registry=r)
        self.landings = Counter(
            "metrale_adapter_landings", "Adapter swaps and promotions by outcome",
            ["op", "source", "result"], registry=r)
        self.refusals = Counter(
            "metrale_refusals", "Refused requests by reason (the error class)", ["reason"],
            registry=r)
        self.pool_full_waits = Counter(
            "metrale_pool_full_waits", "Requests that had to wait for a free adapter slot",
            registry=r)
        self.pool_full_waiting = Gauge(
            "metrale_pool_full_waiting", "Requests waiting for a free adapter slot now", registry=r)
        self.waiting = Gauge("metrale_requests_waiting", "Requests queued (not running)", registry=r)
        self.running = Gauge("metrale_requests_running", "Sequences running", registry=r)
        self.generated_tokens = Counter(
            "metrale_generation_tokens", "Generated tokens ('' = base model)", ["adapter"],
            registry=r)
        self.finished = Counter(
            "metrale_requests_finished", "Finished requests by finish reason", ["finish_reason"],
            registry=r)
        self.ttft = Histogram(
            "metrale_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "metrale_inter_token_latency_seconds", "Time between two tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=r)

        self.adapter_wait = Histogram(
            "metrale_request_adapter_wait_seconds",
            "Arrival until the request's adapter was resident (0 when it already was)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "metrale_request_queue_wait_seconds",
            "Adapter resident until the request was first scheduled", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.adapter_requests = Counter(
            "metrale_adapter_requests", "Adapter requests by whether the adapter was resident "
            "on arrival ('ready') or had to land first ('waited')", ["residency"], registry=r)
        self.slot_drains = Counter(
            "metrale_slot_drains", "Busy slots drained so that a waiting adapter could land",
            registry=r)
        self.adapter_queue = Gauge(
            "metrale_adapter_queue_depth", "Requests waiting (not yet running) per adapter",
            ["adapter"], registry=r)
        # vLLM's metric set under vLLM's names (vllm_metrics.py): what reads vLLM reads us
        self.vllm = VllmMetrics(r if vllm_series else CollectorRegistry(), model_name)

    def set_vllm(self, running: Iterable[str], waiting: Iterable[str], max_lora: int,
                 num_running: int, num_waiting: int, kv_usage: float) -> None:
        """The vLLM-named gauges, after every step."""
        v = self.vllm
        v.set_lora_info(list(running), list(waiting), max_lora)
        v.running.set(num_running)
        v.waiting.set(num_waiting)
        v.kv_usage.set(kv_usage)

    def set_residency(self, rows: Iterable[tuple[str, str, str]]) -> None:
        """Replace the residency gauge with (adapter, slot, state) rows."""
        self.adapter_resident.clear()
        for adapter, slot, state in rows:
            self.adapter_resident.labels(adapter, slot, state).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def instrument(self, lora) -> None:
        """Time and log every swap and promotion of this LoraSlots, the engine's own
        on-demand promotions and peer landings included."""
        lora.listeners.append(self._on_landing)

    def _on_landing(self, event) -> None:
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
