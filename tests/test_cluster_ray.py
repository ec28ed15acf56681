"""metrale on Ray Serve, end to end on the CPU: a local Ray, 2 replicas of a tiny
model, the ingress on a free port. Expected tokens come from transformers + PEFT.
Nothing here waits a fixed time: each wait polls for the event it needs, under a
bound only a broken cluster reaches."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from peft import PeftModel  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from metrale.cluster.config import ClusterConfig, ReplicaSpec  # noqa: E402
from metrale.cluster.launch import APP_NAME, deploy, register_startup  # noqa: E402
from tests.helpers.process import BOUND_S, Bound, tail  # noqa: E402
from tests.helpers.reference import hf_greedy  # noqa: E402
from tests.helpers.server import free_port, make_world  # noqa: E402
from tests.helpers.tiny_models import make_model  # noqa: E402

# alone: Ray Serve's controller, proxy, ingress and two replica processes share the cores with
# nothing else (`make test` runs these after the parallel workers): beside a busy xdist worker
# on 2 cores the cluster's start took 301 s (42 s alone)
pytestmark = [pytest.mark.slow, pytest.mark.alone]
KEY = "internal-test-key"
NS = "metrale-test"
PROMPTS = ([5, 17, 30, 44], [9, 9, 120, 3, 77], [200, 13, 6])


def wait_for(what: str, check, bound_s: float = BOUND_S, failed=lambda: None):
    """check()'s first truthy value; AssertionError at once when failed() names a failure,
    or at the load-stretched bound, saying what was awaited and for how long."""
    bound = Bound(bound_s)
    while not (value := check()):
        if problem := failed():
            raise AssertionError(f"gave up waiting for {what} after {bound.elapsed():.1f} s: "
                                 f"{problem}")
        if bound.expired():
            raise AssertionError(f"never happened: {what}; waited {bound.describe()}")
        time.sleep(0.1)  # the pause between two polls of the cluster's state
    return value


def serve_failure(ray_dir: str) -> str | None:
    """Why the Serve app failed (its status message and the tail of its replicas' logs),
    or None while it is deploying or running."""
    app = serve.status().applications.get(APP_NAME)
    if app is None or app.status not in ("DEPLOY_FAILED", "UNHEALTHY"):
        return None
    logs = sorted(Path(ray_dir).glob("session_latest/logs/serve/replica_*.log"))
    tails = "".join(f"\n--- {log.name}:\n{tail(log.read_text(errors='replace'), 20)}" for log in logs)
    return f"the Serve app is {app.status}: {app.message}{tails}"


class Reference:
    """transformers + PEFT greedy tokens for the tiny model (make_world's seed), decoded."""

    def __init__(self, world) -> None:
        self.world = world
        self.tokenizer = AutoTokenizer.from_pretrained(world["model"])
        self._cache = {}

    def text(self, prompt: list[int], adapter: str | None, n: int) -> str:
        key = (tuple(prompt), adapter, n)
        if key not in self._cache:
            model = make_model("llama", seed=7, max_position_embeddings=1024)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, self.world["adapters"] / adapter)
            tokens, _ = hf_greedy(model.eval(), prompt, n)
            self._cache[key] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return self._cache[key]


class Cluster:
    def __init__(self, url: str, world) -> None:
        self.url, self.world = url, world
        self.ref = Reference(world)

    def complete(self, prompt, model, n=8, url=None, **extra):
        headers = {"Authorization": f"Bearer {KEY}"} if url else {}
        return httpx.post(f"{url or self.url}/v1/completions", timeout=BOUND_S, headers=headers,
                          json={"model": model, "prompt": prompt, "max_tokens": n,
                                "temperature": 0, **extra})

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster", timeout=30).json()

    def register(self, name: str) -> dict:
        r = httpx.post(f"{self.url}/v1/adapters", json={"name": name, "path": name}, timeout=BOUND_S)
        assert r.status_code == 201, r.text
        return r.json()["adapter"]

    def replicas(self) -> dict:
        return self.stats()["replicas"]


# Serve kills a proxy that does not answer its ready check within 5 s (its health check
# within 10 s): on a 2-core box with other jobs running, start-up alone can take longer.
# The local cluster's processes inherit these from this one.
SERVE_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
                  "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "120"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    world = make_world(tmp_path_factory.mktemp("cluster-world"))
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    saved = {k: os.environ.get(k) for k in SERVE_PATIENCE}
    os.environ.update(SERVE_PATIENCE)
    ray.init(num_cpus=2, include_dashboard=False, namespace=NS, _temp_dir=ray_dir,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(model=str(world["model"]), registry_name="metrale-test-registry",
                           registry_namespace=NS, internal_key=KEY, max_loras=2,
                           max_lora_rank=8, max_model_len=1024, peer_transport="http")
        sources = world["model"].parent / "sources"  # org/d: adapter d, named by requests only
        shutil.copytree(world["adapters"] / "d", sources / "org" / "d")
        deploy(spec, ClusterConfig(replicas=2, stats_period_s=0.5),
               {"model_id": world["model"].name, "adapter_roots": (world["adapters"],),
                "adapter_sources": (str(sources),)})
        c = Cluster(f"http://127.0.0.1:{port}", world)
        wait_for("both replicas joined the registry", lambda: len(c.replicas()) == 2,
                 failed=lambda: serve_failure(ray_dir))
        # /health says "starting" until the start-up adapters are registered (none here)
        health = httpx.get(f"{c.url}/health", timeout=BOUND_S)
        assert health.status_code == 503 and health.json()["status"] == "starting", health.text
        register_startup(spec, {})
        assert httpx.get(f"{c.url}/health", timeout=BOUND_S).json()["status"] == "ok"
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_outputs_equal_transformers_peft_through_the_ingress(cluster):
    cluster.register("a")
    for prompt in PROMPTS[:2]:
        for model in ("model", "a"):
            r = cluster.complete(prompt, model)
            assert r.status_code == 200, r.text
            want = cluster.ref.text(prompt, None if model == "model" else "a", 8)
            assert r.json()["choices"][0]["text"] == want
    # the shared server's errors and auth come along: an unknown adapter is a typed 404
    r = cluster.complete(PROMPTS[0], "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    models = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["model", "a"]
    r = httpx.post(f"{cluster.url}/reset_prefix_cache", timeout=60)  # on every replica
    assert r.status_code == 200 and isinstance(r.json()["dropped_blocks"], int)


def test_registered_at_the_ingress_served_by_both_replicas(cluster):
    view = httpx.get(f"{cluster.url}/v1/adapters", timeout=30).json()
    (a,) = [x for x in view["adapters"] if x["name"] == "a"]
    assert len(a["replicas"]) == 2  # residency per replica
    want = cluster.ref.text(PROMPTS[2], "a", 8)
    for rid, rep in cluster.replicas().items():
        r = cluster.complete(PROMPTS[2], "a", url=rep["url"])  # this replica's own server
        assert r.status_code == 200, (rid, r.text)
        assert r.json()["choices"][0]["text"] == want


def test_request_goes_to_the_replica_holding_its_adapter(cluster):
    cluster.register("b")
    assert cluster.complete(PROMPTS[0], "b").status_code == 200
    (holder,) = cluster.stats()["served"]["b"]
    for prompt in PROMPTS:  # one at a time: nobody is overloaded
        r = cluster.complete(prompt, "b")
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == cluster.ref.text(prompt, "b", 8)
    assert cluster.stats()["served"]["b"] == {holder: 1 + len(PROMPTS)}


def landings(url: str) -> dict[str, float]:
    """This replica's promotions by source, from its own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30, headers={"Authorization": f"Bearer {KEY}"}).text
    out = {"peer": 0.0, "disk": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "metrale_adapter_landings_total" and s.labels["op"] == "promote" \
                    and s.labels["result"] == "ok":
                out[s.labels["source"]] += s.value
    return out


def test_replica_lacking_an_adapter_lands_it_from_the_neighbour(cluster):
    (holder,) = cluster.stats()["served"]["b"]
    wait_for("the registry sees b resident on its holder",
             lambda: "b" in cluster.replicas()[holder]["resident"])
    reps = cluster.replicas()
    (other,) = [rid for rid in reps if rid != holder]
    before = landings(reps[other]["url"])
    r = httpx.post(f"{cluster.url}/v1/adapters/b/promote", timeout=BOUND_S)
    assert r.status_code == 200, r.text
    assert r.json()["adapter"]["replicas"][other]["state"] == "READY"
    reps = cluster.replicas()
    records = [x for x in reps[other]["staging"] if x["adapter"] == "b"]
    assert records and records[-1]["source"] == "peer"
    assert records[-1]["peer"] == reps[holder]["peer"]
    # the replica's own landing metric names the source too: one from a peer, none from disk
    after = landings(reps[other]["url"])
    assert after["peer"] == before["peer"] + 1 and after["disk"] == before["disk"]
    r = cluster.complete(PROMPTS[1], "b", url=reps[other]["url"])
    assert r.json()["choices"][0]["text"] == cluster.ref.text(PROMPTS[1], "b", 8)


def test_vllm_gauges_on_every_replica(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    for rep in cluster.replicas().values():
        text = httpx.get(f"{rep['url']}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"}).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"vllm:lora_requests_info", "vllm:num_requests_running",
                "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= names

    def ingress() -> dict:
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def prompt_tokens(families) -> dict:
        return {s.labels["replica"]: s.value for s in families["vllm:prompt_tokens"]
                if s.name.endswith("_total")}

    before = ingress()  # the ingress shows every replica's vLLM series, labelled by replica
    assert set(prompt_tokens(before)) == set(cluster.replicas())
    assert {s.labels["replica"] for s in before["vllm:num_requests_running"]} == set(cluster.replicas())
    r = cluster.complete(PROMPTS[0], "model")
    assert r.status_code == 200, r.text
    moved = sum(prompt_tokens(ingress()).values()) - sum(prompt_tokens(before).values())
    assert moved == r.json()["usage"]["prompt_tokens"]


def test_ingress_series_move_and_replicas_scrape_without_a_key(cluster):
    """The README: each replica's /metrics scraped as a vLLM pod's (no key: the cluster
    has no --api-key); the ingress's own metrale_* series (the Grafana dashboard's) count
    the requests that stream through it."""
    from prometheus_client.parser import text_string_to_metric_families

    for rep in cluster.replicas().values():
        r = httpx.get(f"{rep['url']}/metrics", timeout=30)
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text

    def ingress(name: str) -> float:
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name)

    ttft, tokens = ingress("metrale_time_to_first_token_seconds_count"), \
        ingress("metrale_generation_tokens_total")

    def stream(prompt):  # long enough to be seen running: 400 tokens of a tiny model
        with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=BOUND_S, json={
                "model": "model", "prompt": prompt, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    wait_for("two requests running at the ingress", lambda: ingress("metrale_requests_running") == 2)
    for t in threads:
        t.join()
    assert ingress("metrale_requests_running") == 0
    assert ingress("metrale_time_to_first_token_seconds_count") == ttft + 2
    assert ingress("metrale_generation_tokens_total") == tokens + 800


def test_unload_drains_everywhere(cluster):
    cluster.register("c")
    assert httpx.post(f"{cluster.url}/v1/adapters/c/promote", timeout=BOUND_S).status_code == 200
    n = 400
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=BOUND_S,
                      json={"model": "c", "prompt": PROMPTS[0], "max_tokens": n, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        r = httpx.delete(f"{cluster.url}/v1/adapters/c", timeout=BOUND_S)
        assert r.status_code == 200 and r.json()["status"] in ("draining", "unloaded")
        assert cluster.complete(PROMPTS[0], "c").status_code == 404  # admits nothing new
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the request in flight finished on its slot
        assert '"finish_reason":"length"' in rest[-2].replace(" ", "")

    def gone_everywhere():
        reps = httpx.get(f"{cluster.url}/v1/adapters", timeout=30).json()
        return not [x for x in reps["adapters"] if x["name"] == "c"] and len(reps["slots"]) == 2 \
            and all(s["name"] != "c" for slots in reps["slots"].values() for s in slots)

    wait_for("c drained from every replica", gone_everywhere)


def test_pin_and_reload_apply_to_every_replica(cluster):
    cluster.register("p")
    r = httpx.post(f"{cluster.url}/v1/adapters/p/pin", timeout=BOUND_S)
    assert r.status_code == 200, r.text
    assert r.json()["adapter"]["errors"] == {}  # every replica applied it
    for rid, rep in r.json()["adapter"]["replicas"].items():
        assert rep["pinned"] and rep["state"] == "READY", rid  # landed everywhere, pinned
    # vLLM's in-place reload: every replica serves the new files (d's) from now on
    r = httpx.post(f"{cluster.url}/v1/load_lora_adapter", timeout=BOUND_S,
                   json={"lora_name": "p", "lora_path": "d", "load_inplace": True})
    assert r.status_code == 200, r.text
    want = cluster.ref.text(PROMPTS[1], "d", 8)
    for rep in cluster.replicas().values():
        out = cluster.complete(PROMPTS[1], "p", url=rep["url"])
        assert out.json()["choices"][0]["text"] == want
    assert cluster.complete(PROMPTS[1], "p").json()["choices"][0]["text"] == want
    r = httpx.post(f"{cluster.url}/v1/adapters/p/unpin", timeout=BOUND_S)
    assert not any(rep["pinned"] for rep in r.json()["adapter"]["replicas"].values())


def _kill(replica_id: str) -> None:
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and replica_id in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def test_a_source_adapter_is_registered_cluster_wide_on_first_request(cluster):
    r = cluster.complete(PROMPTS[1], "org/d")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cluster.ref.text(PROMPTS[1], "d", 8)
    for rid, rep in cluster.replicas().items():  # registered on every replica
        r = cluster.complete(PROMPTS[1], "org/d", url=rep["url"])
        assert r.status_code == 200, (rid, r.text)
    assert cluster.complete(PROMPTS[1], "org/none").status_code == 404
    # registered from the source with its header read, its weights left to each landing
    registry = ray.get_actor("metrale-test-registry", namespace=NS)
    assert ray.get(registry.get.remote("org/d")).source.verify_on_landing


def test_killing_a_replica_loses_no_retryable_request(cluster):
    """Greedy requests in flight on a replica that dies are resent to the other one;
    a stream already half delivered is replayed there and continues where it was."""
    jobs = [(p, m) for p in PROMPTS for m in ("model", "a")] * 2
    results: list = [None] * len(jobs)

    def send(i, prompt, model):
        results[i] = cluster.complete(prompt, model, n=24)

    n = 300
    before = set(cluster.replicas())
    served_before = dict(cluster.stats()["served"].get("a", {}))
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=BOUND_S,
                      json={"model": "a", "prompt": PROMPTS[0], "max_tokens": n,
                            "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        served = cluster.stats()["served"]["a"]
        (victim,) = [rid for rid, k in served.items() if k > served_before.get(rid, 0)]
        threads = [threading.Thread(target=send, args=(i, p, m)) for i, (p, m) in enumerate(jobs)]
        for t in threads:
            t.start()
        _kill(victim)
        events = [first] + [line for line in lines if line.startswith("data: ")]
    import json

    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == cluster.ref.text(PROMPTS[0], "a", n)
    for t in threads:
        t.join()
    for (prompt, model), r in zip(jobs, results):
        assert r.status_code == 200, r.text
        want = cluster.ref.text(prompt, None if model == "model" else model, 24)
        assert r.json()["choices"][0]["text"] == want
    # the cluster keeps serving, and Serve brings the replica count back
    assert cluster.complete(PROMPTS[0], "a").json()["choices"][0]["text"] == \
        cluster.ref.text(PROMPTS[0], "a", 8)
    def replacement():
        reps = cluster.replicas()
        fresh = [rep for rid, rep in reps.items() if rid not in before]
        return fresh[0] if fresh and victim not in reps else None

    new = wait_for("a replacement replica joined", replacement)

    def replacement_adapters() -> set[str]:
        """Its adapters; none while its server is still starting (it reports before it listens)."""
        try:
            listing = httpx.get(f"{new['url']}/v1/adapters", timeout=30,
                                headers={"Authorization": f"Bearer {KEY}"})
        except httpx.TransportError:
            return set()
        return {a["name"] for a in listing.json()["adapters"]}

    # it joined with the cluster's adapters: the registry's whole state, on its first poll
    wait_for("the replacement applied the registry", lambda: replacement_adapters() >= {"a", "b", "p"})
    print("requests resent after the kill:", cluster.stats()["retried"])
