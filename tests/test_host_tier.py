"""The fast disk path and the host tier: chunked parallel reads give the file's bytes,
the one-launch landing kernel equals the per-tensor copies, and a landing from the host
tier equals a landing from disk (bytes, ranks, scales) while every refusal still refuses.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import errors
from metrale.adapters.plan import plan_adapter
from metrale.config import ModelConfig, PoolConfig
from metrale.pool import staging
from metrale.pool.staged import stage_views
from metrale.pool.swap import LoraSlots, read_adapter_data
from tests.helpers.engine import tiny_engine
from tests.helpers.kernels import KERNELS
from tests.helpers.pool import land_disk, snapshot
from tests.helpers.tiny_models import hf_config, make_adapter, make_model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    base = make_model("llama")
    make_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    make_adapter(base, root / "b", seed=2, r=6, lora_alpha=3, target_modules=["q_proj", "down_proj"],
                 rank_pattern={"model.layers.1.mlp.down_proj": 2})
    make_adapter(base, root / "c", seed=3, r=8, lora_alpha=16, target_modules=["v_proj"])
    return root


def _slots(dtype=torch.float32, tier_slots: float = 8, **kw) -> LoraSlots:
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    probe = LoraSlots(cfg, PoolConfig(1, 8), "cpu", dtype)
    tier = int(tier_slots * probe.pool.layout.slot_bytes)
    return LoraSlots(cfg, PoolConfig(max_loras=3, max_lora_rank=8, host_tier_bytes=tier, **kw),
                     "cpu", dtype)


def _engine(model_dir, tier_slots: float = 8):
    """An engine whose pool is _slots(tier_slots=...)'s."""
    tier = int(tier_slots * _slots(tier_slots=0).pool.layout.slot_bytes)
    return tiny_engine(model_dir, host_tier_bytes=tier)


def _state(engine) -> tuple:
    """The pool (bytes, slot identities) and the registry's versions and routes."""
    registry = engine.registry
    return snapshot(engine.lora), registry.routes(), [registry.get(n) for n in registry.names()]


def _slot_state(slots, slot):
    p = slots.pool
    return p.slot_region(slot).clone(), p.ranks[slot].clone(), p.scales[slot].clone()


def _same(x, y):
    return all(torch.equal(a, b) for a, b in zip(x, y))


def test_chunked_parallel_read_equals_file(adapters, monkeypatch):
    monkeypatch.setattr(staging, "CHUNK", 1000)  # many chunks through the thread pool
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    plan = plan_adapter(adapters / "a", "a", cfg, PoolConfig(2, 8))
    out = read_adapter_data(plan, staging.StagingBuffers(torch.device("cpu")))
    raw = (adapters / "a" / "adapter_model.safetensors").read_bytes()
    assert out.numpy().tobytes() == raw[plan.data_offset:]


def test_truncated_between_plan_and_read_is_refused(adapters, tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "CHUNK", 1000)
    shutil.copytree(adapters / "a", tmp_path / "a")
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    plan = plan_adapter(tmp_path / "a", "a", cfg, PoolConfig(2, 8))
    path = tmp_path / "a" / "adapter_model.safetensors"
    os.truncate(path, path.stat().st_size - 1500)
    with pytest.raises(errors.AdapterFileError, match="truncated"):
        read_adapter_data(plan, staging.StagingBuffers(torch.device("cpu")))


@pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["views", "recipe"])
def test_landing_kernel_equals_per_tensor_copies(adapters, dtype, how):
    """The one-launch landing (from typed views, or from a plan's precomputed recipe)
    writes what per-tensor copies write."""
    from metrale.ops.landing_triton import base_of, land_rows, land_views
    from metrale.pool.recipe import build_recipe

    slots = _slots(dtype, tier_slots=0)
    for name, slot in (("a", 0), ("b", 2)):
        land_disk(slots, adapters / name, slot)  # per-tensor path on CPU
        plan = plan_adapter(adapters / name, name, slots.model_config, slots.pool_config)
        data = read_adapter_data(plan, staging.StagingBuffers(torch.device("cpu")))
        pool, layout = slots.pool, slots.pool.layout
        n = layout.slot_elems
        got = torch.full_like(pool.buffer, float("nan"))
        got[slot * n:(slot + 1) * n] = 0  # a zeroed slot
        if how == "recipe":
            recipe = build_recipe(plan, layout, torch.device("cpu"))
            land_rows(got[slot * n:], data.view(recipe.dtype), recipe.desc, recipe.tiles)
        else:
            views = stage_views(plan, data)
            items = []
            for landing, view in zip(plan.landings, views):
                t = landing.target
                region = layout.region(t.layer, t.module, landing.kind)
                items.append((view, slot * n + region.offset, t.rank, region.cols,
                              landing.kind == "B", region.cols))
            land_views(got, base_of(views), items)
        assert got[:slot * n].isnan().all() and got[(slot + 1) * n:].isnan().all()
        region = got[slot * n:(slot + 1) * n]
        if dtype == torch.float32:
            assert torch.equal(region, pool.slot_region(slot))
        else:  # the interpreter truncates fp32 -> bf16 (compiled code rounds: gpu test below)
            torch.testing.assert_close(region, pool.slot_region(slot), rtol=2 ** -7, atol=0)


@pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
def test_recipe_of_bt_staged_bytes_lands_like_a_file(adapters):
    """A peer's HTTP bytes carry each B as the pool's Bt ([r, out]): a recipe built with
    staged_bt lands them exactly where a disk landing of the same adapter puts PEFT's
    [out, r] B (and the recipe without it would not: the test can tell)."""
    from metrale.ops.landing_triton import land_rows
    from metrale.pool.recipe import build_recipe

    slots = _slots(torch.float32, tier_slots=0)
    land_disk(slots, adapters / "a", 1)
    plan = plan_adapter(adapters / "a", "a", slots.model_config, slots.pool_config)
    data = read_adapter_data(plan, staging.StagingBuffers(torch.device("cpu")))
    peer = data.clone()  # the same tensors at the same offsets, B as [r, out]
    for landing, view in zip(plan.landings, stage_views(plan, data)):
        if landing.kind == "B":
            begin = plan.staged_begin(landing.entry)
            raw = view.t().contiguous().view(torch.uint8).reshape(-1)  # [r, out] bytes
            peer[begin:begin + raw.numel()] = raw
    layout, n = slots.pool.layout, slots.pool.layout.slot_elems
    landed = {}
    for staged_bt in (True, False):
        got = torch.zeros(n)
        recipe = build_recipe(plan, layout, torch.device("cpu"), staged_bt=staged_bt)
        land_rows(got, peer.view(recipe.dtype), recipe.desc, recipe.tiles)
        landed[staged_bt] = got
    assert torch.equal(landed[True], slots.pool.slot_region(1))
    assert not torch.equal(landed[False], slots.pool.slot_region(1))


def test_recipe_tables_match_the_plan(adapters):
    """A recipe's rank/scale/DoRA rows are the plan's, and it is refused (None) for
    staged tensors of mixed dtypes."""
    import dataclasses

    from metrale.pool.recipe import build_recipe, table_rows

    slots = _slots(torch.float32, tier_slots=0)
    plan = plan_adapter(adapters / "a", "a", slots.model_config, slots.pool_config)
    recipe = build_recipe(plan, slots.pool.layout, torch.device("cpu"))
    for got, want in zip(recipe.tables, table_rows(plan, slots.pool.layout)):
        assert torch.equal(got, want)
    assert int((recipe.ranks > 0).sum()) == len(plan.targets)
    first = plan.landings[0]
    other = torch.float16 if first.entry.torch_dtype != torch.float16 else torch.float32
    odd_entry = dataclasses.replace(first.entry, dtype={torch.float16: "F16", torch.float32: "F32"}[other])
    odd = dataclasses.replace(plan, landings=(dataclasses.replace(first, entry=odd_entry),
                                              *plan.landings[1:]))
    assert build_recipe(odd, slots.pool.layout, torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", [0, 1 << 30])
def test_gpu_mapped_files_land_current_bytes(adapters, tmp_path, mapped):
    """Landings through registered file mappings (and without) equal the CPU copies,
    also after the file is replaced (a new inode: a new mapping) and after one is
    evicted for room; a refused NaN file leaves the slot untouched either way."""
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    size = (adapters / "a" / "adapter_model.safetensors").stat().st_size
    pc = PoolConfig(max_loras=3, max_lora_rank=8, mapped_file_bytes=mapped and size + 16)
    gpu, cpu = LoraSlots(cfg, pc, "cuda", torch.bfloat16), LoraSlots(cfg, pc, "cpu", torch.bfloat16)
    shutil.copytree(adapters / "a", tmp_path / "x")
    for source, slot in ((adapters / "a", 0), (tmp_path / "x", 1), (adapters / "a", 0)):
        version = land_disk(gpu, source, slot)
        land_disk(cpu, source, slot)
    shutil.copytree(adapters / "c", tmp_path / "y")
    os.replace(tmp_path / "y" / "adapter_model.safetensors",
               tmp_path / "x" / "adapter_model.safetensors")
    shutil.copy(tmp_path / "y" / "adapter_config.json", tmp_path / "x" / "adapter_config.json")
    files = gpu.mapped_files
    assert files.registrations == (1 if mapped else 0)  # a file is mapped at its 2nd landing
    for _ in range(2):  # read, then mapped (evicting a's mapping: room for one file)
        land_disk(gpu, tmp_path / "x", 2)
        land_disk(cpu, tmp_path / "x", 2)
    for t_gpu, t_cpu in ((gpu.pool.buffer, cpu.pool.buffer), (gpu.pool.ranks, cpu.pool.ranks),
                         (gpu.pool.scales, cpu.pool.scales)):
        assert torch.equal(t_gpu.cpu(), t_cpu)
    assert len(files) == (1 if mapped else 0) and files.hits == 0
    assert files.registrations == (2 if mapped else 0)
    bad = tmp_path / "bad"
    shutil.copytree(adapters / "a", bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    first = next(iter(tensors))
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    before = gpu.pool.slot_region(0).clone()
    with pytest.raises(errors.NonFiniteWeightsError):
        land_disk(gpu, bad, 0)
    assert torch.equal(gpu.pool.slot_region(0), before) and gpu.table.info(0).version == version


@pytest.mark.gpu
def test_gpu_landing_kernel_is_exact(adapters):
    """On CUDA, pool.land runs the one-launch kernel: bit-identical to the CPU copies
    (fp32 file -> bf16 pool, rounding included), staged through the chunked reader."""
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    pc = PoolConfig(max_loras=3, max_lora_rank=8)
    gpu = LoraSlots(cfg, pc, "cuda", torch.bfloat16)
    cpu = LoraSlots(cfg, pc, "cpu", torch.bfloat16)
    for name, slot in (("a", 0), ("b", 2)):
        land_disk(gpu, adapters / name, slot)
        land_disk(cpu, adapters / name, slot)
    for t_gpu, t_cpu in ((gpu.pool.buffer, cpu.pool.buffer), (gpu.pool.ranks, cpu.pool.ranks),
                         (gpu.pool.scales, cpu.pool.scales)):
        assert torch.equal(t_gpu.cpu(), t_cpu)
    # the host tier on CUDA: pinned images filled on a side stream, landed by one copy
    tiered = LoraSlots(cfg, PoolConfig(3, 8, host_tier_bytes=1 << 30), "cuda", torch.bfloat16)
    land_disk(tiered, adapters / "b", 0)
    land_disk(tiered, adapters / "a", 0)  # overwrites slot 0 after the fill
    land_disk(tiered, adapters / "b", 1)  # hit
    assert tiered.host_tier.hits == 1
    for slot_t, slot_c in ((0, 0), (1, 2)):
        for kind in ("slot_region", "ranks", "scales"):
            got = getattr(tiered.pool, kind)
            want = getattr(cpu.pool, kind)
            got = got(slot_t) if callable(got) else got[slot_t]
            want = want(slot_c) if callable(want) else want[slot_c]
            assert torch.equal(got.cpu(), want), (slot_t, kind)


def test_tier_landing_equals_disk_landing(adapters, tiny_model_dir):
    """An engine's swaps and promotions land from the tier what a disk landing writes."""
    disk = _slots(tier_slots=0)
    engine = _engine(tiny_model_dir)
    tiered = engine.lora
    assert disk.host_tier is None and tiered.host_tier.enabled
    land_disk(disk, adapters / "b", 2)
    engine.swap_lora_slot_from_disk(adapters / "b", "b", 0)  # miss: lands from disk, fills
    assert (tiered.host_tier.misses, tiered.host_tier.hits, len(tiered.host_tier)) == (1, 0, 1)
    assert engine.unload_adapter("b") == "unloaded"
    engine.swap_lora_slot_from_disk(adapters / "a", "a", 2)  # slot 2 held something else
    assert engine.unload_adapter("a") == "unloaded"
    engine.swap_lora_slot_from_disk(adapters / "b", "b", 2)  # hit: one copy of the image
    assert tiered.host_tier.hits == 1
    assert _same(_slot_state(tiered, 2), _slot_state(disk, 2))
    info = tiered.table.info(2)
    assert info.version == engine.registry.current("b").version and info.state.value == "READY"
    assert engine.registry.slot_of("b") == 2
    engine.check_integrity()
    slot, evicted = engine.promote_lora_slot_from_disk(adapters / "a", "a")  # hit via promote
    assert tiered.host_tier.hits == 2 and evicted is None
    land_disk(disk, adapters / "a", 0)
    assert _same(_slot_state(tiered, slot), _slot_state(disk, 0))


def test_files_of_one_layout_share_a_plan_and_land_their_own_bytes(adapters, tmp_path):
    """Two adapters saved with one config and header layout share one plan (its tensors
    and targets) under their own names and paths, and each lands its own values; an
    adapter of another layout plans afresh."""
    values = load_file(adapters / "a" / "adapter_model.safetensors")
    for d, factor in (("x", 1), ("y", 3)):
        shutil.copytree(adapters / "a", tmp_path / d)
        save_file({k: v * factor for k, v in values.items()},
                  tmp_path / d / "adapter_model.safetensors", metadata={"format": "pt"})
    slots, fresh = _slots(tier_slots=0), _slots(tier_slots=0)
    land_disk(slots, tmp_path / "x", 0)
    land_disk(slots, tmp_path / "y", 1)
    px, py = slots.plan_from_disk(tmp_path / "x", "x"), slots.plan_from_disk(tmp_path / "y", "y")
    assert py.landings is px.landings and py.targets is px.targets
    assert (py.name, py.source) == ("y", str(tmp_path / "y" / "adapter_model.safetensors"))
    land_disk(fresh, tmp_path / "y", 1)  # its own plan from scratch
    assert _same(_slot_state(slots, 1), _slot_state(fresh, 1))
    assert not torch.equal(_slot_state(slots, 0)[0], _slot_state(slots, 1)[0])
    pb = slots.plan_from_disk(adapters / "b", "b")
    assert pb.landings is not px.landings


@pytest.mark.parametrize("tier_slots", [8, 0])
def test_changed_file_is_a_miss_and_lands_new_contents(adapters, tmp_path, tier_slots):
    """Neither the host tier nor the remembered plan serves an edited file's old version."""
    shutil.copytree(adapters / "a", tmp_path / "a")
    slots = _slots(tier_slots=tier_slots)
    land_disk(slots, tmp_path / "a", 0)
    old = _slot_state(slots, 0)
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = {k: v * 2 for k, v in load_file(path).items()}
    time.sleep(0.01)
    save_file(tensors, path, metadata={"format": "pt"})
    land_disk(slots, tmp_path / "a", 1)
    if tier_slots:
        assert slots.host_tier.hits == 0 and len(slots.host_tier) == 1  # old version dropped
    new = _slot_state(slots, 1)
    assert not torch.equal(new[0], old[0]) and torch.equal(new[0], old[0] * 2)
    # a different rank under the same path: a new plan, not the remembered one
    time.sleep(0.01)
    shutil.rmtree(tmp_path / "a")
    shutil.copytree(adapters / "c", tmp_path / "a")
    land_disk(slots, tmp_path / "a", 2)
    fresh = _slots(tier_slots=0)
    land_disk(fresh, adapters / "c", 2)
    assert _same(_slot_state(slots, 2), _slot_state(fresh, 2))


def test_refusals_untouched_by_the_tier(adapters, tmp_path, tiny_model_dir):
    shutil.copytree(adapters / "a", tmp_path / "a")
    engine = _engine(tiny_model_dir)
    slots = engine.lora
    engine.swap_lora_slot_from_disk(tmp_path / "a", "a", 0)  # now in the tier
    slots.table.acquire(0)  # a sequence decodes on "a"
    before = _state(engine)
    with pytest.raises(errors.SlotBusyError):  # busy slot: refused before the tier is asked
        engine.swap_lora_slot_from_disk(tmp_path / "a", "a", 0)
    with pytest.raises(errors.InvalidNameError):
        engine.swap_lora_slot_from_disk(tmp_path / "a", "../x", 1)
    assert _state(engine) == before and slots.host_tier.hits == 0
    # the file turns bad: its key changes, the disk path runs and refuses
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(path)
    next(iter(tensors.values()))[0, 0] = float("nan")
    time.sleep(0.01)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(errors.NonFiniteWeightsError):
        engine.swap_lora_slot_from_disk(tmp_path / "a", "a", 1)
    assert _state(engine) == before
    shutil.rmtree(tmp_path / "a")  # gone: stat fails, the disk path reports it
    with pytest.raises(errors.AdapterConfigError):
        engine.swap_lora_slot_from_disk(tmp_path / "a", "a", 1)
    assert _state(engine) == before


def test_lru_eviction_and_capacity(adapters):
    slots = _slots(tier_slots=2.5)  # room for two images
    for i, name in enumerate("abc"):
        land_disk(slots, adapters / name, i)
    assert len(slots.host_tier) == 2  # "a" was the least recently used
    for i in range(3):
        slots.unload_slot(i)
    land_disk(slots, adapters / "a", 0)
    land_disk(slots, adapters / "c", 1)
    assert slots.host_tier.hits == 1 and slots.host_tier.misses == 4
    assert not _slots(tier_slots=0.5).host_tier.enabled  # smaller than one slot: off
