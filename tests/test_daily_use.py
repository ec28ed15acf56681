"""What a user meets every day, beyond generation itself: errors in the caller's own
spelling and with this server's real limits, `metrale adapters ... | head`, the printed
quick-start curl, vLLM's small endpoints (/ping, GET /v1/models/{id}, /tokenize's
add_special_tokens), and adapter names with '/' (org/adapter), never a path."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from metrale.cli import _flags, build_parser, cli_spelling
from metrale.config import ConfigError, EngineConfig, PoolConfig
from metrale.errors import InvalidNameError
from metrale.names import MAX_NAME_CHARS, is_valid_name, validate_adapter_name
from metrale.peer.ids import describe_ids
from metrale.peer.listing import fetch_ids, peer_source
from metrale.server.serve import build_app, curl_example
from tests.helpers.tiny_models import make_adapter, saved_tiny_model

REPO = Path(__file__).resolve().parents[1]
BASE = "tiny-base"
LIMIT = 100  # --max-tokens-limit, far below the engine's own sanity bound
KEY = "k"
HOSTILE = ["../a", "/a", "a/", "a//b", "org/../a", "org/./a", ".", "..", "a\\b", "a b",
           "org/a..b", "a/" + "b" * MAX_NAME_CHARS, "x" * (MAX_NAME_CHARS + 1), "org/.hidden",
           "ok\n", "é", "", "a:b", "a/%2e%2e", "-a", "org/-a", "a\x00"]


# --- a tiny server in-process -----------------------------------------------------------------


def _save_tokenizer_with_bos(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose encode() puts <s> first unless told not to, as
    Llama's does: what add_special_tokens switches."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "<unk> <s> </s> user assistant hello world the moon".split()
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("daily")
    base = saved_tiny_model(root / BASE, seed=3, tokenizer=_save_tokenizer_with_bos)
    make_adapter(base, root / "jail" / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    return root


@pytest.fixture(scope="module")
def client(world):
    args = build_parser().parse_args([
        "serve", "--model", str(world / BASE), "--adapter-root", str(world / "jail"),
        "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256",
        "--num-kv-blocks", "64", "--max-tokens-limit", str(LIMIT), "--api-key", KEY])
    app, _, _ = build_app(args)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _error(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- errors in the caller's spelling, with this server's limits -------------------------------


@pytest.mark.parametrize("path,field,extra", [
    ("/v1/completions", "max_tokens", {"prompt": "hello"}),
    ("/v1/chat/completions", "max_tokens", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/chat/completions", "max_completion_tokens",
     {"messages": [{"role": "user", "content": "hello"}]}),
])
@pytest.mark.parametrize("value", [0, -1, LIMIT + 1, 2**70])
def test_max_tokens_out_of_range_quotes_this_servers_limit(client, path, field, extra, value):
    r = client.post(path, json={"model": BASE, field: value, **extra})
    assert r.status_code == 400
    error = _error(r)
    assert error["param"] == field and error["message"].startswith(field)
    assert f"[1, {LIMIT}]" in error["message"] and "1048576" not in error["message"]
    assert len(error["message"]) < 200


def test_sampling_errors_name_the_request_field(client):
    r = client.post("/v1/chat/completions", json={
        "model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 99})
    error = _error(r)
    assert r.status_code == 400 and error["param"] == "top_logprobs"
    assert error["message"].startswith("top_logprobs must be")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stream": True}),
    ("/tokenize", {"prompt": "hello"}),
])
def test_unknown_model_404_names_the_base_model(client, path, body):
    r = client.post(path, json={"model": "org/nope", **body})
    error = _error(r)
    assert r.status_code == 404 and error["code"] == "model_not_found"
    assert "'org/nope'" in error["message"] and f"'{BASE}'" in error["message"]


def test_registering_twice_says_how_in_each_dialect(client):
    assert client.post("/v1/adapters", json={"name": "twice", "path": "a"}).status_code == 201
    try:
        native = _error(client.post("/v1/adapters", json={"name": "twice", "path": "a"}))
        original = _error(client.post("/v1/lora/load", json={"name": "twice", "path": "a",
                                                               "slot": 0}))
        vllm = client.post("/v1/load_lora_adapter", json={"lora_name": "twice", "lora_path": "a"})
        assert '"reload": true' in original["message"]
        assert '"load_inplace": true' in _error(vllm)["message"]
        for message in (native["message"], original["message"], _error(vllm)["message"]):
            assert "reload=True" not in message and "=True" not in message
    finally:
        client.delete("/v1/adapters/twice")


def test_http_messages_carry_no_python_spellings(client):
    """Refusals that quote a setting say the server's flag, never LLM()'s argument."""
    messages = [
        _error(client.post("/v1/adapters/a/swap", json={"slot": 7}))["message"],
        _error(client.post("/v1/completions", json={"model": BASE, "prompt": "hello " * 200,
                                                     "max_tokens": 90}))["message"],
    ]
    client.post("/v1/adapters", json={"name": "a", "path": "a"})
    try:
        messages.append(_error(client.post("/v1/adapters/a/swap", json={"slot": 7}))["message"])
    finally:
        client.delete("/v1/adapters/a")
    for message in messages:
        assert "max_loras" not in message and "max_model_len" not in message, message
    assert "--max-loras" in messages[-1] and "--max-model-len" in messages[1]


def test_cli_says_flags_for_engine_settings():
    flags = _flags(build_parser())
    for make in (lambda: EngineConfig(max_num_seqs=64, max_num_batched_tokens=32),
                 lambda: PoolConfig(max_loras=-1), lambda: PoolConfig(max_lora_rank=0)):
        with pytest.raises(ConfigError) as e:
            make()
        said = cli_spelling(str(e.value), flags)
        assert "--max-" in said and "max_" not in said.replace("--max-", ""), said
    # a quoted value that only looks like a setting is left alone when no flag has its name
    assert cli_spelling("adapter 'my_adapter' is not registered", flags) == \
        "adapter 'my_adapter' is not registered"


def test_cli_serve_refusal_is_one_line_in_flags(world):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "metrale", "serve", "--model", str(world / BASE),
         "--max-num-seqs", "64", "--max-num-batched-tokens", "32", "--port", "1"],
        capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "--max-num-batched-tokens (32) must be >= --max-num-seqs (64)" in errors[0]
    assert "Traceback" not in proc.stderr


# --- `metrale adapters ... | head` ------------------------------------------------------------


class _Canned(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the server's `body`; records the Authorization header."""

    def do_GET(self):
        self.server.seen.append(self.headers.get("Authorization"))
        data = json.dumps(self.server.body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def canned():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    server.body, server.seen = {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_adapters_list_into_a_closed_pipe_ends_quietly(canned, json_flag):
    canned.body = {"model": BASE, "default_adapter": None, "adapters": [
        {"name": f"org/a{i}", "slot": None, "state": "DISK", "unloading": False,
         "pinned": False, "ref_count": 0, "path": f"/x/{i}"} for i in range(3000)]}
    read, write = os.pipe()
    os.close(read)  # the reader (`head`) is gone before the first line
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "metrale", "adapters", "list", *json_flag, "--url",
         f"http://127.0.0.1:{canned.server_port}"],
        stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write)
    assert canned.seen, "the command never asked the server"
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


# --- the printed quick-start curl works as printed ------------------------------------------


@pytest.mark.parametrize("key,from_env", [("s3cr3t", True), ("it's $HOME `x`", False), (None, False)])
def test_quickstart_curl_sends_the_servers_key(canned, key, from_env):
    cmd = curl_example(f"http://127.0.0.1:{canned.server_port}", "shout", key, key_from_env=from_env)
    env = {k: v for k, v in os.environ.items() if k != "METRALE_API_KEY"}
    if from_env:
        env["METRALE_API_KEY"] = key
    proc = subprocess.run(["bash", "-c", cmd + " -s -o /dev/null"], env=env, timeout=60)
    assert proc.returncode == 0
    assert canned.seen == [None if key is None else f"Bearer {key}"]


# --- vLLM's small endpoints ------------------------------------------------------------------


def test_ping_is_public_like_health(client):
    for method in ("GET", "POST"):
        r = client.request(method, "/ping", headers={"Authorization": ""})
        assert r.status_code == 200
    assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401


def test_get_one_model(client):
    listing = client.get("/v1/models").json()["data"]
    assert client.get(f"/v1/models/{BASE}").json() == listing[0]
    client.post("/v1/adapters", json={"name": "org/a", "path": "a"})
    try:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        for url in ("/v1/models/org/a", "/v1/models/org%2Fa"):
            r = client.get(url)
            assert r.status_code == 200 and r.json() == listed["org/a"]
    finally:
        client.delete("/v1/adapters/org/a")
    for missing in ("nope", "org/a", "org", "..%2F..%2Fetc%2Fpasswd", "x" * 300):
        r = client.get(f"/v1/models/{missing}")
        error = _error(r)
        assert r.status_code == 404 and error["code"] == "model_not_found"
        assert BASE in error["message"] and len(error["message"]) < 300


def test_tokenize_add_special_tokens(client, world):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(world / BASE)
    text = "hello the moon"
    with_bos, without = hf.encode(text), hf.encode(text, add_special_tokens=False)
    assert with_bos != without  # the check can fail: this tokenizer adds <s>
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == with_bos
    for flag, expected in ((True, with_bos), (False, without)):
        r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": flag})
        assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": "no"})
    assert r.status_code == 400 and _error(r)["param"] == "add_special_tokens"


# --- adapter names with '/', never a path ------------------------------------------------------


def test_name_rule():
    for name in ("a", "org/a", "Org-1/a.b_c", "a/b/c", "x" * MAX_NAME_CHARS, "0/0"):
        assert is_valid_name(name) and validate_adapter_name(name) == name
    for name in HOSTILE + [None, 3, b"a", ["a"]]:
        assert not is_valid_name(name), name
        with pytest.raises(InvalidNameError) as e:
            validate_adapter_name(name)
        assert len(str(e.value)) < 400  # a megabyte name is not echoed whole


def test_slash_names_over_http(client):
    listing = lambda: {a["name"] for a in client.get("/v1/adapters").json()["adapters"]}  # noqa: E731
    r = client.post("/v1/adapters", json={"name": "org/a", "path": "a"})
    assert r.status_code == 201 and r.json()["adapter"]["name"] == "org/a"
    try:
        for suffix in ("promote", "pin", "unpin"):
            for name in ("org/a", "org%2Fa"):
                r = client.post(f"/v1/adapters/{name}/{suffix}")
                assert r.status_code == 200 and r.json()["adapter"]["name"] == "org/a"
        r = client.post("/v1/completions", json={"model": "org/a", "prompt": "hello",
                                                 "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "org/a"
        # same files under a plain name answer the same: the name is only a name
        client.post("/v1/adapters", json={"name": "plain", "path": "a"})
        r2 = client.post("/v1/completions", json={"model": "plain", "prompt": "hello",
                                                  "max_tokens": 3, "temperature": 0})
        assert r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert client.post("/v1/lora/active", json={"adapter": "org/a"}).json() == \
            {"adapter": "org/a"}
        client.post("/v1/lora/active", json={"adapter": None})
    finally:
        assert client.delete("/v1/adapters/org%2Fa").json() == {"name": "org/a",
                                                                "status": "unloaded"}
        client.delete("/v1/adapters/plain")
    before = listing()
    for name in HOSTILE:
        r = client.post("/v1/adapters", json={"name": name, "path": "a"})
        assert r.status_code == 400 and _error(r)["code"] == "invalid_adapter_name", name
        assert len(_error(r)["message"]) < 400
        for method, suffix in (("POST", "/promote"), ("POST", "/pin"), ("DELETE", "")):
            r = client.request(method, f"/v1/adapters/{quote(name, safe='')}{suffix}")
            assert r.status_code in (400, 404, 405), (name, suffix, r.status_code)
        r = client.post("/v1/lora/active", json={"adapter": name})
        assert r.status_code in (400, 404) if name else r.status_code == 200
    assert listing() == before


def test_slash_names_as_peer_ids(canned):
    canned.body = {"adapters": [{"id": i} for i in ["org/x", "plain", *HOSTILE]]}
    url = f"http://127.0.0.1:{canned.server_port}"
    assert fetch_ids(url) == ["org/x", "plain"]
    assert peer_source(url, "org/x") == f"peer://127.0.0.1:{canned.server_port}/org/x"
    from metrale.engine.registry import parse_peer_uri

    assert parse_peer_uri(peer_source(url, "org/x")).adapter_id == "org/x"
    shown = describe_ids(["org/x", *HOSTILE])
    assert shown.startswith("org/x and ") and "../" not in shown and "\n" not in shown


# --- `serve` checks its port before anything slow (the model, Ray) ---------------------------


@pytest.mark.parametrize("extra", [[], ["--replicas", "2"]])
def test_a_taken_port_is_one_line_before_anything_starts(extra):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "metrale", "serve", "--port", str(port),
             *extra], capture_output=True, text=True, env=env, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and said == [
        f"metrale: error: 127.0.0.1:{port} is already in use (another `metrale serve`, or "
        "`make run`?): stop it or pass another --port"], said
    assert not {"torch", "ray", "uvicorn"} & imported  # no model loaded, no Ray started


def test_listen_checks():
    from metrale.server.listen import ListenError, check_can_listen

    check_can_listen("127.0.0.1", 0)
    with socket_on_free_port() as port:
        with pytest.raises(ListenError, match="already in use"):
            check_can_listen("127.0.0.1", port)
    check_can_listen("127.0.0.1", port)  # released: free again
    with pytest.raises(ListenError, match="--host"):
        check_can_listen("no-such-host.invalid", 8000)


def test_replicas_without_ray_say_how_to_install_it(monkeypatch):
    import importlib.util

    from metrale.server import listen

    real = importlib.util.find_spec
    monkeypatch.setattr(listen.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "ray" else real(name, *a))
    with pytest.raises(listen.MissingExtraError, match="make cluster"):
        listen.require_ray()


class socket_on_free_port:
    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen()
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()
