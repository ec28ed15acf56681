"""Adapter management against a real `metrale serve` process: load, promote,
swap and unload while requests stream (outputs unchanged), busy slots (409),
bad adapters (422), POOL_FULL (503), path escapes, the admin key, the
default adapter, the vLLM and original-engine dialects, client disconnects
and the `metrale adapters` client. After every refusal the server still
answers a completion."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.cli import main as cli_main
from tests.helpers.process import Bound
from tests.helpers.server import Reference, ServerProcess, make_world, sse_events

ADMIN = "admin-key"
PROMPT = "tell me about the sea"
# tokens: a stream that outlasts the admin calls and the 1 s promotion wait. 900 did not
# on an idle box (the tiny model makes ~1000 tokens a second there); this is 16x that.
LONG = 16000


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = make_world(tmp_path_factory.mktemp("admin"))
    adapters, outside = world["adapters"], world["outside"]
    (adapters / "escape").symlink_to(outside / "evil", target_is_directory=True)
    (adapters / "alias").symlink_to(adapters / "a", target_is_directory=True)
    (adapters / "afile").write_text("not an adapter")
    for name, target in (("linkfile", outside / "evil" / "adapter_model.safetensors"),
                         ("devnull", "/dev/null")):
        (adapters / name).mkdir()
        shutil.copy(adapters / "a" / "adapter_config.json", adapters / name)
        (adapters / name / "adapter_model.safetensors").symlink_to(target)
    (adapters / "fifo").mkdir()
    shutil.copy(adapters / "a" / "adapter_config.json", adapters / "fifo")
    os.mkfifo(adapters / "fifo" / "adapter_model.safetensors")
    shutil.copytree(adapters / "a", adapters / "corrupt")
    weights = adapters / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return world


@pytest.fixture(scope="module")
def server(world, tmp_path_factory):
    srv = ServerProcess(
        ["--model", str(world["model"]), "--adapter-root", str(world["adapters"]),
         "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "16400",
         "--max-tokens-limit", "16384",
         "--admin-key", ADMIN, "--promotion-timeout", "1"],
        tmp_path_factory.mktemp("admin-log") / "server.log")
    try:
        assert admin(srv, "POST", "/v1/adapters", {"name": "a", "path": "a"}).status_code == 201
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def ref(world):
    ref = Reference(world)
    for name in "abcd":
        ref.register(name)
    return ref


def admin(server, method, path, body=None, key=ADMIN):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)


def complete(server, model, max_tokens=8, **extra):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def adapters(server) -> dict:
    listing = httpx.get(f"{server.url}/v1/adapters", timeout=10).json()
    return {a["name"]: a for a in listing["adapters"]} | {"_slots": listing["slots"]}


def assert_serving(server, ref, model=None):
    r = complete(server, model or "model")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.complete(PROMPT, model, max_tokens=8,
                                                          ignore_eos=True).text


def refused(response, status, code=None, words=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code
    for word in words:
        assert word in error["message"], error["message"]


def wait_for(predicate, bound_s=20.0):
    """Until predicate() holds, under a bound only a hung server reaches (the machine's
    load stretches it)."""
    bound = Bound(bound_s)
    while not predicate():
        if bound.expired():
            raise AssertionError(f"condition not reached in {bound.describe()}")
        time.sleep(0.05)  # the pause between two polls of the server's state


def stream(server, model, max_tokens=LONG):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120)


# --- management while requests stream ----------------------------------------------------------


def test_load_promote_swap_unload_while_streaming(server, ref):
    # a cut-off multi-byte character at the end of 600 tokens is completed by the next ones
    want = ref.complete(PROMPT, "a", max_tokens=600, ignore_eos=True).text.rstrip("\ufffd")
    # LONG tokens: the request is still running at the unload below, however fast the box
    # (600 of them could end first); its first 600 tokens' text is compared, then the
    # stream is closed, which aborts the request and ends a's drain.
    with stream(server, "a") as r:
        events = sse_events(r)
        text = next(events)["choices"][0]["text"]
        slot_a = adapters(server)["a"]["slot"]
        assert adapters(server)["a"]["ref_count"] == 1

        # load (vLLM dialect), then swap: refused over the busy slot, fine over the idle one
        r2 = admin(server, "POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "c"})
        assert r2.status_code == 200 and "Success" in r2.text
        refused(admin(server, "POST", "/v1/adapters/c/swap", {"slot": slot_a}), 409, "slot_busy",
                ["in-flight"])
        swapped = admin(server, "POST", "/v1/adapters/c/swap", {"slot": 1 - slot_a}).json()
        assert swapped["adapter"]["slot"] == 1 - slot_a
        # load (native) + promote: b lands in the idle slot, never over the busy one
        assert admin(server, "POST", "/v1/adapters", {"name": "b", "path": "b"}).status_code == 201
        promoted = admin(server, "POST", "/v1/adapters/b/promote").json()
        assert promoted["adapter"]["slot"] == 1 - slot_a and promoted["evicted"] == "c"
        # unload: a leaves the registry now, its slot when its request ends
        assert admin(server, "DELETE", "/v1/adapters/a").json()["status"] == "draining"
        refused(complete(server, "a"), 404, "model_not_found")
        refused(admin(server, "POST", "/v1/adapters/a/promote"), 409)
        assert adapters(server)["a"]["unloading"] is True
        assert_serving(server, ref, "b")
        for event in events:
            text += event["choices"][0]["text"]
            if len(text) >= len(want):
                break
    # every operation above left the running request alone
    assert text[:len(want)] == want

    wait_for(lambda: "a" not in adapters(server))
    assert adapters(server)["_slots"][slot_a]["state"] == "EMPTY"
    # the name is free again
    assert admin(server, "POST", "/v1/adapters", {"name": "a", "path": "a"}).status_code == 201
    assert_serving(server, ref, "a")
    assert "event=swap adapter=c" in server.log() and "event=promote adapter=b" in server.log()


def test_client_disconnect_aborts_the_request(server, ref):
    with stream(server, "c") as r:
        events = sse_events(r)
        next(events), next(events)
        assert adapters(server)["c"]["ref_count"] == 1
    wait_for(lambda: adapters(server)["c"]["ref_count"] == 0)
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.5, json={
            "model": "c", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
    wait_for(lambda: adapters(server)["c"]["ref_count"] == 0)
    assert_serving(server, ref, "c")


def test_pool_full_is_503_after_the_wait(server, ref):
    assert admin(server, "POST", "/v1/adapters/b/pin").json()["adapter"]["pinned"] is True
    assert admin(server, "POST", "/v1/adapters", {"name": "d", "path": "d"}).status_code == 201
    try:
        with stream(server, "c") as r:
            events = sse_events(r)  # kept referenced: closing it would close the stream
            next(events)  # c holds the only cache slot; b is pinned in the other
            start = time.monotonic()
            refused(complete(server, "d"), 503, "pool_full", ["POOL_FULL"])
            assert time.monotonic() - start >= 0.9
            assert_serving(server, ref, "b")  # resident adapters and the base still serve
            assert_serving(server, ref)
    finally:
        assert admin(server, "POST", "/v1/adapters/b/unpin").json()["adapter"]["pinned"] is False
    assert_serving(server, ref, "d")
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics").text)}
    assert families["metrale_pool_full_waits"].samples[0].value >= 1
    refusals = {s.labels["reason"]: s.value for s in families["metrale_refusals"].samples
                if s.name.endswith("_total")}
    assert refusals["PoolFullError"] >= 1 and refusals["SlotBusyError"] >= 1
    swaps = [s for s in families["metrale_adapter_swap_seconds"].samples
             if s.name.endswith("_count")]
    assert swaps[0].value >= 1


# --- refusals -------------------------------------------------------------------------------


def test_adapter_refusals(server, ref, world):
    cases = [
        (("POST", "/v1/adapters", {"name": "bad", "path": "bad"}), 422, ["rank"]),
        (("POST", "/v1/adapters", {"name": "corrupt", "path": "corrupt"}), 422, []),
        (("POST", "/v1/adapters", {"name": "../x", "path": "a"}), 400, ["invalid"]),
        (("POST", "/v1/adapters", {"name": "has space", "path": "a"}), 400, []),
        (("POST", "/v1/adapters", {"name": "c", "path": "c"}), 409, ["already"]),
        (("POST", "/v1/adapters/c/swap", {"slot": 7}), 400, ["out of range"]),
        (("POST", "/v1/adapters/nope/promote", None), 404, []),
        (("POST", "/v1/adapters/nope/pin", None), 404, []),
        (("DELETE", "/v1/adapters/nope", None), 404, []),
        (("POST", "/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, []),
        (("POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "c"}), 400, ["already"]),
        (("POST", "/v1/lora/active", {"adapter": "nope"}), 404, []),
        (("POST", "/v1/lora/load", {"name": "e", "path": "a", "slot": 9}), 400, []),
        (("POST", "/v1/adapters", {"name": "x"}), 400, ["path"]),
    ]
    for (method, path, body), status, words in cases:
        refused(admin(server, method, path, body), status, words=words)
        assert_serving(server, ref, "c")
    assert {"bad", "corrupt", "x"}.isdisjoint(adapters(server))


def test_adapter_paths_stay_inside_the_root(server, ref, world):
    cases = [
        ("../outside/evil", 400, "'..'"),
        (str(world["outside"] / "evil"), 403, "outside"),
        ("escape", 403, "outside"),  # directory symlink out of the root
        ("linkfile", 403, "outside"),  # weights file symlinked out of the root
        ("devnull", 403, "outside"),  # ... to a device
        ("fifo", 400, "regular file"),  # a non-regular file inside the root
        ("afile", 400, "not a directory"),
        ("missing", 400, "does not exist"),
        ("", 400, "non-empty"),
    ]
    for path, status, words in cases:
        for method, endpoint, body in (
            ("POST", "/v1/adapters", {"name": "x", "path": path}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}),
            ("POST", "/v1/lora/load", {"name": "x", "path": path, "slot": 0}),
        ):
            refused(admin(server, method, endpoint, body), status, words=[words])
        assert_serving(server, ref)
    # a symlink that stays inside the root is fine
    assert admin(server, "POST", "/v1/adapters", {"name": "alias", "path": "alias"}).status_code == 201
    assert admin(server, "DELETE", "/v1/adapters/alias").json()["status"] == "unloaded"


def test_admin_key_required(server, ref):
    for key in (None, "wrong"):
        refused(admin(server, "POST", "/v1/adapters/c/promote", key=key), 401)
        refused(admin(server, "POST", "/v1/lora/active", {"adapter": None}, key=key), 401)
    assert_serving(server, ref)  # no --api-key: inference is open


# --- dialects ---------------------------------------------------------------------------------


def test_default_adapter_is_explicit(server, ref):
    assert admin(server, "POST", "/v1/lora/active", {"adapter": "c"}).json() == {"adapter": "c"}
    try:
        assert_serving_as = ref.complete(PROMPT, "c", max_tokens=8, ignore_eos=True).text
        assert complete(server, "model").json()["choices"][0]["text"] == assert_serving_as
        base = complete(server, "model", adapter=None).json()["choices"][0]["text"]
        assert base == ref.complete(PROMPT, None, max_tokens=8, ignore_eos=True).text
        admin(server, "POST", "/v1/adapters/d/promote")  # promotions never move the default
        assert httpx.get(f"{server.url}/v1/lora/active").json() == {"adapter": "c"}
    finally:
        assert admin(server, "POST", "/v1/lora/active", {"adapter": None}).json() == {"adapter": None}
    assert_serving(server, ref)


def test_vllm_load_inplace_and_unload(server, ref):
    assert_serving(server, ref, "c")  # resident
    r = admin(server, "POST", "/v1/load_lora_adapter",
              {"lora_name": "c", "lora_path": "d", "load_inplace": True})
    assert r.status_code == 200, r.text
    want = ref.complete(PROMPT, "d", max_tokens=8, ignore_eos=True).text
    assert complete(server, "c").json()["choices"][0]["text"] == want
    assert admin(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    refused(complete(server, "c"), 404)
    assert admin(server, "POST", "/v1/load_lora_adapter",
                 {"lora_name": "c", "lora_path": "c"}).status_code == 200
    assert_serving(server, ref, "c")


def test_original_slot_load(server, ref):
    r = admin(server, "POST", "/v1/lora/load", {"name": "e", "path": "a", "slot": 1})
    assert r.status_code == 200, r.text
    assert adapters(server)["_slots"][1]["name"] == "e"
    want = ref.complete(PROMPT, "a", max_tokens=8, ignore_eos=True).text
    assert complete(server, "e").json()["choices"][0]["text"] == want


def test_adapters_cli_client(server, capsys):
    url = ["--url", server.url, "--admin-key", ADMIN]
    assert cli_main(["adapters", "list", *url]) == 0
    assert "e" in capsys.readouterr().out
    assert cli_main(["adapters", "load", "f", "b", *url]) == 0
    assert '"name": "f"' in capsys.readouterr().out
    assert cli_main(["adapters", "promote", "f", *url]) == 0
    assert '"state": "READY"' in capsys.readouterr().out
    assert cli_main(["adapters", "swap", "f", "0", *url]) == 0
    assert cli_main(["adapters", "unload", "f", *url]) == 0
    capsys.readouterr()
    assert cli_main(["adapters", "promote", "nope", *url]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert cli_main(["adapters", "list", "--url", server.url, "--admin-key", "wrong"]) == 0  # reads
