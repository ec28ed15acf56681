"""Phi-3: q/k/v and gate/up fused in the checkpoint and in its adapters (PEFT wraps
qkv_proj and gate_up_proj: one lora_A, lora_B's rows split across the parts). Greedy
tokens equal transformers + PEFT for the base and three adapters mixed in one batch
(fused and unfused targets, a rank pattern on a fused module, DoRA)."""

from __future__ import annotations

import pytest

from metrale import LLM
from metrale.config import ConfigError, ModelConfig
from tests.helpers.reference import assert_mixed_batch_matches
from tests.helpers.tiny_models import make_adapter, make_model, save_model

PROMPTS = [[5, 17, 99, 3, 42, 8, 120], [61, 2, 9, 13, 200, 7, 1, 4]]
GEN = 8


def test_phi3_with_fused_adapters_equals_transformers_peft(tmp_path):
    base = make_model("phi3", seed=31)
    save_model(base, tmp_path / "model")
    assert ModelConfig.from_dir(tmp_path / "model").fused_peft_modules
    specs = {
        "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "qkv": dict(r=4, lora_alpha=16, target_modules=["qkv_proj", "down_proj"],
                    rank_pattern={"layers.1.self_attn.qkv_proj": 2}),
        "dora": dict(r=4, lora_alpha=8, target_modules=["gate_up_proj", "o_proj"], use_dora=True),
    }
    adapters = {name: (make_adapter(base, tmp_path / name, seed=i + 3, **spec), tmp_path / name)
                for i, (name, spec) in enumerate(specs.items())}
    assert_mixed_batch_matches(tmp_path / "model", base, adapters, PROMPTS, GEN)


def test_phi3_partial_rotary_is_refused(tmp_path):
    base = make_model("phi3", seed=31, partial_rotary_factor=0.5)
    save_model(base, tmp_path / "model")
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        LLM(tmp_path / "model", max_loras=0, max_model_len=64, block_size=4, num_kv_blocks=16)
