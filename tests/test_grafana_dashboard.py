"""docs/grafana/metrale.json queries only metrics a real server exposes: every metric name
in its PromQL is a sample name in /metrics after the server promoted, swapped, refused
and generated (histograms and labelled counters appear only once used)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import ServerProcess, make_world

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "metrale.json"
_METRIC = re.compile(r"\bmetrale_[a-z0-9_]+")


def _exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def test_dashboard_covers_what_operators_watch():
    text = " ".join(_exprs())
    for needed in ("metrale_adapter_resident", "metrale_adapter_landings_total",
                   "metrale_adapter_promote_seconds_bucket", "metrale_pool_full_waits_total",
                   "metrale_requests_waiting", "metrale_time_to_first_token_seconds_bucket",
                   "metrale_inter_token_latency_seconds_bucket"):
        assert needed in text, needed


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> set[str]:
    world = make_world(tmp_path_factory.mktemp("grafana"))
    srv = ServerProcess(["--model", str(world["model"]), "--adapter-root", str(world["adapters"]),
                         "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256"],
                        tmp_path_factory.mktemp("grafana-log") / "server.log")
    try:
        body = {"prompt": "tell me about the moon", "max_tokens": 4, "temperature": 0}
        for name in "ab":
            r = httpx.post(f"{srv.url}/v1/adapters", json={"name": name, "path": name}, timeout=60)
            assert r.status_code == 201, r.text
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "a"}, timeout=120)
        assert r.status_code == 200, r.text  # a promotion, TTFT, ITL, tokens
        r = httpx.post(f"{srv.url}/v1/adapters/b/swap", json={"slot": 1}, timeout=120)
        assert r.status_code == 200, r.text  # a swap
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "nope"}, timeout=60)
        assert r.status_code == 404  # a refusal
        metrics = httpx.get(f"{srv.url}/metrics", timeout=60)
        assert metrics.status_code == 200
    finally:
        srv.stop()
    return {s.name for fam in text_string_to_metric_families(metrics.text) for s in fam.samples}


def test_every_metric_the_dashboard_queries_exists(scraped):
    queried = {m for expr in _exprs() for m in _METRIC.findall(expr)}
    assert queried, "the dashboard queries nothing"
    assert queried <= scraped, sorted(queried - scraped)
