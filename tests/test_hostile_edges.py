"""Edges a hostile re-run of bad inputs and faults found, each through the HTTP app
(in-process, TestClient): one fault gets one error class whatever the transport and
whenever it strikes; an adapter whose weights would overflow the pool is refused at
registration; error bodies are bounded and never show the server's own paths."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from metrale.cli import build_parser
from metrale.peer import nixl_transport
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.store import AdapterStore
from metrale.pool.landing import land_tensors, slot_norms
from metrale.server.serve import build_app
from tests.helpers.peers import adapter_dir, model_config, new_slots, peer_root
from tests.helpers.pool import norms_by_key

# --- a peer lost during or before the transfer: 502 peer_unavailable, whatever the transport --


class FakeAgent:
    """The part of nixl_agent metrale calls; READs are memmoves between two pools of this
    process. `mode` (class-wide): ok | die (the peer vanishes mid-READ) | stall."""

    mode = "ok"
    _ids = itertools.count(1)

    def __init__(self, name, config) -> None:
        self.name, self.backends = name, {"UCX": 1}
        self.dlists: dict[int, list] = {}
        self.xfers: dict[int, list] = {}

    def register_memory(self, tensor):
        return tensor.data_ptr()

    def get_agent_metadata(self) -> bytes:
        return b"fake-agent:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata.split(b":", 1)[1]

    def remove_remote_agent(self, name) -> None:
        pass

    def prep_xfer_dlist(self, agent_name, descs, mem_type):
        handle = next(self._ids)
        self.dlists[handle] = list(descs)
        return handle

    def make_prepped_xfer(self, op, local_h, local_idx, remote_h, remote_idx):
        handle = next(self._ids)
        self.xfers[handle] = [(self.dlists[local_h][i], self.dlists[remote_h][j])
                              for i, j in zip(local_idx, remote_idx)]
        return handle

    def transfer(self, handle) -> str:
        import ctypes

        for (dst, n, _), (src, _, _) in self.xfers[handle]:
            ctypes.memmove(dst, src, n // 2 if FakeAgent.mode != "ok" else n)
        return "DONE" if FakeAgent.mode == "ok" else "PROC"

    def check_xfer_state(self, handle) -> str:
        return {"die": "ERR", "stall": "PROC"}.get(FakeAgent.mode, "DONE")

    def release_xfer_handle(self, handle) -> None:
        self.xfers.pop(handle)

    def release_dlist_handle(self, handle) -> None:
        self.dlists.pop(handle)


class FakeNixl:
    nixl_agent = FakeAgent

    @staticmethod
    def nixl_agent_config(backends):
        return None


@pytest.fixture
def fake_nixl(monkeypatch):
    monkeypatch.setattr(nixl_transport, "load_nixl", lambda: FakeNixl)
    FakeAgent.mode = "ok"
    yield FakeAgent
    FakeAgent.mode = "ok"


@contextlib.contextmanager
def peer_store(transports=("http", "nixl"), store: list | None = None):
    """An in-process `metrale peer serve` over the peer helpers' adapters a, b, c; yields
    its address (and appends the AdapterStore to `store`)."""
    held = AdapterStore(peer_root()[0] / "adapters", model_config())
    if store is not None:
        store.append(held)
    exporter = held.exporter(transports).start()
    server = PeerHTTPServer(exporter).start()
    try:
        yield server.url.removeprefix("http://")
    finally:
        server.close()
        exporter.close()


def serve(*extra: str, model: Path | None = None) -> TestClient:
    args = build_parser().parse_args([
        "serve", "--model", str(model or peer_root()[0] / "model"), "--max-loras", "2",
        "--max-lora-rank", "8", "--max-model-len", "64", "--num-kv-blocks", "64", *extra])
    return TestClient(build_app(args)[0])


def complete(client: TestClient, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": [3, 14, 15, 92],
                                                "max_tokens": 2, "temperature": 0})


def test_a_landing_failure_keeps_the_class_of_a_typed_cause():
    from metrale.errors import AdapterLandingError, LandingError, NonFiniteWeightsError
    from metrale.peer.errors import PeerTimeoutError, PeerTransferError
    from metrale.server.errors import classify

    for cause, status, code in [
        (PeerTransferError("NIXL transfer ended in state ERR"), 502, "peer_unavailable"),
        (PeerTimeoutError("stalled"), 502, "peer_unavailable"),
        (NonFiniteWeightsError("NaN in the slot"), 422, "invalid_adapter"),
        (OSError("device lost"), 500, "landing_failed"),
        ("superseded", 500, "landing_failed"),
    ]:
        error = LandingError.caused_by(cause, "landing into slot 0 failed; the slot is now EMPTY")
        assert isinstance(error, LandingError)  # still says what happened to the slot
        assert classify(error)[::2] == (status, code), cause
    assert isinstance(LandingError.caused_by(NonFiniteWeightsError("x"), "m"), AdapterLandingError)


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_peer_lost_during_a_nixl_read_is_a_502_like_before_it(fake_nixl, mode):
    with peer_store() as addr, serve("--peer-transport", "nixl", "--peer-timeout", "1") as client:
        r = client.post("/v1/adapters", json={"name": "pa", "path": f"peer://{addr}/a"})
        assert r.status_code == 201, r.text
        fake_nixl.mode = mode  # the requests below wait for a promotion whose READ fails
        r = complete(client, "pa")
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "peer_unavailable"
        slots = client.get("/v1/adapters").json()["slots"]
        assert [s["state"] for s in slots] == ["EMPTY", "EMPTY"]  # the failed landing left it EMPTY
        fake_nixl.mode = "ok"  # the peer is back: the same adapter lands and serves
        assert complete(client, "pa").status_code == 200


def test_peer_lost_before_the_transfer_is_the_same_502():
    with serve("--peer-transport", "http") as client:
        with peer_store(("http",)) as addr:
            r = client.post("/v1/adapters", json={"name": "pa", "path": f"peer://{addr}/a"})
            assert r.status_code == 201, r.text
        r = complete(client, "pa")  # the store is gone: the lease cannot even be asked for
        assert r.status_code == 502 and r.json()["error"]["code"] == "peer_unavailable", r.text


# --- weights whose LoRA overflows the pool: 422 at registration, naming the tensor -----------


def huge_copy(src: Path, dst: Path, key_part: str = "lora_A", value: float = 3e38,
              dtype: torch.dtype | None = None) -> str:
    """A copy of the adapter at src with one weight set to `value` (in the first tensor,
    in sorted order, whose name holds key_part); returns that tensor's name."""
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    key = sorted(k for k in tensors if key_part in k)[0]
    tensors[key][0, 0] = value
    save_file(tensors, dst / "adapter_model.safetensors")
    return key


def test_adapter_whose_lora_would_overflow_is_refused_at_registration(tmp_path):
    key = huge_copy(adapter_dir("a"), tmp_path / "huge")  # 3e38: finite in the float32 pool
    with serve("--adapter-root", str(tmp_path)) as client:
        r = client.post("/v1/adapters", json={"name": "h", "path": "huge"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter" and key in error["message"]
        assert client.get("/v1/adapters").json()["adapters"] == []
        assert complete(client, "h").status_code == 404


@pytest.mark.parametrize("key_part, value, pool_dtype", [
    ("lora_A", 3e38, torch.float32), ("lora_A", 3e38, torch.bfloat16),
    ("lora_B", 3e38, torch.float32), ("lora_B", 65504.0, torch.float16),
    ("lora_A", 65504.0, torch.float16),
])
def test_gain_bound_refuses_what_overflows_in_the_pool_dtype(tmp_path, key_part, value, pool_dtype):
    """Each value fits the pool dtype on its own, the LoRA it is part of does not: an input
    of RMS 1 lined up with A's first row takes A x or s * B (A x) past the dtype's max
    (computed here in float64, from the file, not by the bound under test)."""
    from metrale.adapters.plan import plan_adapter
    from metrale.adapters.weights_check import WeightsOverflowError, check_weights
    from metrale.config import PoolConfig

    key = huge_copy(adapter_dir("a"), tmp_path / "h", key_part, value)
    tensors = load_file(tmp_path / "h" / "adapter_model.safetensors")
    prefix = key.rsplit(f".{key_part}", 1)[0]
    a, b = (tensors[f"{prefix}.{k}.weight"].double() for k in ("lora_A", "lora_B"))
    x = a[0] / a[0].norm() * a.shape[1] ** 0.5  # RMS 1
    h = a @ x
    scale = 8 / 4  # adapter a: lora_alpha / r
    assert max(h.abs().max(), (scale * b @ h).abs().max()) > torch.finfo(pool_dtype).max
    plan = plan_adapter(tmp_path / "h", "h", model_config(), PoolConfig(1, 8))
    with pytest.raises(WeightsOverflowError) as info:
        check_weights(plan, pool_dtype)
    assert key in str(info.value) and str(pool_dtype) in str(info.value)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gain_bound_keeps_peft_initialised_adapters(tmp_path, pool_dtype):
    """An adapter as PEFT initialises it with a random B (trained ones start from B = 0 and
    stay far smaller), all-linear at rank 64 with rsLoRA's scale of 16, passes in every
    pool dtype, float16 included."""
    from metrale.adapters.plan import plan_adapter
    from metrale.adapters.weights_check import check_weights
    from metrale.config import ModelConfig, PoolConfig
    from tests.helpers.tiny_models import hf_config, make_adapter, make_model

    path = tmp_path / "big"
    make_adapter(make_model("llama", seed=3), path, seed=4, r=64, lora_alpha=128,
                 use_rslora=True, target_modules="all-linear")
    model = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    check_weights(plan_adapter(path, "big", model, PoolConfig(1, 64)), pool_dtype)


@pytest.mark.parametrize("chunk_bytes", [None, 44])  # 44: rows straddle the pieces read
@pytest.mark.parametrize("key_part", [None, "lora_A", "lora_B"])
def test_landed_bytes_get_the_bound_registration_applies(tmp_path, monkeypatch, key_part,
                                                          chunk_bytes):
    """The bound at landing (the slot's bytes, reduced per module across layers by
    the landing's slot_norms) and at registration (check_weights: the file read in pieces)
    refuse the same adapters, naming the same tensor; adapter b has rank_pattern,
    alpha_pattern and rsLoRA on every linear."""
    from metrale.adapters import weights_check
    from metrale.adapters.plan import plan_adapter
    from metrale.config import PoolConfig

    if chunk_bytes is not None:
        monkeypatch.setattr(weights_check, "CHUNK_BYTES", chunk_bytes)
    src = adapter_dir("b")
    key = huge_copy(src, tmp_path / "h", key_part) if key_part else None
    path = tmp_path / "h" if key_part else src
    plan = plan_adapter(path, "h", model_config(), PoolConfig(1, 8))
    tensors = load_file(path / "adapter_model.safetensors")
    pool = new_slots(max_loras=2).pool
    land_tensors(pool.slot_tensors[1], pool.layout, plan,
                 [tensors[t.entry.name] for t in plan.landings])  # unchecked bytes

    def check_landed(plan, dtype):
        norms = norms_by_key(pool, 1)
        weights_check.check_gains(plan, [norms[(t.target.layer, t.target.module, t.kind)]
                                         for t in plan.landings], dtype)

    def check_bound(plan, dtype):  # a peer's cached plan: the same bound, as arrays
        bound = weights_check.GainBound.of(plan, pool.norm_keys)
        bound.check(plan, slot_norms(pool.slot_tensors[1])[0], dtype)

    for check in (weights_check.check_weights, check_landed, check_bound):
        if key is None:
            check(plan, torch.float32)
            continue
        with pytest.raises(weights_check.WeightsOverflowError, match=re.escape(key)):
            check(plan, torch.float32)


def test_non_finite_logits_name_the_adapter():
    """Bytes no check let through (here: written into the landed slot afterwards) fail
    the request alone, with an error that names its adapter."""
    from metrale import LLM, SamplingParams
    from metrale.errors import SamplingError

    llm = LLM(peer_root()[0] / "model", max_loras=1, max_lora_rank=8, max_model_len=64,
              block_size=4, num_kv_blocks=64)
    llm.register_adapter("a", adapter_dir("a"), pinned=True)  # lands now, in slot 0
    llm.engine.lora.pool.lora_a(0, "q_proj")[0].fill_(3e38)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(SamplingError, match="adapter 'a'"):
        llm.generate([3, 14, 15, 92], greedy, "a")
    assert len(llm.generate([3, 14, 15, 92], greedy)[0].token_ids) == 2  # the base still serves


@pytest.mark.parametrize("transport", ["http", "nixl"])
def test_peer_adapter_whose_lora_would_overflow_is_refused_when_it_lands(fake_nixl, transport):
    """A peer's bytes are never read at registration: the same bound holds where they
    land, as a 422 that names the tensor (not a 500 per completion). The peer lies: its
    slot was written after its own checks."""
    store = []
    with peer_store(store=store) as addr, serve("--peer-transport", transport) as client:
        slots = store[0].slots
        slots.pool.lora_a(0, "q_proj")[0, 0, 0] = 3e38  # the store lands a, b, c in slots 0, 1, 2
        r = client.post("/v1/adapters", json={"name": "pa", "path": f"peer://{addr}/a"})
        assert r.status_code == 201, r.text
        r = complete(client, "pa")
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter"
        assert re.search(r"layers\.0\.self_attn\.q_proj\.lora_A", error["message"]), error


# --- error bodies: what was sent, bounded, never the server's own paths ---------------------

HUGE = "x" * 100_000


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A server whose adapter root holds a, a truncated adapter and a symlink out of it."""
    root = tmp_path_factory.mktemp("hostile")
    jail = root / "srv-private" / "jail"
    jail.mkdir(parents=True)
    shutil.copytree(adapter_dir("a"), jail / "a")
    (jail / "corrupt").mkdir()
    (jail / "corrupt" / "adapter_config.json").write_text(
        (adapter_dir("a") / "adapter_config.json").read_text())
    weights = (adapter_dir("a") / "adapter_model.safetensors").read_bytes()
    (jail / "corrupt" / "adapter_model.safetensors").write_bytes(weights[:200])
    shutil.copytree(adapter_dir("a"), root / "elsewhere")  # a good adapter, outside the root
    (jail / "escape").symlink_to(root, target_is_directory=True)
    with serve("--adapter-root", str(jail)) as client:
        yield client, root


def _hostile_requests():
    long_path = "missing/" + "z" * 100_000
    yield "POST", "/v1/completions", {"model": HUGE, "prompt": [1, 2], "max_tokens": 1}, HUGE
    yield "POST", "/v1/chat/completions", {"model": HUGE, "messages": [
        {"role": "user", "content": "hi"}]}, HUGE
    for action in ("promote", "pin", "unpin"):
        yield "POST", f"/v1/adapters/{'y' * 5000}/{action}", None, "y" * 5000
    yield "POST", f"/v1/adapters/{'y' * 5000}/swap", {"slot": 0}, "y" * 5000
    yield "DELETE", f"/v1/adapters/{'y' * 5000}", None, "y" * 5000
    yield "POST", "/v1/adapters", {"name": HUGE, "path": "a"}, HUGE
    yield "POST", "/v1/adapters", {"name": "n", "path": long_path}, long_path
    yield "POST", "/v1/load_lora_adapter", {"lora_name": HUGE, "lora_path": "a"}, HUGE
    yield "POST", "/v1/unload_lora_adapter", {"lora_name": HUGE}, HUGE
    yield "POST", "/v1/lora/active", {"adapter": HUGE}, HUGE
    yield "POST", "/v1/lora/load", {"name": "n", "path": long_path, "slot": 0}, long_path
    for name in ("n\x01\n\x1b[31mred", "\x7f\x85\u2028"):  # C0, DEL, C1, a line separator
        yield "POST", "/v1/adapters", {"name": name, "path": "a"}, name
        yield "POST", "/v1/completions", {"model": name, "prompt": [1], "max_tokens": 1}, name
    for path in ("missing", "corrupt", "escape", "escape/elsewhere", "/etc", "/",
                 "/nonexistent/deep/dir", "a\x00b", "../jail/a", "a/adapter_config.json",
                 "\x1b[2J"):
        yield "POST", "/v1/adapters", {"name": "n", "path": path}, path
        yield "POST", "/v1/lora/load", {"name": "n", "path": path, "slot": 0}, path
        yield "POST", "/v1/load_lora_adapter", {"lora_name": "n", "lora_path": path}, path


@pytest.mark.parametrize("method, route, body, sent", list(_hostile_requests()),
                         ids=itertools.count())
def test_refusals_are_bounded_and_show_no_server_path(hostile, method, route, body, sent):
    client, root = hostile
    r = client.request(method, route, json=body)
    assert 400 <= r.status_code < 500, r.text[:500]  # none registers: the fixture stays as it is
    assert len(r.content) < 2000  # a 100k-character name is not echoed back whole
    error = r.json()["error"]
    text = json.dumps(error)
    for private in (str(root), str(adapter_dir("a").parent), "srv-private"):
        if private not in sent:  # a path the caller sent may come back as sent
            assert private not in text, text
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", error["message"]), error


@pytest.mark.parametrize("method, route, body", [
    ("POST", "/v1/completions", {"model": HUGE, "prompt": [1, 2], "max_tokens": 1}),
    ("POST", "/v1/adapters", {"name": HUGE, "path": "a"}),
    ("POST", "/v1/adapters", {"name": "n", "path": HUGE}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": HUGE}),
    ("POST", f"/v1/adapters/{HUGE[:5000]}/promote", None),
])
def test_refusals_name_what_was_sent_truncated(hostile, method, route, body):
    """The 100 KB 404 of a hostile re-run: now the start of the name (the name rule quotes
    64 characters, the error body cuts any run at 100) and a marker that more was sent."""
    r = hostile[0].request(method, route, json=body)
    message = r.json()["error"]["message"]
    assert 400 <= r.status_code < 500 and len(r.content) < 1000, r.text[:300]
    assert "x" * 60 in message and "x" * 101 not in message, message
    assert re.search(r"x'?\.\.\.", message), message  # a marker that more was sent


def test_a_server_path_in_an_engine_message_is_cut_to_what_the_caller_named(hostile):
    """The engine names the resolved file it could not read; the caller sent 'corrupt'."""
    r = hostile[0].post("/v1/adapters", json={"name": "n", "path": "corrupt"})
    message = r.json()["error"]["message"]
    assert r.status_code == 422 and message.startswith(".../adapter_model.safetensors: "), message
