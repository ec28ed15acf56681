"""The ingress's own `metrale_*` request series (the shipped Grafana dashboard reads
them): each request through the ingress as a single server counts it, from the outputs
the replicas stream back: waiting until its first output, then running; its first-token
time, the time between its tokens, its generated tokens, its adapter wait and queue wait,
how it finished. (vLLM's series come from the replicas themselves, labelled by replica.)"""

from __future__ import annotations

import time

from metrale.engine.outputs import RequestOutput
from metrale.server.metrics import ServerMetrics


class RequestSeries:
    """One request's life in the ingress's series: begin() at arrival, output() per
    streamed output, end() whatever ends it (finished, failed, client gone)."""

    def __init__(self, metrics: ServerMetrics, adapter: str | None) -> None:
        self.metrics, self.adapter = metrics, adapter or ""
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0  # the outputs carry cumulative token ids
        self.metrics.waiting.inc()

    def output(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        new = len(out.token_ids) - self.tokens
        if self.first is None:
            m.waiting.dec()
            m.running.inc()
        if new > 0:
            self.tokens = len(out.token_ids)
            m.generated_tokens.labels(self.adapter).inc(new)
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
                if out.adapter_wait_s is not None:
                    m.adapter_wait.observe(out.adapter_wait_s)
                if out.queue_wait_s is not None:
                    m.queue_wait.observe(out.queue_wait_s)
            else:
                m.itl.observe(now - self.last)
            self.last = now
        elif self.first is None:
            self.first = now  # an output without tokens (a refusal's): running from here
        if out.finished:
            m.finished.labels(out.finish_reason or "unknown").inc()

    def end(self) -> None:
        if self.first is None:
            self.metrics.waiting.dec()
        else:
            self.metrics.running.dec()
