"""vLLM's metric set on /metrics: every series inference-perf's vLLM client reads exists,
labelled with the served model's name, and moves under requests by what the requests
themselves report (usage counts, finish reasons) and by how a request's phases add up
(queue + prefill = time to first token, prefill + decode = inference time), in seconds."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from metrale import LLM, SamplingParams
from metrale.server.adapter_ops import AdapterOps
from metrale.server.metrics import ServerMetrics
from metrale.server.serve import build_app
from tests.helpers.engine import step_until
from tests.helpers.server import save_tokenizer
from tests.helpers.tiny_models import make_adapter, saved_tiny_model

BASE = "tiny-base"
BLOCK = 16
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:prompt_tokens_cached", "vllm:prompt_tokens_recomputed",
            "vllm:corrupted_requests", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries", "vllm:mm_cache_hits")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
              "vllm:request_params_n", "vllm:request_params_max_tokens",
              "vllm:request_prefill_kv_computed_tokens", "vllm:iteration_tokens_total",
              "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
              "vllm:kv_block_reuse_gap_seconds")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-metrics")
    base = saved_tiny_model(root / BASE, seed=4, tokenizer=save_tokenizer,
                            max_position_embeddings=512)
    make_adapter(base, root / "jail" / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    return root


@pytest.fixture(scope="module")
def client(world):
    from metrale.cli import build_parser

    args = build_parser().parse_args([
        "serve", "--model", str(world / BASE), "--adapter", f"a={world / 'jail' / 'a'}",
        "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256",
        "--num-kv-blocks", "64"])
    app, _, _ = build_app(args)
    with TestClient(app) as c:
        yield c


def scrape(client) -> dict[str, list]:
    """{sample name: [samples]} of /metrics, as Prometheus' own parser reads it."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, ())
               if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_series_exists_with_the_model_name(client):
    s = scrape(client)
    names = [f"{c}_total" for c in COUNTERS] + list(GAUGES) + \
        [f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")]
    missing = [n for n in names if n not in s]
    assert not missing, missing
    for n in names:
        assert all(x.labels.get("model_name") == BASE for x in s[n]), n
    assert {x.labels["finished_reason"] for x in s["vllm:request_success_total"]} >= \
        {"stop", "length", "abort"}
    (info,) = s["vllm:cache_config_info"]
    assert info.labels["block_size"] == str(BLOCK) and info.labels["num_gpu_blocks"] == "64"
    assert "vllm:lora_requests_info" in s


def _complete(client, prompt, model, max_tokens, stream=False):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if not stream:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200
        return r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    body["stream_options"] = {"include_usage": True}
    import json

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return chunks[-1]["usage"], chunks[-2]["choices"][0]["finish_reason"]


def test_series_move_by_what_the_requests_report(client):
    before = scrape(client)
    words = "hello world the moon tell me about sun sea sky story".split()
    long_prompt = " ".join(words * 4)  # 44 tokens: two full 16-token blocks to cache
    requests = [("hello world", BASE, 5, False), (long_prompt, "a", 7, True),
                (long_prompt, "a", 3, False), ("the sea", BASE, 1, True)]
    usages = []
    start = time.monotonic()
    for prompt, model, n, stream in requests:
        usage, reason = _complete(client, prompt, model, n, stream)
        assert reason == "length" and usage["completion_tokens"] == n
        usages.append(usage)
    wall = time.monotonic() - start
    after = scrape(client)

    def moved(name, **labels):
        return value(after, name, model_name=BASE, **labels) - \
            value(before, name, model_name=BASE, **labels)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    n = len(requests)
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == generated
    assert moved("vllm:request_success_total", finished_reason="length") == n
    assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert moved("vllm:request_generation_tokens_sum") == generated
    assert moved("vllm:request_params_max_tokens_sum") == generated  # ignore_eos: all of them
    assert moved("vllm:request_params_n_sum") == n
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert moved(f"{h}_count") == n, h
    assert moved("vllm:inter_token_latency_seconds_count") == generated - n
    assert moved("vllm:time_per_output_token_seconds_count") == generated - n
    assert moved("vllm:request_time_per_output_token_seconds_count") == \
        sum(u["completion_tokens"] > 1 for u in usages)
    # the prefix cache: the second long prompt finds the first one's full blocks
    long_tokens = usages[1]["prompt_tokens"]
    cached = (long_tokens - 1) // BLOCK * BLOCK
    assert moved("vllm:prefix_cache_queries_total") == prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") == cached
    assert moved("vllm:prompt_tokens_cached_total") == cached
    assert moved("vllm:kv_block_reuse_gap_seconds_count") == cached // BLOCK  # one per block hit
    assert moved("vllm:corrupted_requests_total") == 0
    assert moved("vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached
    # every step's tokens: each prompt token not cached, and every generated token but the
    # last (it is never fed back); nothing was preempted
    assert moved("vllm:num_preemptions_total") == 0
    assert moved("vllm:iteration_tokens_total_sum") == prompt_tokens - cached + generated - n
    # phases add up, in seconds (milliseconds would not fit in the wall time)
    ttft, e2e = moved("vllm:time_to_first_token_seconds_sum"), \
        moved("vllm:e2e_request_latency_seconds_sum")
    queue, prefill = moved("vllm:request_queue_time_seconds_sum"), \
        moved("vllm:request_prefill_time_seconds_sum")
    decode, inference = moved("vllm:request_decode_time_seconds_sum"), \
        moved("vllm:request_inference_time_seconds_sum")
    assert 0 < ttft <= e2e <= wall
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference == pytest.approx(e2e, abs=1e-6)
    assert moved("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_a_client_that_leaves_counts_as_aborted(client):
    before = value(scrape(client), "vllm:request_success_total", finished_reason="abort")
    body = {"model": BASE, "prompt": "hello", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first event: it runs; then we leave
    deadline = time.monotonic() + 60
    while value(scrape(client), "vllm:request_success_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.05)
    assert value(scrape(client), "vllm:request_success_total",
                 finished_reason="abort") == before + 1


def test_preemptions_counted(world):
    """Three sequences that need 3 x 7 blocks on an 8-block cache: some must be
    preempted (their KV dropped, recomputed later)."""
    llm = LLM(world / BASE, max_loras=1, max_lora_rank=8, max_model_len=112, num_kv_blocks=8,
              max_num_seqs=3)
    engine = llm.engine
    metrics = ServerMetrics(BASE)
    ops = AdapterOps(engine, metrics)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i] * 10, params)
    seen = threading.Event()

    def progressed() -> bool:
        ops.after_step()
        if engine.scheduler.num_preemptions:
            seen.set()
        return not engine.has_unfinished_requests()

    step_until(engine, progressed)
    ops.after_step()
    s = {x.name: x for f in text_string_to_metric_families(metrics.exposition().decode())
         for x in f.samples}
    assert seen.is_set()
    assert s["vllm:num_preemptions_total"].value == engine.scheduler.num_preemptions > 0
    # their KV was computed again: at least the 10 prompt tokens of each preempted one
    recomputed = s["vllm:prompt_tokens_recomputed_total"].value
    assert recomputed == engine.scheduler.num_recomputed_tokens >= 10 * engine.scheduler.num_preemptions
    # 8 blocks served 3 x 7: blocks were evicted, so their lifetimes were observed, each
    # at least as long as its idle time before eviction
    lifetime = s["vllm:kv_block_lifetime_seconds_count"].value
    assert lifetime > 0 and lifetime == s["vllm:kv_block_idle_before_evict_seconds_count"].value
    assert s["vllm:kv_block_lifetime_seconds_sum"].value >= \
        s["vllm:kv_block_idle_before_evict_seconds_sum"].value
