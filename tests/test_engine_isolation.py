"""One poisoned request never stops the engine: requests whose adapter comes from a lying,
silent or broken peer, or whose logits go bad, fail alone with a typed error while
concurrent good requests complete with the same tokens as transformers + PEFT, and the
pool's good adapters are byte-identical before and after."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from metrale import LLM, SamplingParams
from metrale.errors import MetraleError
from metrale.peer.wire import decode_doc
from tests.helpers.engine import run_until_done
from tests.helpers.peers import FakePeer, adapter_dir, disk_exporter, peer_root
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_model

LEASE = "fakelease0002"
PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 61, 2, 9, 13, 200]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _lease_reply():
    exporter = disk_exporter("a", transports=("http",))
    lease = exporter.lease("a")
    exporter.release(lease.lease_id)
    reply = decode_doc(lease.body)
    reply["lease"]["id"] = LEASE
    reply["manifest"]["transports"]["http"]["data_path"] = f"/peer/v1/leases/{LEASE}/data"
    return reply


def _poisoned(edit):
    reply = copy.deepcopy(_lease_reply())
    edit(reply["manifest"]["peft"])
    return FakePeer(reply)


POISONS = {
    "rank_pattern-a-list": lambda p: p.update(rank_pattern=[1]),
    "target_modules-bad-regex": lambda p: p.update(target_modules="("),
    "r-infinite": lambda p: p.update(r=float("inf")),
    "alpha-nan": lambda p: p.update(lora_alpha=float("nan")),
    "nested-deep": lambda p: p.update(alpha_pattern={"x": [[[[[[1]]]]]]}),
}


def test_poisoned_peers_fail_alone_among_good_requests():
    root = peer_root()[0]
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=128, peer_transport="http", peer_timeout_s=3.0)
    engine = llm.engine
    llm.register_adapter("good", adapter_dir("b"), pinned=True)  # never a victim
    good_slot = engine.registry.slot_of("good")
    assert engine.registry.get("good").pinned and engine.registry.pinned_slots() == {good_slot}
    good_bytes = engine.lora.pool.slot_region(good_slot).clone()
    good_uid = engine.lora.table.info(good_slot).uid
    peers = {name: _poisoned(edit) for name, edit in POISONS.items()}
    silent = FakePeer(_lease_reply(), mode="half-stall")  # sends half the bytes, then stalls
    try:
        for name, peer in [*peers.items(), ("silent", silent)]:
            engine.register_adapter(name, f"peer://{peer.url}/a")
        good = [engine.add_request(PROMPT, GREEDY, "good") for _ in range(3)]
        base = [engine.add_request(PROMPT[::-1], GREEDY) for _ in range(2)]
        bad = {engine.add_request(PROMPT, GREEDY, name): name for name in [*POISONS, "silent"]}
        done = run_until_done(engine)
    finally:
        for peer in [*peers.values(), silent]:
            peer.close()
    for rid, name in bad.items():
        assert done[rid].finish_reason == "error", name
        assert isinstance(done[rid].error, MetraleError), (name, done[rid].error)
    ref_good = hf_greedy(PeftModel.from_pretrained(make_model("llama", seed=7), adapter_dir("b")),
                         PROMPT, GREEDY.max_tokens)[0]
    ref_base = hf_greedy(make_model("llama", seed=7), PROMPT[::-1], GREEDY.max_tokens)[0]
    assert all(done[rid].token_ids == ref_good for rid in good)
    assert all(done[rid].token_ids == ref_base for rid in base)
    # the good adapter's slot is untouched by every refused landing
    assert engine.registry.slot_of("good") == good_slot
    assert engine.registry.pinned_slots() == {good_slot}
    assert engine.lora.table.info(good_slot).uid == good_uid
    assert torch.equal(engine.lora.pool.slot_region(good_slot), good_bytes)
    engine.check_integrity()
    # and the engine still serves
    assert llm.generate([PROMPT], GREEDY, ["good"])[0].token_ids == ref_good


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_absurd_sampling_values_are_served_or_refused_alone(temperature):
    root = peer_root()[0]
    llm = LLM(root / "model", max_loras=1, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=64)
    engine = llm.engine
    odd = engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=temperature,
                                                    ignore_eos=True))
    ok = engine.add_request(PROMPT, GREEDY)
    done = run_until_done(engine)
    assert done[ok].token_ids == hf_greedy(make_model("llama", seed=7), PROMPT, 6)[0]
    assert done[odd].finish_reason == "length"  # below 1e-5: greedy


def test_a_peer_off_the_allow_list_is_refused_at_registration():
    """It could never land: say so at registration, before anything is contacted."""
    from metrale.peer.errors import PeerNotAllowedError

    root = peer_root()[0]
    llm = LLM(root / "model", max_loras=1, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=32)
    with pytest.raises(PeerNotAllowedError):
        llm.register_adapter("far", "peer://10.9.9.9:7460/a")  # default allow-list: loopback
    assert llm.engine.registry.names() == []


def test_stale_nan_in_freed_kv_blocks_never_reaches_another_request(tmp_path):
    """A poisoned request can leave NaN K/V in blocks it frees. A later batch of requests
    of different lengths decodes over padded, masked keys; the stale NaN there (here:
    the whole cache filled with NaN before they run) must not reach their outputs."""

    from metrale import LLM, SamplingParams
    from tests.helpers.reference import hf_greedy
    from tests.helpers.tiny_models import make_model, save_model

    base = make_model("llama", seed=5)
    save_model(base, tmp_path / "model")
    llm = LLM(tmp_path / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=64)
    for attn in llm.engine.runner.model.attention_layers():
        attn.k_cache.fill_(float("nan"))
        attn.v_cache.fill_(float("nan"))
    prompts = [[5, 17, 99], [61, 2, 9, 13, 200, 7, 1, 4, 77], [8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        assert list(out.token_ids) == hf_greedy(base, prompt, 6)[0]
