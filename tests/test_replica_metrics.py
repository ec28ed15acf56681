"""The ingress's merge of its replicas' vLLM series: every sample keeps its value and
labels and gains `replica`, each family is declared once, and the result parses as the
Prometheus text format (checked with prometheus_client's own parser)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrale.cluster.replica_metrics import merge_replica_series


def _replica(running: int, tokens: int, ttfts: list[float]) -> str:
    r = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running", ["model_name"], registry=r).labels("m").set(running)
    Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"], registry=r).labels("m").inc(tokens)
    h = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"], buckets=(0.1, 1.0),
                  registry=r)
    for t in ttfts:
        h.labels("m").observe(t)
    Gauge("metrale_own", "not vLLM's", registry=r).set(7)
    return generate_latest(r).decode()


def test_samples_keep_their_values_and_gain_the_replica_label():
    text = merge_replica_series({"r0": _replica(2, 30, [0.05]), "r1": _replica(5, 12, [0.5, 2.0])})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "metrale_own" not in families  # only vLLM's series are merged
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"r0": 2.0, "r1": 5.0}
    tokens = {s.labels["replica"]: s.value for s in families["vllm:prompt_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {"r0": 30.0, "r1": 12.0}
    counts = {s.labels["replica"]: s.value for s in families["vllm:time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"r0": 1.0, "r1": 2.0}
    inf = {s.labels["replica"]: s.value for s in families["vllm:time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"}
    assert inf == {"r0": 1.0, "r1": 2.0}
    assert all(s.labels["model_name"] == "m" for f in families.values() for s in f.samples)
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(set(declared)) == len(families)  # one declaration per family


def test_no_replica_no_series():
    assert merge_replica_series({}) == ""
