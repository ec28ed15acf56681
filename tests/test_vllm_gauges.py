"""vLLM-named gauges (what llm-d / the Gateway API Inference Extension scrape): they
parse with prometheus_client's own text parser and carry the right adapter sets,
the running and the waiting ones apart."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from metrale import LLM, SamplingParams  # noqa: E402
from metrale.server.adapter_ops import AdapterOps  # noqa: E402
from metrale.server.metrics import ServerMetrics  # noqa: E402
from tests.helpers.engine import step_until, step_until_running  # noqa: E402
from tests.helpers.tiny_models import make_adapter, make_model, save_model  # noqa: E402


def _samples(metrics: ServerMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-gauges")
    base = make_model("llama", seed=3)
    save_model(base, root / "model")
    for i, name in enumerate(("a", "b")):
        make_adapter(base, root / name, seed=10 + i, r=4, lora_alpha=8, target_modules="all-linear")
    llm = LLM(root / "model", max_loras=1, max_lora_rank=8, max_model_len=256)
    for name in ("a", "b"):
        llm.engine.register_adapter(name, root / name)
    return llm.engine


def test_running_and_waiting_adapter_sets(engine):
    metrics = ServerMetrics()
    ops = AdapterOps(engine, metrics)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    first = engine.add_request([5, 6, 7], params, "a")
    step_until_running(engine, first)
    # one slot, busy with "a": a request for "b" waits for it; one for "a" joins "a"
    engine.add_request([8, 9], params, "b")
    ops.after_step()
    s = _samples(metrics)
    (info,) = s["vllm:lora_requests_info"]
    assert info.labels == {"running_lora_adapters": "a", "waiting_lora_adapters": "b",
                           "max_lora": "1"}
    assert info.value > 0  # the update time, as vLLM sets it
    assert s["vllm:num_requests_running"][0].value == 1
    assert s["vllm:num_requests_waiting"][0].value == 1
    assert 0 < s["vllm:kv_cache_usage_perc"][0].value <= 1
    # our own gauges are still there, beside vLLM's
    assert s["metrale_requests_running"][0].value == 1

    step_until(engine, lambda: not engine.has_unfinished_requests())
    ops.after_step()
    (info,) = _samples(metrics)["vllm:lora_requests_info"]
    assert info.labels["running_lora_adapters"] == "" and info.labels["waiting_lora_adapters"] == ""
