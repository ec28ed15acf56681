"""vLLM's serving metrics, under vLLM's names, labels and units, so that what reads a
vLLM server (inference-perf's vLLM client, Grafana's vLLM dashboards, llm-d and the
Gateway API Inference Extension) reads metrale unchanged. docs/DESIGN.md lists the series
and a request's phases; "queue" includes the wait for the request's adapter to land.
Every series but vllm:lora_requests_info carries model_name (inference-perf filters on it);
times are seconds on the monotonic clock; a prompt's tokens count once, at its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 1-2.5-5 steps: 1 ms to 2500 s, for every duration (vLLM's own buckets differ; quantiles
# and rates read any)
SECONDS = tuple(m * 10.0 ** e for e in range(-3, 3) for m in (1, 2.5, 5)) + (1000.0, 2500.0)
# 1-2-5 steps: 1 to 1M tokens
TOKENS = tuple(m * 10 ** e for e in range(0, 6) for m in (1, 2, 5)) + (1_000_000,)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class FinishedRequest:
    """One request's life, for the per-request histograms. Phase starts are None where
    the request never reached them (aborted while queued, refused when its adapter
    failed to land)."""

    reason: str
    arrival: float
    finished: float
    max_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        r, m = registry, ["model_name"]
        counter, gauge = partial(Counter, labelnames=m, registry=r), partial(Gauge, labelnames=m, registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self._families = {
            "running": gauge("vllm:num_requests_running", "Requests running (in a step)"),
            "waiting": gauge("vllm:num_requests_waiting", "Requests waiting to run (for a "
                             "step or for their adapter)"),
            "kv_usage": gauge("vllm:kv_cache_usage_perc", "KV-cache blocks in use, 0..1"),
            "prompt_tokens": counter("vllm:prompt_tokens", "Prompt tokens of started requests"),
            "generation_tokens": counter("vllm:generation_tokens", "Generated tokens"),
            "preemptions": counter("vllm:num_preemptions", "Running sequences preempted for "
                                   "KV room (recomputed later)"),
            "prefix_queries": counter("vllm:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache"),
            "prefix_hits": counter("vllm:prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache"),
            "prompt_cached": counter("vllm:prompt_tokens_cached", "Prompt tokens of started "
                                     "requests served from the prefix cache"),
            "prompt_recomputed": counter("vllm:prompt_tokens_recomputed", "Tokens whose KV a "
                                         "preemption dropped, computed again"),
            "corrupted": counter("vllm:corrupted_requests", "Requests failed by non-finite "
                                 "logits (an adapter or a base that overflows)"),
            # kept at zero: metrale has no KV cache outside the engine and no multimodal
            # inputs; they exist so that queries written for vLLM find every series
            "external_queries": counter("vllm:external_prefix_cache_queries", "Tokens looked "
                                        "up in an external KV cache (none here: 0)"),
            "external_hits": counter("vllm:external_prefix_cache_hits", "Tokens found in an "
                                     "external KV cache (none here: 0)"),
            "mm_queries": counter("vllm:mm_cache_queries", "Multimodal cache lookups (none "
                                  "here: 0)"),
            "mm_hits": counter("vllm:mm_cache_hits", "Multimodal cache hits (none here: 0)"),
            "block_lifetime": histogram("vllm:kv_block_lifetime_seconds", "A KV block's "
                                        "contents, allocation to eviction", SECONDS),
            "block_idle": histogram("vllm:kv_block_idle_before_evict_seconds", "A KV block's "
                                    "last read to its eviction", SECONDS),
            "block_reuse_gap": histogram("vllm:kv_block_reuse_gap_seconds", "Between two "
                                         "reads of a cached KV block", SECONDS),
            "ttft": histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                              SECONDS),
            "itl": histogram("vllm:inter_token_latency_seconds", "Between two tokens of a "
                             "request", SECONDS),
            "tpot": histogram("vllm:time_per_output_token_seconds", "Between two tokens of a "
                              "request (vLLM's older name of the inter-token latency)", SECONDS),
            "request_tpot": histogram("vllm:request_time_per_output_token_seconds",
                                      "Per request: decode time / (generated tokens - 1)",
                                      SECONDS),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", SECONDS),
            "queue": histogram("vllm:request_queue_time_seconds", "Arrival to first "
                               "scheduled (its adapter's landing included)", SECONDS),
            "inference": histogram("vllm:request_inference_time_seconds", "First scheduled "
                                   "to last token", SECONDS),
            "prefill": histogram("vllm:request_prefill_time_seconds", "First scheduled to "
                                 "first token", SECONDS),
            "decode": histogram("vllm:request_decode_time_seconds", "First to last token",
                                SECONDS),
            "request_prompt": histogram("vllm:request_prompt_tokens", "Prompt tokens per "
                                        "request", TOKENS),
            "request_generation": histogram("vllm:request_generation_tokens", "Generated "
                                            "tokens per request", TOKENS),
            "request_max_generation": histogram(
                "vllm:request_max_num_generation_tokens", "Most tokens generated by one "
                "sequence of a request (n = 1: all of them)", TOKENS),
            "params_n": histogram("vllm:request_params_n", "The request's n", (1, 2, 5, 10, 20)),
            "params_max_tokens": histogram("vllm:request_params_max_tokens", "The request's "
                                           "max_tokens (as the server set it)", TOKENS),
            "prefill_computed": histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Prompt tokens computed, not found in the prefix "
                                          "cache, per request", TOKENS),
            "iteration_tokens": histogram("vllm:iteration_tokens_total", "Tokens computed "
                                          "per engine step", TOKENS),
        }
        self._success = Counter("vllm:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running and waiting adapters (the value is the time "
            "of the last update)", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r)
        self._cache_info = Gauge(
            "vllm:cache_config_info", "The KV cache's configuration (labels; value 1)",
            ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)
        self._cache_labels: tuple[str, ...] | None = None
        self.bind(model_name)

    def bind(self, model_name: str) -> None:
        """Label every series with `model_name` from now on (the server's base model id,
        known once the app is made); series of another name are dropped."""
        self.model_name = model_name
        for name, family in self._families.items():
            family.clear()
            setattr(self, name, family.labels(model_name))
        self._success.clear()
        self.success = {r: self._success.labels(model_name, r) for r in FINISH_REASONS}
        for reason in self.success.values():
            reason.inc(0)
        self._label_cache_info()

    def cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self._cache_labels = (str(block_size), str(num_blocks), str(prefix_caching))
        self._label_cache_info()

    def _label_cache_info(self) -> None:
        self._cache_info.clear()
        if self._cache_labels is not None:
            self._cache_info.labels(self.model_name, *self._cache_labels).set(1)

    def set_lora_info(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """Adapter sets as comma-joined sorted names (vLLM's format)."""
        self.lora_info.clear()
        self.lora_info.labels(",".join(sorted(set(running))), ",".join(sorted(set(waiting))),
                              str(max_lora)).set_to_current_time()

    def first_token(self, arrival: float, now: float, prompt_tokens: int,
                    cached_tokens: int) -> None:
        self.ttft.observe(now - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_cached.inc(cached_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def kv_residency(self, observations: list[tuple[str, float]]) -> None:
        histograms = {"lifetime": self.block_lifetime, "idle": self.block_idle,
                      "reuse_gap": self.block_reuse_gap}
        for kind, seconds in observations:
            histograms[kind].observe(seconds)

    def next_tokens(self, gap_s: float) -> None:
        self.itl.observe(gap_s)
        self.tpot.observe(gap_s)

    def finished(self, r: FinishedRequest) -> None:
        self.success.get(r.reason, self.success["error"]).inc()
        self.e2e.observe(r.finished - r.arrival)
        self.params_n.observe(1)
        self.params_max_tokens.observe(r.max_tokens)
        if r.scheduled is None:
            return  # it never ran: no phases, no token counts
        self.queue.observe(r.scheduled - r.arrival)
        self.request_prompt.observe(r.prompt_tokens)
        self.prefill_computed.observe(r.prompt_tokens - r.cached_prompt_tokens)
        self.request_generation.observe(r.generated_tokens)
        self.request_max_generation.observe(r.generated_tokens)
        if r.first_token is None or r.last_token is None:
            return
        self.prefill.observe(r.first_token - r.scheduled)
        self.decode.observe(r.last_token - r.first_token)
        self.inference.observe(r.last_token - r.scheduled)
        if r.generated_tokens > 1:
            self.request_tpot.observe((r.last_token - r.first_token) / (r.generated_tokens - 1))
