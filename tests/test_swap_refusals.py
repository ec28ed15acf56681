"""Every refusal of the engine's swap and promote leaves the pool bytes, every slot's
identity and the registry (names, versions, routes) as they were, also a refusal of weights
no registration read (bounded in a scratch pool before any slot is chosen); a failure after
zeroing leaves the slot EMPTY with a fresh identity."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from metrale import SamplingParams, errors
from metrale.engine.registry import AdapterSource
from metrale.pool import landing
from metrale.pool.slots import SlotState
from tests.helpers.engine import run_until_done, tiny_engine
from tests.helpers.pool import snapshot
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_model


@pytest.fixture
def filled(adapters, tiny_model_dir):
    """An engine whose slots 0 and 1 hold adapters a and b; slot 2 is a never-filled
    placeholder."""
    engine = tiny_engine(tiny_model_dir)
    engine.swap_lora_slot_from_disk(adapters / "a", "a", 0)
    engine.swap_lora_slot_from_disk(adapters / "b", "b", 1)
    return engine


def state(engine) -> tuple:
    """The pool (bytes, slot identities) and the registry (versions, routes, pins)."""
    registry = engine.registry
    return (snapshot(engine.lora), registry.routes(),
            [registry.get(n) for n in registry.names()], registry.pinned_slots())


def _copy(adapters, tmp_path, name="a"):
    dst = tmp_path / "bad"
    shutil.copytree(adapters / name, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(path / "adapter_model.safetensors")
    fn(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


def _first_key(tensors, kind="lora_A"):
    return sorted(k for k in tensors if kind in k)[0]


def _set_nan(t):
    k = _first_key(t, "lora_B")
    t[k] = t[k].clone()
    t[k][0, 0] = float("nan")


def _lie_about_size(path):
    f = path / "adapter_model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = sorted(k for k in header if k != "__metadata__")[0]
    header[key]["shape"][0] += 1  # claims more elements than its byte range holds
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    f.write_bytes(raw[:8] + new + raw[8 + n:])


def _add_magnitudes(tensors, bad_shape=False, value=1.0):
    """A DoRA magnitude for every module with a lora_B ([out]); the first one corrupted."""
    for i, k in enumerate(sorted(k for k in list(tensors) if k.endswith("lora_B.weight"))):
        out = tensors[k].shape[0]
        m = torch.full((out + (1 if bad_shape and i == 0 else 0),), 1.0)
        if i == 0 and value != 1.0:
            m[3] = value
        tensors[k.replace("lora_B.weight", "lora_magnitude_vector")] = m


# Each case turns a good adapter dir into a bad one; the error class is asserted.
BAD_ADAPTERS = {
    "rank-over-max": (lambda p: _edit_tensors(p, lambda t: None) or _edit_config(
        p, rank_pattern={"q_proj": 9}), errors.AdapterMismatchError),
    "unknown-target": (lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]),
                       errors.AdapterMismatchError),
    # served, but only by an engine started with pool memory for them (this one was not)
    "embedding-lora": (lambda p: _edit_config(p, target_modules=["q_proj", "embed_tokens"]),
                       errors.ExtraTargetsRequiredError),
    "lm-head-lora": (lambda p: _edit_config(p, target_modules=["lm_head"]),
                     errors.ExtraTargetsRequiredError),
    # DoRA without its magnitudes: PEFT could not load it either
    "dora-missing-magnitude": (lambda p: _edit_config(p, use_dora=True), errors.AdapterFileError),
    "dora-magnitude-shape": (lambda p: (_edit_config(p, use_dora=True), _edit_tensors(
        p, lambda t: _add_magnitudes(t, bad_shape=True))), errors.AdapterMismatchError),
    "dora-magnitude-nan": (lambda p: (_edit_config(p, use_dora=True), _edit_tensors(
        p, lambda t: _add_magnitudes(t, value=float("nan")))), errors.NonFiniteWeightsError),
    "dora-magnitude-inf": (lambda p: (_edit_config(p, use_dora=True), _edit_tensors(
        p, lambda t: _add_magnitudes(t, value=float("inf")))), errors.NonFiniteWeightsError),
    "dora-not-bool": (lambda p: _edit_config(p, use_dora="yes"), errors.AdapterConfigError),
    # new tokens: PEFT's copy of a resized embedding (vocab 256 -> 260)
    "new-tokens": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        "base_model.model.model.embed_tokens.base_layer.weight", torch.randn(260, 64))),
        errors.UnsupportedAdapterError),
    "trainable-token-indices": (lambda p: _edit_config(p, trainable_token_indices=[3, 4]),
                                errors.UnsupportedAdapterError),
    "bias": (lambda p: _edit_config(p, bias="all"), errors.UnsupportedAdapterError),
    "modules-to-save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]),
                        errors.UnsupportedAdapterError),
    # expert LoRA on a dense base: its target does not exist here
    "moe-target-parameters": (lambda p: _edit_config(p, target_parameters=["experts.gate_up"]),
                              errors.AdapterMismatchError),
    "not-lora": (lambda p: _edit_config(p, peft_type="IA3"), errors.UnsupportedAdapterError),
    "config-missing": (lambda p: (p / "adapter_config.json").unlink(), errors.AdapterConfigError),
    "config-garbage": (lambda p: (p / "adapter_config.json").write_text("{nope"),
                       errors.AdapterConfigError),
    "pickled-bin": (lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
                    errors.AdapterFileError),
    "truncated": (lambda p: (p / "adapter_model.safetensors").write_bytes(
        (p / "adapter_model.safetensors").read_bytes()[:-100]), errors.AdapterFileError),
    "not-safetensors": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"PK\x03\x04" * 64),
                        errors.AdapterFileError),
    "header-lies": (_lie_about_size, errors.AdapterFileError),
    "nan": (lambda p: _edit_tensors(p, _set_nan), errors.NonFiniteWeightsError),
    "inf": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        _first_key(t), torch.full_like(t[_first_key(t)], float("inf")))),
        errors.NonFiniteWeightsError),
    "int-dtype": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        _first_key(t), t[_first_key(t)].to(torch.int32))), errors.AdapterMismatchError),
    "wrong-shape": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        _first_key(t), torch.randn(4, 32))), errors.AdapterMismatchError),
    "missing-tensor": (lambda p: _edit_tensors(p, lambda t: t.pop(_first_key(t, "lora_B"))),
                       errors.AdapterFileError),
    "extra-tensor": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", torch.randn(4, 64))),
        errors.AdapterMismatchError),
    # a magnitude in an adapter whose config does not say use_dora
    "dora-magnitude-tensor": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64))),
        errors.AdapterMismatchError),
}


# Faults only the values in the pool's dtype show (found in the scratch pool, before any
# slot is touched, when no registration read the weights)
SLOT_FAULTS = {
    # finite, but its LoRA input projection could overflow the pool's float32
    "gain-overflow": (lambda p: _edit_tensors(p, lambda t: t.__setitem__(
        _first_key(t), torch.full_like(t[_first_key(t)], 1e38))), errors.NonFiniteWeightsError),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS | SLOT_FAULTS))
@pytest.mark.parametrize("op", ["swap", "promote"])
def test_bad_adapter_refused_untouched(case, op, filled, adapters, tmp_path):
    corrupt, error = (BAD_ADAPTERS | SLOT_FAULTS)[case]
    bad = _copy(adapters, tmp_path)
    corrupt(bad)
    before = state(filled)
    with pytest.raises(error) as info:
        if op == "swap":
            filled.swap_lora_slot_from_disk(bad, "a", 0)  # idle slot holding "a"
        else:
            filled.promote_lora_slot_from_disk(bad, "x")
    assert isinstance(info.value, errors.MetraleError)
    assert str(info.value)
    assert state(filled) == before
    filled.check_integrity()


def test_state_refusals_untouched(filled, adapters):
    before = state(filled)
    filled.lora.table.acquire(0)  # a sequence decodes on "a"
    busy = state(filled)
    cases = [
        (lambda: filled.swap_lora_slot_from_disk(adapters / "c", "c", 3), errors.SlotOutOfRangeError),
        (lambda: filled.swap_lora_slot_from_disk(adapters / "c", "c", -1),
         errors.SlotOutOfRangeError),
        (lambda: filled.swap_lora_slot_from_disk(adapters / "c", "c", 0), errors.SlotBusyError),
        (lambda: filled.swap_lora_slot_from_disk(adapters / "c", "../c", 2), errors.InvalidNameError),
        (lambda: filled.swap_lora_slot_from_disk(adapters / "nope", "c", 2),
         errors.AdapterConfigError),
    ]
    for call, error in cases:
        with pytest.raises(error):
            call()
        assert state(filled) == busy
    filled.lora.table.release(0)
    assert state(filled)[0][0] == before[0][0] and state(filled)[1:] == before[1:]


def test_swap_message_names_the_rule(filled, adapters):
    filled.lora.table.acquire(0)
    with pytest.raises(errors.SlotBusyError, match="cannot replace an adapter mid-decode"):
        filled.swap_lora_slot_from_disk(adapters / "c", "c", 0)


def test_pool_full_refused_untouched(filled, adapters):
    filled.register_adapter("p", adapters / "c", pinned=True)  # lands in slot 2, pinned
    assert filled.registry.slot_of("p") == 2 and filled.registry.pinned_slots() == {2}
    filled.lora.table.acquire(0)
    filled.lora.table.acquire(1)
    before = state(filled)
    with pytest.raises(errors.PoolFullError, match=r"^POOL_FULL: all 2 cache slot\(s\) are busy"):
        filled.promote_lora_slot_from_disk(adapters / "c", "c")
    assert state(filled) == before


def test_no_pool_and_disabled_swaps(adapters, tiny_model_dir):
    no_pool = tiny_engine(tiny_model_dir, max_loras=0)
    with pytest.raises(errors.NoAdapterPoolError):
        no_pool.swap_lora_slot_from_disk(adapters / "a", "a", 0)
    with pytest.raises(errors.NoAdapterPoolError):
        no_pool.promote_lora_slot_from_disk(adapters / "a", "a")
    assert no_pool.registry.names() == []
    frozen = tiny_engine(tiny_model_dir, allow_runtime_swaps=False)
    before = state(frozen)
    for call in (lambda: frozen.swap_lora_slot_from_disk(adapters / "a", "a", 0),
                 lambda: frozen.promote_lora_slot_from_disk(adapters / "a", "a")):
        with pytest.raises(errors.RuntimeSwapsDisabledError):
            call()
    assert state(frozen) == before


def test_failure_mid_landing_leaves_slot_empty(filled, adapters, monkeypatch):
    table, pool = filled.lora.table, filled.lora.pool
    old = table.info(0)
    other = pool.slot_region(1).clone()
    real_land = landing.land_tensors
    died = []

    def land_half_then_die(t, layout, plan, views):
        if not any(t is s for s in pool.slot_tensors):  # the scratch pool that bounds c first
            return real_land(t, layout, plan, views)
        half = len(plan.landings) // 2
        real_land(t, layout, plan.__class__(**{**plan.__dict__, "landings": plan.landings[:half]}),
                  views[:half])
        assert t.data.any()  # half of c's bytes are in the slot now
        died.append(t.index)
        raise OSError("disk vanished mid-read")

    monkeypatch.setattr(landing, "land_tensors", land_half_then_die)
    with pytest.raises(errors.LandingError, match="disk vanished mid-read.*now EMPTY"):
        filled.swap_lora_slot_from_disk(adapters / "c", "c", 0)
    assert died == [0]
    info = table.info(0)
    assert info.state is SlotState.EMPTY and info.version is None
    assert info.uid != old.uid and info.generation == old.generation + 1
    # "a" lost its slot (its version stays registered); "c" was never installed
    assert filled.registry.slot_of("a") is None and filled.registry.get("c") is None
    assert filled.registry.routes() == {"b": 1}
    assert not pool.slot_region(0).any() and not pool.ranks[0].any()
    assert torch.equal(pool.slot_region(1), other)
    filled.check_integrity()
    monkeypatch.undo()
    # the slot is usable again afterwards
    filled.swap_lora_slot_from_disk(adapters / "c", "c", 0)
    assert table.holds(0, filled.registry.current("c").version)
    assert filled.registry.slot_of("c") == 0


PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 61, 2, 9, 13, 200]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_a(adapters):
    """transformers + PEFT's greedy tokens for adapter a."""
    return hf_greedy(PeftModel.from_pretrained(make_model("llama"), adapters / "a"), PROMPT,
                     GREEDY.max_tokens)[0]


def _counting_reads(engine) -> list[str]:
    reads: list[str] = []
    prepare = engine.lora.prepare_disk
    engine.lora.prepare_disk = lambda path, name, *a, **k: reads.append(name) or prepare(
        path, name, *a, **k)
    return reads


# the faults in the weights' values: a registration that reads no weights lets them pass
READ_AT_LANDING = {"nan", "inf", "dora-magnitude-nan", "dora-magnitude-inf", *SLOT_FAULTS}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS | SLOT_FAULTS))
def test_bad_source_file_refused_for_its_requests_alone(case, filled, adapters, tmp_path,
                                                        reference_a):
    """A directory registered verify_on_landing (a name resolved from --adapter-source) has
    only its config and header read then; its weights are checked when it lands. Every bad
    file is still refused with its error class: at registration, or for its own requests
    while a request on adapter a runs beside them with PEFT's tokens. With every slot full,
    its landing would evict an idle one: the refusal comes first, so every slot's bytes,
    identity and route stay; later requests fail at once, without another read."""
    corrupt, error = (BAD_ADAPTERS | SLOT_FAULTS)[case]
    bad = _copy(adapters, tmp_path)
    corrupt(bad)
    pool, table, registry = filled.lora.pool, filled.lora.table, filled.registry
    filled.swap_lora_slot_from_disk(adapters / "c", "c", 2)  # no free slot left
    kept = [(pool.slot_region(s).clone(), table.info(s).uid) for s in (0, 1, 2)]
    routes = registry.routes()
    try:
        filled.register_adapter("x", AdapterSource(path=bad, verify_on_landing=True))
    except error:
        assert case not in READ_AT_LANDING
        assert state(filled)[1:] == (routes, [registry.get(n) for n in "abc"], set())
        return
    assert case in READ_AT_LANDING  # registration read the config and header only
    reads = _counting_reads(filled)
    good = filled.add_request(PROMPT, GREEDY, "a")
    first = filled.add_request(PROMPT, GREEDY, "x")
    done = run_until_done(filled)
    assert done[first].finish_reason == "error" and isinstance(done[first].error, error), \
        done[first].error
    assert done[good].token_ids == reference_a
    with pytest.raises(error):
        filled.add_request(PROMPT, GREEDY, "x")
    assert reads == ["x"]
    assert registry.routes() == routes
    for s, (data, uid) in zip((0, 1, 2), kept):
        assert torch.equal(pool.slot_region(s), data) and table.info(s).uid == uid
    filled.check_integrity()


def test_refused_source_file_is_read_again_once_fixed(filled, adapters, tmp_path, reference_a,
                                                      monkeypatch):
    """The refusal lasts REFUSAL_S (0 here): the file, fixed meanwhile, is read again and served."""
    from metrale.engine import adapters as adapter_manager

    monkeypatch.setattr(adapter_manager, "REFUSAL_S", 0.0)
    bad = _copy(adapters, tmp_path)
    _edit_tensors(bad, _set_nan)
    filled.register_adapter("x", AdapterSource(path=bad, verify_on_landing=True))
    first = filled.add_request(PROMPT, GREEDY, "x")
    assert isinstance(run_until_done(filled)[first].error, errors.NonFiniteWeightsError)
    shutil.copy(adapters / "a" / "adapter_model.safetensors", bad / "adapter_model.safetensors")
    again = filled.add_request(PROMPT, GREEDY, "x")
    assert run_until_done(filled)[again].token_ids == reference_a
    filled.check_integrity()


def test_a_file_is_bounded_at_its_first_landing_only(filled, adapters, tmp_path):
    """Direct landings bound a file's weights once per exact bytes: a re-landing of a file
    that landed reads no norms; a copy (new identity) is bounded again."""
    bounded, bound = [], filled.lora.bound_in_scratch
    filled.lora.bound_in_scratch = lambda plan, *a: bounded.append(plan.name) or bound(plan, *a)
    filled.swap_lora_slot_from_disk(adapters / "c", "c", 2)
    filled.swap_lora_slot_from_disk(adapters / "c", "c2", 2)
    assert bounded == ["c"]
    filled.swap_lora_slot_from_disk(_copy(adapters, tmp_path, "c"), "c3", 2)
    assert bounded == ["c", "c3"]
    filled.check_integrity()
