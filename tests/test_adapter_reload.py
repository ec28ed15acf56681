"""Same-name reloads never serve old weights: requests admitted after a reload get the new
version's tokens (compared with transformers + PEFT on the new files), requests already
running finish on the old version, and no old KV is reused. The three ways main served old
weights before the registry: a reload of a resident name through the Python API, a
promotion in flight while the files are rewritten in place, and a rewrite that keeps the
files' size and mtime."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch
from peft import PeftModel

from metrale import LLM, SamplingParams
from metrale.errors import AdapterExistsError, AllSlotsPinnedError, InvalidNameError, SlotPinnedError
from metrale.pool.staging import StagingBuffers
from tests.helpers.engine import run_until_done, step_until, step_until_running
from tests.helpers.reference import hf_greedy
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77, 61, 2, 9, 13, 200]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("reload")
    base = make_model("llama", seed=4)
    save_model(base, root / "model")
    make_adapter(base, root / "old", seed=50, r=4, lora_alpha=8, target_modules="all-linear")
    make_adapter(base, root / "new", seed=51, r=4, lora_alpha=8, target_modules="all-linear")
    return root


def reference(adapter_dir) -> list[int]:
    model = PeftModel.from_pretrained(make_model("llama", seed=4), adapter_dir)
    return hf_greedy(model, PROMPT, GREEDY.max_tokens)[0]


@pytest.fixture(scope="module")
def refs(root):
    return {"old": reference(root / "old"), "new": reference(root / "new")}


def _llm(root):
    return LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
               num_kv_blocks=128)


def _copy_adapter(src, dst) -> None:
    dst.mkdir(exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(src / f, dst / f)


def test_reload_of_a_resident_name_serves_the_new_version(root, refs, tmp_path):
    llm = _llm(root)
    engine = llm.engine
    llm.register_adapter("x", root / "old")
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["old"]
    with pytest.raises(AdapterExistsError):  # never half a reload: refused outright
        llm.register_adapter("x", root / "new")
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["old"]
    running = engine.add_request(PROMPT, GREEDY, "x")
    step_until_running(engine, running)
    llm.register_adapter("x", root / "new", reload=True)
    after = engine.add_request(PROMPT, GREEDY, "x")
    done = run_until_done(engine)
    assert done[running].token_ids == refs["old"]  # in flight: finishes on its version
    assert done[after].token_ids == refs["new"]
    assert done[after].num_cached_tokens == 0  # no prefix hit on the old version's KV
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["new"]
    engine.check_integrity()


def test_reload_in_place_while_a_promotion_is_in_flight(root, refs, tmp_path, monkeypatch):
    """The worker has read the old bytes when the files are rewritten in place and a
    reload of the same path arrives: the staged old bytes must never serve."""
    adapter = tmp_path / "x"
    _copy_adapter(root / "old", adapter)
    llm = _llm(root)
    engine = llm.engine
    llm.register_adapter("x", adapter)
    read_done, release = threading.Event(), threading.Event()
    original = StagingBuffers.read_file

    def read_then_hold(self, *args):
        data = original(self, *args)
        read_done.set()
        release.wait(30)
        return data

    monkeypatch.setattr(StagingBuffers, "read_file", read_then_hold)
    before = engine.add_request(PROMPT, GREEDY, "x")
    step_until(engine, read_done.is_set)  # the worker holds the old bytes
    _copy_adapter(root / "new", adapter)
    llm.register_adapter("x", adapter, reload=True)
    after = engine.add_request(PROMPT, GREEDY, "x")
    release.set()
    done = run_until_done(engine)
    assert done[after].token_ids == refs["new"]
    # `before` was still waiting for its slot at the reload: it binds the current version
    assert done[before].token_ids == refs["new"]
    # one landing in all: the superseded read took no slot (refused before WRITING)
    assert sum(info.generation for info in engine.slot_info()) == 1
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["new"]
    engine.check_integrity()


def test_reload_while_a_promotion_writes_its_slot(root, refs, monkeypatch):
    """The reload arrives while the worker writes the old version's bytes into the slot
    (WRITING, after the read's check): that landing must not commit, its version is no
    longer current; the request that waited for it and a later one get the new version."""
    from metrale.engine.promotion import Promoter

    llm = _llm(root)
    engine = llm.engine
    llm.register_adapter("x", root / "old")
    writing, release = threading.Event(), threading.Event()
    original = Promoter._write

    def hold_then_write(self, *args):
        writing.set()
        release.wait(30)
        return original(self, *args)

    monkeypatch.setattr(Promoter, "_write", hold_then_write)
    before = engine.add_request(PROMPT, GREEDY, "x")
    step_until(engine, writing.is_set)  # the slot is LOADING for the old version
    llm.register_adapter("x", root / "new", reload=True)
    after = engine.add_request(PROMPT, GREEDY, "x")
    release.set()
    done = run_until_done(engine)
    assert done[before].token_ids == refs["new"]
    assert done[after].token_ids == refs["new"]
    engine.check_integrity()


def test_rewrite_that_keeps_size_and_mtime_lands_the_new_contents(root, tmp_path):
    """`cp -p`, tar and `rsync -t` keep size and mtime: the plan cache and the host tier
    must still see new contents (here a new lora_alpha of the same width)."""
    adapter = tmp_path / "x"
    _copy_adapter(root / "old", adapter)
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 8
    config_path.write_text(json.dumps(config))
    expected_old = reference(adapter)
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=128, host_tier_bytes=1 << 24)
    llm.register_adapter("x", adapter)
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == expected_old
    stat = config_path.stat()
    config["lora_alpha"] = 3  # same width: the file keeps its size
    config_path.write_text(json.dumps(config))
    os.utime(config_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert config_path.stat().st_size == stat.st_size
    assert config_path.stat().st_mtime_ns == stat.st_mtime_ns
    expected_new = reference(adapter)
    assert expected_new != expected_old
    llm.register_adapter("x", adapter, reload=True)
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == expected_new


def test_landing_a_pinned_name_elsewhere_moves_the_pin(root, refs):
    """The slot the name left is unnamed: it loses its pin (nobody could unpin it) and is
    cache space again, never an orphan."""
    llm = _llm(root)
    engine, table = llm.engine, llm.engine.lora.table
    registry = engine.registry
    llm.register_adapter("x", root / "old", pinned=True)
    old = registry.slot_of("x")
    engine.swap_lora_slot_from_disk(root / "new", "x", 1 - old)
    assert registry.slot_of("x") == 1 - old and registry.pinned_slots() == {1 - old}
    assert registry.name_in(old) is None
    assert table.select_victim(registry.pinned_slots(), registry.routed_slots()) == old
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["new"]
    engine.check_integrity()


@pytest.mark.parametrize("name", ["base", "BASE", "model"])
def test_names_of_the_base_model_are_reserved(root, name):
    llm = _llm(root)
    with pytest.raises(InvalidNameError, match="reserved"):
        llm.register_adapter(name, root / "old")
    assert llm.engine.registry.names() == []


def test_every_slot_pinned_fails_at_once_naming_the_pins(root):
    llm = LLM(root / "model", max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=128, promotion_timeout_s=3600)
    engine = llm.engine
    llm.register_adapter("x", root / "old", pinned=True)
    llm.register_adapter("y", root / "new", pinned=True)
    llm.register_adapter("z", root / "old")
    rid = engine.add_request(PROMPT, GREEDY, "z")
    done = run_until_done(engine)  # no hour-long wait: it can never land
    assert isinstance(done[rid].error, AllSlotsPinnedError)
    assert "all 2 slot(s) are pinned" in str(done[rid].error)
    engine.check_integrity()


def test_a_pinned_slot_is_never_swapped_over(root, refs):
    llm = _llm(root)
    engine, table = llm.engine, llm.engine.lora.table
    llm.register_adapter("x", root / "old", pinned=True)
    slot = engine.registry.slot_of("x")
    before = (engine.lora.pool.slot_region(slot).clone(), table.info(slot))
    with pytest.raises(SlotPinnedError, match="unpin it first"):
        engine.swap_lora_slot_from_disk(root / "new", "y", slot)
    assert torch.equal(engine.lora.pool.slot_region(slot), before[0])
    assert table.info(slot) == before[1] and engine.registry.get("y") is None
    engine.pin_adapter("x", False)
    engine.swap_lora_slot_from_disk(root / "new", "y", slot)
    assert engine.registry.name_in(slot) == "y" and not engine.registry.pinned_slots()  # the pin did not move
    assert llm.generate([PROMPT], GREEDY, ["y"])[0].token_ids == refs["new"]
    engine.check_integrity()


def _one_slot(root, **kw):
    return LLM(root / "model", max_loras=1, max_lora_rank=8, block_size=4, max_model_len=128,
               num_kv_blocks=128, **kw)


def test_a_pinned_reload_lands_into_its_own_idle_slot(root, refs):
    """max_loras=1, the only slot pinned and idle: the reload replaces it at once (it was
    refused POOL_FULL before), the pin holds the new version, and a refused reload of
    another kind still changes nothing."""
    llm = _one_slot(root)
    engine = llm.engine
    llm.register_adapter("x", root / "old", pinned=True)
    old_uid = engine.lora.table.info(0).uid
    version = engine.register_adapter("x", root / "new", reload=True)
    assert version.pinned and engine.registry.slot_of("x") == 0
    assert engine.registry.pinned_slots() == {0}
    assert engine.lora.table.info(0).version == version.version
    assert engine.lora.table.info(0).uid != old_uid
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["new"]
    engine.check_integrity()


def test_a_pinned_reload_of_a_busy_slot_lands_when_it_drains(root, refs):
    """The pinned slot serves a request: the old version finishes there, requests admitted
    after the reload get the new version in the same slot once it drains, and no other
    adapter may take that slot meanwhile."""
    llm = _one_slot(root)
    engine = llm.engine
    llm.register_adapter("x", root / "old", pinned=True)
    running = engine.add_request(PROMPT, GREEDY, "x")
    step_until_running(engine, running)
    version = engine.register_adapter("x", root / "new", reload=True)  # not refused
    assert version.pinned and engine.registry.held_slot("x") == 0
    after = engine.add_request(PROMPT, GREEDY, "x")
    llm.register_adapter("y", root / "old")
    other = engine.add_request(PROMPT, GREEDY, "y")  # may never take x's held slot
    done: dict = {}
    step_until(engine, lambda: engine.registry.slot_of("x") == 0, done)
    assert engine.lora.table.info(0).version == version.version
    done.update(run_until_done(engine))
    assert done[running].token_ids == refs["old"]  # in flight: finished on its version
    assert done[after].token_ids == refs["new"]
    assert engine.registry.pinned_slots() == {0} and engine.registry.get("x").pinned
    assert isinstance(done[other].error, AllSlotsPinnedError)
    engine.check_integrity()


def test_a_pinned_reload_with_nothing_in_flight_lands_without_a_request(root, refs):
    """Held for the new version while busy, the slot takes it as soon as it is idle, with
    no request for it needed."""
    llm = _one_slot(root)
    engine = llm.engine
    llm.register_adapter("x", root / "old", pinned=True)
    running = engine.add_request(PROMPT, GREEDY, "x")
    step_until_running(engine, running)
    version = engine.register_adapter("x", root / "new", reload=True)
    run_until_done(engine)
    step_until(engine, lambda: engine.registry.slot_of("x") == 0)
    assert engine.lora.table.info(0).version == version.version
    assert llm.generate([PROMPT], GREEDY, ["x"])[0].token_ids == refs["new"]
