"""The OpenAI API of a real `metrale serve` process, through the official client:
completions, chat and streaming equal offline LLM.generate for the base model
and for adapters, concurrent clients on more adapters than slots, logprobs,
stop and seed, every inference refusal, the user key on admin endpoints, and
/metrics. After every refusal the server still answers a completion."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import Reference, ServerProcess, make_world

USER, ADMIN = "user-key", "admin-key"
PROMPT = "tell me about the moon"
GREEDY = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("openai"))


@pytest.fixture(scope="module")
def server(world, tmp_path_factory):
    # 3 slots, one pinned by p: a, b, c (and d) share the other two on demand
    srv = ServerProcess(
        ["--model", str(world["model"]), "--adapter", f"p={world['adapters'] / 'p'}",
         "--adapter-root", str(world["adapters"]), "--max-loras", "3", "--max-lora-rank", "8",
         "--max-model-len", "1024", "--api-key", USER, "--admin-key", ADMIN,
         "--max-tokens-limit", "500"],
        tmp_path_factory.mktemp("openai-log") / "server.log")
    try:
        for name in "abcd":
            r = httpx.post(f"{srv.url}/v1/adapters", json={"name": name, "path": name},
                           headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
            assert r.status_code == 201, r.text
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def ref(world):
    ref = Reference(world)
    for name in "abcdp":
        ref.register(name)
    return ref


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER, max_retries=0, timeout=60)


def assert_serving(client, ref):
    out = client.completions.create(model="a", prompt=PROMPT, **GREEDY)
    assert out.choices[0].text == ref.complete(PROMPT, "a", max_tokens=12, ignore_eos=True).text


# --- outputs equal the offline engine ------------------------------------------------------


@pytest.mark.parametrize("model, extra, adapter", [
    ("model", {}, None), ("a", {}, "a"), ("p", {}, "p"), ("model:b", {}, "b"), ("base:c", {}, "c"),
    ("model", {"adapter": "d"}, "d"), ("a", {"adapter": None}, None),
])
def test_completion_equals_offline(client, ref, model, extra, adapter):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, **extra})
    want = ref.complete(PROMPT, adapter, max_tokens=12, ignore_eos=True)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)


def test_token_id_prompt(client, ref):
    ids = [5, 9, 30, 41, 77]
    out = client.completions.create(model="b", prompt=ids, **GREEDY)
    assert out.choices[0].text == ref.complete(ids, "b", max_tokens=12, ignore_eos=True).text


@pytest.mark.parametrize("adapter", [None, "a", "p"])
def test_chat_equals_offline(client, ref, adapter):
    out = client.chat.completions.create(
        model=adapter or "model", messages=[{"role": "user", "content": "tell me a story"}],
        **GREEDY)
    want = ref.chat("tell me a story", adapter, max_tokens=12, ignore_eos=True)
    assert out.choices[0].message.content == want.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.total_tokens == len(want.prompt_token_ids) + 12


@pytest.mark.parametrize("adapter", [None, "b"])
def test_streaming_equals_offline(client, ref, adapter):
    want = ref.chat("why is the sky blue", adapter, max_tokens=12, ignore_eos=True)
    stream = client.chat.completions.create(
        model=adapter or "model", messages=[{"role": "user", "content": "why is the sky blue"}],
        stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12

    want = ref.complete(PROMPT, adapter, max_tokens=12, ignore_eos=True)
    stream = client.completions.create(model=adapter or "model", prompt=PROMPT, stream=True,
                                       **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def _usages(chunks) -> list[tuple[int, int, int]]:
    return [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
            for c in chunks]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, ref, api):
    # vLLM's stream_options.continuous_usage_stats: every chunk says how many tokens so far
    options = {"include_usage": True, "continuous_usage_stats": True}
    if api == "chat":
        want = ref.chat("why is the sky blue", "a", max_tokens=12, ignore_eos=True)
        chunks = list(client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "why is the sky blue"}],
            stream=True, stream_options=options, **GREEDY))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        want = ref.complete(PROMPT, "a", max_tokens=12, ignore_eos=True)
        chunks = list(client.completions.create(model="a", prompt=PROMPT, stream=True,
                                                stream_options=options, **GREEDY))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert all(c.usage is not None for c in chunks)
    prompt = len(want.prompt_token_ids)
    usages = _usages(chunks)
    assert all(p == prompt and t == p + n for p, n, t in usages)
    counts = [n for _, n, _ in usages]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[-2] == 12  # last: the usage chunk
    if api == "chat":
        assert counts[0] == 0  # the role chunk: nothing generated yet


def test_usage_only_in_the_last_chunk_without_continuous_stats(client):
    chunks = list(client.completions.create(model="a", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_sse_wire_format(server):
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {USER}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1])


def test_logprobs_completions_and_chat(client, ref):
    want = ref.complete(PROMPT, "a", max_tokens=5, ignore_eos=True, logprobs=2)
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in want.logprobs], abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    out = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    want = ref.chat("hello", "a", max_tokens=4, ignore_eos=True, logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e["logprob"] for e in want.logprobs],
                                                         abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_stop_and_seed(client, ref):
    full = ref.complete(PROMPT, "c", max_tokens=12, ignore_eos=True)
    stop = full.text.split()[4]
    want = ref.complete(PROMPT, "c", max_tokens=12, ignore_eos=True, stop=(stop,))
    out = client.completions.create(model="c", prompt=PROMPT, stop=[stop], **GREEDY)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "stop"

    sampled = dict(max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)
    want = ref.complete(PROMPT, "d", **sampled)
    outs = [client.completions.create(model="d", prompt=PROMPT, max_tokens=10, temperature=0.9,
                                      seed=1234, extra_body={"ignore_eos": True})
            for _ in range(2)]
    assert [o.choices[0].text for o in outs] == [want.text] * 2


def test_concurrent_clients_on_more_adapters_than_slots(client, ref):
    # 5 adapters + base over 2 cache slots (+1 pinned): promotions, waits and mixed batches
    jobs = [(adapter, f"{PROMPT} {word}")
            for adapter in (None, "a", "b", "c", "d", "p") for word in ("sun", "sea")]

    def run(job):
        adapter, prompt = job
        out = client.completions.create(model=adapter or "model", prompt=prompt, max_tokens=20,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (adapter, prompt), text in zip(jobs, got):
        assert text == ref.complete(prompt, adapter, max_tokens=20, ignore_eos=True).text


def test_models_lists_base_and_adapters_with_residency(client, server):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == "model" and set(ids[1:]) == {"a", "b", "c", "d", "p"}
    raw = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {USER}"}).json()
    by_id = {m["id"]: m for m in raw["data"]}
    p = by_id["p"]["residency"]
    assert p["pinned"] is True and p["state"] == "READY" and p["slot"] is not None and p["uid"] > 0
    for name in "abcd":
        assert set(by_id[name]["residency"]) >= {"slot", "uid", "state", "pinned", "last_used"}
        assert by_id[name]["parent"] == "model"


# --- refusals ---------------------------------------------------------------------------------


def test_inference_refusals(client, server, ref):
    cases = [
        (lambda: client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
         openai.NotFoundError),
        (lambda: client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "hi"}], extra_body={"adapter": "zz"}),
         openai.NotFoundError),
        (lambda: client.completions.create(model="a", prompt=PROMPT, n=0), openai.BadRequestError),
        (lambda: client.completions.create(model="a", prompt=PROMPT, max_tokens=501),
         openai.BadRequestError),
        (lambda: client.completions.create(model="a", prompt=PROMPT, temperature=-1),
         openai.BadRequestError),
        (lambda: client.completions.create(model="a", prompt=PROMPT, max_tokens=0),
         openai.BadRequestError),
        (lambda: client.completions.create(model="a", prompt=[999999]), openai.BadRequestError),
        (lambda: client.chat.completions.create(model="a", messages=[]), openai.BadRequestError),
        (lambda: client.completions.create(model="a", prompt=PROMPT, presence_penalty=2.5),
         openai.BadRequestError),
        (lambda: openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
         .completions.create(model="a", prompt=PROMPT), openai.AuthenticationError),
    ]
    for call, error in cases:
        with pytest.raises(error) as info:
            call()
        body = info.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["message"]
        assert_serving(client, ref)

    auth = {"Authorization": f"Bearer {USER}"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (2 << 20), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "a", "prompt": PROMPT})
    assert r.status_code == 401
    assert_serving(client, ref)


def test_admin_endpoints_refuse_the_user_key(server, client, ref):
    endpoints = [
        ("POST", "/v1/adapters", {"name": "x", "path": "a"}),
        ("POST", "/v1/adapters/a/promote", None), ("POST", "/v1/adapters/a/swap", {"slot": 0}),
        ("POST", "/v1/adapters/a/pin", None), ("POST", "/v1/adapters/a/unpin", None),
        ("DELETE", "/v1/adapters/a", None), ("POST", "/v1/lora/active", {"adapter": "a"}),
        ("POST", "/v1/lora/load", {"name": "a", "path": "a", "slot": 0}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}),
    ]
    for method, path, body in endpoints:
        for key, status in ((USER, 403), (None, 401), ("wrong", 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == status, (method, path, key, r.text)
            assert r.json()["error"]["type"] in ("permission_error", "authentication_error")
    # reads are open to the user key; nothing above changed anything
    listing = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": f"Bearer {USER}"})
    assert {a["name"] for a in listing.json()["adapters"]} == {"a", "b", "c", "d", "p"}
    assert_serving(client, ref)


# --- observability (last: it checks what the tests above did) -------------------------------


def test_health_and_metrics(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # --api-key guards it too
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {USER}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("metrale_adapter_resident", "metrale_adapter_swap_seconds",
                 "metrale_adapter_promote_seconds", "metrale_refusals", "metrale_pool_full_waits",
                 "metrale_requests_waiting", "metrale_requests_running",
                 "metrale_generation_tokens", "metrale_time_to_first_token_seconds",
                 "metrale_inter_token_latency_seconds"):
        assert name in families, name

    def samples(family, suffix=""):
        return [s for s in families[family].samples if s.name == family + suffix]

    resident = {s.labels["adapter"]: s.labels for s in samples("metrale_adapter_resident")}
    assert set(resident) == {"a", "b", "c", "d", "p"}
    assert resident["p"]["state"] == "READY" and resident["p"]["slot"] != "none"
    assert sum(s.labels["state"] == "READY" for s in samples("metrale_adapter_resident")) <= 3
    promotes = samples("metrale_adapter_promote_seconds", "_count")
    assert promotes[0].labels == {"source": "disk"} and promotes[0].value >= 4
    refusals = {s.labels["reason"]: s.value for s in samples("metrale_refusals", "_total")}
    for reason in ("UnknownAdapterError", "BadRequestError", "InvalidSamplingParamsError",
                   "AuthenticationError", "PermissionDeniedError", "PayloadTooLargeError"):
        assert refusals.get(reason, 0) >= 1, (reason, refusals)
    tokens = {s.labels["adapter"]: s.value for s in samples("metrale_generation_tokens", "_total")}
    assert tokens[""] >= 12 and all(tokens[n] >= 12 for n in "abcdp")
    assert samples("metrale_requests_running")[0].value == 0
    assert samples("metrale_requests_waiting")[0].value == 0
    ttft = samples("metrale_time_to_first_token_seconds", "_count")[0].value
    assert ttft >= 20
    itl = samples("metrale_inter_token_latency_seconds", "_sum")[0].value
    assert 0 < itl < 600
    # every first token split its wait into adapter landing and queue; with 3 slots for 5
    # adapters some requests found their adapter resident and some waited for it
    assert samples("metrale_request_adapter_wait_seconds", "_count")[0].value == ttft
    assert samples("metrale_request_queue_wait_seconds", "_count")[0].value == ttft
    residency = {s.labels["residency"]: s.value for s in samples("metrale_adapter_requests",
                                                                  "_total")}
    assert residency["ready"] >= 1 and residency["waited"] >= 4, residency
    assert samples("metrale_adapter_queue_depth") == []  # nothing waits now
    json.dumps(resident)  # labels are plain strings
