"""An engine serves adapters registered with a peer source: requests promote
them from a `metrale peer serve` store automatically, and the tokens equal
the same adapters loaded from disk and transformers+PEFT."""

from __future__ import annotations

import pytest
from peft import PeftModel

from metrale import LLM, SamplingParams
from metrale.peer.errors import PeerNotAllowedError
from tests.helpers.engine import run_until_done
from tests.helpers.peers import adapter_dir, peer_root, start_store, stop
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def store():
    proc, url = start_store()
    yield url.removeprefix("http://")
    stop(proc)


def _llm(**kw):
    return LLM(peer_root()[0] / "model", max_loras=2, max_lora_rank=8, block_size=4,
               max_model_len=64, num_kv_blocks=64, **kw)


@pytest.mark.parametrize("transport", ["http", "nixl"])
def test_requests_promote_peer_adapters_automatically(store, transport):
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL not installed")
    llm = _llm(peer_transport=transport)
    for name in "abc":
        llm.register_adapter(f"p{name}", f"peer://{store}/{name}")
    outs = llm.generate([PROMPT] * 3, GREEDY, ["pa", "pb", "pc"])  # 3 adapters, 2 slots
    disk = _llm()
    for name in "abc":
        disk.register_adapter(name, adapter_dir(name))
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in disk.generate([PROMPT] * 3, GREEDY, list("abc"))]
    peft = PeftModel.from_pretrained(make_model("llama", seed=7), adapter_dir("b"))
    assert outs[1].token_ids == hf_greedy(peft, PROMPT, 8)[0]
    assert llm.engine.adapters.num_promotions == 3


def test_seed_peer_operations(store):
    llm = _llm(peer_transport="http")
    engine = llm.engine
    slot, evicted = engine.promote_lora_slot_from_peer(store, "a", "x")
    assert (slot, evicted) == (0, None)
    engine.swap_lora_slot_from_peer(store, "b", "x", slot)  # same name, new contents
    assert engine.registry.slot_of("x") == slot
    assert engine.lora.table.holds(slot, engine.registry.current("x").version)
    engine.check_integrity()
    assert str(engine.registry.current("x").source.peer) == f"peer://{store}/b"
    out = llm.generate(PROMPT, GREEDY, "x")[0]
    disk = _llm()
    disk.register_adapter("b", adapter_dir("b"))
    assert out.token_ids == disk.generate(PROMPT, GREEDY, "b")[0].token_ids


def test_peer_outside_allow_list_is_refused_at_registration(store):
    llm = _llm(peer_transport="http", peer_allow=("10.0.0.0/8",))
    with pytest.raises(PeerNotAllowedError):  # it could never land: refused before any contact
        llm.register_adapter("pa", f"peer://{store}/a")
    engine = llm.engine
    assert engine.registry.names() == []
    ok = engine.add_request(PROMPT, GREEDY, None)
    done = run_until_done(engine)
    assert done[ok].finish_reason == "length"
    assert all(i.state.value == "EMPTY" and i.uid == 0 for i in engine.slot_info())


def test_the_first_adapter_from_a_peer_warms_its_path(store, monkeypatch, caplog):
    """An engine that warms peers (a GPU engine; this CPU one is told to) plans the
    peer's first adapter when it is registered, so its first landing reuses that plan; a
    second adapter from the same peer warms nothing more; a warm-up that fails is logged
    and the registration stands. Answers equal the disk adapters'."""
    from metrale.engine import llm_engine
    from metrale.peer.errors import PeerManifestError
    from metrale.peer.plans import plan_cache_for

    warmed, real = [], llm_engine.warm_up_peer
    monkeypatch.setattr(llm_engine, "warms_peers", lambda pool: True)
    monkeypatch.setattr(llm_engine, "warm_up_peer",
                        lambda slots, addr, adapter_id, **kw: warmed.append(adapter_id)
                        or real(slots, addr, adapter_id, **kw))
    llm = _llm()
    cache = plan_cache_for(llm.engine.lora.pool)
    llm.register_adapter("pa", f"peer://{store}/a")
    llm.register_adapter("pb", f"peer://{store}/b")
    assert warmed == ["a"] and (cache.hits, cache.misses) == (0, 1)
    outs = llm.generate([PROMPT] * 2, GREEDY, ["pa", "pb"])
    assert cache.hits == 1 and cache.misses == 2  # a: the warmed plan; b: planned at landing
    disk = _llm()
    for name in "ab":
        disk.register_adapter(name, adapter_dir(name))
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in disk.generate([PROMPT] * 2, GREEDY, list("ab"))]

    def failing(*args, **kw):
        raise PeerManifestError("the peer lies")

    monkeypatch.setattr(llm_engine, "warm_up_peer", failing)
    other = _llm()
    with caplog.at_level("INFO", logger="metrale.engine"):
        other.register_adapter("pc", f"peer://{store}/c")
    assert "not warmed up" in caplog.text and "the peer lies" in caplog.text
    disk.register_adapter("c", adapter_dir("c"))
    assert other.generate([PROMPT], GREEDY, "pc")[0].token_ids == disk.generate(
        [PROMPT], GREEDY, "c")[0].token_ids
