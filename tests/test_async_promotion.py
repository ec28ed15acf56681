"""On-demand disk promotions run off the engine thread: decoding of other requests
goes on while an adapter is read, a refusal found by the worker fails only its
requests and touches no slot, and the promoted adapter serves the same tokens as
the synchronous path."""

from __future__ import annotations

import hashlib
import shutil
import threading
import time

import pytest

from metrale import LLM, SamplingParams
from metrale.pool.staging import StagingBuffers
from metrale.pool.swap import LandingEvent
from tests.helpers.engine import run_until_done, step_until
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 61, 2, 9, 13, 200]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_promo")
    base = make_model("llama", seed=4)
    save_model(base, root / "model")
    for i, name in enumerate(("a", "b")):
        make_adapter(base, root / name, seed=30 + i, r=4, lora_alpha=8, target_modules="all-linear")
    return root


def _llm(root, **kw):
    args = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128, num_kv_blocks=128)
    llm = LLM(root / "model", **{**args, **kw})
    for name in ("a", "b"):
        llm.register_adapter(name, root / name)
    return llm


def _pool_hash(engine) -> tuple:
    pool = engine.lora.pool
    digest = hashlib.sha256()
    for t in (pool.buffer, pool.ranks, pool.scales):
        digest.update(t.contiguous().view(-1).view(dtype=t.dtype).numpy().tobytes())
    ids = tuple((i.slot, i.version, i.uid, i.generation, i.state) for i in engine.slot_info())
    ids += tuple(sorted(engine.registry.routes().items()))
    return digest.hexdigest(), ids


def test_decoding_goes_on_while_a_promotion_reads(root, monkeypatch):
    llm = _llm(root)
    engine = llm.engine
    release = threading.Event()
    original = StagingBuffers.read_file

    def slow_read(self, *args):
        release.wait(10)  # the worker holds the read until the base request made progress
        return original(self, *args)

    monkeypatch.setattr(StagingBuffers, "read_file", slow_read)
    events: list[LandingEvent] = []
    engine.lora.listeners.append(events.append)
    base = engine.add_request(PROMPT, BASE)
    engine.step()  # base prefill
    waiting = engine.add_request(PROMPT, GREEDY, "a")
    steps_with_base_tokens, done = 0, {}
    for _ in range(2000):
        in_flight = engine.adapters.job is not None
        outs = engine.step()
        if in_flight and any(o.request_id == base and o.token_ids for o in outs):
            steps_with_base_tokens += 1
            if steps_with_base_tokens >= 10:
                release.set()
        done.update({o.request_id: o for o in outs if o.finished})
        if not engine.has_unfinished_requests():
            break
    release.set()
    assert steps_with_base_tokens >= 10  # the loop was never blocked by the promotion
    assert done[base].finish_reason == "length" and done[waiting].finish_reason == "length"
    assert engine.adapters.num_promotions == 1
    assert [(e.name, e.source, e.error) for e in events] == [("a", "disk", None)]
    engine.check_integrity()


def test_waiter_tokens_equal_synchronous_path(root):
    fast = _llm(root)
    sync = _llm(root, async_promotions=False)
    for llm in (fast, sync):  # "a" lands while a base request decodes; "b" into an idle engine
        engine = llm.engine
        engine.add_request(PROMPT, BASE, request_id="base")
        engine.step()
        engine.add_request(PROMPT, GREEDY, "a", request_id="a")
        engine.add_request(PROMPT[::-1], GREEDY, "b", request_id="b")
        llm.done = run_until_done(engine)
    for rid in ("base", "a", "b"):
        assert fast.done[rid].token_ids == sync.done[rid].token_ids, rid
    assert fast.engine.adapters.num_promotions == sync.engine.adapters.num_promotions == 2
    fast.engine.check_integrity()


@pytest.mark.parametrize("damage", ["nan", "truncated"])
def test_broken_file_found_by_worker_fails_only_its_requests(root, tmp_path, damage):
    llm = _llm(root)
    engine = llm.engine
    shutil.copytree(root / "b", tmp_path / "bad")
    llm.register_adapter("bad", tmp_path / "bad")  # valid at registration
    llm.generate([PROMPT], GREEDY, ["a"])  # "a" resident in one slot, the other never filled
    weights = tmp_path / "bad" / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    if damage == "nan":
        raw[-4:] = b"\x00\x00\xc0\x7f"  # the last float32 becomes NaN; the header still holds
    else:
        raw = raw[:-64]
    weights.write_bytes(bytes(raw))
    before = _pool_hash(engine)
    events: list[LandingEvent] = []
    engine.lora.listeners.append(events.append)
    ok = engine.add_request(PROMPT, GREEDY, "a")
    base = engine.add_request(PROMPT, GREEDY)
    bad = [engine.add_request(PROMPT, GREEDY, "bad") for _ in range(3)]
    done = run_until_done(engine)
    for rid in bad:
        assert done[rid].finish_reason == "error", rid
    assert done[ok].finish_reason == "length" and done[base].finish_reason == "length"
    expected = "NaN" if damage == "nan" else "bad"
    assert expected in str(done[bad[0]].error) or damage == "truncated"
    assert _pool_hash(engine)[1] == before[1]  # identities untouched
    assert _pool_hash(engine)[0] == before[0]  # bytes and tables untouched
    assert [(e.name, e.slot) for e in events] == [("bad", None)] and events[0].error
    engine.check_integrity()


def test_abandoned_promotion_never_lands(root, monkeypatch):
    llm = _llm(root)
    engine = llm.engine
    release = threading.Event()
    original = StagingBuffers.read_file
    monkeypatch.setattr(StagingBuffers, "read_file",
                        lambda self, *a: (release.wait(10), original(self, *a))[1])
    before = _pool_hash(engine)
    rid = engine.add_request(PROMPT, GREEDY, "a")
    assert engine.adapters.advance(time.monotonic()) == []  # starts the worker, which is held
    assert engine.adapters.job is not None
    engine.abort(rid)
    release.set()
    step_until(engine, lambda: engine.adapters.job is None)
    assert _pool_hash(engine) == before  # staged, then dropped: no slot was touched
    assert engine.adapters.num_promotions == 0


@pytest.mark.gpu
def test_async_landings_on_cuda_serve_the_right_adapter(root):
    """On the GPU the landing runs on a side stream while other slots decode: a
    shuffled mix over more adapters than slots, with evictions, gives every request
    the first token and logprob the synchronous path gives it. Batches differ between
    the two runs (landings finish at other steps), so bf16 rounding may differ: compare
    the first token, whose logits a wrong or half-landed adapter would change grossly."""
    import random

    from tests.helpers.tiny_models import make_adapter as mk

    base = make_model("llama", seed=4)
    for i, name in enumerate(("c", "d")):
        if not (root / name).exists():
            mk(base, root / name, seed=40 + i, r=8, lora_alpha=16, target_modules="all-linear")
    names = ["a", "b", "c", "d", None] * 4
    random.Random(3).shuffle(names)
    prompts = [PROMPT[i % 7:] + PROMPT[:i % 7] for i in range(len(names))]
    outs = {}
    for mode in (True, False):
        llm = _llm(root, device="cuda", dtype="bfloat16", async_promotions=mode)
        for name in ("c", "d"):
            llm.register_adapter(name, root / name)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
        outs[mode] = llm.generate(prompts, params, names)
        assert llm.engine.adapters.num_promotions >= 4
        llm.engine.check_integrity()
    for fast, sync in zip(outs[True], outs[False]):
        assert fast.token_ids[0] == sync.token_ids[0]
        assert abs(fast.logprobs[0]["logprob"] - sync.logprobs[0]["logprob"]) < 0.05


@pytest.mark.gpu
def test_an_unread_file_refused_on_cuda_evicts_nothing(root, tmp_path):
    """On the GPU the promotion worker bounds a file registered verify_on_landing in the
    scratch pool (its stream, the recipe's landing kernel, the norms kernel): one whose
    lora_A takes its LoRA past bf16 is refused while both slots are full, no slot's bytes
    or identity move, and a request on a resident adapter beside it is served."""
    import torch
    from safetensors.torch import load_file, save_file

    from metrale.engine.registry import AdapterSource
    from metrale.errors import NonFiniteWeightsError

    llm = _llm(root, device="cuda", dtype="bfloat16")
    engine = llm.engine
    llm.generate([PROMPT, PROMPT], GREEDY, ["a", "b"])  # both slots hold an adapter
    shutil.copytree(root / "b", tmp_path / "huge")
    weights = tmp_path / "huge" / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[key] = torch.full_like(tensors[key], 1e38)
    save_file(tensors, weights)
    engine.register_adapter("huge", AdapterSource(path=tmp_path / "huge", verify_on_landing=True))
    pool = engine.lora.pool
    before = pool.buffer.cpu(), [(i.slot, i.version, i.uid, i.state) for i in engine.slot_info()]
    bad = engine.add_request(PROMPT, GREEDY, "huge")
    ok = engine.add_request(PROMPT, GREEDY, "a")
    done = run_until_done(engine)
    assert isinstance(done[bad].error, NonFiniteWeightsError), done[bad].error
    assert done[ok].finish_reason == "length"
    assert torch.equal(pool.buffer.cpu(), before[0])
    assert [(i.slot, i.version, i.uid, i.state) for i in engine.slot_info()] == before[1]
    engine.check_integrity()
