"""DoRA and embed_tokens / lm_head adapters through every way bytes reach a slot other
than a disk landing: a `metrale peer serve` store over HTTP (manifest v2 carries the
magnitudes and the model-level modules) and the host tier (a slot image, whose DoRA
gains are recomputed on landing). Ground truth: transformers + PEFT."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import ExtraTargetsRequiredError
from tests.helpers.peers import start_store, stop
from tests.helpers.reference import check, hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
EXTRA = ("embed_tokens", "lm_head")
ADAPTERS = {
    "dora": dict(r=4, lora_alpha=6, use_rslora=True, use_dora=True,
                 target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 6}),
    "embdora": dict(r=4, lora_alpha=4, use_dora=True,
                    target_modules=["embed_tokens", "lm_head", "gate_proj"]),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dora-peer")
    base = make_model("llama", seed=5)
    save_model(base, root / "model")
    peft = {name: make_adapter(base, root / "adapters" / name, seed=40 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    return root, base, peft


@pytest.fixture(scope="module")
def store(root):
    proc, url = start_store(adapters=root[0] / "adapters", model=root[0] / "model")
    yield url.removeprefix("http://")
    stop(proc)


def _llm(root, **kw):
    args = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64, num_kv_blocks=64,
                max_num_seqs=8)
    return LLM(root / "model", **{**args, **kw})


def _check(llm, base, peft, names, seed):
    ps = prompts(seed, len(names))
    for p, out, name in zip(ps, llm.generate(ps, GREEDY, names), names):
        check(out, *hf_greedy(base if name is None else peft[name], p, n=GREEDY.max_tokens))


def test_peer_http_landing_serves_dora_and_embedding_exactly(root, store):
    path, base, peft = root
    llm = _llm(path, peer_transport="http", lora_extra_targets=EXTRA)
    for name in ADAPTERS:
        llm.register_adapter(name, f"peer://{store}/{name}")
    _check(llm, base, peft, ["dora", "embdora", None, "plain", "embdora", "dora"], 1)
    assert llm.engine.adapters.num_promotions >= 3  # 3 adapters, 2 slots


def test_peer_adapter_needing_extra_targets_is_refused_naming_the_flag(root, store):
    llm = _llm(root[0], peer_transport="http")
    with pytest.raises(ExtraTargetsRequiredError, match="--lora-extra-targets"):
        llm.engine.promote_lora_slot_from_peer(store, "embdora", "x")
    assert all(i.state.value == "EMPTY" for i in llm.engine.slot_info())  # nothing touched


def test_host_tier_relanding_recomputes_dora_gains(root):
    """One slot, a host tier: dora -> plain -> dora lands the second dora from the tier."""
    path, base, peft = root
    llm = _llm(path, max_loras=1, host_tier_bytes=64 << 20, lora_extra_targets=EXTRA)
    for name in ADAPTERS:
        llm.register_adapter(name, path / "adapters" / name)
    for i, name in enumerate(["dora", "plain", "dora", "embdora", "plain", "embdora"]):
        _check(llm, base, peft, [name, None], 10 + i)
    assert llm.engine.lora.host_tier.hits >= 2


def test_engine_refuses_extra_targets_with_http_4xx():
    """The refusal maps to a client error (422), never a 500."""
    pytest.importorskip("fastapi")
    from metrale.server.errors import classify

    assert classify(ExtraTargetsRequiredError("x"))[0] == 422


def test_engine_slot_exported_without_its_config_lands_identically(root):
    """An engine's READY DoRA + embed/lm_head slot, exported with a config rebuilt from its
    tables (peft_from_tables: ranks, scales, use_dora), lands in another pool with the same
    bytes, tables and gains as a disk landing of the same files."""
    import torch

    from metrale.config import ModelConfig, PoolConfig
    from metrale.peer.exporter import AdapterExporter
    from metrale.peer.http_server import PeerHTTPServer
    from metrale.peer.store import StoreNames
    from metrale.pool.layout import SlotLayout
    from metrale.pool.swap import LoraSlots
    from tests.helpers.pool import land_disk, land_peer

    path = root[0]
    model = ModelConfig.from_dir(path / "model")
    pool_cfg = PoolConfig(2, 8, extra_targets=EXTRA)
    g = torch.Generator().manual_seed(3)
    layout = SlotLayout(model, pool_cfg, torch.float32)
    weights = {k: torch.randn(*reversed(model.linear_shape(k[1])), generator=g)
               for k in layout.module_keys}

    def slots():
        return LoraSlots(model, pool_cfg, "cpu", torch.float32, weights)

    source, disk, target = slots(), slots(), slots()
    land_disk(source, path / "adapters" / "embdora", 1)
    land_disk(disk, path / "adapters" / "embdora", 0)
    names = StoreNames()
    names.add("x", 1)
    server = PeerHTTPServer(AdapterExporter(source, names)).start()  # no peft_for: from the tables
    try:
        land_peer(target, server.url, "x", 0, transport="http", timeout_s=10)
    finally:
        server.close()
    a, b = target.pool, disk.pool
    assert torch.equal(a.slot_region(0), b.slot_region(0))
    for name in ("ranks", "scales", "doras", "gains"):
        assert torch.equal(getattr(a, name)[0], getattr(b, name)[0]), name
    assert bool(a.doras[0].any()) and not torch.equal(a.gains[0], torch.ones_like(a.gains[0]))
