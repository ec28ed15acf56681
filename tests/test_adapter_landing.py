"""Landed, scaled deltas read back through the pool views equal PEFT's own
scaling * B @ A for every module; untargeted modules read zero."""

from __future__ import annotations

import pytest
import torch

from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.pool.swap import LoraSlots
from tests.helpers.kernels import KERNELS
from tests.helpers.pool import land_disk
from tests.helpers.tiny_models import hf_config, make_adapter, make_model, peft_deltas

CASES = {
    "llama-subset-short": ("llama", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    "llama-patterns": ("llama", dict(
        r=4, lora_alpha=8, target_modules=list(LINEAR_MODULES),
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 3, "model.layers.2.self_attn.o_proj": 11},
    )),
    "qwen2-rslora-all-linear": ("qwen2", dict(r=8, lora_alpha=8, use_rslora=True,
                                              target_modules="all-linear")),
    "qwen3-layers-to-transform": ("qwen3", dict(
        r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj"],
        layers_to_transform=[0, 2], layers_pattern="layers",
    )),
    "llama-full-paths": ("llama", dict(
        r=5, lora_alpha=7, target_modules=["model.layers.1.self_attn.k_proj",
                                           "model.layers.0.mlp.up_proj"],
    )),
    "mistral-regex": ("mistral", dict(r=3, lora_alpha=9, target_modules=r".*\.(q|o|down)_proj")),
    "llama-exclude": ("llama", dict(r=4, lora_alpha=4, target_modules=["q_proj", "up_proj"],
                                    exclude_modules=["model.layers.1.mlp.up_proj"])),
}


def _slots(arch: str, dtype=torch.float32, max_rank: int = 8, max_loras: int = 3) -> LoraSlots:
    model_cfg = ModelConfig.from_hf_dict(hf_config(arch).to_dict())
    return LoraSlots(model_cfg, PoolConfig(max_loras, max_rank), "cpu", dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_landed_delta_equals_peft(case, tmp_path):
    arch, lora_kwargs = CASES[case]
    base = make_model(arch)
    peft_model = make_adapter(base, tmp_path / "a", seed=1, **lora_kwargs)
    expected = peft_deltas(peft_model)
    assert expected, "PEFT wrapped nothing: the case is broken"

    slots = _slots(arch)
    version = land_disk(slots, tmp_path / "a", 1)
    assert slots.table.holds(1, version)
    slots.table.check_integrity()
    cfg = slots.model_config
    checked = 0
    for layer in range(cfg.num_layers):
        for module in LINEAR_MODULES:
            path = cfg.module_path(layer, module)
            got = slots.pool.delta(1, layer, module)
            want = expected.get(path, torch.zeros_like(got))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=path)
            checked += path in expected
            # the other slots stay zero
            assert not slots.pool.delta(0, layer, module).any()
    assert checked == len(expected)


def test_bf16_pool_matches_peft(tmp_path):
    base = make_model("llama")
    peft_model = make_adapter(base, tmp_path / "a", seed=2, r=8, lora_alpha=32,
                              target_modules="all-linear")
    slots = _slots("llama", dtype=torch.bfloat16)
    land_disk(slots, tmp_path / "a", 0)
    for path, want in peft_deltas(peft_model).items():
        layer, module = int(path.split(".")[2]), path.rsplit(".", 1)[1]
        got = slots.pool.delta(0, layer, module)
        assert (got - want).norm() / want.norm() < 1e-2, path


def test_rank_and_scale_tables(tmp_path):
    base = make_model("llama")
    make_adapter(base, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"],
                 rank_pattern={"model.layers.1.self_attn.q_proj": 7})
    slots = _slots("llama")
    land_disk(slots, tmp_path / "a", 2)
    q = slots.pool.layout.module_index("q_proj")
    assert slots.pool.ranks[2, :, q].tolist() == [4, 7, 4]
    torch.testing.assert_close(slots.pool.scales[2, :, q], torch.tensor([2.0, 8 / 7, 2.0]))
    assert slots.pool.ranks[2].sum() == 15  # every other module untargeted


def test_bytes_finite_in_the_file_but_not_in_the_pool_dtype_fail_the_landing(tmp_path):
    """A float32 file with a value past float16's range, landed into a float16 pool with no
    check before (a registered file rewritten after its registration read it, which nothing
    bounds again): staging finds it finite, the conversion makes it Inf, and the landing's
    check of the written bytes fails the landing: the slot is EMPTY with a new uid, zeroed."""
    from safetensors.torch import load_file, save_file

    from metrale import errors
    from tests.helpers.tiny_models import write_lora

    path = write_lora(tmp_path / "big", r=4, target_modules=["q_proj", "v_proj"])
    tensors = load_file(path / "adapter_model.safetensors")
    key = sorted(tensors)[0]
    tensors[key][0, 0] = 1e38  # finite in float32, Inf in float16
    save_file(tensors, path / "adapter_model.safetensors")
    slots = _slots("llama", dtype=torch.float16)
    old = slots.table.info(1)
    with pytest.raises(errors.LandingError, match="now EMPTY") as info:
        land_disk(slots, path, 1)  # prepare_disk without verify: no scratch bound
    assert isinstance(info.value.__cause__, errors.NonFiniteWeightsError)
    assert "NaN or Inf in the pool's dtype" in str(info.value.__cause__)
    now = slots.table.info(1)
    assert now.state.value == "EMPTY" and now.uid != old.uid
    assert not slots.pool.slot_region(1).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nan_in_a_file_is_refused_by_the_staged_bytes_one_pass_on_cuda(tmp_path):
    """On CUDA a file of one dtype lands through its recipe, checked by one isfinite pass
    over the staged bytes (no other check sees a float32 file landing into a float32 pool):
    a NaN is refused, naming its tensor, before any slot is touched."""
    from safetensors.torch import load_file, save_file

    from metrale import errors
    from tests.helpers.tiny_models import write_lora

    good = write_lora(tmp_path / "good", r=4, target_modules=["q_proj", "v_proj"])
    bad = write_lora(tmp_path / "nan", r=4, target_modules=["q_proj", "v_proj"])
    tensors = load_file(bad / "adapter_model.safetensors")
    key = sorted(tensors)[-1]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors")
    model_cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    slots = LoraSlots(model_cfg, PoolConfig(3, 8), "cuda", torch.float32)
    land_disk(slots, good, 0)
    assert slots.recipes.get(slots.plan_from_disk(bad, "nan")) is not None  # the recipe path
    before, infos = slots.pool.buffer.clone(), slots.table.infos()
    with pytest.raises(errors.NonFiniteWeightsError, match=key.rsplit(".", 1)[0]):
        land_disk(slots, bad, 1)
    assert torch.equal(slots.pool.buffer, before) and slots.table.infos() == infos


@pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
def test_a_recipe_lands_into_its_slot_alone_as_the_tensors_do(tmp_path):
    """The landing's recipe path (one kernel over the staged bytes, offsets from the slot's
    own region; CUDA's, run here in Triton's interpreter) writes slot 1 exactly as the
    per-tensor path does, and not one element of the slots beside it."""
    from metrale.pool import landing
    from metrale.pool.recipe import build_recipe
    from metrale.pool.staged import StagedAdapter
    from metrale.pool.swap import read_adapter_data
    from tests.helpers.tiny_models import write_lora

    path = write_lora(tmp_path / "a", r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    want, got = _slots("llama"), _slots("llama")
    land_disk(want, path, 1)  # the per-tensor path (CPU)
    plan = got.plan_from_disk(path, "a")
    data = read_adapter_data(plan, got.staging)
    recipe = build_recipe(plan, got.pool.layout, torch.device("cpu"))
    got.pool.buffer.fill_(float("nan"))
    t = got.pool.slot_tensors[1]
    landing.zero_slot(t)
    landing.land_staged(t, got.pool.layout, StagedAdapter(plan, data, recipe, []))
    assert torch.equal(t.data, want.pool.slot_region(1))
    for other in (0, 2):
        assert got.pool.slot_region(other).isnan().all()
